"""Normalizations: BatchNormalization (inference), LayerNormalization, InstanceNormalization, LRN.

All compute in float32 (float64 stays float64) and cast the result back: half-precision
statistics lose too much (a float16 sum of 4096 squares overflows), and the ONNX spec's
``stash_type`` for LayerNormalization is float32 by default.

BatchNormalization folds its four vectors into one scale and one shift per channel
(``a = scale / sqrt(var + eps)``, ``b = bias - mean * a``) so the tensor is touched by exactly
two in-place passes.  The fold costs O(C) per call, too little to be worth a packed buffer (the
pre-packing contract packs one input at a time, and the fold needs four).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, register, register_fused

_EMPTY = np.zeros(0, np.float32)

logger = logging.getLogger(__name__)

__all__ = ["BatchNormalization", "LayerNormalization", "InstanceNormalization", "LRN"]


def _stat_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _f(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return x if x.dtype == dtype else _act.astype(x, dtype)


def batch_norm_affine(scale, bias, mean, var, epsilon: float, dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(A, B)`` with ``BatchNormalization(x) = x * A + B`` for an ``x`` of ``dtype``, in the
    statistics' dtype (float64 for float64 ``x``, else float32): the kernel's own arithmetic,
    which a fused Conv epilogue repeats (``FusedConv``'s ``channels``).  onnxruntime's rounding:
    ``A = (1 / sqrt(var + epsilon)) * scale``, ``B = bias - mean * A`` (a float BatchNormalization
    between Q/DQ pairs feeds a QuantizeLinear, where one ulp can move a code)."""
    sd = _stat_dtype(np.dtype(dtype))
    a = (sd.type(1) / np.sqrt(_f(var, sd) + sd.type(epsilon))) * _f(scale, sd)
    b = _f(bias, sd) - _f(mean, sd) * a
    return a, b


def normalize_mean_variance(x: np.ndarray, axes: tuple[int, ...], normalize_variance: bool = True) -> np.ndarray:
    """onnxruntime's MeanVarianceNormalization over ``axes``: ``y = x - mean``, then ``y /
    sqrt(mean(y^2))`` (no epsilon), in float32 for float16 input."""
    xf = x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
    y = xf - xf.mean(axis=axes, keepdims=True, dtype=xf.dtype)
    if normalize_variance:
        y /= np.sqrt(np.square(y).mean(axis=axes, keepdims=True, dtype=xf.dtype))
    return y.astype(x.dtype, copy=False)


@register("MeanVarianceNormalization", since=9)
class MeanVarianceNormalization(Kernel):
    """MeanVarianceNormalization from opset 9 (ONNX's function ``(X - E[X]) / sqrt(E[(X -
    E[X])^2])`` over ``axes``, default [0, 2, 3]) as onnxruntime's kernel computes it: axes out
    of range are dropped, no epsilon."""

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.axes = [int(a) for a in self.attr("axes", [0, 2, 3])]

    def run(self, x):
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise InvalidArgument(f"node {self.node.name!r} (MeanVarianceNormalization): input must be float, "
                                  f"got {x.dtype}")
        axes = tuple(sorted({a % x.ndim for a in self.axes if -x.ndim <= a < x.ndim}))
        return (normalize_mean_variance(x, axes),)


@register("GroupNormalization", since=18)
class GroupNormalization(Kernel):
    """``(x - mean) / sqrt(var + epsilon) * scale + bias`` with the statistics of each (image,
    group of C / num_groups channels); ``scale`` / ``bias`` per group at opset 18, per channel
    from 21 (the function's bodies).  Computed in float32 (float64 for float64)."""

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.groups = int(self.attr("num_groups", 0))
        self.epsilon = float(self.attr("epsilon", 1e-5))
        self.per_channel = ctx.opset >= 21
        if self.groups < 1:
            raise InvalidArgument(f"node {node.name!r} (GroupNormalization): num_groups must be >= 1, got {self.groups}")

    def run(self, x, scale, bias):
        n, c = x.shape[:2] if x.ndim >= 2 else (0, 0)
        g = self.groups
        want = c if self.per_channel else g
        if x.ndim < 2 or c % g or np.size(scale) != want or np.size(bias) != want:
            raise InvalidArgument(f"node {self.node.name!r} (GroupNormalization): X (N, C, ...) with C a multiple of "
                                  f"num_groups {g} and scale / bias of {'C' if self.per_channel else 'num_groups'} "
                                  f"values, got X {list(x.shape)}, scale {list(np.shape(scale))}, "
                                  f"bias {list(np.shape(bias))}")
        sd = _stat_dtype(x.dtype)
        xr = _f(x, sd).reshape(n, g, -1)
        mean = xr.mean(axis=-1, keepdims=True)
        d = xr - mean
        var = np.square(d).mean(axis=-1, keepdims=True)
        d /= np.sqrt(var + sd.type(self.epsilon))
        if self.per_channel:
            y = d.reshape(x.shape) * _f(scale, sd).reshape((1, c) + (1,) * (x.ndim - 2))
            y += _f(bias, sd).reshape((1, c) + (1,) * (x.ndim - 2))
        else:
            y = d * _f(scale, sd).reshape(1, g, 1)
            y += _f(bias, sd).reshape(1, g, 1)
            y = y.reshape(x.shape)
        return (_f(y, x.dtype),)


@register("BatchNormalization", since=1)
class BatchNormalization(Kernel):
    """Batch normalization for every opset: inference mode, and the training mode of opsets 7-13.

    Opsets 1-8 carry ``spatial`` (0 means per-activation statistics: scale/bias/mean/var have
    shape (C, D1, ...)); opsets 1-6 also ``is_test``/``consumed_inputs``, ignored as onnxruntime
    ignores them (inference mode; their optional outputs are the unchanged running statistics
    and ``None``).  In opsets 7-13 the outputs choose the mode, as in onnxruntime: Y alone is
    inference; with the running and saved statistics asked for, Y is normalized by the batch's
    own mean and (biased) variance, the running mean/var outputs are
    ``momentum * input + (1 - momentum) * batch``, saved_mean the batch mean and saved_var
    ``1 / sqrt(batch var + epsilon)`` (onnxruntime's values; onnx.reference has no kernel for
    it).  Opset 14's ``training_mode=1`` is left to the fallback (``NotImplementedError`` from
    the constructor).
    """

    op_type = "BatchNormalization"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.epsilon = float(self.attr("epsilon", 1e-5))
        if int(self.attr("training_mode", 0)):
            raise NotImplementedError("BatchNormalization training_mode=1 is not implemented natively")
        outputs = len([o for o in node.output if o])
        if ctx.opset >= 14 and outputs > 1:
            raise NotImplementedError("BatchNormalization training outputs are not implemented natively")
        self.train = 7 <= ctx.opset < 14 and outputs > 1
        self.momentum = float(self.attr("momentum", 0.9))

    def run(self, x, scale, bias, mean, var):
        if self.train:
            return self._train(x, scale, bias, mean, var)
        sd = _stat_dtype(x.dtype)
        nd = x.ndim - 2
        if x.ndim >= 2:
            want = x.shape[1]
            for name, v in (("scale", scale), ("B", bias), ("input_mean", mean), ("input_var", var)):
                if v.ndim == 1 and v.shape[0] != want:  # (onnxruntime's check; numpy would broadcast some)
                    raise InvalidArgument(f"node {self.node.name!r} (BatchNormalization): {name} has "
                                          f"{v.shape[0]} values, X has {want} channels")
        a, b = batch_norm_affine(scale, bias, mean, var, self.epsilon, x.dtype)
        if a.ndim == 1:
            shape = (1, a.shape[0]) + (1,) * nd
        else:  # spatial=0: statistics per activation, shape (C, D1, ...)
            shape = (1,) + a.shape
        y = _f(x, sd) * a.reshape(shape)
        y += b.reshape(shape)
        outs = (_f(y, x.dtype), mean, var, None, None)
        return outs[: max(1, len(self.node.output))]

    def run_acts(self, acts, x, scale, bias, mean, var):
        """``run`` then the activations ``acts`` (a fused Relu or fake-quant pair:
        :class:`.elementwise.ActAfter`) in one JIT pass over the tensor (``_conv_jit.affine_act``:
        ``x * A``, ``+ B``, the activations, per channel row, split over the threads for large
        tensors): the same bits as ``run``'s ``y = x * A; y += B`` and the activations after.
        None (the caller runs ``run``) unless float32, per-channel statistics and the JIT."""
        if self.train or x.dtype != np.float32 or x.ndim < 2 or np.ndim(scale) != 1 or not x.size:
            return None
        jit = _act.jit()
        if jit is None:
            return None
        a, b = batch_norm_affine(scale, bias, mean, var, self.epsilon, x.dtype)
        if a.shape != (x.shape[1],) or b.shape != a.shape:
            return None  # run names the mismatch
        x3 = np.ascontiguousarray(x).reshape(x.shape[0], x.shape[1], -1)
        y = np.empty(x.shape, np.float32)
        y3 = y.reshape(x3.shape)
        codes, params = _act.encode(acts)
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        rows = x3.shape[0] * x3.shape[1]
        threads = _act.threads() if x.size >= _act.SPLIT_ELEMENTS else 1
        _act.tuner(("affine_act", x3.shape, codes.shape[0])).run(
            lambda r0, r1: jit.affine_act(x3, a, b, codes, params, y3, r0, r1), rows, threads)
        return (y,)

    def _train(self, x, scale, bias, mean, var):
        """Opsets 7-13 with the statistics outputs: the batch's own statistics (see the class)."""
        sd = _stat_dtype(x.dtype)
        xs = _f(x, sd)
        per_channel = np.ndim(scale) == 1  # spatial (the default); else per activation (C, D1, ...)
        axes = (0, *range(2, x.ndim)) if per_channel else (0,)
        shape = (1, xs.shape[1]) + (1,) * (x.ndim - 2) if per_channel else (1,) + xs.shape[1:]
        with np.errstate(all="ignore"):  # an empty batch's statistics are NaN, as numpy's
            bm = xs.mean(axis=axes)
            bv = xs.var(axis=axes)
            inv = 1 / np.sqrt(bv + sd.type(self.epsilon))
            y = (xs - bm.reshape(shape)) * (inv * _f(scale, sd)).reshape(shape) + _f(bias, sd).reshape(shape)
            mom = sd.type(self.momentum)
            run_mean = _f(mean, sd) * mom + bm * (1 - mom)
            run_var = _f(var, sd) * mom + bv * (1 - mom)
        st = mean.dtype
        outs = (_f(y, x.dtype), _f(run_mean, st), _f(run_var, st), _f(bm, st), _f(inv, st))
        return outs[: len(self.node.output)]


_F32_STASH = np.dtype(np.float32)


@register("LayerNormalization", since=17)
class LayerNormalization(Kernel):
    """Normalization over the axes from ``axis`` on; optional Mean and InvStdDev outputs.

    Statistics are computed in float32 (``stash_type=1``, the only value onnxruntime supports);
    Mean and InvStdDev are returned in that stash type as the spec's type constraint U says
    (onnxruntime does the same).

    Input dtypes.  From opset 17 (ONNX's LayerNormalization) X, Scale, B and Y share one type;
    onnxruntime refuses a model that mixes them, and so do we (``InvalidArgument`` at the first
    run, naming the dtypes).  Below opset 17 ONNX has no LayerNormalization: what runs is
    onnxruntime's own op of that name in the default domain (its type constraints are X: T,
    Scale/B: V, Y: V), which exporters and fp16 converters rely on — e.g. fp16 X with fp32
    Scale/B gives a float32 Y, float32 X with fp16 Scale/B a float16 Y.  We run it the same way:
    statistics and the affine step in float32 (float64 for float64 X), Y in Scale's dtype.
    """

    op_type = "LayerNormalization"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", -1))
        self.epsilon = float(self.attr("epsilon", 1e-5))
        self.mixed = ctx.opset < 17  # onnxruntime's contrib typing: Y has Scale's dtype
        if int(self.attr("stash_type", 1)) != 1:
            raise NotImplementedError("LayerNormalization stash_type != 1 is not implemented natively")

    def run(self, x, scale, bias=None):
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        if not 0 <= axis < max(x.ndim, 1):
            raise InvalidArgument(
                f"node {self.node.name!r} (LayerNormalization): axis {self.axis} out of range for rank {x.ndim}"
            )
        if bias is not None and bias.dtype != scale.dtype:
            raise InvalidArgument(
                f"node {self.node.name!r} (LayerNormalization): B is {bias.dtype}, expected Scale's {scale.dtype}")
        if not self.mixed and scale.dtype != x.dtype:
            raise InvalidArgument(
                f"node {self.node.name!r} (LayerNormalization): X is {x.dtype} but Scale is {scale.dtype}; "
                f"opset {self.ctx.opset} requires one type for X, Scale, B and Y (onnxruntime's mixed-type "
                "LayerNormalization exists only below opset 17)")
        fast = self._jit(x, scale, bias, axis)
        if fast is not None:
            return fast
        sd = _stat_dtype(x.dtype)
        xs = _f(x, sd)
        axes = tuple(range(axis, x.ndim))
        mean = xs.mean(axis=axes, keepdims=True)
        d = xs - mean
        inner = int(np.prod(x.shape[axis:]))
        flat = d.reshape(*d.shape[:axis], inner)  # (not -1: a batch of 0 rows leaves that ambiguous)
        var = np.einsum("...i,...i->...", flat, flat)
        var = var.reshape(mean.shape) / max(1, inner)
        inv = 1.0 / np.sqrt(var + sd.type(self.epsilon))
        d *= inv
        d *= _f(scale, sd)
        if bias is not None:
            d += _f(bias, sd)
        # Mean and InvStdDev in the stash type (float32: U) whatever X's dtype (float64 too),
        # as onnxruntime returns them.
        return (_f(d, scale.dtype), _f(mean, _F32_STASH), _f(inv, _F32_STASH))[: max(1, len(self.node.output))]


    def _jit(self, x, scale, bias, axis):
        """The JIT kernel for float32 normalized over the last axis with (D,) scale and bias
        (transformers' case), or None."""
        if x.dtype != np.float32 or axis != x.ndim - 1 or x.size == 0 or x.shape[-1] == 0:
            return None
        d = x.shape[-1]
        if scale.dtype != np.float32 or scale.size != d or (bias is not None and (bias.dtype != np.float32 or bias.size != d)):
            return None
        got = layer_norm_rows(np.ascontiguousarray(x).reshape(-1, d), scale, bias, self.epsilon)
        if got is None:
            return None
        y, mean, inv = got
        shape = x.shape[:-1] + (1,)
        return (y.reshape(x.shape), mean.reshape(shape), inv.reshape(shape))[: max(1, len(self.node.output))]


@register_fused("layernorm_chain")
class LayerNormChain(LayerNormalization):
    """A LayerNormalization over the last axis that the model writes out in elementwise ops
    (``_fusion.find_layernorm_chains``: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul,
    Add): the kernel above when the scale's length is the last axis', else the chain's own
    broadcasting arithmetic in numpy (a chain the fusion cannot tell at compile is one, such as
    a last axis of 1 broadcast against the scale, computes what the nodes compute)."""

    def __init__(self, node, ctx) -> None:
        # (epsilon: the fused node's attribute, as the base reads it)
        super().__init__(node, dataclasses.replace(ctx, opset=max(17, ctx.opset)))

    def run(self, x, scale, bias):
        if x.dtype == np.float32 and x.ndim >= 1 and x.shape[-1] == scale.shape[0] and x.size:
            d = x.shape[-1]
            if (x.size < _act.SPLIT_ELEMENTS and x.flags.c_contiguous and scale.dtype == bias.dtype == np.float32
                    and scale.shape == bias.shape == (d,)):
                jit = _act.jit()
                if jit is not None:
                    # A small one (a wake-word head's 128 values): the JIT's rows alone, none of
                    # the general path's checks and reshapes (~8 -> ~4 us a call).
                    rows = x.size // d
                    y = np.empty(x.shape, np.float32)
                    stats = np.empty(2 * rows, np.float32)
                    jit.layer_norm_rows(x.reshape(rows, d), scale, bias, np.float32(self.epsilon), y.reshape(rows, d),
                                        stats[:rows], stats[rows:], 0, rows)
                    return (y,)
            return super().run(x, scale, bias)[:1]
        with _act.quiet():
            mean = np.mean(x, axis=-1, keepdims=True, dtype=x.dtype)
            d = x - mean
            std = np.sqrt(np.mean(d * d, axis=-1, keepdims=True, dtype=x.dtype) + x.dtype.type(self.epsilon))
            return (np.asarray(d / std * scale + bias),)


def layer_norm_rows(x2: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, eps: float) -> tuple | None:
    """LayerNorm over the last axis of a C-contiguous float32 ``x2`` (R, D) by the JIT's
    ``layer_norm_rows`` (split over onnxpack's threads when large and it pays): ``(y (R, D),
    mean (R,), inv_std (R,))``, float32; None without the JIT.  ``scale`` / ``bias`` (None: no
    bias) hold D float32 values."""
    jit = _act.jit()
    if jit is None:
        return None
    rows, d = x2.shape
    y = np.empty_like(x2)
    mean = np.empty(rows, np.float32)
    inv = np.empty(rows, np.float32)
    b = _EMPTY if bias is None else np.ascontiguousarray(bias).reshape(d)
    s = np.ascontiguousarray(scale).reshape(d)
    e = np.float32(eps)
    if x2.size < _act.SPLIT_ELEMENTS or rows < 2:  # one thread: the call alone (no tuner, no closure)
        jit.layer_norm_rows(x2, s, b, e, y, mean, inv, 0, rows)
        return y, mean, inv
    _act.tuner(("layer_norm_rows", x2.shape)).run(lambda a, c: jit.layer_norm_rows(x2, s, b, e, y, mean, inv, a, c),
                                                  rows, _act.threads())
    return y, mean, inv


@register("InstanceNormalization", since=1)
class InstanceNormalization(Kernel):
    """Per (image, channel) normalization over the spatial axes."""

    op_type = "InstanceNormalization"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.epsilon = float(self.attr("epsilon", 1e-5))

    def run(self, x, scale, bias):
        sd = _stat_dtype(x.dtype)
        xs = _f(x, sd)
        axes = tuple(range(2, x.ndim))
        mean = xs.mean(axis=axes, keepdims=True)
        d = xs - mean
        var = (d * d).mean(axis=axes, keepdims=True)
        shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        d *= _f(scale, sd).reshape(shape) / np.sqrt(var + sd.type(self.epsilon))
        d += _f(bias, sd).reshape(shape)
        return (_f(d, x.dtype),)


@register("LRN", since=1)
class LRN(Kernel):
    """Local response normalization across channels, windowed sums via one cumulative sum.

    The window of channel c is [c - floor((size-1)/2), c + ceil((size-1)/2)] (spec).  Note that
    onnx.reference (1.23) sums the window for only the first N channels (it loops over the batch
    axis); tests use onnxruntime as the oracle.
    """

    op_type = "LRN"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1e-4))
        self.beta = float(self.attr("beta", 0.75))
        self.bias = float(self.attr("bias", 1.0))
        size = self.attr("size")
        if size is None or int(size) < 1:
            raise InvalidArgument(f"node {node.name!r} (LRN): attribute size must be a positive integer, got {size!r}")
        self.size = int(size)

    def run(self, x):
        sd = _stat_dtype(x.dtype)
        xs = _f(x, sd)
        c = x.shape[1]
        lo = (self.size - 1) // 2
        hi = -(-(self.size - 1) // 2)
        csum = np.zeros((x.shape[0], c + 1) + x.shape[2:], dtype=sd)
        np.cumsum(xs * xs, axis=1, out=csum[:, 1:])
        idx = np.arange(c)
        start = np.clip(idx - lo, 0, c)
        stop = np.clip(idx + hi + 1, 0, c)
        square_sum = csum[:, stop] - csum[:, start]
        y = xs / (sd.type(self.bias) + sd.type(self.alpha / self.size) * square_sum) ** sd.type(self.beta)
        return (_f(y, x.dtype),)


@register("LpNormalization", since=1)
class LpNormalization(Kernel):
    """``x / ||x||_p`` along ``axis`` (p 1 or 2), in float32 (float64 stays float64); a slice
    whose norm is zero gives zeros, as onnxruntime's kernel (onnx.reference divides: NaN).
    The builder's Qwen3.5 L2-normalizes its linear attention's queries and keys with it."""

    op_type = "LpNormalization"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", -1))
        self.p = int(self.attr("p", 2))
        if self.p not in (1, 2):
            raise InvalidArgument(f"node {node.name!r} (LpNormalization): p must be 1 or 2, got {self.p}")

    def run(self, x):
        if x.dtype.kind != "f":
            raise InvalidArgument(f"node {self.node.name!r} (LpNormalization): X must be a float tensor, got {x.dtype}")
        if not -x.ndim <= self.axis < x.ndim:
            raise InvalidArgument(f"node {self.node.name!r} (LpNormalization): axis {self.axis} is out of range "
                                  f"for a rank-{x.ndim} input")
        sd = _stat_dtype(x.dtype)
        xs = _f(x, sd)
        if self.p == 2:
            norm = np.sqrt(np.einsum("...i,...i->...", np.moveaxis(xs, self.axis, -1), np.moveaxis(xs, self.axis, -1)))
        else:
            norm = np.abs(xs).sum(axis=self.axis)
        norm = np.expand_dims(norm, self.axis)
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(norm == 0, sd.type(0), xs / norm)
        return (_f(y, x.dtype),)
