"""Shared pytest setup for every test folder.

* ``tests/`` goes on ``sys.path`` so test modules can ``import kernel_util``.
* ``models/build.py`` (a script, not a package) is imported once, here, and registered as the
  module ``onnxpack_sample_models``: tests ``import onnxpack_sample_models as sample_models``.
  Why a unique name: ``import build`` after putting ``models/`` on ``sys.path`` collides with the
  PyPI package ``build`` (whichever comes first on the path wins), and loading the file once per
  test module made several module objects with their own state.
* hypothesis is kept bounded (no deadline: the 2-core CI machine is often busy).
* The native code cache (``session/kernels/_native.py``) is a fresh temp folder for the test
  session and never built in the background (``ONNXPACK_NATIVE_BUILD=0``): tests that want the
  native kernels get them through the ``native_cache`` fixture.  Its build (numba compiling every
  native entry: ~1 min on one core) starts when the session starts, the way a user's first process
  starts it: a child process that uses numba launches the detached, low-priority builder for a
  folder of its own and exits.  The fixture copies the result in when a test first asks for it —
  the same moment as building it there, so which tests see native kernels does not change; the
  suite meanwhile runs on the other core.  ``test_native.py`` checks that this build happened.
* numba's own cache is filled ahead of the tests by ``jit_primer.py``, a background process
  started with the session (on a fresh clone the kernels' compiles were half the suite's time);
  ``ONNXPACK_TEST_PRIMER=0`` turns it off.  It changes no test's outcome, only the duration.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from types import ModuleType

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
BUILD_PY = os.path.join(ROOT, "models", "build.py")
SAMPLE_MODELS_MODULE = "onnxpack_sample_models"

sys.path.insert(0, TESTS_DIR)

os.environ["ONNXPACK_NATIVE_BUILD"] = "0"
CODE_CACHE = os.environ["ONNXPACK_CODE_CACHE"] = tempfile.mkdtemp(prefix="onnxpack-code-cache-")
_NATIVE_BUILD: dict = {}  # "proc": the background build, "folder": where it writes, "log": its output
_PRIMER: dict = {}  # "proc": jit_primer.py's process, "log": its output


def load_sample_models() -> ModuleType:
    """``models/build.py`` as the module ``onnxpack_sample_models`` (loaded at most once)."""
    module = sys.modules.get(SAMPLE_MODELS_MODULE)
    if module is None:
        spec = importlib.util.spec_from_file_location(SAMPLE_MODELS_MODULE, BUILD_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[SAMPLE_MODELS_MODULE] = module  # registered first, as the import system does
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[SAMPLE_MODELS_MODULE]
            raise
    return module


load_sample_models()

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


def _native_buildable() -> bool:
    import ctypes.util

    return importlib.util.find_spec("numba") is not None and bool(ctypes.util.find_library("gomp"))


# What a user's first process runs: numba serves the kernels (no native code cache yet), and the
# process starts the native build in the background on its way.
FIRST_PROCESS = r"""
import numpy as np
from onnxpack.session.kernels import quant
assert not getattr(quant._jit(), "native", False)  # no cache yet: numba serves, and a build starts
print("numba")
"""


def _start_primer() -> None:
    """Starts ``jit_primer.py`` (see the module docstring) with the suite's environment."""
    if (os.environ.get("ONNXPACK_TEST_PRIMER", "1") == "0" or os.environ.get("ONNXPACK_DISABLE_JIT") == "1"
            or importlib.util.find_spec("numba") is None):
        return  # (off, or no kernel of the run would use numba's cache)
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed at the session's end
    _PRIMER.update(log=log, proc=subprocess.Popen(
        [sys.executable, os.path.join(TESTS_DIR, "jit_primer.py")], cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=log, stderr=subprocess.STDOUT, text=True))


def pytest_sessionstart(session) -> None:
    """Starts the native code cache's build the way a user's first process does (see the module
    docstring): a child process that uses numba starts the detached, low-priority build and exits;
    and the primer of numba's cache."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _start_primer()
    if not _native_buildable():
        return
    folder = tempfile.mkdtemp(prefix="onnxpack-code-cache-build-")
    log = open(os.path.join(folder, "first-process.log"), "w+")  # noqa: SIM115 - closed at the session's end
    env = {k: v for k, v in os.environ.items() if k not in ("ONNXPACK_DISABLE_JIT", "ONNXPACK_DISABLE_NATIVE")}
    env.update(ONNXPACK_CODE_CACHE=folder, ONNXPACK_NATIVE_BUILD="1")
    _NATIVE_BUILD.update(folder=folder, log=log, proc=subprocess.Popen(
        [sys.executable, "-c", FIRST_PROCESS], env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
        stderr=subprocess.STDOUT, text=True))


def _builder_pid(folder: str) -> int | None:
    """The pid in a running build's lock file (``<cache file>.building``) in ``folder``."""
    for name in os.listdir(folder):
        if name.endswith(".building"):
            try:
                with open(os.path.join(folder, name)) as f:
                    return int(f.read().strip() or 0) or None
            except (OSError, ValueError):
                return None
    return None


def pytest_sessionfinish(session, exitstatus) -> None:
    primer = _PRIMER.get("proc")
    if primer is not None:
        if primer.poll() is None:
            primer.kill()
        primer.wait()
        _PRIMER["log"].close()
    proc = _NATIVE_BUILD.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if _NATIVE_BUILD:
        folder = _NATIVE_BUILD["folder"]
        # A first process that finished has started the builder: give it a moment to take its
        # lock (it names its pid there) when it has not written the cache yet.
        until = time.monotonic() + 5
        while (proc is not None and proc.returncode == 0 and time.monotonic() < until and _builder_pid(folder) is None
               and not any(f.endswith(".bin") for f in os.listdir(folder))):
            time.sleep(0.1)
        pid = _builder_pid(folder)
        if pid is not None:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        _NATIVE_BUILD["log"].close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def native_build() -> dict:
    """The session's background build, finished: ``folder`` (where it wrote), ``first`` (the first
    process's exit code and output) and ``file`` (the cache file it wrote, or None); all None in
    an xdist worker, which starts no build.  Skips without numba or GNU OpenMP."""
    pytest.importorskip("numba")
    if not _native_buildable():
        pytest.skip("GNU OpenMP (libgomp) is not installed")
    from onnxpack.session.kernels import _jit_native, _native

    if "proc" not in _NATIVE_BUILD:  # an xdist worker: no session build (native_cache builds here)
        return {"folder": None, "first": None, "file": None}
    if "first" not in _NATIVE_BUILD:
        proc, log, folder = _NATIVE_BUILD["proc"], _NATIVE_BUILD["log"], _NATIVE_BUILD["folder"]
        proc.wait(timeout=300)
        log.seek(0)
        _NATIVE_BUILD["first"] = (proc.returncode, log.read())
        name = os.path.basename(_native.path_for(_jit_native.MODULE, _jit_native._sources()))
        path = os.path.join(folder, name)
        start = time.monotonic()
        while time.monotonic() - start < 600:  # a detached, low-priority build: ~1-2 min of CPU
            building = _builder_pid(folder) is not None
            if os.path.exists(path) and not building:
                break
            if not building and time.monotonic() - start > 60:
                break  # no build running a minute on: it did not start, or it died
            time.sleep(0.5)
        _NATIVE_BUILD["file"] = path if _native.intact(path) else None
    return {"folder": _NATIVE_BUILD["folder"], "first": _NATIVE_BUILD["first"], "file": _NATIVE_BUILD["file"]}


@pytest.fixture(scope="session")
def native_cache(native_build) -> str:
    """The code cache folder with this machine's native JIT kernels built; tests point
    ``ONNXPACK_CODE_CACHE`` at it.  The background build's result is copied in when it succeeded
    and is intact; otherwise the kernels are built here."""
    from onnxpack.session.kernels import _jit_native, _native

    path = _native.path_for(_jit_native.MODULE, _jit_native._sources())
    built = native_build["file"]
    if built is not None:
        stem = os.path.splitext(os.path.basename(path))[0]
        for name in os.listdir(native_build["folder"]):
            if name.startswith(stem) and not name.endswith(".building"):
                shutil.copy2(os.path.join(native_build["folder"], name), os.path.join(os.path.dirname(path), name))
    if not _native.intact(path):
        assert _jit_native.build() is not None
    assert _native.intact(path)
    return os.environ["ONNXPACK_CODE_CACHE"]


@pytest.fixture(params=["jit", "native", "numpy"])
def jit_path(request, monkeypatch):
    """Which compute path the JIT-backed kernels take (activations, RMS norm, the decoding step
    of GroupQueryAttention): numba's kernels, the same kernels from the native code cache without
    numba, or the numpy twins (``ONNXPACK_DISABLE_JIT=1``).  Returns the name."""
    from onnxpack.session import _program
    from onnxpack.session.kernels import _act

    # A session of an earlier test may still be warming its kernels up in the background: were
    # it to load them while this fixture changes the settings, it would cache the old choice.
    assert _program.wait_warm_ups(timeout=600)
    monkeypatch.setattr(_act, "_native_kernels", [])  # looked up again under this test's settings
    if request.param == "numpy":
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
        assert _act.act_kernels() is None
        return request.param
    pytest.importorskip("numba")
    monkeypatch.delenv("ONNXPACK_DISABLE_JIT", raising=False)
    if request.param == "native":
        request.getfixturevalue("native_cache")
        monkeypatch.delenv("ONNXPACK_DISABLE_NATIVE", raising=False)
        assert getattr(_act.act_kernels(), "native", False)
    else:
        monkeypatch.setenv("ONNXPACK_DISABLE_NATIVE", "1")
        assert not getattr(_act.act_kernels(), "native", False)
    return request.param


@pytest.fixture
def panels_on(monkeypatch):
    """Float32 weights packed as 64-column panels for the JIT GEMM on any CPU (by default only on
    AVX-512 CPUs, where they pay: see ``linalg._panel_cpu``), so the panel paths are tested
    everywhere numba is."""
    monkeypatch.setenv("ONNXPACK_PANELS", "1")

