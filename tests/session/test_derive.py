"""Constant expressions (_derive.py): which nodes derive a value, and the keys they derive."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpack.graph._tensor import Tensor
from onnxpack.prepack import WeightRef
from onnxpack.session._derive import derive


def _weights() -> dict[str, WeightRef]:
    w = numpy_helper.from_array(np.arange(-12, 12, dtype=np.int8).reshape(4, 6), "W")
    tensors = [
        w,
        helper.make_tensor("S", TensorProto.FLOAT, [4], [0.5, 0.25, 0.125, 2.0]),  # typed fields
        helper.make_tensor("Z", TensorProto.INT8, [4], [1, -2, 3, 0]),
        helper.make_tensor("S1", TensorProto.FLOAT, [], [0.03125]),
        helper.make_tensor("Z1", TensorProto.INT8, [], [-3]),
        numpy_helper.from_array(np.array([6, 4], np.int64), "shape"),
    ]
    return {t.name: WeightRef("", t.name, Tensor(t, None)) for t in tensors}


def _derive_all(nodes) -> dict[str, WeightRef | None]:
    weights = _weights()
    out: dict[str, WeightRef | None] = {}
    for n in nodes:
        out[n.output[0] if n.output else ""] = derive(n, lambda name: out.get(name) or weights.get(name), {"": 13})
    return out


def test_digests_are_the_saved_keys_of_earlier_versions():
    # Keys of saved packs: these digests were computed by the code that wrote existing packs
    # (before the bytes were hashed in place and the leaf's type formatted lazily); a change
    # here orphans every saved derived pack.
    nodes = [helper.make_node("DequantizeLinear", ["W", "S", "Z"], ["d"], axis=0),
             helper.make_node("Reshape", ["d", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
             helper.make_node("DequantizeLinear", ["W", "S1", "Z1"], ["d1"])]
    got = {k: v.derived.digest.hex() for k, v in _derive_all(nodes).items()}
    assert got == {
        "d": "df44658e2aa1907189ee1a00c1d9e28c",
        "r": "b95a84774076421c0a70a86d78dc6039",
        "t": "88ff987e819200ad83bbe28697e0a146",
        "d1": "907f48e33a8b87dc77163f3cfc8ba54c",
    }
    d = _derive_all(nodes)["d"]
    w = np.arange(-12, 12, dtype=np.int8).reshape(4, 6).astype(np.float32)
    want = (w - np.array([1, -2, 3, 0], np.float32)[:, None]) * np.array([0.5, 0.25, 0.125, 2.0], np.float32)[:, None]
    np.testing.assert_array_equal(d.value(), want)


@pytest.mark.parametrize("outputs,derived", [
    (["d"], True), ([""], False), (["d", ""], True), (["", "d"], False), (["d", "e"], False), ([], False),
], ids=["one", "one-unnamed", "named-then-unnamed", "unnamed-first", "two", "none"])
def test_only_a_node_with_one_named_first_output_derives(outputs, derived):
    node = helper.make_node("DequantizeLinear", ["W", "S1", "Z1"], outputs)
    weights = _weights()
    got = derive(node, weights.get, {"": 13})
    assert (got is not None) == derived


@pytest.mark.parametrize("inputs,derived", [
    (["W", "S1", "Z1"], True), (["W", "S1", ""], True), (["W", "S1"], True), (["W", "x", "Z1"], False),
    (["", "S1", "Z1"], False), (["x", "S1", "Z1"], False),
], ids=["all", "empty-zp", "no-zp", "scale-not-constant", "empty-input", "input-not-constant"])
def test_every_input_but_empty_ones_must_be_a_stored_constant(inputs, derived):
    node = helper.make_node("DequantizeLinear", inputs, ["d"])
    got = derive(node, _weights().get, {"": 13})
    assert (got is not None) == derived


def test_a_chain_computes_what_its_nodes_compute():
    from onnx.reference import ReferenceEvaluator

    nodes = [helper.make_node("DequantizeLinear", ["W", "S", "Z"], ["d"], axis=0),
             helper.make_node("Reshape", ["d", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
             helper.make_node("Cast", ["t"], ["c"], to=TensorProto.DOUBLE)]
    got = _derive_all(nodes)
    inits = [w.tensor.proto for w in _weights().values()]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None)
                                               for n in ("d", "r", "t", "c")], inits)
    want = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])).run(None, {})  # DQ as at 13
    for name, w in zip(("d", "r", "t", "c"), want):
        value = got[name].value()
        assert value.dtype == w.dtype == got[name].dtype and value.shape == w.shape == got[name].shape
        np.testing.assert_array_equal(value, w)
        np.testing.assert_array_equal(got[name].value(), w)  # again: the kernel built once is reused
    assert got["r"].derived.is_view is False and got["c"].elem_type == TensorProto.DOUBLE


def test_a_cast_its_kernel_declines_is_not_derived():
    node = helper.make_node("Cast", ["W"], ["c"], to=TensorProto.FLOAT8E4M3FN)
    assert derive(node, _weights().get, {"": 19}) is None
    node = helper.make_node("Cast", ["W"], ["c"], to=TensorProto.FLOAT16)
    assert derive(node, _weights().get, {"": 19}).dtype == np.float16


@pytest.mark.parametrize("zp_type,opset", [("int8", 13), ("uint8", 13), ("int16", 21), ("uint16", 21)])
def test_a_float_weight_quantized_in_the_graph_is_derived(zp_type, opset):
    """QuantizeLinear -> DequantizeLinear over a float weight (AddQDQPairToWeight, exported QAT
    models): the codes are the zero point's type and the pair's value is onnx.reference's."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    scale = np.array([0.02, 0.01, 0.05, 0.003], np.float32)
    zp = np.array([3, 0, 1, 2], zp_type)
    tensors = [numpy_helper.from_array(a, n) for a, n in ((w, "Wf"), (scale, "S"), (zp, "Z"))]
    weights = {t.name: WeightRef("", t.name, Tensor(t, None)) for t in tensors}
    nodes = [helper.make_node("QuantizeLinear", ["Wf", "S", "Z"], ["q"], axis=0),
             helper.make_node("DequantizeLinear", ["q", "S", "Z"], ["d"], axis=0)]
    got: dict[str, WeightRef | None] = {}
    for n in nodes:
        got[n.output[0]] = derive(n, lambda name: got.get(name) or weights.get(name), {"": opset})
    assert got["q"].dtype == np.dtype(zp_type) and got["d"].dtype == np.float32 and got["d"].shape == (4, 6)
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None)
                                               for n in ("q", "d")], tensors)
    want = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(opset, 19))])).run(None, {})
    for name, v in zip(("q", "d"), want):
        np.testing.assert_array_equal(got[name].value(), v)
        assert got[name].value().dtype == v.dtype


@pytest.mark.parametrize("case", ["no-zero-point", "float16-weight", "int4-zero-point", "output-dtype", "int8-weight"])
def test_other_quantizations_of_a_weight_are_left_to_run(case):
    """Only float32 weights to 8/16-bit codes of a given zero point derive: the result type is
    then known without running the kernel; the rest runs as a node (onnxruntime's semantics)."""
    w = np.ones((2, 3), np.float16 if case == "float16-weight" else np.int8 if case == "int8-weight" else np.float32)
    tensors = [numpy_helper.from_array(w, "Wf"), numpy_helper.from_array(np.array(0.5, w.dtype if w.dtype.kind == "f" else np.float32), "S")]
    if case == "int4-zero-point":
        tensors.append(helper.make_tensor("Z", TensorProto.INT4, [], [1]))
    elif case != "no-zero-point":
        tensors.append(numpy_helper.from_array(np.array(1, np.uint8), "Z"))
    weights = {t.name: WeightRef("", t.name, Tensor(t, None)) for t in tensors}
    attrs = {"output_dtype": TensorProto.UINT8} if case == "output-dtype" else {}
    node = helper.make_node("QuantizeLinear", ["Wf", "S"] + (["Z"] if "Z" in weights else []), ["q"], **attrs)
    assert derive(node, weights.get, {"": 21}) is None


@pytest.mark.parametrize("op", ["Transpose", "Cast"])
def test_a_chain_longer_than_pythons_stack_derives_and_packs(op):
    """A weight through 3,000 cheap ops before a MatMul (a valid model onnxruntime runs): its
    digest and value are computed along the chain in a loop, not by recursion (Python's
    RecursionError escaped session creation from ~500 nodes on), and the MatMul packs it."""
    import onnxruntime as ort

    import onnxpack

    n = 3000
    w = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "W")
    attrs = {"perm": [1, 0]} if op == "Transpose" else {"to": TensorProto.FLOAT}
    nodes = [helper.make_node(op, [f"w{i}" if i else "W"], [f"w{i + 1}"], **attrs) for i in range(n)]
    nodes.append(helper.make_node("MatMul", ["x", f"w{n}"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, {"x": x})[0]
        assert s.get_prepack_stats()["weights_packed"] == 1
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
