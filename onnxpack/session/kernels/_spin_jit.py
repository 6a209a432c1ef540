"""numba helpers that let :func:`._act.parallel`'s threads wait for each other without sleeping
(optional; x86-64 only; see :class:`._act._Pool`).

Imported lazily by the pool when numba is already in the process (the JIT kernels it splits are
numba's) and ``ONNXPACK_DISABLE_JIT`` is not ``1``; without it the pool's threads sleep on locks.

Why: on this project's 2-core VM a thread that sleeps on a futex takes ~15-40 us to run again
(the idle vCPU halts; waking it is an inter-processor interrupt through the hypervisor), and
every split paid two or three such wakes: a 70 us kernel took ~100 us on two threads.  A helper
that keeps polling a counter for a moment after its last task, outside the GIL, starts the next
split's share within a microsecond; the caller likewise polls for the helpers' results.  The
polling is bounded (a few hundred microseconds, then the helper sleeps as before) and a session
run stops it when it returns (:func:`._act.stop_spinning`), so no core is kept busy between runs.

Everything here runs without the GIL and touches only the int64 arrays it is given, through
atomic loads and stores (an ordinary load in a loop may be hoisted out of it by LLVM).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["wait_change", "wait_sum", "bump", "pauses"]


@intrinsic
def _load(typingctx, arr, i):
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def _store(typingctx, arr, i, v):
    sig = types.void(arr, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]])
        builder.store_atomic(args[2], ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _pause(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def wait_change(ctl, old, limit, delay, pub, slot, value):
    """Stores ``pub[slot] = value`` (when ``slot >= 0``), then polls until ``ctl[0] != old`` (a
    split was submitted) or ``ctl[1] != 0`` (stop), at most ``limit`` pauses.  After a change it
    pauses ``delay`` more times: the submitter holds the GIL until it enters its own share, and a
    helper asking for the GIL before that would sleep on it.  Returns ``ctl[0]``."""
    if slot >= 0:
        _store(pub, slot, value)
    for _ in range(limit):
        v = _load(ctl, 0)
        if v != old:
            for _ in range(delay):
                _pause()
            return v
        if _load(ctl, 1) != 0:
            return v
        _pause()
    return _load(ctl, 0)


@njit(cache=True, nogil=True)
def wait_sum(flags, want, limit):
    """Polls until the entries of ``flags`` sum to ``want`` or more, at most ``limit`` pauses;
    returns whether they do."""
    for _ in range(limit):
        total = 0
        for i in range(flags.shape[0]):
            total += _load(flags, i)
        if total >= want:
            return True
        _pause()
    total = 0
    for i in range(flags.shape[0]):
        total += _load(flags, i)
    return total >= want


@njit(cache=True, nogil=True)
def bump(ctl):
    """``ctl[1] = 0`` (polling allowed), then ``ctl[0] += 1`` (release: the queued task is seen)."""
    _store(ctl, 1, 0)
    _store(ctl, 0, _load(ctl, 0) + 1)


@njit(cache=True, nogil=True)
def pauses(n):
    """``n`` pauses (to calibrate their length)."""
    for _ in range(n):
        _pause()
    return n
