"""LoRA adapters in onnxruntime's adapter file format (``.onnx_adapter``): read, write, run.

The format is a FlatBuffer (onnxruntime's ``adapter_schema.fbs``, file identifier ``TORT``)::

    table Parameter { name:string; dims:[int64]; data_type:int32 (ONNX element type);
                      raw_data:[uint8] (force_align: 8); }
    table Adapter   { format_version:int; adapter_version:int; model_version:int;
                      parameters:[Parameter]; }

Files written here are read by onnxruntime and the reverse (tested both ways).  Reading treats
the file as untrusted: every offset, length and vtable entry is bounds-checked, and a bad file is
a :class:`~onnxpack.errors.Fail` naming what was being read ("The buffer fails lora adapter
format verification: ...").

``RunOptions.add_active_adapter(adapter)`` makes a run feed the adapter's parameters by name (a
parameter is a model input, usually an initializer the adapter overrides); the caller's feed wins
over an adapter, a later adapter over an earlier one.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import numpy as np

from onnxpack.graph import shape_fits
from onnxpack.errors import Fail, InvalidArgumentType
from onnxpack.graph._proto import np_dtype_to_tensor_dtype, tensor_dtype_to_np_dtype

__all__ = ["AdapterFormat", "LoraAdapter", "read_adapter_bytes", "write_adapter_bytes", "FORMAT_VERSION", "IDENTIFIER"]

IDENTIFIER = b"TORT"
FORMAT_VERSION = 1  # onnxruntime's kAdapterFormatVersion
_MAX_FILE = 1 << 40  # a sanity cap: sizes read from a file beyond this are corrupt


# -- reading --------------------------------------------------------------------------------------


class _Reader:
    """Checked reads of a FlatBuffer: each says what it was reading when it fails."""

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = memoryview(buf).cast("B")

    def _need(self, pos: int, n: int, what: str) -> None:
        if pos < 0 or n < 0 or pos + n > len(self.buf):
            raise Fail(f"The buffer fails lora adapter format verification: {what} at offset {pos} "
                       f"({n} bytes) is outside the {len(self.buf)}-byte buffer")

    def u32(self, pos: int, what: str) -> int:
        self._need(pos, 4, what)
        return struct.unpack_from("<I", self.buf, pos)[0]

    def i32(self, pos: int, what: str) -> int:
        self._need(pos, 4, what)
        return struct.unpack_from("<i", self.buf, pos)[0]

    def u16(self, pos: int, what: str) -> int:
        self._need(pos, 2, what)
        return struct.unpack_from("<H", self.buf, pos)[0]

    def table(self, pos: int, what: str) -> dict[int, int]:
        """Field index -> absolute position of the field, for the table at ``pos``."""
        vt = pos - self.i32(pos, f"{what} vtable offset")
        size = self.u16(vt, f"{what} vtable size")
        if size < 4 or size % 2:
            raise Fail(f"The buffer fails lora adapter format verification: {what} vtable size {size}")
        self._need(vt, size, f"{what} vtable")
        fields = {}
        for i in range((size - 4) // 2):
            off = self.u16(vt + 4 + 2 * i, f"{what} field {i}")
            if off:
                fields[i] = pos + off
        return fields

    def ref(self, pos: int, what: str) -> int:
        return pos + self.u32(pos, what)

    def vector(self, pos: int, itemsize: int, what: str) -> tuple[int, int]:
        start = self.ref(pos, what)
        n = self.u32(start, f"{what} length")
        self._need(start + 4, n * itemsize, what)
        return start + 4, n


def read_adapter_bytes(data: bytes | memoryview) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """``({"format_version", "adapter_version", "model_version"}, {name: array})`` of an adapter file.

    Arrays are read-only views of ``data`` (no copy).
    """
    r = _Reader(data)
    if len(r.buf) < 8 or bytes(r.buf[4:8]) != IDENTIFIER:
        raise Fail("The buffer does not appear to be a valid lora parameter format")
    root = r.ref(0, "root table offset")
    f = r.table(root, "Adapter")
    versions = {name: (r.i32(f[i], name) if i in f else 0)
                for i, name in enumerate(("format_version", "adapter_version", "model_version"))}
    if versions["format_version"] != FORMAT_VERSION:
        raise Fail(f"Unsupported lora format version {versions['format_version']} (supported: {FORMAT_VERSION})")
    params: dict[str, np.ndarray] = {}
    if 3 in f:
        start, n = r.vector(f[3], 4, "Adapter.parameters")
        for k in range(n):
            p = r.table(r.ref(start + 4 * k, f"parameter {k}"), f"parameter {k}")
            name = ""
            if 0 in p:
                s, length = r.vector(p[0], 1, f"parameter {k} name")
                try:
                    name = bytes(r.buf[s: s + length]).decode("utf-8", "strict")
                except UnicodeDecodeError:
                    raise Fail(f"The buffer fails lora adapter format verification: parameter {k} name is not "
                               "UTF-8") from None
            dims: list[int] = []
            if 1 in p:
                s, length = r.vector(p[1], 8, f"parameter {name!r} dims")
                dims = list(struct.unpack_from(f"<{length}q", r.buf, s))
            elem = r.i32(p[2], f"parameter {name!r} data_type") if 2 in p else 0
            try:
                dtype = np.dtype(tensor_dtype_to_np_dtype(elem))
            except Exception:
                raise Fail(f"lora parameter {name!r}: unsupported data type {elem}") from None
            raw_start, raw_len = r.vector(p[3], 1, f"parameter {name!r} raw_data") if 3 in p else (0, 0)
            count = math.prod(dims)  # Python ints: no overflow from hostile dims
            if not shape_fits(tuple(dims), dtype.itemsize) or count * dtype.itemsize != raw_len:
                raise Fail(f"lora parameter {name!r}: {raw_len} bytes of data do not hold {dtype}{dims}")
            arr = np.frombuffer(r.buf, dtype=dtype.newbyteorder("<"), count=count, offset=raw_start)
            params[name] = arr.reshape(dims)
    return versions, params


# -- writing --------------------------------------------------------------------------------------


class _Writer:
    """Writes a FlatBuffer front to back: a table, then what it refers to (uoffsets point forward)."""

    def __init__(self) -> None:
        self.out = bytearray()

    def align(self, n: int, extra: int = 0) -> None:
        """Pad so that ``len(out) + extra`` is a multiple of ``n``."""
        self.out += b"\0" * ((-(len(self.out) + extra)) % n)

    def table(self, scalars: dict[int, int], refs: list[int]) -> tuple[int, dict[int, int]]:
        """A table with int32 ``scalars`` (field -> value) and uoffset fields ``refs``; returns its
        position and field -> position of each uoffset slot, to be patched with :meth:`patch`."""
        fields = sorted({*scalars, *refs})
        nfields = max(fields) + 1 if fields else 0
        table_size = 4 + 4 * len(fields)
        offsets = {f: 4 + 4 * i for i, f in enumerate(fields)}
        vtable = struct.pack(f"<HH{nfields}H", 4 + 2 * nfields, table_size, *(offsets.get(i, 0) for i in range(nfields)))
        self.align(4, len(vtable))
        vt_pos = len(self.out)
        self.out += vtable
        table_pos = len(self.out)
        self.out += struct.pack("<i", table_pos - vt_pos)
        slots = {}
        for f in fields:
            if f in scalars:
                self.out += struct.pack("<i", scalars[f])
            else:
                slots[f] = len(self.out)
                self.out += b"\0\0\0\0"
        return table_pos, slots

    def patch(self, slot: int, target: int) -> None:
        struct.pack_into("<I", self.out, slot, target - slot)

    def vector(self, data: bytes, count: int, align: int) -> int:
        self.align(max(align, 4), 4)
        pos = len(self.out)
        self.out += struct.pack("<I", count) + data
        return pos

    def string(self, text: str) -> int:
        raw = text.encode("utf-8")
        pos = self.vector(raw, len(raw), 4)
        self.out += b"\0"
        return pos


def write_adapter_bytes(params: dict[str, np.ndarray], adapter_version: int, model_version: int) -> bytes:
    """An adapter file holding ``params`` (name -> array), as onnxruntime writes them."""
    w = _Writer()
    w.out += b"\0\0\0\0" + IDENTIFIER
    root_pos, root = w.table({0: FORMAT_VERSION, 1: int(adapter_version), 2: int(model_version)}, [3])
    struct.pack_into("<I", w.out, 0, root_pos)
    vec = w.vector(b"\0" * 4 * len(params), len(params), 4)
    w.patch(root[3], vec)
    for k, (name, value) in enumerate(params.items()):
        arr = np.ascontiguousarray(value)
        elem = np_dtype_to_tensor_dtype(arr.dtype)
        table_pos, slots = w.table({2: int(elem)}, [0, 1, 3])
        w.patch(vec + 4 + 4 * k, table_pos)
        w.patch(slots[0], w.string(name))
        dims = arr.shape or (1,)  # onnxruntime's reader needs at least one dim; it writes scalars as [1]
        w.patch(slots[1], w.vector(struct.pack(f"<{len(dims)}q", *dims), len(dims), 8))
        w.patch(slots[3], w.vector(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(), arr.nbytes, 8))
    return bytes(w.out)


# -- onnxruntime's classes ------------------------------------------------------------------------


def _values(params: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in params.items():
        arr = v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else np.asarray(v)
        out[str(k)] = arr
    return out


class AdapterFormat:
    """Builds and reads adapter files (onnxruntime's ``AdapterFormat``)."""

    def __init__(self, adapter: Any = None) -> None:
        self._format_version = FORMAT_VERSION
        self._adapter_version = 0
        self._model_version = 0
        self._params: dict[str, np.ndarray] = {}

    @staticmethod
    def read_adapter(file_path: str | os.PathLike) -> AdapterFormat:
        with open(file_path, "rb") as f:
            versions, params = read_adapter_bytes(f.read())
        fmt = AdapterFormat()
        fmt._format_version = versions["format_version"]
        fmt._adapter_version = versions["adapter_version"]
        fmt._model_version = versions["model_version"]
        fmt._params = params
        return fmt

    def export_adapter(self, file_path: str | os.PathLike) -> None:
        data = write_adapter_bytes(self._params, self._adapter_version, self._model_version)
        with open(file_path, "wb") as f:
            f.write(data)

    def get_format_version(self) -> int:
        return self._format_version

    def set_adapter_version(self, adapter_version: int) -> None:
        self._adapter_version = int(adapter_version)

    def get_adapter_version(self) -> int:
        return self._adapter_version

    def set_model_version(self, model_version: int) -> None:
        self._model_version = int(model_version)

    def get_model_version(self) -> int:
        return self._model_version

    def set_parameters(self, params: dict[str, Any]) -> None:
        self._params = _values(params)

    def get_parameters(self) -> dict[str, Any]:
        from onnxpack.session._ortvalue import OrtValue

        return {k: OrtValue(v) for k, v in self._params.items()}


class LoraAdapter:
    """A loaded adapter for ``RunOptions.add_active_adapter`` (onnxruntime's ``LoraAdapter``)."""

    def __init__(self) -> None:
        self.parameters: dict[str, np.ndarray] = {}

    def Load(self, file_path: str | os.PathLike) -> None:  # noqa: N802 - onnxruntime's name
        if not isinstance(file_path, (str, os.PathLike)):
            raise InvalidArgumentType(f"LoraAdapter.Load: expected a path, got {type(file_path).__name__}")
        with open(file_path, "rb") as f:
            _, self.parameters = read_adapter_bytes(f.read())
