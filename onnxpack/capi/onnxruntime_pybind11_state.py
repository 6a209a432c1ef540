"""onnxruntime's native module path: its exception classes and types, from onnxpack.

``except onnxpack.capi.onnxruntime_pybind11_state.InvalidArgument`` catches what onnxpack raises
for a bad argument, ``Fail`` a failed run, and so on: each class is onnxruntime's name for one of
:mod:`onnxpack.errors`' classes (and a subclass of it), see ``errors.as_onnxruntime_error``.
"""

from __future__ import annotations

from onnxpack.errors import (
    DeviceReset,
    EngineError,
    EPFail,
    Fail,
    InvalidProtobuf,
    ModelLoadCanceled,
    ModelLoaded,
    ModelRequiresCompilation,
    NoModel,
    NoSuchFile,
    NotFound,
    RuntimeException,
)
from onnxpack.errors import InvalidArgumentStatus as InvalidArgument
from onnxpack.errors import InvalidGraphStatus as InvalidGraph
from onnxpack.errors import NotImplementedStatus as NotImplemented  # noqa: A004 - onnxruntime's name
from onnxpack.session import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    InferenceSession,
    ModelMetadata,
    NodeArg,
    OrtValue,
    RunOptions,
    SessionIOBinding,
    SessionOptions,
    SparseTensor,
)
from onnxpack.session.ortapi import (
    OrtAllocatorType,
    OrtArenaCfg,
    OrtCompileApiFlags,
    OrtDeviceMemoryType,
    OrtEpAssignedNode,
    OrtEpAssignedSubgraph,
    OrtEpDevice,
    OrtExecutionProviderDevicePolicy,
    OrtExternalInitializerInfo,
    OrtHardwareDevice,
    OrtHardwareDeviceType,
    OrtMemoryInfo,
    OrtMemoryInfoDeviceType,
    OrtMemType,
    OrtSyncStream,
    create_and_register_allocator,
    create_and_register_allocator_v2,
    get_ep_devices,
)
from onnxpack.session.ortapi import (
    set_default_logger_callback,
    set_default_logger_severity,
    set_default_logger_verbosity,
)
from onnxpack.session.ortapi import OrtDevice, OrtSparseFormat
from onnxpack.session.ortapi import (
    disable_telemetry_events,
    enable_telemetry_events,
    get_all_providers,
    get_available_providers,
    get_build_info,
    get_device,
    get_version_string,
    has_collective_ops,
    register_execution_provider_library,
    set_seed,
    unregister_execution_provider_library,
)
from onnxpack.session.ortapi import set_global_thread_pool_sizes

OrtValueVector = list  # onnxruntime's vector of OrtValues; a list here


def get_default_session_options() -> SessionOptions:
    """A new SessionOptions with onnxruntime's defaults."""
    return SessionOptions()

__all__ = [
    "Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException", "InvalidProtobuf",
    "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail", "ModelLoadCanceled", "ModelRequiresCompilation",
    "NotFound", "DeviceReset", "OrtValueVector", "get_default_session_options",
    "ExecutionMode", "ExecutionOrder", "GraphOptimizationLevel", "InferenceSession", "ModelMetadata", "NodeArg",
    "OrtValue", "RunOptions", "SessionIOBinding", "SessionOptions", "SparseTensor", "OrtDevice", "OrtSparseFormat",
    "OrtAllocatorType", "OrtArenaCfg", "OrtCompileApiFlags", "OrtDeviceMemoryType", "OrtEpAssignedNode",
    "OrtEpAssignedSubgraph", "OrtEpDevice", "OrtExecutionProviderDevicePolicy", "OrtExternalInitializerInfo",
    "OrtHardwareDevice", "OrtHardwareDeviceType", "OrtMemoryInfo", "OrtMemoryInfoDeviceType", "OrtMemType",
    "OrtSyncStream", "create_and_register_allocator", "create_and_register_allocator_v2", "get_ep_devices",
    "set_default_logger_callback", "set_default_logger_severity", "set_default_logger_verbosity",
    "disable_telemetry_events", "enable_telemetry_events", "get_all_providers", "get_available_providers",
    "get_build_info", "get_device", "get_version_string", "has_collective_ops", "register_execution_provider_library",
    "set_seed", "unregister_execution_provider_library", "set_global_thread_pool_sizes",
]
