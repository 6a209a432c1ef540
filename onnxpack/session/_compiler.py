"""onnxruntime's ``ModelCompiler`` (the EPContext compile API) on a runtime with no compiling
execution provider.

onnxruntime with only the CPU provider "compiles" no node: ``compile_to_file`` / ``_bytes`` /
``_stream`` write the model unchanged (externalizing large initializers when asked), and
``ERROR_IF_NO_NODES_COMPILED`` fails with FAIL.  Here the same, except that ``compile_to_file``
is ``onnxpack optimize``'s save: the model with its weights pre-packed next to them (onnxpack's
own form of a compiled model, standard ONNX that every runtime loads).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from onnxpack.errors import Fail, InvalidArgumentStatus, InvalidArgumentType
from onnxpack.session._devices import OrtCompileApiFlags
from onnxpack.session.options import GraphOptimizationLevel, SessionOptions

__all__ = ["ModelCompiler"]


class ModelCompiler:
    """Compiles (here: pre-packs and saves) a model; see the module docstring."""

    def __init__(self, sess_options: SessionOptions, input_model_path_or_bytes: str | os.PathLike | bytes,
                 embed_compiled_data_into_model: bool = False,
                 external_initializers_file_path: str | os.PathLike | None = None,
                 external_initializers_size_threshold: int = 1024, flags: int = OrtCompileApiFlags.NONE,
                 graph_optimization_level: GraphOptimizationLevel = GraphOptimizationLevel.ORT_DISABLE_ALL,
                 get_initializer_location_func: Callable[..., Any] | None = None) -> None:
        source = input_model_path_or_bytes
        if isinstance(source, (str, os.PathLike)):
            if not os.fspath(source):
                raise InvalidArgumentStatus("Input model path is empty")
        elif isinstance(source, bytes):
            if not source:
                raise InvalidArgumentStatus("Input model bytes array is empty")
        else:
            raise InvalidArgumentType(f"Unable to load from type '{type(source)}'")
        if external_initializers_file_path and get_initializer_location_func is not None:
            raise InvalidArgumentStatus("Cannot initialize ModelCompiler with both `external_initializers_file_path` "
                                        "and `get_initializer_location_func`")
        self._options = sess_options
        self._source = source
        self._data_file = os.fspath(external_initializers_file_path) if external_initializers_file_path else ""
        self._threshold = int(external_initializers_size_threshold)
        self._flags = int(flags)
        self._write_func: Callable[..., Any] | None = None

    def _check(self) -> None:
        if self._flags & OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED:
            raise Fail("Unable to compile any nodes. Check that the session EPs support compilation and can execute at "
                       "least one subgraph in the model.")

    def compile_to_file(self, output_model_path: str | os.PathLike | None = None) -> None:
        """Writes the model with its weights pre-packed next to them (``onnxpack optimize``)."""
        self._check()
        if output_model_path is None:
            if not isinstance(self._source, (str, os.PathLike)):
                raise InvalidArgumentStatus("compile_to_file: an output path is required for a model given as bytes")
            base = os.fspath(self._source)
            output_model_path = (base[:-5] if base.endswith(".onnx") else base) + "_ctx.onnx"
        out = os.fspath(output_model_path)
        if os.path.exists(out) and self._flags & OrtCompileApiFlags.ERROR_IF_OUTPUT_FILE_EXISTS:
            raise Fail(f"Output model path '{out}' already exists")
        from onnxpack.session._optimize import optimize

        config = dict(self._options.config) if isinstance(self._options, SessionOptions) else {}
        config.setdefault("session.save_external_prepacked_constant_initializers", "1")
        config["session.optimized_model_external_initializers_min_size_in_bytes"] = str(self._threshold)
        if self._data_file:
            config["session.optimized_model_external_initializers_file_name"] = os.path.basename(self._data_file)
        if isinstance(self._source, bytes):
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "model.onnx")
                with open(src, "wb") as f:
                    f.write(self._source)
                optimize(src, out, config)
        else:
            optimize(os.fspath(self._source), out, config)

    def compile_to_bytes(self) -> bytes:
        """The serialized model (unchanged: no node is compiled; weights stay inside)."""
        self._check()
        if isinstance(self._source, bytes):
            return self._source
        import onnx

        return onnx.load(os.fspath(self._source)).SerializeToString()

    def compile_to_stream(self, write_function: Callable[[bytes], None]) -> None:
        write_function(self.compile_to_bytes())

    def set_ep_context_data_write_func(self, write_func: Callable[..., Any]) -> None:
        self._write_func = write_func  # no EPContext data is produced

    def clear_ep_context_data_write_func(self) -> None:
        self._write_func = None

    def set_ep_context_binary_information(self, output_directory: str | os.PathLike, model_name: str) -> None:
        if not os.fspath(output_directory) or not model_name:
            raise InvalidArgumentStatus("set_ep_context_binary_information: directory and model name must not be empty")
