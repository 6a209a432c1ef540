"""Concurrent ``run`` on one session: 8 threads x N runs give exactly the serial results.

Each thread feeds its own inputs (so values leaking between concurrent frames would show up as
wrong numbers, not hide behind identical feeds), and results are compared bit for bit with a
serial pass over the same feeds on the same session: numpy is deterministic for a given shape
and the threads share nothing mutable.  Models cover plain kernels with packed weights (mlp,
transformer, cnn), control flow with outer-scope lookups (subgraphs) and an onnx.reference
fallback node; with and without the activation memory planner.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
import onnxpack_sample_models as sample_models  # models/build.py, via tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
THREADS = 8
RUNS_PER_THREAD = 6


def _feeds(name: str, model: onnx.ModelProto, k: int) -> dict[str, np.ndarray]:
    feeds = sample_models.sample_inputs(name, model)
    rng = np.random.default_rng(1000 + k)
    out = {}
    for key, v in feeds.items():
        if v.dtype.kind == "f":
            out[key] = rng.standard_normal(v.shape).astype(v.dtype)
        elif v.dtype == bool:
            out[key] = np.array(bool(k % 2))
        else:
            out[key] = np.array(k % 4, dtype=v.dtype)  # Loop trip counts 0..3
    return out


def _fallback_model() -> bytes:
    """MatMul (native, packed) -> Det (onnx.reference fallback) per batch item."""
    w = np.random.default_rng(5).standard_normal((4, 4)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Det", ["h"], ["y"], name="det")],
        "fb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [onnx.numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m.SerializeToString()


def _cases():
    cases = []
    for name in ("mlp", "transformer", "cnn", "subgraphs"):
        cases.append(pytest.param(name, id=name))
    cases.append(pytest.param("fallback", id="fallback"))
    return cases


def _session_and_feeds(name: str, planner: str):
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("onnxpack.memory_planner", planner)
    # The same bits in every run: without it a conv's timed path choice may be timed again after
    # the serial pass's first runs and change their last bits (cnn: ~3e-8).
    so.use_deterministic_compute = True
    if name == "fallback":
        data = _fallback_model()
        feeds = [{"x": np.random.default_rng(k).standard_normal((3, 4, 4)).astype(np.float32)}
                 for k in range(THREADS * RUNS_PER_THREAD)]
        return onnxpack.InferenceSession(data, so), feeds
    path = MODELS / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} not built")
    model = onnx.load(str(path), load_external_data=False)
    feeds = [_feeds(name, model, k) for k in range(THREADS * RUNS_PER_THREAD)]
    return onnxpack.InferenceSession(str(path), so), feeds


@pytest.mark.parametrize("planner", ["none", "greedy_by_size"])
@pytest.mark.parametrize("name", _cases())
def test_concurrent_runs_equal_serial(name, planner):
    sess, feeds = _session_and_feeds(name, planner)
    with sess:
        serial = [sess.run(None, f) for f in feeds]
        start = threading.Barrier(THREADS)

        def worker(t: int):
            start.wait()  # all threads hammer the session at once
            return [(k, sess.run(None, feeds[k])) for k in range(t, len(feeds), THREADS)]

        with ThreadPoolExecutor(THREADS) as pool:
            results = [r for chunk in pool.map(worker, range(THREADS)) for r in chunk]
    assert len(results) == len(feeds)
    for k, outs in results:
        for a, b in zip(outs, serial[k]):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, k)
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: run {k} differs from serial")
    # The feeds really differ, so equality above is not trivially true.
    assert not np.array_equal(serial[0][0], serial[1][0])


def test_outputs_of_concurrent_runs_are_independent():
    """Mutating one run's output must not change another run's (no shared output buffers)."""
    sess = onnxpack.InferenceSession(str(MODELS / "mlp.onnx"))
    x = np.ones((4, 64), np.float32)
    first = sess.run(None, {"x": x})[0]
    keep = first.copy()
    second = sess.run(None, {"x": x})[0]
    second[:] = 0
    np.testing.assert_array_equal(first, keep)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], keep)


# -- SplitTuner: whether a kernel's split over threads pays, from its own calls ----------------------
def _covered(calls: list, count: int) -> bool:
    """Every item of [0, count) computed exactly once by the recorded (start, stop) calls."""
    seen = np.zeros(count, np.int64)
    for a, b in calls:
        seen[a:b] += 1
    return bool(np.all(seen == 1))


# -- parallel: the pool under the split kernels ------------------------------------------------------
@pytest.mark.parametrize("count,threads", [(1, 2), (2, 2), (7, 2), (1000, 2), (33, 3), (5, 8)])
def test_parallel_computes_every_item_once(count, threads):
    """Every item of [0, count) once, whatever the chunking and the helpers' timing; the calls are
    made on more than one thread when there are chunks for two (the caller is not the only one
    working) — checked over repeated calls, since the caller may legitimately take every chunk."""
    from onnxpack.session.kernels import _act

    idents: set[int] = set()
    for _ in range(20):
        calls: list = []
        lock = threading.Lock()

        def fn(a, b):
            time.sleep(0.0005)  # releases the GIL: a helper gets chunks
            with lock:
                calls.append((a, b))
                idents.add(threading.get_ident())

        _act.parallel(fn, count, threads)
        assert _covered(calls, count)
    assert len(idents) > 1 or min(count, threads) == 1


def test_parallel_from_concurrent_callers_and_errors():
    """Four threads calling parallel at once each get their own items computed once; an exception in
    a chunk reaches the caller (after the other chunks finished), and the pool still works after it."""
    from onnxpack.session.kernels import _act

    results: dict[int, list] = {}
    errors: list = []

    def caller(key):
        try:
            for _ in range(10):
                out = np.zeros(257, np.int64)

                def fn(a, b):
                    out[a:b] += 1

                _act.parallel(fn, out.size, 2)
                results.setdefault(key, []).append(bool(np.all(out == 1)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and all(all(v) and len(v) == 10 for v in results.values()) and len(results) == 4

    def boom(a, b):
        if a == 0:
            raise ValueError("chunk 0 failed")

    with pytest.raises(ValueError, match="chunk 0 failed"):
        _act.parallel(boom, 100, 2)
    out = np.zeros(100, np.int64)
    _act.parallel(lambda a, b: out.__setitem__(slice(a, b), out[a:b] + 1), 100, 2)
    assert np.all(out == 1)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_parallel_in_a_forked_child():
    """A child forked after the pool started has none of its threads: parallel makes new ones there
    (the work is shared again, not left to the caller) and computes every item once, without
    waiting for a helper that does not exist."""
    import os

    from onnxpack.session.kernels import _act

    _act.parallel(lambda a, b: None, 10, 2)  # the pool exists in the parent
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            out = np.zeros(64, np.int64)
            idents = set()

            def fn(a, b):
                time.sleep(0.0005)
                out[a:b] += 1
                idents.add(threading.get_ident())

            calls = 0
            # Until a helper has taken a chunk (at most 100 calls: on a loaded 2-core machine the
            # new helper thread may not be scheduled within one call's few milliseconds).
            while calls < 5 or (len(idents) < 2 and calls < 100):
                _act.parallel(fn, out.size, 2)
                calls += 1
            os.write(w, b"ok" if np.all(out == calls) and len(idents) > 1 else b"bad")
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    got = os.read(r, 16)
    os.close(r)
    assert got == b"ok" and status == 0


def _polling_pool():
    """The pool with its helpers polling between splits (numba loaded, x86-64), or a skip."""
    import platform

    from onnxpack.session.kernels import _act

    pytest.importorskip("numba")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the helpers poll on x86-64 only")
    pool = _act._Pool.get()
    if pool.spinner() is None:
        pytest.skip("the JIT is disabled")
    return pool


def test_parallel_with_polling_helpers_computes_every_item_once_and_reports_errors():
    """The polling hand-off (helpers publish their counts outside the GIL, the caller polls for
    them): every item once over many back-to-back splits of short chunks, from two callers at
    once, and a helper's exception reaches its caller."""
    from onnxpack.session.kernels import _act

    _polling_pool()
    errors: list = []

    def caller():
        try:
            for count in (2, 3, 17, 100, 1000) * 20:
                out = np.zeros(count, np.int64)

                def fn(a, b):
                    out[a:b] += 1

                _act.parallel(fn, count, 2)
                assert np.all(out == 1), count
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    seen = []
    for _ in range(5):  # (a shared machine may not run the helper within a 4 ms split: try again)
        idents = set()

        def boom(a, b):
            time.sleep(0.001)
            idents.add(threading.get_ident())
            if a >= 50:
                raise ValueError("late chunk failed")

        with pytest.raises(ValueError, match="late chunk failed"):
            _act.parallel(boom, 100, 2)
        seen.append(len(idents))
        if len(idents) == 2:
            break
    assert 2 in seen, seen  # the failing chunks ran on both threads' shares


def test_stop_spinning_stops_the_polling_helpers():
    """A helper told to poll for a long time keeps a core busy until stop_spinning (what every
    session run calls when it returns); then the process uses no CPU while it sleeps."""
    from onnxpack.session.kernels import _act

    pool = _polling_pool()
    saved = pool.limit
    pool.limit = 10**12  # poll "forever"
    seen = []
    try:
        for _ in range(3):  # (a shared machine may not run the helper in some window)
            _act.parallel(lambda a, b: time.sleep(0.001), 4, 2)
            c0 = time.process_time()
            time.sleep(0.1)
            busy = time.process_time() - c0
            _act.stop_spinning()
            time.sleep(0.01)
            c0 = time.process_time()
            time.sleep(0.1)
            idle = time.process_time() - c0
            seen.append((busy, idle))
            if busy > 0.01 and idle < 0.02:
                break
    finally:
        pool.limit = saved
        _act.stop_spinning()
    # (busy: a tenth of the window at least — the suite's JIT primer may hold the other core)
    assert any(busy > 0.01 for busy, _ in seen) and all(idle < 0.02 for _, idle in seen), seen


def test_a_polling_helper_that_fails_to_load_means_sleeping_helpers(monkeypatch):
    """If the polling entries cannot run here (a compile failure), the pool's helpers sleep on the
    queue as without numba: no error reaches a split."""
    import types

    from onnxpack.session.kernels import _act

    def broken(*a):
        raise RuntimeError("no such intrinsic")

    fake = types.SimpleNamespace(serve=broken, post=broken, claim=broken, wait_done=broken, run_job=broken,
                                 wait_sum=broken, bump=broken, pauses=broken, JOB_LEN=17)
    pool = _act._Pool(1)
    monkeypatch.setattr(_act, "load_jit", lambda name, what, on_load=None: fake)
    monkeypatch.setattr(_act._Pool, "get", classmethod(lambda cls: pool))
    import sys

    monkeypatch.setitem(sys.modules, "numba", sys.modules.get("numba", types.ModuleType("numba")))
    assert pool.spinner() is None
    out = np.zeros(100, np.int64)
    _act.parallel(lambda a, b: out.__setitem__(slice(a, b), out[a:b] + 1), 100, 2)
    assert np.all(out == 1)


def test_a_session_run_stops_the_polling(monkeypatch):
    from onnxpack.session import _runner

    calls = []
    monkeypatch.setattr(_runner, "stop_spinning", lambda: calls.append(1))
    so = onnxpack.SessionOptions()
    so.intra_op_num_threads = 1  # (one thread: the polling stops after every run, a failed one too)
    with onnxpack.InferenceSession(str(MODELS / "mlp.onnx"), so) as sess:
        x = np.zeros([d if isinstance(d, int) else 1 for d in sess.get_inputs()[0].shape], np.float32)
        sess.run(None, {sess.get_inputs()[0].name: x})
        with pytest.raises(Exception):
            sess.run(None, {sess.get_inputs()[0].name: x.astype(np.int32)})
    assert len(calls) >= 1


@pytest.mark.parametrize("mode", ["blas", "owned"])
def test_only_runs_with_blas_on_several_threads_stop_the_polling(mode, monkeypatch):
    """Two threads: a BLAS-mode run stops the helpers' polling before and after it (OpenBLAS's
    workers poll the other core then); an owned-mode run leaves them polling out their window, so
    the next run's first split finds them awake, and they sleep after it (the process idle)."""
    from onnxpack.session import _runner
    from onnxpack.session.kernels import _act

    calls = []
    real = _runner.stop_spinning
    monkeypatch.setattr(_runner, "stop_spinning", lambda: (calls.append(1), real()))
    _three_runs_on_two_threads(mode)
    assert len(calls) == (6 if mode == "blas" else 0)
    pool = _act._Pool._instance
    if mode == "owned" and pool is not None and pool.spinner() is not None:
        # (the window is SPIN_US = 250 us: long past after 0.2 s)
        time.sleep(0.2)
        c0 = time.process_time()
        time.sleep(0.1)
        assert time.process_time() - c0 < 0.02


@pytest.mark.parametrize("cost,want_split", [("per-call", False), ("per-item", True)])
def test_split_tuner_keeps_the_faster_way(cost, want_split):
    """A kernel whose cost is per call (each chunk pays a fixed 4 ms, as a thread hand-off does
    on a slow VM) ends on one thread; one whose cost is per item (2 ms each, the GIL released as
    a JIT kernel releases it) ends split.  Every call computes every item exactly once, whichever
    way it runs."""
    from onnxpack.session.kernels import _act

    lock = threading.Lock()
    calls: list = []

    def fn(a, b):
        time.sleep(0.004 if cost == "per-call" else 0.002 * (b - a))
        with lock:
            calls.append((a, b))

    tuner = _act.SplitTuner()
    count = 8
    for _ in range(1 + 2 * _act.SplitTuner.TRIALS):  # the uncounted first call, then both ways
        calls.clear()
        tuner.run(fn, count, 2)
        assert _covered(calls, count)
    assert tuner.choice is want_split
    calls.clear()
    tuner.run(fn, count, 2)
    assert _covered(calls, count) and (len(calls) > 1) is want_split
    # A new thread count is measured again; one thread never splits.
    tuner.run(fn, count, 3)
    assert tuner.choice is None and tuner.threads == 3
    calls.clear()
    tuner.run(fn, count, 1)
    assert calls == [(0, count)]


def test_split_tuner_measures_again_and_follows_a_change(monkeypatch):
    """A choice made while splitting was slow (the other core busy, say) is measured again every
    RECHECK calls, and the tuner follows when the costs have changed; calls made inside a
    session's first run (first_run) are never samples."""
    from onnxpack.session.kernels import _act

    monkeypatch.setattr(_act.SplitTuner, "RECHECK", 10)
    slow_split = [True]

    def fn(a, b):
        # per call 2 ms while "slow_split" (a split pays twice); else 2 ms per item (halved split)
        time.sleep(0.002 if slow_split[0] else 0.001 * (b - a))

    tuner = _act.SplitTuner()
    with _act.first_run():
        for _ in range(10):
            tuner.run(fn, 4, 2)
    assert tuner.one == [] and tuner.split == [] and tuner.choice is None
    for _ in range(2 * _act.SplitTuner.TRIALS):  # (the uncounted first call was in the first run)
        tuner.run(fn, 4, 2)
    assert tuner.choice is False
    slow_split[0] = False
    for _ in range(_act.SplitTuner.RECHECK - 1):
        tuner.run(fn, 4, 2)
    assert tuner.choice is False  # not yet measured again
    tuner.run(fn, 4, 2)
    assert tuner.choice is None
    for _ in range(2 * _act.SplitTuner.TRIALS):
        tuner.run(fn, 4, 2)
    assert tuner.choice is True


def test_owned_mode_split_samples_wait_while_blas_workers_may_be_polling(monkeypatch):
    """After a run with BLAS on several threads its workers poll a core for ~0.1 s: a split timed
    then in owned mode competes with them, so owned-mode calls take no sample until BLAS_POLL_S
    has passed (they split, as an uncounted call does); BLAS-mode calls sample as before (that
    polling is part of their mode)."""
    from onnxpack.session.kernels import _act

    def fn(a, b):
        time.sleep(0.0005)

    monkeypatch.setattr(_act, "BLAS_POLL_S", 60.0)
    monkeypatch.setattr(_act, "owned", [0])
    monkeypatch.setattr(_act, "_blas_polling", [0.0])
    tuner = _act.SplitTuner()
    _act.blas_run_ended()
    _act.owned[0] = 2
    for _ in range(3 * _act.SplitTuner.TRIALS):
        tuner.run(fn, 4, 2)
    assert tuner.modes[1].one == [] and tuner.modes[1].split == [] and tuner.modes[1].choice is None
    _act._blas_polling[0] = time.perf_counter()  # the workers have stopped
    for _ in range(2 * _act.SplitTuner.TRIALS):
        tuner.run(fn, 4, 2)
    assert tuner.modes[1].choice is not None
    _act.blas_run_ended()
    _act.owned[0] = 0  # BLAS mode
    for _ in range(1 + 2 * _act.SplitTuner.TRIALS):
        tuner.run(fn, 4, 2)
    assert tuner.modes[0].choice is not None


def _three_runs_on_two_threads(mode: str) -> None:
    """Three runs of the conv + GEMM model in a session on two threads fixed in thread ``mode``."""
    so = onnxpack.SessionOptions()
    so.intra_op_num_threads = 2
    so.add_session_config_entry("onnxpack.thread_mode", mode)
    sess = onnxpack.InferenceSession(_conv_gemm_model(), so)
    for _ in range(3):
        sess.run(None, {"x": np.ones((1, 16, 48, 48), np.float32)})


@pytest.mark.parametrize("mode", ["blas", "owned"])
def test_a_run_with_blas_on_several_threads_marks_the_polling_window(mode, monkeypatch):
    """A session run in BLAS mode on two threads marks when OpenBLAS's workers may stop polling
    (_act.blas_run_ended, after the run); an owned-mode run leaves the mark as it was."""
    from onnxpack.session import _runner
    from onnxpack.session.kernels import _act

    stamps = []
    monkeypatch.setattr(_runner, "blas_run_ended", lambda: stamps.append(_act.owned[0]))
    _three_runs_on_two_threads(mode)
    assert stamps == ([0, 0, 0] if mode == "blas" else [])


def test_a_sessions_first_run_takes_no_tuner_sample(monkeypatch):
    """A session's first run is run under _act.first_run (its weights' pages fault in on first
    touch, which made splits look slow): its splits record nothing; the second run's do."""
    from onnxpack.session.kernels import _act

    seen = []
    real = _act.SplitTuner.run

    def spy(self, fn, count, threads, native=None):
        seen.append(_act._first_runs[0])
        return real(self, fn, count, threads, native)

    if _act.jit() is None:
        pytest.skip("numba not installed")
    monkeypatch.setattr(_act.SplitTuner, "run", spy)
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    w = np.random.default_rng(5).standard_normal((32, 1, 3, 3)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=32, pads=[1, 1, 1, 1])  # a depthwise conv that splits
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 96, 96])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(w, "w")])
    sess = onnxpack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
                                     .SerializeToString())
    feeds = {"x": np.ones((1, 32, 96, 96), np.float32)}
    sess.run(None, feeds)
    first = list(seen)
    seen.clear()
    sess.run(None, feeds)
    assert first and all(v >= 1 for v in first), first
    assert seen and all(v == 0 for v in seen), seen


def test_split_conv_equals_one_thread_whichever_the_tuner_picks(monkeypatch):
    """A depthwise conv big enough to split, run through its tuner's trials at two threads:
    every run bit-identical to the one-thread result."""
    from onnxpack.session.kernels import _act

    if _act.jit() is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(5)
    w = rng.standard_normal((32, 1, 3, 3)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=32, pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 96, 96])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    x = rng.standard_normal((1, 32, 96, 96)).astype(np.float32)
    one = onnxpack.SessionOptions()
    one.intra_op_num_threads = 1
    want = onnxpack.InferenceSession(model, one).run(None, {"x": x})[0]
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    sess = onnxpack.InferenceSession(model)
    for _ in range(1 + 2 * _act.SplitTuner.TRIALS + 2):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)
    (plan,) = [p for st in sess.program.root.steps for p in st.kernel._plans.values()]
    assert plan.split is not None and any(m.choice is not None for m in plan.split.modes)  # (the runs' mode)


@pytest.mark.parametrize("stride,batch", [(2, 1), (2, 3), (1, 2)], ids=["s2-stem", "s2-stem-batch3", "s1-direct"])
def test_direct_conv_split_in_one_block_per_thread_equals_one_thread(stride, batch, monkeypatch):
    """An RGB stem (conv3_s2_small at stride 2, conv2d_small at stride 1), whose every call
    first lays out its images' input planes, split over two threads (forced) in one block of
    output planes per thread, not in finer chunks that would each lay them out again: every
    plane computed once, bit for bit the one-thread result, which matches onnxruntime."""
    import onnxruntime as ort

    from onnxpack.session.kernels import _act, conv

    if _act.jit() is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(13)
    m = 10
    w = (rng.standard_normal((m, 3, 3, 3)) * 0.3).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[stride, stride]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["y"])]
    inits = [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b"),
             onnx.numpy_helper.from_array(np.array(0, np.float32), "lo"),
             onnx.numpy_helper.from_array(np.array(6, np.float32), "hi")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 48, 48])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    feeds = {"x": rng.standard_normal((batch, 3, 48, 48)).astype(np.float32)}
    one = onnxpack.SessionOptions()
    one.intra_op_num_threads = 1
    want = onnxpack.InferenceSession(model, one).run(None, feeds)[0]
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    sess = onnxpack.InferenceSession(model)
    sess.run(None, feeds)
    (plan,) = [p for st in sess.program.root.steps if isinstance(st.kernel, conv.Conv)
               for p in st.kernel._plans.values() if isinstance(p, conv._ConvPlan)]
    assert plan.per_image and plan.fn.__name__ == ("conv3_s2_small" if stride == 2 else "conv2d_small")
    plan.big = True
    plan.split.threads, plan.split.choice = 2, True
    calls, idents = [], set()
    real = plan.fn

    def spy(*a):
        idents.add(threading.get_ident())
        calls.append((a[-2], a[-1]))
        time.sleep(0.005)
        return real(*a)

    plan.fn = spy
    # (the split through Python threads: where the helpers poll, the unit job takes the same
    # blocks, see test_plane_kernels_split_as_unit_jobs_equals_one_thread)
    monkeypatch.setattr(conv, "_plane_units", lambda *a: False)
    got = sess.run(None, feeds)[0]
    assert sorted(calls) == [(0, batch * m // 2), (batch * m // 2, batch * m)] and len(idents) == 2, calls
    np.testing.assert_array_equal(got, want)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride,c,m,residual", [(1, 128, 100, True), (2, 128, 64, False), (1, 96, 54, True)],
                         ids=["s1-residual", "s2-phases", "s1-m54"])
def test_conv_shift_over_channel_blocks_equals_one_thread(stride, c, m, residual, monkeypatch):
    """A 3x3 conv on a 7x7 map (conv_shift, one band) with a bias, a folded BatchNormalization,
    a residual Add and Relu, split over blocks of output channels on two threads (forced):
    bit for bit the one-thread result, which matches onnxruntime."""
    import onnxruntime as ort

    from onnxpack.session.kernels import _act, conv

    if _act.jit() is None:
        pytest.skip("numba not installed")
    monkeypatch.setattr(conv, "_BCAST_ON", False)  # (conv_shift's split, not conv_bcast's panels)
    rng = np.random.default_rng(9)
    hw = 7 * stride
    F = TensorProto.FLOAT
    inits = [onnx.numpy_helper.from_array((rng.standard_normal((m, c, 3, 3)) * 0.1).astype(np.float32), "w"),
             onnx.numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b")]
    for name, v in (("s", rng.uniform(0.5, 2, m)), ("bb", rng.standard_normal(m)), ("mu", rng.standard_normal(m)),
                    ("var", rng.uniform(0.5, 2, m))):
        inits.append(onnx.numpy_helper.from_array(v.astype(np.float32), name))
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[stride, stride]),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "mu", "var"], ["n"])]
    inputs = [helper.make_tensor_value_info("x", F, [1, c, hw, hw])]
    last = "n"
    if residual:
        nodes.append(helper.make_node("Add", ["n", "r"], ["a"]))
        inputs.append(helper.make_tensor_value_info("r", F, [1, m, 7, 7]))
        last = "a"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    feeds = {"x": rng.standard_normal((1, c, hw, hw)).astype(np.float32)}
    if residual:
        feeds["r"] = rng.standard_normal((1, m, 7, 7)).astype(np.float32)
    one = onnxpack.SessionOptions()
    one.intra_op_num_threads = 1
    want = onnxpack.InferenceSession(model, one).run(None, feeds)[0]
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    monkeypatch.setattr(conv, "_PARALLEL_MACS", 1)
    calls = []
    real = conv._run_channel_blocks
    monkeypatch.setattr(conv, "_run_channel_blocks", lambda *a: calls.append(1) or real(*a))
    sess = onnxpack.InferenceSession(model)
    sess.run(None, feeds)
    (plan,) = [p for st in sess.program.root.steps if isinstance(st.kernel, conv.Conv)
               for p in st.kernel._plans.values() if isinstance(p, conv._ConvPlan) and p.kind == conv._SHIFT]
    assert plan.count == 1
    plan.split.threads, plan.split.choice = 2, True
    idents = set()
    real_jit = plan.jit
    real_fn = real_jit.conv_shift

    class Spy:
        def __getattr__(self, name):
            return getattr(real_jit, name)

        @staticmethod
        def conv_shift(*a):
            idents.add(threading.get_ident())
            time.sleep(0.005)
            return real_fn(*a)

    plan.jit = Spy()
    got = sess.run(None, feeds)[0]
    assert calls and len(idents) == 2
    np.testing.assert_array_equal(got, want)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def _shift_conv_model(rng, batch: int, c: int, m: int, kernel: tuple, stride: int, residual: bool):
    """A Conv (bias, LeakyRelu; with ``residual`` an Add of a second input and Relu after) that
    conv_shift runs: one group, few channels.  Returns (model bytes, feeds)."""
    F = TensorProto.FLOAT
    hw = (20 * stride, 32 * stride)
    pads = [k // 2 for k in kernel] * 2
    inits = [onnx.numpy_helper.from_array((rng.standard_normal((m, c, *kernel)) * 0.2).astype(np.float32), "w"),
             onnx.numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c0"], pads=pads, strides=[stride, stride]),
             helper.make_node("LeakyRelu", ["c0"], ["y"], alpha=0.2)]
    inputs = [helper.make_tensor_value_info("x", F, [batch, c, *hw])]
    feeds = {"x": rng.standard_normal((batch, c, *hw)).astype(np.float32)}
    if residual:
        nodes += [helper.make_node("Add", ["y", "r"], ["a"]), helper.make_node("Relu", ["a"], ["u"])]
        inputs.append(helper.make_tensor_value_info("r", F, [batch, m, 20, 32]))
        feeds["r"] = rng.standard_normal((batch, m, 20, 32)).astype(np.float32)
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(nodes[-1].output[0], F, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString(), feeds


def _conv_split_forced(model, feeds, kind, rtol, atol, monkeypatch):
    """A one-Conv model's one-thread output (checked against onnxruntime within ``rtol`` /
    ``atol``), and a session on two threads whose conv plan, of path ``kind`` with at least three
    items, is told to split: returns (that session, the one-thread output)."""
    import onnxruntime as ort

    from onnxpack.session.kernels import conv

    one = onnxpack.SessionOptions()
    one.intra_op_num_threads = 1
    want = onnxpack.InferenceSession(model, one).run(None, feeds)[0]
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(want, ref, rtol=rtol, atol=atol)
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    monkeypatch.setattr(conv, "_PARALLEL_MACS", 1)
    sess = onnxpack.InferenceSession(model)
    sess.run(None, feeds)
    (plan,) = [p for st in sess.program.root.steps if isinstance(st.kernel, conv.Conv)
               for p in st.kernel._plans.values() if isinstance(p, conv._ConvPlan)]
    assert plan.kind == kind and plan.count >= 3, (plan.kind, plan.count)
    plan.split.threads, plan.split.choice = 2, True
    return sess, want


@pytest.mark.parametrize("batch,c,m,kernel,stride,residual",
                         [(3, 24, 24, (1, 3), 1, False), (2, 24, 40, (3, 1), 1, True), (1, 16, 30, (3, 3), 1, True),
                          (2, 16, 24, (3, 3), 2, False)],
                         ids=["1x3-batch3", "3x1-residual", "3x3-one-image", "3x3-stride2-phases"])
def test_conv_shift_split_as_unit_jobs_equals_one_thread(batch, c, m, kernel, stride, residual, monkeypatch):
    """conv_shift's bands (several images, a residual, a stride-2 conv over its phases) split over
    two threads (forced) as a unit job, a few bands a unit, no GIL: bit for bit the one-thread
    result (with the helpers polling or asleep), which is onnxruntime's within float32 rounding."""
    from onnxpack.session.kernels import conv

    _polling_pool()
    monkeypatch.setattr(conv, "_BCAST_ON", False)  # (30 channels would be conv_bcast's half panel)
    model, feeds = _shift_conv_model(np.random.default_rng(batch + c + m), batch, c, m, kernel, stride, residual)
    sess, want = _conv_split_forced(model, feeds, conv._SHIFT, 1e-5, 1e-5, monkeypatch)
    units = []
    real = conv._shift_units
    monkeypatch.setattr(conv, "_shift_units", lambda *a: units.append(a[1].count) or real(*a))
    _twenty_as_unit_jobs(monkeypatch, lambda: np.testing.assert_array_equal(sess.run(None, feeds)[0], want))
    assert len(units) == 20


@pytest.mark.parametrize("batch, m, taps, stride, pads", [(1, 257, 512, 160, [0, 0]), (3, 48, 64, 16, [32, 31])])
def test_conv_windows_split_as_unit_jobs_equals_one_thread(batch, m, taps, stride, pads, monkeypatch):
    """A long-kernel conv of one input channel (conv_windows: items of 64 output channels by a
    block of positions) split over two threads (forced) as a unit job: bit for bit the one-thread
    result (the helpers polling or asleep), which is onnxruntime's within float32 rounding."""
    from onnxpack.session.kernels import conv

    _polling_pool()
    F = TensorProto.FLOAT
    rng = np.random.default_rng(m)
    w = (rng.standard_normal((m, 1, taps)) / np.sqrt(taps)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W", "B"], ["y"], strides=[stride], pads=pads)], "g",
        [helper.make_tensor_value_info("x", F, [batch, 1, 2000])], [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    feeds = {"x": rng.standard_normal((batch, 1, 2000)).astype(np.float32)}
    sess, want = _conv_split_forced(model, feeds, conv._WINDOWS, 1e-4, 2e-5, monkeypatch)
    _twenty_as_unit_jobs(monkeypatch, lambda: np.testing.assert_array_equal(sess.run(None, feeds)[0], want))


@pytest.mark.parametrize("batch,c,m,k,stride", [(1, 32, 128, 3, 2), (2, 256, 64, 1, 1)])
def test_conv_bcast_split_as_unit_jobs_equals_one_thread(batch, c, m, k, stride, monkeypatch):
    """A conv packed as conv_bcast's panels (items of 64 output channels by a block of positions)
    split over two threads (forced) as a unit job: bit for bit the one-thread result (the helpers
    polling or asleep), which is onnxruntime's within float32 rounding."""
    from onnxpack.session.kernels import _act, conv

    _polling_pool()
    monkeypatch.setattr(_act, "faster_path", lambda key, first, second, prior=None, confirm=False: (0, None))  # conv_bcast
    F = TensorProto.FLOAT
    rng = np.random.default_rng(m)
    w = (rng.standard_normal((m, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W", "B"], ["y"], strides=[stride, stride], pads=[k // 2] * 4)], "g",
        [helper.make_tensor_value_info("x", F, [batch, c, 28, 26])], [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    feeds = {"x": rng.standard_normal((batch, c, 28, 26)).astype(np.float32)}
    sess, want = _conv_split_forced(model, feeds, conv._BCAST, 1e-4, 2e-5, monkeypatch)
    _twenty_as_unit_jobs(monkeypatch, lambda: np.testing.assert_array_equal(sess.run(None, feeds)[0], want))


@pytest.mark.parametrize("batch,c,m,group,kernel,stride,dilation,pads,unit", [
    (2, 24, 24, 24, 3, 1, 1, [1, 1, 1, 1], "PK_DW3_SAME"),
    (1, 20, 20, 20, 5, 1, 1, [2, 2, 2, 2], "PK_DW5_SAME"),
    (2, 24, 24, 24, 3, 2, 1, [1, 1, 1, 1], "PK_DW3_S2"),
    (1, 20, 20, 20, 5, 2, 1, [2, 2, 2, 2], "PK_DW5_S2"),
    (2, 16, 16, 16, 3, 1, 2, [0, 1, 2, 3], "PK_DW2D"),
    (2, 3, 16, 1, 3, 2, 1, [1, 1, 1, 1], "PK_S2_STEM"),
    (3, 3, 12, 1, 3, 1, 1, [1, 0, 1, 2], "PK_SMALL"),
], ids=["dw3-same", "dw5-same", "dw3-stride2", "dw5-stride2", "dw-general", "rgb-stem-stride2", "rgb-direct"])
def test_plane_kernels_split_as_unit_jobs_equals_one_thread(batch, c, m, group, kernel, stride, dilation, pads, unit,
                                                            monkeypatch):
    """The JIT's plane kernels (every depthwise kernel, the direct kernels of RGB stems) split over
    two threads (forced) as a unit job, a block of planes a unit, no GIL, with a Clip fused:
    bit for bit the one-thread result (with the helpers polling or asleep), which is
    onnxruntime's within float32 rounding."""
    from onnxpack.session.kernels import _act, conv

    _polling_pool()
    F = TensorProto.FLOAT
    rng = np.random.default_rng(c + m + kernel + stride)
    w = (rng.standard_normal((m, c // group, kernel, kernel)) / kernel).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W", "B"], ["t"], group=group, strides=[stride] * 2,
                          dilations=[dilation] * 2, pads=pads),
         helper.make_node("Clip", ["t", "lo", "hi"], ["y"])], "g",
        [helper.make_tensor_value_info("x", F, [batch, c, 20, 18])], [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "B"),
         numpy_helper.from_array(np.float32(-1.0), "lo"), numpy_helper.from_array(np.float32(1.5), "hi")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    feeds = {"x": rng.standard_normal((batch, c, 20, 18)).astype(np.float32)}
    sess, want = _conv_split_forced(model, feeds, conv._DW_JIT if group > 1 else conv._DIRECT, 1e-5, 1e-5, monkeypatch)
    (plan,) = [p for st in sess.program.root.steps for p in st.kernel._plans.values()]
    assert plan.unit == getattr(_act.jit(), unit)
    units = []
    real = conv._plane_units
    monkeypatch.setattr(conv, "_plane_units", lambda *a: units.append(a[1].unit) or real(*a))
    _twenty_as_unit_jobs(monkeypatch, lambda: np.testing.assert_array_equal(sess.run(None, feeds)[0], want))
    assert units == [plan.unit] * 20


def test_conv_shift_unit_job_declines_arrays_it_does_not_read_as_they_are(monkeypatch):
    """The unit table holds addresses and sizes: an argument that is not C-contiguous or not of
    the kernel's dtype is declined (False: the split goes through the GIL-bound path), and the
    same call with the arrays as they are computes conv_shift's bands."""
    from onnxpack.session.kernels import conv

    _polling_pool()
    model, feeds = _shift_conv_model(np.random.default_rng(3), 2, 24, 24, (1, 3), 1, False)
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    seen = []
    real = conv._shift_units
    monkeypatch.setattr(conv, "_PARALLEL_MACS", 1)
    monkeypatch.setattr(conv, "_shift_units", lambda *a: seen.append(a) or real(*a))
    sess = onnxpack.InferenceSession(model)
    sess.run(None, feeds)  # (the plan is made in the first run)
    for st in sess.program.root.steps:
        for plan in st.kernel._plans.values():
            plan.split.threads, plan.split.choice = 2, True
    sess.run(None, feeds)
    args, plan, threads = seen[-1]
    y = args[2]
    want = y.copy()
    bias = args[11]
    strided = np.repeat(bias, 2)[::2]
    assert not strided.flags.c_contiguous
    for bad in (args[:11] + (strided,) + args[12:], args[:11] + (bias.astype(np.float64),) + args[12:],
                args[:3] + (args[3].astype(np.int32),) + args[4:]):
        y[...] = np.nan
        assert real(bad, plan, threads) is False
        assert np.isnan(y).all()
    assert real(args, plan, threads) is True
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("a_shape,b_shape,splits", [((1, 700), (700, 1000), False), ((300, 700), (700, 1), False),
                                                    ((4, 1, 700), (700, 300), True)],
                         ids=["one-row", "one-column", "batch-of-rows"])
def test_a_gemv_through_numpy_splits_only_by_whole_items(a_shape, b_shape, splits, monkeypatch):
    """numpy computes a product with one row or one column as a GEMV, whose sums change with the
    block it is cut into: _act.matmul never cuts one (bit for bit numpy's whole product, nothing
    split), while a batch of them splits by whole items."""
    from onnxpack.session.kernels import _act

    monkeypatch.setattr(_act, "threads", lambda: 2)
    monkeypatch.setattr(_act, "blas_threads", lambda: 1)
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    rng = np.random.default_rng(len(a_shape) + b_shape[1])
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    tuner = _act.tuner(("matmul", a.shape, b.shape, "f", False))
    tuner.threads, tuner.choice = 2, True
    ran = []
    real = _act._split
    monkeypatch.setattr(_act, "_split", lambda *args: ran.append(1) or real(*args))
    np.testing.assert_array_equal(_act.matmul(a, b), np.matmul(a, b))
    assert bool(ran) is splits


@pytest.mark.parametrize("m,k,n", [(300, 40, 70), (64, 40, 300), (64, 40, 257), (40, 16, 1000), (20, 8, 100)],
                         ids=["rows", "columns", "columns-ragged", "columns-wide", "too-small"])
def test_split_matmul_computes_every_block_once(m, k, n, monkeypatch):
    """_act.matmul forced to split over two threads (rows of A from 256 of them or when B is
    narrow, else column blocks of 64), each block through numpy (the GEMM jobs off: see the
    next tests for them): every output element is numpy's product (each block's BLAS call sums
    the same products), none left unwritten."""
    from onnxpack.session.kernels import _act

    monkeypatch.setattr(_act, "_native_split", lambda *a: False)
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "threads", lambda: 2)
    monkeypatch.setattr(_act, "blas_threads", lambda: 1)
    rng = np.random.default_rng(9)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    tuner = _act.tuner(("matmul", a.shape, b.shape, a.dtype.char))
    tuner.threads, tuner.choice = 2, True
    calls = []
    real = np.matmul

    def counted(x, y, out=None):
        calls.append(out.shape if out is not None else None)
        return real(x, y, out=out)

    monkeypatch.setattr(_act.np, "matmul", counted)
    out = np.full((m, n), np.nan, np.float32)
    got = _act.matmul(a, b, out=out)
    monkeypatch.setattr(_act.np, "matmul", real)
    assert got is out
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)
    assert len(calls) == (1 if m < 32 else 2), calls
    if len(calls) == 2 and m >= _act._ROW_SPLIT_M:
        assert calls == [(m // 2, n), (m - m // 2, n)]

    # With an epilogue: called once per block, after that block's product is written, and every
    # output element in exactly one block.
    tuner = _act.tuner(("matmul", a.shape, b.shape, a.dtype.char, True))
    tuner.threads, tuner.choice = 2, True
    blocks, seen = [], np.zeros((m, n), np.int64)
    want = a @ b

    def after(r0, r1, c0, c1):
        blocks.append((r0, r1, c0, c1))
        np.testing.assert_allclose(out[r0:r1, c0:c1], want[r0:r1, c0:c1], rtol=1e-5, atol=1e-5)
        seen[r0:r1, c0:c1] += 1

    out = np.full((m, n), np.nan, np.float32)
    assert _act.matmul(a, b, out=out, after=after) is out
    assert np.all(seen == 1) and len(blocks) == len(calls), blocks


def _operand(rng, shape, wider: int = 0):
    """A float32 array of ``shape``; with ``wider``, a view of the first columns of a wider
    one (rows further apart than a row: numpy still hands it to the BLAS as it is)."""
    x = rng.standard_normal(shape[:-1] + (shape[-1] + wider,)).astype(np.float32)
    return x[..., :shape[-1]] if wider else x


@pytest.mark.parametrize("a_shape,b_shape,wider", [
    ((300, 40), (40, 70), 0), ((64, 40), (40, 300), 0), ((64, 40), (40, 257), 3), ((300, 40), (40, 70), 5),
    ((6, 20, 30), (6, 30, 40), 0), ((6, 20, 30), (30, 40), 2), ((1, 20, 30), (6, 30, 40), 0),
    ((20, 30), (5, 30, 40), 1), ((3, 64, 40), (40, 300), 0)],
    ids=["rows", "columns", "columns-ragged-strided", "rows-strided", "batch", "batch-shared-b", "batch-broadcast-a",
         "batch-shared-a-strided", "batch-of-3-by-columns"])
def test_split_matmul_as_gemm_jobs_equals_numpy_bit_for_bit(a_shape, b_shape, wider, monkeypatch):
    """A split float32 GEMM goes to the BLAS as jobs (the helpers' blocks computed by a polling
    helper without Python, or by the caller when none takes them): the output is bit for bit
    what numpy's matmul gives block by block (the same BLAS calls; OpenBLAS's sums for a block of
    rows may round differently from the whole product's, as before the jobs), whatever the split
    (rows, columns, items of a batch, operands shared by every item or broadcast from one, row
    strides wider than a row), into an output that is a view too, and numpy's matmul is not
    called."""
    from onnxpack.session.kernels import _act

    _polling_pool()
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "threads", lambda: 2)
    monkeypatch.setattr(_act, "blas_threads", lambda: 1)
    rng = np.random.default_rng(11)
    a, b = _operand(rng, a_shape, wider), _operand(rng, b_shape, wider)

    whole = np.matmul(a, b)

    def split(native):
        n = whole.shape[-1]
        out = np.full(whole.shape[:-1] + (n + wider,), np.nan, np.float32)[..., :n]
        tuner = _act.tuner(("matmul", a.shape, b.shape, "f", False))
        tuner.threads, tuner.choice = 2, True
        with monkeypatch.context() as mp:
            if not native:
                mp.setattr(_act, "_native_split", lambda *args: False)
            assert _act.matmul(a, b, out=out) is out
        return out

    want = split(False)
    np.testing.assert_allclose(want, whole, rtol=1e-5, atol=1e-5)
    ran = []
    real_split = _act._native_split
    monkeypatch.setattr(_act, "_native_split", lambda *args: ran.append(real_split(*args)) or ran[-1])
    calls = []
    real = np.matmul
    monkeypatch.setattr(_act.np, "matmul", lambda *x, **kw: calls.append(1) or real(*x, **kw))
    for _ in range(20):  # helpers polling or not, every way gives the same bits
        np.testing.assert_array_equal(split(True), want)
    monkeypatch.setattr(_act.np, "matmul", real)
    assert ran and all(ran) and not calls, (ran, calls)


@pytest.mark.parametrize("a_shape,b_shape", [((300, 40), (40, 70)), ((64, 40), (40, 300)), ((6, 20, 30), (6, 30, 40))],
                         ids=["rows", "columns", "batch"])
def test_a_deterministic_run_splits_gemms_by_size_untimed(a_shape, b_shape, monkeypatch):
    """Inside deterministic_run (a use_deterministic_compute session's run) matmul never asks
    its SplitTuner: a product from _DETERMINISTIC_SPLIT_MACS multiply-adds gives the split's
    bits, a smaller one the whole product's (a block's sums may round otherwise than the whole
    product's, with OpenBLAS's Haswell kernels), whatever a tuner decided or is measuring;
    outside it, the tuner decides."""
    from onnxpack.session.kernels import _act

    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "threads", lambda: 2)
    monkeypatch.setattr(_act, "blas_threads", lambda: 1)
    rng = np.random.default_rng(17)
    a, b = _operand(rng, a_shape), _operand(rng, b_shape)
    key = ("matmul", a.shape, b.shape, "f", False)
    tuner = _act.tuner(key)
    tuner.threads, tuner.choice = 2, True
    split = _act.matmul(a, b)
    tuner.choice = False
    whole = _act.matmul(a, b)
    macs = _act.split_size(a.shape[-2], a.shape[-1], b.shape[-1], max(a.shape[0], b.shape[0]) if a.ndim == 3 else 1)
    asked = []
    real = _act.tuner
    monkeypatch.setattr(_act, "tuner", lambda k: asked.append(k) or real(k))
    for limit, want in ((macs, split), (macs + 1, whole)):
        monkeypatch.setattr(_act, "_DETERMINISTIC_SPLIT_MACS", limit)
        for choice in (True, False, None):  # whatever the tuner holds
            tuner.choice = choice
            with _act.deterministic_run():
                np.testing.assert_array_equal(_act.matmul(a, b), want)
    assert key not in asked
    np.testing.assert_allclose(_act.matmul(a, b), np.matmul(a, b), rtol=1e-5, atol=1e-5)
    assert key in asked


def test_gemm_jobs_only_for_products_numpy_hands_to_the_blas_as_they_are():
    """A job's sizes and strides are not checked again where it runs: only float32 operands
    numpy passes to cblas_sgemm unchanged, with agreeing shapes, into a writable output of their
    own, become jobs (a mismatch is numpy's error; a vector is numpy's GEMV; a transposed or
    column-strided operand numpy's own loop; an overlapping output numpy's buffered product)."""
    from onnxpack.session.kernels import _act

    f = np.zeros
    ok = (f((8, 5), np.float32), f((5, 6), np.float32), f((8, 6), np.float32), 1)
    assert _act._jobs_fit(*ok)
    assert _act._jobs_fit(f((4, 8, 5), np.float32), f((5, 6), np.float32), f((4, 8, 6), np.float32), 4)
    bad = {
        "float64": (f((8, 5)), f((5, 6)), f((8, 6)), 1),
        "one row": (f((1, 5), np.float32), f((5, 6), np.float32), f((1, 6), np.float32), 1),
        "one column": (f((8, 5), np.float32), f((5, 1), np.float32), f((8, 1), np.float32), 1),
        "inner sizes": (f((8, 5), np.float32), f((4, 6), np.float32), f((8, 6), np.float32), 1),
        "output shape": (f((8, 5), np.float32), f((5, 6), np.float32), f((8, 7), np.float32), 1),
        "output items": (f((4, 8, 5), np.float32), f((5, 6), np.float32), f((3, 8, 6), np.float32), 4),
        "operand items": (f((2, 8, 5), np.float32), f((4, 5, 6), np.float32), f((4, 8, 6), np.float32), 4),
        "transposed": (f((8, 5), np.float32), f((6, 5), np.float32).T, f((8, 6), np.float32), 1),
        "column stride": (f((8, 10), np.float32)[:, ::2], f((5, 6), np.float32), f((8, 6), np.float32), 1),
        "read-only output": (f((4, 8, 5), np.float32), f((5, 6), np.float32),
                             np.broadcast_to(f((8, 6), np.float32), (4, 8, 6)), 4),
    }
    square = f((8, 8), np.float32)
    bad["output is an operand"] = (square, f((8, 8), np.float32), square, 1)
    for what, args in bad.items():
        assert not _act._jobs_fit(*args), what


def test_split_matmuls_from_concurrent_callers_with_gemm_jobs(monkeypatch):
    """Two threads splitting GEMMs at once: one at a time posts jobs (the other's split takes the
    numpy path meanwhile), and every product is numpy's split's, bit for bit, over many calls."""
    from onnxpack.session.kernels import _act

    _polling_pool()
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "threads", lambda: 2)
    monkeypatch.setattr(_act, "blas_threads", lambda: 1)
    rng = np.random.default_rng(8)
    cases = [(_operand(rng, (300, 40)), _operand(rng, (40, 70))), (_operand(rng, (6, 20, 30)), _operand(rng, (30, 40)))]
    for a, b in cases:
        tuner = _act.tuner(("matmul", a.shape, b.shape, "f", False))
        tuner.threads, tuner.choice = 2, True
        tuner.modes[0].calls = tuner.modes[1].calls = -10**9  # (no re-measuring: every call splits)
    with monkeypatch.context() as mp:
        mp.setattr(_act, "_native_split", lambda *args: False)
        want = [_act.matmul(a, b) for a, b in cases]
    ran, errors = [], []

    real_split = _act._native_split
    monkeypatch.setattr(_act, "_native_split", lambda *args: ran.append(real_split(*args)) or ran[-1])

    def caller(i):
        try:
            a, b = cases[i]
            for _ in range(200):
                np.testing.assert_array_equal(_act.matmul(a, b), want[i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    _two_callers_racing(caller, errors)
    assert any(ran), "no split ran as jobs"


def _two_callers_racing(caller, errors: list) -> None:
    """``caller(0)`` and ``caller(1)`` on two threads at once, the GIL changing hands between
    their steps as often as it can; neither may fail (``errors``) nor hang."""
    import sys

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors and not any(t.is_alive() for t in threads), errors


def test_gemm_jobs_stay_off_where_the_blas_entry_does_not_compute_as_numpy(monkeypatch, caplog):
    """The cblas_sgemm found in numpy's OpenBLAS is checked once on a strided batched product:
    an entry that does not give np.matmul's result (here: one that computes nothing) turns the
    jobs off, with a log line, and splits then go through numpy as before."""
    import logging
    import types

    from onnxpack.session.kernels import _act

    pool = _polling_pool()
    spin = pool.spinner()
    if not pool.sgemm:
        pytest.skip("numpy's BLAS has no ILP64 cblas_sgemm here")
    silent = types.SimpleNamespace(run_job=lambda jobs, row: None)
    with caplog.at_level(logging.INFO, logger=_act.__name__):
        assert _act._find_sgemm(silent, np.zeros((1, spin.JOB_LEN), np.int64), pool.fields) == 0
    assert "GEMM jobs off" in caplog.text
    assert _act._find_sgemm(spin, np.zeros((1, spin.JOB_LEN), np.int64), pool.fields) == pool.sgemm

    monkeypatch.setattr(pool, "sgemm", 0)
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "threads", lambda: 2)
    monkeypatch.setattr(_act, "blas_threads", lambda: 1)
    rng = np.random.default_rng(3)
    a, b = _operand(rng, (300, 40)), _operand(rng, (40, 70))
    tuner = _act.tuner(("matmul", a.shape, b.shape, "f", False))
    tuner.threads, tuner.choice = 2, True
    calls = []
    real = np.matmul
    monkeypatch.setattr(_act.np, "matmul", lambda *x, **kw: calls.append(1) or real(*x, **kw))
    got = _act.matmul(a, b)
    monkeypatch.setattr(_act.np, "matmul", real)
    assert len(calls) == 2  # numpy's two blocks
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)


def test_a_polling_helper_computes_the_gemm_jobs_it_claims():
    """The helper's side of a GEMM job: while it polls, a job posted in its row is claimed and
    computed by it (the caller's claim then fails and it waits for the result); while it sleeps,
    the caller claims the job and computes it.  Either way numpy's product, bit for bit."""
    from onnxpack.session.kernels import _act

    pool = _polling_pool()
    spin = pool.spinner()
    if not pool.sgemm:
        pytest.skip("numpy's BLAS has no ILP64 cblas_sgemm here")
    rng = np.random.default_rng(5)
    a, b = _operand(rng, (37, 50)), _operand(rng, (50, 41))
    want = np.matmul(a, b)
    saved = pool.limit
    pool.limit = 10**12  # poll until told to stop
    try:
        with pool.native_lock:  # (no split of another test's thread uses the rows meanwhile)
            for polling in (True, False):
                if polling:
                    deadline = time.monotonic() + 10
                    while not pool.jobs[0, spin.J_POLLING] and time.monotonic() < deadline:
                        pool.submit(_act._nothing, 1)
                        time.sleep(0.01)
                    assert pool.jobs[0, spin.J_POLLING] == 1
                else:
                    _act.stop_spinning()
                    deadline = time.monotonic() + 10
                    while pool.jobs[0, spin.J_POLLING] and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert pool.jobs[0, spin.J_POLLING] == 0
                out = np.full((37, 41), np.nan, np.float32)
                pool.jobs[0, pool.fields] = (spin.KIND_GEMM, pool.sgemm, 1, 37, 41, 50, a.ctypes.data, 50,
                                             b.ctypes.data, 41, out.ctypes.data, 41, 0, 0, 0)
                pool.token += 1
                assert spin.post(pool.jobs, 0, pool.token) == polling
                if polling:
                    deadline = time.monotonic() + 10
                    while not spin.wait_done(pool.jobs, 0, pool.token, 1000) and time.monotonic() < deadline:
                        pass
                    assert not spin.claim(pool.jobs, 0, pool.token)  # the helper's
                else:
                    assert spin.claim(pool.jobs, 0, pool.token)
                    spin.run_job(pool.jobs, 0)
                np.testing.assert_array_equal(out, want)
    finally:
        pool.limit = saved
        _act.stop_spinning()


def test_unit_jobs_take_every_unit_once_from_every_thread():
    """A unit job (:func:`_act.run_units`): the caller and the polling helpers take units from one
    counter, each unit computed once (a helper late or asleep leaves its units to the caller),
    over many back-to-back jobs of 0 to 300 units; while another split holds the jobs the call
    does nothing and says so."""
    from onnxpack.session.kernels import _act

    pool = _polling_pool()
    spin = pool.spinner()
    from numba import carray, cfunc, types

    @cfunc(types.void(types.CPointer(types.int64), types.int64))
    def mark(table, u):  # + 1 in the unit's slot after the header
        t = carray(table, (spin.U_ARGS + u + 1,))
        t[spin.U_ARGS + u] += 1

    for i in range(400):
        units = (0, 1, 2, 7, 300)[i % 5]
        table = np.zeros(spin.U_ARGS + units, np.int64)
        if i % 50 == 49:
            _act.stop_spinning()  # the helpers asleep: the caller takes every unit
        assert _act.run_units(mark.address, table, units, 2)
        assert np.all(table[spin.U_ARGS:] == 1), (i, units, table[spin.U_ARGS:])
    with pool.native_lock:  # another split posting jobs now
        table = np.zeros(spin.U_ARGS + 3, np.int64)
        assert not _act.run_units(mark.address, table, 3, 2)
        assert not table[spin.U_ARGS:].any()
    _act.stop_spinning()


def _panel_case(rng, m, k, ns):
    from onnxpack.session.kernels.linalg import pack_panels

    a = rng.standard_normal((m, k)).astype(np.float32)
    return a, [pack_panels(rng.standard_normal((k, n)).astype(np.float32)) for n in ns], list(ns)


@pytest.mark.parametrize("m,k,ns", [(32, 300, (384,)), (32, 300, (200, 128, 384)), (130, 200, (192,)),
                                    (5, 700, (130, 64)), (70, 40, (3200,)), (13, 1100, (100,))],
                         ids=["panels", "three-weights-ragged", "rows", "six-rows-whole-panels", "many-panels",
                              "k-blocks-narrow-tail"])
@pytest.mark.usefixtures("panels_on")
def test_split_panel_gemm_as_unit_jobs_equals_one_thread_bit_for_bit(m, k, ns, monkeypatch):
    """A GEMM on panels split over two threads runs as a unit job (units of one panel, or of
    rows from 64 of them and fewer than 48 panels; several weights side by side; a narrow last
    panel; K over several blocks; up to six rows taking each panel whole): bit for bit the
    one-thread product, with the helpers polling or asleep, and the GIL-bound split is not
    called."""
    from onnxpack.session.kernels import _act, linalg

    _polling_pool()
    if linalg._sgemm() is None:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "threads", lambda: 2)
    a, ws, ns = _panel_case(np.random.default_rng(m + k), m, k, ns)
    tuner = _act.tuner(("sgemm_panels", m, k, ns[0] if len(ns) == 1 else tuple(ns)))

    def product(split: bool):
        tuner.threads, tuner.choice = 2, split
        outs = [np.full((m, n), np.nan, np.float32) for n in ns]
        linalg.matmul_panels_many(a, ws, ns, outs)
        return outs

    want = product(False)
    for w, y in zip(ws, want):
        np.testing.assert_allclose(y, a @ w.transpose(1, 0, 2).reshape(k, -1)[:, :y.shape[1]], rtol=1e-5, atol=1e-4)

    def check():
        for got, w in zip(product(True), want):
            np.testing.assert_array_equal(got, w)

    _twenty_as_unit_jobs(monkeypatch, check)


@pytest.mark.usefixtures("panels_on")
def test_a_gemm_of_one_row_splits_by_the_size_of_its_weight(monkeypatch):
    """A GEMM of few rows is held to the split size as if it had 16 (its time is reading the
    weight: MobileNetV2's classifier, 1 x 1280 x 1000, 1.3 M multiply-adds over 5 MB): such a
    product on panels goes to its split tuner at two threads, split or not bit for bit the same,
    while a small one stays on one thread."""
    from onnxpack.session.kernels import _act, linalg

    _polling_pool()
    if linalg._sgemm() is None:
        pytest.skip("numba is not installed")
    assert _act.split_size(1, 1280, 1000) >= _act._SPLIT_MACS > 1280 * 1000
    assert _act.split_size(300, 40, 70, 2) == 2 * 300 * 40 * 70
    assert _act.split_size(1, 64, 64) < _act._SPLIT_MACS
    monkeypatch.setattr(_act, "threads", lambda: 2)
    a, ws, ns = _panel_case(np.random.default_rng(1), 1, 1280, (1000,))
    tuner = _act.tuner(("sgemm_panels", 1, 1280, 1000))
    outs = []
    before = tuner.current().calls
    for split in (False, True):
        tuner.threads, tuner.choice = 2, split
        outs.append(np.full((1, 1000), np.nan, np.float32))
        linalg.matmul_panels_many(a, ws, ns, outs[-1:])
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], a @ ws[0].transpose(1, 0, 2).reshape(1280, -1)[:, :1000], rtol=1e-5, atol=1e-4)
    assert tuner.current().calls == before + 2  # both calls went through the tuner
    small, small_ws, small_ns = _panel_case(np.random.default_rng(2), 1, 64, (64,))
    linalg.matmul_panels_many(small, small_ws, small_ns, [np.empty((1, 64), np.float32)])
    small_choice = _act.tuner(("sgemm_panels", 1, 64, 64)).current()
    assert small_choice.threads == 0 and not small_choice.one and not small_choice.split  # one thread, untimed


def _twenty_as_unit_jobs(monkeypatch, call) -> None:
    """``call()`` twenty times, the pool's helpers polling, then asleep from the eleventh, every
    split a unit job that ran (the GIL-bound split fails the test)."""
    from onnxpack.session.kernels import _act

    ran = []
    real = _act.run_units
    monkeypatch.setattr(_act, "run_units", lambda *args: ran.append(real(*args)) or ran[-1])
    monkeypatch.setattr(_act, "parallel", lambda *args: pytest.fail("the GIL-bound split ran"))
    for i in range(20):
        if i == 10:
            _act.stop_spinning()
        call()
    assert len(ran) == 20 and all(ran)


@pytest.mark.usefixtures("panels_on")
def test_split_panel_gemms_from_concurrent_callers(monkeypatch):
    """Two threads splitting GEMMs on panels at once, the GIL changing hands as often as it can:
    one at a time runs a unit job (the other's split takes the GIL-bound path meanwhile), and
    every product is the one-thread one, bit for bit, over many calls."""
    from onnxpack.session.kernels import _act, linalg

    _polling_pool()
    if linalg._sgemm() is None:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "threads", lambda: 2)
    rng = np.random.default_rng(4)
    cases = [_panel_case(rng, 32, 200, (384,)), _panel_case(rng, 96, 100, (192, 64))]
    want = []
    for a, ws, ns in cases:
        tuner = _act.tuner(("sgemm_panels", a.shape[0], a.shape[1], ns[0] if len(ns) == 1 else tuple(ns)))
        tuner.threads, tuner.choice = 2, False
        want.append([np.empty((a.shape[0], n), np.float32) for n in ns])
        linalg.matmul_panels_many(a, ws, ns, want[-1])
        tuner.choice = True
        tuner.modes[0].calls = tuner.modes[1].calls = -10**9  # (no re-measuring: every call splits)
    ran, errors = [], []
    real = _act.run_units
    monkeypatch.setattr(_act, "run_units", lambda *args: ran.append(real(*args)) or ran[-1])

    def caller(i):
        try:
            a, ws, ns = cases[i]
            for _ in range(200):
                outs = [np.empty((a.shape[0], n), np.float32) for n in ns]
                linalg.matmul_panels_many(a, ws, ns, outs)
                for got, w in zip(outs, want[i]):
                    np.testing.assert_array_equal(got, w)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    _two_callers_racing(caller, errors)
    assert any(ran), "no split ran as a unit job"


@pytest.mark.parametrize("residual", [False, True], ids=["silu", "silu-residual-relu"])
@pytest.mark.parametrize("m,hw", [(300, 8), (64, 24)], ids=["rows", "columns"])
def test_split_conv_epilogue_as_unit_jobs_equals_one_thread(m, hw, residual, monkeypatch):
    """A 1x1 conv with its bias, SiLU and (with a residual) Add and Relu on two threads, split
    forced: each block's product and epilogue run as one unit of a unit job (no GIL), by rows of
    output channels or columns of positions, the one-thread result within float32 rounding (with
    the helpers polling or asleep), which is onnxruntime's within float32 rounding."""
    import onnxruntime as ort

    from onnxpack.session.kernels import _act, conv

    pool = _polling_pool()
    if not pool.sgemm:
        pytest.skip("numpy's BLAS has no ILP64 cblas_sgemm here")
    monkeypatch.setattr(conv, "_BCAST_ON", False)  # (the general path's split GEMM, not conv_bcast's panels)
    rng = np.random.default_rng(m + hw)
    c = 40
    F = TensorProto.FLOAT
    inits = [onnx.numpy_helper.from_array((rng.standard_normal((m, c, 1, 1)) * 0.2).astype(np.float32), "w"),
             onnx.numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c0"]), helper.make_node("Sigmoid", ["c0"], ["s"]),
             helper.make_node("Mul", ["c0", "s"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", F, [1, c, hw, hw])]
    feeds = {"x": rng.standard_normal((1, c, hw, hw)).astype(np.float32)}
    if residual:
        nodes += [helper.make_node("Add", ["y", "r"], ["a"]), helper.make_node("Relu", ["a"], ["u"])]
        inputs.append(helper.make_tensor_value_info("r", F, [1, m, hw, hw]))
        feeds["r"] = rng.standard_normal((1, m, hw, hw)).astype(np.float32)
    out = nodes[-1].output[0]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(out, F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    one = onnxpack.SessionOptions()
    one.intra_op_num_threads = 1
    want = onnxpack.InferenceSession(model, one).run(None, feeds)[0]
    np.testing.assert_allclose(want, ort.InferenceSession(model).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "blas_threads", lambda: 1)
    sess = onnxpack.InferenceSession(model)
    assert len(sess.program.root.steps) == 1  # the conv and its epilogue: one step
    sess.run(None, feeds)
    for key, t in _act._TUNERS.items():
        if key[0] == "matmul" and key[-1] is True:
            t.threads, t.choice = 2, True
    # Each block is its own GEMM call: OpenBLAS may pick another kernel for a block's size than for
    # the whole product (on an AMD Zen 5 VM, up to 8 float32 ulp apart on outputs near 1; on
    # Sapphire Rapids bit for bit): float32 rounding of the output's scale.
    tol = dict(rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))
    _twenty_as_unit_jobs(monkeypatch, lambda: np.testing.assert_allclose(sess.run(None, feeds)[0], want, **tol))


@pytest.mark.parametrize("m,hw,channel_steps", [(300, 8, 1), (64, 24, 1), (300, 8, 2), (48, 24, 2)],
                         ids=["rows", "columns", "rows-two-tables", "columns-two-tables"])
def test_split_conv_epilogue_by_blocks_equals_one_thread(m, hw, channel_steps, monkeypatch):
    """A 1x1 conv followed by what onnxruntime's QDQ quantizer writes around an unfolded
    BatchNormalization (QuantizeLinear -> DequantizeLinear pairs, the BatchNormalization as a
    per-channel step, a residual Add, Relu): on two threads (split forced) each thread runs the
    epilogue of its own block of output channels (rows) or positions (columns), bit for bit the
    one-thread result, which matches onnxruntime within one quantization step."""
    import onnxruntime as ort

    from onnxpack.session.kernels import _act, conv

    if _act.jit() is None:
        pytest.skip("numba not installed")
    monkeypatch.setattr(conv, "_BCAST_ON", False)  # (the general path's split GEMM, not conv_bcast's panels)
    rng = np.random.default_rng(11)
    c = 40
    F = TensorProto.FLOAT
    inits = [onnx.numpy_helper.from_array((rng.standard_normal((m, c, 1, 1)) * 0.2).astype(np.float32), "w"),
             onnx.numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c0"])]
    last = "c0"

    def fake_quant(src, k):
        inits.extend([onnx.numpy_helper.from_array(np.array(0.02 + 0.01 * k, np.float32), f"s{k}"),
                      onnx.numpy_helper.from_array(np.array(3 * k - 4, np.int8), f"z{k}")])
        nodes.extend([helper.make_node("QuantizeLinear", [src, f"s{k}", f"z{k}"], [f"q{k}"]),
                      helper.make_node("DequantizeLinear", [f"q{k}", f"s{k}", f"z{k}"], [f"d{k}"])])
        return f"d{k}"

    k = 0
    for j in range(channel_steps):
        last = fake_quant(last, k)
        k += 1
        for name, v in ((f"bs{j}", rng.uniform(0.5, 2, m)), (f"bb{j}", rng.standard_normal(m)),
                        (f"mu{j}", rng.standard_normal(m)), (f"var{j}", rng.uniform(0.5, 2, m))):
            inits.append(onnx.numpy_helper.from_array(v.astype(np.float32), name))
        nodes.append(helper.make_node("BatchNormalization", [last, f"bs{j}", f"bb{j}", f"mu{j}", f"var{j}"],
                                      [f"n{j}"]))
        last = fake_quant(f"n{j}", k)
        k += 1
    nodes += [helper.make_node("Add", [last, "r"], ["a"]), helper.make_node("Relu", ["a"], ["u"])]
    last = fake_quant("u", k)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, c, hw, hw]),
                                           helper.make_tensor_value_info("r", F, [1, m, hw, hw])],
                              [helper.make_tensor_value_info(last, F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    feeds = {"x": rng.standard_normal((1, c, hw, hw)).astype(np.float32),
             "r": rng.standard_normal((1, m, hw, hw)).astype(np.float32)}
    one = onnxpack.SessionOptions()
    one.intra_op_num_threads = 1
    want = onnxpack.InferenceSession(model, one).run(None, feeds)[0]
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_act, "blas_threads", lambda: 1)
    sess = onnxpack.InferenceSession(model)
    sess.run(None, feeds)
    (plan,) = [p for st in sess.program.root.steps if isinstance(st.kernel, conv.Conv)
               for p in st.kernel._plans.values() if isinstance(p, conv._ConvPlan)]
    assert plan.kind == conv._ONE and not plan.small and plan.table.shape[0] == channel_steps
    for key, t in _act._TUNERS.items():
        if key[0] == "matmul" and key[-1] is True:
            t.threads, t.choice = 2, True
    idents, blocks = set(), []
    real_jit = plan.jit

    class Spy:
        def __getattr__(self, name):
            return getattr(real_jit, name)

        @staticmethod
        def bias_act(y, *a):
            idents.add(threading.get_ident())
            blocks.append(("rows", y.shape[1]))
            time.sleep(0.005)  # so that the other thread takes the other block
            return real_jit.bias_act(y, *a)

        @staticmethod
        def bias_act_rows(y, n, at, length, *a):
            idents.add(threading.get_ident())
            blocks.append(("columns", length))
            time.sleep(0.005)
            return real_jit.bias_act_rows(y, n, at, length, *a)

    plan.jit = Spy()
    got = sess.run(None, feeds)[0]
    assert len(idents) == 2 and len(blocks) == 2, blocks
    assert {b[0] for b in blocks} == {"rows" if m >= _act._ROW_SPLIT_M else "columns"}
    np.testing.assert_array_equal(got, want)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    step = 0.02 + 0.01 * k
    assert np.abs(got - ref).max() <= step * 1.01


def test_a_process_exits_cleanly_right_after_a_split_with_polling_helpers():
    """A process that splits work and exits at once: the polling helper is stopped at exit
    (atexit), never left inside the JIT's code while the interpreter shuts down."""
    import subprocess
    import sys

    _polling_pool()
    code = ("import time, numba\n"
            "from onnxpack.session.kernels import _act\n"
            "_act.parallel(lambda a, b: time.sleep(0.001), 4, 2)\n"
            "assert _act._Pool.get()._spin is not None\n")
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


def _fast_mode_tuner(start: bool, settle: float = 0.0, recheck_s: float = 0.0):
    from onnxpack.session._threads import ModeTuner

    class Tuner(ModeTuner):
        SETTLE = settle
        RECHECK_FIRST_S = RECHECK_S = recheck_s

    return Tuner(start)


@pytest.mark.parametrize("start", [False, True])
@pytest.mark.parametrize("owned_faster", [False, True])
def test_mode_tuner_measures_each_mode_in_a_block_and_keeps_the_faster(start, owned_faster):
    """Runs take the starting mode for a block (its first SKIP runs not counted), then the other
    mode for a block; the mode of the lower median wins and holds until RECHECK_FIRST runs (and
    RECHECK_FIRST_S seconds) later, then twice as long after each choice, up to RECHECK runs (and
    RECHECK_S seconds).  A switch from the starting mode is confirmed first by a second block of
    each mode."""
    tuner = _fast_mode_tuner(start)
    per = tuner.SKIP + tuner.TRIALS
    inputs = [np.empty((1, 3, 8, 8), np.float32)]
    seen = []
    while tuner.choice is None:
        owned, which, key = tuner.pick(inputs)
        assert key == ((1, 3, 8, 8),)
        seen.append((owned, which))
        tuner.record(key, which, 1.0 if owned == owned_faster else 2.0)
        assert len(seen) <= 4 * per
    pair = ([(start, -1)] * tuner.SKIP + [(start, 0)] * tuner.TRIALS
            + [(not start, -1)] * tuner.SKIP + [(not start, 1)] * tuner.TRIALS)
    assert seen == (pair if owned_faster == start else 2 * pair)
    assert tuner.choice is owned_faster
    other = [np.empty((2, 3, 8, 8), np.float32)]
    waits = []
    for runs in [tuner.RECHECK_FIRST * 2 ** k for k in range(6)]:
        waits.append(min(runs, tuner.RECHECK))
        for _ in range(waits[-1] - 1):
            assert tuner.pick(other) == (owned_faster, -1, None)  # decided: any shapes take it
        assert tuner.pick(inputs) == (start, -1, ((1, 3, 8, 8),)) and tuner.choice is None  # measured again
        assert tuner.current() is owned_faster  # (unmeasured runs meanwhile: the mode chosen before)
        while tuner.choice is None:
            owned, which, key = tuner.pick(inputs)
            tuner.record(key, which, 1.0 if owned == owned_faster else 2.0)
    assert waits[0] == tuner.RECHECK_FIRST < tuner.RECHECK == waits[-1]
    # With RECHECK_S not yet passed, RECHECK runs are not enough.
    patient = _fast_mode_tuner(start, recheck_s=60.0)
    while patient.choice is None:
        owned, which, key = patient.pick(inputs)
        patient.record(key, which, 1.0 if owned == owned_faster else 2.0)
    for _ in range(2 * patient.RECHECK):
        assert patient.pick(inputs) == (owned_faster, -1, None)


@pytest.mark.parametrize("start", [False, True])
@pytest.mark.parametrize("blas_over_owned,want_owned", [(1.0, True), (0.98, True), (0.95, False), (1.05, True)])
def test_mode_tuner_keeps_blas_only_when_it_wins_by_the_margin(start, blas_over_owned, want_owned):
    """BLAS mode leaves a polling core behind every run: it is kept only when its median is below
    BLAS_MARGIN of owned mode's; a tie or a smaller gain keeps owned, whichever mode started."""
    tuner = _fast_mode_tuner(start)
    inputs = [np.empty((4, 4), np.float32)]
    while tuner.choice is None:
        owned, which, key = tuner.pick(inputs)
        tuner.record(key, which, 1.0 if owned else blas_over_owned)
    assert tuner.choice is want_owned


@pytest.mark.parametrize("start", [False, True])
@pytest.mark.parametrize("second_pair_agrees", [False, True])
def test_mode_tuner_confirms_a_switch_with_a_second_pair_of_blocks(start, second_pair_agrees):
    """One pair of blocks that favours the other mode (a burst of the rest of the machine in the
    starting mode's block) does not switch: a second block of each mode is measured, and the
    medians of all their runs decide."""
    tuner = _fast_mode_tuner(start)
    inputs = [np.empty((2, 2), np.float32)]
    blocks = 0
    last = None
    while tuner.choice is None:
        mode, which, key = tuner.pick(inputs)
        if which >= 0 and (which, len(tuner.times[which]) // tuner.TRIALS) != last:
            last, blocks = (which, len(tuner.times[which]) // tuner.TRIALS), blocks + 1
        first_pair = len(tuner.times[0]) < tuner.TRIALS or (which == 1 and len(tuner.times[1]) < tuner.TRIALS)
        if first_pair or second_pair_agrees:
            seconds = 2.0 if mode == start else 1.0  # the other mode looks faster
        else:
            seconds = 1.0 if mode == start else 3.0  # ... and then much slower
        tuner.record(key, which, seconds)
    assert blocks == 4
    assert tuner.choice is ((not start) if second_pair_agrees else start)
    assert len(tuner.times[0]) == len(tuner.times[1]) == 2 * tuner.TRIALS


def test_mode_tuner_counts_one_set_of_shapes_and_waits_for_the_settle_time():
    """A run with other input shapes restarts an undecided measurement; a block's runs count only
    SETTLE seconds after its first (OpenBLAS's workers poll for a while after its last call)."""
    tuner = _fast_mode_tuner(False)
    a, b = [np.empty((1, 4))], [np.empty((2, 4))]
    for _ in range(tuner.SKIP + tuner.TRIALS - 1):
        owned, which, key = tuner.pick(a)
        tuner.record(key, which, 1.0)
    assert len(tuner.times[0]) == tuner.TRIALS - 1
    assert tuner.pick(b) == (False, -1, ((2, 4),)) and tuner.times == ([], [])
    slow = _fast_mode_tuner(False, settle=60.0)
    for _ in range(4 * (slow.SKIP + slow.TRIALS)):
        owned, which, key = slow.pick(a)
        assert (owned, which) == (False, -1)
        slow.record(key, which, 1.0)
    assert slow.choice is None and slow.times == ([], [])


@pytest.mark.parametrize("mode", ["blas", "owned"])
def test_thread_mode_config_fixes_the_mode(mode, monkeypatch):
    """``onnxpack.thread_mode`` = blas / owned: every run takes that mode, none is measured; an
    unknown mode is an error naming the choices."""
    from onnxpack.errors import ConfigError
    from onnxpack.session import _runner
    from onnxpack.session._threads import ModeTuner

    monkeypatch.setattr(ModeTuner, "SETTLE", 0.0)
    seen = []
    real = _runner.owned_threads

    def spy(n):
        seen.append(n)
        return real(n)

    monkeypatch.setattr(_runner, "owned_threads", spy)
    so = onnxpack.SessionOptions()
    so.intra_op_num_threads = 2
    so.add_session_config_entry("onnxpack.thread_mode", mode)
    model = _conv_gemm_model()
    sess = onnxpack.InferenceSession(model, so)
    x = np.ones((1, 16, 48, 48), np.float32)
    runs = 2 + 2 * (ModeTuner.SKIP + ModeTuner.TRIALS)
    for _ in range(runs):
        sess.run(None, {"x": x})
    assert sess._runner.modes.times == ([], []) and sess._runner.modes.choice is (mode == "owned")
    assert seen == ([2] * runs if mode == "owned" else [])
    with pytest.raises(ConfigError, match="auto, blas, owned"):
        onnxpack.SessionOptions().add_session_config_entry("onnxpack.thread_mode", "fast")


def _conv_gemm_model() -> bytes:
    """A conv net with a classifier Gemm (its weight packed for onnxpack's own GEMM, where the
    JIT is there: the fixed rule's starting mode is then owned)."""
    rng = np.random.default_rng(7)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((64, 16, 3, 3)).astype(np.float32) * 0.1, "w1"),
             onnx.numpy_helper.from_array(rng.standard_normal((64, 64, 1, 1)).astype(np.float32) * 0.1, "w2"),
             onnx.numpy_helper.from_array(rng.standard_normal((64, 128)).astype(np.float32) * 0.1, "fc")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 48, 48])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


def test_a_session_on_two_threads_tries_both_modes_and_every_run_agrees(monkeypatch):
    """A session at intra_op_num_threads=2 (a conv net with a classifier Gemm) runs blocks of
    both thread modes, then keeps one: every run equals the one-thread session's output (up to
    the rounding of a GEMM split differently)."""
    from onnxpack.session._threads import ModeTuner, blas_libraries

    if not blas_libraries(quiet=True):
        pytest.skip("the BLAS thread count cannot be set here (threadpoolctl)")
    monkeypatch.setattr(ModeTuner, "SETTLE", 0.0)
    model = _conv_gemm_model()
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 16, 48, 48)).astype(np.float32)
    one = onnxpack.SessionOptions()
    one.intra_op_num_threads = 1
    want = onnxpack.InferenceSession(model, one).run(None, {"x": x})[0]
    two = onnxpack.SessionOptions()
    two.intra_op_num_threads = 2
    sess = onnxpack.InferenceSession(model, two)
    modes = sess._runner.modes
    # (two blocks, or four when the first pair favours a switch: see ModeTuner)
    for _ in range(1 + 4 * (ModeTuner.SKIP + ModeTuner.TRIALS) + 3):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    # Both blocks were timed (the second one runs the other mode), and a mode was kept.
    assert modes.choice is not None
    assert len(modes.times[0]) >= ModeTuner.TRIALS and len(modes.times[1]) >= ModeTuner.TRIALS


@pytest.mark.parametrize("start", [False, True])
def test_mode_tuner_switches_only_when_the_confirming_pair_alone_favours_it(start):
    """The first pair of blocks favours the other mode, by far; the confirming pair favours the
    starting mode by a little.  Medians over both pairs would switch (the first pair's times
    dominate); the confirming pair alone keeps the starting mode.  Both pairs favouring the
    switch switch."""
    for second_favours_switch, want in ((False, start), (True, not start)):
        tuner = _fast_mode_tuner(start)
        inputs = [np.empty((1, 4), np.float32)]
        counted = 0
        while tuner.choice is None:
            owned, which, key = tuner.pick(inputs)
            if which >= 0:
                counted += 1
            first_pair = counted <= 2 * tuner.TRIALS
            if owned == start:  # the starting mode: slow in the first pair, then 1.0
                t = 10.0 if first_pair else 1.0
            else:
                t = 1.0 if first_pair else (0.5 if second_favours_switch else 1.2)
            tuner.record(key, which, t)
            assert counted <= 4 * tuner.TRIALS
        assert counted == 4 * tuner.TRIALS and tuner.choice is want


def _in_forked_child(check) -> tuple[bytes, int]:
    """Forks; the child runs ``check()`` (True: ``b"ok"``) under a 60 s alarm (a hang ends it)
    and reports through a pipe.  Returns what it reported and its exit status."""
    import os
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            signal.alarm(60)
            os.write(w, b"ok" if check() else b"bad")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 16)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return got, status


def test_a_child_forked_while_a_run_is_inside_the_mode_tuner_runs_the_session(monkeypatch):
    """A child forked while another thread of the parent is paused inside the thread-mode
    tuner's measuring step runs the same session to the end, equal to the parent's output: the
    tuner holds no lock a forked child would wait on forever (the child gives up after 60 s)."""
    from onnxpack.session import _threads
    from onnxpack.session._threads import ModeTuner, blas_libraries

    if not blas_libraries(quiet=True):
        pytest.skip("the BLAS thread count cannot be set here (threadpoolctl)")
    monkeypatch.setattr(ModeTuner, "SETTLE", 0.0)
    two = onnxpack.SessionOptions()
    two.intra_op_num_threads = 2
    sess = onnxpack.InferenceSession(_conv_gemm_model(), two)
    x = np.random.default_rng(3).standard_normal((1, 16, 48, 48)).astype(np.float32)
    want = sess.run(None, {"x": x})[0]
    sess.run(None, {"x": x})  # measured from here on
    worker, paused, release = [0], threading.Event(), threading.Event()
    real = _threads.time.perf_counter

    class Clock:  # the tuner's clock: pauses the worker thread inside its measuring step
        @staticmethod
        def perf_counter():
            if threading.get_ident() == worker[0]:
                paused.set()
                release.wait(30)
            return real()

    def run_in_worker():
        worker[0] = threading.get_ident()
        sess.run(None, {"x": x})

    monkeypatch.setattr(_threads, "time", Clock)
    t = threading.Thread(target=run_in_worker)
    t.start()
    try:
        assert paused.wait(30)
        got, status = _in_forked_child(
            lambda: all(np.allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6) for _ in range(3)))
    finally:
        release.set()
        t.join(30)
    assert got == b"ok" and status == 0


def test_a_child_forked_while_a_parent_thread_holds_the_thread_locks_runs_sessions():
    """A child forked while another thread of the parent holds the thread-count lock and the
    kernels' tuner lock (as a run starting or ending in that thread does for a moment) runs
    sessions on one and two threads, equal to the parent's outputs: the child makes fresh locks
    and forgets the parent's runs in flight (it gives up after 60 s)."""
    from onnxpack.session import _threads
    from onnxpack.session.kernels import _act

    model = _conv_gemm_model()
    x = np.random.default_rng(4).standard_normal((1, 16, 48, 48)).astype(np.float32)
    sessions = {}
    for n in (1, 2):
        so = onnxpack.SessionOptions()
        so.intra_op_num_threads = n
        sessions[n] = onnxpack.InferenceSession(model, so)
    want = {n: s.run(None, {"x": x})[0] for n, s in sessions.items()}
    held, release = threading.Event(), threading.Event()

    def hold():
        with _threads._lock, _act._lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(30)
        got, status = _in_forked_child(
            lambda: all(np.allclose(s.run(None, {"x": x})[0], want[n], rtol=1e-5, atol=1e-6)
                        for _ in range(3) for n, s in sessions.items()))
    finally:
        release.set()
        t.join(30)
    assert got == b"ok" and status == 0


def test_a_child_forked_during_runs_in_flight_forgets_them():
    """A child forked while parent threads are inside a limited run and an owned run: those runs
    do not exist in the child, so their counts are gone there (left, the smallest would limit
    every run of the child for good, and owned_threads' count would never drop), and the child's
    own runs come and go as in any process."""
    from onnxpack.session import _threads
    from onnxpack.session.kernels import _act

    one = onnxpack.SessionOptions()
    one.intra_op_num_threads = 1
    sess = onnxpack.InferenceSession(_conv_gemm_model(), one)
    x = np.ones((1, 16, 48, 48), np.float32)
    want = sess.run(None, {"x": x})[0]
    held = [threading.Event(), threading.Event()]
    release = threading.Event()

    def limited_run():
        with _threads.blas_threads(1):
            held[0].set()
            release.wait(30)

    def owned_run():
        with _threads.owned_threads(3):
            held[1].set()
            release.wait(30)

    threads = [threading.Thread(target=limited_run), threading.Thread(target=owned_run)]
    for t in threads:
        t.start()
    try:
        assert all(h.wait(30) for h in held)

        def check():
            clean = not _threads._active and not _threads._owners and _act.owned[0] == 0
            ok = np.allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-6)
            return clean and ok and not _threads._active and not _threads._owners

        got, status = _in_forked_child(check)
        assert _threads._active and _threads._owners  # the parent's runs are still in flight
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert got == b"ok" and status == 0
