"""onnxruntime's descriptive types (NodeArg, ModelMetadata) and the checks of a run's feed.

Pure functions of the model proto and the compiled program: the session facade calls them, and so
can tools (``onnxpack plan``) that need a validated feed without running a session.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from onnxpack._frozen import fast_init
from onnxpack.errors import InvalidArgument, RuntimeFailure
from onnxpack.graph import Model
from onnxpack.graph._proto import (
    TensorProto, TensorShapeProto, TypeProto, ValueInfoProto, np_dtype_to_tensor_dtype, tensor_dtype_to_np_dtype,
)
from onnxpack.session._ortvalue import OrtValue, SparseTensor

__all__ = ["NodeArg", "ModelMetadata", "model_inputs", "model_outputs", "model_metadata", "type_string",
           "declared_dim", "shape_of", "validate_feed", "feed_spec", "check_required", "coerce_input", "to_user", "override_dims"]

_ELEM_NAMES = {v: k.lower() for k, v in TensorProto.DataType.items() if k not in ("UNDEFINED",)}


@fast_init
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


def type_string(type_proto: TypeProto) -> str:
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


def declared_dim(d: TensorShapeProto.Dimension) -> int | str | None:
    """One declared dimension as onnxruntime reads it: a fixed size, a symbol, or ``None`` (unknown).

    A negative ``dim_value`` is a legacy spelling of "unknown" (older Paddle and Caffe2 exports
    write ``dim_value: -1``, e.g. PP-OCR's ``ch_ppocr_mobile_v2.0_cls_infer.onnx``): onnxruntime
    1.32 loads such models, reports the dimension as ``None`` and accepts any size there, for every
    negative value.  So do we, in one place: feed checks, ``get_inputs``/``get_outputs`` and the
    shapes the compile step records all go through here.
    """
    if d.HasField("dim_value"):
        value = int(d.dim_value)
        return value if value >= 0 else None
    if d.HasField("dim_param"):
        return d.dim_param
    return None


def shape_of(type_proto: TypeProto) -> list[int | str | None] | None:
    if type_proto.WhichOneof("value") == "optional_type":  # onnxruntime reports the element's shape
        return shape_of(type_proto.optional_type.elem_type)
    if type_proto.WhichOneof("value") != "tensor_type" or not type_proto.tensor_type.HasField("shape"):
        return None
    return [declared_dim(d) for d in type_proto.tensor_type.shape.dim[:]]


def _node_arg(vi: ValueInfoProto) -> NodeArg:
    shape = shape_of(vi.type)
    return NodeArg(vi.name, type_string(vi.type), shape if shape is not None else [])


def model_inputs(model: Model, *, overridable: frozenset[str] = frozenset(), only_overridable: bool = False,
                 infos: Sequence[ValueInfoProto] | None = None) -> list[NodeArg]:
    """The feedable inputs (initializers excluded), or only the overridable initializers.

    ``infos`` are the graph inputs as compiled (free-dimension overrides applied); default: the
    model's own.
    """
    init = model.root.initializers
    infos = model.proto.graph.input if infos is None else infos
    if only_overridable:
        return [_node_arg(i) for i in infos if i.name in overridable]
    return [_node_arg(i) for i in infos if i.name not in init]


def model_outputs(model: Model, infos: Sequence[ValueInfoProto] | None = None) -> list[NodeArg]:
    return [_node_arg(o) for o in (model.proto.graph.output if infos is None else infos)]


def override_dims(inputs: Sequence[ValueInfoProto], outputs: Sequence[ValueInfoProto],
                  by_name: Mapping[str, int], by_denotation: Mapping[str, int]) -> tuple[tuple, tuple]:
    """onnxruntime's free-dimension overrides: symbolic dims named in ``by_name``, and input dims
    whose denotation is in ``by_denotation``, become fixed sizes.  Output dims with the same
    symbolic names follow (onnxruntime's shape inference does the same).  Returns copies
    ``(inputs, outputs)``; the model is not changed."""
    if not by_name and not by_denotation:
        return tuple(inputs), tuple(outputs)
    fixed = dict(by_name)
    new_inputs = []
    for vi in inputs:
        vi = _copy(vi)
        for d in _dims(vi):
            value = by_denotation.get(d.denotation) if d.denotation else None
            named = by_name.get(d.dim_param) if d.HasField("dim_param") else None
            if value is not None and named is not None and value != named:
                raise InvalidArgument(f"Conflicting free dimension overrides. (input {vi.name!r}: dimension "
                                      f"{d.dim_param!r} is {named} by name and {value} by denotation {d.denotation!r})")
            value = named if value is None else value
            if value is not None:
                if d.HasField("dim_param"):
                    fixed.setdefault(d.dim_param, value)
                if not isinstance(declared_dim(d), int):  # symbolic, unknown, or a legacy -1
                    d.dim_value = value
        new_inputs.append(vi)
    new_outputs = []
    for vi in outputs:
        vi = _copy(vi)
        for d in _dims(vi):
            if d.HasField("dim_param") and d.dim_param in fixed:
                d.dim_value = fixed[d.dim_param]
        new_outputs.append(vi)
    return tuple(new_inputs), tuple(new_outputs)


def _copy(vi: ValueInfoProto) -> ValueInfoProto:
    out = ValueInfoProto()
    out.CopyFrom(vi)
    return out


def _dims(vi: ValueInfoProto) -> Sequence[Any]:
    t = vi.type
    if t.WhichOneof("value") == "tensor_type" and t.tensor_type.HasField("shape"):
        return t.tensor_type.shape.dim
    return ()


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


def validate_feed(model: Model, input_feed: Any, overridable: frozenset[str], defaults: Mapping[str, Any], *,
                  inputs: Sequence[ValueInfoProto] | None = None, spec: tuple | None = None) -> dict[str, Any]:
    """Checks a run's feed against the model's declared inputs (``inputs``: as compiled, with
    free-dimension overrides) and coerces it as onnxruntime does; returns name -> value for every
    input (overridable initializers not fed take their defaults, optional inputs not fed are None).

    Coercion: an OrtValue gives its value; nested lists (and Python scalars) become arrays of the
    declared element type; ``bytes``/``np.void``/``str`` arrays fed to a string input become
    object arrays of ``str``; lists fed to a sequence input become lists of arrays.

    Raises:
        InvalidArgument: not a dict, an unknown or missing name, a wrong dtype, rank or fixed dim
            (onnxruntime's messages, followed by the declared and given shapes).
    """
    if not isinstance(input_feed, dict):
        raise InvalidArgument(f"run: input_feed must be a dict of name -> array, got {type(input_feed).__name__}")
    consts = model.root.initializers
    infos = model.proto.graph.input if inputs is None else inputs
    declared, required, types = feed_spec(infos, consts, overridable) if spec is None else spec
    for n in input_feed:
        if n not in declared:
            unknown = [n for n in input_feed if n not in declared]
            feedable = [i.name for i in infos if i.name not in consts]
            raise InvalidArgument(f"Invalid input name: {unknown[0]} (unknown input name(s) {unknown}; "
                                  f"the model's inputs are {feedable})")
    for n in required:
        if input_feed.get(n) is None:
            check_required(infos, declared, overridable, input_feed)  # raises, with onnxruntime's message
    feeds: dict[str, Any] = {}
    for name, type_proto in types:
        value = input_feed.get(name)
        if value is None:
            feeds[name] = defaults[name] if name in overridable else None
        else:
            feeds[name] = coerce_input(name, type_proto, value)
    return feeds


def feed_spec(infos: Sequence[ValueInfoProto], consts: Mapping[str, Any],
              overridable: frozenset[str]) -> tuple[dict[str, ValueInfoProto], tuple[str, ...], tuple]:
    """What :func:`validate_feed` reads of the declared inputs: the feedable names (name -> its
    ValueInfoProto), the required ones, and each feedable one's type.  A runner makes it once
    (reading it from the protos cost ~10 protobuf field reads per input and run)."""
    declared = {i.name: i for i in infos if i.name not in consts or i.name in overridable}
    required = tuple(vi.name for vi in infos if vi.name in declared and vi.name not in overridable
                     and vi.type.WhichOneof("value") != "optional_type")
    return declared, required, tuple((name, vi.type) for name, vi in declared.items())


def check_required(infos: Sequence[ValueInfoProto], feedable: Collection[str], overridable: Collection[str],
                   input_feed: Mapping[str, Any]) -> None:
    """onnxruntime's check that every required input is fed (not optional, not an overridable
    initializer, and not None); raises its ValueError ("Required inputs ... are missing ...")."""
    missing = [vi for vi in infos if vi.name in feedable and vi.name not in overridable and input_feed.get(vi.name) is None
               and vi.type.WhichOneof("value") != "optional_type"]
    if missing:
        details = "; ".join(f"{vi.name!r}: {type_string(vi.type)} {shape_of(vi.type)}" for vi in missing)
        raise InvalidArgument(f"Required inputs ({[vi.name for vi in missing]}) are missing from input feed "
                              f"({list(input_feed)}). ({details})")


def distinct_outputs(values: Sequence[Any]) -> list[Any]:
    """The run's output values with any array sharing memory with an earlier one copied: two graph
    outputs of one value (``y`` and ``Identity(y)``), or overlapping views of one buffer, are
    separate arrays for the user, as onnxruntime's are (writing into one must not change the
    other).  Only arrays over the same base buffer are compared."""
    if len(values) < 2:
        return list(values)
    out = list(values)
    seen: dict[int, list[np.ndarray]] = {}
    for i, v in enumerate(values):
        if not isinstance(v, np.ndarray) or not v.size:
            continue
        root = v
        while isinstance(root.base, np.ndarray):
            root = root.base
        others = seen.setdefault(id(root), [])
        if any(o is v or np.may_share_memory(o, v) for o in others):
            out[i] = v.copy()
        else:
            others.append(v)
    return out


def to_user(value: Any, feeds: Sequence[Any] = (), name: str = "") -> Any:
    """An output as the user gets it: never a read-only view of a weight or blob, never memory
    of one of the run's inputs (a graph input passed through is copied, as onnxruntime does),
    strings as object arrays of ``str``, sequences as lists of such arrays.

    A fresh array is handed out as a view of itself: onnxruntime's outputs are zero-copy views
    of the buffer the session allocated (``output.base`` is that buffer), and code checks it.

    A read-only output may be a broadcast view (Expand) far larger than any allocation: copying
    it is then the output's RuntimeFailure, not numpy's MemoryError."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "SU":
            return _as_str_objects(value)
        if not value.flags.writeable or any(isinstance(f, np.ndarray) and np.may_share_memory(value, f) for f in feeds):
            try:
                return np.array(value, order="C").view()
            except (MemoryError, ValueError) as exc:
                raise RuntimeFailure(
                    f"run: output {name!r} ({value.dtype}{list(value.shape)}, {value.nbytes} bytes) cannot be "
                    f"allocated: {exc}") from exc
        return value if value.base is not None else value.view()
    if isinstance(value, list):
        return [to_user(v, feeds, name) for v in value]
    return value


def _as_str_objects(arr: np.ndarray) -> np.ndarray:
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, v in enumerate(arr.reshape(-1).tolist()):
        flat[i] = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
    return out


def _elem_dtype(elem_type: int) -> np.dtype | None:
    if elem_type == TensorProto.STRING:
        return np.dtype(object)
    try:
        return np.dtype(tensor_dtype_to_np_dtype(elem_type))
    except Exception:  # UNDEFINED or a type numpy cannot hold
        return None


# id(TypeProto) -> (the proto, its numpy dtype, its declared dims with None for any size, or
# None for no shape): a plain tensor input's checks without reading the proto again (reading
# its dims through protobuf cost ~4 us per input and run; Silero VAD feeds three).  The proto is
# kept in the entry, so an id is never reused while its entry lives; bounded.
_TENSOR_SPECS: dict[int, tuple[Any, np.dtype, tuple[int | None, ...] | None]] = {}


def _fast_tensor(type_proto: TypeProto, value: Any) -> bool:
    """Whether ``value`` (an ndarray) passes ``type_proto``'s checks by its cached spec."""
    spec = _TENSOR_SPECS.get(id(type_proto))
    if spec is None or spec[0] is not type_proto or value.dtype != spec[1]:
        return False
    dims = spec[2]
    if dims is None:
        return True
    if value.ndim != len(dims):
        return False
    for d, n in zip(dims, value.shape):
        if d is not None and d != n:
            return False
    return True


def _remember_tensor(type_proto: TypeProto, expected: np.dtype) -> None:
    if len(_TENSOR_SPECS) >= 4096:
        _TENSOR_SPECS.clear()
    tt = type_proto.tensor_type
    dims = None
    if tt.HasField("shape"):
        dims = tuple(d if isinstance(d, int) else None for d in (declared_dim(x) for x in tt.shape.dim[:]))
    _TENSOR_SPECS[id(type_proto)] = (type_proto, expected, dims)


def coerce_input(name: str, type_proto: TypeProto, value: Any) -> Any:
    """One fed value as a run takes it (see :func:`validate_feed`)."""
    if value.__class__ is np.ndarray and _fast_tensor(type_proto, value):
        return value
    if isinstance(value, OrtValue):
        value = value._value
    if isinstance(value, SparseTensor):
        raise InvalidArgument(f"run: input {name!r}: sparse tensors are not taken as inputs (no kernel here "
                              "computes on sparse data); feed sparse_tensor.to_dense()")
    kind = type_proto.WhichOneof("value")
    if kind == "optional_type":
        return coerce_input(name, type_proto.optional_type.elem_type, value)
    if kind == "sequence_type":
        if not isinstance(value, (list, tuple)):
            raise InvalidArgument(f"run: input {name!r} is a {type_string(type_proto)}: expected a list, "
                                  f"got {type(value).__name__}")
        return [coerce_input(name, type_proto.sequence_type.elem_type, v) for v in value]
    if kind != "tensor_type":
        return value
    tt = type_proto.tensor_type
    expected = _elem_dtype(tt.elem_type)
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple, int, float, bool, str, bytes)):
        try:
            arr = np.asarray(value, dtype=expected if expected is not None and expected != object else None)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"run: input {name!r}: cannot convert the {type(value).__name__} to "
                                  f"{type_string(type_proto)} ({exc})") from exc
    else:
        arr = np.asarray(value)
    if expected == object and arr.dtype.kind in "OUSV":
        if arr.dtype.kind != "O" or any(not isinstance(v, str) for v in arr.reshape(-1).tolist()):
            arr = _strings(arr)
    elif expected is not None and arr.dtype != expected:
        raise InvalidArgument(
            f"Unexpected input data type. Actual: ({_type_of(arr)}) , expected: ({type_string(type_proto)}) "
            f"for input {name!r} (numpy {arr.dtype})")
    if tt.HasField("shape"):
        _check_shape(name, type_proto, arr)
    if expected is not None and expected != object:
        _remember_tensor(type_proto, expected)
    return arr


def _strings(arr: np.ndarray) -> np.ndarray:
    """str/bytes/void/object arrays as object arrays of ``str``: bytes and void items decoded as
    UTF-8, the items of an object array converted with ``str()`` (as onnxruntime does)."""
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    decode = arr.dtype.kind in "SV"
    for i, v in enumerate(arr.reshape(-1)):
        if isinstance(v, np.void):
            v = v.tobytes().rstrip(b"\0")
        flat[i] = bytes(v).decode("utf-8") if decode else str(v)
    return out


def _type_of(arr: np.ndarray) -> str:
    if arr.dtype.kind in "OUS":
        return "tensor(string)"
    try:
        return f"tensor({_ELEM_NAMES[np_dtype_to_tensor_dtype(arr.dtype)]})"
    except Exception:  # a dtype with no ONNX element type
        return f"numpy {arr.dtype}"


def _check_shape(name: str, type_proto: TypeProto, arr: np.ndarray) -> None:
    dims = type_proto.tensor_type.shape.dim
    declared, got = shape_of(type_proto), list(arr.shape)
    if arr.ndim != len(dims):
        raise InvalidArgument(
            f"Invalid rank for input: {name} Got: {arr.ndim} Expected: {len(dims)} Please fix either the inputs/outputs "
            f"or the model. (input {name!r}: declared shape {declared}, got {got})")
    bad = [(k, arr.shape[k], fixed) for k, d in enumerate(dims)
           if isinstance(fixed := declared_dim(d), int) and fixed != arr.shape[k]]
    if bad:
        # onnxruntime puts each index on its own line; one line here (CLI errors are one line)
        lines = "".join(f" index: {k} Got: {g} Expected: {e}" for k, g, e in bad)
        raise InvalidArgument(
            f"Got invalid dimensions for input: {name} for the following indices{lines} Please fix either the "
            f"inputs/outputs or the model. (input {name!r}: declared shape {declared}, got {got})")
