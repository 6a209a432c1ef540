"""If, Loop and Scan: run their body graphs' compiled plans with the caller's frame.

A control-flow kernel gets its subgraphs' plans from ``KernelContext.subgraphs`` (compiled
bottom-up, so they exist before the node is bound) and runs them through the same step loop
(``plan.run(inputs, frame)``), so names of enclosing scopes resolve through the frame chain.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxpack.errors import InvalidGraph
from onnxpack.graph._proto import NodeProto, tensor_dtype_to_np_dtype
from onnxpack.session.kernels._base import Kernel, KernelContext, register

__all__ = ["ControlFlowKernel", "If", "Loop", "Scan"]

# Frames and plans are the executor's types (session/_program.py); kernels only call
# ``plan.run(inputs, frame)`` and read ``output_names``/``output_types``/``output_dims``.
Frame = Any
Plan = Any


class ControlFlowKernel(Kernel):
    """Base of kernels that own subgraphs; they run with access to the caller's frame."""

    call_mode = "frame"

    def __init__(self, node: NodeProto, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.subgraphs: dict[str, Plan] = dict(ctx.subgraphs)


@register("If", since=1)
class If(ControlFlowKernel):
    def __init__(self, node: NodeProto, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        then, other = self.subgraphs.get("then_branch"), self.subgraphs.get("else_branch")
        if then is None or other is None:
            raise InvalidGraph(f"node {node.name!r} (If): needs both then_branch and else_branch graphs")
        n_out = len(node.output)
        for label, branch in (("then_branch", then), ("else_branch", other)):
            if len(branch.output_names) != n_out:
                raise InvalidGraph(
                    f"node {node.name!r} (If): {label} has {len(branch.output_names)} outputs, the node {n_out}")
        for k, (a, b) in enumerate(zip(then.output_types, other.output_types)):
            if a and b and a != b:
                from onnx import helper  # an error's wording only

                raise InvalidGraph(
                    f"node {node.name!r} (If): output {k} is {helper.tensor_dtype_to_string(a)} in then_branch "
                    f"but {helper.tensor_dtype_to_string(b)} in else_branch")

    def run_in_frame(self, frame: Frame, cond: Any) -> tuple:
        branch = self.subgraphs["then_branch"] if bool(np.asarray(cond).reshape(-1)[0]) else self.subgraphs["else_branch"]
        return tuple(branch.run([], frame))


@register("Loop", since=1)
class Loop(ControlFlowKernel):
    """Loop (opset 1+): ``M`` trip count and ``cond`` both optional; scan outputs are stacked.

    The body's ``iter_num`` input is a scalar by the spec, but exporters (and onnxruntime's own
    test data) declare it as a 1-element tensor (``int64[1]``) and ``Squeeze`` it in the body.
    onnxruntime feeds it with the rank the body declares: a declared rank other than 0 gets shape
    ``[1]``, a scalar or undeclared shape a scalar.  So do we.  (It does the same for ``cond``,
    but refuses, at shape inference, a body declaring ``cond`` with rank 1: only iter_num matters.)
    """

    def __init__(self, node: NodeProto, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        rank = _declared_rank(body.input[0]) if body is not None and body.input else 0
        self._iter_shape = (1,) if rank else ()

    def run_in_frame(self, frame: Frame, m: Any = None, cond: Any = None, *v_initial: Any) -> tuple:
        body = self.subgraphs["body"]
        n_state = len(v_initial)
        n_scan = len(body.output_names) - 1 - n_state
        max_trips = int(np.asarray(m).reshape(-1)[0]) if m is not None else None
        keep_going = bool(np.asarray(cond).reshape(-1)[0]) if cond is not None else True
        state = list(v_initial)
        scans: list[list[np.ndarray]] = [[] for _ in range(n_scan)]
        i = 0
        # A body without steps never reaches the run's terminate check: the loop checks itself.
        control = frame.control if not body.steps else None
        while keep_going and (max_trips is None or i < max_trips):
            if control is not None:
                control.check()
            cond_in = np.array(keep_going) if cond is not None else np.array(True)
            outs = body.run([np.full(self._iter_shape, i, dtype=np.int64), cond_in, *state], frame)
            if cond is not None:
                keep_going = bool(np.asarray(outs[0]).reshape(-1)[0])
            state = list(outs[1 : 1 + n_state])
            for k in range(n_scan):
                scans[k].append(np.asarray(outs[1 + n_state + k]))
            i += 1
        stacked = []
        for k in range(n_scan):
            if scans[k]:
                stacked.append(np.stack(scans[k]))
            else:
                stacked.append(_empty_output(body, 1 + n_state + k))
        return (*state, *stacked)


@register("Scan", since=8)
class Scan(ControlFlowKernel):
    """Scan: state variables carried, scan inputs sliced along their axes.

    Opset 8 has a leading batch axis on every input and output and an optional
    ``sequence_lens`` first input; it runs as one opset-9 scan per batch item.
    """

    def __init__(self, node: NodeProto, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.num_scan_inputs = int(self.attr("num_scan_inputs"))
        self.batched = ctx.opset < 9
        if self.batched and (self.attr("scan_input_axes") or self.attr("scan_output_axes")):
            raise NotImplementedError("Scan-8 has no axes attributes")

    def run_in_frame(self, frame: Frame, *inputs: Any) -> tuple:
        if not self.batched:
            return self._scan(frame, inputs)
        seq_lens, rest = inputs[0], inputs[1:]
        batch = np.asarray(rest[0]).shape[0]
        per_item = []
        for b in range(batch):
            items = [np.asarray(x)[b] for x in rest]
            n = len(items) - self.num_scan_inputs
            if seq_lens is not None:
                length = int(np.asarray(seq_lens).reshape(-1)[b])
                items = items[:n] + [x[:length] for x in items[n:]]
            per_item.append(self._scan(frame, items))
        n_state = len(rest) - self.num_scan_inputs
        out = []
        for k in range(len(per_item[0])):
            parts = [np.asarray(r[k]) for r in per_item]
            if k >= n_state and seq_lens is not None:
                # Items shorter than the longest sequence are zero-padded along the scan axis,
                # as onnxruntime does.
                longest = max(p.shape[0] for p in parts)
                parts = [np.pad(p, [(0, longest - p.shape[0])] + [(0, 0)] * (p.ndim - 1)) for p in parts]
            out.append(np.stack(parts))
        return tuple(out)

    def _scan(self, frame: Frame, inputs: Any) -> tuple:
        body = self.subgraphs["body"]
        m = self.num_scan_inputs
        n = len(inputs) - m
        state = list(inputs[:n])
        scan_in = [np.asarray(x) for x in inputs[n:]]
        in_axes = list(self.attr("scan_input_axes", [0] * m))
        in_dirs = list(self.attr("scan_input_directions", [0] * m))
        k_out = len(body.output_names) - n
        out_axes = list(self.attr("scan_output_axes", [0] * k_out))
        out_dirs = list(self.attr("scan_output_directions", [0] * k_out))
        views = []
        for x, axis, direction in zip(scan_in, in_axes, in_dirs):
            axis = axis + x.ndim if axis < 0 else axis
            v = np.moveaxis(x, axis, 0)
            views.append(v[::-1] if direction else v)
        length = views[0].shape[0] if views else 0
        collected: list[list[np.ndarray]] = [[] for _ in range(k_out)]
        for t in range(length):
            outs = body.run([*state, *(v[t] for v in views)], frame)
            state = list(outs[:n])
            for k in range(k_out):
                collected[k].append(np.asarray(outs[n + k]))
        results = []
        for k in range(k_out):
            if collected[k]:
                stacked = np.stack(collected[k][::-1] if out_dirs[k] else collected[k])
            else:
                stacked = _empty_output(body, n + k)
            axis = out_axes[k]
            axis = axis + stacked.ndim if axis < 0 else axis
            results.append(np.moveaxis(stacked, 0, axis) if axis else stacked)
        return (*state, *results)


def _declared_rank(value_info: Any) -> int:
    """Rank a graph input declares (0 when it declares no shape)."""
    t = value_info.type
    if t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
        return 0
    return len(t.tensor_type.shape.dim)


def _empty_output(plan: Plan, index: int) -> np.ndarray:
    """A zero-trip scan output: shape (0, *declared per-iteration shape) when the body declares a
    shape, with 0 for each unknown dimension (symbolic, missing or a legacy -1), as onnxruntime
    gives; (0,) when it declares none."""
    dims = plan.output_dims[index] if index < len(plan.output_dims) else None
    tail = () if dims is None else tuple(d if isinstance(d, int) else 0 for d in dims)
    return np.empty((0, *tail), dtype=_output_dtype(plan, index))


def _output_dtype(plan: Plan, index: int) -> np.dtype:
    elem = plan.output_types[index] if index < len(plan.output_types) else 0
    try:
        return np.dtype(tensor_dtype_to_np_dtype(elem)) if elem else np.dtype(np.float32)
    except Exception:
        return np.dtype(np.float32)
