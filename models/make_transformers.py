"""Build encoder / vision models the way people ship them: torch.onnx.export + onnxruntime's optimizer.

Run with the side virtualenv (torch, transformers, onnxruntime)::

    /work/side/bin/python models/make_transformers.py                    # tiny committed fixtures
    /work/side/bin/python models/make_transformers.py --shape bert-base  # full size, into the cache

For each model: a random-weight module from a config (transformers ``*._from_config`` or, for
MobileNetV2, the small network written here), :func:`make_llm.randomize` with a fixed seed, then

* ``<name>-export``: ``torch.onnx.export(..., opset_version=17, dynamo=False)`` with dynamic batch
  (and sequence) axes: standard ONNX ops only;
* ``<name>-opt``: ``onnxruntime.transformers.optimizer.optimize_model(path, model_type=...,
  num_heads=..., hidden_size=...)`` on it, fp32 (the fused contrib ops: Attention,
  SkipLayerNormalization, EmbedLayerNormalization, BiasGelu, FastGelu, ...);
* ``<name>-opt-fp16``: the same optimizer output after
  ``convert_float_to_float16(keep_io_types=True)`` (what ``--float16`` does);
* ``<name>-dynamo``: torch's default exporter (``dynamo=True``, torch.export + onnxscript) at
  ``opset_version=23`` with SDPA attention and dynamic batch and sequence: ONNX's own
  Attention, RMSNormalization and RotaryEmbedding ops (opset 23) instead of their decomposition.

Choices the tools force (see models/README.md):

* The TorchScript exporter (``dynamo=False``) for ``export`` and ``opt``: onnxruntime's fusion
  patterns are written against TorchScript graphs.  The ``dynamo`` variant needs onnxscript in
  the side environment.
* ``attn_implementation="eager"``: with transformers 5's default SDPA attention the optimizer
  fuses no Attention at all (its patterns expect the explicit MatMul/Softmax/MatMul chain).

Every model is checked against torch (the exported fp32 graphs must match the module) and run in
onnxruntime with the sidecar's feed recipe; files go to a temp folder that is renamed into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fixtures  # noqa: E402  (sibling helper modules; models/ is not a package)
from make_llm import DEFAULT_CACHE, randomize  # noqa: E402

__all__ = ["MODELS", "build_model", "main"]

SEED = 20240601
OPSET = 17  # >= 14 as asked; 17 exports LayerNormalization as one op, which the optimizer fuses from
TX_FIXTURES = os.path.join(_fixtures.FIXTURES_DIR, "transformers")
VARIANTS = ("export", "opt", "opt-fp16", "dynamo")
DYNAMO_OPSET = 23  # the first opset with ONNX Attention / RMSNormalization / RotaryEmbedding


@dataclasses.dataclass(frozen=True)
class Spec:
    """One model family: how to build the torch module, its inputs, and how to optimize it."""

    name: str
    build: Callable[[dict[str, Any]], Any]  # config kwargs -> torch module (eval, wrapped)
    tiny: dict[str, Any]
    shapes: dict[str, dict[str, Any]]  # --shape name -> config kwargs
    inputs: Callable[[dict[str, Any]], dict[str, Any]]  # config -> feed recipe (dims, ranges, ...)
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    optimizer: Callable[[dict[str, Any]], dict[str, Any]] | None  # config -> optimize_model kwargs
    mirrors: str
    committed: tuple[str, ...] = VARIANTS  # the variants built by default, committed


# -- modules ----------------------------------------------------------------------------------------

def _hf(cls_name: str, config_cls: str, forward_keys: tuple[str, ...], outputs: int):
    """A builder for a transformers model whose forward takes ``forward_keys`` positionally.

    The wrapper exists because torch.onnx.export passes positional arguments and transformers 5
    forwards take keyword-only extras (``use_cache``), which collide with positional ones.
    """

    def build(cfg_kwargs: dict[str, Any]):
        import torch
        import transformers

        cfg = getattr(transformers, config_cls)(**cfg_kwargs)
        model = getattr(transformers, cls_name)._from_config(cfg, attn_implementation="eager")

        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *args):
                kwargs = dict(zip(forward_keys, args))
                if "use_cache" in type(self.inner).forward.__code__.co_varnames:
                    kwargs["use_cache"] = False
                out = self.inner(**kwargs, return_dict=False)
                return tuple(out[:outputs])

        return Wrapped(model).eval()

    return build


def _mobilenet_v2(cfg: dict[str, Any]):
    """MobileNetV2 (Sandler et al. 2018) in plain torch, the torchvision layout, no torchvision.

    ``blocks`` is the (expansion t, channels c, repeats n, stride s) table; ``width`` scales every
    channel count (rounded to a multiple of 8, as torchvision's ``_make_divisible``).
    """
    import torch
    from torch import nn

    def divisible(v: float, d: int = 8) -> int:
        new = max(d, int(v + d / 2) // d * d)
        return new + d if new < 0.9 * v else new

    def conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1, relu: bool = True):
        layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if relu:
            layers.append(nn.ReLU6(inplace=True))
        return nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, t: int):
            super().__init__()
            hidden = cin * t
            layers = [conv_bn(cin, hidden, 1, 1)] if t != 1 else []
            layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden), conv_bn(hidden, cout, 1, 1, relu=False)]
            self.conv = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.conv(x) if self.residual else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self, width: float, blocks, last_channel: int, num_classes: int):
            super().__init__()
            cin = divisible(32 * width)
            last = divisible(last_channel * max(1.0, width))
            layers = [conv_bn(3, cin, 3, 2)]
            for t, c, n, s in blocks:
                cout = divisible(c * width)
                for i in range(n):
                    layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                    cin = cout
            layers.append(conv_bn(cin, last, 1, 1))
            self.features = nn.Sequential(*layers)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

        def forward(self, x):
            x = self.features(x)
            x = nn.functional.adaptive_avg_pool2d(x, 1)
            return self.classifier(torch.flatten(x, 1))

    model = MobileNetV2(cfg["width"], cfg["blocks"], cfg["last_channel"], cfg["num_classes"])
    return model.eval()


def _randomize_batchnorm(model, seed: int) -> None:
    """Trained BatchNorm statistics (a fresh one has mean 0, var 1: folding it would be a no-op)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, m in sorted(model.named_modules()):
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))


_MOBILENET_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                     (6, 320, 1, 1))


def _text_recipe(cfg: dict[str, Any], vocab_key: str, with_token_types: bool) -> dict[str, Any]:
    recipe = {"dims": {"batch": 2, "sequence": 8}, "int_high": {"input_ids": cfg[vocab_key]},
              "mask_lengths": {"attention_mask": [8, 5]}}
    if with_token_types:
        recipe["int_high"]["token_type_ids"] = cfg.get("type_vocab_size", 2)
    return recipe


_BERT_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=64, type_vocab_size=2)

MODELS: dict[str, Spec] = {s.name: s for s in [
    Spec("bert", _hf("BertModel", "BertConfig", ("input_ids", "attention_mask", "token_type_ids"), 2),
         _BERT_TINY,
         {"bert-base": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                            intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2),
          # MiniLM-like: sentence-transformers/all-MiniLM-L6-v2's encoder (a small BERT); its tiny
          # version would be bert-tiny again, so it is built on demand only.
          "minilm-l6": dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2)},
         lambda cfg: _text_recipe(cfg, "vocab_size", True),
         ("input_ids", "attention_mask", "token_type_ids"), ("last_hidden_state", "pooler_output"),
         {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
          "token_type_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"},
          "pooler_output": {0: "batch"}},
         lambda cfg: dict(model_type="bert", num_heads=cfg["num_attention_heads"], hidden_size=cfg["hidden_size"]),
         "google-bert/bert-base-uncased"),
    Spec("gpt2", _hf("GPT2LMHeadModel", "GPT2Config", ("input_ids", "attention_mask"), 1),
         # vocab 256: the exporter writes the tied lm_head as a second, transposed copy of wte
         dict(vocab_size=256, n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=64, bos_token_id=255,
              eos_token_id=255),
         {"gpt2": dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)},
         lambda cfg: _text_recipe(cfg, "vocab_size", False),
         ("input_ids", "attention_mask"), ("logits",),
         {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
          "logits": {0: "batch", 1: "sequence"}},
         lambda cfg: dict(model_type="gpt2", num_heads=cfg["n_head"], hidden_size=cfg["n_embd"]),
         "openai-community/gpt2", committed=("opt", "opt-fp16")),
    Spec("vit", _hf("ViTForImageClassification", "ViTConfig", ("pixel_values",), 1),
         dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
              patch_size=8, num_labels=10),
         {"vit-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                           image_size=224, patch_size=16, num_labels=1000)},
         lambda cfg: {"dims": {"batch": 2}},
         ("pixel_values",), ("logits",),
         {"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
         lambda cfg: dict(model_type="vit", num_heads=cfg["num_attention_heads"], hidden_size=cfg["hidden_size"]),
         "google/vit-base-patch16-224", committed=("opt", "opt-fp16", "dynamo")),
    # A decoder-only LLM as torch's exporter writes it at opset 23 (grouped-query Attention,
    # RMSNormalization, RotaryEmbedding); onnxruntime's optimizer has no pass for it.
    Spec("llama", _hf("LlamaForCausalLM", "LlamaConfig", ("input_ids", "attention_mask"), 1),
         dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64),
         {},
         # batch 1: the exporter's RotaryEmbedding caches are (1, S, half) for any batch, which
         # onnxruntime 1.32 refuses above batch 1 (the spec asks for (B, S, half)); a right-padded
         # prompt
         lambda cfg: {"dims": {"batch": 1, "sequence": 8}, "int_high": {"input_ids": cfg["vocab_size"]},
                      "mask_lengths": {"attention_mask": [6]}},
         ("input_ids", "attention_mask"), ("logits",),
         {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
          "logits": {0: "batch", 1: "sequence"}},
         None, "meta-llama/Llama-3.2-1B", committed=("dynamo",)),
    # BERT's relatives the same optimizer serves (model_type "bert"): built on demand, not committed.
    *[Spec(name, _hf(cls, conf, keys, 1), dict(_BERT_TINY, **extra), {},
           (lambda types: lambda cfg: _text_recipe(cfg, "vocab_size", types))("token_type_ids" in keys),
           keys, ("last_hidden_state",),
           {**{k: {0: "batch", 1: "sequence"} for k in keys}, "last_hidden_state": {0: "batch", 1: "sequence"}},
           lambda cfg: dict(model_type="bert", num_heads=cfg.get("n_heads", cfg["num_attention_heads"]),
                            hidden_size=cfg.get("dim", cfg["hidden_size"])),
           hf, committed=())
      for name, cls, conf, keys, extra, hf in (
          ("distilbert", "DistilBertModel", "DistilBertConfig", ("input_ids", "attention_mask"),
           dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128), "distilbert/distilbert-base-uncased"),
          ("roberta", "RobertaModel", "RobertaConfig", ("input_ids", "attention_mask"),
           dict(max_position_embeddings=72, pad_token_id=1), "FacebookAI/roberta-base"),
          ("albert", "AlbertModel", "AlbertConfig", ("input_ids", "attention_mask", "token_type_ids"),
           dict(embedding_size=32), "albert/albert-base-v2"),
          ("electra", "ElectraModel", "ElectraConfig", ("input_ids", "attention_mask", "token_type_ids"),
           dict(embedding_size=32), "google/electra-small-discriminator"),
      )],
    # Other families the optimizer has a model_type for: built on demand; T5's encoder (relative
    # position bias, RMS norms fused into SkipSimplifiedLayerNormalization) committed.
    *[Spec(name, _hf(cls, conf, keys, 1), tiny, {},
           (lambda types: lambda cfg: _text_recipe(cfg, "vocab_size", types))("token_type_ids" in keys),
           keys, ("last_hidden_state",),
           {**{k: {0: "batch", 1: "sequence"} for k in keys}, "last_hidden_state": {0: "batch", 1: "sequence"}},
           (lambda mt: lambda cfg: dict(model_type=mt, num_heads=cfg.get("num_heads", cfg.get("num_attention_heads", cfg.get("encoder_attention_heads", 0))),
                                        hidden_size=cfg.get("d_model", cfg.get("hidden_size", 0))))(model_type),
           hf, committed=committed)
      for name, cls, conf, keys, tiny, model_type, hf, committed in (
          ("clip-text", "CLIPTextModel", "CLIPTextConfig", ("input_ids", "attention_mask"),
           dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64), "clip", "openai/clip-vit-base-patch32", ()),
          ("t5-encoder", "T5EncoderModel", "T5Config", ("input_ids", "attention_mask"),
           dict(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4), "t5", "google-t5/t5-small",
           ("opt",)),
          ("bart", "BartModel", "BartConfig", ("input_ids", "attention_mask"),
           dict(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64),
           "bart", "facebook/bart-base", ()),
          ("gpt-neox", "GPTNeoXModel", "GPTNeoXConfig", ("input_ids", "attention_mask"),
           dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64), "gpt_neox", "EleutherAI/pythia-70m", ()),
      )],
    # Tiny: width 0.25 and a shorter block table (every block kind: no expansion, stride 2,
    # residual repeats); the full table and 224x224 with --shape mobilenetv2.
    Spec("mobilenetv2", _mobilenet_v2,
         dict(width=0.25, blocks=((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 1, 2), (6, 96, 2, 1)),
              last_channel=128, num_classes=10, image_size=32),
         {"mobilenetv2": dict(width=1.0, blocks=_MOBILENET_BLOCKS, last_channel=1280, num_classes=1000,
                              image_size=224)},
         lambda cfg: {"dims": {"batch": 2}},
         ("input",), ("logits",),
         {"input": {0: "batch"}, "logits": {0: "batch"}},
         None,
         "torchvision mobilenet_v2", committed=("export",)),
]}


def _example_args(spec: Spec, cfg: dict[str, Any]):
    """Torch inputs for export and for the torch-vs-onnxruntime check (the recipe's feeds)."""
    import torch

    feeds = _fixtures.make_feeds(_input_specs(spec, cfg), spec.inputs(cfg), seed=1)
    return feeds, tuple(torch.from_numpy(feeds[n]) for n in spec.input_names)


def _input_specs(spec: Spec, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    if spec.name in ("vit", "mobilenetv2"):
        size = cfg["image_size"]
        return [{"name": spec.input_names[0], "dtype": "float", "shape": ["batch", 3, size, size]}]
    return [{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]} for n in spec.input_names]


# -- build ------------------------------------------------------------------------------------------

def _export_dynamo(spec: Spec, model, args, work: str) -> str:
    """``model`` through torch's default exporter at :data:`DYNAMO_OPSET`, SDPA attention (what
    ``scaled_dot_product_attention`` becomes: ONNX Attention), the spec's dynamic axes; the
    weights it writes to a side file are put back inside the model (a fixture is one file)."""
    import onnx
    import torch

    inner = getattr(model, "inner", model)
    if hasattr(inner, "set_attn_implementation"):
        inner.set_attn_implementation("sdpa")
    dims: dict[str, Any] = {}
    shapes = tuple({axis: dims.setdefault(name, torch.export.Dim(name)) for axis, name in spec.dynamic_axes[n].items()}
                   for n in spec.input_names)
    if hasattr(model, "inner"):  # the transformers wrapper's forward(*args): one spec for the varargs
        shapes = (shapes,)
    raw = os.path.join(work, "dynamo-raw.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, raw, input_names=list(spec.input_names), output_names=list(spec.output_names),
                          opset_version=DYNAMO_OPSET, dynamo=True, dynamic_shapes=shapes)
    out = os.path.join(work, "dynamo.onnx")
    onnx.save(onnx.load(raw), out)  # external data loaded, saved inline
    onnx.checker.check_model(out)
    return out


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {m.__name__: m.__version__ for m in (torch, transformers, onnxruntime, onnx)}


def _max_diff(model_path: str, feeds: dict[str, np.ndarray], expected: list[np.ndarray]) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    return float(max(np.max(np.abs(g.astype(np.float64) - e.astype(np.float64))) for g, e in zip(got, expected)))


def build_model(spec: Spec, cfg: dict[str, Any], name: str, out_root: str, variants: list[str]) -> list[dict]:
    """Export, optimize and convert one model; write each variant's folder and sidecar."""
    import onnx
    import torch
    from onnxruntime.transformers.optimizer import optimize_model

    torch.manual_seed(SEED)
    model = spec.build(cfg)
    randomize(model, SEED)
    if spec.name == "mobilenetv2":
        _randomize_batchnorm(model, SEED)
    feeds, args = _example_args(spec, cfg)
    with torch.no_grad():
        out = model(*args)
    expected = [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]
    results = []
    with tempfile.TemporaryDirectory(prefix=f"make_transformers-{name}-") as work:
        export_path = os.path.join(work, "export.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript exporter deprecation and tracer warnings
            torch.onnx.export(model, args, export_path, input_names=list(spec.input_names),
                              output_names=list(spec.output_names), dynamic_axes=spec.dynamic_axes,
                              opset_version=OPSET, dynamo=False, do_constant_folding=True)
        onnx.checker.check_model(export_path)
        paths = {"export": export_path}
        if "dynamo" in variants:
            paths["dynamo"] = _export_dynamo(spec, model, args, work)
        opt_kwargs = spec.optimizer(cfg) if spec.optimizer else None
        if opt_kwargs and ({"opt", "opt-fp16"} & set(variants)):
            opt = optimize_model(export_path, **opt_kwargs)
            fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
            paths["opt"] = os.path.join(work, "opt.onnx")
            opt.save_model_to_file(paths["opt"])
            if "opt-fp16" in variants:
                opt.convert_float_to_float16(keep_io_types=True)
                paths["opt-fp16"] = os.path.join(work, "opt-fp16.onnx")
                opt.save_model_to_file(paths["opt-fp16"])
        for variant in variants:
            if variant not in paths:
                continue
            out_path = os.path.join(out_root, f"{name}-{variant}")
            staged = _fixtures.staging_dir(out_path)
            try:
                model_path = os.path.join(staged, "model.onnx")
                shutil.copyfile(paths[variant], model_path)
                os.chmod(model_path, 0o644)
                inv = _fixtures.inventory(model_path)
                recipe = spec.inputs(cfg)
                check = _fixtures.ort_check(model_path, inv["inputs"], {"default": recipe})
                if "error" in check["default"]:
                    raise RuntimeError(f"{out_path}: onnxruntime cannot run it: {check['default']['error']}")
                check["max_abs_diff_vs_torch"] = _max_diff(model_path, feeds, expected)
                command = {
                    "dynamo": f"torch.onnx.export(model, args, opset_version={DYNAMO_OPSET}, dynamo=True, "
                              f"dynamic_shapes={{batch, sequence}}) after {spec.name}._from_config(cfg) with "
                              f"set_attn_implementation('sdpa'); weights saved inside the model",
                    "export": f"torch.onnx.export(model, args, opset_version={OPSET}, dynamo=False, "
                              f"dynamic_axes={{batch, sequence}}) after {spec.name}._from_config(cfg, "
                              f"attn_implementation='eager')" if spec.optimizer else
                              f"torch.onnx.export(model, args, opset_version={OPSET}, dynamo=False, "
                              f"dynamic_axes={{batch}})",
                }
                if opt_kwargs:
                    call = "optimize_model(export.onnx, " + ", ".join(f"{k}={v!r}" for k, v in opt_kwargs.items()) + ")"
                    command["opt"] = call
                    command["opt-fp16"] = call + "; convert_float_to_float16(keep_io_types=True)"
                files = _fixtures.dir_files(staged)
                sidecar = {
                    "sidecar_version": _fixtures.SIDECAR_VERSION,
                    "name": os.path.basename(out_path),
                    "kind": "transformers",
                    "producer": {"tool": {"export": "torch.onnx.export", "dynamo": "torch.onnx.export (dynamo)"}.get(
                                     variant, "onnxruntime optimizer"),
                                 "versions": _versions(), "script": "models/make_transformers.py"},
                    "command": command["dynamo"] if variant == "dynamo" else
                               " ; ".join(command[v] for v in VARIANTS[: VARIANTS.index(variant) + 1]),
                    "source": {"model": spec.name, "mirrors": spec.mirrors, "seed": SEED,
                               "config": {k: (list(map(list, v)) if k == "blocks" else v) for k, v in sorted(cfg.items())}},
                    "fused_ops": fused if variant not in ("export", "dynamo") and opt_kwargs else None,
                    "files": files,
                    "total_bytes": sum(f["bytes"] for f in files.values()),
                    "model_file": "model.onnx",
                    "inventory": inv,
                    "feeds": {"default": recipe},
                    "ort_check": check,
                }
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            _fixtures.replace_path(staged, out_path)
            _fixtures.write_json(out_path + ".json", sidecar)
            contrib = inv["ops"].get("com.microsoft", {})
            print(f"{sidecar['name']}: {sidecar['total_bytes']} bytes, max |onnxruntime - torch| = "
                  f"{check['max_abs_diff_vs_torch']:.2e}, com.microsoft {contrib}", flush=True)
            results.append(sidecar)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", choices=sorted(MODELS), help="default: all")
    p.add_argument("--variant", nargs="+", choices=VARIANTS,
                   help="default: each model's committed variants (the raw export of GPT-2 and ViT adds no op "
                        "bert-tiny-export lacks), all for --shape")
    p.add_argument("--shape", choices=sorted(s for m in MODELS.values() for s in m.shapes),
                   help="build a full-size random model for benchmarks")
    p.add_argument("--out", help=f"output folder (default: {os.path.relpath(TX_FIXTURES)}, or the cache for --shape)")
    p.add_argument("--cache-dir", default=os.environ.get("ONNXPACK_MODELS_CACHE", DEFAULT_CACHE),
                   help="where --shape models go (default: $ONNXPACK_MODELS_CACHE or %(default)s)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.shape:
        spec = next(m for m in MODELS.values() if args.shape in m.shapes)
        build_model(spec, spec.shapes[args.shape], args.shape, args.out or args.cache_dir,
                    args.variant or list(VARIANTS))
    else:
        out_root = args.out or TX_FIXTURES
        for name in args.model or [m for m in MODELS if MODELS[m].committed]:
            spec = MODELS[name]
            build_model(spec, spec.tiny, f"{name}-tiny", out_root, args.variant or list(spec.committed or VARIANTS))
        if out_root == TX_FIXTURES:
            _fixtures.update_readme()
    print(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
