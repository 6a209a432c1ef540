"""This process's memory as Linux reports it (``/proc/self/status``, ``/proc/self/smaps_rollup``)."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["process_memory", "return_freed_heap"]

_STATUS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def process_memory() -> dict[str, int]:
    """Bytes of VmRSS, VmHWM (peak), RssAnon (private), RssFile (file-backed), RssShmem and Pss
    (shared pages divided among sharers); an empty dict where /proc is not there."""
    out: dict[str, int] = {}
    for path, keys in (("/proc/self/status", _STATUS), ("/proc/self/smaps_rollup", ("Pss",))):
        try:
            with open(path) as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in keys:
                        out[key] = int(rest.split()[0]) * 1024
        except OSError:
            pass
    return out


_TRIM: list = []


def return_freed_heap() -> None:
    """Give the C heap's freed pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    glibc keeps freed blocks below the heap's top, and after a large block is freed it serves
    later allocations from the heap: a run with large temporaries (an LLM's prompt: its logits
    alone are tokens x vocabulary floats) leaves that memory private to the process, counted in
    every process serving a model.
    """
    if not _TRIM:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):  # musl and others: no malloc_trim
                fn = None
        _TRIM.append(fn)
    if _TRIM[0] is not None:
        _TRIM[0](0)
