"""``onnxpack demo``: generate a model, optimize it, compare cold (packing) and warm (mapped) starts.

The demo model is generated on the fly into a temp folder: an fp16 MLP (MatMul + Relu layers,
2048-wide by default) whose MatMul kernels widen each fp16 weight to float32 when packing — the
conversion every fp16 model pays at every start unless the packed blobs are saved and mapped.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import numpy as np

from onnxpack.cli._measure import compare
from onnxpack.cli.optimize import optimize_model
from onnxpack.errors import InvalidArgument

__all__ = ["HELP", "add_arguments", "run", "make_demo_model"]

HELP = "generate a model, optimize it, compare cold (packing) and warm (mapped) starts"

# The demo model: fp16 MLP, 2048 wide.  64 MiB of fp16 weights (8 layers) packs to 128 MiB of
# float32 blobs: large enough that packing cost and memory are visible over Python's own ~30 MB,
# small enough that generating, optimizing and 2 x 3 fresh-process starts stay under ~30 s on
# 2 cores.
DEMO_DIM = 2048
DEMO_SIZE_MB = 64
DEMO_REPEATS = 3


def make_demo_model(folder: str, size_mb: float = DEMO_SIZE_MB, dim: int = DEMO_DIM) -> str:
    """Writes an fp16 MLP with about ``size_mb`` MB of weights to ``folder/demo_mlp.onnx``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from onnxpack.graph import save_model

    layer_bytes = dim * dim * 2
    n_layers = max(1, round(size_mb * 1e6 / layer_bytes))
    if size_mb * 1e6 < layer_bytes:  # small sizes (tests): shrink the width instead
        dim = max(16, int(math.sqrt(size_mb * 1e6 / 2)) // 16 * 16)
        n_layers = 2
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(n_layers):
        w = (rng.standard_normal((dim, dim), dtype=np.float32) / math.sqrt(dim)).astype(np.float16)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        out = "y" if i == n_layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"fc{i}"))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [out], name=f"relu{i}"))
        prev = out
    h = TensorProto.FLOAT16
    graph = helper.make_graph(nodes, "demo_fp16_mlp", [helper.make_tensor_value_info("x", h, [4, dim])],
                              [helper.make_tensor_value_info("y", h, [4, dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="onnxpack-demo")
    model.ir_version = 9
    path = os.path.join(folder, "demo_mlp.onnx")
    save_model(model, path, min_size=1024)
    del model, inits
    onnx.checker.check_model(path)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, default=DEMO_SIZE_MB,
                   help=f"fp16 weight megabytes of the generated model (default {DEMO_SIZE_MB})")
    p.add_argument("--repeats", type=int, default=DEMO_REPEATS,
                   help=f"fresh processes per row; the median is shown (default {DEMO_REPEATS})")
    p.add_argument("--processes", type=int, default=1,
                   help="also run this many processes at once and show their total PSS")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="write the models to DIR (kept) instead of a temp folder")


def run(args: argparse.Namespace) -> int:
    """Generate an fp16 MLP, optimize it with blobs, compare cold and warm starts."""
    if args.size_mb <= 0 or args.repeats < 1 or args.processes < 1:
        raise InvalidArgument("demo: --size-mb must be > 0, --repeats and --processes >= 1")
    with tempfile.TemporaryDirectory(prefix="onnxpack-demo-") as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        for sub in ("cold", "warm"):
            os.makedirs(os.path.join(tmp, sub), exist_ok=True)
        t0 = time.perf_counter()
        model = make_demo_model(folder, args.size_mb)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                   if f.startswith("demo_mlp.onnx"))
        print(f"1. generated {model} ({size / 1e6:.1f} MB, fp16 MLP) in {time.perf_counter() - t0:.1f} s")
        optimized = os.path.join(folder, "demo_mlp.opt.onnx")
        print("2. onnxpack optimize (pre-pack and save the blobs next to the weights):")
        optimize_model(model, optimized, progress=False)
        print("3. fresh processes: cold = original model (packs every weight), "
              "warm = optimized model (maps the saved blobs)")
        compare(model, optimized, tmp, repeats=args.repeats, sessions=1, processes=args.processes)
    return 0
