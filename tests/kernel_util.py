"""Run one node through a native kernel, onnx.reference or onnxruntime, and compare, for kernel tests.

Oracles: :func:`run_reference` (onnx.reference, the spec's arithmetic) and :func:`run_ort`
(onnxruntime, for what onnx.reference does not implement or ignores).  :func:`assert_close`
compares with the kernel tolerances :data:`TOL`; :func:`assert_outputs_match` is the generic
comparison (exact for non-floats) the ``check`` helpers of the kernel test files share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxpack.session.kernels import KernelContext, TensorInfo, lookup

# Native vs onnxruntime / onnx.reference: both sum in another order than our BLAS calls; float16
# kernels compute in float32 and round once, the oracles may round per step (an ulp or two of a
# 100-term dot product).
TOL = {
    np.dtype(np.float64): dict(rtol=1e-10, atol=1e-12),
    np.dtype(np.float32): dict(rtol=1e-4, atol=1e-5),
    np.dtype(np.float16): dict(rtol=1e-2, atol=1e-2),
}


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


def run_ort(node, inputs: Sequence[np.ndarray | None], opset: int, *,
            initializers: Mapping[str, np.ndarray] | None = None, optimize: bool = True):
    """Run ``node`` alone through onnxruntime.

    ``inputs`` pair with ``node.input`` in order and are fed as graph inputs; ``initializers``
    (name -> array) become initializers instead.  A node in another domain gets that domain at
    version 1.  ``optimize=False`` turns graph optimizations off (no layout transforms or fusions
    between the node and the oracle's kernel).
    """
    feeds = {n: v for n, v in zip(node.input, inputs) if n and v is not None}
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in feeds.items()],
        [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o],
        [numpy_helper.from_array(v, n) for n, v in (initializers or {}).items()],
    )
    opsets = [helper.make_opsetid("", opset)]
    if node.domain:
        opsets.append(helper.make_opsetid(node.domain, 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_outputs_match(got, want, tol: Callable[[np.dtype], Mapping | None], *, equal_nan: bool = False,
                         prepare: Callable | None = None) -> None:
    """Native outputs ``got`` equal the oracle's ``want``: count, type, dtype, shape and values.

    ``tol(dtype)`` gives the ``rtol``/``atol`` for an output of that dtype, or None for an exact
    comparison (non-float outputs are always exact).  ``prepare(got, want) -> want`` may adjust
    an oracle output first (e.g. a documented dtype quirk of onnx.reference).
    """
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        w = np.asarray(w)
        if prepare is not None:
            w = prepare(g, w)
        assert isinstance(g, np.ndarray), type(g)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        t = tol(g.dtype) if g.dtype.kind == "f" else None
        if t is None:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, **t, equal_nan=equal_nan)


def assert_close(got, want, dtype) -> None:
    """Outputs equal in count, shape and dtype, values within :data:`TOL` of ``dtype``.

    Compared in float64, so a float16 tolerance is not itself rounded to float16.
    """
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), **TOL[np.dtype(dtype)])


def ort_save_optimized(src: str, dst: str, level: str = "all") -> None:
    """``src`` as onnxruntime saves it after its graph optimizations at ``level`` (basic,
    extended, all) -- ``SessionOptions.optimized_model_filepath``, what users ship."""
    so = ort.SessionOptions()
    so.graph_optimization_level = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                   "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                   "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[level]
    so.optimized_model_filepath = dst
    so.log_severity_level = 3
    ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
