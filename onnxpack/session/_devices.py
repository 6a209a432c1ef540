"""Descriptions of devices, memories, allocators and providers, as onnxruntime's Python API has
them — on a runtime with one device (the CPU), one memory (numpy's heap) and one provider.

These types exist so that code written for onnxruntime runs unchanged: a CPU memory info, an
arena config, the CPU ``OrtEpDevice`` from :func:`get_ep_devices`, the per-node provider
assignment.  Where onnxruntime's object steers a native allocator or a device, ours is a record
that is accepted and reported (docs/api.md lists each).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import platform
from collections.abc import Mapping
from typing import Any

from onnxpack.errors import InvalidArgumentType, RuntimeInvalidArgument

__all__ = [
    "OrtMemType", "OrtAllocatorType", "OrtDeviceMemoryType", "OrtMemoryInfoDeviceType", "OrtHardwareDeviceType",
    "OrtExecutionProviderDevicePolicy", "OrtCompileApiFlags", "OrtMemoryInfo", "OrtArenaCfg", "OrtHardwareDevice",
    "OrtEpDevice", "OrtSyncStream", "OrtExternalInitializerInfo", "OrtEpAssignedNode", "OrtEpAssignedSubgraph",
    "get_ep_devices", "create_and_register_allocator", "create_and_register_allocator_v2", "CPU_MEMORY_INFO",
]


class _Enum(enum.IntEnum):
    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class OrtMemType(_Enum):
    CPU_INPUT = -2
    CPU_OUTPUT = -1
    CPU = -1  # onnxruntime's alias of CPU_OUTPUT
    DEFAULT = 0


class OrtAllocatorType(_Enum):
    INVALID = -1
    ORT_DEVICE_ALLOCATOR = 0
    ORT_ARENA_ALLOCATOR = 1


class OrtDeviceMemoryType(_Enum):
    DEFAULT = 0
    HOST_ACCESSIBLE = 5


class OrtMemoryInfoDeviceType(_Enum):
    CPU = 0
    GPU = 1
    FPGA = 2
    NPU = 3


class OrtHardwareDeviceType(_Enum):
    CPU = 0
    GPU = 1
    NPU = 2


class OrtExecutionProviderDevicePolicy(_Enum):
    DEFAULT = 0
    PREFER_CPU = 1
    PREFER_NPU = 2
    PREFER_GPU = 3
    MAX_PERFORMANCE = 4
    MAX_EFFICIENCY = 5
    MIN_OVERALL_POWER = 6


class OrtCompileApiFlags(_Enum):
    NONE = 0
    ERROR_IF_NO_NODES_COMPILED = 1
    ERROR_IF_OUTPUT_FILE_EXISTS = 2


class OrtMemoryInfo:
    """Where a tensor lives.  Here always the CPU; other device names are described, not used."""

    def __init__(self, name: str, allocator_type: OrtAllocatorType, device_id: int, mem_type: OrtMemType) -> None:
        if not isinstance(name, str):
            raise InvalidArgumentType(f"OrtMemoryInfo: name must be a str, got {type(name).__name__}")
        self.name = name
        self.allocator_type = OrtAllocatorType(allocator_type)
        self.device_id = int(device_id)
        self.mem_type = OrtMemType(mem_type)
        self.device_mem_type = OrtDeviceMemoryType.DEFAULT
        self.device_vendor_id = 0

    @staticmethod
    def create_v2(name: str, device_type: OrtMemoryInfoDeviceType, vendor_id: int, device_id: int,
                  mem_type: OrtDeviceMemoryType, alignment: int, allocator_type: OrtAllocatorType) -> OrtMemoryInfo:
        info = OrtMemoryInfo(name, allocator_type, device_id, OrtMemType.DEFAULT)
        info.device_mem_type = OrtDeviceMemoryType(mem_type)
        info.device_vendor_id = int(vendor_id)
        info._device_type = OrtMemoryInfoDeviceType(device_type)
        info._alignment = int(alignment)
        return info

    def __repr__(self) -> str:
        return (f"OrtMemoryInfo(name={self.name!r}, device_id={self.device_id}, mem_type={self.mem_type}, "
                f"allocator_type={self.allocator_type})")


CPU_MEMORY_INFO = OrtMemoryInfo("Cpu", OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, OrtMemType.DEFAULT)

_ARENA_KEYS = ("max_mem", "arena_extend_strategy", "initial_chunk_size_bytes", "max_dead_bytes_per_chunk",
               "initial_growth_chunk_size_bytes", "max_power_of_two_extend_bytes")


class OrtArenaCfg:
    """An arena allocator configuration (kept: numpy allocates; see docs/api.md).

    ``OrtArenaCfg(max_mem, arena_extend_strategy, initial_chunk_size_bytes, max_dead_bytes_per_chunk)``
    or ``OrtArenaCfg({key: value})``, as onnxruntime's.
    """

    def __init__(self, *args: Any) -> None:
        values = dict.fromkeys(_ARENA_KEYS, -1)
        if len(args) == 1 and isinstance(args[0], Mapping):
            unknown = sorted(set(args[0]) - set(_ARENA_KEYS))
            if unknown:
                raise RuntimeInvalidArgument(f"OrtArenaCfg: unknown keys {unknown}; expected some of {list(_ARENA_KEYS)}")
            values.update({k: int(v) for k, v in args[0].items()})
        elif len(args) == 4:
            values.update(zip(_ARENA_KEYS, (int(a) for a in args)))
        else:
            raise InvalidArgumentType("OrtArenaCfg: expected (max_mem, arena_extend_strategy, initial_chunk_size_bytes,"
                                      " max_dead_bytes_per_chunk) or a dict")
        for k, v in values.items():
            setattr(self, k, v)


_REGISTERED_ALLOCATORS: list[tuple[OrtMemoryInfo, OrtArenaCfg | None]] = []


def create_and_register_allocator(mem_info: OrtMemoryInfo, arena_cfg: OrtArenaCfg | None) -> None:
    """Registers a shared CPU allocator for sessions with ``session.use_env_allocators=1``: numpy's
    heap is already shared by every session, so the registration is recorded and has no effect."""
    if not isinstance(mem_info, OrtMemoryInfo):
        raise InvalidArgumentType("create_and_register_allocator: expected an OrtMemoryInfo")
    _REGISTERED_ALLOCATORS.append((mem_info, arena_cfg))


def create_and_register_allocator_v2(provider_type: str, mem_info: OrtMemoryInfo, provider_options: dict,
                                     arena_cfg: OrtArenaCfg | None) -> None:
    if provider_type != "CPUExecutionProvider":
        raise RuntimeInvalidArgument(f"create_and_register_allocator_v2: no allocator for provider {provider_type!r} "
                                     "(onnxpack has CPUExecutionProvider only)")
    create_and_register_allocator(mem_info, arena_cfg)


@dataclasses.dataclass(frozen=True)
class OrtHardwareDevice:
    type: OrtHardwareDeviceType
    vendor: str
    vendor_id: int
    device_id: int
    metadata: dict[str, str]


class OrtSyncStream:
    """A stream for asynchronous copies; the CPU copies synchronously (handle 0)."""

    def get_handle(self) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class OrtEpDevice:
    ep_name: str
    ep_vendor: str
    ep_metadata: dict[str, str]
    ep_options: dict[str, str]
    device: OrtHardwareDevice
    memory_info: Any = None

    def create_sync_stream(self) -> OrtSyncStream:
        return OrtSyncStream()


def get_ep_devices() -> list[OrtEpDevice]:
    """The one (provider, device) pair: CPUExecutionProvider on the host CPU."""
    cpu = OrtHardwareDevice(OrtHardwareDeviceType.CPU, platform.processor() or platform.machine(), 0, 0,
                            {"cpu_count": str(os.cpu_count() or 1)})
    return [OrtEpDevice("CPUExecutionProvider", "onnxpack", {}, {}, cpu, lambda *_: CPU_MEMORY_INFO)]


@dataclasses.dataclass(frozen=True)
class OrtExternalInitializerInfo:
    filepath: str
    file_offset: int
    byte_size: int


@dataclasses.dataclass(frozen=True)
class OrtEpAssignedNode:
    name: str
    op_type: str
    domain: str


@dataclasses.dataclass(frozen=True)
class OrtEpAssignedSubgraph:
    ep_name: str
    nodes: tuple[OrtEpAssignedNode, ...]

    def get_nodes(self) -> list[OrtEpAssignedNode]:
        return list(self.nodes)
