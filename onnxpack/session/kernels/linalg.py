"""MatMul and Gemm: the kernels where most of a dense model's time goes.

Both hand their work to one BLAS call (``np.matmul``).  numpy has no float16/bfloat16 BLAS (a
float16 ``np.matmul`` runs a scalar loop, ~100x slower than sgemm), so half-precision operands are
widened to float32, multiplied, and the result is cast back to the dtype ONNX says the output has.

Pre-packing (constant right-hand operand ``B``):

* The packed buffer is ``B`` (transposes resolved) in the compute dtype.  A float32 ``B`` with
  at least 64 columns is packed as *panels* (:func:`pack_panels`: blocks of 64 columns, each
  K rows of 64 contiguous floats), which the JIT GEMM of :mod:`._sgemm_jit` streams once per
  block of K (its docstring has the measurements: 1.5x OpenBLAS on an encoder's short
  activations, where OpenBLAS's own copy of B inside every call costs as much as the
  arithmetic).  Without numba, and for narrower and float64 weights, ``B`` stays a
  C-contiguous ``(K, N)`` matrix, used as ``A @ packed`` (measured,
  OpenBLAS 0.3.31 SkylakeX kernels, A 64x1024, B 1024x4096: ``(K, N)`` 3.9-4.1 ms on one thread,
  ``(N, K)`` read as ``B^T`` 4.6 ms).
* Gemm folds ``transB`` and ``alpha`` into that buffer, so the call does no extra scaling pass;
  both are in ``PackSpec.attrs`` because they change the packed bytes.  ``C`` stays unpacked: the
  bias is small and is added in place.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Sequence

import numpy as np

from onnxpack.errors import InvalidArgument, InvalidGraph
from onnxpack.graph._proto import NodeProto
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, register, register_fused

logger = logging.getLogger(__name__)

__all__ = ["MatMul", "Gemm", "FusedMatMul"]

# Version of the packed layout written by this module; bump when the layout changes so saved
# blobs of an older layout are ignored (their key no longer matches).  3: float32 panels.
_PACK_VERSION = 3
# Columns per panel (_sgemm_jit.NR; that module imports numba, so the number is repeated here).
PANEL = 64

# Dtypes computed by widening to float32 (no BLAS for them in numpy).
_HALF_KINDS = ("float16", "bfloat16")


_COMPUTE: dict = {}  # dtype (or type) -> compute_dtype's answer: kernels ask on every call


def compute_dtype(dtype: np.dtype) -> np.dtype | None:
    """The dtype BLAS computes in for operands of ``dtype``; ``None`` when BLAS does not apply."""
    try:
        return _COMPUTE[dtype]
    except (KeyError, TypeError):
        pass
    got = _compute_dtype(dtype)
    try:
        if len(_COMPUTE) < 256:
            _COMPUTE[dtype] = got
    except TypeError:  # pragma: no cover - an unhashable dtype-like
        pass
    return got


def _compute_dtype(dtype) -> np.dtype | None:
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return np.dtype(np.float64)
    if dtype == np.float32 or dtype.name in _HALF_KINDS:
        return np.dtype(np.float32)
    return None


def as_compute(x: np.ndarray) -> np.ndarray:
    """``x`` in its compute dtype (a no-op for float32/float64)."""
    cd = compute_dtype(x.dtype)
    if cd is None or x.dtype == cd:
        return x
    return _act.astype(x, cd)


def uses_panels(dtype, shape) -> bool:
    """Whether a constant ``B`` of this dtype and (K, N) shape is packed as panels: the JIT GEMM
    can run here and pays (numba, on a CPU with AVX-512; without numba numpy's BLAS multiplies
    (K, N) faster than the panels as a batch, and on AVX2 OpenBLAS's own kernels beat the JIT's:
    see :func:`_panel_cpu`), float32 (or half, widened), at least 64 columns, and the last
    panel's zero padding at most a quarter of N (N = 65 would multiply twice its columns).  The
    pack's key says which layout it is (:func:`layout_attrs`)."""
    if len(shape) != 2 or shape[0] < 1 or shape[1] < PANEL or compute_dtype(dtype) != np.float32:
        return False
    n = int(shape[1])
    return 4 * (-(-n // PANEL) * PANEL) <= 5 * n and _panel_cpu() and _act.jit_possible()


_ENV_PANELS = "ONNXPACK_PANELS"
_KEY_PANELS = _ENV_PANELS.encode()


def _panel_cpu() -> bool:
    """Whether the panels pay on this CPU: with AVX-512 the JIT GEMM beats OpenBLAS (see
    ``_sgemm_jit``: 100-113 vs 77-98 GFLOP/s warm, 3.7 vs 5.7 ms on an encoder's cold weights);
    on AVX2 (AMD EPYC, one thread) its best tile (6 x 16) ran 44-54 GFLOP/s against OpenBLAS's
    63-70, and an encoder's 18 cold weight GEMMs 12.1 vs 8.6 ms, so weights stay (K, N) for BLAS.
    ``ONNXPACK_PANELS=1`` packs panels on any CPU (numba still needed), ``0`` on none."""
    forced = _act.getenv(_ENV_PANELS, _KEY_PANELS)
    if forced in ("0", "1"):
        return forced == "1"
    from onnxpack.session.kernels._native import cpu_flags

    return "avx512f" in cpu_flags()


def layout_attrs(dtype, shape) -> bytes:
    """What a pack's ``PackSpec.attrs`` add for its layout: panels and (K, N) packs of one weight
    have different keys, so a container shared by sessions with and without the JIT never hands
    one the other's layout."""
    return b"|panels" if uses_panels(dtype, shape) else b""


def identity_panels(dtype, shape) -> bool:
    """Whether :func:`pack_b` of a (K, N) ``B`` of ``dtype`` is ``B``'s own bytes."""
    return compute_dtype(dtype) == np.dtype(dtype) and (not uses_panels(dtype, shape) or shape[1] == PANEL)


def packed_shape(dtype, k: int, n: int) -> tuple[int, ...]:
    """The shape of :func:`pack_b`'s buffer for a (K, N) ``B`` of ``dtype``."""
    return (-(-n // PANEL), k, PANEL) if uses_panels(dtype, (k, n)) else (k, n)


def pack_b(b: np.ndarray) -> np.ndarray:
    """A constant (K, N) ``B`` packed for :func:`matmul_packed`: panels (:func:`pack_panels`)
    where :func:`uses_panels`, else C-contiguous in the compute dtype."""
    if uses_panels(b.dtype, b.shape):
        return pack_panels(b)
    return np.ascontiguousarray(b, dtype=compute_dtype(b.dtype))


def pack_panels(b: np.ndarray) -> np.ndarray:
    """(K, N) -> float32 (ceil(N / 64), K, 64): block p holds columns 64p..64p+63, row by row;
    the last block's missing columns are zeros.  A float32 B of exactly 64 columns is its own
    single panel: a view of it (an identity pack, see :func:`identity_panels`)."""
    k, n = b.shape
    if n == PANEL:
        return np.ascontiguousarray(b, dtype=np.float32).reshape(1, k, PANEL)
    full = n // PANEL
    out = np.empty((-(-n // PANEL), k, PANEL), np.float32)
    if full:
        out[:full] = b[:, :full * PANEL].reshape(k, full, PANEL).transpose(1, 0, 2)
    if n > full * PANEL:
        out[full] = 0
        out[full, :, :n - full * PANEL] = b[:, full * PANEL:]
    return out


_NO_TAIL = np.zeros((0, PANEL), np.float32)


def _sgemm():
    return _act.load_jit("_sgemm_jit", "float32 GEMM")


def warm_panels(writeable: bool) -> None:
    """Loads the float32 GEMM's JIT (numba's on-disk cache) off the critical path: one row
    times one panel of zeros, of the packed weight's array type (numba compiles read-only
    arrays apart).  It holds no weight: a warm-up thread must not read mapped bytes, whose file
    may shrink under it, nor keep a closed session's model mapped while it compiles."""
    jit = _sgemm()
    if jit is not None:
        panel = np.zeros(PANEL, np.float32)
        panel.flags.writeable = writeable
        jit.sgemm_panels(np.zeros((1, 1), np.float32), panel, np.empty((1, PANEL), np.float32), _NO_TAIL, 0, 1)


def adopt_pack(kernel: Kernel, w: np.ndarray) -> None:
    """What a kernel's packed ``B`` says of its runs: with panels for the JIT, its warm-up loads the
    JIT through a task that references no kernel (see ``Kernel.warm_up``)."""
    if w.ndim == 3 and _act.jit_possible():
        kernel.warm_up = functools.partial(warm_panels, bool(w.flags.writeable))


# A GEMM on panels split over threads by rows (each thread every panel) when it has at least this
# many rows and fewer panels than this; else by panels.  Measured two threads, 128 rows (BERT-base's
# tokens), weights cycled as a model runs them: 12 panels 0.61 -> 0.57 ms (K 768) and 2.69 -> 2.63
# (K 3072), 36 panels 2.07 -> 1.93, 256 rows x 12 panels 1.21 -> 1.06; 48 panels 2.39 -> 2.63 (so
# panels there).
_ROW_SPLIT_MIN_ROWS = 64
_ROW_SPLIT_MAX_PANELS = 48


def matmul_panels(a2: np.ndarray, w: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """``a2 @ B`` for a 2-D float32 ``a2`` (M, K) and ``B`` (K, ``n``) packed as panels ``w``;
    written into ``out`` (M, n) when given.  The JIT GEMM where numba is available, split over
    onnxpack's threads by panels; else numpy's BLAS on the panels as a batch."""
    m, k = a2.shape
    if out is None:
        out = np.empty((m, n), np.float32)
    matmul_panels_many(a2, (w,), (n,), (out,))
    return out


def matmul_panels_many(a2: np.ndarray, ws: Sequence[np.ndarray], ns: Sequence[int], outs: Sequence[np.ndarray]) -> None:
    """``outs[j][...] = a2 @ B_j`` for every weight ``B_j`` (K, ``ns[j]``) packed as panels
    ``ws[j]``, all of one K: one GEMM over the weights' panels side by side, split once over
    onnxpack's threads (the sibling projections of one activation, see :class:`MatMulGroup`):
    as a unit job where the pool's helpers poll (:func:`._act.run_units`, no GIL), else through
    :func:`._act.parallel`."""
    m, k = a2.shape
    if m == 0 or not sum(ns):
        return
    if k == 0:
        for out in outs:
            out[...] = 0
        return
    jit = _sgemm()
    if jit is None:
        for w, n, out in zip(ws, ns, outs):
            out[...] = np.matmul(a2, w).transpose(1, 0, 2).reshape(m, -1)[:, :n]
        return
    a2 = np.ascontiguousarray(a2, dtype=np.float32)
    if len(ws) == 1 and (_act.split_size(m, k, ns[0]) < _act._SPLIT_MACS or _act.threads() == 1):
        # Too small to split, or one thread: one call, none of the split's plumbing (a small
        # model's GEMV, 1 x 128 @ 128 x 128: ~1 us of arithmetic under ~9 us of it).
        (w,), (n,), (out,) = ws, ns, outs
        dst = out if out.flags.c_contiguous and out.dtype == np.float32 else np.empty((m, n), np.float32)
        jit.sgemm_panels(a2, w.reshape(-1), dst, _NO_TAIL if n % PANEL == 0 else np.empty((m, PANEL), np.float32),
                         0, w.shape[0])
        if dst is not out:
            out[...] = dst
        return
    dsts = [out if out.flags.c_contiguous and out.dtype == np.float32 else np.empty((m, n), np.float32)
            for n, out in zip(ns, outs)]
    tails = [_NO_TAIL if n % PANEL == 0 else np.empty((m, PANEL), np.float32) for n in ns]
    flats = [w.reshape(-1) for w in ws]
    counts = [w.shape[0] for w in ws]
    starts = [sum(counts[:j]) for j in range(len(counts))]
    panels = sum(counts)

    def run(p0: int, p1: int, r0: int = 0, r1: int = m) -> None:
        # Panels p0 <= p < p1 of the weights side by side, rows r0 <= r < r1.
        for j, first in enumerate(starts):
            lo, hi = max(p0, first) - first, min(p1, first + counts[j]) - first
            if lo < hi:
                tail = tails[j]
                jit.sgemm_panels(a2[r0:r1], flats[j], dsts[j][r0:r1], tail[r0:r1] if tail.shape[0] else tail, lo, hi)

    key = ("sgemm_panels", m, k, ns[0] if len(ns) == 1 else tuple(ns))
    threads = _act.threads() if _act.split_size(m, k, sum(ns)) >= _act._SPLIT_MACS else 1
    # Few panels: each thread all of them for its rows (the panel split's blocks of one or two
    # panels left the threads' shares uneven).
    by_rows = threads > 1 and m >= _ROW_SPLIT_MIN_ROWS and panels < _ROW_SPLIT_MAX_PANELS

    def native() -> bool:
        # The split without the GIL (_act.run_units): units of rows (each every panel) or of
        # one panel (every row), which the threads take from one counter.
        rows, groups = (-(-m // threads), 1) if by_rows else (m, panels)
        units = -(-m // rows) * groups
        table = np.empty(jit.T_W0 + jit.T_WLEN * len(ws), np.int64)
        table[jit.T_A:jit.T_W0] = (a2.ctypes.data, m, k, rows, 1 if groups > 1 else panels, groups, panels, len(ws))
        for j, (flat, count, n, dst, tail) in enumerate(zip(flats, counts, ns, dsts, tails)):
            b = jit.T_W0 + jit.T_WLEN * j
            table[b:b + jit.T_WLEN] = (flat.ctypes.data, count, n, dst.ctypes.data,
                                       tail.ctypes.data if tail.shape[0] else 0)
        return _act.run_units(jit.PANEL_UNIT, table, units, threads)

    if by_rows:
        _act.tuner(key).run(lambda lo, hi: run(0, panels, lo * m // threads, hi * m // threads), threads, threads,
                            native)
    else:
        _act.tuner(key).run(run, panels, threads, native)
    for dst, out in zip(dsts, outs):
        if dst is not out:
            out[...] = dst


def matmul_packed(a: np.ndarray, b: np.ndarray, n: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ B`` for an N-D ``a`` and a packed ``B`` (:func:`pack_b`; panels need B's column
    count ``n``), as one GEMM; into ``out`` (the result's shape, float32 for panels) when given.

    Flattening the leading dimensions of ``a`` turns numpy's per-batch GEMM loop into a single
    large GEMM (much faster for a (batch, seq, K) activation).
    """
    if b.ndim == 3:  # panels
        k = b.shape[1]
        if a.ndim == 0 or a.shape[-1] != k:
            raise ValueError(f"A's shape {list(a.shape)} does not multiply B's {k} rows")
        lead = a.shape[:-1]
        y2 = None if out is None else out.reshape(-1, n)
        y = matmul_panels(a.reshape(-1, k), b, n, y2)
        return out if out is not None else y.reshape(*lead, n)
    if a.ndim <= 1:
        return np.matmul(a, b, out=out)
    if a.ndim == 2:
        return _act.matmul(a, b, out=out)
    a2 = a.reshape(-1, a.shape[-1])
    if out is not None:
        _act.matmul(a2, b, out=out.reshape(-1, b.shape[1]))
        return out
    return _act.matmul(a2, b).reshape(*a.shape[:-1], b.shape[1])


_EINSUM_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,->")


@register("Einsum", since=12)
class Einsum(Kernel):
    """``numpy.einsum`` of the equation (letters, ``...``, ``,``, an optional ``->`` output; spaces
    allowed anywhere, as exporters write them: torchvision's MaxViT ``"B G H I D, B G H J D -> B
    G H I J"``), contraction order chosen by numpy (``optimize=True``: pairwise products through
    BLAS).  The result keeps the inputs' dtype; bfloat16 is computed in float32 (numpy cannot
    accumulate in it), as onnx.reference does.  An equation that does not fit the node (a
    character outside the grammar, a term count other than the input count) is the model's
    InvalidGraph at creation; operands that do not fit it are the run's InvalidArgument."""

    op_type = "Einsum"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        eq = self.attr("equation")
        what = f"node {node.name!r} (Einsum)"
        if not isinstance(eq, str) or not eq.strip():
            raise InvalidGraph(f"{what}: needs a non-empty string attribute 'equation', got {eq!r}")
        compact = "".join(eq.split())
        if (not set(compact) <= _EINSUM_CHARS or compact.count("->") > 1 or compact.replace("->", "").count(">")
                or compact.replace("->", "").count("-") or "," in compact.partition("->")[2]):
            raise InvalidGraph(f"{what}: equation {eq!r} is not of the form 'ab,bc->ac' (letters, '...', ',', '->')")
        terms = compact.split("->")[0].split(",")
        inputs = len(node.input)
        if len(terms) != inputs:
            raise InvalidGraph(f"{what}: equation {eq!r} has {len(terms)} input term(s) for {inputs} input(s)")
        self.equation = compact
        self.what = what

    def run(self, *xs):  # type: ignore[override]
        dtype = xs[0].dtype
        try:
            if dtype.name == "bfloat16":
                y = np.einsum(self.equation, *(x.astype(np.float32) for x in xs), optimize=True).astype(dtype)
            else:
                y = np.einsum(self.equation, *xs, optimize=True)
        except ValueError as exc:  # shapes that do not fit the equation, mixed ranks, ...
            raise InvalidArgument(f"{self.what}: inputs {[list(x.shape) for x in xs]} do not fit equation "
                                  f"{self.equation!r}: {exc}") from exc
        y = np.asarray(y)
        return (y if y.dtype == dtype else y.astype(dtype),)


@register("MatMul", since=1)
class MatMul(Kernel):
    """``Y = A @ B`` with numpy's broadcasting rules (ONNX MatMul follows ``numpy.matmul``)."""

    op_type = "MatMul"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._b: np.ndarray | None = None  # packed B (pack_b)
        self._n = 0  # B's columns (panels pad them)

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != 1 or len(info.shape) != 2 or compute_dtype(info.dtype) is None:
            return None
        self._n = int(info.shape[1])
        identity = identity_panels(info.dtype, info.shape)
        return PackSpec("matmul", _PACK_VERSION, layout_attrs(info.dtype, info.shape), 1, identity=identity)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        return [(compute_dtype(info.dtype), packed_shape(info.dtype, *info.shape))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        return (pack_b(weight),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (self._b,) = buffers
        adopt_pack(self, self._b)

    def _packed_a(self, a: np.ndarray) -> np.ndarray:
        """``a`` in B's compute dtype (a model whose A and B types differ is refused)."""
        a2 = as_compute(a)
        if self._b.ndim == 3 and a2.dtype != np.float32:
            raise InvalidArgument(f"node {self.node.name!r} ({self.op_type}): input A is {a.dtype}, its constant B "
                                  "float32: both inputs must have one type")
        return a2

    def _product(self, a: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        """``a @ B`` in B's compute dtype (float ``a``), a fresh array: from the pack, else from
        ``b`` as given."""
        if self._b is not None:
            if a.ndim == 0:
                raise InvalidArgument(f"node {self.node.name!r}: MatMul input A must not be a scalar")
            return matmul_packed(self._packed_a(a), self._b, self._n)
        return _batched(as_compute(a), as_compute(b))

    def run(self, a, b=None):
        if self._b is None and compute_dtype(a.dtype) is None:  # integer MatMul: numpy's own loop
            return (np.matmul(a, b),)
        y = self._product(a, b)
        if y.dtype != a.dtype:
            y = y.astype(a.dtype)
        return (y,)

    def run_into(self, outs, a, b=None) -> bool:
        """``run`` writing into ``outs[0]`` (the memory planner's arena) with ``np.matmul(out=)``.

        Only where ``run`` is one GEMM whose result already has the output dtype (float32,
        float64), so the bits are ``run``'s; half precision (widened, then cast), integers and
        empty results decline with ``False``.
        """
        y = outs[0]
        if a.ndim == 0 or y.size == 0 or a.dtype != y.dtype or compute_dtype(a.dtype) != a.dtype:
            return False
        if self._b is not None:
            if self._b.ndim == 3 and (a.dtype != np.float32 or not y.flags.c_contiguous):
                return False
            matmul_packed(a, self._b, self._n, out=y)
            return True
        if b is None or b.dtype != a.dtype:
            return False
        np.matmul(a, b, out=y)
        return True


def _batched(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.matmul(a, b)``; batches of equal leading dimensions (attention's heads) as one 3-D
    batch, which :func:`_act.matmul` shares out over onnxpack's threads when it owns them."""
    if a.ndim >= 3 and a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2] and a.dtype == b.dtype and a.size and b.size:
        lead = a.shape[:-2]
        y = _act.matmul(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
        return y.reshape(*lead, *y.shape[-2:])
    return np.matmul(a, b)


def pack_scaled_b(weight: np.ndarray, trans_b: bool, alpha: float) -> np.ndarray:
    """``alpha * B'`` as a C-contiguous (K, N) matrix in the compute dtype (``B' = B.T`` with
    ``trans_b``): the pack of Gemm's and FusedMatMul's constant B.  Never a view of ``weight``
    when scaled."""
    cd = compute_dtype(weight.dtype)
    packed = np.ascontiguousarray(weight.T if trans_b else weight, dtype=cd)
    if alpha != 1.0:
        if np.shares_memory(packed, weight):
            packed = packed.copy()
        packed *= cd.type(alpha)
    return packed


@register("Gemm", since=1)
class Gemm(Kernel):
    """``Y = alpha * A' @ B' + beta * C`` (A' = A or A^T per transA, likewise B').

    Old opsets' ``broadcast`` attribute (opset < 7) needs no handling: numpy broadcasts C either
    way, and a valid model only uses shapes that broadcast.
    """

    op_type = "Gemm"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.0))
        self.beta = float(self.attr("beta", 1.0))
        self.trans_a = int(self.attr("transA", 0))
        self.trans_b = int(self.attr("transB", 0))
        self._b: np.ndarray | None = None  # packed alpha * B' (pack_b)
        self._n = 0  # B's columns (panels pad them)

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != 1 or compute_dtype(info.dtype) is None or len(info.shape) != 2:
            return None
        k, n = info.shape[::-1] if self.trans_b else info.shape
        attrs = struct.pack("<id", self.trans_b, self.alpha) + layout_attrs(info.dtype, (k, n))
        self._n = int(n)
        identity = not self.trans_b and self.alpha == 1.0 and identity_panels(info.dtype, (k, n))
        return PackSpec("gemm", _PACK_VERSION, attrs, 1, identity=identity)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        k, n = info.shape[::-1] if self.trans_b else info.shape
        return [(compute_dtype(info.dtype), packed_shape(info.dtype, k, n))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        return (pack_b(pack_scaled_b(weight, self.trans_b, self.alpha)),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (self._b,) = buffers
        adopt_pack(self, self._b)

    def run(self, a, b=None, c=None):
        out_dtype = a.dtype
        if compute_dtype(a.dtype) is None:  # integer Gemm: exact numpy arithmetic
            y = np.matmul(a.T if self.trans_a else a, b.T if self.trans_b else b)
            if self.alpha != 1.0:
                y = (y * self.alpha).astype(out_dtype)
            if c is not None and self.beta != 0.0:
                y = (y + self.beta * c).astype(out_dtype)
            return (y,)
        a2 = as_compute(a)
        if self.trans_a:
            a2 = a2.T
        if self._b is not None:
            if self._b.ndim == 3 and a2.dtype != np.float32:
                raise InvalidArgument(f"node {self.node.name!r} (Gemm): input A is {a.dtype}, its constant B "
                                      "float32: both inputs must have one type")
            y = matmul_packed(a2, self._b, self._n) if a2.ndim == 2 or self._b.ndim == 3 else a2 @ self._b
        else:
            b2 = as_compute(b)
            y = a2 @ (b2.T if self.trans_b else b2)
            if self.alpha != 1.0:
                y *= y.dtype.type(self.alpha)
        if c is not None and self.beta != 0.0:
            # C broadcasts to (M, N) one way only (numpy would widen Y to C's rank): each of its
            # dims 1 or Y's (compared here: np.broadcast_shapes costs ~4 us, a small model's GEMV).
            if c.ndim > 2 or any(d != 1 and d != e for d, e in zip(c.shape[::-1], y.shape[::-1])):
                raise InvalidArgument(f"node {self.node.name!r} (Gemm): C of shape {list(c.shape)} does not "
                                      f"broadcast to (M, N) = {list(y.shape)}")
            c2 = as_compute(c)
            if self.beta != 1.0:
                c2 = c2 * c2.dtype.type(self.beta)
            y += c2
        if y.dtype != out_dtype:
            y = y.astype(out_dtype)
        return (y,)


_EMPTY1 = np.zeros(0, np.float32)
_EMPTY2 = np.zeros((0, 0), np.float32)


@register_fused("matmul")
class FusedMatMul(MatMul):
    """``MatMul(A, W)`` with the bias Add, activations (GELU, ...) and residual Add after it.

    The epilogue ``post(pre(y + bias) + residual)`` runs in place on the GEMM's fresh output:
    with the JIT one pass over each row while it is in cache (split over the BLAS's threads for
    large outputs), else numpy in-place ufuncs.  ``bias`` comes in float64 and is rounded once to
    the compute dtype; the residual is the node's input 2.
    """

    def __init__(self, node, ctx, *, bias: np.ndarray | None = None, pre=(), residual: bool = False,
                 post=()) -> None:
        super().__init__(node, ctx)
        self.bias = bias
        self._bias_as: dict[tuple[str, int], np.ndarray] = {}  # the bias cast for the output (see _epilogue)
        self.pre = tuple(pre)
        self.post = tuple(post)
        self.residual = residual
        self._fakequant = any(act.kind == "fakequant" for act in (*self.pre, *self.post))

    def run(self, a, b=None, r=None):
        if compute_dtype(a.dtype) not in (None, a.dtype) and (self._b is not None or b is not None):
            # Half precision: the epilogue on the float32 product, one rounding at the end, as
            # onnxruntime computes such a chain (no float16 MatMul, Add or activation kernels on
            # its CPU: it casts to float32 around them and drops the casts between them).
            return (self._epilogue(self._product(a, b), r, a.dtype),)
        (y,) = super().run(a, b)
        return (self._epilogue(y, r, a.dtype),)

    def run_into(self, outs, a, b=None, r=None) -> bool:
        if not super().run_into(outs, a, b):
            return False
        self._epilogue(outs[0], r, a.dtype)
        return True

    def _epilogue(self, y: np.ndarray, r, out_dtype) -> np.ndarray:
        if self.residual and r is None:
            raise InvalidArgument(f"node {self.node.name!r} (MatMul): the fused residual input is missing")
        if self._fakequant and out_dtype != np.float32:
            # A fused Q -> DQ pair has a float32 scale, which QuantizeLinear's x must share.
            raise InvalidArgument(f"node {self.node.name!r} (MatMul): the QuantizeLinear after it takes float32, "
                                  f"got {np.dtype(out_dtype)}")
        yc = y if y.dtype == compute_dtype(y.dtype) else y.astype(compute_dtype(y.dtype) or np.float32)
        n = yc.shape[-1] if yc.ndim else 1
        bias = self.bias
        if bias is not None and (bias.dtype != yc.dtype or bias.shape != (n,)):
            # The bias (kept float64 by the fusion) in the output's dtype and width, made once per
            # dtype and width: a cast per call was a mixed-dtype pass ~10 us in a model.
            key = (yc.dtype.char, n)
            cast = self._bias_as.get(key)
            if cast is None:
                cast = np.broadcast_to(bias, (n,)).astype(yc.dtype)
                cast.setflags(write=False)
                if len(self._bias_as) < 8:
                    self._bias_as[key] = cast
            bias = cast
        res = r if self.residual else None
        if res is not None and res.shape != yc.shape:  # broadcasting residual: numpy's rules
            yc = self._apply(yc, bias, self.pre, None, ())
            yc = yc + as_compute(res).astype(yc.dtype, copy=False)
            yc = self._apply(yc, None, self.post, None, ())
        else:
            yc = self._apply(yc, bias, self.pre, res, self.post)
        return yc if yc.dtype == out_dtype else yc.astype(out_dtype)

    @staticmethod
    def _apply(y, bias, pre, res, post):
        jit = (_act.jit() if y.dtype == np.float32 and y.flags.c_contiguous and y.ndim >= 1 and y.size
               and not _act.numpy_suffices(pre, post) else None)
        if jit is None:
            if bias is not None:
                y += bias
            _act.apply(y, pre)
            if res is not None:
                y += as_compute(res).astype(y.dtype, copy=False)
                _act.apply(y, post)
            return y
        y2 = y.reshape(-1, y.shape[-1])
        codes, params = _act.encode(pre)
        pcodes, pparams = _act.encode(post)
        r2 = _EMPTY2 if res is None else np.ascontiguousarray(res, dtype=np.float32).reshape(y2.shape)
        args = (y2, _EMPTY1 if bias is None else bias, codes, params, r2, pcodes, pparams)
        threads = _act.threads() if y.size >= _act.SPLIT_ELEMENTS else 1
        _act.tuner(("rows_act", y2.shape, codes.shape[0], r2.shape[0] > 0)).run(
            lambda lo, hi: jit.rows_act(*args, lo, hi), y2.shape[0], threads)
        return y


@register_fused("matmul_group")
class MatMulGroup(Kernel):
    """Sibling MatMuls: one activation times several constant weights of one K (a transformer
    layer's query, key and value projections), each with its own bias and activations
    (``members``: one ``(bias, pre, post)`` per weight, as :class:`FusedMatMul` takes them).

    Inputs ``A, B_1 .. B_n``, outputs ``Y_1 .. Y_n``.  Each weight is packed as a MatMul packs it
    (the same pack and key: a model saved before the grouping maps its blobs).  Where all are
    panels and A is float32, the products are one GEMM over the weights' panels side by side
    (:func:`matmul_panels_many`), split once over the threads: three 768-wide projections of 128
    tokens on two threads 2.3 -> 2.0 ms; then each member's epilogue.  Elsewhere each member runs
    as its own FusedMatMul, the same bits either way (every output element is the same sum).
    """

    op_type = "MatMul"

    def __init__(self, node, ctx, *, members, names) -> None:
        super().__init__(node, ctx)
        ins, outs = node.input[:], node.output[:]
        if len(ins) != len(members) + 1 or len(outs) != len(members):
            raise InvalidArgument(f"node {node.name!r}: a MatMul group of {len(members)} takes {len(members) + 1} "
                                  f"inputs and gives {len(members)} outputs, got {len(ins)} and {len(outs)}")
        self.members: list[FusedMatMul] = []
        for (bias, pre, post), name, b, y in zip(members, names, ins[1:], outs):
            sub = NodeProto()
            sub.op_type, sub.name = "MatMul", name
            sub.input.extend([ins[0], b])
            sub.output.append(y)
            self.members.append(FusedMatMul(sub, ctx, bias=bias, pre=pre, post=post))

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        return None if input_index == 0 else self.members[input_index - 1].pack_spec(1, info)

    def expected_packed(self, input_index: int, info: TensorInfo):
        return None if input_index == 0 else self.members[input_index - 1].expected_packed(1, info)

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.members[input_index - 1].prepack(1, weight)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        member = self.members[input_index - 1]
        member.use_prepacked(1, buffers)
        adopt_pack(self, member._b)

    def run(self, a, *bs):
        members = self.members
        if len(bs) != len(members):
            raise InvalidArgument(f"node {self.node.name!r}: {len(members)} weights expected, got {len(bs)}")
        packed = [m._b for m in members]
        k = packed[0].shape[1] if packed[0] is not None and packed[0].ndim == 3 else -1
        if (a.dtype != np.float32 or a.ndim == 0 or a.shape[-1] != k or _sgemm() is None
                or any(w is None or w.ndim != 3 or w.shape[1] != k for w in packed)):
            return tuple(m.run(a, b)[0] for m, b in zip(members, bs))
        lead = a.shape[:-1]
        a2 = a.reshape(-1, k)
        ys = [np.empty((a2.shape[0], m._n), np.float32) for m in members]
        matmul_panels_many(a2, packed, [m._n for m in members], ys)
        return tuple(m._epilogue(y.reshape(*lead, m._n), None, a.dtype) for m, y in zip(members, ys))
