"""Int4/int8 block-quantized weights that stay quantized: MatMulNBits, GatherBlockQuantized and
MatMulBnb4 (FP4 / NF4: float32 rtol 1e-5 of the output's magnitude, the decoded weights being
onnxruntime's bit for bit).

Oracle: onnxruntime (onnx.reference has neither op), single-node models with graph optimizations
off.  Every MatMulNBits case runs through both compute paths — the numba kernels (``jit``,
skipped when numba is not installed) and the numpy panels (``ONNXPACK_DISABLE_JIT=1``) — and
through the packed (constant weights prepacked) and unpacked (weights fed to ``run``) paths.

Tolerances:

* vs onnxruntime with ``accuracy_level=0`` (float32 compute on both sides): the dequantized weight
  is exact in float32 on both sides, only the summation order differs (we sum per block and
  then scale, onnxruntime's float kernels scale first): float32 ``rtol=1e-4, atol=1e-4``; float16
  outputs round once from float32 on our side, onnxruntime may round intermediate sums:
  ``rtol=atol=2e-2``.
* vs onnxruntime with ``accuracy_level=4``: onnxruntime quantizes A per block to int8
  (``scale = max|a_block| / 127``), an error of at most half a step per element, so the
  per-output bound is ``sum_b max|a_b| / 254 * sum_{k in b} |W[k, n]|`` (plus the float32
  tolerance above); we assert that bound, computed from the same weights.  Where onnxpack
  quantizes A too (the JIT GEMV on a CPU with AVX-512 VNNI or AVX2), it agrees with onnxruntime and with
  a numpy model of the integer arithmetic to float32 rounding: ``rtol=1e-5`` plus 1e-5 of the
  output's largest magnitude (the scales are applied in another order).
* packed vs unpacked and jit vs numpy: the same arithmetic in another order: ``rtol=atol=1e-5``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernel_util import run_native

import onnxpack
from onnxpack import InferenceSession, PrepackedWeightsContainer, SessionOptions
from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import KernelContext, TensorInfo, lookup
from onnxpack.session import _threads, optimize
from onnxpack.session.kernels import quant
from onnxpack.session.kernels.quant import TILE, dequantize_nbits, to_tiles, unpack_nbits

MS = "com.microsoft"
F32_TOL = dict(rtol=1e-4, atol=1e-4)
F16_TOL = dict(rtol=2e-2, atol=2e-2)
SAME_TOL = dict(rtol=1e-5, atol=1e-5)
FLAG = "session.save_external_prepacked_constant_initializers"


@pytest.fixture
def path(jit_path):
    """Which compute path the kernels take (conftest's ``jit_path``: numba's kernels, the same
    kernels from the native code cache without numba, or the numpy twins); the int4 kernels are
    checked to take it too."""
    if jit_path == "numpy":
        assert not quant.jit_enabled()
    else:
        assert quant.jit_enabled() and getattr(quant._jit(), "native", False) == (jit_path == "native")
    return jit_path


# -- model builders ---------------------------------------------------------------------------------


def nbits_values(k, n, bs, bits, *, zp="uint8", sdtype=np.float32, bias=False, seed=0):
    """Random B / scales / zero points (/ bias) in onnxruntime's MatMulNBits layout."""
    rng = np.random.default_rng(seed)
    nb = -(-k // bs)
    blob = bs * bits // 8
    vals = {"b": rng.integers(0, 256, (n, nb, blob), dtype=np.uint8),
            "s": (rng.random(n * nb) * 0.05 + 0.005).astype(sdtype)}
    if zp == "uint8":
        vals["zp"] = rng.integers(0, 256, (n, -(-nb * bits // 8)), dtype=np.uint8)
    elif zp == "float":
        vals["zp"] = (rng.random(n * nb) * (2 ** bits - 1)).astype(sdtype)
    if bias:
        vals["bias"] = rng.standard_normal(n).astype(sdtype)
    return vals


def nbits_node(k, n, bs, bits, vals, *, accuracy_level=0, g_idx=False):
    inputs = ["a", "b", "s", "zp" if "zp" in vals else "", "g_idx" if g_idx else "", "bias" if "bias" in vals else ""]
    while inputs[-1] == "":
        inputs.pop()
    return helper.make_node("MatMulNBits", inputs, ["y"], domain=MS, name="mnb", K=k, N=n, bits=bits,
                            block_size=bs, accuracy_level=accuracy_level)


def single_node_model(node, a, consts, *, as_inputs=()):
    """One node; ``consts`` become initializers except names in ``as_inputs`` (graph inputs)."""
    feeds_info = [helper.make_tensor_value_info("a", helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))]
    inits = []
    for name, v in consts.items():
        if name in as_inputs:
            feeds_info.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
        else:
            inits.append(numpy_helper.from_array(v, name))
    out_elem = helper.np_dtype_to_tensor_dtype(a.dtype)
    graph = helper.make_graph([node], "g", feeds_info, [helper.make_value_info("y", onnx.TypeProto())], inits)
    graph.output[0].type.tensor_type.elem_type = out_elem
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=9)


def ort_run(model, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def options(**config) -> SessionOptions:
    so = SessionOptions()
    for k, v in config.items():
        so.add_session_config_entry(k, str(v))
    return so


def assert_vs_oracle(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    tol = F16_TOL if got.dtype == np.float16 else F32_TOL
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **tol)


# -- MatMulNBits vs onnxruntime ---------------------------------------------------------------------

# (id, K, N, block_size, bits, zero points, scale/A dtype, bias)
CASES = [
    ("b4-k64-n40-bs32-u8zp", 64, 40, 32, 4, "uint8", np.float32, False),
    ("b4-k96-n300-bs16-nozp-bias", 96, 300, 16, 4, None, np.float32, True),  # 2 full tiles + 44
    ("b4-k100-n24-bs32-u8zp", 100, 24, 32, 4, "uint8", np.float32, False),  # K % block != 0
    ("b4-k160-n130-bs32-oddblocks", 160, 130, 32, 4, "uint8", np.float32, True),  # 5 blocks: zp nibble pad
    ("b4-k256-n64-bs128-floatzp", 256, 64, 128, 4, "float", np.float32, False),
    ("b4-k72-n129-bs64-f16-u8zp", 72, 129, 64, 4, "uint8", np.float16, True),
    ("b4-k64-n40-bs16-f16-floatzp", 64, 40, 16, 4, "float", np.float16, False),
    ("b8-k64-n40-bs32-u8zp", 64, 40, 32, 8, "uint8", np.float32, False),
    ("b8-k80-n200-bs16-nozp-bias", 80, 200, 16, 8, None, np.float32, True),
    ("b8-k100-n24-bs64-floatzp", 100, 24, 64, 8, "float", np.float32, False),
    ("b8-k64-n16-bs32-f16-u8zp", 64, 16, 32, 8, "uint8", np.float16, True),
    # 2-bit codes, packed as 4-bit ones (the same values) for the 4-bit kernels
    ("b2-k64-n40-bs32-u8zp", 64, 40, 32, 2, "uint8", np.float32, False),
    ("b2-k96-n300-bs16-nozp-bias", 96, 300, 16, 2, None, np.float32, True),
    ("b2-k100-n24-bs32-u8zp", 100, 24, 32, 2, "uint8", np.float32, False),
    ("b2-k64-n40-bs16-f16-floatzp", 64, 40, 16, 2, "float", np.float16, False),
]
ROWS = [(1,), (3,), (2, 17)]  # decode, a few rows, a 3-D prefill above JIT_MAX_ROWS


@pytest.mark.parametrize("lead", ROWS, ids=["m1", "m3", "b2xm17"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matmulnbits_matches_onnxruntime(case, lead, path):
    _, k, n, bs, bits, zp, dtype, bias = case
    vals = nbits_values(k, n, bs, bits, zp=zp, sdtype=dtype, bias=bias)
    node = nbits_node(k, n, bs, bits, vals)
    a = (np.random.default_rng(1).standard_normal((*lead, k)) * 0.5).astype(dtype)
    if bits == 8 and zp == "float":
        # onnxruntime's CPU kernel refuses 8-bit weights with float zero points; the oracle is
        # then the spec's formula in float64 (dequantize_nbits is exact in float32).
        w = dequantize_nbits(vals["b"], vals["s"], vals["zp"], k=k, n=n, bits=bits, block_size=bs)
        want = (a.astype(np.float64) @ w + vals.get("bias", 0)).astype(dtype)
    else:
        (want,) = ort_run(single_node_model(node, a, vals), {"a": a})
    feeds = [a] + [vals.get(nm) if nm else None for nm in node.input[1:]]
    (unpacked,) = run_native(node, feeds, 1)
    assert_vs_oracle(unpacked, want)
    pack = [i for i in (1, 2, 3) if i < len(feeds) and feeds[i] is not None]
    (packed,) = run_native(node, feeds, 1, pack=pack)
    np.testing.assert_allclose(packed.astype(np.float64), unpacked.astype(np.float64), **SAME_TOL)


@pytest.mark.parametrize("m", [1, 40], ids=["m1", "m40"])
def test_jit_and_numpy_paths_agree(m, monkeypatch):
    pytest.importorskip("numba")
    vals = nbits_values(200, 333, 32, 4, zp="uint8", bias=True, seed=5)
    node = nbits_node(200, 333, 32, 4, vals)
    a = np.random.default_rng(6).standard_normal((m, 200)).astype(np.float32)
    feeds = [a] + [vals.get(nm) if nm else None for nm in node.input[1:]]
    monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    (by_numpy,) = run_native(node, feeds, 1, pack=[1, 2, 3])
    monkeypatch.delenv("ONNXPACK_DISABLE_JIT")
    (by_jit,) = run_native(node, feeds, 1, pack=[1, 2, 3])
    want = a @ dequantize_nbits(vals["b"], vals["s"], vals["zp"], k=200, n=333, bits=4, block_size=32) + vals["bias"]
    np.testing.assert_allclose(by_jit, by_numpy, **SAME_TOL)
    np.testing.assert_allclose(by_jit, want, **SAME_TOL)


def test_stall_guard_policy():
    """A parallel GEMV slower than the threshold turns parallel calls off for a span: SERIAL_MIN_S
    after a quiet period, doubling while stalls keep following the spans, up to SERIAL_FOR_S."""
    g = quant._StallGuard()
    assert g.parallel_allowed(100.0)
    mb = 3_000_000  # 1 ms at SERIAL_BYTES_PER_S
    g.record(g.STALL_SECONDS + 0.0009, mb, 100.0)  # within the threshold
    assert g.parallel_allowed(100.0) and g.stalls == 0
    g.record(g.STALL_SECONDS + 0.0011, mb, 100.0)  # a stall
    assert g.stalls == 1
    assert not g.parallel_allowed(100.0 + g.SERIAL_MIN_S - 0.001)
    assert g.parallel_allowed(100.0 + g.SERIAL_MIN_S)
    now, spans = 100.0 + g.SERIAL_MIN_S, []
    for _ in range(8):  # stalls right after each span: the machine stays loaded
        g.record(1.0, mb, now)
        spans.append(round(g.until - now, 6))
        now = g.until
    assert spans[:3] == [2 * g.SERIAL_MIN_S, 4 * g.SERIAL_MIN_S, 8 * g.SERIAL_MIN_S], spans
    assert spans[-1] == g.SERIAL_FOR_S and max(spans) == g.SERIAL_FOR_S, spans
    g.record(1.0, mb, now + g.QUIET_S + 1)  # after a quiet period: the shortest span again
    assert g.until - (now + g.QUIET_S + 1) == pytest.approx(g.SERIAL_MIN_S)
    # a kernel's first call (first touch of its pages) is not counted; its second is
    stalls = g.stalls
    g.record(10.0, mb, 200.0, key="k")
    assert g.stalls == stalls and g.parallel_allowed(200.0)
    g.record(10.0, mb, 200.0, key="k")
    assert g.stalls == stalls + 1 and not g.parallel_allowed(200.0)


def test_decode_after_a_stall_runs_serial_and_matches(monkeypatch):
    """After a stall the GEMV takes the serial kernel, with the same values."""
    pytest.importorskip("numba")
    monkeypatch.delenv("ONNXPACK_DISABLE_JIT", raising=False)
    k, n = 512, 8192  # m*k*n above JIT_SERIAL_BELOW: the parallel GEMV
    vals = nbits_values(k, n, 32, 4, zp="uint8", seed=13)
    node = nbits_node(k, n, 32, 4, vals)
    kern = lookup(MS, "MatMulNBits", 1)(node, KernelContext(1, {MS: 1, "": 17}))
    for i, name in ((1, "b"), (2, "s"), (3, "zp")):
        kern.use_prepacked(i, kern.prepack(i, vals[name]))
    a = np.random.default_rng(14).standard_normal((1, k)).astype(np.float32)
    jit = quant._jit()
    guard = quant._StallGuard()
    monkeypatch.setattr(quant, "_stall_guard", guard)
    if quant._parallel_ok() and jit.threads() > 1:
        assert kern._gemv_call(jit, a, kern._packed[1], kern._packed[2], kern._packed[3])[0] == jit.gemv4
    (before,) = kern.run(a)
    guard.until = float("inf")
    assert kern._gemv_call(jit, a, kern._packed[1], kern._packed[2], kern._packed[3])[0] == jit.gemv4_serial
    (after,) = kern.run(a)
    np.testing.assert_array_equal(after, before)
    want = a.astype(np.float64) @ dequantize_nbits(vals["b"], vals["s"], vals["zp"], k=k, n=n, bits=4, block_size=32)
    np.testing.assert_allclose(after, want, **F32_TOL)


@pytest.mark.parametrize("jit_path", ["numba", "native"], indirect=True)
def test_a_one_thread_runs_gemv_is_serial_on_either_jit(jit_path, monkeypatch):
    """Inside a one-thread session's run (``_act.one_thread``) the GEMV takes the serial kernel,
    on numba's module as on the native code cache (numba's thread count is the machine's cores:
    its parallel GEMV ran on all of them whatever ``intra_op_num_threads`` said), with the same
    values as the parallel one."""
    from onnxpack.session.kernels import _act

    monkeypatch.delenv("ONNXPACK_NUM_THREADS", raising=False)
    k, n = 512, 8192  # m*k*n above JIT_SERIAL_BELOW: the parallel GEMV
    vals = nbits_values(k, n, 32, 4, zp="uint8", seed=15)
    kern = lookup(MS, "MatMulNBits", 1)(nbits_node(k, n, 32, 4, vals), KernelContext(1, {MS: 1, "": 17}))
    for i, name in ((1, "b"), (2, "s"), (3, "zp")):
        kern.use_prepacked(i, kern.prepack(i, vals[name]))
    monkeypatch.setattr(quant, "_stall_guard", quant._StallGuard())
    monkeypatch.setattr(quant._stall_guard, "record", lambda *a, **k: None)
    a = np.random.default_rng(16).standard_normal((1, k)).astype(np.float32)
    jit = quant._jit()
    assert getattr(jit, "native", False) == (jit_path == "native")

    def gemv():
        return kern._gemv_call(jit, a, kern._packed[1], kern._packed[2], kern._packed[3])[0]

    with _threads.blas_threads(2):  # a two-thread setting outside the one-thread run
        if quant._parallel_ok() and jit.threads() > 1 and _act.threads() > 1:
            assert gemv() != jit.gemv4_serial
        (wide,) = kern.run(a)
    with _threads.blas_threads(1), _act.one_thread():
        assert gemv() == jit.gemv4_serial
        (one,) = kern.run(a)
    np.testing.assert_array_equal(one, wide)


@pytest.mark.parametrize("jit_path", ["native"], indirect=True)
def test_repeated_calls_take_the_kept_plan_and_still_decide_threads(jit_path, monkeypatch):
    """A call with the shape of this thread's last one (and the same bias array) repeats its
    native plan (``_repeat``): the values are the full path's; a new shape, another thread, a
    moved serial cut, a stall or another bias makes the full path decide again, and the repeat
    then follows that decision."""
    k, n = 512, 8192  # m*k*n above JIT_SERIAL_BELOW: the parallel GEMV
    vals = nbits_values(k, n, 32, 4, zp="uint8", seed=21, bias=True)
    kern = lookup(MS, "MatMulNBits", 1)(nbits_node(k, n, 32, 4, vals), KernelContext(1, {MS: 1, "": 17}))
    for i, name in ((1, "b"), (2, "s"), (3, "zp")):
        kern.use_prepacked(i, kern.prepack(i, vals[name]))
    guard = quant._StallGuard()
    monkeypatch.setattr(guard, "record", lambda *a, **k: None)  # stalls only where the test sets them
    monkeypatch.setattr(quant, "_stall_guard", guard)
    repeats = []
    real = quant.MatMulNBits._repeat

    def counted(self, a, bias):
        y = real(self, a, bias)
        repeats.append(y is not None)
        return y

    monkeypatch.setattr(quant.MatMulNBits, "_repeat", counted)
    rng = np.random.default_rng(22)
    w = dequantize_nbits(vals["b"], vals["s"], vals["zp"], k=k, n=n, bits=4, block_size=32)

    bias = vals["bias"]

    def check(a, b=bias):
        (y,) = kern.run(a, None, None, None, None, b)
        assert y.shape == (*a.shape[:-1], n) and y.dtype == np.float32
        np.testing.assert_allclose(y, a.astype(np.float64) @ w + (0 if b is None else b), **F32_TOL)
        return y

    a = rng.standard_normal((1, 1, k)).astype(np.float32)
    first = check(a)
    assert kern._again is not None and repeats == []
    np.testing.assert_array_equal(check(a), first)  # the repeat: the same plan, the same values
    assert repeats == [True]
    parallel = kern._again[7] > 1
    check(rng.standard_normal((3, k)).astype(np.float32))  # another shape: the full path
    assert repeats[-1] is False and kern._again[1] == (3, k)
    b = rng.standard_normal((3, k)).astype(np.float32)
    check(b)
    assert repeats[-1] is True
    if parallel:
        guard.until = float("inf")  # a stall: serial from here, and the repeat follows
        np.testing.assert_array_equal(check(b), kern.run(np.ascontiguousarray(b), None, None, None, None, bias)[0])
        assert kern._again[7] == 1
        guard.until = 0.0
        check(b)
        assert repeats[-1] is False and kern._again[7] > 1  # parallel again: decided anew
    monkeypatch.setattr(quant, "JIT_SERIAL_BELOW", 1 << 62)  # the cut moved: serial
    check(b)
    assert kern._again[7] == 1
    check(b)
    assert repeats[-1] is True
    seen = []
    import threading
    t = threading.Thread(target=lambda: seen.append(check(b)))  # another thread: its own plan
    t.start()
    t.join()
    assert len(seen) == 1 and repeats[-1] is False
    np.testing.assert_array_equal(seen[0], kern.run(b, None, None, None, None, bias)[0])
    check(b, None)  # no bias: the full path, then its own repeat
    assert repeats[-1] is False
    check(b, None)
    assert repeats[-1] is True
    check(b, bias.copy())  # an equal bias in another array: the full path
    assert repeats[-1] is False
    # a view that is not C-contiguous, float64, a bias-free call with other dtype: the full path
    check(np.asfortranarray(rng.standard_normal((3, k)).astype(np.float32)))
    (y64,) = kern.run(b.astype(np.float64), None, None, None, None, bias)
    assert y64.dtype == np.float64
    np.testing.assert_allclose(y64, b.astype(np.float64) @ w + bias, **F32_TOL)


@pytest.mark.parametrize("bits", [4, 8], ids=["b4", "b8"])
def test_split_prefill_matches_one_thread_and_restores_blas_threads(bits, path, monkeypatch):
    """Prefill-sized calls (M > JIT_MAX_ROWS) share the dequantized panels out between onnxpack's
    threads with BLAS on one thread: same values as one thread, and BLAS's thread count as before."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    k, n, bs = 160, 3 * TILE + 40, 32  # 4 tiles, the last one narrow
    vals = nbits_values(k, n, bs, bits, zp="uint8", bias=True, seed=11)
    node = nbits_node(k, n, bs, bits, vals)
    a = np.random.default_rng(12).standard_normal((quant.JIT_MAX_ROWS + 23, k)).astype(np.float32)
    feeds = [a] + [vals.get(nm) if nm else None for nm in node.input[1:]]
    want = a.astype(np.float64) @ dequantize_nbits(vals["b"], vals["s"], vals["zp"], k=k, n=n, bits=bits,
                                                   block_size=bs) + vals["bias"]
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        # by library: one that a run loads (another package's BLAS, e.g. scipy's) is not ours to restore
        before = {i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}
        monkeypatch.setenv("ONNXPACK_NUM_THREADS", "1")
        (one,) = run_native(node, feeds, 1, pack=[1, 2, 3])
        monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
        (split,) = run_native(node, feeds, 1, pack=[1, 2, 3])
        after = {i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}
    assert {k: after.get(k) for k in before} == before
    # The split multiplies the same float32 panels in other blocks, so its sums round in another
    # order: any order of a float32 K-term sum is within K * 2**-24 of the sum of its terms'
    # magnitudes from the exact value (the bound on recursive summation), so two orders are
    # within twice that (measured 2e-5 apart where ~60-sized terms cancel to ~0.2).
    scale = np.abs(a).astype(np.float64) @ np.abs(dequantize_nbits(vals["b"], vals["s"], vals["zp"], k=k, n=n, bits=bits,
                                                                    block_size=bs)).astype(np.float64)
    assert np.all(np.abs(split.astype(np.float64) - one) <= 2 * k * 2.0**-24 * (scale + np.abs(vals["bias"])))
    np.testing.assert_allclose(split, want, **F32_TOL)


def int8_path_active() -> bool:
    """Whether MatMulNBits with accuracy_level 4 takes the int8-activation GEMV here (a JIT path
    on a CPU with AVX-512 VNNI or AVX2)."""
    return quant.jit_enabled() and bool(getattr(quant._jit(), "int8_dot", False))


def int8_model(a, b, s, zp, *, k, n, bits, bs):
    """numpy model of onnxruntime's accuracy_level 4 (the oracle of the int8 GEMV): A rounded per
    block of K to int8 with ``scale = max|a| / 127`` (half to even, zero past K), integer dot
    products with the weight's integers minus their zero points, then both scales."""
    nb = -(-k // bs)
    ap = np.zeros((a.shape[0], nb * bs), np.float32)
    ap[:, :k] = a
    blocks = ap.reshape(a.shape[0], nb, bs)
    amax = np.abs(blocks).max(axis=2)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int64)  # (M, nb, bs)
    w = unpack_nbits(np.asarray(b).reshape(n, nb, -1), bits, bs).astype(np.int64)  # (N, nb, bs)
    z = quant._zero_points_dense(zp, n, nb, bits).astype(np.int64)  # (N, nb)
    dots = np.einsum("mbk,nbk->mbn", q, w - z[:, :, None])
    scale = (amax / np.float32(127)).astype(np.float64)[:, :, None] * np.asarray(s, np.float64).reshape(n, nb).T[None]
    return (scale * dots).sum(axis=1)


@pytest.mark.parametrize("bits", [2, 4, 8], ids=["b2", "b4", "b8"])
def test_accuracy_level_4_as_onnxruntime(bits, path):
    """onnxruntime's accuracy_level=4 rounds A to int8 per block.  Where onnxpack does too (the
    JIT GEMV on a CPU with VNNI or AVX2) it agrees with onnxruntime to float32 rounding; elsewhere it
    computes A in float32, within the int8 rounding bound of onnxruntime and much closer to the
    exact product.  Either way both stay within the bound of the exact float32 product."""
    k, n, bs = 256, 96, 32
    vals = nbits_values(k, n, bs, bits, zp="uint8", seed=7)
    node = nbits_node(k, n, bs, bits, vals, accuracy_level=4)
    a = np.random.default_rng(8).standard_normal((4, k)).astype(np.float32)
    (want,) = ort_run(single_node_model(node, a, vals), {"a": a})
    (got,) = run_native(node, [a, vals["b"], vals["s"], vals["zp"]], 1, pack=[1, 2, 3])
    w = dequantize_nbits(vals["b"], vals["s"], vals["zp"], k=k, n=n, bits=bits, block_size=bs)
    amax = np.abs(a).reshape(4, k // bs, bs).max(axis=2)  # (M, n_blocks)
    wabs = np.abs(w).reshape(k // bs, bs, n).sum(axis=1)  # (n_blocks, N)
    bound = amax / 254.0 @ wabs
    exact = a.astype(np.float64) @ w
    for result in (got, want):
        assert (np.abs(result - exact) <= bound * 1.01 + 1e-4).all()
    if int8_path_active():
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(got, int8_model(a, vals["b"], vals["s"], vals["zp"], k=k, n=n, bits=bits, bs=bs),
                                   rtol=1e-5, atol=1e-5 * np.abs(want).max())
    else:
        err = np.abs(got.astype(np.float64) - want)
        assert (err <= bound * 1.01 + 1e-4 + 1e-4 * np.abs(want)).all(), float((err - bound).max())
        # ... and the bound is not vacuous: the exact float32 product is much closer than it.
        assert np.abs(got - exact).max() < 1e-3 * bound.max()


def test_two_bit_blocks_of_16_stay_float_at_accuracy_level_4(path):
    """onnxruntime 1.32 rounds A to int8 for 2-bit weights at accuracy level 4 only in blocks of
    32 or more (test above); in blocks of 16 it multiplies in float, and so do we."""
    k, n, bs = 128, 40, 16
    vals = nbits_values(k, n, bs, 2, zp="uint8", seed=9)
    node = nbits_node(k, n, bs, 2, vals, accuracy_level=4)
    a = np.random.default_rng(10).standard_normal((3, k)).astype(np.float32)
    (want,) = ort_run(single_node_model(node, a, vals), {"a": a})
    (got,) = run_native(node, [a, vals["b"], vals["s"], vals["zp"]], 1, pack=[1, 2, 3])
    w = dequantize_nbits(vals["b"], vals["s"], vals["zp"], k=k, n=n, bits=2, block_size=bs)
    np.testing.assert_allclose(got, a.astype(np.float64) @ w, **F32_TOL)
    np.testing.assert_allclose(got, want, **F32_TOL)


INT8_CASES = [  # (K, N, block size, rows): tiles of 128 columns, 64-column runs, odd tails, K not a multiple
    (896, 4 * TILE, 32, 1), (256, TILE + 64, 32, 3), (200, TILE + 70, 16, 2), (512, 37, 128, 5), (96, 200, 32, 16)]


@pytest.mark.parametrize("case", INT8_CASES, ids=[f"k{c[0]}n{c[1]}bs{c[2]}m{c[3]}" for c in INT8_CASES])
@pytest.mark.parametrize("layout", ["u8zp-f32", "nozp-f16", "u8zp-f16", "nozp-f32"])
@pytest.mark.parametrize("bits", [4, 8], ids=["b4", "b8"])
@pytest.mark.parametrize("jit_path", ["jit", "native"], indirect=True)
def test_int8_gemv_equals_the_integer_model(bits, layout, case, jit_path, path):
    """The int8-activation GEMV (accuracy_level 4) against :func:`int8_model`, on the serial and
    the parallel kernel: every column run and tail, 1-16 rows, float16 and float32 scales."""
    if not int8_path_active():
        pytest.skip("the int8 GEMV runs on the JIT paths of a CPU with AVX-512 VNNI or AVX2")
    k, n, bs, m = case
    zp, sdtype = layout.split("-")
    vals = nbits_values(k, n, bs, bits, zp="uint8" if zp == "u8zp" else None,
                        sdtype=np.float16 if sdtype == "f16" else np.float32, seed=k + n)
    node = nbits_node(k, n, bs, bits, vals, accuracy_level=4)
    kern = lookup(MS, "MatMulNBits", 1)(node, KernelContext(1, {MS: 1, "": 17}))
    for i, name in ((1, "b"), (2, "s"), (3, "zp")):
        if name in vals:
            kern.use_prepacked(i, kern.prepack(i, vals[name]))
    a = (np.random.default_rng(m).standard_normal((m, k)) * np.linspace(0.1, 3, k)).astype(np.float32)
    want = int8_model(a, vals["b"], vals["s"], vals.get("zp"), k=k, n=n, bits=bits, bs=bs)
    jit = quant._jit()
    zmode, zarr, zmid = kern._zmode(kern._packed.get(3))
    for name in (f"gemv{bits}_i8", f"gemv{bits}_i8_serial"):
        y = np.full((m, n), np.nan, np.float32)
        getattr(jit, name)(a, kern._packed[1], quant._jit_view(kern._packed[2]), quant._jit_view(zarr), zmode, zmid, y,
                           n, kern.nblocks, kern.blob, TILE, 2)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)
    (got,) = kern.run(a)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("jit_path", ["jit", "native"], indirect=True)
def test_int8_gemv_turns_a_nan_or_inf_block_into_nan(bad, jit_path, path):
    """A block of A holding a NaN or an infinity has no int8 scale: the outputs are NaN (the
    float kernels give NaN or an infinity there), never finite numbers."""
    if not int8_path_active():
        pytest.skip("the int8 GEMV runs on the JIT paths of a CPU with AVX-512 VNNI or AVX2")
    k, n, bs = 128, 2 * TILE, 32
    vals = nbits_values(k, n, bs, 4, zp="uint8", seed=3)
    node = nbits_node(k, n, bs, 4, vals, accuracy_level=4)
    a = np.random.default_rng(4).standard_normal((2, k)).astype(np.float32)
    a[1, 70] = bad
    (got,) = run_native(node, [a, vals["b"], vals["s"], vals["zp"]], 1, pack=[1, 2, 3])
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()


def test_accuracy_level_4_keeps_float_zero_points_in_float(path):
    """onnxruntime's int8 compute takes no float zero points (it computes such a node in float32):
    neither does onnxpack's."""
    k, n, bs = 256, 96, 32
    vals = nbits_values(k, n, bs, 4, zp="float", seed=5)
    node = nbits_node(k, n, bs, 4, vals, accuracy_level=4)
    a = np.random.default_rng(6).standard_normal((2, k)).astype(np.float32)
    (want,) = ort_run(single_node_model(node, a, vals), {"a": a})
    (got,) = run_native(node, [a, vals["b"], vals["s"], vals["zp"]], 1, pack=[1, 2, 3])
    np.testing.assert_allclose(got, want, **F32_TOL)


def test_k_zero_gives_bias_or_zeros(path):
    n = 12
    for with_bias in (False, True):
        vals = {"b": np.zeros((n, 0, 16), np.uint8), "s": np.zeros((0,), np.float32)}
        if with_bias:
            vals["bias"] = np.arange(n, dtype=np.float32)
        node = nbits_node(0, n, 32, 4, vals)
        a = np.zeros((3, 0), np.float32)
        (want,) = ort_run(single_node_model(node, a, vals), {"a": a})
        feeds = [a] + [vals.get(nm) if nm else None for nm in node.input[1:]]
        (got,) = run_native(node, feeds, 1, pack=[1, 2])
        assert got.shape == (3, n) and want.shape == (3, n)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("zp", ["uint8", "float", None], ids=["u8zp", "floatzp", "nozp"])
def test_g_idx_act_order_matches_onnxruntime(zp, path):
    k, n, bs = 128, 40, 32
    vals = nbits_values(k, n, bs, 4, zp=zp, seed=9)
    # Act order: rows permuted, each row's group index follows its original position.
    perm = np.random.default_rng(10).permutation(k)
    g_idx = (perm // bs).astype(np.int32)
    node = nbits_node(k, n, bs, 4, vals, g_idx=True)
    consts = dict(vals, g_idx=g_idx)
    a = np.random.default_rng(11).standard_normal((2, k)).astype(np.float32)
    try:
        (want,) = ort_run(single_node_model(node, a, consts), {"a": a})
    except Exception as exc:  # noqa: BLE001 - the oracle's own limits, stated in the skip
        pytest.skip(f"onnxruntime does not run this g_idx case: {exc}")
    feeds = [a] + [consts.get(nm) if nm else None for nm in node.input[1:]]
    (got,) = run_native(node, feeds, 1, pack=[i for i in (1, 2, 3) if i < len(feeds) and feeds[i] is not None])
    if zp == "uint8":
        # onnxruntime 1.32's CPU kernel drops uint8 zero points when g_idx is given (it computes
        # with the implicit 8); we follow the spec.  Both facts are checked against numpy.
        nb = k // bs
        q = unpack_nbits(vals["b"].reshape(n, nb, -1), 4, bs).reshape(n, k).astype(np.float64)
        s = vals["s"].reshape(n, nb).astype(np.float64)[:, g_idx]
        z = unpack_nbits(vals["zp"].reshape(n, -1), 4, nb).astype(np.float64)[:, g_idx]
        np.testing.assert_allclose(want, a @ ((q - 8) * s).T, **F32_TOL)
        want = (a @ ((q - z) * s).T).astype(np.float32)
    assert_vs_oracle(got, want)
    # A trivial g_idx (k // block_size) takes the fast path and equals no g_idx at all.
    feeds[4] = (np.arange(k) // bs).astype(np.int32)
    (trivial,) = run_native(node, feeds, 1)
    feeds[4] = None
    (plain,) = run_native(node, feeds, 1)
    np.testing.assert_allclose(trivial, plain, **SAME_TOL)


def test_invalid_inputs_raise_invalid_argument():
    vals = nbits_values(64, 8, 32, 4)
    node = nbits_node(64, 8, 32, 4, vals)
    cls = lookup(MS, "MatMulNBits", 1)
    kern = cls(node, KernelContext(1, {MS: 1}))
    with pytest.raises(InvalidArgument, match="K=64"):
        kern.run(np.zeros((1, 63), np.float32), vals["b"], vals["s"], vals["zp"])
    with pytest.raises(InvalidArgument, match="B must be uint8"):
        kern.run(np.zeros((1, 64), np.float32), vals["b"][:4], vals["s"], vals["zp"])
    with pytest.raises(InvalidArgument, match="scales"):
        kern.run(np.zeros((1, 64), np.float32), vals["b"], vals["s"][:3], vals["zp"])
    with pytest.raises(InvalidArgument, match="g_idx"):
        kern.run(np.zeros((1, 64), np.float32), vals["b"], vals["s"], vals["zp"], np.full(64, 5, np.int32))
    bad = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain=MS, name="bad", K=64, N=8, bits=4, block_size=24)
    with pytest.raises(InvalidArgument, match="block_size"):
        cls(bad, KernelContext(1, {MS: 1}))


# -- the packed format ------------------------------------------------------------------------------

BYTES_CASES = [
    ("b4-bs32-f32-u8zp", 4, 32, np.float32, "uint8"),
    ("b4-bs32-f32-nozp", 4, 32, np.float32, None),
    ("b4-bs16-f16-u8zp", 4, 16, np.float16, "uint8"),
    ("b4-bs16-f16-floatzp", 4, 16, np.float16, "float"),
    ("b4-bs16-f32-floatzp", 4, 16, np.float32, "float"),
    ("b4-bs128-f16-u8zp", 4, 128, np.float16, "uint8"),
    ("b8-bs16-f16-u8zp", 8, 16, np.float16, "uint8"),
    ("b8-bs32-f32-floatzp", 8, 32, np.float32, "float"),
]


@pytest.mark.parametrize("case", BYTES_CASES, ids=[c[0] for c in BYTES_CASES])
def test_packed_bytes_within_1_25x_of_the_quantized_bytes(case):
    _, bits, bs, dtype, zp = case
    k, n = 320, 300
    vals = nbits_values(k, n, bs, bits, zp=zp, sdtype=dtype)
    node = nbits_node(k, n, bs, bits, vals)
    kern = lookup(MS, "MatMulNBits", 1)(node, KernelContext(1, {MS: 1}))
    model_bytes = packed_bytes = 0
    for i, name in ((1, "b"), (2, "s"), (3, "zp")):
        if name not in vals:
            continue
        w = vals[name]
        info = TensorInfo(name, w.dtype, w.shape, helper.np_dtype_to_tensor_dtype(w.dtype))
        bufs = kern.prepack(i, w)
        assert kern.check_packed(i, info, bufs) is None
        model_bytes += w.nbytes
        packed_bytes += sum(b.nbytes for b in bufs)
    assert packed_bytes <= 1.25 * model_bytes, (packed_bytes, model_bytes)
    assert packed_bytes >= model_bytes  # nothing dropped


def test_tiled_layout_and_pack_key():
    n, nb, blob = 2 * TILE + 5, 3, 16
    x = np.random.default_rng(12).integers(0, 256, (n, nb, blob), dtype=np.uint8)
    flat = to_tiles(x)
    assert flat.shape == (x.size,) and flat.dtype == np.uint8
    # Tile t of width w: byte j of block b of column n at t*TILE*nb*blob + (b*blob + j)*w + (n - t*TILE).
    for col in (0, 1, TILE - 1, TILE, 2 * TILE, n - 1):
        t = col // TILE
        w = TILE if t < n // TILE else n % TILE
        for b, j in ((0, 0), (2, 15), (1, 7)):
            assert flat[t * TILE * nb * blob + (b * blob + j) * w + col - t * TILE] == x[col, b, j]
    np.testing.assert_array_equal(quant._untile(flat, n, nb, blob), x)

    vals = nbits_values(64, 8, 32, 4)
    node = nbits_node(64, 8, 32, 4, vals)
    cls = lookup(MS, "MatMulNBits", 1)
    kern = cls(node, KernelContext(1, {MS: 1}))
    b = vals["b"]
    info = TensorInfo("b", b.dtype, b.shape, TensorProto.UINT8)
    spec = kern.pack_spec(1, info)
    assert spec.family == "matmulnbits" and spec.version == 2 and not spec.identity
    other = helper.make_node("MatMulNBits", list(node.input), ["y"], domain=MS, K=64, N=8, bits=4, block_size=16)
    assert cls(other, KernelContext(1, {MS: 1})).pack_spec(1, info).attrs != spec.attrs
    assert kern.expected_packed(1, info) == [(np.dtype(np.uint8), (b.size,))]
    (buf,) = kern.prepack(1, b)
    assert kern.check_packed(1, info, (buf[:-1],)) is not None
    zp = vals["zp"]
    (zbuf,) = kern.prepack(3, zp)  # one byte per block, nibbles unpacked
    np.testing.assert_array_equal(zbuf, to_tiles(unpack_nbits(zp, 4, 2).reshape(8, 2, 1)))


# -- through InferenceSession -----------------------------------------------------------------------


def _decoder_like(k=192, n=264, vocab=300, bs=32, seed=13):
    """GatherBlockQuantized embedding tied with a MatMulNBits lm_head (one shared initializer)."""
    rng = np.random.default_rng(seed)
    nb = k // bs
    # One uint8 initializer (V, n_blocks, blob) is both the lm_head's B and the embedding's data
    # (onnxruntime insists on B's 3-D shape; the gather then sees one block per (row, block)).
    emb = rng.integers(0, 256, (vocab, nb, bs // 2), dtype=np.uint8)
    emb_s = (rng.random((vocab, nb)) * 0.05 + 0.01).astype(np.float32)
    emb_z = rng.integers(0, 16, (vocab, nb), dtype=np.uint8)
    lm_z = (emb_z[:, 0::2] | (np.pad(emb_z[:, 1::2], ((0, 0), (0, nb % 2))) << 4)).astype(np.uint8)
    up = nbits_values(k, n, bs, 4, zp="uint8", seed=seed + 1)
    down = nbits_values(n, k, bs, 4, zp=None, bias=True, seed=seed + 2)
    nodes = [
        helper.make_node("GatherBlockQuantized", ["emb", "ids", "emb_s3", "emb_z3"], ["x4"], domain=MS, name="embed",
                         gather_axis=0, quantize_axis=2, block_size=bs, bits=4),
        helper.make_node("Reshape", ["x4", "shape"], ["x"], name="flat"),
        helper.make_node("MatMulNBits", ["x", "up_b", "up_s", "up_z"], ["h"], domain=MS, name="up", K=k, N=n,
                         bits=4, block_size=bs, accuracy_level=0),
        helper.make_node("MatMulNBits", ["h", "down_b", "down_s", "", "", "down_bias"], ["x2"], domain=MS,
                         name="down", K=n, N=k, bits=4, block_size=bs),
        helper.make_node("MatMulNBits", ["x2", "emb", "emb_s", "lm_z"], ["logits"], domain=MS, name="lm_head",
                         K=k, N=vocab, bits=4, block_size=bs),
    ]
    inits = {"emb": emb, "emb_s": emb_s, "lm_z": lm_z, "emb_s3": emb_s.reshape(vocab, nb, 1),
             "emb_z3": emb_z.reshape(vocab, nb, 1), "shape": np.array([0, 0, k], np.int64),
             "up_b": up["b"], "up_s": up["s"], "up_z": up["zp"],
             "down_b": down["b"], "down_s": down["s"], "down_bias": down["bias"]}
    graph = helper.make_graph(
        nodes, "decoder_like", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
        [numpy_helper.from_array(v, name) for name, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=9)


@pytest.mark.parametrize("seq", [1, 20], ids=["decode", "prefill"])
def test_session_decoder_like_model_matches_onnxruntime(seq, path):
    model = _decoder_like()
    ids = np.random.default_rng(14).integers(0, 300, (2, seq)).astype(np.int64)
    (want,) = ort_run(model, {"ids": ids})
    blob = model.SerializeToString()
    for so in (None, options(**{"session.disable_prepacking": 1})):
        with InferenceSession(blob, so) as sess:
            (got,) = sess.run(None, {"ids": ids})
            assert_vs_oracle(got, want)
            log = sess.get_prepack_log()
            if so is None:
                packed = {(r["node"], r["input"]) for r in log}
                # Every MatMulNBits weight is packed; the embedding's data is not packed by the
                # gather (it reads the model's own bytes), only by the lm_head that multiplies by it.
                assert ("lm_head", 1) in packed and ("up", 1) in packed and ("down", 2) in packed
                assert not any(r["node"] == "embed" for r in log)
            else:
                assert log == []


def test_session_weights_as_graph_inputs_match_onnxruntime(path):
    k, n, bs = 96, 140, 32
    vals = nbits_values(k, n, bs, 4, zp="uint8", bias=True, seed=15)
    node = nbits_node(k, n, bs, 4, vals)
    a = np.random.default_rng(16).standard_normal((3, k)).astype(np.float32)
    model = single_node_model(node, a, vals, as_inputs=("b", "s", "zp"))
    feeds = {"a": a, "b": vals["b"], "s": vals["s"], "zp": vals["zp"]}
    (want,) = ort_run(model, feeds)
    with InferenceSession(model.SerializeToString()) as sess:
        (got,) = sess.run(None, feeds)
        assert [r["input"] for r in sess.get_prepack_log()] == []  # bias is tiny and never packed
    assert_vs_oracle(got, want)


def test_saved_packed_buffers_come_back_identical(tmp_path, path):
    model = _decoder_like()
    src = tmp_path / "m.onnx"
    onnxpack.save_model(model, str(src))
    out = tmp_path / "m.opt.onnx"
    so = options(**{FLAG: 1})
    so.optimized_model_filepath = str(out)
    ids = np.array([[3, 7, 299]], np.int64)
    cold_c, warm_c = PrepackedWeightsContainer(), PrepackedWeightsContainer()
    with InferenceSession(str(src), so, prepacked_weights_container=cold_c) as cold:
        cold_out = cold.run(None, {"ids": ids})
        cold_log = {(r["node"], r["input"]): r["key"] for r in cold.get_prepack_log()}
        cold_bufs = {slot: cold_c.acquire(key, -1).buffers for slot, key in cold_log.items()}
    with InferenceSession(str(out), prepacked_weights_container=warm_c) as warm:
        stats = warm.get_prepack_stats()
        assert stats["weights_packed"] == 0 and stats["blobs_rejected"] == 0
        warm_log = warm.get_prepack_log()
        assert {r["origin"] for r in warm_log} <= {"model", "container"}
        assert {(r["node"], r["input"]) for r in warm_log} == set(cold_log)
        for r in warm_log:
            warm_bufs = warm_c.acquire(r["key"], -1).buffers
            mine = cold_bufs[(r["node"], r["input"])]
            assert len(warm_bufs) == len(mine)
            for wb, cb in zip(warm_bufs, mine):
                assert wb.dtype == cb.dtype and wb.shape == cb.shape
                np.testing.assert_array_equal(wb, cb)
        np.testing.assert_array_equal(warm.run(None, {"ids": ids})[0], cold_out[0])



@pytest.mark.parametrize("k, n", [(32, 256), (20, 384)])
def test_one_block_per_column_warm_starts_without_repacking(tmp_path, k, n, path):
    """K <= block_size and N a multiple of the tile: each column has one block, so the tiled
    scales (and float zero points) are their stored bytes and prepack returns a view of them.  Saved as such, the blob
    would sit at the weight's offset under a spec that is not an identity pack: every warm load
    would reject it with a warning and pack again (found with onnxruntime's MatMulNBitsQuantizer,
    block_size 128, on a 128-wide model).  The saver writes such a buffer apart."""
    bs = 32
    vals = nbits_values(k, n, bs, 4, zp="float", seed=21)
    node = nbits_node(k, n, bs, 4, vals)
    a = np.random.default_rng(22).standard_normal((2, k)).astype(np.float32)
    model = single_node_model(node, a, vals)
    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnxpack.save_model(model, str(src), min_size=0)
    optimize(str(src), str(out))
    (want,) = ort_run(model, {"a": a})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rejected blob is a PrepackWarning
        with InferenceSession(str(out)) as warm:
            stats = warm.get_prepack_stats()
            (got,) = warm.run(None, {"a": a})
    assert stats["weights_packed"] == 0 and stats["blobs_rejected"] == 0 and stats["blobs_from_model"] == 3, stats
    assert_vs_oracle(got, want)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"a": a})[0], want, rtol=0, atol=0)

# -- GatherBlockQuantized vs onnxruntime ------------------------------------------------------------


def gbq_model(data, scales, zp, indices, **attrs):
    names = ["data", "idx", "scales"] + (["zp"] if zp is not None else [])
    node = helper.make_node("GatherBlockQuantized", names, ["y"], domain=MS, name="gbq", **attrs)
    inits = [numpy_helper.from_array(data, "data") if data.dtype == np.uint8
             else helper.make_tensor("data", TensorProto.INT4 if data.dtype.name == "int4" else TensorProto.UINT4,
                                     data.shape, data.astype(np.int8).reshape(-1).tolist()),
             numpy_helper.from_array(scales, "scales")]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "zp") if zp.dtype == np.uint8 else
                     helper.make_tensor("zp", TensorProto.INT4 if zp.dtype.name == "int4" else TensorProto.UINT4,
                                        zp.shape, zp.astype(np.int8).reshape(-1).tolist()))
    elem = helper.np_dtype_to_tensor_dtype(scales.dtype)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("idx", helper.np_dtype_to_tensor_dtype(indices.dtype), indices.shape)],
        [helper.make_tensor_value_info("y", elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10)


# (id, bits, rows, row values, block, zero points, scale dtype)
GBQ_U8 = [
    ("b4-bs32-u8zp", 4, 50, 96, 32, True, np.float32),
    ("b4-bs16-nozp", 4, 40, 64, 16, False, np.float32),
    ("b4-bs64-u8zp-oddblocks-f16", 4, 30, 192, 64, True, np.float16),
    ("b8-bs32-u8zp", 8, 20, 64, 32, True, np.float32),
    ("b8-bs16-nozp", 8, 20, 48, 16, False, np.float32),
]


@pytest.mark.parametrize("case", GBQ_U8, ids=[c[0] for c in GBQ_U8])
def test_gather_block_quantized_uint8_matches_onnxruntime(case):
    _, bits, rows, q, bs, with_zp, sdtype = case
    rng = np.random.default_rng(17)
    nb = -(-q // bs)
    data = rng.integers(0, 256, (rows, q * bits // 8), dtype=np.uint8)
    scales = (rng.random((rows, nb)) * 0.1 + 0.01).astype(sdtype)
    zp = rng.integers(0, 256, (rows, -(-nb * bits // 8)), dtype=np.uint8) if with_zp else None
    idx = np.array([[0, rows - 1, 3], [-1, 5, 5]], np.int64)
    model = gbq_model(data, scales, zp, idx, gather_axis=0, quantize_axis=1, block_size=bs, bits=bits)
    (want,) = ort_run(model, {"idx": idx})
    with InferenceSession(model.SerializeToString()) as sess:
        (got,) = sess.run(None, {"idx": idx})
        assert sess.get_prepack_log() == []  # never packed: the model's own bytes are read
    assert got.dtype == want.dtype and got.shape == want.shape == (2, 3, q)
    np.testing.assert_array_equal(got, want)  # one dequantization per element, both sides


@pytest.mark.parametrize("signed", [True, False], ids=["int4", "uint4"])
@pytest.mark.parametrize("axes", [(0, 1), (1, 0), (0, 2), (2, 1)], ids=["g0q1", "g1q0", "g0q2", "g2q1"])
def test_gather_block_quantized_int4_matches_onnxruntime(axes, signed):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    ga, qa = axes
    rng = np.random.default_rng(18)
    shape = (6, 32, 4) if qa == 1 else ((32, 6, 4) if qa == 0 else (6, 4, 32))
    dt = ml_dtypes.int4 if signed else ml_dtypes.uint4
    lo, hi = (-8, 8) if signed else (0, 16)
    data = rng.integers(lo, hi, shape).astype(dt)
    bs = 16
    sshape = tuple(-(-d // bs) if i == qa else d for i, d in enumerate(shape))
    scales = (rng.random(sshape) * 0.1 + 0.01).astype(np.float32)
    zp = rng.integers(lo, hi, sshape).astype(dt)
    idx = np.array([1, 0, 3, 3], np.int32)
    model = gbq_model(data, scales, zp, idx, gather_axis=ga, quantize_axis=qa, block_size=bs, bits=4)
    try:
        (want,) = ort_run(model, {"idx": idx})
    except Exception as exc:  # noqa: BLE001 - the oracle's own limits, stated in the skip
        pytest.skip(f"onnxruntime does not run GatherBlockQuantized with these axes: {exc}")
    with InferenceSession(model.SerializeToString()) as sess:
        (got,) = sess.run(None, {"idx": idx})
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_gather_block_quantized_rejects_bad_inputs():
    cls = lookup(MS, "GatherBlockQuantized", 1)
    node = helper.make_node("GatherBlockQuantized", ["d", "i", "s"], ["y"], domain=MS, name="g", block_size=16)
    kern = cls(node, KernelContext(1, {MS: 1}))
    data = np.zeros((4, 8), np.uint8)
    scales = np.ones((4, 1), np.float32)
    with pytest.raises(InvalidArgument, match="indices must be in"):
        kern.run(data, np.array([4]), scales)
    with pytest.raises(InvalidArgument, match="scales must have shape"):
        kern.run(data, np.array([0]), np.ones((4, 2), np.float32))
    with pytest.raises(InvalidArgument, match="block_size"):
        cls(helper.make_node("GatherBlockQuantized", ["d", "i", "s"], ["y"], domain=MS, block_size=8),
            KernelContext(1, {MS: 1}))


_FORK_AND_THREADS = r"""
import os, sys, threading
import numpy as np
sys.path[:0] = sys.argv[1:]
from test_kernels_int4 import nbits_node, nbits_values, single_node_model
from onnxpack import InferenceSession
from onnxpack.session.kernels import quant

k, n = 512, 8192  # m*k*n above JIT_SERIAL_BELOW: the parallel GEMV
assert 1 * k * n >= quant.JIT_SERIAL_BELOW
vals = nbits_values(k, n, 32, 4, zp="uint8", seed=3)
node = nbits_node(k, n, 32, 4, vals)
a = np.random.default_rng(4).standard_normal((1, k)).astype(np.float32)
s = InferenceSession(single_node_model(node, a, {nm: vals[nm] for nm in ("b", "s", "zp")}).SerializeToString())
(want,) = s.run(None, {"a": a})
# Several threads running parallel kernels at once (numba's workqueue layer terminates here).
outs = [None] * 4
def work(i):
    outs[i] = s.run(None, {"a": a})[0]
ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
assert all(np.array_equal(o, want) for o in outs)
# A child forked after the parent ran them (GNU OpenMP is not fork-safe: numba kills such a child).
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    (got,) = s.run(None, {"a": a})
    os.write(w, b"ok" if np.array_equal(got, want) else b"wrong")
    os._exit(0)
os.close(w)
_, status = os.waitpid(pid, 0)
print(os.read(r, 16).decode(), os.waitstatus_to_exitcode(status))
print("native" if getattr(quant._jit(), "native", False) else "numba", "numba" in sys.modules)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
@pytest.mark.parametrize("kernels", ["numba", "native"])
def test_parallel_gemv_survives_threads_and_fork(kernels, request):
    pytest.importorskip("numba")
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONNXPACK_DISABLE_JIT", "NUMBA_THREADING_LAYER", "ONNXPACK_DISABLE_NATIVE")}
    if kernels == "native":  # GNU OpenMP teams started through the native code cache's entries
        env["ONNXPACK_CODE_CACHE"] = request.getfixturevalue("native_cache")
    else:
        env["ONNXPACK_DISABLE_NATIVE"] = "1"
    # (Without the guard the child hangs in its first parallel region.)
    p = subprocess.run([sys.executable, "-c", _FORK_AND_THREADS, os.path.dirname(__file__),
                        os.path.dirname(os.path.dirname(__file__))], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    # the native kernels run without numba in the process
    assert p.stdout.split() == ["ok", "0", kernels, str(kernels == "numba")], (p.stdout, p.stderr[-3000:])


def test_arena_shrinkage_run_option_drops_the_dequantization_panel():
    """``memory.enable_memory_arena_shrinkage`` (onnxruntime's run option) also drops the kernels'
    reusable scratch: the prompt-sized panel a later decoding step does not need."""
    k, n = 64, 256
    vals = nbits_values(k, n, 32, 4, zp="uint8", seed=5)
    a = np.random.default_rng(6).standard_normal((quant.JIT_MAX_ROWS + 4, k)).astype(np.float32)
    s = InferenceSession(single_node_model(nbits_node(k, n, 32, 4, vals), a,
                                           {nm: vals[nm] for nm in ("b", "s", "zp")}).SerializeToString())
    (want,) = s.run(None, {"a": a})
    assert quant._panels  # kept for the next call
    ro = onnxpack.RunOptions()
    ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    (got,) = s.run(None, {"a": a}, ro)
    assert not quant._panels
    np.testing.assert_array_equal(got, want)


# -- MatMulBnb4 (onnxruntime's MatMulBnb4Quantizer: FP4 / NF4) ---------------------------------------
def _bnb4_model(k, n, block_size, quant_type, packed, absmax, *, weights_as_inputs=False):
    attrs = dict(K=k, N=n, block_size=block_size, quant_type=quant_type)
    node = helper.make_node("MatMulBnb4", ["A", "B", "absmax"], ["Y"], domain=MS, **attrs)
    consts = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(absmax, "absmax")]
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, None)]
    if weights_as_inputs:
        inputs += [helper.make_tensor_value_info("B", TensorProto.UINT8, None),
                   helper.make_tensor_value_info("absmax", TensorProto.FLOAT, None)]
    graph = helper.make_graph([node], "bnb4", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [] if weights_as_inputs else consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=9)


def _ort(model, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("quant_type", [0, 1], ids=["fp4", "nf4"])
def test_bnb4_tables_and_nibble_order_are_onnxruntimes(quant_type):
    """Every code in every nibble position, absmax 1, A = I: onnxruntime's decoded weight is the
    table, bit for bit (element 2j in the high nibble)."""
    k, n = 16, 2
    codes = np.arange(k * n) % 16
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    model = _bnb4_model(k, n, 16, quant_type, packed, np.ones(2, np.float32))
    want = _ort(model, {"A": np.eye(k, dtype=np.float32)}).T.reshape(-1)
    np.testing.assert_array_equal(want.view(np.uint32) & 0x7FFFFFFF,
                                  quant.BNB4_TABLES[quant_type][codes].view(np.uint32) & 0x7FFFFFFF)
    got = InferenceSession(model.SerializeToString()).run(None, {"A": np.eye(k, dtype=np.float32)})[0]
    np.testing.assert_array_equal(got, _ort(model, {"A": np.eye(k, dtype=np.float32)}))


BNB4_CASES = [  # K, N, block size: odd N*K (a half byte), blocks across rows, several tiles
    (16, 8, 16), (33, 7, 16), (64, 48, 64), (100, 37, 256), (257, 300, 128),
]


@pytest.mark.parametrize("quant_type", [0, 1], ids=["fp4", "nf4"])
@pytest.mark.parametrize("case", BNB4_CASES, ids=[f"k{k}n{n}b{b}" for k, n, b in BNB4_CASES])
def test_matmul_bnb4_quantizer_output_matches_onnxruntime(case, quant_type, monkeypatch):
    """What MatMulBnb4Quantizer writes (its own packing, onnxruntime's native quantizer), through
    a session (weights constant, then fed) and with small tiles."""
    from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer

    k, n, bs = case
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed, absmax = MatMulBnb4Quantizer(onnx.ModelProto(), quant_type, bs).bnb4_block_quant(w)
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    model = _bnb4_model(k, n, bs, quant_type, packed, absmax)
    want = _ort(model, {"A": a})
    tol = dict(rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    sess = InferenceSession(model.SerializeToString())
    assert sess.get_fallback_nodes() == []
    np.testing.assert_allclose(sess.run(None, {"A": a})[0], want, **tol)
    fed = InferenceSession(_bnb4_model(k, n, bs, quant_type, packed, absmax, weights_as_inputs=True).SerializeToString())
    got = fed.run(None, {"A": a, "B": packed, "absmax": absmax})[0]
    np.testing.assert_allclose(got, want, **tol)
    monkeypatch.setattr(quant, "_BNB4_TILE", 40)  # tiles of one or two rows, blocks cut by tiles
    got = run_native(helper.make_node("MatMulBnb4", ["A", "B", "absmax"], ["Y"], domain=MS, K=k, N=n,
                                      block_size=bs, quant_type=quant_type), [a, packed, absmax], 1)[0]
    np.testing.assert_allclose(got, want, **tol)


def test_matmul_bnb4_declines_trans_b_0_and_rejects_bad_inputs():
    rng = np.random.default_rng(5)
    k, n, bs = 16, 12, 16
    packed = rng.integers(0, 256, (k * n + 1) // 2, dtype=np.uint8)
    absmax = rng.random(k * n // bs).astype(np.float32)
    with pytest.raises(NotImplementedError, match="transB=0"):  # onnxruntime's kernel ignores it
        lookup(MS, "MatMulBnb4", 1)(helper.make_node("MatMulBnb4", ["A", "B", "absmax"], ["Y"], domain=MS, K=k, N=n,
                                                     block_size=bs, quant_type=1, transB=0), KernelContext(1, {MS: 1}))
    node = helper.make_node("MatMulBnb4", ["A", "B", "absmax"], ["Y"], domain=MS, K=k, N=n, block_size=bs, quant_type=1)
    with pytest.raises(InvalidArgument, match="B must be uint8 with"):
        run_native(node, [np.zeros((1, k), np.float32), packed[:-1], absmax], 1)
    with pytest.raises(InvalidArgument, match="absmax must be float with"):
        run_native(node, [np.zeros((1, k), np.float32), packed, absmax[:-1]], 1)
    with pytest.raises(InvalidArgument, match="A must be float with last dimension 16"):
        run_native(node, [np.zeros((1, k + 1), np.float32), packed, absmax], 1)
    with pytest.raises(InvalidArgument, match="quant_type must be 0"):
        lookup(MS, "MatMulBnb4", 1)(helper.make_node("MatMulBnb4", ["A", "B", "absmax"], ["Y"], domain=MS, K=k, N=n,
                                                     block_size=bs, quant_type=2), KernelContext(1, {MS: 1}))
