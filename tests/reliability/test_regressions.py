"""Regression tests for what the reliability fuzzer found (one test per fix)."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpack import InferenceSession, SessionOptions
from onnxpack.errors import ModelLoadError, PrepackWarning
from onnxpack.graph import load_model

import reliability_harness as harness


def _write(folder, files):
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return folder


def _matmul_model(w: TensorProto) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("MatMul", ["x", w.name], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_invalid_utf8_location_is_a_model_load_error(bases, tmp_path):
    # protobuf hands invalid UTF-8 in a string field to Python as bytes; it used to escape as
    # TypeError from the location check.
    base = bases["mlp"]
    raw = base["files"][base["entry"]]
    loc = b"mlp.onnx.data"
    assert loc in raw
    _write(tmp_path, base["files"])
    _write(tmp_path, {base["entry"]: raw.replace(loc, b"mlp.onnx.d\xffta", 1)})
    with pytest.raises(ModelLoadError, match="not valid UTF-8"):
        InferenceSession(str(tmp_path / base["entry"]))


@pytest.mark.parametrize("elem,dims", [(TensorProto.FLOAT, [4, 3]), (TensorProto.FLOAT16, [4, 3]),
                                       (TensorProto.INT64, [4, 3]), (TensorProto.STRING, [1, 32]),
                                       (TensorProto.FLOAT, [10**6, 10**6])],
                         ids=["float", "float16", "int64", "string", "1e12-elements"])
def test_in_proto_tensor_without_data_is_a_model_load_error(elem, dims):
    # It used to escape as ValueError (numpy reshape) from session creation.
    w = TensorProto(name="W", data_type=elem, dims=dims)
    with pytest.raises(ModelLoadError, match="expected"):
        load_model(_matmul_model(w).SerializeToString())


def test_in_proto_typed_data_still_loads():
    w = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], np.arange(12, dtype=np.float32).tolist())
    x = np.ones((2, 4), np.float32)
    with InferenceSession(_matmul_model(w).SerializeToString()) as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], x @ np.arange(12, dtype=np.float32).reshape(4, 3))


def test_small_cache_entry_is_crc_checked(bases, tmp_path):
    # A corrupt small region of the cache file used to reach the kernel (no CRC without
    # verify_prepacked) and give silently wrong outputs.
    base = bases["fuzzmix+cache"]
    data = bytearray(base["files"]["packed.cache"])
    off, length = min(base["cache"]["regions"], key=lambda r: r[1])
    assert length < 64 * 1024
    data[off + length // 2] ^= 0x10
    _write(tmp_path, base["files"])
    _write(tmp_path, {"packed.cache": bytes(data)})
    opts = SessionOptions()
    opts.add_session_config_entry("onnxpack.prepacked_cache_path", str(tmp_path / "packed.cache"))
    with pytest.warns(PrepackWarning, match="CRC"):
        s = InferenceSession(str(tmp_path / base["entry"]), opts)
    with s:
        for got, want in zip(s.run(None, base["feeds"]), base["expected"]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shift", [-64, 64, -4096], ids=["back64", "fwd64", "back4096"])
def test_large_blob_offset_pointing_at_other_bytes_is_rejected(bases, tmp_path, shift):
    # Blobs >= 64 KiB are not CRC-checked at load; a record pointing them at a weight's bytes
    # used to give silently wrong outputs.
    base = bases["fuzzmix"]
    proto = onnx.ModelProto.FromString(base["files"][base["entry"]])
    prop = next(p for p in proto.metadata_props if p.key.endswith("/Wh"))
    prefix, body = prop.value.split(";", 1)
    obj = json.loads(body)
    buf = obj["packs"][0]["buffers"][0]
    assert buf["length"] >= 64 * 1024
    buf["offset"] += shift
    prop.value = prefix + ";" + json.dumps(obj, separators=(",", ":"))
    _write(tmp_path, base["files"])
    _write(tmp_path, {base["entry"]: proto.SerializeToString()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = InferenceSession(str(tmp_path / base["entry"]))
    assert any(issubclass(w.category, PrepackWarning) and "overlaps" in str(w.message) for w in caught)
    with s:
        assert s.get_prepack_stats()["blobs_rejected"] >= 1
        for got, want in zip(s.run(None, base["feeds"]), base["expected"]):
            np.testing.assert_array_equal(got, want)


def test_equal_weights_sharing_one_blob_are_not_overlaps(tmp_path):
    # Content keys let two equal weights share one blob: same range, same key, not a conflict.
    # fp16 weights: their pack (widened to fp32) is made whatever the policy on fp32 weights.
    w = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float16)
    inits = [numpy_helper.from_array(w, "A"), numpy_helper.from_array(w.copy(), "B")]
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "A"], ["ya"]), helper.make_node("MatMul", ["x", "B"], ["yb"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64])],
        [helper.make_tensor_value_info("ya", TensorProto.FLOAT16, [2, 512]),
         helper.make_tensor_value_info("yb", TensorProto.FLOAT16, [2, 512])], inits)
    src = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    opts = SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "o.onnx")
    opts.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    InferenceSession(str(src), opts).close()
    x = np.ones((2, 64), np.float16)
    out, stats = harness.outputs_of(str(tmp_path / "o.onnx"), {"x": x})
    assert stats["blobs_rejected"] == 0 and stats["blobs_from_model"] + stats["blobs_from_container"] == 2
    want = x.astype(np.float32) @ w.astype(np.float32)
    for got in out:
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_attribute_of_the_wrong_type_is_an_invalid_graph():
    # A ReduceMean/Softmax-style "axis" stored as a float list used to escape as TypeError from
    # the kernel's constructor (found by the proto fuzzer: bit flips in an attribute's type).
    from onnxpack.errors import InvalidGraph

    node = helper.make_node("Softmax", ["x"], ["y"])
    node.attribute.append(helper.make_attribute("axis", [1.5, 2.5]))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises((InvalidGraph, ModelLoadError)):
        InferenceSession(m.SerializeToString())


# -- issue 12, round two: what the consistent-forgery, live-file and attribute families found ------


def _optimized_twin(folder):
    """fuzztwin optimized into ``folder/m.onnx`` (just saved: its data file is sealed and trusted),
    its feeds and its outputs."""
    from onnxpack.session import optimize

    src_dir = os.path.join(folder, "src")
    os.makedirs(src_dir)
    src, feeds = harness.build_model(harness.FUZZTWIN, src_dir)
    out = os.path.join(folder, "m.onnx")
    optimize(src, out)
    expected, stats = harness.outputs_of(out, feeds)
    assert stats["weights_packed"] == 0 and stats["blobs_from_model"] >= 6
    return out, feeds, expected


def _run_warned(path, feeds, config=None):
    opts = SessionOptions()
    for k, v in (config or {}).items():
        opts.add_session_config_entry(k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with InferenceSession(path, opts) as s:
            got, stats = s.run(None, feeds), s.get_prepack_stats()
    return got, stats, [str(w.message) for w in caught if issubclass(w.category, PrepackWarning)]


def _ort_outputs(path, feeds):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("how", ["offsets-swapped", "offset-duplicated", "scopes-swapped"])
def test_record_is_bound_to_its_weights_offset_in_a_trusted_file(tmp_path, how):
    # Saved records carried no source offset: in a trusted (unchanged, sealed) data file nothing
    # tied a record to the bytes its weight now points at, so swapping two equal-length weights'
    # offsets in the model, or the names of two If nodes (their scopes trade places), kept the old
    # blobs and gave silently wrong outputs (record family, resealed cases).
    path, feeds, _ = _optimized_twin(str(tmp_path))
    proto = onnx.load(path, load_external_data=False)
    if how == "scopes-swapped":
        a, b = (n for n in proto.graph.node if n.op_type == "If")
        a.name, b.name = b.name, a.name
    else:
        ext = {t.name: {e.key: e for e in t.external_data} for t in proto.graph.initializer}
        h1, h2 = ext["H1"]["offset"], ext["H2"]["offset"]
        if how == "offsets-swapped":
            h1.value, h2.value = h2.value, h1.value
        else:
            h1.value = h2.value
    onnx.save(proto, path)  # the data file is untouched: its seal still holds
    got, stats, warned = _run_warned(path, feeds)
    for g, w in zip(got, _ort_outputs(path, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=2e-3)  # fp16 weights: ort rounds per op
    assert stats["weights_packed"] >= 1
    assert any("re-pointed" in m for m in warned), warned
