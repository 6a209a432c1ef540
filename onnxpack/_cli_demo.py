"""``onnxpack demo`` and ``onnxpack bench``: cold (packing) vs warm (mapped) session starts.

Every measured session is created in a fresh Python process (``python -c`` running
:func:`_worker_main`), so create time includes nothing cached in this process and memory figures
are that process's own: ``RssAnon`` (private heap: what packing costs), ``RssFile`` (mapped file
pages: what mapping costs, shared through the page cache) and ``Pss`` (proportional set size:
shared pages divided among the processes mapping them).  With ``--processes N`` the N workers
are alive at the same time when they read their PSS, so the total shows whether they share.

The demo model is generated on the fly into a temp folder: an fp16 MLP (MatMul + Relu layers,
2048-wide by default) whose MatMul kernels widen each fp16 weight to float32 when packing — the
conversion every fp16 model pays at every start unless the packed blobs are saved and mapped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from onnxpack.errors import InvalidArgument

__all__ = ["make_demo_model", "measure", "format_table", "demo_args", "demo", "bench_args", "bench"]

# The demo model: fp16 MLP, 2048 wide.  64 MiB of fp16 weights (8 layers) packs to 128 MiB of
# float32 blobs: large enough that packing cost and memory are visible over Python's own ~30 MB,
# small enough that generating, optimizing and 2 x 3 fresh-process starts stay under ~30 s on
# 2 cores.
DEMO_DIM = 2048
DEMO_SIZE_MB = 64
DEMO_REPEATS = 3

# The worker prints one JSON line starting with this tag (anything else on stdout is ignored).
_TAG = "ONNXPACK-MEASURE "


# -- model ------------------------------------------------------------------------------------


def make_demo_model(folder: str, size_mb: float = DEMO_SIZE_MB, dim: int = DEMO_DIM) -> str:
    """Writes an fp16 MLP with about ``size_mb`` MB of weights to ``folder/demo_mlp.onnx``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from onnxpack.graph import save_model

    layer_bytes = dim * dim * 2
    n_layers = max(1, round(size_mb * 1e6 / layer_bytes))
    if size_mb * 1e6 < layer_bytes:  # small sizes (tests): shrink the width instead
        dim = max(16, int(math.sqrt(size_mb * 1e6 / 2)) // 16 * 16)
        n_layers = 2
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(n_layers):
        w = (rng.standard_normal((dim, dim), dtype=np.float32) / math.sqrt(dim)).astype(np.float16)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        out = "y" if i == n_layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"fc{i}"))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [out], name=f"relu{i}"))
        prev = out
    h = TensorProto.FLOAT16
    graph = helper.make_graph(nodes, "demo_fp16_mlp", [helper.make_tensor_value_info("x", h, [4, dim])],
                              [helper.make_tensor_value_info("y", h, [4, dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="onnxpack-demo")
    model.ir_version = 9
    path = os.path.join(folder, "demo_mlp.onnx")
    save_model(model, path, min_size=1024)
    del model, inits
    onnx.checker.check_model(path)
    return path


def _feeds(model_path: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs from the model's declared inputs (symbolic dims -> 1)."""
    import onnx
    from onnx import TensorProto, helper

    proto = onnx.load(model_path, load_external_data=False)
    init = {t.name for t in proto.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in proto.graph.input:
        if vi.name in init:
            continue
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        if t.elem_type == TensorProto.BOOL:
            feeds[vi.name] = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, 4, shape).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


# -- measuring in fresh processes -------------------------------------------------------------


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
    code = "from onnxpack._cli_demo import _worker_main; _worker_main()"
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


def _has_records(model: str) -> bool:
    import onnx

    from onnxpack.prepack.entry_format import is_record_key

    proto = onnx.load(model, load_external_data=False)
    return any(is_record_key(p.key) for p in proto.metadata_props)


def _compare(model: str, optimized: str, workdir: str, *, repeats: int, sessions: int,
             processes: int, out=None) -> list[tuple[str, dict[str, Any]]]:
    out = out if out is not None else sys.stdout
    feeds = _feeds(model)
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


# -- subcommands ------------------------------------------------------------------------------


def demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, default=DEMO_SIZE_MB,
                   help=f"fp16 weight megabytes of the generated model (default {DEMO_SIZE_MB})")
    p.add_argument("--repeats", type=int, default=DEMO_REPEATS,
                   help=f"fresh processes per row; the median is shown (default {DEMO_REPEATS})")
    p.add_argument("--processes", type=int, default=1,
                   help="also run this many processes at once and show their total PSS")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="write the models to DIR (kept) instead of a temp folder")


def demo(args: argparse.Namespace) -> int:
    """Generate an fp16 MLP, optimize it with blobs, compare cold and warm starts."""
    from onnxpack.cli import optimize_model

    if args.size_mb <= 0 or args.repeats < 1 or args.processes < 1:
        raise InvalidArgument("demo: --size-mb must be > 0, --repeats and --processes >= 1")
    with tempfile.TemporaryDirectory(prefix="onnxpack-demo-") as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        for sub in ("cold", "warm"):
            os.makedirs(os.path.join(tmp, sub), exist_ok=True)
        t0 = time.perf_counter()
        model = make_demo_model(folder, args.size_mb)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                   if f.startswith("demo_mlp.onnx"))
        print(f"1. generated {model} ({size / 1e6:.1f} MB, fp16 MLP) in {time.perf_counter() - t0:.1f} s")
        optimized = os.path.join(folder, "demo_mlp.opt.onnx")
        print("2. onnxpack optimize (pre-pack and save the blobs next to the weights):")
        optimize_model(model, optimized, progress=False)
        print("3. fresh processes: cold = original model (packs every weight), "
              "warm = optimized model (maps the saved blobs)")
        _compare(model, optimized, tmp, repeats=args.repeats, sessions=1, processes=args.processes)
    return 0


def bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model (never modified)")
    p.add_argument("--sessions", type=int, default=1, help="sessions per process (default 1)")
    p.add_argument("--processes", type=int, default=1,
                   help="processes alive at once for the total-PSS column (default 1)")
    p.add_argument("--repeats", type=int, default=DEMO_REPEATS,
                   help=f"fresh processes per row; the median is shown (default {DEMO_REPEATS})")


def bench(args: argparse.Namespace) -> int:
    """Cold vs warm table for a user's model (optimized into a temp folder unless it has blobs)."""
    from onnxpack.cli import optimize_model

    if args.sessions < 1 or args.processes < 1 or args.repeats < 1:
        raise InvalidArgument("bench: --sessions, --processes and --repeats must be >= 1")
    if not os.path.isfile(args.model):
        raise InvalidArgument(f"bench: model {args.model!r} does not exist")
    with tempfile.TemporaryDirectory(prefix="onnxpack-bench-") as tmp:
        for sub in ("cold", "warm"):
            os.makedirs(os.path.join(tmp, sub))
        optimized = os.path.join(tmp, "optimized.onnx")
        print(f"optimizing {args.model} into a temp folder (with pre-packed blobs):")
        optimize_model(args.model, optimized, progress=False)
        _compare(args.model, optimized, tmp, repeats=args.repeats, sessions=args.sessions,
                 processes=args.processes)
    return 0
