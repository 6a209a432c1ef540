"""com.microsoft GreedySearch, Sampling, BeamSearch and WhisperBeamSearch over decoder subgraphs.

``onnxruntime.transformers.convert_generation`` wraps a decoder with past state (GPT-2's
``input_ids, position_ids, attention_mask, past_0..`` -> ``logits, present_0..``, ``model_type``
0) into one node that generates, and its Whisper converter does the same with an ``encoder``
graph (features and start tokens -> the first logits, the self- and cross-attention presents)
and a ``decoder`` graph (one token and the pasts -> logits, self presents).  The graphs are
compiled like any subgraph and run once per generated token, their presents fed back as pasts.
The searches follow onnxruntime's CPU implementation (itself Hugging Face's):

* GPT, first step: position ids count the tokens that are not ``pad_token_id`` (pads get
  position 0 and, without an ``attention_mask`` input, mask 0); later steps feed the chosen
  tokens, the next positions and the mask grown by a column of ones.  Whisper: the encoder runs
  on every beam's features and start tokens (``decoder_input_ids``, else
  ``decoder_start_token_id``), then the decoder a token at a time; its cross-attention pasts
  stay as the encoder gave them.
* Logits of the last position go through the processors onnxruntime applies: repetition
  penalty (a token already in the sequence: ``score * p`` if negative else ``score / p``), no
  repeat n-gram, ``vocab_mask`` and, at the first step, ``prefix_vocab_mask``, min length (eos
  excluded while the sequence is shorter); excluded scores are float32's lowest, as onnxruntime
  writes them; for sampling also presence penalty, temperature and top-p.  Beam search applies
  them to ``log_softmax`` of the logits.
* Greedy: argmax; from a sequence's eos on (the eos included, as onnxruntime writes it) its
  tokens are ``pad_token_id``.  Sampling draws from the filtered distribution with numpy's
  generator seeded by ``seed``, top-p's excluded tokens at probability 0 (the default
  ``filter_value``'s; another value is not applied) (onnxruntime's own generator is not reproduced: only fully
  determined draws — a top-p keeping one token — give its tokens).  Beam search: Hugging Face's
  BeamSearchScorer (hypotheses scored by ``sum_logprobs / length ** length_penalty``,
  ``early_stopping``, the best ``num_return_sequences`` per batch entry), the self-attention
  past reordered by beam at every step (not with one beam).
* T5 (BeamSearch ``model_type`` 1): the encoder reads the input ids, their mask (given, else 0
  on the left padding only) and ``decoder_start_token_id``, once per batch entry, its outputs
  repeated per beam; the decoder also reads the encoder's mask and hidden states.

``init_decoder`` graphs, shared past/present buffers, Whisper's timestamp
processor, temperature and cross-QK outputs are not implemented: such nodes are refused with
the reason.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxpack.errors import InvalidArgument, InvalidGraph
from onnxpack.graph._proto import AttributeProto, NodeProto, tensor_dtype_to_np_dtype
from onnxpack.session.kernels._base import KernelContext, register
from onnxpack.session.kernels.control import ControlFlowKernel

__all__ = ["BeamSearch", "GreedySearch", "Sampling"]

# What onnxruntime's processors write for an excluded token: the lowest float, not -inf (the
# scores output shows it; it stays finite when the beam's score is added).
_EXCLUDED = np.finfo(np.float32).min


def _scalar(value: Any, default: Any, kind: type, what: str) -> Any:
    if value is None:
        return default
    arr = np.asarray(value)
    if arr.size != 1:
        raise InvalidArgument(f"{what} must hold one value, got shape {list(arr.shape)}")
    return kind(arr.reshape(-1)[0])


class _Search(ControlFlowKernel):
    """What the three searches share: the decoder subgraph, its feeds, the logits processors."""

    op_type = ""
    domain = "com.microsoft"

    def __init__(self, node: NodeProto, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        what = self.what = f"node {node.name!r} ({node.op_type})"
        self.model_type = int(self.attr("model_type", 0))
        if self.model_type not in self.model_types:
            raise NotImplementedError(f"{what}: model_type {self.model_type} (implemented: "
                                      f"{', '.join(map(str, self.model_types))})")
        graphs = {a.name: a.g for a in node.attribute[:] if a.type == AttributeProto.GRAPH}
        self.decoder = self.subgraphs.get("decoder")
        if self.decoder is None or "decoder" not in graphs:
            raise InvalidGraph(f"{what}: the decoder graph is required")
        if "init_decoder" in graphs:
            raise NotImplementedError(f"{what}: an init_decoder graph")
        if self.model_type == 0:
            self._setup_gpt(graphs["decoder"])
        else:
            self._setup_encoder_decoder(graphs)
        self.eos = int(self.attr("eos_token_id", -1))
        self.pad = int(self.attr("pad_token_id", -1))
        self.ngram = int(self.attr("no_repeat_ngram_size", 0))
        if self.eos < 0 or self.pad < 0 or self.ngram < 0:
            raise InvalidArgument(f"{what}: eos_token_id and pad_token_id must be given (>= 0), "
                                  f"no_repeat_ngram_size >= 0")

    model_types: tuple[int, ...] = (0,)

    def _setup_gpt(self, graph: Any) -> None:
        what = self.what
        names = [i.name for i in graph.input[:]]
        if len(names) < 4 or len(graph.output) < 2 or len(graph.output) - 1 != len(names) - 3:
            raise InvalidGraph(f"{what}: the decoder must read input_ids, position_ids, attention_mask and one past "
                               f"per present output, got inputs {names} and {len(graph.output)} outputs")
        types = [i.type.tensor_type for i in graph.input[:]]
        self.id_types = [tensor_dtype_to_np_dtype(t.elem_type) if t.elem_type else np.dtype(np.int32) for t in types[:3]]
        self.past_type = tensor_dtype_to_np_dtype(types[3].elem_type) if types[3].elem_type else np.dtype(np.float32)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in types[3].shape.dim]
        # past_i: (2, batch, heads, past length, head size); heads and head size must be declared
        if len(dims) != 5 or dims[0] != 2 or dims[2] is None or dims[4] is None:
            raise InvalidGraph(f"{what}: the decoder's past inputs must be declared (2, batch, heads, length, "
                               f"head_size) with fixed heads and head size, got {dims}")
        self.heads, self.head_size = dims[2], dims[4]
        self.n_past = len(names) - 3

    def _setup_encoder_decoder(self, graphs: dict) -> None:
        """The encoder-decoder graphs as onnxruntime's converters write them: ``encoder`` (T5: the
        input ids, their mask and the decoder's start token; Whisper: the features and the start
        tokens -> logits, hidden states, the self- and cross-attention presents) and ``decoder``
        (one token, for T5 the encoder's mask and hidden states, the pasts -> logits, the
        self-attention presents); inputs and outputs are matched by name."""
        what = self.what
        self.encoder = self.subgraphs.get("encoder")
        if self.encoder is None or "encoder" not in graphs:
            raise InvalidGraph(f"{what}: model_type {self.model_type} needs an encoder graph")
        enc_in = [i.name for i in graphs["encoder"].input[:]]
        dec_in = [i.name for i in graphs["decoder"].input[:]]
        known = (["encoder_input_ids", "decoder_input_ids"] if self.model_type == 2 else
                 ["encoder_input_ids", "encoder_attention_mask", "decoder_input_ids"])
        if enc_in != known and not (self.model_type == 1 and enc_in == known[:2]):
            raise NotImplementedError(f"{what}: encoder inputs {enc_in} (implemented: {', '.join(known)}, as "
                                      "onnxruntime's converter writes them)")
        enc_out = list(self.encoder.output_names)
        dec_out = list(self.decoder.output_names)
        extra = ("encoder_attention_mask", "encoder_hidden_states") if self.model_type == 1 else ()
        for name in dec_in[1:]:
            if name in extra and (name == "encoder_attention_mask" or name in enc_out):
                continue
            if not name.startswith("past_") or ("present_" + name[5:]) not in (dec_out if "_self_" in name else enc_out):
                raise NotImplementedError(f"{what}: decoder input {name!r} (implemented: input_ids, "
                                          f"{', '.join(extra) + ', ' if extra else ''}then past_*_self_* fed by the "
                                          "presents and past_*_cross_* by the encoder's)")
        # onnxruntime 1.32's T5 converter writes an encoder of the cross-attention presents only
        # (no logits, no decoder_input_ids input): the decoder then also runs the first step,
        # from the start token and an empty self-attention past.
        self.encoder_only = self.model_type == 1 and "logits" not in enc_out
        if dec_in[0] != "input_ids" or dec_out[0] != "logits" or (enc_out[0] != "logits" and not self.encoder_only):
            raise InvalidGraph(f"{what}: the encoder and decoder must output logits first and the decoder read "
                               f"input_ids first, got {enc_out[:1]}, {dec_out[:1]}, {dec_in[:1]}")
        self.dec_inputs = dec_in
        self.enc_index = {n: i for i, n in enumerate(enc_out)}
        self.dec_index = {n: i for i, n in enumerate(dec_out)}
        self.start_token = int(self.attr("decoder_start_token_id", -1))

    def _encoder_decoder_hooks(self, frame: Any, encoder_feeds: list, beams: int, expand_after: bool,
                               mask: np.ndarray | None) -> tuple:
        """``first`` and ``after`` for :meth:`BeamSearch._beam` over the encoder and decoder.
        ``expand_after``: the encoder runs once per batch entry and its outputs are repeated per
        beam (onnxruntime's T5), else its feeds are already one row per beam (its Whisper)."""
        carried: dict[str, Any] = {}

        def first():
            outs = self.encoder.run(encoder_feeds if not self.encoder_only else encoder_feeds[:2], frame)
            if expand_after:
                outs = [np.repeat(np.asarray(o), beams, axis=0) for o in outs]
            for name in self.dec_inputs[1:]:
                if "_cross_" in name:
                    carried[name] = outs[self.enc_index["present_" + name[5:]]]
                elif name == "encoder_hidden_states":
                    carried[name] = outs[self.enc_index[name]]
                elif name == "encoder_attention_mask":
                    carried[name] = mask
            if self.encoder_only:  # the first step is the decoder's, from an empty self-attention past
                cross = np.asarray(next(v for n, v in carried.items() if "_cross_" in n))
                empty = np.zeros((cross.shape[0], cross.shape[1], 0, cross.shape[3]), cross.dtype)
                start = np.repeat(np.asarray(encoder_feeds[2]), beams, axis=0)
                return after(start.reshape(-1), None, {"present_" + n[5:]: empty for n in self.dec_inputs[1:]
                                                       if n.startswith("past_") and "_self_" in n})
            selfs = {n: outs[i] for n, i in self.enc_index.items() if "_self_" in n}
            return np.asarray(outs[0])[:, -1, :].astype(np.float32), selfs

        def after(tokens, index, selfs):
            feeds = [tokens.reshape(-1, 1).astype(np.int32)]
            for name in self.dec_inputs[1:]:
                if name in carried:  # the cross-attention pasts, the encoder's outputs and mask: as given
                    feeds.append(carried[name])
                else:
                    past = np.asarray(selfs["present_" + name[5:]])
                    feeds.append(np.ascontiguousarray(past[index]) if beams > 1 and index is not None else past)
            outs = self.decoder.run(feeds, frame)
            return (np.asarray(outs[0])[:, -1, :].astype(np.float32),
                    {n: outs[i] for n, i in self.dec_index.items() if "_self_" in n})

        return first, after

    # -- the decoder ------------------------------------------------------------------------------
    def _first_feeds(self, ids: np.ndarray, mask: np.ndarray | None) -> tuple[list, np.ndarray, np.ndarray]:
        """Feeds of the first step, the next positions and the mask (rows: batch x beams)."""
        keep = ids != self.pad
        positions = np.where(keep, np.cumsum(keep, axis=1) - 1, 0)
        if mask is None:
            mask = keep.astype(np.int32)
        rows = ids.shape[0]
        past = np.zeros((2, rows, self.heads, 0, self.head_size), self.past_type)
        feeds = [ids.astype(self.id_types[0]), positions.astype(self.id_types[1]), mask.astype(self.id_types[2])]
        return feeds + [past] * self.n_past, keep.sum(axis=1).astype(np.int64), mask.astype(np.int32)

    def _step(self, frame: Any, feeds: list) -> tuple[np.ndarray, list]:
        outs = self.decoder.run(feeds, frame)
        logits = np.asarray(outs[0])
        if logits.ndim != 3 or logits.shape[0] != feeds[0].shape[0]:
            raise InvalidGraph(f"{self.what}: the decoder's logits must be (batch, length, vocab), got {list(logits.shape)}")
        return logits[:, -1, :].astype(np.float32), list(outs[1:])

    def _next_feeds(self, tokens: np.ndarray, positions: np.ndarray, mask: np.ndarray, presents: list) -> tuple:
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), np.int32)], axis=1)
        feeds = [tokens.reshape(-1, 1).astype(self.id_types[0]), positions.reshape(-1, 1).astype(self.id_types[1]),
                 mask.astype(self.id_types[2])]
        return feeds + presents, positions + 1, mask

    # -- logits processors ---------------------------------------------------------------------
    def _process(self, scores: np.ndarray, sequences: np.ndarray, first: bool, penalty: float, min_length: int,
                 vocab_mask: np.ndarray | None, prefix_mask: np.ndarray | None, beams: int = 1) -> None:
        """Onnxruntime's processors in place on ``scores`` (rows: batch x beams)."""
        rows, vocab = scores.shape
        if penalty != 1.0:
            for r in range(rows):
                seen = np.unique(sequences[r])
                seen = seen[(seen >= 0) & (seen < vocab)]
                s = scores[r, seen]
                scores[r, seen] = np.where(s < 0, s * np.float32(penalty), s / np.float32(penalty))
        n = self.ngram
        if n > 0 and sequences.shape[1] + 1 >= n:
            for r in range(rows):
                seq = sequences[r].tolist()
                prefix = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
                banned = {seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == prefix}
                banned = [t for t in banned if 0 <= t < vocab]
                scores[r, banned] = _EXCLUDED
        if vocab_mask is not None:
            scores[:, vocab_mask.reshape(-1)[:vocab] == 0] = _EXCLUDED
        if prefix_mask is not None and first:
            scores[np.repeat(prefix_mask[:, :vocab] == 0, beams, axis=0)] = _EXCLUDED
        if min_length > 0 and sequences.shape[1] < min_length and self.eos < vocab:
            scores[:, self.eos] = _EXCLUDED

    def _masks(self, vocab_mask, prefix_mask, batch):
        if prefix_mask is not None and (prefix_mask.ndim != 2 or prefix_mask.shape[0] != batch):
            raise InvalidArgument(f"{self.what}: prefix_vocab_mask must be (batch, vocab), got {list(prefix_mask.shape)}")
        return (None if vocab_mask is None else np.asarray(vocab_mask), None if prefix_mask is None else np.asarray(prefix_mask))

    def _lengths(self, input_ids, max_length, min_length) -> tuple[np.ndarray, int, int]:
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[1] < 1 or ids.dtype.kind not in "iu":
            raise InvalidArgument(f"{self.what}: input_ids must be (batch, length) integers, got {ids.dtype}{list(ids.shape)}")
        top = _scalar(max_length, None, int, f"{self.what}: max_length")
        if top is None or top <= ids.shape[1] or top > 1 << 20:
            raise InvalidArgument(f"{self.what}: max_length must exceed the input length {ids.shape[1]}, got {top}")
        return ids.astype(np.int32), top, _scalar(min_length, 0, int, f"{self.what}: min_length")


@register("GreedySearch", domain="com.microsoft", since=1)
class GreedySearch(_Search):
    op_type = "GreedySearch"

    def run_in_frame(self, frame: Any, input_ids=None, max_length=None, min_length=None, repetition_penalty=None,
                     vocab_mask=None, prefix_vocab_mask=None, attention_mask=None, *rest: Any) -> tuple:
        ids, top, low = self._lengths(input_ids, max_length, min_length)
        penalty = _scalar(repetition_penalty, 1.0, float, f"{self.what}: repetition_penalty")
        vocab_mask, prefix_mask = self._masks(vocab_mask, prefix_vocab_mask, ids.shape[0])
        return (self._greedy(frame, ids, top, low, penalty, vocab_mask, prefix_mask, attention_mask, None),)

    def _greedy(self, frame, ids, top, low, penalty, vocab_mask, prefix_mask, attention_mask, choose) -> np.ndarray:
        batch = ids.shape[0]
        mask = None if attention_mask is None else np.asarray(attention_mask)
        feeds, positions, mask = self._first_feeds(ids, mask)
        sequences = ids
        done = np.zeros(batch, bool)
        first = True
        while sequences.shape[1] < top and not done.all():
            scores, presents = self._step(frame, feeds)
            self._process(scores, sequences, first, penalty, low, vocab_mask, prefix_mask)
            tokens = np.argmax(scores, axis=1).astype(np.int32) if choose is None else choose(scores, sequences)
            done |= tokens == self.eos
            tokens = np.where(done, np.int32(self.pad), tokens)  # onnxruntime writes the eos itself as a pad too
            sequences = np.concatenate([sequences, tokens[:, None]], axis=1)
            first = False
            if sequences.shape[1] < top and not done.all():
                feeds, positions, mask = self._next_feeds(tokens, positions, mask, presents)
        out = np.full((batch, top), self.pad, np.int32)
        out[:, : sequences.shape[1]] = sequences
        return out


@register("Sampling", domain="com.microsoft", since=1)
class Sampling(GreedySearch):
    op_type = "Sampling"

    def __init__(self, node: NodeProto, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.temperature = float(self.attr("temperature", 1.0))
        self.top_p = float(self.attr("top_p", 0.0))
        self.min_keep = max(1, int(self.attr("min_tokens_to_keep", 1)))
        self.presence_penalty = float(self.attr("presence_penalty", 0.0))
        if len(node.output) > 1 and node.output[1]:
            raise NotImplementedError(f"{self.what}: the filtered_logits output (a debugging output)")
        if int(self.attr("custom", 0)):
            raise NotImplementedError(f"{self.what}: custom=1 sampling")
        if self.temperature <= 0 or not 0 <= self.top_p <= 1:
            raise InvalidArgument(f"{self.what}: temperature must be > 0 and top_p in [0, 1]")

    def run_in_frame(self, frame: Any, input_ids=None, max_length=None, min_length=None, repetition_penalty=None,
                     vocab_mask=None, prefix_vocab_mask=None, attention_mask=None, presence_mask=None, seed=None,
                     *rest: Any) -> tuple:
        ids, top, low = self._lengths(input_ids, max_length, min_length)
        penalty = _scalar(repetition_penalty, 1.0, float, f"{self.what}: repetition_penalty")
        vocab_mask, prefix_mask = self._masks(vocab_mask, prefix_vocab_mask, ids.shape[0])
        rng = np.random.default_rng(_scalar(seed, None, int, f"{self.what}: seed"))
        presence = None if presence_mask is None else np.asarray(presence_mask)

        def choose(scores: np.ndarray, sequences: np.ndarray) -> np.ndarray:
            z = scores.astype(np.float64)
            if presence is not None and self.presence_penalty:
                z = z - self.presence_penalty * presence[:, : z.shape[1]]
            z = z / self.temperature
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            if 0 < self.top_p < 1:
                order = np.argsort(-p, axis=1, kind="stable")
                cum = np.cumsum(np.take_along_axis(p, order, 1), axis=1)
                # keep the smallest prefix reaching top_p (at least min_tokens_to_keep)
                keep_sorted = (cum - np.take_along_axis(p, order, 1)) < self.top_p
                keep_sorted[:, : self.min_keep] = True
                keep = np.zeros_like(keep_sorted)
                np.put_along_axis(keep, order, keep_sorted, 1)
                p = np.where(keep, p, 0.0)
                p /= p.sum(axis=1, keepdims=True)
            return np.array([rng.choice(p.shape[1], p=row) for row in p], np.int32)

        return (self._greedy(frame, ids, top, low, penalty, vocab_mask, prefix_mask, attention_mask, choose),)


class _Hypotheses:
    """The best finished sequences of one batch entry (Hugging Face's BeamHypotheses)."""

    def __init__(self, beams: int, length_penalty: float, early_stopping: bool) -> None:
        self.beams, self.length_penalty, self.early = beams, length_penalty, early_stopping
        self.items: list[tuple[float, np.ndarray]] = []
        self.worst = 1e9

    def add(self, sequence: np.ndarray, sum_logprobs: float) -> None:
        score = sum_logprobs / (float(len(sequence)) ** self.length_penalty)
        if len(self.items) < self.beams or score > self.worst:
            self.items.append((score, sequence))
            if len(self.items) > self.beams:
                worst = min(range(len(self.items)), key=lambda i: self.items[i][0])
                del self.items[worst]
                self.worst = min(s for s, _ in self.items)
            else:
                self.worst = min(score, self.worst)

    def is_done(self, best_sum_logprobs: float, length: int) -> bool:
        if len(self.items) < self.beams:
            return False
        if self.early:
            return True
        return self.worst >= best_sum_logprobs / (float(length) ** self.length_penalty)


@register("BeamSearch", domain="com.microsoft", since=1)
class BeamSearch(_Search):
    op_type = "BeamSearch"
    model_types = (0, 1)

    def __init__(self, node: NodeProto, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        self.early_stopping = int(self.attr("early_stopping", 0)) == 1
        outs = node.output[:]
        self.want_scores = len(outs) > 1 and bool(outs[1])
        self.want_step_scores = len(outs) > 2 and bool(outs[2])
        if any(outs[3:]):
            raise NotImplementedError(f"{self.what}: outputs {outs[3:]} (cross_qk / no-speech probabilities)")

    def run_in_frame(self, frame: Any, input_ids=None, max_length=None, min_length=None, num_beams=None,
                     num_return_sequences=None, length_penalty=None, repetition_penalty=None, vocab_mask=None,
                     prefix_vocab_mask=None, attention_mask=None, *rest: Any) -> tuple:
        if self.model_type == 1:
            return self._t5(frame, input_ids, max_length, min_length, num_beams, num_return_sequences, length_penalty,
                            repetition_penalty, vocab_mask, prefix_vocab_mask, attention_mask)
        ids, top, low = self._lengths(input_ids, max_length, min_length)
        beams, ret, lp, penalty = self._beam_options(num_beams, num_return_sequences, length_penalty, repetition_penalty)
        vocab_mask, prefix_mask = self._masks(vocab_mask, prefix_vocab_mask, ids.shape[0])
        mask = None if attention_mask is None else np.repeat(np.asarray(attention_mask), beams, axis=0)
        feeds, positions, mask = self._first_feeds(np.repeat(ids, beams, axis=0), mask)
        state = {"positions": positions, "mask": mask}

        def first():
            logits, presents = self._step(frame, feeds)
            return logits, presents

        def after(tokens, index, presents):
            if beams > 1:  # the past follows its beam (one beam: as it is); positions and mask stay with the row
                presents = [np.ascontiguousarray(np.asarray(p)[:, index]) for p in presents]
            step_feeds, state["positions"], state["mask"] = self._next_feeds(tokens, state["positions"], state["mask"],
                                                                             presents)
            return self._step(frame, step_feeds)

        return self._beam(np.repeat(ids, beams, axis=0), ids.shape[0], beams, ret, top, low, lp, penalty, vocab_mask,
                          prefix_mask, first, after)

    def _t5(self, frame, input_ids, max_length, min_length, num_beams, num_return_sequences, length_penalty,
            repetition_penalty, vocab_mask, prefix_vocab_mask, attention_mask) -> tuple:
        """T5-style encoder-decoder (``model_type`` 1): the encoder reads the input ids, their mask
        (given, else 0 on the left padding only, as onnxruntime builds it) and the start token, once
        per batch entry; its outputs are repeated per beam; the sequences start with the token."""
        what = self.what
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu" or self.start_token < 0:
            raise InvalidArgument(f"{what}: input_ids must be (batch, length) integers and decoder_start_token_id "
                                  f"given, got {ids.dtype}{list(ids.shape)}")
        batch = ids.shape[0]
        start = np.full((batch, 1), self.start_token, np.int32)
        _, top, low = self._lengths(start, max_length, min_length)
        beams, ret, lp, penalty = self._beam_options(num_beams, num_return_sequences, length_penalty, repetition_penalty)
        vocab_mask, prefix_mask = self._masks(vocab_mask, prefix_vocab_mask, batch)
        if attention_mask is not None:
            mask = np.asarray(attention_mask).astype(np.int32)
        else:  # pads before the first other token are masked
            mask = (np.cumsum(ids != self.pad, axis=1) > 0).astype(np.int32)
        first, after = self._encoder_decoder_hooks(frame, [ids.astype(np.int32), mask, start], beams, True,
                                                   np.repeat(mask, beams, axis=0))
        return self._beam(np.repeat(start, beams, axis=0), batch, beams, ret, top, low, lp, penalty, vocab_mask,
                          prefix_mask, first, after)

    def _beam_options(self, num_beams, num_return_sequences, length_penalty, repetition_penalty):
        what = self.what
        beams = _scalar(num_beams, None, int, f"{what}: num_beams")
        ret = _scalar(num_return_sequences, 1, int, f"{what}: num_return_sequences")
        if beams is None or not 1 <= beams <= 128 or not 1 <= ret <= beams:
            raise InvalidArgument(f"{what}: num_beams must be in [1, 128] and num_return_sequences in [1, num_beams], "
                                  f"got {beams} and {ret}")
        return (beams, ret, _scalar(length_penalty, 1.0, float, f"{what}: length_penalty"),
                _scalar(repetition_penalty, 1.0, float, f"{what}: repetition_penalty"))

    def _beam(self, sequences, batch, beams, ret, top, low, lp, penalty, vocab_mask, prefix_mask, first, after):
        """The search: ``first()`` runs the first step, ``after(tokens, beam_index, state)`` the
        next ones (each returns the last position's logits and the state to carry); ``sequences``:
        the start of every row (batch x beams)."""
        start = sequences.shape[1]
        rows = batch * beams
        beam_scores = np.full((batch, beams), -1e9, np.float32)
        beam_scores[:, 0] = 0
        beam_scores = beam_scores.reshape(-1)
        hyps = [_Hypotheses(beams, lp, self.early_stopping) for _ in range(batch)]
        done = np.zeros(batch, bool)
        step_scores = []
        logits, carried = first()
        vocab = logits.shape[1]
        while True:
            shifted = logits - logits.max(axis=1, keepdims=True)
            scores = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))  # log_softmax
            self._process(scores, sequences, sequences.shape[1] == start, penalty, low, vocab_mask, prefix_mask, beams)
            scores += beam_scores[:, None]
            if self.want_step_scores:
                step_scores.append(scores.reshape(batch, beams, vocab).copy())
            flat = scores.reshape(batch, beams * vocab)
            k = min(2 * beams, flat.shape[1])
            part = np.argpartition(-flat, k - 1, axis=1)[:, :k] if k < flat.shape[1] else np.tile(np.arange(k), (batch, 1))
            order = np.argsort(-np.take_along_axis(flat, part, 1), axis=1, kind="stable")
            cand = np.take_along_axis(part, order, 1)
            next_scores = np.zeros(rows, np.float32)
            next_tokens = np.full(rows, self.pad, np.int32)
            next_index = np.zeros(rows, np.int64)  # a finished entry's beams: row 0, as onnxruntime pads them
            cur = sequences.shape[1]
            # onnxruntime's scorer reads each entry's best candidate score from the batch's sorted
            # top-k scores laid end to end (k = 2 x beams per entry), in the window starting at
            # entry x beams, not entry x k: from the second entry on, the window spans the
            # previous entry's candidates too.  Its "done" test, and so when the search stops, follows.
            ranked = np.take_along_axis(flat, cand, 1).reshape(-1)
            for b in range(batch):
                if done[b]:
                    continue
                base = b * beams
                j = 0
                for rank, c in enumerate(cand[b]):
                    beam, token = divmod(int(c), vocab)
                    score = float(flat[b, c])
                    if token == self.eos:
                        if rank >= beams:
                            continue
                        hyps[b].add(sequences[base + beam].copy(), score)
                    else:
                        next_scores[base + j], next_tokens[base + j], next_index[base + j] = score, token, base + beam
                        j += 1
                    if j == beams:
                        break
                done[b] = done[b] or hyps[b].is_done(float(ranked[b * beams:b * beams + k].max()), cur)
            sequences = np.concatenate([sequences[next_index], next_tokens[:, None]], axis=1)
            beam_scores = next_scores
            if done.all() or sequences.shape[1] >= top:
                break
            logits, carried = after(next_tokens, next_index, carried)
        for b in range(batch):
            if not done[b]:
                for beam in range(beams):
                    hyps[b].add(sequences[b * beams + beam].copy(), float(beam_scores[b * beams + beam]))
        out = np.full((batch, ret, top), self.pad, np.int32)
        out_scores = np.zeros((batch, ret), np.float32)
        for b in range(batch):
            best = sorted(hyps[b].items, key=lambda item: item[0], reverse=True)[:ret]
            for r, (score, seq) in enumerate(best):
                out[b, r, : len(seq)] = seq
                out_scores[b, r] = score
        results: list[Any] = [out]
        if self.want_scores or self.want_step_scores:
            results.append(out_scores)
        if self.want_step_scores:  # one slot per step max_length allows, zeros after the last one run
            scores_out = np.zeros((top - start, batch, beams, vocab), np.float32)
            if step_scores:
                scores_out[: len(step_scores)] = np.stack(step_scores)
            results.append(scores_out)
        return tuple(results)


@register("WhisperBeamSearch", domain="com.microsoft", since=1)
class WhisperBeamSearch(BeamSearch):
    """Beam search over Whisper's encoder (features and start tokens: the first step's logits,
    the hidden states, the self- and cross-attention presents) and decoder (a token at a time,
    its self-attention past reordered by beam, the cross-attention past as the encoder gave it),
    as onnxruntime's converter writes them.  The timestamp logits processor, temperature, extra
    decoding ids and the cross-QK / no-speech outputs are not implemented (refused)."""

    op_type = "WhisperBeamSearch"
    model_types = (2,)

    def run_in_frame(self, frame: Any, input_features=None, max_length=None, min_length=None, num_beams=None,
                     num_return_sequences=None, length_penalty=None, repetition_penalty=None, vocab_mask=None,
                     prefix_vocab_mask=None, attention_mask=None, decoder_input_ids=None, logits_processor=None,
                     cross_qk_layer_head=None, extra_decoding_ids=None, temperature=None, *rest: Any) -> tuple:
        what = self.what
        if _scalar(logits_processor, 0, int, f"{what}: logits_processor") != 0 or extra_decoding_ids is not None \
                or cross_qk_layer_head is not None or _scalar(temperature, 1.0, float, f"{what}: temperature") != 1.0:
            raise InvalidArgument(f"{what}: logits_processor, extra_decoding_ids, cross_qk_layer_head and "
                                  "temperature other than 1 are not implemented")
        features = np.asarray(input_features)
        if features.ndim != 3:
            raise InvalidArgument(f"{what}: input_features must be (batch, mels, frames), got {list(features.shape)}")
        batch = features.shape[0]
        if decoder_input_ids is None:
            if self.start_token < 0:
                raise InvalidArgument(f"{what}: no decoder_input_ids and no decoder_start_token_id")
            start = np.full((batch, 1), self.start_token, np.int32)
        else:
            start = np.asarray(decoder_input_ids).astype(np.int32)
            if start.ndim != 2 or start.shape[0] != batch:
                raise InvalidArgument(f"{what}: decoder_input_ids must be ({batch}, length), got {list(start.shape)}")
        ids, top, low = self._lengths(start, max_length, min_length)
        beams, ret, lp, penalty = self._beam_options(num_beams, num_return_sequences, length_penalty, repetition_penalty)
        vocab_mask, prefix_mask = self._masks(vocab_mask, prefix_vocab_mask, batch)
        rows_ids = np.repeat(ids, beams, axis=0)
        first, after = self._encoder_decoder_hooks(frame, [np.repeat(features, beams, axis=0), rows_ids], beams,
                                                   False, None)
        return self._beam(rows_ids, batch, beams, ret, top, low, lp, penalty, vocab_mask, prefix_mask, first, after)
