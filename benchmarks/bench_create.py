"""Session creation scales with the graph: many If nodes (each with two small branches).

Issue 12 found creation quadratic (16,000 If nodes took 11x as long as 4,000: outer-name unions
repeated per subgraph).  This builds N sequential If nodes reading a shared outer initializer
and a chained value, and times ``InferenceSession`` creation in fresh processes; the figure is
the ratio 16,000 / 4,000 (linear: 4; goal <= 4.5).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_create.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BLAS_ENV, BENCH_DIR, blas_info, print_table, run_child, write_json  # noqa: E402


def make_if_chain(path: str, n: int) -> None:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    F = TensorProto.FLOAT
    nodes = []
    prev = "x"
    for k in range(n):
        then = helper.make_graph([helper.make_node("Add", [prev, "w"], [f"t{k}"])], f"then{k}", [],
                                 [helper.make_tensor_value_info(f"t{k}", F, [4])])
        other = helper.make_graph([helper.make_node("Sub", [prev, "w"], [f"e{k}"])], f"else{k}", [],
                                  [helper.make_tensor_value_info(f"e{k}", F, [4])])
        nodes.append(helper.make_node("If", ["c"], [f"h{k}"], name=f"if{k}", then_branch=then, else_branch=other))
        prev = f"h{k}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    graph = helper.make_graph(nodes, "ifs", [helper.make_tensor_value_info("x", F, [4]),
                                              helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F, [4])],
                              [numpy_helper.from_array(np.ones(4, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


_CHILD = """
import json, sys, time
import numpy as np
import onnxpack
path = sys.argv[1]
t0 = time.perf_counter()
s = onnxpack.InferenceSession(path)
t = time.perf_counter() - t0
y = s.run(None, {"x": np.zeros(4, np.float32), "c": np.array(True)})[0]
print(json.dumps({"create_s": t, "y0": float(y[0])}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,4000,16000")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            path = os.path.join(tmp, f"ifs{n}.onnx")
            make_if_chain(path, n)
            samples = []
            for _ in range(args.runs):
                r = run_child(_CHILD, path, drop_env=BLAS_ENV, what=f"{n} If nodes")
                assert r["y0"] == float(n), r  # every branch ran: x + n * w
                samples.append(r["create_s"])
            results[n] = {"create_s": samples, "median_s": statistics.median(samples)}
    base = sizes[1] if len(sizes) > 1 else sizes[0]
    for n in sizes:
        med = results[n]["median_s"]
        rows.append([f"{n}", f"{med * 1e3:.0f} ms", f"{med / results[base]['median_s']:.2f}x",
                     f"{med / n * 1e6:.0f} us"])
    print_table([["If nodes", "create (median)", f"vs {base}", "per node"], *rows])
    ratio = results[sizes[-1]]["median_s"] / results[base]["median_s"]
    print(f"{sizes[-1]} / {base}: {ratio:.2f}x (linear would be {sizes[-1] / base:.1f}x; goal <= 4.5x)")
    write_json(BENCH_DIR / "results" / "create.json",
               {"blas": blas_info(), "results": {str(k): v for k, v in results.items()}, "ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
