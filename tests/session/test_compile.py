"""The compile step and the kernel resolver on their own: no InferenceSession involved."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxpack.errors import InvalidGraph, KernelNotFoundError
from onnxpack.graph import load_model
from onnxpack.prepack import PackSources, PrepackedWeightsContainer
from onnxpack.session import CompileOptions, PrepackStats, compile, run_plan
from onnxpack.session._fusion import Fusion
from onnxpack.session._program import PackEvent, Step, schedule, topological_order
from onnxpack.session._resolve import Deferred, resolve
from onnxpack.session.kernels import KernelContext
from onnxpack.session.kernels.control import If
from onnxpack.session.kernels.conv import FusedConv
from onnxpack.session.kernels._act import Activation
from onnxpack.session.kernels.elementwise import ActAfter

F = TensorProto.FLOAT
RNG = np.random.default_rng(3)


def _mlp() -> bytes:
    w1 = RNG.standard_normal((8, 16)).astype(np.float32)
    w2 = RNG.standard_normal((16, 4)).astype(np.float32).astype(np.float16)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Cast", ["W2"], ["W2f"], name="cast", to=F),
        helper.make_node("MatMul", ["a", "W2f"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", F, [2, 8])],
                              [helper.make_tensor_value_info("y", F, [2, 4])],
                              [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _compile(model_bytes: bytes, container=None, holder=1, **options):
    model = load_model(model_bytes)
    container = container if container is not None else PrepackedWeightsContainer()
    return model, compile(model, CompileOptions(**options), PackSources(model), container, holder), container


def test_program_is_frozen_runs_like_the_reference_and_logs_every_pack():
    data = _mlp()
    model, program, container = _compile(data)
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.root = None  # type: ignore[misc]
    # Cast(W2) is a constant expression (_derive.py): fc2 packs the cast weight itself, and the
    # Cast node, read by nobody unpacked, is dropped without packing anything; MatMul -> Relu runs
    # as one fused step named after the MatMul (session/_fusion.py).
    assert [s.node.name for s in program.root.steps] == ["fc1", "fc2"]
    assert {(e.node, e.input, e.weight.name, e.origin) for e in program.pack_log} == {
        ("fc1", 1, "W1", "packed"), ("fc2", 1, "W2", "packed")}
    # Both originals are packed and read by nothing else: neither stays a constant.
    assert dict(program.root.constants) == {}
    assert program.stats == PrepackStats.from_log(program.pack_log, rejected=0, released=2)
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    (got,) = run_plan(program.root, [x])
    (want,) = ReferenceEvaluator(onnx.load_from_string(data)).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    model.close()


def test_second_compile_on_one_container_takes_every_pack_from_it():
    data = _mlp()
    container = PrepackedWeightsContainer()
    _m1, first, _ = _compile(data, container, holder=1)
    _m2, second, _ = _compile(data, container, holder=2)
    assert {e.origin for e in second.pack_log} == {"container"}
    assert [e.entry.key for e in second.pack_log] == [e.entry.key for e in first.pack_log]
    assert second.stats.weights_packed == 0 and second.stats.blobs_from_container == 2
    container.release(1)
    assert len(container) == 2
    container.release(2)
    assert len(container) == 0


def test_without_prepacking_originals_stay_and_nothing_is_logged():
    _model, program, container = _compile(_mlp(), prepack=False)
    assert program.pack_log == () and len(container) == 0
    assert set(program.root.constants) == {"W1", "W2"}


def test_not_runnable_builds_no_reference_evaluator():
    node = helper.make_node("Det", ["x"], ["y"], name="det")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, [3, 3])],
                              [helper.make_tensor_value_info("y", F, [])])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    _model, program, _ = _compile(data, runnable=False)
    (step,) = program.root.steps
    assert isinstance(step.kernel, Deferred)
    assert program.fallback_nodes == ("main:det:Det",)
    _model, program, _ = _compile(data)
    assert not isinstance(program.root.steps[0].kernel, Deferred)


def test_schedule_releases_after_last_reader_and_keeps_outputs_and_constants():
    def step(name, inputs, outputs):
        return Step(helper.make_node("Identity", inputs, outputs, name=name), None, tuple(inputs), tuple(outputs))

    steps = [step("a", ["x"], ["t"]), step("b", ["t", "c"], ["u"]), step("c", ["u", "t"], ["y", "unused"])]
    out = schedule(steps, ["x"], ["y"], {"c": 1})
    assert [sorted(s.release) for s in out] == [["x"], [], ["t", "u", "unused"]]


def test_topological_order_rejects_cycles_and_double_producers():
    a = helper.make_node("Relu", ["b"], ["a"], name="A")
    b = helper.make_node("Relu", ["a"], ["b"], name="B")
    with pytest.raises(InvalidGraph, match="cycle"):
        topological_order([a, b], lambda n: False, "g")
    c = helper.make_node("Relu", ["x"], ["a"], name="C")
    with pytest.raises(InvalidGraph, match="produced by two nodes"):
        topological_order([a, c], lambda n: n == "x", "g")
    with pytest.raises(InvalidGraph, match="not a graph input"):
        topological_order([c], lambda n: False, "g")
    assert topological_order([b, c], lambda n: n == "x", "g") == [1, 0]


def test_topological_order_known_names_and_the_first_missing_read():
    # ``known`` names are defined before any node runs without asking ``available``; a graph out
    # of order is sorted depth-first; a name nobody defines is reported at the first node reading
    # one, whether the listed order held up to there or not.
    a = helper.make_node("Add", ["x", "w"], ["a"], name="A")
    b = helper.make_node("Relu", ["c"], ["b"], name="B")  # reads C's output, listed after it
    c = helper.make_node("Add", ["a", "w"], ["c"], name="C")

    def available(n):
        assert n != "w", "a known name was asked about"
        return n == "x"

    assert topological_order([a, c, b], available, "g", None, {"w"}) == [0, 1, 2]
    assert topological_order([a, b, c], available, "g", None, {"w"}) == [0, 2, 1]
    assert topological_order([a, b, c], available, "g", [["x", "w"], ["c", "x"], ["a"]], {"w"}) == [0, 2, 1]
    d = helper.make_node("Relu", ["nowhere"], ["d"], name="D")
    for nodes in ([a, c, b, d], [a, b, c, d], [d, a, b, c]):
        with pytest.raises(InvalidGraph, match="node 'D' \\(Relu\\) uses 'nowhere'"):
            topological_order(nodes, available, "g", None, {"w"})
    with pytest.raises(InvalidGraph, match="uses 'w'"):
        topological_order([a], lambda n: n == "x", "g")
    # A known name that a node produces too is that node's output: its readers come after it.
    e = helper.make_node("Relu", ["x"], ["w"], name="E")
    assert topological_order([a, e], lambda n: n == "x", "g", None, {"w"}) == [1, 0]


def _ctx(**kw):
    return KernelContext(opset=17, opsets={"": 17}, **kw)


def test_resolver_picks_native_control_flow_fused_epilogue_and_fallback():
    assert type(resolve(helper.make_node("Relu", ["x"], ["y"]), _ctx()).kernel).__name__ == "Relu"
    then = helper.make_graph([], "t", [], [])
    if_node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=then)
    branch = type("Branch", (), {"output_names": ("y",), "output_types": (1,)})()
    r = resolve(if_node, _ctx(subgraphs={"then_branch": branch, "else_branch": branch}))
    assert isinstance(r.kernel, If) and r.kernel.call_mode == "frame" and not r.fallback
    other = type("Branch", (), {"output_names": ("y",), "output_types": (7,)})()
    with pytest.raises(InvalidGraph, match="else_branch"):  # branches disagree on the dtype
        resolve(if_node, _ctx(subgraphs={"then_branch": branch, "else_branch": other}))
    # A node holding a graph whose native kernel does not run graphs goes to the fallback.
    odd = helper.make_node("Relu", ["x"], ["y"], body=then)
    assert resolve(odd, _ctx()).fallback
    # A model-local function of the same name wins over the native kernel.
    assert resolve(helper.make_node("Relu", ["x"], ["y"]), _ctx(), local_functions={("", "Relu")}).fallback
    conv = helper.make_node("Conv", ["x", "W"], ["y"], name="c")
    fused = resolve(conv, _ctx(), fusion=Fusion(conv, 0, (1,), kernel="conv",
                                                params={"multiplier": None, "shift": None, "relu": True}))
    assert isinstance(fused.kernel, FusedConv) and fused.kernel.relu
    add = helper.make_node("Add", ["a", "b"], ["y"], name="add+relu")
    epi = resolve(add, _ctx(), fusion=Fusion(add, 0, (1,), epilogue=(Activation("relu"),)))
    assert isinstance(epi.kernel, ActAfter) and epi.kernel.writes_into == epi.kernel.inner.writes_into
    assert epi.kernel.acts == (Activation("relu"),)
    with pytest.raises(KernelNotFoundError):
        resolve(helper.make_node("NoSuchOp", ["x"], ["y"], domain="nowhere"), KernelContext(17, {"": 17, "nowhere": 1}))


def test_resolver_turns_a_kernel_crash_on_attributes_into_invalid_graph():
    bad = helper.make_node("Transpose", ["x"], ["y"], perm="not ints")
    with pytest.raises(InvalidGraph, match="Transpose"):
        resolve(bad, _ctx())


def test_stats_are_derived_from_the_log_alone():
    from onnxpack.prepack import PackSpec, PrePackedWeights, WeightRef

    w = WeightRef("", "W", None, np.zeros(4, np.float32))

    def event(origin, key, nbytes, seconds=0.0):
        entry = PrePackedWeights(key, (np.zeros(nbytes, np.uint8),), origin)
        return PackEvent("", "n", "MatMul", 1, w, PackSpec("matmul", 1), entry, origin, seconds)

    log = [event("packed", "a", 10, 0.5), event("model", "b", 20), event("cache", "c", 30),
           event("container", "a", 10)]
    s = PrepackStats.from_log(log, rejected=2, released=1)
    assert (s.weights_packed, s.blobs_from_model, s.blobs_from_cache, s.blobs_from_container) == (1, 1, 1, 1)
    assert (s.bytes_packed, s.bytes_mapped, s.bytes_held, s.seconds_packing) == (10, 50, 60, 0.5)
    assert (s.blobs_rejected, s.originals_released) == (2, 1)


def test_constant_that_numpy_cannot_hold_is_a_clear_error():
    """A Reshape of an empty weight to dimensions whose product overflows numpy's size limit (a
    valid ONNX shape of 0 elements; found by the reliability fuzzer) is folded at creation: the
    failure is an onnxpack error naming the value, not numpy's ValueError."""
    from onnxpack.errors import OnnxpackError

    w = numpy_helper.from_array(np.zeros((0, 4), np.float32), "w")
    shape = numpy_helper.from_array(np.array([19, 562949953421312, 0, 1025], np.int64), "shape")
    nodes = [helper.make_node("Reshape", ["w", "shape"], ["r"], allowzero=1),
             helper.make_node("Identity", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", F, None)], [w, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    import onnxpack

    try:
        with onnxpack.InferenceSession(model.SerializeToString()) as s:
            s.run(None, {})
    except OnnxpackError as exc:
        assert "cannot" in str(exc) or "failed" in str(exc)
    else:
        raise AssertionError("an array numpy cannot hold was accepted")
