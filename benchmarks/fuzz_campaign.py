"""Reliability campaign: fuzzing, hostile locations and limits, kills during writes, concurrency.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/fuzz_campaign.py \
        [--cases 10000] [--kills 100] [--workers 2] [--runs 200] [--seed 0]

Prints one table per part and writes ``benchmarks/results/reliability.json``.  The bounded form
of every part runs in CI as ``tests/reliability``; the targets, oracles and drivers live in
``tests/reliability/reliability_harness.py`` (one implementation for both).  A failing fuzz case
is printed with its target and seed: ``make_case(target, seed, bases)`` reproduces it.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "reliability"))

import reliability_harness as harness  # noqa: E402
from conftest import FUZZ_SAMPLES  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "reliability.json")


def fuzz(bases: dict, cases: int, workers: int, seed: int) -> dict:
    per = -(-cases // len(harness.TARGETS))
    out = {}
    print(f"\n== fuzzing: {per} cases per target, {workers} worker subprocesses ==")
    print(f"{'target':9} {'cases':>6} {'refused':>8} {'ok':>6} {'ok+warn':>8} {'run-err':>8} {'live-err':>8} "
          f"{'trusted':>8} {'fail':>5} {'s':>6}")
    for target in harness.TARGETS:
        t0 = time.perf_counter()
        todo = (harness.make_case(target, seed * 10**9 + k, bases, k) for k in range(per))
        counts: collections.Counter = collections.Counter()
        oracles: collections.Counter = collections.Counter()
        failures = []
        resealed = 0
        with harness.Pool(bases, workers) as pool:
            for case, res in pool.run(todo):
                counts[res["outcome"].split(":")[0]] += 1
                oracles[case["oracle"]] += 1
                resealed += bool(case.get("reseal"))
                if res["verdict"] != "pass":
                    failures.append({"seed": case["seed"], "base": case["base"], "desc": case["desc"],
                                     "config": case["config"], "outcome": res["outcome"],
                                     "detail": res["detail"][-1500:]})
        seconds = time.perf_counter() - t0
        refused = counts["create-error"] + counts["optimize-error"]
        print(f"{target:9} {per:6d} {refused:8d} {counts['ok']:6d} {counts['ok-warned']:8d} "
              f"{counts['run-error']:8d} {counts['ok/live-error']:8d} {oracles['trusted']:8d} {len(failures):5d} "
              f"{seconds:6.1f}")
        for f in failures[:5]:
            print(f"   FAIL seed {f['seed']} {f['base']} {f['desc']!r}: {f['outcome']} {f['detail'][-300:]}")
        out[target] = {"cases": per, "outcomes": dict(counts), "oracles": dict(oracles), "resealed": resealed,
                       "failures": len(failures), "failure_examples": failures[:20], "seconds": round(seconds, 1)}
    return out


def checks() -> dict:
    """Hostile locations and resource limits: their test files, run as they are in CI."""
    print("\n== hostile locations and resource limits (pytest) ==")
    out = {}
    for name in ("test_hostile_locations.py", "test_limits.py"):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               os.path.join(ROOT, "tests", "reliability", name)],
                              capture_output=True, text=True, cwd=ROOT, env=harness.subprocess_env())
        ok = proc.returncode == 0
        print(f"{name:28} {'passed' if ok else 'FAILED'} ({time.perf_counter() - t0:.1f} s)")
        if not ok:
            print(proc.stdout[-3000:])
        out[name] = {"passed": ok}
    return out


def kills(trials: int, workers: int, seed: int) -> dict:
    print(f"\n== SIGKILL during writes: {trials} trials per mode ==")
    out = {}
    with tempfile.TemporaryDirectory(prefix="onnxpack-kills-") as work:
        setup = harness.kill_setup(work)
        print(f"{'mode':9} {'trials':>6} {'killed':>6} {'previous':>8} {'fail':>5} {'write calls':>11} {'s':>6}")
        for mode in harness.KILL_MODES:
            t0 = time.perf_counter()
            calls = setup["calls"][mode]
            rng = random.Random(f"{seed}:{mode}")
            points = [(k, rng.randint(1, calls)) for k in range(trials)]

            def one(item):
                k, kill_at = item
                return kill_at, k % 2 == 1, harness.kill_trial(
                    setup, mode, kill_at, os.path.join(work, mode, str(k)), previous=k % 2 == 1)

            failures, killed = [], 0
            with concurrent.futures.ThreadPoolExecutor(workers) as ex:
                for kill_at, previous, (ok, found) in ex.map(one, points):
                    killed += found.startswith("killed")
                    if not ok:
                        failures.append({"kill_at": kill_at, "previous": previous, "found": found})
            seconds = time.perf_counter() - t0
            print(f"{mode:9} {trials:6d} {killed:6d} {trials // 2:8d} {len(failures):5d} {calls:11d} {seconds:6.1f}")
            for f in failures[:5]:
                print(f"   FAIL {f}")
            out[mode] = {"trials": trials, "killed": killed, "with_previous_output": trials // 2,
                         "write_calls_per_run": calls, "failures": len(failures),
                         "failure_examples": failures[:20], "seconds": round(seconds, 1)}
    return out


def concurrency(bases: dict, runs: int, processes: int) -> dict:
    import test_concurrency as tc

    print("\n== concurrency ==")
    out = {}
    with tempfile.TemporaryDirectory(prefix="onnxpack-conc-") as work:
        base = bases["transformer"]
        for name, data in base["files"].items():
            with open(os.path.join(work, name), "wb") as f:
                f.write(data)
        t0 = time.perf_counter()
        errors = 0
        try:
            n = tc.run_threads_one_session(os.path.join(work, base["entry"]), base["feeds"], base["expected"], 8, runs)
        except Exception as e:  # noqa: BLE001
            n, errors = 0, 1
            print(f"   FAIL {type(e).__name__}: {e}")
        print(f"8 threads x {runs} runs on one session: {n} runs, {errors} errors ({time.perf_counter() - t0:.1f} s)")
        out["threads_one_session"] = {"threads": 8, "runs_per_thread": runs, "runs": n, "errors": errors}
        sessions = 25
        for sample in ("mlp", "subgraphs"):
            base = bases[sample]
            folder = os.path.join(work, sample)
            os.makedirs(folder)
            for name, data in base["files"].items():
                with open(os.path.join(folder, name), "wb") as f:
                    f.write(data)
            t0 = time.perf_counter()
            errors = 0
            try:
                n = tc.run_threads_shared_container(os.path.join(folder, base["entry"]), base["feeds"],
                                                    base["expected"], 8, sessions)
            except Exception as e:  # noqa: BLE001
                n, errors = 0, 1
                print(f"   FAIL {type(e).__name__}: {e}")
            print(f"8 threads x {sessions} sessions on one container ({sample}): {n} sessions, {errors} errors, "
                  f"container empty at the end ({time.perf_counter() - t0:.1f} s)")
            out[f"threads_shared_container_{sample}"] = {"threads": 8, "sessions_per_thread": sessions,
                                                         "sessions": n, "errors": errors}
        folder = os.path.join(work, "procs")
        os.makedirs(folder)
        t0 = time.perf_counter()
        errors = 0
        try:
            n, digests, entries = tc.run_processes(bases, folder, processes, 5)
            errors += len(digests) != 1
        except Exception as e:  # noqa: BLE001
            n, digests, entries, errors = 0, set(), 0, 1
            print(f"   FAIL {type(e).__name__}: {e}")
        print(f"{processes} processes sharing one cache file and one optimized model: {n} sessions, "
              f"{len(digests)} distinct outputs, cache valid with {entries} entries, {errors} errors "
              f"({time.perf_counter() - t0:.1f} s)")
        out["processes_shared_cache"] = {"processes": processes, "sessions": n, "distinct_outputs": len(digests),
                                         "cache_entries": entries, "errors": errors}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000, help="fuzz cases in total (split over the targets)")
    ap.add_argument("--kills", type=int, default=100, help="kill trials per write mode")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--runs", type=int, default=200, help="runs per thread on one session")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    import numpy as np
    import onnx
    import onnxruntime

    os.environ.update(harness.DETERMINISTIC)  # (as the test suite: outputs compared bit for bit)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="onnxpack-campaign-") as work:
        bases = harness.make_bases(FUZZ_SAMPLES, work)
        report = {
            "command": "python3 benchmarks/fuzz_campaign.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "numpy": np.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "samples": list(FUZZ_SAMPLES),
        }
        report["fuzz"] = fuzz(bases, args.cases, args.workers, args.seed)
        report["checks"] = checks()
        report["kills"] = kills(args.kills, args.workers, args.seed)
        report["concurrency"] = concurrency(bases, args.runs, args.processes)
    failures = (sum(t["failures"] for t in report["fuzz"].values())
                + sum(not c["passed"] for c in report["checks"].values())
                + sum(k["failures"] for k in report["kills"].values())
                + sum(c["errors"] for c in report["concurrency"].values()))
    report["total_fuzz_cases"] = sum(t["cases"] for t in report["fuzz"].values())
    report["total_kills"] = sum(k["trials"] for k in report["kills"].values())
    report["total_failures"] = failures
    report["seconds"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\n{report['total_fuzz_cases']} fuzz cases, {report['total_kills']} kills, "
          f"{failures} failures in {report['seconds']} s -> {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
