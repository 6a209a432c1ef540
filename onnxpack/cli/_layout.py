"""The external data layout of a saved model: each weight, its pre-packed blobs, and their users.

``onnxpack inspect`` prints it (through :func:`format_layout`); the optimize command's closing
table and the tests read the rows of :func:`describe_layout`.  Only the model file is parsed:
offsets and sizes come from ``external_data`` entries and from the pre-packed records in
``metadata_props`` (their format: :mod:`onnxpack.prepack.entry_format`), so nothing is paged in.
A malformed record becomes an ``invalid`` row instead of an error: inspecting a broken model
should show what is broken.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx
from onnx import TensorProto

from onnxpack._units import format_bytes
from onnxpack.errors import PrepackFormatError
from onnxpack.graph import Scope
from onnxpack.prepack import entry_format as fmt

logger = logging.getLogger(__name__)

__all__ = ["describe_layout", "format_layout"]

# Report alignment up to this many bytes (64 KiB covers every page size in use: 4 KiB, 16 KiB on
# Apple silicon, 64 KiB on some arm64/ppc64 kernels and Windows' allocation granularity).
_MAX_REPORTED_ALIGN = 64 * 1024

# Op types whose kernel pre-packs a weight of a given family (record key "<family>/...").
_FAMILY_OPS = {"matmul": ("MatMul",), "gemm": ("Gemm",), "conv": ("Conv", "ConvTranspose"),
               "matmulnbits": ("MatMulNBits",)}


def _alignment(offset: int) -> int:
    """The largest power of two (capped) that divides ``offset``."""
    if offset == 0:
        return _MAX_REPORTED_ALIGN
    return min(offset & -offset, _MAX_REPORTED_ALIGN)


def _consumers(scope: Scope, name: str) -> list[str]:
    """``op_type:node`` of every node reading ``name`` in ``scope`` or in nested scopes that do
    not define their own ``name`` (outer-scope use), with ``@scope path`` for nested ones."""
    found = []
    stack = [scope]
    while stack:
        s = stack.pop()
        where = s.path
        for node in s.graph.node:
            if name in node.input:
                found.append(f"{node.op_type}:{node.name or '#'}" + (f"@{where}" if where else ""))
        stack.extend(c for c in reversed(s.children) if name not in c.defined)
    return found


def describe_layout(model_path: str) -> list[dict[str, Any]]:
    """One row per external weight and per pre-packed blob, in file order per data file.

    Row keys: ``kind`` ("weight", "blob" or "invalid"), ``scope``, ``name``, ``file``,
    ``offset``, ``length``, ``align`` (largest power of two dividing the offset, capped at
    64 KiB), ``dtype``, ``shape``, ``key`` (blobs: the pack key), ``kernels`` (ops that use it:
    for a weight every consumer, for a blob the consumers of its kernel family), ``shared_with``
    (blobs: other weights whose record points at the same bytes) and ``note``.
    """
    from onnxpack.graph import load_model

    # The graph layer names scopes exactly as the records do (bottom-up walk, unique paths).
    with load_model(str(model_path)) as model:
        proto = model.proto
        scopes = list(model.scopes())[::-1]  # root first
    by_path = {s.path: s for s in scopes}
    rows: list[dict[str, Any]] = []
    for scope in scopes:
        path = scope.path
        for t in scope.graph.initializer:
            if t.data_location != TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            try:
                offset = int(info.get("offset", "0"))
                length = int(info["length"]) if "length" in info else -1
            except ValueError:
                offset, length = -1, -1
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).str if t.data_type else "?"
            rows.append({
                "kind": "weight", "scope": path, "name": t.name, "file": info.get("location", "?"),
                "offset": offset, "length": length, "align": _alignment(offset) if offset >= 0 else 0,
                "dtype": dtype, "shape": tuple(t.dims), "key": "",
                "kernels": _consumers(scope, t.name), "shared_with": [], "note": "",
            })
    blob_owner: dict[tuple[str, int], list[str]] = {}
    blob_rows: list[dict[str, Any]] = []
    for p in proto.metadata_props:
        if not fmt.is_record_key(p.key):
            continue
        try:
            rec = fmt.parse_record(p.key, p.value)
        except PrepackFormatError as exc:
            rows.append({"kind": "invalid", "scope": "", "name": p.key, "file": "", "offset": -1,
                         "length": -1, "align": 0, "dtype": "", "shape": (), "key": "",
                         "kernels": [], "shared_with": [], "note": str(exc)[:200]})
            continue
        owner = by_path.get(rec.scope)
        users = _consumers(owner, rec.name) if owner is not None else []
        for pack in rec.packs:
            family = pack.key.split("/", 1)[0]
            ops = _FAMILY_OPS.get(family)
            kernels = [u for u in users if ops is None or u.split(":", 1)[0] in ops]
            for i, b in enumerate(pack.buffers):
                label = f"{rec.scope}/{rec.name}" if rec.scope else rec.name
                blob_owner.setdefault((b.location, b.offset), []).append(label)
                blob_rows.append({
                    "kind": "blob", "scope": rec.scope, "name": rec.name, "file": b.location,
                    "offset": b.offset, "length": b.length, "align": _alignment(b.offset),
                    "dtype": b.dtype, "shape": b.shape, "key": pack.key, "kernels": kernels,
                    "shared_with": [], "note": f"buffer {i}" if len(pack.buffers) > 1 else "",
                })
    for r in blob_rows:
        label = f"{r['scope']}/{r['name']}" if r["scope"] else r["name"]
        r["shared_with"] = [o for o in blob_owner[(r["file"], r["offset"])] if o != label]
    # File order, one blob row per distinct location (a shared blob is listed once, with its
    # other owners in shared_with).
    seen: set[tuple[str, int, str]] = set()
    for r in blob_rows:
        k = (r["file"], r["offset"], r["key"])
        if k not in seen:
            seen.add(k)
            rows.append(r)
    order = {"weight": 0, "blob": 1, "invalid": 2}
    rows.sort(key=lambda r: (r["kind"] == "invalid", r["file"], r["offset"], order[r["kind"]]))
    return rows


def _align_text(a: int) -> str:
    if a >= 1024:
        return f"{a // 1024}K"
    return str(a)


def format_layout(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of :func:`describe_layout` rows plus a one-line summary."""
    if not rows:
        return "no external data (every tensor is inside the model file)\n"
    header = ("kind", "tensor", "file", "offset", "size", "align", "dtype", "shape", "kernels")
    table = [header]
    for r in rows:
        if r["kind"] == "invalid":
            table.append(("INVALID", r["name"], "", "", "", "", "", "", r["note"]))
            continue
        name = f"{r['scope']}/{r['name']}" if r["scope"] else r["name"]
        if r["kind"] == "blob":
            name = f"  -> {r['key'].split('/', 1)[0]} blob of {name}"
            if r["shared_with"]:
                name += f" (shared with {', '.join(r['shared_with'])})"
        kernels = ", ".join(r["kernels"]) if r["kernels"] else "-"
        shape = "x".join(map(str, r["shape"])) if r["shape"] else "scalar"
        table.append((r["kind"], name, r["file"], str(r["offset"]), format_bytes(r["length"]),
                      _align_text(r["align"]), r["dtype"], shape, kernels))
    widths = [max(len(row[c]) for row in table) for c in range(len(header) - 1)]
    lines = []
    for row in table:
        cells = [row[c].ljust(widths[c]) if c in (0, 1, 2, 6, 7) else row[c].rjust(widths[c])
                 for c in range(len(header) - 1)]
        lines.append("  ".join(cells) + "  " + row[-1])
    weights = [r for r in rows if r["kind"] == "weight"]
    blobs = [r for r in rows if r["kind"] == "blob"]
    bad = [r for r in rows if r["kind"] == "invalid"]
    misaligned = [r for r in weights + blobs if r["offset"] >= 0 and r["offset"] % 64]
    summary = (f"{len(weights)} weights ({format_bytes(sum(max(r['length'], 0) for r in weights))}), "
               f"{len(blobs)} pre-packed blobs ({format_bytes(sum(r['length'] for r in blobs))})")
    if bad:
        summary += f", {len(bad)} invalid records"
    summary += f", {len(misaligned)} not 64-byte aligned" if misaligned else ", all 64-byte aligned"
    lines.append(summary)
    return "\n".join(lines) + "\n"

