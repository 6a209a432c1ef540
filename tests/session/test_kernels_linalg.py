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


# -- float32 panels (pack_panels, the JIT GEMM of _sgemm_jit) ---------------------------------------
# The JIT sums each output in float32 along K with fused multiply-adds, BLAS in its own blocked
# order: both are within a few float32 ulps of the float64 product times sqrt(K); the tolerance
# below is rtol 1e-5 / atol 1e-5 on values of order 1 (K up to 1,100).
PANEL_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [64, 100, 130, 192, 1000])
@pytest.mark.usefixtures("panels_on")
def test_pack_panels_holds_every_column_and_zero_padding(n):
    from onnxpack.session.kernels.linalg import PANEL, pack_panels, packed_shape, uses_panels

    b = np.arange(7 * n, dtype=np.float32).reshape(7, n)
    p = pack_panels(b)  # (any width: the kernels' helper; uses_panels decides where it is used)
    assert p.shape == (-(-n // PANEL), 7, PANEL) and p.flags.c_contiguous
    unpacked = p.transpose(1, 0, 2).reshape(7, -1)
    np.testing.assert_array_equal(unpacked[:, :n], b)
    assert not unpacked[:, n:].any()
    assert not uses_panels(np.float64, (7, n))
    # Panels where the last one's zero padding is at most a quarter of N.
    assert uses_panels(np.float16, (7, n)) == uses_panels(np.float32, (7, n)) == (n in (64, 192, 1000))
    for cols, want in ((63, False), (65, False), (100, False), (103, True), (127, True), (130, False),
                       (200, False), (205, True), (260, True)):
        assert uses_panels(np.float32, (7, cols)) == want, cols
        assert packed_shape(np.float32, 7, cols) == ((-(-cols // PANEL), 7, PANEL) if want else (7, cols))


@pytest.mark.parametrize("forced,flags,want", [(None, {"avx2", "avx512f"}, True), (None, {"avx2", "fma"}, False),
                                               (None, set(), False), ("1", {"avx2"}, True), ("0", {"avx512f"}, False)],
                         ids=["avx512", "avx2", "unknown", "forced-on", "forced-off"])
def test_panels_only_where_they_pay(forced, flags, want, monkeypatch):
    """By default panels only on CPUs with AVX-512 (on AVX2 OpenBLAS beat the JIT GEMM), read from
    the CPU's flags; ONNXPACK_PANELS=1/0 forces them on/off; numba is needed either way."""
    from onnxpack.session.kernels import _act, _native, linalg

    monkeypatch.setattr(_native, "cpu_flags", lambda: frozenset(flags))
    if forced is None:
        monkeypatch.delenv("ONNXPACK_PANELS", raising=False)
    else:
        monkeypatch.setenv("ONNXPACK_PANELS", forced)
    assert linalg.uses_panels(np.float32, (40, 128)) == (want and _act.jit_possible())
    monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    assert not linalg.uses_panels(np.float32, (40, 128))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "numpy"])
@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 64), (5, 3, 100), (6, 40, 64), (7, 600, 130), (32, 384, 384),
                                   (100, 1100, 70), (0, 8, 64), (3, 0, 64), (131, 50, 64), (65, 20, 3200),
                                   (8, 300, 128), (20, 130, 192)])
def test_matmul_panels_equals_float64_product(m, k, n, threads, jit, monkeypatch):
    """Every row remainder (6, 4, 2 and 1-row tiles; 8 left as two 4-row tiles), a last panel
    narrower than 64, K past one
    block of KC rows (several, and not a multiple of it), empty operands, one and two threads
    (split by rows from 64 of them and fewer than 48 panels, else by panels), the JIT and numpy's
    batched BLAS."""
    from onnxpack.session.kernels import _act
    from onnxpack.session.kernels.linalg import matmul_panels, pack_panels

    monkeypatch.setenv("ONNXPACK_NUM_THREADS", threads)
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)  # split even the small ones
    if not jit:
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    elif _act.load_jit("_sgemm_jit", "test") is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(m * 7 + k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = (rng.standard_normal((k, n)) / np.sqrt(max(k, 1))).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    got = matmul_panels(a, pack_panels(b), n)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, **PANEL_TOL)
    out = np.full((m, n), np.nan, np.float32)
    assert matmul_panels(a[:, ::1], pack_panels(b), n, out) is out
    np.testing.assert_allclose(out, want, **PANEL_TOL)
    if m > 1 and k > 1:  # a non-contiguous A and a non-contiguous output
        wide = np.zeros((m, 2 * k), np.float32)
        wide[:, ::2] = a
        out2 = np.zeros((m, 2 * n), np.float32)[:, ::2]
        matmul_panels(wide[:, ::2], pack_panels(b), n, out2)
        np.testing.assert_allclose(out2, want, **PANEL_TOL)


@pytest.mark.parametrize("n", [150, 364], ids=["small-weight", "prefetched-weight"])
@pytest.mark.parametrize("m", [8, 14, 20, 33])
def test_panel_gemm_rows_do_not_depend_on_their_tile(m, n):
    """Each output row is its own chain of fused multiply-adds over K in order, whichever tile
    (6, 4, 2 or 1 rows) computes it and whether the kernel prefetches meanwhile (a weight from
    PREFETCH_MIN floats): a row alone gives the bits it has among others (K over three KC
    blocks, a narrow last panel).  Up to six short rows (``SMALL_A``) run each panel over all of K
    at once: the same bits again, alone and three at a time."""
    from onnxpack.session.kernels import _act
    from onnxpack.session.kernels.linalg import pack_panels

    jit = _act.load_jit("_sgemm_jit", "test")
    if jit is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(m)
    k = 3 * jit.KC + 5
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = pack_panels(rng.standard_normal((k, n)).astype(np.float32))
    assert (w.size >= jit.PREFETCH_MIN) == (n == 364)
    out, tail = np.empty((m, n), np.float32), np.empty((m, 64), np.float32)
    jit.sgemm_panels(a, w.reshape(-1), out, tail, 0, w.shape[0])
    for r in range(m):
        one, t1 = np.empty((1, n), np.float32), np.empty((1, 64), np.float32)
        jit.sgemm_panels(a[r:r + 1].copy(), w.reshape(-1), one, t1, 0, w.shape[0])
        np.testing.assert_array_equal(one[0].view(np.uint32), out[r].view(np.uint32))
    assert 3 * k <= jit.SMALL_A
    for r in range(0, m - 2, 3):
        three, t3 = np.empty((3, n), np.float32), np.empty((3, 64), np.float32)
        jit.sgemm_panels(a[r:r + 3].copy(), w.reshape(-1), three, t3, 0, w.shape[0])
        np.testing.assert_array_equal(three.view(np.uint32), out[r:r + 3].view(np.uint32))


@pytest.mark.parametrize("case", [("3d", (2, 5, 40), (40, 128), {}), ("vec", (40,), (40, 192), {}),
                                  ("gemm-tb", (5, 40), (260, 40), dict(transB=1, alpha=0.5)),
                                  ("gemm-ta", (40, 7), (40, 320), dict(transA=1))], ids=lambda c: c[0])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.usefixtures("panels_on")
def test_wide_weights_run_from_panels(case, dtype):
    """MatMul and Gemm with a constant B of >= 64 columns pack panels and agree with onnx.reference
    and with the unpacked run; float16 weights are panels of float32."""
    name, sa, sb, attrs = case
    rng = np.random.default_rng(6)
    a = rand(rng, sa, dtype)
    b = rand(rng, sb, dtype, 1 / np.sqrt(40))
    op = "Gemm" if name.startswith("gemm") else "MatMul"
    node = make_node(op, ["a", "b"], ["y"], **attrs)
    k = _kernel(node)
    info = TensorInfo("b", b.dtype, b.shape, TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT)
    spec = k.pack_spec(1, info)
    assert spec is not None and not spec.identity
    (buf,) = k.prepack(1, b)
    assert buf.ndim == 3 and buf.dtype == np.float32
    assert k.check_packed(1, info, (buf,)) is None
    assert k.check_packed(1, info, (buf.reshape(buf.shape[1], -1),)) is not None
    packed = run_native(node, [a, b], 13, pack=[1])
    plain = run_native(node, [a, b], 13)
    assert packed[0].dtype == dtype and packed[0].shape == plain[0].shape
    assert_close(packed, run_reference(node, [a, b], 13), dtype)
    tol = PANEL_TOL if dtype == np.float32 else dict(rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(packed[0].astype(np.float64), plain[0].astype(np.float64), **tol)


@pytest.mark.usefixtures("panels_on")
def test_a_weight_of_64_columns_is_its_own_panel():
    """Exactly 64 float32 columns: the panel is the weight's own bytes (an identity pack, never
    saved twice); float16 still converts."""
    b = np.random.default_rng(7).standard_normal((40, 64)).astype(np.float32)
    for op, attrs in (("MatMul", {}), ("Gemm", {})):
        k = _kernel(make_node(op, ["a", "b"], ["y"], **attrs))
        spec = k.pack_spec(1, TensorInfo("b", b.dtype, b.shape, TensorProto.FLOAT))
        (buf,) = k.prepack(1, b)
        assert spec.identity and buf.shape == (1, 40, 64) and np.shares_memory(buf, b)
    k = _kernel(make_node("Gemm", ["a", "b"], ["y"], alpha=2.0))
    assert not k.pack_spec(1, TensorInfo("b", b.dtype, b.shape, TensorProto.FLOAT)).identity
    h = b.astype(np.float16)
    k = _kernel(make_node("MatMul", ["a", "b"], ["y"]))
    assert not k.pack_spec(1, TensorInfo("b", h.dtype, h.shape, TensorProto.FLOAT16)).identity
    (buf,) = k.prepack(1, h)
    assert buf.dtype == np.float32 and not np.shares_memory(buf, h)


@pytest.mark.usefixtures("panels_on")
def test_panels_refuse_a_of_another_type():
    node = make_node("MatMul", ["a", "b"], ["y"])
    k = _kernel(node)
    b = np.ones((8, 64), np.float32)
    k.pack_spec(1, TensorInfo("b", b.dtype, b.shape, TensorProto.FLOAT))
    k.use_prepacked(1, k.prepack(1, b))
    from onnxpack.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="one type"):
        k.run(np.ones((2, 8), np.float64))



@pytest.mark.usefixtures("panels_on")
def test_without_the_jit_weights_stay_k_by_n_and_keys_tell_the_layouts_apart(monkeypatch, tmp_path):
    """Without numba (ONNXPACK_DISABLE_JIT=1) a wide float32 weight keeps the (K, N) identity
    pack (numpy's BLAS multiplies it faster than panels); the two layouts have different keys,
    so one container shared by a JIT session and a numpy session gives each its own layout and
    both the right result."""
    import onnx
    from onnx import helper, numpy_helper

    import onnxpack
    from onnxpack.session.kernels import _act

    if not _act.jit_possible():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(9)
    w = rng.standard_normal((40, 128)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 40])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 128])],
                          [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = rng.standard_normal((3, 40)).astype(np.float32)
    want = x.astype(np.float64) @ w
    container = onnxpack.PrepackedWeightsContainer()
    jit_sess = onnxpack.InferenceSession(model, prepacked_weights_container=container)
    monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    k = _kernel(make_node("MatMul", ["a", "b"], ["y"]))
    info = TensorInfo("b", w.dtype, w.shape, TensorProto.FLOAT)
    spec = k.pack_spec(1, info)
    assert spec.identity and k.expected_packed(1, info) == [(np.dtype(np.float32), (40, 128))]
    (buf,) = k.prepack(1, w)
    assert buf.shape == (40, 128) and np.shares_memory(buf, w)
    numpy_sess = onnxpack.InferenceSession(model, prepacked_weights_container=container)
    (e_np,) = numpy_sess.get_prepack_log()
    monkeypatch.delenv("ONNXPACK_DISABLE_JIT")
    (e_jit,) = jit_sess.get_prepack_log()
    assert e_np["key"] != e_jit["key"] and e_np["origin"] == "packed"  # not the JIT session's panels
    for sess in (jit_sess, numpy_sess):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, **PANEL_TOL)


EINSUM_CASES = {
    "maxvit-spaces-5d": ("B G H I D, B G H J D -> B G H I J", [(1, 4, 2, 16, 8), (1, 4, 2, 16, 8)]),
    "matmul": ("ij,jk->ik", [(5, 7), (7, 3)]),
    "implicit-output": ("ij,jk", [(5, 7), (7, 3)]),
    "ellipsis-batch": ("...ij,...jk->...ik", [(2, 3, 4, 5), (2, 3, 5, 6)]),
    "three-operands": ("ab,bc,cd->ad", [(3, 4), (4, 5), (5, 2)]),
    "trace-and-sum": ("ii->", [(6, 6)]),
    "transpose": ("abc->cab", [(2, 3, 4)]),
    "outer": ("i,j->ij", [(5,), (3,)]),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64], ids=["f32", "f16", "i64"])
@pytest.mark.parametrize("case", list(EINSUM_CASES), ids=list(EINSUM_CASES))
def test_einsum_is_native_and_matches_onnxruntime(case, dtype):
    """Einsum runs natively (no onnx.reference fallback) and equals onnxruntime: spaces in the
    equation (torchvision's MaxViT writes them), ellipses, an implicit output, several operands,
    traces and transposes, in float32, float16 and int64 (the inputs' dtype kept)."""
    import onnxruntime as ort
    from onnx import helper

    import onnxpack

    eq, shapes = EINSUM_CASES[case]
    rng = np.random.default_rng(len(case))
    xs = [(rng.standard_normal(s) * 3).astype(dtype) for s in shapes]
    names = [f"x{i}" for i in range(len(xs))]
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph([helper.make_node("Einsum", names, ["y"], equation=eq)], "g",
                              [helper.make_tensor_value_info(n, et, list(x.shape)) for n, x in zip(names, xs)],
                              [helper.make_tensor_value_info("y", et, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    feeds = dict(zip(names, xs))
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    sess = onnxpack.InferenceSession(model)
    got = sess.run(None, feeds)[0]
    assert sess.get_fallback_nodes() == []
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {np.float32: 1e-5, np.float16: 2e-2, np.int64: 0}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                               atol=tol * max(1.0, float(np.abs(want.astype(np.float64)).max())))


@pytest.mark.parametrize("eq,match", [("ij,jk->ik->i", "form"), ("ij;jk->ik", "form"), ("ij->ik,j", "form"),
                                      ("ij,jk,kl->il", "3 input term"), ("", "non-empty")])
def test_einsum_equation_that_does_not_fit_the_node_is_an_invalid_graph(eq, match):
    """A malformed equation, or one whose terms do not match the node's inputs, is refused at
    creation with the node named; operands that do not fit the equation are the run's error."""
    from onnx import helper

    import onnxpack
    from onnxpack.errors import InvalidArgument, InvalidGraph, OnnxpackError

    F = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("Einsum", ["a", "b"], ["y"], name="e", equation=eq)], "g",
                              [helper.make_tensor_value_info("a", F, [2, 3]), helper.make_tensor_value_info("b", F, [3, 4])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    with pytest.raises(InvalidGraph, match=match):
        onnxpack.InferenceSession(model)
    good = helper.make_graph([helper.make_node("Einsum", ["a", "b"], ["y"], name="e", equation="ij,jk->ik")], "g",
                             [helper.make_tensor_value_info("a", F, None), helper.make_tensor_value_info("b", F, None)],
                             [helper.make_tensor_value_info("y", F, None)])
    sess = onnxpack.InferenceSession(helper.make_model(good, opset_imports=[helper.make_opsetid("", 17)],
                                                       ir_version=8).SerializeToString())
    with pytest.raises(OnnxpackError, match="Einsum") as info:
        sess.run(None, {"a": np.ones((2, 3), np.float32), "b": np.ones((4, 4), np.float32)})
    assert isinstance(info.value, InvalidArgument) or "do not fit" in str(info.value)
