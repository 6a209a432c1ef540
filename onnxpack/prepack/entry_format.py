"""The per-packed-weight record stored in a saved model's ``metadata_props``.

One record describes one constant weight of one scope and every pack made from it: which weight
(scope path and name), the identity of the source bytes (so a changed weight is detected as
stale), and for each pack its key and its buffers (data file, offset, length, dtype, shape,
checksum).

Where it lives (measured on onnxruntime 1.31.1): an unknown key inside an initializer's
``external_data`` makes onnxruntime refuse the model, keys starting with ``prepacked`` are parsed
as onnxruntime's own, and ``onnx.load`` drops unknown ``external_data`` keys.  Model-level
``metadata_props`` are ignored by every runtime and kept by onnx's save, so each record is one
``metadata_props`` entry:

* **key** ``onnxpack.prepacked/<scope>/<name>`` where ``<scope>`` and ``<name>`` are the scope
  path and weight name *percent-encoded with no safe characters* (``urllib.parse.quote(s,
  safe="")``: every byte outside ``A-Za-z0-9_.-~`` becomes ``%XX``).  The encoded parts contain
  no ``/``, so the one ``/`` after ``<scope>`` splits the key unambiguously, and percent-encoding
  is injective, so two different (scope, name) pairs can never share a key.  The scope and name
  are also stored inside the value; the parser recomputes the key from them and rejects a record
  whose key does not match, so the key is only an index, never a second source of truth.
* **value** ``onnxpack-prepack-v1;`` followed by compact JSON (see ``docs/formats.md``).

Parsing is strict about bounds and sizes (any doubt is a :class:`PrepackFormatError`); the caller
is forgiving about meaning: it downgrades the error to a warning and re-packs the weight.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import math
import re
import zlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import numpy as np

from onnxpack._frozen import fast_init
from onnxpack.graph import MAX_FILE_POSITION, mapped_view, shape_fits
from onnxpack.errors import PrepackFormatError

logger = logging.getLogger(__name__)

__all__ = [
    "KEY_PREFIX",
    "VALUE_MAGIC",
    "FORMAT_VERSION",
    "ALLOWED_DTYPES",
    "BufferRecord",
    "PackRecord",
    "WeightRecord",
    "record_key",
    "is_record_key",
    "FileRecord",
    "file_key",
    "is_file_key",
    "format_file_record",
    "parse_file_record",
    "manifest_bytes",
    "parse_manifest",
    "RecordIndex",
    "format_record",
    "parse_record",
    "check_bounds",
    "checksum",
    "crc32",
    "digest_bytes",
    "buffer_record",
    "split_pack_key",
]

# -- constants, each with its reason ------------------------------------------------------------

# Every metadata_props key we own starts with this; anything else in metadata_props is not ours.
KEY_PREFIX = "onnxpack.prepacked/"

# The value starts with "<magic><version>;" so a foreign or future value is told apart from a
# malformed one before any JSON is parsed (and the version is readable without parsing JSON).
VALUE_MAGIC = "onnxpack-prepack-v"
FORMAT_VERSION = 1
_VALUE_PREFIX = f"{VALUE_MAGIC}{FORMAT_VERSION};"

# A value is parsed only if it is at most this long: a hostile model cannot make us parse
# megabytes of JSON per key.  The largest legal record (MAX_PACKS x MAX_BUFFERS_PER_PACK buffers
# with long locations) stays well below it; the writer enforces the same limit, so we never write
# a record we would refuse to read.
MAX_VALUE_LENGTH = 256 * 1024

# Names (scope path, weight name, data file location) are bounded in UTF-8 bytes.  ONNX names are
# short in practice; the bound keeps the key length bounded too (percent-encoding triples bytes).
MAX_NAME_BYTES = 4096
MAX_KEY_LENGTH = len(KEY_PREFIX) + 1 + 2 * 3 * MAX_NAME_BYTES

# A weight packed by many kernels gets one pack per (kernel family, attributes); more than this
# means a bug or a hostile record.
MAX_PACKS = 16

# A kernel's pack is a handful of buffers (weights, scales, zero points, bias); the cap bounds the
# work done per record and matches the cache file's limit.
MAX_BUFFERS_PER_PACK = 16

# Packed layouts have few dimensions (blocked GEMM panels are 4-5D); numpy itself allows 64.
MAX_DIMS = 8

# Offsets and lengths must fit a signed 64-bit file offset (what mmap/pread accept).
MAX_OFFSET = MAX_FILE_POSITION  # the graph layer's bound on file positions

# Every blob starts 64-byte aligned (cache line, AVX-512 loads; onnxruntime even crashes on
# misaligned blobs).  A record pointing at an unaligned offset is not one we wrote.
BUFFER_ALIGNMENT = 64

# Only plain numeric little-endian dtypes: views over file bytes of these are always valid values
# (no object pointers, no bool bytes other than 0/1, no byte-order surprises on any host).
ALLOWED_DTYPES = frozenset(
    {"|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"}
)
_ITEMSIZE = {d: np.dtype(d).itemsize for d in ALLOWED_DTYPES}  # a warm load checks ~250 records

# Buffer checksums are CRC-32 (zlib.crc32), as 8 lowercase hex digits.  Why: it runs at ~4 GB/s
# here (blake2b ~0.9 GB/s, sha256 ~1.7 GB/s), releases the GIL on large buffers, and detects every
# burst error up to 32 bits; it guards against corruption and wrong offsets, not against an
# attacker (who could rewrite the record and the checksum together anyway).
_CHECKSUM_RE = re.compile(r"[0-9a-f]{8}")
_DRIVE_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")

# Source digests are lowercase hex, 16..128 digits (64..512 bits), even length.  The writer uses
# digest_bytes (blake2b-128); the length range lets the key derivation's digest be reused.
# (Written as a run of 16..128 digits plus an evenness test: sre runs a repeated group such as
# ``(?:[0-9a-f]{2}){8,64}`` pair by pair, ~10x slower, and a warm load checks ~500 of them.)
_DIGEST_RE = re.compile(r"[0-9a-f]{16,128}")

# Pack keys: "<kernel family>/<pack format version>/<hex digest>" (see the pre-packing layer).
_PACK_KEY_RE = re.compile(r"([A-Za-z0-9_.\-]{1,64})/([0-9]{1,9})/([0-9a-f]{16,128})")


def _is_digest(value: Any) -> bool:
    """Lowercase hex of 16..128 digits, an even count."""
    return type(value) is str and not len(value) % 2 and _DIGEST_RE.fullmatch(value) is not None


def _pack_key_match(key: Any) -> re.Match | None:
    m = _PACK_KEY_RE.fullmatch(key) if type(key) is str else None
    return m if m is not None and not len(m.group(3)) % 2 else None


# -- records ------------------------------------------------------------------------------------


def _fail(what: str, expected: str, got: Any) -> PrepackFormatError:
    text = repr(got)
    if len(text) > 200:
        text = text[:200] + "..."
    return PrepackFormatError(f"{what}: expected {expected}, got {text}")


def _check_int(what: str, value: Any, lo: int = 0, hi: int = MAX_OFFSET) -> int:
    # bool is an int subclass; a JSON true must not pass for 1.
    if type(value) is not int:
        raise _fail(what, "an integer", value)
    if not lo <= value <= hi:
        raise _fail(what, f"an integer in [{lo}, {hi}]", value)
    return value


def _check_name(what: str, value: Any, *, allow_empty: bool) -> str:
    if type(value) is not str:
        raise _fail(what, "a string", value)
    if not value and not allow_empty:
        raise _fail(what, "a non-empty string", value)
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise _fail(what, "valid UTF-8 text", value) from e
    if n > MAX_NAME_BYTES:
        raise _fail(what, f"at most {MAX_NAME_BYTES} UTF-8 bytes", f"{n} bytes")
    if "\x00" in value:
        raise _fail(what, "no NUL character", value)
    return value


def _check_location(what: str, value: Any) -> str:
    if type(value) is str and value in _GOOD_LOCATIONS:
        return value
    _check_name(what, value, allow_empty=False)
    # Syntax only: the graph layer resolves the name against the model folder (symlinks etc.).
    parts = value.replace("\\", "/").split("/")
    drive = len(value) > 1 and value[1] == ":" and value[0] in _DRIVE_LETTERS
    if value.startswith(("/", "\\")) or drive or ".." in parts:
        raise _fail(what, "a relative file name inside the model folder", value)
    if len(_GOOD_LOCATIONS) < 64:
        _GOOD_LOCATIONS.add(value)
    return value


# Locations that passed _check_location, a pure function of the text: a model's ~250 buffers
# name the same one or two data files.
_GOOD_LOCATIONS: set[str] = set()


def _buffer_ok(b: "BufferRecord") -> bool:
    """Whether every field of ``b`` follows the rules ``BufferRecord._explain`` checks one by one
    (each condition here is one of them, or stricter): a warm load checks ~250 buffers, and a
    record that passes needs no message, so it costs one expression instead of ~15 calls."""
    offset, length, shape, itemsize = b.offset, b.length, b.shape, _ITEMSIZE.get(b.dtype) if type(b.dtype) is str else None
    if not (type(b.location) is str and b.location in _GOOD_LOCATIONS and type(offset) is int and type(length) is int
            and 0 <= offset and 0 <= length and offset + length <= MAX_OFFSET and not offset % BUFFER_ALIGNMENT
            and itemsize is not None and type(shape) is tuple and len(shape) <= MAX_DIMS
            and type(b.checksum) is str and len(b.checksum) == 8 and _CHECKSUM_RE.fullmatch(b.checksum)):
        return False
    n = itemsize
    for d in shape:
        if type(d) is not int or not 0 < d <= MAX_OFFSET:  # a zero dim: the careful path
            return False
        n *= d
    return n == length and shape_fits(shape, itemsize)


@fast_init
@dataclasses.dataclass(frozen=True)
class BufferRecord:
    """One packed buffer: where its bytes are and what they are.

    ``location`` is a data file name relative to the model's folder; ``offset`` is 64-byte
    aligned; ``length == prod(shape) * itemsize``; ``dtype`` is a numpy dtype string from
    :data:`ALLOWED_DTYPES`; ``checksum`` is the CRC-32 of the bytes as 8 hex digits.
    """

    location: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    checksum: str

    def __post_init__(self) -> None:
        if not _buffer_ok(self):
            self._explain()

    def _explain(self) -> None:
        """Raises the error naming the first field that breaks the rules (``_buffer_ok`` said one does)."""
        _check_location("buffer location", self.location)
        _check_int("buffer offset", self.offset)
        if self.offset % BUFFER_ALIGNMENT:
            raise _fail("buffer offset", f"a multiple of {BUFFER_ALIGNMENT}", self.offset)
        _check_int("buffer length", self.length)
        if self.offset + self.length > MAX_OFFSET:
            raise _fail("buffer end (offset + length)", f"at most {MAX_OFFSET}", self.offset + self.length)
        if type(self.dtype) is not str or self.dtype not in ALLOWED_DTYPES:
            raise _fail("buffer dtype", f"one of {sorted(ALLOWED_DTYPES)}", self.dtype)
        if type(self.shape) is not tuple:
            raise _fail("buffer shape", "a tuple of integers", self.shape)
        if len(self.shape) > MAX_DIMS:
            raise _fail("buffer shape", f"at most {MAX_DIMS} dimensions", self.shape)
        for d in self.shape:
            _check_int("buffer shape dimension", d)
        itemsize = _ITEMSIZE[self.dtype]
        if not shape_fits(self.shape, itemsize):
            raise _fail("buffer shape", "dims whose product fits an array", list(self.shape))
        expected = math.prod(self.shape) * itemsize
        if self.length != expected:
            raise _fail(
                "buffer length",
                f"prod(shape {list(self.shape)}) * itemsize of {self.dtype} = {expected}",
                self.length,
            )
        if type(self.checksum) is not str or not _CHECKSUM_RE.fullmatch(self.checksum):
            raise _fail("buffer checksum", "8 lowercase hex digits (CRC-32)", self.checksum)

    def view(self, data: Any, size: int | None = None) -> np.ndarray:
        """A zero-copy view of this buffer in ``data`` (bytes, mmap; ``size``: its length when
        known), after a bounds check."""
        if size is None:
            size = len(data)
        if self.offset + self.length > size:
            raise _fail(
                f"buffer in {self.location!r}",
                f"offset + length <= file size {size}",
                f"{self.offset} + {self.length}",
            )
        dtype = _NP_DTYPES.get(self.dtype)
        if dtype is None:  # (a numpy dtype, not its string: frombuffer parses a string at every call)
            dtype = _NP_DTYPES[self.dtype] = np.dtype(self.dtype)
        return mapped_view(data, dtype, tuple(self.shape), self.offset)


@fast_init
@dataclasses.dataclass(frozen=True)
class PackRecord:
    """One pack of a weight: its key (``family/version/digest``) and its buffers, in order."""

    key: str
    buffers: tuple[BufferRecord, ...]

    def __post_init__(self) -> None:
        b = self.buffers
        if not (type(b) is tuple and 0 < len(b) <= MAX_BUFFERS_PER_PACK and _pack_key_match(self.key)
                and all(type(x) is BufferRecord for x in b)):
            self._explain()

    def _explain(self) -> None:
        """Raises the error naming the first rule the pack breaks (the one expression above said one does)."""
        split_pack_key(self.key)
        if type(self.buffers) is not tuple or not self.buffers:
            raise _fail(f"buffers of pack {self.key!r}", "a non-empty tuple", self.buffers)
        if len(self.buffers) > MAX_BUFFERS_PER_PACK:
            raise _fail(f"buffers of pack {self.key!r}", f"at most {MAX_BUFFERS_PER_PACK}", len(self.buffers))
        for b in self.buffers:
            if not isinstance(b, BufferRecord):
                raise _fail(f"buffer of pack {self.key!r}", "a BufferRecord", b)


def _plain_name(value: Any, allow_empty: bool) -> bool:
    """Whether ``value`` passes ``_check_name`` for certain: ASCII without NUL, short enough
    (anything else goes through ``_check_name`` itself)."""
    return (type(value) is str and (allow_empty or bool(value)) and len(value) <= MAX_NAME_BYTES and value.isascii()
            and "\x00" not in value)


def _weight_ok(r: "WeightRecord") -> bool:
    """Whether ``r`` follows every rule ``WeightRecord.__post_init__`` checks one by one."""
    off, length, packs = r.source_offset, r.source_length, r.packs
    if not (_plain_name(r.scope, True) and _plain_name(r.name, False) and type(length) is int
            and 0 <= length <= MAX_OFFSET and (off is None or (type(off) is int and 0 <= off and off + length <= MAX_OFFSET))
            and _is_digest(r.source_digest)
            and type(packs) is tuple and 0 < len(packs) <= MAX_PACKS):
        return False
    keys = set()
    for p in packs:
        if type(p) is not PackRecord or p.key in keys:
            return False
        keys.add(p.key)
    return True


@fast_init
@dataclasses.dataclass(frozen=True)
class WeightRecord:
    """Every pack made from one weight of one scope.

    ``scope`` is the scope path ("" for the root graph), ``name`` the initializer name.
    ``source_length``, ``source_offset`` (its offset in the external data file, ``None`` when the
    weight is stored inside the proto) and ``source_digest`` (hex, see :func:`digest_bytes`)
    identify the bytes the packs were made from: if the weight no longer matches, the record is
    stale and the weight is re-packed.
    """

    scope: str
    name: str
    source_length: int
    source_offset: int | None
    source_digest: str
    packs: tuple[PackRecord, ...]

    def __post_init__(self) -> None:
        if not _weight_ok(self):
            self._explain()

    def _explain(self) -> None:
        """Raises the error naming the first rule the record breaks (``_weight_ok`` said one does)."""
        _check_name("scope path", self.scope, allow_empty=True)
        _check_name("weight name", self.name, allow_empty=False)
        _check_int("source length", self.source_length)
        if self.source_offset is not None:
            _check_int("source offset", self.source_offset)
            if self.source_offset + self.source_length > MAX_OFFSET:
                end = self.source_offset + self.source_length
                raise _fail("source end (offset + length)", f"at most {MAX_OFFSET}", end)
        if not _is_digest(self.source_digest):
            raise _fail("source digest", "16..128 lowercase hex digits (even count)", self.source_digest)
        if type(self.packs) is not tuple or not self.packs:
            raise _fail(f"packs of weight {self.name!r}", "a non-empty tuple", self.packs)
        if len(self.packs) > MAX_PACKS:
            raise _fail(f"packs of weight {self.name!r}", f"at most {MAX_PACKS}", len(self.packs))
        seen: set[str] = set()
        for p in self.packs:
            if not isinstance(p, PackRecord):
                raise _fail(f"pack of weight {self.name!r}", "a PackRecord", p)
            if p.key in seen:
                raise _fail(f"packs of weight {self.name!r}", "distinct pack keys", p.key)
            seen.add(p.key)


# -- helpers ------------------------------------------------------------------------------------


def split_pack_key(key: str) -> tuple[str, int, str]:
    """Split ``family/version/digest`` into its parts; :class:`PrepackFormatError` if malformed."""
    m = _pack_key_match(key)
    if m is None:
        raise _fail("pack key", "'<family>/<version>/<hex digest>' (e.g. 'matmul/1/0123abcd...')", key)
    return m.group(1), int(m.group(2)), m.group(3)


def crc32(data: Any) -> int:
    """CRC-32 (zlib) of bytes, a buffer or an array's C-order bytes, without copying views."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
        data = data.reshape(-1).view(np.uint8) if data.size else b""
    return zlib.crc32(data) & 0xFFFFFFFF


def checksum(data: Any) -> str:
    """CRC-32 of a buffer's bytes as 8 lowercase hex digits (the record's ``crc32`` field)."""
    return f"{crc32(data):08x}"


def digest_bytes(data: Any) -> str:
    """blake2b-128 hex digest of a source weight's bytes (the staleness check)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
        data = data.reshape(-1).view(np.uint8) if data.size else b""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def buffer_record(array: np.ndarray, location: str, offset: int) -> BufferRecord:
    """The record of ``array`` written at ``offset`` of ``location`` (little-endian bytes)."""
    dt = np.dtype(array.dtype)
    if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        dt = dt.newbyteorder("<")
        array = array.astype(dt)
    return BufferRecord(
        location=location,
        offset=offset,
        length=int(array.nbytes),
        dtype=dt.str,
        shape=tuple(int(d) for d in array.shape),
        checksum=checksum(array),
    )


def record_key(scope: str, name: str) -> str:
    """The metadata_props key of the record of weight ``name`` in scope ``scope``."""
    _check_name("scope path", scope, allow_empty=True)
    _check_name("weight name", name, allow_empty=False)
    return _key_of(scope, name)


# Characters ``quote(..., safe='')`` leaves as they are: a name made only of them is its own quoting
# (most weight names; urllib's quote costs ~2 us a call, twice per record at every warm load).
_UNQUOTED = re.compile(r"[A-Za-z0-9_.~-]*")


def _key_of(scope: str, name: str) -> str:
    if _UNQUOTED.fullmatch(scope) and _UNQUOTED.fullmatch(name):
        return f"{KEY_PREFIX}{scope}/{name}"
    return f"{KEY_PREFIX}{quote(scope, safe='')}/{quote(name, safe='')}"


def is_record_key(key: str) -> bool:
    """Whether a metadata_props key is a weight record of this format (the value may still be
    malformed); file records (:func:`is_file_key`) are not weight records."""
    return isinstance(key, str) and key.startswith(KEY_PREFIX) and not key.startswith(FILE_KEY_PREFIX)


# -- the data file's seal: identity and manifest ---------------------------------------------------
#
# A saved model's records are bound to its data file in two ways, both checkable without reading
# any weight:
#
# * the **manifest**, a table the saver appends to the data file: per weight record, the
#   blake2b-128 of its metadata key and of its value (:func:`manifest_bytes`).  A record edited,
#   added, or moved to another weight in the model file no longer matches an entry of the manifest
#   in the data file, so that record's blobs are not used (its weight is re-packed);
# * the **file record** (key ``onnxpack.prepacked/~files/<location>``): the data file's
#   ``stat_identity`` (device, inode, size, mtime, ctime) right after it was written, and where its
#   manifest is, with the blake2b-256 of the manifest's bytes.  While the file keeps that identity
#   nobody has written to it (an in-place write moves ctime, which users cannot set back; a copy or
#   a replacement is another inode), so its weights are the ones the records digested; otherwise
#   every source weight and blob is verified in full before use.  A manifest whose bytes do not
#   match the file record (another save's data file) makes every record of that file unusable.
#
# "~" cannot start an encoded scope path (the root's is empty, others start with "%2F"), so the
# file key never collides with a weight record's key.

FILE_KEY_PREFIX = KEY_PREFIX + "~files/"
FILE_VALUE_MAGIC = "onnxpack-datafile-v"
MANIFEST_MAGIC = b"onnxpack-mfst-v1"  # 16 bytes, then the entry count (u64 LE), zeros to 64
# Version 2 adds the record index after the entries: the header holds, after the count, the
# index's offset and length (u64 LE each, from the manifest's start).  Version 1 manifests (saved
# by an older onnxpack) are still read; their records are parsed from the model's JSON.
MANIFEST_MAGIC_V2 = b"onnxpack-mfst-v2"
MANIFEST_HEADER = 64
MANIFEST_ENTRY = 32  # blake2b-128 of the record's key, then of its value
# A manifest longer than this is not one we wrote: refused before reading.  (A million records,
# plus their index: each record a few hundred bytes at most.)
MAX_MANIFEST_BYTES = MANIFEST_HEADER + MANIFEST_ENTRY * (1 << 20) + (1 << 30)

# -- the record index (manifest version 2) --------------------------------------------------------
#
# A warm start of a large model reads a few hundred records; parsing each one's JSON and checking
# it field by field in Python was ~40% of a Qwen2.5-0.5B session's creation.  The manifest, which
# the seal already binds to the model, therefore also holds the records themselves as fixed-size
# rows: one weight row per manifest entry (same order), pointing at its pack rows, which point at
# their buffer rows; text (scope, name, digest, key, file) in one UTF-8 blob.  The rows are checked
# for bounds and sizes all at once with numpy when the manifest is read; a record is then built from
# its rows, not its JSON.  Only a record whose JSON is the one the manifest sealed (same key and
# value digests) is read from the index, and only from the manifest of a file whose seal holds: in
# every other case the JSON is parsed as before.
TABLE_MAGIC = b"onnxpack-rtab-v1"  # then 4 x u32 LE: weights, packs, buffers, text bytes; zeros to 64
TABLE_HEADER = 64
_REF = ("<u4", (2,))  # (offset, length) of a text in the blob
_W_ROW = np.dtype([("scope", *_REF), ("name", *_REF), ("digest", *_REF), ("pack0", "<u4"), ("npacks", "<u4"),
                   ("soff", "<i8"), ("slen", "<i8")])
_P_ROW = np.dtype([("key", *_REF), ("buf0", "<u4"), ("nbuf", "<u4")])
_B_ROW = np.dtype([("loc", *_REF), ("crc", "<u4"), ("dtype", "u1"), ("ndim", "u1"), ("pad", "u1", (2,)),
                   ("offset", "<i8"), ("length", "<i8"), ("shape", "<i8", (MAX_DIMS,))])
# Buffer dtypes by code (the row's ``dtype`` byte): the allowed dtypes, in a fixed order.
_DTYPE_CODES = tuple(sorted(ALLOWED_DTYPES))
_NP_DTYPES: dict[str, np.dtype] = {}  # BufferRecord.view's dtypes, by their string


def dtype_of_code(code: int) -> np.dtype:
    """The numpy dtype of a record-index buffer row's dtype code (checked with the index)."""
    name = _DTYPE_CODES[code]
    dtype = _NP_DTYPES.get(name)
    if dtype is None:
        dtype = _NP_DTYPES[name] = np.dtype(name)
    return dtype
_MAX_VIEW_BYTES = 2**62  # the graph layer's largest array (shape_fits)
_HEX64_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """The seal of one data file: its identity when written and where its manifest is."""

    location: str
    identity: tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns
    manifest_offset: int
    manifest_length: int
    manifest_digest: str  # 64 hex digits: blake2b-256 of the manifest's bytes

    def __post_init__(self) -> None:
        _check_location("data file", self.location)
        if type(self.identity) is not tuple or len(self.identity) != 5:
            raise _fail("data file identity", "5 integers", self.identity)
        for what, v in zip(("device", "inode", "size", "mtime_ns", "ctime_ns"), self.identity):
            _check_int(f"data file {what}", v, 0, 2**64 - 1)
        _check_int("manifest offset", self.manifest_offset)
        _check_int("manifest length", self.manifest_length, MANIFEST_HEADER, MAX_MANIFEST_BYTES)
        if type(self.manifest_digest) is not str or not _HEX64_RE.fullmatch(self.manifest_digest):
            raise _fail("manifest digest", "64 lowercase hex digits", self.manifest_digest)


def file_key(location: str) -> str:
    _check_location("data file", location)
    return f"{FILE_KEY_PREFIX}{quote(location, safe='')}"


def is_file_key(key: str) -> bool:
    return isinstance(key, str) and key.startswith(FILE_KEY_PREFIX)


def format_file_record(record: FileRecord) -> tuple[str, str]:
    body = {"file": record.location, "identity": list(record.identity), "manifest_offset": record.manifest_offset,
            "manifest_length": record.manifest_length, "manifest": record.manifest_digest}
    return file_key(record.location), f"{FILE_VALUE_MAGIC}1;" + json.dumps(body, separators=(",", ":"))


def parse_file_record(key: str, value: str) -> FileRecord:
    """Parse a file record; :class:`PrepackFormatError` on anything malformed."""
    if type(key) is not str or not key.startswith(FILE_KEY_PREFIX) or len(key) > MAX_KEY_LENGTH:
        raise _fail("data file record key", f"at most {MAX_KEY_LENGTH} characters starting with {FILE_KEY_PREFIX!r}", key)
    if type(value) is not str or len(value) > 4096 or not value.startswith(f"{FILE_VALUE_MAGIC}1;"):
        raise _fail(f"data file record {key!r}", f"a value starting with '{FILE_VALUE_MAGIC}1;'", str(value)[:40])
    try:
        obj = json.loads(value.split(";", 1)[1], object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except PrepackFormatError:
        raise
    except (ValueError, RecursionError) as e:
        raise _fail(f"data file record {key!r}", "valid JSON", f"{type(e).__name__}: {e}") from None
    obj = _object("data file record", obj, ("file", "identity", "manifest_offset", "manifest_length", "manifest"))
    identity = _array("data file identity", obj["identity"], 5)
    record = FileRecord(obj["file"], tuple(identity), obj["manifest_offset"], obj["manifest_length"], obj["manifest"])
    if key != file_key(record.location):
        raise _fail("data file record key", repr(file_key(record.location)), key)
    return record


def _entry(key: str, value: str) -> tuple[bytes, bytes]:
    """(key digest, value digest) of a record as the manifest lists it."""
    blake2b = hashlib.blake2b
    return (blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest(),
            blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).digest())


def manifest_bytes(props: Any) -> bytes:
    """The manifest sealing the weight records among ``props`` ((key, value) pairs), with their
    index (version 2; see above).  A record that does not parse gets an empty index row set
    (``npacks = 0``: never read from the index) — the saver writes only records that parse."""
    rows = sorted((*_entry(k, v), k, v) for k, v in props if is_record_key(k))
    entries = b"".join(kd + vd for kd, vd, _, _ in rows)
    table = _table_bytes([(k, v) for _, _, k, v in rows])
    offset = MANIFEST_HEADER + len(entries)
    header = (MANIFEST_MAGIC_V2 + len(rows).to_bytes(8, "little") + offset.to_bytes(8, "little")
              + len(table).to_bytes(8, "little"))
    return header + bytes(MANIFEST_HEADER - len(header)) + entries + table


def _table_bytes(records: list[tuple[str, str]]) -> bytes:
    """The record index of ``records`` (key, value), one weight row each, in their order."""
    text = bytearray()
    refs: dict[str, tuple[int, int]] = {}

    def ref(s: str) -> tuple[int, int]:
        got = refs.get(s)
        if got is None:
            raw = s.encode("utf-8")
            got = refs[s] = (len(text), len(raw))
            text.extend(raw)
        return got

    weights = np.zeros(len(records), _W_ROW)
    packs: list[tuple] = []
    buffers: list[tuple] = []
    listed = collections.Counter(k for k, _ in records)
    for i, (key, value) in enumerate(records):
        try:
            rec = parse_record(key, value)
        except PrepackFormatError:
            continue  # npacks = 0: this record is never read from the index
        if listed[key] > 1 or any(not all(b.shape) for p in rec.packs for b in p.buffers):
            continue  # a key listed twice, an empty buffer: the JSON path decides
        weights[i] = (ref(rec.scope), ref(rec.name), ref(rec.source_digest), len(packs), len(rec.packs),
                      -1 if rec.source_offset is None else rec.source_offset, rec.source_length)
        for p in rec.packs:
            packs.append((ref(p.key), len(buffers), len(p.buffers)))
            for b in p.buffers:
                shape = list(b.shape) + [0] * (MAX_DIMS - len(b.shape))
                buffers.append((ref(b.location), int(b.checksum, 16), _DTYPE_CODES.index(b.dtype), len(b.shape),
                                (0, 0), b.offset, b.length, shape))
    parts = [weights.tobytes(), np.array(packs, _P_ROW).tobytes(), np.array(buffers, _B_ROW).tobytes(), bytes(text)]
    header = TABLE_MAGIC + b"".join(n.to_bytes(4, "little") for n in (len(records), len(packs), len(buffers), len(text)))
    return header + bytes(TABLE_HEADER - len(header)) + b"".join(parts)


def parse_manifest(data: bytes) -> dict[bytes, bytes]:
    """key digest -> value digest of a manifest; :class:`PrepackFormatError` if malformed."""
    return _parse_manifest(data)[0]


def _parse_manifest(data: bytes) -> tuple[dict[bytes, bytes], tuple[int, int] | None]:
    """(key digest -> value digest, the record index's (offset, length) or None for version 1)."""
    magic = bytes(data[:16])
    if len(data) < MANIFEST_HEADER or magic not in (MANIFEST_MAGIC, MANIFEST_MAGIC_V2):
        raise _fail("manifest", f"{MANIFEST_MAGIC_V2!r} and a {MANIFEST_HEADER}-byte header", magic)
    count = int.from_bytes(data[16:24], "little")
    end = MANIFEST_HEADER + MANIFEST_ENTRY * count
    table = None
    if magic == MANIFEST_MAGIC_V2:
        offset, length = int.from_bytes(data[24:32], "little"), int.from_bytes(data[32:40], "little")
        if offset != end or offset + length != len(data):
            raise _fail("manifest layout", f"entries [{MANIFEST_HEADER}, {end}) then the index to the end "
                        f"({len(data)} bytes)", f"index at {offset}, {length} bytes")
        table = (offset, length)
    elif len(data) != end:
        raise _fail("manifest length", f"{MANIFEST_HEADER} + {MANIFEST_ENTRY} x {count}", len(data))
    out: dict[bytes, bytes] = {}
    for k in range(count):
        at = MANIFEST_HEADER + MANIFEST_ENTRY * k
        out[bytes(data[at:at + 16])] = bytes(data[at + 16:at + 32])
    return out, table


class RecordIndex:
    """The record index of a version-2 manifest (see above), checked for bounds and sizes.

    ``row(kd)`` is the index of the weight row of the record whose key digest is ``kd``;
    ``record(i)`` builds that record (the same :class:`WeightRecord` its JSON parses to);
    ``manifest`` is the manifest's entries (what :func:`parse_manifest` returns).
    """

    def __init__(self, data: bytes) -> None:
        entries, where = _parse_manifest(data)
        self.manifest = entries  # key digest -> value digest, as parse_manifest gives them
        if where is None:
            raise _fail("manifest", "version 2 (with a record index)", "version 1")
        offset, length = where
        table = memoryview(data)[offset:offset + length]
        if length < TABLE_HEADER or bytes(table[:16]) != TABLE_MAGIC:
            raise _fail("record index", f"{TABLE_MAGIC!r} and a {TABLE_HEADER}-byte header", bytes(table[:16]))
        count = int.from_bytes(data[16:24], "little")
        n_w, n_p, n_b, n_t = (int.from_bytes(table[16 + 4 * i:20 + 4 * i], "little") for i in range(4))
        sizes = (n_w * _W_ROW.itemsize, n_p * _P_ROW.itemsize, n_b * _B_ROW.itemsize, n_t)
        if n_w != count or TABLE_HEADER + sum(sizes) != length:
            raise _fail("record index size", f"{count} weight rows in {length - TABLE_HEADER} bytes",
                        f"{n_w} weights, {n_p} packs, {n_b} buffers, {n_t} text bytes")
        at = TABLE_HEADER
        arrays = []
        for dt, n, size in zip((_W_ROW, _P_ROW, _B_ROW), (n_w, n_p, n_b), sizes):
            arrays.append(np.frombuffer(table, dt, n, at))
            at += size
        self._w, self._p, self._b = arrays
        self._text = bytes(table[at:at + n_t])
        # ASCII text (what our saver writes for ASCII names) decoded once: its byte offsets are its
        # character offsets, so a reference is a slice of the string.
        self._ascii = self._text.decode("ascii") if self._text.isascii() else None
        self._check(n_t)
        # Plain Python rows from here on (numpy's per-field scalar access costs ~1 us a field):
        # tuples of each table's fields in order, a text reference or a shape as a list.
        self._wl, self._pl, self._bl = (list(zip(*(t[f].tolist() for f in t.dtype.names))) if len(t) else []
                                        for t in (self._w, self._p, self._b))
        self._texts = self._check_texts()
        # Row i is entry i; a key digest listed twice (two records under one key) has no row.
        if len(entries) == count:  # every key digest once: the manifest's keys in order are the rows
            self._rows = dict(zip(entries, range(count)))
        else:
            kds = [bytes(data[MANIFEST_HEADER + MANIFEST_ENTRY * i:MANIFEST_HEADER + MANIFEST_ENTRY * i + 16])
                   for i in range(count)]
            listed = collections.Counter(kds)
            self._rows = {kd: i for i, kd in enumerate(kds) if listed[kd] == 1}

    def _check(self, n_t: int) -> None:
        """Bounds and sizes of every row at once: text references inside the blob, pack and
        buffer ranges inside their tables, the JSON format's numeric rules for each buffer."""
        w, p, b = self._w, self._p, self._b

        def refs_ok(r: np.ndarray) -> bool:
            return bool(np.all(r[..., 0].astype(np.int64) + r[..., 1] <= n_t))

        def range_ok(first: np.ndarray, count: np.ndarray, limit: int, most: int) -> bool:
            used = count > 0
            return bool(np.all(count <= most) and np.all(first[used].astype(np.int64) + count[used] <= limit))

        soff, slen = w["soff"], w["slen"]
        ok = (refs_ok(w["scope"]) and refs_ok(w["name"]) and refs_ok(w["digest"]) and refs_ok(p["key"])
              and refs_ok(b["loc"]) and range_ok(w["pack0"], w["npacks"], len(p), MAX_PACKS)
              and range_ok(p["buf0"], p["nbuf"], len(b), MAX_BUFFERS_PER_PACK) and bool(np.all(p["nbuf"] > 0))
              and bool(np.all((slen >= 0) & (slen <= MAX_OFFSET) & (soff >= -1) & (soff <= MAX_OFFSET - slen))))
        if not ok:
            raise _fail("record index", "rows inside their tables and text", "a row out of bounds")
        off, length, ndim, shape = b["offset"], b["length"], b["ndim"].astype(np.int64), b["shape"]
        dims = np.arange(MAX_DIMS)[None, :] < ndim[:, None]
        item = np.array([_ITEMSIZE[d] for d in _DTYPE_CODES], np.int64)[np.minimum(b["dtype"], len(_DTYPE_CODES) - 1)]
        # prod(shape) * itemsize == length, computed where it cannot overflow: every used dim in
        # [1, 2**31) and at most 8 of them would; instead bound the running product step by step.
        prod = item.copy()
        fits = np.ones(len(b), bool)
        for d in range(MAX_DIMS):
            dim = np.where(dims[:, d], shape[:, d], 1)
            fits &= (dim >= 1) & (dim <= MAX_OFFSET)
            dim = np.where(fits, dim, 1)
            fits &= prod <= MAX_OFFSET // dim
            prod = np.where(fits, prod * dim, 0)
        ok = (bool(np.all(b["dtype"] < len(_DTYPE_CODES))) and bool(np.all(ndim <= MAX_DIMS))
              and bool(np.all(fits)) and bool(np.all(prod == length)) and bool(np.all(length <= _MAX_VIEW_BYTES))
              and bool(np.all((off >= 0) & (off % BUFFER_ALIGNMENT == 0) & (length >= 0) & (off <= MAX_OFFSET - length))))
        if not ok:
            raise _fail("record index", "buffers of allowed dtypes, aligned, length = prod(shape) x itemsize "
                        "with every dim positive", "a buffer that breaks these rules")

    def _check_texts(self) -> list[bool]:
        """Per weight row, whether its texts follow the JSON format's rules (names, digest, pack
        keys distinct and well formed, files inside the model folder): the numbers were checked
        by :meth:`_check`, so a row that passes builds its record without checking it again.  A
        row that fails is left to the record's JSON (which reports it)."""
        out: list = []
        locations: dict[str, bool] = {}
        text, pl, bl = self._ascii, self._pl, self._bl
        for w in self._wl:
            if text is None or w[4] != 1:
                try:
                    out.append(self._texts_of(w, locations))
                except UnicodeDecodeError:  # not UTF-8: not text we wrote
                    out.append(None)
                continue
            # The common row (ASCII text, one pack), as _texts_of checks it, inline: a warm load of
            # an LLM checks ~250 of them.
            (a, n), (b, m), (c, k) = w[0], w[1], w[2]
            scope, name, digest = text[a:a + n], text[b:b + m], text[c:c + k]
            p = pl[w[3]]
            key = text[p[0][0]:p[0][0] + p[0][1]]
            if not (len(scope) <= MAX_NAME_BYTES and "\x00" not in scope and name and len(name) <= MAX_NAME_BYTES
                    and "\x00" not in name and not k % 2 and _DIGEST_RE.fullmatch(digest) is not None
                    and _pack_key_match(key) is not None):
                out.append(self._texts_of(w, locations))  # the careful path decides (and names nothing)
                continue
            files = []
            for row in bl[p[1]:p[1] + p[2]]:
                loc = text[row[0][0]:row[0][0] + row[0][1]]
                ok = locations.get(loc)
                if ok is None:
                    try:
                        _check_location("buffer location", loc)
                        ok = locations[loc] = True
                    except PrepackFormatError:
                        ok = locations[loc] = False
                if not ok:
                    break
                files.append(loc)
            else:
                out.append((scope, name, digest, [(key, files)]))
                continue
            out.append(None)
        return out

    def _texts_of(self, w: tuple, locations: dict[str, bool]) -> tuple | None:
        """Weight row ``w``'s texts — (scope, name, digest, per pack (key, its buffers' files)) —
        when they follow the rules, else None (``locations``: files seen, and whether each passed)."""
        scope, name, digest = self._str(w[0]), self._str(w[1]), self._str(w[2])
        if not ((_plain_name(scope, True) or _valid_name(scope, True)) and (_plain_name(name, False) or _valid_name(name, False))
                and _is_digest(digest) and 0 < w[4]):
            return None
        keys = set()
        packs = []
        for p in self._pl[w[3]:w[3] + w[4]]:
            key = self._str(p[0])
            if key in keys or _pack_key_match(key) is None:
                return None
            keys.add(key)
            files = []
            for b in self._bl[p[1]:p[1] + p[2]]:
                loc = self._str(b[0])
                if loc not in locations:
                    try:
                        _check_location("buffer location", loc)
                        locations[loc] = True
                    except PrepackFormatError:
                        locations[loc] = False
                if not locations[loc]:
                    return None
                files.append(loc)
            packs.append((key, files))
        return scope, name, digest, packs

    def row(self, kd: bytes) -> int | None:
        """The weight row of the record with key digest ``kd`` (None: no such entry, its record
        did not parse when saved, or its texts break the format's rules)."""
        i = self._rows.get(kd)
        return None if i is None or self._texts[i] is None else i

    def _str(self, ref: list[int]) -> str:
        if self._ascii is not None:
            return self._ascii[ref[0]:ref[0] + ref[1]]
        return self._text[ref[0]:ref[0] + ref[1]].decode("utf-8", "surrogatepass")

    def row_texts(self, i: int) -> tuple[str, str, str, list[tuple[str, list[str]]]]:
        """Weight row ``i``'s texts (one :meth:`row` returned): scope, name, source digest, and
        per pack its key and its buffers' files."""
        return self._texts[i]

    def row_source(self, i: int) -> tuple[int | None, int, tuple]:
        """Weight row ``i``'s source offset (None: not recorded), source length, and the buffer
        row of its first pack's first buffer (location ref, crc32, dtype code, ndim, -, offset,
        length, shape; see :func:`_buffer_row`)."""
        w = self._wl[i]
        return (None if w[5] < 0 else w[5]), w[6], self._bl[self._pl[w[3]][1]]

    def names(self, i: int) -> tuple[str, str]:
        """(scope, name) of weight row ``i`` (one :meth:`row` returned)."""
        return self._texts[i][0], self._texts[i][1]

    def spans(self) -> list[tuple[str, int, int, str]]:
        """(file, offset, end, pack key) of every buffer of the rows :meth:`row` returns (for the
        overlap check)."""
        out = []
        for w, texts in zip(self._wl, self._texts):
            if texts is None:
                continue
            for p, (key, files) in zip(self._pl[w[3]:w[3] + w[4]], texts[3]):
                for b, loc in zip(self._bl[p[1]:p[1] + p[2]], files):
                    out.append((loc, b[5], b[5] + b[6], key))
        return out

    def record(self, i: int) -> WeightRecord:
        """The record of weight row ``i`` (one :meth:`row` returned): every rule its constructors
        check was checked for the whole index, so it is built without checking again."""
        w = self._wl[i]
        scope, name, digest, texts = self._texts[i]
        pl, bl = self._pl, self._bl
        packs = tuple(
            _unchecked(PackRecord, key=key, buffers=tuple(_buffer_row(loc, bl[pl[w[3] + k][1] + j]) for j, loc in enumerate(files)))
            for k, (key, files) in enumerate(texts)
        ) if len(texts) != 1 or len(texts[0][1]) != 1 else (  # most weights: one pack of one buffer
            _unchecked(PackRecord, key=texts[0][0], buffers=(_buffer_row(texts[0][1][0], bl[pl[w[3]][1]]),)),)
        return _unchecked(WeightRecord, scope=scope, name=name, source_length=w[6],
                          source_offset=None if w[5] < 0 else w[5], source_digest=digest, packs=packs)


def _buffer_row(location: str, b: tuple) -> BufferRecord:
    """The BufferRecord of record-index buffer row ``b`` (checked with the whole index)."""
    buf = object.__new__(BufferRecord)
    buf.__dict__.update(location=location, offset=b[5], length=b[6], dtype=_DTYPE_CODES[b[2]],
                        shape=tuple(b[7][:b[3]]), checksum=f"{b[1]:08x}")
    return buf


def _unchecked(cls: type, **fields: Any) -> Any:
    """An instance of the frozen dataclass ``cls`` with ``fields``, its checks skipped (for
    records whose every field the index checked in bulk)."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _valid_name(value: str, allow_empty: bool) -> bool:
    try:
        _check_name("name", value, allow_empty=allow_empty)
    except PrepackFormatError:
        return False
    return True


def _to_json(record: WeightRecord) -> dict[str, Any]:
    return {
        "scope": record.scope,
        "name": record.name,
        "source": {
            "offset": record.source_offset,
            "length": record.source_length,
            "digest": record.source_digest,
        },
        "packs": [
            {
                "key": p.key,
                "buffers": [
                    {
                        "file": b.location,
                        "offset": b.offset,
                        "length": b.length,
                        "dtype": b.dtype,
                        "shape": list(b.shape),
                        "crc32": b.checksum,
                    }
                    for b in p.buffers
                ],
            }
            for p in record.packs
        ],
    }


def format_record(record: WeightRecord) -> tuple[str, str]:
    """The (key, value) metadata_props entry of ``record``.

    Raises :class:`PrepackFormatError` if the record would be longer than the parser accepts.
    """
    if not isinstance(record, WeightRecord):
        raise _fail("record", "a WeightRecord", record)
    key = record_key(record.scope, record.name)
    value = _VALUE_PREFIX + json.dumps(_to_json(record), separators=(",", ":"), ensure_ascii=False)
    if len(value) > MAX_VALUE_LENGTH:
        raise _fail(f"record of weight {record.name!r}", f"at most {MAX_VALUE_LENGTH} characters", len(value))
    return key, value


def _object(what: str, value: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    if type(value) is not dict:
        raise _fail(what, "a JSON object", value)
    if value.keys() != _FIELD_SETS.setdefault(fields, frozenset(fields)):
        keys = set(value)
        missing = sorted(set(fields) - keys)
        extra = sorted(keys - set(fields))
        raise _fail(what, f"fields {list(fields)}", f"missing {missing}, unknown {extra}")
    return value


_FIELD_SETS: dict[tuple[str, ...], frozenset[str]] = {}


def _array(what: str, value: Any, limit: int) -> list[Any]:
    if type(value) is not list:
        raise _fail(what, "a JSON array", value)
    if len(value) > limit:
        raise _fail(what, f"at most {limit} items", len(value))
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _fail("JSON object", "no duplicate field", k)
            seen.add(k)
    return out


def _no_constants(name: str) -> Any:
    raise _fail("JSON number", "a finite number", name)


# One decoder for every record (json.loads with options builds a new one per call).
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def _parse_buffer(value: Any) -> BufferRecord:
    obj = _object("buffer", value, ("file", "offset", "length", "dtype", "shape", "crc32"))
    shape = _array("buffer shape", obj["shape"], MAX_DIMS)
    return BufferRecord(
        location=obj["file"],
        offset=obj["offset"],
        length=obj["length"],
        dtype=obj["dtype"],
        shape=tuple(shape),
        checksum=obj["crc32"],
    )


def _parse_pack(value: Any) -> PackRecord:
    obj = _object("pack", value, ("key", "buffers"))
    buffers = _array("pack buffers", obj["buffers"], MAX_BUFFERS_PER_PACK)
    return PackRecord(key=obj["key"], buffers=tuple(_parse_buffer(b) for b in buffers))


def parse_record(key: str, value: str) -> WeightRecord:
    """Parse one metadata_props entry written by :func:`format_record`.

    Raises :class:`PrepackFormatError` naming the key and what was expected on anything
    malformed: a key or value too long, a foreign magic, an unknown version, bad JSON, missing or
    unknown fields, wrong types, out-of-range numbers, a length that disagrees with dtype and
    shape, a disallowed dtype, or a key that does not match the scope and name inside the value.
    """
    try:
        return _parse_record(key, value)
    except PrepackFormatError as e:
        shown = key if isinstance(key, str) and len(key) <= 300 else repr(key)[:300]
        raise PrepackFormatError(f"pre-packed record {shown}: {e}") from None


def _parse_record(key: str, value: str) -> WeightRecord:
    if type(key) is not str or not key.startswith(KEY_PREFIX):
        raise _fail("metadata key", f"a string starting with {KEY_PREFIX!r}", key)
    if len(key) > MAX_KEY_LENGTH:
        raise _fail("metadata key", f"at most {MAX_KEY_LENGTH} characters", len(key))
    if type(value) is not str:
        raise _fail("value", "a string", value)
    if len(value) > MAX_VALUE_LENGTH:
        raise _fail("value", f"at most {MAX_VALUE_LENGTH} characters", len(value))
    if not value.startswith(VALUE_MAGIC):
        raise _fail("value", f"to start with {VALUE_MAGIC!r} (not an onnxpack record)", value[:40])
    version, sep, body = value[len(VALUE_MAGIC) :].partition(";")
    if not sep or not version.isdigit() or len(version) > 9 or version != str(int(version)):
        raise _fail("format version", f"'{VALUE_MAGIC}<n>;'", value[:40])
    if int(version) != FORMAT_VERSION:
        raise _fail("format version", f"{FORMAT_VERSION} (this onnxpack reads only that)", int(version))
    try:
        obj = _DECODER.decode(body)
    except PrepackFormatError:
        raise
    except (ValueError, RecursionError) as e:
        raise _fail("value JSON", "valid JSON", f"{type(e).__name__}: {e}") from None
    obj = _object("record", obj, ("scope", "name", "source", "packs"))
    source = _object("source", obj["source"], ("offset", "length", "digest"))
    packs = _array("packs", obj["packs"], MAX_PACKS)
    record = WeightRecord(
        scope=obj["scope"],
        name=obj["name"],
        source_length=source["length"],
        source_offset=source["offset"],
        source_digest=source["digest"],
        packs=tuple(_parse_pack(p) for p in packs),
    )
    expected_key = _key_of(record.scope, record.name)  # the names were checked by WeightRecord
    if key != expected_key:
        raise _fail("metadata key", f"{expected_key!r} (from the scope and name in the value)", key)
    return record


def check_bounds(record: WeightRecord, file_sizes: int | Mapping[str, int]) -> None:
    """Check that every buffer of ``record`` lies inside its data file.

    ``file_sizes`` is one size for every location, or a mapping location → size (a location
    missing from the mapping is an error).  Raises :class:`PrepackFormatError` naming the weight,
    pack, buffer and bounds.
    """
    for p in record.packs:
        for i, b in enumerate(p.buffers):
            if isinstance(file_sizes, Mapping):
                if b.location not in file_sizes:
                    raise _fail(
                        f"weight {record.name!r} pack {p.key!r} buffer {i} file",
                        f"one of {sorted(file_sizes)}",
                        b.location,
                    )
                size = file_sizes[b.location]
            else:
                size = file_sizes
            if b.offset + b.length > size:
                raise _fail(
                    f"weight {record.name!r} pack {p.key!r} buffer {i} in {b.location!r}",
                    f"offset + length <= file size {size}",
                    f"{b.offset} + {b.length} = {b.offset + b.length}",
                )

