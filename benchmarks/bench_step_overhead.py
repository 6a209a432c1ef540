"""Per-node overhead of the step loop: a chain of 1,000 tiny ops, run plain and with run controls.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_step_overhead.py \
        [--nodes 1000] [--runs 200] [--rounds 7] [--modes plain,run_options,terminate_hook,profiling]

The model is ``x -> Neg -> Neg -> ... -> y`` on a float32[16] tensor: the kernels do almost
nothing, so the time per node is the executor's own cost (argument gathering, the kernel call,
storing and releasing values).  Modes:

* ``plain``: ``session.run(None, feed)`` — the plain loop, no hook;
* ``run_options``: ``session.run(None, feed, RunOptions())`` — a RunOptions is passed, so each
  step goes through the run-control hook that checks ``terminate``;
* ``profiling``: a session created with ``enable_profiling`` — each step is timed and recorded.

Rounds interleave the modes (one batch of each per round) so machine noise hits all alike; the
figures are the median and the minimum over rounds of (batch time / runs / nodes) — on a shared
machine the minimum is the steadier estimate of the loop's own cost.  Run it against two checkouts
(``PYTHONPATH=<checkout>``) to compare before/after; a checkout without RunOptions or profiling
measures ``plain`` only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from onnx import TensorProto, helper


def chain_model(nodes: int) -> bytes:
    names = ["x"] + [f"t{i}" for i in range(nodes - 1)] + ["y"]
    graph = helper.make_graph(
        [helper.make_node("Neg", [names[i]], [names[i + 1]], name=f"neg{i}") for i in range(nodes)], "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=100, help="runs per batch")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--modes", default="plain,run_options,profiling")
    args = ap.parse_args(argv)
    import onnxpack

    model = chain_model(args.nodes)
    feed = {"x": np.arange(16, dtype=np.float32)}
    calls = {}
    modes = args.modes.split(",")
    plain = onnxpack.InferenceSession(model)
    if "plain" in modes:
        calls["plain"] = lambda: plain.run(None, feed)
    if "run_options" in modes and hasattr(onnxpack, "RunOptions"):
        ro = onnxpack.RunOptions()
        calls["run_options"] = lambda: plain.run(None, feed, ro)
    if "profiling" in modes and hasattr(onnxpack, "RunOptions"):
        so = onnxpack.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = "/tmp/onnxpack_bench_profile"
        prof = onnxpack.InferenceSession(model, so)
        calls["profiling"] = lambda: prof.run(None, feed)
    for f in calls.values():  # warm-up
        f()
    per_node: dict[str, list[float]] = {m: [] for m in calls}
    for _ in range(args.rounds):
        for mode, f in calls.items():
            t0 = time.perf_counter()
            for _ in range(args.runs):
                f()
            per_node[mode].append((time.perf_counter() - t0) / args.runs / args.nodes)
    result = {m: statistics.median(v) * 1e6 for m, v in per_node.items()}
    best = {m: min(v) * 1e6 for m, v in per_node.items()}
    print(json.dumps({"onnxpack": onnxpack.__file__, "nodes": args.nodes, "us_per_node": result,
                      "us_per_node_min": best}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
