"""The packed-weight cache file as sessions use it (``onnxpack.prepacked_cache_path``).

Issue 6, "Tests": two processes in a row, no-op saves, create/close cycles, shared files, user
containers, models that carry saved blobs, concurrent processes, corrupt and truncated files,
kill -9 during an append, and unwritable folders.  Oracles: onnxruntime's outputs, the bytes and
``os.stat`` of the file on disk, and the cache file reader with CRC-32 verification.

Where the issue says "process", the test runs real subprocesses (``_CHILD``): keys of weights
mapped from a file use the file's identity, so only a fresh process proves they are stable.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack_sample_models import build_sample, sample_inputs  # models/build.py, via tests/conftest.py
from onnxpack.errors import InvalidArgument, PrepackWarning
from onnxpack.prepack import cache_file as cf
from onnxpack.prepack.cache_file import CacheFile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_PY = os.path.join(ROOT, "models", "build.py")

MODELS = ("mlp", "cnn", "subgraphs", "transformer", "fp16_mlp")
# fp16_mlp computes one MatMul in float16 (onnxruntime and numpy accumulate differently).
ATOL = {"fp16_mlp": 2e-3}
CHILD_TIMEOUT = 120


# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Sample models built once per module, so file-identity keys are stable across the tests."""
    out = tmp_path_factory.mktemp("models")
    return {name: build_sample(name, str(out)) for name in MODELS}


@pytest.fixture(scope="module")
def oracle(models) -> dict[str, list[np.ndarray]]:
    return {n: onnxruntime.InferenceSession(p).run(None, sample_inputs(n)) for n, p in models.items()}


def check_outputs(name: str, got, oracle) -> None:
    for a, b in zip(got, oracle[name], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=ATOL.get(name, 1e-5), err_msg=name)


def options(cache: str | os.PathLike, **extra: str) -> onnxpack.SessionOptions:
    o = onnxpack.SessionOptions()
    o.add_session_config_entry("onnxpack.prepacked_cache_path", os.fspath(cache))
    for k, v in extra.items():
        o.add_session_config_entry(k, v)
    return o


def run_in_process(model: str | bytes, name: str | None, cache, **kw):
    """(stats, outputs, cache keys of the session's packs) of one session, closed afterwards."""
    with onnxpack.InferenceSession(model, options(cache), **kw) as s:
        ys = s.run(None, sample_inputs(name)) if name else None
        return s.get_prepack_stats(), ys, {row["key"] for row in s.get_prepack_log()}


def stat(path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def age(path) -> None:
    """Set an old mtime, so any later write shows whatever the file system's time granularity."""
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))


def assert_loadable(path, keys=None) -> set[str]:
    """Every entry of the file loads with its CRC-32 checked; returns the keys."""
    with CacheFile.open(path) as c:
        assert len(c) > 0
        for k in c.keys():
            assert all(isinstance(b, np.ndarray) for b in c.get(k, verify=True))
        found = c.keys()
    if keys is not None:
        assert keys <= found
    return found


# A child process: waits for an optional "go" file, optionally kills itself with SIGKILL halfway
# through one of the cache writer's writes, runs its models with the cache path set, saves each
# model's outputs to OUT/<name>.npz and prints stats and pack keys as JSON.
_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    import numpy as np
    cfg = json.loads(sys.argv[1])
    import runpy
    import onnxpack
    from onnxpack.prepack import cache_file as cf
    sample_inputs = runpy.run_path(cfg["build_py"])["sample_inputs"]  # models/build.py

    kill = cfg.get("kill")
    if kill:
        real = cf._pwrite_all
        def pwrite(fd, data, offset):
            view = memoryview(data).cast("B")
            hit = {"region": offset >= cf.HEADER_SIZE and bytes(view[:8]) != cf.INDEX_MAGIC,
                   "index": bytes(view[:8]) == cf.INDEX_MAGIC,
                   "slot": offset < cf.HEADER_SIZE}[kill]
            if hit:
                real(fd, view[: len(view) // 2], offset)  # torn write: reaches the page cache
                os.kill(os.getpid(), signal.SIGKILL)
            real(fd, data, offset)
        cf._pwrite_all = pwrite
    if cfg.get("go"):
        while not os.path.exists(cfg["go"]):
            time.sleep(0.002)
    report = {}
    for name, path in cfg["models"].items():
        o = onnxpack.SessionOptions()
        o.add_session_config_entry("onnxpack.prepacked_cache_path", cfg["cache"])
        with onnxpack.InferenceSession(path, o) as s:
            ys = s.run(None, sample_inputs(name))
            np.savez(os.path.join(cfg["out"], name + ".npz"), *ys)
            report[name] = {"stats": s.get_prepack_stats(),
                            "keys": sorted({r["key"] for r in s.get_prepack_log()})}
    print(json.dumps(report))
""")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def spawn(tmp_path, tag: str, models: dict[str, str], cache, **cfg) -> tuple[subprocess.Popen, str]:
    out = tmp_path / f"out-{tag}"
    out.mkdir()
    cfg.update(build_py=BUILD_PY, models=models, cache=os.fspath(cache), out=str(out))
    p = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(cfg)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env(), cwd=str(tmp_path))
    return p, str(out)


def finish(p: subprocess.Popen, out: str) -> tuple[dict, dict[str, list[np.ndarray]]]:
    stdout, stderr = p.communicate(timeout=CHILD_TIMEOUT)
    assert p.returncode == 0, stderr
    report = json.loads(stdout.strip().splitlines()[-1])
    outputs = {}
    for name in report:
        with np.load(os.path.join(out, name + ".npz")) as z:
            outputs[name] = [z[f"arr_{i}"] for i in range(len(z.files))]
    return report, outputs


def run_child(tmp_path, tag, models, cache, **cfg):
    return finish(*spawn(tmp_path, tag, models, cache, **cfg))


def matmul_model(w: np.ndarray, *, relu: bool = False) -> bytes:
    """A tiny in-proto model (content-hash keys); ``relu`` makes a different graph, same weight."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h" if relu else "y"], name="mm")]
    if relu:
        nodes.append(helper.make_node("Relu", ["h"], ["y"], name="relu"))
    d = w.shape[0]
    g = helper.make_graph(
        nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, w.shape[1]])],
        [numpy_helper.from_array(w, "W")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m.SerializeToString()


# -- processes in a row, no-op saves, cycles ----------------------------------------------------


def test_second_process_packs_nothing_and_gives_identical_outputs(tmp_path, models, oracle):
    cache = tmp_path / "c.cache"
    want = {"mlp": models["mlp"], "transformer": models["transformer"]}
    r1, y1 = run_child(tmp_path, "first", want, cache)
    size_after_first = os.path.getsize(cache)
    r2, y2 = run_child(tmp_path, "second", want, cache)
    for name in want:
        s1, s2 = r1[name]["stats"], r2[name]["stats"]
        assert s1["weights_packed"] > 0 and s1["blobs_from_cache"] == 0
        assert s2["weights_packed"] == 0 and s2["bytes_packed"] == 0
        assert s2["blobs_from_cache"] == s1["weights_packed"]
        assert s2["bytes_mapped"] == s1["bytes_packed"]
        assert r1[name]["keys"] == r2[name]["keys"]  # file-identity keys survive a restart
        for a, b in zip(y1[name], y2[name], strict=True):
            assert np.array_equal(a, b)  # bit-identical: the same packed bytes
        check_outputs(name, y2[name], oracle)
    assert os.path.getsize(cache) == size_after_first
    assert_loadable(cache, set(r1["mlp"]["keys"]) | set(r1["transformer"]["keys"]))


def test_noop_session_leaves_size_and_mtime_unchanged(tmp_path, models, oracle):
    cache = tmp_path / "c.cache"
    run_in_process(models["cnn"], "cnn", cache)
    age(cache)
    age(str(cache) + cf.LOCK_SUFFIX)
    before, lock_before = stat(cache), stat(str(cache) + cf.LOCK_SUFFIX)
    stats, ys, _ = run_in_process(models["cnn"], "cnn", cache)
    assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] == 3
    check_outputs("cnn", ys, oracle)
    assert stat(cache) == before  # same inode, size and mtime: not even opened for writing
    assert stat(str(cache) + cf.LOCK_SUFFIX) == lock_before  # the writers' lock was not taken


def test_twenty_create_close_cycles_do_not_grow_the_file(tmp_path, models, oracle):
    cache = tmp_path / "c.cache"
    stats, _, _ = run_in_process(models["subgraphs"], "subgraphs", cache)
    assert stats["weights_packed"] == 3
    age(cache)
    first = stat(cache)
    for _ in range(20):
        stats, ys, _ = run_in_process(models["subgraphs"], "subgraphs", cache)
        assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] == 3
    check_outputs("subgraphs", ys, oracle)
    assert stat(cache) == first
    assert len(cf.info(cache).entries) == 3


# -- sharing ------------------------------------------------------------------------------------


def test_two_models_share_one_file(tmp_path, models, oracle):
    cache = tmp_path / "c.cache"
    _, _, keys_mlp = run_in_process(models["mlp"], "mlp", cache)
    size1 = os.path.getsize(cache)
    _, _, keys_cnn = run_in_process(models["cnn"], "cnn", cache)
    assert os.path.getsize(cache) > size1  # appended in place after the first model's entries
    assert assert_loadable(cache) == keys_mlp | keys_cnn
    age(cache)
    before = stat(cache)
    r, ys = run_child(tmp_path, "both", {"cnn": models["cnn"], "mlp": models["mlp"]}, cache)
    for name in ("mlp", "cnn"):
        assert r[name]["stats"]["weights_packed"] == 0
        assert r[name]["stats"]["blobs_from_cache"] == 3
        check_outputs(name, ys[name], oracle)
    assert stat(cache) == before


def test_equal_weights_in_two_models_share_one_entry(tmp_path):
    cache = tmp_path / "c.cache"
    w = np.random.default_rng(0).standard_normal((32, 24)).astype(np.float32)
    x = {"x": np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)}
    a, b = matmul_model(w), matmul_model(w, relu=True)
    with onnxpack.InferenceSession(a, options(cache)) as s:
        assert s.get_prepack_stats()["weights_packed"] == 1
        np.testing.assert_allclose(s.run(None, x)[0], x["x"] @ w, rtol=1e-5, atol=1e-5)
    age(cache)
    before = stat(cache)
    with onnxpack.InferenceSession(b, options(cache)) as s:  # another model, the same weight bytes
        st = s.get_prepack_stats()
        assert st["weights_packed"] == 0 and st["blobs_from_cache"] == 1
        np.testing.assert_allclose(s.run(None, x)[0], np.maximum(x["x"] @ w, 0), rtol=1e-5, atol=1e-5)
    assert stat(cache) == before
    assert len(assert_loadable(cache)) == 1


@pytest.mark.parametrize("user_container", [False, True], ids=["own-container", "user-container"])
def test_with_and_without_a_user_container(tmp_path, models, oracle, user_container):
    cache = tmp_path / "c.cache"
    kw = {"prepacked_weights_container": onnxpack.PrepackedWeightsContainer()} if user_container else {}
    s1 = onnxpack.InferenceSession(models["mlp"], options(cache), **kw)
    assert s1.get_prepack_stats()["weights_packed"] == 3
    age(cache)
    before = stat(cache)
    with onnxpack.InferenceSession(models["mlp"], options(cache), **kw) as s2:
        st = s2.get_prepack_stats()
        assert st["weights_packed"] == 0
        if user_container:  # the live session's packs come first; the cache is not even read
            assert st["blobs_from_container"] == 3 and st["blobs_from_cache"] == 0
        else:
            assert st["blobs_from_cache"] == 3 and st["blobs_from_container"] == 0
        check_outputs("mlp", s2.run(None, sample_inputs("mlp")), oracle)
    s1.close()
    # A fresh container after every holder is gone: the cache file serves it.
    kw = {"prepacked_weights_container": onnxpack.PrepackedWeightsContainer()} if user_container else {}
    with onnxpack.InferenceSession(models["mlp"], options(cache), **kw) as s3:
        st = s3.get_prepack_stats()
        assert st["weights_packed"] == 0 and st["blobs_from_cache"] == 3
        check_outputs("mlp", s3.run(None, sample_inputs("mlp")), oracle)
    assert stat(cache) == before


def test_model_with_saved_blobs_uses_them_first_and_adds_nothing(tmp_path, models, oracle):
    opt = tmp_path / "opt.onnx"
    o = onnxpack.SessionOptions()
    o.optimized_model_filepath = str(opt)
    o.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    onnxpack.InferenceSession(models["mlp"], o).close()
    cache = tmp_path / "c.cache"
    run_in_process(models["cnn"], "cnn", cache)  # the cache exists and holds other entries
    age(cache)
    before = stat(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrepackWarning)
        stats, ys, _ = run_in_process(str(opt), "mlp", cache)
    assert stats["blobs_from_model"] == 3
    assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] == 0
    check_outputs("mlp", ys, oracle)
    assert stat(cache) == before
    # And with no cache file at all, none is created.
    fresh = tmp_path / "fresh.cache"
    stats, _, _ = run_in_process(str(opt), "mlp", fresh)
    assert stats["blobs_from_model"] == 3 and not fresh.exists()


# -- concurrency --------------------------------------------------------------------------------


def test_four_concurrent_processes_on_one_fresh_path(tmp_path, models, oracle):
    cache = tmp_path / "c.cache"
    go = tmp_path / "go"
    sets = [("mlp", "cnn"), ("cnn", "transformer"), ("transformer", "mlp"), ("fp16_mlp", "subgraphs")]
    procs = [spawn(tmp_path, f"p{i}", {n: models[n] for n in names}, cache, go=str(go))
             for i, names in enumerate(sets)]
    time.sleep(0.5)  # let them import; then all start creating sessions at once
    go.touch()
    keys: set[str] = set()
    for p, out in procs:
        report, ys = finish(p, out)
        for name, r in report.items():
            keys |= set(r["keys"])
            check_outputs(name, ys[name], oracle)
    assert assert_loadable(cache) == keys  # every pack of every process, each once
    info = cf.info(cache)
    assert len(info.entries) == len(keys)
    for name in MODELS:  # every model's entries were committed: a new session packs nothing
        stats, ys, _ = run_in_process(models[name], name, cache)
        assert stats["weights_packed"] == 0, name
        check_outputs(name, ys, oracle)


# -- damaged files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_cache(models, tmp_path_factory) -> bytes:
    """The bytes of a valid cache file holding the mlp's three entries."""
    path = tmp_path_factory.mktemp("good") / "c.cache"
    stats, _, _ = run_in_process(models["mlp"], "mlp", path)
    assert stats["weights_packed"] == 3
    return path.read_bytes()


def _slot_fields(data: bytes, i: int = 0) -> tuple:
    return cf._SLOT.unpack_from(data, i * cf.SLOT_SIZE)


def _with_index(data: bytes, mutate) -> bytes:
    """``data`` with its index changed by ``mutate(bytearray)`` and every CRC made valid again."""
    _, _, _, seq, ioff, ilen, count, _, _, _ = _slot_fields(data)
    index = bytearray(data[ioff:ioff + ilen])
    mutate(index)
    slot = cf._encode_slot(seq, ioff, bytes(index), count)
    return slot * cf.NUM_SLOTS + data[cf.HEADER_SIZE:ioff] + bytes(index)


def _first_buffer_at(index: bytearray) -> int:
    (klen, _nbuf) = cf._ENTRY.unpack_from(index, cf._INDEX_HEADER.size)
    return cf._INDEX_HEADER.size + cf._ENTRY.size + klen


def _set_first_offset(value_of):
    def mutate(index: bytearray) -> None:
        at = _first_buffer_at(index)
        off, length, dt, ndim, crc = cf._BUFFER.unpack_from(index, at)
        cf._BUFFER.pack_into(index, at, value_of(off, len(index)), length, dt, ndim, crc)
    return mutate


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x5A
    return bytes(b)


def _both_slots(data: bytes, fn) -> bytes:
    b = bytearray(data)
    for i in range(cf.NUM_SLOTS):
        fn(b, i * cf.SLOT_SIZE)
    return bytes(b)


def _index_offset(data: bytes) -> int:
    return _slot_fields(data)[4]


CORRUPTIONS = {
    # foreign: no magic in either slot -> never written to
    "magic": (lambda d: _both_slots(d, lambda b, o: b.__setitem__(slice(o, o + 8), b"NOTOURS!")), "kept"),
    # a newer format version -> never written to
    "version": (lambda d: _both_slots(d, lambda b, o: struct.pack_into("<I", b, o + 8, cf.FORMAT_VERSION + 1)), "kept"),
    # both commit slots fail their CRC -> ours but damaged -> rebuilt at the next append
    "slot-crc": (lambda d: _both_slots(d, lambda b, o: b.__setitem__(o + 20, b[o + 20] ^ 1)), "rebuilt"),
    # the slots point past the end of the file
    "slot-index-bounds": (lambda d: _both_slots(d, lambda b, o: (
        struct.pack_into("<Q", b, o + 24, len(d) + 4096),
        struct.pack_into("<I", b, o + cf._SLOT.size, cf.crc32(bytes(b[o:o + cf._SLOT.size]))))), "rebuilt"),
    # index bytes changed under a valid slot: the index CRC-32 fails
    "index-crc": (lambda d: _flip(d, _index_offset(d) + 30), "rebuilt"),
    # a structurally bad index with valid CRCs (wrong index magic)
    "index-magic": (lambda d: _with_index(d, lambda ix: ix.__setitem__(slice(0, 8), b"XXXXXXXX")), "rebuilt"),
    # an entry whose region lies beyond the index (within the file), CRCs valid
    "entry-bounds-in-file": (lambda d: _with_index(d, _set_first_offset(lambda off, n: _index_offset(d))), "rebuilt"),
    # an entry whose region lies far beyond the end of the file, CRCs valid
    "entry-bounds-past-eof": (lambda d: _with_index(d, _set_first_offset(lambda off, n: 1 << 40)), "rebuilt"),
    # an entry at an unaligned offset, CRCs valid
    "entry-unaligned": (lambda d: _with_index(d, _set_first_offset(lambda off, n: off + 4)), "rebuilt"),
}


def _fall_back(tmp_path, models, oracle, data: bytes):
    """A session on a cache file holding ``data`` warns once, packs in memory and computes right."""
    cache = tmp_path / "c.cache"
    cache.write_bytes(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats, ys, keys = run_in_process(models["mlp"], "mlp", cache)
    prepack = [w for w in caught if issubclass(w.category, PrepackWarning)]
    assert len(prepack) == 1 and "ignored" in str(prepack[0].message), [str(w.message) for w in prepack]
    assert stats["weights_packed"] == 3 and stats["blobs_from_cache"] == 0
    check_outputs("mlp", ys, oracle)
    return cache, keys


@pytest.mark.parametrize("kind", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_corrupt_file_falls_back_with_a_warning(tmp_path, models, oracle, good_cache, kind):
    mutate, policy = CORRUPTIONS[kind]
    bad = mutate(good_cache)
    assert bad != good_cache
    with pytest.raises(onnxpack.errors.CacheFileError):
        CacheFile.open(_write(tmp_path / "probe", bad))
    cache, keys = _fall_back(tmp_path, models, oracle, bad)
    if policy == "kept":  # foreign or newer: may be someone else's data, never touched
        assert cache.read_bytes() == bad
    else:  # ours but holding nothing usable: replaced (rename) by a fresh file with the packs
        assert assert_loadable(cache) == keys
        stats, _, _ = run_in_process(models["mlp"], "mlp", cache)
        assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] == 3


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_truncated_file_falls_back_with_a_warning(tmp_path, models, oracle, good_cache):
    n = len(good_cache)
    rng = np.random.default_rng(6)
    points = sorted({1, 7, 8, 12, cf.SLOT_SIZE - 1, cf.SLOT_SIZE, cf.HEADER_SIZE - 1, cf.HEADER_SIZE,
                     _index_offset(good_cache), n - 1, *map(int, rng.integers(cf.HEADER_SIZE, n, 6))})
    for i, cut in enumerate(points):
        sub = tmp_path / f"cut{i}"
        sub.mkdir()
        cache, _ = _fall_back(sub, models, oracle, good_cache[:cut])
        data = cache.read_bytes()
        if data != good_cache[:cut]:  # rebuilt (ours but damaged); left alone if it looked foreign
            assert_loadable(cache)


def test_bad_entry_bytes_are_caught_with_verify(tmp_path, models, oracle, good_cache):
    """Region bytes are covered by CRC-32 only with onnxpack.verify_prepacked=1 (no full read)."""
    with CacheFile.open(_write(tmp_path / "probe", good_cache)) as c:
        off = next(iter(c._entries.values())).buffers[0].offset
    cache = tmp_path / "c.cache"
    cache.write_bytes(_flip(good_cache, off + 5))
    with pytest.warns(PrepackWarning, match="re-packing"):
        with onnxpack.InferenceSession(models["mlp"], options(cache, **{"onnxpack.verify_prepacked": "1"})) as s:
            st = s.get_prepack_stats()
            assert st["weights_packed"] == 1 and st["blobs_from_cache"] == 2
            check_outputs("mlp", s.run(None, sample_inputs("mlp")), oracle)


# -- crashes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["region", "index", "slot"])
def test_kill_9_during_a_session_append_leaves_a_loadable_file(tmp_path, models, oracle, stage):
    cache = tmp_path / "c.cache"
    _, _, keys_mlp = run_in_process(models["mlp"], "mlp", cache)
    p, _ = spawn(tmp_path, "killed", {"cnn": models["cnn"]}, cache, kill=stage)
    p.communicate(timeout=CHILD_TIMEOUT)
    assert p.returncode == -signal.SIGKILL
    assert os.path.getsize(cache) > 0
    # The previous commit is intact: mlp's entries load and serve a new session.
    assert assert_loadable(cache) == keys_mlp
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrepackWarning)
        stats, ys, _ = run_in_process(models["mlp"], "mlp", cache)
        assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] == 3
        check_outputs("mlp", ys, oracle)
        # The file still takes appends (the junk of the torn one is garbage, not damage).
        stats, ys, keys_cnn = run_in_process(models["cnn"], "cnn", cache)
        assert stats["weights_packed"] == 3
        check_outputs("cnn", ys, oracle)
    assert assert_loadable(cache) == keys_mlp | keys_cnn
    assert cf.info(cache).wasted_bytes > 0  # the torn append, until `onnxpack cache compact`


def test_kill_9_while_creating_a_fresh_file(tmp_path, models, oracle):
    cache = tmp_path / "c.cache"
    p, _ = spawn(tmp_path, "killed", {"cnn": models["cnn"]}, cache, kill="region")
    p.communicate(timeout=CHILD_TIMEOUT)
    assert p.returncode == -signal.SIGKILL
    assert not cache.exists()  # a new file is written to a temp name, then renamed
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrepackWarning)
        stats, ys, keys = run_in_process(models["cnn"], "cnn", cache)
    assert stats["weights_packed"] == 3
    check_outputs("cnn", ys, oracle)
    assert assert_loadable(cache) == keys


_APPENDER = textwrap.dedent("""
    import sys, numpy as np, onnxpack
    from onnx import TensorProto, helper, numpy_helper

    def matmul_model(w):
        g = helper.make_graph(
            [helper.make_node("MatMul", ["x", "W"], ["y"])], "mm",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, w.shape[0]])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, w.shape[1]])],
            [numpy_helper.from_array(w, "W")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 9
        return m.SerializeToString()

    o = onnxpack.SessionOptions()
    o.add_session_config_entry("onnxpack.prepacked_cache_path", sys.argv[1])
    rng = np.random.default_rng()
    while True:  # a new weight every time: every session appends
        w = rng.standard_normal((128, 96)).astype(np.float32)
        onnxpack.InferenceSession(matmul_model(w), o).close()
""")


def test_kill_9_at_a_random_moment_leaves_a_loadable_file(tmp_path):
    cache = tmp_path / "c.cache"
    p = subprocess.Popen([sys.executable, "-c", _APPENDER, str(cache)],
                         env=child_env(), stderr=subprocess.PIPE, cwd=str(tmp_path))
    deadline = time.monotonic() + 60
    while (not cache.exists() or os.path.getsize(cache) < 300_000) and time.monotonic() < deadline:
        assert p.poll() is None, p.stderr.read().decode()
        time.sleep(0.01)
    time.sleep(float(np.random.default_rng().uniform(0, 0.2)))
    p.kill()
    p.communicate(timeout=CHILD_TIMEOUT)
    assert p.returncode == -signal.SIGKILL
    assert len(assert_loadable(cache)) >= 2


# -- folders we cannot write to -----------------------------------------------------------------


def test_unwritable_cache_warns_and_the_session_works(tmp_path, models, oracle):
    """A write failure (here: the lock file cannot be opened) is a warning, never an error."""
    cache = tmp_path / "c.cache"
    os.mkdir(str(cache) + cf.LOCK_SUFFIX)  # EISDIR for the writer even as root
    with pytest.warns(PrepackWarning, match="not updated"):
        stats, ys, _ = run_in_process(models["mlp"], "mlp", cache)
    assert stats["weights_packed"] == 3
    check_outputs("mlp", ys, oracle)
    assert not cache.exists()


def test_read_only_but_complete_cache_is_used_without_warnings(tmp_path, models, oracle):
    cache = tmp_path / "c.cache"
    run_in_process(models["mlp"], "mlp", cache)
    os.unlink(str(cache) + cf.LOCK_SUFFIX)
    os.mkdir(str(cache) + cf.LOCK_SUFFIX)  # any write would fail now
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrepackWarning)
        stats, ys, _ = run_in_process(models["mlp"], "mlp", cache)
    assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] == 3
    check_outputs("mlp", ys, oracle)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_folder_warns_and_the_session_works(tmp_path, models, oracle):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.warns(PrepackWarning):
            stats, ys, _ = run_in_process(models["mlp"], "mlp", folder / "c.cache")
        assert stats["weights_packed"] == 3
        check_outputs("mlp", ys, oracle)
    finally:
        folder.chmod(0o755)


def test_missing_folder_is_an_error_at_creation(tmp_path, models):
    with pytest.raises(InvalidArgument, match="does not exist"):
        onnxpack.InferenceSession(models["mlp"], options(tmp_path / "nope" / "c.cache"))
