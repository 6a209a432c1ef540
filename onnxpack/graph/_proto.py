"""ONNX's protobuf classes and the few ``onnx.helper`` functions that loading and running a model
need, without importing the ``onnx`` package.

``import onnx`` loads its C++ extension (checker, shape inference, op schemas, parser, version
converter) and dozens of Python modules: ~90 ms and ~5 MB of private memory in every process
(measured 6.8 MB RssAnon for ``import onnx`` against 1.9 MB for its generated ``onnx_ml_pb2``
alone), none of which a load, a compile or a run uses.  Workers that share one model's mapped
weights pay it once each, so it is most of what separates four generating processes from one.

So the message classes come from onnx's own generated ``onnx_ml_pb2.py``, executed on its own
(it imports only ``google.protobuf``): protobuf keeps one class per message in its default
descriptor pool, so these are the very classes ``onnx.ModelProto`` … name, before and after a
later ``import onnx`` (which registers the identical file again, as protobuf allows).  When onnx
is already imported, its module is used as is.

The helpers here are exact copies of onnx's behaviour for the element types and attributes they
handle (tests/graph/test_proto.py compares them with onnx's over every type); anything else is
delegated to ``onnx.helper`` / ``onnx.numpy_helper``, which imports onnx on first use.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import numpy as np

__all__ = [
    "ModelProto", "GraphProto", "NodeProto", "TensorProto", "AttributeProto", "ValueInfoProto", "TypeProto",
    "TensorShapeProto", "SparseTensorProto", "FunctionProto", "OperatorSetIdProto", "StringStringEntryProto",
    "tensor_dtype_to_np_dtype", "np_dtype_to_tensor_dtype", "get_attribute_value", "make_node", "onnx_version",
]


def _generated_module() -> Any:
    """onnx's ``onnx_ml_pb2`` module: onnx's own once onnx is imported, else its file run alone."""
    loaded = sys.modules.get("onnx.onnx_ml_pb2")
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("onnx")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "onnx_ml_pb2.py")
        if os.path.isfile(path):
            # Same module name as onnx's (the classes' __module__ is set from it, so protos
            # pickle as onnx's), but not entered in sys.modules: ``import onnx`` later runs its
            # own copy, which finds every message already in the pool.
            file_spec = importlib.util.spec_from_file_location("onnx.onnx_ml_pb2", path)
            if file_spec is None or file_spec.loader is None:
                break
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
            return module
    import onnx  # an onnx build without the ML protos, or laid out otherwise: the whole package

    return onnx


_pb = _generated_module()
ModelProto = _pb.ModelProto
GraphProto = _pb.GraphProto
NodeProto = _pb.NodeProto
TensorProto = _pb.TensorProto
AttributeProto = _pb.AttributeProto
ValueInfoProto = _pb.ValueInfoProto
TypeProto = _pb.TypeProto
TensorShapeProto = _pb.TensorShapeProto
SparseTensorProto = _pb.SparseTensorProto
FunctionProto = _pb.FunctionProto
OperatorSetIdProto = _pb.OperatorSetIdProto
StringStringEntryProto = _pb.StringStringEntryProto
del _pb

# The element types numpy has natively, as onnx maps them (onnx._mapping.TENSOR_TYPE_MAP); the
# others (bfloat16, float8, int4, …) are ml_dtypes types that onnx.helper gives.
_NATIVE = {
    TensorProto.FLOAT: np.dtype(np.float32),
    TensorProto.UINT8: np.dtype(np.uint8),
    TensorProto.INT8: np.dtype(np.int8),
    TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.INT16: np.dtype(np.int16),
    TensorProto.INT32: np.dtype(np.int32),
    TensorProto.INT64: np.dtype(np.int64),
    TensorProto.STRING: np.dtype(object),
    TensorProto.BOOL: np.dtype(np.bool_),
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.DOUBLE: np.dtype(np.float64),
    TensorProto.UINT32: np.dtype(np.uint32),
    TensorProto.UINT64: np.dtype(np.uint64),
    TensorProto.COMPLEX64: np.dtype(np.complex64),
    TensorProto.COMPLEX128: np.dtype(np.complex128),
}
_NATIVE_ELEM = {dtype: elem for elem, dtype in _NATIVE.items()}


def tensor_dtype_to_np_dtype(tensor_dtype: int) -> np.dtype:
    """``onnx.helper.tensor_dtype_to_np_dtype``."""
    dtype = _NATIVE.get(tensor_dtype)
    if dtype is not None:
        return dtype
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(tensor_dtype)


def np_dtype_to_tensor_dtype(np_dtype: Any) -> int:
    """``onnx.helper.np_dtype_to_tensor_dtype``."""
    try:
        elem = _NATIVE_ELEM.get(np_dtype)
    except TypeError:  # an unhashable argument: onnx's own error
        elem = None
    if elem is not None:
        return elem
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np_dtype)


_SCALAR_FIELD = {
    AttributeProto.FLOAT: "f", AttributeProto.INT: "i", AttributeProto.STRING: "s", AttributeProto.TENSOR: "t",
    AttributeProto.SPARSE_TENSOR: "sparse_tensor", AttributeProto.GRAPH: "g", AttributeProto.TYPE_PROTO: "tp",
}
_LIST_FIELD = {
    AttributeProto.FLOATS: "floats", AttributeProto.INTS: "ints", AttributeProto.STRINGS: "strings",
    AttributeProto.TENSORS: "tensors", AttributeProto.SPARSE_TENSORS: "sparse_tensors",
    AttributeProto.GRAPHS: "graphs", AttributeProto.TYPE_PROTOS: "type_protos",
}


def get_attribute_value(attr: Any) -> Any:
    """``onnx.helper.get_attribute_value``: the attribute's value by its declared type (lists as
    lists, ``None`` for UNDEFINED); a reference attribute, or an unknown type, is onnx's error."""
    kind = attr.type
    field = _SCALAR_FIELD.get(kind)
    if field is not None and not attr.ref_attr_name:
        return getattr(attr, field)
    field = _LIST_FIELD.get(kind)
    if field is not None and not attr.ref_attr_name:
        return list(getattr(attr, field))
    if kind == AttributeProto.UNDEFINED and not attr.ref_attr_name:
        return None
    from onnx import helper

    return helper.get_attribute_value(attr)


def make_node(op_type: str, inputs: Any, outputs: Any, name: str | None = None, domain: str | None = None,
              **kwargs: Any) -> Any:
    """``onnx.helper.make_node``; nodes with attributes are made by onnx.helper itself."""
    if kwargs:
        from onnx import helper

        return helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **kwargs)
    node = NodeProto()
    node.op_type = op_type
    node.input.extend(inputs)
    node.output.extend(outputs)
    if name:
        node.name = name
    if domain is not None:
        node.domain = domain
    return node


def onnx_version() -> str:
    """The installed onnx's version, read from its package metadata (no import)."""
    onnx = sys.modules.get("onnx")
    if onnx is not None:
        return onnx.__version__
    from importlib import metadata

    try:
        return metadata.version("onnx")
    except metadata.PackageNotFoundError:
        import onnx

        return onnx.__version__
