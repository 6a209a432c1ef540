"""BatchNormalization, LayerNormalization, InstanceNormalization, LRN vs an oracle.

Oracle: onnx.reference, except LRN (onnx.reference 1.23 sums the window only for the first N
channels, looping over the batch axis) and LayerNormalization's float16 Mean/InvStdDev outputs
(the spec types them U = the stash type, float32; onnx.reference returns X's dtype), where
onnxruntime is the oracle.  Tolerances: float32 rtol 1e-4 / atol 1e-5; float16 rtol 1e-2 /
atol 1e-2 (we compute statistics in float32 and round once).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_util import assert_close, make_node, run_ort, run_native, run_reference

DTYPES = [np.float32, np.float16]
IDS = ["f32", "f16"]


def bn_inputs(rng, shape, dtype, stat_shape=None):
    c = shape[1]
    ss = stat_shape or (c,)
    return [
        rng.standard_normal(shape).astype(dtype),
        rng.standard_normal(ss).astype(dtype),
        rng.standard_normal(ss).astype(dtype),
        rng.standard_normal(ss).astype(dtype),
        (rng.random(ss) + 0.5).astype(dtype),
    ]


@pytest.mark.parametrize("dtype", DTYPES + [np.float64], ids=IDS + ["f64"])
@pytest.mark.parametrize("opset", [7, 9, 15], ids=["op7", "op9", "op15"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3), (1, 4, 6), (1, 2, 3, 4, 2)], ids=["4d", "2d", "3d", "5d"])
def test_batchnorm(shape, opset, dtype):
    """onnx.reference is the oracle at opset 15; at 7 and 9 it runs training mode (momentum's
    default makes it compute batch statistics), so onnxruntime (float32) is the oracle there."""
    inputs = bn_inputs(np.random.default_rng(0), shape, dtype)
    node = make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3)
    if opset >= 15:
        want = run_reference(node, inputs, opset)
    else:
        want = [w.astype(dtype) for w in run_ort(node, [i.astype(np.float32) for i in inputs], opset)]
        dtype = np.float32 if dtype == np.float64 else dtype  # the oracle ran in float32
    assert_close(run_native(node, inputs, opset), want, dtype)


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("acts", ["relu", "fakequant-relu", "none"])
@pytest.mark.parametrize("shape", [(1, 64, 40, 40), (2, 5, 7), (3, 300), (1, 7, 3, 4, 5)])
def test_batchnorm_fused_pass_is_the_unfused_bits(shape, acts, threads, monkeypatch):
    """BatchNormalization with its fused activations (``run_acts``: one JIT pass, split by
    channel rows over two threads for a large tensor) gives the bits of ``run`` and the
    activations applied after it by numpy, including a transposed (non-contiguous) input,
    signed zeros, NaN and infinities."""
    from onnxpack.session.kernels import KernelContext, _act, lookup
    from onnxpack.session.kernels._act import Activation

    if _act.jit() is None:
        pytest.skip("numba is not installed")
    monkeypatch.setenv("ONNXPACK_NUM_THREADS", threads)
    monkeypatch.setattr(_act, "_SPLIT_MACS", 1)
    rng = np.random.default_rng(len(shape) * 7 + shape[1])
    x, s, b, m, v = bn_inputs(rng, shape, np.float32)
    x = x * 4
    x.reshape(-1)[:5] = [0.0, -0.0, np.nan, np.inf, -np.inf]
    if len(shape) == 4:  # a view with other strides: the kernel works on a contiguous copy
        x = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    chain = {"relu": (Activation("relu"),), "none": (),
             "fakequant-relu": (Activation("fakequant", 0.05, -128.0 - 3, 127.0 - 3), Activation("relu"))}[acts]
    node = make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3)
    k = lookup("", "BatchNormalization", 15)(node, KernelContext(15, {"": 15}))
    for _ in range(3):  # the split tuner's samples: one thread and split alternate
        got = k.run_acts(chain, x, s, b, m, v)[0]
        want = _act.apply(k.run(x, s, b, m, v)[0].copy(), chain)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_batchnorm_opset6_attributes_and_spatial0():
    """Opset 6's is_test/spatial are accepted; spatial=0 takes per-activation statistics."""
    rng = np.random.default_rng(1)
    inputs = bn_inputs(rng, (2, 3, 4), np.float32, stat_shape=(3, 4))
    x, s, b, m, v = inputs
    node = make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], is_test=1, spatial=0, epsilon=1e-5)
    want = (x - m) / np.sqrt(v + 1e-5) * s + b
    assert_close(run_native(node, inputs, 6), [want], np.float32)
    node = make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], is_test=1, spatial=1)
    inputs = bn_inputs(rng, (2, 3, 4), np.float32)
    x, s, b, m, v = inputs
    want = (x - m[:, None]) / np.sqrt(v[:, None] + 1e-5) * s[:, None] + b[:, None]
    assert_close(run_native(node, inputs, 6), [want], np.float32)


def test_batchnorm_old_opset_optional_outputs_are_running_stats():
    inputs = bn_inputs(np.random.default_rng(5), (2, 3, 4), np.float32)
    node = make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], is_test=1)
    got = run_native(node, inputs, 6)
    assert len(got) == 3
    np.testing.assert_array_equal(got[1], inputs[3])
    np.testing.assert_array_equal(got[2], inputs[4])


def test_batchnorm_training_mode_is_left_to_fallback():
    from onnxpack.session.kernels import KernelContext, lookup

    node = make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1)
    with pytest.raises(NotImplementedError):
        lookup("", "BatchNormalization", 15)(node, KernelContext(15, {"": 15}))


def test_layernorm_float64_statistics_are_float32():
    """Mean and InvStdDev come out in the stash type, float32, for float64 X too (onnxruntime's;
    they were float64); SimplifiedLayerNormalization's inv_std_var likewise."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 6)) * 2).astype(np.float64)
    s = rng.standard_normal(6).astype(np.float64)
    for node, ins in ((make_node("LayerNormalization", ["x", "s"], ["y", "m", "i"], epsilon=1e-5), [x, s]),
                      (make_node("SimplifiedLayerNormalization", ["x", "s"], ["y", "i"], epsilon=1e-5), [x, s])):
        got = run_native(node, ins, 17)
        want = run_ort(node, ins, 17, optimize=False)
        assert [g.dtype for g in got] == [w.dtype for w in want] == [np.float64] + [np.float32] * (len(got) - 1)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)


LN_CASES = [("last", (2, 3, 8), -1), ("axis1", (2, 3, 4, 5), 1), ("axis0", (3, 4), 0), ("axis-2", (2, 3, 4, 5), -2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("outputs", [1, 3], ids=["Y", "Y-mean-invstd"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", LN_CASES, ids=[c[0] for c in LN_CASES])
def test_layernorm(case, bias, outputs, dtype):
    _, shape, axis = case
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    norm_shape = shape[axis:] if axis >= 0 else shape[len(shape) + axis :]
    inputs = [x, rng.standard_normal(norm_shape).astype(dtype)]
    names = ["x", "s"]
    if bias:
        inputs.append(rng.standard_normal(norm_shape).astype(dtype))
        names.append("b")
    node = make_node("LayerNormalization", names, ["y", "mean", "inv"][:outputs], axis=axis, epsilon=1e-4)
    got = run_native(node, inputs, 17)
    assert len(got) == outputs
    if dtype == np.float32:
        assert_close(got, run_reference(node, inputs, 17), dtype)
    else:
        want = run_ort(node, inputs, 17)
        assert [w.dtype for w in want] == [g.dtype for g in got]
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 7), (1, 2, 3, 4, 2)], ids=["4d", "3d", "5d"])
def test_instancenorm(shape, dtype):
    rng = np.random.default_rng(3)
    inputs = [
        (rng.standard_normal(shape) * 2).astype(dtype),
        rng.standard_normal(shape[1]).astype(dtype),
        rng.standard_normal(shape[1]).astype(dtype),
    ]
    node = make_node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-3)
    assert_close(run_native(node, inputs, 6), run_reference(node, inputs, 6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(
    "attrs", [dict(size=3), dict(size=4, alpha=1e-2, beta=0.5, bias=2.0), dict(size=1), dict(size=7)], ids=["s3", "s4-params", "s1", "s7"]
)
def test_lrn(attrs, dtype):
    """Oracle: the spec's formula written as a loop over channels (float64), and onnxruntime for
    odd sizes (it rejects even ones)."""
    x = (np.random.default_rng(4).standard_normal((2, 6, 4, 5)) * 3).astype(dtype)
    node = make_node("LRN", ["x"], ["y"], **attrs)
    got = run_native(node, [x], 13)
    size, alpha, beta, bias = attrs["size"], attrs.get("alpha", 1e-4), attrs.get("beta", 0.75), attrs.get("bias", 1.0)
    xd = x.astype(np.float64)
    sq = np.zeros_like(xd)
    for c in range(x.shape[1]):
        lo, hi = max(0, c - (size - 1) // 2), min(x.shape[1], c + -(-(size - 1) // 2) + 1)
        sq[:, c] = (xd[:, lo:hi] ** 2).sum(axis=1)
    want = (xd / (bias + alpha / size * sq) ** beta).astype(dtype)
    assert_close(got, [want], dtype)
    if size % 2:
        assert_close(got, run_ort(node, [x], 13), dtype)


# -- GroupNormalization (native; it ran onnx.reference's function, ~25x onnxruntime's time) -------
@pytest.mark.parametrize("opset,groups", [(18, 4), (18, 12), (21, 4), (21, 1)])
def test_group_normalization_matches_onnxruntime(opset, groups):
    from contrib_util import check_all_paths
    from onnx import helper as _h

    rng = np.random.default_rng(opset + groups)
    x = (rng.standard_normal((2, 12, 5, 6)) * 3 + 1).astype(np.float32)
    n_params = 12 if opset >= 21 else groups  # per channel from opset 21, per group before
    consts = {"sc": rng.standard_normal(n_params).astype(np.float32), "bi": rng.standard_normal(n_params).astype(np.float32)}
    node = _h.make_node("GroupNormalization", ["x", "sc", "bi"], ["y"], num_groups=groups, epsilon=1e-3)
    check_all_paths(node, {"x": x}, consts, dict(rtol=1e-5, atol=1e-5), opset=opset)


# -- LpNormalization (native: the builder's Qwen3.5 L2-normalizes queries and keys with it) -------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [-1, 0, 1, 2])
def test_lp_normalization_matches_onnxruntime(p, axis, dtype):
    """Slices whose norm is zero give zeros, as onnxruntime's kernel (onnx.reference: NaN)."""
    x = np.random.default_rng(5).standard_normal((2, 3, 5)).astype(dtype)
    x[0, 0] = 0
    x[:, :, 0] = 0
    node = make_node("LpNormalization", ["x"], ["y"], axis=axis, p=p)
    got = run_native(node, [x], 17)
    want = run_ort(node, [x], 17)
    assert_close(got, want, dtype)
    assert np.isfinite(got[0]).all()


def test_lp_normalization_refuses_other_norms():
    from onnxpack.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="p must be 1 or 2"):
        run_native(make_node("LpNormalization", ["x"], ["y"], p=3), [np.ones((2, 2), np.float32)], 17)
