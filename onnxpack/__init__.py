"""onnxpack: a numpy ONNX inference session that pre-packs constant weights, saves the packed
blobs next to the model's external initializers and memory-maps them back on the next load.

Change one import::

    import onnxpack as ort
    sess = ort.InferenceSession("model.onnx")

Every public name of onnxruntime's Python package is here; docs/api.md says what each does on a
numpy CPU runtime.
"""

from __future__ import annotations

from onnxpack import errors
from onnxpack.errors import OnnxpackError, PrepackWarning
from onnxpack.graph import load_model, save_model
from onnxpack.prepack import PrepackedWeightsContainer
from onnxpack.session import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    InferenceSession,
    IOBinding,
    ModelMetadata,
    NodeArg,
    OrtValue,
    RunOptions,
    SessionIOBinding,
    SessionOptions,
    SparseTensor,
)
from onnxpack.session.ortapi import ModelCompiler
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
from onnxpack.session.ortapi import AdapterFormat, LoraAdapter
from onnxpack.session.ortapi import OrtDevice, OrtDeviceVendorId, OrtSparseFormat, copy_tensors
from onnxpack.session.ortapi import (
    PACKAGE_NAME as package_name,
)
from onnxpack.session.ortapi import (
    VERSION,
    disable_telemetry_events,
    enable_telemetry_events,
    get_all_providers,
    get_available_providers,
    get_build_info,
    get_device,
    get_version_string,
    has_collective_ops,
    preload_dlls,
    print_debug_info,
    register_execution_provider_library,
    set_seed,
    unregister_execution_provider_library,
)
from onnxpack.session.ortapi import set_global_thread_pool_sizes

# onnxruntime's module paths (``onnxpack.capi.onnxruntime_pybind11_state.Fail`` ...), loaded as
# ``import onnxruntime`` loads them.
from onnxpack import capi  # noqa: E402
from onnxpack.capi import _pybind_state, onnxruntime_inference_collection, onnxruntime_pybind11_state  # noqa: E402,F401

__version__ = VERSION
version = VERSION
cuda_version = ""  # onnxruntime's: empty on a build without CUDA

__all__ = [
    # onnxpack's own
    "PrepackedWeightsContainer", "load_model", "save_model", "errors", "OnnxpackError", "PrepackWarning",
    "__version__",
    # onnxruntime's names (docs/api.md)
    "InferenceSession", "SessionOptions", "RunOptions", "NodeArg", "ModelMetadata", "GraphOptimizationLevel",
    "ExecutionMode", "ExecutionOrder", "OrtValue", "SparseTensor", "IOBinding", "SessionIOBinding", "OrtDevice",
    "OrtDeviceVendorId", "OrtSparseFormat", "OrtMemoryInfo", "OrtMemType", "OrtAllocatorType", "OrtArenaCfg",
    "OrtDeviceMemoryType", "OrtMemoryInfoDeviceType", "OrtHardwareDevice", "OrtHardwareDeviceType", "OrtEpDevice",
    "OrtExecutionProviderDevicePolicy", "OrtCompileApiFlags", "OrtSyncStream", "OrtExternalInitializerInfo",
    "OrtEpAssignedNode", "OrtEpAssignedSubgraph", "AdapterFormat", "LoraAdapter", "ModelCompiler", "copy_tensors",
    "create_and_register_allocator", "create_and_register_allocator_v2", "get_ep_devices", "get_device",
    "get_all_providers", "get_available_providers", "get_build_info", "get_version_string", "has_collective_ops",
    "enable_telemetry_events", "disable_telemetry_events", "preload_dlls", "print_debug_info",
    "register_execution_provider_library", "unregister_execution_provider_library", "set_seed",
    "set_default_logger_severity", "set_default_logger_verbosity", "set_default_logger_callback",
    "set_global_thread_pool_sizes", "capi", "version", "package_name", "cuda_version",
]
