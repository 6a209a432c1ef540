"""Attention, MultiHeadAttention, RotaryEmbedding (com.microsoft and ONNX-23) and
GroupQueryAttention, QAttention vs onnxruntime 1.32 (CPU, graph optimizations off).

Tolerances: float32 rtol 1e-4 / atol 1e-5 (onnxruntime's MLAS GEMMs and softmax sum in another
order); float16 rtol 1e-2 / atol 1e-2 after widening (both sides compute in float32 and round
once, but onnxruntime's rotary kernel rounds each float16 product: an ulp or two of float16).
Where onnxruntime leaves values unspecified (output rows of a right-padded prompt past its
length) only the specified rows are compared.
"""

from __future__ import annotations


import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from contrib_util import MS, check_all_paths, run_ort_model, single_node_model
from quant_util import onnxpack_node, ort_node

import onnxpack
from onnxpack.errors import InvalidArgument, OnnxpackError
from onnxpack.session.kernels import KernelContext, lookup
from onnxpack.session.kernels.attention import GroupQueryAttention, sliding_rows

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
    ("empty-past", dict(unidirectional=1), (16, 16, 16), 0, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", ATTN_VARIANTS, ids=[c[0] for c in ATTN_VARIANTS])
def test_attention_variants(case, dtype):
    _, attrs, sizes, past, abias = case
    rng = np.random.default_rng(1)
    x, w, bias = attention_case(rng, dtype, sizes)
    plen = 3 if past is True else 0
    feeds = {"x": x, "m": np.array([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0]], np.int32)[:, : plen + S]}
    ins = ["x", "w", "b", "m", "", ""]
    outs = ["y"]
    if past is not False:
        feeds["past"] = rand(rng, (2, B, NH, plen, 4), dtype)
        ins[4] = "past"
        outs.append("present")
    if abias:
        feeds["ab"] = rand(rng, (1, NH, S, S + plen), dtype)
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
    want_present = np.zeros_like(past)
    want_present[:, :, :, :p] = past[:, :, :, :p]
    want_present[0, :, :, p:p + S] = kk
    want_present[1, :, :, p:p + S] = v
    np.testing.assert_allclose(present[:, :, :, : p + S], want_present[:, :, :, : p + S], rtol=1e-5, atol=1e-6)
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


# QAttention (quantize_dynamic of an optimized BERT): the integer product is exact on both sides
# (onnxruntime's u8s8 GEMM given the int8 weight shifted to uint8, quant_util), so the outputs
# differ only by the attention's float arithmetic.
QATTN_CASES = [
    # id, weight dtype, per-column scale / zero point, input zero point, mask, past
    ("s8-tensor", np.int8, False, False, None, False),
    ("s8-column-mask", np.int8, True, True, "1d-lengths", False),
    ("u8-column-zp-2d-mask", np.uint8, True, True, "2d", False),
    ("u8-tensor-past", np.uint8, False, True, None, True),
]


@pytest.mark.parametrize("case", QATTN_CASES, ids=[c[0] for c in QATTN_CASES])
def test_qattention_matches_onnxruntime(case):
    _, wdt, per_col, with_xz, mask, past = case
    rng = np.random.default_rng(len(case[0]))
    total = 48
    x = rng.integers(0, 256, (B, S, DIN)).astype(np.uint8)
    info = np.iinfo(wdt)
    w = rng.integers(info.min, info.max, (DIN, total), endpoint=True).astype(wdt)
    bias = rand(rng, (total,), np.float32, 0.2)
    ws = (rng.random(total if per_col else ()) * 0.004 + 0.001).astype(np.float32)
    wz = rng.integers(info.min // 4 + 64 * (wdt == np.uint8), info.max // 4 + 64 * (wdt == np.uint8),
                      total if per_col else (), endpoint=True).astype(wdt)
    names = ["x", "w", "b", "xs", "ws", "m", "xz", "wz", "past"]
    inputs = [x, w, bias, np.array(0.02, np.float32), np.asarray(ws), None,
              np.array(rng.integers(100, 156), np.uint8) if with_xz else None, np.asarray(wz), None]
    if mask is not None:
        inputs[5] = MASKS[mask]
    outs = ["y"]
    attrs = {}
    if past:
        inputs[8] = rand(rng, (2, B, NH, 3, 4), np.float32)
        outs.append("present")
        attrs["unidirectional"] = 1
    names = [n if v is not None else "" for n, v in zip(names, inputs)]
    node = mk("QAttention", names, outs, num_heads=NH, **attrs)
    want = ort_node(node, inputs, 21)
    for prepack in (True, False):
        got, sess = onnxpack_node(node, inputs, 21, consts=["w", "b", "ws", "wz"], prepack=prepack)
        assert sess.get_fallback_nodes() == []
        assert sess.get_prepack_stats()["weights_packed"] == (2 if prepack else 0)
        for g, w_ in zip(got, want):
            assert g.dtype == w_.dtype and g.shape == w_.shape
            np.testing.assert_allclose(g, w_, **F32)
    got, _ = onnxpack_node(node, inputs, 21)  # every input fed
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(g, w_, **F32)


def test_qattention_rejects_float_input_and_bad_scales():
    n = mk("QAttention", ["x", "w", "b", "xs", "ws"], ["y"], num_heads=2)
    k = lookup(MS, "QAttention", 1)(n, KernelContext(1, {MS: 1}))
    w = np.zeros((4, 12), np.int8)
    b = np.zeros(12, np.float32)
    one = np.array(1.0, np.float32)
    with pytest.raises(InvalidArgument, match="input must be int8 or uint8"):
        k.run(np.zeros((1, 2, 4), np.float32), w, b, one, one)
    with pytest.raises(InvalidArgument, match="weight_scale must be a scalar or have 12 values"):
        k.run(np.zeros((1, 2, 4), np.uint8), w, b, one, np.ones(5, np.float32))
    with pytest.raises(InvalidArgument, match="3 equal multiples"):
        k.run(np.zeros((1, 2, 4), np.uint8), np.zeros((4, 10), np.int8), np.zeros(10, np.float32), one, one)


# ------------------------------------------------------------------------------------------------
# MultiHeadAttention
# ------------------------------------------------------------------------------------------------
MHA_CASES = ["separate", "separate-bias", "cross-kv-len", "packed-qkv", "packed-kv", "bnsh-kv", "key-padding-2d",
             "key-padding-1d", "key-padding-3d", "attention-bias", "past-present", "unidirectional-past", "qk-output",
             "unidirectional-more-keys", "unidirectional-more-keys-past"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", MHA_CASES)
def test_multihead_attention(case, dtype):
    rng = np.random.default_rng(3)
    n, h, s = 2, 4, 3
    d = n * h
    # more keys than queries, causal: onnxruntime's last query row sees every key (the rows
    # before it: keys j <= past + i)
    l_ = 4 if case == "cross-kv-len" else (5 if case.startswith("unidirectional-more-keys") else s)
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
    past = case in ("past-present", "unidirectional-past", "unidirectional-more-keys-past")
    t = s + (2 if past else 0)
    if case == "unidirectional-more-keys":
        attrs["unidirectional"] = 1
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
        attrs["unidirectional"] = int(case.startswith("unidirectional"))
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


@pytest.mark.parametrize("shape", [(2, 2, 5, 8), (3, 5, 16)], ids=["4d", "3d"])
def test_onnx_rotary_embedding_23_broadcasts_one_batch_row_of_caches(shape):
    """Without position_ids, caches of one batch row (1, S, half) serve every row: what torch's
    exporter writes at opset 23 (onnx.reference broadcasts them; onnxruntime 1.32 refuses them
    above batch 1) -- equal to the same caches repeated per row, which onnxruntime runs."""
    rng = np.random.default_rng(6)
    x = rand(rng, shape, np.float32)
    attrs = dict(num_heads=2) if len(shape) == 3 else {}
    s = shape[1] if len(shape) == 3 else shape[2]
    cos, sin = rope_caches(16, 4, np.float32)
    c, sn = cos[None, 3:3 + s], sin[None, 3:3 + s]
    n = mk("RotaryEmbedding", ["x", "c", "s"], ["y"], domain="", **attrs)
    want = check_all_paths(n, {"x": x, "c": np.repeat(c, shape[0], 0), "s": np.repeat(sn, shape[0], 0)}, {}, F32,
                           opset=23)
    check_all_paths(n, {"x": x, "c": c, "s": sn}, {}, F32, opset=23, want=want)
    bad = single_node_model(n, {"x": x, "c": c[:, :-1], "s": sn[:, :-1]}, {}, 23)
    with pytest.raises(onnxpack.errors.RuntimeFailure, match="caches must be"):
        onnxpack.InferenceSession(bad.SerializeToString()).run(None, {"x": x, "c": c[:, :-1], "s": sn[:, :-1]})


# ------------------------------------------------------------------------------------------------
# GroupQueryAttention
# ------------------------------------------------------------------------------------------------
GQA_INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
              "sin_cache", "position_ids", "attention_bias", "head_sink"]


def gqa_model(dtype, used: set[str], consts: dict[str, np.ndarray], **attrs) -> onnx.ModelProto:
    """A one-node GroupQueryAttention model whose inputs have no fixed shapes (steps differ)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    types = {"seqlens_k": TensorProto.INT32, "total_sequence_length": TensorProto.INT32,
             "position_ids": TensorProto.INT64}
    ins = [n if n in used or n in consts else "" for n in GQA_INPUTS]
    while ins[-1] == "":
        ins.pop()
    node = helper.make_node("GroupQueryAttention", ins, ["y", "present_key", "present_value"], domain=MS, **attrs)
    graph = helper.make_graph(
        [node], "gqa",
        [helper.make_tensor_value_info(n, types.get(n, elem), None) for n in ins if n and n not in consts],
        [helper.make_tensor_value_info(o, elem, None) for o in node.output],
        [numpy_helper.from_array(v, n) for n, v in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10)


class GqaPair:
    """The same GQA model in onnxruntime and in onnxpack."""

    def __init__(self, model):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.ort = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.ours = onnxpack.InferenceSession(model.SerializeToString())
        assert not self.ours.get_fallback_nodes()


GQA_LOOP = [
    # id, layout, packed, rotary (None | "halves" | "interleaved"), attrs
    ("exact-plain", "exact", False, None, {}),
    ("shared-plain", "shared", False, None, {}),
    ("exact-rotary", "exact", False, "halves", {}),
    ("shared-rotary-interleaved", "shared", False, "interleaved", {}),
    ("shared-packed-rotary", "shared", True, "halves", {}),
    ("exact-local-window", "exact", False, "halves", dict(local_window_size=3)),
    ("shared-softcap", "shared", False, None, dict(softcap=2.0)),
    ("exact-packed-window-softcap", "exact", True, "interleaved", dict(local_window_size=2, softcap=5.0)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", GQA_LOOP, ids=[c[0] for c in GQA_LOOP])
@pytest.mark.parametrize("batch", [2, 1], ids=["batch2", "batch1"])
def test_gqa_prompt_then_decode_steps(case, dtype, batch, jit_path, monkeypatch):
    """A right-padded batch-2 prompt (lengths 5 and 3), then 4 decode steps each feeding its own
    present back as past.  "exact": past holds exactly the cached rows (P = past length, empty
    for the prompt); "shared": past is a max-length buffer (12 rows) that present keeps.  Batch 1
    float32 decode steps take the JIT kernel (``_attn_jit.gqa_decode``) unless numpy is asked for:
    checked, so a silent fall back to numpy fails the test."""
    took = _gqa_loop_vs_onnxruntime(case, dtype, batch, monkeypatch)
    assert any(took) == (jit_path != "numpy" and batch == 1 and dtype == np.float32), took
    # Packed QKV decoding steps (onnxruntime-genai's graphs) take the short path to the same call.
    assert ("packed" in took) == (any(took) and case[2]), took


def _new_tokens(rng, batch: int, s: int, n: int, nkv: int, h: int, dtype, packed: bool) -> dict:
    """GroupQueryAttention's inputs for ``s`` new tokens: packed QKV as ``query``, or query, key
    and value apart (drawn in that order)."""
    if packed:
        return {"query": rand(rng, (batch, s, (n + 2 * nkv) * h), dtype)}
    return {"query": rand(rng, (batch, s, n * h), dtype), "key": rand(rng, (batch, s, nkv * h), dtype),
            "value": rand(rng, (batch, s, nkv * h), dtype)}


def _gqa_loop_vs_onnxruntime(case, dtype, batch, monkeypatch) -> list[bool]:
    """test_gqa_prompt_then_decode_steps's loop; returns, per decode call, whether the JIT took it
    (``"packed"`` when the packed-QKV decoding path did)."""
    took = []
    decode_jit = GroupQueryAttention._decode_jit
    decode_packed = GroupQueryAttention._decode_packed

    def spy(self, *args):
        got = decode_jit(self, *args)
        took.append(got is not None)
        return got

    def spy_packed(self, *args):
        got = decode_packed(self, *args)
        if got is not None:
            took.append("packed")
        return got

    monkeypatch.setattr(GroupQueryAttention, "_decode_jit", spy)
    monkeypatch.setattr(GroupQueryAttention, "_decode_packed", spy_packed)
    _, layout, packed, rotary, attrs = case
    rng = np.random.default_rng(10)
    n, nkv, h, cap = 4, 2, 16, 12  # onnxruntime rotates only head sizes that are multiples of 16
    consts = {}
    if rotary:
        consts["cos_cache"], consts["sin_cache"] = rope_caches(16, h // 2, dtype)
        attrs = dict(attrs, do_rotary=1, rotary_interleaved=int(rotary == "interleaved"))
    used = {"query", "past_key", "past_value", "seqlens_k", "total_sequence_length"}
    if not packed:
        used |= {"key", "value"}
    pair = GqaPair(gqa_model(dtype, used, consts, num_heads=n, kv_num_heads=nkv, **attrs))
    lens = np.array([5, 3])[:batch]  # batch 1: the one-sequence decoding path
    s = 5
    p0 = 0 if layout == "exact" else cap
    caches = {k: (np.zeros((batch, nkv, p0, h), dtype),) * 2 for k in ("ort", "ours")}
    for step in range(5):
        if step:
            lens = lens + 1
            s = 1
        total = int(lens.max())
        feeds = {"seqlens_k": (lens - 1).astype(np.int32), "total_sequence_length": np.array(total, np.int32)}
        feeds.update(_new_tokens(rng, batch, s, n, nkv, h, dtype, packed))
        outs = {}
        for side, sess in (("ort", pair.ort), ("ours", pair.ours)):
            pk, pv = caches[side]
            outs[side] = sess.run(None, {**feeds, "past_key": pk, "past_value": pv})
            caches[side] = (outs[side][1], outs[side][2])
        (y_ort, k_ort, v_ort), (y, k, v) = outs["ort"], outs["ours"]
        assert y.dtype == y_ort.dtype == dtype and y.shape == y_ort.shape
        # present rows: max(total_sequence_length, past rows) -- the buffer, or exactly the total
        assert k.shape == k_ort.shape == (batch, nkv, cap if layout == "shared" else total, h), k.shape
        t = tol(dtype)
        if step == 0:  # rows of row 1 past its length 3 are unspecified in onnxruntime
            np.testing.assert_allclose(y[0].astype(np.float64), y_ort[0].astype(np.float64), **t)
            if batch == 2:
                np.testing.assert_allclose(y[1, :3].astype(np.float64), y_ort[1, :3].astype(np.float64), **t)
        else:
            np.testing.assert_allclose(y.astype(np.float64), y_ort.astype(np.float64), **t, err_msg=f"step {step}")
        # every row, those past the longest row's end too (zero on both sides)
        for got, ref, what in ((k, k_ort, "present_key"), (v, v_ort, "present_value")):
            np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), **t, err_msg=f"{what} {step}")
            np.testing.assert_array_equal(got[:, :, total:] == 0, True, err_msg=f"{what} {step}")
    return took


@pytest.mark.parametrize("case", [GQA_LOOP[2], GQA_LOOP[5], GQA_LOOP[7]], ids=[GQA_LOOP[i][0] for i in (2, 5, 7)])
@pytest.mark.parametrize("jit_path", ["native"], indirect=True)
def test_gqa_decode_steps_split_over_kv_heads(case, jit_path, monkeypatch):
    """The native decoding step with its KV heads shared out over an OpenMP team of 2 (taken from
    a few hundred keys on; here from the first, and past the one-thread key limit) equals
    onnxruntime, rotary, window and softcap included."""
    from onnxpack.session.kernels import _jit_native, _native, attention

    monkeypatch.setenv("ONNXPACK_NUM_THREADS", "2")
    monkeypatch.setattr(_jit_native._Kernels, "GQA_SPLIT_KEYS", 1)
    monkeypatch.setattr(attention, "_JIT_MAX_KEYS", 2)  # past it only the split serves
    entries = []
    parallel = _native.Native.parallel

    def spy(self, name, block, threads):
        entries.append(name)
        return parallel(self, name, block, threads)

    monkeypatch.setattr(_native.Native, "parallel", spy)
    took = _gqa_loop_vs_onnxruntime(case, np.float32, 1, monkeypatch)
    assert all(took) and "gqa_f32_omp" in entries, (took, entries)


GQA_PROMPT = [
    ("plain", {}, set()),
    ("scale", dict(scale=0.2), set()),
    ("smooth-softmax", dict(smooth_softmax=1), set()),
    ("head-sink", {}, {"head_sink"}),
    ("attention-bias", {}, {"attention_bias"}),
    ("attention-bias-softcap", dict(softcap=1.5), {"attention_bias"}),
    ("position-ids-rotary", dict(do_rotary=1), {"position_ids"}),
    ("non-causal", dict(causal=0), set()),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", GQA_PROMPT, ids=[c[0] for c in GQA_PROMPT])
def test_gqa_options(case, dtype):
    """Options on a prompt of 4 tokens plus one decode step (past of 4 rows), batch 2."""
    _, attrs, extra = case
    rng = np.random.default_rng(11)
    n, nkv, h = 6, 2, 16
    consts = {}
    if attrs.get("do_rotary"):
        consts["cos_cache"], consts["sin_cache"] = rope_caches(16, h // 2, dtype)
    for s, p in ((4, 0), (1, 4)):
        feeds = {
            "query": rand(rng, (2, s, n * h), dtype), "key": rand(rng, (2, s, nkv * h), dtype),
            "value": rand(rng, (2, s, nkv * h), dtype),
            "past_key": rand(rng, (2, nkv, p, h), dtype), "past_value": rand(rng, (2, nkv, p, h), dtype),
            "seqlens_k": np.full(2, p + s - 1, np.int32), "total_sequence_length": np.array(p + s, np.int32),
        }
        if "head_sink" in extra:
            feeds["head_sink"] = rand(rng, (n,), dtype)
        if "attention_bias" in extra:
            feeds["attention_bias"] = rand(rng, (2, 1, s, p + s), dtype, 2.0)
        if "position_ids" in extra:
            feeds["position_ids"] = rng.integers(0, 16, (2, s)).astype(np.int64)
        ins = [k if k in feeds or k in consts else "" for k in GQA_INPUTS]
        node = mk("GroupQueryAttention", ins, ["y", "present_key", "present_value"], num_heads=n, kv_num_heads=nkv,
                  **attrs)
        check_all_paths(node, feeds, consts, tol(dtype))


SLIDING = [
    # id, batch, cache rows, window, packed, steps (new tokens per call; the first is the prompt)
    ("batch1-chunks", 1, 8, 8, False, (5, 1, 1, 4, 1, 1, 3)),
    ("batch1-wider-cache", 1, 10, 6, True, (7, 1, 5, 1, 1, 2)),
    ("batch2-decode", 2, 6, 6, False, (4, 1, 1, 1, 1, 1, 1, 1)),
    ("batch1-long-prompt", 1, 6, 4, True, (9, 1, 1)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", SLIDING, ids=[c[0] for c in SLIDING])
def test_gqa_sliding_window_cache_matches_onnxruntime(case, dtype):
    """``sliding_window_cache=1`` (the builder's Gemma-2 local layers): the cache is a buffer of C
    rows that present keeps from row 0 and cuts to its last C rows once the context is longer,
    each call's present fed back as the next past; prompts and chunks longer than what is left
    of the buffer, and a batch whose second row advances every other step (onnxruntime
    refuses right-padded prompts with this cache).  Outputs and every row of the present caches
    that onnxruntime defines (the first ``sliding_rows`` of each row) agree, and past rows that
    onnxruntime laid out are read as it reads them: each side is fed the other's present."""
    _, batch, cap, window, packed, steps = case
    rng = np.random.default_rng(12)
    n, nkv, h = 4, 2, 16
    consts = {}
    consts["cos_cache"], consts["sin_cache"] = rope_caches(64, h // 2, dtype)
    used = {"query", "past_key", "past_value", "seqlens_k", "total_sequence_length"} | (set() if packed else {"key", "value"})
    pair = GqaPair(gqa_model(dtype, used, consts, num_heads=n, kv_num_heads=nkv, local_window_size=window,
                             sliding_window_cache=1, do_rotary=1, softcap=4.0))
    caches = {k: (np.zeros((batch, nkv, cap, h), dtype),) * 2 for k in ("ort", "ours")}
    lens = np.zeros(batch, np.int64)
    for step, s in enumerate(steps):
        lens = lens + np.array([s, s * (step % 2)])[:batch] if step else np.full(batch, s)
        total = s if step == 0 else int(lens.max())
        feeds = {"seqlens_k": (lens - 1).astype(np.int32), "total_sequence_length": np.array(total, np.int32)}
        width = (n + 2 * nkv) * h if packed else n * h
        feeds["query"] = rand(rng, (batch, s, width), dtype)
        if not packed:
            feeds["key"] = rand(rng, (batch, s, nkv * h), dtype)
            feeds["value"] = rand(rng, (batch, s, nkv * h), dtype)
        outs = {}
        swap = step % 3 == 2  # now and then each side continues from the other's caches
        for side, sess in (("ort", pair.ort), ("ours", pair.ours)):
            pk, pv = caches[{"ort": "ours", "ours": "ort"}[side] if swap else side]
            outs[side] = sess.run(None, {**feeds, "past_key": pk, "past_value": pv})
        for side in outs:
            caches[side] = (outs[side][1], outs[side][2])
        (y_ort, k_ort, v_ort), (y, k, v) = outs["ort"], outs["ours"]
        t = tol(dtype)
        assert k.shape == k_ort.shape == (batch, nkv, cap, h)
        for r in range(batch):
            rows = sliding_rows(int(lens[r]), cap, window)
            np.testing.assert_allclose(y[r].astype(np.float64), y_ort[r].astype(np.float64), **t,
                                       err_msg=f"step {step} row {r}")
            for got, ref, what in ((k, k_ort, "present_key"), (v, v_ort, "present_value")):
                np.testing.assert_allclose(got[r, :, :rows].astype(np.float64), ref[r, :, :rows].astype(np.float64),
                                           **t, err_msg=f"{what} step {step} row {r}")
            # ours: the unspecified rows are zero (onnxruntime leaves whatever the memory held)
            assert not k[r, :, rows:].any() and not v[r, :, rows:].any()


def test_gqa_sliding_window_cache_shorter_than_the_window_is_refused():
    ctx = KernelContext(1, {MS: 1})
    cls = lookup(MS, "GroupQueryAttention", 1)
    k = cls(mk("GroupQueryAttention", GQA_INPUTS[:7], ["y", "pk", "pv"], num_heads=2, kv_num_heads=1,
               local_window_size=4, sliding_window_cache=1), ctx)
    q, kv = np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 4), np.float32)
    past = np.zeros((1, 1, 3, 4), np.float32)
    with pytest.raises(InvalidArgument, match="fewer than local_window_size"):
        k.run(q, kv, kv, past, past, np.array([2], np.int32), np.array(3, np.int32))
    with pytest.raises(InvalidArgument, match="needs local_window_size > 0"):  # as onnxruntime
        cls(mk("GroupQueryAttention", GQA_INPUTS[:7], ["y"], num_heads=2, kv_num_heads=1, sliding_window_cache=1), ctx)


def test_sliding_rows_cycle():
    """Pure: a full buffer of C rows drops C - W + 1 of them at the next token, then refills."""
    assert [sliding_rows(p, 5, 3) for p in range(13)] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3]
    assert [sliding_rows(p, 4, 4) for p in (3, 4, 5, 40)] == [3, 4, 4, 4]


def test_gqa_declines_what_it_does_not_implement_and_checks_lengths():
    ctx = KernelContext(1, {MS: 1})
    cls = lookup(MS, "GroupQueryAttention", 1)
    with pytest.raises(NotImplementedError):
        cls(mk("GroupQueryAttention", ["q"], ["y"], num_heads=2, kv_num_heads=1, k_quant_type="PER_TENSOR"), ctx)
    with pytest.raises(InvalidArgument, match="multiple of kv_num_heads"):
        cls(mk("GroupQueryAttention", ["q"], ["y"], num_heads=3, kv_num_heads=2), ctx)
    k = cls(mk("GroupQueryAttention", GQA_INPUTS[:7], ["y"], num_heads=2, kv_num_heads=1), ctx)
    q = np.zeros((1, 1, 8), np.float32)
    kv = np.zeros((1, 1, 4), np.float32)
    past = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(InvalidArgument, match="seqlens_k"):
        k.run(q, kv, kv, past, past, np.array([5], np.int32), np.array(3, np.int32))


def _heap_junk():
    """Leave freed float32 arrays of a recognizable value on the heap: memory an array is later
    given without being written would show it."""
    junk = [np.full(64 * 64, 12345.0, np.float32) for _ in range(64)]
    del junk


def _bits(x):
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


GQA_STATIC = [
    # id, dtype, batch, packed, past rows P (static: P >= total; 0: the growing cache)
    ("static-f32", np.float32, 1, False, 10),
    ("static-f32-packed", np.float32, 1, True, 10),
    ("static-f16", np.float16, 1, False, 10),
    ("static-f32-batch2", np.float32, 2, False, 10),
    ("static-f16-batch2-packed", np.float16, 2, True, 10),
    ("growing-f32-batch2", np.float32, 2, False, 0),
    ("growing-f16", np.float16, 1, True, 0),
]


@pytest.mark.parametrize("case", GQA_STATIC, ids=[c[0] for c in GQA_STATIC])
def test_gqa_present_rows_equal_onnxruntime_bit_for_bit(case, jit_path):
    """A valid static KV cache (a past buffer of P rows, the used ones first; its other rows hold
    stale values, not zeros) and a growing one, prompt then decode steps, batch rows of
    different lengths: every row of present_key / present_value is onnxruntime's, bit for bit
    (no rotary: the present is copies of past and new rows, and onnxruntime's zeros wherever a
    call writes nothing -- past a row's end and a static buffer's unused rows, whatever the past
    buffer held there).  Before each run the heap is left holding freed arrays of 12345.0, and
    the same feeds run twice give the same bits: no row is memory left unwritten."""
    _, dtype, batch, packed, cap = case
    rng = np.random.default_rng(21)
    n, nkv, h = 4, 2, 16
    used = {"query", "past_key", "past_value", "seqlens_k", "total_sequence_length"}
    used |= set() if packed else {"key", "value"}
    pair = GqaPair(gqa_model(dtype, used, {}, num_heads=n, kv_num_heads=nkv))
    lens = np.array([4, 2])[:batch]
    past = rand(rng, (batch, nkv, cap, h), dtype), rand(rng, (batch, nkv, cap, h), dtype)  # stale rows
    for step in range(4):
        s = 4 if step == 0 else 1
        if step:
            lens = lens + 1
        total = 4 if step == 0 else int(lens.max())
        feeds = {"seqlens_k": (lens - 1).astype(np.int32), "total_sequence_length": np.array(total, np.int32),
                 "past_key": past[0], "past_value": past[1]}
        feeds.update(_new_tokens(rng, batch, s, n, nkv, h, dtype, packed))
        want = pair.ort.run(None, feeds)
        runs = []
        for _ in range(2):
            _heap_junk()
            runs.append(pair.ours.run(None, feeds))
        got = runs[0]
        assert got[1].shape == want[1].shape == (batch, nkv, max(cap, total), h)
        for i, what in ((1, "present_key"), (2, "present_value")):
            np.testing.assert_array_equal(_bits(got[i]), _bits(want[i]), err_msg=f"{what} step {step}")
            np.testing.assert_array_equal(_bits(runs[1][i]), _bits(got[i]), err_msg=f"{what} step {step}")
        for r in range(batch):  # a padded prompt's rows past the row's length: unspecified
            keep = slice(0, int(lens[r])) if step == 0 else slice(None)
            np.testing.assert_allclose(got[0][r, keep].astype(np.float64), want[0][r, keep].astype(np.float64),
                                       **tol(dtype), err_msg=f"output step {step} row {r}")
        past = (want[1], want[2])  # both continue from onnxruntime's caches


@pytest.mark.parametrize("layout", ["shared", "apart"])
def test_gqa_bound_present_rows_equal_onnxruntime(layout):
    """IOBinding: present bound to the past buffer itself (the shared KV cache: only the new row
    is written, the buffer's other rows stay as they were, in onnxruntime too) or to a buffer
    apart from it that holds junk (zeroed first, as onnxruntime zeroes it): every row equal to
    onnxruntime's, bit for bit, over a few decode steps of a static cache.  (A binding's first
    run of a signature computes a fresh present that is then copied into the buffer -- zeros
    in its unused rows, see ``_iobinding._BindHook`` -- so one warm-up step on scratch buffers
    comes first, on both sides.)"""
    rng = np.random.default_rng(22)
    n, nkv, h, cap = 4, 2, 16, 12
    used = {"query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"}
    pair = GqaPair(gqa_model(np.float32, used, {}, num_heads=n, kv_num_heads=nkv))
    stale = rand(rng, (1, nkv, cap, h), np.float32), rand(rng, (1, nkv, cap, h), np.float32)
    results = {}
    for side, sess, rt in (("ort", pair.ort, ort), ("ours", pair.ours, onnxpack)):
        step_rng = np.random.default_rng(23)  # the same feeds on both sides
        binding = sess.io_binding()
        got = []
        for step, length in enumerate((3, 3, 4, 5)):
            if step < 2:  # the warm-up's scratch buffers, then the real cache
                past = [rt.OrtValue.ortvalue_from_numpy(x.copy()) for x in stale]
            present = past if layout == "shared" else [
                rt.OrtValue.ortvalue_from_numpy(np.full((1, nkv, cap, h), 12345.0, np.float32)) for _ in range(2)]
            for name, x in (("query", rand(step_rng, (1, 1, n * h), np.float32)),
                            ("key", rand(step_rng, (1, 1, nkv * h), np.float32)),
                            ("value", rand(step_rng, (1, 1, nkv * h), np.float32)),
                            ("seqlens_k", np.array([length - 1], np.int32)),
                            ("total_sequence_length", np.array(length, np.int32))):
                binding.bind_cpu_input(name, x)
            binding.bind_ortvalue_input("past_key", past[0])
            binding.bind_ortvalue_input("past_value", past[1])
            binding.bind_output("y")
            binding.bind_ortvalue_output("present_key", present[0])
            binding.bind_ortvalue_output("present_value", present[1])
            sess.run_with_iobinding(binding)
            assert present[0].data_ptr() == binding.get_outputs()[1].data_ptr()
            if step:
                got.append([o.copy() for o in binding.copy_outputs_to_cpu()])
            past = present
        results[side] = got
    for step, (want, got) in enumerate(zip(results["ort"], results["ours"])):
        np.testing.assert_allclose(got[0], want[0], **F32, err_msg=f"step {step}")
        for i in (1, 2):
            np.testing.assert_array_equal(_bits(got[i]), _bits(want[i]), err_msg=f"present {i} step {step}")
        if layout == "shared":  # the stale rows past the sequence are untouched
            np.testing.assert_array_equal(got[1][:, :, 5:], stale[0][:, :, 5:])
        else:
            assert not got[1][:, :, 3 + step:].any()


GQA_LENGTHS = [
    # id, batch, S, past rows P, total T, seqlens_k, onnxruntime's error (None: computed)
    ("over-long-total-no-past", 1, 1, 0, 64, [0], "total_sequence_length must equal"),
    ("over-long-total-past", 1, 1, 3, 9, [3], "total_sequence_length must equal"),
    ("over-long-total-prompt", 1, 3, 2, 4, [2], "total_sequence_length must equal"),
    ("total-shorter-than-the-tokens", 1, 3, 0, 2, [1], "at least kv_sequence_length"),
    ("chunk-after-a-past-batch2", 2, 2, 3, 5, [4, 3], "batch_size must be 1"),
    ("seqlens-past-the-present", 1, 1, 4, 4, [4], "seqlens_k"),
    ("growing-full-past", 1, 1, 2, 3, [2], None),
    ("growing", 2, 1, 3, 4, [3, 1], None),
    ("static-total-below-past", 1, 1, 6, 3, [2], None),
    ("static-seqlens-beyond-total", 1, 1, 8, 4, [6], None),  # onnxruntime bounds seqlens_k by C, not T
    ("static-prompt", 2, 3, 5, 3, [2, 1], None),
    ("chunk-after-a-past", 1, 2, 4, 4, [3], None),
]


@pytest.mark.parametrize("packed", [False, True], ids=["kv", "packed"])
@pytest.mark.parametrize("case", GQA_LENGTHS, ids=[c[0] for c in GQA_LENGTHS])
def test_gqa_lengths_refused_or_computed_as_onnxruntime(case, packed, jit_path):
    """total_sequence_length T, past rows P, new tokens S and seqlens_k checked as onnxruntime
    checks them: T >= S, T == P + S (growing) or T <= P (static), seqlens_k in [0, max(T, P)),
    a chunk after a past only for one sequence.  What onnxruntime refuses is an onnxpack
    InvalidArgument (the kernel's own; a RuntimeFailure caused by it from a session) -- a T
    larger than P + S no longer returns present rows nobody wrote; what it computes gives its
    values (the present bit for bit).  Every decoding path is tried: numpy, numba, native and,
    for packed float32 decoding steps, the packed path."""
    _, b, s, p, t, seqlens, error = case
    rng = np.random.default_rng(24)
    n, nkv, h = 2, 1, 16
    used = {"query", "past_key", "past_value", "seqlens_k", "total_sequence_length"}
    used |= set() if packed else {"key", "value"}
    pair = GqaPair(gqa_model(np.float32, used, {}, num_heads=n, kv_num_heads=nkv))
    feeds = {"seqlens_k": np.array(seqlens, np.int32), "total_sequence_length": np.array(t, np.int32),
             "past_key": rand(rng, (b, nkv, p, h), np.float32), "past_value": rand(rng, (b, nkv, p, h), np.float32)}
    if packed:
        feeds["query"] = rand(rng, (b, s, (n + 2 * nkv) * h), np.float32)
    else:
        feeds["query"] = rand(rng, (b, s, n * h), np.float32)
        feeds["key"] = rand(rng, (b, s, nkv * h), np.float32)
        feeds["value"] = rand(rng, (b, s, nkv * h), np.float32)
    if error is not None:
        with pytest.raises(Exception, match=error):
            pair.ort.run(None, feeds)
        with pytest.raises(OnnxpackError, match=error) as info:
            pair.ours.run(None, feeds)
        assert isinstance(info.value.__cause__, InvalidArgument), repr(info.value.__cause__)
        kernel = lookup(MS, "GroupQueryAttention", 1)(
            mk("GroupQueryAttention", [x if x in feeds else "" for x in GQA_INPUTS[:7]], ["y", "pk", "pv"],
               num_heads=n, kv_num_heads=nkv), KernelContext(1, {MS: 1}))
        with pytest.raises(InvalidArgument, match=error):
            kernel.run(*(feeds.get(x) for x in GQA_INPUTS[:7]))
        return
    want = pair.ort.run(None, feeds)
    _heap_junk()
    got = pair.ours.run(None, feeds)
    for i in (1, 2):
        np.testing.assert_array_equal(_bits(got[i]), _bits(want[i]))
    lens = np.array(seqlens) + 1
    for r in range(b):  # a padded prompt's rows past its length: unspecified
        keep = slice(0, int(lens[r])) if s == t else slice(None)
        np.testing.assert_allclose(got[0][r, keep], want[0][r, keep], **F32, err_msg=f"row {r}")


def test_attention_shared_buffer_present_keeps_the_buffer_rows():
    """Attention with past_present_share_buffer=1 (onnxruntime's CPU kernel refuses it): present is
    the past buffer with the new rows written after past_sequence_length -- the rows beyond are
    the buffer's, never memory left unwritten."""
    rng = np.random.default_rng(25)
    x, w, bias = attention_case(rng, np.float32)
    m, p = 9, 2
    past = rand(rng, (2, B, NH, m, 4), np.float32)
    node = mk("Attention", ["x", "w", "b", "", "past", "", "pl"], ["y", "present"], num_heads=NH,
              past_present_share_buffer=1)
    kernel = lookup(MS, "Attention", 1)(node, KernelContext(1, {MS: 1}))
    _heap_junk()
    _, present = kernel.run(x, w, bias, None, past, None, np.array([p], np.int32))
    np.testing.assert_array_equal(present[:, :, :, :p], past[:, :, :, :p])
    np.testing.assert_array_equal(present[:, :, :, p + S:], past[:, :, :, p + S:])
    assert not np.array_equal(present[:, :, :, p:p + S], past[:, :, :, p:p + S])


# -- a float16 / bfloat16 exported attention chain: the nodes' rounding, BLAS products ----------
def _chain_model(elem, scale: np.ndarray) -> bytes:
    nodes = [helper.make_node("Transpose", ["qr"], ["qt"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 2, 3, 1]),
             helper.make_node("Transpose", ["vr"], ["vt"], perm=[0, 2, 1, 3]),
             helper.make_node("MatMul", ["qt", "kt"], ["qk"]), helper.make_node("Mul", ["qk", "sc"], ["qks"]),
             helper.make_node("Add", ["qks", "mask"], ["qkm"]), helper.make_node("Softmax", ["qkm"], ["pr"], axis=-1),
             helper.make_node("MatMul", ["pr", "vt"], ["y"])]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info(x, elem, [2, 70, 3, 16]) for x in ("qr", "kr", "vr")]
        + [helper.make_tensor_value_info("mask", elem, [2, 1, 1, 70])],
        [helper.make_tensor_value_info("y", elem, None)], [numpy_helper.from_array(scale, "sc")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_attention_chain_equals_unfused_nodes(dtype, monkeypatch):
    """Q.K^T -> Mul -> Add(mask) -> Softmax -> .V in float16 (convert_float_to_float16's output)
    and bfloat16: the attention_chain kernel's two products are float32 BLAS GEMMs of the
    widened operands, rounded once, as the MatMul kernel computes them (numpy's float16 matmul
    is a scalar loop), the scale, mask and softmax the nodes' own: the same bits as onnxpack's
    unfused nodes (pre-packing off: no fusion).  float16 runs fused in a session (bfloat16
    chains are not fused: the kernel is called directly) and is within the file's float16
    tolerance of onnxruntime."""
    from onnxpack.session.kernels import _act
    from onnxpack.session.kernels.attention import AttentionChain

    if dtype == "bfloat16":
        ml = pytest.importorskip("ml_dtypes")
        np_dtype, elem = np.dtype(ml.bfloat16), TensorProto.BFLOAT16
    else:
        np_dtype, elem = np.dtype(np.float16), TensorProto.FLOAT16
    rng = np.random.default_rng(26)
    feeds = {x: (rng.standard_normal((2, 70, 3, 16)) * 2).astype(np_dtype) for x in ("qr", "kr", "vr")}
    feeds["mask"] = np.where(rng.random((2, 1, 1, 70)) < 0.3, -10000.0, 0.0).astype(np_dtype)
    scale = np.array(0.25, np_dtype)
    model = onnx.load_from_string(_chain_model(elem, np.array(0.25, np.float32)))
    # (numpy_helper cannot write ml_dtypes' bfloat16: make_tensor rounds the float to either type)
    model.graph.initializer[0].CopyFrom(helper.make_tensor("sc", elem, [], [0.25]))
    model = model.SerializeToString()
    so = onnxpack.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(model, so) as sess:
        assert "AttentionChain" not in [type(st.kernel).__name__ for st in sess.program.root.steps]
        (unfused,) = sess.run(None, feeds)
    products = []
    real = _act.matmul

    def spy(a, b, *args, **kwargs):
        products.append((a.dtype, b.dtype))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(_act, "matmul", spy)
    q = feeds["qr"].transpose(0, 2, 1, 3)
    k = feeds["kr"].transpose(0, 2, 3, 1)
    v = feeds["vr"].transpose(0, 2, 1, 3)
    kernel = AttentionChain(helper.make_node("MatMul", ["q", "k"], ["y"]), KernelContext(17, {"": 17}), scale=scale)
    (direct,) = kernel.run(q, k, v, feeds["mask"])
    assert products == [(np.float32, np.float32)] * 2, products  # both products widened, by BLAS
    assert direct.dtype == unfused.dtype == np_dtype and direct.shape == unfused.shape == (2, 3, 70, 16)
    np.testing.assert_array_equal(direct.view(np.uint16), unfused.view(np.uint16))
    if dtype == "float16":
        with onnxpack.InferenceSession(model) as sess:
            assert "AttentionChain" in [type(st.kernel).__name__ for st in sess.program.root.steps]
            (got,) = sess.run(None, feeds)
        np.testing.assert_array_equal(got.view(np.uint16), unfused.view(np.uint16))
        (want,) = run_ort_model(onnx.load_from_string(model), feeds)
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), **F16)


# ------------------------------------------------------------------------------------------------
# A BERT-like graph as onnxruntime's optimizer writes it: packed blobs saved and mapped back
# ------------------------------------------------------------------------------------------------
def bert_like_model(dtype, vocab=40, hidden=16, heads=2, ff=32, seq=6):
    rng = np.random.default_rng(12)
    w = {
        "word": rand(rng, (vocab, hidden), dtype), "pos": rand(rng, (seq, hidden), dtype),
        "seg": rand(rng, (2, hidden), dtype), "g0": rand(rng, (hidden,), dtype), "b0": rand(rng, (hidden,), dtype),
        "qkv_w": rand(rng, (hidden, 3 * hidden), dtype, 0.3), "qkv_b": rand(rng, (3 * hidden,), dtype, 0.1),
        "wo_t": rand(rng, (hidden, hidden), dtype, 0.3), "bo": rand(rng, (hidden,), dtype, 0.1),
        "g1": rand(rng, (hidden,), dtype), "b1": rand(rng, (hidden,), dtype),
        "w1": rand(rng, (hidden, ff), dtype, 0.3), "bf1": rand(rng, (ff,), dtype, 0.1),
        "w2": rand(rng, (ff, hidden), dtype, 0.3), "bf2": rand(rng, (hidden,), dtype, 0.1),
        "g2": rand(rng, (hidden,), dtype), "b2": rand(rng, (hidden,), dtype),
    }
    n = helper.make_node
    nodes = [
        n("EmbedLayerNormalization", ["ids", "segs", "word", "pos", "seg", "g0", "b0", "mask"], ["emb", "mask_index"],
          domain=MS, epsilon=1e-5),
        n("Attention", ["emb", "qkv_w", "qkv_b", "mask_index"], ["att"], domain=MS, num_heads=heads),
        n("FusedMatMul", ["att", "wo_t"], ["proj"], domain=MS, transB=1, alpha=1.0),
        n("SkipLayerNormalization", ["proj", "emb", "g1", "b1", "bo"], ["ln1"], domain=MS, epsilon=1e-5),
        n("MatMul", ["ln1", "w1"], ["f1"]),
        n("BiasGelu", ["f1", "bf1"], ["act"], domain=MS),
        n("MatMul", ["act", "w2"], ["f2"]),
        n("SkipLayerNormalization", ["f2", "ln1", "g2", "b2", "bf2"], ["y"], domain=MS, epsilon=1e-5),
    ]
    i32 = TensorProto.INT32
    graph = helper.make_graph(
        nodes, "bert_like",
        [helper.make_tensor_value_info(k, i32, [2, seq]) for k in ("ids", "segs", "mask")],
        [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [2, seq, hidden])],
        [numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=9)
    feeds = {"ids": rng.integers(0, vocab, (2, seq)).astype(np.int32),
             "segs": rng.integers(0, 2, (2, seq)).astype(np.int32),
             "mask": np.array([[1] * seq, [1] * (seq - 2) + [0, 0]], np.int32)}
    return model, feeds


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_bert_like_graph_saved_with_packed_blobs(dtype, tmp_path):
    """Created once (packs), saved with its packed blobs, loaded again (maps every blob, packs
    nothing); each run matches onnxruntime, and so does a session with prepacking disabled."""
    model, feeds = bert_like_model(dtype)
    src = tmp_path / "bert.onnx"
    onnx.save(model, str(src))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (want,) = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    t = tol(dtype)
    out = tmp_path / "bert.opt.onnx"
    o = onnxpack.SessionOptions()
    o.optimized_model_filepath = str(out)
    o.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    o.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "0")
    with onnxpack.InferenceSession(str(src), o) as first:
        assert not first.get_fallback_nodes()
        packed = first.get_prepack_stats()["weights_packed"]
        # Attention weight + bias, FusedMatMul B, 2 MatMul B; float32 also the 5 embedding tables
        assert packed == (10 if dtype == np.float32 else 5)
        np.testing.assert_allclose(first.run(None, feeds)[0].astype(np.float64), want.astype(np.float64), **t)
    with onnxpack.InferenceSession(str(out)) as again:
        st = again.get_prepack_stats()
        assert st["weights_packed"] == 0 and st["blobs_from_model"] == packed, st
        np.testing.assert_allclose(again.run(None, feeds)[0].astype(np.float64), want.astype(np.float64), **t)
    o2 = onnxpack.SessionOptions()
    o2.add_session_config_entry("session.disable_prepacking", "1")
    with onnxpack.InferenceSession(str(src), o2) as plain:
        np.testing.assert_allclose(plain.run(None, feeds)[0].astype(np.float64), want.astype(np.float64), **t)


# -- the JIT attention (attend_heads) against the numpy products it replaces ---------------------
JIT_ATTEND = {  # (B, N, Nkv, S, T, H, bias shape or None)
    "bert": (1, 12, 12, 128, 128, 64, (1, 1, 1, 128)),
    "batch-key-mask": (2, 4, 4, 9, 9, 16, (2, 1, 1, 9)),
    "grouped": (2, 6, 2, 7, 11, 8, (1, 6, 7, 11)),
    "per-row-bias": (1, 3, 3, 5, 70, 130, (1, 1, 5, 70)),  # H > the GEMM's K block; T past a panel
    "long-keys": (1, 2, 1, 3, 300, 5, (300,)),  # T past the P @ V K block; a 1-D bias
    "no-bias": (1, 2, 2, 65, 65, 64, None),
    "2d-bias": (1, 2, 2, 4, 6, 3, (4, 6)),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(JIT_ATTEND), ids=list(JIT_ATTEND))
def test_jit_attention_equals_numpy_products(case, threads, monkeypatch):
    """``attend_heads`` (heads split over two threads or not) against ``_attend_products`` (numpy's
    batched BLAS and softmax): within float32 rounding of the output's scale, with masked keys
    (-10000 and -inf), a row whose every key is masked (zeros, as numpy's path gives), a NaN
    query (its rows NaN), and the q / k / v views the kernels pass (strided, not copies)."""
    from onnxpack.session.kernels import _act
    from onnxpack.session.kernels import attention as A

    if _act.load_jit("_attn_jit", "attention") is None:
        pytest.skip("numba not installed")
    b, n, nkv, s, t, h, bshape = JIT_ATTEND[case]
    rng = np.random.default_rng(len(case))
    qkv = rng.standard_normal((b, s, n * h + 2)).astype(np.float32)
    q = qkv[..., 1:1 + n * h].reshape(b, s, n, h).transpose(0, 2, 1, 3)  # a strided view
    k = rng.standard_normal((b, nkv, t, h)).astype(np.float32)
    v = rng.standard_normal((b, nkv, t, h)).astype(np.float32)
    q[0, 0, 0, 0] = np.nan
    bias = None
    if bshape is not None:
        bias = np.where(rng.random(bshape) < 0.25, np.float32(-10000), np.float32(0)).astype(np.float32)
        flat = bias.reshape(-1, bshape[-1])
        flat[-1, 0] = -np.inf
        if flat.shape[0] > 1 or len(bshape) == 1:
            flat[0, :] = -np.inf  # every key of these rows masked
    monkeypatch.setattr(A, "_SPLIT_ATTENTION_MACS", 0)
    monkeypatch.setattr(A, "_JIT_MIN_KEYS", 1)  # (small geometries too: the kernel is what is tested)
    monkeypatch.setattr(_act, "threads", lambda: threads)
    want, _ = A._attend_products(q, k, v, 0.3, bias, None, 0.0, None, None, False)

    def numpy_path(*_args):
        raise AssertionError("the JIT attention did not run")

    monkeypatch.setattr(A, "_attend_products", numpy_path)
    got, raw = A._attend(q, k, v, 0.3, bias)
    assert raw is None and got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got).any()  # the NaN query's row
    scale = float(np.nanmax(np.abs(want)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale)
    if threads == 2:
        tuner = _act.tuner(("attend_heads", q.shape, k.shape))
        assert tuner.threads == 2


def test_jit_attention_takes_only_its_cases(monkeypatch):
    """A bias that does not broadcast, a mask of excluded keys, a softcap, a float16 query or
    fewer keys than a panel go to numpy's path (which raises its own error for the bias)."""
    from onnxpack.session.kernels import attention as A

    calls = []
    monkeypatch.setattr(A, "_attend_products", lambda *a: calls.append(a) or (np.zeros(1), None))
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    k = v = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    A._attend(q, k, v, 1.0, np.zeros((3, 1, 1, 5), np.float32))
    A._attend(q, k, v, 1.0, exclude=np.zeros((1, 1, 4, 5), bool))
    A._attend(q, k, v, 1.0, softcap=5.0)
    A._attend(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), 1.0)
    A._attend(q, k, v, 1.0)  # 5 keys: fewer than a panel of 64 (numpy's products are faster)
    assert len(calls) == 5
