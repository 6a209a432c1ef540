"""numba kernels for one decoding step of GroupQueryAttention (optional; the numpy twin is
``attention.GroupQueryAttention``'s general path), and for whole-sequence attention over blocks
of heads (:func:`attend_heads`; its numpy twin is ``attention._attend_products``).

Imported lazily (:func:`onnxpack.session.kernels._act.load_jit`) on the first decoding step, only
when numba is installed and ``ONNXPACK_DISABLE_JIT`` is not ``1``; processes that find the native
code cache (:mod:`._jit_native`) call :func:`gqa_decode`'s compiled entry without numba.

One token of one sequence: the numpy path makes ~40 numpy calls per layer (rotary of q and k,
cache writes, two products, a softmax), ~100-150 us per layer on Qwen2.5-0.5B's shapes of which
~5 us is arithmetic.  Here it is one call that allocates nothing: the caller passes the scratch.

``fastmath={"contract", "reassoc"}``: the dot products over the head dimension are reductions,
which vectorize only when they may be reassociated (numpy's BLAS also sums in its own order).
No finite-math assumption: NaN and Inf propagate as in numpy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types

from onnxpack.session.kernels._conv_jit import _LANES, _expf
from onnxpack.session.kernels._sgemm_jit import KC, _rows
from onnxpack.session.kernels._sgemm_jit import NR as _PANEL  # the packed operands' panel width

__all__ = ["attend_heads", "gqa_decode", "native_entries"]

_FM = {"contract", "reassoc"}


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy", inline="always")
def _rotate(x, cos, sin, half, interleaved, out):
    """``out`` = ``x`` with its first ``2 * half`` features rotated by (cos, sin) (the halves or
    the interleaved pairs layout), the rest copied."""
    h = x.shape[0]
    if interleaved:
        for i in range(half):
            a = x[2 * i]
            b = x[2 * i + 1]
            out[2 * i] = a * cos[i] - b * sin[i]
            out[2 * i + 1] = a * sin[i] + b * cos[i]
    else:
        for i in range(half):
            a = x[i]
            b = x[i + half]
            out[i] = a * cos[i] - b * sin[i]
            out[i + half] = a * sin[i] + b * cos[i]
    for i in range(2 * half, h):
        out[i] = x[i]


@njit(cache=True, fastmath={"contract"}, nogil=True, error_model="numpy")
def _exp_shifted(scores, count, m):
    """``scores[:count] = exp(scores - m)`` with ``_conv_jit._expf`` (vectorizes; within 1 ulp),
    compiled without ``reassoc``: its range reduction must keep its order."""
    for j in range(count):
        scores[j] = _expf(scores[j] - m)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def gqa_decode(q, k, v, pk, pv, pos, lo, cos, sin, half, interleaved, scale, softcap, out, qr, scores):
    """Attention of one new token at position ``pos`` over cache rows ``lo .. pos``.

    ``q`` (N, H), ``k``/``v`` (Nkv, H): the token's projections (not rotated); ``pk``/``pv``
    (Nkv, C, H): the caches, whose row ``pos`` receives the rotated ``k`` and ``v``; ``cos``/``sin``
    (half,) at ``pos`` (``half`` 0: no rotary); ``out`` (N, H).  Scratch: ``qr`` (H,) and
    ``scores`` (at least ``pos + 1 - lo``).  Query head i reads KV head ``i // (N / Nkv)``.
    ``softcap`` > 0 caps the scaled scores as ``softcap * tanh(s / softcap)``.

    One head at a time: dot products four keys at a time (vectorized over the head dimension),
    the softmax, then the value rows weighted into the output four at a time (measured one
    thread, 14 heads over 2 KV heads of 64: 7 us at 40 keys, 28 us at 200, 133 us at 1,000,
    against 12, 51 and 250 us one key at a time; all query heads of a KV head per key row ran
    slower still).
    """
    n, h = q.shape
    nkv = k.shape[0]
    group = n // nkv
    t = pos + 1
    count = t - lo
    for g in range(nkv):
        _rotate(k[g], cos, sin, half, interleaved, pk[g, pos])
        vrow = pv[g, pos]
        for d in range(h):
            vrow[d] = v[g, d]
    for i in range(n):
        g = i // group
        _rotate(q[i], cos, sin, half, interleaved, qr)
        kg = pk[g]
        # Four keys per pass: each element of the rotated query is loaded once for four dot
        # products (four independent vectorized sums), then the scores are scaled (and capped).
        j = 0
        while j + 4 <= count:
            k0 = kg[lo + j]
            k1 = kg[lo + j + 1]
            k2 = kg[lo + j + 2]
            k3 = kg[lo + j + 3]
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for d in range(h):
                qd = qr[d]
                s0 += qd * k0[d]
                s1 += qd * k1[d]
                s2 += qd * k2[d]
                s3 += qd * k3[d]
            scores[j] = s0
            scores[j + 1] = s1
            scores[j + 2] = s2
            scores[j + 3] = s3
            j += 4
        while j < count:
            kj = kg[lo + j]
            s = np.float32(0.0)
            for d in range(h):
                s += qr[d] * kj[d]
            scores[j] = s
            j += 1
        m = -np.inf
        for j in range(count):
            s = scores[j] * scale
            if softcap > 0:
                s = softcap * np.float32(math.tanh(s / softcap))
            scores[j] = s
            m = max(m, s)
        _exp_shifted(scores, count, m)
        total = np.float32(0.0)
        for j in range(count):
            total += scores[j]
        for j in range(count):
            scores[j] = scores[j] / total
        o = out[i]
        for d in range(h):
            o[d] = 0
        vg = pv[g]
        # Four value rows per pass: the output row is loaded and stored once for four keys.
        j = 0
        while j + 4 <= count:
            p0 = scores[j]
            p1 = scores[j + 1]
            p2 = scores[j + 2]
            p3 = scores[j + 3]
            v0 = vg[lo + j]
            v1 = vg[lo + j + 1]
            v2 = vg[lo + j + 2]
            v3 = vg[lo + j + 3]
            for d in range(h):
                o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
            j += 4
        while j < count:
            p = scores[j]
            vj = vg[lo + j]
            for d in range(h):
                o[d] += p * vj[d]
            j += 1


@njit(cache=True, fastmath={"contract"}, nogil=True, error_model="numpy")
def attend_heads(q, k, v, bias, scale, divide, floor, out, i0, i1):
    """Heads ``i0 <= i < i1`` (``i = b * N + n``) of ``softmax(scale * q @ k^T + bias) @ v``, as
    :func:`attention._attend_products` computes it without softcap, masks or sinks: one call a
    block of heads, no GIL, so a thread pool runs heads side by side.

    ``q`` (B, N, S, H), ``k``/``v`` (B, Nkv, T, H) float32 of any strides (query head ``n`` reads
    KV head ``n // (N / Nkv)``); ``bias`` float32 (B|1, N|1, S|1, T), or T = 0 for none;
    ``out`` (B, N, S, H).  The scores are ``q @ k^T`` times ``scale`` (divided by it when
    ``divide``), then plus the bias: two roundings, as two nodes or numpy's two passes make them.
    ``floor`` bounds each row's maximum from below: the lowest float makes a row of -inf scores
    weights of 0 (the attention ops' rule), -inf makes them NaN (Softmax's).

    Per head: q copied to rows, K^T and V packed into 64-column panels (once per KV head and
    batch), ``q @ k^T`` and ``p @ v`` by the panel GEMM's tiles (``_sgemm_jit._rows``), and between
    them each row's softmax as the numpy path computes it: the row's maximum (at least ``floor``),
    ``_expf`` of the differences, their sum (1 where it is 0) and one division per element.  Sums
    run in another order than numpy's BLAS: results differ in the last bits.
    """
    nb, n_, s_, h_ = q.shape
    nkv = k.shape[1]
    t_ = k.shape[2]
    group = n_ // nkv
    tp = (t_ + _PANEL - 1) // _PANEL * _PANEL
    hp = (h_ + _PANEL - 1) // _PANEL * _PANEL
    qb = np.empty((s_, h_), np.float32)
    kt = np.zeros((tp // _PANEL) * h_ * _PANEL, np.float32)
    vp = np.zeros((hp // _PANEL) * tp * _PANEL, np.float32)
    sc = np.zeros((s_, tp), np.float32)
    ob = np.empty((s_, hp), np.float32)
    has_bias = bias.shape[3] > 0
    lanes = np.empty(_LANES, np.float32)
    sums = np.empty(_LANES, np.float32)
    last = -1
    for it in range(i0, i1):
        b = it // n_
        n = it - b * n_
        g = n // group
        if b * nkv + g != last:
            last = b * nkv + g
            for p in range(tp // _PANEL):
                t1 = min(_PANEL, t_ - p * _PANEL)
                for d in range(h_):
                    row = (p * h_ + d) * _PANEL
                    for j in range(t1):
                        kt[row + j] = k[b, g, p * _PANEL + j, d]
            for t in range(t_):
                for d in range(h_):
                    vp[((d // _PANEL) * tp + t) * _PANEL + d % _PANEL] = v[b, g, t, d]
        for i in range(s_):
            for d in range(h_):
                qb[i, d] = q[b, n, i, d]
        for p in range(tp // _PANEL):
            for k0 in range(0, h_, KC):
                _rows(sc, p * _PANEL, tp, kt, (p * h_ + k0) * _PANEL, _PANEL, qb, k0, min(KC, h_ - k0), 1 if k0 > 0 else 0,
                      -1, 0)
        bb = b if bias.shape[0] > 1 else 0
        bn = n if bias.shape[1] > 1 else 0
        for i in range(s_):
            # (indexed, not through row views: a view costs reference counting per row)
            bi = i if bias.shape[2] > 1 else 0
            if divide:
                for t in range(t_):
                    sc[i, t] = sc[i, t] / scale
            else:
                for t in range(t_):
                    sc[i, t] = sc[i, t] * scale
            if has_bias:  # (a loop of its own: no product and sum contracted into one rounding)
                for t in range(t_):
                    sc[i, t] = sc[i, t] + bias[bb, bn, bi, t]
            # The maximum over 16 interleaved lanes (vectorizes).  A NaN score is not seen here
            # (comparisons skip it) but its exp is NaN, so the sum and every weight of the row
            # are NaN, as numpy's NaN maximum makes them; +inf gives inf - inf = NaN alike.
            for j in range(_LANES):
                lanes[j] = floor
            body = t_ - t_ % _LANES
            for t in range(0, body, _LANES):
                for j in range(_LANES):
                    z = sc[i, t + j]
                    lanes[j] = z if z > lanes[j] else lanes[j]
            m = floor
            for j in range(_LANES):
                m = lanes[j] if lanes[j] > m else m
            for t in range(body, t_):
                m = sc[i, t] if sc[i, t] > m else m
            for t in range(t_):
                sc[i, t] = _expf(sc[i, t] - m)
            for j in range(_LANES):
                sums[j] = 0.0
            for t in range(0, body, _LANES):
                for j in range(_LANES):
                    sums[j] += sc[i, t + j]
            total = np.float32(0.0)
            for j in range(_LANES):
                total += sums[j]
            for t in range(body, t_):
                total += sc[i, t]
            if total == 0:
                total = np.float32(1.0)
            for t in range(t_):
                sc[i, t] = sc[i, t] / total
        for p in range(hp // _PANEL):
            for k0 in range(0, tp, KC):
                _rows(ob, p * _PANEL, hp, vp, (p * tp + k0) * _PANEL, _PANEL, sc, k0, min(KC, tp - k0), 1 if k0 > 0 else 0,
                      -1, 0)
        for i in range(s_):
            for d in range(h_):
                out[b, n, i, d] = ob[i, d]


def native_entries() -> dict:
    """name -> numba cfunc of this module's native entries: ``gqa_f32``, :func:`gqa_decode` over an
    argument block laid out as ``_jit_native.Q_*`` names it (float32 arrays; scale and softcap as
    float64), and ``gqa_f32_omp``, its KV heads shared out over a GNU OpenMP team (per-thread
    scratch rows in ``Q_QR`` / ``Q_SCORES``, each thread's dynamic-loop slots after the block)."""
    from numba import carray, cfunc

    from onnxpack.session.kernels import _jit_native as L
    from onnxpack.session.kernels._nbits_jit import F32, address, as_ptr, gomp_functions

    @njit(inline="always")
    def views(blk, tid):
        """The block's arrays; ``tid`` picks a thread's scratch rows (the serial entry: 0)."""
        b = carray(blk, (L.Q_SLOTS,), np.int64)
        n, nkv, h, cap, half = b[L.Q_N], b[L.Q_NKV], b[L.Q_H], b[L.Q_CAP], b[L.Q_HALF]
        width = b[L.Q_SCORES_LEN]
        return (carray(as_ptr(b[L.Q_Q], F32), (n, h)), carray(as_ptr(b[L.Q_K], F32), (nkv, h)),
                carray(as_ptr(b[L.Q_V], F32), (nkv, h)), carray(as_ptr(b[L.Q_PK], F32), (nkv, cap, h)),
                carray(as_ptr(b[L.Q_PV], F32), (nkv, cap, h)), carray(as_ptr(b[L.Q_COS], F32), (half,)),
                carray(as_ptr(b[L.Q_SIN], F32), (half,)), carray(as_ptr(b[L.Q_OUT], F32), (n, h)),
                carray(as_ptr(b[L.Q_QR] + 4 * tid * h, F32), (h,)),
                carray(as_ptr(b[L.Q_SCORES] + 4 * tid * width, F32), (width,)))

    def gqa_f32(blk):
        b = carray(blk, (L.Q_SLOTS,), np.int64)
        bf = carray(blk, (L.Q_SLOTS,), np.float64)
        q, k, v, pk, pv, cos, sin, out, qr, scores = views(blk, 0)
        gqa_decode(q, k, v, pk, pv, b[L.Q_POS], b[L.Q_LO], cos, sin, b[L.Q_HALF], b[L.Q_INTERLEAVED] != 0,
                   np.float32(bf[L.Q_SCALE]), np.float32(bf[L.Q_SOFTCAP]), out, qr, scores)

    loop_start, loop_next, loop_end, thread_num = gomp_functions()

    def gqa_f32_omp(blk):
        # The KV heads shared out by a dynamic loop (a descheduled thread's heads go to the
        # others); Q_QR / Q_SCORES hold one scratch row per thread, then each thread's loop slots.
        b = carray(blk, (L.Q_SLOTS,), np.int64)
        bf = carray(blk, (L.Q_SLOTS,), np.float64)
        n, nkv, half, pos, lo = b[L.Q_N], b[L.Q_NKV], b[L.Q_HALF], b[L.Q_POS], b[L.Q_LO]
        group = n // nkv
        tid = np.int64(thread_num())
        q, k, v, pk, pv, cos, sin, out, qr, scores = views(blk, tid)
        slot = address(blk) + 8 * (L.Q_SLOTS + 2 * tid)
        bounds = carray(blk, (L.Q_SLOTS + 2 * tid + 2,), np.int64)[L.Q_SLOTS + 2 * tid:]
        if loop_start(0, nkv, 1, 1, slot, slot + 8):
            while True:
                for hk in range(bounds[0], bounds[1]):
                    gqa_decode(q[hk * group:(hk + 1) * group], k[hk:hk + 1], v[hk:hk + 1], pk[hk:hk + 1],
                               pv[hk:hk + 1], pos, lo, cos, sin, half, b[L.Q_INTERLEAVED] != 0,
                               np.float32(bf[L.Q_SCALE]), np.float32(bf[L.Q_SOFTCAP]),
                               out[hk * group:(hk + 1) * group], qr, scores)
                if not loop_next(slot, slot + 8):
                    break
        loop_end()

    sig = types.void(types.voidptr)
    return {"gqa_f32": cfunc(sig, nopython=True, error_model="numpy", fastmath=_FM)(gqa_f32),
            "gqa_f32_omp": cfunc(sig, nopython=True, error_model="numpy", fastmath=_FM)(gqa_f32_omp)}


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernels only read.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"q", "k", "v", "cos", "sin", "bias"}))
