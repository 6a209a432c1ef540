"""onnxruntime's normalizations beyond ONNX: SkipLayerNormalization, SkipSimplifiedLayerNormalization
(com.microsoft), SimplifiedLayerNormalization and LayerNormalization before opset 17 (registered by
onnxruntime in the *default* domain from version 1), EmbedLayerNormalization (com.microsoft); and
ONNX's RMSNormalization-23, SimplifiedLayerNormalization's standard form.

onnxruntime 1.32 has no com.microsoft LayerNormalization or SimplifiedLayerNormalization (its
schema list has them only in the default domain), so neither is registered there.

Everything is computed in float32 (float64 stays float64) and rounded once, as onnxruntime's CPU
kernels do for float16: they widen input, skip and bias, sum in float, and round the sum (the
``input_skip_bias_sum`` output) and the normalized result separately.  Statistics outputs
(``mean``, ``inv_std_var``) are float32 with the normalized axes kept as 1, as onnxruntime
returns them.

EmbedLayerNormalization pre-packs its float32 tables (word, position, segment embeddings, gamma,
beta) as identity packs, so they are shared, saved and mapped like any packed weight and ``run``
never reads the originals.  float16 tables are left unpacked: widening a table to float32 would
double its memory to save the widening of only the ``batch * sequence`` rows a call gathers.
"""

from __future__ import annotations

import logging

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, broadcasts_to, register
from onnxpack.session.kernels.norm import LayerNormalization, layer_norm_rows

logger = logging.getLogger(__name__)

__all__ = ["layer_norm_f", "rms_norm_f"]

# onnxruntime's LayerNormalization for opsets 1-16 (a contrib kernel in the default domain) has
# the same attributes, inputs and outputs as ONNX's LayerNormalization-17, but lets Scale/B/Y have
# another type than X (the kernel reads ctx.opset: see norm.LayerNormalization).
register("LayerNormalization", since=1)(LayerNormalization)


def _float(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def layer_norm_f(x: np.ndarray, gamma, beta, eps: float, axis: int = -1):
    """LayerNorm of a float32/float64 ``x`` over its axes from ``axis`` on, in place on ``x``.

    Returns ``(y, mean, inv_std)`` with the statistics shaped like ``x`` with those axes 1.
    ``x`` must be a fresh array (it becomes ``y``).  Infinities and NaN propagate as NaN without
    numpy's warnings (onnxruntime warns of nothing either).
    """
    axes = tuple(range(axis % x.ndim, x.ndim))
    with np.errstate(all="ignore"):
        # Sums in float64, as the JIT's rows (norm.layer_norm_rows): a float32 row near the
        # float32 maximum has a finite mean, as in onnxruntime (float32 sums overflowed to inf).
        mean = x.mean(axis=axes, keepdims=True, dtype=np.float64).astype(x.dtype)
        x -= mean
        inv = np.mean(np.square(x), axis=axes, keepdims=True, dtype=np.float64).astype(x.dtype)
        inv += x.dtype.type(eps)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        x *= inv
        x *= gamma
        if beta is not None:
            x += beta
    return x, mean, inv


def rms_norm_f(x: np.ndarray, gamma, eps: float, axis: int = -1):
    """RMS norm (``x / sqrt(mean(x**2) + eps) * gamma``) in place on a fresh float ``x``.

    Returns ``(y, inv_std)``; no numpy warnings (see :func:`layer_norm_f`).
    """
    axes = tuple(range(axis % x.ndim, x.ndim))
    with np.errstate(all="ignore"):
        inv = np.mean(np.square(x), axis=axes, keepdims=True)
        inv += x.dtype.type(eps)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        x *= inv
        x *= gamma
    return x, inv


def _rms_jit(x, skip, gamma, bias, eps: float, want_sum: bool):
    """``(y, inv_std_var, input_skip_bias_sum or None)`` of RMS normalization over the last axis
    by the JIT kernel (``_conv_jit.rms_rows``: native code cache or numba) for float32 ``x``,
    ``skip`` (``x``'s shape or None), ``gamma`` and ``bias`` (D values or None); None when a
    dtype differs or no JIT is available (then the numpy path computes the same)."""
    d = x.shape[-1] if x.ndim else 0
    if (x.dtype != np.float32 or x.size == 0 or gamma.dtype != np.float32 or gamma.size != d
            or any(v is not None and v.dtype != np.float32 for v in (skip, bias))
            or (bias is not None and bias.size != d)):
        return None
    k = _act.act_kernels()
    if k is None:
        return None
    x2 = np.ascontiguousarray(x).reshape(-1, d)
    rows = x2.shape[0]
    sk = np.empty((0, d), np.float32) if skip is None else np.ascontiguousarray(skip).reshape(rows, d)
    y = np.empty((rows, d), np.float32)
    total = np.empty((rows, d), np.float32) if want_sum else np.empty((0, d), np.float32)
    inv = np.empty(rows, np.float32)
    k.rms_rows(x2, sk, _NO_VALUES if bias is None else _vector(bias, d), _vector(gamma, d), np.float32(eps), y, total,
               inv, 0, rows)
    stat = x.shape[:-1] + (1,)
    return y.reshape(x.shape), inv.reshape(stat), (total.reshape(x.shape) if want_sum else None)


_NO_VALUES = np.zeros(0, np.float32)
_NO_ROWS = np.zeros((0, 0), np.float32)  # the kernel's sum output when none is wanted


def _vector(v: np.ndarray, d: int) -> np.ndarray:
    """``v`` as a contiguous (d,) array: the weight itself when it is one (the native kernels
    remember a weight's address; a view made per call would be looked up anew each time)."""
    if v.shape == (d,) and v.flags.c_contiguous:
        return v
    return np.ascontiguousarray(v).reshape(d)


def _to(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return y if y.dtype == dtype else y.astype(dtype)


class _SkipNorm(Kernel):
    """Shared by SkipLayerNormalization and SkipSimplifiedLayerNormalization."""

    _simplified = False

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.epsilon = float(self.attr("epsilon", 1e-12))
        outs = list(node.output) + [""] * 4
        self.want_mean = bool(outs[1])
        self.want_inv = bool(outs[2])
        self.want_sum = bool(outs[3])
        self.n_out = len(node.output)
        self._again: tuple | None = None  # see _repeat

    def _check(self, x, skip, gamma, beta, bias) -> int:
        if x.ndim not in (2, 3):
            raise InvalidArgument(
                f"node {self.node.name!r} ({self.op_type}): input must be 3-D (batch, sequence, hidden) or 2-D "
                f"(tokens, hidden), got shape {list(x.shape)}"
            )
        h = x.shape[-1]
        ok_skip = skip.shape == x.shape or (skip.ndim >= 2 and skip.shape[-1] == h and skip.shape[-2] == x.shape[-2]
                                            and all(d == 1 for d in skip.shape[:-2]) and skip.ndim <= x.ndim)
        if not ok_skip:
            raise InvalidArgument(
                f"node {self.node.name!r} ({self.op_type}): skip must have shape {list(x.shape)}, "
                f"(1, {x.shape[-2]}, {h}) or ({x.shape[-2]}, {h}), got {list(skip.shape)}"
            )
        for name, v in (("gamma", gamma), ("beta", beta), ("bias", bias)):
            if v is not None and v.shape not in ((h,), (1, h), (1, 1, h)):
                raise InvalidArgument(
                    f"node {self.node.name!r} ({self.op_type}): {name} must have shape ({h},), got {list(v.shape)}"
                )
        return h

    def _repeat(self, x, skip, gamma) -> tuple | None:
        """The outputs by the native RMS kernel when ``x``, ``skip`` and ``gamma`` are as in the
        call that :meth:`_run` last computed so (float32, C-contiguous, the same shapes, the same
        gamma array, no bias), else None.  Why: a decoding step runs this twice per layer on one
        token, and the checks and reshapes of the full path cost ~15 us of Python per call, three
        times the kernel (measured on Qwen2.5-0.5B)."""
        kept = self._again
        if (x.__class__ is not np.ndarray or skip.__class__ is not np.ndarray or gamma is not kept[1]
                or x.shape != kept[0] or skip.shape != kept[0] or x.dtype != np.float32 or skip.dtype != np.float32
                or not x.flags.c_contiguous or not skip.flags.c_contiguous):
            return None
        k = _act.native()
        if k is None:
            return None
        shape, _, rows, d, stat = kept
        y = np.empty(shape, np.float32)
        total = np.empty(shape, np.float32) if self.want_sum else _NO_ROWS
        inv = np.empty(stat, np.float32)
        k.rms(rows, d, x, skip, rows, _NO_VALUES, 0, gamma, y, total, rows if self.want_sum else 0, inv,
              np.float32(self.epsilon))
        mean = np.zeros_like(inv) if self.want_mean else None
        return (y, mean, inv if self.want_inv else None, total if self.want_sum else None)[: self.n_out]

    def _run(self, x, skip, gamma, beta, bias):
        if bias is None and self._again is not None:
            got = self._repeat(x, skip, gamma)
            if got is not None:
                return got
        self._check(x, skip, gamma, beta, bias)
        if self._simplified and skip.shape == x.shape:
            got = _rms_jit(x, skip, gamma, bias, self.epsilon, self.want_sum)
            if got is not None:
                y, inv, total = got
                if (bias is None and x.__class__ is np.ndarray and skip.__class__ is np.ndarray
                        and x.flags.c_contiguous and skip.flags.c_contiguous and gamma.shape == (x.shape[-1],)
                        and gamma.flags.c_contiguous and gamma.__class__ is np.ndarray and x.size
                        and hasattr(_act.native(), "rms")):
                    self._again = (x.shape, gamma, x.size // x.shape[-1], x.shape[-1], x.shape[:-1] + (1,))
                mean = np.zeros_like(inv) if self.want_mean else None
                return (y, mean, inv if self.want_inv else None, total)[: self.n_out]
        fd = _float(x.dtype)
        s = x.astype(fd)
        s += skip
        if bias is not None:
            s += bias
        g = gamma.reshape(-1)
        fast = None
        if fd == np.float32 and not self._simplified and s.size:
            # The JIT's one pass per row (the numpy path's ten passes over the activations took
            # 0.24 ms of BERT-base's 128 x 768, per call): the same two-pass statistics.
            fast = layer_norm_rows(s.reshape(-1, s.shape[-1]), g.astype(np.float32, copy=False),
                                   None if beta is None else beta.reshape(-1).astype(np.float32, copy=False),
                                   self.epsilon)
        total = _to(s, x.dtype) if self.want_sum else None
        if fast is None and self.want_sum and total is s:
            total = s.copy()  # s is normalized in place below
        if fast is not None:
            y, mean, inv = fast
            stat = s.shape[:-1] + (1,)
            y, mean, inv = y.reshape(s.shape), mean.reshape(stat), inv.reshape(stat)
        elif self._simplified:
            y, inv = rms_norm_f(s, g, self.epsilon)
            mean = np.zeros_like(inv) if self.want_mean else None
        else:
            y, mean, inv = layer_norm_f(s, g, None if beta is None else beta.reshape(-1), self.epsilon)
        outs = (_to(y, x.dtype), _to(mean, np.float32) if self.want_mean else None,
                _to(inv, np.float32) if self.want_inv else None, total)
        return outs[: self.n_out]


@register("SkipLayerNormalization", domain="com.microsoft", since=1)
class SkipLayerNormalization(_SkipNorm):
    """``LayerNorm(input + skip + bias) * gamma + beta`` over the last axis.

    Outputs: output, mean, inv_std_var (float32, shape (..., 1)), input_skip_bias_sum.
    """

    def run(self, x, skip, gamma, beta=None, bias=None):
        return self._run(x, skip, gamma, beta, bias)


@register("SkipSimplifiedLayerNormalization", domain="com.microsoft", since=1)
class SkipSimplifiedLayerNormalization(_SkipNorm):
    """``RMSNorm(input + skip + bias) * gamma`` over the last axis.

    Outputs: output, mean (unused by the math; zeros when requested), inv_std_var,
    input_skip_bias_sum.
    """

    _simplified = True

    def run(self, x, skip, gamma, bias=None):
        return self._run(x, skip, gamma, None, bias)


@register("SimplifiedLayerNormalization", since=1)
class SimplifiedLayerNormalization(Kernel):
    """RMS normalization over the axes from ``axis`` on (onnxruntime registers it in the default
    domain for every opset).  Outputs Y (the scale's dtype, onnxruntime's type V) and the
    float32 inv_std_var (shape of X with the normalized axes 1)."""

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", -1))
        self.epsilon = float(self.attr("epsilon", 1e-5))
        if int(self.attr("stash_type", 1)) != 1:
            raise NotImplementedError("SimplifiedLayerNormalization stash_type != 1")
        self.n_out = len(node.output)

    def run(self, x, scale):
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        if not 0 <= axis < max(x.ndim, 1):
            raise InvalidArgument(
                f"node {self.node.name!r} (SimplifiedLayerNormalization): axis {self.axis} out of range for "
                f"rank {x.ndim}"
            )
        if axis == x.ndim - 1:
            got = _rms_jit(x, None, scale, None, self.epsilon, False)
            if got is not None:
                return got[:2][: self.n_out]
        fd = _float(np.result_type(x.dtype, scale.dtype) if np.float64 in (x.dtype, scale.dtype) else x.dtype)
        y, inv = rms_norm_f(x.astype(fd), scale, self.epsilon, axis)
        return (_to(y, scale.dtype), _to(inv, np.dtype(np.float32)))[: self.n_out]  # (float32 for float64 X too)


# stash_type -> the least precision of RMSNormalization's first stage (bfloat16: float32, numpy
# has no bfloat16)
_STASH = {1: np.dtype(np.float32), 10: np.dtype(np.float16), 11: np.dtype(np.float64), 16: np.dtype(np.float32)}


@register("RMSNormalization", since=23)
class RMSNormalization(Kernel):
    """ONNX RMSNormalization-23 (torch's exporter writes it for RMSNorm at opset 23):
    ``Cast(X / sqrt(mean(X**2) + epsilon), X's dtype) * scale`` over the axes from ``axis`` on,
    as the op's function body computes it; ``scale`` broadcasts to X (unidirectionally).  The
    first stage runs in ``stash_type``'s precision (float32 by default) or X's when that is wider
    (float64 X stays float64, as in onnxruntime and onnx.reference), its mean of squares summed in
    float64; float32 over the last axis runs in the JIT's one pass (``rms_rows``, shared with
    SimplifiedLayerNormalization) when it is available, whose float32 sums overflow for rows of
    values beyond ~1e19 (zeros there)."""

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", -1))
        self.epsilon = float(self.attr("epsilon", 1e-5))
        stash = int(self.attr("stash_type", 1))
        if stash not in _STASH:
            raise InvalidArgument(
                f"node {node.name!r} (RMSNormalization): stash_type must be one of {sorted(_STASH)}, got {stash}")
        self.stash = _STASH[stash]

    def run(self, x, scale):
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        if not 0 <= axis < x.ndim:
            raise InvalidArgument(
                f"node {self.node.name!r} (RMSNormalization): axis {self.axis} out of range for rank {x.ndim}")
        if x.dtype.kind != "f" or scale.dtype.kind != "f":
            raise InvalidArgument(f"node {self.node.name!r} (RMSNormalization): X and scale must be float tensors, "
                                  f"got {x.dtype} and {scale.dtype}")
        if not broadcasts_to(scale.shape, x.shape):
            raise InvalidArgument(
                f"node {self.node.name!r} (RMSNormalization): scale of shape {list(scale.shape)} does not "
                f"broadcast to X's {list(x.shape)}")
        stage = np.promote_types(self.stash, x.dtype)
        if stage == np.float32 and axis == x.ndim - 1 and x.dtype == np.float32:
            got = _rms_jit(x, None, scale, None, self.epsilon, False)
            if got is not None:
                return (got[0],)
        if x.size == 0:  # nothing to normalize (numpy's mean of an empty axis would warn)
            return (np.multiply(x, scale),)
        with np.errstate(all="ignore"):  # inf / NaN inputs, a zero row with epsilon 0: the arithmetic's
            xf = x.astype(stage)  # a fresh array: normalized in place
            inv = np.mean(np.square(xf, dtype=np.float64), axis=tuple(range(axis, x.ndim)), keepdims=True)
            inv += self.epsilon
            np.sqrt(inv, out=inv)
            np.reciprocal(inv, out=inv)
            xf *= inv.astype(stage, copy=False)
            return (np.multiply(_to(xf, x.dtype), scale),)


# -- EmbedLayerNormalization ----------------------------------------------------------------------
_EMBED_PACK_VERSION = 1
_EMBED_TABLES = (2, 3, 4, 5, 6)  # word, position, segment embeddings, gamma, beta


@register("EmbedLayerNormalization", domain="com.microsoft", since=1)
class EmbedLayerNormalization(Kernel):
    """``LayerNorm(word[input_ids] + position[position_ids] + segment[segment_ids])``.

    ``position_ids`` (input 8, (batch, seq) or (1, seq)) defaults to ``0 .. seq-1``.  Output 1,
    ``mask_index``, is the number of non-zero entries of each row of ``mask`` (zeros without a
    mask), as onnxruntime computes it; output 2 is the embedding sum before normalization.
    Out-of-range ids are an error, as in onnxruntime.
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.epsilon = float(self.attr("epsilon", 1e-12))
        self.tables: dict[int, np.ndarray] = {}
        outs = list(node.output) + ["", ""]
        self.want_mask = bool(outs[1])
        self.want_sum = bool(outs[2])
        self.n_out = len(node.output)

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index not in _EMBED_TABLES or np.dtype(info.dtype) != np.float32:
            return None
        return PackSpec("embed_layer_norm", _EMBED_PACK_VERSION, b"", 1, identity=True)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        return [(np.dtype(np.float32), tuple(info.shape))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.ascontiguousarray(weight, dtype=np.float32),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (self.tables[input_index],) = buffers

    def _gather(self, table: np.ndarray, ids: np.ndarray, what: str) -> np.ndarray:
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            bad = ids[(ids < 0) | (ids >= table.shape[0])].reshape(-1)[0]
            raise InvalidArgument(
                f"node {self.node.name!r} (EmbedLayerNormalization): {what} {int(bad)} out of range "
                f"[0, {table.shape[0]})"
            )
        return table[ids]

    def run(self, input_ids, segment_ids=None, word=None, position=None, segment=None, gamma=None, beta=None,
            mask=None, position_ids=None):
        word, position, segment, gamma, beta = (
            self.tables.get(i, v) for i, v in zip(_EMBED_TABLES, (word, position, segment, gamma, beta))
        )
        name = self.node.name
        if input_ids.ndim != 2:
            raise InvalidArgument(
                f"node {name!r} (EmbedLayerNormalization): input_ids must be 2-D, got {list(input_ids.shape)}"
            )
        b, s = input_ids.shape
        h = word.shape[1]
        for what, t in (("position_embedding", position), ("segment_embedding", segment)):
            if t is not None and (t.ndim != 2 or t.shape[1] != h):
                raise InvalidArgument(
                    f"node {name!r} (EmbedLayerNormalization): {what} must be 2-D with {h} columns, got {list(t.shape)}"
                )
        for what, t in (("segment_ids", segment_ids), ("mask", mask)):
            if t is not None and t.shape != input_ids.shape:
                raise InvalidArgument(
                    f"node {name!r} (EmbedLayerNormalization): {what} must have input_ids' shape {[b, s]}, "
                    f"got {list(t.shape)}"
                )
        if (segment_ids is None) != (segment is None):
            raise InvalidArgument(
                f"node {name!r} (EmbedLayerNormalization): segment_ids and segment_embedding must be given together"
            )
        fd = _float(word.dtype)
        e = self._gather(word, input_ids, "input id").astype(fd)  # fresh: normalized in place
        if position_ids is None:
            if s > position.shape[0]:
                raise InvalidArgument(
                    f"node {name!r} (EmbedLayerNormalization): sequence length {s} exceeds position_embedding's "
                    f"{position.shape[0]} rows"
                )
            e += position[:s]
        else:
            if position_ids.shape not in ((b, s), (1, s)):
                raise InvalidArgument(
                    f"node {name!r} (EmbedLayerNormalization): position_ids must have shape {[b, s]} or {[1, s]}, "
                    f"got {list(position_ids.shape)}"
                )
            e += self._gather(position, position_ids, "position id")
        if segment_ids is not None:
            e += self._gather(segment, segment_ids, "segment id")
        total = _to(e, word.dtype).copy() if self.want_sum else None
        y, _, _ = layer_norm_f(e, gamma, beta, self.epsilon)
        mask_index = None
        if self.want_mask:
            mask_index = (np.count_nonzero(mask, axis=1) if mask is not None else np.zeros(b)).astype(np.int32)
        return (_to(y, word.dtype), mask_index, total)[: self.n_out]


@register("QEmbedLayerNormalization", domain="com.microsoft", since=1)
class QEmbedLayerNormalization(EmbedLayerNormalization):
    """EmbedLayerNormalization of 8-bit tables (``quantize_dynamic`` of an optimized BERT): each
    table dequantized as onnxruntime does, ``float32(q - zero_point) * scale``, then the float
    kernel.  Inputs: ids, segment ids, the word / position / segment tables, gamma, beta, mask,
    then their scales (8-12) and zero points (13-17) in the same order.  Nothing is packed: a
    table's float image needs its scale and zero point, so it is dequantized per call (a gather's
    worth of work next to the model's GEMMs)."""

    op_type = "QEmbedLayerNormalization"
    domain = "com.microsoft"
    _PARAMS = {2: (8, 13), 3: (9, 14), 4: (10, 15), 5: (11, 16), 6: (12, 17)}  # table -> (scale, zero point)

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        return None

    def run(self, input_ids, segment_ids=None, word=None, position=None, segment=None, gamma=None, beta=None,
            mask=None, *params):
        params = tuple(params) + (None,) * (10 - len(params))
        tables = {2: word, 3: position, 4: segment, 5: gamma, 6: beta}
        deq = {}
        for i, q in tables.items():
            if q is None:
                deq[i] = None
                continue
            scale, zp = params[self._PARAMS[i][0] - 8], params[self._PARAMS[i][1] - 8]
            if scale is None:
                raise InvalidArgument(f"node {self.node.name!r} (QEmbedLayerNormalization): input {i} needs its scale")
            z = np.int32(0) if zp is None else np.asarray(zp).astype(np.int32).reshape(())
            deq[i] = (q.astype(np.int32) - z).astype(np.float32) * np.asarray(scale, np.float32).reshape(())
        return super().run(input_ids, segment_ids, deq[2], deq[3], deq[4], deq[5], deq[6], mask)

