"""The persistent packed-weight cache file: pack once per machine for models used as they are.

Layout (all integers little-endian; byte by byte in ``docs/formats.md``)::

    [0, 64)      commit slot 0  ┐ the header: two fixed-size commit records ("footers": magic,
    [64, 128)    commit slot 1  ┘ version, sequence, index offset/length, entry count, index CRC)
    [128, ...)   packed regions, each 64-byte aligned, regions >= 64 KiB page aligned
    ...          index: magic, entry count, then per entry its key and per buffer offset, length,
                 dtype, shape and CRC-32
    ...          (later appends: more regions, a new full index, ...)

Why two slots at the front instead of one footer at the end: an append must write its regions
before the index and commit record that refer to them, so a crash (kill -9, power loss) mid-append
leaves junk after the last good footer, and finding that footer again means scanning back over up
to gigabytes of junk in which a packed weight may even contain footer-like bytes.  With two slots
the file is appended to and never truncated, the previous commit stays untouched in the *other*
slot while a new one is written, and each slot carries its own CRC: a reader takes the valid slot
with the highest sequence number whose index checks out, so a torn slot, a torn index or junk
appended anywhere falls back to the previous commit in O(1) (TFLite / ExecuTorch / file-system
superblock style).

Writers (:func:`append_entries`, :func:`compact`) hold an exclusive ``fcntl.flock`` on a sidecar
lock file ``PATH + ".lock"`` (never on the data file, and never deleted, so it cannot race with
its own re-creation), re-read the current commit under the lock, and append only keys not yet
present.  Appends happen in place after the current end of file: readers in other processes keep
valid mappings (no truncation, no SIGBUS); a commit is: regions + index, ``fsync``, then the new
slot, ``fsync``.  A brand-new file, a rebuild and a compaction are written to a temp file in the
same folder, fsynced and renamed over ``PATH`` (old mappings keep the old inode alive).

Rebuild policy: a file that is ours but damaged (our magic in a slot, but no slot whose index
checks out) is replaced by a fresh file at the next append — it holds nothing usable, and rename
never disturbs existing mappings.  A foreign file (no magic) or a newer-version file is never
written to: it may be the user's data or a newer onnxpack's cache, so it is only reported.
Readers never repair anything; they raise :class:`CacheFileError` and the caller warns and packs
in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import mmap
import os
import stat
import struct
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from onnxpack.graph import MAX_FILE_POSITION, mapped_view, open_regular_file, shape_fits, stat_identity
from onnxpack._io import atomic_write
from onnxpack.errors import CacheFileError, InvalidArgument
from onnxpack.prepack.entry_format import ALLOWED_DTYPES, MAX_BUFFERS_PER_PACK, MAX_DIMS, crc32

try:  # POSIX only; on other systems writers raise CacheFileError (readers still work).
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

__all__ = [
    "CacheFile",
    "CacheBuffer",
    "CacheEntry",
    "CacheInfo",
    "AppendResult",
    "CompactResult",
    "load_or_empty",
    "append_entries",
    "compact",
    "info",
]

# -- constants, each with its reason ------------------------------------------------------------

# Identifies our commit slots; a file with this magic in neither slot is foreign and never touched.
MAGIC = b"OPKCACHE"
# Bump when the layout changes; a reader refuses (and a writer never touches) a newer file.
FORMAT_VERSION = 1
# Starts every index, so a slot pointing at non-index bytes fails before the entries are parsed.
INDEX_MAGIC = b"OPKINDEX"

# slot: magic, version, flags, sequence, index offset, index length, entry count, index crc32,
# two reserved words, then the crc32 of the 60 bytes before it.  64 bytes = one cache line.
_SLOT = struct.Struct("<8sIIQQQQIII")
_SLOT_CRC = struct.Struct("<I")
SLOT_SIZE = _SLOT.size + _SLOT_CRC.size
NUM_SLOTS = 2
HEADER_SIZE = NUM_SLOTS * SLOT_SIZE

# index header: magic, format version, reserved, entry count
_INDEX_HEADER = struct.Struct("<8sIIQ")
# entry: key length (UTF-8 bytes), buffer count, reserved byte; then the key bytes
_ENTRY = struct.Struct("<HBx")
# buffer: offset, length, dtype (ASCII numpy str, NUL padded), ndim, 3 reserved, crc32; then
# ndim uint64 dimensions
_BUFFER = struct.Struct("<QQ4sB3xI")
_DIM = struct.Struct("<Q")

# Every region starts 64-byte aligned (cache line; SIMD loads); this is also checked on read, so
# an entry at an odd offset is rejected as not ours.
REGION_ALIGNMENT = 64
# Regions at least this large start on a page (allocation granularity) boundary, so they share no
# page with a neighbour (touching one never pages in another) and can be mapped on their own;
# below it the padding (up to a page) would waste more than it saves.
PAGE_ALIGN_THRESHOLD = 64 * 1024
PAGE_SIZE = mmap.ALLOCATIONGRANULARITY

# Bounds on what a (possibly hostile) file can make us read and allocate before any check: the
# index is read whole, so it is capped; entries and keys are capped so parsing stays bounded.
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 1 << 18
MAX_KEY_BYTES = 1024
MAX_BUFFERS = MAX_BUFFERS_PER_PACK
MAX_OFFSET = MAX_FILE_POSITION  # the graph layer's bound on file positions
MAX_SEQUENCE = 2**64 - 1

# The writers' lock is a sidecar file, so locking never touches the data file's bytes or mtime.
LOCK_SUFFIX = ".lock"


# -- records ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheBuffer:
    """Where one buffer of an entry lives in the cache file and what it is."""

    offset: int
    length: int
    dtype: str  # numpy dtype string from entry_format.ALLOWED_DTYPES, e.g. "<f4"
    shape: tuple[int, ...]
    crc32: int


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    key: str
    buffers: tuple[CacheBuffer, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.length for b in self.buffers)


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """What ``onnxpack cache info`` prints.

    ``wasted_bytes`` is everything that is neither the header, a live region nor the live index:
    alignment padding, old indexes, regions orphaned by a crash, junk after a torn append.
    """

    path: str
    file_size: int
    version: int
    sequence: int
    entries: tuple[CacheEntry, ...]
    live_bytes: int
    index_bytes: int
    wasted_bytes: int


@dataclasses.dataclass(frozen=True)
class AppendResult:
    added: tuple[str, ...]  # keys written by this call
    skipped: tuple[str, ...]  # keys already present (not written again)
    bytes_written: int  # 0 when nothing new: the file was not opened for writing at all
    rebuilt: bool  # a damaged file of ours was replaced by a fresh one (its entries were lost)


@dataclasses.dataclass(frozen=True)
class CompactResult:
    entries: int  # entries kept
    dropped: tuple[str, ...]  # entries whose bytes failed their CRC-32 (not copied)
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass(frozen=True)
class _State:
    slot: int
    sequence: int
    max_sequence: int  # highest sequence of any slot with a valid CRC (the next commit beats it)
    index_offset: int
    index_length: int
    entries: dict[str, CacheEntry]


class _DamagedCache(CacheFileError):
    """Ours (our magic in a slot) but no usable commit: a writer may replace it."""


# -- reading ------------------------------------------------------------------------------------


def _fail(cls: type[CacheFileError], path: str, what: str, expected: str, got: Any) -> CacheFileError:
    return cls(f"cache file {path!r}: {what}: expected {expected}, got {got}")


def _align(pos: int, length: int) -> int:
    a = PAGE_SIZE if length >= PAGE_ALIGN_THRESHOLD else REGION_ALIGNMENT
    return -(-pos // a) * a


def _pread_exact(fd: int, n: int, offset: int, path: str, what: str) -> bytes:
    chunks = []
    got = 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            break
        chunks.append(b)
        got += len(b)
    data = b"".join(chunks)
    if len(data) != n:
        raise _fail(_DamagedCache, path, f"EOF reading {what} at offset {offset}", f"{n} bytes", len(data))
    return data


def _parse_slot(raw: bytes) -> tuple[str, tuple[int, ...] | None]:
    """('ok'|'empty'|'torn'|'newer', fields). 'empty' = no magic; 'torn' = magic but bad CRC."""
    # Only the full magic makes a file ours: a few bytes that merely look like its start might
    # be the user's data, and a file we think is ours may be replaced by a writer.
    if not raw.startswith(MAGIC):
        return "empty", None
    # Magic and version (bytes 0-11) keep their place in every format version, so a newer
    # layout is recognised as newer (and left alone) even if the rest of its slot differs.
    if len(raw) >= 12:
        (version,) = struct.unpack_from("<I", raw, 8)
        if version > FORMAT_VERSION:
            return "newer", (version,)
    if len(raw) < SLOT_SIZE:
        return "torn", None  # ours, cut short
    (crc,) = _SLOT_CRC.unpack_from(raw, _SLOT.size)
    if crc32(raw[: _SLOT.size]) != crc:
        return "torn", None
    magic, version, flags, seq, ioff, ilen, count, icrc, r0, r1 = _SLOT.unpack_from(raw)
    if version != FORMAT_VERSION or flags or r0 or r1 or seq == 0:
        return "torn", None
    return "ok", (seq, ioff, ilen, count, icrc)


def _parse_index(data: bytes, count: int, limit: int, path: str) -> dict[str, CacheEntry]:
    """Entries of one index; ``limit`` is the index offset (every region lies before it)."""
    bad = _DamagedCache
    if len(data) < _INDEX_HEADER.size:
        raise _fail(bad, path, "index header", f"{_INDEX_HEADER.size} bytes", len(data))
    magic, version, reserved, n = _INDEX_HEADER.unpack_from(data)
    if magic != INDEX_MAGIC or version != FORMAT_VERSION or reserved:
        raise _fail(bad, path, "index header", f"{INDEX_MAGIC!r} version {FORMAT_VERSION}", (magic, version))
    if n != count:
        raise _fail(bad, path, "index entry count", f"{count} (from the commit slot)", n)
    pos = _INDEX_HEADER.size
    entries: dict[str, CacheEntry] = {}

    def take(st: struct.Struct, what: str) -> tuple[Any, ...]:
        nonlocal pos
        if pos + st.size > len(data):
            raise _fail(bad, path, f"EOF in index reading {what}", f"{st.size} bytes", len(data) - pos)
        out = st.unpack_from(data, pos)
        pos += st.size
        return out

    for i in range(n):
        klen, nbuf = take(_ENTRY, f"entry {i}")
        if not 0 < klen <= MAX_KEY_BYTES or pos + klen > len(data):
            raise _fail(bad, path, f"entry {i} key length", f"1..{MAX_KEY_BYTES} within the index", klen)
        try:
            key = data[pos : pos + klen].decode("utf-8")
        except UnicodeDecodeError as e:
            raise _fail(bad, path, f"entry {i} key", "UTF-8", e) from None
        pos += klen
        if key in entries:
            raise _fail(bad, path, f"entry {i} key", "a key not seen before in the index", repr(key))
        if not 0 < nbuf <= MAX_BUFFERS:
            raise _fail(bad, path, f"entry {key!r} buffer count", f"1..{MAX_BUFFERS}", nbuf)
        buffers = []
        for j in range(nbuf):
            what = f"entry {key!r} buffer {j}"
            off, length, dt, ndim, crc = take(_BUFFER, what)
            dtype = dt.rstrip(b"\x00").decode("ascii", "replace")
            if dtype not in ALLOWED_DTYPES:
                raise _fail(bad, path, f"{what} dtype", f"one of {sorted(ALLOWED_DTYPES)}", repr(dt))
            if ndim > MAX_DIMS:
                raise _fail(bad, path, f"{what} ndim", f"at most {MAX_DIMS}", ndim)
            shape = tuple(take(_DIM, f"{what} shape")[0] for _ in range(ndim))
            if not shape_fits(shape, np.dtype(dtype).itemsize):
                raise _fail(bad, path, f"{what} shape", "dims whose product fits an array", list(shape))
            expected = math.prod(shape) * np.dtype(dtype).itemsize
            if length != expected:
                raise _fail(bad, path, f"{what} length", f"prod{list(shape)} * itemsize = {expected}", length)
            if off % REGION_ALIGNMENT or off < HEADER_SIZE or off + length > limit:
                raise _fail(
                    bad, path, f"{what} bounds",
                    f"{REGION_ALIGNMENT}-aligned, within [{HEADER_SIZE}, index offset {limit})",
                    f"offset {off} length {length}",
                )
            buffers.append(CacheBuffer(off, length, dtype, shape, crc))
        entries[key] = CacheEntry(key, tuple(buffers))
    if pos != len(data):
        raise _fail(bad, path, "index length", f"{pos} bytes for {n} entries", len(data))
    return entries


def _read_state(fd: int, header: bytes, size: int, path: str) -> _State:
    """The newest commit whose slot and index check out; CacheFileError if there is none.

    ``header`` must be read *before* ``size`` is taken: the file only grows, so everything a
    slot in that snapshot refers to lies below ``size``.
    """
    slots = [_parse_slot(header[i * SLOT_SIZE : (i + 1) * SLOT_SIZE]) for i in range(NUM_SLOTS)]
    kinds = [k for k, _ in slots]
    if all(k == "empty" for k in kinds):
        raise _fail(
            CacheFileError, path, "magic", f"{MAGIC!r} in a commit slot (not an onnxpack cache file)", repr(header[:8])
        )
    for kind, fields in slots:
        if kind == "newer":
            raise _fail(
                CacheFileError, path, "format version", f"<= {FORMAT_VERSION} (written by a newer onnxpack)", fields[0]
            )
    valid = sorted(
        ((fields[0], i, fields) for i, (kind, fields) in enumerate(slots) if kind == "ok"),
        key=lambda t: (-t[0], t[1]),
    )
    if not valid:
        raise _fail(_DamagedCache, path, "commit slots", "a slot with a valid CRC-32", "none (torn or corrupt)")
    max_seq = valid[0][0]
    first_error: CacheFileError | None = None
    for seq, i, (_, ioff, ilen, count, icrc) in valid:
        try:
            if ilen > MAX_INDEX_BYTES or count > MAX_ENTRIES:
                raise _fail(
                    _DamagedCache, path, f"slot {i} index size",
                    f"<= {MAX_INDEX_BYTES} bytes and <= {MAX_ENTRIES} entries", (ilen, count),
                )
            if ioff % REGION_ALIGNMENT or ioff < HEADER_SIZE or ioff + ilen > size:
                raise _fail(
                    _DamagedCache, path, f"slot {i} index bounds",
                    f"64-aligned within [{HEADER_SIZE}, file size {size}]", f"offset {ioff} length {ilen}",
                )
            data = _pread_exact(fd, ilen, ioff, path, "index")
            if crc32(data) != icrc:
                raise _fail(_DamagedCache, path, f"slot {i} index CRC-32", f"{icrc:08x}", f"{crc32(data):08x}")
            entries = _parse_index(data, count, ioff, path)
        except _DamagedCache as e:
            logger.debug("%s", e)
            first_error = first_error or e
            continue
        return _State(i, seq, max_seq, ioff, ilen, entries)
    assert first_error is not None, "Bug: no valid slot and no error"
    raise first_error


# -- the reader ---------------------------------------------------------------------------------


class CacheFile:
    """A cache file mapped read-only once; :meth:`get` returns zero-copy views into the mapping.

    Open with :meth:`open` (or :func:`load_or_empty`).  A missing or empty file is an empty cache.
    Every entry's bounds were checked against the file at open; CRC-32s are checked by
    ``get(..., verify=True)``.  Close with :meth:`close` (views already handed out stay valid:
    the mapping is released when the last of them dies).
    """

    def __init__(self, path: str, mm: mmap.mmap | None, size: int, state: _State | None,
                 fd: int | None = None) -> None:
        self.path = path
        self._mm = mm
        self._size = size
        self._state = state
        self._fd = fd  # kept open while mapped: check() tells with one fstat if it was changed
        self._entries: dict[str, CacheEntry] = state.entries if state else {}
        # check(): the file's identity when its served entries last matched their CRCs, and the
        # keys get() handed out (the bytes sessions compute with).
        self._checked: tuple[int, ...] | None = None
        self._served: set[str] = set()
        self._lock = threading.Lock()
        if fd is not None:
            try:
                self._checked = stat_identity(os.fstat(fd))
            except OSError:
                pass

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> CacheFile:
        """Map ``path``; raises :class:`CacheFileError` if it is corrupt, foreign, newer, or not a
        regular file (a FIFO or a device is refused without blocking or reading)."""
        path = os.fspath(path)
        if not os.path.lexists(path):
            return cls(path, None, 0, None)
        try:
            fd, st = open_regular_file(path, "packed-weight cache file", MAX_FILE_POSITION, CacheFileError)
        except CacheFileError:
            if not os.path.lexists(path):
                return cls(path, None, 0, None)
            raise
        try:
            header = os.pread(fd, HEADER_SIZE, 0)
            size = st.st_size
            if size == 0:
                os.close(fd)
                return cls(path, None, 0, None)
            state = _read_state(fd, header, size, path)
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, mm, size, state, fd)

    def check(self) -> None:
        """Raises CacheFileError if the mapped file shrank below what is mapped (reading a
        truncated mapping kills the process with SIGBUS) or if an entry :meth:`get` handed out no
        longer holds its bytes (a ``cp`` over the file, a write in place: the mapping shows the new
        bytes).  Writers that follow the format only append, which changes the file's mtime too,
        so a changed identity is not an error by itself: it makes this call check the CRC-32 of
        every served entry once (read with ``pread``, so a concurrent truncation is a short read,
        not SIGBUS), and the identity is remembered when they all match."""
        with self._lock:  # close() takes it too: the fd is never closed (and reused) under a pread
            self._check_locked()

    def _check_locked(self) -> None:
        if self._fd is None or self._mm is None:
            return
        try:
            ident = stat_identity(os.fstat(self._fd))
        except OSError:
            return
        if ident[2] < self._size:
            raise CacheFileError(
                f"packed-weight cache {self.path!r} was truncated under the live session ({self._size} -> "
                f"{ident[2]} bytes): its packed weights are gone — create the session again"
            )
        if ident == self._checked:
            return
        for key in sorted(self._served):
            for j, b in enumerate(self._entries[key].buffers):
                if self._pread_crc(b.offset, b.length) != b.crc32:
                    raise CacheFileError(
                        f"packed-weight cache {self.path!r} was rewritten under the live session: entry "
                        f"{key!r} buffer {j} no longer holds its bytes — create the session again"
                    )
        self._checked = ident

    def _pread_crc(self, offset: int, length: int) -> int | None:
        crc, pos, end = 0, offset, offset + length
        while pos < end:
            try:
                chunk = os.pread(self._fd, min(end - pos, 1 << 24), pos)
            except (OSError, TypeError):
                return None
            if not chunk:
                return None
            crc = zlib.crc32(chunk, crc)
            pos += len(chunk)
        return crc & 0xFFFFFFFF

    def __enter__(self) -> CacheFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> set[str]:
        return set(self._entries)

    def entry(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def get(self, key: str, *, verify: bool = False) -> tuple[np.ndarray, ...] | None:
        """Read-only views of ``key``'s buffers, or ``None`` if absent.

        With ``verify`` every buffer's CRC-32 is checked (reading all its bytes) and a mismatch
        raises :class:`CacheFileError`.
        """
        e = self._entries.get(key)
        if e is None:
            return None
        if self._mm is None:
            raise CacheFileError(f"cache file {self.path!r}: closed")
        with self._lock:
            self._served.add(key)
        out = []
        for j, b in enumerate(e.buffers):
            arr = mapped_view(self._mm, b.dtype, tuple(b.shape), b.offset)
            if verify:
                got = crc32(arr)
                if got != b.crc32:
                    raise _fail(
                        CacheFileError, self.path, f"entry {key!r} buffer {j} CRC-32", f"{b.crc32:08x}", f"{got:08x}"
                    )
            out.append(arr)
        return tuple(out)

    def info(self) -> CacheInfo:
        entries = tuple(self._entries.values())
        live = sum(e.nbytes for e in entries)
        st = self._state
        index_bytes = st.index_length if st else 0
        header = HEADER_SIZE if st else 0
        return CacheInfo(
            path=self.path,
            file_size=self._size,
            version=FORMAT_VERSION if st else 0,
            sequence=st.sequence if st else 0,
            entries=entries,
            live_bytes=live,
            index_bytes=index_bytes,
            wasted_bytes=self._size - header - live - index_bytes,
        )

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # Views handed out by get() still use the mapping; it is unmapped when they die.
                pass


def load_or_empty(path: str | os.PathLike[str]) -> tuple[CacheFile, str | None]:
    """Open ``path``; on :class:`CacheFileError` or OSError an empty cache and the warning text."""
    try:
        return CacheFile.open(path), None
    except (CacheFileError, OSError) as e:
        return CacheFile(os.fspath(path), None, 0, None), f"ignoring packed-weight cache: {e}"


def info(path: str | os.PathLike[str]) -> CacheInfo:
    """Entries, sizes and wasted bytes of the cache file at ``path`` (CacheFileError if bad)."""
    with CacheFile.open(path) as cf:
        return cf.info()


# -- writing ------------------------------------------------------------------------------------


# The lock file is opened without following a symlink (O_CREAT through a symlink would create
# its target, wherever it points) and without blocking (a FIFO put there), and must be a regular
# file: anything else is refused, and nothing is written.
_LOCK_FLAGS = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0))


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        raise CacheFileError(f"cache file {path!r}: writing needs fcntl.flock (POSIX)")
    # The target first: a cache path naming a device, a FIFO or a folder is refused before a lock
    # file is created next to it (e.g. /dev/zero.lock).
    if os.path.lexists(path):
        fd, _ = open_regular_file(path, "packed-weight cache file", MAX_FILE_POSITION, CacheFileError)
        os.close(fd)
    try:
        fd = os.open(path + LOCK_SUFFIX, _LOCK_FLAGS, 0o644)
    except OSError as e:
        raise CacheFileError(f"cache file {path!r}: cannot open its lock file {path + LOCK_SUFFIX!r}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheFileError(f"cache file {path!r}: its lock file {path + LOCK_SUFFIX!r} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _prepare(entries: Mapping[str, Sequence[np.ndarray]]) -> dict[str, tuple[np.ndarray, ...]]:
    """Validate keys and buffers and make each buffer C-contiguous little-endian."""
    out: dict[str, tuple[np.ndarray, ...]] = {}
    for key, buffers in entries.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"cache entry key: expected str, got {type(key).__name__}")
        try:
            kb = key.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgument(f"cache entry key {key!r}: expected valid UTF-8 text") from e
        if not 0 < len(kb) <= MAX_KEY_BYTES:
            raise InvalidArgument(
                f"cache entry key {key[:80]!r}: expected 1..{MAX_KEY_BYTES} UTF-8 bytes, got {len(kb)}"
            )
        bufs = tuple(buffers)
        if not 0 < len(bufs) <= MAX_BUFFERS:
            raise InvalidArgument(f"cache entry {key!r}: expected 1..{MAX_BUFFERS} buffers, got {len(bufs)}")
        fixed = []
        for j, a in enumerate(bufs):
            a = np.asarray(a)
            dt = a.dtype
            if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
                dt = dt.newbyteorder("<")
            if dt.str not in ALLOWED_DTYPES or a.ndim > MAX_DIMS:
                raise InvalidArgument(
                    f"cache entry {key!r} buffer {j}: expected a numeric array of dtype in "
                    f"{sorted(ALLOWED_DTYPES)} with <= {MAX_DIMS} dims, got {a.dtype.str}{list(a.shape)}"
                )
            fixed.append(np.asarray(a, dtype=dt, order="C"))  # (ascontiguousarray makes 0-d 1-d)
        out[key] = tuple(fixed)
    return out


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _bytes_of(a: np.ndarray) -> Any:
    return a.reshape(-1).view(np.uint8)


def _encode_index(entries: Sequence[CacheEntry]) -> bytes:
    parts = [_INDEX_HEADER.pack(INDEX_MAGIC, FORMAT_VERSION, 0, len(entries))]
    for e in entries:
        kb = e.key.encode("utf-8")
        parts.append(_ENTRY.pack(len(kb), len(e.buffers)))
        parts.append(kb)
        for b in e.buffers:
            parts.append(_BUFFER.pack(b.offset, b.length, b.dtype.encode("ascii"), len(b.shape), b.crc32))
            parts.extend(_DIM.pack(d) for d in b.shape)
    return b"".join(parts)


def _encode_slot(sequence: int, index_offset: int, index: bytes, count: int) -> bytes:
    body = _SLOT.pack(MAGIC, FORMAT_VERSION, 0, sequence, index_offset, len(index), count, crc32(index), 0, 0)
    return body + _SLOT_CRC.pack(crc32(body))


def _layout(
    start: int, items: Mapping[str, Sequence[np.ndarray]]
) -> tuple[list[tuple[int, np.ndarray]], list[CacheEntry], int]:
    """Offsets of every buffer written from ``start`` on: (writes, entries, end)."""
    pos = start
    writes: list[tuple[int, np.ndarray]] = []
    entries: list[CacheEntry] = []
    for key, bufs in items.items():
        recs = []
        for a in bufs:
            pos = _align(pos, a.nbytes)
            shape = tuple(int(d) for d in a.shape)
            recs.append(CacheBuffer(pos, int(a.nbytes), a.dtype.str, shape, crc32(a)))
            if a.nbytes:
                writes.append((pos, a))
            pos += a.nbytes
        entries.append(CacheEntry(key, tuple(recs)))
    return writes, entries, pos


def _check_limits(path: str, entries: Sequence[CacheEntry], index: bytes) -> None:
    if len(entries) > MAX_ENTRIES or len(index) > MAX_INDEX_BYTES:
        raise _fail(
            CacheFileError, path, "cache size",
            f"<= {MAX_ENTRIES} entries and an index <= {MAX_INDEX_BYTES} bytes "
            "(run `onnxpack cache compact` or use a new path)",
            f"{len(entries)} entries, {len(index)} bytes",
        )


def _write_new_file(path: str, items: Mapping[str, Sequence[np.ndarray]]) -> int:
    """Write a complete cache file holding ``items`` to a temp file, fsync, rename over ``path``."""
    writes, entries, end = _layout(HEADER_SIZE, items)
    index_offset = _align(end, 0)
    index = _encode_index(entries)
    _check_limits(path, entries, index)
    slot = _encode_slot(1, index_offset, index, len(entries))

    def write(f) -> None:
        fd = f.fileno()
        _pwrite_all(fd, slot * NUM_SLOTS, 0)
        for off, a in writes:
            _pwrite_all(fd, _bytes_of(a), off)
        _pwrite_all(fd, index, index_offset)

    atomic_write(path, write)  # temp file, fsync, rename over ``path``, fsync the folder
    return index_offset + len(index)


def append_entries(path: str | os.PathLike[str], entries: Mapping[str, Sequence[np.ndarray]]) -> AppendResult:
    """Add the entries whose keys the file does not hold yet; write nothing if there are none.

    Serialized with other writers by an exclusive flock on ``PATH.lock``.  A missing (or empty)
    file is created; a damaged file of ours is replaced (``rebuilt``); a foreign or newer-version
    file raises :class:`CacheFileError` and is left alone.  Bad keys or buffers raise
    :class:`onnxpack.errors.InvalidArgument`; I/O failures raise OSError.
    """
    path = os.fspath(path)
    items = _prepare(entries)
    with _locked(path):
        fd = None
        if os.path.lexists(path):
            # A regular file only (a FIFO would block the open or the writes), then read-write.
            rfd, _ = open_regular_file(path, "packed-weight cache file", MAX_FILE_POSITION, CacheFileError)
            try:
                fd = os.open(f"/proc/self/fd/{rfd}", os.O_RDWR) if os.path.exists("/proc/self/fd") else os.open(path, os.O_RDWR)
            finally:
                os.close(rfd)
        try:
            state: _State | None = None
            rebuilt = False
            size = 0
            if fd is not None:
                header = os.pread(fd, HEADER_SIZE, 0)
                size = os.fstat(fd).st_size
                if size:
                    try:
                        state = _read_state(fd, header, size, path)
                    except _DamagedCache as e:
                        logger.info("replacing damaged packed-weight cache: %s", e)
                        rebuilt = True
            present = state.entries if state else {}
            new = {k: v for k, v in items.items() if k not in present}
            skipped = tuple(k for k in items if k in present)
            if not new:
                return AppendResult((), skipped, 0, False)
            if state is None:
                written = _write_new_file(path, new)
                return AppendResult(tuple(new), skipped, written, rebuilt)
            assert fd is not None, "Bug: a state without a file"
            writes, added, end = _layout(size, new)
            index_offset = _align(end, 0)
            all_entries = list(present.values()) + added
            index = _encode_index(all_entries)
            _check_limits(path, all_entries, index)
            if state.max_sequence >= MAX_SEQUENCE:
                raise _fail(CacheFileError, path, "commit sequence", f"< {MAX_SEQUENCE}", state.max_sequence)
            for off, a in writes:
                _pwrite_all(fd, _bytes_of(a), off)
            _pwrite_all(fd, index, index_offset)
            os.fsync(fd)  # regions and index are durable before any slot points at them
            target = 1 - state.slot  # never overwrite the commit we are building on
            slot = _encode_slot(state.max_sequence + 1, index_offset, index, len(all_entries))
            _pwrite_all(fd, slot, target * SLOT_SIZE)
            os.fsync(fd)
            return AppendResult(tuple(new), skipped, index_offset + len(index) - size + SLOT_SIZE, False)
        finally:
            if fd is not None:
                os.close(fd)


def compact(path: str | os.PathLike[str]) -> CompactResult:
    """Rewrite ``path`` atomically (temp, fsync, rename) with only the live entries.

    Entries whose bytes fail their CRC-32 are dropped (and reported).  Processes that mapped the
    old file keep using it untouched (rename never truncates their inode).
    """
    path = os.fspath(path)
    with _locked(path):
        cf = CacheFile.open(path)  # missing/empty: nothing to do; foreign/damaged: CacheFileError
        with cf:
            before = cf._size
            if cf._state is None:
                return CompactResult(0, (), before, before)
            keep: dict[str, tuple[np.ndarray, ...]] = {}
            dropped = []
            for key in cf._entries:
                try:
                    keep[key] = cf.get(key, verify=True)  # type: ignore[assignment]
                except CacheFileError as e:
                    logger.warning("compact: dropping %s", e)
                    dropped.append(key)
            after = _write_new_file(path, keep)
            keep.clear()
        return CompactResult(len(cf._entries) - len(dropped), tuple(dropped), before, after)
