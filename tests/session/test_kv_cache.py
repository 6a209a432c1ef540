"""GroupQueryAttention with a shared KV cache: present bound to the past buffer is updated in place."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from onnxpack.session.kernels import KernelContext, lookup

N, NKV, H, CAP = 4, 2, 16, 32


def _kernel(**attrs):
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "sk", "tot"], ["y", "k", "v"],
                            domain="com.microsoft", num_heads=N, kv_num_heads=NKV, **attrs)
    return lookup("com.microsoft", "GroupQueryAttention", 1)(node, KernelContext(1, {"com.microsoft": 1}))


@pytest.mark.parametrize("window", [-1, 5], ids=["full", "local-window"])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_in_place_cache_equals_copying_cache_over_steps(window, rotary, jit_path):
    """(With the native kernels, the decoding steps after the first repeat the first's plan:
    ``GroupQueryAttention._repeat``.)"""
    rng = np.random.default_rng(0)
    extra = ()
    if rotary:
        angles = rng.random((CAP, H // 4)).astype(np.float32) * 3
        extra = (np.cos(angles), np.sin(angles))
    k = _kernel(local_window_size=window, do_rotary=int(rotary), softcap=30.0 if rotary else 0.0)
    shared_k = np.zeros((1, NKV, CAP, H), np.float32)
    shared_v = np.zeros((1, NKV, CAP, H), np.float32)
    copy_k, copy_v = shared_k.copy(), shared_v.copy()
    length = 0
    for s in (6, 1, 1, 1, 3, 1, 1):  # prompt, decode steps, a chunk, decode steps
        qkv = rng.standard_normal((1, s, (N + 2 * NKV) * H)).astype(np.float32)
        total = length + s
        sk = np.array([total - 1], np.int32)
        tot = np.array(total, np.int32)
        want = k.run(qkv, None, None, copy_k, copy_v, sk, tot, *extra)
        before = (shared_k.ctypes.data, shared_v.ctypes.data)
        y = np.empty((1, s, N * H), np.float32)
        got = k.run_into((y, shared_k, shared_v), qkv, None, None, shared_k, shared_v, sk, tot, *extra)
        assert got[0] is y and got[1] is shared_k and got[2] is shared_v
        assert (shared_k.ctypes.data, shared_v.ctypes.data) == before
        np.testing.assert_allclose(y, want[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(shared_k[:, :, :total], want[1][:, :, :total])
        np.testing.assert_array_equal(shared_v[:, :, :total], want[2][:, :, :total])
        copy_k, copy_v = want[1], want[2]
        length = total


def test_unshared_output_buffers_get_the_past_rows_copied():
    rng = np.random.default_rng(1)
    k = _kernel()
    pk = rng.standard_normal((1, NKV, CAP, H)).astype(np.float32)
    pv = rng.standard_normal((1, NKV, CAP, H)).astype(np.float32)
    qkv = rng.standard_normal((1, 1, (N + 2 * NKV) * H)).astype(np.float32)
    sk, tot = np.array([9], np.int32), np.array(10, np.int32)
    want = k.run(qkv, None, None, pk, pv, sk, tot)
    outs = (np.empty((1, 1, N * H), np.float32), np.full_like(pk, np.nan), np.full_like(pv, np.nan))
    k.run_into(outs, qkv, None, None, pk, pv, sk, tot)
    for got, ref in zip(outs, want):
        np.testing.assert_allclose(got[..., :10, :] if got.ndim == 4 else got,
                                   ref[..., :10, :] if ref.ndim == 4 else ref, rtol=1e-6, atol=1e-6)
