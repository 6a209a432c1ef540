"""numba kernels for 8-bit integer GEMMs on AVX-512 VNNI or AVX2 (optional; see :mod:`.qinteger`).

Imported lazily by :mod:`onnxpack.session.kernels.qinteger` on a kernel's first ``run`` — never at
``import onnxpack`` nor at session creation — only when numba is installed, ``ONNXPACK_DISABLE_JIT``
is not ``1`` and this CPU has AVX-512 VNNI (:func:`._nbits_jit.int8_dot_supported`) or AVX2;
elsewhere the exact float32 GEMM of :func:`.qinteger.int_matmul` computes the same integers.

What it computes: ``out[m, n] = sum_k a[m, k] * w[k, n]`` in int32, exactly, for ``a`` uint8
(M, K4*4) and ``w`` the weight's int8 *lanes* (:func:`.qinteger.to_lanes`): the N columns in tiles
of ``TILE`` = 128, a tile of width ``W`` stores, for each group ``g`` of 4 consecutive k, ``W``
lanes of 4 bytes (column c's ``w[4g..4g+3, c]``).  One ``vpdpbusd`` multiplies a broadcast 4-byte
group of A (unsigned) by 16 such lanes (signed) and adds each lane's four products into its int32
sum: 64 multiply-adds per instruction, the weight bytes streamed once per 4 rows of A.  Zero points
and the signed/unsigned shifts are applied by the caller with row and column sums.

On AVX2 (no VNNI) the same lanes are multiplied with ``vpmaddubsw`` (unsigned bytes of A times
signed lanes, adjacent pairs added into int16) and ``vpmaddwd`` (adjacent int16 pairs into int32):
a 256-bit vector is 8 columns' lanes.  ``vpmaddubsw`` saturates a pair whose sum leaves int16 —
255 * -128 twice does — which onnxruntime's u8s8 kernels accept; here each byte of A is split into
its low 7 bits and its top bit (``a = lo + 128 * hi``), whose pair sums stay within
2 * 127 * 128 = 32,512 and 2 * 128: ``vpmaddwd`` adds the low pairs by 1 and the high pairs by 128
into the same int32 sums, exactly ``vpdpbusd``'s integers.  Two multiplies per product instead
of one: on the AMD EPYC here a 32 x 1024 @ 1024 x 8210 product (ddddocr's quantized classifier)
took 22 ms through the exact float32 GEMM (the lanes unpacked per call) and ~7 ms this way
(onnxruntime's saturating kernel: 5.7 ms).  For a weight none of whose lanes is -128 (int8
quantized symmetrically, [-127, 127]) the GEMM sums ``(a - 128) * w`` instead: ``|a - 128|``
(at most 128, unsigned) times the lane signed like ``a - 128`` (``vpsignb``), pair sums within
2 * 128 * 127: one multiply per product, and the caller adds ``128 * colsum`` back (32 x 512 @
512 x 2048, one thread: 1.10 -> 0.82 ms).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from onnxpack.session.kernels._nbits_jit import (_I8, _I32, _I64, _V16, _V8I32, _V16I16, _V32I8, _avx2_fn, _compiled,
                                                 accumulate, array_data, int8_avx2_supported, int8_dot_supported,
                                                 row_pointers, splat, store_rows, vpdpbusd)

__all__ = ["qgemm", "qgemm_serial", "int8_dot", "available", "TILE", "native_entries"]

TILE = 128


def _qdot_setup(context, builder, sig, args, rows: int, vecs: int, vbytes: int, vtype):
    """What every ``_qdot`` codegen starts from: the ``rows`` output row pointers, and
    ``loads(g)``: group ``g``'s ``vecs`` weight vectors (``vbytes`` bytes of lanes each, type
    ``vtype``) and each row's 4-byte group of A as an int32."""
    out, ooff, ostride, w, woff, wstride, a, aoff, astride, ngroups = args

    def const(v):
        return ir.Constant(_I64, v)

    outs = row_pointers(builder, array_data(context, builder, sig.args[0], out, _I32), ooff, ostride, rows)
    wp = builder.gep(array_data(context, builder, sig.args[3], w, _I8), [woff])
    aps = row_pointers(builder, array_data(context, builder, sig.args[6], a, _I8), aoff, astride, rows)

    def loads(g):
        row0 = builder.mul(g, wstride)
        wv = [builder.load(builder.bitcast(builder.gep(wp, [builder.add(row0, const(vbytes * h))]), vtype.as_pointer()),
                           align=1) for h in range(vecs)]
        quads = [builder.load(builder.bitcast(builder.gep(ap, [builder.mul(g, const(4))]), _I32.as_pointer()), align=1)
                 for ap in aps]
        return wv, quads

    return outs, loads, ngroups, const


def _qdot_codegen(vecs: int, rows: int):
    """``vecs`` vectors of 16 columns (64 bytes of lanes each, contiguous) for ``rows`` rows of
    A: per group of 4 k, the weight lanes are loaded once and multiplied with each row's
    broadcast group."""

    def codegen(context, builder, sig, args):
        outs, loads, ngroups, _ = _qdot_setup(context, builder, sig, args, rows, vecs, 64, _V16)
        dp = vpdpbusd(builder)

        def step(g, accs):
            wv, quads = loads(g)
            # vpdpbusd: the first factor's bytes are unsigned (A), the second's signed (lanes).
            return [[builder.call(dp, [acc, splat(builder, quad), v]) for acc, v in zip(acc_row, wv)]
                    for acc_row, quad in zip(accs, quads)]

        store_rows(builder, outs, accumulate(builder, ngroups, rows, vecs, step))
        return context.get_dummy_value()

    return codegen


def _qdot_avx2_codegen(vecs: int, rows: int, signs: bool = False):
    """AVX2 code of the ``_qdot`` intrinsics (see the module docstring): ``vecs`` vectors of 8
    columns (32 bytes of lanes each, contiguous) for ``rows`` rows of A; each row's broadcast
    group is split once into its bytes' low 7 bits and top bits, for every vector.  ``signs``:
    the sums of ``(a - 128) * w`` instead, for weights without -128 (see :func:`_qgemm_avx2`)."""

    def codegen(context, builder, sig, args):
        outs, loads, ngroups, const = _qdot_setup(context, builder, sig, args, rows, vecs, 32, _V32I8)

        def i32s(v):
            return ir.Constant(_V8I32, [ir.Constant(_I32, v)] * 8)

        maddubs = _avx2_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, _V32I8)
        maddwd = _avx2_fn(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, _V16I16)
        psign = _avx2_fn(builder, "llvm.x86.avx2.psign.b", _V32I8, _V32I8)
        ones = ir.Constant(_V16I16, [ir.Constant(ir.IntType(16), 1)] * 16)
        c128 = ir.Constant(_V16I16, [ir.Constant(ir.IntType(16), 128)] * 16)
        low7, top, seven, flip = i32s(0x7F7F7F7F), i32s(0x01010101), i32s(7), i32s(0x80808080 - 2**32)
        zero8 = ir.Constant(_V32I8, [ir.Constant(_I8, 0)] * 32)

        def row_signs(acc_row, quad, wv):
            # a - 128 as signed bytes; |a - 128| (at most 128) times each lane's w signed like
            # a - 128 (|w| <= 127): every pair sum within 2 * 128 * 127 = 32,512.
            sa = builder.bitcast(builder.xor(splat(builder, quad, 8), flip), _V32I8)
            mag = builder.select(builder.icmp_signed("<", sa, zero8), builder.sub(zero8, sa), sa)
            return [builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [mag, builder.call(psign, [v, sa])]), ones]))
                    for acc, v in zip(acc_row, wv)]

        def row_split(acc_row, quad, wv):
            ab = splat(builder, quad, 8)
            lo = builder.bitcast(builder.and_(ab, low7), _V32I8)
            hi = builder.bitcast(builder.and_(builder.lshr(ab, seven), top), _V32I8)
            # vpmaddubsw: the first factor's bytes are unsigned (A's parts), the second's signed.
            return [builder.add(builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [lo, v]), ones])),
                                builder.call(maddwd, [builder.call(maddubs, [hi, v]), c128]))
                    for acc, v in zip(acc_row, wv)]

        combine = row_signs if signs else row_split

        def step(g, accs):
            wv, quads = loads(g)
            return [combine(acc_row, quad, wv) for acc_row, quad in zip(accs, quads)]

        results = accumulate(builder, ngroups, rows, vecs, step, _V8I32)
        for dst, res_row in zip(outs, results):
            for i, res in enumerate(res_row):
                builder.store(res, builder.bitcast(builder.gep(dst, [const(8 * i)]), _V8I32.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _qdot_intrinsic(vecs: int, rows: int, avx2: bool = False, signs: bool = False):
    def impl(typingctx, out, ooff, ostride, w, woff, wstride, a, aoff, astride, ngroups):
        if not all(isinstance(x, types.Array) and x.layout == "C" for x in (out, w, a)) or \
                out.dtype != types.int32 or w.dtype != types.int8 or a.dtype != types.uint8:
            return None
        i64 = types.int64
        gen = _qdot_avx2_codegen(vecs, rows, signs) if avx2 else _qdot_codegen(vecs, rows)
        return types.void(out, i64, i64, w, i64, i64, a, i64, i64, i64), gen

    impl.__name__ = impl.__qualname__ = (f"_qdot{(8 if avx2 else 16) * vecs}x{rows}{'_avx2' if avx2 else ''}"
                                         f"{'_signs' if signs else ''}")
    return intrinsic(impl)


# ``_qdot{C}x{R}(out, ooff, ostride, w, woff, wstride, a, aoff, astride, ngroups)``: for R rows r,
# ``out.flat[ooff + r*ostride:][:C]`` = the int32 sums over ``ngroups`` groups g of A's 4 bytes at
# ``a.flat[aoff + r*astride + 4g]`` times the C lanes at ``w.flat[woff + g*wstride:]`` (offsets in
# elements; arrays of any rank, C-contiguous).
_qdot128x1 = _qdot_intrinsic(8, 1)
_qdot64x1 = _qdot_intrinsic(4, 1)
_qdot64x4 = _qdot_intrinsic(4, 4)
# The same on AVX2, 8 columns a vector.
_qdot16x4_avx2 = _qdot_intrinsic(2, 4, True)
_qdot8x4_avx2 = _qdot_intrinsic(1, 4, True)
_qdot32x1_avx2 = _qdot_intrinsic(4, 1, True)
_qdot8x1_avx2 = _qdot_intrinsic(1, 1, True)
# ... and their sums of (a - 128) * w, for weights without -128.
_qdot16x4_signs = _qdot_intrinsic(2, 4, True, True)
_qdot8x4_signs = _qdot_intrinsic(1, 4, True, True)
_qdot32x1_signs = _qdot_intrinsic(4, 1, True, True)
_qdot8x1_signs = _qdot_intrinsic(1, 1, True, True)


@njit(cache=True, inline="always")
def _tile(t, n, groups):
    """Column tile ``t`` of the lanes: its width (TILE, or the last tile's rest), the offset of its
    bytes in the lanes, its first column."""
    nfull = n // TILE
    return (TILE if t < nfull else n - nfull * TILE), t * TILE * groups * 4, t * TILE


@njit(cache=True)
def _odd_columns(a, w, out, n, groups, base, n0, width, c0, shift):
    """Columns ``c0 <= c < width`` of one tile (those no vector covers), one product at a time:
    the sums of ``(a - shift) * w``."""
    for cc in range(c0, width):
        for r in range(a.shape[0]):
            s = 0
            for g in range(groups):
                off = base + (g * width + cc) * 4
                for j in range(4):
                    s += (np.int32(a[r, 4 * g + j]) - shift) * np.int32(w[off + j])
            out[r, n0 + cc] = s


@njit(cache=True)
def _tiles_avx2(a, w, out, n, groups, t0, t1, signs):
    """:func:`_tiles` on AVX2: 16 columns x 4 rows per pass, then 8 columns; leftover rows 32
    columns at a time, then 8.  ``signs``: every column holds the sums of ``(a - 128) * w``
    (see :func:`_qgemm_avx2`)."""
    m_rows = a.shape[0]
    kp = a.shape[1]
    for t in range(t0, t1):
        width, base, n0 = _tile(t, n, groups)
        vec = width - width % 8
        m = 0
        while m + 4 <= m_rows and vec > 0:
            c = 0
            while c + 16 <= vec:
                if signs:
                    _qdot16x4_signs(out, m * n + n0 + c, n, w, base + 4 * c, 4 * width, a, m * kp, kp, groups)
                else:
                    _qdot16x4_avx2(out, m * n + n0 + c, n, w, base + 4 * c, 4 * width, a, m * kp, kp, groups)
                c += 16
            if c < vec:
                if signs:
                    _qdot8x4_signs(out, m * n + n0 + c, n, w, base + 4 * c, 4 * width, a, m * kp, kp, groups)
                else:
                    _qdot8x4_avx2(out, m * n + n0 + c, n, w, base + 4 * c, 4 * width, a, m * kp, kp, groups)
            m += 4
        for r in range(m, m_rows):
            c = 0
            while c + 32 <= vec:
                if signs:
                    _qdot32x1_signs(out, r * n + n0 + c, 0, w, base + 4 * c, 4 * width, a, r * kp, 0, groups)
                else:
                    _qdot32x1_avx2(out, r * n + n0 + c, 0, w, base + 4 * c, 4 * width, a, r * kp, 0, groups)
                c += 32
            while c < vec:
                if signs:
                    _qdot8x1_signs(out, r * n + n0 + c, 0, w, base + 4 * c, 4 * width, a, r * kp, 0, groups)
                else:
                    _qdot8x1_avx2(out, r * n + n0 + c, 0, w, base + 4 * c, 4 * width, a, r * kp, 0, groups)
                c += 8
        _odd_columns(a, w, out, n, groups, base, n0, width, vec, 128 if signs else 0)


@njit(cache=True)
def _tiles(a, w, out, n, groups, t0, t1):
    """Column tiles ``t0 <= t < t1`` of ``out = a @ W`` (see the module docstring)."""
    m_rows = a.shape[0]
    kp = a.shape[1]
    for t in range(t0, t1):
        width, base, n0 = _tile(t, n, groups)
        vec = width - width % 64
        m = 0
        while m + 4 <= m_rows and vec > 0:
            for c in range(0, vec, 64):
                _qdot64x4(out, m * n + n0 + c, n, w, base + 4 * c, 4 * width, a, m * kp, kp, groups)
            m += 4
        for r in range(m, m_rows):
            c = 0
            if vec == 128:
                _qdot128x1(out, r * n + n0, 0, w, base, 4 * width, a, r * kp, 0, groups)
                c = 128
            while c < vec:
                _qdot64x1(out, r * n + n0 + c, 0, w, base + 4 * c, 4 * width, a, r * kp, 0, groups)
                c += 64
        _odd_columns(a, w, out, n, groups, base, n0, width, vec, 0)  # a last tile's odd columns


def _qgemm(a, w, out, n, groups, threads, signs):
    """``out[m, n] = sum_k a[m, k] * W[k, n]`` (int32, exact): ``a`` uint8 (M, 4*groups)
    C-contiguous (zero past K), ``w`` the int8 lanes, ``out`` int32 (M, N); tiles shared out over
    ``threads``.  (``signs``: see :func:`_qgemm_avx2`; VNNI's products need no such form.)"""
    ntiles = -(-n // TILE)
    nth = max(1, min(threads, ntiles))
    for th in prange(nth):
        _tiles(a, w, out, n, groups, th * ntiles // nth, (th + 1) * ntiles // nth)


def _qgemm_avx2(a, w, out, n, groups, threads, signs):
    """:func:`_qgemm` on AVX2.  With ``signs`` (1), for a weight none of whose lanes is -128, the
    sums of ``(a - 128) * W`` instead — ``|a - 128|`` times each lane signed like ``a - 128``,
    one ``vpmaddubsw`` per 32 products where the split form takes two; the caller adds ``128 *
    colsum(W)``."""
    ntiles = -(-n // TILE)
    nth = max(1, min(threads, ntiles))
    for th in prange(nth):
        _tiles_avx2(a, w, out, n, groups, th * ntiles // nth, (th + 1) * ntiles // nth, signs)


int8_dot = int8_dot_supported()
# Whether this CPU runs the int8 GEMM: with VNNI, else with AVX2's multiply-adds.
available = int8_dot or int8_avx2_supported()
# Whether ``qgemm(..., signs=1)`` computes the sums of (a - 128) * W (AVX2; VNNI ignores it).
signs_form = available and not int8_dot
if int8_dot:
    qgemm = _compiled(_qgemm, "qgemm", True)
    qgemm_serial = _compiled(_qgemm, "qgemm_serial", False)
else:
    qgemm = _compiled(_qgemm_avx2, "qgemm_avx2", True)
    qgemm_serial = _compiled(_qgemm_avx2, "qgemm_avx2_serial", False)

@njit(cache=True)
def _tiles_vnni(a, w, out, n, groups, t0, t1, signs):
    _tiles(a, w, out, n, groups, t0, t1)


_tiles_here = _tiles_vnni if int8_dot else _tiles_avx2


def native_entries() -> dict:
    """name -> numba cfunc of the native entries (see :mod:`._jit_native`), on a CPU with VNNI
    or AVX2: ``qgemm`` runs this CPU's tiles (:func:`_tiles` or :func:`_tiles_avx2`) over every
    tile, ``qgemm_omp`` is a GNU OpenMP worker taking tiles from a dynamic loop; the argument
    block is ``_jit_native.QG_*`` (addresses and sizes), then two loop slots per thread."""
    if not available:
        return {}
    tiles = _tiles_here
    from numba import carray, cfunc

    from onnxpack.session.kernels import _jit_native as L
    from onnxpack.session.kernels._nbits_jit import _I8_MARK, _I32_MARK, U8, address, as_ptr, gomp_functions

    loop_start, loop_next, loop_end, thread_num = gomp_functions()

    @njit(inline="always")
    def views(blk):
        b = carray(blk, (L.QG_SLOTS,), np.int64)
        m, kp, n = b[L.QG_M], b[L.QG_KP], b[L.QG_N]
        a = carray(as_ptr(b[L.QG_A], U8), (m, kp))
        w = carray(as_ptr(b[L.QG_W], _I8_MARK), (b[L.QG_WLEN],))
        out = carray(as_ptr(b[L.QG_OUT], _I32_MARK), (m, n))
        return a, w, out, n, b[L.QG_GROUPS], b[L.QG_SIGNS]

    def qgemm_entry(blk):
        a, w, out, n, groups, signs = views(blk)
        tiles(a, w, out, n, groups, 0, -(-n // TILE), signs)

    def qgemm_omp(blk):
        a, w, out, n, groups, signs = views(blk)
        tid = np.int64(thread_num())
        slot = address(blk) + 8 * (L.QG_SLOTS + 2 * tid)
        bounds = carray(blk, (L.QG_SLOTS + 2 * tid + 2,), np.int64)[L.QG_SLOTS + 2 * tid:]
        if loop_start(0, -(-n // TILE), 1, 1, slot, slot + 8):
            while True:
                tiles(a, w, out, n, groups, bounds[0], bounds[1], signs)
                if not loop_next(slot, slot + 8):
                    break
        loop_end()

    def signs_form_marker(blk):  # present in a build whose qgemm honours signs (AVX2)
        pass

    sig = types.void(types.voidptr)
    entries = {"qgemm": cfunc(sig, nopython=True, error_model="numpy")(qgemm_entry),
               "qgemm_omp": cfunc(sig, nopython=True, error_model="numpy")(qgemm_omp)}
    if signs_form:
        entries["qgemm_signs_form"] = cfunc(sig, nopython=True, error_model="numpy")(signs_form_marker)
    return entries


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernels only read.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"a", "w"}))
