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

__all__ = ["lstm_standard", "lstm_small"]

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
