"""Constant folding at compile (session/_fold.py): what folds, what does not, and that folded
programs compute what onnx.reference computes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxpack
from onnxpack.errors import RuntimeFailure
from onnxpack.session import _fold

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name + "_t"))


def _shape_chain_model() -> bytes:
    """x (2, 12) reshaped to a shape computed from a constant's Shape, Gather, Mul, Unsqueeze and
    Concat (Silero-style padding arithmetic), plus a padding amount from ConstantOfShape."""
    nodes = [
        _const("c", np.zeros((3, 4), np.float32)),
        helper.make_node("Shape", ["c"], ["s"]),
        _const("i0", np.int64(0)),
        _const("i1", np.int64(1)),
        helper.make_node("Gather", ["s", "i0"], ["d0"]),
        helper.make_node("Gather", ["s", "i1"], ["d1"]),
        helper.make_node("Mul", ["d0", "d1"], ["n"]),  # 12
        _const("ax", np.array([0], np.int64)),
        helper.make_node("Unsqueeze", ["n", "ax"], ["nu"]),
        _const("minus1", np.array([-1], np.int64)),
        helper.make_node("Concat", ["minus1", "nu"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("ConstantOfShape", ["nu"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.float32))),
        helper.make_node("Add", ["r", "ones"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 12])],
                              [helper.make_tensor_value_info("y", F, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _ops(sess) -> list[str]:
    return [s.node.op_type for s in sess.program.root.steps]


def test_shape_arithmetic_over_constants_folds_and_runs_like_the_reference():
    model = _shape_chain_model()
    x = np.random.default_rng(0).standard_normal((2, 12)).astype(np.float32)
    sess = onnxpack.InferenceSession(model)
    # Only the steps that read the input are left; every folded value is a plan constant.
    assert _ops(sess) == ["Reshape", "Add"]
    assert {"shape", "ones"} <= set(sess.program.root.constants)
    (want,) = ReferenceEvaluator(onnx.load_from_string(model)).run(None, {"x": x})
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)


def test_no_folding_without_graph_optimizations():
    so = onnxpack.SessionOptions()
    so.graph_optimization_level = onnxpack.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = onnxpack.InferenceSession(_shape_chain_model(), so)
    assert "Concat" in _ops(sess) and "Shape" in _ops(sess)
    x = np.ones((2, 12), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x + 1)


def test_random_and_large_values_keep_their_steps():
    big = np.arange(_fold.MAX_BYTES // 4 + 1, dtype=np.float32)
    nodes = [
        helper.make_node("RandomNormalLike", ["w"], ["noise"], seed=1.0),
        helper.make_node("Neg", ["big"], ["nbig"]),  # not a folding op
        helper.make_node("Identity", ["big"], ["ibig"]),  # a folding op, but over MAX_BYTES
        helper.make_node("Add", ["x", "noise"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, [3])],
        [helper.make_tensor_value_info(n, F, None) for n in ("y", "nbig", "ibig")],
        [numpy_helper.from_array(np.zeros(3, np.float32), "w"), numpy_helper.from_array(big, "big")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    sess = onnxpack.InferenceSession(model)
    assert sorted(_ops(sess)) == ["Add", "Identity", "Neg", "RandomNormalLike"]
    y, nbig, ibig = sess.run(None, {"x": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(nbig, -big)
    np.testing.assert_array_equal(ibig, big)


def test_a_kernel_error_is_left_to_the_run():
    nodes = [_const("shape", np.array([5, 5], np.int64)),
             _const("c", np.zeros(6, np.float32)),
             helper.make_node("Reshape", ["c", "shape"], ["bad"]),  # 6 elements into 25: invalid
             helper.make_node("Add", ["x", "bad"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, None)],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    sess = onnxpack.InferenceSession(model)  # creation does not fail
    assert "Reshape" in _ops(sess)
    with pytest.raises(RuntimeFailure):
        sess.run(None, {"x": np.zeros(1, np.float32)})


def test_subgraphs_read_values_folded_in_the_enclosing_graph():
    then_g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", F, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, None)])
    nodes = [_const("a", np.array([3], np.int64)), _const("b", np.array([-1], np.int64)),
             helper.make_node("Concat", ["a", "b"], ["shape"], axis=0),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [6]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    sess = onnxpack.InferenceSession(model)
    assert _ops(sess) == ["If"]
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x, "cond": np.array(True)})[0], x.reshape(3, 2))
    np.testing.assert_array_equal(sess.run(None, {"x": x, "cond": np.array(False)})[0], -x)


def test_folded_values_are_owned_copies():
    w = np.arange(8, dtype=np.float32)
    nodes = [helper.make_node("Slice", ["w", "st", "en"], ["ws"]), helper.make_node("Add", ["x", "ws"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, [4])], [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([2], np.int64), "st"),
         numpy_helper.from_array(np.array([6], np.int64), "en")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    sess = onnxpack.InferenceSession(model)
    ws = sess.program.root.constants["ws"]
    assert ws.flags.owndata and _ops(sess) == ["Add"]
    np.testing.assert_array_equal(sess.run(None, {"x": np.zeros(4, np.float32)})[0], w[2:6])


@pytest.mark.parametrize("large", [False, True], ids=["small-bias", "large-bias"])
def test_steps_fold_through_a_cast_chain_that_keeps_its_pack(large):
    """A Cast of a constant is a derived chain: a foldable step reading it folds through it;
    read by a step that does not fold, it folds itself when small (computed at creation) and
    above ``_fold.COMPUTED_MAX_BYTES`` keeps its step, which packs the value (mapped at a warm start)."""
    bias = np.arange(3000 * 12 if large else 2, dtype=np.float16).reshape((3000, 2, 3, 2) if large else (2,))
    assert (bias.size * 4 > _fold.COMPUTED_MAX_BYTES) == large
    nodes = [_const("c", np.array([2, 3], np.int32)),
             helper.make_node("Cast", ["c"], ["c64"], to=I64),
             _const("m1", np.array([-1], np.int64)),
             helper.make_node("Concat", ["c64", "m1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Cast", ["bias"], ["b32"], to=F),
             helper.make_node("Add", ["r", "b32"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [12])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    sess = onnxpack.InferenceSession(model)
    if large:
        assert _ops(sess) == ["Reshape", "Cast", "Add"]  # the bias Cast packs its result
        assert [e["op_type"] for e in sess.get_prepack_log()] == ["Cast"]
    else:
        assert _ops(sess) == ["Reshape", "Add"] and sess.get_prepack_log() == []
        assert sess.program.root.constants["b32"].dtype == np.float32
    x = np.arange(12, dtype=np.float32)
    (want,) = ReferenceEvaluator(onnx.load_from_string(model)).run(None, {"x": x})
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)


def _sliced_lstm_model(hidden: int = 8, inp: int = 5) -> tuple[bytes, dict]:
    """Silero-style: the LSTM's W, R and B built at run time from LSTMCell-layout weights by
    Slice + Concat + Unsqueeze of constants (gate blocks reordered i, f, g, o -> i, o, f, c)."""
    rng = np.random.default_rng(3)
    h = hidden
    w_ih = rng.standard_normal((4 * h, inp)).astype(np.float32) * 0.3
    w_hh = rng.standard_normal((4 * h, h)).astype(np.float32) * 0.3
    b = rng.standard_normal((8 * h,)).astype(np.float32) * 0.1
    inits = [numpy_helper.from_array(w_ih, "w_ih"), numpy_helper.from_array(w_hh, "w_hh"),
             numpy_helper.from_array(b, "b_all")]
    nodes = []

    def reorder(src, out, block):
        parts = []
        for k, (lo, hi) in enumerate([(0, 1), (3, 4), (1, 3)]):  # i, o, (f, g)
            for nm, v in (("s", lo * block), ("e", hi * block)):
                nodes.append(_const(f"{out}_{nm}{k}", np.array([v], np.int64)))
            nodes.append(_const(f"{out}_ax{k}", np.array([0], np.int64)))
            nodes.append(helper.make_node("Slice", [src, f"{out}_s{k}", f"{out}_e{k}", f"{out}_ax{k}"], [f"{out}_p{k}"]))
            parts.append(f"{out}_p{k}")
        nodes.append(helper.make_node("Concat", parts, [f"{out}_cat"], axis=0))
        nodes.append(_const(f"{out}_u", np.array([0], np.int64)))
        nodes.append(helper.make_node("Unsqueeze", [f"{out}_cat", f"{out}_u"], [out]))

    reorder("w_ih", "W", h)
    reorder("w_hh", "R", h)
    reorder("b_all", "B", 2 * h)  # 8H values in blocks of 2H: the shape is what matters here
    nodes.append(helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["y", "yh", "yc"], hidden_size=h))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3, 2, inp]),
                                           helper.make_tensor_value_info("h0", F, [1, 2, h]),
                                           helper.make_tensor_value_info("c0", F, [1, 2, h])],
                              [helper.make_tensor_value_info(n, F, None) for n in ("y", "yh", "yc")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": rng.standard_normal((3, 2, inp)).astype(np.float32),
             "h0": rng.standard_normal((1, 2, h)).astype(np.float32),
             "c0": rng.standard_normal((1, 2, h)).astype(np.float32)}
    return model.SerializeToString(), feeds


def test_folded_weights_are_packed_by_their_kernel():
    import onnxruntime as ort

    model, feeds = _sliced_lstm_model()
    sess = onnxpack.InferenceSession(model)
    (lstm,) = [s for s in sess.program.root.steps if s.node.op_type == "LSTM"]
    assert lstm.packed == {1, 2, 3}  # W, R, B: folded, then packed (fed None at run)
    assert not {"W", "R", "B"} & set(sess.program.root.constants)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, ref in zip(sess.run(None, feeds), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # With packing off nothing is packed, and the result is the same.
    opts = onnxpack.SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", "1")
    plain = onnxpack.InferenceSession(model, opts)
    for got, ref in zip(plain.run(None, feeds), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_a_folded_matmul_weight_is_packed_and_integer_constants_are_not():
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    nodes = [_const("w_a", w[:, :2]), _const("w_b", w[:, 2:]),
             helper.make_node("Concat", ["w_a", "w_b"], ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["m"]),
             _const("shape", np.array([-1], np.int64)),
             helper.make_node("Reshape", ["m", "shape"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 3])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    sess = onnxpack.InferenceSession(model)
    steps = {s.node.op_type: s for s in sess.program.root.steps}
    assert steps["MatMul"].packed == {1} and steps["Reshape"].packed == frozenset()
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    (want,) = ReferenceEvaluator(onnx.load_from_string(model)).run(None, {"x": x})
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-6)


def test_a_subgraph_folds_and_packs_weights_its_outer_scopes_hold_in_constant_nodes():
    """Silero VAD v5's layout: the weights are Constant nodes of an If branch, and the node that
    reads them (there its LSTM; here a MatMul) sits in an If nested in that branch, behind a
    Slice + Concat.  The outer scope's constants are known when the nested one compiles: the
    chain folds and the MatMul's weight is packed (it was re-sliced and read unpacked at every
    run); both branches compute what onnxruntime computes."""
    import onnxruntime as ort

    w = (np.arange(64, dtype=np.float32).reshape(16, 4) - 30) / 17
    inner_then = helper.make_graph(
        [_const("s0", np.array([0], np.int64)), _const("s8", np.array([8], np.int64)),
         _const("s16", np.array([16], np.int64)),
         helper.make_node("Slice", ["W", "s0", "s8"], ["lo"]), helper.make_node("Slice", ["W", "s8", "s16"], ["hi"]),
         helper.make_node("Concat", ["hi", "lo"], ["Wc"], axis=0), helper.make_node("MatMul", ["x", "Wc"], ["t"])],
        "inner_then", [], [helper.make_tensor_value_info("t", F, None)])
    inner_else = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["e"])], "inner_else", [],
                                   [helper.make_tensor_value_info("e", F, None)])
    outer_then = helper.make_graph(
        [helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(w, "W_t")),
         helper.make_node("If", ["inner"], ["o"], then_branch=inner_then, else_branch=inner_else)],
        "outer_then", [], [helper.make_tensor_value_info("o", F, None)])
    outer_else = helper.make_graph([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("ReduceSum", ["n"], ["r"])],
                                   "outer_else", [], [helper.make_tensor_value_info("r", F, None)])
    graph = helper.make_graph([helper.make_node("If", ["outer"], ["y"], then_branch=outer_then, else_branch=outer_else)],
                              "g", [helper.make_tensor_value_info("x", F, [2, 16]),
                                    helper.make_tensor_value_info("outer", TensorProto.BOOL, []),
                                    helper.make_tensor_value_info("inner", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    sess = onnxpack.InferenceSession(model)
    matmuls = [s for plan in sess.program.plans.values() for s in plan.steps if s.node.op_type == "MatMul"]
    assert len(matmuls) == 2 and all(s.packed == {1} for s in matmuls)
    inner = next(plan for path, plan in sess.program.plans.items() if path.endswith("then_branch") and path.count("/") == 2)
    assert [s.node.op_type for s in inner.steps] == ["MatMul"]  # the Slices and the Concat folded
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    for outer in (True, False):
        for inner_cond in (True, False):
            feeds = {"x": x, "outer": np.array(outer), "inner": np.array(inner_cond)}
            np.testing.assert_allclose(sess.run(None, feeds)[0], theirs.run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_a_folded_graph_output_is_copied_for_the_user():
    nodes = [_const("c", np.zeros((2, 3), np.float32)), helper.make_node("Shape", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1])],
                              [helper.make_tensor_value_info("y", I64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    sess = onnxpack.InferenceSession(model)
    x = np.zeros(1, np.float32)
    got = sess.run(None, {"x": x})[0]
    got[...] = 7  # the user's array: writing it must not change what later runs return
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], [2, 3])


@pytest.mark.parametrize("reader", ["Add", "Gemm"], ids=["read-unpacked", "offered-for-packing"])
def test_a_folded_constant_that_cannot_be_computed_is_the_models_error(reader, monkeypatch):
    """A small computed constant (a dequantized weight) is computed at creation: whatever its
    computation raises that is not onnxpack's own error (numpy's, on a hostile chain) comes out
    as InvalidGraph naming the constant, both where a step reads it unpacked and where the
    compile step first offers it to its reader's packing."""
    from onnxpack.errors import InvalidGraph
    from onnxpack.session.kernels import qdq

    def broken(self, *args):
        raise ValueError("operands could not be broadcast")
    monkeypatch.setattr(qdq.DequantizeLinear, "run", broken)
    inits = [numpy_helper.from_array(np.ones((4, 6), np.int8), "W"), numpy_helper.from_array(np.float32(0.5), "S"),
             numpy_helper.from_array(np.int8(0), "Z")]
    nodes = [helper.make_node("DequantizeLinear", ["W", "S", "Z"], ["w"])]
    if reader == "Add":
        nodes.append(helper.make_node("Add", ["x", "w"], ["y"], name="reader"))
    else:  # Gemm with transB: a pack it declines for the derived weight's layout is still offered the value
        nodes.append(helper.make_node("Gemm", ["x", "w"], ["y"], name="reader", transA=1))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [4, 6])],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()
    with pytest.raises(InvalidGraph, match="constant 'w' .*cannot be computed: ValueError"):
        onnxpack.InferenceSession(model)
