"""JIT kernels through the native code cache (:mod:`._native`): no numba in the process.

:func:`load` returns a stand-in for the ``_nbits_jit`` module — the same ``gemv4`` / ``gemv4_serial``
/ ``gemv8`` / ``gemv8_serial`` (and their int8-activation ``_i8`` twins where the cache has them) /
``dequant4`` / ``dequant8`` calls on the same arrays — plus
``act_inplace`` and ``rms_rows`` of ``_conv_jit`` (elementwise activations, RMS normalization)
and ``gqa_decode`` of ``_attn_jit``.  Its functions fill an int64
argument block (the layouts below, read by the entries that ``_nbits_jit.native_entries`` and
``_conv_jit.native_entries`` compile) and call the cached object code through ctypes, so the
process never imports numba.  A weight layout the cache has no entry for (float zero points)
is handed to the numba module, imported then.  :func:`build` writes the cache from a process
that has numba.

This module imports neither numba nor llvmlite at import time.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxpack.session.kernels import _act, _native
from onnxpack.session.kernels._base import scratch_releaser

if TYPE_CHECKING:
    import subprocess

__all__ = ["load", "build", "MODULE"]

MODULE = "jit"
CHUNK = 128  # columns per work item (``_nbits_jit.CHUNK``; checked by :func:`build`)

# GEMV argument block: int64 slots (``G_ZMID`` holds a float64), then two loop slots per thread.
# ``G_NEXT``: the address of a second GEMV's block for the ``_pair`` worker (two GEMVs of one A).
(G_A, G_M, G_K, G_BQ, G_BQ_LEN, G_SC, G_SC_LEN, G_ZQ, G_ZQ_LEN, G_ZMODE, G_ZMID, G_Y, G_N, G_NB, G_BLOB,
 G_TILE, G_ADE, G_ASUM, G_SCRATCH, G_CHUNK, G_NEXT) = range(21)
G_HEADER = 21
# Dequantization argument block.
(D_BQ, D_BQ_LEN, D_SC, D_SC_LEN, D_ZQ, D_ZQ_LEN, D_ZMODE, D_ZMID, D_OUT, D_ROWS, D_COLS, D_N, D_NB, D_BLOB,
 D_TILE, D_T0, D_T1) = range(17)
D_HEADER = 17
# RMS normalization argument block (``_conv_jit.native_entries``' ``rms_f32``): rows, D, then
# x, skip, skip rows, bias, bias length, gamma, y, total, total rows, inv; eps a float64.
RMS_SLOTS = 13
_RMS_PACK = struct.Struct("<12qd")
# One GroupQueryAttention decoding step (``_attn_jit.native_entries``' ``gqa_f32``): int64 slots,
# then scale and softcap as float64.
(Q_N, Q_NKV, Q_H, Q_CAP, Q_HALF, Q_POS, Q_LO, Q_Q, Q_K, Q_V, Q_PK, Q_PV, Q_COS, Q_SIN, Q_OUT, Q_QR, Q_SCORES,
 Q_SCORES_LEN, Q_INTERLEAVED, Q_SCALE, Q_SOFTCAP) = range(21)
Q_SLOTS = 21
_Q_PACK = struct.Struct("<19q2d")
# The integer MatMuls' int8 GEMM (``_qgemm_jit.native_entries``): A (uint8 (M, KP)), the lanes
# (int8, their length), out (int32 (M, N)), groups of 4 k; then two loop slots per thread.
(QG_A, QG_M, QG_KP, QG_W, QG_WLEN, QG_OUT, QG_N, QG_GROUPS, QG_SIGNS) = range(9)
QG_SLOTS = 9
_QG_PACK = struct.Struct("<9q")

_SCALES = {np.dtype(np.float32): "f32", np.dtype(np.uint16): "u16"}
_local = threading.local()
_EMPTY_U8 = np.zeros(1, np.uint8)


def _sources() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return [os.path.join(here, f"{name}.py")
            for name in ("_nbits_jit", "_conv_jit", "_attn_jit", "_qgemm_jit", "_erf", "_jit_native")]


# The GEMV block's header as packed by struct (slot G_ZMID is a float64); the dequantization's.
_G_PACK = struct.Struct("<" + "".join("d" if i == G_ZMID else "q" for i in range(G_HEADER)))
_D_PACK = struct.Struct("<" + "".join("d" if i == D_ZMID else "q" for i in range(D_HEADER)))
_SLOTS = 64  # loop slots of the per-thread block: up to this many OpenMP threads


def _data_offset() -> int | None:
    """Where an ndarray object keeps its data pointer, counted from the object's address: right
    after the object header in numpy's ``PyArrayObject`` (16 bytes on a 64-bit CPython build;
    checked here on arrays of several kinds, else None and :func:`_addr` asks numpy)."""
    off = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # ob_refcnt, ob_type
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    samples = (base, base[1:, 2:], np.zeros(0, np.uint8), np.frombuffer(bytes(16), np.uint8), base.T)
    try:
        for a in samples:
            if ctypes.c_void_p.from_address(id(a) + off).value != a.__array_interface__["data"][0]:
                return None
    except Exception:  # pragma: no cover - an interpreter whose objects are laid out otherwise
        return None
    return off


_DATA_OFFSET = _data_offset()
_read_pointer = ctypes.c_void_p.from_address


def _addr(a: np.ndarray) -> int:
    """The data address of ``a`` (an ndarray the caller holds for the call): read from the array
    object (~0.5 us; ``__array_interface__`` costs ~2 us and a kernel call passes up to a dozen
    addresses), or through numpy where the layout check failed."""
    if _DATA_OFFSET is not None and a.__class__ is np.ndarray:
        return _read_pointer(id(a) + _DATA_OFFSET).value or 0
    return a.__array_interface__["data"][0]


_MAX_PLANS = 1024  # GEMV plans kept per thread


class _GemvPlan:
    """One GEMV's argument block, filled once and kept (in the thread's scratch, per weight,
    shape and thread count) for the next call with the same arguments: a call then writes only
    the activations' and the output's addresses (measured on a Qwen2.5-0.5B decoding step, ~100
    GEMVs, filling the block cost ~10 us per call).

    It keeps weak references to the weight's arrays (a closed session's weights are not held
    alive; an id that a new array reuses is not mistaken for the old one) and the scratch
    arrays it addresses, still the thread's own (:func:`_scratch` replaces a buffer that is
    too small, and releasing the scratch drops every plan with it)."""

    __slots__ = ("block", "address", "threads", "main", "prep", "omp", "pair", "refs", "names", "scratch")

    def __init__(self, lib: _native.Native, name: str, threads: int, arrays: tuple, names: tuple,
                 scratch: tuple) -> None:
        self.block = (ctypes.c_int64 * (G_HEADER + 2 * _SLOTS))()
        self.address = ctypes.addressof(self.block)
        self.threads = threads
        self.main = lib.entry(name)
        self.prep = lib.entry(name + "_prep") if threads > 1 else None
        self.omp = lib.parallel_entry(name + "_omp") if threads > 1 else None
        pair = name + "_pair"
        self.pair = lib.parallel_entry(pair) if threads > 1 and pair in lib.addresses else None
        self.refs = tuple(weakref.ref(x) for x in arrays)
        self.names = names
        self.scratch = scratch

    def holds(self, *arrays: np.ndarray) -> bool:
        """Whether the plan is for these very arrays and its scratch is still the thread's."""
        for ref, x in zip(self.refs, arrays):
            if ref() is not x:
                return False
        local = _local.__dict__
        for name, buf in zip(self.names, self.scratch):
            if local.get(name) is not buf:
                return False
        return True

    def __call__(self, a: np.ndarray, y: np.ndarray) -> None:
        block = self.block
        block[G_A] = _addr(a)
        block[G_Y] = _addr(y)
        if self.prep is not None:
            self.prep(self.address)  # no barrier in the team: A is ready first
            self.omp(self.address, self.threads)
        else:
            self.main(self.address)


def _block() -> tuple[Any, int]:
    """This thread's argument block (ctypes int64 array) and its address."""
    blk = getattr(_local, "block", None)
    if blk is None:
        buf = (ctypes.c_int64 * (G_HEADER + 2 * _SLOTS))()
        blk = _local.block = (buf, ctypes.addressof(buf))
    return blk


@scratch_releaser
def _drop_scratch() -> None:
    block = getattr(_local, "block", None)
    _local.__dict__.clear()
    if block is not None:
        _local.block = block


def _scratch(name: str, count: int, dtype) -> np.ndarray:
    """A per-thread buffer of at least ``count`` elements, reused across calls."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < count:
        buf = np.empty(max(count, 1), dtype)
        setattr(_local, name, buf)
    return buf


class _Kernels:
    """The stand-in for ``_nbits_jit`` (see the module docstring)."""

    native = True
    CHUNK = CHUNK
    address = staticmethod(_addr)  # an array's data address, for callers of the ``*_at`` entries

    def __init__(self, lib: _native.Native) -> None:
        self._lib = lib
        self._numba = None

    # numba's kernels, for layouts the cache has no entry for
    def _fallback(self):
        if self._numba is None:
            from onnxpack.session.kernels import _nbits_jit

            self._numba = _nbits_jit
        return self._numba

    @staticmethod
    def threads() -> int:
        return _act.threads()

    @property
    def used_openmp(self) -> bool:
        return self._lib.used_openmp

    def _key(self, bits: int, sc: np.ndarray, zq: np.ndarray, zmode: int) -> str | None:
        sck = _SCALES.get(sc.dtype)
        if sck is None or (zmode and zq.dtype != np.uint8):
            return None
        return f"{bits}_{sck}"

    @property
    def int8_dot(self) -> bool:
        """Whether the cache has the int8-activation GEMVs (built on a CPU with AVX-512 VNNI or AVX2)."""
        return "gemv4_f32_i8" in self._lib.addresses

    def gemv_plan(self, bits, parallel, a, bq, sc, zq, zmode, zmid, n, nb, blob, tile, threads, i8=""):
        """The plan of the GEMV that ``gemv{bits}{i8}[_serial]`` runs on these arguments — call it
        as ``plan(a, y)`` with any ``a`` of this one's shape — or None when the cache has no entry
        for the layout (numba's kernel computes it).  Plans are kept per thread; a caller may
        keep one too while ``plan.holds(bq, sc)`` (the thread's scratch may be replaced)."""
        m, k = a.shape
        threads = min(max(1, int(threads)), _SLOTS) if parallel else 1
        if not zmode or zq.size == 0:
            zq = _EMPTY_U8
        plans = _local.__dict__.get("plans")
        if plans is None:
            plans = _local.plans = {}
        key = (id(bq), id(sc), id(zq), m, k, threads, bits, i8, zmode, zmid, n, nb, blob, tile)
        plan = plans.get(key)
        if plan is None or not plan.holds(bq, sc, zq):
            plan = self._gemv_plan(bits, a, bq, sc, zq, zmode, zmid, n, nb, blob, tile, threads, i8)
            if plan is None:
                return None
            if len(plans) >= _MAX_PLANS:  # weights of closed sessions: start again
                plans.clear()
            plans[key] = plan
        return plan

    @staticmethod
    def pairs(first: _GemvPlan, second: _GemvPlan) -> bool:
        """Whether :meth:`gemv_pair` runs these two plans together: both parallel int8 GEMVs on
        the same thread count, of activations laid out alike (the same scratch for A)."""
        return (first.pair is not None and second.pair is not None and first.threads == second.threads
                and first.block[G_M] == second.block[G_M] and first.block[G_K] == second.block[G_K]
                and first.block[G_NB] == second.block[G_NB] and first.block[G_BLOB] == second.block[G_BLOB]
                and first.block[G_ADE] == second.block[G_ADE] and first.block[G_ASUM] == second.block[G_ASUM])

    @staticmethod
    def gemv_pair(first: _GemvPlan, second: _GemvPlan, a: np.ndarray, y1: np.ndarray, y2: np.ndarray) -> None:
        """``first(a, y1)`` and ``second(a, y2)`` in one OpenMP region (plans for which
        :meth:`pairs` holds): A is quantized once, the team takes the work items of both."""
        block, other = first.block, second.block
        block[G_A] = other[G_A] = _addr(a)
        block[G_Y] = _addr(y1)
        other[G_Y] = _addr(y2)
        block[G_NEXT] = second.address
        first.prep(first.address)
        first.pair(first.address, first.threads)

    def _gemv(self, bits, parallel, a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads, i8=""):
        plan = self.gemv_plan(bits, parallel, a, bq, sc, zq, zmode, zmid, n, nb, blob, tile, threads, i8)
        if plan is None:
            name = f"gemv{bits}{i8}" + ("" if parallel else "_serial")
            return getattr(self._fallback(), name)(a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads)
        plan(a, y)

    def _gemv_plan(self, bits, a, bq, sc, zq, zmode, zmid, n, nb, blob, tile, threads, i8) -> _GemvPlan | None:
        key = self._key(bits, sc, zq, zmode)
        if key is None:
            return None
        key += i8
        m, k = a.shape
        if i8:  # int8 activations (m, nb, block_size), then scales and sums (2, m, nb)
            names = (("aq", m * nb * blob * 8 // bits, np.int8), ("asc", 2 * m * nb, np.float32))
        else:
            names = (("ade", m * nb * (8 // bits) * blob, np.float32), ("asum", m * nb, np.float32))
        names += (("work", threads * 2 * m * CHUNK, np.float32),)
        scratch = tuple(_scratch(*spec) for spec in names)
        ade, asum, work = scratch
        # Work items (CHUNK columns) taken a few at a time: each thread then streams runs of
        # neighbouring columns, and about 4 grabs per thread still even out a slow thread.
        # (One item per grab ran ~10 % faster in a loop of GEMVs alone but 2-5 % slower inside a
        # decoding step, tokens alternating between the two in one process: AVX2, Qwen2.5-0.5B.)
        chunk = max(1, -(-n // CHUNK) // (4 * threads))
        plan = _GemvPlan(self._lib, f"gemv{key}", threads, (bq, sc, zq), tuple(s[0] for s in names), scratch)
        _G_PACK.pack_into(plan.block, 0, 0, m, k, _addr(bq), bq.size, _addr(sc), sc.size, _addr(zq), zq.size,
                          zmode, float(zmid), 0, n, nb, blob, tile, _addr(ade), _addr(asum), _addr(work), chunk, 0)
        return plan

    def gemv4(self, *args):
        self._gemv(4, True, *args)

    def gemv4_serial(self, *args):
        self._gemv(4, False, *args)

    def gemv8(self, *args):
        self._gemv(8, True, *args)

    def gemv8_serial(self, *args):
        self._gemv(8, False, *args)

    def gemv4_i8(self, *args):
        self._gemv(4, True, *args, i8="_i8")

    def gemv4_i8_serial(self, *args):
        self._gemv(4, False, *args, i8="_i8")

    def gemv8_i8(self, *args):
        self._gemv(8, True, *args, i8="_i8")

    def gemv8_i8_serial(self, *args):
        self._gemv(8, False, *args, i8="_i8")

    def _dequant(self, bits, bq, sc, zq, zmode, zmid, out, n, nb, blob, tile, t0, t1):
        key = self._key(bits, sc, zq, zmode)
        if key is None or not out.flags.c_contiguous:
            return getattr(self._fallback(), f"dequant{bits}")(bq, sc, zq, zmode, zmid, out, n, nb, blob, tile, t0, t1)
        if not zmode or zq.size == 0:
            zq = _EMPTY_U8
        buf, address = _block()
        _D_PACK.pack_into(buf, 0, _addr(bq), bq.size, _addr(sc), sc.size, _addr(zq), zq.size, zmode, float(zmid),
                          _addr(out), out.shape[0], out.shape[1], n, nb, blob, tile, t0, t1)
        self._lib.call(f"dequant{key}", address)

    def dequant4(self, *args):
        self._dequant(4, *args)

    def dequant8(self, *args):
        self._dequant(8, *args)

    def has_qgemm(self) -> bool:
        """Whether the cache has the integer MatMuls' int8 GEMM (built on a CPU with VNNI or AVX2)."""
        return "qgemm" in self._lib.addresses

    @property
    def signs_form(self) -> bool:
        """``_qgemm_jit.signs_form`` of the build: whether ``qgemm(..., signs=1)`` computes the
        sums of (a - 128) * W."""
        return "qgemm_signs_form" in self._lib.addresses

    def _qgemm(self, a, w, out, n, groups, threads, signs) -> None:
        """``_qgemm_jit.qgemm``: ``a`` uint8 (M, 4*groups), ``w`` int8 lanes, ``out`` int32 (M, N),
        all C-contiguous."""
        buf, address = _block()
        _QG_PACK.pack_into(buf, 0, _addr(a), a.shape[0], a.shape[1], _addr(w), w.size, _addr(out), n, groups,
                           int(signs))
        threads = min(max(1, int(threads)), _SLOTS)
        if threads > 1:
            self._lib.parallel("qgemm_omp", address, threads)
        else:
            self._lib.call("qgemm", address)

    def qgemm(self, *args) -> None:
        self._qgemm(*args)

    def qgemm_serial(self, a, w, out, n, groups, threads, signs) -> None:
        self._qgemm(a, w, out, n, groups, 1, signs)

    def act_inplace(self, flat: np.ndarray, codes: np.ndarray, params: np.ndarray) -> None:
        """``_conv_jit.act_inplace``: float32 ``flat`` (C-contiguous, 1-D), int64 ``codes``,
        float32 ``params`` (len(codes), 3)."""
        codes = np.ascontiguousarray(codes, np.int64)
        params = np.ascontiguousarray(params, np.float32)
        buf, address = _block()
        struct.pack_into("<5q", buf, 0, _addr(flat), flat.size, _addr(codes), codes.size, _addr(params))
        self._lib.call("act_f32", address)


    def rms_rows(self, x, skip, bias, gamma, eps, y, total, inv_out, r0, r1) -> None:
        """``_conv_jit.rms_rows`` over all rows (``r0 == 0``, ``r1`` the row count): float32,
        C-contiguous arrays of the shapes it documents."""
        rows, d = x.shape
        if (r0, r1) != (0, rows):  # pragma: no cover - callers pass every row
            raise ValueError(f"Bug: rms_rows rows {r0}..{r1} of {rows}")
        self.rms(rows, d, x, skip, skip.shape[0], bias, bias.shape[0], gamma, y, total, total.shape[0], inv_out, eps)

    def rms(self, rows, d, x, skip, skip_rows, bias, bias_len, gamma, y, total, total_rows, inv_out, eps) -> None:
        """:meth:`rms_rows` with the sizes given: C-contiguous float32 arrays of any shape holding
        ``rows * d`` values (``skip``: ``skip_rows * d``, ``bias``: ``bias_len``, ``total``:
        ``total_rows * d``, ``inv_out``: ``rows``)."""
        buf, address = _block()
        _RMS_PACK.pack_into(buf, 0, rows, d, _addr(x), _addr(skip), skip_rows, _addr(bias), bias_len,
                            _addr(gamma), _addr(y), _addr(total), total_rows, _addr(inv_out), float(eps))
        self._lib.call("rms_f32", address)


    # Keys from which a decoding step shares its KV heads out over the OpenMP team: measured (2
    # threads, 14 heads over 2 KV heads of 64) the split pays from a few hundred keys; below, a
    # fork-join costs more than half the step.
    GQA_SPLIT_KEYS = 384

    def gqa_splits(self, nkv: int, keys: int) -> bool:
        """Whether :meth:`gqa_decode` shares the KV heads out (then it is the fastest path at any
        number of keys: the numpy path's batched BLAS is not faster)."""
        return nkv > 1 and keys >= self.GQA_SPLIT_KEYS and _act.threads() > 1 and "gqa_f32_omp" in self._lib.addresses

    def gqa_decode(self, q, k, v, pk, pv, pos, lo, cos, sin, half, interleaved, scale, softcap, out, qr,
                   scores) -> None:
        """``_attn_jit.gqa_decode`` on C-contiguous float32 arrays of the shapes it documents
        (``qr`` and ``scores`` are not used: the thread's scratch serves)."""
        nkv, cap, h = pk.shape
        self.gqa_decode_at(q.shape[0], nkv, h, cap, half, pos, lo, _addr(q), _addr(k), _addr(v), _addr(pk),
                           _addr(pv), _addr(cos), _addr(sin), _addr(out), interleaved, scale, softcap)

    def gqa_decode_at(self, n, nkv, h, cap, half, pos, lo, q, k, v, pk, pv, cos, sin, out, interleaved, scale,
                      softcap) -> None:
        """:meth:`gqa_decode` on data addresses (the caller keeps the arrays alive and checked:
        ``q`` n x h, ``k``/``v`` nkv x h, ``pk``/``pv`` nkv x cap x h, ``cos``/``sin`` the ``half``
        values of row ``pos``, ``out`` n x h float32), with this thread's scratch."""
        buf, address = _block()
        count = int(pos) + 1 - int(lo)
        threads = min(_act.threads(), nkv, _SLOTS)
        split = self.gqa_splits(nkv, count)
        if split:
            qr = _scratch("gqa_qr", threads * h, np.float32)
            scores = _scratch("gqa_scores", threads * count, np.float32)
        else:
            qr = _scratch("gqa_qr", h, np.float32)
            scores = _scratch("gqa_scores", count, np.float32)
        _Q_PACK.pack_into(buf, 0, n, nkv, h, cap, int(half), int(pos), int(lo), q, k, v, pk, pv, cos, sin, out,
                          _addr(qr), _addr(scores), count if split else scores.shape[0], int(bool(interleaved)),
                          float(scale), float(softcap))
        if split:
            self._lib.parallel("gqa_f32_omp", address, threads)
        else:
            self._lib.call("gqa_f32", address)


def load() -> _Kernels | None:
    """The native stand-in when the code cache has this machine's build, else None."""
    addresses = _native.load(MODULE, _sources())
    return None if addresses is None else _Kernels(_native.Native(addresses))


def build() -> str | None:
    """Compile the native entries with numba and write the code cache; the file written or None."""
    expected = _native.path_for(MODULE, _sources())  # named before the sources are imported
    from onnxpack.session.kernels import _attn_jit, _conv_jit, _nbits_jit, _qgemm_jit

    if _nbits_jit.CHUNK != CHUNK:  # pragma: no cover - the two modules must agree
        raise RuntimeError(f"Bug: _nbits_jit.CHUNK {_nbits_jit.CHUNK} != {CHUNK}")
    return _native.save(MODULE, _sources(), {**_nbits_jit.native_entries(), **_conv_jit.native_entries(),
                                                   **_attn_jit.native_entries(), **_qgemm_jit.native_entries()},
                        expected)



_LOCK_STALE_S = 15 * 60


def build_in_background() -> subprocess.Popen | None:
    """Start ``python -m onnxpack.session.kernels._jit_native`` detached (its own session, low
    priority, output discarded); a thread reaps it.  Returns the process, or None when this
    machine's cache already exists (intact)."""
    path = _native.path_for(MODULE, _sources())
    if path is None or _native.intact(path):
        return None
    import subprocess  # (only the first process on a machine gets here)

    proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    threading.Thread(target=proc.wait, name="onnxpack-native-build", daemon=True).start()
    return proc


def _main() -> int:
    """The background build: one builder per machine at a time (an exclusive lock file next to
    the cache file; a lock older than 15 minutes is a dead builder's and is taken over)."""
    if hasattr(os, "nice"):
        os.nice(10)
    path = _native.path_for(MODULE, _sources())
    if path is None or _native.intact(path):
        return 0
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    lock = path + ".building"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        try:
            if time.time() - os.stat(lock).st_mtime < _LOCK_STALE_S:
                return 0
            os.unlink(lock)
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError:
            return 0
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return 0 if build() else 1
    finally:
        try:
            os.unlink(lock)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(_main())
