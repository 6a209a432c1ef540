"""InferenceSession: onnxruntime's Python API over a compiled :class:`Program`.

Creation is load → :func:`~onnxpack.session._compile.compile` → (optionally) save; running is
the program's root plan through the one step loop (or the memory planner's hook).  Everything
else here is the onnxruntime facade: options, providers, NodeArgs, feed checks, close.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.graph import Model, load_model
from onnxpack.prepack import PackSources, PrepackedWeightsContainer
from onnxpack.session._api import (
    ModelMetadata,
    NodeArg,
    model_inputs,
    model_metadata,
    model_outputs,
    to_user,
    validate_feed,
)
from onnxpack.session._arena import ArenaRunner
from onnxpack.session._compile import CompileOptions, compile
from onnxpack.session._optimize import save_program
from onnxpack.session._program import Program, run_plan
from onnxpack.session.options import SessionOptions, validate_config

__all__ = ["InferenceSession"]

_HOLDER_IDS = itertools.count(1)
_SUPPORTED_PROVIDERS = ("CPUExecutionProvider",)


class InferenceSession:
    """Runs an ONNX model with numpy; mirrors ``onnxruntime.InferenceSession``.

    Args:
        path_or_bytes: model file path, or the serialized model.
        sess_options: :class:`SessionOptions` (config keys, optimized model path, initializers).
        providers: ``None`` or ``["CPUExecutionProvider"]``.
        prepacked_weights_container: a :class:`PrepackedWeightsContainer` shared with other
            sessions; without one, the session owns a local container shared by its subgraphs.
    """

    def __init__(
        self,
        path_or_bytes: str | os.PathLike | bytes,
        sess_options: SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[dict] | None = None,
        *,
        prepacked_weights_container: PrepackedWeightsContainer | None = None,
    ) -> None:
        self._closed = True
        self._runs = 0  # runs in flight: close() waits for them
        self._lock = threading.Condition()
        self._options = sess_options if sess_options is not None else SessionOptions()
        if not isinstance(self._options, SessionOptions):
            raise InvalidArgument(f"sess_options: expected onnxpack.SessionOptions, got {type(sess_options).__name__}")
        self._config = validate_config(self._options.config)
        self._providers = _check_providers(providers)
        container = prepacked_weights_container
        if container is not None and not isinstance(container, PrepackedWeightsContainer):
            raise InvalidArgument(
                f"prepacked_weights_container: expected onnxpack.PrepackedWeightsContainer, got {type(container).__name__}"
            )
        self._container = container if container is not None else PrepackedWeightsContainer()
        holder = next(_HOLDER_IDS)
        self._finalizer = weakref.finalize(self, self._container.release, holder)
        self._model: Model = load_model(path_or_bytes if isinstance(path_or_bytes, bytes) else os.fspath(path_or_bytes))
        cfg = self._config
        try:
            # Blobs that will be saved again must be proven to match their weights (issue 12): a
            # session that saves verifies in full, as onnxpack optimize does.
            saving = bool(self._options.optimized_model_filepath and cfg["session.save_external_prepacked_constant_initializers"])
            sources = PackSources(self._model, verify=bool(cfg["onnxpack.verify_prepacked"]) or saving,
                                  cache_path=cfg["onnxpack.prepacked_cache_path"] or "")
            options = CompileOptions(prepack=not cfg["session.disable_prepacking"],
                                     initializers=self._options.initializers)
            self._program: Program = compile(self._model, options, sources, self._container, holder)
            sources.flush_cache()
            if self._options.optimized_model_filepath:
                save_program(self._model, self._program, os.fspath(self._options.optimized_model_filepath), cfg)
        except BaseException:
            self._finalizer()
            self._model.close()
            raise
        planner = cfg["onnxpack.memory_planner"]
        self._arena = None if planner in (None, "none") else ArenaRunner(self._program.root, planner)
        self._closed = False

    # -- description ------------------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return model_inputs(self._model)

    def get_outputs(self) -> list[NodeArg]:
        return model_outputs(self._model)

    def get_overridable_initializers(self) -> list[NodeArg]:
        return model_inputs(self._model, overridable=self._program.overridable, only_overridable=True)

    def get_modelmeta(self) -> ModelMetadata:
        return model_metadata(self._model)

    def get_session_options(self) -> SessionOptions:
        return self._options

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_prepack_stats(self) -> dict[str, Any]:
        return self._program.stats.as_dict()

    def get_fallback_nodes(self) -> list[str]:
        """Nodes run by onnx.reference (no native kernel), as ``scope:node:op_type``."""
        return list(self._program.fallback_nodes)

    def get_prepack_log(self) -> list[dict[str, Any]]:
        """One row per packed kernel input: node, weight, key, bytes and where the blob came from."""
        return [e.as_row() for e in self._program.pack_log]

    @property
    def model(self) -> Model:
        return self._model

    @property
    def program(self) -> Program:
        """The compiled program this session runs (frozen plans, pack log, stats)."""
        return self._program

    # -- running ----------------------------------------------------------------------------------
    def run(self, output_names: Sequence[str] | None, input_feed: dict[str, Any], run_options: Any = None) -> list[np.ndarray]:
        with self._lock:
            if self._closed:
                raise InvalidArgument("this InferenceSession is closed")
            self._runs += 1
        try:
            program = self._program
            program.check_files()
            root = program.root
            feeds = validate_feed(self._model, input_feed, program.overridable, program.defaults)
            all_outputs = root.output_names
            if output_names:
                missing = [n for n in output_names if n not in all_outputs]
                if missing:
                    raise InvalidArgument(
                        f"run: unknown output name(s) {missing}; the model's outputs are {list(all_outputs)}")
            inputs = [feeds[n] for n in root.input_names]
            values = run_plan(root, inputs) if self._arena is None else self._arena.run(inputs)
            result = dict(zip(all_outputs, values))
            names = list(output_names) if output_names else all_outputs
            return [to_user(result[n], n) for n in names]
        finally:
            with self._lock:
                self._runs -= 1
                self._lock.notify_all()

    def get_memory_plan(self, input_shapes: dict[str, Sequence[int]] | None = None) -> dict[str, Any] | None:
        """The activation memory plan of the root graph, or ``None`` when there is none yet.

        Plans are made at the first run for a set of input shapes (with
        ``onnxpack.memory_planner`` set), so this is ``None`` before that run and when the
        planner is off.  Without ``input_shapes`` the latest plan is returned.  The dict is
        :meth:`PlanResult.as_dict` (algorithm, totals, lower bound, per memory arena/peak, per
        tensor name/memory/offset/size/first/last, plus nbytes/dtype/shape/node) with the input
        ``signature``, ``steps``, ``planned_steps`` and the ``lifetimes`` planned.
        """
        if self._closed:
            raise InvalidArgument("this InferenceSession is closed")
        return None if self._arena is None else self._arena.memory_plan(input_shapes)

    # -- closing ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Releases the packed weights and mappings; waits for runs in flight to finish."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._runs:
                self._lock.wait()
        self._finalizer()
        self._arena = None
        self._model.close()

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_providers(providers: Sequence[Any] | None) -> list[str]:
    if providers is None:
        return list(_SUPPORTED_PROVIDERS)
    names = []
    for p in providers:
        name = p[0] if isinstance(p, tuple) else p
        if name not in _SUPPORTED_PROVIDERS:
            raise InvalidArgument(f"providers: onnxpack runs on {', '.join(_SUPPORTED_PROVIDERS)} only, got {name!r}")
        names.append(name)
    return names
