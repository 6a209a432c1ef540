"""Tensor-manipulation kernels: shapes, views, indexing, padding, resizing, constants.

Kernels that numpy can express as views (Reshape, Squeeze, Unsqueeze, Flatten, Transpose,
Slice, Split, Expand, Identity-like paths) return views of their input: the executor never
mutates a value it handed to a kernel, so copying would only cost time and memory.  Views may be
read-only or non-contiguous (Expand returns a zero-stride broadcast view).

Where an opset moved an attribute to an input (Split/Squeeze/Unsqueeze at 13, Slice at 10, Pad
at 11, Reshape at 5, TopK at 10) each generation is its own registered class.  Attribute
combinations these kernels do not implement raise ``NotImplementedError`` from ``__init__``; the
session then runs that node with onnx.reference instead.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.graph import shape_fits, sparse_to_dense
from onnxpack.graph._tensor import to_array
from onnxpack.session.kernels._base import Kernel, KernelContext, register

logger = logging.getLogger(__name__)

__all__: list[str] = []  # kernels are reached through the registry only



_I64 = np.dtype(np.int64)


def _ints(x: np.ndarray | None) -> list[int] | None:
    """A 0-d or 1-d integer tensor input as Python ints (``None`` stays ``None``)."""
    if x is None:
        return None
    if x.__class__ is np.ndarray and x.dtype.kind in "iu" and x.ndim <= 1:
        v = x.tolist()  # Python ints already (~0.3 us; the generic way below ~2 us)
        return v if v.__class__ is list else [v]
    return [int(v) for v in np.asarray(x).reshape(-1).tolist()]


def _scalar(x: np.ndarray, op_type: str, name: str) -> np.generic:
    """The one element of a scalar input given as a 0-d or 1-element tensor (a numpy scalar)."""
    x = np.asarray(x)
    if x.size != 1:
        raise ValueError(f"{op_type} input {name!r} must hold one element, got shape {x.shape}")
    return x.reshape(())[()]


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _data_axis(axis: int, rank: int, what: str) -> int:
    """``axis`` of an input of ``rank`` in ``[0, rank)``; one outside ``[-rank, rank)`` is refused
    (numpy wraps some silently: ArgMax's -5 on rank 4 reduced axis 3), as onnxruntime refuses it."""
    if not -rank <= axis < rank:
        raise InvalidArgument(f"{what}: axis {axis} is out of range for an input of rank {rank} "
                              f"(valid: {-rank} to {rank - 1})")
    return axis + rank if axis < 0 else axis


# ------------------------------------------------------------------------------------------------
# shape-only ops (views)
# ------------------------------------------------------------------------------------------------
def _reshape(x: np.ndarray, shape: list[int], allowzero: bool) -> np.ndarray:
    if not allowzero:
        # A 0 copies the input's dimension at the same position.
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


@register("Reshape", since=1)
class Reshape1(Kernel):
    """Reshape-1: the target shape is the ``shape`` attribute."""

    reshapes_input = True

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.shape = [int(d) for d in self.attr("shape", [])]

    def run(self, x):  # type: ignore[override]
        return (_reshape(x, self.shape, False),)


@register("Reshape", since=5)
class Reshape5(Kernel):
    """Reshape from opset 5: the shape is an input; ``allowzero`` (opset 14) keeps 0 literal."""

    reshapes_input = True

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.allowzero = bool(self.attr("allowzero", 0))

    def run(self, x, shape):  # type: ignore[override]
        return (_reshape(x, _ints(shape), self.allowzero),)


@register("Transpose", since=1)
class Transpose(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        perm = self.attr("perm")
        self.perm = tuple(int(p) for p in perm) if perm else None

    def run(self, x):  # type: ignore[override]
        return (np.transpose(x, self.perm),)


@register("Flatten", since=1)
class Flatten(Kernel):
    reshapes_input = True

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 1))

    def run(self, x):  # type: ignore[override]
        axis = _norm_axis(self.axis, x.ndim)
        outer = math.prod(x.shape[:axis])
        return (x.reshape(outer, math.prod(x.shape[axis:])),)


def _squeeze(x: np.ndarray, axes: list[int] | None) -> np.ndarray:
    if not axes:
        return np.squeeze(x)
    return np.squeeze(x, axis=tuple(axes))


def _unsqueeze(x: np.ndarray, axes: list[int]) -> np.ndarray:
    """``np.expand_dims(x, axes)`` (negative axes count from the output's rank) as one reshape
    when the axes are plain (~0.5 us instead of ~5 us).  One axis (nearly every Unsqueeze)
    skips the general checks' sorting and sets: ~1.4 us instead of ~3.8 (Silero VAD runs eight
    a step)."""
    if len(axes) == 1 and x.__class__ is np.ndarray:
        a = axes[0]
        if a < 0:
            a += x.ndim + 1
        if 0 <= a <= x.ndim:
            s = x.shape
            return x.reshape(s[:a] + (1,) + s[a:])
    rank = x.ndim + len(axes)
    norm = sorted(a + rank if a < 0 else a for a in axes)
    if x.__class__ is not np.ndarray or len(set(norm)) != len(norm) or not all(0 <= a < rank for a in norm):
        return np.expand_dims(x, tuple(axes))  # numpy's errors for bad axes
    shape = list(x.shape)
    for a in norm:
        shape.insert(a, 1)
    return x.reshape(shape)


@register("Squeeze", since=1)
class Squeeze1(Kernel):
    reshapes_input = True

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        axes = self.attr("axes")
        self.axes = [int(a) for a in axes] if axes else None

    def run(self, x):  # type: ignore[override]
        return (_squeeze(x, self.axes),)


@register("Squeeze", since=13)
class Squeeze13(Kernel):
    reshapes_input = True

    def run(self, x, axes=None):  # type: ignore[override]
        return (_squeeze(x, _ints(axes)),)


@register("Unsqueeze", since=1)
class Unsqueeze1(Kernel):
    reshapes_input = True

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axes = [int(a) for a in self.attr("axes", [])]

    def run(self, x):  # type: ignore[override]
        return (_unsqueeze(x, self.axes),)


@register("Unsqueeze", since=13)
class Unsqueeze13(Kernel):
    reshapes_input = True

    def run(self, x, axes):  # type: ignore[override]
        return (_unsqueeze(x, _ints(axes)),)


@register("Shape", since=1)
class Shape(Kernel):
    """The shape as int64; ``start``/``end`` (opset 15) clamp like Python slices."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.start = int(self.attr("start", 0))
        end = self.attr("end")
        self.end = None if end is None else int(end)

    def run(self, x):  # type: ignore[override]
        return (np.array(x.shape[self.start : self.end], dtype=np.int64),)


@register("Size", since=1)
class Size(Kernel):
    def run(self, x):  # type: ignore[override]
        return (np.array(x.size, dtype=np.int64),)


@register("Expand", since=8)
class Expand(Kernel):
    """Bidirectional broadcast of x to ``shape``; returns a read-only broadcast view."""

    def run(self, x, shape):  # type: ignore[override]
        target = np.broadcast_shapes(x.shape, tuple(_ints(shape)))
        if target == x.shape:
            return (x,)
        return (np.broadcast_to(x, target),)


@register("Tile", since=6)
class Tile(Kernel):
    def run(self, x, repeats):  # type: ignore[override]
        return (np.tile(x, _ints(repeats)),)


# ------------------------------------------------------------------------------------------------
# Concat / Split / Slice
# ------------------------------------------------------------------------------------------------
@register("Concat", since=1)
class Concat(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 1))  # opset 1 defaulted to 1; later it is required

    def run(self, *xs):  # type: ignore[override]
        xs = [x for x in xs if x is not None]
        if len(xs) == 1:
            return (xs[0],)
        return (np.concatenate(xs, axis=self.axis),)


def _split(x: np.ndarray, axis: int, sizes: list[int] | None, n_out: int, num_outputs: int | None):
    axis = _norm_axis(axis, x.ndim)
    dim = x.shape[axis]
    if sizes is None:
        if num_outputs is not None:
            # Opset 18: chunks of ceil(dim / n); the last one takes what is left.
            chunk = -(-dim // num_outputs)
            sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(num_outputs)]
        else:
            sizes = [dim // n_out] * n_out
    elif len(sizes) != n_out or min(sizes) < 0 or sum(sizes) != dim:
        raise InvalidArgument(f"Split: sizes {sizes} must be {n_out} non-negative lengths adding up to "
                              f"the axis' {dim}")
    index: list[slice] = [slice(None)] * x.ndim
    out = []
    start = 0
    for size in sizes:  # (running sums in Python: np.cumsum's Python layers cost more than the views)
        stop = start + size
        index[axis] = slice(start, stop)
        out.append(x[tuple(index)])
        start = stop
    return tuple(out)


@register("Split", since=1)
class Split1(Kernel):
    """Split before opset 13: ``split`` is an attribute (opset 1 also accepted a 2nd input)."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 0))
        split = self.attr("split")
        self.split = [int(s) for s in split] if split else None
        self.n_out = len(node.output)

    def run(self, x, split=None):  # type: ignore[override]
        sizes = self.split if self.split is not None else _ints(split)
        return _split(x, self.axis, sizes or None, self.n_out, None)


@register("Split", since=13)
class Split13(Kernel):
    """Split from opset 13: ``split`` is an optional input; opset 18 adds ``num_outputs``."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 0))
        n = self.attr("num_outputs")
        self.num_outputs = None if n is None else int(n)
        self.n_out = len(node.output)
        if self.num_outputs is not None and self.num_outputs != self.n_out:
            # (as onnxruntime; and a num_outputs of 2**63 - 1 would otherwise be a loop that long)
            raise InvalidArgument(f"node {node.name!r} (Split): num_outputs is {self.num_outputs}, the node has "
                                  f"{self.n_out} outputs")

    def run(self, x, split=None):  # type: ignore[override]
        sizes = _ints(split)
        return _split(x, self.axis, sizes or None, self.n_out, self.num_outputs)


def _slice(x: np.ndarray, starts, ends, axes, steps) -> np.ndarray:
    return x[_slice_index(x.shape, starts, ends, axes, steps)]


def _slice_index(shape: tuple[int, ...], starts, ends, axes, steps) -> tuple[slice, ...]:
    """The numpy index of ONNX Slice's ``starts``/``ends``/``axes``/``steps`` on ``shape``."""
    if axes is None:
        axes = list(range(len(starts)))
    if steps is None:
        steps = [1] * len(starts)
    index: list[slice] = [slice(None)] * len(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _norm_axis(axis, len(shape))
        dim = shape[axis]
        if start < 0:
            start += dim
        if end < 0:
            end += dim
        if step > 0:
            start = min(max(start, 0), dim)
            end = min(max(end, 0), dim)
            index[axis] = slice(start, end, step)
        else:
            # Negative steps clamp start to [0, dim-1] and end to [-1, dim-1], where -1 means
            # "past the first element" -- which a Python slice spells as None.
            start = min(max(start, 0), dim - 1)
            end = min(max(end, -1), dim - 1)
            index[axis] = slice(start, end if end >= 0 else None, step)
    return tuple(index)


@register("Slice", since=1)
class Slice1(Kernel):
    """Slice before opset 10: starts/ends/axes are attributes, steps are 1."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.starts = [int(v) for v in self.attr("starts", [])]
        self.ends = [int(v) for v in self.attr("ends", [])]
        axes = self.attr("axes")
        self.axes = [int(v) for v in axes] if axes else None

    def run(self, x):  # type: ignore[override]
        return (_slice(x, self.starts, self.ends, self.axes, None),)


@register("Slice", since=10)
class Slice10(Kernel):
    """Slice from opset 10: starts, ends, axes and steps are inputs (negative steps allowed)."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        # (input shape, each index input's bytes) -> numpy index: the indices are constants of the
        # model nearly always, and turning them into slices cost more than the slicing (Silero
        # VAD's STFT: five Slices a run, ~5 us each of Python, ~1 us with this).
        self._index: dict[tuple, tuple[slice, ...]] = {}

    def run(self, x, starts, ends, axes=None, steps=None):  # type: ignore[override]
        if (starts.__class__ is np.ndarray and ends.__class__ is np.ndarray and starts.dtype is _I64
                and ends.dtype is _I64 and (axes is None or (axes.__class__ is np.ndarray and axes.dtype is _I64))
                and (steps is None or (steps.__class__ is np.ndarray and steps.dtype is _I64))):
            # int64 bytes name the values exactly (None kept apart from an empty array)
            key = (x.shape, starts.tobytes(), ends.tobytes(), None if axes is None else axes.tobytes(),
                   None if steps is None else steps.tobytes())
            index = self._index.get(key)
            if index is None:
                index = _slice_index(x.shape, _ints(starts), _ints(ends), _ints(axes), _ints(steps))
                if len(self._index) < 64:  # bounded: a model fed ever new shapes
                    self._index[key] = index
            return (x[index],)
        return (_slice(x, _ints(starts), _ints(ends), _ints(axes), _ints(steps)),)

    def fixed(self, shape, dtype, constants):
        starts, ends, axes, steps = (list(constants) + [None, None])[:4]
        return operator.itemgetter(_slice_index(shape, _ints(starts), _ints(ends), _ints(axes), _ints(steps)))


# ------------------------------------------------------------------------------------------------
# indexing
# ------------------------------------------------------------------------------------------------
@register("Gather", since=1)
class Gather(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 0))

    def run(self, data, indices):  # type: ignore[override]
        return (np.take(data, indices, axis=self.axis),)  # negative indices wrap, as specified

    def fixed(self, shape, dtype, constants):
        """One constant index (a 0-d tensor: a row, a state of a stack): a basic index and a
        copy (~0.4 us against np.take's ~1.2); other indices keep ``run``."""
        indices = constants[0] if constants else None
        if indices is None or indices.__class__ is not np.ndarray or indices.ndim or indices.dtype.kind not in "iu":
            return None
        axis = self.axis + len(shape) if self.axis < 0 else self.axis
        i = int(indices)
        if not 0 <= axis < len(shape) or not -shape[axis] <= i < shape[axis]:
            return None  # (np.take raises: the step keeps raising where it did)
        get = operator.itemgetter((slice(None),) * axis + (i + shape[axis] if i < 0 else i,))

        def row(x: np.ndarray) -> np.ndarray:
            return get(x).copy()

        return row


def _element_index(indices: np.ndarray, axis: int) -> tuple[np.ndarray, ...]:
    """Advanced index selecting ``indices`` along ``axis`` and the identity elsewhere."""
    rank = indices.ndim
    index = []
    for d in range(rank):
        if d == axis:
            index.append(indices)
        else:
            shape = [1] * rank
            shape[d] = indices.shape[d]
            index.append(np.arange(indices.shape[d]).reshape(shape))
    return tuple(index)


@register("GatherElements", since=11)
class GatherElements(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 0))

    def run(self, data, indices):  # type: ignore[override]
        axis = _data_axis(self.axis, data.ndim, f"node {self.node.name!r} (GatherElements)")
        return (data[_element_index(indices, axis)],)


@register("GatherND", since=11)
class GatherND(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.batch_dims = int(self.attr("batch_dims", 0))

    def run(self, data, indices):  # type: ignore[override]
        b = self.batch_dims
        k = indices.shape[-1]
        batch = data.shape[:b]
        nb = math.prod(batch)
        flat_data = data.reshape((nb,) + data.shape[b:])
        flat_idx = indices.reshape(nb, -1, k)
        batch_idx = np.arange(nb).reshape(nb, 1)
        picked = flat_data[(batch_idx,) + tuple(flat_idx[..., j] for j in range(k))]
        return (picked.reshape(indices.shape[:-1] + data.shape[b + k :]),)


_SCATTER_UFUNC = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


@register("ScatterND", since=11)
class ScatterND(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        reduction = self.attr("reduction", "none")
        if reduction != "none" and reduction not in _SCATTER_UFUNC:
            raise NotImplementedError(f"ScatterND reduction={reduction!r}")
        self.ufunc = _SCATTER_UFUNC.get(reduction)

    def run(self, data, indices, updates):  # type: ignore[override]
        out = data.copy()
        k = indices.shape[-1]
        idx = tuple(np.moveaxis(indices.reshape(-1, k), 1, 0))
        upd = updates.reshape((-1,) + data.shape[k:])
        if self.ufunc is None:
            out[idx] = upd
        else:
            self.ufunc.at(out, idx, upd)
        return (out,)


@register("ScatterElements", since=11)
class ScatterElements(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 0))
        reduction = self.attr("reduction", "none")
        if reduction != "none" and reduction not in _SCATTER_UFUNC:
            raise NotImplementedError(f"ScatterElements reduction={reduction!r}")
        self.ufunc = _SCATTER_UFUNC.get(reduction)

    def run(self, data, indices, updates):  # type: ignore[override]
        out = data.copy()
        idx = _element_index(indices, _norm_axis(self.axis, data.ndim))
        if self.ufunc is None:
            out[idx] = updates
        else:
            self.ufunc.at(out, idx, updates)
        return (out,)


@register("Scatter", since=9)
class Scatter(ScatterElements):
    """Scatter (opset 9, deprecated at 11): ScatterElements under its old name, no reduction."""


@register("NonZero", since=9)
class NonZero(Kernel):
    def run(self, x):  # type: ignore[override]
        if x.ndim == 0:
            return (np.zeros((0, int(bool(x))), dtype=np.int64),)
        return (np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1),)


def _topk(x: np.ndarray, k: int, axis: int, largest: bool):
    axis = _data_axis(axis, x.ndim, "TopK")
    if not 0 <= k <= x.shape[axis]:
        raise InvalidArgument(f"TopK: k {k} must be between 0 and the axis' size {x.shape[axis]} (axis {axis} of "
                              f"{list(x.shape)})")
    if largest:
        # Descending, lower index first among equal values (onnxruntime's order), for every
        # dtype without negating: a stable ascending sort of the flipped axis, read backwards.
        n = x.shape[axis]
        order = np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
        idx = (n - 1) - np.take(order, np.arange(k), axis=axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
        idx = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, idx, axis=axis), idx.astype(np.int64, copy=False)


@register("TopK", since=1)
class TopK1(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.k = int(self.attr("k"))
        self.axis = int(self.attr("axis", -1))

    def run(self, x):  # type: ignore[override]
        return _topk(x, self.k, self.axis, True)


@register("TopK", since=10)
class TopK10(Kernel):
    """TopK from opset 10: k is an input; opset 11 adds ``largest`` and ``sorted``."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", -1))
        self.largest = bool(self.attr("largest", 1))

    def run(self, x, k):  # type: ignore[override]
        return _topk(x, _ints(k)[0], self.axis, self.largest)


class _ArgExtreme(Kernel):
    _fn: ClassVar = staticmethod(np.argmax)

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 0))
        self.keepdims = bool(self.attr("keepdims", 1))
        self.last = bool(self.attr("select_last_index", 0))

    def run(self, x):  # type: ignore[override]
        axis = _data_axis(self.axis, x.ndim, f"node {self.node.name!r} ({self.op_type})")
        fn = type(self)._fn
        if self.last:
            idx = x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis, keepdims=self.keepdims)
        else:
            idx = fn(x, axis=axis, keepdims=self.keepdims)
        return (np.asarray(idx, dtype=np.int64),)


@register("ArgMax", since=1)
class ArgMax(_ArgExtreme):
    _fn = staticmethod(np.argmax)


@register("ArgMin", since=1)
class ArgMin(_ArgExtreme):
    _fn = staticmethod(np.argmin)


@register("CumSum", since=11)
class CumSum(Kernel):
    """Running sums along ``axis`` (exclusive: starting from the identity; reverse: from the end)."""

    _scan = staticmethod(np.cumsum)
    _identity = 0

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.exclusive = bool(self.attr("exclusive", 0))
        self.reverse = bool(self.attr("reverse", 0))

    def run(self, x, axis):  # type: ignore[override]
        given = _ints(axis)[0]
        if not -x.ndim <= given < x.ndim:
            raise InvalidArgument(f"node {self.node.name!r} ({self.op_type}): axis {given} out of range for rank "
                                  f"{x.ndim}" + (" (a scalar has no axis)" if x.ndim == 0 else ""))
        ax = _norm_axis(given, x.ndim)
        src = np.flip(x, ax) if self.reverse else x
        with np.errstate(over="ignore", invalid="ignore"):  # the arithmetic's inf / NaN, unwarned
            if self.exclusive:
                out = np.full_like(src, self._identity)
                head = [slice(None)] * x.ndim
                tail = [slice(None)] * x.ndim
                head[ax] = slice(1, None)
                tail[ax] = slice(None, -1)
                self._scan(src[tuple(tail)], axis=ax, dtype=x.dtype, out=out[tuple(head)])
            else:
                out = self._scan(src, axis=ax, dtype=x.dtype)
        return (np.flip(out, ax) if self.reverse else out,)


@register("CumProd", since=26)
class CumProd(CumSum):
    """Running products (opset 26): CumSum's attributes, 1 as the exclusive start."""

    _scan = staticmethod(np.cumprod)
    _identity = 1


@register("TensorScatter", since=24)
class TensorScatter(Kernel):
    """``update`` written into a copy of ``past_cache`` along ``axis`` from each batch row's
    ``write_indices`` (zeros when absent) on: a KV cache update outside Attention (opset 24).
    ``linear`` mode refuses a write past the cache's end; ``circular`` wraps around it (of
    more updates than the cache holds, the last ones stay, as the spec's loop leaves them)."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.mode = self.attr("mode", "linear")
        if self.mode not in ("linear", "circular"):
            raise InvalidArgument(f"node {node.name!r} (TensorScatter): mode must be 'linear' or 'circular', "
                                  f"got {self.mode!r}")
        self.axis = int(self.attr("axis", -2))

    def run(self, past, update, write_indices=None):  # type: ignore[override]
        name = self.node.name
        ax = _norm_axis(self.axis, past.ndim)
        if not 0 <= ax < past.ndim:
            raise InvalidArgument(f"node {name!r} (TensorScatter): axis {self.axis} out of range for rank {past.ndim}")
        if ax == 0:
            raise InvalidArgument(f"node {name!r} (TensorScatter): axis {self.axis} is the batch axis")
        if (update.ndim != past.ndim or update.dtype != past.dtype or update.shape[ax] > past.shape[ax]
                or any(a != b for k, (a, b) in enumerate(zip(past.shape, update.shape)) if k != ax)):
            raise InvalidArgument(f"node {name!r} (TensorScatter): update {update.dtype}{list(update.shape)} does not "
                                  f"fit the cache {past.dtype}{list(past.shape)} along axis {ax}")
        length, count, b = past.shape[ax], update.shape[ax], past.shape[0]
        if write_indices is None:
            start = np.zeros(b, np.int64)
        elif write_indices.shape != (b,):
            raise InvalidArgument(f"node {name!r} (TensorScatter): write_indices must have shape {[b]}, got "
                                  f"{list(write_indices.shape)}")
        else:
            start = write_indices.astype(np.int64)
        out = past.copy()
        if count == 0 or out.size == 0:
            return (out,)
        upd = np.moveaxis(update, ax, 1)
        if self.mode == "circular":
            keep = min(count, length)  # earlier updates the later ones overwrite are skipped
            pos = (start[:, None] + np.arange(count - keep, count)) % length
            upd = upd[:, count - keep:]
        else:
            pos = start[:, None] + np.arange(count)
            if start.min() < 0 or pos.max() >= length:
                raise InvalidArgument(f"node {name!r} (TensorScatter): linear writes from {start.tolist()} of "
                                      f"{count} rows do not fit a cache of {length}")
        np.moveaxis(out, ax, 1)[np.arange(b)[:, None], pos] = upd
        return (out,)


@register("OneHot", since=9)
class OneHot(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", -1))

    def run(self, indices, depth, values):  # type: ignore[override]
        d = int(np.asarray(depth).reshape(-1)[0])
        idx = indices.astype(np.int64)
        idx = np.where(idx < 0, idx + d, idx)  # out-of-range stays out of range: all "off"
        hot = idx[..., None] == np.arange(d, dtype=np.int64)
        off, on = values.reshape(-1)[0], values.reshape(-1)[1]
        out = np.where(hot, on, off).astype(values.dtype, copy=False)
        axis = _norm_axis(self.axis, indices.ndim + 1)
        return (np.moveaxis(out, -1, axis),)


@register("Trilu", since=14)
class Trilu(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.upper = bool(self.attr("upper", 1))

    def run(self, x, k=None):  # type: ignore[override]
        kk = 0 if k is None else _ints(k)[0]
        return ((np.triu if self.upper else np.tril)(x, kk),)


@register("DepthToSpace", since=1)
class DepthToSpace(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.bs = int(self.attr("blocksize"))
        self.mode = self.attr("mode", "DCR")
        if self.mode not in ("DCR", "CRD"):
            raise NotImplementedError(f"DepthToSpace mode={self.mode!r}")

    def run(self, x):  # type: ignore[override]
        b, c, h, w = x.shape
        bs = self.bs
        if self.mode == "DCR":
            tmp = x.reshape(b, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
        else:
            tmp = x.reshape(b, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
        return (tmp.reshape(b, c // (bs * bs), h * bs, w * bs),)


@register("SpaceToDepth", since=1)
class SpaceToDepth(Kernel):
    """Blocks of the spatial axes moved into depth; ``mode`` (DCR default, or CRD) orders them.

    DCR puts the block offset before the channel (depth = (bh * bs + bw) * C + c), CRD after
    it (depth = c * bs * bs + bh * bs + bw), mirroring DepthToSpace's two modes.
    """

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.bs = int(self.attr("blocksize"))
        self.mode = self.attr("mode", "DCR")
        if self.mode not in ("DCR", "CRD"):
            raise NotImplementedError(f"SpaceToDepth mode={self.mode!r}")

    def run(self, x):  # type: ignore[override]
        b, c, h, w = x.shape
        bs = self.bs
        perm = (0, 3, 5, 1, 2, 4) if self.mode == "DCR" else (0, 1, 3, 5, 2, 4)
        tmp = x.reshape(b, c, h // bs, bs, w // bs, bs).transpose(perm)
        return (tmp.reshape(b, c * bs * bs, h // bs, w // bs),)


# ------------------------------------------------------------------------------------------------
# constants and generators
# ------------------------------------------------------------------------------------------------
def _frozen(a: np.ndarray) -> np.ndarray:
    # The same array is returned by every run: read-only so nobody can change it for the next.
    a = np.array(a)  # own the memory
    a.setflags(write=False)
    return a


@register("Constant", since=1)
class Constant(Kernel):
    """The value is built once, at bind time; every run returns the same read-only array."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        attrs = {a.name: a for a in node.attribute}
        if "value" in attrs:
            value = to_array(attrs["value"].t)
        elif "value_float" in attrs:
            value = np.array(attrs["value_float"].f, dtype=np.float32)
        elif "value_floats" in attrs:
            value = np.array(list(attrs["value_floats"].floats), dtype=np.float32)
        elif "value_int" in attrs:
            value = np.array(attrs["value_int"].i, dtype=np.int64)
        elif "value_ints" in attrs:
            value = np.array(list(attrs["value_ints"].ints), dtype=np.int64)
        elif "sparse_value" in attrs and attrs["sparse_value"].HasField("sparse_tensor"):
            # The output is dense (as onnxruntime makes it); onnx.reference would hand a
            # SparseTensor object to the next node.  Checked like a sparse initializer.
            value = sparse_to_dense(attrs["sparse_value"].sparse_tensor, f"node {node.name!r} (Constant) sparse_value")
        else:
            # value_string(s), or a reference to a function attribute.
            raise NotImplementedError(f"Constant with attributes {sorted(attrs)}")
        if value.dtype == object:
            raise NotImplementedError("Constant string tensor")
        self.value = _frozen(value)

    def run(self):  # type: ignore[override]
        return (self.value,)


@register("ConstantOfShape", since=9)
class ConstantOfShape(Kernel):
    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        value = None
        for a in node.attribute:
            if a.name == "value":
                value = to_array(a.t)
        if value is None:
            value = np.zeros(1, dtype=np.float32)
        if value.dtype == object:
            raise NotImplementedError("ConstantOfShape of strings")
        self.fill = value.reshape(-1)[0]
        self.dtype = value.dtype

    def run(self, shape):  # type: ignore[override]
        return (np.full(_ints(shape), self.fill, dtype=self.dtype),)


_RANGE_INPUTS = ("start", "limit", "delta")


@register("Range", since=11)
class Range(Kernel):
    """``start + i * delta`` for ``i < max(ceil((limit - start) / delta), 0)``, in the inputs' dtype."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        if int(self.attr("stash_type", 1)) != 1:
            raise NotImplementedError("Range stash_type=0 (accumulate in float16)")

    def run(self, start, limit, delta):  # type: ignore[override]
        dtype = start.dtype
        # The inputs are scalars by the spec, but producers (AffineGrid's function body among
        # them) pass 1-element 1-D tensors, which onnx.reference accepts: take the one element.
        start, limit, delta = (_scalar(v, "Range", n) for v, n in zip((start, limit, delta), _RANGE_INPUTS))
        if dtype.kind in "iu":
            # Exact, in Python integers: numpy's own length (computed in float64, then in intp)
            # wraps for spans near 2^63 — np.arange(0, 2**63 - 1) is empty, and so is
            # np.arange(-2**63, 2**63 - 1, 2**62), silently (found by the reliability fuzzer).
            s, lim, d = int(start), int(limit), int(delta)
            if d == 0:
                raise InvalidArgument(f"node {self.node.name!r} (Range): delta must not be 0")
            count = max(-((s - lim) // d), 0)  # ceil((limit - start) / delta)
            self._check_count(count, dtype)
            wide = np.dtype(np.uint64 if dtype.kind == "u" else np.int64)
            with np.errstate(over="ignore"):  # i * delta may wrap; start + i * delta fits (< limit)
                out = np.arange(count, dtype=wide) * wide.type(d) + wide.type(s)
            return (out.astype(dtype, copy=False),)
        if dtype == np.float16:  # stash_type=1: compute in float32, round once
            start, limit, delta = (np.float32(v) for v in (start, limit, delta))
        with np.errstate(all="ignore"):
            span = (np.float64(limit) - np.float64(start)) / np.float64(delta)
        if np.isfinite(span):
            self._check_count(max(math.ceil(span), 0), dtype)
        return (np.arange(start, limit, delta).astype(dtype, copy=False),)

    def _check_count(self, count: int, dtype: np.dtype) -> None:
        if not shape_fits((count,), dtype.itemsize):
            raise InvalidArgument(
                f"node {self.node.name!r} (Range): {count} elements of {dtype} do not fit any array")


# ------------------------------------------------------------------------------------------------
# Pad
# ------------------------------------------------------------------------------------------------
_PAD_MODES = {"constant", "reflect", "edge", "wrap"}


def _pad(x: np.ndarray, pads: list[int], mode: str, value, axes: list[int] | None) -> np.ndarray:
    return _pad_fn(x.shape, pads, mode, value, axes)(x)


def _pad_fn(shape: tuple[int, ...], pads: list[int], mode: str, value,
            axes: list[int] | None) -> Callable[[np.ndarray], np.ndarray]:
    """Pad of an input of ``shape`` as a function of the input (of any dtype): what depends on
    the shape decided here (a plan specialized for fixed shapes keeps the function:
    ``Kernel.fixed``)."""
    rank = len(shape)
    if axes is None:
        axes = list(range(rank))
    n = len(axes)
    before = [0] * rank
    after = [0] * rank
    for i, axis in enumerate(axes):
        axis = _norm_axis(axis, rank)
        before[axis] = pads[i]
        after[axis] = pads[i + n]
    crop = None
    if any(max(-b, 0) + max(-a, 0) > d for b, a, d in zip(before, after, shape)):
        # Negative pads removing more than the axis holds (+7 before and -7 after an axis of 2):
        # the spec pads, then removes; onnxruntime's output is then the pad value where the input
        # is not, for the constant mode, and an error for the others.
        out_shape = tuple(d + b + a for d, b, a in zip(shape, before, after))
        if min(out_shape) < 0 or mode != "constant":
            raise InvalidArgument(f"Pad ({mode}): pads {pads} remove more than the input {list(shape)} holds "
                                  f"(output {list(out_shape)})")
        src = tuple(slice(max(0, -b), max(max(0, -b), min(d, o - b))) for d, b, o in zip(shape, before, out_shape))
        dst = tuple(slice(max(0, b), max(0, b) + (c.stop - c.start)) for b, c in zip(before, src))

        def overlap(x: np.ndarray) -> np.ndarray:
            out = np.full(out_shape, value, dtype=x.dtype)
            out[dst] = x[src]
            return out

        return overlap
    if any(p < 0 for p in before + after):
        # Negative pads crop: that first, with a view.
        crop = tuple(slice(max(-b, 0), shape[d] - max(-a, 0)) for d, (b, a) in enumerate(zip(before, after)))
        shape = tuple(len(range(*c.indices(d))) for c, d in zip(crop, shape))
        before = [max(b, 0) for b in before]
        after = [max(a, 0) for a in after]

    def cropped(x: np.ndarray) -> np.ndarray:
        return x if crop is None else x[crop]

    if not any(before) and not any(after):
        return cropped
    if mode == "constant":
        out_shape = tuple(s + b + a for s, b, a in zip(shape, before, after))
        inner = tuple(slice(b, b + s) for b, s in zip(before, shape))

        def constant(x: np.ndarray) -> np.ndarray:
            out = np.full(out_shape, value, dtype=x.dtype)
            out[inner] = cropped(x)
            return out

        return constant
    padded = [d for d in range(rank) if before[d] or after[d]]
    if mode == "reflect" and len(padded) == 1 and max(before[padded[0]], after[padded[0]]) < shape[padded[0]]:
        # One axis, pads shorter than it (an STFT's reflect padding): the mirrored edges and the
        # input in one gather, a few us instead of np.pad's general path (~30 us on 512 samples).
        d, b, a = padded[0], before[padded[0]], after[padded[0]]
        size = shape[d]
        index = np.concatenate([np.arange(b, 0, -1), np.arange(size), np.arange(size - 2, size - 2 - a, -1)])

        def reflect(x: np.ndarray) -> np.ndarray:
            return np.take(cropped(x), index, axis=d)

        return reflect
    widths = list(zip(before, after))

    def general(x: np.ndarray) -> np.ndarray:
        return np.pad(cropped(x), widths, mode=mode)

    return general


@register("Pad", since=1)
class Pad2(Kernel):
    """Pad before opset 11: ``pads`` (``paddings`` in opset 1), ``mode``, ``value`` attributes."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        pads = self.attr("pads", self.attr("paddings"))
        self.pads = [int(p) for p in pads]
        self.mode = self.attr("mode", "constant")
        if self.mode not in _PAD_MODES:
            raise NotImplementedError(f"Pad mode={self.mode!r}")
        self.value = float(self.attr("value", 0.0))

    def run(self, x):  # type: ignore[override]
        return (_pad(x, self.pads, self.mode, self.value, None),)

    def fixed(self, shape, dtype, constants):
        return _pad_fn(shape, self.pads, self.mode, self.value, None)


@register("Pad", since=11)
class Pad11(Kernel):
    """Pad from opset 11: ``pads``, ``constant_value`` and (opset 18) ``axes`` are inputs."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.mode = self.attr("mode", "constant")
        if self.mode not in _PAD_MODES:
            raise NotImplementedError(f"Pad mode={self.mode!r}")

    def run(self, x, pads, value=None, axes=None):  # type: ignore[override]
        return (_pad(x, _ints(pads), self.mode, self._value(value), _ints(axes)),)

    def fixed(self, shape, dtype, constants):
        pads, value, axes = (list(constants) + [None, None])[:3]
        return _pad_fn(shape, _ints(pads), self.mode, self._value(value), _ints(axes))

    @staticmethod
    def _value(value):
        return 0 if value is None or value.size == 0 else value.reshape(-1)[0]


# ------------------------------------------------------------------------------------------------
# GridSample
# ------------------------------------------------------------------------------------------------
_GRID_MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest", "bicubic": "cubic", "cubic": "cubic"}
_GRID_PADDING = ("zeros", "border", "reflection")


def _reflect(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Coordinates folded back into [lo, hi] by reflecting at the borders (as often as needed)."""
    span = hi - lo
    if span <= 0:
        return np.full_like(v, lo)
    below, above = v < lo, v > hi
    dx = np.where(below, lo - v, np.where(above, v - hi, 0)).astype(v.dtype)
    n = np.floor(dx / span)
    r = dx - n * span
    even = (n % 2) == 0
    out = np.where(below, np.where(even, lo + r, hi - r), v)
    return np.where(above, np.where(even, hi - r, lo + r), out).astype(v.dtype, copy=False)


def _cubic_weights(t: np.ndarray) -> list[np.ndarray]:
    """Keys' cubic convolution weights (alpha -0.75) of the taps at -1, 0, 1, 2 for fractions ``t``."""
    a = t.dtype.type(-0.75)
    one = t.dtype.type(1)
    x0, x1, x2, x3 = t + one, t, one - t, 2 * one - t
    w0 = ((a * x0 - 5 * a) * x0 + 8 * a) * x0 - 4 * a
    w1 = ((a + 2) * x1 - (a + 3)) * x1 * x1 + one
    w2 = ((a + 2) * x2 - (a + 3)) * x2 * x2 + one
    w3 = ((a * x3 - 5 * a) * x3 + 8 * a) * x3 - 4 * a
    return [w0, w1, w2, w3]


@register("GridSample", since=16)
class GridSample(Kernel):
    """Sample (N, C, *spatial) at the grid's normalized coordinates (grid (N, *out, D), its last
    axis x first), nearest / (bi)linear / (bi)cubic, zeros / border / reflection padding, any
    number of spatial axes; the spec's (and onnx.reference's) coordinate rules, vectorized: one
    gather of all channels per tap (2^D taps linear, 4^D cubic).  com.microsoft's GridSample
    (before opset 16: ``bilinear`` / ``bicubic``) is the same kernel."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        mode = self.attr("mode", "linear" if ctx.opset >= 20 and not node.domain else "bilinear")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        padding = self.attr("padding_mode", "zeros")
        padding = padding.decode() if isinstance(padding, bytes) else padding
        if mode not in _GRID_MODES or padding not in _GRID_PADDING:
            raise InvalidArgument(f"node {node.name!r} (GridSample): mode {mode!r} / padding_mode {padding!r} not "
                                  f"in {sorted(_GRID_MODES)} / {list(_GRID_PADDING)}")
        self.mode, self.padding = _GRID_MODES[mode], padding
        self.align = bool(int(self.attr("align_corners", 0)))

    def run(self, x, grid):  # type: ignore[override]
        name = self.node.name
        d = x.ndim - 2
        if d < 1 or grid.ndim != d + 2 or grid.shape[0] != x.shape[0] or grid.shape[-1] != d:
            raise InvalidArgument(f"node {name!r} (GridSample): X (N, C, *spatial) and grid (N, *out, {max(d, 1)}) "
                                  f"do not fit: X {list(x.shape)}, grid {list(grid.shape)}")
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise InvalidArgument(f"node {name!r} (GridSample): X must be float, got {x.dtype}")
        cd = np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)
        n, c, dims = x.shape[0], x.shape[1], x.shape[2:]
        out_sp = grid.shape[1:-1]
        if 0 in (n, c) or 0 in out_sp:
            return (np.zeros((n, c, *out_sp), x.dtype),)
        g = grid.astype(cd, copy=False)
        xt = np.moveaxis(x.astype(cd, copy=False), 1, -1)  # (N, *spatial, C): one gather takes every channel
        coords, bounds = [], []
        for i, size in enumerate(dims):  # spatial axis i is the grid's component d - 1 - i
            v = g[..., d - 1 - i]
            if self.align:
                v = (v + 1) / 2 * cd.type(size - 1)
                lo, hi = 0.0, float(size - 1)
            else:
                v = ((v + 1) * cd.type(size) - 1) / 2
                lo, hi = -0.5, size - 0.5
            if self.mode == "nearest":
                v = np.rint(v)
            if self.padding == "border" and self.mode != "cubic":
                # (cubic: onnxruntime clamps each tap's index only, as PyTorch; onnx.reference
                # clamps the coordinate first, up to ~0.3 of the values apart)
                v = np.clip(v, 0, size - 1)
            elif self.padding == "reflection":
                v = _reflect(v, cd.type(lo), cd.type(hi))
            coords.append(v)
            bounds.append((lo, hi))
        taps = [self._taps(v, size, lo, hi) for v, size, (lo, hi) in zip(coords, dims, bounds)]
        nidx = np.arange(n).reshape((n,) + (1,) * len(out_sp))
        y = None
        for combo in itertools.product(*taps):
            w = combo[0][1]
            for _, wi in combo[1:]:
                w = w * wi
            vals = xt[(nidx, *(idx for idx, _ in combo))]  # (N, *out, C)
            term = vals * w[..., None]
            y = term if y is None else y + term
        return (np.moveaxis(y, -1, 1).astype(x.dtype, copy=False),)

    def _taps(self, v: np.ndarray, size: int, lo: float, hi: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """(index, weight) per tap along one axis; a tap outside the image reads index 0 with
        weight 0 (zeros), its clamped index (border) or its reflected index (reflection)."""
        if self.mode == "nearest":
            starts, weights = [v.astype(np.int64)], [np.ones_like(v)]
        elif self.mode == "linear":
            f = np.floor(v)
            t = v - f
            starts = [f.astype(np.int64), f.astype(np.int64) + 1]
            weights = [1 - t, t]
        else:
            f = np.floor(v)
            base = f.astype(np.int64)
            starts = [base - 1, base, base + 1, base + 2]
            weights = _cubic_weights(v - f)
        out = []
        for idx, w in zip(starts, weights):
            if self.padding == "zeros":
                inside = (idx >= 0) & (idx < size)
                out.append((np.where(inside, idx, 0), np.where(inside, w, 0).astype(w.dtype, copy=False)))
            elif self.padding == "border":
                out.append((np.clip(idx, 0, size - 1), w))
            else:
                ref = _reflect(idx.astype(np.float64), lo, hi).astype(np.int64)
                out.append((np.clip(ref, 0, size - 1), w))
        return out


@register("GridSample", domain="com.microsoft", since=1)
class MsGridSample(GridSample):
    """com.microsoft's GridSample (onnxruntime's, before ONNX had it): ``bilinear`` / ``nearest`` /
    ``bicubic``, the same coordinates."""


# ------------------------------------------------------------------------------------------------
# Resize
# ------------------------------------------------------------------------------------------------
_RESIZE_MODES = ("nearest", "linear", "cubic")
_RESIZE_COORDS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
_ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")


# Coordinate modes whose linear 2-D Resize runs onnxruntime's bilinear formula (Resize._bilinear).
_ORT_BILINEAR_COORDS = frozenset({"half_pixel", "asymmetric", "pytorch_half_pixel", "align_corners"})


@register("Resize", since=11)
class Resize(Kernel):
    """Separable Resize: one 1-D gather (nearest) or weighted gather (linear/cubic) per axis; a
    float32 linear or cubic resize over the last two axes (2-D, or 4-D with the outer two kept)
    is onnxruntime's own bilinear / bicubic formula instead, bit for bit (:meth:`_bilinear`,
    :meth:`_bicubic`).

    Supported: every ``mode`` and ``nearest_mode``; coordinate modes half_pixel,
    half_pixel_symmetric, pytorch_half_pixel, align_corners, asymmetric; ``axes``;
    ``keep_aspect_ratio_policy``; ``exclude_outside``.  ``tf_crop_and_resize`` (roi,
    extrapolation), ``tf_half_pixel_for_nn`` and ``antialias=1`` raise ``NotImplementedError``
    so the session falls back to onnx.reference.  Resize-10 and Upsample: :class:`_LegacyResize`.
    """

    # Nearest's source indices per (length in, length out, scale) -> (indices, repeat factor or 0).
    _nearest_plans: dict | None = None

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.mode = self.attr("mode", "nearest")
        self.coord = self.attr("coordinate_transformation_mode", "half_pixel")
        self.nearest_mode = self.attr("nearest_mode", "round_prefer_floor")
        self.cubic_a = float(self.attr("cubic_coeff_a", -0.75))
        self.exclude_outside = bool(self.attr("exclude_outside", 0))
        self.policy = self.attr("keep_aspect_ratio_policy", "stretch")
        axes = self.attr("axes")
        self.axes = [int(a) for a in axes] if axes else None
        unsupported = []
        if self.mode not in _RESIZE_MODES:
            unsupported.append(f"mode={self.mode!r}")
        if self.coord not in _RESIZE_COORDS:
            unsupported.append(f"coordinate_transformation_mode={self.coord!r}")
        if self.nearest_mode not in _NEAREST_MODES:
            unsupported.append(f"nearest_mode={self.nearest_mode!r}")
        if int(self.attr("antialias", 0)):
            unsupported.append("antialias=1")
        if self.policy not in _ASPECT_POLICIES:
            unsupported.append(f"keep_aspect_ratio_policy={self.policy!r}")
        if unsupported:
            raise NotImplementedError("Resize " + ", ".join(unsupported))

    def _plan(self, x: np.ndarray, scales, sizes) -> tuple[list[float], list[int]]:
        rank = x.ndim
        axes = [_norm_axis(a, rank) for a in self.axes] if self.axes else list(range(rank))
        factors = [1.0] * rank
        out = list(x.shape)
        if sizes is not None and sizes.size:
            wanted = _ints(sizes)
            for a, s in zip(axes, wanted):
                out[a] = s
                factors[a] = s / x.shape[a] if x.shape[a] else 1.0
            if self.policy != "stretch":
                pick = min if self.policy == "not_larger" else max
                scale = pick(factors[a] for a in axes)
                for a in axes:
                    factors[a] = scale
                    out[a] = int(scale * x.shape[a] + 0.5)
        else:
            given = [float(v) for v in np.asarray(scales, dtype=np.float32).reshape(-1).tolist()]
            for a, s in zip(axes, given):
                factors[a] = s
                # float32, as onnxruntime: 10 x 1.8f is 18 there, 17.99999952 in float64
                out[a] = int(np.float32(s) * np.float32(x.shape[a])) if x.shape[a] < 1 << 24 else int(s * x.shape[a])
        return factors, out

    def run(self, x, roi=None, scales=None, sizes=None):  # type: ignore[override]
        factors, out_shape = self._plan(x, scales, sizes)
        if tuple(out_shape) == x.shape:
            # onnxruntime copies the input when the output has its shape, whatever the scales say
            # (a 1.09 scale of 6 columns is 6 columns: read as the identity there, not resampled)
            return (x.copy(),)
        if self.mode == "nearest":
            return (self._resize_nearest(x, factors, out_shape),)
        if x.dtype == np.float32 and x.ndim in (2, 4) and 0 not in x.shape and 0 not in out_shape and \
                self.coord in _ORT_BILINEAR_COORDS and all(
                    out_shape[a] == x.shape[a] and math.isclose(factors[a], 1.0) for a in range(x.ndim - 2)):
            # onnxruntime's own 2-D formulas, with its float32 scales (sizes: output / input)
            scales2 = [np.float32(np.float32(o) / np.float32(i)) if sizes is not None and sizes.size
                       and self.policy == "stretch" else np.float32(f)
                       for o, i, f in zip(out_shape[-2:], x.shape[-2:], factors[-2:])]
            return ((self._bilinear if self.mode == "linear" else self._bicubic)(x, scales2, out_shape[-2:]),)
        work = x if x.dtype.kind == "f" and x.dtype != np.float16 else x.astype(np.float32)
        for axis, (scale, n_out) in enumerate(zip(factors, out_shape)):
            n_in = work.shape[axis]
            if n_out == n_in and math.isclose(scale, 1.0):
                continue
            if n_out == 0 or n_in == 0:
                shape = list(work.shape)
                shape[axis] = n_out
                work = np.empty(shape, dtype=work.dtype)
                continue
            coords = self._source_coords(n_in, n_out, scale)
            if self.mode == "linear":
                work = self._linear(work, axis, coords, n_in)
            else:
                work = self._cubic(work, axis, coords, n_in)
        return (_cast_back(work, x.dtype),)

    def _resize_nearest(self, x: np.ndarray, factors: list[float], out_shape: list[int]) -> np.ndarray:
        """Nearest: each resampled axis one gather of source indices (no arithmetic, no dtype
        change).  The indices of an axis depend only on its lengths and scale: made once and kept.
        When every resampled axis repeats each source element ``k`` times in order (an integer
        upsampling, as a YOLO neck's 2x), the input is copied into the output's strided phases
        instead of a take per axis (2x of 1x128x20x20: 220 -> 90 us)."""
        cache = self._nearest_plans
        if cache is None:  # (per kernel; subclasses need not call Resize.__init__)
            cache = self._nearest_plans = {}
        plans = []
        for axis, (scale, n_out) in enumerate(zip(factors, out_shape)):
            n_in = x.shape[axis]
            if n_out == n_in and math.isclose(scale, 1.0):
                continue
            key = (n_in, n_out, scale)
            got = cache.get(key)
            if got is None:
                if n_out == 0 or n_in == 0:
                    got = (None, 0)
                else:
                    idx = self._nearest(self._source_coords(n_in, n_out, scale), n_in)
                    k = n_out // n_in
                    repeat = k >= 1 and n_out == k * n_in and np.array_equal(idx, np.arange(n_out) // k)
                    got = (idx, k if repeat else 0)
                if len(cache) < 64:
                    cache[key] = got
            plans.append((axis, n_out) + got)
        if plans and all(idx is not None and k for _, _, idx, k in plans) and math.prod(k for *_, k in plans) <= 16:
            # y viewed as (..., n_in, k, ...) for each repeated axis; x copied once per phase
            # (j, ...) of the repeats: y[..., i, j, ...] = x[..., i, ...] (a broadcast over the k
            # axes instead made numpy's innermost loop k long: slower than the takes).
            reps = {axis: k for axis, _, _, k in plans}
            view = []
            for axis, n in enumerate(x.shape):
                view.extend((n, reps[axis]) if axis in reps else (n,))
            y = np.empty(out_shape, x.dtype)
            yv = y.reshape(view)
            for phase in itertools.product(*(range(reps[a]) for a in sorted(reps))):
                at, it = [], iter(phase)
                for axis in range(x.ndim):
                    at.append(slice(None))
                    if axis in reps:
                        at.append(next(it))
                yv[tuple(at)] = x
            return y
        work = x
        for axis, n_out, idx, _k in plans:
            if idx is None:
                shape = list(work.shape)
                shape[axis] = n_out
                work = np.empty(shape, dtype=work.dtype)
            else:
                work = np.take(work, idx, axis=axis)
        return work if work is not x else x.copy()

    def _source_coords(self, n_in: int, n_out: int, scale: float) -> np.ndarray:
        y = np.arange(n_out, dtype=np.float64)
        width = scale * n_in  # the un-rounded output length, as the spec uses it
        mode = self.coord
        if mode == "align_corners":
            # onnxruntime's rule (the spec's "length_resized"): the output's own length, not the
            # scale's un-rounded one (6 x 1.7 is 10 positions, the last one reading the input's last)
            return np.zeros(n_out) if n_out == 1 else y * (n_in - 1) / (n_out - 1)
        # The scale-based modes in float32, as onnxruntime computes them: a source coordinate
        # that is an integer in exact arithmetic (12 / 2.4) rounds to it in float32 but falls
        # just below it in float64, and a nearest pixel then moves by one.  (Measured against
        # onnxruntime on 1,500 random nearest / linear / cubic resizes at non-integer scales,
        # with the equal-shape copy in run: 26 differed in float64, 8 in float32, all of them
        # asymmetric with round_prefer_ceil, where onnxruntime's pixel is not its own formula's.)
        y32, s32 = y.astype(np.float32), np.float32(scale)
        if mode == "asymmetric":
            return y32 / s32
        if mode == "pytorch_half_pixel":
            # (an output of length 1 reads coordinate 0: the spec's and onnxruntime's rule)
            return np.zeros(n_out, np.float32) if n_out <= 1 else (y32 + np.float32(0.5)) / s32 - np.float32(0.5)
        if mode == "half_pixel_symmetric":
            offset = (n_in / 2) * (1 - n_out / width)
            return offset + (y + 0.5) / scale - 0.5
        return (y32 + np.float32(0.5)) / s32 - np.float32(0.5)  # half_pixel

    def _nearest(self, coords: np.ndarray, n_in: int) -> np.ndarray:
        fl = np.floor(coords)
        frac = coords - fl
        mode = self.nearest_mode
        if mode == "round_prefer_floor":
            up = frac > 0.5
        elif mode == "round_prefer_ceil":
            up = frac >= 0.5
        elif mode == "floor":
            up = np.zeros(coords.shape, dtype=bool)
        else:  # ceil
            up = frac > 0
        idx = fl.astype(np.int64) + up
        return np.clip(idx, 0, n_in - 1)

    @staticmethod
    def _weighted(work: np.ndarray, axis: int, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        # idx, w: (n_out, taps).  Sum over taps of take(work, idx[:, t]) * w[:, t].
        shape = [1] * work.ndim
        shape[axis] = idx.shape[0]
        w = w.astype(work.dtype)
        out = np.take(work, idx[:, 0], axis=axis) * w[:, 0].reshape(shape)
        for t in range(1, idx.shape[1]):
            out += np.take(work, idx[:, t], axis=axis) * w[:, t].reshape(shape)
        return out

    def _ort_coords(self, n_in: int, n_out: int, scale: np.float32) -> np.ndarray:
        """onnxruntime's source coordinates of one axis, in float32 (the output's own index where
        the scale is 1), not clamped."""
        o = np.arange(n_out, dtype=np.float32)
        half = np.float32(0.5)
        if scale == 1:
            return o
        if self.coord == "asymmetric":
            return o / scale
        if self.coord == "align_corners":
            return np.zeros(n_out, np.float32) if n_out == 1 else o * np.float32(n_in - 1) / np.float32(n_out - 1)
        if self.coord == "pytorch_half_pixel" and n_out <= 1:
            return np.zeros(n_out, np.float32)
        return (o + half) / scale - half  # half_pixel, pytorch_half_pixel

    def _ort_cubic_axis(self, n_in: int, n_out: int, scale: np.float32) -> tuple:
        """One axis of onnxruntime's bicubic Resize (its ResizeBiCubic), in float32: the four
        source pixels of each output (clamped into the input) and their Keys coefficients of the
        coordinate's fraction, zeroed outside the input and divided by their sum with
        ``exclude_outside`` (else divided by 1)."""
        c = self._ort_coords(n_in, n_out, scale)
        base = np.floor(c)
        s = np.abs(c - base)
        a = np.float32(self.cubic_a)
        one, two = np.float32(1), np.float32(2)
        f4, f5, f8 = np.float32(4), np.float32(5), np.float32(8)
        s1, s2, s3 = s + one, one - s, two - s
        coeffs = np.stack([((a * s1 - f5 * a) * s1 + f8 * a) * s1 - f4 * a,
                           ((a + two) * s - (a + np.float32(3))) * s * s + one,
                           ((a + two) * s2 - (a + np.float32(3))) * s2 * s2 + one,
                           ((a * s3 - f5 * a) * s3 + f8 * a) * s3 - f4 * a], axis=1).astype(np.float32)
        taps = base.astype(np.int64)[:, None] + np.arange(-1, 3)[None, :]
        total = np.ones(n_out, np.float32)
        if self.exclude_outside:
            coeffs = np.where((taps < 0) | (taps >= n_in), np.float32(0), coeffs)
            total = np.zeros(n_out, np.float32)
            for i in range(4):
                total = total + coeffs[:, i]
        return np.clip(taps, 0, n_in - 1), coeffs, total

    def _bicubic(self, x: np.ndarray, scales: list, out_hw: list) -> np.ndarray:
        """A float32 2-D input, or a 4-D one resized over its last two axes, as onnxruntime's
        ResizeBiCubic computes it: along x first, ``sum_j coeff_x[j] / sum_x * X[row, col_j]``
        from 0, then along y, ``sum_i x_i * coeff_y[i] / sum_y`` from 0, in float32 and in that
        order (the separable passes weighed in float64 and rounded between the axes)."""
        (h, w), (oh, ow) = x.shape[-2:], out_hw
        yi, cy, sy = self._ort_cubic_axis(h, oh, scales[0])
        xi, cx, sx = self._ort_cubic_axis(w, ow, scales[1])
        wx = [cx[:, j] / sx for j in range(4)]
        out = None
        for i in range(4):
            rows = np.take(x, yi[:, i], axis=-2)  # (..., OH, W)
            t = None
            for j in range(4):
                term = wx[j] * np.take(rows, xi[:, j], axis=-1)
                t = term + np.float32(0) if t is None else t + term  # (from 0: a -0.0 term is +0.0)
            term = (t * cy[:, i][:, None]) / sy[:, None]
            out = term + np.float32(0) if out is None else out + term
        return out

    def _ort_axis(self, n_in: int, n_out: int, scale: np.float32) -> tuple:
        """One axis of onnxruntime's bilinear Resize (its SetupUpsampleBilinear), in float32: the
        source coordinate (the output's own index where the scale is 1), clamped into the input;
        its lower and upper pixel; their weights as distances to the other one (``|c - i1|``,
        ``|c - i2|``), 0.5 and 0.5 where both pixels are the last."""
        half = np.float32(0.5)
        c = self._ort_coords(n_in, n_out, scale)
        c = np.minimum(np.maximum(c, np.float32(0)), np.float32(n_in - 1))
        i1 = np.minimum(c.astype(np.int64), n_in - 1)
        i2 = np.minimum(i1 + 1, n_in - 1)
        d1 = np.abs(c - i1.astype(np.float32))
        d2 = np.abs(c - i2.astype(np.float32))
        last = i1 == i2
        d1[last] = half
        d2[last] = half
        return i1, i2, d1, d2

    def _bilinear(self, x: np.ndarray, scales: list, out_hw: list) -> np.ndarray:
        """A float32 2-D input, or a 4-D one resized over its last two axes, as onnxruntime's
        UpsampleBilinear computes it: ``dx2*dy2*X11 + dx1*dy2*X21 + dx2*dy1*X12 + dx1*dy1*X22``
        in float32, left to right (its weights and neighbours from :meth:`_ort_axis`).  The
        separable passes of :meth:`_linear` round between the axes and weigh ``1 - r`` and ``r``:
        the last bit of 3-75 % of the outputs differed, and a QuantizeLinear after such a Resize
        (quantize_static's QDQ upsampling) moved a code at its ties."""
        (h, w), (oh, ow) = x.shape[-2:], out_hw
        y1, y2, dy1, dy2 = self._ort_axis(h, oh, scales[0])
        x1, x2, dx1, dx2 = self._ort_axis(w, ow, scales[1])
        dy1, dy2 = dy1[:, None], dy2[:, None]
        r1, r2 = np.take(x, y1, axis=-2), np.take(x, y2, axis=-2)
        out = (dx2 * dy2) * np.take(r1, x1, axis=-1)
        out += (dx1 * dy2) * np.take(r1, x2, axis=-1)
        out += (dx2 * dy1) * np.take(r2, x1, axis=-1)
        out += (dx1 * dy1) * np.take(r2, x2, axis=-1)
        return out

    def _linear(self, work, axis, coords, n_in):
        fl = np.floor(coords)
        ratio = coords - fl
        i0 = fl.astype(np.int64)
        idx = np.clip(np.stack([i0, i0 + 1], axis=1), 0, n_in - 1)
        w = np.stack([1 - ratio, ratio], axis=1)
        return self._weighted(work, axis, idx, w)

    def _cubic(self, work, axis, coords, n_in):
        fl = np.floor(coords)
        r = coords - fl
        i0 = fl.astype(np.int64)
        a = self.cubic_a
        # Keys' cubic kernel at distances r+1, r, 1-r, 2-r from taps i0-1 .. i0+2.
        d = np.stack([r + 1, r, 1 - r, 2 - r], axis=1)
        ad = np.abs(d)
        w = np.where(
            ad <= 1,
            ((a + 2) * ad - (a + 3)) * ad * ad + 1,
            np.where(ad < 2, ((a * ad - 5 * a) * ad + 8 * a) * ad - 4 * a, 0.0),
        )
        raw = i0[:, None] + np.arange(-1, 3)[None, :]
        if self.exclude_outside:
            w = np.where((raw < 0) | (raw >= n_in), 0.0, w)
            total = w.sum(axis=1, keepdims=True)
            w = w / np.where(total == 0, 1.0, total)
        return self._weighted(work, axis, np.clip(raw, 0, n_in - 1), w)


class _LegacyResize(Resize):
    """Upsample (opsets 7-9) and Resize-10 as onnxruntime runs them: asymmetric coordinates
    (``x / scale``), ``nearest`` or ``linear``; a nearest pixel is the coordinate's floor when
    the axis grows and its ceiling when it shrinks."""

    def __init__(self, node, ctx: KernelContext) -> None:
        Kernel.__init__(self, node, ctx)
        mode = self.attr("mode", "nearest")
        self.mode = mode.decode() if isinstance(mode, bytes) else mode
        if self.mode not in ("nearest", "linear", "bilinear"):
            raise InvalidArgument(f"node {node.name!r} ({node.op_type}): mode must be nearest or linear, got {self.mode!r}")
        self.mode = "linear" if self.mode == "bilinear" else self.mode
        self.coord, self.nearest_mode, self.cubic_a = "asymmetric", "floor", -0.75
        self.exclude_outside, self.policy, self.axes = False, "stretch", None

    def _nearest(self, coords: np.ndarray, n_in: int) -> np.ndarray:
        idx = np.ceil(coords) if coords.shape[0] < n_in else np.floor(coords)
        return np.clip(idx.astype(np.int64), 0, n_in - 1)

    def _scaled(self, x: np.ndarray, scales) -> tuple:
        s = np.asarray(scales, np.float32).reshape(-1)
        if s.size != x.ndim:
            raise InvalidArgument(f"node {self.node.name!r} ({self.node.op_type}): {s.size} scales for a "
                                  f"{x.ndim}-D input")
        return Resize.run(self, x, None, s)


@register("Upsample", since=7)
class Upsample7(_LegacyResize):
    """Upsample-7/8: ``scales`` is an attribute."""

    def run(self, x):  # type: ignore[override]
        return self._scaled(x, [float(v) for v in self.attr("scales", [])])


@register("Upsample", since=9)
class Upsample9(_LegacyResize):
    """Upsample-9: ``scales`` is an input."""

    def run(self, x, scales):  # type: ignore[override]
        return self._scaled(x, scales)


@register("Resize", since=10)
class Resize10(_LegacyResize):
    """Resize-10: Upsample-9's inputs and arithmetic (opset 11 added roi, sizes and the modes)."""

    def run(self, x, scales):  # type: ignore[override]
        return self._scaled(x, scales)


def _cast_back(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An interpolated result in the input's dtype: integers truncated toward zero, as
    onnxruntime's ``static_cast`` does (a QOperator model resizes its uint8 / int8 codes: rounding
    to nearest moved ~half of them by one code), then held to the type's range (a cubic overshoot)."""
    if y.dtype == dtype:
        return y
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.trunc(y), info.min, info.max).astype(dtype)
    return y.astype(dtype)
