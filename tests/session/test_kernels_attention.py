"""Attention, MultiHeadAttention, RotaryEmbedding (com.microsoft and ONNX-23) and
GroupQueryAttention vs onnxruntime 1.32 (CPU, graph optimizations off).

Tolerances: float32 rtol 1e-4 / atol 1e-5 (onnxruntime's MLAS GEMMs and softmax sum in another
order); float16 rtol 1e-2 / atol 1e-2 after widening (both sides compute in float32 and round
once, but onnxruntime's rotary kernel rounds each float16 product: an ulp or two of float16).
Where onnxruntime leaves values unspecified (output rows of a right-padded prompt past its
length) only the specified rows are compared.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from contrib_util import MS, check_all_paths, run_ort_model, single_node_model

import onnxpack
from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels import KernelContext, lookup

F32 = dict(rtol=1e-4, atol=1e-5)
F16 = dict(rtol=1e-2, atol=1e-2)
DTYPES = [np.float32, np.float16]
DT_IDS = ["f32", "f16"]


def tol(dtype):
    return F32 if np.dtype(dtype) == np.float32 else F16


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def mk(op, inputs, outputs, domain=MS, **attrs):
    inputs = list(inputs)
    while inputs and inputs[-1] == "":
        inputs.pop()
    return helper.make_node(op, inputs, outputs, domain=domain, **attrs)


def rope_caches(max_pos, half, dtype, base=10000.0):
    inv = 1.0 / base ** (np.arange(half) / half)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------
B, S, DIN, NH = 2, 5, 16, 4


def attention_case(rng, dtype, sizes=(16, 16, 16)):
    x = rand(rng, (B, S, DIN), dtype)
    w = rand(rng, (DIN, sum(sizes)), dtype, 0.3)
    bias = rand(rng, (sum(sizes),), dtype, 0.2)
    return x, w, bias


MASKS = {
    "none": None,
    "1d-lengths": np.array([5, 3], np.int32),
    "1d-end-start": np.array([5, 4, 0, 1], np.int32),
    "2d": np.array([[1, 1, 1, 0, 1], [1, 1, 0, 0, 0]], np.int32),
    "3d": (np.arange(S)[None, :, None] >= np.arange(S)[None, None, :]).repeat(B, 0).astype(np.int32),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("unidirectional", [0, 1], ids=["bidir", "unidir"])
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_attention_masks(mask, unidirectional, dtype):
    rng = np.random.default_rng(0)
    x, w, bias = attention_case(rng, dtype)
    feeds = {"x": x}
    ins = ["x", "w", "b", ""]
    if MASKS[mask] is not None:
        feeds["m"] = MASKS[mask]
        ins[3] = "m"
    n = mk("Attention", ins, ["y"], num_heads=NH, unidirectional=unidirectional)
    check_all_paths(n, feeds, {"w": w, "b": bias}, tol(dtype), packs=2)


ATTN_VARIANTS = [
    ("qkv-sizes", dict(qkv_hidden_sizes=[16, 16, 8]), (16, 16, 8), False, False),
    ("scale-filter", dict(scale=0.3, mask_filter_value=-50.0), (16, 16, 16), False, False),
    ("attention-bias", dict(), (16, 16, 16), False, True),
    ("past-present", dict(unidirectional=1), (16, 16, 16), True, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", ATTN_VARIANTS, ids=[c[0] for c in ATTN_VARIANTS])
def test_attention_variants(case, dtype):
    _, attrs, sizes, past, abias = case
    rng = np.random.default_rng(1)
    x, w, bias = attention_case(rng, dtype, sizes)
    feeds = {"x": x, "m": np.array([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0]], np.int32)[:, : (3 if past else 0) + S]}
    ins = ["x", "w", "b", "m", "", ""]
    outs = ["y"]
    if past:
        feeds["past"] = rand(rng, (2, B, NH, 3, 4), dtype)
        ins[4] = "past"
        outs.append("present")
    if abias:
        feeds["ab"] = rand(rng, (1, NH, S, S + (3 if past else 0)), dtype)
        ins[5] = "ab"
    n = mk("Attention", ins, outs, num_heads=NH, **attrs)
    check_all_paths(n, feeds, {"w": w, "b": bias}, tol(dtype), packs=2)


def test_attention_shared_buffer_and_4d_mask_against_formula():
    """past_present_share_buffer and the 4-D (Megatron) mask: onnxruntime's CPU kernel refuses
    the 4-D mask, so both are checked against the same attention written out in float64
    (rtol 1e-5)."""
    rng = np.random.default_rng(2)
    x, w, bias = attention_case(rng, np.float32)
    m, p = 8, 2
    past = rand(rng, (2, B, NH, m, 4), np.float32)
    mask4 = np.tril(np.ones((m, m), np.int32))[None, None].repeat(B, 0)
    mask4[1, 0, :, 0] = 0
    n = mk("Attention", ["x", "w", "b", "m", "past", "", "pl"], ["y", "present"], num_heads=NH,
           past_present_share_buffer=1)
    k = lookup(MS, "Attention", 1)(n, KernelContext(1, {MS: 1}))
    y, present = k.run(x, w, bias, mask4, past, None, np.array([p], np.int32))
    qkv = x.astype(np.float64) @ w + bias
    q, kk, v = (qkv[..., i * 16:(i + 1) * 16].reshape(B, S, NH, 4).transpose(0, 2, 1, 3) for i in range(3))
    want_present = past.copy()
    want_present[0, :, :, p:p + S] = kk
    want_present[1, :, :, p:p + S] = v
    np.testing.assert_allclose(present, want_present, rtol=1e-5, atol=1e-6)
    K, V = want_present[0, :, :, : p + S], want_present[1, :, :, : p + S]
    scores = q @ K.swapaxes(-1, -2) / 2.0 + np.where(mask4[:, :, p:p + S, : p + S] > 0, 0, -10000.0)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    want = (e / e.sum(-1, keepdims=True) @ V).transpose(0, 2, 1, 3).reshape(B, S, 16)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_attention_declines_rotary_and_rejects_bad_weights():
    with pytest.raises(NotImplementedError):
        lookup(MS, "Attention", 1)(mk("Attention", ["x", "w"], ["y"], num_heads=2, do_rotary=1), KernelContext(1, {}))
    k = lookup(MS, "Attention", 1)(mk("Attention", ["x", "w"], ["y"], num_heads=2), KernelContext(1, {}))
    with pytest.raises(InvalidArgument, match="3 equal multiples"):
        k.run(np.zeros((1, 2, 4), np.float32), np.zeros((4, 10), np.float32))


# ------------------------------------------------------------------------------------------------
# MultiHeadAttention
# ------------------------------------------------------------------------------------------------
MHA_CASES = ["separate", "separate-bias", "cross-kv-len", "packed-qkv", "packed-kv", "bnsh-kv", "key-padding-2d",
             "key-padding-1d", "key-padding-3d", "attention-bias", "past-present", "unidirectional-past", "qk-output"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", MHA_CASES)
def test_multihead_attention(case, dtype):
    rng = np.random.default_rng(3)
    n, h, s = 2, 4, 3
    d = n * h
    l_ = 4 if case == "cross-kv-len" else s
    feeds = {"q": rand(rng, (B, s, d), dtype)}
    ins = ["q", "k", "v", "", "", "", "", ""]
    outs = ["y"]
    attrs = {}
    if case == "packed-qkv":
        feeds = {"q": rand(rng, (B, s, n, 3, h), dtype)}
        ins[1] = ins[2] = ""
    elif case == "packed-kv":
        feeds["k"] = rand(rng, (B, l_, n, 2, h), dtype)
        ins[2] = ""
    elif case == "bnsh-kv":
        feeds["k"], feeds["v"] = rand(rng, (B, n, 5, h), dtype), rand(rng, (B, n, 5, h), dtype)
    else:
        feeds["k"], feeds["v"] = rand(rng, (B, l_, d), dtype), rand(rng, (B, l_, d), dtype)
    if case in ("separate-bias", "packed-kv", "packed-qkv"):
        feeds["b"] = rand(rng, (3 * d,), dtype, 0.3)
        ins[3] = "b"
    past = case in ("past-present", "unidirectional-past")
    t = s + (2 if past else 0)
    if case == "key-padding-2d":
        feeds["m"] = np.array([[1, 1, 0], [1, 0, 1]], np.int32)
    elif case == "key-padding-1d":
        feeds["m"] = np.array([3, 2], np.int32)
    elif case == "key-padding-3d":
        feeds["m"] = (rng.random((B, s, t)) > 0.3).astype(np.int32)
    if "m" in feeds:
        ins[4] = "m"
    if case in ("attention-bias", "past-present"):
        feeds["ab"] = rand(rng, (B, 1, s, t), dtype)
        ins[5] = "ab"
    if past:
        feeds["pk"], feeds["pv"] = rand(rng, (B, n, 2, h), dtype), rand(rng, (B, n, 2, h), dtype)
        ins[6], ins[7] = "pk", "pv"
        outs += ["present_key", "present_value"]
        attrs["unidirectional"] = int(case == "unidirectional-past")
    if case == "qk-output":
        outs += ["", "", "qk"]
        attrs["scale"] = 0.7
    node = mk("MultiHeadAttention", ins, outs, num_heads=n, **attrs)
    want = None
    if case.startswith("packed"):
        # onnxruntime's CPU kernel refuses packed QKV / KV: the oracle is onnxruntime on the same
        # values unpacked into separate query, key and value.
        if case == "packed-qkv":
            qkv = feeds["q"]
            sep = {"q": qkv[:, :, :, 0].reshape(B, s, d), "k": qkv[:, :, :, 1].reshape(B, s, d),
                   "v": qkv[:, :, :, 2].reshape(B, s, d), "b": feeds["b"]}
        else:
            kv = feeds["k"]
            sep = {"q": feeds["q"], "k": kv[:, :, :, 0].reshape(B, l_, d), "v": kv[:, :, :, 1].reshape(B, l_, d),
                   "b": feeds["b"]}
        sep_node = mk("MultiHeadAttention", ["q", "k", "v", "b"], outs, num_heads=n, **attrs)
        want = run_ort_model(single_node_model(sep_node, sep, {}), sep)
    check_all_paths(node, feeds, {}, tol(dtype), want=want, out_types={"qk": dtype})


# ------------------------------------------------------------------------------------------------
# RotaryEmbedding
# ------------------------------------------------------------------------------------------------
ROTARY_CASES = [
    ("3d", (2, 5, 16), {}, "bs"),
    ("3d-interleaved", (2, 5, 16), dict(interleaved=1), "bs"),
    ("3d-offset", (2, 5, 16), {}, "offset"),
    ("3d-partial", (2, 5, 16), dict(rotary_embedding_dim=4, num_heads=2), "bs"),
    ("3d-partial-interleaved", (2, 5, 16), dict(rotary_embedding_dim=4, num_heads=2, interleaved=1), "bs"),
    ("4d", (2, 2, 5, 8), {}, "bs"),
    ("4d-interleaved-offset", (2, 2, 5, 8), dict(interleaved=1), "offset"),
    ("packed-batching-scale", (2, 5, 16), dict(is_packed_batching=1, scale=2.0), "bs"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", ROTARY_CASES, ids=[c[0] for c in ROTARY_CASES])
def test_ms_rotary_embedding(case, dtype):
    _, shape, attrs, pos = case
    rng = np.random.default_rng(4)
    x = rand(rng, shape, dtype)
    half = attrs.get("rotary_embedding_dim", 8) // 2
    cos, sin = rope_caches(16, half, dtype)
    s = shape[1] if len(shape) == 3 else shape[2]
    p = np.array([3], np.int64) if pos == "offset" else rng.integers(0, 16, (2, s)).astype(np.int64)
    n = mk("RotaryEmbedding", ["x", "p", "c", "s"], ["y"], **attrs)
    check_all_paths(n, {"x": x, "p": p}, {"c": cos, "s": sin}, tol(dtype))


ROTARY23_CASES = [
    ("4d", (2, 2, 5, 8), {}, True),
    ("4d-interleaved", (2, 2, 5, 8), dict(interleaved=1), True),
    ("3d-heads", (2, 5, 16), dict(num_heads=2), True),
    ("3d-partial", (2, 5, 16), dict(num_heads=2, rotary_embedding_dim=4), True),
    ("no-position-ids", (2, 2, 5, 8), {}, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", ROTARY23_CASES, ids=[c[0] for c in ROTARY23_CASES])
def test_onnx_rotary_embedding_23(case, dtype):
    _, shape, attrs, with_pos = case
    rng = np.random.default_rng(5)
    x = rand(rng, shape, dtype)
    half = attrs.get("rotary_embedding_dim", 8) // 2
    s = shape[1] if len(shape) == 3 else shape[2]
    cos, sin = rope_caches(16, half, dtype)
    if with_pos:
        p = rng.integers(0, 16, (2, s)).astype(np.int64)
        n = mk("RotaryEmbedding", ["x", "c", "s", "p"], ["y"], domain="", **attrs)
        check_all_paths(n, {"x": x, "p": p}, {"c": cos, "s": sin}, tol(dtype), opset=23)
    else:
        p = rng.integers(0, 16, (2, s))
        n = mk("RotaryEmbedding", ["x", "c", "s"], ["y"], domain="", **attrs)
        check_all_paths(n, {"x": x, "c": cos[p], "s": sin[p]}, {}, tol(dtype), opset=23)
