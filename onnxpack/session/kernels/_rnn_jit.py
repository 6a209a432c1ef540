"""numba kernel for the LSTM recurrence with the default activations (optional; see :mod:`.rnn`).

Imported lazily by :mod:`onnxpack.session.kernels.rnn` on an LSTM's first ``run`` (or its
warm-up thread) — never at ``import onnxpack`` nor at session creation — only when numba is
installed and ``ONNXPACK_DISABLE_JIT`` is not ``1``; elsewhere the numpy loop of ``LSTM._run``
computes the same.

Why: a step of a small LSTM is a (batch, H) x (H, 4H) product and a dozen elementwise passes
over (batch, 4H) arrays; in numpy each is a call of 1-3 us, so a one-step LSTM of hidden 128
(Silero VAD) spent ~40 us in Python against ~5 us of arithmetic.  Here one call runs every step.

Formulas as the numpy loop: ``gates = h @ R^T + (x @ W^T + b)[t]`` in ONNX's gate order
i, o, f, c; ``sigmoid(z) = 0.5 * (tanh(z / 2) + 1)``; ``c = f * c + i * tanh(g)``;
``h = o * tanh(c)``; float32 throughout (the product summed over H in order, so results differ
from BLAS's blocked sums by rounding only).  ``tanh`` is :func:`._conv_jit._tanhf` (at most 1.9
ulp; libm's scalar ``tanhf`` cost ~20 ns an element and kept the cell loop from vectorizing: ~10
of the 24 us of Silero VAD's one-step LSTM).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from onnxpack.session.kernels._conv_jit import _tanhf

__all__ = ["lstm_standard", "lstm_small", "lstm_cell_mlas"]

_FM = {"contract"}
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _cell(gates, c, h, y, t, b, hid):
    """The gates' activations and the state update of one (step, batch row)."""
    for j in range(hid):
        i = _HALF * (_tanhf(gates[j] * _HALF) + _ONE)
        o = _HALF * (_tanhf(gates[hid + j] * _HALF) + _ONE)
        f = _HALF * (_tanhf(gates[2 * hid + j] * _HALF) + _ONE)
        cn = f * c[b, j] + i * _tanhf(gates[3 * hid + j])
        hn = o * _tanhf(cn)
        c[b, j] = cn
        h[b, j] = hn
        y[t, b, j] = hn


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _recur(gates, rt, h, b, hid, g4):
    """``gates = h[b] @ rt``, summed over H in order."""
    for j in range(g4):
        gates[j] = np.float32(0.0)
    for k in range(hid):
        hk = h[b, k]
        for j in range(g4):
            gates[j] += hk * rt[k, j]


@njit(cache=True, nogil=True, fastmath=_FM, error_model="numpy")
def lstm_standard(xw, rt, h, c, y, reverse):
    """Every step of one direction: ``xw`` (seq, batch, 4H) the input projection plus bias,
    ``rt`` (H, 4H) the recurrence weight transposed (C-contiguous), ``h`` and ``c`` (batch, H)
    the states, updated in place, ``y`` (seq, batch, H) receives each step's ``h``; steps run
    from the last to the first when ``reverse``."""
    seq, batch, g4 = xw.shape
    hid = g4 // 4
    gates = np.empty(g4, np.float32)
    for s in range(seq):
        t = seq - 1 - s if reverse else s
        for b in range(batch):
            _recur(gates, rt, h, b, hid, g4)
            for j in range(g4):
                gates[j] += xw[t, b, j]
            _cell(gates, c, h, y, t, b, hid)


@njit(cache=True, nogil=True, fastmath=_FM, error_model="numpy")
def lstm_small(x, wt, bias, rt, h, c, y, reverse):
    """:func:`lstm_standard` with the input projection made here, step by step: ``x`` (seq, batch,
    I), ``wt`` (I, 4H) the input weight transposed, ``bias`` (4H,) the summed biases.  For a few
    (step, batch row) pairs, where one BLAS call for the projection costs more than the products
    (Silero VAD's one-step LSTM: 1 x 128 by 128 x 512)."""
    seq, batch, inp = x.shape
    g4 = rt.shape[1]
    hid = g4 // 4
    gates = np.empty(g4, np.float32)
    xw = np.empty(g4, np.float32)
    for s in range(seq):
        t = seq - 1 - s if reverse else s
        for b in range(batch):
            for j in range(g4):
                xw[j] = np.float32(0.0)
            for k in range(inp):
                xk = x[t, b, k]
                for j in range(g4):
                    xw[j] += xk * wt[k, j]
            _recur(gates, rt, h, b, hid, g4)
            for j in range(g4):
                gates[j] += xw[j] + bias[j]
            _cell(gates, c, h, y, t, b, hid)


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernels only read.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"xw", "rt", "x", "wt", "bias"}))


# MLAS' logistic and tanh (see rnn.mlas_logistic): each Horner step a fused multiply-add, here
# the float64 product of two float32 values (exact) plus the coefficient, rounded to float32;
# every other operation a float32 one, rounded on its own (no fastmath: no contraction).
_L = tuple(np.float64(np.float32(c)) for c in (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05,
                                              8.51377133304701e-03, 2.48287947061529e-01))
_LQ = tuple(np.float64(np.float32(c)) for c in (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06,
                                               1.70198817374094e-03, 1.16817656904453e-01, 9.93151921023180e-01))
_T = tuple(np.float64(np.float32(c)) for c in (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
                                              5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
                                              4.89352455891786e-03))
_TQ = tuple(np.float64(np.float32(c)) for c in (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                                               4.89352518554385e-03))
_L0, _L1, _L2, _L3, _L4 = _L
_LQ0, _LQ1, _LQ2, _LQ3, _LQ4, _LQ5 = _LQ
_T0, _T1, _T2, _T3, _T4, _T5, _T6 = _T
_TQ0, _TQ1, _TQ2, _TQ3 = _TQ
_F18 = np.float32(18.0)
_F9 = np.float32(9.0)
_F0 = np.float32(0.0)


@njit(inline="always", error_model="numpy")
def _fma(x2, acc, c):
    return np.float32(np.float64(x2) * np.float64(acc) + c)


@njit(inline="always", error_model="numpy")
def _mlas_logistic(v):
    if v != v:
        return v
    x = min(max(v, -_F18), _F18)
    x2 = x * x
    p = _fma(x2, np.float32(_L0), _L1)
    p = _fma(x2, p, _L2)
    p = _fma(x2, p, _L3)
    p = _fma(x2, p, _L4)
    q = _fma(x2, np.float32(_LQ0), _LQ1)
    q = _fma(x2, q, _LQ2)
    q = _fma(x2, q, _LQ3)
    q = _fma(x2, q, _LQ4)
    q = _fma(x2, q, _LQ5)
    r = (x * p) / q + _HALF
    return max(r, _F0)


@njit(inline="always", error_model="numpy")
def _mlas_tanh(v):
    if v != v:
        return v
    x = min(max(v, -_F9), _F9)
    x2 = x * x
    p = _fma(x2, np.float32(_T0), _T1)
    p = _fma(x2, p, _T2)
    p = _fma(x2, p, _T3)
    p = _fma(x2, p, _T4)
    p = _fma(x2, p, _T5)
    p = _fma(x2, p, _T6)
    q = _fma(x2, np.float32(_TQ0), _TQ1)
    q = _fma(x2, q, _TQ2)
    q = _fma(x2, q, _TQ3)
    return (x * p) / q


@njit(cache=True, nogil=True, error_model="numpy")
def lstm_cell_mlas(gates, c, h):
    """One step's cell as onnxruntime computes it: ``gates`` (batch, 4H) = X W + H R + bias in
    the order i, o, f, g; i, o, f through MLAS' logistic, g and the new state through its tanh;
    ``c = c * f + i * g`` (two products, one sum) in place, ``h = tanh(c) * o`` into ``h``."""
    rows = gates.shape[0]
    hid = gates.shape[1] // 4
    for b in range(rows):
        for j in range(hid):
            i = _mlas_logistic(gates[b, j])
            o = _mlas_logistic(gates[b, hid + j])
            f = _mlas_logistic(gates[b, 2 * hid + j])
            g = _mlas_tanh(gates[b, 3 * hid + j])
            cc = c[b, j] * f + i * g
            c[b, j] = cc
            h[b, j] = _mlas_tanh(cc) * o
