"""Elementwise kernels: arithmetic, comparisons, logic, activations, Cast, Identity, Dropout.

Every kernel keeps ONNX's output dtype exactly.  numpy (NEP 50, numpy >= 2) keeps the array's
dtype when the other operand is a Python scalar, so attributes (Python floats) never widen
float16 to float64; where numpy *would* promote two arrays (Pow with an integer exponent, Mean's
division) the result is cast back to the input dtype, as the spec and onnx.reference do.

Ops whose math raises floating-point warnings by design (``Log(0)``, ``Div`` by zero) compute
under ``np.errstate(all="ignore")``: onnxruntime never warns, and a warning per run would drown
the log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.graph._proto import TensorProto, np_dtype_to_tensor_dtype, tensor_dtype_to_np_dtype
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, KernelContext, PackSpec, register
from onnxpack.session.kernels._erf import erf_f32

logger = logging.getLogger(__name__)

__all__: list[str] = []  # kernels are reached through the registry only

_SCIPY_ERF: list = []  # [scipy.special.erf or None] once looked up


def _scipy_erf():
    """scipy's erf (a fast, correctly rounded float64 ufunc) when scipy is installed, else None.

    Looked up on first use, not at import: ``scipy.special`` pulls in numpy.f2py, unittest and
    13 MB of private memory per process (measured: RssAnon after ``import onnxpack`` 41 -> 28 MB),
    and only float64 Erf needs it.
    """
    if not _SCIPY_ERF:
        try:  # scipy is optional
            from scipy.special import erf  # type: ignore[import-untyped]
        except ImportError:  # pragma: no cover - depends on the environment
            erf = None
        _SCIPY_ERF.append(erf)
    return _SCIPY_ERF[0]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
# Taylor coefficients of erf(x) * sqrt(pi) / 2 = sum (-1)^n x^(2n+1) / (n! (2n+1)), n = 0..9.
_ERF_TAYLOR = tuple((-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(10))
# Numerical Recipes' erfcc: fractional error of erfc below 1.2e-7 everywhere.
_ERFC_NR = (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
    0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277,
)  # fmt: skip
# Below this |x| the Taylor series is used: erfc's 1.2e-7 *fractional* error would be a large
# *relative* error of erf near 0; at |x| = 0.5 ten Taylor terms are exact to ~1e-13.
_ERF_TAYLOR_LIMIT = 0.5


def erf_numpy(x: np.ndarray) -> np.ndarray:
    """erf without scipy, computed in float64 (relative error < 2e-7 everywhere); float64 inputs only
    (float32/float16 use the faster :func:`erf_f32`).

    Taylor series near zero (where erf is small and needs relative accuracy), Numerical Recipes'
    Chebyshev fit of erfc elsewhere (where erf >= 0.52 so erfc's error is relative to ~1).
    """
    x64 = np.asarray(x, dtype=np.float64)
    a = np.abs(x64)
    z2 = x64 * x64
    taylor = np.zeros_like(x64)
    for c in reversed(_ERF_TAYLOR):
        taylor = taylor * z2 + c
    taylor *= x64 * _TWO_OVER_SQRT_PI
    t = 1.0 / (1.0 + 0.5 * a)
    poly = np.zeros_like(x64)
    for c in reversed(_ERFC_NR):
        poly = poly * t + c
    with np.errstate(under="ignore", over="ignore"):
        erfc = t * np.exp(-z2 + poly)
    far = np.copysign(1.0 - erfc, x64)
    return np.where(a < _ERF_TAYLOR_LIMIT, taylor, far)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in x's dtype.

    float32, float16 and bfloat16 compute in float32 (rounded once to x's dtype): from
    ``_JIT_MIN`` elements with numba, one vectorized pass of the Gelu epilogue's erf
    (``_conv_jit.erf_array``: the same two pieces and coefficients, its own float32 exp; 1.03
    ulp against math.erf on 2M points, 128K elements 49 us against 526), else :func:`erf_f32`
    (numpy passes, 1.5 ulp): the same bits with or without scipy, and faster than both scipy's
    ufunc and the float64 series.  float64 keeps float64 accuracy (scipy when present, else
    :func:`erf_numpy`).  (A QDQ or QOperator BERT keeps its Gelu as Erf between dequantization
    and quantization: 4 such Erfs were 2.2 of a 4-layer model's 14 ms.)
    """
    if x.dtype != np.float64:
        y = _erf_jit(x)
        if y is None:
            y = erf_f32(x)
    elif _scipy_erf() is not None:
        y = _scipy_erf()(x)
    else:
        y = erf_numpy(x)
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def _same(y: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``y`` as an array of ``like``'s dtype (no copy when it already is)."""
    y = np.asarray(y)
    return y if y.dtype == like.dtype else _act.astype(y, like.dtype)


# Float32 tensors of at least this many elements run activations through the JIT (one pass);
# below, numpy's call overhead is smaller than the JIT's.
_JIT_MIN = 4096


def _jit_act(x: np.ndarray, act: _act.Activation) -> np.ndarray | None:
    """``act(x)`` as a new float32 array through the JIT kernels, or None when they do not
    apply (other dtypes, small tensors, no numba): the caller's numpy formula then runs."""
    if x.dtype != np.float32 or x.size < _JIT_MIN:
        return None
    jit = _act.act_kernels()
    if jit is None:
        return None
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    codes, params = _act.encode((act,))
    jit.act_inplace(y.reshape(-1), codes, params)
    return y


def _erf_jit(x: np.ndarray) -> np.ndarray | None:
    """erf of a float32, float16 or bfloat16 ``x`` as a new float32 array by the numba kernel, or
    None (small, no numba): see :func:`_erf`."""
    if x.size < _JIT_MIN:
        return None
    jit = _act.jit()
    if jit is None:
        return None
    xf = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty(xf.shape, np.float32)
    jit.erf_array(xf.reshape(-1), y.reshape(-1))
    return y


_SIGMOID = _act.Activation("sigmoid")
_SILU = _act.Activation("silu")
_HARDSWISH = _act.Activation("hardswish", 1.0 / 6.0, 0.5)
_GELU = _act.Activation("gelu")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    y = _jit_act(x, _SIGMOID)
    if y is not None:
        return y
    return _sigmoid_numpy(x)


def _hardswish(x: np.ndarray) -> np.ndarray:
    y = _jit_act(x, _HARDSWISH)
    if y is not None:
        return y
    with np.errstate(over="ignore", invalid="ignore"):  # -inf * 0 is NaN, silently
        return x * np.clip(x / 6 + 0.5, 0, 1)


def _sigmoid_numpy(x: np.ndarray) -> np.ndarray:
    # 1 / (1 + exp(-x)) keeps full *relative* accuracy in both tails (tanh-based forms lose it
    # for negative x); exp overflows to inf only where the true result is below float range.
    y = np.empty_like(x)  # (not np.negative(x): that is a numpy scalar for 0-d x)
    np.negative(x, out=y)
    with _act.quiet():
        np.exp(y, out=y)
    y += 1
    np.reciprocal(y, out=y)
    return y


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        if a.dtype.kind == "u" and b.dtype.kind == "u":
            return np.floor_divide(a, b)
        # C-style truncation toward zero, as onnxruntime and onnx.reference compute it.
        q = np.floor_divide(a, b)
        r = np.remainder(a, b)
        q += ((r != 0) & ((a < 0) ^ (b < 0))).astype(q.dtype)
        return q
    return np.divide(a, b)


def _pow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if b.size == 1 and b.ndim <= a.ndim and a.dtype.kind == "f":
        e = b.reshape(()).item()
        if e == 2:
            return np.square(a)  # x ** 2 (variance, L2 norms): one multiply instead of pow
        if a.dtype in (np.float32, np.float64) and isinstance(e, (int, float)) and math.isfinite(e) and e == int(e):
            if e == 3:
                # onnxruntime's bits: its Pow multiplies for an exponent of 2 or 3 (the tanh
                # GELU's cube), and calls pow for any other.
                return a * a * a
            # An integer exponent: pow of the magnitude, then the base's sign for an odd one,
            # the same bits as pow itself (C's pow(-x, n) is +-pow(x, n)).  numpy's float32 pow
            # of a negative base took ~50-100x as long as of a positive one (measured: 49k
            # floats, 0.06 ms positive, 2.7 ms mixed signs, 5.4 ms negative).
            mag = np.power(np.abs(a), a.dtype.type(e))
            return np.copysign(mag, a, out=mag) if int(e) % 2 else mag
    if a.dtype.kind == "f" and b.dtype != a.dtype:
        b = b.astype(a.dtype)  # float base, other exponent type: compute in the base's type
    if a.dtype.kind in "iu" and b.dtype.kind == "i" and (b < 0).any():
        # An integer base to a negative integer power (numpy refuses it): the integer result
        # onnxruntime computes, 1 for base 1, +-1 for base -1 by the exponent's parity, 0 else.
        neg = b < 0
        safe = np.power(a, np.where(neg, 0, b).astype(b.dtype, copy=False))
        small = np.where(a == 1, 1, np.where(a == -1, np.where(b % 2 == 0, 1, -1), 0)).astype(safe.dtype)
        return _same(np.where(neg, small, safe), a)
    return _same(np.power(a, b), a)


def _bitshift_left(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    bits = a.dtype.itemsize * 8
    out = np.left_shift(a, np.clip(b, 0, bits - 1).astype(a.dtype))
    return np.where((b < 0) | (b >= bits), a.dtype.type(0), out)


def _bitshift_right(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    bits = a.dtype.itemsize * 8
    out = np.right_shift(a, np.clip(b, 0, bits - 1).astype(a.dtype))
    out_of_range = (b < 0) | (b >= bits)
    if a.dtype.kind == "i":
        # An amount outside [0, bits) leaves the sign fill alone (-1 or 0), as onnx.reference
        # computes it.  Clamping covers amounts >= bits (a shift by bits-1 is the fill) but not
        # negative ones, which the clamp would turn into "no shift".
        fill = np.where(a < 0, a.dtype.type(-1), a.dtype.type(0))
        return np.asarray(np.where(out_of_range, fill, out))
    return np.asarray(np.where(out_of_range, a.dtype.type(0), out))  # unsigned: the fill is 0


# ------------------------------------------------------------------------------------------------
# table-driven unary and binary kernels
# ------------------------------------------------------------------------------------------------
class _Unary(Kernel):
    """``y = fn(x)`` for a numpy function that keeps x's dtype (or gives bool, for IsNaN).

    ``np.asarray`` because a ufunc applied to a 0-d array returns a numpy scalar.
    """

    _fn: Callable[[np.ndarray], np.ndarray]
    _quiet = False

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._f = type(self)._fn  # bound once: run is on every model's hot path

    def run(self, x):  # type: ignore[override]
        if self._quiet:
            with np.errstate(all="ignore"):
                return (np.asarray(self._f(x)),)
        r = self._f(x)
        return (r,) if r.__class__ is np.ndarray else (np.asarray(r),)

    def run_into(self, outs, x) -> bool:
        """``run`` writing into ``outs[0]`` (the memory planner's arena) with numpy ``out=``.

        The same ufunc on the same operands, so the bits equal ``run``'s; functions that are not
        one ufunc (Round, Sigmoid, Erf, ...) decline with ``False`` and are ``run`` instead.
        """
        fn = _UNARY_INTO.get(self.op_type) or type(self)._fn
        if not isinstance(fn, np.ufunc) and self.op_type not in _UNARY_INTO:
            return False
        if self._quiet:
            with np.errstate(all="ignore"):
                fn(x, out=outs[0])
        else:
            fn(x, out=outs[0])
        return True


class _Binary(Kernel):
    """``y = fn(a, b)`` with multidirectional broadcasting."""

    _fn: Callable[[np.ndarray, np.ndarray], np.ndarray]
    _quiet = False

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._f = type(self)._fn

    def run(self, a, b):  # type: ignore[override]
        if a.dtype == _F16 and b.dtype == _F16 and self._f in _HALF_WIDE and max(a.size, b.size) >= _act.HALF_JIT_MIN:
            # numpy computes a float16 + - * / in float32 and rounds it, element by element in
            # scalar C: the same arithmetic whole-array, with the JIT's conversions (a float16
            # PP-OCR classifier's HardSwish Mul steps 850 -> ~40 us)
            with np.errstate(all="ignore"):
                r = np.asarray(self._f(_act.astype(a, np.float32), _act.astype(b, np.float32)))
            return (_act.astype(r, _F16),)
        if self._quiet:
            with np.errstate(all="ignore"):
                return (np.asarray(self._f(a, b)),)
        r = self._f(a, b)
        return (r,) if r.__class__ is np.ndarray else (np.asarray(r),)

    def run_into(self, outs, a, b) -> bool:
        """``run`` writing into ``outs[0]`` with numpy ``out=`` (ufuncs only; Div on floats)."""
        if a.dtype == _F16 and self._f in _HALF_WIDE and outs[0].size >= _act.HALF_JIT_MIN:
            return False  # (run's float32 arithmetic is faster than numpy's float16 loop)
        fn = type(self)._fn
        if fn is _div and a.dtype.kind == "f" and b.dtype == a.dtype:
            fn = np.divide  # float Div is np.divide in ``_div`` too
        elif not isinstance(fn, np.ufunc):
            return False
        if self._quiet:
            with np.errstate(all="ignore"):
                fn(a, b, out=outs[0])
        else:
            fn(a, b, out=outs[0])
        return True


def _define(base: type[Kernel], op_type: str, since: int, fn: Callable, quiet: bool = False) -> type[Kernel]:
    cls = type(
        op_type,
        (base,),
        {
            "_fn": staticmethod(fn),
            "_quiet": quiet,
            "op_type": op_type,
            "since": since,
            "__doc__": f"ONNX {op_type} (since opset {since}).",
            "__module__": __name__,
        },
    )
    return register(op_type, since=since)(cls)


# op_type, first opset, function, whether floating-point warnings are expected and silenced.
_UNARY: tuple[tuple[str, int, Callable, bool], ...] = (
    ("Neg", 1, np.negative, False),
    ("Abs", 1, np.abs, False),
    ("Sqrt", 1, np.sqrt, True),
    ("Exp", 1, np.exp, True),
    ("Log", 1, np.log, True),
    ("Reciprocal", 1, np.reciprocal, True),
    ("Floor", 1, np.floor, False),
    ("Ceil", 1, np.ceil, False),
    ("Round", 11, np.round, False),  # numpy rounds half to even, as ONNX requires
    ("Sign", 9, np.sign, False),
    ("Not", 1, np.logical_not, False),
    ("BitwiseNot", 18, np.invert, False),
    ("Relu", 1, lambda x: np.maximum(x, 0), False),
    ("Sigmoid", 1, _sigmoid, False),
    ("Tanh", 1, np.tanh, False),
    ("Erf", 9, _erf, False),
    ("Softplus", 1, lambda x: np.logaddexp(0, x), True),
    ("Softsign", 1, lambda x: x / (1 + np.abs(x)), False),
    ("Sin", 7, np.sin, True),
    ("Cos", 7, np.cos, True),
    ("Tan", 7, np.tan, True),
    ("Asin", 7, np.arcsin, True),
    ("Acos", 7, np.arccos, True),
    ("Atan", 7, np.arctan, False),
    ("Sinh", 9, np.sinh, True),
    ("Cosh", 9, np.cosh, True),
    ("Asinh", 9, np.arcsinh, False),
    ("Acosh", 9, np.arccosh, True),
    ("Atanh", 9, np.arctanh, True),
    ("IsNaN", 9, np.isnan, False),
    ("Mish", 18, lambda x: x * np.tanh(np.logaddexp(0, x)), True),
    ("HardSwish", 14, _hardswish, False),
)

# Unary ops whose table function is not itself a ufunc but is one ufunc call with ``out=``.
_UNARY_INTO: dict[str, Callable[..., np.ndarray]] = {
    "Relu": lambda x, out: np.maximum(x, 0, out=out),  # the table's ``np.maximum(x, 0)``
}

_F16 = np.dtype(np.float16)
# The float16 operations numpy computes in float32 and rounds once, which float32 arrays then one
# rounding reproduce bit for bit (float32 carries 2 x 11 + 2 bits: rounding twice is harmless
# for + - * /).
_HALF_WIDE = frozenset({np.add, np.subtract, np.multiply, _div})

_BINARY: tuple[tuple[str, int, Callable, bool], ...] = (
    ("Add", 1, np.add, False),
    ("Sub", 1, np.subtract, False),
    ("Mul", 1, np.multiply, False),
    ("Div", 1, _div, True),
    ("Pow", 1, _pow, True),
    ("Equal", 1, np.equal, False),
    ("Less", 1, np.less, False),
    ("LessOrEqual", 12, np.less_equal, False),
    ("Greater", 1, np.greater, False),
    ("GreaterOrEqual", 12, np.greater_equal, False),
    ("And", 1, np.logical_and, False),
    ("Or", 1, np.logical_or, False),
    ("Xor", 1, np.logical_xor, False),
    ("BitwiseAnd", 18, np.bitwise_and, False),
    ("BitwiseOr", 18, np.bitwise_or, False),
    ("BitwiseXor", 18, np.bitwise_xor, False),
)

for _op, _since, _fn, _quiet in _UNARY:
    _define(_Unary, _op, _since, _fn, _quiet)
for _op, _since, _fn, _quiet in _BINARY:
    _define(_Binary, _op, _since, _fn, _quiet)
del _op, _since, _fn, _quiet


# ------------------------------------------------------------------------------------------------
# kernels with attributes
# ------------------------------------------------------------------------------------------------
@register("Mod", since=10)
class Mod(Kernel):
    """``fmod=1``: C fmod (sign of the dividend); ``fmod=0``: Python modulo (sign of the divisor)."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self._fn = np.fmod if int(self.attr("fmod", 0)) == 1 else np.mod

    def run(self, a, b):  # type: ignore[override]
        with np.errstate(all="ignore"):
            return (np.asarray(self._fn(a, b)),)


@register("BitShift", since=11)
class BitShift(Kernel):
    """Shifts with ONNX's rule for amounts outside [0, bits): the sign fill alone."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        direction = self.attr("direction")
        if direction not in ("LEFT", "RIGHT"):
            raise NotImplementedError(f"BitShift direction {direction!r}")
        self._fn = _bitshift_left if direction == "LEFT" else _bitshift_right

    def run(self, a, b):  # type: ignore[override]
        return (np.asarray(self._fn(a, b)),)


class _Variadic(Kernel):
    _fn: Callable[[np.ndarray, np.ndarray], np.ndarray]

    def run(self, *xs):  # type: ignore[override]
        xs = [x for x in xs if x is not None]
        if len(xs) == 1:
            return (xs[0],)
        fn = type(self)._fn
        out = np.asarray(fn(xs[0], xs[1]))  # (0-d operands give a numpy scalar: no out= target)
        for x in xs[2:]:
            if np.broadcast_shapes(out.shape, x.shape) == out.shape:
                fn(out, x, out=out)
            else:
                out = fn(out, x)
        return (out,)


@register("Max", since=1)
class Max(_Variadic):
    """Elementwise maximum of any number of inputs (NaN propagates, as in onnxruntime)."""

    _fn = staticmethod(np.maximum)


@register("Min", since=1)
class Min(_Variadic):
    """Elementwise minimum of any number of inputs."""

    _fn = staticmethod(np.minimum)


@register("Sum", since=1)
class Sum(_Variadic):
    """Elementwise sum of any number of inputs."""

    _fn = staticmethod(np.add)


@register("Mean", since=1)
class Mean(_Variadic):
    """Elementwise mean: the sum divided by the count, in the inputs' dtype."""

    _fn = staticmethod(np.add)

    def run(self, *xs):  # type: ignore[override]
        n = sum(x is not None for x in xs)
        (s,) = super().run(*xs)
        if s is next(x for x in xs if x is not None):
            return (s,)
        s /= n  # in place: the sum is our own fresh array, and dtype stays
        return (s,)


@register("Where", since=9)
class Where(Kernel):
    """``np.where``; x and y share a dtype in valid models, so no promotion happens."""

    def run(self, cond, x, y):  # type: ignore[override]
        return (_same(np.where(cond, x, y), x),)


@register("LeakyRelu", since=1)
class LeakyRelu(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 0.01))

    def run(self, x):  # type: ignore[override]
        return (_same(np.where(x < 0, x * self.alpha, x), x),)


@register("PRelu", since=1)
class PRelu(Kernel):
    """``x < 0 ? slope * x : x`` with the slope broadcast unidirectionally to x."""

    def run(self, x, slope):  # type: ignore[override]
        return (_same(np.where(x < 0, x * _prelu_slope(x, slope), x), x),)


def _prelu_slope(x: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """``slope`` shaped to broadcast against x.

    Models exported for opsets before 7 (and some later ones, which onnxruntime and
    onnx.reference both accept) give a per-channel slope of shape (C,) for x of shape
    (N, C, ...), which numpy's trailing-axis rule does not broadcast.  Like onnx.reference, a
    1-D slope that does not broadcast is laid along the one axis of x with its length; when no
    axis or several axes match, numpy's own error stands.
    """
    try:
        np.broadcast_shapes(x.shape, slope.shape)
        return slope
    except ValueError:
        if slope.ndim != 1:
            raise
    matches = [d for d, n in enumerate(x.shape) if n == slope.shape[0]]
    if len(matches) != 1:
        raise ValueError(f"PRelu slope of shape {slope.shape} does not broadcast to x of shape {x.shape}")
    shape = [1] * x.ndim
    shape[matches[0]] = slope.shape[0]
    return slope.reshape(shape)


@register("HardSigmoid", since=1)
class HardSigmoid(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 0.2))
        self.beta = float(self.attr("beta", 0.5))

    def run(self, x):  # type: ignore[override]
        y = _jit_act(x, _act.Activation("hardsigmoid", self.alpha, self.beta))
        if y is not None:
            return (y,)
        return (_same(np.clip(x * self.alpha + self.beta, 0, 1), x),)


@register("Elu", since=1)
class Elu(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.0))

    def run(self, x):  # type: ignore[override]
        with np.errstate(all="ignore"):
            return (_same(np.where(x > 0, x, self.alpha * np.expm1(x)), x),)


@register("Celu", since=12)
class Celu(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.0))

    def run(self, x):  # type: ignore[override]
        with np.errstate(all="ignore"):
            y = np.maximum(x, 0) + np.minimum(0, self.alpha * np.expm1(x / self.alpha))
        return (_same(y, x),)


@register("Selu", since=1)
class Selu(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.67326319217681884765625))
        self.gamma = float(self.attr("gamma", 1.05070102214813232421875))

    def run(self, x):  # type: ignore[override]
        with np.errstate(all="ignore"):
            return (_same(np.where(x > 0, x, self.alpha * np.expm1(x)) * self.gamma, x),)


@register("ThresholdedRelu", since=1)
class ThresholdedRelu(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.0))

    def run(self, x):  # type: ignore[override]
        return (_same(np.where(x > self.alpha, x, 0), x),)


@register("Swish", since=24)
class Swish(Kernel):
    """``x * sigmoid(alpha * x)`` (opset 24; alpha 1 is SiLU: the JIT's one pass for large float32
    tensors); float16 is computed in float32 and rounded."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.0))

    def run(self, x):  # type: ignore[override]
        if x.dtype.kind != "f":
            raise InvalidArgument(f"node {self.node.name!r} (Swish): X must be a float tensor, got {x.dtype}")
        if self.alpha == 1.0:
            y = _jit_act(x, _SILU)
            if y is not None:
                return (y,)
        xf = x.astype(np.float32) if x.dtype == np.float16 else x
        with np.errstate(all="ignore"):  # inf / NaN inputs: the arithmetic's result, unwarned
            d = np.exp(xf * xf.dtype.type(-self.alpha))
            d += 1
            return (_same(xf / d, x),)


@register("Gelu", since=20)
class Gelu(Kernel):
    """Exact (erf) or tanh-approximated GELU; float16 is computed in float32 and rounded."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        approximate = self.attr("approximate", "none")
        if approximate not in ("none", "tanh"):
            raise NotImplementedError(f"Gelu approximate={approximate!r}")
        self.tanh = approximate == "tanh"

    def run(self, x):  # type: ignore[override]
        if x.ndim == 0:  # in-place numpy ops need arrays, and 0-d arithmetic gives scalars
            return (self.run(x.reshape(1))[0].reshape(()),)
        if not self.tanh:
            y = _jit_act(x, _GELU)
            if y is not None:
                return (y,)
        xf = x.astype(np.float32) if x.dtype == np.float16 else x
        with np.errstate(over="ignore", invalid="ignore"):  # inf * 0 is NaN, silently (onnxruntime warns of nothing)
            if self.tanh:
                inner = xf * xf
                inner *= 0.044715
                inner += 1
                inner *= xf
                inner *= math.sqrt(2.0 / math.pi)
                y = np.tanh(inner, out=inner)
            else:
                y = _erf(xf * (1.0 / math.sqrt(2.0)))
            y += 1
            y *= xf
            y *= 0.5
        return (_same(y, x),)


@register("IsInf", since=10)
class IsInf(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.neg = int(self.attr("detect_negative", 1)) == 1
        self.pos = int(self.attr("detect_positive", 1)) == 1

    def run(self, x):  # type: ignore[override]
        if self.neg and self.pos:
            return (np.isinf(x),)
        if self.pos:
            return (np.isposinf(x),)
        if self.neg:
            return (np.isneginf(x),)
        return (np.zeros(x.shape, dtype=bool),)


@register("Clip", since=1)
class Clip1(Kernel):
    """Clip before opset 11: bounds are attributes (defaults: the whole float range)."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.lo = self.attr("min")
        self.hi = self.attr("max")

    def run(self, x):  # type: ignore[override]
        return (_clip(x, self.lo, self.hi),)


@register("Clip", since=11)
class Clip11(Kernel):
    """Clip from opset 11: bounds are optional scalar inputs of x's dtype."""

    def run(self, x, lo=None, hi=None):  # type: ignore[override]
        return (_clip(x, lo, hi),)


def _clip(x: np.ndarray, lo, hi) -> np.ndarray:
    # maximum then minimum, as the spec defines it (min > max gives max everywhere).  A missing
    # bound of a float Clip is the type's largest finite value (the spec's default, onnxruntime's):
    # an infinity becomes it; NaN stays NaN.
    if x.dtype.kind == "f" and (lo is None or hi is None):
        info = np.finfo(x.dtype)
        lo = info.min if lo is None else lo
        hi = info.max if hi is None else hi
    if lo is None and hi is None:
        return x
    if lo is not None:
        # A ufunc on 0-d operands returns a numpy scalar, which cannot be an ``out=``.
        y = np.asarray(np.maximum(x, lo))
        if hi is not None:
            np.minimum(y, hi, out=y)
    else:
        y = np.minimum(x, hi)
    return _same(y, x)


# ONNX element types a numpy cast reproduces exactly.  Strings, float8, float4 and 4-bit
# integers need saturation, rounding modes or packing rules: left to onnx.reference.
_CASTABLE = frozenset(
    {
        TensorProto.FLOAT,
        TensorProto.DOUBLE,
        TensorProto.FLOAT16,
        TensorProto.BFLOAT16,
        TensorProto.INT8,
        TensorProto.INT16,
        TensorProto.INT32,
        TensorProto.INT64,
        TensorProto.UINT8,
        TensorProto.UINT16,
        TensorProto.UINT32,
        TensorProto.UINT64,
        TensorProto.BOOL,
    }
)
_EXACT_SOURCE_KINDS = frozenset("fiub")  # float, signed, unsigned, bool (not str/object/void)


def _cast_dtype(to: int) -> np.dtype:
    if to not in _CASTABLE:
        raise NotImplementedError(f"Cast to {TensorProto.DataType.Name(to)}")
    return np.dtype(tensor_dtype_to_np_dtype(to))


@register("Cast", since=1)
class Cast(Kernel):
    """numpy ``astype`` for numeric and bool targets (``saturate`` only matters for float8).

    A Cast of a constant (the usual way exporters widen fp16 weights: ``Cast(W_fp16) -> fp32``)
    pre-packs: the cast weight is computed once, saved and mapped like any packed weight, and
    ``run`` returns it without touching the original.
    """

    _PACK_VERSION = 1

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        to = self.attr("to")
        if isinstance(to, str):  # opset 1 spelled the type as a string
            to = TensorProto.DataType.Value(to.upper())
        self.dtype = _cast_dtype(int(to))
        self._packed: np.ndarray | None = None

    def pack_spec(self, input_index, info):
        target = np.dtype(self.dtype)
        source = np.dtype(info.dtype)
        if input_index != 0 or target == source or target.isbuiltin != 1 or target.kind not in "iuf":
            return None
        # bfloat16 (ml_dtypes) sources too: widening a bf16 weight is the same exact astype.
        if not ((source.isbuiltin == 1 and source.kind in "iuf") or source.name == "bfloat16"):
            return None
        return PackSpec("cast", self._PACK_VERSION, target.str.encode(), 1)

    def expected_packed(self, input_index, info):
        if self.pack_spec(input_index, info) is None:
            return None
        return [(np.dtype(self.dtype), tuple(info.shape))]

    def prepack(self, input_index, weight):
        return (np.ascontiguousarray(weight.astype(self.dtype)).reshape(weight.shape),)

    def use_prepacked(self, input_index, buffers):
        (self._packed,) = buffers

    def run(self, x=None):  # type: ignore[override]
        if self._packed is not None:
            return (self._packed,)
        if x.dtype.kind == "f" and self.dtype.kind in "iub":
            # NaN / inf / out-of-range floats to integers: the platform's conversion, as
            # onnxruntime's, without numpy's warning (a T5 mask of finfo.min casts every run).
            with np.errstate(invalid="ignore", over="ignore"):
                return (x.astype(self.dtype, copy=False),)
        return (_act.astype(x, self.dtype),)  # (float16 <-> float32 by the JIT's pass)


@register("CastLike", since=15)
class CastLike(Kernel):
    """Cast to the second input's dtype; exotic targets go through onnx.reference's own cast."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.saturate = bool(self.attr("saturate", 1))

    def run(self, x, like):  # type: ignore[override]
        # ml_dtypes' float8 types also have kind "f": test for numpy's own dtypes (isbuiltin 1;
        # ml_dtypes' are 2), whose astype is the spec's cast -- float8 targets need saturation,
        # which astype does not do.
        if like.dtype.kind in _EXACT_SOURCE_KINDS and like.dtype.isbuiltin == 1:
            return (x.astype(like.dtype, copy=False),)
        from onnx.reference.ops.op_cast import cast_to  # rare path: float8/bfloat16/4-bit

        to = np_dtype_to_tensor_dtype(like.dtype)
        return (np.asarray(cast_to(x, to, self.saturate)),)


@register("Identity", since=1)
class Identity(Kernel):
    """Returns its input itself: the executor never mutates values, so no copy is needed."""

    def run(self, x):  # type: ignore[override]
        return (x,)


@register("Optional", since=15)
class Optional(Kernel):
    """An optional holding its input, or empty (``None``) without one.  (onnx.reference's wraps
    the value in a list, so OptionalGetElement returned the list and an empty optional read as
    holding a value.)"""

    def run(self, x=None):  # type: ignore[override]
        return (x,)


@register("OptionalHasElement", since=15)
class OptionalHasElement(Kernel):
    """Whether the optional holds a value (from opset 18 the input may be a plain tensor or
    sequence, or omitted: an empty optional)."""

    def run(self, x=None):  # type: ignore[override]
        return (np.array(x is not None),)


@register("OptionalGetElement", since=15)
class OptionalGetElement(Kernel):
    """The optional's value (from opset 18 a plain tensor or sequence passes through); an empty
    optional is the run's error."""

    def run(self, x=None):  # type: ignore[override]
        if x is None:
            raise InvalidArgument(f"node {self.node.name!r} (OptionalGetElement): the optional input holds no value")
        return (x,)


@register("Dropout", since=1)
class Dropout(Kernel):
    """Inference Dropout: identity, and when the mask output is requested a mask of ones from
    opset 12 (of zeros before, as onnxruntime's).

    From opset 12 ``training_mode`` is an input; when it is true at run time the random mask is
    drawn exactly as onnx.reference draws it (``RandomState(seed)``), so results stay
    comparable.  The mask is bool from opset 10, the input's dtype before.
    """

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.want_mask = len(node.output) > 1 and bool(node.output[1])
        self.mask_bool = ctx.opset >= 10
        self.seed = self.attr("seed")
        self.ratio_attr = float(self.attr("ratio", 0.5))

    def run(self, x, ratio=None, training_mode=None):  # type: ignore[override]
        if self.ctx.opset >= 12 and training_mode is not None and bool(np.asarray(training_mode)):
            p = 0.5 if ratio is None else float(np.asarray(ratio))
            if p != 0:
                mask = np.random.RandomState(self.seed).uniform(0, 1.0, x.shape) >= p
                y = _same(mask * x * (1.0 / (1.0 - p)), x)
                return (y, mask) if self.want_mask else (y,)
        if not self.want_mask:
            return (x,)
        # Before opset 12 (no training_mode) the inference mask is all zeros / False, as
        # onnxruntime returns it; from 12 all ones / True (nothing dropped).
        fill = np.ones if self.ctx.opset >= 12 else np.zeros
        return (x, fill(x.shape, dtype=bool if self.mask_bool else x.dtype))


class ActAfter(Kernel):
    """A kernel whose single output the activations ``acts`` (:class:`._act.Activation`, in
    order) transform in place: the epilogue of a fusion that keeps the producer's own kernel
    (``Add/Sum/Sub/Mul -> Relu``, ``MatMulNBits -> SiLU``, ...).

    The producer's result is a fresh array unless it returned one of its inputs (Sum of one
    input): then the activations work on a copy, so no caller's value is ever written.  float16
    and bfloat16 results are widened to float32 for the activations and rounded once, as the
    standalone kernels compute them (Relu and Clip, exact in any dtype, stay in place).
    """

    def __init__(self, inner: Kernel, acts) -> None:
        super().__init__(inner.node, inner.ctx)
        self.inner = inner
        self.acts = tuple(acts)
        self._exact = _act.numpy_suffices(self.acts)
        self._quantizes = any(a.kind == "fakequant" for a in self.acts)
        self.writes_into = inner.writes_into  # type: ignore[misc]
        self.call_mode = inner.call_mode
        # A producer that can apply the activations itself: ``run_acts(acts, *inputs)`` returns
        # its outputs with them applied, or None when it cannot for these inputs.
        self._fused = getattr(inner, "run_acts", None)
        # Relu and Clip only: their numpy passes (_act.apply_numpy's) called here directly, the
        # bounds of each as (low, high) with None for no bound.  These never warn, so no errstate:
        # on tiny tensors the generic path's layers cost ~4 us a call against ~1 us of arithmetic.
        kept = [a for a in self.acts if a.kind != "none"]
        self._bounds = (tuple((0.0, None) if a.kind == "relu" else (a.a, a.b) for a in kept)
                        if all(a.kind in ("relu", "clip") for a in kept) else None)

    def pack_spec(self, input_index, info):
        return self.inner.pack_spec(input_index, info)

    def expected_packed(self, input_index, info):
        return self.inner.expected_packed(input_index, info)

    def check_packed(self, input_index, info, buffers):
        return self.inner.check_packed(input_index, info, buffers)

    def prepack(self, input_index, weight):
        return self.inner.prepack(input_index, weight)

    def use_prepacked(self, input_index, buffers) -> None:
        self.inner.use_prepacked(input_index, buffers)

    def _apply(self, y: np.ndarray) -> np.ndarray:
        """The activations over ``y`` (fresh and writable) in place; returns it."""
        if y.dtype.kind != "f" and not self._exact:
            raise InvalidArgument(f"node {self.node.name!r} ({self.op_type}): fused activations need a float "
                                  f"result, got {y.dtype}")
        if y.dtype != np.float32 and self._quantizes:
            # A fused QuantizeLinear with a float32 scale reads float32 (the spec's T1): another
            # dtype is a model onnxruntime refuses, not one to quantize in another precision.
            raise InvalidArgument(f"node {self.node.name!r} ({self.node.op_type}): a fused QuantizeLinear with a "
                                  f"float32 scale needs a float32 input, got {y.dtype}")
        if y.dtype in (np.float32, np.float64) or self._exact:
            return _act.apply(y, self.acts)
        wide = _act.apply(y.astype(np.float32), self.acts)
        np.copyto(y, wide, casting="unsafe")
        return y

    def run_into(self, outs, *inputs) -> bool:
        """The producer's ``run_into`` (the planner's arena), then the activations in place on ``outs[0]``."""
        if not self.inner.run_into(outs, *inputs):
            return False
        self._apply(outs[0])
        return True

    def run(self, *inputs):
        fused = self._fused
        if fused is not None:  # the producer applies them in its own last pass (BatchNormalization)
            got = fused(self.acts, *inputs)
            if got is not None:
                return got
        (y,) = self.inner.run(*inputs)[:1]
        if not (isinstance(y, np.ndarray) and y.flags.writeable and y.flags.owndata and not any(y is x for x in inputs)):
            y = np.array(y, copy=True)
        bounds = self._bounds
        if bounds is None:
            return (self._apply(y),)
        t = y.dtype.type
        for lo, hi in bounds:
            if lo is not None:
                np.maximum(y, t(lo), out=y)
            if hi is not None:
                np.minimum(y, t(hi), out=y)
        return (y,)
