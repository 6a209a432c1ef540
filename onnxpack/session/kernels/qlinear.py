"""The QLinear family: QLinearConv, QLinearMatMul (ai.onnx) and onnxruntime's com.microsoft
QLinearConv, QGemm, QLinearAdd, QLinearMul, QLinearSigmoid, QLinearLeakyRelu, QLinearConcat,
QLinearWhere, QLinearGlobalAveragePool, QLinearAveragePool, QLinearSoftmax, QLinearReduceMean.

Every op computes on 8-bit tensors (int8 or uint8) with (scale, zero point) pairs.  The arithmetic
is onnxruntime's x86 CPU arithmetic where that is plain float32 and can be matched bit for bit:

* Convolutions and GEMMs accumulate exactly in integers (``qinteger.int_conv`` /
  ``int_matmul``), add the int32 bias, convert to float32 (round to nearest even, like
  ``cvtepi32_ps``), multiply by the float32 ``x_scale * w_scale / y_scale``, round half to even
  and add the output zero point, saturating (``MlasRequantizeOutput``).
* QLinearMul: ``float32((a - za) * (b - zb)) * (sa * sb / sc) + zc``, rounded (MLAS' SSE2 kernel).
* QLinearAdd: MLAS' AVX2 kernel's fused multiply-adds of the codes by ``sa / sc`` and ``sb / sc``
  onto one float32 constant of the zero points (see the kernel).
* QLinearGlobalAveragePool: ``float32(sum - zp * n) * (sx / (sy * n))``, rounded (MLAS).
* QLinearSigmoid / QLinearLeakyRelu / QLinearConcat / QLinearWhere: a 256-entry table built like
  onnxruntime's ``QlinearBuildLookupTable`` (dequantize every code, apply, quantize).
* QLinearAveragePool: the float AveragePool (``conv.AveragePool``) of the dequantized input,
  quantized with ``rint(y / sy + zy)`` (onnxruntime's ``quantize_value``).
* QLinearSoftmax: onnxruntime's table of exponentials, in-order float32 row sums and
  ``floor(1 / y_scale)`` (see the kernel).

Where onnxruntime uses fixed-point or approximated arithmetic, we compute the spec's float formula
instead and agree within one quantization step: QLinearSigmoid (MLAS' logistic approximation;
ours is ``1 / (1 + exp(-x))`` in float32), and the symmetric-int8 QLinearConv kernels that fuse
requantization into the GEMM.  QLinearReduceMean has no onnxruntime CPU kernel; it is
``quantize(ReduceMean(dequantize(x)))``.

Pre-packing: the constant weight of QLinearConv (input 3), QLinearMatMul (input 3) and QGemm
(input 3, transB resolved) becomes its integers as float32 in the GEMM layout (see
``qinteger.py``); scales, zero points and the bias are small and read per call.
"""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels._base import Kernel, register
from onnxpack.session.kernels.conv import AveragePool, _pad, _SpatialAttrs, _window
from onnxpack.session.kernels.qdq import _fq_jit, int_range, memo_holds, memo_key, quantize
from onnxpack.session.kernels.qinteger import (
    _EIGHT_BIT_DTYPES,
    PackedConvWeight,
    PackedMatMulWeight,
    check_eight_bit,
    int_conv,
    int_matmul,
    per_channel,
    per_tensor,
    shift,
    span,
)

logger = logging.getLogger(__name__)

__all__ = ["requantize", "lookup_table", "QLinearConv", "QLinearMatMul", "QGemm"]

_F32 = np.dtype(np.float32)
MS = "com.microsoft"


# -- shared arithmetic --------------------------------------------------------------------------


def requantize(acc: np.ndarray, multiplier: np.ndarray | np.float32, zero_point, dtype: np.dtype,
               bias: np.ndarray | None = None) -> np.ndarray:
    """``saturate(rint(float32(acc + bias) * multiplier) + zero_point)`` in ``dtype``.

    ``acc`` holds exact integer accumulators (float32 or float64); the sum with the int32 bias is
    exact in float64 and rounded once to float32, as onnxruntime converts its int32 accumulator.
    """
    if (bias is None and acc.dtype in _ACC_DTYPES and acc.ndim >= 1 and acc.size >= _REQUANT_JIT_MIN
            and (dtype == np.uint8 or dtype == np.int8) and np.ndim(zero_point) == 0):
        mult = np.asarray(multiplier)
        if mult.dtype == _F32 and (mult.size == 1 or mult.shape == acc.shape[-1:]):
            jit = _fq_jit()
            if jit is not None:  # one pass, the same float32 arithmetic (see _qdq_jit.requantize_acc)
                lo, hi = int_range(dtype)
                out = np.empty(acc.shape, dtype)
                jit.requantize_acc(np.ascontiguousarray(acc).reshape(-1, acc.shape[-1]), mult.reshape(-1),
                                   np.float32(0 if zero_point is None else zero_point), np.float32(lo), np.float32(hi),
                                   out.reshape(-1, acc.shape[-1]))
                return out
    if bias is not None:
        acc = acc.astype(np.float64, copy=False) + bias
    f = np.asarray(acc, dtype=np.float32)  # a 0-d array, never a scalar: the ops below write in place
    f *= multiplier
    np.rint(f, out=f)
    if zero_point is not None:
        f += np.float32(zero_point) if np.ndim(zero_point) == 0 else np.asarray(zero_point, dtype=np.float32)
    lo, hi = int_range(dtype)
    np.clip(f, lo, hi, out=f)
    return f.astype(dtype)


_REQUANT_JIT_MIN = 1024  # accumulators from which requantize takes its numba pass
# The accumulators it takes: the int8 GEMM's int32, the exact sgemm's float32 and float64 (integers)
_ACC_DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.float64))


def _zp_value(zp) -> np.float32 | np.ndarray:
    return np.float32(0) if zp is None else np.asarray(zp).astype(np.float32)


def _quantize_f32(v: np.ndarray, scale: np.float32, zp, dtype: np.dtype) -> np.ndarray:
    """MlasQuantizeLinear: ``saturate(rint(v / scale) + zp)`` in float32."""
    q = np.asarray(np.divide(v, scale, dtype=np.float32))
    np.rint(q, out=q)
    q += _zp_value(zp)
    lo, hi = int_range(dtype)
    np.fmax(q, lo, out=q)
    np.fmin(q, hi, out=q)
    return q.astype(dtype)


def lookup_table(dtype: np.dtype, x_scale, x_zp, y_scale, y_zp, fn=None) -> np.ndarray:
    """The 256 output codes of an 8-bit unary op, indexed by the input's byte (``x.view(uint8)``).

    Built like onnxruntime's ``QlinearBuildLookupTable``: every code dequantized as
    ``x_scale * float(code - x_zp)``, mapped by ``fn`` (identity: a requantization), quantized.
    """
    codes = np.arange(256, dtype=np.uint8).view(dtype)
    deq = np.float32(x_scale) * (codes.astype(np.int32) - int(_zp_value(x_zp))).astype(np.float32)
    out = deq if fn is None else fn(deq).astype(np.float32)
    return _quantize_f32(out, np.float32(y_scale), y_zp, dtype)


def _apply_table(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    return table[x.view(np.uint8)]


def _check_same_type(x: np.ndarray, zp, name: str, what: str) -> None:
    if zp is not None and np.asarray(zp).dtype != x.dtype:
        raise InvalidArgument(f"{what}: {name} must have the input's type {x.dtype}, got {np.asarray(zp).dtype}")


def _scalar_f32(value, name: str, what: str) -> np.float32:
    if value is None:
        raise InvalidArgument(f"{what}: {name} is required")
    return np.float32(per_tensor(value, name, what))


class _QKernel(Kernel):
    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.what = f"node {node.name!r} ({node.op_type})"


# -- convolution and GEMMs ------------------------------------------------------------------------


@register("QLinearConv", since=10)
class QLinearConv(PackedConvWeight, _QKernel):
    """``y = quantize(conv(x - x_zp, w - w_zp) * x_scale * w_scale + bias * x_scale * w_scale)``.

    w_scale / w_zero_point may be per output channel; the bias is int32 with scale
    ``x_scale * w_scale``.  com.microsoft's version adds ``channels_last`` (NHWC in and out).
    """

    op_type = "QLinearConv"
    weight_index = 3

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.sp = _SpatialAttrs(self)
        self.group = int(self.attr("group", 1))
        if self.group < 1:
            raise InvalidArgument(f"{self.what}: group must be >= 1, got {self.group}")
        self.channels_last = bool(int(self.attr("channels_last", 0)))
        self._init_weight()

    def run(self, x, x_scale, x_zero_point, w=None, w_scale=None, w_zero_point=None, y_scale=None,
            y_zero_point=None, bias=None):
        what = self.what
        check_eight_bit(x, "x", what)
        if x.ndim < 3:
            raise InvalidArgument(f"{what}: x must be (N, C, D1, ...), got shape {list(x.shape)}")
        if self.channels_last:
            x = np.moveaxis(x, -1, 1)
        _check_same_type(x, x_zero_point, "x_zero_point", what)
        xz = per_tensor(x_zero_point, "x_zero_point", what)
        yz = per_tensor(y_zero_point, "y_zero_point", what)
        out_dtype = yz.dtype if yz is not None else x.dtype
        wf, wspan, wl1 = self._conv_weight(w, w_zero_point, what)
        m = wf.shape[0] * wf.shape[1]
        ws = per_channel(w_scale, m, "w_scale", what)
        acc = int_conv(shift(x, xz), wf, self.sp, self.group, span(x.dtype, xz), wspan, wl1, what)
        cshape = (1, m) + (1,) * (acc.ndim - 2)
        mult = (_scalar_f32(x_scale, "x_scale", what) * ws.astype(np.float32)) / _scalar_f32(y_scale, "y_scale", what)
        b = None
        if bias is not None:
            if bias.size != m:
                raise InvalidArgument(f"{what}: B must have {m} values (one per output channel), got {list(bias.shape)}")
            b = bias.astype(np.int64).reshape(cshape)
        y = requantize(acc, mult.reshape(cshape) if mult.ndim else mult, yz, out_dtype, b)
        if self.channels_last:
            y = np.ascontiguousarray(np.moveaxis(y, 1, -1))
        return (y,)


@register("QLinearConv", domain=MS, since=1)
class QLinearConvMS(QLinearConv):
    domain = MS


def _row_or_scalar(value) -> np.ndarray:
    """A per-tensor or per-row (M,) parameter shaped to broadcast against an (…, M, N) result."""
    value = np.asarray(value)
    if value.size == 1:
        return value.reshape(())
    if value.ndim == 1:
        return value.reshape(-1, 1)
    return value


def _col_or_scalar(value) -> np.ndarray:
    """A per-tensor or per-column (N,) parameter shaped to broadcast against an (…, M, N) result."""
    value = np.asarray(value)
    return value.reshape(()) if value.size == 1 else value


@register("QLinearMatMul", since=10)
class QLinearMatMul(PackedMatMulWeight, _QKernel):
    """``y = quantize((a - a_zp) @ (b - b_zp) * a_scale * b_scale / y_scale + y_zp)``.

    a's and y's parameters are per tensor or per row, b's per tensor or per column; scales may
    be float16/bfloat16 (opset 21, widened to float32).  Non-8-bit types of opset 21 (float8)
    are computed as ``quantize(dequantize(a) @ dequantize(b))``.
    """

    op_type = "QLinearMatMul"
    weight_index = 3

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._init_weight()

    def run(self, a, a_scale, a_zero_point, b=None, b_scale=None, b_zero_point=None, y_scale=None, y_zero_point=None):
        what = self.what
        if a.dtype not in _EIGHT_BIT_DTYPES or (b is not None and b.dtype not in _EIGHT_BIT_DTYPES):
            return (self._float_path(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point),)
        _check_same_type(a, a_zero_point, "a_zero_point", what)
        out_dtype = np.asarray(y_zero_point).dtype if y_zero_point is not None else a.dtype
        bz = None if b_zero_point is None else _col_or_scalar(b_zero_point)
        acc = self._int_matmul(a, a_zero_point, b, bz, what)
        sa = _row_or_scalar(a_scale).astype(np.float32)
        sb = _col_or_scalar(b_scale).astype(np.float32)
        sy = _row_or_scalar(y_scale).astype(np.float32)
        mult = (sa * sb) / sy
        yz = None if y_zero_point is None else _row_or_scalar(y_zero_point)
        return (requantize(acc, mult, yz, out_dtype),)

    def _float_path(self, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp):
        """``quantize(dequantize(a) @ dequantize(b))`` for opset 21's float8 types."""
        what = self.what
        if b is None:
            raise InvalidArgument(f"{what}: B of type float8 is never packed")

        def deq(t, s, zp, shape_fn):
            f = t.astype(np.float32)
            if zp is not None:
                f = f - shape_fn(zp).astype(np.float32)
            return f * shape_fn(s).astype(np.float32)

        y = np.matmul(deq(a, a_scale, a_zp, _row_or_scalar), deq(b, b_scale, b_zp, _col_or_scalar))
        out = np.asarray(y_zp).dtype if y_zp is not None else a.dtype
        ys = np.asarray(y_scale)
        if ys.size == 1:
            return quantize(y, ys.reshape(()), None if y_zp is None else np.asarray(y_zp).reshape(()),
                            out_dtype=out, what=what)
        return quantize(y, ys.reshape(-1), None if y_zp is None else np.asarray(y_zp).reshape(-1),
                        axis=y.ndim - 2, out_dtype=out, what=what)


@register("QGemm", domain=MS, since=1)
class QGemm(PackedMatMulWeight, _QKernel):
    """``Y = alpha * a_scale * b_scale * ((A' - a_zp) @ (B' - b_zp) + C)``, quantized with
    (y_scale, y_zero_point) or returned as float32 when y_scale is absent.

    C is int32 (scale ``a_scale * b_scale``) and broadcasts like Gemm's C; b's parameters are per
    tensor or per column.
    """

    op_type = "QGemm"
    domain = MS
    weight_index = 3

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.0))
        self.trans_a = int(self.attr("transA", 0))
        self.trans_b = int(self.attr("transB", 0))
        self._init_weight()

    def run(self, a, a_scale, a_zero_point, b=None, b_scale=None, b_zero_point=None, c=None, y_scale=None,
            y_zero_point=None):
        what = self.what
        check_eight_bit(a, "A", what)
        if a.ndim != 2:
            raise InvalidArgument(f"{what}: A must be 2-D, got shape {list(a.shape)}")
        if self.trans_a:
            a = a.T
        n = self._n(b, what)
        az = per_tensor(a_zero_point, "a_zero_point", what)
        bz = per_channel(b_zero_point, n, "b_zero_point", what)
        acc = self._int_matmul(np.ascontiguousarray(a) if self.trans_a else a, az, b, bz, what)
        if c is not None:
            acc = acc.astype(np.float64, copy=False) + np.asarray(c, dtype=np.float64)
        bs = per_channel(b_scale, n, "b_scale", what).astype(np.float32)
        mult = (np.float32(self.alpha) * _scalar_f32(a_scale, "a_scale", what)) * bs
        if y_scale is None:
            y = acc.astype(np.float32)
            y *= mult
            return (y,)
        mult = mult / _scalar_f32(y_scale, "y_scale", what)
        yz = per_tensor(y_zero_point, "y_zero_point", what)
        out_dtype = yz.dtype if yz is not None else np.dtype(np.uint8)
        return (requantize(acc, mult, yz, out_dtype),)


# -- elementwise ------------------------------------------------------------------------------------


class _QBinary(_QKernel):
    _memo = None  # (A's dtype, memo_key of the six scale / zero-point inputs, their derived constants)

    def _derived(self, a, b, params: tuple) -> tuple:
        """The op's constants from its six scale and zero-point inputs (``_from_params``),
        validated as :meth:`_params` does; kept while calls bring the same read-only arrays with the
        same values (a model's constants: :func:`.qdq.memo_key`) and an A and B of the type they
        were checked with: the checks and the scalar arithmetic were most of a QLinearAdd call on
        128 x 256 codes (19 -> ~9 us a step).  Arrays a caller may still write (fed inputs) are
        read again at every call."""
        memo = self._memo
        if memo is not None and a.dtype == memo[0] and b.dtype == memo[0] and memo_holds(memo[1], params):
            return memo[2]
        derived = self._from_params(*self._params(a, params[0], params[1], b, *params[2:]), a.dtype)
        key = memo_key(params)
        if key is not None:
            self._memo = (a.dtype, key, derived)
        return derived

    def _from_params(self, sa, za, sb, zb, sc, zc, dtype) -> tuple:
        raise NotImplementedError

    def _params(self, a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp):
        what = self.what
        check_eight_bit(a, "A", what)
        if b.dtype != a.dtype:
            raise InvalidArgument(f"{what}: A and B must have the same type, got {a.dtype} and {b.dtype}")
        for zp, name in ((a_zp, "A_zero_point"), (b_zp, "B_zero_point"), (c_zp, "C_zero_point")):
            _check_same_type(a, zp, name, what)
        return (
            _scalar_f32(a_scale, "A_scale", what), np.float32(_zp_value(per_tensor(a_zp, "A_zero_point", what))),
            _scalar_f32(b_scale, "B_scale", what), np.float32(_zp_value(per_tensor(b_zp, "B_zero_point", what))),
            _scalar_f32(c_scale, "C_scale", what), np.float32(_zp_value(per_tensor(c_zp, "C_zero_point", what))),
        )


@register("QLinearAdd", domain=MS, since=1)
class QLinearAdd(_QBinary):
    """``C = A + B`` on codes, with numpy broadcasting, in onnxruntime's x86 (AVX2) arithmetic.

    MLAS folds the zero points into one float32 constant ``zc - (ra * za + rb * zb)`` (the first
    product fused, ``ra = sa / sc`` and ``rb = sb / sc`` in float32), then per element
    ``fma(a, ra, fma(b, rb, constant))``; where its broadcaster hands it A as one value per span,
    ``fma(b, rb, fma(a, ra, constant))`` (the compiler fuses the span's ``constant + a * ra``).
    The result is rounded to even and saturated through int32 and int16 to 8 bits.  The numba
    kernel computes the fused multiply-adds as LLVM's float32 ``fma``; the numpy path in float64,
    rounded once: exact, a code times a ratio having at most 32 significant bits (the two agree
    on every code pair at 40 random scale sets).  (``quantize(dequantize(A) + dequantize(B))`` gave another code for ~5 in
    a million values, near rounding ties: 9 of all 65,536 code pairs at 30 random scale sets.)
    """

    op_type = "QLinearAdd"
    domain = MS

    def _from_params(self, sa, za, sb, zb, sc, zc, dtype) -> tuple:
        with np.errstate(all="ignore"):
            ra, rb = np.float32(sa / sc), np.float32(sb / sc)
            constant = np.float32(zc - _fma32(ra, za, np.float32(rb * zb)))
        return (ra, rb, constant) + int_range(dtype)

    def run(self, a, a_scale, a_zero_point=None, b=None, b_scale=None, b_zero_point=None, c_scale=None,
            c_zero_point=None):
        ra, rb, constant, lo, hi = self._derived(a, b, (a_scale, a_zero_point, b_scale, b_zero_point, c_scale,
                                                        c_zero_point))
        shape = a.shape if a.shape == b.shape else np.broadcast_shapes(a.shape, b.shape)
        with np.errstate(all="ignore"):
            jit = _fq_jit() if math.prod(shape) >= _ADD_JIT_MIN else None
            if jit is not None:
                # One vectorized pass, the same arithmetic (numpy's below: ~11 passes over float64
                # arrays; 128 x 1024 codes 306 -> 11 us, onnxruntime 17); a broadcast operand made whole.
                out = np.empty(shape, a.dtype)
                flat = _flat_operands(a, b, shape)
                jit.qlinear_add(flat[0], flat[1], ra, rb, constant, _a_per_span(a.shape, b.shape, shape), lo, hi,
                                out.reshape(-1))
                return (out,)
            if _a_per_span(a.shape, b.shape, shape):
                acc = _fma32(b, rb, _fma32(a, ra, constant))
            else:
                acc = _fma32(a, ra, _fma32(b, rb, constant))
            q = np.asarray(np.rint(np.broadcast_to(acc, shape).astype(np.float64)))  # (0-d: an array, not a scalar)
        q[~(np.abs(q) < 2.0 ** 31)] = -(2.0 ** 31)  # cvtps2dq's answer out of range (and NaN)
        return (np.clip(q, lo, hi).astype(a.dtype),)


_ADD_JIT_MIN = 64  # codes from which QLinearAdd and QLinearMul take their numba kernels


def _flat_operands(a: np.ndarray, b: np.ndarray, shape: tuple[int, ...]) -> list[np.ndarray]:
    """``a`` and ``b`` as flat C arrays of the broadcast ``shape`` (no copy when already so)."""
    return [x.reshape(-1) if x.shape == shape and x.flags.c_contiguous
            else np.ascontiguousarray(np.broadcast_to(x, shape)).reshape(-1) for x in (a, b)]


def _fma32(x, y, z) -> np.ndarray:
    """float32 ``x * y + z`` rounded once (``x`` or ``y`` an 8-bit code or zero point: the
    float64 product is exact, and so is its sum with a float32 ``z`` of similar magnitude)."""
    return np.asarray(np.asarray(x, np.float64) * np.asarray(y, np.float64) + np.asarray(z, np.float64)).astype(np.float32)


def _a_per_span(a_shape: tuple, b_shape: tuple, shape: tuple) -> bool:
    """Whether onnxruntime's broadcaster passes A to QLinearAdd as one value per span: A is
    broadcast along the innermost dimension of the output larger than 1 and B is not (or the
    output has one element)."""
    n = len(shape)
    a_full = (1,) * (n - len(a_shape)) + tuple(a_shape)
    b_full = (1,) * (n - len(b_shape)) + tuple(b_shape)
    for d in range(n - 1, -1, -1):
        if shape[d] != 1:
            return a_full[d] == 1 and b_full[d] != 1
    return True


@register("QLinearMul", domain=MS, since=1)
class QLinearMul(_QBinary):
    """``C = rint(float32((A - za) * (B - zb)) * (sa * sb / sc) + zc)``, saturated (MLAS' x86 kernel)."""

    op_type = "QLinearMul"
    domain = MS

    def _from_params(self, sa, za, sb, zb, sc, zc, dtype) -> tuple:
        with np.errstate(all="ignore"):
            mult = np.float32(np.float32(sa * sb) / sc)
        return (za, zb, mult, zc) + int_range(dtype) + (bool(np.isfinite(mult)),)

    def run(self, a, a_scale, a_zero_point=None, b=None, b_scale=None, b_zero_point=None, c_scale=None,
            c_zero_point=None):
        za, zb, mult, zc, lo, hi, finite = self._derived(a, b, (a_scale, a_zero_point, b_scale, b_zero_point, c_scale,
                                                                c_zero_point))
        shape = a.shape if a.shape == b.shape else np.broadcast_shapes(a.shape, b.shape)
        jit = _fq_jit() if finite and math.prod(shape) >= _ADD_JIT_MIN else None
        if jit is not None:  # (one pass, the same float32 arithmetic: see QLinearAdd)
            out = np.empty(shape, a.dtype)
            flat = _flat_operands(a, b, shape)
            jit.qlinear_mul(flat[0], flat[1], za, zb, mult, zc, lo, hi, out.reshape(-1))
            return (out,)
        prod = np.asarray(shift(a, za) * shift(b, zb))  # |product| <= 65025: exact in float32
        prod *= mult
        prod += zc
        np.rint(prod, out=prod)
        np.clip(prod, lo, hi, out=prod)
        return (prod.astype(a.dtype),)


class _QUnaryTable(_QKernel):
    """An 8-bit unary op computed through a 256-entry lookup table."""

    def _fn(self, v: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def run(self, x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        what = self.what
        check_eight_bit(x, "X", what)
        _check_same_type(x, x_zero_point, "X_zero_point", what)
        _check_same_type(x, y_zero_point, "Y_zero_point", what)
        table = lookup_table(x.dtype, _scalar_f32(x_scale, "X_scale", what), per_tensor(x_zero_point, "X_zero_point", what),
                             _scalar_f32(y_scale, "Y_scale", what), per_tensor(y_zero_point, "Y_zero_point", what), self._fn)
        return (_apply_table(x, table),)


@register("QLinearSigmoid", domain=MS, since=1)
class QLinearSigmoid(_QUnaryTable):
    op_type = "QLinearSigmoid"
    domain = MS

    def _fn(self, v):
        with np.errstate(over="ignore"):
            return np.float32(1) / (np.float32(1) + np.exp(-v))


@register("QLinearLeakyRelu", domain=MS, since=1)
class QLinearLeakyRelu(_QUnaryTable):
    op_type = "QLinearLeakyRelu"
    domain = MS

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.alpha = np.float32(self.attr("alpha", 0.01))

    def _fn(self, v):
        return np.where(v >= 0, v, v * self.alpha)


@register("QLinearConcat", domain=MS, since=1)
class QLinearConcat(_QKernel):
    """Inputs ``Y_scale, Y_zero_point, (X_i, X_i_scale, X_i_zero_point)...``: each X_i is
    requantized to Y's parameters (copied when they are equal), then concatenated on ``axis``."""

    op_type = "QLinearConcat"
    domain = MS

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        if "axis" not in self.attrs:
            raise InvalidArgument(f"{self.what}: attribute axis is required")
        self.axis = int(self.attr("axis"))
        if len(node.input) < 5 or (len(node.input) - 2) % 3:
            raise InvalidArgument(
                f"{self.what}: expected Y_scale, Y_zero_point and (tensor, scale, zero point) triples, "
                f"got {len(node.input)} inputs"
            )

    def run(self, y_scale, y_zero_point, *triples):
        what = self.what
        sy = _scalar_f32(y_scale, "Y_scale", what)
        yz = per_tensor(y_zero_point, "Y_zero_point", what)
        parts = []
        for k in range(0, len(triples), 3):
            x, sx, xz = triples[k : k + 3]
            check_eight_bit(x, f"input {k // 3}", what)
            if x.dtype != yz.dtype:
                raise InvalidArgument(f"{what}: input {k // 3} has type {x.dtype}, Y_zero_point {yz.dtype}")
            sx = _scalar_f32(sx, f"input {k // 3} scale", what)
            xz = per_tensor(xz, f"input {k // 3} zero point", what)
            if sx == sy and (xz if xz is not None else 0) == yz:
                parts.append(x)
            else:
                parts.append(_apply_table(x, lookup_table(x.dtype, sx, xz, sy, yz)))
        rank = parts[0].ndim
        axis = self.axis + rank if self.axis < 0 else self.axis
        if not 0 <= axis < rank:
            raise InvalidArgument(f"{what}: axis {self.axis} out of range for rank {rank}")
        return (np.concatenate(parts, axis=axis),)


@register("QLinearWhere", domain=MS, since=1)
class QLinearWhere(_QKernel):
    """``Z = where(condition, requantize(X -> Z), requantize(Y -> Z))``."""

    op_type = "QLinearWhere"
    domain = MS

    def run(self, condition, x, x_scale, x_zero_point, y, y_scale, y_zero_point, z_scale, z_zero_point):
        what = self.what
        check_eight_bit(x, "X", what)
        sz = _scalar_f32(z_scale, "z_scale", what)
        zz = per_tensor(z_zero_point, "z_zero_point", what)
        vals = []
        for t, s, zp, name in ((x, x_scale, x_zero_point, "x"), (y, y_scale, y_zero_point, "y")):
            if t.dtype != x.dtype:
                raise InvalidArgument(f"{what}: X and Y must have the same type, got {x.dtype} and {t.dtype}")
            s = _scalar_f32(s, f"{name}_scale", what)
            zp = per_tensor(zp, f"{name}_zero_point", what)
            if s == sz and (0 if zp is None else zp) == (0 if zz is None else zz):
                vals.append(t)
            else:
                vals.append(_apply_table(t, lookup_table(t.dtype, s, zp, sz, zz)))
        return (np.where(np.asarray(condition, dtype=bool), vals[0], vals[1]),)


# -- pools and reductions ---------------------------------------------------------------------------


@register("QLinearGlobalAveragePool", domain=MS, since=1)
class QLinearGlobalAveragePool(_QKernel):
    """``y = rint(float32(sum(x) - x_zp * n) * (x_scale / (y_scale * n))) + y_zp`` per (image,
    channel), saturated; ``channels_last`` reads (N, *spatial, C) and writes (N, 1.., C)."""

    op_type = "QLinearGlobalAveragePool"
    domain = MS

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.channels_last = bool(int(self.attr("channels_last", 0)))

    def run(self, x, x_scale, x_zero_point, y_scale, y_zero_point):
        what = self.what
        check_eight_bit(x, "X", what)
        if x.ndim < 3:
            raise InvalidArgument(f"{what}: X must be (N, C, D1, ...), got shape {list(x.shape)}")
        axes = tuple(range(1, x.ndim - 1)) if self.channels_last else tuple(range(2, x.ndim))
        return (_global_average(x, axes, x_scale, x_zero_point, y_scale, y_zero_point, what),)


def _global_average(x, axes, x_scale, x_zero_point, y_scale, y_zero_point, what: str) -> np.ndarray:
    """QLinearGlobalAveragePool's integer arithmetic over ``axes`` (kept as 1s)."""
    n = math.prod(x.shape[a] for a in axes)
    xz = per_tensor(x_zero_point, "x_zero_point", what)
    yz = per_tensor(y_zero_point, "y_zero_point", what)
    acc = x.sum(axis=axes, keepdims=True, dtype=np.int64)
    if xz is not None:
        acc -= int(xz) * n
    sx, sy = _scalar_f32(x_scale, "x_scale", what), _scalar_f32(y_scale, "y_scale", what)
    mult = np.float32(sx / np.float32(sy * np.float32(n)))
    out_dtype = yz.dtype if yz is not None else x.dtype
    return requantize(acc.astype(np.float64), mult, yz, out_dtype)


@register("QLinearAveragePool", domain=MS, since=1)
class QLinearAveragePool(_QKernel):
    """Average pooling of quantized ``X`` in onnxruntime's arithmetic: each code dequantized to
    float32 (``x_scale * (x - x_zp)``), a window's values summed in float32 in row-major window
    order (padding and the ceil_mode overhang skipped), divided by the count (the window's valid
    elements, or the kernel's size with ``count_include_pad``), then ``rint(y / y_scale + y_zp)``
    saturated.  A window covering the whole unpadded input is onnxruntime's global average pool
    (:class:`QLinearGlobalAveragePool`'s integer sum).  Zero padding adds exact zeros to the
    running sums, so one vectorized pass per kernel offset gives the same sums."""

    op_type = "QLinearAveragePool"
    domain = MS

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.channels_last = bool(int(self.attr("channels_last", 0)))
        self.count_include_pad = bool(int(self.attr("count_include_pad", 0)))
        self._pool = AveragePool(node, ctx)  # (its attributes and output geometry)

    def run(self, x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        what = self.what
        check_eight_bit(x, "X", what)
        if x.ndim < 3:
            raise InvalidArgument(f"{what}: X must be (N, C, D1, ...), got shape {list(x.shape)}")
        if self.channels_last:
            x = np.moveaxis(x, -1, 1)
        ks, strides, dils, begin, end, out, extent = self._pool._geometry(x)
        spatial = x.shape[2:]
        if tuple(ks) == tuple(spatial) and not any(begin) and not any(self._pool.sp.pads or ()):
            axes = tuple(range(2, x.ndim))
            y = _global_average(x, axes, x_scale, x_zero_point, y_scale, y_zero_point, what)
        else:
            y = self._windows(x, ks, strides, dils, begin, out, extent, spatial, x_scale, x_zero_point,
                              y_scale, y_zero_point)
        if self.channels_last:
            y = np.ascontiguousarray(np.moveaxis(y, 1, -1))
        return (y,)

    def _windows(self, x, ks, strides, dils, begin, out, extent, spatial, x_scale, x_zero_point, y_scale,
                 y_zero_point):
        what = self.what
        xz = per_tensor(x_zero_point, "x_zero_point", what)
        yz = per_tensor(y_zero_point, "y_zero_point", what)
        xf = _scalar_f32(x_scale, "x_scale", what) * shift(x, xz)
        xp = _pad(xf, begin, extent, 0.0)
        acc = None
        for offset in itertools.product(*(range(k) for k in ks)):
            win = xp[(Ellipsis,) + _window(offset, out, strides, dils)]
            if acc is None:
                acc = win.astype(np.float32, copy=True)
            else:
                acc += win
        if self.count_include_pad:
            count = np.float32(math.prod(ks))
        else:  # per axis: window positions inside the input, their product
            count = np.ones((1, 1) + (1,) * len(out), np.float32)
            for i, (o, s, k, d, b, n) in enumerate(zip(out, strides, ks, dils, begin, spatial)):
                pos = np.arange(o)[:, None] * s - b + np.arange(k)[None, :] * d
                valid = ((pos >= 0) & (pos < n)).sum(axis=1).astype(np.float32)
                shape = [1] * (2 + len(out))
                shape[2 + i] = o
                count = count * valid.reshape(shape)
        acc /= count
        q = np.asarray(np.divide(acc, _scalar_f32(y_scale, "y_scale", what), dtype=np.float32))
        q += _zp_value(yz)
        np.rint(q, out=q)
        lo, hi = int_range(x.dtype)
        np.clip(q, lo, hi, out=q)
        return q.astype(x.dtype)


@register("QLinearSoftmax", domain=MS, since=1)
class QLinearSoftmax(_QKernel):
    """Softmax of quantized ``X`` as onnxruntime computes it; attribute ``opset`` < 13 flattens
    from ``axis`` (default 1) like Softmax-1/11, >= 13 normalizes along ``axis`` only (default -1).

    onnxruntime does not dequantize: it looks each code's exponential up in a table of 256 floats
    (``exp((i - 255 + shift) * x_scale)``, ``shift`` keeping a row's sum finite), sums a row's
    values in float32 in order, and writes ``rint(v * floor(1 / y_scale) / sum) + y_zero_point``.
    ``floor(1 / y_scale)`` is not ``1 / y_scale`` (255 for the quantizer's 1/256 ... but 254 for
    1/255), so ``quantize(softmax(dequantize(X)))`` differs from it by a code in ~10 % of the
    values, and an attention probability one code off moved a quantized transformer's outputs
    by up to 10 steps.  The same table, sum order and rounding give onnxruntime's codes (checked
    against it on random rows of 1-3,000 codes, scales and zero points).  Where onnxruntime's
    int8 kernel would wrap a code past 127 around, this one saturates (as its uint8 kernel and
    current builds do); ``X``'s zero point does not matter (a softmax ignores a common shift).
    """

    op_type = "QLinearSoftmax"
    domain = MS

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        if "opset" not in self.attrs:
            raise InvalidArgument(f"{self.what}: attribute opset is required")
        self.opset = int(self.attr("opset"))
        self.axis = int(self.attr("axis", 1 if self.opset < 13 else -1))
        self._tables: dict[tuple[float, int], np.ndarray] = {}

    def _table(self, x_scale: np.float32, d: int) -> np.ndarray:
        """The 256 exponentials for a row of ``d`` codes, indexed by ``code - max code + 255``."""
        key = (float(x_scale), d)
        table = self._tables.get(key)
        if table is None:
            with np.errstate(all="ignore"):
                # log(FLT_MAX / d), the division in float32; minus 5 bits of headroom for the sum.
                shift = max(0.0, math.log(float(np.float32(_FLT_MAX) / np.float32(d))) - 5.0)
                shift = np.float64(shift) / np.float64(x_scale)
                args = ((np.arange(256, dtype=np.float64) - 255.0) + shift) * np.float64(x_scale)
                table = np.array([math.exp(a) if not a >= 709.0 else math.inf for a in args.tolist()],
                                 np.float64).astype(np.float32)
            if len(self._tables) < 64:
                self._tables[key] = table
        return table

    def run(self, x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        what = self.what
        check_eight_bit(x, "X", what)
        rank = x.ndim
        axis = self.axis + rank if self.axis < 0 else self.axis
        if not 0 <= axis < max(rank, 1):
            raise InvalidArgument(f"{what}: axis {self.axis} out of range for rank {rank}")
        per_tensor(x_zero_point, "x_zero_point", what)
        yz = per_tensor(y_zero_point, "y_zero_point", what)
        xs = _scalar_f32(x_scale, "X_scale", what)
        ys = _scalar_f32(y_scale, "y_scale", what)
        out_dtype = yz.dtype if yz is not None else x.dtype
        if x.size == 0:
            return (np.zeros(x.shape, out_dtype),)
        if rank == 0:
            rows = x.reshape(1, 1)
        elif self.opset < 13:
            rows = x.reshape(math.prod(x.shape[:axis]), -1)
        else:
            rows = np.moveaxis(x, axis, -1)
        table = self._table(xs, rows.shape[-1])
        lo, hi = int_range(out_dtype)
        jit = _fq_jit() if x.size >= _SOFTMAX_JIT_MIN else None
        if jit is not None:
            # One pass a row, the same table, sum order and rounding (the numpy passes below: a
            # (1, 4, 128, 128) attention map 540 -> ~60 us on one Zen 5 core).
            with np.errstate(all="ignore"):
                y_int = np.float64(np.floor(np.float32(1.0) / ys))
            flat = np.ascontiguousarray(rows).reshape(-1, rows.shape[-1])
            y = np.empty(flat.shape, out_dtype)
            jit.qsoftmax_rows(flat, table, y_int, np.float64(_zp_value(yz)), np.float64(lo), np.float64(hi), y)
            y = y.reshape(rows.shape)
            if rank == 0:
                return (y.reshape(()),)
            if self.opset < 13:
                return (y.reshape(x.shape),)
            return (np.ascontiguousarray(np.moveaxis(y, -1, axis)),)
        codes = rows.astype(np.int32)
        values = table[codes - codes.max(axis=-1, keepdims=True) + 255]
        total = np.cumsum(values, axis=-1, dtype=np.float32)[..., -1:]  # in order, as onnxruntime adds
        with np.errstate(all="ignore"):
            y_int = np.floor(np.float32(1.0) / ys)
            q = np.rint(values.astype(np.float64) * np.float64(y_int) / total.astype(np.float64))
        q = np.nan_to_num(q, nan=0.0, posinf=hi, neginf=lo) + _zp_value(yz)
        y = np.clip(q, lo, hi).astype(out_dtype)
        if rank == 0:
            return (y.reshape(()),)
        if self.opset < 13:
            return (y.reshape(x.shape),)
        return (np.ascontiguousarray(np.moveaxis(y, -1, axis)),)


_FLT_MAX = np.finfo(np.float32).max
_SOFTMAX_JIT_MIN = 256  # codes from which QLinearSoftmax takes its numba kernel


@register("QLinearReduceMean", domain=MS, since=1)
class QLinearReduceMean(_QKernel):
    """``quantize(ReduceMean(dequantize(data), axes, keepdims))`` in float32."""

    op_type = "QLinearReduceMean"
    domain = MS

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        for required in ("axes", "keepdims"):
            if required not in self.attrs:
                raise InvalidArgument(f"{self.what}: attribute {required} is required")
        self.axes = tuple(int(a) for a in self.attr("axes"))
        self.keepdims = bool(int(self.attr("keepdims")))

    def run(self, data, data_scale, data_zero_point=None, reduced_scale=None, reduced_zero_point=None):
        what = self.what
        check_eight_bit(data, "data", what)
        rank = data.ndim
        axes = tuple(sorted({a + rank if a < 0 else a for a in self.axes}))
        if any(not 0 <= a < rank for a in axes):
            raise InvalidArgument(f"{what}: axes {list(self.axes)} out of range for rank {rank}")
        xz = per_tensor(data_zero_point, "data_zero_point", what)
        yz = per_tensor(reduced_zero_point, "reduced_zero_point", what)
        v = _scalar_f32(data_scale, "data_scale", what) * shift(data, xz)
        mean = v.mean(axis=axes or None, keepdims=self.keepdims, dtype=np.float32)
        out_dtype = yz.dtype if yz is not None else data.dtype
        return (_quantize_f32(np.asarray(mean, dtype=np.float32), _scalar_f32(reduced_scale, "reduced_scale", what), yz, out_dtype),)
