"""Native elementwise kernels against onnx.reference (the oracle), op by op.

Tolerances: integer and bool outputs exact; float64 rtol 1e-12; float32 rtol 1e-6 / atol 1e-7;
float16 rtol 2e-3 / atol 2e-3 (a few half-precision ulps: our float16 transcendental kernels
compute in float32 and round once, onnx.reference rounds at every step).  Output dtypes and
shapes must match exactly.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from onnx import TensorProto

from kernel_util import assert_outputs_match, make_node, run_native, run_ort, run_reference

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import lookup
from onnxpack.session.kernels import elementwise

OPSET = 21
TOL = {
    np.dtype(np.float64): dict(rtol=1e-12, atol=1e-14),
    np.dtype(np.float32): dict(rtol=1e-6, atol=1e-7),
    np.dtype(np.float16): dict(rtol=2e-3, atol=2e-3),
}


def check(node, inputs, opset=OPSET, tol=None):
    got = run_native(node, inputs, opset)
    assert_outputs_match(got, run_reference(node, inputs, opset), lambda dt: tol or TOL[dt], equal_nan=True)
    return got


rng = np.random.default_rng(0)


def rand(shape, dtype, lo=-3.0, hi=3.0):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if dtype.kind in "iu":
        lo = max(lo, np.iinfo(dtype).min)
        return rng.integers(int(lo), int(hi) + 1, size=shape).astype(dtype)
    return rng.uniform(lo, hi, size=shape).astype(dtype)


FLOATS = [np.float32, np.float16, np.float64]

# op, input range (domain of the function), dtypes
UNARY = [
    ("Neg", (-3, 3), FLOATS + [np.int32, np.int64]),
    ("Abs", (-3, 3), FLOATS + [np.int8, np.int64]),
    ("Sqrt", (0.01, 4), FLOATS),
    ("Exp", (-5, 5), FLOATS),
    ("Log", (0.01, 5), FLOATS),
    ("Reciprocal", (0.5, 4), FLOATS),
    ("Floor", (-3, 3), FLOATS),
    ("Ceil", (-3, 3), FLOATS),
    ("Round", (-3, 3), FLOATS),
    ("Sign", (-3, 3), FLOATS + [np.int32]),
    ("Relu", (-3, 3), FLOATS + [np.int32, np.int8]),
    ("Sigmoid", (-30, 30), FLOATS),
    ("Tanh", (-4, 4), FLOATS),
    ("Erf", (-4, 4), FLOATS),
    ("Softplus", (-20, 20), FLOATS),
    ("Softsign", (-5, 5), FLOATS),
    ("Sin", (-5, 5), FLOATS),
    ("Cos", (-5, 5), FLOATS),
    ("Tan", (-1, 1), [np.float32]),
    ("Asin", (-0.9, 0.9), [np.float32]),
    ("Acos", (-0.9, 0.9), [np.float32]),
    ("Atan", (-3, 3), [np.float32]),
    ("Sinh", (-3, 3), [np.float32]),
    ("Cosh", (-3, 3), [np.float32]),
    ("Asinh", (-3, 3), [np.float32]),
    ("Acosh", (1.1, 3), [np.float32]),
    ("Atanh", (-0.9, 0.9), [np.float32]),
    ("IsNaN", (-3, 3), [np.float32, np.float16]),
    ("HardSwish", (-5, 5), [np.float32]),
    ("Mish", (-5, 5), [np.float32]),
]


@pytest.mark.parametrize(
    "op,rng_,dtype",
    [(op, r, d) for op, r, ds in UNARY for d in ds],
    ids=[f"{op}-{np.dtype(d).name}" for op, _, ds in UNARY for d in ds],
)
def test_unary(op, rng_, dtype):
    x = rand((3, 4, 5), dtype, *rng_)
    if op == "IsNaN":
        x.reshape(-1)[::7] = np.nan
    if op == "Round":
        x.reshape(-1)[:6] = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5], dtype=dtype)
    # onnx.reference evaluates Erf in float32 even for float64 input.
    tol = TOL[np.dtype(np.float32)] if (op, np.dtype(dtype)) == ("Erf", np.float64) else None
    check(make_node(op, ["x"], ["y"]), [x], opset=OPSET, tol=tol)


@pytest.mark.parametrize("op", ["Relu", "Sigmoid", "Exp", "Abs", "Neg"], ids=str)
def test_unary_empty_and_scalar(op):
    for x in (np.zeros((0, 3), np.float32), np.array(0.7, np.float32)):
        (y,) = check(make_node(op, ["x"], ["y"]), [x])
        assert y.shape == x.shape


def test_not_bitwise_not():
    check(make_node("Not", ["x"], ["y"]), [rand((4, 5), np.bool_)])
    check(make_node("BitwiseNot", ["x"], ["y"]), [rand((4, 5), np.int32, -50, 50)], opset=18)
    check(make_node("BitwiseNot", ["x"], ["y"]), [rand((4, 5), np.uint8, 0, 255)], opset=18)


BROADCAST = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 5)), ((1,), (2, 3)), ((), (2, 2)), ((0, 3), (1, 3))]
ARITH = ["Add", "Sub", "Mul", "Div"]


@pytest.mark.parametrize("shapes", BROADCAST, ids=[f"{a}x{b}" for a, b in BROADCAST])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32, np.int64, np.uint8], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ARITH)
def test_arithmetic(op, dtype, shapes):
    a = rand(shapes[0], dtype, 0 if np.dtype(dtype).kind == "u" else -20, 20)
    b = rand(shapes[1], dtype, 1, 9)
    if np.dtype(dtype).kind == "i" and b.size:
        b.reshape(-1)[::2] *= -1  # negative divisors exercise C truncation
    check(make_node(op, ["a", "b"], ["y"]), [a, b])


def test_integer_div_truncates_like_c():
    a = np.array([7, -7, 7, -7, 6, -6], np.int32)
    b = np.array([2, 2, -2, -2, 3, 3], np.int32)
    (y,) = check(make_node("Div", ["a", "b"], ["y"]), [a, b])
    assert y.tolist() == [3, -3, -3, 3, 2, -2]


@pytest.mark.parametrize(
    "a_dtype,b_dtype,b_val",
    [
        (np.float32, np.float32, None),
        (np.float32, np.float32, 2.0),
        (np.float16, np.float16, 2.0),
        (np.float32, np.int64, 3),
        (np.float16, np.float32, 0.5),
        (np.int32, np.int32, 2),
        (np.int64, np.float32, 2.0),
    ],
    ids=["f32", "f32-sq", "f16-sq", "f32^i64", "f16^f32", "i32^i32", "i64^f32"],
)
def test_pow(a_dtype, b_dtype, b_val):
    a = rand((3, 4), a_dtype, 1, 4)
    b = rand((4,), b_dtype, 0.5, 2) if b_val is None else np.array(b_val, dtype=b_dtype)
    (y,) = check(make_node("Pow", ["a", "b"], ["y"]), [a, b])
    assert y.dtype == a.dtype


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32], ids=lambda d: np.dtype(d).name)
def test_mod(fmod, dtype):
    if np.dtype(dtype).kind == "f" and fmod == 0:
        pytest.skip("float Mod requires fmod=1")
    a = rand((4, 5), dtype, -20, 20)
    b = rand((5,), dtype, 1, 6)
    b[::2] *= -1
    check(make_node("Mod", ["a", "b"], ["y"], fmod=fmod), [a, b])


CMP = ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"]


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", CMP)
def test_compare(op, dtype):
    a = rand((3, 4), dtype, -2, 2).round()
    b = rand((4,), dtype, -2, 2).round()
    (y,) = check(make_node(op, ["a", "b"], ["y"]), [a.astype(dtype), b.astype(dtype)])
    assert y.dtype == np.bool_


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op):
    check(make_node(op, ["a", "b"], ["y"]), [rand((3, 4), np.bool_), rand((1, 4), np.bool_)])


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
def test_bitwise(op):
    check(make_node(op, ["a", "b"], ["y"]), [rand((3, 4), np.int32, -99, 99), rand((4,), np.int32, -99, 99)], opset=18)


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.uint64], ids=lambda d: np.dtype(d).name)
def test_bitshift(direction, dtype):
    bits = np.dtype(dtype).itemsize * 8
    a = rand((3, 6), dtype, 0, 200)
    b = np.array([0, 1, 3, bits - 1, bits, bits + 5], dtype=dtype)
    check(make_node("BitShift", ["a", "b"], ["y"], direction=direction), [a, b])


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64], ids=lambda d: np.dtype(d).name)
def test_bitshift_signed_out_of_range_amounts(direction, dtype):
    # Regression: a negative amount was clamped to 0 ("no shift") instead of giving the fill.
    bits = np.dtype(dtype).itemsize * 8
    a = np.array([-16, 8, -1, 5, -128, 127], dtype=dtype)
    b = np.array([-1, -3, 2, bits, bits + 1, -bits], dtype=dtype)
    (y,) = check(make_node("BitShift", ["a", "b"], ["y"], direction=direction), [a, b])
    if direction == "RIGHT":
        assert y[:2].tolist() == [-1, 0]  # the sign fill, as the conformance suite expects


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32], ids=lambda d: np.dtype(d).name)
def test_variadic(op, n, dtype):
    if op == "Mean" and np.dtype(dtype).kind != "f":
        pytest.skip("Mean is float-only")
    # onnx.reference's Mean accumulates in place, so it cannot grow the rank: (3, 1) for it.
    shapes = [(3, 4), (4,), (3, 1) if op == "Mean" else (2, 1, 4)][:n]
    xs = [rand(s, dtype) for s in shapes]
    names = [f"x{i}" for i in range(n)]
    check(make_node(op, names, ["y"]), xs)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16], ids=lambda d: np.dtype(d).name)
def test_where(dtype):
    c = rand((3, 1), np.bool_)
    check(make_node("Where", ["c", "x", "y"], ["z"]), [c, rand((3, 4), dtype), rand((4,), dtype)])


ACTIVATIONS = [
    ("LeakyRelu", {}),
    ("LeakyRelu", {"alpha": 0.2}),
    ("HardSigmoid", {}),
    ("HardSigmoid", {"alpha": 0.5, "beta": 0.1}),
    ("Elu", {}),
    ("Elu", {"alpha": 0.3}),
    ("Selu", {}),
    ("Selu", {"alpha": 1.5, "gamma": 2.0}),
    ("Celu", {"alpha": 0.7}),
    ("ThresholdedRelu", {"alpha": 0.5}),
    ("Gelu", {}),
    ("Gelu", {"approximate": "tanh"}),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(
    "op,attrs", ACTIVATIONS, ids=[f"{op}-{'-'.join(f'{k}={v}' for k, v in a.items()) or 'default'}" for op, a in ACTIVATIONS]
)
def test_activation(op, attrs, dtype):
    x = rand((2, 3, 7), dtype, -4, 4)
    check(make_node(op, ["x"], ["y"], **attrs), [x])


@pytest.mark.parametrize("shape", [(2, 3, 7), (8, 1024), ()], ids=["small", "jit-size", "0d"])
@pytest.mark.parametrize("alpha", [1.0, 1.702, 0.5])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: np.dtype(d).name)
def test_swish_opset24(shape, alpha, dtype):
    """Swish (opset 24): x * sigmoid(alpha * x); alpha 1 on a large float32 tensor is the JIT's SiLU."""
    x = rand(shape, dtype, -8, 8)
    check(make_node("Swish", ["x"], ["y"], alpha=alpha), [x], opset=24)


def test_swish_takes_floats_only_and_does_not_warn():
    """An integer X is refused (onnxruntime refuses the model; the op is typed float); inf and NaN
    give the arithmetic's result without a numpy warning."""
    with pytest.raises(InvalidArgument, match="Swish"):
        run_native(make_node("Swish", ["x"], ["y"], alpha=float("nan")), [np.arange(3)], 24)
    x = np.array([-np.inf, 1.0, np.nan, np.inf], np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (y,) = run_native(make_node("Swish", ["x"], ["y"]), [x], 24)
    assert np.isnan(y[[0, 2]]).all() and y[3] == np.inf


@pytest.mark.parametrize("slope_shape", [(1,), (4, 1, 1), (5,)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_prelu(slope_shape, dtype):
    check(make_node("PRelu", ["x", "s"], ["y"]), [rand((2, 4, 3, 5), dtype), rand(slope_shape, dtype, 0, 1)])


@pytest.mark.parametrize("opset", [6, 9, 16])
@pytest.mark.parametrize("x_shape", [(2, 3, 4), (2, 3, 4, 5)], ids=str)
def test_prelu_channel_slope_legacy_broadcast(x_shape, opset):
    # Regression: pytorch-exported models give slope (C,) for x (N, C, ...); numpy's trailing
    # rule does not broadcast it, onnx.reference (and onnxruntime) lay it along the C axis.
    x = rand(x_shape, np.float32)
    (y,) = check(make_node("PRelu", ["x", "s"], ["y"]), [x, np.array([0.1, 0.2, 0.3], np.float32)], opset=opset)
    np.testing.assert_allclose(y[:, 1], np.where(x[:, 1] < 0, 0.2 * x[:, 1], x[:, 1]), rtol=1e-6)


def test_prelu_ambiguous_slope_still_fails():
    x = rand((3, 3, 4), np.float32)  # a (3,) slope matches two axes: no guess
    with pytest.raises(ValueError):
        run_native(make_node("PRelu", ["x", "s"], ["y"]), [x, np.ones(3, np.float32)], OPSET)


@pytest.mark.parametrize("neg,pos", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_isinf(neg, pos):
    x = np.array([1.0, np.inf, -np.inf, np.nan, 0.0], np.float32)
    check(make_node("IsInf", ["x"], ["y"], detect_negative=neg, detect_positive=pos), [x])


def test_erf_without_scipy_matches_math_erf():
    x = np.concatenate([np.linspace(-6, 6, 2001), [0.0, 1e-8, -1e-8, 0.4999, 0.5, 0.5001]])
    want = np.array([math.erf(v) for v in x])
    got = elementwise.erf_numpy(x)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-30)


# --- Clip ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bounds", [(None, None), (-1, None), (None, 1), (-1, 1), (2, 1)], ids=str)
def test_clip_inputs(bounds, dtype):
    lo, hi = bounds
    names = ["x", "" if lo is None else "lo", "" if hi is None else "hi"]
    while names and names[-1] == "":
        names.pop()
    inputs = [rand((3, 5), dtype)]
    if len(names) > 1:
        inputs.append(None if lo is None else np.array(lo, dtype))
    if len(names) > 2:
        inputs.append(np.array(hi, dtype))
    check(make_node("Clip", names, ["y"]), inputs, opset=13)


@pytest.mark.parametrize("bounds", [(-1.0, None), (-1.0, 1.0), (None, 1.0)], ids=str)
@pytest.mark.parametrize("value", [-3.0, 0.25, 7.0], ids=str)
def test_clip_zero_dim_input(value, bounds):
    # Regression: np.maximum of 0-d arrays is a numpy scalar, which cannot be an out= target
    # (DynamicQuantizeLinear's function body clips a 0-d scale).
    lo, hi = bounds
    names = ["x", "" if lo is None else "lo", "hi" if hi is not None else ""]
    inputs = [np.array(value, np.float32), None if lo is None else np.array(lo, np.float32)]
    if hi is None:
        names, inputs = names[:2], inputs[:2]
    else:
        inputs.append(np.array(hi, np.float32))
    (y,) = check(make_node("Clip", names, ["y"]), inputs, opset=13)
    assert y.shape == ()


@pytest.mark.parametrize("attrs", [{}, {"min": -0.5}, {"max": 0.5}, {"min": -1.0, "max": 1.5}], ids=str)
def test_clip_attributes_opset6(attrs):
    check(make_node("Clip", ["x"], ["y"], **attrs), [rand((3, 5), np.float32)], opset=6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bounds", [(None, None), (-1, None), (None, 1)], ids=str)
def test_clip_missing_bound_is_the_largest_finite_value(bounds, dtype):
    """A missing Clip bound is the type's largest finite value (the spec's default,
    onnxruntime's; onnx.reference leaves the infinities): +-inf become +-max, NaN stays;
    standalone and as a MatMul's epilogue."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    import onnxpack

    lo, hi = bounds
    x = np.array([[np.inf, -np.inf, np.nan, 0.5, -3.0, 7.0]], dtype)
    names = ["x", "" if lo is None else "lo", "" if hi is None else "hi"]
    while names[-1] == "":
        names.pop()
    inputs = ([x] + [None if v is None else np.array(v, dtype) for v in bounds])[: len(names)]
    node = make_node("Clip", names, ["y"])
    # (onnx.reference leaves the infinities: np.clip without that bound)
    np.testing.assert_array_equal(run_native(node, inputs, 13)[0], run_ort(node, inputs, 13, optimize=False)[0])
    if dtype == np.float32:  # (an epilogue of a packed MatMul: float32 sums)
        inits = [numpy_helper.from_array(np.eye(6, dtype=np.float32), "w")] + [
            numpy_helper.from_array(np.array(v, np.float32), n) for v, n in zip(bounds, ("lo", "hi")) if v is not None]
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Clip", ["m"] + names[1:], ["y"])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
        xm = np.array([[1e38, -1e38, 0.5, 2.0, -3.0, 7.0]], np.float32) * np.float32(10)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        want = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, {"x": xm})[0]
        np.testing.assert_array_equal(onnxpack.InferenceSession(model).run(None, {"x": xm})[0], want)


# --- Cast ------------------------------------------------------------------------------------
CAST_TYPES = {
    "float": (TensorProto.FLOAT, np.float32),
    "float16": (TensorProto.FLOAT16, np.float16),
    "double": (TensorProto.DOUBLE, np.float64),
    "int8": (TensorProto.INT8, np.int8),
    "int32": (TensorProto.INT32, np.int32),
    "int64": (TensorProto.INT64, np.int64),
    "uint8": (TensorProto.UINT8, np.uint8),
    "bool": (TensorProto.BOOL, np.bool_),
}


@pytest.mark.parametrize("src", list(CAST_TYPES))
@pytest.mark.parametrize("dst", list(CAST_TYPES))
def test_cast(src, dst):
    dtype = CAST_TYPES[src][1]
    x = rand((4, 5), dtype, 0, 100)
    if np.dtype(dtype).kind == "f":
        x = (x * 1.37).astype(dtype)
        x.reshape(-1)[:3] = [0, 0.5, 1.0]
    (y,) = check(make_node("Cast", ["x"], ["y"], to=CAST_TYPES[dst][0]), [x], opset=19)
    assert y.dtype == CAST_TYPES[dst][1]


def test_cast_bfloat16_and_castlike():
    x = rand((3, 4), np.float32)
    check(make_node("Cast", ["x"], ["y"], to=TensorProto.BFLOAT16), [x], opset=19)
    check(make_node("CastLike", ["x", "t"], ["y"]), [x, np.zeros(1, np.float16)], opset=19)


@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("src", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("target", ["float8_e5m2", "float8_e4m3fn"])
def test_castlike_float8_saturates(target, src, saturate):
    # Regression: ml_dtypes' float8 dtypes have kind "f", so they took the plain astype path,
    # which overflows to inf where the spec (saturate=1) clamps to the largest finite value.
    import ml_dtypes

    like = np.zeros(1, getattr(ml_dtypes, target))
    x = np.array([0.4, 1e4, -1e4, 1e6, np.inf, -np.inf, np.nan], np.float32).astype(src)
    node = make_node("CastLike", ["x", "t"], ["y"], saturate=saturate)
    (got,) = run_native(node, [x, like], 19)
    (want,) = run_reference(node, [x, like], 19)
    assert got.dtype == like.dtype
    np.testing.assert_array_equal(got.astype(np.float32), np.asarray(want).astype(np.float32))
    if saturate and target == "float8_e5m2":
        assert got.astype(np.float32)[3] == 57344.0


def test_cast_to_string_falls_back():
    cls = lookup("", "Cast", 19)
    from onnxpack.session.kernels import KernelContext

    with pytest.raises(NotImplementedError):
        cls(make_node("Cast", ["x"], ["y"], to=TensorProto.STRING), KernelContext(19, {"": 19}))
    with pytest.raises(NotImplementedError):
        cls(make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E4M3FN), KernelContext(19, {"": 19}))


@pytest.mark.parametrize("op", ["Sum", "Max", "Min", "Mean"])
def test_variadic_of_three_scalars(op):
    """Three or more rank-0 operands (a numpy scalar from the first pair has no out= target)."""
    ins = [np.array(v, np.float32) for v in (1.0, 2.5, -3.0)]
    node = make_node(op, ["a", "b", "c"], ["y"])
    (got,) = run_native(node, ins, 13)
    np.testing.assert_array_equal(got, run_ort(node, ins, 13, optimize=False)[0])
    assert isinstance(got, np.ndarray) and got.shape == ()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_pow_integer_base_to_negative_integer_powers(dtype):
    """numpy refuses an integer to a negative integer power; onnxruntime gives the C++ integer
    result: 1 for base 1, +-1 for base -1 by the exponent's parity, 0 for the others."""
    a = np.array([2, 1, -1, -1, 3, 5, 0, -7], dtype)
    b = np.array([-1, -3, -3, -2, 2, -2, 3, 1], dtype)
    node = make_node("Pow", ["a", "b"], ["y"])
    (got,) = run_native(node, [a, b], 15)
    np.testing.assert_array_equal(got, run_ort(node, [a, b], 15, optimize=False)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("exponent", [3.0, 3, 4.0, 5.0, -1.0, -2.0, -3.0, 0.0, 1.0, 31.0],
                         ids=lambda e: f"{type(e).__name__}{e}")
def test_pow_integer_exponent_of_negative_bases(dtype, exponent):
    """A scalar integer exponent over bases of both signs (and zeros, infinities, NaN): 3 is
    multiplied out, onnxruntime's bits (its Pow multiplies for 2 and 3, the tanh GELU's cube);
    any other within 2 ulp of onnxruntime's pow and of the float64 result, the sign of an odd
    power from the base.  numpy's pow of a negative float32 base took 50-100x the time of a
    positive one (a GELU's cube made a T5 encoder 8x onnxruntime's time)."""
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(4096) * 3).astype(dtype)
    a[:10] = [0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 1.0, -2.0, 1e-30, -1e-30]
    b = np.array(exponent, dtype if isinstance(exponent, float) else np.int64)
    node = make_node("Pow", ["a", "b"], ["y"])
    (got,) = run_native(node, [a, b], 15)
    (want,) = run_ort(node, [a, b], 15, optimize=False)
    assert got.dtype == want.dtype == dtype
    if exponent == 3:
        np.testing.assert_array_equal(got, want)
        return
    finite = np.isfinite(want) & (want != 0)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])  # zeros, inf: signs too
    exact = np.power(a.astype(np.float64), float(exponent)) if dtype == np.float32 else want
    ulp = np.spacing(np.abs(want[finite]).astype(dtype))
    assert np.all(np.abs(got[finite] - want[finite]) <= 2 * ulp)
    assert np.all(np.abs(got[finite] - exact[finite]) <= 2 * ulp)
    assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


# --- Identity / Dropout ----------------------------------------------------------------------
def test_identity_returns_input():
    x = rand((2, 3), np.float32)
    (y,) = check(make_node("Identity", ["x"], ["y"]), [x])
    assert y is x


@pytest.mark.parametrize(
    "opset,outputs,extra",
    [(7, ["y"], []), (10, ["y", "m"], []), (13, ["y", "m"], []), (13, ["y"], [np.array(0.3, np.float32)]),
     (13, ["y", "m"], [np.array(0.3, np.float32), np.array(False)])],
    ids=["7", "10-mask", "13-mask", "13-ratio", "13-training-off"],
)
def test_dropout_inference(opset, outputs, extra):
    """Identity; the inference mask is all True from opset 12 and all False / zeros before, as
    onnxruntime returns it (onnx.reference's opset-7/10 mask is ones: the oracle there is
    onnxruntime)."""
    x = rand((3, 4), np.float32)
    names = ["x", "r", "t"][: 1 + len(extra)]
    node = make_node("Dropout", names, outputs)
    if opset >= 12:
        check(node, [x, *extra], opset=opset)
    for o in (7, 10) if opset == 10 else ():
        legacy = make_node("Dropout", ["x"], ["y", "m"])
        got, want = run_native(legacy, [x], o), run_ort(legacy, [x], o, optimize=False)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
        assert not got[1].any()
    if opset == 7:
        np.testing.assert_array_equal(run_native(node, [x], 7)[0], x)


# --- registry --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "op,opset,cls",
    [("Clip", 6, elementwise.Clip1), ("Clip", 10, elementwise.Clip1), ("Clip", 11, elementwise.Clip11),
     ("Clip", 21, elementwise.Clip11), ("Gelu", 20, elementwise.Gelu), ("Mod", 13, elementwise.Mod)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_registry_picks_version(op, opset, cls):
    assert lookup("", op, opset) is cls
    assert lookup("ai.onnx", op, opset) is cls


def test_registry_generated_classes_carry_since():
    assert lookup("", "Erf", 13).since == 9
    assert lookup("", "Add", 14).op_type == "Add"


def test_registry_absent_before_introduction():
    assert lookup("", "Gelu", 19) is None
    assert lookup("", "Mod", 9) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_a_run_warns_of_no_ieee_overflow_or_nan_as_onnxruntime(threads):
    """IEEE arithmetic that overflows or makes NaN (a causal mask of float32's lowest value added
    to a padding mask of it: HF GPT-Neo's attention) gives onnxruntime's -inf / NaN without a
    numpy RuntimeWarning: in a run (a large tensor's Mul too, which a two-thread run may split),
    in a constant folded at creation."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    import onnxpack

    lo = np.finfo(np.float32).min
    big = np.full((256, 512), 3e38, np.float32)
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]),  # lowest + lowest: -inf
             helper.make_node("Sub", ["s", "s"], ["nan"]),  # -inf - -inf: NaN
             helper.make_node("Mul", ["x", "k"], ["m"]),  # 3e38 * 3e38: inf, on a large tensor
             helper.make_node("Mul", ["k", "k"], ["kk"]),  # a constant: folded at creation (inf)
             helper.make_node("Add", ["m", "kk"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 4]),
                     helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 4]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, list(big.shape))],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in (("s", [2, 4]), ("nan", [2, 4]),
                                                                              ("y", list(big.shape)))],
        [numpy_helper.from_array(np.array(3e38, np.float32), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    feeds = {"a": np.full((2, 4), lo, np.float32), "b": np.full((2, 4), lo, np.float32), "x": big}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    so = onnxpack.SessionOptions()
    so.intra_op_num_threads = threads
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sess = onnxpack.InferenceSession(model.SerializeToString(), so)
        for _ in range(3):
            got = sess.run(None, feeds)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
    assert np.isneginf(got[0]).all() and np.isnan(got[1]).all() and np.isposinf(got[2]).all()


@pytest.mark.parametrize("n", [511, 512, 4099])
def test_half_float_conversion_pass_gives_numpys_bits(n):
    """float16 <-> float32 by the JIT's pass (``_act.astype``, from HALF_JIT_MIN elements): numpy's
    bits both ways, for every float16 value, and float32 values that round to ties, overflow to
    inf, underflow to subnormals and zero, -0; NaN stays NaN (the hardware conversion quiets a
    signaling NaN's payload, numpy keeps it); non-contiguous inputs; shapes kept."""
    from onnxpack.session.kernels import _act

    def same_bits(got, want, bits):
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits))

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    same_bits(_act.astype(every, np.float32), every.astype(np.float32), np.uint32)
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 6, n)).astype(np.float32)
    ties = (np.arange(n, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0 ** -10)  # halfway between halves
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 65504.0, 65519.996, 65520.0, 6e-8, 3e-8, 1e-9],
                       np.float32)
    for arr in (x, ties, np.resize(special, n), x.reshape(-1, 1)[::1, 0], np.stack([x, x])[:, ::2]):
        with np.errstate(over="ignore"):
            want = arr.astype(np.float16)
        got = _act.astype(arr, np.float16)
        assert got.shape == arr.shape and got.dtype == np.float16
        same_bits(got, want, np.uint16)
        same_bits(_act.astype(got, np.float32), got.astype(np.float32), np.uint32)
    same = np.zeros(3, np.float32)
    assert _act.astype(same, np.float32) is same


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_float16_arithmetic_in_float32_gives_numpys_float16_bits(op):
    """float16 + - * / of large operands compute in float32 and round once (the JIT's
    conversions): numpy's float16 results bit for bit (numpy rounds each float32 result too),
    with overflow to inf, subnormals, signed zeros, NaN, and broadcasting either side."""
    rng = np.random.default_rng(41)
    a = (rng.standard_normal((64, 48)) * 10.0 ** rng.uniform(-6, 4, (64, 48))).astype(np.float16)
    b = (rng.standard_normal((64, 48)) * 10.0 ** rng.uniform(-6, 4, (64, 48))).astype(np.float16)
    a[0, :8] = [np.nan, np.inf, -np.inf, -0.0, 65504, 6e-8, 1e-7, 0.0]
    b[0, :8] = [1.0, -np.inf, 2.0, 0.0, 65504, 6e-8, -1e-7, 0.0]
    fn = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}[op]
    for x, y in ((a, b), (a, b[:1]), (a[:, :1], b)):
        (got,) = run_native(make_node(op, ["a", "b"], ["y"]), [x, y], 14)
        with np.errstate(all="ignore"):
            want = fn(x, y)
        assert got.dtype == np.float16 and got.shape == want.shape
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
