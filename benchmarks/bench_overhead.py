"""Per-node overhead: µs per node on a 1,000-node chain of small ops, onnxpack vs onnxruntime.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_overhead.py [--nodes 1000] [--runs 31]

The chain alternates Add (with a constant), Mul (with a constant) and Relu on a float32 [1, 16]
tensor, so every kernel does ~1 µs of numpy work: what is left is the executor's per-step cost
(argument gathering, dispatch, storing and releasing values) and each kernel's Python wrapper.
Also reported: the same chain timed kernel by kernel outside the executor (the floor the loop
cannot go below) and onnxruntime (spinning off, 1 thread) on the same model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import onnxpack  # noqa: E402
from _common import write_json  # noqa: E402

OPS = ("Add", "Mul", "Relu")


def chain_model(n: int, width: int = 16) -> bytes:
    nodes, prev = [], "x"
    inits = [numpy_helper.from_array(np.full((width,), 0.5, np.float32), "c_add"),
             numpy_helper.from_array(np.full((width,), 0.999, np.float32), "c_mul")]
    for k in range(n):
        op = OPS[k % len(OPS)]
        out = "y" if k == n - 1 else f"t{k}"
        ins = [prev] if op == "Relu" else [prev, "c_add" if op == "Add" else "c_mul"]
        nodes.append(helper.make_node(op, ins, [out], name=f"n{k}"))
        prev = out
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m.SerializeToString()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=31)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "overhead.json"))
    args = ap.parse_args(argv)
    model = chain_model(args.nodes)
    sess = onnxpack.InferenceSession(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    theirs = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    feed = {"x": np.random.default_rng(0).standard_normal((1, 16), dtype=np.float32)}
    plan = sess.program.root

    def kernels_only():
        values = dict(plan.constants)
        values["x"] = feed["x"]
        for step in plan.steps:
            args = [values.get(n) for n in step.inputs]
            values[step.outputs[0]] = step.kernel.run(*args)[0]

    runners = {"onnxpack": lambda: sess.run(None, feed), "kernels only": kernels_only,
               "onnxruntime": lambda: theirs.run(None, feed)}
    for fn in runners.values():
        fn()
    times = {k: [] for k in runners}
    for _ in range(args.runs):
        for k, fn in runners.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    # The fastest run is the figure least disturbed by other processes on a shared machine (as
    # timeit reports); the median is printed beside it.
    us = {k: min(v) / args.nodes * 1e6 for k, v in times.items()}
    med = {k: statistics.median(v) / args.nodes * 1e6 for k, v in times.items()}
    print(f"{args.nodes}-node chain of {'/'.join(OPS)} on float32[1,16], best (median) of {args.runs}:")
    for k, v in us.items():
        print(f"  {k:14s} {v:6.2f} ({med[k]:.2f}) us per node")
    print(f"  executor overhead (onnxpack - kernels only): {us['onnxpack'] - us['kernels only']:.2f} us per node")
    write_json(args.json, {"nodes": args.nodes, "us_per_node_best": us, "us_per_node_median": med, "all_s": times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
