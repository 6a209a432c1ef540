"""com.microsoft LinearAttention (and ONNX LinearAttention-27), LinearAttentionGate, GatedRMSNorm,
GatedAdd, MRotaryEmbedding, BranchwiseRMSNorm: the ops onnxruntime-genai's builder writes for
Qwen3.5 (dense and MoE).

Oracle: onnxruntime 1.32's CPU kernels on single-node models with random inputs.  Where
onnxruntime refuses what the spec defines, the tests first show the refusal, then check the
kernel against onnxruntime otherwise: LinearAttention's ``state_window`` against onnxruntime's
plain (W = 0) runs of the sequence's prefixes; MRotaryEmbedding's 3-D input without ``num_heads``
against the same node with it; GatedAdd's projected mode (CUDA-only bfloat16 in onnxruntime)
against the spec's formula written out here in float64 with its rounding points.

Tolerances: float32 rtol 1e-4 / atol 1e-5 — both sides compute in float32 but sum in another
order (onnxruntime loops or calls MLAS, numpy's matmul/einsum pairs differently), and the
LinearAttention recurrence carries that error through a few tokens (keys L2-normalized, decays
in (0, 1], so it does not grow).  float16 rtol 2e-3 / atol 2e-3 — both compute in float32 and
round once to float16 (onnxruntime casts to float32 around its float-only LinearAttention), so
they differ by at most one float16 step (2^-10 relative) where the float32 values straddle a
rounding boundary.  Elementwise float32 ops (gates, norms, GatedAdd) use rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from onnx import helper

from contrib_util import MS, assert_match, check_all_paths, run_onnxpack, run_ort_model, single_node_model

import onnxpack
from onnxpack.errors import OnnxpackError
from onnxpack.session.kernels.linear_attention import mrope_streams

F32 = dict(rtol=1e-4, atol=1e-5)
F16 = dict(rtol=2e-3, atol=2e-3)
EW = dict(rtol=1e-5, atol=1e-6)


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))  # deterministic (str hashes are salted)


def check(node, feeds, tol, consts=None, opset=21):
    """onnxruntime vs onnxpack (one session; all inputs fed); returns onnxruntime's outputs."""
    model = single_node_model(node, feeds, consts or {}, opset)
    want = run_ort_model(model, feeds)
    got, _ = run_onnxpack(model, feeds)
    assert_match(got, want, tol)
    return want


def run_pack(node, feeds, opset=21):
    model = single_node_model(node, feeds, {}, opset)
    return onnxpack.InferenceSession(model.SerializeToString()).run(None, feeds)


def ort_refuses(node, feeds, match: str, opset=21):
    model = single_node_model(node, feeds, {}, opset)
    with pytest.raises(Exception, match=match):
        run_ort_model(model, feeds)


# -- LinearAttention -------------------------------------------------------------------------------

def la_inputs(b, t, hq, hkv, nk, dk, dv, *, past, per_key=False, beta_one=False, dtype=np.float32, seed=0,
              window=0):
    rng = _rng("la", b, t, hq, hkv, nk, dk, dv, past, per_key, beta_one, seed, window)
    k = rng.standard_normal((b, t, nk, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the delta rules want L2-normalized keys
    feeds = dict(
        q=rng.standard_normal((b, t, hq * dk)),
        k=k.reshape(b, t, nk * dk),
        v=rng.standard_normal((b, t, hkv * dv)),
        g=-rng.uniform(0.01, 1.0, (b, t, hkv * dk if per_key else hkv)),
        beta=rng.uniform(0.0, 1.0, (b, t, 1 if beta_one else hkv)),
    )
    if past:
        shape = (b, hkv, dk, dv) if not window else (window, b, hkv, dk, dv)
        feeds["p"] = 0.5 * rng.standard_normal(shape)
    return {n: v.astype(dtype) for n, v in feeds.items()}


def la_node(hq, hkv, rule="gated_delta", *, past=True, decay=True, beta=True, domain=MS, **attrs):
    inputs = ["q", "k", "v", "p" if past else "", "g" if decay else "", "beta" if beta else ""]
    while inputs[-1] == "":
        inputs.pop()
    return helper.make_node("LinearAttention", inputs, ["o", "s"], domain=domain, q_num_heads=hq,
                            kv_num_heads=hkv, update_rule=rule, **attrs)


RULES = ("linear", "gated", "delta", "gated_delta")
# (H_q, H_kv, key heads): multi-head, GQA, MQA, inverse GQA (Qwen3.5's shape), fewer key heads
HEADS = [(2, 2, 2), (4, 2, 2), (4, 1, 1), (2, 4, 4), (2, 4, 2)]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("heads", HEADS)
def test_linear_attention_rules_heads(rule, heads):
    hq, hkv, nk = heads
    for b, t, past in ((2, 5, True), (1, 1, True), (2, 3, False)):
        feeds = la_inputs(b, t, hq, hkv, nk, 8, 6, past=past, seed=len(rule))
        node = la_node(hq, hkv, rule, past=past)
        feeds = {n: v for n, v in feeds.items() if n in node.input}
        want = check(node, feeds, F32)
        assert want[0].shape == (b, t, max(hq, hkv) * 6) and want[1].shape == (b, hkv, 8, 6)


@pytest.mark.parametrize("rule", RULES)
def test_linear_attention_decay_beta_layouts_and_scale(rule):
    for per_key, beta_one, scale in ((True, False, 0.0), (False, True, 0.3), (True, True, 1.0)):
        feeds = la_inputs(2, 4, 4, 2, 2, 4, 8, past=True, per_key=per_key, beta_one=beta_one)
        check(la_node(4, 2, rule, scale=scale, chunk_size=2), feeds, F32)  # chunk_size: a hint only


def test_linear_attention_optional_gates_absent():
    # the rules without decay / beta take neither; given anyway, they are ignored
    for rule, decay, beta in (("linear", False, False), ("gated", True, False), ("delta", False, True)):
        node = la_node(2, 2, rule, past=False, decay=decay, beta=beta)
        feeds = la_inputs(2, 3, 2, 2, 2, 8, 8, past=False)
        feeds = {n: v for n, v in feeds.items() if n in node.input}
        check(node, feeds, F32)
    feeds = la_inputs(2, 3, 2, 2, 2, 8, 8, past=True)
    check(la_node(2, 2, "linear"), feeds, F32)


def test_linear_attention_float16_and_decode_chain():
    # float16 in and out (past state float16, or float32 kept float32); then prefill + 3 decode
    # steps fed back through the state equal one prefill over the whole sequence
    feeds = la_inputs(2, 4, 2, 4, 4, 8, 8, past=True, dtype=np.float16)
    check(la_node(2, 4), feeds, F16)
    check(la_node(2, 4, past=False), {n: v for n, v in feeds.items() if n != "p"}, F16)
    mixed = dict(feeds, p=feeds["p"].astype(np.float32))
    want = check(la_node(2, 4), mixed, F16)
    assert want[1].dtype == np.float32

    full = la_inputs(2, 7, 2, 4, 4, 16, 16, past=False, seed=3)
    whole = run_pack(la_node(2, 4, past=False), full)
    state = np.zeros((2, 4, 16, 16), np.float32)
    outs = []
    for lo, hi in ((0, 4), (4, 5), (5, 6), (6, 7)):
        step = {n: v[:, lo:hi] for n, v in full.items()}
        step["p"] = state
        check(la_node(2, 4), step, F32)
        out, state = run_pack(la_node(2, 4), step)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), whole[0], **F32)
    np.testing.assert_allclose(state, whole[1], **F32)


def test_linear_attention_empty_sequence():
    feeds = la_inputs(2, 0, 2, 2, 2, 4, 4, past=True)
    out, state = run_pack(la_node(2, 2), feeds)
    assert out.shape == (2, 0, 8)
    np.testing.assert_array_equal(state, feeds["p"])


@pytest.mark.parametrize("rule", RULES)
def test_linear_attention_empty_batch_matches_onnxruntime(rule):
    """Batch 0 (found by fuzzing: a reshape of the empty decay failed in numpy): empty outputs."""
    feeds = la_inputs(0, 3, 2, 2, 2, 4, 4, past=True, per_key=rule == "gated")
    node = la_node(2, 2, rule)
    want = check(node, {n: v for n, v in feeds.items() if n in node.input}, F32)
    assert want[0].shape == (0, 3, 8) and want[1].shape == (0, 2, 4, 4)


@pytest.mark.parametrize("window", [1, 3])
def test_linear_attention_state_window(window):
    """onnxruntime's CPU kernel refuses state_window > 0; slot j of the present must be
    onnxruntime's state after the prefix of T - W + j + 1 tokens (zeros before the first)."""
    for rule in ("gated_delta", "linear"):
        for t, past in ((5, True), (2, False), (1, True)):
            feeds = la_inputs(2, t, 2, 4, 2, 8, 4, past=past, window=window, seed=7)
            node = la_node(2, 4, rule, past=past, state_window=window)
            ort_refuses(node, feeds, "state_window")
            out, present = run_pack(node, feeds)
            assert present.shape == (window, 2, 4, 8, 4)
            plain = dict(feeds)
            if past:
                plain["p"] = feeds["p"][-1]
            want = run_ort_model(single_node_model(la_node(2, 4, rule, past=past), plain, {}), plain)
            assert_match([out], want[:1], F32)
            for j in range(window):
                n = t - window + j + 1
                if n <= 0:
                    np.testing.assert_array_equal(present[j], 0)
                    continue
                prefix = {k: (v[:, :n] if k != "p" else v) for k, v in plain.items()}
                ref = run_ort_model(single_node_model(la_node(2, 4, rule, past=past), prefix, {}), prefix)[1]
                np.testing.assert_allclose(present[j], ref, **F32, err_msg=f"slot {j}")


def test_linear_attention_onnx_domain_27():
    for heads, rule in (((4, 2, 2), "gated_delta"), ((2, 2, 2), "delta"), ((4, 1, 1), "gated"), ((2, 2, 2), "linear")):
        hq, hkv, nk = heads
        feeds = la_inputs(2, 3, hq, hkv, nk, 8, 4, past=True, per_key=rule == "gated")
        node = la_node(hq, hkv, rule, domain="", decay="gated" in rule, beta="delta" in rule)
        check(node, {n: v for n, v in feeds.items() if n in node.input}, F32, opset=27)
    # the ONNX op wants decay / beta exactly when the rule uses them, and a key of kv_num_heads heads
    feeds = la_inputs(2, 3, 2, 2, 2, 8, 4, past=True)
    for rule, message in (("delta", "forbids the decay"), ("gated", "forbids the beta")):
        ort_refuses(la_node(2, 2, rule, domain=""), feeds, "forbids", opset=27)
        with pytest.raises(OnnxpackError, match=message):
            run_pack(la_node(2, 2, rule, domain=""), feeds, opset=27)
    feeds = la_inputs(2, 3, 4, 2, 1, 8, 4, past=True)
    ort_refuses(la_node(4, 2, domain=""), feeds, "mismatch", opset=27)
    with pytest.raises(OnnxpackError, match="key must be"):
        run_pack(la_node(4, 2, domain=""), feeds, opset=27)
    # inverse GQA is a com.microsoft extension: both refuse it at opset 27
    feeds = la_inputs(1, 2, 2, 4, 4, 4, 4, past=False)
    node = la_node(2, 4, past=False, domain="")
    ort_refuses(node, feeds, "multiple of kv_num_heads", opset=27)
    with pytest.raises(OnnxpackError, match="multiple of kv_num_heads"):
        run_pack(node, feeds, opset=27)


@pytest.mark.parametrize("change,message", [
    (dict(drop="g"), "decay is required"),
    (dict(drop="beta"), "beta is required"),
    (dict(g=(2, 3, 3)), "decay must be"),
    (dict(beta=(2, 3, 2)), "beta must be"),
    (dict(p=(2, 4, 8, 5)), "past_state must be"),
    (dict(k=(2, 3, 20)), "key hidden size"),
    (dict(k=(2, 3, 24)), "kv_num_heads 4 is not a multiple"),
    (dict(v=(2, 2, 24)), "batch and sequence"),
    (dict(q=(2, 3)), "must be 3-D"),
])
def test_linear_attention_bad_inputs(change, message):
    feeds = la_inputs(2, 3, 2, 4, 4, 8, 6, past=True)
    node = la_node(2, 4)
    if "drop" in change:
        node = la_node(2, 4, decay=change["drop"] != "g", beta=change["drop"] != "beta")
        feeds = {n: v for n, v in feeds.items() if n in node.input}
    else:
        for name, shape in change.items():
            feeds[name] = np.zeros(shape, np.float32)
    with pytest.raises(OnnxpackError, match=message):
        run_pack(node, feeds)


@pytest.mark.parametrize("attrs,message", [
    (dict(q_num_heads=3, kv_num_heads=2), "multiple of the other"),
    (dict(q_num_heads=2, kv_num_heads=2, update_rule="mamba"), "update_rule"),
    (dict(q_num_heads=2, kv_num_heads=2, state_window=9), "state_window"),
    (dict(q_num_heads=2), "kv_num_heads"),
])
def test_linear_attention_bad_attributes(attrs, message):
    node = helper.make_node("LinearAttention", ["q", "k", "v"], ["o", "s"], domain=MS, **attrs)
    feeds = {n: np.zeros((1, 1, 8), np.float32) for n in ("q", "k", "v")}
    with pytest.raises(OnnxpackError, match=message):
        run_pack(node, feeds)


# -- LinearAttentionGate ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(np.float32, EW), (np.float16, F16)])
def test_linear_attention_gate(dtype, tol):
    rng = _rng("lag")
    for shape, with_b, want_beta in (((2, 5, 4), True, True), ((1, 1, 4), True, False), ((3, 4), False, False),
                                     ((2, 2, 3, 4), True, True)):
        h = shape[-1]
        a = (rng.standard_normal(shape) * 8).astype(dtype)  # both softplus branches, far tails included
        consts = dict(dt=rng.standard_normal(h).astype(np.float32),
                      ds=-np.exp(rng.standard_normal(h)).astype(np.float32))
        feeds = dict(a=a)
        if with_b:
            feeds["b"] = (rng.standard_normal(shape) * 6).astype(dtype)
        node = helper.make_node("LinearAttentionGate", ["a", "dt", "ds"] + (["b"] if with_b else []),
                                ["decay", "beta"] if want_beta else ["decay"], domain=MS)
        check_all_paths(node, feeds, consts, tol)


def test_linear_attention_gate_errors():
    a = np.zeros((1, 2, 4), np.float32)
    node = helper.make_node("LinearAttentionGate", ["a", "dt", "ds"], ["decay", "beta"], domain=MS)
    feeds = dict(a=a, dt=np.zeros(4, np.float32), ds=np.zeros(4, np.float32))
    with pytest.raises(OnnxpackError, match="input b is required"):
        run_pack(node, feeds)
    node = helper.make_node("LinearAttentionGate", ["a", "dt", "ds"], ["decay"], domain=MS)
    with pytest.raises(OnnxpackError, match="must have 4 elements"):
        run_pack(node, dict(feeds, dt=np.zeros(3, np.float32)))


# -- GatedRMSNorm ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(np.float32, EW), (np.float16, F16)])
@pytest.mark.parametrize("activation", [None, "silu", "swish", "sigmoid"])
def test_gated_rms_norm(dtype, tol, activation):
    rng = _rng("grn", activation)
    attrs = {} if activation is None else dict(activation=activation)
    for shape, c, eps in (((2, 3, 32), 8, 1e-6), ((1, 1, 16), 16, None), ((5, 12), 4, 0.1)):
        a = dict(attrs) if eps is None else dict(attrs, epsilon=eps)
        node = helper.make_node("GatedRMSNorm", ["x", "s", "z"], ["y"], domain=MS, **a)
        feeds = dict(x=rng.standard_normal(shape).astype(dtype), z=(3 * rng.standard_normal(shape)).astype(dtype))
        check_all_paths(node, feeds, dict(s=rng.standard_normal(c).astype(dtype)), tol)


def test_gated_rms_norm_errors():
    node = helper.make_node("GatedRMSNorm", ["x", "s", "z"], ["y"], domain=MS)
    x = np.ones((2, 10), np.float32)
    with pytest.raises(OnnxpackError, match="multiple of scale's length 4"):
        run_pack(node, dict(x=x, s=np.ones(4, np.float32), z=x))
    with pytest.raises(OnnxpackError, match="gate must have X's shape"):
        run_pack(node, dict(x=x, s=np.ones(5, np.float32), z=x[:1]))
    bad = helper.make_node("GatedRMSNorm", ["x", "s", "z"], ["y"], domain=MS, activation="relu")
    with pytest.raises(OnnxpackError, match="activation"):
        run_pack(bad, dict(x=x, s=np.ones(5, np.float32), z=x))


# -- GatedAdd --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(np.float32, EW), (np.float16, dict(rtol=0, atol=0))])
def test_gated_add(dtype, tol):
    # float16: the product rounded to float16 before the add, exactly as onnxruntime
    rng = _rng("ga")
    node = helper.make_node("GatedAdd", ["x", "y", "g"], ["o"], domain=MS)
    for shape in ((2, 5, 16), (1, 1, 8), (3, 7)):
        feeds = dict(x=rng.standard_normal(shape).astype(dtype), y=rng.standard_normal(shape).astype(dtype),
                     g=rng.uniform(0, 1, shape[:-1] + (1,)).astype(dtype))
        check(node, feeds, tol)


def _gated_add_projected_reference(x, y, gate, w, dtype):
    def rnd(v):
        return np.asarray(v, np.float32).astype(dtype).astype(np.float64)

    p = rnd(gate.astype(np.float64) @ w.astype(np.float64))
    s = rnd(1 / (1 + np.exp(-p)))
    return rnd(x.astype(np.float64) + rnd(y.astype(np.float64) * s)).astype(dtype)


def test_gated_add_projected():
    """onnxruntime's CPU kernel refuses gate_weight (CUDA bfloat16 only): the spec's formula."""
    import ml_dtypes

    rng = _rng("gap")
    node = helper.make_node("GatedAdd", ["x", "y", "g", "w"], ["o"], domain=MS)
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        feeds = dict(x=rng.standard_normal((2, 3, 8)), y=rng.standard_normal((2, 3, 8)),
                     g=rng.standard_normal((2, 3, 5)), w=rng.standard_normal((5, 1)) / 2)
        feeds = {n: v.astype(dtype) for n, v in feeds.items()}
        if dtype == np.float32:
            ort_refuses(node, feeds, "BFloat16 only")
        got = run_pack(node, feeds)[0]
        want = _gated_add_projected_reference(feeds["x"], feeds["y"], feeds["g"], feeds["w"], dtype)
        assert got.dtype == want.dtype
        tol = 1e-6 if dtype == np.float32 else 1e-2  # the float32 dot may round the other way
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


def test_gated_add_errors():
    node = helper.make_node("GatedAdd", ["x", "y", "g"], ["o"], domain=MS)
    x = np.ones((2, 4), np.float32)
    with pytest.raises(OnnxpackError, match="gate's last dimension must be 1"):
        run_pack(node, dict(x=x, y=x, g=x))
    with pytest.raises(OnnxpackError, match="gate must be"):
        run_pack(node, dict(x=x, y=x, g=np.ones((1, 1), np.float32)))
    with pytest.raises(OnnxpackError, match="Y must have X's shape"):
        run_pack(node, dict(x=x, y=x[:1], g=x[:, :1]))


# -- MRotaryEmbedding ------------------------------------------------------------------------------

def test_mrope_streams():
    assert mrope_streams((3, 3, 2), 1, 8).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_streams((2, 1, 1), 0, 4).tolist() == [0, 0, 1, 2]
    assert mrope_streams((16, 24, 24), 0, 64).tolist() == [0] * 16 + [1] * 24 + [2] * 24


def mrope_case(rng, b, s, n, head, half, max_pos, dtype, four_d):
    x = rng.standard_normal((b, n, s, head) if four_d else (b, s, n * head)).astype(dtype)
    pos = rng.integers(0, max_pos, (3, b, s)).astype(np.int64)  # distinct T / H / W streams
    ang = rng.uniform(0, 2 * math.pi, (max_pos, half))
    return dict(x=x, p=pos), dict(c=np.cos(ang).astype(dtype), sn=np.sin(ang).astype(dtype))


@pytest.mark.parametrize("dtype,tol", [(np.float32, EW), (np.float16, F16)])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("interleaved", [0, 1])
def test_mrotary_embedding(dtype, tol, layout, interleaved):
    rng = _rng("mrope", layout, interleaved)
    # (B, S, heads, head, rotary dim attr, section, 4-D input, scale)
    for b, s, n, head, rot, section, four_d, scale in (
        (2, 5, 4, 16, 0, (3, 3, 2), False, None),   # whole head rotated
        (1, 1, 4, 32, 16, (3, 3, 2), False, None),  # Qwen3.5: partial rotary, decode step
        (2, 3, 2, 16, 0, (4, 2, 2), True, 0.5),     # 4-D input, scale
        (2, 4, 3, 12, 8, (2, 1, 1), True, None),
    ):
        half = (rot or head) // 2
        feeds, consts = mrope_case(rng, b, s, n, head, half, 11, dtype, four_d)
        attrs = dict(mrope_section=list(section), mrope_layout=layout, interleaved=interleaved)
        if not four_d or rot:
            attrs["num_heads"] = n
        if rot:
            attrs["rotary_embedding_dim"] = rot
        if scale is not None:
            attrs["scale"] = scale
            attrs["is_packed_batching"] = 1  # no effect on a padded batch
        node = helper.make_node("MRotaryEmbedding", ["x", "p", "c", "sn"], ["y"], domain=MS, **attrs)
        check_all_paths(node, feeds, consts, tol)


def test_mrotary_embedding_without_num_heads():
    """onnxruntime refuses a 3-D input without num_heads; the head size then comes from the cache."""
    rng = _rng("mrope-nh")
    feeds, consts = mrope_case(rng, 2, 3, 4, 16, 8, 9, np.float32, False)
    node = helper.make_node("MRotaryEmbedding", ["x", "p", "c", "sn"], ["y"], domain=MS, mrope_section=[4, 2, 2],
                            mrope_layout=1)
    all_feeds = {**feeds, **consts}
    ort_refuses(node, all_feeds, "num_heads")
    with_heads = helper.make_node("MRotaryEmbedding", ["x", "p", "c", "sn"], ["y"], domain=MS,
                                  mrope_section=[4, 2, 2], mrope_layout=1, num_heads=4)
    want = run_ort_model(single_node_model(with_heads, all_feeds, {}), all_feeds)
    assert_match(run_pack(node, all_feeds), want, EW)


def test_mrotary_embedding_errors():
    rng = _rng("mrope-err")
    feeds, consts = mrope_case(rng, 1, 2, 2, 8, 4, 5, np.float32, False)
    all_feeds = {**feeds, **consts}

    def node(**attrs):
        return helper.make_node("MRotaryEmbedding", ["x", "p", "c", "sn"], ["y"], domain=MS,
                                **{"mrope_section": [2, 1, 1], "num_heads": 2, **attrs})
    with pytest.raises(OnnxpackError, match="must sum to"):
        run_pack(node(mrope_section=[2, 2, 1]), all_feeds)
    with pytest.raises(OnnxpackError, match=r"position ids must be in \[0, 5\)"):
        run_pack(node(), dict(all_feeds, p=all_feeds["p"] + 5))
    with pytest.raises(OnnxpackError, match="position_ids must be integer"):
        run_pack(node(), dict(all_feeds, p=all_feeds["p"][:2]))
    with pytest.raises(OnnxpackError, match="mrope_layout"):
        run_pack(node(mrope_layout=2), all_feeds)
    with pytest.raises(OnnxpackError, match="does not fit head size"):
        run_pack(node(num_heads=1), all_feeds)


# -- BranchwiseRMSNorm -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(np.float32, EW), (np.float16, F16)])
def test_branchwise_rms_norm(dtype, tol):
    rng = _rng("brn")
    c, h = 3, 8
    for flat in (False, True):
        shape = (2, 4, c * h) if flat else (2, 4, c, h)
        attrs = dict(num_branches=c) if flat else {}
        for scale_shape, scale_dtype in ((None, None), ((h,), dtype), ((c, h), dtype), ((c * h,), np.float32),
                                         ((h,), np.float16)):
            node = helper.make_node("BranchwiseRMSNorm", ["x"] + (["s"] if scale_shape else []), ["y"], domain=MS,
                                    epsilon=1e-3, **attrs)
            feeds = dict(x=rng.standard_normal(shape).astype(dtype))
            consts = {} if scale_shape is None else dict(s=rng.standard_normal(scale_shape).astype(scale_dtype))
            check_all_paths(node, feeds, consts, tol)


def test_branchwise_rms_norm_errors():
    node = helper.make_node("BranchwiseRMSNorm", ["x", "s"], ["y"], domain=MS, num_branches=3)
    x = np.ones((2, 12), np.float32)
    with pytest.raises(OnnxpackError, match="scale must be"):
        run_pack(node, dict(x=x, s=np.ones(5, np.float32)))
    with pytest.raises(OnnxpackError, match="multiple of num_branches 3"):
        run_pack(node, dict(x=np.ones((2, 10), np.float32), s=np.ones(4, np.float32)))


@pytest.mark.parametrize("rule", RULES)
def test_linear_attention_numpy_loop_equals_the_jit(rule, monkeypatch):
    """Both paths of the recurrence (the numba kernel where numba is installed, which the tests
    above check against onnxruntime, and the numpy loop) agree, window slots included."""
    from onnxpack.session.kernels import linear_attention

    if linear_attention._jit() is None:
        pytest.skip("numba is not installed: only the numpy loop runs")
    for heads, window, per_key in (((4, 2, 2), 0, False), ((2, 4, 2), 3, True), ((2, 2, 1), 2, False)):
        hq, hkv, nk = heads
        feeds = la_inputs(2, 5, hq, hkv, nk, 8, 6, past=True, per_key=per_key, seed=7, window=window)
        node = la_node(hq, hkv, rule, state_window=window) if window else la_node(hq, hkv, rule)
        feeds = {n: v for n, v in feeds.items() if n in node.input}
        model = single_node_model(node, feeds, {}, 21)
        jit_out, _ = run_onnxpack(model, feeds)
        monkeypatch.setattr(linear_attention, "_jit", lambda: None)
        numpy_out, _ = run_onnxpack(model, feeds)
        monkeypatch.undo()
        assert_match(jit_out, numpy_out, F32, "numba vs numpy")
