"""Activations applied in place on a kernel's fresh output (fusion epilogues), numba or numpy.

An :class:`Activation` is a small frozen record (kind and up to two float parameters) that a
fusion record carries to the kernel it builds (``session/_fusion.py``).  :func:`apply` runs it
in place on a float32/float64 array: through the numba kernels of :mod:`._conv_jit` when they are
available (one pass, float32 only), else with numpy in-place ufuncs.  Both compute the same
formulas; they differ by rounding only (SiLU/Sigmoid: the JIT's float32 exp is within 2 ulp of
numpy's), which the tests bound.

The JIT module is imported on the first call, never at import or session creation, and only when
numba is importable and ``ONNXPACK_DISABLE_JIT`` is not ``1`` (the switch MatMulNBits uses too).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import logging
import math
import os
import platform
import queue
import sys
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from onnxpack._frozen import fast_init
logger = logging.getLogger(__name__)

__all__ = ["Activation", "apply", "jit", "parallel", "threads", "matmul", "set_owned_threads", "jit_possible"]

# Kind -> code understood by _conv_jit._act_row.
CODES = {"none": 0, "relu": 1, "clip": 2, "hardswish": 3, "silu": 4, "sigmoid": 5, "leakyrelu": 6,
         "hardsigmoid": 7, "affine": 8, "gelu": 9, "fakequant": 10, "channel": 11, "fastgelu": 12, "quickgelu": 13}

_ENV_DISABLE = "ONNXPACK_DISABLE_JIT"
_jit_modules: dict[str, Any] = {}  # module name -> the module, or None when it cannot be imported
_lock = threading.Lock()


# os.environ.get costs ~1.5 us (key encoding, a Mapping method): read on every kernel call
# (a fused Conv read it three times), it was ~5 % of a small model's run (Silero VAD).  On POSIX
# os.environ keeps its bytes mirror in ``_data``, updated by every assignment and deletion
# (monkeypatch.setenv included), so one dict lookup reads the current value.
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENV_DATA, dict):  # pragma: no cover - other platforms / interpreters
    _ENV_DATA = None


def getenv(name: str, key: bytes) -> str:
    """``os.environ.get(name, "")``, in one dict lookup where possible (``key`` = ``name``
    encoded)."""
    if _ENV_DATA is None:  # pragma: no cover
        return os.environ.get(name, "")
    v = _ENV_DATA.get(key)
    return "" if v is None else os.fsdecode(v)


_KEY_DISABLE = _ENV_DISABLE.encode()


def load_jit(name: str, what: str, on_load: Callable[[], None] | None = None):
    """The numba kernel module ``onnxpack.session.kernels.<name>``, imported on first use (never
    at ``import onnxpack`` nor at session creation); ``None`` when numba is missing, does not fit
    this numpy, or ``ONNXPACK_DISABLE_JIT=1`` (then the numpy twins compute the same).  ``what``
    names the kernels in the log line; ``on_load`` runs once after a successful import."""
    if getenv(_ENV_DISABLE, _KEY_DISABLE) == "1":
        return None
    if name in _jit_modules:
        return _jit_modules[name]
    with _lock:
        if name not in _jit_modules:
            try:
                module = importlib.import_module(f"onnxpack.session.kernels.{name}")
            except ImportError as exc:
                logger.info("%s: numba kernels unavailable (%s); using numpy", what, exc)
                module = None
            else:
                if on_load is not None:
                    on_load()
                _build_native_soon()
            _jit_modules[name] = module
    return _jit_modules[name]


def one_specialization(namespace: dict, inputs: frozenset[str] = frozenset()) -> None:
    """Makes each numba dispatcher in ``namespace`` (a JIT module's globals, at the end of the
    module) compile one specialization for argument types that differ only in whether an array is
    read-only.

    Why: numba types a read-only array (a packed weight, a mapped or user-given array) apart from
    a writable one and compiles the function again for each combination it meets — seconds per
    kernel, mid-run, and 123 specializations where 75 differ in more than that over the test
    suite.  A dispatcher here compiles read-only the array arguments whose parameter is named in
    ``inputs`` (the module's names for arrays its kernels only read) and those it has seen
    read-only (never written: numba refuses to compile a write to a read-only array); a writable
    array there runs the same code (numba itself converts writable to read-only arrays safely),
    registered for its exact types so later calls take numba's C fast path.  Every process makes
    the same choice for the named inputs, so numba's on-disk cache serves them all.  A name that
    is written after all makes numba refuse the read-only signature: the dispatcher then compiles
    exact types, as numba does.  Inlined helpers are left alone (typed inside their callers), and
    so is every dispatcher when this numba lacks what the rule needs."""
    try:
        import inspect

        from numba.core import types
        from numba.core.dispatcher import Dispatcher
    except ImportError:  # pragma: no cover - numba without its usual layout
        return
    for obj in list(namespace.values()):
        if (isinstance(obj, Dispatcher) and hasattr(obj, "_insert") and hasattr(types.Array, "copy")
                and obj.targetoptions.get("inline", "never") == "never" and "compile" not in vars(obj)):
            try:
                params = list(inspect.signature(obj.py_func).parameters)
            except (TypeError, ValueError):  # pragma: no cover
                params = []
            _one_per_writability(obj, types.Array, {i for i, name in enumerate(params) if name in inputs})


def _one_per_writability(disp: Any, array_type: type, declared: set[int]) -> None:
    compile_exact = disp.compile
    readonly = set(declared)  # argument positions compiled read-only (declared, or seen so)
    # Exact argument types registered for numba's C fast path, each once: two threads that miss
    # it together (a kernel split over onnxpack's threads, on its first call) both come here,
    # and a signature registered twice is an ambiguous match for numba's overload resolution,
    # which then sends every later call through this slow path (typeof of every argument and a
    # compile lookup: measured 130 calls a run of YOLOv8n's Winograd kernels and 104 of
    # MobileNetV2's depthwise ones at two threads, ~0.3 ms each there).
    inserted: set = set()
    insert_lock = threading.Lock()

    def compile(sig):
        if not isinstance(sig, tuple):  # an explicit signature: as numba compiles it
            return compile_exact(sig)
        readonly.update(i for i, t in enumerate(sig) if type(t) is array_type and not t.mutable)
        canonical = tuple(t.copy(readonly=True) if type(t) is array_type and t.mutable and i in readonly else t
                          for i, t in enumerate(sig))
        if canonical == sig:
            return compile_exact(sig)
        try:
            entry = compile_exact(canonical)
        except Exception as exc:  # noqa: BLE001 - e.g. a declared input that is written after all
            logger.info("numba: %s compiled for its exact argument types (%s)", disp.py_func.__qualname__,
                        type(exc).__name__)
            disp.compile = compile_exact  # from now on, as numba compiles
            return compile_exact(sig)
        with insert_lock:
            if sig not in inserted:
                disp._insert([t._code for t in sig], entry, False)
                inserted.add(sig)
        return entry

    disp.compile = compile


_native_kernels: list = []  # [the _jit_native stand-in or None] once looked up
_ENV_BUILD = "ONNXPACK_NATIVE_BUILD"


def native():
    """The JIT kernels loaded from the native code cache without numba (see
    :mod:`._jit_native`), or None: no cache for this machine yet, llvmlite missing, or
    ``ONNXPACK_DISABLE_JIT=1``."""
    if getenv(_ENV_DISABLE, _KEY_DISABLE) == "1":
        return None
    if not _native_kernels:
        with _lock:
            if not _native_kernels:
                try:
                    from onnxpack.session.kernels import _jit_native

                    kernels = _jit_native.load()
                except Exception as exc:  # noqa: BLE001 - never fatal: numba or numpy compute the same
                    logger.info("native code cache unavailable (%s); using numba", exc)
                    kernels = None
                _native_kernels.append(kernels)
    return _native_kernels[0]


_build_started = False


def _build_native_soon() -> None:
    """After numba served a kernel in this process: write the native code cache for the next
    processes, once, in a detached low-priority child process (it compiles for ~20 s of CPU;
    this process neither waits nor holds its memory).  ``ONNXPACK_NATIVE_BUILD=0`` turns it off."""
    global _build_started
    if _build_started or os.environ.get(_ENV_BUILD, "1") == "0" or _native_kernels[:1] != [None]:
        return
    _build_started = True
    try:
        from onnxpack.session.kernels import _jit_native

        _jit_native.build_in_background()
    except Exception as exc:  # noqa: BLE001 - an optimization only
        logger.info("could not start the native code cache build (%s)", exc)


def jit():
    """The conv / activation numba kernels (:mod:`._conv_jit`), or ``None`` (see :func:`load_jit`)."""
    return load_jit("_conv_jit", "conv")


_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
# Elements from which a float16 <-> float32 conversion takes the JIT's pass (below, numpy's call
# costs less than the JIT's dispatch).
HALF_JIT_MIN = 512
_half_broken = [False]  # the JIT's conversion failed here once (no F16C lowering?): numpy's from then on


def astype(x: np.ndarray, dtype) -> np.ndarray:
    """``x`` in ``dtype``: ``x`` itself when it already is, float16 <-> float32 by one vectorized
    JIT pass (:mod:`._half_jit`, the same bits as numpy's conversion, 40x to 900x faster), else
    ``x.astype(dtype)``."""
    dtype = np.dtype(dtype)
    src = x.dtype
    if src == dtype:
        return x
    if (x.size >= HALF_JIT_MIN and not _half_broken[0]
            and ((src == _F16 and dtype == _F32) or (src == _F32 and dtype == _F16))):
        mod = load_jit("_half_jit", "half-float conversion")
        if mod is not None:
            flat = np.ascontiguousarray(x).reshape(-1)
            out = np.empty(x.shape, dtype)
            try:
                if src == _F16:
                    mod.h2f(flat.view(np.uint16), out.reshape(-1))
                else:
                    mod.f2h(flat, out.reshape(-1).view(np.uint16))
                return out
            except Exception as exc:  # noqa: BLE001 - numpy's conversion computes the same
                _half_broken[0] = True
                logger.info("half-float conversion: numba kernels unavailable (%s); using numpy", exc)
    return x.astype(dtype)


def act_kernels():
    """What runs ``act_inplace(flat, codes, params)``: the native code cache's kernels when this
    machine has them (no numba in the process), else :func:`jit`'s module, else None."""
    return native() or jit()


def attn_kernels():
    """What runs ``gqa_decode`` (:mod:`._attn_jit`): the native code cache's kernels, else the
    numba module, else None."""
    return native() or load_jit("_attn_jit", "attention")


_blas_get_threads = None


def blas_threads() -> int:
    """How many threads numpy's BLAS may use now (OpenBLAS's own setting, which
    ``threadpoolctl.threadpool_limits`` and ``OPENBLAS_NUM_THREADS`` change); the CPU count when
    it cannot be read.  The JIT kernels split work over as many threads, so a user's limit holds
    for them too."""
    global _blas_get_threads
    if _blas_get_threads is None:
        _blas_get_threads = _find_blas_get_threads()
    try:
        return max(1, int(_blas_get_threads()))
    except Exception:  # pragma: no cover - exotic BLAS builds
        return os.cpu_count() or 1


_ENV_THREADS = "ONNXPACK_NUM_THREADS"
_KEY_THREADS = _ENV_THREADS.encode()


# The thread count of the runs in flight that own their threads (session/_threads.owned_threads:
# BLAS at one thread, this many for onnxpack's kernels); 0 when none does.
owned = [0]


def set_owned_threads(n: int) -> None:
    """Sets the thread count :func:`threads` answers while runs that own their threads are in
    flight (0: none is)."""
    owned[0] = max(0, int(n))


class _ThreadFlag(threading.local):
    on = False


class _FlagOn:
    """A context manager (subclasses name their ``flag``): the thread-local ``flag.on`` is True
    in this thread for the duration, then what it was (runs nest)."""

    __slots__ = ("before",)
    flag: _ThreadFlag

    def __enter__(self) -> None:
        self.before = self.flag.on
        self.flag.on = True

    def __exit__(self, *exc: Any) -> None:
        self.flag.on = self.before


try:  # numpy 2's floating-point error state: a context variable holding one C object
    from numpy._core._ufunc_config import _extobj_contextvar as _fp_state, _make_extobj

    _FP_IGNORE = _make_extobj(all="ignore")
except (ImportError, TypeError):  # pragma: no cover - numpy 1.x, or another layout
    _fp_state = None


class quiet:  # noqa: N801 - used as a context manager, like a function
    """``np.errstate(all="ignore")``: no floating-point warnings for the duration (onnxruntime
    computes IEEE arithmetic silently).  Its state made once, set and reset through numpy's
    context variable: ~0.2 us a use against ~1-1.5 us for a new ``np.errstate`` (every run enters
    one; so do small tensors' numpy formulas).  The state made at import keeps the buffer size and
    error callback numpy had then; neither changes a result."""

    __slots__ = ("token",)

    if _fp_state is not None:
        def __enter__(self) -> None:
            self.token = _fp_state.set(_FP_IGNORE)

        def __exit__(self, *exc: Any) -> None:
            _fp_state.reset(self.token)
    else:  # pragma: no cover
        def __enter__(self) -> None:
            self.token = np.errstate(all="ignore")
            self.token.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.token.__exit__(*exc)


_one = _ThreadFlag()  # this thread is inside a run of a one-thread session (see one_thread)
_deterministic = _ThreadFlag()  # ... of a deterministic session (see deterministic_run)


class one_thread(_FlagOn):  # noqa: N801 - used as a context manager, like a function
    """For the duration, :func:`threads` answers 1 in this thread: a run of a session with
    ``intra_op_num_threads = 1``.  Per thread, not process-wide as the owned count is: beside
    another session's run that owns two threads, a one-thread run read that count and split
    its kernels over both (the BLAS count, process-wide, is the smallest of the two runs')."""

    __slots__ = ()
    flag = _one


class deterministic_run(_FlagOn):  # noqa: N801 - used as a context manager, like a function
    """For the duration, this thread's kernels decide nothing by timing that changes a result: a
    run of a session with ``use_deterministic_compute``.  Every :class:`PathChoice` answers path
    0 (the packed default) untimed, and :func:`matmul` splits a GEMM by its size alone
    (``_DETERMINISTIC_SPLIT_MACS``) instead of asking its :class:`SplitTuner`.

    Why: :func:`faster_path` times two ways of computing a geometry that round differently (the
    last bits of a sum: ~3e-8 on a Conv's outputs), and with some BLAS kernels a GEMM cut into
    blocks of rows or columns sums differently from the whole product (OpenBLAS's Haswell
    kernels: up to ~1e-6 of the values; its SkylakeX kernels give the same bits), so what a
    process keeps depends on how busy the machine was when it measured: two processes, or a
    session's runs before and after a choice is measured again, may then give outputs that differ
    in the last bits.  The other kernels' splits cut their work into independent items (the same
    bits split or not) and stay tuned.  Per thread, as :class:`one_thread`: another session's run
    beside it keeps its own choices."""

    __slots__ = ()
    flag = _deterministic


def threads() -> int:
    """Threads onnxpack's own kernels use: ``ONNXPACK_NUM_THREADS`` when set, else 1 inside a
    one-thread session's run (:class:`one_thread`), else the count of the runs that own their
    threads (owned mode: see ``_threads.ModeTuner``), else the BLAS's."""
    v = getenv(_ENV_THREADS, _KEY_THREADS)
    if v:
        try:
            return max(1, int(v))
        except ValueError:
            logger.warning("%s=%r is not an integer; using the BLAS's thread count", _ENV_THREADS, v)
    if _one.on:
        return 1
    return owned[0] or blas_threads()


_jit_found: list[bool] = []


def jit_possible() -> bool:
    """Whether the numba kernels can be loaded here (numba installed, ``ONNXPACK_DISABLE_JIT``
    not ``1``), without importing numba."""
    if getenv(_ENV_DISABLE, _KEY_DISABLE) == "1":
        return False
    if not _jit_found:
        import importlib.util

        _jit_found.append(importlib.util.find_spec("numba") is not None)
    return _jit_found[0]


# GEMMs below this many multiply-adds are never split (a thread hand-off costs ~10-20 us).
_SPLIT_MACS = 1 << 21
# In a deterministic run (deterministic_run) a GEMM of at least this many multiply-adds splits, untimed;
# smaller ones run whole (MobileNetV2's 1x1 convs of 2-5 M ran 2x slower split on this VM, see matmul).
_DETERMINISTIC_SPLIT_MACS = 1 << 24
# ... counting a GEMM of fewer rows as this many: with few rows its time is reading the weight
# (MobileNetV2's classifier, 1 x 1280 x 1000: 1.3 M multiply-adds, 5 MB of weight, ~200 us on one
# thread), not its multiply-adds.
_SPLIT_MIN_ROWS = 16


def split_size(m: int, k: int, n: int, batch: int = 1) -> int:
    """The size a GEMM of ``batch`` (M, K) @ (K, N) products is held to ``_SPLIT_MACS`` by."""
    return batch * max(m, _SPLIT_MIN_ROWS) * k * n


# Row-wise JIT passes (epilogues, normalizations, softmax) over fewer elements than this run on
# one thread; from it their SplitTuner decides.
SPLIT_ELEMENTS = 1 << 16
_ROW_SPLIT_M = 256  # from this many rows of A a GEMM splits by rows (see matmul)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None,
           after: Callable[[int, int, int, int], Any] | None = None) -> np.ndarray:
    """``np.matmul(a, b)`` (2-D by 2-D, or batched 3-D), split over onnxpack's threads when the
    BLAS runs single-threaded and ``ONNXPACK_NUM_THREADS`` asks for more.

    Why: OpenBLAS splits each GEMM statically between its threads, so on a machine where another
    process holds a core every call waits for a descheduled worker (measured on the shared VM: a
    6 ms GEMM took 24 ms on 2 BLAS threads).  With the BLAS at one thread
    (``threadpoolctl.threadpool_limits(1)``) and ``ONNXPACK_NUM_THREADS=2``, each GEMM is cut into
    one block of rows or columns per thread (or blocks of the batch) taken from :func:`parallel`'s
    shared counter, and the caller computes whatever blocks no other thread took: never slower
    than one thread.  Otherwise this is ``np.matmul`` itself.

    ``after(r0, r1, c0, c1)`` (2-D operands only), when given, is the caller's epilogue: it is
    called once per computed block ``out[r0:r1, c0:c1]``, in the thread that computed the block,
    right after its GEMM (while the block is still in that core's cache), and once over the whole
    output when the GEMM is not split.  A convolution's bias and activations thus run on both
    threads instead of on one after the split GEMM.
    """
    t = threads()
    if (t <= 1 or blas_threads() > 1 or a.ndim not in (2, 3) or b.ndim not in (2, 3)
            or (after is not None and (a.ndim != 2 or b.ndim != 2))):
        return _whole(a, b, out, after)
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = max(a.shape[0] if a.ndim == 3 else 1, b.shape[0] if b.ndim == 3 else 1)
    if split_size(m, k, n, batch) < _SPLIT_MACS or a.dtype != b.dtype or a.dtype.kind != "f":
        return _whole(a, b, out, after)
    if (m == 1 or n == 1) and not ((a.ndim == 3 or b.ndim == 3) and batch >= 2 * t):
        # numpy computes a product with one row or column as a GEMV, whose sums change with the
        # block it is cut into (measured: 1 x 1280 by 1280 x 1000 in two column blocks differs
        # from the whole by up to 2e-5): such a product splits only by whole batch items.
        return _whole(a, b, out, after)
    if out is None:
        out = np.empty(((batch,) if (a.ndim == 3 or b.ndim == 3) else ()) + (m, n), dtype=np.result_type(a, b))
    # Whether a split pays is measured per shape (SplitTuner): MobileNetV2's 1x1 convs (2-5 M
    # multiply-adds) ran 2x slower split on this VM, where a sleeping thread takes ~15-40 us to wake.
    if _deterministic.on:
        # Untimed: a block's sums may round otherwise than the whole product's (see
        # deterministic_run), so the size alone decides.
        if split_size(m, k, n, batch) < _DETERMINISTIC_SPLIT_MACS:
            return _whole(a, b, out, after)
        split = _split
    else:
        split = tuner(("matmul", a.shape, b.shape, a.dtype.char, after is not None)).run
    # A block: (first item, last item + 1, rows, columns) of the output.
    if out.ndim == 3 and batch >= 2 * t:
        def block(lo, hi):
            return lo, hi, 0, m, 0, n
        count = batch
    # One block per thread: every BLAS call packs its whole share of the other operand again
    # (OpenBLAS copies both operands into its panels), so more blocks cost more copies (measured
    # on resnet50's and MobileNetV2's 1x1 convs, two threads: 4 blocks 5-40 % slower than 2, the
    # 64-column blocks taken 8 at a time up to 60 % slower).  Rows when A has many (each thread
    # packs only its rows of A: 512 x 128 by 128 x 784 0.45 ms against 0.55 by columns, 0.67 on
    # one thread), else column blocks of a multiple of 64 (a BLAS micro-panel's).
    elif m >= _ROW_SPLIT_M or n < 128 * t:
        if m < 16 * t:
            return _whole(a, b, out, after)

        def block(lo, hi):
            return 0, batch, lo * m // t, hi * m // t, 0, n
        count = t
    else:
        cuts = [i * (n // 64) // t * 64 for i in range(t)] + [n]

        def block(lo, hi):
            return 0, batch, 0, m, cuts[lo], cuts[hi]
        count = t
    tail = after is not None

    def run(lo, hi):
        b0, b1, r0, r1, c0, c1 = block(lo, hi)
        np.matmul(_items(a, b0, b1)[..., r0:r1, :], _items(b, b0, b1)[..., c0:c1],
                  out=_items(out, b0, b1)[..., r0:r1, c0:c1])
        if tail:
            after(r0, r1, c0, c1)

    # Without the GIL: GEMM jobs for a split without an epilogue, a unit job (each block's
    # product, then its epilogue in the same thread) for an epilogue that says how to run it
    # natively (``after.native``); else the split through numpy and :func:`parallel`.  (An
    # epilogue run in Python after a job brings the helper back to the GIL: measured on
    # resnet50's 1x1 convs with a residual, jobs gained nothing that way, and 3-20 % was lost
    # with every epilogue left to the caller.)  Checked only when the tuner splits (~2 us a call).
    native = None
    if after is None:
        native = lambda: _jobs_fit(a, b, out, batch) and _native_split(a, b, out, block, count, t)  # noqa: E731
    elif getattr(after, "native", None) is not None and out.ndim == 2:
        native = lambda: _jobs_fit(a, b, out, 1) and _native_epilogue_split(a, b, out, block, count, t, after.native)  # noqa: E731
    split(run, count, t, native)
    return out


def _shared(x: np.ndarray) -> bool:
    """Whether every item of a batched product reads all of operand ``x``: a 2-D one, or a batch
    of one that broadcasts."""
    return x.ndim == 2 or x.shape[0] == 1


def _items(x: np.ndarray, b0: int, b1: int) -> np.ndarray:
    """Items ``b0 .. b1`` of a batched operand (all of a :func:`_shared` one)."""
    return x if _shared(x) else x[b0:b1]


def _jobs_fit(a: np.ndarray, b: np.ndarray, out: np.ndarray, batch: int) -> bool:
    """Whether :func:`_native_split` computes ``out = a @ b`` as numpy would: float32 operands
    numpy hands to the BLAS as they are (:func:`_blasable`), shapes that agree (a job's sizes
    are not checked again, and numpy, not a job, reports a mismatch), no vector (numpy computes
    a product with one row or column as a GEMV, whose sums may round differently), an output
    that is writable and overlaps neither operand (numpy buffers such a product)."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    return (a.dtype == b.dtype == out.dtype == np.float32 and m >= 2 and n >= 2 and k >= 1 and out.flags.writeable
            and not np.may_share_memory(out, a) and not np.may_share_memory(out, b)
            and b.shape[-2] == k and out.shape[-2:] == (m, n)
            and all(x.ndim == 2 or x.shape[0] in (1, batch) for x in (a, b)) and (out.ndim == 2 or out.shape[0] == batch)
            and _blasable(a) and _blasable(b) and _blasable(out))


def _blasable(x: np.ndarray) -> bool:
    """Whether numpy hands float32 ``x`` (2-D, or 3-D batches) to the BLAS as it is: unit stride
    along rows, a row stride of at least a row.  (Elsewhere numpy's matmul runs its own loops,
    whose sums differ in rounding from the BLAS's: a split must then go through numpy too.)"""
    s = x.strides
    return s[-1] == 4 and s[-2] % 4 == 0 and s[-2] >= 4 * x.shape[-1] and (x.ndim == 2 or s[0] % 4 == 0)


def _native_split(a: np.ndarray, b: np.ndarray, out: np.ndarray, block, count: int, threads: int) -> bool:
    """:func:`matmul`'s split (float32, every operand :func:`_blasable`) over ``count`` items cut
    into ``threads`` blocks (``block(lo, hi)`` -> the block's item, row and column ranges of the
    output), the helpers' blocks posted as GEMM jobs that they compute without the GIL
    (:mod:`._spin_jit`): the caller computes its own block, then each job no helper claimed.
    False (nothing done) when there is no such path here:
    no polling helpers, no known ``cblas_sgemm`` in numpy's BLAS, or another thread's split is
    using the jobs now."""
    pool = _Pool.get()
    spin = pool.spinner()
    if spin is None or not pool.sgemm or not pool.native_lock.acquire(False):
        return False
    try:
        jobs, own, fn = pool.jobs, pool.own, pool.sgemm
        rows = min(threads - 1, jobs.shape[0])
        # Each operand's address and item stride (0: a matrix every item shares).
        where = (a.ctypes.data, b.ctypes.data, out.ctypes.data,
                 *(0 if _shared(x) else x.strides[0] for x in (a, b, out)))
        own[0, pool.fields] = _gemm_fields(fn, a, b, out, block(0, count // (rows + 1)), where)

        def fill(r: int) -> None:
            lo, hi = count * (r + 1) // (rows + 1), count * (r + 2) // (rows + 1)
            jobs[r, pool.fields] = _gemm_fields(fn, a, b, out, block(lo, hi), where)

        tokens = _post_jobs(pool, spin, rows, fill)
        spin.run_job(own, 0)
        _finish_jobs(pool, spin, tokens)
    finally:
        pool.native_lock.release()
    return True


def c_arrays(dtype, *arrays: np.ndarray) -> bool:
    """Whether every array is C-contiguous of ``dtype``: as a unit kernel reads an array from its
    address and sizes in the unit table."""
    return all(x.dtype == dtype and x.flags.c_contiguous for x in arrays)


def _native_epilogue_split(a: np.ndarray, b: np.ndarray, out: np.ndarray, block, count: int, threads: int,
                           epilogue: tuple) -> bool:
    """:func:`matmul`'s split of a 2-D float32 product (every operand :func:`_blasable`) with a
    convolution's epilogue, as a unit job of ``count`` blocks (``block(u, u + 1)``): each block's
    product by numpy's ``cblas_sgemm``, then ``epilogue`` on it, in the thread that took it
    (``_conv_jit.gemm_act_unit``).  ``epilogue``: ``(y, bias, codes, params, residual, post
    codes, post params)`` as :meth:`.conv.Conv._block_epilogue` gives them (``y`` (1, M, L): the
    output, ``out`` its (M, L) matrix).  False when there is no such path here (see
    :func:`run_units`), or ``out`` is not ``y``'s memory."""
    pool = _Pool.get()
    g = jit()
    y, bias, codes, params, res, pcodes, pparams = epilogue
    if (g is None or pool.spinner() is None or not pool.sgemm or not out.flags.c_contiguous
            or out.shape != y.shape[1:] or out.ctypes.data != y.ctypes.data):
        return False
    table = np.empty(g.GA_BLOCKS + 4 * count, np.int64)
    table[g.GA_FN:g.GA_BLOCKS] = (
        pool.sgemm, a.shape[1], a.ctypes.data, a.strides[0] // 4, b.ctypes.data, b.strides[0] // 4, y.ctypes.data,
        y.shape[1], y.shape[2], bias.ctypes.data, bias.shape[0], codes.ctypes.data, codes.shape[0], params.ctypes.data,
        res.ctypes.data if res.shape[0] else 0, pcodes.ctypes.data, pcodes.shape[0], pparams.ctypes.data)
    for u in range(count):
        _, _, r0, r1, c0, c1 = block(u, u + 1)
        table[g.GA_BLOCKS + 4 * u:g.GA_BLOCKS + 4 * u + 4] = (r0, r1, c0, c1)
    return run_units(g.GEMM_ACT_UNIT, table, count, threads)


def _gemm_fields(fn: int, a, b, out, block, where) -> tuple:
    """A GEMM job's fields (``_Pool.fields``) for one block ``(b0, b1, r0, r1, c0, c1)`` of
    ``out = a @ b`` (``where``: the operands' addresses, then their item strides)."""
    b0, b1, r0, r1, c0, c1 = block
    pa, pb, pc, sa, sb, sc = where
    la, lb, lc = a.strides[-2], b.strides[-2], out.strides[-2]
    return (0, fn, b1 - b0, r1 - r0, c1 - c0, a.shape[-1], pa + b0 * sa + r0 * la, la // 4, pb + b0 * sb + 4 * c0,
            lb // 4, pc + b0 * sc + r0 * lc + 4 * c0, lc // 4, sa, sb, sc)


def run_units(fn: int, table: np.ndarray, units: int, threads: int) -> bool:
    """Units ``0 .. units - 1`` of a native kernel computed by this thread and up to ``threads - 1``
    polling helpers, none of them holding the GIL (:mod:`._spin_jit`'s unit tables): ``fn`` is
    the address of the kernel's C entry ``void f(int64 *table, int64 unit)``, ``table`` a
    C-contiguous int64 array holding its arguments from ``_spin_jit.U_ARGS`` on (the header
    before is written here).  Every thread takes units from one counter, so a helper that starts
    late or is descheduled leaves its units to the others.  False (nothing done) when there is
    no such path here: no polling helpers, or another thread's split is using the jobs now."""
    pool = _Pool.get()
    spin = pool.spinner()
    if spin is None or not pool.native_lock.acquire(False):
        return False
    try:
        table[spin.U_NEXT], table[spin.U_FN], table[spin.U_COUNT] = 0, fn, units
        addr = table.ctypes.data
        jobs = pool.jobs

        def fill(r: int) -> None:
            jobs[r, spin.J_KIND], jobs[r, spin.J_TABLE] = spin.KIND_UNITS, addr

        tokens = _post_jobs(pool, spin, min(threads - 1, jobs.shape[0], units - 1), fill)
        spin.run_units(addr)
        _finish_jobs(pool, spin, tokens)
    finally:
        pool.native_lock.release()
    return True


def _post_jobs(pool: "_Pool", spin, rows: int, fill: Callable[[int], None]) -> list[int]:
    """Posts a job in each of the first ``rows`` helpers' rows (``fill(r)`` writes row ``r``'s
    fields first) and wakes the helpers that are not polling; returns the jobs' tokens."""
    tokens = []
    asleep = 0
    for r in range(rows):
        fill(r)
        pool.token += 1
        tokens.append(pool.token)
        if not spin.post(pool.jobs, r, pool.token):
            asleep += 1
    if asleep:  # a task on the queue wakes a helper that sleeps there; it then polls for jobs
        pool.submit(_nothing, asleep)
    return tokens


def _finish_jobs(pool: "_Pool", spin, tokens: list[int]) -> None:
    """Every posted job computed: here when no helper claimed it, else waited for."""
    for r, token in enumerate(tokens):
        if spin.claim(pool.jobs, r, token):
            spin.run_job(pool.jobs, r)
        else:
            while not spin.wait_done(pool.jobs, r, token, pool.limit):
                time.sleep(0)


def _nothing() -> None:
    return None


def _whole(a: np.ndarray, b: np.ndarray, out: np.ndarray | None, after) -> np.ndarray:
    """:func:`matmul` on this thread: ``np.matmul``, then ``after`` over the whole output."""
    y = np.matmul(a, b, out=out)
    if after is not None:
        after(0, y.shape[-2], 0, y.shape[-1])
    return y


def _blas_function(pattern: str, names: tuple[str, ...]):
    """``(library path, symbol, ctypes function)`` of the first of ``names`` exported by a library
    of numpy's wheel (``numpy.libs``) matching ``pattern`` (its OpenBLAS), or None."""
    import ctypes
    import glob

    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, pattern))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in names:
            fn = getattr(lib, sym, None)
            if fn is not None:
                return path, sym, fn
    return None


def _find_sgemm(spin, row: np.ndarray, fields: slice) -> int:
    """The address of numpy's OpenBLAS's ILP64 ``cblas_sgemm`` (the one numpy's matmul calls),
    checked on a small product against ``np.matmul`` (a job in ``row``, its ``fields`` as
    :func:`_native_split` writes them); 0 when not found or not equal."""
    import ctypes

    found = _blas_function("*openblas64*.so*", ("scipy_cblas_sgemm64_", "cblas_sgemm64_"))
    if found is None:
        return 0
    path, sym, fn = found
    addr = ctypes.cast(fn, ctypes.c_void_p).value or 0
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 5, 7), np.float32)
    b = rng.standard_normal((7, 9), np.float32)
    c = np.zeros((2, 5, 12), np.float32)[..., :9]
    row[0, fields] = (0, addr, 2, 5, 9, 7, a.ctypes.data, 7, b.ctypes.data, 9, c.ctypes.data, 12, 140, 0, 240)
    spin.run_job(row, 0)
    if np.array_equal(c, np.matmul(a, b)):
        return addr
    logger.info("thread pool: %s in %s does not compute as numpy's matmul; GEMM jobs off", sym, path)
    return 0


def _find_blas_get_threads():
    import ctypes

    found = _blas_function("*openblas*.so*", ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                                              "openblas_get_num_threads"))
    if found is not None:
        fn = found[2]
        fn.restype = ctypes.c_int
        return fn
    return lambda: os.cpu_count() or 1


def parallel(fn, count: int, threads: int) -> None:
    """``fn(start, stop)`` over ``[0, count)`` on up to ``threads`` threads (the caller's and pool
    threads; the JIT kernels release the GIL).

    Work is cut into ``2 * threads`` chunks taken from a shared counter, and the caller works
    too: when another process holds the other core and a pool thread is not scheduled, the
    caller simply takes every chunk instead of waiting for a fixed share (a static split, as
    OpenBLAS does, waits a whole scheduler slice there).  The caller waits only for chunks a pool
    thread has started.  Each chunk's Python (claiming it, calling ``fn``) takes the GIL, and a
    thread that waits for the GIL sleeps and is woken through the other vCPU (~15-40 us here):
    with ``4 * threads`` chunks a 40 us kernel took ~104 us on two threads, with ``2 * threads``
    ~48 us (a 145 us one 110 -> 108, a 575 us one 390 -> 366; one chunk per thread gained nothing
    more, and would leave the caller a whole share to redo when a helper is descheduled).

    The pool is plain threads reading one queue (:class:`_Pool`), the bookkeeping one uncontended
    lock: on this project's 2-core VM each futex wake costs ~15-40 us (the other vCPU halts when
    idle), and ``concurrent.futures``' Future and Condition objects added ~40 us to every call.
    Where the JIT is loaded (x86-64), helpers poll for the next split for a moment instead of
    sleeping and the caller polls for their results (:mod:`._spin_jit`): a 70 us kernel on two
    threads 100 -> 55 us, a 270 us one 235 -> 165 us (session 47's note); a run with BLAS on
    several threads stops the polling (:func:`stop_spinning`), a run on onnxpack's own threads
    leaves it to end on its own (see session/_runner.py).
    """
    threads = max(1, min(threads, count))
    if threads == 1:
        fn(0, count)
        return
    pool = _Pool.get()
    spin = pool.spinner()
    helpers = threads - 1
    chunks = min(count, 2 * threads)
    bounds = [count * k // chunks for k in range(chunks + 1)]
    mutex = threading.Lock()
    done = threading.Lock()
    done.acquire()
    # Chunks each helper finished, published by the helper after it let go of the GIL (spin only).
    flags = np.zeros(helpers, np.int64) if spin is not None else None
    # [next chunk, chunks claimed by helpers, chunks they finished, caller asleep on done,
    #  first error, helper slots handed out]
    state = [0, 0, 0, False, None, 0]

    def claim(helper: bool) -> int:
        with mutex:
            k = state[0]
            if k >= chunks:
                return -1
            state[0] = k + 1
            if helper:
                state[1] += 1
            return k

    def run(k: int) -> None:
        try:
            fn(bounds[k], bounds[k + 1])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            state[4] = exc

    def helper() -> tuple | None:
        k = claim(True)
        if k < 0:
            return None
        mine = 0
        while k >= 0:
            run(k)
            mine += 1
            k = claim(True)
        with mutex:
            state[2] += mine
            if state[3] and state[2] == state[1]:
                done.release()
            slot = state[5]
            state[5] += 1
        return None if flags is None else (flags, slot, mine)

    # The helpers are woken once this thread has claimed its first chunk: a helper that asks for
    # the GIL while this thread still holds it sleeps on it (a 15-40 us wake on this VM).
    pool.submit(helper, helpers, wake=spin is None)
    k = claim(False)
    if spin is not None:
        spin.bump(pool.ctl)
    while k >= 0:
        run(k)
        k = claim(False)
    with mutex:
        want = state[1]
    if want and not (spin is not None and spin.wait_sum(flags, want, pool.limit)):
        with mutex:
            wait = state[3] = state[2] < state[1]
        if wait:
            done.acquire()
    if state[4] is not None:
        raise state[4]


def stop_spinning() -> None:
    """Ends the helpers' polling (see :func:`parallel`): a session run that is not on onnxpack's
    own threads calls it when it returns (and before, with BLAS on several threads), and the
    process at exit."""
    pool = _Pool._instance
    if pool is not None and pool._spin is not None:
        pool.ctl[1] = 1


class _Pool:
    """Daemon threads that run the callables put on one queue (:func:`parallel`'s helpers).  A
    forked child starts with none (the parent's threads do not exist there): :meth:`get` makes
    new ones.

    With :mod:`._spin_jit` (numba already in the process, x86-64, the JIT not disabled) a helper
    that finished a task polls ``ctl[0]`` (bumped by every submit) for up to ``limit`` pauses
    (~250 us) before sleeping on the queue, and publishes its result in that same call, outside
    the GIL; ``ctl[1]`` set stops the polling.  Meanwhile it computes the GEMM jobs posted in its
    row of ``jobs`` (:func:`_native_split`), never returning to Python for them.
    """

    _instance: _Pool | None = None
    _pid = 0
    SPIN_US = 250.0  # how long a helper polls for the next split
    # How long a helper lets the submitter enter its own share first (the submitter wakes the
    # helpers once it has claimed its first chunk, then still holds the GIL until its kernel
    # releases it: a helper that asks before sleeps on the GIL).  Measured on a split GEMM's
    # halves, the helper started its share 43 us after the caller with 3 us, 12 us with 6, 18
    # with 10; in the models (two threads, 4 rounds, fresh processes) 10 us was 2-5 % faster than
    # 3 on resnet50, YOLOX and YOLOv8n, 6 us 1-2 %.
    DELAY_US = 10.0

    def __init__(self, size: int) -> None:
        self.size = size
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.ctl = np.zeros(2, np.int64)  # [submits, stop polling]
        self._spin: Any = None
        self._spin_tried = False
        self.limit = self.delay = 0
        # GEMM jobs (see _native_split): one row per helper, the caller's own, their guard.
        self.jobs = self.own = np.zeros((0, 0), np.int64)
        self.sgemm = 0  # address of numpy's BLAS's ILP64 cblas_sgemm, 0 when unknown
        self.native_lock = threading.Lock()
        self.token = 0
        self.fields = slice(0, 0)
        for i in range(size):
            threading.Thread(target=self._serve, args=(i,), name=f"onnxpack-jit-{i}", daemon=True).start()

    def spinner(self) -> Any:
        """:mod:`._spin_jit`, or None (helpers sleep between tasks)."""
        if self._spin is None and not self._spin_tried and "numba" in sys.modules:
            self._spin_tried = True
            if platform.machine().lower() in ("x86_64", "amd64"):
                spin = load_jit("_spin_jit", "thread pool")
                if spin is not None:
                    try:  # every entry compiled (or loaded) here, where a failure only means no polling
                        probe = np.zeros(2, np.int64)
                        rows = np.zeros((1, spin.JOB_LEN), np.int64)
                        spin.serve(probe, 0, 1, 0, probe, -1, 0, rows, 0)
                        spin.post(rows, 0, 1)
                        spin.claim(rows, 0, 1)
                        spin.wait_done(rows, 0, 1, 1)
                        table = np.zeros(spin.U_ARGS, np.int64)  # (no units)
                        spin.run_units(table.ctypes.data)
                        spin.wait_sum(probe, 0, 1)
                        spin.bump(probe)
                        spin.pauses(1000)
                        t0 = time.perf_counter()
                        spin.pauses(20000)
                        per = max((time.perf_counter() - t0) / 20000, 1e-9)  # seconds a pause
                    except Exception as exc:  # noqa: BLE001 - the helpers then sleep between tasks
                        logger.info("thread pool: no polling (%s: %s)", type(exc).__name__, exc)
                    else:
                        self.limit = max(1, int(self.SPIN_US * 1e-6 / per))
                        self.delay = int(self.DELAY_US * 1e-6 / per)
                        self.jobs = np.zeros((self.size, spin.JOB_LEN), np.int64)
                        self.own = np.zeros((1, spin.JOB_LEN), np.int64)
                        self.fields = slice(spin.J_KIND, spin.J_SC + 1)  # what _native_split writes (kind GEMM: 0)
                        self.sgemm = _find_sgemm(spin, self.own, self.fields)
                        self._spin = spin
                        # At exit, no helper left inside the JIT's code while the interpreter
                        # (and numba with it) shuts down.
                        atexit.register(stop_spinning)
        return self._spin

    def _serve(self, row: int) -> None:
        np.seterr(all="ignore")  # (this thread's context: its shares of a run are as quiet as the run)
        get, get_nowait, ctl = self.queue.get, self.queue.get_nowait, self.ctl
        pending = None  # the last task's result to publish: (flags, slot, value)
        none = np.zeros(1, np.int64)
        while True:
            seq = int(ctl[0])  # (read before the queue: a submit after it changes it)
            try:
                task = get_nowait()
            except queue.Empty:
                task = None
                spin = self._spin
                if spin is not None and not ctl[1]:
                    flags, slot, value = pending if pending is not None else (none, -1, 0)
                    pending = None
                    spin.serve(ctl, seq, self.limit, self.delay, flags, slot, value, self.jobs, row)
                    try:
                        task = get_nowait()
                    except queue.Empty:
                        task = None
            if pending is not None:  # (published under the GIL: another task came first)
                pending[0][pending[1]] = pending[2]
                pending = None
            if task is None:
                task = get()
            pending = task()

    def submit(self, task: Callable[[], Any], copies: int, wake: bool = True) -> None:
        """Queues ``copies`` of ``task``; ``wake=False``: the polling helpers see them only at
        the caller's next ``bump`` of ``ctl`` (sleeping ones take them at once)."""
        put = self.queue.put
        for _ in range(copies):
            put(task)
        if wake and self._spin is not None:
            self._spin.bump(self.ctl)

    @classmethod
    def get(cls) -> _Pool:
        pool = cls._instance
        if pool is None or cls._pid != os.getpid():
            with _lock:
                pool = cls._instance
                if pool is None or cls._pid != os.getpid():
                    pool = cls._instance = _Pool(max(1, (os.cpu_count() or 2) - 1))
                    cls._pid = os.getpid()
        return pool


class SplitTuner:
    """Whether splitting one kernel's calls over threads (:func:`parallel`) pays, decided from
    its own calls.

    Why: what a split costs depends on the machine more than on the work.  On this project's
    2-core VM a sleeping thread takes ~15-40 us to wake, and every chunk hands the GIL across
    threads: with session 46's pool a 68 us kernel took 196 us on two threads (a 1.1 ms one
    0.76 ms), and MobileNetV2's depthwise convolutions ran 2-4x slower split than on one thread
    (the polling helpers of :func:`parallel` have since cut that cost, not removed it); on bare
    metal the same split pays from tens of microseconds.  No fixed threshold in multiply-adds
    serves both.

    So each kernel geometry (one tuner) times its calls: the first is not counted (JIT loading,
    cold caches), nor any made in a session's first run (:func:`first_run`), nor owned-mode
    calls while OpenBLAS's workers may still poll after a BLAS-mode run (``_blas_polling``), then calls
    alternate between the split and one thread until each has ``TRIALS`` samples, and the lower
    median wins.  Every ``RECHECK`` calls after that it measures again (the same way): six calls
    taken while the other core was busy, or while the machine was still warming up, would
    otherwise decide for as long as the process lives.  A new thread count measures at once.
    ``RECHECK`` is 128 (was 512): on an AMD Zen 5 VM, session 57, the orientation classifier's
    depthwise convs on two threads measured their split in a slow moment of some processes
    (one thread 155 us, split 183, where other processes measured 113 and 77) and ran unsplit
    for the next 512 calls (the model 4.9 ms a run against 3.6); three processes each, the
    medians 3.4-4.9 ms at 512 against 3.3-4.9 at 128 (YOLOv8n 10.8-11.3 against 10.2-10.5,
    MobileNetV2 4.1-4.7 against 4.1-4.3), on a noisy host.  Measuring again costs three calls
    of the slower way per RECHECK.
    Splitting changes no result (the kernels split their work by independent items), only its
    time, except :func:`matmul`'s blocks of a GEMM, whose sums some BLAS kernels round otherwise
    than the whole product's (see :class:`deterministic_run`, which decides them by size).
    Concurrent runs may both record a sample: harmless.

    The two thread modes of a run (BLAS on the session's threads, or BLAS on one and onnxpack's
    kernels on them: see ``session._threads``) measure and decide apart: what a split costs
    depends on whether OpenBLAS's own workers are polling the other core, and a session may try
    both modes (``session._threads.ModeTuner``).
    """

    TRIALS = 3
    RECHECK = 128
    __slots__ = ("modes",)

    def __init__(self) -> None:
        self.modes = (_SplitChoice(), _SplitChoice())  # [0]: BLAS mode, [1]: owned mode

    def run(self, fn: Callable[[int, int], Any], count: int, threads: int,
            native: Callable[[], bool] | None = None) -> None:
        """``fn(start, stop)`` over ``[0, count)``: split over ``threads`` or on this thread.
        ``native()``, when given, is the split's own way (GEMM jobs: see :func:`matmul`); when
        it returns False the split goes through :func:`parallel` as without it."""
        self.modes[1 if owned[0] else 0].run(fn, count, threads, native)

    def current(self) -> _SplitChoice:
        """The measurements and choice of the thread mode now in force."""
        return self.modes[1 if owned[0] else 0]

    # The current mode's state (tests, logs); setting ``threads`` or ``choice`` sets both modes'
    # (a test forcing a split whichever mode its run takes).
    def _both(name: str) -> property:
        def put(self, value) -> None:
            for m in self.modes:
                setattr(m, name, value)

        return property(lambda self: getattr(self.current(), name), put)

    threads = _both("threads")
    choice = _both("choice")
    one = property(lambda self: self.current().one)
    split = property(lambda self: self.current().split)
    del _both


def _split(fn, count: int, threads: int, native: Callable[[], bool] | None) -> None:
    if native is None or not native():
        parallel(fn, count, threads)


class _SplitChoice:
    """One thread mode's measurements and choice for a :class:`SplitTuner` (its ``TRIALS`` and
    ``RECHECK``)."""

    __slots__ = ("threads", "one", "split", "choice", "started", "calls")

    def __init__(self) -> None:
        self.threads = 0
        self.one: list[float] = []
        self.split: list[float] = []
        self.choice: bool | None = None  # True: split; False: one thread; None: still measuring
        self.started = False
        self.calls = 0  # calls since the choice was made

    def run(self, fn: Callable[[int, int], Any], count: int, threads: int,
            native: Callable[[], bool] | None = None) -> None:
        """``fn(start, stop)`` over ``[0, count)``: split over ``threads`` or on this thread
        (see :meth:`SplitTuner.run`)."""
        threads = max(1, min(threads, count))
        if threads == 1:
            fn(0, count)
            return
        if threads != self.threads:  # a new thread count: measure again
            self.threads, self.one, self.split, self.choice, self.started = threads, [], [], None, False
        choice = self.choice
        if choice is not None:
            self.calls += 1
            if self.calls >= SplitTuner.RECHECK:  # measure again from the next call
                self.one, self.split, self.choice = [], [], None
            if choice:
                _split(fn, count, threads, native)
            else:
                fn(0, count)
            return
        if not self.started or _first_runs[0] or (owned[0] and time.perf_counter() < _blas_polling[0]):
            self.started = True  # (not counted)
            _split(fn, count, threads, native)
            return
        use_split = len(self.split) <= len(self.one)
        t0 = time.perf_counter()
        if use_split:
            _split(fn, count, threads, native)
        else:
            fn(0, count)
        (self.split if use_split else self.one).append(time.perf_counter() - t0)
        if len(self.one) >= SplitTuner.TRIALS and len(self.split) >= SplitTuner.TRIALS:
            self.choice = statistics.median(self.split) < statistics.median(self.one)
            self.calls = 0


# Until when (time.perf_counter) OpenBLAS's workers may still be polling a core after the last
# run with BLAS on several threads (:func:`blas_run_ended`): a split measured then in owned mode
# (BLAS on one thread, onnxpack's kernels split) competes with them for the other core.  Measured:
# the wake-word CNN on two threads starts in BLAS mode, and its owned-mode tuners, sampling in
# the first runs after the switch, once kept every conv_shift on one thread (18.2 ms a run
# against 13-14 with its splits; 1.73x onnxruntime's time against 1.37-1.53x in three other runs).
_blas_polling = [0.0]
BLAS_POLL_S = 0.12  # OpenBLAS's workers poll ~0.1 s after a call (measured: 100 ms of CPU time)


def blas_run_ended() -> None:
    """A session run with BLAS on several threads has returned (see ``_blas_polling``)."""
    _blas_polling[0] = time.perf_counter() + BLAS_POLL_S


# Session runs in flight that are their session's first (:func:`first_run`).  Such a run reads every
# weight for the first time: each page of the model's mapping faults on first touch, in every
# thread that reads it, so a split measured there looks slower than it is.  Measured on BERT-base
# (two threads): its tuners sampled in the first run kept the 768 x 768 GEMMs on one thread (split
# ~1.5 ms against ~1.1 ms; 0.75 ms once the pages are mapped), 119 -> 141 ms a run.
_first_runs = [0]


def _after_fork_in_child() -> None:
    """A forked child runs none of its parent's runs: a fresh lock (a thread of the parent may
    have held it at the fork, and would never release it here), no first run in flight."""
    global _lock
    _lock = threading.Lock()
    _first_runs[0] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def first_run():
    """While this context is open, :class:`SplitTuner` takes no sample (every call splits, as its
    first, uncounted call does): a session's first run."""
    with _lock:
        _first_runs[0] += 1
    try:
        yield
    finally:
        with _lock:
            _first_runs[0] -= 1


# Which of two paths of a kernel geometry runs (faster_path): geometry key -> 0 or 1.
_PATHS: OrderedDict[Hashable, int] = OrderedDict()
PATH_TRIALS = 2
PATH_MARGIN = 0.9  # the second path is taken only if at most this much of the first's time
# A call site's choice is timed again, once per key, this many calls of its geometry in one
# thread mode after its first timing (see PathChoice), and the second timing stands.
PATH_CONFIRM_AT = 6
_CONFIRMED: set = set()  # keys whose choice was timed again (bounded with _PATHS)


def path_mode() -> tuple[int, bool]:
    """The thread mode a path choice holds for: :func:`threads`, and whether runs own their
    threads (BLAS on one thread) or share them with OpenBLAS's workers.  Which path is faster
    differs between the two (a GEMM-based path splits through BLAS in one and onnxpack's own
    jobs in the other, and OpenBLAS's polling workers slow the JIT kernels beside them)."""
    n = threads()
    return n, n > 1 and owned[0] != 0


class PathChoice:
    """One call site's choice between two paths for one geometry (:func:`faster_path`), per
    thread mode (:func:`path_mode`).

    Why per mode and timed twice: the first call of a geometry comes in a session's first run,
    when the pool's threads start, the JIT warms up and the split tuners still measure: on two
    threads YOLOv8n's 26 conv geometries chose differently in 8-13 of them from one process to
    the next (the model 9.5 to 15.9 ms a run; more trials at the first call did not steady it).
    Timed again ``PATH_CONFIRM_AT`` calls later (once per key and process) four of five
    processes ran 9.5-9.9 ms; but a choice timed again inside the thread-mode tuner's BLAS block
    and then kept in owned mode moved resnet50's convs to the general path (1.42x onnxruntime's
    time against 1.23-1.26): each mode now times and keeps its own."""

    __slots__ = ("modes",)

    def __init__(self) -> None:
        # path_mode() -> [path, calls until it is timed again (-1: never again)]
        self.modes: dict[tuple[int, bool], list[int]] = {}

    def settled(self) -> int | None:
        """The path of this call in the mode now in force, or None: it is to be timed (the
        geometry's first call in this mode, or its confirming one): :meth:`Conv._path`.  Path 0,
        untimed, inside a deterministic run (:class:`deterministic_run`)."""
        if _deterministic.on:
            return 0
        got = self.modes.get(path_mode())
        if got is None:
            return None
        left = got[1]
        if left > 0:
            got[1] = left - 1
        elif left == 0:
            return None
        return got[0]

    def takes(self, path: int) -> bool:
        """Whether some mode runs ``path``."""
        return any(v[0] == path for v in self.modes.values())


def faster_path(key: Hashable, first: Callable[[], Any], second: Callable[[], Any],
                prior: int | None = None, confirm: bool = False) -> tuple[int, Any]:
    """Which of two ways of computing a kernel's call (the same result up to rounding) runs for
    the geometry named by ``key``, decided once per process by timing both on the first call:
    returns (0 or 1, that path's result of this call, or None when the choice was made before:
    the caller then runs it).

    Why: which one is faster is the machine's.  Winograd F(2x2, 3x3) against the direct
    convolution (conv_shift) on YOLOv8n's 3x3 convs, one thread: on a Sapphire Rapids core
    Winograd ran them up to 1.2x faster, on an AMD Zen 5 core (session 57) 1.4-2.6x slower (64 ->
    64 on 40x40 845 vs 592 us; 128 -> 128 on 10x10 344 vs 210), resnet50's at parity.

    How: each path once, not timed (its plan, its JIT, its weight's pages, its scratch), then
    both alternately ``PATH_TRIALS`` times; the second is chosen only when its best time is under
    ``PATH_MARGIN`` of the first's (near parity the first, the packed default, keeps a choice
    that the machine's noise would flip from one process to the next).  The choice is per
    process and key, not per session: every session of the model computes the same bits, cold
    or warm, in one thread mode once the key is confirmed (the call sites put the thread mode in
    the key: :class:`PathChoice`; the modes already differ in a GEMM split's rounding).  The
    paths must not write into memory that the other reads (their caller's output buffer
    included).

    ``prior``: the caller's choice for a geometry not decided yet, taken without measuring and
    kept for the key (a kernel whose first geometries all chose one path, fed ever new input
    shapes: a detector on images of every size would otherwise pay the measuring per size).

    ``confirm``: the call site's confirming call (:class:`PathChoice`): the two paths are timed
    again, once per key and process, and that choice stands."""
    with _lock:
        choice = _PATHS.get(key)
        if choice is None and prior is not None:
            choice = _PATHS[key] = prior
        if confirm and key in _CONFIRMED:
            confirm = False  # (another call site timed it again already)
    if choice is not None and not confirm:
        return choice, None
    first()
    second()
    best = [math.inf, math.inf]
    got = [None, None]
    for _ in range(PATH_TRIALS):
        for which, fn in enumerate((first, second)):
            t0 = time.perf_counter()
            got[which] = fn()
            best[which] = min(best[which], time.perf_counter() - t0)
    choice = 1 if best[1] < PATH_MARGIN * best[0] else 0
    logger.debug("path %s of %r: %.3g s against %.3g s", choice, key, best[choice], best[1 - choice])
    with _lock:
        _PATHS[key] = choice
        if confirm:
            _CONFIRMED.add(key)
        while len(_PATHS) > _MAX_TUNERS:
            _CONFIRMED.discard(_PATHS.popitem(last=False)[0])
    return choice, got[choice]


_TUNERS: OrderedDict[Hashable, SplitTuner] = OrderedDict()
_MAX_TUNERS = 4096


def tuner(key: Hashable) -> SplitTuner:
    """The :class:`SplitTuner` of a kernel geometry named by ``key`` (kept for the most recent
    ``_MAX_TUNERS`` keys), for kernels that have no plan object to hold one."""
    with _lock:
        t = _TUNERS.get(key)
        if t is None:
            t = _TUNERS[key] = SplitTuner()
            while len(_TUNERS) > _MAX_TUNERS:
                _TUNERS.popitem(last=False)
        return t


@fast_init
@dataclasses.dataclass(frozen=True)
class Activation:
    """``kind`` with parameters: clip ``[a, b]``; hardswish/hardsigmoid ``a*x + b``; leakyrelu
    slope ``a``; affine ``a*x + b``; fastgelu: onnxruntime's FastGelu (tanh GELU); quickgelu
    ``x * sigmoid(a * x)`` (onnxruntime's QuickGelu); fakequant (a QuantizeLinear -> DequantizeLinear pair of one
    per-tensor scale ``a``): ``clamp(rint(x / a), b, c) * a`` with ``[b, c]`` the integer range
    shifted by the zero point (NaN goes to ``b``, ``-0`` to ``+0``: the pair's bits); channel:
    ``x * A[m] + B[m]`` per channel ``m`` of a Conv's output, ``(A, B)`` the kernel's table
    ``int(a)`` (:func:`apply_channels`; only a Conv epilogue carries it)."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    c: float = 0.0

    @property
    def code(self) -> int:
        return CODES[self.kind]

    def params(self, dtype) -> tuple[int, np.floating, np.floating, np.floating]:
        t = np.dtype(dtype).type
        return self.code, t(self.a), t(self.b), t(self.c)


NONE = Activation("none")


def apply_numpy(y: np.ndarray, act: Activation) -> np.ndarray:
    """``act`` over ``y`` in place with numpy (``y`` a fresh, writable float array).

    Floating-point warnings are silenced (``exp`` overflows where sigmoid is 0, ``-inf * 0`` is
    NaN as in the op-by-op graph): onnxruntime never warns.
    """
    with np.errstate(all="ignore"):
        return _apply_numpy(y, act)


def _apply_numpy(y: np.ndarray, act: Activation) -> np.ndarray:
    kind = act.kind
    t = y.dtype.type
    if kind == "none":
        return y
    if kind == "relu":
        np.maximum(y, 0, out=y)
    elif kind == "clip":
        np.maximum(y, t(act.a), out=y)
        np.minimum(y, t(act.b), out=y)
    elif kind in ("hardswish", "hardsigmoid"):
        s = y * t(act.a)
        s += t(act.b)
        np.clip(s, 0, 1, out=s)
        if kind == "hardswish":
            y *= s
        else:
            y[...] = s
    elif kind in ("silu", "sigmoid"):
        s = np.negative(y)
        with np.errstate(over="ignore"):
            np.exp(s, out=s)
        s += 1
        if kind == "silu":
            y /= s
        else:
            np.reciprocal(s, out=y)
    elif kind == "leakyrelu":
        np.multiply(y, t(act.a), out=y, where=y < 0)
    elif kind == "affine":
        y *= t(act.a)
        y += t(act.b)
    elif kind == "gelu":
        from onnxpack.session.kernels.contrib_activation import gelu_inplace

        gelu_inplace(y, half_last=act.a == 1.0)
    elif kind == "fastgelu":
        from onnxpack.session.kernels.contrib_activation import tanh_gelu_inplace

        tanh_gelu_inplace(y)
    elif kind == "quickgelu":
        from onnxpack.session.kernels.contrib_activation import quick_gelu_inplace

        quick_gelu_inplace(y, act.a)
    elif kind == "fakequant":  # FakeQuant's numpy arithmetic (qdq.py), in place
        s = t(act.a)
        np.divide(y, s, out=y)
        np.rint(y, out=y)
        np.fmax(y, t(act.b), out=y)
        np.fmin(y, t(act.c), out=y)
        y *= s
        y += t(0.0)
    else:
        raise RuntimeError(f"Bug: unknown activation {kind!r}")
    return y


_encoded: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

# The JIT epilogues' (``_conv_jit.bias_act`` and the kernels sharing its arguments) "none":
# no residual (N, M, L) and no per-channel tables (K, M, 2).
NO_RESIDUAL = np.zeros((0, 0, 0), np.float32)
NO_CHANNELS = np.zeros((0, 0, 2), np.float32)


_KEEPS = frozenset({"relu", "clip"})  # kinds whose JIT loop keeps some elements as they are


def encode(acts, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``(codes int64 (k,), params (k, 3))`` of a sequence of activations, for the JIT kernels.

    Made once per chain and dtype (a kernel's chain is fixed: two small arrays per call cost
    ~3 us each in every fused Conv/MatMul step); the arrays are shared, and nothing writes them.
    """
    key = (tuple(acts), np.dtype(dtype).char)
    got = _encoded.get(key)
    if got is None:
        codes = np.array([a.code for a in acts], dtype=np.int64)
        # Relu's and Clip's third parameter is the 0.0 _act_row subtracts from the values it
        # keeps (so LLVM stores every element: see its docstring).
        params = np.array([[a.a, a.b, 0.0 if a.kind in _KEEPS else a.c] for a in acts], dtype=dtype).reshape(len(acts), 3)
        got = (codes, params)
        if len(_encoded) < 4096:  # bounded (a NaN parameter never finds its own entry)
            got = _encoded.setdefault(key, got)
    return got


# Activations numpy computes in place at memory speed (one ufunc pass, no temporary): an
# epilogue of only these (and a bias or residual add) never loads the JIT, whose import and LLVM
# cost ~36 MB of private memory in every process (measured: PSS of 4 processes serving an MLP
# 1.62x one process with the JIT loaded for its Relu epilogue, 1.25x without).
_NUMPY_SPEED = frozenset({"none", "relu", "clip"})


def numpy_suffices(*chains) -> bool:
    """Whether every activation in ``chains`` (sequences of Activation) is one numpy does as
    fast as the JIT (:data:`_NUMPY_SPEED`)."""
    return all(a.kind in _NUMPY_SPEED for chain in chains for a in chain)


def apply_channels(y: np.ndarray, acts, channels) -> np.ndarray:
    """:func:`apply` with per-channel steps: an ``Activation("channel", k)`` is
    ``y * channels[k][0] + channels[k][1]`` along axis 1 (a product, then a sum: two roundings,
    as BatchNormalization's numpy computes it), the others as :func:`apply` runs them."""
    run: list[Activation] = []
    for act in acts:
        if act.kind != "channel":
            run.append(act)
            continue
        apply(y, run)
        run = []
        a, b = channels[int(act.a)]
        shape = (1, a.shape[0]) + (1,) * (y.ndim - 2)
        y *= a.astype(y.dtype, copy=False).reshape(shape)
        y += b.astype(y.dtype, copy=False).reshape(shape)
    return apply(y, run)


def apply(y: np.ndarray, acts) -> np.ndarray:
    """The activations ``acts`` (in order) over ``y`` in place (the JIT kernel for C-contiguous
    float32 -- from the native code cache when this machine has it, so numba is not imported --
    else numpy); returns ``y``."""
    acts = [a for a in acts if a.kind != "none"]
    if not acts:
        return y
    j = act_kernels() if y.dtype == np.float32 and y.flags.c_contiguous and y.size >= 1 and not numpy_suffices(acts) else None
    if j is None:
        for a in acts:
            apply_numpy(y, a)
        return y
    codes, params = encode(acts)
    j.act_inplace(y.reshape(-1), codes, params)
    return y
