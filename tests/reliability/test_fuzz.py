"""Bounded fuzzing of every untrusted input (the CI form of ``benchmarks/fuzz_campaign.py``).

Each example is one case of a target (see ``reliability_harness`` for the targets, the families
and their oracles) run in a worker subprocess: a crash, a hang, an exception that is not an
``OnnxpackError``, a rejected blob without a ``PrepackWarning``, a wrong output, a write outside
the model folder, memory that grew for a refused shape or a creation over its budget fails the
test with the case's seed, so ``make_case(target, seed, bases)`` reproduces it.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reliability_harness as harness

# Per target; ~20-40 ms per example on 2 cores.  The many-subgraphs family builds models of up to
# ~12,000 nodes (seconds each with onnxruntime's reference), so it draws fewer; its large sizes
# are covered by test_many_subgraphs_create_within_the_linear_budget below.
EXAMPLES = {"subgraphs": 4}
DEFAULT_EXAMPLES = 60

# Targets whose cases mostly succeed: the fuzzer must reach that side of the oracle too, not
# only the error path.  (special and huge cases are mostly refusals by design.)
MUST_RUN = ("entry", "blob", "cache", "record", "inplace", "live", "attr", "subgraphs")


@pytest.mark.parametrize("target", harness.TARGETS)
def test_fuzz_target(target, bases, pool):
    outcomes: dict[str, int] = {}

    @settings(max_examples=EXAMPLES.get(target, DEFAULT_EXAMPLES), database=None, deadline=None)
    @given(seed=st.integers(min_value=0, max_value=2**32 - 1))
    def one(seed):
        case = harness.make_case(target, seed, bases)
        res = pool.run_one(case)
        outcomes[res["outcome"]] = outcomes.get(res["outcome"], 0) + 1
        assert res["verdict"] == "pass", (
            f"{target} seed {seed} on {case['base']} ({case['desc']!r}, config {case['config']}): "
            f"{res['outcome']}: {res['detail']}"
        )

    one()
    if target in MUST_RUN:
        assert sum(n for o, n in outcomes.items() if o.startswith("ok")) > 0, outcomes


@pytest.mark.parametrize("shape", [(2000, 1, False), (3, 24, True)], ids=["2000-ifs", "24-deep-with-weights"])
def test_many_subgraphs_create_within_the_linear_budget(bases, pool, shape):
    n, depth, weights = shape
    case = harness.subgraph_case(random.Random(n), n, depth, weights=weights, outer=False, loops=True, cond=True)
    case.update(id=0, target="subgraphs", seed=-1, base=None)
    res = pool.run_one(case)
    assert res["verdict"] == "pass" and res["outcome"] == "ok", (case["desc"], res)
    assert res["create_seconds"] <= case["budget"]


def test_crash_and_hang_are_detected(bases):
    """The harness itself: a case that kills its worker is a crash, one that sleeps is a hang."""
    case = harness.make_case("entry", 1, bases)
    with harness.Pool(bases, n=1, timeout=5) as p:
        p.workers[0].submit(case)
        p.workers[0].proc.kill()
        res = p.workers[0].poll()
        while res is None:
            res = p.workers[0].poll()
        assert res["outcome"] == "crash" and res["verdict"] == "fail"
        assert p.run_one(case)["verdict"] == "pass"  # restarted


def test_writes_outside_the_folder_are_detected(bases, pool, tmp_path):
    """The harness itself: a cache file outside the case folder is a write outside it."""
    outside = str(tmp_path / "outside.cache")
    case = {"id": 0, "target": "special", "seed": -1, "base": "fuzzmix+cache", "files": {}, "remove": ["packed.cache"],
            "config": {"onnxpack.prepacked_cache_path": outside}, "oracle": "equal", "desc": "cache outside"}
    res = pool.run_one(case)
    assert res["verdict"] == "fail" and "outside the model folder" in res["detail"], res
