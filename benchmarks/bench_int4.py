"""MatMulNBits on Qwen2.5-0.5B layer shapes: onnxpack (numba, numpy) vs onnxruntime, side by side.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_int4.py [--rounds 5] [--repeat 15]
        [--rows 1,128] [--threads 2] [--no-numpy] [--stream-mb 96] [--json benchmarks/results/int4.json]

Shapes (K x N) are those onnxruntime-genai's builder emits for Qwen2.5-0.5B (hidden 896,
intermediate 4864, 14 query heads and 2 KV heads of 64, vocabulary 151936): q 896x896, k and v
896x128, o 896x896, gate and up 896x4864, down 4864x896, lm_head 896x151936; 4 bits, block 32,
uint8 zero points, float32 scales, as the builder writes for CPU.  Weights are random (the speed
does not depend on their values).  For each shape and row count M, one call of:

* ``onnxpack-jit`` — the kernel with its packed weights, numba path (2 threads by default);
* ``onnxpack-numpy`` — the same kernel with ``ONNXPACK_DISABLE_JIT=1`` (dequantized panels + BLAS);
* ``ort-acc4`` / ``ort-acc0`` — onnxruntime running the single node (weights as initializers,
  ``intra_op_num_threads`` = threads), with ``accuracy_level`` 4 (int8 activations, what the
  builder emits) and 0 (float32, what we compute).

Each implementation is measured in a process of its own, and each row count in another one
(three thread pools — numba's OpenMP team, OpenBLAS's and onnxruntime's — spin after their work
and starve one another on 2 cores when they share a process: our M=1 kernel measured 50-70 ms
per call right after onnxruntime's runs instead of 0.1-0.2 ms, and our M=128 path 24 ms instead
of 2 ms for 896x896 right after the numba GEMV had run).  Rounds interleave the processes (every
implementation once per round, ``--repeat`` calls per shape, median per round) and the table
shows the median over rounds: on a shared machine a burst of load then hits all of them alike.
The per-token line adds up 24 layers (q, k, v, o, gate, up, down) and the lm_head.

Decode (M = 1) streams its weights from memory, as a real decoding step does (a token reads
~250 MB of int4 weights, 8x the 32 MB L3): each M=1 call here goes to the next of enough copies
of the weights (different values) to exceed ``--stream-mb`` (default 96 MB; at most 128 copies), so a layer's
weights are not found in the cache (``--stream-mb 0``: one copy, cache-hot, compute-bound).  The
GB/s columns are the packed bytes read (weights + scales + zero points) per second, next to this
machine's read bandwidth measured first (numpy sum over 256 MB, 1 and 2 threads, best of 5).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import ROOT, blas_info, print_table, run_child, write_json  # noqa: E402

sys.path.insert(0, str(ROOT))
from onnxpack.session.kernels import KernelContext, TensorInfo, lookup  # noqa: E402
from onnxpack.session.kernels import quant  # noqa: E402

MS = "com.microsoft"
LAYERS = 24
# (name, K, N, count per layer); the lm_head once per token.
SHAPES = [("q", 896, 896, 1), ("k_v", 896, 128, 2), ("o", 896, 896, 1), ("gate_up", 896, 4864, 2),
          ("down", 4864, 896, 1), ("lm_head", 896, 151936, 0)]
BLOCK = 32
# At most this many copies of one shape's weights (k/v: 128 x 75 KB = 9.6 MB, which partly stays in L3).
MAX_COPIES = 128


def _weights(k: int, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    nb = k // BLOCK
    return {"b": rng.integers(0, 256, (n, nb, BLOCK // 2), dtype=np.uint8),
            "s": (rng.random(n * nb) * 0.01 + 0.001).astype(np.float32),
            "zp": rng.integers(0, 256, (n, (nb + 1) // 2), dtype=np.uint8)}


def _node(k: int, n: int, accuracy_level: int) -> onnx.NodeProto:
    return helper.make_node("MatMulNBits", ["a", "b", "s", "zp"], ["y"], domain=MS, K=k, N=n, bits=4,
                            block_size=BLOCK, accuracy_level=accuracy_level)


def _kernel(k: int, n: int, w: dict[str, np.ndarray]):
    node = _node(k, n, 4)
    kern = lookup(MS, "MatMulNBits", 1)(node, KernelContext(1, {MS: 1, "": 17}))
    for i, name in ((1, "b"), (2, "s"), (3, "zp")):
        arr = w[name]
        info = TensorInfo(name, arr.dtype, arr.shape, helper.np_dtype_to_tensor_dtype(arr.dtype))
        kern.use_prepacked(i, kern.prepack(i, arr))
        assert kern.check_packed(i, info, (kern._packed[i],)) is None
    return kern


def _ort(k: int, n: int, w: dict[str, np.ndarray], accuracy_level: int, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        [_node(k, n, accuracy_level)], "bench",
        [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(v, name) for name, v in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=9)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _packed_bytes(k: int, n: int) -> int:
    """Bytes one call reads from the packed weight: int4 B, float32 scales, uint8 zero points."""
    nb = -(-k // BLOCK)
    return n * nb * (BLOCK // 2 + 4 + 1)


def _measure(impl: str, m: int, threads: int, repeat: int, stream_mb: float) -> dict:
    """One implementation over every shape for one row count (run in a child process)."""
    if impl == "onnxpack-numpy":
        os.environ["ONNXPACK_DISABLE_JIT"] = "1"
    else:
        os.environ.pop("ONNXPACK_DISABLE_JIT", None)
    try:
        import numba
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    out = {}
    for si, (name, k, n, _) in enumerate(SHAPES):
        copies = min(MAX_COPIES, max(1, -(-int(stream_mb * 1e6) // _packed_bytes(k, n)))) if m == 1 and stream_mb > 0 else 1
        fns = []
        for c in range(copies):
            w = _weights(k, n, si + 1000 * c)
            if impl.startswith("ort-"):
                sess = _ort(k, n, w, int(impl[-1]), threads)
                fns.append(lambda sess=sess: sess.run(None, {"a": a}))
            else:
                kern = _kernel(k, n, w)
                fns.append(lambda kern=kern: kern.run(a))
        a = np.random.default_rng(100 + m).standard_normal((m, k)).astype(np.float32)
        turn = [0]

        def fn():
            f = fns[turn[0] % len(fns)]
            turn[0] += 1
            return f()

        reps = max(3, repeat // (10 if n > 100_000 else 1) // (4 if m > 16 else 1))
        reps = max(reps, 2 * len(fns)) if len(fns) > 1 else reps
        y = fns[0]()[0]
        for f in fns[1:]:
            f()
        out[f"{name}/{m}"] = {"ms": _median_ms(fn, reps), "checksum": float(np.abs(y).sum()), "copies": copies}
    return out


def _read_bandwidth() -> dict[str, float]:
    """GB/s of a numpy float32 sum over 256 MB, on 1 and on 2 threads (best of 5 each)."""
    import threading

    x = np.ones(64 << 20, np.float32)
    x.sum()
    res = {}
    for nth in (1, 2):
        parts = np.array_split(x, nth)
        best = float("inf")
        for _ in range(5):
            ths = [threading.Thread(target=p.sum) for p in parts]
            t0 = time.perf_counter()
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            best = min(best, time.perf_counter() - t0)
        res[f"{nth}t"] = x.nbytes / best / 1e9
    return res


_CHILD = ("import sys, json; sys.argv[1:1] = []; import bench_int4 as b; print(json.dumps(b._measure(sys.argv[1], "
          "int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))))")
_CHILD_BW = "import json, bench_int4 as b; print(json.dumps(b._read_bandwidth()))"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--rows", default="1,128", help="comma-separated row counts M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy path (slow for the lm_head)")
    ap.add_argument("--stream-mb", type=float, default=96.0,
                    help="M=1: cycle through copies of the weights totalling this many MB (0: one copy, cache-hot)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "int4.json"))
    args = ap.parse_args(argv)
    os.environ.pop("ONNXPACK_DISABLE_JIT", None)
    try:
        import numba
        numba_version = numba.__version__
    except ImportError:
        numba_version = None
        print("numba not installed: onnxpack-jit is the numpy path", file=sys.stderr)
    rows_list = [int(r) for r in args.rows.split(",")]
    impls = ["onnxpack-jit"] + ([] if args.no_numpy else ["onnxpack-numpy"]) + ["ort-acc4", "ort-acc0"]
    rounds: dict[str, list[dict]] = {impl: [] for impl in impls}
    bandwidth = run_child(_CHILD_BW, what="read bandwidth")
    print("read bandwidth (numpy sum over 256 MB): " + "  ".join(f"{t} {v:.1f} GB/s" for t, v in bandwidth.items()))
    for r in range(args.rounds):
        for impl in impls:
            merged: dict = {}
            for m in rows_list:
                merged.update(run_child(_CHILD, impl, m, args.threads, args.repeat, args.stream_mb, what=f"{impl} M={m}"))
            rounds[impl].append(merged)
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(
            f"{impl} {sum(v['ms'] for v in rounds[impl][-1].values()):.1f}" for impl in impls), flush=True)
    results = []
    for name, k, n, per_layer in SHAPES:
        for m in rows_list:
            key = f"{name}/{m}"
            per_round = {impl: [rd[key]["ms"] for rd in rounds[impl]] for impl in impls}
            sums = {impl: rounds[impl][0][key]["checksum"] for impl in impls}
            results.append({"shape": name, "K": k, "N": n, "M": m, "per_layer": per_layer,
                            "ms": {impl: statistics.median(v) for impl, v in per_round.items()},
                            "rounds_ms": per_round, "output_abs_sum": sums})
    table = [["shape", "K", "N", "M"] + [f"{lb} ms" for lb in impls] + ["jit/acc4", "jit/acc0", "jit GB/s",
                                                                       "acc4 GB/s"]]
    for r in results:
        gb = _packed_bytes(r["K"], r["N"]) / 1e6
        r["jit_GBps"] = gb / r["ms"]["onnxpack-jit"]
        table.append([r["shape"], str(r["K"]), str(r["N"]), str(r["M"])] + [f"{r['ms'][lb]:.3f}" for lb in impls]
                     + [f"{r['ms']['onnxpack-jit'] / r['ms']['ort-acc4']:.2f}",
                        f"{r['ms']['onnxpack-jit'] / r['ms']['ort-acc0']:.2f}",
                        f"{gb / r['ms']['onnxpack-jit']:.1f}" if r["M"] == 1 else "",
                        f"{gb / r['ms']['ort-acc4']:.1f}" if r["M"] == 1 else ""])
    totals = {}
    for m in rows_list:
        tot = {lb: sum(r["ms"][lb] * (r["per_layer"] * LAYERS or 1) for r in results if r["M"] == m) for lb in impls}
        totals[m] = tot
        tok_gb = sum(_packed_bytes(k, n) * (per_layer * LAYERS or 1) for _, k, n, per_layer in SHAPES) / 1e6
        table.append([f"per token ({LAYERS} layers + lm_head)" if m == 1 else f"prefill {m} ({LAYERS} layers + lm_head)",
                      "", "", str(m)] + [f"{tot[lb]:.2f}" for lb in impls]
                     + [f"{tot['onnxpack-jit'] / tot['ort-acc4']:.2f}", f"{tot['onnxpack-jit'] / tot['ort-acc0']:.2f}",
                        f"{tok_gb / tot['onnxpack-jit']:.1f}" if m == 1 else "",
                        f"{tok_gb / tot['ort-acc4']:.1f}" if m == 1 else ""])
    print()
    print_table(table, left=1)
    payload = {
        "benchmark": "bench_int4", "machine": platform.machine(), "cpus": os.cpu_count(),
        "threads": args.threads, "rounds": args.rounds, "repeat": args.repeat, "stream_mb": args.stream_mb,
        "read_bandwidth_GBps": bandwidth,
        "onnxruntime": ort.__version__, "numpy": np.__version__, "numba": numba_version,
        "blas": blas_info(), "env_dropped": [v for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if v not in os.environ],
        "load_average": os.getloadavg(), "results": results, "per_token_ms": {str(m): t for m, t in totals.items()},
    }
    write_json(args.json, payload)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
