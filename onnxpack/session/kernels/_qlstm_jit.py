"""numba kernel for DynamicQuantizeLSTM's recurrence, every step in one call (optional; see
:class:`.qinteger.DynamicQuantizeLSTM`).

Imported lazily on the kernel's first run with packed (int8 lanes) recurrence weights, only when
numba is installed, ``ONNXPACK_DISABLE_JIT`` is not ``1`` and this CPU runs the int8 GEMM
(:mod:`._qgemm_jit`: AVX-512 VNNI or AVX2); elsewhere the kernel's numpy loop computes the same.

Why: a step of the quantized recurrence is a (batch, H) x (H, 4H) int8 product between a dozen
small numpy passes (the dynamic quantization of h, the GEMM's zero-point corrections, the scale,
the bias, the cell): ~40 us of Python a step against ~5 us of arithmetic.  text2tashkeel's
bidirectional int8 taggers (two layers of hidden 256, 30 characters) took 5.2 ms a run against
onnxruntime's 0.9.

Each step is the numpy loop's arithmetic, bit for bit (a test compares them): h quantized to
uint8 per tensor as onnxruntime's ``GetQuantizationParameter`` and ``MlasQuantizeLinear`` do
(:func:`.qdq.dynamic_qparams`), the exact int32 product on the lanes with the zero points applied
through row and column sums (:func:`.qinteger.lanes_matmul`), then ``float32(acc) * (a_scale *
w_scale) + XW[t] + bias`` and MLAS' cell (:func:`._rnn_jit.lstm_cell_mlas`).  No ``fastmath``: a
contracted multiply-add or a reciprocal would change the bits.  A step whose h holds a NaN or an
infinity is left to the numpy loop (the count of steps done is returned), which defines what
quantizing those gives.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from onnxpack.session.kernels._qgemm_jit import TILE, _tiles_here, available, signs_form
from onnxpack.session.kernels._rnn_jit import lstm_cell_mlas

__all__ = ["qlstm_steps", "available", "signs_form"]

_F0 = np.float32(0.0)
_F255 = np.float32(255.0)


@njit(cache=True, nogil=True, error_model="numpy")
def qlstm_steps(xw, bias, lanes, colsum, b_shift, w_scale, h, c, y, d, reverse, lens, signs):
    """Runs the recurrence of direction ``d`` in place on ``h`` and ``c`` (batch, H), writing
    ``y[t, d]``; returns the number of steps done (all ``seq`` unless a step's h is not finite).

    ``xw``: (seq, batch, 4H) float32, the input projection; ``bias``: (4H,) float32; ``lanes``,
    ``colsum``: R's int8 lanes and column sums (K = H); ``b_shift``: (4H,) int64, ``128·[R
    unsigned] - R's zero point`` per column; ``w_scale``: (4H,) float32, R's scale per column;
    ``lens``: (batch,) int64 sequence lengths, or empty; ``signs``: the AVX2 GEMM's signed form
    (``_qgemm_jit.signs_form`` and no lane of -128)."""
    seq, batch, n = xw.shape
    k = h.shape[1]
    groups = (k + 3) // 4
    ntiles = (n + TILE - 1) // TILE
    au = np.zeros((batch, groups * 4), np.uint8)
    acc = np.empty((batch, n), np.int32)
    gates = np.empty((batch, n), np.float32)
    c_new = np.empty_like(c)
    h_new = np.empty_like(h)
    rows = np.empty(batch, np.int64)
    c_less = 128 * signs
    for s in range(seq):
        t = seq - 1 - s if reverse else s
        # dynamic_qparams(h): min and max with 0, the scale, the rounded zero point.
        lo = _F0
        hi = _F0
        for b in range(batch):
            for j in range(k):
                v = h[b, j]
                if v - v != _F0:  # NaN or an infinity
                    return s
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
        if hi == lo:
            scale = np.float32(1.0)
        else:
            scale = np.float32(np.float32(hi - lo) / _F255)
        zf = np.float32(_F0 - np.float32(lo / scale))
        zp = np.int64(np.rint(min(max(zf, _F0), _F255)))
        zf = np.float32(zp)  # (as the numpy loop's float32 of the uint8 zero point: never -0.0)
        # _dynamic_quantize_uint8: rint(h / scale) kept within the codes, plus the zero point.
        for b in range(batch):
            total = 0
            for j in range(k):
                q = np.rint(np.float32(h[b, j] / scale))
                q = min(max(q, -zf), _F255 - zf) + zf
                code = np.uint8(q)
                au[b, j] = code
                total += np.int64(code)
            rows[b] = total
        _tiles_here(au, lanes, acc, n, groups, 0, ntiles, signs)
        # The zero points through the row and column sums (lanes_matmul's corrections: the
        # exact integer, which fits in int32), then float32(acc) * (a_scale * w_scale) + XW + b.
        a_shift = zp
        for b in range(batch):
            for j in range(n):
                bs = b_shift[j]
                exact = (np.int64(acc[b, j]) + rows[b] * bs - (a_shift - c_less) * np.int64(colsum[j])
                         - k * a_shift * bs)
                g = np.float32(np.int32(exact)) * np.float32(scale * w_scale[j])
                g = np.float32(g + xw[t, b, j])
                gates[b, j] = np.float32(g + bias[j])
        c_new[:] = c
        lstm_cell_mlas(gates, c_new, h_new)
        for b in range(batch):
            if lens.size and t >= lens[b]:
                continue  # past this row's length: its state stays, its output stays 0
            for j in range(k):
                c[b, j] = c_new[b, j]
                h[b, j] = h_new[b, j]
                y[t, d, b, j] = h_new[b, j]
    return seq


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernel only reads.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization({"qlstm_steps": qlstm_steps},
                        frozenset({"xw", "bias", "lanes", "colsum", "b_shift", "w_scale", "lens"}))
