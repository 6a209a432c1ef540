"""InferenceSession's public API against onnxruntime's: NodeArgs, metadata, providers, options,
initializer overrides, output subsets, input validation, run-time and creation-time errors.

Oracle: onnxruntime 1.31 (the API we mirror) for NodeArg lists, metadata and numbers (float32
rtol 1e-4 / atol 1e-5); onnxruntime is also asked to reject each bad input we reject, so our
errors are not stricter than the API we copy — except where noted (unknown add_initializer
names, unknown providers and bad ``session.*`` values, which onnxruntime silently accepts).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack.errors import ConfigError, InvalidArgument, InvalidGraph, OnnxpackError, RuntimeFailure

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
F = TensorProto.FLOAT
TOL = dict(rtol=1e-4, atol=1e-5)


def _ort(model, so=None):
    so = so or ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _model(nodes, inputs, outputs, inits=(), *, opset=17, ir=9, **kw) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], **kw)
    m.ir_version = ir
    return m.SerializeToString()


def _symbolic_model() -> bytes:
    """Symbolic, unknown and fixed dims; an overridable initializer; metadata fields."""
    unknown = onnx.ValueInfoProto(name="z")
    unknown.type.tensor_type.elem_type = TensorProto.INT64
    unknown.type.tensor_type.shape.dim.add()  # neither value nor param: shape [None]
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
             helper.make_node("Identity", ["z"], ["z_out"], name="id")]
    m = onnx.load_from_string(_model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["batch", 3]), unknown,
         helper.make_tensor_value_info("W", F, [3, 4])],
        [helper.make_tensor_value_info("y", F, ["batch", 4]),
         helper.make_tensor_value_info("z_out", TensorProto.INT64, [None])],
        [w], producer_name="onnxpack-tests", doc_string="a model", domain="ai.test", model_version=7))
    m.graph.doc_string = "the graph"
    onnx.helper.set_model_props(m, {"author": "tests", "licence": "MIT"})
    return m.SerializeToString()


def _api_models():
    params = [pytest.param(str(p), id=p.stem) for p in sorted(MODELS.glob("*.onnx"))]
    params += [pytest.param(str(p), id=p.stem) for p in sorted(LIGHT_DIR.glob("light_*.onnx"))]
    params.append(pytest.param(_symbolic_model(), id="symbolic"))
    return params


def _args(nodeargs):
    return [(a.name, a.type, a.shape) for a in nodeargs]


@pytest.mark.parametrize("model", _api_models())
def test_nodeargs_and_metadata_equal_onnxruntime(model):
    """get_inputs/get_outputs/get_overridable_initializers and get_modelmeta, field by field.

    The light models are IR 3 (every initializer is also a graph input); onnxruntime treats
    those initializers as constants, not inputs nor overridable, and so must we.
    """
    theirs = _ort(model)
    with onnxpack.InferenceSession(model) as ours:
        assert _args(ours.get_inputs()) == _args(theirs.get_inputs())
        assert _args(ours.get_outputs()) == _args(theirs.get_outputs())
        assert _args(ours.get_overridable_initializers()) == _args(theirs.get_overridable_initializers())
        a, b = ours.get_modelmeta(), theirs.get_modelmeta()
        for field in ("producer_name", "graph_name", "domain", "description", "graph_description",
                      "version", "custom_metadata_map"):
            assert getattr(a, field) == getattr(b, field), field


def test_symbolic_dims_are_strings_and_none():
    with onnxpack.InferenceSession(_symbolic_model()) as s:
        (x, z) = s.get_inputs()
        assert (x.name, x.type, x.shape) == ("x", "tensor(float)", ["batch", 3])
        assert (z.name, z.type, z.shape) == ("z", "tensor(int64)", [None])
        (w,) = s.get_overridable_initializers()
        assert (w.name, w.shape) == ("W", [3, 4])
        # A symbolic dim accepts any size.
        for batch in (1, 5):
            x_val = np.ones((batch, 3), np.float32)
            y, zo = s.run(None, {"x": x_val, "z": np.arange(batch, dtype=np.int64)})
            np.testing.assert_allclose(y, x_val @ np.arange(12, dtype=np.float32).reshape(3, 4), **TOL)
            assert zo.tolist() == list(range(batch))


def test_overridable_initializer_feed_matches_onnxruntime():
    model = _symbolic_model()
    feeds = {"x": np.ones((2, 3), np.float32), "z": np.zeros(1, np.int64),
             "W": np.full((3, 4), 2.0, np.float32)}
    want = _ort(model).run(None, feeds)
    got = onnxpack.InferenceSession(model).run(None, feeds)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    del feeds["W"]  # the default value again
    np.testing.assert_allclose(onnxpack.InferenceSession(model).run(None, feeds)[0],
                               _ort(model).run(None, feeds)[0], **TOL)


# -- providers and options ----------------------------------------------------------------------
@pytest.mark.parametrize("providers", [None, ["CPUExecutionProvider"], [("CPUExecutionProvider", {})]],
                         ids=["none", "cpu", "cpu-tuple"])
def test_providers_accepted(providers):
    with onnxpack.InferenceSession(str(MODELS / "mlp.onnx"), providers=providers) as s:
        assert s.get_providers() == ["CPUExecutionProvider"]


@pytest.mark.parametrize("providers", [["CUDAExecutionProvider", "CPUExecutionProvider"], ["CUDAExecutionProvider"],
                                       ["CPUExecutionProvider", "FooProvider"]], ids=["cuda-cpu", "cuda", "foo"])
def test_providers_other_than_cpu_warn_and_run_on_cpu_as_onnxruntime(providers, capfd):
    """A CPU-only onnxruntime warns about providers it does not have and runs on the CPU (for an
    unknown name it also prints its fallback notice); so do we, with the same warning text."""
    path = str(MODELS / "mlp.onnx")
    with pytest.warns(UserWarning, match="is not in available provider names") as theirs_warnings:
        theirs = ort.InferenceSession(path, providers=providers)
    with pytest.warns(UserWarning, match="is not in available provider names") as our_warnings:
        ours = onnxpack.InferenceSession(path, providers=providers)
    assert ours.get_providers() == theirs.get_providers() == ["CPUExecutionProvider"]
    assert ({str(w.message).split("Available")[0] for w in our_warnings}
            == {str(w.message).split("Available")[0] for w in theirs_warnings})
    x = np.zeros((4, 64), np.float32)
    np.testing.assert_allclose(ours.run(None, {"x": x})[0], theirs.run(None, {"x": x})[0], **TOL)


def test_unknown_onnxpack_key_rejected_at_add_and_at_creation():
    so = onnxpack.SessionOptions()
    with pytest.raises(ConfigError, match="onnxpack.no_such_key"):
        so.add_session_config_entry("onnxpack.no_such_key", "1")
    with pytest.raises(ConfigError):
        so.get_session_config_entry("onnxpack.no_such_key")  # and it was not stored
    # An options object that got the key some other way (the dict is the storage) still fails
    # when the session is created.
    so._config["onnxpack.no_such_key"] = "1"
    with pytest.raises(ConfigError, match="onnxpack.no_such_key"):
        onnxpack.InferenceSession(str(MODELS / "mlp.onnx"), so)


@pytest.mark.parametrize("key,value", [
    ("session.disable_prepacking", "yes"),
    ("onnxpack.verify_prepacked", "2"),
    ("onnxpack.allocation_granularity", "100"),
    ("onnxpack.allocation_granularity", "-4096"),
    ("onnxpack.align_threshold", "big"),
    ("onnxpack.memory_planner", "magic"),
    ("session.optimized_model_external_initializers_min_size_in_bytes", "-1"),
])
def test_bad_config_values_rejected(key, value):
    so = onnxpack.SessionOptions()
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        so.add_session_config_entry(key, value)
    assert repr(value) in str(e.value)
    so._config[key] = value  # bypassing add: creation checks again
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        onnxpack.InferenceSession(str(MODELS / "mlp.onnx"), so)


def test_config_entries_round_trip_and_unknown_session_keys_kept():
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.add_session_config_entry("session.some_ort_only_key", "whatever")  # as onnxruntime: kept
    assert so.get_session_config_entry("session.disable_prepacking") == "1"
    assert so.get_session_config_entry("session.some_ort_only_key") == "whatever"
    with pytest.raises(ConfigError):
        so.add_session_config_entry("session.disable_prepacking", 1)  # not a string
    with onnxpack.InferenceSession(str(MODELS / "mlp.onnx"), so) as s:
        assert s.get_session_options() is so
        assert s.get_prepack_stats()["weights_packed"] == 0


def test_sess_options_type_checked():
    with pytest.raises(InvalidArgument, match="SessionOptions"):
        onnxpack.InferenceSession(str(MODELS / "mlp.onnx"), ort.SessionOptions())


@pytest.mark.parametrize("prepack", ["0", "1"])
def test_add_initializer_matches_onnxruntime(prepack):
    path = str(MODELS / "mlp.onnx")
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 256), dtype=np.float32)
    x = rng.standard_normal((4, 64), dtype=np.float32)
    theirs_so = ort.SessionOptions()
    ov = ort.OrtValue.ortvalue_from_numpy(w1)
    theirs_so.add_initializer("W1", ov)
    want = _ort(path, theirs_so).run(None, {"x": x})[0]
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", prepack)
    so.add_initializer("W1", w1)
    got = onnxpack.InferenceSession(path, so).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, **TOL)
    default = onnxpack.InferenceSession(path).run(None, {"x": x})[0]
    assert not np.allclose(default, got, **TOL)  # the override really changed the weight


def test_add_initializer_unknown_name_rejected():
    so = onnxpack.SessionOptions()
    so.add_initializer("not_a_weight", np.zeros(3, np.float32))
    with pytest.raises(InvalidArgument, match="not_a_weight"):
        onnxpack.InferenceSession(str(MODELS / "mlp.onnx"), so)


# -- run ------------------------------------------------------------------------------------------
def _two_output_model() -> bytes:
    return _model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Neg", ["x"], ["n"], name="neg"),
         helper.make_node("Add", ["r", "n"], ["s"], name="add")],
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info(o, F, ["N", 4]) for o in ("r", "n", "s")])


def test_run_output_names_subset_and_order():
    model = _two_output_model()
    x = np.random.default_rng(1).standard_normal((3, 4), dtype=np.float32)
    theirs = _ort(model)
    with onnxpack.InferenceSession(model) as s:
        for names in (["s"], ["n", "r"], ["s", "s"], None, []):
            got = s.run(names, {"x": x})
            want = theirs.run(names, {"x": x})
            assert len(got) == len(want)
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, **TOL)
        with pytest.raises(InvalidArgument, match="nope"):
            s.run(["nope"], {"x": x})


def test_outputs_are_writable_copies_of_constants():
    """A graph output that is an initializer must not hand out the (read-only) weight itself."""
    w = np.arange(4, dtype=np.float32)
    model = _model([], [], [helper.make_tensor_value_info("W", F, [4])], [numpy_helper.from_array(w, "W")])
    s = onnxpack.InferenceSession(model)
    (out,) = s.run(None, {})
    out[:] = -1
    np.testing.assert_array_equal(s.run(None, {})[0], w)


def test_close_and_context_manager():
    path = str(MODELS / "mlp.onnx")
    x = np.zeros((4, 64), np.float32)
    with onnxpack.InferenceSession(path) as s:
        s.run(None, {"x": x})
    with pytest.raises(InvalidArgument, match="closed"):
        s.run(None, {"x": x})
    s.close()  # idempotent
    s2 = onnxpack.InferenceSession(path)
    s2.close()
    with pytest.raises(OnnxpackError):
        s2.run(None, {"x": x})


# -- input validation -----------------------------------------------------------------------------
def _validation_model() -> bytes:
    return _model([helper.make_node("Add", ["a", "b"], ["c"], name="add")],
                  [helper.make_tensor_value_info("a", F, ["batch", 3]),
                   helper.make_tensor_value_info("b", F, [1, 3])],
                  [helper.make_tensor_value_info("c", F, ["batch", 3])])


GOOD = {"a": np.ones((2, 3), np.float32), "b": np.ones((1, 3), np.float32)}
BAD_FEEDS = [
    # (id, feed, words the message must contain)
    # onnxruntime's message first, then the declared and given shapes
    ("missing", {"a": GOOD["a"]}, ["Required inputs (['b']) are missing from input feed (['a'])", "tensor(float)",
                                   "[1, 3]"]),
    ("unknown", {**GOOD, "zz": GOOD["a"]}, ["Invalid input name: zz", "'a'", "'b'"]),
    ("dtype", {**GOOD, "a": GOOD["a"].astype(np.float64)},
     ["Unexpected input data type. Actual: (tensor(double)) , expected: (tensor(float))", "'a'", "float64"]),
    ("int-dtype", {**GOOD, "b": np.ones((1, 3), np.int64)},
     ["Actual: (tensor(int64)) , expected: (tensor(float))", "'b'"]),
    ("rank", {**GOOD, "a": np.ones((2, 3, 1), np.float32)},
     ["Invalid rank for input: a Got: 3 Expected: 2", "['batch', 3]", "[2, 3, 1]"]),
    ("scalar", {**GOOD, "b": np.float32(1)}, ["Invalid rank for input: b Got: 0 Expected: 2"]),
    ("fixed-dim", {**GOOD, "b": np.ones((2, 3), np.float32)},
     ["Got invalid dimensions for input: b", "index: 0 Got: 2 Expected: 1", "[1, 3]", "[2, 3]"]),
]


@pytest.mark.parametrize("feed,words", [pytest.param(f, w, id=i) for i, f, w in BAD_FEEDS])
def test_bad_inputs_raise_invalid_argument(feed, words):
    model = _validation_model()
    with pytest.raises(Exception):  # onnxruntime rejects the same feed
        _ort(model).run(None, feed)
    with onnxpack.InferenceSession(model) as s:
        with pytest.raises(InvalidArgument) as e:
            s.run(None, feed)
        for w in words:
            assert w in str(e.value), f"{w!r} not in {str(e.value)!r}"
        # ... and the session still works afterwards.
        np.testing.assert_allclose(s.run(None, GOOD)[0], GOOD["a"] + GOOD["b"])


@pytest.mark.parametrize("feed,words", [pytest.param(f, w, id=i) for i, f, w in BAD_FEEDS])
def test_bad_inputs_raise_after_good_runs(feed, words):
    """A good run caches each plain tensor input's declared dtype and dims (the feed checks
    then skip the proto); a bad feed afterwards still gets the full checks and messages, and a
    symbolic dim still takes any size."""
    with onnxpack.InferenceSession(_validation_model()) as s:
        s.run(None, GOOD)
        s.run(None, {"a": np.ones((5, 3), np.float32), "b": GOOD["b"]})
        with pytest.raises(InvalidArgument) as e:
            s.run(None, feed)
        for w in words:
            assert w in str(e.value), f"{w!r} not in {str(e.value)!r}"


def test_input_feed_must_be_a_dict():
    with onnxpack.InferenceSession(_validation_model()) as s:
        with pytest.raises(InvalidArgument, match="dict"):
            s.run(None, [GOOD["a"], GOOD["b"]])


def test_symbolic_dim_accepts_any_size():
    with onnxpack.InferenceSession(_validation_model()) as s:
        got = s.run(None, {"a": np.ones((7, 3), np.float32), "b": np.ones((1, 3), np.float32)})[0]
        assert got.shape == (7, 3)


# -- failures at run time and at creation -----------------------------------------------------
def test_kernel_failure_names_node_and_chains_cause():
    model = _model(
        [helper.make_node("Relu", ["x"], ["r"], name="first"),
         helper.make_node("Reshape", ["r", "shape"], ["y"], name="the_reshape")],
        [helper.make_tensor_value_info("x", F, [6]), helper.make_tensor_value_info("shape", TensorProto.INT64, ["r"])],
        [helper.make_tensor_value_info("y", F, None)])
    feeds = {"x": np.ones(6, np.float32), "shape": np.array([4], np.int64)}
    with pytest.raises(Exception):
        _ort(model).run(None, feeds)
    with onnxpack.InferenceSession(model) as s:
        with pytest.raises(RuntimeFailure) as e:
            s.run(None, feeds)
        assert "the_reshape" in str(e.value) and "Reshape" in str(e.value)
        assert e.value.__cause__ is not None
        assert type(e.value.__cause__).__name__ in str(e.value)
        np.testing.assert_array_equal(s.run(None, {**feeds, "shape": np.array([3, 2], np.int64)})[0],
                                      np.ones((3, 2), np.float32))


def test_kernel_failure_inside_subgraph_names_inner_node():
    body = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="inner_reshape")], "then", [],
        [helper.make_tensor_value_info("y", F, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y2"], name="inner_id")], "else", [],
                              [helper.make_tensor_value_info("y2", F, None)])
    model = _model(
        [helper.make_node("If", ["c"], ["out"], name="the_if", then_branch=body, else_branch=other)],
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("x", F, [6]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("out", F, None)])
    with onnxpack.InferenceSession(model) as s:
        with pytest.raises(RuntimeFailure, match="inner_reshape") as e:
            s.run(None, {"c": np.array(True), "x": np.ones(6, np.float32), "shape": np.array([4], np.int64)})
        assert "Reshape" in str(e.value)


def test_cycle_is_invalid_graph_at_creation():
    model = _model(
        [helper.make_node("Add", ["x", "b"], ["a"], name="n_a"), helper.make_node("Relu", ["a"], ["b"], name="n_b"),
         helper.make_node("Identity", ["a"], ["y"], name="n_y")],
        [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])])
    with pytest.raises(Exception):
        _ort(model)
    with pytest.raises(InvalidGraph, match="cycle") as e:
        onnxpack.InferenceSession(model)
    assert "n_a" in str(e.value) or "n_b" in str(e.value)


def test_undefined_input_is_invalid_graph_at_creation():
    model = _model(
        [helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")],
        [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])])
    with pytest.raises(Exception):
        _ort(model)
    with pytest.raises(InvalidGraph) as e:
        onnxpack.InferenceSession(model)
    assert "ghost" in str(e.value) and "adder" in str(e.value)


def test_undefined_name_inside_subgraph_is_invalid_graph():
    then = helper.make_graph([helper.make_node("Identity", ["nowhere"], ["t"], name="bad_id")], "then", [],
                             [helper.make_tensor_value_info("t", F, None)])
    els = helper.make_graph([helper.make_node("Identity", ["x"], ["e"], name="ok_id")], "else", [],
                            [helper.make_tensor_value_info("e", F, None)])
    model = _model(
        [helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=els)],
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("y", F, None)])
    with pytest.raises(InvalidGraph, match="nowhere"):
        onnxpack.InferenceSession(model)


def test_duplicate_producer_is_invalid_graph():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"], name="one"), helper.make_node("Neg", ["x"], ["y"], name="two")],
        [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])])
    with pytest.raises(InvalidGraph, match="'y'"):
        onnxpack.InferenceSession(model)


def test_fallback_nodes_reported():
    """An op without a native kernel runs through onnx.reference and is listed."""
    model = _model([helper.make_node("Det", ["x"], ["y"], name="det")],
                   [helper.make_tensor_value_info("x", F, [3, 3])], [helper.make_tensor_value_info("y", F, [])])
    x = np.random.default_rng(2).standard_normal((3, 3), dtype=np.float32) + 3 * np.eye(3, dtype=np.float32)
    with onnxpack.InferenceSession(model) as s:
        got = s.run(None, {"x": x})[0]
        assert any(n.endswith(":det:Det") for n in s.get_fallback_nodes()), s.get_fallback_nodes()
    np.testing.assert_allclose(got, _ort(model).run(None, {"x": x})[0], **TOL)


def test_bad_model_bytes_is_model_load_error():
    with pytest.raises(onnxpack.errors.ModelLoadError):
        onnxpack.InferenceSession(b"not a model")
    with pytest.raises((onnxpack.errors.ModelLoadError, OSError)):
        onnxpack.InferenceSession(os.path.join(str(MODELS), "does_not_exist.onnx"))


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_creation_pauses_the_garbage_collector_and_restores_it(enabled, fails):
    """The collector is off while a session is built and as it was afterwards, also when
    creation fails; the session works and the collector runs normally after it."""
    import gc

    seen = []
    relu = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    original = onnxpack.session._session.compile

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        if fails:
            raise InvalidGraph("the compile step fails")
        return original(*args, **kwargs)

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        onnxpack.session._session.compile = spy
        if fails:
            with pytest.raises(OnnxpackError, match="the compile step fails"):
                onnxpack.InferenceSession(relu)
        else:
            sess = onnxpack.InferenceSession(relu)
            assert sess.run(None, {"x": np.array([-1, 2], np.float32)})[0].tolist() == [0, 2]
        assert gc.isenabled() is enabled
        assert seen == [False]
    finally:
        onnxpack.session._session.compile = original
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("frozen_before", [False, True])
def test_creation_leaves_its_objects_old_and_the_callers_frozen_objects_frozen(frozen_before):
    """After a creation the session's objects are in the collector's oldest generation (no young
    collection walks them); objects the caller froze (gc.freeze before forking workers) stay
    frozen, and nothing the session made is left frozen."""
    import gc

    relu = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    was = gc.isenabled()
    gc.enable()
    gc.collect()
    try:
        if frozen_before:
            gc.freeze()
        frozen = gc.get_freeze_count()
        sess = onnxpack.InferenceSession(relu)
        assert gc.get_freeze_count() == frozen
        young = {id(o) for o in gc.get_objects(generation=0)} | {id(o) for o in gc.get_objects(generation=1)}
        if frozen_before:  # left young: unfreezing would have handed the caller's objects back
            assert id(sess.program) in young
        else:
            assert id(sess.program) not in young and id(sess.program.root) not in young
            assert id(sess.program) in {id(o) for o in gc.get_objects(generation=2)}
        assert sess.run(None, {"x": np.array([-1, 2], np.float32)})[0].tolist() == [0, 2]
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("planner", ["none", "greedy_by_size"])
@pytest.mark.parametrize("read", [False, True], ids=["graph-output", "read-by-a-node"])
def test_node_with_more_outputs_than_its_op_is_a_clear_error(planner, read):
    """A node written with more outputs than its op has (onnxruntime refuses the model at load):
    running it names the node and the outputs never produced -- the extra output was silently
    absent, and a node reading it failed with a bare KeyError (found by fuzzing)."""
    nodes = [helper.make_node("Relu", ["x"], ["y", "extra"], name="relu")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if read:
        nodes.append(helper.make_node("Neg", ["extra"], ["z"], name="neg"))
        outs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    else:
        outs.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("onnxpack.memory_planner", planner)
    sess = onnxpack.InferenceSession(model, so)
    with pytest.raises(onnxpack.errors.RuntimeFailure, match=r"'relu' \(Relu\).*names 2 outputs.*\['extra'\]"):
        sess.run(None, {"x": np.ones(2, np.float32)})
