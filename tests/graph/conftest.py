"""Shared fixtures for the graph layer tests: the sample model builder and built samples."""

from __future__ import annotations

import onnxpack_sample_models as sample_models  # registered by tests/conftest.py
import pytest


@pytest.fixture(scope="session")
def samples(tmp_path_factory) -> dict[str, str]:
    """Every sample model built freshly into a temp folder: name -> model path."""
    return sample_models.build_all(str(tmp_path_factory.mktemp("samples")))


@pytest.fixture(scope="session")
def build_module():
    """``models/build.py`` imported as a module (SAMPLES, sample_inputs, make_matmul_chain…)."""
    return sample_models
