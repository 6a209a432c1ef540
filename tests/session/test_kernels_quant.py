"""com.microsoft::MatMulNBits vs onnxruntime (onnx.reference has no MatMulNBits).

Models come from onnxruntime's own ``MatMulNBitsQuantizer`` (symmetric: no zero points;
asymmetric: packed uint8 zero points), and hand-written nodes cover what the quantizer does not
write here: float16 scales/A, float zero points, bias, M > the blocked-path threshold.
Tolerances: float32 rtol 1e-4 / atol 1e-4 (dequantized weights are exact; sums differ in order
and onnxruntime's kernel may block K differently); float16 rtol 1e-2 / atol 2e-2.  Packed vs
unpacked: rtol 1e-5 / atol 1e-5.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from kernel_util import run_native, run_ort

from onnxpack.session.kernels.quant import dequantize_nbits

TOL = {np.dtype(np.float32): dict(rtol=1e-4, atol=1e-4), np.dtype(np.float16): dict(rtol=1e-2, atol=2e-2)}
PACK_TOL = dict(rtol=1e-5, atol=1e-5)
MS = "com.microsoft"


def ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def quantized_model(k, n, block_size, symmetric, seed=0):
    quantizer_mod = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.2).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    q = quantizer_mod.MatMulNBitsQuantizer(copy.deepcopy(model), block_size=block_size, is_symmetric=symmetric)
    q.process()
    qm = q.model.model
    (node,) = [nd for nd in qm.graph.node if nd.op_type == "MatMulNBits"]
    inits = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    return qm, node, inits, w


def feeds_for(node, a, inits):
    return [a] + [inits.get(name) if name else None for name in node.input[1:]]


QCASES = [
    ("k64-n40-b32-sym", 64, 40, 32, True),
    ("k64-n40-b32-asym", 64, 40, 32, False),
    ("k96-n24-b16-asym", 96, 24, 16, False),
    ("k100-n8-b32-asym", 100, 8, 32, False),  # K not a multiple of the block: padded last block
    ("k200-n16-b128-sym", 200, 16, 128, True),
    ("k160-n12-b32-asym-oddblocks", 160, 12, 32, False),  # 5 blocks: zero points pad a nibble
]


@pytest.mark.parametrize("m", [1, 5, 40], ids=["m1", "m5", "m40"])
@pytest.mark.parametrize("case", QCASES, ids=[c[0] for c in QCASES])
def test_quantizer_models_match_onnxruntime(case, m):
    _, k, n, bs, sym = case
    qm, node, inits, _ = quantized_model(k, n, bs, sym)
    a = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    (want,) = ort_session(qm).run(None, {"a": a})
    feeds = feeds_for(node, a, inits)
    (got,) = run_native(node, feeds, 1)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL[np.dtype(np.float32)])
    pack = [i for i in (1, 2, 3) if i < len(feeds) and feeds[i] is not None]
    (packed,) = run_native(node, feeds, 1, pack=pack)
    np.testing.assert_allclose(packed, got, **PACK_TOL)


def test_dequantized_weight_is_close_to_the_original():
    """The dequantized weight is within half a quantization step of the float weight."""
    qm, node, inits, w = quantized_model(64, 16, 32, False)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    zp = inits.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    deq = dequantize_nbits(inits[node.input[1]], inits[node.input[2]], zp, k=attrs["K"], n=attrs["N"], bits=4, block_size=32)
    assert deq.shape == w.shape
    step = np.repeat(inits[node.input[2]].reshape(16, -1).T, 32, axis=0)
    assert (np.abs(deq - w) <= step * 0.5 + 1e-6).all()


def hand_node_case(k, n, bs, *, scale_dtype, zp_kind, bias, seed=2):
    rng = np.random.default_rng(seed)
    nb = -(-k // bs)
    b = rng.integers(0, 256, (n, nb, bs // 2), dtype=np.uint8)
    scales = (rng.random((n * nb,)) * 0.1 + 0.01).astype(scale_dtype)
    inputs = ["a", "b", "s"]
    values = {"b": b, "s": scales}
    if zp_kind == "uint8":
        values["zp"] = rng.integers(0, 256, (n, -(-nb // 2)), dtype=np.uint8)
        inputs.append("zp")
    elif zp_kind == "float":
        values["zp"] = (rng.random((n * nb,)) * 15).astype(scale_dtype)
        inputs.append("zp")
    if bias:
        inputs += [""] * (5 - len(inputs)) + ["bias"]
        values["bias"] = rng.standard_normal(n).astype(scale_dtype)
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain=MS, K=k, N=n, bits=4, block_size=bs)
    return node, values


HAND = [
    ("f32-nozp", np.float32, None, False),
    ("f32-u8zp-bias", np.float32, "uint8", True),
    ("f32-floatzp", np.float32, "float", False),
    ("f16-u8zp", np.float16, "uint8", False),
    ("f16-floatzp-bias", np.float16, "float", True),
]


@pytest.mark.parametrize("m", [1, 24], ids=["m1", "m24"])
@pytest.mark.parametrize("case", HAND, ids=[c[0] for c in HAND])
def test_hand_written_nodes_match_onnxruntime(case, m):
    _, dtype, zp_kind, bias = case
    k, n, bs = 80, 12, 16
    node, values = hand_node_case(k, n, bs, scale_dtype=dtype, zp_kind=zp_kind, bias=bias)
    a = (np.random.default_rng(3).standard_normal((2, m, k)) * 0.5).astype(dtype)  # 3-D A
    (want,) = run_ort(node, [a], 17, initializers=values, optimize=False)
    names = list(node.input)
    feeds = [a] + [values.get(nm) if nm else None for nm in names[1:]]
    (got,) = run_native(node, feeds, 1)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **TOL[np.dtype(dtype)])
    pack = [i for i in (1, 2, 3) if i < len(feeds) and feeds[i] is not None]
    (packed,) = run_native(node, feeds, 1, pack=pack)
    np.testing.assert_allclose(packed.astype(np.float64), got.astype(np.float64), **PACK_TOL)


# The packed layout, the pack key, g_idx and the byte budget: tests/session/test_kernels_int4.py.
