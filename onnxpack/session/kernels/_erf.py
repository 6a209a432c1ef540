"""A fast, accurate float32 ``erf`` in numpy (numpy has none; scipy is not a dependency).

Two pieces, each a polynomial fitted (least squares on Chebyshev nodes, in float64) and then
evaluated in float32 with Horner's rule; the range is split where MLAS splits it:

* ``|x| < 0.921875``: ``erf(x) = x + x * P(x*x)``.  ``P`` approximates ``erf(x)/x - 1`` (degree
  5 in ``x*x``); adding the exact ``x`` last keeps the final rounding to half an ulp of erf.
* ``0.921875 <= |x|``: ``erf(x) = 1 - exp(Q(|x|))``, where ``Q`` (degree 8) approximates
  ``log(erfc(x))`` on [0.921875, 3.925]; from 3.925 on, float32 erf is 1 (erfc < 3e-8, half
  an ulp of 1) and ``|x|`` is clamped there.

Measured against ``math.erf`` on 2,000,001 float32 points in [-5, 5] (tests repeat this on a
dense grid): max error 8.8e-8 absolute, 1.5 ulp of the float32 result.  Cost: ~45 cheap elementwise
float32 passes over L2-sized chunks, no Python loop per element, no float64 temporaries.
"""

from __future__ import annotations

import numpy as np

__all__ = ["erf_f32", "ERF_SPLIT", "ERF_CLAMP"]

ERF_SPLIT = np.float32(0.921875)  # where the two pieces meet (MLAS's boundary)
ERF_CLAMP = np.float32(3.925)  # erf(3.925) rounds to 1.0 in float32

# erf(x)/x - 1 = sum P[k] * (x*x)**k  on |x| < ERF_SPLIT (coefficient 0 is 2/sqrt(pi) - 1).
_P = np.array(
    [
        1.1283791491205692e00 - 1.0,
        -3.7612491161930545e-01,
        1.1281792950261417e-01,
        -2.6765864871981515e-02,
        4.9921834248521741e-03,
        -5.9862108334072183e-04,
    ],
    dtype=np.float32,
)
# log(erfc(x)) = sum Q[k] * x**k  on ERF_SPLIT <= x <= ERF_CLAMP.
_Q = np.array(
    [
        3.1093467864685032e-04,
        -1.1302002400158964e00,
        -6.3187564235320570e-01,
        -1.1004015650370906e-01,
        2.6402298930790269e-02,
        -4.7543202013882657e-03,
        5.9596747506893816e-04,
        -4.5992549508988079e-05,
        1.6355378129217844e-06,
    ],
    dtype=np.float32,
)


_SIGN = np.uint32(0x80000000)


def _horner(coeffs: np.ndarray, v: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``sum coeffs[k] * v**k`` into ``p`` (Horner's rule, one in-place pass per operation)."""
    np.multiply(v, coeffs[-1], out=p)
    p += coeffs[-2]
    for c in coeffs[-3::-1]:
        p *= v
        p += c
    return p


# Elements per chunk: the ~45 passes run over six chunk-sized float32 buffers (384 KiB), which
# stay in L2, instead of streaming whole tensors through memory 45 times.  Measured on a (128,
# 3072) tensor (CPU ms, shared 2-core machine): whole tensor 7.9, chunks of 4096 6.7 (per-call
# overhead), 16384 3.4, 65536 3.2; scipy's ufunc 5.1.
_CHUNK = 16384


def erf_f32(x: np.ndarray) -> np.ndarray:
    """``erf(x)`` as a new float32 array (other float inputs are computed in float32).

    Both pieces are computed for every element and blended by multiplying with the 0/1 mask
    (``np.where`` and ``np.copyto(where=)`` on a random mask were 5-8x slower than a whole
    arithmetic pass here); the arguments are clamped so both pieces stay finite, which makes
    the blend exact.  The sign is copied bitwise (``np.copysign`` was ~8 passes' worth).  NaN
    propagates; ``erf(+-inf) = +-1``; ``erf(-0.0) = -0.0``.
    """
    x = np.asarray(x)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape)
    out = np.empty_like(x)
    flat, oflat = x.reshape(-1), out.reshape(-1)
    n = flat.size
    c = min(_CHUNK, n)
    a, s, t = (np.empty(c, np.float32) for _ in range(3))
    m = np.empty(c, bool)
    for i in range(0, n, _CHUNK):
        xc, o = flat[i:i + _CHUNK], oflat[i:i + _CHUNK]
        k = xc.size
        ak, sk, tk, mk = a[:k], s[:k], t[:k], m[:k]
        np.abs(xc, out=ak)
        np.minimum(ak, ERF_SPLIT, out=sk)
        np.multiply(sk, sk, out=tk)
        _horner(_P, tk, o)  # small piece: erf = s + s * P(s*s)
        o *= sk
        o += sk
        np.minimum(ak, ERF_CLAMP, out=tk)
        _horner(_Q, tk, sk)  # large piece: erf = 1 - exp(Q(a))
        np.exp(sk, out=sk)
        np.subtract(np.float32(1), sk, out=sk)
        np.less(ak, ERF_SPLIT, out=mk)  # False for NaN: the NaN of the large piece is kept
        o *= mk
        np.logical_not(mk, out=mk)
        sk *= mk
        o += sk
        bits = o.view(np.uint32)
        bits |= xc.view(np.uint32) & _SIGN
    return out
