"""The QLinear family vs onnxruntime (graph optimizations off; weights as initializers, so
onnxruntime's pre-packed and symmetric-int8 kernels run too).

Output codes are compared in quantization steps.  Exact (0 steps) where onnxruntime's x86
arithmetic is plain float32 and ours is the same: QLinearConv, QLinearMatMul, QGemm (exact
integer accumulation, float32 requantization), QLinearMul, QLinearAdd (MLAS' fused multiply-adds),
QLinearGlobalAveragePool, QLinearConcat, QLinearWhere, QLinearLeakyRelu, QLinearSoftmax (its table
of exponentials, in-order sums and ``floor(1 / y_scale)``), QLinearAveragePool (dequantized floats
summed in window order, divided by the count).  Within one step where onnxruntime approximates:
QLinearSigmoid (MLAS' logistic approximation); the fraction of codes that differ is bounded too.  QLinearReduceMean has no
onnxruntime CPU kernel: it is compared with onnx.reference's DequantizeLinear -> ReduceMean ->
QuantizeLinear (float64 mean there, float32 here: within one step).

Output scales are chosen from the float result's range so that few codes saturate: a test whose
outputs all clip to 0/255 would compare nothing.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kernel_util import run_native, run_reference
from quant_util import MS, assert_steps, onnxpack_node, ort_node

from onnxpack.errors import InvalidArgument

OPSET = 17


def ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return np.asarray(rng.integers(info.min, info.max, shape, endpoint=True)).astype(dtype)


def out_params(real: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero point) covering ``real``'s range with ~2% headroom."""
    lo, hi = min(float(real.min()), 0.0), max(float(real.max()), 0.0)
    scale = np.float32((hi - lo) / 250 or 1.0)
    qmin = np.iinfo(dtype).min
    zp = np.clip(np.rint(qmin + 2 - lo / scale), np.iinfo(dtype).min, np.iinfo(dtype).max)
    return np.array(scale, np.float32), np.array(zp).astype(dtype)


def check(node, inputs, *, consts, steps=0, max_fraction=1.0, pack=(), opset=OPSET, native_opset=None):
    """onnxruntime vs run_native (unpacked and packed) vs onnxpack sessions (prepacked, unpacked)."""
    (want,) = ort_node(node, inputs, opset, consts=consts)
    nop = native_opset if native_opset is not None else (1 if node.domain else opset)
    (got,) = run_native(node, inputs, nop)
    assert_steps(got, want, steps, max_fraction=max_fraction)
    if pack:
        (packed,) = run_native(node, inputs, nop, pack=pack)
        np.testing.assert_array_equal(packed, got)
    for prepack in (True, False):
        (out,), sess = onnxpack_node(node, inputs, opset, consts=consts, prepack=prepack)
        np.testing.assert_array_equal(out, got)
        assert sess.get_fallback_nodes() == []
        if pack:
            assert sess.get_prepack_stats()["weights_packed"] == (len(pack) if prepack else 0)
    return got, want


# -- QLinearConv ----------------------------------------------------------------------------------

CONV_CASES = [
    ("3x3-pad", (1, 16, 10, 10), (32, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("3x3-s2-asym", (2, 8, 9, 10), (12, 8, 3, 3), dict(strides=[2, 2], pads=[1, 0, 2, 1])),
    ("depthwise", (1, 16, 10, 10), (16, 1, 3, 3), dict(group=16, pads=[1, 1, 1, 1])),
    ("group2-dil", (1, 8, 9, 9), (8, 4, 3, 3), dict(group=2, dilations=[2, 2])),
    ("1x1", (2, 32, 8, 8), (16, 32, 1, 1), {}),
    ("1d", (2, 6, 13), (5, 6, 3), dict(pads=[1, 1])),
    ("large-k", (1, 128, 6, 6), (32, 128, 3, 3), dict(pads=[1, 1, 1, 1])),  # K = 1152: chunked
]
CONV_TYPES = [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8)]


def qconv_inputs(rng, xshape, wshape, xdt, wdt, per_channel, attrs):
    x, w = ints(rng, xdt, xshape), ints(rng, wdt, wshape)
    m = wshape[0]
    xs, xz = np.array(0.02, np.float32), ints(rng, xdt, ())
    ws = np.asarray(rng.random(m if per_channel else ()) * 0.01 + 0.001).astype(np.float32)
    wz = np.zeros(m if per_channel else (), wdt) if wdt == np.int8 else ints(rng, wdt, m if per_channel else ())
    b = rng.integers(-3000, 3000, m).astype(np.int32)
    # the float result, for output parameters that do not saturate everything
    node = helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["acc"], **{k: v for k, v in attrs.items()})
    wz_ref = wz if wz.ndim == 0 else wz.reshape(-1)
    (acc,) = run_reference(node, [x, w, xz, wz_ref], OPSET) if wz.ndim == 0 else run_native(node, [x, w, xz, wz], OPSET)
    wsb = ws.reshape(1, -1, *([1] * (acc.ndim - 2))) if ws.ndim else ws
    real = (acc + b.reshape(1, -1, *([1] * (acc.ndim - 2)))) * xs * wsb
    ys, yz = out_params(real, xdt)
    return [x, xs, xz, w, ws, wz, ys, yz, b]


QCONV_NAMES = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"]


@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
@pytest.mark.parametrize("types", CONV_TYPES, ids=["u8s8", "u8u8", "s8s8"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_qlinear_conv_matches_onnxruntime(case, types, per_channel):
    _, xshape, wshape, attrs = case
    rng = np.random.default_rng(len(case[0]) * 7 + per_channel)
    inputs = qconv_inputs(rng, xshape, wshape, *types, per_channel, attrs)
    node = helper.make_node("QLinearConv", QCONV_NAMES, ["y"], **attrs)
    got, _ = check(node, inputs, consts=QCONV_NAMES[1:], pack=[3])
    info = np.iinfo(got.dtype)
    assert ((got > info.min) & (got < info.max)).mean() > 0.5  # mostly unsaturated: a real comparison


def test_qlinear_conv_without_bias_and_channels_last():
    rng = np.random.default_rng(21)
    attrs = dict(pads=[1, 1, 1, 1], strides=[2, 1])
    inputs = qconv_inputs(rng, (2, 8, 7, 9), (6, 8, 3, 3), np.uint8, np.int8, True, attrs)
    node = helper.make_node("QLinearConv", QCONV_NAMES[:8], ["y"], **attrs)
    check(node, inputs[:8], consts=QCONV_NAMES[1:8], pack=[3])
    # com.microsoft's channels_last: NHWC in and out, the same codes
    (nchw,) = run_native(node, inputs[:8], OPSET)
    ms = helper.make_node("QLinearConv", QCONV_NAMES[:8], ["y"], domain=MS, channels_last=1, **attrs)
    nhwc = [inputs[0].transpose(0, 2, 3, 1).copy()] + inputs[1:8]
    got, _ = check(ms, nhwc, consts=QCONV_NAMES[1:8], pack=[3])
    np.testing.assert_array_equal(got, nchw.transpose(0, 2, 3, 1))


def test_qlinear_conv_matches_reference_per_channel_weight_zero_points():
    """Different uint8 zero points per output channel: spec-valid, onnxruntime rejects them."""
    rng = np.random.default_rng(22)
    attrs = dict(pads=[1, 1, 1, 1])
    inputs = qconv_inputs(rng, (1, 4, 6, 6), (5, 4, 3, 3), np.uint8, np.uint8, True, attrs)
    node = helper.make_node("QLinearConv", QCONV_NAMES, ["y"], **attrs)
    (want,) = run_reference(node, inputs, OPSET)
    (got,) = run_native(node, inputs, OPSET, pack=[3])
    assert_steps(got, want, 1, max_fraction=0.01)  # the reference requantizes in float64


# -- QLinearMatMul / QGemm -----------------------------------------------------------------------------

MM_CASES = [
    # id, A shape, B shape, A dtype, B dtype, per-column b
    ("u8s8", (6, 20), (20, 9), np.uint8, np.int8, False),
    ("u8u8-col", (2, 6, 20), (20, 9), np.uint8, np.uint8, True),
    ("s8s8-col", (6, 40), (40, 9), np.int8, np.int8, True),
    ("u8s8-large-k", (3, 2000), (2000, 16), np.uint8, np.int8, False),
    ("u8u8-batched-b", (2, 4, 8), (2, 8, 5), np.uint8, np.uint8, False),
]


def mm_inputs(rng, ashape, bshape, adt, bdt, per_col):
    a, b = ints(rng, adt, ashape), ints(rng, bdt, bshape)
    n = bshape[-1]
    as_, az = np.array(0.03, np.float32), ints(rng, adt, ())
    bs = np.asarray(rng.random(n if per_col else ()) * 0.01 + 0.002).astype(np.float32)
    bz = ints(rng, bdt, n if per_col else ()) if bdt == np.uint8 else np.zeros(n if per_col else (), bdt)
    real = (np.matmul(a.astype(np.int64) - az, b.astype(np.int64) - bz) * (as_ * bs)).astype(np.float64)
    ys, yz = out_params(real, adt)
    return [a, as_, az, b, bs, bz, ys, yz]


MM_NAMES = ["a", "as", "az", "b", "bs", "bz", "ys", "yz"]


@pytest.mark.parametrize("opset", [10, 21])
@pytest.mark.parametrize("case", MM_CASES, ids=[c[0] for c in MM_CASES])
def test_qlinear_matmul_matches_onnxruntime(case, opset):
    _, ashape, bshape, adt, bdt, per_col = case
    inputs = mm_inputs(np.random.default_rng(len(case[0])), ashape, bshape, adt, bdt, per_col)
    node = helper.make_node("QLinearMatMul", MM_NAMES, ["y"])
    got, _ = check(node, inputs, consts=MM_NAMES[1:], pack=[3] if len(bshape) == 2 else [], opset=max(opset, 10))
    info = np.iinfo(got.dtype)
    assert ((got > info.min) & (got < info.max)).mean() > 0.5


def test_requantization_ties_round_half_to_even():
    """x_scale * b_scale / y_scale = 0.5 exactly: every odd accumulator is a tie, which
    onnxruntime (and we) round to even; rounding half up would differ on half of them."""
    rng = np.random.default_rng(40)
    a, b = ints(rng, np.uint8, (8, 3)) // 4, ints(rng, np.int8, (3, 16)) // 4
    inputs = [a, np.array(1.0, np.float32), np.array(0, np.uint8), b, np.array(0.5, np.float32),
              np.array(0, np.int8), np.array(1.0, np.float32), np.array(128, np.uint8)]
    node = helper.make_node("QLinearMatMul", MM_NAMES, ["y"])
    got, want = check(node, inputs, consts=MM_NAMES[1:], pack=[3])
    acc = a.astype(np.int64) @ b.astype(np.int64)
    assert (acc % 2 == 1).mean() > 0.3
    np.testing.assert_array_equal(got.astype(np.int64), np.clip(np.rint(acc / 2) + 128, 0, 255))


def test_qlinear_matmul_float16_scales_opset21():
    """Opset 21 allows float16 scales; onnxruntime has no kernel: onnx.reference (float64
    requantization) within one step."""
    inputs = mm_inputs(np.random.default_rng(5), (6, 20), (20, 9), np.uint8, np.int8, True)
    for k in (1, 4, 6):
        inputs[k] = inputs[k].astype(np.float16)
    node = helper.make_node("QLinearMatMul", MM_NAMES, ["y"])
    (want,) = run_reference(node, inputs, 21)
    (got,) = run_native(node, inputs, 21, pack=[3])
    assert_steps(got, want, 1, max_fraction=0.02)


def test_qlinear_matmul_float8_matches_dq_matmul_q_in_onnxruntime():
    """Opset 21's float8 operands: quantize(dequantize(a) @ dequantize(b)), checked against
    onnxruntime running exactly that as DequantizeLinear -> MatMul -> QuantizeLinear."""
    import ml_dtypes

    rng = np.random.default_rng(6)
    f8 = np.dtype(ml_dtypes.float8_e4m3fn)
    a = rng.standard_normal((5, 16)).astype(f8)
    b = rng.standard_normal((16, 7)).astype(f8)
    s = [np.array(v, np.float32) for v in (0.5, 0.25, 2.0)]
    z = np.zeros((), f8)
    node = helper.make_node("QLinearMatMul", MM_NAMES, ["y"])
    inputs = [a, s[0], z, b, s[1], z, s[2], z]
    (got,) = run_native(node, inputs, 21)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["a", "as", "az"], ["fa"]),
         helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["fb"]),
         helper.make_node("MatMul", ["fa", "fb"], ["fy"]),
         helper.make_node("QuantizeLinear", ["fy", "ys", "yz"], ["y"]),
         helper.make_node("Cast", ["y"], ["y32"], to=onnx.TensorProto.FLOAT)],
        "g", [], [helper.make_value_info("y32", onnx.TypeProto())],
        [numpy_helper.from_array(v, n) for n, v in zip(MM_NAMES, inputs)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    import onnxruntime as ort

    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})
    assert got.dtype == f8
    np.testing.assert_array_equal(got.astype(np.float32), want)


QGEMM_CASES = [
    # id, M, K, N, transA, transB, per-column, C kind, quantized output, alpha
    ("u8s8-float-out", 5, 24, 7, 0, 0, False, None, False, 1.0),
    ("u8s8-transB-col-C", 5, 24, 7, 0, 1, True, "row", True, 1.0),
    ("u8u8-transA-C-full-alpha", 6, 30, 4, 1, 0, False, "full", True, 0.5),
    ("s8s8-large-k-col", 4, 1500, 9, 0, 1, True, "scalar", True, 1.0),
]


@pytest.mark.parametrize("case", QGEMM_CASES, ids=[c[0] for c in QGEMM_CASES])
def test_qgemm_matches_onnxruntime(case):
    _, m, k, n, ta, tb, per_col, ckind, quant_out, alpha = case
    rng = np.random.default_rng(len(case[0]))
    adt, bdt = (np.int8, np.int8) if case[0].startswith("s8") else (np.uint8, np.int8 if "s8" in case[0] else np.uint8)
    a = ints(rng, adt, (k, m) if ta else (m, k))
    b = ints(rng, bdt, (n, k) if tb else (k, n))
    as_, az = np.array(0.03, np.float32), ints(rng, adt, ())
    bs = np.asarray(rng.random(n if per_col else ()) * 0.01 + 0.002).astype(np.float32)
    bz = ints(rng, bdt, n if per_col else ()) if bdt == np.uint8 else np.zeros(n if per_col else (), bdt)
    c = {None: None, "row": rng.integers(-5000, 5000, (n,)), "full": rng.integers(-5000, 5000, (m, n)),
         "scalar": rng.integers(-5000, 5000, ())}[ckind]
    c = None if c is None else np.asarray(c).astype(np.int32)
    names = ["a", "as", "az", "b", "bs", "bz", "c" if c is not None else ""]
    inputs = [a, as_, az, b, bs, bz, c]
    if quant_out:
        aa = a.T if ta else a
        bb = b.T if tb else b
        acc = (aa.astype(np.int64) - az) @ (bb.astype(np.int64) - bz) + (0 if c is None else c)
        ys, yz = out_params(alpha * acc * as_ * bs, adt)
        names += ["ys", "yz"]
        inputs += [ys, yz]
    node = helper.make_node("QGemm", names, ["y"], domain=MS, transA=ta, transB=tb, alpha=alpha)
    consts = [nm for nm in names[1:] if nm]
    if quant_out:
        check(node, inputs, consts=consts, pack=[3])
    else:
        (want,) = ort_node(node, inputs, OPSET, consts=consts)
        (got,) = run_native(node, inputs, 1, pack=[3])
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))


# -- elementwise -----------------------------------------------------------------------------------------

BIN_SHAPES = [((3, 4, 5), (3, 4, 5)), ((3, 4, 5), (4, 1)), ((2, 1, 5), (1,)), ((3, 4, 5), ())]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
@pytest.mark.parametrize("shapes", BIN_SHAPES, ids=["same", "broadcast", "scalar-b-1d", "scalar-b"])
@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_qlinear_binary_matches_onnxruntime(op, shapes, dtype):
    rng = np.random.default_rng(len(op) + len(shapes[1]))
    a, b = ints(rng, dtype, shapes[0]), ints(rng, dtype, shapes[1])
    sa, sb = np.array(0.05, np.float32), np.array(0.02, np.float32)
    za, zb = ints(rng, dtype, ()), ints(rng, dtype, ())
    fa, fb = (a.astype(np.float64) - za) * sa, (b.astype(np.float64) - zb) * sb
    sc, zc = out_params(fa + fb if op == "QLinearAdd" else fa * fb, dtype)
    node = helper.make_node(op, ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["c"], domain=MS)
    inputs = [a, sa, za, b, sb, zb, sc, zc]
    check(node, inputs, consts=["sa", "za", "sb", "zb", "sc", "zc"], steps=0)


# Each span kind of onnxruntime's broadcaster: same shapes, A one value per span (innermost
# output dimension), B one value per span, size-1 dimensions of the output skipped, one element.
ADD_SHAPES = [((256, 256), (256, 256)), ((256, 1), (256, 256)), ((256, 256), (256, 1)),
              ((4, 1, 1), (4, 3, 1)), ((1,), (1,))]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
@pytest.mark.parametrize("shapes", ADD_SHAPES, ids=["same", "a-per-span", "b-per-span", "ones-skipped", "one"])
def test_qlinear_add_every_code_pair_as_onnxruntime(shapes, dtype):
    """All 65,536 code pairs (where the shapes allow) at scale sets drawn at random: onnxruntime's
    fused multiply-adds give its codes exactly, rounding ties included (the float formula
    ``quantize(dequantize(A) + dequantize(B))`` missed ~5 values in a million)."""
    info = np.iinfo(dtype)
    codes = np.arange(info.min, info.max + 1)
    rng = np.random.default_rng(40 + ADD_SHAPES.index(shapes))
    for _ in range(6):
        a = (np.broadcast_to(codes[:, None], (256, 256)) if shapes[0] == (256, 256) else ints(rng, dtype, shapes[0]))
        b = (np.broadcast_to(codes[None, :], (256, 256)) if shapes[1] == (256, 256) else ints(rng, dtype, shapes[1]))
        a, b = np.ascontiguousarray(a, dtype), np.ascontiguousarray(b, dtype)
        sa, sb = (np.array(v, np.float32) for v in 10 ** rng.uniform(-3, -1, 2))
        sc = np.array((sa + sb) * rng.uniform(0.3, 2), np.float32)
        za, zb, zc = (ints(rng, dtype, ()) for _ in range(3))
        node = helper.make_node("QLinearAdd", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["c"], domain=MS)
        check(node, [a, sa, za, b, sb, zb, sc, zc], consts=["sa", "za", "sb", "zb", "sc", "zc"], steps=0)


@pytest.mark.parametrize("shapes", ADD_SHAPES[:3] + [((40, 1, 1), (40, 3, 1)), ((2, 3, 1, 40), (3, 5, 1)), ((40,), (6, 40))],
                         ids=["same", "a-per-span", "b-per-span", "ones-skipped", "both-broadcast", "bias-like"])
@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_qlinear_add_and_mul_numba_kernels_give_the_numpy_codes(op, shapes, monkeypatch):
    """QLinearAdd's and QLinearMul's one-pass numba kernels (taken from _ADD_JIT_MIN codes) give
    the numpy arithmetic's codes bit for bit, for every broadcast (and both operand orders of
    onnxruntime's broadcaster in QLinearAdd), at scale sets drawn at random and at scales of
    inf, NaN and 0 (saturation; in QLinearAdd NaN to the lowest code as cvtps2dq's -2^31 clamps;
    QLinearMul takes numpy's path when its multiplier is not finite)."""
    from onnxpack.session.kernels import _act, qlinear

    if _act.load_jit("_qdq_jit", "fake-quant") is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(7)
    calls = []
    real = qlinear._fq_jit

    def spy():
        calls.append(1)
        return real()

    for dtype in (np.uint8, np.int8):
        a, b = ints(rng, dtype, shapes[0]), ints(rng, dtype, shapes[1])
        for scales in [10 ** rng.uniform(-3, -1, 3), 10 ** rng.uniform(-3, -1, 3), (0.02, 0.03, np.inf),
                       (np.inf, 0.02, 0.05), (0.02, np.nan, 0.05), (0.02, 0.03, 0.0), (1e30, 1e30, 1e-30)]:
            sa, sb, sc = (np.array(v, np.float32) for v in scales)
            za, zb, zc = (ints(rng, dtype, ()) for _ in range(3))
            node = helper.make_node(op, ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["c"], domain=MS)
            inputs = [a, sa, za, b, sb, zb, sc, zc]
            monkeypatch.setattr(qlinear, "_fq_jit", spy)
            (got,) = run_native(node, inputs, 1)
            monkeypatch.setattr(qlinear, "_fq_jit", lambda: None)
            (want,) = run_native(node, inputs, 1)
            assert got.dtype == want.dtype == dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want, err_msg=str(scales))
    assert len(calls) == (14 if op == "QLinearAdd" else 6)  # (Mul: 4 of 7 scale sets give no finite multiplier)


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_qlinear_add_and_mul_of_rank_0_codes(op):
    """Rank-0 A and B (numpy's 0-d arithmetic gives scalars, which the numpy path wrote into)."""
    ins = [np.array(10, np.uint8), np.array(0.05, np.float32), np.array(3, np.uint8), np.array(200, np.uint8),
           np.array(0.02, np.float32), np.array(128, np.uint8), np.array(0.1, np.float32), np.array(7, np.uint8)]
    node = helper.make_node(op, ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["y"], domain=MS)
    check(node, ins, consts=["as", "az", "bs", "bz", "cs", "cz"])


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("how", ["flag-flipped", "view-of-writable", "reshaped"])
def test_qlinear_binary_reads_a_fed_read_only_scale_that_changed(op, how):
    """A fed scale that is read-only but changes between runs (its owner sets it writable, writes
    and sets it read-only again; a read-only view of a buffer its owner writes; the same array
    given another shape) is read again: onnxruntime's codes at every run, never the constants
    derived from the values of an earlier run (the kernel keeps those only while the very same
    bytes come: ``qdq.memo_key``)."""
    import onnxruntime as ort

    import onnxpack

    node = helper.make_node(op, ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["c"], domain=MS)
    inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in
             [("az", 3, np.uint8), ("bs", 0.05, np.float32), ("bz", 2, np.uint8), ("cs", 0.1, np.float32),
              ("cz", 5, np.uint8)]]
    scale_shape = [1] if how == "reshaped" else []
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("a", onnx.TensorProto.UINT8, [4, 8]),
                      helper.make_tensor_value_info("as", onnx.TensorProto.FLOAT, None),
                      helper.make_tensor_value_info("b", onnx.TensorProto.UINT8, [4, 8])],
        [helper.make_tensor_value_info("c", onnx.TensorProto.UINT8, [4, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(MS, 1)])
    model = model.SerializeToString()
    ours = onnxpack.InferenceSession(model)
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(41)
    a, b = ints(rng, np.uint8, (4, 8)), ints(rng, np.uint8, (4, 8))
    buffer = np.array([0.02], np.float32)
    scale = buffer.reshape(()) if how == "view-of-writable" else buffer.reshape(()).copy()
    scale.flags.writeable = False
    seen = set()
    for run in range(4):
        feed = {"a": a, "as": scale, "b": b}
        got = ours.run(None, feed)[0]
        want = theirs.run(None, {**feed, "as": scale.reshape(scale_shape) if how == "reshaped" else scale})[0]
        np.testing.assert_array_equal(got, want, err_msg=f"run {run}")
        seen.add(got.tobytes())
        if how == "view-of-writable":
            buffer *= 3  # (the fed view stays read-only)
        elif how == "flag-flipped":
            scale.flags.writeable = True
            scale *= 3
            scale.flags.writeable = False
        else:
            scale.shape = (1,) if scale.shape == () else ()
            if run == 1:
                scale.flags.writeable = True
                scale *= 3
                scale.flags.writeable = False
    assert len(seen) >= 2  # the scale's change changed the codes


def test_memo_key_holds_only_for_the_same_arrays_and_bytes():
    """``memo_key`` / ``memo_holds``: None for a writable (or non-array) value; holds for the same
    read-only arrays (and omitted inputs) with the same dtype, shape and bytes, not for an equal
    copy, a changed value, another shape or another dtype."""
    from onnxpack.session.kernels.qdq import memo_holds, memo_key

    s = np.array(0.5, np.float32)
    assert memo_key((s, None)) is None and memo_key((0.5,)) is None
    s.flags.writeable = False
    z = np.arange(4, dtype=np.uint8)
    z.flags.writeable = False
    key = memo_key((s, None, z))
    assert key is not None and memo_holds(key, (s, None, z))
    assert not memo_holds(key, (s.copy(), None, z)) and not memo_holds(key, (s, z, z))
    assert not memo_holds(key, (s, None)) and not memo_holds(None, (s, None, z))
    z.shape = (2, 2)
    assert not memo_holds(key, (s, None, z))
    z.shape = (4,)
    assert memo_holds(key, (s, None, z))
    z.flags.writeable = True
    z[0] = 9
    z.flags.writeable = False
    assert not memo_holds(key, (s, None, z))


def test_qlinear_add_omitted_zero_points_are_zero():
    """onnxruntime cannot type an omitted zero point (its type inference fails), so the omitted
    case is compared with onnxruntime given explicit zeros."""
    rng = np.random.default_rng(30)
    a, b = ints(rng, np.int8, (4, 6)), ints(rng, np.int8, (4, 6))
    s, s2, z = np.array(0.1, np.float32), np.array(0.2137, np.float32), np.array(0, np.int8)
    full = helper.make_node("QLinearAdd", ["a", "s", "z", "b", "s", "z", "s2", "z"], ["c"], domain=MS)
    (want,) = ort_node(full, [a, s, z, b, s, z, s2, z], OPSET, consts=["s", "s2", "z"])
    node = helper.make_node("QLinearAdd", ["a", "s", "", "b", "s", "", "s2"], ["c"], domain=MS)
    (got,) = run_native(node, [a, s, None, b, s, None, s2], 1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
@pytest.mark.parametrize("op,attrs", [("QLinearSigmoid", {}), ("QLinearLeakyRelu", {"alpha": 0.1})], ids=["sigmoid", "leakyrelu"])
def test_qlinear_unary_matches_onnxruntime(op, attrs, dtype):
    x = np.arange(256, dtype=np.uint8).view(dtype).reshape(4, 64)  # every code
    xs, xz = np.array(0.05, np.float32), np.array(10, dtype)
    real = (x.astype(np.float64) - 10) * 0.05
    real = 1 / (1 + np.exp(-real)) if op == "QLinearSigmoid" else np.where(real >= 0, real, 0.1 * real)
    ys, yz = out_params(real, dtype)
    node = helper.make_node(op, ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS, **attrs)
    # QLinearSigmoid: MLAS' logistic is an approximation, one step on a few codes
    steps = 1 if op == "QLinearSigmoid" else 0
    check(node, [x, xs, xz, ys, yz], consts=["xs", "xz", "ys", "yz"], steps=steps, max_fraction=0.05)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
def test_qlinear_concat_matches_onnxruntime(dtype):
    rng = np.random.default_rng(31)
    x1, x2, x3 = ints(rng, dtype, (2, 3, 4)), ints(rng, dtype, (2, 5, 4)), ints(rng, dtype, (2, 1, 4))
    ys, yz = np.array(0.04, np.float32), np.array(5, dtype)
    s1, z1 = np.array(0.03, np.float32), np.array(-2 if dtype == np.int8 else 100, dtype)
    names = ["ys", "yz", "x1", "s1", "z1", "x2", "ys", "yz", "x3", "s3", "z3"]
    inputs = [ys, yz, x1, s1, z1, x2, ys, yz, x3, np.array(0.1, np.float32), np.array(0, dtype)]
    node = helper.make_node("QLinearConcat", names, ["y"], domain=MS, axis=1)
    got, _ = check(node, inputs, consts=["ys", "yz", "s1", "z1", "s3", "z3"])
    np.testing.assert_array_equal(got[:, 3:8], x2)  # same parameters: copied


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
def test_qlinear_where_matches_onnxruntime(dtype):
    rng = np.random.default_rng(32)
    cond = rng.random((3, 1, 6)) < 0.5
    x, y = ints(rng, dtype, (3, 4, 6)), ints(rng, dtype, (4, 1))
    names = ["c", "x", "xs", "xz", "y", "ys", "yz", "zs", "zz"]
    inputs = [cond, x, np.array(0.02, np.float32), np.array(3, dtype), y, np.array(0.07, np.float32),
              np.array(1, dtype), np.array(0.05, np.float32), np.array(2, dtype)]
    node = helper.make_node("QLinearWhere", names, ["z"], domain=MS)
    check(node, inputs, consts=["xs", "xz", "ys", "yz", "zs", "zz"])


# -- pools, softmax, reduce ------------------------------------------------------------------------------


@pytest.mark.parametrize("channels_last", [0, 1], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
def test_qlinear_global_average_pool_matches_onnxruntime(dtype, channels_last):
    rng = np.random.default_rng(33)
    x = ints(rng, dtype, (2, 7, 9, 11) if not channels_last else (2, 9, 11, 7))
    xs, xz = np.array(0.05, np.float32), np.array(7, dtype)
    ys, yz = np.array(0.01, np.float32), np.array(-3 if dtype == np.int8 else 120, dtype)
    node = helper.make_node("QLinearGlobalAveragePool", ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS,
                            channels_last=channels_last)
    try:
        check(node, [x, xs, xz, ys, yz], consts=["xs", "xz", "ys", "yz"])
    except Exception as exc:
        if "NOT_IMPLEMENTED" in str(exc) or "Could not find an implementation" in str(exc):
            pytest.skip(f"onnxruntime has no {dtype.__name__} kernel: {exc}")
        raise


POOL_CASES = [
    ("2x2-s2", (2, 3, 8, 9), dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("3x3-pad-include", (1, 4, 7, 7), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)),
    ("3x3-pad-exclude-ceil", (1, 4, 8, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    ("1d", (2, 3, 10), dict(kernel_shape=[3], strides=[2])),
    ("3x3-include-ceil", (1, 3, 8, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 1, 1, 0], ceil_mode=1,
                                            count_include_pad=1)),
    ("5x5-s1-large", (1, 8, 20, 20), dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2])),
    ("whole-image", (2, 5, 7, 6), dict(kernel_shape=[7, 6])),  # onnxruntime's global average pool
]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_qlinear_average_pool_matches_onnxruntime(case, dtype):
    _, shape, attrs = case
    rng = np.random.default_rng(len(case[0]))
    x = ints(rng, dtype, shape)
    inputs = [x, np.array(0.0513, np.float32), np.array(4, dtype), np.array(0.0417, np.float32),
              np.array(-1 if dtype == np.int8 else 9, dtype)]
    node = helper.make_node("QLinearAveragePool", ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS, **attrs)
    check(node, inputs, consts=["xs", "xz", "ys", "yz"])
    if len(shape) == 4:  # channels_last: the same codes, NHWC
        (nchw,) = run_native(node, inputs, 1)
        ms = helper.make_node("QLinearAveragePool", ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS, channels_last=1, **attrs)
        nhwc = [x.transpose(0, 2, 3, 1).copy()] + inputs[1:]
        got, _ = check(ms, nhwc, consts=["xs", "xz", "ys", "yz"])
        np.testing.assert_array_equal(got, nchw.transpose(0, 2, 3, 1))


SOFTMAX_CASES = [
    ("op13-last", (3, 4, 20), 13, -1),
    ("op13-mid", (3, 7, 5), 13, 1),
    ("op12-flatten", (2, 3, 8), 12, 1),
    ("op13-long-rows", (2, 700), 13, -1),
    ("op13-one-code", (4, 1), 13, -1),  # probability 1 everywhere: the largest code
]
# (x_scale, y_scale): the quantizer's 1/256; 1/255 and 0.003, where floor(1 / y_scale) is not
# 1 / y_scale; an x_scale so large that a row is all-or-nothing.
SOFTMAX_SCALES = [(0.02, 1 / 256), (0.1, 1 / 255), (0.004, 0.003), (3.0, 1 / 256)]


@pytest.mark.parametrize("scales", SOFTMAX_SCALES, ids=[f"xs{a:g}-ys{b:.3g}" for a, b in SOFTMAX_SCALES])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=[c[0] for c in SOFTMAX_CASES])
def test_qlinear_softmax_matches_onnxruntime(case, dtype, scales):
    """onnxruntime's codes exactly (its table of exponentials, in-order sums, floor(1 / y_scale)),
    zero points of the quantizer (0 / -128) and not; rows of clustered codes (close
    probabilities) and of spread ones."""
    _, shape, opset, axis = case
    rng = np.random.default_rng(len(case[0]) + 7 * SOFTMAX_SCALES.index(scales))
    x = ints(rng, dtype, shape)
    if x.ndim > 1:
        x[0] = np.clip(x[0].astype(int) // 16 + 60, np.iinfo(dtype).min, np.iinfo(dtype).max).astype(dtype)
    xz = np.array(0 if dtype == np.int8 else 128, dtype)
    for yz in ((0, 7) if dtype == np.uint8 else (-128, -100)):
        inputs = [x, np.array(scales[0], np.float32), xz, np.array(scales[1], np.float32), np.array(yz, dtype)]
        node = helper.make_node("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS, opset=opset, axis=axis)
        check(node, inputs, consts=["xs", "xz", "ys", "yz"], steps=0)


def test_requantize_numba_pass_gives_the_numpy_codes(monkeypatch):
    """Accumulators (int32, or float32 / float64 integers) from _REQUANT_JIT_MIN take one numba
    pass (``_qdq_jit.requantize_acc``):
    the numpy path's codes for per-column and per-tensor multipliers, uint8 and int8, with and
    without a zero point, accumulators up to int32's range (float32 conversion rounds them).
    QLinearMatMul / QLinearConv / QGemm reach it in the tests against onnxruntime."""
    from onnxpack.session.kernels import _act
    from onnxpack.session.kernels import qlinear as ql

    if _act.jit() is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(37)
    for trial in range(80):
        m, n = int(rng.integers(1, 40)), int(rng.integers(8, 300))
        big = trial % 3 == 0
        acc = rng.integers(-2**31, 2**31 - 1 if big else 300_000, (m, n), dtype=np.int64)
        acc = np.tile(acc, (-(-ql._REQUANT_JIT_MIN // acc.size), 1)).astype(np.int32)
        if trial % 7 == 3:  # the exact sgemm's accumulators: integers held as float32 / float64
            acc = acc.astype(np.float64 if big else np.float32)
        mult = (rng.random(n) * 1e-3).astype(np.float32) if trial % 2 else np.float32(rng.random() * 1e-4)
        dtype = np.dtype(np.uint8 if trial % 4 < 2 else np.int8)
        info = np.iinfo(dtype)
        zp = None if trial % 5 == 0 else np.array(rng.integers(info.min, info.max + 1), dtype)
        got = ql.requantize(acc, mult, zp, dtype)
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
        want = ql.requantize(acc, mult, zp, dtype)
        monkeypatch.delenv("ONNXPACK_DISABLE_JIT")
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_qlinear_softmax_numba_kernel_gives_the_numpy_codes(monkeypatch):
    """From _SOFTMAX_JIT_MIN codes QLinearSoftmax runs one numba pass a row
    (``_qdq_jit.qsoftmax_rows``): the numpy path's codes for random shapes, axes (every one of
    them and the default), opsets 1 and 13, both 8-bit types, the quantizer's output scales and
    others, zero points (the quantizer's and random ones); and onnxruntime's on one attention
    map (the existing cases reach the kernel with their long rows)."""
    from onnxpack.session.kernels import KernelContext, _act, lookup
    from onnxpack.session.kernels import qlinear as ql

    if _act.jit() is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(36)
    for trial in range(60):
        dtype = np.uint8 if trial % 2 else np.int8
        info = np.iinfo(dtype)
        shape = tuple(int(v) for v in rng.integers(1, 12, rng.integers(1, 4))) + (int(rng.integers(20, 300)),)
        x = rng.integers(info.min, info.max + 1, shape).astype(dtype)
        if x.size < ql._SOFTMAX_JIT_MIN:
            x = np.concatenate([x] * -(-ql._SOFTMAX_JIT_MIN // x.size), axis=-1)
        ys = (1 / 256, 1 / 255, float(10 ** rng.uniform(-4, -1)))[trial % 3]
        yz = info.min if trial % 5 == 0 else int(rng.integers(info.min, info.max + 1))
        inputs = [x, np.array(10 ** rng.uniform(-3, 0.5), np.float32), np.array(0, dtype), np.array(ys, np.float32),
                  np.array(yz, dtype)]
        attrs = {"opset": 13 if trial % 4 else 1}
        if trial % 3:
            attrs["axis"] = int(rng.integers(-x.ndim, x.ndim))
        node = helper.make_node("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS, **attrs)
        kernel = lookup(MS, "QLinearSoftmax", 1)(node, KernelContext(opset=1, opsets={"": 13, MS: 1}))
        (got,) = kernel.run(*inputs)
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
        (want,) = kernel.run(*inputs)
        monkeypatch.delenv("ONNXPACK_DISABLE_JIT")
        assert got.dtype == want.dtype and got.shape == want.shape == x.shape
        np.testing.assert_array_equal(got, want)
    x = rng.integers(0, 256, (1, 4, 64, 64)).astype(np.uint8)
    inputs = [x, np.array(0.05, np.float32), np.array(128, np.uint8), np.array(1 / 256, np.float32), np.array(0, np.uint8)]
    node = helper.make_node("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS, opset=13, axis=-1)
    check(node, inputs, consts=["xs", "xz", "ys", "yz"], steps=0)


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[1], [-1, 0]], ids=["ax1", "ax-1,0"])
def test_qlinear_reduce_mean_matches_reference(axes, keepdims):
    rng = np.random.default_rng(34)
    x = ints(rng, np.uint8, (3, 5, 4))
    s, z, ys, yz = np.array(0.03, np.float32), np.array(100, np.uint8), np.array(0.01, np.float32), np.array(90, np.uint8)
    node = helper.make_node("QLinearReduceMean", ["x", "s", "z", "ys", "yz"], ["y"], domain=MS, axes=axes, keepdims=keepdims)
    (got,) = run_native(node, [x, s, z, ys, yz], 1)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["f"]),
         helper.make_node("ReduceMean", ["f", "axes"], ["m"], keepdims=keepdims),
         helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.UINT8, x.shape)],
        [helper.make_value_info("y", onnx.TypeProto())],
        [numpy_helper.from_array(v, n) for n, v in (("s", s), ("z", z), ("ys", ys), ("yz", yz),
                                                     ("axes", np.array(axes, np.int64)))],
    )
    (want,) = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])).run(None, {"x": x})
    assert_steps(got, want, 1, max_fraction=0.1)


# -- errors ------------------------------------------------------------------------------------------------


def test_invalid_inputs_raise_invalid_argument():
    rng = np.random.default_rng(35)
    inputs = qconv_inputs(rng, (1, 4, 5, 5), (3, 4, 3, 3), np.uint8, np.int8, True, {})
    node = helper.make_node("QLinearConv", QCONV_NAMES, ["y"], name="qc")
    bad = list(inputs)
    bad[4] = np.ones(5, np.float32)  # w_scale: 5 values for 3 channels
    with pytest.raises(InvalidArgument, match="w_scale"):
        run_native(node, bad, OPSET)
    bad = list(inputs)
    bad[0] = inputs[0].astype(np.float32)
    with pytest.raises(InvalidArgument, match="int8 or uint8"):
        run_native(node, bad, OPSET)
    with pytest.raises(InvalidArgument, match="axis is required"):
        run_native(helper.make_node("QLinearConcat", ["a", "b", "c", "d", "e"], ["y"], domain=MS), [None] * 5, 1)


# -- NhwcMaxPool (onnxruntime's NHWC transformer, models saved at level "all") ---------------------
NHWC_POOL_CASES = [
    ("3x3-s2", (2, 9, 10, 5), dict(kernel_shape=[3, 3], strides=[2, 2])),
    ("2x2-pads-ceil", (1, 7, 7, 8), dict(kernel_shape=[2, 2], strides=[2, 2], pads=[0, 1, 1, 0], ceil_mode=1)),
    ("3x3-dil", (1, 8, 9, 3), dict(kernel_shape=[3, 3], dilations=[2, 2])),
    ("3x3-same-lower", (1, 8, 9, 3), dict(kernel_shape=[3, 3], auto_pad="SAME_LOWER")),
    # (dilations with auto_pad SAME: onnxruntime's kernel gives a VALID-sized output, against the
    # spec's ceil(in / stride) that MaxPool gives; no exporter writes a dilated max pool)
    ("1d", (2, 11, 4), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
@pytest.mark.parametrize("case", NHWC_POOL_CASES, ids=[c[0] for c in NHWC_POOL_CASES])
def test_nhwc_max_pool_matches_onnxruntime(case, dtype):
    _, shape, attrs = case
    x = ints(np.random.default_rng(len(case[0])), dtype, shape)
    check(helper.make_node("NhwcMaxPool", ["x"], ["y"], domain=MS, **attrs), [x], consts=[])


def test_nhwc_max_pool_rejects_float_input():
    node = helper.make_node("NhwcMaxPool", ["x"], ["y"], domain=MS, kernel_shape=[2, 2])
    with pytest.raises(InvalidArgument, match="must be int8 or uint8"):
        run_native(node, [np.zeros((1, 4, 4, 2), np.float32)], 1)
