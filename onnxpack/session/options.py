"""SessionOptions with onnxruntime's Python API and config keys, plus onnxpack's own keys.

Keys onnxruntime knows keep onnxruntime's names.  Unknown ``onnxpack.*`` keys and invalid values
are errors (raised when added and again at session creation), never silently ignored; other
``session.*`` keys are kept and ignored, as onnxruntime ignores keys it does not use.
"""

from __future__ import annotations

import enum
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnxpack.errors import ConfigError, ConfigKeyNotFound, Fail, InvalidArgumentType, RuntimeInvalidArgument

__all__ = ["SessionOptions", "CONFIG_KEYS", "validate_config", "GraphOptimizationLevel", "ExecutionMode",
           "ExecutionOrder", "check_severity"]

PLANNERS = ("none", "naive", "greedy_by_size", "position_greedy", "auto")


def _bool(key: str, value: str) -> bool:
    if value not in ("0", "1"):
        raise ConfigError(f"config {key!r}: expected '0' or '1', got {value!r}")
    return value == "1"


def _nonneg_int(key: str, value: str) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        raise ConfigError(f"config {key!r}: expected a non-negative integer, got {value!r}") from None
    if n < 0:
        raise ConfigError(f"config {key!r}: expected a non-negative integer, got {value!r}")
    return n


def _granularity(key: str, value: str) -> int:
    n = _nonneg_int(key, value)
    if n < 64 or n & (n - 1):
        raise ConfigError(f"config {key!r}: expected a power of two >= 64, got {value!r}")
    return n


def _accuracy_level(key: str, value: str) -> int:
    n = _nonneg_int(key, value)
    if n > 4:
        raise ConfigError(f"config {key!r}: expected an accuracy level 0-4, got {value!r}")
    return n


def _text(key: str, value: str) -> str:
    if "\x00" in value:
        raise ConfigError(f"config {key!r}: NUL byte in value")
    return value


THREAD_MODES = ("auto", "blas", "owned")


def _one_of(choices: tuple[str, ...]) -> Callable[[str, str], str]:
    """The parser of a key whose value is one of ``choices``."""

    def parse(key: str, value: str) -> str:
        if value not in choices:
            raise ConfigError(f"config {key!r}: expected one of {', '.join(choices)}, got {value!r}")
        return value

    return parse


# key -> (parser, default value as a string, one line of documentation)
CONFIG_KEYS: dict[str, tuple[Callable[[str, str], Any], str, str]] = {
    "session.disable_prepacking": (_bool, "0", "1 turns pre-packing of constant weights off"),
    "session.save_external_prepacked_constant_initializers": (
        _bool, "0", "1 saves pre-packed blobs next to the weights in optimized_model_filepath's data file"),
    "session.optimized_model_external_initializers_file_name": (
        _text, "", "data file name (next to optimized_model_filepath); default <model>.data"),
    "session.optimized_model_external_initializers_min_size_in_bytes": (
        _nonneg_int, "1024", "initializers smaller than this stay inside the saved model"),
    "session.qdq_matmulnbits_accuracy_level": (
        _accuracy_level, "4", "accuracy_level of the MatMulNBits steps that 4-bit blocked DequantizeLinear -> "
        "MatMul pairs run as (onnxruntime's default 4: int8 activations where the int4 GEMV quantizes them)"),
    "onnxpack.align_threshold": (_nonneg_int, "", "tensors/blobs at least this large start on the granularity"),
    "onnxpack.allocation_granularity": (_granularity, str(mmap.ALLOCATIONGRANULARITY), "alignment of large tensors"),
    "onnxpack.prepacked_cache_path": (_text, "", "persistent packed-weight cache file (empty = off)"),
    "onnxpack.verify_prepacked": (_bool, "0", "1 verifies every mapped blob's checksum at load"),
    "onnxpack.memory_planner": (_one_of(PLANNERS), "none", "activation memory planner: " + "|".join(PLANNERS)),
    "onnxpack.specialize_shapes": (_bool, "1", "1 runs a root plan specialized per set of input shapes "
                                   "(shape arithmetic folded, If inlined, guarded)"),
    "onnxpack.thread_mode": (_one_of(THREAD_MODES), "auto", "runs on several threads: blas (numpy's BLAS on "
                             "them), owned (BLAS on one, onnxpack's kernels on them) or auto (a block of each, "
                             "the faster kept)"),
}


def validate_config(config: dict[str, str]) -> dict[str, Any]:
    """Parse every known key (defaults filled in); raise ConfigError on unknown onnxpack.* keys."""
    parsed: dict[str, Any] = {}
    for key, value in config.items():
        if key in CONFIG_KEYS:
            continue
        if key.startswith("onnxpack."):
            known = ", ".join(k for k in CONFIG_KEYS if k.startswith("onnxpack."))
            raise ConfigError(f"unknown config key {key!r}; onnxpack keys are: {known}")
    for key, (parser, default, _doc) in CONFIG_KEYS.items():
        value = config.get(key, default)
        if value == "":  # unset: text keys stay "", numeric keys mean "use the default"
            parsed[key] = "" if parser is _text else None
        else:
            parsed[key] = parser(key, value)
    return parsed


class _OrtEnum(enum.IntEnum):
    """An enum that prints as onnxruntime's pybind11 enums do (``GraphOptimizationLevel.ORT_ENABLE_ALL``)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class GraphOptimizationLevel(_OrtEnum):
    """onnxruntime's graph optimization levels.  onnxpack's graph rewrites are its fusions
    (Conv→BatchNormalization→Relu, elementwise→Relu): ``ORT_DISABLE_ALL`` turns them off, every
    other level keeps them on (there is nothing level-specific beyond them)."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(_OrtEnum):
    """Sequential or parallel execution of independent nodes.  onnxpack runs nodes one after the
    other in both modes (see docs/api.md); the setting is kept and reported."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(_OrtEnum):
    """Node order policy; onnxpack's order is its deterministic topological order in all three."""

    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


def check_severity(value: Any, what: str, *, allow_default: bool) -> int:
    """A logging severity as onnxruntime takes it: 0 verbose .. 4 fatal (-1: "use the default")."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentType(f"{what}: expected an int, got {type(value).__name__}")
    low = -1 if allow_default else 0
    if not low <= int(value) <= 4:
        raise RuntimeInvalidArgument(
            f"{what}: {value} is not a valid severity; expected {low}..4 (0:Verbose, 1:Info, 2:Warning, 3:Error, 4:Fatal)")
    return int(value)


def _typed(name: str, kind: type | tuple[type, ...], doc: str, *, convert: Callable[[Any], Any] | None = None) -> property:
    """A SessionOptions/RunOptions attribute that refuses values of the wrong type (TypeError, as
    onnxruntime's pybind11 setters do) instead of storing something that breaks much later."""
    attr = "_" + name

    def get(self: Any) -> Any:
        return getattr(self, attr)

    def set_(self: Any, value: Any) -> None:
        ok = isinstance(value, kind) and not (kind in (int, (int, np.integer)) and isinstance(value, bool))
        if not ok:
            want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise InvalidArgumentType(f"{name}: expected {want}, got {type(value).__name__} ({value!r})")
        setattr(self, attr, convert(value) if convert else value)

    return property(get, set_, doc=doc)


_INT = (int, np.integer)


class SessionOptions:
    """onnxruntime-compatible session options (every attribute and method of onnxruntime 1.31's
    ``SessionOptions``; docs/api.md says what each one does here)."""

    optimized_model_filepath = _typed("optimized_model_filepath", str, "save the compiled model here (with its packs)")
    logid = _typed("logid", str, "tag of this session's log records")
    log_severity_level = _typed("log_severity_level", _INT, "-1 (the default logger's) or 0..4", convert=int)
    log_verbosity_level = _typed("log_verbosity_level", _INT, "kept (onnxruntime: debug builds only)", convert=int)
    intra_op_num_threads = _typed("intra_op_num_threads", _INT, "BLAS threads during runs (0: leave as is)", convert=int)
    inter_op_num_threads = _typed("inter_op_num_threads", _INT, "kept; nodes run sequentially", convert=int)
    enable_profiling = _typed("enable_profiling", (bool, _INT), "record one trace event per node", convert=bool)
    profile_file_prefix = _typed("profile_file_prefix", str, "prefix of end_profiling()'s JSON file")
    enable_mem_pattern = _typed("enable_mem_pattern", (bool, _INT), "False turns the memory planner off", convert=bool)
    enable_cpu_mem_arena = _typed("enable_cpu_mem_arena", (bool, _INT), "False: planner arenas are not pooled",
                                  convert=bool)
    enable_mem_reuse = _typed("enable_mem_reuse", (bool, _INT), "kept; values are always released after last use",
                              convert=bool)
    use_deterministic_compute = _typed(
        "use_deterministic_compute", (bool, _INT),
        "True: the same bits in every run and process for a given thread count (no timed path or GEMM "
        "split choices, the starting thread mode kept); default from ONNXPACK_DETERMINISTIC=1", convert=bool)
    use_per_session_threads = _typed("use_per_session_threads", (bool, _INT),
                                     "False: use set_global_thread_pool_sizes' intra-op count", convert=bool)
    graph_optimization_level = _typed("graph_optimization_level", GraphOptimizationLevel,
                                      "ORT_DISABLE_ALL turns onnxpack's fusions off")
    execution_mode = _typed("execution_mode", ExecutionMode, "kept; nodes run sequentially")
    execution_order = _typed("execution_order", ExecutionOrder, "kept; onnxpack's topological order")

    def __init__(self) -> None:
        self.optimized_model_filepath = ""
        self.logid = ""
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.enable_mem_pattern = True
        self.enable_cpu_mem_arena = True
        self.enable_mem_reuse = True
        # (A process-wide default, for a test suite or a batch job that compares outputs bit for bit.)
        self.use_deterministic_compute = os.environ.get("ONNXPACK_DETERMINISTIC", "") == "1"
        self.use_per_session_threads = True
        self.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.execution_mode = ExecutionMode.ORT_SEQUENTIAL
        self.execution_order = ExecutionOrder.DEFAULT
        self._config: dict[str, str] = {}
        self._initializers: dict[str, np.ndarray] = {}
        self._external_initializers: dict[str, np.ndarray] = {}
        self._external_files: dict[str, bytes] = {}
        self._dims_by_name: dict[str, int] = {}
        self._dims_by_denotation: dict[str, int] = {}
        self._providers: list[tuple[str, dict[str, str]]] = []
        self._cancel_load = False

    # -- config entries ---------------------------------------------------------------------------
    def add_session_config_entry(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(f"config entries are strings; got {type(key).__name__}={type(value).__name__}")
        trial = dict(self._config)
        trial[key] = value
        validate_config(trial)
        self._config[key] = value

    def get_session_config_entry(self, key: str) -> str:
        if key in self._config:
            return self._config[key]
        raise ConfigKeyNotFound(f"SessionOptions does not have configuration with key: {key}")

    # -- initializers -----------------------------------------------------------------------------
    def add_initializer(self, name: str, array: Any) -> None:
        """Use ``array`` (an ndarray or OrtValue) as initializer ``name`` (it overrides the model's)."""
        arr = np.asarray(array)
        if arr.dtype == object:
            raise ConfigError(f"add_initializer({name!r}): object arrays are not supported")
        self._initializers[name] = arr

    def add_external_initializers(self, names: Sequence[str], values: Sequence[Any]) -> None:
        """Supply the data of initializers the model stores externally (the files need not exist)."""
        if isinstance(names, str) or len(names) != len(values):
            raise InvalidArgumentType("add_external_initializers: expected two lists of the same length (names, OrtValues)")
        for name, value in zip(names, values):
            self._external_initializers[str(name)] = np.asarray(value)

    def add_external_initializers_from_files_in_memory(self, names: Sequence[str], buffers: Sequence[Any],
                                                       lengths: Sequence[int]) -> None:
        """Supply the content of external data files by file name (``location`` in the model)."""
        if isinstance(names, str) or not len(names) == len(buffers) == len(lengths):
            raise InvalidArgumentType("add_external_initializers_from_files_in_memory: expected three lists of the "
                                      "same length (file names, buffers, lengths)")
        for name, buf, n in zip(names, buffers, lengths):
            data = memoryview(buf).cast("B")
            if not 0 <= int(n) <= len(data):
                raise ConfigError(f"add_external_initializers_from_files_in_memory({name!r}): length {n} is outside "
                                  f"the buffer of {len(data)} bytes")
            self._external_files[str(name)] = bytes(data[: int(n)])

    # -- free dimensions --------------------------------------------------------------------------
    def add_free_dimension_override_by_name(self, name: str, value: int) -> None:
        """Fix the symbolic dimension ``name`` to ``value`` in the model's inputs (and outputs)."""
        self._dims_by_name.setdefault(_dim_key(name, "name"), _dim_value(name, value))

    def add_free_dimension_override_by_denotation(self, denotation: str, value: int) -> None:
        """Fix every symbolic input dimension whose denotation is ``denotation`` (e.g. DATA_BATCH)."""
        self._dims_by_denotation.setdefault(_dim_key(denotation, "denotation"), _dim_value(denotation, value))

    # -- providers and libraries ------------------------------------------------------------------
    def add_provider(self, provider_name: str, provider_options: dict) -> None:
        """Append an execution provider; only CPUExecutionProvider exists here."""
        from onnxpack.session._providers import check_provider_for_options

        self._providers.append((check_provider_for_options(provider_name), {str(k): str(v) for k, v in
                                                                           dict(provider_options).items()}))

    def add_provider_for_devices(self, ep_devices: Sequence[Any], provider_options: dict) -> None:
        for device in ep_devices:
            self.add_provider(getattr(device, "ep_name", device), provider_options)

    def has_providers(self) -> bool:
        return bool(self._providers)

    def set_provider_selection_policy(self, policy: Any) -> None:
        """Kept: there is one device and one provider to select."""
        self._selection_policy = policy

    def set_provider_selection_policy_delegate(self, delegate: Any) -> None:
        if not callable(delegate):
            raise InvalidArgumentType("set_provider_selection_policy_delegate: expected a callable")
        self._selection_policy = delegate

    def register_custom_ops_library(self, library_path: str) -> None:
        """Native custom-op libraries cannot run here: fails as onnxruntime fails on a library it
        cannot load, saying why."""
        raise Fail(f"Failed to load library {library_path}: onnxpack runs no native custom-op libraries (its kernels "
                   "are Python; register one with onnxpack.session.kernels.register instead)")

    def set_load_cancellation_flag(self, value: bool) -> None:
        """True makes a session creation that uses these options stop with ModelLoadCanceled."""
        self._cancel_load = bool(value)

    def set_ep_context_data_read_func(self, func: Any) -> None:
        if not callable(func):
            raise InvalidArgumentType("set_ep_context_data_read_func: expected a callable")
        self._ep_context_read = func  # EP context models are compiled for devices: none here

    def clear_ep_context_data_read_func(self) -> None:
        self._ep_context_read = None

    # -- read by the session ----------------------------------------------------------------------
    @property
    def config(self) -> dict[str, str]:
        return dict(self._config)

    @property
    def initializers(self) -> dict[str, np.ndarray]:
        return dict(self._initializers)

    @property
    def external_initializers(self) -> dict[str, np.ndarray]:
        return dict(self._external_initializers)

    @property
    def external_files(self) -> dict[str, bytes]:
        return dict(self._external_files)

    @property
    def free_dimensions(self) -> tuple[dict[str, int], dict[str, int]]:
        """(overrides by dim name, overrides by denotation)."""
        return dict(self._dims_by_name), dict(self._dims_by_denotation)

    @property
    def providers(self) -> list[tuple[str, dict[str, str]]]:
        return list(self._providers)

    @property
    def load_cancelled(self) -> bool:
        return self._cancel_load

    def copy(self) -> SessionOptions:
        """A copy with the same attributes, entries and overrides (arrays are shared)."""
        new = SessionOptions.__new__(SessionOptions)
        new.__dict__.update({k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                             for k, v in self.__dict__.items()})
        return new


def _dim_key(name: Any, what: str) -> str:
    if not isinstance(name, str):
        raise InvalidArgumentType(f"free dimension override by {what}: expected a str, got {type(name).__name__}")
    return name


def _dim_value(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, _INT):
        raise InvalidArgumentType(f"free dimension override {name!r}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ConfigError(f"free dimension override {name!r}: expected a non-negative size, got {value}")
    return int(value)
