"""This process's memory: as Linux reports it (``/proc/self/status``, ``/proc/self/smaps_rollup``),
and what the C allocator keeps of what runs free.

**Freed memory kept for the next run** (``enable_cpu_mem_arena``, :func:`keep_freed_memory`).
A run allocates its activations and scratch with numpy (``malloc``) and frees each at its last
use.  glibc hands memory back to the kernel when the free space at the top of its heap passes a
trim threshold, and serves large blocks with ``mmap``, unmapped at each ``free``; its dynamic
thresholds only follow the largest block freed so far.  The next run then touches fresh pages
again: a page fault per 4 KiB, each zeroing its page.  Measured on this project's 2-core VM (AMD
EPYC, glibc 2.36): the openWakeWord embedding CNN took ~1,900 page faults per run (7.5 MB of its
activations, every run) at ~5 µs each, 10 ms of a 55-75 ms run.  onnxruntime's CPU arena
(``enable_cpu_mem_arena``, on by default) keeps what it allocated and pays none of this.

So the first session created with ``enable_cpu_mem_arena`` true (the default, as in onnxruntime)
asks glibc once per process (``mallopt``) to serve blocks up to ``MMAP_THRESHOLD`` from its heap
and to keep up to ``TRIM_THRESHOLD`` of free space at a heap's top.  Larger blocks (an LLM
prompt's logits) are still mapped and returned at ``free``, so what is kept is bounded;
:func:`return_freed_heap` (``memory.enable_memory_arena_shrinkage``, the end of a generation)
still gives everything free back.  The setting is the process's (glibc has no other scope): a
later session with ``enable_cpu_mem_arena = False`` does not undo it.
``ONNXPACK_MALLOC_TUNING=0`` turns it off; other C libraries (musl, macOS, Windows) are left as
they are.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

__all__ = ["process_memory", "return_freed_heap", "keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

logger = logging.getLogger(__name__)

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


# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap: glibc's own ceiling for its dynamic threshold (the
# largest it would pick by itself, after freeing a block that large).
MMAP_THRESHOLD = 32 << 20
# Free space kept at the top of a heap before it goes back to the kernel.
TRIM_THRESHOLD = 128 << 20

_keep_lock = threading.Lock()
_KEPT: list[bool] = []  # [whether the settings are in effect], once decided


def keep_freed_memory() -> bool:
    """Applies the allocator settings of the module docstring once per process; whether they
    are in effect (False off glibc, with ``ONNXPACK_MALLOC_TUNING=0``, or when refused)."""
    if not _KEPT:
        with _keep_lock:
            if not _KEPT:
                _KEPT.append(_apply_keep())
    return _KEPT[0]


def _apply_keep() -> bool:
    if os.environ.get("ONNXPACK_MALLOC_TUNING", "1") == "0":
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, ValueError, OSError):  # no confstr name, or no mallopt: not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    logger.debug("glibc keeps freed memory (mmap threshold %d, trim threshold %d): %s", MMAP_THRESHOLD,
                 TRIM_THRESHOLD, "applied" if ok else "refused")
    return ok
