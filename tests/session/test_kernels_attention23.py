"""ONNX Attention (opsets 23, 24, 25) and RMSNormalization-23: what torch's exporter writes for
``scaled_dot_product_attention`` and RMSNorm at opset 23 and later.

Oracles: onnxruntime 1.32 (CPU, graph optimizations off) where it runs the case; onnx.reference
where onnxruntime refuses what the spec allows (an ``attn_mask`` shorter than the keys, a rank-1
mask) and for opset 25's windows.  Where the two disagree, the spec decides: onnx.reference
1.23 returns the soft-capped scores for ``qk_matmul_output_mode=0`` (the spec and onnxruntime:
the raw scores), so mode 0 with a softcap is checked against onnxruntime only.

onnxruntime writes masked scores of the mode-2 ``qk_matmul_output`` as the lowest float32 where the
spec has -inf: those entries are mapped to -inf before comparing.

Tolerances: float32 rtol 1e-4 / atol 1e-5 (the products sum in another order); float16 inputs
rtol 1e-2 / atol 1e-2 (computed in float32 and rounded once, as onnxruntime does;
onnx.reference computes in float16).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from contrib_util import assert_match, run_onnxpack, run_ort_model, single_node_model
from kernel_util import run_reference

import onnxpack
from onnxpack.errors import InvalidArgument, RuntimeFailure

F32 = dict(rtol=1e-4, atol=1e-5)
F16 = dict(rtol=1e-2, atol=1e-2)
NAMES = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
OUTS = ("Y", "present_key", "present_value", "qk")


def attention(inputs, n_out=1, opset=23, **attrs):
    """(node, feeds) for an Attention node over ``inputs`` (None: input absent)."""
    names = [n if x is not None else "" for n, x in zip(NAMES, inputs)]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node("Attention", names, list(OUTS[:n_out]), **attrs)
    feeds = {n: x for n, x in zip(NAMES, inputs) if x is not None}
    return node, feeds


def check(inputs, n_out=1, opset=23, oracle="ort", tol=F32, **attrs):
    """onnxpack (pre-packing on and off) == the oracle: every output's dtype, shape and values."""
    node, feeds = attention(inputs, n_out, opset, **attrs)
    model = single_node_model(node, feeds, {}, opset)
    if oracle == "ort":
        want = run_ort_model(model, feeds)
        if attrs.get("qk_matmul_output_mode") == 2 and n_out == 4:
            # onnxruntime writes a masked score as the lowest float32 in this debug output, the
            # spec (and onnx.reference) as -inf: the same weights after the softmax.
            want[3] = np.where(want[3] <= np.finfo(want[3].dtype).min, -np.inf, want[3]).astype(want[3].dtype)
    else:
        want = run_reference(node, list(inputs)[: len(node.input)], opset)
    got, _ = run_onnxpack(model, feeds)
    assert_match(got, want, tol, "prepacked")
    got2, _ = run_onnxpack(model, feeds, disable_prepacking=True)
    assert_match(got2, want, tol, "prepacking disabled")
    return got


def assert_clear_error(model, feeds, op: str) -> None:
    """The model is refused with an InvalidArgument naming the op: at creation (a bad attribute)
    or at run (bad inputs: a RuntimeFailure naming the node, the InvalidArgument as its cause)."""
    with pytest.raises((InvalidArgument, RuntimeFailure), match=op) as info:
        onnxpack.InferenceSession(model.SerializeToString()).run(None, feeds)
    err = info.value
    assert isinstance(err, InvalidArgument) or isinstance(err.__cause__, InvalidArgument), repr(err)


def rnd(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


B, H, S, T, D = 2, 4, 3, 5, 8


@pytest.fixture
def qkv():
    rng = np.random.default_rng(23)
    return rnd(rng, B, H, S, D), rnd(rng, B, H, T, D), rnd(rng, B, H, T, D)


@pytest.mark.parametrize("opset", [23, 24, 25])
def test_plain_4d(qkv, opset):
    check(list(qkv), opset=opset)


@pytest.mark.parametrize("s", [1, 3, 5])
def test_causal_without_past_is_top_left(qkv, s):
    """Without a cache the causal frontier is j <= i (offset 0), also for fewer queries than keys."""
    q, k, v = qkv
    q = np.random.default_rng(s).standard_normal((B, H, s, D)).astype(np.float32)
    check([q, k, v], is_causal=1)


@pytest.mark.parametrize("past", [0, 2, 6])
def test_causal_with_past_and_present(qkv, past):
    """present = past rows then the new ones (bit for bit); the frontier shifts by the past."""
    q, k, v = qkv
    rng = np.random.default_rng(past)
    pk, pv = rnd(rng, B, H, past, D), rnd(rng, B, H, past, D)
    got = check([q, k, v, None, pk, pv], n_out=3, is_causal=1)
    np.testing.assert_array_equal(got[1], np.concatenate((pk, k), axis=2))
    np.testing.assert_array_equal(got[2], np.concatenate((pv, v), axis=2))


@pytest.mark.parametrize("shape", [(S, T), (B, 1, S, T), (B, H, S, T), (1, S, T)], ids=["2d", "b1st", "bhst", "3d"])
@pytest.mark.parametrize("kind", ["bool", "float", "int64"])
@pytest.mark.parametrize("causal", [0, 1])
def test_masks(qkv, shape, kind, causal):
    rng = np.random.default_rng(5)
    if kind == "bool":
        mask = rng.random(shape) > 0.3
    elif kind == "float":
        mask = rnd(rng, *shape)
    else:
        mask = (rng.random(shape) > 0.3).astype(np.int64)  # an integer mask is added as it is
    check([*qkv, mask], is_causal=causal)


def test_fully_masked_rows_are_zero(qkv):
    """A query row with no visible key (an all-False bool row, an all -inf float row) outputs
    zeros, not NaN, in Y and in the mode-3 probabilities."""
    rng = np.random.default_rng(6)
    bmask = rng.random((S, T)) > 0.3
    bmask[1] = False
    got = check([*qkv, bmask], n_out=4, qk_matmul_output_mode=3)
    assert not np.isnan(got[0]).any() and np.all(got[0][:, :, 1] == 0) and np.all(got[3][:, :, 1] == 0)
    fmask = rnd(rng, B, 1, S, T)
    fmask[0, 0, 2] = -np.inf
    got = check([*qkv, fmask])
    assert np.all(got[0][0, :, 2] == 0) and np.isfinite(got[0]).all()


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_short_masks_pad_with_minus_infinity(qkv, kind, rank):
    """A mask shorter than the keys is padded with -inf (the spec; onnxruntime refuses it)."""
    rng = np.random.default_rng(7)
    shape = {1: (3,), 2: (S, 3), 4: (B, 1, S, 3)}[rank]
    mask = rng.random(shape) > 0.2 if kind == "bool" else rnd(rng, *shape)
    check([*qkv, mask], oracle="reference")


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_qk_matmul_output_modes(qkv, mode, softcap):
    mask = rnd(np.random.default_rng(8), B, 1, S, T)
    check([*qkv, mask], n_out=4, qk_matmul_output_mode=mode, softcap=softcap, is_causal=1)


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_qk_modes_match_the_reference_too(qkv, mode):
    mask = rnd(np.random.default_rng(9), B, 1, S, T)
    check([*qkv, mask], n_out=4, oracle="reference", qk_matmul_output_mode=mode, softcap=3.0)


@pytest.mark.parametrize("attrs", [dict(scale=0.1), dict(softmax_precision=11), dict(softmax_precision=1),
                                   dict(softcap=1.5, scale=0.7)], ids=["scale", "sp-f64", "sp-f32", "softcap"])
def test_scale_softcap_precision(qkv, attrs):
    check(list(qkv), **attrs)


def test_float16_softmax_precision_follows_the_spec(qkv):
    """softmax_precision=10 on float32 inputs: the scores are cast to float16 for the softmax, as
    the spec and onnx.reference do (onnxruntime 1.32 ignores the attribute: ~1e-3 away)."""
    got = check(list(qkv), oracle="reference", tol=dict(rtol=1e-5, atol=1e-6), softmax_precision=10)
    node, feeds = attention(list(qkv), softmax_precision=10)
    ort_y = run_ort_model(single_node_model(node, feeds, {}, 23), feeds)[0]
    assert 1e-4 < np.abs(got[0] - ort_y).max() < 1e-2


def test_3d_grouped_query_attention_with_cache():
    """3-D Q/K/V with q_num_heads / kv_num_heads (4 query heads over 2 KV heads), V's head size
    differing from Q's; the cache in (B, kv_heads, P, head) as the spec lays it out."""
    rng = np.random.default_rng(10)
    q, k, v = rnd(rng, B, S, 4 * D), rnd(rng, B, T, 2 * D), rnd(rng, B, T, 2 * 6)
    pk, pv = rnd(rng, B, 2, 4, D), rnd(rng, B, 2, 4, 6)
    check([q, k, v], q_num_heads=4, kv_num_heads=2)
    check([q, k, v, None, pk, pv], n_out=3, q_num_heads=4, kv_num_heads=2, is_causal=1)


def test_4d_grouped_query_and_value_head_size(qkv):
    rng = np.random.default_rng(11)
    q = qkv[0]
    check([q, rnd(rng, B, 2, T, D), rnd(rng, B, 2, T, 6)], is_causal=1)
    check([q, rnd(rng, B, 1, T, D), rnd(rng, B, 1, T, D)])  # multi-query


def test_float16_and_float64(qkv):
    half = [x.astype(np.float16) for x in qkv]
    mask = rnd(np.random.default_rng(12), B, 1, S, T).astype(np.float16)
    check([*half, mask], tol=F16, is_causal=1)
    # float64: onnx.reference computes in float64 as we do (onnxruntime is ~1e-7 away: its double
    # kernel is not float64 throughout)
    check([x.astype(np.float64) for x in qkv], oracle="reference", tol=dict(rtol=1e-10, atol=1e-12), is_causal=1)


@pytest.mark.parametrize("causal", [0, 1])
def test_opset24_nonpad_kv_seqlen(qkv, causal):
    """nonpad_kv_seqlen hides each batch's keys from its length on; with is_causal the frontier
    is bottom-right: offset = length - S per batch (a length below S hides every key of the
    leading rows: zeros)."""
    lens = np.array([5, 3], np.int64)
    check([*qkv, None, None, None, lens], opset=24, is_causal=causal)
    check([*qkv, None, None, None, np.array([2, 4], np.int64)], opset=24, oracle="reference", is_causal=causal)


@pytest.mark.parametrize("window", [(1, 1), (2, 0), (0, -1), (-1, 1)])
@pytest.mark.parametrize("causal", [0, 1])
def test_opset25_windows(qkv, window, causal):
    left, right = window
    check(list(qkv), opset=25, oracle="reference", left_window_size=left, right_window_size=right, is_causal=causal)
    rng = np.random.default_rng(13)
    pk, pv = rnd(rng, B, H, 3, D), rnd(rng, B, H, 3, D)
    check([*qkv, None, pk, pv], n_out=3, opset=25, oracle="reference", left_window_size=left,
          right_window_size=right, is_causal=causal)


def test_windows_are_refused_before_opset25(qkv):
    """The window attributes exist from opset 25: an opset-23 node carrying one is refused at load,
    as onnxruntime refuses it (graph/_attributes.py)."""
    import onnxruntime as ort

    from onnxpack.errors import InvalidGraph

    node, feeds = attention(list(qkv), is_causal=1, left_window_size=0)
    model = single_node_model(node, feeds, {}, 23)
    with pytest.raises(InvalidGraph, match="left_window_size"):
        run_onnxpack(model, feeds)
    with pytest.raises(Exception, match="left_window_size"):
        ort.InferenceSession(model if isinstance(model, (bytes, str)) else model.SerializeToString(),
                             providers=["CPUExecutionProvider"])


def test_edge_sizes_and_overflow():
    """No key at all (T = 0, no past): zero rows, as for any fully masked row; no query: an empty
    Y; scores that overflow float32 give the arithmetic's result without a numpy warning
    (onnxruntime never warns)."""
    rng = np.random.default_rng(17)
    q = rnd(rng, 1, 2, 3, 4)
    node, feeds = attention([q, rnd(rng, 1, 2, 0, 4), rnd(rng, 1, 2, 0, 5)])
    got, _ = run_onnxpack(single_node_model(node, feeds, {}, 23), feeds)
    assert got[0].shape == (1, 2, 3, 5) and not got[0].any()
    node, feeds = attention([rnd(rng, 1, 2, 0, 4), rnd(rng, 1, 2, 3, 4), rnd(rng, 1, 2, 3, 4)])
    got, _ = run_onnxpack(single_node_model(node, feeds, {}, 23), feeds)
    assert got[0].shape == (1, 2, 0, 4)
    big = [q * 1e20, rnd(rng, 1, 2, 3, 4) * 1e20, rnd(rng, 1, 2, 3, 4)]
    node, feeds = attention(big)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, _ = run_onnxpack(single_node_model(node, feeds, {}, 23), feeds)
    assert got[0].shape == (1, 2, 3, 4)


def test_fully_masked_rows_are_zero_whatever_their_scores():
    """The spec decides a fully masked row on the bias, not the scores: NaN or inf in its Q row
    still gives zeros there (as onnxruntime and onnx.reference); the other rows keep their NaN."""
    rng = np.random.default_rng(18)
    q, k, v = rnd(rng, 1, 1, 3, 4), rnd(rng, 1, 1, 3, 4), rnd(rng, 1, 1, 3, 4)
    q[0, 0, 1] = np.nan
    q[0, 0, 2] = np.inf
    mask = np.ones((3, 3), bool)
    mask[1] = False
    mask[2] = False
    got = check([q, k, v, mask])
    assert np.all(got[0][0, 0, 1:] == 0) and np.isfinite(got[0][0, 0, 0]).all()


@pytest.mark.parametrize("heads", [2**31 - 1, 2**62])
def test_3d_heads_beyond_the_hidden_size_are_refused(heads):
    """q_num_heads larger than a 3-D input's hidden size (0 here: every count divides it) is an
    error naming the op, not a reshape error or a 288 GiB allocation (found by fuzzing)."""
    x = np.zeros((1, 2, 0), np.float32)
    node, feeds = attention([x, x, x], q_num_heads=heads, kv_num_heads=heads)
    assert_clear_error(single_node_model(node, feeds, {}, 23), feeds, "positive multiple")


@pytest.mark.parametrize("case", ["rank", "heads-missing", "heads-multiple", "head-size", "past-alone",
                                  "past-shape", "mask-long", "mask-broadcast", "nonpad-with-past", "mode",
                                  "head-size-0"])
def test_bad_inputs_are_clear_errors(qkv, case):
    q, k, v = qkv
    rng = np.random.default_rng(14)
    inputs, attrs = [q, k, v], {}
    if case == "rank":
        inputs = [q, k.reshape(B, T, H * D), v]
    elif case == "heads-missing":
        inputs = [x.reshape(x.shape[0], x.shape[2], -1) for x in qkv]
    elif case == "heads-multiple":
        inputs = [q, rnd(rng, B, 3, T, D), rnd(rng, B, 3, T, D)]
    elif case == "head-size":
        inputs = [q, rnd(rng, B, H, T, D + 1), v]
    elif case == "past-alone":
        inputs = [q, k, v, None, rnd(rng, B, H, 2, D)]
    elif case == "past-shape":
        inputs = [q, k, v, None, rnd(rng, B, H, 2, D + 1), rnd(rng, B, H, 2, D)]
    elif case == "mask-long":
        inputs = [q, k, v, rnd(rng, S, T + 2)]
    elif case == "mask-broadcast":
        inputs = [q, k, v, rnd(rng, 3, S, T)]
    elif case == "head-size-0":
        inputs = [rnd(rng, B, H, S, 0), rnd(rng, B, H, T, 0), v]
    elif case == "nonpad-with-past":
        inputs = [q, k, v, None, rnd(rng, B, H, 2, D), rnd(rng, B, H, 2, D), np.array([5, 5], np.int64)]
    else:
        attrs = dict(qk_matmul_output_mode=4)
    opset = 24 if case == "nonpad-with-past" else 23
    node, feeds = attention(inputs, n_out=3 if case.startswith("past") or case.startswith("nonpad") else 1,
                            **attrs)
    assert_clear_error(single_node_model(node, feeds, {}, opset), feeds, "Attention")


# -- RMSNormalization-23 ------------------------------------------------------------------------------

def rms_model(x, scale, **attrs):
    node = helper.make_node("RMSNormalization", ["x", "s"], ["y"], **attrs)
    return node, single_node_model(node, {"x": x, "s": scale}, {}, 23)


@pytest.mark.parametrize("axis,scale_shape", [(-1, (8,)), (-1, (1, 1, 8)), (-1, (3, 8)), (1, (3, 8)), (0, (2, 3, 8)),
                                              (-2, (1, 8))], ids=["last", "last-1x1", "last-s", "from1", "all", "m2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=["f32", "f16", "f64"])
@pytest.mark.parametrize("stash", [1, 11])
def test_rms_normalization(axis, scale_shape, dtype, stash):
    """vs onnxruntime (which runs the op's function body: the normalized value is cast back to
    X's dtype, then scaled) and, at stash_type 1, onnx.reference."""
    rng = np.random.default_rng(15)
    x = (rng.standard_normal((2, 3, 8)) * 2 + 0.3).astype(dtype)
    scale = rng.standard_normal(scale_shape).astype(dtype)
    node, model = rms_model(x, scale, axis=axis, epsilon=1e-5, stash_type=stash)
    feeds = {"x": x, "s": scale}
    # float64 stays float64 whatever the stash type (as in onnxruntime and onnx.reference)
    tol = F16 if dtype == np.float16 else dict(rtol=1e-10, atol=1e-12) if dtype == np.float64 else F32
    got, _ = run_onnxpack(model, feeds)
    assert_match(got, run_ort_model(model, feeds), tol, "onnxruntime")
    if stash == 1:
        assert_match(got, run_reference(node, [x, scale], 23), tol, "onnx.reference")


def test_rms_normalization_float16_rounds_before_scaling():
    """float16: the normalized value is rounded to float16 before the scale multiplies it (the
    function body's Cast), so the result is within one float16 step of onnxruntime's."""
    rng = np.random.default_rng(16)
    x = rng.standard_normal((4, 64)).astype(np.float16)
    scale = (rng.standard_normal(64) * 3).astype(np.float16)
    _, model = rms_model(x, scale)
    got = run_onnxpack(model, {"x": x, "s": scale})[0][0]
    want = run_ort_model(model, {"x": x, "s": scale})[0]
    step = np.spacing(np.abs(want).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(got.astype(np.float32) - want.astype(np.float32)) <= step)


def test_rms_normalization_large_values():
    """float32 rows whose squares overflow float32 normalize on the numpy path (a broadcast scale:
    the mean of squares sums in float64), as in onnxruntime, without a warning; float64 X keeps
    float64 (stash_type 1 lowers no precision: onnxruntime and onnx.reference compute it in
    float64), so the same values times 1e10 normalize there.  (The JIT's last-axis pass sums in
    float32: zeros for such rows, see RMSNormalization.)"""
    rng = np.random.default_rng(19)
    x = (rng.standard_normal((2, 64)) * 1e20).astype(np.float32)
    scale = np.ones(1, np.float32)
    _, model = rms_model(x, scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_onnxpack(model, {"x": x, "s": scale})[0][0]
    np.testing.assert_allclose(got, run_ort_model(model, {"x": x, "s": scale})[0], rtol=1e-5)
    x64 = x.astype(np.float64) * 1e10
    want = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-5)
    _, model = rms_model(x64, np.ones(64))
    got = run_onnxpack(model, {"x": x64, "s": np.ones(64)})[0][0]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(got, run_ort_model(model, {"x": x64, "s": np.ones(64)})[0], rtol=1e-12)


@pytest.mark.parametrize("bad", [dict(axis=3), dict(stash_type=7), "scale", "rank0", "int"])
def test_rms_normalization_bad_nodes(bad):
    x = np.ones((2, 3, 8), np.float32)
    scale = np.ones((2, 2, 3, 8) if bad == "scale" else (8,), np.float32)
    if bad == "rank0":
        x, scale = np.float32(2.0).reshape(()), np.ones((), np.float32)
    elif bad == "int":
        x = np.ones((2, 3, 8), np.int64)
    _, model = rms_model(x, scale, **(bad if isinstance(bad, dict) else {}))
    assert_clear_error(model, {"x": x, "s": scale}, "RMSNormalization")
