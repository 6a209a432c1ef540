"""InferenceSession: onnxruntime's Python API over a compiled :class:`Program`.

Creation is load → :func:`~onnxpack.session._compile.compile` → (optionally) save; every run API
goes through :class:`~onnxpack.session._runner.Runner`.  What lives elsewhere: value types
(``_ortvalue``), bindings (``_iobinding``), run options and controls (``_run_options``), the
profiler (``_profile``), providers (``_providers``), devices (``_devices``), user-supplied data
and ``ort_config`` (``_load``), BLAS threads (``_threads``), logging (``_logging``).  Errors of
every public method are onnxruntime's classes as well as ours (``errors.as_onnxruntime_error``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from onnxpack.errors import InvalidArgument, ModelLoadCanceled
from onnxpack.graph import Model
from onnxpack.prepack import PackSources, PrepackedWeightsContainer
from onnxpack.session import _providers
from onnxpack.session._api import (ModelMetadata, NodeArg, check_required, model_inputs, model_metadata, model_outputs,
                                   distinct_outputs, to_user, type_string)
from onnxpack.session._compile import compile
from onnxpack.session._iobinding import IOBinding
from onnxpack.session._load import compile_options, load_for_session, options_from_model
from onnxpack.session._logging import SessionLog
from onnxpack.session._optimize import save_program
from onnxpack.session._ortvalue import OrtValue
from onnxpack.session._profile import Profiler
from onnxpack.session._providers import ProviderAPI, ort_errors as _ort_errors
from onnxpack.session._program import Program
from onnxpack.session._runner import Runner
from onnxpack.session.options import SessionOptions, check_severity, validate_config

__all__ = ["InferenceSession"]

_HOLDER_IDS = itertools.count(1)


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector paused while a session is built (when it was running).

    Creation allocates tens of thousands of objects that live as long as the session (the
    parsed model, kernels, plans, records), and makes next to no cyclic garbage: each of the
    ~25 collections their allocation set off during creation walked them for nothing (measured
    on the Qwen2.5-0.5B shape: 24 young and 2 middle-generation collections, 4-9 ms of a 55-100
    ms warm create).  Once creation ends the collector runs as before; its first pass walks the
    new objects once (1.6-2.4 ms).  A concurrent ``gc.disable()`` in another thread during a
    creation is overridden when the creation ends, as with any code that pauses the collector.
    """
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            _promote_young()
            gc.enable()


def _promote_young() -> None:
    """Moves the objects the collector tracks into its oldest generation without walking them.

    What a session builds lives as long as the session; left young, the first collection after
    creation walks every one of them (2-4 ms after an LLM's creation, ~60,000 objects) to find no
    garbage, and a later one walks them again on their way to the oldest generation.
    ``gc.freeze()`` then ``gc.unfreeze()`` splices the generations' lists onto the oldest one
    (constant time, CPython's gc_list_merge).  Skipped when the process froze objects itself
    (``gc.freeze()`` before forking workers): unfreezing would hand those back to the collector.
    Young garbage of the caller's, if any, is then found by the next full collection instead.
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


class InferenceSession(ProviderAPI):
    """Runs an ONNX model with numpy; mirrors ``onnxruntime.InferenceSession`` (docs/api.md).

    Args:
        path_or_bytes: model file path, or the serialized model.
        sess_options: :class:`SessionOptions`.
        providers, provider_options: as onnxruntime's; the session runs on CPUExecutionProvider,
            other names warn as on a CPU-only onnxruntime.
        prepacked_weights_container: a :class:`PrepackedWeightsContainer` shared with other
            sessions; without one, the session owns a local container shared by its subgraphs.
        read_config_from_model, enable_fallback: onnxruntime's keyword arguments.
    """

    @_ort_errors
    def __init__(self, path_or_bytes: str | os.PathLike | bytes, sess_options: SessionOptions | None = None,
                 providers: Sequence[Any] | None = None, provider_options: Sequence[dict] | None = None, *,
                 prepacked_weights_container: PrepackedWeightsContainer | None = None, **kwargs: Any) -> None:
        with _gc_paused():
            self._init(path_or_bytes, sess_options, providers, provider_options, prepacked_weights_container, kwargs)

    def _init(self, path_or_bytes, sess_options, providers, provider_options, prepacked_weights_container,
              kwargs: dict) -> None:
        # Runs in flight, counted under a plain lock (entered and left at every run: a Condition's
        # own methods are Python); close() waits on a Condition over the same lock.
        self._mutex = threading.Lock()
        self._closed, self._runs, self._lock = True, 0, threading.Condition(self._mutex)
        options = sess_options if sess_options is not None else SessionOptions()
        if not isinstance(options, SessionOptions):
            raise InvalidArgument(f"sess_options: expected onnxpack.SessionOptions, got {type(sess_options).__name__}")
        names, opts = _providers.normalize_providers(providers, provider_options)
        self._providers, self._provider_options = _providers.session_providers(names, opts)
        self._fallback = int(kwargs.get("enable_fallback", 1)) == 1
        container = prepacked_weights_container
        if container is not None and not isinstance(container, PrepackedWeightsContainer):
            raise InvalidArgument(
                f"prepacked_weights_container: expected onnxpack.PrepackedWeightsContainer, got {type(container).__name__}")
        self._config = validate_config(options.config)
        if options.load_cancelled:
            raise ModelLoadCanceled("Model loading was canceled (SessionOptions.set_load_cancellation_flag)")
        t0 = time.perf_counter_ns()
        self._model: Model = load_for_session(path_or_bytes, options)
        self._container = container if container is not None else PrepackedWeightsContainer()
        holder = next(_HOLDER_IDS)
        self._finalizer = weakref.finalize(self, self._container.release, holder)
        try:
            self._create(options, kwargs, holder, t0, isinstance(path_or_bytes, (bytes, bytearray, memoryview)))
        except BaseException:
            self._finalizer()
            self._model.close()
            raise
        self._closed = False

    def _create(self, options: SessionOptions, kwargs: dict, holder: int, t_load: int, from_bytes: bool) -> None:
        read = kwargs.get("read_config_from_model")
        self._options = options = options_from_model(self._model, options, None if read is None else int(read) == 1)
        check_severity(options.log_severity_level, "log_severity_level", allow_default=True)
        self._log = SessionLog(__name__, options.logid, options.log_severity_level)
        profiler = Profiler(options.profile_file_prefix, t_load) if options.enable_profiling else None
        t1 = time.perf_counter_ns()
        cfg = self._config
        # Blobs that will be saved again must be proven to match their weights (issue 12): a
        # session that saves verifies in full, as onnxpack optimize does.
        saving = bool(options.optimized_model_filepath and cfg["session.save_external_prepacked_constant_initializers"])
        sources = PackSources(self._model, verify=bool(cfg["onnxpack.verify_prepacked"]) or saving,
                              cache_path=cfg["onnxpack.prepacked_cache_path"] or "")
        self._program: Program = compile(self._model, compile_options(options, cfg), sources, self._container, holder)
        sources.flush_cache()
        if options.optimized_model_filepath:
            save_program(self._model, self._program, os.fspath(options.optimized_model_filepath), cfg)
        self._runner = Runner(self._model, self._program, options, cfg, profiler)
        init = self._model.root.initializers
        self._feedable = frozenset(n for n in (i.name for i in self._program.inputs) if n not in init) \
            | self._program.overridable
        self._output_types = {o.name: type_string(o.type) for o in self._program.outputs}
        if profiler is not None:
            profiler.event("Session", "model_loading_array" if from_bytes else "model_loading_uri", t_load, t1)
            profiler.event("Session", "session_initialization", t1, time.perf_counter_ns())
        self._log.log(1, "session created: %d nodes, %d run by onnx.reference, %d weights packed",
                      len(self._program.root.steps), len(self._program.fallback_nodes), len(self._program.pack_log))
        # Last: the warm-up thread competes for the GIL with whatever creation still has to do.
        self._program.start_warm_ups()

    # -- description ------------------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return model_inputs(self._model, infos=self._program.inputs)

    def get_outputs(self) -> list[NodeArg]:
        return model_outputs(self._model, self._program.outputs)

    def get_overridable_initializers(self) -> list[NodeArg]:
        return model_inputs(self._model, overridable=self._program.overridable, only_overridable=True,
                            infos=self._program.inputs)

    def get_modelmeta(self) -> ModelMetadata:
        return model_metadata(self._model)

    def get_session_options(self) -> SessionOptions:
        return self._options

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
    def _enter(self) -> None:
        with self._mutex:
            if self._closed:
                raise InvalidArgument("this InferenceSession is closed")
            self._runs += 1

    def _exit(self) -> None:
        with self._mutex:
            self._runs -= 1
            if self._closed and not self._runs:  # close() is waiting for the last run
                self._lock.notify_all()

    @_ort_errors
    def run(self, output_names: Sequence[str] | None, input_feed: dict[str, Any], run_options: Any = None) -> list[Any]:
        self._enter()
        try:
            names, values, inputs = self._runner.execute(input_feed, output_names, run_options)
            return [to_user(v, inputs, n) for n, v in zip(names, distinct_outputs(values))]
        finally:
            self._exit()

    @_ort_errors
    def run_with_ort_values(self, output_names: Sequence[str] | None, input_dict_ort_values: dict[str, Any],
                            run_options: Any = None) -> list[OrtValue]:
        self._enter()
        try:
            names, values, inputs = self._runner.execute(input_dict_ort_values, output_names, run_options)
            return [OrtValue(to_user(v, inputs, n), self._output_types.get(n))
                    for n, v in zip(names, distinct_outputs(values))]
        finally:
            self._exit()

    def run_with_ortvaluevector(self, run_options, feed_names, feeds, fetch_names, fetches: list, fetch_devices=None) -> None:
        """Fills ``fetches`` (a list) with the outputs as OrtValues."""
        fetches[:] = self.run_with_ort_values(list(fetch_names), dict(zip(feed_names, feeds)), run_options)

    @_ort_errors
    def run_async(self, output_names: Sequence[str] | None, input_feed: dict[str, Any],
                  callback: Callable[[list, Any, str], None], user_data: Any, run_options: Any = None) -> None:
        """Runs in a new thread, then calls ``callback(outputs, user_data, error_message)``
        (``[]`` and the message on failure, the outputs and ``""`` on success)."""
        check_required(self._program.inputs, self._feedable, self._program.overridable, input_feed)

        def work() -> None:
            try:
                outputs = self.run(output_names, input_feed, run_options)
            except Exception as exc:  # reported to the callback, as onnxruntime does
                callback([], user_data, str(exc))
            else:
                callback(outputs, user_data, "")

        threading.Thread(target=work, name="onnxpack-run-async", daemon=True).start()

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    @_ort_errors
    def run_with_iobinding(self, iobinding: IOBinding, run_options: Any = None) -> None:
        if not isinstance(iobinding, IOBinding) or iobinding._session is not self:
            raise InvalidArgument("IOBinding must be used with the session that created it.")
        self._enter()
        try:
            iobinding._run(self._runner, run_options, self._output_types)
        finally:
            self._exit()

    # -- profiling --------------------------------------------------------------------------------
    def end_profiling(self) -> str:
        """Writes the profile (Chrome trace JSON) and returns its file name; '' if not profiling."""
        profiler = self._runner.profiler
        return profiler.end() if profiler is not None else ""

    def get_profiling_start_time_ns(self) -> int:
        return self._runner.profiler.start_ns if self._runner.profiler is not None else 0

    def get_memory_plan(self, input_shapes: dict[str, Sequence[int]] | None = None) -> dict[str, Any] | None:
        """The root graph's activation memory plan (``ArenaRunner.memory_plan``) or ``None``."""
        if self._closed:
            raise InvalidArgument("this InferenceSession is closed")
        arena = self._runner.arena
        return None if arena is None else arena.memory_plan(input_shapes)

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
        self._runner.arena = None
        self._model.close()

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
