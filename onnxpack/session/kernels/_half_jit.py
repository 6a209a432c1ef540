"""numba kernels converting float16 to and from float32 (optional, the ``jit`` extra).

Imported by :func:`onnxpack.session.kernels._act.astype` on first use, only when numba is
installed and ``ONNXPACK_DISABLE_JIT`` is not ``1``.  numba has no float16 type: the kernels read
and write the half floats' bits (``uint16``) and convert with LLVM's ``fpext`` / ``fptrunc``,
which a vectorized loop turns into ``vcvtph2ps`` / ``vcvtps2ph`` on x86 (F16C).  The same IEEE
conversions as numpy's (round half to even, overflow to infinity): the bits are equal but for
NaN payloads (the hardware quiets a signaling NaN; NaN stays NaN; tests compare them).  Why: numpy converts half floats in scalar C, ~1.2 ns an element to float32
and 2-34 ns from it (the overflowing values slowest); these loops ~0.03 ns.  A float16 model's
every kernel widens its inputs and rounds its outputs: a 1x1 convolution of 32 x 56 x 56 half
floats spent 0.6 of its 0.66 ms converting.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["h2f", "f2h"]


@intrinsic
def _half_to_float(typingctx, bits):
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _float_to_half(typingctx, value):
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit(cache=True, nogil=True)
def h2f(src, dst):  # pragma: no cover - compiled; tested through _act.astype
    """``dst[i] = float32(half(src[i]))``: ``src`` the half floats' bits (uint16), flat."""
    for i in range(src.shape[0]):
        dst[i] = _half_to_float(src[i])


@njit(cache=True, nogil=True)
def f2h(src, dst):  # pragma: no cover - compiled; tested through _act.astype
    """``dst[i] = bits(half(src[i]))``: float32 to half floats, rounded to nearest even."""
    for i in range(src.shape[0]):
        dst[i] = _float_to_half(src[i])


from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"src"}))
