"""Build LLMs the way people ship them: onnxruntime-genai's model builder on random HF checkpoints.

Run with the side virtualenv (torch, transformers, tokenizers, onnxruntime-genai)::

    /work/side/bin/python models/make_llm.py                      # tiny committed fixtures
    /work/side/bin/python models/make_llm.py --arch phi3 gemma --out /tmp/llm   # other families
    /work/side/bin/python models/make_llm.py --shape qwen2.5-0.5b  # full size, into the cache

For each architecture and variant (precision, execution provider): a config (``AutoConfig.for_model``), random weights from a
fixed seed (``AutoModelForCausalLM.from_config`` then :func:`randomize`), ``save_pretrained`` into a
scratch folder together with a byte-level BPE tokenizer trained here on :data:`TEXT` with the
``tokenizers`` package; then the builder, exactly as a user types it::

    python -m onnxruntime_genai.models.builder -m <hf name> -i <hf dir> -o <out> -p <precision> -e <ep> -c <cache>

Its output (``model.onnx``, ``model.onnx.data``, ``genai_config.json``, tokenizer files) is the
fixture, written to a temp folder and renamed into place; the sidecar ``<name>.json`` beside the
folder records the command, versions, op inventory and the feed recipe, after the model ran in
onnxruntime and, through onnxruntime-genai, generated a few tokens.

Why random weights are not left at HF's init: HF initialises biases to zero and norm weights to
one, and the builder drops all-zero biases (``torch.count_nonzero(bias) > 0``), so a fresh Qwen2
would export without the q/k/v bias every real Qwen2 has.  :func:`randomize` gives every weight a
scale a trained model has (linear weights N(0, 1/fan_in), norm weights 1 + N(0, 0.1²), biases
N(0, 0.1²)), so the export has the structure of a real checkpoint and attention is not uniform
(tests that compare attention outputs then see rotary, mask and cache errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fixtures  # noqa: E402  (a sibling helper module; models/ is not a package)

__all__ = ["ARCHS", "SHAPES", "VARIANTS", "build_llm", "main"]

SEED = 20240531
# A variant is "<precision>" (for -e cpu) or "<precision>-<ep>".  The builder targets CPU with
# int4/fp32; with -p fp16 -e cpu it makes MultiHeadAttention + RotaryEmbedding graphs (GQA is only
# chosen for fp32 on CPU), while the fp16 models people ship are built for GPUs (-e cuda: fp16
# GroupQueryAttention), which onnxruntime's CPU provider runs as well: both are fixtures.
VARIANTS = ("int4", "fp16", "fp32", "fp16-cuda")
_PRECISION_CHOICES = ("int4", "int8", "fp16", "bf16", "fp32")
_EP_CHOICES = ("cpu", "cuda", "dml", "webgpu")


def parse_variant(variant: str) -> tuple[str, str]:
    """``"fp16-cuda"`` -> ``("fp16", "cuda")``; ``"int4"`` -> ``("int4", "cpu")``."""
    precision, _, ep = variant.partition("-")
    ep = ep or "cpu"
    if precision not in _PRECISION_CHOICES or ep not in _EP_CHOICES:
        raise argparse.ArgumentTypeError(
            f"variant {variant!r}: expected <precision>[-<ep>] with precision in {_PRECISION_CHOICES} "
            f"and ep in {_EP_CHOICES}")
    return precision, ep
LLM_FIXTURES = os.path.join(_fixtures.FIXTURES_DIR, "llm")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "onnxpack", "models")
TINY_VOCAB = 512

# The tokenizer's training text: a few paragraphs are enough for a vocabulary of a few hundred
# merges on top of the 256 byte symbols.
TEXT = [
    "A pure Python inference session reads a model, finds a kernel for every node and runs the "
    "graph with numpy. Before the first run, every constant weight is packed into the layout its "
    "kernel computes fastest with: half precision weights become single precision, four bit blocks "
    "are unpacked, convolution filters are reshaped and matrices are transposed.",
    "Packing costs time at every process start, and every worker keeps its own copy. So the packed "
    "blobs are saved next to the model's external initializers, and the next load maps them back "
    "from the file: the operating system shares one physical copy between all the processes that "
    "read the same model, and a warm start packs nothing at all.",
    "The model builder of onnxruntime-genai turns a Hugging Face checkpoint into an ONNX decoder "
    "with grouped query attention, rotary embeddings, fused skip normalization and block quantized "
    "weights. Its output folder holds the model, its data file, the generation config and the "
    "tokenizer files, ready for a small chat loop on a laptop.",
    "The quick brown fox jumps over the lazy dog; then the dog sleeps again. Numbers such as 1, 22, "
    "333 and 4096 appear in configs, and so do names like hidden_size, num_heads and rope_theta. "
    "Questions? Answers! Lists, tables, code: def run(self, x): return x @ w + b.",
]

# The pre-tokenizer split regexes the real tokenizers use (tokenizer.json of Qwen2.5 and Llama 3).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class Arch:
    """One model family: its HF config for the tiny fixture and its tokenizer conventions."""

    name: str
    model_type: str  # HF model_type (AutoConfig.for_model)
    architecture: str  # HF architectures[0]: what the builder dispatches on
    hf_name: str  # the model whose structure the tiny one mirrors; passed as the builder's -m
    tiny: dict[str, Any]  # HF config kwargs of the tiny fixture (vocab comes from the tokenizer)
    special_tokens: tuple[str, ...]  # appended after the trained vocabulary, as real ones are
    bos: str | None
    eos: str
    pad: str | None
    split_regex: str = _QWEN2_SPLIT
    committed: tuple[str, ...] = ()  # the variants built by default, committed under models/fixtures/llm
    # How the checkpoint stores its experts' fused 3-D weights: (E, in, out) like gpt-oss, else
    # (E, out, in) like transformers' other MoE families (see :func:`randomize`).
    experts_in_first: bool = False
    # The transformers class of a multimodal checkpoint (its text decoder is what the builder
    # exports; ``tiny`` then holds a ``text_config``), else AutoModelForCausalLM.
    model_class: str | None = None


_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)

ARCHS: dict[str, Arch] = {a.name: a for a in [
    # Qwen2.5-0.5B-Instruct: q/k/v biases, tied embeddings, rope_theta 1e6, eps 1e-6.
    Arch("qwen2", "qwen2", "Qwen2ForCausalLM", "Qwen/Qwen2.5-0.5B-Instruct",
         dict(_TINY, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
              tie_word_embeddings=True, use_sliding_window=False),
         ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
         committed=VARIANTS),
    # Llama-3.2-1B-Instruct: no biases, tied embeddings, llama3 rope scaling, eps 1e-5.  The real
    # original_max_position_embeddings is 8192; 64 keeps it below the tiny context (transformers
    # insists) and still puts the 8 rotary frequencies of head_dim 16 in all three llama3 regimes
    # (wavelength < 64/4 kept, > 64 divided by factor, in between interpolated).
    Arch("llama", "llama", "LlamaForCausalLM", "meta-llama/Llama-3.2-1B-Instruct",
         dict(_TINY, rms_norm_eps=1e-5, tie_word_embeddings=True,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}),
         ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
         "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", split_regex=_LLAMA3_SPLIT, committed=VARIANTS),
    # Phi-3-mini-4k: fused qkv_proj / gate_up_proj in the checkpoint, untied (a plain Gather of the
    # fp32 embedding, a separate lm_head), default rope (max_position_embeddings ==
    # original_max_position_embeddings -> Phi3MiniModel).  Phi-3-mini has 32/32 heads; the tiny
    # one keeps GQA (4/2) like the others.
    Arch("phi3", "phi3", "Phi3ForCausalLM", "microsoft/Phi-3-mini-4k-instruct",
         dict(_TINY, rms_norm_eps=1e-5, tie_word_embeddings=False, original_max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"), None, "<|end|>", "<|endoftext|>",
         committed=("int4",)),
    # Phi-3.5-mini / Phi-4-mini style: LongRoPE (max_position_embeddings > original, per-frequency
    # short/long factors; the builder makes two cos/sin caches and picks one by sequence length),
    # partial rotary (Phi-4-mini rotates 3/4 of each head), GQA, tied embeddings (Phi-4-mini).
    Arch("phi3-longrope", "phi3", "Phi3ForCausalLM", "microsoft/Phi-4-mini-instruct",
         # head_dim 32 x 0.5 = 16 rotary dims: onnxruntime wants the cos cache width (8) a multiple
         # of 8 (Phi-4-mini: 128 x 0.75 / 2 = 48).  "type" duplicates "rope_type" because the
         # builder reads the older key (transformers 5 writes only "rope_type").
         dict(_TINY, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, tie_word_embeddings=True,
              original_max_position_embeddings=64, partial_rotary_factor=0.5,
              rope_parameters={"rope_type": "longrope", "type": "longrope", "rope_theta": 10000.0,
                               "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8],
                               "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
                               "original_max_position_embeddings": 64}),
         ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"), None, "<|end|>", "<|endoftext|>",
         committed=("int4",)),
    # Gemma-2b: gelu(tanh) MLP, norms as (1 + w), embeddings scaled by sqrt(hidden), tied.  Not
    # committed: Gemma 2 has all of its ops plus soft-capping and a sliding window.
    Arch("gemma", "gemma", "GemmaForCausalLM", "google/gemma-2b-it",
         dict(_TINY, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
              hidden_activation="gelu_pytorch_tanh"),
         ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<end_of_turn>", "<pad>"),
    # Gemma-2-2b: attention and final logit soft-capping, alternating sliding-window layers (layer 0
    # local: GroupQueryAttention with local_window_size and a window-sized cache).
    Arch("gemma2", "gemma2", "Gemma2ForCausalLM", "google/gemma-2-2b-it",
         dict(_TINY, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=32,
              query_pre_attn_scalar=16),
         ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<end_of_turn>", "<pad>",
         committed=("int4",)),
    # Qwen3-0.6B: q/k RMS norms per head before rotary (the builder's GroupQueryAttention gets them
    # as SimplifiedLayerNormalization of the packed Q and K), no q/k/v biases, tied, head_dim 16.
    Arch("qwen3", "qwen3", "Qwen3ForCausalLM", "Qwen/Qwen3-0.6B",
         dict(_TINY, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
         ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
         committed=("int4",)),
    # Granite-3.x: Llama with multipliers on the embeddings, residuals, attention and logits.
    Arch("granite", "granite", "GraniteForCausalLM", "ibm-granite/granite-3.1-2b-instruct",
         dict(_TINY, rms_norm_eps=1e-5, tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
              attention_multiplier=0.015625, logits_scaling=8.0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"), None, "<|end_of_text|>", "<|end_of_text|>",
         committed=("int4",)),
    # Mistral-7B-v0.1: sliding-window attention, untied, rope_theta 1e4.  Not committed: the builder
    # drops the window (transformers 5 configs of Mistral carry no layer_types, and the builder
    # marks only "sliding_attention" layers local), so the export is a Llama with an untied head.
    # Liquid's LFM2: short-convolution layers (com.microsoft::CausalConvWithState, a carried
    # convolution state in genai_config's past_conv_names) between attention layers.
    Arch("lfm2", "lfm2", "Lfm2ForCausalLM", "LiquidAI/LFM2-350M",
         dict(_TINY, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False, block_ff_dim=128,
              conv_L_cache=3, tie_word_embeddings=True),
         ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
         committed=("int4",)),
    # gpt-oss-20b: mixture of experts (com.microsoft QMoE / MoE: 4 experts, top 2, swiglu with
    # alpha 1.702, beta 1 and limit 7, expert biases), attention sinks, alternating sliding-window
    # (32) and full layers, yarn rope (original context 256: yarn's correction range needs
    # 0 < low < high < head_dim / 2 - 1), untied head.  The builder's int4/int8 read the checkpoint's
    # MXFP4 experts (see :func:`_gpt_oss_mxfp4`).
    Arch("gpt-oss", "gpt_oss", "GptOssForCausalLM", "openai/gpt-oss-20b",
         dict(_TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
              max_position_embeddings=1024, layer_types=["sliding_attention", "full_attention"],
              tie_word_embeddings=False, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 256, "rope_theta": 150000.0}),
         ("<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>"), None, "<|return|>", "<|endoftext|>",
         committed=("int4",), experts_in_first=True),
    # LFM2-8B-A1B: LFM2's conv + attention layers, the first one with a dense MLP, the others a
    # mixture of experts routed in the graph (sigmoid scores + a load-balancing bias, TopK,
    # QMoE's router_weights).
    Arch("lfm2-moe", "lfm2_moe", "Lfm2MoeForCausalLM", "LiquidAI/LFM2-8B-A1B",
         dict(_TINY, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_dense_layers=1,
              moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, use_expert_bias=True,
              norm_topk_prob=True, routed_scaling_factor=1.0, conv_L_cache=3, tie_word_embeddings=True),
         ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
         committed=("int4",)),
    # Qwen3.5-MoE (Qwen3.5-35B-A3B): layers of gated DeltaNet linear attention (com.microsoft
    # LinearAttention, LinearAttentionGate, GatedRMSNorm, CausalConvWithState with SiLU, carried
    # conv and recurrent states) and of gated full attention (GroupQueryAttention after
    # MRotaryEmbedding, 3-row position ids), a mixture of experts with a shared expert (QMoE,
    # GatedAdd).  The checkpoint is the multimodal one (a one-layer vision tower the builder skips).
    Arch("qwen3.5-moe", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen/Qwen3.5-35B-A3B",
         dict(text_config=dict(
             hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=256, layer_types=["linear_attention", "full_attention"],
             linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
             num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                              "mrope_section": [3, 3, 2], "mrope_interleaved": True}),
              tie_word_embeddings=False,
              vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                 patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)),
         ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
         committed=("int4",), model_class="Qwen3_5MoeForConditionalGeneration"),
    Arch("mistral", "mistral", "MistralForCausalLM", "mistralai/Mistral-7B-Instruct-v0.1",
         dict(_TINY, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=32,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         ("<unk>", "<s>", "</s>"), "<s>", "</s>", None),
]}

# Full-size shapes for benchmarks: the real configs (config.json of the named checkpoints), random
# weights stored in bfloat16 as the real checkpoints are; the tokenizer stays the small one (its
# special tokens get ids inside it, which the real vocabulary size leaves room for).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, vocab_size=151936, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
        use_sliding_window=False, max_window_layers=21)),
    "llama-3.2-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, vocab_size=128256,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}


# -- HF checkpoint ----------------------------------------------------------------------------------

def write_tokenizer(arch: Arch, hf_dir: str, vocab_size: int = TINY_VOCAB) -> dict[str, int]:
    """Train a byte-level BPE on :data:`TEXT`, save tokenizer.json + tokenizer_config.json.

    Returns the special token ids.  The trainer gets ``vocab_size - len(special)`` symbols and the
    special tokens are appended after them, so they get the highest ids, as in Qwen2 and Llama 3.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(arch.split_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(arch.special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    tok.add_special_tokens(list(arch.special_tokens))
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, more than {vocab_size}")
    tok.save(os.path.join(hf_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in arch.special_tokens}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": arch.bos,
        "eos_token": arch.eos,
        "pad_token": arch.pad,
        "add_bos_token": arch.bos is not None,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(hf_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in (("bos_token", arch.bos), ("eos_token", arch.eos), ("pad_token", arch.pad))
                   if v is not None}, f, indent=2, sort_keys=True)
    return ids


def randomize(model, seed: int, experts_in_first: bool = False) -> None:
    """Give every parameter trained-model-like random values (see the module docstring).

    Weights N(0, 1/fan_in) (fan_in: the input features of a Linear or Embedding row, in x kh x kw
    of a Conv, the first axis of a transformers ``Conv1D``, which stores [in, out], one expert's
    input features of a mixture of experts' fused (E, out, in) weights, or (E, in, out) with
    ``experts_in_first``); 1-D parameters (norm weights, biases) get N(0, 0.1²) added to their
    initial value.
    """
    import math

    import torch

    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for mod_name, module in sorted(model.named_modules()):
            for name, p in sorted(module.named_parameters(recurse=False)):
                if id(p) in seen:  # tied weights are drawn once
                    continue
                seen.add(id(p))
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                if p.ndim == 1:
                    p.copy_((p.float() + 0.1 * noise).to(p.dtype))  # norm weight (1 or 0 based) or bias
                    continue
                if type(module).__name__ == "Conv1D":
                    fan_in = p.shape[0]
                elif p.ndim == 3 and "experts" in mod_name.split(".")[-1:]:
                    fan_in = p.shape[1] if experts_in_first else p.shape[2]
                else:
                    fan_in = math.prod(p.shape[1:])
                p.copy_((noise / fan_in ** 0.5).to(p.dtype))


_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of the 8 codes (bit 3: sign)


def _gpt_oss_mxfp4(model) -> dict[str, Any]:
    """gpt-oss's experts as its released checkpoints store them, which the builder's int4/int8
    re-quantize from: MXFP4 (``<proj>_blocks`` (E, out, in/32, 16) uint8, two codes per byte, the
    even element low; ``<proj>_scales`` (E, out, in/32) power-of-two exponents + 127).  The random
    experts are rounded to those values in place, so the float checkpoint and its MXFP4 tensors
    are the same model."""
    import torch

    mags = torch.tensor(_FP4_E2M1)
    extra = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, proj)  # (E, in, out)
                w = p.transpose(-1, -2).float()
                e, n, k = w.shape
                x = w.reshape(e, n, k // 32, 32)
                exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
                scaled = x / torch.pow(2.0, exp).unsqueeze(-1)
                idx = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(-1)
                codes = idx.to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
                extra[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
                extra[f"model.layers.{i}.mlp.experts.{proj}_scales"] = (exp + 127).to(torch.uint8).contiguous()
                rounded = mags[idx] * torch.where(scaled < 0, -1.0, 1.0) * torch.pow(2.0, exp).unsqueeze(-1)
                p.copy_(rounded.reshape(e, n, k).transpose(-1, -2).to(p.dtype))
    return extra


def write_checkpoint(arch: Arch, hf_dir: str, overrides: dict[str, Any] | None = None,
                     dtype: str = "float32", seed: int = SEED) -> dict[str, Any]:
    """Config + random weights + tokenizer into ``hf_dir``; returns the config as saved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    os.makedirs(hf_dir, exist_ok=True)
    ids = write_tokenizer(arch, hf_dir)
    special = dict(bos_token_id=ids.get(arch.bos) if arch.bos else None, eos_token_id=ids[arch.eos],
                   pad_token_id=ids.get(arch.pad) if arch.pad else None)
    kwargs = json.loads(json.dumps(arch.tiny))  # a deep copy (text_config is a dict)
    if "text_config" in kwargs:  # a multimodal checkpoint: the vocabulary is its text decoder's
        kwargs["text_config"].update(vocab_size=TINY_VOCAB, **special)
    else:
        kwargs["vocab_size"] = TINY_VOCAB
    kwargs.update(overrides or {})
    kwargs.update(special, architectures=[arch.architecture])
    cfg = AutoConfig.for_model(arch.model_type, **kwargs)
    torch.manual_seed(seed)
    if arch.model_class:
        import transformers

        model = getattr(transformers, arch.model_class)._from_config(cfg, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    randomize(model, seed, arch.experts_in_first)
    mxfp4 = _gpt_oss_mxfp4(model) if arch.model_type == "gpt_oss" else None
    model.generation_config = GenerationConfig(**special)
    model.save_pretrained(hf_dir)
    if mxfp4:
        from safetensors.torch import load_file, save_file

        path = os.path.join(hf_dir, "model.safetensors")
        tensors = load_file(path)
        tensors.update(mxfp4)
        save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


# -- the builder ------------------------------------------------------------------------------------

def builder_argv(arch: Arch, hf_dir: str, out_dir: str, precision: str, ep: str, cache_dir: str,
                 extra_options: list[str] | None = None) -> list[str]:
    argv = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", arch.hf_name, "-i", hf_dir,
            "-o", out_dir, "-p", precision, "-e", ep, "-c", cache_dir]
    if extra_options:
        argv += ["--extra_options", *extra_options]
    return argv


def _offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    return env


def run_builder(argv: list[str], log_path: str) -> float:
    """Run the builder; its (long) log goes to ``log_path``. Returns the seconds it took."""
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=_offline_env(), cwd=os.path.dirname(log_path))
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"builder failed (exit {proc.returncode}): {' '.join(argv)}\n...{tail}")
    return seconds


def genai_smoke(model_dir: str, n_tokens: int = 8) -> dict[str, Any]:
    """Load the folder with onnxruntime-genai and greedily generate ``n_tokens`` from a prompt.

    max_length is at least the sliding window's cache capacity: onnxruntime-genai sizes a
    sliding-window layer's cache as min(window + slack, max_length), and onnxruntime's
    GroupQueryAttention refuses a cache smaller than the window (found on Gemma 2).
    """
    import onnxruntime_genai as og

    with open(os.path.join(model_dir, "genai_config.json"), encoding="utf-8") as f:
        window = json.load(f)["model"]["decoder"].get("sliding_window") or {}
    model = og.Model(model_dir)
    tokenizer = og.Tokenizer(model)
    prompt = "The model builder packs weights"
    ids = tokenizer.encode(prompt)
    params = og.GeneratorParams(model)
    capacity = window.get("window_size", 0) + window.get("cache_slack", 0)
    params.set_search_options(max_length=max(len(ids) + n_tokens, capacity), do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    for _ in range(n_tokens):
        if gen.is_done():
            break
        gen.generate_next_token()
    seq = list(gen.get_sequence(0))
    return {"onnxruntime_genai": og.__version__, "prompt": prompt, "prompt_ids": [int(i) for i in ids],
            "generated_ids": [int(i) for i in seq[len(ids):]], "decoded": tokenizer.decode(seq[len(ids):])}


def llm_feed_recipes(genai: dict[str, Any], hf_config: dict[str, Any], seq: int = 5,
                     past: int = 4, capacity: int = 16) -> dict[str, dict[str, Any]]:
    """Feeds of the steps a generation loop runs (batch 1), as :func:`_fixtures.make_feeds` recipes.

    ``prefill``: ``seq`` prompt tokens, empty cache.  ``decode``: one token after ``past`` cached
    ones (random cache contents).  ``chunk``: ``seq`` tokens after ``past`` cached ones (chunked
    prefill, or a multi-token step).  ``decode_long``, for LongRoPE models only: one token after
    more than ``original_max_position_embeddings`` cached ones, where the builder's ``If`` switches
    to the long cos/sin caches.  ``decode_shared``, for models whose genai_config says
    ``past_present_share_buffer`` (GroupQueryAttention): one token after ``past`` cached ones held
    in a cache buffer of ``capacity`` positions, the way onnxruntime-genai runs them (past and
    present are one max_length buffer; the attention mask gives the valid length).  Its present
    outputs are meaningful only on their first ``present_valid_length`` positions (onnxruntime
    zero-fills the rest when it allocates present itself; onnxruntime-genai aliases it to past).
    :func:`build_llm` keeps only the recipes onnxruntime runs.
    """
    dec = genai["model"]["decoder"]
    inputs = dec["inputs"]
    # Sliding-window layers (Gemma 2/3) keep a window-sized cache that is always passed whole
    # (GroupQueryAttention's sliding_window_cache=1 refuses a smaller one): its capacity is the
    # window plus the builder's slack, whatever the step; the attention mask says what is valid.
    window = dec.get("sliding_window") or {}
    sliding = window.get("window_size", 0) + window.get("cache_slack", 0) if window.get("layers") else None

    def recipe(s: int, p: int) -> dict[str, Any]:
        return {
            "dims": {"batch_size": 1, "sequence_length": s, "past_sequence_length": p,
                     "total_sequence_length": p + s, "kv_cache_dim": dec["head_size"],
                     **({"past_sliding_length": sliding, "total_sliding_length": sliding} if sliding else {})},
            "int_high": {inputs["input_ids"]: genai["model"]["vocab_size"]},
            "ones": [inputs["attention_mask"]] if "attention_mask" in inputs else [],
            "arange": [inputs["position_ids"]] if "position_ids" in inputs else [],
            "arange_start": p,
        }

    recipes = {"prefill": recipe(seq, 0), "decode": recipe(1, past), "chunk": recipe(seq, past)}
    if genai["search"].get("past_present_share_buffer"):
        shared = recipe(1, past)
        shared["dims"] = dict(shared["dims"], past_sequence_length=capacity)
        shared["present_valid_length"] = past + 1
        recipes["decode_shared"] = shared
    original = hf_config.get("original_max_position_embeddings")
    if original and original < hf_config["max_position_embeddings"]:
        recipes["decode_long"] = recipe(1, original + 2)
    return recipes


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxruntime_genai
    import tokenizers
    import torch
    import transformers

    return {m.__name__: m.__version__ for m in (onnxruntime_genai, onnxruntime, onnx, torch, transformers, tokenizers)}


def build_llm(arch: Arch, variant: str, out_path: str, *, hf_dir: str, hf_config: dict[str, Any],
              work_dir: str, extra_options: list[str] | None = None, smoke: bool = True) -> dict[str, Any]:
    """Run the builder on a written checkpoint into ``out_path`` (replaced), write the sidecar."""
    precision, ep = parse_variant(variant)
    staged = _fixtures.staging_dir(out_path)
    try:
        cache = os.path.join(work_dir, "builder-cache")
        argv = builder_argv(arch, hf_dir, staged, precision, ep, cache, extra_options)
        run_builder(argv, os.path.join(work_dir, f"builder-{variant}.log"))
        shutil.rmtree(cache, ignore_errors=True)
        with open(os.path.join(staged, "genai_config.json"), encoding="utf-8") as f:
            genai = json.load(f)
        model_path = os.path.join(staged, genai["model"]["decoder"]["filename"])
        inv = _fixtures.inventory(model_path)
        feeds = llm_feed_recipes(genai, hf_config)
        check = _fixtures.ort_check(model_path, inv["inputs"], feeds)
        if "error" in check["prefill"]:
            raise RuntimeError(f"onnxruntime cannot run the prefill feed: {check['prefill']['error']}")
        # A feed onnxruntime refuses is no oracle for tests: drop it, keep the reason in the sidecar.
        feeds = {mode: r for mode, r in feeds.items() if "error" not in check[mode]}
        # onnxruntime-genai opens a model with the provider its genai_config names: only CPU here.
        # Its failure is a finding about the builder's output, recorded, not a reason to drop it.
        smoke_result = None
        if smoke and ep == "cpu":
            try:
                smoke_result = genai_smoke(staged)
            except Exception as exc:  # onnxruntime-genai raises its own types
                smoke_result = {"error": " ".join(str(exc).split())[:600]}
        files = _fixtures.dir_files(staged)
        shown = ["python", "-m", "onnxruntime_genai.models.builder", "-m", arch.hf_name, "-i", "<hf_dir>",
                 "-o", "<out>", "-p", precision, "-e", ep, "-c", "<cache>"]
        if extra_options:
            shown += ["--extra_options", *extra_options]
        sidecar = {
            "sidecar_version": _fixtures.SIDECAR_VERSION,
            "name": os.path.basename(out_path),
            "kind": "llm",
            "producer": {"tool": "onnxruntime-genai builder", "versions": _versions(),
                         "script": "models/make_llm.py"},
            "command": " ".join(shown),
            "source": {"arch": arch.name, "mirrors": arch.hf_name, "seed": SEED, "hf_config": {
                k: hf_config[k] for k in sorted(hf_config) if k not in ("transformers_version", "dtype")}},
            "files": files,
            "total_bytes": sum(f["bytes"] for f in files.values()),
            "model_file": genai["model"]["decoder"]["filename"],
            "inventory": inv,
            "feeds": feeds,
            "ort_check": check,
            "genai_smoke": smoke_result,
        }
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    _fixtures.replace_path(staged, out_path)
    return sidecar


def build_arch(arch: Arch, variants: list[str], out_root: str, *, overrides: dict[str, Any] | None = None,
               dtype: str = "float32", name: str | None = None, smoke: bool = True) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory(prefix=f"make_llm-{arch.name}-") as work:
        hf_dir = os.path.join(work, "hf")
        t0 = time.perf_counter()
        hf_config = write_checkpoint(arch, hf_dir, overrides, dtype)
        print(f"{arch.name}: checkpoint written in {time.perf_counter() - t0:.1f}s", flush=True)
        for variant in variants:
            out_path = os.path.join(out_root, f"{name or arch.name}-{variant}")
            t0 = time.perf_counter()
            try:
                sc = build_llm(arch, variant, out_path, hf_dir=hf_dir, hf_config=hf_config, work_dir=work,
                               smoke=smoke)
            except Exception as exc:  # report and go on: the point of --arch is to learn what fails
                print(f"{arch.name}-{variant}: FAILED: {exc}", flush=True)
                results.append({"name": os.path.basename(out_path), "error": str(exc)})
                continue
            _fixtures.write_json(out_path + ".json", sc)
            contrib = sc["inventory"]["ops"].get("com.microsoft", {})
            print(f"{sc['name']}: {sc['total_bytes']} bytes, built and checked in {time.perf_counter() - t0:.1f}s, "
                  f"com.microsoft {contrib}, genai: {sc['genai_smoke'] and sc['genai_smoke'].get('generated_ids', 'FAILED')}",
                  flush=True)
            results.append(sc)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", choices=sorted(ARCHS),
                   help="families to build (default: the committed ones, " +
                        ", ".join(a.name for a in ARCHS.values() if a.committed) + ")")
    p.add_argument("--variant", nargs="+", type=lambda v: parse_variant(v) and v, default=None,
                   help="<precision>[-<ep>] builds (-p precision -e ep); default: each family's committed "
                        "variants (all of " + " ".join(VARIANTS) + " for a family with none), int4 for --shape")
    p.add_argument("--out", help=f"output folder (default: {os.path.relpath(LLM_FIXTURES)}, or the cache for --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="build a full-size random model for benchmarks")
    p.add_argument("--cache-dir", default=os.environ.get("ONNXPACK_MODELS_CACHE", DEFAULT_CACHE),
                   help="where --shape models go (default: $ONNXPACK_MODELS_CACHE or %(default)s)")
    p.add_argument("--no-smoke", action="store_true", help="skip the onnxruntime-genai generation check")
    args = p.parse_args(argv)

    if args.shape:
        arch_name, overrides = SHAPES[args.shape]
        out_root = args.out or args.cache_dir
        results = build_arch(ARCHS[arch_name], args.variant or ["int4"], out_root, overrides=overrides,
                             dtype="bfloat16", name=args.shape, smoke=not args.no_smoke)
    else:
        archs = args.arch or [a.name for a in ARCHS.values() if a.committed]
        out_root = args.out or LLM_FIXTURES
        results = []
        for name in archs:
            variants = args.variant or list(ARCHS[name].committed or VARIANTS)
            results += build_arch(ARCHS[name], variants, out_root, smoke=not args.no_smoke)
        if out_root == LLM_FIXTURES:
            _fixtures.update_readme()
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
