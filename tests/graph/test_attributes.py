"""Attributes an op does not have at the model's opset: refused at load, as onnxruntime does.

onnxruntime (onnx's checker) refuses a node of the default or ai.onnx.ml domain carrying an
attribute its schema does not declare at the model's opset ("Unrecognized attribute"); a runtime
that ignores it computes something else (ReduceMean-18 with an ``axes`` attribute reduces over
every axis).  The table of allowed names is generated from onnx.defs and kept in
onnxpack/graph/_attributes.py so that a load does not import onnx.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack.errors import InvalidGraph
from onnxpack.graph import _attributes, load_model

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, opset, *, ml=None, initializers=(), functions=()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("ai.onnx.ml", ml)] if ml else [])
    imports += [helper.make_opsetid(d, 1) for d in {f.domain for f in functions}]
    ir = 10 if opset >= 21 else 8
    return helper.make_model(graph, opset_imports=imports, ir_version=ir, functions=list(functions)).SerializeToString()


def _vi(name, shape=None, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _ort(data: bytes):
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def test_table_is_generated_from_installed_onnx():
    """Regenerate with ``python3 -m onnxpack.graph._attributes --write`` when onnx moves."""
    assert _attributes._TABLE == _attributes.generate()


def test_allowed_lookups():
    a = _attributes.allowed
    assert a("", "ReduceMean", 17) == {"axes", "keepdims"}
    assert a("", "ReduceMean", 18) == a("", "ReduceMean", 21) == {"keepdims", "noop_with_empty_axes"}
    assert a("ai.onnx", "ReduceSum", 13) == {"keepdims", "noop_with_empty_axes"}
    assert a("", "ReduceSum", 12) == {"axes", "keepdims"}
    assert a("", "Split", 13) == {"axis"} and a("", "Split", 18) == {"axis", "num_outputs"}
    assert a("", "Relu", 14) == frozenset() and a("", "Relu", 1) == {"consumed_inputs"}
    assert a("", "Squeeze", 11) == {"axes"} and a("", "Squeeze", 13) == frozenset()
    assert a("ai.onnx.ml", "Normalizer", 1) == {"norm"}
    assert a("", "BitwiseAnd", 14) is None  # before the op existed: not this check's business
    assert a("", "NoSuchOp", 18) is None
    assert a("com.microsoft", "FusedMatMul", 1) is None
    assert a("", "LayerNormalization", 17) is None  # onnx's schema allows unchecked attributes
    assert a("", "LayerNormalization", 16) is None  # onnxruntime's own pre-17 LayerNormalization


# (label, node, opset, ml opset, inputs, outputs, initializers, the refused attribute)
_X = [_vi("x", [2, 1, 3])]
_INVALID = [
    ("ReduceMean-18 axes", helper.make_node("ReduceMean", ["x"], ["y"], "rm", axes=[-1], keepdims=1), 18, None, _X,
     [_vi("y")], [], "axes"),
    ("ReduceMean-21 axes", helper.make_node("ReduceMean", ["x"], ["y"], "rm", axes=[-1]), 21, None, _X, [_vi("y")], [], "axes"),
    ("ReduceSum-13 axes", helper.make_node("ReduceSum", ["x"], ["y"], "rs", axes=[1]), 13, None, _X, [_vi("y")], [], "axes"),
    ("ReduceSum-18 axes", helper.make_node("ReduceSum", ["x"], ["y"], "rs", axes=[-1]), 18, None, _X, [_vi("y")], [], "axes"),
    ("ReduceMax-18 axes", helper.make_node("ReduceMax", ["x"], ["y"], "rx", axes=[2]), 18, None, _X, [_vi("y")], [], "axes"),
    ("Squeeze-13 axes", helper.make_node("Squeeze", ["x"], ["y"], "sq", axes=[1]), 13, None, _X, [_vi("y")], [], "axes"),
    ("Unsqueeze-13 axes", helper.make_node("Unsqueeze", ["x", "a"], ["y"], "uq", axes=[0]), 13, None, _X, [_vi("y")],
     [numpy_helper.from_array(np.array([0], np.int64), "a")], "axes"),
    ("Split-13 split", helper.make_node("Split", ["x"], ["y", "z"], "sp", axis=2, split=[1, 2]), 13, None, _X,
     [_vi("y"), _vi("z")], [], "split"),
    ("Split-18 split", helper.make_node("Split", ["x"], ["y", "z"], "sp", axis=2, split=[1, 2]), 18, None, _X,
     [_vi("y"), _vi("z")], [], "split"),
    ("Softmax-13 foo", helper.make_node("Softmax", ["x"], ["y"], "sm", axis=-1, foo=3), 13, None, _X, [_vi("y")], [], "foo"),
    ("Relu-14 alpha", helper.make_node("Relu", ["x"], ["y"], "r", alpha=0.5), 14, None, _X, [_vi("y")], [], "alpha"),
    ("Relu-14 _single_underscore", helper.make_node("Relu", ["x"], ["y"], "r", _x=1), 14, None, _X, [_vi("y")], [], "_x"),
    # quantize_static(per_channel=True) of an opset-11 model: DequantizeLinear's axis came at 13
    ("DequantizeLinear-10 axis", helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], "dq", axis=0), 11, None,
     [_vi("q", [2, 3], TensorProto.INT8)], [_vi("y")],
     [numpy_helper.from_array(np.float32(0.5), "s"), numpy_helper.from_array(np.int8(0), "z")], "axis"),
    ("ml Normalizer foo", helper.make_node("Normalizer", ["x2"], ["y"], "nz", domain="ai.onnx.ml", norm="L2", foo=1), 17, 3,
     [_vi("x2", [2, 3])], [_vi("y")], [], "foo"),
]


@pytest.mark.parametrize("case", _INVALID, ids=[c[0] for c in _INVALID])
def test_unknown_attribute_refused_like_onnxruntime(case):
    label, node, opset, ml, inputs, outputs, inits, attr = case
    data = _model([node], inputs, outputs, opset, ml=ml, initializers=inits)
    with pytest.raises(Exception, match="Unrecognized attribute"):
        _ort(data)
    with pytest.raises(InvalidGraph) as info:
        onnxpack.InferenceSession(data)
    message = str(info.value)
    for part in (repr(node.name), f"({node.op_type}, opset {ml or opset} ", repr(attr), "onnxruntime refuses"):
        assert part in message, (part, message)
    allowed = _attributes.allowed(node.domain, node.op_type, ml or opset)
    assert ", ".join(sorted(allowed)) in message if allowed else "attributes there: none" in message


def test_reducemean_raised_to_opset_21_refused_instead_of_reducing_everything():
    """The MatMulNBitsQuantizer(QDQ) case: an opset-13 model raised to 21, its ReduceMean kept."""
    node = helper.make_node("ReduceMean", ["x"], ["y"], "mean", axes=[-1], keepdims=1)
    data = _model([node], [_vi("x", [2, 3])], [_vi("y")], 21)
    with pytest.raises(InvalidGraph, match="'axes'.*ReduceMean does not have"):
        onnxpack.InferenceSession(data)
    # the same reduction with axes as an input (valid at 21) loads and reduces the last axis
    node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], "mean", keepdims=1)
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    data = _model([node], [_vi("x", [2, 3])], [_vi("y")], 21, initializers=[axes])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(onnxpack.InferenceSession(data).run(None, {"x": x})[0], [[1.0], [4.0]])
    np.testing.assert_allclose(_ort(data).run(None, {"x": x})[0], [[1.0], [4.0]])


def _if_model(bad: bool) -> bytes:
    kwargs = {"axes": [-1]} if bad else {}
    inputs = ["x"] if bad else ["x", "axes"]
    then_g = helper.make_graph([helper.make_node("ReduceMean", inputs, ["t"], "inner_mean", keepdims=1, **kwargs)],
                               "then", [], [_vi("t")])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [_vi("e")])
    nodes = [helper.make_node("If", ["c"], ["y"], "branch", then_branch=then_g, else_branch=else_g)]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    return _model(nodes, [_vi("x", [2, 3]), _vi("c", [], TensorProto.BOOL)], [_vi("y")], 18, initializers=inits)


def _loop_model(bad: bool) -> bytes:
    kwargs = {"alpha": 0.5} if bad else {}
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Relu", ["v"], ["v_out"], "inner_relu", **kwargs)],
        "body", [_vi("i", [], TensorProto.INT64), _vi("cond", [], TensorProto.BOOL), _vi("v", [2, 3])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("v_out", [2, 3])])
    nodes = [helper.make_node("Loop", ["n", "", "x"], ["y"], "loop", body=body)]
    return _model(nodes, [_vi("x", [2, 3]), _vi("n", [], TensorProto.INT64)], [_vi("y", [2, 3])], 14)


@pytest.mark.parametrize("make, inner", [(_if_model, "inner_mean"), (_loop_model, "inner_relu")])
def test_subgraph_nodes_checked_at_model_opset(make, inner):
    with pytest.raises(Exception, match="Unrecognized attribute"):
        _ort(make(True))
    with pytest.raises(InvalidGraph, match=repr(inner)):
        onnxpack.InferenceSession(make(True))
    good = make(False)
    _ort(good)
    onnxpack.InferenceSession(good)


# Valid nodes carrying every attribute their schema has at that opset: (label, node, opset, ml,
# inputs, outputs, initializers).
_I64 = TensorProto.INT64


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


_X4 = [_vi("x", [1, 2, 4, 4])]
_VALID = [
    ("ReduceMean-13", helper.make_node("ReduceMean", ["x"], ["y"], axes=[-1], keepdims=0), 13, None, _X4, [_vi("y")], []),
    ("ReduceMean-18", helper.make_node("ReduceMean", ["x", "a"], ["y"], keepdims=0, noop_with_empty_axes=1), 18, None, _X4,
     [_vi("y")], [_i64("a", [1])]),
    ("ReduceSum-11", helper.make_node("ReduceSum", ["x"], ["y"], axes=[1], keepdims=1), 11, None, _X4, [_vi("y")], []),
    ("ReduceSum-13", helper.make_node("ReduceSum", ["x", "a"], ["y"], keepdims=1, noop_with_empty_axes=0), 13, None, _X4,
     [_vi("y")], [_i64("a", [1])]),
    ("Split-11", helper.make_node("Split", ["x"], ["y", "z"], axis=3, split=[1, 3]), 11, None, _X4, [_vi("y"), _vi("z")], []),
    ("Split-13", helper.make_node("Split", ["x", "s"], ["y", "z"], axis=3), 13, None, _X4, [_vi("y"), _vi("z")],
     [_i64("s", [1, 3])]),
    ("Split-18", helper.make_node("Split", ["x"], ["y", "z"], axis=3, num_outputs=2), 18, None, _X4, [_vi("y"), _vi("z")], []),
    ("Squeeze-11", helper.make_node("Squeeze", ["x"], ["y"], axes=[0]), 11, None, _X4, [_vi("y")], []),
    ("Conv-11", helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="NOTSET", dilations=[1, 1], group=2,
                                 kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1]), 11, None, _X4, [_vi("y")],
     [numpy_helper.from_array(np.ones((2, 1, 3, 3), np.float32), "w")]),
    ("Gemm-13", helper.make_node("Gemm", ["m", "w"], ["y"], alpha=0.5, beta=2.0, transA=0, transB=1), 13, None,
     [_vi("m", [2, 4])], [_vi("y")], [numpy_helper.from_array(np.ones((3, 4), np.float32), "w")]),
    ("Softmax-13", helper.make_node("Softmax", ["x"], ["y"], axis=1), 13, None, _X4, [_vi("y")], []),
    ("LeakyRelu-16", helper.make_node("LeakyRelu", ["x"], ["y"], alpha=0.2), 16, None, _X4, [_vi("y")], []),
    ("Cast-19", helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16, saturate=1), 19, None, _X4,
     [_vi("y", elem=TensorProto.FLOAT16)], []),
    ("LayerNormalization-17", helper.make_node("LayerNormalization", ["x", "sc", "b"], ["y"], axis=-1, epsilon=1e-5,
                                               stash_type=1), 17, None, _X4, [_vi("y")],
     [numpy_helper.from_array(np.ones(4, np.float32), n) for n in ("sc", "b")]),
    ("Relu-14 __internal", helper.make_node("Relu", ["x"], ["y"], __note=1), 14, None, _X4, [_vi("y")], []),
    ("ml Normalizer-1", helper.make_node("Normalizer", ["x2"], ["y"], domain="ai.onnx.ml", norm="L1"), 17, 3,
     [_vi("x2", [2, 3])], [_vi("y")], []),
    ("ml Binarizer-1", helper.make_node("Binarizer", ["x2"], ["y"], domain="ai.onnx.ml", threshold=0.5), 17, 3,
     [_vi("x2", [2, 3])], [_vi("y")], []),
]


@pytest.mark.parametrize("case", _VALID, ids=[c[0] for c in _VALID])
def test_every_attribute_of_the_opset_accepted(case):
    label, node, opset, ml, inputs, outputs, inits = case
    names = {a.name for a in node.attribute}
    allowed = _attributes.allowed(node.domain, node.op_type, ml or opset)
    if allowed is not None:  # every attribute the schema has (the internal ``__`` names aside)
        assert {n for n in names if not n.startswith("__")} == allowed
    data = _model([node], inputs, outputs, opset, ml=ml, initializers=inits)
    feeds = {v.name: np.random.default_rng(0).random([d.dim_value for d in v.type.tensor_type.shape.dim], np.float32)
             for v in inputs}
    expected = _ort(data).run(None, feeds)
    got = onnxpack.InferenceSession(data).run(None, feeds)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-3)


def test_ops_the_table_does_not_know_are_left_to_other_layers():
    # a custom domain, an op name onnx does not have, an op used before it existed (BitwiseAnd-18
    # at 14) and a model-local function: loaded, whatever their attributes
    fn = helper.make_function("local", "Relu", ["a"], ["b"], [helper.make_node("Identity", ["a"], ["b"])],
                              [helper.make_opsetid("", 14)], attributes=["alpha"])
    nodes = [helper.make_node("FusedMatMul", ["x", "x"], ["p"], domain="com.microsoft", anything=1),
             helper.make_node("NoSuchOp", ["p"], ["q"], whatever=2),
             helper.make_node("BitwiseAnd", ["q", "q"], ["r"], bogus=3),
             helper.make_node("Relu", ["r"], ["y"], domain="local", alpha=0.5)]
    data = _model(nodes, [_vi("x", [2, 2])], [_vi("y")], 14, functions=[fn])
    load_model(data).close()


def test_model_without_the_domain_import_is_not_checked():
    node = helper.make_node("Normalizer", ["x"], ["y"], domain="ai.onnx.ml", foo=1)
    data = _model([node], [_vi("x", [2, 3])], [_vi("y")], 17)  # no ai.onnx.ml import
    load_model(data).close()


def test_no_onnx_conformance_model_refused():
    """Every model of onnx's conformance suites (the node cases built from the wheel's test-case
    code, the model cases and the data folder), skipped or not in test_backend, loads: none
    carries an attribute its op lacks (onnxruntime loads them too)."""
    import glob
    import os
    import warnings

    import onnx.backend.test
    from onnx.backend.test.case import model as model_cases
    from onnx.backend.test.case import node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_cases.collect_testcases() + model_cases.collect_testcases()
    models = [(c.name, c.model.SerializeToString()) for c in cases if c.model is not None]
    data = os.path.join(os.path.dirname(onnx.backend.test.__file__), "data")
    for path in sorted(glob.glob(os.path.join(data, "**", "model.onnx"), recursive=True)):
        with open(path, "rb") as f:
            models.append((os.path.relpath(path, data), f.read()))
    assert len(models) > 1500
    refused = []
    for name, data in models:
        try:
            load_model(data).close()
        except InvalidGraph as e:
            if "does not have at this opset" in str(e):
                refused.append((name, str(e)))
    assert not refused
