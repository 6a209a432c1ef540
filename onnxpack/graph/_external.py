"""External data: resolve a tensor's ``external_data`` safely and map each data file once.

A model is untrusted input.  Its ``external_data`` entries name a file, an offset and a length;
every one of them is checked here, in one place, before a single byte is read:

* the location must be a relative path without NUL bytes, and its real path (symlinks resolved)
  must stay inside the model's folder — absolute paths, ``..`` escapes and symlinks pointing out
  are refused without opening anything outside the folder;
* the target must be a regular file (``os.stat`` before ``open``, then ``O_NOFOLLOW |
  O_NONBLOCK`` so a FIFO or device can never block or be read, then ``fstat`` on the descriptor
  to make sure we opened what we checked);
* offset and length must be non-negative decimal integers, lie inside the file, and the length
  must equal what the tensor's shape and dtype need.

Each file is opened once per :class:`DataFiles` and mapped read-only (``mmap.ACCESS_READ``);
tensors are zero-copy views into that mapping, so loading touches no weight pages.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import stat
import threading


from onnxpack._frozen import fast_init
from onnxpack.errors import ExternalDataError
from onnxpack.graph._proto import TensorProto

__all__ = ["ExternalLocation", "DataFiles", "parse_external_data", "stat_identity", "RESERVED_KEYS",
           "MAX_FILE_POSITION", "open_regular_file", "read_regular_file"]

logger = logging.getLogger(__name__)

# Keys of TensorProto.external_data that describe where the bytes are.  Everything else
# (``checksum``, unknown keys) is carried through a save unchanged, except keys onnxruntime
# owns that point into a specific file layout (see ``_save._STALE_KEY_PREFIXES``).
RESERVED_KEYS = ("location", "offset", "length")

# Offsets/lengths beyond this cannot be valid file positions on any platform we support; the
# cap also keeps a hostile "99999…" string from turning into a huge Python int that overflows
# later C-level arithmetic (mmap, numpy).
MAX_FILE_POSITION = 2**63 - 1

# O_NOFOLLOW/O_NONBLOCK do not exist on Windows; there the stat checks above are what protects us.
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def _opened_path(fd: int) -> str | None:
    """The path of the file open as ``fd``, as the kernel names it (Linux's /proc/self/fd), or
    None where that cannot be asked."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return path if path.startswith("/") and not path.endswith(" (deleted)") else None


@fast_init
@dataclasses.dataclass(frozen=True)
class ExternalLocation:
    """Where an external tensor's bytes live, after validation.

    Attributes:
        location: the location string exactly as written in the model.
        path: resolved absolute real path of the data file (inside the model's folder).
        offset: byte offset of the tensor in the file.
        length: number of bytes of the tensor in the file.
        file_id: :func:`stat_identity` of the opened file; the prepack layer uses it as a cheap
            identity of the weight's bytes.
    """

    location: str
    path: str
    offset: int
    length: int
    file_id: tuple[int, int, int, int, int]


def stat_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``: what identifies a file's bytes
    without reading them.  Any write in place moves mtime and ctime (ctime cannot be set back by a
    user), a copy or a replacement is another inode: while the identity holds, the bytes are the
    ones seen when it was taken."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def open_regular_file(path: str, what: str, max_bytes: int, error: type[Exception],
                      flags: int = 0) -> tuple[int, os.stat_result]:
    """Opens ``path`` without blocking and returns ``(fd, fstat)`` after checking that what was
    opened is a regular file of at most ``max_bytes``: a FIFO, a device (``/dev/zero``), a socket
    or a folder — directly or behind a symlink — is ``error`` naming ``what``, never a hang or an
    endless read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_BINARY", 0) | flags)
    except OSError as e:
        raise error(f"cannot read {what} {path!r}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path!r}: expected a regular file, got {_file_kind(st.st_mode)}")
        if st.st_size > max_bytes:
            raise error(f"{what} {path!r}: {st.st_size} bytes, more than the {max_bytes} it may have")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular_file(path: str, what: str, max_bytes: int, error: type[Exception]) -> bytes:
    """The bytes of a regular file (see :func:`open_regular_file`), read to its size at open."""
    fd, st = open_regular_file(path, what, max_bytes, error)
    try:
        chunks = []
        left = st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 26))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise error(f"cannot read {what} {path!r}: {e.strerror}") from e
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def parse_external_data(tensor: TensorProto) -> dict[str, str]:
    """Returns the tensor's ``external_data`` entries as a dict (last entry wins)."""
    return {entry.key: entry.value for entry in tensor.external_data[:]}


def _parse_position(tensor_name: str, location: str, key: str, value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit() or not text.isascii():
        raise ExternalDataError(
            f"tensor {tensor_name!r}: external data {key} of file {location!r} must be a "
            f"non-negative decimal integer, got {value!r}"
        )
    number = int(text)
    if number > MAX_FILE_POSITION:
        raise ExternalDataError(
            f"tensor {tensor_name!r}: external data {key} of file {location!r} is {number}, "
            f"beyond the largest file position {MAX_FILE_POSITION}"
        )
    return number


class _MappedFile:
    """One opened, read-only mapped data file; its descriptor stays open so that :meth:`check`
    can tell, with one ``fstat``, whether the mapped inode was truncated or rewritten."""

    __slots__ = ("path", "size", "file_id", "buffer", "_mmap", "fd", "_fd_lock")

    def __init__(self, path: str, size: int, file_id: tuple[int, ...], mm, fd: int) -> None:
        self.path = path
        self.size = size
        self.file_id = file_id
        self._mmap = mm
        self.fd = fd
        # check() and close() hold it: a descriptor closed between reading it and fstat could be
        # another file's by then (sessions sharing blobs check each other's files).
        self._fd_lock = threading.Lock()
        # mmap of an empty file is impossible; an empty bytes object serves zero-length views.
        self.buffer = mm if mm is not None else b""

    def check(self) -> None:
        with self._fd_lock:
            if self.fd < 0:  # closed with its model: nothing runs from it any more
                return
            try:
                now = stat_identity(os.fstat(self.fd))
            except (OSError, ValueError):
                return
        if now != self.file_id:
            raise ExternalDataError(
                f"external data file {self.path!r} changed under the live session (was {self.size} "
                f"bytes, now {now[2]}; modified after it was mapped): its weights are no longer the "
                "ones loaded — create the session again"
            )

    def close(self) -> None:
        with self._fd_lock:
            fd, self.fd = self.fd, -1
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


class DataFiles:
    """The external data files of one model: resolved, validated and mapped once each.

    Args:
        base_dir: folder that locations resolve against; ``None`` means the model came from bytes
            without a folder, so any external tensor is an error.
    """

    def __init__(self, base_dir: str | None) -> None:
        self.base_dir = os.path.abspath(base_dir) if base_dir is not None else None
        self._real_base = os.path.realpath(self.base_dir) if self.base_dir is not None else None
        self._files: dict[str, _MappedFile] = {}  # by location string as written
        self._closed = False

    # -- resolution -------------------------------------------------------------------------
    def _resolve(self, tensor_name: str, location: str) -> str:
        if self._real_base is None:
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data file {location!r} cannot be resolved: the "
                "model was loaded from bytes without base_dir"
            )
        if "\x00" in location:
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data location {location!r} contains a NUL byte"
            )
        if not location:
            raise ExternalDataError(f"tensor {tensor_name!r}: external data location is empty")
        # Refuse absolute locations in every spelling (POSIX, Windows drive, UNC), not only the
        # host's: a model built on one OS is loaded on another.
        if (
            os.path.isabs(location)
            or location.startswith(("/", "\\"))
            or (len(location) > 1 and location[1] == ":")
        ):
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data location {location!r} is absolute; it must "
                f"be relative to the model folder {self.base_dir!r}"
            )
        parts = location.replace("\\", "/").split("/")
        if ".." in parts:
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data location {location!r} escapes the model "
                f"folder {self.base_dir!r} with '..'"
            )
        # realpath resolves symlinks with lstat/readlink only: nothing is opened.
        try:
            real = os.path.realpath(os.path.join(self._real_base, location))
        except (OSError, ValueError) as e:  # (a path changing under it: a loop, a component gone)
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data location {location!r} cannot be resolved: {e}") from e
        if os.path.commonpath([real, self._real_base]) != self._real_base or real == self._real_base:
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data location {location!r} resolves to {real!r}, "
                f"outside the model folder {self._real_base!r} (symlink pointing out?)"
            )
        return real

    def _open(self, tensor_name: str, location: str) -> _MappedFile:
        if self._closed:
            raise ExternalDataError(
                f"tensor {tensor_name!r}: the model was closed; cannot map {location!r}"
            )
        cached = self._files.get(location)
        if cached is not None:
            return cached
        real = self._resolve(tensor_name, location)
        try:
            st = os.stat(real, follow_symlinks=False)
        except OSError as e:
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data file {location!r} ({real}) cannot be "
                f"accessed: {e.strerror}"
            ) from e
        if not stat.S_ISREG(st.st_mode):
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data file {location!r} ({real}) is not a "
                "regular file"
            )
        try:
            fd = os.open(real, _OPEN_FLAGS)
        except OSError as e:
            raise ExternalDataError(
                f"tensor {tensor_name!r}: external data file {location!r} ({real}) cannot be "
                f"opened: {e.strerror}"
            ) from e
        try:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                raise ExternalDataError(
                    f"tensor {tensor_name!r}: external data file {location!r} ({real}) changed "
                    "while it was being opened or is not a regular file"
                )
            opened = _opened_path(fd)
            if opened is not None and (os.path.commonpath([opened, self._real_base]) != self._real_base
                                       or opened == self._real_base):
                # A directory of the path swapped for a symlink between the checks and the open
                # (the stat and the open both followed it): what was opened is what counts.
                raise ExternalDataError(
                    f"tensor {tensor_name!r}: external data file {location!r} opened as {opened!r}, outside "
                    f"the model folder {self._real_base!r} (the path changed while it was being opened)"
                )
            size = fst.st_size
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size > 0 else None
        except BaseException:
            os.close(fd)
            raise
        file_id = stat_identity(fst)
        mapped = _MappedFile(real, size, file_id, mm, fd)
        # Two spellings of one location ("w.bin", "./w.bin") share one mapping.
        for other in self._files.values():
            if other.path == real and other.file_id == file_id:
                mapped.close()
                mapped = other
                break
        self._files[location] = mapped
        return mapped

    # -- public -----------------------------------------------------------------------------
    def locate(
        self, tensor: TensorProto, expected_nbytes: int
    ) -> tuple[ExternalLocation, object]:
        """Validates an external tensor and returns its location and the buffer it lives in.

        Args:
            tensor: the TensorProto with ``data_location == EXTERNAL``.
            expected_nbytes: bytes its shape and dtype need.

        Returns:
            ``(ExternalLocation, buffer)`` where ``buffer`` is the read-only mapping (or ``b""``).

        Raises:
            ExternalDataError: naming the tensor, the file and the bounds, on any violation.
        """
        name = tensor.name
        entries = parse_external_data(tensor)
        location = entries.get("location")
        if location is None:
            raise ExternalDataError(f"tensor {name!r}: external data has no 'location' entry")
        offset = _parse_position(name, location, "offset", entries.get("offset"))
        length = _parse_position(name, location, "length", entries.get("length"))
        mapped = self._open(name, location)
        offset = 0 if offset is None else offset
        if length is None:
            # onnx reads "to the end of file" when length is missing; we require the tensor's
            # own size to fit instead, which is what every writer means.
            length = expected_nbytes
        elif length != expected_nbytes:
            raise ExternalDataError(
                f"tensor {name!r}: external data length {length} in file {location!r} does not "
                f"match its shape {tuple(tensor.dims)} and dtype "
                f"{TensorProto.DataType.Name(tensor.data_type)}: expected {expected_nbytes} bytes"
            )
        if offset > mapped.size or length > mapped.size - offset:
            raise ExternalDataError(
                f"tensor {name!r}: external data [{offset}, {offset + length}) lies outside file "
                f"{location!r} of {mapped.size} bytes"
            )
        loc = ExternalLocation(location, mapped.path, offset, length, mapped.file_id)
        return loc, mapped.buffer

    def _mapped(self) -> tuple[_MappedFile, ...]:
        """Every mapping once, from a snapshot of the table taken in one step.

        Another session's thread may call :meth:`check` (sessions sharing packed blobs through a
        container each guard the files the blobs map, see ``PrePackedWeights.check_source``)
        while this model's own thread closes it: iterating the table itself there raised
        "dictionary changed size during iteration" in the other session's run (seen in CI:
        eight threads creating, running and closing sessions on one container).  ``tuple()`` of
        a dict's values is built without running Python code, so no other thread can change the
        table in between."""
        return tuple({id(m): m for m in tuple(self._files.values())}.values())

    def paths(self) -> set[str]:
        """Real paths of every data file mapped so far."""
        return {m.path for m in self._mapped()}

    def identity(self, location: str) -> tuple[int, ...] | None:
        """:func:`stat_identity` of the mapped file ``location`` when it was opened (None if not
        mapped)."""
        m = self._files.get(location)
        return None if m is None else m.file_id

    def check(self) -> None:
        """Raises ExternalDataError if a mapped file was truncated or rewritten since it was
        mapped (one ``fstat`` per file): reading a truncated mapping kills the process with
        SIGBUS, and a rewritten one gives other weights than the ones loaded."""
        for m in self._mapped():
            m.check()

    def close(self) -> None:
        """Forgets the mappings and closes the descriptors.

        The mmaps themselves are not closed: numpy views taken earlier hold references to them,
        and closing a mapping under a live view would crash the process.  The OS unmaps each file
        once the last view is garbage-collected.
        """
        for m in self._mapped():
            m.close()
        self._files.clear()
        self._closed = True

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
