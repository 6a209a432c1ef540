"""onnxruntime's descriptive types (NodeArg, ModelMetadata) and the checks of a run's feed.

Pure functions of the model proto and the compiled program: the session facade calls them, and so
can tools (``onnxpack plan``) that need a validated feed without running a session.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxpack.errors import InvalidArgument, RuntimeFailure
from onnxpack.graph import Model

__all__ = ["NodeArg", "ModelMetadata", "model_inputs", "model_outputs", "model_metadata", "type_string",
           "shape_of", "validate_feed", "to_user"]

_ELEM_NAMES = {v: k.lower() for k, v in TensorProto.DataType.items() if k not in ("UNDEFINED",)}


@dataclasses.dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime describes it."""

    name: str
    type: str  # "tensor(float)"
    shape: list[int | str | None]


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


def type_string(type_proto: onnx.TypeProto) -> str:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({_ELEM_NAMES.get(type_proto.tensor_type.elem_type, 'undefined')})"
    if kind == "sequence_type":
        return f"seq({type_string(type_proto.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({type_string(type_proto.optional_type.elem_type)})"
    if kind == "map_type":
        m = type_proto.map_type
        return f"map({_ELEM_NAMES.get(m.key_type, 'undefined')},{type_string(m.value_type)})"
    if kind == "sparse_tensor_type":
        return f"sparse_tensor({_ELEM_NAMES.get(type_proto.sparse_tensor_type.elem_type, 'undefined')})"
    return "unknown"


def shape_of(type_proto: onnx.TypeProto) -> list[int | str | None] | None:
    if type_proto.WhichOneof("value") != "tensor_type" or not type_proto.tensor_type.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for d in type_proto.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def _node_arg(vi: onnx.ValueInfoProto) -> NodeArg:
    shape = shape_of(vi.type)
    return NodeArg(vi.name, type_string(vi.type), shape if shape is not None else [])


def model_inputs(model: Model, *, overridable: frozenset[str] = frozenset(), only_overridable: bool = False) -> list[NodeArg]:
    """The feedable inputs (initializers excluded), or only the overridable initializers."""
    init = model.root.initializers
    if only_overridable:
        return [_node_arg(i) for i in model.proto.graph.input if i.name in overridable]
    return [_node_arg(i) for i in model.proto.graph.input if i.name not in init]


def model_outputs(model: Model) -> list[NodeArg]:
    return [_node_arg(o) for o in model.proto.graph.output]


def model_metadata(model: Model) -> ModelMetadata:
    p = model.proto
    return ModelMetadata(
        producer_name=p.producer_name,
        graph_name=p.graph.name,
        domain=p.domain,
        description=p.doc_string,
        graph_description=p.graph.doc_string,
        version=p.model_version if p.HasField("model_version") else 2**63 - 1,  # ORT's kNoVersion
        custom_metadata_map={m.key: m.value for m in p.metadata_props if not m.key.startswith("onnxpack.prepacked/")},
    )


def validate_feed(model: Model, input_feed: Any, overridable: frozenset[str], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Checks a run's feed against the model's declared inputs; returns name -> value for every
    input (overridable initializers not fed take their defaults).

    Raises:
        InvalidArgument: not a dict, an unknown or missing name, a wrong dtype, rank or fixed dim.
    """
    if not isinstance(input_feed, dict):
        raise InvalidArgument(f"run: input_feed must be a dict of name -> array, got {type(input_feed).__name__}")
    consts = model.root.initializers
    declared = {i.name: i for i in model.proto.graph.input if i.name not in consts or i.name in overridable}
    unknown = [n for n in input_feed if n not in declared]
    if unknown:
        required = [i.name for i in model_inputs(model)]
        raise InvalidArgument(f"run: unknown input name(s) {unknown}; the model's inputs are {required}")
    feeds: dict[str, Any] = {}
    for vi in declared.values():
        name = vi.name
        if name not in input_feed:
            if name in overridable:
                feeds[name] = defaults[name]
                continue
            raise InvalidArgument(f"run: missing input {name!r} ({type_string(vi.type)}, shape {shape_of(vi.type)})")
        feeds[name] = _check_input(name, vi.type, input_feed[name])
    return feeds


def to_user(value: Any, name: str = "") -> Any:
    """Outputs are the user's to keep and modify: never a read-only view of a weight or blob.

    A read-only output may be a broadcast view (Expand) far larger than any allocation: copying
    it is then the output's RuntimeFailure, not numpy's MemoryError."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        try:
            return np.array(value)
        except (MemoryError, ValueError) as exc:
            raise RuntimeFailure(
                f"run: output {name!r} ({value.dtype}{list(value.shape)}, {value.nbytes} bytes) cannot be "
                f"allocated: {exc}") from exc
    return value


def _check_input(name: str, type_proto: onnx.TypeProto, value: Any) -> Any:
    if type_proto.WhichOneof("value") != "tensor_type":
        return value
    tt = type_proto.tensor_type
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    try:
        expected = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
    except Exception:
        expected = None
    if expected is not None and arr.dtype != expected and not (expected == object and arr.dtype.kind in "USO"):
        raise InvalidArgument(
            f"run: input {name!r} has the wrong type: expected {type_string(type_proto)} "
            f"({expected}), got {arr.dtype}"
        )
    if tt.HasField("shape"):
        dims = tt.shape.dim
        if arr.ndim != len(dims):
            raise InvalidArgument(
                f"run: input {name!r} has the wrong rank: expected {len(dims)} "
                f"(shape {shape_of(type_proto)}), got {arr.ndim} (shape {list(arr.shape)})"
            )
        for k, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value != arr.shape[k]:
                raise InvalidArgument(
                    f"run: input {name!r} has the wrong shape: dimension {k} expected {d.dim_value}, "
                    f"got {arr.shape[k]} (expected {shape_of(type_proto)}, got {list(arr.shape)})"
                )
    return arr
