"""RoiAlign, NonMaxSuppression and MaxRoiPool (kernels/detection.py) against onnxruntime 1.32 (graph
optimizations off).  RoiAlign: float32 rtol 1e-4 / atol 1e-5 (the average is summed as two
small GEMMs, onnxruntime sums sample by sample); max mode follows onnxruntime's rule (the
largest weighted corner of each sample), which it warns differs from its future one.
NonMaxSuppression: the selected indices exactly, ties in score included."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from contrib_util import check_all_paths
from kernel_util import run_native

from onnxpack.errors import InvalidArgument

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 6, 20, 24)).astype(np.float32)
ROIS = RNG.uniform(-3, 20, (12, 4)).astype(np.float32)
ROIS[:, 2:] = ROIS[:, :2] + RNG.uniform(0.2, 15, (12, 2))
BATCH = RNG.integers(0, 2, 12).astype(np.int64)
ROI_CASES = [(o, m, r, s) for o in (10, 16) for m in ("avg", "max") for r in (0, 2) for s in (1.0, 0.5)]


@pytest.mark.parametrize("opset,mode,ratio,scale", ROI_CASES,
                         ids=[f"op{o}-{m}-sr{r}-ss{s}" for o, m, r, s in ROI_CASES])
def test_roi_align_matches_onnxruntime(opset, mode, ratio, scale):
    node = helper.make_node("RoiAlign", ["x", "r", "b"], ["y"], output_height=5, output_width=4,
                            sampling_ratio=ratio, spatial_scale=scale, mode=mode)
    check_all_paths(node, {"x": X, "r": ROIS, "b": BATCH}, {}, dict(rtol=1e-4, atol=1e-5), opset=opset)


def test_roi_align_output_half_pixel_at_opset_16():
    node = helper.make_node("RoiAlign", ["x", "r", "b"], ["y"], output_height=3, output_width=3,
                            coordinate_transformation_mode="output_half_pixel")
    check_all_paths(node, {"x": X, "r": ROIS, "b": BATCH}, {}, dict(rtol=1e-4, atol=1e-5), opset=16)


def test_roi_align_rejects_a_batch_index_out_of_range_and_hostile_rois():
    node = helper.make_node("RoiAlign", ["x", "r", "b"], ["y"])
    with pytest.raises(InvalidArgument, match="batch index out of range"):
        run_native(node, [X, ROIS, np.full(12, 2, np.int64)], 16)
    bad = ROIS.copy()
    bad[3, 2] = np.nan
    with pytest.raises(InvalidArgument, match="rois must be finite"):
        run_native(node, [X, bad, BATCH], 16)
    bad[3, 2] = 1e30  # a sampling grid of ~1e29 per cell: refused, not looped over
    with pytest.raises(InvalidArgument, match="samples per output cell"):
        run_native(node, [X, bad, BATCH], 16)


def _nms_case(seed, center, ties, with_score):
    rng = np.random.default_rng(seed)
    nb = int(rng.integers(5, 120))
    boxes = rng.uniform(0, 100, (2, nb, 4)).astype(np.float32)
    if seed % 2:
        boxes[..., 2:] = boxes[..., :2] + rng.uniform(1, 30, (2, nb, 2))
    scores = rng.random((2, 3, nb)).astype(np.float32)
    if ties:
        scores = np.round(scores * 4) / 4
    consts = {"m": np.array([int(rng.integers(1, 30))], np.int64), "iou": np.array([rng.uniform(0.2, 0.7)], np.float32)}
    if with_score:
        consts["st"] = np.array([rng.uniform(0, 0.6)], np.float32)
    return boxes, scores, consts


NMS_CASES = [(s, c, t, w) for s in (1, 2) for c in (0, 1) for t in (False, True) for w in (False, True)]


@pytest.mark.parametrize("seed,center,ties,with_score", NMS_CASES,
                         ids=[f"s{s}-c{c}-{'ties' if t else 'distinct'}-{'st' if w else 'no-st'}" for s, c, t, w in NMS_CASES])
def test_non_max_suppression_matches_onnxruntime(seed, center, ties, with_score):
    boxes, scores, consts = _nms_case(seed, center, ties, with_score)
    node = helper.make_node("NonMaxSuppression", ["b", "s", *consts], ["y"], center_point_box=center)
    check_all_paths(node, {"b": boxes, "s": scores}, consts, None, opset=11)


def test_non_max_suppression_without_a_limit_selects_nothing():
    boxes, scores, _ = _nms_case(3, 0, False, False)
    node = helper.make_node("NonMaxSuppression", ["b", "s"], ["y"])
    check_all_paths(node, {"b": boxes, "s": scores}, {}, None, opset=11)


@pytest.mark.parametrize("attrs", [dict(pooled_shape=[3, 3]), dict(pooled_shape=[7, 5], spatial_scale=0.5),
                                   dict(pooled_shape=[2, 4], spatial_scale=0.75)], ids=["3x3", "7x5-half", "2x4-0.75"])
def test_max_roi_pool_matches_onnxruntime(attrs):
    """(onnx.reference has no MaxRoiPool.)  ROIs reaching outside the map and inverted ones
    (empty bins: 0) included; exact."""
    rng = np.random.default_rng(9)
    rois = np.concatenate([rng.integers(0, 2, (30, 1)).astype(np.float32), rng.uniform(-4, 26, (30, 4)).astype(np.float32)], 1)
    rois[:, 3:] = rois[:, 1:3] + rng.uniform(-2, 15, (30, 2))
    check_all_paths(helper.make_node("MaxRoiPool", ["x", "r"], ["y"], **attrs), {"x": X, "r": rois}, {}, None, opset=17)


@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("path", ["numba", "rows", "matrix"])
def test_nms_many_candidates_every_form_matches_onnxruntime(path, center, monkeypatch):
    """NonMaxSuppression over many candidates (torchvision's detectors feed it thousands): the
    numba greedy pass, and without numba the greedy pass by one row of IoUs per kept box (used
    beyond _NMS_MATRIX_MAX candidates; here forced) and by the matrix of every pair, select
    onnxruntime's boxes in its order: score ties, zero-area boxes, a score threshold, the
    per-class limit, two batches and classes."""
    import onnxruntime as ort
    from onnx import helper

    import onnxpack
    from onnxpack.session.kernels import _act, detection

    if path == "numba":
        if _act.load_jit("_det_jit", "NonMaxSuppression") is None:
            pytest.skip("numba not installed")
        calls = []
        real = _act.load_jit
        monkeypatch.setattr(_act, "load_jit", lambda *a, **k: calls.append(a) or real(*a, **k))
    else:
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
        monkeypatch.setattr(detection, "_NMS_MATRIX_MAX", 0 if path == "rows" else 2048)
    rng = np.random.default_rng(5 + center)
    n = 1500
    xy = rng.uniform(0, 300, (2, n, 2)).astype(np.float32)
    wh = rng.uniform(0, 40, (2, n, 2)).astype(np.float32)
    wh[:, ::97] = 0  # zero-area boxes
    boxes = np.concatenate([xy, wh], -1) if center else np.concatenate([xy, xy + wh], -1)
    scores = np.round(rng.random((2, 2, n)), 2).astype(np.float32)  # many ties
    F, I = TensorProto.FLOAT, TensorProto.INT64
    for limit, score_t in ((n, None), (200, 0.3)):
        inputs = ["b", "s", "m", "t"] + (["st"] if score_t is not None else [])
        inits = [helper.make_tensor("m", I, [1], [limit]), helper.make_tensor("t", F, [1], [0.3])]
        if score_t is not None:
            inits.append(helper.make_tensor("st", F, [1], [score_t]))
        graph = helper.make_graph(
            [helper.make_node("NonMaxSuppression", inputs, ["y"], center_point_box=center)], "g",
            [helper.make_tensor_value_info("b", F, [2, n, 4]), helper.make_tensor_value_info("s", F, [2, 2, n])],
            [helper.make_tensor_value_info("y", I, None)], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
        feeds = {"b": boxes, "s": scores}
        want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        got = onnxpack.InferenceSession(model).run(None, feeds)[0]
        assert got.shape[0] > 100
        np.testing.assert_array_equal(got, want)
    if path == "numba":
        assert ("_det_jit", "NonMaxSuppression") in calls
