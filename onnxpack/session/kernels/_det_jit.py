"""numba kernel for NonMaxSuppression's greedy pass (optional, the ``jit`` extra).

Imported by :class:`onnxpack.session.kernels.detection.NonMaxSuppression` on its first run with
more than a few candidates, only when numba is installed and ``ONNXPACK_DISABLE_JIT`` is not
``1``; the numpy forms in ``detection.py`` select the same boxes (tests run both).  Per pair,
exactly their float32 arithmetic: the intersection's height and width clamped at 0 (NaN
propagating as numpy's minimum and maximum do), its area, the union, and the IoU where both
areas and the union are positive (else 0), compared with the float32 threshold.  One pass over
the candidates instead of a numpy row per kept box: torchvision's 9,000 candidates ~0.35 s in
numpy rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["nms_greedy"]


@njit(cache=True, nogil=True, error_model="numpy")
def nms_greedy(yy1, xx1, yy2, xx2, ar, iou_t, limit, keep):  # pragma: no cover - compiled; tested through NonMaxSuppression
    """Greedy NMS over candidates already ordered by descending score: candidate ``i`` is kept
    unless a kept one suppressed it, and then suppresses every later candidate whose IoU with
    it exceeds ``iou_t``; the kept positions go to ``keep`` (at most ``limit``); returns how
    many."""
    n = yy1.shape[0]
    suppressed = np.zeros(n, np.bool_)
    zero = np.float32(0.0)
    count = 0
    for i in range(n):
        if suppressed[i]:
            continue
        keep[count] = i
        count += 1
        if count >= limit:
            break
        y1, x1, y2, x2, ai = yy1[i], xx1[i], yy2[i], xx2[i], ar[i]
        for j in range(i + 1, n):
            if suppressed[j]:
                continue
            ih = np.maximum(np.minimum(y2, yy2[j]) - np.maximum(y1, yy1[j]), zero)
            iw = np.maximum(np.minimum(x2, xx2[j]) - np.maximum(x1, xx1[j]), zero)
            inter = ih * iw
            aj = ar[j]
            union = ai + aj - inter
            if ai > zero and aj > zero and union > zero and inter / union > iou_t:
                suppressed[j] = True
    return count


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernel only reads.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"yy1", "xx1", "yy2", "xx2", "ar"}))
