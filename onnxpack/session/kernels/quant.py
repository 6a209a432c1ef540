"""``com.microsoft::MatMulNBits``: block-wise n-bit weight-only quantized MatMul.

Layout, as onnxruntime's ``MatMulNBitsQuantizer`` writes it (and onnxruntime's kernel reads it):

* ``B`` uint8 (N, n_blocks, blob_size): column n of the (K, N) weight, cut into blocks of
  ``block_size`` rows, each block's values packed little-end-first (4 bits: element 2j in the low
  nibble of byte j); the last block is zero-padded when K is not a multiple of block_size.
* ``scales`` (N * n_blocks) or (N, n_blocks), float32 / float16 / bfloat16.
* ``zero_points`` optional: uint8 packed like ``B`` per column (N, ceil(n_blocks*bits/8)), or
  the scales' float type with the scales' shape.  Absent means ``2**(bits-1)``.
* ``g_idx`` (input 4) is not supported; ``bias`` (input 5, (N,)) is added.

Dequantized weight: ``W[k, n] = (q[k, n] - zp[k // bs, n]) * scale[k // bs, n]``.

Pre-packing choice (measured, OpenBLAS single thread, K = N = 2048, block 32):

=========================  ========  ===========  ================================
layout                     M = 1     M = 64       memory vs the 4-bit original
=========================  ========  ===========  ================================
dense fp32 W               0.55 ms   21 ms        8x (needs scales in its key)
integer q as fp32 (ours)   0.70 ms   33 ms        8x
uint8 q, dequant per call  12-16 ms  29 ms        2x
=========================  ========  ===========  ================================

The contract packs one input at a time and keys a packed buffer by that input alone, so a
buffer that bakes in the scales (dense W) would collide in a shared container between two models
with the same ``B`` and different scales.  We therefore pack ``B`` into its integers widened to
float32, laid out (K_pad, N) for BLAS, and pack ``scales``/``zero_points`` separately as
(n_blocks, N) float32.  For few rows (M <= ``_BLOCKED_MAX_ROWS``, the decoding case) the call
multiplies A block-wise with the integers in one batched GEMM and applies scales and zero
points to the (n_blocks, M, N) partial products (``zp`` enters as ``sum_k A[m, k]`` per block times
``zp * scale``), which is within ~1.3x of the dense GEMM; for more rows it rebuilds the
dense weight once per call (one fused pass) and runs one GEMM.
"""

from __future__ import annotations

import logging
import struct

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, register
from onnxpack.session.kernels.linalg import as_compute

logger = logging.getLogger(__name__)

__all__ = ["MatMulNBits", "unpack_nbits", "dequantize_nbits"]

_PACK_VERSION = 1

# Up to this many rows of A, apply scales to block partial products instead of rebuilding the
# dense weight: the partial products cost n_blocks * M * N, the rebuild K * N.
_BLOCKED_MAX_ROWS = 16


def unpack_nbits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Unsigned ``bits``-bit values, low bits first, from the last axis of a uint8 array."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    vals = (packed[..., None] >> shifts) & mask
    vals = vals.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
    return vals[..., :count]


def dequantize_nbits(b, scales, zero_points, *, k: int, n: int, bits: int, block_size: int) -> np.ndarray:
    """The (K, N) float32 weight a MatMulNBits node multiplies by (used by tests and the CLI)."""
    q, s = _integers(b, n, bits, block_size), _scales(scales, n)
    zp = _zero_points(zero_points, n, s.shape[0], bits)
    w = (q.reshape(s.shape[0], block_size, n) - zp[:, None, :]) * s[:, None, :]
    return w.reshape(-1, n)[:k]


def _integers(b: np.ndarray, n: int, bits: int, block_size: int) -> np.ndarray:
    """B's integers as float32 (n_blocks * block_size, N), C-contiguous."""
    nblocks = b.shape[1]
    q = unpack_nbits(np.asarray(b, dtype=np.uint8).reshape(n, nblocks, -1), bits, block_size)
    return np.ascontiguousarray(q.reshape(n, nblocks * block_size).T, dtype=np.float32)


def _scales(scales: np.ndarray, n: int) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(scales).reshape(n, -1).T, dtype=np.float32)


def _zero_points(zp: np.ndarray | None, n: int, nblocks: int, bits: int) -> np.ndarray:
    """Zero points as float32 (n_blocks, N)."""
    if zp is None:
        return np.full((nblocks, n), float(1 << (bits - 1)), dtype=np.float32)
    if zp.dtype == np.uint8:
        vals = unpack_nbits(zp.reshape(n, -1), bits, nblocks)
        return np.ascontiguousarray(vals.T, dtype=np.float32)
    return np.ascontiguousarray(np.asarray(zp).reshape(n, -1).T, dtype=np.float32)


@register("MatMulNBits", domain="com.microsoft", since=1)
class MatMulNBits(Kernel):
    """``Y = A @ dequantize(B)`` (+ bias), computed in float32, output in A's dtype."""

    op_type = "MatMulNBits"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        missing = [a for a in ("K", "N", "block_size") if a not in self.attrs]
        if missing:
            raise InvalidArgument(f"node {node.name!r} (MatMulNBits): missing attribute(s) {missing}")
        self.k = int(self.attr("K"))
        self.n = int(self.attr("N"))
        self.bits = int(self.attr("bits", 4))
        self.block_size = int(self.attr("block_size"))
        if self.bits not in (2, 4, 8):
            raise NotImplementedError(f"MatMulNBits bits={self.bits} is not implemented natively")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise InvalidArgument(
                f"node {node.name!r} (MatMulNBits): block_size must be a power of 2 and >= 16, got {self.block_size}"
            )
        if len(node.input) > 4 and node.input[4]:
            raise NotImplementedError("MatMulNBits with g_idx is not implemented natively")
        self.nblocks = -(-self.k // self.block_size)
        self._q: np.ndarray | None = None  # (K_pad, N) float32 integers
        self._s: np.ndarray | None = None  # (n_blocks, N) float32
        self._zp: np.ndarray | None = None  # (n_blocks, N) float32

    # -- pre-packing ------------------------------------------------------------------------------
    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index not in (1, 2, 3):
            return None
        attrs = struct.pack("<qqqqB", self.k, self.n, self.bits, self.block_size, input_index)
        return PackSpec("matmulnbits", _PACK_VERSION, attrs, 1)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        if input_index == 1:
            return [(np.dtype(np.float32), (self.nblocks * self.block_size, self.n))]
        return [(np.dtype(np.float32), (self.nblocks, self.n))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        self._check_input(input_index, weight)
        if input_index == 1:
            return (_integers(weight, self.n, self.bits, self.block_size),)
        if input_index == 2:
            return (_scales(weight, self.n),)
        return (_zero_points(weight, self.n, self.nblocks, self.bits),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (buf,) = buffers
        if input_index == 1:
            self._q = buf
        elif input_index == 2:
            self._s = buf
        else:
            self._zp = buf

    def _check_input(self, i: int, arr: np.ndarray) -> None:
        blob = self.block_size * self.bits // 8
        if i == 1:
            if arr.dtype != np.uint8 or arr.size != self.n * self.nblocks * blob:
                raise InvalidArgument(
                    f"node {self.node.name!r} (MatMulNBits): B must be uint8 with "
                    f"{self.n}x{self.nblocks}x{blob} elements (N, n_blocks, blob), got {arr.dtype}{list(arr.shape)}"
                )
        elif i == 2 and arr.size != self.n * self.nblocks:
            raise InvalidArgument(
                f"node {self.node.name!r} (MatMulNBits): scales must have N*n_blocks = "
                f"{self.n * self.nblocks} elements, got shape {list(arr.shape)}"
            )

    # -- compute --------------------------------------------------------------------------------
    def run(self, a, b=None, scales=None, zero_points=None, g_idx=None, bias=None):
        n, bs, nb = self.n, self.block_size, self.nblocks
        if self._q is not None:
            q = self._q
        else:
            self._check_input(1, b)
            q = _integers(b.reshape(n, nb, -1), n, self.bits, bs)
        if self._s is not None:
            s = self._s
        else:
            self._check_input(2, scales)
            s = _scales(scales, n)
        if self._zp is not None:
            zp = self._zp
        else:
            zp = _zero_points(zero_points, n, nb, self.bits)
        if a.shape[-1] != self.k:
            raise InvalidArgument(
                f"node {self.node.name!r} (MatMulNBits): A's last dimension must be K={self.k}, got {list(a.shape)}"
            )
        out_dtype = a.dtype
        lead = a.shape[:-1]
        a2 = as_compute(a).reshape(-1, self.k)
        if a2.dtype != np.float32:
            a2 = a2.astype(np.float32)
        m = a2.shape[0]
        kpad = nb * bs
        if m <= _BLOCKED_MAX_ROWS:
            if kpad != self.k:
                a2 = np.concatenate([a2, np.zeros((m, kpad - self.k), np.float32)], axis=1)
            ab = a2.reshape(m, nb, bs).transpose(1, 0, 2)  # (nb, m, bs)
            part = np.matmul(ab, q.reshape(nb, bs, n))  # (nb, m, n)
            part *= s[:, None, :]
            y = part.sum(axis=0)
            y -= ab.sum(axis=2).T @ (zp * s)
        else:
            w = q.reshape(nb, bs, n) - zp[:, None, :]
            w *= s[:, None, :]
            y = a2 @ w.reshape(kpad, n)[: self.k]
        if bias is not None:
            y += as_compute(bias).astype(np.float32, copy=False)
        y = y.reshape(*lead, n)
        return (y.astype(out_dtype, copy=False),)
