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
