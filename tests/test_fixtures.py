"""The committed fixtures of models/fixtures: present, small, what their sidecars say, run by onnxruntime.

The fixtures are built by models/make_llm.py and models/make_transformers.py with tools the test
extra does not install (torch, transformers, onnxruntime-genai); these tests need only onnx,
numpy and onnxruntime.  Each fixture is a folder ``models/fixtures/<kind>/<name>/`` with a sidecar
``<name>.json`` beside it; ``models/_fixtures.py`` reads both and builds the sidecar's feeds.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import onnxruntime as ort
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODULE = "onnxpack_model_fixtures"  # a unique name: models/ is not a package


def _load_fixtures_module():
    module = sys.modules.get(_MODULE)
    if module is None:
        spec = importlib.util.spec_from_file_location(_MODULE, os.path.join(ROOT, "models", "_fixtures.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[_MODULE] = module
        spec.loader.exec_module(module)
    return module


fx = _load_fixtures_module()
SIDECARS = fx.read_sidecars()
IDS = [os.path.relpath(p, fx.FIXTURES_DIR)[: -len(".json")] for p, _ in SIDECARS]
MAX_BYTES = 1_000_000  # a fixture folder stays well under 1 MB: git history keeps every version

# What the other test suites and kernels rely on: LLMs from onnxruntime-genai's builder in every
# precision, BERT/GPT-2/ViT through onnxruntime's optimizer, a hand-written CNN export.
REQUIRED = {
    *(f"llm/{arch}-{v}" for arch in ("qwen2", "llama") for v in ("int4", "fp16", "fp32", "fp16-cuda")),
    "llm/phi3-int4", "llm/phi3-longrope-int4", "llm/gemma2-int4",
    # mixtures of experts (com.microsoft QMoE): gpt-oss (sinks, sliding window), LFM2-MoE
    "llm/gpt-oss-int4", "llm/lfm2-moe-int4",
    # Qwen3.5-MoE: gated DeltaNet linear attention (LinearAttention, recurrent + conv states), M-RoPE
    "llm/qwen3.5-moe-int4",
    "transformers/bert-tiny-export", "transformers/bert-tiny-opt", "transformers/bert-tiny-opt-fp16",
    "transformers/gpt2-tiny-opt", "transformers/gpt2-tiny-opt-fp16",
    "transformers/vit-tiny-opt", "transformers/vit-tiny-opt-fp16",
    "transformers/mobilenetv2-tiny-export",
    # torch's default (dynamo) exporter at opset 23: ONNX Attention, RMSNormalization, RotaryEmbedding
    "transformers/bert-tiny-dynamo", "transformers/vit-tiny-dynamo", "transformers/llama-tiny-dynamo",
}


def test_required_fixtures_are_committed():
    assert REQUIRED <= set(IDS), f"missing fixtures: {sorted(REQUIRED - set(IDS))}"


def test_every_fixture_folder_has_a_sidecar_and_back():
    folders = set()
    for kind in sorted(os.listdir(fx.FIXTURES_DIR)):
        kind_dir = os.path.join(fx.FIXTURES_DIR, kind)
        if os.path.isdir(kind_dir):
            folders |= {f"{kind}/{d}" for d in os.listdir(kind_dir) if os.path.isdir(os.path.join(kind_dir, d))}
    assert folders == set(IDS), (
        f"folders without a sidecar: {sorted(folders - set(IDS))}; sidecars without a folder: "
        f"{sorted(set(IDS) - folders)} (a leftover .tmp-/.old- folder is an interrupted build)"
    )


@pytest.mark.parametrize(("path", "sidecar"), SIDECARS, ids=IDS)
def test_fixture_is_small_and_is_what_its_sidecar_says(path, sidecar):
    folder = path[: -len(".json")]
    files = fx.dir_files(folder)
    assert files == sidecar["files"], "files changed since the sidecar was written: rebuild with models/make_*.py"
    total = sum(f["bytes"] for f in files.values())
    assert total < MAX_BYTES, f"{total} bytes"
    # Recomputed from the model: catches a model replaced by hand and a sidecar edited by hand.
    assert fx.inventory(os.path.join(folder, sidecar["model_file"])) == sidecar["inventory"]


def _session(model_path: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("path", "sidecar"), SIDECARS, ids=IDS)
def test_fixture_runs_in_onnxruntime_on_its_feeds(path, sidecar):
    model_path = os.path.join(path[: -len(".json")], sidecar["model_file"])
    assert sidecar["feeds"], "a fixture without a feed onnxruntime runs is no oracle"
    for mode, recipe in sorted(sidecar["feeds"].items()):
        sess = _session(model_path)
        outputs = sess.run(None, fx.make_feeds(sidecar["inventory"]["inputs"], recipe))
        expected = sidecar["ort_check"][mode]
        feeds = fx.make_feeds(sidecar["inventory"]["inputs"], recipe)
        total = feeds["attention_mask"].shape[1] if "attention_mask" in feeds else None
        for meta, value in zip(sess.get_outputs(), outputs):
            assert list(value.shape) == expected[meta.name]["shape"], (mode, meta.name)
            assert str(value.dtype) == expected[meta.name]["dtype"], (mode, meta.name)
            if meta.name.startswith("present") and value.ndim == 4 and total is not None:
                # A window-sized cache (gpt-oss, Gemma 2) defines its first ``total`` rows: the
                # others hold what onnxruntime found in the memory (NaN at times).
                value = value[:, :, :total]
            if np.issubdtype(value.dtype, np.floating):
                assert np.isfinite(value).all(), (mode, meta.name)


def test_feeds_are_deterministic_and_follow_the_recipe():
    inputs = [{"name": "ids", "dtype": "int64", "shape": ["b", "s"]},
              {"name": "mask", "dtype": "int64", "shape": ["b", "s"]},
              {"name": "pos", "dtype": "int64", "shape": ["b", "s"]},
              {"name": "x", "dtype": "float16", "shape": ["b", 3]}]
    recipe = {"dims": {"b": 2, "s": 4}, "int_high": {"ids": 7}, "mask_lengths": {"mask": [4, 1]},
              "arange": ["pos"], "arange_start": 3}
    a, b = fx.make_feeds(inputs, recipe), fx.make_feeds(inputs, recipe)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert a["ids"].shape == (2, 4) and a["ids"].min() >= 0 and a["ids"].max() < 7
    np.testing.assert_array_equal(a["mask"], [[1, 1, 1, 1], [1, 0, 0, 0]])
    np.testing.assert_array_equal(a["pos"], [[3, 4, 5, 6], [3, 4, 5, 6]])
    assert a["x"].dtype == np.float16 and a["x"].shape == (2, 3)
    with pytest.raises(KeyError, match="'s'"):
        fx.make_feeds(inputs, {"dims": {"b": 1}})
