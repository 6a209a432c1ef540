"""Measurement helpers shared by the benchmark scripts in ``benchmarks/``.

One copy of what every ``bench_*.py`` needs, so that all of them measure the same way:

* :func:`blas_info` — the BLAS library numpy calls (threadpoolctl), recorded beside every result:
  onnxpack cannot beat the BLAS it calls, and OpenBLAS picks its kernels at run time.
* :func:`proc_memory` — RssAnon / RssFile / VmRSS / VmHWM from ``/proc/self/status`` and Pss
  from ``/proc/self/smaps_rollup``, in bytes.  RssAnon is what a process owns privately; mapped
  weights are file-backed and shared through the page cache, which Pss divides among sharers.
* :func:`run_child` / :func:`run_json` — a measurement in a fresh interpreter (honest create
  time and RSS: no state left by an earlier measurement), answering one JSON line.
* :func:`median_seconds` — the median of timed calls after a warm-up.
* :func:`write_json` — results written to a temp file in the target folder, fsynced, renamed.

This module imports only the standard library at import time: children import it before they
take their "before" memory reading.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "ROOT", "BENCH_DIR", "BLAS_ENV", "blas_info", "proc_memory", "run_child", "run_json",
    "median_seconds", "write_json", "session_feeds", "print_table", "build_native_cache",
]

BENCH_DIR = pathlib.Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
# Set on the dev machine to force OpenBLAS's kernel choice; benchmarks run without them (see
# DESIGN.md) so the figures are those of OpenBLAS's own run-time detection.
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_BLAS_KEYS = ("user_api", "internal_api", "version", "architecture", "num_threads", "threading_layer",
              "filepath")
_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
# A failed child's stderr tail kept in the error: enough for a traceback, not a flood.
_STDERR_TAIL = 4000


def build_native_cache() -> None:
    """Builds the JIT's native code cache now if this tree's kernels changed since it was built
    (a no-op when it is current): what the first process to load a JIT kernel otherwise starts
    in the background, taking a core for ~20-40 s -- which, during a measurement, slowed three
    models' two-thread runs 20x in one run of bench_models.py."""
    subprocess.run([sys.executable, "-m", "onnxpack.session.kernels._jit_native"], check=False,
                   env={k: v for k, v in os.environ.items() if k not in BLAS_ENV}, cwd=str(ROOT))


def blas_info() -> list[dict]:
    """The BLAS/OpenMP libraries loaded in this process (threadpoolctl), one dict each."""
    try:
        import numpy  # noqa: F401  (loads the BLAS threadpoolctl is to report)
        from threadpoolctl import threadpool_info
    except ImportError:
        return [{"error": "threadpoolctl not installed (pip install threadpoolctl)"}]
    return [{k: i.get(k) for k in _BLAS_KEYS} for i in threadpool_info()]


def proc_memory() -> dict[str, int]:
    """This process's memory in bytes: VmRSS, VmHWM, RssAnon, RssFile, RssShmem and Pss.

    Keys the kernel does not report (non-Linux, no smaps_rollup before Linux 4.14) are absent.
    """
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _STATUS_KEYS:
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        return out
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    out["Pss"] = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return out


def run_json(cmd: Sequence[str], *, drop_env: Iterable[str] = (), what: str = "") -> Any:
    """Runs ``cmd`` in a fresh process; returns the JSON of the last line it printed.

    The child can import ``onnxpack`` from this tree and ``_common`` / ``_models`` from
    ``benchmarks/`` (both put on ``PYTHONPATH``; the editable install may point elsewhere), runs in
    the repository root, and does not see the variables in ``drop_env``.
    """
    env = {k: v for k, v in os.environ.items() if k not in set(drop_env)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), str(BENCH_DIR), env.get("PYTHONPATH"))))
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=str(ROOT), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed{' (' + what + ')' if what else ''}, "
                           f"exit {proc.returncode}:\n{proc.stderr[-_STDERR_TAIL:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"benchmark child printed nothing{' (' + what + ')' if what else ''}:\n"
                           f"{proc.stderr[-_STDERR_TAIL:]}")
    return json.loads(lines[-1])


def run_child(script: str, *args: object, drop_env: Iterable[str] = (), what: str = "") -> Any:
    """Runs ``python -c script args...`` through :func:`run_json` (args passed as strings)."""
    return run_json([sys.executable, "-c", script, *map(str, args)], drop_env=drop_env, what=what)


def median_seconds(fn: Callable[[], object], repeat: int, *, warmup: int = 1) -> float:
    """Median wall time of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_json(path: str | os.PathLike, payload: Any, *, indent: int = 1,
               default: Callable[[Any], Any] | None = None) -> pathlib.Path:
    """Writes ``payload`` as JSON to ``path``: temp file in the same folder, fsync, rename."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=indent, default=default)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def session_feeds(sess, seed: int = 0, *, dynamic: int = 1) -> dict:
    """Seeded feeds for an onnxpack session's inputs: floats N(0, 1), everything else zeros.

    Dynamic dimensions become ``dynamic``.
    """
    import numpy as np

    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}
    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in sess.get_inputs():
        shape = [d if isinstance(d, int) else dynamic for d in (arg.shape or [])]
        dt = np.dtype(types[arg.type])
        feeds[arg.name] = rng.standard_normal(shape).astype(dt) if dt.kind == "f" else np.zeros(shape, dt)
    return feeds


def print_table(rows: Sequence[Sequence[str]], *, left: int = 1) -> None:
    """Prints ``rows`` (the first is the header) aligned; the first ``left`` columns left-justified."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(c.ljust(w) if k < left else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
