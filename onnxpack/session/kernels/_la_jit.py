"""numba kernel for LinearAttention's recurrence (optional; see :mod:`.linear_attention`).

Imported lazily by :mod:`onnxpack.session.kernels.linear_attention` on a node's first ``run`` —
never at ``import onnxpack`` nor at session creation — only when numba is installed and
``ONNXPACK_DISABLE_JIT`` is not ``1``; elsewhere the numpy loop of ``LinearAttention.run``
computes the same.

Why: the numpy loop makes five passes over every head's (d_k, d_v) state per token (decay, the
retrieval ``S^T k``, the rank-one update, the output ``S^T q``), each a numpy call over all
batches and heads: at Qwen3.5's widths (32 value heads of 128 x 128, 2 MB of state) a prefill of
128 tokens took 86 ms against onnxruntime's 19.  Here each head's state stays in cache while
the tokens pass: two passes per token, one decaying the state while it retrieves ``S^T k``, one
updating it while it reads the outputs.

Formulas as the numpy loop (float32; sums over d_k in row order, so results differ from BLAS's
by rounding only): ``S *= exp(g)`` (gated rules: per head, or per row of S), ``u = beta (v -
S^T k)`` (delta rules; else ``u = v``), ``S += k u^T``, ``o_j = scale S^T q_j`` for the query
heads j of this KV head; with a state window, the state after each of the last W tokens.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["recurrence"]


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
def recurrence(q, k, v, g, beta, s, out, window, gated, delta, scale):
    """q (B, T, H, G, dk), k (B, T, H, dk), v (B, T, H, dv), g (B, T, H, dk or 1) the decay factors
    (exp'd; unused unless ``gated``), beta (B, T, H or 1) (unused unless ``delta``), s (B, H, dk, dv)
    the state, updated in place; out (B, T, H, G, dv); window (W, B, H, dk, dv), W >= 0."""
    nb, nt, nh, ng, dk = q.shape
    dv = v.shape[3]
    w = window.shape[0]
    per_row = g.shape[3] != 1
    hb = beta.shape[2]
    ret = np.empty(dv, np.float32)
    upd = np.empty(dv, np.float32)
    for b in range(nb):
        for h in range(nh):
            st = s[b, h]
            for t in range(nt):
                kt = k[b, t, h]
                # pass 1: the decay, and S^T k read from the decayed state
                if delta:
                    for c in range(dv):
                        ret[c] = 0.0
                for r in range(dk):
                    row = st[r]
                    if gated:
                        gr = g[b, t, h, r] if per_row else g[b, t, h, 0]
                        for c in range(dv):
                            row[c] *= gr
                    if delta:
                        kr = kt[r]
                        for c in range(dv):
                            ret[c] += kr * row[c]
                if delta:
                    bt = beta[b, t, h if hb != 1 else 0]
                    for c in range(dv):
                        upd[c] = bt * (v[b, t, h, c] - ret[c])
                else:
                    for c in range(dv):
                        upd[c] = v[b, t, h, c]
                # pass 2: S += k u^T, and the outputs S^T q
                o = out[b, t, h]
                for j in range(ng):
                    for c in range(dv):
                        o[j, c] = 0.0
                for r in range(dk):
                    row = st[r]
                    kr = kt[r]
                    for c in range(dv):
                        row[c] += kr * upd[c]
                    for j in range(ng):
                        qr = q[b, t, h, j, r]
                        oj = o[j]
                        for c in range(dv):
                            oj[c] += qr * row[c]
                for j in range(ng):
                    for c in range(dv):
                        o[j, c] *= scale
                if w and t >= nt - w:
                    window[w - nt + t, b, h] = st


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernel only reads.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"q", "k", "v", "g", "beta"}))
