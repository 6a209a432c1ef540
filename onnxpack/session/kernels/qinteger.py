"""Integer matrix products: MatMulInteger, ConvInteger and onnxruntime's dynamic-quantization ops
(com.microsoft DynamicQuantizeMatMul, MatMulIntegerToFloat, DynamicQuantizeLSTM), plus the exact
integer GEMM and convolution that the QLinear family (``qlinear.py``) shares.

Exact integer arithmetic on float BLAS
--------------------------------------
numpy has no integer BLAS (an int32 ``np.matmul`` is a scalar loop, ~100x slower than sgemm), so
8-bit operands are widened to float32 and multiplied by sgemm.  float32 holds every integer up to
2**24 exactly, so the product is exact when no partial sum can exceed 2**24, whatever order BLAS
adds in.  Two bounds decide it:

* ``max|a| * (largest column L1 norm of the weight)`` bounds every partial sum.  The L1 norm of a
  packed weight is computed once; real weights (and random ones) are far below ``K * max|w|``,
  so e.g. a 3x3x64 conv of uint8 activations needs ``sum|w| <= 2**24 / 255 = 65793``: one sgemm.
* otherwise K is cut into equal chunks of at most ``2**24 // (max|a| * max|w|)`` (514 for uint8
  minus zero point times int8), one sgemm per chunk, the partial products added in float64
  (exact below 2**53); the result is then float64.

Measured on the dev machine (2 threads, OpenBLAS, median of 21; ``benchmarks/bench_quant.py``
repeats this with one thread), exact chunked sgemm vs plain sgemm vs float64 dgemm:

=====================  ===========  ===================  ========================
M x K x N              sgemm        chunked sgemm (512)  dgemm (+ widening cast)
=====================  ===========  ===================  ========================
64 x 576 x 3136        1.97 ms      2.36-2.51 ms         3.5 ms (4.6 ms)
128 x 1152 x 784       1.58 ms      1.74-1.87 ms         2.9-3.1 ms (3.5-4.0 ms)
256 x 2304 x 196       1.38-1.73    1.63-2.23 ms         3.4-3.6 ms (4.3-5.8 ms)
2048 x 512 x 128       1.76 ms      1.90-2.49 ms         4.5-4.7 ms (5.1-6.2 ms)
=====================  ===========  ===================  ========================

so even when chunked the exact product costs 1.1-1.3x an inexact sgemm, about half a dgemm.

Zero points: the activation's zero point is subtracted while widening (one pass, needed anyway);
the weight's is either subtracted from the (small) weight per call or applied afterwards as
``rowsum(a) * zp_b``, whichever touches fewer elements.  Both are exact.

Integer GEMM on AVX-512 VNNI or AVX2
------------------------------------
MatMul-like weights (MatMulInteger, DynamicQuantizeMatMul, MatMulIntegerToFloat, QLinearMatMul,
QGemm) are packed as int8 *lanes* (:func:`to_lanes`, family ``qmatmul``/``qgemm`` version 2): one
byte per weight, 4 consecutive k of a column side by side, plus the column sums.  Where numba
runs on a CPU with AVX-512 VNNI, :func:`lanes_matmul` multiplies uint8 activations by them with
``vpdpbusd`` (:mod:`._qgemm_jit`) in exact int32 and applies the zero points and the
signed/unsigned shifts with row and column sums: 128x768 @ 768x3072 with zero points, one thread,
1.6-1.7 ms (8.0 ms for the exact sgemm; onnxruntime 1.55 ms side by side).  On AVX2 the same
lanes go through ``vpmaddubsw`` / ``vpmaddwd`` with the activation bytes split so no pair sum
saturates, or in a signed form for weights without -128 (see :mod:`._qgemm_jit`; exact either
way).  Without numba the lanes are unpacked to float32 per call, a tile of columns at a time, for
the exact sgemm (not kept: that would be a private 4x copy per process).

Pre-packing: the zero point is *not* folded in: the pre-packing contract keys a pack by its own
input only, so a pack that baked in another input (the zero point) could be handed to a node
with the same weight and another zero point.  Conv weights are packed as their integers in
float32, (g, M/g, C/g, *kernel) like ``Conv`` (family ``qconv``): 4 bytes per weight instead of
1.  DynamicQuantizeLSTM's W and R are lanes per direction (family ``qlstm`` version 2): its
recurrence multiplies one row of h by R at every step (ddddocr's quantized OCR LSTM, 32 steps x 2
directions of 512 x 2048, one thread: 17 ms with float32 R on the exact sgemm, 10 ms on the int8
GEMM, most of the rest Python per step).
"""

from __future__ import annotations

import logging
import math
import struct

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, register
from onnxpack.session.kernels.conv import Conv, _pad, _padded_extent, _SpatialAttrs, conv_geometry, im2col
from onnxpack.session.kernels.qdq import dynamic_qparams, int_range
from onnxpack.session.kernels.rnn import LSTM

logger = logging.getLogger(__name__)

__all__ = [
    "exact_matmul",
    "max_l1",
    "int_matmul",
    "int_conv",
    "span",
    "shift",
    "MatMulInteger",
    "ConvInteger",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "DynamicQuantizeLSTM",
    "to_lanes",
    "from_lanes",
    "lanes_matmul",
]

# Every integer of magnitude <= 2**24 is a float32.
_EXACT = 1 << 24
_PACK_VERSION = 1
# MatMul-like weights (families qmatmul / qgemm): version 2 keeps them 8-bit (int8 lanes, see
# to_lanes); version 1 was float32 (K, N), 4x the bytes.
_MATMUL_PACK_VERSION = 2
# DynamicQuantizeLSTM's W and R (family qlstm): version 2 keeps them 8-bit (each direction's int8
# lanes and column sums); version 1 was float32 (num_dir, K, 4H), 4x the bytes.
_LSTM_PACK_VERSION = 2
_EIGHT_BIT = ("int8", "uint8")
_EIGHT_BIT_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))
_LANE_TILE = 128  # columns per tile of the lanes layout (_qgemm_jit.TILE)
# The int8 GEMM's result is exact in (wrapping) int32 arithmetic while the true result fits in
# int32: |sum_k (a - a_zp)(b - b_zp)| <= K * 255 * 255.
_LANES_MAX_K = (2**31 - 1) // (255 * 255)
_F32 = np.dtype(np.float32)


# -- exact integer arithmetic -------------------------------------------------------------------


def span(dtype: np.dtype, zero_point: np.ndarray | None = None) -> int:
    """Largest ``|q - zero_point|`` over the values ``q`` of an integer ``dtype``."""
    lo, hi = int_range(dtype)
    if zero_point is None or np.size(zero_point) == 0:
        return max(-lo, hi)
    z = np.asarray(zero_point).astype(np.int64)
    return int(max(int(z.max()) - lo, hi - int(z.min())))


def shift(q: np.ndarray, zero_point: np.ndarray | float | None) -> np.ndarray:
    """``q - zero_point`` as float32 (exact for 8-bit ``q``), a fresh array."""
    if zero_point is None:
        return q.astype(np.float32)
    return np.asarray(np.subtract(q, zero_point, dtype=np.float32))


def exact_matmul(a: np.ndarray, b: np.ndarray, bound: int, total: float | None = None) -> np.ndarray:
    """``a @ b`` (``np.matmul`` broadcasting) of float32 arrays holding integers, exactly.

    ``bound`` is the largest ``|a_ik * b_kj|``; ``total``, when known, bounds every
    ``sum_k |a_ik * b_kj|`` (max |a| times the largest column L1 norm of ``b``).  Every partial
    sum BLAS forms, in any order, is at most that, so with ``total <= 2**24`` one sgemm is exact;
    typical weights (L1 norms far below K * max|b|) take this path.  Otherwise K is cut into
    equal chunks of at most ``2**24 // bound``; the result is then float64.
    """
    k = a.shape[-1]
    kc = max(1, _EXACT // max(int(bound), 1))
    if k <= kc or (total is not None and total <= _EXACT):
        return np.matmul(a, b)
    nchunks = -(-k // kc)
    kc = -(-k // nchunks)  # balanced: 576 -> 288 + 288, not 514 + 62
    parts = (np.matmul(a[..., k0 : k0 + kc], b[..., k0 : k0 + kc, :]) for k0 in range(0, k, kc))
    acc = np.add(next(parts), next(parts), dtype=np.float64)
    for part in parts:
        acc += part
    return acc


def max_l1(w: np.ndarray, axis: int) -> float:
    """The largest L1 norm along ``axis`` of a float32 integer array (exactly, in float64)."""
    return float(np.abs(w).sum(axis=axis, dtype=np.float64).max()) if w.size else 0.0


def _row_param(zp: np.ndarray | None) -> np.ndarray | None:
    """A's zero point (scalar, per row (M,), or N-D (..., M, 1)) shaped to broadcast against A."""
    if zp is None:
        return None
    zp = np.asarray(zp)
    if zp.size == 1:
        return zp.reshape(())
    if zp.ndim == 1:
        return zp.reshape(-1, 1)
    return zp


def _col_param(zp: np.ndarray | None) -> np.ndarray | None:
    """B's zero point (scalar, per column (N,), or N-D (..., 1, N)) shaped to broadcast against B."""
    if zp is None:
        return None
    zp = np.asarray(zp)
    return zp.reshape(()) if zp.size == 1 else zp


def _shifted_a(a: np.ndarray, a_zp, a_shifted: bool, a_span: int | None) -> tuple[np.ndarray, int]:
    """(A minus its zero point as float32, the bound of its magnitude); ``a_shifted``: ``a`` is
    that already, bounded by ``a_span``."""
    if a_shifted:
        return a, int(a_span)
    zpa = _row_param(a_zp)
    return shift(a, zpa), span(a.dtype, zpa)


def int_matmul(a: np.ndarray, a_zp, b: np.ndarray, b_dtype: np.dtype, b_zp, *, a_shifted: bool = False,
               a_span: int | None = None, b_l1: float | None = None, what: str = "") -> np.ndarray:
    """Exact ``(a - a_zp) @ (b - b_zp)`` with numpy's matmul rules, as float32 or float64.

    ``a`` holds integers (or, with ``a_shifted``, float32 values already minus their zero point,
    whose magnitude is at most ``a_span``); ``b`` holds integers of ``b_dtype``, either as that
    dtype or as packed float32; ``b_l1`` (optional) is the largest column L1 norm of ``b``
    itself (zero point not subtracted), see :func:`exact_matmul`.
    """
    if a.ndim == 0 or b.ndim == 0:
        raise InvalidArgument(f"{what}: MatMul operands must not be scalars")
    af, amax = _shifted_a(a, a_zp, a_shifted, a_span)
    bf = b if b.dtype == _F32 else b.astype(np.float32)
    squeeze_a = af.ndim == 1
    squeeze_b = bf.ndim == 1
    if squeeze_a:
        af = af[None, :]
    if squeeze_b:
        bf = bf[:, None]
    if af.shape[-1] != bf.shape[-2]:
        raise InvalidArgument(f"{what}: inner dimensions differ: A {list(a.shape)}, B {list(b.shape)}")
    zpb = _col_param(b_zp)
    if zpb is not None and not zpb.astype(np.int64).any():
        zpb = None
    lead = None
    if bf.ndim == 2 and af.ndim > 2:  # one large GEMM instead of numpy's loop over the batch
        lead = af.shape[:-1]
        af = af.reshape(-1, af.shape[-1])
    total = None if b_l1 is None else amax * b_l1
    if zpb is None:
        acc = exact_matmul(af, bf, amax * span(b_dtype), total)
    else:
        rows, k, n = math.prod(af.shape[:-1]), af.shape[-1], bf.shape[-1]
        if rows * (k + n) < k * n or (bf.ndim > 2 and bf.size > acc_size(af, bf)):
            # (a @ b) - rowsum(a) * zp_b: touches the activations, not the weight (nor a batched
            # B larger than the product: then subtracting its zero point would cost more).
            acc = exact_matmul(af, bf, amax * span(b_dtype), total).astype(np.float64, copy=False)
            acc -= af.sum(axis=-1, keepdims=True, dtype=np.float64) * zpb.astype(np.float64)
        else:
            acc = exact_matmul(af, bf - zpb.astype(np.float32), amax * span(b_dtype, zpb))
    if lead is not None:
        acc = acc.reshape(*lead, acc.shape[-1])
    if squeeze_b:
        acc = acc[..., 0]
    if squeeze_a:
        acc = acc[..., 0, :] if not squeeze_b else acc[..., 0]
    return acc


def acc_size(a: np.ndarray, b: np.ndarray) -> int:
    """Elements of ``np.matmul(a, b)`` for 2-D or batched operands of matching inner dimensions."""
    return math.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2])) * a.shape[-2] * b.shape[-1]


def int_conv(xf: np.ndarray, w: np.ndarray, sp: _SpatialAttrs, group: int, x_span: int, w_span: int,
             w_l1: float, what: str) -> np.ndarray:
    """Exact convolution of float32 integer tensors, (N, M, *out), float32 or float64.

    ``xf`` is the input minus its zero point (padding contributes zeros, i.e. the zero point, as
    onnxruntime pads), ``w`` the weight in the packed layout (g, M/g, C/g, *kernel) minus its
    zero point; ``x_span`` / ``w_span`` bound their magnitudes, ``w_l1`` is the largest L1 norm
    of one output channel's weights.  Same shapes as ``Conv``: 1x1 convolutions use the input as
    the column matrix, depthwise ones ``Conv``'s tap loop (exact while ``x_span * w_l1 <=
    2**24``), the rest ``im2col`` and :func:`exact_matmul`.
    """
    n, c = xf.shape[:2]
    nd = xf.ndim - 2
    g, mg, cg = w.shape[:3]
    m = g * mg
    ks, strides, dils = sp.resolve(nd, w.shape[3:])
    if c != cg * g or len(ks) != nd:
        raise InvalidArgument(
            f"{what}: input has {c} channels and rank {xf.ndim}, weight expects {cg * g} channels "
            f"(group {g}) and kernel {list(w.shape[3:])}"
        )
    kprod = math.prod(ks)
    begin, end, out_shape = conv_geometry(xf.shape[2:], ks, strides, dils, sp.pads, sp.auto_pad)
    length = math.prod(out_shape)
    wm = w.reshape(g, mg, cg * kprod)
    if kprod == 1 and not any(begin) and not any(end):
        xs = xf[(Ellipsis,) + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out_shape, strides))]
        cols = np.ascontiguousarray(xs).reshape(n, g, cg, length)
    else:
        xp = _pad(xf, begin, _padded_extent(xf.shape[2:], begin, out_shape, ks, strides, dils), 0)
        if cg == 1 and mg == 1 and g > 1 and x_span * w_l1 <= _EXACT:
            return Conv._depthwise(xp, wm, ks, out_shape, strides, dils).reshape((n, m) + tuple(out_shape))
        cols = im2col(xp, ks, out_shape, strides, dils).reshape(n, g, cg * kprod, length)
    bound, total = x_span * w_span, x_span * w_l1
    if g == 1:
        acc = exact_matmul(wm[0], cols[:, 0], bound, total)  # (n, M, L)
    else:
        acc = exact_matmul(wm, cols, bound, total)  # (n, g, M/g, L)
    return acc.reshape((n, m) + tuple(out_shape))


def check_eight_bit(arr: np.ndarray, name: str, what: str) -> None:
    if arr.dtype not in _EIGHT_BIT_DTYPES:
        raise InvalidArgument(f"{what}: {name} must be int8 or uint8, got {arr.dtype}")


def per_tensor(value: np.ndarray | None, name: str, what: str):
    """The single value of a per-tensor scale or zero point (None stays None)."""
    if value is None:
        return None
    value = np.asarray(value)
    if value.size != 1:
        raise InvalidArgument(f"{what}: {name} must be a scalar or a one-element tensor, got shape {list(value.shape)}")
    return value.reshape(())


def per_channel(value: np.ndarray | None, count: int, name: str, what: str) -> np.ndarray | None:
    """A scale or zero point that is per tensor or has one value per channel, as a 0-d or (count,) array."""
    if value is None:
        return None
    value = np.asarray(value)
    if value.size == 1:
        return value.reshape(())
    if value.size != count or value.ndim > 2:
        raise InvalidArgument(
            f"{what}: {name} must be a scalar or have {count} values (one per channel), got shape {list(value.shape)}"
        )
    return value.reshape(count)


# -- weight packing, shared with qlinear.py -----------------------------------------------------


def to_lanes(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An 8-bit (K, N) weight as int8 *lanes* and its column sums (int32 (N,)).

    Layout: K is padded with zeros to a multiple of 4; the N columns are cut into tiles of 128
    (the last holds N % 128); a tile of width ``w`` stores, for each group ``g`` of 4 consecutive
    k, ``w`` lanes of 4 bytes, ``[g][column][k % 4]`` in C order.  uint8 weights are stored minus
    128 (their signed image; :func:`lanes_matmul` adds the 128 back through the column sums).
    One byte per weight: a quantized weight stays quantized.
    """
    k, n = b.shape
    k4 = -(-k // 4)
    w = np.zeros((k4 * 4, n), np.int8)
    if b.dtype == np.uint8:
        np.subtract(b, 128, out=w[:k], dtype=np.int16, casting="unsafe")
    else:
        w[:k] = b
    colsum = w.sum(axis=0, dtype=np.int64).astype(np.int32)
    g = w.reshape(k4, 4, n).transpose(0, 2, 1)  # (k4, n, 4)
    nfull = n // _LANE_TILE
    parts = []
    if nfull:
        parts.append(g[:, : nfull * _LANE_TILE].reshape(k4, nfull, _LANE_TILE, 4).transpose(1, 0, 2, 3).reshape(-1))
    if n - nfull * _LANE_TILE:
        parts.append(g[:, nfull * _LANE_TILE:].reshape(-1))
    lanes = np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0]) if parts else np.empty(0, np.int8)
    return lanes, colsum


def from_lanes(lanes: np.ndarray, k: int, n: int, unsigned: bool) -> np.ndarray:
    """The (K, N) weight's integers as float32 from its lanes (the numpy GEMM's operand)."""
    k4 = -(-k // 4)
    nfull = n // _LANE_TILE
    cut = nfull * _LANE_TILE * k4 * 4
    out = np.empty((k4 * 4, n), np.float32)
    view = out.reshape(k4, 4, n)
    if nfull:
        full = lanes[:cut].reshape(nfull, k4, _LANE_TILE, 4)  # (t, g, c, j) -> (g, j, t, c)
        view[:, :, : nfull * _LANE_TILE] = full.transpose(1, 3, 0, 2).reshape(k4, 4, nfull * _LANE_TILE)
    if n - nfull * _LANE_TILE:
        view[:, :, nfull * _LANE_TILE:] = lanes[cut:].reshape(k4, n - nfull * _LANE_TILE, 4).transpose(0, 2, 1)
    if unsigned:
        out += np.float32(128)
    return out[:k]


_DENSE_COLUMNS = 4 * _LANE_TILE  # columns of the weight unpacked to float32 at a time (no VNNI)


def lanes_tiles(lanes: np.ndarray, k: int, n: int, unsigned: bool):
    """Yields ``(c0, c1, tile)``: the float32 (K, c1 - c0) integers of columns c0:c1 of the
    weight whose lanes these are, ``_DENSE_COLUMNS`` at a time, in one reused buffer (each tile
    is valid until the next is made).  :func:`from_lanes` by pieces: a tile stays in cache for
    its GEMM, and no (K, N) float32 copy of the weight is ever made."""
    k4 = -(-k // 4)
    nfull = n // _LANE_TILE
    cut = nfull * _LANE_TILE * k4 * 4
    buf = np.empty(k4 * 4 * _DENSE_COLUMNS, np.float32)
    full = lanes[:cut].reshape(nfull, k4, _LANE_TILE, 4)
    per = _DENSE_COLUMNS // _LANE_TILE
    for t0 in range(0, nfull, per):
        t1 = min(nfull, t0 + per)
        w = (t1 - t0) * _LANE_TILE
        view = buf[: k4 * 4 * w].reshape(k4, 4, t1 - t0, _LANE_TILE)  # (g, j, t, c) <- (t, g, c, j)
        np.copyto(view, full[t0:t1].transpose(1, 3, 0, 2), casting="unsafe")
        tile = view.reshape(k4 * 4, w)
        if unsigned:
            tile += np.float32(128)
        yield t0 * _LANE_TILE, t1 * _LANE_TILE, tile[:k]
    rest = n - nfull * _LANE_TILE
    if rest:
        view = buf[: k4 * 4 * rest].reshape(k4, 4, rest)
        np.copyto(view, lanes[cut:].reshape(k4, rest, 4).transpose(0, 2, 1), casting="unsafe")
        tile = view.reshape(k4 * 4, rest)
        if unsigned:
            tile += np.float32(128)
        yield n - rest, n, tile[:k]


def _qjit():
    """The int8 GEMM kernels (AVX-512 VNNI or AVX2) or None: from the native code cache when it
    has them (no numba in the process), else numba's :mod:`._qgemm_jit`."""
    native = _act.native()
    if native is not None and native.has_qgemm():
        return native
    module = _act.load_jit("_qgemm_jit", "MatMulInteger")
    return module if module is not None and module.available else None


def no_min_lane(lanes: np.ndarray) -> bool:
    """Whether no stored lane byte is -128 (int8 weights in [-127, 127], as symmetric quantizers
    write them): then :func:`lanes_matmul` may take the AVX2 GEMM's faster signed form."""
    return bool(lanes.size == 0 or lanes.min() > -128)


def lanes_matmul(a: np.ndarray, a_zp, lanes: np.ndarray, colsum: np.ndarray, k: int, n: int,
                 b_unsigned: bool, b_zp, no_min: bool = False) -> np.ndarray | None:
    """``(a - a_zp) @ (B - b_zp)`` exactly, as int32 (..., N), with the int8 GEMM on the lanes; None
    when it does not apply here (no VNNI JIT, a zero point of another shape, K too large): the
    caller then takes the float32 path.

    ``a``: 8-bit (..., K); ``a_zp``: None, a scalar or one per row of a 2-D ``a``; ``b_zp``: None,
    a scalar or one per column.  With ``a_u`` = A as unsigned bytes (int8 + 128), ``w_s`` the
    stored lanes (uint8 weights - 128) and ``A' = 128·[A signed] + a_zp``, ``B' = 128·[B
    unsigned] - b_zp``: ``sum_k (a - a_zp)(b - b_zp) = a_u·w_s + B'·rowsum(a_u) - A'·colsum(w_s)
    - K·A'·B'``, every term an exact integer.  ``no_min``: the caller knows :func:`no_min_lane`
    holds for ``lanes``; on AVX2 the GEMM then sums ``(a_u - 128)·w_s`` (one multiply per product
    instead of two), and the column sums' term takes ``A' - 128``.
    """
    jit = _qjit()
    if jit is None or k > _LANES_MAX_K or a.ndim < 1 or a.shape[-1] != k or a.dtype not in _EIGHT_BIT_DTYPES:
        return None
    az = None if a_zp is None else np.asarray(a_zp)
    bz = None if b_zp is None else np.asarray(b_zp)
    if bz is not None and bz.size > 1 and not bz.any():
        bz = None  # per-column zero points that are all 0 (symmetric weights): the scalar form below
    if az is not None and az.size != 1 and not (a.ndim == 2 and az.ndim == 1 and az.size == a.shape[0]):
        return None
    if bz is not None and bz.size != 1 and not (bz.ndim == 1 and bz.size == n):
        return None
    lead = a.shape[:-1]
    m = math.prod(lead)
    groups = -(-k // 4)
    signed_a = a.dtype == np.int8
    a2 = a.reshape(m, k)
    if signed_a or k % 4 or not a2.flags.c_contiguous:
        au = np.zeros((m, groups * 4), np.uint8)
        if signed_a:  # int8 + 128 as uint8: flip the sign bit
            np.bitwise_xor(a2.view(np.uint8), np.uint8(0x80), out=au[:, :k])
        else:
            au[:, :k] = a2
    else:
        au = a2  # uint8 rows already in groups of 4: no copy
    out = np.empty((m, n), np.int32)
    signs = 1 if no_min and jit.signs_form else 0
    threads = _act.threads()
    if threads > 1 and m * k * n >= 1 << 21:
        jit.qgemm(au, lanes, out, n, groups, threads, signs)
    else:
        jit.qgemm_serial(au, lanes, out, n, groups, 1, signs)
    c_less = 128 * signs  # the GEMM's own shift of a_u: less to take off with the column sums
    # The corrections in int32, in place: every term is an integer and the exact result fits in
    # int32 (|result| <= K * 255 * 255 < 2**31 for K <= _LANES_MAX_K), so wrapping int32
    # arithmetic (numpy's) ends on the exact value.
    if (az is None or az.size == 1) and (bz is None or bz.size == 1):
        # Scalar shifts (per-tensor zero points), as Python ints: a few array operations where a
        # recurrent layer calls this once per step (1 x 512 @ 512 x 2048: ~100 us of overhead
        # in the general form below, more than the product).
        a_sh = (128 if signed_a else 0) + (0 if az is None else int(az.reshape(())))
        b_sh = (128 if b_unsigned else 0) - (0 if bz is None else int(bz.reshape(())))
        if b_sh:
            out += (au.sum(axis=1, dtype=np.int64) * b_sh).astype(np.int32).reshape(-1, 1)
        if a_sh != c_less:
            out -= colsum * np.int32(a_sh - c_less)
        if a_sh and b_sh:
            out -= np.int64(k * a_sh * b_sh).astype(np.int32)  # (wraps as the rest does)
        return out.reshape(*lead, n)
    a_shift = np.int64(128 if signed_a else 0)
    if az is not None:
        a_shift = a_shift + (az.astype(np.int64).reshape(-1, 1) if az.size > 1 else np.int64(az.reshape(())))
    b_shift = np.int64(128 if b_unsigned else 0)
    if bz is not None:
        b_shift = b_shift - (bz.astype(np.int64).reshape(1, -1) if bz.size > 1 else np.int64(bz.reshape(())))
    if np.any(b_shift):
        rows = au.sum(axis=1, dtype=np.int64).reshape(-1, 1) * b_shift  # (M, 1) or (M, N)
        out += rows.astype(np.int32)
    if np.any(a_shift) or c_less:
        cols = (a_shift - c_less) * colsum.astype(np.int64).reshape(1, -1) + np.int64(k) * a_shift * b_shift
        out -= cols.astype(np.int32)
    return out.reshape(*lead, n)


class PackedMatMulWeight:
    """Mixin: a MatMul-like kernel whose input ``weight_index`` (B, (K, N), 8-bit) may be packed
    as int8 lanes and column sums (:func:`to_lanes`); ``trans_b`` (Gemm's transB) is resolved in
    the pack.  :meth:`_int_matmul` multiplies with the int8 GEMM where it runs (AVX-512 VNNI),
    else with the exact float32 GEMM over the weight's integers."""

    weight_index: int = 1
    trans_b: int = 0

    def _init_weight(self) -> None:
        self._lanes: tuple[np.ndarray, np.ndarray] | None = None  # (lanes, column sums)
        self._b_dtype: np.dtype | None = None
        self._tile_l1: list[float] | None = None  # the same per tile of lanes_tiles, computed once
        self._no_min: bool | None = None  # no_min_lane of the packed lanes, at the first product

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != self.weight_index or len(info.shape) != 2 or np.dtype(info.dtype).name not in _EIGHT_BIT:
            return None
        # The pack keeps neither B's dtype nor its exact K (lanes pad K to 4): both come from here.
        self._b_dtype = np.dtype(info.dtype)
        self._b_kn = self._kn(info.shape)
        family = "qgemm" if self.trans_b else "qmatmul"
        return PackSpec(family, _MATMUL_PACK_VERSION, struct.pack("<B", int(self.trans_b)), 1)

    def _kn(self, shape) -> tuple[int, int]:
        k, n = shape[::-1] if self.trans_b else shape
        return int(k), int(n)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        k, n = self._kn(info.shape)
        return [(np.dtype(np.int8), (-(-k // 4) * 4 * n,)), (np.dtype(np.int32), (n,))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        return to_lanes(weight.T if self.trans_b else weight)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        self._lanes = (buffers[0], buffers[1])

    def _lanes_int_matmul(self, a: np.ndarray, a_zp, b_zp, what: str, *, a_shifted: bool = False,
                          a_span: int | None = None) -> np.ndarray:
        """``(a - a_zp) @ (B - b_zp)`` exactly from the packed lanes without the int8 GEMM: the
        exact float32 GEMM column tile by column tile (:func:`lanes_tiles`).  Measured on a
        32 x 1024 @ 1024 x 8210 weight (ddddocr's classifier), one thread: 31 ms for the whole
        weight unpacked, then one GEMM, against 19 by tiles.  The tiles' column L1 norms are
        computed at the first call and kept (per tile: a bound at least as tight as the
        weight's)."""
        k, n = self._b_kn
        if a.ndim == 0 or a.shape[-1] != k:
            raise InvalidArgument(f"{what}: inner dimensions differ: A {list(a.shape)}, B ({k}, {n})")
        af, amax = _shifted_a(a, a_zp, a_shifted, a_span)
        zpb = _col_param(b_zp)
        norms = self._tile_l1
        seen: list[float] = []
        out = None
        for i, (c0, c1, tile) in enumerate(lanes_tiles(self._lanes[0], k, n, self._b_dtype == np.uint8)):
            if norms is None:
                seen.append(max_l1(tile, axis=0))
            zb = zpb if zpb is None or zpb.ndim == 0 else zpb[c0:c1]
            acc = int_matmul(af, None, tile, self._b_dtype, zb, a_shifted=True, a_span=amax,
                             b_l1=seen[i] if norms is None else norms[i], what=what)
            if out is None:
                out = np.empty((*acc.shape[:-1], n), acc.dtype)
            elif acc.dtype != out.dtype and acc.dtype == np.float64:  # a chunked tile: float64 holds every sum
                wide = np.empty(out.shape, np.float64)
                wide[..., :c0] = out[..., :c0]  # (the columns after c0 are not written yet)
                out = wide
            out[..., c0:c1] = acc
        if norms is None:
            self._tile_l1 = seen
        return out

    def _int_matmul(self, a: np.ndarray, a_zp, b: np.ndarray | None, b_zp, what: str) -> np.ndarray:
        """``(a - a_zp) @ (B - b_zp)`` exactly (int64, or float32/float64 holding integers)."""
        if self._lanes is None:
            bw, bdtype = self._weight(b, what)
            return int_matmul(a, a_zp, bw, bdtype, b_zp, what=what)
        lanes, colsum = self._lanes
        k, n = self._b_kn
        if a.ndim == 0 or a.shape[-1] != k:
            raise InvalidArgument(f"{what}: inner dimensions differ: A {list(a.shape)}, B ({k}, {n})")
        unsigned = self._b_dtype == np.uint8
        if self._no_min is None:
            self._no_min = no_min_lane(lanes)
        got = lanes_matmul(a, a_zp, lanes, colsum, k, n, unsigned, b_zp, self._no_min)
        if got is not None:
            return got
        # No int8 GEMM here: the weight's integers as float32 for the exact sgemm, a tile at a
        # time, per call (a copy kept would be a private 4x of the weight in every process).
        return self._lanes_int_matmul(a, a_zp, b_zp, what)

    def _weight(self, b: np.ndarray | None, what: str) -> tuple[np.ndarray, np.dtype]:
        """(B as (…, K, N) integers, B's integer dtype) for an unpacked B."""
        if b is None:
            raise InvalidArgument(f"{what}: input B is missing")
        check_eight_bit(b, "B", what)
        if self.trans_b:
            if b.ndim != 2:
                raise InvalidArgument(f"{what}: B must be 2-D, got shape {list(b.shape)}")
            b = b.T
        return b, b.dtype

    def _n(self, b: np.ndarray | None, what: str) -> int:
        """Columns of B (packed or given)."""
        if self._lanes is not None:
            return self._b_kn[1]
        bw, _ = self._weight(b, what)
        return bw.shape[-1]


class PackedConvWeight:
    """Mixin: a convolution whose input ``weight_index`` (8-bit, (M, C/g, *kernel)) may be packed
    as float32 (g, M/g, C/g, *kernel), ``Conv``'s packed layout."""

    weight_index: int = 1
    group: int = 1

    def _init_weight(self) -> None:
        self._w: np.ndarray | None = None
        self._w_dtype: np.dtype | None = None
        self._w_l1: float | None = None  # largest per-channel L1 norm of the packed weight

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != self.weight_index or len(info.shape) < 3 or np.dtype(info.dtype).name not in _EIGHT_BIT:
            return None
        if info.shape[0] % self.group:
            return None
        self._w_dtype = np.dtype(info.dtype)
        return PackSpec("qconv", _PACK_VERSION, struct.pack("<q", self.group), 1)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        m, g = info.shape[0], self.group
        return [(_F32, (g, m // g) + tuple(info.shape[1:]))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        m, g = weight.shape[0], self.group
        return (np.ascontiguousarray(weight.reshape((g, m // g) + weight.shape[1:]), dtype=np.float32),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (self._w,) = buffers

    def _conv_weight(self, w: np.ndarray | None, w_zp: np.ndarray | None, what: str) -> tuple[np.ndarray, int, float]:
        """(weight minus its zero point as float32 (g, M/g, C/g, *kernel), max |w - zp|, the
        largest L1 norm of one output channel's weights minus zero point)."""
        packed = self._w is not None
        if packed:
            wf, dtype = self._w, self._w_dtype
        else:
            if w is None:
                raise InvalidArgument(f"{what}: input W is missing")
            check_eight_bit(w, "W", what)
            if w.ndim < 3 or w.shape[0] % self.group:
                raise InvalidArgument(
                    f"{what}: W must be (M, C/group, *kernel) with M divisible by group {self.group}, got {list(w.shape)}"
                )
            wf = w.reshape((self.group, w.shape[0] // self.group) + w.shape[1:]).astype(np.float32)
            dtype = w.dtype
        m = wf.shape[0] * wf.shape[1]
        zp = per_channel(w_zp, m, "w_zero_point", what)
        per_out = wf.reshape(m, -1)
        if zp is not None and zp.astype(np.int64).any():
            z = zp.astype(np.float32).reshape((wf.shape[0], wf.shape[1]) + (1,) * (wf.ndim - 2)) if zp.ndim else zp.astype(np.float32)
            wf = wf - z
            return wf, span(dtype, zp), max_l1(wf.reshape(m, -1), axis=1)
        if not packed:
            return wf, span(dtype), max_l1(per_out, axis=1)
        if self._w_l1 is None:  # the pack is immutable: computed once, at the first call
            self._w_l1 = max_l1(per_out, axis=1)
        return wf, span(dtype), self._w_l1


# -- kernels --------------------------------------------------------------------------------------


@register("MatMulInteger", since=10)
class MatMulInteger(PackedMatMulWeight, Kernel):
    """``Y = (A - a_zero_point) @ (B - b_zero_point)`` as int32, exactly.

    a_zero_point: scalar, per row (M,) or (..., M, 1); b_zero_point: scalar, per column (N,) or
    (..., 1, N).
    """

    op_type = "MatMulInteger"
    weight_index = 1

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._init_weight()
        self.what = f"node {node.name!r} (MatMulInteger)"

    def run(self, a, b=None, a_zero_point=None, b_zero_point=None):
        check_eight_bit(a, "A", self.what)
        acc = self._int_matmul(a, a_zero_point, b, b_zero_point, self.what)
        return (acc.astype(np.int32, copy=False),)


@register("ConvInteger", since=10)
class ConvInteger(PackedConvWeight, Kernel):
    """``Y = conv(x - x_zero_point, w - w_zero_point)`` as int32, exactly (w_zero_point may be per
    output channel); padding is the zero point, so it contributes nothing."""

    op_type = "ConvInteger"
    weight_index = 1

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.sp = _SpatialAttrs(self)
        self.group = int(self.attr("group", 1))
        if self.group < 1:
            raise InvalidArgument(f"node {node.name!r} (ConvInteger): group must be >= 1, got {self.group}")
        self._init_weight()
        self.what = f"node {node.name!r} (ConvInteger)"

    def run(self, x, w=None, x_zero_point=None, w_zero_point=None):
        check_eight_bit(x, "x", self.what)
        if x.ndim < 3:
            raise InvalidArgument(f"{self.what}: x must be (N, C, D1, ...), got shape {list(x.shape)}")
        xz = per_tensor(x_zero_point, "x_zero_point", self.what)
        wf, wspan, wl1 = self._conv_weight(w, w_zero_point, self.what)
        acc = int_conv(shift(x, xz), wf, self.sp, self.group, span(x.dtype, xz), wspan, wl1, self.what)
        return (acc.astype(np.int32),)


def _dynamic_quantize_shifted(a: np.ndarray, params: tuple | None = None) -> tuple[np.ndarray, np.float32, int]:
    """uint8 dynamic quantization of a float32 tensor, returned as ``q - zero_point`` (float32),
    the scale, and max |q - zero_point|: the quantized integers without a uint8 round trip.
    ``params``: ``dynamic_qparams(a)`` when the caller has them."""
    scale, zp = dynamic_qparams(a) if params is None else params
    q = np.divide(a, scale, dtype=np.float32)
    np.rint(q, out=q)
    z = np.float32(zp)
    np.fmax(q, -z, out=q)
    np.fmin(q, np.float32(255) - z, out=q)
    return q, scale, max(int(zp), 255 - int(zp))


def _dynamic_quantize_uint8(a: np.ndarray) -> tuple[np.ndarray, np.float32, int]:
    """uint8 dynamic quantization of a float32 tensor (DynamicQuantizeLinear's integers: the same
    as :func:`_dynamic_quantize_shifted` plus the zero point), its scale and zero point."""
    params = dynamic_qparams(a)
    q, scale, _ = _dynamic_quantize_shifted(a, params)
    zp = params[1]
    q += np.float32(zp)
    return q.astype(np.uint8), scale, int(zp)


def scale_bias(acc: np.ndarray, multiplier: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``float32(acc) * multiplier + bias`` (onnxruntime's scale-bias output processor)."""
    y = acc.astype(np.float32)
    y *= multiplier
    if bias is not None:
        y += bias.astype(np.float32, copy=False)
    return y


@register("DynamicQuantizeMatMul", domain="com.microsoft", since=1)
class DynamicQuantizeMatMul(PackedMatMulWeight, Kernel):
    """``Y = A @ dequantize(B) + bias`` with A quantized on the fly to uint8 (per tensor, as
    DynamicQuantizeLinear), the integer product exact, scaled by ``a_scale * b_scale`` (per tensor
    or per column)."""

    op_type = "DynamicQuantizeMatMul"
    domain = "com.microsoft"
    weight_index = 1

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._init_weight()
        self.what = f"node {node.name!r} (DynamicQuantizeMatMul)"

    def run(self, a, b=None, b_scale=None, b_zero_point=None, bias=None):
        if a.dtype != _F32:
            raise InvalidArgument(f"{self.what}: A must be float32, got {a.dtype}")
        n = self._n(b, self.what)
        bs = per_channel(b_scale, n, "b_scale", self.what)
        bz = per_channel(b_zero_point, n, "b_zero_point", self.what)
        if self._lanes is not None and _qjit() is not None:
            q, a_scale, zp = _dynamic_quantize_uint8(a)
            acc = self._int_matmul(q, np.uint8(zp), None, bz, self.what)
        else:
            af, a_scale, a_span = _dynamic_quantize_shifted(a)
            if self._lanes is not None:
                acc = self._lanes_int_matmul(af, None, bz, self.what, a_shifted=True, a_span=a_span)
            else:
                bw, bdtype = self._weight(b, self.what)
                acc = int_matmul(af, None, bw, bdtype, bz, a_shifted=True, a_span=a_span, what=self.what)
        return (scale_bias(acc, np.float32(a_scale) * bs.astype(np.float32), bias),)


@register("MatMulIntegerToFloat", domain="com.microsoft", since=1)
class MatMulIntegerToFloat(PackedMatMulWeight, Kernel):
    """``Y = (A - a_zp) @ (B - b_zp) * (a_scale * b_scale) + bias`` in the scales' float type."""

    op_type = "MatMulIntegerToFloat"
    domain = "com.microsoft"
    weight_index = 1

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._init_weight()
        self.what = f"node {node.name!r} (MatMulIntegerToFloat)"

    def run(self, a, b=None, a_scale=None, b_scale=None, a_zero_point=None, b_zero_point=None, bias=None):
        check_eight_bit(a, "A", self.what)
        n = self._n(b, self.what)
        sa = np.asarray(a_scale)
        sa = sa.reshape(()) if sa.size == 1 else sa.reshape(-1, 1)  # per tensor or per row
        sb = per_channel(b_scale, n, "b_scale", self.what)
        bz = per_channel(b_zero_point, n, "b_zero_point", self.what)
        acc = self._int_matmul(a, a_zero_point, b, bz, self.what)
        y = scale_bias(acc, sa.astype(np.float32) * sb.astype(np.float32), bias)
        return (y.astype(np.asarray(a_scale).dtype, copy=False),)


@register("DynamicQuantizeLSTM", domain="com.microsoft", since=1)
class DynamicQuantizeLSTM(LSTM):
    """LSTM with 8-bit W (num_dir, input, 4H) and R (num_dir, H, 4H) and per-tensor or per-column
    scales/zero points (num_dir,) or (num_dir, 4H).  As in onnxruntime, both GEMMs (all timesteps'
    ``X @ W`` up front, ``h @ R`` per step) quantize their float operand to uint8 per tensor on
    the fly and multiply exactly in integers; gates and states stay float32."""

    op_type = "DynamicQuantizeLSTM"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.what = f"node {node.name!r} (DynamicQuantizeLSTM)"
        self._wdtype: dict[int, np.dtype] = {}
        self._wshape: dict[int, tuple[int, ...]] = {}

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index in (1, 2):
            if len(info.shape) != 3 or np.dtype(info.dtype).name not in _EIGHT_BIT:
                return None
            self._wdtype[input_index] = np.dtype(info.dtype)
            self._wshape[input_index] = tuple(int(d) for d in info.shape)
            return PackSpec("qlstm", _LSTM_PACK_VERSION, bytes([input_index]), 2)
        return super().pack_spec(input_index, info)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if input_index in (1, 2):
            if self.pack_spec(input_index, info) is None:
                return None
            nd, k, n = info.shape
            return [(np.dtype(np.int8), (nd, -(-k // 4) * 4 * n)), (np.dtype(np.int32), (nd, n))]
        return super().expected_packed(input_index, info)

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        if input_index in (1, 2):  # (num_dir, K, 4H): each direction's (K, 4H) as int8 lanes
            check_eight_bit(weight, "W" if input_index == 1 else "R", self.what)
            packs = [to_lanes(weight[d]) for d in range(weight.shape[0])]
            return (np.stack([p[0] for p in packs]), np.stack([p[1] for p in packs]))
        return super().prepack(input_index, weight)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        if input_index in (1, 2):
            lanes, colsum = buffers
            nd, k, n = self._wshape[input_index]
            packed = _LanesWeight(lanes, colsum, nd, k, n, self._wdtype[input_index] == np.uint8)
            if input_index == 1:
                self._wt = packed
            else:
                self._rt = packed
            return
        super().use_prepacked(input_index, buffers)

    def run(self, x, w=None, r=None, b=None, seq_lens=None, h0=None, c0=None, p=None,
            w_scale=None, w_zero_point=None, r_scale=None, r_zero_point=None):
        if x.dtype != _F32:
            raise InvalidArgument(f"{self.what}: X must be float32, got {x.dtype}")
        for arr, name in ((w, "W"), (r, "R")):
            if arr is not None:
                check_eight_bit(arr, name, self.what)
                if arr.ndim != 3:
                    raise InvalidArgument(f"{self.what}: {name} must be 3-D (num_dir, K, 4H), got {list(arr.shape)}")
        wdt = w.dtype if w is not None else self._wdtype.get(1)
        rdt = r.dtype if r is not None else self._wdtype.get(2)
        params = []
        for scale, zp, dt, name in ((w_scale, w_zero_point, wdt, "W"), (r_scale, r_zero_point, rdt, "R")):
            if scale is None or zp is None:
                raise InvalidArgument(f"{self.what}: {name}_scale and {name}_zero_point are required")
            s = np.asarray(scale, dtype=np.float32).reshape(self.num_dir, -1)
            z = np.asarray(zp).reshape(self.num_dir, -1)
            params.append((s, z, dt))
        # The base class transposes unpacked W/R from ONNX's (num_dir, 4H, K) layout; ours are
        # already (num_dir, K, 4H), so hand it a transposed view.
        wv = None if w is None else w.transpose(0, 2, 1)
        rv = None if r is None else r.transpose(0, 2, 1)
        return self._run(x, wv, rv, b, seq_lens, h0, c0, p, q=params)

    def _project(self, a: np.ndarray, weight: np.ndarray, d: int, which: int, q) -> np.ndarray:
        scale, zp, dtype = q[which]
        z = zp[d] if zp.shape[1] > 1 else zp[d, 0]
        s = scale[d] if scale.shape[1] > 1 else scale[d, 0]
        a = np.ascontiguousarray(a, dtype=np.float32)
        if isinstance(weight, _LanesDirection):
            # The int8 GEMM on the packed lanes (one byte per weight: a step's h @ R reads 1/4 of
            # the bytes a float32 copy would); its exact integers are the float path's.
            aq, a_scale, a_zp = _dynamic_quantize_uint8(a)
            acc = lanes_matmul(aq, np.uint8(a_zp), weight.lanes, weight.colsum, weight.k, weight.n, weight.unsigned, z,
                               weight.no_min())
            if acc is not None:
                return acc.astype(np.float32) * (np.float32(a_scale) * s)
            weight = weight.dense()
        af, a_scale, a_span = _dynamic_quantize_shifted(a)
        acc = int_matmul(af, None, weight, dtype, z, a_shifted=True, a_span=a_span, what=self.what)
        return acc.astype(np.float32) * (np.float32(a_scale) * s)

    def _exact_steps(self, d, xw, bias, weight, h, c, y, lens, q) -> int:
        # Every step in one call of the JIT (see _qlstm_jit) where R is packed as lanes.
        if (not isinstance(weight, _LanesDirection) or weight.k > _LANES_MAX_K or weight.k != h.shape[1]
                or xw.ndim != 3 or xw.shape[2] != weight.n or bias.shape != (weight.n,) or weight.n != 4 * weight.k
                or h.shape != c.shape or xw.shape[1] != h.shape[0]):
            return 0  # (the JIT indexes without bounds checks: only shapes it was written for)
        if not (h.dtype == c.dtype == xw.dtype == bias.dtype == _F32 and h.flags.c_contiguous and c.flags.c_contiguous):
            return 0
        jit = _act.load_jit("_qlstm_jit", "DynamicQuantizeLSTM")
        if jit is None or not jit.available:
            return 0
        scale, zp, _dtype = q[1]
        n = weight.n
        w_scale = np.ascontiguousarray(np.broadcast_to(scale[d] if scale.shape[1] > 1 else scale[d, 0], (n,)), _F32)
        z = (zp[d] if zp.shape[1] > 1 else zp[d, :1]).astype(np.int64)
        b_shift = np.ascontiguousarray(np.broadcast_to((128 if weight.unsigned else 0) - z, (n,)))
        signs = 1 if jit.signs_form and weight.no_min() else 0
        lens64 = np.zeros(0, np.int64) if lens is None else np.asarray(lens, np.int64).reshape(-1)
        return int(jit.qlstm_steps(np.ascontiguousarray(xw), bias, weight.lanes, weight.colsum, b_shift, w_scale,
                                   h, c, y, d, self._reverse(d), lens64, signs))


class _LanesWeight:
    """DynamicQuantizeLSTM's packed W or R: each direction's (K, 4H) weight as int8 lanes
    (:func:`to_lanes`) with its column sums; ``shape`` is the float layout's (num_dir, K, 4H),
    which the LSTM's plumbing reads, and indexing by a direction gives that direction's weight."""

    def __init__(self, lanes: np.ndarray, colsum: np.ndarray, nd: int, k: int, n: int, unsigned: bool) -> None:
        self.lanes, self.colsum, self.k, self.n, self.unsigned = lanes, colsum, k, n, unsigned
        self.shape = (nd, k, n)
        self._dense: dict[int, np.ndarray] = {}
        self._no_min: dict[int, bool] = {}

    def __getitem__(self, d: int) -> _LanesDirection:
        return _LanesDirection(self, d)


class _LanesDirection:
    """One direction of a :class:`_LanesWeight`."""

    def __init__(self, owner: _LanesWeight, d: int) -> None:
        self.lanes, self.colsum = owner.lanes[d], owner.colsum[d]
        self.k, self.n, self.unsigned = owner.k, owner.n, owner.unsigned
        self._owner, self._d = owner, d

    def no_min(self) -> bool:
        """:func:`no_min_lane` of this direction's lanes, computed once."""
        got = self._owner._no_min.get(self._d)
        if got is None:
            got = self._owner._no_min[self._d] = no_min_lane(self.lanes)
        return got

    def dense(self) -> np.ndarray:
        """The weight's integers as float32 (K, 4H), for the exact float32 GEMM where the int8
        GEMM does not run (no numba, or a CPU without AVX2): unpacked once per direction and kept
        (a private float32 copy, 4x the pack: only on that fallback)."""
        got = self._owner._dense.get(self._d)
        if got is None:
            got = self._owner._dense[self._d] = from_lanes(self.lanes, self.k, self.n, self.unsigned)
        return got
