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

Cost: a few µs per run when a limit is set (one read of each library's count when no other
limited run is in flight, a set when the count changes, under a lock); nothing otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["blas_threads", "owned_threads", "set_global_thread_pool_sizes", "global_intra_op_threads", "blas_libraries"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_active: dict[int, int] = {}  # requested count -> runs in flight asking for it
_original: list[int | None] = []  # each library's count when the first limited run started
_applied: list[int | None] = []  # each library's count as last set or read (under _lock)
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
    """Called under ``_lock``: BLAS at ``n`` threads (``n <= 0``: the count the process had).
    ``_applied`` is the count each library has as we last set or read it, so a run sets a
    library only when its count changes and reads none while others are in flight."""
    for i, lib in enumerate(_libs or ()):
        count = _original[i]
        if count is None:  # the library cannot say its count: leave it alone
            continue
        want = count if n <= 0 else n
        if _applied[i] != want:
            lib.set_num_threads(want)
            _applied[i] = want


class _Counted:
    """Counts ``n`` in ``counts`` for the duration of a ``with`` and calls ``apply`` with the
    smallest count in flight (0 when none is left); ``first()`` runs, under the lock, when
    ``counts`` was empty.

    (A class, not a generator context manager: it is entered at every run of a session with
    ``intra_op_num_threads`` set, where contextlib's generator, threadpoolctl's re-reads of each
    library's count before every set and its symbol look-ups cost 15-45 us a run; this costs a
    few, one read of the counts when the first run starts and a set when a count changes.)"""

    __slots__ = ("counts", "n", "apply", "first")

    def __init__(self, counts: dict[int, int], n: int, apply: Any, first: Any = None) -> None:
        self.counts, self.n, self.apply, self.first = counts, n, apply, first

    def __enter__(self) -> None:
        counts = self.counts
        with _lock:
            if not counts and self.first is not None:
                self.first()
            counts[self.n] = counts.get(self.n, 0) + 1
            self.apply(min(counts))

    def __exit__(self, *exc: Any) -> None:
        counts, n = self.counts, self.n
        with _lock:
            left = counts[n] - 1
            if left:
                counts[n] = left
            else:
                del counts[n]
            self.apply(min(counts) if counts else 0)


class _Nothing:
    """The limit of ``n <= 0`` (or without threadpoolctl): nothing to do."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NOTHING = _Nothing()


def _save_original() -> None:
    """The counts the libraries have when the first limited run starts (re-read each time no run
    is in flight: a user may change them between runs); restored when the last one ends."""
    _original[:] = [lib.get_num_threads() for lib in _libs or ()]
    _applied[:] = _original


def blas_threads(n: int) -> Any:
    """Limit BLAS to ``n`` threads for the duration of a ``with`` (no-op for ``n <= 0``)."""
    if n <= 0 or not blas_libraries():
        return _NOTHING
    return _Counted(_active, n, _apply, _save_original)


_owners: dict[int, int] = {}  # owned_threads counts in flight


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
    with blas_threads(1), _Counted(_owners, n, set_owned_threads):
        yield


def set_global_thread_pool_sizes(intra_op_num_threads: int = 0, inter_op_num_threads: int = 0) -> None:
    """The intra-op thread count of sessions with ``use_per_session_threads = False``."""
    global _global_intra
    _global_intra = max(0, int(intra_op_num_threads))


def global_intra_op_threads() -> int:
    return _global_intra
