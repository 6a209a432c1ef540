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
from onnxpack.session._fallback import FallbackKernel  # noqa: E402
import onnxpack.session.kernels  # noqa: E402,F401  (importing it registers every kernel)
from onnxpack.session.kernels._base import KernelContext, lookup, normalize_domain  # noqa: E402


def _nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _nodes(g)


_CONTROL_FLOW = {"If", "Loop", "Scan"}  # served by the executor itself, not a kernel


def classify_ops(model: onnx.ModelProto) -> dict[str, list[str]]:
    """``{"native": [...], "fallback": [...], "missing": [...]}`` of ``domain::op`` names."""
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
    seen: dict[str, str] = {}
    for node in _nodes(model.graph):
        domain = normalize_domain(node.domain)
        key = f"{domain or 'ai.onnx'}::{node.op_type}"
        if key in seen:
            continue
        opset = opsets.get(domain, 1)
        if domain == "" and node.op_type in _CONTROL_FLOW:
            seen[key] = "native"
        elif lookup(domain, node.op_type, opset) is not None:
            seen[key] = "native"
        else:
            try:
                FallbackKernel(node, KernelContext(opset=opset, opsets=opsets))
                seen[key] = "fallback"
            except Exception:  # KernelNotFoundError, or onnx.reference failing on the node
                seen[key] = "missing"
    out: dict[str, list[str]] = collections.defaultdict(list)
    for key, how in sorted(seen.items()):
        out[how].append(key)
    return {k: out.get(k, []) for k in ("native", "fallback", "missing")}


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def check(sidecar_path: str, sidecar: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime as ort

    model_path = os.path.join(sidecar_path[: -len(".json")], sidecar["model_file"])
    model = onnx.load(model_path, load_external_data=False)
    result: dict[str, Any] = {"ops": classify_ops(model)}
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
