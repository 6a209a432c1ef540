"""Crash-safe file writing, shared by every module that writes a file.

Every file onnxpack writes goes to a temp name in the target folder, is fsynced, renamed over
the final name, and the folder is fsynced: a crash leaves the old file or the new one, never a
torn one, and readers that mapped the old file keep its inode.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["atomic_write", "fsync_dir", "temp_path"]


def fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows: directories cannot be opened; rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(folder: str, final_name: str) -> tuple[int, str]:
    """A new, exclusively created temp file next to ``final_name``: (fd, path).

    Not ``mkstemp``: it creates 0600 files; ``O_EXCL`` with mode 0666 lets the umask decide, like
    any normally created file.
    """
    while True:
        tmp = os.path.join(folder, f".{final_name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            return fd, tmp
        except FileExistsError:
            continue


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` through ``write(file)``: temp file, fsync, rename, fsync the folder."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    fd, tmp = temp_path(folder, name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)
