"""Helpers for the quantized-kernel tests: one-node models through onnxruntime and onnxpack.

onnxruntime's Python binding cannot take or return ml_dtypes arrays (int4, float8, ...), so
:func:`ort_node` passes such inputs as initializers and appends a ``Cast`` to float32 for such
outputs.  :func:`onnxpack_node` builds the same one-node model for an ``onnxpack.InferenceSession``
with chosen inputs as initializers (the pre-packed path) and runs it with pre-packing on or off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnxpack

MS = "com.microsoft"


def is_ml_dtype(dtype: np.dtype) -> bool:
    """ml_dtypes types (int4, float8, bfloat16, ...) that onnxruntime's binding cannot take."""
    dtype = np.dtype(dtype)
    return dtype.kind == "V" or dtype.name.startswith("float8") or dtype.name.startswith("float4")


def comparable(a: np.ndarray) -> np.ndarray:
    """An array numpy can compare: ml_dtypes values widened to float32 (exactly)."""
    a = np.asarray(a)
    return a.astype(np.float32) if is_ml_dtype(a.dtype) else a


def _model(node, inputs: Sequence[np.ndarray | None], opset: int, consts: Iterable[str], ms_opset: int,
           cast_outputs: Sequence[int] = ()) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    consts = set(consts)
    feeds, inits, vis = {}, [], []
    for name, value in zip(node.input, inputs):
        if not name or value is None or name in feeds or any(t.name == name for t in inits):
            continue
        if name in consts:
            inits.append(numpy_helper.from_array(np.asarray(value), name))
        else:
            feeds[name] = value
            vis.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
    nodes = [node]
    outs = []
    for k, o in enumerate(node.output):
        if not o:
            continue
        if k in cast_outputs:
            nodes.append(helper.make_node("Cast", [o], [o + "_f32"], to=TensorProto.FLOAT))
            outs.append(helper.make_value_info(o + "_f32", onnx.TypeProto()))
        else:
            outs.append(helper.make_value_info(o, onnx.TypeProto()))
    graph = helper.make_graph(nodes, "g", vis, outs, inits)
    opsets = [helper.make_opsetid("", opset)]
    if node.domain:
        opsets.append(helper.make_opsetid(node.domain, ms_opset))
    return helper.make_model(graph, opset_imports=opsets, ir_version=10), feeds


def ort_node(node, inputs: Sequence[np.ndarray | None], opset: int, *, consts: Iterable[str] = (),
             ml_outputs: Sequence[int] = (), ms_opset: int = 1) -> list[np.ndarray]:
    """``node`` alone through onnxruntime (graph optimizations off).

    Inputs named in ``consts`` and every ml_dtypes input become initializers; outputs listed in
    ``ml_outputs`` (ml_dtypes types) come back cast to float32.
    """
    consts = set(consts) | {n for n, v in zip(node.input, inputs) if v is not None and is_ml_dtype(v.dtype)}
    model, feeds = _model(node, inputs, opset, consts, ms_opset, ml_outputs)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def onnxpack_node(node, inputs: Sequence[np.ndarray | None], opset: int, *, consts: Iterable[str] = (),
                  prepack: bool = True, ms_opset: int = 1) -> tuple[list[np.ndarray], onnxpack.InferenceSession]:
    """``node`` alone through an onnxpack session; returns (outputs, session)."""
    model, feeds = _model(node, inputs, opset, consts, ms_opset)
    so = onnxpack.SessionOptions()
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    sess = onnxpack.InferenceSession(model.SerializeToString(), so)
    return sess.run(None, feeds), sess


def assert_steps(got: np.ndarray, want: np.ndarray, steps: int = 0, *, max_fraction: float = 1.0) -> None:
    """Integer outputs equal in dtype and shape, values at most ``steps`` quantization steps apart,
    and at most ``max_fraction`` of them different at all."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    diff = np.abs(comparable(got).astype(np.float64) - comparable(want).astype(np.float64))
    assert diff.size == 0 or diff.max() <= steps, f"max difference {diff.max()} > {steps} step(s)"
    if steps:
        frac = float((diff > 0).mean()) if diff.size else 0.0
        assert frac <= max_fraction, f"{frac:.3%} of the values differ (allowed {max_fraction:.3%})"
