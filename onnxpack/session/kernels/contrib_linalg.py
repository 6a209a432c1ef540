"""com.microsoft::FusedMatMul: ``alpha * op(A) @ op(B)``, a MatMul with Transposes and a scale
folded in by onnxruntime's optimizer; FusedGemm (Gemm + activation); GemmFastGelu (MatMul +
FastGelu, see :class:`GemmFastGelu`).

``op`` first applies ``transBatch`` (the first axis moves behind the other batch axes, to
position ``rank - 2``: ``(d0, d1, .., d_{r-2}, d_{r-1}) -> (d1, .., d_{r-2}, d0, d_{r-1})``),
then ``trans`` (the last two axes swap), as onnxruntime's MatMul helper does.

A constant 2-D ``B`` is pre-packed as ``alpha * op(B)``, a C-contiguous ``(K, N)`` matrix in
the BLAS compute dtype, exactly as Gemm packs (``linalg``'s helpers; ``transB`` and ``alpha``
are in ``PackSpec.attrs`` since they change the packed bytes); for a 2-D ``B`` transBatchB is
the identity permutation.
"""

from __future__ import annotations

import logging
import struct

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, register
from onnxpack.session.kernels.contrib_activation import fast_gelu
from onnxpack.session.kernels.linalg import (Gemm, MatMul, adopt_pack, as_compute, compute_dtype, identity_panels,
                                             layout_attrs, matmul_packed, pack_b, pack_scaled_b, packed_shape)

logger = logging.getLogger(__name__)

__all__ = ["FusedMatMul", "GemmFastGelu"]

_PACK_VERSION = 2  # 2: a float32 B of >= 64 columns is panels (linalg.pack_b)


def _op(x: np.ndarray, trans_batch: bool, trans: bool) -> np.ndarray:
    if trans_batch and x.ndim > 2:
        x = x.transpose(list(range(1, x.ndim - 1)) + [0, x.ndim - 1])
    if trans and x.ndim >= 2:
        x = x.swapaxes(-1, -2)
    return x


@register("FusedGemm", domain="com.microsoft", since=1)
class FusedGemm(Gemm):
    """com.microsoft FusedGemm (onnxruntime's extended optimizer: Gemm + an activation, e.g. BERT's
    pooler ``Gemm -> Tanh``): ``act(alpha * A' @ B' + beta * C)`` with ``activation``,
    ``activation_alpha`` and ``activation_beta``; the Gemm is this package's (packed B)."""

    op_type = "FusedGemm"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        from onnxpack.session.kernels.rnn import named_activation

        name = self.attr("activation", "")
        params = (self.attr("activation_alpha"), self.attr("activation_beta"))
        self._act = named_activation(name, params) if name else None

    def run(self, a, b=None, c=None):
        (y,) = super().run(a, b, c)
        if self._act is not None:
            y = np.asarray(self._act(y)).astype(y.dtype, copy=False)
        return (y,)

    def run_into(self, outs, a, b=None, c=None) -> bool:
        return False  # run computes it (the activation reads the Gemm's result)


@register("TransposeMatMul", domain="com.microsoft", since=1)  # its name before 1.8 (backward compatibility)
@register("FusedMatMul", domain="com.microsoft", since=1)
class FusedMatMul(Kernel):
    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.0))
        self.trans_a = bool(int(self.attr("transA", 0)))
        self.trans_b = bool(int(self.attr("transB", 0)))
        self.trans_batch_a = bool(int(self.attr("transBatchA", 0)))
        self.trans_batch_b = bool(int(self.attr("transBatchB", 0)))
        self._b: np.ndarray | None = None  # packed alpha * op(B) (linalg.pack_b)
        self._n = 0  # op(B)'s columns

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != 1 or len(info.shape) != 2 or compute_dtype(info.dtype) is None:
            return None
        k, n = info.shape[::-1] if self.trans_b else info.shape
        self._n = int(n)
        identity = not self.trans_b and self.alpha == 1.0 and identity_panels(info.dtype, (k, n))
        attrs = struct.pack("<id", self.trans_b, self.alpha) + layout_attrs(info.dtype, (k, n))
        return PackSpec("fused_matmul", _PACK_VERSION, attrs, 1, identity=identity)

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

    def run(self, a, b=None):
        if compute_dtype(a.dtype) is None:
            raise InvalidArgument(f"node {self.node.name!r} (FusedMatMul): unsupported input dtype {a.dtype}")
        if a.ndim == 0 or (b is not None and b.ndim == 0):
            raise InvalidArgument(f"node {self.node.name!r} (FusedMatMul): inputs must not be scalars")
        a2 = as_compute(_op(a, self.trans_batch_a, self.trans_a))
        try:
            if self._b is not None:
                if self._b.ndim == 3 and a2.dtype != np.float32:
                    raise ValueError(f"A is {a.dtype}, the constant B float32")
                y = matmul_packed(a2, self._b, self._n)
            else:
                y = np.matmul(a2, as_compute(_op(b, self.trans_batch_b, self.trans_b)))
                if self.alpha != 1.0:
                    y *= y.dtype.type(self.alpha)
        except ValueError as exc:
            raise InvalidArgument(
                f"node {self.node.name!r} (FusedMatMul): shapes {list(a.shape)} and "
                f"{list(b.shape) if b is not None else [self._b.shape[-2], self._n]} do not multiply ({exc})"
            ) from None
        return (y if y.dtype == a.dtype else y.astype(a.dtype),)


@register("GemmFastGelu", domain="com.microsoft", since=1)
class GemmFastGelu(MatMul):
    """``FastGelu(X @ W + bias)`` (bias optional, 1-D along the last axis): what onnxruntime's
    transformer optimizer writes for a MatMul followed by FastGelu with
    ``FusionOptions.enable_gemm_fast_gelu`` (meant for its GPU providers: its CPU provider has no
    kernel for it).  ``W`` is packed as MatMul packs it (same key: the same bytes); the product
    stays in the compute dtype until after the activation, so a float16 model rounds once.
    """

    op_type = "GemmFastGelu"

    def run(self, x, w=None, bias=None):  # type: ignore[override]
        if compute_dtype(x.dtype) is None:
            raise InvalidArgument(f"node {self.node.name!r} (GemmFastGelu): unsupported input dtype {x.dtype}")
        if x.ndim == 0 or (w is not None and w.ndim == 0):
            raise InvalidArgument(f"node {self.node.name!r} (GemmFastGelu): inputs must not be scalars")
        try:
            y = self._product(x, w)
        except ValueError as exc:
            raise InvalidArgument(
                f"node {self.node.name!r} (GemmFastGelu): shapes {list(x.shape)} and "
                f"{list(w.shape) if w is not None else [self._b.shape[-2], self._n]} do not multiply ({exc})"
            ) from None
        return (fast_gelu(self, y, bias, x.dtype),)

    def run_into(self, outs, x, w=None, bias=None) -> bool:
        return False  # run computes it (the activation reads the product)
