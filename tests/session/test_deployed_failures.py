"""Failures found running onnxruntime's own test data, each reproduced in code and fixed at its cause.

onnxruntime is the oracle (graph optimizations off, so it runs the very graph we run); where ONNX
is silent its behaviour is the spec.  Every model runs through ``onnxpack.InferenceSession`` with
its constants as initializers (the pre-packed path), with ``session.disable_prepacking=1``, and —
where the fix touches packing — fed as graph inputs (the unpacked kernel path) and saved by
``onnxpack optimize`` and loaded warm.

Tolerances: float32 rtol 1e-5 / atol 1e-6 for the small one-op models here (a handful of terms per
output; measured worst 3e-7), float16 outputs rtol/atol 1e-3 (one fp16 rounding either side),
integer and bool outputs exactly.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack import cli
from onnxpack.errors import InvalidArgument, OnnxpackError
from onnxpack.session.kernels.rnn import ACTIVATIONS
from onnxpack.session._fold import COMPUTED_MAX_BYTES

F, H, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64
TOL = {np.dtype(np.float32): dict(rtol=1e-5, atol=1e-6), np.dtype(np.float16): dict(rtol=1e-3, atol=1e-3),
       np.dtype(np.float64): dict(rtol=1e-12, atol=1e-12)}


def vi(name: str, elem: int, dims) -> onnx.ValueInfoProto:
    """A value info whose dims may be ints (negative ones kept: ``make_tensor_value_info`` would
    too, but being explicit is the point here), strings or None."""
    v = helper.make_tensor_value_info(name, elem, None)
    if dims is None:
        return v
    shape = v.type.tensor_type.shape
    shape.SetInParent()
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, str):
            dim.dim_param = d
        elif d is not None:
            dim.dim_value = d
    return v


def model(nodes, inputs, outputs, inits=(), opset=17) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8).SerializeToString()


def ort_run(data: bytes, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def session(data, *, prepack: bool = True) -> onnxpack.InferenceSession:
    so = onnxpack.SessionOptions()
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    return onnxpack.InferenceSession(data, so)


def assert_same(got, want, what: str = "") -> None:
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        w = np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, w.dtype, g.shape, w.shape)
        if w.dtype.kind == "f":
            np.testing.assert_allclose(g, w, err_msg=f"{what} output {k}", **TOL[w.dtype])
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{what} output {k}")


def check_both(data: bytes, feeds, want=None) -> list[np.ndarray]:
    """onnxpack with and without pre-packing equals onnxruntime; returns onnxpack's outputs."""
    want = ort_run(data, feeds) if want is None else want
    for prepack in (True, False):
        got = session(data, prepack=prepack).run(None, feeds)
        assert_same(got, want, f"prepack={prepack}")
    return got


# -- dim_value -1: a legacy spelling of "unknown" ------------------------------------------------
@pytest.mark.parametrize("dim", [-1, -2], ids=["minus1", "minus2"])
def test_negative_dim_value_is_unknown_everywhere(dim):
    """onnxruntime accepts any size for a negative declared dimension and reports it as None."""
    data = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", F, [dim, 3])], [vi("y", F, [dim, 3])])
    ref = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    sess = session(data)
    assert [a.shape for a in sess.get_inputs()] == [a.shape for a in ref.get_inputs()] == [[None, 3]]
    assert [a.shape for a in sess.get_outputs()] == [a.shape for a in ref.get_outputs()] == [[None, 3]]
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3)).astype(np.float32)
        assert_same(sess.run(None, {"x": x}), ref.run(None, {"x": x}))
    # A fixed dimension next to it is still checked.
    with pytest.raises(InvalidArgument, match="index: 1 Got: 4 Expected: 3"):
        sess.run(None, {"x": np.zeros((2, 4), np.float32)})


def test_paddle_style_classifier_with_minus_one_dims(tmp_path):
    """The shape of PP-OCR's ch_ppocr_mobile_v2.0_cls_infer.onnx: [-1, 3, 48, 192] in, [-1, 2]
    out, -1 in value_info too; run, optimized, warm, and by the ``onnxpack run`` command."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    scale, bias = rng.uniform(0.5, 1.5, 8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    mean, var = rng.standard_normal(8).astype(np.float32) * 0.1, rng.uniform(0.5, 1.5, 8).astype(np.float32)
    fc = (rng.standard_normal((8, 2)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["bn"]),
        helper.make_node("HardSwish", ["bn"], ["hs"]),
        helper.make_node("GlobalAveragePool", ["hs"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=1),
    ]
    inits = [numpy_helper.from_array(a, n) for n, a in
             [("w", w), ("s", scale), ("b", bias), ("m", mean), ("v", var), ("fc", fc)]]
    g = helper.make_graph(nodes, "cls", [vi("x", F, [-1, 3, 48, 192])], [vi("y", F, [-1, 2])], inits,
                          value_info=[vi("c", F, [-1, 8, 24, 96]), vi("flat", F, [-1, 8])])
    src = tmp_path / "cls.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)], ir_version=7), str(src))
    x = rng.standard_normal((3, 3, 48, 192)).astype(np.float32)
    want = ort_run(str(src), {"x": x})
    check_both(str(src), {"x": x}, want)
    out = tmp_path / "cls.opt.onnx"
    assert cli.main(["optimize", str(src), "-o", str(out), "--no-progress"]) == 0
    warm = session(str(out))
    assert warm.get_prepack_stats()["weights_packed"] == 0
    assert_same(warm.run(None, {"x": x}), want, "warm")
    assert cli.main(["run", str(out)]) == 0  # random feeds: unknown dims become 1


@pytest.mark.parametrize("declared", [[3, -1], [3, None], [3, "n"]], ids=["minus1", "missing", "symbolic"])
def test_zero_trip_scan_output_with_unknown_dims_matches_onnxruntime(declared):
    """A Loop that runs no iteration returns empty scan outputs shaped from the body's declared
    per-iteration shape, with 0 for an unknown dimension: a -1 is unknown like a missing or
    symbolic one (onnxruntime: (0, 3, 0) for all three)."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Identity", ["z"], ["scan"])],
        "body", [vi("i", I64, []), vi("c", TensorProto.BOOL, [])],
        [vi("c_out", TensorProto.BOOL, []), vi("scan", F, declared)])
    data = model([helper.make_node("Loop", ["M", ""], ["s"], body=body)],
                 [vi("M", I64, []), vi("z", F, [3, "k"])], [vi("s", F, None)], opset=13)
    got = check_both(data, {"M": np.array(0, np.int64), "z": np.ones((3, 5), np.float32)})
    assert got[0].shape == (0, 3, 0)


# -- Loop bodies whose iteration number is a 1-element tensor -----------------------------------
@pytest.mark.parametrize("iter_rank", [1, 0], ids=["iter-int64[1]", "iter-scalar"])
def test_loop_body_declaring_iter_num_as_1d(iter_rank):
    """onnxruntime feeds ``iter_num`` with the rank the body declares; the body squeezes it (as
    exporters write it) and stops after 3 iterations through its condition."""
    ax = numpy_helper.from_array(np.array([0], np.int64), "ax")
    nodes, i_name = [], "i"
    if iter_rank:
        nodes.append(helper.make_node("Squeeze", ["i", "ax"], ["i_s"]))
        i_name = "i_s"
    nodes += [
        helper.make_node("Cast", [i_name], ["i_f"], to=F),
        helper.make_node("Add", ["acc", "i_f"], ["acc_out"]),
        helper.make_node("Less", [i_name, "two"], ["lt"]),
        helper.make_node("And", ["c", "lt"], ["c_out"]),
        helper.make_node("Identity", ["i_f"], ["trace"]),
    ]
    body = helper.make_graph(
        nodes, "body", [vi("i", I64, [1] if iter_rank else []), vi("c", TensorProto.BOOL, []), vi("acc", F, [])],
        [vi("c_out", TensorProto.BOOL, []), vi("acc_out", F, []), vi("trace", F, [])],
        [ax, numpy_helper.from_array(np.array(2, np.int64), "two")])
    data = model([helper.make_node("Loop", ["M", "cond", "a0"], ["a", "t"], body=body)],
                 [vi("M", I64, []), vi("cond", TensorProto.BOOL, []), vi("a0", F, [])],
                 [vi("a", F, []), vi("t", F, None)], opset=13)
    feeds = {"M": np.array(10, np.int64), "cond": np.array(True), "a0": np.array(0.5, np.float32)}
    got = check_both(data, feeds)
    assert got[0] == np.float32(3.5) and got[1].tolist() == [0.0, 1.0, 2.0]  # iterations 0, 1, 2


# -- RNN / GRU / LSTM activations --------------------------------------------------------------
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
N_ACTS = {"RNN": 1, "GRU": 2, "LSTM": 3}
# Moderate parameters and weights: with unbounded activations (Affine, Softplus, LeakyRelu ...) in
# every gate the states grow step by step, and large states would compare accumulation orders, not
# kernels.  Measured worst relative difference to onnxruntime with these: 1.2e-6.
ALPHAS, BETAS = [0.6, 0.8, 0.9], [0.3, 0.2, 0.1]


def rnn_model(op: str, acts, *, alphas=None, betas=None, direction="forward", seq_lens=None, clip=None,
              as_inputs=False, hidden=5, seed=0):
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    arrays = {
        "W": (rng.standard_normal((nd, g * hidden, 4)) * 0.3).astype(np.float32),
        "R": (rng.standard_normal((nd, g * hidden, hidden)) * 0.2).astype(np.float32),
        "B": (rng.standard_normal((nd, 2 * g * hidden)) * 0.2).astype(np.float32),
    }
    x = rng.standard_normal((6, 3, 4)).astype(np.float32)
    attrs = dict(hidden_size=hidden, direction=direction)
    if acts is not None:
        attrs["activations"] = acts
    if alphas is not None:
        attrs["activation_alpha"] = alphas
    if betas is not None:
        attrs["activation_beta"] = betas
    if clip is not None:
        attrs["clip"] = clip
    names = ["X", "W", "R", "B"]
    feeds = {"X": x}
    if seq_lens is not None:
        names.append("L")
        feeds["L"] = np.array(seq_lens, np.int32)
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outputs, **attrs)
    inputs = [vi("X", F, [6, 3, 4])] + ([vi("L", TensorProto.INT32, [3])] if seq_lens is not None else [])
    if as_inputs:
        inputs += [vi(n, F, a.shape) for n, a in arrays.items()]
        feeds.update(arrays)
        inits = []
    else:
        inits = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    return model([node], inputs, [vi(o, F, None) for o in outputs], inits, opset=14), feeds


DEFAULT_ACTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("op,position", [("RNN", 0), ("GRU", 0), ("GRU", 1), ("LSTM", 0), ("LSTM", 1), ("LSTM", 2)],
                         ids=["RNN-f", "GRU-f", "GRU-g", "LSTM-f", "LSTM-g", "LSTM-h"])
def test_every_activation_in_every_position_matches_onnxruntime(op, position, act):
    """Each activation in each position (the others the defaults), alpha/beta given so no default
    is involved (an unbounded function in every LSTM position at once makes the cell grow doubly
    exponentially: overflow, not a kernel, would be compared)."""
    acts = list(DEFAULT_ACTS[op])
    acts[position] = act
    data, feeds = rnn_model(op, acts, alphas=ALPHAS[: len(acts)], betas=BETAS[: len(acts)])
    check_both(data, feeds)


@pytest.mark.parametrize("as_inputs", [False, True], ids=["initializers", "graph-inputs"])
@pytest.mark.parametrize("case", [
    ("relu", dict(acts=["Relu"])),
    ("relu-bidi", dict(acts=["Relu", "Sigmoid"], direction="bidirectional")),
    ("default-tanh-reverse", dict(acts=None, direction="reverse")),
    ("seqlens-clip", dict(acts=["Relu"], seq_lens=[6, 0, 3], clip=0.9)),
    ("two-for-one-direction", dict(acts=["Relu", "Tanh"])),
    ("leakyrelu-elu-defaults", dict(acts=["LeakyRelu", "Elu"], direction="bidirectional")),
    ("hardsigmoid-default", dict(acts=["HardSigmoid"])),
    ("scaledtanh-default", dict(acts=["ScaledTanh"])),
], ids=lambda c: c[0])
def test_rnn_matches_onnxruntime(case, as_inputs):
    """Plain RNN (onnx.reference knows only Tanh): directions, sequence_lens with a zero length,
    clip, onnxruntime's defaults where ONNX has none (ScaledTanh: 0, 0), two activations for one
    direction (onnxruntime ignores the second)."""
    kwargs = dict(case[1])
    data, feeds = rnn_model("RNN", kwargs.pop("acts"), as_inputs=as_inputs, **kwargs)
    check_both(data, feeds)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_spec_defaults_where_onnxruntime_departs_from_them(op):
    """Affine (alpha 1, beta 0) and ThresholdedRelu (alpha 1) without parameters: ONNX says the
    defaults of the corresponding operators; onnxruntime uses 0.  We follow the spec, so the
    result equals the same node with those values given explicitly."""
    n = N_ACTS[op]
    for act, alpha, beta in (("Affine", 1.0, 0.0), ("ThresholdedRelu", 1.0, None)):
        data, feeds = rnn_model(op, [act] * n)
        explicit, _ = rnn_model(op, [act] * n, alphas=[alpha] * n, betas=None if beta is None else [beta] * n)
        want = ort_run(explicit, feeds)
        assert_same(session(data).run(None, feeds), want, act)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_unknown_activation_is_the_nodes_invalid_argument(op):
    data, _ = rnn_model(op, ["Swish"] * N_ACTS[op])
    with pytest.raises(InvalidArgument, match="unknown activation 'Swish'"):
        session(data)


def test_rnn_packs_its_weights_and_saves_them(tmp_path):
    data, feeds = rnn_model("RNN", ["Relu", "Relu"], direction="bidirectional")
    src, out = tmp_path / "rnn.onnx", tmp_path / "rnn.opt.onnx"
    src.write_bytes(data)
    cold = session(str(src))
    assert {e["op_type"] for e in cold.get_prepack_log()} == {"RNN"} and len(cold.get_prepack_log()) == 3
    assert cli.main(["optimize", str(src), "-o", str(out), "--no-progress"]) == 0
    warm = session(str(out))
    assert warm.get_prepack_stats()["blobs_from_model"] == 3 and warm.get_prepack_stats()["weights_packed"] == 0
    for a, b in zip(warm.run(None, feeds), cold.run(None, feeds)):
        np.testing.assert_array_equal(a, b)


# -- Constant with sparse_value ----------------------------------------------------------------
@pytest.mark.parametrize("coo", [False, True], ids=["linear-indices", "coo-indices"])
def test_constant_sparse_value_matches_onnxruntime(coo):
    values = numpy_helper.from_array(np.array([1.5, -2.5, 4.0], np.float32), "v")
    if coo:
        indices = numpy_helper.from_array(np.array([[0, 1], [1, 0], [2, 3]], np.int64), "i")
    else:
        indices = numpy_helper.from_array(np.array([1, 4, 11], np.int64), "i")
    sp = helper.make_sparse_tensor(values, indices, [3, 4])
    data = model([helper.make_node("Constant", [], ["c"], sparse_value=sp), helper.make_node("Add", ["x", "c"], ["y"])],
                 [vi("x", F, [3, 4])], [vi("y", F, [3, 4])], opset=13)
    check_both(data, {"x": np.arange(12, dtype=np.float32).reshape(3, 4)})


def test_constant_sparse_value_out_of_bounds_names_the_node():
    sp = helper.make_sparse_tensor(numpy_helper.from_array(np.array([1.0], np.float32), "v"),
                                   numpy_helper.from_array(np.array([12], np.int64), "i"), [3, 4])
    data = model([helper.make_node("Constant", [], ["c"], name="sparse_c", sparse_value=sp)], [], [vi("c", F, [3, 4])],
                 opset=13)
    with pytest.raises(OnnxpackError, match="sparse_c.*sparse_value"):
        session(data)


# -- LayerNormalization with mixed input dtypes --------------------------------------------------
@pytest.mark.parametrize("opset", [13, 16])
@pytest.mark.parametrize("x_type,p_type", [(H, F), (F, H), (H, H)], ids=["x16-p32", "x32-p16", "x16-p16"])
def test_layernorm_mixed_dtypes_below_opset_17_as_onnxruntime_runs_it(x_type, p_type, opset):
    """onnxruntime's own LayerNormalization (opsets 1-16, default domain): Y takes Scale's dtype,
    Mean and InvStdDev are float32."""
    rng = np.random.default_rng(opset)
    pdt = helper.tensor_dtype_to_np_dtype(p_type)
    inits = [numpy_helper.from_array(rng.standard_normal(16).astype(pdt), "s"),
             numpy_helper.from_array(rng.standard_normal(16).astype(pdt), "b")]
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1, epsilon=1e-5)
    data = model([node], [vi("x", x_type, [2, 3, 16])], [vi("y", p_type, None), vi("mean", F, None), vi("inv", F, None)],
                 inits, opset=opset)
    x = rng.standard_normal((2, 3, 16)).astype(helper.tensor_dtype_to_np_dtype(x_type))
    got = check_both(data, {"x": x})
    assert got[0].dtype == pdt


def test_layernorm_mixed_dtypes_at_opset_17_are_refused_as_onnxruntime_does():
    inits = [numpy_helper.from_array(np.ones(8, np.float32), "s"), numpy_helper.from_array(np.zeros(8, np.float32), "b")]
    data = model([helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], name="ln")], [vi("x", H, [2, 8])],
                 [vi("y", H, None)], inits, opset=17)
    with pytest.raises(Exception, match="LayerNormalization"):
        ort_run(data, {"x": np.ones((2, 8), np.float16)})
    with pytest.raises(OnnxpackError, match="X is float16 but Scale is float32"):
        session(data).run(None, {"x": np.ones((2, 8), np.float16)})


# -- back-to-back Cast of a constant -----------------------------------------------------------
@pytest.mark.parametrize("leaf", ["initializer", "constant-node"])
@pytest.mark.parametrize("mid", [H, TensorProto.INT32, TensorProto.DOUBLE, TensorProto.BFLOAT16],
                         ids=["via-f16", "via-i32", "via-f64", "via-bf16"])
@pytest.mark.parametrize("bias", [(2, 8), (1100, 2, 8)], ids=["small-bias", "large-bias"])
def test_cast_of_a_cast_of_a_constant(tmp_path, mid, leaf, bias):
    """W → Cast(mid) → Cast(float) → MatMul and B → Cast(mid) → Cast(float) → Add: the MatMul
    packs the twice-cast weight (a constant expression, both Casts leave the plan); the Add's
    operand, a computed constant read unpacked, folds when small (computed once at creation: no
    step, no pack) and above ``_fold.COMPUTED_MAX_BYTES`` keeps its last Cast, which packs its own
    result (mapped at a warm start); the values are onnxruntime's exactly (casts are exact, the
    MatMul sums 24 terms), cold, without pre-packing, warm after ``onnxpack optimize`` with no
    warning, and from the cache file."""
    rng = np.random.default_rng(mid)
    w = (rng.standard_normal((24, 8)) * 40).astype(np.float32)
    b = (rng.standard_normal(bias) * 40).astype(np.float32)
    large = b.nbytes > COMPUTED_MAX_BYTES
    nodes = [helper.make_node("Cast", ["w"], ["w1"], to=mid), helper.make_node("Cast", ["w1"], ["w2"], to=F),
             helper.make_node("MatMul", ["x", "w2"], ["y"]),
             helper.make_node("Cast", ["b"], ["b1"], to=mid), helper.make_node("Cast", ["b1"], ["b2"], to=F),
             helper.make_node("Add", ["y", "b2"], ["z"])]
    if leaf == "initializer":
        inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    else:
        inits = []
        nodes = [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w, "w")),
                 helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(b, "b"))] + nodes
    src = tmp_path / "cast.onnx"
    src.write_bytes(model(nodes, [vi("x", F, [2, 24])], [vi("z", F, list(bias))], inits))
    feeds = {"x": rng.standard_normal((2, 24)).astype(np.float32)}
    want = ort_run(str(src), feeds)
    cold = session(str(src))
    assert_same(cold.run(None, feeds), want, "cold")
    assert sorted((e["node"] or e["op_type"], e["op_type"]) for e in cold.get_prepack_log()) == [
        ("Cast", "Cast"), ("MatMul", "MatMul")][0 if large else 1:]
    assert [s.node.op_type for s in cold.program.root.steps] == ["MatMul", "Cast", "Add"] if large else ["MatMul", "Add"]
    assert_same(session(str(src), prepack=False).run(None, feeds), want, "no prepack")
    out = tmp_path / "cast.opt.onnx"
    assert cli.main(["optimize", str(src), "-o", str(out), "--no-progress"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "blob ignored, re-packing" on the warm load
        warm = session(str(out))
    stats = warm.get_prepack_stats()
    assert stats["weights_packed"] == 0 and stats["blobs_from_model"] == 1 + large
    assert_same(warm.run(None, feeds), want, "warm")
    assert_same(ort_run(str(out), feeds), want, "onnxruntime on the saved model")
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("onnxpack.prepacked_cache_path", str(tmp_path / "cache.bin"))
    onnxpack.InferenceSession(str(src), so)
    cached = onnxpack.InferenceSession(str(src), so)
    assert cached.get_prepack_stats()["blobs_from_cache"] == 1 + large
    assert_same(cached.run(None, feeds), want, "cache file")


# -- Multinomial ---------------------------------------------------------------------------------
PROBS = np.array([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.0, 0.25, 0.5]])
N_SAMPLES = 20000
# Each frequency of N_SAMPLES draws has a standard error <= sqrt(0.25 / 20000) = 0.0035; 0.02 is
# over 5 of them.  With a seed the draws are fixed, so the bound cannot flake.
FREQ_TOL = 0.02


def multinomial_model(dtype: int | None = None, seed: float | None = 3.0, sample_size: int = N_SAMPLES) -> bytes:
    attrs = dict(sample_size=sample_size)
    if seed is not None:
        attrs["seed"] = seed
    if dtype is not None:
        attrs["dtype"] = dtype
    out_type = dtype if dtype is not None else TensorProto.INT32
    return model([helper.make_node("Multinomial", ["x"], ["y"], **attrs)], [vi("x", F, [3, 4])],
                 [vi("y", out_type, None)])


def _logits() -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(PROBS).astype(np.float32)  # log(0) = -inf: probability 0


def _freqs(samples: np.ndarray) -> np.ndarray:
    return np.stack([np.bincount(row, minlength=4) / row.size for row in samples])


@pytest.mark.parametrize("dtype", [None, TensorProto.INT64], ids=["int32-default", "int64"])
def test_multinomial_samples_onnxruntimes_distribution(dtype):
    data = multinomial_model(dtype)
    x = {"x": _logits()}
    (want,) = ort_run(data, x)
    (got,) = session(data).run(None, x)
    assert got.dtype == want.dtype and got.shape == want.shape == (3, N_SAMPLES)
    assert got.min() >= 0 and got.max() < 4
    assert (got[2] != 1).all()  # a -inf logit is never drawn
    np.testing.assert_allclose(_freqs(got), PROBS, atol=FREQ_TOL)
    np.testing.assert_allclose(_freqs(got), _freqs(want), atol=FREQ_TOL)


def test_multinomial_seed_fixes_the_sequence_per_session():
    """With a seed, two sessions draw the same sequence and successive runs of one session draw
    fresh samples (onnxruntime behaves the same); without one, sessions differ."""
    x = {"x": _logits()}
    data = multinomial_model(sample_size=50)
    a, b = session(data), session(data)
    first = a.run(None, x)[0]
    np.testing.assert_array_equal(first, b.run(None, x)[0])
    assert not np.array_equal(first, a.run(None, x)[0])
    ref_a, ref_b = (ort.InferenceSession(data, providers=["CPUExecutionProvider"]) for _ in range(2))
    r1 = ref_a.run(None, x)[0]
    assert np.array_equal(r1, ref_b.run(None, x)[0]) and not np.array_equal(r1, ref_a.run(None, x)[0])
    unseeded = multinomial_model(seed=None, sample_size=50)
    assert not np.array_equal(session(unseeded).run(None, x)[0], session(unseeded).run(None, x)[0])


def test_multinomial_row_without_finite_logit_gives_class_count_like_onnxruntime():
    data = multinomial_model(sample_size=8)
    x = {"x": np.full((3, 4), -np.inf, np.float32)}
    (want,) = ort_run(data, x)
    (got,) = session(data).run(None, x)
    np.testing.assert_array_equal(got, want)
    assert (got == 4).all()


def test_multinomial_bad_dtype_is_invalid_argument():
    data = multinomial_model(dtype=TensorProto.FLOAT, sample_size=2)
    with pytest.raises(InvalidArgument, match="dtype must be int32"):
        session(data)
