"""ai.onnx.ml ops as onnxruntime computes them: ZipMap, LinearClassifier, Normalizer,
TreeEnsembleClassifier.

sklearn-onnx classifiers end in ``ZipMap`` (a sequence of maps, one ``{label: probability}`` per
row), which onnx.reference does not have; ``LinearClassifier`` and ``Normalizer`` are here because
onnxruntime's results differ from onnx.reference's where models depend on it:

* LinearClassifier: the coefficients are read as ``[classes, features of the input]`` (row-major,
  whatever the coefficient count); with one class and two labels the scores are ``[1 - p, p]``
  where ``p`` is the logistic of the score for LOGISTIC and the raw score for NONE, SOFTMAX and
  SOFTMAX_ZERO; with one class and no two labels the raw score whatever the transform (PROBIT
  excepted), as onnxruntime does;
* Normalizer MAX divides by the row's maximum (not its largest magnitude);
* TreeEnsembleClassifier with two classes follows onnxruntime's binary rules for labels, scores
  and base_values (see the class).

The other ai.onnx.ml ops (TreeEnsembleRegressor, SVM*, Scaler, LinearRegressor, ...) run through
onnx.reference, whose results match onnxruntime's for them (tests/session/test_kernels_ml.py).
"""

from __future__ import annotations

import math

import numpy as np

from onnxpack.errors import InvalidArgument, InvalidGraph
from onnxpack.graph._tensor import to_array
from onnxpack.session.kernels._base import Kernel, register

__all__ = ["ZipMap", "LinearClassifier", "Normalizer", "TreeEnsembleClassifier"]

ML = "ai.onnx.ml"
_TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT")


def _label(self: Kernel) -> str:
    return f"node {self.node.name or '<unnamed>'!r} ({self.node.op_type})"


@register("ZipMap", domain=ML, since=1)
class ZipMap(Kernel):
    """``[N, C]`` (or ``[C]``) scores -> a list of N dicts ``{classlabel: float}``, keys in
    ascending order (onnxruntime builds ``std::map``s)."""

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        ints = self.attrs.get("classlabels_int64s")
        strings = self.attrs.get("classlabels_strings")
        if (ints is None) == (strings is None):
            raise InvalidGraph(f"{_label(self)}: Must provide classlabels_strings or classlabels_int64s but not both.")
        self.labels = [int(v) for v in ints] if ints is not None else [
            v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in strings]

    def run(self, x):
        if x.ndim == 0 or x.ndim > 2:
            raise InvalidArgument(f"{_label(self)}: Zipmap only supports 1D or 2D input tensors, got shape "
                                  f"{list(x.shape)}")
        rows = x.reshape(1, -1) if x.ndim == 1 else x
        if rows.shape[1] != len(self.labels):
            raise InvalidArgument(f"{_label(self)}: Input features_per_batch[{rows.shape[1]}] != number of "
                                  f"classlabels[{len(self.labels)}]")
        order = sorted(range(len(self.labels)), key=self.labels.__getitem__)  # std::map: sorted keys
        keys = [self.labels[k] for k in order]
        return ([dict(zip(keys, (row[k] for k in order))) for row in rows.astype(np.float32).tolist()],)


def _logistic(s: np.ndarray) -> np.ndarray:
    v = 1.0 / (1.0 + np.exp(-np.abs(s)))
    return np.where(s < 0, 1.0 - v, v).astype(np.float32)


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def _softmax_zero(s: np.ndarray) -> np.ndarray:
    """onnxruntime's SOFTMAX_ZERO: entries that are (near) zero stay zero-weighted."""
    vmax = s.max(axis=1, keepdims=True)
    nonzero = np.abs(s) > 1e-7
    e = np.where(nonzero, np.exp(s - vmax), s * np.exp(-vmax))
    total = np.where(nonzero, e, 0).sum(axis=1, keepdims=True)
    return (e / total).astype(np.float32)


def _probit(s: np.ndarray) -> np.ndarray:
    """onnxruntime's ComputeProbit: sqrt(2) * its ErfInv approximation (Winitzki, a = 0.147)."""
    x = 2.0 * s.astype(np.float32) - 1.0
    sgn = np.where(x < 0, -1.0, 1.0)
    y = (1 - x) * (1 + x)
    ln = np.log(y)
    v = 2 / (math.pi * 0.147) + 0.5 * ln
    v2 = 1 / 0.147 * ln
    return (math.sqrt(2) * sgn * np.sqrt(-v + np.sqrt(v * v - v2))).astype(np.float32)


@register("LinearClassifier", domain=ML, since=1)
class LinearClassifier(Kernel):
    """``scores = X @ coefficients.T + intercepts``; label = argmax (or sign, one class)."""

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.coefficients = np.asarray(self.attrs.get("coefficients", []), np.float32)
        if not self.coefficients.size:
            raise InvalidGraph(f"{_label(self)}: attribute 'coefficients' is required")
        self.intercepts = np.asarray(self.attrs.get("intercepts", []), np.float32)
        self.classes = len(self.intercepts)
        strings = self.attrs.get("classlabels_strings")
        self.labels = ([v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in strings] if strings
                       else [int(v) for v in self.attrs.get("classlabels_ints", [])])
        self.strings = bool(strings)
        self.post = self.attr("post_transform", "NONE")
        if self.post not in _TRANSFORMS:
            self.post = "PROBIT"  # onnxruntime's MakeTransform: anything else is PROBIT
        if self.classes == 0:
            raise InvalidGraph(f"{_label(self)}: attribute 'intercepts' is required (one per class)")

    def run(self, x):
        if x.ndim == 0:
            raise InvalidArgument(f"{_label(self)}: Input shape needs to be at least a single dimension.")
        rows = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
        n, features = rows.shape
        if self.coefficients.size < self.classes * features:
            raise InvalidArgument(f"{_label(self)}: {self.coefficients.size} coefficients cannot hold "
                                  f"{self.classes} classes x {features} features")
        w = self.coefficients[: self.classes * features].reshape(self.classes, features)
        scores = rows.astype(np.float32) @ w.T + self.intercepts
        labels = self.labels
        if self.classes == 1:
            two = len(labels) == 2
            pos, neg = (labels[1], labels[0]) if two else (("1", "0") if self.strings else (1, 0))
            label = [pos if s > 0 else neg for s in scores[:, 0]]
            s = scores[:, 0]
            if self.post == "PROBIT":
                # onnxruntime transforms the n scores in place at the start of the [n, 2] output
                flat = np.zeros(n * (2 if two else 1), np.float32)
                flat[:n] = _probit(s)
                scores = flat.reshape(n, -1)
            elif two:
                s = _logistic(s) if self.post == "LOGISTIC" else s
                scores = np.stack([1.0 - s, s], axis=1).astype(np.float32)
            # one class, no two labels: the raw score, whatever post_transform says (as onnxruntime)
        else:
            label = [labels[i] for i in scores.argmax(axis=1)] if labels else scores.argmax(axis=1).tolist()
            scores = self._transform(scores)
        out = np.array(label, dtype=object if self.strings else np.int64).reshape(n)
        return out, scores.astype(np.float32)

    def _transform(self, s: np.ndarray) -> np.ndarray:
        post = self.post
        if post == "LOGISTIC":
            return _logistic(s)
        if post == "SOFTMAX":
            return _softmax(s)
        if post == "SOFTMAX_ZERO":
            return _softmax_zero(s)
        if post == "PROBIT":
            return _probit(s)
        return s


@register("Normalizer", domain=ML, since=1)
class Normalizer(Kernel):
    """Row-wise normalization to float32: MAX (by the row's maximum), L1, L2; rows of zero norm
    are copied unchanged."""

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.norm = self.attr("norm", "MAX")
        if self.norm not in ("MAX", "L1", "L2"):
            raise InvalidGraph(f"{_label(self)}: Invalid normalize value of {self.norm!r} (expected MAX, L1 or L2)")

    def run(self, x):
        if x.ndim > 2:
            raise InvalidArgument(f"{_label(self)}: Rank of input to Normalized must be less than 2. Got {x.ndim}")
        rows = x.reshape(1, -1).astype(np.float32) if x.ndim < 2 else x.astype(np.float32)
        if self.norm == "MAX":
            z = rows.max(axis=1, keepdims=True) if rows.shape[1] else np.zeros((rows.shape[0], 1), np.float32)
        elif self.norm == "L1":
            z = np.abs(rows).sum(axis=1, keepdims=True)
        else:
            z = np.sqrt((rows * rows).sum(axis=1, keepdims=True))
        safe = np.where(z == 0, 1, z)
        return ((rows / safe).astype(np.float32).reshape(x.shape),)


# -- TreeEnsembleClassifier ---------------------------------------------------------------------

_MODES = {"BRANCH_LEQ": 0, "BRANCH_LT": 1, "BRANCH_GTE": 2, "BRANCH_GT": 3, "BRANCH_EQ": 4, "BRANCH_NEQ": 5,
          "LEAF": 6}


def _attr_array(kernel: Kernel, name: str, dtype: type) -> np.ndarray | None:
    """An attribute as an array, from ``name`` or its opset-3 ``name_as_tensor`` form."""
    value = kernel.attrs.get(name)
    if value is None:
        tensor = kernel.attrs.get(name + "_as_tensor")
        if tensor is None:
            return None
        return to_array(tensor).astype(dtype)
    if value and isinstance(value[0], bytes):
        return np.array([v.decode("utf-8") for v in value], dtype=object)
    return np.asarray(value, dtype=dtype)


@register("TreeEnsembleClassifier", domain=ML, since=1)
class TreeEnsembleClassifier(Kernel):
    """Tree ensemble classification with onnxruntime's scoring rules.

    Trees are walked for all rows at once (one vectorized step per tree level); each reached leaf
    adds its class weights (SUM).  Then onnxruntime's TreeAggregatorClassifier decides labels and
    scores, including its binary rules: with two classes, the label comes from the positive
    class's score (> 0.5 when every weight is positive and only one class has weights, > 0
    otherwise), base_values are applied as it applies them, and a single score is expanded to two
    (``[1 - p, p]`` with ``p`` the score or its logistic, or ``[-s, s]`` / logistic pairs for
    mixed-sign weights).
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        tree = _attr_array(self, "nodes_treeids", np.int64)
        ids = _attr_array(self, "nodes_nodeids", np.int64)
        feature = _attr_array(self, "nodes_featureids", np.int64)
        value = _attr_array(self, "nodes_values", np.float64)
        modes = _attr_array(self, "nodes_modes", object)
        true_ids = _attr_array(self, "nodes_truenodeids", np.int64)
        false_ids = _attr_array(self, "nodes_falsenodeids", np.int64)
        if any(a is None for a in (tree, ids, modes)):
            raise InvalidGraph(f"{_label(self)}: nodes_treeids, nodes_nodeids and nodes_modes are required")
        n = len(tree)
        feature = np.zeros(n, np.int64) if feature is None else feature
        value = np.zeros(n) if value is None else value
        true_ids = np.zeros(n, np.int64) if true_ids is None else true_ids
        false_ids = np.zeros(n, np.int64) if false_ids is None else false_ids
        track = _attr_array(self, "nodes_missing_value_tracks_true", np.int64)
        if any(len(a) != n for a in (ids, feature, value, modes, true_ids, false_ids)) or (track is not None and len(track) != n):
            raise InvalidGraph(f"{_label(self)}: the nodes_* attributes must all have {n} entries")
        try:
            self.mode = np.array([_MODES[m] for m in modes], np.int8)
        except KeyError as exc:
            raise InvalidGraph(f"{_label(self)}: unknown node mode {exc.args[0]!r}") from None
        index = {(int(t), int(i)): k for k, (t, i) in enumerate(zip(tree, ids))}
        leaf = self.mode == _MODES["LEAF"]

        def child(ids_: np.ndarray, what: str) -> np.ndarray:
            out = np.zeros(n, np.int64)
            for k in np.flatnonzero(~leaf):
                c = index.get((int(tree[k]), int(ids_[k])))
                if c is None:
                    raise InvalidGraph(f"{_label(self)}: node {int(ids[k])} of tree {int(tree[k])} has no {what} "
                                       f"node {int(ids_[k])}")
                out[k] = c
            return out

        self.true_child, self.false_child = child(true_ids, "true"), child(false_ids, "false")
        referenced = set(self.true_child[~leaf].tolist()) | set(self.false_child[~leaf].tolist())
        self.roots = [k for k in range(n) if k not in referenced]
        self.feature, self.value, self.leaf = feature, value, leaf
        self.track_true = np.zeros(n, bool) if track is None else track.astype(bool)
        ints = _attr_array(self, "classlabels_int64s", np.int64)
        strings = _attr_array(self, "classlabels_strings", object)
        self.strings = strings is not None and len(strings) > 0
        self.labels = list(strings) if self.strings else ([] if ints is None else ints.tolist())
        c = len(self.labels)
        if c < 2:
            raise NotImplementedError("TreeEnsembleClassifier with fewer than two class labels")
        cls_tree = _attr_array(self, "class_treeids", np.int64)
        cls_node = _attr_array(self, "class_nodeids", np.int64)
        cls_id = _attr_array(self, "class_ids", np.int64)
        cls_w = _attr_array(self, "class_weights", np.float64)
        if any(a is None for a in (cls_tree, cls_node, cls_id, cls_w)):
            raise InvalidGraph(f"{_label(self)}: class_treeids, class_nodeids, class_ids and class_weights are required")
        self.weights = np.zeros((n, c), np.float32)
        self.has = np.zeros((n, c), bool)
        for t, i, k, w in zip(cls_tree, cls_node, cls_id, cls_w):
            node_index = index.get((int(t), int(i)))
            if node_index is None or not 0 <= k < c:
                raise InvalidGraph(f"{_label(self)}: class weight for node {int(i)} of tree {int(t)}, class {int(k)} "
                                   "does not match a node and a class")
            self.weights[node_index, k] += np.float32(w)
            self.has[node_index, k] = True
        base = _attr_array(self, "base_values", np.float32)
        self.base = np.zeros(0, np.float32) if base is None else base
        self.post = self.attr("post_transform", "NONE")
        if self.post not in _TRANSFORMS:
            self.post = "PROBIT"
        self.binary_case = c == 2 and len(set(cls_id.tolist())) == 1
        self.all_positive = bool((cls_w >= 0).all())

    def _leaves(self, x: np.ndarray) -> list[np.ndarray]:
        rows = np.arange(x.shape[0])
        out = []
        for root in self.roots:
            cur = np.full(x.shape[0], root, np.int64)
            active = ~self.leaf[cur]
            while active.any():
                k = cur[active]
                v = x[rows[active], self.feature[k]]
                t = self.value[k].astype(x.dtype)
                mode = self.mode[k]
                cond = np.select([mode == 0, mode == 1, mode == 2, mode == 3, mode == 4],
                                 [v <= t, v < t, v >= t, v > t, v == t], v != t)
                cond |= np.isnan(v) & self.track_true[k]
                cur[active] = np.where(cond, self.true_child[k], self.false_child[k])
                active = ~self.leaf[cur]
            out.append(cur)
        return out

    def run(self, x):
        if x.ndim == 0:
            raise InvalidArgument(f"{_label(self)}: the input must have at least one dimension")
        x2 = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
        x2 = x2 if x2.dtype == np.float64 else x2.astype(np.float32)
        if self.feature.size and x2.shape[1] <= int(self.feature.max()):
            raise InvalidArgument(f"{_label(self)}: the model reads feature {int(self.feature.max())}, the input has "
                                  f"{x2.shape[1]}")
        n, c = x2.shape[0], len(self.labels)
        scores = np.zeros((n, c), np.float32)
        has = np.zeros((n, c), bool)
        for leaves in self._leaves(x2):
            scores += self.weights[leaves]
            has |= self.has[leaves]
        if c > 2:
            label_index, out = self._multiclass(scores, has)
            return self._label_values(label_index), out
        return self._binary(scores, has)

    def _label_values(self, index: np.ndarray) -> np.ndarray:
        return (np.array(self.labels, dtype=object) if self.strings else np.asarray(self.labels, np.int64))[index]

    def _multiclass(self, scores: np.ndarray, has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = min(len(self.base), scores.shape[1])
        scores[:, :k] += self.base[:k]
        has[:, :k] = True
        masked = np.where(has, scores, -np.inf)
        label_index = masked.argmax(axis=1)  # first maximum, as onnxruntime's strict '>' scan
        return label_index, _post(np.where(has, scores, 0).astype(np.float32), self.post)

    def _binary(self, scores: np.ndarray, has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """onnxruntime's binary rules, row by row (see the class docstring).  Outside its
        "binary case" (one class carrying weights) onnxruntime's label is 1 or 0 for a positive
        or non-positive score — the values 1/0 for int64 labels, the labels at index 1/0 for
        string labels — and so is ours."""
        n = scores.shape[0]
        out = np.zeros((n, 2), np.float32)
        index = np.zeros(n, np.int64)
        base = self.base
        for r in range(n):
            s0, s1 = float(scores[r, 0]), float(scores[r, 1])
            h0, h1 = bool(has[r, 0]), bool(has[r, 1])
            extra = -1
            two = True
            if len(base) == 2:
                if h1:
                    s1 = float(np.float32(base[1] + s0))
                    s0 = -s1
                else:
                    s1, s0 = float(np.float32(s1 + base[1])), float(np.float32(s0 + base[0]))
            elif len(base) == 1:
                s0 = float(np.float32(s0 + base[0]))
                two = h1
            elif len(base) == 0:
                extra = 3
                two = h1
            pos = s1 if (two and h1) else (s0 if h0 else 0.0)
            if self.binary_case:
                if self.all_positive:
                    extra, index[r] = (0, 1) if pos > 0.5 else (1, 0)
                else:
                    extra, index[r] = (2, 1) if pos > 0 else (3, 0)
            else:
                index[r] = 1 if pos > 0 else 0
            if two:
                out[r] = _post(np.array([[s0, s1]], np.float32), self.post)[0]
            elif self.post == "PROBIT":
                out[r, 0] = _probit(np.array([s0], np.float32))[0]
            elif extra in (0, 1):
                p = float(_logistic(np.array([s0]))[0]) if self.post == "LOGISTIC" else s0
                out[r] = (1 - p, p)
            elif extra in (2, 3):
                out[r] = (_logistic(np.array([-s0]))[0], _logistic(np.array([s0]))[0]) if self.post == "LOGISTIC" else (-s0, s0)
            else:
                out[r, 0] = s0
        if self.binary_case or self.strings:
            return self._label_values(index), out
        return index, out  # the values 1 / 0 themselves (see above)


def _post(s: np.ndarray, post: str) -> np.ndarray:
    if post == "LOGISTIC":
        return _logistic(s)
    if post == "SOFTMAX":
        return _softmax(s)
    if post == "SOFTMAX_ZERO":
        return _softmax_zero(s)
    if post == "PROBIT":
        return _probit(s)
    return s.astype(np.float32)
