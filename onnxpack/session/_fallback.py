"""Kernels for every op without a native one: onnx.reference's implementation, bound once."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import onnx
from onnx import FunctionProto, NodeProto, helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpFunction, RuntimeContextError

from onnxpack.errors import KernelNotFoundError
from onnxpack.graph import subgraphs_of
from onnxpack.session.kernels import Kernel, KernelContext

logger = logging.getLogger(__name__)

__all__ = ["FallbackKernel"]


class FallbackKernel(Kernel):
    """Runs a node through onnx.reference (so every valid model runs, if slowly).

    The node is wrapped in a one-node graph (onnx.reference ignores ``opsets`` for a bare
    NodeProto and would pick the newest version of the op) and its implementation instantiated
    once, at session creation.  Ops whose implementation depends on input types (context-dependent
    functions such as GroupNormalization) are instantiated at the first run per input-type
    signature.  Nodes with graph attributes get the enclosing scopes' values as ``context``.
    """

    fallback = True

    def __init__(self, node: NodeProto, ctx: KernelContext, functions: list[FunctionProto] | None = None) -> None:
        if ctx.inline is not None and next(subgraphs_of(node), None) is not None:
            node = ctx.inline(node)  # external tensors of its graphs through the checked loader
        super().__init__(node, ctx)
        self._opsets = {("" if d == "ai.onnx" else d): v for d, v in ctx.opsets.items()}
        self._opsets.setdefault("", onnx.defs.onnx_opset_version())
        self._opsets.setdefault(node.domain, ctx.opset)
        self._functions = functions or None
        self._by_types: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._impl: Any = None
        try:
            self._impl = self._instantiate(None)
            if isinstance(self._impl, OpFunction) and not self._impl.need_context():
                # Function-bodied ops (e.g. GroupNormalization-21) expand by input types.
                self._impl = None
        except RuntimeContextError:
            self._impl = None  # needs input types: built at the first run
        except Exception as exc:  # onnx.reference raises many types for an unknown op
            raise KernelNotFoundError(
                f"node {node.name!r}: no native kernel and onnx.reference has none for "
                f"{node.domain or 'ai.onnx'}::{node.op_type} at opset {ctx.opset} ({exc})"
            ) from exc
        if self._impl is not None and self._impl.need_context():
            self.call_mode = "context"  # graph attributes: it reads enclosing scopes' values

    def _instantiate(self, types: tuple | None) -> Any:
        node = self.node
        inputs = []
        for k, name in enumerate(node.input):
            if types is not None and k < len(types) and types[k] is not None:
                inputs.append(helper.make_tensor_value_info(name, types[k][0], [None] * types[k][1]))
            else:
                inputs.append(helper.make_value_info(name, onnx.TypeProto()))
        graph = helper.make_graph(
            [node], "fallback", [i for i in inputs if i.name],
            [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o],
        )
        if types is not None:
            # Context-dependent: a whole typed one-node model, run as a whole.
            model = helper.make_model(
                graph, opset_imports=[helper.make_opsetid(d, v) for d, v in self._opsets.items()],
                functions=self._functions or None,
            )
            return ReferenceEvaluator(model)
        evaluator = ReferenceEvaluator(graph, opsets=self._opsets, functions=self._functions)
        return evaluator.rt_nodes_[0]

    def run(self, *inputs: np.ndarray | None, context: dict[str, Any] | None = None) -> tuple:
        impl = self._impl
        if impl is None:
            sig = tuple(
                (helper.np_dtype_to_tensor_dtype(x.dtype), x.ndim) if isinstance(x, np.ndarray) else None for x in inputs
            )
            with self._lock:
                evaluator = self._by_types.get(sig)
                if evaluator is None:
                    evaluator = self._by_types[sig] = self._instantiate(sig)
            feeds = {n: x for n, x in zip(self.node.input, inputs) if n and x is not None}
            return tuple(evaluator.run(None, feeds))
        # onnx.reference treats trailing None inputs as absent; it wants them dropped.
        args = list(inputs)
        while args and args[-1] is None:
            args.pop()
        if impl.need_context():
            out = impl.run(*args, context=context or {})
        else:
            out = impl.run(*args)
        return tuple(out)
