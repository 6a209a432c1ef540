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
import os
import statistics
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

__all__ = ["blas_threads", "owned_threads", "set_global_thread_pool_sizes", "global_intra_op_threads", "blas_libraries",
           "ModeTuner"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_active: dict[int, int] = {}  # requested count -> runs in flight asking for it
_original: list[int | None] = []  # each library's count when the first limited run started
_applied: list[int | None] = []  # each library's count as last set or read (under _lock)
_libs: list[Any] | None = None  # threadpoolctl controllers of the loaded BLAS libraries ([] if unavailable)
# _libs' count getters and setters (bound methods, looked up once per list of libraries)
_for_libs: list[Any] = [None]
_getters: list[Any] = []
_setters: list[Any] = []
_global_intra = 0


def blas_libraries(quiet: bool = False) -> list[Any]:
    """threadpoolctl's controllers of the BLAS libraries numpy loaded (``[]`` without threadpoolctl,
    which logs a warning once, at the first call that is not ``quiet``)."""
    global _libs, _unwarned
    if _libs is None:
        try:
            import numpy  # noqa: F401  (loads the BLAS library to control)
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _libs, _unwarned = [], True
        else:
            _libs = _numpy_own(list(ThreadpoolController().select(user_api="blas").lib_controllers))
    if _unwarned and not quiet:
        _unwarned = False
        logger.warning("intra_op_num_threads is set but threadpoolctl is not installed, so numpy's BLAS threads "
                       "cannot be limited; the setting is ignored (pip install threadpoolctl)")
    return _libs


_unwarned = False  # threadpoolctl is missing and no call has said so yet


def _numpy_own(libs: list[Any]) -> list[Any]:
    """The BLAS numpy itself calls, among ``libs``, when it can be told: the one shipped in the
    wheel's ``numpy.libs`` folder beside the package.  Others in the process are not ours to
    limit: numba imports scipy, whose wheel brings its own OpenBLAS, and onnxpack's kernels never
    call it (its JIT kernels call no BLAS); limiting it too doubled the library calls of every
    run (~2.5 us of Silero VAD's ~110).  A numpy built against a system BLAS shares it with
    scipy: then every library found is kept, as before."""
    import numpy

    mine = os.path.realpath(os.path.dirname(numpy.__file__)) + ".libs"
    own = [lib for lib in libs if os.path.dirname(os.path.realpath(getattr(lib, "filepath", "") or "")) == mine]
    return own if own else libs


def _raw(lib: Any, name: str) -> Any:
    """OpenBLAS's own C function ``name`` (``get``/``set_num_threads`` of its threading layer)
    as a ctypes function, or None (another library, or threadpoolctl without the look-up): a
    call costs ~0.2 us, against ~0.5 us through the controller's method, which looks the symbol
    up at every call (three calls a run of a session with intra_op_num_threads set)."""
    look = getattr(lib, "_get_symbol", None)
    if look is None or getattr(lib, "internal_api", None) != "openblas":
        return None
    omp = getattr(lib, "threading_layer", None) == "openmp"
    try:
        return look(("omp_get_max_threads" if omp else "openblas_get_num_threads") if name == "get" else
                    ("omp_set_num_threads" if omp else "openblas_set_num_threads"))
    except Exception:  # noqa: BLE001 - a controller of another layout: its methods serve
        return None


def _own_setter(lib: Any) -> Any:
    """``lib``'s thread-count setter as the library has it.  threadpoolctl (3.6 on) makes
    OpenBLAS's ``set_num_threads`` a no-op in every thread but one, the first live thread that
    set it: a run from a server's worker thread after the main thread had set the count (or from
    the main thread while such a worker lives) kept the count as it was, its BLAS on every core.
    The runs in flight are coordinated here (the smallest count applies, under ``_lock``), so the
    library's own setter is called; controllers without that guard are called as they are."""
    return _raw(lib, "set") or getattr(lib, "_real_set_num_threads", None) or lib.set_num_threads


def _apply(n: int) -> None:
    """Called under ``_lock``: BLAS at ``n`` threads (``n <= 0``: the count the process had).
    ``_applied`` is the count each library has as we last set or read it, so a run sets a
    library only when its count changes and reads none while others are in flight."""
    for i, setter in enumerate(_setters):
        count = _original[i]
        if count is None:  # the library cannot say its count: leave it alone
            continue
        want = count if n <= 0 else n
        if _applied[i] != want:
            setter(want)
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
    if _for_libs[0] is not _libs:
        _getters[:] = [_raw(lib, "get") or lib.get_num_threads for lib in _libs or ()]
        _setters[:] = [_own_setter(lib) for lib in _libs or ()]
        _for_libs[0] = _libs
    _original[:] = [get() for get in _getters]
    _applied[:] = _original


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's runs in flight: a fresh lock (another thread of
    the parent may have held it at the fork, and would never release it here) and no counts in
    flight (they would never end here, and the smallest would limit the child's runs for good)."""
    global _lock
    _lock = threading.Lock()
    if _active or _owners:
        _active.clear()
        _owners.clear()
        from onnxpack.session.kernels import set_owned_threads

        set_owned_threads(0)


class _Limit:
    """:func:`blas_threads`' context: :class:`_Counted` over ``_active`` written out, one shared
    object per count.  It is entered at every run of a session with ``intra_op_num_threads`` set,
    where Python's caches are cold after the model's kernels: a new generic object a run, its calls
    through attributes, cost several us more of Silero VAD's run (~110 us in all)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        n = self.n
        with _lock:
            if not _active:
                _save_original()
            _active[n] = _active.get(n, 0) + 1
            _apply(min(_active))

    def __exit__(self, *exc: Any) -> None:
        n = self.n
        with _lock:
            left = _active[n] - 1
            if left:
                _active[n] = left
            else:
                del _active[n]
            _apply(min(_active) if _active else 0)


_limits: dict[int, _Limit] = {}  # n -> its context (it holds only n: one per count, shared)


def blas_threads(n: int) -> Any:
    """Limit BLAS to ``n`` threads for the duration of a ``with`` (no-op for ``n <= 0``)."""
    if n <= 0 or not (_libs or blas_libraries()):
        return _NOTHING
    limit = _limits.get(n)
    if limit is None:
        limit = _limits[n] = _Limit(n)
    return limit


_owners: dict[int, int] = {}  # owned_threads counts in flight

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def owned_threads(n: int) -> Iterator[None]:
    """For the duration, BLAS at one thread and onnxpack's own kernels on ``n`` threads (the
    smallest count while several such runs overlap): a run in owned mode (see :class:`ModeTuner`).
    Why not both pools: after each call an OpenBLAS worker spins
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


class ModeTuner:
    """Which thread mode a session's runs on ``n > 1`` threads take, decided from its own runs:
    BLAS on ``n`` threads (onnxpack's own kernels split over ``n`` too), or owned
    (:func:`owned_threads`: BLAS on one, onnxpack's kernels and its GEMM splits on ``n``).

    Why: neither wins everywhere, and which one does is a property of the model on the machine,
    not of its op types.  Measured on this project's 2-vCPU VM, steady state, each mode in a
    process of its own (owned time / BLAS time): a CRNN 0.66, openWakeWord's embedding CNN 0.72,
    YOLOX 0.77, resnet50 0.83, PP-PicoDet 0.92, PP-OCR's detector 0.93, YOLOv8n 0.99,
    MobileNetV2 0.97-1.02, but a MobileNet-style orientation classifier 1.10-1.25 and a
    mel-spectrogram front end 1.40-1.57: OpenBLAS splits a small GEMM between its own threads
    for less than onnxpack's pool pays to hand a share over (the GIL), while after each of its
    calls OpenBLAS's workers poll the other core for a while and slow onnxpack's own split
    kernels beside them.

    The starting mode is owned, whatever the model.  Until session 66 it was owned only for a
    program with a GEMM of onnxpack's own (the panel GEMM), BLAS for the rest, and a switch needs
    two pairs of blocks that favour it (below) where keeping the starting mode needs one: one
    disturbed pair kept a model in its starting mode.  Measured in session 66, two threads, each
    mode in a session of its own, blocks alternating in one process (owned / BLAS): YOLOv8n 0.57,
    resnet50 0.69, YOLOX 0.70, PicoDet 0.73, the wake-word CNN 0.66, PP-OCR's recognizer 0.59 and
    detector 0.91, the orientation classifier 0.67 and 0.96 in two runs, MobileNetV2 0.95, the
    CRNN 0.75, MiniLM-L3 1.03, Silero VAD 1.07, the mel-spectrogram front end 1.14: owned wins
    almost everywhere since onnxpack's conv kernels split without the GIL, and a starting mode in
    BLAS had taken the orientation classifier to BLAS mode in two of three benchmark runs (1.7-1.9x
    onnxruntime's time against 1.4x owned).  The mel front end, which prefers BLAS, gets there by
    the confirmed switch.

    Measuring: the session's first run is not counted (it maps the weights' pages), then runs
    take the starting mode until ``TRIALS`` of them are counted, then the other mode as long.  A
    block's runs count from its ``SKIP + 1``-th and ``SETTLE`` seconds after its first: each
    mode's kernels tune their own splits in their first runs (see ``kernels._act.SplitTuner``),
    and after a BLAS-mode run OpenBLAS's workers poll for up to ~0.1 s (``THREAD_TIMEOUT``),
    slowing whatever onnxpack's own threads do meanwhile: measured in blocks of six runs
    alternating with the other mode, MobileNetV2 ran owned 1.21x slower than on BLAS, each mode
    in a process of its own the same speed (12.1-12.2 vs 11.9-12.3 ms).  The mode with the lower
    median then runs, BLAS only if it is faster by ``BLAS_MARGIN``: after every run its workers
    keep a core busy polling for ~0.1 s, which the rest of the machine pays (onnxruntime's runs in
    the same process, interleaved, 15-25 % slower on MobileNetV2), where owned mode's helpers stop
    polling when a run returns.  A choice of the other mode than the starting one is confirmed by a
    second pair of blocks, whose medians alone decide (a switch needs two pairs that favour it):
    one pair of blocks disturbed by the rest of the machine took YOLOX on two threads to BLAS mode
    in one of session 54's benchmark runs (2.02x onnxruntime's time, 1.81x owned in the other run;
    owned / BLAS measured 0.77 in processes of their own), a CRNN in session 57's while both
    pairs' medians decided (13.5 ms a run against 9.0-9.4 owned, 12.3 on one thread).
    The session measures again ``RECHECK_FIRST`` runs and ``RECHECK_FIRST_S`` seconds after its
    first choice (both: a fast model's measuring must stay a small share of its runs), then at
    twice the distance after each choice, up to ``RECHECK`` runs and ``RECHECK_S`` seconds: the
    first measurement falls in a process's first seconds, which are often unlike its steady
    state, and a wrong choice then held for a minute.  Measured in session 61 on the orientation
    classifier, two threads, each process's first runs interleaved with onnxruntime's (a
    process starting up beside other work): owned mode's medians 4.4-7.9 ms in those runs and
    3.8-4.7 in the steady state that followed, so two processes of five chose BLAS mode, one of
    them then running 6.7-7.9 ms.  Only
    runs of one set of input shapes count: a run with other shapes restarts an undecided
    measurement (a model whose shapes change at every run, a decoder's growing cache, keeps the
    starting mode).  The mode changes no result beyond the rounding of a GEMM split differently,
    only its time; concurrent runs may record each other's time: harmless.
    """

    SKIP = 7
    SETTLE = 0.25  # seconds from a block's first run before its runs count (see above)
    TRIALS = 5
    BLAS_MARGIN = 0.97  # BLAS mode is kept only if its median is below this much of owned's
    RECHECK_FIRST = 100  # runs, and ...
    RECHECK_FIRST_S = 3.0  # ... seconds after the first choice before measuring again (both)
    RECHECK = 2000  # the most runs, and ...
    RECHECK_S = 60.0  # ... seconds after a later choice (each doubles the one before)
    # No lock: a child forked while another thread held one would hang at its next run.  Each
    # step is a few attribute stores under the GIL, and the lists of times are read through a
    # reference taken once (a reset makes new lists; the old ones only ever grow), so racing
    # runs can at worst mix up samples, never fail.
    __slots__ = ("start", "choice", "key", "phase", "runs", "since", "times", "calls", "rounds", "wait", "last")

    def __init__(self, start: bool) -> None:
        self.start = start  # the starting mode: True = owned
        self.choice: bool | None = None  # the mode chosen (True = owned); None while measuring
        self.key: Hashable = None  # the input shapes being measured
        self.phase = 0  # the block being measured: 0 the starting mode's, 1 the other's
        self.runs = 0  # runs taken in this block
        self.since = 0.0  # when this block's first run started, or the choice was made
        self.times: tuple[list[float], list[float]] = ([], [])  # counted times per block
        self.calls = 0  # runs since the choice was made
        self.rounds = 1  # pairs of blocks to measure (2: confirming a switch from the starting mode)
        self.wait: tuple[int, float] | None = None  # runs and seconds from the choice to measuring again
        self.last: bool | None = None  # the mode chosen last (kept while measuring again)

    def _next_wait(self, wait: tuple[int, float] | None) -> tuple[int, float]:
        """The distance from a choice to the next measuring, given the one after the choice before."""
        if wait is None:
            return self.RECHECK_FIRST, self.RECHECK_FIRST_S
        return min(2 * wait[0], self.RECHECK), min(2 * wait[1], self.RECHECK_S)

    def current(self) -> bool:
        """The mode of runs that are not measured (a session's first, runs with run options or
        profiling, on a pruned plan): the one chosen (while measuring again: the one chosen
        before), else the starting mode."""
        choice = self.choice if self.choice is not None else self.last
        return self.start if choice is None else choice

    def fix(self) -> None:
        """Keeps the starting mode for good (``onnxpack.thread_mode`` set)."""
        self.choice, self.calls, self.since = self.start, -(1 << 62), float("inf")
        self.wait = (self.RECHECK, self.RECHECK_S)

    def pick(self, inputs: Sequence[Any]) -> tuple[bool, int, Hashable]:
        """The mode of the next run on ``inputs`` (True = owned), the block its time counts in
        (-1: not counted) and the key of its input shapes to :meth:`record` it with."""
        choice = self.choice
        if choice is not None:
            self.calls += 1
            runs, seconds = self.wait
            if self.calls < runs or time.perf_counter() - self.since < seconds:
                return choice, -1, None
            self.choice, self.key = None, None  # measure again from this run
        key = tuple(getattr(v, "shape", None) for v in inputs)
        if key != self.key:
            self.key, self.times, self.phase, self.runs, self.rounds = key, ([], []), 0, 0, 1
        phase = 1 if len(self.times[0]) >= self.TRIALS * self.rounds else 0
        now = time.perf_counter()
        if phase != self.phase or self.runs == 0:
            self.phase, self.runs, self.since = phase, 0, now
        self.runs += 1
        settled = self.runs > self.SKIP and now - self.since >= self.SETTLE
        return self.start != bool(phase), (phase if settled else -1), key

    def record(self, key: Hashable, which: int, seconds: float) -> None:
        """The time of a run :meth:`pick` counted in ``which``."""
        times = self.times
        if which < 0 or key != self.key or self.choice is not None:
            return
        times[which].append(seconds)
        first, other = times
        want = self.TRIALS * self.rounds
        if len(first) >= want and len(other) >= want:
            # The confirming pair of blocks decides alone: a switch needs two pairs that favour it.
            skip = want - self.TRIALS
            pair = (first[skip:], other[skip:]) if self.start else (other[skip:], first[skip:])
            owned, blas = (statistics.median(t) for t in pair)
            choice = not blas < self.BLAS_MARGIN * owned
            if choice != self.start and self.rounds == 1:
                self.rounds = 2  # a switch: a second block of each mode first
                return
            self.calls, self.since = 0, time.perf_counter()
            self.wait = self._next_wait(self.wait)
            self.choice = self.last = choice
            logger.debug("thread mode: %s (medians: owned %.3g s, BLAS %.3g s)",
                         "owned" if self.choice else "BLAS", owned, blas)


def set_global_thread_pool_sizes(intra_op_num_threads: int = 0, inter_op_num_threads: int = 0) -> None:
    """The intra-op thread count of sessions with ``use_per_session_threads = False``."""
    global _global_intra
    _global_intra = max(0, int(intra_op_num_threads))


def global_intra_op_threads() -> int:
    return _global_intra
