"""Values in and out of runs, against onnxruntime call by call: OrtValue, IOBinding (zero-copy
inputs, outputs written into the caller's buffers — through ``run_into`` where the kernel has it —
and the LLM decode pattern where one step's ``present`` buffers are the next step's ``past``),
input coercion (lists, bytes, np.void, optional inputs, string outputs), free-dimension overrides
and the checks against them, onnxruntime's exception classes, providers, ModelCompiler.

Tolerances: float32 results of the same numpy/MLAS ops, rtol 1e-5 / atol 1e-6; copies exactly.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack import errors
from onnxpack.capi import onnxruntime_pybind11_state as state

F = TensorProto.FLOAT
TOL = dict(rtol=1e-5, atol=1e-6)
RUNTIMES = {"onnxruntime": ort, "onnxpack": onnxpack}


def _model(nodes, inputs, outputs, inits=(), opset=17) -> bytes:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m.SerializeToString()


def _both(model, so=None):
    so_ort = ort.SessionOptions()
    so_ort.log_severity_level = 3
    return ort.InferenceSession(model, so_ort, providers=["CPUExecutionProvider"]), onnxpack.InferenceSession(model, so)


W = (np.random.default_rng(0).standard_normal((8, 8)) / 3).astype(np.float32)
MATMUL = _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], [helper.make_tensor_value_info("x", F, ["n", 8])],
                [helper.make_tensor_value_info("y", F, ["n", 8])], [numpy_helper.from_array(W, "W")])


# -- OrtValue -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "uint8", "int16", "uint16", "int32",
                                   "uint32", "int64", "uint64", "bool"])
def test_ortvalue_describes_like_onnxruntime(dtype):
    arr = (np.arange(6) % 2 if dtype == "bool" else np.arange(6)).astype(dtype).reshape(2, 3)
    theirs, ours = ort.OrtValue.ortvalue_from_numpy(arr), onnxpack.OrtValue.ortvalue_from_numpy(arr)
    for call in ("shape", "data_type", "element_type", "device_name", "is_tensor", "has_value",
                 "is_tensor_sequence", "is_sparse_tensor", "tensor_size_in_bytes"):
        assert getattr(ours, call)() == getattr(theirs, call)(), call
    assert ours.data_ptr() == arr.ctypes.data  # the caller's buffer, no copy
    fresh_t = ort.OrtValue.ortvalue_from_shape_and_type([4, 5], TensorProto.FLOAT16)
    fresh_o = onnxpack.OrtValue.ortvalue_from_shape_and_type([4, 5], TensorProto.FLOAT16)
    assert (fresh_o.data_type(), fresh_o.shape(), fresh_o.numpy().dtype) == (
        fresh_t.data_type(), fresh_t.shape(), fresh_t.numpy().dtype)


def test_ortvalue_devices_fail_like_a_cpu_only_onnxruntime():
    x = np.ones(3, np.float32)
    for rt in RUNTIMES.values():
        with pytest.raises(RuntimeError):
            rt.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
        with pytest.raises(RuntimeError):
            rt.OrtValue.ortvalue_from_shape_and_type([3], np.float32, "cuda", 0)
        with pytest.raises(Exception, match="Unsupported device type: foo"):
            rt.OrtValue.ortvalue_from_numpy(x, "foo", 0)
        assert rt.OrtDevice.make("cuda", 0).device_type() == 1  # describing a device is fine


def test_ortvalue_update_inplace_and_copy_tensors():
    v = onnxpack.OrtValue.ortvalue_from_shape_and_type([2, 2], np.float32)
    keep = v.numpy()
    v.update_inplace(np.array([[1, 2], [3, 4]], np.float32))
    assert keep is v.numpy() and keep.tolist() == [[1, 2], [3, 4]]
    dst = onnxpack.OrtValue.ortvalue_from_shape_and_type([2, 2], np.float32)
    onnxpack.copy_tensors([v], [dst])
    assert dst.numpy().tolist() == [[1, 2], [3, 4]]
    with pytest.raises(RuntimeError):
        v.update_inplace(np.zeros(3, np.float32))


def test_run_with_ort_values_matches_onnxruntime():
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    theirs, ours = _both(MATMUL)
    t = theirs.run_with_ort_values(None, {"x": ort.OrtValue.ortvalue_from_numpy(x)})
    o = ours.run_with_ort_values(None, {"x": onnxpack.OrtValue.ortvalue_from_numpy(x)})
    assert len(o) == len(t) == 1
    assert (o[0].data_type(), o[0].shape()) == (t[0].data_type(), t[0].shape())
    np.testing.assert_allclose(o[0].numpy(), t[0].numpy(), **TOL)


# -- IOBinding ------------------------------------------------------------------------------------
MATMUL_W_INPUT = _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
                        [helper.make_tensor_value_info("x", F, ["n", 8]), helper.make_tensor_value_info("W", F, [8, 8])],
                        [helper.make_tensor_value_info("y", F, ["n", 8])])


@pytest.mark.parametrize("weights", ["packed", "fed", "prepacking-disabled"])
def test_bound_output_written_through_run_into(weights):
    """Second run with the same shapes: MatMul writes straight into the bound buffer (its plain
    ``run`` is made to fail to prove it is not called), and the caller's buffer holds the result.
    The weight is a packed initializer, a graph input, or an initializer with pre-packing off."""
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    so = onnxpack.SessionOptions()
    if weights == "prepacking-disabled":
        so.add_session_config_entry("session.disable_prepacking", "1")
    sess = onnxpack.InferenceSession(MATMUL_W_INPUT if weights == "fed" else MATMUL, so)
    out = onnxpack.OrtValue.ortvalue_from_shape_and_type([4, 8], np.float32)
    buf = out.numpy()
    binding = sess.io_binding()
    binding.bind_cpu_input("x", x)
    if weights == "fed":
        binding.bind_cpu_input("W", W)
    binding.bind_ortvalue_output("y", out)
    sess.run_with_iobinding(binding)  # first run: computed, then copied in; shapes recorded
    np.testing.assert_allclose(buf, x @ W, **TOL)
    kernel = sess.program.root.steps[0].kernel

    def no_plain_run(*args):
        raise AssertionError("run() called: the bound buffer was not written by run_into")

    kernel.run = no_plain_run
    x2 = x * 2
    binding.bind_cpu_input("x", x2)
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(buf, x2 @ W, **TOL)
    assert binding.get_outputs()[0] is out and out.numpy() is buf
    # another shape: run_into is not tried with a buffer that does not fit; the run fails like onnxruntime
    del kernel.run
    binding.bind_cpu_input("x", np.ones((5, 8), np.float32))
    with pytest.raises(RuntimeError, match="Error in execution: Got invalid dimensions for output: y"):
        sess.run_with_iobinding(binding)


def test_binding_decision_follows_inputs_that_alias_the_bound_buffer():
    """The binding's decision (which steps write into bound buffers) is kept from run to run
    while the bound buffers and the inputs touching them stay the same.  A new input that *is*
    the bound output buffer must not be read while MatMul writes into it: the result is computed,
    then copied in — the same as a fresh binding and as numpy — and later runs with a harmless
    input write in place again."""
    rng = np.random.default_rng(7)
    sess = onnxpack.InferenceSession(MATMUL)
    out = onnxpack.OrtValue.ortvalue_from_shape_and_type([8, 8], np.float32)
    buf = out.numpy()
    binding = sess.io_binding()
    kernel = sess.program.root.steps[0].kernel
    real, into = kernel.run_into, []

    def spy(outs, *args):  # numpy's matmul copes with the alias; a kernel need not: it is never handed one
        into.append(any(np.may_share_memory(a, o) for a in args for o in outs if isinstance(a, np.ndarray)
                        and isinstance(o, np.ndarray)))
        return real(outs, *args)

    kernel.run_into = spy
    for x in (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2)):  # the decision is made, then kept
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input("x", x)
        binding.bind_ortvalue_output("y", out)
        sess.run_with_iobinding(binding)
        np.testing.assert_allclose(buf, x @ W, **TOL)
    buf[:] = rng.standard_normal((8, 8)).astype(np.float32)
    expected = buf @ W
    binding.bind_cpu_input("x", buf)  # the output buffer itself as the input
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(buf, expected, **TOL)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    binding.bind_cpu_input("x", x)
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(buf, x @ W, **TOL)
    assert binding.get_outputs()[0] is out
    assert into == [False, False], into  # runs 2 and 4 wrote in place, never with the alias


@pytest.mark.parametrize("planner", ["none", "greedy_by_size"])
def test_kv_cache_decode_loop_reuses_bound_buffers_like_onnxruntime(planner):
    """present_k = Concat(past_k, k_new) along the sequence axis; y = MatMul(q, present_k^T).
    Each step binds the previous step's present buffer as past and a preallocated buffer of one
    more position as present; onnxruntime runs the same bindings."""
    d = 4
    nodes = [helper.make_node("Concat", ["past_k", "k_new"], ["present_k"], axis=1, name="cat"),
             helper.make_node("Transpose", ["present_k"], ["kt"], perm=[0, 2, 1], name="tr"),
             helper.make_node("MatMul", ["q", "kt"], ["scores"], name="mm")]
    model = _model(nodes, [helper.make_tensor_value_info("past_k", F, [1, "past", d]),
                           helper.make_tensor_value_info("k_new", F, [1, 1, d]),
                           helper.make_tensor_value_info("q", F, [1, 1, d])],
                   [helper.make_tensor_value_info("present_k", F, [1, "total", d]),
                    helper.make_tensor_value_info("scores", F, [1, 1, "total"])])
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("onnxpack.memory_planner", planner)
    results = {}
    for name, rt in RUNTIMES.items():
        sess = rt.InferenceSession(model, so if rt is onnxpack else None, providers=["CPUExecutionProvider"])
        binding = sess.io_binding()
        past = rt.OrtValue.ortvalue_from_numpy(np.zeros((1, 0, d), np.float32))
        steps = []
        for t in range(5):
            inputs = np.random.default_rng(100 + t)  # the same step inputs for both runtimes
            present = rt.OrtValue.ortvalue_from_shape_and_type([1, t + 1, d], np.float32)
            binding.bind_ortvalue_input("past_k", past)
            binding.bind_cpu_input("k_new", inputs.standard_normal((1, 1, d)).astype(np.float32))
            binding.bind_cpu_input("q", inputs.standard_normal((1, 1, d)).astype(np.float32))
            binding.bind_ortvalue_output("present_k", present)
            binding.bind_output("scores")
            sess.run_with_iobinding(binding)
            outs = binding.get_outputs()
            assert outs[0].data_ptr() == present.data_ptr()  # written into the caller's buffer
            steps.append((present.numpy().copy(), outs[1].numpy().copy()))
            past = present  # the next step reads this step's present buffer
        results[name] = steps
    for (kt, st), (ko, so_) in zip(results["onnxruntime"], results["onnxpack"]):
        np.testing.assert_allclose(ko, kt, **TOL)
        np.testing.assert_allclose(so_, st, **TOL)


def test_bound_inputs_are_not_copied():
    """An Identity output bound by device name is a copy onnxruntime-style, but the kernels read
    the bound input itself: a kernel that returns its input (Reshape view) sees the caller's bytes."""
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")], [helper.make_tensor_value_info("x", F, [2, 3])],
                   [helper.make_tensor_value_info("y", F, [6])], [numpy_helper.from_array(np.array([6], np.int64), "s")])
    sess = onnxpack.InferenceSession(model)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    seen = []
    kernel = sess.program.root.steps[0].kernel
    real = kernel.run
    kernel.run = lambda *a: (seen.append(a[0]), real(*a))[1]
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", onnxpack.OrtValue.ortvalue_from_numpy(x))
    binding.bind_output("y")
    sess.run_with_iobinding(binding)
    assert seen[0] is x
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], x.reshape(-1))


@pytest.mark.parametrize("case", ["no-output", "unknown-input", "wrong-dtype-out", "wrong-shape-out", "wrong-dtype-in",
                                  "other-session"])
def test_iobinding_errors_like_onnxruntime(case):
    x = np.ones((2, 8), np.float32)
    kinds = []
    for rt in RUNTIMES.values():
        sess = rt.InferenceSession(MATMUL, providers=["CPUExecutionProvider"])
        binding = sess.io_binding()
        with pytest.raises(Exception) as e:
            if case == "unknown-input":
                binding.bind_cpu_input("nope", x)
            binding.bind_cpu_input("x", x.astype(np.float64) if case == "wrong-dtype-in" else x)
            if case == "wrong-dtype-out":
                binding.bind_ortvalue_output("y", rt.OrtValue.ortvalue_from_shape_and_type([2, 8], np.float64))
            elif case == "wrong-shape-out":
                binding.bind_ortvalue_output("y", rt.OrtValue.ortvalue_from_shape_and_type([2, 7], np.float32))
            elif case != "no-output":
                binding.bind_output("y")
            if case == "other-session":
                rt.InferenceSession(MATMUL, providers=["CPUExecutionProvider"]).run_with_iobinding(binding)
            else:
                sess.run_with_iobinding(binding)
        kinds.append((type(e.value), str(e.value)))
    (t_type, t_msg), (o_type, o_msg) = kinds
    for builtin in (RuntimeError, ValueError):  # caught by the same except clauses (ours may be more)
        assert issubclass(o_type, builtin) or not issubclass(t_type, builtin), (builtin, t_type, o_type)
    assert issubclass(o_type, errors.OnnxpackError)
    key = {"no-output": "At least one output should be requested", "unknown-input": "Failed to find NodeArg with name: nope",
           "wrong-dtype-out": "Unexpected output data type", "wrong-shape-out": "Got invalid dimensions for output: y",
           "wrong-dtype-in": "Unexpected input data type", "other-session": "IOBinding must be used with the session"}[case]
    assert key in t_msg and key in o_msg, (t_msg, o_msg)


# -- input coercion -------------------------------------------------------------------------------
def _identity(elem, shape) -> bytes:
    return _model([helper.make_node("Identity", ["x"], ["y"])], [helper.make_tensor_value_info("x", elem, shape)],
                  [helper.make_tensor_value_info("y", elem, shape)])


@pytest.mark.parametrize("elem,shape,value", [
    (TensorProto.INT32, [2], [1, 2]),
    (TensorProto.INT32, [2], [1.5, 2.5]),
    (TensorProto.INT32, [2], [True, False]),
    (TensorProto.FLOAT, [2, 2], [[1, 2], [3, 4]]),
    (TensorProto.BOOL, [3], [1, 0, 1]),
    (TensorProto.STRING, [2], ["a", "bc"]),
    (TensorProto.STRING, [2], np.array([b"ab", b"xyz"], dtype=object)),
    (TensorProto.STRING, [2], np.array([b"must", b"have"], dtype=np.void)),
    (TensorProto.STRING, [2], np.array(["a", "bc"], dtype=object)),
    (TensorProto.STRING, [2], np.array(["olá", "你好"])),
], ids=["int-list", "float-list-to-int", "bool-list-to-int", "nested-list", "int-list-to-bool", "str-list",
        "bytes", "void", "object", "unicode"])
def test_inputs_coerced_like_onnxruntime(elem, shape, value):
    theirs, ours = _both(_identity(elem, shape))
    (t,), (o,) = theirs.run(None, {"x": value}), ours.run(None, {"x": value})
    assert o.dtype == t.dtype and o.shape == t.shape
    assert o.tolist() == t.tolist()
    if elem == TensorProto.STRING:
        assert all(type(s) is str for s in o.reshape(-1))


def test_optional_input_may_be_left_out_or_none():
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2]))
    model = _model([helper.make_node("OptionalHasElement", ["x"], ["y"])], [helper.make_value_info("x", opt)],
                   [helper.make_tensor_value_info("y", TensorProto.BOOL, [])], opset=18)
    theirs, ours = _both(model)
    assert [(a.name, a.type, a.shape) for a in ours.get_inputs()] == [(a.name, a.type, a.shape) for a in theirs.get_inputs()]
    for feed in ({}, {"x": None}, {"x": np.ones(2, np.float32)}):
        assert ours.run(None, feed)[0] == theirs.run(None, feed)[0]


def test_string_outputs_are_object_arrays_of_str():
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.STRING)],
                   [helper.make_tensor_value_info("x", TensorProto.INT64, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.STRING, [3])])
    theirs, ours = _both(model)
    x = np.array([1, -2, 30], np.int64)
    t, o = theirs.run(None, {"x": x})[0], ours.run(None, {"x": x})[0]
    assert o.dtype == object and [type(v) for v in o] == [str] * 3 and o.tolist() == t.tolist()


# -- free dimensions -----------------------------------------------------------------------------
def _free_dims_model() -> bytes:
    x = helper.make_tensor_value_info("x", F, ["batch", "seq", 4])
    x.type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
    return _model([helper.make_node("Relu", ["x"], ["y"])], [x], [helper.make_tensor_value_info("y", F, ["batch", "seq", 4])])


@pytest.mark.parametrize("by_name,by_denotation", [({"seq": 5}, {}), ({}, {"DATA_BATCH": 2}),
                                                   ({"seq": 5, "batch": 3}, {"DATA_BATCH": 2}), ({"nope": 1}, {})],
                         ids=["name", "denotation", "both", "unused"])
def test_free_dimension_overrides_like_onnxruntime(by_name, by_denotation):
    sessions = []
    for rt in RUNTIMES.values():
        so = rt.SessionOptions()
        for k, v in by_name.items():
            so.add_free_dimension_override_by_name(k, v)
        for k, v in by_denotation.items():
            so.add_free_dimension_override_by_denotation(k, v)
        if by_name.get("batch", 2) != by_denotation.get("DATA_BATCH", by_name.get("batch", 2)):
            with pytest.raises(rt.capi.onnxruntime_pybind11_state.InvalidArgument,
                               match="Conflicting free dimension overrides"):
                rt.InferenceSession(_free_dims_model(), so, providers=["CPUExecutionProvider"])
            continue
        sessions.append(rt.InferenceSession(_free_dims_model(), so, providers=["CPUExecutionProvider"]))
    if not sessions:
        return
    theirs, ours = sessions
    assert [a.shape for a in ours.get_inputs()] == [a.shape for a in theirs.get_inputs()]
    assert [a.shape for a in ours.get_outputs()] == [a.shape for a in theirs.get_outputs()]
    shape = [d if isinstance(d, int) else 2 for d in theirs.get_inputs()[0].shape]
    good = np.ones(shape, np.float32)
    np.testing.assert_array_equal(ours.run(None, {"x": good})[0], theirs.run(None, {"x": good})[0])
    fixed = [k for k, d in enumerate(theirs.get_inputs()[0].shape) if isinstance(d, int) and k < 2]
    if fixed:
        bad = np.ones([s + 1 if k in fixed else s for k, s in enumerate(shape)], np.float32)
        with pytest.raises(state.InvalidArgument) as e:
            ours.run(None, {"x": bad})
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument) as t:
            theirs.run(None, {"x": bad})
        for k in fixed:
            needle = f"index: {k} Got: {shape[k] + 1} Expected: {shape[k]}"
            assert needle in str(e.value) and needle in str(t.value)


# -- errors catchable as onnxruntime's -------------------------------------------------------------
def test_errors_are_onnxruntime_classes_and_ours(tmp_path):
    cases = [
        (lambda rt: rt.InferenceSession(str(tmp_path / "missing.onnx")), "NoSuchFile", errors.ModelLoadError),
        (lambda rt: rt.InferenceSession(b"not a model"), "InvalidProtobuf", errors.ModelLoadError),
        (lambda rt: rt.InferenceSession(MATMUL).run(None, {"x": np.ones((2, 8), np.float64)}), "InvalidArgument",
         errors.InvalidArgument),
        (lambda rt: rt.InferenceSession(MATMUL).run(["nope"], {"x": np.ones((2, 8), np.float32)}), "InvalidArgument",
         errors.InvalidArgument),
        (lambda rt: rt.InferenceSession(_model([helper.make_node("NoSuchOp", ["x"], ["y"])],
                                               [helper.make_tensor_value_info("x", F, [1])],
                                               [helper.make_tensor_value_info("y", F, [1])])), "InvalidGraph",
         errors.KernelNotFoundError),
        (lambda rt: rt.InferenceSession(_model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["x"])],
                                               [], [helper.make_tensor_value_info("y", F, [1])])), "Fail",
         errors.InvalidGraph),
        (lambda rt: rt.InferenceSession(_model([helper.make_node("Add", ["x", "ghost"], ["y"])],
                                               [helper.make_tensor_value_info("x", F, [1])],
                                               [helper.make_tensor_value_info("y", F, [1])])), "InvalidArgument",
         errors.InvalidGraph),
        (lambda rt: rt.InferenceSession(_model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["y"])],
                                               [helper.make_tensor_value_info("x", F, [1])],
                                               [helper.make_tensor_value_info("y", F, [1])])), "Fail",
         errors.InvalidGraph),
    ]
    for make, name, ours_cls in cases:
        with pytest.raises(Exception) as t:
            make(ort)
        with pytest.raises(ours_cls) as o:
            make(onnxpack)
        ort_cls = type(t.value)
        ours_named = getattr(state, ort_cls.__name__)  # the same name exists in onnxpack's capi module ...
        assert isinstance(o.value, ours_named), (ort_cls, type(o.value))  # ... and catches our error
        if name:
            assert ort_cls.__name__ == name


def test_model_load_error_subclass_mapping_keeps_our_classes():
    so = onnxpack.SessionOptions()
    so._config["onnxpack.nope"] = "1"
    with pytest.raises(errors.ConfigError) as e:
        onnxpack.InferenceSession(MATMUL, so)
    assert isinstance(e.value, state.InvalidArgument)
    with pytest.raises(state.Fail, match="Failed to load library"):
        onnxpack.SessionOptions().register_custom_ops_library("/no/such/lib.so")
    with pytest.raises(state.Fail):
        onnxpack.register_execution_provider_library("x", "/no/such/ep.so")


# -- providers ------------------------------------------------------------------------------------
def test_provider_api_like_onnxruntime():
    theirs, ours = _both(MATMUL)
    assert ours.get_providers() == theirs.get_providers()
    assert ours.get_provider_options() == theirs.get_provider_options()
    for sess in (theirs, ours):
        with pytest.raises(RuntimeError, match="Unknown Provider Type: Nope"), pytest.warns(UserWarning):
            sess.set_providers(["Nope"])
    ours.set_providers(["CPUExecutionProvider"], [{"x": 1}])
    assert ours.get_provider_options() == {"CPUExecutionProvider": {"x": "1"}}
    with pytest.warns(UserWarning, match="CUDAExecutionProvider"):
        ours.set_providers(["CUDAExecutionProvider"])
    assert ours.get_providers() == ["CPUExecutionProvider"]
    assert onnxpack.get_all_providers() == ort.get_all_providers()
    assert onnxpack.get_available_providers() == ["CPUExecutionProvider"]
    assert onnxpack.get_device() == ort.get_device() == "CPU"
    for rt in RUNTIMES.values():
        so = rt.SessionOptions()
        so.add_provider("CPUExecutionProvider", {})
        assert so.has_providers()
        with pytest.raises(RuntimeError, match="Unknown Provider Type"):
            so.add_provider("FooExecutionProvider", {})
        with pytest.raises(Exception, match="Failed to add provider of type 'CUDAExecutionProvider'"):
            so.add_provider("CUDAExecutionProvider", {})


def test_model_compiler_writes_a_prepacked_model(tmp_path):
    src = tmp_path / "in.onnx"
    src.write_bytes(MATMUL)
    compiler = onnxpack.ModelCompiler(onnxpack.SessionOptions(), str(src))
    compiler.compile_to_file(str(tmp_path / "out.onnx"))
    x = np.ones((2, 8), np.float32)
    with onnxpack.InferenceSession(str(tmp_path / "out.onnx")) as s:
        np.testing.assert_allclose(s.run(None, {"x": x})[0], x @ W, **TOL)
    np.testing.assert_allclose(ort.InferenceSession(str(tmp_path / "out.onnx")).run(None, {"x": x})[0], x @ W, **TOL)
    assert onnx.load_from_string(onnxpack.ModelCompiler(onnxpack.SessionOptions(), MATMUL).compile_to_bytes()).graph.node
    strict = onnxpack.ModelCompiler(onnxpack.SessionOptions(), MATMUL, flags=onnxpack.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED)
    theirs = ort.ModelCompiler(ort.SessionOptions(), MATMUL, flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED)
    for c, fail in ((strict, state.Fail), (theirs, ort.capi.onnxruntime_pybind11_state.Fail)):
        with pytest.raises(fail, match="Unable to compile any nodes"):
            c.compile_to_file(str(tmp_path / "strict.onnx"))


def test_iobinding_output_bound_by_name_is_never_a_view_of_a_weight_or_an_input(tmp_path):
    """An output bound by name (onnxpack allocates it) that is a weight reshaped, or an input
    passed through, comes out as run() gives it: a writable copy, not a read-only view of the
    mapped data file (truncating the file after the run then killed a read of the output with
    SIGBUS) nor the input's memory."""
    w = np.arange(1 << 12, dtype=np.float32).reshape(64, 64)
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["W", "shp"], ["y"]), helper.make_node("Identity", ["x"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None), helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([-1], np.int64), "shp")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    sess = onnxpack.InferenceSession(str(path))
    x = np.ones(3, np.float32)
    b = sess.io_binding()
    b.bind_cpu_input("x", x)
    b.bind_output("y")
    b.bind_output("z")
    sess.run_with_iobinding(b)
    y, z = (v.numpy() for v in b.get_outputs())
    assert y.flags.writeable and z.flags.writeable and not np.shares_memory(z, x)
    y[:] = -1.0
    z[:] = 5.0
    sess.run_with_iobinding(b)
    y2, z2 = (v.numpy() for v in b.get_outputs())
    np.testing.assert_array_equal(y2, w.reshape(-1))
    np.testing.assert_array_equal(z2, x)
    np.testing.assert_array_equal(x, 1.0)


@pytest.mark.parametrize("outputs", [["y", "z"], ["y", "v"], ["y", "y2", "z"]], ids=["identity", "reshape-view", "three"])
def test_outputs_of_one_value_are_separate_arrays(outputs):
    """Two graph outputs of one value (``y`` and ``Identity(y)``; ``y`` and a Reshape of it, a view
    of the same memory) come back as separate arrays, as onnxruntime's do: writing into one
    leaves the other as computed."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Identity", ["y"], ["z"]),
             helper.make_node("Identity", ["y"], ["y2"]), helper.make_node("Reshape", ["y", "shape"], ["v"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", f, [2, 3])],
                   [helper.make_tensor_value_info(n, f, None) for n in outputs],
                   [numpy_helper.from_array(np.array([3, 2], np.int64), "shape")])
    x = np.array([[1, -2, 3], [4, 5, -6]], np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for run in (lambda s: s.run(None, {"x": x}), lambda s: [v.numpy() for v in s.run_with_ort_values(None, {"x": x})]):
        got = run(onnxpack.InferenceSession(model))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        got[0][...] = 42.0
        for g, w in zip(got[1:], want[1:]):
            np.testing.assert_array_equal(g, w)


def test_optional_kernels_hold_get_and_test_their_value():
    """Optional / OptionalHasElement / OptionalGetElement run natively as onnxruntime does: the
    optional of a tensor gives the tensor back, an empty one has no element, and getting its
    element is the run's error (onnx.reference's Optional wraps its value in a list)."""
    f = TensorProto.FLOAT
    full = _model([helper.make_node("Optional", ["a"], ["o"]), helper.make_node("OptionalGetElement", ["o"], ["y"]),
                   helper.make_node("OptionalHasElement", ["o"], ["h"])],
                  [helper.make_tensor_value_info("a", f, [2, 3])],
                  [helper.make_tensor_value_info("y", f, [2, 3]), helper.make_tensor_value_info("h", TensorProto.BOOL, [])],
                  opset=18)
    empty_node = helper.make_node("Optional", [], ["o"], type=helper.make_tensor_type_proto(f, None))
    empty = _model([empty_node, helper.make_node("OptionalHasElement", ["o"], ["h"])],
                   [helper.make_tensor_value_info("a", f, [2, 3])], [helper.make_tensor_value_info("h", TensorProto.BOOL, [])],
                   opset=18)
    get_empty = _model([empty_node, helper.make_node("OptionalGetElement", ["o"], ["y"])],
                       [helper.make_tensor_value_info("a", f, [2, 3])], [helper.make_tensor_value_info("y", f, None)],
                       opset=18)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    for model in (full, empty):
        want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"a": a})
        with onnxpack.InferenceSession(model) as s:
            assert not s.get_fallback_nodes()
            got = s.run(None, {"a": a})
        assert [type(g) for g in got] == [np.ndarray] * len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)
    with pytest.raises(Exception, match="holds no value"):
        onnxpack.InferenceSession(get_empty).run(None, {"a": a})
