"""SIGKILL at random points of every write: ``onnxpack optimize``, the session flag save and
cache-file appends (a few trials here; ``benchmarks/fuzz_campaign.py`` runs >= 100 per mode).

The kill driver SIGKILLs itself right before its N-th write call (buffered write, os.write,
fsync, rename, close …), N drawn from the number a complete run makes.  After the kill the
previous output (or, with none, no output) or the complete new one must be there and load
without a warning, with the input's outputs; the input files are byte-identical.
"""

from __future__ import annotations

import random

import pytest

import reliability_harness as harness

TRIALS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return harness.kill_setup(str(tmp_path_factory.mktemp("kills")))


@pytest.mark.parametrize("mode", harness.KILL_MODES)
def test_kill_during_write(setup, mode, tmp_path):
    calls = setup["calls"][mode]
    assert calls and calls > 3, f"the {mode} run made {calls} write calls"
    rng = random.Random(mode)
    points = [1, calls] + [rng.randint(2, calls - 1) for _ in range(TRIALS - 2)]
    results = []
    for k, kill_at in enumerate(points):
        ok, found = harness.kill_trial(setup, mode, kill_at, str(tmp_path / f"t{k}"), previous=bool(k % 2))
        results.append((kill_at, found))
        assert ok, f"{mode}: kill before write call {kill_at} of {calls}: {found}"
