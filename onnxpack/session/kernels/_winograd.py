"""Winograd F(2x2, 3x3) convolution: 3x3 stride-1 convs with 2.25x fewer multiplies than im2col.

Lavin & Gray (2016): each 4x4 input tile ``d`` becomes ``V = B^T d B``, each 3x3 filter ``g``
becomes ``U = G g G^T`` (at pack time), the 16 elementwise products summed over input channels
are 16 GEMMs ``M[k] = U[k] @ V[k]`` (one batched ``np.matmul``, BLAS), and ``Y = A^T M A`` gives a
2x2 output tile.  F(2,3)'s transform matrices hold only 0, +-1 and 1/2, so the result stays
within a few ulp of the direct convolution's rounding (tests measure it); F(4,3) would cut the
multiplies 4x but its larger constants cost accuracy and its transforms more passes.

Measured (1 thread, shared 2-core machine, ms): the GEMM part alone against im2col's single GEMM
for (C, M, H=W) = (64, 80, 40) 1.05 vs 2.63, (64, 64, 56) 1.69 vs 3.71, (256, 256, 14) 1.94 vs
3.03, (512, 512, 7) 4.66 vs 7.59; the JIT transforms add a fraction of that.  Channels below
:data:`MIN_CHANNELS` (an RGB stem) keep im2col: their GEMMs are too thin for BLAS.

The transforms run in the numba kernels of :mod:`._conv_jit` (padding folded into the input
transform, bias and activations into the output transform); without numba, numpy computes the
same transforms with strided views and ``tensordot``.
"""

from __future__ import annotations

import numpy as np

from onnxpack.session.kernels import _act

__all__ = ["MIN_CHANNELS", "weight_transform", "weight_untransform", "conv3x3"]

# Both the input and output channel counts must reach this for the Winograd pack.
MIN_CHANNELS = 8

_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
_BT = np.array([[1.0, 0.0, -1.0, 0.0], [0.0, 1.0, 1.0, 0.0], [0.0, -1.0, 1.0, 0.0], [0.0, 1.0, 0.0, -1.0]])
_AT = np.array([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, -1.0, -1.0]])


# Winograd's error in an output is relative to the largest products of its 4x4 input tile, not to
# that output's own terms (the transforms add and then cancel them): a filter whose largest entry
# dwarfs the rest (a corrupted weight, found by the fuzz campaign: one 2e29 among 0.1s) spreads
# rounding of its size into neighbouring outputs that direct convolution computes exactly.
# Such filters, and non-finite ones, are declined and run by im2col.
MAX_FILTER_RANGE = 1024.0


def weight_is_tame(w: np.ndarray) -> bool:
    """Whether Winograd keeps its stated accuracy on filter ``w`` (M, C, 3, 3): finite, and in
    every output channel the largest magnitude at most ``MAX_FILTER_RANGE`` times the median of
    the channel's nonzero magnitudes (a median, so that a few outliers cannot hide themselves in
    the scale they are compared with; nonzero, so that pruned filters are not penalised)."""
    a = np.abs(np.asarray(w, dtype=np.float64).reshape(w.shape[0], -1))
    if not np.isfinite(a).all():
        return False
    for row in a:
        nz = row[row > 0]
        if nz.size and nz.max() > MAX_FILTER_RANGE * np.median(nz):
            return False
    return True


def weight_transform(w: np.ndarray) -> np.ndarray:
    """``U = G g G^T`` of every (M, C) 3x3 filter, as a C-contiguous float32 ``(16, M, C)``
    (row ``4a + b`` is element (a, b)); computed in float64 and rounded once."""
    u = np.einsum("ai,mcij,bj->abmc", _G, np.asarray(w, dtype=np.float64), _G)
    return np.ascontiguousarray(u.reshape(16, w.shape[0], w.shape[1]), dtype=np.float32)


def weight_untransform(u: np.ndarray) -> np.ndarray:
    """The (M, C, 3, 3) float32 filters back from ``U`` (G's left inverse, in float64): for maps
    too small for Winograd to pay, without keeping a second pack of every weight."""
    gp = np.linalg.pinv(_G)  # (3, 4), exact left inverse: G has full column rank
    g = np.einsum("ia,abmc,jb->mcij", gp, u.astype(np.float64).reshape(4, 4, u.shape[1], u.shape[2]), gp)
    return np.ascontiguousarray(g, dtype=np.float32)


def conv3x3(x: np.ndarray, u: np.ndarray, bias: np.ndarray | None, begin: tuple[int, int],
            out_shape: tuple[int, int], acts) -> np.ndarray:
    """The stride-1, dilation-1 3x3 convolution of float32 ``x`` (N, C, H, W) by the transformed
    filters ``u`` (16, M, C), plus ``bias`` and ``acts``; padding ``begin`` in front (the end
    padding is implied by ``out_shape``).  None when ``x`` holds an infinity or a NaN: the
    transforms would spread it (inf - inf) beyond the outputs that read it; convolve directly."""
    n, c, h, w = x.shape
    m = u.shape[1]
    oh, ow = out_shape
    th, tw = (oh + 1) // 2, (ow + 1) // 2
    tiles = n * th * tw
    jit = _act.jit()
    x = np.ascontiguousarray(x, dtype=np.float32)
    bias32 = np.zeros(m, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    threads = _act.threads() if tiles * c * 16 >= (1 << 17) else 1
    if jit is not None:
        v = np.empty((16, c, tiles), np.float32)
        bad = np.zeros(1, np.int64)
        _act.tuner(("wino_input", x.shape, tuple(begin))).run(
            lambda a, b: jit.wino_input(x, v, begin[0], begin[1], th, tw, a, b, bad), n * c, threads)
        if bad[0]:
            return None
    else:
        if not np.isfinite(x).all():
            return None
        v = _input_numpy(x, begin, th, tw)
    mx = _act.matmul(u, v)  # (16, M, tiles): 16 BLAS GEMMs
    y = np.empty((n, m, oh, ow), np.float32)
    if jit is not None:
        codes, params = _act.encode(acts)
        _act.tuner(("wino_output", y.shape)).run(
            lambda a, b: jit.wino_output(mx, y, bias32, codes, params, th, tw, a, b), n * m, threads)
        return y
    yt = np.tensordot(_AT.astype(np.float32), mx.reshape(4, 4, m, n, th, tw), axes=(1, 0))  # (2, 4, m, n, th, tw)
    yt = np.tensordot(yt, _AT.T.astype(np.float32), axes=(1, 0))  # (2, m, n, th, tw, 2)
    full = yt.transpose(2, 1, 3, 0, 4, 5).reshape(n, m, 2 * th, 2 * tw)
    y[...] = full[:, :, :oh, :ow]
    y += bias32.reshape(1, m, 1, 1)
    return _act.apply(y, acts)


def _input_numpy(x: np.ndarray, begin, th: int, tw: int) -> np.ndarray:
    n, c, h, w = x.shape
    hp, wp = 2 * th + 2, 2 * tw + 2
    p = np.zeros((n, c, hp, wp), np.float32)
    rows, cols = min(h, hp - begin[0]), min(w, wp - begin[1])
    p[:, :, begin[0]:begin[0] + rows, begin[1]:begin[1] + cols] = x[:, :, :rows, :cols]
    d = np.lib.stride_tricks.sliding_window_view(p, (4, 4), axis=(2, 3))[:, :, ::2, ::2]  # (n, c, th, tw, 4, 4)
    bt = _BT.astype(np.float32)
    v = np.tensordot(bt, d, axes=(1, 4))  # (4, n, c, th, tw, 4)
    v = np.tensordot(v, bt.T, axes=(5, 0))  # (4, n, c, th, tw, 4)
    return np.ascontiguousarray(v.transpose(0, 5, 2, 1, 3, 4)).reshape(16, c, n * th * tw)
