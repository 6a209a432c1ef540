"""Benchmark: activation memory planning — arena sizes vs the lower bound, and planned runs.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_planner.py \
        [--runs 7] [--models NAME,...] [--planner auto] [--json PATH]

Per model (the sample models, onnx's light resnet50 / squeezenet / densenet121 / inception_v1
with real random weights, and a transformer block of BERT-base width at sequence 128):

1. **Arena sizes.**  One recorded run gives every intermediate's size and lifetime; naive,
   greedy_by_size and position_greedy place them (64-byte alignment) and each total is divided
   by the lower bound (max live bytes).  Goal: best <= 1.05x.  The *run-time* plan (only outputs
   of kernels that write into the arena, ``run_into``) is reported too.
2. **Latency.**  One fresh subprocess holds a session with the planner off and one with it on,
   warms both (the planned one records and plans on its first run), then alternates their runs;
   the median of ``--runs`` each and the planned/unplanned ratio are reported.
3. **Peak RSS of a run.**  One fresh subprocess per mode: create, warm up, reset the peak
   (``/proc/self/clear_refs`` 5), run ``--runs`` times, read VmHWM; also RssAnon after.

Light models and the transformer block are written to ``benchmarks/work/planner/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pathlib
import statistics
import sys
import textwrap

import onnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _models  # noqa: E402
from _common import BLAS_ENV, ROOT, print_table, run_child, session_feeds, write_json  # noqa: E402

WORK = ROOT / "benchmarks" / "work" / "planner"
RESULTS = ROOT / "benchmarks" / "results" / "planner.json"
LIGHT_MODELS = ("squeezenet", "resnet50", "densenet121", "inception_v1")
GOAL_RATIO = 1.05  # issue 7: best arena <= 1.05x the lower bound
BLOCK = dict(s=128, d=768, h=12, ff=3072)  # BERT-base width at sequence 128


def prepare_models(selected: set[str] | None) -> dict[str, str]:
    """name -> model path: the sample models, the light models (written once), the block."""
    WORK.mkdir(parents=True, exist_ok=True)
    models = {pathlib.Path(p).stem: p for p in sorted(glob.glob(str(ROOT / "models" / "*.onnx")))}
    build = _models.sample_models()
    for name in LIGHT_MODELS:
        src = pathlib.Path(build.LIGHT_DIR) / f"light_{name}.onnx"
        if not src.exists():
            print(f"skipping {name}: {src} not found", file=sys.stderr)
            continue
        dst = WORK / f"{name}.onnx"
        if not dst.exists():
            _save(build.materialize_light_model(src, expose_logits=False), dst)
        models[name] = str(dst)
    dst = WORK / "transformer_block.onnx"
    if not dst.exists():
        _save(_models.transformer_block(**BLOCK), dst)
    models["transformer_block"] = str(dst)
    if selected:
        models = {k: v for k, v in models.items() if k in selected}
    return models


def _save(model: onnx.ModelProto, dst: pathlib.Path) -> None:
    tmp = dst.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(model.SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dst)


_PRELUDE = textwrap.dedent("""
    import json, statistics, sys, time
    import numpy as np
    from onnxpack import InferenceSession, SessionOptions
    from _common import blas_info, proc_memory, session_feeds

    args = json.loads(sys.argv[1])

    def session(planner):
        o = SessionOptions()
        o.add_session_config_entry("onnxpack.memory_planner", planner)
        return InferenceSession(args["model"], o)
""")

_LATENCY = textwrap.dedent("""
    base, planned = session("none"), session(args["planner"])
    feeds = session_feeds(base)
    ref = base.run(None, feeds)
    for _ in range(2):  # the planned session records + plans on its first run
        got = planned.run(None, feeds)
        base.run(None, feeds)
    same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(ref, got))
    times = {"none": [], "planned": []}
    for _ in range(args["runs"]):
        for k, s in (("none", base), ("planned", planned)):
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[k].append(time.perf_counter() - t0)
    plan = planned.get_memory_plan()
    print(json.dumps({"seconds": times, "bit_equal": same, "blas": blas_info(),
                      "runtime_plan": None if plan is None else {
                          k: plan[k] for k in ("algorithm", "total_size", "lower_bound", "planned_steps", "steps")}}))
""")

_RSS = textwrap.dedent("""
    s = session(args["planner"])
    feeds = session_feeds(s)
    for _ in range(2):
        s.run(None, feeds)
    before = proc_memory()
    with open("/proc/self/clear_refs", "w") as fh:  # reset VmHWM to the current RSS
        fh.write("5")
    for _ in range(args["runs"]):
        s.run(None, feeds)
    after = proc_memory()
    print(json.dumps({"rss_before_runs": before["VmRSS"], "peak_rss_runs": after["VmHWM"],
                      "rss_anon_after": after["RssAnon"]}))
""")


def _child(body: str, **kwargs) -> dict:
    """Run ``body`` after the prelude in a fresh interpreter; its last stdout line is JSON."""
    return run_child(_PRELUDE + body, json.dumps(kwargs), drop_env=BLAS_ENV, what=str(kwargs))


def arena_sizes(path: str) -> dict:
    """Arena totals of each algorithm for every intermediate, and of the run-time plan."""
    from onnxpack import InferenceSession
    from onnxpack.session import planner
    from onnxpack.session import analyze, validate_feed

    with InferenceSession(path) as sess:
        program = sess.program
        valid = validate_feed(sess.model, session_feeds(sess), program.overridable, program.defaults)
        inputs = [valid[n] for n in program.root.input_names]
        lifetimes, _, _ = analyze(program.root, inputs, algorithm="naive")
        rt_lifetimes, rt, _ = analyze(program.root, inputs, algorithm="auto", runtime_only=True)
    lb, _ = planner.lower_bound(lifetimes, planner.DEFAULT_ALIGNMENT)
    row = {"tensors": len(lifetimes), "lower_bound": lb}
    for name in ("naive", "greedy_by_size", "position_greedy"):
        row[name] = planner.plan(lifetimes, algorithm=name).total_size
    best = min(row[n] for n in ("greedy_by_size", "position_greedy", "naive"))
    row["best_ratio"] = best / lb if lb else 1.0
    row["runtime_tensors"] = len(rt_lifetimes)
    row["runtime_arena"] = rt.total_size
    row["runtime_lower_bound"] = rt.lower_bound
    return row


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--models", default="", help="comma-separated subset of model names")
    ap.add_argument("--planner", default="auto", help="planner measured against none")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.runs < 5:
        ap.error("--runs must be >= 5 (medians of at least 5 runs)")
    models = prepare_models(set(filter(None, args.models.split(","))) or None)
    rows = {}
    blas = None
    for name, path in models.items():
        row = arena_sizes(path)
        lat = _child(_LATENCY, model=path, planner=args.planner, runs=args.runs)
        blas = blas or lat["blas"]
        t_none = statistics.median(lat["seconds"]["none"])
        t_plan = statistics.median(lat["seconds"]["planned"])
        rss = {mode: _child(_RSS, model=path, planner=mode, runs=args.runs)
               for mode in ("none", args.planner)}
        row.update(
            latency_none_ms=1e3 * t_none, latency_planned_ms=1e3 * t_plan, latency_ratio=t_plan / t_none,
            # min is less sensitive to other processes on a shared machine; reported beside the median
            latency_min_ratio=min(lat["seconds"]["planned"]) / min(lat["seconds"]["none"]),
            bit_equal=lat["bit_equal"], runtime_plan=lat["runtime_plan"],
            peak_rss_runs_none=rss["none"]["peak_rss_runs"], peak_rss_runs_planned=rss[args.planner]["peak_rss_runs"],
            rss_before_runs_none=rss["none"]["rss_before_runs"],
            rss_before_runs_planned=rss[args.planner]["rss_before_runs"],
        )
        rows[name] = row
        print(f"{name}: done", file=sys.stderr)

    print(f"\nArena size (MiB) of every intermediate, 64-byte aligned; ratio = best / lower bound (goal <= {GOAL_RATIO})")
    hdr = ("model", "tensors", "lower bound", "naive", "greedy_by_size", "position_greedy", "best/LB")
    table = [hdr] + [
        (n, str(r["tensors"]), _mib(r["lower_bound"]), _mib(r["naive"]), _mib(r["greedy_by_size"]),
         _mib(r["position_greedy"]), f"{r['best_ratio']:.3f}")
        for n, r in rows.items()
    ]
    print_table(table)
    print(f"\nRun-time plan ({args.planner}; run_into outputs only), latency (median of {args.runs}, ms) "
          "and peak RSS during runs (MiB)")
    hdr = ("model", "arena tensors", "arena", "t none", "t planned", "planned/none", "(min)", "peak none",
           "peak planned", "bit-equal")
    table = [hdr] + [
        (n, str(r["runtime_tensors"]), _mib(r["runtime_arena"]), f"{r['latency_none_ms']:.2f}",
         f"{r['latency_planned_ms']:.2f}", f"{r['latency_ratio']:.3f}", f"{r['latency_min_ratio']:.3f}",
         _mib(r["peak_rss_runs_none"]),
         _mib(r["peak_rss_runs_planned"]), str(r["bit_equal"]))
        for n, r in rows.items()
    ]
    print_table(table)
    ratios = [r["latency_ratio"] for r in rows.values()]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else float("nan")
    worst = max((r["best_ratio"] for r in rows.values()), default=0.0)
    print(f"\nbest arena / lower bound, worst model: {worst:.3f} (goal <= {GOAL_RATIO}: "
          f"{'met' if worst <= GOAL_RATIO else 'NOT met'})")
    print(f"planned / unplanned latency, geometric mean: {geo:.3f}")
    print(f"BLAS: {blas}")
    out = {"runs": args.runs, "planner": args.planner, "blas": blas, "models": rows,
           "worst_best_ratio": worst, "latency_ratio_geomean": geo}
    write_json(args.json, out, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
