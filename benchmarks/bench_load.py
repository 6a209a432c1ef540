"""Benchmark: load_model time and RSS growth for 64 MB and 1 GB models, and the align threshold.

Usage::

    python benchmarks/bench_load.py [--dir DIR] [--runs 7] [--sizes 64M,1G] [--json PATH]

Each measurement runs in a fresh subprocess (imports done before the clock starts) so RSS and
Python state are honest; the page cache is left as it is (nothing is dropped).  Models are
MatMul chains of 16 layers, so the 64 MB and 1 GB models have the same graph and differ only in
weight bytes: a load that is O(graph) gives a ratio near 1.

Targets (issue 2): both loads <= 50 ms, ratio 1 GB / 64 MB <= 1.5, RSS growth <= 5% of weights.

``--align`` (always included) computes, for a sweep of tensor sizes, what page-aligning costs
(padding, % of file) and saves (pages spanned when one tensor is read alone), over layouts made
by ``compute_offset``: the evidence for ``DEFAULT_ALIGN_THRESHOLD``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import statistics
import sys
import tempfile
import textwrap

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _models  # noqa: E402
from _common import ROOT, blas_info, run_child, write_json  # noqa: E402

N_LAYERS = 16
SIZES = {"64M": 64 << 20, "1G": 1 << 30}

_CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy, onnx
    from onnxpack.graph import load_model
    from _common import proc_memory

    before = proc_memory()
    t0 = time.perf_counter()
    model = load_model(sys.argv[1])
    t1 = time.perf_counter()
    after = proc_memory()
    n = sum(len(s.initializers) for s in model.scopes())
    print(json.dumps({"seconds": t1 - t0, "before": before, "after": after, "tensors": n}))
""")


def _measure(path: str, runs: int) -> dict:
    samples = []
    for _ in range(runs):
        samples.append(run_child(_CHILD, path, what=path))
    secs = [s["seconds"] for s in samples]
    rss = [s["after"]["VmRSS"] - s["before"]["VmRSS"] for s in samples]
    anon = [s["after"].get("RssAnon", 0) - s["before"].get("RssAnon", 0) for s in samples]
    return {"median_ms": statistics.median(secs) * 1e3, "min_ms": min(secs) * 1e3,
            "runs_ms": [round(s * 1e3, 3) for s in secs],
            "rss_growth_bytes": statistics.median(rss), "rss_anon_growth_bytes": statistics.median(anon),
            "tensors": samples[0]["tensors"]}


def align_study(granularity: int = mmap.ALLOCATIONGRANULARITY) -> list[dict]:
    """Padding cost vs pages saved of page-aligning tensors of one size, in a realistic layout
    where each weight is followed by a small (bias-like, 1 KiB) tensor."""
    from onnxpack.graph import compute_offset

    rows = []
    for size in [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]:
        result = {}
        for label, threshold in (("packed", 1 << 62), ("aligned", 0)):
            end = 0
            spans = []
            for _ in range(64):
                for n in (size, 1000):  # weight, then a bias that keeps offsets unaligned
                    start = compute_offset(end, n, align_threshold=threshold if n == size else 1 << 62,
                                           allocation_granularity=granularity)
                    if n == size:
                        spans.append((start + n - 1) // granularity - start // granularity + 1)
                    end = start + n
            result[label] = (end, statistics.mean(spans))
        (p_end, p_pages), (a_end, a_pages) = result["packed"], result["aligned"]
        rows.append({"tensor_bytes": size,
                     "padding_pct_of_file": round(100 * (a_end - p_end) / p_end, 2),
                     "pages_spanned_packed": round(p_pages, 3),
                     "pages_spanned_aligned": round(a_pages, 3),
                     "pages_saved_pct": round(100 * (p_pages - a_pages) / p_pages, 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="where to generate models (kept); default: a temp dir (removed)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--sizes", default="64M,1G")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "load.json"))
    args = ap.parse_args(argv)
    build = _models.sample_models()
    tmp = None
    folder = args.dir
    if folder is None:
        tmp = tempfile.TemporaryDirectory(prefix="onnxpack-bench-")
        folder = tmp.name
    os.makedirs(folder, exist_ok=True)
    results = {"n_layers": N_LAYERS, "runs": args.runs, "blas": blas_info(), "models": {}}
    try:
        for label in args.sizes.split(","):
            total = SIZES[label]
            dim = int((total / N_LAYERS / 4) ** 0.5)
            path = os.path.join(folder, f"chain_{label}.onnx")
            if not os.path.exists(path):
                weight_bytes = build.make_matmul_chain(path, N_LAYERS, dim)
            else:
                weight_bytes = N_LAYERS * dim * dim * 4
            r = _measure(path, args.runs)
            r.update(weight_bytes=weight_bytes, dim=dim,
                     rss_growth_pct_of_weights=round(100 * r["rss_growth_bytes"] / weight_bytes, 4))
            results["models"][label] = r
    finally:
        if tmp is not None:
            tmp.cleanup()
    models = results["models"]
    if "64M" in models and "1G" in models:
        results["ratio_1G_over_64M"] = round(models["1G"]["median_ms"] / models["64M"]["median_ms"], 3)
    results["align"] = align_study()
    print(f"{'model':6} {'weights':>12} {'median ms':>10} {'min ms':>8} {'RSS growth':>12} {'% of w':>8}")
    for label, r in models.items():
        print(f"{label:6} {r['weight_bytes']:>12} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} "
              f"{r['rss_growth_bytes']:>12} {r['rss_growth_pct_of_weights']:>8.3f}")
    if "ratio_1G_over_64M" in results:
        print(f"ratio 1G/64M: {results['ratio_1G_over_64M']}")
    print(f"\n{'tensor':>9} {'padding %':>10} {'pages packed':>13} {'pages aligned':>14} {'saved %':>8}")
    for row in results["align"]:
        print(f"{row['tensor_bytes']:>9} {row['padding_pct_of_file']:>10} "
              f"{row['pages_spanned_packed']:>13} {row['pages_spanned_aligned']:>14} "
              f"{row['pages_saved_pct']:>8}")
    write_json(args.json, results, indent=2)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
