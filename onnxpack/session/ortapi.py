"""onnxruntime's Python API as onnxpack provides it: the module-level functions, value and
device types, logging, LoRA adapters and the model compiler that ``onnxpack`` and
``onnxpack.capi`` re-export under onnxruntime's names (what each does: ``docs/api.md``)."""

from __future__ import annotations

from onnxpack.session._compiler import (  # noqa: F401
    ModelCompiler,
)
from onnxpack.session._devices import (  # noqa: F401
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
    OrtMemType,
    OrtMemoryInfo,
    OrtMemoryInfoDeviceType,
    OrtSyncStream,
    create_and_register_allocator,
    create_and_register_allocator_v2,
    get_ep_devices,
)
from onnxpack.session._logging import (  # noqa: F401
    set_default_logger_callback,
    set_default_logger_severity,
    set_default_logger_verbosity,
)
from onnxpack.session._lora import (  # noqa: F401
    AdapterFormat,
    LoraAdapter,
)
from onnxpack.session._ortvalue import (  # noqa: F401
    OrtDevice,
    OrtDeviceVendorId,
    OrtSparseFormat,
    copy_tensors,
)
from onnxpack.session._providers import (  # noqa: F401
    normalize_providers,
)
from onnxpack.session._runtime import (  # noqa: F401
    PACKAGE_NAME,
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
from onnxpack.session._threads import (  # noqa: F401
    set_global_thread_pool_sizes,
)

__all__ = ["AdapterFormat", "LoraAdapter", "ModelCompiler", "OrtAllocatorType", "OrtArenaCfg", "OrtCompileApiFlags", "OrtDevice", "OrtDeviceMemoryType", "OrtDeviceVendorId", "OrtEpAssignedNode", "OrtEpAssignedSubgraph", "OrtEpDevice", "OrtExecutionProviderDevicePolicy", "OrtExternalInitializerInfo", "OrtHardwareDevice", "OrtHardwareDeviceType", "OrtMemType", "OrtMemoryInfo", "OrtMemoryInfoDeviceType", "OrtSparseFormat", "OrtSyncStream", "PACKAGE_NAME", "VERSION", "copy_tensors", "create_and_register_allocator", "create_and_register_allocator_v2", "disable_telemetry_events", "enable_telemetry_events", "get_all_providers", "get_available_providers", "get_build_info", "get_device", "get_ep_devices", "get_version_string", "has_collective_ops", "normalize_providers", "preload_dlls", "print_debug_info", "register_execution_provider_library", "set_default_logger_callback", "set_default_logger_severity", "set_default_logger_verbosity", "set_global_thread_pool_sizes", "set_seed", "unregister_execution_provider_library"]
