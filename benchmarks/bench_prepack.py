"""Benchmark pre-packing (issue 4): run latency packed vs unpacked, session create time, and the
RSS of 1 vs 8 sessions sharing one PrepackedWeightsContainer, side by side with onnxruntime.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_prepack.py \
        [--dir benchmarks/work] [--runs 7] [--sessions 8] [--json benchmarks/results/prepack.json]

Models (generated once into ``--dir`` by ``benchmarks/_models.py``, deterministic):

* ``fp16_mlp`` — ~103 MB of fp16 weights (4 MatMul 3584x3584 + Relu, fp16 activations);
* ``int4`` — the 100.7 MB fp32 MatMul chain (6 x 2048x2048) quantized to 4-bit MatMulNBits by
  onnxruntime's ``MatMulNBitsQuantizer`` (block 32).

Method:

* latency — one fresh process per model holds an onnxpack session with pre-packing, one with
  ``session.disable_prepacking=1`` and an onnxruntime session; runs are interleaved (one of each
  per round, after one warm-up round) and the median of ``--runs`` rounds is reported, so the
  ratios are measured side by side.  onnxruntime's intra-op threads are told not to spin
  (``session.intra_op.allow_spinning=0``): spinning threads left over from its run would steal
  the cores from the numpy run that follows (measured: +50% on onnxpack's fp16 MLP run).
* create time — a fresh process per measurement (imports done before the clock starts), median
  of ``--runs`` processes; onnxpack starts cold (no cache file, no saved blobs).
* memory — a fresh process per configuration: create N sessions (onnxpack: all on one container;
  ``onnxpack-private``: each its own), run each once, then read RssAnon/RssFile from
  /proc/self/status and Pss from /proc/self/smaps_rollup.  RssAnon is what sessions own
  privately; file-backed pages (the mapped weights) are shared with the page cache.  The goal:
  RssAnon of 8 onnxpack sessions <= 1.1x one session's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import textwrap

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _models  # noqa: E402
from _common import ROOT, run_child, write_json  # noqa: E402

MODELS = {"fp16_mlp": _models.make_fp16_mlp, "int4": _models.make_int4_model}
GOAL_RSS_RATIO = 1.1  # issue 4: 8 sessions on one container <= 1.1x one session's RSS

_PRELUDE = textwrap.dedent("""
    import gc, json, statistics, sys, time
    import numpy as np
    import onnxruntime as ort
    import onnxpack
    import _models
    from _common import blas_info, proc_memory

    def ox_session(path, prepack=True, container=None):
        so = onnxpack.SessionOptions()
        if not prepack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        return onnxpack.InferenceSession(path, so, prepacked_weights_container=container)

    def ort_session(path, spin=True):
        so = ort.SessionOptions()
        if not spin:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    args = json.loads(sys.argv[1])
    path = args["model"]
    feeds = _models.feeds_for(path)
""")

_LATENCY = _PRELUDE + textwrap.dedent("""
    sessions = {"onnxpack packed": ox_session(path), "onnxpack unpacked": ox_session(path, prepack=False),
                "onnxruntime": ort_session(path, spin=False)}
    outs = {k: s.run(None, feeds)[0] for k, s in sessions.items()}  # warm-up round
    times = {k: [] for k in sessions}
    for _ in range(args["runs"]):
        for k, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[k].append(time.perf_counter() - t0)
    ref = outs["onnxruntime"].astype(np.float64)
    diff = {k: float(np.max(np.abs(v.astype(np.float64) - ref))) for k, v in outs.items()}
    packed_vs_unpacked = float(np.max(np.abs(outs["onnxpack packed"].astype(np.float64)
                                             - outs["onnxpack unpacked"].astype(np.float64))))
    print(json.dumps({"seconds": times, "max_abs_diff_vs_onnxruntime": diff,
                      "max_abs_diff_packed_vs_unpacked": packed_vs_unpacked,
                      "stats": sessions["onnxpack packed"].get_prepack_stats(), "blas": blas_info(),
                      "ort_allow_spinning": 0}))
""")

_CREATE = _PRELUDE + textwrap.dedent("""
    engine = args["engine"]
    t0 = time.perf_counter()
    if engine == "onnxruntime":
        s = ort_session(path)
    else:
        s = ox_session(path, prepack=engine == "onnxpack packed")
    t1 = time.perf_counter()
    s.run(None, feeds)
    t2 = time.perf_counter()
    print(json.dumps({"create": t1 - t0, "first_run": t2 - t1}))
""")

_MEMORY = _PRELUDE + textwrap.dedent("""
    engine, n = args["engine"], args["sessions"]
    gc.collect()
    before = proc_memory()
    container = onnxpack.PrepackedWeightsContainer() if engine == "onnxpack" else None
    sessions = []
    for _ in range(n):
        if engine == "onnxruntime":
            sessions.append(ort_session(path))
        else:
            sessions.append(ox_session(path, container=container))
    for s in sessions:
        s.run(None, feeds)
    gc.collect()
    after = proc_memory()
    extra = {}
    if container is not None:
        extra = {"container_entries": len(container), "container_nbytes": container.nbytes}
    print(json.dumps({"before": before, "after": after, **extra}))
""")


def _child(script: str, args: dict) -> dict:
    return run_child(script, json.dumps(args), what=str(args))


def _ensure_models(folder: pathlib.Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, make in MODELS.items():
        path = folder / f"{name}.onnx"
        if not (path.exists() and (folder / f"{name}.onnx.data").exists()):
            print(f"generating {path} ...", flush=True)
            make(path)
        paths[name] = str(path)
    return paths


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def bench_model(name: str, path: str, runs: int, n_sessions: int) -> dict:
    weight_bytes = os.path.getsize(path + ".data")
    lat = _child(_LATENCY, {"model": path, "runs": runs})
    create = {}
    for engine in ("onnxpack packed", "onnxpack unpacked", "onnxruntime"):
        samples = [_child(_CREATE, {"model": path, "engine": engine}) for _ in range(runs)]
        create[engine] = {"create_median": statistics.median(s["create"] for s in samples),
                          "first_run_median": statistics.median(s["first_run"] for s in samples),
                          "create": [s["create"] for s in samples]}
    memory = {}
    for engine in ("onnxpack", "onnxpack-private", "onnxruntime"):
        for n in (1, n_sessions):
            if engine == "onnxpack-private" and n == 1:
                continue  # same as onnxpack with one session
            memory[f"{engine} x{n}"] = _child(_MEMORY, {"model": path, "engine": engine, "sessions": n})
    return {"model": name, "path": path, "data_bytes": weight_bytes, "latency": lat, "create": create,
            "memory": memory}


def _print_model(res: dict, n_sessions: int) -> dict:
    name = res["model"]
    lat = res["latency"]
    med = {k: statistics.median(v) for k, v in lat["seconds"].items()}
    print(f"\n== {name}: data file {_mb(res['data_bytes'])} MB; packed {_mb(lat['stats']['bytes_packed'])} MB "
          f"({lat['stats']['weights_packed']} weights)")
    print(f"{'run latency (median)':28s} {'ms':>9s} {'vs packed':>10s} {'max|diff| vs ort':>17s}")
    for k, v in med.items():
        print(f"  {k:26s} {v * 1000:9.2f} {v / med['onnxpack packed']:9.2f}x "
              f"{lat['max_abs_diff_vs_onnxruntime'][k]:17.3g}")
    print(f"{'session create (median)':28s} {'ms':>9s} {'first run ms':>13s}")
    for k, v in res["create"].items():
        print(f"  {k:26s} {v['create_median'] * 1000:9.1f} {v['first_run_median'] * 1000:13.1f}")
    print(f"{'memory after one run each':28s} {'RssAnon MB':>11s} {'+anon MB':>9s} {'RssFile MB':>11s} "
          f"{'Pss MB':>8s}")
    anon = {}
    for k, m in res["memory"].items():
        a, b = m["after"], m["before"]
        anon[k] = a["RssAnon"]
        print(f"  {k:26s} {_mb(a['RssAnon']):>11s} {_mb(a['RssAnon'] - b['RssAnon']):>9s} "
              f"{_mb(a['RssFile']):>11s} {_mb(a.get('Pss', 0)):>8s}")
    ratios = {}
    for engine in ("onnxpack", "onnxruntime"):
        one, many = res["memory"][f"{engine} x1"], res["memory"][f"{engine} x{n_sessions}"]
        total = many["after"]["RssAnon"] / one["after"]["RssAnon"]
        d1 = one["after"]["RssAnon"] - one["before"]["RssAnon"]
        dn = many["after"]["RssAnon"] - many["before"]["RssAnon"]
        ratios[engine] = {"rss_anon_ratio": total, "rss_anon_growth_ratio": dn / d1 if d1 else None}
        goal = f"  (goal <= {GOAL_RSS_RATIO}x: {'met' if total <= GOAL_RSS_RATIO else 'NOT met'})" \
            if engine == "onnxpack" else ""
        print(f"  {engine}: RssAnon {n_sessions} sessions / 1 session = {total:.2f}x "
              f"(growth over the interpreter: {dn / d1 if d1 else float('nan'):.2f}x){goal}")
    res["ratios"] = ratios
    res["latency_median_ms"] = {k: v * 1000 for k, v in med.items()}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=str(ROOT / "benchmarks" / "work"), help="folder for generated models")
    p.add_argument("--runs", type=int, default=7, help="runs / processes per median (>= 5)")
    p.add_argument("--sessions", type=int, default=8, help="sessions in the memory comparison")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "prepack.json"))
    args = p.parse_args(argv)
    if args.runs < 5:
        p.error("--runs must be >= 5 (medians of fewer runs are noise)")
    paths = _ensure_models(pathlib.Path(args.dir))
    results = []
    for name in args.models.split(","):
        res = bench_model(name, paths[name], args.runs, args.sessions)
        results.append(_print_model(res, args.sessions))
    blas = results[0]["latency"]["blas"] if results else []
    print("\nBLAS: " + "; ".join(f"{b['internal_api']} {b['version']} {b['architecture']} "
                                 f"threads={b['num_threads']}" for b in blas))
    env = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS")}
    write_json(args.json, indent=2, payload={
        "benchmark": "prepack", "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
        "runs": args.runs, "sessions": args.sessions, "env": env, "blas": blas, "results": results})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
