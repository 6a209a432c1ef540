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
from BLAS's blocked sums by rounding only).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["lstm_standard"]


@njit(cache=True, nogil=True)
def lstm_standard(xw, rt, h, c, y, reverse):
    """Every step of one direction: ``xw`` (seq, batch, 4H) the input projection plus bias,
    ``rt`` (H, 4H) the recurrence weight transposed (C-contiguous), ``h`` and ``c`` (batch, H)
    the states, updated in place, ``y`` (seq, batch, H) receives each step's ``h``; steps run
    from the last to the first when ``reverse``."""
    seq, batch, g4 = xw.shape
    hid = g4 // 4
    gates = np.empty(g4, np.float32)
    half = np.float32(0.5)
    one = np.float32(1.0)
    for s in range(seq):
        t = seq - 1 - s if reverse else s
        for b in range(batch):
            for j in range(g4):
                gates[j] = np.float32(0.0)
            for k in range(hid):
                hk = h[b, k]
                for j in range(g4):
                    gates[j] += hk * rt[k, j]
            for j in range(g4):
                gates[j] += xw[t, b, j]
            for j in range(hid):
                i = half * (np.tanh(gates[j] * half) + one)
                o = half * (np.tanh(gates[hid + j] * half) + one)
                f = half * (np.tanh(gates[2 * hid + j] * half) + one)
                cn = f * c[b, j] + i * np.tanh(gates[3 * hid + j])
                c[b, j] = cn
                h[b, j] = o * np.tanh(cn)
                y[t, b, j] = h[b, j]


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernels only read.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"xw", "rt"}))
