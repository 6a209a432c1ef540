"""onnxruntime's contrib ops (com.microsoft norms, activations, FusedMatMul) and the float32 erf.

Oracle: onnxruntime 1.32 with graph optimizations off, one node per model (``run_ort``), except
for BiasAdd, BiasSoftmax and BiasSplitGelu, which onnxruntime implements for CUDA only: there the
oracle is the op's formula in float64.  Tolerances (stated per test where they differ):

* float32: rtol 1e-4 / atol 1e-5 (``TOL``): onnxruntime sums in another order (MLAS), and its
  erf/tanh/exp are other float32 approximations (each within a few ulp).
* float16: rtol 1e-2 / atol 1e-2 after widening both to float64: both sides compute in float32
  and round once at the end, so results differ by at most an ulp or two of float16 (ulp is
  ~1e-3 relative) when onnxruntime's float32 intermediates differ from ours in their last bits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnxpack.session.kernels._erf import erf_f32


# ------------------------------------------------------------------------------------------------
# erf
# ------------------------------------------------------------------------------------------------
def test_erf_f32_max_error_on_dense_grid():
    """Max error vs math.erf (float64) on 400,001 float32 points in [-6, 6]: <= 1e-7 absolute
    and <= 2 ulp of the float32 result (measured 8.8e-8 and 1.5 ulp)."""
    x = np.linspace(-6, 6, 400_001, dtype=np.float32)
    want = np.array([math.erf(float(v)) for v in x])
    got = erf_f32(x)
    assert got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)
    assert err.max() <= 1e-7, err.max()
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    nz = x != 0
    assert (err[nz] / ulp[nz]).max() <= 2.0


def test_erf_f32_tiny_values_keep_relative_accuracy():
    """Near 0 erf(x) ~ 2x/sqrt(pi): relative error stays within 2 ulp down to subnormals."""
    x = np.geomspace(1e-38, 1e-2, 2000, dtype=np.float32)
    want = np.array([math.erf(float(v)) for v in x])
    got = erf_f32(x).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2.4e-7)
    np.testing.assert_array_equal(erf_f32(-x), -erf_f32(x))


def test_erf_f32_special_values_and_shapes():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.925, 1e30, -3e38], np.float32)
    with np.errstate(all="raise"):
        got = erf_f32(x)
    assert np.isnan(got[0])
    np.testing.assert_array_equal(got[1:], [1, -1, 0, 0, 1, 1, -1])
    assert np.signbit(got[4]) and not np.signbit(got[3])
    assert erf_f32(np.array(0.5, np.float32)).shape == ()
    assert erf_f32(np.zeros((2, 0), np.float32)).shape == (2, 0)
    t = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(erf_f32(t.T), erf_f32(t).T)  # non-contiguous input
    assert erf_f32(np.float16(1.0)).dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("mode", ["jit", "numpy"])
def test_erf_node_both_paths_against_math_erf_and_onnxruntime(mode, dtype, monkeypatch):
    """The Erf node on 200,001 points of [-6, 6] and special values, through numba's one pass
    (``_conv_jit.erf_array``, taken from ``_JIT_MIN`` elements) or the numpy passes of erf_f32:
    float32 within 2 ulp of math.erf (measured 1.03 and 1.48), float16 within one float16 ulp (both
    compute in float32 and round once), NaN / inf / -0 kept; and within TOL of onnxruntime."""
    import onnxruntime as ort
    from onnx import TensorProto

    import onnxpack
    from onnxpack.session.kernels import _act

    if mode == "numpy":
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    elif _act.jit() is None:
        pytest.skip("numba not installed")
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    node = helper.make_node("Erf", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, None)],
                              [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.925, 1e4, -6e4], dtype)
    x = np.concatenate([np.linspace(-6, 6, 200_001).astype(dtype), special])
    got = onnxpack.InferenceSession(model).run(None, {"x": x})[0]
    assert got.dtype == dtype and got.shape == x.shape
    want = np.array([math.erf(float(v)) if np.isfinite(v) else math.copysign(1.0, v) for v in x[:-8]])
    if dtype == np.float32:
        ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        nz = x[:-8] != 0
        assert (np.abs(got[:-8].astype(np.float64) - want)[nz] / ulp[nz]).max() <= 2.0
    else:
        assert np.abs(got[:-8].astype(np.float64) - want).max() <= np.spacing(np.float16(1.0))
    tail = got[-8:]
    assert np.isnan(tail[0])
    np.testing.assert_array_equal(tail[1:], np.array([1, -1, 0, 0, 1, 1, -1], dtype))
    assert np.signbit(tail[4]) and not np.signbit(tail[3])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), **tol)


# ------------------------------------------------------------------------------------------------
# ops vs onnxruntime
# ------------------------------------------------------------------------------------------------
from onnx import helper  # noqa: E402

from contrib_util import MS, check_all_paths  # noqa: E402

from onnxpack.errors import InvalidArgument  # noqa: E402
from onnxpack.session.kernels import KernelContext, contrib_norm, lookup  # noqa: E402

F32 = dict(rtol=1e-4, atol=1e-5)
F16 = dict(rtol=1e-2, atol=1e-2)
DTYPES = [np.float32, np.float16]
DT_IDS = ["f32", "f16"]


def tol(dtype):
    return F32 if np.dtype(dtype) == np.float32 else F16


def rand(rng, shape, dtype, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(dtype)


def node(op, inputs, outputs, domain=MS, **attrs):
    return helper.make_node(op, inputs, outputs, domain=domain, **attrs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize(
    "op,attrs,extra",
    [
        ("Gelu", {}, None),
        ("BiasGelu", {}, "B"),
        ("FastGelu", {}, None),
        ("FastGelu", {}, "bias"),
        ("QuickGelu", {}, None),
        ("QuickGelu", {"alpha": 1.3}, None),
    ],
    ids=["gelu", "biasgelu", "fastgelu", "fastgelu-bias", "quickgelu", "quickgelu-alpha"],
)
def test_activations(op, attrs, extra, dtype, jit_path):
    rng = np.random.default_rng(0)
    x = rand(rng, (2, 5, 16), dtype, 2.5)
    x.reshape(-1)[:4] = [0, -20, 20, 1e-3]  # saturated tails and near zero
    feeds = {"x": x}
    ins = ["x"]
    if extra:
        feeds[extra] = rand(rng, (16,), dtype)
        ins.append(extra)
    check_all_paths(node(op, ins, ["y"], **attrs), feeds, {}, tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_activations_bias_as_constant(dtype):
    """A constant bias (the usual case after fusion) is read as an initializer, not packed."""
    rng = np.random.default_rng(1)
    x, b = rand(rng, (3, 16), dtype), rand(rng, (16,), dtype)
    check_all_paths(node("BiasGelu", ["x", "b"], ["y"]), {"x": x}, {"b": b}, tol(dtype))
    check_all_paths(node("FastGelu", ["x", "b"], ["y"]), {"x": x}, {"b": b}, tol(dtype))


def _gelu64(v):
    return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_cuda_only_activations_against_formulas(dtype):
    """BiasAdd and BiasSplitGelu have no CPU kernel in onnxruntime: the oracle is the formula in
    float64, rounded to the dtype (float32: rtol 1e-5; float16: one ulp of rounding, rtol 1e-3)."""
    rng = np.random.default_rng(2)
    x, b, s = rand(rng, (2, 3, 8), dtype), rand(rng, (8,), dtype), rand(rng, (2, 3, 8), dtype)
    t = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-3, atol=1e-3)
    want = (x.astype(np.float64) + b + s).astype(dtype)
    check_all_paths(node("BiasAdd", ["x", "b", "s"], ["y"]), {"x": x, "s": s}, {"b": b}, t, want=[want])
    z = x.astype(np.float64) + b
    want = (z[..., :4] * _gelu64(z[..., 4:])).astype(dtype)
    check_all_paths(node("BiasSplitGelu", ["x", "b"], ["y"]), {"x": x}, {"b": b}, t, want=[want])


def _softmax64(z, axis):
    axes = tuple(range(axis, z.ndim))
    e = np.exp(z - z.max(axis=axes, keepdims=True))
    return e / e.sum(axis=axes, keepdims=True)


BIAS_SOFTMAX = [
    ("full-rank", 3, 1, (2, 3, 4, 5), (2, 1, 4, 5)),
    ("inner", 3, 1, (2, 3, 4, 5), (2, 5)),
    ("outer", 2, 0, (2, 3, 4, 5), (3, 4, 5)),
    ("axis-2-inner", 2, 1, (2, 3, 4, 5), (2, 4, 5)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", BIAS_SOFTMAX, ids=[c[0] for c in BIAS_SOFTMAX])
def test_bias_softmax(case, dtype):
    """CUDA-only in onnxruntime: the oracle is softmax(data + bias) in float64."""
    _, axis, inner, xs, bs = case
    rng = np.random.default_rng(3)
    x, b = rand(rng, xs, dtype, 3), rand(rng, bs, dtype, 3)
    b64 = b.astype(np.float64)
    if inner and len(bs) < len(xs):
        lead = len(bs) - (len(xs) - axis)
        b64 = b64.reshape(bs[:lead] + (1,) * (axis - lead) + bs[lead:])
    want = _softmax64(x.astype(np.float64) + b64, axis).astype(dtype)
    t = dict(rtol=1e-5, atol=1e-7) if dtype == np.float32 else dict(rtol=1e-3, atol=1e-4)
    n = node("BiasSoftmax", ["x", "b"], ["y"], axis=axis, is_inner_broadcast=inner)
    check_all_paths(n, {"x": x, "b": b}, {}, t, want=[want])


def test_bias_softmax_rejects_bias_that_does_not_broadcast():
    n = node("BiasSoftmax", ["x", "b"], ["y"], axis=1, is_inner_broadcast=0)
    k = lookup(MS, "BiasSoftmax", 1)(n, KernelContext(1, {MS: 1}))
    with pytest.raises(InvalidArgument, match="does not broadcast"):
        k.run(np.zeros((2, 3), np.float32), np.zeros((4,), np.float32))


# -- norms ---------------------------------------------------------------------------------------
SKIP_CASES = [
    ("3d", (2, 3, 16), (2, 3, 16), True, True),
    ("3d-nobeta-nobias", (2, 3, 16), (2, 3, 16), False, False),
    ("skip-1sh", (2, 3, 16), (1, 3, 16), True, False),
    ("skip-sh", (2, 3, 16), (3, 16), False, True),
    ("2d-tokens", (5, 16), (5, 16), True, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("outputs", [1, 4], ids=["y", "all-outputs"])
@pytest.mark.parametrize("case", SKIP_CASES, ids=[c[0] for c in SKIP_CASES])
def test_skip_layer_norm(case, outputs, dtype, jit_path):
    """Against onnxruntime on the JIT's row kernel (float32 sums, float16 widened), from the
    native code cache, and on numpy's path."""
    _, xs, ss, beta, bias = case
    rng = np.random.default_rng(4)
    feeds = {"x": rand(rng, xs, dtype, 2, 0.5), "s": rand(rng, ss, dtype)}
    consts = {"g": rand(rng, (16,), dtype)}
    ins = ["x", "s", "g", "", ""]
    if beta:
        consts["be"] = rand(rng, (16,), dtype)
        ins[3] = "be"
    if bias:
        consts["bi"] = rand(rng, (16,), dtype)
        ins[4] = "bi"
    while ins[-1] == "":
        ins.pop()
    outs = ["y", "mean", "inv", "sum"][:outputs]
    check_all_paths(node("SkipLayerNormalization", ins, outs, epsilon=1e-5), feeds, consts, tol(dtype))


def test_skip_layer_norm_non_finite_rows(jit_path):
    """Rows holding +inf, NaN or values whose squares overflow float32: the same NaN / finite
    pattern and values as onnxruntime on every path (JIT, native, numpy), and no numpy warning
    (the numpy path used to warn "invalid value encountered in subtract").  The mean output is
    left out: a row holding +inf has mean +inf here and NaN in onnxruntime (its reduction's
    artifact; the other outputs agree)."""
    import warnings

    rng = np.random.default_rng(8)
    x = rand(rng, (1, 4, 16), np.float32)
    x[0, 0, 3] = np.inf
    x[0, 1, 5] = np.nan
    x[0, 2, :] = 3e38  # a constant row: its centred values are 0, then the sum's overflow
    feeds = {"x": x, "s": rand(rng, (1, 4, 16), np.float32)}
    consts = {"g": rand(rng, (16,), np.float32), "be": rand(rng, (16,), np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = check_all_paths(node("SkipLayerNormalization", ["x", "s", "g", "be"], ["y", "", "inv", "sum"],
                                    epsilon=1e-5), feeds, consts, dict(rtol=1e-5, atol=1e-5))
    assert np.isnan(want[0][0, 0]).all() and np.isnan(want[0][0, 1]).all() and np.isfinite(want[0][0, 3]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("outputs", [["y"], ["y", "", "inv", "sum"], ["y", "mean", "inv", "sum"]],
                         ids=["y", "inv-sum", "all-outputs"])  # onnxruntime's mean output: zeros
@pytest.mark.parametrize("case", SKIP_CASES, ids=[c[0] for c in SKIP_CASES])
def test_skip_simplified_layer_norm(case, outputs, dtype, jit_path):
    """Every path (float32 with a skip of the input's shape runs ``_conv_jit.rms_rows`` unless
    numpy is asked for) against onnxruntime."""
    _, xs, ss, _, bias = case
    rng = np.random.default_rng(5)
    feeds = {"x": rand(rng, xs, dtype, 2, 0.5), "s": rand(rng, ss, dtype)}
    consts = {"g": rand(rng, (16,), dtype)}
    ins = ["x", "s", "g"]
    if bias:
        consts["bi"] = rand(rng, (16,), dtype)
        ins.append("bi")
    check_all_paths(node("SkipSimplifiedLayerNormalization", ins, outputs, epsilon=1e-6), feeds, consts, tol(dtype))


@pytest.mark.parametrize("rows", [1, 7])
def test_rms_kernel_matches_numpy_twin(rows, jit_path):
    """``_rms_jit`` (the JIT kernel) against the numpy formula in float64: the sum output is the
    float32 sum exactly, y and inv_std_var within a few float32 ulps; without a JIT it declines."""
    rng = np.random.default_rng(12)
    d = 896
    x = (rng.standard_normal((1, rows, d)) * 3).astype(np.float32)
    skip = rng.standard_normal((1, rows, d)).astype(np.float32)
    bias = rng.standard_normal(d).astype(np.float32)
    gamma = rng.standard_normal(d).astype(np.float32)
    got = contrib_norm._rms_jit(x, skip, gamma, bias, 1e-6, True)
    if jit_path == "numpy":
        assert got is None
        return
    y, inv, total = got
    s = (x + skip) + bias
    np.testing.assert_array_equal(total, s)
    ref_inv = 1.0 / np.sqrt(np.mean(s.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(inv, ref_inv, rtol=3e-7)
    np.testing.assert_allclose(y, s * ref_inv * gamma, rtol=1e-6, atol=1e-6)
    y2, inv2, none = contrib_norm._rms_jit(x, None, gamma, None, 1e-6, False)
    assert none is None
    np.testing.assert_allclose(y2, x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6) * gamma,
                               rtol=1e-6, atol=1e-6)
    # dtypes the kernel does not take: the numpy path runs instead
    assert contrib_norm._rms_jit(x.astype(np.float64), None, gamma, None, 1e-6, False) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("opset", [1, 17, 23], ids=["op1", "op17", "op23"])
@pytest.mark.parametrize("axis,shape", [(-1, (2, 3, 16)), (2, (2, 3, 4, 8)), (0, (3, 8))],
                         ids=["last", "axis2", "axis0"])
def test_simplified_layer_norm_default_domain(axis, shape, opset, dtype, jit_path):
    """onnxruntime registers SimplifiedLayerNormalization in the default domain at version 1, so
    any opset of the default domain resolves to it."""
    rng = np.random.default_rng(6)
    x = rand(rng, shape, dtype, 2, 0.3)
    scale = rand(rng, shape[axis:], dtype)
    n = node("SimplifiedLayerNormalization", ["x", "g"], ["y", "inv"], domain="", axis=axis, epsilon=1e-5)
    check_all_paths(n, {"x": x}, {"g": scale}, tol(dtype), opset=opset)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_layer_norm_before_opset17(dtype):
    """LayerNormalization at opset 13 (onnxruntime's default-domain contrib kernel from v1)."""
    rng = np.random.default_rng(7)
    x = rand(rng, (2, 3, 8), dtype, 2, 1)
    n = node("LayerNormalization", ["x", "g", "b"], ["y", "m", "inv"], domain="", axis=-1, epsilon=1e-5)
    check_all_paths(n, {"x": x}, {"g": rand(rng, (8,), dtype), "b": rand(rng, (8,), dtype)}, tol(dtype), opset=13)


EMBED_CASES = [
    ("all", True, True, None, 3),
    ("no-segment", False, True, None, 3),
    ("no-mask", True, False, None, 2),  # (onnxruntime rejects a 1-output node)
    ("position-ids", True, True, "bs", 3),
    ("position-ids-1s", False, False, "1s", 3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", EMBED_CASES, ids=[c[0] for c in EMBED_CASES])
def test_embed_layer_norm(case, dtype):
    _, segment, mask, pos_ids, n_out = case
    rng = np.random.default_rng(8)
    b, s, h, vocab = 2, 5, 16, 30
    ids = rng.integers(0, vocab, (b, s)).astype(np.int32)
    feeds = {"ids": ids}
    consts = {"w": rand(rng, (vocab, h), dtype), "p": rand(rng, (12, h), dtype)}
    ins = ["ids", "", "w", "p", "", "g", "be", "", ""]
    if segment:
        feeds["seg"] = rng.integers(0, 2, (b, s)).astype(np.int32)
        consts["se"] = rand(rng, (2, h), dtype)
        ins[1], ins[4] = "seg", "se"
    consts["g"], consts["be"] = rand(rng, (h,), dtype), rand(rng, (h,), dtype)
    if mask:
        feeds["m"] = np.array([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], np.int32)
        ins[7] = "m"
    if pos_ids:
        feeds["pos"] = rng.integers(0, 12, (b, s) if pos_ids == "bs" else (1, s)).astype(np.int32)
        ins[8] = "pos"
    while ins[-1] == "":
        ins.pop()
    outs = ["y", "mask_index", "sum"][:n_out]
    n = node("EmbedLayerNormalization", ins, outs, epsilon=1e-5)
    packs = 4 + segment if dtype == np.float32 else 0  # float32 tables: identity packs
    check_all_paths(n, feeds, consts, tol(dtype), packs=packs)


@pytest.mark.parametrize("segment", [True, False], ids=["segment", "no-segment"])
@pytest.mark.parametrize("qdt", [np.uint8, np.int8], ids=["u8", "s8"])
def test_qembed_layer_norm(qdt, segment):
    """QEmbedLayerNormalization (quantize_dynamic of an optimized BERT): 8-bit tables with their
    scales and zero points, against onnxruntime."""
    rng = np.random.default_rng(9)
    b, s, h, vocab = 2, 5, 16, 30
    info = np.iinfo(qdt)

    def q(shape):
        return rng.integers(info.min, info.max, shape, endpoint=True).astype(qdt)

    feeds = {"ids": rng.integers(0, vocab, (b, s)).astype(np.int32),
             "m": np.array([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], np.int32)}
    tables = {"w": q((vocab, h)), "p": q((12, h)), "se": q((2, h)), "g": q((h,)), "be": q((h,))}
    consts = dict(tables)
    for t in tables:
        consts[t + "_s"] = np.array(rng.random() * 0.02 + 0.005, np.float32)
        consts[t + "_z"] = np.array(rng.integers(info.min // 2, info.max // 2), qdt)
    order = ["w", "p", "se", "g", "be"]
    if not segment:
        order.remove("se")
        for k in ("se", "se_s", "se_z"):
            del consts[k]
    else:
        feeds["seg"] = rng.integers(0, 2, (b, s)).astype(np.int32)

    def name(t, suffix=""):
        return t + suffix if t in order else ""

    ins = ["ids", "seg" if segment else "", "w", "p", name("se"), "g", "be", "m"]
    ins += [name(t, "_s") for t in ("w", "p", "se", "g", "be")] + [name(t, "_z") for t in ("w", "p", "se", "g", "be")]
    n = node("QEmbedLayerNormalization", ins, ["y", "mask_index"], epsilon=1e-5)
    check_all_paths(n, feeds, consts, F32, packs=0)


def test_embed_layer_norm_rejects_out_of_range_ids():
    n = node("EmbedLayerNormalization", ["ids", "", "w", "p", "", "g", "b"], ["y"])
    k = lookup(MS, "EmbedLayerNormalization", 1)(n, KernelContext(1, {MS: 1}))
    w = np.zeros((4, 8), np.float32)
    with pytest.raises(InvalidArgument, match="input id 4 out of range"):
        k.run(np.array([[0, 4]], np.int32), None, w, w, None, np.ones(8, np.float32), np.zeros(8, np.float32))


# -- FusedMatMul -----------------------------------------------------------------------------------
FUSED_CASES = [
    ("plain-2d", {}, (3, 8), (8, 5)),
    ("3d-a-const-b", {}, (2, 3, 8), (8, 5)),
    ("transA-alpha", dict(transA=1, alpha=0.5), (2, 8, 3), (8, 5)),
    ("transB", dict(transB=1), (2, 3, 8), (5, 8)),
    ("both-alpha", dict(transA=1, transB=1, alpha=-1.25), (8, 3), (5, 8)),
    ("batched-b", dict(transB=1, alpha=0.125), (2, 4, 3, 8), (2, 4, 5, 8)),
    ("transBatchA", dict(transBatchA=1), (3, 2, 8), (2, 8, 5)),
    ("transBatchA-transA", dict(transBatchA=1, transA=1), (8, 2, 3), (2, 8, 5)),
    ("transBatchB", dict(transBatchB=1), (2, 3, 8), (8, 2, 5)),
    ("transBatch-4d", dict(transBatchA=1, transBatchB=1, transB=1), (3, 2, 4, 8), (5, 2, 4, 8)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_matmul(case, dtype):
    _, attrs, sa, sb = case
    rng = np.random.default_rng(9)
    a, b = rand(rng, sa, dtype), rand(rng, sb, dtype, 0.3)
    n = node("FusedMatMul", ["a", "b"], ["y"], **attrs)
    if len(sb) == 2:  # a constant 2-D B is packed
        check_all_paths(n, {"a": a}, {"b": b}, tol(dtype), packs=1)
    else:
        check_all_paths(n, {"a": a, "b": b}, {}, tol(dtype))


# -- FusedConv / FusedGemm (onnxruntime's extended optimizer writes them into saved models) -------
FUSED_ACTS = [
    ("relu", dict(activation="Relu")),
    ("clip", dict(activation="Clip", activation_params=[0.0, 6.0])),
    ("sigmoid", dict(activation="Sigmoid")),
    ("tanh", dict(activation="Tanh")),
    ("leakyrelu", dict(activation="LeakyRelu", activation_params=[0.2])),
    ("hardsigmoid", dict(activation="HardSigmoid", activation_params=[0.3, 0.4])),
    ("none", {}),
]


@pytest.mark.parametrize("with_z", [False, True], ids=["", "sum"])
@pytest.mark.parametrize("act", FUSED_ACTS, ids=[a[0] for a in FUSED_ACTS])
def test_fused_conv(act, with_z):
    """com.microsoft FusedConv: ``act(Conv(X, W, B) + Z)``, the weight packed; strides, pads and
    groups as Conv's."""
    rng = np.random.default_rng(21)
    x = rand(rng, (2, 4, 9, 9), np.float32)
    w, b = rand(rng, (6, 2, 3, 3), np.float32, 0.4), rand(rng, (6,), np.float32, 0.2)
    feeds = {"x": x}
    inputs = ["x", "w", "b"]
    if with_z:
        feeds["z"] = rand(rng, (2, 6, 5, 5), np.float32)
        inputs.append("z")
    n = node("FusedConv", inputs, ["y"], group=2, strides=[2, 2], pads=[1, 1, 1, 1], kernel_shape=[3, 3], **act[1])
    check_all_paths(n, feeds, {"w": w, "b": b}, F32, packs=1)


GEMM_ACTS = [a for a in FUSED_ACTS if a[0] not in ("clip", "none")]  # onnxruntime's FusedGemm needs one of these


@pytest.mark.parametrize("act", GEMM_ACTS, ids=[a[0] for a in GEMM_ACTS])
def test_fused_gemm(act):
    """com.microsoft FusedGemm: ``act(alpha * A @ B' + beta * C)`` (BERT's pooler as onnxruntime
    saves it: transB, Tanh); ``activation_alpha`` / ``_beta`` are the activation's parameters."""
    rng = np.random.default_rng(22)
    a, w, c = rand(rng, (3, 16), np.float32), rand(rng, (8, 16), np.float32, 0.3), rand(rng, (8,), np.float32)
    attrs = {k: v for k, v in act[1].items() if k != "activation_params"}
    for i, v in enumerate(act[1].get("activation_params", [])):
        attrs[("activation_alpha", "activation_beta")[i]] = v
    n = node("FusedGemm", ["a", "w", "c"], ["y"], transB=1, alpha=0.5, beta=1.5, **attrs)
    check_all_paths(n, {"a": a}, {"w": w, "c": c}, F32, packs=1)


def test_fused_activation_names_we_do_not_serve_are_declined():
    with pytest.raises(NotImplementedError):
        lookup(MS, "FusedGemm", 1)(node("FusedGemm", ["a", "w"], ["y"], activation="Selu"), KernelContext(1, {MS: 1}))


def test_model_optimized_by_onnxruntime_runs_natively(tmp_path):
    """onnxruntime's own graph optimizer (level EXTENDED, saved with optimized_model_filepath)
    rewrites plain ops into Gelu, FusedMatMul and SkipLayerNormalization; the saved model runs
    without any onnx.reference fallback and matches the unoptimized model in onnxruntime."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, numpy_helper

    import onnxpack

    rng = np.random.default_rng(20)
    d, ff = 16, 32
    w = {"w1": rand(rng, (d, ff), np.float32, 0.3), "b1": rand(rng, (ff,), np.float32, 0.1),
         "w2t": rand(rng, (d, ff), np.float32, 0.3), "g": rand(rng, (d,), np.float32),
         "be": rand(rng, (d,), np.float32),
         "sqrt2": np.array(math.sqrt(2), np.float32), "one": np.array(1, np.float32), "half": np.array(0.5, np.float32)}
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "w1"], ["h0"]), n("Add", ["h0", "b1"], ["h1"]),
        n("Div", ["h1", "sqrt2"], ["g0"]), n("Erf", ["g0"], ["g1"]), n("Add", ["g1", "one"], ["g2"]),
        n("Mul", ["h1", "g2"], ["g3"]), n("Mul", ["g3", "half"], ["act"]),
        n("Transpose", ["w2t"], ["w2"], perm=[1, 0]), n("MatMul", ["act", "w2"], ["h2"]),
        n("Add", ["x", "h2"], ["r"]),
        n("LayerNormalization", ["r", "g", "be"], ["y"], axis=-1, epsilon=1e-5),
        n("Transpose", ["y"], ["yt"], perm=[0, 2, 1]), n("MatMul", ["y", "yt"], ["z0"]),
        n("Mul", ["z0", "half"], ["z"]),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, d])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 5, 5])],
                              [numpy_helper.from_array(v, k) for k, v in w.items()])
    src, opt = tmp_path / "mlp.onnx", tmp_path / "mlp.opt.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(src))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(opt)
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    ops = {(nd.domain, nd.op_type) for nd in onnx.load(str(opt)).graph.node}
    assert {(MS, "Gelu"), (MS, "FusedMatMul"), (MS, "SkipLayerNormalization")} <= ops, ops
    x = {"x": rand(rng, (2, 5, d), np.float32)}
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (want,) = ort.InferenceSession(str(src), plain, providers=["CPUExecutionProvider"]).run(None, x)
    sess = onnxpack.InferenceSession(str(opt))
    assert sess.get_fallback_nodes() == []
    np.testing.assert_allclose(sess.run(None, x)[0], want, **F32)


# -- com.microsoft copies of standard tensor ops (contrib_tensor.py) and TransposeMatMul ------------
_X3 = np.random.default_rng(11).standard_normal((3, 4, 5)).astype(np.float32)
CONTRIB_TENSOR_CASES = [
    ("ExpandDims", {"x": _X3}, {"axis": np.array(-1, np.int32)}, ["y"], {}),
    ("ExpandDims", {"x": _X3}, {"axis": np.array(1, np.int32)}, ["y"], {}),
    ("Range", {"s": np.array(2, np.int32), "l": np.array(11, np.int32)}, {}, ["y"], {}),  # delta omitted
    ("Range", {"s": np.array(2.5, np.float32), "l": np.array(-1, np.float32), "d": np.array(-0.5, np.float32)}, {},
     ["y"], {}),
    ("Pad", {"x": _X3}, {"pads": np.array([[0, 1, 2, 1, 0, 1]], np.int64), "v": np.array([1.5], np.float32)}, ["y"],
     {}),
    ("Pad", {"x": _X3}, {"pads": np.array([0, 1, 2, 1, 0, 1], np.int64)}, ["y"], dict(mode="reflect")),
    ("Trilu", {"x": _X3}, {"k": np.array(1, np.int64)}, ["y"], dict(upper=0)),
    ("GatherND", {"x": _X3}, {"i": np.array([[0, 1], [2, 3]], np.int32)}, ["y"], {}),
    ("GatherND", {"x": _X3}, {"i": np.array([[[0], [2]]], np.int64)}, ["y"], {}),
    ("Unique", {"x": np.array([2.0, 1.0, 1.0, 3.0, 4.0, 3.0, -0.5], np.float32)}, {}, ["y", "idx", "counts"], {}),
    ("TransposeMatMul", {"a": _X3, "b": np.random.default_rng(12).standard_normal((3, 4, 6)).astype(np.float32)}, {},
     ["y"], dict(transA=1, alpha=0.5)),
]


@pytest.mark.parametrize("case", CONTRIB_TENSOR_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CONTRIB_TENSOR_CASES)])
def test_contrib_copies_of_standard_ops_match_onnxruntime(case):
    op, feeds, consts, outs, attrs = case
    n = node(op, list(feeds) + list(consts), outs, **attrs)
    check_all_paths(n, feeds, consts, F32, opset=17)


def test_contrib_unique_keeps_first_occurrence_order_for_integers():
    """(onnxruntime registers com.microsoft Unique for float only: the integer case against its
    definition.)"""
    x = np.array([5, 5, -1, 7, 5, -1, 0], np.int64)
    k = lookup(MS, "Unique", 1)(node("Unique", ["x"], ["y", "idx", "counts"]), KernelContext(1, {MS: 1}))
    y, idx, counts = k.run(x)
    np.testing.assert_array_equal(y, [5, -1, 7, 0])
    np.testing.assert_array_equal(y[idx], x)
    np.testing.assert_array_equal(counts, [3, 2, 1, 1])
    assert idx.dtype == counts.dtype == np.int64
