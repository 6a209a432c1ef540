"""Detection heads' ops: RoiAlign (Faster / Mask R-CNN exports), NonMaxSuppression and MaxRoiPool.

Both ran onnx.reference before, a Python loop per output element or per box pair: a 50-box
RoiAlign over a 16-channel 32 x 32 map took 539 ms (onnxruntime: 1 ms).  The arithmetic is
onnxruntime's (its CPU kernels follow Detectron's): checked against it in
``tests/session/test_kernels_detection.py``.
"""

from __future__ import annotations

import math

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, KernelContext, register

__all__: list[str] = []  # kernels are reached through the registry only

_MAX_SAMPLES = 1 << 24  # bilinear samples per ROI (a 7 x 7 output of 2 x 2 grids takes 196)


def _bilinear_axis(coords: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per sample coordinate along one axis: (valid, low index, high index, low weight, high
    weight), Detectron's rules: outside [-1, size] the sample is empty; below 0 it reads 0; at
    or past size - 1 it reads the last row."""
    valid = (coords >= -1.0) & (coords <= size)
    c = np.maximum(coords, 0)
    low = c.astype(np.int64)
    last = low >= size - 1
    low = np.where(last, size - 1, low)
    high = np.where(last, size - 1, low + 1)
    c = np.where(last, low.astype(coords.dtype), c)
    frac = c - low
    return valid, low, high, 1 - frac, frac


@register("RoiAlign", since=10)
class RoiAlign(Kernel):
    """Region-of-interest pooling by bilinear samples: ``avg`` or ``max`` over a regular grid of
    samples per output cell (``sampling_ratio`` per side, or ceil(roi size / output size));
    ``coordinate_transformation_mode`` (opset 16) ``half_pixel`` shifts the ROI by -0.5 and lets
    it be smaller than a pixel, ``output_half_pixel`` (opset 10's behaviour) does neither.  The
    average is separable: one small (oh x H) @ X[c] @ (W x ow) product per ROI."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        default = "half_pixel" if ctx.opset >= 16 else "output_half_pixel"
        coord = self.attr("coordinate_transformation_mode", default)
        coord = coord.decode() if isinstance(coord, bytes) else coord
        mode = self.attr("mode", "avg")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if coord not in ("half_pixel", "output_half_pixel") or mode not in ("avg", "max"):
            raise InvalidArgument(f"node {node.name!r} (RoiAlign): mode {mode!r} / coordinate_transformation_mode "
                                  f"{coord!r} not in avg, max / half_pixel, output_half_pixel")
        self.half_pixel, self.mode = coord == "half_pixel", mode
        self.oh, self.ow = int(self.attr("output_height", 1)), int(self.attr("output_width", 1))
        self.ratio = int(self.attr("sampling_ratio", 0))
        self.scale = float(self.attr("spatial_scale", 1.0))
        if self.oh < 1 or self.ow < 1 or self.ratio < 0:
            raise InvalidArgument(f"node {node.name!r} (RoiAlign): output_height/width must be >= 1 and "
                                  f"sampling_ratio >= 0, got {self.oh}, {self.ow}, {self.ratio}")

    def run(self, x, rois, batch_indices):  # type: ignore[override]
        name = self.node.name
        if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4 or np.ndim(batch_indices) != 1 \
                or batch_indices.shape[0] != rois.shape[0]:
            raise InvalidArgument(f"node {name!r} (RoiAlign): X must be (N, C, H, W), rois (R, 4) and batch_indices "
                                  f"(R,), got {list(x.shape)}, {list(rois.shape)}, {list(np.shape(batch_indices))}")
        n, c, h, w = x.shape
        if not np.all(np.isfinite(rois)):
            raise InvalidArgument(f"node {name!r} (RoiAlign): rois must be finite")
        bidx = np.asarray(batch_indices).astype(np.int64)
        if bidx.size and (bidx.min() < 0 or bidx.max() >= n):
            raise InvalidArgument(f"node {name!r} (RoiAlign): batch index out of range [0, {n}): "
                                  f"{int(bidx.min())}..{int(bidx.max())}")
        cd = np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)
        xf = x.astype(cd, copy=False)
        r = rois.astype(cd, copy=False)
        y = np.zeros((rois.shape[0], c, self.oh, self.ow), cd)
        off = cd.type(0.5 if self.half_pixel else 0.0)
        scale = cd.type(self.scale)
        for k in range(rois.shape[0]):
            x1, y1, x2, y2 = (r[k, i] * scale - off for i in range(4))
            rw, rh = x2 - x1, y2 - y1
            if not self.half_pixel:
                rw, rh = max(rw, cd.type(1)), max(rh, cd.type(1))
            bh, bw = rh / cd.type(self.oh), rw / cd.type(self.ow)
            gh = self.ratio if self.ratio > 0 else int(math.ceil(rh / self.oh))
            gw = self.ratio if self.ratio > 0 else int(math.ceil(rw / self.ow))
            if gh * gw * self.oh * self.ow > _MAX_SAMPLES:  # (a hostile ROI: a grid no feature map needs)
                raise InvalidArgument(f"node {name!r} (RoiAlign): ROI {k} asks for {gh} x {gw} samples per output "
                                      f"cell; at most {_MAX_SAMPLES} samples per ROI")
            count = max(gh * gw, 1)
            ys = y1 + np.arange(self.oh, dtype=cd)[:, None] * bh + (np.arange(gh, dtype=cd)[None, :] + cd.type(0.5)) * bh / cd.type(gh)
            xs = x1 + np.arange(self.ow, dtype=cd)[:, None] * bw + (np.arange(gw, dtype=cd)[None, :] + cd.type(0.5)) * bw / cd.type(gw)
            vy, ly, hy, wly, why = _bilinear_axis(ys.reshape(-1), h)
            vx, lx, hx, wlx, whx = _bilinear_axis(xs.reshape(-1), w)
            img = xf[bidx[k]]
            if self.mode == "avg":
                ay = np.zeros((self.oh * gh, h), cd)
                rows = np.arange(self.oh * gh)
                np.add.at(ay, (rows, ly), np.where(vy, wly, 0))
                np.add.at(ay, (rows, hy), np.where(vy, why, 0))
                ax = np.zeros((self.ow * gw, w), cd)
                cols = np.arange(self.ow * gw)
                np.add.at(ax, (cols, lx), np.where(vx, wlx, 0))
                np.add.at(ax, (cols, hx), np.where(vx, whx, 0))
                ay = ay.reshape(self.oh, gh, h).sum(axis=1)
                ax = ax.reshape(self.ow, gw, w).sum(axis=1)
                y[k] = (ay @ img @ ax.T) / cd.type(count)
            else:  # max over samples of the largest weighted corner (onnxruntime's rule)
                best = None
                for yi, wy in ((ly, wly), (hy, why)):
                    for xi, wx in ((lx, wlx), (hx, whx)):
                        v = img[:, yi[:, None], xi[None, :]] * (wy[:, None] * wx[None, :])
                        best = v if best is None else np.maximum(best, v)
                valid = vy[:, None] & vx[None, :]
                best = np.where(valid, best, 0).reshape(c, self.oh, gh, self.ow, gw)
                y[k] = best.max(axis=(2, 4))
        return (y.astype(x.dtype, copy=False),)


@register("NonMaxSuppression", since=10)
class NonMaxSuppression(Kernel):
    """Greedy non-maximum suppression per (batch, class): boxes by descending score (ties in box
    order), kept while their IoU with every kept box is at most ``iou_threshold`` and their
    score above ``score_threshold``, at most ``max_output_boxes_per_class`` each; output
    (batch, class, box) rows as int64.  ``center_point_box=1`` reads [x_center, y_center, w, h].
    A class's greedy pass runs in numba from 64 candidates (``_det_jit``), else in numpy: the
    IoU matrix of every pair up to ``_NMS_MATRIX_MAX`` candidates, beyond it one row of IoUs per
    kept box over the candidates still in play (:func:`_ious` for both)."""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.center = int(self.attr("center_point_box", 0))

    def run(self, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,  # type: ignore[override]
            score_threshold=None):
        name = self.node.name
        if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or scores.shape[0] != boxes.shape[0] \
                or scores.shape[2] != boxes.shape[1]:
            raise InvalidArgument(f"node {name!r} (NonMaxSuppression): boxes must be (N, B, 4) and scores (N, C, B), "
                                  f"got {list(boxes.shape)} and {list(scores.shape)}")
        limit = 0 if max_output_boxes_per_class is None or np.size(max_output_boxes_per_class) == 0 \
            else int(np.asarray(max_output_boxes_per_class).reshape(-1)[0])
        iou_t = 0.0 if iou_threshold is None or np.size(iou_threshold) == 0 \
            else float(np.asarray(iou_threshold).reshape(-1)[0])
        score_t = None if score_threshold is None or np.size(score_threshold) == 0 \
            else float(np.asarray(score_threshold).reshape(-1)[0])
        out: list[tuple[int, int, int]] = []
        if limit <= 0:
            return (np.zeros((0, 3), np.int64),)
        b = boxes.astype(np.float32, copy=False)
        if self.center:
            cx, cy, bw, bh = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
            y1, y2 = cy - bh / 2, cy + bh / 2
            x1, x2 = cx - bw / 2, cx + bw / 2
        else:  # [y1, x1, y2, x2], either corner first
            y1 = np.minimum(b[..., 0], b[..., 2])
            y2 = np.maximum(b[..., 0], b[..., 2])
            x1 = np.minimum(b[..., 1], b[..., 3])
            x2 = np.maximum(b[..., 1], b[..., 3])
        area = (y2 - y1) * (x2 - x1)
        for bi in range(boxes.shape[0]):
            for ci in range(scores.shape[1]):
                s = scores[bi, ci].astype(np.float32, copy=False)
                cand = np.nonzero(s > score_t)[0] if score_t is not None else np.arange(s.size)
                if cand.size == 0:
                    continue
                order = cand[np.argsort(-s[cand], kind="stable")]
                yy1, xx1, yy2, xx2, ar = y1[bi, order], x1[bi, order], y2[bi, order], x2[bi, order], area[bi, order]
                jit = _act.load_jit("_det_jit", "NonMaxSuppression") if order.size >= _NMS_JIT_MIN else None
                if jit is not None:
                    keep = np.empty(min(order.size, limit), np.int64)
                    count = jit.nms_greedy(*(np.ascontiguousarray(v) for v in (yy1, xx1, yy2, xx2, ar)),
                                           np.float32(iou_t), limit, keep)
                    out.extend((bi, ci, int(k)) for k in order[keep[:count]])
                    continue
                boxes_c = (yy1, xx1, yy2, xx2, ar)
                if order.size <= _NMS_MATRIX_MAX:
                    out.extend(_nms_matrix(boxes_c, order, iou_t, limit, bi, ci))
                    continue
                # Greedy: the best remaining box is kept and suppresses the remaining boxes whose
                # IoU with it exceeds the threshold; one row of IoUs per kept box, over the boxes
                # still in play (the matrix of every pair took 0.8 s and GBs for torchvision's
                # 9,000 candidates, this 0.34 s; onnxruntime 50 ms).
                rest = np.arange(order.size)
                kept = 0
                while rest.size:
                    i = rest[0]
                    out.append((bi, ci, int(order[i])))
                    kept += 1
                    if kept >= limit:
                        break
                    rest = rest[1:]
                    rest = rest[~(_ious(boxes_c, i, rest) > iou_t)]
        return (np.array(out, np.int64).reshape(-1, 3),)


_NMS_MATRIX_MAX = 2048  # candidates up to which a class's IoUs are one matrix (below: ~25 us a kept box)
_NMS_JIT_MIN = 64  # candidates from which the numba pass runs (_det_jit), when it can


def _ious(boxes, i, j) -> np.ndarray:
    """IoUs of candidates ``i`` and ``j`` (indices, broadcast against each other) of one (batch,
    class): ``boxes`` = (y1, x1, y2, x2, area) by candidate; 0 where an area or the union is not
    positive (the numba pass, ``_det_jit.nms_greedy``, computes the same per pair)."""
    yy1, xx1, yy2, xx2, ar = boxes
    ih = np.maximum(np.minimum(yy2[i], yy2[j]) - np.maximum(yy1[i], yy1[j]), 0)
    iw = np.maximum(np.minimum(xx2[i], xx2[j]) - np.maximum(xx1[i], xx1[j]), 0)
    inter = ih * iw
    ai, aj = ar[i], ar[j]
    union = ai + aj - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((ai > 0) & (aj > 0) & (union > 0), inter / union, 0)


def _nms_matrix(boxes, order, iou_t, limit, bi, ci) -> list[tuple[int, int, int]]:
    """NonMaxSuppression's greedy pass for one (batch, class) over the IoU matrix of every pair of
    its candidates (``order``: by descending score)."""
    idx = np.arange(order.size)
    iou = _ious(boxes, idx[:, None], idx[None, :])
    suppressed = np.zeros(order.size, bool)
    out = []
    for i in range(order.size):
        if suppressed[i]:
            continue
        out.append((bi, ci, int(order[i])))
        if len(out) >= limit:
            break
        suppressed |= iou[i] > iou_t
    return out


@register("MaxRoiPool", since=1)
class MaxRoiPool(Kernel):
    """Fast R-CNN's ROI max pooling: each ROI ([batch, x1, y1, x2, y2] times ``spatial_scale``,
    rounded half away from zero, inclusive ends) cut into ``pooled_shape`` bins of
    floor / ceil bounds, each bin's maximum (0 for an empty bin), as onnxruntime's kernel.
    (onnx.reference has none: it failed.)"""

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        shape = self.attr("pooled_shape")
        if shape is None or len(shape) != 2 or min(int(v) for v in shape) < 1:
            raise InvalidArgument(f"node {node.name!r} (MaxRoiPool): pooled_shape must be 2 positive values, got {shape}")
        self.ph, self.pw = (int(v) for v in shape)
        self.scale = float(self.attr("spatial_scale", 1.0))

    def run(self, x, rois):  # type: ignore[override]
        name = self.node.name
        if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 5:
            raise InvalidArgument(f"node {name!r} (MaxRoiPool): X must be (N, C, H, W) and rois (R, 5), got "
                                  f"{list(x.shape)} and {list(rois.shape)}")
        n, c, h, w = x.shape
        if not np.all(np.isfinite(rois)):
            raise InvalidArgument(f"node {name!r} (MaxRoiPool): rois must be finite")
        y = np.zeros((rois.shape[0], c, self.ph, self.pw), x.dtype)

        def rnd(v: float) -> int:  # C's round: half away from zero
            return int(math.floor(v + 0.5)) if v >= 0 else -int(math.floor(-v + 0.5))

        for k, roi in enumerate(np.asarray(rois, np.float64)):
            b = int(roi[0])
            if not 0 <= b < n:
                raise InvalidArgument(f"node {name!r} (MaxRoiPool): ROI {k}'s batch index {b} is outside [0, {n})")
            x1, y1, x2, y2 = (rnd(float(np.float32(v) * np.float32(self.scale))) for v in roi[1:])
            rh, rw = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
            bh, bw = np.float32(rh) / np.float32(self.ph), np.float32(rw) / np.float32(self.pw)
            for i in range(self.ph):
                hs = min(max(int(math.floor(i * bh)) + y1, 0), h)
                he = min(max(int(math.ceil((i + 1) * bh)) + y1, 0), h)
                for j in range(self.pw):
                    ws = min(max(int(math.floor(j * bw)) + x1, 0), w)
                    we = min(max(int(math.ceil((j + 1) * bw)) + x1, 0), w)
                    if he > hs and we > ws:
                        y[k, :, i, j] = x[b, :, hs:he, ws:we].max(axis=(1, 2))
        return (y,)
