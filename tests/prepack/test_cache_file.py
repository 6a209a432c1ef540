"""The persistent packed-weight cache file: round trips, no-op appends, damage, concurrency, crashes."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnxpack.errors import CacheFileError, InvalidArgument
from onnxpack.prepack import cache_file as cf
from onnxpack.prepack.cache_file import CacheFile, append_entries

# -- helpers ------------------------------------------------------------------------------------


def content(key: str, big: bool = False) -> list[np.ndarray]:
    """Deterministic buffers for a key, so any process can check what it reads."""
    seed = zlib.crc32(key.encode())
    rng = np.random.default_rng(seed)
    n = 70_000 if big else int(rng.integers(0, 40))
    return [
        rng.standard_normal(n).astype("<f4"),
        rng.integers(-100, 100, size=(int(rng.integers(1, 4)), 3)).astype("<i8"),
    ]


def assert_entries(path, expected: dict[str, list[np.ndarray]], *, exact=True):
    with CacheFile.open(path) as c:
        if exact:
            assert c.keys() == set(expected)
        for key, bufs in expected.items():
            got = c.get(key, verify=True)
            assert got is not None, key
            assert len(got) == len(bufs)
            for g, b in zip(got, bufs):
                assert g.dtype == b.dtype and g.shape == b.shape
                np.testing.assert_array_equal(g, b)


def check_consistent(path, truth: dict[str, list[np.ndarray]]) -> set[str]:
    """Open ``path``: either CacheFileError, or every entry it has equals the truth exactly."""
    try:
        c = CacheFile.open(path)
    except CacheFileError:
        return set()
    with c:
        assert c.keys() <= set(truth)
        for key in c.keys():
            got = c.get(key, verify=True)
            for g, b in zip(got, truth[key], strict=True):
                assert g.dtype == b.dtype and g.shape == b.shape
                assert g.tobytes() == b.tobytes()
        return c.keys()


def build_rounds(path, rounds):
    truth = {}
    for r in rounds:
        batch = {k: content(k) for k in r}
        append_entries(path, batch)
        truth.update(batch)
    return truth


# -- round trips --------------------------------------------------------------------------------

dtypes = st.sampled_from(["|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"])
arrays = st.tuples(dtypes, st.lists(st.integers(0, 6), max_size=3), st.integers(0, 2**31)).map(
    lambda t: np.random.default_rng(t[2]).integers(0, 255, size=int(np.prod(t[1], dtype=np.int64)) * np.dtype(t[0]).itemsize, dtype=np.uint8).view(t[0]).reshape(t[1])
)
keys = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
batches = st.dictionaries(keys, st.lists(arrays, min_size=1, max_size=3), max_size=4)


@given(st.lists(batches, min_size=1, max_size=3))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip_rounds(rounds):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.bin")
        truth = {}
        for batch in rounds:
            res = append_entries(path, batch)
            assert set(res.added) == set(batch) - set(truth)
            assert set(res.skipped) == set(batch) & set(truth)
            for k, v in batch.items():
                truth.setdefault(k, v)  # the first write of a key wins
        if truth:
            assert_entries(path, {k: list(v) for k, v in truth.items()})
            with CacheFile.open(path) as c:
                for e in c.info().entries:
                    for b in e.buffers:
                        assert b.offset % 64 == 0
                        if b.length >= cf.PAGE_ALIGN_THRESHOLD:
                            assert b.offset % cf.PAGE_SIZE == 0
        else:
            assert not os.path.exists(path)


def test_views_zero_copy_read_only_and_survive_close(tmp_path):
    path = tmp_path / "c.bin"
    big = content("big", big=True)
    append_entries(path, {"big": big, "small": content("small")})
    c = CacheFile.open(path)
    (a, b) = c.get("big")
    assert not a.flags.writeable and not a.flags.owndata
    assert a.ctypes.data % 64 == 0
    info = c.entry("big")
    assert info.buffers[0].offset % cf.PAGE_SIZE == 0  # >= 64 KiB: page aligned
    c.close()
    np.testing.assert_array_equal(a, big[0])  # the mapping lives as long as the views
    assert c.get("missing") is None
    with pytest.raises(CacheFileError, match="closed"):
        c.get("small")


def test_bytes_on_disk_match_index(tmp_path):
    """Independent of the reader: decode the documented layout with struct and compare bytes."""
    path = tmp_path / "c.bin"
    truth = build_rounds(path, [["a", "b"], ["c"]])
    raw = path.read_bytes()
    slots = [struct.unpack_from("<8sIIQQQQIIII", raw, 64 * i) for i in range(2)]
    best = max(slots, key=lambda s: s[3])
    magic, version, flags, seq, ioff, ilen, count, icrc, _, _, scrc = best
    assert (magic, version, seq, count) == (b"OPKCACHE", 1, 2, 3)
    assert scrc == zlib.crc32(raw[64 * slots.index(best) : 64 * slots.index(best) + 60])
    index = raw[ioff : ioff + ilen]
    assert zlib.crc32(index) == icrc and index[:8] == b"OPKINDEX"
    pos = 24
    for _ in range(count):
        klen, nbuf = struct.unpack_from("<HB", index, pos)
        key = index[pos + 4 : pos + 4 + klen].decode()
        pos += 4 + klen
        for j in range(nbuf):
            off, length, dt, ndim, crc = struct.unpack_from("<QQ4sB3xI", index, pos)
            pos += 28
            shape = struct.unpack_from(f"<{ndim}Q", index, pos)
            pos += 8 * ndim
            want = truth[key][j]
            assert dt.rstrip(b"\0").decode() == want.dtype.str and shape == want.shape
            assert raw[off : off + length] == want.tobytes() and crc == zlib.crc32(want.tobytes())
    assert pos == ilen


# -- nothing new, nothing written ---------------------------------------------------------------


def test_noop_append_writes_nothing(tmp_path):
    path = tmp_path / "c.bin"
    truth = build_rounds(path, [["a", "b"], ["c"]])
    before = path.read_bytes()
    st1 = os.stat(path)
    time.sleep(0.01)
    res = append_entries(path, {k: truth[k] for k in ("a", "c")})
    assert res.added == () and res.bytes_written == 0 and set(res.skipped) == {"a", "c"}
    assert append_entries(path, {}).bytes_written == 0
    st2 = os.stat(path)
    assert (st2.st_size, st2.st_mtime_ns, st2.st_ino) == (st1.st_size, st1.st_mtime_ns, st1.st_ino)
    assert path.read_bytes() == before


def test_many_rounds_all_load_and_compact(tmp_path):
    path = tmp_path / "c.bin"
    rounds = [[f"k{r}-{i}" for i in range(3)] for r in range(8)]
    truth = build_rounds(path, rounds)
    assert_entries(path, truth)
    before = cf.info(path)
    assert len(before.entries) == 24 and before.sequence == 8
    assert before.wasted_bytes > 0  # 7 old indexes
    old = CacheFile.open(path)
    old_views = old.get("k0-0")
    res = cf.compact(path)
    assert res.entries == 24 and res.dropped == () and res.bytes_after < res.bytes_before
    after = cf.info(path)
    assert after.wasted_bytes < before.wasted_bytes and after.file_size == res.bytes_after
    assert_entries(path, truth)
    # A mapping taken before the compaction still reads the old, intact bytes.
    np.testing.assert_array_equal(old_views[0], truth["k0-0"][0])
    old.close()
    # And appending after a compaction keeps working.
    truth.update(build_rounds(path, [["z"]]))
    assert_entries(path, truth)


def test_missing_and_empty_files_are_empty(tmp_path):
    path = tmp_path / "c.bin"
    with CacheFile.open(path) as c:
        assert len(c) == 0 and c.get("x") is None
    path.write_bytes(b"")
    c, warning = cf.load_or_empty(path)
    assert len(c) == 0 and warning is None
    res = append_entries(path, {"a": content("a")})
    assert res.added == ("a",)
    assert_entries(path, {"a": content("a")})
    assert cf.info(tmp_path / "nope").entries == ()


@pytest.mark.parametrize(
    "entries",
    [
        {"a": [np.array(["x"])]},
        {"a": [np.zeros(3, dtype=np.complex64)]},
        {"a": [np.zeros(3, dtype=bool)]},
        {"a": [np.zeros((1,) * 9, dtype="<f4")]},
        {"a": []},
        {"a": [np.zeros(1, "<f4")] * (cf.MAX_BUFFERS + 1)},
        {"": [np.zeros(1, "<f4")]},
        {"k" * (cf.MAX_KEY_BYTES + 1): [np.zeros(1, "<f4")]},
        {1: [np.zeros(1, "<f4")]},
    ],
    ids=["str", "complex", "bool", "ndim", "no-buffers", "too-many-buffers", "empty-key", "long-key", "int-key"],
)
def test_bad_entries_rejected_before_writing(tmp_path, entries):
    path = tmp_path / "c.bin"
    with pytest.raises(InvalidArgument):
        append_entries(path, entries)
    assert not path.exists()


def test_big_endian_and_strided_inputs_stored_little_endian(tmp_path):
    path = tmp_path / "c.bin"
    a = np.arange(12, dtype=">f8").reshape(3, 4)[:, ::2]
    append_entries(path, {"a": [a]})
    with CacheFile.open(path) as c:
        (got,) = c.get("a", verify=True)
        assert got.dtype.str == "<f8"
        np.testing.assert_array_equal(got, a)


# -- damage: never a crash, never a wrong buffer ------------------------------------------------


def _rewrite_slot(raw: bytearray, i: int, **fields) -> None:
    names = ["magic", "version", "flags", "seq", "ioff", "ilen", "count", "icrc", "r0", "r1"]
    vals = dict(zip(names, struct.unpack_from("<8sIIQQQQIII", raw, 64 * i)))
    vals.update(fields)
    body = struct.pack("<8sIIQQQQIII", *(vals[n] for n in names))
    raw[64 * i : 64 * i + 64] = body + struct.pack("<I", zlib.crc32(body))


def _newest_slot(raw) -> int:
    seqs = [struct.unpack_from("<Q", raw, 64 * i + 16)[0] for i in range(2)]
    return 0 if seqs[0] >= seqs[1] else 1


def test_truncated_at_every_byte(tmp_path):
    path = tmp_path / "c.bin"
    truth = build_rounds(path, [["a"], ["b", "c"], ["d"]])
    raw = path.read_bytes()
    assert len(raw) < 4096
    seen_states = set()
    cut = tmp_path / "cut.bin"
    for n in range(len(raw) + 1):
        cut.write_bytes(raw[:n])
        seen_states.add(frozenset(check_consistent(cut, truth)))
    # The full file gives everything; shorter files give an earlier commit or an error.
    assert frozenset(truth) in seen_states
    assert frozenset({"a", "b", "c"}) in seen_states  # the previous commit survives a torn tail


def test_truncated_random_points_then_writer_recovers(tmp_path):
    path = tmp_path / "c.bin"
    truth = build_rounds(path, [["a"], ["b"], ["c"]])
    raw = path.read_bytes()
    rng = random.Random(0)
    for n in sorted({0, 3, 8, 64, 100, 128, 200} | set(rng.sample(range(len(raw)), 25))):
        p = tmp_path / f"t{n}.bin"
        p.write_bytes(raw[:n])
        had = check_consistent(p, truth)
        if 0 < n < len(cf.MAGIC):
            # Too short to carry our magic: could be anyone's file, so it is never overwritten.
            with pytest.raises(CacheFileError, match="magic"):
                append_entries(p, {"new": content("new")})
            assert p.read_bytes() == raw[:n]
            continue
        res = append_entries(p, {"new": content("new")})
        # Either the commit it fell back to kept its entries, or the damaged file was rebuilt.
        assert res.rebuilt or had <= cf.CacheFile.open(p).keys()
        want = {"new": content("new")} | ({} if res.rebuilt else {k: truth[k] for k in had})
        assert_entries(p, want)


class _Crash(Exception):
    pass


def test_crash_at_every_write_keeps_previous_commit(tmp_path, monkeypatch):
    """Simulate a crash half-way through each write of an append: the old commit must survive."""
    base = tmp_path / "base.bin"
    old = build_rounds(base, [["a"], ["b"]])
    new = {"c": content("c"), "d": content("d", big=True)}
    real = cf._pwrite_all
    k = 0
    while True:
        path = tmp_path / f"crash{k}.bin"
        path.write_bytes(base.read_bytes())
        calls = 0

        def torn(fd, data, offset, _k=k):
            nonlocal calls
            calls += 1
            if calls - 1 == _k:
                mv = memoryview(data).cast("B")
                real(fd, mv[: len(mv) // 2], offset)
                raise _Crash
            real(fd, data, offset)

        monkeypatch.setattr(cf, "_pwrite_all", torn)
        try:
            append_entries(path, new)
        except _Crash:
            monkeypatch.setattr(cf, "_pwrite_all", real)
            assert check_consistent(path, old) == set(old), f"crash in write {k}"
            # The next writer builds on the surviving commit.
            append_entries(path, new)
            assert_entries(path, old | new)
            k += 1
            continue
        monkeypatch.setattr(cf, "_pwrite_all", real)
        break
    assert k >= 4  # regions of c (2 buffers), d (2 buffers), index, slot


def test_garbage_appended_is_ignored_and_appended_after(tmp_path):
    path = tmp_path / "c.bin"
    truth = build_rounds(path, [["a"], ["b"]])
    fake_slot = bytes(path.read_bytes()[:64])  # even a copy of a valid slot in the junk
    with open(path, "ab") as f:
        f.write(fake_slot + os.urandom(5000))
    assert_entries(path, truth)
    truth.update(build_rounds(path, [["c"]]))
    assert_entries(path, truth)
    assert cf.info(path).wasted_bytes >= 5064


@pytest.mark.parametrize(
    "data",
    [b"\x08\x07\x12\x07pytorch" + os.urandom(3000), b"OPK", b"OPKCACH", b"\0" * 200],
    ids=["model", "magic-prefix-3", "magic-prefix-7", "zeros"],
)
def test_foreign_file_never_touched(tmp_path, data):
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    with pytest.raises(CacheFileError, match="magic"):
        CacheFile.open(path)
    c, warning = cf.load_or_empty(path)
    assert len(c) == 0 and "magic" in warning
    with pytest.raises(CacheFileError, match="magic"):
        append_entries(path, {"a": content("a")})
    with pytest.raises(CacheFileError):
        cf.compact(path)
    assert path.read_bytes() == data


@pytest.mark.parametrize("with_crc", [True, False], ids=["same-layout", "other-layout"])
def test_newer_version_never_touched(tmp_path, with_crc):
    path = tmp_path / "c.bin"
    build_rounds(path, [["a"]])
    raw = bytearray(path.read_bytes())
    if with_crc:
        _rewrite_slot(raw, 0, version=2)
    else:  # a newer layout: only magic and version (bytes 0-11) are promised to stay put
        raw[8:12] = struct.pack("<I", 2)
        raw[12:64] = os.urandom(52)
    path.write_bytes(raw)
    with pytest.raises(CacheFileError, match="newer"):
        CacheFile.open(path)
    with pytest.raises(CacheFileError, match="newer"):
        append_entries(path, {"b": content("b")})
    assert path.read_bytes() == raw


def test_torn_newest_slot_falls_back_to_previous_commit(tmp_path):
    path = tmp_path / "c.bin"
    truth = build_rounds(path, [["a"], ["b"]])
    raw = bytearray(path.read_bytes())
    raw[64 * _newest_slot(raw) + 30] ^= 0xFF
    path.write_bytes(raw)
    assert check_consistent(path, truth) == {"a"}
    # The next writer builds on the surviving commit and overwrites the torn slot.
    res = append_entries(path, {"c": content("c")})
    assert not res.rebuilt
    assert_entries(path, {k: content(k) for k in "ac"})


def test_corrupt_index_falls_back_or_fails(tmp_path):
    path = tmp_path / "c.bin"
    truth = build_rounds(path, [["a"], ["b"]])
    raw = bytearray(path.read_bytes())
    ioff = struct.unpack_from("<Q", raw, 64 * _newest_slot(raw) + 24)[0]
    for pos in range(ioff, len(raw), 7):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        path.write_bytes(bad)
        assert check_consistent(path, truth) == {"a"}
    # A single-commit file with a corrupt index has nothing to fall back to.
    single = tmp_path / "s.bin"
    build_rounds(single, [["a"]])
    bad = bytearray(single.read_bytes())
    bad[-3] ^= 0x01
    single.write_bytes(bad)
    with pytest.raises(CacheFileError, match="CRC-32"):
        CacheFile.open(single)
    res = append_entries(single, {"x": content("x")})
    assert res.rebuilt
    assert_entries(single, {"x": content("x")})


def _forge_index(path, mutate) -> None:
    """Rewrite the only commit's index through ``mutate`` with valid CRCs (a hostile file)."""
    with CacheFile.open(path) as c:
        entries = list(c.info().entries)
        state = c._state
    raw = bytearray(path.read_bytes())
    entries = mutate(entries)
    index = cf._encode_index(entries)
    raw[state.index_offset :] = index
    for i in range(2):
        _rewrite_slot(raw, i, ilen=len(index), icrc=zlib.crc32(index), count=len(entries))
    path.write_bytes(raw)


def _with_buffer(entries, **kw):
    import dataclasses

    e = entries[0]
    b = dataclasses.replace(e.buffers[0], **kw)
    return [dataclasses.replace(e, buffers=(b,) + e.buffers[1:])] + entries[1:]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda es: _with_buffer(es, offset=10**6), "bounds"),
        (lambda es: _with_buffer(es, offset=2**63, length=8, shape=(2,)), "bounds"),
        (lambda es: _with_buffer(es, offset=132), "bounds"),
        (lambda es: _with_buffer(es, offset=0), "bounds"),
        (lambda es: _with_buffer(es, length=es[0].buffers[0].length + 4), "length"),
        (lambda es: _with_buffer(es, dtype="|O"), "dtype"),
        (lambda es: _with_buffer(es, dtype=">f4"), "dtype"),
        (lambda es: _with_buffer(es, shape=(1,) * 9, length=4), "ndim"),
        (lambda es: es + es[:1], "key"),
    ],
    ids=["past-index", "overflow", "unaligned", "in-header", "length", "object-dtype", "big-endian", "ndim", "duplicate-key"],
)
def test_hostile_index_rejected(tmp_path, mutate, match):
    path = tmp_path / "c.bin"
    build_rounds(path, [["a", "b"]])
    _forge_index(path, mutate)
    with pytest.raises(CacheFileError, match=match):
        CacheFile.open(path)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(ilen=cf.MAX_INDEX_BYTES + 1), "index size"),
        (dict(count=cf.MAX_ENTRIES + 1), "index size"),
        (dict(ioff=2**63), "index bounds"),
        (dict(count=1), "entry count"),
        (dict(magic=b"OPKCACHX"), "CRC|magic"),
        (dict(flags=1), "slot"),
        (dict(seq=0), "slot"),
    ],
    ids=["huge-index", "many-entries", "index-past-eof", "count-mismatch", "magic", "flags", "seq0"],
)
def test_hostile_slot_rejected(tmp_path, fields, match):
    path = tmp_path / "c.bin"
    build_rounds(path, [["a", "b"]])
    raw = bytearray(path.read_bytes())
    for i in range(2):
        _rewrite_slot(raw, i, **fields)
    path.write_bytes(raw)
    with pytest.raises(CacheFileError, match=match):
        CacheFile.open(path)


def test_flipped_region_byte_caught_by_verify(tmp_path):
    path = tmp_path / "c.bin"
    truth = build_rounds(path, [["a", "b"]])
    with CacheFile.open(path) as c:
        off = c.entry("a").buffers[1].offset
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0x40
    path.write_bytes(raw)
    with CacheFile.open(path) as c:
        assert c.get("a") is not None  # no verification: bounds/dtype/shape are still right
        with pytest.raises(CacheFileError, match="'a' buffer 1 CRC-32"):
            c.get("a", verify=True)
    res = cf.compact(path)
    assert res.dropped == ("a",) and res.entries == 1
    assert_entries(path, {"b": truth["b"]})


# -- concurrency and crashes --------------------------------------------------------------------


def _worker(path: str, wid: int) -> None:
    for r in range(4):
        # Every worker writes its own keys and keys shared with the others.
        ks = [f"w{wid}-r{r}", f"shared-{r}", f"shared-{(r + wid) % 4}"]
        append_entries(path, {k: content(k, big=k.endswith("0")) for k in ks})
        with CacheFile.open(path) as c:
            for k in ks:
                got = c.get(k, verify=True)
                assert got is not None and got[0].tobytes() == content(k, big=k.endswith("0"))[0].tobytes()


def test_concurrent_processes(tmp_path):
    path = str(tmp_path / "c.bin")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(path, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with CacheFile.open(path) as c:
        keys = c.keys()
    want = {f"w{w}-r{r}" for w in range(4) for r in range(4)} | {f"shared-{r}" for r in range(4)}
    assert keys == want
    assert_entries(path, {k: content(k, big=k.endswith("0")) for k in want})
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))


_KILL_CHILD = """
import sys, numpy as np
from onnxpack.prepack.cache_file import append_entries
path = sys.argv[1]
for i in range(200):
    append_entries(path, {f"big{i}": [np.full(1 << 20, i, dtype="<u4"), np.arange(i + 1, dtype="<i8")]})
"""


@pytest.mark.parametrize("trial", range(4))
def test_kill_during_append_leaves_loadable_file(tmp_path, trial):
    path = tmp_path / "c.bin"
    append_entries(path, {"first": content("first")})
    child = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(path)])
    try:
        # Wait until the child is appending (the file grew), then kill it after a random delay.
        deadline = time.monotonic() + 30
        while os.path.getsize(path) < (1 << 20) and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.005)
        time.sleep(random.Random(trial).uniform(0, 0.3))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with CacheFile.open(path) as c:
        keys = c.keys()
        assert "first" in keys
        for k in keys - {"first"}:
            i = int(k[3:])
            a, b = c.get(k, verify=True)
            assert a.shape == (1 << 20,) and int(a[0]) == i and int(a[-1]) == i
            np.testing.assert_array_equal(b, np.arange(i + 1))
    res = append_entries(path, {"after": content("after")})
    assert not res.rebuilt
    with CacheFile.open(path) as c:
        assert keys | {"after"} == c.keys()
