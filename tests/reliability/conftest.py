"""Fixtures of the reliability suite: fuzzing bases and one worker subprocess shared per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import reliability_harness as harness  # noqa: E402

# Small models cover every path the fuzzer targets: fuzzmix packs whatever the kernels' policy
# on fp32 weights (Gemm transB, an fp16 MatMul weight whose blob is >= 64 KiB, so not CRC-checked
# at load); the samples add conv, outer-scope weights in subgraphs, fp16 sources and one weight
# shared by two kernels, with whatever their kernels pack.
FUZZ_SAMPLES = (harness.FUZZMIX, harness.FUZZTWIN, "mlp", "cnn", "subgraphs", "fp16_mlp", "shared_weight", "transformer")


@pytest.fixture(scope="session")
def bases(tmp_path_factory):
    return harness.make_bases(FUZZ_SAMPLES, str(tmp_path_factory.mktemp("fuzz-bases")))


@pytest.fixture(autouse=True)
def deterministic(monkeypatch):
    """Sessions made by this suite's tests compute the bits their bases' expected outputs hold
    (see ``harness.DETERMINISTIC``)."""
    for k, v in harness.DETERMINISTIC.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="session")
def pool(bases):
    with harness.Pool(bases, n=1) as p:
        yield p
