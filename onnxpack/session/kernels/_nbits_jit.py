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

__all__ = ["gemv4", "gemv4_serial", "gemv8", "gemv8_serial", "gemv4_i8", "gemv4_i8_serial", "gemv8_i8",
           "gemv8_i8_serial", "int8_dot", "dequant4", "dequant8", "threads", "CHUNK"]

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


# -- int8 activations (onnxruntime's accuracy_level 4) ----------------------------------------------
# With ``accuracy_level=4`` onnxruntime quantizes A per block to int8 (``scale = max|a| / 127``,
# round to nearest even) and multiplies integers; so do these kernels, on CPUs with AVX-512 VNNI
# (and with AVX2: see below):
# ``vpdpbusd`` multiplies 64 unsigned weight bytes by 64 signed activation bytes and adds each
# lane's four products into 16 int32 sums, 128 multiply-adds per two instructions where the
# float kernel above needs two conversions and two FMAs per 32.  Measured, one thread, block 32,
# one row: K=896 N=4864 0.27 -> 0.095 ms (8 -> 23 GB/s of packed weights), N=151,936 (the
# lm_head) 9.5 -> 6.6 ms.  The packed layout is the same as the float kernels': the in-register
# transpose below costs a few shuffles per 256 bytes.


def int8_dot_supported() -> bool:
    """Whether this CPU runs the VNNI int8 kernels (AVX-512 VNNI and BW): numba compiles them for it."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    return bool(features.get("avx512vnni") and features.get("avx512bw"))


def int8_avx2_supported() -> bool:
    """Whether this CPU runs the AVX2 int8 kernels (``vpmaddubsw`` / ``vpmaddwd``)."""
    import llvmlite.binding as llvm

    return bool(llvm.get_host_cpu_features().get("avx2"))


_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V64 = ir.VectorType(_I8, 64)
_V16 = ir.VectorType(_I32, 16)


def _lanes(vals) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(vals)), [ir.Constant(_I32, v) for v in vals])


# Four rows of 64 weight bytes (bytes j..j+3 of a block, columns c0..c0+63) to four vectors of 16
# columns whose int32 lanes hold one column's 4 bytes: pairs of rows byte-interleaved, then pairs
# of pairs 16-bit-interleaved.
_PAIR = [_lanes([c + 64 * h for c in range(32 * part, 32 * part + 32) for h in (0, 1)]) for part in (0, 1)]
_QUAD = [_lanes([2 * c + off for c in range(16 * q, 16 * q + 16) for off in (0, 1, 64, 65)]) for q in (0, 1)]


def declare(builder, name: str, vector) -> ir.Function:
    """The LLVM intrinsic ``name`` of three ``vector`` arguments returning one, declared once in
    ``builder``'s module."""
    mod = builder.module
    return mod.globals.get(name) or ir.Function(mod, ir.FunctionType(vector, [vector] * 3), name)


def prefetch_fn(builder) -> ir.Function:
    """The ``llvm.prefetch`` intrinsic in ``builder``'s module, declared once: (address as i8*,
    read 0 / write 1, locality 0-3, data cache 1); it never faults, even past an array's end."""
    mod = builder.module
    return mod.globals.get("llvm.prefetch.p0i8") or ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")


def vpdpbusd(builder):
    """The ``vpdpbusd`` intrinsic in ``builder``'s module: ``(acc, u, s)`` adds to each int32 lane
    of ``acc`` the four products of ``u``'s unsigned bytes and ``s``'s signed bytes."""
    return declare(builder, "llvm.x86.avx512.vpdpbusd.512", _V16)


def splat(builder, x, lanes: int = 16):
    """``x`` (an int32, or a value of another element type) broadcast to ``lanes`` lanes."""
    one = ir.VectorType(x.type, 1)
    v = builder.insert_element(ir.Constant(one, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(one, None), _lanes([0] * lanes))


def accumulate(builder, ngroups, rows: int, vecs: int, step, vector=_V16, init=None):
    """Emit ``for g in range(ngroups)`` carrying ``rows`` x ``vecs`` vector accumulators
    (``vector``: 16 int32 lanes, or 8 on AVX2, or a float vector) from zero, or from ``init``
    (rows of values): ``step(g, accs) -> new accs`` emits one iteration (it may emit loops of its
    own).  Returns the accumulators after the loop (their start when ``ngroups <= 0``)."""
    start = builder.block
    loop = builder.append_basic_block("acc.loop")
    done = builder.append_basic_block("acc.done")
    if init is None:
        init = [[ir.Constant(vector, None)] * vecs for _ in range(rows)]
    builder.cbranch(builder.icmp_signed(">", ngroups, ir.Constant(_I64, 0)), loop, done)
    builder.position_at_end(loop)
    g = builder.phi(_I64)
    accs = [[builder.phi(vector) for _ in range(vecs)] for _ in range(rows)]
    g.add_incoming(ir.Constant(_I64, 0), start)
    for acc_row, init_row in zip(accs, init):
        for acc, v in zip(acc_row, init_row):
            acc.add_incoming(v, start)
    new = step(g, accs)
    g_next = builder.add(g, ir.Constant(_I64, 1))
    end = builder.block
    g.add_incoming(g_next, end)
    for acc_row, new_row in zip(accs, new):
        for acc, v in zip(acc_row, new_row):
            acc.add_incoming(v, end)
    builder.cbranch(builder.icmp_signed("<", g_next, ngroups), loop, done)
    builder.position_at_end(done)
    results = [[builder.phi(vector) for _ in row] for row in new]
    for res_row, new_row, init_row in zip(results, new, init):
        for res, v, v0 in zip(res_row, new_row, init_row):
            res.add_incoming(v0, start)
            res.add_incoming(v, end)
    return results


def store_rows(builder, outs, results) -> None:
    """Each row's accumulators to 16 consecutive int32 each at its pointer in ``outs``."""
    for out, res_row in zip(outs, results):
        for i, res in enumerate(res_row):
            builder.store(res, builder.bitcast(builder.gep(out, [ir.Constant(_I64, 16 * i)]), _V16.as_pointer()),
                          align=4)


@intrinsic
def as_ptr(typingctx, addr, marker):
    """A pointer to ``marker``'s dtype (any array of it) at the int64 address ``addr``: native
    entries and unit kernels read their argument blocks' addresses with it."""
    if addr != types.int64 or not isinstance(marker, types.Array):
        return None
    ptr = types.CPointer(marker.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(types.int64, marker), codegen


@intrinsic
def address(typingctx, p):
    """A void pointer as an int64."""
    if p != types.voidptr:
        return None

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], context.get_value_type(types.int64))

    return types.int64(types.voidptr), codegen


# dtype markers for :func:`as_ptr` (frozen as constants in compiled code)
F32, U8, U16, I64 = (np.zeros(0, t) for t in (np.float32, np.uint8, np.uint16, np.int64))


def array_data(context, builder, ty, val, elt):
    """The data pointer of a numba array value as ``elt*``."""
    return builder.bitcast(context.make_array(ty)(context, builder, val).data, elt.as_pointer())


def row_pointers(builder, base, off, stride, rows: int) -> list:
    """The ``rows`` pointers ``base + off + r * stride`` (offsets in elements): a tile's rows of
    its output or of A."""
    return [builder.gep(base, [builder.add(off, builder.mul(ir.Constant(_I64, r), stride))]) for r in range(rows)]


def _dot_codegen(nibbles: bool, halves: int, rows: int):
    """Code of the ``_dot*`` intrinsics: ``halves`` runs of 64 columns side by side (128 columns
    read 4 rows of 128 contiguous bytes per group: one sequential stream) for ``rows`` rows of A
    at once (the weight bytes are loaded and transposed once for all of them)."""

    def codegen(context, builder, sig, args):
        isum, ioff, istride, bq, boff, stride, aq, aoff, astride, ngroups = args

        def const(v):
            return ir.Constant(_I64, v)

        outs = row_pointers(builder, array_data(context, builder, sig.args[0], isum, _I32), ioff, istride, rows)
        wp = builder.gep(array_data(context, builder, sig.args[3], bq, _I8), [boff])
        aps = [builder.bitcast(p, _I32.as_pointer())
               for p in row_pointers(builder, array_data(context, builder, sig.args[6], aq, _I8), aoff, astride, rows)]
        dp = vpdpbusd(builder)

        def step(g, accs):
            row0 = builder.mul(builder.mul(g, const(4)), stride)
            quads = []
            for h in range(halves):
                loads = [builder.load(builder.bitcast(builder.gep(wp, [builder.add(builder.add(row0, builder.mul(const(i), stride)),
                                                                                    const(64 * h))]), _V64.as_pointer()),
                                      align=1) for i in range(4)]
                pairs01 = [builder.shuffle_vector(loads[0], loads[1], m) for m in _PAIR]
                pairs23 = [builder.shuffle_vector(loads[2], loads[3], m) for m in _PAIR]
                quads += [builder.shuffle_vector(pairs01[p], pairs23[p], m) for p in (0, 1) for m in _QUAD]
            if nibbles:
                # Lane bytes hold elements (2j, 2j+1), ..., (2j+6, 2j+7): low nibbles meet the
                # block's 4 even activations, high nibbles its 4 odd ones.
                low = ir.Constant(_V64, [ir.Constant(_I8, 15)] * 64)
                four = ir.Constant(_V64, [ir.Constant(_I8, 4)] * 64)
                parts = [(builder.bitcast(builder.and_(v, low), _V16), builder.bitcast(builder.lshr(v, four), _V16))
                         for v in quads]
            new = []
            for r in range(rows):
                if nibbles:
                    even = splat(builder, builder.load(builder.gep(aps[r], [builder.mul(g, const(2))])))
                    odd = splat(builder, builder.load(builder.gep(aps[r], [builder.add(builder.mul(g, const(2)), const(1))])))
                    new.append([builder.call(dp, [builder.call(dp, [acc, lo, even]), hi, odd])
                                for acc, (lo, hi) in zip(accs[r], parts)])
                else:
                    quad = splat(builder, builder.load(builder.gep(aps[r], [g])))
                    new.append([builder.call(dp, [acc, builder.bitcast(v, _V16), quad]) for acc, v in zip(accs[r], quads)])
            return new

        store_rows(builder, outs, accumulate(builder, ngroups, rows, 4 * halves, step))
        return context.get_dummy_value()

    return codegen


def _dot_intrinsic(nibbles: bool, halves: int, rows: int):
    def impl(typingctx, isum, ioff, istride, bq, boff, stride, aq, aoff, astride, ngroups):
        if not all(isinstance(x, types.Array) and x.layout == "C" for x in (isum, bq, aq)) or \
                isum.dtype != types.int32 or bq.dtype != types.uint8 or aq.dtype != types.int8:
            return None
        i64 = types.int64
        sig = types.void(isum, i64, i64, bq, i64, i64, aq, i64, i64, i64)
        return sig, _dot_codegen(nibbles, halves, rows)

    impl.__name__ = impl.__qualname__ = f"_dot{64 * halves}x{rows}_{4 if nibbles else 8}"
    return intrinsic(impl)


# ``_dot{C}x{R}_{bits}(isum, ioff, istride, bq, boff, stride, aq, aoff, astride, ngroups)``: for R
# rows r of A, ``isum.flat[ioff + r*istride :][:C]`` = the int32 dot products of C columns of one
# block with row r's int8 activations (``aq.flat[aoff + r*astride:]``, :func:`_prep_i8`'s order).
# The block has ``ngroups`` groups of 4 weight bytes per column (8 elements at 4 bits, 4 at 8),
# each group's bytes ``stride`` apart from ``bq[boff]`` on (the tiled layout).  Arrays of any
# rank, C-contiguous; offsets in elements.
# -- the same integer dot products on AVX2 (no VNNI) ----------------------------------------------
# ``vpmaddubsw`` multiplies 32 unsigned weight bytes by 32 signed activation bytes and adds
# adjacent pairs into 16 int16 lanes (saturating); ``vpmaddwd`` by ones adds adjacent int16 pairs
# into 8 int32 lanes: one column's four products, as ``vpdpbusd`` gives them.  Nothing saturates:
# activations are at most 127 in magnitude (``_prep_i8``), 4-bit weights at most 15, so a group's
# low-nibble and high-nibble pair sums together stay within 2 * 2 * 15 * 127 = 7,620; 8-bit weights
# are split into their nibbles the same way, the high one's sums weighted by 16 in ``vpmaddwd``.
# Exactly the VNNI kernels' integers.  Four rows of 32 weight bytes are transposed with in-lane
# unpacks only, which leave the columns in the order 0-3 16-19 | 4-7 20-23 | 8-11 24-27 |
# 12-15 28-31 across the four vectors; the sums are put back in order once, when stored.  Each
# group's first pass prefetches the same rows of the next block (a whole block ahead): reading the
# weights from memory, one thread went from ~5 to ~6 GB/s, two from ~8.5 to ~9 (the lm_head and
# 4864x896 streamed from DRAM, alternating builds; without the shuffles it ran no faster: this
# kernel waits for memory, not arithmetic).  The prefetches are non-temporal (locality 0): the
# weights pass through once per token, and the step's other work (attention, norms, the Python
# between kernels) then finds more of its own data still cached — Qwen2.5-0.5B int4 decoding on
# an AMD EPYC, fresh processes alternating with the locality-3 build: 42.2 vs 44.2 and 45.0 vs
# 46.3 ms per token (medians of 6 and 4 processes).
_V32I8 = ir.VectorType(_I8, 32)
_V16I16 = ir.VectorType(ir.IntType(16), 16)
_V8I32 = ir.VectorType(_I32, 8)


def _unpack_mask(size: int, hi: bool) -> ir.Constant:
    """shufflevector mask of ``vpunpck{l,h}*`` on 256-bit vectors of ``size`` elements: per
    128-bit lane, the low (or high) half of the lane's elements of both operands, interleaved."""
    per = size // 2  # elements per 128-bit lane
    half = per // 2
    idx = [off + lane * per + i + (half if hi else 0) for lane in (0, 1) for i in range(half) for off in (0, size)]
    return _lanes(idx)


_UNPACK8 = (_unpack_mask(32, False), _unpack_mask(32, True))
_UNPACK16 = (_unpack_mask(16, False), _unpack_mask(16, True))
_ORDER = (_lanes([0, 1, 2, 3, 8, 9, 10, 11]), _lanes([4, 5, 6, 7, 12, 13, 14, 15]))


def _avx2_fn(builder, name: str, ret, arg):
    mod = builder.module
    return mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ret, [arg, arg]), name)


def _dot_codegen_avx2(nibbles: bool, cols: int, rows: int):
    """AVX2 code of the ``_dot*`` intrinsics (see the VNNI ones): ``cols`` columns as runs of 32,
    each its own pass over the block's groups, ``rows`` rows of A per pass."""

    def codegen(context, builder, sig, args):
        isum, ioff, istride, bq, boff, stride, aq, aoff, astride, ngroups = args

        def const(v):
            return ir.Constant(_I64, v)

        outs = row_pointers(builder, array_data(context, builder, sig.args[0], isum, _I32), ioff, istride, rows)
        wp = builder.gep(array_data(context, builder, sig.args[3], bq, _I8), [boff])
        aps = [builder.bitcast(p, _I32.as_pointer())
               for p in row_pointers(builder, array_data(context, builder, sig.args[6], aq, _I8), aoff, astride, rows)]
        maddubs = _avx2_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, _V32I8)
        maddwd = _avx2_fn(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, _V16I16)
        ones = ir.Constant(_V16I16, [ir.Constant(ir.IntType(16), 1)] * 16)
        sixteens = ir.Constant(_V16I16, [ir.Constant(ir.IntType(16), 16)] * 16)
        low = ir.Constant(_V32I8, [ir.Constant(_I8, 15)] * 32)
        four = ir.Constant(_V32I8, [ir.Constant(_I8, 4)] * 32)

        def acts(r, idx):
            return builder.bitcast(splat(builder, builder.load(builder.gep(aps[r], [idx])), 8), _V32I8)

        pf = prefetch_fn(builder)
        i32 = ir.IntType(32)
        for run in range(cols // 32):
            def step(g, accs, run=run):
                row0 = builder.mul(builder.mul(g, const(4)), stride)
                if run == 0:  # the next block's same rows (prefetches never fault, even past the end)
                    ahead = builder.mul(builder.mul(ngroups, const(4)), stride)
                    for i in range(4):
                        for line in range(0, cols, 64):
                            at = builder.add(builder.add(builder.add(row0, builder.mul(const(i), stride)), ahead), const(line))
                            builder.call(pf, [builder.gep(wp, [at]), ir.Constant(i32, 0), ir.Constant(i32, 0), ir.Constant(i32, 1)])
                loads = [builder.load(builder.bitcast(
                    builder.gep(wp, [builder.add(builder.add(row0, builder.mul(const(i), stride)), const(32 * run))]),
                    _V32I8.as_pointer()), align=1) for i in range(4)]
                p01 = [builder.bitcast(builder.shuffle_vector(loads[0], loads[1], m), _V16I16) for m in _UNPACK8]
                p23 = [builder.bitcast(builder.shuffle_vector(loads[2], loads[3], m), _V16I16) for m in _UNPACK8]
                quads = [builder.bitcast(builder.shuffle_vector(p01[h], p23[h], m), _V32I8)
                         for h in (0, 1) for m in _UNPACK16]
                parts = [(builder.and_(v, low), builder.lshr(v, four)) for v in quads]
                new = []
                for r in range(rows):
                    if nibbles:
                        even, odd = acts(r, builder.mul(g, const(2))), acts(r, builder.add(builder.mul(g, const(2)), const(1)))
                        new.append([builder.add(acc, builder.call(maddwd, [builder.add(
                            builder.call(maddubs, [lo, even]), builder.call(maddubs, [hi, odd])), ones]))
                            for acc, (lo, hi) in zip(accs[r], parts)])
                    else:
                        quad = acts(r, g)
                        new.append([builder.add(builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [lo, quad]), ones])),
                                                builder.call(maddwd, [builder.call(maddubs, [hi, quad]), sixteens]))
                                    for acc, (lo, hi) in zip(accs[r], parts)])
                return new

            results = accumulate(builder, ngroups, rows, 4, step, _V8I32)
            for out, q in zip(outs, results):
                ordered = [builder.shuffle_vector(q[0], q[1], _ORDER[0]), builder.shuffle_vector(q[2], q[3], _ORDER[0]),
                           builder.shuffle_vector(q[0], q[1], _ORDER[1]), builder.shuffle_vector(q[2], q[3], _ORDER[1])]
                for i, v in enumerate(ordered):
                    builder.store(v, builder.bitcast(builder.gep(out, [const(32 * run + 8 * i)]), _V8I32.as_pointer()),
                                  align=4)
        return context.get_dummy_value()

    return codegen


def _dot_intrinsic_avx2(nibbles: bool, cols: int, rows: int):
    def impl(typingctx, isum, ioff, istride, bq, boff, stride, aq, aoff, astride, ngroups):
        if not all(isinstance(x, types.Array) and x.layout == "C" for x in (isum, bq, aq)) or \
                isum.dtype != types.int32 or bq.dtype != types.uint8 or aq.dtype != types.int8:
            return None
        i64 = types.int64
        sig = types.void(isum, i64, i64, bq, i64, i64, aq, i64, i64, i64)
        return sig, _dot_codegen_avx2(nibbles, cols, rows)

    impl.__name__ = impl.__qualname__ = f"_dot{cols}x{rows}_{4 if nibbles else 8}_avx2"
    return intrinsic(impl)


# Which integer kernels this CPU runs: "vnni" (AVX-512 VNNI), "avx2", or None (the float kernels).
INT8_ISA = "vnni" if int8_dot_supported() else "avx2" if int8_avx2_supported() else None
if INT8_ISA == "avx2":
    _dot128x1_4 = _dot_intrinsic_avx2(True, 128, 1)
    _dot64x1_4 = _dot_intrinsic_avx2(True, 64, 1)
    _dot64x4_4 = _dot_intrinsic_avx2(True, 64, 4)
    _dot128x1_8 = _dot_intrinsic_avx2(False, 128, 1)
    _dot64x1_8 = _dot_intrinsic_avx2(False, 64, 1)
    _dot64x4_8 = _dot_intrinsic_avx2(False, 64, 4)
else:
    _dot128x1_4 = _dot_intrinsic(True, 2, 1)
    _dot64x1_4 = _dot_intrinsic(True, 1, 1)
    _dot64x4_4 = _dot_intrinsic(True, 1, 4)
    _dot128x1_8 = _dot_intrinsic(False, 2, 1)
    _dot64x1_8 = _dot_intrinsic(False, 1, 1)
    _dot64x4_8 = _dot_intrinsic(False, 1, 4)


@njit(cache=True, fastmath=_FM)
def _prep_i8(a, aq, asc, blob, bits):
    """A quantized per block as onnxruntime's accuracy_level 4 does: ``asc[0, m, b]`` the block's
    scale ``max|a| / 127``, ``aq[m, b]`` its values ``round_half_even(a / scale)`` (int8, zero past
    K) in the order the ``_dot*`` intrinsics read them, ``asc[1, m, b]`` their sum.

    A block holding a NaN or an infinity gets scale NaN and values 0: every output it touches is
    NaN (the float kernels give NaN or an infinity there), never a finite wrong number.
    """
    m_rows, k = a.shape
    nb = asc.shape[2]
    bs = blob * 8 // bits
    for m in range(m_rows):
        for b in range(nb):
            amax = np.float32(0.0)
            bad = False
            for r in range(bs):
                kk = b * bs + r
                v = abs(a[m, kk]) if kk < k else np.float32(0.0)
                bad |= not (v <= np.float32(3.4028235e38))
                amax = max(amax, v)
            if bad:
                aq[m, b, :] = 0
                asc[0, m, b] = np.float32(np.nan)
                asc[1, m, b] = 0
                continue
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            total = 0
            for r in range(bs):
                kk = b * bs + r
                q = np.int32(np.rint(a[m, kk] * inv)) if kk < k else np.int32(0)
                total += q
                # 4 bits: element 8g + 2i + p (byte 4g + i, nibble p) goes to 8g + 4p + i.
                pos = (r & ~7) + ((r & 1) << 2) + ((r >> 1) & 3) if bits == 4 else r
                aq[m, b, pos] = np.int8(q)
            asc[0, m, b] = amax / np.float32(127.0)
            asc[1, m, b] = np.float32(total)


@njit(cache=True, fastmath=_FM)
def _items_i8(aq, asc, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, bits, it0, it1, isum, acc):
    """Work items ``it0 <= it < it1`` of the int8 GEMV with the caller's (rows, CHUNK) scratch:
    per block, the integer dot products (128 columns of one row, or 64 columns of four rows, at a
    time: the ``_dot*`` intrinsics), then
    ``acc += scale_w * scale_a * (dot - zero_point * sum(a_q))`` in float32."""
    m_rows = aq.shape[0]
    bs = aq.shape[2]
    chunk = isum.shape[1]
    groups = blob // 4
    total, nfull, rem = _items(n, tile)
    for it in range(it0, it1):
        tl, c0, width, cw = _item(it, nfull, rem, tile)
        bbase = tl * tile * nb * blob + c0
        sbase = tl * tile * nb + c0
        acc[:, :cw] = 0
        for b in range(nb):
            boff = bbase + b * blob * width
            m = 0
            # Four rows at a time (prefill): the block's bytes are loaded and transposed once.
            while m + 4 <= m_rows and cw - cw % 64 > 0:
                for c in range(0, cw - cw % 64, 64):
                    if bits == 4:
                        _dot64x4_4(isum, m * chunk + c, chunk, bq, boff + c, width, aq, (m * nb + b) * bs, nb * bs, groups)
                    else:
                        _dot64x4_8(isum, m * chunk + c, chunk, bq, boff + c, width, aq, (m * nb + b) * bs, nb * bs, groups)
                m += 4
            for r in range(m, m_rows):
                c = 0
                if cw == 128:
                    if bits == 4:
                        _dot128x1_4(isum, r * chunk, 0, bq, boff, width, aq, (r * nb + b) * bs, 0, groups)
                    else:
                        _dot128x1_8(isum, r * chunk, 0, bq, boff, width, aq, (r * nb + b) * bs, 0, groups)
                    c = 128
                while c + 64 <= cw:
                    if bits == 4:
                        _dot64x1_4(isum, r * chunk + c, 0, bq, boff + c, width, aq, (r * nb + b) * bs, 0, groups)
                    else:
                        _dot64x1_8(isum, r * chunk + c, 0, bq, boff + c, width, aq, (r * nb + b) * bs, 0, groups)
                    c += 64
            for r in range(m_rows):
                ab = aq[r, b]
                im = isum[r]
                for cc in range(cw - cw % 64, cw):  # the last tile's odd columns
                    s = 0
                    for j in range(blob):
                        v = np.int32(bq[boff + j * width + cc])
                        if bits == 4:
                            base = (j >> 2) * 8 + (j & 3)
                            s += (v & 15) * np.int32(ab[base]) + (v >> 4) * np.int32(ab[base + 4])
                        else:
                            s += v * np.int32(ab[j])
                    im[cc] = s
            soff = sbase + b * width
            srow = sc[soff:soff + cw]
            for m in range(m_rows):
                f = asc[0, m, b]
                qs = asc[1, m, b]
                am = acc[m]
                im = isum[m]
                if zmode == 1:
                    zrow = zq[soff:soff + cw]
                    for cc in range(cw):
                        am[cc] += (_f32(srow[cc]) * f) * (np.float32(im[cc]) - _f32(zrow[cc]) * qs)
                else:
                    zs = zmid * qs
                    for cc in range(cw):
                        am[cc] += (_f32(srow[cc]) * f) * (np.float32(im[cc]) - zs)
        n0 = tl * tile + c0
        for m in range(m_rows):
            for cc in range(cw):
                y[m, n0 + cc] = acc[m, cc]


@njit(cache=True, fastmath=_FM, inline="always")
def _gemv_i8(a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads, bits):
    m_rows = a.shape[0]
    aq = np.empty((m_rows, nb, blob * 8 // bits), np.int8)
    asc = np.empty((2, m_rows, nb), np.float32)
    _prep_i8(a, aq, asc, blob, bits)
    total, nfull, rem = _items(n, tile)
    nth = max(1, min(threads, total))
    for th in prange(nth):
        isum = np.empty((m_rows, CHUNK), np.int32)
        acc = np.empty((m_rows, CHUNK), np.float32)
        _items_i8(aq, asc, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, bits, th * total // nth,
                  (th + 1) * total // nth, isum, acc)


def _gemv4_i8(a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads):
    """:func:`_gemv4` with A quantized to int8 per block (accuracy_level 4; needs VNNI or AVX2)."""
    _gemv_i8(a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads, 4)


def _gemv8_i8(a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads):
    """:func:`_gemv8` with A quantized to int8 per block (accuracy_level 4; needs VNNI or AVX2)."""
    _gemv_i8(a, bq, sc, zq, zmode, zmid, y, n, nb, blob, tile, threads, 8)


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
_I8_MARK, _I32_MARK = np.zeros(0, np.int8), np.zeros(0, np.int32)  # dtype markers for ``as_ptr``
_I64_MARK, _F64_MARK = np.zeros(0, np.int64), np.zeros(0, np.float64)
# Compiled on first call only: on a CPU without VNNI or AVX2 they are never called (``INT8_ISA``).
gemv4_i8 = _compiled(_gemv4_i8, "gemv4_i8", True)
gemv4_i8_serial = _compiled(_gemv4_i8, "gemv4_i8_serial", False)
gemv8_i8 = _compiled(_gemv8_i8, "gemv8_i8", True)
gemv8_i8_serial = _compiled(_gemv8_i8, "gemv8_i8_serial", False)
int8_dot = INT8_ISA is not None


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

def gomp_functions():
    """GNU OpenMP's dynamic-loop functions and ``omp_get_thread_num`` as numba external functions
    (the native OpenMP workers of this module, ``_attn_jit`` and ``_qgemm_jit``), with the library
    loaded so that numba's JIT resolves them: ``(loop_start, loop_next, loop_end, thread_num)``."""
    import llvmlite.binding as llvm

    from onnxpack.session.kernels._native import gomp_library

    llvm.load_library_permanently(gomp_library())
    i64 = types.int64
    return (types.ExternalFunction("GOMP_loop_nonmonotonic_dynamic_start", types.uint8(i64, i64, i64, i64, i64, i64)),
            types.ExternalFunction("GOMP_loop_nonmonotonic_dynamic_next", types.uint8(i64, i64)),
            types.ExternalFunction("GOMP_loop_end_nowait", types.void()),
            types.ExternalFunction("omp_get_thread_num", types.int32()))


def native_entries() -> dict:
    """name -> numba cfunc of every native entry (compiles them: seconds, in the writing process).

    For each weight layout the models use — scales float32 or float16 bits (``u16``), per-block
    zero points uint8 (an empty array when the implicit middle value is used) — and for 4 and 8
    bits: ``gemv{bits}_{sc}`` (serial), ``gemv{bits}_{sc}_prep`` (re-orders the activations) then
    ``gemv{bits}_{sc}_omp`` (an OpenMP worker for ``GOMP_parallel``: every thread takes work items
    from a dynamic loop; no barrier before it) and ``dequant{bits}_{sc}``; on a CPU with VNNI or AVX2 also
    ``gemv{bits}_{sc}_i8``, ``gemv{bits}_{sc}_i8_prep`` and ``gemv{bits}_{sc}_i8_omp`` (A quantized
    to int8 by the prep entry, then the OpenMP worker without a barrier: the argument block's
    ``G_ADE`` is then int8 (M, n_blocks, block_size), ``G_ASUM`` float32 (2, M, n_blocks) and each
    thread's scratch an int32 then a float32 (M, CHUNK) half), and ``gemv{bits}_{sc}_i8_pair``
    (the OpenMP worker of two such GEMVs of one A: the block at ``G_NEXT`` is the second's).
    """
    from numba import carray, cfunc

    from onnxpack.session.kernels import _jit_native as L

    loop_start, loop_next, loop_end, thread_num = gomp_functions()
    sig = types.void(types.voidptr)
    out = {}

    def make(sck, bits):
        scm = F32 if sck == "f32" else U16
        prep, items, deq = (_prep4, _items4, dequant4) if bits == 4 else (_prep8, _items8, dequant8)
        per = 8 // bits  # values per byte: the activations' planes (``_prep4`` / ``_prep8``)

        @njit(inline="always")
        def views(blk):
            return views_of(carray(blk, (L.G_HEADER,), np.int64), carray(blk, (L.G_HEADER,), np.float64))

        @njit(inline="always")
        def views_of(g, gf):
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

        def prep_entry(blk):
            g, a, bq, sc, zq, y, ade, asum, zmid = views(blk)
            prep(a, ade, asum, g[L.G_BLOB])

        def worker(blk):
            # The activations were re-ordered by the caller (``prep_entry``) before the team
            # started: no barrier, so the caller takes work items at once even when the other
            # thread is not scheduled yet.
            g, a, bq, sc, zq, y, ade, asum, zmid = views(blk)
            m = g[L.G_M]
            tid = np.int64(thread_num())
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

        @njit(inline="always")
        def i8_views(blk):
            return i8_views_of(carray(blk, (L.G_HEADER,), np.int64), carray(blk, (L.G_HEADER,), np.float64))

        @njit(inline="always")
        def i8_views_of(g, gf):
            g, a, bq, sc, zq, y, _, _, zmid = views_of(g, gf)
            m, nb = g[L.G_M], g[L.G_NB]
            aq = carray(as_ptr(g[L.G_ADE], _I8_MARK), (m, nb, g[L.G_BLOB] * 8 // bits))
            asc = carray(as_ptr(g[L.G_ASUM], F32), (2, m, nb))
            return g, a, bq, sc, zq, y, aq, asc, zmid

        def serial_i8(blk):
            g, a, bq, sc, zq, y, aq, asc, zmid = i8_views(blk)
            m = g[L.G_M]
            isum = carray(as_ptr(g[L.G_SCRATCH], _I32_MARK), (m, CHUNK))
            acc = carray(as_ptr(g[L.G_SCRATCH] + 4 * m * CHUNK, F32), (m, CHUNK))
            _prep_i8(a, aq, asc, g[L.G_BLOB], bits)
            total, nfull, rem = _items(g[L.G_N], g[L.G_TILE])
            _items_i8(aq, asc, bq, sc, zq, g[L.G_ZMODE], zmid, y, g[L.G_N], g[L.G_NB], g[L.G_BLOB], g[L.G_TILE],
                      bits, 0, total, isum, acc)

        def prep_i8(blk):
            g, a, bq, sc, zq, y, aq, asc, zmid = i8_views(blk)
            _prep_i8(a, aq, asc, g[L.G_BLOB], bits)

        def worker_i8(blk):
            # A was quantized by the caller (``prep_i8``) before the team started: no barrier, so
            # the caller takes work items at once even when the other thread is not scheduled yet.
            g, a, bq, sc, zq, y, aq, asc, zmid = i8_views(blk)
            m = g[L.G_M]
            tid = np.int64(thread_num())
            isum = carray(as_ptr(g[L.G_SCRATCH] + tid * 8 * m * CHUNK, _I32_MARK), (m, CHUNK))
            acc = carray(as_ptr(g[L.G_SCRATCH] + tid * 8 * m * CHUNK + 4 * m * CHUNK, F32), (m, CHUNK))
            total, nfull, rem = _items(g[L.G_N], g[L.G_TILE])
            slot = address(blk) + 8 * (L.G_HEADER + 2 * tid)
            bounds = carray(blk, (L.G_HEADER + 2 * tid + 2,), np.int64)[L.G_HEADER + 2 * tid:]
            if loop_start(0, total, 1, g[L.G_CHUNK], slot, slot + 8):
                while True:
                    _items_i8(aq, asc, bq, sc, zq, g[L.G_ZMODE], zmid, y, g[L.G_N], g[L.G_NB], g[L.G_BLOB],
                              g[L.G_TILE], bits, bounds[0], bounds[1], isum, acc)
                    if not loop_next(slot, slot + 8):
                        break
            loop_end()

        def pair_i8(blk):
            # Two GEMVs of one A — the gated MLP's gate and up projections — in one team: the
            # items of this block's weight, then those of the block at ``G_NEXT`` (same M, K,
            # block size and bits, so the same quantized A, which the caller's ``prep_i8`` on this
            # block wrote into the scratch both blocks address).  One fork-join and one A for two.
            g, a, bq, sc, zq, y, aq, asc, zmid = i8_views(blk)
            g2 = carray(as_ptr(g[L.G_NEXT], _I64_MARK), (L.G_HEADER,))
            _, _, bq2, sc2, zq2, y2, _, _, zmid2 = i8_views_of(g2, carray(as_ptr(g[L.G_NEXT], _F64_MARK),
                                                                          (L.G_HEADER,)))
            m = g[L.G_M]
            tid = np.int64(thread_num())
            isum = carray(as_ptr(g[L.G_SCRATCH] + tid * 8 * m * CHUNK, _I32_MARK), (m, CHUNK))
            acc = carray(as_ptr(g[L.G_SCRATCH] + tid * 8 * m * CHUNK + 4 * m * CHUNK, F32), (m, CHUNK))
            first, nfull, rem = _items(g[L.G_N], g[L.G_TILE])
            second, nfull, rem = _items(g2[L.G_N], g2[L.G_TILE])
            slot = address(blk) + 8 * (L.G_HEADER + 2 * tid)
            bounds = carray(blk, (L.G_HEADER + 2 * tid + 2,), np.int64)[L.G_HEADER + 2 * tid:]
            if loop_start(0, first + second, 1, g[L.G_CHUNK], slot, slot + 8):
                while True:
                    b0, b1 = bounds[0], bounds[1]
                    if b0 < first:
                        _items_i8(aq, asc, bq, sc, zq, g[L.G_ZMODE], zmid, y, g[L.G_N], g[L.G_NB], g[L.G_BLOB],
                                  g[L.G_TILE], bits, b0, min(b1, first), isum, acc)
                    if b1 > first:
                        _items_i8(aq, asc, bq2, sc2, zq2, g2[L.G_ZMODE], zmid2, y2, g2[L.G_N], g2[L.G_NB],
                                  g2[L.G_BLOB], g2[L.G_TILE], bits, max(b0, first) - first, b1 - first, isum, acc)
                    if not loop_next(slot, slot + 8):
                        break
            loop_end()

        made = {}
        int8 = ((f"gemv{bits}_{sck}_i8", serial_i8), (f"gemv{bits}_{sck}_i8_omp", worker_i8),
                (f"gemv{bits}_{sck}_i8_prep", prep_i8), (f"gemv{bits}_{sck}_i8_pair", pair_i8)) if int8_dot else ()
        for name, fn in ((f"gemv{bits}_{sck}", serial), (f"gemv{bits}_{sck}_omp", worker),
                         (f"gemv{bits}_{sck}_prep", prep_entry), (f"dequant{bits}_{sck}", dequant), *int8):
            fn = types_module.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
            made[name] = cfunc(sig, nopython=True, error_model="numpy", fastmath=_FM)(fn)
        return made

    for sck in ("f32", "u16"):
        for bits in (4, 8):
            out.update(make(sck, bits))
    return out


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernels only read.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"a", "bq", "sc", "zq"}))
