"""numba kernels for 8-bit integer GEMMs on AVX-512 VNNI (optional; see :mod:`.qinteger`).

Imported lazily by :mod:`onnxpack.session.kernels.qinteger` on a kernel's first ``run`` — never at
``import onnxpack`` nor at session creation — only when numba is installed, ``ONNXPACK_DISABLE_JIT``
is not ``1`` and this CPU has AVX-512 VNNI (:func:`._nbits_jit.int8_dot_supported`); elsewhere the
exact float32 GEMM of :func:`.qinteger.int_matmul` computes the same integers.

What it computes: ``out[m, n] = sum_k a[m, k] * w[k, n]`` in int32, exactly, for ``a`` uint8
(M, K4*4) and ``w`` the weight's int8 *lanes* (:func:`.qinteger.to_lanes`): the N columns in tiles
of ``TILE`` = 128, a tile of width ``W`` stores, for each group ``g`` of 4 consecutive k, ``W``
lanes of 4 bytes (column c's ``w[4g..4g+3, c]``).  One ``vpdpbusd`` multiplies a broadcast 4-byte
group of A (unsigned) by 16 such lanes (signed) and adds each lane's four products into its int32
sum: 64 multiply-adds per instruction, the weight bytes streamed once per 4 rows of A.  Zero points
and the signed/unsigned shifts are applied by the caller with row and column sums.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from onnxpack.session.kernels._nbits_jit import (_I8, _I32, _I64, _V16, _compiled, accumulate, array_data,
                                                 int8_dot_supported, splat, store_rows, vpdpbusd)

__all__ = ["qgemm", "qgemm_serial", "int8_dot", "TILE", "native_entries"]

TILE = 128


def _qdot_codegen(vecs: int, rows: int):
    """``vecs`` vectors of 16 columns (64 bytes of lanes each, contiguous) for ``rows`` rows of
    A: per group of 4 k, the weight lanes are loaded once and multiplied with each row's
    broadcast group."""

    def codegen(context, builder, sig, args):
        out, ooff, ostride, w, woff, wstride, a, aoff, astride, ngroups = args

        def const(v):
            return ir.Constant(_I64, v)

        outs = [builder.gep(array_data(context, builder, sig.args[0], out, _I32),
                            [builder.add(ooff, builder.mul(const(r), ostride))]) for r in range(rows)]
        wp = builder.gep(array_data(context, builder, sig.args[3], w, _I8), [woff])
        aps = [builder.gep(array_data(context, builder, sig.args[6], a, _I8), [builder.add(aoff, builder.mul(const(r), astride))])
               for r in range(rows)]
        dp = vpdpbusd(builder)

        def step(g, accs):
            row0 = builder.mul(g, wstride)
            wv = [builder.load(builder.bitcast(builder.gep(wp, [builder.add(row0, const(64 * h))]), _V16.as_pointer()),
                               align=1) for h in range(vecs)]
            new = []
            for r in range(rows):
                quad = builder.load(builder.bitcast(builder.gep(aps[r], [builder.mul(g, const(4))]), _I32.as_pointer()),
                                    align=1)
                ab = splat(builder, quad)
                # vpdpbusd: the first factor's bytes are unsigned (A), the second's signed (lanes).
                new.append([builder.call(dp, [acc, ab, v]) for acc, v in zip(accs[r], wv)])
            return new

        store_rows(builder, outs, accumulate(builder, ngroups, rows, vecs, step))
        return context.get_dummy_value()

    return codegen


def _qdot_intrinsic(vecs: int, rows: int):
    def impl(typingctx, out, ooff, ostride, w, woff, wstride, a, aoff, astride, ngroups):
        if not all(isinstance(x, types.Array) and x.layout == "C" for x in (out, w, a)) or \
                out.dtype != types.int32 or w.dtype != types.int8 or a.dtype != types.uint8:
            return None
        i64 = types.int64
        return types.void(out, i64, i64, w, i64, i64, a, i64, i64, i64), _qdot_codegen(vecs, rows)

    impl.__name__ = impl.__qualname__ = f"_qdot{16 * vecs}x{rows}"
    return intrinsic(impl)


# ``_qdot{C}x{R}(out, ooff, ostride, w, woff, wstride, a, aoff, astride, ngroups)``: for R rows r,
# ``out.flat[ooff + r*ostride:][:C]`` = the int32 sums over ``ngroups`` groups g of A's 4 bytes at
# ``a.flat[aoff + r*astride + 4g]`` times the C lanes at ``w.flat[woff + g*wstride:]`` (offsets in
# elements; arrays of any rank, C-contiguous).
_qdot128x1 = _qdot_intrinsic(8, 1)
_qdot64x1 = _qdot_intrinsic(4, 1)
_qdot64x4 = _qdot_intrinsic(4, 4)


@njit(cache=True)
def _tiles(a, w, out, n, groups, t0, t1):
    """Column tiles ``t0 <= t < t1`` of ``out = a @ W`` (see the module docstring)."""
    m_rows = a.shape[0]
    kp = a.shape[1]
    nfull = n // TILE
    for t in range(t0, t1):
        width = TILE if t < nfull else n - nfull * TILE
        base = t * TILE * groups * 4
        n0 = t * TILE
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
        for cc in range(vec, width):  # a last tile's odd columns
            for r in range(m_rows):
                s = 0
                for g in range(groups):
                    off = base + (g * width + cc) * 4
                    for j in range(4):
                        s += np.int32(a[r, 4 * g + j]) * np.int32(w[off + j])
                out[r, n0 + cc] = s


def _qgemm(a, w, out, n, groups, threads):
    """``out[m, n] = sum_k a[m, k] * W[k, n]`` (int32, exact): ``a`` uint8 (M, 4*groups)
    C-contiguous (zero past K), ``w`` the int8 lanes, ``out`` int32 (M, N); tiles shared out over
    ``threads``."""
    ntiles = -(-n // TILE)
    nth = max(1, min(threads, ntiles))
    for th in prange(nth):
        _tiles(a, w, out, n, groups, th * ntiles // nth, (th + 1) * ntiles // nth)


qgemm = _compiled(_qgemm, "qgemm", True)
qgemm_serial = _compiled(_qgemm, "qgemm_serial", False)
int8_dot = int8_dot_supported()


def native_entries() -> dict:
    """name -> numba cfunc of the native entries (see :mod:`._jit_native`), on a CPU with VNNI
    only: ``qgemm`` runs :func:`_tiles` over every tile, ``qgemm_omp`` is a GNU OpenMP worker
    taking tiles from a dynamic loop; the argument block is ``_jit_native.QG_*`` (addresses and
    sizes), then two loop slots per thread."""
    if not int8_dot:
        return {}
    from numba import carray, cfunc

    from onnxpack.session.kernels import _jit_native as L
    from onnxpack.session.kernels._conv_jit import U8, address, as_ptr
    from onnxpack.session.kernels._nbits_jit import _I8_MARK, _I32_MARK, gomp_functions

    loop_start, loop_next, loop_end, thread_num = gomp_functions()

    @njit(inline="always")
    def views(blk):
        b = carray(blk, (L.QG_SLOTS,), np.int64)
        m, kp, n = b[L.QG_M], b[L.QG_KP], b[L.QG_N]
        a = carray(as_ptr(b[L.QG_A], U8), (m, kp))
        w = carray(as_ptr(b[L.QG_W], _I8_MARK), (b[L.QG_WLEN],))
        out = carray(as_ptr(b[L.QG_OUT], _I32_MARK), (m, n))
        return a, w, out, n, b[L.QG_GROUPS]

    def qgemm_entry(blk):
        a, w, out, n, groups = views(blk)
        _tiles(a, w, out, n, groups, 0, -(-n // TILE))

    def qgemm_omp(blk):
        a, w, out, n, groups = views(blk)
        tid = np.int64(thread_num())
        slot = address(blk) + 8 * (L.QG_SLOTS + 2 * tid)
        bounds = carray(blk, (L.QG_SLOTS + 2 * tid + 2,), np.int64)[L.QG_SLOTS + 2 * tid:]
        if loop_start(0, -(-n // TILE), 1, 1, slot, slot + 8):
            while True:
                _tiles(a, w, out, n, groups, bounds[0], bounds[1])
                if not loop_next(slot, slot + 8):
                    break
        loop_end()

    sig = types.void(types.voidptr)
    return {"qgemm": cfunc(sig, nopython=True, error_model="numpy")(qgemm_entry),
            "qgemm_omp": cfunc(sig, nopython=True, error_model="numpy")(qgemm_omp)}


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernels only read.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"a", "w"}))
