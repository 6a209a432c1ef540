"""The ops ONNX removed (experimental in opsets 1-8) that onnxruntime still runs, and
MeanVarianceNormalization from opset 9, against onnxruntime 1.32 (graph optimizations off).

Tolerance: float32 rtol 1e-5 / atol 1e-6 (elementwise formulas; onnxruntime's tanh, exp and log
are vectorized approximations a few ulps from numpy's; the normalization's sums run in another
order).  Shapes, crops and slices are exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from contrib_util import check_all_paths
from kernel_util import run_native

from onnxpack.errors import InvalidArgument

TOL = dict(rtol=1e-5, atol=1e-6)
OPSET = 7


def _x(shape=(2, 3, 6, 7), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3


ELEMENTWISE = [
    ("ImageScaler", dict(scale=0.017, bias=[-2.1, -1.5, 0.4])),
    ("ImageScaler", dict(bias=[1.0, 2.0, 3.0])),  # scale defaults to 1
    ("Affine", dict(alpha=2.5, beta=-0.75)),
    ("Scale", dict(scale=-3.0)),
    ("ScaledTanh", dict(alpha=1.7, beta=0.66)),
    ("ParametricSoftplus", dict(alpha=0.8, beta=2.5)),
    ("ThresholdedRelu", dict(alpha=0.4)),
    ("ThresholdedRelu", {}),  # alpha defaults to 1
]


@pytest.mark.parametrize("op,attrs", ELEMENTWISE, ids=[f"{op}-{i}" for i, (op, _) in enumerate(ELEMENTWISE)])
def test_elementwise_legacy_ops_match_onnxruntime(op, attrs):
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    check_all_paths(node, {"x": _x()}, {}, TOL, opset=OPSET)


def test_parametric_softplus_does_not_overflow():
    x = np.array([[-500.0, -30.0, 0.0, 30.0, 500.0]], np.float32)
    node = helper.make_node("ParametricSoftplus", ["x"], ["y"], alpha=2.0, beta=3.0)
    (y,) = run_native(node, [x], OPSET)
    np.testing.assert_allclose(y, 2.0 * np.logaddexp(0.0, 3.0 * x.astype(np.float64)), rtol=1e-6)


@pytest.mark.parametrize("attrs", [dict(border=[1, 2, 3, 0]), dict(border=[1, 2, 0, 0], scale=[3, 4]),
                                   dict(border=[0, 0, 0, 0])], ids=["borders", "scale", "none"])
def test_crop_matches_onnxruntime(attrs):
    check_all_paths(helper.make_node("Crop", ["x"], ["y"], **attrs), {"x": _x()}, {}, None, opset=OPSET)


def test_crop_rejects_borders_that_do_not_fit():
    node = helper.make_node("Crop", ["x"], ["y"], border=[4, 0, 4, 0])
    with pytest.raises(InvalidArgument, match="do not fit"):
        run_native(node, [_x()], OPSET)


@pytest.mark.parametrize("with_axes", [False, True], ids=["no-axes", "axes"])
def test_dynamic_slice_matches_onnxruntime(with_axes):
    consts = {"starts": np.array([1, -5], np.int64), "ends": np.array([3, 100], np.int64)}
    ins = ["x", "starts", "ends"]
    if with_axes:
        consts["axes"] = np.array([1, 3], np.int64)
        ins.append("axes")
    check_all_paths(helper.make_node("DynamicSlice", ins, ["y"]), {"x": _x()}, consts, None, opset=OPSET)


@pytest.mark.parametrize("across", [0, 1], ids=["per-channel", "across-channels"])
@pytest.mark.parametrize("variance", [0, 1], ids=["mean-only", "variance"])
def test_mean_variance_normalization_1_matches_onnxruntime(across, variance):
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"], across_channels=across,
                            normalize_variance=variance)
    check_all_paths(node, {"x": _x() + 5}, {}, TOL, opset=OPSET)


@pytest.mark.parametrize("opset", [9, 13])
@pytest.mark.parametrize("axes", [None, [1], [2, 3], [0, 1, 2, 3], [-1, 3]], ids=["default", "c", "hw", "all", "dup"])
def test_mean_variance_normalization_9_matches_onnxruntime(axes, opset):
    attrs = {} if axes is None else dict(axes=axes)
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"], **attrs)
    check_all_paths(node, {"x": _x() + 5}, {}, TOL, opset=opset)
