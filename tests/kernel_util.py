"""Run one node through a native kernel and through onnx.reference, for kernel tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from onnxpack.session.kernels import KernelContext, TensorInfo, lookup


def make_node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], domain: str = "", **attrs):
    return helper.make_node(op_type, list(inputs), list(outputs), domain=domain or None, **attrs)


def run_native(node, inputs: Sequence[np.ndarray | None], opset: int, *, pack: Sequence[int] = ()):
    """Run ``node`` through its native kernel; inputs listed in ``pack`` go through prepack."""
    cls = lookup(node.domain, node.op_type, opset)
    assert cls is not None, f"no native kernel for {node.op_type}"
    kernel = cls(node, KernelContext(opset=opset, opsets={node.domain or "": opset}))
    feeds = list(inputs)
    for i in pack:
        w = np.asarray(feeds[i])
        info = TensorInfo(node.input[i], w.dtype, tuple(w.shape), helper.np_dtype_to_tensor_dtype(w.dtype))
        spec = kernel.pack_spec(i, info)
        assert spec is not None, f"{node.op_type} does not pack input {i}"
        w.setflags(write=False)
        buffers = kernel.prepack(i, w)
        assert kernel.check_packed(i, info, buffers) is None
        kernel.use_prepacked(i, buffers)
        feeds[i] = None  # the kernel must not read the original any more
    return kernel.run(*feeds)


def run_reference(node, inputs: Sequence[np.ndarray | None], opset: int, output_count: int | None = None):
    """Run ``node`` alone through onnx.reference (the oracle)."""
    names = list(node.input)
    feeds = {n: v for n, v in zip(names, inputs) if n and v is not None}
    domain = node.domain or ""
    opsets = [helper.make_opsetid("", opset if domain == "" else 21)]
    if domain:
        opsets.append(helper.make_opsetid(domain, opset))
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in feeds.items()],
        [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o],
    )
    model = helper.make_model(graph, opset_imports=opsets)
    ref = ReferenceEvaluator(model)
    return ref.run(None, feeds)
