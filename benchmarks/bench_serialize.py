"""Saved pre-packed blobs: cold (packing) vs warm (mapped) session starts, against onnxruntime.

Run::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_serialize.py [--repeats 5]

Models (benchmarks/_models.py, generated into benchmarks/work/serialize/): the 100.7 MB fp32
6x2048^2 MatMul chain, the ~103 MB fp16 MLP and the 4-bit MatMulNBits chain.  For each, in one
run and in fresh processes (median of --repeats):

* onnxpack cold: the original model, every weight packed at create;
* onnxpack warm: the model optimized with ``save_external_prepacked_constant_initializers=1``,
  every blob mapped;
* onnxruntime without / with its own saved prepack file (its optimized model written with the
  same flag), create time and memory, same processes protocol;
* PSS of 4 onnxpack processes alive at once (warm and cold).

Memory: RssAnon growth over create (after-create minus before-create: the interpreter and
numpy are not the model's), RssFile and Pss after create and after one run.  Ratios checked
against the issue's targets are printed and stored in benchmarks/results/serialize.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _models  # noqa: E402
from _common import blas_info, print_table, proc_memory, run_json, write_json  # noqa: E402

from onnxpack.cli._measure import measure  # noqa: E402
from onnxpack.cli import optimize_model  # noqa: E402

WORK = HERE / "work" / "serialize"
RESULTS = HERE / "results" / "serialize.json"
_MB = 1 << 20


def _ort_worker(model: str, feeds_path: str) -> None:
    import onnxruntime as ort

    before = proc_memory()
    t0 = time.perf_counter()
    s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    create = time.perf_counter() - t0
    after = proc_memory()
    s.run(None, dict(np.load(feeds_path)))
    after_run = proc_memory()
    print(json.dumps({"create_s": create, "before": before, "after_create": after,
                      "after_run": after_run}), flush=True)


def _ort_measure(model: str, feeds_path: str, repeats: int) -> dict:
    res = [run_json([sys.executable, __file__, "--ort-worker", model, feeds_path], what=model)
           for _ in range(repeats)]

    def med(f):
        return statistics.median(f(x) for x in res)

    return {
        "create_ms": med(lambda x: x["create_s"] * 1e3),
        "anon_growth_mb": med(lambda x: (x["after_create"]["RssAnon"] - x["before"]["RssAnon"]) / _MB),
        "rss_file_mb": med(lambda x: x["after_create"]["RssFile"] / _MB),
        "pss_mb": med(lambda x: x["after_create"].get("Pss", -_MB) / _MB),
        "rss_anon_run_mb": med(lambda x: x["after_run"]["RssAnon"] / _MB),
        "rss_file_run_mb": med(lambda x: x["after_run"]["RssFile"] / _MB),
    }


def _ort_optimized(src: str, out: str) -> str:
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.optimized_model_filepath = out
    o.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    o.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                               os.path.basename(out) + ".data")
    o.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(src, o, providers=["CPUExecutionProvider"])
    return out


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def run(repeats: int, processes: int, only: list[str] | None) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    gens = {"matmul_fp32": _models.make_matmul_model, "mlp_fp16": _models.make_fp16_mlp,
            "matmulnbits_int4": _models.make_int4_model}
    report = {"repeats": repeats, "processes": processes, "python": sys.version.split()[0],
              "machine": platform.machine(), "cpus": os.cpu_count(), "blas": blas_info(), "models": {}}
    for name, gen in gens.items():
        if only and name not in only:
            continue
        folder = WORK / name
        folder.mkdir(exist_ok=True)
        src = str(folder / f"{name}.onnx")
        if not os.path.exists(src):
            print(f"[{name}] generating ...", flush=True)
            gen(src)
        weight_bytes = sum(os.path.getsize(folder / f) for f in os.listdir(folder)
                           if f == f"{name}.onnx.data")
        opt = str(folder / f"{name}.opt.onnx")
        print(f"[{name}] onnxpack optimize ...", flush=True)
        figures = optimize_model(src, opt, progress=False)
        ort_opt = _ort_optimized(src, str(folder / f"{name}.ort.onnx"))
        feeds = _models.feeds_for(src)
        with tempfile.TemporaryDirectory() as tmp:
            for sub in ("cold", "warm"):
                os.makedirs(os.path.join(tmp, sub))
            feeds_path = os.path.join(tmp, "feeds.npz")
            np.savez(feeds_path, **feeds)
            print(f"[{name}] measuring ...", flush=True)
            cold = measure(src, feeds, os.path.join(tmp, "cold"), repeats=repeats, processes=processes)
            warm = measure(opt, feeds, os.path.join(tmp, "warm"), repeats=repeats, processes=processes)
            ort_plain = _ort_measure(src, feeds_path, repeats)
            ort_saved = _ort_measure(ort_opt, feeds_path, repeats)
        equal = all(np.array_equal(a, b) for a, b in zip(cold["outputs"], warm["outputs"]))
        for r in (cold, warm):
            r.pop("outputs")
        ratios = {
            "warm_over_ort_saved_create": warm["create_ms"] / ort_saved["create_ms"],
            "cold_over_warm_create": cold["create_ms"] / warm["create_ms"],
            "warm_anon_growth_over_weight_bytes": warm["anon_growth_mb"] * 2**20 / weight_bytes,
            # Both sides after one run (the processes alive together have run once).
            "warm_pss_total_over_one": (warm["pss_total_mb"] / warm["pss_run_mb"]) if warm["pss_total_mb"] else None,
            "warm_pss_growth_total_over_one": (warm["pss_growth_total_mb"] / warm["pss_run_growth_mb"])
            if warm["pss_growth_total_mb"] and warm["pss_run_growth_mb"] > 0 else None,
        }
        report["models"][name] = {"weight_bytes": weight_bytes, "optimize": figures,
                                  "onnxpack_cold": cold, "onnxpack_warm": warm,
                                  "ort_without_saved_prepack": ort_plain,
                                  "ort_with_saved_prepack": ort_saved,
                                  "warm_outputs_equal_cold": equal, "ratios": ratios}
    return report


def print_report(report: dict) -> None:
    p = report["processes"]
    head = ["model", "session", "create ms", "packed", "mapped", "anon+ MB", "RssFile MB", "PSS MB",
            "anon run MB", "file run MB", f"PSS x{p} MB", f"PSS+ x{p}/1"]
    rows = [head]
    for name, m in report["models"].items():
        for label, key in (("onnxpack cold", "onnxpack_cold"), ("onnxpack warm", "onnxpack_warm"),
                           ("ort", "ort_without_saved_prepack"), ("ort + saved prepack", "ort_with_saved_prepack")):
            r = m[key]
            growth_ratio = (r["pss_growth_total_mb"] / r["pss_run_growth_mb"]
                            if r.get("pss_growth_total_mb") and r.get("pss_run_growth_mb", 0) > 0 else None)
            rows.append([name, label, _fmt(r["create_ms"]), str(r.get("packed", "-")), str(r.get("mapped", "-")),
                         _fmt(r["anon_growth_mb"]), _fmt(r["rss_file_mb"]), _fmt(r["pss_mb"]),
                         _fmt(r["rss_anon_run_mb"]), _fmt(r["rss_file_run_mb"]),
                         _fmt(r.get("pss_total_mb")), _fmt(growth_ratio, ".2f")])
    print_table(rows, left=2)
    print()
    print("targets: warm/ort-saved create <= 0.5; cold/warm >= 20 (fp16, int4); "
          "warm RssAnon growth <= 5% of weight bytes; PSS of 4 <= 1.3x one")
    for name, m in report["models"].items():
        r = m["ratios"]
        print(f"  {name:18s} warm/ort-saved {r['warm_over_ort_saved_create']:.2f}  "
              f"cold/warm {r['cold_over_warm_create']:.1f}x  "
              f"anon/weights {100 * r['warm_anon_growth_over_weight_bytes']:.2f}%  "
              f"PSS total/one {_fmt(r['warm_pss_total_over_one'], '.2f')} "
              f"(model-attributable {_fmt(r['warm_pss_growth_total_over_one'], '.2f')})  "
              f"outputs equal {m['warm_outputs_equal_cold']}")
    print(f"BLAS: {report['blas']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ort-worker"]:
        _ort_worker(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--only", nargs="*", default=None, help="matmul_fp32 mlp_fp16 matmulnbits_int4")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    report = run(args.repeats, args.processes, args.only)
    print_report(report)
    if not args.no_save:
        write_json(RESULTS, report, default=float)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
