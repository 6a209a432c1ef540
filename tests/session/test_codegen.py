"""The generated plan function (_codegen) against the step loop it replaces: the same outputs, the
same errors, the same release points, and the loop wherever the function declines.

The loop is the oracle: every model here is run on both (the generated function switched off by
marking the plans declined), bit for bit; hand-built plans check what a model cannot show (a value
freed at its last use, a kernel patched after compilation, the error naming the step)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

import onnxpack
from onnxpack.errors import RuntimeFailure
from onnxpack.session import _codegen, _program
from onnxpack.session._program import Frame, Plan, Step, run_plan, schedule

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"


class _Fn:
    """A plain kernel computing ``fn(*args)``; counts its calls."""

    call_mode = "plain"

    def __init__(self, fn, outputs=1):
        self.fn = fn
        self.calls = 0
        self.outputs = outputs

    def run(self, *args):
        self.calls += 1
        r = self.fn(*args)
        return r if self.outputs != 1 else (r,)


def _plan(steps, inputs, outputs, constants=None, name="g"):
    made = [Step(helper.make_node("Custom", [n for n in ins], list(outs), name=f"n{k}"), kernel, tuple(ins), tuple(outs))
            for k, (kernel, ins, outs) in enumerate(steps)]
    made = schedule(made, list(inputs), list(outputs), constants or {})
    return Plan(name, name, tuple(inputs), tuple(outputs), constants or {}, tuple(made))


def _both(plan, inputs, parent=None):
    """(the loop's outputs, the generated function's) for one plan; asserts the function ran."""
    plan.__dict__["_fast"] = _program._DECLINED
    loop = run_plan(plan, inputs, parent)
    plan.__dict__.pop("_fast")
    run_plan(plan, inputs, parent)  # the first plain run: counted
    fast = run_plan(plan, inputs, parent)  # the second: generated, then run
    assert callable(plan.__dict__["_fast"])
    return loop, fast


def test_generated_run_equals_the_loop_on_a_hand_built_plan():
    add = _Fn(lambda a, b: a + b)
    split = _Fn(lambda a: (a[:1], None, np.float32(a.sum())), outputs=3)
    scalar = _Fn(lambda a: np.float64(a.max()))  # a numpy scalar: stored as a 0-d array
    plan = _plan([(add, ["x", "w"], ["t"]), (split, ["t"], ["h", "", "s"]), (scalar, ["t"], ["m"]),
                  (_Fn(lambda h, s, m, o: h * s + m + (0 if o is None else 1)), ["h", "s", "m", ""], ["y"])],
                 ["x"], ["y", "m", "t"], {"w": np.arange(3, dtype=np.float32)})
    x = np.ones(3, np.float32)
    loop, fast = _both(plan, [x])
    assert len(loop) == len(fast) == 3
    for a, b in zip(loop, fast):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert fast[1].__class__ is np.ndarray and fast[1].ndim == 0


def test_a_value_is_freed_at_its_last_use():
    """The intermediate ``t`` dies after its last reader, before the plan's last step runs."""
    seen = {}

    def make(x):
        t = np.full(1000, 2.0)
        seen["ref"] = weakref.ref(t)
        return t

    def last(u):
        gc.collect()
        seen["alive_at_last_step"] = seen["ref"]() is not None
        return u + 1

    plan = _plan([(_Fn(make), ["x"], ["t"]), (_Fn(lambda t: t.sum(keepdims=True)), ["t"], ["u"]),
                  (_Fn(last), ["u"], ["y"])], ["x"], ["y"])
    for _ in range(3):
        run_plan(plan, [np.zeros(1)])
    assert callable(plan.__dict__["_fast"]) and seen["alive_at_last_step"] is False


def test_a_kernel_patched_after_compilation_is_called_and_errors_name_the_step():
    k = _Fn(lambda a: a * 2)
    plan = _plan([(_Fn(lambda a: a + 1), ["x"], ["t"]), (k, ["t"], ["y"])], ["x"], ["y"])
    _both(plan, [np.zeros(2)])
    k.run = lambda a: (a * 3,)  # on the instance, after the function was generated
    np.testing.assert_array_equal(run_plan(plan, [np.ones(2)])[0], [6.0, 6.0])

    def boom(a):
        raise ValueError("bad value")

    k.run = boom
    plan.__dict__["_fast"] = _program._DECLINED
    with pytest.raises(RuntimeFailure) as loop_err:
        run_plan(plan, [np.ones(2)])
    plan.__dict__.pop("_fast")
    for _ in range(2):
        with pytest.raises(RuntimeFailure) as fast_err:
            run_plan(plan, [np.ones(2)])
    assert callable(plan.__dict__["_fast"])
    assert str(fast_err.value) == str(loop_err.value) and "node 'n1' (Custom)" in str(fast_err.value)
    assert isinstance(fast_err.value.__cause__, ValueError)

    class Miss(RuntimeFailure):
        pass

    def miss(a):
        raise Miss("passed through")

    k.run = miss
    with pytest.raises(Miss, match="passed through"):
        run_plan(plan, [np.ones(2)])


def test_outer_names_come_from_the_enclosing_frame():
    plan = _plan([(_Fn(lambda a, o: a + o), ["x", "outer"], ["y"])], ["x"], ["y", "outer2"])
    parent = Frame({"outer": np.float32(5), "outer2": np.arange(2)}, None)
    loop, fast = _both(plan, [np.ones(2, np.float32)], parent)
    np.testing.assert_array_equal(loop[0], fast[0])
    assert fast[1] is parent.values["outer2"]


def test_frame_steps_read_their_subgraphs_names_as_the_loop_does():
    """A control-flow step (called with its frame) runs in the generated function: its frame holds
    the plan's live values and constants its subgraphs read (Step.implicit), the enclosing frame
    the rest; what it reads equals the loop's frame, and its outputs."""
    seen = []

    class FrameKernel:
        call_mode = "frame"

        def run_in_frame(self, frame, a):
            got = {n: frame.get(n) for n in ("t", "c", "outer")}
            seen.append(got)
            return (a + got["t"] + got["c"] + got["outer"],)

    steps = [(_Fn(lambda a: a * 2), ["x"], ["t"]), (FrameKernel(), ["x"], ["y"])]
    made = [Step(helper.make_node("Custom", ins, outs, name=f"n{k}"), kern, tuple(ins), tuple(outs),
                 implicit=("t", "c", "outer") if k == 1 else ())
            for k, (kern, ins, outs) in enumerate(steps)]
    consts = {"c": np.float32(3)}
    made = schedule(made, ["x"], ["y"], consts)
    plan = Plan("g", "g", ("x",), ("y",), consts, tuple(made))
    parent = Frame({"outer": np.float32(10), "t": np.float32(-100)}, None)  # the plan's own t wins
    loop, fast = _both(plan, [np.ones(2, np.float32)], parent)
    np.testing.assert_array_equal(loop[0], fast[0])
    np.testing.assert_array_equal(fast[0], [16.0, 16.0])
    assert all(np.array_equal(v, seen[0][n]) for got in seen[1:] for n, v in got.items())
    # A step called with the run's whole context (the onnx.reference fallback): declined.

    class ContextKernel:
        call_mode = "context"

        def run(self, a, context=None):
            return (a,)

    plan = _plan([(ContextKernel(), ["x"], ["y"])], ["x"], ["y"])
    with pytest.raises(_codegen.Declined):
        _codegen.generate(plan, _program.store, _program.missing_outputs, _program.step_failure, Frame)
    for _ in range(3):
        np.testing.assert_array_equal(run_plan(plan, [np.ones(1)])[0], [1.0])
    assert plan.__dict__["_fast"] is _program._DECLINED
    # A subgraph reading a name of the plan after its release: declined (the loop's frame would
    # not hold it there).
    made = [Step(helper.make_node("Custom", ["x"], ["t"], name="a"), _Fn(lambda a: a), ("x",), ("t",), release=("t",)),
            Step(helper.make_node("Custom", ["x"], ["y"], name="b"), FrameKernel(), ("x",), ("y",), implicit=("t",))]
    with pytest.raises(_codegen.Declined, match="subgraphs"):
        _codegen.generate(Plan("g", "g", ("x",), ("y",), {}, tuple(made)), _program.store, _program.missing_outputs,
                          _program.step_failure, Frame)
    # A name read after its release (not produced by a valid graph, but the loop then looks it up
    # in the enclosing frames): declined.
    steps = (Step(helper.make_node("Custom", ["x"], ["t"], name="a"), _Fn(lambda a: a), ("x",), ("t",), release=("t",)),
             Step(helper.make_node("Custom", ["t"], ["y"], name="b"), _Fn(lambda a: a), ("t",), ("y",)))
    odd = Plan("g", "g", ("x",), ("y",), {}, steps)
    with pytest.raises(_codegen.Declined):
        _codegen.generate(odd, _program.store, _program.missing_outputs, _program.step_failure)
    # A plan longer than MAX_STEPS: declined (the loop runs it; no seconds-long generation).
    long = _plan([(_Fn(lambda a: a), ["x"], ["t0"])] + [(_Fn(lambda a: a), [f"t{k}"], [f"t{k + 1}"]) for k in range(9)],
                 ["x"], ["t9"])
    import unittest.mock

    with unittest.mock.patch.object(_codegen, "MAX_STEPS", 5), pytest.raises(_codegen.Declined, match="more than 5"):
        _codegen.generate(long, _program.store, _program.missing_outputs, _program.step_failure)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "subgraphs", "shared_weight", "fp16_mlp"])
def test_sample_models_run_the_same_generated_and_looped(name, monkeypatch):
    """Every sample model (control flow included: its If/Loop bodies are plans run by their
    kernels) gives bit for bit the loop's outputs on its later runs."""
    path = str(MODELS / f"{name}.onnx")
    so = onnxpack.SessionOptions()
    if name == "subgraphs":
        # Unspecialized: the If on the ``cond`` input runs its branches (specialized, it would be
        # inlined, and the branches' plans would not run at all).
        so.add_session_config_entry("onnxpack.specialize_shapes", "0")
    sess = onnxpack.InferenceSession(path, so)
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in i.shape]
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                 "tensor(bool)": np.bool_}[i.type]
        feeds[i.name] = (rng.standard_normal(shape) if dtype != np.bool_ else rng.random(shape) > 0.5).astype(dtype)
    generated = [sess.run(None, feeds) for _ in range(4)][-1]
    plans = list(sess.program.plans.values())
    if sess._runner.specializer is not None:
        plans += [p for p in sess._runner.specializer._plans.values() if isinstance(p, Plan)]
    assert any(callable(p.__dict__.get("_fast")) for p in plans)
    monkeypatch.setattr(_program, "_generated", lambda plan, runs: _program._DECLINED)
    looped = onnxpack.InferenceSession(path, so).run(None, feeds)
    assert len(generated) == len(looped)
    for a, b in zip(generated, looped):
        np.testing.assert_array_equal(a, b)


def test_a_plan_of_no_steps_and_a_generator_failure():
    """A branch that only passes a value through (no steps) runs generated; a bug in the generator
    is never a run's failure: a warning, then the loop."""
    x = np.ones(2)
    empty = Plan("g", "g", ("x",), ("x",), {}, ())
    for _ in range(3):
        assert run_plan(empty, [x])[0] is x
    assert callable(empty.__dict__["_fast"])
    plan = _plan([(_Fn(lambda a: a + 1), ["x"], ["y"])], ["x"], ["y"])

    def broken(*a):
        raise TypeError("generator bug")

    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("onnxpack.session._program").addHandler(handler)
    try:
        original = _codegen.generate
        _codegen.generate = broken
        try:
            for _ in range(3):
                np.testing.assert_array_equal(run_plan(plan, [x])[0], [2.0, 2.0])
        finally:
            _codegen.generate = original
    finally:
        logging.getLogger("onnxpack.session._program").removeHandler(handler)
    assert plan.__dict__["_fast"] is _program._DECLINED
    assert any("generator bug" in r.getMessage() for r in records)


def test_a_dropped_session_frees_its_kernels_without_the_cyclic_collector():
    """The generated function holds the plan's kernels and constants; it must not keep them alive
    past the session (no reference cycle: freed by reference counting, as with the loop)."""
    import gc

    path = str(MODELS / "mlp.onnx")
    enabled = gc.isenabled()
    gc.disable()
    try:
        sess = onnxpack.InferenceSession(path)
        x = np.zeros([d if isinstance(d, int) else 1 for d in sess.get_inputs()[0].shape], np.float32)
        for _ in range(3):
            sess.run(None, {sess.get_inputs()[0].name: x})
        assert callable(sess.program.root.__dict__.get("_fast"))
        kernel = weakref.ref(sess.program.root.steps[0].kernel)
        sess.close()
        del sess
        assert kernel() is None
    finally:
        if enabled:
            gc.enable()
