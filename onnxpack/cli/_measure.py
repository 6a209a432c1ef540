"""Cold (packing) vs warm (mapped) session starts, measured in fresh processes.

Every measured session is created in a fresh Python process (``python -c`` running
:func:`_worker_main`), so create time includes nothing cached in this process and memory figures
are that process's own: ``RssAnon`` (private heap: what packing costs), ``RssFile`` (mapped file
pages: what mapping costs, shared through the page cache) and ``Pss`` (proportional set size:
shared pages divided among the processes mapping them).  With ``processes > 1`` the workers are
alive at the same time when they read their PSS, so the total shows whether they share.
``onnxpack demo`` and ``onnxpack bench`` print :func:`compare`'s table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from onnxpack.cli._common import random_inputs
from onnxpack.errors import InvalidArgument

__all__ = ["feeds_for", "measure", "format_table", "compare"]

# The worker prints one JSON line starting with this tag (anything else on stdout is ignored).
_TAG = "ONNXPACK-MEASURE "


def feeds_for(model_path: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random inputs from the model's declared inputs (symbolic dims -> 1)."""
    from onnxpack.graph import load_model
    from onnxpack.session import model_inputs

    with load_model(model_path) as model:
        return random_inputs(model_inputs(model), seed=seed)


def _memory() -> dict[str, int]:
    """RssAnon/RssFile (kB, /proc/self/status) and Pss (kB, /proc/self/smaps_rollup); Linux only."""
    out = {"rss_anon_kb": -1, "rss_file_kb": -1, "pss_kb": -1}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    out["rss_anon_kb"] = int(line.split()[1])
                elif line.startswith("RssFile:"):
                    out["rss_file_kb"] = int(line.split()[1])
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    out["pss_kb"] = int(line.split()[1])
    except OSError:
        pass
    return out


def _worker_main() -> None:
    """Child process: create ``sessions`` sessions of a model, run once, report, wait, report PSS.

    argv: model feeds.npz out.npz sessions wait(0|1)
    """
    model, feeds_path, out_path, n_sessions, wait = sys.argv[1:6]
    before = _memory()
    t0 = time.perf_counter()
    # Import time is not create time (as for onnxruntime, imported before its sessions).
    from onnxpack.session import InferenceSession

    t_import = time.perf_counter() - t0
    before = _memory()
    sessions, times = [], []
    for _ in range(int(n_sessions)):
        t0 = time.perf_counter()
        sessions.append(InferenceSession(model))
        times.append(time.perf_counter() - t0)
    after_create = _memory()
    feeds = dict(np.load(feeds_path))
    outputs = sessions[0].run(None, feeds)
    after_run = _memory()
    np.savez(out_path, *outputs)
    stats = sessions[0].get_prepack_stats()
    result = {"create_s": times, "import_s": t_import, "before": before, "after_create": after_create,
              "after_run": after_run, "stats": stats}
    print(_TAG + json.dumps(result), flush=True)
    if wait == "1":  # stay alive until the parent has every worker up, then report PSS
        sys.stdin.readline()
        print(_TAG + json.dumps({"all_alive": _memory()}), flush=True)


def _spawn(model: str, feeds_path: str, out_path: str, sessions: int, wait: bool) -> subprocess.Popen:
    code = "from onnxpack.cli._measure import _worker_main; _worker_main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, model, feeds_path, out_path, str(sessions), "1" if wait else "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _read_result(proc: subprocess.Popen) -> dict[str, Any]:
    while True:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read()
            raise InvalidArgument(f"measuring process failed (exit {proc.wait()}): {err.strip()[-2000:]}")
        if line.startswith(_TAG):
            return json.loads(line[len(_TAG):])


def measure(model: str, feeds: dict[str, np.ndarray], workdir: str, *, repeats: int = 1,
            sessions: int = 1, processes: int = 1) -> dict[str, Any]:
    """Create-time/memory figures of ``model`` from fresh processes.

    ``repeats`` sequential single processes give the median create time and memory; then, if
    ``processes > 1``, that many processes alive together give the total PSS.  Returns a dict
    with ``create_ms`` (median of each process's first session), ``packed``/``mapped`` counts,
    memory in MB (``anon_growth`` = RssAnon after create minus before create), ``outputs``
    (the first run's outputs) and ``pss_total_mb``.
    """
    feeds_path = os.path.join(workdir, "feeds.npz")
    np.savez(feeds_path, **feeds)
    results = []
    for r in range(max(1, repeats)):
        out_path = os.path.join(workdir, f"out{r}.npz")
        proc = _spawn(model, feeds_path, out_path, sessions, wait=False)
        results.append(_read_result(proc))
        proc.wait()
    with np.load(os.path.join(workdir, "out0.npz")) as z:
        outputs = [z[f"arr_{i}"] for i in range(len(z.files))]

    def med(f) -> float:
        return statistics.median(f(x) for x in results)

    mb = 1 / 1024
    row = {
        "create_ms": med(lambda x: x["create_s"][0] * 1e3),
        "create_all_ms": med(lambda x: sum(x["create_s"]) * 1e3),
        "packed": results[0]["stats"]["weights_packed"],
        "mapped": results[0]["stats"]["blobs_from_model"] + results[0]["stats"]["blobs_from_cache"],
        "rejected": results[0]["stats"]["blobs_rejected"],
        "anon_growth_mb": med(lambda x: (x["after_create"]["rss_anon_kb"] - x["before"]["rss_anon_kb"]) * mb),
        "rss_anon_mb": med(lambda x: x["after_create"]["rss_anon_kb"] * mb),
        "rss_file_mb": med(lambda x: x["after_create"]["rss_file_kb"] * mb),
        "pss_mb": med(lambda x: x["after_create"]["pss_kb"] * mb),
        "rss_anon_run_mb": med(lambda x: x["after_run"]["rss_anon_kb"] * mb),
        "rss_file_run_mb": med(lambda x: x["after_run"]["rss_file_kb"] * mb),
        "outputs": outputs,
        "pss_total_mb": None,
        "pss_growth_total_mb": None,
        "pss_growth_mb": med(lambda x: (x["after_create"]["pss_kb"] - x["before"]["pss_kb"]) * mb),
        # The processes alive together have run once, so compare them with one process after a run.
        "pss_run_mb": med(lambda x: x["after_run"]["pss_kb"] * mb),
        "pss_run_growth_mb": med(lambda x: (x["after_run"]["pss_kb"] - x["before"]["pss_kb"]) * mb),
        "processes": processes,
    }
    if processes > 1:
        procs = [_spawn(model, feeds_path, os.path.join(workdir, f"p{k}.npz"), sessions, wait=True)
                 for k in range(processes)]
        try:
            first = [_read_result(p) for p in procs]
            for p in procs:
                p.stdin.write("\n")
                p.stdin.flush()
            alive = [_read_result(p)["all_alive"]["pss_kb"] for p in procs]
            row["pss_total_mb"] = sum(alive) * mb
            # What the model adds: each process's PSS with all alive minus its PSS before create
            # (interpreter and libraries excluded; their sharing only lowers this further).
            row["pss_growth_total_mb"] = sum(a - f["before"]["pss_kb"] for a, f in zip(alive, first)) * mb
        finally:
            for p in procs:
                p.stdin.close()
                p.wait()
    return row


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def format_table(rows: list[tuple[str, dict[str, Any]]], reference: list[np.ndarray]) -> str:
    """The comparison table; ``outputs equal`` compares each row's outputs with ``reference``."""
    multi = any(r["pss_total_mb"] is not None for _, r in rows)
    header = ["session", "create ms", "packed", "mapped", "RssAnon +MB", "RssFile MB", "PSS MB",
              "outputs equal"]
    if multi:
        header.insert(7, f"PSS x{rows[0][1]['processes']} MB")
    table = [header]
    for label, r in rows:
        cells = [label, f"{r['create_ms']:.1f}", str(r["packed"]), str(r["mapped"]),
                 f"{r['anon_growth_mb']:.1f}", f"{r['rss_file_mb']:.1f}", f"{r['pss_mb']:.1f}",
                 "yes" if _equal(r["outputs"], reference) else "NO"]
        if multi:
            cells.insert(7, f"{r['pss_total_mb']:.1f}" if r["pss_total_mb"] is not None else "-")
        table.append(cells)
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def compare(model: str, optimized: str, workdir: str, *, repeats: int, sessions: int,
             processes: int, out=None) -> list[tuple[str, dict[str, Any]]]:
    out = out if out is not None else sys.stdout
    feeds = feeds_for(model)
    cold = measure(model, feeds, os.path.join(workdir, "cold"), repeats=repeats, sessions=sessions,
                   processes=processes)
    warm = measure(optimized, feeds, os.path.join(workdir, "warm"), repeats=repeats,
                   sessions=sessions, processes=processes)
    rows = [("cold: original model (packs)", cold), ("warm: optimized model (maps)", warm)]
    out.write(format_table(rows, cold["outputs"]))
    if warm["create_ms"] > 0:
        out.write(f"warm create is {cold['create_ms'] / warm['create_ms']:.1f}x faster than cold; "
                  f"private memory (RssAnon growth) {cold['anon_growth_mb']:.1f} MB -> "
                  f"{warm['anon_growth_mb']:.1f} MB\n")
    return rows
