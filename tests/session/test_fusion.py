"""Conv → BatchNormalization → Relu fusion: when it applies, and that it never changes results."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack.errors import OnnxpackError
from onnxpack.session._fusion import find_conv_fusions

F = TensorProto.FLOAT
RNG = np.random.default_rng(7)


def _w(*shape, positive=False):
    a = RNG.standard_normal(shape).astype(np.float32)
    return np.abs(a) + 0.5 if positive else a


def conv_bn_relu_model(*, bias=True, relu=True, bn=True, extra_reader=None, group=1, bn_stats=None):
    """x(1,4,8,8) -> Conv(3x3, pad 1) -> [BN] -> [Relu] -> y; optionally another reader."""
    cin, cout = 4, 6
    inits = [numpy_helper.from_array(_w(cout, cin // group, 3, 3), "W")]
    conv_in = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(_w(cout), "B"))
        conv_in.append("B")
    nodes = [helper.make_node("Conv", conv_in, ["c"], name="conv", pads=[1, 1, 1, 1], group=group)]
    last = "c"
    if bn:
        scale, shift, mean, var = bn_stats or (_w(cout), _w(cout), _w(cout), _w(cout, positive=True))
        for name, arr in (("s", scale), ("bb", shift), ("m", mean), ("v", var)):
            inits.append(numpy_helper.from_array(arr, name))
        nodes.append(helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["n"], name="bn", epsilon=1e-3))
        last = "n"
    if relu:
        nodes.append(helper.make_node("Relu", [last], ["r"], name="relu"))
        last = "r"
    nodes.append(helper.make_node("Identity", [last], ["y"], name="out"))
    outputs = [helper.make_tensor_value_info("y", F, None)]
    if extra_reader:
        nodes.append(helper.make_node("Neg", [extra_reader], ["z"], name="extra"))
        outputs.append(helper.make_tensor_value_info("z", F, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, cin, 8, 8])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()


def _fused(sess) -> list[str]:
    return [r["node"] for r in sess.get_prepack_log() if "+" in r["node"]]


def _ort(model, feed):
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)


CASES = {
    "conv-bn-relu": dict(),
    "conv-bn": dict(relu=False),
    "conv-relu": dict(bn=False),
    "no-bias": dict(bias=False),
    "groups": dict(group=2),
}


@pytest.mark.parametrize("kwargs", list(CASES.values()), ids=list(CASES))
def test_fused_chain_equals_onnxruntime_and_unfused(kwargs):
    model = conv_bn_relu_model(**kwargs)
    feed = {"x": _w(1, 4, 8, 8)}
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, feed)
        assert _fused(s), "the chain was not fused"
    opts = onnxpack.SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model, opts) as s:
        unfused = s.run(None, feed)
        assert not _fused(s)
    want = _ort(model, feed)
    for a, b, c in zip(got, unfused, want):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)  # float32, BLAS order differs
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reader", ["c", "n"], ids=["conv-output-read-twice", "bn-output-read-twice"])
def test_value_read_elsewhere_is_not_fused_away(reader):
    model = conv_bn_relu_model(extra_reader=reader)
    feed = {"x": _w(1, 4, 8, 8)}
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, feed)
    for a, b in zip(got, _ort(model, feed)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_find_conv_fusions_rules():
    import onnx

    model = onnx.load_from_string(conv_bn_relu_model())
    nodes = list(model.graph.node)
    consts = {t.name for t in model.graph.initializer}
    readers = {n: 1 for node in nodes for n in node.input}
    found = find_conv_fusions(nodes, readers, {"y"}, consts.__contains__, 17)
    assert [(f.conv, f.bn, f.relu) for f in found] == [(0, 1, 2)]
    # BatchNormalization statistics that are not constants: only nothing to fold.
    found = find_conv_fusions(nodes, readers, {"y"}, lambda n: n in {"W", "B"}, 17)
    assert [(f.conv, f.bn, f.relu) for f in found] == []
    # The Conv output is a graph output: must stay materialized.
    found = find_conv_fusions(nodes, readers, {"c"}, consts.__contains__, 17)
    assert found == []


def test_folded_weight_is_saved_and_mapped_and_keyed_by_statistics(tmp_path):
    stats = (_w(6), _w(6), _w(6), _w(6, positive=True))
    model = conv_bn_relu_model(bn_stats=stats)
    src = tmp_path / "m.onnx"
    src.write_bytes(model)
    opts = onnxpack.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "opt.onnx")
    opts.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "64")
    feed = {"x": _w(1, 4, 8, 8)}
    with onnxpack.InferenceSession(str(src), opts) as cold:
        want = cold.run(None, feed)
        cold_keys = {r["key"] for r in cold.get_prepack_log()}
    with onnxpack.InferenceSession(str(tmp_path / "opt.onnx")) as warm:
        stats_warm = warm.get_prepack_stats()
        assert stats_warm["weights_packed"] == 0 and stats_warm["blobs_from_model"] >= 1
        assert any(r["key"].startswith("conv_bn/") for r in warm.get_prepack_log())
        for a, b in zip(warm.run(None, feed), want):
            np.testing.assert_array_equal(a, b)
    # Other statistics, same weight: another key (a folded blob is never reused for them).
    other = conv_bn_relu_model(bn_stats=(stats[0] * 2, stats[1], stats[2], stats[3]))
    with onnxpack.InferenceSession(other) as s:
        assert not ({r["key"] for r in s.get_prepack_log() if r["key"].startswith("conv_bn/")} & cold_keys)


@pytest.mark.parametrize("fused", [False, True], ids=["conv", "fused-conv-bn-relu"])
def test_conv_run_into_writes_the_given_buffer(fused):
    """The planner's arena path: ``run_into`` must fill ``outs[0]`` and say so (a ``False``
    makes the executor compute the node a second time)."""
    from onnxpack.session.kernels import KernelContext
    from onnxpack.session.kernels.conv import Conv, FusedConv

    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1])
    ctx = KernelContext(opset=17, opsets={"": 17})
    x, w, b = _w(1, 4, 8, 8), _w(6, 4, 3, 3), _w(6)
    if fused:
        kernel = FusedConv(node, ctx, multiplier=np.abs(_w(6)) + 0.1, shift=_w(6), relu=True)
    else:
        kernel = Conv(node, ctx)
    want = kernel.run(x, w, b)[0]
    out = np.full(want.shape, np.nan, np.float32)
    assert kernel.run_into((out,), x, w, b) is True
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("op,n_inputs", [("Add", 2), ("Sum", 3), ("Sum", 1), ("Mul", 2), ("Sub", 2)],
                         ids=["add", "sum3", "sum1-returns-its-input", "mul", "sub"])
def test_elementwise_then_relu_is_fused_and_never_writes_an_input(op, n_inputs):
    names = [f"x{k}" for k in range(n_inputs)]
    nodes = [helper.make_node(op, names, ["s"], name="op"), helper.make_node("Relu", ["s"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, [2, 5]) for n in names],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    feed = {n: _w(2, 5) for n in names}
    before = {n: v.copy() for n, v in feed.items()}
    with onnxpack.InferenceSession(model) as s:
        assert [st.node.name for st in s.program.root.steps] == ["op+relu"]
        got = s.run(None, feed)
    for n in names:
        np.testing.assert_array_equal(feed[n], before[n])  # the caller's arrays are untouched
    np.testing.assert_allclose(got[0], _ort(model, feed)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("acts", ["relu", "clip", "clip-min", "relu-clip"])
def test_elementwise_then_relu_and_clip_equal_onnxruntime_bit_for_bit(acts, dtype):
    """Add followed by Relu / Clip (ActAfter's direct numpy passes): onnxruntime's values bit for
    bit over NaN, infinities and values at the bounds, in every dtype the ops take; no warning."""
    import warnings

    T = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inits, prev = [helper.make_node("Add", ["a", "b"], ["s"], name="add")], [], "s"
    for k, act in enumerate(acts.split("-")):
        out = "y" if k == len(acts.split("-")) - 1 else f"t{k}"
        if act == "relu":
            nodes.append(helper.make_node("Relu", [prev], [out], name=f"act{k}"))
        else:
            lo = numpy_helper.from_array(np.array(-1.5 if dtype != np.int32 else -1, dtype), f"lo{k}")
            hi = numpy_helper.from_array(np.array(6.0 if dtype != np.int32 else 6, dtype), f"hi{k}")
            inits += [lo, hi] if act == "clip" else [lo]
            nodes.append(helper.make_node("Clip", [prev, f"lo{k}"] + ([f"hi{k}"] if act == "clip" else []), [out],
                                          name=f"act{k}"))
        prev = out
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, T, [3, 8]) for n in "ab"],
                              [helper.make_tensor_value_info("y", T, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    rng = np.random.default_rng(5)
    if dtype == np.int32:
        a = rng.integers(-20, 20, (3, 8)).astype(dtype)
    else:
        a = (rng.standard_normal((3, 8)) * 4).astype(dtype)
        a[0, :6] = [np.nan, np.inf, -np.inf, 6.0, -1.5, -0.0]
    b = np.zeros((3, 8), dtype)
    with onnxpack.InferenceSession(model) as s:
        kinds = [type(st.kernel).__name__ for st in s.program.root.steps]
        assert (kinds[0] == "ActAfter") == acts.startswith("relu"), kinds  # Clip after Add stays a node
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = [s.run(None, {"a": a, "b": b})[0] for _ in range(3)]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # its Relu+Clip fusion
    # fails at load on int32 and float64 ('Unexpected data type for Clip'): the nodes as written
    want = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, {"a": a, "b": b})[0]
    for g in got:
        assert g.dtype == want.dtype
        np.testing.assert_array_equal(g.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", ["fed-scale", "constant-no-conv", "training", "two-outputs"])
def test_batchnorm_then_relu_is_fused_when_bn_stays_a_node(case, dtype):
    """BatchNormalization whose statistics are fed at run time (graph inputs: no Conv can fold
    it) or that follows no Conv clamps in place; training mode (onnx.reference) and a BN with its
    running statistics as outputs (opset 9) keep their Relu.  Equal to onnxruntime either way."""
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(5)
    stats = {"mean": rng.standard_normal(4), "var": rng.random(4) + 0.5}
    fed = {"x": rng.standard_normal((2, 4, 3, 5)).astype(dtype)}
    fed["x"][0, 0, 0, :2] = [0.0, -0.0]  # signed zeros and a NaN pass through as the unfused pair's
    fed["x"][1, 3, 2, 4] = np.nan
    params = {"scale": rng.standard_normal(4), "bias": rng.standard_normal(4)}
    opset, outs, attrs = 17, ["b"], {}
    if case == "fed-scale":
        fed.update({k: v.astype(dtype) for k, v in params.items()})
        inits = [numpy_helper.from_array(v.astype(dtype), k) for k, v in stats.items()]
    else:
        inits = [numpy_helper.from_array(v.astype(dtype), k) for k, v in {**params, **stats}.items()]
    if case == "training":
        attrs = {"training_mode": 1}
    if case == "two-outputs":  # (training mode in opset 9: see the test below)
        opset, outs = 9, ["b", "rm", "rv", "sm", "sv"]
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], outs, name="bn", **attrs),
             helper.make_node("Relu", ["b"], ["y"], name="relu")]
    inputs = [helper.make_tensor_value_info(n, t, list(v.shape)) for n, v in fed.items()]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", t, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8).SerializeToString()
    before = {n: v.copy() for n, v in fed.items()}
    with onnxpack.InferenceSession(model) as s:
        names = [st.node.name for st in s.program.root.steps]
        assert names == (["bn+relu"] if case in ("fed-scale", "constant-no-conv") else ["bn", "relu"])
        got = s.run(None, fed)
        from onnxpack.session.kernels import _act

        if names == ["bn+relu"] and dtype == np.float32 and _act.jit() is not None:
            kernel = s.program.root.steps[0].kernel
            calls = []
            real = kernel._fused
            kernel._fused = lambda *a: calls.append(1) or real(*a)
            np.testing.assert_array_equal(s.run(None, fed)[0], got[0])
            assert calls  # the one-pass path ran
    for n in fed:
        np.testing.assert_array_equal(fed[n], before[n])
    if case == "training":
        return  # onnxruntime runs no training-mode BatchNormalization; onnx.reference computed it
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == np.float32 else dict(rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(got[0].astype(np.float32), _ort(model, fed)[0].astype(np.float32), **tol)
    # The fused pair (float32: BatchNormalization's run_acts, its + B and the Relu in one JIT
    # pass) gives the unfused kernels' very bits.
    opts = onnxpack.SessionOptions()
    opts.graph_optimization_level = onnxpack.GraphOptimizationLevel.ORT_DISABLE_ALL
    with onnxpack.InferenceSession(model, opts) as plain:
        assert len(plain.program.root.steps) == 2
        np.testing.assert_array_equal(got[0], plain.run(None, fed)[0])


@pytest.mark.parametrize("opset", [7, 9, 13])
@pytest.mark.parametrize("spatial", [1, 0], ids=["spatial", "per-activation"])
def test_batchnorm_with_its_statistics_outputs_is_training_mode_as_onnxruntime(opset, spatial):
    """Opsets 7-13: a BatchNormalization asked for its running and saved statistics normalizes by
    the batch's own statistics (onnxruntime's training mode); all five outputs equal its."""
    if spatial == 0 and opset >= 9:
        pytest.skip("spatial is an attribute of opsets 7-8 only")
    rng = np.random.default_rng(7)
    shape = (3, 4) if spatial else (4, 3, 5)
    stats = {"scale": rng.standard_normal(shape), "bias": rng.standard_normal(shape),
             "mean": rng.standard_normal(shape), "var": rng.random(shape) + 0.5}
    if spatial:
        stats = {k: v[0] for k, v in stats.items()}
    attrs = {"momentum": 0.8, "epsilon": 1e-3}
    if opset < 9:
        attrs["spatial"] = spatial
    outs = ["y", "rm", "rv", "sm", "sv"]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], outs, name="bn", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, [2, 4, 3, 5])],
                              [helper.make_tensor_value_info(o, F, None) for o in outs],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in stats.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8).SerializeToString()
    feed = {"x": rng.standard_normal((2, 4, 3, 5)).astype(np.float32)}
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, feed)
    if spatial == 0:  # onnxruntime refuses it ("Training mode only supports spatial BN"): the spec's formulas
        x = feed["x"].astype(np.float64)
        bm, bv = x.mean(axis=0), x.var(axis=0)
        inv = 1 / np.sqrt(bv + 1e-3)
        want = [(x - bm) * inv * stats["scale"] + stats["bias"], 0.8 * stats["mean"] + 0.2 * bm,
                0.8 * stats["var"] + 0.2 * bv, bm, inv]
    else:
        want = _ort(model, feed)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# -- QuantizeLinear -> DequantizeLinear ("fake quantization") ----------------------------------
def qdq_model(zp: np.ndarray, scale: np.ndarray, *, axis: int = 1, opset: int = 17, dq_scale=None,
              extra_q_reader: bool = False, q_output: bool = False, x_shape=(2, 3, 5)) -> bytes:
    """x(2,3,5) -> QuantizeLinear -> DequantizeLinear -> Identity -> y."""
    zt = helper.np_dtype_to_tensor_dtype(zp.dtype)
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "z")]
    dq_in = ["q", "s", "z"]
    if dq_scale is not None:
        inits.append(numpy_helper.from_array(dq_scale, "s2"))
        dq_in = ["q", "s2", "z"]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q", axis=axis),
             helper.make_node("DequantizeLinear", dq_in, ["d"], name="dq", axis=axis),
             helper.make_node("Identity", ["d"], ["y"], name="out")]
    outputs = [helper.make_tensor_value_info("y", F, None)]
    if extra_q_reader:
        nodes.append(helper.make_node("Cast", ["q"], ["qc"], to=F))
        outputs.append(helper.make_tensor_value_info("qc", F, None))
    if q_output:
        outputs.append(helper.make_tensor_value_info("q", zt, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, list(x_shape))], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9).SerializeToString()


def _hard_values(scale: float) -> np.ndarray:
    """Ties, signed zeros after rounding, saturation both ways, NaN and infinities."""
    special = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -0.3, 0.3, -0.0, 0.0, 1e9, -1e9, np.nan, np.inf, -np.inf,
                        126.5, 127.5, -128.5, 254.5, 255.5], np.float32)
    x = np.concatenate([special * np.float32(scale), RNG.standard_normal(30 - special.size).astype(np.float32) * 3])
    return x[:30].reshape(2, 3, 5)


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))  # NaN payloads, -0.0 vs +0.0


FQ_CASES = {
    "uint8": (np.array(128, np.uint8), np.array(0.05, np.float32), 17),
    "int8-zero": (np.array(0, np.int8), np.array(0.03, np.float32), 17),
    "int8": (np.array(-7, np.int8), np.array(0.02, np.float32), 17),
    "per-axis": (np.array([3, 0, 250], np.uint8), np.array([0.01, 0.2, 0.05], np.float32), 17),
    "int16": (np.array(-300, np.int16), np.array(1e-3, np.float32), 21),
    "uint16": (np.array(40000, np.uint16), np.array(2e-3, np.float32), 21),
}


@pytest.mark.parametrize("jit", ["numba", "numpy"])
@pytest.mark.parametrize("zp,scale,opset", list(FQ_CASES.values()), ids=list(FQ_CASES))
def test_fake_quant_pair_is_fused_and_bit_identical(zp, scale, opset, jit, monkeypatch):
    """The fused pair gives the unfused pair's and onnxruntime's bits: rounding ties to even,
    saturation, NaN to the lowest code, -0.0 after rounding becoming +0.0 as the integer does —
    with the numba kernel and with its numpy twin (``ONNXPACK_DISABLE_JIT=1``)."""
    if jit == "numba":
        pytest.importorskip("numba")
    else:
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    model = qdq_model(zp, scale, opset=opset)
    x = {"x": _hard_values(float(np.max(scale)))}
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, x)[0]
        assert [st.node.name for st in s.program.root.steps] == ["q+dq", "out"]
    opts = onnxpack.SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model, opts) as s:
        unfused = s.run(None, x)[0]
        assert [st.node.op_type for st in s.program.root.steps] == ["QuantizeLinear", "DequantizeLinear", "Identity"]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, x)[0]
    _same_bits(got, unfused)
    _same_bits(got, want)


@pytest.mark.parametrize("case", ["per-tensor", "per-axis"])
def test_fake_quant_pair_runs_of_changing_shapes_keep_onnxruntimes_bits(case):
    """The fused pair keeps its scale's and zero point's arrays for the numba kernel between runs
    of one input shape (``FakeQuant._memo``): runs alternating between shapes (and a per-axis
    scale laid out anew for each) give onnxruntime's bits every time."""
    pytest.importorskip("numba")
    zp, scale, opset = FQ_CASES["uint8" if case == "per-tensor" else "per-axis"]
    model = qdq_model(zp, scale, opset=opset, x_shape=("n", 3, "w"))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    with onnxpack.InferenceSession(model) as s:
        assert [st.node.name for st in s.program.root.steps] == ["q+dq", "out"]
        for shape in [(2, 3, 5), (2, 3, 5), (4, 3, 7), (2, 3, 5), (1, 3, 1), (4, 3, 7)]:
            x = {"x": (RNG.standard_normal(shape) * 3).astype(np.float32)}
            _same_bits(s.run(None, x)[0], ref.run(None, x)[0])


def test_fake_quant_kernel_reads_a_read_only_scale_that_changed():
    """The fused pair's kernel keeps its numba arrays while the same read-only scale and zero
    point come with the same values; the same objects with other values (set writable, written,
    set read-only again) are laid out anew: the pair's arithmetic on the new values."""
    pytest.importorskip("numba")  # (the numpy path keeps nothing)
    from onnxpack.session.kernels import KernelContext
    from onnxpack.session.kernels.qdq import FakeQuant

    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], name="q+dq")
    kernel = FakeQuant(node, KernelContext(opset=13, opsets={"": 13}), axis=1, low=0, high=255)
    scale, zp = np.array(0.05, np.float32), np.array(128, np.uint8)
    for v in (scale, zp):
        v.flags.writeable = False
    x = (RNG.standard_normal((3, 4)) * 40).astype(np.float32)  # (most codes saturate: the zero point tells)
    for step in range(3):
        (got,) = kernel.run(x, scale, zp)
        z = np.float32(zp)
        want = (np.clip(np.rint(x / scale) + z, 0, 255) - z) * scale
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=f"step {step}")
        for v in (scale, zp):
            v.flags.writeable = True
        scale *= 4
        zp -= 50
        for v in (scale, zp):
            v.flags.writeable = False


@pytest.mark.parametrize("jit", ["numba", "numpy"])
@pytest.mark.parametrize("value", [1.0, -0.3, 1e9, np.nan])
def test_fake_quant_pair_on_a_scalar_keeps_its_shape(value, jit, monkeypatch):
    """A pair on a rank-0 tensor (onnxruntime's quantizer puts them on a model's shape arithmetic:
    MobileViT's patch sizes) gives a rank-0 result, onnxruntime's bits: the numba kernel's input
    made contiguous stays 0-d, and numpy's 0-d arithmetic (a scalar, not an array) still runs in
    place."""
    if jit == "numba":
        pytest.importorskip("numba")
    else:
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    model = qdq_model(np.array(-128, np.int8), np.array(0.03, np.float32), x_shape=())
    x = {"x": np.array(value, np.float32)}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, x)[0]
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, x)[0]
        assert [st.node.name for st in s.program.root.steps] == ["q+dq", "out"]
    _same_bits(np.asarray(got), want)


@pytest.mark.parametrize("case", ["q-read-twice", "q-is-output", "other-scale"])
def test_fake_quant_pair_not_fused(case):
    zp, scale = np.array(128, np.uint8), np.array(0.05, np.float32)
    kwargs = {"q-read-twice": dict(extra_q_reader=True), "q-is-output": dict(q_output=True),
              "other-scale": dict(dq_scale=np.array(0.06, np.float32))}[case]
    model = qdq_model(zp, scale, **kwargs)
    x = {"x": _hard_values(0.05)}
    with onnxpack.InferenceSession(model) as s:
        assert not any("+" in (st.node.name or "") for st in s.program.root.steps)
        got = s.run(None, x)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for g, w in zip(got, ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, x)):
        np.testing.assert_array_equal(g, w)


# -- BatchNormalization -> fake-quant pair (-> Relu): a QDQ model's standalone BN ----------------
def bn_qdq_model(*, relu: bool, stats_as_inputs: bool, x_type: int = F) -> bytes:
    """x(1,5,6,7) -> BatchNormalization -> QuantizeLinear -> DequantizeLinear [-> Relu] -> y, as
    onnxruntime's quantizer writes a BN it could not fold: scale and mean as dequantized int8
    constants (their DequantizeLinear nodes read by the BN, which packs nothing), bias and var
    plain initializers, with ``stats_as_inputs`` also graph inputs (overridable by a feed, as in
    the light ResNet-50 that onnxruntime's quantizer leaves such BNs in)."""
    rng = np.random.default_rng(5)
    c = 5
    s_scale, m_scale = np.float32(0.02), np.float32(0.05)
    inits = [numpy_helper.from_array(rng.integers(-120, 120, c).astype(np.int8), "s_q"),
             numpy_helper.from_array(s_scale, "s_s"), numpy_helper.from_array(np.int8(3), "s_z"),
             numpy_helper.from_array(rng.integers(-120, 120, c).astype(np.int8), "m_q"),
             numpy_helper.from_array(m_scale, "m_s"), numpy_helper.from_array(np.int8(0), "m_z"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
             numpy_helper.from_array((rng.random(c) + 0.2).astype(np.float32), "v"),
             numpy_helper.from_array(np.float32(0.04), "y_s"), numpy_helper.from_array(np.uint8(120), "y_z")]
    nodes = [helper.make_node("DequantizeLinear", ["s_q", "s_s", "s_z"], ["s"], name="dq_s"),
             helper.make_node("DequantizeLinear", ["m_q", "m_s", "m_z"], ["m"], name="dq_m"),
             helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["n"], name="bn", epsilon=1e-3),
             helper.make_node("QuantizeLinear", ["n", "y_s", "y_z"], ["nq"], name="q"),
             helper.make_node("DequantizeLinear", ["nq", "y_s", "y_z"], ["nd"], name="dq")]
    last = "nd"
    if relu:
        nodes.append(helper.make_node("Relu", ["nd"], ["r"], name="relu"))
        last = "r"
    nodes.append(helper.make_node("Identity", [last], ["y"], name="out"))
    inputs = [helper.make_tensor_value_info("x", x_type, [1, c, 6, 7])]
    if stats_as_inputs:
        inputs += [helper.make_tensor_value_info(n, F, [c]) for n in ("b", "v")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", F, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("jit", ["numba", "numpy"])
@pytest.mark.parametrize("stats_as_inputs", [False, True], ids=["stats-constant", "stats-graph-inputs"])
@pytest.mark.parametrize("relu", [False, True], ids=["bn-qdq", "bn-qdq-relu"])
def test_batchnorm_then_fake_quant_pair_is_one_step(relu, stats_as_inputs, jit, monkeypatch):
    """A BatchNormalization that stays a node, quantized after: one step (the BN with the pair,
    and a Relu after it, as its epilogue), and its dequantized int8 statistics folded at creation
    (no DequantizeLinear step left: they are small constants computed from weights).  Bit for bit
    the unfused nodes (pre-packing off: every node its own step) with the JIT and with numpy,
    also with the overridable statistics fed; within one quantization step of onnxruntime (its
    BN rounds ``x * A + B`` its own way: a value at a rounding tie may land one code over)."""
    if jit == "numba":
        pytest.importorskip("numba")
    else:
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    model = bn_qdq_model(relu=relu, stats_as_inputs=stats_as_inputs)
    x = RNG.standard_normal((1, 5, 6, 7)).astype(np.float32) * 3
    feeds = [{"x": x}]
    if stats_as_inputs:
        feeds.append({"x": x, "b": np.linspace(-1, 1, 5, dtype=np.float32), "v": np.full(5, 0.7, np.float32)})
    with onnxpack.InferenceSession(model) as s:
        kinds = [(st.node.op_type, type(st.kernel).__name__) for st in s.program.root.steps]
        assert kinds == [("BatchNormalization", "ActAfter"), ("Identity", "Identity")], kinds
        assert [a.kind for a in s.program.root.steps[0].kernel.acts] == ["fakequant"] + ["relu"] * relu
        got = [s.run(None, f)[0] for f in feeds]
    opts = onnxpack.SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model, opts) as s:
        assert "BatchNormalization" in [st.node.op_type for st in s.program.root.steps]
        unfused = [s.run(None, f)[0] for f in feeds]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    o = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    for g, u, f in zip(got, unfused, feeds):
        _same_bits(g, u)
        want = o.run(None, f)[0]
        steps = np.abs(g.astype(np.float64) - want) / 0.04
        assert steps.max() <= 1 + 1e-6 and (steps > 1e-6).mean() <= 0.05, (steps.max(), (steps > 1e-6).mean())
    if stats_as_inputs:
        assert not np.array_equal(got[0], got[1])  # the fed statistics were used


def test_batchnorm_fake_quant_epilogue_refuses_a_non_float32_input():
    """QuantizeLinear with a float32 scale reads float32 (onnxruntime refuses the model): a
    double BN fused with the pair is a clear error, not a quantization in another precision."""
    model = bn_qdq_model(relu=False, stats_as_inputs=False, x_type=TensorProto.DOUBLE)
    with onnxpack.InferenceSession(model) as s:
        with pytest.raises(OnnxpackError, match="float32 input, got float64"):
            s.run(None, {"x": np.ones((1, 5, 6, 7))})


# -- MatMulNBits -> bias Add -> activations ------------------------------------------------------
def nbits_model(dtype, *, bias: bool, act: str | None, extra_reader: bool = False, own_bias: bool = False) -> bytes:
    """``MatMulNBits`` (K 64, N 48, 4 bits, block 32, zero points) then optionally an ``Add`` of a
    constant bias and an activation: ``silu`` (Sigmoid + Mul, onnxruntime-genai's gate) or
    ``relu``; ``extra_reader`` makes the product a second graph output; ``own_bias`` gives the
    MatMulNBits its own bias input."""
    rng = np.random.default_rng(21)
    k, n, bs = 64, 48, 32
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, k // bs, bs // 2), dtype=np.uint8), "B"),
             numpy_helper.from_array((rng.random(n * k // bs) * 0.05 + 0.01).astype(dtype), "S"),
             numpy_helper.from_array(rng.integers(0, 256, (n, 1), dtype=np.uint8), "Z"),
             numpy_helper.from_array(rng.standard_normal(n).astype(dtype), "bias")]
    ins = ["x", "B", "S", "Z"] + (["", "bias"] if own_bias else [])
    nodes = [helper.make_node("MatMulNBits", ins, ["p"], name="mm", domain="com.microsoft", K=k, N=n, bits=4,
                              block_size=bs, accuracy_level=4)]
    last = "p"
    if bias:
        nodes.append(helper.make_node("Add", [last, "bias"], ["pb"], name="add"))
        last = "pb"
    if act == "silu":
        nodes += [helper.make_node("Sigmoid", [last], ["sg"], name="sig"),
                  helper.make_node("Mul", [last, "sg"], ["y"], name="mul")]
        last = "y"
    elif act == "relu":
        nodes.append(helper.make_node("Relu", [last], ["y"], name="relu"))
        last = "y"
    outs = [helper.make_tensor_value_info(last, t, None)]
    if extra_reader:
        outs.append(helper.make_tensor_value_info("p", t, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", t, [3, k])], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=9)
    return model.SerializeToString()


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("bias,act", [(True, None), (True, "silu"), (False, "silu"), (False, "relu")],
                         ids=["bias", "bias-silu", "silu", "relu"])
def test_nbits_bias_and_activation_fuse_and_equal_onnxruntime(bias, act, dtype, jit_path):
    """The chain runs as one MatMulNBits step (bias as its input, activations in place; float16's
    bias Add a step of its own) on every compute path and equals the unfused chain (prepacking off: each node its own kernel) --
    float32 to 1e-6, float16 to a float16 ulp (the fused chain rounds once) -- and onnxruntime
    within 2 % of the output's scale (its accuracy_level 4 rounds A to int8)."""
    model = nbits_model(dtype, bias=bias, act=act)
    feed = {"x": np.random.default_rng(22).standard_normal((3, 64)).astype(dtype)}
    with onnxpack.InferenceSession(model) as s:
        names = [st.node.name for st in s.program.root.steps]
        got = s.run(None, feed)[0]
    if dtype == np.float16 and bias:
        # (a float16 MatMulNBits rounds its result before the bias Add, in onnxruntime too: the
        # Add stays a step, with the activations after it)
        assert names[0].startswith("mm") and "add" in names, names
    else:
        assert len(names) == 1 and names[0].startswith("mm"), names
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")  # no prepacking: no fusion
    with onnxpack.InferenceSession(model, so) as s:
        assert len(s.program.root.steps) > 1
        unfused = s.run(None, feed)[0]
    ort_y = _ort(model, feed)[0]
    assert got.dtype == unfused.dtype == np.dtype(dtype)
    if dtype == np.float32:
        np.testing.assert_allclose(got, unfused, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_allclose(got.astype(np.float32), unfused.astype(np.float32), rtol=2e-3, atol=2e-3)
    scale = float(np.abs(ort_y.astype(np.float32)).max())
    np.testing.assert_allclose(got.astype(np.float32), ort_y.astype(np.float32), rtol=0, atol=2e-2 * scale)


def gated_model(dtype, *, up_first: bool = False, up_read_elsewhere: bool = False, other_input: bool = False,
                 up_bias: bool = False, k: int = 64, n: int = 48) -> bytes:
    """The gated MLP of onnxruntime-genai's Llama/Qwen decoders: ``Mul(SiLU(gate(x)), up(x))``
    with two MatMulNBits (K 64, N 48 unless given; the gate with zero points, the up projection without) and
    a down projection after it.  ``up_first``: ``Mul(up, act)``; ``up_read_elsewhere``: the up
    projection is also a graph output; ``other_input``: the up projection reads another input;
    ``up_bias``: the up projection has its own bias input."""
    rng = np.random.default_rng(31)
    bs = 32
    nbg, nbd = k // bs, -(-n // bs)  # blocks of the gate/up weights and of the down projection's
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, k // bs, bs // 2), dtype=np.uint8), "Bg"),
             numpy_helper.from_array((rng.random(n * k // bs) * 0.05 + 0.01).astype(dtype), "Sg"),
             numpy_helper.from_array(rng.integers(0, 256, (n, -(-nbg // 2)), dtype=np.uint8), "Zg"),
             numpy_helper.from_array(rng.integers(0, 256, (n, k // bs, bs // 2), dtype=np.uint8), "Bu"),
             numpy_helper.from_array((rng.random(n * k // bs) * 0.05 + 0.01).astype(dtype), "Su"),
             numpy_helper.from_array(rng.standard_normal(n).astype(dtype), "bu"),
             numpy_helper.from_array(rng.integers(0, 256, (k, nbd, bs // 2), dtype=np.uint8), "Bd"),
             numpy_helper.from_array((rng.random(k * nbd) * 0.05 + 0.01).astype(dtype), "Sd")]
    attrs = dict(domain="com.microsoft", K=k, N=n, bits=4, block_size=bs, accuracy_level=4)
    up_in = "x2" if other_input else "x"
    nodes = [helper.make_node("MatMulNBits", ["x", "Bg", "Sg", "Zg"], ["g"], name="gate", **attrs),
             helper.make_node("Sigmoid", ["g"], ["gs"], name="sig"),
             helper.make_node("Mul", ["g", "gs"], ["act"], name="silu"),
             helper.make_node("MatMulNBits", [up_in, "Bu", "Su"] + (["", "", "bu"] if up_bias else []), ["u"],
                              name="up", **attrs),
             helper.make_node("Mul", ["u", "act"] if up_first else ["act", "u"], ["h"], name="mul"),
             helper.make_node("MatMulNBits", ["h", "Bd", "Sd"], ["y"], name="down", domain="com.microsoft", K=n, N=k,
                              bits=4, block_size=bs, accuracy_level=4)]
    ins = [helper.make_tensor_value_info("x", t, ["m", k])]
    if other_input:
        ins.append(helper.make_tensor_value_info("x2", t, ["m", k]))
    outs = [helper.make_tensor_value_info("y", t, None)]
    if up_read_elsewhere:
        outs.append(helper.make_tensor_value_info("u", t, None))
    graph = helper.make_graph(nodes, "g", ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=9)
    return model.SerializeToString()


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("rows", [1, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("variant", ["act-up", "up-act", "up-bias"])
def test_gated_nbits_mlp_runs_as_one_step_and_equals_the_nodes(variant, rows, dtype, jit_path, tmp_path):
    """gate -> SiLU, up, Mul run as one ``nbits_gated`` step, equal to the unfused nodes (prepacking
    off) -- float32 to 1e-6, float16 to a float16 ulp of the scale -- and to onnxruntime within 2 % of
    the output's scale (its accuracy_level 4 rounds A to int8); the saved model warm-starts from its
    blobs (both projections' packs mapped, none made) with the same result."""
    model = gated_model(dtype, up_first=variant == "up-act", up_bias=variant == "up-bias")
    feed = {"x": np.random.default_rng(32).standard_normal((rows, 64)).astype(dtype)}
    with onnxpack.InferenceSession(model) as s:
        kinds = [type(st.kernel).__name__ for st in s.program.root.steps]
        got = s.run(None, feed)[0]
    assert kinds == ["GatedMatMulNBits", "MatMulNBits"], kinds
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")  # no prepacking: no fusion
    with onnxpack.InferenceSession(model, so) as s:
        assert len(s.program.root.steps) == 6
        unfused = s.run(None, feed)[0]
    assert got.dtype == unfused.dtype == np.dtype(dtype)
    scale = float(np.abs(unfused.astype(np.float32)).max())
    tol = 1e-6 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(got.astype(np.float32), unfused.astype(np.float32), rtol=tol, atol=tol * scale)
    ort_y = _ort(model, feed)[0].astype(np.float32)
    np.testing.assert_allclose(got.astype(np.float32), ort_y, rtol=0, atol=2e-2 * float(np.abs(ort_y).max()))
    src = tmp_path / "m.onnx"
    src.write_bytes(model)
    save = onnxpack.SessionOptions()
    save.optimized_model_filepath = str(tmp_path / "opt.onnx")
    save.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    onnxpack.InferenceSession(str(src), save).close()
    with onnxpack.InferenceSession(str(tmp_path / "opt.onnx")) as s:
        stats = s.get_prepack_stats()
        warm = s.run(None, feed)[0]
    assert stats["weights_packed"] == 0 and stats["blobs_from_model"] >= 5, stats
    np.testing.assert_array_equal(warm, got)


@pytest.mark.parametrize("jit_path", ["native"], indirect=True)
@pytest.mark.parametrize("rows", [1, 5], ids=["decode", "prefill"])
def test_gated_nbits_gate_and_up_in_one_parallel_region(rows, jit_path, monkeypatch):
    """With the native code cache and two threads, the gate and up GEMVs of a gated MLP large
    enough for the parallel GEMV run as one OpenMP region (``_jit_native.gemv_pair``): the same
    values, bit for bit, as the two GEMVs called apart, and onnxruntime's within 2 % of the scale."""
    from onnxpack.session.kernels import _act, _jit_native, quant

    if _act.threads() < 2 or not quant._parallel_ok():
        pytest.skip("one thread here: the GEMVs run serially, never paired")
    model = gated_model(np.float32, k=256, n=8192)  # K * N above quant.JIT_SERIAL_BELOW
    feed = {"x": np.random.default_rng(34).standard_normal((rows, 256)).astype(np.float32)}
    calls = []
    pair = _jit_native._Kernels.gemv_pair
    monkeypatch.setattr(_jit_native._Kernels, "gemv_pair", staticmethod(lambda *a: calls.append(1) or pair(*a)))
    monkeypatch.setattr(quant, "_stall_guard", quant._StallGuard())
    with onnxpack.InferenceSession(model) as s:
        assert [type(st.kernel).__name__ for st in s.program.root.steps] == ["GatedMatMulNBits", "MatMulNBits"]
        paired = s.run(None, feed)[0]
        assert calls, "the gate and up GEMVs were not paired"
        monkeypatch.setattr(quant.GatedMatMulNBits, "_paired", lambda self, a: None)
        apart = s.run(None, feed)[0]
    np.testing.assert_array_equal(paired, apart)
    ort_y = _ort(model, feed)[0]
    np.testing.assert_allclose(paired, ort_y, rtol=0, atol=2e-2 * float(np.abs(ort_y).max()))


@pytest.mark.parametrize("case", ["up-read-elsewhere", "up-reads-another-input"])
def test_gated_nbits_mlp_not_fused(case):
    """The up projection's product read by anything else, or computed from another input: the gate
    chain fuses alone and the results equal onnxruntime's."""
    model = gated_model(np.float32, up_read_elsewhere=case == "up-read-elsewhere",
                        other_input=case == "up-reads-another-input")
    rng = np.random.default_rng(33)
    feed = {"x": rng.standard_normal((3, 64)).astype(np.float32)}
    if case == "up-reads-another-input":
        feed["x2"] = rng.standard_normal((3, 64)).astype(np.float32)
    with onnxpack.InferenceSession(model) as s:
        kinds = [type(st.kernel).__name__ for st in s.program.root.steps]
        got = s.run(None, feed)
    assert "GatedMatMulNBits" not in kinds and "ActAfter" in kinds, kinds
    for a, b in zip(got, _ort(model, feed)):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * float(np.abs(b).max()))


@pytest.mark.parametrize("case", ["product-read-elsewhere", "has-own-bias"])
def test_nbits_chain_not_fused(case):
    """A product that is also a graph output is not fused away; a MatMulNBits with its own bias
    input keeps the Add (there is no slot for a second bias)."""
    if case == "product-read-elsewhere":
        model = nbits_model(np.float32, bias=True, act="silu", extra_reader=True)
    else:
        model = nbits_model(np.float32, bias=True, act=None, own_bias=True)
    feed = {"x": np.random.default_rng(23).standard_normal((3, 64)).astype(np.float32)}
    with onnxpack.InferenceSession(model) as s:
        names = [st.node.name for st in s.program.root.steps]
        got = s.run(None, feed)
    assert len(names) >= 2, names
    for a, b in zip(got, _ort(model, feed)):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * float(np.abs(b).max()))


# -- fake-quant pairs and BatchNormalization in a Conv's epilogue (QDQ models) ----------------------
def _fq(nodes, inits, x, name, scale, zp):
    """x -> QuantizeLinear -> DequantizeLinear (per tensor) -> returns the DQ output name."""
    inits += [numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"), numpy_helper.from_array(zp, f"{name}_z")]
    nodes += [helper.make_node("QuantizeLinear", [x, f"{name}_s", f"{name}_z"], [f"{name}_q"], name=f"{name}_q"),
              helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_d"],
                               name=f"{name}_dq")]
    return f"{name}_d"


def qdq_conv_block_model(kind: str) -> tuple[bytes, dict, float]:
    """A QDQ residual block as onnxruntime.quantization writes it: every activation through a
    Q -> DQ pair, int8 per-channel weights through DequantizeLinear, BatchNormalization after the
    Conv's pair (so it cannot fold into the weight), a Sum of two such branches, Relu, a last
    pair.  ``kind`` picks the Conv path of the 3x3 branch: im2col, direct (RGB-stem sized),
    depthwise, Winograd.  Returns the model, a feed and the last pair's scale."""
    cin, cout, hw, group = {"im2col": (4, 6, 8, 1), "direct": (3, 6, 8, 1), "depthwise": (6, 6, 8, 6),
                            "winograd": (8, 8, 16, 1)}[kind]
    nodes: list = []
    inits: list = []
    u8, i8 = np.array(128, np.uint8), np.array(0, np.int8)
    x = _fq(nodes, inits, "x", "in", 0.02, u8)

    def branch(tag, src, c_in, k, group=1):
        w = RNG.standard_normal((cout, c_in // group, k, k)).astype(np.float32)
        ws = (np.abs(w).reshape(cout, -1).max(axis=1) / 127).astype(np.float32)
        wq = np.clip(np.rint(w / ws.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
        inits.extend([numpy_helper.from_array(wq, f"{tag}_wq"), numpy_helper.from_array(ws, f"{tag}_ws"),
                      numpy_helper.from_array(np.zeros(cout, np.int8), f"{tag}_wz")])
        nodes.append(helper.make_node("DequantizeLinear", [f"{tag}_wq", f"{tag}_ws", f"{tag}_wz"], [f"{tag}_w"],
                                      name=f"{tag}_wdq", axis=0))
        nodes.append(helper.make_node("Conv", [src, f"{tag}_w"], [f"{tag}_c"], name=f"{tag}_conv",
                                      pads=[k // 2] * 4, group=group))
        c = _fq(nodes, inits, f"{tag}_c", f"{tag}_cq", 0.05, u8)
        stats = (_w(cout), _w(cout), _w(cout), _w(cout, positive=True))
        for n, arr in zip(("s", "b", "m", "v"), stats):
            inits.append(numpy_helper.from_array(arr, f"{tag}_bn{n}"))
        nodes.append(helper.make_node("BatchNormalization", [c, *(f"{tag}_bn{n}" for n in "sbmv")], [f"{tag}_n"],
                                      name=f"{tag}_bn", epsilon=1e-3))
        return _fq(nodes, inits, f"{tag}_n", f"{tag}_nq", 0.04, i8)

    a = branch("a", x, cin, 3, group)
    b = branch("b", x, cin, 1)
    nodes.append(helper.make_node("Sum", [a, b], ["sum"], name="sum"))
    nodes.append(helper.make_node("Relu", ["sum"], ["relu"], name="relu"))
    y = _fq(nodes, inits, "relu", "out", 0.03, np.array(0, np.uint8))
    nodes.append(helper.make_node("Identity", [y], ["y"], name="y"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, cin, hw, hw])],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feed = {"x": (RNG.standard_normal((1, cin, hw, hw)) * 0.8).astype(np.float32)}
    return model.SerializeToString(), feed, 0.03


@pytest.mark.parametrize("jit", ["numba", "numpy"])
@pytest.mark.parametrize("kind", ["im2col", "direct", "depthwise", "winograd"])
def test_qdq_conv_block_fuses_pairs_and_batchnorm_bit_identically(kind, jit, monkeypatch):
    """Conv -> Q -> DQ -> BatchNormalization -> Q -> DQ, the residual Sum, Relu and the last pair
    run as the Conv's epilogue (one pass): the bits of the same session's unfused nodes
    (``ORT_DISABLE_ALL``: packs kept, fusions off), and onnxruntime's within a quantization step
    per rounding that float order may flip."""
    if jit == "numba":
        pytest.importorskip("numba")
    else:
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    from onnxpack.session.kernels import conv as conv_mod

    monkeypatch.setattr(conv_mod, "_WINO_OVER_SHIFT", 0)  # Winograd even for the JIT's few channels
    model, feed, out_scale = qdq_conv_block_model(kind)
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, feed)[0]
        ops = [type(st.kernel).__name__ for st in s.program.root.steps]
    assert ops == ["FakeQuant", "FusedConv", "FusedConv", "Identity"], ops  # the input's pair stays
    opts = onnxpack.SessionOptions()
    opts.graph_optimization_level = onnxpack.GraphOptimizationLevel.ORT_DISABLE_ALL
    with onnxpack.InferenceSession(model, opts) as s:
        unfused = s.run(None, feed)[0]
        assert "BatchNormalization" in [st.node.op_type for st in s.program.root.steps]
    _same_bits(got, unfused)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=3 * out_scale + 1e-6)
    assert np.mean(got == want) > 0.9


def test_fake_quant_pair_after_matmul_is_its_epilogue():
    """MatMul -> bias Add -> Q -> DQ: the pair runs in the fused MatMul's epilogue, same bits."""
    w = RNG.standard_normal((16, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "B"], ["add"], name="add")]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(_w(8), "B")]
    y = _fq(nodes, inits, "add", "o", 0.07, np.array(-3, np.int8))
    nodes.append(helper.make_node("Identity", [y], ["y"], name="y"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [5, 16])],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    feed = {"x": RNG.standard_normal((5, 16)).astype(np.float32)}
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, feed)[0]
        assert [type(st.kernel).__name__ for st in s.program.root.steps] == ["FusedMatMul", "Identity"]
    opts = onnxpack.SessionOptions()
    opts.graph_optimization_level = onnxpack.GraphOptimizationLevel.ORT_DISABLE_ALL
    with onnxpack.InferenceSession(model, opts) as s:
        _same_bits(got, s.run(None, feed)[0])


@pytest.mark.parametrize("half_last", [True, False], ids=["half-last", "half-first"])
def test_fused_gelu_overflows_where_the_graph_does(half_last, jit_path):
    """torch's exact GELU fused after a MatMul keeps the graph's order of products: with the 0.5
    applied last, ``x * (1 + erf)`` overflows to inf for x above half the float32 maximum, as the
    op-by-op graph (and onnxruntime) computes; with the 0.5 first it stays finite.  (The
    reliability fuzzer found the fused chain finite where onnxruntime gave inf.)"""
    w = numpy_helper.from_array(np.diag([1.0, 1.0, 1.0, 1.0]).astype(np.float32), "W")
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("rsqrt2", 0.70710677), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
             helper.make_node("Mul", ["m", "rsqrt2"], ["g0"]), helper.make_node("Erf", ["g0"], ["g1"]),
             helper.make_node("Add", ["g1", "one"], ["g2"])]
    if half_last:
        nodes += [helper.make_node("Mul", ["m", "g2"], ["g3"]), helper.make_node("Mul", ["g3", "half"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["m", "half"], ["g3"]), helper.make_node("Mul", ["g3", "g2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 4])],
                              [helper.make_tensor_value_info("y", F, None)], [w, *consts])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    feed = {"x": np.array([[3e38, -3e38, 1e38, 2.0], [-1.0, 0.5, 2.5e38, -2.5e38]], np.float32)}
    with onnxpack.InferenceSession(model) as s:
        assert len(s.program.root.steps) == 1  # the whole chain is one fused MatMul
        got = s.run(None, feed)[0]
    want = _ort(model, feed)[0]
    assert np.array_equal(np.isinf(got), np.isinf(want)) and np.isinf(want).any() == half_last
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)


# -- the planner's own look-ups, against the checks they replace ----------------------------------
def _users_of_by_counting(nodes, readers, protected, taken):
    """``users_of`` as it was first written: the users, then their reads counted from the protos."""
    by_input: dict[str, list[int]] = {}
    for k, node in enumerate(nodes):
        for name in node.input:
            if name:
                by_input.setdefault(name, []).append(k)

    def users_of(name):
        users = sorted(set(by_input.get(name, [])))
        if not users or name in protected or any(u in taken for u in users):
            return None
        count = sum(1 for u in users for i in nodes[u].input if i == name)
        return users if readers.get(name, 0) == count else None
    return users_of


@pytest.mark.parametrize("seed", range(6))
def test_sole_users_equals_counting_the_reads(seed):
    # Random graphs with names read twice by one node, by several nodes, by "subgraphs" (extra
    # reads), protected names and taken nodes: the list-length count answers as the recount did.
    from onnxpack.session._fusion import _Nodes, _sole_users

    rng = np.random.default_rng(seed)
    names = [f"v{i}" for i in range(12)]
    nodes = []
    for k in range(25):
        ins = [str(rng.choice(names + [""])) for _ in range(int(rng.integers(1, 4)))]
        nodes.append(helper.make_node("Add", ins, [f"o{k}"]))
    readers: dict[str, int] = {}
    for node in nodes:
        for n in node.input:
            if n:
                readers[n] = readers.get(n, 0) + 1
    for n in rng.choice(names, 3, replace=False):
        readers[str(n)] = readers.get(str(n), 0) + 1  # a subgraph's read
    protected = {str(n) for n in rng.choice(names, 2, replace=False)}
    for taken in (set(), {int(t) for t in rng.choice(25, 5, replace=False)}):
        want = _users_of_by_counting(nodes, readers, protected, taken)
        for wrapped in (nodes, _Nodes(nodes)):
            got = _sole_users(wrapped, readers, protected, taken)
            for n in names + ["missing", ""]:
                assert got(n) == want(n), n
    # the answer is the caller's list: changing it changes nothing kept
    some = next(n for n in names if _sole_users(nodes, readers, set(), set())(n))
    users_of = _sole_users(nodes, readers, set(), set())
    first = users_of(some)
    first.append(99)
    assert 99 not in users_of(some)


def test_compile_hands_plan_fusions_the_index_and_read_counts_it_would_build(monkeypatch):
    # The compile step builds the fusions' input index in the pass that counts the reads
    # (nodes_with_index): it is the one _by_input builds, and the counts add the subgraphs'
    # reads and the graph outputs.
    import onnx

    from onnxpack.session import _compile
    from onnxpack.session._fusion import _by_input

    seen = []
    real = _compile.plan_fusions

    def spy(nodes, readers, protected, *args):
        seen.append((nodes, dict(readers), set(protected)))
        return real(nodes, readers, protected, *args)

    monkeypatch.setattr(_compile, "plan_fusions", spy)
    model = onnx.load_from_string(qdq_conv_block_model("im2col")[0])
    # An If reading two of the block's values from its branches, and a graph output read by a node.
    branch = helper.make_graph([helper.make_node("Add", ["sum", "relu"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", F, None)])
    cond = numpy_helper.from_array(np.array(True), "cond")
    model.graph.initializer.append(cond)
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=branch))
    model.graph.output.append(helper.make_tensor_value_info("z", F, None))
    model.graph.output.append(helper.make_tensor_value_info("relu", F, None))
    with onnxpack.InferenceSession(model.SerializeToString()):
        pass
    (nodes, readers, protected), = [s for s in seen if len(s[0]) == len(model.graph.node)]
    assert nodes.by_input == _by_input(list(nodes))
    want: dict[str, int] = {}
    for node in model.graph.node:
        for n in node.input:
            if n:
                want[n] = want.get(n, 0) + 1
    for n in ("sum", "relu"):  # the branches' reads (once per node, not per branch)
        want[n] += 1
    for n in protected:
        want[n] = want.get(n, 0) + 1
    assert protected == {"y", "z", "relu"} and readers == want


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", ">i2", ">u2", "int32", "int4", "uint4",
                                   "float32", "float8_e4m3fn", "bool"])
def test_fake_quant_range_is_the_table_by_name(dtype):
    from onnxpack.session._fusion import _FAKE_QUANT_TYPES, _fake_quant_range

    dt = np.dtype(getattr(ml_dtypes, dtype)) if hasattr(ml_dtypes, dtype) else np.dtype(dtype)
    for _ in range(2):  # computed, then cached
        assert _fake_quant_range(dt) == _FAKE_QUANT_TYPES.get(dt.name)


@pytest.mark.parametrize("scale", [
    np.array(0.05, np.float32), np.array([0.05], np.float32), np.array(0.0, np.float32), np.array(-0.0, np.float32),
    np.array(-0.05, np.float32), np.array(np.nan, np.float32), np.array(np.inf, np.float32),
    np.array(1e-45, np.float32), np.array([0.1, 0.2], np.float32), np.array([0.1, 0.0], np.float32),
    np.array([0.1, np.nan], np.float32),
], ids=["pos", "pos-1d", "zero", "negzero", "neg", "nan", "inf", "denormal", "axis-pos", "axis-zero", "axis-nan"])
def test_fake_quant_pair_accepts_a_scale_exactly_when_every_value_is_positive(scale):
    from onnxpack.session._fusion import _fake_quant_pair

    zp = np.zeros(scale.shape, np.uint8)
    values = {"s": scale, "z": zp}
    q = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=0)
    dq = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], axis=0)
    got = _fake_quant_pair(q, dq, values.get, 13)
    assert (got is not None) == bool((scale > 0).all())
    if got is not None:
        assert got[:3] == (0, 0, 255) and got[3] is scale and got[4] is zp


@pytest.mark.parametrize("outputs", [["y"], [""], [], ["y", ""], ["", "y"], ["y", "z"], ["y", "", ""], ["", ""]],
                         ids=["one", "unnamed", "none", "named-unnamed", "unnamed-named", "two", "named-2-unnamed",
                              "two-unnamed"])
def test_sole_output_is_the_named_first_output_of_a_one_output_node(outputs):
    from onnxpack.session._fusion import sole_output as _sole_output

    node = helper.make_node("Relu", ["x"], outputs)
    # the condition it replaces: exactly one named output, and it is the first
    first = node.output[0] if node.output else ""
    want = first if first and len([o for o in node.output if o]) == 1 else ""
    assert _sole_output(node) == want


# -- the opset-20/24 activation ops as epilogues ---------------------------------------------------
@pytest.mark.parametrize("producer", ["conv", "matmul-add"])
@pytest.mark.parametrize("act", ["Swish", "Gelu", "Gelu-tanh", "Swish-alpha"])
def test_gelu_and_swish_ops_fuse_into_their_producer(producer, act, jit_path):
    """torch's exporter writes GELU as Gelu (opset 20) and SiLU as Swish (opset 24): the exact
    Gelu and Swish with alpha 1 run as their Conv's / MatMul's epilogue, equal to the unfused
    nodes (pre-packing off) to 1e-6 and to onnxruntime to 1e-5; the tanh Gelu and another
    alpha stay nodes."""
    rng = np.random.default_rng(41)
    op = act.split("-")[0]
    attrs = {"Gelu-tanh": dict(approximate="tanh"), "Swish-alpha": dict(alpha=1.5)}.get(act, {})
    if producer == "conv":
        inits = [numpy_helper.from_array(_w(8, 4, 3, 3), "W"), numpy_helper.from_array(_w(8), "B")]
        nodes = [helper.make_node("Conv", ["x", "W", "B"], ["t"], name="p", pads=[1, 1, 1, 1])]
        x = rng.standard_normal((2, 4, 9, 9)).astype(np.float32)
    else:
        inits = [numpy_helper.from_array(_w(16, 24), "W"), numpy_helper.from_array(_w(24), "B")]
        nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="p"),
                 helper.make_node("Add", ["m", "B"], ["t"], name="add")]
        x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    nodes.append(helper.make_node(op, ["t"], ["y"], name="act", **attrs))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10).SerializeToString()
    with onnxpack.InferenceSession(model) as s:
        steps = [st.node.name for st in s.program.root.steps]
        got = s.run(None, {"x": x})[0]
    fused = act in ("Swish", "Gelu")
    assert (len(steps) == 1) == fused, steps
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model, so) as s:
        unfused = s.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, unfused, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


# -- onnxruntime's fused GELUs (its transformer optimizer's output) as MatMul epilogues ----------
MS_GELU = {
    "biasgelu": ("BiasGelu", True, "const", True),        # MatMul -> BiasGelu(t, B)
    "add-gelu": ("Gelu", False, "const", True),           # MatMul -> Add(B) -> Gelu
    "fastgelu-bias": ("FastGelu", True, "const", True),   # MatMul -> FastGelu(t, B) (GPT-2 optimized)
    "add-fastgelu": ("FastGelu", False, "const", True),   # MatMul -> Add(B) -> FastGelu(t)
    "fastgelu-fed-bias": ("FastGelu", True, "input", False),
    "add-quickgelu": ("QuickGelu", False, "const", True),  # MatMul -> Add(B) -> QuickGelu (CLIP-class)
    "biasgelu-fed-bias": ("BiasGelu", True, "input", False),  # a bias fed at run time: a node
    "biasgelu-2d-bias": ("BiasGelu", True, "2d", False),  # (1, N): refused by the op, not fused
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", list(MS_GELU), ids=list(MS_GELU))
def test_onnxruntime_gelu_ops_fuse_into_matmul(case, dtype, jit_path):
    """``com.microsoft`` BiasGelu / FastGelu (with a constant 1-D bias) and Gelu / FastGelu /
    QuickGelu after a MatMul by a constant weight run as the MatMul's epilogue (bias, then the
    exact, tanh or sigmoid GELU in float32, one rounding: the op's own arithmetic); equal to the unfused nodes (pre-packing off) to 1e-6 (float16: its
    ulp, the fused MatMul rounding its product once before the epilogue as the node does) and to
    onnxruntime to 1e-5 (2e-3)."""
    op, bias_in_op, bias_kind, fused = MS_GELU[case]
    rng = np.random.default_rng(43)
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w = (rng.standard_normal((16, 24)) * 0.5).astype(dtype)
    b = rng.standard_normal(24).astype(dtype)
    inits = [numpy_helper.from_array(w, "W")]
    inputs = [helper.make_tensor_value_info("x", t, [3, 5, 16])]
    feed = {"x": rng.standard_normal((3, 5, 16)).astype(dtype) * 2}
    if bias_kind == "input":
        inputs.append(helper.make_tensor_value_info("B", t, [24]))
        feed["B"] = b
    else:
        inits.append(numpy_helper.from_array(b.reshape(1, 24) if bias_kind == "2d" else b, "B"))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="p")]
    if bias_in_op:
        nodes.append(helper.make_node(op, ["m", "B"], ["y"], name="act", domain="com.microsoft"))
    else:
        attrs = {"alpha": 1.5} if op == "QuickGelu" else {}
        nodes += [helper.make_node("Add", ["m", "B"], ["t"], name="add"),
                  helper.make_node(op, ["t"], ["y"], name="act", domain="com.microsoft", **attrs)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", t, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=9).SerializeToString()
    with onnxpack.InferenceSession(model) as s:
        steps = [st.node.name for st in s.program.root.steps]
        if bias_kind == "2d":  # the op's 1-D bias check still runs: the fusion takes no other shape
            with pytest.raises(onnxpack.errors.OrtRuntimeFailure, match="must be 1-D"):
                s.run(None, feed)
            assert steps == ["p", "act"]
            return
        got = s.run(None, feed)[0]
    assert (len(steps) == 1) == fused, steps
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model, so) as s:
        assert len(s.program.root.steps) == len(nodes)
        unfused = s.run(None, feed)[0]
    assert got.dtype == unfused.dtype == np.dtype(dtype)
    want = _ort(model, feed)[0]
    if dtype == np.float32:
        np.testing.assert_allclose(got, unfused, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        g32, u32 = got.astype(np.float32), unfused.astype(np.float32)
        np.testing.assert_allclose(g32, u32, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(g32, want.astype(np.float32), rtol=2e-3, atol=2e-3)


# -- an exported attention (MatMul, scale, mask, Softmax, MatMul) as one step -------------------
CHAIN = {  # scale op, mask kind, softmax axis attribute, opset, dtype, fused
    "mul-mask-input": ("Mul", "input", None, 17, np.float32, True),
    "div-mask-const": ("Div", "const", -1, 17, np.float32, True),
    "no-scale": (None, "input", None, 17, np.float32, True),
    "no-mask": ("Mul", None, None, 17, np.float32, True),
    "masked-rows": ("Mul", "rows", None, 17, np.float32, True),
    "f16": ("Mul", "input", None, 17, np.float16, True),
    "opset11-axis-1": ("Mul", "input", None, 11, np.float32, False),
    "opset11-axis-last": ("Mul", "input", -1, 11, np.float32, True),
    "axis-2": ("Mul", "input", 2, 17, np.float32, False),
    "probs-read-twice": ("Mul", "input", None, 17, np.float32, False),
    "scale-5d": ("Mul", "input", None, 17, np.float32, True),  # a (1,1,1,1,1) scale: a 5-D output, as numpy's broadcasting
}


@pytest.mark.parametrize("case", list(CHAIN), ids=list(CHAIN))
def test_exported_attention_chain_is_one_step(case, jit_path):
    """torch's BERT export writes attention as ``MatMul(Q, K^T) -> Mul/Div(scale) -> Add(mask) ->
    Softmax -> MatMul(., V)``: it runs as one step (the JIT's attention when numba is there),
    equal to the nodes one by one (pre-packing off: no such fusion) to float32 rounding and to
    onnxruntime; a Softmax over another axis, the probabilities read twice stay nodes."""
    op, mask_kind, axis, opset, dtype, fused = CHAIN[case]
    rng = np.random.default_rng(44)
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    b, n, s, h = 2, 3, 9, 16
    feeds = {"q": rng.standard_normal((b, n, s, h)).astype(dtype), "k": rng.standard_normal((b, n, s, h)).astype(dtype),
             "v": rng.standard_normal((b, n, s, h)).astype(dtype)}
    inputs = [helper.make_tensor_value_info(x, t, [b, n, s, h]) for x in ("q", "k", "v")]
    inits = []
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"], name="qk")]
    last = "qk"
    if op is not None:
        c = np.array(0.25 if op == "Mul" else 4.0 ** 0.5 * 1.7, dtype)
        if case == "scale-5d":
            c = c.reshape(1, 1, 1, 1, 1)
        inits.append(numpy_helper.from_array(c, "c"))
        nodes.append(helper.make_node(op, [last, "c"], ["sc"]))
        last = "sc"
    if mask_kind is not None:
        mask = np.where(rng.random((b, 1, 1, s)) < 0.3, -10000.0, 0.0).astype(dtype)
        if mask_kind == "rows":
            mask = np.where(rng.random((b, 1, s, s)) < 0.3, -np.inf, 0.0).astype(dtype)
            mask[0, 0, 2, :] = -np.inf  # a row of only -inf: Softmax gives NaN
        if mask_kind == "const":
            inits.append(numpy_helper.from_array(mask, "mask"))
        else:
            inputs.append(helper.make_tensor_value_info("mask", t, list(mask.shape)))
            feeds["mask"] = mask
        nodes.append(helper.make_node("Add", [last, "mask"], ["masked"]))
        last = "masked"
    nodes.append(helper.make_node("Softmax", [last], ["p"], **({} if axis is None else {"axis": axis})))
    nodes.append(helper.make_node("MatMul", ["p", "v"], ["y"], name="pv"))
    outputs = [helper.make_tensor_value_info("y", t, None)]
    if case == "probs-read-twice":
        outputs.append(helper.make_tensor_value_info("p", t, None))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8).SerializeToString()
    from onnxpack.session.kernels import attention as A

    jit_runs = []
    real = A._attend_heads

    def counted(*args, **kwargs):
        got = real(*args, **kwargs)
        jit_runs.append(got is not None)
        return got

    with onnxpack.InferenceSession(model) as sess, pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "_attend_heads", counted)
        mp.setattr(A, "_JIT_MIN_KEYS", 1)  # (9 keys: the JIT's kernel on this small geometry too)
        kinds = [type(st.kernel).__name__ for st in sess.program.root.steps]
        got = sess.run(None, feeds)
    assert ("AttentionChain" in kinds) == fused, kinds
    # the JIT's attention (numba's module: it is not in the native code cache) for float32
    assert any(jit_runs) == (fused and jit_path != "numpy" and dtype == np.float32 and case != "scale-5d"), jit_runs
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model, so) as sess:
        assert "AttentionChain" not in [type(st.kernel).__name__ for st in sess.program.root.steps]
        unfused = sess.run(None, feeds)
    want = _ort(model, feeds)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=2e-3, atol=2e-3)
    for g, u, w in zip(got, unfused, want, strict=True):
        assert g.dtype == u.dtype == w.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(u))
        np.testing.assert_allclose(g.astype(np.float32), u.astype(np.float32), **tol)
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), **tol)
    if mask_kind == "rows":
        assert np.isnan(got[0][0, 0, 2]).all()


# -- sibling MatMuls: one activation, several constant weights ------------------------------------
def sibling_model(*, with_residual: bool = False, tokens: int = 5) -> bytes:
    """x(2,tokens,64): Q = x @ Wq + bq, K = x @ Wk (no bias), V = Relu(x @ Wv + bv), as an exported
    attention layer's projections; Z = x @ Wz with another K (of x's transpose: never grouped);
    with ``with_residual`` also R = x @ Wr + x (a residual member: stays its own step)."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(rng.standard_normal((64, n)).astype(np.float32), name)
             for name, n in (("Wq", 64), ("Wk", 128), ("Wv", 192), ("Wr", 64))]
    inits += [numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), name) for name, n in (("bq", 64), ("bv", 192))]
    inits.append(numpy_helper.from_array(rng.standard_normal((tokens, 64)).astype(np.float32), "Wz"))
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q0"], name="q"), helper.make_node("Add", ["q0", "bq"], ["Q"], name="qb"),
             helper.make_node("MatMul", ["x", "Wk"], ["K"], name="k"),
             helper.make_node("MatMul", ["x", "Wv"], ["v0"], name="v"), helper.make_node("Add", ["v0", "bv"], ["v1"], name="vb"),
             helper.make_node("Relu", ["v1"], ["V"], name="vr"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]), helper.make_node("MatMul", ["xt", "Wz"], ["Z"], name="z")]
    outs = ["Q", "K", "V", "Z"]
    if with_residual:
        nodes += [helper.make_node("MatMul", ["x", "Wr"], ["r0"], name="r"), helper.make_node("Add", ["r0", "x"], ["R"], name="rres")]
        outs.append("R")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, tokens, 64])],
                              [helper.make_tensor_value_info(o, F, None) for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.mark.usefixtures("panels_on")
@pytest.mark.parametrize("tokens", [5, 40], ids=["10-rows", "80-rows"])
@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["qkv", "qkv-and-residual"])
def test_sibling_matmuls_run_as_one_group(with_residual, threads, tokens, tmp_path, monkeypatch):
    """The projections of one activation by constant weights of one K run as one step (one GEMM
    over all their panels, one split), each with its own bias and activations; a member with a
    residual, and a MatMul of another K, stay their own steps.  The outputs are the ungrouped
    steps' bits (every element the same sum), onnxruntime's within float32 rounding, the same
    warm from the saved packs (mapped, nothing packed), on one thread and two (with 80 rows the
    GEMMs split by rows, with 10 by panels), two threads giving one thread's bits."""
    from onnxpack.session import _fusion
    from onnxpack.session.kernels import _act

    monkeypatch.setenv("ONNXPACK_NUM_THREADS", threads)
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)  # split even these small products
    model = sibling_model(with_residual=with_residual, tokens=tokens)
    feed = {"x": RNG.standard_normal((2, tokens, 64)).astype(np.float32)}
    src = tmp_path / "siblings.onnx"
    src.write_bytes(model)
    with onnxpack.InferenceSession(str(src)) as s:
        groups = [st for st in s.program.root.steps if type(st.kernel).__name__ == "MatMulGroup"]
        assert [(g.inputs, g.outputs) for g in groups] == [(("x", "Wq", "Wk", "Wv"), ("Q", "K", "V"))]
        assert "R" not in groups[0].outputs and "Z" not in groups[0].outputs
        got = s.run(None, feed)
    with monkeypatch.context() as patched:
        patched.setattr(_fusion, "group_sibling_matmuls", lambda nodes, fusions, taken, meta: fusions)
        with onnxpack.InferenceSession(str(src)) as s:
            assert not any(type(st.kernel).__name__ == "MatMulGroup" for st in s.program.root.steps)
            ungrouped = s.run(None, feed)
    for g, u in zip(got, ungrouped):
        _same_bits(g, u)
    with monkeypatch.context() as one:
        one.setenv("ONNXPACK_NUM_THREADS", "1")
        with onnxpack.InferenceSession(str(src)) as s:
            for g, u in zip(got, s.run(None, feed)):
                _same_bits(g, u)
    for g, w in zip(got, _ort(model, feed)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
    out = tmp_path / "siblings.opt.onnx"
    so = onnxpack.SessionOptions()
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    onnxpack.InferenceSession(str(src), so)
    with onnxpack.InferenceSession(str(out)) as warm:
        stats = warm.get_prepack_stats()
        assert stats["weights_packed"] == 0 and stats["blobs_from_model"] >= 3
        for g, w in zip(warm.run(None, feed), got):
            _same_bits(g, w)


def test_sibling_matmuls_fall_back_to_their_own_steps_without_panels(monkeypatch):
    """Where the weights are not panels (numpy's BLAS: no JIT, or a CPU where panels do not pay)
    the group runs each member as its own MatMul: onnxruntime's results, grouped or not."""
    monkeypatch.setenv("ONNXPACK_PANELS", "0")
    model = sibling_model()
    feed = {"x": RNG.standard_normal((2, 5, 64)).astype(np.float32)}
    with onnxpack.InferenceSession(model) as s:
        assert any(type(st.kernel).__name__ == "MatMulGroup" for st in s.program.root.steps)
        got = s.run(None, feed)
    for g, w in zip(got, _ort(model, feed)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


DQ_GATHER_CASES = {
    "uint8-zp-axis0": (np.uint8, 131, None, 0, (3, 4), 13, ""),
    "int8-no-zp-axis0": (np.int8, None, None, 0, (5,), 13, ""),
    "int8-zp-axis1": (np.int8, -3, None, 1, (2, 2), 17, ""),
    "uint8-opset21": (np.uint8, 7, None, 0, (6,), 21, ""),
    "int8-com.microsoft": (np.int8, 2, None, 0, (4,), 13, "com.microsoft"),
    "per-axis-not-fused": (np.uint8, 128, 1, 0, (4,), 13, ""),
}


@pytest.mark.parametrize("case", list(DQ_GATHER_CASES), ids=list(DQ_GATHER_CASES))
def test_dequantize_then_gather_gathers_codes_first(case):
    """``Gather(DequantizeLinear(W, s, z), idx)`` with a per-tensor scale runs as one step that
    gathers W's codes and dequantizes those rows (``find_dq_gather``): onnxruntime's and the
    unfused nodes' bits, negative indices included; a per-axis scale is not fused (its small
    table is folded at creation instead); an index out of range stays the error it was."""
    dtype, zp, per_axis, axis, ishape, opset, domain = DQ_GATHER_CASES[case]
    table = RNG.integers(np.iinfo(dtype).min, np.iinfo(dtype).max + 1, (40, 6)).astype(dtype)
    scale = np.array(0.037, np.float32) if per_axis is None else (RNG.random(6) * 0.1 + 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(table, "w"), numpy_helper.from_array(scale, "s")]
    dq_in = ["w", "s"]
    if zp is not None:
        inits.append(numpy_helper.from_array(np.array(zp, dtype) if per_axis is None else
                                             np.full(6, zp, dtype), "z"))
        dq_in.append("z")
    dq_attrs = {"axis": per_axis} if per_axis is not None else {}
    nodes = [helper.make_node("DequantizeLinear", dq_in, ["t"], name="dq", domain=domain, **dq_attrs),
             helper.make_node("Gather", ["t", "i"], ["y"], name="g", axis=axis)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("i", TensorProto.INT64, list(ishape))],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()
    bound = table.shape[axis]
    idx = RNG.integers(-bound, bound, ishape).astype(np.int64)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, {"i": idx})[0]
    plain = onnxpack.SessionOptions()
    plain.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model) as s, onnxpack.InferenceSession(model, plain) as u:
        got, unfused = s.run(None, {"i": idx})[0], u.run(None, {"i": idx})[0]
        kinds = [type(st.kernel).__name__ for st in s.program.root.steps]
        assert (kinds == ["DequantizeGather"]) == (per_axis is None), kinds
        bad = np.full(ishape, bound + 3, np.int64)
        errors = []
        for sess in (s, u):
            with pytest.raises(Exception) as info:
                sess.run(None, {"i": bad})
            errors.append(type(info.value))
        assert errors[0] is errors[1] and issubclass(errors[0], OnnxpackError), errors
    _same_bits(got, unfused)
    _same_bits(got, want)


@pytest.mark.parametrize("case", ["opset11", "opset12-int8", "contrib-uint8", "contrib-int16", "contrib-per-axis"])
def test_fake_quant_pair_of_older_opsets_and_contrib_domain_is_fused(case):
    """A QuantizeLinear -> DequantizeLinear pair at opsets 10-12 (per tensor) and onnxruntime's
    com.microsoft pair (any type the fusion takes, per axis too) fuse as the opset-13 pair does:
    the unfused nodes' and onnxruntime's bits."""
    domain = "com.microsoft" if case.startswith("contrib") else ""
    opset = 11 if "opset11" in case else (12 if "opset12" in case else 13)
    per_axis = "per-axis" in case
    zdtype = {"contrib-int16": np.int16, "opset12-int8": np.int8}.get(case, np.uint8)
    scale = np.array([0.02, 0.11, 0.05], np.float32) if per_axis else np.array(0.04, np.float32)
    zp = (np.array([3, 0, 250], zdtype) if per_axis else np.array(7 if zdtype != np.int8 else -3, zdtype))
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "z")]
    attrs = {"axis": 1} if per_axis else {}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q", domain=domain, **attrs),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], name="dq", domain=domain, **attrs),
             helper.make_node("Identity", ["d"], ["y"], name="out")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 3, 5])],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=7).SerializeToString()
    x = {"x": _hard_values(float(np.max(scale)))}
    plain = onnxpack.SessionOptions()
    plain.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model) as s, onnxpack.InferenceSession(model, plain) as u:
        got, unfused = s.run(None, x)[0], u.run(None, x)[0]
        names = [st.node.name for st in s.program.root.steps]
    assert names == ["q+dq", "out"], names
    _same_bits(got, unfused)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    _same_bits(got, ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, x)[0])


# -- Identity nodes between the links of a chain ----------------------------------------------------
def _identity_chain_model(variant: str) -> bytes:
    """x -> Conv -> Add(per-channel constant) -> Identity [-> Identity] -> Relu -> y, as Paddle's
    exporter writes an SE block; ``variant`` adds a reason for an Identity to stay."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 4, 1, 1)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((1, 6, 1, 1)).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
             helper.make_node("Add", ["c", "b"], ["a"], name="add"),
             helper.make_node("Identity", ["a"], ["i1"], name="id1")]
    last = "i1"
    if variant == "two":
        nodes.append(helper.make_node("Identity", ["i1"], ["i2"], name="id2"))
        last = "i2"
    if variant.startswith("dropout"):
        extra = {"dropout": ([], ["i2"]), "dropout-mask": ([], ["i2", "mask"]),
                 "dropout-training": (["ratio", "training"], ["i2"])}[variant]
        nodes.append(helper.make_node("Dropout", ["i1", *extra[0]], extra[1], name="drop"))
        inits += [numpy_helper.from_array(np.float32(0.3), "ratio"), numpy_helper.from_array(np.array(False), "training")]
        last = "i2"
    nodes.append(helper.make_node("Relu", [last], ["y"], name="relu"))
    outputs = [helper.make_tensor_value_info("y", F, None)]
    if variant == "graph-output":
        outputs.append(helper.make_tensor_value_info("i1", F, None))
    if variant == "dropout-mask":
        outputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, None))
    if variant == "subgraph":
        branch = helper.make_graph([helper.make_node("Neg", ["i1"], ["n"])], "then", [],
                                   [helper.make_tensor_value_info("n", F, None)])
        other = helper.make_graph([helper.make_node("Abs", ["i1"], ["m"])], "else", [],
                                  [helper.make_tensor_value_info("m", F, None)])
        nodes.append(helper.make_node("If", ["flag"], ["z"], then_branch=branch, else_branch=other))
        inits.append(numpy_helper.from_array(np.array(True), "flag"))
        outputs.append(helper.make_tensor_value_info("z", F, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 4, 5, 5])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("variant,steps,identities", [("one", 1, 0), ("two", 1, 0), ("graph-output", 3, 1),
                                                      ("subgraph", 4, 1), ("dropout", 1, 0), ("dropout-mask", 3, 0),
                                                      ("dropout-training", 3, 0)])
def test_identities_inside_a_chain_do_not_stop_its_fusion(variant, steps, identities):
    """As onnxruntime's Identity (and Dropout) elimination: readers of an Identity read its input,
    so the Conv takes the Add and the Relu after the Identity (one step); an Identity whose name
    is a graph output or read by a subgraph stays (and the chain stops at the name read twice);
    so does a Dropout whose mask is asked for or that is given a training_mode.  Outputs equal
    onnxruntime's and the unoptimized session's; the model's own nodes are unchanged."""
    model = _identity_chain_model(variant)
    feed = {"x": np.random.default_rng(3).standard_normal((2, 4, 5, 5)).astype(np.float32)}
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, feed)
        kinds = [st.node.op_type for st in s.program.root.steps]
        assert len(kinds) == steps and kinds.count("Identity") == identities, kinds
        assert sum(n.op_type == "Identity" for n in s.model.proto.graph.node) == (2 if variant == "two" else 1)
        assert ("Dropout" in kinds) == (variant in ("dropout-mask", "dropout-training"))
    plain = onnxpack.SessionOptions()
    plain.graph_optimization_level = onnxpack.GraphOptimizationLevel.ORT_DISABLE_ALL
    with onnxpack.InferenceSession(model, plain) as s:
        assert "Identity" in [st.node.op_type for st in s.program.root.steps]
        unoptimized = s.run(None, feed)
    for a, b, c in zip(got, unoptimized, _ort(model, feed)):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_identity_aliases_rules():
    """The pure rule: an Identity chain reads through to its first input; one that is pinned, read
    by a node with subgraphs or has no single named input and output stays."""
    from onnxpack.session._fusion import identity_aliases, passes_through, read_through

    nodes = [helper.make_node("Identity", ["a"], ["b"]), helper.make_node("Identity", ["b"], ["c"]),
             helper.make_node("Identity", ["c"], ["d"]), helper.make_node("Identity", ["a"], ["e"]),
             helper.make_node("Identity", [""], ["f"]), helper.make_node("Identity", ["a"], ["g"], domain="com.x"),
             helper.make_node("Add", ["c", "e"], ["h"]), helper.make_node("If", ["e"], ["k"])]
    ins = [n.input[:] for n in nodes]
    outs = [n.output[:] for n in nodes]
    got = identity_aliases(nodes, ins, outs, pinned={"d"}, holders={7})
    assert got == {"b": "a", "c": "a"}
    add = read_through(nodes[6], got)
    assert list(add.input) == ["a", "e"] and list(nodes[6].input) == ["c", "e"]
    assert read_through(nodes[3], got) is nodes[3]
    drops = [helper.make_node("Dropout", ["a"], ["b"]), helper.make_node("Dropout", ["a", "r"], ["b"]),
             helper.make_node("Dropout", ["a", "", ""], ["b", ""]), helper.make_node("Dropout", ["a"], ["b", "m"]),
             helper.make_node("Dropout", ["a", "r", "t"], ["b"]), helper.make_node("Dropout", [""], ["b"])]
    assert [passes_through(n, n.input[:], n.output[:]) for n in drops] == [True, True, True, False, False, False]


@pytest.mark.parametrize("saved_at,loaded_at", [("all", "off"), ("off", "all"), ("all", "all")])
def test_a_weight_through_an_identity_warm_starts_at_either_optimization_level(saved_at, loaded_at, tmp_path):
    """A Conv and a MatMul weight reached through an Identity (how torch exports shared weights)
    are packed under the weight's own key whether the compile reads through the Identity (graph
    optimizations on) or runs it (off): a model saved at one level maps every blob at the other,
    packs nothing and warns of nothing, with the cold run's outputs."""
    import warnings

    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 4, 3, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((6, 5)).astype(np.float32), "M")]
    nodes = [helper.make_node("Identity", ["W"], ["w_shared"]), helper.make_node("Identity", ["M"], ["m_shared"]),
             helper.make_node("Conv", ["x", "w_shared"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("MatMul", ["r", "m_shared"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, 4, 5, 6])],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    (tmp_path / "m.onnx").write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString())
    level = {"all": onnxpack.GraphOptimizationLevel.ORT_ENABLE_ALL, "off": onnxpack.GraphOptimizationLevel.ORT_DISABLE_ALL}
    feed = {"x": rng.standard_normal((1, 4, 5, 6)).astype(np.float32)}
    opts = onnxpack.SessionOptions()
    opts.graph_optimization_level = level[saved_at]
    opts.optimized_model_filepath = str(tmp_path / "opt.onnx")
    opts.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "64")
    with onnxpack.InferenceSession(str(tmp_path / "m.onnx"), opts) as cold:
        want = cold.run(None, feed)[0]
        assert cold.get_prepack_stats()["weights_packed"] == 2
    warm_opts = onnxpack.SessionOptions()
    warm_opts.graph_optimization_level = level[loaded_at]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with onnxpack.InferenceSession(str(tmp_path / "opt.onnx"), warm_opts) as warm:
            stats = warm.get_prepack_stats()
            assert (stats["weights_packed"], stats["blobs_rejected"], stats["blobs_from_model"]) == (0, 0, 2), stats
            np.testing.assert_allclose(warm.run(None, feed)[0], want, rtol=1e-6, atol=1e-6)


# -- LayerNormalization written out in elementwise ops (torch's nn.LayerNorm below opset 17) --------
def _layernorm_chain_model(*, opset=13, square="Pow", swap=False, axes=(-1,), d_out=False, dims=("b", 5, 8),
                           hidden=8, eps=1e-5) -> bytes:
    """``y = Relu((x - mean) / sqrt(mean((x - mean)^2) + eps) * gamma + beta)`` over the last
    axis, as the exporters write it: ReduceMean's axes an attribute below opset 18 and an input
    from 18; the square a Pow by 2 or a Mul; ``swap``: gamma and beta as the first operands;
    ``d_out``: the centred value is a graph output too (read outside the chain)."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "beta"),
             numpy_helper.from_array(np.array(eps, np.float32), "eps"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]

    def mean(inp, out):
        if opset >= 18:
            return helper.make_node("ReduceMean", [inp, "axes"], [out], keepdims=1)
        return helper.make_node("ReduceMean", [inp], [out], axes=list(axes), keepdims=1)

    if opset >= 18:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    nodes = [helper.make_node("Add", ["x0", "x0"], ["x"]), mean("x", "m"), helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]) if square == "Pow" else helper.make_node("Mul", ["d", "d"], ["sq"]),
             mean("sq", "v"), helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Mul", ["gamma", "n"] if swap else ["n", "gamma"], ["g"]),
             helper.make_node("Add", ["beta", "g"] if swap else ["g", "beta"], ["ln"]),
             helper.make_node("Relu", ["ln"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", F, None)]
    if d_out:
        outputs.append(helper.make_tensor_value_info("d", F, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x0", F, list(dims))], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("variant", [dict(), dict(square="Mul"), dict(swap=True), dict(opset=18), dict(opset=11, eps=1e-12)],
                         ids=["pow", "mul-square", "swapped-operands", "axes-input", "opset11"])
def test_a_written_out_layernorm_runs_as_one_step_like_onnxruntime(variant):
    """torch's nn.LayerNorm below opset 17 (nine elementwise ops): one LayerNormalization step,
    as onnxruntime's LayerNormFusion makes it; the outputs as onnxruntime's."""
    model = _layernorm_chain_model(**variant)
    sess = onnxpack.InferenceSession(model)
    ops = [s.node.op_type for s in sess.program.root.steps]
    assert ops.count("LayerNormalization") == 1 and "ReduceMean" not in ops and "Sqrt" not in ops, ops
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 5, 8)).astype(np.float32) * 3 + 1
        np.testing.assert_allclose(sess.run(None, {"x0": x})[0], theirs.run(None, {"x0": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", [dict(axes=(1,)), dict(d_out=True)], ids=["not-last-axis", "centred-value-read"])
def test_a_chain_that_is_not_a_layernorm_keeps_its_steps(variant):
    """Reduced over another axis, or an intermediate read outside the chain: not fused, and the
    results are still onnxruntime's."""
    model = _layernorm_chain_model(**variant)
    sess = onnxpack.InferenceSession(model)
    assert "LayerNormalization" not in [s.node.op_type for s in sess.program.root.steps]
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((2, 5, 8)).astype(np.float32)
    for got, want in zip(sess.run(None, {"x0": x}), theirs.run(None, {"x0": x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_written_out_layernorm_whose_last_axis_broadcasts_computes_what_its_nodes_compute():
    """A last axis of 1 against an 8-value gamma (the chain broadcasts it; a LayerNormalization
    would refuse the scale): the fused step computes the chain's arithmetic, as onnxruntime does
    on the nodes without its optimizations (with them, its own fusion refuses the run: "Last
    dimension of gamma and input does not match")."""
    model = _layernorm_chain_model(dims=("b", 5, 1))
    sess = onnxpack.InferenceSession(model)
    assert "LayerNormalization" in [s.node.op_type for s in sess.program.root.steps]
    x = RNG.standard_normal((2, 5, 1)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, {"x0": x})[0]
    got = sess.run(None, {"x0": x})[0]
    assert got.shape == want.shape == (2, 5, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chain", ["bias", "bias-relu", "silu", "nbits-bias", "nbits-bias-relu"])
def test_half_precision_chains_round_as_onnxruntime(chain):
    """float16 ``MatMul -> Add [-> Relu]`` / ``MatMul -> SiLU``: onnxruntime has no float16 MatMul,
    Add or activation kernels on its CPU, casts to float32 around them and drops the casts between
    them, so the chain rounds to half once, at its end; the fused epilogue runs on the float32
    product likewise (it rounded the product first: 1 ulp off on ~30 % of the outputs).  A float16
    MatMulNBits has its own kernel there, rounding its result before the Add reads it: the Add
    stays a step."""
    rng = np.random.default_rng(21)
    k, n = 64, 48
    f16 = TensorProto.FLOAT16
    inits = [numpy_helper.from_array(rng.standard_normal(n).astype(np.float16), "b")]
    if chain.startswith("nbits"):
        q = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        inits += [numpy_helper.from_array(q, "q"),
                  numpy_helper.from_array((rng.random(n * (k // 32)) * 0.05 + 0.01).astype(np.float16), "s")]
        nodes = [helper.make_node("MatMulNBits", ["x", "q", "s"], ["m"], domain="com.microsoft", K=k, N=n, bits=4,
                                  block_size=32)]
    else:
        inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.3).astype(np.float16), "w"))
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m"])]
    if chain == "silu":
        nodes += [helper.make_node("Sigmoid", ["m"], ["s1"]), helper.make_node("Mul", ["m", "s1"], ["y"])]
    elif chain.endswith("relu"):
        nodes += [helper.make_node("Add", ["m", "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    else:
        nodes.append(helper.make_node("Add", ["m", "b"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f16, [6, k])],
                              [helper.make_tensor_value_info("y", f16, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8).SerializeToString()
    feeds = {"x": rng.standard_normal((6, k)).astype(np.float16)}
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    sess = onnxpack.InferenceSession(model)
    got = sess.run(None, feeds)[0]
    assert got.dtype == want.dtype == np.float16
    off = got.view(np.int16).astype(np.int32) - want.view(np.int16).astype(np.int32)
    # (the float32 products may round a sum the other way, which a half rounding rarely shows)
    assert np.abs(off).max() <= 1 and np.mean(off != 0) <= 0.02, (np.abs(off).max(), np.mean(off != 0))
    steps = sess.program.root.steps
    if chain.startswith("nbits"):  # the MatMulNBits alone, the Add after it
        assert len(steps) >= 2 and steps[0].node.op_type == "MatMulNBits" and len(steps[0].node.input) < 6
    else:
        assert len(steps) == 1  # the chain fused
