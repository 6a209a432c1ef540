"""``onnxpack inspect MODEL``: what a session makes of a model, and what its pre-packing did.

It creates one session (exactly as a user would, with the given config entries) and reports:

* **op coverage** — per op type, how many nodes run natively, through onnx.reference (the
  fallback), or not at all (unsupported: no native kernel and onnx.reference has none), computed
  without running anything (:func:`onnxpack.session.op_coverage`), so a user sees before running
  whether a model is fully covered.  A model with unsupported ops cannot make a session: the
  report then says why, and gives the coverage, scopes, initializers and layout anyway;
* **scopes** — every graph, bottom-up, with the node that owns it;
* **initializers** — name, dtype, shape, bytes, and where the bytes live (external file, offset,
  length, or in the proto);
* **packs** — which node packs which weight, the packed size and where the pack came from
  (``packed`` now, ``container``, ``model`` file, ``cache`` file), read from
  ``InferenceSession.get_prepack_log()``;
* **fallback nodes** — nodes run by onnx.reference because no native kernel serves them;
* **prepack stats** — ``InferenceSession.get_prepack_stats()``.

The report is one plain dict (:func:`collect`), printed either as JSON (``--json``) or as text by
one small function per section (:data:`SECTIONS`), so a new section is one function and one entry.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from onnxpack.cli._common import EXIT_OK, format_bytes, parse_config
from onnxpack.cli._layout import describe_layout, format_layout

logger = logging.getLogger(__name__)

__all__ = ["HELP", "add_arguments", "run", "collect", "format_text", "SECTIONS"]

HELP = "print op coverage, scopes, initializers, packed weights, fallback nodes and prepack stats"

Report = dict[str, Any]


# -- collecting ---------------------------------------------------------------------------------------
def _scope_rows(model: Any) -> list[dict[str, Any]]:
    rows = []
    for scope in model.scopes():
        owner = scope.owner
        rows.append({
            "path": scope.path,
            "graph": scope.graph.name,
            "owner": None if owner is None else {"node": owner.name, "op_type": owner.op_type,
                                                 "attribute": scope.attr_name},
            "nodes": len(scope.graph.node),
            "initializers": len(scope.initializers),
        })
    return rows


def _owner_path(by_path: dict[str, Any], scope_path: str, name: str) -> str | None:
    """Path of the scope whose initializer ``name`` is, as seen from scope ``scope_path``."""
    scope = by_path.get(scope_path)
    owner = scope.resolve(name) if scope is not None else None
    return owner.path if owner is not None and name in owner.initializers else None


def _initializer_rows(model: Any, packs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_path = {s.path: s for s in model.scopes()}
    packed_names = {(_owner_path(by_path, r["scope"], r["weight"]), r["weight"]) for r in packs}
    rows = []
    for scope in model.scopes():
        for name, tensor in scope.initializers.items():
            ext = tensor.external
            rows.append({
                "scope": scope.path,
                "name": name,
                "dtype": str(tensor.dtype),
                "shape": list(tensor.dims),
                "nbytes": int(tensor.nbytes),
                "location": None if ext is None else ext.location,
                "offset": None if ext is None else int(ext.offset),
                "length": None if ext is None else int(ext.length),
                "packed": (scope.path, name) in packed_names,
            })
    return rows


def _coverage(model: Any) -> dict[str, Any]:
    from onnxpack.session import op_coverage

    rows = [r.as_dict() for r in op_coverage(model)]
    counts = {status: sum(1 for r in rows if r["status"] == status) for status in ("native", "fallback", "unsupported")}
    return {"ops": rows, "op_types": counts, "fully_native": not counts["fallback"] and not counts["unsupported"],
            "runnable": not counts["unsupported"]}


def collect(model_path: str, config: dict[str, str] | None = None) -> Report:
    """Create a session for ``model_path`` and return the inspection report as plain data.

    Args:
        model_path: the model file (never modified; inspecting writes nothing unless a config
            entry such as ``onnxpack.prepacked_cache_path`` asks the session to).
        config: session config entries (``session.disable_prepacking`` …), validated by the
            session like any user's.

    A model some node of which nothing can run (``KernelNotFoundError``) gets a report without a
    session: ``session_error`` says why, packs, fallback nodes and stats are empty/None.
    """
    from onnxpack.errors import KernelNotFoundError
    from onnxpack.graph import load_model
    from onnxpack.session import InferenceSession, SessionOptions

    so = SessionOptions()
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    t0 = time.perf_counter()
    try:
        session = InferenceSession(model_path, so)
    except KernelNotFoundError as exc:
        with load_model(os.fspath(model_path)) as model:
            return _report(model_path, config, model, None, None, str(exc))
    create_seconds = time.perf_counter() - t0
    try:
        return _report(model_path, config, session.model, session, create_seconds, None)
    finally:
        session.close()


def _report(model_path: str, config: dict[str, str] | None, model: Any, session: Any,
            create_seconds: float | None, error: str | None) -> Report:
    packs = session.get_prepack_log() if session is not None else []
    return {
        "model": os.fspath(model_path),
        "opsets": {k or "ai.onnx": v for k, v in sorted(model.opsets.items())},
        "create_seconds": create_seconds,
        "session_error": error,
        "config": dict(config or {}),
        "coverage": _coverage(model),
        "scopes": _scope_rows(model),
        "initializers": _initializer_rows(model, packs),
        "packs": packs,
        "fallback_nodes": session.get_fallback_nodes() if session is not None else [],
        "stats": session.get_prepack_stats() if session is not None else None,
        "layout": describe_layout(os.fspath(model_path)),
    }


# -- printing --------------------------------------------------------------------------------------
def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def _scope_label(path: str) -> str:
    return path or "(main)"


def format_header(report: Report) -> list[str]:
    opsets = ", ".join(f"{d} {v}" for d, v in report["opsets"].items())
    lines = [f"model: {report['model']}", f"opsets: {opsets}"]
    if report.get("session_error"):
        lines.append(f"no session: {report['session_error']}")
    else:
        lines.append(f"session created in {report['create_seconds'] * 1000:.1f} ms")
    if report["config"]:
        lines.append("config: " + ", ".join(f"{k}={v}" for k, v in report["config"].items()))
    return lines


def format_coverage(report: Report) -> list[str]:
    """Per op type: native / fallback (onnx.reference) / unsupported node counts."""
    cov = report["coverage"]
    n = cov["op_types"]
    if cov["fully_native"]:
        verdict = "every op runs natively"
    elif cov["runnable"]:
        verdict = f"{n['fallback']} op type(s) run through onnx.reference (slow), the rest natively"
    else:
        verdict = f"{n['unsupported']} op type(s) UNSUPPORTED: no native kernel, no onnx.reference implementation"
    rows = [[f"{r['domain']}::{r['op_type']}", r["opset"], r["nodes"], r["status"], r["native"], r["fallback"],
             r["unsupported"], r["reason"] or ""] for r in cov["ops"]]
    return [f"op coverage ({len(rows)} op types: {verdict}):"] + _table(
        ["op", "opset", "nodes", "status", "native", "fallback", "unsupported", "why not native"], rows)


def format_scopes(report: Report) -> list[str]:
    rows = []
    for s in report["scopes"]:
        owner = s["owner"]
        label = "-" if owner is None else f"{owner['op_type']} {owner['node'] or '#'} .{owner['attribute']}"
        rows.append([_scope_label(s["path"]), s["graph"], label, s["nodes"], s["initializers"]])
    return [f"scopes ({len(rows)}, bottom-up):"] + _table(["scope", "graph", "owner", "nodes", "initializers"], rows)


def format_initializers(report: Report) -> list[str]:
    rows = []
    total = 0
    for t in report["initializers"]:
        total += t["nbytes"]
        where = "in proto" if t["location"] is None else f"{t['location']} @{t['offset']} +{t['length']}"
        rows.append([_scope_label(t["scope"]), t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
                     t["nbytes"], where, "yes" if t["packed"] else "no"])
    head = f"initializers ({len(rows)}, {format_bytes(total)}):"
    return [head] + _table(["scope", "name", "dtype", "shape", "bytes", "stored", "packed"], rows)


def format_packs(report: Report) -> list[str]:
    packs = report["packs"]
    if report.get("session_error"):
        return ["packed weights: (no session)"]
    if not packs:
        return ["packed weights: none"]
    rows = [[_scope_label(p["scope"]), p["node"] or "#", p["op_type"], p["input"], p["weight"], p["nbytes"],
             p["origin"], p["key"]] for p in packs]
    return [f"packed weights ({len(packs)} kernel inputs):"] + _table(
        ["scope", "node", "op", "input", "weight", "packed bytes", "origin", "key"], rows)


def format_fallback(report: Report) -> list[str]:
    if report.get("session_error"):
        return ["fallback nodes (onnx.reference): (no session)"]
    nodes = report["fallback_nodes"]
    if not nodes:
        return ["fallback nodes (onnx.reference): none"]
    return [f"fallback nodes (onnx.reference): {len(nodes)}"] + [f"  {n}" for n in nodes]


def format_stats(report: Report) -> list[str]:
    if report["stats"] is None:
        return ["prepack stats: (no session)"]
    rows = []
    for key, value in report["stats"].items():
        if isinstance(value, float):
            shown = f"{value * 1000:.2f} ms" if key.startswith("seconds") else f"{value:g}"
        elif key.startswith("bytes"):
            shown = f"{value} ({format_bytes(value)})"
        else:
            shown = str(value)
        rows.append([key, shown])
    return ["prepack stats:"] + _table(["stat", "value"], rows)


def format_layout_section(report: Report) -> list[str]:
    """External data layout: each weight and its saved blobs, offsets, alignment, sizes, kernels."""
    rows = report.get("layout") or []
    if not rows:
        return ["external data layout: (no external data)"]
    return ["external data layout:"] + format_layout(rows).rstrip("\n").splitlines()


# One entry per printed section, in order; a new section is a function taking the report.
SECTIONS: list[Callable[[Report], list[str]]] = [
    format_header,
    format_coverage,
    format_scopes,
    format_initializers,
    format_packs,
    format_fallback,
    format_stats,
    format_layout_section,
]


def format_text(report: Report) -> str:
    return "\n\n".join("\n".join(section(report)) for section in SECTIONS) + "\n"


# -- the subcommand --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model to inspect (never modified)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-prepack", action="store_true",
                   help="create the session with session.disable_prepacking=1")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="session config entry (repeatable), e.g. onnxpack.prepacked_cache_path=cache.bin")


def run(args: argparse.Namespace) -> int:
    config = parse_config(args.config)
    if args.no_prepack:
        config["session.disable_prepacking"] = "1"
    report = collect(args.model, config)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    else:
        print(format_text(report), end="")
    return EXIT_OK
