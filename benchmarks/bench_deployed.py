"""Deployed models: a QDQ ResNet-50 vs its float model, and an ORT-optimized BERT-base vs onnxruntime.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_deployed.py \\
        [--repeat 21] [--creates 7] [--threads 1 2] [--only resnet|bert] [--json PATH]

**QDQ ResNet-50.**  onnx's light resnet50 with real random weights (models/build.py), upgraded to
opset 13 and quantized by ``onnxruntime.quantization.quantize_static`` (QDQ, per channel, MinMax
over 4 seeded random images), both models saved by ``onnxpack optimize``.  Figures:

* warm create (the optimized model, packs mapped) of the QDQ model vs the float model: fresh
  processes, alternating, median of ``--creates`` (goal: within 1.1x);
* run latency, the two sessions called alternately in one fresh process (a busy machine slows
  both alike; a fresh heap, not the one the quantizer and optimize left), after a warm-up of at
  least 30 runs and 1 s of each (onnxpack picks its thread mode from its first runs), ``--repeat``
  rounds of a block of each (back-to-back runs for 0.25 s, those started 0.15 s or more into it
  counted), median (goal: within 1.1x); onnxruntime's figures, from another process, for context;
* the saved data file vs the QDQ model's own tensors (int8 weights, scales, int32 biases) plus
  its fp32 packs (goal: <= 1.1x): a weight stored twice would show here.

**BERT-base, ORT-optimized** (12 layers, hidden 768; ``models/make_transformers.py --shape
bert-base``, cached in ``~/.cache/onnxpack/models``): batch 1, sequence 128.  onnxpack's warm create
(optimized model) vs onnxruntime's create of the model it is given (fresh processes, alternating,
medians; goal <= 0.1x), run latency side by side in a fresh process, as above (goal <= 1.3x).

Threads: run latencies are measured for each ``--threads`` count (default 1 and 2), onnxpack's
BLAS threads and onnxruntime's intra-op threads set alike (threadpoolctl; onnxruntime spinning
off).  On the shared 2-core dev machine OpenBLAS's second thread stalls whenever the other core is
busy (bench_quant.py saw the same), so the one-thread figures are the stable ones there.  Results
go to ``benchmarks/results/deployed.json``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import BLAS_ENV, BENCH_DIR, ROOT, blas_info, build_native_cache, print_table, run_child, write_json  # noqa: E402

BERT_PATH = pathlib.Path(os.environ.get("ONNXPACK_MODELS_CACHE", pathlib.Path.home() / ".cache" / "onnxpack" / "models"))
BERT_MODEL = BERT_PATH / "bert-base-opt" / "model.onnx"
BERT_BUILD = "/work/side/bin/python models/make_transformers.py --shape bert-base"

# A fresh interpreter: imports first (not timed), then one session creation, timed.
_CREATE = """
import json, sys, time
which, path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
if which == "ort":
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    t0, c0 = time.perf_counter(), time.process_time()
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
else:
    import onnxpack
    t0, c0 = time.perf_counter(), time.process_time()
    s = onnxpack.InferenceSession(path)
t, c = time.perf_counter() - t0, time.process_time() - c0
extra = {} if which == "ort" else {"weights_packed": s.get_prepack_stats()["weights_packed"]}
print(json.dumps({"create_s": t, "create_cpu_s": c, **extra}))
"""


# A fresh interpreter runs sessions side by side: the parent's heap (the quantizer, optimize, the
# 400 MB BERT proto) would otherwise tax every fresh array the runs allocate.
_RUNS = """
import contextlib, json, sys
import numpy as np
spec = json.loads(sys.argv[1])
threads, repeat = spec["threads"], spec["repeat"]
feeds = {k: np.load(v) for k, v in spec["feeds"].items()}
try:
    from threadpoolctl import threadpool_limits
    limit = threadpool_limits(limits=threads)
except ImportError:
    limit = contextlib.nullcontext()
with limit:
    sessions = {}
    for label, (which, path) in spec["models"].items():
        if which == "ort":
            import onnxruntime as ort
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.log_severity_level = 3
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            if not spec.get("ort_optimize", True):
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            sessions[label] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        else:
            import onnxpack
            sessions[label] = onnxpack.InferenceSession(path)
    first = {label: [np.asarray(o).tolist() for o in s.run(None, feeds)][0] for label, s in sessions.items()}
    # bench_models' method: an interleaved warm-up, then per round a block of each session.
    import bench_models
    runners = {label: (lambda s=s: s.run(None, feeds)) for label, s in sessions.items()}
    bench_models.warm_up(runners, [s for label, s in sessions.items() if spec["models"][label][0] != "ort"])
    times = {label: [] for label in sessions}
    for _ in range(repeat):
        for label, run in runners.items():
            times[label].extend(bench_models.run_block(run))
print(json.dumps({"times": times, "first": first}))
"""


def run_side_by_side(models: dict[str, tuple[str, str]], feeds: dict, threads: int, repeat: int,
                     tmp: pathlib.Path) -> tuple[dict[str, list[float]], dict[str, np.ndarray]]:
    """Run latencies of ``models`` (label -> (which, path)) called alternately in a fresh process;
    returns the times and each model's first output."""
    import json

    paths = {}
    for name, value in feeds.items():
        paths[name] = str(tmp / f"feed-{len(paths)}.npy")
        np.save(paths[name], value)
    spec = {"threads": threads, "repeat": repeat, "feeds": paths, "models": models}
    r = run_child(_RUNS, json.dumps(spec), drop_env=BLAS_ENV, what=f"runs of {sorted(models)}")
    return r["times"], {k: np.asarray(v, np.float32) for k, v in r["first"].items()}


def creates(models: dict[str, tuple[str, str]], n: int, threads: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Fresh-process create times (wall, and CPU time of the creating process: less sensitive to
    other processes on a shared machine), the models' creates alternating; ``models``: label ->
    (which, path)."""
    wall: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(n):
        for label, (which, path) in models.items():
            r = run_child(_CREATE, which, path, threads, drop_env=BLAS_ENV, what=f"create {label}")
            assert r.get("weights_packed", 0) == 0, (label, r)  # warm: everything mapped
            wall[label].append(r["create_s"])
            cpu[label].append(r["create_cpu_s"])
    return wall, cpu


def _ort_session(path: str, threads: int, *, optimize: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


# -- QDQ ResNet-50 ----------------------------------------------------------------------------------
def build_resnet(folder: pathlib.Path) -> tuple[str, str, dict]:
    """Float and QDQ ResNet-50 in ``folder`` (opset 13, external data); returns paths and feeds."""
    import onnx
    import onnx.version_converter
    from onnxruntime import quantization

    sys.path.insert(0, str(ROOT / "tests"))
    import conftest  # noqa: F401  (importing it registers models/build.py as onnxpack_sample_models)
    import onnxpack_sample_models as sample_models

    light, model = sample_models.write_light_model("light_resnet50", folder / "light", expose_logits=False)
    feeds = sample_models.light_inputs(model)
    float_path, qdq_path = str(folder / "resnet50.onnx"), str(folder / "resnet50-qdq.onnx")
    onnx.save(onnx.version_converter.convert_version(onnx.load(light), 13), float_path,
              save_as_external_data=True, location="resnet50.onnx.data")

    class Reader(quantization.CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{k: np.random.default_rng(100 + i).standard_normal(v.shape).astype(np.float32)
                              for k, v in feeds.items()} for i in range(4)])

        def get_next(self):
            return next(self._it, None)

    quantization.quantize_static(float_path, qdq_path, Reader(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=True)
    return float_path, qdq_path, feeds


def bench_resnet(args, tmp: pathlib.Path) -> dict:
    from onnxpack.session import optimize

    t0 = time.perf_counter()
    float_src, qdq_src, feeds = build_resnet(tmp)
    print(f"built float + QDQ resnet50 in {time.perf_counter() - t0:.1f} s")
    saved = {}
    for label, src in (("float", float_src), ("qdq", qdq_src)):
        out = str(tmp / f"{label}.opt.onnx")
        result, program = optimize(src, out)
        blobs = {e.entry.key: e.entry.nbytes for e in program.pack_log if not e.spec.identity}
        saved[label] = {"path": out, "data_bytes": result.bytes_written, "tensor_bytes": result.tensor_bytes,
                        "blob_bytes": sum(blobs.values()), "packs": len(program.pack_log)}
    q = saved["qdq"]
    size_ratio = q["data_bytes"] / (q["tensor_bytes"] + q["blob_bytes"])

    create, create_cpu = creates({"float": ("onnxpack", saved["float"]["path"]),
                                  "qdq": ("onnxpack", saved["qdq"]["path"])}, args.creates, 1)
    cmed = {k: _med(v) for k, v in create.items()}
    ccpu = {k: _med(v) for k, v in create_cpu.items()}
    rows = [["resnet50", "warm create", "(CPU)", "data file", "tensors", "packs (non-identity)"]]
    for label in ("float", "qdq"):
        s = saved[label]
        rows.append([label, f"{cmed[label] * 1e3:.0f} ms", f"{ccpu[label] * 1e3:.0f} ms", _mb(s["data_bytes"]),
                     _mb(s["tensor_bytes"]), _mb(s["blob_bytes"])])
    print_table(rows)
    want = _ort_session(qdq_src, 1, optimize=False).run(None, feeds)[0]
    runs, med = {}, {}
    for threads in args.threads:
        # The goal's pair alone, side by side in a fresh process; onnxruntime's figures (context)
        # in another, so its threads and caches do not sit between the two calls compared.
        runs[threads], first = run_side_by_side(
            {"float": ("onnxpack", saved["float"]["path"]), "qdq": ("onnxpack", saved["qdq"]["path"])},
            feeds, threads, args.repeat, tmp)
        assert np.abs(first["qdq"] - want).max() <= 1.01 / 255, "QDQ outputs differ from onnxruntime's"
        theirs, _ = run_side_by_side({"ort float": ("ort", float_src), "ort qdq": ("ort", qdq_src)}, feeds, threads,
                                     args.repeat, tmp)
        runs[threads].update(theirs)
        med[threads] = {k: _med(v) for k, v in runs[threads].items()}
    print_table([["run (median)", *(f"{t} thread(s)" for t in args.threads)],
                 *[[label, *(f"{med[t][label] * 1e3:.0f} ms" for t in args.threads)]
                   for label in ("float", "qdq", "ort float", "ort qdq")]])
    ratios = {"create_qdq_over_float": cmed["qdq"] / cmed["float"],
              "create_cpu_qdq_over_float": ccpu["qdq"] / ccpu["float"], "data_over_tensors_plus_packs": size_ratio,
              "run_qdq_over_float": {t: med[t]["qdq"] / med[t]["float"] for t in args.threads}}
    run_text = ", ".join(f"{r:.2f}x ({t} thread(s))" for t, r in ratios["run_qdq_over_float"].items())
    print(f"QDQ / float: warm create {ratios['create_qdq_over_float']:.2f}x (CPU "
          f"{ratios['create_cpu_qdq_over_float']:.2f}x), run {run_text} (goals <= 1.1x); "
          f"QDQ data file / (its tensors + fp32 packs) {size_ratio:.3f} (goal <= 1.1)")
    return {"saved": {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in saved.items()},
            "create_s": create, "create_cpu_s": create_cpu, "run_s": runs, "create_median_s": cmed,
            "create_cpu_median_s": ccpu, "run_median_s": med, "ratios": ratios}


# -- BERT-base --------------------------------------------------------------------------------------
def bench_bert(args, tmp: pathlib.Path) -> dict | None:
    from onnxpack.session import optimize

    if not BERT_MODEL.exists():
        print(f"BERT-base not built: {BERT_MODEL} missing; build it with {BERT_BUILD}")
        return None
    out = str(tmp / "bert-base.opt.onnx")
    t0 = time.perf_counter()
    optimize(str(BERT_MODEL), out)
    print(f"optimized BERT-base in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 30522, (1, 128)).astype(np.int64),
             "attention_mask": np.ones((1, 128), np.int64), "token_type_ids": np.zeros((1, 128), np.int64)}
    create, create_cpu = creates({"ort": ("ort", str(BERT_MODEL)), "onnxpack warm": ("onnxpack", out)},
                                 args.creates, max(args.threads))
    cmed = {k: _med(v) for k, v in create.items()}
    runs, med = {}, {}
    for threads in args.threads:
        runs[threads], first = run_side_by_side({"onnxpack": ("onnxpack", out), "ort": ("ort", str(BERT_MODEL))},
                                                feeds, threads, args.repeat, tmp)
        np.testing.assert_allclose(first["onnxpack"], first["ort"], rtol=1e-3, atol=1e-3)
        med[threads] = {k: _med(v) for k, v in runs[threads].items()}
    print_table([["bert-base (1 x 128)", "create", *(f"run, {t} thread(s)" for t in args.threads)],
                 ["onnxruntime", f"{cmed['ort'] * 1e3:.0f} ms", *(f"{med[t]['ort'] * 1e3:.0f} ms" for t in args.threads)],
                 ["onnxpack (warm)", f"{cmed['onnxpack warm'] * 1e3:.0f} ms",
                  *(f"{med[t]['onnxpack'] * 1e3:.0f} ms" for t in args.threads)]])
    ratios = {"create_over_ort": cmed["onnxpack warm"] / cmed["ort"],
              "run_over_ort": {t: med[t]["onnxpack"] / med[t]["ort"] for t in args.threads}}
    run_text = ", ".join(f"{r:.2f}x ({t} thread(s))" for t, r in ratios["run_over_ort"].items())
    print(f"onnxpack / onnxruntime: warm create {ratios['create_over_ort']:.3f}x (goal <= 0.1x), "
          f"run {run_text} (goal <= 1.3x)")
    return {"create_s": create, "create_cpu_s": create_cpu, "run_s": runs, "create_median_s": cmed,
            "run_median_s": med, "ratios": ratios}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=21, help="timed runs per session (median)")
    p.add_argument("--creates", type=int, default=7, help="fresh-process creates per model (median)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="run latency thread counts")
    p.add_argument("--only", choices=["resnet", "bert"])
    p.add_argument("--json", default=str(BENCH_DIR / "results" / "deployed.json"))
    args = p.parse_args(argv)
    if any(k in os.environ for k in BLAS_ENV):
        print(f"note: {', '.join(k for k in BLAS_ENV if k in os.environ)} set: numpy's GEMM is slowed; "
              "run with env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE")
    build_native_cache()
    results: dict = {"blas": blas_info(), "threads": args.threads, "repeat": args.repeat, "creates": args.creates}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "resnet"):
            results["resnet50_qdq"] = bench_resnet(args, pathlib.Path(tmp))
        if args.only in (None, "bert"):
            results["bert_base"] = bench_bert(args, pathlib.Path(tmp))
    write_json(args.json, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
