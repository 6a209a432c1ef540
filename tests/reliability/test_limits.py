"""Resource limits: a model declaring a 10^12-element tensor, or a file declaring a huge header,
index or record, is refused with a clear error before anything of that size is allocated.

Runs in a subprocess whose address space is capped (``RLIMIT_AS`` = what it uses after imports
plus 1 GiB), and measures each case's Python heap peak with ``tracemalloc``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import onnx
from onnx import TensorProto, helper

from onnxpack.prepack import cache_file as cf

import reliability_harness as harness

TERA = 10**12

CHILD = textwrap.dedent(r"""
    import json, os, resource, sys, tracemalloc, warnings
    from onnxpack import InferenceSession, SessionOptions
    from onnxpack.errors import OnnxpackError
    folder, cases = sys.argv[1], json.loads(sys.argv[2])
    warnings.simplefilter("ignore")
    InferenceSession(os.path.join(folder, "warmup.onnx")).close()
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    out = {}
    for name, cache in cases:
        opts = SessionOptions()
        if cache:
            opts.add_session_config_entry("onnxpack.prepacked_cache_path", os.path.join(folder, cache))
        tracemalloc.start()
        try:
            InferenceSession(os.path.join(folder, name), opts).close()
            result = "ok"
        except OnnxpackError as e:
            result = type(e).__name__ + ": " + str(e)[:300]
        except BaseException as e:
            result = "FOREIGN " + type(e).__name__ + ": " + str(e)[:300]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out[name + ("+" + cache if cache else "")] = [result, peak]
    print(json.dumps(out))
""")


def _model(w: TensorProto, shape=(2, 4)) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("MatMul", ["x", w.name], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _external(name, dims, length=None, offset="0"):
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims, data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value="w.bin")
    t.external_data.add(key="offset", value=offset)
    if length is not None:
        t.external_data.add(key="length", value=str(length))
    return t


def test_huge_declarations_fail_before_allocation(bases, tmp_path):
    (tmp_path / "w.bin").write_bytes(bytes(4096))
    cases = {
        "inproto-1e12.onnx": _model(TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[TERA])),
        "inproto-1e6x1e6.onnx": _model(TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[10**6, 10**6])),
        "inproto-overflow.onnx": _model(TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[2**62, 2**62])),
        "external-1e12-length.onnx": _model(_external("W", [TERA], length=4 * TERA)),
        "external-1e12-nolength.onnx": _model(_external("W", [TERA])),
        "external-1e12-huge-offset.onnx": _model(_external("W", [4, 3], length=48, offset=str(TERA))),
        "external-raw-1e12-typed.onnx": _model(TensorProto(name="W", data_type=TensorProto.INT64, dims=[TERA])),
    }
    w = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], [0.5] * 12)
    cases["warmup.onnx"] = _model(w)
    # a record value far beyond the parser's limit (50 MB of JSON-looking text)
    big = _model(w)
    big.metadata_props.add(key="onnxpack.prepacked//W", value="onnxpack-prepack-v1;" + "[" * (50 << 20))
    cases["record-50MB.onnx"] = big
    for name, m in cases.items():
        (tmp_path / name).write_bytes(m.SerializeToString())
    # cache files whose commit slot declares a 10 GB index, and 2^62 entries
    base = bases["fuzzmix+cache"]
    (tmp_path / "fuzzmix.onnx").write_bytes(base["files"]["fuzzmix.onnx"])
    good = base["files"]["packed.cache"]
    real_ilen = base["cache"]["index"][1]
    for label, ilen, count in (("index-10GB", 10 << 30, 3), ("entries-2^62", real_ilen, 2**62)):
        fields = list(cf._SLOT.unpack_from(good))
        fields[5], fields[6] = ilen, count
        body = cf._SLOT.pack(*fields)
        slot = body + struct.pack("<I", cf.crc32(body))
        (tmp_path / f"{label}.cache").write_bytes(slot + slot + good[2 * cf.SLOT_SIZE:])
    todo = [[n, None] for n in sorted(cases) if n != "warmup.onnx"]
    todo += [["fuzzmix.onnx", "index-10GB.cache"], ["fuzzmix.onnx", "entries-2^62.cache"]]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(todo)],
                          capture_output=True, text=True, timeout=120, env=harness.subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (result, peak) in report.items():
        assert not result.startswith("FOREIGN"), (name, result)
        # Reading and parsing a model costs about twice its size; nothing may scale with what
        # it *declares*.
        size = os.path.getsize(tmp_path / name.split("+")[0])
        assert peak < (16 << 20) + 3 * size, f"{name}: Python heap peak {peak} bytes for a {size}-byte file"
        if name.endswith(".cache"):
            assert result == "ok", (name, result)  # a bad cache file is ignored with a warning
        elif name.startswith("record"):
            assert result == "ok", (name, result)  # the record is ignored, the weight re-packed
        else:
            assert result.split(":")[0] in ("ModelLoadError", "ExternalDataError"), (name, result)
            assert "W" in result, (name, result)  # the message names the tensor
