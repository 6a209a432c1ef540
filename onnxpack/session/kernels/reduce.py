"""Reductions (Reduce*), Softmax, LogSoftmax and Hardmax, with each opset's rule.

Two generations of Reduce*: ``axes`` as an attribute (ReduceSum before opset 13, the others
before 18) and ``axes`` as an optional input with ``noop_with_empty_axes`` (from then on).  Each
generation is its own registered class, so ``run`` never tests the opset.

Softmax-family ops changed meaning at opset 13: before, the input is coerced to 2-D at ``axis``
(default 1) and normalized over the whole trailing block; from 13, one ``axis`` (default -1).

float16 inputs of LogSoftmax and ReduceMean/ReduceLogSumExp are computed in float32 and rounded
once at the end, as onnxruntime does, so they are at least as accurate as onnx.reference.
float16 Softmax is the exception: it rounds every step to float16 exactly as onnx.reference
does, because the float16 conformance data (Attention's function body) was produced that way
and a once-rounded result misses it by more than the suite's tolerance.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, KernelContext, register

logger = logging.getLogger(__name__)

__all__: list[str] = []  # kernels are reached through the registry only



def _same(y, like: np.ndarray) -> np.ndarray:
    y = np.asarray(y)
    return y if y.dtype == like.dtype else _act.astype(y, like.dtype)


def _reduced_is_empty(x: np.ndarray, axes: tuple[int, ...] | None) -> bool:
    if x.size:
        return False
    if axes is None:
        return True
    return any(x.shape[a] == 0 for a in axes)


def _extreme(dtype: np.dtype, largest: bool):
    if dtype == np.bool_:
        return largest
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if largest else info.min
    return np.inf if largest else -np.inf


# --- the reductions themselves: f(x, axes, keepdims) -> array of x's dtype --------------------
def _sum(x, axes, keepdims):
    return np.sum(x, axis=axes, keepdims=keepdims)


def _mean(x, axes, keepdims):
    if _reduced_is_empty(x, axes):  # the mean of nothing: 0, as onnxruntime gives it (the spec is silent)
        return np.zeros(np.sum(x, axis=axes, keepdims=keepdims).shape, dtype=x.dtype)
    if x.dtype == np.float16:
        return np.mean(x, axis=axes, keepdims=keepdims, dtype=np.float32)
    if x.dtype.kind == "f" and x.size:
        # np.mean's own steps (the sum in x's dtype, then one division by the count) without its
        # Python layers: ~3 us instead of ~12, bit for bit the same (Silero VAD's (1, 1) mean).
        count = x.size if axes is None else math.prod(x.shape[a] for a in axes)
        if count:
            with np.errstate(all="ignore"):  # an overflowing sum is inf, quietly, as below
                return np.true_divide(np.add.reduce(x, axis=axes, dtype=x.dtype, keepdims=keepdims), count)
    with np.errstate(all="ignore"):
        return np.mean(x, axis=axes, keepdims=keepdims, dtype=x.dtype if x.dtype.kind == "f" else None)


def _max(x, axes, keepdims):
    if _reduced_is_empty(x, axes):
        return np.max(x, axis=axes, keepdims=keepdims, initial=_extreme(x.dtype, False))
    return np.max(x, axis=axes, keepdims=keepdims)


def _min(x, axes, keepdims):
    if _reduced_is_empty(x, axes):
        return np.min(x, axis=axes, keepdims=keepdims, initial=_extreme(x.dtype, True))
    return np.min(x, axis=axes, keepdims=keepdims)


def _prod(x, axes, keepdims):
    return np.prod(x, axis=axes, keepdims=keepdims)


def _l1(x, axes, keepdims):
    return np.sum(np.abs(x), axis=axes, keepdims=keepdims)


def _l2(x, axes, keepdims):
    # float16 squares and sums in float32, rounded once (onnxruntime's; in float16 a square
    # overflows from 256 and a sum of small ones underflows to 0)
    xf = x.astype(np.float32) if x.dtype == np.float16 else x
    return np.sqrt(np.sum(np.square(xf), axis=axes, keepdims=keepdims))


def _sum_square(x, axes, keepdims):
    return np.sum(np.square(x), axis=axes, keepdims=keepdims)


def _log_sum(x, axes, keepdims):
    with np.errstate(divide="ignore"):
        return np.log(np.sum(x, axis=axes, keepdims=keepdims))


def _log_sum_exp(x, axes, keepdims):
    xf = x.astype(np.float32) if x.dtype == np.float16 else x
    if _reduced_is_empty(x, axes):
        return np.full(np.sum(x, axis=axes, keepdims=keepdims).shape, -np.inf, dtype=x.dtype)
    m = np.max(xf, axis=axes, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)  # an all -inf (or inf) slice must not give inf - inf
    e = np.exp(xf - m)
    with np.errstate(divide="ignore"):
        s = np.log(np.sum(e, axis=axes, keepdims=True)) + m
    if not keepdims:
        s = np.squeeze(s, axis=axes)
    return s


def _unit_reduction(fn: Callable, shape: tuple[int, ...], dtype: np.dtype, axes, keepdims: bool):
    """The fixed form (``Kernel.fixed``) of a reduction over axes of one element in all (Silero
    VAD's ReduceMean of a (1, 1) score: ~3.7 us in its run, ~0.6 this way): the input reshaped,
    copied; for a float sum or mean plus 0, as numpy's reduction adds its identity (-0.0 becomes
    0.0; a mean then divides by 1, exactly).  An integer mean goes through float64 and back
    (rounding above 2^53), so it keeps ``run``, as do the other reductions and an empty input."""
    dtype = np.dtype(dtype)
    if not ((fn in (_sum, _max, _min, _prod) and dtype.kind in "iuf") or (fn is _mean and dtype.kind == "f")):
        return None
    rank = len(shape)
    ax = list(range(rank)) if axes is None else [a + rank if a < 0 else a for a in axes]
    if (any(not 0 <= a < rank for a in ax) or len(set(ax)) != len(ax) or math.prod(shape) == 0
            or math.prod(shape[a] for a in ax) != 1):
        return None
    out = tuple(1 if d in ax else n for d, n in enumerate(shape)) if keepdims else tuple(
        n for d, n in enumerate(shape) if d not in ax)

    if fn in (_sum, _mean) and dtype.kind == "f":
        zero = dtype.type(0)

        def one_sum(x: np.ndarray) -> np.ndarray:
            return x.reshape(out) + zero

        return one_sum

    def one(x: np.ndarray) -> np.ndarray:
        return x.reshape(out).copy()

    return one


class _ReduceAttr(Kernel):
    """Reduce* with ``axes`` as an attribute: no axes means every axis."""

    _fn: ClassVar[Callable]

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        axes = self.attr("axes")
        self.axes = tuple(int(a) for a in axes) if axes else None
        self.keepdims = bool(self.attr("keepdims", 1))

    def run(self, x):  # type: ignore[override]
        return (_same(type(self)._fn(x, self.axes, self.keepdims), x),)

    def fixed(self, shape, dtype, constants):
        return _unit_reduction(type(self)._fn, shape, dtype, self.axes, self.keepdims)


class _ReduceInput(Kernel):
    """Reduce* with ``axes`` as an optional input; empty axes reduce all, or nothing when
    ``noop_with_empty_axes`` is set."""

    _fn: ClassVar[Callable]

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.keepdims = bool(self.attr("keepdims", 1))
        self.noop = bool(self.attr("noop_with_empty_axes", 0))

    def run(self, x, axes=None):  # type: ignore[override]
        if axes is None or axes.size == 0:
            # With noop_with_empty_axes, a reduction over no axis: each element alone, so the
            # elementwise part still applies (ReduceL1 |x|, ReduceSumSquare x^2, ReduceLogSum
            # log x), as onnxruntime and onnx.reference compute it; the input itself was returned.
            ax = () if self.noop else None
        else:
            ax = tuple(int(a) for a in axes.reshape(-1).tolist())
        return (_same(type(self)._fn(x, ax, self.keepdims), x),)

    def fixed(self, shape, dtype, constants):
        axes = constants[0] if constants else None
        if axes is None or axes.size == 0:
            return None  # (all axes, or nothing with noop_with_empty_axes: run decides)
        return _unit_reduction(type(self)._fn, shape, dtype, tuple(int(a) for a in axes.reshape(-1).tolist()),
                               self.keepdims)


_REDUCE: tuple[tuple[str, int, Callable], ...] = (
    # op_type, opset where axes became an input, reduction
    ("ReduceSum", 13, _sum),
    ("ReduceMean", 18, _mean),
    ("ReduceMax", 18, _max),
    ("ReduceMin", 18, _min),
    ("ReduceProd", 18, _prod),
    ("ReduceL1", 18, _l1),
    ("ReduceL2", 18, _l2),
    ("ReduceSumSquare", 18, _sum_square),
    ("ReduceLogSum", 18, _log_sum),
    ("ReduceLogSumExp", 18, _log_sum_exp),
)

def _define(op: str, base: type, since: int, fn) -> None:
    """Register ``base`` specialised with the numpy function ``fn`` as ONNX ``op`` from ``since``."""
    cls = type(
        f"{op}_{since}",
        (base,),
        {
            "_fn": staticmethod(fn),
            "op_type": op,
            "since": since,
            "__doc__": f"ONNX {op} from opset {since} ({base.__doc__.splitlines()[0]})",
            "__module__": __name__,
        },
    )
    register(op, since=since)(cls)


for _op, _since_input, _fn in _REDUCE:
    _define(_op, _ReduceAttr, 1, _fn)
    _define(_op, _ReduceInput, _since_input, _fn)
del _op, _since_input, _fn


# ------------------------------------------------------------------------------------------------
# Softmax family
# ------------------------------------------------------------------------------------------------
def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax in x's own dtype, float16 included.

    float16 is *not* widened: onnx.reference and the conformance data (e.g. the float16
    Attention function bodies) round every step -- x - max, exp, the sum, the division -- to
    float16, and a float32 computation rounded once differs from them by up to 1.2e-3 relative,
    beyond the suite's 1e-3.  Every step here is one correctly rounded numpy operation, so the
    result matches onnx.reference's bit for bit.
    """
    if x.size == 0:
        return x.copy()
    fast = _softmax_jit(x, axis, None)
    if fast is not None:
        return fast
    # float16 -65504 - max: -inf, whose exp is the 0 it stands for; a row of -inf: NaN, silently
    # (onnxruntime warns of nothing)
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.asarray(x - np.max(x, axis=axis, keepdims=True))
    np.exp(y, out=y)
    y /= np.sum(y, axis=axis, keepdims=True)
    return _same(y, x)


def _softmax_jit(x: np.ndarray, axis: int, out: np.ndarray | None) -> np.ndarray | None:
    """float32 softmax over the last axis by the JIT's ``softmax_rows`` (into ``out`` when
    given, C-contiguous); None when it does not apply (other dtypes or axes, no numba)."""
    if x.dtype != np.float32 or x.ndim == 0 or x.size == 0 or axis not in (-1, x.ndim - 1):
        return None
    if out is not None and (out.dtype != np.float32 or out.shape != x.shape or not out.flags.c_contiguous):
        return None
    jit = _act.jit()
    if jit is None:
        return None
    d = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, d)
    y = np.empty(x.shape, np.float32) if out is None else out
    y2 = y.reshape(x2.shape)
    rows = x2.shape[0]
    threads = _act.threads() if x2.size >= _act.SPLIT_ELEMENTS else 1
    _act.tuner(("softmax_rows", x2.shape)).run(lambda a, b: jit.softmax_rows(x2, y2, a, b), rows, threads)
    return y


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    xf = x.astype(np.float32) if x.dtype == np.float16 else x
    if xf.size == 0:
        return x.copy()
    y = xf - np.max(xf, axis=axis, keepdims=True)
    y -= np.log(np.sum(np.exp(y), axis=axis, keepdims=True))
    return _same(y, x)


def _hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    y = np.zeros_like(x)
    if x.size == 0:
        return y
    idx = np.expand_dims(np.argmax(x, axis=axis), axis)  # first maximum wins, as the spec says
    np.put_along_axis(y, idx, 1, axis=axis)
    return y


class _SoftmaxAxis(Kernel):
    """Opset >= 13: normalize along one axis (default -1)."""

    _fn: ClassVar[Callable[[np.ndarray, int], np.ndarray]]

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", -1))

    def run(self, x):  # type: ignore[override]
        return (type(self)._fn(x, self.axis),)

    def run_into(self, outs, x) -> bool:
        """Softmax written into ``outs[0]`` (the memory planner's arena): ``_softmax``'s exact
        steps with ``out=``; the other ops of the family decline with ``False``."""
        if type(self)._fn is not _softmax or x.size == 0 or x.ndim == 0:
            return False
        y = outs[0]
        if _softmax_jit(x, self.axis, y) is not None:
            return True
        np.subtract(x, np.max(x, axis=self.axis, keepdims=True), out=y)
        np.exp(y, out=y)
        y /= np.sum(y, axis=self.axis, keepdims=True)
        return True


class _Softmax2D(Kernel):
    """Opset < 13: coerce to 2-D at ``axis`` (default 1), normalize each row, restore the shape."""

    _fn: ClassVar[Callable[[np.ndarray, int], np.ndarray]]

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 1))

    def run(self, x):  # type: ignore[override]
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        if axis == x.ndim - 1 and x.ndim > 0:
            return (type(self)._fn(x, -1),)  # the 2-D rule is the last-axis rule: no reshape
        rows = int(np.prod(x.shape[:axis], dtype=np.int64))
        flat = x.reshape(rows, -1) if x.size else x.reshape(rows, int(np.prod(x.shape[axis:])))
        return (type(self)._fn(flat, 1).reshape(x.shape),)


for _op, _fn in (("Softmax", _softmax), ("LogSoftmax", _log_softmax), ("Hardmax", _hardmax)):
    _define(_op, _Softmax2D, 1, _fn)
    _define(_op, _SoftmaxAxis, 13, _fn)
del _op, _fn
