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
  native kernels build them once through the ``native_cache`` fixture.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from types import ModuleType

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
BUILD_PY = os.path.join(ROOT, "models", "build.py")
SAMPLE_MODELS_MODULE = "onnxpack_sample_models"

sys.path.insert(0, TESTS_DIR)

os.environ["ONNXPACK_NATIVE_BUILD"] = "0"
os.environ["ONNXPACK_CODE_CACHE"] = tempfile.mkdtemp(prefix="onnxpack-code-cache-")


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


@pytest.fixture(scope="session")
def native_cache() -> str:
    """The code cache folder with this machine's native JIT kernels built (skips without numba or
    GNU OpenMP); tests point ``ONNXPACK_CODE_CACHE`` at it."""
    pytest.importorskip("numba")
    import ctypes.util

    if not ctypes.util.find_library("gomp"):
        pytest.skip("GNU OpenMP (libgomp) is not installed")
    from onnxpack.session.kernels import _jit_native

    assert _jit_native.build() is not None
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
