"""What the guarantees cost at a warm start: trusted, verified, and copied data files.

For the 100 MB models of bench_serialize (fp32 MatMul chain, fp16 MLP, int4 MatMulNBits chain),
optimized once, warm create in fresh processes (median of --repeats):

* default: the data file has the identity recorded when it was written (the seal): records are
  checked against its manifest, no weight is read;
* ``onnxpack.verify_prepacked=1``: every source weight digested, every blob checksummed;
* copied: the same files copied into another folder (new inodes, same bytes): the identity no
  longer matches, so default mode verifies in full too, then maps.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 benchmarks/bench_verify.py
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _models  # noqa: E402
from _common import BLAS_ENV, blas_info, print_table, run_child, write_json  # noqa: E402

_CHILD = r"""
import json, sys, time, warnings
import onnxpack
path, verify = sys.argv[1], sys.argv[2]
so = onnxpack.SessionOptions()
if verify == "1":
    so.add_session_config_entry("onnxpack.verify_prepacked", "1")
with warnings.catch_warnings():
    warnings.simplefilter("error", onnxpack.PrepackWarning)
    t0 = time.perf_counter()
    s = onnxpack.InferenceSession(path, so)
    t = time.perf_counter() - t0
st = s.get_prepack_stats()
print(json.dumps({"create_s": t, "mapped": st["blobs_from_model"], "packed": st["weights_packed"]}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    from onnxpack.cli import optimize_model

    gens = {"matmul_fp32": _models.make_matmul_model, "mlp_fp16": _models.make_fp16_mlp,
            "matmulnbits_int4": _models.make_int4_model}
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        for name, gen in gens.items():
            folder = pathlib.Path(tmp) / name
            folder.mkdir()
            src = folder / "m.onnx"
            gen(str(src))
            opt = folder / "opt.onnx"
            optimize_model(str(src), str(opt), progress=False, out=open("/dev/null", "w"))
            copied = pathlib.Path(tmp) / f"{name}-copy"
            copied.mkdir()
            for f in folder.iterdir():
                if f.name.startswith("opt.onnx"):
                    shutil.copy(f, copied / f.name)
            cases = {"default": (opt, "0"), "verify_prepacked=1": (opt, "1"), "copied (default)": (copied / "opt.onnx", "0")}
            res = {}
            for label, (path, verify) in cases.items():
                samples = [run_child(_CHILD, path, verify, drop_env=BLAS_ENV, what=f"{name} {label}")
                           for _ in range(args.repeats)]
                assert all(s["packed"] == 0 and s["mapped"] > 0 for s in samples), samples
                res[label] = {"median_s": statistics.median(s["create_s"] for s in samples), "samples": samples}
            results[name] = res
            base = res["default"]["median_s"]
            rows.append([name, *(f"{res[c]['median_s'] * 1e3:.1f} ms ({res[c]['median_s'] / base:.1f}x)" for c in cases)])
    print_table([["model (~100 MB)", "default", "verify_prepacked=1", "copied (default)"], *rows])
    write_json(HERE / "results" / "verify.json", {"blas": blas_info(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
