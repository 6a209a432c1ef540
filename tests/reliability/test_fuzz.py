"""Bounded fuzzing of every untrusted input (the CI form of ``benchmarks/fuzz_campaign.py``).

Each example is one mutation of a saved sample (see ``reliability_harness`` for the targets and
their oracles) run in a worker subprocess: a crash, a hang, an exception that is not an
``OnnxpackError``, a rejected blob without a ``PrepackWarning`` or a wrong output fails the test
with the case's seed, so ``make_case(target, seed, bases)`` reproduces it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reliability_harness as harness

# Per target; ~20 ms per example on 2 cores keeps the whole file around 10 s.
EXAMPLES = 60


@pytest.mark.parametrize("target", harness.TARGETS)
def test_fuzz_target(target, bases, pool):
    outcomes: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, database=None, deadline=None)
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
    # The fuzzer must reach both sides of the oracle, not only the error path.
    if target in ("entry", "blob", "cache"):
        assert sum(n for o, n in outcomes.items() if o.startswith("ok")) > 0, outcomes


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
