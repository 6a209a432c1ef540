"""onnxruntime's value types on a CPU-only numpy runtime: OrtValue, OrtDevice, SparseTensor.

An :class:`OrtValue` here is a thin holder of what a run consumes or produces — a numpy array
(tensors), a list (sequences), a dict (maps), ``None`` (an empty optional) or a
:class:`SparseTensor` — plus its ONNX type.  A CPU tensor made with ``ortvalue_from_numpy``
shares the caller's buffer (no copy, as onnxruntime), so binding it to a run
(:mod:`~onnxpack.session._iobinding`) passes that very buffer to the kernels, and binding one as a
preallocated output makes the run write into it.

Devices: only ``cpu`` holds data.  ``cuda``, ``dml``, ``cann``, ``gpu``, ``npu`` and ``webgpu`` are
names onnxruntime knows: as on a CPU-only onnxruntime, an OrtDevice can describe them but
allocating there fails ("Can't allocate memory on the device using this package ...").  Any
other name is onnxruntime's "Unsupported device type".
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpack.errors import InvalidArgumentType, RuntimeInvalidArgument
from onnxpack.graph._proto import TensorProto, np_dtype_to_tensor_dtype, tensor_dtype_to_np_dtype

__all__ = ["OrtValue", "OrtDevice", "OrtDeviceVendorId", "SparseTensor", "OrtSparseFormat", "copy_tensors",
           "value_type", "elem_dtype", "elem_type_of"]

_ELEM_NAMES = {v: k.lower() for k, v in TensorProto.DataType.items() if k != "UNDEFINED"}

# onnxruntime's device names (get_ort_device_type) -> (OrtDevice type id, vendor id).
_DEVICE_TYPES = {"cpu": 0, "gpu": 1, "cuda": 1, "dml": 1, "webgpu": 1, "cann": 2, "npu": 2}


class OrtDeviceVendorId(enum.IntEnum):
    """PCI vendor ids, as onnxruntime's ``OrtDeviceVendorId``."""

    NONE = 0x0000
    AMD = 0x1002
    NVIDIA = 0x10DE
    ARM = 0x13B5
    MICROSOFT = 0x1414
    HUAWEI = 0x19E5
    QUALCOMM = 0x5143
    INTEL = 0x8086


_VENDORS = {"cuda": OrtDeviceVendorId.NVIDIA, "dml": OrtDeviceVendorId.MICROSOFT, "cann": OrtDeviceVendorId.HUAWEI,
            "webgpu": OrtDeviceVendorId.NONE}


class OrtSparseFormat(enum.IntEnum):
    ORT_SPARSE_UNDEFINED = 0
    ORT_SPARSE_COO = 1
    ORT_SPARSE_CSRC = 2
    ORT_SPARSE_BLOCK_SPARSE = 4

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class OrtDevice:
    """A device description: type (0 cpu, 1 gpu, 2 npu), memory type, vendor id, device id."""

    def __init__(self, device_type: int, mem_type: int = 0, vendor_id: int = 0, device_id: int = 0,
                 name: str = "cpu") -> None:
        self._type, self._mem, self._vendor, self._id, self._name = device_type, mem_type, vendor_id, device_id, name

    @staticmethod
    def make(ort_device_name: str, device_id: int, vendor_id: int = -1) -> OrtDevice:
        name = _device_name(ort_device_name)
        vendor = int(vendor_id) if vendor_id >= 0 else int(_VENDORS.get(name, OrtDeviceVendorId.NONE))
        return OrtDevice(_DEVICE_TYPES[name], 0, vendor, int(device_id), name)

    def device_id(self) -> int:
        return self._id

    def device_type(self) -> int:
        return self._type

    def device_vendor_id(self) -> int:
        return self._vendor

    def device_mem_type(self) -> int:
        return self._mem

    def _get_c_device(self) -> OrtDevice:
        return self

    def __repr__(self) -> str:
        return f"OrtDevice({self._name}:{self._id}, type={self._type}, vendor=0x{self._vendor:04x})"


def _device_name(name: Any) -> str:
    if not isinstance(name, str) or name not in _DEVICE_TYPES:
        raise RuntimeInvalidArgument(f"Unsupported device type: {name}")
    return name


def _require_cpu(device_type: Any) -> None:
    name = _device_name(device_type)
    if name != "cpu":
        raise RuntimeInvalidArgument(
            f"Can't allocate memory on the {name} device using this package: onnxpack computes with numpy on the "
            "CPU only (use device_type 'cpu')")


# -- types ----------------------------------------------------------------------------------------


def elem_dtype(element_type: Any) -> np.dtype:
    """A numpy dtype from a numpy type/dtype or an ONNX element type (int, e.g. TensorProto.BFLOAT16)."""
    if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
        if int(element_type) == TensorProto.STRING:
            return np.dtype(object)
        try:
            return np.dtype(tensor_dtype_to_np_dtype(int(element_type)))
        except Exception as exc:
            raise RuntimeInvalidArgument(f"unsupported ONNX element type {element_type}") from exc
    try:
        return np.dtype(element_type)
    except TypeError as exc:
        raise InvalidArgumentType(f"element_type: expected a numpy type or an ONNX element type, got {element_type!r}") from exc


def elem_type_of(dtype: np.dtype) -> int:
    """The ONNX element type of a numpy dtype (str/bytes/object arrays are STRING)."""
    if dtype.kind in "OUS":
        return TensorProto.STRING
    try:
        return int(np_dtype_to_tensor_dtype(dtype))
    except Exception as exc:
        raise RuntimeInvalidArgument(f"numpy dtype {dtype} has no ONNX element type") from exc


def value_type(value: Any) -> str:
    """onnxruntime's type string of a run value (``tensor(float)``, ``seq(tensor(int64))``, ...)."""
    if isinstance(value, np.ndarray):
        return f"tensor({_ELEM_NAMES[elem_type_of(value.dtype)]})"
    if isinstance(value, SparseTensor):
        return value.data_type()
    if isinstance(value, list):
        return f"seq({value_type(value[0])})" if value else "seq(tensor(undefined))"
    if isinstance(value, dict):
        key = next(iter(value), None)
        kt = "string" if isinstance(key, str) else "int64"
        vt = "tensor(float)" if not value else value_type(np.asarray(next(iter(value.values()))))
        return f"map({kt},{vt})"
    if value is None:
        return "optional(tensor(undefined))"
    return value_type(np.asarray(value))


# -- OrtValue -------------------------------------------------------------------------------------


class OrtValue:
    """A value of a run (see the module docstring); mirrors ``onnxruntime.OrtValue``."""

    __slots__ = ("_value", "_type", "__weakref__")

    def __init__(self, value: Any, type_string: str | None = None) -> None:
        self._value = value
        self._type = type_string

    # -- factories --------------------------------------------------------------------------------
    @classmethod
    def ortvalue_from_numpy(cls, numpy_obj: Any, /, device_type: str = "cpu", device_id: int = 0,
                            vendor_id: int = -1) -> OrtValue:
        """A CPU tensor backed by ``numpy_obj``'s buffer (copied only if it is not C-contiguous)."""
        _require_cpu(device_type)
        if not isinstance(numpy_obj, np.ndarray):
            raise InvalidArgumentType(f"ortvalue_from_numpy: expected a numpy array, got {type(numpy_obj).__name__}")
        arr = numpy_obj if numpy_obj.flags.c_contiguous else np.ascontiguousarray(numpy_obj)
        return cls(arr)

    @classmethod
    def ortvalue_from_numpy_with_onnx_type(cls, data: np.ndarray, /, onnx_element_type: int) -> OrtValue:
        """``data``'s bytes seen as ``onnx_element_type`` (same item size), without a copy."""
        dtype = elem_dtype(onnx_element_type)
        if dtype.itemsize != data.dtype.itemsize:
            raise RuntimeInvalidArgument(
                f"ortvalue_from_numpy_with_onnx_type: element size {data.dtype.itemsize} of {data.dtype} does not "
                f"match {dtype.itemsize} of ONNX element type {onnx_element_type}")
        return cls(np.ascontiguousarray(data).view(dtype))

    @classmethod
    def ortvalue_from_shape_and_type(cls, shape: Sequence[int], element_type: Any, device_type: str = "cpu",
                                     device_id: int = 0, vendor_id: int = -1, memory_info: Any = None) -> OrtValue:
        """A new CPU tensor of ``shape`` and ``element_type`` (uninitialized, as onnxruntime's)."""
        if memory_info is None:
            _require_cpu(device_type)
        dtype = elem_dtype(element_type)
        arr = np.empty(tuple(int(d) for d in shape), dtype)
        if dtype == object:
            arr.fill("")
        return cls(arr)

    @classmethod
    def ort_value_from_sparse_tensor(cls, sparse_tensor: SparseTensor) -> OrtValue:
        if not isinstance(sparse_tensor, SparseTensor):
            raise InvalidArgumentType("ort_value_from_sparse_tensor: expected a SparseTensor")
        return cls(sparse_tensor)

    @classmethod
    def from_dlpack(cls, data: Any, /) -> OrtValue:
        """A tensor sharing the memory of a DLPack producer (an object with ``__dlpack__`` or a
        DLPack capsule); CPU memory only."""
        if not hasattr(data, "__dlpack__"):
            data = _Capsule(data)
        try:
            arr = np.from_dlpack(data)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise RuntimeInvalidArgument(f"from_dlpack: {exc}") from exc
        return cls(arr)

    # -- what it holds ----------------------------------------------------------------------------
    def _tensor(self, what: str) -> np.ndarray:
        if not isinstance(self._value, np.ndarray):
            raise RuntimeInvalidArgument(f"{what}: this OrtValue holds a {self.data_type()}, not a tensor")
        return self._value

    def numpy(self) -> np.ndarray:
        """The tensor as a numpy array sharing this value's memory."""
        value = self._value
        if isinstance(value, np.ndarray):
            return value
        raise RuntimeInvalidArgument(f"numpy(): this OrtValue holds a {self.data_type()}; numpy() is for tensors")

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.numpy()
        if copy is not None:
            return np.array(arr, dtype=dtype, copy=copy)
        return arr if dtype is None else np.asarray(arr, dtype=dtype)

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        return self._tensor("__dlpack__").__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU, device 0

    def data_ptr(self) -> int:
        return int(self._tensor("data_ptr").ctypes.data)

    def device_name(self) -> str:
        return "cpu"

    def shape(self) -> list[int]:
        value = self._value
        if isinstance(value, SparseTensor):
            return value.dense_shape()
        return list(self._tensor("shape").shape)

    def data_type(self) -> str:
        return self._type or value_type(self._value)

    def element_type(self) -> int:
        return elem_type_of(self._tensor("element_type").dtype)

    def tensor_size_in_bytes(self) -> int:
        arr = self._tensor("tensor_size_in_bytes")
        if arr.dtype == object:
            return int(sum(len(str(s).encode()) for s in arr.flat))
        return int(arr.nbytes)

    def has_value(self) -> bool:
        return self._value is not None

    def is_tensor(self) -> bool:
        return isinstance(self._value, np.ndarray)

    def is_sparse_tensor(self) -> bool:
        return isinstance(self._value, SparseTensor)

    def is_tensor_sequence(self) -> bool:
        return isinstance(self._value, list)

    def as_sparse_tensor(self) -> SparseTensor:
        if not isinstance(self._value, SparseTensor):
            raise RuntimeInvalidArgument(f"as_sparse_tensor: this OrtValue holds a {self.data_type()}")
        return self._value

    def update_inplace(self, data: Any) -> None:
        """Copy ``data`` (a numpy array or an OrtValue) into this tensor's memory."""
        arr = self._tensor("update_inplace")
        src = data.numpy() if isinstance(data, OrtValue) else data
        if not isinstance(src, np.ndarray):
            raise InvalidArgumentType("data must be a numpy.ndarray or an OrtValue.")
        if src.size != arr.size or src.dtype != arr.dtype:
            raise RuntimeInvalidArgument(
                f"update_inplace: source {src.dtype}{list(src.shape)} does not fit this OrtValue "
                f"({arr.dtype}{list(arr.shape)})")
        np.copyto(arr, src.reshape(arr.shape))

    def _get_c_value(self) -> OrtValue:
        return self

    def __repr__(self) -> str:
        shape = f", shape={list(self._value.shape)}" if isinstance(self._value, np.ndarray) else ""
        return f"OrtValue({self.data_type()}{shape}, device=cpu)"


class _Capsule:
    """A raw DLPack capsule presented to ``np.from_dlpack`` as a CPU producer."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def copy_tensors(src: Sequence[OrtValue], dst: Sequence[OrtValue], stream: Any = None) -> None:
    """Copy each source tensor into the matching destination tensor (CPU to CPU)."""
    if len(src) != len(dst):
        raise RuntimeInvalidArgument(f"copy_tensors: {len(src)} sources but {len(dst)} destinations")
    for s, d in zip(src, dst):
        d.update_inplace(s)


# -- SparseTensor ---------------------------------------------------------------------------------


class _View:
    def __init__(self, **arrays: np.ndarray) -> None:
        self._arrays = arrays

    def indices(self) -> np.ndarray:
        return self._arrays["indices"]

    def inner(self) -> np.ndarray:
        return self._arrays["inner"]

    def outer(self) -> np.ndarray:
        return self._arrays["outer"]


def _readonly(arr: Any, dtype: Any = None) -> np.ndarray:
    out = np.array(arr, dtype=dtype, copy=True)
    out.flags.writeable = False
    return out


class SparseTensor:
    """A COO or CSR(C) sparse tensor on the CPU (onnxruntime's ``SparseTensor`` API).

    Sessions do not take sparse inputs here (no kernel computes on sparse data); sparse
    *initializers* in models are densified at load, as onnxruntime does for ops without sparse
    kernels.
    """

    def __init__(self, fmt: OrtSparseFormat, dense_shape: Sequence[int], values: np.ndarray, **indices: np.ndarray) -> None:
        self._format = fmt
        self._shape = [int(d) for d in dense_shape]
        self._values = _readonly(values, object if np.asarray(values).dtype.kind in "OUS" else None)
        self._indices = {k: _readonly(v, np.int64) for k, v in indices.items()}

    @staticmethod
    def sparse_coo_from_numpy(dense_shape: Sequence[int], values: np.ndarray, coo_indices: np.ndarray,
                              ort_device: OrtDevice) -> SparseTensor:
        """COO: ``coo_indices`` are linear indices (1-D, one per value) or ``[nnz, rank]`` coordinates."""
        _check_sparse_device(ort_device)
        values = np.asarray(values)
        idx = np.asarray(coo_indices)
        nnz = values.shape[0] if values.ndim else 0
        if not (idx.ndim == 1 and idx.shape[0] == nnz) and not (idx.ndim == 2 and idx.shape == (nnz, len(dense_shape))):
            raise RuntimeInvalidArgument(f"sparse_coo_from_numpy: indices of shape {list(idx.shape)} do not fit "
                                         f"{nnz} values of a {len(dense_shape)}-D tensor")
        return SparseTensor(OrtSparseFormat.ORT_SPARSE_COO, dense_shape, values, indices=idx)

    @staticmethod
    def sparse_csr_from_numpy(dense_shape: Sequence[int], values: np.ndarray, inner_indices: np.ndarray,
                              outer_indices: np.ndarray, ort_device: OrtDevice) -> SparseTensor:
        """CSR(C) of a 2-D tensor: column (inner) index per value, row (outer) offsets (rows + 1)."""
        _check_sparse_device(ort_device)
        values = np.asarray(values)
        if len(dense_shape) != 2 or len(inner_indices) != len(values) or len(outer_indices) != dense_shape[0] + 1:
            raise RuntimeInvalidArgument("sparse_csr_from_numpy: expected a 2-D shape, one inner index per value and "
                                         "rows + 1 outer indices")
        return SparseTensor(OrtSparseFormat.ORT_SPARSE_CSRC, dense_shape, values, inner=inner_indices,
                            outer=outer_indices)

    def values(self) -> np.ndarray:
        return self._values

    def as_coo_view(self) -> _View:
        self._expect(OrtSparseFormat.ORT_SPARSE_COO)
        return _View(indices=self._indices["indices"])

    def as_csrc_view(self) -> _View:
        self._expect(OrtSparseFormat.ORT_SPARSE_CSRC)
        return _View(inner=self._indices["inner"], outer=self._indices["outer"])

    def as_blocksparse_view(self) -> _View:
        self._expect(OrtSparseFormat.ORT_SPARSE_BLOCK_SPARSE)
        return _View()

    def _expect(self, fmt: OrtSparseFormat) -> None:
        if self._format != fmt:
            raise RuntimeInvalidArgument(f"this sparse tensor is {self._format.name}, not {fmt.name}")

    def to_cuda(self, ort_device: OrtDevice) -> SparseTensor:
        raise RuntimeInvalidArgument("to_cuda: this package has no CUDA device (onnxpack computes on the CPU)")

    def format(self) -> OrtSparseFormat:
        return self._format

    def dense_shape(self) -> list[int]:
        return list(self._shape)

    def data_type(self) -> str:
        return f"sparse_tensor({_ELEM_NAMES[elem_type_of(self._values.dtype)]})"

    def device_name(self) -> str:
        return "cpu"

    def _get_c_tensor(self) -> SparseTensor:
        return self

    def to_dense(self) -> np.ndarray:
        """The dense tensor (onnxpack's addition; zeros are the dtype's zero, "" for strings)."""
        out = np.zeros(self._shape, self._values.dtype)
        if self._values.dtype == object:
            out.fill("")
        if self._format == OrtSparseFormat.ORT_SPARSE_COO:
            idx = self._indices["indices"]
            flat = idx if idx.ndim == 1 else np.ravel_multi_index(tuple(idx.T), self._shape)
            out.reshape(-1)[flat] = self._values
        else:
            outer, inner = self._indices["outer"], self._indices["inner"]
            rows = np.repeat(np.arange(self._shape[0]), np.diff(outer))
            out[rows, inner] = self._values
        return out


def _check_sparse_device(device: Any) -> None:
    if not isinstance(device, OrtDevice):
        raise InvalidArgumentType(f"expected an OrtDevice, got {type(device).__name__}")
    if device.device_type() != 0:
        raise RuntimeInvalidArgument("sparse tensors live on the CPU here (onnxpack has no other device)")
