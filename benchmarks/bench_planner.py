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
import subprocess
import sys
import textwrap

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "work" / "planner"
RESULTS = ROOT / "benchmarks" / "results" / "planner.json"
LIGHT = pathlib.Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
LIGHT_MODELS = ("squeezenet", "resnet50", "densenet121", "inception_v1")
GOAL_RATIO = 1.05  # issue 7: best arena <= 1.05x the lower bound

sys.path.insert(0, str(ROOT))


def light_model_with_weights(path: pathlib.Path, seed: int = 0) -> onnx.ModelProto:
    """onnx's light model with each ConstantOfShape weight replaced by a random initializer
    (1-D tensors in [0.5, 1.5) so batch-norm variances stay positive)."""
    m = onnx.load(str(path))
    g = m.graph
    rng = np.random.default_rng(seed)
    inits = {t.name: t for t in g.initializer}
    keep, new = [], []
    for n in g.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in inits:
            shape = numpy_helper.to_array(inits[n.input[0]]).astype(int).tolist()
            if len(shape) <= 1:
                w = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            else:
                w = (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
            new.append(numpy_helper.from_array(w, n.output[0]))
        else:
            keep.append(n)
    used = {i for n in keep for i in n.input}
    kept = [t for t in g.initializer if t.name in used]
    gone = set(inits) | {t.name for t in new}
    inputs = [i for i in g.input if i.name not in gone]
    g.ClearField("node")
    g.node.extend(keep)
    g.ClearField("initializer")
    g.initializer.extend(kept + new)
    g.ClearField("input")
    g.input.extend(inputs)
    return m


def transformer_block(s: int = 128, d: int = 768, h: int = 12, ff: int = 3072, seed: int = 0) -> onnx.ModelProto:
    """One pre-LN encoder block (attention + GELU MLP), BERT-base width, batch 1."""
    rng = np.random.default_rng(seed)
    hd = d // h

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or 1 / math.sqrt(shape[0]))).astype(np.float32)

    arrays = {
        "ln1_s": 1 + w(d, scale=0.1), "ln1_b": w(d, scale=0.1), "Wq": w(d, d), "Wk": w(d, d), "Wv": w(d, d),
        "Wo": w(d, d), "bq": w(d, scale=0.1), "ln2_s": 1 + w(d, scale=0.1), "ln2_b": w(d, scale=0.1),
        "W1": w(d, ff), "b1": w(ff, scale=0.1), "W2": w(ff, d), "b2": w(d, scale=0.1),
        "heads_shape": np.array([1, s, h, hd], np.int64), "model_shape": np.array([1, s, d], np.int64),
        "att_scale": np.array(1 / math.sqrt(hd), np.float32), "half": np.array(0.5, np.float32),
        "one": np.array(1.0, np.float32), "rsqrt2": np.array(1 / math.sqrt(2), np.float32),
    }
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln1_s", "ln1_b"], ["ln1"], axis=-1, epsilon=1e-5),
        n("MatMul", ["ln1", "Wq"], ["q0"]), n("Add", ["q0", "bq"], ["q"]),
        n("MatMul", ["ln1", "Wk"], ["k"]), n("MatMul", ["ln1", "Wv"], ["v"]),
        n("Reshape", ["q", "heads_shape"], ["qh"]), n("Reshape", ["k", "heads_shape"], ["kh"]),
        n("Reshape", ["v", "heads_shape"], ["vh"]),
        n("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]), n("Transpose", ["kh"], ["kt"], perm=[0, 2, 3, 1]),
        n("Transpose", ["vh"], ["vt"], perm=[0, 2, 1, 3]),
        n("MatMul", ["qt", "kt"], ["scores"]), n("Mul", ["scores", "att_scale"], ["scaled"]),
        n("Softmax", ["scaled"], ["probs"], axis=-1), n("MatMul", ["probs", "vt"], ["ctx"]),
        n("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]), n("Reshape", ["ctx_t", "model_shape"], ["ctx_r"]),
        n("MatMul", ["ctx_r", "Wo"], ["att"]), n("Add", ["x", "att"], ["res1"]),
        n("LayerNormalization", ["res1", "ln2_s", "ln2_b"], ["ln2"], axis=-1, epsilon=1e-5),
        n("MatMul", ["ln2", "W1"], ["f1"]), n("Add", ["f1", "b1"], ["f1b"]),
        n("Mul", ["f1b", "rsqrt2"], ["g0"]), n("Erf", ["g0"], ["g1"]), n("Add", ["g1", "one"], ["g2"]),
        n("Mul", ["f1b", "g2"], ["g3"]), n("Mul", ["g3", "half"], ["gelu"]),
        n("MatMul", ["gelu", "W2"], ["f2"]), n("Add", ["f2", "b2"], ["f2b"]), n("Add", ["res1", "f2b"], ["y"]),
    ]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "transformer_block", [vi("x", TensorProto.FLOAT, [1, s, d])],
                          [vi("y", TensorProto.FLOAT, [1, s, d])],
                          [numpy_helper.from_array(a, k) for k, a in arrays.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def prepare_models(selected: set[str] | None) -> dict[str, str]:
    """name -> model path: the sample models, the light models (written once), the block."""
    WORK.mkdir(parents=True, exist_ok=True)
    models = {pathlib.Path(p).stem: p for p in sorted(glob.glob(str(ROOT / "models" / "*.onnx")))}
    for name in LIGHT_MODELS:
        src = LIGHT / f"light_{name}.onnx"
        if not src.exists():
            print(f"skipping {name}: {src} not found", file=sys.stderr)
            continue
        dst = WORK / f"{name}.onnx"
        if not dst.exists():
            _save(light_model_with_weights(src), dst)
        models[name] = str(dst)
    dst = WORK / "transformer_block.onnx"
    if not dst.exists():
        _save(transformer_block(), dst)
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
    sys.path.insert(0, {root!r})
    from onnxpack import InferenceSession, SessionOptions

    args = json.loads(sys.argv[1])

    def session(planner):
        o = SessionOptions()
        o.add_session_config_entry("onnxpack.memory_planner", planner)
        return InferenceSession(args["model"], o)

    def feeds_for(sess):
        rng = np.random.default_rng(0)
        types = {{"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                  "tensor(bool)": np.bool_, "tensor(double)": np.float64, "tensor(int32)": np.int32}}
        f = {{}}
        for i in sess.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in (i.shape or [])]
            dt = np.dtype(types[i.type])
            f[i.name] = rng.standard_normal(shape).astype(dt) if dt.kind == "f" else np.zeros(shape, dt)
        return f

    def status():
        out = {{}}
        with open("/proc/self/status") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
        return out
""")

_LATENCY = textwrap.dedent("""
    from threadpoolctl import threadpool_info
    base, planned = session("none"), session(args["planner"])
    feeds = feeds_for(base)
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
    blas = [{k: i.get(k) for k in ("internal_api", "version", "num_threads", "architecture")} for i in threadpool_info()]
    print(json.dumps({"seconds": times, "bit_equal": same, "blas": blas,
                      "runtime_plan": None if plan is None else {
                          k: plan[k] for k in ("algorithm", "total_size", "lower_bound", "planned_steps", "steps")}}))
""")

_RSS = textwrap.dedent("""
    s = session(args["planner"])
    feeds = feeds_for(s)
    for _ in range(2):
        s.run(None, feeds)
    before = status()
    with open("/proc/self/clear_refs", "w") as fh:  # reset VmHWM to the current RSS
        fh.write("5")
    for _ in range(args["runs"]):
        s.run(None, feeds)
    after = status()
    print(json.dumps({"rss_before_runs": before["VmRSS"], "peak_rss_runs": after["VmHWM"],
                      "rss_anon_after": after["RssAnon"]}))
""")


def _child(body: str, **kwargs) -> dict:
    """Run ``body`` after the prelude in a fresh interpreter; its last stdout line is JSON."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    script = _PRELUDE.format(root=str(ROOT)) + body
    out = subprocess.run([sys.executable, "-c", script, json.dumps(kwargs)], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def arena_sizes(path: str) -> dict:
    """Arena totals of each algorithm for every intermediate, and of the run-time plan."""
    from onnxpack import InferenceSession
    from onnxpack.session import planner
    from onnxpack.session._arena import analyze

    with InferenceSession(path) as sess:
        rng = np.random.default_rng(0)
        feeds = {}
        for i in sess.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in (i.shape or [])]
            dt = np.dtype({"tensor(float)": np.float32, "tensor(float16)": np.float16,
                           "tensor(int64)": np.int64, "tensor(bool)": np.bool_}[i.type])
            feeds[i.name] = rng.standard_normal(shape).astype(dt) if dt.kind == "f" else np.zeros(shape, dt)
        lifetimes, _, _ = analyze(sess, feeds, algorithm="naive")
        rt_lifetimes, rt, _ = analyze(sess, feeds, algorithm="auto", runtime_only=True)
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
    _print_table(table)
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
    _print_table(table)
    ratios = [r["latency_ratio"] for r in rows.values()]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else float("nan")
    worst = max((r["best_ratio"] for r in rows.values()), default=0.0)
    print(f"\nbest arena / lower bound, worst model: {worst:.3f} (goal <= {GOAL_RATIO}: "
          f"{'met' if worst <= GOAL_RATIO else 'NOT met'})")
    print(f"planned / unplanned latency, geometric mean: {geo:.3f}")
    print(f"BLAS: {blas}")
    out = {"runs": args.runs, "planner": args.planner, "blas": blas, "models": rows,
           "worst_best_ratio": worst, "latency_ratio_geomean": geo}
    pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, args.json)
    print(f"wrote {args.json}")
    return 0


def _print_table(rows) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    sys.exit(main())
