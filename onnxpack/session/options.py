"""SessionOptions with onnxruntime's Python API and config keys, plus onnxpack's own keys.

Keys onnxruntime knows keep onnxruntime's names.  Unknown ``onnxpack.*`` keys and invalid values
are errors (raised when added and again at session creation), never silently ignored; other
``session.*`` keys are kept and ignored, as onnxruntime ignores keys it does not use.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from onnxpack.errors import ConfigError

__all__ = ["SessionOptions", "CONFIG_KEYS", "validate_config"]

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


def _text(key: str, value: str) -> str:
    if "\x00" in value:
        raise ConfigError(f"config {key!r}: NUL byte in value")
    return value


def _planner(key: str, value: str) -> str:
    if value not in PLANNERS:
        raise ConfigError(f"config {key!r}: expected one of {', '.join(PLANNERS)}, got {value!r}")
    return value


# key -> (parser, default value as a string, one line of documentation)
CONFIG_KEYS: dict[str, tuple[Callable[[str, str], Any], str, str]] = {
    "session.disable_prepacking": (_bool, "0", "1 turns pre-packing of constant weights off"),
    "session.save_external_prepacked_constant_initializers": (
        _bool, "0", "1 saves pre-packed blobs next to the weights in optimized_model_filepath's data file"),
    "session.optimized_model_external_initializers_file_name": (
        _text, "", "data file name (next to optimized_model_filepath); default <model>.data"),
    "session.optimized_model_external_initializers_min_size_in_bytes": (
        _nonneg_int, "1024", "initializers smaller than this stay inside the saved model"),
    "onnxpack.align_threshold": (_nonneg_int, "", "tensors/blobs at least this large start on the granularity"),
    "onnxpack.allocation_granularity": (_granularity, str(mmap.ALLOCATIONGRANULARITY), "alignment of large tensors"),
    "onnxpack.prepacked_cache_path": (_text, "", "persistent packed-weight cache file (empty = off)"),
    "onnxpack.verify_prepacked": (_bool, "0", "1 verifies every mapped blob's checksum at load"),
    "onnxpack.memory_planner": (_planner, "none", "activation memory planner: " + "|".join(PLANNERS)),
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


class SessionOptions:
    """onnxruntime-compatible session options."""

    def __init__(self) -> None:
        self.optimized_model_filepath: str = ""
        self.log_severity_level: int = 2
        self.log_verbosity_level: int = 0
        self.logid: str = ""
        self.intra_op_num_threads: int = 0
        self.inter_op_num_threads: int = 0
        self.enable_profiling: bool = False
        self.enable_mem_pattern: bool = True
        self.enable_cpu_mem_arena: bool = True
        self.graph_optimization_level: Any = None
        self.execution_mode: Any = None
        self._config: dict[str, str] = {}
        self._initializers: dict[str, np.ndarray] = {}

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
        raise ConfigError(f"config key {key!r} is not set")

    def add_initializer(self, name: str, array: Any) -> None:
        """Use ``array`` as the value of initializer ``name`` (it overrides the model's)."""
        arr = np.asarray(array)
        if arr.dtype == object:
            raise ConfigError(f"add_initializer({name!r}): object arrays are not supported")
        self._initializers[name] = arr

    @property
    def config(self) -> dict[str, str]:
        return dict(self._config)

    @property
    def initializers(self) -> dict[str, np.ndarray]:
        return dict(self._initializers)
