"""com.microsoft GreedySearch, Sampling, BeamSearch (GPT and T5) and WhisperBeamSearch against onnxruntime.

The decoder subgraph is a small GPT-shaped graph built here (token and position embeddings, a
key/value projection appended to the past state, a mask-weighted sum of the state, a vocabulary
projection): it has the signature ``convert_generation`` gives GPT-2 (``input_ids,
position_ids, attention_mask, past_0`` -> ``logits, present_0``), reads every input, and its
logits depend on the whole past, so the searches' bookkeeping (positions, masks, the past
reordered by beam) shows in the tokens.  Tokens must be equal; BeamSearch's scores within float
rounding (1e-5).  Sampling is compared where its draw is determined (a tiny top-p); its
other draws use numpy's generator (onnxruntime's is not reproduced), checked for validity.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack

V, H, D, B = 24, 2, 4, 2
EOS, PAD = 3, 0


def _decoder(seed: int) -> object:
    rng = np.random.default_rng(seed)
    hd = H * D

    def w(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [w("E", V, hd), w("P", 64, hd, scale=0.5), w("Wkv", hd, 2 * hd, scale=0.5), w("Wo", hd, V, scale=1.5),
             numpy_helper.from_array(np.array([0, 0, 2, H, D], np.int64), "kv_shape"),
             numpy_helper.from_array(np.array([0, 1, hd], np.int64), "ctx_shape"),
             numpy_helper.from_array(np.array([0, 3], np.int64), "sum_axes"),
             numpy_helper.from_array(np.array([0, 2, 4], np.int64), "mask_axes")]
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["e"]),
        helper.make_node("Gather", ["P", "position_ids"], ["p"]),
        helper.make_node("Add", ["e", "p"], ["h"]),
        helper.make_node("MatMul", ["h", "Wkv"], ["kv"]),
        helper.make_node("Reshape", ["kv", "kv_shape"], ["kv5"]),
        helper.make_node("Transpose", ["kv5"], ["kvt"], perm=[2, 0, 3, 1, 4]),
        helper.make_node("Concat", ["past_0", "kvt"], ["present_0"], axis=3),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "mask_axes"], ["mask5"]),
        helper.make_node("Mul", ["present_0", "mask5"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "sum_axes"], ["ctx"], keepdims=0),
        helper.make_node("Reshape", ["ctx", "ctx_shape"], ["ctx3"]),
        helper.make_node("Mul", ["ctx3", "quarter"], ["ctxs"]),
        helper.make_node("Add", ["h", "ctxs"], ["z"]),
        helper.make_node("Tanh", ["z"], ["t"]),
        helper.make_node("MatMul", ["t", "Wo"], ["logits"]),
    ]
    inits.append(numpy_helper.from_array(np.array(0.25, np.float32), "quarter"))
    i32 = TensorProto.INT32
    inputs = [helper.make_tensor_value_info("input_ids", i32, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", i32, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", i32, ["batch", "total"]),
              helper.make_tensor_value_info("past_0", TensorProto.FLOAT, [2, "batch", H, "past", D])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", V]),
               helper.make_tensor_value_info("present_0", TensorProto.FLOAT, [2, "batch", H, "total", D])]
    return helper.make_graph(nodes, "decoder", inputs, outputs, inits)


def _model(op: str, seed: int, inputs: list[str], n_out: int = 1, **attrs) -> bytes:
    node = helper.make_node(op, inputs, ["sequences", "sequences_scores", "scores"][:n_out], domain="com.microsoft",
                            eos_token_id=EOS, pad_token_id=PAD, model_type=0, decoder=_decoder(seed), **attrs)
    types = {"input_ids": TensorProto.INT32, "length_penalty": TensorProto.FLOAT, "repetition_penalty": TensorProto.FLOAT}
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, types.get(n, TensorProto.INT32), None)
                                            for n in inputs if n],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT if "score" in o else TensorProto.INT32, None)
                               for o in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model.SerializeToString()


_ORACLE = """
import sys, numpy as np, onnxruntime as ort
so = ort.SessionOptions(); so.log_severity_level = 3
feeds = dict(np.load(sys.argv[2]))
outs = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"]).run(None, feeds)
np.savez(sys.argv[3], *outs)
"""


def _ort_fresh(path, feeds: dict, tmp_path) -> list:
    """onnxruntime's outputs for the model at ``path``, computed in a fresh process."""
    np.savez(tmp_path / "feeds.npz", **feeds)
    subprocess.run([sys.executable, "-c", _ORACLE, str(path), str(tmp_path / "feeds.npz"), str(tmp_path / "want.npz")],
                   check=True)
    with np.load(tmp_path / "want.npz") as got:
        return [got[f"arr_{i}"] for i in range(len(got.files))]


def _both(model: bytes, feeds: dict, tmp_path) -> tuple[list, list]:
    """onnxpack's outputs and onnxruntime's, the latter from a fresh process: onnxruntime 1.32's
    searches over this decoder give other tokens once other search models ran in the process
    (seen: the same model, run again after two others, continued past a token it had stopped at;
    a process running only the one model gives the same tokens every time, equal to ours)."""
    (tmp_path / "m.onnx").write_bytes(model)
    want = _ort_fresh(tmp_path / "m.onnx", feeds, tmp_path)
    sess = onnxpack.InferenceSession(model)
    assert sess.get_fallback_nodes() == []
    return sess.run(None, feeds), want


def _prompt(seed: int, length: int = 5, pad_left: int = 0) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(4, V, (B, length)).astype(np.int32)
    ids[1, :pad_left] = PAD  # left padding: pads get position 0 and mask 0
    return ids


def _one(x, dtype=np.int32):
    return np.array([x], dtype)


GREEDY = [
    dict(),
    dict(repetition_penalty=1.6),
    dict(min_length=9),
    dict(vocab_mask=True),
    dict(prefix_vocab_mask=True),
    dict(no_repeat_ngram_size=1),
    dict(no_repeat_ngram_size=2, repetition_penalty=0.7),
    dict(pad_left=2),
    dict(pad_left=2, attention_mask=True),
]


def _feeds(seed, case, names):
    rng = np.random.default_rng(seed + 100)
    feeds = {"input_ids": _prompt(seed, pad_left=case.get("pad_left", 0)), "max_length": _one(14)}
    if "min_length" in names:
        feeds["min_length"] = _one(case.get("min_length", 0))
    if "repetition_penalty" in names:
        feeds["repetition_penalty"] = _one(case.get("repetition_penalty", 1.0), np.float32)
    if case.get("vocab_mask"):
        mask = np.ones(V, np.int32)
        mask[rng.choice(V, 8, replace=False)] = 0
        feeds["vocab_mask"] = mask
    if case.get("prefix_vocab_mask"):
        feeds["prefix_vocab_mask"] = (rng.random((B, V)) < 0.3).astype(np.int32)
    if case.get("attention_mask"):
        feeds["attention_mask"] = (feeds["input_ids"] != PAD).astype(np.int32)
    return feeds


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("case", GREEDY, ids=lambda c: "-".join(f"{k}" for k in c) or "plain")
def test_greedy_search_matches_onnxruntime(case, seed, tmp_path):
    names = ["input_ids", "max_length", "min_length", "repetition_penalty", "vocab_mask", "prefix_vocab_mask",
             "attention_mask"]
    feeds = _feeds(seed, case, names)
    inputs = [n if n in feeds else "" for n in names]
    model = _model("GreedySearch", seed, inputs, no_repeat_ngram_size=case.get("no_repeat_ngram_size", 0))
    got, want = _both(model, feeds, tmp_path)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[0].dtype == np.int32 and got[0].shape == (B, 14)


BEAM = [
    dict(num_beams=3),
    dict(num_beams=4, num_return_sequences=2, length_penalty=0.6),
    dict(num_beams=4, num_return_sequences=4, length_penalty=1.8, early_stopping=1),
    dict(num_beams=2, repetition_penalty=1.5, no_repeat_ngram_size=2),
    dict(num_beams=3, min_length=10, vocab_mask=True),
    dict(num_beams=3, prefix_vocab_mask=True, pad_left=2, attention_mask=True),
    dict(num_beams=1),
]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("case", BEAM, ids=lambda c: "-".join(f"{k}{v if v is not True else ''}" for k, v in c.items()))
def test_beam_search_matches_onnxruntime(case, seed, tmp_path):
    names = ["input_ids", "max_length", "min_length", "num_beams", "num_return_sequences", "length_penalty",
             "repetition_penalty", "vocab_mask", "prefix_vocab_mask", "attention_mask"]
    feeds = _feeds(seed, case, names)
    feeds["num_beams"] = _one(case["num_beams"])
    feeds["num_return_sequences"] = _one(case.get("num_return_sequences", 1))
    feeds["length_penalty"] = _one(case.get("length_penalty", 1.0), np.float32)
    inputs = [n if n in feeds else "" for n in names]
    model = _model("BeamSearch", seed, inputs, n_out=3, early_stopping=case.get("early_stopping", 0),
                   no_repeat_ngram_size=case.get("no_repeat_ngram_size", 0))
    got, want = _both(model, feeds, tmp_path)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)  # sequences_scores
    assert got[2].shape == want[2].shape
    finite = np.isfinite(want[2])
    np.testing.assert_array_equal(np.isfinite(got[2]), finite)
    np.testing.assert_allclose(got[2][finite], want[2][finite], rtol=1e-5, atol=1e-4)  # every step's scores


@pytest.mark.parametrize("attrs", [dict(top_p=1e-4), dict(top_p=1e-4, temperature=0.7)], ids=["top_p-tiny", "temperature"])
def test_sampling_determined_draws_match_onnxruntime(attrs, tmp_path):
    names = ["input_ids", "max_length", "min_length", "repetition_penalty", "", "", "", "", "seed"]
    feeds = {"input_ids": _prompt(4), "max_length": _one(14), "min_length": _one(0),
             "repetition_penalty": _one(1.2, np.float32), "seed": _one(7)}
    got, want = _both(_model("Sampling", 4, names, **attrs), feeds, tmp_path)
    np.testing.assert_array_equal(got[0], want[0])


def test_sampling_draws_are_valid_and_follow_the_seed():
    names = ["input_ids", "max_length", "", "", "", "", "", "", "seed"]
    model = _model("Sampling", 5, names, top_p=0.8, temperature=1.3)
    sess = onnxpack.InferenceSession(model)
    prompt = _prompt(5)
    runs = [sess.run(None, {"input_ids": prompt, "max_length": _one(16), "seed": _one(s)})[0] for s in (1, 1, 2)]
    np.testing.assert_array_equal(runs[0], runs[1])
    for seq in runs:
        np.testing.assert_array_equal(seq[:, :5], prompt)
        assert seq.shape == (B, 16) and ((seq >= 0) & (seq < V)).all()
        for row in seq:  # after an eos, only pads
            ends = np.flatnonzero(row[5:] == EOS)
            if ends.size:
                assert (row[5 + ends[0] + 1:] == PAD).all()


def test_encoder_decoder_searches_are_refused_with_the_reason():
    node = helper.make_node("BeamSearch", ["input_ids", "max_length", "", "num_beams"], ["sequences"],
                            domain="com.microsoft", eos_token_id=EOS, pad_token_id=PAD, model_type=2,
                            decoder=_decoder(1), encoder=_decoder(2))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.INT32, None)
                                            for n in ("input_ids", "max_length", "num_beams")],
                              [helper.make_tensor_value_info("sequences", TensorProto.INT32, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(onnxpack.errors.OnnxpackError, match="BeamSearch"):
        onnxpack.InferenceSession(m.SerializeToString())


# -- Whisper ----------------------------------------------------------------------------------------
MELS, FRAMES = 6, 10


def _whisper_graphs(seed: int, t5: bool = False, encoder_only: bool = False):
    """A Whisper-shaped pair with onnxruntime's converter signatures: ``encoder`` (features, start
    tokens -> logits, hidden states, self and cross presents) and ``decoder`` (a token, the self
    and cross pasts -> logits, self presents); logits read the tokens, the mean of the cross keys
    and the sum of the self keys, so a past that does not follow its beam shows."""
    rng = np.random.default_rng(seed)
    hd = H * D
    weights = {"We": rng.standard_normal((V if t5 else MELS, hd)) * 0.5, "Wk": rng.standard_normal((hd, hd)) * 0.5,
               "Wv": rng.standard_normal((hd, hd)) * 0.5, "E": rng.standard_normal((V, hd)),
               "Wsk": rng.standard_normal((hd, hd)) * 0.5, "Wsv": rng.standard_normal((hd, hd)) * 0.5,
               "Wo": rng.standard_normal((hd, V)) * 1.5}

    def inits():
        out = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
        out += [numpy_helper.from_array(np.array([0, 0, H, D], np.int64), "heads"),
                numpy_helper.from_array(np.array([0, 1, hd], np.int64), "flat"),
                numpy_helper.from_array(np.array([2], np.int64), "time"),
                numpy_helper.from_array(np.array(0.25, np.float32), "quarter"),
                numpy_helper.from_array(np.array([-1], np.int64), "last"),
                numpy_helper.from_array(np.array([1], np.int64), "seq")]
        return out

    def split_heads(x, out):  # (B, T, hd) -> (B, H, T, D)
        return [helper.make_node("Reshape", [x, "heads"], [out + "_r"]),
                helper.make_node("Transpose", [out + "_r"], [out], perm=[0, 2, 1, 3])]

    def head(tokens_emb, cross_k, self_k):
        return [helper.make_node("ReduceMean", [cross_k, "time"], ["cm"], keepdims=1),
                helper.make_node("Transpose", ["cm"], ["cmt"], perm=[0, 2, 1, 3]),
                helper.make_node("Reshape", ["cmt", "flat"], ["ctx"]),
                helper.make_node("ReduceSum", [self_k, "time"], ["ss"], keepdims=1),
                helper.make_node("Transpose", ["ss"], ["sst"], perm=[0, 2, 1, 3]),
                helper.make_node("Reshape", ["sst", "flat"], ["sctx"]),
                helper.make_node("Mul", ["sctx", "quarter"], ["sq"]),
                helper.make_node("Add", [tokens_emb, "ctx"], ["z1"]),
                helper.make_node("Add", ["z1", "sq"], ["z"]),
                helper.make_node("Tanh", ["z"], ["t"]),
                helper.make_node("MatMul", ["t", "Wo"], ["logits"])]

    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    kv = [f"present_{w}_{k}_0" for k in ("self", "cross") for w in ("key", "value")]
    if t5:  # token ids and their mask (masked positions give zero hidden states)
        source = [helper.make_node("Gather", ["We", "encoder_input_ids"], ["g"]),
                  helper.make_node("Cast", ["encoder_attention_mask"], ["mf"], to=TensorProto.FLOAT),
                  helper.make_node("Unsqueeze", ["mf", "last"], ["mu"]),
                  helper.make_node("Mul", ["g", "mu"], ["encoder_hidden_states"])]
    else:
        source = [helper.make_node("Transpose", ["encoder_input_ids"], ["ft"], perm=[0, 2, 1]),
                  helper.make_node("MatMul", ["ft", "We"], ["encoder_hidden_states"])]
    enc_nodes = [*source,
                 helper.make_node("MatMul", ["encoder_hidden_states", "Wk"], ["ck"]),
                 helper.make_node("MatMul", ["encoder_hidden_states", "Wv"], ["cv"]),
                 *split_heads("ck", "present_key_cross_0"), *split_heads("cv", "present_value_cross_0"),
                 helper.make_node("Gather", ["E", "decoder_input_ids"], ["e"]),
                 helper.make_node("MatMul", ["e", "Wsk"], ["sk"]), helper.make_node("MatMul", ["e", "Wsv"], ["sv"]),
                 *split_heads("sk", "present_key_self_0"), *split_heads("sv", "present_value_self_0"),
                 *head("e", "present_key_cross_0", "present_key_self_0")]
    enc_inputs = ([helper.make_tensor_value_info("encoder_input_ids", i32, ["b", "n"]),
                   helper.make_tensor_value_info("encoder_attention_mask", i32, ["b", "n"])] if t5 else
                  [helper.make_tensor_value_info("encoder_input_ids", f, ["b", MELS, FRAMES])])
    if encoder_only:  # onnxruntime 1.32's T5 export: the cross-attention presents only
        encoder = helper.make_graph(enc_nodes[: len(source) + 2 + 4], "encoder", enc_inputs,
                                    [helper.make_tensor_value_info(n, f, ["b", H, "n", D]) for n in kv[2:]], inits())
    else:
        encoder = helper.make_graph(
            enc_nodes, "encoder", enc_inputs + [helper.make_tensor_value_info("decoder_input_ids", i32, ["b", "s"])],
            [helper.make_tensor_value_info("logits", f, ["b", "s", V]),
             helper.make_tensor_value_info("encoder_hidden_states", f, ["b", "n" if t5 else FRAMES, hd])]
            + [helper.make_tensor_value_info(n, f, ["b", H, "t", D]) for n in kv], inits())
    dec_nodes = [helper.make_node("Gather", ["E", "input_ids"], ["e"]),
                 helper.make_node("MatMul", ["e", "Wsk"], ["sk"]), helper.make_node("MatMul", ["e", "Wsv"], ["sv"]),
                 *split_heads("sk", "nk"), *split_heads("sv", "nv"),
                 helper.make_node("Concat", ["past_key_self_0", "nk"], ["present_key_self_0"], axis=2),
                 helper.make_node("Concat", ["past_value_self_0", "nv"], ["present_value_self_0"], axis=2),
                 *head("e2" if t5 else "e", "past_key_cross_0", "present_key_self_0")]
    extra = []
    if encoder_only:  # the decoder reads the encoder's mask (its count joins the token)
        dec_nodes[:0] = [helper.make_node("Cast", ["encoder_attention_mask"], ["mf"], to=TensorProto.FLOAT),
                         helper.make_node("ReduceSum", ["mf", "seq"], ["ms"], keepdims=1),
                         helper.make_node("Unsqueeze", ["ms", "last"], ["mu"]),
                         helper.make_node("Mul", ["mu", "quarter"], ["hq"])]
        dec_nodes.insert(5, helper.make_node("Add", ["e", "hq"], ["e2"]))
        extra = [helper.make_tensor_value_info("encoder_attention_mask", i32, ["b", "n"])]
    elif t5:  # the decoder also reads the encoder's hidden states and mask (their masked sum joins the token)
        dec_nodes[:0] = [helper.make_node("Cast", ["encoder_attention_mask"], ["mf"], to=TensorProto.FLOAT),
                         helper.make_node("Unsqueeze", ["mf", "last"], ["mu"]),
                         helper.make_node("Mul", ["encoder_hidden_states", "mu"], ["hm"]),
                         helper.make_node("ReduceSum", ["hm", "seq"], ["hs"], keepdims=1),
                         helper.make_node("Mul", ["hs", "quarter"], ["hq"])]
        dec_nodes.insert(6, helper.make_node("Add", ["e", "hq"], ["e2"]))
        extra = [helper.make_tensor_value_info("encoder_attention_mask", i32, ["b", "n"]),
                 helper.make_tensor_value_info("encoder_hidden_states", f, ["b", "n", hd])]
    decoder = helper.make_graph(
        dec_nodes, "decoder", [helper.make_tensor_value_info("input_ids", i32, ["b", 1])] + extra
        + [helper.make_tensor_value_info(n.replace("present", "past"), f, ["b", H, "t", D]) for n in kv],
        [helper.make_tensor_value_info("logits", f, ["b", 1, V])]
        + [helper.make_tensor_value_info(n, f, ["b", H, "t", D]) for n in kv[:2]], inits())
    return encoder, decoder


def _encoder_decoder_model(op: str, names: list[str], model_type: int, case: dict, encoder, decoder):
    """A one-node model of ``op`` (``model_type``) over the encoder and decoder graphs, with the
    three outputs (sequences, their scores, every step's scores)."""
    node = helper.make_node(op, names, ["sequences", "sequences_scores", "scores"], domain="com.microsoft",
                            eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=20, model_type=model_type,
                            early_stopping=case.get("early_stopping", 0), encoder=encoder, decoder=decoder)
    floats = {"input_features", "length_penalty", "repetition_penalty"}
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT if n in floats else
                                                                          TensorProto.INT32, None) for n in names if n],
                              [helper.make_tensor_value_info("sequences", TensorProto.INT32, None),
                               helper.make_tensor_value_info("sequences_scores", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


WHISPER = [
    dict(batch=2, beams=3, ret=2, max_length=9, lp=1.0, start=[20]),
    dict(batch=2, beams=4, ret=4, max_length=8, lp=0.5, start=[20, 7, 9], repetition_penalty=1.3),
    dict(batch=1, beams=1, ret=1, max_length=9, lp=1.0, start=[20]),
    dict(batch=3, beams=2, ret=1, max_length=10, lp=1.5, start=[20, 5], early_stopping=1),
]


@pytest.mark.parametrize("case", WHISPER, ids=lambda c: f"b{c['batch']}-beams{c['beams']}-ret{c['ret']}")
def test_whisper_beam_search_matches_onnxruntime(case, tmp_path):
    encoder, decoder = _whisper_graphs(case["batch"] * 10 + case["beams"])
    names = ["input_features", "max_length", "min_length", "num_beams", "num_return_sequences", "length_penalty",
             "repetition_penalty", "", "", "", "decoder_input_ids"]
    model = _encoder_decoder_model("WhisperBeamSearch", names, 2, case, encoder, decoder)
    b = case["batch"]
    feeds = {"input_features": np.random.default_rng(b).standard_normal((b, MELS, FRAMES)).astype(np.float32),
             "max_length": _one(case["max_length"]), "min_length": _one(2), "num_beams": _one(case["beams"]),
             "num_return_sequences": _one(case["ret"]), "length_penalty": _one(case["lp"], np.float32),
             "repetition_penalty": _one(case.get("repetition_penalty", 1.0), np.float32),
             "decoder_input_ids": np.tile(np.array(case["start"], np.int32), (b, 1))}
    got, want = _both(model.SerializeToString(), feeds, tmp_path)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-4)


T5 = [
    dict(batch=2, beams=3, ret=2, max_length=9, lp=1.0),
    dict(batch=2, beams=4, ret=4, max_length=8, lp=0.5, repetition_penalty=1.3, pad_left=2),
    dict(batch=1, beams=1, ret=1, max_length=9, lp=1.0),
    dict(batch=3, beams=2, ret=1, max_length=10, lp=1.5, early_stopping=1, attention_mask=True, pad_left=1),
    dict(batch=2, beams=3, ret=2, max_length=9, lp=1.0, encoder_only=True, pad_left=2),
    dict(batch=2, beams=1, ret=1, max_length=8, lp=1.0, encoder_only=True, attention_mask=True, pad_left=1),
]


@pytest.mark.parametrize("case", T5, ids=lambda c: f"b{c['batch']}-beams{c['beams']}-ret{c['ret']}"
                         + ("-encoder-only" if c.get("encoder_only") else ""))
def test_t5_beam_search_matches_onnxruntime(case, tmp_path):
    """BeamSearch model_type 1 (T5's encoder-decoder as onnxruntime's T5 converter writes it: the
    legacy encoder-and-decoder-init graph, and 1.32's encoder of the cross presents only, whose
    first step is the decoder's from an empty self-attention past)."""
    encoder, decoder = _whisper_graphs(case["batch"] * 10 + case["beams"], t5=True,
                                       encoder_only=case.get("encoder_only", False))
    names = ["input_ids", "max_length", "min_length", "num_beams", "num_return_sequences", "length_penalty",
             "repetition_penalty", "", "", "attention_mask" if case.get("attention_mask") else ""]
    model = _encoder_decoder_model("BeamSearch", names, 1, case, encoder, decoder)
    b = case["batch"]
    ids = np.random.default_rng(b + 7).integers(4, V, (b, 6)).astype(np.int32)
    ids[-1, : case.get("pad_left", 0)] = PAD
    feeds = {"input_ids": ids, "max_length": _one(case["max_length"]), "min_length": _one(2),
             "num_beams": _one(case["beams"]), "num_return_sequences": _one(case["ret"]),
             "length_penalty": _one(case["lp"], np.float32),
             "repetition_penalty": _one(case.get("repetition_penalty", 1.0), np.float32)}
    if case.get("attention_mask"):
        feeds["attention_mask"] = (ids != PAD).astype(np.int32)
    got, want = _both(model.SerializeToString(), feeds, tmp_path)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["gpt", "whisper"])
def test_search_models_save_and_warm_start(kind, tmp_path):
    """A search model through ``onnxpack optimize``: its subgraphs' weights and packs saved, a warm
    session packs nothing and gives the cold session's outputs, onnxruntime on the saved model
    gives its outputs on the original."""
    import warnings

    from onnxpack.errors import PrepackWarning
    from onnxpack.session import optimize

    if kind == "gpt":
        names = ["input_ids", "max_length", "min_length", "num_beams", "num_return_sequences", "length_penalty",
                 "repetition_penalty"]
        model = _model("BeamSearch", 5, names, n_out=2)
        feeds = {"input_ids": _prompt(5), "max_length": _one(12)}
    else:
        encoder, decoder = _whisper_graphs(9)
        names = ["input_features", "max_length", "min_length", "num_beams", "num_return_sequences", "length_penalty",
                 "repetition_penalty"]
        model = _encoder_decoder_model("WhisperBeamSearch", names, 2, {}, encoder, decoder).SerializeToString()
        feeds = {"input_features": np.random.default_rng(9).standard_normal((2, MELS, FRAMES)).astype(np.float32),
                 "max_length": _one(8)}
    feeds.update(min_length=_one(1), num_beams=_one(3), num_return_sequences=_one(2),
                 length_penalty=_one(1.0, np.float32), repetition_penalty=_one(1.0, np.float32))
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    src.write_bytes(model)
    optimize(str(src), str(out))
    cold = onnxpack.InferenceSession(str(src)).run(None, feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrepackWarning)
        warm = onnxpack.InferenceSession(str(out))
        got = warm.run(None, feeds)
    assert warm.get_prepack_stats()["weights_packed"] == 0 and warm.get_prepack_stats()["blobs_from_model"] > 0
    for g, c in zip(got, cold):
        np.testing.assert_array_equal(g, c)
    want = _ort_fresh(src, feeds, tmp_path)
    for s, w in zip(_ort_fresh(out, feeds, tmp_path), want):
        np.testing.assert_array_equal(s, w)
    np.testing.assert_array_equal(got[0], want[0])
