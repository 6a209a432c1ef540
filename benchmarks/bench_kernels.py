"""Per-kernel latency: onnxpack's native kernels (packed and unpacked) vs onnxruntime, one node each.

Usage::

    python benchmarks/bench_kernels.py [--repeat 9] [--threads N] [--json out.json]

Prints one row per case: median milliseconds of the native kernel with pre-packed weights, without
(raw weights, converted per call), and onnxruntime running the same single node with its weights
as initializers.  Timings are medians of ``--repeat`` runs after one warm-up.

Note (measured on the 2-core AVX-512 dev machine): OpenBLAS 0.3.31's runtime detection picks its
Haswell (AVX2) kernels there; ``OPENBLAS_CORETYPE=SkylakeX`` set in the environment before numpy
is imported makes sgemm ~1.7x faster.  On a machine shared with other busy processes, OpenBLAS's
threads stall (timings jump in 4-8 ms steps): compare with ``--threads 1`` there.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from onnxpack.session.kernels import KernelContext, TensorInfo, lookup

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import blas_info, median_seconds, write_json  # noqa: E402


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    return median_seconds(fn, repeat) * 1e3


def _kernel(node, opset: int, domain_opsets: dict[str, int]):
    cls = lookup(node.domain, node.op_type, opset)
    return cls(node, KernelContext(opset, domain_opsets))


def _pack(kernel, node, index: int, weight: np.ndarray) -> None:
    info = TensorInfo(node.input[index], weight.dtype, weight.shape, helper.np_dtype_to_tensor_dtype(weight.dtype))
    if kernel.pack_spec(index, info) is None:
        return
    kernel.use_prepacked(index, kernel.prepack(index, weight))


def _ort(node, feeds: dict[str, np.ndarray], weights: dict[str, np.ndarray], opsets, threads: int):
    graph = helper.make_graph(
        [node],
        "bench",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in feeds.items()],
        [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o],
        [numpy_helper.from_array(v, n) for n, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()], ir_version=8)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, feeds)


def _case(name, node, inputs: list[np.ndarray | None], const: list[int], opset, repeat, threads, domain_opsets=None):
    domain_opsets = domain_opsets or {"": opset}
    packed = _kernel(node, opset, domain_opsets)
    feeds_packed = list(inputs)
    for i in const:
        w = inputs[i].copy()
        w.setflags(write=False)
        _pack(packed, node, i, w)
        feeds_packed[i] = None if _is_packed(packed, node, i, w) else inputs[i]
    raw = _kernel(node, opset, domain_opsets)
    t_packed = _median_ms(lambda: packed.run(*feeds_packed), repeat)
    t_raw = _median_ms(lambda: raw.run(*inputs), repeat)
    feeds = {n: v for i, (n, v) in enumerate(zip(node.input, inputs)) if n and v is not None and i not in const}
    weights = {node.input[i]: inputs[i] for i in const}
    t_ort = _median_ms(_ort(node, feeds, weights, domain_opsets, threads), repeat)
    return dict(case=name, packed_ms=t_packed, unpacked_ms=t_raw, ort_ms=t_ort, ratio_vs_ort=t_packed / t_ort)


def _is_packed(kernel, node, i, w) -> bool:
    info = TensorInfo(node.input[i], w.dtype, w.shape, helper.np_dtype_to_tensor_dtype(w.dtype))
    return kernel.pack_spec(i, info) is not None


def cases(rng: np.random.Generator):
    f32, f16 = np.float32, np.float16
    # MLP layer, batch 64 (BLAS-bound), fp32 and fp16 weights.
    for dtype in (f32, f16):
        a = rng.standard_normal((64, 1024)).astype(dtype)
        b = (rng.standard_normal((4096, 1024)) * 0.03).astype(dtype)
        c = rng.standard_normal(4096).astype(dtype)
        yield f"Gemm 64x1024x4096 transB {np.dtype(dtype).name}", helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1), [a, b, c], [1, 2], 13
    a = rng.standard_normal((1, 128, 768)).astype(f32)
    b = (rng.standard_normal((768, 3072)) * 0.03).astype(f32)
    yield "MatMul 1x128x768 @ 768x3072", helper.make_node("MatMul", ["a", "b"], ["y"]), [a, b], [1], 13
    # resnet50-like convolutions, batch 1.
    for cin, cout, k, s, hw in ((3, 64, 7, 2, 224), (64, 64, 3, 1, 56), (256, 64, 1, 1, 56), (128, 128, 3, 2, 56), (512, 512, 3, 1, 7)):
        x = rng.standard_normal((1, cin, hw, hw)).astype(f32)
        w = (rng.standard_normal((cout, cin, k, k)) * 0.05).astype(f32)
        bias = rng.standard_normal(cout).astype(f32)
        node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[k // 2] * 4, strides=[s, s])
        yield f"Conv {cin}->{cout} k{k} s{s} {hw}x{hw}", node, [x, w, bias], [1, 2], 17
    x = rng.standard_normal((1, 96, 56, 56)).astype(f32)
    w = rng.standard_normal((96, 1, 3, 3)).astype(f32)
    yield "Conv depthwise 96 k3 56x56", helper.make_node("Conv", ["x", "w"], ["y"], group=96, pads=[1] * 4), [x, w], [1], 17
    x = rng.standard_normal((1, 64, 112, 112)).astype(f32)
    yield "MaxPool k3 s2 112x112", helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4), [x], [], 17
    # LSTM, seq 32, batch 8.
    h, i = 256, 128
    xs = rng.standard_normal((32, 8, i)).astype(f32)
    w = (rng.standard_normal((1, 4 * h, i)) * 0.05).astype(f32)
    r = (rng.standard_normal((1, 4 * h, h)) * 0.05).astype(f32)
    bb = rng.standard_normal((1, 8 * h)).astype(f32) * 0.1
    yield "LSTM seq32 b8 h256", helper.make_node("LSTM", ["x", "w", "r", "b"], ["y", "yh", "yc"], hidden_size=h), [xs, w, r, bb], [1, 2, 3], 14


def nbits_cases(rng: np.random.Generator):
    k = n = 2048
    bs = 32
    nb = k // bs
    b = rng.integers(0, 256, (n, nb, bs // 2), dtype=np.uint8)
    scales = (rng.random(n * nb) * 0.02).astype(np.float32)
    zp = rng.integers(0, 256, (n, nb // 2), dtype=np.uint8)
    node = helper.make_node("MatMulNBits", ["a", "b", "s", "zp"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=bs)
    for m in (1, 64):
        a = rng.standard_normal((m, k)).astype(np.float32)
        yield f"MatMulNBits M={m} K=N={k} b{bs}", node, [a, b, scales, zp], [1, 2, 3], 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="onnxruntime intra-op threads")
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for name, node, inputs, const, opset in cases(rng):
        rows.append(_case(name, node, inputs, const, opset, args.repeat, args.threads))
    for name, node, inputs, const, opset in nbits_cases(rng):
        rows.append(_case(name, node, inputs, const, opset, args.repeat, args.threads, {"": 17, "com.microsoft": 1}))
    print(f"{'case':40s} {'packed ms':>10s} {'unpacked ms':>12s} {'ort ms':>8s} {'packed/ort':>10s}")
    for r in rows:
        print(f"{r['case']:40s} {r['packed_ms']:10.3f} {r['unpacked_ms']:12.3f} {r['ort_ms']:8.3f} {r['ratio_vs_ort']:10.2f}")
    blas = blas_info()
    print("BLAS:", "; ".join(f"{b.get('internal_api')} {b.get('version')} {b.get('architecture')} "
                               f"threads={b.get('num_threads')}" for b in blas))
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
