"""Block-quantized weights that stay quantized: ``com.microsoft::MatMulNBits``, ``GatherBlockQuantized``
and ``MatMulBnb4`` (FP4 / NF4 codes, decoded per call: see its class).

MatMulNBits, as onnxruntime's ``MatMulNBitsQuantizer`` (and onnxruntime-genai's builder) write it:

* ``B`` uint8 (N, n_blocks, blob): column n of the (K, N) weight, cut into blocks of
  ``block_size`` rows, each block's values packed little-end-first (4 bits: element 2j in the low
  nibble of byte j); the last block is zero-padded when K is not a multiple of block_size.
* ``scales`` (N * n_blocks) or (N, n_blocks), float32 / float16 / bfloat16.
* ``zero_points`` optional: uint8 packed like ``B`` per column (N, ceil(n_blocks*bits/8)), or
  the scales' float type with the scales' shape.  Absent means ``2**(bits-1)``.
* ``g_idx`` (input 4, int32 (K,)): row k uses the scale and zero point of block ``g_idx[k]``
  (act-order); ``bias`` (input 5, (N,)) is added.

Dequantized weight: ``W[k, n] = (q[k, n] - zp[g(k), n]) * scale[g(k), n]``, ``g(k) = k // block_size``
without g_idx.

Packed format (pack version 2; ``docs/formats.md`` has the same table).  Every packed buffer is
1-D and uses one **tiled layout**: the N columns are cut into tiles of ``TILE`` = 128 columns (the
last tile holds the remaining ``N % 128``), and a tile of width ``w`` stores its per-block data
column-fastest, ``(n_blocks, r, w)`` in C order, where ``r`` is the bytes per block.

=============  =============================  ===================================================
input          packed buffer                  bytes vs the model's
=============  =============================  ===================================================
B              uint8 (N * n_blocks * blob,)   equal (the same bytes, re-ordered; r = blob)
scales         float32, or float16 kept as    equal (bfloat16 and float64 are widened to float32)
               float16 (N * n_blocks,)
zero_points    uint8 (N * n_blocks,), one     uint8: 2x the packed nibbles (1 byte per block);
               byte per block; float: like    float: as scales
               scales
=============  =============================  ===================================================

So the packed total is at most the model's B + scales + 2x its zero-point bytes (for 4 bits,
block 32, float32 scales and uint8 zero points: 21 bytes per block of 32 vs the model's 20.5,
1.02x); the one widening, bfloat16 to float32, stays within 1.25x except for bfloat16 float
zero points at block size 16 (1.33x).  Why tiles: a decode GEMV then streams each tile front to
back with the column loop innermost (vectorized, no per-block horizontal sum), 2.7x faster on one
thread than a dot product per column over the model's own layout (K=896, N=4864: 0.23 ms vs
0.62 ms); the scales and zero points of a tile sit next to each other the same way.  The pack
contract keys each buffer by its own input alone (a shared container would otherwise hand one
model's dense weight, baked with its scales, to another model with the same ``B`` and other
scales), so scales are never folded into ``B`` or the zero points.

Compute (``W`` is never materialized whole):

* few rows (M <= ``JIT_MAX_ROWS``, decoding) with numba (the ``jit`` extra): one pass over the
  packed tiles, 2 threads (:mod:`._nbits_jit`).  With ``accuracy_level=4`` onnxruntime quantizes
  A per block to int8 and multiplies integers; on CPUs with AVX-512 VNNI or AVX2 so does this
  GEMV (the same rounding; integer dot products instead of float conversions: ~2.8x faster with
  VNNI, 3x with AVX2, one thread, 896x4864: 0.44 -> 0.15 ms), elsewhere, and on every other path,
  A stays float32.
* otherwise (prefill, or no numba, or ``ONNXPACK_DISABLE_JIT=1``): dequantize a panel of tiles
  into a per-thread float32 scratch and multiply it with BLAS, panel by panel; with 2 threads
  the panels are shared out between onnxpack's threads, each with a one-thread BLAS call.

``GatherBlockQuantized`` gathers rows and dequantizes only those: it never packs, so a tied
embedding that shares its bytes with the lm_head's ``B`` is read from the model's own bytes (a
mapped file's untouched pages are never paged in) and no second copy of it is made.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
import time

from typing import Any

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, register, register_fused, scratch_releaser
from onnxpack.session.kernels.linalg import as_compute

logger = logging.getLogger(__name__)

__all__ = [
    "MatMulNBits", "GatherBlockQuantized", "MatMulBnb4", "BNB4_TABLES", "unpack_nbits", "dequantize_nbits", "to_tiles", "jit_enabled",
    "TILE", "JIT_MAX_ROWS",
]

_NO_ZERO_POINTS = np.empty(0, np.uint8)  # the kernels' zero-point argument when the model has none

# Version of the packed layout; 1 was B's integers widened to float32 (K_pad, N) with
# (n_blocks, N) float32 scales and zero points, 8x the 4-bit bytes.
_PACK_VERSION = 2

# Columns per tile of the packed layout (a multiple of the JIT's 64-column work item).
TILE = 128

# Up to this many rows of A the JIT streams the packed weight once for all rows; above, a
# dequantized panel and BLAS win (measured: see benchmarks/bench_int4.py and the commit message).
JIT_MAX_ROWS = 16

# Below this many multiply-adds the JIT runs on the calling thread only: a 2-thread fork-join
# saves at most ~15 us there and risks a scheduler slice when the other core is busy.  (On an
# AVX2 host, 896x896 and 896x1152 on 2 threads were ~15 us faster per call in a loop of GEMVs
# alone, and no faster inside a decoding step: tokens alternating between the two cuts.)
JIT_SERIAL_BELOW = 2_000_000

# Float32 elements of one dequantized panel (per thread, reused across calls) when one BLAS call
# uses every thread: 1 Mi floats (4 MiB) keep a panel within this machine's 2 MiB L2 + shared L3
# while BLAS sees wide enough products.  When the panels are split over onnxpack's threads (BLAS
# on one thread each, see ``MatMulNBits._panels``) a panel is one tile: measured M=128, 2 threads,
# fresh processes: lm_head 896x151936 235 ms with 1-tile panels, 2 tiles 229-637 ms, 4 tiles
# 315-530 ms; gate_up 896x4864 9.4-15 ms vs 12.6-15 ms with 4 tiles.
_PANEL_FLOATS = 1 << 20



def jit_enabled() -> bool:
    """Whether the numba kernels are used (numba importable and ``ONNXPACK_DISABLE_JIT`` not 1)."""
    return _jit() is not None


def _jit():
    """The MatMulNBits JIT kernels: from the native code cache when this machine has it (no numba
    in the process: see :mod:`._jit_native`), else numba's (:mod:`._nbits_jit`), else ``None``
    (see ``_act.load_jit``)."""
    return _act.native() or _act.load_jit("_nbits_jit", "MatMulNBits", _prefer_openmp)


def _prefer_openmp() -> None:
    """numba's threading layer for the parallel GEMV: OpenMP first, unless the user chose one.

    Measured on Qwen2.5-0.5B int4 (2 cores, 121 GEMVs per token): 33-45 ms per token with the
    OpenMP layer, 95-110 ms with the ``workqueue`` layer, whose sleeping workers are woken for
    every call; and ``workqueue`` terminates the process when two threads run parallel kernels at
    once, while OpenMP gives each calling thread its own team.  GNU OpenMP cannot be used in a
    child forked after the parent used it (numba terminates such a child): :func:`_parallel_ok`
    keeps a forked child on the serial kernels."""
    import numba

    if "NUMBA_THREADING_LAYER" in os.environ or "NUMBA_THREADING_LAYER_PRIORITY" in os.environ:
        return
    from numba.np.ufunc import parallel as nparallel

    if not getattr(nparallel, "_is_initialized", False):
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


_forked_after_parallel = False


def _after_fork_in_child() -> None:
    global _forked_after_parallel
    native = _act._native_kernels[0] if _act._native_kernels else None
    if native is not None and native.used_openmp:
        _forked_after_parallel = True
    if _act._jit_modules.get("_nbits_jit") is not None:
        from numba.np.ufunc import parallel as nparallel

        _forked_after_parallel = _forked_after_parallel or bool(getattr(nparallel, "_is_initialized", False))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _parallel_ok() -> bool:
    """Whether numba's parallel kernels may run in this process (see :func:`_prefer_openmp`)."""
    return not _forked_after_parallel


# Dequantization panels: thread ident -> float32 scratch reused by that thread's later calls
# (the caller's and, for split prefill panels, the pool threads').
_panels: dict[int, np.ndarray] = {}


@scratch_releaser
def _drop_scratch() -> None:
    """Every thread's panel (a thread still using one keeps its own reference)."""
    _panels.clear()


class _StallGuard:
    """Serial GEMVs for a while after a parallel one stalled.

    The parallel GEMV splits its columns statically over an OpenMP team and ends on a barrier, so
    when another process holds a core, every call waits for a descheduled thread: measured on
    this shared 2-core machine while other processes kept it loaded, gate_up 896x4864 took 36 ms
    per call on 2 threads vs 0.27 ms on one, and a whole Qwen2.5-0.5B decoding step took 1.4-1.9 s
    (onnxruntime's 66-83 ms in the same minutes).  A call is a
    stall when it takes longer than :data:`STALL_SECONDS` plus the time one thread needs at
    :data:`SERIAL_BYTES_PER_S`; after one, GEMVs run on the calling thread for a span, then the
    parallel kernel is tried again.  The span starts at :data:`SERIAL_MIN_S` and doubles for
    each stall that follows the last span by less than :data:`QUIET_S` (a machine that stays
    loaded), up to :data:`SERIAL_FOR_S`; a stall after a quiet period starts again from the
    shortest.  Why not always the longest: one descheduling on a shared host is common, and a
    second of serial GEMVs after each made a 40-token decode ~20 % slower (Qwen2.5-0.5B, 30 vs
    25 ms per token in runs with and without one stall).  On a quiet machine no call stalls and
    nothing changes.  Races between threads only move ``until``: harmless.

    A kernel's first parallel call is no evidence (``key``: the kernel): it touches its weight's
    pages and its scratch for the first time in the process, and counting it sent whole decoding
    runs to one thread (measured, Qwen2.5-0.5B int4 after a 1,024-token prompt: 43-50 ms per
    token instead of ~30).
    """

    STALL_SECONDS = 0.002
    SERIAL_BYTES_PER_S = 3e9  # well below one thread's ~10-14 GB/s: only stalls trip it
    SERIAL_MIN_S = 0.05
    SERIAL_FOR_S = 1.0
    QUIET_S = 2.0

    def __init__(self) -> None:
        self.until = 0.0
        self.span = 0.0
        self.stalls = 0
        self.seen: set = set()

    def parallel_allowed(self, now: float) -> bool:
        return now >= self.until

    def record(self, seconds: float, nbytes: int, now: float, key: Any = None) -> None:
        if key is not None and key not in self.seen:
            self.seen.add(key)
            return
        if seconds > self.STALL_SECONDS + nbytes / self.SERIAL_BYTES_PER_S:
            again = self.span > 0 and now - self.until < self.QUIET_S
            self.span = min(self.SERIAL_FOR_S, 2 * self.span) if again else self.SERIAL_MIN_S
            self.until = now + self.span
            self.stalls += 1


_stall_guard = _StallGuard()


def _gemv_threads(jit, macs: int) -> int:
    """How many threads a JIT GEMV of ``macs`` multiply-adds runs on now: one below the serial
    cut, after a fork, or while the stall guard says so; else the JIT's thread count, at most
    onnxpack's (:func:`._act.threads`: a session's ``intra_op_num_threads``; numba's own count
    is the machine's cores, which a one-thread session's GEMVs used when they ran on numba's
    module rather than the native code cache, whose count is already onnxpack's)."""
    if macs < JIT_SERIAL_BELOW or not _parallel_ok():
        return 1
    threads = min(jit.threads(), _act.threads())
    return threads if threads == 1 or _stall_guard.parallel_allowed(time.perf_counter()) else 1


_blas_control: Any = None


def _blas_threads_control():
    """``onnxpack.session._threads.blas_threads`` (a ref-counted BLAS thread limit that nests with
    the runner's ``intra_op_num_threads``), or ``None`` without threadpoolctl."""
    global _blas_control
    if _blas_control is None:
        try:
            import threadpoolctl  # noqa: F401
        except ImportError:
            _blas_control = False
        else:
            from onnxpack.session._threads import blas_threads

            _blas_control = blas_threads
    return _blas_control or None


def _scratch(count: int) -> np.ndarray:
    """A float32 scratch of ``count`` elements, reused by later calls in this thread."""
    key = threading.get_ident()
    buf = _panels.get(key)
    if buf is None or buf.size < count:
        if buf is None and len(_panels) >= 4:  # threads that ended leave their panel: drop those
            alive = {t.ident for t in threading.enumerate()}
            for k in [k for k in _panels if k not in alive]:
                _panels.pop(k, None)
        buf = np.empty(max(count, 1), np.float32)
        _panels[key] = buf
    return buf[:count]


# -- layout helpers ---------------------------------------------------------------------------------


def unpack_nbits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Unsigned ``bits``-bit values, low bits first, from the last axis of a uint8 array."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    vals = (packed[..., None] >> shifts) & mask
    vals = vals.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
    return vals[..., :count]


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes (uint8 values < 16, an even count on the last axis) two to a byte, the even
    one in the low nibble: MatMulNBits' 4-bit layout."""
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def to_tiles(x: np.ndarray) -> np.ndarray:
    """(N, n_blocks, r) per-column block data -> the 1-D tiled layout (see the module docstring)."""
    n, nb, r = x.shape
    nfull = n // TILE
    parts = []
    if nfull:
        parts.append(x[: nfull * TILE].reshape(nfull, TILE, nb, r).transpose(0, 2, 3, 1).reshape(-1))
    if n - nfull * TILE:
        parts.append(x[nfull * TILE:].transpose(1, 2, 0).reshape(-1))
    if not parts:
        return np.empty(0, x.dtype)
    return np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0])


def _tile_views(flat: np.ndarray, n: int, nb: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Views (full tiles (nfull, nb, r, TILE), last tile (nb, r, N % TILE)) of a tiled buffer."""
    nfull = n // TILE
    cut = nfull * TILE * nb * r
    return flat[:cut].reshape(nfull, nb, r, TILE), flat[cut:].reshape(nb, r, n - nfull * TILE)


def _untile(flat: np.ndarray, n: int, nb: int, r: int) -> np.ndarray:
    """Inverse of :func:`to_tiles`: (N, n_blocks, r)."""
    full, last = _tile_views(flat, n, nb, r)
    top = full.transpose(0, 3, 1, 2).reshape(-1, nb, r)
    return np.concatenate([top, last.transpose(2, 0, 1)]) if last.size or not top.size else top


def _is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def _float_storage(dtype: np.dtype) -> np.dtype:
    """The packed dtype of float scales / zero points: float32 and float16 stay, others widen."""
    dtype = np.dtype(dtype)
    return dtype if dtype in (np.dtype(np.float32), np.dtype(np.float16)) else np.dtype(np.float32)


def _as_storage(x: np.ndarray) -> np.ndarray:
    target = _float_storage(x.dtype)
    if x.dtype == target:
        return x
    return np.asarray(x).astype(np.float32).astype(target, copy=False)


def _jit_view(x: np.ndarray) -> np.ndarray:
    """numba has no float16: float16 buffers go in as their uint16 bits (converted in the kernel)."""
    return x.view(np.uint16) if x.dtype == np.float16 else x


def dequantize_nbits(b, scales, zero_points, *, k: int, n: int, bits: int, block_size: int) -> np.ndarray:
    """The (K, N) float32 weight a MatMulNBits node multiplies by (used by tests and the CLI)."""
    nb = -(-k // block_size)
    q = unpack_nbits(np.asarray(b, dtype=np.uint8).reshape(n, nb, -1), bits, block_size)  # (N, nb, bs)
    s = np.asarray(scales).astype(np.float32).reshape(n, nb)
    zp = _zero_points_dense(zero_points, n, nb, bits)
    w = (q.astype(np.float32) - zp[:, :, None]) * s[:, :, None]
    return np.ascontiguousarray(w.reshape(n, nb * block_size)[:, :k].T)


def _zero_points_dense(zp: np.ndarray | None, n: int, nb: int, bits: int) -> np.ndarray:
    """Zero points as float32 (N, n_blocks)."""
    if zp is None:
        return np.full((n, nb), float(1 << (bits - 1)), dtype=np.float32)
    if zp.dtype == np.uint8:
        return unpack_nbits(zp.reshape(n, -1), bits, nb).astype(np.float32)
    return np.asarray(zp).astype(np.float32).reshape(n, nb)


# -- MatMulNBits ------------------------------------------------------------------------------------


_SPECS: dict[tuple, PackSpec | None] = {}  # MatMulNBits.pack_spec's answers
_NO_SPEC = object()
_U8 = np.dtype(np.uint8)


@register("MatMulNBits", domain="com.microsoft", since=1)
class MatMulNBits(Kernel):
    """``Y = A @ dequantize(B)`` (+ bias), computed in float32, output in A's dtype."""

    op_type = "MatMulNBits"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        missing = [a for a in ("K", "N") if a not in self.attrs]
        if missing:
            raise InvalidArgument(f"node {node.name!r} (MatMulNBits): missing attribute(s) {missing}")
        self.k = int(self.attr("K"))
        self.n = int(self.attr("N"))
        self.bits = int(self.attr("bits", 4))
        self.block_size = int(self.attr("block_size", 0))
        # 4: A may be quantized to int8 per block (onnxruntime's CompInt8); the JIT GEMV does so on
        # CPUs with VNNI or AVX2, every other path computes in float32.
        self.accuracy_level = int(self.attr("accuracy_level", 0))
        if self.bits not in (2, 4, 8):
            raise InvalidArgument(f"node {node.name!r} (MatMulNBits): bits must be 2, 4 or 8, got {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise InvalidArgument(
                f"node {node.name!r} (MatMulNBits): block_size must be a power of 2 and >= 16, got {self.block_size}"
            )
        if self.k < 0 or self.n < 0:
            raise InvalidArgument(f"node {node.name!r} (MatMulNBits): K and N must be >= 0, got K={self.k} N={self.n}")
        self.nblocks = -(-self.k // self.block_size)
        # The packed (tiled) codes' width: 2-bit weights are packed as 4-bit codes (the same
        # values), so every 4-bit path serves them, accuracy level 4's int8 activations among
        # them, as onnxruntime quantizes A for 2-bit weights too (its SQ2Bit int8 kernels).
        self.cbits = 4 if self.bits == 2 else self.bits
        self.blob = self.block_size * self.cbits // 8  # bytes a block of a column, packed
        self.wire_blob = self.block_size * self.bits // 8  # ... in input B
        self.has_zp = len(node.input) > 3 and bool(node.input[3])
        self._packed: dict[int, np.ndarray] = {}  # input index -> tiled buffer
        self._gemv_fns: tuple | None = None  # see _gemv_call
        self._plan: tuple | None = None  # see _native_plan
        self._again: tuple | None = None  # see _repeat

    # -- pre-packing ------------------------------------------------------------------------------
    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index not in (1, 2, 3):
            return None
        # Asked twice per packed input at a warm load (binding, then the blob's check), by ~120
        # nodes of a few shapes: one immutable spec per (node shape, input, dtype).
        cache_key = (self.k, self.n, self.bits, self.block_size, input_index, info.dtype)
        spec = _SPECS.get(cache_key, _NO_SPEC)
        if spec is not _NO_SPEC:
            return spec
        dtype = np.dtype(info.dtype)
        if (input_index == 1 and dtype != np.uint8) or (input_index == 2 and not _is_float(dtype)) or (
                input_index == 3 and dtype != np.uint8 and not _is_float(dtype)):
            spec = None  # a wrong type: run() says what is wrong
        else:
            attrs = struct.pack("<qqqqBq", self.k, self.n, self.bits, self.block_size, input_index, TILE)
            if self.cbits != self.bits:
                attrs += bytes([self.cbits])  # (2-bit codes packed 4-bit: another layout, another key)
            spec = PackSpec("matmulnbits", _PACK_VERSION, attrs, 1)
        if len(_SPECS) < 1024:
            _SPECS[cache_key] = spec
        return spec

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        count = self.n * self.nblocks
        if input_index == 1:
            return [(_U8, (count * self.blob,))]
        if input_index == 3 and self._codes_zero_points(info):
            return [(_U8, (count,))]
        return [(_float_storage(info.dtype), (count,))]

    def _codes_zero_points(self, info: TensorInfo) -> bool:
        """Whether zero points of this type are packed as uint8 codes (else as floats)."""
        return np.dtype(info.dtype) == _U8

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        return (self._pack(input_index, weight),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (self._packed[input_index],) = buffers

    def _pack(self, i: int, arr: np.ndarray) -> np.ndarray:
        """Input ``i`` in the tiled layout (also used per call for inputs that were not packed)."""
        self._check_input(i, arr)
        n, nb = self.n, self.nblocks
        if i == 1:
            if self.cbits != self.bits:  # 2-bit codes, four a byte -> 4-bit codes, two a byte (low first)
                codes = unpack_nbits(np.asarray(arr).reshape(n, nb, self.wire_blob), self.bits, self.block_size)
                return to_tiles(pack_nibbles(codes))
            return to_tiles(np.asarray(arr).reshape(n, nb, self.blob))
        if i == 3 and arr.dtype == np.uint8:
            return to_tiles(unpack_nbits(np.asarray(arr).reshape(n, -1), self.bits, nb).reshape(n, nb, 1))
        return to_tiles(_as_storage(np.asarray(arr)).reshape(n, nb, 1))

    def _check_input(self, i: int, arr: np.ndarray | None) -> None:
        name = self.node.name
        if arr is None:
            raise InvalidArgument(f"node {name!r} (MatMulNBits): input {i} is missing")
        count = self.n * self.nblocks
        if i == 1:
            if arr.dtype != np.uint8 or arr.size != count * self.wire_blob:
                raise InvalidArgument(
                    f"node {name!r} (MatMulNBits): B must be uint8 with {self.n}x{self.nblocks}x{self.wire_blob} "
                    f"elements (N, n_blocks, blob), got {arr.dtype}{list(arr.shape)}"
                )
        elif i == 2:
            if not _is_float(arr.dtype) or arr.size != count:
                raise InvalidArgument(
                    f"node {name!r} (MatMulNBits): scales must be float with N*n_blocks = {count} elements, "
                    f"got {arr.dtype}{list(arr.shape)}"
                )
        elif i == 3:
            if arr.dtype == np.uint8:
                per_col = -(-self.nblocks * self.bits // 8)
                if arr.size != self.n * per_col:
                    raise InvalidArgument(
                        f"node {name!r} (MatMulNBits): uint8 zero_points must have N*ceil(n_blocks*bits/8) = "
                        f"{self.n * per_col} elements, got {list(arr.shape)}"
                    )
            elif not _is_float(arr.dtype) or arr.size != count:
                raise InvalidArgument(
                    f"node {name!r} (MatMulNBits): zero_points must be uint8 or float with N*n_blocks = "
                    f"{count} elements, got {arr.dtype}{list(arr.shape)}"
                )

    # -- compute --------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Load the JIT kernels off the critical path — from the native code cache (no numba:
        see :mod:`._jit_native`), else numba's from its on-disk cache, for a decode-sized and a
        prefill-sized call with this node's packed weights.

        The parallel GEMV is loaded, never run, here: an OpenMP runtime gives each thread that
        starts a parallel region its own team, so a first call from this background thread left
        a second team spinning beside the caller's (measured on Qwen2.5-0.5B int4, 2 cores:
        40 ms per token instead of 28).  The prefill path's dequantization runs on one tile (a
        whole prefill-sized call would also set BLAS's thread count from this thread)."""
        jit = _jit()
        bq, sc = self._packed.get(1), self._packed.get(2)
        zq = self._packed.get(3) if self.has_zp else None
        if jit is None or self.k == 0 or self.n == 0 or bq is None or sc is None or (self.has_zp and zq is None):
            return
        if not getattr(jit, "native", False):  # native code is loaded already: nothing to compile
            import numba

            fn, args = self._gemv_call(jit, np.zeros((1, self.k), np.float32), bq, sc, zq)
            fn.compile(tuple(numba.typeof(x) for x in args))
        zmode, zarr, zmid = self._zmode(zq)
        # One tile, no BLAS: loads the dequantization kernel without touching BLAS's thread count.
        kpad = self.nblocks * self.block_size
        w = np.empty((kpad, min(self.n, TILE)), np.float32)
        dq = jit.dequant4 if self.cbits == 4 else jit.dequant8
        dq(bq, _jit_view(sc), _jit_view(zarr), zmode, zmid, w, self.n, self.nblocks, self.blob, TILE, 0, 1)

    def run(self, a, b=None, scales=None, zero_points=None, g_idx=None, bias=None):
        if g_idx is None and self._again is not None:
            y = self._repeat(a, bias)
            if y is not None:
                return (y,)
        name = self.node.name
        if a is None or a.ndim < 1 or a.shape[-1] != self.k:
            raise InvalidArgument(
                f"node {name!r} (MatMulNBits): A's last dimension must be K={self.k}, "
                f"got {None if a is None else list(a.shape)}"
            )
        bq = self._packed.get(1)
        if bq is None:
            bq = self._pack(1, b)
        sc = self._packed.get(2)
        if sc is None:
            sc = self._pack(2, scales)
        zq = None
        if self.has_zp:
            zq = self._packed.get(3)
            if zq is None:
                zq = self._pack(3, zero_points)
        out_dtype = a.dtype
        lead = a.shape[:-1]
        a2 = as_compute(a).reshape(math.prod(lead), self.k)
        if a2.dtype != np.float32:
            a2 = a2.astype(np.float32)
        a2 = np.ascontiguousarray(a2)
        if g_idx is not None and not self._trivial_g_idx(g_idx):
            y = a2 @ self._dense_g_idx(bq, sc, zq, g_idx)
        elif self.k == 0 or self.n == 0 or a2.shape[0] == 0:
            y = np.zeros((a2.shape[0], self.n), np.float32)
        else:
            y = self._matmul(a2, bq, sc, zq, (*lead, self.n))
            kept = self._plan  # this thread's native plan for these rows, if the call took one
            if (kept is not None and a2.shape[0] <= JIT_MAX_ROWS and a.__class__ is np.ndarray
                    and a.dtype == np.float32 and a.flags.c_contiguous
                    and kept[0][:2] == (threading.get_ident(), a2.shape[0])
                    and (bias is None or (bias.__class__ is np.ndarray and bias.dtype == np.float32
                                          and bias.size == self.n))):
                self._again = (kept[0][0], a.shape, kept[1], bq, sc, zq, y.shape, kept[0][2], bias,
                               None if bias is None else bias.reshape(self.n))
        if bias is not None:
            if bias.size != self.n:
                raise InvalidArgument(f"node {name!r} (MatMulNBits): bias must have N={self.n} elements, got {list(bias.shape)}")
            y += as_compute(bias).astype(np.float32, copy=False).reshape(self.n)
        if y.ndim != len(lead) + 1:
            y = y.reshape(*lead, self.n)
        return (y.astype(out_dtype, copy=False),)

    def _repeat(self, a, bias) -> np.ndarray | None:
        """``A @ W`` (+ ``bias``) by the native plan of this thread's last call when ``a`` and
        ``bias`` are as that call's (``a`` float32, C-contiguous, the same shape; the very same
        float32 bias array or none; no ``g_idx``), else None.

        Why: a decoding step calls ~100 GEMVs with the same shapes at every token, and the full
        path's checks, reshapes and look-ups cost ~15 us of Python per call (measured on
        Qwen2.5-0.5B with the native calls stubbed out) — as much as a small GEMV itself.  The
        plan is the one the full path chose; what that choice depends on and may change between
        calls is checked again: the same thread, the same packed weights, and the thread count
        the full path would choose now (:func:`_gemv_threads`)."""
        kept = self._again
        if (a.__class__ is not np.ndarray or a.shape != kept[1] or a.dtype != np.float32 or not a.flags.c_contiguous
                or kept[0] != threading.get_ident() or bias is not kept[8]):
            return None
        plan, bq, sc, zq, threads, add = kept[2], kept[3], kept[4], kept[5], kept[7], kept[9]
        packed = self._packed
        # (The plan was made for these arrays, which ``kept`` holds alive: no weak reference to
        # check.  Its scratch is this thread's, kept alive by the plan, even if the thread's
        # scratch was replaced since: the next full-path call drops it.)
        if packed.get(1) is not bq or packed.get(2) is not sc or (self.has_zp and packed.get(3) is not zq):
            return None
        jit = _jit()
        if jit is None or _gemv_threads(jit, a.size * self.n) != threads:
            return None  # the full path decides anew (and keeps its new plan)
        y = np.empty(kept[6], np.float32)
        if threads == 1:
            plan(a, y)
        else:
            t0 = time.perf_counter()
            plan(a, y)
            t1 = time.perf_counter()
            _stall_guard.record(t1 - t0, bq.nbytes + sc.nbytes + (0 if zq is None else zq.nbytes), t1, id(self))
        if add is not None:
            y += add  # (as the full path adds it)
        return y

    def _zmode(self, zq):
        """(zero-point mode for the tiled kernels, per-block zero points, implicit zero point)."""
        if zq is None:
            return 0, _NO_ZERO_POINTS, np.float32(1 << (self.bits - 1))
        return 1, zq, np.float32(1 << (self.bits - 1))

    def _matmul(self, a2: np.ndarray, bq, sc, zq, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """``a2 @ W`` (M, N); from the GEMV, a fresh array of ``shape`` (M * N elements) when given:
        the result owns its memory (no view), so a fused activation works on it in place."""
        m = a2.shape[0]
        jit = _jit()
        if jit is not None and (m <= JIT_MAX_ROWS or self._int8(jit, zq)):
            out = None if shape is None else np.empty(shape, np.float32)
            fn, args = self._gemv_call(jit, a2, bq, sc, zq, out)
            y, threads = args[6], args[-1]
            if getattr(jit, "native", False):  # the native code cache: its plan, called on (A, y)
                plan = self._native_plan(jit, threads > 1, args)
                if plan is not None:
                    fn, args = plan, (a2, y)
            if threads == 1 or m > JIT_MAX_ROWS:  # the stall guard's yardstick is a few rows
                fn(*args)
            else:
                t0 = time.perf_counter()
                fn(*args)
                t1 = time.perf_counter()
                _stall_guard.record(t1 - t0, bq.nbytes + sc.nbytes + (0 if zq is None else zq.nbytes), t1, id(self))
            return y if out is None else out
        zmode, zarr, zmid = self._zmode(zq)
        return self._panels(a2, bq, sc, zarr, zmode, zmid, jit)

    def _paired_part(self, jit, a2: np.ndarray, shape: tuple[int, ...]):
        """(the native plan, its output as (M, N), the fresh output of ``shape``) of a parallel
        int8 GEMV of ``a2`` (float32, C-contiguous, K columns) — the part
        :class:`GatedMatMulNBits` pairs with another — or None where this call takes another path."""
        bq, sc = self._packed.get(1), self._packed.get(2)
        zq = self._packed.get(3) if self.has_zp else None
        if bq is None or sc is None or (self.has_zp and zq is None) or not self._int8(jit, zq):
            return None
        out = np.empty(shape, np.float32)
        fn, args = self._gemv_call(jit, a2, bq, sc, zq, out)
        if args[-1] == 1:
            return None
        plan = self._native_plan(jit, True, args)
        return None if plan is None else (plan, args[6], out)

    def _native_plan(self, jit, parallel: bool, args: tuple):
        """The native code cache's plan of the GEMV ``args`` are for (see ``_jit_native.gemv_plan``),
        kept on the kernel per calling thread, rows and thread count: a decoding step then skips
        the plan's look-up by its fourteen keys (~5 us per call, ~120 calls per token)."""
        a2, bq, sc, zq, zmode, zmid, _, n, nb, blob, tile, threads = args
        key = (threading.get_ident(), a2.shape[0], threads)
        kept = self._plan
        if kept is not None and kept[0] == key and kept[1].holds(bq, sc):
            return kept[1]
        plan = jit.gemv_plan(self.cbits, parallel, a2, bq, sc, zq, zmode, zmid, n, nb, blob, tile, threads,
                             "_i8" if self._int8(jit, zq) else "")
        self._plan = None if plan is None else (key, plan)
        return plan

    def _int8(self, jit, zq) -> bool:
        """Whether A is rounded to int8 per block, as onnxruntime's ``accuracy_level=4`` does (it
        computes float zero points in float): the JIT's int8 GEMV on a CPU with AVX-512 VNNI or
        AVX2, for any number of rows (at M=128 it beats dequantized panels and BLAS: measured with
        VNNI 896x4864 5.3 vs 6.8 ms, the lm_head 152 vs 219 ms, 2 threads; with AVX2 7.7 vs
        10.4 ms and 310 vs 274 ms, at M=32 2.5 vs 5.3 ms and 50 vs 86 ms)."""
        # (2-bit weights in blocks of 16: onnxruntime 1.32 computes those in float)
        return (self.accuracy_level == 4 and jit.int8_dot and (zq is None or zq.dtype == np.uint8)
                and (self.bits != 2 or self.block_size >= 32))

    def _gemv_call(self, jit, a2: np.ndarray, bq, sc, zq, out: np.ndarray | None = None) -> tuple[Any, tuple]:
        """The JIT GEMV for ``a2`` and its arguments; the output ``y`` (M, N) is ``args[6]``, a
        view of ``out`` (fresh, C-contiguous, M * N float32) when given."""
        m = a2.shape[0]
        fns = self._gemv_fns
        if fns is None or fns[0] is not jit or fns[1] is not sc or fns[2] is not zq:
            # (jit, sc, zq, serial GEMV, parallel GEMV, the arguments after A and B): the same
            # for every call once the weights are packed
            zmode, zarr, zmid = self._zmode(zq)
            name = f"gemv{self.cbits}{'_i8' if self._int8(jit, zq) else ''}"
            fns = self._gemv_fns = (jit, sc, zq, getattr(jit, name + "_serial"), getattr(jit, name),
                                    (_jit_view(sc), _jit_view(zarr), zmode, zmid))
        y = np.empty((m, self.n), np.float32) if out is None else out.reshape(m, self.n)
        threads = _gemv_threads(jit, m * self.k * self.n)
        return fns[3] if threads == 1 else fns[4], (a2, bq, *fns[5], y, self.n, self.nblocks, self.blob, TILE,
                                                    threads)

    def _panels(self, a2, bq, sc, zarr, zmode, zmid, jit) -> np.ndarray:
        """``a2 @ W`` by dequantizing panels of whole tiles into a reused scratch, then BLAS.

        With more than one thread (:func:`._act.threads`) and threadpoolctl installed, the panels
        are split over onnxpack's threads (:func:`._act.parallel`: chunks from a shared counter,
        the caller works too) and BLAS runs on one thread for the call, so the dequantization
        runs in parallel too and a descheduled thread never stalls the others.  OpenBLAS splits
        each call statically between its threads and waits for the slowest: measured M=128,
        2 threads, fresh processes, while another process loaded the machine, lm_head
        896x151936 3.5-4.7 s with OpenBLAS's 2 threads vs 0.47-0.90 s split; on a quiet machine
        254 vs 235 ms (gate_up 896x4864: 12.8-13.7 vs 9.4-12.0 ms, down 4864x896 12.3-19.9 vs
        10.6-11.0 ms).  The BLAS limit is process-wide while the call runs (BLAS libraries have
        no per-thread setting): a BLAS call from another Python thread meanwhile runs on one
        thread too, and a concurrent prefill-sized call here then sees one thread and does not
        split.
        """
        m = a2.shape[0]
        kpad = self.nblocks * self.block_size
        ntiles = -(-self.n // TILE)
        y = np.empty((m, self.n), np.float32)
        threads = _act.threads()  # one tile: the caller alone, still with a one-thread BLAS
        split = threads > 1 and _blas_threads_control() is not None
        per = 1 if split else max(1, _PANEL_FLOATS // (kpad * TILE))

        def run(p0: int, p1: int) -> None:
            for t0 in range(p0 * per, min(ntiles, p1 * per), per):
                t1 = min(ntiles, t0 + per)
                c0, c1 = t0 * TILE, min(self.n, t1 * TILE)
                w = _scratch(kpad * (c1 - c0)).reshape(kpad, c1 - c0)
                if jit is not None:
                    fn = jit.dequant4 if self.cbits == 4 else jit.dequant8
                    fn(bq, _jit_view(sc), _jit_view(zarr), zmode, zmid, w, self.n, self.nblocks, self.blob, TILE,
                       t0, t1)
                else:
                    self._dequant_numpy(bq, sc, zarr, zmode, zmid, t0, t1, w)
                np.matmul(a2, w[: self.k], out=y[:, c0:c1])

        npanels = -(-ntiles // per)
        if split:
            with _blas_threads_control()(1):
                _act.parallel(run, npanels, threads)
        else:
            run(0, npanels)
        return y

    def _dequant_numpy(self, bq, sc, zarr, zmode, zmid, t0, t1, out) -> None:
        """numpy twin of the JIT's dequant: tiles ``t0 <= t < t1`` into ``out`` (K_pad, columns).

        Tile by tile, straight into ``out`` (splitting out's row axis is always a view): each
        bit plane is shifted, masked and converted in one assignment, then the zero point is
        subtracted and the scale applied in place: 2 + 8/bits passes, no temporaries of W's size.
        """
        n, nb, bs, bits = self.n, self.nblocks, self.block_size, self.cbits
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        bfull, blast = _tile_views(bq, n, nb, self.blob)
        sfull, slast = _tile_views(sc, n, nb, 1)
        if zmode:
            zfull, zlast = _tile_views(zarr, n, nb, 1)
        nfull = bfull.shape[0]
        for t in range(t0, t1):
            c0 = (t - t0) * TILE
            last = t >= nfull
            braw = blast if last else bfull[t]  # (nb, blob, w)
            w = braw.shape[-1]
            dst = out[:, c0:c0 + w]
            planes = dst.reshape(nb, self.blob, per, w)
            for p in range(per):
                planes[:, :, p, :] = (braw >> np.uint8(p * bits)) & mask if per > 1 else braw
            q = dst.reshape(nb, bs, w)
            if zmode:
                q -= (zlast if last else zfull[t]).astype(np.float32)
            else:
                q -= zmid
            q *= (slast if last else sfull[t]).astype(np.float32, copy=False)

    def _trivial_g_idx(self, g_idx: np.ndarray) -> bool:
        g = np.asarray(g_idx)
        if g.size != self.k or g.dtype.kind not in "iu":
            raise InvalidArgument(
                f"node {self.node.name!r} (MatMulNBits): g_idx must be integers with K={self.k} elements, "
                f"got {g.dtype}{list(g.shape)}"
            )
        if g.size and (g.min() < 0 or g.max() >= self.nblocks):
            raise InvalidArgument(
                f"node {self.node.name!r} (MatMulNBits): g_idx values must be in [0, {self.nblocks}), "
                f"got [{g.min()}, {g.max()}]"
            )
        return bool(np.array_equal(g.reshape(-1), np.arange(self.k) // self.block_size))

    def _dense_g_idx(self, bq, sc, zq, g_idx) -> np.ndarray:
        """The (K, N) float32 weight with act-order block indices (numpy; correct, not fast)."""
        n, nb = self.n, self.nblocks
        q = unpack_nbits(_untile(bq, n, nb, self.blob), self.cbits, self.block_size).reshape(n, -1)[:, : self.k]
        s = _untile(sc, n, nb, 1).reshape(n, nb).astype(np.float32)
        z = (_untile(zq, n, nb, 1).reshape(n, nb).astype(np.float32) if zq is not None
             else np.full((n, nb), float(1 << (self.bits - 1)), np.float32))
        g = np.asarray(g_idx).reshape(-1).astype(np.intp)
        return np.ascontiguousarray(((q.astype(np.float32) - z[:, g]) * s[:, g]).T)


@register_fused("dq_nbits")
class DequantizeMatMulNBits(MatMulNBits):
    """``MatMul(A, DequantizeLinear(W, scales, zero points))`` with a 4-bit W blocked along K
    (``_fusion.find_dq_matmul_nbits``), run as MatMulNBits.  Inputs 1-3 are the model's own
    (K, N) int4/uint4 W and (K / block, N) scales and zero points; each is packed into
    MatMulNBits' tiles from its MatMulNBits form: W transposed to (N, K) and two codes a byte
    (low nibble first), int4 codes and zero points shifted by 8 to the unsigned codes MatMulNBits
    reads ((q + 8) - (z + 8) = q - z; no zero points: MatMulNBits' default 8 is int4's 0)."""

    op_type = "MatMulNBits"
    domain = "com.microsoft"

    def __init__(self, node, ctx, *, zero_codes: bool = False) -> None:
        super().__init__(node, ctx)
        if zero_codes:  # a uint4 weight without zero points: codes of 0 (``_fusion.find_dq_matmul_nbits``)
            self.has_zp = True
            self._packed[3] = to_tiles(np.zeros((self.n, self.nblocks, 1), np.uint8))

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index not in (1, 2, 3) or self._dq_problem(input_index, tuple(info.shape), np.dtype(info.dtype)):
            return None
        attrs = struct.pack("<qqqqBq", self.k, self.n, self.bits, self.block_size, input_index, TILE)
        return PackSpec("dqmatmulnbits", _PACK_VERSION, attrs, 1)

    def _codes_zero_points(self, info: TensorInfo) -> bool:
        return True  # 4-bit zero points, packed as MatMulNBits' uint8 codes

    def _dq_problem(self, i: int, shape: tuple, dtype: np.dtype) -> str | None:
        want = (self.k, self.n) if i == 1 else (self.nblocks, self.n)
        if shape != want:
            return f"shape {list(shape)}, expected {list(want)}"
        if i == 2:
            return None if _is_float(dtype) else f"dtype {dtype}, expected a float type"
        return None if dtype.name in ("int4", "uint4") else f"dtype {dtype}, expected int4 or uint4"

    def _pack(self, i: int, arr: np.ndarray) -> np.ndarray:
        if arr is None:
            return super()._pack(i, arr)  # (its error)
        reason = self._dq_problem(i, tuple(arr.shape), arr.dtype)
        if reason is not None:
            raise InvalidArgument(f"node {self.node.name!r} (MatMul of a DequantizeLinear): input {i} has {reason}")
        if i == 2:
            return super()._pack(2, np.ascontiguousarray(np.asarray(arr).T))
        codes = np.asarray(arr).astype(np.uint8 if arr.dtype.name == "uint4" else np.int8)
        codes = (codes.astype(np.int16) + (8 if arr.dtype.name == "int4" else 0)).astype(np.uint8).T  # (N, K) or (N, nb)
        if i == 1:
            kpad = self.nblocks * self.block_size
            full = np.zeros((self.n, kpad), np.uint8)
            full[:, : self.k] = codes
        else:
            full = np.zeros((self.n, self.nblocks + (self.nblocks & 1)), np.uint8)
            full[:, : self.nblocks] = codes
        return super()._pack(i, pack_nibbles(full))


@register_fused("nbits_gated")
class GatedMatMulNBits(Kernel):
    """``act(A @ W_gate) * (A @ W_up)`` — the gated MLP of Llama/Qwen-family decoders as one step
    (``_fusion.find_gated_nbits``): the gate projection with its fused activations (an
    :class:`ActAfter` over :class:`MatMulNBits`), the up projection, then the product in place on
    the gate's fresh result.  Each projection is the kernel it would be unfused, with the same
    packs (inputs 1-5 are the gate's, 6-10 the up projection's B, scales, zero points, g_idx,
    bias), so the arithmetic — and a saved model's records — are those of the three nodes.

    Why: a decoding step runs these 3 nodes per layer; one step instead of three saves two step
    dispatches and the Mul's output allocation (~50 us per layer with the per-step costs of a
    Qwen2.5-0.5B decoding step)."""

    op_type = "MatMulNBits"
    domain = "com.microsoft"

    def __init__(self, node, ctx, *, up, acts) -> None:
        super().__init__(node, ctx)
        from onnxpack.session.kernels.elementwise import ActAfter

        gate = type(node)()
        gate.CopyFrom(node)
        del gate.input[6:]
        self.gate = ActAfter(MatMulNBits(gate, ctx), acts)
        self.up = MatMulNBits(up, ctx)
        self._again: tuple | None = None  # see _paired

    def _part(self, i: int) -> tuple[Kernel, int]:
        return (self.gate, i) if i < 6 else (self.up, i - 5)

    def pack_spec(self, input_index, info):
        k, i = self._part(input_index)
        return k.pack_spec(i, info) if i else None

    def expected_packed(self, input_index, info):
        k, i = self._part(input_index)
        return k.expected_packed(i, info) if i else None

    def check_packed(self, input_index, info, buffers):
        k, i = self._part(input_index)
        return k.check_packed(i, info, buffers) if i else "kernel does not pack this input"

    def prepack(self, input_index, weight):
        k, i = self._part(input_index)
        return k.prepack(i, weight)

    def use_prepacked(self, input_index, buffers) -> None:
        k, i = self._part(input_index)
        k.use_prepacked(i, buffers)

    def warm_up(self) -> None:
        self.up.warm_up()

    def run(self, a, b=None, scales=None, zero_points=None, g_idx=None, bias=None, up_b=None, up_scales=None,
            up_zero_points=None, up_g_idx=None, up_bias=None):
        if g_idx is None and bias is None and up_g_idx is None and up_bias is None:
            paired = self._paired(a)
            if paired is not None:
                return (paired,)
        (g,) = self.gate.run(a, b, scales, zero_points, g_idx, bias)
        (u,) = self.up.run(a, up_b, up_scales, up_zero_points, up_g_idx, up_bias)
        if g.shape == u.shape and g.dtype == u.dtype and g.flags.writeable and g.flags.owndata:
            np.multiply(g, u, out=g)  # the gate's result is fresh: in place
            return (g,)
        return (np.multiply(g, u),)

    def _repeat(self, a, jit) -> np.ndarray | None:
        """:meth:`_paired` by this thread's last pair of plans when ``a`` has that call's shape
        (see :meth:`MatMulNBits._repeat`): what the pairing depends on is checked again, the rest
        of :meth:`_paired`'s work is not redone; None where the full path decides."""
        kept = self._again
        if kept[0] != threading.get_ident() or not getattr(jit, "native", False):
            return None
        p1, p2, weights, shape, nbytes = kept[2:]
        # (As in MatMulNBits._repeat, no ``holds``: the two plans share A's scratch — jit.pairs
        # checked it when the pair was kept — and their blocks do not change.)
        if (not all(k._packed.get(i) is w for k, i, w in weights)
                or _gemv_threads(jit, a.size * self.up.n) != p1.threads):
            return None
        t0 = time.perf_counter()
        g = np.empty(shape, np.float32)
        u = np.empty(shape, np.float32)
        jit.gemv_pair(p1, p2, a, g, u)
        t1 = time.perf_counter()
        _stall_guard.record(t1 - t0, nbytes, t1, id(self))
        g = self.gate._apply(g)
        np.multiply(g, u, out=g)
        return g

    def _paired(self, a) -> np.ndarray | None:
        """``act(A @ W_gate) * (A @ W_up)`` with both GEMVs in one OpenMP region of the native
        code cache (``_jit_native.gemv_pair``: A quantized once, one fork-join, the team taking
        the work items of both weights), or None where the two calls run apart.  The same work
        items as two calls, so the same values.  Why: a decoding step runs this once per layer;
        apart, the second call pays its own fork-join, A's quantization and ~10 us of Python."""
        gate, up = self.gate.inner, self.up
        if (a.__class__ is not np.ndarray or a.dtype != np.float32 or a.ndim < 1 or a.shape[-1] != gate.k
                or up.k != gate.k or up.n != gate.n or gate.k == 0 or gate.n == 0 or not a.flags.c_contiguous):
            return None
        jit = _jit()
        if self._again is not None and a.shape == self._again[1]:
            g = self._repeat(a, jit)
            if g is not None:
                return g
        if not getattr(jit, "native", False):
            return None
        lead = a.shape[:-1]
        a2 = a.reshape(-1, gate.k)
        m = a2.shape[0]
        if m == 0:
            return None
        first = gate._paired_part(jit, a2, (*lead, gate.n))
        second = up._paired_part(jit, a2, (*lead, up.n)) if first is not None else None
        if second is None or not jit.pairs(first[0], second[0]):
            return None
        (p1, y1, g), (p2, y2, u) = first, second
        t0 = time.perf_counter()
        jit.gemv_pair(p1, p2, a2, y1, y2)
        t1 = time.perf_counter()
        if m <= JIT_MAX_ROWS:  # the stall guard's yardstick is a few rows
            nbytes = sum(x.nbytes for k in (gate, up) for x in k._packed.values())
            _stall_guard.record(t1 - t0, nbytes, t1, id(self))
            weights = tuple((k, i, k._packed.get(i)) for k in (gate, up) for i in (1, 2, 3))
            self._again = (threading.get_ident(), a.shape, p1, p2, weights, g.shape, nbytes)
        g = self.gate._apply(g)
        np.multiply(g, u, out=g)
        return g


# -- GatherBlockQuantized ---------------------------------------------------------------------------


@register("GatherBlockQuantized", domain="com.microsoft", since=1)
class GatherBlockQuantized(Kernel):
    """Gather slices of a block-quantized tensor and dequantize only them.

    ``data`` uint8 (values packed ``8 // bits`` per byte, low bits first, like MatMulNBits; absent
    zero points mean ``2**(bits-1)``; gather_axis 0 and quantize_axis last, as onnxruntime
    requires) or int4/uint4 (one value per element, any axes, bits 4, absent zero points mean 0).
    ``scales`` has data's rank with the quantize axis counted in blocks; the output has the
    scales' dtype.  Nothing is packed: the kernel reads the model's own bytes on every call and
    touches only the gathered rows.  Out-of-range indices are an error (onnxruntime writes
    zeros for them).
    """

    op_type = "GatherBlockQuantized"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.gather_axis = int(self.attr("gather_axis", 0))
        self.quantize_axis = int(self.attr("quantize_axis", 1))
        self.block_size = int(self.attr("block_size", 128))
        self.bits = int(self.attr("bits", 4))
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise InvalidArgument(
                f"node {node.name!r} (GatherBlockQuantized): block_size must be a power of 2 and >= 16, "
                f"got {self.block_size}"
            )
        if self.bits not in (2, 4, 8):
            raise InvalidArgument(f"node {node.name!r} (GatherBlockQuantized): bits must be 2, 4 or 8, got {self.bits}")

    def _fail(self, msg: str) -> InvalidArgument:
        return InvalidArgument(f"node {self.node.name!r} (GatherBlockQuantized): {msg}")

    def run(self, data, indices, scales, zero_points=None):
        if data is None or indices is None or scales is None:
            raise self._fail("data, indices and scales are required")
        r = data.ndim
        if r < 1:
            raise self._fail("data must have rank >= 1")
        ga = self.gather_axis + r if self.gather_axis < 0 else self.gather_axis
        qa = self.quantize_axis + r if self.quantize_axis < 0 else self.quantize_axis
        if not (0 <= ga < r and 0 <= qa < r):
            raise self._fail(f"gather_axis {self.gather_axis} / quantize_axis {self.quantize_axis} out of range for rank {r}")
        if indices.dtype.kind not in "iu":
            raise self._fail(f"indices must be int32 or int64, got {indices.dtype}")
        if not _is_float(scales.dtype):
            raise self._fail(f"scales must be float, got {scales.dtype}")
        if scales.ndim != r:
            raise self._fail(f"data and scales must have the same rank, got {r} and {scales.ndim}")
        packed = data.dtype == np.uint8
        if packed:
            if ga != 0 or qa != r - 1 or r < 2:
                raise self._fail(f"uint8 data needs gather_axis 0 and quantize_axis {r - 1} (last), got {ga} and {qa}")
            comp = 8 // self.bits
        elif data.dtype.name in ("int4", "uint4"):
            if self.bits != 4:
                raise self._fail(f"int4/uint4 data needs bits 4, got {self.bits}")
            comp = 1
        else:
            raise self._fail(f"data must be uint8, int4 or uint4, got {data.dtype}")
        dim = data.shape[ga]
        idx = np.asarray(indices).astype(np.int64).reshape(-1)
        if idx.size and (idx.min() < -dim or idx.max() >= dim):
            raise self._fail(f"indices must be in [-{dim}, {dim - 1}], got [{idx.min()}, {idx.max()}]")
        idx = np.where(idx < 0, idx + dim, idx)
        qlen = data.shape[qa] * comp
        nblk = -(-qlen // self.block_size)
        want_scales = tuple(nblk if i == qa else d for i, d in enumerate(data.shape))
        if tuple(scales.shape) != want_scales:
            raise self._fail(f"scales must have shape {list(want_scales)}, got {list(scales.shape)}")
        if zero_points is not None:
            zshape = tuple(-(-nblk // comp) if i == qa else d for i, d in enumerate(want_scales))
            if tuple(zero_points.shape) != zshape or zero_points.dtype != data.dtype:
                raise self._fail(f"zero_points must be {data.dtype} with shape {list(zshape)}, "
                                 f"got {zero_points.dtype}{list(zero_points.shape)}")
        out_dtype = scales.dtype
        sel = np.take(data, idx, axis=ga)  # only the gathered slices are read
        if packed:
            q = unpack_nbits(sel, self.bits, qlen)
        else:
            q = sel.astype(np.int8)
        # Block index of every position along the quantize axis, as seen after the gather.
        if ga == qa:
            blk = idx // self.block_size
        else:
            blk = np.arange(qlen) // self.block_size
        s = np.take(scales, idx, axis=ga) if ga != qa else scales
        s = np.take(s, blk, axis=qa).astype(np.float32)
        if zero_points is None:
            z = np.float32(1 << (self.bits - 1)) if packed else np.float32(0)
        else:
            zsel = np.take(zero_points, idx, axis=ga) if ga != qa else zero_points
            zsel = unpack_nbits(zsel, self.bits, nblk) if packed else zsel.astype(np.int8)
            z = np.take(zsel, blk, axis=qa).astype(np.float32)
        w = (q.astype(np.float32) - z) * s
        out_shape = data.shape[:ga] + tuple(np.shape(indices)) + data.shape[ga + 1:]
        out_shape = out_shape[:-1] + (out_shape[-1] * comp,) if packed else out_shape
        return (w.reshape(out_shape).astype(out_dtype, copy=False),)


# The 16 values of bitsandbytes' 4-bit codes as onnxruntime's MatMulBnb4 decodes them (float32;
# measured against onnxruntime 1.32 in tests/session/test_kernels_int4.py): FP4 (sign bit, then a
# 3-bit magnitude code) and NF4 (normal-distribution quantiles).
BNB4_TABLES = {
    0: np.array([0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5, 0.1666666716337204,
                 0.25, 0.0, -0.0052083334885537624, -0.6666666865348816, -1.0, -0.3333333432674408, -0.5,
                 -0.1666666716337204, -0.25], np.float32),
    1: np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0], np.float32),
}

_BNB4_TILE = 1 << 18  # weight elements dequantized at a time (1 MiB of float32 scratch)


@register("MatMulBnb4", domain="com.microsoft", since=1)
class MatMulBnb4(Kernel):
    """``Y = A @ dequantize(B)``, the FP4 / NF4 weights of onnxruntime's ``MatMulBnb4Quantizer``.

    ``B`` uint8 ((N*K + 1) / 2,): the transposed (N, K) weight flattened, two 4-bit codes per
    byte, element ``2j`` in the high nibble of byte ``j``; ``absmax`` ((N*K + block_size - 1) /
    block_size,): one scale per block of ``block_size`` consecutive elements of that flattening.
    ``W^T[n, k] = table[code] * absmax[(n*K + k) // block_size]`` (one float32 product, as
    onnxruntime), then the GEMM.  ``transB=0`` (never written by the quantizer) is declined:
    onnxruntime's CPU kernel multiplies by the transposed weight whatever it says.

    Nothing is packed: the 4-bit codes stay as the model stores them and are decoded per call,
    a tile of rows of ``W^T`` at a time into a small scratch (a pack of one input cannot fold in
    another input's scales, and a decoded pack would be 8x the model's bytes)."""

    op_type = "MatMulBnb4"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        missing = [a for a in ("K", "N", "block_size", "quant_type") if a not in self.attrs]
        if missing:
            raise InvalidArgument(f"node {node.name!r} (MatMulBnb4): missing attribute(s) {missing}")
        self.k, self.n = int(self.attr("K")), int(self.attr("N"))
        self.block_size = int(self.attr("block_size"))
        quant_type = int(self.attr("quant_type"))
        if not int(self.attr("transB", 1)):
            raise NotImplementedError("MatMulBnb4 with transB=0 (onnxruntime's CPU kernel ignores it)")
        if quant_type not in BNB4_TABLES:
            raise InvalidArgument(f"node {node.name!r} (MatMulBnb4): quant_type must be 0 (FP4) or 1 (NF4), got {quant_type}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise InvalidArgument(
                f"node {node.name!r} (MatMulBnb4): block_size must be a power of 2 and >= 16, got {self.block_size}")
        if self.k < 0 or self.n < 0:
            raise InvalidArgument(f"node {node.name!r} (MatMulBnb4): K and N must be >= 0, got K={self.k} N={self.n}")
        self.table = BNB4_TABLES[quant_type]

    def _fail(self, message: str) -> InvalidArgument:
        return InvalidArgument(f"node {self.node.name!r} (MatMulBnb4): {message}")

    def decode(self, b: np.ndarray, absmax: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the flattened (N, K) weight, decoded to float32."""
        b0, b1 = start // 2, (stop + 1) // 2
        chunk = b[b0:b1]
        codes = np.empty(2 * chunk.size, np.uint8)
        np.right_shift(chunk, 4, out=codes[0::2])
        np.bitwise_and(chunk, 15, out=codes[1::2])
        first = start - 2 * b0
        vals = self.table.take(codes[first:first + stop - start])
        bs = self.block_size
        a0 = start // bs
        scale = np.repeat(absmax[a0:(stop - 1) // bs + 1], bs)[start - a0 * bs:stop - a0 * bs]
        vals *= scale
        return vals

    def run(self, a, b=None, absmax=None):
        k, n = self.k, self.n
        numel = k * n
        if b is None or b.dtype != np.uint8 or b.size != (numel + 1) // 2:
            raise self._fail(f"B must be uint8 with (N*K + 1) / 2 = {(numel + 1) // 2} elements, "
                             f"got {None if b is None else f'{b.dtype}{list(b.shape)}'}")
        nabs = -(-numel // self.block_size)
        if absmax is None or absmax.dtype.kind != "f" or absmax.size != nabs:
            raise self._fail(f"absmax must be float with ceil(N*K / block_size) = {nabs} elements, "
                             f"got {None if absmax is None else f'{absmax.dtype}{list(absmax.shape)}'}")
        if a is None or a.dtype.kind != "f" or a.ndim < 1 or a.shape[-1] != k:
            raise self._fail(f"A must be float with last dimension {k}, "
                             f"got {None if a is None else f'{a.dtype}{list(a.shape)}'}")
        b = b.reshape(-1)
        scales = absmax.reshape(-1).astype(np.float32, copy=False)
        a2 = as_compute(a).reshape(-1, k).astype(np.float32, copy=False)
        y = np.empty((a2.shape[0], n), np.float32)
        if numel <= _BNB4_TILE or k == 0:
            np.matmul(a2, self.decode(b, scales, 0, numel).reshape(n, k).T, out=y)
        else:
            rows = max(1, _BNB4_TILE // k)  # rows of W^T (columns of Y) per tile
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                w = self.decode(b, scales, r0 * k, r1 * k).reshape(r1 - r0, k)
                np.matmul(a2, w.T, out=y[:, r0:r1])
        return (y.reshape(*a.shape[:-1], n).astype(a.dtype, copy=False),)
