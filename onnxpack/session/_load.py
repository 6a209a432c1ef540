"""What session creation reads besides the model file: user-supplied external data, the
model's own ``ort_config`` session options, and what the options ask of the compile step.

* ``SessionOptions.add_external_initializers(names, values)`` supplies the data of initializers
  the model stores externally, and ``add_external_initializers_from_files_in_memory(files, ...)``
  the content of external data files: the named tensors take their bytes from memory, and their
  files need not exist.  As onnxruntime, a name that is not an initializer of the model's graph,
  or an initializer that is not external, is an error (FAIL).
* With ``ORT_LOAD_CONFIG_FROM_MODEL=1`` in the environment (or ``read_config_from_model=1``), the
  JSON in the model's ``ort_config`` metadata entry sets ``intra_op_num_threads``,
  ``inter_op_num_threads``, ``execution_mode``, ``graph_optimization_level`` and
  ``enable_profiling`` of the session's options (onnxruntime's keys; others are ignored).  The
  caller's SessionOptions object is not modified: the session gets a copy.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np

from onnxpack.errors import Fail, InvalidArgumentStatus, InvalidArgumentType, ModelLoadError
from onnxpack.graph import Model, load_model
from onnxpack.graph._proto import GraphProto, ModelProto, TensorProto, tensor_dtype_to_np_dtype
from onnxpack.session._compile import CompileOptions
from onnxpack.session.options import ExecutionMode, GraphOptimizationLevel, SessionOptions

__all__ = ["load_for_session", "options_from_model", "compile_options"]

logger = logging.getLogger(__name__)


def load_for_session(path_or_bytes: Any, options: SessionOptions) -> Model:
    """The model, with user-supplied external data in place of the files it names."""
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        source: Any = bytes(path_or_bytes)
    elif isinstance(path_or_bytes, (str, os.PathLike)):
        source = os.fspath(path_or_bytes)
    else:
        raise InvalidArgumentType(f"Unable to load from type '{type(path_or_bytes)}'")
    by_name, by_file = options.external_initializers, options.external_files
    if not by_name and not by_file:
        return load_model(source)
    if isinstance(source, str):
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ModelLoadError(f"cannot read model file {source!r}: {exc.strerror}") from exc
        base_dir = os.path.dirname(os.path.abspath(source))
    else:
        data, base_dir = source, None
    proto = ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception:  # load_model says what is wrong with the bytes
        return load_model(source)
    _supply(proto.graph, by_name, by_file)
    return load_model(proto.SerializeToString(), base_dir=base_dir)


def _supply(graph: GraphProto, by_name: dict[str, np.ndarray], by_file: dict[str, bytes]) -> None:
    inits = {t.name: t for t in graph.initializer}
    for name in by_name:
        t = inits.get(name)
        if t is None:
            raise Fail(f"add_external_initializers: Failed to find existing initializer with name {name}.")
        if t.data_location != TensorProto.EXTERNAL:
            raise Fail(f"add_external_initializers: Trying to replace non-external initializer {name!r} with external data")
    for t in inits.values():
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if t.name in by_name:
            _replace(t, by_name[t.name])
        elif info.get("location") in by_file:
            blob = by_file[info["location"]]
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if info.get("length") else len(blob) - offset
            if offset < 0 or length < 0 or offset + length > len(blob):
                raise Fail(f"initializer {t.name!r}: bytes [{offset}, {offset + length}) are outside the in-memory "
                           f"file {info['location']!r} of {len(blob)} bytes")
            _set_raw(t, blob[offset: offset + length])


def _replace(t: TensorProto, value: np.ndarray) -> None:
    dtype = tensor_dtype_to_np_dtype(t.data_type)
    value = np.asarray(value)
    if value.dtype != dtype or list(value.shape) != list(t.dims):
        raise Fail(f"add_external_initializers: initializer {t.name!r} is {np.dtype(dtype)}{list(t.dims)}, "
                   f"the value given is {value.dtype}{list(value.shape)}")
    from onnx import numpy_helper  # add_external_initializers only

    new = numpy_helper.from_array(value, t.name)
    t.CopyFrom(new)


def _set_raw(t: TensorProto, raw: bytes) -> None:
    del t.external_data[:]
    t.data_location = TensorProto.DEFAULT
    t.raw_data = raw


def compile_options(options: SessionOptions, config: dict[str, Any]) -> CompileOptions:
    """What the session's options ask of the compile step (``config``: the validated entries)."""
    by_name, by_denotation = options.free_dimensions
    return CompileOptions(prepack=not config["session.disable_prepacking"], initializers=options.initializers,
                          fuse=options.graph_optimization_level != GraphOptimizationLevel.ORT_DISABLE_ALL,
                          dims_by_name=by_name, dims_by_denotation=by_denotation,
                          qdq_accuracy_level=config["session.qdq_matmulnbits_accuracy_level"],
                          qdq_rewrite=options.graph_optimization_level >= GraphOptimizationLevel.ORT_ENABLE_EXTENDED)


_ORT_CONFIG_KEY = "ort_config"


def options_from_model(model: Model, options: SessionOptions, enabled: bool | None = None) -> SessionOptions:
    """``options`` updated from the model's ``ort_config`` JSON when enabled (see the module)."""
    if enabled is None:
        enabled = os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1"
    if not enabled:
        return options
    text = next((m.value for m in model.proto.metadata_props if m.key == _ORT_CONFIG_KEY), None)
    if text is None:
        return options
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentStatus(f"Json stored in the `ort_config` key cannot be parsed. Error message: {exc}") from exc
    new = options.copy()
    for key, value in (config.get("session_options") or {}).items():
        setter = _SETTERS.get(key)
        if setter is None:
            logger.info("Ignoring unsupported session option in ORT config: %s", key)
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentStatus(f"{key} option in the model file must be an integer")
        setter(new, value)
    return new


def _threads(attr: str):
    def set_(o: SessionOptions, v: int) -> None:
        if v < 0:
            raise InvalidArgumentStatus(f"Unsupported value for {attr}: {v}")
        setattr(o, attr, v)
    return set_


def _enum(attr: str, enum: Any, what: str):
    def set_(o: SessionOptions, v: int) -> None:
        try:
            setattr(o, attr, enum(v))
        except ValueError:
            raise InvalidArgumentStatus(f"Unsupported {what} value in ORT config: {v}") from None
    return set_


def _profiling(o: SessionOptions, v: int) -> None:
    if v not in (0, 1):
        raise InvalidArgumentStatus(f"Unsupported value for enable_profiling option: {v}")
    o.enable_profiling = bool(v)


_SETTERS = {
    "intra_op_num_threads": _threads("intra_op_num_threads"),
    "inter_op_num_threads": _threads("inter_op_num_threads"),
    "execution_mode": _enum("execution_mode", ExecutionMode, "execution_mode"),
    "graph_optimization_level": _enum("graph_optimization_level", GraphOptimizationLevel, "graph_optimization_level"),
    "enable_profiling": _profiling,
}
