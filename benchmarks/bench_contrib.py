"""onnxruntime contrib ops: the float32 erf, a BERT-base encoder as onnxruntime's optimizer writes
it, and GroupQueryAttention decode steps -- onnxpack vs onnxruntime.

Usage (leave OpenBLAS's tuning variables out for timings, as the other benchmarks, and keep
BLAS on one thread: onnxruntime runs on one thread here too)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \
        python benchmarks/bench_contrib.py [--repeat 15] [--json out.json]

Sections (every timing the median CPU milliseconds of ``--repeat`` runs, candidates interleaved
run by run so a noisy machine slows all of them alike):

* ``erf``: erf of a (128, 3072) float32 tensor (BERT-base's GELU input at sequence 128):
  ``erf_f32`` vs scipy's ufunc vs the old float64 series (``erf_numpy``).
* ``bert``: 2 BERT-base layers (hidden 768, 12 heads, FF 3072, sequence 128, batch 1) in the
  fused form -- EmbedLayerNormalization, Attention (packed QKV), MatMul, SkipLayerNormalization,
  BiasGelu -- in onnxpack and in onnxruntime; and the same block written with plain ONNX ops
  (Erf GELU) in onnxpack with each erf.
* ``gqa``: one GroupQueryAttention decode step (batch 1, 16 query / 4 KV heads, head 64) at
  several total lengths, with past as exactly the past rows and as a 2048-row buffer.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack.session.kernels import _erf, elementwise

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import blas_info, print_table, write_json  # noqa: E402
from _models import transformer_block  # noqa: E402

MS = "com.microsoft"


def interleaved_ms(cands: dict[str, callable], repeat: int) -> dict[str, float]:
    """Median milliseconds of each candidate, run in turn ``repeat`` times after one warm-up.

    CPU time of this process (``time.process_time``), not wall time: the 2-core machine these
    figures come from is shared and oversubscribed (load average 6-8), where wall times of the
    same call varied 5x between runs.  BLAS (``OPENBLAS_NUM_THREADS=1``) and onnxruntime
    (``intra_op_num_threads=1``) both run on this thread, so CPU time is the work done.
    """
    for fn in cands.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(repeat):
        for k, fn in cands.items():
            t0 = time.process_time()
            fn()
            times[k].append(time.process_time() - t0)
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def ort_session(model, *, optimize: bool = False):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def bert_fused(layers=2, seq=128, hidden=768, heads=12, ff=3072, vocab=30522, seed=0):
    """BERT-base layers in the form ``optimize_model(model_type="bert")`` writes."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1 / math.sqrt(shape[0])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inits = {"word": w(vocab, hidden, scale=0.1), "pos": w(512, hidden, scale=0.1), "seg": w(2, hidden, scale=0.1),
             "g0": 1 + w(hidden, scale=0.1), "b0": w(hidden, scale=0.1)}
    n = helper.make_node
    nodes = [n("EmbedLayerNormalization", ["ids", "segs", "word", "pos", "seg", "g0", "b0", "mask"], ["h0", "mi"],
               domain=MS, epsilon=1e-12)]
    x = "h0"
    for i in range(layers):
        p = f"l{i}_"
        inits.update({p + "qkv": w(hidden, 3 * hidden), p + "qkv_b": w(3 * hidden, scale=0.02),
                      p + "wo": w(hidden, hidden), p + "bo": w(hidden, scale=0.02),
                      p + "g1": 1 + w(hidden, scale=0.1), p + "b1": w(hidden, scale=0.1),
                      p + "w1": w(hidden, ff), p + "bf1": w(ff, scale=0.02), p + "w2": w(ff, hidden),
                      p + "bf2": w(hidden, scale=0.02), p + "g2": 1 + w(hidden, scale=0.1),
                      p + "b2": w(hidden, scale=0.1)})
        nodes += [
            n("Attention", [x, p + "qkv", p + "qkv_b", "mi"], [p + "att"], domain=MS, num_heads=heads),
            n("MatMul", [p + "att", p + "wo"], [p + "proj"]),
            n("SkipLayerNormalization", [p + "proj", x, p + "g1", p + "b1", p + "bo"], [p + "ln1"], domain=MS,
              epsilon=1e-12),
            n("MatMul", [p + "ln1", p + "w1"], [p + "f1"]),
            n("BiasGelu", [p + "f1", p + "bf1"], [p + "act"], domain=MS),
            n("MatMul", [p + "act", p + "w2"], [p + "f2"]),
            n("SkipLayerNormalization", [p + "f2", p + "ln1", p + "g2", p + "b2", p + "bf2"], [p + "out"], domain=MS,
              epsilon=1e-12),
        ]
        x = p + "out"
    i32 = TensorProto.INT32
    graph = helper.make_graph(nodes, "bert",
                              [helper.make_tensor_value_info(k, i32, [1, seq]) for k in ("ids", "segs", "mask")],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, seq, hidden])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=9)
    feeds = {"ids": rng.integers(0, vocab, (1, seq)).astype(np.int32), "segs": np.zeros((1, seq), np.int32),
             "mask": np.ones((1, seq), np.int32)}
    return model, feeds


def gqa_model(n=16, nkv=4, h=64):
    elem = TensorProto.FLOAT
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    types = {"seqlens_k": TensorProto.INT32, "total_sequence_length": TensorProto.INT32}
    node = helper.make_node("GroupQueryAttention", names, ["y", "pk", "pv"], domain=MS, num_heads=n, kv_num_heads=nkv)
    graph = helper.make_graph([node], "gqa",
                              [helper.make_tensor_value_info(k, types.get(k, elem), None) for k in names],
                              [helper.make_tensor_value_info(o, elem, None) for o in node.output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    result: dict = {"blas": blas_info()}

    # -- erf ------------------------------------------------------------------------------------
    x = (np.random.default_rng(0).standard_normal((128, 3072)) / math.sqrt(2)).astype(np.float32)
    cands = {"erf_f32": lambda: _erf.erf_f32(x), "erf_numpy (float64 series)": lambda: elementwise.erf_numpy(x)}
    if elementwise._scipy_erf is not None:
        cands["scipy.special.erf"] = lambda: elementwise._scipy_erf(x)
    erf_ms = interleaved_ms(cands, args.repeat * 3)
    result["erf_ms"] = erf_ms
    print("erf of a (128, 3072) float32 tensor")
    print_table([["erf", "median ms"]] + [[k, f"{v:.2f}"] for k, v in erf_ms.items()])

    # -- BERT-base ---------------------------------------------------------------------------------
    model, feeds = bert_fused()
    ours = onnxpack.InferenceSession(model.SerializeToString())
    assert not ours.get_fallback_nodes(), ours.get_fallback_nodes()
    theirs = ort_session(model)
    want = theirs.run(None, feeds)[0]
    got = ours.run(None, feeds)[0]
    err = float(np.abs(got - want).max())
    plain = transformer_block(s=128, d=768, h=12, ff=3072)
    plain_sess = onnxpack.InferenceSession(plain.SerializeToString())
    xin = {"x": np.random.default_rng(1).standard_normal((1, 128, 768)).astype(np.float32)}
    real_erf = elementwise.erf_f32

    def plain_with(erf):
        def run():
            elementwise.erf_f32 = erf
            try:
                plain_sess.run(None, xin)
            finally:
                elementwise.erf_f32 = real_erf
        return run

    bert_ms = interleaved_ms({
        "fused BERT x2, onnxpack": lambda: ours.run(None, feeds),
        "fused BERT x2, onnxruntime (1 thread)": lambda: theirs.run(None, feeds),
        "plain-op block, onnxpack, erf_f32": plain_with(real_erf),
        "plain-op block, onnxpack, erf_numpy": plain_with(lambda v: elementwise.erf_numpy(v).astype(np.float32)),
    }, args.repeat)
    result["bert_ms"] = bert_ms
    result["bert_max_abs_diff_vs_onnxruntime"] = err
    print(f"\nBERT-base, sequence 128, batch 1 (fused output max |diff| vs onnxruntime: {err:.2e})")
    print_table([["model / runtime", "median ms"]] + [[k, f"{v:.1f}"] for k, v in bert_ms.items()])

    # -- GQA decode ------------------------------------------------------------------------------
    n, nkv, h, cap = 16, 4, 64, 2048
    gm = gqa_model(n, nkv, h)
    g_ours = onnxpack.InferenceSession(gm.SerializeToString())
    g_ort = ort_session(gm)
    rng = np.random.default_rng(2)
    rows = [["total length", "past layout", "onnxpack ms", "onnxruntime ms"]]
    result["gqa_decode_ms"] = []
    for total in (128, 512, 2048):
        for layout in ("exact", "buffer"):
            plen = total - 1 if layout == "exact" else cap
            f = {"query": rng.standard_normal((1, 1, n * h)).astype(np.float32),
                 "key": rng.standard_normal((1, 1, nkv * h)).astype(np.float32),
                 "value": rng.standard_normal((1, 1, nkv * h)).astype(np.float32),
                 "past_key": rng.standard_normal((1, nkv, plen, h)).astype(np.float32),
                 "past_value": rng.standard_normal((1, nkv, plen, h)).astype(np.float32),
                 "seqlens_k": np.array([total - 1], np.int32), "total_sequence_length": np.array(total, np.int32)}
            ms = interleaved_ms({"ours": lambda: g_ours.run(None, f), "ort": lambda: g_ort.run(None, f)}, args.repeat)
            result["gqa_decode_ms"].append({"total": total, "layout": layout, **ms})
            rows.append([str(total), layout, f"{ms['ours']:.3f}", f"{ms['ort']:.3f}"])
    print(f"\nGroupQueryAttention decode step (batch 1, {n}/{nkv} heads, head {h}, buffer {cap} rows)")
    print_table(rows, left=2)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
