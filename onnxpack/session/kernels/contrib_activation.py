"""onnxruntime's com.microsoft activations: Gelu, BiasGelu, FastGelu, QuickGelu, BiasSplitGelu,
BiasAdd and BiasSoftmax.

All compute in float32 (float64 stays float64) and round once to the input's dtype, as
onnxruntime's CPU kernels do for float16 (they widen to float, compute, narrow).  Gelu,
BiasGelu, FastGelu and QuickGelu run the JIT's activation pass on float32 (the code a MatMul
epilogue runs when they fuse into it); the numpy functions here serve float64 and machines
without numba.  The exact GELU there uses :func:`erf_f32` (float64 inputs use the float64 erf of
``elementwise``).  BiasAdd,
BiasSoftmax and BiasSplitGelu have no CPU kernel in onnxruntime 1.32 (CUDA only); they are
implemented from the op schema so that models optimized for GPU still run here.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, broadcasts_to, register
from onnxpack.session.kernels._erf import erf_f32

logger = logging.getLogger(__name__)

__all__ = ["compute_float", "fast_gelu", "gelu_inplace", "quick_gelu_inplace", "tanh_gelu_inplace"]

_SQRT1_2 = 1.0 / math.sqrt(2.0)
# FastGelu's constants as onnxruntime writes them: sqrt(2/pi) and 0.044715 * sqrt(2/pi).
_FAST_A = 0.7978845608028654
_FAST_B = 0.035677408136300125


def compute_float(x: np.ndarray) -> np.ndarray:
    """``x`` as a new float32 array (float64 stays float64, as a new array).

    The kernels below work in place on the result, so it is always a fresh copy.
    """
    return x.astype(np.float64 if x.dtype == np.float64 else np.float32)


def gelu_inplace(xf: np.ndarray, half_last: bool = False) -> np.ndarray:
    """``xf = 0.5 * xf * (1 + erf(xf / sqrt(2)))`` in place on a fresh float array; with
    ``half_last``, ``(xf * (1 + erf)) * 0.5`` (torch's export order, whose product overflows to
    inf for |x| above half the dtype's maximum, as the op-by-op graph does)."""
    if xf.dtype == np.float64:
        from onnxpack.session.kernels.elementwise import _erf  # float64 erf (scipy or series)

        e = _erf(xf * _SQRT1_2)
    else:
        e = erf_f32(xf * np.float32(_SQRT1_2))
    e += 1
    if half_last:
        xf *= e
        xf *= 0.5
        return xf
    e *= 0.5
    xf *= e
    return xf


def tanh_gelu_inplace(xf: np.ndarray) -> np.ndarray:
    """FastGelu: ``0.5 * x * (1 + tanh(0.7978845608 * x + 0.0356774081 * x**3))`` in place
    (infinities: -inf gives NaN as the formula does, without numpy's warnings)."""
    with np.errstate(over="ignore", invalid="ignore"):
        inner = xf * xf
        inner *= _FAST_B
        inner += _FAST_A
        inner *= xf
        np.tanh(inner, out=inner)
        inner += 1
        inner *= 0.5
        xf *= inner
    return xf


def quick_gelu_inplace(xf: np.ndarray, alpha: float) -> np.ndarray:
    """QuickGelu: ``x / (1 + exp(-alpha * x))`` in place on a fresh float array."""
    with np.errstate(over="ignore", invalid="ignore"):  # exp overflows to inf where sigmoid is 0; -inf: NaN
        s = xf * (-alpha)
        np.exp(s, out=s)
        s += 1
        np.divide(xf, s, out=xf)
    return xf


_GELU = _act.Activation("gelu")
_FAST_GELU = _act.Activation("fastgelu")


def _activate(xf: np.ndarray, act) -> np.ndarray:
    """``act`` in place on the fresh float array ``xf``: the JIT's one pass for float32 (the
    fused MatMul epilogues' code, from the native code cache or numba), else the numpy functions
    above (float64, or without numba)."""
    return _act.apply(xf, (act,))


def _check_bias(kernel: Kernel, x: np.ndarray, bias: np.ndarray, name: str = "bias") -> None:
    if bias.ndim != 1 or x.ndim == 0 or bias.shape[0] != x.shape[-1]:
        raise InvalidArgument(
            f"node {kernel.node.name!r} ({kernel.op_type}): {name} must be 1-D of length "
            f"{x.shape[-1] if x.ndim else '?'}"
            f" (the input's last dimension), got shape {list(bias.shape)}"
        )


def _out(y: np.ndarray, like: np.ndarray) -> np.ndarray:
    return y if y.dtype == like.dtype else y.astype(like.dtype)


@register("Gelu", domain="com.microsoft", since=1)
class MsGelu(Kernel):
    """``0.5 * x * (1 + erf(x / sqrt(2)))`` (exact GELU)."""

    def run(self, x):
        if x.ndim == 0:
            return (self.run(x.reshape(1))[0].reshape(()),)
        return (_out(_activate(compute_float(x), _GELU), x),)


@register("BiasGelu", domain="com.microsoft", since=1)
class BiasGelu(Kernel):
    """Exact GELU of ``A + B`` with a 1-D bias B along A's last axis."""

    def run(self, a, b):
        _check_bias(self, a, b, "B")
        xf = compute_float(a)
        xf += b
        return (_out(_activate(xf, _GELU), a),)


def fast_gelu(kernel: Kernel, x: np.ndarray, bias: np.ndarray | None, out_dtype) -> np.ndarray:
    """FastGelu's result: the tanh-approximated GELU of ``x (+ bias)`` (bias 1-D along the last
    axis; checked for ``kernel``'s errors) in ``out_dtype``.  ``x`` is not modified."""
    if x.ndim == 0:
        return fast_gelu(kernel, x.reshape(1), bias, out_dtype).reshape(())
    xf = compute_float(x)
    if bias is not None:
        _check_bias(kernel, x, bias)
        xf += bias
    y = _activate(xf, _FAST_GELU)
    return y if y.dtype == out_dtype else y.astype(out_dtype)


@register("FastGelu", domain="com.microsoft", since=1)
class FastGelu(Kernel):
    """tanh-approximated GELU of ``X (+ bias)``."""

    def run(self, x, bias=None):
        return (fast_gelu(self, x, bias, x.dtype),)


@register("QuickGelu", domain="com.microsoft", since=1)
class QuickGelu(Kernel):
    """``x * sigmoid(alpha * x)``; alpha defaults to 1.702."""

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.alpha = float(self.attr("alpha", 1.702))

    def run(self, x):
        if x.ndim == 0:
            return (self.run(x.reshape(1))[0].reshape(()),)
        return (_out(_activate(compute_float(x), _act.Activation("quickgelu", self.alpha)), x),)


@register("BiasSplitGelu", domain="com.microsoft", since=1)
class BiasSplitGelu(Kernel):
    """``(X + bias)`` split in halves along the last axis: ``left * gelu(right)``."""

    def run(self, x, bias):
        _check_bias(self, x, bias)
        if x.shape[-1] % 2:
            raise InvalidArgument(
                f"node {self.node.name!r} (BiasSplitGelu): the last dimension must be even, got {x.shape[-1]}"
            )
        xf = compute_float(x)
        xf += bias
        h = x.shape[-1] // 2
        right = gelu_inplace(np.ascontiguousarray(xf[..., h:]))
        right *= xf[..., :h]
        return (_out(right, x),)


@register("BiasAdd", domain="com.microsoft", since=1)
class BiasAdd(Kernel):
    """``X + bias + skip`` (X and skip (N, S, C), bias (C))."""

    def run(self, x, bias, skip):
        _check_bias(self, x, bias)
        if skip.shape != x.shape:
            raise InvalidArgument(
                f"node {self.node.name!r} (BiasAdd): skip must have X's shape {list(x.shape)}, got {list(skip.shape)}"
            )
        xf = compute_float(x)
        xf += bias
        xf += skip
        return (_out(xf, x),)


@register("BiasSoftmax", domain="com.microsoft", since=1)
class BiasSoftmax(Kernel):
    """``softmax(data + bias)`` over the axes from ``axis`` on.

    A bias of the data's rank broadcasts as numpy does.  A bias of lower rank covers the softmax
    axes and either the leading axes (``is_inner_broadcast=1``: it is broadcast over the axes
    just before ``axis``) or the trailing batch axes (``is_inner_broadcast=0``: it is broadcast
    over the leading axes, numpy's own rule).
    """

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attr("axis", 1))
        inner = self.attr("is_inner_broadcast")
        if inner is None:
            raise InvalidArgument(f"node {node.name!r} (BiasSoftmax): attribute is_inner_broadcast is required")
        self.inner = bool(int(inner))

    def run(self, data, bias):
        r = data.ndim
        axis = self.axis + r if self.axis < 0 else self.axis
        if not 0 <= axis < max(r, 1):
            raise InvalidArgument(f"node {self.node.name!r} (BiasSoftmax): axis {self.axis} out of range for rank {r}")
        if bias.ndim < r and self.inner:
            lead = bias.ndim - (r - axis)
            if lead < 0:
                raise InvalidArgument(
                    f"node {self.node.name!r} (BiasSoftmax): bias of shape {list(bias.shape)} does not cover "
                    "the softmax axes"
                )
            bias = bias.reshape(bias.shape[:lead] + (1,) * (axis - lead) + bias.shape[lead:])
        if not broadcasts_to(bias.shape, data.shape):
            raise InvalidArgument(
                f"node {self.node.name!r} (BiasSoftmax): bias of shape {list(bias.shape)} does not broadcast to data "
                f"{list(data.shape)}"
            )
        z = compute_float(data)
        z += bias
        axes = tuple(range(axis, r))
        z -= z.max(axis=axes, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=axes, keepdims=True)
        return (_out(z, data),)
