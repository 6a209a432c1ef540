"""Native Reduce*, Softmax, LogSoftmax and Hardmax against onnx.reference or numpy.

Tolerances: integer outputs exact; float32 rtol 1e-6 / atol 1e-7 (rtol 1e-5 for the
exp/log-based reductions, whose summation order differs); float16 rtol/atol 5e-3 (we accumulate
float16 in float32, onnx.reference in float16) except Softmax, which must match bit for bit.  Softmax before opset 13 is checked against a
numpy statement of the spec's flatten-to-2-D rule, because onnx.reference applies the opset-13
axis rule at every opset.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_util import assert_outputs_match, make_node, run_native, run_ort, run_reference

from onnxpack.session.kernels import lookup

rng = np.random.default_rng(1)
TOL = {np.dtype(np.float32): dict(rtol=1e-6, atol=1e-7), np.dtype(np.float16): dict(rtol=5e-3, atol=5e-3)}
LOOSE = {"ReduceLogSumExp", "ReduceLogSum", "ReduceL2", "ReduceMean", "ReduceProd", "Softmax", "LogSoftmax"}


def check(node, inputs, opset, op=None):
    got = run_native(node, inputs, opset)

    def prepare(g, w):
        if node.op_type == "ReduceSumSquare" and inputs[0].dtype == np.int32:
            # onnx.reference's np.sum widens int32 to int64; the spec keeps T.
            assert g.dtype == np.int32
            w = w.astype(np.int32)
        return w

    def tol(dtype):
        t = dict(TOL[dtype])
        if dtype == np.float32 and (op or node.op_type) in LOOSE:
            t["rtol"] = 1e-5
        return t

    assert_outputs_match(got, run_reference(node, inputs, opset), tol, equal_nan=True, prepare=prepare)
    return got


def data(shape, dtype):
    if np.dtype(dtype).kind in "iu":
        return rng.integers(1, 5, size=shape).astype(dtype)
    return rng.uniform(0.2, 2.0, size=shape).astype(dtype)


REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]  # fmt: skip
AXES = [None, [0], [-1], [1, 2], [0, -1]]


def _axes_opset(op):
    return 13 if op == "ReduceSum" else 18


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", AXES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", REDUCE)
def test_reduce_axes_input(op, dtype, axes, keepdims):
    if np.dtype(dtype).kind in "iu" and op in ("ReduceLogSumExp", "ReduceLogSum", "ReduceL2", "ReduceMean"):
        pytest.skip("float-only math")
    x = data((2, 3, 4), dtype)
    opset = _axes_opset(op)
    if axes is None:
        check(make_node(op, ["x"], ["y"], keepdims=keepdims), [x], opset)
    else:
        check(make_node(op, ["x", "a"], ["y"], keepdims=keepdims), [x, np.array(axes, np.int64)], opset)


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", AXES, ids=str)
@pytest.mark.parametrize("op", REDUCE)
def test_reduce_axes_attribute(op, axes, keepdims):
    opset = 11
    attrs = {"keepdims": keepdims}
    if axes is not None:
        attrs["axes"] = axes
    check(make_node(op, ["x"], ["y"], **attrs), [data((2, 3, 4), np.float32)], opset)


@pytest.mark.parametrize("noop", [0, 1])
@pytest.mark.parametrize("op", REDUCE)
def test_reduce_empty_axes(op, noop):
    """No axes: every axis, or with noop_with_empty_axes a reduction over none, whose
    elementwise part still applies (ReduceL1 |x|, ReduceSumSquare x^2, ReduceLogSum log x), as
    onnxruntime and onnx.reference compute it."""
    x = data((2, 3), np.float32)
    opset = _axes_opset(op)
    (y,) = check(make_node(op, ["x", "a"], ["y"], noop_with_empty_axes=noop), [x, np.zeros(0, np.int64)], opset)
    if noop and op in ("ReduceSum", "ReduceMax", "ReduceMean"):
        np.testing.assert_array_equal(y, x)
    if noop:
        xs = np.array([[-2.0, 0.5, 3.0], [1e-3, -0.0, 7.0]], np.float32)
        ins = [xs if op != "ReduceLogSum" else np.abs(xs) + 0.5, np.zeros(0, np.int64)]
        node = make_node(op, ["x", "a"], ["y"], noop_with_empty_axes=1)
        np.testing.assert_allclose(run_native(node, ins, opset)[0], run_ort(node, ins, opset, optimize=False)[0],
                                   rtol=1e-6)


def test_reduce_l2_float16_squares_in_float32_and_empty_means_are_zero():
    """ReduceL2 of float16 squares and sums in float32 (float16 squares overflow from 256 and
    small ones underflow), rounded once, as onnxruntime; a mean over an empty axis is 0
    (onnxruntime's; the spec leaves it undefined)."""
    x = np.array([[300.0, 300.0, 4.0], [1e-4, 1e-4, 1e-4]], np.float16)
    node = make_node("ReduceL2", ["x", "a"], ["y"], keepdims=0)
    ins = [x, np.array([1], np.int64)]
    (got,) = run_native(node, ins, 18)
    np.testing.assert_array_equal(got, run_ort(node, ins, 18, optimize=False)[0])
    assert np.isfinite(got).all() and got[1] > 0
    for dtype in (np.float32, np.float16, np.int64):
        empty = [np.zeros((4, 0, 2), dtype), np.array([1], np.int64)]
        mean = make_node("ReduceMean", ["x", "a"], ["y"], keepdims=1)
        np.testing.assert_array_equal(run_native(mean, empty, 18)[0], run_ort(mean, empty, 18, optimize=False)[0])


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceLogSumExp", "ReduceSumSquare"])
def test_reduce_over_empty_dimension(op):
    x = np.zeros((2, 0, 3), np.float32)
    check(make_node(op, ["x", "a"], ["y"], keepdims=1), [x, np.array([1], np.int64)], _axes_opset(op))


def test_reduce_zero_d_result_is_array():
    (y,) = run_native(make_node("ReduceSum", ["x"], ["y"], keepdims=0), [data((3, 4), np.float32)], 13)
    assert isinstance(y, np.ndarray) and y.shape == ()


def test_reduce_log_sum_exp_is_stable():
    x = np.array([[1000.0, 1000.0], [-np.inf, -np.inf]], np.float32)
    (y,) = run_native(make_node("ReduceLogSumExp", ["x", "a"], ["y"], keepdims=0), [x, np.array([1], np.int64)], 18)
    np.testing.assert_allclose(y, [1000 + np.log(2), -np.inf], rtol=1e-6)


# --- Softmax family --------------------------------------------------------------------------
def numpy_softmax_2d(x, axis, op):
    axis = axis % x.ndim
    flat = x.astype(np.float64).reshape(int(np.prod(x.shape[:axis])), -1)
    if op == "Hardmax":
        y = np.zeros_like(flat)
        y[np.arange(flat.shape[0]), flat.argmax(1)] = 1
    else:
        e = np.exp(flat - flat.max(1, keepdims=True))
        y = e / e.sum(1, keepdims=True)
        if op == "LogSoftmax":
            y = np.log(y)
    return y.reshape(x.shape).astype(x.dtype)


SOFT = ["Softmax", "LogSoftmax", "Hardmax"]


@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1, -3], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", SOFT)
def test_softmax_axis_rule(op, dtype, axis):
    x = rng.normal(0, 3, size=(2, 3, 5)).astype(dtype)
    attrs = {} if axis is None else {"axis": axis}
    check(make_node(op, ["x"], ["y"], **attrs), [x], 13)


@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1, -2], ids=str)
@pytest.mark.parametrize("op", SOFT)
@pytest.mark.parametrize("opset", [1, 11])
def test_softmax_flatten_rule(op, axis, opset):
    x = rng.normal(0, 3, size=(2, 3, 5)).astype(np.float32)
    attrs = {} if axis is None else {"axis": axis}
    (y,) = run_native(make_node(op, ["x"], ["y"], **attrs), [x], opset)
    want = numpy_softmax_2d(x, 1 if axis is None else axis, op)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_softmax_large_values_and_empty():
    x = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    (y,) = run_native(make_node("Softmax", ["x"], ["y"]), [x], 13)
    np.testing.assert_allclose(y, [[1, 0, 0]], atol=1e-7)
    (y,) = run_native(make_node("Softmax", ["x"], ["y"]), [np.zeros((0, 4), np.float32)], 13)
    assert y.shape == (0, 4)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("shape", [(2, 3, 8), (4, 200)], ids=str)
def test_softmax_float16_matches_reference_bit_for_bit(shape, opset):
    # Regression: float16 Softmax computed in float32 and rounded once differed from
    # onnx.reference (and the float16 Attention conformance data) by ~1.2e-3 relative.
    x = rng.normal(0, 3, size=shape).astype(np.float16)
    node = make_node("Softmax", ["x"], ["y"], axis=-1)
    (got,) = run_native(node, [x], opset)
    (want,) = run_reference(node, [x], opset)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)


def test_hardmax_first_maximum_wins():
    x = np.array([[1.0, 3.0, 3.0, 0.0]], np.float32)
    (y,) = check(make_node("Hardmax", ["x"], ["y"]), [x], 13)
    assert y.tolist() == [[0, 1, 0, 0]]


@pytest.mark.parametrize(
    "op,opset,name",
    [("ReduceSum", 11, "ReduceSum_1"), ("ReduceSum", 13, "ReduceSum_13"), ("ReduceMean", 17, "ReduceMean_1"),
     ("ReduceMean", 18, "ReduceMean_18"), ("ReduceMax", 20, "ReduceMax_18"), ("Softmax", 12, "Softmax_1"),
     ("Softmax", 13, "Softmax_13"), ("LogSoftmax", 11, "LogSoftmax_1"), ("Hardmax", 21, "Hardmax_13")],
    ids=lambda v: str(v),
)
def test_registry_picks_version(op, opset, name):
    cls = lookup("", op, opset)
    assert cls is not None and cls.__name__ == name


@pytest.mark.parametrize("jit", ["jit", "numpy"])
@pytest.mark.parametrize("shape", [(2, 12, 16, 16), (3, 40), (5, 7), (1, 1), (2, 3, 1)], ids=str)
def test_softmax_last_axis_jit_equals_reference(shape, jit, monkeypatch):
    """float32 Softmax over the last axis runs the JIT's softmax_rows (rows shorter and longer
    than its 16 lanes, with a tail); rows holding NaN, +Inf or only -Inf give NaN as numpy's
    formula does, and a row with some -Inf gives 0 there."""
    from onnxpack.session.kernels import _act

    if jit == "numpy":
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    elif _act.jit() is None:
        pytest.skip("numba not installed")
    x = rng.normal(0, 4, size=shape).astype(np.float32)
    if x.shape[-1] >= 3 and x.size // x.shape[-1] >= 4:
        rows = x.reshape(-1, x.shape[-1])
        rows[0, 1] = np.nan
        rows[1, 2] = np.inf
        rows[2, :] = -np.inf
        rows[3, 0] = -np.inf
    with np.errstate(all="ignore"):
        check(make_node("Softmax", ["x"], ["y"]), [x], 13)
