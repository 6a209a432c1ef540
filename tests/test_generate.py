"""The generate loop on the builder's fixtures, against a loop driving onnxruntime."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxpack.cli import main
from onnxpack.generate import GenAIConfig, Generator, SearchOptions, sample_token
from onnxpack.session.kernels import quant

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "models" / "fixtures" / "llm"
PROMPT = [3, 17, 42, 7, 99, 5]


def _ort_greedy(folder: pathlib.Path, prompt, n, tmp_path) -> list[int]:
    """A plain onnxruntime loop (growing cache, no IOBinding): the oracle.  MatMulNBits compute as
    onnxpack's do here, so int4 logits agree to float rounding: with the builder's accuracy_level
    4 (A rounded to int8 per block) where onnxpack's int8 GEMV runs (a JIT path on a CPU with
    AVX-512 VNNI; every call here has at most 16 rows), else with accuracy_level 0 (float A)."""
    cfg = GenAIConfig.load(folder)
    model = onnx.load(folder / cfg.filename)
    int8 = quant.jit_enabled() and bool(getattr(quant._jit(), "int8_dot", False))
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "MatMulNBits" and a.name == "accuracy_level" and not (int8 and a.i == 4):
                a.i = 0
    path = tmp_path / "oracle.onnx"
    onnx.save(model, path, save_as_external_data=True, location="oracle.data")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    dtype = np.float16 if "float16" in sess.get_inputs()[2].type else np.float32
    # a sliding-window layer's cache: window_size rows (genai_config's "sliding_window"), zero at first
    rows = {i: cfg.window_size if i in cfg.sliding_layers else 0 for i in range(cfg.layers)}
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    attention = [i for i in range(cfg.layers) if cfg.past_key % i in shapes]
    past = {cfg.past_key % i: np.zeros((1, cfg.kv_heads, rows[i], cfg.head_size), dtype) for i in attention}
    past |= {cfg.past_value % i: np.zeros((1, cfg.kv_heads, rows[i], cfg.head_size), dtype) for i in attention}
    # LFM2's and Qwen3.5's convolution states (1, channels, K - 1), Qwen3.5's recurrent states:
    # zero at first, each layer's that the model has
    states = [(p % i, q % i) for p, q in ((cfg.past_conv, cfg.present_conv), (cfg.past_recurrent, cfg.present_recurrent))
              if p for i in range(cfg.layers) if p % i in shapes]
    past |= {p: np.zeros((1, *shapes[p][1:]), dtype) for p, _ in states}
    ids, out, length = list(prompt), [], 0
    declared = {i.name for i in sess.get_inputs()}
    for _ in range(n):
        feed = {cfg.input_ids: np.array([ids], np.int64), **past}
        if cfg.attention_mask in declared:
            feed[cfg.attention_mask] = np.ones((1, length + len(ids)), np.int64)
        if cfg.position_ids and cfg.position_ids in declared:
            pos = np.arange(length, length + len(ids), dtype=np.int64)[None]
            feed[cfg.position_ids] = np.stack([pos] * 3) if len(shapes[cfg.position_ids]) == 3 else pos
        res = dict(zip(names, sess.run(None, feed)))
        length += len(ids)
        for i in attention:
            past[cfg.past_key % i] = res[cfg.present_key % i]
            past[cfg.past_value % i] = res[cfg.present_value % i]
        for p, q in states:
            past[p] = res[q]
        tok = int(np.argmax(res[cfg.logits][0, -1]))
        out.append(tok)
        ids = [tok]
    return out


@pytest.mark.parametrize("fixture", ["qwen2-fp32", "llama-fp32", "qwen2-int4", "llama-int4", "phi3-int4", "gemma2-int4",
                                     "qwen3-int4", "granite-int4", "lfm2-int4", "gpt-oss-int4", "lfm2-moe-int4",
                                     "qwen3.5-moe-int4"])
def test_greedy_tokens_equal_an_onnxruntime_loop(fixture, tmp_path):
    """gemma2-int4 and gpt-oss-int4 generate past their 32-token sliding window (local layer 0)."""
    folder = FIXTURES / fixture
    n = 40 if fixture.startswith(("gemma2", "gpt-oss")) else 10
    want = _ort_greedy(folder, PROMPT, n, tmp_path)
    with Generator(folder) as gen:
        got = list(gen.generate(PROMPT, max_new_tokens=n, stop=()))
    # eos may stop us early; the tokens before it are the oracle's.
    assert got == want[: len(got)] and (len(got) == n or got[-1] in gen.config.eos), (got, want)


def test_config_fields_from_the_builder():
    cfg = GenAIConfig.load(FIXTURES / "qwen2-int4")
    assert cfg.layers == 2 and cfg.kv_heads >= 1 and cfg.head_size > 0
    assert cfg.past_key % 1 == "past_key_values.1.key" and cfg.present_value % 0 == "present.0.value"
    assert cfg.share_buffer and cfg.eos
    assert cfg.sliding_layers == frozenset() and cfg.window_size == 0
    gemma = GenAIConfig.load(FIXTURES / "gemma2-int4")  # local attention in layer 0, window 32
    assert gemma.sliding_layers == {0} and gemma.window_size == 32


def test_generation_stops_at_max_length_and_rejects_too_long_prompts():
    with Generator(FIXTURES / "llama-fp32", max_length=len(PROMPT) + 3) as gen:
        assert len(list(gen.generate(PROMPT, stop=()))) <= 3
        with pytest.raises(Exception, match="max_length"):
            list(gen.generate(list(range(len(PROMPT) + 3))))


def test_sampling_filters():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 5.0, 4.9, -3.0, 1.0])
    assert sample_token(logits, SearchOptions(), rng) == 1
    top2 = SearchOptions(do_sample=True, top_k=2)
    assert {sample_token(logits, top2, rng) for _ in range(200)} == {1, 2}
    nucleus = SearchOptions(do_sample=True, top_p=0.5)
    assert {sample_token(logits, nucleus, rng) for _ in range(200)} == {1}
    hot = SearchOptions(do_sample=True, temperature=100.0)
    seen = {sample_token(logits, hot, rng) for _ in range(400)}
    assert seen == {0, 1, 2, 3, 4}
    a = [sample_token(logits, hot, np.random.default_rng(7)) for _ in range(5)]
    b = [sample_token(logits, hot, np.random.default_rng(7)) for _ in range(5)]
    assert a == b
    with pytest.raises(Exception):
        SearchOptions(top_p=0.0).check()


def test_cli_generate_with_ids(capsys):
    assert main(["generate", str(FIXTURES / "qwen2-fp32"), "--ids", ",".join(map(str, PROMPT)),
                 "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) >= 1
    assert "tokens/s" in captured.err and "time to first token" in captured.err


def test_cli_generate_with_text(capsys):
    pytest.importorskip("tokenizers")
    assert main(["generate", str(FIXTURES / "qwen2-fp32"), "--prompt", "hello", "--max-new-tokens", "3"]) == 0
    assert "generated" in capsys.readouterr().err


def test_kv_cache_buffers_are_reused_and_updated_in_place():
    from onnxpack.generate import _Cache

    with Generator(FIXTURES / "qwen2-int4") as gen:
        assert gen.shared
        cache = _Cache(gen, 16)
        ids = {name: buf.ctypes.data for name, buf in cache.past.items()}
        objs = dict(cache.past)
        cache.step(PROMPT)
        for _ in range(3):
            cache.step([5])
        assert {name: buf.ctypes.data for name, buf in cache.past.items()} == ids
        assert all(cache.past[n] is objs[n] for n in objs)
        total = len(PROMPT) + 3
        for buf in cache.past.values():
            assert np.abs(buf[:, :, :total]).sum(axis=-1).all()  # every written row holds a key/value
        # Each decode step wrote its row into the bound buffer itself: run one more step with a
        # sentinel in the next row and check the step replaced it.
        for buf in cache.past.values():
            buf[:, :, total] = np.nan
        cache.step([6])
        for buf in cache.past.values():
            assert np.isfinite(buf[:, :, total]).all()


def test_decode_steps_write_the_bound_cache_in_place_without_copying(monkeypatch):
    """From the second step of a shape on, each GroupQueryAttention writes only its new rows
    into the bound buffer (run_into with the buffers): no step recomputes a whole present cache
    (run) and no bound output is copied after the run."""
    from onnxpack.generate import _Cache
    from onnxpack.session import _iobinding
    from onnxpack.session.kernels.attention import GroupQueryAttention

    calls = {"run": 0, "run_into": 0, "copyto": 0}
    run, run_into, copyto = GroupQueryAttention.run, GroupQueryAttention.run_into, np.copyto

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(GroupQueryAttention, "run", counted("run", run))
    monkeypatch.setattr(GroupQueryAttention, "run_into", counted("run_into", run_into))
    monkeypatch.setattr(_iobinding.np, "copyto", counted("copyto", copyto))
    with Generator(FIXTURES / "qwen2-fp32") as gen:
        layers = gen.config.layers
        cache = _Cache(gen, 24)
        first = cache.step(PROMPT)
        cache.step([5])  # the first decode step learns the shapes
        calls.update(run=0, run_into=0, copyto=0)
        for tok in (6, 7):
            cache.step([tok])
        assert calls == {"run": 0, "run_into": 2 * layers, "copyto": 0}, calls
        # and the values are the copying path's: a fresh unbound session on the same ids
        with Generator(FIXTURES / "qwen2-fp32") as plain:
            plain.shared = False
            ref = _Cache(plain, 24)
            assert np.array_equal(ref.step(PROMPT), first)
            for tok in (5, 6, 7):
                ref.step([tok])
            np.testing.assert_allclose(ref.step([8]), cache.step([8]), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("fixture", ["qwen2-int4", "llama-fp32", "phi3-int4"])
def test_decode_repeats_equal_the_full_paths(fixture, native_cache, monkeypatch):
    """From a shape's second decoding step on, MatMulNBits, the gated MLP's paired GEMVs,
    SkipSimplifiedLayerNormalization and GroupQueryAttention repeat what their full paths chose
    for that shape (``_repeat``, native kernels): the logits of every step are bit-identical to
    the full paths' (``_repeat`` off), and each of the four repeats really runs."""
    from onnxpack.generate import _Cache
    from onnxpack.session.kernels import _act, attention, contrib_norm

    monkeypatch.delenv("ONNXPACK_DISABLE_JIT", raising=False)
    monkeypatch.delenv("ONNXPACK_DISABLE_NATIVE", raising=False)
    # Every GEMV on the team (the fixtures' layers are below the serial cut), and no stall turning
    # it off midway: the paired GEMVs run in both configurations alike.
    monkeypatch.setattr(quant, "JIT_SERIAL_BELOW", 0)
    monkeypatch.setattr(quant._StallGuard, "parallel_allowed", lambda self, now: True)
    classes = (quant.MatMulNBits, quant.GatedMatMulNBits, contrib_norm._SkipNorm, attention.GroupQueryAttention)
    taken = {cls: 0 for cls in classes}

    def counting(cls):
        real = cls._repeat

        def repeat(self, *a, **k):
            got = real(self, *a, **k)
            taken[cls] += got is not None
            return got
        return repeat

    def logits(repeat: bool) -> list[np.ndarray]:
        with monkeypatch.context() as mp:
            mp.setattr(_act, "_native_kernels", [])
            for cls in classes:
                mp.setattr(cls, "_repeat", counting(cls) if repeat else (lambda self, *a, **k: None))
            assert getattr(_act.act_kernels(), "native", False)
            with Generator(FIXTURES / fixture) as gen:
                assert gen.shared
                cache = _Cache(gen, 24)
                out = [cache.step(PROMPT).copy()]
                for tok in (5, 6, 7, 8, 9):
                    out.append(cache.step([tok]).copy())
        return out

    full = logits(False)
    fast = logits(True)
    for a, b in zip(full, fast):
        np.testing.assert_array_equal(a, b)
    nbits = any(n.op_type == "MatMulNBits"
                for n in onnx.load(FIXTURES / fixture / "model.onnx", load_external_data=False).graph.node)
    want = [quant.MatMulNBits, quant.GatedMatMulNBits] if nbits else []
    want += [contrib_norm._SkipNorm, attention.GroupQueryAttention]
    assert all(taken[cls] > 0 for cls in want), taken
