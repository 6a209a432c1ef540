"""Run latency, side by side in one process: onnxpack vs onnx.reference vs onnxruntime.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_run.py \
        [--runs 7] [--ref-runs 3] [--profile] [--json benchmarks/results/run.json]

Models (weights random, seeded; generated into ``benchmarks/work/``, git-ignored):

* ``resnet50``: onnx's ``light_resnet50.onnx`` with its ConstantOfShape weights replaced by real
  random initializers (``materialize_light_model`` in models/build.py),
  batch 1, 224x224;
* ``transformer-small``: models/transformer.onnx (seq 8, d 64: executor overhead dominates);
* ``transformer``: one pre-LN encoder block, seq 128, d 512, 8 heads, ff 2048, batch 1;
* ``mlp``: batch 64, 1024 -> 4096 -> 4096 -> 1024 (MatMul + Add + Relu): BLAS-bound.

Runs are interleaved (one run of each runtime per round) so load from other processes hits all
three alike; each figure is the median over rounds after one warm-up run.  onnx.reference takes
~1 s per resnet50 run, so it gets ``--ref-runs`` rounds.  numpy's own GEMM rate and the BLAS
library in use (threadpoolctl) are reported beside the table: onnxpack cannot beat the BLAS it
calls, and onnxruntime uses its own MLAS kernels.

Targets (issue 3): resnet50 >= 20x faster than onnx.reference and <= 2x onnxruntime's latency;
mlp <= 1.3x onnxruntime.  When a target is missed (or with ``--profile``) the onnxpack resnet50
run is profiled: time per op type (kernel ``run`` calls timed by a wrapper), the executor's
own overhead (wall time minus kernel time), and cProfile's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import platform
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's onnxpack, whatever the editable install resolves to
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import onnxpack  # noqa: E402
import _models  # noqa: E402
from _common import blas_info, median_seconds, write_json  # noqa: E402

WORK = ROOT / "benchmarks" / "work"
RESULTS = ROOT / "benchmarks" / "results" / "run.json"
TARGETS = {  # model -> (max onnxpack/onnxruntime latency ratio, min onnx.reference/onnxpack)
    "resnet50": (2.0, 20.0),
    "mlp": (1.3, None),
}


# -- models ---------------------------------------------------------------------------------------
def _save(model: onnx.ModelProto, path: Path) -> str:
    tmp = path.with_suffix(".tmp")
    onnx.save_model(model, str(tmp), save_as_external_data=True, location=path.name + ".data",
                    size_threshold=1024)
    os.replace(tmp, path)
    return str(path)


def make_resnet50() -> tuple[str, dict[str, np.ndarray]]:
    build = _models.sample_models()
    path, model = build.write_light_model("light_resnet50", WORK, seed=0, expose_logits=False)
    return path, build.light_inputs(model)


def make_mlp(batch: int = 64, dims=(1024, 4096, 4096, 1024)) -> tuple[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for k, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        inits.append(numpy_helper.from_array(rng.standard_normal((a, b), dtype=np.float32) / np.float32(math.sqrt(a)), f"W{k}"))
        inits.append(numpy_helper.from_array(rng.standard_normal(b, dtype=np.float32) * np.float32(0.1), f"b{k}"))
        out = "y" if k == len(dims) - 2 else f"h{k}"
        nodes += [helper.make_node("MatMul", [prev, f"W{k}"], [f"m{k}"]),
                  helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"])]
        nodes.append(helper.make_node("Relu", [f"a{k}"], [out]) if out != "y" else
                     helper.make_node("Identity", [f"a{k}"], [out]))
        prev = out
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, dims[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, dims[-1]])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return _save(m, WORK / "mlp_b64.onnx"), {"x": rng.standard_normal((batch, dims[0]), dtype=np.float32)}


def make_transformer(s: int = 128, d: int = 512, h: int = 8, ff: int = 2048) -> tuple[str, dict[str, np.ndarray]]:
    """One pre-LN encoder block (LayerNorm, MHA, residual, LayerNorm, GELU FFN, residual)."""
    m = _models.transformer_block(s, d, h, ff, seed=0)
    rng = np.random.default_rng(0)
    return _save(m, WORK / f"transformer_s{s}_d{d}.onnx"), {"x": rng.standard_normal((1, s, d), dtype=np.float32)}


def make_small_transformer() -> tuple[str, dict[str, np.ndarray]]:
    path = ROOT / "models" / "transformer.onnx"
    return str(path), {"x": np.random.default_rng(0).standard_normal((1, 8, 64), dtype=np.float32)}


MODELS = {
    "resnet50": make_resnet50,
    "transformer-small": make_small_transformer,
    "transformer": make_transformer,
    "mlp": make_mlp,
}


# -- measuring ----------------------------------------------------------------------------------
def gemm_gflops(m: int, k: int, n: int, repeat: int = 9) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    out = np.empty((m, n), np.float32)
    return 2 * m * k * n / median_seconds(lambda: np.matmul(a, b, out=out), repeat) / 1e9


def bench_model(name: str, runs: int, ref_runs: int, threads: int = 0) -> dict:
    path, feeds = MODELS[name]()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads  # 0 = onnxruntime's default (one per core)
    # Runs are interleaved in one process: onnxruntime's worker threads would otherwise spin on
    # both cores after each of its runs and slow whichever runtime goes next.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    runners = {
        "onnxpack": onnxpack.InferenceSession(path).run,
        "onnxruntime": ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run,
        "onnx.reference": ReferenceEvaluator(path).run,
    }
    outs = {k: fn(None, feeds) for k, fn in runners.items()}  # warm-up + agreement check
    max_err = {k: float(max(np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in zip(outs[k], outs["onnxruntime"])))
               for k in ("onnxpack", "onnx.reference")}
    times: dict[str, list[float]] = defaultdict(list)
    for r in range(max(runs, ref_runs)):
        for k, fn in runners.items():
            if k == "onnx.reference" and r >= ref_runs:
                continue
            t0 = time.perf_counter()
            fn(None, feeds)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "model": name, "path": os.path.relpath(path, ROOT), "inputs": {k: list(v.shape) for k, v in feeds.items()},
        "median_ms": med, "runs": {k: len(v) for k, v in times.items()},
        "all_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
        "onnxpack_vs_onnxruntime": med["onnxpack"] / med["onnxruntime"],
        "reference_vs_onnxpack": med["onnx.reference"] / med["onnxpack"],
        "max_abs_diff_vs_onnxruntime": max_err,
    }


def profile_resnet50(runs: int = 5) -> dict:
    """Where onnxpack's resnet50 time goes: per op type, executor overhead, cProfile top."""
    path, feeds = make_resnet50()
    sess = onnxpack.InferenceSession(path)
    plan = sess.program.root
    per_op: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    originals = []
    for step in plan.steps:
        kernel, op = step.kernel, step.node.op_type
        orig = kernel.run
        originals.append((kernel, orig))

        def timed(*a, _orig=orig, _op=op, **kw):
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                per_op[_op] += time.perf_counter() - t0
                calls[_op] += 1

        kernel.run = timed
    sess.run(None, feeds)
    per_op.clear()
    calls.clear()
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        walls.append(time.perf_counter() - t0)
    for kernel, orig in originals:
        kernel.run = orig
    wall = sum(walls) / runs
    kernels = sum(per_op.values()) / runs
    conv_flops = _conv_flops(path)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        sess.run(None, feeds)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return {
        "wall_ms": wall * 1e3, "kernel_ms": kernels * 1e3, "executor_overhead_ms": (wall - kernels) * 1e3,
        "steps": len(plan.steps), "conv_gflop": conv_flops / 1e9,
        "conv_gflops_achieved": conv_flops / 1e9 / (per_op["Conv"] / runs) if per_op.get("Conv") else None,
        "per_op_ms": {k: round(v / runs * 1e3, 3) for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])},
        "calls_per_run": {k: v // runs for k, v in calls.items()},
        "fallback_nodes": sess.get_fallback_nodes(),
        "cprofile_top_tottime": lines[:30],
    }


def _print_table(rows: list[dict], runs: int, ref_runs: int) -> list[str]:
    header = (f"{'model':18s} {'onnxpack ms':>12s} {'onnxruntime ms':>15s} {'reference ms':>13s} "
              f"{'vs ORT':>8s} {'ref/ours':>9s}  target")
    print(header)
    print("-" * len(header))
    missed = []
    for r in rows:
        m = r["median_ms"]
        target = TARGETS.get(r["model"])
        verdict = ""
        if target:
            ok_ort = r["onnxpack_vs_onnxruntime"] <= target[0]
            ok_ref = target[1] is None or r["reference_vs_onnxpack"] >= target[1]
            verdict = f"<= {target[0]}x ORT {'ok' if ok_ort else 'MISSED'}"
            if target[1] is not None:
                verdict += f"; >= {target[1]:.0f}x ref {'ok' if ok_ref else 'MISSED'}"
            if not (ok_ort and ok_ref):
                missed.append(r["model"])
        print(f"{r['model']:18s} {m['onnxpack']:12.2f} {m['onnxruntime']:15.2f} {m['onnx.reference']:13.1f} "
              f"{r['onnxpack_vs_onnxruntime']:7.2f}x {r['reference_vs_onnxpack']:8.1f}x  {verdict}")
    print(f"(medians; {runs} rounds, onnx.reference {ref_runs} on resnet50)")
    return missed


def _conv_flops(path: str) -> float:
    """2 * multiply-adds of every Conv (shapes from ONNX shape inference)."""
    m = onnx.shape_inference.infer_shapes(onnx.load(path, load_external_data=False))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(m.graph.value_info) + list(m.graph.output) + list(m.graph.input)}
    dims = {t.name: list(t.dims) for t in m.graph.initializer}
    total = 0.0
    for n in m.graph.node:
        if n.op_type == "Conv" and n.output[0] in shapes and n.input[1] in dims:
            w, out = dims[n.input[1]], shapes[n.output[0]]
            total += 2.0 * math.prod(out) * math.prod(w[1:])
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="timed rounds per model (default 7, >= 5)")
    ap.add_argument("--ref-runs", type=int, default=3, help="rounds for onnx.reference on resnet50 (default 3)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--threads", default="0,1",
                    help="comma-separated thread settings for numpy's BLAS and onnxruntime, one table "
                         "each (0 = each library's default, one per core; 1 gives stable figures on "
                         "a busy machine, where spinning BLAS threads stall).  Default: 0,1")
    ap.add_argument("--profile", action="store_true", help="always profile onnxpack on resnet50")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    import threadpoolctl

    WORK.mkdir(parents=True, exist_ok=True)
    env = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    machine = {
        "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "numpy": np.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__,
        "onnxpack": onnxpack.__version__, "load_average_start": os.getloadavg(), "env": env, "blas": blas_info(),
    }
    print(f"numpy {np.__version__}, onnxruntime {ort.__version__}, {os.cpu_count()} CPUs, load average "
          + " ".join(f"{x:.2f}" for x in machine["load_average_start"]))
    for b in machine["blas"]:
        print("BLAS:", ", ".join(f"{k}={v}" for k, v in b.items()))
    result: dict = {"machine": machine, "targets": {k: list(v) for k, v in TARGETS.items()}, "settings": []}
    missed_any = False
    for threads in (int(t) for t in args.threads.split(",")):
        with threadpoolctl.threadpool_limits(threads or None):
            gemm = {"1024x1024x1024": gemm_gflops(1024, 1024, 1024), "64x4096x4096": gemm_gflops(64, 4096, 4096),
                    # resnet50's conv GEMMs at batch 1: a conv2_x 3x3 and a conv4_x 3x3
                    "64x576x3136": gemm_gflops(64, 576, 3136), "256x2304x196": gemm_gflops(256, 2304, 196)}
            print(f"\n== threads: {threads or 'default (one per core)'}; numpy sgemm GFLOP/s: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in gemm.items()))
            rows = [bench_model(name, args.runs, args.ref_runs if name == "resnet50" else args.runs, threads)
                    for name in args.models.split(",")]
            missed = _print_table(rows, args.runs, args.ref_runs)
            missed_any |= bool(missed)
            result["settings"].append({"threads": threads or "default", "numpy_gemm_gflops": gemm,
                                       "load_average": os.getloadavg(), "rows": rows, "missed": missed})
    if missed_any or args.profile:
        with threadpoolctl.threadpool_limits(1):
            prof = profile_resnet50()
        result["resnet50_profile_1_thread"] = prof
        print(f"\nonnxpack resnet50 profile (1 thread): wall {prof['wall_ms']:.1f} ms = kernels "
              f"{prof['kernel_ms']:.1f} ms + executor overhead {prof['executor_overhead_ms']:.1f} ms "
              f"over {prof['steps']} steps; Conv: {prof['conv_gflop']:.2f} GFLOP at "
              f"{prof['conv_gflops_achieved']:.0f} GFLOP/s")
        for op, ms in prof["per_op_ms"].items():
            print(f"  {op:20s} {ms:8.2f} ms  ({prof['calls_per_run'][op]} calls)")
        if prof["fallback_nodes"]:
            print("  fallback nodes:", prof["fallback_nodes"])
        print("  cProfile, top functions by own time (3 runs):")
        for ln in prof["cprofile_top_tottime"][4:20]:
            print("   ", ln)
    out = write_json(args.json, result)
    print(f"\nwrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
