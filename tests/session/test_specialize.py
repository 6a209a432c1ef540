"""Shape specialization (session/_specialize.py): plans rewritten per set of input shapes.

Every test compares outputs with onnx.reference (exact for these integer/copy-only graphs, or
``allclose`` at 1e-6 where floats are computed) on the first runs (generic), the runs after
specialization, and runs whose shapes differ; and checks what the specialized plan holds.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxpack
from onnxpack.session import _specialize
from onnxpack.session.kernels import _act

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name + "_t"))


def _model(nodes, inputs, outputs, opset=17) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8).SerializeToString()


def _batch_if_model() -> bytes:
    """Silero-style: Squeeze axis 0 when the batch is 1 (If on Shape -> Gather -> Equal), then a
    Reshape to [batch * rows, -1] computed from Shape, and Relu; an Identity to the output."""
    then_g = helper.make_graph([_const("ax0", np.array([0], np.int64)),
                                helper.make_node("Squeeze", ["h", "ax0"], ["sq"])], "then", [],
                               [helper.make_tensor_value_info("sq", F, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["h"], ["id"])], "else", [],
                               [helper.make_tensor_value_info("id", F, None)])
    nodes = [
        helper.make_node("Relu", ["x"], ["h"]),
        helper.make_node("Shape", ["h"], ["s"]),
        _const("i0", np.array(0, np.int64)),
        _const("one", np.array(1, np.int64)),
        helper.make_node("Gather", ["s", "i0"], ["b"]),
        helper.make_node("Equal", ["b", "one"], ["is1"]),
        helper.make_node("If", ["is1"], ["picked"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Shape", ["picked"], ["ps"]),
        _const("minus1", np.array([-1], np.int64)),
        _const("ax", np.array([0], np.int64)),
        helper.make_node("ReduceProd", ["ps"], ["n"], keepdims=1),
        helper.make_node("Concat", ["n", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["picked", "target"], ["flat"]),
        helper.make_node("Sigmoid", ["flat"], ["sig"]),
        helper.make_node("Identity", ["sig"], ["y"]),
        helper.make_node("Identity", ["s"], ["shape_out"]),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["b", "r", "c"])],
                  [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("shape_out", I64, None)])


def _check(sess, model, feeds):
    want = ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds)
    got = sess.run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    return got


def _plans(sess):
    return sess._runner.specializer._plans


@pytest.mark.parametrize("shape", [(1, 3, 4), (2, 3, 4), (1, 1, 1)], ids=["batch1", "batch2", "ones"])
def test_specialized_plan_folds_shape_logic_inlines_if_and_matches_reference(shape):
    model = _batch_if_model()
    sess = onnxpack.InferenceSession(model)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for _ in range(4):  # generic, recording, specialized, specialized
        _check(sess, model, {"x": x})
    (plan,) = _plans(sess).values()
    ops = [s.node.op_type for s in plan.steps]
    # Relu, Sigmoid, the Reshape (its target a constant now), the Squeeze when batch is 1, and a
    # guard for each Shape step's input (Relu's output, the If's).
    assert "If" not in ops and "Gather" not in ops and "Equal" not in ops and "Concat" not in ops
    assert ops.count("ShapeGuard") == 2
    assert "Identity" not in ops  # the else branch's and the output's Identity are aliases now
    assert len(plan.steps) < len(sess.program.root.steps)


def test_new_shapes_get_their_own_plan_and_old_ones_keep_theirs():
    model = _batch_if_model()
    sess = onnxpack.InferenceSession(model)
    rng = np.random.default_rng(1)
    shapes = [(1, 2, 3), (3, 2, 3), (1, 5, 1), (1, 2, 3), (3, 2, 3)]
    for shape in shapes * 3:
        _check(sess, model, {"x": rng.standard_normal(shape).astype(np.float32)})
    assert len(_plans(sess)) == 3


def test_a_shape_output_that_became_a_constant_is_copied_for_the_user():
    model = _batch_if_model()
    sess = onnxpack.InferenceSession(model)
    x = np.ones((2, 3, 4), np.float32)
    for _ in range(3):
        got = _check(sess, model, {"x": x})
        got[1][...] = 99  # writing an output must not change what later runs return
    assert _plans(sess)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[1], [2, 3, 4])


def _data_dependent_model() -> bytes:
    """NonZero's output shape depends on the values, not the input shape: a Shape of it,
    arithmetic, and a ConstantOfShape sized by it."""
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"]),
        helper.make_node("Shape", ["nz"], ["s"]),
        _const("i1", np.array([1], np.int64)),
        helper.make_node("Gather", ["s", "i1"], ["count"]),
        helper.make_node("ConstantOfShape", ["count"], ["z"], value=numpy_helper.from_array(np.ones(1, np.float32))),
        helper.make_node("ReduceSum", ["z"], ["y"], keepdims=0),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F, [6])], [helper.make_tensor_value_info("y", F, None)])


def test_a_guard_miss_reruns_generically_and_the_key_stays_generic():
    model = _data_dependent_model()
    sess = onnxpack.InferenceSession(model)
    a = np.array([1, 0, 2, 0, 0, 3], np.float32)
    b = np.array([1, 1, 1, 1, 0, 1], np.float32)
    for _ in range(3):
        assert _check(sess, model, {"x": a})[0] == 3
    (plan,) = _plans(sess).values()
    assert any(s.node.op_type == "ShapeGuard" for s in plan.steps)
    assert _check(sess, model, {"x": b})[0] == 5  # same input shape, other NonZero shape
    assert list(_plans(sess).values()) == [_specialize._GENERIC]
    for x in (a, b, a):
        _check(sess, model, {"x": x})


def test_if_on_a_data_value_stays_an_if():
    then_g = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", F, None)])
    else_g = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             _const("zero", np.array(0, np.float32)),
             helper.make_node("Greater", ["total", "zero"], ["pos"]),
             helper.make_node("If", ["pos"], ["y"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Shape", ["y"], ["s"]),
             _const("i0", np.array(0, np.int64)),
             helper.make_node("Gather", ["s", "i0"], ["n"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [3])],
                   [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("n", I64, None)])
    sess = onnxpack.InferenceSession(model)
    for x in ([1, 2, -1], [1, 2, -1], [-5, 1, 1], [1, 1, 1], [-5, 1, 1]):
        _check(sess, model, {"x": np.array(x, np.float32)})
    (plan,) = _plans(sess).values()
    assert [s.node.op_type for s in plan.steps].count("If") == 1


def _rate_if_model() -> bytes:
    """Silero VAD v5's layout: ``If(sr == 16000)`` around the model (``sr`` a 0-d int64 input),
    the 16 kHz branch holding a shape If of its own (batch 1 squeezed) and the 8 kHz branch
    another computation; ``step`` is an int64 input that only feeds arithmetic."""
    inner_then = helper.make_graph([_const("ax0", np.array([0], np.int64)), helper.make_node("Squeeze", ["h", "ax0"], ["sq"])],
                                   "inner_then", [], [helper.make_tensor_value_info("sq", F, None)])
    inner_else = helper.make_graph([helper.make_node("Identity", ["h"], ["hid"])], "inner_else", [],
                                   [helper.make_tensor_value_info("hid", F, None)])
    then_g = helper.make_graph([
        helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Shape", ["h"], ["s"]),
        _const("i0", np.array(0, np.int64)), _const("one", np.array(1, np.int64)),
        helper.make_node("Gather", ["s", "i0"], ["b"]), helper.make_node("Equal", ["b", "one"], ["is1"]),
        helper.make_node("If", ["is1"], ["t"], then_branch=inner_then, else_branch=inner_else)],
        "then", [], [helper.make_tensor_value_info("t", F, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", F, None)])
    nodes = [_const("rate", np.array(16000, np.int64)), helper.make_node("Equal", ["sr", "rate"], ["is16"]),
             helper.make_node("If", ["is16"], ["y"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Add", ["step", "one_"], ["next"]), _const("one_", np.array(1, np.int64))]
    nodes = nodes[-1:] + nodes[:-1]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["b", 3]), helper.make_tensor_value_info("sr", I64, []),
                          helper.make_tensor_value_info("step", I64, [])],
                  [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("next", I64, None)])


def test_an_if_on_a_small_integer_input_is_inlined_per_value_of_that_input():
    """An If whose condition a small integer input decides (Silero VAD v5's sample rate) is
    inlined, nested shape Ifs with it, in a plan per value of that input: its runs no longer pay
    for the If frames (Silero v5 0.24 -> 0.10 ms a run; onnxruntime 0.08).  The keys hold that
    input's value, not the step counter's (which no condition reads): the counter changing at
    every run keeps using the plan."""
    model = _rate_if_model()
    sess = onnxpack.InferenceSession(model)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 3)).astype(np.float32)
    for step in range(5):
        _check(sess, model, {"x": x, "sr": np.array(16000, np.int64), "step": np.array(step, np.int64)})
    specializer = sess._runner.specializer
    assert specializer.value_at == (sess.program.root.input_names.index("sr"),)
    (plan,) = _plans(sess).values()
    assert plan is not _specialize._GENERIC
    ops = [st.node.op_type for st in plan.steps]
    assert "If" not in ops and "Equal" not in ops and ops.count("Squeeze") == 1, ops
    # Another rate, another batch: each its own plan, every run as the reference computes it.
    feeds = [{"x": x, "sr": np.array(8000, np.int64), "step": np.array(1, np.int64)},
             {"x": rng.standard_normal((2, 3)).astype(np.float32), "sr": np.array(16000, np.int64),
              "step": np.array(7, np.int64)}]
    for f in feeds * 3 + [{"x": x, "sr": np.array(16000, np.int64), "step": np.array(9, np.int64)}]:
        _check(sess, model, f)
    assert len([p for p in _plans(sess).values() if p is not _specialize._GENERIC]) == 3


def test_an_if_on_an_input_that_changes_at_every_run_computes_every_run():
    """The rate changing at every run (each value a new key, never specialized) and an input too
    large to key by: every run still computes the branch its condition picks."""
    model = _rate_if_model()
    sess = onnxpack.InferenceSession(model)
    x = np.random.default_rng(5).standard_normal((1, 3)).astype(np.float32)
    for k in range(8):
        _check(sess, model, {"x": x, "sr": np.array(16000 if k % 2 else 8000 + k, np.int64), "step": np.array(k, np.int64)})


def test_a_branch_that_reuses_an_outer_name_is_not_inlined():
    # Not valid ONNX (names are SSA across scopes), but runnable: the branch's "h" shadows the
    # main graph's "h" inside the branch.  Inlining would clash; the If must stay.
    then_g = helper.make_graph([helper.make_node("Neg", ["x"], ["h"])], "then", [],
                               [helper.make_tensor_value_info("h", F, None)])
    else_g = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Size", ["s"], ["rank"]),
             _const("one", np.array(1, np.int64)),
             helper.make_node("Equal", ["rank", "one"], ["is1"]),
             helper.make_node("If", ["is1"], ["r"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("Add", ["r", "h"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, None)], [helper.make_tensor_value_info("y", F, None)])
    sess = onnxpack.InferenceSession(model)
    x = np.array([1.5, -2.0], np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], -x + np.maximum(x, 0))
    (plan,) = _plans(sess).values()
    assert "If" in [s.node.op_type for s in plan.steps]


def test_a_loop_body_reading_a_folded_value_and_an_aliased_name():
    # The Loop's body reads "n" (folded: the input's length) and "h" (an If output inlined).
    body = helper.make_graph(
        [helper.make_node("Add", ["acc", "n_f"], ["acc2"]), helper.make_node("Add", ["acc2", "hs"], ["acc3"]),
         helper.make_node("Identity", ["c"], ["c2"])],
        "body", [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("acc", F, [])],
        [helper.make_tensor_value_info("c2", TensorProto.BOOL, []), helper.make_tensor_value_info("acc3", F, [])])
    then_g = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0)], "then", [],
                               [helper.make_tensor_value_info("t", F, None)])
    else_g = helper.make_graph([helper.make_node("ReduceMax", ["x"], ["e"], keepdims=0)], "else", [],
                               [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ReduceProd", ["s"], ["n"], keepdims=0),
             helper.make_node("Cast", ["n"], ["n_f"], to=F),
             _const("three", np.array(3, np.int64)),
             helper.make_node("Greater", ["n", "three"], ["big"]),
             helper.make_node("If", ["big"], ["hs"], then_branch=then_g, else_branch=else_g),
             _const("trips", np.array(2, np.int64)),
             _const("cond", np.array(True)),
             _const("zero", np.array(0, np.float32)),
             helper.make_node("Loop", ["trips", "cond", "zero"], ["y"], body=body)]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, None)], [helper.make_tensor_value_info("y", F, None)])
    sess = onnxpack.InferenceSession(model)
    rng = np.random.default_rng(2)
    for shape in ((2,), (5,), (2,), (5,), (2,), (5,)):
        _check(sess, model, {"x": rng.standard_normal(shape).astype(np.float32)})
    assert len(_plans(sess)) == 2


def test_specialization_can_be_turned_off_and_is_off_without_optimizations():
    model = _batch_if_model()
    opts = onnxpack.SessionOptions()
    opts.add_session_config_entry("onnxpack.specialize_shapes", "0")
    assert onnxpack.InferenceSession(model, opts)._runner.specializer is None
    opts = onnxpack.SessionOptions()
    opts.graph_optimization_level = onnxpack.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = onnxpack.InferenceSession(model, opts)
    assert sess._runner.specializer is None
    _check(sess, model, {"x": np.ones((1, 2, 2), np.float32)})
    # A model with no Shape, Size or If has nothing to specialize.
    plain = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", F, None)],
                   [helper.make_tensor_value_info("y", F, None)])
    assert onnxpack.InferenceSession(plain)._runner.specializer is None


def test_a_run_with_run_options_takes_the_generic_plan():
    model = _batch_if_model()
    sess = onnxpack.InferenceSession(model)
    x = np.ones((1, 2, 2), np.float32)
    ro = onnxpack.RunOptions()
    for _ in range(3):
        _check(sess, model, {"x": x})
        np.testing.assert_array_equal(sess.run(["y"], {"x": x}, ro)[0], sess.run(None, {"x": x})[0])


def test_reshaping_steps_become_guarded_reshapes():
    # Unsqueeze/Reshape with constant axes/shapes run as one reshape for the recorded input
    # shape; NonZero's output changes shape with the same input shape: the reshape's guard misses.
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]),
             _const("ax", np.array([0], np.int64)),
             helper.make_node("Unsqueeze", ["nz", "ax"], ["u"]),
             _const("shape", np.array([-1], np.int64)),
             helper.make_node("Reshape", ["u", "shape"], ["flat"]),
             helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["r", "s"], ["same"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2, 3])],
                   [helper.make_tensor_value_info("flat", I64, None), helper.make_tensor_value_info("same", F, None)])
    sess = onnxpack.InferenceSession(model)
    a = np.array([[1, 0, 2], [0, 0, 3]], np.float32)
    for _ in range(3):
        _check(sess, model, {"x": a})
    (plan,) = _plans(sess).values()
    kernels = [type(s.kernel).__name__ for s in plan.steps]
    assert kernels.count("_FixedReshape") == 3 and "Shape" not in [s.node.op_type for s in plan.steps]
    _check(sess, model, {"x": np.ones((2, 3), np.float32)})  # 6 nonzeros, not 3: the guard misses
    assert list(_plans(sess).values()) == [_specialize._GENERIC]
    _check(sess, model, {"x": a})


def _fixed_forms_model() -> bytes:
    """Steps with fixed forms (Kernel.fixed) for the recorded shapes: a reflect Pad and a
    constant Pad, a Gather of one row (a negative index), a strided Slice, a 3-tap Conv + Relu
    over four positions and a 1x1 head (conv_tiny), an STFT-like Conv (conv_windows); a reflect
    Pad of NonZero's indices (its shape depends on the data: its guard misses); a Shape to make
    the plan worth specializing."""
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((16, 8, 3)) / 5).astype(np.float32)
    w2 = (rng.standard_normal((2, 16, 1)) / 4).astype(np.float32)
    w3 = (rng.standard_normal((70, 1, 64)) / 8).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "B1"),
             numpy_helper.from_array(w2, "W2"), numpy_helper.from_array(w3, "W3")]
    nodes = [
        _const("p1", np.array([0, 0, 2, 0, 0, 3], np.int64)),
        helper.make_node("Pad", ["x", "p1"], ["a"], mode="reflect"),
        _const("p2", np.array([0, 0, 1, 0, 0, 2], np.int64)),
        _const("v", np.array(1.5, np.float32)),
        helper.make_node("Pad", ["a", "p2", "v"], ["b"], mode="constant"),
        _const("st", np.array([1], np.int64)), _const("en", np.array([12], np.int64)),
        _const("axs", np.array([2], np.int64)), _const("sp", np.array([3], np.int64)),
        helper.make_node("Slice", ["b", "st", "en", "axs", "sp"], ["c"]),
        helper.make_node("Conv", ["c", "W1", "B1"], ["d"], pads=[1, 1], kernel_shape=[3]),
        helper.make_node("Relu", ["d"], ["e"]),
        helper.make_node("Conv", ["e", "W2"], ["head"], kernel_shape=[1]),
        helper.make_node("Conv", ["wave", "W3"], ["spec"], strides=[40], kernel_shape=[64]),
        helper.make_node("NonZero", ["x"], ["nz"]),
        helper.make_node("Cast", ["nz"], ["nzf"], to=F),
        _const("p3", np.array([0, 2, 0, 1], np.int64)),
        helper.make_node("Pad", ["nzf", "p3"], ["nzp"], mode="reflect"),
        helper.make_node("Shape", ["x"], ["s"]),
        _const("row", np.array(-2, np.int64)),
        helper.make_node("Gather", ["x", "row"], ["picked"], axis=1),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, 8, 6]),
                                           helper.make_tensor_value_info("wave", F, [1, 1, 300])],
                              [helper.make_tensor_value_info(n, t, None) for n, t in
                               (("head", F), ("spec", F), ("nzp", F), ("s", I64), ("picked", F))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8).SerializeToString()


def test_fixed_forms_of_pad_slice_and_conv_match_the_reference_and_miss_guards_on_new_shapes():
    model = _fixed_forms_model()
    sess = onnxpack.InferenceSession(model)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 8, 6)).astype(np.float32)
    x[0, 0, :3] = 0  # (NonZero's count: 45 here, 48 with another input of the same shape)
    wave = rng.standard_normal((1, 1, 300)).astype(np.float32)
    outs = [_check(sess, model, {"x": x, "wave": wave}) for _ in range(4)]  # generic, recording, fixed, fixed
    for o in outs[2:]:
        for g, w in zip(o, outs[0]):
            np.testing.assert_array_equal(g, w)  # the fixed forms compute what the kernels compute
    (plan,) = _plans(sess).values()
    fixed = [s.node.op_type for s in plan.steps if type(s.kernel).__name__ == "_Fixed"]
    jit = _act.jit() is not None  # (without it the convs keep their general path: no fixed form)
    assert sorted(fixed) == (["Conv"] * 3 if jit else []) + ["Gather", "Pad", "Pad", "Pad", "Slice"]
    x2 = rng.standard_normal((1, 8, 6)).astype(np.float32)  # no zero: NonZero's output is wider
    _check(sess, model, {"x": x2, "wave": wave})
    assert list(_plans(sess).values()) == [_specialize._GENERIC]
    _check(sess, model, {"x": x, "wave": wave})


@pytest.mark.parametrize("opset", [13, 18])
def test_reductions_over_one_element_are_copies_in_specialized_plans(opset):
    """Sum, mean, max, min and product over axes of one element in all (attribute or input axes,
    keepdims either way) take a fixed form, a reshaped copy, equal to onnx.reference's bit for
    bit (NaN, -0.0 and inf kept); an integer mean (through float64) and a reduction over more
    than one element keep their kernels."""
    nodes, outs = [helper.make_node("Shape", ["x"], ["s"])], [helper.make_tensor_value_info("s", I64, None)]
    for k, (op, axes, keepdims, src) in enumerate([("ReduceMean", [1], 0, "x"), ("ReduceMax", [-3], 1, "x"),
                                                   ("ReduceMin", [1, 3], 0, "x"), ("ReduceProd", [1], 1, "x"),
                                                   ("ReduceSum", [1], 0, "x"), ("ReduceMean", [1], 1, "xi"),
                                                   ("ReduceSum", [2], 0, "x")]):
        attrs = {"keepdims": keepdims}
        ins = [src]
        if opset >= 18 or op == "ReduceSum":
            nodes.append(_const(f"a{k}", np.array(axes, np.int64)))
            ins.append(f"a{k}")
        else:
            attrs["axes"] = axes
        nodes.append(helper.make_node(op, ins, [f"y{k}"], **attrs))
        outs.append(helper.make_tensor_value_info(f"y{k}", TensorProto.INT32 if src == "xi" else F, None))
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2, 1, 3, 1]),
                           helper.make_tensor_value_info("xi", TensorProto.INT32, [2, 1, 3, 1])], outs, opset=opset)
    sess = onnxpack.InferenceSession(model)
    x = np.array([np.nan, -0.0, np.inf, 1.5, -2.25, 3e38], np.float32).reshape(2, 1, 3, 1)
    xi = np.arange(-3, 3, dtype=np.int32).reshape(2, 1, 3, 1) * 7
    ref = ReferenceEvaluator(onnx.load_from_string(model)).run(None, {"x": x, "xi": xi})
    for _ in range(4):
        got = sess.run(None, {"x": x, "xi": xi})
        for g, w in zip(got, ref):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
            assert (np.signbit(g) == np.signbit(w)).all()
    (plan,) = _plans(sess).values()
    fixed = [s.outputs[0] for s in plan.steps if type(s.kernel).__name__ == "_Fixed"]
    assert sorted(fixed) == ["y0", "y1", "y2", "y3", "y4"]


def test_a_subclass_that_overrides_run_offers_no_inherited_fixed_form():
    """com.microsoft's FusedConv runs Conv, then adds Z and applies its activation: Conv's fixed
    form (the conv alone) must not stand for it in a specialized plan; the result stays
    onnxruntime's.  Only a class that defines run offers a fixed form (FusedConv, ours, names
    Conv's)."""
    import onnxruntime as ort

    from onnxpack.session.kernels.contrib_tensor import MsPad
    from onnxpack.session.kernels.conv import Conv, FusedConv, OrtFusedConv
    from onnxpack.session.kernels.nchwc import NchwcConv
    from onnxpack.session.kernels.tensor import Pad11

    assert [_specialize._fixable(c) for c in (Conv, FusedConv, Pad11)] == [True, True, True]
    assert [_specialize._fixable(c) for c in (OrtFusedConv, NchwcConv, MsPad)] == [False, False, False]
    rng = np.random.default_rng(9)
    w = (rng.standard_normal((8, 16, 3)) / 4).astype(np.float32)
    nodes = [helper.make_node("FusedConv", ["x", "W", "B"], ["y"], domain="com.microsoft", activation="Relu",
                              pads=[1, 1], kernel_shape=[3]),
             helper.make_node("Shape", ["x"], ["s"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, 16, 1])],
                              [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("s", I64, None)],
                              [numpy_helper.from_array(w, "W"),
                               numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8).SerializeToString()
    x = rng.standard_normal((1, 16, 1)).astype(np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert (want == 0).any()  # (the Relu clips some outputs)
    sess = onnxpack.InferenceSession(model)
    for _ in range(4):  # generic, recording, specialized, specialized
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    (plan,) = _plans(sess).values()
    assert not [s for s in plan.steps if type(s.kernel).__name__ == "_Fixed"]
