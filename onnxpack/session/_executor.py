"""The executor: one plan per scope, values released after their last use, subgraphs run by the
same machinery with outer-scope lookup.

A :class:`ScopePlan` is built once per scope at session creation (bottom-up, so a node's
subgraph plans exist before the node's kernel is bound).  Running a plan creates a
:class:`Frame` — a dict of values plus the enclosing frame — so concurrent ``run`` calls share
nothing mutable.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from onnx import NodeProto

from onnxpack.errors import InvalidGraph, RuntimeFailure

logger = logging.getLogger(__name__)

__all__ = ["Frame", "Step", "ScopePlan", "topological_order"]

_MISSING = object()


class Frame:
    """Values of one running scope; names not found here are looked up in the parent frame."""

    __slots__ = ("values", "parent")

    def __init__(self, values: dict[str, Any], parent: Frame | None) -> None:
        self.values = values
        self.parent = parent

    def get(self, name: str) -> Any:
        frame: Frame | None = self
        while frame is not None:
            v = frame.values.get(name, _MISSING)
            if v is not _MISSING:
                return v
            frame = frame.parent
        raise KeyError(name)

    def visible(self) -> dict[str, Any]:
        """Every visible name (outer first, inner wins): the context onnx.reference wants."""
        chain = []
        frame: Frame | None = self
        while frame is not None:
            chain.append(frame.values)
            frame = frame.parent
        out: dict[str, Any] = {}
        for values in reversed(chain):
            out.update(values)
        return out


@dataclasses.dataclass
class Step:
    """One node bound to its kernel."""

    node: NodeProto
    kernel: Any
    inputs: tuple[str, ...]  # "" for an omitted optional input
    outputs: tuple[str, ...]
    packed: frozenset[int] = frozenset()  # input indices the kernel took pre-packed (fed None)
    release: tuple[str, ...] = ()  # local names whose last use is this step
    needs_frame: bool = False  # control flow: gets the frame
    needs_context: bool = False  # onnx.reference fallback with graph attributes
    implicit: tuple[str, ...] = ()  # names its subgraphs read from enclosing scopes

    @property
    def label(self) -> str:
        return f"node {self.node.name or '<unnamed>'!r} ({self.node.op_type})"


def topological_order(nodes: Sequence[NodeProto], available: set[str], scope_name: str,
                      reads: Sequence[Sequence[str]] | None = None) -> list[int]:
    """Indices of ``nodes`` in an order where every input is produced before use.

    ``available`` holds names defined before any node runs (graph inputs, initializers, and every
    name visible from enclosing scopes); ``reads[i]`` is what node ``i`` reads — its inputs plus
    the implicit inputs of its subgraphs (default: its inputs).  A cycle or an input nobody
    produces is InvalidGraph.
    """
    producers: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for out in node.output:
            if out:
                if out in producers:
                    raise InvalidGraph(
                        f"graph {scope_name!r}: value {out!r} is produced by two nodes "
                        f"({nodes[producers[out]].name!r} and {node.name!r})"
                    )
                producers[out] = i
    # Inputs include names consumed by the node's subgraphs (implicit inputs).
    deps: list[set[int]] = []
    for i, node in enumerate(nodes):
        d: set[int] = set()
        for name in (reads[i] if reads is not None else node.input):
            if not name or name in available and name not in producers:
                continue
            p = producers.get(name)
            if p is None:
                if name in available:
                    continue
                raise InvalidGraph(
                    f"graph {scope_name!r}: node {node.name!r} ({node.op_type}) uses {name!r}, "
                    "which is not a graph input, an initializer, or any node's output"
                )
            d.add(p)
        deps.append(d)
    order: list[int] = []
    state = [0] * len(nodes)  # 0 new, 1 on stack, 2 done
    for start in range(len(nodes)):
        if state[start]:
            continue
        stack = [(start, iter(sorted(deps[start])))]
        state[start] = 1
        while stack:
            i, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                state[i] = 2
                order.append(i)
            elif state[nxt] == 1:
                raise InvalidGraph(f"graph {scope_name!r}: cycle through node {nodes[nxt].name!r} ({nodes[nxt].op_type})")
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(deps[nxt]))))
    return order


class ScopePlan:
    """The steps of one graph, in order, with release points and constants."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        constants: dict[str, Any],
        steps: list[Step],
        outer_names: set[str],
    ) -> None:
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.constants = constants
        self.steps = steps
        self.output_types: list[int] = []  # ONNX elem types of the outputs (empty Loop/Scan results)
        self.output_dims: list[list[int | None] | None] = []  # declared output shapes, None if unknown
        self._compute_release(outer_names)

    def _compute_release(self, outer_names: set[str]) -> None:
        keep = set(self.output_names) | set(self.constants) | outer_names
        last: dict[str, int] = {}
        for k, step in enumerate(self.steps):
            for name in _step_reads(step):
                last[name] = k
        produced = set(self.input_names)
        for step in self.steps:
            produced.update(o for o in step.outputs if o)
        release: dict[int, list[str]] = {}
        for name, k in last.items():
            if name in produced and name not in keep:
                release.setdefault(k, []).append(name)
        for k, step in enumerate(self.steps):
            step.release = tuple(release.get(k, ()))
            # Outputs nobody reads are dropped at once.
            for o in step.outputs:
                if o and o not in last and o not in keep:
                    step.release += (o,)

    def run(self, inputs: Sequence[Any], parent: Frame | None) -> list[Any]:
        values = dict(self.constants)
        for name, value in zip(self.input_names, inputs):
            values[name] = value
        frame = Frame(values, parent)
        get = frame.get
        for step in self.steps:
            args = [None if (i in step.packed or not n) else (values[n] if n in values else get(n)) for i, n in enumerate(step.inputs)]
            try:
                if step.needs_frame:
                    outs = step.kernel.run_in_frame(frame, *args)
                elif step.needs_context:
                    outs = step.kernel.run(*args, context=frame.visible())
                else:
                    outs = step.kernel.run(*args)
            except RuntimeFailure:
                raise
            except Exception as exc:
                raise RuntimeFailure(f"{step.label} in graph {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
            for name, value in zip(step.outputs, outs):
                if name:
                    values[name] = value if isinstance(value, (np.ndarray, list)) or value is None else np.asarray(value)
            for name in step.release:
                values.pop(name, None)
        try:
            return [values[n] if n in values else get(n) for n in self.output_names]
        except KeyError as exc:
            raise RuntimeFailure(f"graph {self.name!r}: output {exc.args[0]!r} was not produced") from None


def _step_reads(step: Step) -> list[str]:
    """Every name the step reads: its inputs and its subgraphs' implicit inputs."""
    return [n for n in (*step.inputs, *step.implicit) if n]
