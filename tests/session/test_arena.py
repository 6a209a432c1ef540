"""The run-time memory planner: planned runs equal unplanned runs bit for bit.

Oracles: the same session run with ``onnxpack.memory_planner=none`` (bit for bit), and
``onnx.reference`` for the small adversarial graphs built here (aliasing views, outputs that view
intermediates, values read far apart, a subgraph returning an outer value).
"""

from __future__ import annotations

import functools
import glob
import os
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxpack_sample_models as sample_models  # models/build.py, via tests/conftest.py
from onnxpack import InferenceSession, SessionOptions
from onnxpack.session import planner
from onnxpack.session.kernels import lookup
from onnxpack.session.kernels._base import KernelContext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE_MODELS = sorted(glob.glob(os.path.join(ROOT, "models", "*.onnx")))
ALGORITHMS = ["naive", "greedy_by_size", "position_greedy", "auto"]
F32 = np.float32


def _session(model, algorithm: str = "none") -> InferenceSession:
    # One thread: a GEMM split over threads (its blocks, and whether it splits, tuned per call) may
    # round differently from the whole product where OpenBLAS's kernel for a block's size differs
    # (its Haswell kernels on an AMD Zen 5 VM: a row or column block of a product is not bit for
    # bit the whole's); bit-for-bit runs are this test's yardstick.
    opts = SessionOptions()
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("onnxpack.memory_planner", algorithm)
    return InferenceSession(model, opts)


def _feeds(sess: InferenceSession, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    types = {"tensor(float)": F32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}
    feeds = {}
    for arg in sess.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in (arg.shape or [])]
        dt = types[arg.type]
        if dt == np.bool_:
            feeds[arg.name] = rng.random(shape) > 0.5
        elif np.dtype(dt).kind == "i":
            feeds[arg.name] = rng.integers(0, 3, shape).astype(dt)
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(dt)
    return feeds


def _assert_same(want, got, what: str) -> None:
    assert len(want) == len(got), what
    for k, (a, b) in enumerate(zip(want, got)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: output {k}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{what}: output {k} differs"


# --------------------------------------------------------------------------------------------
# Sample models and light models


@functools.lru_cache(maxsize=None)
def _reference(model_key: str):
    model = _load(model_key)
    sess = _session(model)
    feeds = [_feeds(sess, seed) for seed in (0, 1)]
    return model, feeds, [sess.run(None, f) for f in feeds]


@functools.lru_cache(maxsize=None)
def _load(model_key: str):
    if model_key.startswith("light_"):
        # Real random weights make every channel differ, so a wrong arena offset shows.
        return sample_models.materialize_light_model(model_key, expose_logits=False).SerializeToString()
    return model_key


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("path", SAMPLE_MODELS, ids=[os.path.basename(p) for p in SAMPLE_MODELS])
def test_sample_models_planned_equal_unplanned(path, algorithm):
    model, feeds, want = _reference(path)
    sess = _session(model, algorithm)
    # Run 1 records, runs 2.. are planned; alternate inputs so stale arena bytes would show.
    for r in range(4):
        _assert_same(want[r % 2], sess.run(None, feeds[r % 2]), f"{path} {algorithm} run {r}")
    plan = sess.get_memory_plan()
    assert plan is not None and plan["planned_steps"] > 0  # the planned path really ran


LIGHT_CASES = [
    ("light_squeezenet", "naive"),
    ("light_squeezenet", "greedy_by_size"),
    ("light_squeezenet", "position_greedy"),
    ("light_shufflenet", "auto"),
    ("light_inception_v1", "auto"),
    ("light_resnet50", "greedy_by_size"),
]


@pytest.mark.parametrize(("name", "algorithm"), LIGHT_CASES, ids=[f"{n}-{a}" for n, a in LIGHT_CASES])
def test_light_models_planned_equal_unplanned(name, algorithm):
    if not os.path.exists(os.path.join(sample_models.LIGHT_DIR, name + ".onnx")):
        pytest.skip(f"{name} is not shipped with this onnx")
    model, feeds, want = _reference(name)
    sess = _session(model, algorithm)
    for r in range(3):
        _assert_same(want[r % 2], sess.run(None, feeds[r % 2]), f"{name} {algorithm} run {r}")
    plan = sess.get_memory_plan()
    assert plan["planned_steps"] > 0 and plan["total_size"] > 0


# --------------------------------------------------------------------------------------------
# Adversarial graphs (oracle: onnx.reference)


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _check_against_reference(model: bytes, feeds_list, algorithm="greedy_by_size"):
    ref = ReferenceEvaluator(onnx.load_from_string(model))
    unplanned = _session(model)
    sess = _session(model, algorithm)
    kept = []
    for r, feeds in enumerate(feeds_list):
        want = unplanned.run(None, feeds)
        got = sess.run(None, feeds)
        _assert_same(want, got, f"run {r}")
        for a, b in zip(ref.run(None, feeds), got):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        kept.append((want, got))
    # Results handed out earlier are the user's: later runs (reusing the arena) never touch them.
    for r, (want, got) in enumerate(kept):
        _assert_same(want, got, f"kept result of run {r}")
    return sess


def _xs(shape, n=4):
    rng = np.random.default_rng(7)
    return [{"x": rng.standard_normal(shape).astype(F32)} for _ in range(n)]


def test_reshape_of_value_still_used_later():
    # a is viewed by r (Reshape) whose last use comes after a's last direct use: the view must
    # keep a's bytes alive, or b/c would be written over them.
    nodes = [
        helper.make_node("Add", ["x", "x"], ["a"]),
        helper.make_node("Reshape", ["a", "s1"], ["r"]),
        helper.make_node("Mul", ["a", "a"], ["b"]),
        helper.make_node("Relu", ["b"], ["c"]),
        helper.make_node("Sigmoid", ["c"], ["c2"]),
        helper.make_node("Tanh", ["c2"], ["c3"]),
        helper.make_node("Reshape", ["r", "s2"], ["r2"]),
        helper.make_node("Add", ["r2", "c3"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", [4, 6])], [_vi("y", [4, 6])], [_i64("s1", [24]), _i64("s2", [4, 6])])
    sess = _check_against_reference(model, _xs((4, 6)))
    plan = sess.get_memory_plan()
    life = {t["name"]: t for t in plan["tensors"]}
    assert life["a"]["last"] >= 6  # extended to r2's use at step 6 (the last Reshape)


def test_outputs_that_view_intermediates_and_identity_chains():
    nodes = [
        helper.make_node("Add", ["x", "x"], ["a"]),
        helper.make_node("Mul", ["x", "x"], ["m"]),
        helper.make_node("Reshape", ["a", "s"], ["y_view"]),  # output = view of an intermediate
        helper.make_node("Identity", ["m"], ["i1"]),
        helper.make_node("Identity", ["i1"], ["i2"]),
        helper.make_node("Identity", ["i2"], ["y_id"]),  # Identity chain to a graph output
        helper.make_node("Transpose", ["a"], ["t"], perm=[1, 0]),  # a numpy view, not a Reshape
        helper.make_node("Neg", ["t"], ["y_t"]),
        helper.make_node("Exp", ["m"], ["y_e"]),
    ]
    outs = [_vi("y_view", [24]), _vi("y_id", [4, 6]), _vi("y_t", [6, 4]), _vi("y_e", [4, 6])]
    model = _model(nodes, [_vi("x", [4, 6])], outs, [_i64("s", [24])])
    sess = _check_against_reference(model, _xs((4, 6)))
    planned = {t["name"] for t in sess.get_memory_plan()["tensors"]}
    # a and m are viewed by graph outputs: planning them would hand the user arena bytes.
    assert not planned & {"a", "m", "y_view", "y_id", "y_t", "y_e"}


def test_intermediate_read_by_two_consumers_far_apart():
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Relu", ["a"], ["h0"])]
    for k in range(12):
        op = ("Sigmoid", "Tanh", "Neg")[k % 3]
        nodes.append(helper.make_node(op, [f"h{k}"], [f"h{k + 1}"]))
    nodes.append(helper.make_node("Mul", ["h12", "a"], ["y"]))
    model = _model(nodes, [_vi("x", [8, 16])], [_vi("y", [8, 16])])
    sess = _check_against_reference(model, _xs((8, 16)))
    plan = sess.get_memory_plan()
    life = {t["name"]: t for t in plan["tensors"]}
    assert (life["a"]["first"], life["a"]["last"]) == (0, 14)
    assert plan["total_size"] < sum(t["size"] for t in plan["tensors"])  # slots were reused


def test_split_and_slice_views_of_a_value_reused():
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["a"]),
        helper.make_node("Split", ["a", "sp"], ["p", "q"], axis=1),
        helper.make_node("Slice", ["a", "st", "en", "ax"], ["sl"]),
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("Sigmoid", ["e"], ["e2"]),
        helper.make_node("Add", ["p", "q"], ["pq"]),
        helper.make_node("Concat", ["pq", "sl"], ["cat"], axis=1),
        helper.make_node("Concat", ["e2", "cat"], ["y"], axis=1),
    ]
    inits = [_i64("sp", [3, 3]), _i64("st", [1]), _i64("en", [3]), _i64("ax", [1])]
    model = _model(nodes, [_vi("x", [4, 6])], [_vi("y", [4, 6 + 3 + 2])], inits)
    _check_against_reference(model, _xs((4, 6)))


def test_subgraph_returning_an_outer_intermediate():
    then_g = helper.make_graph([helper.make_node("Identity", ["a"], ["o"])], "then", [], [_vi("o", [4, 6])])
    else_g = helper.make_graph([helper.make_node("Neg", ["a"], ["o2"])], "else", [], [_vi("o2", [4, 6])])
    nodes = [
        helper.make_node("Add", ["x", "x"], ["a"]),
        helper.make_node("If", ["cond"], ["i"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Exp", ["x"], ["b"]),
        helper.make_node("Sigmoid", ["b"], ["b2"]),
        helper.make_node("Add", ["i", "b2"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", [4, 6]), _vi("cond", [], TensorProto.BOOL)], [_vi("y", [4, 6])])
    feeds = [dict(f, cond=np.array(k % 2 == 0)) for k, f in enumerate(_xs((4, 6)))]
    _check_against_reference(model, feeds)


def test_data_dependent_intermediate_shapes_with_one_signature():
    # The input signature is the same every run, but the Reshape target (an input) changes the
    # shapes downstream: steps whose inputs differ from the recording must not use the arena.
    nodes = [
        helper.make_node("Add", ["x", "x"], ["a"]),
        helper.make_node("Reshape", ["a", "shape"], ["r"]),
        helper.make_node("Relu", ["r"], ["b"]),
        helper.make_node("ReduceSum", ["b"], ["s"], keepdims=0),
        helper.make_node("Exp", ["b"], ["e"]),
        helper.make_node("ReduceSum", ["e"], ["s2"], keepdims=0),
        helper.make_node("Add", ["s", "s2"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", [4, 6]), _vi("shape", [2], TensorProto.INT64)], [_vi("y", [])], opset=12)
    rng = np.random.default_rng(3)
    feeds = [
        {"x": rng.standard_normal((4, 6)).astype(F32), "shape": np.array(s, dtype=np.int64)}
        for s in ([4, 6], [6, 4], [2, 12], [4, 6], [24, 1])
    ]
    _check_against_reference(model, feeds)


# --------------------------------------------------------------------------------------------
# Concurrency


def test_concurrent_runs_equal_serial_results():
    path = os.path.join(ROOT, "models", "transformer.onnx")
    sess = _session(path, "auto")
    base = _session(path)
    feeds = [_feeds(base, seed) for seed in range(6)]
    want = [base.run(None, f) for f in feeds]
    sess.run(None, feeds[0])  # record and plan
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def worker(k: int) -> None:
        try:
            barrier.wait()
            for r in range(15):
                j = (k + r) % len(feeds)
                _assert_same(want[j], sess.run(None, feeds[j]), f"thread {k} run {r}")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_runs_hold_distinct_arenas():
    from onnxpack.session._arena import _SignaturePlan

    path = os.path.join(ROOT, "models", "mlp.onnx")
    sess = _session(path, "greedy_by_size")
    feeds = _feeds(sess)
    sess.run(None, feeds)
    (sp,) = [p for p in sess._runner.arena._plans.values() if isinstance(p, _SignaturePlan)]
    a, b = sp.acquire(), sp.acquire()  # two runs in flight
    assert not np.shares_memory(a.buffers[0], b.buffers[0])
    sp.release(a)
    sp.release(b)
    out = sess.run(None, feeds)
    for arena in sp._pool:
        assert not any(np.shares_memory(o, arena.buffers[0]) for o in out)


# --------------------------------------------------------------------------------------------
# get_memory_plan


def test_get_memory_plan_consistent_with_validate():
    path = os.path.join(ROOT, "models", "transformer.onnx")
    assert _session(path).get_memory_plan() is None  # planner off
    sess = _session(path, "auto")
    assert sess.get_memory_plan() is None  # nothing run yet
    feeds = _feeds(sess)
    sess.run(None, feeds)
    plan = sess.get_memory_plan()
    lifetimes = [planner.TensorLifetime(**t) for t in plan["lifetimes"]]
    config = planner.MemoryConfig(tuple(planner.Memory(m["name"], m["capacity"], m["alignment"]) for m in plan["memories"]))
    placements = tuple(
        planner.Placement(t["name"], t["memory"], t["offset"], t["size"], t["first"], t["last"]) for t in plan["tensors"]
    )
    result = planner.PlanResult(
        plan["algorithm"], placements, {m["name"]: m["arena_size"] for m in plan["memories"]},
        plan["lower_bound"], plan["lower_bound_step"], {m["name"]: m["peak"] for m in plan["memories"]},
        {m["name"]: m["peak_step"] for m in plan["memories"]}, config,
    )
    planner.validate(result, lifetimes, config)
    align = config.memories[0].alignment
    assert (plan["lower_bound"], plan["lower_bound_step"]) == planner.lower_bound(lifetimes, align)
    assert plan["total_size"] == sum(m["arena_size"] for m in plan["memories"]) >= plan["lower_bound"]
    assert plan["algorithm"] in plan["candidates"] and min(plan["candidates"].values()) == plan["total_size"]
    outputs = {o.name for o in sess.get_outputs()}
    for t in plan["tensors"]:
        assert t["name"] not in outputs
        assert t["size"] >= t["nbytes"] == int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize
    assert [s["shape"] for s in plan["signature"]] == [list(v.shape) for v in feeds.values()]
    assert sess.get_memory_plan({n: v.shape for n, v in feeds.items()}) == plan


# --------------------------------------------------------------------------------------------
# run_into == run, bit for bit, kernel by kernel


_INTO_CASES = [
    ("Add", 2), ("Sub", 2), ("Mul", 2), ("Div", 2), ("Equal", 2), ("Greater", 2),
    ("Relu", 1), ("Neg", 1), ("Exp", 1), ("Log", 1), ("Sqrt", 1), ("Tanh", 1), ("Abs", 1), ("IsNaN", 1),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32], ids=str)
@pytest.mark.parametrize(("op", "arity"), _INTO_CASES, ids=[c[0] for c in _INTO_CASES])
def test_run_into_equals_run(op, arity, dtype):
    cls = lookup("", op, 17)
    kernel = cls(helper.make_node(op, ["a", "b"][:arity], ["y"]), KernelContext(17, {"": 17}))
    rng = np.random.default_rng(0)
    shapes = [((3, 5), (5,)), ((), ()), ((2, 1, 4), (3, 1))]
    for sa, sb in shapes:
        args = [np.asarray(rng.standard_normal(s) * 4).astype(dtype) for s in (sa, sb)[:arity]]
        if np.dtype(dtype).kind == "i" and op == "Div":
            args[1] = np.where(args[1] == 0, 1, args[1]).astype(dtype)
        with np.errstate(all="ignore"):
            (want,) = kernel.run(*args)
        out = np.full(want.shape, 7, dtype=want.dtype)
        done = kernel.run_into((out,), *args)
        if done is False:
            continue
        assert np.array_equal(out, want, equal_nan=True), (op, dtype, sa, sb)


def test_softmax_run_into_equals_run():
    cls = lookup("", "Softmax", 13)
    rng = np.random.default_rng(0)
    for axis in (-1, 0, 1):
        kernel = cls(helper.make_node("Softmax", ["x"], ["y"], axis=axis), KernelContext(13, {"": 13}))
        for dtype in (np.float32, np.float16):
            x = rng.standard_normal((3, 4, 5)).astype(dtype)
            (want,) = kernel.run(x)
            out = np.empty_like(want)
            assert kernel.run_into((out,), x) is True
            assert np.array_equal(out, want)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=str)
def test_matmul_run_into_equals_run(packed, dtype):
    cls = lookup("", "MatMul", 13)
    rng = np.random.default_rng(0)
    for sa in [(7,), (5, 7), (2, 3, 7), (0, 7)]:
        kernel = cls(helper.make_node("MatMul", ["a", "b"], ["y"]), KernelContext(13, {"": 13}))
        a = rng.standard_normal(sa).astype(dtype)
        b = rng.standard_normal((7, 6)).astype(dtype)
        if packed:
            kernel.use_prepacked(1, kernel.prepack(1, b))
        (want,) = kernel.run(a, None if packed else b)
        out = np.full(want.shape, 7, dtype=want.dtype)
        done = kernel.run_into((out,), a, None if packed else b)
        if np.dtype(dtype) == np.float16 or want.size == 0:
            assert done is False  # widened and cast back, or empty: left to run
            continue
        assert done is True and np.array_equal(out, want), (sa, dtype)
