"""Ops that ONNX removed from the standard (its "experimental" ops of opsets 1-8) but onnxruntime
still runs, so old exports that use them still load: the model zoo's Tiny YOLOv2 (opsets 7-8)
scales its input with ``ImageScaler``, Caffe2 and early converters wrote ``Affine``, ``Crop``,
``Scale``, ``ScaledTanh``, ``ParametricSoftplus``, ``DynamicSlice`` and the first
``MeanVarianceNormalization``.  onnx has no schema for them and ``onnx.reference`` no kernel;
the semantics here are onnxruntime's (checked against it in ``tests/session/test_kernels_legacy.py``).
Float computations stay in the input's float type, one numpy operation per step.
"""

from __future__ import annotations

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels._base import Kernel, KernelContext, register
from onnxpack.session.kernels.norm import normalize_mean_variance
from onnxpack.session.kernels.tensor import Slice10

__all__ = ["ImageScaler", "Affine", "Scale", "ScaledTanh", "ParametricSoftplus", "Crop", "DynamicSlice",
           "MeanVarianceNormalization1"]


def _float_input(kernel: Kernel, x: np.ndarray) -> None:
    if x.dtype.kind != "f":
        raise InvalidArgument(f"node {kernel.node.name!r} ({kernel.node.op_type}): input must be float, got {x.dtype}")


@register("ImageScaler", since=1)
class ImageScaler(Kernel):
    """``y = x * scale + bias[c]`` for an (N, C, ...) image, one bias per channel."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.scale = float(self.attr("scale", 1.0))
        self.bias = [float(b) for b in self.attr("bias", [])]

    def run(self, x):  # type: ignore[override]
        _float_input(self, x)
        if x.ndim < 2 or len(self.bias) != x.shape[1]:
            raise InvalidArgument(f"node {self.node.name!r} (ImageScaler): bias has {len(self.bias)} values, the "
                                  f"input {list(x.shape)} has {x.shape[1] if x.ndim > 1 else 'no'} channels")
        y = x * x.dtype.type(self.scale)
        y += np.asarray(self.bias, x.dtype).reshape((1, -1) + (1,) * (x.ndim - 2))
        return (y,)


class _AlphaBeta(Kernel):
    """An elementwise op of attributes ``alpha`` and ``beta`` (defaults per class)."""

    defaults = (1.0, 1.0)

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", self.defaults[0]))
        self.beta = float(self.attr("beta", self.defaults[1]))


@register("Affine", since=1)
class Affine(_AlphaBeta):
    """``y = alpha * x + beta``."""

    defaults = (1.0, 0.0)

    def run(self, x):  # type: ignore[override]
        _float_input(self, x)
        y = x * x.dtype.type(self.alpha)
        y += x.dtype.type(self.beta)
        return (y,)


@register("Scale", since=1)
class Scale(Kernel):
    """``y = scale * x``."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.scale = float(self.attr("scale", 1.0))

    def run(self, x):  # type: ignore[override]
        _float_input(self, x)
        return (x * x.dtype.type(self.scale),)


@register("ScaledTanh", since=1)
class ScaledTanh(_AlphaBeta):
    """``y = alpha * tanh(beta * x)``."""

    def run(self, x):  # type: ignore[override]
        _float_input(self, x)
        y = np.tanh(x * x.dtype.type(self.beta))
        y *= x.dtype.type(self.alpha)
        return (y,)


@register("ParametricSoftplus", since=1)
class ParametricSoftplus(_AlphaBeta):
    """``y = alpha * log(1 + exp(beta * x))``, as ``max(bx, 0) + log1p(exp(-|bx|))`` (no overflow)."""

    def run(self, x):  # type: ignore[override]
        _float_input(self, x)
        bx = x * x.dtype.type(self.beta)
        y = np.log1p(np.exp(-np.abs(bx)))
        y += np.maximum(bx, 0)
        y *= x.dtype.type(self.alpha)
        return (y,)


@register("Crop", since=1)
class Crop(Kernel):
    """Crop an (N, C, H, W) image: ``border`` = [left, top, right, bottom]; with ``scale`` = [h, w]
    the output is h x w from (top, left), else what the borders leave."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.border = [int(v) for v in self.attr("border", [])]
        self.scale = [int(v) for v in self.attr("scale", [])]
        if len(self.border) != 4 or min(self.border) < 0 or self.scale and (len(self.scale) != 2 or min(self.scale) < 0):
            raise InvalidArgument(f"node {node.name!r} (Crop): border must be 4 non-negative values and scale 2 "
                                  f"(or none), got border={self.border} scale={self.scale}")

    def run(self, x):  # type: ignore[override]
        if x.ndim != 4:
            raise InvalidArgument(f"node {self.node.name!r} (Crop): input must be (N, C, H, W), got {list(x.shape)}")
        left, top, right, bottom = self.border
        h, w = x.shape[2:]
        if self.scale:
            bottom_end, right_end = top + self.scale[0], left + self.scale[1]
        else:
            bottom_end, right_end = h - bottom, w - right
        if top > bottom_end or left > right_end or bottom_end > h or right_end > w:
            raise InvalidArgument(f"node {self.node.name!r} (Crop): border={self.border} scale={self.scale} do not "
                                  f"fit an image of {h} x {w}")
        return (np.ascontiguousarray(x[:, :, top:bottom_end, left:right_end]),)


@register("DynamicSlice", since=1)
class DynamicSlice(Slice10):
    """Slice-10 before it had steps: data, starts, ends, optional axes."""

    def run(self, x, starts, ends, axes=None):  # type: ignore[override]
        return super().run(x, starts, ends, axes)


@register("MeanVarianceNormalization", since=1)
class MeanVarianceNormalization1(Kernel):
    """The first MeanVarianceNormalization (opsets 1-8; :class:`.norm.MeanVarianceNormalization`
    from 9) as onnxruntime computes it: statistics over the batch and the spatial axes, and the
    channels too with ``across_channels=1`` (the batch included, as onnxruntime's kernel does);
    ``x - mean``, divided by ``sqrt(mean((x - mean)^2))`` with ``normalize_variance`` (no
    epsilon)."""

    op_type = "MeanVarianceNormalization"

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.across_channels = bool(int(self.attr("across_channels", 0)))
        self.normalize_variance = bool(int(self.attr("normalize_variance", 1)))

    def run(self, x):  # type: ignore[override]
        _float_input(self, x)
        if x.ndim < 2:
            raise InvalidArgument(f"node {self.node.name!r} (MeanVarianceNormalization): input must be (N, C, ...), "
                                  f"got {list(x.shape)}")
        axes = (0, *range(1 if self.across_channels else 2, x.ndim))
        return (normalize_mean_variance(x, axes, self.normalize_variance),)
