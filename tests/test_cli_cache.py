"""``onnxpack cache info PATH`` and ``onnxpack cache compact PATH``.

Oracles: the cache file reader (``cache_file.info`` / ``CacheFile.get(verify=True)``), the bytes,
inode and folder listing on disk, and a session that must pack nothing after a compaction.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

import onnxpack
from onnxpack.cli import main
from onnxpack.prepack import cache_file as cf
from onnxpack.prepack.cache_file import CacheFile, append_entries

from onnxpack_sample_models import build_sample, sample_inputs  # models/build.py, via tests/conftest.py


def bufs(seed: int, n: int = 3000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n // 30, 30)).astype("<f4"), np.arange(seed + 1, dtype="<i8")]


ENTRIES = {f"matmul/2/{i:032x}": bufs(i) for i in range(4)}


@pytest.fixture
def cache(tmp_path) -> str:
    """A cache file with garbage: two appends (one old index) and the junk of a torn append."""
    path = str(tmp_path / "c.cache")
    keys = list(ENTRIES)
    append_entries(path, {k: ENTRIES[k] for k in keys[:2]})
    append_entries(path, {k: ENTRIES[k] for k in keys[2:]})
    with open(path, "ab") as f:
        f.write(b"\xab" * 10_000)  # what a kill -9 mid-append leaves behind
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_same_entries(path: str) -> None:
    with CacheFile.open(path) as c:
        assert c.keys() == set(ENTRIES)
        for k, want in ENTRIES.items():
            for a, b in zip(c.get(k, verify=True), want, strict=True):
                assert a.dtype == b.dtype and np.array_equal(a, b)


# -- info ---------------------------------------------------------------------------------------


def test_info_lists_entries_sizes_and_wasted_bytes(capsys, cache):
    code, out, err = run(capsys, "info", cache)
    assert code == 0 and err == ""
    truth = cf.info(cache)
    assert f"{len(ENTRIES)} entries" in out
    assert f"({os.path.getsize(cache)} bytes)" in out
    assert f"wasted {truth.wasted_bytes} bytes" in out
    assert truth.wasted_bytes > 10_000  # the junk, the first index, padding
    for key, b in ENTRIES.items():
        line = next(line for line in out.splitlines() if key in line)
        assert str(sum(x.nbytes for x in b)) in line.split()
        assert "<f4[100, 30]" in line


def test_info_json_matches_the_reader(capsys, cache):
    code, out, _ = run(capsys, "info", "--json", cache)
    assert code == 0
    got = json.loads(out)
    truth = cf.info(cache)
    assert got["file_size"] == truth.file_size == os.path.getsize(cache)
    assert got["wasted_bytes"] == truth.wasted_bytes
    assert got["live_bytes"] == sum(sum(a.nbytes for a in b) for b in ENTRIES.values())
    assert {e["key"]: e["nbytes"] for e in got["entries"]} == {
        k: sum(a.nbytes for a in b) for k, b in ENTRIES.items()
    }
    assert got["file_size"] == cf.HEADER_SIZE + got["live_bytes"] + got["index_bytes"] + got["wasted_bytes"]


def test_info_changes_nothing(capsys, cache):
    os.utime(cache, ns=(10**9, 10**9))
    before = os.stat(cache)
    data = open(cache, "rb").read()
    assert run(capsys, "info", cache)[0] == 0
    after = os.stat(cache)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert open(cache, "rb").read() == data


# -- compact ------------------------------------------------------------------------------------


def test_compact_drops_garbage_keeps_entries_and_renames(capsys, cache, tmp_path):
    before = cf.info(cache)
    ino = os.stat(cache).st_ino
    old = CacheFile.open(cache)  # another process's live mapping of the old file
    old_views = {k: old.get(k) for k in ENTRIES}
    code, out, err = run(capsys, "compact", cache)
    assert code == 0 and err == ""
    after = cf.info(cache)
    assert f"{len(ENTRIES)} entries kept" in out
    assert f"{before.file_size} -> {after.file_size} bytes" in out
    assert after.file_size < before.file_size - 10_000
    assert after.wasted_bytes < before.wasted_bytes
    assert after.wasted_bytes < cf.REGION_ALIGNMENT * (2 * len(ENTRIES) + 1)  # padding only
    assert_same_entries(cache)
    assert os.stat(cache).st_ino != ino  # a new file renamed over the path: never rewritten in place
    for k, views in old_views.items():  # the old mapping still reads the old (same) bytes
        for a, b in zip(views, ENTRIES[k], strict=True):
            assert np.array_equal(a, b)
    old.close()
    leftovers = sorted(os.listdir(tmp_path))
    assert leftovers == ["c.cache", "c.cache" + cf.LOCK_SUFFIX]  # no temp files left behind
    # Compacting again finds nothing to free and keeps every entry.
    assert run(capsys, "compact", cache)[0] == 0
    assert cf.info(cache).file_size == after.file_size
    assert_same_entries(cache)


def test_compact_drops_entries_whose_bytes_fail_their_crc(capsys, cache):
    key = list(ENTRIES)[1]
    with CacheFile.open(cache) as c:
        off = c.entry(key).buffers[0].offset
    with open(cache, "r+b") as f:
        f.seek(off + 3)
        f.write(b"\xff\xff")
    code, out, _ = run(capsys, "compact", cache)
    assert code == 0
    assert f"dropped {key}" in out
    with CacheFile.open(cache) as c:
        assert c.keys() == set(ENTRIES) - {key}
        for k in c.keys():
            c.get(k, verify=True)


def test_session_after_compact_packs_nothing(capsys, tmp_path):
    model = build_sample("mlp", str(tmp_path))
    path = str(tmp_path / "s.cache")
    o = onnxpack.SessionOptions()
    o.add_session_config_entry("onnxpack.prepacked_cache_path", path)
    with onnxpack.InferenceSession(model, o) as s:
        want = s.run(None, sample_inputs("mlp"))
    with open(path, "ab") as f:
        f.write(b"\0" * 5000)
    assert run(capsys, "compact", path)[0] == 0
    with onnxpack.InferenceSession(model, o) as s:
        st = s.get_prepack_stats()
        assert st["weights_packed"] == 0 and st["blobs_from_cache"] == 3
        for a, b in zip(s.run(None, sample_inputs("mlp")), want, strict=True):
            assert np.array_equal(a, b)


# -- errors: one line, exit 2, nothing written --------------------------------------------------


def _newer(data: bytes) -> bytes:
    b = bytearray(data)
    for i in range(cf.NUM_SLOTS):
        struct.pack_into("<I", b, i * cf.SLOT_SIZE + 8, cf.FORMAT_VERSION + 1)
    return bytes(b)


def _torn_slots(data: bytes) -> bytes:
    b = bytearray(data)
    for i in range(cf.NUM_SLOTS):
        b[i * cf.SLOT_SIZE + 20] ^= 1
    return bytes(b)


BAD = {
    "foreign": (lambda d: b"PK\x03\x04" + bytes(len(d)), "not an onnxpack cache file"),
    "newer": (_newer, "newer onnxpack"),
    "damaged": (_torn_slots, "commit slots"),
    "truncated": (lambda d: d[: cf.HEADER_SIZE + 100], "index bounds"),  # inside the first regions
}


@pytest.mark.parametrize("action", ["info", "compact"])
@pytest.mark.parametrize("kind", list(BAD), ids=list(BAD))
def test_bad_file_is_one_line_exit_2_and_untouched(capsys, cache, action, kind):
    mutate, words = BAD[kind]
    data = mutate(open(cache, "rb").read())
    with open(cache, "wb") as f:
        f.write(data)
    code, out, err = run(capsys, action, cache)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("onnxpack cache: error: ") and words in err
    assert "Traceback" not in err
    assert open(cache, "rb").read() == data


def test_truncated_after_the_first_commit_shows_the_first_commit(capsys, cache):
    """A cut inside the second append's bytes leaves the first commit (the other slot) valid."""
    with open(cache, "r+b") as f:
        header = f.read(cf.HEADER_SIZE)
        # index offset: bytes 24..32 of each slot (magic, version, flags, sequence before it)
        first_index = min(struct.unpack_from("<Q", header, i * cf.SLOT_SIZE + 24)[0] for i in range(cf.NUM_SLOTS))
        f.truncate(first_index + 4096)
    code, out, _ = run(capsys, "info", "--json", cache)
    assert code == 0
    assert {e["key"] for e in json.loads(out)["entries"]} == set(list(ENTRIES)[:2])


@pytest.mark.parametrize("action", ["info", "compact"])
def test_missing_path_and_folder_are_errors(capsys, tmp_path, action):
    code, out, err = run(capsys, action, str(tmp_path / "nope.cache"))
    assert code == 2 and err.count("\n") == 1 and "no such file" in err
    assert not (tmp_path / "nope.cache").exists() and not (tmp_path / "nope.cache.lock").exists()
    code, out, err = run(capsys, action, str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "regular file" in err


def test_usage_errors_exit_2(capsys):
    assert main(["cache"]) == 2
    assert main(["cache", "frobnicate", "x"]) == 2
    assert main(["cache", "info"]) == 2
    capsys.readouterr()
