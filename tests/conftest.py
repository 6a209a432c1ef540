"""Shared pytest setup for every test folder.

* ``tests/`` goes on ``sys.path`` so test modules can ``import kernel_util``.
* ``models/build.py`` (a script, not a package) is imported once, here, and registered as the
  module ``onnxpack_sample_models``: tests ``import onnxpack_sample_models as sample_models``.
  Why a unique name: ``import build`` after putting ``models/`` on ``sys.path`` collides with the
  PyPI package ``build`` (whichever comes first on the path wins), and loading the file once per
  test module made several module objects with their own state.
* hypothesis is kept bounded (no deadline: the 2-core CI machine is often busy).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
BUILD_PY = os.path.join(ROOT, "models", "build.py")
SAMPLE_MODELS_MODULE = "onnxpack_sample_models"

sys.path.insert(0, TESTS_DIR)


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
