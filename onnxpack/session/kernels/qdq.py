"""QuantizeLinear, DequantizeLinear (ai.onnx 10-25 and com.microsoft 1) and DynamicQuantizeLinear.

The arithmetic follows onnxruntime's CPU kernels, which follow the spec:

* ``DequantizeLinear``: ``y = float32(int32(x) - zero_point) * float32(scale)``, then cast to the
  output dtype (the scale's dtype, or ``output_dtype`` from opset 23).  Half-precision scales are
  widened, the product rounded once (onnxruntime does the same).
* ``QuantizeLinear``: ``q = x / scale`` in float32 (or the ``precision`` attribute's dtype),
  rounded half to even (``np.rint``), plus the zero point, saturated to the output type's range.
  NaN saturates to the type's minimum, as onnxruntime's ``max(x, lo)`` does.  Float 8/6/4 outputs
  are cast with round-to-nearest-even; ``saturate=1`` (the default) clips to the type's largest
  finite value first, ``saturate=0`` keeps ml_dtypes' overflow behaviour (NaN or Inf, the spec's
  table).
* ``DynamicQuantizeLinear`` (uint8): ``scale = (max(x, 0) - min(x, 0)) / 255`` (1.0 when the range
  is empty, onnxruntime's choice; the spec would divide by zero), ``zero_point =
  rint(clip(-min / scale, 0, 255))``, all in float32 like onnxruntime's ``GetQuantizationParameter``
  (onnx.reference computes differently and disagrees with onnxruntime by one step on ties).

Granularity (one helper for both directions): a scalar / one-element scale is per-tensor;
a 1-D scale is per-axis along ``axis``; with ``block_size`` the scale has the input's rank and
``ceil(D_axis / block_size)`` on the axis, each scale covering ``block_size`` consecutive elements
(the last block may be short).

Types: int8, uint8, int16, uint16, int32 (DequantizeLinear only: the bias), int4, uint4, int2,
uint2 (ml_dtypes, one element per byte, as the session holds them), float8 e4m3fn / e4m3fnuz /
e5m2 / e5m2fnuz, float4 e2m1 and float6 e2m3 / e3m2; scales float32, float16, bfloat16 and
float8 e8m0.

The pure helpers :func:`dequantize` and :func:`quantize` are public: a session-level fusion can
call ``dequantize`` to fold a constant DequantizeLinear into its consumer's packed weight.
"""

from __future__ import annotations

import math

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.graph._proto import tensor_dtype_to_np_dtype
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, KernelContext, register, register_fused


__all__ = [
    "dequantize",
    "quantize",
    "int_range",
    "is_float_quant",
    "dynamic_qparams",
    "QuantizeLinear",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "FakeQuant",
]

# Integer quantized types: name -> (lowest, highest).  ml_dtypes' int4/uint4/int2/uint2 have
# numpy kind "V", so they are looked up by name, not by np.iinfo.
_INT_RANGES: dict[str, tuple[int, int]] = {
    "int8": (-128, 127),
    "uint8": (0, 255),
    "int16": (-32768, 32767),
    "uint16": (0, 65535),
    "int32": (-(2**31), 2**31 - 1),
    "int4": (-8, 7),
    "uint4": (0, 15),
    "int2": (-2, 1),
    "uint2": (0, 3),
}

# Small float quantized types and their largest finite value (the saturation bound).
_FLOAT_MAX: dict[str, float] = {
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
    "float4_e2m1fn": 6.0,
    "float6_e2m3fn": 7.5,
    "float6_e3m2fn": 28.0,
}
# Types without an infinity or NaN encoding: a cast always saturates (the spec's saturate
# attribute "has no effect" for them).
_ALWAYS_SATURATE = ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn")

_F32 = np.dtype(np.float32)


def memo_key(values: tuple) -> tuple | None:
    """What a kernel keeps a memo of constants derived from ``values`` (scales, zero points; None
    for an omitted input) under: the arrays and a copy of each one's dtype, shape and bytes; None
    when one of them is not a read-only ndarray (a caller may still write it: read at every call).

    Read-only is not unchanging: a fed array may be a read-only view of a buffer its owner writes,
    or an array its owner sets writable, changes and sets read-only again, and the next run then
    brings the same object with other values.  :func:`memo_holds` compares the copies too (~0.2 us
    a small array): a memo never answers for values other than those it was made from."""
    if all(v is None or (type(v) is np.ndarray and not v.flags.writeable) for v in values):
        return tuple(values), tuple(None if v is None else (v.dtype, v.shape, v.tobytes()) for v in values)
    return None


def memo_holds(key: tuple | None, values: tuple) -> bool:
    """Whether ``values`` are the very arrays :func:`memo_key` made ``key`` from, with the same
    dtype, shape and bytes."""
    if key is None:
        return False
    kept, copies = key
    if len(values) != len(kept):
        return False
    for v, k, c in zip(values, kept, copies):
        if v is not k:
            return False
        if v is not None and (v.dtype != c[0] or v.shape != c[1] or v.tobytes() != c[2]):
            return False
    return True


def int_range(dtype: np.dtype) -> tuple[int, int] | None:
    """(lowest, highest) of an integer quantized type, ``None`` for any other dtype."""
    try:
        return _RANGE_OF[dtype]
    except (KeyError, TypeError):  # (TypeError: an unhashable spelling of a dtype)
        got = _INT_RANGES.get(np.dtype(dtype).name)
        if len(_RANGE_OF) < 64:
            try:
                _RANGE_OF[dtype] = got
            except TypeError:
                pass
        return got


# int_range's answers by the dtype object itself: numpy builds ``dtype.name`` in Python at every
# access (~2 us), and the quantized kernels ask several times a call (a QOperator BERT's run asked
# ~150 times).
_RANGE_OF: dict = {}


def is_float_quant(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name in _FLOAT_MAX


def _np_dtype(elem_type: int, what: str) -> np.dtype:
    try:
        return np.dtype(tensor_dtype_to_np_dtype(int(elem_type)))
    except Exception as exc:  # an unknown or unmapped TensorProto type
        raise InvalidArgument(f"{what}: unsupported element type {elem_type}") from exc


def _as_f32(a: np.ndarray) -> np.ndarray:
    """Widen quantized integers or small floats to float32 (int32 via int64: exact subtraction)."""
    a = np.asarray(a)
    if a.dtype == _F32:
        return a
    return a.astype(np.float32)


def _param(value: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int, what: str) -> np.ndarray:
    """A scale or zero point laid out to broadcast against an input of ``shape``.

    Per-tensor values come back 0-d, per-axis values with ones everywhere but ``axis``, blocked
    values repeated ``block_size`` times along ``axis`` (cut to the input's extent).
    """
    value = np.asarray(value)
    if value.size == 1 and not block_size:
        return value.reshape(())
    rank = len(shape)
    if rank == 0:
        raise InvalidArgument(f"{what}: a scalar input needs a per-tensor scale, got shape {list(value.shape)}")
    ax = axis + rank if axis < 0 else axis
    if not 0 <= ax < rank:
        raise InvalidArgument(f"{what}: axis {axis} is out of range for an input of rank {rank}")
    if not block_size:
        if value.ndim != 1 or value.shape[0] != shape[ax]:
            raise InvalidArgument(
                f"{what}: per-axis scale/zero point must be 1-D of length {shape[ax]} (input "
                f"{list(shape)}, axis {axis}), got shape {list(value.shape)}"
            )
        return value.reshape((1,) * ax + (-1,) + (1,) * (rank - ax - 1))
    if block_size < 0:
        raise InvalidArgument(f"{what}: block_size must be positive, got {block_size}")
    want = tuple(-(-d // block_size) if i == ax else d for i, d in enumerate(shape))
    if value.shape != want:
        raise InvalidArgument(
            f"{what}: blocked scale/zero point must have shape {list(want)} (input {list(shape)}, "
            f"axis {axis}, block_size {block_size}), got {list(value.shape)}"
        )
    rep = np.repeat(value, block_size, axis=ax)
    if rep.shape[ax] != shape[ax]:
        rep = rep[(slice(None),) * ax + (slice(0, shape[ax]),)]
    return rep


def dequantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None, axis: int = 1,
               block_size: int = 0, *, out_dtype: np.dtype | None = None, what: str = "DequantizeLinear") -> np.ndarray:
    """``(x - zero_point) * scale`` as onnxruntime computes it, in ``out_dtype`` (default: the
    scale's dtype; float32 for a float8 e8m0 scale).

    Integers are subtracted exactly (int32 via int64) and converted to float32 once; small-float
    inputs are widened to float32.  The product is computed in float32 and rounded once to the
    output dtype.
    """
    x = np.asarray(x)
    scale = np.asarray(scale)
    if out_dtype is None:
        out_dtype = scale.dtype if scale.dtype.name in ("float32", "float16", "bfloat16", "float64") else _F32
    out_dtype = np.dtype(out_dtype)
    s = _param(scale, x.shape, axis, block_size, what)
    s = s.astype(np.float32) if s.dtype != _F32 else s
    if int_range(x.dtype) is not None:
        zpv = None if zero_point is None else np.asarray(zero_point)
        if zpv is None or not zpv.astype(np.int64).any():
            dx = x.astype(np.float32)
        elif x.dtype.kind in "iu" and x.dtype.itemsize == 1:  # the difference is exact in float32
            dx = np.asarray(np.subtract(x, _param(zpv, x.shape, axis, block_size, what), dtype=np.float32))
        else:  # 16/32-bit: subtract exactly in int64, round once to float32 (int32(x) - zp in onnxruntime)
            zp = _param(zpv.astype(np.int64), x.shape, axis, block_size, what)
            dx = np.asarray(x.astype(np.int64) - zp).astype(np.float32)
    elif is_float_quant(x.dtype) or x.dtype.kind == "f" or x.dtype.name == "bfloat16":
        dx = x.astype(np.float32)  # a fresh array: the product below may write into it
        if zero_point is not None and np.asarray(zero_point).astype(np.float32).any():
            dx -= _param(np.asarray(zero_point), x.shape, axis, block_size, what).astype(np.float32)
    else:
        raise InvalidArgument(f"{what}: cannot dequantize a tensor of type {x.dtype}")
    y = np.multiply(dx, s, out=dx if dx.shape == np.broadcast_shapes(dx.shape, s.shape) else None)
    return y if y.dtype == out_dtype else y.astype(out_dtype)


def quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None, axis: int = 1,
             block_size: int = 0, *, out_dtype: np.dtype | None = None, saturate: bool = True,
             precision: np.dtype | None = None, what: str = "QuantizeLinear") -> np.ndarray:
    """``saturate(rint(x / scale) + zero_point)`` in the zero point's dtype (or ``out_dtype``,
    default uint8).  See the module docstring for rounding, NaN and small-float rules."""
    x = np.asarray(x)
    scale = np.asarray(scale)
    if zero_point is not None:
        zero_point = np.asarray(zero_point)
        if out_dtype is not None and np.dtype(out_dtype) != zero_point.dtype:
            raise InvalidArgument(
                f"{what}: output_dtype {np.dtype(out_dtype)} differs from the zero point's type {zero_point.dtype}"
            )
        out_dtype = zero_point.dtype
    out_dtype = np.dtype(out_dtype if out_dtype is not None else np.uint8)
    cd = np.dtype(precision) if precision is not None else _F32
    if cd.name not in ("float32", "float64", "float16", "bfloat16"):
        cd = _F32
    if (cd == _F32 and x.dtype == _F32 and scale.size == 1 and scale.dtype == _F32 and not block_size
            and x.size >= _QUANTIZE_JIT_MIN and (out_dtype == np.uint8 or out_dtype == np.int8)
            and (zero_point is None or zero_point.size == 1)):
        # A per-tensor 8-bit quantization (an activation's): one numba pass, the same arithmetic
        # as below (a QOperator BERT's (128, 1024) QuantizeLinear 68 -> ~15 us on one Zen 5 core).
        jit = _fq_jit()
        if jit is not None:
            lo, hi = int_range(out_dtype)
            zp = np.float32(0) if zero_point is None else np.float32(zero_point.reshape(()))
            out = np.empty(x.shape, out_dtype)
            jit.quantize_8bit(np.ascontiguousarray(x).reshape(-1), np.float32(scale.reshape(())), zp, np.float32(lo),
                              np.float32(hi), out.reshape(-1))
            return out
    s = _param(scale, x.shape, axis, block_size, what)
    xs = x.astype(cd) if x.dtype != cd else x
    q = np.asarray(np.divide(xs, s.astype(cd) if s.dtype != cd else s))  # a 0-d array, never a scalar
    if q.dtype != _F32 and cd != np.float64:
        q = q.astype(np.float32)
    zp = None
    if zero_point is not None and zero_point.astype(np.float32).any():
        zp = _param(zero_point, x.shape, axis, block_size, what)
    rng = int_range(out_dtype)
    if rng is not None and out_dtype != np.int32:
        np.rint(q, out=q)
        if zp is not None:
            q = np.add(q, zp.astype(q.dtype), out=q if q.shape == np.broadcast_shapes(q.shape, zp.shape) else None)
        # fmax/fmin (not clip): NaN becomes the lowest value, as onnxruntime's max(x, lo) does.
        np.fmax(q, rng[0], out=q)
        np.fmin(q, rng[1], out=q)
        if out_dtype.kind in "iu":
            return q.astype(out_dtype)
        return q.astype(np.int8).astype(out_dtype)  # ml_dtypes int4/uint4/int2/uint2
    if is_float_quant(out_dtype):
        if zp is not None:
            q = q + _as_f32(zp)
        if saturate or out_dtype.name in _ALWAYS_SATURATE:
            m = _FLOAT_MAX[out_dtype.name]
            q = np.clip(q, -m, m)  # NaN stays NaN; +-Inf becomes +-max
        with np.errstate(over="ignore", invalid="ignore"):
            return q.astype(out_dtype)
    raise InvalidArgument(f"{what}: cannot quantize to {out_dtype}")


# Below this many elements numpy's passes cost less than a call into the JIT.
_QUANTIZE_JIT_MIN = 4096


def dynamic_qparams(x: np.ndarray) -> tuple[np.float32, np.uint8]:
    """uint8 scale and zero point of a float tensor, as onnxruntime's GetQuantizationParameter."""
    if x.size:
        # NaN left out, as onnxruntime's min and max kernels mostly do (SSE/AVX min and max
        # return their second operand where one is NaN: which NaN survives depends on its lane);
        # the NaN elements themselves quantize to code 0 (see quantize_u8).  With np.min one NaN
        # made the scale NaN and every code 0.
        lo = np.fmin.reduce(x, axis=None)
        hi = np.fmax.reduce(x, axis=None)
        lo = np.float32(lo) if lo < 0 else np.float32(0)  # (an all-NaN tensor: 0 and 0)
        hi = np.float32(hi) if hi > 0 else np.float32(0)
    else:
        lo = hi = np.float32(0)
    scale = np.float32(1.0) if hi == lo else np.float32(np.float32(hi - lo) / np.float32(255))
    zp = np.float32(np.float32(0) - np.float32(lo / scale))
    zp = np.uint8(np.rint(np.float32(min(max(zp, np.float32(0)), np.float32(255)))))
    return scale, zp


def quantize_u8(x: np.ndarray, scale: np.float32, zp: np.uint8) -> np.ndarray:
    """Per-tensor uint8 quantization of a float32 tensor (the dynamic-quantization fast path):
    one pass with numba (``_qdq_jit.quantize_8bit``, the same arithmetic), else six numpy ones."""
    if x.size >= _QUANTIZE_JIT_MIN and x.dtype == np.float32:
        jit = _fq_jit()
        if jit is not None:
            out = np.empty(x.shape, np.uint8)
            jit.quantize_8bit(np.ascontiguousarray(x).reshape(-1), np.float32(scale), np.float32(zp), np.float32(0),
                              np.float32(255), out.reshape(-1))
            return out
    q = np.asarray(np.divide(x, scale, dtype=np.float32))
    np.rint(q, out=q)
    q += np.float32(zp)
    np.fmax(q, 0, out=q)
    np.fmin(q, 255, out=q)
    return q.astype(np.uint8)


# -- kernels ------------------------------------------------------------------------------------


class _QDQBase(Kernel):
    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 1))
        self.block_size = int(self.attr("block_size", 0))
        if self.block_size < 0:
            raise InvalidArgument(f"node {node.name!r} ({node.op_type}): block_size must be >= 0, got {self.block_size}")
        od = int(self.attr("output_dtype", 0))
        self.output_dtype = _np_dtype(od, f"node {node.name!r} ({node.op_type}) output_dtype") if od else None
        self.what = f"node {node.name!r} ({node.op_type})"


@register("DequantizeLinear", since=10)
class DequantizeLinear(_QDQBase):
    """``y = (x - x_zero_point) * x_scale``; per-tensor, per-axis (13+) and blocked (21+)."""

    op_type = "DequantizeLinear"

    def run(self, x, x_scale, x_zero_point=None):
        if self.output_dtype is not None:
            out = self.output_dtype
        elif self.domain == "" and self.ctx.opset < 19:
            out = _F32
        else:
            out = None
        if x_zero_point is not None and int_range(x.dtype) is not None and x_zero_point.dtype != x.dtype:
            raise InvalidArgument(
                f"{self.what}: x_zero_point must have x's type {x.dtype}, got {x_zero_point.dtype}"
            )
        return (dequantize(x, x_scale, x_zero_point, self.axis, self.block_size, out_dtype=out, what=self.what),)


@register("DequantizeLinear", domain="com.microsoft", since=1)
class DequantizeLinearMS(DequantizeLinear):
    """onnxruntime's contrib DequantizeLinear (16-bit and 4-bit types before opset 21 had them)."""

    domain = "com.microsoft"


@register_fused("dq_gather")
class DequantizeGather(Kernel):
    """``Gather(DequantizeLinear(W, scale, zero point), indices)`` with a constant ``W`` and a
    per-tensor scale and zero point (``_fusion.find_dq_gather``): W's codes gathered along the
    Gather's axis (``np.take``: negative indices wrap, as specified), then the DequantizeLinear's
    own kernel on the gathered codes: its values, since it is elementwise; only the rows read
    are dequantized, not the whole table at every run.  Inputs: W, indices, scale, zero point."""

    op_type = "Gather"

    def __init__(self, node, ctx, *, dq) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 0))
        domain = "com.microsoft" if dq.domain == "com.microsoft" else ""
        opset = ctx.opsets.get(domain, 1)
        self._dq = (DequantizeLinearMS if domain else DequantizeLinear)(dq, KernelContext(opset=opset, opsets=ctx.opsets))

    def run(self, w, indices, scale, zero_point=None):  # type: ignore[override]
        return self._dq.run(np.take(w, indices, axis=self.axis), scale, zero_point)


@register("QuantizeLinear", since=10)
class QuantizeLinear(_QDQBase):
    """``y = saturate(rint(x / y_scale) + y_zero_point)``; per-tensor, per-axis, blocked."""

    op_type = "QuantizeLinear"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.saturate = bool(int(self.attr("saturate", 1)))
        prec = int(self.attr("precision", 0))
        self.precision = _np_dtype(prec, f"{self.what} precision") if prec else None

    def run(self, x, y_scale, y_zero_point=None):
        if x.dtype.kind not in "fi" and x.dtype.name != "bfloat16":
            raise InvalidArgument(f"{self.what}: x must be a float (or int32) tensor, got {x.dtype}")
        y = quantize(x, y_scale, y_zero_point, self.axis, self.block_size, out_dtype=self.output_dtype,
                     saturate=self.saturate, precision=self.precision, what=self.what)
        return (y,)


@register("QuantizeLinear", domain="com.microsoft", since=1)
class QuantizeLinearMS(QuantizeLinear):
    domain = "com.microsoft"


@register("DynamicQuantizeLinear", since=11)
class DynamicQuantizeLinear(Kernel):
    """uint8 ``y, y_scale, y_zero_point`` of a float32 tensor (see :func:`dynamic_qparams`)."""

    op_type = "DynamicQuantizeLinear"

    def run(self, x):
        if x.dtype != _F32:
            raise InvalidArgument(f"node {self.node.name!r} (DynamicQuantizeLinear): x must be float32, got {x.dtype}")
        scale, zp = dynamic_qparams(x)
        return (quantize_u8(x, scale, zp), np.array(scale, dtype=np.float32), np.array(zp, dtype=np.uint8))


def _fq_jit():
    """The numba twin of FakeQuant (:mod:`._qdq_jit`), or ``None`` (see ``_act.load_jit``)."""
    return _act.load_jit("_qdq_jit", "fake-quant")


@register_fused("fake_quant")
class FakeQuant(Kernel):
    """A QuantizeLinear -> DequantizeLinear pair of one scale and zero point (``_fusion.py``),
    as one float computation: ``y = clamp(rint(x / s), low - zp, high - zp) * s``.

    Bit for bit the pair's result: ``rint(x / s)`` is the Q's rounding in float32; clamping it to
    the integer range shifted by the zero point equals clamping ``rint(x / s) + zp`` and
    subtracting ``zp`` again (integers of at most 16 bits are exact in float32), and NaN clamps
    to the lowest value as the Q's ``fmax`` makes it; the product is the DQ's single rounding.  A
    final ``+ 0.0`` turns ``-0.0`` into ``+0.0``, as the DQ's integer-to-float conversion does.
    Five passes over one fresh array instead of eight over three, and no integer tensor; with
    numba (the ``jit`` extra) one pass (``_qdq_jit.fake_quant``, the same arithmetic).
    """

    op_type = "QuantizeLinear"

    def __init__(self, node, ctx, *, axis: int, low: int, high: int) -> None:
        super().__init__(node, ctx)
        self.axis, self.low, self.high = axis, float(low), float(high)
        self.what = f"node {node.name!r} (QuantizeLinear+DequantizeLinear)"

    _memo = None  # (memo_key of scale and zero point, x's shape, the numba kernel's arrays): see run

    def run(self, x, scale, zero_point):  # type: ignore[override]
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise InvalidArgument(f"{self.what}: x must be a float tensor, got {x.dtype}")
        xs = x if x.dtype == _F32 else x.astype(np.float32)
        memo = self._memo
        if memo is not None and memo[1] == x.shape and memo_holds(memo[0], (scale, zero_point)):
            # The model's constant scale and zero point at the shape they were checked for: the
            # kernel's arrays as made then (a QDQ BERT runs ~130 pairs, most on 128 x 256 floats,
            # where laying them out was half of a ~10 us call).
            jit = _fq_jit()
            if jit is not None:
                return (self._jit_call(jit, xs, *memo[2]),)
        s = _param(scale, x.shape, self.axis, 0, self.what)
        zp = _param(zero_point, x.shape, self.axis, 0, self.what).astype(np.float32)
        jit = _fq_jit() if x.size else None
        if jit is not None:
            args = self._jit_args(xs, s, zp)
            key = memo_key((scale, zero_point))
            if key is not None:
                self._memo = (key, x.shape, args)
            return (self._jit_call(jit, xs, *args),)
        t = np.asarray(np.divide(xs, s))  # (a 0-d x and scale make a numpy scalar: in place below needs an array)
        if t.shape != x.shape:  # a per-axis scale broadcast wider than x (cannot happen: _param checks)
            raise InvalidArgument(f"{self.what}: scale {list(np.shape(scale))} does not fit x {list(x.shape)}")
        np.rint(t, out=t)
        np.fmax(t, self.low - zp, out=t)
        np.fmin(t, self.high - zp, out=t)
        t *= s
        t += np.float32(0.0)
        return (t,)

    def _jit_args(self, xs: np.ndarray, s: np.ndarray, zp: np.ndarray) -> tuple:
        """The numba kernel's view of ``xs`` as (outer, C, inner), C the scale's length, and its
        scale, low and high arrays."""
        if s.size == 1:
            shape3 = (1, 1, xs.size)
        else:
            ax = self.axis + xs.ndim if self.axis < 0 else self.axis
            shape3 = (math.prod(xs.shape[:ax]), xs.shape[ax], math.prod(xs.shape[ax + 1:]))
        scale = np.ascontiguousarray(s, dtype=np.float32).reshape(-1)
        shift = np.ascontiguousarray(zp, dtype=np.float32).reshape(-1)
        return shape3, scale, np.float32(self.low) - shift, np.float32(self.high) - shift

    @staticmethod
    def _jit_call(jit, xs: np.ndarray, shape3: tuple, scale: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """The numba kernel over ``xs`` seen as ``shape3``, into a fresh array."""
        if not xs.flags.c_contiguous:
            xs = xs.copy()  # (not np.ascontiguousarray: it makes a 0-d x 1-d, and the result's shape is xs's)
        out = np.empty_like(xs)
        jit.fake_quant(xs.reshape(shape3), scale, low, high, out.reshape(shape3))
        return out
