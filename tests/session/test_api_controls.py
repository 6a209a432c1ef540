"""Run controls and session settings of the onnxruntime API: RunOptions.terminate (set before a
run and from another thread during one, also inside a Loop body), profiling (Chrome-trace schema,
one event per node, node times adding up to the run), BLAS threads (intra_op_num_threads through
threadpoolctl, and the one warning without it), logging (severities, callback, logid), graph
optimization level, memory-pattern/arena switches, only_execute_path_to_fetches, run_async.

onnxruntime is asked the same where it can run the same model (pre-set terminate, errors,
profile file shape); the thread-controlled cases use a test kernel ("Gate") that onnxruntime does
not have.  No timing is asserted except the profile's own arithmetic (durations it records must
add up), and waits are bounded by generous timeouts only to fail instead of hanging.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack.capi import onnxruntime_pybind11_state as state
from onnxpack.errors import ConfigError, RuntimeFailure, Terminated
from onnxpack.session import _threads
from onnxpack.session.kernels import Kernel, register

F = TensorProto.FLOAT
TEST_DOMAIN = "test.onnxpack.api"
WAIT = 60  # seconds: only a bound against hanging, never an assertion


@register("Gate", domain=TEST_DOMAIN, since=1)
class Gate(Kernel):
    """Identity that counts its calls; on the call numbered ``stop_at`` it signals ``reached`` and
    waits for ``release`` (set by the test after it has set ``terminate``)."""

    calls = 0
    stop_at = -1
    reached = threading.Event()
    release = threading.Event()
    blas_threads: list[int] = []

    def run(self, x):
        cls = type(self)
        cls.calls += 1
        if cls.calls == cls.stop_at:
            cls.reached.set()
            cls.release.wait(WAIT)
        libs = _threads.blas_libraries()
        if libs:
            cls.blas_threads.append(libs[0].num_threads)
        return (x,)

    @classmethod
    def reset(cls, stop_at=-1):
        cls.calls, cls.stop_at = 0, stop_at
        cls.reached, cls.release = threading.Event(), threading.Event()
        cls.blas_threads = []


def _model(nodes, inputs, outputs, inits=(), opsets=(("", 17),)) -> bytes:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 9
    return m.SerializeToString()


def _gate_chain(n: int) -> bytes:
    names = ["x"] + [f"t{i}" for i in range(n - 1)] + ["y"]
    return _model([helper.make_node("Gate", [names[i]], [names[i + 1]], name=f"gate{i}", domain=TEST_DOMAIN)
                   for i in range(n)], [helper.make_tensor_value_info("x", F, [2])],
                  [helper.make_tensor_value_info("y", F, [2])], opsets=(("", 17), (TEST_DOMAIN, 1)))


def _gate_loop(trips: int) -> bytes:
    body = helper.make_graph(
        [helper.make_node("Gate", ["v_in"], ["v_out"], name="body_gate", domain=TEST_DOMAIN),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", F, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("v_out", F, [2])])
    return _model([helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)],
                  [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])],
                  [numpy_helper.from_array(np.array(trips, np.int64), "n")], opsets=(("", 17), (TEST_DOMAIN, 1)))


def _matmul_chain(n: int, size: int) -> bytes:
    w = (np.random.default_rng(0).standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
    names = ["x"] + [f"t{i}" for i in range(n - 1)] + ["y"]
    return _model([helper.make_node("MatMul", [names[i], "W"], [names[i + 1]], name=f"mm{i}") for i in range(n)],
                  [helper.make_tensor_value_info("x", F, [size, size])],
                  [helper.make_tensor_value_info("y", F, [size, size])], [numpy_helper.from_array(w, "W")])


MUL = _model([helper.make_node("Mul", ["X", "W"], ["Y"], name="mul_1")], [helper.make_tensor_value_info("X", F, [3, 2])],
             [helper.make_tensor_value_info("Y", F, [3, 2])],
             [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "W")])
X = np.ones((3, 2), np.float32)


# -- terminate ------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", ["onnxruntime", "onnxpack"])
def test_terminate_set_before_run_fails_like_onnxruntime_and_stays_set(runtime):
    rt = {"onnxruntime": ort, "onnxpack": onnxpack}[runtime]
    sess = rt.InferenceSession(MUL, providers=["CPUExecutionProvider"])
    ro = rt.RunOptions()
    ro.terminate = True
    fail = rt.capi.onnxruntime_pybind11_state.Fail
    for _ in range(2):  # the flag stays set
        with pytest.raises(fail, match="Exiting due to terminate flag being set to true"):
            sess.run(None, {"X": X}, ro)
    ro.terminate = False
    np.testing.assert_array_equal(sess.run(None, {"X": X}, ro)[0], X * np.arange(6).reshape(3, 2))


@pytest.mark.parametrize("model,stop_at,total", [(_gate_chain(200), 3, 200), (_gate_loop(200), 3, 200)],
                         ids=["chain", "loop-body"])
@pytest.mark.parametrize("planner", ["none", "greedy_by_size"])
def test_terminate_from_another_thread_stops_between_nodes(model, stop_at, total, planner):
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("onnxpack.memory_planner", planner)
    sess = onnxpack.InferenceSession(model, so)
    ro = onnxpack.RunOptions()
    Gate.reset(stop_at)
    outcome = {}

    def work():
        try:
            sess.run(None, {"x": np.ones(2, np.float32)}, ro)
            outcome["result"] = "finished"
        except Exception as exc:  # the assertion is below, in the test thread
            outcome["result"] = exc

    t = threading.Thread(target=work)
    t.start()
    assert Gate.reached.wait(WAIT)
    ro.terminate = True  # another thread, while the run is inside node number stop_at
    Gate.release.set()
    t.join(WAIT)
    exc = outcome["result"]
    assert isinstance(exc, Terminated) and isinstance(exc, state.Fail) and isinstance(exc, RuntimeFailure)
    assert str(exc) == "Exiting due to terminate flag being set to true."
    assert Gate.calls == stop_at < total  # the node in flight finished; no later node ran
    ro.terminate = False
    Gate.reset()
    np.testing.assert_array_equal(sess.run(None, {"x": np.ones(2, np.float32)}, ro)[0], np.ones(2, np.float32))
    assert Gate.calls == total


def test_runs_without_run_options_take_the_plain_loop():
    """No RunOptions, no profiling, no binding: run_plan gets no control (the per-node hook that
    checks terminate is not installed)."""
    from onnxpack.session import _runner

    seen = []
    real = _runner.run_plan

    def spy(plan, inputs, parent=None, hook=None, control=None):
        seen.append(control)
        return real(plan, inputs, parent, hook, control)

    sess = onnxpack.InferenceSession(MUL)
    try:
        _runner.run_plan = spy
        sess.run(None, {"X": X})
        sess.run(None, {"X": X}, onnxpack.RunOptions())
    finally:
        _runner.run_plan = real
    assert seen[0] is None and seen[1] is not None


# -- profiling ------------------------------------------------------------------------------------
_EVENT_KEYS = {"cat": str, "pid": int, "tid": int, "dur": (int, float), "ts": (int, float), "ph": str, "name": str,
               "args": dict}


def _check_trace(path: str) -> list[dict]:
    """The Chrome trace event format's JSON-array form, complete ("X") events."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    events = json.loads(text)
    assert isinstance(events, list) and events
    lines = text.strip().splitlines()
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) == len(events) + 2  # one event per line
    for e in events:
        assert set(e) == set(_EVENT_KEYS), e
        for key, kind in _EVENT_KEYS.items():
            assert isinstance(e[key], kind) and not isinstance(e[key], bool), (key, e)
        assert e["ph"] == "X" and e["dur"] >= 0 and e["cat"] in ("Session", "Node")
    return events


def test_profile_is_a_chrome_trace_like_onnxruntime(tmp_path):
    files = {}
    for name, rt in (("onnxruntime", ort), ("onnxpack", onnxpack)):
        so = rt.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / f"{name}_prof")
        sess = rt.InferenceSession(MUL, so, providers=["CPUExecutionProvider"])
        start = sess.get_profiling_start_time_ns()
        sess.run(None, {"X": X})
        sess.run(None, {"X": X})
        files[name] = sess.end_profiling()
        assert files[name].startswith(so.profile_file_prefix + "_") and files[name].endswith(".json")
        assert sess.end_profiling() == ""  # ended: nothing more to write
        assert start > 0
    theirs, ours = _check_trace(files["onnxruntime"]), _check_trace(files["onnxpack"])
    for events in (theirs, ours):
        names = [e["name"] for e in events]
        assert names.count("model_run") == 2
        assert names.count("mul_1_kernel_time") == 2
        assert "session_initialization" in names
        node = next(e for e in events if e["cat"] == "Node")
        assert node["args"]["op_name"] == "Mul" and node["args"]["provider"] == "CPUExecutionProvider"
        assert node["args"]["output_type_shape"] == [{"float": [3, 2]}]


def test_profile_node_times_add_up_to_the_run(tmp_path):
    """Every node of the graph has one event per run, and a run's node events add up to its
    model_run event within 10 % (20 MatMuls of 256x256: the loop's own cost is small)."""
    so = onnxpack.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    sess = onnxpack.InferenceSession(_matmul_chain(20, 256), so)
    x = np.ones((256, 256), np.float32)
    for _ in range(4):
        sess.run(None, {"x": x})
    events = _check_trace(sess.end_profiling())
    runs = [e for e in events if e["name"] == "model_run"]
    nodes = [e for e in events if e["cat"] == "Node"]
    assert len(runs) == 4 and len(nodes) == 4 * 20
    for run in runs[1:]:  # the first run also pays first-call costs outside any node
        inside = [n for n in nodes if run["ts"] <= n["ts"] <= run["ts"] + run["dur"]]
        assert sorted(n["args"]["node_index"] for n in inside) == sorted(str(k) for k in range(20))
        total = sum(n["dur"] for n in inside)
        assert abs(total - run["dur"]) <= 0.10 * run["dur"], (total, run["dur"])
        assert all(0 <= n["args"]["kernel_dur"] <= n["dur"] + 1e-3 for n in inside)


def test_profiling_off_start_time_zero_and_empty_end():
    sess = onnxpack.InferenceSession(MUL)
    theirs = ort.InferenceSession(MUL, providers=["CPUExecutionProvider"])
    assert sess.get_profiling_start_time_ns() == theirs.get_profiling_start_time_ns() == 0
    assert sess.end_profiling() == theirs.end_profiling() == ""


# -- threads --------------------------------------------------------------------------------------
def test_intra_op_num_threads_limits_blas_during_runs_only():
    pytest.importorskip("threadpoolctl")
    libs = _threads.blas_libraries()
    if not libs:
        pytest.skip("numpy loaded no BLAS threadpoolctl can control")
    before = libs[0].num_threads
    libs[0].set_num_threads(2)
    try:
        so = onnxpack.SessionOptions()
        so.intra_op_num_threads = 1
        sess = onnxpack.InferenceSession(_gate_chain(2), so)
        Gate.reset()
        sess.run(None, {"x": np.ones(2, np.float32)})
        assert Gate.blas_threads == [1, 1]
        assert libs[0].num_threads == 2  # restored after the run
        # On several threads, in BLAS mode (runs start in owned mode: the BLAS at one thread, see
        # test_runs_on_several_threads_start_in_owned_mode).
        so0 = onnxpack.SessionOptions()
        so0.add_session_config_entry("onnxpack.thread_mode", "blas")
        Gate.reset()
        onnxpack.InferenceSession(_gate_chain(2), so0).run(None, {"x": np.ones(2, np.float32)})
        assert Gate.blas_threads == [2, 2]  # 0: left as it is
        # The user changes the count between runs: the next run restores the new one.
        libs[0].set_num_threads(1)
        so2 = onnxpack.SessionOptions()
        so2.intra_op_num_threads = 2
        so2.add_session_config_entry("onnxpack.thread_mode", "blas")
        Gate.reset()
        onnxpack.InferenceSession(_gate_chain(2), so2).run(None, {"x": np.ones(2, np.float32)})
        assert Gate.blas_threads == [2, 2]
        assert libs[0].num_threads == 1
        Gate.reset()
        sess.run(None, {"x": np.ones(2, np.float32)})  # limited to the count it already has
        assert Gate.blas_threads == [1, 1] and libs[0].num_threads == 1
    finally:
        libs[0].set_num_threads(before)


def test_only_numpys_own_blas_is_limited_when_it_can_be_told():
    """numba imports scipy, whose wheel brings a second OpenBLAS that onnxpack never calls: the
    limit applies to the one in numpy's wheel (``numpy.libs``); a numpy on a system BLAS (no such
    folder among the libraries) keeps every library found."""
    import os

    class Lib:
        def __init__(self, path: str) -> None:
            self.filepath = path

    ours = Lib(os.path.join(os.path.realpath(os.path.dirname(np.__file__)) + ".libs", "libscipy_openblas64_.so"))
    scipys = Lib("/site-packages/scipy.libs/libscipy_openblas.so")
    system = Lib("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
    assert _threads._numpy_own([scipys, ours]) == [ours]
    assert _threads._numpy_own([system, scipys]) == [system, scipys]


@pytest.mark.parametrize("first_setter", ["main", "worker"])
def test_intra_op_num_threads_limits_blas_in_runs_from_any_thread(first_setter):
    """threadpoolctl (3.6 on) lets only one live thread change OpenBLAS's thread count, the
    first that set it, and ignores every other thread's set: a 1-thread session run from a
    server's worker thread after the main thread had set the count (or from the main thread
    while a worker that set it lives) ran its BLAS on every core.  A run's limit holds in
    whichever thread runs it, and the count is restored after it."""
    pytest.importorskip("threadpoolctl")
    libs = _threads.blas_libraries()
    if not libs:
        pytest.skip("numpy loaded no BLAS threadpoolctl can control")
    lib = libs[0]
    clear = getattr(type(lib), "clear_controlling_thread", None)
    before = lib.num_threads
    so = onnxpack.SessionOptions()
    so.intra_op_num_threads = 1
    sess = onnxpack.InferenceSession(_gate_chain(2), so)
    seen: list = []

    def run() -> None:
        Gate.reset()
        sess.run(None, {"x": np.ones(2, np.float32)})
        seen.append((list(Gate.blas_threads), lib.num_threads))

    set_it, done = threading.Event(), threading.Event()

    def worker() -> None:  # sets the count through threadpoolctl, then stays alive
        lib.set_num_threads(2)
        set_it.set()
        done.wait(WAIT)

    helper = threading.Thread(target=worker)
    try:
        if clear is not None:
            clear(force=True)
        if first_setter == "main":
            lib.set_num_threads(2)
            runner = threading.Thread(target=run)
            runner.start()
            runner.join(WAIT)
        else:
            helper.start()
            assert set_it.wait(WAIT)
            run()
        assert seen == [([1, 1], 2)]
    finally:
        done.set()
        if helper.is_alive():
            helper.join(WAIT)
        if clear is not None:
            clear(force=True)
        lib.set_num_threads(before)


def _gate_after_panels() -> bytes:
    """MatMul by a 128-column float32 weight (panels: onnxpack's own GEMM), then a Gate."""
    w = np.random.default_rng(3).standard_normal((8, 128)).astype(np.float32)
    return _model([helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                   helper.make_node("Gate", ["h"], ["y"], name="gate", domain=TEST_DOMAIN)],
                  [helper.make_tensor_value_info("x", F, [2, 8])], [helper.make_tensor_value_info("y", F, [2, 128])],
                  [numpy_helper.from_array(w, "W")], opsets=(("", 17), (TEST_DOMAIN, 1)))


@pytest.mark.usefixtures("panels_on")
@pytest.mark.parametrize("setting", [2, 0], ids=["intra2", "default"])
def test_runs_on_several_threads_start_in_owned_mode(setting, monkeypatch):
    """Runs on several threads start in owned mode (see ModeTuner), whatever the program: the BLAS
    at one thread and onnxpack's threads at the session's count (the BLAS's, when 0), both
    restored after the run, for a program with a panel GEMM (with numba) and one without a GEMM;
    ``onnxpack.thread_mode = blas`` keeps the BLAS at the count."""
    pytest.importorskip("threadpoolctl")
    from onnxpack.session.kernels import _act

    if not _act.jit_possible():
        pytest.skip("numba is not installed: panels run on numpy's BLAS")
    libs = _threads.blas_libraries()
    if not libs:
        pytest.skip("numpy loaded no BLAS threadpoolctl can control")
    monkeypatch.delenv("ONNXPACK_NUM_THREADS", raising=False)
    before = libs[0].num_threads
    libs[0].set_num_threads(2)
    seen = []
    real = Gate.run
    monkeypatch.setattr(Gate, "run", lambda self, x: seen.append((libs[0].num_threads, _act.threads())) or real(self, x))
    try:
        so = onnxpack.SessionOptions()
        so.intra_op_num_threads = setting
        sess = onnxpack.InferenceSession(_gate_after_panels(), so)
        x = np.random.default_rng(4).standard_normal((2, 8)).astype(np.float32)
        got = sess.run(None, {"x": x})[0]
        assert seen == [(1, 2)]
        assert libs[0].num_threads == 2 and _act.threads() == 2  # restored
        w = np.random.default_rng(3).standard_normal((8, 128)).astype(np.float32)  # _gate_after_panels
        np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
        seen.clear()
        plain = onnxpack.InferenceSession(_gate_chain(1), so)
        plain.run(None, {"x": np.ones(2, np.float32)})
        assert seen == [(1, 2)]
        assert libs[0].num_threads == 2 and _act.threads() == 2
        seen.clear()
        so.add_session_config_entry("onnxpack.thread_mode", "blas")
        blas = onnxpack.InferenceSession(_gate_chain(1), so)
        blas.run(None, {"x": np.ones(2, np.float32)})
        assert seen == [(2, 2)]
    finally:
        libs[0].set_num_threads(before)


def test_a_one_thread_run_beside_an_owned_run_splits_nothing(monkeypatch):
    """A run of a session with ``intra_op_num_threads = 1`` while another session's run owns two
    threads: its kernels stay on one thread (they read the owned run's count, process-wide, and
    split over two), and the owner's keep their two."""
    pytest.importorskip("threadpoolctl")
    from onnxpack.session.kernels import _act

    if not _threads.blas_libraries():
        pytest.skip("numpy loaded no BLAS threadpoolctl can control")
    monkeypatch.delenv("ONNXPACK_NUM_THREADS", raising=False)
    seen = []
    real = Gate.run
    monkeypatch.setattr(Gate, "run", lambda self, x: real(self, x) + (seen.append(_act.threads()),)[:0])
    owner_opts = onnxpack.SessionOptions()
    owner_opts.intra_op_num_threads = 2
    owner_opts.add_session_config_entry("onnxpack.thread_mode", "owned")
    owner = onnxpack.InferenceSession(_gate_chain(1), owner_opts)
    one_opts = onnxpack.SessionOptions()
    one_opts.intra_op_num_threads = 1
    one = onnxpack.InferenceSession(_gate_chain(1), one_opts)
    x = {"x": np.ones(2, np.float32)}
    owner.run(None, x)  # (its first run)
    Gate.reset(stop_at=1)
    paused = threading.Thread(target=owner.run, args=(None, x))
    paused.start()
    try:
        assert Gate.reached.wait(WAIT)
        seen.clear()
        one.run(None, x)
        assert seen == [1]
    finally:
        Gate.release.set()
        paused.join(WAIT)
    assert seen == [1, 2]  # the owner's run resumed after the other's had ended
    seen.clear()
    owner.run(None, x)
    assert seen == [2] and _act.owned[0] == 0


def test_owned_thread_counts_overlap_as_the_smallest():
    from onnxpack.session.kernels import _act

    with _threads.owned_threads(4):
        assert _act.owned[0] == 4
        with _threads.owned_threads(3):
            assert _act.owned[0] == 3
        assert _act.owned[0] == 4
    assert _act.owned[0] == 0
    with _threads.owned_threads(1):  # one thread: nothing of onnxpack's to own
        assert _act.owned[0] == 0


def test_thread_settings_without_threadpoolctl_warn_once(monkeypatch, caplog):
    monkeypatch.setattr(_threads, "_libs", None)
    monkeypatch.setattr(_threads, "_unwarned", False)
    monkeypatch.setitem(__import__("sys").modules, "threadpoolctl", None)  # import fails
    so = onnxpack.SessionOptions()
    so.intra_op_num_threads = 1
    sess = onnxpack.InferenceSession(MUL, so)
    with caplog.at_level(logging.WARNING, logger="onnxpack"):
        for _ in range(3):
            np.testing.assert_array_equal(sess.run(None, {"X": X})[0], X * np.arange(6).reshape(3, 2))
    warnings = [r for r in caplog.records if "threadpoolctl" in r.getMessage()]
    assert len(warnings) == 1


def test_default_threads_without_threadpoolctl_say_nothing_and_keep_one_mode(monkeypatch, caplog):
    """No thread setting and no threadpoolctl: no warning (nothing was asked), and on several
    BLAS threads the runs keep their starting thread mode (owned mode needs the BLAS at one
    thread, which only threadpoolctl can set), measuring nothing."""
    monkeypatch.setattr(_threads, "_libs", None)
    monkeypatch.setattr(_threads, "_unwarned", False)
    monkeypatch.setitem(__import__("sys").modules, "threadpoolctl", None)  # import fails
    sess = onnxpack.InferenceSession(MUL)
    with caplog.at_level(logging.WARNING, logger="onnxpack"):
        for _ in range(40):
            np.testing.assert_array_equal(sess.run(None, {"X": X})[0], X * np.arange(6).reshape(3, 2))
    assert not [r for r in caplog.records if "threadpoolctl" in r.getMessage()]
    modes = sess._runner.modes
    assert modes.choice is None and modes.times == ([], [])


# -- logging --------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", ["onnxruntime", "onnxpack"])
def test_bad_severities_rejected_like_onnxruntime(runtime):
    rt = {"onnxruntime": ort, "onnxpack": onnxpack}[runtime]
    for bad in (-1, 5):
        with pytest.raises(RuntimeError):
            rt.set_default_logger_severity(bad)
    so = rt.SessionOptions()
    so.log_severity_level = 7
    with pytest.raises(RuntimeError):
        rt.InferenceSession(MUL, so, providers=["CPUExecutionProvider"], enable_fallback=0)
    rt.set_default_logger_severity(2 if runtime == "onnxpack" else 3)


def test_session_log_records_carry_logid_and_respect_severity():
    records = []
    onnxpack.set_default_logger_callback(lambda *r: records.append(r), severity=0)
    try:
        so = onnxpack.SessionOptions()
        so.logid = "my-session"
        onnxpack.InferenceSession(MUL, so)
        assert any(r[2] == "my-session" and r[0] == 1 and "session created" in r[4] for r in records)
        records.clear()
        so.log_severity_level = 3  # errors only: the info record is not emitted
        onnxpack.InferenceSession(MUL, so)
        assert not any(r[2] == "my-session" for r in records)
    finally:
        onnxpack.set_default_logger_callback(None)
        onnxpack.set_default_logger_severity(2)


# -- optimization level, memory switches, pruning ----------------------------------------------
def _add_relu_model() -> bytes:
    return _model([helper.make_node("Add", ["x", "b"], ["s"], name="add"), helper.make_node("Relu", ["s"], ["y"], name="relu")],
                  [helper.make_tensor_value_info("x", F, [4])], [helper.make_tensor_value_info("y", F, [4])],
                  [numpy_helper.from_array(np.full(4, -0.5, np.float32), "b")])


@pytest.mark.parametrize("level,steps", [("ORT_DISABLE_ALL", 2), ("ORT_ENABLE_BASIC", 1), ("ORT_ENABLE_ALL", 1)])
def test_graph_optimization_level_switches_fusions(level, steps):
    so = onnxpack.SessionOptions()
    so.graph_optimization_level = getattr(onnxpack.GraphOptimizationLevel, level)
    sess = onnxpack.InferenceSession(_add_relu_model(), so)
    assert len(sess.program.root.steps) == steps  # Add -> Relu fused into one step unless disabled
    x = np.array([-1, 0, 0.25, 2], np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x - 0.5, 0))


def test_enum_attributes_refuse_ints_as_onnxruntime():
    for rt in (ort, onnxpack):
        so = rt.SessionOptions()
        with pytest.raises(TypeError):
            so.graph_optimization_level = 99
        with pytest.raises(TypeError):
            so.execution_mode = 1
        with pytest.raises(TypeError):
            so.intra_op_num_threads = 1.5
        assert str(so.graph_optimization_level) == "GraphOptimizationLevel.ORT_ENABLE_ALL"
        assert so.log_severity_level == -1 and so.profile_file_prefix == "onnxruntime_profile_"


@pytest.mark.parametrize("mem_pattern,arena,planned,pooled", [(True, True, True, True), (True, False, True, False),
                                                              (False, True, False, False)])
def test_mem_pattern_and_cpu_arena_switches(mem_pattern, arena, planned, pooled):
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("onnxpack.memory_planner", "greedy_by_size")
    so.enable_mem_pattern = mem_pattern
    so.enable_cpu_mem_arena = arena
    sess = onnxpack.InferenceSession(_matmul_chain(4, 8), so)
    x = np.ones((8, 8), np.float32)
    want = ort.InferenceSession(_matmul_chain(4, 8), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    arena_runner = sess._runner.arena
    assert (arena_runner is not None) == planned
    if planned:
        (sp,) = [p for p in arena_runner._plans.values() if p is not None]
        assert bool(sp._pool) == pooled
        ro = onnxpack.RunOptions()
        ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        sess.run(None, {"x": x}, ro)
        assert not sp._pool  # shrunk after the run


_FAULTS_CHILD = r"""
import json, resource, sys
import numpy as np
from onnx import TensorProto, helper
import onnxpack
n = 1 << 20  # 4 MiB of float32 per activation; up to three live at once
nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Add", ["a", "x"], ["b"]),
         helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Add", ["c", "b"], ["d"]),
         helper.make_node("Add", ["d", "c"], ["e"]), helper.make_node("ReduceSum", ["e"], ["y"], keepdims=0)]
g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
so = onnxpack.SessionOptions()
so.enable_cpu_mem_arena = sys.argv[1] == "1"
s = onnxpack.InferenceSession(m.SerializeToString(), so)
x = np.ones(n, np.float32)
for _ in range(3):
    s.run(None, {"x": x})
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    y = s.run(None, {"x": x})[0]
from onnxpack.session import _memory
print(json.dumps({"faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5, "y": float(y),
                  "kept": _memory._KEPT == [True]}))
"""


def _faults_per_run(arena: bool, tuning: str) -> dict:
    env = dict(os.environ, ONNXPACK_MALLOC_TUNING=tuning)
    out = subprocess.run([sys.executable, "-c", _FAULTS_CHILD, "1" if arena else "0"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                    reason="the allocator settings are glibc's; page faults are read from getrusage on Linux")
def test_cpu_arena_keeps_freed_memory_between_runs():
    """With enable_cpu_mem_arena (the default) a run's activations do not come back as fresh
    pages at every run: glibc is asked to keep freed memory (session/_memory.py).  Without the
    settings, the same runs fault every 4 KiB page of their activations again (glibc returns the
    top of its heap to the kernel once the free space there passes its trim threshold)."""
    kept = _faults_per_run(True, "1")
    assert kept["kept"] is True
    assert kept["y"] == 13.0 * (1 << 20)  # x = 1: e = 13 x
    assert kept["faults"] < 64, kept  # a few pages of Python objects at most, not the activations
    plain = _faults_per_run(True, "0")
    assert plain["kept"] is False and plain["y"] == kept["y"]
    assert plain["faults"] > 500, plain  # the pattern above is one glibc trims: the test can fail
    off = _faults_per_run(False, "1")  # enable_cpu_mem_arena = False: the allocator is left alone
    assert off["kept"] is False and off["faults"] > 500, off


def test_only_execute_path_to_fetches_skips_other_nodes():
    """A node whose result is not fetched would fail (Reshape to an impossible shape); with
    only_execute_path_to_fetches it does not run, as onnxruntime documents the option.
    (onnxruntime 1.32 itself runs it and fails here — docs/api.md lists the difference.)"""
    model = _model([helper.make_node("Neg", ["x"], ["a"], name="wanted"),
                    helper.make_node("Reshape", ["x", "bad_shape"], ["b"], name="unwanted"),
                    helper.make_node("Abs", ["b"], ["c"], name="after_unwanted")],
                   [helper.make_tensor_value_info("x", F, [4])],
                   [helper.make_tensor_value_info("a", F, [4]), helper.make_tensor_value_info("c", F, None)],
                   [numpy_helper.from_array(np.array([3], np.int64), "bad_shape")])
    x = np.arange(4, dtype=np.float32)
    sess = onnxpack.InferenceSession(model)
    ro = onnxpack.RunOptions()
    with pytest.raises(RuntimeFailure, match="unwanted"):
        sess.run(["a"], {"x": x}, ro)
    ro.only_execute_path_to_fetches = True
    for _ in range(2):  # the pruned plan is cached per output set
        np.testing.assert_array_equal(sess.run(["a"], {"x": x}, ro)[0], -x)
    with pytest.raises(RuntimeFailure, match="unwanted"):
        sess.run(["c", "a"], {"x": x}, ro)


def test_run_async_reports_errors_to_the_callback_like_onnxruntime():
    got = {}
    for name, rt in (("onnxruntime", ort), ("onnxpack", onnxpack)):
        done = threading.Event()
        sess = rt.InferenceSession(MUL, providers=["CPUExecutionProvider"])

        def callback(res, data, err, name=name, done=done):
            got[name] = (res, data, err)
            done.set()

        sess.run_async(None, {"X": np.ones((3, 3), np.float32)}, callback, "ud")
        assert done.wait(WAIT)
        with pytest.raises(ValueError, match=r"Required inputs \(\['X'\]\) are missing"):
            sess.run_async(None, {}, callback, "ud")
    for res, data, err in got.values():
        assert res == [] and data == "ud"
        assert "Got invalid dimensions for input: X" in err and "index: 1 Got: 3 Expected: 2" in err


def test_config_entry_errors():
    so = onnxpack.SessionOptions()
    with pytest.raises(RuntimeError, match="SessionOptions does not have configuration with key: nope"):
        so.get_session_config_entry("nope")
    with pytest.raises(ConfigError):  # and ours, for code that catches onnxpack's errors
        so.get_session_config_entry("nope")
    ro = onnxpack.RunOptions()
    with pytest.raises(RuntimeError, match="RunOptions does not have configuration with key: nope"):
        ro.get_run_config_entry("nope")
    with pytest.raises(TypeError):
        ro.add_run_config_entry("a", 1)


@pytest.mark.parametrize("empty", [True, False], ids=["empty-body", "one-node-body"])
def test_terminate_stops_a_loop_whose_body_has_no_steps(empty):
    """A Loop of 2^62 trips whose body has no node (outputs wired to its inputs) stops when
    another thread sets terminate, as one whose body runs steps does: with no step, the body
    never reached the run's check (the run kept going after terminate)."""
    import time

    cond = helper.make_tensor_value_info
    if empty:
        body = helper.make_graph([], "body", [cond("i", TensorProto.INT64, []), cond("c", TensorProto.BOOL, []),
                                             cond("v", TensorProto.FLOAT, [1])],
                                 [cond("c", TensorProto.BOOL, []), cond("v", TensorProto.FLOAT, [1])])
    else:
        body = helper.make_graph([helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Identity", ["v"], ["v2"])],
                                 "body", [cond("i", TensorProto.INT64, []), cond("c", TensorProto.BOOL, []),
                                          cond("v", TensorProto.FLOAT, [1])],
                                 [cond("c2", TensorProto.BOOL, []), cond("v2", TensorProto.FLOAT, [1])])
    graph = helper.make_graph([helper.make_node("Loop", ["M", "C", "x"], ["y"], body=body)], "g",
                              [cond("x", TensorProto.FLOAT, [1])], [cond("y", TensorProto.FLOAT, [1])],
                              [numpy_helper.from_array(np.array(2**62, np.int64), "M"), numpy_helper.from_array(np.array(True), "C")])
    sess = onnxpack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    ro = onnxpack.RunOptions()
    got: list = []

    def run() -> None:
        try:
            sess.run(None, {"x": np.ones(1, np.float32)}, ro)
            got.append("returned")
        except Terminated as exc:
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.3)
    ro.terminate = True
    t.join(20)
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], Terminated), got
