"""QuantizeLinear, DequantizeLinear (opsets 10-25, com.microsoft 1) and DynamicQuantizeLinear.

Oracle: onnxruntime 1.32 (graph optimizations off), which computes these in float32 exactly as
we do, so every comparison is exact: dequantized floats bit for bit, quantized codes equal.
onnxruntime has no float4e2m1 kernel and no ``output_dtype``/``precision`` support; those cases
use onnx.reference, also exact.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from kernel_util import run_native, run_reference
from quant_util import MS, comparable, onnxpack_node, ort_node

from onnxpack.errors import InvalidArgument, RuntimeFailure
from onnxpack.session.kernels.qdq import dequantize, quantize

SHAPE = (3, 6, 5)


def codes(rng, dtype, shape):
    """Random values of a quantized type covering its whole range (an array even for shape ())."""
    return np.asarray(_codes(rng, np.dtype(dtype), shape))


def _codes(rng, dtype, shape):
    if dtype.name in ("int8", "uint8", "int16", "uint16"):
        info = np.iinfo(dtype)
        return np.asarray(rng.integers(info.min, info.max, shape, endpoint=True)).astype(dtype)
    if dtype.name == "int32":
        return np.asarray(rng.integers(-(2**30), 2**30, shape)).astype(np.int32)  # bias-like, beyond 2**24
    if dtype.name in ("int4", "uint4", "int2", "uint2"):
        info = ml_dtypes.iinfo(dtype)
        return np.asarray(rng.integers(int(info.min), int(info.max), shape, endpoint=True)).astype(np.int8).astype(dtype)
    # small floats: every finite code, NaN excluded
    raw = np.asarray(rng.integers(0, 256, shape)).astype(np.uint8)
    vals = raw.view(dtype) if dtype.name.startswith("float8") else np.asarray(rng.standard_normal(shape) * 2).astype(dtype)
    f = vals.astype(np.float32)
    return np.where(np.isfinite(f), f, 1.0).astype(np.float32).astype(dtype)


def params(rng, dtype, gran, shape, scale_dtype=np.float32, zero_point=True):
    """(scale, zero point or None, attrs) for a granularity: tensor, axis<k>, block<k>."""
    attrs = {}
    if gran == "tensor":
        pshape = ()
    elif gran.startswith("axis"):
        axis = int(gran[4:])
        attrs["axis"] = axis
        pshape = (shape[axis],)
    else:  # block<size> along axis 1
        bs = int(gran[5:])
        attrs.update(axis=1, block_size=bs)
        pshape = tuple(-(-d // bs) if i == 1 else d for i, d in enumerate(shape))
    scale = np.asarray(rng.random(pshape) * 0.1 + 0.01).astype(scale_dtype)
    zp = None
    if zero_point:
        dtype = np.dtype(dtype)
        if dtype.name in ("int32",) or dtype.name.startswith("float"):
            zp = np.zeros(pshape, dtype)
        else:
            zp = codes(rng, dtype, pshape)
    return scale, zp, attrs


OPSET_TYPES = {
    10: ["int8", "uint8", "int32"],
    13: ["int8", "uint8", "int32"],
    19: ["int8", "uint8", "int32", "float8_e4m3fn", "float8_e5m2"],
    21: ["int8", "uint8", "int16", "uint16", "int32", "int4", "uint4", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz"],
    23: ["int8", "uint8", "int16", "uint16", "int4", "uint4", "float8_e5m2"],
    25: ["int2", "uint2", "int8"],
}
GRANS = {10: ["tensor"], 13: ["tensor", "axis1", "axis0"], 19: ["tensor", "axis2"]}
DQ_CASES = [
    (opset, t, g)
    for opset, types in OPSET_TYPES.items()
    for t in types
    for g in GRANS.get(opset, ["tensor", "axis1", "axis-1", "block2", "block4"])
    if not (t == "int32" and g.startswith("block") and opset < 21)
]


def _ml(name):
    return np.dtype(getattr(ml_dtypes, name, None) or name)


@pytest.mark.parametrize("zero_point", [True, False], ids=["zp", "nozp"])
@pytest.mark.parametrize("case", DQ_CASES, ids=[f"op{o}-{t}-{g}" for o, t, g in DQ_CASES])
def test_dequantize_matches_onnxruntime(case, zero_point):
    opset, tname, gran = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    dtype = _ml(tname)
    x = codes(rng, dtype, SHAPE)
    scale, zp, attrs = params(rng, dtype, gran, SHAPE, zero_point=zero_point)
    inputs = [x, scale] + ([zp] if zp is not None else [])
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"][: len(inputs)], ["y"], **attrs)
    (want,) = ort_node(node, inputs, opset)
    (got,) = run_native(node, inputs, opset)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    (sess_out,), sess = onnxpack_node(node, inputs, opset, consts=["s", "z"])
    np.testing.assert_array_equal(sess_out, want)
    assert sess.get_fallback_nodes() == []


REF_CASES = [
    (opset, t, g)
    for opset, types in ((19, ["int8", "uint8", "float8_e4m3fn"]), (21, ["int16", "uint4", "int4", "float8_e5m2"]),
                         (23, ["uint8", "int4"]), (25, ["int2", "uint2", "float4_e2m1fn"]))
    for t in types
    for g in (["tensor", "axis1"] if opset == 19 else ["tensor", "axis-1", "block4"])
]


@pytest.mark.parametrize("case", REF_CASES, ids=[f"op{o}-{t}-{g}" for o, t, g in REF_CASES])
def test_quantize_dequantize_match_reference(case):
    """onnx.reference (opset >= 19 only) computes in float32 too: exact agreement.  Values beyond
    int32 after the division are left out: the reference casts them to int32 before saturating
    (1e9 / scale becomes INT_MIN, then the type's minimum); onnxruntime and we saturate to the
    maximum (tested against onnxruntime above)."""
    opset, tname, gran = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    dtype = _ml(tname)
    x = codes(rng, dtype, SHAPE)
    scale, zp, attrs = params(rng, dtype, gran, SHAPE, zero_point=not tname.startswith("float"))
    inputs = [x, scale] + ([zp] if zp is not None else [])
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"][: len(inputs)], ["y"], **attrs)
    (want,) = run_reference(node, inputs, opset)
    (got,) = run_native(node, inputs, opset)
    np.testing.assert_array_equal(got, want)
    xf = q_input(rng, scale, zp, attrs, dtype, extremes=False)
    zq = zp if zp is not None else np.zeros(scale.shape, dtype)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], **attrs)
    (want,) = run_reference(node, [xf, scale, zq], opset)
    (got,) = run_native(node, [xf, scale, zq], opset)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(comparable(got), comparable(want))


@pytest.mark.parametrize("opset", [19, 21, 23])
def test_dequantize_float16_scale(opset):
    """The output takes the scale's type; computed in float32 and rounded once (onnxruntime)."""
    rng = np.random.default_rng(opset)
    x = codes(rng, np.int8, SHAPE)
    scale, zp, attrs = params(rng, np.int8, "axis1", SHAPE, scale_dtype=np.float16)
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], **attrs)
    (want,) = ort_node(node, [x, scale, zp], opset)
    (got,) = run_native(node, [x, scale, zp], opset)
    assert got.dtype == want.dtype == np.float16
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("out", [TensorProto.FLOAT16, TensorProto.BFLOAT16], ids=["f16", "bf16"])
def test_dequantize_output_dtype_opset23(out):
    """onnxruntime has no output_dtype != scale type kernel: onnx.reference (float32 product,
    one cast) is the oracle."""
    rng = np.random.default_rng(out)
    x = codes(rng, np.uint8, SHAPE)
    scale, zp, attrs = params(rng, np.uint8, "block2", SHAPE)
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], output_dtype=out, **attrs)
    (want,) = run_reference(node, [x, scale, zp], 23)
    (got,) = run_native(node, [x, scale, zp], 23)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(comparable(got), comparable(want))


def test_dequantize_float4_matches_reference():
    rng = np.random.default_rng(4)
    x = codes(rng, ml_dtypes.float4_e2m1fn, SHAPE)
    scale, _, attrs = params(rng, np.uint8, "block4", SHAPE)
    node = helper.make_node("DequantizeLinear", ["x", "s"], ["y"], **attrs)
    (want,) = run_reference(node, [x, scale], 25)
    (got,) = run_native(node, [x, scale], 25)
    np.testing.assert_array_equal(got, want)


def test_com_microsoft_dequantize_int16():
    rng = np.random.default_rng(5)
    x = codes(rng, np.int16, SHAPE)
    scale, zp, attrs = params(rng, np.int16, "axis1", SHAPE)
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], domain=MS, **attrs)
    (want,) = ort_node(node, [x, scale, zp], 17)
    (got,) = run_native(node, [x, scale, zp], 1)
    np.testing.assert_array_equal(got, want)


# -- QuantizeLinear ---------------------------------------------------------------------------------

Q_TYPES = {
    10: ["uint8", "int8"],
    13: ["uint8", "int8"],
    19: ["uint8", "int8", "float8_e4m3fn", "float8_e5m2"],
    21: ["uint8", "int8", "int16", "uint16", "int4", "uint4", "float8_e4m3fnuz", "float8_e5m2fnuz"],
    23: ["uint8", "int8", "int16", "uint4", "float8_e4m3fn"],
}
Q_CASES = [
    (opset, t, g) for opset, types in Q_TYPES.items() for t in types
    for g in GRANS.get(opset, ["tensor", "axis1", "axis-1", "block2", "block4"])
]


def q_input(rng, scale, zp, attrs, dtype, shape=SHAPE, x_dtype=np.float32, extremes=True):
    """Floats that hit exact .5 ties of x / scale; with ``extremes``, values far out of range
    (beyond int32 after the division) and +-inf."""
    s = np.broadcast_to(_expand(scale, attrs, shape), shape).astype(np.float32)
    k = rng.integers(-300, 300, shape).astype(np.float32)
    x = (k + np.where(rng.random(shape) < 0.3, 0.5, rng.random(shape))) * s
    x = x.astype(x_dtype)
    if not extremes:
        return x
    flat = x.reshape(-1)
    big = 6e4 if x_dtype == np.float16 else 1e9
    flat[:3] = [big, -big, 0.0]
    if x_dtype == np.float32:
        flat[3:5] = [np.inf, -np.inf]
    return x


def _expand(scale, attrs, shape):
    if scale.ndim == 0:
        return scale
    axis = attrs.get("axis", 1) % len(shape)
    if "block_size" in attrs:
        return np.repeat(scale, attrs["block_size"], axis=axis).take(range(shape[axis]), axis=axis)
    return scale.reshape([-1 if i == axis else 1 for i in range(len(shape))])


@pytest.mark.parametrize("case", Q_CASES, ids=[f"op{o}-{t}-{g}" for o, t, g in Q_CASES])
def test_quantize_matches_onnxruntime(case):
    opset, tname, gran = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    dtype = _ml(tname)
    scale, zp, attrs = params(rng, dtype, gran, SHAPE)
    x = q_input(rng, scale, zp, attrs, dtype)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], **attrs)
    ml = [0] if dtype.kind == "V" or tname.startswith("float8") else []
    (want,) = ort_node(node, [x, scale, zp], opset, ml_outputs=ml)
    (got,) = run_native(node, [x, scale, zp], opset)
    assert got.dtype == dtype
    np.testing.assert_array_equal(comparable(got), want)
    (sess_out,), sess = onnxpack_node(node, [x, scale, zp], opset, consts=["s", "z"])
    np.testing.assert_array_equal(comparable(sess_out), want)
    assert sess.get_fallback_nodes() == []


@pytest.mark.parametrize("tname", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_quantize_float8_without_saturation(tname):
    """saturate=0: out-of-range values become NaN (e4m3fn, fnuz) or Inf (e5m2)."""
    rng = np.random.default_rng(7)
    dtype = _ml(tname)
    scale, zp, attrs = params(rng, dtype, "tensor", SHAPE)
    x = q_input(rng, scale, zp, attrs, dtype)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], saturate=0)
    (want,) = ort_node(node, [x, scale, zp], 21, ml_outputs=[0])
    (got,) = run_native(node, [x, scale, zp], 21)
    np.testing.assert_array_equal(comparable(got), want)  # NaNs compare equal here
    assert np.isnan(want).any() or np.isinf(want).any()


def test_quantize_float16_input():
    rng = np.random.default_rng(8)
    scale, zp, attrs = params(rng, np.int8, "axis1", SHAPE, scale_dtype=np.float16)
    x = q_input(rng, scale, zp, attrs, np.int8, x_dtype=np.float16)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], **attrs)
    (want,) = ort_node(node, [x, scale, zp], 19)
    (got,) = run_native(node, [x, scale, zp], 19)
    np.testing.assert_array_equal(got, want)


def test_quantize_nan_saturates_to_the_lowest_code():
    x = np.array([np.nan, 1.0, -np.nan], np.float32)
    for zp in (np.array(7, np.uint8), np.array(-3, np.int8)):
        node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
        (want,) = ort_node(node, [x, np.array(0.5, np.float32), zp], 13)
        (got,) = run_native(node, [x, np.array(0.5, np.float32), zp], 13)
        np.testing.assert_array_equal(got, want)
        assert got[0] == np.iinfo(zp.dtype).min


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=["u8", "s8"])
def test_quantize_numba_pass_gives_the_numpy_codes_and_onnxruntimes(dtype, monkeypatch):
    """A per-tensor 8-bit QuantizeLinear of a float32 tensor of at least _QUANTIZE_JIT_MIN
    elements takes one numba pass (``_qdq_jit.quantize_8bit``): the numpy path's codes at random
    scales over six decades, ties (x.5 steps), NaN / inf / -0, 3e38, with and without a zero point,
    a zero scale (inf and NaN quotients: saturated, NaN to the lowest code); and onnxruntime's."""
    from onnxpack.session.kernels import _act
    from onnxpack.session.kernels import qdq as qdq_mod

    if _act.jit() is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(21)
    info = np.iinfo(dtype)
    n = 2 * qdq_mod._QUANTIZE_JIT_MIN + 3
    for trial in range(24):
        scale = np.array(np.float32(10 ** rng.uniform(-4, 2)) if trial != 5 else np.float32(0), np.float32)
        x = (rng.standard_normal(n) * float(scale) * 10 ** rng.uniform(0, 3)).astype(np.float32)
        x[:40] = (np.arange(40, dtype=np.float32) - 20.5) * scale  # ties
        x[40:47] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 3e38, -3e38]
        zp = None if trial % 3 == 0 else np.array(rng.integers(info.min, info.max + 1), dtype)
        out = dtype if zp is None else None
        got = quantize(x, scale, zp, out_dtype=out)
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
        want = quantize(x, scale, zp, out_dtype=out)
        monkeypatch.delenv("ONNXPACK_DISABLE_JIT")
        assert got.dtype == want.dtype == dtype
        np.testing.assert_array_equal(got, want)
        if zp is not None and trial % 4 == 1:
            node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
            (ref,) = ort_node(node, [x, scale, zp], 13)
            np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("out", [TensorProto.INT8, TensorProto.UINT4], ids=["int8", "uint4"])
def test_quantize_output_dtype_without_zero_point(out):
    rng = np.random.default_rng(9)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    node = helper.make_node("QuantizeLinear", ["x", "s"], ["y"], output_dtype=out)
    ml = [0] if out == TensorProto.UINT4 else []
    (want,) = ort_node(node, [x, np.array(0.05, np.float32)], 21, ml_outputs=ml)
    (got,) = run_native(node, [x, np.array(0.05, np.float32)], 21)
    assert got.dtype == helper.tensor_dtype_to_np_dtype(out)
    np.testing.assert_array_equal(comparable(got), want)


def test_quantize_precision_attribute_matches_reference():
    """opset 23's ``precision``: the division in float16 (onnxruntime has no kernel for it)."""
    rng = np.random.default_rng(10)
    x = (rng.standard_normal(SHAPE) * 3).astype(np.float32)
    s = np.array(0.0137, np.float32)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], precision=TensorProto.FLOAT16)
    z = np.array(3, np.int8)
    (want,) = run_reference(node, [x, s, z], 23)
    (got,) = run_native(node, [x, s, z], 23)
    np.testing.assert_array_equal(got, want)


def test_com_microsoft_quantize_uint16():
    rng = np.random.default_rng(11)
    scale, zp, attrs = params(rng, np.uint16, "axis1", SHAPE)
    x = q_input(rng, scale, zp, attrs, np.uint16) * 100
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], domain=MS, **attrs)
    (want,) = ort_node(node, [x, scale, zp], 17)
    (got,) = run_native(node, [x, scale, zp], 1)
    np.testing.assert_array_equal(got, want)


def test_roundtrip_helpers_blocked_with_short_last_block():
    """dequantize(quantize(x)) is within half a step of x; block 4 over 6 leaves a block of 2."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 6, 3)).astype(np.float32)
    scale = np.stack([np.abs(x[:, :4]).max(1), np.abs(x[:, 4:]).max(1)], axis=1) / 127
    q = quantize(x, scale, np.zeros_like(scale, dtype=np.int8), axis=1, block_size=4)
    back = dequantize(q, scale, None, axis=1, block_size=4)
    step = np.repeat(scale, 4, axis=1)[:, :6]
    assert q.dtype == np.int8 and back.dtype == np.float32
    assert (np.abs(back - x) <= step / 2 + 1e-7).all()


@pytest.mark.parametrize(
    "op,scale_shape,attrs,match",
    [
        ("DequantizeLinear", (5,), {"axis": 1}, "per-axis"),
        ("DequantizeLinear", (3, 2, 5), {"axis": 1, "block_size": 2}, "blocked"),
        ("QuantizeLinear", (6,), {"axis": 4}, "out of range"),
    ],
    ids=["axis-length", "block-shape", "axis-range"],
)
def test_bad_scale_shapes_raise_invalid_argument(op, scale_shape, attrs, match):
    x = np.zeros(SHAPE, np.int8 if op == "DequantizeLinear" else np.float32)
    node = helper.make_node(op, ["x", "s"], ["y"], name="q0", **attrs)
    with pytest.raises(InvalidArgument, match=match):
        run_native(node, [x, np.ones(scale_shape, np.float32)], 21)
    with pytest.raises((InvalidArgument, RuntimeFailure), match="q0"):
        onnxpack_node(node, [x, np.ones(scale_shape, np.float32)], 21)[0]


# -- DynamicQuantizeLinear ------------------------------------------------------------------------------

DQL_INPUTS = {
    "random": lambda r: r.standard_normal((4, 33)).astype(np.float32),
    "positive": lambda r: (r.random((2, 17)) + 0.25).astype(np.float32),
    "negative": lambda r: -(r.random((2, 17)) * 3 + 0.1).astype(np.float32),
    "zeros": lambda r: np.zeros((3, 5), np.float32),
    "constant": lambda r: np.full((7,), 2.5, np.float32),
    "ties": lambda r: (np.arange(-20, 236, dtype=np.float32) * (10.0 / 255) + 5.0 / 255).reshape(16, 16),
    "wide": lambda r: (r.standard_normal((64, 64)) * 1e4).astype(np.float32),
    # From 4,096 elements the quantization runs as one JIT pass (with numba): the same codes.
    "ties-large": lambda r: np.tile(np.arange(-20, 236, dtype=np.float32) * (10.0 / 255) + 5.0 / 255, 40).reshape(40, 256),
    "random-large": lambda r: (r.standard_normal((3, 64, 100)) * 2.5 + 0.7).astype(np.float32),
    # A NaN is left out of the min and max (onnxruntime's kernels drop it, here where its scalar
    # loop reads it: fewer than 16 values, or past the last 16) and quantizes to code 0; before,
    # the scale was NaN and every code 0.
    "nan-short": lambda r: np.array([0.5, np.nan, -1.0, 2.0, 0.25, np.nan, -0.125], np.float32),
    "nan-tail": lambda r: np.concatenate([r.standard_normal(64), [np.nan, 1.5, -3.0]]).astype(np.float32),
    "all-nan": lambda r: np.full((5,), np.nan, np.float32),
}


@pytest.mark.parametrize("name", list(DQL_INPUTS), ids=list(DQL_INPUTS))
def test_dynamic_quantize_linear_matches_onnxruntime(name):
    x = DQL_INPUTS[name](np.random.default_rng(13))
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    want = ort_node(node, [x], 11)
    got = run_native(node, [x], 11)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)
    sess_out, sess = onnxpack_node(node, [x], 11)
    for g, w in zip(sess_out, want):
        np.testing.assert_array_equal(g, w)
    assert sess.get_fallback_nodes() == []
