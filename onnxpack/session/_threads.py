"""``intra_op_num_threads``: the BLAS threads numpy uses while a session runs.

onnxpack's kernels are numpy; the threads doing their heavy lifting are the BLAS library's
(OpenBLAS, MKL, BLIS, ...).  A session with ``intra_op_num_threads = n > 0`` limits them to ``n``
during each of its runs through threadpoolctl (an optional dependency: ``pip install
onnxpack[threads]``; without it the setting logs one warning and is ignored) and restores the
previous count after.  The count is process-wide, as BLAS has it: while runs asking for
different counts overlap, the smallest is applied (every run gets at most what it asked for), and
the count the process had is restored when the last of them ends.

``set_global_thread_pool_sizes(intra, inter)`` sets the count used by sessions created with
``use_per_session_threads = False`` (onnxruntime's global thread pool).

Cost: about 5 µs per run when a limit is set (two BLAS calls under a lock); nothing otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["blas_threads", "owned_threads", "set_global_thread_pool_sizes", "global_intra_op_threads", "blas_libraries"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_active: collections.Counter[int] = collections.Counter()  # requested count -> runs in flight asking for it
_original: list[int] = []
_libs: list[Any] | None = None  # threadpoolctl controllers of the loaded BLAS libraries ([] if unavailable)
_global_intra = 0


def blas_libraries() -> list[Any]:
    """threadpoolctl's controllers of the BLAS libraries numpy loaded (``[]`` without threadpoolctl)."""
    global _libs
    if _libs is None:
        try:
            import numpy  # noqa: F401  (loads the BLAS library to control)
            from threadpoolctl import ThreadpoolController
        except ImportError:
            logger.warning("intra_op_num_threads is set but threadpoolctl is not installed, so numpy's BLAS threads "
                           "cannot be limited; the setting is ignored (pip install threadpoolctl)")
            _libs = []
        else:
            _libs = list(ThreadpoolController().select(user_api="blas").lib_controllers)
    return _libs


def _apply(n: int) -> None:
    for lib, count in zip(_libs or (), _original):
        want = count if n <= 0 else n
        if lib.num_threads != want:
            lib.set_num_threads(want)


@contextlib.contextmanager
def _counted(counts: collections.Counter[int], n: int, apply: Any, first: Any = None) -> Iterator[None]:
    """Counts ``n`` in ``counts`` for the duration and calls ``apply`` with the smallest count in
    flight (0 when none is left); ``first()`` runs, under the lock, when ``counts`` was empty."""
    with _lock:
        if not counts and first is not None:
            first()
        counts[n] += 1
        apply(min(counts))
    try:
        yield
    finally:
        with _lock:
            counts[n] -= 1
            if not counts[n]:
                del counts[n]
            apply(min(counts) if counts else 0)


def _save_original() -> None:
    _original[:] = [lib.num_threads for lib in _libs or ()]


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Limit BLAS to ``n`` threads for the duration (no-op for ``n <= 0``)."""
    if n <= 0 or not blas_libraries():
        yield
        return
    with _counted(_active, n, _apply, _save_original):
        yield


_owners: collections.Counter[int] = collections.Counter()  # owned_threads counts in flight


@contextlib.contextmanager
def owned_threads(n: int) -> Iterator[None]:
    """For the duration, BLAS at one thread and onnxpack's own kernels on ``n`` threads (the
    smallest count while several such runs overlap): a run whose heavy work is onnxpack's own
    (``Kernel.owns_threads``).  Why not both pools: after each call an OpenBLAS worker spins
    for a while, waiting for more work, and takes the core onnxpack's threads would use
    (measured, BERT-base on 2 cores: 250-270 ms per run with the JIT GEMM on 2 threads beside
    2-thread BLAS, 160-180 ms with the BLAS at one thread).  Without threadpoolctl the BLAS keeps
    its count and only onnxpack's threads change."""
    from onnxpack.session.kernels import set_owned_threads

    if n <= 1:
        with blas_threads(n):
            yield
        return
    with blas_threads(1), _counted(_owners, n, set_owned_threads):
        yield


def set_global_thread_pool_sizes(intra_op_num_threads: int = 0, inter_op_num_threads: int = 0) -> None:
    """The intra-op thread count of sessions with ``use_per_session_threads = False``."""
    global _global_intra
    _global_intra = max(0, int(intra_op_num_threads))


def global_intra_op_threads() -> int:
    return _global_intra
