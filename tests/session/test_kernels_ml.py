"""ai.onnx.ml models as sklearn-onnx writes them, against onnxruntime.

Native kernels (kernels/ml.py): ZipMap, LinearClassifier, Normalizer; through onnx.reference:
TreeEnsembleClassifier/Regressor, LinearRegressor, Scaler — compared here because sklearn
pipelines end in them.  Tolerance: float32 scores rtol 1e-5 / atol 1e-6 (one GEMM or one sum of
leaf weights in float32 on either side); labels and map keys exactly.  Both the prepacked and
the unpacked paths are the same here (no ml kernel packs), and a session with
``session.disable_prepacking`` is run for the end-to-end model.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.datasets import get_example

import onnxpack
from onnxpack.errors import InvalidGraph, RuntimeFailure

F = TensorProto.FLOAT
ML = "ai.onnx.ml"
TOL = dict(rtol=1e-5, atol=1e-6)


def _model(node, inputs, outputs, ml_opset=1) -> bytes:
    m = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, ml_opset)])
    m.ir_version = 8
    return m.SerializeToString()


def _seq_map(name, key_type):
    return helper.make_value_info(name, helper.make_sequence_type_proto(
        helper.make_map_type_proto(key_type, helper.make_tensor_type_proto(F, None))))


def _ort(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _compare(model, feeds, *, config=None, defined=None):
    """Runs both; ``defined(output_index, array)`` selects the part of an output onnxruntime defines."""
    want = _ort(model).run(None, feeds)
    so = onnxpack.SessionOptions()
    for k, v in (config or {}).items():
        so.add_session_config_entry(k, v)
    got = onnxpack.InferenceSession(model, so).run(None, feeds)
    assert len(got) == len(want)
    if defined is not None:
        got = [defined(k, g) for k, g in enumerate(got)]
        want = [defined(k, w) for k, w in enumerate(want)]
    for g, w in zip(got, want):
        if isinstance(w, list):
            assert isinstance(g, list) and len(g) == len(w)
            for gd, wd in zip(g, w):
                assert list(gd) == list(wd)  # same keys, same order
                assert all(type(v) is float for v in gd.values())
                np.testing.assert_allclose(list(gd.values()), list(wd.values()), **TOL)
        else:
            assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
            if w.dtype == object:
                assert g.tolist() == w.tolist()
            else:
                np.testing.assert_allclose(g, w, **TOL)
    return got


RNG = np.random.default_rng(7)
X4 = RNG.standard_normal((6, 4)).astype(np.float32)


@pytest.mark.parametrize("labels,key_type", [
    (dict(classlabels_int64s=[3, 1, 4, 7]), TensorProto.INT64),
    (dict(classlabels_strings=["setosa", "b", "c", "d"]), TensorProto.STRING),
], ids=["int64-keys", "string-keys"])
@pytest.mark.parametrize("shape", [(6, 4), (4,)], ids=["2d", "1d"])
def test_zipmap(labels, key_type, shape):
    node = helper.make_node("ZipMap", ["x"], ["y"], domain=ML, **labels)
    model = _model(node, [helper.make_tensor_value_info("x", F, list(shape))], [_seq_map("y", key_type)])
    _compare(model, {"x": X4.reshape(-1)[: int(np.prod(shape))].reshape(shape)})


def test_zipmap_errors_as_onnxruntime():
    node = helper.make_node("ZipMap", ["x"], ["y"], domain=ML, classlabels_int64s=[1, 2, 3])
    model = _model(node, [helper.make_tensor_value_info("x", F, [None, None])], [_seq_map("y", TensorProto.INT64)])
    with pytest.raises(Exception, match="features_per_batch"):
        _ort(model).run(None, {"x": X4})
    with pytest.raises(RuntimeFailure, match=r"features_per_batch\[4\] != number of classlabels\[3\]"):
        onnxpack.InferenceSession(model).run(None, {"x": X4})
    both = helper.make_node("ZipMap", ["x"], ["y"], domain=ML, classlabels_int64s=[1], classlabels_strings=["a"])
    bad = _model(both, [helper.make_tensor_value_info("x", F, [None, 1])], [_seq_map("y", TensorProto.INT64)])
    with pytest.raises(Exception):
        _ort(bad)
    with pytest.raises(InvalidGraph, match="but not both"):
        onnxpack.InferenceSession(bad)


POSTS = ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"]


@pytest.mark.parametrize("post", POSTS)
@pytest.mark.parametrize("classes,labels", [
    (3, dict(classlabels_ints=[0, 1, 2])),
    (3, dict(classlabels_strings=["a", "b", "c"])),
    (1, dict(classlabels_ints=[5, 9])),
    (1, dict(classlabels_strings=["no", "yes"])),
    (1, dict()),
], ids=["3-ints", "3-strings", "binary-ints", "binary-strings", "one-class"])
def test_linear_classifier(post, classes, labels):
    if post == "PROBIT":
        x = np.clip(X4 * 0.05, -0.09, 0.09)  # PROBIT of a score outside (0, 1) is NaN on both sides
        coef = list(np.full(classes * 4, 0.1))
        intercepts = [0.3 + 0.1 * k for k in range(classes)]
    else:
        x = X4
        coef = list(RNG.standard_normal(classes * 4))
        intercepts = list(RNG.standard_normal(classes))
    label_type = TensorProto.STRING if "classlabels_strings" in labels else TensorProto.INT64
    node = helper.make_node("LinearClassifier", ["x"], ["label", "scores"], domain=ML, coefficients=coef,
                            intercepts=intercepts, post_transform=post, **labels)
    model = _model(node, [helper.make_tensor_value_info("x", F, [None, 4])],
                   [helper.make_tensor_value_info("label", label_type, None),
                    helper.make_tensor_value_info("scores", F, None)])
    defined = None
    if post == "PROBIT" and classes == 1 and labels:
        # onnxruntime writes the n probits at the start of the [n, 2] scores and leaves the rest
        # uninitialized (we write zeros there): only the first n values are defined.
        defined = lambda k, a: a.reshape(-1)[: a.shape[0]] if k == 1 else a  # noqa: E731
    _compare(model, {"x": x}, defined=defined)


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.int32], ids=["double", "int64", "int32"])
def test_linear_classifier_input_types(dtype):
    node = helper.make_node("LinearClassifier", ["x"], ["label", "scores"], domain=ML,
                            coefficients=list(RNG.standard_normal(8)), intercepts=[0.1, -0.2],
                            classlabels_ints=[0, 1], post_transform="SOFTMAX")
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = _model(node, [helper.make_tensor_value_info("x", elem, [None, 4])],
                   [helper.make_tensor_value_info("label", TensorProto.INT64, None),
                    helper.make_tensor_value_info("scores", F, None)])
    _compare(model, {"x": (X4 * 10).astype(dtype)})


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64], ids=["float", "double", "int64"])
def test_normalizer(norm, dtype):
    node = helper.make_node("Normalizer", ["x"], ["y"], domain=ML, norm=norm)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = _model(node, [helper.make_tensor_value_info("x", elem, [None, 4])], [helper.make_tensor_value_info("y", F, None)])
    x = (X4 * 10).astype(dtype)
    x[2] = 0  # a zero row is copied unchanged
    _compare(model, {"x": x})


def test_logreg_iris_from_onnxruntime_datasets():
    """onnxruntime.datasets' sklearn-onnx model: LinearClassifier -> Normalizer -> ZipMap, with a
    declared input of [3, 2] (its coefficients are for 4 features: onnxruntime reads them as rows of
    the input's width, and so do we)."""
    path = get_example("logreg_iris.onnx")
    x = np.array([[5.1, 3.5], [6.2, 2.9], [1.0, 2.0]], np.float32)
    ours = onnxpack.InferenceSession(path)
    theirs = _ort(path)
    assert [(o.name, o.type, o.shape) for o in ours.get_outputs()] == [(o.name, o.type, o.shape) for o in theirs.get_outputs()]
    got = _compare(path, {"float_input": x})
    assert got[0].tolist() == [0, 0, 0]
    _compare(path, {"float_input": x}, config={"session.disable_prepacking": "1"})


def _forest(rng, n_trees, depth, n_features, n_targets, classifier):
    """Random complete trees as sklearn-onnx writes them (BRANCH_LEQ, one leaf weight per target)."""
    attrs = {k: [] for k in ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_values", "nodes_modes",
                             "nodes_truenodeids", "nodes_falsenodeids", "nodes_hitrates",
                             "nodes_missing_value_tracks_true")}
    prefix = "class" if classifier else "target"
    leaves = {f"{prefix}_treeids": [], f"{prefix}_nodeids": [], f"{prefix}_ids": [], f"{prefix}_weights": []}
    for t in range(n_trees):
        n_nodes = 2 ** (depth + 1) - 1
        for node in range(n_nodes):
            leaf = node >= 2 ** depth - 1
            attrs["nodes_treeids"].append(t)
            attrs["nodes_nodeids"].append(node)
            attrs["nodes_featureids"].append(0 if leaf else int(rng.integers(n_features)))
            attrs["nodes_values"].append(0.0 if leaf else float(rng.standard_normal()))
            attrs["nodes_modes"].append("LEAF" if leaf else "BRANCH_LEQ")
            attrs["nodes_truenodeids"].append(0 if leaf else 2 * node + 1)
            attrs["nodes_falsenodeids"].append(0 if leaf else 2 * node + 2)
            attrs["nodes_hitrates"].append(1.0)
            attrs["nodes_missing_value_tracks_true"].append(0)
            if leaf:
                for k in range(n_targets):
                    leaves[f"{prefix}_treeids"].append(t)
                    leaves[f"{prefix}_nodeids"].append(node)
                    leaves[f"{prefix}_ids"].append(k)
                    leaves[f"{prefix}_weights"].append(float(rng.random() if classifier else rng.standard_normal()))
    return {**attrs, **leaves}


@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "LOGISTIC"])
@pytest.mark.parametrize("n_classes", [3, 2], ids=["3-classes", "2-classes"])
def test_tree_ensemble_classifier(post, n_classes):
    rng = np.random.default_rng(n_classes)
    attrs = _forest(rng, n_trees=5, depth=3, n_features=4, n_targets=n_classes, classifier=True)
    node = helper.make_node("TreeEnsembleClassifier", ["x"], ["label", "probabilities"], domain=ML,
                            classlabels_int64s=list(range(n_classes)), post_transform=post, **attrs)
    zip_node = helper.make_node("ZipMap", ["probabilities"], ["output_probability"], domain=ML,
                                classlabels_int64s=list(range(n_classes)))
    m = helper.make_model(helper.make_graph(
        [node, zip_node], "forest", [helper.make_tensor_value_info("x", F, [None, 4])],
        [helper.make_tensor_value_info("label", TensorProto.INT64, [None]), _seq_map("output_probability", TensorProto.INT64)]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])
    m.ir_version = 8
    _compare(m.SerializeToString(), {"x": RNG.standard_normal((16, 4)).astype(np.float32)})


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_tree_ensemble_regressor(aggregate):
    attrs = _forest(np.random.default_rng(11), n_trees=4, depth=3, n_features=4, n_targets=2, classifier=False)
    node = helper.make_node("TreeEnsembleRegressor", ["x"], ["y"], domain=ML, n_targets=2, aggregate_function=aggregate,
                            base_values=[0.5, -0.5], **attrs)
    model = _model(node, [helper.make_tensor_value_info("x", F, [None, 4])], [helper.make_tensor_value_info("y", F, None)])
    _compare(model, {"x": RNG.standard_normal((16, 4)).astype(np.float32)})


def test_scaler_and_linear_regressor():
    scaler = helper.make_node("Scaler", ["x"], ["y"], domain=ML, offset=[0.1, 0.2, 0.3, 0.4], scale=[2.0, 3.0, 4.0, 5.0])
    _compare(_model(scaler, [helper.make_tensor_value_info("x", F, [None, 4])], [helper.make_tensor_value_info("y", F, None)]),
             {"x": X4})
    reg = helper.make_node("LinearRegressor", ["x"], ["y"], domain=ML, coefficients=list(RNG.standard_normal(8)),
                           intercepts=[0.5, -0.5], targets=2)
    _compare(_model(reg, [helper.make_tensor_value_info("x", F, [None, 4])], [helper.make_tensor_value_info("y", F, None)]),
             {"x": X4})


@pytest.mark.parametrize("labels", [dict(classlabels_int64s=[5, 9]), dict(classlabels_strings=["no", "yes"])],
                         ids=["int64-5-9", "strings"])
@pytest.mark.parametrize("weighted_classes", [1, 2], ids=["one-class-weighted", "both-weighted"])
def test_tree_ensemble_binary_labels(labels, weighted_classes):
    """Two classes: onnxruntime's label rules (with both classes weighted and int labels it answers
    1/0 themselves, not the class labels — and so do we)."""
    attrs = _forest(np.random.default_rng(5), n_trees=3, depth=2, n_features=4, n_targets=weighted_classes,
                    classifier=True)
    if weighted_classes == 1:
        attrs["class_ids"] = [1] * len(attrs["class_ids"])
    label_type = TensorProto.STRING if "classlabels_strings" in labels else TensorProto.INT64
    node = helper.make_node("TreeEnsembleClassifier", ["x"], ["label", "p"], domain=ML, **labels, **attrs)
    model = _model(node, [helper.make_tensor_value_info("x", F, [None, 4])],
                   [helper.make_tensor_value_info("label", label_type, [None]), helper.make_tensor_value_info("p", F, None)])
    _compare(model, {"x": RNG.standard_normal((12, 4)).astype(np.float32)})
