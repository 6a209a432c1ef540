"""Fuzzing harness shared by ``tests/reliability`` and ``benchmarks/fuzz_campaign.py``.

A *base* is one sample model saved by onnxpack (optimized: its data file holds pre-packed blobs
and its ``metadata_props`` hold one record per packed weight; or plain with a persistent cache
file) together with deterministic feeds and the outputs of the unmutated model.  A *case* is a
base plus a few files replaced by mutated bytes, a session config and an *oracle*:

``equal``
    the mutation cannot change any weight (pre-packed records, blob bytes, cache file): the
    session must either raise an ``OnnxpackError`` or succeed — with a ``PrepackWarning`` whenever
    it rejected a saved blob — and give outputs bit-identical to the unmutated model's.
``reference``
    the mutation may legitimately change weights or the graph (model proto, external data
    entries): the session must raise an ``OnnxpackError`` or succeed, and then ``run`` must raise
    an ``OnnxpackError`` or give what onnxruntime gives on the same mutated files (when onnxruntime
    loads and runs them), else what onnxpack itself gives with pre-packing disabled and the saved
    records stripped (so a saved blob never stands in for a changed weight).
``trusted``
    a mutation of the bytes of a saved blob of at least ``ALWAYS_VERIFY_BELOW`` bytes without
    ``onnxpack.verify_prepacked``: such blobs are trusted like the weights themselves (checking
    them would page every packed weight in at load), so only "no crash, no foreign exception" is
    asked; the same mutations are also run with ``verify_prepacked=1`` under ``equal``.

Every case runs in a worker subprocess (so a segfault is seen as a crash, not as the death of the
test run) with a per-case timeout (a hang is a failure).  Any exception that is not an
``OnnxpackError`` is a failure, with its traceback in the result.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGETS = ("entry", "blob", "external", "cache", "proto")

# Per case: session creation of these small models takes ~10 ms; anything near this is a hang.
CASE_TIMEOUT = 30.0

# onnxruntime and numpy accumulate float32 sums in different orders.
ORT_RTOL, ORT_ATOL = 1e-3, 1e-4

_FRAME = struct.Struct("<Q")


def load_build():
    """``models/build.py`` as a module (SAMPLES, sample_inputs, build_sample …)."""
    spec = importlib.util.spec_from_file_location("onnxpack_models_build", os.path.join(ROOT, "models", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def subprocess_env() -> dict[str, str]:
    """Environment for child Pythons: the repository first on the path, quiet BLAS threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["PYTHONFAULTHANDLER"] = "1"
    return env


# -- bases ----------------------------------------------------------------------------------------

# A model whose every weight is packed whatever the kernels' policy on fp32 weights: Gemm with
# transB (the pack transposes) and an fp16 MatMul weight (the pack widens it: a 128 KiB blob, so
# above the CRC-at-every-load size).  The campaign's big-blob oracles rely on it.
FUZZMIX = "fuzzmix"


def fuzzmix_model():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    r = np.random.default_rng(7)
    F, H = TensorProto.FLOAT, TensorProto.FLOAT16
    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("Wg", (r.standard_normal((256, 64)) / 8).astype(np.float32)),
        ("bg", (r.standard_normal(256) / 10).astype(np.float32)),
        ("Wh", (r.standard_normal((256, 128)) / 16).astype(np.float16)),
        ("Wg2", (r.standard_normal((32, 128)) / 11).astype(np.float32))]]
    nodes = [
        helper.make_node("Gemm", ["x", "Wg", "bg"], ["g1"], name="gemm1", transB=1),
        helper.make_node("Relu", ["g1"], ["a1"], name="relu"),
        helper.make_node("Cast", ["a1"], ["a1h"], name="to_fp16", to=H),
        helper.make_node("MatMul", ["a1h", "Wh"], ["h2"], name="mm_fp16"),
        helper.make_node("Cast", ["h2"], ["h2f"], name="to_fp32", to=F),
        helper.make_node("Gemm", ["h2f", "Wg2"], ["y"], name="gemm2", transB=1),
    ]
    g = helper.make_graph(nodes, FUZZMIX, [helper.make_tensor_value_info("x", F, [2, 64])],
                          [helper.make_tensor_value_info("y", F, [2, 32])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnxpack-fuzz")
    m.ir_version = 9
    return m


def build_model(name: str, folder: str) -> tuple[str, dict]:
    """(model path, feeds) of a sample (``models/build.py``) or of :data:`FUZZMIX`, saved with
    its weights in ``<name>.onnx.data``."""
    import numpy as np

    build = load_build()
    if name != FUZZMIX:
        return build.build_sample(name, folder), build.sample_inputs(name)
    from onnxpack.graph import save_model

    path = os.path.join(folder, f"{name}.onnx")
    save_model(fuzzmix_model(), path, location=f"{name}.onnx.data", min_size=1024)
    return path, {"x": np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)}


def model_proto(name: str):
    return fuzzmix_model() if name == FUZZMIX else load_build().SAMPLES[name]()


def _read_dir(folder: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        if os.path.isfile(p) and not name.endswith(".lock"):
            with open(p, "rb") as f:
                out[name] = f.read()
    return out


def make_bases(names: Iterable[str], work: str) -> dict[str, dict[str, Any]]:
    """Builds, per sample, an optimized base ``<name>`` and a plain+cache base ``<name>+cache``.

    Each base is a dict: ``files`` (name -> bytes), ``entry`` (model file name), ``config``,
    ``feeds``, ``expected`` (outputs of the unmutated files), ``blobs`` / ``weights`` (byte ranges
    in the data file) or ``cache`` (cache layout), all plain data so it pickles to workers.
    """
    import warnings

    import numpy as np
    import onnx

    from onnxpack import InferenceSession, SessionOptions
    from onnxpack.cli import optimize_model
    from onnxpack.prepack import cache_file as cf
    from onnxpack.prepack import entry_format as fmt

    build = load_build()
    bases: dict[str, dict[str, Any]] = {}
    for name in names:
        src = os.path.join(work, f"src-{name}")
        os.makedirs(src, exist_ok=True)
        plain, feeds = build_model(name, src)
        # optimized base
        opt_dir = os.path.join(work, f"opt-{name}")
        os.makedirs(opt_dir, exist_ok=True)
        entry = f"{name}.onnx"
        optimize_model(plain, os.path.join(opt_dir, entry), location=f"{name}.onnx.data", out=io.StringIO())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with InferenceSession(os.path.join(opt_dir, entry)) as s:
                expected = s.run(None, feeds)
        proto = onnx.load(os.path.join(opt_dir, entry), load_external_data=False)
        blobs = []
        for prop in proto.metadata_props:
            if fmt.is_record_key(prop.key):
                rec = fmt.parse_record(prop.key, prop.value)
                for p in rec.packs:
                    for b in p.buffers:
                        blobs.append((b.location, b.offset, b.length))
        weights = []
        for init in _all_initializers(proto.graph):
            if init.data_location == onnx.TensorProto.EXTERNAL:
                e = {x.key: x.value for x in init.external_data}
                weights.append((e["location"], int(e.get("offset", 0)), int(e["length"])))
        ref_atol = _ort_error(os.path.join(opt_dir, entry), feeds, expected)
        # A buffer recorded at its weight's own range is an identity pack (the weight itself):
        # mutating it mutates the model, so the blob target draws only from real blobs.
        blobs = set(blobs) - set(weights)
        bases[name] = {
            "name": name, "files": _read_dir(opt_dir), "entry": entry, "config": {}, "feeds": feeds,
            "expected": expected, "blobs": sorted(blobs), "weights": sorted(set(weights)),
            "ref_atol": ref_atol,
        }
        # plain model + populated cache file.  Its weights are stored inside the proto: keys of
        # external weights are file identities (inode, mtime), which a copy of the files in a
        # case folder would not match, so every lookup would miss and the cache go unread.
        cache_dir = os.path.join(work, f"cache-{name}")
        os.makedirs(cache_dir, exist_ok=True)
        onnx.save_model(model_proto(name), os.path.join(cache_dir, entry))
        opts = SessionOptions()
        opts.add_session_config_entry("onnxpack.prepacked_cache_path", os.path.join(cache_dir, "packed.cache"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            InferenceSession(os.path.join(cache_dir, entry), opts).close()
            with InferenceSession(os.path.join(cache_dir, entry), opts) as s:
                got = s.run(None, feeds)
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)
        if not os.path.exists(os.path.join(cache_dir, "packed.cache")):
            continue  # none of its kernels packs: nothing was cached, no cache base
        info = cf.info(os.path.join(cache_dir, "packed.cache"))
        regions = [(b.offset, b.length) for e in info.entries for b in e.buffers]
        header = _read_dir(cache_dir)["packed.cache"][: cf.HEADER_SIZE]
        slot = cf._SLOT.unpack_from(header)
        bases[name + "+cache"] = {
            "name": name + "+cache", "files": _read_dir(cache_dir), "entry": entry,
            "config": {"onnxpack.prepacked_cache_path": "packed.cache"}, "feeds": feeds,
            "expected": expected, "cache": {"regions": regions, "index": (slot[4], slot[5]),
                                            "header": cf.HEADER_SIZE, "slot": cf.SLOT_SIZE},
        }
    return bases


def _ort_error(path: str, feeds: dict, expected: list) -> float:
    """Absolute tolerance against onnxruntime for this base: 8x the unmutated model's largest
    difference (fp16 models differ more than fp32 ones), at least ``ORT_ATOL``."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    err = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
              for a, b in zip(got, expected))
    return max(ORT_ATOL, 8 * err)


def _all_initializers(graph):
    from onnxpack.graph._model import subgraphs_of

    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
        for _, _, g in subgraphs_of(node):
            yield from _all_initializers(g)


# -- mutations ------------------------------------------------------------------------------------

_HOSTILE_LOCATIONS = [
    "/etc/passwd", "/dev/zero", "../outside.bin", "sub/../../outside.bin", "a\x00b", "", ".", "./",
    "C:\\Windows\\win.ini", "\\\\server\\share\\x", "nonexistent.bin", "x" * 5000, "é/ü.bin",
    "link_out", "fifo", "subdir", "devzero", "%2e%2e/x", "./{data}", "{data}/", "{model}",
    "packed.cache", "{data}\n",
]

_HOSTILE_INTS = [0, 1, -1, 63, 64, 65, 4096, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1,
                 2**63, 2**64, 10**30, -(2**63)]


def _mutate_bytes(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None) -> tuple[bytes, str]:
    """A random byte-level mutation inside ``data[lo:hi]`` (flip, set, zero, random run)."""
    hi = len(data) if hi is None else hi
    if hi <= lo:
        return data, "noop"
    b = bytearray(data)
    kind = rng.choice(["flip", "flip", "byte", "zero", "run", "ones"])
    if kind == "flip":
        i = rng.randrange(lo, hi)
        bit = rng.randrange(8)
        b[i] ^= 1 << bit
        return bytes(b), f"flip bit {bit} at {i}"
    if kind == "byte":
        i = rng.randrange(lo, hi)
        v = rng.randrange(256)
        if v == b[i]:
            v ^= 0x55
        b[i] = v
        return bytes(b), f"byte {v} at {i}"
    n = rng.randint(1, min(64, hi - lo))
    i = rng.randrange(lo, hi - n + 1)
    if kind == "zero":
        fill = bytes(n)
    elif kind == "ones":
        fill = b"\xff" * n
    else:
        fill = rng.randbytes(n)
    if fill == bytes(b[i : i + n]):
        fill = bytes(x ^ 0xA5 for x in fill)
    b[i : i + n] = fill
    return bytes(b), f"{kind} {n} bytes at {i}"


def _mutate_text(rng: random.Random, text: str) -> tuple[str, str]:
    kind = rng.choice(["char", "delete", "insert", "truncate", "dup"])
    if not text:
        return rng.choice(["{", "x", "\x00"]), "empty->junk"
    i = rng.randrange(len(text))
    if kind == "char":
        c = rng.choice('0123456789{}[]",:-.eE \x00\\/abcfnrtu\u00e9\ud7ff')
        return text[:i] + c + text[i + 1 :], f"char {c!r} at {i}"
    if kind == "delete":
        n = rng.randint(1, 8)
        return text[:i] + text[i + n :], f"delete {n} at {i}"
    if kind == "insert":
        s = rng.choice(["0", "-", "1e999", "null", ",", "\"", "9" * 30, "NaN", "[", "}"])
        return text[:i] + s + text[i:], f"insert {s!r} at {i}"
    if kind == "truncate":
        return text[:i], f"truncate at {i}"
    j = rng.randrange(len(text))
    return text + text[min(i, j) : max(i, j)], "duplicate tail"


def _json_paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _json_paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _json_paths(v, path + (i,))
    return out


def _hostile_json_value(rng: random.Random, base: dict, old: Any) -> Any:
    blobs = base.get("blobs") or [("x", 0, 0)]
    weights = base.get("weights") or [("x", 0, 0)]
    choices = [
        lambda: rng.choice(_HOSTILE_INTS),
        lambda: (old + rng.choice([-64, 64, -4096, 4096, 1, -1])) if type(old) is int else 64,
        lambda: rng.choice(blobs)[rng.choice([1, 2])],
        lambda: rng.choice(weights)[rng.choice([1, 2])],
        lambda: len(base["files"].get(base["entry"] + ".data", b"")),
        lambda: _fill(rng.choice(_HOSTILE_LOCATIONS), base),
        lambda: rng.choice(["<f4", "<f2", "<f8", "|u1", "|b1", "O", "<c8", ">f4", "float32", "<M8"]),
        lambda: rng.choice([None, True, False, 1.5, float(2**70), "", [], {}, [1, 2], {"a": 1}]),
        lambda: rng.choice(["matmul/2/" + "0" * 32, "gemm/2/" + "ab" * 16, "conv/1/zz", "x"]),
        lambda: rng.choice([[], [0], [2**40, 2**40], [-1, 4], [64] * 9, [1] * 8]),
        lambda: "".join(rng.choice("0123456789abcdef") for _ in range(rng.choice([8, 16, 64, 63]))),
    ]
    return rng.choice(choices)()


def _fill(loc: str, base: dict) -> str:
    data = base["entry"] + ".data"
    return loc.replace("{data}", data).replace("{model}", base["entry"])


def _set_path(obj: Any, path: tuple, value: Any, delete: bool = False) -> None:
    for k in path[:-1]:
        obj = obj[k]
    if delete:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


def mutate_entry(rng: random.Random, base: dict) -> tuple[dict[str, bytes], dict[str, str], str]:
    """Mutates the pre-packed records (metadata_props) of an optimized base."""
    import onnx

    proto = onnx.ModelProto.FromString(base["files"][base["entry"]])
    props = [p for p in proto.metadata_props if p.key.startswith("onnxpack.prepacked/")]
    prop = rng.choice(props)
    kind = rng.choice(["json", "json", "json", "text", "key", "swap", "dup", "version", "drop_prefix"])
    prefix, _, body = prop.value.partition(";")
    if kind == "json":
        obj = json.loads(body)
        path = rng.choice(_json_paths(obj)[1:])
        if rng.random() < 0.15 and isinstance(path[-1], str):
            _set_path(obj, path, None, delete=True)
            desc = f"delete {path}"
        else:
            old = obj
            for k in path:
                old = old[k]
            new = _hostile_json_value(rng, base, old)
            _set_path(obj, path, new)
            desc = f"set {path} = {new!r}"[:200]
        prop.value = prefix + ";" + json.dumps(obj, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
    elif kind == "text":
        prop.value, desc = _mutate_text(rng, prop.value)
    elif kind == "key":
        prop.key, desc = _mutate_text(rng, prop.key)
        desc = "key " + desc
    elif kind == "swap":
        other = rng.choice(props)
        prop.value = other.value
        desc = f"value of {other.key} under {prop.key}"
    elif kind == "dup":
        extra = proto.metadata_props.add()
        extra.key = prop.key
        extra.value = rng.choice(props).value
        desc = f"duplicate key {prop.key}"
    elif kind == "version":
        prop.value = rng.choice(["onnxpack-prepack-v2;", "onnxpack-prepack-v01;", "onnxpack-prepack-v;",
                                 "onnxpack-prepack-v99999999999;", "xx"]) + body
        desc = "version " + prop.value[:30]
    else:
        prop.value = body
        desc = "value without magic"
    config = {"onnxpack.verify_prepacked": "1"} if rng.random() < 0.25 else {}
    return {base["entry"]: proto.SerializeToString()}, config, desc


def mutate_blob(rng: random.Random, base: dict) -> tuple[dict[str, bytes], dict[str, str], str, str]:
    """Mutates bytes of one saved blob in the data file; returns files, config, desc, oracle."""
    from onnxpack.prepack._record import ALWAYS_VERIFY_BELOW

    loc, off, length = rng.choice(base["blobs"])
    data = base["files"][loc]
    new, desc = _mutate_bytes(rng, data, off, off + length)
    verify = rng.random() < 0.5
    config = {"onnxpack.verify_prepacked": "1"} if verify else {}
    oracle = "equal" if verify or length < ALWAYS_VERIFY_BELOW else "trusted"
    return {loc: new}, config, f"blob [{off},{off + length}) {desc}", oracle


def mutate_external(rng: random.Random, base: dict) -> tuple[dict[str, bytes], dict[str, str], str]:
    """Mutates the external_data entries (location, offset, length) of one initializer."""
    import onnx

    proto = onnx.ModelProto.FromString(base["files"][base["entry"]])
    tensors = [t for t in _all_initializers(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    t = rng.choice(tensors)
    entries = {e.key: e.value for e in t.external_data}
    key = rng.choice(["location", "offset", "length", "offset", "length", "drop", "extra"])
    size = len(base["files"].get(entries["location"], b""))
    if key == "location":
        value = _fill(rng.choice(_HOSTILE_LOCATIONS), base)
    elif key in ("offset", "length"):
        old = int(entries.get(key, 0))
        value = rng.choice([
            str(rng.choice(_HOSTILE_INTS)), str(old + rng.choice([-64, 64, -4, 4, 4096, -4096, 1])),
            str(rng.randrange(0, size + 1)), str(size), "-1", "abc", " 64", "+64", "0x40", "1e3", "",
            "٣", "64\x00", str(old) * 2,
        ])
    elif key == "drop":
        victim = rng.choice(["location", "offset", "length"])
        kept = [(e.key, e.value) for e in t.external_data if e.key != victim]
        del t.external_data[:]
        for k, v in kept:
            t.external_data.add(key=k, value=v)
        return {base["entry"]: proto.SerializeToString()}, {}, f"{t.name}: drop {victim}"
    else:
        k = rng.choice(["location", "offset", "length", "checksum", "prepacked_x", "basepath"])
        t.external_data.add(key=k, value=rng.choice(["0", "/etc/passwd", "64", "zz"]))
        return {base["entry"]: proto.SerializeToString()}, {}, f"{t.name}: extra entry {k}"
    for e in t.external_data:
        if e.key == key:
            e.value = value
            break
    else:
        t.external_data.add(key=key, value=value)
    return {base["entry"]: proto.SerializeToString()}, {}, f"{t.name}: {key} = {value[:80]!r}"


def mutate_cache(rng: random.Random, base: dict) -> tuple[dict[str, bytes], dict[str, str], str, str]:
    """Mutates the cache file: commit slots, index, regions, truncation, junk, swaps."""
    from onnxpack.prepack._record import ALWAYS_VERIFY_BELOW

    data = base["files"]["packed.cache"]
    c = base["cache"]
    ioff, ilen = c["index"]
    kind = rng.choice(["slot", "slot", "index", "index", "region", "truncate", "junk", "swap", "random", "empty"])
    oracle = "equal"
    verify = rng.random() < 0.3
    if kind == "slot":
        new, desc = _mutate_bytes(rng, data, 0, c["header"])
    elif kind == "index":
        new, desc = _mutate_bytes(rng, data, ioff, ioff + ilen)
    elif kind == "region":
        off, length = rng.choice(c["regions"])
        new, desc = _mutate_bytes(rng, data, off, off + length)
        if not verify and length >= ALWAYS_VERIFY_BELOW:
            oracle = "trusted"
        desc = f"region [{off},{off + length}) " + desc
    elif kind == "truncate":
        n = rng.choice([rng.randrange(len(data)), ioff, ioff + ilen - 1, c["header"], c["slot"], 8])
        new, desc = data[:n], f"truncate to {n}"
    elif kind == "junk":
        new, desc = data + rng.randbytes(rng.randint(1, 5000)), "junk appended"
    elif kind == "swap":
        s = c["slot"]
        new, desc = data[s : 2 * s] + data[:s] + data[2 * s :], "slots swapped"
    elif kind == "random":
        new, desc = rng.randbytes(rng.randint(1, 4096)), "random file"
    else:
        new, desc = b"", "empty file"
    config = {"onnxpack.verify_prepacked": "1"} if verify else {}
    return {"packed.cache": new}, config, f"cache {desc}", oracle


def mutate_proto(rng: random.Random, base: dict) -> tuple[dict[str, bytes], dict[str, str], str]:
    """Mutates the model proto: truncation, random bytes, huge/negative dims, wrong dtypes."""
    import onnx

    raw = base["files"][base["entry"]]
    kind = rng.choice(["truncate", "bytes", "bytes", "random", "dims", "dims", "dtype", "dtype", "raw", "shape"])
    if kind == "truncate":
        n = rng.randrange(len(raw))
        return {base["entry"]: raw[:n]}, {}, f"truncate to {n}"
    if kind == "bytes":
        new = raw
        descs = []
        for _ in range(rng.randint(1, 4)):
            new, d = _mutate_bytes(rng, new)
            descs.append(d)
        return {base["entry"]: new}, {}, "; ".join(descs)
    if kind == "random":
        return {base["entry"]: rng.randbytes(rng.randint(0, 3000))}, {}, "random bytes"
    proto = onnx.ModelProto.FromString(raw)
    tensors = list(_all_initializers(proto.graph))
    t = rng.choice(tensors)
    if kind == "dims":
        dims = list(t.dims)
        choice = rng.choice(["huge", "neg", "drop", "add", "zero", "overflow"])
        if choice == "huge":
            dims = [10**12] if rng.random() < 0.5 else dims[:-1] + [2**40]
        elif choice == "neg":
            if dims:
                dims[rng.randrange(len(dims))] = rng.choice([-1, -(2**62)])
            else:
                dims = [-1]
        elif choice == "drop":
            dims = dims[:-1]
        elif choice == "add":
            dims = dims + [rng.choice([1, 2, 10**6])]
        elif choice == "zero":
            dims = [0] + dims
        else:
            dims = [2**62, 2**62, 16]
        del t.dims[:]
        t.dims.extend(dims)
        desc = f"{t.name}: dims {dims}"
    elif kind == "dtype":
        v = rng.choice(list(range(0, 27)) + [99, 2**31 - 1])
        t.data_type = v
        desc = f"{t.name}: data_type {v}"
    elif kind == "raw":
        if t.HasField("raw_data"):
            t.raw_data = t.raw_data[: rng.randrange(len(t.raw_data) + 1)]
            desc = f"{t.name}: raw_data truncated"
        else:
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
            desc = f"{t.name}: external data dropped (no data at all)"
    else:
        vis = list(proto.graph.input) + list(proto.graph.output)
        vi = rng.choice(vis)
        dims = vi.type.tensor_type.shape.dim
        if len(dims):
            dims[rng.randrange(len(dims))].dim_value = rng.choice([0, 10**12, 2**62])
        vi.type.tensor_type.elem_type = rng.choice([vi.type.tensor_type.elem_type, 0, 7, 10, 99])
        desc = f"value info {vi.name} changed"
    return {base["entry"]: proto.SerializeToString()}, {}, desc


def make_case(target: str, seed: int, bases: dict[str, dict], case_id: int = 0) -> dict[str, Any]:
    """The case of ``target`` drawn from ``seed`` (deterministic: a failing seed reproduces)."""
    rng = random.Random(f"{target}:{seed}")
    if target == "cache":  # bases whose cache file holds entries (kernels that pack)
        pool = [b for b in bases if b.endswith("+cache") and bases[b]["cache"]["regions"]]
    elif target in ("entry", "blob"):  # bases with saved blobs
        pool = [b for b in bases if not b.endswith("+cache") and bases[b]["blobs"]]
    else:
        pool = [b for b in bases if not b.endswith("+cache")]
    base = bases[rng.choice(sorted(pool))]
    oracle = "equal"
    if target == "entry":
        files, config, desc = mutate_entry(rng, base)
    elif target == "blob":
        files, config, desc, oracle = mutate_blob(rng, base)
    elif target == "external":
        files, config, desc = mutate_external(rng, base)
        oracle = "reference"
    elif target == "cache":
        files, config, desc, oracle = mutate_cache(rng, base)
    elif target == "proto":
        files, config, desc = mutate_proto(rng, base)
        oracle = "reference"
    else:
        raise ValueError(f"unknown target {target!r}")
    return {"id": case_id, "target": target, "seed": seed, "base": base["name"], "files": files,
            "config": config, "oracle": oracle, "desc": desc}


# -- the worker (runs in a subprocess) --------------------------------------------------------------


def _send(stream, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def _recv(stream) -> Any:
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError
    (n,) = _FRAME.unpack(head)
    return pickle.loads(stream.read(n))


def _same(a: list, b: list, exact: bool, atol: float = ORT_ATOL) -> str | None:
    import numpy as np

    if len(a) != len(b):
        return f"{len(a)} outputs, expected {len(b)}"
    for k, (x, y) in enumerate(zip(a, b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"output {k}: {x.dtype}{list(x.shape)} != expected {y.dtype}{list(y.shape)}"
        if exact:
            if not np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"):
                return f"output {k}: differs (max abs diff {np.nanmax(np.abs(x.astype(float) - y.astype(float)))})"
        elif x.dtype.kind in "fc":
            # Mutated weights can make outputs huge; float rounding grows with them.
            finite = np.abs(y[np.isfinite(y)].astype(np.float64))
            scale = max(1.0, float(finite.max(initial=0.0)))
            if not np.allclose(x, y, rtol=ORT_RTOL, atol=atol * scale, equal_nan=True):
                with np.errstate(all="ignore"):
                    return f"output {k}: differs from reference (max abs diff {np.nanmax(np.abs(x - y))})"
        elif not np.array_equal(x, y):
            return f"output {k}: differs from reference"
    return None


def _evaluate(case: dict, bases: dict, workdir: str, out) -> dict[str, Any]:
    import warnings

    import numpy as np  # noqa: F401

    from onnxpack import InferenceSession, SessionOptions
    from onnxpack.errors import OnnxpackError, PrepackWarning

    base = bases[case["base"]]
    folder = tempfile.mkdtemp(dir=workdir)
    try:
        files = dict(base["files"])
        files.update(case["files"])
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        # hostile neighbours the locations may name
        os.symlink("/etc/passwd", os.path.join(folder, "link_out"))
        os.symlink("/dev/zero", os.path.join(folder, "devzero"))
        os.mkfifo(os.path.join(folder, "fifo"))
        os.mkdir(os.path.join(folder, "subdir"))
        path = os.path.join(folder, base["entry"])
        config = dict(base["config"])
        config.update(case["config"])
        opts = SessionOptions()
        for k, v in config.items():
            if k == "onnxpack.prepacked_cache_path":
                v = os.path.join(folder, v)
            opts.add_session_config_entry(k, v)
        res: dict[str, Any] = {"id": case["id"], "verdict": "pass", "outcome": "", "detail": ""}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                sess = InferenceSession(path, opts)
            except OnnxpackError as e:
                msg = str(e)
                res["outcome"] = "create-error:" + type(e).__name__
                res["detail"] = msg[:300]
                if not msg.strip():
                    res["verdict"], res["detail"] = "fail", f"{type(e).__name__} with an empty message"
                return res
            except BaseException as e:  # noqa: BLE001 - anything else is what we hunt for
                res["verdict"] = "fail"
                res["outcome"] = "create-foreign:" + type(e).__name__
                res["detail"] = "".join(traceback.format_exception(e))[-3000:]
                return res
            stats = sess.get_prepack_stats()
            try:
                outputs = sess.run(None, base["feeds"])
            except OnnxpackError as e:
                outputs = None
                res["outcome"] = "run-error:" + type(e).__name__
                res["detail"] = str(e)[:300]
            except BaseException as e:  # noqa: BLE001
                res["verdict"] = "fail"
                res["outcome"] = "run-foreign:" + type(e).__name__
                res["detail"] = "".join(traceback.format_exception(e))[-3000:]
                return res
            finally:
                sess.close()
        warned = [w for w in caught if issubclass(w.category, PrepackWarning)]
        if not res["outcome"]:
            res["outcome"] = "ok-warned" if warned else "ok"
        if stats["blobs_rejected"] and not warned:
            res["verdict"], res["detail"] = "fail", f"{stats['blobs_rejected']} blob(s) rejected without a PrepackWarning"
            return res
        oracle = case["oracle"]
        if oracle == "equal":
            if outputs is None:
                res["verdict"] = "fail"
                res["detail"] = "run failed on a mutation that cannot change weights: " + res["detail"]
                return res
            diff = _same(outputs, base["expected"], exact=True)
            if diff:
                res["verdict"], res["detail"] = "fail", "silently wrong output: " + diff
        elif oracle == "reference" and outputs is not None:
            _send(out, {"stage": "reference", "id": case["id"]})  # a crash from here on is not ours
            ref, which = _reference(path, folder, config, base["feeds"])
            res["reference"] = which
            if ref is not None:
                # Not exact even against onnxpack itself: a packed (transposed, contiguous) weight
                # and the original view go through different BLAS kernels.
                diff = _same(outputs, ref, exact=False, atol=base.get("ref_atol", ORT_ATOL))
                if diff and which == "onnxruntime":
                    # onnxruntime's CPU provider computes float16 ops in float32 (it inserts
                    # Casts), so garbage fp16 weights overflow differently: ask the spec's
                    # numpy implementation, onnx.reference, before calling it a failure.
                    spec = _spec_reference(path, base["feeds"])
                    if spec is not None and _same(outputs, spec, exact=False, atol=base.get("ref_atol", ORT_ATOL)) is None:
                        diff, res["reference"] = None, "onnx.reference"
                if diff:
                    res["verdict"], res["detail"] = "fail", f"output differs from {which}: {diff}"
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _spec_reference(path: str, feeds: dict) -> list | None:
    import warnings

    import onnx
    from onnx.reference import ReferenceEvaluator

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return list(ReferenceEvaluator(onnx.load(path)).run(None, feeds))
    except Exception:  # noqa: BLE001 - no spec reference for this model
        return None


def _reference(path: str, folder: str, config: dict, feeds: dict) -> tuple[list | None, str]:
    """Outputs of onnxruntime on the mutated files, else of onnxpack without any saved blob."""
    import warnings

    import onnx

    try:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4
        # The spec's semantics, op by op: fusions change float16 rounding (a MatMul fused with
        # a Cast to float never overflows float16, the unfused graph does).
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        return sess.run(None, feeds), "onnxruntime"
    except Exception:  # noqa: BLE001 - onnxruntime refusing the model just means no reference
        pass
    from onnxpack import InferenceSession, SessionOptions
    from onnxpack.errors import OnnxpackError

    try:
        proto = onnx.ModelProto.FromString(open(path, "rb").read())
        keep = [p for p in proto.metadata_props if not p.key.startswith("onnxpack.prepacked/")]
        del proto.metadata_props[:]
        proto.metadata_props.extend(keep)
        stripped = os.path.join(folder, "stripped.onnx")
        with open(stripped, "wb") as f:
            f.write(proto.SerializeToString())
        opts = SessionOptions()
        opts.add_session_config_entry("session.disable_prepacking", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with InferenceSession(stripped, opts) as s:
                return s.run(None, feeds), "self"
    except (OnnxpackError, Exception):  # noqa: BLE001
        return None, "none"


def worker_main() -> int:
    """Worker loop: reads ``init`` then cases from stdin, writes results to stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the frame stream
    inp = os.fdopen(0, "rb")
    import faulthandler
    import logging
    import warnings

    faulthandler.enable()
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    msg = _recv(inp)
    bases = msg["bases"]
    workdir = tempfile.mkdtemp(prefix="onnxpack-fuzz-")
    try:
        while True:
            try:
                case = _recv(inp)
            except EOFError:
                return 0
            t0 = time.perf_counter()
            try:
                res = _evaluate(case, bases, workdir, out)
            except BaseException as e:  # noqa: BLE001 - a harness error is reported, not hidden
                res = {"id": case["id"], "verdict": "fail", "outcome": "harness:" + type(e).__name__,
                       "detail": "".join(traceback.format_exception(e))[-3000:]}
            res["seconds"] = time.perf_counter() - t0
            res["stage"] = "done"
            _send(out, res)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# -- the parent side ------------------------------------------------------------------------------


class Worker:
    """One worker subprocess; restarted after a crash or a hang."""

    def __init__(self, bases: dict) -> None:
        self.bases = bases
        self.proc: subprocess.Popen | None = None
        self.case: dict | None = None
        self.stage = "create"
        self.started = 0.0
        self._buf = b""
        self.restarts = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=subprocess_env(), cwd=ROOT,
        )
        _send(self.proc.stdin, {"bases": self.bases})
        self._buf = b""

    def submit(self, case: dict) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.case, self.stage, self.started = case, "create", time.monotonic()
        _send(self.proc.stdin, case)

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def poll(self) -> dict | None:
        """Reads what is available; returns the finished result, or None if still running."""
        chunk = os.read(self.fileno(), 1 << 20)
        if not chunk:
            return self._died()
        self._buf += chunk
        while len(self._buf) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(self._buf)
            if len(self._buf) < _FRAME.size + n:
                break
            msg = pickle.loads(self._buf[_FRAME.size : _FRAME.size + n])
            self._buf = self._buf[_FRAME.size + n :]
            if msg.get("stage") == "reference":
                self.stage = "reference"
                continue
            self.case = None
            return msg
        return None

    def _died(self) -> dict:
        rc = self.proc.wait()
        case, self.case = self.case, None
        self.proc = None
        self.restarts += 1
        if self.stage == "reference":  # onnxruntime (the reference) crashed, not onnxpack
            return {"id": case["id"], "verdict": "pass", "outcome": "ok", "reference": "crashed",
                    "detail": f"reference onnxruntime died (rc {rc})"}
        sig = -rc if rc < 0 else None
        return {"id": case["id"], "verdict": "fail", "outcome": "crash",
                "detail": f"worker died: {'signal ' + signal.Signals(sig).name if sig else 'exit ' + str(rc)}"}

    def kill_hung(self) -> dict:
        case = self.case
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self.case = None
        self.restarts += 1
        return {"id": case["id"], "verdict": "fail", "outcome": "hang",
                "detail": f"no result after {CASE_TIMEOUT} s (stage {self.stage})"}

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
            self.proc = None


class Pool:
    """Runs cases on ``n`` worker subprocesses; yields ``(case, result)`` as they finish."""

    def __init__(self, bases: dict, n: int = 1, timeout: float = CASE_TIMEOUT) -> None:
        self.workers = [Worker(bases) for _ in range(n)]
        self.timeout = timeout

    def run(self, cases: Iterable[dict]) -> Iterator[tuple[dict, dict]]:
        it = iter(cases)
        pending = True
        idle = list(self.workers)
        busy: dict[int, tuple[Worker, dict]] = {}
        while True:
            while pending and idle:
                try:
                    case = next(it)
                except StopIteration:
                    pending = False
                    break
                w = idle.pop()
                w.submit(case)
                busy[w.fileno()] = (w, case)
            if not busy:
                return
            ready, _, _ = select.select(list(busy), [], [], 0.5)
            for fd in ready:
                w, case = busy[fd]
                res = w.poll()
                if res is not None:
                    del busy[fd]
                    idle.append(w)
                    yield case, res
            now = time.monotonic()
            for fd, (w, case) in list(busy.items()):
                if now - w.started > self.timeout:
                    del busy[fd]
                    idle.append(w)
                    yield case, w.kill_hung()

    def run_one(self, case: dict) -> dict:
        for _case, res in self.run([case]):
            return res
        raise RuntimeError("Bug: no result")

    def close(self) -> None:
        for w in self.workers:
            w.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- kills during writes ----------------------------------------------------------------------------

# C functions through which every byte we write reaches the file system (buffered file writes,
# os.write/pwrite, fsync, rename/replace, truncate, close).  The kill driver counts calls to them
# and SIGKILLs itself right before the N-th one: a kill at a precise, random point of a write.
WRITE_CALLS = frozenset({"write", "pwrite", "fsync", "fdatasync", "replace", "rename", "ftruncate",
                         "truncate", "close", "flush", "writelines", "unlink"})

KILL_MODES = ("optimize", "flag", "cache")


def kill_driver(mode: str, kill_at: int, args: list[str]) -> int:
    """Runs one write operation, SIGKILLing itself before write call ``kill_at`` (0: never).

    Prints the number of write calls made when it completes (to size the random kill points).
    ``optimize``: ``onnxpack optimize INPUT -o OUTPUT`` through ``onnxpack.cli.main``;
    ``flag``: InferenceSession(INPUT) with ``optimized_model_filepath=OUTPUT`` and the
    save-blobs flag; ``cache``: InferenceSession(INPUT) with ``prepacked_cache_path=OUTPUT``.
    """
    import warnings

    from onnxpack import InferenceSession, SessionOptions
    from onnxpack.cli import main as cli_main

    warnings.simplefilter("ignore")
    src, dst = args
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "c_call" and getattr(arg, "__name__", "") in WRITE_CALLS:
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    opts = SessionOptions()
    if mode == "flag":
        opts.optimized_model_filepath = dst
        opts.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    elif mode == "cache":
        opts.add_session_config_entry("onnxpack.prepacked_cache_path", dst)
    sys.setprofile(profile)
    try:
        if mode == "optimize":
            rc = cli_main(["optimize", src, "-o", dst, "--no-progress"])
        else:
            InferenceSession(src, opts).close()
            rc = 0
    finally:
        sys.setprofile(None)
    print(f"WRITE_CALLS {count}", flush=True)
    return rc


def run_kill_driver(mode: str, kill_at: int, src: str, dst: str, timeout: float = 120) -> tuple[int, int | None]:
    """(return code, write calls counted or None) of one kill-driver subprocess."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--kill", mode, str(kill_at), os.path.abspath(src),
         os.path.abspath(dst)],
        capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=timeout,
    )
    calls = None
    for line in proc.stdout.splitlines():
        if line.startswith("WRITE_CALLS "):
            calls = int(line.split()[1])
    if proc.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"kill driver {mode} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return proc.returncode, calls


def file_digest(path: str) -> str | None:
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    except FileNotFoundError:
        return None


def folder_digests(folder: str) -> dict[str, str]:
    return {n: file_digest(os.path.join(folder, n)) for n in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, n))}


def outputs_of(path: str, feeds: dict, config: dict | None = None) -> tuple[list, dict]:
    """Outputs and prepack stats of a fresh session (warnings are errors: a torn file would warn)."""
    import warnings

    from onnxpack import InferenceSession, SessionOptions

    opts = SessionOptions()
    for k, v in (config or {}).items():
        opts.add_session_config_entry(k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with InferenceSession(path, opts) as s:
            return s.run(None, feeds), s.get_prepack_stats()


def kill_setup(work: str, name: str = FUZZMIX) -> dict[str, Any]:
    """Inputs of the kill trials: sample ``name`` (external data) and, for cache appends, a
    cache file already holding another model's entries."""
    import warnings

    import onnx

    from onnxpack import InferenceSession, SessionOptions

    build = load_build()
    src = os.path.join(work, "input")
    os.makedirs(src, exist_ok=True)
    model, feeds = build_model(name, src)
    expected, _ = outputs_of(model, feeds)
    other = os.path.join(work, "other.onnx")  # in-proto weights: content keys, any folder
    onnx.save_model(build.SAMPLES["fp16_mlp"](), other)  # its fp16 MatMul weight always packs
    prev_cache = os.path.join(work, "prev.cache")
    opts = SessionOptions()
    opts.add_session_config_entry("onnxpack.prepacked_cache_path", prev_cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        InferenceSession(other, opts).close()
    calls = {}
    for mode in KILL_MODES:  # one complete run per mode counts its write calls
        folder = os.path.join(work, f"count-{mode}")
        os.makedirs(folder, exist_ok=True)
        dst = os.path.join(folder, "out.cache" if mode == "cache" else "out.onnx")
        calls[mode] = run_kill_driver(mode, 0, model, dst)[1]
    return {"model": model, "src": src, "feeds": feeds, "expected": expected, "prev_cache": prev_cache,
            "calls": calls, "inputs": folder_digests(src)}


def kill_trial(setup: dict, mode: str, kill_at: int, folder: str, previous: bool) -> tuple[bool, str]:
    """One kill during a write; returns (passed, what was found).

    With ``previous`` the output already exists (an earlier optimize, or a cache file with
    another model's entries): after the kill it must still be there, whole.  Without it the
    output is absent or complete.  Either way it loads without a warning and gives the inputs'
    outputs, and the input files are byte-identical.
    """
    import numpy as np

    from onnxpack.cli import optimize_model
    from onnxpack.prepack import cache_file as cf

    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "out.cache" if mode == "cache" else "out.onnx")
    old_keys: set[str] = set()
    if previous:
        if mode == "cache":
            shutil.copy(setup["prev_cache"], out)
            old_keys = {e.key for e in cf.info(out).entries}
        else:
            optimize_model(setup["model"], out, prepack=False, out=io.StringIO())
    rc, _ = run_kill_driver(mode, kill_at, setup["model"], out)
    state = "killed" if rc else "completed"
    if folder_digests(setup["src"]) != setup["inputs"]:
        return False, f"{state}: input files changed"
    if not os.path.exists(out):
        return (not previous), f"{state}: no output" + (" (the previous one is gone)" if previous else "")
    try:
        if mode == "cache":
            keys = {e.key for e in cf.info(out).entries}
            if not old_keys <= keys:
                return False, f"{state}: previous cache entries lost"
            got, stats = outputs_of(setup["model"], setup["feeds"], {"onnxpack.prepacked_cache_path": out})
            found = f"{state}: cache with {len(keys)} entries"
        else:
            got, stats = outputs_of(out, setup["feeds"])
            found = f"{state}: output loads ({stats['blobs_from_model']} blobs mapped)"
    except Exception as e:  # noqa: BLE001 - any failure to load is a torn output
        return False, f"{state}: output does not load cleanly: {type(e).__name__}: {e}"
    for a, b in zip(got, setup["expected"]):
        if not np.array_equal(a, b):
            return False, f"{found}, but gives different outputs"
    return True, found


# -- processes sharing one cache file and one optimized model -----------------------------------------


def process_job(optimized: str, plain: str, cache: str, feeds: dict, repeats: int) -> list[str]:
    """One of several processes: sessions on the shared optimized model and on a plain model with
    the shared cache file; returns a digest of every output (they must all be equal)."""
    import hashlib
    import warnings

    from onnxpack import InferenceSession, SessionOptions

    warnings.simplefilter("error")  # a torn or racing cache file would warn
    digests = []
    for _ in range(repeats):
        for path, config in ((optimized, {}), (plain, {"onnxpack.prepacked_cache_path": cache})):
            opts = SessionOptions()
            for k, v in config.items():
                opts.add_session_config_entry(k, v)
            with InferenceSession(path, opts) as s:
                out = s.run(None, feeds)
            digests.append(hashlib.blake2b(b"".join(a.tobytes() for a in out), digest_size=16).hexdigest())
    return digests


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(worker_main())
    if sys.argv[1:2] == ["--kill"]:
        sys.exit(kill_driver(sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
