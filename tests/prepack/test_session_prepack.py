"""Pre-packing through InferenceSession: packed == unpacked, containers, sharing, release.

Oracles: the same session with ``session.disable_prepacking=1`` (the kernels' unpacked path),
onnxruntime (single-node models, the independent reference for every pre-packing op) and
onnx.reference (sample models), plus counts read back from ``get_prepack_stats`` /
``get_prepack_log`` / ``len(container)`` and, for the release of originals, the kernel's own
accounting of resident pages in ``/proc/self/smaps``.

Tolerances (stated once, per output dtype):

* packed vs unpacked — the same arithmetic in a different memory layout, so only the BLAS
  summation order may differ: float32 ``rtol=atol=1e-5``; float16 outputs are rounded from a
  float32 result, so one float16 ulp: ``rtol=atol=1e-3``.
* onnxpack vs onnxruntime / onnx.reference — different kernels altogether: float32
  ``rtol=atol=1e-4``; float16 ``rtol=atol=2e-2`` (onnxruntime may accumulate in float16).
"""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxpack
import onnxpack_sample_models as sample_models  # models/build.py, via tests/conftest.py
from onnxpack import InferenceSession, PrepackedWeightsContainer, SessionOptions


PACKED_VS_UNPACKED = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float16: dict(rtol=1e-3, atol=1e-3)}
VS_ORACLE = {np.float32: dict(rtol=1e-4, atol=1e-4), np.float16: dict(rtol=2e-2, atol=2e-2)}


def _tol(table, arr):
    return table[np.float16] if arr.dtype == np.float16 else table[np.float32]


def _options(**config) -> SessionOptions:
    so = SessionOptions()
    for k, v in config.items():
        so.add_session_config_entry(k, str(v))
    return so


def _unpacked() -> SessionOptions:
    return _options(**{"session.disable_prepacking": 1})


def _assert_close(got, want, table, what):
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{what}: output {k} shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), err_msg=f"{what}: output {k}",
                                   **_tol(table, w))


# -- sample models -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    return sample_models.build_all(str(tmp_path_factory.mktemp("samples")))


@pytest.mark.parametrize("name", sorted(sample_models.SAMPLES))
def test_sample_model_packed_equals_unpacked(samples, name):
    path = samples[name]
    feeds = sample_models.sample_inputs(name)
    with InferenceSession(path) as packed, InferenceSession(path, _unpacked()) as plain:
        got = packed.run(None, feeds)
        want = plain.run(None, feeds)
        stats_p, stats_u = packed.get_prepack_stats(), plain.get_prepack_stats()
    _assert_close(got, want, PACKED_VS_UNPACKED, f"{name} packed vs unpacked")
    assert stats_p["weights_packed"] >= 1, f"{name}: nothing was packed"
    assert stats_u["weights_packed"] == 0 and stats_u["bytes_held"] == 0
    # Independent oracle: onnx.reference on the same file.
    ref = ReferenceEvaluator(path).run(None, feeds)
    _assert_close(got, ref, VS_ORACLE, f"{name} vs onnx.reference")


# -- one node per pre-packing op --------------------------------------------------------------------
def _rng(seed):
    return np.random.default_rng(seed)


def _model(node, inputs, consts, outputs, *, domain="", opset=17):
    graph = helper.make_graph(
        [node], "single",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in inputs],
        [helper.make_tensor_value_info(o, elem, shape) for o, elem, shape in outputs],
        [numpy_helper.from_array(a, n) for n, a in consts if a is not None])
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    m = helper.make_model(graph, opset_imports=opsets)
    m.ir_version = 9
    return m.SerializeToString()


def _case(op, inputs, consts, outputs, attrs=None, *, domain="", opset=17, order=None):
    """(model bytes, feeds); ``order`` lists the node's input names ("" = omitted)."""
    names = order if order is not None else [n for n, _ in inputs] + [n for n, _ in consts]
    node = helper.make_node(op, names, [o for o, _, _ in outputs], domain=domain or None, **(attrs or {}))
    return _model(node, inputs, consts, outputs, domain=domain, opset=opset), dict(inputs)


F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _matmul(dtype, a_shape, k, n):
    r = _rng(1)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    a = r.standard_normal(a_shape).astype(dtype)
    b = (r.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    return _case("MatMul", [("A", a)], [("B", b)], [("Y", elem, list(a_shape[:-1]) + [n])])


def _gemm(dtype, trans_a, trans_b, alpha, beta, with_c=True):
    r = _rng(2)
    m, k, n = 5, 12, 7
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    a = r.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = r.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    consts = [("B", b)] + ([("C", r.standard_normal((n,)).astype(dtype))] if with_c else [])
    return _case("Gemm", [("A", a)], consts, [("Y", elem, [m, n])],
                 dict(transA=trans_a, transB=trans_b, alpha=alpha, beta=beta))


def _conv(group=1, dilations=(1, 1), pads=(0, 0, 0, 0), strides=(1, 1), bias=True, dtype=np.float32):
    r = _rng(3)
    c, m, kh, kw = 4, 6, 3, 3
    x = r.standard_normal((2, c, 9, 8)).astype(dtype)
    w = (0.3 * r.standard_normal((m, c // group, kh, kw))).astype(dtype)
    consts = [("W", w)] + ([("B", r.standard_normal(m).astype(dtype))] if bias else [])
    eh = (kh - 1) * dilations[0] + 1
    ew = (kw - 1) * dilations[1] + 1
    oh = (9 + pads[0] + pads[2] - eh) // strides[0] + 1
    ow = (8 + pads[1] + pads[3] - ew) // strides[1] + 1
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return _case("Conv", [("X", x)], consts, [("Y", elem, [2, m, oh, ow])],
                 dict(group=group, dilations=list(dilations), pads=list(pads), strides=list(strides),
                      kernel_shape=[kh, kw]))


def _conv1d():
    r = _rng(4)
    x = r.standard_normal((1, 3, 11)).astype(np.float32)
    w = r.standard_normal((5, 3, 4)).astype(np.float32)
    return _case("Conv", [("X", x)], [("W", w)], [("Y", F32, [1, 5, 10])], dict(pads=[1, 2]))


def _conv_transpose(group=1, strides=(1, 1), pads=(0, 0, 0, 0), output_padding=(0, 0), bias=True):
    r = _rng(5)
    c, m, kh, kw = 4, 6, 3, 3
    x = r.standard_normal((1, c, 5, 4)).astype(np.float32)
    w = (0.3 * r.standard_normal((c, m // group, kh, kw))).astype(np.float32)
    consts = [("W", w)] + ([("B", r.standard_normal(m).astype(np.float32))] if bias else [])
    oh = strides[0] * (5 - 1) + output_padding[0] + kh - pads[0] - pads[2]
    ow = strides[1] * (4 - 1) + output_padding[1] + kw - pads[1] - pads[3]
    return _case("ConvTranspose", [("X", x)], consts, [("Y", F32, [1, m, oh, ow])],
                 dict(group=group, strides=list(strides), pads=list(pads),
                      output_padding=list(output_padding)))


def _rnn(op, direction, *, bias=True, linear_before_reset=0, dtype=np.float32):
    r = _rng(6)
    seq, batch, inp, hid = 4, 3, 5, 6
    gates = 4 if op == "LSTM" else 3
    nd = 2 if direction == "bidirectional" else 1
    x = r.standard_normal((seq, batch, inp)).astype(dtype)
    w = (0.4 * r.standard_normal((nd, gates * hid, inp))).astype(dtype)
    rr = (0.4 * r.standard_normal((nd, gates * hid, hid))).astype(dtype)
    consts = [("W", w), ("R", rr)] + ([("B", (0.1 * r.standard_normal((nd, 2 * gates * hid))).astype(dtype))] if bias else [])
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = dict(direction=direction, hidden_size=hid)
    if op == "GRU":
        attrs["linear_before_reset"] = linear_before_reset
    return _case(op, [("X", x)], consts, [("Y", elem, [seq, nd, batch, hid]), ("Y_h", elem, [nd, batch, hid])],
                 attrs, order=["X", "W", "R"] + (["B"] if bias else []))


def _matmul_nbits(k=64, n=24, block_size=32, zero_points=True, m=3):
    """com.microsoft MatMulNBits with random 4-bit blocks (B: N x n_blocks x blob uint8)."""
    r = _rng(7)
    nblocks = -(-k // block_size)
    blob = block_size // 2
    a = r.standard_normal((m, k)).astype(np.float32)
    b = r.integers(0, 256, size=(n, nblocks, blob), dtype=np.uint8)
    scales = (0.05 + 0.05 * r.random(n * nblocks)).astype(np.float32)
    consts = [("B", b), ("scales", scales)]
    if zero_points:
        zp = r.integers(0, 256, size=(n * ((nblocks + 1) // 2),), dtype=np.uint8)
        consts.append(("zp", zp))
    return _case("MatMulNBits", [("A", a)], consts, [("Y", F32, [m, n])],
                 dict(K=k, N=n, bits=4, block_size=block_size), domain="com.microsoft")


OP_CASES = {
    "matmul_f32": lambda: _matmul(np.float32, (4, 16), 16, 8),
    "matmul_f32_batched": lambda: _matmul(np.float32, (2, 3, 16), 16, 8),
    "matmul_f32_vector": lambda: _matmul(np.float32, (16,), 16, 8),
    "matmul_f16": lambda: _matmul(np.float16, (4, 32), 32, 8),
    "matmul_f16_batched": lambda: _matmul(np.float16, (2, 3, 32), 32, 8),
    "gemm_plain": lambda: _gemm(np.float32, 0, 0, 1.0, 1.0),
    "gemm_transB": lambda: _gemm(np.float32, 0, 1, 1.0, 1.0),
    "gemm_transA": lambda: _gemm(np.float32, 1, 0, 1.0, 1.0),
    "gemm_transA_transB_alpha_beta": lambda: _gemm(np.float32, 1, 1, 0.5, 2.0),
    "gemm_alpha_no_c": lambda: _gemm(np.float32, 0, 1, 1.7, 1.0, with_c=False),
    "gemm_beta0": lambda: _gemm(np.float32, 0, 0, 2.0, 0.0),
    "gemm_f16_transB": lambda: _gemm(np.float16, 0, 1, 1.0, 1.0),
    "conv_plain": lambda: _conv(),
    "conv_groups2": lambda: _conv(group=2),
    "conv_depthwise": lambda: _conv_dw(),
    "conv_dilation_pads": lambda: _conv(dilations=(2, 1), pads=(2, 1, 1, 0)),
    "conv_strides": lambda: _conv(strides=(2, 2), pads=(1, 1, 1, 1), group=2),
    "conv_nobias": lambda: _conv(bias=False),
    "conv_1d": _conv1d,
    "convtranspose_plain": lambda: _conv_transpose(),
    "convtranspose_groups_strides": lambda: _conv_transpose(group=2, strides=(2, 2)),
    "convtranspose_pads_outpad": lambda: _conv_transpose(strides=(2, 2), pads=(1, 0, 1, 1), output_padding=(1, 1),
                                                         bias=False),
    "lstm_forward": lambda: _rnn("LSTM", "forward"),
    "lstm_reverse": lambda: _rnn("LSTM", "reverse"),
    "lstm_bidirectional": lambda: _rnn("LSTM", "bidirectional"),
    "lstm_nobias": lambda: _rnn("LSTM", "forward", bias=False),
    "gru_forward": lambda: _rnn("GRU", "forward"),
    "gru_reverse_lbr": lambda: _rnn("GRU", "reverse", linear_before_reset=1),
    "gru_bidirectional": lambda: _rnn("GRU", "bidirectional"),
    "gru_bidirectional_lbr": lambda: _rnn("GRU", "bidirectional", linear_before_reset=1),
    "matmulnbits_zp": lambda: _matmul_nbits(),
    "matmulnbits_no_zp": lambda: _matmul_nbits(zero_points=False),
    "matmulnbits_k_not_multiple": lambda: _matmul_nbits(k=40, block_size=16),
    "matmulnbits_many_rows": lambda: _matmul_nbits(m=70),
}


def _conv_dw():
    r = _rng(8)
    x = r.standard_normal((1, 4, 7, 7)).astype(np.float32)
    w = r.standard_normal((4, 1, 3, 3)).astype(np.float32)
    return _case("Conv", [("X", x)], [("W", w)], [("Y", F32, [1, 4, 7, 7])],
                 dict(group=4, pads=[1, 1, 1, 1], kernel_shape=[3, 3]))


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_prepacking_op_packed_equals_unpacked_and_onnxruntime(case):
    model, feeds = OP_CASES[case]()
    with InferenceSession(model) as packed, InferenceSession(model, _unpacked()) as plain:
        got = packed.run(None, feeds)
        want = plain.run(None, feeds)
        log = packed.get_prepack_log()
        stats = packed.get_prepack_stats()
        assert packed.get_fallback_nodes() == [], "the op must run on its native kernel"
        assert plain.get_prepack_stats()["weights_packed"] == 0
    op_type = onnx.load_from_string(model).graph.node[0].op_type
    packed_weights = {row["weight"] for row in log}
    assert stats["weights_packed"] == len(packed_weights) >= 1, f"{case}: {log}"
    assert {row["op_type"] for row in log} == {op_type}
    assert "B" in packed_weights or "W" in packed_weights
    assert stats["originals_released"] == len(packed_weights)
    _assert_close(got, want, PACKED_VS_UNPACKED, f"{case} packed vs unpacked")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    oracle = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    _assert_close(got, oracle, VS_ORACLE, f"{case} vs onnxruntime")


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_matmul_bf16_and_f64_packed_equals_unpacked_and_numpy(dtype):
    """onnxruntime has no CPU MatMul for bfloat16, so the oracle is numpy in float64.

    bfloat16 outputs are rounded from a float32 result: one bf16 ulp is 2**-8 relative.
    """
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float64)
    r = _rng(12)
    a = r.standard_normal((3, 32)).astype(np_dtype)
    b = (r.standard_normal((32, 8)) / 6).astype(np_dtype)
    elem = helper.np_dtype_to_tensor_dtype(np_dtype)
    model, feeds = _case("MatMul", [("A", a)], [("B", b)], [("Y", elem, [3, 8])])
    with InferenceSession(model) as packed, InferenceSession(model, _unpacked()) as plain:
        got = packed.run(None, feeds)[0]
        want = plain.run(None, feeds)[0]
        assert packed.get_prepack_stats()["weights_packed"] == 1
    assert got.dtype == np_dtype
    tol = dict(rtol=2**-8, atol=2**-8) if dtype == "bfloat16" else dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **tol)
    oracle = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), oracle, **(dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else tol))


# -- containers ---------------------------------------------------------------------------------------
@pytest.fixture()
def transformer(samples):
    return samples["transformer"], sample_models.sample_inputs("transformer")


def test_two_sessions_share_one_container(transformer):
    path, feeds = transformer
    c = PrepackedWeightsContainer()
    s1 = InferenceSession(path, prepacked_weights_container=c)
    n_entries, nbytes = len(c), c.nbytes
    st1 = s1.get_prepack_stats()
    assert st1["weights_packed"] == n_entries > 0 and st1["blobs_from_container"] == 0
    assert nbytes == st1["bytes_packed"]
    s2 = InferenceSession(path, prepacked_weights_container=c)
    st2 = s2.get_prepack_stats()
    assert st2["weights_packed"] == 0 and st2["bytes_packed"] == 0
    assert st2["blobs_from_container"] == n_entries
    assert len(c) == n_entries and c.nbytes == nbytes  # nothing new
    assert all(c.holders(k) == 2 for k in c.keys())
    # Both sessions use the very same packed buffers.
    keys1 = {r["key"] for r in s1.get_prepack_log()}
    keys2 = {r["key"] for r in s2.get_prepack_log()}
    assert keys1 == keys2 == set(c.keys())
    np.testing.assert_array_equal(s1.run(None, feeds)[0], s2.run(None, feeds)[0])
    s1.close()
    assert len(c) == n_entries  # s2 still holds them
    # Packed sessions fuse MatMul + bias + GELU (one rounding per step less): close, not equal.
    np.testing.assert_allclose(s2.run(None, feeds)[0], InferenceSession(path, _unpacked()).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-6)
    s2.close()
    assert len(c) == 0 and c.nbytes == 0


def test_garbage_collected_session_releases_its_entries(transformer):
    path, feeds = transformer
    c = PrepackedWeightsContainer()
    s = InferenceSession(path, prepacked_weights_container=c)
    s.run(None, feeds)
    keep = InferenceSession(path, prepacked_weights_container=c)
    assert len(c) > 0 and all(c.holders(k) == 2 for k in c.keys())
    del s
    gc.collect()
    assert len(c) > 0 and all(c.holders(k) == 1 for k in c.keys())
    del keep
    gc.collect()
    assert len(c) == 0


def test_failed_session_creation_releases_its_entries(transformer, tmp_path):
    path, _ = transformer
    c = PrepackedWeightsContainer()
    so = _options(**{"onnxpack.prepacked_cache_path": str(tmp_path / "missing-folder" / "cache.bin")})
    with pytest.raises(onnxpack.OnnxpackError):
        InferenceSession(path, so, prepacked_weights_container=c)
    gc.collect()
    assert len(c) == 0


def test_eight_threads_create_run_close_on_one_container(samples):
    names = ["mlp", "transformer", "cnn", "shared_weight"]
    feeds = {n: sample_models.sample_inputs(n) for n in names}
    expected = {n: InferenceSession(samples[n], _unpacked()).run(None, feeds[n]) for n in names}
    c = PrepackedWeightsContainer()
    start = threading.Barrier(8)
    errors: list[BaseException] = []
    packed_total = []
    lock = threading.Lock()

    def worker(k):
        try:
            start.wait()
            for rep in range(3):
                name = names[(k + rep) % len(names)]
                with InferenceSession(samples[name], prepacked_weights_container=c) as s:
                    out = s.run(None, feeds[name])
                    _assert_close(out, expected[name], PACKED_VS_UNPACKED, f"thread {k} {name}")
                    with lock:
                        packed_total.append(s.get_prepack_stats()["weights_packed"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(packed_total) == 24
    assert len(c) == 0 and c.nbytes == 0


# -- sharing inside one session (session-local container) --------------------------------------------
def _shared_across_subgraphs() -> tuple[bytes, dict[str, np.ndarray]]:
    """W used by a root MatMul, by a MatMul in an If branch and by one in a Loop body."""
    d = 16
    r = _rng(9)
    w = (r.standard_normal((d, d)) / 4).astype(np.float32)
    vi = helper.make_tensor_value_info
    then_g = helper.make_graph([helper.make_node("MatMul", ["h", "W"], ["t"], name="then_mm")],
                               "then", [], [vi("t", F32, [1, d])])
    else_g = helper.make_graph([helper.make_node("Neg", ["h"], ["e"], name="else_neg")],
                               "else", [], [vi("e", F32, [1, d])])
    body = helper.make_graph(
        [helper.make_node("MatMul", ["v_in", "W"], ["mm"], name="body_mm"),
         helper.make_node("Tanh", ["mm"], ["v_out"], name="body_tanh"),
         helper.make_node("Identity", ["c_in"], ["c_out"], name="body_cond")],
        "body", [vi("i", TensorProto.INT64, []), vi("c_in", TensorProto.BOOL, []), vi("v_in", F32, [1, d])],
        [vi("c_out", TensorProto.BOOL, []), vi("v_out", F32, [1, d])])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="root_mm"),
        helper.make_node("If", ["cond"], ["ify"], name="if", then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["M", "cond", "ify"], ["y"], name="loop", body=body),
    ]
    g = helper.make_graph(nodes, "shared", [vi("x", F32, [1, d]), vi("cond", TensorProto.BOOL, []),
                                            vi("M", TensorProto.INT64, [])],
                          [vi("y", F32, [1, d])], [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    feeds = {"x": r.standard_normal((1, d)).astype(np.float32), "cond": np.array(True), "M": np.array(3, np.int64)}
    return m.SerializeToString(), feeds


@pytest.mark.parametrize("with_container", [False, True], ids=["session_local", "user_container"])
def test_weight_shared_by_nodes_and_subgraphs_is_packed_once(with_container):
    model, feeds = _shared_across_subgraphs()
    c = PrepackedWeightsContainer() if with_container else None
    with InferenceSession(model, prepacked_weights_container=c) as s:
        stats = s.get_prepack_stats()
        log = s.get_prepack_log()
        got = s.run(None, feeds)
        if c is not None:
            assert len(c) == 1
        plans = list(s.program.plans.values())
        assert all("W" not in p.constants for p in plans), "the original W must be released"
    assert sorted(r["node"] for r in log) == ["body_mm", "root_mm", "then_mm"]
    assert len({r["key"] for r in log}) == 1
    assert stats["weights_packed"] == 1
    assert stats["blobs_from_container"] == 2
    assert stats["originals_released"] == 1
    assert stats["bytes_held"] == stats["bytes_packed"] == 16 * 16 * 4
    want = ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds)
    _assert_close(got, want, VS_ORACLE, "shared weight vs onnx.reference")
    if c is not None:
        assert len(c) == 0


def test_sample_shared_weight_packed_once(samples):
    with InferenceSession(samples["shared_weight"]) as s:
        stats = s.get_prepack_stats()
        log = s.get_prepack_log()
    assert [r["node"] for r in log] == ["first", "second"]
    assert stats["weights_packed"] == 1 and stats["blobs_from_container"] == 1


def test_weight_read_unpacked_somewhere_keeps_its_original():
    """W feeds a MatMul (packed) and an Add (never packed): the original must stay referenced."""
    r = _rng(10)
    w = r.standard_normal((4, 4)).astype(np.float32)
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "W"], ["y"])],
        "g", [vi("x", F32, [4, 4])], [vi("y", F32, [4, 4])], [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    x = r.standard_normal((4, 4)).astype(np.float32)
    with InferenceSession(m.SerializeToString()) as s:
        assert s.get_prepack_stats()["weights_packed"] == 1
        assert s.get_prepack_stats()["originals_released"] == 0
        assert "W" in s.program.root.constants
        np.testing.assert_allclose(s.run(None, {"x": x})[0], x @ w + w, rtol=1e-5, atol=1e-5)


# -- release of originals --------------------------------------------------------------------------
def _mapping_rss(path: str) -> tuple[int, int]:
    """(number of mappings, total Rss bytes) of ``path`` in this process, from /proc/self/smaps."""
    real = os.path.realpath(path)
    count = rss = 0
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                current = len(head) >= 6 and head[5] == real
                count += current
            elif current and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return count, rss


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_released_originals_are_never_paged_in_on_a_warm_start(tmp_path):
    model = str(tmp_path / "chain.onnx")
    n_layers, dim = 4, 512
    weight_bytes = sample_models.make_matmul_chain(model, n_layers, dim, np.float32, seed=3)
    data = model + ".data"
    cache = str(tmp_path / "packed.cache")
    so = _options(**{"onnxpack.prepacked_cache_path": cache})
    x = _rng(11).standard_normal((1, dim)).astype(np.float32)
    with InferenceSession(model, so) as cold:  # packs (reads the originals) and fills the cache
        assert cold.get_prepack_stats()["weights_packed"] == n_layers
        want = cold.run(None, {"x": x})
    del cold
    gc.collect()  # a closed session's tensors keep the mapping alive until they are collected
    assert _mapping_rss(data)[0] == 0, "nothing may keep the cold session's data mapping alive"
    warm = InferenceSession(model, so)
    try:
        stats = warm.get_prepack_stats()
        assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] == n_layers
        assert stats["originals_released"] == n_layers
        assert all(not p.constants for p in warm.program.plans.values())
        got = warm.run(None, {"x": x})
        np.testing.assert_array_equal(got[0], want[0])
        mappings, rss = _mapping_rss(data)
        # The data file may stay mapped, but none of its weight pages were touched: only what a
        # key check samples may be resident (at most a few pages), never the weights.
        assert rss <= weight_bytes // 20, f"{rss} bytes of the {weight_bytes}-byte data file are resident"
    finally:
        warm.close()


def test_warm_up_tasks_keep_no_closed_session_mapped(tmp_path, monkeypatch):
    """The kernels' warm-up tasks (run by a background thread, which may still be compiling JIT
    code after the session is closed) hold neither the kernel nor its model: a closed session's
    data file unmaps while something still holds them (the fresh CI run, with numba's caches
    cold, once kept the mapping alive for the whole compile)."""
    from onnxpack.session import _program

    monkeypatch.setattr(_program.Program, "start_warm_ups", lambda self: None)
    model = str(tmp_path / "chain.onnx")
    sample_models.make_matmul_chain(model, 2, 256, np.float32, seed=4)  # 256 columns: panels
    sess = InferenceSession(model)
    tasks = sess.program.warm_ups
    if not tasks:
        pytest.skip("no kernel here has warm-up work (numba is not installed)")
    assert _mapping_rss(model + ".data")[0] >= 1
    sess.close()
    del sess
    gc.collect()
    assert _mapping_rss(model + ".data")[0] == 0, "a warm-up task keeps the closed session's model mapped"
    for task in tasks:  # and they still do their work
        task()


def test_unpacked_session_keeps_every_original(samples):
    with InferenceSession(samples["mlp"], _unpacked()) as s:
        assert s.get_prepack_stats()["originals_released"] == 0
        assert set(s.program.root.constants) == {"W1", "b1", "W2", "b2", "W3", "b3"}
