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


def test_equal_weights_read_as_they_are_record_their_own_bytes(tmp_path):
    """fp32 MatMul weights are packed as themselves (identity packs, recorded at the weight's
    own offset).  Two equal weights, one of them in a subgraph as a Whisper model's encoder and
    decoder graphs hold them, got one content key: the container handed the second the first's
    view, which was recorded at the first's bytes, and every warm load refused it as overlapping
    another weight (with a warning) and packed again (found by optimizing onnxruntime's
    Whisper beam-search model)."""
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    branch = helper.make_graph([helper.make_node("MatMul", ["x", "C"], ["yc"])], "then", [],
                               [helper.make_tensor_value_info("yc", TensorProto.FLOAT, [2, 64])],
                               [numpy_helper.from_array(w.copy(), "C")])
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"]), helper.make_node("MatMul", ["a", "B"], ["b"]),
             helper.make_node("If", ["cond"], ["c"], then_branch=branch, else_branch=branch),
             helper.make_node("Add", ["b", "c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64]),
                                       helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
                          [numpy_helper.from_array(w, "A"), numpy_helper.from_array(w.copy(), "B")])
    src = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    from onnxpack.session import optimize

    optimize(str(src), str(tmp_path / "o.onnx"))
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrepackWarning)
        sess = InferenceSession(str(tmp_path / "o.onnx"))
        (got,) = sess.run(None, {"x": x, "cond": np.array(True)})
    stats = sess.get_prepack_stats()
    assert stats["blobs_rejected"] == 0 and stats["weights_packed"] == 0, stats
    np.testing.assert_allclose(got, x @ w @ w + x @ w, rtol=1e-4, atol=1e-4)


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


def _one_input_chains():
    """Graphs whose fusion candidates hold a binary node left with one input (the proto fuzzer's
    bit flips made one: an Add after a MatMul with a constant weight, seed 4343000000021)."""
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    root2 = numpy_helper.from_array(np.array(2 ** -0.5, np.float32), "r2")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    three = numpy_helper.from_array(np.array(3.0, np.float32), "three")
    mm = helper.make_node("MatMul", ["x", "W"], ["t"])
    cases = {
        "matmul-bias": [mm, helper.make_node("Add", ["t"], ["y"])],
        "gelu-add": [mm, helper.make_node("Mul", ["t", "r2"], ["s"]), helper.make_node("Erf", ["s"], ["e"]),
                     helper.make_node("Add", ["e"], ["e1"]), helper.make_node("Mul", ["t", "e1"], ["p"]),
                     helper.make_node("Mul", ["p", "half"], ["y"])],
        "gelu-half": [mm, helper.make_node("Mul", ["t", "r2"], ["s"]), helper.make_node("Erf", ["s"], ["e"]),
                      helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["t", "e1"], ["p"]),
                      helper.make_node("Mul", ["p"], ["y"])],
        "hardswish-add": [mm, helper.make_node("Add", ["t"], ["a"]), helper.make_node("Clip", ["a"], ["c"]),
                          helper.make_node("Mul", ["t", "c"], ["y"])],
    }
    for name, nodes in cases.items():
        g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, half, root2, one, three])
        yield name, helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("name,model", list(_one_input_chains()), ids=[n for n, _ in _one_input_chains()])
def test_fusion_candidate_with_one_input_is_an_invalid_graph(name, model):
    """The fusion planner reads a binary node's other operand only when it has two inputs: the
    one-input node is then the node's own error at creation (was an IndexError from the planner)."""
    from onnxpack.errors import InvalidGraph

    with pytest.raises(InvalidGraph, match="input"):
        InferenceSession(model.SerializeToString())


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


def _forge(path, attack):
    """Rewrites fuzztwin's records consistently (the blob of H2 for H1) and the data file's
    manifest to seal them: every CRC, the manifest and its digest agree."""
    proto = onnx.load(path, load_external_data=False)
    recs, _ = harness._records_of(proto)
    (k1, p1, b1, buf1), (k2, _p2, _b2, buf2) = [
        next(item for item in harness._saved_buffers(recs) if item[0].endswith("/" + name)) for name in ("H1", "H2")]
    binding = {f: buf2[f] for f in harness._BINDING}
    if attack == "swap":
        recs[k2][2]["packs"][0]["buffers"][0].update({f: buf1[f] for f in harness._BINDING})
        harness._store(*recs[k2])
    else:  # the other record deleted
        harness._drop_props(proto, {k2})
        recs, _ = harness._records_of(proto)  # the props were rebuilt
    recs[k1][2]["packs"][p1]["buffers"][b1].update(binding)
    harness._store(*recs[k1])
    loc = harness._data_location(proto)
    data_path = os.path.join(os.path.dirname(path), loc)
    with open(data_path, "rb") as f:
        data = harness._forge_manifest(proto, f.read())
    with open(data_path, "wb") as f:
        f.write(data)
    onnx.save(proto, path)


@pytest.mark.parametrize("attack", ["swap", "delete-and-repoint"])
@pytest.mark.parametrize("mode", ["identity-changed", "verify-on-resealed"])
def test_consistently_forged_records_are_caught_by_full_verification(tmp_path, attack, mode):
    # A full verification checked each record against its weight (digest) and each blob against
    # its record (CRC), but records are rewritable text: swapping two equal-shaped packs' offset,
    # length and CRC and re-sealing the manifest passed both checks, even with verify_prepacked=1.
    # Now a full verification compares the blob with the weight's own pack.
    path, feeds, expected = _optimized_twin(str(tmp_path))
    _forge(path, attack)
    config = {}
    if mode == "verify-on-resealed":  # the seal forged too: trusted unless verify_prepacked
        harness._reseal(str(tmp_path), "m.onnx")
        config = {"onnxpack.verify_prepacked": "1"}
    got, stats, warned = _run_warned(path, feeds, config)
    for g, w in zip(got, expected):
        np.testing.assert_array_equal(g, w)
    assert stats["blobs_rejected"] >= 1 and any("not this weight's pack" in m for m in warned), warned


def test_same_content_copy_is_still_mapped_after_the_pack_comparison(tmp_path):
    import shutil

    path, feeds, expected = _optimized_twin(str(tmp_path))
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in os.listdir(tmp_path):
        if name.startswith("m.onnx"):
            shutil.copy(tmp_path / name, moved / name)  # new inodes: verified in full
    got, stats, warned = _run_warned(str(moved / "m.onnx"), feeds)
    assert warned == [] and stats["weights_packed"] == 0 and stats["blobs_from_model"] >= 6
    for g, w in zip(got, expected):
        np.testing.assert_array_equal(g, w)


def _twin_with_cache(folder):
    proto = harness.fuzztwin_model()
    path = os.path.join(folder, "twin.onnx")
    onnx.save_model(proto, path)  # in-proto weights: content keys
    cache = os.path.join(folder, "packed.cache")
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32), "c": np.array(True)}
    expected, _ = harness.outputs_of(path, feeds, {"onnxpack.prepacked_cache_path": cache})
    _, stats = harness.outputs_of(path, feeds, {"onnxpack.prepacked_cache_path": cache})
    assert stats["blobs_from_cache"] >= 6
    return path, cache, feeds, expected


@pytest.mark.parametrize("kind", ["swap", "keys"])
def test_consistently_forged_cache_commit_is_caught_with_verify(tmp_path, kind):
    # The same with the cache file: a newer commit (index CRC and slot CRC valid) swapping the
    # regions or the keys of two equal-shaped entries gave wrong outputs under verify_prepacked=1.
    import dataclasses
    import random

    path, cache, feeds, expected = _twin_with_cache(str(tmp_path))
    with open(cache, "rb") as f:
        data = f.read()
    entries = harness._cache_entries(data)
    big = [i for i, e in enumerate(entries) if int(np.prod(e.buffers[0].shape)) == 256 * 256]  # (4, 256, 64) panels
    assert len(big) == 2
    i, j = big
    a, b = entries[i], entries[j]
    if kind == "swap":
        entries[i], entries[j] = dataclasses.replace(a, buffers=b.buffers), dataclasses.replace(b, buffers=a.buffers)
    else:
        entries[i], entries[j] = dataclasses.replace(a, key=b.key), dataclasses.replace(b, key=a.key)
    with open(cache, "wb") as f:
        f.write(harness._cache_commit(random.Random(0), data, entries))
    opts = {"onnxpack.prepacked_cache_path": cache, "onnxpack.verify_prepacked": "1"}
    got, stats, warned = _run_warned(path, feeds, opts)
    for g, w in zip(got, expected):
        np.testing.assert_array_equal(g, w)
    assert sum("is not its pack" in m for m in warned) == 2, warned


@pytest.mark.parametrize("how", ["cp-same-size", "cp-larger", "write-in-place"])
def test_cache_rewritten_under_a_live_session_is_an_error(tmp_path, how):
    # CacheFile.check only looked for a file that shrank (our appends only grow it), so a cache
    # file rewritten in place (`cp` of another version, a write) fed the live session's mapped
    # entries other bytes: silently wrong outputs at the next run (live family).
    from onnxpack.errors import CacheFileError

    path, cache, feeds, expected = _twin_with_cache(str(tmp_path))
    opts = SessionOptions()
    opts.add_session_config_entry("onnxpack.prepacked_cache_path", cache)
    with InferenceSession(path, opts) as s:
        for g, w in zip(s.run(None, feeds), expected):
            np.testing.assert_array_equal(g, w)
        with open(cache, "rb") as f:
            data = bytearray(f.read())
        region = max((b for e in harness._cache_entries(bytes(data)) for b in e.buffers), key=lambda b: b.length)
        data[region.offset:region.offset + 64] = bytes(64)
        if how == "write-in-place":
            with open(cache, "r+b") as f:
                f.seek(region.offset)
                f.write(bytes(64))
        else:
            with open(cache, "r+b") as f:
                f.truncate(0)
                f.write(bytes(data) + (bytes(100000) if how == "cp-larger" else b""))
        with pytest.raises(CacheFileError, match="rewritten under the live session"):
            s.run(None, feeds)


def test_cache_appended_by_another_writer_keeps_the_live_session_running(tmp_path):
    from onnxpack.prepack import cache_file as cf

    path, cache, feeds, expected = _twin_with_cache(str(tmp_path))
    opts = SessionOptions()
    opts.add_session_config_entry("onnxpack.prepacked_cache_path", cache)
    with InferenceSession(path, opts) as s:
        s.run(None, feeds)
        cf.append_entries(cache, {"other/1/" + "ab" * 16: (np.arange(4096, dtype=np.float32),)})
        for _ in range(2):  # the first run after the append checks the entries' CRCs, once
            for g, w in zip(s.run(None, feeds), expected):
                np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("where", ["cache-is-a-fifo", "lock-is-a-dangling-symlink", "lock-is-a-fifo"])
def test_cache_writer_creates_nothing_beside_special_files(tmp_path, where):
    # The writer created PATH.lock before checking PATH: a cache path naming /dev/zero made it
    # create /dev/zero.lock (special family), and the lock was opened with O_CREAT through a
    # symlink, creating whatever file the symlink named.
    src = tmp_path / "m.onnx"
    onnx.save_model(harness.fuzztwin_model(), str(src))
    cache = tmp_path / "packed.cache"
    outside = tmp_path / "elsewhere" / "created"
    (tmp_path / "elsewhere").mkdir()
    if where == "cache-is-a-fifo":
        os.mkfifo(cache)
    elif where == "lock-is-a-fifo":
        os.mkfifo(str(cache) + ".lock")
    else:
        os.symlink(outside, str(cache) + ".lock")
    feeds = {"x": np.ones((2, 64), np.float32), "c": np.array(True)}
    got, stats, warned = _run_warned(str(src), feeds, {"onnxpack.prepacked_cache_path": str(cache)})
    assert warned, "the unusable cache is reported"
    assert not outside.exists()
    if where == "cache-is-a-fifo":
        assert not os.path.lexists(str(cache) + ".lock")
    else:
        assert not cache.exists()  # nothing written without the lock


def test_constant_with_a_sparse_value_gives_the_dense_tensor():
    # The native Constant declined sparse_value and onnx.reference's Constant handed a
    # SparseTensor object on, so a valid model onnxruntime runs failed at run (attr family).
    sp = helper.make_sparse_tensor(numpy_helper.from_array(np.array([2.0, -3.0], np.float32), "v"),
                                   numpy_helper.from_array(np.array([1, 3], np.int64), "i"), [2, 2])
    g = helper.make_graph([helper.make_node("Constant", [], ["k"], sparse_value=sp),
                           helper.make_node("Add", ["x", "k"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    with InferenceSession(data) as s:
        (y,) = s.run(None, {"x": x})
    import onnxruntime as ort

    (want,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(y, x + np.array([[0, 2], [0, -3]], np.float32))


@pytest.mark.parametrize("case", ["index-beyond", "unsorted", "huge-dims"])
def test_constant_with_a_hostile_sparse_value_is_refused(case):
    v = np.ones(2, np.float32)
    idx, dims = {"index-beyond": ([1, 9], [4]), "unsorted": ([2, 1], [4]), "huge-dims": ([0, 1], [2**40, 2**40])}[case]
    sp = helper.make_sparse_tensor(numpy_helper.from_array(v, "v"), numpy_helper.from_array(np.array(idx, np.int64), "i"), dims)
    g = helper.make_graph([helper.make_node("Constant", [], ["y"], sparse_value=sp)], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    with pytest.raises(ModelLoadError):
        InferenceSession(data)


def test_output_broadcast_beyond_any_allocation_is_a_runtime_failure():
    # Expand returns a broadcast view (no memory); run() copies read-only outputs for the user
    # with np.array, and numpy's MemoryError for a 9.5 TiB copy escaped run() (huge family).
    from onnxpack.errors import RuntimeFailure

    shape = numpy_helper.from_array(np.array([19, 4, 8589934595, 4], np.int64), "shape")
    g = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    with InferenceSession(data) as s:
        with pytest.raises(RuntimeFailure, match="output 'y'"):
            s.run(None, {"x": np.arange(4, dtype=np.float32)})
        # a broadcast that fits is still the user's own, writable array
        small = {"x": np.arange(4, dtype=np.float32)}
    data2 = data.replace(np.array([19, 4, 8589934595, 4], np.int64).tobytes(), np.array([1, 2, 3, 4], np.int64).tobytes())
    with InferenceSession(data2) as s:
        (y,) = s.run(None, small)
    assert y.shape == (1, 2, 3, 4) and y.flags.writeable and y.flags.c_contiguous and 0 not in y.strides


@pytest.mark.parametrize("args", [(0, 2**63 - 1, 1), (-(2**63), 2**63 - 1, 2**62), (2**62, -(2**63), -(2**61)), (5, -7, -3)],
                         ids=["2^63-1-elements", "full-span-4", "full-span-negative", "small"])
def test_range_over_spans_near_2_63_is_exact_or_refused(args):
    # np.arange computes its length in float64 and then intp: Range(0, 2^63 - 1, 1) came out
    # empty, and Range(-2^63, 2^63 - 1, 2^62) too, where onnxruntime gives 4 elements (huge family).
    from onnxpack.errors import RuntimeFailure

    start, limit, delta = args
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for v, n in ((start, "a"), (limit, "b"), (delta, "d"))]
    g = helper.make_graph([helper.make_node("Range", ["a", "b", "d"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, None)], inits)
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    count = max(-((start - limit) // delta), 0)
    with InferenceSession(data) as s:
        if count > 2**40:
            with pytest.raises(RuntimeFailure, match="do not fit any array"):
                s.run(None, {})
            return
        (y,) = s.run(None, {})
    assert y.tolist() == [start + k * delta for k in range(count)]


def test_resave_onto_an_output_that_dies_before_the_model_rename_keeps_the_old_pair(tmp_path, monkeypatch):
    # Re-saving onto an existing output renamed the new data file over the old output's data file
    # before renaming the model: a kill in between left the old model reading the new layout
    # (garbage weights; the campaign's flag-save and optimize kills with a previous output).
    from onnxpack.graph import _save
    from onnxpack.session import optimize

    src, feeds = harness.build_model(harness.FUZZMIX, str(tmp_path))
    out = str(tmp_path / "out.onnx")
    optimize(src, out, {"session.save_external_prepacked_constant_initializers": "0"})
    before, _ = harness.outputs_of(out, feeds)
    data_before = harness.folder_digests(str(tmp_path))
    real = _save._atomic_write

    def dies_at_the_model(folder, name, write):
        if name == "out.onnx":
            raise OSError("killed")
        return real(folder, name, write)

    monkeypatch.setattr(_save, "_atomic_write", dies_at_the_model)
    with pytest.raises(Exception):
        optimize(src, out)
    monkeypatch.undo()
    after = harness.folder_digests(str(tmp_path))
    assert {k: v for k, v in after.items() if k in data_before} == data_before  # nothing replaced
    got, _ = harness.outputs_of(out, feeds)
    for g, w in zip(got, before):
        np.testing.assert_array_equal(g, w)
    # A save that completes drops the old output's data file: re-saves alternate two names.
    for _ in range(3):
        optimize(src, out)
        names = sorted(n for n in os.listdir(tmp_path) if n.startswith("out.onnx") and n != "out.onnx")
        assert len(names) <= 2, names  # the one in use, plus the orphan of the save that died
        got, stats = harness.outputs_of(out, feeds)
        assert stats["blobs_from_model"] >= 1
        for g, w in zip(got, before):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("mode", ["flag", "optimize"])
def test_kills_around_the_commit_of_a_resave_leave_a_whole_pair(tmp_path, mode):
    setup = harness.kill_setup(str(tmp_path / "setup"))
    calls = setup["calls"][mode]
    for kill_at in range(calls - 12, calls + 1):  # the data rename, the model's write and rename
        ok, found = harness.kill_trial(setup, mode, kill_at, str(tmp_path / f"k{kill_at}"), previous=True)
        assert ok, f"{mode}: kill before write call {kill_at} of {calls}: {found}"


@pytest.mark.parametrize("wtype", [TensorProto.INT32, TensorProto.INT64, TensorProto.FLOAT16])
def test_conv_batchnorm_fold_of_a_weight_of_another_type_matches_the_unfused_graph(wtype):
    # With pre-packing on, Conv+BatchNormalization fuse; an int32 weight is not packed, so the fold
    # ran per call in the weight's own dtype and truncated the float multiplier: other outputs than
    # the unfused graph (pre-packing off) gave (proto fuzzer: a Conv weight's data_type set to 6).
    rng = np.random.default_rng(3)
    w = rng.integers(-3, 4, (4, 3, 3, 3))
    inits = [numpy_helper.from_array(w.astype(helper.tensor_dtype_to_np_dtype(wtype)), "W")]
    for name, v in (("s", rng.uniform(0.5, 1.5, 4)), ("b", rng.standard_normal(4)), ("m", rng.standard_normal(4)),
                    ("v", rng.uniform(0.5, 2, 4))):
        inits.append(numpy_helper.from_array(v.astype(np.float32), name))
    g = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    x = {"x": rng.standard_normal((1, 3, 6, 6)).astype(np.float32)}
    outs = []
    for prepack in ("0", "1"):
        opts = SessionOptions()
        opts.add_session_config_entry("session.disable_prepacking", "1" if prepack == "0" else "0")
        with InferenceSession(data, opts) as s:
            outs.append(s.run(None, x)[0])
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("outlier", [2e24, -3e14, 5e3], ids=["huge", "large-negative", "moderate"])
def test_conv_filter_with_an_outlier_is_not_run_by_winograd(outlier, monkeypatch):
    # Found by the inplace family: bytes patched into a 3x3 filter made one entry 2e24 among
    # 0.1s.  Winograd's rounding is relative to the largest products of a whole input tile, so
    # outputs whose own terms were small (the outlier's tap on the zero padding) got ~1e17 of
    # noise; direct convolution (onnxruntime's, and ours by im2col) computes them exactly.
    from onnxpack.session.kernels import conv as conv_mod

    monkeypatch.setattr(conv_mod, "_WINO_OVER_SHIFT", 0)  # 16 channels: Winograd's, even with the JIT
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32)
    w[9, 4, 0, 0] = outlier
    x = rng.standard_normal((1, 16, 16, 16)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    import onnxruntime as ort

    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with InferenceSession(data) as s:
        got = s.run(None, {"x": x})[0]
    # every output within float32 rounding of its own magnitude (the padded border included)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, equal_nan=True)
    clean = np.delete(np.arange(16), 9)
    np.testing.assert_allclose(got[:, clean], want[:, clean], rtol=1e-5, atol=1e-5)


def test_winograd_still_packs_ordinary_and_pruned_filters():
    from onnxpack.session.kernels import _winograd

    rng = np.random.default_rng(8)
    w = (rng.standard_normal((32, 16, 3, 3)) * 0.05).astype(np.float32)
    assert _winograd.weight_is_tame(w)
    w[:, ::2] = 0  # half the filters pruned to zero
    assert _winograd.weight_is_tame(w)
    w[3, 1, 1, 1] = 1e6
    assert not _winograd.weight_is_tame(w)


def test_leaf_dtype_change_invalidates_a_derived_pack_in_a_trusted_file(tmp_path):
    """A float16 weight widened by ``Cast`` is packed as a derived value; the same bytes relabelled
    bfloat16 in the proto (the data file untouched and resealed, so the trusted path reads no
    byte) derive another value.  Its key must differ: the pack is re-made with a warning and the
    output is onnxruntime's (found by the fuzzer: proto target, seed 1173, a silently wrong
    output from the old pack)."""
    from onnxpack.session import optimize

    rng = np.random.default_rng(31)
    w = numpy_helper.from_array((rng.standard_normal((8, 16)) * 0.5).astype(np.float16), "Wh")
    nodes = [helper.make_node("Cast", ["Wh"], ["W"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "W"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    src = tmp_path / "src.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = str(tmp_path / "m.onnx")
    optimize(str(src), out, {"session.optimized_model_external_initializers_min_size_in_bytes": "0"})
    feeds = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    _, stats, _ = _run_warned(out, feeds)
    assert stats["blobs_from_model"] >= 1, stats
    proto = onnx.load(out, load_external_data=False)
    (t,) = [t for t in proto.graph.initializer if t.name == "Wh"]
    t.data_type = TensorProto.BFLOAT16
    onnx.save(proto, out)
    harness._reseal(str(tmp_path), "m.onnx")
    got, stats, warned = _run_warned(out, feeds)
    assert warned and stats["blobs_from_model"] == 0, (warned, stats)
    np.testing.assert_allclose(got[0], _ort_outputs(out, feeds)[0], rtol=1e-5, atol=1e-5)


def test_empty_weight_reshaped_past_numpys_index_range_is_not_derived(tmp_path):
    # An empty initializer Reshape'd (allowzero; a constant expression over a weight) to [2**61 + 3, 0]:
    # the product is 0, so the derivation took it, and numpy's reshape then refused the shape at
    # compile ("array is too big"), a ValueError out of InferenceSession (huge family, seed 1162).
    # Such a value is not derived; the Reshape runs, and fails as the run's error.
    w = numpy_helper.from_array(np.zeros((0,), np.float32), "w")
    shape = numpy_helper.from_array(np.array([2**61 + 3, 0], np.int64), "s")
    g = helper.make_graph([helper.make_node("Reshape", ["w", "s"], ["y"], allowzero=1)],
                          "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, shape])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    from onnxpack.errors import OnnxpackError

    try:
        sess = InferenceSession(path)
    except OnnxpackError:
        return  # refused at creation as ours: fine too
    with pytest.raises(OnnxpackError):
        sess.run(None, {})


def _rewrite_manifest(path: str, transform) -> None:
    """Replaces the data file's manifest by ``transform(manifest)`` (appended at the end), points
    the seal at it with its digest and renews the seal's identity: a trusted file again."""
    import dataclasses
    import hashlib

    from onnxpack.prepack import entry_format as fmt

    proto = onnx.load(path, load_external_data=False)
    (p,) = [p for p in proto.metadata_props if fmt.is_file_key(p.key)]
    rec = fmt.parse_file_record(p.key, p.value)
    data_path = os.path.join(os.path.dirname(path), rec.location)
    with open(data_path, "rb") as f:
        data = f.read()
    man = transform(data[rec.manifest_offset:rec.manifest_offset + rec.manifest_length])
    off = -(-len(data) // 64) * 64
    with open(data_path, "wb") as f:
        f.write(data + bytes(off - len(data)) + man)
    p.value = fmt.format_file_record(dataclasses.replace(
        rec, manifest_offset=off, manifest_length=len(man), manifest_digest=hashlib.blake2b(man, digest_size=32).hexdigest()))[1]
    onnx.save(proto, path)
    harness._reseal(os.path.dirname(path), os.path.basename(path))


def _counting_json(monkeypatch) -> list:
    from onnxpack.prepack import entry_format as fmt

    parsed = []
    real = fmt.parse_record
    monkeypatch.setattr(fmt, "parse_record", lambda k, v: parsed.append(k) or real(k, v))
    return parsed


@pytest.mark.parametrize("manifest", ["as-saved", "version-1", "index-damaged", "index-row-damaged"])
def test_trusted_records_come_from_the_record_index(tmp_path, monkeypatch, manifest):
    """A trusted (sealed, unchanged) data file's records are built from its manifest's record
    index, not parsed from their JSON; a version-1 manifest (older onnxpack) or a damaged index
    falls back to the JSON (a damaged index with one warning), and every blob still comes from the
    model, with the same outputs."""
    from onnxpack.prepack import entry_format as fmt

    path, feeds, expected = _optimized_twin(str(tmp_path))
    n_records = sum(fmt.is_record_key(p.key) for p in onnx.load(path, load_external_data=False).metadata_props)
    if manifest == "version-1":
        def v1(man: bytes) -> bytes:
            count = int.from_bytes(man[16:24], "little")
            entries = man[fmt.MANIFEST_HEADER:fmt.MANIFEST_HEADER + fmt.MANIFEST_ENTRY * count]
            return fmt.MANIFEST_MAGIC + man[16:24] + bytes(fmt.MANIFEST_HEADER - 24) + entries
        _rewrite_manifest(path, v1)
    elif manifest == "index-damaged":  # the index's counts: refused whole
        _rewrite_manifest(path, lambda man: man[:int.from_bytes(man[24:32], "little") + 16] + b"\xff" * 16
                          + man[int.from_bytes(man[24:32], "little") + 32:])
    elif manifest == "index-row-damaged":  # a weight name's text: that row left to its JSON
        def damage(man: bytes) -> bytes:
            at = int.from_bytes(man[24:32], "little")
            text = man.rindex(b"H1")  # (the text blob is last: its copy of a weight name)
            assert text > at
            return man[:text] + b"\x00\x01" + man[text + 2:]
        _rewrite_manifest(path, damage)
    parsed = _counting_json(monkeypatch)
    got, stats, warned = _run_warned(path, feeds)
    for g, w in zip(got, expected):
        np.testing.assert_array_equal(g, w)
    assert stats["weights_packed"] == 0 and stats["blobs_rejected"] == 0, stats
    if manifest == "as-saved":
        assert parsed == [] and warned == []
    elif manifest == "index-row-damaged":
        assert len(parsed) == 1 and warned == []
    else:
        assert len(parsed) == n_records
        assert (warned == []) == (manifest == "version-1"), warned


@pytest.mark.parametrize("op, attrs, opset", [("Unsqueeze", {"axes": [0]}, 21), ("Unsqueeze", {}, 21),
                                              ("Squeeze", {}, 13), ("Reshape", {}, 14), ("Pad", {"pads": [1, 1]}, 18),
                                              ("Pad", {}, 18)])
def test_a_node_missing_a_required_input_is_refused_at_creation(op, attrs, opset):
    """An opset-21 model whose Unsqueeze kept its opset-11 ``axes`` attribute (what onnxruntime's
    weight-only quantizer left after raising a GPT-2's opset) failed at the first run with a
    Python signature error; onnxruntime refuses it at load.  A required input missing for the
    model's opset (as its kernel's run() declares them) is an InvalidGraph at creation (Squeeze's axes
    are optional: that node is fine); the older opset's attribute itself is refused first, at
    load (the attributes each op has at the model's opset: graph/_attributes.py)."""
    from onnxpack.errors import InvalidGraph

    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()
    if op == "Squeeze":
        assert InferenceSession(model).run(None, {"x": np.ones((1, 3), np.float32)})[0].shape == (3,)
        return
    with pytest.raises(InvalidGraph, match="does not have at this opset" if attrs else "requires 2"):
        InferenceSession(model)


EMPTY_BATCH = {  # (C, M, kernel, pads, strides, group, H, W): each of Conv's paths
    "gather": (16, 16, (3, 3), [1, 1, 1, 1], [1, 1], 1, 10, 10),
    "shift": (16, 16, (3, 3), [1, 1, 1, 1], [1, 1], 1, 40, 40),
    "winograd-pack": (64, 64, (3, 3), [1, 1, 1, 1], [1, 1], 1, 40, 40),
    "im2col": (8, 96, (5, 5), [2, 2, 2, 2], [1, 1], 1, 40, 40),
    "stride2": (16, 32, (3, 3), [1, 1, 1, 1], [2, 2], 1, 40, 40),
    "pointwise": (32, 64, (1, 1), [0, 0, 0, 0], [1, 1], 1, 20, 20),
    "depthwise": (16, 16, (3, 3), [1, 1, 1, 1], [1, 1], 16, 20, 20),
}


@pytest.mark.parametrize("jit", ["numba", "numpy"])
@pytest.mark.parametrize("case", list(EMPTY_BATCH), ids=list(EMPTY_BATCH))
def test_conv_and_layer_norm_on_an_empty_batch(case, jit, monkeypatch):
    # Found by the conv differential fuzz (seeds 5159000, 5224001): a model with a dynamic batch
    # run at batch 0 raised "cannot reshape array of size 0 into shape (0,newaxis)" on every Conv
    # path but the depthwise one (reshapes by the batch size with a -1, which a size of 0 leaves
    # ambiguous), and so did LayerNormalization's numpy path; onnxruntime returns empty tensors.
    if jit == "numpy":
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    c, m, k, pads, strides, group, h, w = EMPTY_BATCH[case]
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((m, c // group) + k).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=list(k), pads=pads, strides=strides,
                              group=group),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("LayerNormalization", ["r", "s"], ["y"], axis=1)]
    out_hw = [(h + pads[0] + pads[2] - k[0]) // strides[0] + 1, (w + pads[1] + pads[3] - k[1]) // strides[1] + 1]
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b"),
             numpy_helper.from_array(np.ones([m] + out_hw, np.float32), "s")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, h, w])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    import onnxruntime as ort

    with InferenceSession(model) as s:
        for n in (2, 0, 1):  # a batch before and after the empty one: the plans per shape
            x = rng.standard_normal((n, c, h, w)).astype(np.float32)
            got = s.run(None, {"x": x})[0]
            want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            assert got.shape == want.shape == (n, m, *out_hw)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("jit", ["numba", "numpy"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
def test_winograd_conv_keeps_an_infinity_or_nan_where_it_is(bad, jit, monkeypatch):
    # Found by the conv differential fuzz (216 cases, every one a Winograd-packed conv): the input
    # transform subtracts inputs, so one infinity became NaN over its 4x4 tiles' outputs (and a
    # NaN spread to every output of its tiles; a Relu after turned onnxruntime's -inf into 0 where
    # ours stayed NaN).  A plane holding a non-finite value now runs the direct convolution.
    from onnxpack.session.kernels import _winograd, conv as conv_mod

    if jit == "numpy":
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    monkeypatch.setattr(conv_mod, "_WINO_TUNED", False)  # Winograd where it packed (not the faster path)
    calls = []
    real = _winograd.conv3x3
    monkeypatch.setattr(_winograd, "conv3x3", lambda *a: calls.append(real(*a)) or calls[-1])
    c = m = 64  # C*M/(C+M) = 32: packed for Winograd with the JIT too
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((m, c, 3, 3)) / 24).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 20, 20])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()
    import onnxruntime as ort

    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    with InferenceSession(model) as s:
        assert any("_wino/" in r["key"] for r in s.get_prepack_log())
        x = rng.standard_normal((1, c, 20, 20)).astype(np.float32)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], ref.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)
        assert calls and calls[-1] is not None  # finite: Winograd's
        x[0, 3, 9, 9] = bad
        got, want = s.run(None, {"x": x})[0], ref.run(None, {"x": x})[0]
        assert calls[-1] is None  # declined: the direct path
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))


def test_conv_scratch_is_never_short_of_its_alignment_offset():
    """conv._scratch reused a thread's buffer made for a smaller request when it held the new
    request's bytes but not past its 64-byte-aligned start: the scratch came back up to 63 bytes
    short and its reshape failed (found by a differential fuzz of stride-2 convs: two convs whose
    padded inputs differed by a few floats, "cannot reshape array of size 144961 into shape
    (144964,)").  Every request gets a full, aligned buffer whatever came before."""
    from onnxpack.session.kernels import conv

    for first in range(1000, 1064):
        conv._conv_scratch.clear()
        conv._scratch("regression", (first,), np.uint8)
        for extra in range(64):
            got = conv._scratch("regression", (first + extra,), np.uint8)
            assert got.size == first + extra and got.ctypes.data % 64 == 0
    conv._conv_scratch.clear()
