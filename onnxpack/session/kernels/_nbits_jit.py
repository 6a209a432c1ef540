"""numba kernels for block-quantized weights in the tiled layout of :mod:`.quant` (optional).

Imported lazily by :mod:`onnxpack.session.kernels.quant` on a kernel's first ``run`` — never at
``import onnxpack`` nor at session creation — and only when numba is installed (the ``jit``
extra) and ``ONNXPACK_DISABLE_JIT`` is not ``1``.  Everything here has a numpy twin in
:mod:`.quant` that tests compare against.

Layout read here (written by ``quant.to_tiles``): the N output columns are cut into tiles of
``tile`` columns (the last tile holds the remaining ``N % tile``).  Tile ``t`` of width ``W`` stores
its per-block data column-fastest: byte ``j`` of block ``b`` of column ``n`` at
``t*tile*nb*blob + (b*blob + j)*W + (n - t*tile)``; scales and per-block zero points the same
way with ``blob = 1``.  So a GEMV streams every tile once, front to back, and the innermost loop
runs over contiguous columns: no horizontal sum per block, and it vectorizes (AVX-512: 16 columns
per instruction).

Why columns innermost (measured, one thread, K=896, N=4864, block 32, single row): the model's own
layout (column n's blocks contiguous, one dot product per block) runs 0.62-0.66 ms, this layout
0.23 ms; the per-block dot product of 16 bytes is too short for the vectorizer (it picks a
64-wide main loop and runs the scalar-ish epilogue) and ends every block with a horizontal sum.

Compile choices: ``cache=True`` (compiled code is kept on disk next to this file or in numba's
user cache; a later process loads it in well under a second); ``parallel=True`` with ``prange``
over one chunk of column groups per thread; ``fastmath={"contract"}`` only: fused multiply-add,
no reassociation and no finite-math assumptions (the column loop is elementwise, so it vectorizes
without reassociation, and NaN/Inf in the activations propagate as they do in numpy).
"""

from __future__ import annotations

import types as types_module

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

__all__ = ["gemv4", "gemv4_serial", "gemv8", "gemv8_serial", "dequant4", "dequant8", "threads", "CHUNK"]

# Columns one work item covers: 4 AVX-512 vectors of float32; a tile is a multiple of it.
CHUNK = 128
_FM = {"contract"}


def threads() -> int:
    """Threads a parallel kernel runs on (numba's setting: ``NUMBA_NUM_THREADS``, ``set_num_threads``)."""
    return numba.get_num_threads()


def _f32(x):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@intrinsic
def _half_to_f32(typingctx, h):
    """IEEE half (given as its uint16 bits) to float32: one ``vcvtph2ps``, exact for every value."""
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@overload(_f32, inline="always")
def _f32_impl(x):
    if x == types.uint16:  # float16 bits (numba has no float16 type)
        return lambda x: _half_to_f32(x)
    if x in (types.float32, types.float64, types.uint8):
        return lambda x: np.float32(x)
    return None


@njit(cache=True)
def _items(n, tile):
    """(work items, full tiles, columns of the last tile) for ``n`` columns in tiles of ``tile``."""
    nfull = n // tile
    rem = n - nfull * tile
    return nfull * (tile // CHUNK) + (rem + CHUNK - 1) // CHUNK, nfull, rem


@njit(cache=True)
def _item(it, nfull, rem, tile):
    """Tile index, first column inside the tile, tile width and item width of work item ``it``."""
    per = tile // CHUNK
    if it < nfull * per:
        tl = it // per
        c0 = (it - tl * per) * CHUNK
        width = tile
    else:
        tl = nfull
        c0 = (it - nfull * per) * CHUNK
        width = rem
    return tl, c0, width, min(CHUNK, width - c0)


@njit(cache=True, fastmath=_FM, inline="always")
def _scale_block(acc, t, sc, zq, zmode, zmid, asum, b, soff, cw):
    """``acc[m] += s * (t[m] - z * sum(a[m] over block b))`` for the ``cw`` columns at ``soff``."""
    srow = sc[soff:soff + cw]
    if zmode == 1:
        zrow = zq[soff:soff + cw]
        for m in range(acc.shape[0]):
            s_a = asum[m, b]
            am = acc[m]
            tm = t[m]
            for c in range(cw):
                am[c] += _f32(srow[c]) * (tm[c] - _f32(zrow[c]) * s_a)
    else:
        for m in range(acc.shape[0]):
            s_a = asum[m, b] * zmid
            am = acc[m]
            tm = t[m]
            for c in range(cw):
                am[c] += _f32(srow[c]) * (tm[c] - s_a)


@njit(cache=True, fastmath=_FM)
def _prep4(a, ade, asum, blob):
    """The activations re-ordered for 4-bit blocks: ``ade[m, b, 0 | 1, j]`` = element ``2j`` | ``2j+1``
    of block ``b`` of row ``m`` (zero past K), ``asum[m, b]`` = the block's sum."""
    m_rows, k = a.shape
    nb = asum.shape[1]
    bs = 2 * blob
    for m in range(m_rows):
        for b in range(nb):
            s = np.float32(0.0)
            for r in range(bs):
                v = a[m, b * bs + r] if b * bs + r < k else np.float32(0.0)
                ade[m, b, r & 1, r >> 1] = v
                s += v
            asum[m, b] = s


@njit(cache=True, fastmath=_FM)
def _items4(ade, asum, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, it0, it1, t, acc):
    """Work items ``it0 <= it < it1`` (CHUNK columns each) of the 4-bit GEMV, with the caller's
    (rows, CHUNK) scratch ``t`` and ``acc``: allocates nothing."""
    m_rows = ade.shape[0]
    total, nfull, rem = _items(n, tile)
    for it in range(it0, it1):
        tl, c0, width, cw = _item(it, nfull, rem, tile)
        bbase = tl * tile * nb * blob + c0
        sbase = tl * tile * nb + c0
        acc[:, :cw] = 0
        for b in range(nb):
            t[:, :cw] = 0
            # Rows of A outermost: the block's bytes (blob x 128) stay in L1 for the next row.
            for m in range(m_rows):
                tm = t[m]
                even = ade[m, b, 0]
                odd = ade[m, b, 1]
                for j in range(blob):
                    off = bbase + (b * blob + j) * width
                    row = bq[off:off + cw]  # a slice: range() indices need no wraparound check
                    e = even[j]
                    o = odd[j]
                    for c in range(cw):
                        v = row[c]
                        # Left to right: two FMAs into t (``t += (e*lo + o*hi)`` is a multiply,
                        # an FMA and an add).
                        tm[c] = tm[c] + e * np.float32(np.uint8(v & np.uint8(15))) + o * np.float32(
                            np.uint8(v >> np.uint8(4)))
            _scale_block(acc, t, sc, zq, zmode, zmid, asum, b, sbase + b * width, cw)
        n0 = tl * tile + c0
        for m in range(m_rows):
            for c in range(cw):
                y[m, n0 + c] = acc[m, c]


def _gemv4(a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads):
    """``y[m, :] = a[m, :] @ W`` for 4-bit blocks: ``W[k, n] = (q - z) * s`` (few rows of ``a``).

    ``a`` (M, K) float32; ``bq`` uint8 tiles (two values per byte, element 2j low nibble);
    ``sc`` float32 or float16-bits tiles; ``zq`` per-block zero points (uint8, float32 or
    float16 bits) used when ``zmode`` is 1, else every zero point is ``zmid``; ``y`` (M, N);
    ``threads`` is ``numba.get_num_threads()`` read by the caller (calling it in here would make
    the function uncacheable: a ctypes global).
    ``a``'s values are re-ordered once per call so each byte's two nibbles meet two contiguous
    planes of ``a`` (even and odd positions of the block), and the zero point enters per block as
    ``z * sum(a over the block)``.
    """
    m_rows = a.shape[0]
    ade = np.empty((m_rows, nb, 2, blob), np.float32)
    asum = np.empty((m_rows, nb), np.float32)
    _prep4(a, ade, asum, blob)
    total, nfull, rem = _items(n, tile)
    nth = max(1, min(threads, total))
    for th in prange(nth):
        t = np.empty((m_rows, CHUNK), np.float32)
        acc = np.empty((m_rows, CHUNK), np.float32)
        _items4(ade, asum, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, th * total // nth,
                (th + 1) * total // nth, t, acc)


@njit(cache=True, fastmath=_FM)
def _prep8(a, ade, asum, blob):
    """:func:`_prep4` for 8-bit blocks: ``ade[m, b, 0, j]`` = element j of block b (zero past K)."""
    m_rows, k = a.shape
    nb = asum.shape[1]
    for m in range(m_rows):
        for b in range(nb):
            s = np.float32(0.0)
            for r in range(blob):
                v = a[m, b * blob + r] if b * blob + r < k else np.float32(0.0)
                ade[m, b, 0, r] = v
                s += v
            asum[m, b] = s


@njit(cache=True, fastmath=_FM)
def _items8(ade, asum, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, it0, it1, t, acc):
    """:func:`_items4` for 8-bit blocks (one value per byte, ``blob == block_size``)."""
    m_rows = ade.shape[0]
    total, nfull, rem = _items(n, tile)
    for it in range(it0, it1):
        tl, c0, width, cw = _item(it, nfull, rem, tile)
        bbase = tl * tile * nb * blob + c0
        sbase = tl * tile * nb + c0
        acc[:, :cw] = 0
        for b in range(nb):
            t[:, :cw] = 0
            for m in range(m_rows):
                tm = t[m]
                am = ade[m, b, 0]
                for j in range(blob):
                    off = bbase + (b * blob + j) * width
                    row = bq[off:off + cw]
                    e = am[j]
                    for c in range(cw):
                        tm[c] += e * np.float32(row[c])
            _scale_block(acc, t, sc, zq, zmode, zmid, asum, b, sbase + b * width, cw)
        n0 = tl * tile + c0
        for m in range(m_rows):
            for c in range(cw):
                y[m, n0 + c] = acc[m, c]


def _gemv8(a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads):
    """:func:`_gemv4` for 8-bit blocks (one value per byte, ``blob == block_size``)."""
    m_rows = a.shape[0]
    ade = np.empty((m_rows, nb, 1, blob), np.float32)
    asum = np.empty((m_rows, nb), np.float32)
    _prep8(a, ade, asum, blob)
    total, nfull, rem = _items(n, tile)
    nth = max(1, min(threads, total))
    for th in prange(nth):
        t = np.empty((m_rows, CHUNK), np.float32)
        acc = np.empty((m_rows, CHUNK), np.float32)
        _items8(ade, asum, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, th * total // nth,
                (th + 1) * total // nth, t, acc)


def _compiled(py_func, name: str, parallel: bool):
    """``py_func`` compiled under its own name: numba names cache files by qualified name, so a
    parallel and a serial build of one Python function would otherwise share (and clobber) them."""
    fn = types_module.FunctionType(py_func.__code__, py_func.__globals__, name, py_func.__defaults__,
                                   py_func.__closure__)
    fn.__qualname__ = name
    fn.__doc__ = py_func.__doc__
    return njit(cache=True, parallel=parallel, fastmath=_FM)(fn)


# Parallel over column groups (2 threads here), and serial builds for small products: a fork-join
# costs ~10-20 us and, when another process holds the second core, a barrier can wait a whole
# scheduler slice (measured: 40-70 ms per call for a 0.05 ms GEMV while the machine's load was 7).
gemv4 = _compiled(_gemv4, "gemv4", True)
gemv4_serial = _compiled(_gemv4, "gemv4_serial", False)
gemv8 = _compiled(_gemv8, "gemv8", True)
gemv8_serial = _compiled(_gemv8, "gemv8_serial", False)


@njit(cache=True, fastmath=_FM, nogil=True)
def dequant4(bq, sc, zq, zmode, zmid, out, n, nb, blob, tile, t0, t1):
    """Dense float32 ``W`` of tiles ``t0 <= t < t1`` into ``out`` (nb * block_size, columns).

    Serial on purpose, and without the GIL: the caller runs it on several Python threads (one
    panel each, each followed by a one-thread BLAS call).  An OpenMP team here, spinning beside
    OpenBLAS's threads on 2 cores, made whole calls 100-1000x slower (measured: 190 ms instead of
    ~1 ms for 896x4864 at M=1 with a parallel dequant).
    """
    bs = 2 * blob
    nfull = n // tile
    rem = n - nfull * tile
    for idx in range((t1 - t0) * nb):
        tl = t0 + idx // nb
        b = idx - (idx // nb) * nb
        width = tile if tl < nfull else rem
        col0 = (tl - t0) * tile
        soff = tl * tile * nb + b * width
        srow = sc[soff:soff + width]
        zrow = zq[soff:soff + width] if zmode == 1 else zq[0:0]
        for j in range(blob):
            off = tl * tile * nb * blob + (b * blob + j) * width
            row = bq[off:off + width]
            lo = out[b * bs + 2 * j, col0:col0 + width]
            hi = out[b * bs + 2 * j + 1, col0:col0 + width]
            if zmode == 1:
                for c in range(width):
                    s = _f32(srow[c])
                    z = _f32(zrow[c])
                    v = row[c]
                    lo[c] = (np.float32(np.uint8(v & np.uint8(15))) - z) * s
                    hi[c] = (np.float32(np.uint8(v >> np.uint8(4))) - z) * s
            else:
                for c in range(width):
                    s = _f32(srow[c])
                    v = row[c]
                    lo[c] = (np.float32(np.uint8(v & np.uint8(15))) - zmid) * s
                    hi[c] = (np.float32(np.uint8(v >> np.uint8(4))) - zmid) * s


@njit(cache=True, fastmath=_FM, nogil=True)
def dequant8(bq, sc, zq, zmode, zmid, out, n, nb, blob, tile, t0, t1):
    """:func:`dequant4` for 8-bit blocks."""
    nfull = n // tile
    rem = n - nfull * tile
    for idx in range((t1 - t0) * nb):
        tl = t0 + idx // nb
        b = idx - (idx // nb) * nb
        width = tile if tl < nfull else rem
        col0 = (tl - t0) * tile
        soff = tl * tile * nb + b * width
        srow = sc[soff:soff + width]
        zrow = zq[soff:soff + width] if zmode == 1 else zq[0:0]
        for j in range(blob):
            off = tl * tile * nb * blob + (b * blob + j) * width
            row = bq[off:off + width]
            dst = out[b * blob + j, col0:col0 + width]
            if zmode == 1:
                for c in range(width):
                    dst[c] = (np.float32(row[c]) - _f32(zrow[c])) * _f32(srow[c])
            else:
                for c in range(width):
                    dst[c] = (np.float32(row[c]) - zmid) * _f32(srow[c])


# -- native entry points (see :mod:`._native` and :mod:`._jit_native`) ----------------------------
# C-ABI functions taking one int64 argument block (layout: ``_jit_native.G_*`` / ``D_*``), built
# only when a process writes the native code cache.  They allocate nothing: the Python side
# passes every scratch buffer, so the object code never calls numba's runtime.

def native_entries() -> dict:
    """name -> numba cfunc of every native entry (compiles them: seconds, in the writing process).

    For each weight layout the models use — scales float32 or float16 bits (``u16``), per-block
    zero points uint8 (an empty array when the implicit middle value is used) — and for 4 and 8
    bits: ``gemv{bits}_{sc}`` (serial), ``gemv{bits}_{sc}_omp`` (an OpenMP worker for
    ``GOMP_parallel``: thread 0 re-orders the activations, a barrier, then every thread takes
    work items from a dynamic loop) and ``dequant{bits}_{sc}``.
    """
    import llvmlite.binding as llvm
    from numba import carray, cfunc

    from onnxpack.session.kernels import _jit_native as L
    from onnxpack.session.kernels._native import gomp_library
    from onnxpack.session.kernels._conv_jit import F32, U8, U16, address, as_ptr

    # The OpenMP workers call GNU OpenMP's loop and barrier functions: numba's JIT must resolve them.
    llvm.load_library_permanently(gomp_library())

    i64 = types.int64
    loop_start = types.ExternalFunction("GOMP_loop_nonmonotonic_dynamic_start", types.uint8(i64, i64, i64, i64, i64, i64))
    loop_next = types.ExternalFunction("GOMP_loop_nonmonotonic_dynamic_next", types.uint8(i64, i64))
    loop_end = types.ExternalFunction("GOMP_loop_end_nowait", types.void())
    barrier = types.ExternalFunction("GOMP_barrier", types.void())
    thread_num = types.ExternalFunction("omp_get_thread_num", types.int32())
    sig = types.void(types.voidptr)
    out = {}

    def make(sck, bits):
        scm = F32 if sck == "f32" else U16
        prep, items, deq = (_prep4, _items4, dequant4) if bits == 4 else (_prep8, _items8, dequant8)
        per = 8 // bits  # values per byte: the activations' planes (``_prep4`` / ``_prep8``)

        @njit(inline="always")
        def views(blk):
            g = carray(blk, (L.G_HEADER,), np.int64)
            gf = carray(blk, (L.G_HEADER,), np.float64)
            m, k, nb, blob = g[L.G_M], g[L.G_K], g[L.G_NB], g[L.G_BLOB]
            a = carray(as_ptr(g[L.G_A], F32), (m, k))
            bq = carray(as_ptr(g[L.G_BQ], U8), (g[L.G_BQ_LEN],))
            sc = carray(as_ptr(g[L.G_SC], scm), (g[L.G_SC_LEN],))
            zq = carray(as_ptr(g[L.G_ZQ], U8), (g[L.G_ZQ_LEN],))
            y = carray(as_ptr(g[L.G_Y], F32), (m, g[L.G_N]))
            ade = carray(as_ptr(g[L.G_ADE], F32), (m, nb, per, blob))
            asum = carray(as_ptr(g[L.G_ASUM], F32), (m, nb))
            return g, a, bq, sc, zq, y, ade, asum, np.float32(gf[L.G_ZMID])

        def serial(blk):
            g, a, bq, sc, zq, y, ade, asum, zmid = views(blk)
            scratch = carray(as_ptr(g[L.G_SCRATCH], F32), (2, g[L.G_M], CHUNK))
            prep(a, ade, asum, g[L.G_BLOB])
            total, nfull, rem = _items(g[L.G_N], g[L.G_TILE])
            items(ade, asum, bq, sc, zq, g[L.G_ZMODE], zmid, y, g[L.G_N], g[L.G_NB], g[L.G_BLOB], g[L.G_TILE],
                  0, total, scratch[0], scratch[1])

        def worker(blk):
            g, a, bq, sc, zq, y, ade, asum, zmid = views(blk)
            m = g[L.G_M]
            tid = np.int64(thread_num())
            if tid == 0:
                prep(a, ade, asum, g[L.G_BLOB])
            barrier()
            scratch = carray(as_ptr(g[L.G_SCRATCH] + tid * 8 * m * CHUNK, F32), (2, m, CHUNK))
            total, nfull, rem = _items(g[L.G_N], g[L.G_TILE])
            slot = address(blk) + 8 * (L.G_HEADER + 2 * tid)  # this thread's (start, end) pair
            bounds = carray(blk, (L.G_HEADER + 2 * tid + 2,), np.int64)[L.G_HEADER + 2 * tid:]
            if loop_start(0, total, 1, g[L.G_CHUNK], slot, slot + 8):
                while True:
                    items(ade, asum, bq, sc, zq, g[L.G_ZMODE], zmid, y, g[L.G_N], g[L.G_NB], g[L.G_BLOB],
                          g[L.G_TILE], bounds[0], bounds[1], scratch[0], scratch[1])
                    if not loop_next(slot, slot + 8):
                        break
            loop_end()

        def dequant(blk):
            d = carray(blk, (L.D_HEADER,), np.int64)
            df = carray(blk, (L.D_HEADER,), np.float64)
            bq = carray(as_ptr(d[L.D_BQ], U8), (d[L.D_BQ_LEN],))
            sc = carray(as_ptr(d[L.D_SC], scm), (d[L.D_SC_LEN],))
            zq = carray(as_ptr(d[L.D_ZQ], U8), (d[L.D_ZQ_LEN],))
            w = carray(as_ptr(d[L.D_OUT], F32), (d[L.D_ROWS], d[L.D_COLS]))
            deq(bq, sc, zq, d[L.D_ZMODE], np.float32(df[L.D_ZMID]), w, d[L.D_N], d[L.D_NB], d[L.D_BLOB],
                d[L.D_TILE], d[L.D_T0], d[L.D_T1])

        made = {}
        for name, fn in ((f"gemv{bits}_{sck}", serial), (f"gemv{bits}_{sck}_omp", worker),
                         (f"dequant{bits}_{sck}", dequant)):
            fn = types_module.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
            made[name] = cfunc(sig, nopython=True, error_model="numpy", fastmath=_FM)(fn)
        return made

    for sck in ("f32", "u16"):
        for bits in (4, 8):
            out.update(make(sck, bits))
    return out
