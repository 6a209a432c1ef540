"""onnxruntime's own Python API tests, run against onnxruntime and onnxpack through one shim.

Ported from onnxruntime's ``onnxruntime/test/python/onnxruntime_test_python.py`` (and the CPU
cases of ``onnxruntime_test_python_iobinding.py``): every test that exercises something on a
CPU-only machine.  Not ported: tests whose body only runs with CUDA, TensorRT, DML, TVM or several
GPUs (set_providers_with_options, session_providers, tuning results, gh_issue9799, cuda copy
stream, multiple devices, tvm), and tests that need onnxruntime's prebuilt native custom-op library
(``register_custom_ops_library`` is tested for its failure instead).

The shim (:class:`Runtime`) gives each test the module under test as ``rt.ort`` and onnxruntime's
module paths (``rt.C`` = ``capi._pybind_state``, ``rt.state`` = ``capi.onnxruntime_pybind11_state``,
``rt.collection`` = ``capi.onnxruntime_inference_collection``); for onnxpack they are
``onnxpack``'s own re-exports.  Each test runs on both; onnxruntime passing is the check that a
test means what it says.  Adaptations from the original, where it reaches into onnxruntime's
private objects: ``sess._sess.run_with_ort_values(...)`` is the public ``run_with_ort_values``,
``ortvalue._ortvalue.to_dlpack()`` the public ``__dlpack__``, ``C.OrtValue.from_dlpack`` the public
``OrtValue.from_dlpack``.  The test data models of onnxruntime's repository are rebuilt in code
with the same names, inputs, outputs and values (:func:`testdata`).

A test onnxpack does not pass is marked ``xfail(strict=True)`` for onnxpack only, with the reason;
``pytest -rx`` lists them.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import pathlib
import queue
import threading
import types
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack

F = TensorProto.FLOAT


class Runtime(types.SimpleNamespace):
    """The module under test and onnxruntime's module paths into it."""


def _runtime(mod) -> Runtime:
    return Runtime(name=mod.__name__, ort=mod, C=mod.capi._pybind_state, state=mod.capi.onnxruntime_pybind11_state,
                   collection=mod.capi.onnxruntime_inference_collection)


RUNTIMES = {"onnxruntime": onnxruntime, "onnxpack": onnxpack}
# Tests onnxpack fails on purpose: id -> reason.  (Empty when everything passes.)
ONNXPACK_XFAIL: dict[str, str] = {}


@pytest.fixture(params=list(RUNTIMES), ids=list(RUNTIMES))
def rt(request):
    if request.param == "onnxpack":
        reason = ONNXPACK_XFAIL.get(request.node.originalname)
        if reason:
            request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    runtime = _runtime(RUNTIMES[request.param])
    yield runtime
    if request.param == "onnxruntime":
        onnxruntime.set_default_logger_severity(3)  # onnxruntime's tests leave it changed; keep stderr quiet


# -- onnxruntime's testdata models, rebuilt ------------------------------------------------------


def _save(model: onnx.ModelProto, path: pathlib.Path, **kw) -> None:
    if model.ir_version == 0 or model.ir_version > 10:
        model.ir_version = 9
    onnx.save(model, str(path), **kw)


def _model(nodes, inputs, outputs, inits=(), opset=17, **kw) -> onnx.ModelProto:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)], **kw)
    m.ir_version = 9
    return m


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _build_testdata(d: pathlib.Path) -> None:
    w = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
    _save(_model([helper.make_node("Mul", ["X", "W"], ["Y"], name="mul_1")], [_vi("X", F, [3, 2])],
                 [_vi("Y", F, [3, 2])], [numpy_helper.from_array(w, "W")], producer_name="chenta"), d / "mul_1.onnx")
    w2 = np.array([[1.0], [2.0]], np.float32)
    _save(_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [_vi("X", F, [3, 2])], [_vi("Y", F, [3, 1])],
                 [numpy_helper.from_array(w2, "W")]), d / "matmul_1.onnx")
    _save(_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [_vi("X", F, ["None", 2])],
                 [_vi("Y", F, ["None", 1])], [numpy_helper.from_array(w2, "W")]), d / "matmul_2.onnx")
    B = TensorProto.BOOL
    _save(_model([helper.make_node("And", ["input1:0", "input:0"], ["output:0"])],
                 [_vi("input1:0", B, [2, 2]), _vi("input:0", B, [2, 2])], [_vi("output:0", B, [2, 2])]),
          d / "logicaland.onnx")
    S = TensorProto.STRING
    _save(_model([helper.make_node("Identity", ["input:0"], ["output:0"])], [_vi("input:0", S, [2, 2])],
                 [_vi("output:0", S, [2, 2])]), d / "identity_string.onnx")
    opt_seq = helper.make_optional_type_proto(helper.make_sequence_type_proto(helper.make_tensor_type_proto(F, None)))
    _save(_model([helper.make_node("Identity", ["input"], ["output"])], [helper.make_value_info("input", opt_seq)],
                 [helper.make_value_info("output", opt_seq)], opset=16), d / "identity_opt.onnx")
    seq_f = helper.make_sequence_type_proto(helper.make_tensor_type_proto(F, None))
    seq_i = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.INT64, None))
    _save(_model([helper.make_node("SequenceLength", ["X"], ["Y"])], [helper.make_value_info("X", seq_f)],
                 [_vi("Y", TensorProto.INT64, [])]), d / "sequence_length.onnx")
    _save(_model([helper.make_node("SequenceConstruct", ["tensor1", "tensor2"], ["output_sequence"])],
                 [_vi("tensor1", TensorProto.INT64, [2, 3]), _vi("tensor2", TensorProto.INT64, [2, 3])],
                 [helper.make_value_info("output_sequence", seq_i)]), d / "sequence_construct.onnx")
    _save(_model([helper.make_node("SequenceInsert", ["input_seq", "tensor"], ["output_sequence"])],
                 [helper.make_value_info("input_seq", seq_i), _vi("tensor", TensorProto.INT64, [2, 3])],
                 [helper.make_value_info("output_sequence", seq_i)]), d / "sequence_insert.onnx")
    cfg = _model([helper.make_node("Identity", ["x"], ["y"])], [_vi("x", F, [2])], [_vi("y", F, [2])])
    helper.set_model_props(cfg, {"ort_config": json.dumps({"session_options": {
        "inter_op_num_threads": 5, "intra_op_num_threads": 2, "graph_optimization_level": 99,
        "enable_profiling": 1}})})
    _save(cfg, d / "model_with_valid_ort_config_json.onnx")
    x = _vi("x", F, ["Dim1", "Dim2", 5])
    x.type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
    x.type.tensor_type.shape.dim[1].denotation = "DATA_CHANNEL"
    _save(_model([helper.make_node("Abs", ["x"], ["y"])], [x], [_vi("y", F, ["Dim1", "Dim2", 5])]),
          d / "abs_free_dimensions.onnx")
    # Pad whose pads come from a file that is not on disk ("come from user").
    pads = TensorProto(name="Pads_not_on_disk", data_type=TensorProto.INT64, dims=[4],
                       data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "Pads_not_on_disk.bin"), ("offset", "0"), ("length", "32")):
        pads.external_data.add(key=k, value=v)
    _save(_model([helper.make_node("Add", ["x", "Pads_not_on_disk"], ["y"])], [_vi("x", TensorProto.INT64, [4])],
                 [_vi("y", TensorProto.INT64, [4])], [pads]), d / "model_with_external_initializer_come_from_user.onnx")
    # A model whose weights already live in an external file next to it.
    rng = np.random.default_rng(0)
    big = _model([helper.make_node("MatMul", ["X", "W"], ["Y"]), helper.make_node("Add", ["Y", "B"], ["Z"])],
                 [_vi("X", F, [1, 16])], [_vi("Z", F, [1, 16])],
                 [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "W"),
                  numpy_helper.from_array(rng.standard_normal((16,)).astype(np.float32), "B")])
    _save(copy.deepcopy(big), d / "model_with_orig_ext_data.onnx", save_as_external_data=True,
          location="model_with_orig_ext_data.bin", size_threshold=0)
    _save(big, d / "mnist.onnx")
    _save(_model([helper.make_node("Add", ["a", "b"], ["c"], name="add_0"),
                  helper.make_node("Mul", ["c", "b"], ["d"], name="mul_0"),
                  helper.make_node("Add", ["d", "a"], ["e"], name="add_1")],
                 [_vi("a", F, [2]), _vi("b", F, [2])], [_vi("e", F, [2])]), d / "add_mul_add.onnx")
    (d / "lora").mkdir()
    lora = _model([helper.make_node("MatMul", ["lora_param_a", "lora_param_b"], ["ab"]),
                   helper.make_node("Add", ["weight", "ab"], ["w_eff"]),
                   helper.make_node("MatMul", ["input_x", "w_eff"], ["output"])],
                  [_vi("input_x", F, [4, 4]), _vi("lora_param_a", F, [4, 2]), _vi("lora_param_b", F, [2, 4])],
                  [_vi("output", F, [4, 4])],
                  [numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4) / 4, "weight"),
                   numpy_helper.from_array(np.zeros((4, 2), np.float32), "lora_param_a"),
                   numpy_helper.from_array(np.zeros((2, 4), np.float32), "lora_param_b")])
    _save(lora, d / "lora" / "two_params_lora_model.onnx")
    fmt = onnxruntime.AdapterFormat()  # the adapter file as onnxruntime's tools write it
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters({"lora_param_a": onnxruntime.OrtValue.ortvalue_from_numpy(np.ones((4, 2), np.float32)),
                        "lora_param_b": onnxruntime.OrtValue.ortvalue_from_numpy(np.full((2, 4), 2.0, np.float32))})
    fmt.export_adapter(str(d / "lora" / "two_params_lora_model.onnx_adapter"))


@pytest.fixture(scope="module")
def testdata(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("testdata")
    _build_testdata(d)
    return d


@pytest.fixture
def get_name(testdata, tmp_path, monkeypatch):
    """onnxruntime's ``helper.get_name``; tests also run in a scratch folder (they write files to '.')."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "testdata").mkdir()
    return lambda name: str(testdata / name)


X = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
XX = np.array([[1.0, 4.0], [9.0, 16.0], [25.0, 36.0]], dtype=np.float32)


def _run_model(sess, run_options):
    res = sess.run([], {sess.get_inputs()[0].name: X}, run_options=run_options)
    np.testing.assert_allclose(res[0], XX, rtol=1e-05, atol=1e-08)


# -- the tests -----------------------------------------------------------------------------------


def test_get_version_string(rt):
    assert rt.ort.get_version_string() is not None


def test_get_build_info(rt):
    assert rt.ort.get_build_info() is not None
    assert "Build Info" in rt.ort.get_build_info()


def test_model_serialization(rt, get_name):
    so = rt.ort.SessionOptions()
    so.log_severity_level = 1
    so.logid = "TestModelSerialization"
    so.optimized_model_filepath = "./PythonApiTestOptimizedModel.onnx"
    rt.ort.InferenceSession(get_name("mul_1.onnx"), sess_options=so)
    assert os.path.isfile(so.optimized_model_filepath)


def test_model_serialization_with_external_initializers(rt, get_name):
    so = rt.ort.SessionOptions()
    so.optimized_model_filepath = "./model_with_external_initializers.onnx"
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "external_initializers.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "100")
    rt.ort.InferenceSession(get_name("mnist.onnx"), sess_options=so)
    assert os.path.isfile(so.optimized_model_filepath)
    assert os.path.isfile("external_initializers.bin")


def test_model_serialization_with_external_initializers_to_directory(rt, get_name):
    so = rt.ort.SessionOptions()
    so.optimized_model_filepath = os.path.join("./testdata/", "model_with_external_initializers_in_dir.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                "external_initializers_in_dir.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "100")
    rt.ort.InferenceSession(get_name("mnist.onnx"), sess_options=so)
    assert os.path.isfile(so.optimized_model_filepath)
    assert os.path.isfile(os.path.join("./testdata/", "external_initializers_in_dir.bin"))


def test_model_serialization_with_original_external_initializers_to_directory(rt, get_name):
    so = rt.ort.SessionOptions()
    so.optimized_model_filepath = os.path.join("./testdata/", "model_opt_with_ext_data.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model_opt_with_ext_data.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "20")
    rt.ort.InferenceSession(get_name("model_with_orig_ext_data.onnx"), sess_options=so)
    assert os.path.isfile(so.optimized_model_filepath)
    assert os.path.isfile(os.path.join("./testdata/", "model_opt_with_ext_data.bin"))


def test_model_serialization_with_original_external_initializers_to_current_directory(rt, get_name):
    so = rt.ort.SessionOptions()
    so.optimized_model_filepath = "model_opt_with_ext_data_1.onnx"
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model_opt_with_ext_data_1.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "100")
    session1 = rt.ort.InferenceSession(get_name("model_with_orig_ext_data.onnx"), sess_options=so)
    del session1
    assert os.path.isfile("model_opt_with_ext_data_1.onnx")
    so2 = rt.ort.SessionOptions()
    so2.optimized_model_filepath = "model_opt_with_ext_data_2.onnx"
    so2.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                 "model_opt_with_ext_data_2.bin")
    so2.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "10")
    session2 = rt.ort.InferenceSession("model_opt_with_ext_data_1.onnx", sess_options=so2)
    del session2
    assert os.path.isfile("model_opt_with_ext_data_2.onnx")
    assert os.path.isfile("model_opt_with_ext_data_2.bin")
    os.remove("model_opt_with_ext_data_1.onnx")  # model 2 must load without model 1
    session3 = rt.ort.InferenceSession("model_opt_with_ext_data_2.onnx", sess_options=rt.ort.SessionOptions())
    out = session3.run(None, {"X": np.ones((1, 16), np.float32)})[0]
    assert out.shape == (1, 16)


def test_get_providers(rt, get_name):
    assert "CPUExecutionProvider" in rt.ort.get_available_providers()
    assert rt.ort.get_all_providers()[-1] == "CPUExecutionProvider"
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    assert "CPUExecutionProvider" in sess.get_providers()


def test_enabling_and_disabling_telemetry(rt):
    rt.ort.disable_telemetry_events()
    rt.ort.enable_telemetry_events()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # its raising callback, by design
def test_set_default_logger_callback(rt, get_name):
    assert callable(rt.ort.set_default_logger_callback)
    messages = []

    def my_callback(severity, category, logid, code_location, message):
        messages.append((severity, category, logid, code_location, message))

    rt.ort.set_default_logger_callback(my_callback, severity=0)
    try:
        sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=["CPUExecutionProvider"])
        (res,) = sess.run(["Y"], {"X": X})
        np.testing.assert_allclose(res, X * X)
        assert len(messages) > 0, "logging callback was never invoked"
        for severity, category, logid, code_location, message in messages:
            assert isinstance(severity, int)
            assert isinstance(category, str)
            assert isinstance(logid, str)
            assert isinstance(code_location, str)
            assert isinstance(message, str)
        rt.ort.set_default_logger_callback(None)
        rt.ort.set_default_logger_severity(2)
        (res,) = sess.run(["Y"], {"X": X})
        np.testing.assert_allclose(res, X * X)
        rt.ort.set_default_logger_callback(lambda sev, cat, lid, loc, msg: None)
        rt.ort.set_default_logger_callback(my_callback, severity=0)
        rt.ort.set_default_logger_callback(my_callback, severity=4)
        with pytest.raises(RuntimeError):
            rt.ort.set_default_logger_callback(my_callback, severity=5)
        with pytest.raises(RuntimeError):
            rt.ort.set_default_logger_callback(my_callback, severity=-1)
        with pytest.raises(RuntimeError):
            rt.ort.set_default_logger_callback("not a callable")

        def raising_callback(severity, category, logid, code_location, message):
            raise ValueError("intentional error from callback")

        rt.ort.set_default_logger_callback(raising_callback, severity=0)
        rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=["CPUExecutionProvider"])
    finally:
        rt.ort.set_default_logger_callback(None)
        rt.ort.set_default_logger_severity(2)


def test_deserialization_from_path_object(rt, get_name):
    rt.ort.InferenceSession(pathlib.Path(get_name("mul_1.onnx")), providers=rt.ort.get_available_providers())


def test_invalid_set_providers(rt, get_name):
    with pytest.raises(RuntimeError) as context, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=["CPUExecutionProvider"])
        sess.set_providers(["InvalidProvider"])
    assert "Unknown Provider Type: InvalidProvider" in str(context.value)


def test_run_model_with_optional_sequence_input(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("identity_opt.onnx"))
    x = [np.array([1, 2, 3, 4, 5]).astype(np.float32)]
    res = sess.run([sess.get_outputs()[0].name], {sess.get_inputs()[0].name: x})
    np.testing.assert_allclose(res[0], x)


def test_run_model(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    inputs = sess.get_inputs()
    assert len(inputs) == 1
    assert inputs[0].name == "X"
    assert inputs[0].shape == [3, 2]
    input_meminfos = sess.get_input_memory_infos()
    assert len(input_meminfos) == 1
    assert input_meminfos[0] is not None
    assert len(sess.get_input_epdevices()) == 1
    outputs = sess.get_outputs()
    assert len(outputs) == 1
    assert outputs[0].name == "Y"
    assert outputs[0].shape == [3, 2]
    output_meminfos = sess.get_output_memory_infos()
    assert len(output_meminfos) == 1
    assert output_meminfos[0] is not None
    res = sess.run([outputs[0].name], {inputs[0].name: X})
    np.testing.assert_allclose(res[0], XX, rtol=1e-05, atol=1e-08)


def test_run_async(rt, get_name):
    event = threading.Event()
    seen = {}

    class MyData:
        def __init__(self, id):
            self.__id = id

        def get_id(self):
            return self.__id

    def callback(res, data, err):
        seen.update(err=err, res=res, id=data.get_id())
        event.set()

    so = rt.ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), so, providers=rt.ort.get_available_providers())
    sess.run_async(["Y"], {"X": X}, callback, MyData(123456))
    event.wait(10)
    assert event.is_set()
    assert len(seen["err"]) == 0
    assert len(seen["res"]) == 1
    assert seen["id"] == 123456
    np.testing.assert_allclose(seen["res"][0], XX, rtol=1e-05, atol=1e-08)


def test_run_model_from_bytes(rt, get_name):
    with open(get_name("mul_1.onnx"), "rb") as f:
        content = f.read()
    sess = rt.ort.InferenceSession(content, providers=rt.ort.get_available_providers())
    assert sess.get_inputs()[0].name == "X"
    assert sess.get_inputs()[0].shape == [3, 2]
    assert sess.get_outputs()[0].name == "Y"
    assert sess.get_outputs()[0].shape == [3, 2]
    res = sess.run(["Y"], {"X": X})
    np.testing.assert_allclose(res[0], XX, rtol=1e-05, atol=1e-08)


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "non-contiguous"])
def test_run_model2(rt, get_name, contiguous):
    sess = rt.ort.InferenceSession(get_name("matmul_1.onnx"), providers=rt.ort.get_available_providers())
    x = X if contiguous else np.array([[2.0, 1.0], [4.0, 3.0], [6.0, 5.0]], dtype=np.float32)[:, [1, 0]]
    assert sess.get_inputs()[0].name == "X"
    assert sess.get_inputs()[0].shape == [3, 2]
    assert sess.get_outputs()[0].name == "Y"
    assert sess.get_outputs()[0].shape == [3, 1]
    expected = np.array([[5.0], [11.0], [17.0]], dtype=np.float32)
    np.testing.assert_allclose(sess.run(["Y"], {"X": x})[0], expected, rtol=1e-05, atol=1e-08)
    np.testing.assert_allclose(sess.run(["Y"], {"X": np.ascontiguousarray(x)})[0], expected, rtol=1e-05, atol=1e-08)


def test_run_model_multiple_threads(rt, get_name):
    so = rt.ort.SessionOptions()
    so.log_verbosity_level = 1
    so.logid = "MultiThreadsTest"
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), sess_options=so, providers=rt.ort.get_available_providers())
    errors = queue.Queue()

    def work(name):
        try:
            ro = rt.ort.RunOptions()
            ro.logid = name
            _run_model(sess, ro)
        except Exception as exc:  # surfaced below: a thread's assertion would be lost
            errors.put(exc)

    threads = [threading.Thread(target=work, args=(f"thread{i}",)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors.empty(), errors.get()


def test_list_as_input(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    res = sess.run([], {sess.get_inputs()[0].name: X.tolist()})
    np.testing.assert_allclose(res[0], XX, rtol=1e-05, atol=1e-08)


def test_string_list_as_input(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("identity_string.onnx"))
    x = np.array(["this", "is", "identity", "test"], dtype=str).reshape((2, 2))
    res = sess.run([], {sess.get_inputs()[0].name: x.tolist()})
    np.testing.assert_equal(res[0], x)


def test_run_device(rt):
    device = rt.ort.get_device()
    assert "CPU" in device or "GPU" in device


def test_run_model_symbolic_input(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("matmul_2.onnx"))
    assert sess.get_inputs()[0].name == "X"
    assert sess.get_inputs()[0].shape == ["None", 2]
    assert sess.get_outputs()[0].name == "Y"
    assert sess.get_outputs()[0].shape == ["None", 1]
    res = sess.run(["Y"], {"X": X})
    np.testing.assert_allclose(res[0], np.array([[5.0], [11.0], [17.0]], dtype=np.float32), rtol=1e-05, atol=1e-08)


def test_boolean_inputs(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("logicaland.onnx"), providers=rt.ort.get_available_providers())
    a = np.array([[True, True], [False, False]], dtype=bool)
    b = np.array([[True, False], [True, False]], dtype=bool)
    ins, outs = sess.get_inputs(), sess.get_outputs()
    assert (ins[0].name, ins[0].shape, ins[0].type) == ("input1:0", [2, 2], "tensor(bool)")
    assert (ins[1].name, ins[1].shape, ins[1].type) == ("input:0", [2, 2], "tensor(bool)")
    assert (outs[0].name, outs[0].shape, outs[0].type) == ("output:0", [2, 2], "tensor(bool)")
    res = sess.run(["output:0"], {"input1:0": a, "input:0": b})
    np.testing.assert_equal(res[0], np.array([[True, False], [False, False]], dtype=bool))


STRING_INPUTS = {
    "string_input1": (np.array(["this", "is", "identity", "test"], dtype=str).reshape((2, 2)), None),
    "string_input2": (np.array(["Olá", "你好", "여보세요", "hello"], dtype=str).reshape((2, 2)), None),
    "input_bytes": (np.array([b"this", b"is", b"identity", b"test"]).reshape((2, 2)), "|S8"),
    "input_object": (np.array(["this", "is", "identity", "test"], object).reshape((2, 2)), None),
    "input_void": (np.array([b"must", b"have", b"same", b"size"], dtype=np.void).reshape((2, 2)),
                   np.array([["must", "have"], ["same", "size"]], dtype=object)),
}


@pytest.mark.parametrize("case", list(STRING_INPUTS))
def test_string_inputs(rt, get_name, case):
    """onnxruntime's test_string_input1/2, test_input_bytes, test_input_object, test_input_void."""
    x, expect = STRING_INPUTS[case]
    sess = rt.ort.InferenceSession(get_name("identity_string.onnx"))
    ins, outs = sess.get_inputs(), sess.get_outputs()
    assert (ins[0].name, ins[0].shape, ins[0].type) == ("input:0", [2, 2], "tensor(string)")
    assert (outs[0].name, outs[0].shape, outs[0].type) == ("output:0", [2, 2], "tensor(string)")
    res = sess.run(["output:0"], {"input:0": x})
    if expect is None:
        np.testing.assert_equal(res[0], x)
    elif isinstance(expect, str):
        np.testing.assert_equal(res[0].astype(expect), x)
    else:
        np.testing.assert_equal(res[0], expect)


def test_raise_wrong_num_inputs(rt, get_name):
    with pytest.raises(ValueError) as context:
        sess = rt.ort.InferenceSession(get_name("logicaland.onnx"), providers=rt.ort.get_available_providers())
        sess.run([], {"input:0": np.array([[True, True], [False, False]], dtype=bool)})
    assert "Required inputs (['input1:0']) are missing from input feed (['input:0'])" in str(context.value)


def test_profiler_with_session_options(rt, get_name):
    so = rt.ort.SessionOptions()
    so.enable_profiling = True
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), sess_options=so, providers=rt.ort.get_available_providers())
    sess.run([], {"X": X})
    profile_file = sess.end_profiling()
    tags = ["pid", "dur", "ts", "ph", "X", "name", "args"]
    with open(profile_file) as f:
        lines = f.readlines()
    assert "[" in lines[0]
    for i in range(1, len(lines) - 1):
        for tag in tags:
            assert tag in lines[i]
    assert "]" in lines[-1]


def test_profiler_get_start_time_ns(rt, get_name):
    def start_time():
        so = rt.ort.SessionOptions()
        so.enable_profiling = True
        sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), sess_options=so, providers=rt.ort.get_available_providers())
        t = sess.get_profiling_start_time_ns()
        os.remove(sess.end_profiling())
        return t

    t1, t2, t3 = start_time(), start_time(), start_time()
    assert t1 <= t2 <= t3


def test_graph_optimization_level(rt, get_name):
    opt = rt.ort.SessionOptions()
    assert opt.graph_optimization_level == rt.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opt.graph_optimization_level = rt.ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    assert opt.graph_optimization_level == rt.ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    sess = rt.ort.InferenceSession(get_name("logicaland.onnx"), sess_options=opt, providers=rt.ort.get_available_providers())
    a = np.array([[True, True], [False, False]], dtype=bool)
    b = np.array([[True, False], [True, False]], dtype=bool)
    sess.run([], {"input1:0": a, "input:0": b})


def test_sequence_length(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("sequence_length.onnx"))
    x = [np.array([1.0, 0.0, 3.0, 44.0, 23.0, 11.0], dtype=np.float32).reshape((2, 3))] * 2
    assert (sess.get_inputs()[0].name, sess.get_inputs()[0].type) == ("X", "seq(tensor(float))")
    assert (sess.get_outputs()[0].name, sess.get_outputs()[0].type) == ("Y", "tensor(int64)")
    res = sess.run(["Y"], {"X": x})
    assert np.array(2, dtype=np.int64) == res[0]


def test_sequence_construct(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("sequence_construct.onnx"))
    assert sess.get_inputs()[0].type == "tensor(int64)"
    assert sess.get_inputs()[1].type == "tensor(int64)"
    assert (sess.get_inputs()[0].name, sess.get_inputs()[1].name) == ("tensor1", "tensor2")
    assert (sess.get_outputs()[0].name, sess.get_outputs()[0].type) == ("output_sequence", "seq(tensor(int64))")
    t1 = np.array([1, 0, 3, 44, 23, 11], dtype=np.int64).reshape((2, 3))
    t2 = np.array([1, 2, 3, 4, 5, 6], dtype=np.int64).reshape((2, 3))
    res = sess.run(["output_sequence"], {"tensor1": t1, "tensor2": t2})
    np.testing.assert_array_equal(res[0], [t1, t2])


def test_sequence_insert(rt, get_name):
    opt = rt.ort.SessionOptions()
    opt.execution_mode = rt.ort.ExecutionMode.ORT_SEQUENTIAL
    sess = rt.ort.InferenceSession(get_name("sequence_insert.onnx"), sess_options=opt)
    assert sess.get_inputs()[0].type == "seq(tensor(int64))"
    assert sess.get_inputs()[1].type == "tensor(int64)"
    assert (sess.get_inputs()[0].name, sess.get_inputs()[1].name) == ("input_seq", "tensor")
    assert (sess.get_outputs()[0].name, sess.get_outputs()[0].type) == ("output_sequence", "seq(tensor(int64))")
    t = np.array([1, 0, 3, 44, 23, 11], dtype=np.int64).reshape((2, 3))
    res = sess.run(["output_sequence"], {"tensor": t, "input_seq": []})
    np.testing.assert_array_equal(res[0], [t])


def test_ort_execution_mode(rt):
    opt = rt.ort.SessionOptions()
    assert opt.execution_mode == rt.ort.ExecutionMode.ORT_SEQUENTIAL
    opt.execution_mode = rt.ort.ExecutionMode.ORT_PARALLEL
    assert opt.execution_mode == rt.ort.ExecutionMode.ORT_PARALLEL


def test_loading_session_options_from_model(rt, get_name, monkeypatch):
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    sess = rt.ort.InferenceSession(get_name("model_with_valid_ort_config_json.onnx"),
                                   providers=rt.ort.get_available_providers())
    session_options = sess.get_session_options()
    assert session_options.inter_op_num_threads == 5
    assert session_options.intra_op_num_threads == 2
    assert session_options.execution_mode == rt.ort.ExecutionMode.ORT_SEQUENTIAL
    assert session_options.graph_optimization_level == rt.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert session_options.enable_profiling
    os.remove(sess.end_profiling())


@pytest.mark.parametrize("how,overrides,expected", [
    ("denotation", [("DATA_BATCH", 3), ("DATA_CHANNEL", 5)], [3, 5, 5]),
    ("name", [("Dim1", 4), ("Dim2", 6)], [4, 6, 5]),
], ids=["by_denotation", "by_name"])
def test_session_options_add_free_dimension_override(rt, get_name, how, overrides, expected):
    so = rt.ort.SessionOptions()
    for key, value in overrides:
        getattr(so, f"add_free_dimension_override_by_{how}")(key, value)
    sess = rt.ort.InferenceSession(get_name("abs_free_dimensions.onnx"), sess_options=so,
                                   providers=rt.ort.get_available_providers())
    assert sess.get_inputs()[0].name == "x"
    assert sess.get_inputs()[0].shape == expected


def test_session_options_add_config_entry(rt):
    so = rt.ort.SessionOptions()
    so.add_session_config_entry("CONFIG_KEY", "CONFIG_VAL")
    assert so.get_session_config_entry("CONFIG_KEY") == "CONFIG_VAL"


def test_invalid_session_options_config_entry(rt):
    so = rt.ort.SessionOptions()
    with pytest.raises(RuntimeError) as context:
        so.get_session_config_entry("INVALID_KEY")
    assert "SessionOptions does not have configuration with key: INVALID_KEY" in str(context.value)


def test_session_options_add_initializer(rt, get_name):
    so = rt.ort.SessionOptions()
    value = rt.ort.OrtValue.ortvalue_from_numpy(np.array([[2.0, 1.0], [4.0, 3.0], [6.0, 5.0]], dtype=np.float32))
    so.add_initializer("W", value)
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), sess_options=so, providers=["CPUExecutionProvider"])
    res = sess.run(["Y"], {"X": X})
    assert np.array_equal(res[0], np.array([[2.0, 2.0], [12.0, 12.0], [30.0, 30.0]], dtype=np.float32))


def test_session_options_add_external_initializers(rt, get_name):
    value = rt.ort.OrtValue.ortvalue_from_numpy(np.array([0, 0, 1, 1]).astype(np.int64))
    so = rt.ort.SessionOptions()
    so.add_external_initializers(["Pads_not_on_disk"], [value])
    sess = rt.ort.InferenceSession(get_name("model_with_external_initializer_come_from_user.onnx"), sess_options=so,
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {"x": np.arange(4, dtype=np.int64)})[0], [0, 1, 3, 4])


def test_session_options_add_external_initializers_from_files_in_memory(rt, get_name):
    pads_bytes = np.array([0, 0, 1, 1], dtype=np.int64).tobytes()
    so = rt.ort.SessionOptions()
    so.add_external_initializers_from_files_in_memory(["Pads_not_on_disk.bin"], [pads_bytes], [len(pads_bytes)])
    sess = rt.ort.InferenceSession(get_name("model_with_external_initializer_come_from_user.onnx"), sess_options=so,
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {"x": np.arange(4, dtype=np.int64)})[0], [0, 1, 3, 4])


def test_register_custom_ops_library_missing_library_fails(rt):
    """onnxruntime's test needs its prebuilt custom-op library; without one both fail alike."""
    so = rt.ort.SessionOptions()
    with pytest.raises(rt.state.Fail, match="Failed to load library"):
        so.register_custom_ops_library("./libcustom_op_library.so")


def test_ort_value(rt, get_name):
    ortvalue1 = rt.ort.OrtValue.ortvalue_from_numpy(X)
    assert ortvalue1.device_name() == "cpu"
    assert ortvalue1.shape() == [3, 2]
    assert ortvalue1.data_type() == "tensor(float)"
    assert ortvalue1.is_tensor()
    assert ortvalue1.tensor_size_in_bytes() == 4 * 2 * 3
    assert np.array_equal(ortvalue1.numpy(), X)
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    assert np.array_equal(sess.run(["Y"], {"X": ortvalue1})[0], XX)
    vect = sess.run_with_ort_values(["Y"], {"X": ortvalue1}, rt.ort.RunOptions())
    assert isinstance(vect, list) and np.array_equal(vect[0].numpy(), XX)
    assert np.array_equal(ortvalue1.numpy(), X)
    with_type = rt.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(X, 1)
    assert with_type.is_tensor()
    assert with_type.element_type() == 1
    assert with_type.shape() == [3, 2]


@pytest.mark.parametrize("shape", [(1, 8, 0, 128), (0,), (0, 4), (4, 0), (3, 2)],
                         ids=["kv-cache", "0", "0x4", "4x0", "3x2"])
def test_ort_value_dlpack(rt, shape):
    """onnxruntime's test_ort_value_dlpack(_zero_size) and _dlpack_protocol, through the public API."""
    arr = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    ortvalue = rt.ort.OrtValue.ortvalue_from_numpy(arr)
    assert ortvalue.__dlpack_device__() == (1, 0)
    ortvalue2 = rt.ort.OrtValue.from_dlpack(ortvalue.__dlpack__())
    assert list(ortvalue2.shape()) == list(shape)
    np.testing.assert_equal(ortvalue2.numpy(), arr)
    if arr.size:
        assert ortvalue2.data_ptr() == ortvalue.data_ptr()


def test_ort_value_array_protocol(rt):
    numpy_arr = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    ortvalue = rt.ort.OrtValue.ortvalue_from_numpy(numpy_arr)
    result = np.asarray(ortvalue)
    np.testing.assert_equal(numpy_arr, result)
    assert result.dtype == np.float32
    assert ortvalue.data_ptr() == result.ctypes.data
    np.testing.assert_equal(numpy_arr, np.array(ortvalue))
    same = np.asarray(ortvalue, dtype=np.float32)
    assert ortvalue.data_ptr() == same.ctypes.data
    f64 = np.asarray(ortvalue, dtype=np.float64)
    np.testing.assert_equal(numpy_arr.astype(np.float64), f64)
    assert f64.dtype == np.float64
    for arr in (np.array([1, 2, 3], dtype=np.int64), np.array([True, False, True], dtype=np.bool_)):
        out = np.asarray(rt.ort.OrtValue.ortvalue_from_numpy(arr))
        np.testing.assert_equal(arr, out)
        assert out.dtype == arr.dtype


def test_run_output_does_not_alias_input_passthrough(rt):
    shape = [1, 2, 2, 2]
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["input_0", "ten_const"], ["plus_10"], name="Add0")], "PassthroughTest",
        [_vi("input_0", F, shape)], [_vi("plus_10", F, shape), _vi("input_0", F, shape)],
        initializer=[numpy_helper.from_array(np.array(10, dtype=np.float32), "ten_const")]),
        opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    so = rt.ort.SessionOptions()
    so.graph_optimization_level = rt.ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = rt.ort.InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
    all_outputs = []
    for k in range(7):
        data = np.full(shape, float(k), dtype=np.float32)
        outputs = session.run(None, {"input_0": data})
        np.testing.assert_array_equal(outputs[0], np.full(shape, k + 10.0, dtype=np.float32))
        np.testing.assert_array_equal(outputs[1], np.full(shape, float(k), dtype=np.float32))
        assert not np.shares_memory(outputs[1], data)
        all_outputs.append(outputs)
    for k, outputs in enumerate(all_outputs):
        np.testing.assert_array_equal(outputs[0], np.full(shape, k + 10.0, dtype=np.float32))
        np.testing.assert_array_equal(outputs[1], np.full(shape, float(k), dtype=np.float32))


def test_run_session_owned_output_is_zero_copy(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=["CPUExecutionProvider"])
    output = sess.run(None, {sess.get_inputs()[0].name: X})[0]
    assert output.base is not None, "Session-owned output should have a backing base object"


def test_ort_value_from_dlpack_protocol_object(rt):
    numpy_arr = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    ortvalue = rt.ort.OrtValue.from_dlpack(numpy_arr)
    np.testing.assert_equal(numpy_arr, ortvalue.numpy())
    assert list(numpy_arr.shape) == list(ortvalue.shape())
    src = rt.ort.OrtValue.ortvalue_from_numpy(numpy_arr)
    dst = rt.ort.OrtValue.from_dlpack(src)
    np.testing.assert_equal(numpy_arr, dst.numpy())
    assert src.data_ptr() == dst.data_ptr()


def test_ort_value_from_dlpack_bool(rt):
    bool_arr = np.array([True, False, True, False], dtype=np.bool_)
    np.testing.assert_equal(bool_arr, rt.ort.OrtValue.from_dlpack(rt.ort.OrtValue.ortvalue_from_numpy(bool_arr)).numpy())
    uint8_arr = np.array([1, 2, 255], dtype=np.uint8)
    out = rt.ort.OrtValue.from_dlpack(rt.ort.OrtValue.ortvalue_from_numpy(uint8_arr)).numpy()
    np.testing.assert_equal(uint8_arr, out)
    assert out.dtype == np.uint8


def test_sparse_tensor_coo_format(rt):
    cpu_device = rt.ort.OrtDevice.make("cpu", 0)
    shape = [9, 9]
    values = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    indices = np.array([3, 5, 15], dtype=np.int64)
    sparse_tensor = rt.ort.SparseTensor.sparse_coo_from_numpy(shape, values, indices, cpu_device)
    assert sparse_tensor.format() == rt.ort.OrtSparseFormat.ORT_SPARSE_COO
    assert sparse_tensor.dense_shape() == shape
    assert sparse_tensor.data_type() == "sparse_tensor(float)"
    assert sparse_tensor.device_name() == "cpu"
    values_ret = sparse_tensor.values()
    assert not values_ret.flags.writeable
    indices_ret = sparse_tensor.as_coo_view().indices()
    assert not indices_ret.flags.writeable
    gc.collect()
    assert np.array_equal(values, values_ret)
    assert np.array_equal(indices, indices_ret)
    ort_value = rt.ort.OrtValue.ort_value_from_sparse_tensor(sparse_tensor)
    sparse_tensor = ort_value.as_sparse_tensor()
    assert not sparse_tensor.values().flags.writeable
    assert not sparse_tensor.as_coo_view().indices().flags.writeable
    str_values = np.array(["xyz", "yxz", "zyx"], dtype=str)
    str_sparse_tensor = rt.ort.SparseTensor.sparse_coo_from_numpy(shape, str_values, indices, cpu_device)
    assert str_sparse_tensor.format() == rt.ort.OrtSparseFormat.ORT_SPARSE_COO
    assert str_sparse_tensor.dense_shape() == shape
    assert str_sparse_tensor.data_type() == "sparse_tensor(string)"
    assert str_sparse_tensor.device_name() == "cpu"
    assert np.array_equal(str_values, str_sparse_tensor.values())
    str_indices_ret = str_sparse_tensor.as_coo_view().indices()
    gc.collect()
    assert not str_indices_ret.flags.writeable
    assert np.array_equal(indices, str_indices_ret)
    with pytest.raises(RuntimeError):
        sparse_tensor.to_cuda(rt.ort.OrtDevice.make("cuda", 0))


def test_sparse_tensor_csr_format(rt):
    cpu_device = rt.ort.OrtDevice.make("cpu", 0)
    shape = [9, 9]
    values = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    inner_indices = np.array([1, 1, 1], dtype=np.int64)
    outer_indices = np.array([0, 1, 2, 3, 3, 3, 3, 3, 3, 3], dtype=np.int64)
    sparse_tensor = rt.ort.SparseTensor.sparse_csr_from_numpy(shape, values, inner_indices, outer_indices, cpu_device)
    assert sparse_tensor.format() == rt.ort.OrtSparseFormat.ORT_SPARSE_CSRC
    assert sparse_tensor.dense_shape() == shape
    assert sparse_tensor.data_type() == "sparse_tensor(float)"
    assert sparse_tensor.device_name() == "cpu"
    inner_ret = sparse_tensor.as_csrc_view().inner()
    outer_ret = sparse_tensor.as_csrc_view().outer()
    assert not inner_ret.flags.writeable and not outer_ret.flags.writeable
    gc.collect()
    assert np.array_equal(inner_indices, inner_ret)
    assert np.array_equal(outer_indices, outer_ret)
    str_sparse_tensor = rt.ort.SparseTensor.sparse_csr_from_numpy(
        shape, np.array(["xyz", "yxz", "zyx"], dtype=str), inner_indices, outer_indices, cpu_device)
    assert str_sparse_tensor.format() == rt.ort.OrtSparseFormat.ORT_SPARSE_CSRC
    assert str_sparse_tensor.dense_shape() == shape
    assert str_sparse_tensor.data_type() == "sparse_tensor(string)"
    assert str_sparse_tensor.device_name() == "cpu"


def test_ort_device(rt):
    cpu_device = rt.ort.OrtDevice.make("cpu", 0)
    assert cpu_device.device_id() == 0
    assert cpu_device.device_type() == 0
    assert cpu_device.device_vendor_id() == rt.ort.OrtDeviceVendorId.NONE
    assert cpu_device.device_mem_type() == 0
    cuda_device = rt.ort.OrtDevice.make("cuda", 0)
    assert cuda_device.device_vendor_id() == rt.ort.OrtDeviceVendorId.NVIDIA
    assert rt.ort.OrtDeviceVendorId.NVIDIA == 0x10DE


def test_ort_memory_info(rt):
    info = rt.ort.OrtMemoryInfo("Cpu", rt.ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, rt.ort.OrtMemType.DEFAULT)
    assert info.name == "Cpu"
    assert info.device_id == 0
    assert info.mem_type == rt.ort.OrtMemType.DEFAULT
    assert info.allocator_type == rt.ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR
    assert info.device_mem_type == rt.ort.OrtDeviceMemoryType.DEFAULT
    assert info.device_vendor_id == 0


def test_ort_memory_info_create_v2(rt):
    info = rt.ort.OrtMemoryInfo.create_v2("Test", rt.ort.OrtMemoryInfoDeviceType.CPU, 0, 0,
                                          rt.ort.OrtDeviceMemoryType.DEFAULT, 128,
                                          rt.ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR)
    assert info.name == "Test"
    assert info.device_id == 0
    assert info.mem_type == rt.ort.OrtMemType.DEFAULT
    assert info.allocator_type == rt.ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR
    assert info.device_mem_type == rt.ort.OrtDeviceMemoryType.DEFAULT
    assert info.device_vendor_id == 0


def test_shared_allocator_using_create_and_register_allocator(rt, get_name):
    info = rt.ort.OrtMemoryInfo("Cpu", rt.ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, rt.ort.OrtMemType.DEFAULT)
    rt.ort.create_and_register_allocator(info, None)
    so1 = rt.ort.SessionOptions()
    so1.log_severity_level = 1
    so1.add_session_config_entry("session.use_env_allocators", "1")
    rt.ort.InferenceSession(get_name("mul_1.onnx"), sess_options=so1, providers=rt.ort.get_available_providers())
    so2 = rt.ort.SessionOptions()
    so2.log_severity_level = 1
    rt.ort.InferenceSession(get_name("mul_1.onnx"), sess_options=so2, providers=rt.ort.get_available_providers())


def test_memory_arena_shrinkage(rt, get_name):
    sess = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=["CPUExecutionProvider"])
    ro = rt.ort.RunOptions()
    ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    assert ro.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    sess.run([], {sess.get_inputs()[0].name: X}, ro)


def test_check_and_normalize_provider_args(rt):
    check = rt.collection.check_and_normalize_provider_args
    valid = ["a", "b", "c"]

    def check_success(providers, provider_options, expected_providers, expected_provider_options):
        actual_providers, actual_options = check(providers, provider_options, valid)
        assert actual_providers == expected_providers
        assert actual_options == expected_provider_options

    check_success(None, None, [], [])
    check_success(["a"], None, ["a"], [{}])
    check_success(["a", "b"], None, ["a", "b"], [{}, {}])
    check_success([("a", {1: 2}), "b"], None, ["a", "b"], [{"1": "2"}, {}])
    check_success(["a", "b"], [{1: 2}, {}], ["a", "b"], [{"1": "2"}, {}])
    with pytest.warns(UserWarning):
        check_success(["a", "b", "a"], [{"x": 1}, {}, {"y": 2}], ["a", "b"], [{"x": "1"}, {}])
    for providers, options in ((3, None), ([3], None), (["a"], 3), (["a"], ["not dict"]), (["a", "b"], [{1: 2}]),
                               ([("a", {1: 2})], [{3: 4}])):
        with pytest.raises(ValueError):
            check(providers, options, valid)


def test_create_allocator(rt):
    def verify(cfg, expected):
        for key, val in expected.items():
            assert getattr(cfg, key) == val, key

    verify(rt.ort.OrtArenaCfg(8, 0, 4, 2), {"max_mem": 8, "arena_extend_strategy": 0,
                                            "initial_chunk_size_bytes": 4, "max_dead_bytes_per_chunk": 2})
    for kvp in ({"max_mem": 16, "arena_extend_strategy": 1, "initial_chunk_size_bytes": 8,
                 "max_dead_bytes_per_chunk": 4, "initial_growth_chunk_size_bytes": 2},
                {"max_mem": 32, "arena_extend_strategy": 11, "initial_chunk_size_bytes": 18,
                 "max_dead_bytes_per_chunk": 14, "initial_growth_chunk_size_bytes": 12,
                 "max_power_of_two_extend_bytes": 17}):
        verify(rt.ort.OrtArenaCfg(kvp), kvp)


def test_adapter_export_read(rt, tmp_path):
    """onnxruntime's test_adater_export_read, plus the files read by the other runtime."""
    val = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    params = {"param_1": rt.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                  np.array(val).astype(np.float32).reshape(5, 2), 1),
              "param_2": rt.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                  np.array(val).astype(np.int64).reshape(2, 5), 7)}
    fmt = rt.ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters(params)
    path = str(tmp_path / "test_adapter.onnx_adapter")
    fmt.export_adapter(path)
    for reader in (rt.ort, onnxpack if rt.ort is onnxruntime else onnxruntime):
        read = reader.AdapterFormat.read_adapter(path)
        assert read.get_adapter_version() == 1
        assert read.get_model_version() == 1
        actual = read.get_parameters()
        assert sorted(actual) == sorted(params)
        for key, value in actual.items():
            assert value.is_tensor()
            assert params[key].element_type() == value.element_type()
            assert params[key].shape() == value.shape()
            np.testing.assert_allclose(value.numpy(), params[key].numpy())


def test_run_with_adapter(rt, get_name):
    adapter = rt.ort.LoraAdapter()
    adapter.Load(os.path.abspath(get_name("lora/two_params_lora_model.onnx_adapter")))
    run_options = rt.ort.RunOptions()
    run_options.add_active_adapter(adapter)
    session = rt.ort.InferenceSession(get_name("lora/two_params_lora_model.onnx"))
    outputs = session.run(None, {"input_x": np.ones((4, 4), dtype=np.float32)}, run_options)
    w = np.arange(16, dtype=np.float32).reshape(4, 4) / 4 + np.ones((4, 2), np.float32) @ np.full((2, 4), 2.0, np.float32)
    assert len(outputs) == 1
    np.testing.assert_allclose(outputs[0], np.ones((4, 4), np.float32) @ w)


def test_run_base_model(rt, get_name):
    session = rt.ort.InferenceSession(get_name("lora/two_params_lora_model.onnx"))
    outputs = session.run(None, {"input_x": np.ones((4, 4), dtype=np.float32)}, rt.ort.RunOptions())
    assert len(outputs) == 1
    np.testing.assert_allclose(outputs[0], np.ones((4, 4), np.float32) @ (np.arange(16, dtype=np.float32).reshape(4, 4) / 4))


def test_get_graph_provider_assignment_info(rt, get_name):
    so = rt.ort.SessionOptions()
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = rt.ort.InferenceSession(get_name("add_mul_add.onnx"), sess_options=so)
    ep_subgraphs = session.get_provider_graph_assignment_info()
    assert len(ep_subgraphs) == 3
    for ep_subgraph in ep_subgraphs:
        assert ep_subgraph.ep_name == "CPUExecutionProvider"
        assert len(ep_subgraph.get_nodes()) == 1
    node_ids = [f"{n.domain}:{n.op_type}/{n.name}" for s in ep_subgraphs for n in s.get_nodes()]
    assert sorted(node_ids) == [":Add/add_0", ":Add/add_1", ":Mul/mul_0"]


def test_get_graph_provider_assignment_info_not_enabled(rt, get_name):
    session = rt.ort.InferenceSession(get_name("add_mul_add.onnx"))
    with pytest.raises(rt.state.Fail) as context:
        session.get_provider_graph_assignment_info()
    assert "Session configuration entry 'session.record_ep_graph_assignment_info' must be set to \"1\"" in str(
        context.value)


def _tree_model(nodes_modes, nodes_values, nodes_truenodeids, nodes_falsenodeids, class_treeids, class_nodeids,
                class_weights, **kw):
    n = len(nodes_modes)
    kw.setdefault("base_values", [-0.405])
    node = helper.make_node(
        "TreeEnsembleClassifier", ["X"], ["label", "probs"], domain="ai.onnx.ml", nodes_treeids=[0] * n,
        nodes_nodeids=list(range(n)), nodes_featureids=[0] * n, nodes_values=nodes_values, nodes_modes=nodes_modes,
        nodes_truenodeids=nodes_truenodeids, nodes_falsenodeids=nodes_falsenodeids,
        nodes_missing_value_tracks_true=[0] * n, nodes_hitrates=[1.0] * n, class_treeids=class_treeids,
        class_nodeids=class_nodeids, class_ids=[0] * len(class_weights), class_weights=class_weights,
        classlabels_int64s=[0, 1], post_transform="LOGISTIC", **kw)
    m = helper.make_model(helper.make_graph([node], "test", [_vi("X", F, [None, 3])],
                                            [_vi("label", TensorProto.INT64, [None]), _vi("probs", F, [None, 2])]),
                          opset_imports=[helper.make_opsetid("", 15), helper.make_opsetid("ai.onnx.ml", 3)])
    m.ir_version = 9
    return m.SerializeToString()


def test_tree_ensemble_logistic(rt):
    x = {"X": np.array([[0.1, 0.0, 0.0]], dtype=np.float32)}
    split = _tree_model(["BRANCH_LT", "LEAF", "LEAF"], [0.5, 0.0, 0.0], [1, 0, 0], [2, 0, 0], [0, 0], [1, 2], [0.3, -0.3])
    np.testing.assert_allclose(rt.ort.InferenceSession(split).run(None, x)[1][0][1], 1 / (1 + np.exp(0.105)), atol=1e-5)
    leaf = _tree_model(["LEAF"], [0.0], [0], [0], [0], [0], [0.0])
    expected = 1 / (1 + np.exp(0.405))
    np.testing.assert_allclose(rt.ort.InferenceSession(leaf).run(None, x)[1][0][1], expected, atol=1e-5)
    leaf_neg = _tree_model(["LEAF"], [0.0], [0], [0], [0], [0], [-0.405], base_values=[0.0])
    np.testing.assert_allclose(rt.ort.InferenceSession(leaf_neg).run(None, x)[1][0][1], expected, atol=1e-5)


# -- onnxruntime_test_python_iobinding.py, device "cpu" ------------------------------------------

ALTERNATE = np.array([[2.0, 4.0], [6.0, 8.0], [10.0, 12.0]], dtype=np.float32)
ALTERNATE_OUT = np.array([[2.0, 8.0], [18.0, 32.0], [50.0, 72.0]], dtype=np.float32)


def test_bind_input_to_cpu_arr(rt, get_name):
    session = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    io_binding = session.io_binding()
    io_binding.bind_cpu_input("X", X)
    io_binding.bind_output("Y")
    session.run_with_iobinding(io_binding)
    io_binding.synchronize_outputs()
    assert np.array_equal(XX, io_binding.copy_outputs_to_cpu()[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint32, np.int64, np.uint64, np.int16,
                                   np.uint16, np.int8, np.uint8, np.float16, np.bool_],
                         ids=lambda d: np.dtype(d).name)
def test_bind_input_types(rt, dtype):
    x = np.arange(8).reshape((-1, 2)).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["X"], ["Y"])], "lr",
                                                [_vi("X", elem, [None, 2])], [_vi("Y", elem, [None, 2])]),
                              ir_version=7, opset_imports=[helper.make_operatorsetid("", 17)])
    sess = rt.ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ort_value = rt.ort.OrtValue.ortvalue_from_numpy(x)
    bind = sess.io_binding()
    bind.bind_ortvalue_input("X", ort_value)
    bind.bind_output("Y", "cpu")
    sess.run_with_iobinding(bind)
    np.testing.assert_almost_equal(x, bind.get_outputs()[0].numpy())
    bind = sess.io_binding()
    bind.bind_input("X", "cpu", 0, dtype, x.shape, ort_value.data_ptr())
    bind.bind_output("Y", "cpu")
    sess.run_with_iobinding(bind)
    np.testing.assert_almost_equal(x, bind.get_outputs()[0].numpy())


def test_bind_input_only(rt, get_name):
    value = rt.ort.OrtValue.ortvalue_from_numpy(X, "cpu", 0)
    session = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    io_binding = session.io_binding()
    io_binding.bind_input("X", "cpu", 0, np.float32, [3, 2], value.data_ptr())
    io_binding.synchronize_inputs()
    io_binding.bind_output("Y")
    session.run_with_iobinding(io_binding)
    io_binding.synchronize_outputs()
    assert np.array_equal(XX, io_binding.copy_outputs_to_cpu()[0])


def test_bind_input_and_preallocated_output(rt, get_name):
    value = rt.ort.OrtValue.ortvalue_from_numpy(X, "cpu", 0)
    session = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    io_binding = session.io_binding()
    io_binding.bind_input("X", "cpu", 0, np.float32, [3, 2], value.data_ptr())
    output = rt.ort.OrtValue.ortvalue_from_shape_and_type([3, 2], np.float32, "cpu", 0)
    io_binding.bind_output("Y", "cpu", 0, np.float32, [3, 2], output.data_ptr())
    io_binding.synchronize_inputs()
    session.run_with_iobinding(io_binding)
    io_binding.synchronize_outputs()
    assert np.array_equal(XX, io_binding.copy_outputs_to_cpu()[0])
    assert np.array_equal(XX, output.numpy())  # written into the preallocated buffer


def test_bind_input_and_non_preallocated_output(rt, get_name):
    session = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    io_binding = session.io_binding()
    value = rt.ort.OrtValue.ortvalue_from_numpy(X, "cpu", 0)
    io_binding.bind_input("X", "cpu", 0, np.float32, [3, 2], value.data_ptr())
    io_binding.bind_output("Y", "cpu")
    io_binding.synchronize_inputs()
    session.run_with_iobinding(io_binding)
    io_binding.synchronize_outputs()
    for _ in range(2):
        ort_outputs = io_binding.get_outputs()
        assert len(ort_outputs) == 1
        assert ort_outputs[0].device_name() == "cpu"
        assert np.array_equal(XX, ort_outputs[0].numpy())
    value2 = rt.ort.OrtValue.ortvalue_from_numpy(ALTERNATE, "cpu", 0)
    io_binding.bind_input("X", "cpu", 0, np.float32, [3, 2], value2.data_ptr())
    io_binding.synchronize_inputs()
    session.run_with_iobinding(io_binding)
    io_binding.synchronize_outputs()
    ort_outputs = io_binding.get_outputs()
    assert len(ort_outputs) == 1
    assert ort_outputs[0].device_name() == "cpu"
    assert np.array_equal(ALTERNATE_OUT, ort_outputs[0].numpy())


def test_bind_input_and_bind_output_with_ortvalues(rt, get_name):
    session = rt.ort.InferenceSession(get_name("mul_1.onnx"), providers=rt.ort.get_available_providers())
    io_binding = session.io_binding()
    io_binding.bind_ortvalue_input("X", rt.ort.OrtValue.ortvalue_from_numpy(X, "cpu", 0))
    output_ortvalue = rt.ort.OrtValue.ortvalue_from_shape_and_type([3, 2], np.float32, "cpu", 0)
    io_binding.bind_ortvalue_output("Y", output_ortvalue)
    io_binding.synchronize_inputs()
    session.run_with_iobinding(io_binding)
    io_binding.synchronize_outputs()
    assert np.array_equal(XX, output_ortvalue.numpy())
    io_binding.bind_ortvalue_input("X", rt.ort.OrtValue.ortvalue_from_numpy(ALTERNATE, "cpu", 0))
    io_binding.synchronize_inputs()
    session.run_with_iobinding(io_binding)
    io_binding.synchronize_outputs()
    assert np.array_equal(ALTERNATE_OUT, output_ortvalue.numpy())
