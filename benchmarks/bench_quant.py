"""Quantized models and kernels: onnxpack's native integer kernels vs onnxruntime.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_quant.py \\
        [--threads 1 2] [--repeat 15] [--size 128] [--json benchmarks/results/quant.json]

Builds a ResNet-like float CNN in code (20 convolutions, widths 32-256, 128x128 input), quantizes
it with ``onnxruntime.quantization`` three ways (``quantize_dynamic``: DynamicQuantizeLinear +
ConvInteger; ``quantize_static`` QOperator per channel: QLinearConv + QLinearAdd; QDQ per
channel), and times whole-model runs of onnxpack and onnxruntime side by side: the two sessions
alternate call by call, so a busy machine slows both alike; medians of ``--repeat`` calls after a
warm-up.  onnxpack's BLAS threads and onnxruntime's intra-op threads are set to the same count
(threadpoolctl; onnxruntime spinning off).  Then single-node kernels (ConvInteger, QLinearConv,
MatMulInteger, packed weights) and the exact chunked sgemm vs a plain (inexact) sgemm vs dgemm.

Then (``--encoder``, default the cached BERT-base export that ``bench_deployed.py`` uses; skipped
with the command that builds it when absent) the same three quantizations of a transformer encoder
(batch 1, 128 tokens; per tensor, as the quantizer's defaults), each against onnxruntime with its
default optimizations (as users run it), with the largest output difference from onnxruntime
without optimizations beside onnxruntime's own optimized-vs-unoptimized difference: a deep
quantized model amplifies last-bit differences (a LayerNormalization or erf one ulp apart flips a
code, which later layers carry).

Note: on the shared 2-core dev machine, OpenBLAS's second thread stalls whenever the other core
is busy (timings jump by 10x); the one-thread figures are the stable ones there.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnxpack
from onnxpack.session.kernels import KernelContext, TensorInfo, lookup
from onnxpack.session.kernels.qinteger import exact_matmul

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import blas_info, print_table, write_json  # noqa: E402


def resnet_like(size: int = 128, width: int = 32, blocks=(2, 2, 2, 2), seed: int = 0) -> onnx.ModelProto:
    """Stem conv (stride 2), four stages of basic blocks (3x3, 3x3, residual Add), 1x1 shortcuts."""
    rng = np.random.default_rng(seed)
    inits, nodes, k = [], [], [0]

    def fresh(prefix):
        k[0] += 1
        return f"{prefix}{k[0]}"

    def conv(x, cin, cout, ks=3, stride=1, relu=True):
        w, b, y = fresh("w"), fresh("b"), fresh("t")
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((cout, cin, ks, ks)) * np.sqrt(2 / (cin * ks * ks))).astype(np.float32), w))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.05).astype(np.float32), b))
        nodes.append(helper.make_node("Conv", [x, w, b], [y], pads=[ks // 2] * 4, strides=[stride] * 2))
        if not relu:
            return y
        nodes.append(helper.make_node("Relu", [y], [y + "r"]))
        return y + "r"

    x, cin = conv("x", 3, width, 3, 2), width
    for stage, nblocks in enumerate(blocks):
        cout = width * 2**stage
        for block in range(nblocks):
            stride = 2 if block == 0 and stage > 0 else 1
            h = conv(conv(x, cin, cout, 3, stride), cout, cout, 3, 1, relu=False)
            short = x if stride == 1 and cin == cout else conv(x, cin, cout, 1, stride, relu=False)
            a = fresh("add")
            nodes.append(helper.make_node("Add", [h, short], [a]))
            nodes.append(helper.make_node("Relu", [a], [a + "r"]))
            x, cin = a + "r", cout
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["y"]))
    graph = helper.make_graph(nodes, "resnet_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def quantized_models(folder: pathlib.Path, size: int) -> dict[str, pathlib.Path]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_dynamic, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter([{"x": np.random.default_rng(i).standard_normal((1, 3, size, size)).astype(np.float32)}
                             for i in range(4)])

        def get_next(self):
            return next(self._it, None)

    src = folder / "float.onnx"
    onnx.save(resnet_like(size), str(src))
    out = {"float": src, "dynamic (ConvInteger)": folder / "dynamic.onnx",
           "QOperator per-channel": folder / "qop.onnx", "QDQ per-channel": folder / "qdq.onnx"}
    quantize_dynamic(str(src), str(out["dynamic (ConvInteger)"]))
    quantize_static(str(src), str(out["QOperator per-channel"]), Reader(), quant_format=QuantFormat.QOperator, per_channel=True)
    quantize_static(str(src), str(out["QDQ per-channel"]), Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    return out


ENCODER = pathlib.Path(os.environ.get("ONNXPACK_MODELS_CACHE", pathlib.Path.home() / ".cache" / "onnxpack" / "models")) / "bert-base-export" / "model.onnx"
ENCODER_BUILD = "/work/side/bin/python models/make_transformers.py --shape bert-base"


def quantized_encoders(folder: pathlib.Path, src: pathlib.Path) -> dict[str, pathlib.Path]:
    """The float encoder and its QOperator, QDQ (static, 4 random calibration batches) and dynamic
    quantizations, written to ``folder``."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter([encoder_feeds(src, seed) for seed in range(4)])

        def get_next(self):
            return next(self._it, None)

    out = {"encoder float": src, "encoder QOperator": folder / "enc_qop.onnx", "encoder QDQ": folder / "enc_qdq.onnx",
           "encoder dynamic": folder / "enc_qd.onnx"}
    quantize_static(str(src), str(out["encoder QOperator"]), Reader(), quant_format=QuantFormat.QOperator,
                    use_external_data_format=True)
    quantize_static(str(src), str(out["encoder QDQ"]), Reader(), quant_format=QuantFormat.QDQ, use_external_data_format=True)
    quantize_dynamic(str(src), str(out["encoder dynamic"]), weight_type=QuantType.QInt8, use_external_data_format=True)
    return out


def encoder_feeds(path: pathlib.Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Batch 1, 128 tokens: random ids, a mask of ones, token types 0."""
    rng = np.random.default_rng(seed)
    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    return {n: rng.integers(0, 1000, (1, 128)) if n == "input_ids" else
            (np.ones((1, 128), np.int64) if n == "attention_mask" else np.zeros((1, 128), np.int64)) for n in names}


def encoder_rows(models: dict[str, pathlib.Path], threads: int, repeat: int) -> list[dict]:
    rows = []
    for name, path in models.items():
        feeds = encoder_feeds(path)
        sess = onnxpack.InferenceSession(str(path))
        ref = _ort_session(path, threads)
        plain = _ort_session(path, threads, optimize=False).run(None, feeds)[0]
        t = side_by_side({"onnxpack": lambda: sess.run(None, feeds), "ort": lambda: ref.run(None, feeds)}, repeat)
        ours, theirs = sess.run(None, feeds)[0], ref.run(None, feeds)[0]
        rows.append(dict(model=name, threads=threads, onnxpack_ms=t["onnxpack"], ort_ms=t["ort"],
                         ratio=t["onnxpack"] / t["ort"], fallback_nodes=len(sess.get_fallback_nodes()),
                         output_scale=float(np.abs(plain).max()),
                         max_diff_vs_ort_unoptimized=float(np.abs(ours.astype(np.float64) - plain).max()),
                         ort_optimized_vs_unoptimized=float(np.abs(theirs.astype(np.float64) - plain).max())))
    return rows


def _ort_session(model, threads: int, optimize: bool = True) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = str(model) if isinstance(model, pathlib.Path) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def side_by_side(fns: dict[str, callable], repeat: int, warm_s: float = 1.0, warm_calls: int = 20) -> dict[str, float]:
    """Median ms of each callable, calls interleaved (one of each per round) after a warm-up of at
    least ``warm_calls`` calls and ``warm_s`` seconds of each (an onnxpack session on several
    threads first measures its two thread modes, one of them BLAS's own threads: a QOperator
    BERT-base ran 3x slower in that block than after it)."""
    for fn in fns.values():
        t0, calls = time.perf_counter(), 0
        while calls < warm_calls or time.perf_counter() - t0 < warm_s:
            fn()
            calls += 1
    times = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def model_rows(models: dict[str, pathlib.Path], size: int, threads: int, repeat: int) -> list[dict]:
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, size, size)).astype(np.float32)}
    rows = []
    for name, path in models.items():
        sess = onnxpack.InferenceSession(str(path))
        ref = _ort_session(path, threads)
        t = side_by_side({"onnxpack": lambda: sess.run(None, feeds), "ort": lambda: ref.run(None, feeds)}, repeat)
        counts = {}
        for n in onnx.load(str(path), load_external_data=False).graph.node:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
        rows.append(dict(model=name, threads=threads, onnxpack_ms=t["onnxpack"], ort_ms=t["ort"],
                         ratio=t["onnxpack"] / t["ort"], fallback_nodes=len(sess.get_fallback_nodes()),
                         ops=counts))
    return rows


def _kernel_fn(node, inputs, pack: int, opset: int):
    cls = lookup(node.domain, node.op_type, opset)
    kernel = cls(node, KernelContext(opset, {"": 17, "com.microsoft": 1}))
    w = inputs[pack]
    info = TensorInfo(node.input[pack], w.dtype, w.shape, helper.np_dtype_to_tensor_dtype(w.dtype))
    kernel.pack_spec(pack, info)
    kernel.use_prepacked(pack, kernel.prepack(pack, w))
    args = list(inputs)
    args[pack] = None
    return lambda: kernel.run(*args)


def _ort_node_fn(node, inputs, consts, threads):
    feeds = {n: v for i, (n, v) in enumerate(zip(node.input, inputs)) if n and i not in consts}
    graph = helper.make_graph(
        [node], "k",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in feeds.items()],
        [helper.make_value_info(o, onnx.TypeProto()) for o in node.output],
        [numpy_helper.from_array(inputs[i], node.input[i]) for i in consts],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(node.domain, 1)] if node.domain else [])
    sess = _ort_session(helper.make_model(graph, opset_imports=opsets, ir_version=9), threads)
    return lambda: sess.run(None, feeds)


def kernel_cases(rng):
    def u8(shape):
        return rng.integers(0, 256, shape).astype(np.uint8)

    def s8(shape):
        return rng.integers(-127, 128, shape).astype(np.int8)

    for cin, cout, k, hw in ((64, 64, 3, 56), (128, 128, 3, 28), (256, 256, 3, 14), (256, 64, 1, 56)):
        x, w = u8((1, cin, hw, hw)), s8((cout, cin, k, k))
        z8, zs = np.array(120, np.uint8), np.array(0, np.int8)
        node = helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["y"], pads=[k // 2] * 4)
        yield f"ConvInteger {cin}->{cout} k{k} {hw}x{hw}", node, [x, w, z8, zs], 1, [1, 2, 3]
        sc = np.array(0.01, np.float32)
        q = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"], pads=[k // 2] * 4)
        ws = (rng.random(cout) * 0.01).astype(np.float32)
        b = rng.integers(-1000, 1000, cout).astype(np.int32)
        yield f"QLinearConv {cin}->{cout} k{k} {hw}x{hw}", q, [x, sc, z8, w, ws, np.zeros(cout, np.int8), np.array(0.5, np.float32), z8, b], 3, [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = u8((128, 768)), s8((768, 3072))
    node = helper.make_node("MatMulInteger", ["a", "b", "az"], ["y"])
    yield "MatMulInteger 128x768 @ 768x3072", node, [a, b, np.array(128, np.uint8)], 1, [1, 2]


def kernel_rows(threads: int, repeat: int) -> list[dict]:
    rows = []
    for name, node, inputs, pack, consts in kernel_cases(np.random.default_rng(0)):
        opset = 1 if node.domain else 17
        t = side_by_side({"onnxpack": _kernel_fn(node, inputs, pack, opset),
                          "ort": _ort_node_fn(node, inputs, consts, threads)}, repeat)
        rows.append(dict(kernel=name, threads=threads, onnxpack_ms=t["onnxpack"], ort_ms=t["ort"], ratio=t["onnxpack"] / t["ort"]))
    return rows


def gemm_rows(repeat: int) -> list[dict]:
    rng = np.random.default_rng(1)
    rows = []
    for m, k, n in ((64, 576, 3136), (128, 1152, 784), (256, 2304, 196), (2048, 512, 128)):
        a = rng.integers(-255, 256, (m, k)).astype(np.float32)
        b = rng.integers(-128, 128, (k, n)).astype(np.float32)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        t = side_by_side({"sgemm": lambda: a @ b, "exact": lambda: exact_matmul(a, b, 255 * 128),
                          "dgemm": lambda: a64 @ b64}, repeat)
        rows.append(dict(shape=f"{m}x{k}x{n}", sgemm_ms=t["sgemm"], exact_chunked_ms=t["exact"], dgemm_ms=t["dgemm"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--size", type=int, default=128, help="input height and width of the CNN")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--encoder", default=str(ENCODER), help="float transformer encoder to quantize ('' skips)")
    args = ap.parse_args(argv)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - in the bench extra
        threadpool_limits = None
    result = {"models": [], "encoders": [], "kernels": [], "gemm": [], "blas": blas_info(),
              "loadavg_before": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp:
        models = quantized_models(pathlib.Path(tmp), args.size)
        encoders = {}
        if args.encoder and pathlib.Path(args.encoder).exists():
            encoders = quantized_encoders(pathlib.Path(tmp), pathlib.Path(args.encoder))
        elif args.encoder:
            print(f"no encoder at {args.encoder}: build it with `{ENCODER_BUILD}` (skipped)")
        for threads in args.threads:
            ctx = threadpool_limits(threads) if threadpool_limits else None
            try:
                result["models"] += model_rows(models, args.size, threads, args.repeat)
                result["encoders"] += encoder_rows(encoders, threads, args.repeat)
                result["kernels"] += kernel_rows(threads, args.repeat)
                if threads == 1:
                    result["gemm"] = gemm_rows(args.repeat)
            finally:
                if ctx is not None:
                    ctx.restore_original_limits()
    print_table([["model", "threads", "onnxpack ms", "ort ms", "ratio", "fallback"]] + [
        [r["model"], str(r["threads"]), f"{r['onnxpack_ms']:.1f}", f"{r['ort_ms']:.1f}", f"{r['ratio']:.2f}",
         str(r["fallback_nodes"])] for r in result["models"]])
    if result["encoders"]:
        print()
        print_table([["encoder (1 x 128)", "threads", "onnxpack ms", "ort ms", "ratio", "max |diff| vs ort unoptimized",
                      "ort's own optimized vs unoptimized", "output scale"]] + [
            [r["model"], str(r["threads"]), f"{r['onnxpack_ms']:.1f}", f"{r['ort_ms']:.1f}", f"{r['ratio']:.2f}",
             f"{r['max_diff_vs_ort_unoptimized']:.2g}", f"{r['ort_optimized_vs_unoptimized']:.2g}",
             f"{r['output_scale']:.2g}"] for r in result["encoders"]])
    print()
    print_table([["kernel (packed weights)", "threads", "onnxpack ms", "ort ms", "ratio"]] + [
        [r["kernel"], str(r["threads"]), f"{r['onnxpack_ms']:.2f}", f"{r['ort_ms']:.2f}", f"{r['ratio']:.2f}"]
        for r in result["kernels"]])
    print()
    print_table([["integer GEMM M x K x N (1 thread)", "sgemm ms (inexact)", "exact chunked ms", "dgemm ms"]] + [
        [r["shape"], f"{r['sgemm_ms']:.2f}", f"{r['exact_chunked_ms']:.2f}", f"{r['dgemm_ms']:.2f}"] for r in result["gemm"]])
    result["loadavg_after"] = list(os.getloadavg())
    print(f"load average before/after: {result['loadavg_before'][0]:.1f} / {result['loadavg_after'][0]:.1f}")
    print("BLAS:", "; ".join(f"{b.get('internal_api')} {b.get('version')} {b.get('architecture')}" for b in result["blas"]))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
