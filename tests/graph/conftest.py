"""Shared fixtures for the graph layer tests: the sample model builder and built samples."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_build():
    spec = importlib.util.spec_from_file_location("onnxpack_models_build", ROOT / "models" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()


@pytest.fixture(scope="session")
def samples(tmp_path_factory) -> dict[str, str]:
    """Every sample model built freshly into a temp folder: name -> model path."""
    return build.build_all(str(tmp_path_factory.mktemp("samples")))


@pytest.fixture(scope="session")
def build_module():
    """``models/build.py`` imported as a module (SAMPLES, sample_inputs, make_matmul_chain…)."""
    return build
