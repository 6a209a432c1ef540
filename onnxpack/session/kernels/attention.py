"""Attention ops of onnxruntime's transformer optimizer and of onnxruntime-genai's LLM builder:
com.microsoft Attention, MultiHeadAttention, RotaryEmbedding, GroupQueryAttention, and ONNX
RotaryEmbedding-23 and Attention-23 (torch's exporter at opset 23).

Every op computes in float32 (float64 stays float64) and rounds its outputs once; the KV cache
outputs (``present*``) keep the input dtype and copy past rows bit for bit.  Attention runs as
batched ``np.matmul`` over (batch, heads): no Python loop over heads or tokens; with numba, a
float32 attention without masks of excluded keys, softcap or sinks runs as one JIT call per
block of heads instead (``_attn_jit.attend_heads``: no GIL, so heads split over threads).  Grouped-query
attention multiplies each KV head with its group of query heads as one (group * seq, head) block
(``q.reshape(B, kv_heads, group * S, H) @ k^T``), so K and V are never repeated per query head.

Masks are additive, built once per call as onnxruntime's CPU kernels build them: a masked key
gets ``mask_filter_value`` (default -10000) for mask inputs and the lowest float for the causal
(unidirectional) part, so a fully masked row gives the same (uniform) weights as onnxruntime.
GroupQueryAttention instead takes excluded keys (causal, window, past a row's length) out of
the softmax (weight exactly 0), as its onnxruntime kernel does.

Pre-packing: Attention's merged QKV weight is packed as the float32 (K, N) matrix that one BLAS
call multiplies with (an identity pack for float32 weights, as MatMul packs), and its bias as a
float32 vector.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, ClassVar

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import (Kernel, PackSpec, TensorInfo, broadcasts_to, register, register_fused,
                                            same_view)
from onnxpack.session.kernels.linalg import (adopt_pack, compute_dtype, identity_panels, layout_attrs, matmul_packed,
                                             pack_b, packed_shape)
from onnxpack.session.kernels.qinteger import PackedMatMulWeight, check_eight_bit, per_channel, per_tensor, scale_bias

logger = logging.getLogger(__name__)

__all__ = ["apply_rotary", "softmax_rows"]

_PACK_VERSION = 2  # 2: a float32 QKV weight of >= 64 columns is panels (linalg.pack_b)
_LOWEST = np.finfo(np.float32).min
_NO_ROTARY = np.zeros(0, np.float32)
_F32 = np.dtype(np.float32)
# Up to this many keys a decoding step runs as one JIT call (rotary, cache row, attention);
# beyond, numpy's batched BLAS products read each cache row once for all the query heads that
# share it and win (measured one thread, Qwen2.5-0.5B's 14 heads over 2 KV heads of 64, the
# attention alone: 1,000 keys 127 us JIT vs 96 us numpy, 2,000 keys 283 vs 177 us; the numpy
# path's ~20 other numpy calls per step, ~60-100 us, make the JIT the faster up to ~1,000).
_JIT_MAX_KEYS = 1024


def _fd(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _f(x: np.ndarray, fd: np.dtype) -> np.ndarray:
    return x if x.dtype == fd else x.astype(fd)


def _err(kernel: Kernel, msg: str) -> InvalidArgument:
    return InvalidArgument(f"node {kernel.node.name!r} ({kernel.op_type}): {msg}")


def softmax_rows(z: np.ndarray, sink: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis in place on a fresh float array.

    ``sink`` (broadcastable to ``z[..., :1]``) is an extra logit that joins the denominator only
    (smooth softmax: 0; head sinks: one value per head).
    """
    m = z.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    # A row with every key excluded (-inf; only padding rows of a right-padded prompt under a
    # local window) gives zeros instead of NaN: its max becomes finite and its sum 1.
    np.maximum(m, np.finfo(z.dtype).min, out=m)
    z -= m
    np.exp(z, out=z)
    s = z.sum(axis=-1, keepdims=True)
    if sink is not None:
        s += np.exp(sink - m)
    s[s == 0] = 1
    z /= s
    return z


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool, rot_dim: int) -> np.ndarray:
    """Rotate the first ``rot_dim`` features of the last axis of ``x`` (a new float array).

    ``cos``/``sin`` broadcast against ``x[..., :rot_dim // 2]``.  Halves layout: pairs are
    ``(i, i + rot_dim/2)``; interleaved: ``(2i, 2i + 1)``.
    """
    with np.errstate(invalid="ignore", over="ignore"):  # inf / NaN inputs: the arithmetic's, unwarned
        return _apply_rotary(x, cos, sin, interleaved, rot_dim)


def _apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool, rot_dim: int) -> np.ndarray:
    out = x.copy()
    half = rot_dim // 2
    if interleaved:
        x1, x2 = x[..., 0:rot_dim:2], x[..., 1:rot_dim:2]
        o1, o2 = out[..., 0:rot_dim:2], out[..., 1:rot_dim:2]
    else:
        x1, x2 = x[..., :half], x[..., half:rot_dim]
        o1, o2 = out[..., :half], out[..., half:rot_dim]
    np.multiply(x1, cos, out=o1)
    o1 -= x2 * sin
    np.multiply(x1, sin, out=o2)
    o2 += x2 * cos
    return out


def _attend(q, k, v, scale: float, bias=None, *, exclude=None, softcap: float = 0.0, post_bias=None, sink=None,
            qk_out: bool = False):
    """``softmax(scale * q @ k^T + bias) @ v`` for q (B, N, S, H), k/v (B, Nkv, T, H).

    N must be a multiple of Nkv (grouped query attention: query heads ``g*G .. g*G+G-1`` share
    KV head g).  ``bias`` (additive, broadcast to (B, N, S, T)) is added before ``softcap``
    (``softcap * tanh(scores / softcap)``), ``post_bias`` after it; ``exclude`` (bool, True = key
    not attended) then takes keys out of the softmax.  ``sink``: see :func:`softmax_rows`.  Returns
    (B, N, S, Hv) and, with ``qk_out``, the scaled scores plus bias (before softcap and mask).
    """
    b, n, s, h = q.shape
    nkv = k.shape[1]
    g = n // nkv
    t = k.shape[2]
    macs = b * n * s * t * (h + v.shape[-1])
    if (exclude is None and softcap <= 0 and post_bias is None and sink is None and not qk_out and s > 1
            and q.dtype == k.dtype == v.dtype == _F32 and h == v.shape[-1] and q.size and k.size):
        fast = _attend_heads(q, k, v, scale, bias, macs)
        if fast is not None:
            return fast, None
    with _one_blas_thread(macs):
        return _attend_products(q, k, v, scale, bias, exclude, softcap, post_bias, sink, qk_out)


# From this many multiply-adds the JIT attention splits its heads over onnxpack's threads
# (whether that pays is measured per shape: _act.SplitTuner).
_SPLIT_ATTENTION_MACS = 1 << 22
_NO_BIAS = np.zeros((1, 1, 1, 0), np.float32)
# Below a 64-key panel, the JIT's products compute mostly its zero padding: numpy's batched
# products were faster (measured one thread, 2 x 12 heads of 16 tokens: 68 us against 84 us
# for the chain of nodes; 12 heads of 32 tokens 97 against 107; 128 tokens 840 against 664).
_JIT_MIN_KEYS = 64


def _attend_heads(q, k, v, scale, bias, macs: int, *, divide: bool = False, floor=_LOWEST):
    """:func:`_attend_products` (no softcap, mask, sink or scores output) by the JIT's
    ``attend_heads``: each block of heads one call without the GIL (numpy's path is ~10 calls a
    head, and splits over threads only through the BLAS), or None without the JIT or for a bias
    that is not float.  Measured one thread, BERT-base's 12 heads of 128 tokens: 0.90 -> 0.58 ms.
    ``divide``: the scores divided by ``scale``; ``floor``: see ``attend_heads``."""
    if k.shape[2] < _JIT_MIN_KEYS:
        return None
    jit = _act.load_jit("_attn_jit", "attention")
    if jit is None:
        return None
    if bias is None:
        b4 = _NO_BIAS
    else:
        bias = np.asarray(bias)
        if bias.dtype.kind != "f" or bias.ndim > 4:
            return None
        b4 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        full = q.shape[:3] + (k.shape[2],)
        if any(d not in (1, f) for d, f in zip(b4.shape, full)):
            return None  # not broadcastable: numpy's path raises its error
        b4 = np.ascontiguousarray(b4 if b4.shape[3] == full[3] else np.broadcast_to(b4, b4.shape[:3] + full[3:]),
                                  dtype=np.float32)
    b, n, s, h = q.shape
    out = np.empty((b, n, s, h), np.float32)
    sc = np.float32(scale)
    floor = np.float32(floor)
    threads = _act.threads() if macs >= _SPLIT_ATTENTION_MACS else 1
    _act.tuner(("attend_heads", q.shape, k.shape)).run(
        lambda lo, hi: jit.attend_heads(q, k, v, b4, sc, divide, floor, out, lo, hi), b * n, threads)
    return out


def _one_blas_thread(macs: int):
    """BLAS limited to one thread for an attention whose products total fewer than
    ``_SMALL_ATTENTION_MACS`` multiply-adds, else nothing.  OpenBLAS splits each of numpy's
    per-head GEMMs statically between its threads and waits for the slowest: on the shared VM a
    128-token prompt's attention (14 heads, ~30 M multiply-adds) took 17 ms per layer on 2 BLAS
    threads while another process ran, against 3.6 ms of CPU on one."""
    if macs >= _SMALL_ATTENTION_MACS:
        return contextlib.nullcontext()
    from onnxpack.session._threads import blas_threads

    return blas_threads(1)


_SMALL_ATTENTION_MACS = 1 << 26


def _attend_products(q, k, v, scale, bias, exclude, softcap, post_bias, sink, qk_out):
    b, n, s, h = q.shape
    nkv = k.shape[1]
    g = n // nkv
    t = k.shape[2]
    qg = q.reshape(b, nkv, g * s, h)
    if g * s < t:
        # Few query rows against a long cache (decoding): numpy's batched matmul with a
        # transposed right operand is slow (measured 1.7 ms vs 0.15 ms for 16 rows x 2048 keys,
        # one thread), so multiply the cache as the left operand and transpose the small result.
        scores = np.matmul(k, np.ascontiguousarray(qg.swapaxes(-1, -2)))
        scores = np.ascontiguousarray(scores.swapaxes(-1, -2)).reshape(b, n, s, t)
    else:
        scores = np.matmul(qg, k.swapaxes(-1, -2)).reshape(b, n, s, t)
    scores *= scores.dtype.type(scale)
    if bias is not None:
        scores += bias
    raw = scores.copy() if qk_out else None
    if softcap > 0:
        scores /= scores.dtype.type(softcap)
        np.tanh(scores, out=scores)
        scores *= scores.dtype.type(softcap)
    if post_bias is not None:
        scores += post_bias
    if exclude is not None:  # one broadcast add of a small 0 / -inf mask (no boolean indexing)
        scores += np.where(exclude, scores.dtype.type(-np.inf), scores.dtype.type(0))
    softmax_rows(scores, sink)
    out = np.matmul(scores.reshape(b, nkv, g * s, -1), v).reshape(b, n, s, v.shape[-1])
    return out, raw


@register_fused("attention_chain")
class AttentionChain(Kernel):
    """An exported attention, ``MatMul(Q, K) [* or / scale] [+ mask] Softmax(axis -1)
    MatMul(., V)`` (``_fusion.find_attention_chains``), as one step: inputs Q, K, V, mask.

    float32 Q (B, N, S, H), K (B, N, H, T), V (B, N, T, H) with a float32 scale and mask run
    the JIT's ``attend_heads`` (K read transposed in place; the scale applied as its node does, a
    product or a division, then the mask: two roundings; Softmax's rule for a row of -inf: NaN);
    every other case runs the nodes' own operations one after the other, with their rounding
    points: each MatMul as the MatMul kernel computes it (float16 / bfloat16 widened to float32
    and rounded once, :func:`_node_matmul`), the scale and mask as numpy's broadcasting, the
    Softmax kernel's softmax (float16 step by step in float16): the unfused nodes' bits.  Torch's
    BERT-base export: 12 heads of 128 tokens 0.9 -> 0.6 ms a layer on one thread, and its heads
    split over threads; float16, 4 heads of 128 tokens 24 -> 1.7 ms on one thread (numpy's
    float16 matmul is a scalar loop; what remains is the float16 scale, mask and softmax steps).
    """

    def __init__(self, node, ctx, *, scale: np.ndarray | None = None, divide: bool = False) -> None:
        super().__init__(node, ctx)
        self.scale = scale
        self.divide = divide

    def run(self, q, k, v, mask=None):
        sc = self.scale
        if (q.dtype == k.dtype == v.dtype == _F32 and q.ndim == k.ndim == v.ndim == 4
                and q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[3] == k.shape[2] == v.shape[3]
                and k.shape[3] == v.shape[2] and q.shape[2] > 1 and q.size and k.size
                and (sc is None or (sc.dtype == _F32 and sc.ndim <= 4)) and (mask is None or mask.dtype == _F32)):
            b, n, s, h = q.shape
            got = _attend_heads(q, k.swapaxes(-1, -2), v, 1.0 if sc is None else sc.reshape(()), mask,
                                b * n * s * k.shape[3] * 2 * h, divide=self.divide, floor=-np.inf)
            if got is not None:
                return (got,)
        from onnxpack.session.kernels.reduce import _softmax

        with np.errstate(all="ignore"):  # (the nodes' kernels warn of nothing either)
            y = _node_matmul(q, k)
            if sc is not None:
                y = np.divide(y, sc) if self.divide else np.multiply(y, sc)
            if mask is not None:
                y = np.add(y, mask)
            return (_node_matmul(_softmax(y, -1), v),)


def _node_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` as the MatMul node's kernel (``linalg.MatMul`` without a packed B) computes it:
    float16 / bfloat16 operands widened to float32, multiplied by BLAS (equal leading dimensions
    as one 3-D batch, :func:`_act.matmul`), the product rounded once to ``a``'s dtype; other
    dtypes (float32, float64, and what the node would refuse) numpy's own ``matmul``.  numpy has
    no half-precision BLAS: its float16 ``matmul`` is a scalar loop, ~100-500x slower."""
    cd = compute_dtype(a.dtype)
    if cd is None or cd == a.dtype or a.dtype != b.dtype:
        return np.matmul(a, b)
    a2, b2 = a.astype(cd), b.astype(cd)
    if a2.ndim >= 3 and a2.ndim == b2.ndim and a2.shape[:-2] == b2.shape[:-2] and a2.size and b2.size:
        lead = a2.shape[:-2]
        y = _act.matmul(a2.reshape(-1, *a2.shape[-2:]), b2.reshape(-1, *b2.shape[-2:]))
        y = y.reshape(*lead, *y.shape[-2:])
    else:
        y = np.matmul(a2, b2)
    return y.astype(a.dtype)


def _bsd_to_bnsh(x: np.ndarray, heads: int) -> np.ndarray:
    b, s, d = x.shape
    return x.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)


def sliding_rows(past: int, cap: int, window: int) -> int:
    """How many cached rows a sliding-window cache of ``cap >= window > 0`` rows holds after
    ``past`` tokens (onnxruntime's GroupQueryAttention with ``sliding_window_cache=1``): all of
    them until the buffer is full; then the count cycles through ``window .. cap`` (an overflow
    drops ``cap - window + 1`` rows; a cache as large as the window stays full, one row dropped
    per token).  It depends on ``past`` alone, whatever the steps' sizes were."""
    if past <= cap:
        return past
    return window + (past - cap - 1) % (cap - window + 1)


def _bnsh_to_bsd(x: np.ndarray) -> np.ndarray:
    b, n, s, h = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, n * h)


def _causal(s: int, t: int, past: int) -> np.ndarray:
    """True where query i (absolute position past + i) may not see key j (j > past + i)."""
    return np.arange(t)[None, :] > (past + np.arange(s))[:, None]


def _key_mask_bias(kernel, mask: np.ndarray, b: int, s: int, t: int, past: int, filter_value: float, fd):
    """onnxruntime's additive mask from a mask_index / key_padding_mask: (B, 1, S, T) or None.

    Raw masks (B, T) and (B, S, T): 0 -> ``filter_value``.  1-D (B): right padding, keys at or
    after ``mask[b]`` masked.  1-D (2B): then also keys before ``mask[B + b]``.  Other 1-D
    lengths (3B+2, CUDA's cumulated lengths) are read as (B) end positions, as onnxruntime's CPU
    kernel does.  4-D (B, 1, M, M) (Megatron GPT-2, CUDA only in onnxruntime): row
    ``past + i``, first T columns, 0 -> ``filter_value``.
    """
    fv = fd.type(filter_value)
    if mask.ndim == 1:
        if mask.shape[0] < b:
            raise _err(kernel, f"1-D mask of length {mask.shape[0]} is shorter than the batch {b}")
        cols = np.arange(t)[None, :]
        masked = cols >= mask[:b, None]
        if mask.shape[0] == 2 * b:
            masked |= cols < np.minimum(mask[b:, None], t)
        return np.where(masked, fv, fd.type(0))[:, None, None, :]
    if mask.ndim == 2:
        if mask.shape != (b, t):
            raise _err(kernel, f"2-D mask must have shape {[b, t]}, got {list(mask.shape)}")
        return np.where(mask > 0, fd.type(0), fv)[:, None, None, :]
    if mask.ndim == 3:
        if mask.shape != (b, s, t):
            raise _err(kernel, f"3-D mask must have shape {[b, s, t]}, got {list(mask.shape)}")
        return np.where(mask > 0, fd.type(0), fv)[:, None, :, :]
    if mask.ndim == 4:
        if mask.shape[0] != b or mask.shape[1] != 1 or mask.shape[2] < past + s or mask.shape[3] < t:
            raise _err(kernel, f"4-D mask must be ({b}, 1, M, M) with M >= {max(past + s, t)}, got {list(mask.shape)}")
        return np.where(mask[:, :, past:past + s, :t] > 0, fd.type(0), fv)
    raise _err(kernel, f"mask of rank {mask.ndim} is not supported")


def _add_bias(kernel, acc, attention_bias, b, n, s, t):
    if attention_bias is None:
        return acc
    ab = attention_bias
    if ab.ndim != 4 or ab.shape[0] not in (1, b) or ab.shape[1] not in (1, n) or ab.shape[2:] != (s, t):
        raise _err(kernel, f"attention_bias must have shape ({b} or 1, {n} or 1, {s}, {t}), got {list(ab.shape)}")
    ab = _f(ab, np.dtype(np.float32) if acc is None else acc.dtype)
    return ab if acc is None else acc + ab


@register("Attention", domain="com.microsoft", since=1)
class Attention(Kernel):
    """Self attention with a merged QKV projection (BERT, GPT-2 after onnxruntime's optimizer).

    Inputs: input (B, S, D_in), weights (D_in, Dq + Dk + Dv), bias, mask_index, past
    (2, B, N, P, H), attention_bias, past_sequence_length.  Outputs: output (B, S, Dv), present
    (2, B, N, P + S, H).  ``past_present_share_buffer=1``: past is a (2, B, N, M, H) buffer whose
    first ``past_sequence_length`` rows are valid, and present is that buffer with the new rows
    written after them (the rows beyond are the past buffer's: what sharing it gives;
    onnxruntime's CPU kernel refuses the attribute).
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        heads = self.attr("num_heads")
        if heads is None or int(heads) <= 0:
            raise InvalidArgument(
                f"node {node.name!r} (Attention): num_heads must be a positive integer, got {heads!r}"
            )
        self.heads = int(heads)
        self.sizes = [int(v) for v in self.attr("qkv_hidden_sizes", [])] or None
        self.unidirectional = bool(int(self.attr("unidirectional", 0)))
        self.filter_value = float(self.attr("mask_filter_value", -10000.0))
        self.scale = float(self.attr("scale", 0.0))
        self.share_buffer = bool(int(self.attr("past_present_share_buffer", 0)))
        if int(self.attr("do_rotary", 0)):
            # onnxruntime's CPU kernel refuses it too ("fuse the model with MHA + RotaryEmbedding").
            raise NotImplementedError("Attention do_rotary=1 (not supported on CPU by onnxruntime either)")
        if self.sizes is not None and (len(self.sizes) != 3 or any(v <= 0 or v % self.heads for v in self.sizes)):
            raise InvalidArgument(
                f"node {node.name!r} (Attention): qkv_hidden_sizes must be 3 positive multiples of num_heads "
                f"{self.heads}, got {self.sizes}"
            )
        self._w: np.ndarray | None = None
        self._wshape: tuple[int, ...] = ()  # the packed weight's (K, N)
        self._b: np.ndarray | None = None
        self.n_out = len(node.output)

    # -- packing: the merged weight as linalg's GEMM operand (pack_b), the bias as a float vector --
    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        cd = compute_dtype(info.dtype)
        if input_index not in (1, 2) or cd is None or len(info.shape) != (2 if input_index == 1 else 1):
            return None
        if input_index == 1:
            self._wshape = tuple(int(d) for d in info.shape)
            return PackSpec("attention_qkv_weight", _PACK_VERSION, layout_attrs(info.dtype, info.shape), 1,
                            identity=identity_panels(info.dtype, info.shape))
        return PackSpec("attention_qkv_bias", _PACK_VERSION, b"", 1, identity=cd == np.dtype(info.dtype))

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        if input_index == 1:
            return [(compute_dtype(info.dtype), packed_shape(info.dtype, *info.shape))]
        return [(compute_dtype(info.dtype), tuple(info.shape))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        if input_index == 1:
            return (pack_b(weight),)
        return (np.ascontiguousarray(weight, dtype=compute_dtype(weight.dtype)),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        if input_index == 1:
            (self._w,) = buffers
            adopt_pack(self, self._w)
        else:
            (self._b,) = buffers

    def run(self, x, weights=None, bias=None, mask_index=None, past=None, attention_bias=None,
            past_sequence_length=None):
        w = self._w if self._w is not None else weights
        wshape = self._wshape if self._w is not None else w.shape  # (a packed weight may be panels)
        bias = self._b if self._b is not None else bias
        if x.ndim != 3:
            raise _err(self, f"input must be 3-D (batch, sequence, hidden), got shape {list(x.shape)}")
        if len(wshape) != 2 or wshape[0] != x.shape[2]:
            raise _err(self, f"weights must be ({x.shape[2]}, Dq + Dk + Dv), got {list(wshape)}")
        total = wshape[1]
        if self.sizes is None:
            if total % 3 or (total // 3) % self.heads:
                raise _err(self, f"weights' second dimension {total} must be 3 equal multiples of "
                                 f"num_heads {self.heads}")
            dq = dk = dv = total // 3
        else:
            dq, dk, dv = self.sizes
            if dq + dk + dv != total:
                raise _err(self, f"qkv_hidden_sizes {self.sizes} do not sum to the weights' second dimension {total}")
        if dq != dk:
            raise _err(self, f"Q and K hidden sizes must be equal, got {dq} and {dk}")
        if bias is not None and bias.shape != (total,):
            raise _err(self, f"bias must have shape ({total},), got {list(bias.shape)}")
        fd = _fd(x.dtype)
        qkv = matmul_packed(_f(x, fd), w if w.ndim == 3 else _f(w, fd), total)
        if bias is not None:
            qkv += _f(bias, fd)
        return self._from_qkv(qkv, (dq, dk, dv), x.dtype, fd, mask_index, past, attention_bias, past_sequence_length)

    def _from_qkv(self, qkv, sizes, out_dtype, fd, mask_index, past, attention_bias, past_sequence_length):
        """The attention from the projected (B, S, Dq + Dk + Dv) ``qkv``."""
        dq, dk, dv = sizes
        b, s, _ = qkv.shape
        n = self.heads
        q = _bsd_to_bnsh(qkv[..., :dq], n)
        k = _bsd_to_bnsh(qkv[..., dq:dq + dk], n)
        v = _bsd_to_bnsh(qkv[..., dq + dk:], n)
        h = dq // n
        present = None
        past_len = 0
        if past is not None:
            if dq != dv:
                raise _err(self, "with past state, Q, K and V hidden sizes must be equal")
            if past.ndim != 5 or past.shape[0] != 2 or past.shape[1] != b or past.shape[2] != n or past.shape[4] != h:
                raise _err(self, f"past must have shape (2, {b}, {n}, past_length, {h}), got {list(past.shape)}")
            if self.share_buffer:
                if past_sequence_length is None:
                    raise _err(self, "past_present_share_buffer=1 needs the past_sequence_length input")
                past_len = int(np.asarray(past_sequence_length).reshape(-1)[0])
                if not 0 <= past_len <= past.shape[3] - s:
                    raise _err(self, f"past_sequence_length {past_len} + sequence {s} exceeds the buffer's "
                                     f"{past.shape[3]} rows")
                # present is the buffer with the new rows written into it (where the buffer is
                # shared, onnxruntime's CUDA kernel writes them into past itself): a copy of the
                # whole past, rows beyond past_len + S included, never unwritten memory.
                present = past.copy()
                present[0, :, :, past_len:past_len + s] = k
                present[1, :, :, past_len:past_len + s] = v
                k_all = _f(present[0, :, :, :past_len + s], fd)
                v_all = _f(present[1, :, :, :past_len + s], fd)
            else:
                past_len = past.shape[3]
                k_all = np.concatenate([_f(past[0], fd), k], axis=2)
                v_all = np.concatenate([_f(past[1], fd), v], axis=2)
                if self.n_out > 1 and self.node.output[1]:
                    present = np.stack([k_all, v_all]).astype(out_dtype, copy=False)
        else:
            k_all, v_all = k, v
            if self.n_out > 1 and self.node.output[1]:
                present = np.stack([k, v]).astype(out_dtype, copy=False)
        t = past_len + s
        scale = self.scale if self.scale != 0.0 else 1.0 / math.sqrt(h)
        acc = None
        if mask_index is not None:
            acc = _key_mask_bias(self, mask_index, b, s, t, past_len, self.filter_value, fd)
        if self.unidirectional:
            causal = np.where(_causal(s, t, past_len), fd.type(_LOWEST), fd.type(0))
            acc = causal if acc is None else np.where(_causal(s, t, past_len), fd.type(_LOWEST), acc)
        acc = _add_bias(self, acc, attention_bias, b, n, s, t)
        out, _ = _attend(q, k_all, v_all, scale, acc)
        y = _bnsh_to_bsd(out)
        return (y.astype(out_dtype, copy=False), present)[: self.n_out]


@register("QAttention", domain="com.microsoft", since=1)
class QAttention(PackedMatMulWeight, Attention):
    """Attention of an 8-bit input and weight (``quantize_dynamic`` of an optimized BERT / GPT-2):
    ``(X - x_zp) @ (W - w_zp)`` exactly in integers, ``float32(acc) * (x_scale * w_scale)`` (per
    tensor or per column) ``+ bias`` as onnxruntime's scale-bias step, then :class:`Attention`'s
    computation.  Inputs: input, weight, bias, input_scale, weight_scale, mask_index,
    input_zero_point, weight_zero_point, past.  The weight is packed as MatMulInteger's (8-bit
    lanes, family ``qmatmul``), the bias as Attention's."""

    weight_index = 1

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._init_weight()
        self.what = f"node {node.name!r} (QAttention)"

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index == 1:
            return PackedMatMulWeight.pack_spec(self, input_index, info)
        return Attention.pack_spec(self, input_index, info) if input_index == 2 else None

    def expected_packed(self, input_index: int, info: TensorInfo):
        if input_index == 1:
            return PackedMatMulWeight.expected_packed(self, input_index, info)
        return Attention.expected_packed(self, input_index, info) if input_index == 2 else None

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        if input_index == 1:
            return PackedMatMulWeight.prepack(self, input_index, weight)
        return Attention.prepack(self, input_index, weight)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        if input_index == 1:
            PackedMatMulWeight.use_prepacked(self, input_index, buffers)
        else:
            Attention.use_prepacked(self, input_index, buffers)

    def run(self, x, weight=None, bias=None, input_scale=None, weight_scale=None, mask_index=None,
            input_zero_point=None, weight_zero_point=None, past=None):
        if x.ndim != 3:
            raise _err(self, f"input must be 3-D (batch, sequence, hidden), got shape {list(x.shape)}")
        check_eight_bit(x, "input", self.what)
        total = self._n(weight, self.what)
        if total % 3 or (total // 3) % self.heads:
            raise _err(self, f"weight's second dimension {total} must be 3 equal multiples of num_heads {self.heads}")
        if input_scale is None or weight_scale is None:
            raise _err(self, "input_scale and weight_scale are required")
        bias = self._b if self._b is not None else bias
        if bias is not None and bias.shape != (total,):
            raise _err(self, f"bias must have shape ({total},), got {list(bias.shape)}")
        xs = per_tensor(input_scale, "input_scale", self.what)
        xz = None if input_zero_point is None else per_tensor(input_zero_point, "input_zero_point", self.what)
        ws = per_channel(weight_scale, total, "weight_scale", self.what)
        wz = per_channel(weight_zero_point, total, "weight_zero_point", self.what)
        acc = self._int_matmul(x, xz, weight, wz, self.what)
        qkv = scale_bias(acc, np.float32(xs) * ws.astype(np.float32), bias)
        d = total // 3
        return self._from_qkv(qkv, (d, d, d), np.dtype(np.float32), np.dtype(np.float32), mask_index, past, None, None)


def _project_kv(kernel, x, bias_part, heads, fd):
    """key/value input (B, L, D) -> (B, N, L, H) float, plus its bias."""
    xf = _f(x, fd)
    if bias_part is not None:
        xf = xf + bias_part
    return _bsd_to_bnsh(xf, heads)


@register("MultiHeadAttention", domain="com.microsoft", since=1)
class MultiHeadAttention(Kernel):
    """Self or cross attention on projected Q, K, V (onnxruntime's fusion of BERT/ViT/T5/Whisper).

    query (B, S, D) or packed QKV (B, S, N, 3, H); key (B, L, D), packed KV (B, L, N, 2, H) or
    already split into heads (B, N, L, H) (then value too, and no bias is added to them); bias
    (D + D + Dv) added to the projections; key_padding_mask (B), (2B), (3B+2), (B, T) or
    (B, S, T); attention_bias (B or 1, N or 1, S, T); past_key/past_value (B, N, P, H).  Outputs:
    output (B, S, Dv), present_key/present_value (B, N, P + L, H), qk (the scaled scores plus
    mask and attention_bias, before softmax).  ``past_sequence_length`` and
    ``cache_indirection`` (beam search buffer sharing, the CUDA decoder path) are not supported.
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        heads = self.attr("num_heads")
        if heads is None or int(heads) <= 0:
            raise InvalidArgument(f"node {node.name!r} (MultiHeadAttention): num_heads must be positive, got {heads!r}")
        self.heads = int(heads)
        self.unidirectional = bool(int(self.attr("unidirectional", 0)))
        self.filter_value = float(self.attr("mask_filter_value", -10000.0))
        self.scale = float(self.attr("scale", 0.0))
        ins = list(node.input) + [""] * 10
        if ins[8] or ins[9]:
            raise NotImplementedError("MultiHeadAttention past_sequence_length / cache_indirection inputs")
        outs = list(node.output) + [""] * 4
        self.want_present = bool(outs[1]) or bool(outs[2])
        self.want_qk = bool(outs[3])
        self.n_out = len(node.output)

    def run(self, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
            past_key=None, past_value=None, past_sequence_length=None, cache_indirection=None):
        n = self.heads
        fd = _fd(query.dtype)
        if query.ndim == 5:  # packed QKV (B, S, N, 3, H)
            if key is not None or value is not None or query.shape[2] != n or query.shape[3] != 3:
                raise _err(self, f"packed QKV must be (B, S, {n}, 3, H) with no key/value, got {list(query.shape)}")
            qf = _f(query, fd)
            h = query.shape[4]
            b, s = query.shape[:2]
            if bias is not None:
                qf = qf + bias.reshape(3, n, h).transpose(1, 0, 2)
            q, k, v = (qf[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
            dv = n * h
        else:
            if query.ndim != 3 or query.shape[2] % n:
                raise _err(self, f"query must be (B, S, D) with D a multiple of {n}, got {list(query.shape)}")
            b, s, d = query.shape
            h = d // n
            if key is None:
                raise _err(self, "key is required unless query is packed QKV")
            bq = bk = bv = None
            if key.ndim == 5:  # packed KV (B, L, N, 2, H)
                if value is not None or key.shape[2] != n or key.shape[3] != 2 or key.shape[4] != h:
                    raise _err(self, f"packed KV must be (B, L, {n}, 2, {h}) with no value, got {list(key.shape)}")
                dv = d
                kf = _f(key, fd)
                if bias is not None:
                    kf = kf + bias[d:].reshape(2, n, h).transpose(1, 0, 2)
                k, v = (kf[:, :, :, i].transpose(0, 2, 1, 3) for i in range(2))
                bq = None if bias is None else bias[:d]
            else:
                if value is None:
                    raise _err(self, "value is required with an unpacked key")
                if key.ndim == 4:  # already (B, N, L, H)
                    if (key.shape[:2] != (b, n) or key.shape[3] != h or value.ndim != 4
                            or value.shape[:3] != key.shape[:3]):
                        raise _err(self, f"4-D key/value must be ({b}, {n}, L, {h}), got {list(key.shape)} / "
                                         f"{list(value.shape)}")
                    dv = value.shape[1] * value.shape[3]
                    k, v = _f(key, fd), _f(value, fd)
                    bq = None if bias is None else bias[:d]
                else:
                    if (key.ndim != 3 or key.shape[0] != b or key.shape[2] != d or value.ndim != 3
                            or value.shape[:2] != key.shape[:2]):
                        raise _err(self, f"key/value must be ({b}, L, {d}) / ({b}, L, Dv), got {list(key.shape)} / "
                                         f"{list(value.shape)}")
                    dv = value.shape[2]
                    if bias is not None:
                        if bias.shape != (2 * d + dv,):
                            raise _err(self, f"bias must have shape ({2 * d + dv},), got {list(bias.shape)}")
                        bq, bk, bv = _f(bias[:d], fd), _f(bias[d:2 * d], fd), _f(bias[2 * d:], fd)
                    k = _project_kv(self, key, bk, n, fd)
                    v = _project_kv(self, value, bv, n, fd)
            qf = _f(query, fd)
            if bq is not None:
                qf = qf + _f(bq, fd)
            q = _bsd_to_bnsh(qf, n)
        past_len = 0
        if past_key is not None or past_value is not None:
            if past_key is None or past_value is None:
                raise _err(self, "past_key and past_value must be given together")
            if (past_key.ndim != 4 or past_key.shape[:2] != (b, n) or past_key.shape[3] != h
                    or past_value.shape != past_key.shape):
                raise _err(self, f"past_key/past_value must be ({b}, {n}, P, {h}), got {list(past_key.shape)}")
            past_len = past_key.shape[2]
            k = np.concatenate([_f(past_key, fd), k], axis=2)
            v = np.concatenate([_f(past_value, fd), v], axis=2)
        t = k.shape[2]
        scale = self.scale if self.scale != 0.0 else 1.0 / math.sqrt(h)
        mask = None
        if key_padding_mask is not None:
            mask = _key_mask_bias(self, key_padding_mask, b, s, t, past_len, self.filter_value, fd)
        if self.unidirectional:
            # onnxruntime's causal mask: row i sees keys j <= past + i, except the last row, which
            # sees every key (the same when the keys are the past and these rows, t = past + s;
            # with more keys, e.g. one query over a whole key sequence, that query sees them all).
            c = _causal(s, t, past_len)
            c[-1] = False
            mask = np.where(c, fd.type(_LOWEST), fd.type(0)) if mask is None else np.where(c, fd.type(_LOWEST), mask)
        ab = None
        if attention_bias is not None:
            ab = _add_bias(self, None, attention_bias, b, n, s, t).astype(fd, copy=False)
        bias_all = ab if mask is None else (mask if ab is None else mask + ab)
        out, qk = _attend(q, k, v, scale, bias_all, qk_out=self.want_qk)
        dt = query.dtype
        y = _bnsh_to_bsd(out).astype(dt, copy=False)
        pk = k.astype(dt, copy=False) if self.want_present else None
        pv = v.astype(dt, copy=False) if self.want_present else None
        return (y, pk, pv, None if qk is None else qk.astype(dt, copy=False))[: self.n_out]


def _bounds(a: np.ndarray) -> tuple[int, int]:
    """(min, max) of a small non-empty integer array as Python ints (a decoding step has one
    row: two numpy reductions cost ~10x a list's)."""
    if a.size <= 64:
        v = a.ravel().tolist()
        return min(v), max(v)
    return int(a.min()), int(a.max())


def _present_cache(given, past, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, bool]:
    """(the array a present cache is written into, whether it is the past buffer itself).

    ``given`` (a buffer bound to the output, or None) serves when it fits: the past buffer
    itself (the shared KV cache: its past rows are already in place and nothing else of it is
    written) or a buffer apart from the past, which is zeroed as onnxruntime zeroes a present
    that is not the past buffer: the rows a call does not write (past the longest row, a
    shorter row's tail, a static cache's unused end) are 0, never memory left unwritten.
    Otherwise a fresh zeroed array (calloc: pages untouched until written)."""
    if given is not None and given.shape == shape and given.dtype == dtype and given.flags.writeable:
        if same_view(given, past):
            return given, True
        if past is None or not np.may_share_memory(given, past):
            given.fill(0)
            return given, False
    return np.zeros(shape, dtype), False


def _gather_cache(kernel, cache: np.ndarray, positions: np.ndarray, half: int, what: str) -> np.ndarray:
    if cache.ndim != 2 or cache.shape[1] != half:
        raise _err(kernel, f"{what} must be 2-D (max_position, {half}), got {list(cache.shape)}")
    if positions.size:
        lo, hi = _bounds(positions)
        if lo < 0 or hi >= cache.shape[0]:
            raise _err(kernel, f"position ids must be in [0, {cache.shape[0]}) ({what} rows), got [{lo}, {hi}]")
    return cache[positions]


def _rotary_dims(kernel, d_or_h: int, heads: int, rot_attr: int, half: int, three_d: bool) -> tuple[int, int]:
    """(head_size, rotary_dim) for RotaryEmbedding's input layouts."""
    if three_d:
        if heads > 0:
            if d_or_h % heads:
                raise _err(kernel, f"hidden size {d_or_h} is not a multiple of num_heads {heads}")
            head = d_or_h // heads
        else:
            if rot_attr > 0:
                raise _err(kernel, "num_heads is required with rotary_embedding_dim for a 3-D input")
            head = 2 * half
    else:
        head = d_or_h
    rot = rot_attr if rot_attr > 0 else head
    if rot > head or rot % 2 or rot // 2 != half or (three_d and d_or_h % head):
        raise _err(kernel, f"rotary dimension {rot} (cache width {half}) does not fit head size {head}")
    return head, rot


@register("RotaryEmbedding", domain="com.microsoft", since=1)
class MsRotaryEmbedding(Kernel):
    """onnxruntime's RotaryEmbedding: inputs (input, position_ids, cos_cache, sin_cache).

    input (B, S, D) or (B, N, S, H); position_ids (B, S), or one offset (shape (1,)) giving
    positions ``offset + 0 .. S-1``; caches (max_position, rotary_dim / 2).  ``interleaved``,
    ``rotary_embedding_dim`` (partial rotation; needs ``num_heads`` for 3-D input).  ``scale`` and
    ``is_packed_batching`` do not change onnxruntime's CPU results and are accepted and ignored.
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.interleaved = bool(int(self.attr("interleaved", 0)))
        self.heads = int(self.attr("num_heads", 0))
        self.rot = int(self.attr("rotary_embedding_dim", 0))

    def run(self, x, position_ids, cos_cache, sin_cache):
        if x.ndim not in (3, 4):
            raise _err(self, f"input must be 3-D or 4-D, got shape {list(x.shape)}")
        b = x.shape[0]
        s = x.shape[1] if x.ndim == 3 else x.shape[2]
        half = cos_cache.shape[-1]
        head, rot = _rotary_dims(self, x.shape[-1], self.heads, self.rot, half, x.ndim == 3)
        pos = np.asarray(position_ids)
        if pos.size == 1 and pos.ndim <= 1:
            pos = int(pos.reshape(-1)[0]) + np.arange(s)[None, :]
        elif pos.shape != (b, s):
            raise _err(self, f"position_ids must have shape (1,) or {[b, s]}, got {list(pos.shape)}")
        cos = _gather_cache(self, cos_cache, pos, half, "cos_cache")  # (B|1, S, half)
        sin = _gather_cache(self, sin_cache, pos, half, "sin_cache")
        return (_rotate(x, cos, sin, b, s, -1, head, self.interleaved, rot),)


@register("RotaryEmbedding", since=23)
class RotaryEmbedding23(Kernel):
    """ONNX RotaryEmbedding-23: inputs (X, cos_cache, sin_cache, position_ids).

    X (B, N, S, H), or (B, S, hidden) with ``num_heads``; with position_ids (B, S) the caches are
    (max_position, rotary_dim / 2), without they are (B, S, rotary_dim / 2).
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.interleaved = bool(int(self.attr("interleaved", 0)))
        self.heads = int(self.attr("num_heads", 0))
        self.rot = int(self.attr("rotary_embedding_dim", 0))

    def run(self, x, cos_cache, sin_cache, position_ids=None):
        if x.ndim not in (3, 4):
            raise _err(self, f"X must be 3-D or 4-D, got shape {list(x.shape)}")
        if x.ndim == 3 and self.heads <= 0:
            raise _err(self, "num_heads is required for a 3-D X")
        b = x.shape[0]
        s = x.shape[1] if x.ndim == 3 else x.shape[2]
        half = cos_cache.shape[-1]
        head = x.shape[-1] // self.heads if x.ndim == 3 else x.shape[-1]
        if x.ndim == 3 and x.shape[-1] % self.heads:
            raise _err(self, f"hidden size {x.shape[-1]} is not a multiple of num_heads {self.heads}")
        rot = self.rot if self.rot > 0 else head
        if rot > head or rot % 2 or rot // 2 != half:
            raise _err(self, f"rotary dimension {rot} (cache width {half}) does not fit head size {head}")
        if position_ids is not None:
            if position_ids.shape != (b, s):
                raise _err(self, f"position_ids must have shape {[b, s]}, got {list(position_ids.shape)}")
            cos = _gather_cache(self, cos_cache, position_ids, half, "cos_cache")
            sin = _gather_cache(self, sin_cache, position_ids, half, "sin_cache")
        else:
            # (B, S, half) as the spec has them, or one batch row broadcast over the batch (what
            # torch's exporter writes at opset 23 for position ids shared by the batch;
            # onnx.reference broadcasts it, onnxruntime 1.32 refuses it for a batch above 1)
            for cache in (cos_cache, sin_cache):
                if cache.ndim != 3 or cache.shape[0] not in (1, b) or cache.shape[1:] != (s, half):
                    raise _err(self, f"without position_ids the caches must be {[b, s, half]} (or {[1, s, half]}), "
                                     f"got {list(cache.shape)}")
            cos, sin = cos_cache, sin_cache
        return (_rotate(x, cos, sin, b, s, self.heads, head, self.interleaved, rot),)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, b: int, s: int, heads: int, head: int,
            interleaved: bool, rot: int) -> np.ndarray:
    """Rotary embedding of ``x`` — (B, S, heads*head), or (B, heads, S, head) when 4-D — with
    per-position ``cos``/``sin`` of shape (B|1, S, half), in ``x``'s float compute type."""
    fd = _fd(x.dtype)
    cos, sin = _f(cos, fd), _f(sin, fd)
    if x.ndim == 3:
        xh = _f(x, fd).reshape(b, s, heads, head)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        xh = _f(x, fd)
        cos, sin = cos[:, None], sin[:, None]
    y = apply_rotary(xh, cos, sin, interleaved, rot)
    return y.reshape(x.shape).astype(x.dtype, copy=False)


# softmax_precision: the dtype the scores are cast to for the softmax (ONNX's TensorProto codes);
# bfloat16 (16) has no numpy dtype and computes in float32.
_SOFTMAX_PRECISION = {1: np.dtype(np.float32), 10: np.dtype(np.float16), 11: np.dtype(np.float64),
                      16: np.dtype(np.float32)}


@register("Attention", since=23)
class Attention23(Kernel):
    """ONNX Attention (opsets 23-25; what torch's exporter writes for ``scaled_dot_product_attention``
    at opset 23 and later).

    Q (B, Hq, S, H), K (B, Hkv, T, H), V (B, Hkv, T, Hv), or all three 3-D (B, S, heads * H) with
    ``q_num_heads`` / ``kv_num_heads``; Hq a multiple of Hkv (grouped-query attention).  With
    ``past_key`` / ``past_value`` the keys are the past's rows then K's (``present_*``).  The
    additive bias: ``attn_mask`` (bool: False -> -inf; otherwise added as it is; a last axis shorter
    than the keys is padded with -inf), the causal frontier (query i sees key j <= i + offset,
    offset = past rows, or ``nonpad_kv_seqlen[b] - S`` per batch), the opset-25 window
    (``left_window_size`` / ``right_window_size`` around ``offset + i``) and the keys at or past
    ``nonpad_kv_seqlen[b]``.  Scores are ``scale * Q K^T``, then ``softcap * tanh(. / softcap)``,
    then the bias, softmax; a query row with no visible key gives zeros (the spec's fully masked
    row).  ``qk_matmul_output`` is the scores before softcap (mode 0), after it (1), with the bias
    (2), or the softmax (3).  Computed in float32 (float64 stays float64; ``softmax_precision``
    11 makes the softmax float64) and rounded once, as onnxruntime's CPU kernel does.
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.causal = bool(int(self.attr("is_causal", 0)))
        self.q_heads = int(self.attr("q_num_heads", 0))
        self.kv_heads = int(self.attr("kv_num_heads", 0))
        self.mode = int(self.attr("qk_matmul_output_mode", 0))
        scale = self.attr("scale")
        self.scale = None if scale is None else float(scale)
        self.softcap = float(self.attr("softcap", 0.0))
        precision = self.attr("softmax_precision")
        self.left = int(self.attr("left_window_size", -1)) if ctx.opset >= 25 else -1
        self.right = int(self.attr("right_window_size", -1)) if ctx.opset >= 25 else -1
        if self.mode not in (0, 1, 2, 3):
            raise _err(self, f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {self.mode}")
        if precision is not None and int(precision) not in _SOFTMAX_PRECISION:
            raise _err(self, f"softmax_precision must be one of {sorted(_SOFTMAX_PRECISION)}, got {precision}")
        self.precision = None if precision is None else _SOFTMAX_PRECISION[int(precision)]
        if self.left < -1 or self.right < -1:
            raise _err(self, f"window sizes must be -1 or >= 0, got left {self.left}, right {self.right}")
        if self.q_heads < 0 or self.kv_heads < 0:
            raise _err(self, f"q_num_heads and kv_num_heads must be positive, got {self.q_heads}, {self.kv_heads}")
        outs = list(node.output) + [""] * 4
        self.want_present = bool(outs[1] or outs[2])
        self.want_qk = bool(outs[3])
        self.n_out = len(node.output)

    def _heads(self, q, k, v):
        """Q, K, V as (B, N, S, H) views (3-D inputs split into their heads), checked against each other."""
        if not q.ndim == k.ndim == v.ndim or q.ndim not in (3, 4):
            raise _err(self, f"Q, K and V must all be 3-D or all 4-D, got shapes {list(q.shape)}, {list(k.shape)}, "
                             f"{list(v.shape)}")
        if q.ndim == 3:
            if self.q_heads <= 0 or self.kv_heads <= 0:
                raise _err(self, "3-D Q, K, V need the q_num_heads and kv_num_heads attributes")
            for x, n, what in ((q, self.q_heads, "Q"), (k, self.kv_heads, "K"), (v, self.kv_heads, "V")):
                if x.shape[2] % n or x.shape[2] < n:
                    raise _err(self, f"{what}'s hidden size {x.shape[2]} is not a positive multiple of its {n} heads")
            q, k, v = (_bsd_to_bnsh(q, self.q_heads), _bsd_to_bnsh(k, self.kv_heads), _bsd_to_bnsh(v, self.kv_heads))
        b, n, s, h = q.shape
        if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
            raise _err(self, f"K {list(k.shape)} and V {list(v.shape)} do not match each other and Q {list(q.shape)}")
        if k.shape[3] != h:
            raise _err(self, f"Q's head size {h} differs from K's {k.shape[3]}")
        if h == 0 and self.scale is None:
            raise _err(self, "head size 0 leaves the default scale 1/sqrt(head size) undefined")
        if k.shape[1] == 0 or n % k.shape[1]:
            raise _err(self, f"{n} query heads are not a multiple of {k.shape[1]} key/value heads")
        return q, k, v

    def _cache(self, k, v, past_key, past_value, nonpad):
        if (past_key is None) != (past_value is None):
            raise _err(self, "past_key and past_value must be given together")
        if past_key is None:
            return k, v, 0
        if nonpad is not None:
            raise _err(self, "nonpad_kv_seqlen cannot be used with past_key / past_value")
        for past, x, what in ((past_key, k, "past_key"), (past_value, v, "past_value")):
            if past.ndim != 4 or past.shape[:2] != x.shape[:2] or past.shape[3] != x.shape[3]:
                raise _err(self, f"{what} must have shape {[x.shape[0], x.shape[1], 'P', x.shape[3]]}, got "
                                 f"{list(past.shape)}")
        if past_key.shape[2] != past_value.shape[2]:
            raise _err(self, f"past_key has {past_key.shape[2]} rows, past_value {past_value.shape[2]}")
        if past_key.dtype != k.dtype or past_value.dtype != v.dtype:
            raise _err(self, "past_key / past_value must have the dtypes of K / V")
        return (np.concatenate((past_key, k), axis=2), np.concatenate((past_value, v), axis=2), past_key.shape[2])

    def _bias(self, mask, nonpad, b: int, n: int, s: int, t: int, past: int, fd) -> np.ndarray | None:
        """The additive bias (0 / -inf / the float mask), broadcastable to (B, N, S, T), or None."""
        ninf, zero = fd.type(-np.inf), fd.type(0)
        bias = None
        if mask is not None:
            if mask.ndim > 4 or mask.ndim == 0:
                raise _err(self, f"attn_mask must have rank 1 to 4, got shape {list(mask.shape)}")
            if mask.shape[-1] > t:
                raise _err(self, f"attn_mask's last axis {mask.shape[-1]} is longer than the {t} keys")
            bias = np.where(mask, zero, ninf) if mask.dtype == np.bool_ else mask.astype(fd)
            if mask.shape[-1] < t:
                pad = np.full(mask.shape[:-1] + (t - mask.shape[-1],), ninf, fd)
                bias = np.concatenate((bias, pad), axis=-1)
            if not broadcasts_to(bias.shape, (b, n, s, t)):
                raise _err(self, f"attn_mask of shape {list(mask.shape)} does not broadcast to {[b, n, s, t]}")
        if nonpad is not None:
            if nonpad.shape != (b,):
                raise _err(self, f"nonpad_kv_seqlen must have shape {[b]}, got {list(nonpad.shape)}")
            lens = nonpad.astype(np.int64)
            offset = (lens - s)[:, None, None, None]  # per batch: (B, 1, 1, 1)
        else:
            offset = past
        if self.causal or self.left >= 0 or self.right >= 0:
            # distance = (offset + i) - j, as (S, T) or (B, 1, S, T)
            dist = (np.arange(s)[:, None] - np.arange(t)[None, :]) + offset
            allowed = dist >= 0 if self.causal else np.ones(np.shape(dist), bool)
            if self.left >= 0:
                allowed &= dist <= self.left
            if self.right >= 0:
                allowed &= -dist <= self.right
            part = np.where(allowed, zero, ninf)
            bias = part if bias is None else bias + part
        if nonpad is not None:
            part = np.where(np.arange(t)[None, :] < lens[:, None], zero, ninf)[:, None, None, :]
            bias = part if bias is None else bias + part
        return bias

    def run(self, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
        three_d = q.ndim == 3
        out_dtype = q.dtype
        qh, kh, vh = self._heads(q, k, v)
        kh, vh, past = self._cache(kh, vh, past_key, past_value, nonpad_kv_seqlen)
        present = (kh, vh) if self.want_present else None
        b, n, s, h = qh.shape
        t = kh.shape[2]
        fd = _fd(np.result_type(q.dtype, k.dtype, v.dtype))
        with np.errstate(invalid="ignore", over="ignore"):  # a +inf mask meeting a -inf: NaN, unwarned
            bias = self._bias(attn_mask, nonpad_kv_seqlen, b, n, s, t, past, fd)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(h)
        qf, kf, vf = _f(qh, fd), _f(kh, fd), _f(vh, fd)
        if t == 0:  # no key at all: every row is fully masked (zeros), and so is every score output
            y = np.zeros((b, n, s, vf.shape[-1]), fd)
            qk = np.zeros((b, n, s, 0), fd) if self.want_qk else None
        else:
            y, qk = self._products(qf, kf, vf, bias, scale, fd)
        with np.errstate(over="ignore"):  # float16 outputs beyond its range: inf, as a cast gives
            y = (_bnsh_to_bsd(y) if three_d else y).astype(out_dtype, copy=False)
            outs = [y]
            if self.n_out > 1:
                outs += [present[0] if present else None, present[1] if present else None]
            if self.n_out > 3:
                outs.append(None if qk is None else qk.astype(out_dtype, copy=False))
        return tuple(outs[: self.n_out])

    def _products(self, qf, kf, vf, bias, scale: float, fd) -> tuple[np.ndarray, np.ndarray | None]:
        """(Y as (B, N, S, Hv), the qk_matmul_output or None) in ``fd``; overflowing scores
        (inf, then NaN where inf meets inf) are the arithmetic's, unwarned as in onnxruntime."""
        b, n, s, h = qf.shape
        nkv, t = kf.shape[1], kf.shape[2]
        g = n // nkv
        with _one_blas_thread(b * n * s * t * (h + vf.shape[-1])), np.errstate(over="ignore", invalid="ignore"):
            scores = np.matmul(qf.reshape(b, nkv, g * s, h), kf.swapaxes(-1, -2)).reshape(b, n, s, t)
            scores *= fd.type(scale)
            qk = scores.copy() if self.want_qk and self.mode == 0 else None
            if self.softcap > 0:
                scores /= fd.type(self.softcap)
                np.tanh(scores, out=scores)
                scores *= fd.type(self.softcap)
            if self.want_qk and self.mode == 1:
                qk = scores.copy()
            if bias is not None:
                scores += bias
            if self.want_qk and self.mode == 2:
                qk = scores.copy()
            if self.precision is not None and self.precision != fd:
                probs = softmax_rows(scores.astype(self.precision)).astype(fd)
            else:
                probs = softmax_rows(scores)
            if bias is not None:
                # A row whose bias hides every key is zeros whatever its scores (NaN or inf ones
                # included), as the spec decides it: on the bias, not the logits.
                dead = np.isneginf(bias).all(axis=-1, keepdims=True)
                if dead.any():
                    probs = np.where(dead, fd.type(0), probs)
            if self.want_qk and self.mode == 3:
                qk = probs
            y = np.matmul(probs.reshape(b, nkv, g * s, t), vf).reshape(b, n, s, vf.shape[-1])
        return y, qk


@register("GroupQueryAttention", domain="com.microsoft", since=1)
class GroupQueryAttention(Kernel):
    """Causal grouped-query attention with a KV cache (onnxruntime-genai's decoder layers).

    Inputs: query (B, S, N*H) or packed QKV (B, S, (N + 2*Nkv) * H) with key/value omitted;
    key/value (B, S, Nkv*H); past_key/past_value (B, Nkv, P, H) (P may be 0); seqlens_k (B)
    int32 = total length - 1 per row; total_sequence_length (scalar int32); cos_cache/sin_cache
    (max_position, rotary_dim / 2); position_ids (B, S); attention_bias (B or 1, N or 1, S, T);
    head_sink (N).  Outputs: output (B, S, N*H), present_key/present_value (B, Nkv, C, H) with
    ``C = max(total_sequence_length, P)``, in the cache's dtype.  As onnxruntime checks, T =
    total_sequence_length is at least S and either ``P + S`` (a growing cache) or at most P (a
    static cache, a buffer of P rows), and ``seqlens_k`` is in [0, C).  A present that is not
    the past buffer is zero where a call writes nothing (past a row's end, a static cache's
    unused rows), as onnxruntime zeroes it; a present bound to the past buffer itself (the
    shared KV cache, ``run_into``) gets only the new rows: a step costs O(new tokens) there.

    As in onnxruntime, a call is the first prompt when ``S == total_sequence_length``: then every
    row's past is empty and its S new rows fill present rows 0..S-1 (rows of a right-padded
    prompt past ``seqlens_k[b]`` are written but never attended to).  Otherwise row b has
    ``past_b = seqlens_k[b] + 1 - S`` cached tokens and the new ones go to rows
    ``past_b .. past_b + S - 1``.  A present apart from the past gets the valid past rows
    copied (which the attention reads anyway): "past is a max-length buffer" (P = C) and "past
    has exactly the past length" give the same values in every row but the past buffer's rows
    beyond the valid ones, which are zero in the present as in onnxruntime's.

    Query i of row b (absolute position ``p = past_b + i``) attends to keys ``j <= p`` (all
    ``j < seqlens_k[b] + 1`` with ``causal=0``), and with ``local_window_size = W > 0`` only to
    the W keys ``j > p - W`` (itself included; measured against onnxruntime 1.32, whose older
    releases attended to W + 1 keys).  ``softcap`` caps the scaled scores (``softcap * tanh(x / softcap)``) before
    attention_bias is added (onnxruntime's order); ``smooth_softmax`` adds a zero logit to the softmax denominator,
    ``head_sink`` a per-head one.  Rotary (``do_rotary``) rotates Q and K at positions
    ``position_ids`` (for a first prompt only its first element counts: positions
    ``position_ids[0, 0] + i`` for every row, as onnxruntime does) or else ``past_b + i``.

    ``sliding_window_cache=1`` keeps a window-sized cache (see :meth:`_sliding`).  Not
    implemented (the constructor declines): quantized caches (``k_quant_type``,
    ``kv_cache_bit_width``), ``qk_output``, the q/k norm weights and ``query_seqlens``.
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        n, nkv = self.attr("num_heads"), self.attr("kv_num_heads")
        if n is None or nkv is None or int(n) <= 0 or int(nkv) <= 0 or int(n) % int(nkv):
            raise InvalidArgument(
                f"node {node.name!r} (GroupQueryAttention): num_heads ({n}) must be a positive multiple of "
                f"kv_num_heads ({nkv})"
            )
        self.heads, self.kv_heads = int(n), int(nkv)
        self.scale = float(self.attr("scale", 0.0))
        self.softcap = float(self.attr("softcap", 0.0))
        self.window = int(self.attr("local_window_size", -1))
        self.do_rotary = bool(int(self.attr("do_rotary", 0)))
        self.interleaved = bool(int(self.attr("rotary_interleaved", 0)))
        self.smooth = int(self.attr("smooth_softmax", -1)) == 1
        self.causal = bool(int(self.attr("causal", 1)))
        if not self.causal and self.window > 0:
            raise InvalidArgument(f"node {node.name!r} (GroupQueryAttention): local_window_size needs causal=1")
        for name, default in (("k_quant_type", "NONE"), ("v_quant_type", "NONE")):
            if self.attr(name, default) != "NONE":
                raise NotImplementedError(f"GroupQueryAttention {name}={self.attr(name)!r} (quantized KV cache)")
        if int(self.attr("qk_output", 0)):
            raise NotImplementedError("GroupQueryAttention qk_output")
        self.sliding = bool(int(self.attr("sliding_window_cache", 0)))
        if self.sliding and self.window <= 0:
            raise InvalidArgument(f"node {node.name!r} (GroupQueryAttention): sliding_window_cache=1 needs "
                                  f"local_window_size > 0, got {self.window}")
        ins = list(node.input) + [""] * 16
        if any(ins[i] for i in (12, 13, 14, 15)) or (len(node.output) > 3 and node.output[3]):
            raise NotImplementedError("GroupQueryAttention k/v scales, q/k norm weights, query_seqlens or output_qk")
        self.n_out = len(node.output)
        self._again: tuple | None = None  # see _repeat

    # present_key / present_value may be the past_key / past_value buffers themselves.
    bound_outputs: ClassVar[dict[int, int]] = {1: 3, 2: 4}

    def run(self, *inputs):
        return self._run(*inputs)

    def run_into(self, outs, *inputs) -> tuple:
        """Outputs into given buffers.  A present buffer that *is* the past buffer (the caller
        bound ``present_*`` to the same array as ``past_*``: the shared KV cache of
        onnxruntime-genai's ``past_present_share_buffer``) is updated in place: only the new
        rows are written, so a decode step costs O(new tokens) in cache writes, not O(context)."""
        outs = tuple(outs) + (None,) * (3 - len(outs))
        got = list(self._run(*inputs, present=(outs[1], outs[2])))
        for i, given in enumerate(outs[:len(got)]):
            if given is not None and got[i] is not given:
                np.copyto(given, got[i])
                got[i] = given
        return tuple(got)

    def _run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
             total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
             attention_bias=None, head_sink=None, *unused, present=(None, None)):
        if (self._again is not None and key is None and position_ids is None and attention_bias is None
                and head_sink is None and not self.sliding):
            got = self._repeat(query, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache,
                               present)
            if got is not None:
                return got
        if (key is None and past_key is not None and position_ids is None and attention_bias is None and head_sink is None
                and not self.sliding):
            got = self._decode_packed(query, past_key, past_value, seqlens_k, total_sequence_length, cos_cache,
                                      sin_cache, present)
            if got is not None:
                return got
        n, nkv = self.heads, self.kv_heads
        if query.ndim != 3:
            raise _err(self, f"query must be 3-D (batch, sequence, hidden), got {list(query.shape)}")
        b, s, d = query.shape
        fd = _fd(query.dtype)
        if key is None:
            if value is not None or d % (n + 2 * nkv):
                raise _err(self, f"packed QKV needs a last dimension divisible by {n + 2 * nkv}, got {d}")
            h = d // (n + 2 * nkv)
            qf = _f(query, fd)
            q = qf[..., : n * h].reshape(b, s, n, h)
            k = qf[..., n * h:(n + nkv) * h].reshape(b, s, nkv, h)
            v = qf[..., (n + nkv) * h:].reshape(b, s, nkv, h)
        else:
            if value is None or d % n:
                raise _err(self, f"query's last dimension {d} must be a multiple of num_heads {n}, with key and value")
            h = d // n
            if key.shape != (b, s, nkv * h) or value.shape != (b, s, nkv * h):
                raise _err(self, f"key/value must be {[b, s, nkv * h]}, got {list(key.shape)} / {list(value.shape)}")
            q = _f(query, fd).reshape(b, s, n, h)
            k = _f(key, fd).reshape(b, s, nkv, h)
            v = _f(value, fd).reshape(b, s, nkv, h)
        if seqlens_k is None or total_sequence_length is None:
            raise _err(self, "seqlens_k and total_sequence_length are required")
        lens = np.asarray(seqlens_k).reshape(-1).astype(np.int64) + 1
        total = int(np.asarray(total_sequence_length).reshape(-1)[0])
        if lens.shape != (b,):
            raise _err(self, f"seqlens_k must have shape ({b},), got {list(np.shape(seqlens_k))}")
        if (past_key is None) != (past_value is None):
            raise _err(self, "past_key and past_value must be given together")
        plen = 0 if past_key is None else past_key.shape[2]
        if past_key is not None:
            want = (b, nkv, plen, h)
            if past_key.shape != want or past_value.shape != want:
                raise _err(self, f"past_key/past_value must be {list(want)}, got {list(past_key.shape)} / "
                                 f"{list(past_value.shape)}")
        lens_lo, lens_hi = _bounds(lens)
        first_prompt = s == total
        past = np.zeros(b, np.int64) if first_prompt else lens - s
        if self.sliding:
            if lens_lo < 1 or lens_hi > total:
                raise _err(self, f"seqlens_k + 1 must be in [1, total_sequence_length={total}], got {lens.tolist()}")
            return self._sliding(q, k, v, past_key, past_value, past, lens, first_prompt, position_ids, cos_cache,
                                 sin_cache, attention_bias, head_sink, query.dtype, fd, h)
        self._check_total(total, plen, s, b)
        cap = max(total, plen)
        if lens_lo < 1 or lens_hi > cap:  # onnxruntime: seqlens_k in [0, present rows)
            raise _err(self, f"seqlens_k must be in [0, {cap}) (the present cache's rows: max(total_sequence_length"
                             f"={total}, past rows={plen})), got {(lens - 1).tolist()}")
        past_lo, past_hi = _bounds(past)
        if past_lo < 0 or past_hi + s > cap or (not first_prompt and past_hi > plen):
            raise _err(self, f"seqlens_k {(lens - 1).tolist()} do not fit sequence {s}, past {plen}, total {total}")
        if (s == 1 and b == 1 and attention_bias is None and head_sink is None and not self.smooth and self.causal
                and fd == np.float32 and query.dtype == np.float32
                and (past_key is None or past_key.dtype == past_value.dtype == np.float32)):
            got = self._decode_jit(q, k, v, past_key, past_value, past, first_prompt, cap, position_ids, cos_cache,
                                   sin_cache, present)
            if got is not None:
                return got
        if self.do_rotary:
            cos, sin = self._rotary_tables(cos_cache, sin_cache, position_ids, first_prompt, past, s, h, fd)
            rot = 2 * cos.shape[-1]
            q = apply_rotary(q, cos[:, :, None, :], sin[:, :, None, :], self.interleaved, rot)
            k = apply_rotary(k, cos[:, :, None, :], sin[:, :, None, :], self.interleaved, rot)
        cache_dtype = query.dtype if past_key is None else past_key.dtype
        shape = (b, nkv, cap, h)
        (pk, k_shared), (pv, v_shared) = (_present_cache(o, past_c, shape, cache_dtype)
                                          for o, past_c in zip(present, (past_key, past_value)))
        kt = k.transpose(0, 2, 1, 3)  # (B, Nkv, S, H)
        vt = v.transpose(0, 2, 1, 3)
        if past_lo == past_hi:  # every row has the same past: one slice per cache
            p0 = int(past[0])
            if p0 and not k_shared:
                pk[:, :, :p0] = past_key[:, :, :p0]
            if p0 and not v_shared:
                pv[:, :, :p0] = past_value[:, :, :p0]
            pk[:, :, p0:p0 + s] = kt
            pv[:, :, p0:p0 + s] = vt
        else:  # right-padded batch: a slice per row (a loop over the batch only)
            for r in range(b):
                p0 = int(past[r])
                if not k_shared:
                    pk[r, :, :p0] = past_key[r, :, :p0]
                if not v_shared:
                    pv[r, :, :p0] = past_value[r, :, :p0]
                pk[r, :, p0:p0 + s] = kt[r]
                pv[r, :, p0:p0 + s] = vt[r]
        t = int((past + s).max())  # keys any query can see
        if (s == 1 and b == 1 and attention_bias is None and head_sink is None and not self.smooth
                and self.causal):
            return self._decode_step(q, pk, pv, t, query.dtype, fd, h)
        kk = _f(pk[:, :, :t], fd)
        vv = _f(pv[:, :, :t], fd)
        shorter = np.flatnonzero(past + s < t)
        if shorter.size and (k_shared or v_shared):
            # A shorter row's keys up to t, which no query of the row attends: zero in what the
            # products read (a fresh present is zero there already; a shared buffer, whatever the
            # caller left there, possibly NaN, is not written: onnxruntime leaves it as it is).
            kk, vv = np.array(kk), np.array(vv)
            for r in shorter:
                kk[r, :, past[r] + s:t] = 0
                vv[r, :, past[r] + s:t] = 0
        qpos = past[:, None] + np.arange(s)[None, :]  # (B, S) absolute query positions
        j = np.arange(t)[None, None, :]
        exclude = j >= lens[:, None, None]  # beyond the row's length
        if self.causal:
            exclude = exclude | (j > qpos[:, :, None])
        if self.window > 0:
            exclude = exclude | (j <= qpos[:, :, None] - self.window)
        bias = None
        if attention_bias is not None:
            ab = attention_bias
            if (ab.ndim != 4 or ab.shape[0] not in (1, b) or ab.shape[1] not in (1, n) or ab.shape[2] != s
                    or ab.shape[3] < t):
                raise _err(self, f"attention_bias must be ({b} or 1, {n} or 1, {s}, >= {t}), got {list(ab.shape)}")
            bias = _f(ab[..., :t], fd)
        sink, scale = self._sink_scale(head_sink, n, h, fd)
        out, _ = _attend(q.transpose(0, 2, 1, 3), kk, vv, scale, exclude=exclude[:, None], softcap=self.softcap,
                         post_bias=bias, sink=sink)
        y = _bnsh_to_bsd(out).astype(query.dtype, copy=False)
        return (y, pk, pv)[: self.n_out]

    def _check_total(self, total: int, plen: int, s: int, b: int) -> None:
        """onnxruntime's checks of ``total_sequence_length`` T against the past buffer's P rows
        and the S new tokens (a cache that is not ``sliding_window_cache``): ``T >= S``, and
        ``T == P + S`` (a growing cache: present is past plus the new rows) or ``T <= P`` (a
        static cache: present is a buffer of P rows).  A larger T would ask for present rows
        that no past and no new token fills.  Several new tokens after a past (a chunk of a
        prompt) only for a batch of one."""
        if total < s:
            raise _err(self, f"total_sequence_length must be at least kv_sequence_length for a non-sliding cache, "
                             f"got {total} and {s}")
        if b > 1 and s > 1 and s != total:  # (not a first prompt: the new tokens follow a past)
            raise _err(self, "batch_size must be 1 when sequence_length > 1 and past context is given, got batch "
                             f"{b}, sequence {s}, total_sequence_length {total}")
        if total != plen + s and total > plen:
            raise _err(self, f"total_sequence_length must equal past_sequence_length + kv_sequence_length for a "
                             f"dynamic cache, or be no greater than past_sequence_length for a static cache, got "
                             f"total_sequence_length={total}, past_sequence_length={plen}, kv_sequence_length={s}")

    def _sink_scale(self, head_sink, n: int, h: int, fd) -> tuple:
        """(the softmax's extra logit: ``head_sink`` per head, 0 for ``smooth_softmax``, else None;
        the scores' scale)."""
        sink = None
        if head_sink is not None:
            if head_sink.shape != (n,):
                raise _err(self, f"head_sink must have shape ({n},), got {list(head_sink.shape)}")
            sink = _f(head_sink, fd).reshape(1, n, 1, 1)
        elif self.smooth:
            sink = fd.type(0)
        return sink, (self.scale if self.scale != 0.0 else 1.0 / math.sqrt(h))

    def _sliding(self, q, k, v, past_key, past_value, past, lens, first_prompt: bool, position_ids, cos_cache,
                 sin_cache, attention_bias, head_sink, out_dtype, fd, h: int) -> tuple:
        """``sliding_window_cache=1`` (the builder's local-attention layers, Gemma-2): the cache
        is a buffer of C rows (``past_key``'s length, at least the window W) holding, from row 0,
        the last :func:`sliding_rows` tokens of the row's past.  The present holds, from row 0,
        the last ``sliding_rows(past + S)`` of those rows followed by the S new tokens (rows
        after them unspecified: zero here).  Attention reads the past rows and the new tokens
        before the cut, at their absolute positions: the same as a full cache.  Measured
        against onnxruntime 1.32 (bit-identical logits; the layout on random chunk sequences
        with C = W .. W + 5); it refuses a cache shorter than the window."""
        b, s, n, _ = q.shape
        if past_key is None:
            raise _err(self, "sliding_window_cache=1 needs past_key and past_value (the window's cache buffers)")
        cap = past_key.shape[2]
        if cap < self.window:
            raise _err(self, f"sliding_window_cache=1: the cache holds {cap} rows, fewer than local_window_size "
                             f"{self.window}")
        if attention_bias is not None:
            raise _err(self, "attention_bias with sliding_window_cache=1 is not supported")
        if int(lens.min(initial=s)) < s:  # (onnxruntime: no right-padded prompt with this cache)
            raise _err(self, f"seqlens_k {(lens - 1).tolist()}: each row must hold the {s} new tokens")
        if self.do_rotary:
            cos, sin = self._rotary_tables(cos_cache, sin_cache, position_ids, first_prompt, past, s, h, fd)
            rot = 2 * cos.shape[-1]
            q = apply_rotary(q, cos[:, :, None, :], sin[:, :, None, :], self.interleaved, rot)
            k = apply_rotary(k, cos[:, :, None, :], sin[:, :, None, :], self.interleaved, rot)
        cache_dtype = past_key.dtype
        kt = k.transpose(0, 2, 1, 3).astype(cache_dtype, copy=False)  # (B, Nkv, S, H)
        vt = v.transpose(0, 2, 1, 3).astype(cache_dtype, copy=False)
        pk = np.zeros(past_key.shape, cache_dtype)
        pv = np.zeros(past_value.shape, cache_dtype)
        sink, scale = self._sink_scale(head_sink, n, h, fd)
        y = np.empty((b, s, n * h), out_dtype)
        for r in range(b):  # rows may differ in their past: each its own keys
            p = int(past[r])
            keep = sliding_rows(p, cap, self.window)
            keys = np.concatenate([past_key[r, :, :keep], kt[r]], axis=1)  # (Nkv, keep + S, H)
            values = np.concatenate([past_value[r, :, :keep], vt[r]], axis=1)
            pos = np.arange(p - keep, p + s)[None, :]  # the keys' absolute positions
            qpos = (p + np.arange(s))[:, None]
            exclude = pos >= lens[r]
            if self.causal:
                exclude = exclude | (pos > qpos)
            if self.window > 0:
                exclude = exclude | (pos <= qpos - self.window)
            out, _ = _attend(q[r:r + 1].transpose(0, 2, 1, 3), _f(keys[None], fd), _f(values[None], fd), scale,
                             exclude=exclude[None, None], softcap=self.softcap, sink=sink)
            y[r] = _bnsh_to_bsd(out)[0].astype(out_dtype, copy=False)
            cut = keys.shape[1] - sliding_rows(p + s, cap, self.window)
            pk[r, :, :keys.shape[1] - cut] = keys[:, cut:]
            pv[r, :, :keys.shape[1] - cut] = values[:, cut:]
        return (y, pk, pv)[: self.n_out]

    def _repeat(self, query, past_key, past_value, seqlens_k, total, cos_cache, sin_cache, present) -> tuple | None:
        """:meth:`_decode_packed` for the decoding step of a shared KV cache (``present_*`` bound
        to the very ``past_*`` arrays) on the native kernels, by what :meth:`_decode_packed` found
        for the same query and cache shapes and the same cos/sin caches before (``_again``): the
        per-step values (the position, the keys' range) are checked as it checks them, the rest
        is not redone, and the kernel gets data addresses (the new token's q/k/v inside the
        packed query, the cos/sin rows inside the caches: no copies).  None for anything else.

        Why: this runs once per layer per token, and :meth:`_decode_packed` costs ~40 us of Python
        per call (~1 ms per token on Qwen2.5-0.5B) around a kernel of a few microseconds."""
        kept = self._again
        if (query.__class__ is not np.ndarray or past_key.__class__ is not np.ndarray
                or past_value.__class__ is not np.ndarray or present[0] is not past_key or present[1] is not past_value
                or query.shape != kept[0] or past_key.shape != kept[1] or past_value.shape != kept[1]
                or query.dtype != _F32 or past_key.dtype != _F32 or past_value.dtype != _F32
                or not (query.flags.c_contiguous and past_key.flags.c_contiguous and past_value.flags.c_contiguous
                        and past_key.flags.writeable and past_value.flags.writeable)
                or cos_cache is not kept[2] or sin_cache is not kept[3] or seqlens_k.__class__ is not np.ndarray
                or total.__class__ is not np.ndarray or seqlens_k.size != 1 or total.size != 1
                or seqlens_k.dtype.kind != "i" or total.dtype.kind != "i"):
            return None
        kern = _act.native()
        if kern is None or not hasattr(kern, "gqa_decode_at"):
            return None  # (numba's module: no address-level entry)
        n, nkv = self.heads, self.kv_heads
        _, _, plen, h = kept[1]
        length, t_total = int(seqlens_k.item()) + 1, int(total.item())
        if length < 1 or length > t_total or t_total == 1 or t_total > plen:
            return None  # (a first prompt, or a present larger than the past: not the shared cache)
        p0 = length - 1
        if p0 >= kept[6]:
            return None
        lo = max(0, p0 + 1 - self.window) if self.window > 0 else 0
        if p0 + 1 - lo > _JIT_MAX_KEYS and not kern.gqa_splits(nkv, p0 + 1 - lo):
            return None
        out = np.empty((1, 1, n * h), _F32)
        address = kern.address
        q = address(query)
        row = 4 * kept[5]
        kern.gqa_decode_at(n, nkv, h, plen, kept[5], p0, lo, q, q + 4 * n * h, q + 4 * (n + nkv) * h,
                           address(past_key), address(past_value), kept[7] + p0 * row, kept[8] + p0 * row,
                           address(out),
                           self.interleaved, kept[4], self.softcap)
        return (out, past_key, past_value)[: self.n_out]

    def _decode_packed(self, query, past_key, past_value, seqlens_k, total, cos_cache, sin_cache,
                       present) -> tuple | None:
        """The decoding step of onnxruntime-genai's graphs — one float32 token of one sequence,
        packed QKV, a past, no position_ids / attention_bias / head_sink — with what
        :meth:`_run` checks checked on Python ints and the cos/sin rows taken straight from the
        caches (no position gather); the same JIT call as :meth:`_decode_jit` (:meth:`_jit_step`).  None for anything else (or anything :meth:`_run`
        would refuse, which then says why): the general path computes it.

        Why: this step runs once per layer per token, and the general path's validation and
        its rotary gathers cost ~100 us of Python per call (2.6 ms per token on
        Qwen2.5-0.5B's 24 layers, measured with the native calls stubbed out)."""
        if (query.__class__ is not np.ndarray or query.ndim != 3 or query.shape[0] != 1 or query.shape[1] != 1
                or query.dtype != _F32 or not query.flags.c_contiguous or self.smooth or not self.causal
                or past_value is None or past_key.dtype != _F32 or past_value.dtype != _F32
                or seqlens_k is None or total is None or seqlens_k.size != 1 or total.size != 1
                or seqlens_k.dtype.kind != "i" or total.dtype.kind != "i"):
            return None
        n, nkv = self.heads, self.kv_heads
        d = query.shape[2]
        if d % (n + 2 * nkv):
            return None
        h = d // (n + 2 * nkv)
        plen = past_key.shape[2] if past_key.ndim == 4 else -1
        if past_key.shape != (1, nkv, plen, h) or past_value.shape != past_key.shape:
            return None
        length, t_total = int(seqlens_k.item()) + 1, int(total.item())
        if length < 1 or length > t_total or t_total < 1 or (t_total != plen + 1 and t_total > plen):
            return None  # (what _run refuses, or a static cache's seqlens_k past total: _run computes it)
        first = t_total == 1  # the first prompt, of one token
        p0 = 0 if first else length - 1
        cap = max(t_total, plen)
        if p0 + 1 > cap or (not first and p0 > plen):
            return None
        got = self._jit_for(p0)
        if got is None:
            return None
        kern, lo = got
        half = 0
        cos = sin = _NO_ROTARY
        if self.do_rotary:
            if cos_cache is None or sin_cache is None or cos_cache.ndim != 2 or sin_cache.ndim != 2:
                return None
            half = cos_cache.shape[1]
            if sin_cache.shape[1] != half or 2 * half > h or p0 >= cos_cache.shape[0] or p0 >= sin_cache.shape[0]:
                return None
            # Copies of the rows (half floats each): a fresh writable array's address is cheaper
            # to take than a read-only view's.
            cos = np.array(cos_cache[p0], dtype=_F32)
            sin = np.array(sin_cache[p0], dtype=_F32)
        rows = query.reshape(n + 2 * nkv, h)
        got = self._jit_step(kern, rows[:n], rows[n:n + nkv], rows[n + nkv:], past_key, past_value, present, p0, lo,
                             cap, cos, sin, half)
        if (present[0] is past_key and present[1] is past_value and cap == plen and hasattr(kern, "gqa_decode_at")
                and past_key.flags.c_contiguous and past_value.flags.c_contiguous and past_key.flags.writeable
                and past_value.flags.writeable):
            tables = (cos_cache, sin_cache) if self.do_rotary else (_NO_ROTARY, _NO_ROTARY)
            if all(t.__class__ is np.ndarray and t.dtype == _F32 and t.flags.c_contiguous for t in tables):
                limit = min(cos_cache.shape[0], sin_cache.shape[0]) if self.do_rotary else 1 << 62
                scale = self.scale if self.scale != 0.0 else 1.0 / math.sqrt(h)
                self._again = (query.shape, past_key.shape, cos_cache, sin_cache, scale, half, limit,
                               kern.address(tables[0]), kern.address(tables[1]))
        return got

    def _rotary_tables(self, cos_cache, sin_cache, position_ids, first_prompt: bool, past, s: int, h: int, fd):
        """(cos, sin) rows, each (B, S, rotary_dim / 2) in ``fd``, at the new tokens' positions:
        ``position_ids`` (for a first prompt only its first element counts, as in onnxruntime)
        or else each row's past length onwards."""
        if cos_cache is None or sin_cache is None:
            raise _err(self, "do_rotary=1 needs cos_cache and sin_cache")
        b = past.shape[0]
        if position_ids is not None:
            if position_ids.shape != (b, s):
                raise _err(self, f"position_ids must have shape {[b, s]}, got {list(position_ids.shape)}")
            pos = position_ids
            if first_prompt:  # onnxruntime reads only the first element for a first prompt
                pos = np.broadcast_to(int(position_ids.reshape(-1)[0]) + np.arange(s), (b, s))
        else:
            pos = past[:, None] + np.arange(s)[None, :]
        half = cos_cache.shape[-1]
        if 2 * half > h:
            raise _err(self, f"cos_cache width {half} exceeds head_size / 2 = {h // 2}")
        return (_f(_gather_cache(self, cos_cache, pos, half, "cos_cache"), fd),
                _f(_gather_cache(self, sin_cache, pos, half, "sin_cache"), fd))

    def _decode_jit(self, q, k, v, past_key, past_value, past, first_prompt: bool, cap: int, position_ids,
                    cos_cache, sin_cache, present) -> tuple | None:
        """One float32 token of one sequence by the JIT kernel (``_attn_jit.gqa_decode``: rotary,
        the cache row, the attention in one call), or None when no JIT is available or the token
        sees more than ``_JIT_MAX_KEYS`` keys and the kernel does not share its KV heads out over
        threads (then the numpy path below computes the same).
        ``q``/``k``/``v`` are (1, 1, heads, H); the new token sits at cache row ``past[0]``; past
        rows are copied into a present buffer that is not the past buffer itself."""
        p0 = int(past[0])
        got = self._jit_for(p0)
        if got is None:
            return None
        kern, lo = got
        h = q.shape[-1]
        half = 0
        cos = sin = _NO_ROTARY
        if self.do_rotary:
            cos2, sin2 = self._rotary_tables(cos_cache, sin_cache, position_ids, first_prompt, past, 1, h,
                                             np.dtype(np.float32))
            cos, sin = np.ascontiguousarray(cos2[0, 0]), np.ascontiguousarray(sin2[0, 0])
            half = cos.shape[0]
        return self._jit_step(kern, q[0, 0], k[0, 0], v[0, 0], past_key, past_value, present, p0, lo, cap, cos, sin,
                              half)

    def _jit_for(self, p0: int) -> tuple[Any, int] | None:
        """(the JIT kernels, the first key) for a token at cache row ``p0``, or None when no JIT is
        available or the token sees more than ``_JIT_MAX_KEYS`` keys and the kernel does not share
        its KV heads out over threads."""
        lo = max(0, p0 + 1 - self.window) if self.window > 0 else 0
        kern = _act.attn_kernels()
        if kern is None or (p0 + 1 - lo > _JIT_MAX_KEYS
                            and not (hasattr(kern, "gqa_splits") and kern.gqa_splits(self.kv_heads, p0 + 1 - lo))):
            return None
        return kern, lo

    def _jit_step(self, kern, q, k, v, past_key, past_value, present, p0: int, lo: int, cap: int, cos, sin,
                  half: int) -> tuple:
        """The JIT call of one float32 token: ``q`` (heads, H), ``k``/``v`` (kv_heads, H), C-contiguous;
        past rows are copied into a present buffer that is not the past buffer itself (zeroed
        first: see :func:`_present_cache`)."""
        n, nkv = self.heads, self.kv_heads
        h = q.shape[-1]
        shape = (1, nkv, cap, h)
        (pk, k_shared), (pv, v_shared) = (
            _present_cache(o if o is None or o.flags.c_contiguous else None, past_c, shape, _F32)
            for o, past_c in zip(present, (past_key, past_value)))
        if p0 and not k_shared:
            pk[:, :, :p0] = past_key[:, :, :p0]
        if p0 and not v_shared:
            pv[:, :, :p0] = past_value[:, :, :p0]
        out = np.empty((1, 1, n * h), _F32)
        scale = self.scale if self.scale != 0.0 else 1.0 / math.sqrt(h)
        kern.gqa_decode(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), pk[0], pv[0], p0,
                        lo, cos, sin, half, self.interleaved, scale, self.softcap, out.reshape(n, h),
                        np.empty(h, _F32), np.empty(p0 + 1 - lo, _F32))
        return (out, pk, pv)[: self.n_out]

    def _decode_step(self, q, pk, pv, t: int, dtype, fd, h: int) -> tuple:
        """One new token of one sequence (the decoding step): the general path's arithmetic on
        (Nkv, keys, G) products with no mask to build — the query at position ``t - 1`` sees keys
        ``0 .. t-1`` (the last W with ``local_window_size = W``) — in about half the numpy calls
        (24 of them per token on Qwen2.5-0.5B)."""
        n, nkv = self.heads, self.kv_heads
        g = n // nkv
        lo = max(0, t - self.window) if self.window > 0 else 0
        kk = _f(pk[0, :, lo:t], fd)  # (Nkv, T, H)
        vv = _f(pv[0, :, lo:t], fd)
        qg = q.reshape(nkv, g, h)
        scale = self.scale if self.scale != 0.0 else 1.0 / math.sqrt(h)
        # Keys as the left operand (numpy's batched matmul with a transposed right operand is
        # slow), then the small (Nkv, T, G) product turned to (Nkv, G, T) rows: the softmax runs
        # along contiguous rows and the value product takes a plain left operand (transposed, it
        # cost ~0.4 ms per layer at 1,024 keys).
        scores = np.ascontiguousarray(np.matmul(kk, np.ascontiguousarray(qg.swapaxes(-1, -2))).swapaxes(-1, -2))
        scores *= fd.type(scale)
        if self.softcap > 0:
            scores /= fd.type(self.softcap)
            np.tanh(scores, out=scores)
            scores *= fd.type(self.softcap)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = np.matmul(scores, vv)  # (Nkv, G, H)
        y = out.reshape(1, 1, n * h).astype(dtype, copy=False)
        return (y, pk, pv)[: self.n_out]
