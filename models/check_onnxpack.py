"""How far onnxpack gets on each committed fixture: which ops it lacks, whether it loads and agrees.

Run from the repository root with the test environment (no torch needed)::

    python3 models/check_onnxpack.py [--json OUT]

For every fixture (``models/fixtures/*/*.json`` sidecars) it classifies each node's op as served
by a native kernel, by the onnx.reference fallback, or by nothing ("missing": no native kernel and
onnx.reference has no implementation), then tries ``onnxpack.InferenceSession`` on the model and,
when that works, runs the sidecar's feeds and compares with onnxruntime (max absolute difference
per feed).  It reports; it changes nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _fixtures  # noqa: E402

import onnxpack  # noqa: E402
from onnxpack.graph import load_model  # noqa: E402
from onnxpack.session import op_coverage  # noqa: E402


def classify_ops(model_path: str) -> dict[str, list[str]]:
    """``{"native": [...], "fallback": [...], "missing": [...]}`` of ``domain::op`` names, from
    ``onnxpack.session.op_coverage`` (what ``onnxpack inspect`` reports); an op some of whose
    nodes run differently is listed under its worst status."""
    with load_model(model_path) as model:
        rows = op_coverage(model)
    out: dict[str, list[str]] = collections.defaultdict(list)
    for r in rows:
        out[{"unsupported": "missing"}.get(r.status, r.status)].append(f"{r.domain}::{r.op_type}")
    return {k: sorted(out.get(k, [])) for k in ("native", "fallback", "missing")}


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def check(sidecar_path: str, sidecar: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime as ort

    model_path = os.path.join(sidecar_path[: -len(".json")], sidecar["model_file"])
    result: dict[str, Any] = {"ops": classify_ops(model_path)}
    try:
        sess = onnxpack.InferenceSession(model_path)
    except Exception as exc:  # the point is to see how it fails
        result["session"] = _first_line(exc)
        return result
    result["session"] = "ok"
    so = ort.SessionOptions()
    so.log_severity_level = 3
    runs = {}
    for mode, recipe in sorted(sidecar["feeds"].items()):
        feeds = _fixtures.make_feeds(sidecar["inventory"]["inputs"], recipe)
        expected = ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"]).run(None, feeds)
        try:
            got = sess.run(None, feeds)
        except Exception as exc:
            runs[mode] = _first_line(exc)
            continue
        runs[mode] = float(max(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(e, np.float64)))
                               for g, e in zip(got, expected)))
    result["runs"] = runs
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    results = {}
    for path, sidecar in _fixtures.read_sidecars():
        name = os.path.relpath(path, _fixtures.FIXTURES_DIR)[: -len(".json")]
        results[name] = r = check(path, sidecar)
        print(f"{name}: session {r['session']}")
        print(f"    missing: {' '.join(r['ops']['missing']) or '-'}")
        print(f"    fallback (onnx.reference): {' '.join(r['ops']['fallback']) or '-'}")
        if "runs" in r:
            print("    max |onnxpack - onnxruntime|: " + ", ".join(
                f"{m}={v:.2e}" if isinstance(v, float) else f"{m}: {v}" for m, v in r["runs"].items()))
    if args.json:
        _fixtures.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
