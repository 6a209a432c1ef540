"""com.microsoft's copies of standard tensor ops, which onnxruntime registered before ONNX had
them (or with other defaults) and older exports and converters still write: ExpandDims, Range,
Pad, Trilu, GatherND and Unique.  Each is the standard kernel with the contrib op's input
conventions; ``Unique`` keeps first-occurrence order (ONNX's sorts by default)."""

from __future__ import annotations

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels._base import Kernel, register
from onnxpack.session.kernels.tensor import GatherND, Pad11, Range, Trilu, Unsqueeze13

__all__: list[str] = []  # kernels are reached through the registry only

MS = "com.microsoft"


@register("ExpandDims", domain=MS, since=1)
class ExpandDims(Unsqueeze13):
    """Unsqueeze at one axis given as an int32 scalar input (negative counts from the output's end)."""

    def run(self, x, axis):  # type: ignore[override]
        a = np.asarray(axis)
        if a.size != 1:
            raise InvalidArgument(f"node {self.node.name!r} (ExpandDims): axis must be a scalar, got {list(a.shape)}")
        return super().run(x, a.reshape(1).astype(np.int64))


@register("Range", domain=MS, since=1)
class MsRange(Range):
    """ONNX's Range with ``delta`` optional (1)."""

    def run(self, start, limit, delta=None):  # type: ignore[override]
        if delta is None:
            delta = np.ones((), np.asarray(start).dtype)
        return super().run(start, limit, delta)


@register("Pad", domain=MS, since=1)
class MsPad(Pad11):
    """Pad-11 whose ``pads`` may also be (1, 2 * rank)."""

    def run(self, x, pads, value=None):  # type: ignore[override]
        return super().run(x, np.asarray(pads).reshape(-1), value)


@register("Trilu", domain=MS, since=1)
class MsTrilu(Trilu):
    """ONNX's Trilu (onnxruntime's contrib copy from before opset 14)."""


@register("GatherND", domain=MS, since=1)
class MsGatherND(GatherND):
    """ONNX's GatherND-11 (no batch dims), int32 or int64 indices."""

    def run(self, data, indices):  # type: ignore[override]
        return super().run(data, np.asarray(indices).astype(np.int64, copy=False))


@register("Unique", domain=MS, since=1)
class MsUnique(Kernel):
    """1-D ``Unique``: the distinct values in order of first occurrence, each input's index into
    them (int64) and each value's count (int64)."""

    def run(self, x):  # type: ignore[override]
        if x.ndim != 1:
            raise InvalidArgument(f"node {self.node.name!r} (Unique): input must be 1-D, got {list(x.shape)}")
        _, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True)
        order = np.argsort(first, kind="stable")  # sorted position -> first-occurrence rank
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        return (x[first[order]], rank[inverse.reshape(-1)].astype(np.int64), counts[order].astype(np.int64))
