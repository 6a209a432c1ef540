"""com.microsoft MoE and QMoE: mixture-of-experts layers (onnxruntime-genai's builder writes them for
gpt-oss, Phi-3.5-MoE, LFM2-MoE, Qwen3.5-MoE).

Oracles: onnxruntime 1.32's CPU kernels wherever they run the case; elsewhere — what onnxruntime's
CPU provider refuses but the op's spec defines (fc3 gating, swiglu_fusion 0 and 2, mixed
widths) and where it departs from the spec (the sparse mixer it ignores, the legacy (E, in, out)
layout it multiplies as (E, out, in)) — :func:`reference`: a per-token loop over the spec's
formulas on dequantized float64 weights, written here without the kernel's code.

Tolerances: float32 rtol 1e-4 / atol 1e-5 (sums in another order; the kernels run on
dequantized tiles or the JIT GEMV), float16 rtol 1e-2 / atol 1e-2 (onnxruntime multiplies float16
experts in float16, onnxpack in float32).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from contrib_util import assert_match, check_all_paths, run_onnxpack, single_node_model

import onnxpack
from onnxpack.errors import OnnxpackError
from onnxpack.session import optimize
from onnxpack.session.kernels.moe import route

F32 = dict(rtol=1e-4, atol=1e-5)
F16 = dict(rtol=1e-2, atol=1e-2)
QMOE_NAMES = ("x", "r", "w1", "s1", "b1", "w2", "s2", "b2", "w3", "s3", "b3", "z1", "z2", "z3", "rw")
MOE_NAMES = ("x", "r", "w1", "b1", "w2", "b2", "w3", "b3")


# -- an independent reference --------------------------------------------------------------------
def _codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    per = 8 // bits
    out = np.zeros((*packed.shape[:-1], packed.shape[-1] * per), np.int64)
    for i in range(per):
        out[..., i::per] = (packed >> (i * bits)) & ((1 << bits) - 1)
    return out[..., :count]


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (..., n) -> uint8 (..., ceil(n * bits / 8)), the low bits first (zero-padded)."""
    per = 8 // bits
    pad = (-q.shape[-1]) % per
    q = np.concatenate([q, np.zeros((*q.shape[:-1], pad), q.dtype)], -1) if pad else q
    q = q.reshape(*q.shape[:-1], -1, per).astype(np.uint8)
    out = np.zeros(q.shape[:-1], np.uint8)
    for i in range(per):
        out |= q[..., i] << (i * bits)
    return out


def dequantize(w, s, z, bits: int, k: int, block: int) -> np.ndarray:
    """(E, N, K) float64 experts from QMoE's codes, scales and packed zero points."""
    q = _codes(w, bits, k).astype(np.float64)
    e, n = q.shape[:2]
    if block:
        nb = -(-k // block)
        zp = np.full((e, n, nb), float(1 << (bits - 1))) if z is None else _codes(z, bits, nb).astype(np.float64)
        scale = np.repeat(s.astype(np.float64), block, axis=-1)[..., :k]
        return (q - np.repeat(zp, block, axis=-1)[..., :k]) * scale
    zp = np.full((e, n), float(1 << (bits - 1))) if z is None else _codes(z, bits, n).astype(np.float64)
    return (q - zp[..., None]) * s.astype(np.float64)[..., None]


def _softmax(v):
    v = np.exp(v - v.max())
    return v / v.sum()


def reference(x, logits, w1, w2, w3=None, b1=None, b2=None, b3=None, *, k, act, fusion=0, alpha=1.0, beta=0.0,
              limit=math.inf, normalize=False, sparse=False, legacy=False, router_weights=None):
    """The layer per the op's spec, token by token in float64 (weights (E, out, in) unless legacy)."""
    x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    lg = logits.astype(np.float64)
    out = np.zeros_like(x2)

    def mm(w, e, a):
        return a @ (w[e] if legacy else w[e].T)

    def gelu_tanh(v):
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))

    def sig(v):
        return 1 / (1 + np.exp(-v))

    for t in range(x2.shape[0]):
        row = lg[t]
        if sparse:
            picks, weights, masked = [], [], row.copy()
            for _ in range(2):
                best = int(np.argmax(masked))
                top = masked[best]
                far = (top - row) / np.maximum(np.abs(row), top) > 0.02
                gates = np.where(far, -np.inf, masked)
                weights.append(_softmax(gates)[best])
                picks.append(best)
                masked[best] = -np.inf
        else:
            p = _softmax(row)
            picks = sorted(range(len(p)), key=lambda i: (-p[i], -i))[:k]
            weights = [p[i] for i in picks]
            if router_weights is not None:
                weights = [float(router_weights[t, i]) for i in picks]
            if normalize:
                weights = [w / sum(weights) for w in weights]
        for e, wt in zip(picks, weights):
            g = mm(w1, e, x2[t]) + (0 if b1 is None else b1[e])
            if act == "swiglu":
                if fusion == 1:
                    gate, lin = g[0::2], g[1::2]
                elif fusion == 2:
                    gate, lin = g[: len(g) // 2], g[len(g) // 2:]
                else:
                    gate, lin = g, mm(w3, e, x2[t]) + (0 if b3 is None else b3[e])
                gate = np.minimum(gate, limit)
                lin = np.clip(lin, -limit, limit)
                hdn = gate * sig(alpha * gate) * (lin + beta)
            else:
                hdn = {"relu": lambda v: np.maximum(v, 0), "gelu": gelu_tanh, "silu": lambda v: v * sig(v),
                       "identity": lambda v: v}[act](g)
                if w3 is not None:
                    hdn = hdn * (mm(w3, e, x2[t]) + (0 if b3 is None else b3[e]))
            out[t] += wt * (mm(w2, e, hdn) + (0 if b2 is None else b2[e]))
    return out.reshape(x.shape).astype(x.dtype)


# -- cases ------------------------------------------------------------------------------------------
def _node(op, names, present, **attrs):
    inputs = [n if n in present else "" for n in names]
    while not inputs[-1]:
        inputs.pop()
    return helper.make_node(op, inputs, ["y"], domain="com.microsoft", **attrs)


def moe_case(rng, act="silu", *, fusion=None, k=2, e=4, h=16, inter=24, rows=5, bias=True, fc3=False,
             dtype=np.float32, legacy=False, x3=False, **attrs):
    f1 = 2 * inter if act == "swiglu" and fusion in (1, 2) else inter
    w1 = (rng.standard_normal((e, f1, h)) * 0.3).astype(dtype)
    w2 = (rng.standard_normal((e, h, inter)) * 0.3).astype(dtype)
    consts = {"w1": np.ascontiguousarray(w1.transpose(0, 2, 1)) if legacy else w1,
              "w2": np.ascontiguousarray(w2.transpose(0, 2, 1)) if legacy else w2}
    if bias:
        consts["b1"] = (rng.standard_normal((e, f1)) * 0.1).astype(dtype)
        consts["b2"] = (rng.standard_normal((e, h)) * 0.1).astype(dtype)
    if fc3:
        w3 = (rng.standard_normal((e, inter, h)) * 0.3).astype(dtype)
        consts["w3"] = np.ascontiguousarray(w3.transpose(0, 2, 1)) if legacy else w3
    if fusion is not None:
        attrs["swiglu_fusion"] = fusion
    feeds = {"x": rng.standard_normal((1, rows, h) if x3 else (rows, h)).astype(dtype),
             "r": rng.standard_normal((rows, e)).astype(dtype)}
    node = _node("MoE", MOE_NAMES, {**feeds, **consts}, k=k, activation_type=act, **attrs)
    return node, feeds, consts


def _reference_of(node, feeds, consts, quant=None):
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    act = attrs["activation_type"].decode()
    w = {n: consts.get(n) for n in ("w1", "w2", "w3")}
    if quant is not None:
        w = {f"w{j}": None if consts.get(f"w{j}") is None else dequantize(
            consts[f"w{j}"], consts[f"s{j}"], consts.get(f"z{j}"), quant["bits"][j - 1], quant["k"][j - 1],
            attrs.get("block_size", 0)) for j in (1, 2, 3)}
    legacy = quant is None and consts["w2"].shape[1] != feeds["x"].shape[-1]
    return reference(feeds["x"], feeds["r"], w["w1"], w["w2"], w["w3"], consts.get("b1"), consts.get("b2"),
                     consts.get("b3"), k=attrs["k"], act=act, fusion=attrs.get("swiglu_fusion", 0),
                     alpha=attrs.get("activation_alpha", 1.0), beta=attrs.get("activation_beta", 0.0),
                     limit=attrs.get("swiglu_limit", math.inf),
                     normalize=bool(attrs.get("normalize_routing_weights", 0)) or (quant is not None and "rw" not in feeds),
                     sparse=bool(attrs.get("use_sparse_mixer", 0)), legacy=legacy, router_weights=feeds.get("rw"))


@pytest.mark.parametrize("act", ["relu", "gelu", "silu", "identity"])
@pytest.mark.parametrize("normalize", [0, 1])
def test_moe_activations_match_onnxruntime(act, normalize):
    rng = np.random.default_rng(1)
    node, feeds, consts = moe_case(rng, act, normalize_routing_weights=normalize)
    want = check_all_paths(node, feeds, consts, F32)
    assert_match([reference(feeds["x"], feeds["r"], consts["w1"], consts["w2"], None, consts["b1"], consts["b2"],
                            k=2, act=act, normalize=bool(normalize))], want, F32, "reference vs onnxruntime")


@pytest.mark.parametrize("case", [
    dict(act="swiglu", fusion=1),
    dict(act="swiglu", fusion=1, activation_alpha=1.702, activation_beta=1.0, swiglu_limit=0.5),
    dict(act="silu", k=1), dict(act="silu", k=4), dict(act="relu", bias=False), dict(act="silu", x3=True),
    dict(act="silu", rows=1), dict(act="silu", rows=0), dict(act="gelu", e=6, k=3, rows=33),
])
def test_moe_variants_match_onnxruntime(case):
    node, feeds, consts = moe_case(np.random.default_rng(2), **case)
    check_all_paths(node, feeds, consts, F32)


def test_moe_float16_matches_onnxruntime():
    node, feeds, consts = moe_case(np.random.default_rng(3), "silu", dtype=np.float16)
    check_all_paths(node, feeds, consts, F16)


def test_moe_equal_probabilities_pick_the_higher_index_as_onnxruntime():
    rng = np.random.default_rng(4)
    node, feeds, consts = moe_case(rng, "relu", e=5, k=2, normalize_routing_weights=1)
    feeds["r"][:] = 0.0
    feeds["r"][1:, :2] = 1.0  # rows 1..: experts 0 and 1 tie above the rest
    check_all_paths(node, feeds, consts, F32)


@pytest.mark.parametrize("case", [
    dict(act="silu", fc3=True),  # onnxruntime's CPU kernel: "FC3 is not implemented"
    dict(act="swiglu", fusion=0, fc3=True, swiglu_limit=1.0),  # its CPU kernel supports fusion 1 only
    dict(act="swiglu", fusion=2, activation_alpha=1.702, activation_beta=1.0),
    dict(act="silu", legacy=True),  # (E, in, out): onnxruntime's CPU kernel multiplies it as (E, out, in)
    dict(act="silu", e=8, use_sparse_mixer=1),  # ignored by onnxruntime's CPU kernel
])
def test_moe_beyond_onnxruntime_cpu_matches_the_spec(case):
    node, feeds, consts = moe_case(np.random.default_rng(5), **case)
    want = [_reference_of(node, feeds, consts)]
    check_all_paths(node, feeds, consts, F32, want=want)


def test_sparse_mixer_routes_as_phi_moe():
    logits = np.array([[3.0, 2.99, -1.0, 0.5], [0.0, -5.0, 4.0, 3.95]], np.float32)
    experts, weights = route(logits, 2, False, True)
    assert experts.tolist() == [[0, 1], [2, 3]]
    # top-1: the softmax over the logits within 2% (relative) of the best; top-2 likewise without it
    np.testing.assert_allclose(weights[0], [_softmax(np.array([3.0, 2.99]))[0], 1.0], rtol=1e-6)
    np.testing.assert_allclose(weights[1], [_softmax(np.array([4.0, 3.95]))[0], 1.0], rtol=1e-6)


# -- QMoE -----------------------------------------------------------------------------------------------
def qmoe_case(rng, act="swiglu", *, fusion=1, k=2, e=4, h=64, inter=32, rows=5, bits=4, block=32, zp=False, bias=True,
              fc3=False, dtype=np.float32, sdtype=np.float32, rw=False, proj_bits=None, **attrs):
    f1 = 2 * inter if act == "swiglu" and fusion in (1, 2) else inter
    pb = proj_bits or (bits, bits, bits)
    consts, quant = {}, {"bits": pb, "k": (h, inter, h)}

    def add(j, n, kk, b):
        consts[f"w{j}"] = pack_codes(rng.integers(0, 1 << b, (e, n, kk)), b)
        nb = -(-kk // block) if block else None
        # weights of a trained model's size whatever the width: |w| up to ~0.4
        consts[f"s{j}"] = ((rng.random((e, n, nb) if block else (e, n)) * 0.05 + 0.01) * 8 / (1 << (b - 1))).astype(sdtype)
        if zp:
            consts[f"z{j}"] = pack_codes(rng.integers(0, 1 << b, (e, n, nb) if block else (e, n)), b)

    add(1, f1, h, pb[0])
    add(2, h, inter, pb[1])
    if fc3:
        add(3, inter, h, pb[2])
    if bias:
        consts["b1"] = (rng.standard_normal((e, f1)) * 0.1).astype(dtype)
        consts["b2"] = (rng.standard_normal((e, h)) * 0.1).astype(dtype)
    feeds = {"x": rng.standard_normal((rows, h)).astype(dtype), "r": rng.standard_normal((rows, e)).astype(dtype)}
    if rw:
        feeds["rw"] = rng.random((rows, e)).astype(dtype)
    if block:
        attrs["block_size"] = block
    if fusion is not None:
        attrs["swiglu_fusion"] = fusion
    if proj_bits:
        attrs.update(fc1_expert_weight_bits=pb[0], fc2_expert_weight_bits=pb[1], fc3_expert_weight_bits=pb[2])
    node = _node("QMoE", QMOE_NAMES, {**feeds, **consts}, k=k, activation_type=act, expert_weight_bits=bits, **attrs)
    return node, feeds, consts, quant


def _ort(model, feeds, disable_prepacking: bool = False):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_prepacking", "1" if disable_prepacking else "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def check_qmoe(node, feeds, consts, want=None, tol=F32):
    """onnxpack == onnxruntime on each path, against onnxruntime's same configuration: packed
    weights (where both round a block-wise projection's activations to int8 when its QNBit GEMM
    takes them), pre-packing disabled and weights fed at run time (both in float32).  ``want``
    (float32 paths) replaces onnxruntime where it refuses the case.  Returns the packed path's."""
    model = single_node_model(node, feeds, consts, 21)
    packs = _packs(node, consts)
    got, stats = run_onnxpack(model, feeds)
    assert stats["weights_packed"] == packs, stats
    assert_match(got, _ort(model, feeds) if want is None else want, tol, "prepacked")
    got2, stats2 = run_onnxpack(model, feeds, disable_prepacking=True)
    assert stats2["weights_packed"] == 0
    unpacked = _ort(model, feeds, disable_prepacking=True) if want is None else want
    assert_match(got2, unpacked, tol, "prepacking disabled")
    as_inputs = single_node_model(node, {**feeds, **consts}, {}, 21)
    got3, _ = run_onnxpack(as_inputs, {**feeds, **consts})
    assert_match(got3, unpacked, tol, "weights as inputs")
    return got


def _packs(node, consts) -> int:
    """Weights and scales are packed, and zero points of 8 bits (narrower ones say not how many
    blocks a row has: unpacked per call)."""
    names = [n for n in consts if n[0] in "ws"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    bits = attrs.get("expert_weight_bits", 4)
    return len(names) + sum(1 for n in consts if n[0] == "z"
                            and attrs.get(f"fc{n[1]}_expert_weight_bits", bits) == 8)


@pytest.mark.parametrize("case", [
    dict(), dict(act="silu", fusion=None), dict(block=16), dict(block=64), dict(block=0), dict(bits=8),
    dict(bits=8, block=0), dict(bits=2), dict(zp=True), dict(bits=8, zp=True), dict(block=0, zp=True),
    dict(sdtype=np.float16), dict(rw=True), dict(rw=True, normalize_routing_weights=1),
    dict(h=48, inter=48),  # a partial last block
    dict(rows=1), dict(rows=64), dict(accuracy_level=4),
    dict(normalize_routing_weights=1, activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0),  # gpt-oss
])
def test_qmoe_matches_onnxruntime(case):
    node, feeds, consts, quant = qmoe_case(np.random.default_rng(6), **case)
    packed = check_qmoe(node, feeds, consts)
    # onnxruntime without its pre-packing multiplies every projection in float32: the reference's
    int8 = case.get("block", 32) and (case.get("bits") == 8 or case.get("accuracy_level") == 4)
    tol = dict(rtol=0, atol=0.03 * float(np.abs(packed[0]).max())) if int8 else F32
    assert_match([_reference_of(node, feeds, consts, quant)], packed, tol, "reference vs onnxruntime")


def test_qmoe_float16_matches_onnxruntime():
    node, feeds, consts, _ = qmoe_case(np.random.default_rng(7), dtype=np.float16, sdtype=np.float16)
    check_qmoe(node, feeds, consts, tol=F16)


def test_qmoe_routing_is_always_normalized_as_onnxruntime_cpu():
    """onnxruntime's CPU QMoE divides the chosen probabilities by their sum whatever
    normalize_routing_weights says (its float MoE honours it): so does QMoE here."""
    node, feeds, consts, quant = qmoe_case(np.random.default_rng(8), normalize_routing_weights=0)
    got = check_qmoe(node, feeds, consts)
    assert_match([_reference_of(node, feeds, consts, quant)], got, F32)


@pytest.mark.parametrize("case", [
    dict(act="silu", fusion=None, fc3=True),  # "FC3 gating is not yet implemented on CPU"
    dict(act="swiglu", fusion=0, fc3=True),
    dict(proj_bits=(4, 8, 4)),  # "Mixed-width QMoE execution is not yet implemented on CPU"
    dict(act="swiglu", fusion=2, zp=True),
])
def test_qmoe_beyond_onnxruntime_cpu_matches_the_spec(case):
    node, feeds, consts, quant = qmoe_case(np.random.default_rng(9), **case)
    want = [_reference_of(node, feeds, consts, quant)]
    # a packed 8-bit block-wise projection multiplies int8-rounded activations, as onnxruntime's do
    tol = dict(rtol=0, atol=0.03 * float(np.abs(want[0]).max())) if 8 in quant["bits"][:2] else F32
    check_qmoe(node, feeds, consts, want=want, tol=tol)


def test_qmoe_saved_packs_map_back(tmp_path):
    """optimize saves the tiled packs; a warm session maps them, packs nothing, and agrees."""
    node, feeds, consts, _ = qmoe_case(np.random.default_rng(10), bits=8, zp=True)
    model = single_node_model(node, feeds, consts, 21)
    src = tmp_path / "qmoe.onnx"
    onnx.save(model, str(src), save_as_external_data=True, location="qmoe.onnx.data", size_threshold=0)
    cold = onnxpack.InferenceSession(str(src)).run(None, feeds)
    optimize(str(src), str(tmp_path / "opt.onnx"))
    warm = onnxpack.InferenceSession(str(tmp_path / "opt.onnx"))
    stats = warm.get_prepack_stats()
    assert stats["weights_packed"] == 0 and stats["blobs_from_model"] == _packs(node, consts), stats
    for a, b in zip(warm.run(None, feeds), cold):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad,message", [
    (lambda f, c: f.update(r=f["r"][:, :3]), "router_probs must have shape"),
    (lambda f, c: c.update(w2=c["w2"][:, :, :-1]), r"inter size 30 \(fc2_experts_weights \[4, 64, 15\]\)"),
    (lambda f, c: c.update(s1=c["s1"][:, :, :1]), "fc1_scales must be float of shape"),
    (lambda f, c: c.update(b2=c["b2"][:, :3]), "fc2 bias must have shape"),
])
def test_qmoe_bad_inputs_are_clear_errors(bad, message):
    node, feeds, consts, _ = qmoe_case(np.random.default_rng(11))
    bad(feeds, consts)
    for packed in (True, False):  # constant weights, then weights fed at run time
        model = single_node_model(node, feeds if packed else {**feeds, **consts}, consts if packed else {}, 21)
        with pytest.raises(OnnxpackError, match=message):
            onnxpack.InferenceSession(model.SerializeToString()).run(None, feeds if packed else {**feeds, **consts})


@pytest.mark.parametrize("attrs,message", [
    (dict(k=5), "more than the 4 experts"),
    (dict(block_size=24), "block_size must be a power of 2"),
    (dict(expert_weight_bits=5), "bits must be 2, 3, 4 or 8"),
    (dict(expert_weight_bits=3), "INT3 profile"),  # without weights_prepacked=0, as onnxruntime
    (dict(activation_type="geglu"), "activation_type"),
    (dict(quant_type="fp4"), "quant_type"),
])
def test_qmoe_bad_attributes_are_clear_errors(attrs, message):
    node, feeds, consts, _ = qmoe_case(np.random.default_rng(12))
    for a in list(node.attribute):
        if a.name in attrs:
            node.attribute.remove(a)
    node.attribute.extend(helper.make_attribute(n, v) for n, v in attrs.items())
    model = single_node_model(node, feeds, consts, 21)
    with pytest.raises(OnnxpackError, match=message):
        onnxpack.InferenceSession(model.SerializeToString()).run(None, feeds)


def test_qmoe_biases_computed_at_run_time(tmp_path):
    """Packed experts serve call after call; biases that are fresh arrays each run (a node's
    outputs) are read anew."""
    node, feeds, consts, quant = qmoe_case(np.random.default_rng(13))
    b1 = consts.pop("b1")
    node.input[4] = "b1_run"
    scale = helper.make_node("Mul", ["b1_in", "one"], ["b1_run"])
    model = single_node_model(node, {**feeds, "b1_in": b1}, {**consts, "one": np.ones(1, np.float32)}, 21)
    model.graph.node.insert(0, scale)
    sess = onnxpack.InferenceSession(model.SerializeToString())
    for k in range(3):
        bias = (b1 * (k + 1)).astype(np.float32)
        got = sess.run(None, {**feeds, "b1_in": bias})
        want = _reference_of(node, feeds, {**consts, "b1": bias}, quant)
        assert_match(got, [want], F32, f"call {k}")


def test_moe_attribute_defaults_and_limits_as_onnxruntime():
    """k defaults to 1 (the schema's); a NaN swiglu_limit clamps nothing (as onnxruntime reads
    it); QMoE's weights_prepacked -1 (the default) and 0 name the raw layout."""
    rng = np.random.default_rng(14)
    node, feeds, consts = moe_case(rng, "silu")
    node.attribute.remove(next(a for a in node.attribute if a.name == "k"))
    check_all_paths(node, feeds, consts, F32)
    node, feeds, consts = moe_case(rng, "swiglu", fusion=1, swiglu_limit=float("nan"), activation_alpha=1.702)
    want = check_all_paths(node, feeds, consts, F32)
    assert np.isfinite(want[0]).all()
    for prepacked in (-1, 0):
        node, feeds, consts, _ = qmoe_case(rng, weights_prepacked=prepacked)
        check_qmoe(node, feeds, consts)


@pytest.mark.parametrize("op,attrs,message", [
    ("MoE", dict(swiglu_limit=-1.0), "swiglu_limit must be >= 0"),  # onnxruntime aborts the process
    ("QMoE", dict(weights_prepacked=1), "CUDA layout"),
])
def test_moe_refused_attributes(op, attrs, message):
    rng = np.random.default_rng(15)
    if op == "MoE":
        node, feeds, consts = moe_case(rng, "swiglu", fusion=1, **attrs)
    else:
        node, feeds, consts, _ = qmoe_case(rng, **attrs)
    with pytest.raises(OnnxpackError, match=message):
        onnxpack.InferenceSession(single_node_model(node, feeds, consts, 21).SerializeToString()).run(None, feeds)


def _three_bit_stream(q: np.ndarray) -> np.ndarray:
    """3-bit codes (..., K) -> one little-endian bit stream per row, uint8 (..., ceil(3K / 8))."""
    bits = ((q[..., None] >> np.arange(3)) & 1).reshape(*q.shape[:-1], -1).astype(np.uint8)
    return np.packbits(bits, axis=-1, bitorder="little")


@pytest.mark.parametrize("block,zp,dtype,normalize,level", [
    (32, False, np.float16, 1, 0), (64, False, np.float16, 1, 0), (64, True, np.float16, 1, 0),
    (32, False, np.float32, 1, 0),
    (32, False, np.float16, 0, 0),  # onnxruntime's INT3 path honours normalize_routing_weights
    (64, False, np.float16, 1, 4),  # and multiplies in float whatever accuracy_level says
])
def test_qmoe_int3_profile_matches_onnxruntime(block, zp, dtype, normalize, level):
    """The INT3 profile (onnxruntime 1.32's schema): 3-bit codes, one bit stream per row, (u - 4) *
    scale; zero points, when given, all 4 (onnxruntime's CPU kernel refuses explicit ones: the
    reference decides); float16 or bfloat16 activations (float32 refused, as onnxruntime).
    Computed as 4-bit codes with zero point 4."""
    rng = np.random.default_rng(16)
    e, h, inter, rows = 4, 64, 64, 5
    consts = {}
    for j, (n, k) in enumerate(((2 * inter, h), (h, inter)), start=1):
        consts[f"w{j}"] = _three_bit_stream(rng.integers(0, 8, (e, n, k)))
        consts[f"s{j}"] = (rng.random((e, n, k // block)) * 0.05 + 0.02).astype(dtype)
        if zp:
            consts[f"z{j}"] = _three_bit_stream(np.full((e, n, k // block), 4))
    feeds = {"x": rng.standard_normal((rows, h)).astype(dtype), "r": rng.standard_normal((rows, e)).astype(dtype)}
    node = _node("QMoE", QMOE_NAMES, {**feeds, **consts}, k=2, activation_type="swiglu", swiglu_fusion=1,
                 expert_weight_bits=3, block_size=block, normalize_routing_weights=normalize, activation_beta=-0.5,
                 weights_prepacked=0, accuracy_level=level)
    model = single_node_model(node, feeds, consts, 21)
    if dtype == np.float32:
        with pytest.raises(OnnxpackError, match="float16 or bfloat16"):
            onnxpack.InferenceSession(model.SerializeToString()).run(None, feeds)
        return
    w = {f"w{j}": _codes_int3(consts[f"w{j}"], consts[f"s{j}"], block, k) for j, k in ((1, h), (2, inter))}
    ref = [reference(feeds["x"].astype(np.float64), feeds["r"], w["w1"], w["w2"], k=2, act="swiglu", fusion=1,
                     beta=-0.5, normalize=bool(normalize)).astype(dtype)]
    want = ref if zp else _ort(model, feeds)
    got, stats = run_onnxpack(model, feeds)
    assert stats["weights_packed"] == 4, stats
    assert_match(got, want, F16, "prepacked")
    assert_match(run_onnxpack(model, feeds, disable_prepacking=True)[0], want, F16, "prepacking disabled")
    assert_match(ref, want, F16, "reference vs onnxruntime")


def _codes_int3(stream, scales, block, k):
    bits = np.unpackbits(stream, axis=-1, bitorder="little")[..., :3 * k].reshape(*stream.shape[:-1], k, 3)
    q = bits[..., 0] + 2 * bits[..., 1] + 4 * bits[..., 2]
    return (q - 4.0) * np.repeat(scales.astype(np.float64), block, axis=-1)


def test_qmoe_int3_zero_points_other_than_four_are_refused():
    rng = np.random.default_rng(17)
    node, feeds, consts, _ = qmoe_case(rng, bits=4, dtype=np.float16)
    e, h, inter = 4, 64, 32
    consts = {"w1": _three_bit_stream(rng.integers(0, 8, (e, 2 * inter, h))), "s1": np.ones((e, 2 * inter, 2), np.float16),
              "w2": _three_bit_stream(rng.integers(0, 8, (e, h, inter))), "s2": np.ones((e, h, 1), np.float16),
              "z1": _three_bit_stream(np.full((e, 2 * inter, 2), 3)), "z2": _three_bit_stream(np.full((e, h, 1), 4))}
    node = _node("QMoE", QMOE_NAMES, {**feeds, **consts}, k=2, activation_type="swiglu", swiglu_fusion=1,
                 expert_weight_bits=3, block_size=32, weights_prepacked=0)
    model = single_node_model(node, feeds, consts, 21)
    with pytest.raises(OnnxpackError, match="every 3-bit zero point must be 4"):
        onnxpack.InferenceSession(model.SerializeToString()).run(None, feeds)


def test_qmoe_block_size_beyond_the_row_as_onnxruntime():
    """A block_size of K or more is one block per row: packed at the row's size (a huge
    block_size allocated its size per row: 5 GiB for a 3 KB model at 2**26), and (E, N) scales
    with it are row-wise, as onnxruntime reads them."""
    rng = np.random.default_rng(18)
    for block in (1 << 26, 128):
        node, feeds, consts, quant = qmoe_case(rng, block=0, h=64, inter=32)
        node.attribute.extend([helper.make_attribute("block_size", block)])
        model = single_node_model(node, feeds, consts, 21)
        got, stats = run_onnxpack(model, feeds)
        assert stats["bytes_packed"] < 64 * sum(v.nbytes for v in consts.values()), stats
        assert_match(got, _ort(model, feeds), F32, f"block_size {block}")
