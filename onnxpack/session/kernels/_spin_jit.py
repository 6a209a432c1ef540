"""numba helpers that let :func:`._act.parallel`'s threads wait for each other without sleeping
(optional; x86-64 only; see :class:`._act._Pool`).

Imported lazily by the pool when numba is already in the process (the JIT kernels it splits are
numba's) and ``ONNXPACK_DISABLE_JIT`` is not ``1``; without it the pool's threads sleep on locks.

Why: on this project's 2-core VM a thread that sleeps on a futex takes ~15-40 us to run again
(the idle vCPU halts; waking it is an inter-processor interrupt through the hypervisor), and
every split paid two or three such wakes: a 70 us kernel took ~100 us on two threads.  A helper
that keeps polling a counter for a moment after its last task, outside the GIL, starts the next
split's share within a microsecond; the caller likewise polls for the helpers' results.  The
polling is bounded (a few hundred microseconds, then the helper sleeps as before); a session run
with BLAS on several threads stops it (:func:`._act.stop_spinning`: OpenBLAS's own workers poll
then), a run on onnxpack's own threads lets it run out, so back-to-back runs find the helpers awake
and an idle process keeps no core busy past the window.

**GEMM jobs without the GIL** (:func:`serve`, :func:`run_job`).  A helper that returns to Python
to take its share of a split GEMM asks for the GIL while the submitter still holds it (setting up
its own share) and sleeps on it: measured, a helper started its half of a 1024 x 256 x 196 GEMM
35-48 us after the submitter, and the split took 438 us against 376 for the two halves run
free-standing side by side.  So a split GEMM (:func:`._act.matmul`) posts each helper's block as
a *job*: a row of int64 (:data:`JOB_LEN`: the BLAS's ``cblas_sgemm`` address, the block's sizes,
addresses, leading dimensions and batch strides), which a polling helper claims (compare and
swap) and computes by calling the BLAS itself, never touching Python; whichever of the helper and
the submitter claims a job first computes it, so a helper that is asleep or busy costs nothing
but the submitter's time.

**Unit jobs** (:func:`run_units`): a split of one of onnxpack's own JIT kernels without the GIL
either (the float32 GEMM on panels, :func:`._sgemm_jit.panel_unit`; a 1x1 conv's GEMM blocks with
their epilogue, :func:`._conv_jit.gemm_act_unit`; conv_shift's bands, :func:`._conv_jit.shift_unit`).  The caller writes a *unit
table* (the address of the kernel's C entry, compiled by numba's ``cfunc``, the count of units,
then the kernel's arguments) and posts its address to the helpers as a job; the caller and every
helper that claims the job take units from one counter (an atomic add) until none is left, so a
helper that starts late or is descheduled leaves its share to the others instead of being waited
for.  Measured in MiniLM-L3 (32 tokens) on two threads, per call, the GIL-bound split -> units:
the Q/K/V projections 228 -> 169 us, the FFN's two GEMMs 268 -> 202 and 272 -> 203 us (their one
thread's 320 and 300), the attention output's 93 -> 78; the model 4.3-4.4 -> 3.6 ms a run.

Everything here runs without the GIL and touches only the int64 arrays it is given, through
atomic loads and stores (an ordinary load in a loop may be hoisted out of it by LLVM).  A job's
addresses are the caller's arrays, alive until it has seen the job done.

Measured (two threads, one BLAS thread each, ``benchmarks``' environment), one thread -> split
through numpy -> split as jobs: a batch of 16 (64 x 256) @ (256 x 196) 0.87-0.90 -> 0.58-0.61 ->
0.49-0.51 ms; (256 x 64) @ (64 x 3136) 0.77-0.82 -> 0.53-0.58 -> 0.47-0.49; (2048 x 512) @
(512 x 49) 0.98-1.01 -> 0.60-0.62 -> 0.54-0.58; (96 x 96) @ (96 x 2704) 0.36 -> 0.29 -> 0.23.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["wait_sum", "bump", "pauses", "serve", "run_job", "run_units", "claim", "wait_done", "post", "JOB_LEN"]

# A job's row (int64).  Kind GEMM: what :func:`run_job` computes, for b in range(batch):
#   C[b] (m x n, row stride ldc) = A[b] (m x k, lda) @ B[b] (k x n, ldb), float32, row-major,
# A[b] at address a + b * stride_a (bytes), likewise B and C.  Kind UNITS: a unit table's
# items (:func:`run_units`), its address in ``J_TABLE``.
J_TOKEN = 0  # > 0: posted, not yet claimed; claiming negates it
J_DONE = 1  # the token of the last job finished by a helper
J_KIND = 2  # KIND_GEMM or KIND_UNITS
J_FN = 3  # address of an ILP64 cblas_sgemm (enums int32, sizes int64)
J_TABLE = J_FN  # (kind UNITS) address of the unit table
J_BATCH, J_M, J_N, J_K = 4, 5, 6, 7
J_A, J_LDA, J_B, J_LDB, J_C, J_LDC = 8, 9, 10, 11, 12, 13
J_SA, J_SB, J_SC = 14, 15, 16
J_POLLING = 17  # 1 while the helper of this row polls for jobs (in serve)
JOB_LEN = 18
KIND_GEMM, KIND_UNITS = 0, 1

# A unit table (int64, the caller's): the next unit to take, then the address of a C function
# ``void f(int64 *table, int64 unit)`` (a numba ``cfunc``) that computes one unit reading its
# arguments from the table (from ``U_ARGS`` on), and the count of units.  Every thread taking
# part takes units from ``U_NEXT`` (an atomic add) until none is left: a helper that starts late,
# or is descheduled, leaves its units to the others.
U_NEXT, U_FN, U_COUNT = 0, 1, 2
U_ARGS = 3


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


@intrinsic
def _cas(typingctx, arr, i, old, new):
    """``arr[i] = new`` if it holds ``old`` (atomically); returns what it held."""
    sig = types.int64(arr, types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]])
        pair = builder.cmpxchg(ptr, args[2], args[3], "acq_rel", "acquire")
        return builder.extract_value(pair, 0)

    return sig, codegen


@intrinsic
def _load_at(typingctx, addr):
    """The int64 at address ``addr`` (an atomic load)."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def _add_at(typingctx, addr, v):
    """Adds ``v`` to the int64 at address ``addr`` (atomically); returns what it held."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "acq_rel")

    return sig, codegen


@intrinsic
def _call_unit(typingctx, fn, table, unit):
    """Calls ``void fn(int64 *table, int64 unit)`` at address ``fn``."""
    i64 = types.int64
    sig = types.void(i64, i64, i64)

    def codegen(context, builder, signature, args):
        l64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [l64.as_pointer(), l64])
        table = builder.inttoptr(args[1], l64.as_pointer())
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [table, args[2]])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _sgemm(typingctx, fn, m, n, k, a, lda, b, ldb, c, ldc):
    """Calls the ILP64 ``cblas_sgemm`` at address ``fn``: row-major, no transposes, alpha 1,
    beta 0 (the call numpy's matmul makes for C-contiguous float32 operands)."""
    i64 = types.int64
    sig = types.void(i64, i64, i64, i64, i64, i64, i64, i64, i64, i64)

    def codegen(context, builder, signature, args):
        i32, l64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        fp = f32.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, l64, l64, l64, f32, fp, l64, fp, l64, f32, fp, l64])
        f, m_, n_, k_, a_, lda_, b_, ldb_, c_, ldc_ = args
        call = builder.inttoptr(f, fnty.as_pointer())
        builder.call(call, [ir.Constant(i32, 101), ir.Constant(i32, 111), ir.Constant(i32, 111), m_, n_, k_,
                            ir.Constant(f32, 1.0), builder.inttoptr(a_, fp), lda_, builder.inttoptr(b_, fp), ldb_,
                            ir.Constant(f32, 0.0), builder.inttoptr(c_, fp), ldc_])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def run_units(table):
    """Takes units of the unit table at address ``table`` (see :data:`U_ARGS`) and computes them
    until none is left."""
    fn = _load_at(table + 8 * U_FN)
    count = _load_at(table + 8 * U_COUNT)
    while True:
        u = _add_at(table + 8 * U_NEXT, 1)
        if u >= count:
            return
        _call_unit(fn, table, u)


@njit(cache=True, nogil=True)
def run_job(jobs, row):
    """Computes the job in ``jobs[row]`` (see :data:`JOB_LEN`)."""
    base = row * JOB_LEN
    j = jobs.reshape(-1)
    if j[base + J_KIND] == KIND_UNITS:
        run_units(j[base + J_TABLE])
        return
    fn = j[base + J_FN]
    for bi in range(j[base + J_BATCH]):
        _sgemm(fn, j[base + J_M], j[base + J_N], j[base + J_K], j[base + J_A] + bi * j[base + J_SA], j[base + J_LDA],
               j[base + J_B] + bi * j[base + J_SB], j[base + J_LDB], j[base + J_C] + bi * j[base + J_SC],
               j[base + J_LDC])


@njit(cache=True, nogil=True)
def claim(jobs, row, token):
    """Claims job ``token`` in ``jobs[row]``; whether this caller got it (else a helper did)."""
    return _cas(jobs.reshape(-1), row * JOB_LEN + J_TOKEN, token, -token) == token


@njit(cache=True, nogil=True)
def post(jobs, row, token):
    """Publishes ``jobs[row]`` (its other fields written) as job ``token``; returns whether the
    row's helper is polling for jobs now."""
    j = jobs.reshape(-1)
    _store(j, row * JOB_LEN + J_TOKEN, token)
    return _load(j, row * JOB_LEN + J_POLLING) != 0


@njit(cache=True, nogil=True)
def wait_done(jobs, row, token, limit):
    """Polls until the helper that claimed job ``token`` has finished it, at most ``limit``
    pauses; returns whether it has."""
    j = jobs.reshape(-1)
    for _ in range(limit):
        if _load(j, row * JOB_LEN + J_DONE) == token:
            return True
        _pause()
    return _load(j, row * JOB_LEN + J_DONE) == token


@njit(cache=True, nogil=True)
def serve(ctl, old, limit, delay, pub, slot, value, jobs, row):
    """A helper's polling for the next split.  Stores ``pub[slot] = value`` (when ``slot >= 0``:
    its last task's result), then polls until ``ctl[0] != old`` (a task was queued) or ``ctl[1]
    != 0`` (stop), at most ``limit`` pauses, meanwhile computing every GEMM job posted in
    ``jobs[row]`` that it claims first (each one restarts the ``limit``).  After a change it
    pauses ``delay`` more times: the submitter holds the GIL until it enters its own share, and a
    helper asking for the GIL before that would sleep on it.  Returns ``ctl[0]``."""
    j = jobs.reshape(-1)
    base = row * JOB_LEN
    if slot >= 0:
        _store(pub, slot, value)
    _store(j, base + J_POLLING, 1)
    left = limit
    v = old
    while left > 0:
        t = _load(j, base + J_TOKEN)
        if t > 0 and _cas(j, base + J_TOKEN, t, -t) == t:
            run_job(jobs, row)
            _store(j, base + J_DONE, t)
            left = limit
            continue
        v = _load(ctl, 0)
        if v != old:
            _store(j, base + J_POLLING, 0)
            for _ in range(delay):
                _pause()
            return v
        if _load(ctl, 1) != 0:
            break
        _pause()
        left -= 1
    _store(j, base + J_POLLING, 0)
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
