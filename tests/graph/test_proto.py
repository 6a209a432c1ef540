"""onnxpack.graph._proto: ONNX's classes and helpers without ``import onnx``, equal to onnx's own."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, TensorProto, helper

from onnxpack.graph import _proto

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "models" / "fixtures" / "llm"


def _same(ours, theirs):
    """Both calls give equal results, or both raise the same kind of error."""
    try:
        expected = theirs()
    except Exception as e:  # noqa: BLE001 - whatever onnx raises, ours must too
        with pytest.raises(type(e)):
            ours()
        return
    got = ours()
    assert got == expected and type(got) is type(expected), (got, expected)


@pytest.mark.parametrize("elem", sorted(TensorProto.DataType.values()) + [999])
def test_tensor_dtype_to_np_dtype_is_onnxs(elem):
    _same(lambda: _proto.tensor_dtype_to_np_dtype(elem), lambda: helper.tensor_dtype_to_np_dtype(elem))


def _dtypes():
    out = []
    for elem in TensorProto.DataType.values():
        try:
            out.append(helper.tensor_dtype_to_np_dtype(elem))
        except (KeyError, ValueError, TypeError):
            pass
    return out + [np.dtype(">f4"), np.dtype("<U3"), np.dtype("S2"), np.dtype([("a", "i4")]), np.float32, "float32"]


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_np_dtype_to_tensor_dtype_is_onnxs(dtype):
    _same(lambda: _proto.np_dtype_to_tensor_dtype(dtype), lambda: helper.np_dtype_to_tensor_dtype(dtype))


def _attributes():
    g = helper.make_graph([], "g", [], [])
    t = helper.make_tensor("t", TensorProto.FLOAT, [2], [1.0, 2.0])
    sp = helper.make_sparse_tensor(t, helper.make_tensor("i", TensorProto.INT64, [1], [0]), [4])
    tp = helper.make_tensor_type_proto(TensorProto.INT8, [3])
    made = [helper.make_attribute(name, value) for name, value in (
        ("f", 1.5), ("i", -3), ("s", b"abc"), ("t", t), ("sp", sp), ("g", g), ("tp", tp),
        ("fs", [1.0, 2.5]), ("is", [1, 2, 3]), ("ss", [b"a", b"b"]), ("ts", [t, t]), ("sps", [sp]),
        ("gs", [g, g]), ("tps", [tp, tp]))]
    empty = AttributeProto(name="ints_empty", type=AttributeProto.INTS)
    undefined = AttributeProto(name="u")
    reference = AttributeProto(name="r", type=AttributeProto.FLOAT, ref_attr_name="alpha")
    return made + [empty, undefined, reference]


@pytest.mark.parametrize("attr", _attributes(), ids=lambda a: f"{a.name}-{a.type}")
def test_get_attribute_value_is_onnxs(attr):
    _same(lambda: _proto.get_attribute_value(attr), lambda: helper.get_attribute_value(attr))


@pytest.mark.parametrize("kwargs", [
    {}, {"name": "n"}, {"domain": ""}, {"domain": "com.microsoft", "name": "n"}, {"alpha": 0.5, "name": "a"},
    {"doc_string": "d"},
])
def test_make_node_is_onnxs(kwargs):
    ours = _proto.make_node("Relu", ["x", ""], ["y"], **kwargs)
    theirs = helper.make_node("Relu", ["x", ""], ["y"], **kwargs)
    assert ours.SerializeToString() == theirs.SerializeToString()


def test_the_classes_are_onnxs():
    for name in ("ModelProto", "GraphProto", "NodeProto", "TensorProto", "AttributeProto", "ValueInfoProto",
                 "TypeProto", "SparseTensorProto", "FunctionProto", "OperatorSetIdProto"):
        assert getattr(_proto, name) is getattr(onnx, name)
    assert _proto.onnx_version() == onnx.__version__


# A process that loads, optimizes and runs models never imports onnx; onnx imported afterwards
# works as usual and names the very classes onnxpack made its protos of.
_CHILD = r"""
import json, os, sys
import numpy as np
import onnxpack
from onnxpack.generate import Generator
folder, out = sys.argv[1], sys.argv[2]
tokens = []
with Generator(folder) as gen:
    tokens = list(gen.generate([5, 9, 2, 7], max_new_tokens=3, stop=()))
from onnxpack.session import optimize
optimize(os.path.join(folder, "model.onnx"), os.path.join(out, "model.onnx"))
warm = onnxpack.InferenceSession(os.path.join(out, "model.onnx"))
before = sorted(m for m in sys.modules if m == "onnx" or m.startswith("onnx."))
import onnx
from onnx import checker, helper, numpy_helper
from onnxpack.graph import _proto
model = onnx.load(os.path.join(out, "model.onnx"))
assert all(numpy_helper.to_array(t).size for t in model.graph.initializer)
relu = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", 1, [2])],
                         [helper.make_tensor_value_info("y", 1, [2])])
checker.check_model(helper.make_model(relu))
print(json.dumps({"before": before, "tokens": tokens, "warm_stats": warm.get_prepack_stats()["blobs_from_model"],
                  "same": all(getattr(_proto, n) is getattr(onnx, n) for n in ("ModelProto", "TensorProto", "NodeProto")),
                  "pickled": type(model).__module__}))
"""


@pytest.mark.parametrize("backend", ["default", "python"])
def test_loading_and_running_never_import_onnx(tmp_path, backend):
    env = dict(os.environ)
    if backend == "python":  # protobuf's pure-Python implementation registers files its own way
        env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    env["ONNXPACK_DISABLE_NATIVE"] = "1"
    env["ONNXPACK_DISABLE_JIT"] = "1"
    out = tmp_path / "opt"
    out.mkdir()
    res = subprocess.run([sys.executable, "-c", _CHILD, str(FIXTURES / "qwen2-int4"), str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["before"] == []
    assert got["same"] is True
    assert got["pickled"] == "onnx.onnx_ml_pb2"
    assert got["warm_stats"] > 0
    from onnxpack.generate import Generator

    with Generator(FIXTURES / "qwen2-int4") as gen:
        assert got["tokens"] == list(gen.generate([5, 9, 2, 7], max_new_tokens=3, stop=()))
