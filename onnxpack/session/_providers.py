"""Execution providers as onnxruntime's Python API takes them, on a runtime that has one: the CPU.

onnxruntime validates ``providers`` / ``provider_options`` (:func:`normalize_providers`, the same
checks and ``ValueError`` messages as onnxruntime's ``check_and_normalize_provider_args``), warns
about names it does not have and runs on what it has.  The most copied line of onnxruntime's
examples, ``providers=['CUDAExecutionProvider', 'CPUExecutionProvider']``, therefore works on a
CPU-only onnxruntime with a warning — and here too.  Where onnxruntime fails (``set_providers``
with an unknown name, ``add_provider`` of a provider it was built without) we fail alike.
"""

from __future__ import annotations

import collections.abc
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from onnxpack.errors import Fail, InvalidArgumentStatus, OnnxpackError, RuntimeInvalidArgument, as_onnxruntime_error
from onnxpack.session import _devices

__all__ = ["AVAILABLE", "ALL_PROVIDERS", "normalize_providers", "session_providers", "check_known",
           "check_provider_for_options", "ProviderAPI", "ort_errors"]

AVAILABLE = ("CPUExecutionProvider",)

# onnxruntime 1.31/1.32's get_all_providers(): every provider it knows, highest precedence first.
ALL_PROVIDERS = (
    "TensorrtExecutionProvider", "CUDAExecutionProvider", "MIGraphXExecutionProvider", "OpenVINOExecutionProvider",
    "DnnlExecutionProvider", "VitisAIExecutionProvider", "QNNExecutionProvider", "NnapiExecutionProvider",
    "VSINPUExecutionProvider", "JsExecutionProvider", "CoreMLExecutionProvider", "DmlExecutionProvider",
    "RknpuExecutionProvider", "WebNNExecutionProvider", "WebGpuExecutionProvider", "XnnpackExecutionProvider",
    "CANNExecutionProvider", "AzureExecutionProvider", "CPUExecutionProvider",
)


def normalize_providers(providers: Any, provider_options: Any, available: Sequence[str] = AVAILABLE, *,
                        stacklevel: int = 5) -> tuple[list[str], list[dict[str, str]]]:
    """onnxruntime's provider-argument rules: names or (name, options) tuples, or names plus a
    parallel list of option dicts; option keys and values become strings; a duplicate is ignored
    with a warning; a name not in ``available`` is kept with a warning.

    Raises:
        ValueError (InvalidArgument): the arguments are not shaped as onnxruntime accepts them.
    """
    if providers is None:
        return [], []
    chosen: dict[str, dict[str, str]] = {}

    def add(name: str, options: dict) -> None:
        if name not in available:
            warnings.warn(f"Specified provider '{name}' is not in available provider names."
                          f"Available providers: '{', '.join(available)}'", UserWarning, stacklevel=stacklevel)
        if name in chosen:
            warnings.warn(f"Duplicate provider '{name}' encountered, ignoring.", UserWarning, stacklevel=stacklevel)
            return
        chosen[name] = {str(k): str(v) for k, v in options.items()}

    if not isinstance(providers, collections.abc.Sequence) or isinstance(providers, str):
        raise InvalidArgumentStatus("'providers' should be a sequence.")
    if provider_options is not None:
        if not isinstance(provider_options, collections.abc.Sequence):
            raise InvalidArgumentStatus("'provider_options' should be a sequence.")
        if len(providers) != len(provider_options):
            raise InvalidArgumentStatus("'providers' and 'provider_options' should be the same length if both are given.")
        if not all(isinstance(p, str) for p in providers):
            raise InvalidArgumentStatus("Only string values for 'providers' are supported if 'provider_options' is given.")
        if not all(isinstance(o, dict) for o in provider_options):
            raise InvalidArgumentStatus("'provider_options' values must be dicts.")
        for name, options in zip(providers, provider_options):
            add(name, options)
    else:
        for p in providers:
            if isinstance(p, str):
                add(p, {})
            elif isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], dict):
                add(p[0], p[1])
            else:
                raise InvalidArgumentStatus("'providers' values must be either strings or (string, dict) tuples.")
    return list(chosen), list(chosen.values())


def check_known(names: Sequence[str]) -> None:
    """onnxruntime's error for a provider name it has never heard of (``set_providers``)."""
    for name in names:
        if name not in ALL_PROVIDERS:
            raise RuntimeInvalidArgument(f"Unknown Provider Type: {name}")


def session_providers(names: Sequence[str], options: Sequence[dict[str, str]]) -> tuple[list[str], dict[str, dict]]:
    """What a session runs on, whatever was asked: the CPU, with the options given for it.

    Returns ``(get_providers(), get_provider_options())``.
    """
    cpu = next((o for n, o in zip(names, options) if n == "CPUExecutionProvider"), {})
    return ["CPUExecutionProvider"], {"CPUExecutionProvider": dict(cpu)}


def check_provider_for_options(name: Any) -> str:
    """``SessionOptions.add_provider``: as a CPU-only onnxruntime, CPU is accepted, a provider it
    knows but was built without is INVALID_ARGUMENT, an unknown name a RuntimeError."""
    if not isinstance(name, str):
        raise RuntimeInvalidArgument(f"add_provider: expected a provider name, got {type(name).__name__}")
    if name in AVAILABLE:
        return name
    check_known([name])
    raise InvalidArgumentStatus(f"Failed to add provider of type '{name}' to SessionOptions. "
                                "Provider configuration is not supported.")


def ort_errors(fn: Callable) -> Callable:
    """Our errors leave a public method as onnxruntime's classes too (re-typed in place)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OnnxpackError as exc:
            as_onnxruntime_error(exc)
            raise
    return wrapper


class ProviderAPI:
    """The part of ``InferenceSession`` that says where it runs: providers, their options,
    memory infos, devices, node assignment — and onnxruntime's provider-specific entries that
    have nothing to do on one CPU provider (tuning results, dynamic EP options, captured graphs).
    Expects ``_providers``, ``_provider_options``, ``_options``, ``_program`` and ``get_inputs``/
    ``get_outputs`` on the session."""

    _providers: list[str]
    _provider_options: dict[str, dict[str, str]]

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {k: dict(v) for k, v in self._provider_options.items()}

    @ort_errors
    def set_providers(self, providers: Sequence[Any] | None = None, provider_options: Sequence[dict] | None = None) -> None:
        """As onnxruntime's: unknown names fail ("Unknown Provider Type"), known ones the package
        lacks warn; the session keeps running on the CPU (nothing is re-created)."""
        names, opts = normalize_providers(providers, provider_options)
        check_known(names)
        self._providers, self._provider_options = session_providers(names, opts)

    def enable_fallback(self) -> None:
        self._fallback = True  # kept: with one provider there is nothing to fall back to

    def disable_fallback(self) -> None:
        self._fallback = False

    def get_input_memory_infos(self) -> list[_devices.OrtMemoryInfo]:
        return [_devices.CPU_MEMORY_INFO for _ in self.get_inputs()]  # type: ignore[attr-defined]

    def get_output_memory_infos(self) -> list[_devices.OrtMemoryInfo]:
        return [_devices.CPU_MEMORY_INFO for _ in self.get_outputs()]  # type: ignore[attr-defined]

    def get_input_epdevices(self) -> list[_devices.OrtEpDevice]:
        return [_devices.get_ep_devices()[0] for _ in self.get_inputs()]  # type: ignore[attr-defined]

    @ort_errors
    def get_provider_graph_assignment_info(self) -> list[_devices.OrtEpAssignedSubgraph]:
        """One subgraph per node of the model's graph, all on CPUExecutionProvider (onnxruntime
        requires ``session.record_ep_graph_assignment_info=1``)."""
        if self._options.config.get("session.record_ep_graph_assignment_info") != "1":  # type: ignore[attr-defined]
            raise Fail("Session configuration entry 'session.record_ep_graph_assignment_info' must be set to \"1\" "
                       "to retrieve EP graph assignment information.")
        return [_devices.OrtEpAssignedSubgraph("CPUExecutionProvider", (_devices.OrtEpAssignedNode(
            s.node.name, s.node.op_type, s.node.domain),)) for s in self._program.root.steps]  # type: ignore[attr-defined]

    def get_tuning_results(self) -> list[dict]:
        return []  # no tunable kernels

    @ort_errors
    def set_tuning_results(self, results: Sequence[dict], *, error_on_invalid: bool = False) -> None:
        for r in results:
            if error_on_invalid and r.get("ep") != "CPUExecutionProvider":
                raise RuntimeInvalidArgument(f"Cannot find execution provider {r.get('ep')}")

    def set_ep_dynamic_options(self, options: dict[str, str]) -> None:
        self._ep_options = {str(k): str(v) for k, v in dict(options).items()}  # no provider reads them

    def release_captured_graph(self, graph_annotation_id: int = 0) -> None:
        """No graphs are captured on the CPU."""

    @ort_errors
    def create_ortvalue_from_shape_and_type(self, shape: Sequence[int], element_type: Any, device_type: str,
                                            device_id: int = 0, vendor_id: int = -1) -> Any:
        """A tensor from the session's allocator: numpy's heap (the CPU device only)."""
        from onnxpack.session._ortvalue import OrtValue

        return OrtValue.ortvalue_from_shape_and_type(shape, element_type, device_type, device_id, vendor_id)
