"""The native code cache (``session/kernels/_native.py``, ``_jit_native.py``): JIT kernels that
numba compiled once, loaded later without numba (a shared library where the system linker made
one, else the object code through llvmlite).

Oracles: numpy (the kernels' numpy twins and formulas), the bytes of the cache file, and
``sys.modules`` of a fresh process (numba must not be imported when the cache serves).
The kernels' agreement with onnxruntime runs in ``test_kernels_int4.py`` (its ``native`` path).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from onnxpack.session.kernels import _act, _jit_native, _native

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


def _cache_file(folder: str) -> str:
    (name,) = [f for f in os.listdir(folder) if f.startswith(_jit_native.MODULE + "-") and f.endswith(".bin")]
    return os.path.join(folder, name)


@pytest.fixture
def cache_copy(native_cache, tmp_path, monkeypatch):
    """A private copy of the built cache folder, made the code cache for this test."""
    from onnxpack.session import _program

    assert _program.wait_warm_ups(timeout=600)  # no earlier session loads kernels under the old settings
    folder = tmp_path / "cache"
    shutil.copytree(native_cache, folder)
    monkeypatch.setenv("ONNXPACK_CODE_CACHE", str(folder))
    monkeypatch.setattr(_act, "_native_kernels", [])
    return _cache_file(str(folder))


def test_fingerprint_names_every_source_and_changes_with_them(tmp_path):
    pytest.importorskip("llvmlite")
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    first = _native.fingerprint([str(a), str(b)])
    assert first == _native.fingerprint([str(a), str(b)])
    b.write_text("y = 3\n")
    assert _native.fingerprint([str(a), str(b)]) != first


_CPU = """processor\t: {n}
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 106
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
stepping\t: 6
cpu MHz\t\t: {mhz}
bogomips\t: {mips}
flags\t\t: fpu sse2 avx2 fma {extra}

"""


@pytest.mark.parametrize("change, same", [
    (dict(mhz="3499.998", mips="5800.01"), True),  # the clock and bogomips move between reads: same code
    (dict(extra="avx512f avx512_vnni"), False),  # another instruction set: other code
])
def test_cache_name_follows_the_cpus_features_not_its_clock(tmp_path, monkeypatch, change, same):
    src = tmp_path / "k.py"
    src.write_text("x = 1\n")

    def name_with(**fields):
        values = {"mhz": "2900.000", "mips": "5799.99", "extra": "", **fields}
        info = tmp_path / "cpuinfo"
        info.write_text("".join(_CPU.format(n=n, **values) for n in range(2)))
        monkeypatch.setattr(_native, "_CPUINFO", str(info))
        return _native.fingerprint([str(src)])

    assert (name_with() == name_with(**change)) is same


def test_cache_file_layout(cache_copy):
    blob = open(cache_copy, "rb").read()
    assert blob.startswith(_native.MAGIC)
    header, objects = _native._read(cache_copy)
    assert sum(len(o) for o in objects) + len(_native.MAGIC) + 8 + struct.unpack_from("<Q", blob, len(_native.MAGIC))[0] \
        == len(blob)
    names = set(header["entries"])
    for sc in ("f32", "u16"):
        for bits in (4, 8):
            assert {f"gemv{bits}_{sc}", f"gemv{bits}_{sc}_omp", f"dequant{bits}_{sc}"} <= names
    assert "act_f32" in names


needs_ld = pytest.mark.skipif(shutil.which("ld") is None, reason="no system linker (ld): object code only")


@needs_ld
def test_shared_library_next_to_the_cache_file_matches_its_record(cache_copy):
    header, _ = _native._read(cache_copy)
    length, digest = header["shared"]
    blob = open(_native.shared_path(cache_copy), "rb").read()
    assert len(blob) == length and hashlib.sha256(blob).hexdigest() == digest
    assert blob[:4] == b"\x7fELF"
    # the library exports every entry the header names (what the loader looks up)
    nm = shutil.which("nm")
    if nm:
        exported = subprocess.run([nm, "-D", "--defined-only", _native.shared_path(cache_copy)], capture_output=True,
                                  text=True, check=True).stdout
        assert all(symbol in exported for _, symbol in header["entries"].values())


@needs_ld
@pytest.mark.parametrize("how", ["flip-byte", "truncated", "missing"])
def test_damaged_shared_library_falls_back_to_the_object_code(cache_copy, how, caplog):
    lib = _native.shared_path(cache_copy)
    if how == "missing":
        os.unlink(lib)
    else:
        blob = bytearray(open(lib, "rb").read())
        if how == "flip-byte":
            blob[len(blob) // 2] ^= 0xFF
        else:
            del blob[len(blob) // 2:]
        open(lib, "wb").write(bytes(blob))
    assert not _native.intact(cache_copy)  # the background build rewrites both
    with caplog.at_level(logging.WARNING, logger="onnxpack.session.kernels._native"):
        kernels = _jit_native.load()
    assert any("does not match" in r.getMessage() for r in caplog.records)
    if importlib.util.find_spec("llvmlite") is not None:
        assert kernels is not None  # the object code, through llvmlite
        _act._native_kernels[:] = [kernels]  # the fixture's private list
        assert _act.act_kernels() is kernels
        x = np.linspace(-30, 30, 4097, dtype=np.float32)
        y = x.copy()
        _act.apply(y, [_act.Activation("silu")])
        assert np.allclose(y, x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-5, atol=1e-6)


def _tamper(path: str, how: str) -> None:
    blob = bytearray(open(path, "rb").read())
    start = len(_native.MAGIC) + 8
    (hlen,) = struct.unpack_from("<Q", blob, len(_native.MAGIC))
    if how == "flip-object-byte":
        blob[start + hlen + 100] ^= 0xFF
    elif how == "truncated":
        del blob[len(blob) // 2:]
    elif how == "magic":
        blob[0:4] = b"ELF\x7f"
    elif how == "header-length":
        struct.pack_into("<Q", blob, len(_native.MAGIC), 1 << 40)
    elif how == "trailing":
        blob += b"\0" * 16
    elif how == "entry-index":
        header = json.loads(blob[start:start + hlen])
        header["entries"]["act_f32"][0] = 999
        new = json.dumps(header).encode()
        blob[len(_native.MAGIC):start + hlen] = struct.pack("<Q", len(new)) + new
    elif how == "not-json":
        blob[start:start + 8] = b"\xff" * 8
    open(path, "wb").write(bytes(blob))


@pytest.mark.parametrize("how", ["flip-object-byte", "truncated", "magic", "header-length", "trailing",
                                 "entry-index", "not-json"])
def test_damaged_cache_file_is_ignored_with_a_warning(cache_copy, how, caplog):
    _tamper(cache_copy, how)
    with caplog.at_level(logging.WARNING, logger="onnxpack.session.kernels._native"):
        assert _jit_native.load() is None
    assert any("unusable" in r.getMessage() for r in caplog.records)
    # the kernels still run (numba now), and the same
    jit = _act.act_kernels()
    assert jit is not None and not getattr(jit, "native", False)


def test_a_change_to_the_sources_is_a_cache_miss(cache_copy, monkeypatch, tmp_path):
    assert _jit_native.load() is not None
    extra = tmp_path / "changed.py"
    extra.write_text("# one more source\n")
    sources = _jit_native._sources()
    monkeypatch.setattr(_jit_native, "_sources", lambda: [*sources, str(extra)])
    assert _jit_native.load() is None  # another fingerprint: no file of that name, no warning


def test_lock_held_by_a_live_builder_means_no_second_build(cache_copy, monkeypatch):
    os.unlink(cache_copy)  # no cache: a build would start
    path = _native.path_for(_jit_native.MODULE, _jit_native._sources())
    open(path + ".building", "w").write("12345")
    called = []
    monkeypatch.setattr(_jit_native, "build", lambda: called.append(1))
    assert _jit_native._main() == 0
    assert not called and not os.path.exists(path)


_NO_NUMBA = r"""
import sys
import numpy as np
from onnxpack.session.kernels import _act, elementwise, quant
assert getattr(quant._jit(), "native", False), "native kernels not loaded"
x = np.random.default_rng(0).standard_normal(50000).astype(np.float32) * 8
y = elementwise._sigmoid(x)
ref = 1 / (1 + np.exp(-x.astype(np.float64)))
ulp = np.abs(y.astype(np.float64) - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)
# the other kernels a decoding LLM runs: a fused epilogue (SiLU), RMS norm, the GQA step
from onnxpack.session.kernels import contrib_norm
z = x.copy()
_act.apply(z, [_act.Activation("silu")])
assert np.allclose(z, x * ref, rtol=1e-5, atol=1e-6)
assert contrib_norm._rms_jit(x.reshape(50, 1000), None, np.ones(1000, np.float32), None, 1e-6, False) is not None
assert getattr(_act.attn_kernels(), "native", False)
jit = quant._jit()
if jit.int8_dot:  # the int8-activation GEMV (accuracy_level 4), serial and parallel, with a tail
    rng = np.random.default_rng(1)
    k, n, nb = 256, 200, 8
    b = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    s = (rng.random((n, nb)) * 0.05).astype(np.float32)
    a = rng.standard_normal((2, k)).astype(np.float32)
    w = quant.dequantize_nbits(b, s, None, k=k, n=n, bits=4, block_size=32)
    bound = np.abs(a).reshape(2, nb, 32).max(axis=2) / 254 @ np.abs(w).reshape(nb, 32, n).sum(axis=1)
    for name in ("gemv4_i8", "gemv4_i8_serial"):
        y = np.full((2, n), np.nan, np.float32)
        getattr(jit, name)(a, quant.to_tiles(b), quant.to_tiles(s.reshape(n, nb, 1)), quant._NO_ZERO_POINTS, 0,
                           np.float32(8), y, n, nb, 16, quant.TILE, 2)
        assert (np.abs(y - a @ w) <= bound * 1.01 + 1e-4).all(), name
from onnxpack.session.kernels import qinteger  # the integer MatMuls' int8 GEMM, serial and parallel
if jit.has_qgemm():  # (AVX-512 VNNI or AVX2)
    assert qinteger._qjit() is jit, "the native int8 GEMM was not taken"
    for m, k, n in ((3, 70, 150), (64, 256, 300)):
        a = rng.integers(0, 256, (m, k)).astype(np.uint8)
        b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        lanes, colsum = qinteger.to_lanes(b)
        got = qinteger.lanes_matmul(a, np.uint8(5), lanes, colsum, k, n, False, np.int8(-3))
        assert np.array_equal(got, (a.astype(np.int64) - 5) @ (b.astype(np.int64) + 3)), (m, k, n)
print(float(ulp.max()), "numba" in sys.modules, "llvmlite" in sys.modules,
      sorted(m for m in ("importlib.metadata", "subprocess", "ctypes.util") if m in sys.modules) or "-")
"""


def test_native_kernels_serve_without_importing_numba(native_cache):
    env = {k: v for k, v in os.environ.items() if k not in ("ONNXPACK_DISABLE_JIT", "ONNXPACK_DISABLE_NATIVE")}
    env["ONNXPACK_CODE_CACHE"] = native_cache
    p = subprocess.run([sys.executable, "-c", _NO_NUMBA], capture_output=True, text=True, env=env, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    ulp, numba_imported, llvmlite_imported, build_only = p.stdout.split()
    assert float(ulp) <= 3.0  # the JIT sigmoid's bound (test_conv_fast.py)
    assert numba_imported == "False"
    # nor what only a build uses (each costs milliseconds and private memory in every process)
    assert build_only == "-"
    # with a system linker the build made a shared library: loading it needs no llvmlite either
    assert llvmlite_imported == ("False" if shutil.which("ld") else "True")


@pytest.mark.parametrize("dist", ["numpy", "onnx", "numba", "llvmlite", "pytest", "onnxpack", "no-such-dist"])
def test_versions_in_the_fingerprint_are_importlib_metadatas(dist):
    from importlib import metadata

    try:
        expected = metadata.version(dist)
    except metadata.PackageNotFoundError:
        expected = "absent"
    assert _native._version(dist) == expected


def test_gomp_library_opens():
    import ctypes

    assert ctypes.CDLL(_native.gomp_library()).GOMP_parallel


def test_damaged_cache_file_is_rebuilt_over(cache_copy, monkeypatch):
    _tamper(cache_copy, "flip-object-byte")
    called = []
    monkeypatch.setattr(_jit_native, "build", lambda: called.append(1) or cache_copy)
    assert _jit_native._main() == 0
    assert called == [1]


def test_first_process_builds_the_cache_in_the_background(native_build):
    # The session's own build (conftest.py) is a user's first process: numba served it, it started
    # the detached, low-priority builder and exited; the builder wrote the cache file for this
    # machine, and a later process runs the kernels from it without numba.
    if native_build["first"] is None:
        pytest.skip("an xdist worker starts no session build")
    rc, out = native_build["first"]
    assert rc == 0 and out.split() == ["numba"], out[-3000:]
    assert native_build["file"] is not None, f"no intact cache file in {os.listdir(native_build['folder'])}"
    assert not any(f.endswith(".building") for f in os.listdir(native_build["folder"]))  # the lock was released
    env = {k: v for k, v in os.environ.items() if k not in ("ONNXPACK_DISABLE_JIT", "ONNXPACK_DISABLE_NATIVE")}
    env.update(ONNXPACK_CODE_CACHE=native_build["folder"], ONNXPACK_NATIVE_BUILD="1")
    p = subprocess.run([sys.executable, "-c", _NO_NUMBA], capture_output=True, text=True, env=env, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[1] == "False"


def test_wait_warm_ups_waits_for_started_warm_ups():
    # start_warm_ups counts a warm-up before its thread runs, so a caller that changes the JIT
    # loaders' settings can wait for every warm-up already started, even one not yet scheduled.
    import threading

    from onnxpack.session import _program

    gate, ran = threading.Event(), []

    class _Program:
        warm_ups = (lambda: (gate.wait(10), ran.append(1)),)

    _program.Program.start_warm_ups(_Program())
    assert not _program.wait_warm_ups(timeout=0.05)  # still running: blocked on the gate
    gate.set()
    assert _program.wait_warm_ups(timeout=10) and ran == [1]


def test_a_forked_child_does_not_wait_for_its_parents_warm_ups():
    import threading

    from onnxpack.session import _program

    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    gate = threading.Event()

    class _Program:
        warm_ups = (lambda: gate.wait(10),)

    _program.Program.start_warm_ups(_Program())
    try:
        # The thread may not hold _WARMING yet (then the fork does not wait for it): the child
        # must not count it either way.
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(0 if _program.wait_warm_ups(timeout=1) else 1)
        gate.set()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        gate.set()
        assert _program.wait_warm_ups(timeout=10)


def test_data_addresses_are_numpys(tmp_path):
    """``_jit_native._addr`` (the pointer read from the array object) gives what numpy reports for
    every kind of array a kernel is handed: fresh, views, transposed, empty, read-only mapped
    file bytes, a subclass (asked through numpy)."""
    assert _jit_native._DATA_OFFSET is not None  # CPython on 64 bits: the fast read is in use
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 64)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    base = np.arange(120, dtype=np.float32).reshape(10, 12)
    arrays = [base, base[3:, 5:], base.T, base[::2, ::3], np.empty((0, 7), np.float32), np.zeros(1, np.int8),
              np.asarray(mapped), np.asarray(mapped)[4096:].view(np.float32), mapped, np.frombuffer(b"abcdefgh", np.uint8)]
    for a in arrays:
        assert _jit_native._addr(a) == a.__array_interface__["data"][0], (type(a), a.shape, a.strides)
