"""MatMulInteger, ConvInteger and com.microsoft DynamicQuantizeMatMul, MatMulIntegerToFloat,
DynamicQuantizeLSTM vs onnxruntime; the exact integer GEMM alone.

Integer outputs (MatMulInteger, ConvInteger) must be exactly onnxruntime's: the accumulation is
exact (chunked float32 GEMM, see ``qinteger.py``), onnxruntime accumulates in int32 (this
machine has AVX512-VNNI, so its u8s8 kernels do not saturate int16 pairs).  Per-row A zero
points and per-channel ConvInteger weight zero points, which onnxruntime rejects, are compared
with onnx.reference or the spec's formula in int64.

Float outputs (DynamicQuantizeMatMul, MatMulIntegerToFloat): the quantized A, the integer sum
and ``float32(acc) * (a_scale * b_scale)`` are onnxruntime's; only the final ``+ bias`` may be
fused differently, so rtol 1e-6 and atol 1e-6 of the output's magnitude.  DynamicQuantizeLSTM
re-quantizes ``h`` every step, so a one-ulp gate difference would move an ``h`` code and the
states after it: it computes onnxruntime's gates (``X W + H R`` then the bias, MLAS' logistic
and tanh) and is compared exactly for one sequence, over longer sequences too.  With a batch,
onnxruntime splits the rows over its threads (``batch_parallel_``: more than 4 rows, or 2+ rows
of at most 256 units) and quantizes each thread's ``h`` rows on their own, so its result depends
on its thread count; ours quantizes the step's ``h`` as one tensor (its one-thread arithmetic):
atol 1e-3 there (a code moved by one step moves the states by ~1e-4).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from kernel_util import run_native, run_reference
from quant_util import MS, onnxpack_node, ort_node

from onnxpack.session.kernels.qinteger import exact_matmul

OPSET = 17


def ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return np.asarray(rng.integers(info.min, info.max, shape, endpoint=True)).astype(dtype)


@pytest.mark.parametrize("signs", ["mixed", "positive"])
@pytest.mark.parametrize("k", [1, 514, 515, 3000], ids=["k1", "k514", "k515", "k3000"])
def test_exact_matmul_is_exact(k, signs):
    """Extreme 8-bit values (the worst case for float32 rounding) against int64 matmul."""
    rng = np.random.default_rng(k)
    if signs == "mixed":
        a = rng.choice([-255, 255, 254, -1], (7, k)).astype(np.float32)
        b = rng.choice([-128, 127, 126], (k, 9)).astype(np.float32)
    else:  # sums far beyond 2**24
        a = rng.choice([255, 253, 251], (7, k)).astype(np.float32)
        b = rng.choice([127, 125, 123], (k, 9)).astype(np.float32)
    got = exact_matmul(a, b, 255 * 128)
    want = a.astype(np.int64) @ b.astype(np.int64)
    np.testing.assert_array_equal(got.astype(np.int64), want)
    if k == 3000 and signs == "positive":
        # one float32 GEMM over these K = 3000 terms is not exact: the chunking is what makes it so
        assert got.dtype == np.float64
        assert not np.array_equal((a @ b).astype(np.int64), want)


# -- MatMulInteger -------------------------------------------------------------------------------

MMI_CASES = [
    # id, A shape, B shape, A dtype, B dtype, a_zp kind, b_zp kind
    ("u8u8-2d", (5, 7), (7, 4), np.uint8, np.uint8, "scalar", "scalar"),
    ("u8s8-2d-nozp", (5, 7), (7, 4), np.uint8, np.int8, None, None),
    ("s8s8-3d", (2, 5, 7), (7, 4), np.int8, np.int8, "scalar", None),
    ("u8s8-bzp-col", (3, 5, 16), (16, 6), np.uint8, np.int8, "scalar", "column"),
    ("u8u8-bzp-col-large-k", (4, 1500), (1500, 33), np.uint8, np.uint8, "scalar", "column"),
    ("u8s8-large-k-many-rows", (64, 600), (600, 8), np.uint8, np.int8, "scalar", "scalar"),
    ("u8u8-batched-b", (2, 3, 5, 7), (2, 1, 7, 4), np.uint8, np.uint8, "scalar", "scalar"),
    ("u8s8-1d-a", (7,), (7, 4), np.uint8, np.int8, "scalar", None),
]


def zp_for(rng, kind, dtype, count):
    if kind is None:
        return None
    if kind == "scalar":
        return ints(rng, dtype, ())
    return ints(rng, dtype, (count,))


def test_integer_products_stay_exact_where_float32_would_round():
    """All-extreme operands (K = 2304 products of 255 * 127 sum to ~7.5e7 > 2**24): one float32
    GEMM would round; MatMulInteger and ConvInteger must still equal onnxruntime's int32."""
    a = np.full((2, 2304), 255, np.uint8)
    a[1, ::7] = 254
    b = np.full((2304, 3), 127, np.int8)
    b[::5, 1] = 126
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    (want,) = ort_node(node, [a, b], OPSET)
    assert int(want.max()) > 2**24
    np.testing.assert_array_equal(run_native(node, [a, b], OPSET, pack=[1])[0], want)
    x = np.full((1, 256, 4, 4), 250, np.uint8)
    w = np.full((2, 256, 3, 3), 127, np.int8)
    w[1, :, 0, 0] = -128
    node = helper.make_node("ConvInteger", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    (want,) = ort_node(node, [x, w], OPSET)
    assert int(want.max()) > 2**24
    np.testing.assert_array_equal(run_native(node, [x, w], OPSET, pack=[1])[0], want)


@pytest.mark.parametrize("case", MMI_CASES, ids=[c[0] for c in MMI_CASES])
def test_matmul_integer_matches_onnxruntime(case):
    _, ashape, bshape, adt, bdt, azk, bzk = case
    rng = np.random.default_rng(len(case[0]))
    a, b = ints(rng, adt, ashape), ints(rng, bdt, bshape)
    az, bz = zp_for(rng, azk, adt, ashape[-2] if len(ashape) > 1 else 1), zp_for(rng, bzk, bdt, bshape[-1])
    names = ["a", "b", "az" if az is not None else "", "bz" if bz is not None else ""]
    while names and not names[-1]:
        names.pop()
    inputs = [a, b, az, bz][: len(names)]
    node = helper.make_node("MatMulInteger", names, ["y"])
    (want,) = ort_node(node, inputs, OPSET)
    assert want.dtype == np.int32
    (got,) = run_native(node, inputs, OPSET)
    np.testing.assert_array_equal(got, want)
    if len(bshape) == 2:
        (packed,) = run_native(node, inputs, OPSET, pack=[1])
        np.testing.assert_array_equal(packed, want)
    for prepack in (True, False):
        (out,), sess = onnxpack_node(node, inputs, OPSET, consts=["b", "az", "bz"], prepack=prepack)
        np.testing.assert_array_equal(out, want)
        assert sess.get_fallback_nodes() == []
        assert sess.get_prepack_stats()["weights_packed"] == (1 if prepack and len(bshape) == 2 else 0)


def test_matmul_integer_per_row_a_zero_point():
    """Per-row a_zero_point (spec-valid; onnxruntime rejects it and onnx.reference 1.23 cannot
    broadcast it): the spec's formula in int64 is the oracle."""
    rng = np.random.default_rng(1)
    a, b = ints(rng, np.uint8, (6, 9)), ints(rng, np.uint8, (9, 5))
    az, bz = ints(rng, np.uint8, (6,)), ints(rng, np.uint8, (5,))
    node = helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"])
    want = ((a.astype(np.int64) - az[:, None]) @ (b.astype(np.int64) - bz)).astype(np.int32)
    (got,) = run_native(node, [a, b, az, bz], OPSET, pack=[1])
    np.testing.assert_array_equal(got, want)


# -- ConvInteger ------------------------------------------------------------------------------------

CONV_CASES = [
    ("3x3", (2, 4, 9, 10), (6, 4, 3, 3), {}),
    ("3x3-pad-s2", (1, 4, 9, 10), (6, 4, 3, 3), dict(pads=[1, 0, 2, 1], strides=[2, 2])),
    ("dilation", (1, 3, 9, 10), (5, 3, 3, 3), dict(dilations=[2, 1])),
    ("same-upper", (1, 4, 9, 10), (6, 4, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ("group2", (2, 4, 9, 10), (6, 2, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    ("depthwise", (2, 8, 9, 10), (8, 1, 3, 3), dict(group=8, pads=[1, 1, 1, 1])),
    ("1x1", (2, 8, 7, 6), (5, 8, 1, 1), {}),
    ("1x1-s2", (1, 8, 7, 6), (5, 8, 1, 1), dict(strides=[2, 2])),
    ("1d", (2, 3, 11), (5, 3, 4), dict(pads=[1, 2])),
    ("3d", (1, 3, 5, 6, 7), (4, 3, 3, 2, 3), dict(pads=[1, 1, 1, 1, 0, 1])),
    ("large-k", (1, 160, 6, 6), (16, 160, 3, 3), dict(pads=[1, 1, 1, 1])),  # K = 1440: 3 chunks
]


@pytest.mark.parametrize("wdt", [np.uint8, np.int8], ids=["w-u8", "w-s8"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_integer_matches_onnxruntime(case, wdt):
    _, xshape, wshape, attrs = case
    rng = np.random.default_rng(len(case[0]) + (wdt == np.int8))
    x, w = ints(rng, np.uint8, xshape), ints(rng, wdt, wshape)
    xz, wz = ints(rng, np.uint8, ()), ints(rng, wdt, ())
    node = helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["y"], **attrs)
    inputs = [x, w, xz, wz]
    (want,) = ort_node(node, inputs, OPSET)
    (got,) = run_native(node, inputs, OPSET)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    (packed,) = run_native(node, inputs, OPSET, pack=[1])
    np.testing.assert_array_equal(packed, want)
    for prepack in (True, False):
        (out,), sess = onnxpack_node(node, inputs, OPSET, consts=["w", "xz", "wz"], prepack=prepack)
        np.testing.assert_array_equal(out, want)
        assert sess.get_fallback_nodes() == []


def test_conv_integer_without_zero_points_and_per_channel_weight_zero_point():
    """Per-output-channel w_zero_point (spec-valid, onnxruntime rejects it): onnx.reference."""
    rng = np.random.default_rng(3)
    x, w = ints(rng, np.uint8, (1, 3, 7, 7)), ints(rng, np.uint8, (4, 3, 3, 3))
    node = helper.make_node("ConvInteger", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    (want,) = ort_node(node, [x, w], OPSET)
    np.testing.assert_array_equal(run_native(node, [x, w], OPSET, pack=[1])[0], want)
    wz = ints(rng, np.uint8, (4,))
    node = helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["y"], pads=[1, 1, 1, 1])
    inputs = [x, w, np.array(3, np.uint8), wz]
    (want,) = run_reference(node, inputs, OPSET)
    np.testing.assert_array_equal(run_native(node, inputs, OPSET, pack=[1])[0], want)
    np.testing.assert_array_equal(run_native(node, inputs, OPSET)[0], want)


# -- DynamicQuantizeMatMul / MatMulIntegerToFloat ----------------------------------------------------------


def assert_float_close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = float(np.abs(want).max()) or 1.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * scale)


DQMM_CASES = [
    # id, A shape, B shape, B dtype, per-column scales, zero point, bias
    ("s8-tensor", (4, 16), (16, 8), np.int8, False, False, False),
    ("s8-column-bias-3d", (2, 3, 16), (16, 8), np.int8, True, False, True),
    ("u8-tensor-zp-bias", (5, 40), (40, 12), np.uint8, False, True, True),
    ("u8-column-zp-large-k", (3, 1200), (1200, 10), np.uint8, True, True, False),
]


@pytest.mark.parametrize("case", DQMM_CASES, ids=[c[0] for c in DQMM_CASES])
def test_dynamic_quantize_matmul_matches_onnxruntime(case):
    _, ashape, bshape, bdt, per_col, with_zp, with_bias = case
    rng = np.random.default_rng(len(case[0]))
    a = rng.standard_normal(ashape).astype(np.float32)
    b = ints(rng, bdt, bshape)
    n = bshape[-1]
    bs = (rng.random(n if per_col else ()) * 0.02 + 0.001).astype(np.float32)
    names, inputs = ["a", "b", "bs"], [a, b, np.asarray(bs)]
    if with_zp or with_bias:
        names.append("bz" if with_zp else "")
        inputs.append(ints(rng, bdt, n if per_col else ()) if with_zp else None)
    if with_bias:
        names.append("bias")
        inputs.append(rng.standard_normal(n).astype(np.float32))
    node = helper.make_node("DynamicQuantizeMatMul", names, ["y"], domain=MS)
    (want,) = ort_node(node, inputs, OPSET)
    (got,) = run_native(node, inputs, 1)
    assert_float_close(got, want)
    (packed,) = run_native(node, inputs, 1, pack=[1])
    np.testing.assert_array_equal(packed, got)
    for prepack in (True, False):
        (out,), sess = onnxpack_node(node, inputs, OPSET, consts=["b", "bs", "bz", "bias"], prepack=prepack)
        np.testing.assert_array_equal(out, got)
        assert sess.get_fallback_nodes() == []


@pytest.mark.parametrize("adt,bdt", [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8)], ids=["u8s8", "u8u8", "s8s8"])
@pytest.mark.parametrize("out", [np.float32, np.float16], ids=["f32", "f16"])
def test_matmul_integer_to_float_matches_onnxruntime(adt, bdt, out):
    rng = np.random.default_rng(7)
    a, b = ints(rng, adt, (2, 5, 24)), ints(rng, bdt, (24, 6))
    inputs = [a, b, np.array(0.02, out), (rng.random(6) * 0.01 + 0.001).astype(out),
              ints(rng, adt, ()), ints(rng, bdt, (6,)), rng.standard_normal(6).astype(out)]
    node = helper.make_node("MatMulIntegerToFloat", ["a", "b", "as", "bs", "az", "bz", "bias"], ["y"], domain=MS)
    try:
        (want,) = ort_node(node, inputs, OPSET)
    except Exception as exc:  # onnxruntime registers only some type combinations
        if "NOT_IMPLEMENTED" not in str(exc):
            raise
        pytest.skip(f"onnxruntime has no MatMulIntegerToFloat kernel for {adt.__name__}/{bdt.__name__}/{out.__name__}")
    (got,) = run_native(node, inputs, 1, pack=[1])
    if out == np.float16:
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=1e-3)
        assert got.dtype == want.dtype
    else:
        assert_float_close(got, want)


# -- DynamicQuantizeLSTM ---------------------------------------------------------------------------------


def lstm_case(rng, seq, batch, inp, hidden, num_dir, wdt, per_col):
    x = rng.standard_normal((seq, batch, inp)).astype(np.float32)
    w = ints(rng, wdt, (num_dir, inp, 4 * hidden))
    r = ints(rng, wdt, (num_dir, hidden, 4 * hidden))
    pshape = (num_dir, 4 * hidden) if per_col else (num_dir,)
    ws = (rng.random(pshape) * 0.004 + 0.002).astype(np.float32)
    rs = (rng.random(pshape) * 0.004 + 0.002).astype(np.float32)
    zp = 128 if wdt == np.uint8 else 0
    wz = np.full(pshape, zp, wdt)
    rz = np.full(pshape, zp, wdt)
    b = (rng.standard_normal((num_dir, 8 * hidden)) * 0.1).astype(np.float32)
    return [x, w, r, b, None, None, None, None, ws, wz, rs, rz]


LSTM_CASES = [
    ("fwd-s8-tensor", 5, 2, 6, 4, 1, np.int8, False),
    ("bidir-u8-column", 4, 3, 5, 3, 2, np.uint8, True),
    ("fwd-s8-column-wide", 3, 1, 40, 16, 1, np.int8, True),
    ("bidir-s8-long", 32, 1, 64, 48, 2, np.int8, True),  # an OCR's recurrence: 32 re-quantized steps
    ("bidir-u8-tensor-long", 24, 1, 20, 40, 2, np.uint8, False),
]


@pytest.mark.parametrize("case", LSTM_CASES, ids=[c[0] for c in LSTM_CASES])
def test_dynamic_quantize_lstm_matches_onnxruntime(case):
    _, seq, batch, inp, hidden, nd, wdt, per_col = case
    rng = np.random.default_rng(len(case[0]))
    inputs = lstm_case(rng, seq, batch, inp, hidden, nd, wdt, per_col)
    names = ["x", "w", "r", "b", "", "", "", "", "ws", "wz", "rs", "rz"]
    direction = "bidirectional" if nd == 2 else "forward"
    node = helper.make_node("DynamicQuantizeLSTM", names, ["y", "yh", "yc"], domain=MS, hidden_size=hidden,
                            direction=direction)
    want = ort_node(node, inputs, OPSET)
    got = run_native(node, inputs, 1)
    packed = run_native(node, inputs, 1, pack=[1, 2, 3])
    tol = dict(rtol=0, atol=0) if batch == 1 else dict(atol=1e-3)  # see the module docstring
    for g, p, w in zip(got, packed, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, **tol)
        np.testing.assert_array_equal(p, g)
    outs, sess = onnxpack_node(node, inputs, OPSET, consts=["w", "r", "b", "ws", "wz", "rs", "rz"])
    for g, w in zip(outs, want):
        np.testing.assert_allclose(g, w, **tol)
    assert sess.get_fallback_nodes() == []
    assert sess.get_prepack_stats()["weights_packed"] == 3


JIT_LSTM_CASES = [
    # id, seq, batch, input, hidden, directions, weight dtype, per-column, what else
    ("u8-column-zero-points", 6, 2, 7, 5, 2, np.uint8, True, "zero-points"),
    ("s8-rows-4-and-1", 5, 5, 8, 36, 1, np.int8, False, ""),  # the GEMM's 4-row pass and a leftover row
    ("s8-lengths", 7, 3, 4, 6, 2, np.int8, True, "lengths"),
    ("s8-nan-bias", 6, 1, 5, 4, 2, np.int8, False, "nan"),
    ("u8-inf-state", 4, 2, 3, 4, 1, np.uint8, False, "inf"),
    ("s8-wide", 9, 1, 16, 130, 1, np.int8, True, ""),  # 4H = 520: a last tile of 8 columns
]


@pytest.mark.parametrize("case", JIT_LSTM_CASES, ids=[c[0] for c in JIT_LSTM_CASES])
def test_dynamic_quantize_lstm_recurrence_in_one_call_is_the_loop(case, monkeypatch):
    """With R packed as lanes, the recurrence runs every step in one JIT call (_qlstm_jit); its
    results are the per-step loop's, bit for bit: nonzero per-column zero points, sequence
    lengths, a NaN bias and an infinite initial state (the loop takes over from the step whose h
    is not finite), batches over the GEMM's 4-row pass, a hidden size not a multiple of 4."""
    from onnxpack.session.kernels import _act, qinteger as qi

    if qi._qjit() is None or _act.load_jit("_qlstm_jit", "DynamicQuantizeLSTM") is None:
        pytest.skip("the one-call recurrence needs numba and a CPU with AVX-512 VNNI or AVX2")
    _, seq, batch, inp, hidden, nd, wdt, per_col, extra = case
    rng = np.random.default_rng(len(case[0]) + seq)
    inputs = lstm_case(rng, seq, batch, inp, hidden, nd, wdt, per_col)
    names = ["x", "w", "r", "b", "", "", "", "", "ws", "wz", "rs", "rz"]
    pshape = inputs[10].shape
    if extra == "zero-points":
        inputs[9] = ints(rng, wdt, pshape)
        inputs[11] = ints(rng, wdt, pshape)
    if extra == "lengths":
        names[4], inputs[4] = "lens", np.array([7, 2, 5], np.int32)
    if extra == "nan":  # a NaN bias: every step's gates, so h after the first step
        inputs[3][:, 5] = np.nan
    if extra == "inf":
        names[5], names[6] = "h0", "c0"
        inputs[5] = rng.standard_normal((nd, batch, hidden)).astype(np.float32)
        inputs[5][0, 1, 2] = np.inf
        inputs[6] = rng.standard_normal((nd, batch, hidden)).astype(np.float32)
    direction = "bidirectional" if nd == 2 else "forward"
    node = helper.make_node("DynamicQuantizeLSTM", names, ["y", "yh", "yc"], domain=MS, hidden_size=hidden,
                            direction=direction)
    calls = []
    one_call = qi.DynamicQuantizeLSTM._exact_steps

    def counted(self, *args):
        done = one_call(self, *args)
        calls.append(done)
        return done

    monkeypatch.setattr(qi.DynamicQuantizeLSTM, "_exact_steps", counted)
    got = run_native(node, inputs, 1, pack=[1, 2, 3])
    assert len(calls) == nd
    if extra == "nan":  # the loop takes over at the second step of each direction
        assert calls == [1, 1]
    elif extra == "inf":
        assert calls == [0]
    else:
        assert calls == [seq] * nd
    monkeypatch.setattr(qi.DynamicQuantizeLSTM, "_exact_steps", lambda self, *args: 0)
    want = run_native(node, inputs, 1, pack=[1, 2, 3])
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)
    if batch == 1 and not extra:  # (onnxruntime's min and max of a tensor with a NaN depend on its position)
        for g, w in zip(got, ort_node(node, inputs, OPSET)):
            np.testing.assert_array_equal(g, w)


# -- the int8 lanes pack and its GEMM -------------------------------------------------------------

from onnxpack.session.kernels import qinteger  # noqa: E402

LANE_SHAPES = [(1, 1, 1), (3, 5, 3), (4, 64, 128), (7, 130, 200), (16, 768, 300), (9, 3, 64), (2, 255, 129)]


@pytest.mark.parametrize("bdt", [np.int8, np.uint8], ids=["s8", "u8"])
@pytest.mark.parametrize("k,n", [(1, 1), (5, 3), (64, 128), (130, 300), (3, 129)])
def test_lanes_round_trip_and_stay_8_bit(k, n, bdt):
    """The lanes pack holds the weight's integers (uint8 as their signed image) in one byte each,
    K padded to 4, plus one int32 column sum per column: from_lanes gives the weight back."""
    b = ints(np.random.default_rng(k * n), bdt, (k, n))
    lanes, colsum = qinteger.to_lanes(b)
    assert lanes.dtype == np.int8 and lanes.shape == (-(-k // 4) * 4 * n,)
    stored = b.astype(np.int64) - (128 if bdt == np.uint8 else 0)
    np.testing.assert_array_equal(colsum, stored.sum(axis=0))
    np.testing.assert_array_equal(qinteger.from_lanes(lanes, k, n, bdt == np.uint8), b.astype(np.float32))


@pytest.mark.parametrize("shape", LANE_SHAPES, ids=[f"m{m}k{k}n{n}" for m, k, n in LANE_SHAPES])
@pytest.mark.parametrize("zps", ["none", "scalar", "row-col"])
@pytest.mark.parametrize("adt,bdt", [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8), (np.int8, np.uint8)],
                         ids=["u8s8", "u8u8", "s8s8", "s8u8"])
def test_int8_gemm_is_exact(adt, bdt, zps, shape):
    """The int8 GEMM on the lanes (AVX-512 VNNI, or AVX2 with the activation bytes split) against
    int64 numpy: every dtype pair, zero points none / per tensor / per row and column, 4-row and
    1-row passes, K not a multiple of 4, the last tile's odd columns, extreme values."""
    if qinteger._qjit() is None:
        pytest.skip("the int8 GEMM needs numba and a CPU with AVX-512 VNNI or AVX2")
    m, k, n = shape
    rng = np.random.default_rng(m * k + n)
    a, b = ints(rng, adt, (m, k)), ints(rng, bdt, (k, n))
    if zps == "none":
        az = bz = None
    elif zps == "scalar":
        az, bz = ints(rng, adt, ()), ints(rng, bdt, ())
    else:
        az, bz = ints(rng, adt, (m,)), ints(rng, bdt, (n,))
    lanes, colsum = qinteger.to_lanes(b)
    got = qinteger.lanes_matmul(a, az, lanes, colsum, k, n, bdt == np.uint8, bz)
    want = (a.astype(np.int64) - (0 if az is None else np.asarray(az, np.int64).reshape(-1, 1) if zps != "scalar" else int(az))) @ \
        (b.astype(np.int64) - (0 if bz is None else np.asarray(bz, np.int64)))
    assert got is not None and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", LANE_SHAPES, ids=[f"m{m}k{k}n{n}" for m, k, n in LANE_SHAPES])
@pytest.mark.parametrize("zps", ["none", "scalar", "row-col"])
@pytest.mark.parametrize("adt", [np.uint8, np.int8], ids=["u8", "s8"])
def test_int8_gemm_signed_form_is_exact(adt, zps, shape):
    """Weights in [-127, 127] (symmetric int8, no_min_lane): the GEMM's signed form (AVX2: the
    sums of (a - 128) * w, the column sums' term shifted back) against int64 numpy, through the
    scalar and the per-row / per-column corrections, with and without the form."""
    if qinteger._qjit() is None:
        pytest.skip("the int8 GEMM needs numba and a CPU with AVX-512 VNNI or AVX2")
    m, k, n = shape
    rng = np.random.default_rng(7 * m + k + n)
    a = ints(rng, adt, (m, k))
    b = rng.integers(-127, 128, (k, n)).astype(np.int8)
    b[0] = -127
    if zps == "none":
        az = bz = None
    elif zps == "scalar":
        az, bz = ints(rng, adt, ()), ints(rng, np.int8, ())
    else:
        az, bz = ints(rng, adt, (m,)), ints(rng, np.int8, (n,))
    lanes, colsum = qinteger.to_lanes(b)
    assert qinteger.no_min_lane(lanes)
    want = (a.astype(np.int64) - (0 if az is None else np.asarray(az, np.int64).reshape(-1, 1) if zps != "scalar" else int(az))) @ \
        (b.astype(np.int64) - (0 if bz is None else np.asarray(bz, np.int64)))
    for no_min in (True, False):
        got = qinteger.lanes_matmul(a, az, lanes, colsum, k, n, False, bz, no_min)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("wval", [-128, 127])
@pytest.mark.parametrize("m,k,n", [(4, 64, 24), (1, 70, 40), (5, 3, 9)])
def test_int8_gemm_saturation_cases(wval, m, k, n):
    """Where a pairwise int16 sum of products saturates (255 * -128 twice is -65,280; 255 * 127
    twice 64,770): the GEMM still gives the exact int32 sums (onnxruntime's AVX2 kernel does not)."""
    if qinteger._qjit() is None:
        pytest.skip("the int8 GEMM needs numba and a CPU with AVX-512 VNNI or AVX2")
    a = np.full((m, k), 255, np.uint8)
    a[:, ::3] = 254  # not all equal: the split of every byte matters
    b = np.full((k, n), wval, np.int8)
    lanes, colsum = qinteger.to_lanes(b)
    got = qinteger.lanes_matmul(a, None, lanes, colsum, k, n, False, None)
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("jit", ["jit", "numpy"])
def test_packed_matmul_integer_on_both_paths(jit, monkeypatch):
    """A pre-packed MatMulInteger / QLinearMatMul equals the int64 formula with the int8 GEMM and
    with the numpy path (the lanes unpacked to float32 for the exact sgemm), batched A included."""
    if jit == "numpy":
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    else:
        monkeypatch.delenv("ONNXPACK_DISABLE_JIT", raising=False)
    rng = np.random.default_rng(5)
    a = ints(rng, np.uint8, (2, 3, 70))
    b = ints(rng, np.int8, (70, 150))
    az, bz = np.uint8(7), ints(rng, np.int8, (150,))
    node = helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"])
    (got,) = run_native(node, [a, b, az, bz], OPSET, pack=[1])
    want = (a.astype(np.int64) - 7) @ (b.astype(np.int64) - bz.astype(np.int64))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


TILED = [  # (A shape, K, N): several 512-column tiles, a 128-lane remainder, a column remainder
    ((5, 40), 40, 1300),
    ((2, 3, 1030), 1030, 700),  # K = 1030: the columns of large weights need K-chunks (float64)
    ((1030,), 1030, 129),
]


@pytest.mark.parametrize("bdt", [np.int8, np.uint8], ids=["s8", "u8"])
@pytest.mark.parametrize("case", TILED, ids=["tiles-remainder", "chunked-batched", "vector"])
def test_lanes_tiles_fallback_is_exact(case, bdt, monkeypatch):
    """Without the int8 GEMM, a packed weight is multiplied a tile of columns at a time
    (lanes_tiles): every tile's GEMM exact, tiles that need K-chunks (float64) next to tiles that
    do not (the first 512 columns take small values, the others any), per-column zero
    points cut per tile; twice, so the kept per-tile norms are used too."""
    monkeypatch.setattr(qinteger, "_qjit", lambda: None)
    a_shape, k, n = case
    rng = np.random.default_rng(k + n)
    info = np.iinfo(bdt)
    b = ints(rng, bdt, (k, n))
    small = np.asarray(rng.integers(-3, 4, (k, n)) + (0 if bdt == np.int8 else 128)).astype(bdt)
    b[:, :512] = small[:, :512]
    b[:, -3:] = info.max if bdt == np.uint8 else info.min
    a = ints(rng, np.uint8, a_shape)
    az = np.uint8(3)
    for bz in (ints(rng, bdt, (n,)), None):  # without B's zero point, small tiles stay float32
        node = helper.make_node("MatMulInteger", ["a", "b", "az"] + (["bz"] if bz is not None else []), ["y"])
        for weight in (b, np.ascontiguousarray(b[:, ::-1])):  # float64 tiles first, then last
            want = (a.astype(np.int64) - 3) @ (weight.astype(np.int64) - (0 if bz is None else bz.astype(np.int64)))
            for _ in range(2):
                inputs = [a, weight, az] + ([bz] if bz is not None else [])
                (got,) = run_native(node, inputs, OPSET, pack=[1])
                assert got.dtype == np.int32 and got.shape == want.shape
                np.testing.assert_array_equal(got, want)


def test_lanes_tiles_give_the_weight_back():
    """lanes_tiles by pieces == from_lanes whole: every column once, in order, uint8 shifted back."""
    for k, n, bdt in ((7, 1300, np.uint8), (64, 512, np.int8), (3, 5, np.int8)):
        b = ints(np.random.default_rng(n), bdt, (k, n))
        lanes, _ = qinteger.to_lanes(b)
        pieces = [(c0, c1, t.copy()) for c0, c1, t in qinteger.lanes_tiles(lanes, k, n, bdt == np.uint8)]
        bounds = [(c0, c1) for c0, c1, _ in pieces]  # consecutive, at most 512 wide, the last from n // 128 * 128
        assert bounds[0][0] == 0 and bounds[-1][1] == n and all(p[1] == q[0] for p, q in zip(bounds, bounds[1:]))
        assert all(0 < c1 - c0 <= 512 for c0, c1 in bounds)
        np.testing.assert_array_equal(np.concatenate([t for _, _, t in pieces], axis=1), b.astype(np.float32))
