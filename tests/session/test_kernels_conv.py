"""Conv, ConvTranspose and pools: native vs onnx.reference (or onnxruntime), packed vs unpacked.

Tolerances: float32 rtol 1e-4 / atol 1e-5 (inputs are scaled so outputs are O(1); BLAS sums in
a different order than onnx.reference); float16 rtol 1e-2 / atol 1e-2 (we accumulate in float32
and round once, onnx.reference accumulates in float16).  Packed vs unpacked: the same float32
arithmetic on the same matrix, so rtol 1e-6 / atol 1e-6.

onnxruntime is the oracle where onnx.reference 1.23 is wrong: MaxPool's Indices output (it
returns the row-major index for storage_order=1 and wrong indices when unpadded) and
``ceil_mode`` (it pads the overhang on both sides), asymmetric pool pads and padded 3-D pools.  ConvTranspose with group > 1 slices the
weight by output channels; we compare grouped ConvTranspose with onnxruntime as well.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kernel_util import assert_close, make_node, run_ort, run_native, run_reference

OPSET = 17
PACK_TOL = dict(rtol=1e-6, atol=1e-6)


def conv_inputs(rng, x_shape, w_shape, dtype, bias=True):
    fan_in = int(np.prod(w_shape[1:]))
    x = rng.standard_normal(x_shape).astype(dtype)
    w = (rng.standard_normal(w_shape) / np.sqrt(fan_in)).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype) if bias else None
    return x, w, b


CONV_CASES = [
    # id, x shape, w shape, attrs
    ("3x3", (2, 4, 9, 10), (6, 4, 3, 3), {}),
    ("3x3-pad1", (1, 4, 9, 10), (6, 4, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("3x3-s2-asympad", (2, 4, 9, 10), (6, 4, 3, 3), dict(strides=[2, 2], pads=[1, 0, 2, 1])),
    ("dilation", (1, 4, 9, 10), (6, 4, 3, 3), dict(dilations=[2, 1])),
    ("same-upper-s2", (1, 4, 9, 10), (6, 4, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ("same-lower", (1, 4, 9, 10), (6, 4, 2, 2), dict(auto_pad="SAME_LOWER")),
    ("valid", (1, 4, 9, 10), (6, 4, 3, 3), dict(auto_pad="VALID")),
    ("group2", (2, 4, 9, 10), (6, 2, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    ("depthwise", (2, 4, 9, 10), (4, 1, 3, 3), dict(group=4, pads=[1, 1, 1, 1])),
    ("depthwise-s2", (1, 8, 9, 10), (8, 1, 3, 3), dict(group=8, strides=[2, 2], pads=[0, 0, 1, 1])),
    ("depthwise-mult2", (1, 4, 9, 10), (8, 1, 3, 3), dict(group=4)),
    ("depthwise-dil2", (1, 4, 9, 10), (4, 1, 3, 3), dict(group=4, dilations=[2, 2], pads=[2, 1, 2, 1])),
    ("depthwise-1d", (2, 3, 11), (3, 1, 5), dict(group=3, pads=[2, 2])),
    ("depthwise-3d", (1, 2, 5, 6, 7), (2, 1, 3, 3, 3), dict(group=2, pads=[1, 1, 1, 1, 1, 1])),
    ("1x1", (2, 8, 7, 6), (5, 8, 1, 1), {}),
    ("1x1-s2", (1, 8, 7, 6), (5, 8, 1, 1), dict(strides=[2, 2])),
    ("1x1-group2", (1, 8, 7, 6), (6, 4, 1, 1), dict(group=2)),
    ("7x7-s2-pad3", (1, 3, 20, 20), (8, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3], kernel_shape=[7, 7])),
    ("1d", (2, 3, 11), (5, 3, 4), dict(pads=[1, 2])),
    ("1d-s3-dil2", (2, 3, 17), (5, 3, 3), dict(strides=[3], dilations=[2])),
    ("3d", (1, 3, 5, 6, 7), (4, 3, 3, 2, 3), dict(pads=[1, 1, 1, 1, 0, 1])),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_matches_reference_and_packed(case, dtype):
    _, xs, ws, attrs = case
    rng = np.random.default_rng(0)
    x, w, b = conv_inputs(rng, xs, ws, dtype)
    node = make_node("Conv", ["x", "w", "b"], ["y"], **attrs)
    got = run_native(node, [x, w, b], OPSET)
    assert_close(got, run_reference(node, [x, w, b], OPSET), dtype)
    packed = run_native(node, [x, w, b], OPSET, pack=[1])
    np.testing.assert_allclose(packed[0].astype(np.float64), got[0].astype(np.float64), **PACK_TOL)


def test_conv_without_bias_and_kernel_shape_packed():
    rng = np.random.default_rng(1)
    x, w, _ = conv_inputs(rng, (1, 4, 6, 6), (3, 4, 3, 3), np.float32, bias=False)
    node = make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    want = run_reference(node, [x, w], OPSET)
    assert_close(run_native(node, [x, w], OPSET, pack=[1]), want, np.float32)


def test_conv_packed_buffer_is_the_group_gemm_matrix():
    """The packed weight is (g, M/g, C/g, *kernel) float32, C-contiguous, the widened fp16 weight."""
    from onnxpack.session.kernels import KernelContext, TensorInfo, lookup

    w = np.random.default_rng(2).standard_normal((6, 2, 3, 3)).astype(np.float16)
    node = make_node("Conv", ["x", "w"], ["y"], group=2)
    k = lookup("", "Conv", OPSET)(node, KernelContext(OPSET, {"": OPSET}))
    info = TensorInfo("w", w.dtype, w.shape, onnx.TensorProto.FLOAT16)
    (buf,) = k.prepack(1, w)
    assert buf.dtype == np.float32 and buf.flags.c_contiguous and buf.shape == (2, 3, 2, 3, 3)
    assert k.expected_packed(1, info) == [(np.dtype(np.float32), (2, 3, 2, 3, 3))]
    np.testing.assert_array_equal(buf.reshape(6, 2, 3, 3), w.astype(np.float32))
    assert k.check_packed(1, info, (buf[:1],)) is not None


CONVT_CASES = [
    ("basic", (2, 4, 5, 6), (4, 3, 3, 3), {}),
    ("s2", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2])),
    ("s2-pads-outpad", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], pads=[1, 1, 0, 0], output_padding=[1, 1])),
    ("output-shape", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 3], output_shape=[12, 18])),
    ("same-upper", (1, 4, 5, 6), (4, 3, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ("dilation", (1, 4, 5, 6), (4, 3, 3, 3), dict(dilations=[2, 2])),
    ("k4-s2-p1", (1, 4, 5, 6), (4, 2, 4, 4), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    ("1d", (2, 3, 7), (3, 2, 3), dict(strides=[2])),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CONVT_CASES, ids=[c[0] for c in CONVT_CASES])
def test_conv_transpose_matches_reference_and_packed(case, dtype):
    _, xs, ws, attrs = case
    rng = np.random.default_rng(3)
    x = rng.standard_normal(xs).astype(dtype)
    w = (rng.standard_normal(ws) / np.sqrt(ws[0])).astype(dtype)
    b = rng.standard_normal(ws[1]).astype(dtype)
    node = make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    got = run_native(node, [x, w, b], OPSET)
    assert_close(got, run_reference(node, [x, w, b], OPSET), dtype)
    packed = run_native(node, [x, w, b], OPSET, pack=[1])
    np.testing.assert_allclose(packed[0].astype(np.float64), got[0].astype(np.float64), **PACK_TOL)


@pytest.mark.parametrize("attrs", [dict(group=2), dict(group=2, strides=[2, 2], pads=[1, 0, 1, 0])], ids=["g2", "g2-s2"])
def test_conv_transpose_groups_match_onnxruntime(attrs):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 4, 5, 6)).astype(np.float32)
    w = (rng.standard_normal((4, 3, 3, 3)) / 2).astype(np.float32)  # M = 3 * 2 = 6 != C
    b = rng.standard_normal(6).astype(np.float32)
    node = make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    want = run_ort(node, [x, w, b], OPSET, optimize=False)
    assert_close(run_native(node, [x, w, b], OPSET), want, np.float32)
    assert_close(run_native(node, [x, w, b], OPSET, pack=[1]), want, np.float32)


@pytest.mark.parametrize("extra", [0, 1, 2], ids=["natural", "natural+1", "natural+2"])
def test_conv_transpose_output_shape_larger_than_natural_keeps_the_result_at_the_start(extra):
    """An explicit ``output_shape`` up to ``stride - 1`` past the natural size puts the extra
    positions (the bias alone) at the end, as onnxruntime and onnx.reference do (splitting the
    negative total padding between both ends shifted the result); ``stride`` or more past it is
    refused, as onnxruntime refuses it."""
    from onnxpack.errors import InvalidArgument

    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 4, 3)).astype(np.float32)
    w = rng.standard_normal((2, 3, 2, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    natural = (3 * 3 + 2, 2 * 3 + 3)  # stride 3: (in - 1) * 3 + k
    node = make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[3, 3],
                     output_shape=[natural[0] + extra, natural[1] + (2 - extra)])
    want = run_ort(node, [x, w, b], OPSET, optimize=False)
    assert_close(run_native(node, [x, w, b], OPSET), want, np.float32)
    assert_close(run_native(node, [x, w, b], OPSET, pack=[1]), want, np.float32)
    assert_close(run_native(node, [x, w, b], OPSET), run_reference(node, [x, w, b], OPSET), np.float32)
    too_far = make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[3, 3], output_shape=[natural[0] + 3, natural[1]])
    with pytest.raises(InvalidArgument, match="inconsistent"):
        run_native(too_far, [x, w, b], OPSET)


POOL_CASES = [
    ("k3", dict(kernel_shape=[3, 3])),
    ("k3-s2-pad1", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("k2-s2", dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("same-upper-s2", dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])),
    ("same-lower", dict(kernel_shape=[2, 2], auto_pad="SAME_LOWER")),
    # One tap along an axis: the rows are kept as they are (skipped, not copied), or subsampled.
    ("k12-s12", dict(kernel_shape=[1, 2], strides=[1, 2])),
    ("k21-s21", dict(kernel_shape=[2, 1], strides=[2, 1])),
    ("k12-s22", dict(kernel_shape=[1, 2], strides=[2, 2])),
    ("k11", dict(kernel_shape=[1, 1])),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_pools_match_reference(case, op, dtype):
    x = np.random.default_rng(5).standard_normal((2, 3, 9, 10)).astype(dtype)
    for extra in ({}, {"count_include_pad": 1}) if op == "AveragePool" else ({},):
        node = make_node(op, ["x"], ["y"], **case[1], **extra)
        assert_close(run_native(node, [x], OPSET), run_reference(node, [x], OPSET), dtype)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize(
    "attrs",
    [
        dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
        dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=1),
        dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1),
        dict(kernel_shape=[3, 3], dilations=[2, 2]),
        dict(kernel_shape=[2, 3], strides=[3, 2], dilations=[2, 1], pads=[1, 1, 0, 1], ceil_mode=1),
        dict(kernel_shape=[3, 2], pads=[1, 1, 0, 1]),
        dict(kernel_shape=[3, 2], pads=[1, 1, 0, 1], count_include_pad=1),
        # one tap along H over padded rows (onnx.reference's MaxPool fails on these pads)
        dict(kernel_shape=[1, 3], pads=[0, 1, 0, 1]),
        dict(kernel_shape=[1, 3], strides=[2, 1], pads=[0, 1, 0, 1], count_include_pad=1),
    ],
    ids=["ceil", "ceil-pad", "ceil-incl", "ceil-pad-incl", "dilated", "dilated-ceil", "asym-pads", "asym-pads-incl",
         "k13-pad", "k13-s21-incl"],
)
def test_pools_ceil_mode_match_onnxruntime(attrs, op):
    if op == "MaxPool":
        attrs = {k: v for k, v in attrs.items() if k != "count_include_pad"}
    x = np.random.default_rng(6).standard_normal((1, 2, 10, 11)).astype(np.float32)
    node = make_node(op, ["x"], ["y"], **attrs)
    assert_close(run_native(node, [x], 19), run_ort(node, [x], 19, optimize=False), np.float32)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("op, extra", [("AveragePool", {}), ("AveragePool", dict(count_include_pad=1)),
                                       ("LpPool", {}), ("AveragePool", dict(ceil_mode=1))],
                         ids=["avg", "avg-incl", "lp", "avg-ceil"])
def test_same_pools_with_strides_wider_than_the_kernel_match_onnxruntime(op, extra, auto_pad):
    """The SAME padding ``(out - 1) * stride + kernel - in`` is negative when the strides skip
    more than the kernel: onnxruntime's pools keep it (C's ``/ 2`` split), so windows start
    inside the input (6 rows, kernel 1, stride 3, SAME_UPPER: rows 1 and 4)."""
    rng = np.random.default_rng(9)
    for h in (5, 6, 7, 9, 10):
        for kh, sh in ((1, 3), (1, 4), (2, 4), (2, 5), (3, 6), (1, 6)):
            x = rng.standard_normal((1, 2, h, 7)).astype(np.float32)
            node = make_node(op, ["x"], ["y"], kernel_shape=[kh, 2], strides=[sh, 3], auto_pad=auto_pad, **extra)
            assert_close(run_native(node, [x], 19), run_ort(node, [x], 19, optimize=False), np.float32)


@pytest.mark.parametrize("storage_order", [0, 1], ids=["row", "col"])
@pytest.mark.parametrize(
    "attrs",
    [dict(kernel_shape=[3, 3]), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), dict(kernel_shape=[2, 2], strides=[2, 2])],
    ids=["k3", "k3-s2-pad1", "k2-s2"],
)
def test_maxpool_indices_match_onnxruntime(attrs, storage_order):
    x = np.random.default_rng(7).standard_normal((2, 3, 7, 8)).astype(np.float32)
    node = make_node("MaxPool", ["x"], ["y", "i"], storage_order=storage_order, **attrs)
    got = run_native(node, [x], 12)
    want = run_ort(node, [x], 12, optimize=False)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[1].dtype == np.int64


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_1d_and_3d_match_onnxruntime(op):
    """onnx.reference 1.23 indexes out of bounds on padded 3-D pools, so onnxruntime is the oracle."""
    rng = np.random.default_rng(8)
    for shape, ks in (((2, 3, 12), [3]), ((1, 2, 5, 6, 7), [2, 2, 3])):
        x = rng.standard_normal(shape).astype(np.float32)
        node = make_node(op, ["x"], ["y"], kernel_shape=ks, pads=[1] * (2 * len(ks)))
        assert_close(run_native(node, [x], OPSET), run_ort(node, [x], OPSET, optimize=False), np.float32)


@pytest.mark.parametrize("shape,attrs", [
    ((1, 64, 7, 7), dict(kernel_shape=[7, 7])),  # resnet's last pool
    ((2, 3, 4, 5), dict(kernel_shape=[4, 5], strides=[2, 2], count_include_pad=1)),
    ((2, 3, 6), dict(kernel_shape=[6])),
    ((1, 2, 3, 4, 5), dict(kernel_shape=[3, 4, 5])),
    ((1, 2, 5, 5), dict(kernel_shape=[5, 5], pads=[1, 1, 1, 1])),  # padded: the general path
    ((1, 2, 5, 5), dict(kernel_shape=[5, 5], ceil_mode=1, strides=[2, 2])),
], ids=["7x7", "strided-incl", "1d", "3d", "padded", "ceil"])
def test_average_pool_over_whole_planes_matches_onnxruntime(shape, attrs):
    """An AveragePool whose one window is each whole plane (a global average written as a pool)
    takes the row-sum GEMV: onnxruntime's values, NaN and inf where a plane holds them."""
    x = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[[3, 40 % x.size]] = np.nan, np.inf
    node = make_node("AveragePool", ["x"], ["y"], **attrs)
    got, want = run_native(node, [x], 19), run_ort(node, [x], 19, optimize=False)
    assert got[0].shape == want[0].shape
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 6), (1, 4, 7), (1, 2, 3, 4, 5)], ids=["2d", "1d", "3d"])
def test_global_pools(shape, op, dtype):
    """numpy is the oracle: onnx.reference's GlobalMaxPool mis-shapes non-2-D inputs."""
    x = np.random.default_rng(9).standard_normal(shape).astype(dtype)
    node = make_node(op, ["x"], ["y"])
    axes = tuple(range(2, x.ndim))
    if op == "GlobalMaxPool":
        want = x.max(axis=axes, keepdims=True)
    else:
        want = x.astype(np.float64).mean(axis=axes, keepdims=True).astype(dtype)
    assert_close(run_native(node, [x], OPSET), [want], dtype)


def test_global_average_pool_repeated_calls_reuse_nothing_but_the_ones_vector():
    """One kernel called again and again (as in a model's runs): the repeat path (float32 NCHW,
    contiguous, a spatial size seen before) gives numpy's mean within float32 rounding, for a new
    spatial size, a non-contiguous input, NaN and inf, as the first call does."""
    from onnxpack.session.kernels import KernelContext
    from onnxpack.session.kernels.conv import GlobalAveragePool

    kernel = GlobalAveragePool(make_node("GlobalAveragePool", ["x"], ["y"]), KernelContext(opset=OPSET, opsets={"": OPSET}))
    rng = np.random.default_rng(10)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in ((1, 8, 7, 7), (1, 8, 7, 7), (2, 3, 4, 5), (1, 8, 7, 7))]
    inputs.append(rng.standard_normal((1, 7, 7, 8)).astype(np.float32).transpose(0, 3, 1, 2))  # not contiguous
    special = rng.standard_normal((1, 3, 7, 7)).astype(np.float32)
    special[0, 1, 2, 3], special[0, 2, 0, 0] = np.nan, np.inf
    inputs += [special, special]
    for x in inputs:
        (y,) = kernel.run(x)
        want = x.astype(np.float64).mean(axis=(2, 3), keepdims=True)
        assert y.shape == want.shape and y.dtype == np.float32
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape,ks,strides,dils,pads",
    [((3, 9), (3,), (1,), (1,), (1, 1)),  # Silero VAD's encoder convs
     ((1, 576), (256,), (128,), (1,), (0, 0)),  # its STFT
     ((4, 5, 7), (3, 2), (2, 1), (1, 2), (1, 0, 2, 1)),
     ((2, 4, 4, 5), (2, 3, 2), (1, 2, 1), (1, 1, 2), (0, 1, 1, 1, 0, 2))],
    ids=["1d-3tap", "stft", "2d-asym", "3d"])
def test_gather_index_is_im2col_of_the_padded_input(shape, ks, strides, dils, pads):
    """Small convs build their column matrix by one gather (conv._gather_index): the same matrix
    as im2col over the padded copy, padding read from one appended zero."""
    import math

    from onnxpack.session.kernels import conv as C

    x = np.random.default_rng(0).standard_normal((2,) + shape).astype(np.float32)
    begin, _, out = C.conv_geometry(shape[1:], ks, strides, dils, pads, "NOTSET")
    xp = C._pad(x, begin, C._padded_extent(shape[1:], begin, out, ks, strides, dils), 0)
    want = C.im2col(xp, ks, out, strides, dils).reshape(2, shape[0] * math.prod(ks), -1)
    idx = C._gather_index(shape, ks, out, strides, dils, begin)
    size = math.prod(shape)
    xz = np.concatenate([x.reshape(2, size), np.zeros((2, 1), np.float32)], 1)
    assert np.array_equal(xz[:, idx], want)


# -- LpPool / GlobalLpPool (native; onnx.reference's LpPool took ~0.8 s for 16 x 32 x 32, and it has
# no GlobalLpPool) ------------------------------------------------------------------------------------
LP_CASES = [
    ("LpPool", dict(kernel_shape=[3, 3], p=2), 11, (1, 4, 12, 11)),
    ("LpPool", dict(kernel_shape=[3, 3], p=3, pads=[1, 1, 1, 1], strides=[2, 2]), 11, (1, 4, 12, 11)),
    ("LpPool", dict(kernel_shape=[2, 2], p=1, dilations=[2, 2], ceil_mode=1, strides=[2, 2]), 18, (1, 4, 12, 11)),
    ("LpPool", dict(kernel_shape=[3], p=2, strides=[2]), 11, (2, 3, 10)),
    ("GlobalLpPool", dict(p=2), 11, (2, 4, 6, 7)),
    ("GlobalLpPool", dict(p=3), 11, (2, 4, 6, 7)),
]


@pytest.mark.parametrize("op,attrs,opset,shape", LP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(LP_CASES)])
def test_lp_pools_match_onnxruntime(op, attrs, opset, shape):
    from contrib_util import check_all_paths
    from onnx import helper as _h

    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    check_all_paths(_h.make_node(op, ["x"], ["y"], **attrs), {"x": x}, {}, dict(rtol=1e-5, atol=1e-5), opset=opset)


# -- DeformConv (native; onnx.reference's loop took 520 s for an 8 x 16 x 3 x 3 conv of 32 x 32) -----
DEFORM_CASES = [
    ("plain", (1, 4, 8, 9), (6, 4, 3, 3), {}, True, False, 2.0),
    ("groups-pads-mask", (2, 4, 8, 9), (6, 2, 3, 3), dict(group=2, pads=[1, 1, 1, 1]), True, True, 2.0),
    ("offset-groups-strides-dilations", (1, 8, 10, 10), (4, 8, 3, 3),
     dict(offset_group=2, strides=[2, 2], dilations=[2, 1], pads=[2, 1, 0, 1]), False, True, 2.0),
    ("far-offsets-2x3", (1, 4, 7, 7), (4, 4, 2, 3), dict(pads=[0, 1, 1, 0]), True, False, 6.0),
]


@pytest.mark.parametrize("case", DEFORM_CASES, ids=[c[0] for c in DEFORM_CASES])
def test_deform_conv_matches_onnxruntime(case):
    from contrib_util import check_all_paths
    from onnx import helper as _h

    _, shape, wshape, attrs, with_b, with_mask, spread = case
    rng = np.random.default_rng(len(case[0]))
    n, (kh, kw) = shape[0], wshape[2:]
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    p = attrs.get("pads", [0, 0, 0, 0])
    oh = (shape[2] + p[0] + p[2] - (dh * (kh - 1) + 1)) // sh + 1
    ow = (shape[3] + p[1] + p[3] - (dw * (kw - 1) + 1)) // sw + 1
    og = attrs.get("offset_group", 1)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "o": (rng.standard_normal((n, og * 2 * kh * kw, oh, ow)) * spread).astype(np.float32)}
    consts = {"w": rng.standard_normal(wshape).astype(np.float32)}
    ins = ["x", "w", "o", "", ""]
    if with_b:
        consts["b"] = rng.standard_normal(wshape[0]).astype(np.float32)
        ins[3] = "b"
    if with_mask:
        feeds["m"] = rng.random((n, og * kh * kw, oh, ow)).astype(np.float32)
        ins[4] = "m"
    while ins[-1] == "":
        ins.pop()
    node = _h.make_node("DeformConv", ins, ["y"], kernel_shape=[kh, kw], **attrs)
    check_all_paths(node, feeds, consts, dict(rtol=1e-4, atol=1e-4), opset=19)


COL2IM_CASES = [
    ([12, 11], [3, 3], {}, 4),
    ([8, 9], [2, 3], dict(strides=[2, 1], pads=[1, 0, 1, 2], dilations=[1, 2]), 3),
    ([10], [3], dict(strides=[2]), 2),
    ([4, 5, 6], [2, 2, 2], {}, 2),
]


@pytest.mark.parametrize("image,block,attrs,channels", COL2IM_CASES, ids=["2d", "2d-strided-padded", "1d", "3d"])
def test_col2im_matches_onnxruntime(image, block, attrs, channels):
    from contrib_util import check_all_paths
    from onnx import helper as _h

    nd = len(image)
    pads = attrs.get("pads", [0] * 2 * nd)
    counts = [(image[d] + pads[d] + pads[d + nd] - attrs.get("dilations", [1] * nd)[d] * (block[d] - 1) - 1)
              // attrs.get("strides", [1] * nd)[d] + 1 for d in range(nd)]
    x = np.random.default_rng(nd).standard_normal((2, channels * int(np.prod(block)), int(np.prod(counts))))
    consts = {"i": np.array(image, np.int64), "b": np.array(block, np.int64)}
    check_all_paths(_h.make_node("Col2Im", ["x", "i", "b"], ["y"], **attrs), {"x": x.astype(np.float32)}, consts,
                    dict(rtol=1e-5, atol=1e-5), opset=18)


@pytest.mark.parametrize("block", [8, 16])
def test_nchwc_filters_unblock_to_plain_order(block):
    """The two saved NCHWc filter layouts (checked against onnxruntime's saved models, block 8,
    by test_deployed_models::test_float_model_saved_at_level_all), built here from a plain filter
    element by element and read back, for both block sizes."""
    from onnxpack.session.kernels.nchwc import unblock_filter

    rng = np.random.default_rng(block)
    o, i, kh, kw = 2 * block, 2 * block, 3, 2
    plain = rng.standard_normal((o, i, kh, kw)).astype(np.float32)
    bibo = np.empty(o * i * kh * kw, np.float32)  # (O/B, I/B, kh, kw, Bi, Bo)
    for oo, ii, y, x in np.ndindex(o, i, kh, kw):
        at = ((((oo // block) * (i // block) + ii // block) * kh + y) * kw + x) * block * block + (ii % block) * block + oo % block
        bibo[at] = plain[oo, ii, y, x]
    np.testing.assert_array_equal(unblock_filter(bibo.reshape(plain.shape), 1, block), plain)
    first = plain[:, :3]  # a 3-channel input: (O/B, I, kh, kw, Bo)
    bo = np.empty(first.size, np.float32)
    for oo, ii, y, x in np.ndindex(*first.shape):
        bo[((((oo // block) * 3 + ii) * kh + y) * kw + x) * block + oo % block] = first[oo, ii, y, x]
    np.testing.assert_array_equal(unblock_filter(bo.reshape(first.shape), 1, block), first)
    depthwise = plain[:, :1]
    dw = np.empty(depthwise.size, np.float32)
    for oo, _, y, x in np.ndindex(*depthwise.shape):
        dw[(((oo // block) * kh + y) * kw + x) * block + oo % block] = depthwise[oo, 0, y, x]
    np.testing.assert_array_equal(unblock_filter(dw.reshape(depthwise.shape), o, block), depthwise)


@pytest.mark.parametrize("ceil_mode", [0, 1])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_same_pools_with_dilations_match_onnxruntime(op, ceil_mode):
    """onnxruntime's pools size SAME padding with the undilated kernel, then count outputs with
    the dilated one (and ceil_mode): fewer outputs than ceil(in / stride) (kernel 3, dilation 2
    over 3 columns: 1 output, where the spec's rule gives 3)."""
    rng = np.random.default_rng(10)
    for auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        for (kh, kw), (dh, dw), (sh, sw) in (((1, 3), (2, 2), (1, 1)), ((2, 2), (2, 2), (2, 2)), ((3, 3), (2, 1), (1, 2)),
                                             ((4, 1), (3, 1), (3, 1))):
            for h, w in ((8, 3), (9, 7)):
                x = rng.standard_normal((1, 2, h, w)).astype(np.float32)
                attrs = dict(auto_pad=auto_pad, kernel_shape=[kh, kw], strides=[sh, sw], dilations=[dh, dw])
                if op != "LpPool":
                    attrs["ceil_mode"] = ceil_mode
                node = make_node(op, ["x"], ["y"], **attrs)
                got, want = run_native(node, [x], 19), run_ort(node, [x], 19, optimize=False)
                assert got[0].shape == want[0].shape, (attrs, h, w)
                assert_close(got, want, np.float32)


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"])
@pytest.mark.parametrize("attrs", [dict(strides=[0, 1]), dict(strides=[1, -2**31]), dict(dilations=[1, 0]),
                                   dict(kernel_shape=[-3, 3])], ids=["stride0", "stride-neg", "dil0", "kernel-neg"])
def test_non_positive_strides_dilations_and_kernels_are_refused(op, attrs):
    """As onnxruntime refuses them; a negative one sized the padded input or the output in the
    exabytes (found by a fuzzer: "Unable to allocate 384 GiB")."""
    from onnxpack.errors import InvalidArgument

    attrs = dict(attrs)
    if op.endswith("Pool"):
        attrs.setdefault("kernel_shape", [3, 3])
    x = np.zeros((1, 2, 8, 8), np.float32)
    ins = [x, np.ones((2, 2, 3, 3), np.float32)] if op.startswith("Conv") else [x]
    with pytest.raises(InvalidArgument, match="must be positive"):
        run_native(make_node(op, ["x", "w"][: len(ins)], ["y"], **attrs), ins, 19)


@pytest.mark.parametrize("pads", [[3, 0, 0, 0], [0, -1, 0, 0], [1, 1]], ids=["pad=kernel", "negative", "half"])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_pool_pads_outside_onnxruntimes_rule_are_refused(op, pads):
    from onnxpack.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="pads"):
        run_native(make_node(op, ["x"], ["y"], kernel_shape=[3, 3], pads=pads), [np.zeros((1, 2, 8, 8), np.float32)], 19)


def _causal_conv_case(rng, attrs, k, length, past, bias, dtype=np.float32):
    b, c = 2, 5
    s = (k - 1) * attrs.get("dilation", 1)
    last = attrs.get("channels_last", 0) == 1
    x = rng.standard_normal((b, length, c) if last else (b, c, length)).astype(dtype)
    w = rng.standard_normal((c, 1, k)).astype(dtype)
    state = rng.standard_normal((b, s, c) if last else (b, c, s)).astype(dtype)
    if attrs.get("state_window"):
        state = np.stack([rng.standard_normal(state.shape).astype(dtype) for _ in range(attrs["state_window"])])
    inputs = [x, w, rng.standard_normal(c).astype(dtype) if bias else None, state if past else None]
    names = ["x", "w", "b" if bias else "", "p" if past else ""]
    return make_node("CausalConvWithState", names, ["y", "present"], domain="com.microsoft", ndim=1, **attrs), inputs


CAUSAL_CASES = [
    ({}, 3, 5, True, False),               # LFM2's: kernel 3, a carried state
    ({}, 3, 1, True, True),                # one decoding step
    ({}, 4, 2, False, True),               # no state: zeros; fewer positions than the state holds
    ({"activation": "silu"}, 4, 6, True, True),
    ({"activation": "swish", "dilation": 2}, 3, 7, True, False),
    ({"channels_last": 1}, 3, 5, True, True),
    ({"dilation": 3}, 1, 4, False, True),  # K = 1: an empty state
]
CAUSAL_IDS = ["lfm2", "step", "nostate", "silu", "swish-dil2", "channels-last", "k1"]


@pytest.mark.parametrize("attrs, k, length, past, bias", CAUSAL_CASES, ids=CAUSAL_IDS)
def test_causal_conv_with_state_matches_onnxruntime(attrs, k, length, past, bias):
    node, inputs = _causal_conv_case(np.random.default_rng(11), attrs, k, length, past, bias)
    got = run_native(node, inputs, 1)
    want = run_ort(node, inputs, 1, optimize=False)
    for g, v in zip(got, want):
        assert g.dtype == v.dtype and g.shape == v.shape
        np.testing.assert_allclose(g, v, rtol=1e-6, atol=1e-6)
    # float16 (onnxruntime's CPU kernel has float32 only): the float32 result of the same values, rounded
    half = [None if a is None else a.astype(np.float16) for a in inputs]
    want16 = run_ort(node, [None if a is None else a.astype(np.float32) for a in half], 1, optimize=False)
    for g, v in zip(run_native(node, half, 1), want16):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), v, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("window, k, length", [(3, 3, 5), (4, 2, 2), (2, 4, 1)])
def test_causal_conv_state_window_holds_each_prefix_state(window, k, length):
    """state_window W (onnxruntime runs it on CUDA only): slot j is the state after position
    L - W + j, i.e. the plain op's present_state on that prefix (zeros before the first)."""
    node, inputs = _causal_conv_case(np.random.default_rng(12), {"state_window": window}, k, length, True, True)
    y, present = run_native(node, inputs, 1)
    plain = make_node("CausalConvWithState", list(node.input), ["y", "present"], domain="com.microsoft")
    past = inputs[3][-1]
    want_y, _ = run_ort(plain, [inputs[0], inputs[1], inputs[2], past], 1, optimize=False)
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
    assert present.shape == (window,) + past.shape
    for j in range(window):
        end = length - window + j + 1
        if end <= 0:
            assert not present[j].any()
            continue
        _, want = run_ort(plain, [inputs[0][:, :, :end], inputs[1], inputs[2], past], 1, optimize=False)
        np.testing.assert_array_equal(present[j], want)


def test_causal_conv_with_state_refuses_what_it_does_not_implement():
    from onnxpack.errors import InvalidArgument

    x, w = np.zeros((1, 2, 3), np.float32), np.zeros((2, 1, 3), np.float32)
    with pytest.raises(NotImplementedError, match="ndim"):
        run_native(make_node("CausalConvWithState", ["x", "w"], ["y", "p"], domain="com.microsoft", ndim=2), [x, w], 1)
    with pytest.raises(InvalidArgument, match="past_state"):
        run_native(make_node("CausalConvWithState", ["x", "w", "", "p"], ["y", "p"], domain="com.microsoft"),
                   [x, w, None, np.zeros((1, 2, 5), np.float32)], 1)
