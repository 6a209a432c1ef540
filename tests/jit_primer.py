"""Fills numba's on-disk cache in a background process while the test suite runs.

Why: on a fresh clone numba's cache (``__pycache__`` beside the kernel modules) is empty, and the
suite's first use of each JIT kernel compiles it in the test process: ~80 specializations, about
half of the suite's time on the 2-core CI machine (12 minutes cold against 6 warm), paid one
after another while the second core mostly idles.  ``conftest.pytest_sessionstart`` starts this
script, which compiles the specializations listed in ``jit_signatures.txt`` in the order the
suite first needs them, on the other core, ahead of the tests.  A test that reaches a kernel
first compiles it itself, as without this script, and one already cached is only loaded here:
no test's outcome depends on this process, only the suite's duration.  numba writes each cache
entry to a temp name and renames it, so two processes compiling one kernel leave a whole entry.

``jit_signatures.txt`` lists ``<kernel module> <function> <numba signature>``, one per line, in
the order a cold run of the suite compiled them.  After changing a JIT kernel's arguments,
regenerate it: run the suite once on a fresh clone with ``ONNXPACK_TEST_PRIMER=0`` (with the
primer on, the cache would hold whatever the old list made it compile), then, in that clone,
``python tests/jit_primer.py --record``.  A stale line costs only its own compile or a logged
miss.

Usage: ``python tests/jit_primer.py`` (exits 0 whatever fails) | ``--record``.
"""

from __future__ import annotations

import glob
import importlib
import os
import pickle
import re
import sys
import time
import traceback

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
SIGNATURES = os.path.join(TESTS_DIR, "jit_signatures.txt")
KERNELS = os.path.join(ROOT, "onnxpack", "session", "kernels")
PACKAGE = "onnxpack.session.kernels"


def parse_signature(text: str) -> tuple:
    """A numba signature from its printed form, e.g. ``(Array(float32, 2, 'C', True,
    aligned=True), int64, Literal[int](0))``, evaluated among numba's type names only."""
    from numba.core import types

    names = {k: getattr(types, k) for k in dir(types) if not k.startswith("_")}
    names["bool"] = types.boolean
    text = re.sub(r"Literal\[int\]\((-?\d+)\)", r"IntegerLiteral(\1)", text)
    text = re.sub(r"Literal\[bool\]\((True|False)\)", r"BooleanLiteral(\1)", text)
    sig = eval(text, {"__builtins__": {}}, names)  # noqa: S307 - our own file, numba's names only
    return sig if isinstance(sig, tuple) else (sig,)


def record(pycache: str = os.path.join(KERNELS, "__pycache__"), out: str = SIGNATURES) -> int:
    """Writes ``out`` from numba's cache index files in ``pycache``, each specialization in the
    order its cache entry was written (the order the run that filled the cache needed them)."""
    rows = []
    for index in glob.glob(os.path.join(pycache, "*.nbi")):
        module, function = os.path.basename(index).split("-", 1)[0].split(".", 1)
        with open(index, "rb") as f:
            pickle.load(f)  # numba's version
            _stamp, overloads = pickle.loads(f.read())
        for key, data_name in overloads.items():
            data = os.path.join(pycache, data_name)
            when = os.path.getmtime(data) if os.path.exists(data) else float("inf")
            rows.append((when, module, function, str(key[0])))
    rows.sort()
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        for _, module, function, sig in rows:
            f.write(f"{module} {function} {sig}\n")
    os.replace(tmp, out)
    print(f"wrote {len(rows)} signatures to {os.path.relpath(out)}")
    return 0


def read_signatures(path: str = SIGNATURES) -> list[list[str]]:
    """``[module, function, signature text]`` for each line of ``path``."""
    with open(path) as f:
        return [line.rstrip("\n").split(" ", 2) for line in f if line.strip() and not line.startswith("#")]


def prime(path: str = SIGNATURES) -> int:
    """Compiles (or loads from numba's cache) every specialization listed in ``path``."""
    t0 = time.monotonic()
    done = missed = 0
    lines = read_signatures(path)
    # The int4 kernels last: the session's native code cache build (conftest), started beside this
    # process, compiles their helpers in its first minute, and the suite needs them late.
    lines.sort(key=lambda row: row[0] == "_nbits_jit")
    for module, function, text in lines:
        try:
            t = time.monotonic()
            dispatcher = getattr(importlib.import_module(f"{PACKAGE}.{module}"), function)
            dispatcher.compile(parse_signature(text))
            done += 1
            print(f"{time.monotonic() - t:6.1f} s  {module}.{function}", flush=True)
        except Exception:  # noqa: BLE001 - a miss only means the suite compiles that kernel itself
            missed += 1
            print(f"could not compile {module}.{function}:", flush=True)
            traceback.print_exc(limit=1)
    print(f"primed {done} specializations ({missed} missed) in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record"]:
        return record()
    sys.path.insert(0, ROOT)
    try:
        return prime()
    except Exception:  # noqa: BLE001 - never fails the suite
        traceback.print_exc()
        return 0


if __name__ == "__main__":
    sys.exit(main())
