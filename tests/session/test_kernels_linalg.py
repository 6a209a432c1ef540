"""MatMul and Gemm: native vs onnx.reference, packed vs unpacked, packed-buffer contract.

Tolerances: float32 rtol 1e-4 / atol 1e-5 (BLAS sums in another order); float64 rtol 1e-10;
float16 rtol 1e-2 / atol 1e-2 (we accumulate in float32 and round once, onnx.reference's
float16 matmul rounds differently); bfloat16 is checked against float32 numpy rounded to
bfloat16 (rtol 2e-2).  Integer MatMul is exact.  Packed vs unpacked: rtol 1e-6 / atol 1e-6.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

from kernel_util import assert_close, make_node, run_native, run_reference

from onnxpack.session.kernels import KernelContext, TensorInfo, lookup

PACK_TOL = dict(rtol=1e-6, atol=1e-6)
DTYPES = [np.float32, np.float16, np.float64]
DTYPE_IDS = ["f32", "f16", "f64"]


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


MATMUL_SHAPES = [
    ("2d", (3, 8), (8, 5), True),
    ("3d-a", (2, 3, 8), (8, 5), True),
    ("4d-a", (2, 2, 3, 8), (8, 5), True),
    ("vec-a", (8,), (8, 5), True),
    ("row", (1, 64), (64, 33), True),
    ("batched-b", (2, 3, 8), (2, 8, 5), False),
    ("broadcast-b", (2, 3, 8), (1, 8, 5), False),
    ("vec-b", (3, 8), (8,), False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", MATMUL_SHAPES, ids=[c[0] for c in MATMUL_SHAPES])
def test_matmul(case, dtype):
    _, sa, sb, packable = case
    rng = np.random.default_rng(0)
    a = rand(rng, sa, dtype)
    b = rand(rng, sb, dtype, 1 / np.sqrt(sb[-2] if len(sb) > 1 else sb[0]))
    node = make_node("MatMul", ["a", "b"], ["y"])
    got = run_native(node, [a, b], 13)
    assert_close(got, run_reference(node, [a, b], 13), dtype)
    if packable:
        packed = run_native(node, [a, b], 13, pack=[1])
        assert packed[0].dtype == got[0].dtype
        np.testing.assert_allclose(packed[0].astype(np.float64), got[0].astype(np.float64), **PACK_TOL)


def test_matmul_bfloat16_packed():
    rng = np.random.default_rng(1)
    a = rand(rng, (4, 16), ml_dtypes.bfloat16)
    b = rand(rng, (16, 6), ml_dtypes.bfloat16)
    node = make_node("MatMul", ["a", "b"], ["y"])
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(ml_dtypes.bfloat16)
    for pack in ([], [1]):
        (got,) = run_native(node, [a, b], 13, pack=pack)
        assert got.dtype == ml_dtypes.bfloat16
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32], ids=["i32", "i64", "u32"])
def test_matmul_integer_exact_and_not_packed(dtype):
    rng = np.random.default_rng(2)
    a = rng.integers(0, 10, (3, 4)).astype(dtype)
    b = rng.integers(0, 10, (4, 5)).astype(dtype)
    node = make_node("MatMul", ["a", "b"], ["y"])
    (got,) = run_native(node, [a, b], 13)
    np.testing.assert_array_equal(got, a @ b)
    assert got.dtype == dtype
    k = lookup("", "MatMul", 13)(node, KernelContext(13, {"": 13}))
    assert k.pack_spec(1, TensorInfo("b", b.dtype, b.shape, TensorProto.INT32)) is None


GEMM_CASES = [
    ("plain", dict(), (3, 6), (6, 4), (4,)),
    ("transA", dict(transA=1), (6, 3), (6, 4), (4,)),
    ("transB", dict(transB=1), (3, 6), (4, 6), (4,)),
    ("both-alpha-beta", dict(transA=1, transB=1, alpha=0.5, beta=2.0), (6, 3), (4, 6), (3, 4)),
    ("alpha-only", dict(alpha=-1.5), (3, 6), (6, 4), (1, 4)),
    ("scalar-c", dict(beta=0.25), (3, 6), (6, 4), ()),
    ("col-c", dict(), (3, 6), (6, 4), (3, 1)),
    ("no-c", dict(alpha=2.0), (3, 6), (6, 4), None),
    ("beta-zero", dict(beta=0.0), (3, 6), (6, 4), (3, 4)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_gemm(case, dtype):
    _, attrs, sa, sb, sc = case
    rng = np.random.default_rng(3)
    a, b = rand(rng, sa, dtype), rand(rng, sb, dtype, 0.4)
    inputs = [a, b] + ([] if sc is None else [rand(rng, sc, dtype)])
    names = ["a", "b", "c"][: len(inputs)]
    node = make_node("Gemm", names, ["y"], **attrs)
    got = run_native(node, inputs, 13)
    assert_close(got, run_reference(node, inputs, 13), dtype)
    packed = run_native(node, inputs, 13, pack=[1])
    np.testing.assert_allclose(packed[0].astype(np.float64), got[0].astype(np.float64), **PACK_TOL)


def test_gemm_old_opset_broadcast_attribute():
    rng = np.random.default_rng(4)
    a, b, c = rand(rng, (3, 5), np.float32), rand(rng, (5, 4), np.float32), rand(rng, (4,), np.float32)
    node = make_node("Gemm", ["a", "b", "c"], ["y"], broadcast=1, alpha=0.5)
    want = [0.5 * a @ b + c]
    assert_close(run_native(node, [a, b, c], 6), want, np.float32)
    assert_close(run_native(node, [a, b, c], 6, pack=[1]), want, np.float32)


def _kernel(node, opset=13):
    return lookup("", node.op_type, opset)(node, KernelContext(opset, {"": opset}))


@pytest.mark.parametrize("trans_b", [0, 1], ids=["B", "BT"])
def test_gemm_packed_layout_is_scaled_bt_fp32(trans_b):
    """Pack: float16 -> float32, (K, N) C-contiguous, alpha folded; the key attrs change with them."""
    w = np.random.default_rng(5).standard_normal((6, 4)).astype(np.float16)
    w.setflags(write=False)
    node = make_node("Gemm", ["a", "b"], ["y"], transB=trans_b, alpha=3.0)
    k = _kernel(node)
    info = TensorInfo("b", w.dtype, w.shape, TensorProto.FLOAT16)
    spec = k.pack_spec(1, info)
    assert spec is not None and spec.family == "gemm" and spec.nbuffers == 1
    (buf,) = k.prepack(1, w)
    b = w.astype(np.float32).T if trans_b else w.astype(np.float32)
    assert buf.dtype == np.float32 and buf.flags.c_contiguous
    np.testing.assert_array_equal(buf, 3.0 * b)
    assert k.expected_packed(1, info) == [(np.dtype(np.float32), buf.shape)]
    assert k.check_packed(1, info, (buf,)) is None
    assert k.check_packed(1, info, (buf.astype(np.float64),)) is not None
    other = _kernel(make_node("Gemm", ["a", "b"], ["y"], transB=1 - trans_b, alpha=3.0))
    assert other.pack_spec(1, info).attrs != spec.attrs
    assert k.pack_spec(0, info) is None


def test_matmul_pack_spec_does_not_read_bytes():
    """pack_spec/expected_packed take only TensorInfo; 1-D and 3-D B are not packed."""
    k = _kernel(make_node("MatMul", ["a", "b"], ["y"]))
    info = TensorInfo("b", np.dtype(np.float16), (8, 3), TensorProto.FLOAT16)
    assert k.expected_packed(1, info) == [(np.dtype(np.float32), (8, 3))]
    assert k.pack_spec(1, TensorInfo("b", np.dtype(np.float32), (8,), TensorProto.FLOAT)) is None
    assert k.pack_spec(1, TensorInfo("b", np.dtype(np.float32), (2, 8, 3), TensorProto.FLOAT)) is None
