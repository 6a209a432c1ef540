"""Models written by ``onnxruntime.quantization`` run natively and give onnxruntime's outputs.

Every sample model (``models/``: mlp, cnn, transformer) and a small CNN built here (residual Add,
LeakyRelu, Sigmoid, Concat, depthwise conv: the QLinear ops those produce) is quantized with
``quantize_static`` (QDQ per tensor, QDQ per channel, QDQ uint8, QDQ int16 (ai.onnx opset 21),
QDQ int4 weights and QDQ uint16 (com.microsoft Q/DQ), QDQ saved again by onnxruntime's
extended graph optimizations (QLinear ops, QLinearSoftmax among them), QOperator per tensor,
QOperator per channel; MinMax calibration over a small data reader) and ``quantize_dynamic``,
then run by
onnxruntime (graph optimizations off, so it executes the very graph we execute) and by onnxpack
with pre-packing on and off.

Tolerances.  QOperator models end in a DequantizeLinear: outputs must be within one quantization
step of that output scale.  QDQ models compute in float between Q/DQ pairs, where onnxpack's ops
round an ulp apart from onnxruntime's, enough to move a code now and then (with 16-bit
activations, steps of ~1e-5: cnn 10%, transformer 2-4% of the outputs by one step; with 8-bit,
one code of a transformer's attention moved 0.6% of its outputs by up to 7 steps):
``quant_util.assert_qdq_model_close`` compares them end to end allowing for that, and segment by
segment, both runtimes fed onnxruntime's codes, where nothing may differ.  Integer GEMMs of uint8
by int8 weights are compared against onnxruntime's exact products (``quant_util.ort_exact``).  Dynamic models end
in float ops after the integer ones (Mul by the scales, Add, Softmax): rtol 1e-5 and atol 1e-5 of
the output's magnitude (measured <= 5e-7 absolute).  No node may fall back to onnx.reference.
"""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
import onnxpack_sample_models as sample_models
from quant_util import assert_qdq_model_close, ort_exact

quantization = pytest.importorskip("onnxruntime.quantization")

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODES = ["qdq", "qdq-channel", "qdq-uint8", "qdq-int16", "qdq-int4", "qdq-uint16-contrib", "qdq-ortopt",
         "qdq-weightpair", "qop", "qop-channel", "dynamic"]
# integer op -> index of its weight input (pre-packed when it is an initializer)
WEIGHT_INPUT = {"QLinearConv": 3, "QLinearMatMul": 3, "QGemm": 3, "MatMulInteger": 1, "ConvInteger": 1}


class _Reader(quantization.CalibrationDataReader):
    def __init__(self, feeds):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)


def small_cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(3)

    def w(*shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32))

    inits = {"w1": w(8, 3, 3, 3), "b1": w(8), "w2": w(8, 1, 3, 3), "w3": w(4, 3, 1, 1), "wf": w(12, 5), "bf": w(5)}
    for name, t in inits.items():
        t.name = name
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], group=8),
        helper.make_node("LeakyRelu", ["c2"], ["l2"], alpha=0.1),
        helper.make_node("Add", ["l2", "r1"], ["res"]),
        helper.make_node("Conv", ["x", "w3"], ["c3"]),
        helper.make_node("Sigmoid", ["c3"], ["s3"]),
        helper.make_node("Concat", ["res", "s3"], ["cat"], axis=1),
        helper.make_node("MaxPool", ["cat"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["mp"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "wf", "bf"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "small_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], list(inits.values()),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _source(name: str, tmp: pathlib.Path) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    if name == "small_cnn":
        path = tmp / "small_cnn.onnx"
        if not path.exists():
            onnx.save(small_cnn(), str(path))
        return path, {"x": np.random.default_rng(0).standard_normal((1, 3, 12, 12)).astype(np.float32)}
    path = ROOT / "models" / f"{name}.onnx"
    return path, sample_models.sample_inputs(name, onnx.load(str(path), load_external_data=False))


def _calibration(feeds: dict[str, np.ndarray], n: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{k: (v + rng.standard_normal(v.shape).astype(v.dtype) * 0.3) for k, v in feeds.items()} for _ in range(n)]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(model name, mode) -> (quantized model path, feeds), quantized once per module."""
    tmp = tmp_path_factory.mktemp("quantized")
    cache: dict[tuple[str, str], tuple[pathlib.Path, dict]] = {}

    def get(name: str, mode: str):
        key = (name, mode)
        if key not in cache:
            src, feeds = _source(name, tmp)
            out = tmp / f"{name}-{mode}.onnx"
            if mode == "dynamic":
                quantization.quantize_dynamic(str(src), str(out))
            else:
                kwargs = dict(
                    quant_format=quantization.QuantFormat.QOperator if mode.startswith("qop") else quantization.QuantFormat.QDQ,
                    per_channel=mode.endswith("channel"),
                )
                qt = quantization.QuantType
                if mode.endswith("uint8"):
                    kwargs.update(activation_type=qt.QUInt8, weight_type=qt.QUInt8)
                elif mode.endswith("int16"):  # ai.onnx Q/DQ, opset 21
                    kwargs.update(activation_type=qt.QInt16, weight_type=qt.QInt16)
                elif mode.endswith("int4"):  # int4 weights: com.microsoft Q/DQ at the model's opset
                    kwargs.update(activation_type=qt.QUInt8, weight_type=qt.QInt4)
                elif mode.endswith("weightpair"):  # float weights, each through a Q -> DQ pair in the graph
                    kwargs.update(per_channel=True, extra_options={"AddQDQPairToWeight": True})
                elif mode.endswith("uint16-contrib"):
                    kwargs.update(activation_type=qt.QUInt16, weight_type=qt.QUInt8, extra_options={"UseQDQContribOps": True})
                quantization.quantize_static(str(src), str(out), _Reader(_calibration(feeds)), **kwargs)
                if mode == "qdq-ortopt":  # saved by onnxruntime's own graph optimizer (offline)
                    _ort_optimized(out, out)
            cache[key] = (out, feeds)
        return cache[key]

    return get


def _ort_optimized(src: pathlib.Path, out: pathlib.Path) -> None:
    """``src`` as onnxruntime's extended graph optimizations save it: Q/DQ groups become
    QLinearMatMul / QLinearConv and com.microsoft QLinearAdd, QLinearMul, QLinearSoftmax, ... with
    the float ops left between Q/DQ pairs (a model optimized once, offline, then shipped)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out)
    so.log_severity_level = 3
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])


def _ort(path: pathlib.Path, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(ort_exact(str(path)), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _output_steps(model: onnx.ModelProto) -> list[float | None]:
    """The quantization step of each graph output produced by a DequantizeLinear, else None."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    steps = []
    for out in model.graph.output:
        node = producer.get(out.name)
        if node is not None and node.op_type == "DequantizeLinear" and node.input[1] in inits:
            steps.append(float(np.max(inits[node.input[1]])))
        else:
            steps.append(None)
    return steps


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "small_cnn"])
def test_quantized_model_matches_onnxruntime(quantized, name, mode):
    path, feeds = quantized(name, mode)
    model = onnx.load(str(path))
    want = _ort(path, feeds)
    steps = _output_steps(model)
    init_names = {t.name for t in model.graph.initializer}
    n_integer = sum(1 for n in model.graph.node if n.input[WEIGHT_INPUT.get(n.op_type, 0)] in init_names
                    and n.op_type in WEIGHT_INPUT)
    for prepack in (True, False):
        so = onnxpack.SessionOptions()
        if not prepack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        sess = onnxpack.InferenceSession(str(path), so)
        got = sess.run(None, feeds)
        assert sess.get_fallback_nodes() == []
        stats = sess.get_prepack_stats()
        if prepack:
            assert stats["weights_packed"] >= n_integer
        else:
            assert stats["weights_packed"] == 0
        if mode.startswith("qdq"):  # float ops between Q/DQ pairs: see assert_qdq_model_close
            assert_qdq_model_close(model, feeds, got, steps, {} if prepack else {"session.disable_prepacking": "1"})
            continue
        for g, w, step in zip(got, want, steps):
            assert g.dtype == w.dtype and g.shape == w.shape
            if step is not None:
                # one step, up to float32 rounding of the two dequantized products
                assert np.abs(g - w).max() <= step * 1.01, f"more than one output step ({step}) apart"
            else:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def test_quantizer_emits_the_ops_we_serve(quantized):
    """The QOperator small CNN exercises the com.microsoft QLinear ops (a guard: if the quantizer
    stops emitting them, the comparison above no longer covers them)."""
    path, _ = quantized("small_cnn", "qop")
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"QLinearConv", "QLinearAdd", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearConcat",
            "QLinearGlobalAveragePool", "QGemm"} <= ops
    path, _ = quantized("cnn", "dynamic")
    assert {"DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"} <= {n.op_type for n in onnx.load(str(path)).graph.node}


def test_prepacked_quantized_weights_are_saved_and_mapped_back(quantized, tmp_path):
    """Packed integer weights saved next to the model are mapped back (read-only) and give the
    same outputs; nothing is packed on the warm load."""
    path, feeds = quantized("small_cnn", "qop-channel")
    out = tmp_path / "small_cnn.opt.onnx"
    so = onnxpack.SessionOptions()
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    cold = onnxpack.InferenceSession(str(path), so)
    cold_out = cold.run(None, feeds)
    assert cold.get_prepack_stats()["weights_packed"] >= 4
    warm = onnxpack.InferenceSession(str(out))
    stats = warm.get_prepack_stats()
    assert stats["weights_packed"] == 0 and stats["blobs_from_model"] >= 4
    for a, b in zip(warm.run(None, feeds), cold_out):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_float_weights_quantized_in_the_graph_are_packed(quantized, tmp_path, name):
    """``AddQDQPairToWeight`` keeps each weight float behind a QuantizeLinear -> DequantizeLinear
    pair (so do PyTorch's exported quantization-aware models): the pair over a weight is a
    constant, rounded once and packed by the weight's reader, never re-quantized at each run; the
    packs are saved and mapped back (nothing packed warm, the cold outputs bit for bit), and
    onnxruntime runs the saved model as it runs the source."""
    path, feeds = quantized(name, "qdq-weightpair")
    model = onnx.load(str(path))
    inits = {t.name for t in model.graph.initializer}
    packing = {i for n in model.graph.node if n.op_type in ("Conv", "MatMul", "Gemm") for i in n.input}
    dq_of = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    weight_pairs = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in inits
                    and dq_of.get(n.output[0]) in packing]
    assert len(weight_pairs) >= 2  # the quantizer still writes the pairs this test is about
    out = tmp_path / f"{name}.opt.onnx"
    so = onnxpack.SessionOptions()
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    cold = onnxpack.InferenceSession(str(path), so)
    quantizes_weights = [st.node.name for st in cold.program.root.steps
                         if st.node.op_type == "QuantizeLinear" and st.inputs[0] in inits]
    assert quantizes_weights == []
    assert cold.get_prepack_stats()["weights_packed"] >= len(weight_pairs)
    cold_out = cold.run(None, feeds)
    warm = onnxpack.InferenceSession(str(out))
    stats = warm.get_prepack_stats()
    assert stats["weights_packed"] == 0 and stats["blobs_from_model"] >= len(weight_pairs)
    for a, b in zip(warm.run(None, feeds), cold_out):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_ort(out, feeds), _ort(path, feeds)):
        np.testing.assert_array_equal(a, b)


def test_concurrent_runs_share_one_session(quantized):
    """Integer kernels keep no per-call state (the lazily computed weight norms are idempotent):
    four threads running one session give the single-threaded outputs."""
    import threading

    path, feeds = quantized("small_cnn", "qop-channel")
    sess = onnxpack.InferenceSession(str(path))
    rng = np.random.default_rng(5)
    inputs = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    want = [onnxpack.InferenceSession(str(path)).run(None, f)[0] for f in inputs]
    errors = []

    def work(k):
        try:
            for _ in range(5):
                np.testing.assert_array_equal(sess.run(None, inputs[k])[0], want[k])
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
