"""Single-node models for the contrib-op tests: one node, some inputs fed, some constant.

:func:`check_all_paths` runs the same node through onnxruntime (graph optimizations off, the
oracle) and through ``onnxpack.InferenceSession`` three ways: constants as initializers (the
kernel pre-packs them), constants as initializers with ``session.disable_prepacking=1``, and
constants fed as graph inputs (nothing to pack).  All three must match the oracle.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

import onnxpack

MS = "com.microsoft"


def single_node_model(node, feeds: Mapping[str, np.ndarray], consts: Mapping[str, np.ndarray], opset: int = 21,
                      ms_opset: int = 1, out_types: Mapping[str, np.dtype] | None = None) -> onnx.ModelProto:
    """``out_types`` declares output element types where onnxruntime cannot infer them."""
    out_types = out_types or {}

    def out_vi(o):
        if o in out_types:
            return helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(np.dtype(out_types[o])), None)
        return helper.make_value_info(o, onnx.TypeProto())

    def vi(n, v):
        return helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)

    graph = helper.make_graph(
        [node], "g", [vi(n, v) for n, v in feeds.items()],
        [out_vi(o) for o in node.output if o],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in consts.items()],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS, ms_opset)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def run_ort_model(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feeds))


def run_onnxpack(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *, disable_prepacking: bool = False):
    so = onnxpack.SessionOptions()
    if disable_prepacking:
        so.add_session_config_entry("session.disable_prepacking", "1")
    sess = onnxpack.InferenceSession(model.SerializeToString(), so)
    assert not sess.get_fallback_nodes(), sess.get_fallback_nodes()
    return sess.run(None, dict(feeds)), sess.get_prepack_stats()


def assert_match(got, want, tol: Mapping | None, what: str = "") -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    for k, (g, w) in enumerate(zip(got, want)):
        w = np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, w.dtype, g.shape, w.shape)
        if g.dtype.kind != "f" or tol is None:
            np.testing.assert_array_equal(g, w, err_msg=f"{what} output {k}")
        else:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), **tol, err_msg=f"{what} output {k}")


def check_all_paths(node, feeds: Mapping[str, np.ndarray], consts: Mapping[str, np.ndarray], tol: Mapping, *,
                    packs: int = 0, opset: int = 21, want=None, out_types=None) -> list[np.ndarray]:
    """Oracle vs the three session paths; ``packs`` = how many weights the kernel must pack.

    ``want`` replaces onnxruntime as the oracle (ops onnxruntime runs only on CUDA).
    """
    model = single_node_model(node, feeds, consts, opset, out_types=out_types)
    if want is None:
        want = run_ort_model(model, feeds)
    got, stats = run_onnxpack(model, feeds)
    assert_match(got, want, tol, "prepacked")
    assert stats["weights_packed"] == packs, stats
    got2, stats2 = run_onnxpack(model, feeds, disable_prepacking=True)
    assert stats2["weights_packed"] == 0
    assert_match(got2, want, tol, "prepacking disabled")
    if consts:
        unpacked = single_node_model(node, {**feeds, **consts}, {}, opset, out_types=out_types)
        got3, _ = run_onnxpack(unpacked, {**feeds, **consts})
        assert_match(got3, want, tol, "weights as inputs")
    return want
