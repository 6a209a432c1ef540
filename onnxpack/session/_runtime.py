"""onnxruntime's module-level functions: versions, build info, devices, providers, telemetry,
EP libraries — answered for a pure-Python CPU runtime.

What onnxruntime loads natively (execution-provider libraries) fails as onnxruntime fails on a
library it cannot load; what has no meaning here (telemetry, DLL preloading) is accepted and
does nothing, as on the platforms where onnxruntime does nothing either.
"""

from __future__ import annotations

import platform
import sys

import numpy as np

from onnxpack.errors import Fail
from onnxpack.graph._proto import onnx_version
from onnxpack.session._providers import ALL_PROVIDERS, AVAILABLE

__all__ = ["get_device", "get_all_providers", "get_available_providers", "get_build_info", "get_version_string",
           "enable_telemetry_events", "disable_telemetry_events", "has_collective_ops", "preload_dlls",
           "print_debug_info", "register_execution_provider_library", "unregister_execution_provider_library",
           "set_seed", "VERSION", "PACKAGE_NAME"]

VERSION = "0.1.0"
PACKAGE_NAME = "onnxpack"


def get_device() -> str:
    """``"CPU"``: the device onnxpack computes on."""
    return "CPU"


def get_all_providers() -> list[str]:
    """Every execution provider name onnxruntime knows, highest precedence first (CPU last)."""
    return list(ALL_PROVIDERS)


def get_available_providers() -> list[str]:
    """The providers this package runs on: ``["CPUExecutionProvider"]``."""
    return list(AVAILABLE)


def get_version_string() -> str:
    return VERSION


def _blas() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl not installed)"
    libs = [f"{i.get('internal_api')} {i.get('version')} ({i.get('num_threads')} threads)"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    return ", ".join(libs) or "none found"


def get_build_info() -> str:
    """One line as onnxruntime's ("ORT Build Info: ..."): versions of onnxpack and its engine."""
    return (f"onnxpack Build Info: version={VERSION}, python={platform.python_version()}, numpy={np.__version__}, "
            f"onnx={onnx_version()}, blas={_blas()}, providers=CPUExecutionProvider")


def enable_telemetry_events() -> None:
    """No telemetry is collected (as onnxruntime on non-Windows builds)."""


def disable_telemetry_events() -> None:
    """No telemetry is collected (as onnxruntime on non-Windows builds)."""


def has_collective_ops() -> bool:
    return False


def preload_dlls(cuda: bool = True, cudnn: bool = True, msvc: bool = True, directory: str | None = None) -> None:
    """Nothing to preload: no native libraries."""


def print_debug_info() -> None:
    print(f"onnxpack version: {VERSION}")
    print(f"platform: {platform.platform()}")
    print(f"python: {sys.version.split()[0]} at {sys.executable}")
    print(f"numpy {np.__version__}, onnx {onnx_version()}, BLAS: {_blas()}")


_EP_LIBRARIES: dict[str, str] = {}


def register_execution_provider_library(registration_name: str, path: str) -> None:
    """Fails as onnxruntime fails on a library it cannot load: no native providers run here."""
    raise Fail(f"Failed to load library {path}: onnxpack cannot load native execution-provider libraries "
               "(it computes with numpy on the CPU)")


def unregister_execution_provider_library(registration_name: str) -> None:
    raise Fail(f"Execution provider library: {registration_name} was not registered.")


def set_seed(seed: int) -> None:
    """Seeds numpy's global generator (kernels without a ``seed`` attribute that draw from it).

    onnx.reference's RandomNormal/RandomUniform(Like)/Multinomial without a ``seed`` attribute use
    fresh unseeded generators; docs/api.md lists this difference."""
    np.random.seed(int(seed) & 0xFFFFFFFF)
