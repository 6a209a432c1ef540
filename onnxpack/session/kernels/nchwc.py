"""onnxruntime's NCHWc ops (domain ``com.microsoft.nchwc``), which its *all* graph-optimization
level writes into a float CNN it saves (``SessionOptions.optimized_model_filepath``, whose
default level is *all*): ReorderInput / ReorderOutput around blocked-layout Conv, MaxPool,
AveragePool, GlobalMaxPool, GlobalAveragePool and Upsample (integer scales: a YOLO neck's
nearest Resize).

onnxruntime keeps an NCHWc tensor as (N, C_pad, H, W) whose memory is (N, C_pad / B, H, W, B),
B the CPU's block size (MLAS: 16 with AVX-512, else 8), and saves the Conv weights already
reordered into blocks under their padded plain dims.  Here an NCHWc tensor is a plain (N, C_pad,
H, W) array (padding channels included) -- nothing outside these ops sees it -- and a Conv's
weight is put back in plain order when it is packed:

* ``OIHWBiBo`` -- (O/B, I/B, kh, kw, Bi, Bo) -- for a convolution of an NCHWc input;
* ``OIHWBo`` -- (O/B, I, kh, kw, Bo) -- for a depthwise one and for one reading a plain NCHW
  input whose channel count is not a multiple of B (the model's first convolution).

A model saved on a CPU with another block size reads wrongly in onnxruntime too (the blocks are
the saving CPU's); this module uses this CPU's, as onnxruntime here does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels._base import Kernel, KernelContext, PackSpec, TensorInfo, register
from onnxpack.session.kernels.conv import AveragePool, GlobalAveragePool, MaxPool, OrtFusedConv
from onnxpack.session.kernels.tensor import Resize

__all__ = ["block_size", "unblock_filter"]

NCHWC = "com.microsoft.nchwc"
_BLOCK: int | None = None


def block_size() -> int:
    """MLAS' NCHWc block size on this CPU: 16 with AVX-512F, else 8."""
    global _BLOCK
    if _BLOCK is None:
        flags = ""
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                flags = next((line for line in f if line.startswith("flags")), "")
        except OSError:
            pass
        _BLOCK = 16 if " avx512f" in flags else 8
    return _BLOCK


def unblock_filter(w: np.ndarray, group: int, block: int) -> np.ndarray:
    """A saved NCHWc Conv filter (its padded plain dims, blocked data) in plain OIHW order."""
    o, i, kh, kw = w.shape
    if o % block:
        raise InvalidArgument(f"NCHWc filter of {o} output channels is not a multiple of the block size {block}")
    flat = np.ascontiguousarray(w).reshape(-1)
    if (group > 1 and i == 1) or (group == 1 and i % block):  # depthwise, or a plain NCHW input: OIHWBo
        return flat.reshape(o // block, i, kh, kw, block).transpose(0, 4, 1, 2, 3).reshape(o, i, kh, kw)
    if i % block:
        raise InvalidArgument(f"NCHWc filter of {i} input channels per group is not a multiple of the block size {block}")
    return flat.reshape(o // block, i // block, kh, kw, block, block).transpose(0, 5, 1, 4, 2, 3).reshape(o, i, kh, kw)


@register("ReorderInput", domain=NCHWC, since=1)
class ReorderInput(Kernel):
    """NCHW (or NHWC with ``channels_last``) to an NCHWc tensor: channels padded with zeros to a
    multiple of the block size."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.channels_last = bool(int(self.attr("channels_last", 0)))

    def run(self, x):  # type: ignore[override]
        if x.ndim < 3:
            raise InvalidArgument(f"node {self.node.name!r} (ReorderInput): input must be 3-D or more, got {list(x.shape)}")
        if self.channels_last:
            x = np.moveaxis(x, -1, 1)
        b = block_size()
        pad = -x.shape[1] % b
        if pad:
            x = np.concatenate([x, np.zeros((x.shape[0], pad, *x.shape[2:]), x.dtype)], axis=1)
        return (np.ascontiguousarray(x),)


@register("ReorderOutput", domain=NCHWC, since=1)
class ReorderOutput(Kernel):
    """An NCHWc tensor back to NCHW (or NHWC): its first ``channels`` channels."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.channels = int(self.attr("channels", 0))
        self.channels_last = bool(int(self.attr("channels_last", 0)))

    def run(self, x):  # type: ignore[override]
        if x.ndim < 3 or not 0 < self.channels <= x.shape[1]:
            raise InvalidArgument(f"node {self.node.name!r} (ReorderOutput): {self.channels} channels of a "
                                  f"{list(x.shape)} tensor")
        y = x[:, : self.channels]
        if self.channels_last:
            y = np.moveaxis(y, 1, -1)
        return (np.ascontiguousarray(y),)


@register("Conv", domain=NCHWC, since=1)
class NchwcConv(OrtFusedConv):
    """Conv with the NCHWc filter layout: ``act(Conv(X, W, B) + Sum)`` (``activation``,
    ``activation_params`` as FusedConv); the filter is un-blocked when packed (or per call when
    fed), the bias zero-padded to the padded output channels."""

    op_type = "Conv"
    domain = NCHWC

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        spec = super().pack_spec(input_index, info)
        if spec is None or input_index != 1:
            return spec
        # Other bytes than a plain Conv's for the same weight: its own family, never the weight itself.
        return dataclasses.replace(spec, family="nchwc_" + spec.family,
                                   attrs=spec.attrs + b"|block:%d" % block_size(), identity=False)

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        if input_index == 1:
            weight = unblock_filter(weight, self.group, block_size())
        return super().prepack(input_index, weight)

    def run(self, x, w=None, b=None, z=None):
        if w is not None and not self._packed_weight():
            w = unblock_filter(w, self.group, block_size())
        if b is not None and w is not None and b.shape[0] < w.shape[0]:
            b = np.concatenate([b, np.zeros(w.shape[0] - b.shape[0], b.dtype)])
        return super().run(x, w, b, z)

    def _packed_weight(self) -> bool:
        return getattr(self, "_w", None) is not None


@register("MaxPool", domain=NCHWC, since=1)
class NchwcMaxPool(MaxPool):
    """MaxPool of an NCHWc tensor (per channel: the plain kernel)."""

    domain = NCHWC


@register("AveragePool", domain=NCHWC, since=1)
class NchwcAveragePool(AveragePool):
    """AveragePool of an NCHWc tensor (per channel: the plain kernel)."""

    domain = NCHWC


@register("GlobalAveragePool", domain=NCHWC, since=1)
class NchwcGlobalAveragePool(GlobalAveragePool):
    """GlobalAveragePool of an NCHWc tensor."""

    domain = NCHWC


@register("GlobalMaxPool", domain=NCHWC, since=1)
class NchwcGlobalMaxPool(Kernel):
    """GlobalMaxPool of an NCHWc tensor."""

    def run(self, x):  # type: ignore[override]
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


@register("Upsample", domain=NCHWC, since=1)
class NchwcUpsample(Resize):
    """Upsample of an NCHWc tensor by integer ``scales`` (what a Resize by integer factors
    becomes): ``nearest`` or ``linear`` with its ``coordinate_transformation_mode``, the Resize
    kernel's arithmetic."""

    def __init__(self, node, ctx: KernelContext) -> None:
        Kernel.__init__(self, node, ctx)
        mode = self.attr("mode", "nearest")
        coord = self.attr("coordinate_transformation_mode", "asymmetric")
        self.mode = mode.decode() if isinstance(mode, bytes) else mode
        self.coord = coord.decode() if isinstance(coord, bytes) else coord
        self.scales = [float(v) for v in self.attr("scales", [])]
        if self.mode not in ("nearest", "linear") or self.coord not in ("asymmetric", "half_pixel", "align_corners",
                                                                          "pytorch_half_pixel"):
            raise NotImplementedError(f"NCHWc Upsample mode={self.mode!r} coordinate_transformation_mode={self.coord!r}")
        self.nearest_mode, self.cubic_a, self.exclude_outside, self.policy, self.axes = "floor", -0.75, False, "stretch", None

    def run(self, x):  # type: ignore[override]
        if len(self.scales) != x.ndim:
            raise InvalidArgument(f"node {self.node.name!r} (Upsample): {len(self.scales)} scales for a "
                                  f"{x.ndim}-D input")
        return super().run(x, None, np.array(self.scales, np.float32))
