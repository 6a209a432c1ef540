"""Text generation with a decoder exported by onnxruntime-genai's model builder.

The builder writes a folder with ``model.onnx`` (+ data), ``genai_config.json`` and tokenizer
files.  :class:`Generator` reads the config (input/output names, layers, KV heads, head size, eos,
context length, search defaults), creates one :class:`~onnxpack.InferenceSession` and drives it:
a prefill step for the prompt, then one step per new token.

The KV cache lives in preallocated buffers of the model's full length (onnxruntime-genai's
``past_present_share_buffer`` layout: ``(batch, kv_heads, max_length, head_size)``).  Each step
binds every ``present_*`` output to the very buffer it passes as the matching ``past_*`` input
(``InferenceSession.io_binding``), so GroupQueryAttention writes only the new rows into it: a
decode step does no copy of the cache and its time stays flat as the context grows.  Models whose
attention is not GroupQueryAttention (the builder's fp16 CPU graphs use MultiHeadAttention with a
growing cache) get their ``present_*`` back as new arrays, which become the next ``past_*``.
Layers the config lists under ``sliding_window`` (Gemma-2's local attention) keep a cache of
``window_size`` rows instead, in either layout.  Layers without attention have no KV cache but
fixed-size states carried from step to step the same way: a convolution state (LFM2's short
convolutions, Qwen3.5's linear attention: ``past_conv_names`` / ``present_conv_names``) and a
recurrent state (Qwen3.5's gated DeltaNet: ``past_recurrent_names`` / ``present_recurrent_names``).
Which layers have which is read off the model's inputs (the config's ``layer_types``, where
present, must agree).  Position ids of three rows (Qwen-VL's multimodal rotary positions) get the
text positions in every row.

Tokenization needs the optional ``tokenizers`` package (``pip install onnxpack[genai]``); token ids
work without it.

    from onnxpack.generate import Generator
    gen = Generator("qwen2-int4/")
    for token in gen.generate([1, 2, 3], max_new_tokens=16):
        print(token)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from onnxpack.errors import InvalidArgument, ModelLoadError
from onnxpack.session._memory import return_freed_heap

__all__ = ["GenAIConfig", "Generator", "SearchOptions", "sample_token"]

logger = logging.getLogger(__name__)

_MAX_CONFIG_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How the next token is chosen (onnxruntime-genai's ``search`` section)."""

    max_length: int = 2048
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> None:
        if self.max_length < 1:
            raise InvalidArgument(f"max_length must be >= 1, got {self.max_length}")
        if self.temperature <= 0:
            raise InvalidArgument(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class GenAIConfig:
    """What the generate loop needs from ``genai_config.json``."""

    folder: str
    filename: str
    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    past_key: str  # name pattern with %d
    past_value: str
    logits: str
    present_key: str
    present_value: str
    layers: int
    kv_heads: int
    head_size: int
    eos: tuple[int, ...]
    pad: int | None
    bos: int | None
    context_length: int
    share_buffer: bool
    search: SearchOptions
    # Layers whose attention keeps a sliding-window cache (the builder's "sliding_window"
    # section, Gemma-2's local layers): their past is a buffer of window_size rows.
    sliding_layers: frozenset[int] = frozenset()
    window_size: int = 0
    # Layers without attention (``layer_types`` "conv": LFM2) carry a convolution state instead.
    conv_layers: frozenset[int] = frozenset()
    past_conv: str | None = None
    present_conv: str | None = None
    # Qwen3.5's linear-attention layers: a recurrent state too (the Generator finds which layers
    # have one among the model's inputs).
    past_recurrent: str | None = None
    present_recurrent: str | None = None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if i not in self.conv_layers)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> GenAIConfig:
        folder = os.fspath(folder)
        path = os.path.join(folder, "genai_config.json")
        try:
            if os.path.getsize(path) > _MAX_CONFIG_BYTES:
                raise ModelLoadError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes: not a genai config")
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except OSError as e:
            raise ModelLoadError(f"cannot read {path!r}: {e.strerror}") from e
        except ValueError as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
        try:
            model = raw["model"]
            dec = model["decoder"]
            ins, outs = dec["inputs"], dec["outputs"]
            eos = model.get("eos_token_id", [])
            eos = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            search = raw.get("search", {})
            context = int(model.get("context_length", search.get("max_length", 2048)))
            sliding = dec.get("sliding_window") or {}
            window = int(sliding.get("window_size", 0)) if sliding else 0
            sliding_layers = frozenset(int(i) for i in sliding.get("layers", ())) if window > 0 else frozenset()
            types = dec.get("layer_types") or ()
            conv_layers = frozenset(i for i, t in enumerate(types) if t == "conv")
            past_conv, present_conv = ins.get("past_conv_names"), outs.get("present_conv_names")
            if conv_layers and not (past_conv and present_conv):
                raise KeyError("past_conv_names / present_conv_names (layer_types lists conv layers)")
            return cls(
                folder=folder,
                filename=str(dec.get("filename", "model.onnx")),
                input_ids=str(ins.get("input_ids", "input_ids")),
                attention_mask=ins.get("attention_mask"),
                position_ids=ins.get("position_ids"),
                past_key=str(ins["past_key_names"]),
                past_value=str(ins["past_value_names"]),
                logits=str(outs.get("logits", "logits")),
                present_key=str(outs["present_key_names"]),
                present_value=str(outs["present_value_names"]),
                layers=int(dec["num_hidden_layers"]),
                kv_heads=int(dec["num_key_value_heads"]),
                head_size=int(dec["head_size"]),
                eos=eos,
                pad=None if model.get("pad_token_id") is None else int(model["pad_token_id"]),
                bos=None if model.get("bos_token_id") is None else int(model["bos_token_id"]),
                context_length=context,
                share_buffer=bool(search.get("past_present_share_buffer", False)),
                search=SearchOptions(
                    max_length=min(int(search.get("max_length", context)), context),
                    do_sample=bool(search.get("do_sample", False)),
                    temperature=float(search.get("temperature", 1.0)),
                    top_k=int(search.get("top_k", 0)),
                    top_p=float(search.get("top_p", 1.0)),
                ),
                sliding_layers=sliding_layers,
                window_size=window,
                conv_layers=conv_layers,
                past_conv=None if past_conv is None else str(past_conv),
                present_conv=None if present_conv is None else str(present_conv),
                past_recurrent=None if ins.get("past_recurrent_names") is None else str(ins["past_recurrent_names"]),
                present_recurrent=(None if outs.get("present_recurrent_names") is None
                                   else str(outs["present_recurrent_names"])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: missing or invalid field ({type(e).__name__}: {e})") from e


def sample_token(logits: np.ndarray, options: SearchOptions, rng: np.random.Generator | None) -> int:
    """The next token from one row of logits: argmax, or a sample after temperature, top-k and
    top-p (nucleus) filtering."""
    if not options.do_sample:  # the same index as in float64 (the conversion is exact), without the copy
        return int(np.argmax(np.asarray(logits).reshape(-1)))
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    z = logits / options.temperature
    if options.top_k and options.top_k < z.size:
        kth = np.partition(z, -options.top_k)[-options.top_k]
        z = np.where(z < kth, -np.inf, z)
    z = z - np.max(z)
    p = np.exp(z)
    p /= p.sum()
    if options.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, options.top_p) + 1)]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(p.size, p=p))


class Generator:
    """A decoder session with its KV cache, driven token by token (see the module docstring).

    Args:
        folder: the builder's output folder.
        sess_options: :class:`~onnxpack.SessionOptions` for the session.
        max_length: prompt + generated tokens at most (default: the config's).
        prepacked_weights_container: shared with other sessions of the same model.
    """

    def __init__(self, folder: str | os.PathLike, sess_options: Any = None, *, max_length: int | None = None,
                 prepacked_weights_container: Any = None) -> None:
        from onnxpack import InferenceSession

        self.config = cfg = GenAIConfig.load(folder)
        self.session = InferenceSession(os.path.join(cfg.folder, cfg.filename), sess_options,
                                        prepacked_weights_container=prepacked_weights_container)
        inputs = {a.name: a for a in self.session.get_inputs()}
        self._inputs = inputs
        # What each layer carries, as the model's inputs say: a KV cache, a convolution state, a
        # recurrent state (a config without layer_types, Qwen3.5's, lists no conv layers).
        self._attention = tuple(i for i in range(cfg.layers) if cfg.past_key % i in inputs)
        declared = cfg.conv_layers and (set(cfg.attention_layers) != set(self._attention) or any(
            cfg.past_conv % i not in inputs for i in cfg.conv_layers))
        if cfg.input_ids not in inputs or declared or any(cfg.past_value % i not in inputs for i in self._attention):
            raise ModelLoadError(f"{cfg.folder}: the model lacks an input named in genai_config.json "
                                 f"({cfg.input_ids!r}, a layer's past value, or a state its layer_types lists)")
        self._states = [(past % i, present % i) for past, present in ((cfg.past_conv, cfg.present_conv),
                                                                    (cfg.past_recurrent, cfg.present_recurrent))
                        if past and present for i in range(cfg.layers) if past % i in inputs]
        if not self._attention and not self._states:
            raise ModelLoadError(f"{cfg.folder}: the model has none of the cache inputs genai_config.json names")
        key0 = cfg.past_key % self._attention[0] if self._attention else self._states[0][0]
        self._cache_dtype = _np_dtype(inputs[key0].type)
        self.max_length = min(max_length or cfg.search.max_length, cfg.context_length)
        if self.max_length < 1:
            raise InvalidArgument(f"max_length must be >= 1, got {self.max_length}")
        ops = {n.op_type for n in self.session.model.proto.graph.node}
        # Shared buffers only where the attention kernel updates a bound cache in place.
        self.shared = cfg.share_buffer and "GroupQueryAttention" in ops and hasattr(self.session, "io_binding")
        self._tokenizer = None

    # -- tokenizer (optional) -----------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            try:
                from tokenizers import Tokenizer
            except ImportError as e:
                raise InvalidArgument("text needs the 'tokenizers' package (pip install onnxpack[genai]); "
                                      "or give token ids") from e
            path = os.path.join(self.config.folder, "tokenizer.json")
            if not os.path.isfile(path):
                raise ModelLoadError(f"{self.config.folder}: no tokenizer.json")
            self._tokenizer = Tokenizer.from_file(path)
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # -- the loop -------------------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], *, max_new_tokens: int | None = None,
                 search: SearchOptions | None = None, stop: Sequence[int] = (), seed: int = 0,
                 on_step: Callable[[int, float], None] | None = None) -> Iterator[int]:
        """Yields new token ids after ``prompt`` until an eos/stop token (yielded too), the
        maximum length, or ``max_new_tokens``.  ``on_step(token, seconds)`` is called per step."""
        cfg = self.config
        options = search or cfg.search
        options.check()
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidArgument("generate: the prompt must hold at least one token")
        limit = self.max_length
        if len(ids) >= limit:
            raise InvalidArgument(f"generate: a prompt of {len(ids)} tokens does not fit max_length {limit}")
        budget = limit - len(ids) if max_new_tokens is None else min(max_new_tokens, limit - len(ids))
        stops = set(cfg.eos) | {int(t) for t in stop}
        # numpy.random (~10 modules) is imported only by a sampling search
        rng = np.random.default_rng(seed) if options.do_sample else None
        state = _Cache(self, len(ids) + budget)
        new = ids
        try:
            for _ in range(budget):
                t0 = time.perf_counter()
                logits = state.step(new)
                token = sample_token(logits[0, -1], options, rng)
                if on_step is not None:
                    on_step(token, time.perf_counter() - t0)
                del logits  # a prompt's (S, vocab) logits: released before the next step
                yield token
                if token in stops:
                    return
                new = [token]
        finally:
            # The generation's KV cache and the steps' garbage go back to the OS: a process that
            # waits for its next request holds the model's shared pages and little else.
            del state
            return_freed_heap()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.session.close()


class _Cache:
    """The KV cache of one generation and the step that feeds it."""

    def __init__(self, gen: Generator, capacity: int) -> None:
        self.gen = gen
        cfg = gen.config
        self.length = 0
        self.capacity = capacity
        attention = gen._attention
        self.names = [(cfg.past_key % i, cfg.present_key % i) for i in attention]
        self.names += [(cfg.past_value % i, cfg.present_value % i) for i in attention]
        # A convolution or recurrent state has the shape the model declares, batch 1 (LFM2's
        # (1, channels, K - 1); Qwen3.5's recurrent (1, heads, d_k, d_v)).
        states = {past: _state_shape(gen._inputs[past]) for past, _ in gen._states}
        self.names += gen._states
        # A sliding-window layer's cache is window_size rows in either layout (its attention keeps
        # the last tokens in it; onnxruntime refuses a shorter one).
        window = {p for i in cfg.sliding_layers for p in (cfg.past_key % i, cfg.past_value % i)}

        def rows(past: str, default: int) -> int:
            return cfg.window_size if past in window else default

        if gen.shared:
            from onnxpack import OrtValue

            self.past = {p: np.zeros(states[p] if p in states else (1, cfg.kv_heads, rows(p, capacity), cfg.head_size),
                                     gen._cache_dtype) for p, _ in self.names}
            # Bound once: each step rebinds only the inputs that change (ids, mask, positions).
            self.binding = b = gen.session.io_binding()
            for past, present in self.names:
                buf = OrtValue.ortvalue_from_numpy(self.past[past])
                b.bind_ortvalue_input(past, buf)
                b.bind_ortvalue_output(present, buf)  # the same buffer: updated in place
            b.bind_output(cfg.logits)  # (bound last: the last of the run's outputs)
        else:
            self.past = {p: np.zeros(states[p] if p in states else (1, cfg.kv_heads, rows(p, 0), cfg.head_size),
                                     gen._cache_dtype) for p, _ in self.names}
            self.binding = None

    def step(self, new: Sequence[int]) -> np.ndarray:
        gen, cfg = self.gen, self.gen.config
        s = len(new)
        total = self.length + s
        feed: dict[str, np.ndarray] = {cfg.input_ids: np.asarray([new], np.int64)}
        if cfg.attention_mask and cfg.attention_mask in gen._inputs:
            feed[cfg.attention_mask] = np.ones((1, total), np.int64)
        if cfg.position_ids and cfg.position_ids in gen._inputs:
            pos = np.arange(self.length, total, dtype=np.int64)[None, :]
            if len(gen._inputs[cfg.position_ids].shape) == 3:  # (3, batch, sequence): one row per M-RoPE axis
                pos = np.ascontiguousarray(np.broadcast_to(pos, (3, 1, s)))
            feed[cfg.position_ids] = pos
        if self.binding is not None:
            b = self.binding
            for name, value in feed.items():
                b.bind_cpu_input(name, value)
            gen.session.run_with_iobinding(b, _shrink_options() if s > 1 else None)
            logits = b.get_outputs()[-1].numpy()
        else:
            feed.update(self.past)
            outs = gen.session.run(None, feed, _shrink_options() if s > 1 else None)
            by_name = dict(zip([o.name for o in gen.session.get_outputs()], outs))
            for past, present in self.names:
                self.past[past] = by_name[present]
            logits = by_name[cfg.logits]
        self.length = total
        return logits


@functools.lru_cache(maxsize=1)
def _shrink_options() -> Any:
    """RunOptions for a prompt's step: onnxruntime's arena shrinkage, which in onnxpack also drops
    the kernels' reusable scratch and returns the freed heap after the run (a prompt's temporaries
    are tens of MB that no decoding step needs again; measured with Qwen2.5-0.5B int4 and a
    32-token prompt: RssAnon after generating 49.5 -> 43.3 MB per process)."""
    from onnxpack import RunOptions

    ro = RunOptions()
    ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return ro


def _state_shape(arg: Any) -> tuple[int, ...]:
    """A convolution or recurrent state's shape for one sequence: the declared dims, batch 1."""
    dims = list(arg.shape)
    if len(dims) < 2 or not all(isinstance(d, int) and d >= 0 for d in dims[1:]):
        raise ModelLoadError(f"state {arg.name!r}: expected (batch, ...) with every other dimension fixed, "
                             f"the model declares {dims}")
    return (1, *dims[1:])


def _np_dtype(onnx_type: str) -> np.dtype:
    return np.dtype({"tensor(float16)": np.float16, "tensor(bfloat16)": np.float32}.get(onnx_type, np.float32))
