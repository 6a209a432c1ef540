"""The models people deploy, end to end: quantized CNNs, ORT-optimized transformers, LLMs.

Every model goes through the same path (:func:`check_deployed`):

1. onnxpack (pre-packing on, and ``session.disable_prepacking=1``) equals onnxruntime within the
   tolerance stated for its family below;
2. ``onnxpack optimize`` saves it; the warm session of the saved model packs nothing and gives the
   cold session's outputs exactly (the same packed bytes, mapped);
3. a session with ``onnxpack.prepacked_cache_path`` on the original model, second process-start
   style creation, packs nothing and gives the cold outputs exactly;
4. onnxruntime loads the saved model and gives exactly its outputs on the original;
5. the saved data file stores no weight twice: its bytes are at most the weights' own bytes plus
   the non-identity packs plus alignment padding, and quantized weights keep their dtype.

Models and oracles (onnxruntime with graph optimizations off: it runs the very graph we run;
integer GEMMs of uint8 by int8 constants with the weights shifted to uint8, the same products,
which onnxruntime computes exactly on every x86 CPU: ``quant_util.ort_exact``):

* onnx's light squeezenet quantized by ``onnxruntime.quantization`` in every mode (static QDQ per
  tensor and per channel, QOperator, dynamic), light resnet50 static QDQ per channel (real random
  weights: models/build.py), and the sample models (mlp, cnn, transformer) QDQ/QOperator/dynamic
  and QDQ with float weights behind Q/DQ pairs (``AddQDQPairToWeight``);
  calibration: 2 seeded random batches.  Static models end in a DequantizeLinear (then maybe
  float ops): within one quantization step of that DequantizeLinear; QDQ Convs and MatMuls run in
  float between Q/DQ pairs, in another summation order, which can move a code by one and the
  outputs after it by more: ``quant_util.assert_qdq_model_close`` then also compares the model
  segment by segment, both runtimes fed onnxruntime's codes (measured: identical).
  Dynamic models end in float ops after integer GEMMs: rtol 1e-5, atol 1e-5 of the output's
  magnitude (measured <= 3e-7 relative), or, where an ulp of float arithmetic before a
  DynamicQuantizeLinear moved a code (seen on a T5 encoder: onnxruntime's AVX-512
  SimplifiedLayerNormalization is an ulp from its AVX2 one and from ours), within 1% of the
  magnitude end to end and the tight tolerance segment by segment, both runtimes fed onnxruntime's
  codes at every DynamicQuantizeLinear (``quant_util.assert_dynamic_model_close``).
* ``models/fixtures/transformers`` (torch export and onnxruntime's optimizer, fp32 and fp16):
  float32 rtol 1e-4 / atol 1e-5 (measured max |diff| 1.2e-6 on outputs of magnitude ~4); fp16
  (keep_io_types: float32 outputs of float16 arithmetic) rtol/atol 1e-2 (measured 4.1e-3: one or
  two fp16 ulps at magnitude 2-4, from another summation order).
* ``models/fixtures/llm`` (onnxruntime-genai's builder), the sidecars' prefill and decode feeds:
  fp32 rtol 1e-4 / atol 1e-5 (measured 2e-6 on logits ~4); fp16 rtol/atol 1e-2 (measured 4.9e-3,
  ~1 fp16 ulp at 4).  int4 models carry ``accuracy_level=4``: onnxruntime quantizes activations to
  int8 per block, and so does onnxpack's int8 GEMV (a CPU with VNNI or AVX2), while its other
  paths compute them in float32; so the tight comparison runs both on the model with
  ``accuracy_level=0`` (fp32 rtol 1e-4 / atol 2e-5: measured 5e-6), and the original model agrees
  within 5% of the largest logit (measured 2%, the int8 rounding of activations).
  gemma2's sliding-window layers (``sliding_window_cache=1``): only the rows of ``present_*``
  a step defines are compared (:func:`_kv_specified`).
* light squeezenet quantized statically and saved by onnxruntime at level *all* (channels-last
  int8 ops): one step of the last DequantizeLinear, like the static models (measured: equal).
* float CNNs saved by onnxruntime at level *all* (NCHWc ops, filters in this CPU's blocks):
  float32 rtol 1e-4 / atol 1e-5 of the output's magnitude (measured <= 4e-7 relative).
* the sample transformer through the weight-only quantizers (MatMulNBits, int4 DequantizeLinear,
  MatMulBnb4): rtol 1e-4, atol 1e-4 of the output's magnitude (measured <= 2.2e-6 relative).
* the optimizer's float32 fixtures through ``quantize_dynamic`` (QAttention,
  QEmbedLayerNormalization): the dynamic models' comparison (measured <= 2.3e-7 relative end to
  end, but the T5 encoder's one moved code on an AVX-512 CPU).

Timing (2-core dev machine, shared): 37-46 s, of which resnet50 (upgrade to opset 13, quantize
6 s, pack, save 100 MB of fp32 blobs, load warm and from the cache file) ~20 s.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import sys

import numpy as np
import onnx
import onnx.version_converter
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import onnxpack
import onnxpack_sample_models as sample_models
from onnxpack.session import optimize
from kernel_util import ort_save_optimized
from quant_util import assert_dynamic_model_close, assert_qdq_model_close, ort_exact

quantization = pytest.importorskip("onnxruntime.quantization")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "models"))
import _fixtures as fx  # noqa: E402  (models/ is not a package; test_fixtures.py reads it the same way)

F32 = dict(rtol=1e-4, atol=1e-5)
F16 = dict(rtol=1e-2, atol=1e-2)


# -- the one path every model takes -------------------------------------------------------------
def ort_run(path: str | bytes, feeds: dict, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.log_severity_level = 3
    return ort.InferenceSession(ort_exact(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def session(path: str, **config: str) -> onnxpack.InferenceSession:
    so = onnxpack.SessionOptions()
    for key, value in config.items():
        so.add_session_config_entry(key, value)
    return onnxpack.InferenceSession(path, so)


def _exact(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k)
        np.testing.assert_array_equal(g, w, err_msg=f"{what}: output {k}")


def check_deployed(path: str, feeds_list: list[dict], compare, tmp: pathlib.Path, specified=None,
                   ort_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL) -> None:
    """Steps 1-5 of the module docstring for the model at ``path``; ``compare(got, want, what)``
    checks onnxpack against onnxruntime for this model's family; ``specified(outputs, feeds)``
    keeps the part of the outputs a runtime defines (the rest is compared nowhere); ``ort_level``:
    onnxruntime's graph optimizations for the models whose arithmetic depends on them."""
    if specified is not None:
        def run_of(run):
            return lambda path_or_none, feeds: specified(run(path_or_none, feeds), feeds)
    else:
        def run_of(run):
            return run
    ort_of = run_of(lambda p, feeds: ort_run(p, feeds, ort_level))

    def session_of(p, **config):
        sess = session(p, **config)
        return sess, run_of(lambda names, feeds: sess.run(names, feeds))

    wants = [ort_of(path, feeds) for feeds in feeds_list]
    cold, cold_run = session_of(path)
    colds = [cold_run(None, feeds) for feeds in feeds_list]
    _, unpacked_run = session_of(path, **{"session.disable_prepacking": "1"})
    for feeds, got, want in zip(feeds_list, colds, wants):
        compare(got, want, "cold")
        compare(unpacked_run(None, feeds), want, "no prepacking")
    n_packs = len(cold.get_prepack_log())

    out = tmp / "optimized.onnx"
    result, program = optimize(path, str(out))
    warm, warm_run = session_of(str(out))
    stats = warm.get_prepack_stats()
    assert stats["weights_packed"] == 0 and stats["blobs_rejected"] == 0, stats
    assert stats["blobs_from_model"] + stats["blobs_from_container"] == n_packs, (stats, n_packs)
    for feeds, want in zip(feeds_list, colds):
        _exact(warm_run(None, feeds), want, "warm")
    for feeds, want in zip(feeds_list, wants):
        _exact(ort_of(str(out), feeds), want, "onnxruntime on the saved model")

    cache = {"onnxpack.prepacked_cache_path": str(tmp / "packs.cache")}
    session(path, **cache).close()
    cached, cached_run = session_of(path, **cache)
    stats = cached.get_prepack_stats()
    assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] + stats["blobs_from_container"] == n_packs
    for feeds, want in zip(feeds_list, colds):
        _exact(cached_run(None, feeds), want, "cache file")

    # No weight stored twice: weights once, non-identity packs once each, padding at most one
    # allocation granule per item, the manifest under 64 KiB.
    blobs = {e.entry.key: e.entry.nbytes for e in program.pack_log if not e.spec.identity}
    items = result.tensors_written + len(blobs) + 1
    assert result.bytes_written <= result.tensor_bytes + sum(blobs.values()) + items * mmap.ALLOCATIONGRANULARITY + 65536
    src, saved = onnx.load(path, load_external_data=False), onnx.load(str(out), load_external_data=False)
    assert {t.name: t.data_type for t in src.graph.initializer} == {t.name: t.data_type for t in saved.graph.initializer}


# -- quantized CNNs and samples ----------------------------------------------------------------
class _Reader(quantization.CalibrationDataReader):
    def __init__(self, feeds: list[dict]) -> None:
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)


def _calibration(feeds: dict, n: int = 2) -> list[dict]:
    return [{k: np.random.default_rng(10 + i).standard_normal(v.shape).astype(v.dtype) for k, v in feeds.items()}
            for i in range(n)]


def quantize(src: str, out: str, mode: str, feeds: dict) -> None:
    if mode == "dynamic":
        quantization.quantize_dynamic(src, out)
        return
    fmt = quantization.QuantFormat.QOperator if mode == "qop" else quantization.QuantFormat.QDQ
    # qdq-weightpair: float weights behind a Q -> DQ pair each (AddQDQPairToWeight), per channel
    extra = {"AddQDQPairToWeight": True} if mode == "qdq-weightpair" else {}
    quantization.quantize_static(src, out, _Reader(_calibration(feeds)), quant_format=fmt,
                                 per_channel=mode in ("qdq-channel", "qdq-weightpair"), extra_options=extra)


def _output_steps(model: onnx.ModelProto) -> list[float | None]:
    """Per graph output, the quantization step (largest scale) of the DequantizeLinear it comes
    from through float ops on input 0 (Softmax, Reshape, Flatten ...), or None if it comes from
    none.  A softmax moves by at most half the largest logit change, so the step bounds it too."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    steps: list[float | None] = []
    for out in model.graph.output:
        node = producer.get(out.name)
        while node is not None and node.op_type not in ("DequantizeLinear", "QuantizeLinear") and node.input:
            node = producer.get(node.input[0])
        ok = node is not None and node.op_type == "DequantizeLinear" and node.input[1] in inits
        steps.append(float(np.max(inits[node.input[1]])) if ok else None)
    return steps


QUANT_CASES = [("light_squeezenet", m) for m in ("qdq", "qdq-channel", "qop", "dynamic")]
QUANT_CASES += [("light_resnet50", "qdq-channel")]
QUANT_CASES += [(s, m) for s in ("mlp", "cnn", "transformer") for m in ("qdq", "qop", "dynamic", "qdq-weightpair")]


@pytest.mark.parametrize("name,mode", QUANT_CASES, ids=[f"{n.removeprefix('light_')}-{m}" for n, m in QUANT_CASES])
def test_quantized_model(name, mode, tmp_path):
    if name.startswith("light_"):
        light, model = sample_models.write_light_model(name, tmp_path / "light", expose_logits=False)
        feeds = sample_models.light_inputs(model)
        # The light models are opset 9; per-channel Q/DQ needs opset 13 (DequantizeLinear's axis),
        # and the quantizer's own upgrade stops at 11: upgrade first, as its docs advise.
        upgraded = onnx.version_converter.convert_version(onnx.load(light), 13)
        src = str(tmp_path / f"{name}-13.onnx")
        onnx.save(upgraded, src, save_as_external_data=True, location=f"{name}-13.onnx.data")
    else:
        src = str(ROOT / "models" / f"{name}.onnx")
        feeds = sample_models.sample_inputs(name, onnx.load(src, load_external_data=False))
    path = str(tmp_path / f"{name}-{mode}.onnx")
    quantize(src, path, mode, feeds)
    steps = _output_steps(onnx.load(path))
    assert mode == "dynamic" or all(s is not None for s in steps), steps

    def compare(got, want, what):
        options = {"session.disable_prepacking": "1"} if what == "no prepacking" else {}
        if mode.startswith("qdq"):  # float ops between Q/DQ pairs: see assert_qdq_model_close
            assert_qdq_model_close(path, feeds, got, steps, options, want=want, segments=None)
            return
        if mode == "dynamic":  # float ops before each DynamicQuantizeLinear: see assert_dynamic_model_close
            assert_dynamic_model_close(path, feeds, got, want, what, options)
            return
        for g, w, step in zip(got, want, steps):
            assert g.dtype == w.dtype and g.shape == w.shape, what
            if step is None:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=what)
            else:  # one step of the last DequantizeLinear, up to float32 rounding of its products
                assert float(np.abs(g - w).max()) <= step * 1.01, (what, float(np.abs(g - w).max()), step)

    check_deployed(path, [feeds], compare, tmp_path)


ALL_LEVEL_CASES = [("light_squeezenet", "qop"), ("light_squeezenet", "qdq"), ("cnn", "qdq"), ("cnn", "qop")]


@pytest.mark.parametrize("name,mode", ALL_LEVEL_CASES, ids=[f"{n.removeprefix('light_')}-{m}" for n, m in ALL_LEVEL_CASES])
def test_quantized_model_saved_at_level_all(name, mode, tmp_path):
    """A statically quantized CNN as onnxruntime's *all* level saves it: its NHWC transformer
    turns the int8 convolutions channels-last (com.microsoft QLinearConv ``channels_last=1``,
    NhwcMaxPool, QLinearGlobalAveragePool, QLinearAveragePool, QGemm, Transposes; the sample cnn
    keeps a float BatchNormalization between Q/DQ pairs).  Steps 1-5, one step of the last
    DequantizeLinear (measured: equal)."""
    if name.startswith("light_"):
        light, model = sample_models.write_light_model(name, tmp_path / "light", expose_logits=False)
        feeds = sample_models.light_inputs(model)
        src = str(tmp_path / f"{name}-13.onnx")
        onnx.save(onnx.version_converter.convert_version(onnx.load(light), 13), src)
    else:
        src = str(ROOT / "models" / f"{name}.onnx")
        feeds = sample_models.sample_inputs(name, onnx.load(src, load_external_data=False))
    quantized = str(tmp_path / f"{name}-{mode}.onnx")
    quantize(src, quantized, mode, feeds)
    saved = str(tmp_path / "ort-all.onnx")
    ort_save_optimized(quantized, saved)
    ops = {n.op_type for n in onnx.load(saved).graph.node if n.domain == "com.microsoft"}
    assert "QLinearConv" in ops, ops
    steps = _output_steps(onnx.load(saved))

    def compare(got, want, what):
        for g, w, step in zip(got, want, steps):
            assert g.dtype == w.dtype and g.shape == w.shape, what
            assert float(np.abs(g - w).max()) <= (step or 0) * 1.01, (what, float(np.abs(g - w).max()), step)

    work = tmp_path / "work"
    work.mkdir()
    check_deployed(saved, [feeds], compare, work)


def _nchwc_probe(path: str) -> dict:
    """A float CNN with what the NCHWc transformer handles differently: a 3-channel first Conv
    (plain NCHW input), a depthwise Conv + Clip, a 1 x 1 Conv, a grouped Conv whose residual Add
    becomes its Sum input, a 12-channel Conv (output channels padded to the block), GlobalMaxPool,
    integer-scale Resizes into Convs (NCHWc Upsample, nearest and linear) and one left in NCHW."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    inits = {"W1": rng.standard_normal((16, 3, 3, 3)), "B1": rng.standard_normal(16), "Wd": rng.standard_normal((16, 1, 3, 3)),
             "W2": rng.standard_normal((32, 16, 1, 1)), "Wg": rng.standard_normal((32, 16, 3, 3)),
             "W12": rng.standard_normal((12, 32, 3, 3)), "B12": rng.standard_normal(12),
             "W3": rng.standard_normal((8, 32, 3, 3))}
    inits = {k: (v * 0.3).astype(np.float32) for k, v in inits.items()}
    inits.update(lo=np.array(0, np.float32), hi=np.array(6, np.float32), sc=np.array([1, 1, 2, 2], np.float32),
                 three=np.array(3, np.float32), six=np.array(6, np.float32))
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["a2"]),
             helper.make_node("Conv", ["a2", "Wd"], ["b"], pads=[1, 1, 1, 1], group=16),
             helper.make_node("Clip", ["b", "lo", "hi"], ["b2"]),
             helper.make_node("Conv", ["b2", "W2"], ["c"]),
             helper.make_node("Conv", ["c", "Wg"], ["d"], pads=[1, 1, 1, 1], group=2),
             helper.make_node("Add", ["d", "c"], ["e"]),
             helper.make_node("Conv", ["e", "W12", "B12"], ["f"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Sigmoid", ["f"], ["f2"]),
             helper.make_node("GlobalMaxPool", ["e"], ["g"]),
             helper.make_node("Resize", ["e", "", "sc"], ["h"], mode="nearest"),
             # (integer-scale Resizes between Convs become NCHWc Upsample: a YOLO neck's nearest one, a linear one)
             helper.make_node("Resize", ["e", "", "sc"], ["u0"], mode="nearest", coordinate_transformation_mode="asymmetric",
                              nearest_mode="floor"),
             helper.make_node("Conv", ["u0", "W3"], ["u"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["e", "", "sc"], ["v0"], mode="linear"),
             helper.make_node("Conv", ["v0", "W3"], ["v"]),
             # HardSwish spelled out after a Conv (PP-OCR's): onnxruntime puts it after a ReorderOutput
             helper.make_node("Conv", ["e", "W3"], ["k"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["k", "three"], ["k1"]),
             helper.make_node("Clip", ["k1", "lo", "hi"], ["k2"]),
             helper.make_node("Div", ["k2", "six"], ["k3"]),
             helper.make_node("Mul", ["k", "k3"], ["k4"]),
             helper.make_node("MaxPool", ["k4"], ["hs"], kernel_shape=[2, 2], strides=[2, 2])]
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 10, 9])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("f2", "g", "h", "u", "v", "hs")],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return {"x": np.random.default_rng(1).standard_normal((1, 3, 10, 9)).astype(np.float32)}


@pytest.mark.parametrize("name", ["probe", "cnn", "light_squeezenet", "mobilenetv2"])
def test_float_model_saved_at_level_all(name, tmp_path):
    """A float CNN as onnxruntime saves it at its default level, *all*: NCHWc ops
    (com.microsoft.nchwc ReorderInput / ReorderOutput, blocked-filter Conv with fused activation
    and Sum, MaxPool, AveragePool, Global*Pool) with the filters saved in this CPU's blocks.
    Steps 1-5, float32 rtol 1e-4 / atol 1e-5 of the output's magnitude (measured <= 4e-7)."""
    work = tmp_path / "src"
    work.mkdir()
    if name == "probe":
        src = str(work / "probe.onnx")
        feeds = _nchwc_probe(src)
    elif name == "cnn":
        src = str(ROOT / "models" / "cnn.onnx")
        feeds = sample_models.sample_inputs(name, onnx.load(src, load_external_data=False))
    elif name == "mobilenetv2":
        (path, sidecar), = [(p, sc) for p, sc in SIDECARS if p.endswith("mobilenetv2-tiny-export.json")]
        src = os.path.join(path[: -len(".json")], sidecar["model_file"])
        feeds = _fixture_feeds(sidecar, sorted(sidecar["feeds"]))[0]
    else:
        src, model = sample_models.write_light_model(name, work, expose_logits=False)
        feeds = sample_models.light_inputs(model)
    saved = str(work / "ort-all.onnx") if name in ("probe", "light_squeezenet") else str(tmp_path / "ort-all.onnx")
    if name == "cnn":  # the saved model points at the source's data file, next to it
        import shutil

        shutil.copy(src + ".data", tmp_path / "cnn.onnx.data")
    ort_save_optimized(src, saved)
    ops = {n.op_type for n in onnx.load(saved, load_external_data=False).graph.node if n.domain == "com.microsoft.nchwc"}
    assert "Conv" in ops and (name != "probe" or "Upsample" in ops), ops

    compare = _relative_compare(1e-4, 1e-5)

    out = tmp_path / "work"
    out.mkdir()
    check_deployed(saved, [feeds], compare, out)


WEIGHT_ONLY = ["nbits2", "nbits4-asym", "nbits8-sym", "nbits4-qdq", "bnb4-fp4", "bnb4-nf4"]


@pytest.mark.parametrize("mode", WEIGHT_ONLY)
def test_weight_only_quantized_transformer(mode, tmp_path):
    """The sample transformer through onnxruntime's weight-only quantizers: MatMulNBitsQuantizer
    (2 / 4 / 8 bits, asymmetric and symmetric, MatMulNBits or blocked int4 DequantizeLinear) and
    MatMulBnb4Quantizer (FP4, NF4).  The weights decode exactly on both sides: float32 rtol 1e-4,
    atol 1e-4 of the output's magnitude (measured <= 2.2e-6 relative)."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq
    from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer

    src = str(ROOT / "models" / "transformer.onnx")
    feeds = sample_models.sample_inputs("transformer", onnx.load(src, load_external_data=False))
    if mode.startswith("bnb4"):
        quantizer = MatMulBnb4Quantizer(onnx.load(src), 0 if mode.endswith("fp4") else 1, 32)
    else:
        bits = int(mode[5])
        config = mnq.DefaultWeightOnlyQuantConfig(
            block_size=32, bits=bits, is_symmetric=mode.endswith("-sym"),
            quant_format=QuantFormat.QDQ if mode.endswith("qdq") else QuantFormat.QOperator)
        quantizer = mnq.MatMulNBitsQuantizer(onnx.load(src), algo_config=config)
    quantizer.process()
    path = str(tmp_path / f"{mode}.onnx")
    onnx.save(quantizer.model.model, path)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert ops & {"MatMulNBits", "MatMulBnb4", "DequantizeLinear"}, ops

    compare = _relative_compare(1e-4, 1e-4)

    # The 4-bit DequantizeLinear -> MatMul pairs run as MatMulNBits with onnxruntime's default
    # accuracy level 4 (int8 activations: 7e-3 relative off the float graph), as its optimizer
    # fuses them; the other modes are the same at every level.
    check_deployed(path, [feeds], compare, tmp_path, ort_level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                   if mode.endswith("qdq") else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_int4_dequantize_matmul_pairs_run_as_matmulnbits(symmetric, block_size, tmp_path):
    """4-bit blocked ``DequantizeLinear -> MatMul`` (the weight-only quantizer's QDQ format, the
    builder's ``use_qdq``) runs as MatMulNBits, as onnxruntime's optimizer rewrites it: the int4
    weights stay 4-bit in the packs (were float32, 8x), the results are onnxruntime's at its
    default ``session.qdq_matmulnbits_accuracy_level`` 4 and at 0 (then the float graph's), with
    and without pre-packing; an accuracy level outside 0-4 is refused."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    src = str(ROOT / "models" / "transformer.onnx")
    feeds = sample_models.sample_inputs("transformer", onnx.load(src, load_external_data=False))
    config = mnq.DefaultWeightOnlyQuantConfig(block_size=block_size, bits=4, is_symmetric=symmetric,
                                              quant_format=QuantFormat.QDQ)
    quantizer = mnq.MatMulNBitsQuantizer(onnx.load(src), algo_config=config)
    quantizer.process()
    path = str(tmp_path / "qdq4.onnx")
    onnx.save(quantizer.model.model, path)
    model = onnx.load(path)
    inits = {t.name: t for t in model.graph.initializer}
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert dqs and all(inits[n.input[0]].data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) for n in dqs)
    quantized = sum(inits[n].ByteSize() for d in dqs for n in d.input if n)  # int4 bytes, scales, zero points

    def theirs(level, accuracy):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.log_severity_level = 3
        if accuracy is not None:
            so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", accuracy)
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)

    compare = _relative_compare(1e-5, 1e-5)
    level = ort.GraphOptimizationLevel
    for accuracy, want in ((None, theirs(level.ORT_ENABLE_ALL, None)), ("0", theirs(level.ORT_DISABLE_ALL, None))):
        for prepack in ("0", "1"):
            config = {"session.disable_prepacking": prepack}
            if accuracy is not None:
                config["session.qdq_matmulnbits_accuracy_level"] = accuracy
            sess = session(path, **config)
            compare(sess.run(None, feeds), want, f"accuracy {accuracy}, disable_prepacking {prepack}")
            log = sess.get_prepack_log()
            if prepack == "0":
                assert {r["op_type"] for r in log} == {"MatMulNBits"} and len(log) == sum(len([n for n in d.input if n]) for d in dqs)
                if block_size <= 64:  # (K is 64: a longer block is padded to a whole one, in onnxruntime too)
                    assert sum(r["nbytes"] for r in log) <= 1.25 * quantized, (sum(r["nbytes"] for r in log), quantized)
    # onnxruntime's default differs from the float graph (else the test above proves nothing)
    assert not np.allclose(theirs(level.ORT_ENABLE_ALL, None)[0], theirs(level.ORT_DISABLE_ALL, None)[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(onnxpack.errors.OnnxpackError, match="accuracy level"):
        session(path, **{"session.qdq_matmulnbits_accuracy_level": "5"})


def test_int4_block_weights_of_a_static_qdq_model_stay_the_float_graph(tmp_path):
    """quantize_static with 4-bit block weights (``weight_type=QInt4``, ``BlockSize``) writes
    ``DQ(activation) -> MatMul <- DQ(int4 weight)`` with a QuantizeLinear after the MatMul:
    onnxruntime leaves that MatMul in float (its DQ -> MatMulNBits rewrite takes a MatMul whose
    weight's DequantizeLinear is its only one and whose result nothing quantizes), so must we
    (fused, with int8 activations at accuracy level 4, a quarter of the outputs moved a step)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    rng = np.random.default_rng(1)
    f = onnx.TensorProto.FLOAT
    inits = [onnx.numpy_helper.from_array((rng.standard_normal((64, 48)) / 8).astype(np.float32), "w1"),
             onnx.numpy_helper.from_array((rng.standard_normal((48, 16)) / 7).astype(np.float32), "w2")]
    nodes = [onnx.helper.make_node("MatMul", ["x", "w1"], ["h"]), onnx.helper.make_node("Relu", ["h"], ["r"]),
             onnx.helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("x", f, [4, 64])],
                                   [onnx.helper.make_tensor_value_info("y", f, [4, 16])], inits)
    src, path = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)]), src)
    batches = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(4)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(batches)

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src), str(path), Reader(), quant_format=QuantFormat.QDQ, weight_type=QuantType.QInt4,
                    activation_type=QuantType.QUInt8, extra_options={"BlockSize": 32})
    model = onnx.load(path)
    inits = {t.name: t for t in model.graph.initializer}
    assert any(n.op_type == "DequantizeLinear" and n.input[0] in inits and inits[n.input[0]].data_type == onnx.TensorProto.INT4
               for n in model.graph.node)
    feeds = {"x": batches[0]["x"]}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    want = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    sess = session(str(path))
    assert "MatMulNBits" not in {r["op_type"] for r in sess.get_prepack_log()}
    # In output steps (the float products may round a tie the other way on another machine):
    # at most one step off, on a few outputs; fused, a quarter of them were.
    last = next(n for n in model.graph.node if n.output[0] == model.graph.output[0].name)
    assert last.op_type == "DequantizeLinear"
    step = float(onnx.numpy_helper.to_array(inits[last.input[1]]))
    _within_a_step(sess.run(None, feeds)[0], want, step)


_QT = {"uint8": (onnx.TensorProto.UINT8, 128), "int8": (onnx.TensorProto.INT8, 0),
       "uint16": (onnx.TensorProto.UINT16, 32768), "int16": (onnx.TensorProto.INT16, 0)}


@pytest.mark.parametrize("a_type,q_type,fused", [(None, None, True), (None, "uint8", False), ("int8", None, False),
                                                 ("uint16", None, True), ("int16", "uint16", True),
                                                 ("uint16", "int8", False), ("uint8", "int16", False)])
def test_int4_block_matmul_in_a_qdq_group_fuses_as_onnxruntime(a_type, q_type, fused, tmp_path):
    """``MatMul(A, DQ(int4 block weight))`` inside a QDQ group: onnxruntime rewrites it to
    MatMulNBits (accuracy level 4: int8 activations) unless the group is 8-bit (A dequantized from
    8-bit codes, or an 8-bit QuantizeLinear reading the result), whose rules keep it in float;
    ours fuses alike and equals onnxruntime's default session, whichever way it goes."""
    rng = np.random.default_rng(0)
    th, f = onnx.helper, onnx.TensorProto
    k, n = 64, 24
    nodes = [th.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0, block_size=16)]
    inits = [th.make_tensor("w", f.INT4, [k, n], rng.integers(-8, 8, k * n).tolist()),
             onnx.numpy_helper.from_array((rng.random((k // 16, n)) * 0.02 + 0.01).astype(np.float32), "ws"),
             th.make_tensor("wz", f.INT4, [k // 16, n], [0] * (k // 16 * n))]

    def fake_quant(src: str, dst: str, qtype: str, scale8: float, scale16: float) -> str:
        """``src`` through a QuantizeLinear -> DequantizeLinear pair of type ``qtype`` as ``dst``."""
        t, zp = _QT[qtype]
        inits.extend([onnx.numpy_helper.from_array(np.array(scale8 if "8" in qtype else scale16, np.float32), dst + "s"),
                      th.make_tensor(dst + "z", t, [], [zp])])
        nodes.extend([th.make_node("QuantizeLinear", [src, dst + "s", dst + "z"], [dst + "q"]),
                      th.make_node("DequantizeLinear", [dst + "q", dst + "s", dst + "z"], [dst])])
        return dst

    a = "x" if a_type is None else fake_quant("x", "xd", a_type, 0.05, 0.0005)
    nodes.append(th.make_node("MatMul", [a, "wd"], ["m"]))
    out = "m" if q_type is None else fake_quant("m", "y", q_type, 0.5, 0.002)
    graph = th.make_graph(nodes, "g", [th.make_tensor_value_info("x", f.FLOAT, [4, k])],
                          [th.make_tensor_value_info(out, f.FLOAT, None)], inits)
    path = str(tmp_path / "m.onnx")
    onnx.save(th.make_model(graph, opset_imports=[th.make_opsetid("", 21)], ir_version=10), path)
    feeds = {"x": (rng.standard_normal((4, k)) * 3).astype(np.float32)}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    want = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.array_equal(want, plain) != fused  # (onnxruntime's rewrite changes the numbers)
    sess = session(path)
    assert ("MatMulNBits" in {r["op_type"] for r in sess.get_prepack_log()}) == fused
    got = sess.run(None, feeds)[0]
    if q_type is None:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    else:  # (a quantized result: in its steps, as above)
        _within_a_step(got, want, 0.5 if "8" in q_type else 0.002)


@pytest.mark.parametrize("form,fused", [("relu", False), ("clip", False), ("relu-output", True), ("relu-twice", True),
                                        ("sigmoid", True), ("gemm", True), ("gemm-bias", True), ("gemm-alpha", False),
                                        ("gemm-transB", False), ("gemm-bias-relu", False), ("uint4-no-zero-points", True),
                                        ("add", True), ("add-relu", False), ("add-1n", False), ("add-relu-3d", True)])
def test_int4_block_matmul_rewrite_follows_onnxruntime_node_groups(form, fused, tmp_path):
    """Where onnxruntime rewrites ``DQ(int4 block weight) -> MatMul`` (or a Gemm that is a
    MatMul: alpha 1, no transposes, beta 1 with a bias of N) to MatMulNBits, and where not: a
    MatMul whose one reader is a Relu or Clip with one reader, not a graph output, forms a group
    with it that no rewrite takes (float); ours fuses alike and equals its default session.  A
    MatMul of a 2-D A followed by an Add is a Gemm there first (MatMulAddFusion), rewritten only
    with a bias of N values and no clip group after it (the A's shape as declared)."""
    rng = np.random.default_rng(3)
    th, f = onnx.helper, onnx.TensorProto
    k, n = 64, 48
    inits = [th.make_tensor("wq", f.INT4, [k, n], rng.integers(-8, 8, k * n).tolist()),
             onnx.numpy_helper.from_array((rng.random((k // 32, n)) * 0.02 + 0.01).astype(np.float32), "ws"),
             onnx.numpy_helper.from_array((rng.standard_normal((n, 8)) * 0.1).astype(np.float32), "w2"),
             onnx.numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b")]
    if form == "uint4-no-zero-points":  # (zero points of 0 in onnxruntime's rewrite: MatMulNBits' default is 8)
        inits[0] = th.make_tensor("wq", f.UINT4, [k, n], rng.integers(0, 16, k * n).tolist())
    nodes = [th.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0, block_size=32)]
    outs = ["y"]
    if form.startswith("gemm"):
        attrs = {"alpha": 0.5} if form == "gemm-alpha" else {}
        if form == "gemm-transB":  # (B given transposed: the rewrite needs B as (K, N))
            inits[0] = th.make_tensor("wq", f.INT4, [n, k], rng.integers(-8, 8, k * n).tolist())
            inits[1] = onnx.numpy_helper.from_array((rng.random((n // 16, k)) * 0.02 + 0.01).astype(np.float32), "ws")
            nodes[0] = th.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0, block_size=16)
            attrs["transB"] = 1
        ins = ["x", "w", "b"] if "bias" in form else ["x", "w"]
        nodes.append(th.make_node("Gemm", ins, ["m"], **attrs))
    elif form.startswith("add"):
        nodes.append(th.make_node("MatMul", ["x", "w"], ["m0"]))
        if form == "add-1n":
            inits.append(onnx.numpy_helper.from_array(rng.standard_normal((1, n)).astype(np.float32), "b1n"))
        nodes.append(th.make_node("Add", ["m0", "b1n" if form == "add-1n" else "b"], ["m"]))
    else:
        nodes.append(th.make_node("MatMul", ["x", "w"], ["m"]))
    act = {"relu": "Relu", "relu-output": "Relu", "relu-twice": "Relu", "clip": "Clip", "sigmoid": "Sigmoid",
           "gemm-bias-relu": "Relu", "add-relu": "Relu", "add-relu-3d": "Relu"}.get(form)
    if act is not None:
        nodes.append(th.make_node(act, ["m"], ["r"]))
        nodes.append(th.make_node("MatMul", ["r", "w2"], ["y"]))
        if form == "relu-output":
            outs.append("r")
        if form == "relu-twice":
            nodes.append(th.make_node("Add", ["r", "r"], ["r2"]))
            outs.append("r2")
    else:
        nodes.append(th.make_node("MatMul", ["m", "w2"], ["y"]))
    xshape = [2, 4, k] if form.endswith("3d") else ["batch", k]
    graph = th.make_graph(nodes, "g", [th.make_tensor_value_info("x", f.FLOAT, xshape)],
                          [th.make_tensor_value_info(o, f.FLOAT, None) for o in outs], inits)
    path = str(tmp_path / "m.onnx")
    onnx.save(th.make_model(graph, opset_imports=[th.make_opsetid("", 21)], ir_version=10), path)
    feeds = {"x": (rng.standard_normal([2, 4, k] if form.endswith("3d") else [4, k]) * 3).astype(np.float32)}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    want = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert np.array_equal(want[0], plain[0]) != fused  # (onnxruntime's rewrite changes the numbers)
    for prepack in ("0", "1"):
        sess = session(path, **{"session.disable_prepacking": prepack})
        fused_here = any(type(st.kernel).__name__ == "DequantizeMatMulNBits" for st in sess.program.root.steps)
        assert fused_here == fused
        for g, w in zip(sess.run(None, feeds), want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


@pytest.mark.parametrize("level", ["ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
def test_int4_block_matmul_is_rewritten_from_the_extended_level_as_onnxruntime(level, tmp_path):
    """onnxruntime rewrites ``DQ(int4 block weight) -> MatMul`` in its QDQ transformer, which runs
    from ORT_ENABLE_EXTENDED on: at ORT_ENABLE_BASIC the pair stays float there, and here."""
    rng = np.random.default_rng(4)
    th, f = onnx.helper, onnx.TensorProto
    k, n = 64, 32
    inits = [th.make_tensor("wq", f.INT4, [k, n], rng.integers(-8, 8, k * n).tolist()),
             onnx.numpy_helper.from_array((rng.random((k // 32, n)) * 0.02 + 0.01).astype(np.float32), "ws")]
    nodes = [th.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0, block_size=32),
             th.make_node("MatMul", ["x", "w"], ["y"])]
    graph = th.make_graph(nodes, "g", [th.make_tensor_value_info("x", f.FLOAT, [4, k])],
                          [th.make_tensor_value_info("y", f.FLOAT, None)], inits)
    path = str(tmp_path / "m.onnx")
    onnx.save(th.make_model(graph, opset_imports=[th.make_opsetid("", 21)], ir_version=10), path)
    feeds = {"x": (rng.standard_normal((4, k)) * 3).astype(np.float32)}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    want = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.array_equal(want, plain) == (level == "ORT_ENABLE_BASIC")
    for prepack in ("0", "1"):
        ours = onnxpack.SessionOptions()
        ours.graph_optimization_level = getattr(onnxpack.GraphOptimizationLevel, level)
        ours.add_session_config_entry("session.disable_prepacking", prepack)
        got = onnxpack.InferenceSession(path, ours).run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_a_long_chain_before_the_rewrite_asks_no_deep_recursion(tmp_path):
    """The rewrite's shape question (a 2-D A's MatMul -> Add) follows at most a few dozen
    producers up: 3,000 Relus before it are a valid model, not a RecursionError; the shape is then
    unknown and the pair rewritten as before."""
    rng = np.random.default_rng(5)
    th, f = onnx.helper, onnx.TensorProto
    k, n = 64, 32
    nodes, prev = [], "x"
    for i in range(3000):
        nodes.append(th.make_node("Relu", [prev], [f"r{i}"]))
        prev = f"r{i}"
    inits = [th.make_tensor("wq", f.INT4, [k, n], rng.integers(-8, 8, k * n).tolist()),
             onnx.numpy_helper.from_array((rng.random((k // 32, n)) * 0.02 + 0.01).astype(np.float32), "ws"),
             onnx.numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b")]
    nodes += [th.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0, block_size=32),
              th.make_node("MatMul", [prev, "w"], ["m"]), th.make_node("Add", ["m", "b"], ["y"])]
    graph = th.make_graph(nodes, "g", [th.make_tensor_value_info("x", f.FLOAT, [4, k])],
                          [th.make_tensor_value_info("y", f.FLOAT, None)], inits)
    model = th.make_model(graph, opset_imports=[th.make_opsetid("", 21)], ir_version=10).SerializeToString()
    feeds = {"x": rng.standard_normal((4, k)).astype(np.float32)}
    sess = onnxpack.InferenceSession(model)
    assert any(type(st.kernel).__name__ == "DequantizeMatMulNBits" for st in sess.program.root.steps)
    got = sess.run(None, feeds)[0]
    assert got.shape == (4, n) and np.isfinite(got).all()


def _within_a_step(got: np.ndarray, want: np.ndarray, step: float) -> None:
    """``got`` is ``want`` (both dequantized by ``step``) but for at most one step on at most 5 %
    of the outputs: a product rounded the other way at a quantization tie."""
    off = np.rint(np.abs(got - want) / step)
    assert off.max() <= 1 and np.mean(off > 0) <= 0.05, (off.max(), np.mean(off > 0))


# -- ORT-optimizer and LLM fixtures ------------------------------------------------------------
SIDECARS = fx.read_sidecars()


def _fixture_params(kind: str):
    out = []
    for path, sidecar in SIDECARS:
        name = os.path.relpath(path, fx.FIXTURES_DIR)[: -len(".json")]
        if not name.startswith(kind + "/"):
            continue
        out.append(pytest.param(path, sidecar, id=name.split("/", 1)[1]))
    return out


def _fixture_feeds(sidecar: dict, modes) -> list[dict]:
    return [fx.make_feeds(sidecar["inventory"]["inputs"], sidecar["feeds"][m]) for m in modes if m in sidecar["feeds"]]


def _dynamic_compare(path: str, feeds_list: list[dict]):
    """``compare`` for check_deployed on a dynamically quantized model: ``assert_dynamic_model_close``
    (a code that an ulp of float arithmetic moved, then the model cut at every
    DynamicQuantizeLinear), with the feeds whose onnxruntime outputs ``want`` is."""
    wants = [ort_run(path, feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL) for feeds in feeds_list]

    def compare(got, want, what):
        feeds = next(f for f, w in zip(feeds_list, wants) if all(np.array_equal(a, b) for a, b in zip(w, want)))
        options = {"session.disable_prepacking": "1"} if what == "no prepacking" else {}
        assert_dynamic_model_close(path, feeds, got, want, what, options)

    return compare


def _relative_compare(rtol: float, atol_of_max: float):
    """``compare`` for check_deployed: dtype and shape equal, values within ``rtol`` and
    ``atol_of_max`` times the largest magnitude of onnxruntime's output."""

    def compare(got, want, what):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, what
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol_of_max * float(np.abs(w).max()), err_msg=what)

    return compare


def _float_compare(fp16: bool):
    tol = F16 if fp16 else F32

    def compare(got, want, what):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, what
            np.testing.assert_allclose(g, w, err_msg=what, **(F16 if g.dtype == np.float16 else tol))

    return compare


@pytest.mark.parametrize("path,sidecar", _fixture_params("transformers"))
def test_transformer_fixture(path, sidecar, tmp_path):
    model = os.path.join(path[: -len(".json")], sidecar["model_file"])
    check_deployed(model, _fixture_feeds(sidecar, sorted(sidecar["feeds"])), _float_compare("fp16" in path), tmp_path)


@pytest.mark.parametrize("path,sidecar", [p for p in _fixture_params("transformers") if p.id.endswith("-dynamo")])
def test_dynamo_export_runs_natively_at_every_batch(path, sidecar):
    """torch's default exporter at opset 23 writes ONNX's Attention (and, for Llama,
    RMSNormalization and RotaryEmbedding): every node runs natively, and a batch of two prompts
    (one right-padded) equals onnxruntime on each prompt alone.  (Row by row because onnxruntime
    1.32 refuses the exporter's batch-1 rotary caches at batch 2, which the spec's broadcasting
    and onnx.reference allow.)"""
    model = os.path.join(path[: -len(".json")], sidecar["model_file"])
    ops = {n.op_type for n in onnx.load(model, load_external_data=False).graph.node}
    assert "Attention" in ops, ops
    sess = session(model)
    assert not sess.get_fallback_nodes(), sess.get_fallback_nodes()
    inputs = sidecar["inventory"]["inputs"]
    recipe = {"dims": {"batch": 2, "sequence": 8}}
    if any(i["dtype"] == "int64" for i in inputs):
        recipe["int_high"] = {"input_ids": 200, "token_type_ids": 2}
        recipe["mask_lengths"] = {"attention_mask": [8, 5]}
    feeds = fx.make_feeds(inputs, recipe)
    got = sess.run(None, feeds)
    for row in range(2):
        want = ort_run(model, {k: v[row:row + 1] for k, v in feeds.items()}, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g[row:row + 1], w, **F32, err_msg=f"row {row}")


@pytest.mark.parametrize("path,sidecar", [p for p in _fixture_params("transformers") if p.id.endswith("-export")])
def test_export_saved_by_onnxruntime_optimizer(path, sidecar, tmp_path):
    """The exported fixtures as onnxruntime's extended graph optimizer saves them for shipping
    (``optimized_model_filepath``): FusedConv (Conv + Clip), FusedGemm (the pooler's Gemm + Tanh),
    FusedMatMul, BiasGelu; steps 1-5 on the saved model."""
    model = os.path.join(path[: -len(".json")], sidecar["model_file"])
    saved = tmp_path / "ort-extended.onnx"
    ort_save_optimized(model, str(saved), "extended")
    ops = {n.op_type for n in onnx.load(str(saved), load_external_data=False).graph.node if n.domain == "com.microsoft"}
    assert ops & {"FusedConv", "FusedGemm", "FusedMatMul"}, ops
    work = tmp_path / "work"
    work.mkdir()
    check_deployed(str(saved), _fixture_feeds(sidecar, sorted(sidecar["feeds"])), _float_compare(False), work)


@pytest.mark.parametrize("weight_type", ["QInt8", "QUInt8"])
@pytest.mark.parametrize("path,sidecar", [p for p in _fixture_params("transformers") if p.id.endswith("-opt")])
def test_optimized_transformer_quantized_dynamically(path, sidecar, weight_type, tmp_path):
    """The optimizer's float32 fixtures through ``quantize_dynamic`` (how onnxruntime's BERT
    guides make an int8 model): the fused Attention and EmbedLayerNormalization become QAttention
    and QEmbedLayerNormalization, the other MatMuls dynamic-quantized GEMMs.  Steps 1-5, the
    dynamic models' tolerance."""
    model = os.path.join(path[: -len(".json")], sidecar["model_file"])
    out = str(tmp_path / f"dynamic-{weight_type}.onnx")
    # (DefaultTensorType: the quantizer cannot infer the float type of the contrib ops' outputs)
    quantization.quantize_dynamic(model, out, weight_type=getattr(quantization.QuantType, weight_type),
                                  extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    ops = {n.op_type for n in onnx.load(out, load_external_data=False).graph.node}
    if "bert" in path:
        assert {"QAttention", "QEmbedLayerNormalization"} <= ops, ops
    assert ops & {"MatMulInteger", "DynamicQuantizeMatMul", "QAttention"}, ops

    feeds_list = _fixture_feeds(sidecar, sorted(sidecar["feeds"]))
    work = tmp_path / "work"
    work.mkdir()
    check_deployed(out, feeds_list, _dynamic_compare(out, feeds_list), work)


# onnxruntime's transformer optimizer with each of its switches (FusionOptions), on the committed
# BERT export: what a user who turns one on ships.  opt_level=0: the optimizer's own fusions only
# (its onnxruntime pre-pass imports torch).  (name, FusionOptions fields, float16 conversion:
# None, or keep_io_types)
_OPTIMIZER_SWITCHES = [
    ("default", {}, None),
    ("gelu-approximation", {"enable_gelu_approximation": True}, None),
    ("multi-head-attention", {"use_multi_head_attention": True}, None),
    ("raw-attention-mask", {"use_raw_attention_mask": True}, None),
    ("mask-index-end", {"attention_mask_format": "MaskIndexEnd"}, None),
    ("mask-as-attention-mask", {"attention_mask_format": "AttentionMask"}, None),
    ("no-mask", {"attention_mask_format": "NoMask"}, None),
    ("no-attention", {"disable_attention": True}, None),
    ("no-skip-layer-norm", {"disable_skip_layer_norm": True}, None),
    ("no-embed-layer-norm", {"disable_embed_layer_norm": True}, None),
    ("no-bias-gelu", {"disable_bias_gelu": True}, None),
    ("no-bias-skip-layer-norm", {"disable_bias_skip_layer_norm": True}, None),
    ("fp16", {}, True),
    ("fp16-io", {}, False),
    ("fp16-fastgelu-mha", {"enable_gelu_approximation": True, "use_multi_head_attention": True}, True),
]


def _ort_optimize(model: str, out: str, switches: dict, fp16, heads: int = 4, hidden: int = 64) -> set[str]:
    """``optimize_model`` (model_type bert) with ``switches`` set on its FusionOptions, then
    ``convert_float_to_float16(keep_io_types=fp16)`` unless ``fp16`` is None; saved to ``out``.
    Returns the com.microsoft op types of the result."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions

    options = FusionOptions("bert")
    for key, value in switches.items():
        setattr(options, key, getattr(AttentionMaskFormat, value) if key == "attention_mask_format" else value)
    opt = optimizer.optimize_model(model, model_type="bert", num_heads=heads, hidden_size=hidden,
                                   optimization_options=options, opt_level=0)
    if fp16 is not None:
        opt.convert_float_to_float16(keep_io_types=fp16)
    opt.save_model_to_file(out)
    return {n.op_type for n in onnx.load(out, load_external_data=False).graph.node if n.domain == "com.microsoft"}


def _bert_export():
    path, sidecar = next((p, s) for p, s in SIDECARS if p.endswith("bert-tiny-export.json"))
    return os.path.join(path[: -len(".json")], sidecar["model_file"]), sidecar


@pytest.mark.parametrize("name,switches,fp16", _OPTIMIZER_SWITCHES, ids=[c[0] for c in _OPTIMIZER_SWITCHES])
def test_transformer_optimizer_switches(name, switches, fp16, tmp_path):
    """The BERT export through onnxruntime's transformer optimizer with each FusionOptions switch
    (attention as MultiHeadAttention, the mask as raw / index / none, each fusion turned off,
    FastGelu, float16 with float16 or float32 inputs and outputs): steps 1-5 (a sweep of these
    switches over ten exported families, BERT's relatives, GPT-2, ViT, CLIP, T5, BART, GPT-NeoX,
    found every one equal to onnxruntime)."""
    model, sidecar = _bert_export()
    out = str(tmp_path / "opt.onnx")
    ops = _ort_optimize(model, out, switches, fp16)
    assert ops, ops  # the optimizer fused something
    inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(out, load_external_data=False).graph.input}
    feeds_list = [{k: v.astype(onnx.helper.tensor_dtype_to_np_dtype(inputs[k])) for k, v in feeds.items() if k in inputs}
                  for feeds in _fixture_feeds(sidecar, sorted(sidecar["feeds"]))]
    work = tmp_path / "work"
    work.mkdir()
    check_deployed(out, feeds_list, _float_compare(fp16 is not None), work)


@pytest.mark.parametrize("fp16", [None, True], ids=["fp32", "fp16"])
def test_gemm_fast_gelu(fp16, tmp_path):
    """``enable_gemm_fast_gelu`` fuses MatMul + FastGelu into com.microsoft GemmFastGelu, which
    onnxruntime's CPU provider cannot run: onnxpack runs it, packing W as a MatMul, and equals
    onnxruntime on the same optimizer output without that switch (MatMul then FastGelu); the
    saved model maps its packs warm and gives the cold outputs exactly."""
    model, sidecar = _bert_export()
    fused, plain = str(tmp_path / "fused.onnx"), str(tmp_path / "plain.onnx")
    assert "GemmFastGelu" in _ort_optimize(model, fused, {"enable_gelu_approximation": True,
                                                          "enable_gemm_fast_gelu": True}, fp16)
    assert "FastGelu" in _ort_optimize(model, plain, {"enable_gelu_approximation": True}, fp16)
    cold = session(fused)
    assert not cold.get_fallback_nodes()
    gemm_nodes = {n.name for n in onnx.load(fused, load_external_data=False).graph.node if n.op_type == "GemmFastGelu"}
    assert gemm_nodes <= {e["node"] for e in cold.get_prepack_log()}  # W packed
    saved = tmp_path / "saved.onnx"
    optimize(fused, str(saved))
    warm = session(str(saved))
    assert warm.get_prepack_stats()["weights_packed"] == 0
    for feeds in _fixture_feeds(sidecar, sorted(sidecar["feeds"])):
        got = cold.run(None, feeds)
        _float_compare(fp16 is not None)(got, ort_run(plain, feeds), "GemmFastGelu against MatMul + FastGelu")
        _exact(warm.run(None, feeds), got, "warm")


def _kv_specified(proto: onnx.ModelProto):
    """The rows of each ``present.*`` output that a step defines: the first ``total`` (the
    attention mask's length), or all of a window-sized cache's when ``total`` is longer (a
    sliding-window layer's buffer, Gemma-2).  onnxruntime leaves the others as it found the
    memory (NaN now and then)."""
    names = [o.name for o in proto.graph.output]

    def specified(outputs, feeds):
        total = feeds["attention_mask"].shape[1]
        return [o[:, :, :min(total, o.shape[2])] if n.startswith("present") and o.ndim == 4 else o
                for n, o in zip(names, outputs)]

    return specified


@pytest.mark.parametrize("path,sidecar", _fixture_params("llm"))
def test_llm_fixture(path, sidecar, tmp_path):
    folder = path[: -len(".json")]
    model = os.path.join(folder, sidecar["model_file"])
    feeds = _fixture_feeds(sidecar, ("prefill", "decode"))
    proto = onnx.load(model, load_external_data=False)
    specified = _kv_specified(proto)
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    if not nbits:
        check_deployed(model, feeds, _float_compare("fp16" in path), tmp_path, specified)
        return
    # int4: tight against onnxruntime on the model with activations in float32 (accuracy_level 0)
    # on both sides; the builder's model (accuracy_level 4: int8 activations in onnxruntime, and
    # in onnxpack's int8 GEMV where it runs, float32 elsewhere) loosely below.
    full = onnx.load(model)
    for node in full.graph.node:
        for attr in node.attribute:
            if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                attr.i = 0
    exact = (tmp_path / "acc0").with_suffix(".onnx")
    onnx.save(full, str(exact))
    tight = _float_compare(False)
    for f, want in zip(feeds, (ort_run(str(exact), f) for f in feeds)):
        tight(specified(session(str(exact)).run(None, f), f), specified(want, f), "accuracy_level=0 on both sides")

    def loose(got, want, what):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, what
            assert float(np.abs(g - w).max()) <= 0.05 * float(np.abs(w).max()), what

    check_deployed(model, feeds, loose, tmp_path, specified)
