"""One numba specialization per argument types, whatever the arrays' writability
(``kernels._act.one_specialization``): fewer compiles, the same results."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from onnxpack.session.kernels import _act  # noqa: E402


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _scaled_sum(a, b, out):
    for i in range(out.shape[0]):
        out[i] = 2.0 * a[i] + b[i]


def _calls_it(a, b, out):
    _SCALED(a, b, out)
    out[0] += 1.0


_SCALED = None


def _dispatchers():
    """Fresh dispatchers (no specialization yet): one patched, and one calling it from compiled code."""
    global _SCALED
    ns = {"scaled_sum": numba.njit(_scaled_sum)}
    _act.one_specialization(ns)
    _SCALED = ns["scaled_sum"]  # the global _calls_it resolves when it is typed
    ns["calls_it"] = numba.njit(_calls_it)
    _act.one_specialization(ns)
    return ns


def test_writability_combinations_share_a_specialization_and_compute_the_same():
    ns = _dispatchers()
    f = ns["scaled_sum"]
    a, b = np.arange(5, dtype=np.float32), np.linspace(0, 1, 5, dtype=np.float32)
    want = 2 * a + b
    for x, y in ((_readonly(a), b), (a, _readonly(b)), (_readonly(a), _readonly(b)), (a, b), (a, _readonly(b))):
        out = np.zeros(5, np.float32)
        f(x, y, out)
        np.testing.assert_array_equal(out, want)
    # Without the rule numba compiles all four combinations; with it: the first one seen, then
    # both inputs read-only once each has been seen so (the output is never made read-only).
    assert len(f.overloads) == 2
    assert all(sig[2].mutable for sig in f.overloads)
    # Another dtype is another specialization, as before.
    out64 = np.zeros(5)
    f(a.astype(np.float64), b.astype(np.float64), out64)
    np.testing.assert_array_equal(out64, want.astype(np.float64))
    assert len(f.overloads) == 3


def test_a_patched_dispatcher_is_still_callable_from_compiled_code():
    ns = _dispatchers()
    a, b = np.ones(4, np.float32), np.full(4, 3.0, np.float32)
    for x in (a, _readonly(a)):
        out = np.zeros(4, np.float32)
        ns["calls_it"](x, b, out)
        np.testing.assert_array_equal(out, [6.0, 5.0, 5.0, 5.0])


def test_inlined_helpers_and_patched_dispatchers_are_left_as_they_are():
    inline = numba.njit(inline="always")(lambda x: x + 1)
    ns = {"inline": inline}
    _act.one_specialization(ns)
    assert "compile" not in vars(inline)
    ns = _dispatchers()
    patched = vars(ns["scaled_sum"])["compile"]
    _act.one_specialization(ns)  # a second pass (a dispatcher imported into another module)
    assert vars(ns["scaled_sum"])["compile"] is patched


def _add_into(x, y):
    for i in range(y.shape[0]):
        y[i] += x[i]


def test_declared_inputs_compile_read_only_from_the_first_call():
    f = numba.njit(_scaled_sum)
    _act.one_specialization({"f": f}, frozenset({"a", "b"}))
    a, b = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
    out = np.zeros(3, np.float32)
    f(a, b, out)  # writable inputs: compiled read-only all the same
    (sig,) = f.overloads
    assert [t.mutable for t in sig] == [False, False, True]
    f(_readonly(a), b, out)
    f(a, _readonly(b), out)
    assert len(f.overloads) == 1
    np.testing.assert_array_equal(out, 2 * a + b)


def test_a_declared_input_that_is_written_compiles_exact_types_and_still_writes():
    # 'y' named as an input by mistake: numba refuses the read-only signature, the dispatcher
    # falls back to numba's own choice, and the write reaches the caller's array.
    f = numba.njit(_add_into)
    _act.one_specialization({"f": f}, frozenset({"x", "y"}))
    y = np.ones(3, np.float32)
    f(np.arange(3, dtype=np.float32), y)
    np.testing.assert_array_equal(y, [1.0, 2.0, 3.0])
    (sig,) = f.overloads
    assert sig[1].mutable


def test_two_threads_missing_together_register_the_signature_once():
    """Two threads calling a kernel for the first time with the same types (a kernel split over
    onnxpack's threads) both miss numba's C fast path and come to the patched compile together.
    The exact types must be registered once: registered twice they are an ambiguous match, and
    numba sent every later call through the slow path (typeof of each argument and a compile
    lookup at every call: 130 calls a run of YOLOv8n's Winograd kernels)."""
    import threading

    ns = {"scaled_sum": numba.njit(_scaled_sum)}
    _act.one_specialization(ns, frozenset({"a"}))  # ``a`` compiled read-only, called writable
    disp = ns["scaled_sum"]
    patched = disp.compile
    seen: list = []
    both_in = threading.Barrier(2)
    first_calls = [True]

    def spy(sig):
        seen.append(sig)
        if first_calls[0]:
            both_in.wait(timeout=60)  # the two first calls are in compile at the same time
        return patched(sig)

    disp.compile = spy
    a, b = np.arange(8, dtype=np.float32), np.ones(8, np.float32)
    outs = [np.zeros(8, np.float32) for _ in range(2)]
    workers = [threading.Thread(target=disp, args=(a, b, out)) for out in outs]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert len(seen) == 2 and seen[0] == seen[1]
    for out in outs:
        np.testing.assert_array_equal(out, 2 * a + b)
    first_calls[0] = False
    seen.clear()
    out = np.zeros(8, np.float32)
    for _ in range(5):
        disp(a, b, out)
    assert seen == []  # numba's fast path serves every later call
    np.testing.assert_array_equal(out, 2 * a + b)
