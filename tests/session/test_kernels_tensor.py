"""Native tensor-manipulation kernels against onnx.reference (the oracle).

Tolerances: everything that only moves elements is compared exactly (all dtypes); Resize
linear and Range on floats use rtol 1e-6 / atol 1e-6 for float32, cubic 1e-5 (four taps
with negative weights accumulated in float32) (we interpolate in
float32, onnx.reference in float64) and rtol/atol 2e-3 for float16.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from kernel_util import assert_outputs_match, make_node, run_native, run_ort, run_reference

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import KernelContext, lookup
from onnxpack.session.kernels import tensor

rng = np.random.default_rng(2)
I64 = np.int64


def i64(*v):
    return np.array(v, dtype=I64)


def check(node, inputs, opset=21, close=False, tol=None):
    got = run_native(node, inputs, opset)

    def tolerance(dtype):
        if not close:
            return None
        t = tol or (2e-3 if dtype == np.float16 else 1e-6)
        return dict(rtol=t, atol=t)

    assert_outputs_match(got, run_reference(node, inputs, opset), tolerance)
    return got


def x_(shape, dtype=np.float32):
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 100, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


# --- shapes ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,target,allowzero",
    [((2, 3, 4), (6, 4), 0), ((2, 3, 4), (-1,), 0), ((2, 3, 4), (0, -1), 0), ((2, 3, 4), (0, 0, 4), 0),
     ((0, 3), (3, 0), 1), ((2, 3), (3, 2), 1), ((1,), (), 0)],
    ids=str,
)
def test_reshape(shape, target, allowzero):
    x = x_(shape)
    (y,) = check(make_node("Reshape", ["x", "s"], ["y"], allowzero=allowzero), [x, i64(*target)])
    if x.size:
        assert np.shares_memory(x, y)  # a view, no copy


def test_reshape_opset1_attribute():
    (y,) = run_native(make_node("Reshape", ["x"], ["y"], shape=[3, -1]), [x_((2, 3))], 1)
    assert y.shape == (3, 2)


@pytest.mark.parametrize("perm", [None, [0, 2, 1], [2, 0, 1]], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_], ids=lambda d: np.dtype(d).name)
def test_transpose(perm, dtype):
    attrs = {} if perm is None else {"perm": perm}
    check(make_node("Transpose", ["x"], ["y"], **attrs), [x_((2, 3, 4), dtype) if dtype != np.bool_ else x_((2, 3, 4)) > 0])


@pytest.mark.parametrize("axis", [0, 1, 2, -1, 3], ids=str)
def test_flatten(axis):
    check(make_node("Flatten", ["x"], ["y"], axis=axis), [x_((2, 3, 4))], opset=13)


@pytest.mark.parametrize("axes", [None, [1], [-1], [1, 3]], ids=str)
@pytest.mark.parametrize("opset", [11, 13])
def test_squeeze(axes, opset):
    x = x_((2, 1, 3, 1))
    if opset >= 13:
        ins = [x] if axes is None else [x, i64(*axes)]
        check(make_node("Squeeze", ["x", "a"][: len(ins)], ["y"]), ins, opset)
    else:
        attrs = {} if axes is None else {"axes": axes}
        check(make_node("Squeeze", ["x"], ["y"], **attrs), [x], opset)


@pytest.mark.parametrize("axes", [[0], [1], [2], [-1], [-2], [-3], [1, 3], [0, -1]], ids=str)
@pytest.mark.parametrize("opset", [11, 13])
def test_unsqueeze(axes, opset):
    x = x_((2, 3))
    if opset >= 13:
        check(make_node("Unsqueeze", ["x", "a"], ["y"]), [x, i64(*axes)], opset)
    else:
        check(make_node("Unsqueeze", ["x"], ["y"], axes=axes), [x], opset)


@pytest.mark.parametrize("axis", [3, -4, 7])
def test_unsqueeze_axis_out_of_range_is_refused(axis):
    from onnxpack.session.kernels.tensor import _unsqueeze

    # one axis takes a fast path; out of [-rank-1, rank] it still gets numpy's error
    with pytest.raises(np.exceptions.AxisError):
        _unsqueeze(x_((2, 3)), [axis])
    assert _unsqueeze(np.array(5.0, np.float32), [-1]).shape == (1,)


@pytest.mark.parametrize("start,end", [(None, None), (1, None), (-2, None), (0, -1), (5, None), (-9, 2)], ids=str)
def test_shape(start, end):
    attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    check(make_node("Shape", ["x"], ["y"], **attrs), [x_((2, 3, 4))], opset=15)


def test_size():
    check(make_node("Size", ["x"], ["y"]), [x_((2, 3, 4))])
    check(make_node("Size", ["x"], ["y"]), [x_((0, 3))])


@pytest.mark.parametrize("shape,target", [((3, 1), (2, 3, 4)), ((1,), (3,)), ((2, 3), (1, 1)), ((3, 1), (3, 1))], ids=str)
def test_expand(shape, target):
    check(make_node("Expand", ["x", "s"], ["y"]), [x_(shape), i64(*target)])


def test_tile():
    check(make_node("Tile", ["x", "r"], ["y"]), [x_((2, 3)), i64(2, 3)])


# --- Concat / Split / Slice ------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1], ids=str)
def test_concat(axis):
    xs = [x_((2, 3)), x_((2, 3)), x_((2, 3))]
    check(make_node("Concat", ["a", "b", "c"], ["y"], axis=axis), xs)


def test_concat_with_empty():
    check(make_node("Concat", ["a", "b"], ["y"], axis=0), [x_((0, 3)), x_((2, 3))])


@pytest.mark.parametrize(
    "opset,axis,split,n",
    [(11, 0, None, 2), (11, 1, [1, 3], 2), (11, -1, [1, 1, 2], 3), (13, 1, None, 2), (13, 1, [3, 1], 2),
     (13, -1, [0, 4], 2), (18, 1, None, 3)],
    ids=str,
)
def test_split(opset, axis, split, n):
    x = x_((4, 4))
    outs = [f"y{i}" for i in range(n)]
    if opset >= 13:
        ins = [x] if split is None else [x, i64(*split)]
        attrs = {"axis": axis}
        if opset >= 18 and split is None:
            attrs["num_outputs"] = n
        check(make_node("Split", ["x", "s"][: len(ins)], outs, **attrs), ins, opset)
    else:
        attrs = {"axis": axis} if split is None else {"axis": axis, "split": split}
        check(make_node("Split", ["x"], outs, **attrs), [x], opset)


def test_split_uneven_num_outputs():
    check(make_node("Split", ["x"], ["a", "b", "c"], axis=0, num_outputs=3), [x_((7, 2))], 18)


@pytest.mark.parametrize("num_outputs", [1, 3, 2**63 - 1])
def test_split_num_outputs_other_than_the_outputs_is_refused(num_outputs):
    """onnxruntime refuses it too; 2**63 - 1 on an empty input was a loop that long (found by a fuzzer)."""
    from onnxpack.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="num_outputs"):
        run_native(make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=num_outputs), [x_((0, 2))], 18)


@pytest.mark.parametrize("sizes", [[1, 2], [2, 2, 0], [5, -1]])
def test_split_sizes_that_do_not_cover_the_axis_are_refused(sizes):
    from onnxpack.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="sizes"):
        run_native(make_node("Split", ["x", "s"], ["a", "b"], axis=0), [x_((4, 2)), i64(*sizes)], 13)


SLICES = [
    ([0], [2], None, None),
    ([1, 0], [3, -1], [0, 1], None),
    ([-1], [-100], [1], [-1]),
    ([3], [0], [0], [-2]),
    ([0], [2**62], [2], [2]),
    ([-100], [100], [-1], [1]),
    ([5], [10], [0], [1]),
    ([10], [-10], [0], [-1]),
    ([2], [2], [0], [1]),
]


@pytest.mark.parametrize("starts,ends,axes,steps", SLICES, ids=[str(i) for i in range(len(SLICES))])
def test_slice(starts, ends, axes, steps):
    x = x_((4, 5, 6))
    ins = [x, i64(*starts), i64(*ends)]
    if axes is not None:
        ins.append(i64(*axes))
    if steps is not None:
        ins.append(i64(*steps))
    check(make_node("Slice", ["x", "s", "e", "a", "t"][: len(ins)], ["y"]), ins, 13)


def test_slice_reuses_its_index_only_for_the_same_shape_and_values():
    """Slice keeps the index it made for (shape, int64 indices): one kernel fed the cases above
    in turn, twice, and on other shapes, equals onnx.reference each time; int32 indices whose
    bytes equal an int64 case's, and no axes against empty axes, are not confused."""
    node = make_node("Slice", ["x", "s", "e", "a", "t"], ["y"])
    kernel = lookup("", "Slice", 13)(node, KernelContext(13, {"": 13}))
    for shape in [(4, 5, 6), (6, 5, 4), (4, 5, 6)]:
        x = x_(shape)
        for starts, ends, axes, steps in SLICES * 2:
            a = i64(*(axes if axes is not None else range(len(starts))))
            t = i64(*(steps if steps is not None else [1] * len(starts)))
            want = run_reference(node, [x, i64(*starts), i64(*ends), a, t], 13)[0]
            got = kernel.run(x, i64(*starts), i64(*ends), a, t)[0]
            np.testing.assert_array_equal(got, want)
    x = x_((4, 5, 6))
    # int32 [2, 0] has the bytes of int64 [2]: as ends of axis 0 they mean 2 for both dims of axes [0, 1]
    got = kernel.run(x, np.array([0, 0], np.int32), np.array([2, 0], np.int32), np.array([0, 1], np.int32), None)[0]
    assert got.shape == (2, 0, 6)
    assert kernel.run(x, i64(0), i64(2), None, None)[0].shape == (2, 5, 6)  # no axes: axis 0
    assert kernel.run(x, i64(0), i64(2), None, None)[0].shape == (2, 5, 6)


def test_slice_opset1_attributes():
    node = make_node("Slice", ["x"], ["y"], starts=[1, -2], ends=[100, -1], axes=[0, 2])
    check(node, [x_((4, 5, 6))], 9)


# --- indexing --------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1], ids=str)
@pytest.mark.parametrize("ind_shape", [(), (2,), (2, 3)], ids=str)
def test_gather(axis, ind_shape):
    x = x_((3, 4, 5))
    dim = x.shape[axis]
    idx = rng.integers(-dim, dim, size=ind_shape).astype(I64)
    check(make_node("Gather", ["x", "i"], ["y"], axis=axis), [x, idx])


@pytest.mark.parametrize("axis", [0, 1, -1], ids=str)
def test_gather_elements(axis):
    x = x_((3, 4))
    shape = list(x.shape)
    shape[axis] = 5  # more indices than the axis holds; onnx.reference needs the other dims equal
    idx = rng.integers(-2, 2, size=shape).astype(I64)
    (y,) = run_native(make_node("GatherElements", ["x", "i"], ["y"], axis=axis), [x, idx], 13)
    # onnx.reference mishandles a negative axis: ask it with the equivalent positive one.
    (want,) = run_reference(make_node("GatherElements", ["x", "i"], ["y"], axis=axis % 2), [x, idx], 13)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd(batch_dims):
    x = x_((2, 3, 4))
    idx = np.array([[[0, 1], [1, 2]], [[1, 3], [0, 0]]], I64) if batch_dims else np.array([[0, 1], [1, 2]], I64)
    check(make_node("GatherND", ["x", "i"], ["y"], batch_dims=batch_dims), [x, idx])


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd(reduction):
    x = x_((4, 3))
    idx = np.array([[1], [3]], I64)
    upd = x_((2, 3))
    check(make_node("ScatterND", ["x", "i", "u"], ["y"], reduction=reduction), [x, idx, upd], 18)


@pytest.mark.parametrize("reduction", ["none", "add"])
@pytest.mark.parametrize("axis", [0, 1])
def test_scatter_elements(axis, reduction):
    x = x_((3, 4))
    idx = np.array([[0, 2], [1, 0]], I64)
    check(make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=axis, reduction=reduction), [x, idx, x_((2, 2))], 18)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_opset9_is_scatter_elements(axis):
    # Regression: Scatter (opset 9/10, deprecated at 11) had no kernel and onnx.reference has
    # none either; it is ScatterElements without reduction, which serves as the oracle.
    x = x_((3, 4))
    idx = np.array([[1, 0, 2], [0, 2, 1]], I64)
    upd = x_((2, 3))
    (got,) = run_native(make_node("Scatter", ["x", "i", "u"], ["y"], axis=axis), [x, idx, upd], 10)
    (want,) = run_reference(make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=axis), [x, idx, upd], 11)
    np.testing.assert_array_equal(got, want)


def test_nonzero():
    x = np.array([[1, 0, 2], [0, 0, 3]], np.float32)
    check(make_node("NonZero", ["x"], ["y"]), [x])
    check(make_node("NonZero", ["x"], ["y"]), [np.zeros((2, 0), np.float32)])


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("axis", [-1, 0, 1], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8], ids=lambda d: np.dtype(d).name)
def test_topk(largest, axis, dtype):
    x = rng.integers(0, 6, size=(4, 5, 6)).astype(dtype)  # many ties: the lower index must win
    check(make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest), [x, i64(3)], 11)


def test_topk_opset1():
    check(make_node("TopK", ["x"], ["v", "i"], k=2), [x_((3, 5))], 1)


@pytest.mark.parametrize("last", [0, 1])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axis", [0, -1], ids=str)
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_extreme(op, axis, keepdims, last):
    x = rng.integers(0, 3, size=(3, 4)).astype(np.float32)
    check(make_node(op, ["x"], ["y"], axis=axis, keepdims=keepdims, select_last_index=last), [x], 13)


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=lambda d: np.dtype(d).name)
def test_cumsum(exclusive, reverse, dtype):
    x = x_((3, 4), dtype)
    check(make_node("CumSum", ["x", "a"], ["y"], exclusive=exclusive, reverse=reverse), [x, np.array(1, np.int32)], close=True)


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.int64], ids=lambda d: np.dtype(d).name)
def test_cumprod_opset26(exclusive, reverse, axis, dtype):
    """CumProd (opset 26): the exclusive product starts from 1."""
    x = rng.integers(1, 4, size=(3, 4)).astype(dtype) * np.where(rng.random((3, 4)) < 0.3, -1, 1).astype(dtype)
    check(make_node("CumProd", ["x", "a"], ["y"], exclusive=exclusive, reverse=reverse), [x, np.array(axis, np.int64)],
          26, close=True)


@pytest.mark.parametrize("op", ["CumSum", "CumProd"])
@pytest.mark.parametrize("x_shape,axis", [((3, 4), 2), ((3, 4), -3), ((3, 4), 2**40), ((), 0)],
                         ids=["past-end", "before-start", "huge", "scalar"])
def test_cumulative_axis_out_of_range_is_refused(op, x_shape, axis):
    """An axis outside [-r, r) -- a scalar has none -- is an InvalidArgument naming the op (was
    numpy's AxisError, an int conversion error, or an IndexError on an exclusive scalar)."""
    node = make_node(op, ["x", "a"], ["y"], exclusive=1)
    with pytest.raises(InvalidArgument, match=f"{op}.*out of range"):
        run_native(node, [x_((x_shape)), np.array(axis, np.int64)], 26)


TENSOR_SCATTER_CASES = [
    # (cache shape, update rows, axis, mode, write indices or None)
    ((2, 2, 6, 4), 1, -2, "linear", (3, 5)),
    ((2, 2, 6, 4), 3, -2, "linear", None),
    ((2, 2, 6, 4), 6, 2, "linear", (0, 0)),
    ((2, 6, 4), 2, 1, "linear", (4, 1)),
    ((2, 2, 6, 4), 3, -2, "circular", (4, 5)),
    ((2, 2, 6, 4), 1, -2, "circular", (6, 11)),
    ((2, 3, 5), 2, -1, "circular", (4, 0)),
    ((2, 2, 6, 4), 0, -2, "linear", (2, 2)),
]


@pytest.mark.parametrize("case", TENSOR_SCATTER_CASES, ids=[f"{c[3]}-{k}" for k, c in enumerate(TENSOR_SCATTER_CASES)])
def test_tensor_scatter_opset24(case):
    """TensorScatter (a KV cache update outside Attention) vs onnx.reference; the past is never
    written in place."""
    shape, rows, axis, mode, where = case
    past = x_(shape)
    ushape = list(shape)
    ushape[axis] = rows
    update = x_(tuple(ushape))
    names = ["p", "u"] + (["w"] if where is not None else [])
    inputs = [past, update] + ([i64(*where)] if where is not None else [])
    before = past.copy()
    check(make_node("TensorScatter", names, ["y"], axis=axis, mode=mode), inputs, 24)
    np.testing.assert_array_equal(past, before)


@pytest.mark.parametrize("bad", ["past-end", "negative", "shape", "axis0", "mode", "indices"])
def test_tensor_scatter_refuses_what_does_not_fit(bad):
    past, update = x_((2, 2, 6, 4)), x_((2, 2, 2, 4))
    where = i64(3, 5)
    attrs = dict(axis=-2)
    if bad == "past-end":
        pass  # 5 + 2 rows > 6 in linear mode
    elif bad == "negative":
        where = i64(-1, 0)
    elif bad == "shape":
        update = x_((2, 3, 2, 4))
    elif bad == "axis0":
        attrs = dict(axis=0)
    elif bad == "mode":
        attrs = dict(mode="ring")
    else:
        where = i64(1, 2, 3)
    node = make_node("TensorScatter", ["p", "u", "w"], ["y"], **attrs)
    with pytest.raises(InvalidArgument, match="TensorScatter"):
        run_native(node, [past, update, where], 24)


@pytest.mark.parametrize("axis", [-1, 0, 1], ids=str)
def test_onehot(axis):
    idx = np.array([[0, 3, -1], [5, 2, -4]], I64)
    check(make_node("OneHot", ["i", "d", "v"], ["y"], axis=axis), [idx, np.array(4, I64), np.array([0.0, 2.5], np.float32)], 11)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 2], ids=str)
def test_trilu(upper, k):
    ins = [x_((2, 4, 5))] + ([] if k is None else [i64(k)])
    check(make_node("Trilu", ["x", "k"][: len(ins)], ["y"], upper=upper), ins, 14)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode):
    check(make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode), [x_((2, 8, 3, 4))], 13)


def test_space_to_depth():
    check(make_node("SpaceToDepth", ["x"], ["y"], blocksize=2), [x_((2, 3, 4, 6))], 13)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_mode(mode):
    # Regression: the opset-28 ``mode`` attribute was ignored (CRD computed as DCR).
    x = x_((2, 3, 4, 6))
    (y,) = check(make_node("SpaceToDepth", ["x"], ["y"], blocksize=2, mode=mode), [x], 28)
    # Inverse of DepthToSpace in the same mode, an oracle independent of onnx.reference.
    (back,) = run_native(make_node("DepthToSpace", ["y"], ["x"], blocksize=2, mode=mode), [y], 13)
    np.testing.assert_array_equal(back, x)


# --- constants / generators ------------------------------------------------------------------
@pytest.mark.parametrize(
    "attrs",
    [
        {"value": helper.make_tensor("v", TensorProto.FLOAT, [2, 2], [1, 2, 3, 4])},
        {"value": helper.make_tensor("v", TensorProto.INT64, [], [7])},
        {"value_float": 1.5},
        {"value_floats": [1.0, 2.5]},
        {"value_int": 3},
        {"value_ints": [1, 2, 3]},
    ],
    ids=["tensor", "scalar", "float", "floats", "int", "ints"],
)
def test_constant(attrs):
    (y,) = check(make_node("Constant", [], ["y"], **attrs), [], 13)
    assert not y.flags.writeable


def test_constant_sparse_falls_back():
    node = make_node("Constant", [], ["y"], value_string="abc")
    with pytest.raises(NotImplementedError):
        lookup("", "Constant", 13)(node, KernelContext(13, {"": 13}))


@pytest.mark.parametrize(
    "value", [None, helper.make_tensor("v", TensorProto.INT32, [1], [5]), helper.make_tensor("v", TensorProto.FLOAT16, [1], [1.5])],
    ids=["default", "int32", "float16"],
)
@pytest.mark.parametrize("shape", [(2, 3), (0,), ()], ids=str)
def test_constant_of_shape(value, shape):
    attrs = {} if value is None else {"value": value}
    check(make_node("ConstantOfShape", ["s"], ["y"], **attrs), [np.array(shape, I64)])


@pytest.mark.parametrize(
    "start,limit,delta,dtype",
    [(0, 10, 3, np.int64), (10, 4, -2, np.int32), (0.5, 3.2, 0.7, np.float32), (1, 1, 1, np.int64), (0, 1, 0.25, np.float16)],
    ids=str,
)
def test_range(start, limit, delta, dtype):
    ins = [np.array(v, dtype) for v in (start, limit, delta)]
    check(make_node("Range", ["a", "b", "c"], ["y"]), ins, 11, close=True)


@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_range_one_element_1d_inputs(dtype):
    # Regression: AffineGrid's function body feeds Range 1-element 1-D tensors, which numpy
    # cannot turn into Python scalars.  onnx.reference takes the one element.
    ins = [np.array([v], dtype) for v in (0, 5, 2)]
    (y,) = check(make_node("Range", ["a", "b", "c"], ["y"]), ins, 11, close=True)
    assert y.tolist() == [0, 2, 4]


def test_range_rejects_multi_element_inputs():
    with pytest.raises(ValueError):
        run_native(make_node("Range", ["a", "b", "c"], ["y"]), [i64(0, 1), i64(5), i64(1)], 11)


# --- Pad -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("pads", [[0, 1, 2, 1], [1, 0, 0, 2]], ids=str)
def test_pad(mode, pads):
    x = x_((3, 4))
    ins = [x, i64(*pads)]
    if mode == "constant":
        ins.append(np.array(1.5, np.float32))
    check(make_node("Pad", ["x", "p", "v"][: len(ins)], ["y"], mode=mode), ins, 13)


# One padded axis takes reflect's concatenate path; pads as long as the axis take np.pad's.
@pytest.mark.parametrize("pads", [[0, 2, 0, 3], [0, 0, 0, 3], [2, 0, 0, 0], [0, 3, 0, 0], [0, 4, 0, 1], [1, 0, 1, 0]],
                         ids=str)
def test_pad_reflect_one_axis(pads):
    check(make_node("Pad", ["x", "p"], ["y"], mode="reflect"), [x_((3, 4)), i64(*pads)], 13)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_negative_crops(mode):
    # onnx.reference (np.pad) rejects negative pads; the oracle is crop-then-np.pad.
    x = x_((3, 4))
    (y,) = run_native(make_node("Pad", ["x", "p"], ["y"], mode=mode), [x, i64(0, -1, 1, 0)], 13)
    np.testing.assert_array_equal(y, np.pad(x[:, 1:], [(0, 1), (0, 0)], mode=mode))


@pytest.mark.parametrize("pads", [[0, 7, 0, -7], [0, 3, 0, -6], [0, -6, 0, 3], [2, 0, -5, 0], [0, -2, 0, -2]],
                         ids=str)
def test_pad_negative_pads_beyond_the_axis_give_onnxruntimes_constant_output(pads):
    """A negative pad removing more than the axis holds after the other side's padding (+7 then
    -7 on an axis of 4): the output is the spec's length ``d + begin + end``, the pad value wherever
    the input is not (onnxruntime's; cropping first kept the input and the wrong length); the
    other modes refuse it, as onnxruntime does."""
    from onnxpack.errors import InvalidArgument

    x = x_((3, 4))
    ins = [x, i64(*pads), np.array(1.5, np.float32)]
    (got,) = run_native(make_node("Pad", ["x", "p", "v"], ["y"]), ins, 13)
    (want,) = run_ort(make_node("Pad", ["x", "p", "v"], ["y"]), ins, 13, optimize=False)
    np.testing.assert_array_equal(got, want)
    for mode in ("edge", "reflect"):
        if max(-pads[0], 0) + max(-pads[2], 0) > 3 or max(-pads[1], 0) + max(-pads[3], 0) > 4:
            with pytest.raises(InvalidArgument, match="remove more"):
                run_native(make_node("Pad", ["x", "p"], ["y"], mode=mode), [x, i64(*pads)], 13)


def test_pad_axes_and_wrap():
    x = x_((2, 3, 4))
    check(make_node("Pad", ["x", "p", "", "a"], ["y"]), [x, i64(1, 2, 0, 1), None, i64(-1, 0)], 18)
    check(make_node("Pad", ["x", "p"], ["y"], mode="wrap"), [x, i64(0, 1, 2, 0, 1, 1)], 19)


def test_pad_opset2_attributes():
    check(make_node("Pad", ["x"], ["y"], pads=[0, 1, 1, 0], value=2.0), [x_((3, 4))], 2)


# --- Resize ----------------------------------------------------------------------------------
RESIZE = [
    ("nearest", "asymmetric", "floor"),
    ("nearest", "half_pixel", "round_prefer_floor"),
    ("nearest", "half_pixel", "round_prefer_ceil"),
    ("nearest", "align_corners", "ceil"),
    ("nearest", "pytorch_half_pixel", "round_prefer_floor"),
    ("linear", "half_pixel", None),
    ("linear", "align_corners", None),
    ("linear", "asymmetric", None),
    ("linear", "pytorch_half_pixel", None),
    ("linear", "half_pixel_symmetric", None),
    ("cubic", "half_pixel", None),
    ("cubic", "align_corners", None),
]


@pytest.mark.parametrize("scales", [(1, 1, 2, 2), (1, 1, 0.5, 0.6), (1, 1, 1.7, 0.8)], ids=str)
@pytest.mark.parametrize("mode,coord,nearest", RESIZE, ids=["-".join(filter(None, r)) for r in RESIZE])
def test_resize_scales(mode, coord, nearest, scales):
    """Against onnx.reference; align_corners against onnxruntime, whose rule we follow where the
    two differ: it divides by the output's length minus one, onnx.reference (and the node suite's
    stored outputs) by the scale's un-rounded length minus one (5 x 1.7 = 8.5 for 8 positions)."""
    attrs = {"mode": mode, "coordinate_transformation_mode": coord}
    if nearest:
        attrs["nearest_mode"] = nearest
    x = x_((1, 2, 5, 6))
    node = make_node("Resize", ["x", "", "s"], ["y"], **attrs)
    inputs = [x, None, np.array(scales, np.float32)]
    if coord != "align_corners":
        check(node, inputs, 19, close=True, tol=1e-5 if mode == "cubic" else None)
        return
    t = 1e-5  # (float32 rounding of values ~1; the rules differed by 0.4-2.6)
    assert_outputs_match(run_native(node, inputs, 19), run_ort(node, inputs, 19, optimize=False),
                         lambda dtype: dict(rtol=t, atol=t))


@pytest.mark.parametrize("how", [("s", (1, 1, 2, 2)), ("s", (1, 1, 1.5, 3)), ("s", (1, 1, 0.6, 1.7)), ("s", (1, 1, 1, 2.5)),
                                 ("s", (2.5, 0.5)), ("z", (1, 2, 9, 4)), ("z", (7, 13))], ids=str)
@pytest.mark.parametrize("coord", ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"])
def test_linear_resize_is_onnxruntimes_bilinear_bit_for_bit(coord, how):
    """A float32 linear Resize over the last two axes (2-D, or 4-D with the outer axes kept) is
    onnxruntime's bilinear formula, bit for bit: its clamped coordinates, its weights (the
    distances to the other pixel; 0.5 and 0.5 at the last one) and its four products summed in
    order; non-finite inputs spread as there (a neighbour weighted 0 still multiplies).  The
    separable passes before rounded between the axes: a QuantizeLinear after an upsampling
    (quantize_static's QDQ models) moved a code at its ties."""
    kind, vals = how
    rng = np.random.default_rng(len(coord) + len(vals))
    x = rng.standard_normal((1, 2, 5, 6) if len(vals) == 4 else (5, 6)).astype(np.float32)
    x.reshape(-1)[[3, 17]] = [np.inf, np.nan]
    if kind == "s":
        node = make_node("Resize", ["x", "", "s"], ["y"], mode="linear", coordinate_transformation_mode=coord)
        inputs = [x, None, np.array(vals, np.float32)]
    else:
        node = make_node("Resize", ["x", "", "", "z"], ["y"], mode="linear", coordinate_transformation_mode=coord)
        inputs = [x, None, None, i64(*vals)]
    (got,) = run_native(node, inputs, 19)
    (want,) = run_ort(node, inputs, 19, optimize=False)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("extra", [{}, {"exclude_outside": 1}, {"cubic_coeff_a": -0.5}], ids=["plain", "exclude", "a05"])
@pytest.mark.parametrize("how", [("s", (1, 1, 2, 2)), ("s", (1, 1, 1.5, 0.7)), ("z", (1, 2, 9, 4)), ("z", (7, 13))], ids=str)
@pytest.mark.parametrize("coord", ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"])
def test_cubic_resize_is_onnxruntimes_bicubic_bit_for_bit(coord, how, extra):
    """A float32 cubic Resize over the last two axes is onnxruntime's ResizeBiCubic bit for bit:
    Keys coefficients of the coordinate's fraction in float32, along x then along y, each sum
    from 0 in order, ``exclude_outside`` renormalizing; non-finite inputs spread as there."""
    kind, vals = how
    rng = np.random.default_rng(len(coord) + len(vals) + len(extra))
    x = rng.standard_normal((1, 2, 5, 6) if len(vals) == 4 else (5, 6)).astype(np.float32)
    x.reshape(-1)[[3, 17]] = [np.inf, np.nan]
    attrs = dict(mode="cubic", coordinate_transformation_mode=coord, **extra)
    if kind == "s":
        node = make_node("Resize", ["x", "", "s"], ["y"], **attrs)
        inputs = [x, None, np.array(vals, np.float32)]
    else:
        node = make_node("Resize", ["x", "", "", "z"], ["y"], **attrs)
        inputs = [x, None, None, i64(*vals)]
    (got,) = run_native(node, inputs, 19)
    (want,) = run_ort(node, inputs, 19, optimize=False)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32])
def test_resize_integer_input_truncates_as_onnxruntime(dtype):
    """A linearly interpolated integer is truncated toward zero (onnxruntime's static_cast; a
    QOperator model resizes its uint8 / int8 codes), not rounded to nearest: equal to
    onnxruntime's up to one code where the float sums round across an integer (the two sum in
    other orders).  (onnxruntime has no cubic Resize of integers; ours truncates the same way and
    holds the result to the type's range.)"""
    local = np.random.default_rng(17)  # (not the module's generator: later tests keep their inputs)
    x = local.integers(-60 if np.dtype(dtype).kind == "i" else 0, 100, size=(1, 3, 6, 7)).astype(dtype)
    node = make_node("Resize", ["x", "", "s"], ["y"], mode="linear")
    inputs = [x, None, np.array([1, 1, 1.7, 1.3], np.float32)]
    (got,) = run_native(node, inputs, 19)
    (want,) = run_ort(node, inputs, 19, optimize=False)
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
    assert diff.max() <= 1 and np.mean(diff > 0) < 0.02, (diff.max(), np.mean(diff > 0))
    rounded = np.abs(np.rint(run_native(node, [x.astype(np.float64), *inputs[1:]], 19)[0]) - want).max()
    assert rounded >= 1  # (this input tells the rules apart: rounding to nearest is off by a code)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("sizes", [(1, 2, 10, 3), (1, 2, 7, 12)], ids=str)
def test_resize_sizes(mode, sizes):
    x = x_((1, 2, 5, 6))
    check(make_node("Resize", ["x", "", "", "z"], ["y"], mode=mode), [x, None, None, i64(*sizes)], 19, close=True,
          tol=1e-5 if mode == "cubic" else None)


@pytest.mark.parametrize("policy", ["not_larger", "not_smaller"])
def test_resize_axes_and_aspect_policy(policy):
    x = x_((1, 2, 5, 6))
    node = make_node("Resize", ["x", "", "", "z"], ["y"], mode="linear", axes=[2, 3], keep_aspect_ratio_policy=policy)
    check(node, [x, None, None, i64(9, 9)], 19, close=True)


def test_resize_cubic_exclude_outside_and_float16():
    x = x_((1, 1, 5, 6), np.float16)
    node = make_node("Resize", ["x", "", "s"], ["y"], mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5)
    check(node, [x, None, np.array([1, 1, 2, 1.5], np.float32)], 19, close=True)


def test_resize_opset11_roi_input_and_integer_nearest():
    x = x_((1, 1, 3, 4), np.uint8)
    node = make_node("Resize", ["x", "r", "s"], ["y"], mode="nearest")
    check(node, [x, np.zeros(0, np.float32), np.array([1, 1, 2, 3], np.float32)], 11)


@pytest.mark.parametrize(
    "attrs",
    [{"coordinate_transformation_mode": "tf_crop_and_resize"}, {"antialias": 1, "mode": "linear"}, {"mode": "bogus"}],
    ids=["tf_crop", "antialias", "bogus-mode"],
)
def test_resize_unsupported_raises_not_implemented(attrs):
    node = make_node("Resize", ["x", "r", "s"], ["y"], **attrs)
    with pytest.raises(NotImplementedError):
        tensor.Resize(node, KernelContext(19, {"": 19}))


def test_resize10_and_upsample_take_the_legacy_kernel():
    assert lookup("", "Resize", 10) is tensor.Resize10
    assert lookup("", "Resize", 11) is tensor.Resize
    assert lookup("", "Upsample", 8) is tensor.Upsample7
    assert lookup("", "Upsample", 9) is tensor.Upsample9


@pytest.mark.parametrize(
    "op,opset,cls",
    [("Reshape", 4, tensor.Reshape1), ("Reshape", 14, tensor.Reshape5), ("Split", 11, tensor.Split1),
     ("Split", 18, tensor.Split13), ("Slice", 9, tensor.Slice1), ("Slice", 13, tensor.Slice10),
     ("Squeeze", 12, tensor.Squeeze1), ("Squeeze", 21, tensor.Squeeze13), ("Unsqueeze", 13, tensor.Unsqueeze13),
     ("Pad", 10, tensor.Pad2), ("Pad", 18, tensor.Pad11), ("TopK", 9, tensor.TopK1), ("TopK", 11, tensor.TopK10)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_registry_picks_version(op, opset, cls):
    assert lookup("", op, opset) is cls


# -- GridSample (native: onnx.reference's took 39 s for one 8 x 64 x 64 sample) --------------------
# Against onnxruntime (graph optimizations off), rtol 1e-5 / atol 1e-6: the interpolation weights
# are summed in another order.  For cubic sampling with border padding onnxruntime clamps each
# tap's index and not the coordinate (as PyTorch does); onnx.reference clamps the coordinate too,
# up to ~0.3 apart; this kernel follows onnxruntime.
GRID_CASES = [(m, p, a) for m in ("linear", "nearest", "cubic") for p in ("zeros", "border", "reflection") for a in (0, 1)]


@pytest.mark.parametrize("mode,padding,align", GRID_CASES, ids=[f"{m}-{p}-ac{a}" for m, p, a in GRID_CASES])
def test_grid_sample_matches_onnxruntime(mode, padding, align):
    from contrib_util import check_all_paths

    rng = np.random.default_rng(len(mode) * 7 + len(padding) + align)
    x = rng.standard_normal((2, 3, 7, 9)).astype(np.float32)
    grid = rng.uniform(-1.3, 1.3, (2, 5, 6, 2)).astype(np.float32)
    node = helper.make_node("GridSample", ["x", "g"], ["y"], mode=mode, padding_mode=padding, align_corners=align)
    check_all_paths(node, {"x": x, "g": grid}, {}, dict(rtol=1e-5, atol=1e-6), opset=20)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("domain", ["", "com.microsoft"], ids=["onnx-16", "ms"])
def test_grid_sample_16_and_contrib_names(mode, domain):
    from contrib_util import check_all_paths

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 6, 5)).astype(np.float32)
    grid = rng.uniform(-1.2, 1.2, (1, 4, 4, 2)).astype(np.float32)
    node = helper.make_node("GridSample", ["x", "g"], ["y"], domain=domain, mode=mode, padding_mode="border",
                            align_corners=1)
    check_all_paths(node, {"x": x, "g": grid}, {}, dict(rtol=1e-5, atol=1e-6), opset=16)


@pytest.mark.parametrize("mode,padding", [("linear", "zeros"), ("nearest", "reflection"), ("linear", "border")])
def test_grid_sample_volumes_match_onnxruntime(mode, padding):
    from contrib_util import check_all_paths

    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 4, 5, 6)).astype(np.float32)
    grid = rng.uniform(-1.3, 1.3, (1, 3, 3, 3, 3)).astype(np.float32)
    node = helper.make_node("GridSample", ["x", "g"], ["y"], mode=mode, padding_mode=padding, align_corners=1)
    check_all_paths(node, {"x": x, "g": grid}, {}, dict(rtol=1e-5, atol=1e-6), opset=20)


def test_grid_sample_rejects_mismatched_grid():
    from onnxpack.errors import InvalidArgument

    node = helper.make_node("GridSample", ["x", "g"], ["y"])
    with pytest.raises(InvalidArgument, match="do not fit"):
        run_native(node, [np.zeros((1, 2, 4, 4), np.float32), np.zeros((1, 3, 3, 3), np.float32)], 20)


# -- Upsample (7-9) and Resize-10 (onnx.reference cannot run Upsample-7's attribute scales) ----------
LEGACY_SCALES = [[1.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.7, 2.4], [1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.3, 1.0]]


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("op,opset", [("Upsample", 7), ("Upsample", 9), ("Resize", 10)])
@pytest.mark.parametrize("scales", LEGACY_SCALES, ids=["x2x3", "x1.7x2.4", "x2", "x1.3"])
def test_upsample_and_resize_10_match_onnxruntime(op, opset, mode, scales):
    from contrib_util import check_all_paths

    x = np.random.default_rng(5).standard_normal((1, 2, 5, 7)).astype(np.float32)
    if opset < 9:
        node = helper.make_node(op, ["x"], ["y"], mode=mode, scales=scales)
        consts = {}
    else:
        node = helper.make_node(op, ["x", "s"], ["y"], mode=mode)
        consts = {"s": np.array(scales, np.float32)}
    check_all_paths(node, {"x": x}, consts, dict(rtol=1e-5, atol=1e-6), opset=opset)


def test_resize_10_shrinks_with_the_ceiling_as_onnxruntime():
    from contrib_util import check_all_paths

    x = np.random.default_rng(6).standard_normal((1, 2, 9, 8)).astype(np.float32)
    node = helper.make_node("Resize", ["x", "s"], ["y"], mode="nearest")
    check_all_paths(node, {"x": x}, {"s": np.array([1, 1, 0.6, 0.5], np.float32)}, None, opset=10)


RESIZE_ORT_CASES = [  # scales where float64 coordinates move a nearest pixel off onnxruntime's
    ("asymmetric-floor-2.4", (1, 1, 3, 7), [1.0, 1.0, 1.0, 2.4], "nearest", "asymmetric", "floor"),
    ("asymmetric-floor-1.7", (1, 1, 11, 2), [1.0, 1.0, 1.7, 1.0], "nearest", "asymmetric", "floor"),
    ("half-pixel-linear", (1, 2, 6, 5), [1.0, 1.0, 1.7, 2.4], "linear", "half_pixel", "round_prefer_floor"),
    ("output-10x1.8", (1, 1, 10, 3), [1.0, 1.0, 1.8, 1.0], "nearest", "half_pixel", "round_prefer_floor"),
    ("pytorch-length-1", (1, 1, 2, 4), [1.0, 1.0, 0.6, 1.5], "cubic", "pytorch_half_pixel", "round_prefer_floor"),
    ("same-shape-copy", (1, 1, 2, 6), [1.0, 1.0, 1.2, 1.09], "linear", "pytorch_half_pixel", "round_prefer_floor"),
]


@pytest.mark.parametrize("case", RESIZE_ORT_CASES, ids=[c[0] for c in RESIZE_ORT_CASES])
def test_resize_coordinates_in_float32_as_onnxruntime(case):
    from contrib_util import check_all_paths

    _, shape, scales, mode, coord, nearest = case
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    node = helper.make_node("Resize", ["x", "", "s"], ["y"], mode=mode, coordinate_transformation_mode=coord,
                            nearest_mode=nearest)
    check_all_paths(node, {"x": x}, {"s": np.array(scales, np.float32)}, dict(rtol=1e-5, atol=1e-6), opset=13)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("coord,nearest,scales", [
    ("half_pixel", "round_prefer_floor", (1, 1, 2, 2)),
    ("asymmetric", "floor", (1, 2, 3, 1)),
    ("half_pixel", "round_prefer_ceil", (2, 1, 2, 4)),
    ("half_pixel", "round_prefer_floor", (1, 1, 0.5, 2)),  # one axis shrinks: the take per axis
    ("asymmetric", "floor", (1, 1, 1.5, 2)),  # one axis a repeat, the other not
], ids=["hp-2x2", "asym-2x3", "hp-ceil-mixed", "hp-shrink", "asym-1.5x2"])
def test_resize_nearest_integer_upsampling_equals_onnxruntime(coord, nearest, scales, dtype, monkeypatch):
    """Nearest resizes that repeat every element k times along each resampled axis run as one
    broadcast copy (no np.take); the rest gather per axis.  Both give onnxruntime's output bit for
    bit, for two input shapes on one kernel (its index plans are kept per length)."""
    import onnxruntime as ort

    import onnxpack

    T = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("Resize", ["x", "", "s"], ["y"], mode="nearest", coordinate_transformation_mode=coord,
                            nearest_mode=nearest)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", T, None)],
                              [helper.make_tensor_value_info("y", T, None)],
                              initializer=[helper.make_tensor("s", TensorProto.FLOAT, [4], list(scales))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9).SerializeToString()
    want_fast = all(float(s).is_integer() for s in scales)
    takes = []
    real_take = np.take
    monkeypatch.setattr(tensor.np, "take", lambda *a, **k: takes.append(1) or real_take(*a, **k))
    rng = np.random.default_rng(7)
    sess = onnxpack.InferenceSession(model)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for shape in [(2, 3, 5, 4), (1, 3, 7, 6)]:
        x = (rng.standard_normal(shape) * 50).astype(dtype)
        takes.clear()
        got = sess.run(None, {"x": x})[0]
        assert bool(takes) != want_fast
        want = ref.run(None, {"x": x})[0]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def _bad_cases():
    rng = np.random.default_rng(9)
    x4 = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    yield "argmax-axis", make_node("ArgMax", ["x"], ["y"], axis=-5), [x4], 13
    yield "argmin-axis", make_node("ArgMin", ["x"], ["y"], axis=4), [x4], 13
    yield "gatherelements-axis", make_node("GatherElements", ["d", "i"], ["y"], axis=3), [
        rng.standard_normal((4, 5, 6)).astype(np.float32), rng.integers(0, 4, (4, 5, 2)).astype(np.int64)], 13
    yield "topk-negative-k", make_node("TopK", ["x", "k"], ["v", "i"], axis=0), [x4, np.array([-1], np.int64)], 11
    yield "topk-k-past-axis", make_node("TopK", ["x", "k"], ["v", "i"], axis=1), [x4, np.array([4], np.int64)], 11
    yield "gemm-3d-c", make_node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1), [
        rng.standard_normal((1, 8)).astype(np.float32), rng.standard_normal((64, 1)).astype(np.float32),
        rng.standard_normal((2, 8, 64)).astype(np.float32)], 13
    yield "batchnorm-empty-var", make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"]), [
        rng.standard_normal((2, 1, 1, 1)).astype(np.float32), np.ones(1, np.float32), np.zeros(1, np.float32),
        np.zeros(1, np.float32), np.zeros(0, np.float32)], 15


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_inputs_onnxruntime_refuses_are_refused(case):
    """Axes out of range, a negative or too large TopK k, a Gemm C that does not broadcast to
    (M, N), BatchNormalization statistics of the wrong length: onnxruntime refuses them, and
    numpy wrapped or broadcast them into a result (a helper's attacks)."""
    _, node, ins, opset = case
    with pytest.raises(InvalidArgument):
        run_native(node, ins, opset)
    with pytest.raises(Exception):
        run_ort(node, ins, opset, optimize=False)
