"""Server throughput: worker threads, each running its own one-thread session, onnxpack vs onnxruntime.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_server.py [--models a,b] [--workers 2]

How a model is served from a thread pool (a web framework's sync handlers): ``--workers``
threads, each looping over its own session created with ``intra_op_num_threads = 1`` (one core
per request; the pool gives the parallelism).  The main thread creates the sessions and runs each
once before the workers start (an application's warm-up), as it would.  Per model, in a fresh
process: the two runtimes' workers run in alternating blocks (``--block`` seconds each, the first
``--settle`` seconds of a block not counted), ``--rounds`` rounds; reported per runtime the
median over rounds of runs completed per second (all workers) and the median latency of a run,
and onnxpack's throughput over onnxruntime's.

Why: ``intra_op_num_threads`` is how such a server keeps each request on one core.  Until
session 52 a run from a worker thread did not get its limit whenever another thread had set the
BLAS count first (threadpoolctl 3.6+ honours only its first live "controlling" thread; see
``onnxpack/session/_threads.py``), so every worker's GEMMs ran on every core at once.

Writes ``benchmarks/results/server.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import BLAS_ENV, blas_info, build_native_cache, print_table, run_child, write_json  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "server.json"
DEFAULT_MODELS = "resnet50,yolox-ddddocr,minilm-l3,mobilenetv2,wakeword-embedding"

_CHILD = """
import json, statistics, sys, threading, time
import numpy as np
import bench_models as bm
spec = json.loads(sys.argv[1])
workers, rounds, block, settle = spec["workers"], spec["rounds"], spec["block"], spec["settle"]
path, feeds = bm.all_models()[spec["model"]][1]()
import onnxpack, onnxruntime as ort
sessions = {"onnxpack": [], "onnxruntime": []}
for _ in range(workers):
    so = onnxpack.SessionOptions()
    so.intra_op_num_threads = 1
    sessions["onnxpack"].append(onnxpack.InferenceSession(path, so))
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.inter_op_num_threads = 1
    o.log_severity_level = 3
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions["onnxruntime"].append(ort.InferenceSession(path, o, providers=["CPUExecutionProvider"]))
if spec["old_setter"]:  # the same sessions run with session 51's setter (threadpoolctl's guarded one)
    sessions["onnxpack-s51"] = sessions["onnxpack"]
fp = bm._feeds_for(sessions["onnxpack"][0], feeds)
first = {}
for label in ("onnxpack", "onnxruntime"):  # the application's warm-up, in the main thread
    for s in sessions[label]:
        first[label] = s.run(None, fp)[0]
diff = float(np.abs(np.asarray(first["onnxpack"], np.float64) - np.asarray(first["onnxruntime"], np.float64)).max())

def block_of(label):
    from onnxpack.session import _threads
    own = _threads._own_setter
    if label == "onnxpack-s51":
        _threads._own_setter = lambda lib: lib.set_num_threads
        for lib in _threads.blas_libraries():  # the main thread's warm-up made it threadpoolctl's controller
            lib.set_num_threads(lib.num_threads)
    try:
        return _block(label)
    finally:
        _threads._own_setter = own

def _block(label):
    stop = threading.Event()
    done = [[] for _ in range(workers)]  # (start, end) of each run, per worker
    def work(i):
        s = sessions[label][i]
        while not stop.is_set():
            t0 = time.perf_counter()
            s.run(None, fp)
            done[i].append((t0, time.perf_counter()))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(block)
    stop.set()
    for t in threads:
        t.join()
    lo, hi = start + settle, start + block
    runs = [(a, b) for d in done for a, b in d if a >= lo and b <= hi]
    return len(runs) / (hi - lo), [b - a for a, b in runs]

throughput = {k: [] for k in sessions}
latency = {k: [] for k in sessions}
for label in sessions:  # warm-up block of each
    block_of(label)
for _ in range(rounds):
    for label in sessions:
        rate, lat = block_of(label)
        throughput[label].append(rate)
        latency[label].extend(lat)
print(json.dumps({"throughput": throughput, "latency_ms": {k: statistics.median(v) * 1e3 if v else None
                                                          for k, v in latency.items()},
                  "runs_counted": {k: len(v) for k, v in latency.items()}, "max_abs_diff": diff}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=float, default=4.0, help="seconds per runtime per round")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds at the start of a block not counted")
    ap.add_argument("--old-setter", action="store_true",
                    help="also run onnxpack with session 51's BLAS thread setter (threadpoolctl's, which ignores "
                         "sets from every thread but the first that set it): what the fix is worth")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.workers < 1 or args.rounds < 1 or not 0 <= args.settle < args.block:
        ap.error("need --workers >= 1, --rounds >= 1 and 0 <= --settle < --block")
    import bench_models as bm
    import numpy as np
    import onnxruntime as ort

    available = bm.all_models()
    names = [n for n in args.models.split(",") if n]
    missing = [n for n in names if n not in available]
    if missing:
        ap.error(f"not available here: {', '.join(missing)} (available: {', '.join(available)})")
    build_native_cache()
    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
               "numpy": np.__version__, "onnxruntime": ort.__version__, "blas": blas_info(),
               "load_average_start": os.getloadavg()}
    print(f"{args.workers} worker threads, one 1-thread session each; {args.rounds} rounds of {args.block:g} s "
          f"blocks per runtime (first {args.settle:g} s not counted); load "
          + " ".join(f"{x:.2f}" for x in machine["load_average_start"]))
    rows, table = [], [["model", "onnxpack runs/s", "onnxruntime runs/s", "throughput ratio", "latency ms (ours / ort)"]
                       + (["onnxpack runs/s, session 51's setter"] if args.old_setter else [])]
    for name in names:
        spec = {"model": name, "workers": args.workers, "rounds": args.rounds, "block": args.block,
                "settle": args.settle, "old_setter": args.old_setter}
        r = run_child(_CHILD, json.dumps(spec), drop_env=BLAS_ENV, what=f"server blocks of {name}")
        med = {k: statistics.median(v) for k, v in r["throughput"].items()}
        ratio = med["onnxpack"] / med["onnxruntime"]
        rows.append({"model": name, **r, "median_runs_per_s": med, "throughput_ratio": ratio})
        lat = r["latency_ms"]
        table.append([name, f"{med['onnxpack']:.1f}", f"{med['onnxruntime']:.1f}", f"{ratio:.2f}",
                      f"{lat['onnxpack']:.1f} / {lat['onnxruntime']:.1f}"]
                     + ([f"{med['onnxpack-s51']:.1f}"] if args.old_setter else []))
        print(f"  {name}: {med['onnxpack']:.1f} vs {med['onnxruntime']:.1f} runs/s ({ratio:.2f}), "
              f"max|diff| {r['max_abs_diff']:.2e}", flush=True)
    print()
    print_table(table)
    ratios = [r["throughput_ratio"] for r in rows]
    geo = float(np.exp(np.mean(np.log(ratios)))) if ratios else None
    if geo is not None:
        print(f"geometric mean of onnxpack's throughput over onnxruntime's: {geo:.2f}")
    write_json(args.json, {"machine": machine, "workers": args.workers, "old_setter": args.old_setter, "rounds": args.rounds, "block_s": args.block,
                           "settle_s": args.settle, "rows": rows, "geomean_throughput_ratio": geo,
                           "load_average_end": os.getloadavg()})
    print(f"wrote {os.path.relpath(args.json)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
