"""numba kernels for float32 GEMMs on a pre-packed weight (optional; see :mod:`.linalg`).

Imported lazily by :mod:`onnxpack.session.kernels.linalg` on a kernel's first ``run`` (or its
warm-up thread) — never at ``import onnxpack`` nor at session creation — only when numba is
installed and ``ONNXPACK_DISABLE_JIT`` is not ``1``; elsewhere numpy's BLAS computes the same
product from the same packed buffer (:func:`.linalg.matmul_panels`).

What it computes: ``out = a @ B`` for ``a`` float32 (M, K) C-contiguous and ``B`` (K, N) packed
as *panels* (:func:`.linalg.pack_panels`): ``ceil(N / 64)`` blocks of 64 columns, each ``K`` rows
of 64 contiguous floats, the last one zero-padded.  A micro-kernel keeps ``rows x vecs`` vectors
of float32 sums in registers and per k loads ``vecs`` vectors of one panel row and multiplies them
with each row's broadcast ``a[r, k]`` (fused multiply-add).  With AVX-512 a tile is a whole panel
row: 6 rows x 4 vectors of 16 = 24 of the 32 registers.  Without it (AVX2: 16 registers of 8
floats) a tile is 16 columns of the panel, 6 x 2 = 12 accumulators, and a panel takes four tiles
side by side (the same packed bytes: a tile reads its 16 columns of each 64-float row); the wide
tile there spills and ran at 29 GFLOP/s against OpenBLAS's 73 (AMD EPYC, one thread).  K is cut
into blocks of ``KC`` so a panel's block (``KC * 256`` bytes) stays in L1 while every row of
``a`` passes over it.

Why not numpy's BLAS on the weight as stored: OpenBLAS copies (packs) ``B`` into its own panel
layout inside every call.  For the short activations of encoder models (tens of rows) that copy,
read with a stride of a whole weight row from memory the previous layers pushed out of the
caches, costs as much as the arithmetic.  Measured on the dev machine (one thread, AVX-512,
OpenBLAS 0.3 SkylakeX kernels), the 18 weight GEMMs of a MiniLM-L3 encoder on 32 tokens
(21 MB of weights, cycled as a model runs them): OpenBLAS on the (K, N) weights 5.7 ms, this
kernel on the same row-major weights 5.3-6.1 ms, on panels 3.7 ms (onnxruntime's MLAS on its own
packed weights: 3.9 ms in the model).  Warm in cache the kernel runs 100-113 GFLOP/s against
OpenBLAS's 77-98 on the same shapes (M 32-512, K 384-1536, N 384-3072).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from onnxpack.session.kernels._nbits_jit import (F32, accumulate, array_data, as_ptr, declare, prefetch_fn, row_pointers,
                                                 splat)

__all__ = ["sgemm_panels", "panel_unit", "PANEL_UNIT", "prefetch", "conv_tile6", "conv_tile4", "conv_tile2", "conv_tile1",
           "gtile6", "gtile4", "gtile2", "gtile1", "gtile6h", "gtile4h", "gtile2h", "gtile1h", "tstore", "tstore_bias",
           "HALF", "NR", "KC", "LANES", "TILE"]

NR = 64  # columns per panel: the packed layout (4 vectors of 16 float32)
# Rows of a panel per pass: 32 KB of it, L1-resident while all rows of ``a`` pass.  With 512 (an
# L2-resident block) each 6-row tile read the panel from L2: 512 -> 128 took BERT-base from 159 to
# 153 ms a run on one AVX-512 thread, an encoder FFN GEMM of 32 x 384 x 1536 from 0.447 to 0.389 ms.
KC = 128
# Weights (float32 elements, panels included) from which sgemm_panels prefetches the next block:
# 512 KiB, a quarter of this VM's L2.
PREFETCH_MIN = 1 << 17
# At most this many floats of ``a`` (and at most 6 rows: one tile) make sgemm_panels run each panel
# over all of K at once, in storage order: half of L1, so the rows stay there while the panel
# streams through (one tile reads each block once, so the KC blocks bought no reuse; they only
# made the weight stream jump between panels).  Weights cycled as a model runs them, one thread:
# a GEMV (M = 1) 1280 x 1000 268 -> 206 us, 2048 x 1000 436 -> 341; 4 rows x 1280 292 -> 233,
# 6 x 768 x 768 150 -> 109; with 4 rows of K = 2048 (32 KB) 496 -> 531, 6 x 2048 611 -> 751.
SMALL_A = 6144


def _host_lanes() -> int:
    """float32 lanes of this CPU's widest vector registers: 16 with AVX-512, else 8 (AVX2)."""
    import llvmlite.binding as llvm

    return 16 if llvm.get_host_cpu_features().get("avx512f") else 8


LANES = _host_lanes()
TILE = 64 if LANES == 16 else 16  # columns per micro-tile: 4 vectors of 16, or 2 of 8

_F32, _I64 = ir.FloatType(), ir.IntType(64)
_VF = ir.VectorType(_F32, LANES)


def _const(v: int) -> ir.Constant:
    """An int64 constant."""
    return ir.Constant(_I64, v)


def _vptr(builder, p, i: int):
    """The float32 pointer ``p`` advanced by ``i`` vectors, as a vector pointer."""
    return builder.bitcast(builder.gep(p, [_const(LANES * i)]), _VF.as_pointer())


def _c_typed(dtype, *arrays) -> bool:
    """Whether every numba type in ``arrays`` is a C-contiguous array of ``dtype`` (what the
    intrinsics' pointer arithmetic takes)."""
    return all(isinstance(x, types.Array) and x.layout == "C" and x.dtype == dtype for x in arrays)


def _store_sums(builder, outs, sums) -> None:
    """Each row's vector sums to consecutive vectors at its pointer in ``outs``."""
    for dst, row in zip(outs, sums):
        for i, v in enumerate(row):
            builder.store(v, _vptr(builder, dst, i), align=4)


def _start_sums(builder, acc_in, outs, vecs: int):
    """Each row's ``vecs`` starting accumulators: zero, or (``acc_in != 0``) the vectors at its
    pointer in ``outs`` (what an earlier block of the sum left there)."""
    zero = ir.Constant(_VF, None)
    entry = builder.block
    load = builder.append_basic_block("init.load")
    ready = builder.append_basic_block("init.ready")
    builder.cbranch(builder.icmp_signed("!=", acc_in, ir.Constant(_I64, 0)), load, ready)
    builder.position_at_end(load)
    loaded = [[builder.load(_vptr(builder, out, i), align=4) for i in range(vecs)] for out in outs]
    builder.branch(ready)
    builder.position_at_end(ready)
    inits = []
    for row in loaded:
        phis = []
        for v in row:
            p = builder.phi(_VF)
            p.add_incoming(zero, entry)
            p.add_incoming(v, load)
            phis.append(p)
        inits.append(phis)
    return inits


def _tile_codegen(rows: int, width: int = TILE):
    """``rows`` rows of ``a`` times ``width`` columns of one panel block: ``rows x vecs`` vector
    accumulators, from zero or (``acc != 0``) from the output's current values, stored back at
    the end; the k-th iteration also prefetches cache line ``min(k, pfn - 1)`` of the ``pfn``
    lines at ``w.flat[pfoff:]`` (none when ``pfn <= 0``)."""
    vecs = width // LANES

    def codegen(context, builder, sig, args):
        out, ooff, ostride, w, woff, wstride, a, aoff, astride, nk, acc_in, pfoff, pfn = args

        op = array_data(context, builder, sig.args[0], out, _F32)
        outs = row_pointers(builder, op, ooff, ostride, rows)
        wbase = array_data(context, builder, sig.args[3], w, _F32)
        wp = builder.gep(wbase, [woff])
        ap = array_data(context, builder, sig.args[6], a, _F32)
        aps = row_pointers(builder, ap, aoff, astride, rows)
        fma = declare(builder, f"llvm.fma.v{LANES}f32", _VF)
        hint = prefetch_fn(builder)
        # The starting sums: zero, or what an earlier block of K left in the output.
        inits = _start_sums(builder, acc_in, outs, vecs)
        pre = builder.block
        loop = builder.append_basic_block("k.loop")
        done = builder.append_basic_block("k.done")
        builder.cbranch(builder.icmp_signed(">", nk, _const(0)), loop, done)
        builder.position_at_end(loop)
        k = builder.phi(_I64)
        k.add_incoming(_const(0), pre)
        accs = [[builder.phi(_VF) for _ in range(vecs)] for _ in range(rows)]
        for r in range(rows):
            for i in range(vecs):
                accs[r][i].add_incoming(inits[r][i], pre)
        # One line of the next block a step, among the multiply-adds: a burst of prefetches
        # before the tile filled the core's miss buffers and stalled it until the lines came.
        with builder.if_then(builder.icmp_signed(">", pfn, _const(0))):
            line = builder.select(builder.icmp_signed("<", k, pfn), k, builder.sub(pfn, _const(1)))
            target = builder.gep(wbase, [builder.add(pfoff, builder.mul(line, _const(16)))])
            i32 = ir.IntType(32)
            builder.call(hint, [builder.bitcast(target, ir.IntType(8).as_pointer()), ir.Constant(i32, 0),
                                ir.Constant(i32, 3), ir.Constant(i32, 1)])
        wrow = builder.gep(wp, [builder.mul(k, wstride)])
        wv = [builder.load(_vptr(builder, wrow, i), align=4) for i in range(vecs)]
        new = []
        for r in range(rows):
            s = splat(builder, builder.load(builder.gep(aps[r], [k])), LANES)
            new.append([builder.call(fma, [s, v, acc]) for acc, v in zip(accs[r], wv)])
        k_next = builder.add(k, _const(1))
        end = builder.block
        k.add_incoming(k_next, end)
        for r in range(rows):
            for i in range(vecs):
                accs[r][i].add_incoming(new[r][i], end)
        builder.cbranch(builder.icmp_signed("<", k_next, nk), loop, done)
        builder.position_at_end(done)
        final = []
        for r in range(rows):
            for i in range(vecs):
                p = builder.phi(_VF)
                p.add_incoming(inits[r][i], pre)
                p.add_incoming(new[r][i], end)
                final.append((r, i, p))
        for r, i, p in final:  # (every phi first: LLVM wants them at the top of the block)
            builder.store(p, _vptr(builder, outs[r], i), align=4)
        return context.get_dummy_value()

    return codegen


def _tile_intrinsic(rows: int, width: int = TILE):
    def impl(typingctx, out, ooff, ostride, w, woff, wstride, a, aoff, astride, nk, acc_in, pfoff, pfn):
        if not _c_typed(types.float32, out, w, a):
            return None
        i64 = types.int64
        return types.void(out, i64, i64, w, i64, i64, a, i64, i64, i64, i64, i64, i64), _tile_codegen(rows, width)

    impl.__name__ = impl.__qualname__ = f"_tile{width}x{rows}"
    return intrinsic(impl)


# ``_tileR(out, ooff, ostride, w, woff, wstride, a, aoff, astride, nk, acc, pfoff, pfn)``: for R
# rows r, ``out.flat[ooff + r*ostride:][:TILE]`` (+)= sum over k < nk of ``a.flat[aoff + r*astride + k]``
# times the TILE floats at ``w.flat[woff + k*wstride:]`` (offsets in elements, C-contiguous arrays),
# prefetching the ``pfn`` cache lines at ``w.flat[pfoff:]`` (16 floats apart) one a step.
_tile6 = _tile_intrinsic(6)
_tile4 = _tile_intrinsic(4)
_tile2 = _tile_intrinsic(2)
_tile1 = _tile_intrinsic(1)
# The same over the first HALF columns only (a panel whose output channels end within them:
# conv_windows' and conv_bcast's last panel).  With AVX2 a tile is already 16 columns wide and
# the panel kernels run two of them instead.
HALF = 32
_tile6h, _tile4h, _tile2h, _tile1h = (_tile_intrinsic(rows, min(TILE, HALF)) for rows in (6, 4, 2, 1))


def _gtile_codegen(rows: int, width: int = TILE):
    """:func:`_tile_codegen` with A's elements gathered: row ``r``'s k-th element is at
    ``a.flat[bases[boff + r] + koffs[koff + k]]`` (a convolution's output position ``r`` and
    its k-th (input channel, tap)), without the prefetching."""
    vecs = width // LANES

    def codegen(context, builder, sig, args):
        out, ooff, ostride, w, woff, wstride, a, bases, boff, koffs, koff, nk, acc_in = args

        op = array_data(context, builder, sig.args[0], out, _F32)
        outs = row_pointers(builder, op, ooff, ostride, rows)
        wp = builder.gep(array_data(context, builder, sig.args[3], w, _F32), [woff])
        ap = array_data(context, builder, sig.args[6], a, _F32)
        bp = array_data(context, builder, sig.args[7], bases, _I64)
        kp = builder.gep(array_data(context, builder, sig.args[9], koffs, _I64), [koff])
        aps = [builder.gep(ap, [builder.load(builder.gep(bp, [builder.add(boff, _const(r))]))]) for r in range(rows)]
        fma = declare(builder, f"llvm.fma.v{LANES}f32", _VF)

        def step(k, accs):
            wrow = builder.gep(wp, [builder.mul(k, wstride)])
            wv = [builder.load(_vptr(builder, wrow, i), align=4) for i in range(vecs)]
            ko = builder.load(builder.gep(kp, [k]))
            return [[builder.call(fma, [splat(builder, builder.load(builder.gep(aps[r], [ko])), LANES), v, acc])
                     for acc, v in zip(accs[r], wv)] for r in range(rows)]

        sums = accumulate(builder, nk, rows, vecs, step, _VF, init=_start_sums(builder, acc_in, outs, vecs))
        _store_sums(builder, outs, sums)
        return context.get_dummy_value()

    return codegen


def _gtile_intrinsic(rows: int, width: int = TILE):
    def impl(typingctx, out, ooff, ostride, w, woff, wstride, a, bases, boff, koffs, koff, nk, acc_in):
        if not (_c_typed(types.float32, out, w, a) and _c_typed(types.int64, bases, koffs)):
            return None
        i64 = types.int64
        return (types.void(out, i64, i64, w, i64, i64, a, bases, i64, koffs, i64, i64, i64),
                _gtile_codegen(rows, width))

    impl.__name__ = impl.__qualname__ = f"_gtile{width}x{rows}"
    return intrinsic(impl)


# ``_gtileR(out, ooff, ostride, w, woff, wstride, a, bases, boff, koffs, koff, nk, acc)``: ``_tileR``
# with A's row r, element k at ``a.flat[bases[boff + r] + koffs[koff + k]]`` (no prefetching).
gtile6, gtile4, gtile2, gtile1 = (_gtile_intrinsic(rows) for rows in (6, 4, 2, 1))
gtile6h, gtile4h, gtile2h, gtile1h = (_gtile_intrinsic(rows, min(TILE, HALF)) for rows in (6, 4, 2, 1))


def _transpose_codegen(bias: bool):
    """A ``LANES`` x ``LANES`` block transposed in registers (see ``tstore``): the rows loaded,
    the bias vector added to each (``bias``), then for each bit ``h`` of a lane's index the
    off-diagonal ``h`` x ``h`` blocks of every ``2h`` x ``2h`` block swapped between row pairs (one
    two-source shuffle per row a level: ``LANES * log2(LANES)`` shuffles), the rows stored."""
    lanes = LANES

    def codegen(context, builder, sig, args):
        dst, doff, dstride, src, soff, sstride = args[:6]
        sp = builder.gep(array_data(context, builder, sig.args[3], src, _F32), [soff])
        dp = builder.gep(array_data(context, builder, sig.args[0], dst, _F32), [doff])
        rows = [builder.load(_vptr(builder, p, 0), align=4) for p in row_pointers(builder, sp, _const(0), sstride, lanes)]
        if bias:
            bp = builder.gep(array_data(context, builder, sig.args[6], args[6], _F32), [args[7]])
            b = builder.load(_vptr(builder, bp, 0), align=4)
            rows = [builder.fadd(r, b) for r in rows]
        i32 = ir.IntType(32)
        h = lanes // 2
        while h:
            low = ir.Constant(ir.VectorType(i32, lanes), [j if not j & h else lanes + j - h for j in range(lanes)])
            high = ir.Constant(ir.VectorType(i32, lanes), [j + h if not j & h else lanes + j for j in range(lanes)])
            for i in range(lanes):
                if not i & h:
                    a, c = rows[i], rows[i + h]
                    rows[i], rows[i + h] = builder.shuffle_vector(a, c, low), builder.shuffle_vector(a, c, high)
            h //= 2
        for r, p in zip(rows, row_pointers(builder, dp, _const(0), dstride, lanes)):
            builder.store(r, _vptr(builder, p, 0), align=4)
        return context.get_dummy_value()

    return codegen


@intrinsic
def tstore(typingctx, dst, doff, dstride, src, soff, sstride):
    """``dst.flat[doff + j*dstride + i] = src.flat[soff + i*sstride + j]`` for ``i, j < LANES``
    (float32, C-contiguous; offsets in elements): a block of ``LANES`` x ``LANES`` written
    transposed, in registers.  Why: a panel kernel's sums (positions x 64 channels) go to an
    (M, P) output; element by element that took ~1.9 cycles an element (25 of a 960 <- 160 1x1
    conv's 87 us on a 7x7 map), this ~0.2."""
    if not _c_typed(types.float32, dst, src):
        return None
    i64 = types.int64
    return types.void(dst, i64, i64, src, i64, i64), _transpose_codegen(False)


@intrinsic
def tstore_bias(typingctx, dst, doff, dstride, src, soff, sstride, bias, boff):
    """:func:`tstore` with ``bias.flat[boff + j]`` added to element ``j`` of every source row (the
    destination's row ``j``) before the transpose."""
    if not _c_typed(types.float32, dst, src, bias):
        return None
    i64 = types.int64
    return types.void(dst, i64, i64, src, i64, i64, bias, i64), _transpose_codegen(True)


@intrinsic
def prefetch(typingctx, arr, offset):
    """A hint to fetch the cache line of ``arr.flat[offset]`` (float32, C-contiguous) into every
    cache level; never faults, even past the array's end."""
    if not (isinstance(arr, types.Array) and arr.layout == "C" and arr.dtype == types.float32
            and isinstance(offset, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.gep(array_data(context, builder, sig.args[0], args[0], _F32), [args[1]])
        i32 = ir.IntType(32)
        # read, locality 3 (keep in every level), data cache
        builder.call(prefetch_fn(builder), [builder.bitcast(ptr, ir.IntType(8).as_pointer()), ir.Constant(i32, 0),
                                            ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, types.int64), codegen


def _conv_tile_codegen(rows: int):
    """``rows`` output channels times ``TILE`` consecutive output positions of a stride-1
    convolution, every tap and input channel summed in registers (see ``conv_tileR``)."""
    vecs = TILE // LANES

    def codegen(context, builder, sig, args):
        out, ooff, ostride, x, xoff, xstride, w, woff, wrow, ntaps, nk, taps, acc_in = args

        op = array_data(context, builder, sig.args[0], out, _F32)
        xp = array_data(context, builder, sig.args[3], x, _F32)
        wp = array_data(context, builder, sig.args[6], w, _F32)
        tp = array_data(context, builder, sig.args[11], taps, _I64)
        wrows = row_pointers(builder, wp, woff, wrow, rows)
        fma = declare(builder, f"llvm.fma.v{LANES}f32", _VF)

        def tap(t, accs):
            xt = builder.gep(xp, [builder.add(xoff, builder.load(builder.gep(tp, [t])))])

            def channel(k, accs):
                xv = [builder.load(_vptr(builder, builder.gep(xt, [builder.mul(k, xstride)]), i), align=4) for i in range(vecs)]
                at = builder.add(builder.mul(k, ntaps), t)
                return [[builder.call(fma, [splat(builder, builder.load(builder.gep(wrows[r], [at])), LANES), v, acc])
                         for acc, v in zip(accs[r], xv)] for r in range(rows)]

            return accumulate(builder, nk, rows, vecs, channel, _VF, init=accs)

        outs = row_pointers(builder, op, ooff, ostride, rows)
        sums = accumulate(builder, ntaps, rows, vecs, tap, _VF, init=_start_sums(builder, acc_in, outs, vecs))
        _store_sums(builder, outs, sums)
        return context.get_dummy_value()

    return codegen


def _conv_tile_intrinsic(rows: int):
    def impl(typingctx, out, ooff, ostride, x, xoff, xstride, w, woff, wrow, ntaps, nk, taps, acc_in):
        if not (_c_typed(types.float32, out, x, w) and _c_typed(types.int64, taps)):
            return None
        i64 = types.int64
        return types.void(out, i64, i64, x, i64, i64, w, i64, i64, i64, i64, taps, i64), _conv_tile_codegen(rows)

    impl.__name__ = impl.__qualname__ = f"conv_tile{rows}"
    return intrinsic(impl)


# ``conv_tileR(out, ooff, ostride, x, xoff, xstride, w, woff, wrow, ntaps, nk, taps, acc)``: for R rows
# r, ``out.flat[ooff + r*ostride:][:TILE] (+)=`` (``+=`` when ``acc != 0``) the sum over taps t < ntaps and input channels
# k < nk of ``w.flat[woff + r*wrow + k*ntaps + t]`` (a weight laid out (M, C, taps)) times the
# TILE floats at ``x.flat[xoff + taps[t] + k*xstride:]`` (input channel k's plane shifted by the
# tap's offset).  The accumulators stay in registers over every tap and channel.
conv_tile6 = _conv_tile_intrinsic(6)
conv_tile4 = _conv_tile_intrinsic(4)
conv_tile2 = _conv_tile_intrinsic(2)
conv_tile1 = _conv_tile_intrinsic(1)


@njit(cache=True, nogil=True)
def _rows(dst, doff, ds, w, woff, ws, a, aoff, nk, acc, nxt, nlines):
    """Every row of ``a`` (M, K) times one 64-column block of B (see ``_tileR``): per ``TILE``
    columns of it, tiles of 6 rows, then 4 (two where 6 + 2 would be left), 2 and 1.  Each tile
    prefetches its share of the ``nlines`` cache lines of the next block (at ``w.flat[nxt:]``,
    none when ``nxt < 0``) one line a step of its sum: the first tile over a block otherwise
    waits on it.  Issued all at once before each tile (~85 lines for 32 rows), the prefetches
    barely overlapped the arithmetic (the core's miss buffers fill and the tile waits): with the
    weights coming from L3 or memory (cycled as a model runs them, one thread) a 32 x 384 x 1152
    GEMM took 247 us, 195 with one line a step (no prefetch at all: 257-282); 32 x 1536 x 384
    374 -> 305; BERT-base's 128 x 768 x 3072 within noise (4.11 -> 4.08 ms)."""
    m_rows, k = a.shape
    tiles = 0
    m = 0
    while m < m_rows:  # (the tiles of one TILE-column group, as below)
        left = m_rows - m
        m += 6 if left >= 6 and left != 8 else (4 if left >= 4 else (2 if left >= 2 else 1))
        tiles += 1
    per = min(nk, -(-nlines // (tiles * (NR // TILE)))) if nxt >= 0 else 0
    line = 0
    for c in range(0, NR, TILE):
        m = 0
        while m < m_rows:
            pn = max(0, min(per, nlines - line))
            po = nxt + line * 16
            line += pn
            left = m_rows - m
            if left >= 6 and left != 8:
                _tile6(dst, doff + m * ds + c, ds, w, woff + c, ws, a, aoff + m * k, k, nk, acc, po, pn)
                m += 6
            elif left >= 4:
                _tile4(dst, doff + m * ds + c, ds, w, woff + c, ws, a, aoff + m * k, k, nk, acc, po, pn)
                m += 4
            elif left >= 2:
                _tile2(dst, doff + m * ds + c, ds, w, woff + c, ws, a, aoff + m * k, k, nk, acc, po, pn)
                m += 2
            else:
                _tile1(dst, doff + m * ds + c, ds, w, woff + c, ws, a, aoff + m * k, k, nk, acc, po, pn)
                m += 1


@njit(cache=True, nogil=True)
def sgemm_panels(a, w, out, tail, p0, p1):
    """Panels ``p0 <= p < p1`` of ``out = a @ B`` (see the module docstring): ``a`` (M, K),
    ``w`` the panels flat, ``out`` (M, N), ``tail`` an (M, 64) scratch for a last panel narrower
    than 64 columns (its valid columns are copied to ``out``).  K >= 1.

    While one block of a panel (``KC`` rows of it) is multiplied, the next block in this order
    (the next panel's, or the first panel's of the next ``KC`` rows) is prefetched: the weights
    come from L3 or memory, and the hardware prefetcher does not follow the jump between panels
    (BERT-base's GEMMs, 128 rows, weights cycled as a model runs them, one thread: 120 -> 140
    GFLOP/s at 768 x 768, 124 -> 144 at 3072 x 768; MiniLM's, 32 rows: 76 -> 87).  Only for a
    weight of at least ``PREFETCH_MIN`` floats: a smaller one may be in L2 already (a small model's
    weights stay there between runs), where the hints only cost (32 x 384 x 384 on one weight
    reused: 70 -> 77 us).  A few short rows (``SMALL_A``) take each panel whole instead."""
    m_rows, k = a.shape
    n = out.shape[1]
    full = n // NR
    ahead = w.shape[0] >= PREFETCH_MIN
    if m_rows <= 6 and m_rows * k <= SMALL_A:
        # One tile holds every row: each panel whole, panel after panel (see SMALL_A); the same
        # chain of multiply-adds per output as the blocks below, so the same bits.
        for p in range(p0, p1):
            if p < full:
                _rows(out, p * NR, n, w, p * k * NR, NR, a, 0, k, 0, -1, 0)
            else:
                _rows(tail, 0, NR, w, p * k * NR, NR, a, 0, k, 0, -1, 0)
    else:
        for k0 in range(0, k, KC):
            nk = min(KC, k - k0)
            acc = 1 if k0 > 0 else 0
            for p in range(p0, p1):
                if not ahead:
                    nxt, nlines = -1, 0
                elif p + 1 < p1:
                    nxt, nlines = (p + 1) * k * NR + k0 * NR, nk * NR // 16
                elif k0 + KC < k:
                    nxt, nlines = p0 * k * NR + (k0 + KC) * NR, min(KC, k - k0 - KC) * NR // 16
                else:
                    nxt, nlines = -1, 0
                if p < full:
                    _rows(out, p * NR, n, w, p * k * NR + k0 * NR, NR, a, k0, nk, acc, nxt, nlines)
                else:
                    _rows(tail, 0, NR, w, p * k * NR + k0 * NR, NR, a, k0, nk, acc, nxt, nlines)
    if p1 > full:
        c0 = full * NR
        for r in range(m_rows):
            for c in range(n - c0):
                out[r, c0 + c] = tail[r, c]


# The unit table of :func:`panel_unit` (int64; ``_spin_jit.U_ARGS`` = 3 header slots first):
# A's address, rows M and K; rows per unit; panels per unit and panel groups (a unit is one
# group of rows times one panel group: unit u = row group u // groups + panel group u % groups);
# the panels in all; the weights' count; then per weight (side by side, panel after panel) its
# panels' address, panel count, columns N, the output's address (M, N) and the tail scratch's
# (M, 64; 0 when N is a multiple of 64).
T_A, T_M, T_K, T_ROWS, T_PANELS, T_PANEL_GROUPS, T_ALL, T_WEIGHTS = range(3, 11)
T_W0, T_WLEN = 11, 5


@cfunc(types.void(types.CPointer(types.int64), types.int64), cache=True)
def panel_unit(table, u):
    """One unit of a GEMM on panels split over threads without the GIL (``_act.run_units``): its
    rows of ``a`` times its panels of each weight, by :func:`sgemm_panels` (so the same bits as
    the same panels computed on one thread)."""
    head = carray(table, (T_W0,))
    t = carray(table, (T_W0 + T_WLEN * head[T_WEIGHTS],))
    m, k = t[T_M], t[T_K]
    groups = t[T_PANEL_GROUPS]
    rg = u // groups
    r0 = rg * t[T_ROWS]
    rows = min(m, r0 + t[T_ROWS]) - r0
    q0 = (u - rg * groups) * t[T_PANELS]
    q1 = min(t[T_ALL], q0 + t[T_PANELS])
    a = carray(as_ptr(t[T_A] + 4 * r0 * k, F32), (rows, k))
    first = 0
    for j in range(t[T_WEIGHTS]):
        b = T_W0 + T_WLEN * j
        count, n = t[b + 1], t[b + 2]
        lo, hi = max(q0, first) - first, min(q1, first + count) - first
        if lo < hi:
            w = carray(as_ptr(t[b], F32), (count * k * NR,))
            out = carray(as_ptr(t[b + 3] + 4 * r0 * n, F32), (rows, n))
            tail = carray(as_ptr(t[b + 4] + 4 * r0 * NR, F32), (rows if t[b + 4] else 0, NR))
            sgemm_panels(a, w, out, tail, lo, hi)
        first += count


PANEL_UNIT = panel_unit.address


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernels only read.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"a", "w"}))
