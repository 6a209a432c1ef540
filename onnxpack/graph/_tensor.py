"""Tensor: one initializer (or constant) of a model, as a lazily built read-only numpy view."""

from __future__ import annotations

import math
import mmap
import sys

import numpy as np

from onnxpack.errors import ExternalDataError, ModelLoadError
from onnxpack.graph._external import DataFiles, ExternalLocation
from onnxpack.graph._proto import TensorProto, tensor_dtype_to_np_dtype

__all__ = ["Tensor", "storage_nbytes", "mapped_view", "shape_fits", "to_array"]


def _numpy_helper():
    """onnx.numpy_helper, for the rare element types and layouts converted here by onnx itself
    (imported on first use: see _proto)."""
    from onnx import numpy_helper

    return numpy_helper


def to_array(proto: TensorProto) -> np.ndarray:
    """An in-proto tensor (a Constant's value, an attribute's tensor) as a read-only array, as
    ``onnx.numpy_helper.to_array`` converts it; the model's checks on counts and shapes apply."""
    return Tensor(proto, None).numpy()


# Element types stored packed, several per byte: bits per element.  Their raw bytes cannot be a
# zero-copy numpy view (ml_dtypes' int4 etc. use one byte per element), so numpy() unpacks.
_PACKED_BITS = {
    TensorProto.INT4: 4,
    TensorProto.UINT4: 4,
    TensorProto.FLOAT4E2M1: 4,
}
for _name, _bits in (("INT2", 2), ("UINT2", 2), ("FLOAT6E2M3", 6), ("FLOAT6E3M2", 6)):
    if hasattr(TensorProto, _name):
        _PACKED_BITS[getattr(TensorProto, _name)] = _bits


_DTYPES: dict[int, np.dtype] = {}
_STRING = TensorProto.STRING
_EXTERNAL = TensorProto.EXTERNAL


def _np_dtype(elem_type: int, name: str) -> np.dtype:
    dtype = _DTYPES.get(elem_type)
    if dtype is not None:
        return dtype
    try:
        dtype = np.dtype(tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"tensor {name!r}: unsupported element type {elem_type}") from e
    _DTYPES[elem_type] = dtype
    return dtype


def storage_nbytes(elem_type: int, dims: tuple[int, ...], dtype: np.dtype) -> int:
    """Bytes a tensor of this type and shape occupies as raw (little-endian, packed) data."""
    count = math.prod(dims)
    bits = _PACKED_BITS.get(elem_type)
    if bits is not None:
        return (count * bits + 7) // 8
    return count * dtype.itemsize


# numpy refuses any array (even an empty one) whose dims, zeros counted as 1, multiply to more
# bytes than an intp can hold; a shape is accepted only if it is an array numpy can make.
_MAX_ARRAY_BYTES = 2**62


def shape_fits(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether numpy can represent an array of ``shape`` (dims ≥ 0; zeros counted as 1)."""
    n = math.prod(shape)
    if n > 0 and (not shape or min(shape) > 0):  # the common case: every dim positive
        return n * max(itemsize, 1) <= _MAX_ARRAY_BYTES
    return all(d >= 0 for d in shape) and math.prod(max(int(d), 1) for d in shape) * max(itemsize, 1) <= _MAX_ARRAY_BYTES


def byte_array(buffer) -> np.ndarray | None:
    """A read-only uint8 array over all of ``buffer`` (a read-only mapping or bytes) for
    :func:`mapped_view` to slice, or None when it is empty or writable."""
    if not len(buffer):
        return None
    arr = np.frombuffer(buffer, np.uint8)
    return None if arr.flags.writeable else arr


def mapped_view(buffer, dtype: np.dtype | str, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """A read-only zero-copy array of ``shape`` over ``buffer`` (a mapping or bytes) at ``offset``.

    The one place a file region becomes an array (tensors, pre-packed blobs, cache entries);
    callers have checked the bounds.  An empty shape of zero elements is a fresh empty array.
    ``buffer`` may be :func:`byte_array` of a mapping, for many views of one file.
    """
    count = math.prod(shape)
    if count == 0:
        arr = np.zeros(shape, dtype=dtype)
    elif buffer.__class__ is np.ndarray:
        # A read-only uint8 array over a whole mapping (see ``byte_array``): a slice of it holds
        # the mapping through that array's one buffer export; frombuffer would take an export
        # per view, after first asking for a writable one and clearing the error (~2.4 vs 1 us).
        dtype = np.dtype(dtype)
        return buffer[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
    else:
        # frombuffer, not np.ndarray(buffer=...): numpy's constructor keeps no buffer export, so
        # closing the mapping under a live view would unmap its pages (a crash, not an error).
        arr = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
        if not arr.flags.writeable:  # a read-only mapping or bytes: already what we hand out
            return arr
    arr.flags.writeable = False
    return arr


# In-proto tensors without raw_data keep their values in one typed field (onnx.proto3 comments).
_TYPED_FIELD = {
    TensorProto.FLOAT: ("float_data", 1),
    TensorProto.COMPLEX64: ("float_data", 2),
    TensorProto.DOUBLE: ("double_data", 1),
    TensorProto.COMPLEX128: ("double_data", 2),
    TensorProto.INT64: ("int64_data", 1),
    TensorProto.UINT32: ("uint64_data", 1),
    TensorProto.UINT64: ("uint64_data", 1),
}


# Element types whose typed field numpy_helper.to_array converts with one ``astype``: elem type ->
# (field, storage dtype).
_TYPED_NUMPY = {
    TensorProto.FLOAT: ("float_data", np.float32),
    TensorProto.DOUBLE: ("double_data", np.float64),
    TensorProto.INT64: ("int64_data", np.int64),
    TensorProto.INT32: ("int32_data", np.int32),
    TensorProto.INT8: ("int32_data", np.int32),
    TensorProto.UINT8: ("int32_data", np.int32),
}


def _check_typed_count(proto: TensorProto, name: str, elem_type: int, dims: tuple[int, ...]) -> None:
    """Checks that an in-proto tensor holds as many values as its shape needs, before anything
    is allocated: a model declaring a 10^12-element tensor with no data must be an error, not a
    ``reshape`` failure or a huge allocation (found by the reliability fuzzer)."""
    field, per_element = _TYPED_FIELD.get(elem_type, ("int32_data", 1))
    count = math.prod(dims)
    bits = _PACKED_BITS.get(elem_type)
    # Sub-byte types keep one packed byte per int32_data entry.
    need = (count * bits + 7) // 8 if bits is not None else count * per_element
    got = len(getattr(proto, field))
    if got != need:
        raise ModelLoadError(
            f"tensor {name!r}: holds {got} values in {field}, expected {need} for shape {dims} and "
            f"dtype {TensorProto.DataType.Name(elem_type)} (no raw_data, no external data)"
        )


class Tensor:
    """One tensor of a model; data is materialized only when asked for.

    Attributes:
        name: the tensor's name.
        elem_type: ONNX element type (``TensorProto.FLOAT`` …).
        dims: shape.
        dtype: numpy dtype (``onnx.helper.tensor_dtype_to_np_dtype``).
        nbytes: bytes the data occupies as stored raw (on disk for external tensors).
        proto: the TensorProto (external data is NOT pulled into it).
        external: where the bytes live when external, else ``None``.
    """

    __slots__ = ("name", "elem_type", "dims", "dtype", "nbytes", "proto", "external",
                 "_buffer", "_array", "_raw", "_handed")

    def __init__(self, proto: TensorProto, files: DataFiles | None, *,
                 array: np.ndarray | None = None) -> None:
        self.proto = proto
        self.name = name = proto.name
        self.elem_type = elem_type = proto.data_type
        self.dims = dims = tuple(proto.dims[:])  # protobuf's int64 field: Python ints (sliced: see _model.subgraphs_of)
        if dims and min(dims) < 0:
            raise ModelLoadError(f"tensor {name!r}: negative dimension in {dims}")
        dtype = _DTYPES.get(elem_type)
        if dtype is None:
            dtype = _np_dtype(elem_type, name)
        self.dtype = dtype
        if not shape_fits(dims, dtype.itemsize):
            raise ModelLoadError(f"tensor {name!r}: shape {dims} is too large for any array")
        self._array = array
        self._buffer = None
        self._handed = False  # whether raw() handed out a view of the mapped bytes
        self._raw: bytes | memoryview | None = None
        self.external: ExternalLocation | None = None
        if elem_type == _STRING:
            if proto.data_location == _EXTERNAL:
                raise ExternalDataError(
                    f"tensor {name!r}: string tensors cannot be stored as external data"
                )
            if array is None and len(proto.string_data) != math.prod(dims):
                raise ModelLoadError(
                    f"tensor {name!r}: holds {len(proto.string_data)} strings, expected "
                    f"{math.prod(dims)} for shape {dims}"
                )
            self.nbytes = sum(len(s) for s in proto.string_data)
            return
        self.nbytes = storage_nbytes(elem_type, dims, dtype)
        if proto.data_location == _EXTERNAL:
            if files is None:
                raise ExternalDataError(
                    f"tensor {self.name!r} uses external data but no data folder is known"
                )
            self.external, self._buffer = files.locate(proto, self.nbytes)
        elif proto.HasField("raw_data") and array is None:
            if len(proto.raw_data) != self.nbytes:
                raise ModelLoadError(
                    f"tensor {self.name!r}: raw_data has {len(proto.raw_data)} bytes, expected "
                    f"{self.nbytes} for shape {self.dims} and dtype "
                    f"{TensorProto.DataType.Name(self.elem_type)}"
                )
        elif array is None:
            _check_typed_count(proto, self.name, self.elem_type, self.dims)

    def __repr__(self) -> str:
        where = f"external {self.external.location}@{self.external.offset}" if self.external else "in-proto"
        return f"Tensor({self.name!r}, {self.dtype}, {self.dims}, {where})"

    def drop_pages(self) -> bool:
        """Tell the OS this process no longer needs the tensor's mapped pages resident.

        Used after a weight was packed and nothing reads the original any more: its pages leave
        this process's RSS (they stay in the page cache, shared, and would simply fault back in
        if read again, so views stay valid).  Only whole pages inside the tensor are dropped.
        Returns whether anything was advised.  Nothing is when no view of the bytes was ever
        handed out (:meth:`raw`, :meth:`numpy`): no page of them was touched through this tensor
        (a warm start reads none of its packed weights), and the system call would be for nothing.
        """
        buf = self._buffer
        if self.external is None or not isinstance(buf, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return False
        if self._array is None and not self._handed:
            return False
        page = mmap.PAGESIZE
        start = -(-self.external.offset // page) * page
        end = (self.external.offset + self.external.length) // page * page
        if end <= start:
            return False
        try:
            buf.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            return False
        return True

    def raw(self) -> memoryview | bytes:
        """The tensor's bytes as stored: little-endian, packed for sub-byte types, no copy when
        external (a read-only memoryview of the mapping).

        For an in-proto tensor these are the very bytes :meth:`numpy` views (one buffer, kept):
        protobuf hands out a new ``bytes`` object at every ``raw_data`` access, and a saver that
        recognises a pack as a view of its weight (an identity pack) compares buffer addresses —
        two copies would make every in-proto fp32 weight's pack a second copy on disk.
        """
        if self.external is not None:
            start = self.external.offset
            self._handed = True
            return memoryview(self._buffer)[start:start + self.external.length]
        if self._raw is not None:
            return self._raw
        if self.proto.HasField("raw_data") and self._array is None:
            self._raw = self.proto.raw_data
            return self._raw
        if self.elem_type == TensorProto.STRING:
            raise ModelLoadError(f"tensor {self.name!r}: string tensors have no raw bytes")
        arr = self.numpy()
        if self.elem_type in _PACKED_BITS or sys.byteorder == "big" or not arr.flags.c_contiguous:
            return _numpy_helper().from_array(arr, self.name).raw_data
        # Typed fields (or a given array): the array's own bytes are the stored little-endian ones.
        self._raw = memoryview(arr.reshape(-1).view(np.uint8))
        return self._raw

    def numpy(self) -> np.ndarray:
        """The data as a read-only array (zero-copy over the mapping for external data)."""
        if self._array is not None:
            return self._array
        if self.elem_type == TensorProto.STRING or (
            self.external is None and not self.proto.HasField("raw_data")
        ):
            # Typed fields: a copy is unavoidable.  The common numeric types directly, as
            # numpy_helper.to_array converts them (its generic path costs ~25 us a tensor, and a
            # QDQ model stores every scale and zero point this way).
            typed = _TYPED_NUMPY.get(self.elem_type)
            if typed is not None and not self.proto.HasField("segment"):
                field, storage = typed
                values = getattr(self.proto, field)
                if len(values) == 1:
                    # One value (a QDQ model's scales and zero points, ~400 in a ResNet-50): a
                    # fresh 0-d array of it, cast and shaped as below; numpy's sequence
                    # conversion of the repeated field costs several times more.
                    arr = np.array(values[0], dtype=storage)
                    if arr.dtype != self.dtype:
                        arr = arr.astype(self.dtype)
                    if self.dims != ():
                        arr = arr.reshape(self.dims)
                else:
                    arr = np.asarray(values, dtype=storage).astype(self.dtype).reshape(self.dims)
            else:
                arr = _numpy_helper().to_array(self.proto)
        elif self.elem_type in _PACKED_BITS or sys.byteorder == "big":
            proto = TensorProto()
            proto.data_type = self.elem_type
            proto.dims.extend(self.dims)
            proto.raw_data = bytes(self.raw())
            arr = _numpy_helper().to_array(proto)
        elif self.external is not None:
            arr = mapped_view(self._buffer, self.dtype, self.dims, self.external.offset)
        else:
            arr = mapped_view(self.raw(), self.dtype, self.dims, 0)
        arr.flags.writeable = False
        self._array = arr
        return arr
