"""Which ops of a model run natively, through onnx.reference, or not at all — without running it.

``op_coverage(model)`` answers, per (domain, op type), how many nodes (in every scope, dead ones
included) the resolver would give a native kernel, how many the onnx.reference fallback, and how
many nothing can run.  It asks the same resolver a session uses (``_resolve.resolve``), so a native
kernel that declines a node (``NotImplementedError``: e.g. BatchNormalization in training mode)
counts as fallback for that node, and a model-local function as fallback.  Whether onnx.reference
has an op is learnt by building its one-node evaluator (what the fallback does at session
creation), once per (domain, op type, opset).  Nothing is packed and nothing runs, so a model with
unsupported ops — which a session refuses — can still be reported on.

Control-flow ops (If, Loop, Scan) are native: their kernels need their subgraphs' compiled plans,
so they are counted without being built; their bodies' nodes are counted like any other.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from onnxpack.errors import KernelNotFoundError, OnnxpackError
from onnxpack.graph import Model, subgraphs_of
from onnxpack.session._resolve import resolve
from onnxpack.session.kernels import KernelContext, lookup, normalize_domain

logger = logging.getLogger(__name__)

__all__ = ["OpCoverage", "op_coverage"]

NATIVE, FALLBACK, UNSUPPORTED = "native", "fallback", "unsupported"


@dataclasses.dataclass
class OpCoverage:
    """How the nodes of one (domain, op type) are served.

    ``status`` is ``unsupported`` if any node cannot run, else ``fallback`` if any runs through
    onnx.reference, else ``native``; ``reason`` is the first reason a node is not native.
    """

    domain: str  # "ai.onnx" for the default domain
    op_type: str
    opset: int
    native: int = 0
    fallback: int = 0
    unsupported: int = 0
    reason: str | None = None

    @property
    def nodes(self) -> int:
        return self.native + self.fallback + self.unsupported

    @property
    def status(self) -> str:
        return UNSUPPORTED if self.unsupported else FALLBACK if self.fallback else NATIVE

    def as_dict(self) -> dict[str, Any]:
        return {"domain": self.domain, "op_type": self.op_type, "opset": self.opset, "status": self.status,
                "nodes": self.nodes, "native": self.native, "fallback": self.fallback,
                "unsupported": self.unsupported, "reason": self.reason}


def op_coverage(model: Model) -> list[OpCoverage]:
    """Per (domain, op type), sorted by domain then op type: how its nodes would be run."""
    opsets = dict(model.opsets)
    functions = tuple(model.proto.functions)
    local = frozenset((normalize_domain(f.domain), f.name) for f in functions)
    rows: dict[tuple[str, str], OpCoverage] = {}
    reference: dict[tuple[str, str, int], str | None] = {}  # -> None if onnx.reference has it, else why not
    for scope in model.scopes():
        for node in scope.graph.node:
            domain = normalize_domain(node.domain)
            opset = opsets.get(domain, 1)
            row = rows.get((domain, node.op_type))
            if row is None:
                row = rows[(domain, node.op_type)] = OpCoverage(domain or "ai.onnx", node.op_type, opset)
            how, reason = _classify(node, domain, opset, opsets, functions, local, reference, model)
            setattr(row, how, getattr(row, how) + 1)
            if reason is not None and row.reason is None:
                row.reason = reason
    return [rows[k] for k in sorted(rows)]


def _classify(node: Any, domain: str, opset: int, opsets: dict[str, int], functions: tuple, local: frozenset,
              reference: dict, model: Model) -> tuple[str, str | None]:
    if (domain, node.op_type) not in local:
        cls = lookup(domain, node.op_type, opset)
        if cls is not None and cls.call_mode == "frame":
            return NATIVE, None  # control flow: built with its subgraphs' plans, by compile
    ctx = KernelContext(opset=opset, opsets=opsets, functions=functions, inline=model.inlined)
    try:
        resolved = resolve(node, ctx, local_functions=local, runnable=False)
    except OnnxpackError as exc:  # an invalid node for its native kernel: it cannot run
        return UNSUPPORTED, f"{type(exc).__name__}: {exc}"
    if not resolved.fallback:
        return NATIVE, None
    key = (domain, node.op_type, opset)
    if key not in reference:
        reference[key] = _reference_refuses(node, ctx, functions)
    why = reference[key]
    if why is not None:
        return UNSUPPORTED, why
    if (domain, node.op_type) in local:
        return FALLBACK, "a function defined by the model (run by onnx.reference)"
    if lookup(domain, node.op_type, opset) is not None:
        return FALLBACK, "the native kernel declines this node's attributes (run by onnx.reference)"
    return FALLBACK, "no native kernel (run by onnx.reference)"


def _reference_refuses(node: Any, ctx: KernelContext, functions: tuple) -> str | None:
    """None when onnx.reference can build this node, else why not (one line)."""
    from onnxpack.session._fallback import FallbackKernel

    try:
        FallbackKernel(node, ctx, list(functions))
    except KernelNotFoundError:
        return f"no native kernel, and onnx.reference has no {node.domain or 'ai.onnx'}::{node.op_type}"
    except Exception as exc:  # onnx.reference fails on the node in many ways
        text = " ".join(str(exc).split())[:200]
        return f"no native kernel, and onnx.reference fails on it ({type(exc).__name__}: {text})"
    return None
