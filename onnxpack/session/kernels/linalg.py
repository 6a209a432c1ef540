"""MatMul and Gemm: the kernels where most of a dense model's time goes.

Both hand their work to one BLAS call (``np.matmul``).  numpy has no float16/bfloat16 BLAS (a
float16 ``np.matmul`` runs a scalar loop, ~100x slower than sgemm), so half-precision operands are
widened to float32, multiplied, and the result is cast back to the dtype ONNX says the output has.

Pre-packing (constant right-hand operand ``B``):

* The packed buffer is ``B`` (transposes resolved) as a C-contiguous ``(K, N)`` float32
  (float64 stays float64) matrix, used as ``A @ packed``.  Measured on the dev machine (OpenBLAS
  0.3.31 SkylakeX kernels, A 64x1024, B 1024x4096): C-contiguous ``(K, N)`` 3.9-4.1 ms on one
  thread and 2.2-2.3 ms on two, ``(N, K)`` read as ``B^T`` 4.6 ms / 3.0 ms; for one row (gemv)
  both are equal.
* Gemm folds ``transB`` and ``alpha`` into that buffer, so the call does no extra scaling pass;
  both are in ``PackSpec.attrs`` because they change the packed bytes.  ``C`` stays unpacked: the
  bias is small and is added in place.
"""

from __future__ import annotations

import logging
import struct

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, register, register_fused

logger = logging.getLogger(__name__)

__all__ = ["MatMul", "Gemm", "FusedMatMul"]

# Version of the packed layout written by this module; bump when the layout changes so saved
# blobs of an older layout are ignored (their key no longer matches).
_PACK_VERSION = 2

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
    return x.astype(cd)


def matmul_packed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for an N-D ``a`` and a 2-D packed ``b`` (K, N), as one BLAS call.

    Flattening the leading dimensions of ``a`` turns numpy's per-batch GEMM loop into a single
    large GEMM (much faster for a (batch, seq, K) activation).
    """
    if a.ndim <= 1:
        return a @ b
    if a.ndim == 2:
        return _act.matmul(a, b)
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])
    return _act.matmul(a2, b).reshape(*lead, b.shape[1])


@register("MatMul", since=1)
class MatMul(Kernel):
    """``Y = A @ B`` with numpy's broadcasting rules (ONNX MatMul follows ``numpy.matmul``)."""

    op_type = "MatMul"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._b: np.ndarray | None = None  # packed B (K, N)

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != 1 or len(info.shape) != 2 or compute_dtype(info.dtype) is None:
            return None
        identity = compute_dtype(info.dtype) == np.dtype(info.dtype)
        return PackSpec("matmul", _PACK_VERSION, b"", 1, identity=identity)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        return [(compute_dtype(info.dtype), tuple(info.shape))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.ascontiguousarray(weight, dtype=compute_dtype(weight.dtype)),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (self._b,) = buffers

    def run(self, a, b=None):
        out_dtype = a.dtype
        if self._b is not None:
            if a.ndim == 0:
                raise InvalidArgument(f"node {self.node.name!r}: MatMul input A must not be a scalar")
            y = matmul_packed(as_compute(a), self._b)
        else:
            if compute_dtype(a.dtype) is None:  # integer MatMul: numpy's own loop
                return (np.matmul(a, b),)
            y = np.matmul(as_compute(a), as_compute(b))
        if y.dtype != out_dtype:
            y = y.astype(out_dtype)
        return (y,)

    def run_into(self, outs, a, b=None) -> bool:
        """``run`` writing into ``outs[0]`` (the memory planner's arena) with ``np.matmul(out=)``.

        Only where ``run`` is one BLAS call whose result already has the output dtype (float32,
        float64), so the bits are ``run``'s; half precision (widened, then cast), integers and
        empty results decline with ``False``.
        """
        y = outs[0]
        if a.ndim == 0 or y.size == 0 or a.dtype != y.dtype or compute_dtype(a.dtype) != a.dtype:
            return False
        if self._b is not None:
            if a.ndim == 2:
                _act.matmul(a, self._b, out=y)
            elif a.ndim < 2:
                np.matmul(a, self._b, out=y)
            else:  # matmul_packed's single flattened GEMM
                _act.matmul(a.reshape(-1, a.shape[-1]), self._b, out=y.reshape(-1, y.shape[-1]))
            return True
        if b is None or b.dtype != a.dtype:
            return False
        np.matmul(a, b, out=y)
        return True


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
        self._b: np.ndarray | None = None  # packed alpha * B' (K, N)

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != 1 or compute_dtype(info.dtype) is None or len(info.shape) != 2:
            return None
        attrs = struct.pack("<id", self.trans_b, self.alpha)
        identity = not self.trans_b and self.alpha == 1.0 and compute_dtype(info.dtype) == np.dtype(info.dtype)
        return PackSpec("gemm", _PACK_VERSION, attrs, 1, identity=identity)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        k, n = info.shape[::-1] if self.trans_b else info.shape
        return [(compute_dtype(info.dtype), (k, n))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        return (pack_scaled_b(weight, self.trans_b, self.alpha),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (self._b,) = buffers

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
            y = _act.matmul(a2, self._b) if a2.ndim == 2 else a2 @ self._b
        else:
            b2 = as_compute(b)
            y = a2 @ (b2.T if self.trans_b else b2)
            if self.alpha != 1.0:
                y *= y.dtype.type(self.alpha)
        if c is not None and self.beta != 0.0:
            c2 = as_compute(c)
            if self.beta != 1.0:
                c2 = c2 * c2.dtype.type(self.beta)
            if np.broadcast_shapes(y.shape, c2.shape) == y.shape:
                y += c2
            else:
                y = y + c2
        if y.dtype != out_dtype:
            y = y.astype(out_dtype)
        return (y,)


# Rows of a fused MatMul's output below which its epilogue runs on one thread.
_PARALLEL_ELEMENTS = 1 << 16
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
        self.pre = tuple(pre)
        self.post = tuple(post)
        self.residual = residual
        self._fakequant = any(act.kind == "fakequant" for act in (*self.pre, *self.post))

    def run(self, a, b=None, r=None):
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
        bias = None if self.bias is None else np.broadcast_to(self.bias, (n,)).astype(yc.dtype)
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
        threads = _act.threads() if y.size >= _PARALLEL_ELEMENTS else 1
        _act.parallel(lambda lo, hi: jit.rows_act(*args, lo, hi), y2.shape[0], threads)
        return y
