"""Issue 12: the mechanisms an independent campaign used to break the guarantees, one test each
(with variants), against onnxruntime or onnx.reference as the oracle."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxpack
from onnxpack import InferenceSession, SessionOptions
from onnxpack.cli import main as cli_main
from onnxpack.errors import InvalidArgument, InvalidGraph, ModelLoadError, OnnxpackError, PrepackWarning
from onnxpack.graph import save_model
from onnxpack.prepack import entry_format as ef
from onnxpack.session import optimize

F, H = TensorProto.FLOAT, TensorProto.FLOAT16
N = 256  # fp16 [N, N] weights: their fp32 packs are 256 KiB, above the always-CRC-checked size


def _two_weight_model(folder, seed=0, name="m.onnx"):
    """x -> MatMul W1 -> MatMul W2 -> y, fp16 weights of equal shape, saved with external data."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((N, N)) / 16).astype(np.float16)
    w2 = (rng.standard_normal((N, N)) / 16).astype(np.float16)
    nodes = [helper.make_node("Cast", ["x"], ["xh"], to=H),
             helper.make_node("MatMul", ["xh", "W1"], ["h"], name="fc1"),
             helper.make_node("MatMul", ["h", "W2"], ["yh"], name="fc2"),
             helper.make_node("Cast", ["yh"], ["y"], to=F)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, N])],
                              [helper.make_tensor_value_info("y", F, [2, N])],
                              [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = os.path.join(folder, name)
    save_model(model, path, min_size=64)
    return path


def _opt(src, out):
    optimize(str(src), str(out))
    return str(out)


def _feed():
    return {"x": np.random.default_rng(9).standard_normal((2, N)).astype(np.float32)}


def _ort(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, _feed())


def _run(path, **config):
    opts = SessionOptions()
    for k, v in config.items():
        opts.add_session_config_entry(k.replace("__", "."), v)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with InferenceSession(str(path), opts) as s:
            got = s.run(None, _feed())
            stats = s.get_prepack_stats()
    return got, stats, [str(w.message) for w in ws if issubclass(w.category, PrepackWarning)]


def _close(a, b):
    # fp16 weights, fp32 compute: ours widens once, onnxruntime rounds per fp16 step.
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-2)


def _weight_region(model_path, name):
    proto = onnx.load(model_path, load_external_data=False)
    t = next(t for t in proto.graph.initializer if t.name == name)
    info = {e.key: e.value for e in t.external_data}
    return os.path.join(os.path.dirname(model_path), info["location"]), int(info["offset"]), int(info["length"])


def _rewrite_in_place(data_path, offset, new_bytes, keep_mtime=True):
    st = os.stat(data_path)
    with open(data_path, "r+b") as f:
        f.seek(offset)
        f.write(new_bytes)
    if keep_mtime:
        os.utime(data_path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _records(path):
    proto = onnx.load(path, load_external_data=False)
    return proto, {p.key: p for p in proto.metadata_props}


# -- 1, 2: stale sources ---------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["in-place-mtime-restored", "copy-replaced"])
def test_stale_source_between_samples_is_caught_and_not_laundered(tmp_path, how):
    src = _two_weight_model(tmp_path)
    opt = _opt(src, tmp_path / "opt.onnx")
    data, off, length = _weight_region(opt, "W1")
    # Bytes in the middle of W1, between the 16 staleness samples of old.
    w = np.frombuffer(open(data, "rb").read()[off:off + length], np.float16).copy()
    mid = len(w) // 2 + 37
    w[mid:mid + 8] = 4.0
    if how == "in-place-mtime-restored":
        _rewrite_in_place(data, off, w.tobytes())
    else:  # cp to a new file and rename over: another inode, same size
        tmp = data + ".new"
        shutil.copy(data, tmp)
        _rewrite_in_place(tmp, off, w.tobytes(), keep_mtime=False)
        shutil.copystat(data, tmp)
        os.replace(tmp, data)
    want = _ort(opt)
    got, stats, warned = _run(opt)
    _close(got, want)
    assert stats["weights_packed"] >= 1 and any("W1" in m and "stale" in m for m in warned), warned
    # Re-optimizing the stale model must not launder the stale blob under W1's new digest.
    again = _opt(opt, tmp_path / "again.onnx")
    for config in ({}, {"onnxpack__verify_prepacked": "1"}):
        got, stats, _ = _run(again, **config)
        _close(got, want)
        assert stats["weights_packed"] == 0  # the re-saved blobs are W1's current pack


def test_same_content_copy_still_maps_after_full_verification(tmp_path):
    src = _two_weight_model(tmp_path)
    opt = _opt(src, tmp_path / "opt.onnx")
    moved = tmp_path / "copy"
    moved.mkdir()
    for f in os.listdir(tmp_path):
        if f.startswith("opt.onnx"):
            shutil.copy(tmp_path / f, moved / f)  # new inodes: verified in full, then mapped
    got, stats, warned = _run(moved / "opt.onnx")
    assert warned == [] and stats["weights_packed"] == 0 and stats["blobs_from_model"] == 2
    _close(got, _ort(src))


# -- 3: records pointing at the wrong blob -------------------------------------------------------

def _edit(proto, name, fn):
    key = ef.record_key("", name)
    prop = next(p for p in proto.metadata_props if p.key == key)
    prefix, body = prop.value.split(";", 1)
    obj = json.loads(body)
    fn(obj)
    prop.value = prefix + ";" + json.dumps(obj, separators=(",", ":"))


def _buffers(proto, name):
    key = ef.record_key("", name)
    prop = next(p for p in proto.metadata_props if p.key == key)
    return json.loads(prop.value.split(";", 1)[1])["packs"][0]["buffers"][0]


@pytest.mark.parametrize("attack", ["swap-offsets", "other-file", "delete-and-repoint"])
def test_record_pointing_at_another_blob_is_never_used(tmp_path, attack):
    src = _two_weight_model(tmp_path)
    opt = _opt(src, tmp_path / "opt.onnx")
    proto, _ = _records(opt)
    b1, b2 = dict(_buffers(proto, "W1")), dict(_buffers(proto, "W2"))
    if attack == "swap-offsets":
        _edit(proto, "W1", lambda o: o["packs"][0]["buffers"][0].update(offset=b2["offset"], crc32=b2["crc32"]))
        _edit(proto, "W2", lambda o: o["packs"][0]["buffers"][0].update(offset=b1["offset"], crc32=b1["crc32"]))
    elif attack == "other-file":
        # A second data file in the folder holding W2's blob where W1's record points.
        other = tmp_path / "other.data"
        shutil.copy(tmp_path / b1["file"], other)
        with open(tmp_path / b1["file"], "rb") as f:
            f.seek(b2["offset"])
            blob2 = f.read(b2["length"])
        with open(other, "r+b") as f:
            f.seek(b1["offset"])
            f.write(blob2)
        _edit(proto, "W1", lambda o: o["packs"][0]["buffers"][0].update(file="other.data", crc32=b2["crc32"]))
    else:
        keep = [p for p in proto.metadata_props if p.key != ef.record_key("", "W2")]
        del proto.metadata_props[:]
        proto.metadata_props.extend(keep)
        _edit(proto, "W1", lambda o: o["packs"][0]["buffers"][0].update(offset=b2["offset"], crc32=b2["crc32"]))
    onnx.save(proto, opt)
    for config in ({}, {"onnxpack__verify_prepacked": "1"}):
        got, stats, warned = _run(opt, **config)
        _close(got, _ort(src))
        assert stats["weights_packed"] >= 1 and warned


# -- 4: cache file identity -------------------------------------------------------------------

def test_cache_entry_of_a_weight_rewritten_in_place_with_mtime_restored_is_not_used(tmp_path):
    src = _two_weight_model(tmp_path)
    cache = str(tmp_path / "packs.cache")
    _run(src, onnxpack__prepacked_cache_path=cache)
    got, stats, _ = _run(src, onnxpack__prepacked_cache_path=cache)
    assert stats["blobs_from_cache"] == 2
    data, off, length = _weight_region(src, "W2")
    w = -np.frombuffer(open(data, "rb").read()[off:off + length], np.float16)
    _rewrite_in_place(data, off, w.tobytes())
    got, stats, _ = _run(src, onnxpack__prepacked_cache_path=cache)
    assert stats["blobs_from_cache"] == 0
    _close(got, _ort(src))


# -- 5: duplicate records ----------------------------------------------------------------------

def test_duplicate_record_keys_are_all_ignored(tmp_path):
    src = _two_weight_model(tmp_path)
    opt = _opt(src, tmp_path / "opt.onnx")
    proto, props = _records(opt)
    dup = proto.metadata_props.add()
    dup.key, dup.value = ef.record_key("", "W1"), "onnxpack-prepack-v1;{broken"
    onnx.save(proto, opt)
    got, stats, warned = _run(opt)
    _close(got, _ort(src))
    assert stats["blobs_rejected"] >= 1 and stats["weights_packed"] >= 1  # W1 really re-packed
    assert any("W1" in m for m in warned)


# -- 6: name clashes --------------------------------------------------------------------------

@pytest.mark.parametrize("clash", ["initializer", "input", "node-output", "in-subgraph"])
@pytest.mark.parametrize("prepack", ["0", "1"])
def test_redefined_names_are_refused_like_onnxruntime(clash, prepack):
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "W")
    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    inputs = [helper.make_tensor_value_info("x", F, [2, 2])]
    if clash == "initializer":
        nodes.append(helper.make_node("Neg", ["x"], ["W"]))
    elif clash == "input":
        nodes.append(helper.make_node("Neg", ["r"], ["x"]))
    elif clash == "node-output":
        nodes.append(helper.make_node("Neg", ["x"], ["r"]))
    else:
        body = helper.make_graph([helper.make_node("Neg", ["x"], ["t"]), helper.make_node("Abs", ["x"], ["t"])],
                                 "b", [], [helper.make_tensor_value_info("t", F, [2, 2])])
        nodes.append(helper.make_node("If", ["c"], ["z"], then_branch=body, else_branch=body))
        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    nodes.append(helper.make_node("MatMul", ["r", "W"], ["y"]))
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", F, [2, 2])], [w])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    with pytest.raises(Exception):
        ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    opts = SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", prepack)
    with pytest.raises(InvalidGraph):
        InferenceSession(data, opts)


# -- 7: float64 folds ---------------------------------------------------------------------------

def test_float64_conv_batchnorm_fold_keeps_float64_precision():
    rng = np.random.default_rng(1)
    D = TensorProto.DOUBLE
    inits = [numpy_helper.from_array(rng.standard_normal((6, 4, 3, 3)), "W"),
             numpy_helper.from_array(rng.standard_normal(6), "B")]
    for name, arr in (("s", rng.standard_normal(6)), ("bb", rng.standard_normal(6)),
                      ("m", rng.standard_normal(6)), ("v", np.abs(rng.standard_normal(6)) + 0.1)):
        inits.append(numpy_helper.from_array(arr, name))
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["n"], epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", D, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", D, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((1, 4, 8, 8))
    with InferenceSession(model.SerializeToString()) as s:
        assert any("+" in r["node"] for r in s.get_prepack_log())  # fused
        (got,) = s.run(None, {"x": x})
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# -- 8: attribute tensors stored externally ------------------------------------------------------

@pytest.mark.parametrize("op", ["Constant", "ConstantOfShape", "SequenceMap-subgraph-initializer"])
def test_attribute_tensors_are_read_from_the_model_folder_not_the_working_directory(tmp_path, monkeypatch, op):
    folder, cwd = tmp_path / "model", tmp_path / "cwd"
    folder.mkdir(), cwd.mkdir()
    good, bad = np.arange(4, dtype=np.float32) + 1, np.full(4, 666.0, np.float32)
    (folder / "c.bin").write_bytes(good.tobytes())
    (cwd / "c.bin").write_bytes(bad.tobytes())

    def ext(name, dims):
        t = TensorProto(name=name, data_type=F, dims=dims, data_location=TensorProto.EXTERNAL)
        for k, v in (("location", "c.bin"), ("offset", "0"), ("length", "16")):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    opset = 17
    if op == "Constant":
        nodes = [helper.make_node("Constant", [], ["c"], value=ext("v", [4])), helper.make_node("Add", ["x", "c"], ["y"])]
        feed = {"x": np.zeros(4, np.float32)}
    elif op == "ConstantOfShape":
        val = ext("v", [1])
        val.external_data[2].value = "4"
        nodes = [helper.make_node("ConstantOfShape", ["shape"], ["c"], value=val), helper.make_node("Add", ["x", "c"], ["y"])]
        feed = {"x": np.zeros(4, np.float32)}
    else:
        body = helper.make_graph([helper.make_node("Add", ["e", "w"], ["o"])], "body",
                                 [helper.make_tensor_value_info("e", F, [4])], [helper.make_tensor_value_info("o", F, [4])],
                                 [ext("w", [4])])
        nodes = [helper.make_node("SequenceConstruct", ["x"], ["seq"]),
                 helper.make_node("SequenceMap", ["seq"], ["out"], body=body),
                 helper.make_node("SequenceAt", ["out", "zero"], ["y"])]
        feed = {"x": np.zeros(4, np.float32)}
    inits = [numpy_helper.from_array(np.array([4], np.int64), "shape"), numpy_helper.from_array(np.array(0, np.int64), "zero")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [4])],
                          [helper.make_tensor_value_info("y", F, [4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    monkeypatch.chdir(cwd)
    with InferenceSession(str(folder / "m.onnx")) as s:
        (y,) = s.run(None, feed)
    expected = good if op != "ConstantOfShape" else np.full(4, good[0], np.float32)
    np.testing.assert_array_equal(y, expected)


# -- 9, 10: nothing the user gave is lost ------------------------------------------------------------

def test_optimize_onto_the_inputs_data_file_is_refused(tmp_path, capsys):
    src = _two_weight_model(tmp_path)
    data = tmp_path / "m.onnx.data"
    before = data.read_bytes()
    assert cli_main(["optimize", str(src), "-o", str(data)]) == 2
    assert "data file of the input" in capsys.readouterr().err
    assert data.read_bytes() == before


def test_in_place_saves_never_replace_a_data_file_another_model_shares(tmp_path):
    src = _two_weight_model(tmp_path)
    proto = onnx.load(src, load_external_data=False)
    proto.graph.name = "twin"
    onnx.save(proto, tmp_path / "twin.onnx")  # shares m.onnx.data
    want = _ort(tmp_path / "twin.onnx")
    shared = (tmp_path / "m.onnx.data").read_bytes()
    for _ in range(3):
        _opt(src, src)
    assert (tmp_path / "m.onnx.data").read_bytes() == shared
    _close(_run(tmp_path / "twin.onnx")[0], want)
    _close(_run(src)[0], want)


# -- 11: files that shrink under a live session ----------------------------------------------------

_LIVE = r"""
import os, sys, numpy as np, onnxpack
path, victim, cache = sys.argv[1], sys.argv[2], sys.argv[3]
opts = onnxpack.SessionOptions()
if cache:
    opts.add_session_config_entry("onnxpack.prepacked_cache_path", cache)
s = onnxpack.InferenceSession(path, opts)
x = {"x": np.ones((2, 256), np.float32)}
s.run(None, x)
with open(victim, "r+b") as f:   # what `cp new old` does: truncate in place, then write
    f.truncate(0)
    f.write(b"\0" * 100)
try:
    s.run(None, x)
    print("RAN")
except onnxpack.OnnxpackError as e:
    print("ERROR", type(e).__name__, str(e)[-200:])
"""


@pytest.mark.parametrize("victim", ["model-data", "cache"])
def test_truncated_mapped_file_is_an_error_not_a_crash(tmp_path, victim):
    src = _two_weight_model(tmp_path)
    path, cache = src, ""
    if victim == "model-data":
        path = _opt(src, tmp_path / "opt.onnx")
        target = tmp_path / "opt.onnx.data"
    else:
        cache = str(tmp_path / "packs.cache")
        _run(src, onnxpack__prepacked_cache_path=cache)
        target = cache
    out = subprocess.run([sys.executable, "-c", _LIVE, str(path), str(target), cache],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("ERROR") and "create the session again" in out.stdout, out.stdout


# -- 12, 13, 17: hostile protos and files get our errors --------------------------------------------

def _sparse_model(values, indices, dims):
    sp = helper.make_sparse_tensor(numpy_helper.from_array(values, "S"), numpy_helper.from_array(indices, "S_i"), dims)
    g = helper.make_graph([helper.make_node("Identity", ["S"], ["y"])], "g", [], [helper.make_tensor_value_info("y", F, None)])
    g.sparse_initializer.extend([sp])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("case", ["huge-dims", "negative-index", "count-mismatch", "unsorted", "index-beyond"])
def test_hostile_sparse_initializers_are_model_load_errors(case):
    v = np.ones(2, np.float32)
    data = {
        "huge-dims": (v, np.array([0, 1], np.int64), [2**40, 2**40]),
        "negative-index": (v, np.array([-1, 1], np.int64), [4]),
        "count-mismatch": (v, np.array([0, 1, 2], np.int64), [4]),
        "unsorted": (v, np.array([2, 1], np.int64), [4]),
        "index-beyond": (v, np.array([1, 9], np.int64), [4]),
    }[case]
    with pytest.raises(ModelLoadError):
        InferenceSession(_sparse_model(*data))


def test_zero_sized_tensor_with_giant_dim_is_a_model_load_error():
    t = TensorProto(name="W", data_type=F, dims=[2**62, 0])
    g = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [], [helper.make_tensor_value_info("y", F, None)], [t])
    with pytest.raises(ModelLoadError):
        InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


@pytest.mark.parametrize("op,group", [("Conv", 0), ("Conv", -1), ("ConvTranspose", -1), ("ConvTranspose", 0)])
def test_bad_conv_group_is_our_error(op, group):
    w = numpy_helper.from_array(np.ones((2, 2, 3, 3), np.float32), "W")
    g = helper.make_graph([helper.make_node(op, ["x", "W"], ["y"], group=group)], "g",
                          [helper.make_tensor_value_info("x", F, [1, 2, 5, 5])], [helper.make_tensor_value_info("y", F, None)], [w])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(OnnxpackError, match="group"):
        InferenceSession(data).run(None, {"x": np.ones((1, 2, 5, 5), np.float32)})


def test_cache_entry_with_unrepresentable_shape_is_refused_and_compact_is_one_line(tmp_path, capsys):
    from onnxpack.errors import CacheFileError
    from onnxpack.prepack import cache_file as cf

    path = str(tmp_path / "c.cache")
    cf.append_entries(path, {"matmul/1/" + "ab" * 16: (np.zeros((2, 2), np.float32),)})
    # Forge a newer commit whose index (valid CRCs) declares shape (2**40, 2**40, 0), length 0.
    entry = cf.CacheEntry("matmul/1/" + "cd" * 16, (cf.CacheBuffer(128, 0, "<f4", (2**40, 2**40, 0), 0),))
    index = cf._encode_index([entry])
    with open(path, "r+b") as f:
        end = -(-os.fstat(f.fileno()).st_size // 64) * 64
        f.truncate(end)
        f.seek(end)
        f.write(index)
        f.seek(cf.SLOT_SIZE)  # slot 1, sequence above slot 0's
        f.write(cf._encode_slot(99, end, index, 1))
    # The reader falls back to the previous commit (the forged index is refused) ...
    with cf.CacheFile.open(path) as c:
        assert "matmul/1/" + "cd" * 16 not in c and len(c) == 1
    # ... and with no good commit left, the CLI says so in one line.
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(cf._encode_slot(98, end, index, 1))
    with pytest.raises(CacheFileError):
        cf.CacheFile.open(path)
    assert cli_main(["cache", "compact", path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err


# -- 14: special files ---------------------------------------------------------------------------

_OPEN = r"""
import sys, warnings, onnxpack
kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "model":
        onnxpack.InferenceSession(path)
    else:
        o = onnxpack.SessionOptions()
        o.add_session_config_entry("onnxpack.prepacked_cache_path", path)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            onnxpack.InferenceSession(sys.argv[3], o)
        print("WARNED", len(ws))
        sys.exit(0)
    print("OPENED")
except onnxpack.OnnxpackError as e:
    print("ERROR", type(e).__name__)
"""


@pytest.mark.parametrize("kind,target", [("model", "fifo"), ("model", "link-fifo"), ("model", "link-zero"),
                                         ("cache", "fifo"), ("cache", "link-fifo")])
def test_special_files_never_hang_or_read_forever(tmp_path, kind, target):
    src = _two_weight_model(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", tmp_path / "link-fifo")
    os.symlink("/dev/zero", tmp_path / "link-zero")
    out = subprocess.run([sys.executable, "-c", _OPEN, kind, str(tmp_path / target), src],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ERROR ModelLoadError" if kind == "model" else "WARNED 1"), out.stdout


# -- 16: run racing close -----------------------------------------------------------------------

def test_run_racing_close_finishes_or_says_closed(tmp_path):
    src = _two_weight_model(tmp_path)
    for _ in range(20):
        s = InferenceSession(src)
        errors, done = [], threading.Event()

        def loop():
            while not done.is_set():
                try:
                    s.run(None, _feed())
                except InvalidArgument as e:
                    assert "closed" in str(e)
                    return
                except BaseException as e:  # anything else is the bug
                    errors.append(e)
                    return

        threads = [threading.Thread(target=loop) for _ in range(3)]
        for t in threads:
            t.start()
        s.close()
        done.set()
        for t in threads:
            t.join()
        assert not errors, errors


# -- 17: models onnxruntime refuses ------------------------------------------------------------------

@pytest.mark.parametrize("case", ["output-count", "output-dtype"])
def test_if_branches_that_disagree_are_refused(case):
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, [2])])
    if case == "output-count":
        other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"]), helper.make_node("Identity", ["x"], ["e2"])],
                                  "else", [], [helper.make_tensor_value_info("e", F, [2]), helper.make_tensor_value_info("e2", F, [2])])
    else:
        other = helper.make_graph([helper.make_node("Cast", ["x"], ["e"], to=TensorProto.DOUBLE)], "else", [],
                                  [helper.make_tensor_value_info("e", TensorProto.DOUBLE, [2])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                          [helper.make_tensor_value_info("x", F, [2]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", F, None)])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    with pytest.raises(Exception):
        ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    with pytest.raises(InvalidGraph, match="If"):
        InferenceSession(data)


# -- invalid UTF-8 anywhere in a string field --------------------------------------------------------

@pytest.mark.parametrize("where", ["dim_param", "attribute-name", "metadata-key", "node-input", "value-info-name",
                                   "external-data-value", "opset-domain"])
def test_invalid_utf8_in_any_string_field_is_a_model_load_error(where):
    marker = "ZZMARKZZ"
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "W")
    x = helper.make_tensor_value_info("x", F, [marker if where == "dim_param" else 2, 2])
    node = helper.make_node("Gemm", ["x", marker if where == "node-input" else "W"], ["y"],
                            **{(marker if where == "attribute-name" else "alpha"): 1.0})
    g = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", F, None)], [w])
    if where == "node-input":
        g.initializer[0].name = marker
    if where == "value-info-name":
        g.value_info.append(helper.make_tensor_value_info(marker, F, [2]))
    if where == "external-data-value":
        e = g.initializer[0].external_data.add()
        e.key, e.value = "checksum", marker
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)] +
                          ([helper.make_opsetid(marker, 1)] if where == "opset-domain" else []))
    if where == "metadata-key":
        helper.set_model_props(m, {marker: "v"})
    raw = m.SerializeToString()
    assert raw.count(marker.encode()) >= 1
    bad = raw.replace(marker.encode(), b"ZZ\xffMARKZZ"[:len(marker)])
    with pytest.raises(ModelLoadError, match="UTF-8"):
        InferenceSession(bad)


def test_batchnorm_statistics_not_one_per_channel_are_not_folded():
    """A fuzzer-found case: BN variance of shape (C, 1) made the Conv+BN fold's pack raise a raw
    ValueError.  Such statistics are not folded; the model then runs or is refused with our error."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 2, 3, 3)).astype(np.float32), "W")]
    for name, shape in (("s", (4,)), ("bb", (4,)), ("m", (4,)), ("v", (4, 1))):
        inits.append(numpy_helper.from_array(np.abs(rng.standard_normal(shape)).astype(np.float32) + 0.1, name))
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, 2, 5, 5])],
                          [helper.make_tensor_value_info("y", F, None)], inits)
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)], ir_version=8).SerializeToString()
    try:
        with InferenceSession(data) as s:
            s.run(None, {"x": np.ones((1, 2, 5, 5), np.float32)})
    except OnnxpackError:
        pass
