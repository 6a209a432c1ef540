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

Issue 12's families (``record``, ``inplace``, ``live``, ``special``, ``attr``, ``huge``,
``subgraphs``; see ``mutate_record`` … ``make_subgraphs``) add:

``mapped``
    ``equal``, and a same-content file (copied, touched, rewritten with its own bytes) still maps
    every saved blob: no warning, nothing re-packed.
``live``
    ``equal`` for the first run; then files change under the live session, and every later run
    gives the same outputs or an ``OnnxpackError`` (a SIGBUS kills the worker: a crash).
``error``, ``zero``, ``error_or_want``, ``error_or_ref``
    a special file or a huge shape must be refused with an ``OnnxpackError`` (``zero``: or give
    the declared zero-size tensor; the others: or the expected outputs).
``want``
    a valid standalone model (attribute tensors, many subgraphs): the outputs onnxruntime gives
    (on the model with every tensor inline, for attribute tensors, whose decoys in the working
    directory must never reach an output).

and, for every case: no file written, renamed or removed outside the case folder (an audit hook
in the worker), a peak-memory cap for huge shapes, and a creation-time budget for many subgraphs.
The data file's seal is renewed after the files are written (``reseal``) where a case models a
file unchanged since its save: that is the *trusted* path, where nothing is re-read at load.

Every case runs in a worker subprocess (so a segfault is seen as a crash, not as the death of the
test run) with a per-case timeout (a hang is a failure).  Any exception that is not an
``OnnxpackError`` is a failure, with its traceback in the result.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
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
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The first round's targets (one mutation of a saved file each) and issue 12's families.
TARGETS = ("entry", "blob", "external", "cache", "proto",
           "record", "inplace", "live", "special", "attr", "huge", "subgraphs")

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


# Every session of the suite, in this process and its children, runs with
# use_deterministic_compute: outputs are compared bit for bit with the bases' expected ones, and
# without it a conv's path is chosen per process by timing two ways that round differently (the
# cnn sample's outputs 3e-8 apart between a busy parent and its children).
DETERMINISTIC = {"ONNXPACK_DETERMINISTIC": "1"}


def subprocess_env() -> dict[str, str]:
    """Environment for child Pythons: the repository first on the path, quiet BLAS threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(DETERMINISTIC)
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


# A model whose packs come in equal-shaped pairs, so that a record can be re-pointed at another
# weight's blob *consistently* (same dtype, shape and length; the other blob's CRC): Gemm (transB)
# weights A1/A2 (16 KiB packs, CRC-checked at every load) and fp16 MatMul weights H1/H2 (256 KiB
# fp32 packs, not read at load), plus two If nodes whose branches hold initializers of the same
# names and shapes (T, E), so that swapping the If nodes' names swaps the scopes records bind to.
FUZZTWIN = "fuzztwin"


def fuzztwin_model():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    r = np.random.default_rng(11)
    F, H = TensorProto.FLOAT, TensorProto.FLOAT16

    def w(name, shape, scale, dtype=np.float32):
        return numpy_helper.from_array((r.standard_normal(shape) / scale).astype(dtype), name)

    def branch(tag, src, out):
        nodes = [helper.make_node("Gemm", [src, "T" if tag == "then" else "E"], [out], transB=1)]
        init = [w("T" if tag == "then" else "E", (64, 64), 8)]
        return helper.make_graph(nodes, f"{tag}_{out}", [], [helper.make_tensor_value_info(out, F, [2, 64])], init)

    inits = [w("A1", (64, 64), 8), w("A2", (64, 64), 8), w("H0", (64, 256), 8, np.float16),
             w("H1", (256, 256), 16, np.float16), w("H2", (256, 256), 16, np.float16)]
    nodes = [
        helper.make_node("Gemm", ["x", "A1"], ["g1"], name="gemm_a1", transB=1),
        helper.make_node("Relu", ["g1"], ["r1"], name="relu"),
        helper.make_node("Gemm", ["r1", "A2"], ["g2"], name="gemm_a2", transB=1),
        helper.make_node("Cast", ["g2"], ["g2h"], name="to_fp16", to=H),
        helper.make_node("MatMul", ["g2h", "H0"], ["m0"], name="mm_h0"),
        helper.make_node("MatMul", ["m0", "H1"], ["m1"], name="mm_h1"),
        helper.make_node("MatMul", ["m1", "H2"], ["m2"], name="mm_h2"),
        helper.make_node("Cast", ["m2"], ["y"], name="to_fp32", to=F),
        helper.make_node("If", ["c"], ["ia"], name="if_a", then_branch=branch("then", "g2", "ta"),
                         else_branch=branch("else", "g2", "ea")),
        helper.make_node("If", ["c"], ["z"], name="if_b", then_branch=branch("then", "ia", "tb"),
                         else_branch=branch("else", "ia", "eb")),
    ]
    g = helper.make_graph(nodes, FUZZTWIN, [helper.make_tensor_value_info("x", F, [2, 64]),
                                            helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", F, [2, 256]), helper.make_tensor_value_info("z", F, [2, 64])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnxpack-fuzz")
    m.ir_version = 9
    return m


_OWN_MODELS = {FUZZMIX: fuzzmix_model, FUZZTWIN: fuzztwin_model}


def build_model(name: str, folder: str) -> tuple[str, dict]:
    """(model path, feeds) of a sample (``models/build.py``) or of :data:`FUZZMIX`, saved with
    its weights in ``<name>.onnx.data``."""
    import numpy as np

    build = load_build()
    if name not in _OWN_MODELS:
        return build.build_sample(name, folder), build.sample_inputs(name)
    from onnxpack.graph import save_model

    path = os.path.join(folder, f"{name}.onnx")
    save_model(_OWN_MODELS[name](), path, location=f"{name}.onnx.data", min_size=1024)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)}
    if name == FUZZTWIN:
        feeds["c"] = np.array(True)
    return path, feeds


def model_proto(name: str):
    return _OWN_MODELS[name]() if name in _OWN_MODELS else load_build().SAMPLES[name]()


def _read_dir(folder: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        if os.path.isfile(p) and not name.endswith(".lock"):
            with open(p, "rb") as f:
                out[name] = f.read()
    return out


@mock.patch.dict(os.environ, DETERMINISTIC)
def make_bases(names: Iterable[str], work: str) -> dict[str, dict[str, Any]]:
    """Builds, per sample, an optimized base ``<name>`` and a plain+cache base ``<name>+cache``.

    Each base is a dict: ``files`` (name -> bytes), ``entry`` (model file name), ``config``,
    ``feeds``, ``expected`` (outputs of the unmutated files), ``blobs`` / ``weights`` (byte ranges
    in the data file) or ``cache`` (cache layout), all plain data so it pickles to workers.
    Its sessions run with :data:`DETERMINISTIC` set, as the workers' do.
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
                stats = s.get_prepack_stats()
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
            "ref_atol": ref_atol, "stats": stats,
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
                cache_stats = s.get_prepack_stats()
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
            "expected": expected, "stats": cache_stats, "cache": {"regions": regions, "index": (slot[4], slot[5]),
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


# -- issue 12's families: consistent forgeries, files changed under the session, special files,
# -- attribute tensors, huge shapes, many subgraphs ---------------------------------------------------
#
# These cases carry more than replaced files (see ``_evaluate``): ``reseal`` (after writing the
# files, the data file's seal gets the file's new identity, as right after a save: the *trusted*
# path, where nothing is re-read), ``post`` (actions applied after that: writes in place with mtime
# restored, copies renamed over the file ...), ``live`` (actions applied between two runs of one
# session), ``special`` (FIFOs, symlinks, folders created in the folder), ``path`` (open another
# file than the model), ``cwd`` (decoy files in the working directory), ``optimize`` (optimize
# first, then load the output), ``limit`` (peak traced allocation), ``budget`` (creation seconds).


def _records_of(proto) -> tuple[dict[str, tuple[Any, str, dict]], list]:
    """(weight records: key -> (prop, value prefix, JSON body), file-record props) of a model."""
    from onnxpack.prepack import entry_format as fmt

    recs: dict[str, tuple[Any, str, dict]] = {}
    files = []
    for p in proto.metadata_props:
        if fmt.is_file_key(p.key):
            files.append(p)
        elif fmt.is_record_key(p.key):
            prefix, _, body = p.value.partition(";")
            recs[p.key] = (p, prefix, json.loads(body))
    return recs, files


def _store(prop, prefix: str, obj: dict) -> None:
    prop.value = prefix + ";" + json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _drop_props(proto, keys: set[str]) -> None:
    keep = [(p.key, p.value) for p in proto.metadata_props if p.key not in keys]
    del proto.metadata_props[:]
    for k, v in keep:
        proto.metadata_props.add(key=k, value=v)


def _forge_manifest(proto, data: bytes) -> bytes:
    """Seals the weight records now in ``proto`` consistently: a manifest of them written into the
    data file (over the old one when it has the same length, else appended) and the file record
    pointed at it with its digest.  Only the file's identity (or a full verification) can tell."""
    import dataclasses
    import hashlib

    from onnxpack.prepack import entry_format as fmt

    man = fmt.manifest_bytes([(p.key, p.value) for p in proto.metadata_props])
    for p in proto.metadata_props:
        if not fmt.is_file_key(p.key):
            continue
        rec = fmt.parse_file_record(p.key, p.value)
        if len(man) == rec.manifest_length and rec.manifest_offset + len(man) <= len(data):
            off = rec.manifest_offset
            data = data[:off] + man + data[off + len(man):]
        else:
            off = -(-len(data) // 64) * 64
            data = data + bytes(off - len(data)) + man
        digest = hashlib.blake2b(man, digest_size=32).hexdigest()
        p.value = fmt.format_file_record(dataclasses.replace(
            rec, manifest_offset=off, manifest_length=len(man), manifest_digest=digest))[1]
    return data


def _saved_buffers(recs: dict) -> list[tuple[str, int, int, dict]]:
    return [(key, pi, bi, b) for key, (_p, _x, obj) in recs.items()
            for pi, pack in enumerate(obj["packs"]) for bi, b in enumerate(pack["buffers"])]


def _twins(rng: random.Random, recs: dict) -> tuple[tuple, tuple] | None:
    """Two buffers of different records with the same dtype and shape (a consistent swap)."""
    groups: dict[tuple, list] = {}
    for item in _saved_buffers(recs):
        b = item[3]
        groups.setdefault((b["dtype"], tuple(b["shape"])), []).append(item)
    pairs = [(a, b) for g in groups.values() for i, a in enumerate(g) for b in g[i + 1:]
             if a[0] != b[0] and (a[3]["offset"], a[3]["file"]) != (b[3]["offset"], b[3]["file"])]
    return rng.choice(pairs) if pairs else None


_BINDING = ("file", "offset", "length", "crc32")


def _data_location(proto) -> str | None:
    from onnxpack.prepack import entry_format as fmt

    for p in proto.metadata_props:
        if fmt.is_file_key(p.key):
            try:
                return fmt.parse_file_record(p.key, p.value).location
            except Exception:  # noqa: BLE001
                return None
    return None


def mutate_record(rng: random.Random, base: dict) -> dict[str, Any]:
    """Family 1: records mutated *consistently* — valid JSON, valid bounds, the binding wrong.

    Buffers (offset, length, CRC) swapped between records of equal-shaped packs, a record
    re-pointed at another file of the folder holding the other blob's bytes, a record deleted and
    another re-pointed at its blob, records duplicated or made up for weights that do not exist,
    the seal edited (identity, manifest offset / length / digest / bytes), and — half of the time —
    the manifest in the data file forged to seal the edited records (that changes the file's
    identity, so a full verification must still catch the wrong blob).  The model's own
    initializers re-pointed consistently (equal-length weights' offsets swapped, If nodes' names
    swapped so their scopes trade places) change the weights: compared with onnxruntime.
    """
    import onnx

    from onnxpack.prepack import entry_format as fmt

    proto = onnx.ModelProto.FromString(base["files"][base["entry"]])
    recs, seals = _records_of(proto)
    loc = _data_location(proto)
    data = base["files"][loc]
    files: dict[str, bytes] = {}
    oracle, forge, desc = "equal", False, ""
    reseal = rng.random() < 0.6
    kind = rng.choice(["swap", "swap", "repoint_file", "delete_repoint", "dup", "phantom", "seal", "seal",
                       "offsets", "scopes"])
    if kind in ("swap", "repoint_file", "delete_repoint") and _twins(rng, recs) is None:
        kind = "phantom"
    if kind == "scopes":
        owners = [n for n in proto.graph.node if any(True for _ in _subgraph_attrs(n)) and n.name]
        if len({n.name for n in owners}) < 2:
            kind = "offsets"
    if kind == "swap":
        a, b = _twins(rng, recs)
        (ka, pa, ba, bufa), (kb, pb, bb, bufb) = a, b
        fields = _BINDING if rng.random() < 0.8 else ("offset", "crc32")
        va, vb = {f: bufa[f] for f in fields}, {f: bufb[f] for f in fields}
        recs[ka][2]["packs"][pa]["buffers"][ba].update(vb)
        recs[kb][2]["packs"][pb]["buffers"][bb].update(va)
        _store(*recs[ka])
        _store(*recs[kb])
        forge = rng.random() < 0.5
        desc = f"swap {fields} of {ka.rsplit('/', 1)[-1]} and {kb.rsplit('/', 1)[-1]}"
    elif kind == "repoint_file":
        a, b = _twins(rng, recs)
        (ka, pa, ba, bufa), (_kb, _pb, _bb, bufb) = a, b
        alt = rng.choice(["alt.data", base["entry"] + ".data.bak", "copy-" + loc])
        other = bytearray(data)
        blob = data[bufb["offset"]:bufb["offset"] + bufb["length"]]
        other[bufa["offset"]:bufa["offset"] + bufa["length"]] = blob
        files[alt] = bytes(other)
        recs[ka][2]["packs"][pa]["buffers"][ba].update(file=alt, crc32=bufb["crc32"])
        _store(*recs[ka])
        forge = rng.random() < 0.5
        desc = f"re-point {ka.rsplit('/', 1)[-1]} at {alt!r} holding the other blob"
    elif kind == "delete_repoint":
        a, b = _twins(rng, recs)
        (ka, pa, ba, bufa), (kb, _pb, _bb, bufb) = a, b
        _drop_props(proto, {kb})
        recs, _ = _records_of(proto)
        recs[ka][2]["packs"][pa]["buffers"][ba].update({f: bufb[f] for f in _BINDING})
        _store(*recs[ka])
        forge = rng.random() < 0.5
        desc = f"delete {kb.rsplit('/', 1)[-1]}, re-point {ka.rsplit('/', 1)[-1]} at its blob"
    elif kind == "dup":
        pool = list(recs) + [p.key for p in seals]
        key = rng.choice(pool)
        value = next(p.value for p in proto.metadata_props if p.key == key)
        proto.metadata_props.add(key=key, value=value)
        forge = key in recs and rng.random() < 0.5
        desc = f"duplicate {key[:60]}"
    elif kind == "phantom":
        key = rng.choice(sorted(recs))
        obj = json.loads(json.dumps(recs[key][2]))
        how = rng.choice(["name", "scope", "both"])
        if how in ("name", "both"):
            obj["name"] = rng.choice(["ghost", obj["name"] + "_", "W" * 3, "x", obj["name"].upper() + "9"])
        if how in ("scope", "both"):
            obj["scope"] = rng.choice(["/nowhere.then_branch", "/if_a.else_branch", "/#0.body", obj["scope"] + "/x.g"])
        new_key = fmt.record_key(obj["scope"], obj["name"])
        if new_key in recs:
            new_key = fmt.record_key(obj["scope"], obj["name"] + "_ghost")
            obj["name"] += "_ghost"
        prop = proto.metadata_props.add(key=new_key)
        _store(prop, recs[key][1], obj)
        forge = rng.random() < 0.7
        desc = f"record for missing weight {obj['scope']}/{obj['name']}"
    elif kind == "seal":
        import dataclasses

        if not seals:
            desc = "no seal"
        else:
            prop = seals[0]
            rec = fmt.parse_file_record(prop.key, prop.value)
            what = rng.choice(["identity", "offset", "length", "digest", "bytes", "drop", "location", "dup"])
            if what == "identity":
                ident = list(rec.identity)
                i = rng.randrange(5)
                ident[i] = max(0, ident[i] + rng.choice([-1, 1, 10**9, -(10**9)]))
                rec = dataclasses.replace(rec, identity=tuple(ident))
                reseal = False
            elif what == "offset":
                rec = dataclasses.replace(rec, manifest_offset=max(0, rec.manifest_offset + rng.choice([-64, 64, -4096, 4096, -rec.manifest_offset])))
            elif what == "length":
                rec = dataclasses.replace(rec, manifest_length=max(fmt.MANIFEST_HEADER, rec.manifest_length + rng.choice([-32, 32, 64, -64])))
            elif what == "digest":
                rec = dataclasses.replace(rec, manifest_digest="".join(rng.choice("0123456789abcdef") for _ in range(64)))
            elif what == "bytes":
                new, _d = _mutate_bytes(rng, data, rec.manifest_offset, rec.manifest_offset + rec.manifest_length)
                files[loc] = new
            elif what == "location":
                rec = dataclasses.replace(rec, location=rng.choice([base["entry"], "other.data", loc + ".1"]))
            if what == "drop":
                _drop_props(proto, {prop.key})
            elif what == "dup":
                proto.metadata_props.add(key=prop.key, value=prop.value)
            else:
                _drop_props(proto, {prop.key})
                k, v = fmt.format_file_record(rec)
                proto.metadata_props.add(key=k, value=v)
            desc = f"seal: {what}"
    elif kind == "offsets":
        tensors = [t for t in _all_initializers(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
        by_len: dict[int, list] = {}
        for t in tensors:
            e = {x.key: x for x in t.external_data}
            by_len.setdefault(int(e["length"].value), []).append(e)
        pairs = [g for g in by_len.values() if len(g) > 1]
        if pairs:
            a, b = rng.sample(rng.choice(pairs), 2)
            if rng.random() < 0.7:
                a["offset"].value, b["offset"].value = b["offset"].value, a["offset"].value
                desc = "swap the offsets of two equal-length initializers"
            else:
                a["offset"].value = b["offset"].value
                desc = "point an initializer at an equal-length one's bytes"
        else:
            t = rng.choice(tensors)
            e = {x.key: x for x in t.external_data}
            e["offset"].value = str(int(e["offset"].value) + rng.choice([64, -64, 4096]))
            desc = f"{t.name}: offset moved"
        oracle = "reference"
    else:  # scopes
        owners = [n for n in proto.graph.node if any(True for _ in _subgraph_attrs(n)) and n.name]
        a, b = rng.sample(owners, 2)
        a.name, b.name = b.name, a.name
        oracle = "reference"
        desc = f"swap the names of {a.name} and {b.name} (their scopes trade places)"
    if forge and seals:
        files[loc] = _forge_manifest(proto, files.get(loc, data))
        desc += " + manifest forged"
    verify = rng.random() < 0.25
    if forge and reseal and oracle == "equal" and not verify:
        # Records, manifest and seal all rewritten to agree: nothing but a full verification can
        # tell such a model from one saved that way (see docs/reliability.md, "What is trusted").
        oracle = "trusted"
    files[base["entry"]] = proto.SerializeToString()
    return {"files": files, "config": {"onnxpack.verify_prepacked": "1"} if verify else {},
            "oracle": oracle, "reseal": reseal, "desc": f"{kind}: {desc}" + (" (resealed)" if reseal else "")}


def _subgraph_attrs(node):
    from onnx import AttributeProto

    for a in node.attribute:
        if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
            yield a


def _regions(base: dict, loc: str) -> tuple[list, list]:
    weights = [(o, n) for l, o, n in base["weights"] if l == loc and n]
    blobs = [(o, n) for l, o, n in base["blobs"] if l == loc and n]
    return weights, blobs


def _cache_entries(data: bytes) -> list:
    from onnxpack.prepack import cache_file as cf

    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "c")
        with open(p, "wb") as f:
            f.write(data)
        return list(cf.info(p).entries)


def _cache_commit(rng: random.Random, data: bytes, entries: list, both: bool = False) -> bytes:
    """``data`` plus a newer commit holding ``entries`` (an index with valid CRCs, appended, and a
    slot with the next sequence number): what a writer following the format would leave."""
    from onnxpack.prepack import cache_file as cf

    index = cf._encode_index(entries)
    end = -(-len(data) // 64) * 64
    new = bytearray(data + bytes(end - len(data)) + index)
    seq = 1 + max(cf._SLOT.unpack_from(data, i * cf.SLOT_SIZE)[3] for i in range(cf.NUM_SLOTS))
    slot = cf._encode_slot(seq, end, index, len(entries))
    for i in ((0, 1) if both else (rng.randrange(cf.NUM_SLOTS),)):
        new[i * cf.SLOT_SIZE:(i + 1) * cf.SLOT_SIZE] = slot
    return bytes(new)


def forge_cache(rng: random.Random, base: dict) -> dict[str, Any]:
    """Family 1 on the cache file, whose index is its records: a newer commit, CRCs and all
    valid, that swaps the regions of two entries of equal dtype and shape, re-points an entry at
    another's region (and drops that one), swaps two entries' keys, or drops entries.  Without
    ``verify_prepacked`` the cache file is trusted like a sealed data file (its index's CRC-32s
    guard against corruption, not against a rewrite): only "no crash"; with it, the outputs."""
    import dataclasses

    data = base["files"]["packed.cache"]
    entries = _cache_entries(data)
    groups: dict[tuple, list] = {}
    for i, e in enumerate(entries):
        groups.setdefault(tuple((b.dtype, b.shape) for b in e.buffers), []).append(i)
    pairs = [g for g in groups.values() if len(g) > 1]
    kind = rng.choice(["swap", "repoint", "keys", "drop"]) if pairs else "drop"
    if kind == "drop":
        keep = [e for e in entries if rng.random() < 0.5]
        entries, desc = keep, f"drop {len(entries) - len(keep)} entries"
    else:
        i, j = rng.sample(rng.choice(pairs), 2)
        a, b = entries[i], entries[j]
        if kind == "swap":
            entries[i], entries[j] = dataclasses.replace(a, buffers=b.buffers), dataclasses.replace(b, buffers=a.buffers)
        elif kind == "keys":
            entries[i], entries[j] = dataclasses.replace(a, key=b.key), dataclasses.replace(b, key=a.key)
        else:
            entries[i] = dataclasses.replace(a, buffers=b.buffers)
            del entries[j]
        desc = f"{kind} entries {i} and {j}"
    verify = rng.random() < 0.5
    return {"files": {"packed.cache": _cache_commit(rng, data, entries, rng.random() < 0.3)},
            "config": {"onnxpack.verify_prepacked": "1"} if verify else {},
            "oracle": "equal" if verify or kind == "drop" else "trusted", "desc": f"cache commit forged: {desc}"}


def mutate_inplace(rng: random.Random, base: dict) -> dict[str, Any]:
    """Family 2: the data file changed after the save (the files start resealed, as just saved):
    bytes written in place at random offsets (weights, blobs, padding, the manifest) with the
    mtime restored (``os.utime``), a modified copy renamed over it with its stat copied, and
    same-content copies / rewrites / touches, which must still map every blob without a warning.
    """
    import onnx

    proto = onnx.ModelProto.FromString(base["files"][base["entry"]])
    loc = _data_location(proto)
    data = base["files"][loc]
    weights, blobs = _regions(base, loc)
    kind = rng.choice(["patch_weight", "patch_weight", "patch_any", "patch_blob", "replace", "same_copy",
                       "touch", "rewrite_same"])
    if kind == "patch_blob" and not blobs:
        kind = "patch_weight"
    keep = rng.random() < 0.7
    oracle = "reference"

    def patch_in(lo: int, hi: int) -> tuple[int, bytes]:
        n = rng.randint(1, min(64, hi - lo))
        at = rng.randrange(lo, hi - n + 1)
        new = bytes(x ^ rng.randrange(1, 256) for x in data[at:at + n])
        return at, new

    if kind in ("patch_weight", "patch_blob", "patch_any"):
        lo, n = rng.choice(weights if kind == "patch_weight" else blobs) if kind != "patch_any" else (0, len(data))
        at, new = patch_in(lo, lo + n)
        post = [("patch", loc, at, new, keep)]
        desc = f"{kind}: {len(new)} bytes at {at}" + (" (mtime restored)" if keep else "")
    elif kind == "replace":
        lo, n = rng.choice(weights)
        at, new = patch_in(lo, lo + n)
        post = [("replace", loc, data[:at] + new + data[at + len(new):], True)]
        desc = f"copy with {len(new)} bytes changed at {at}, stat copied, renamed over"
    elif kind == "same_copy":
        post = [("replace", loc, data, rng.random() < 0.5)]
        oracle, desc = "mapped", "same-content copy renamed over"
    elif kind == "touch":
        post = [("touch", loc)]
        oracle, desc = "mapped", "mtime moved"
    else:
        lo, n = rng.choice(weights + blobs)
        at = rng.randrange(lo, lo + n)
        post = [("patch", loc, at, data[at:at + rng.randint(1, 64)], keep)]
        oracle, desc = "mapped", f"same bytes written back at {at}"
    verify = rng.random() < 0.2
    return {"files": {}, "config": {"onnxpack.verify_prepacked": "1"} if verify else {}, "oracle": oracle,
            "reseal": True, "post": post, "desc": desc}


def make_live(rng: random.Random, base: dict) -> dict[str, Any]:
    """Family 3: files changed under a live session, between two runs: the data file, the cache
    file or the model file truncated, rewritten in place, ``cp``'d over (truncate, then write),
    replaced by rename, unlinked, appended to (and, for the cache, a legitimate append by another
    process).  The next runs must give the loaded model's outputs or an ``OnnxpackError``, never a
    SIGBUS (which kills the worker: a crash) or other outputs."""
    cache = "packed.cache" in base["files"]
    victims = [base["entry"]] + (["packed.cache"] * 3 if cache else [n for n in base["files"] if n != base["entry"]] * 3)
    victim = rng.choice(victims)
    data = base["files"][victim]
    size = len(data)
    kinds = ["truncate0", "truncate_half", "truncate_tail", "cp_same", "cp_other", "cp_longer", "write", "write",
             "rename_other", "unlink", "append", "truncate_restore"]
    if victim == "packed.cache":
        kinds += ["cache_append", "cache_append"]
    kind = rng.choice(kinds)

    def other_bytes(n: int) -> bytes:
        b = bytearray(data[:n] if n <= size else data + bytes(n - size))
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(b)) if b else 0
            run = rng.randint(1, 256)
            b[at:at + run] = rng.randbytes(len(b[at:at + run]))
        return bytes(b)

    if kind == "truncate0":
        live = [("truncate", victim, 0)]
    elif kind == "truncate_half":
        live = [("truncate", victim, size // 2)]
    elif kind == "truncate_tail":
        live = [("truncate", victim, max(0, size - rng.choice([1, 64, 4096, 65536])))]
    elif kind == "cp_same":
        live = [("cp", victim, data)]
    elif kind == "cp_other":
        live = [("cp", victim, other_bytes(size))]
    elif kind == "cp_longer":
        live = [("cp", victim, other_bytes(size + rng.choice([1, 4096, 100000])))]
    elif kind == "write":
        at = rng.randrange(size) if size else 0
        live = [("patch", victim, at, rng.randbytes(min(rng.randint(1, 4096), max(1, size - at))), rng.random() < 0.5)]
    elif kind == "rename_other":
        live = [("replace", victim, other_bytes(size), rng.random() < 0.5)]
    elif kind == "unlink":
        live = [("unlink", victim)]
    elif kind == "append":
        live = [("append", victim, rng.randbytes(rng.randint(1, 70000)))]
    elif kind == "truncate_restore":
        live = [("truncate", victim, rng.randrange(size + 1)), ("cp", victim, data)]
    else:
        live = [("cache_append", victim, rng.randrange(1 << 30))]
    return {"files": {}, "config": {}, "oracle": "live", "reseal": True, "live": live,
            "desc": f"{victim}: {kind}"}


# Special files created in every case folder of the special family (besides the harness's usual
# neighbours fifo, subdir, devzero, link_out).
_SPECIAL_NAMES = {"fifo": "fifo", "link_fifo": "link:fifo", "devzero": "link:/dev/zero", "subdir": "dir",
                  "link_subdir": "link:subdir", "dev_null": "link:/dev/null"}


def make_special(rng: random.Random, base: dict, bases: dict) -> dict[str, Any]:
    """Family 4: special files (FIFO, symlink to a FIFO, /dev/zero, a folder) as the model path, a
    data location, a record's file, the cache path and the cache's lock file.  A hang (the
    per-case timeout) is a failure; a model or data file that is not a regular file must be an
    ``OnnxpackError``, a record or cache file one only loses its blobs (a warning, same outputs)."""
    import onnx

    special = rng.choice(["fifo", "link_fifo", "devzero", "subdir", "link_subdir", "dev_null"])
    where = rng.choice(["model", "location", "record", "cache", "cache", "lock", "lock"])
    if where in ("cache", "lock"):
        name = rng.choice(sorted(b for b in bases if b.endswith("+cache")))
        base = bases[name]
    case: dict[str, Any] = {"files": {}, "config": {}, "base": base["name"]}
    if where == "model":
        case.update(path=special, oracle="error")
    elif where == "location":
        proto = onnx.ModelProto.FromString(base["files"][base["entry"]])
        tensors = [t for t in _all_initializers(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
        t = rng.choice(tensors)
        for e in t.external_data:
            if e.key == "location":
                e.value = special
        case.update(files={base["entry"]: proto.SerializeToString()}, oracle="error", reseal=True)
    elif where == "record":
        proto = onnx.ModelProto.FromString(base["files"][base["entry"]])
        recs, _ = _records_of(proto)
        if recs:
            key = rng.choice(sorted(recs))
            for pack in recs[key][2]["packs"]:
                for b in pack["buffers"]:
                    b["file"] = special
            _store(*recs[key])
            files = {base["entry"]: proto.SerializeToString()}
            if rng.random() < 0.5:
                loc = _data_location(proto)
                if loc:
                    files[loc] = _forge_manifest(proto, base["files"][loc])
                    files[base["entry"]] = proto.SerializeToString()
            case.update(files=files)
        case.update(oracle="equal", reseal=rng.random() < 0.5)
    elif where == "cache":
        target = rng.choice([special, special, "/dev/zero"])
        case.update(config={"onnxpack.prepacked_cache_path": target}, oracle="equal")
    else:  # lock: the session packs (no cache file yet) and appends, taking the lock
        case.update(remove=["packed.cache"] if rng.random() < 0.8 else [], oracle="equal",
                    special=[("packed.cache.lock", _SPECIAL_NAMES[special])])
        special = "lock=" + special
    case["desc"] = f"{where}: {special}"
    return case


# Decoy bytes: what a file of the working directory holds where the model folder's file holds
# the real tensor.  666.0 as float32; the real values are small integers, so a decoy anywhere in
# a computation shows in the outputs.
DECOY = 666.0


def _ext_tensor(name: str, array, location: str, offset: int):
    from onnx import TensorProto, numpy_helper

    t = numpy_helper.from_array(array, name)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(array.nbytes))):
        t.external_data.add(key=k, value=v)
    return t


def _tensors_of(graph):
    """Every TensorProto of ``graph`` and its subgraphs: initializers, sparse ones' values and
    indices, node attributes (``t``, ``tensors``, ``sparse_tensor(s)``)."""
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield sp.values
        yield sp.indices
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("sparse_tensor"):
                yield a.sparse_tensor.values
                yield a.sparse_tensor.indices
            for sp in a.sparse_tensors:
                yield sp.values
                yield sp.indices
            if a.HasField("g"):
                yield from _tensors_of(a.g)
            for g in a.graphs:
                yield from _tensors_of(g)


def _inline_model(model, files: dict[str, bytes]) -> bytes:
    """``model`` with every external tensor's bytes (from ``files``, by normalized location)
    stored inline: the same model as the fuzzer meant it, for the reference."""
    from onnx import ModelProto, TensorProto

    m = ModelProto()
    m.CopyFrom(model)
    for t in _tensors_of(m.graph):
        if t.data_location == TensorProto.EXTERNAL:
            e = {x.key: x.value for x in t.external_data}
            off, n = int(e.get("offset", 0)), int(e["length"])
            raw = files[os.path.normpath(e["location"])][off:off + n]
            t.ClearField("external_data")
            t.data_location = TensorProto.DEFAULT
            t.raw_data = bytes(raw)
    return m.SerializeToString()


def make_attr(rng: random.Random) -> dict[str, Any]:
    """Family 5: attribute tensors with external data — a Constant's ``value`` and
    ``sparse_value``, ConstantOfShape's ``value``, initializers and Constants of subgraphs (If,
    Loop, SequenceMap bodies), sparse initializers of subgraphs, a Constant weight a MatMul packs
    — whose locations (``c0.bin``, ``./c1.bin``, ``sub/c0.bin`` …) resolve to other files from
    the working directory, which holds decoys (666.0) under the same names.  Optionally optimized
    first (the save reads them too).  Oracle: onnx.reference on the same model with every tensor
    inline; a decoy in an output is a wrong output."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    F = TensorProto.FLOAT
    files: dict[str, bytearray] = {}

    def ext(name: str, array):
        loc = rng.choice(["c0.bin", "c1.bin", "sub/c0.bin", "./c1.bin", "sub/./c2.bin"])
        buf = files.setdefault(os.path.normpath(loc), bytearray())
        off = -(-len(buf) // 64) * 64
        buf.extend(bytes(off - len(buf)))
        buf.extend(array.tobytes())
        return _ext_tensor(name, array, loc, off)

    def vec(n=4):
        return (rng.choice([-3, -2, -1, 1, 2, 3]) * np.arange(1, n + 1) + rng.randint(-4, 4)).astype(np.float32)

    def branch(kind: str, tag: str):
        """An If branch adding a weight to x: an initializer, a Constant or a sparse initializer
        of the branch."""
        w = vec()
        bnodes, binits, bsparse = [], [], []
        if kind == "init":
            binits.append(ext(f"w_{tag}", w))
        elif kind == "constant":
            bnodes.append(helper.make_node("Constant", [], [f"w_{tag}"], value=ext(f"w_{tag}", w)))
        else:
            idx = np.array([0, 2], np.int64)
            bsparse.append(helper.make_sparse_tensor(ext(f"w_{tag}", w[idx]), numpy_helper.from_array(idx, f"w_{tag}_i"), [4]))
        bnodes.append(helper.make_node("Add", ["x", f"w_{tag}"], [f"o_{tag}"]))
        g = helper.make_graph(bnodes, f"b_{tag}", [], [helper.make_tensor_value_info(f"o_{tag}", F, [4])], binits)
        g.sparse_initializer.extend(bsparse)
        return g

    nodes, inits, outs = [], [], []
    pieces = rng.sample(["constant", "sparse_constant", "cos", "if_init", "if_constant", "if_sparse", "loop_init",
                         "seqmap", "matmul_constant"], rng.randint(1, 4))
    for k, piece in enumerate(pieces):
        out = f"p{k}"
        if piece == "constant":
            nodes.append(helper.make_node("Constant", [], [out], value=ext(f"k{k}", vec())))
        elif piece == "sparse_constant":
            idx = np.array([1, 3], np.int64)
            indices = ext(f"k{k}_i", idx) if rng.random() < 0.5 else numpy_helper.from_array(idx, f"k{k}_i")
            sp = helper.make_sparse_tensor(ext(f"k{k}", vec(2)), indices, [4])
            nodes.append(helper.make_node("Constant", [], [out], sparse_value=sp))
        elif piece == "cos":
            inits.append(numpy_helper.from_array(np.array([4], np.int64), f"shape{k}"))
            value = ext(f"k{k}", np.array([rng.randint(-9, 9)], np.float32))
            nodes.append(helper.make_node("ConstantOfShape", [f"shape{k}"], [out], value=value))
        elif piece.startswith("if_"):
            nodes.append(helper.make_node("If", ["c"], [out], name=f"if{k}", then_branch=branch(piece[3:], f"t{k}"),
                                          else_branch=branch(piece[3:], f"e{k}")))
        elif piece == "loop_init":
            body = helper.make_graph(
                [helper.make_node("Add", [f"acc{k}", f"lw{k}"], [f"acc_out{k}"]),
                 helper.make_node("Identity", [f"cond{k}"], [f"cond_out{k}"])],
                f"loop{k}", [helper.make_tensor_value_info(f"i{k}", TensorProto.INT64, []),
                             helper.make_tensor_value_info(f"cond{k}", TensorProto.BOOL, []),
                             helper.make_tensor_value_info(f"acc{k}", F, [4])],
                [helper.make_tensor_value_info(f"cond_out{k}", TensorProto.BOOL, []),
                 helper.make_tensor_value_info(f"acc_out{k}", F, [4])], [ext(f"lw{k}", vec())])
            inits.append(numpy_helper.from_array(np.array(rng.randint(0, 3), np.int64), f"trip{k}"))
            nodes.append(helper.make_node("Loop", [f"trip{k}", "", "x"], [out], body=body))
        elif piece == "seqmap":
            body = helper.make_graph([helper.make_node("Mul", [f"e{k}", f"sw{k}"], [f"so{k}"])], f"sm{k}",
                                     [helper.make_tensor_value_info(f"e{k}", F, [4])],
                                     [helper.make_tensor_value_info(f"so{k}", F, [4])], [ext(f"sw{k}", vec())])
            inits.append(numpy_helper.from_array(np.array(0, np.int64), f"zero{k}"))
            nodes += [helper.make_node("SequenceConstruct", ["x"], [f"seq{k}"]),
                      helper.make_node("SequenceMap", [f"seq{k}"], [f"mapped{k}"], body=body),
                      helper.make_node("SequenceAt", [f"mapped{k}", f"zero{k}"], [out])]
        else:  # matmul_constant: a Constant weight the MatMul kernel packs (a constant expression)
            w = np.array([[rng.randint(-3, 3) for _ in range(4)] for _ in range(4)], np.float32)
            nodes += [helper.make_node("Constant", [], [f"mw{k}"], value=ext(f"mw{k}", w)),
                      helper.make_node("MatMul", ["x", f"mw{k}"], [out])]
        outs.append(out)
    acc = "x"
    for j, o in enumerate(outs):
        nxt = f"sum{j}" if j < len(outs) - 1 else "y"
        nodes.append(helper.make_node("Add", [acc, o], [nxt]))
        acc = nxt
    g = helper.make_graph(nodes, "attr", [helper.make_tensor_value_info("x", F, [4]),
                                          helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", F, [4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnxpack-fuzz")
    model.ir_version = 8
    data = {n: bytes(b) for n, b in files.items()}
    decoys = {n: np.full(len(b) // 4 + 16, DECOY, np.float32).tobytes() for n, b in data.items()}
    cond = rng.random() < 0.5
    out_files = {"attr.onnx": model.SerializeToString(), **data}
    feeds = {"x": np.arange(4, dtype=np.float32) - 1.5, "c": np.array(cond)}
    return {"standalone": True, "entry": "attr.onnx", "files": out_files, "cwd": decoys, "feeds": feeds,
            "inline": _inline_model(model, data), "oracle": "want", "config": {},
            "optimize": rng.random() < 0.3, "desc": f"{'+'.join(pieces)} (c={cond})"}


def _giant_dims(rng: random.Random, lo_bits: int, hi_bits: int) -> list[int]:
    """1-4 dims (each below 2^63, what an ONNX int64 dim holds) whose product has between
    ``lo_bits`` and ``hi_bits`` bits."""
    total = rng.randint(lo_bits, hi_bits)
    n = max(rng.randint(1, 4), -(-total // 62))
    cuts = sorted(rng.randint(0, total) for _ in range(n - 1))
    bits = [min(b - a, 62) for a, b in zip([0] + cuts, cuts + [total])]
    return [max(1, (1 << b) + rng.choice([0, 0, 1, -1, 3])) for b in bits]


_HUGE_DTYPES = {1: 4, 10: 2, 3: 1, 11: 8, 7: 8}  # ONNX elem type -> itemsize


def make_huge(rng: random.Random, bases: dict) -> dict[str, Any]:
    """Family 6: huge but consistent shapes — declared dims up to 2^62 with a matching external
    ``length``, zero-size tensors with giant dims, sparse initializers with dims up to 2^40 (a
    few valid indices), giant Constant values, giant value-info shapes, ops asked for giant
    outputs at run time, saved records and cache-index entries whose shapes and lengths agree
    but are giant.  They must be refused (an ``OnnxpackError``, or the blob or cache entry ignored
    with a warning) *before* allocating: the case's peak traced allocation is capped, and for
    declared shapes a ``MemoryError`` anywhere in the error chain is a failure (the refusal came
    from the allocator, not from a check).  Shapes computed at run time are asked for sizes no
    allocator grants (>= 2^38 elements): a clean error, and the memory does not grow."""
    import numpy as np
    from onnx import TensorProto, TypeProto, helper, numpy_helper

    F = TensorProto.FLOAT
    kind = rng.choice(["init_ext", "init_zero", "sparse", "attr_ext", "value_info", "runtime", "runtime",
                       "record_shape", "cache_shape"])
    limit = 64 << 20
    x = np.arange(4, dtype=np.float32)

    def model(nodes, inits, inputs=None, outputs=None, sparse=()):
        g = helper.make_graph(nodes, "huge", inputs or [helper.make_tensor_value_info("x", F, [4])],
                              outputs or [helper.make_tensor_value_info("y", F, None)], inits)
        g.sparse_initializer.extend(sparse)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnxpack-fuzz")
        m.ir_version = 8
        return m.SerializeToString()

    def giant_ext(name, dims, elem):
        t = TensorProto(name=name, data_type=elem, dims=dims, data_location=TensorProto.EXTERNAL)
        n = math.prod(dims) * _HUGE_DTYPES[elem]
        for k, v in (("location", "w.bin"), ("offset", str(rng.choice([0, 0, 64, 4096]))), ("length", str(n))):
            t.external_data.add(key=k, value=v)
        return t

    case: dict[str, Any] = {"standalone": True, "entry": "huge.onnx", "feeds": {"x": x}, "config": {},
                            "limit": limit, "declared": True}
    elem = rng.choice(sorted(_HUGE_DTYPES))
    if kind == "init_ext":
        dims = _giant_dims(rng, 28, 66)
        case["files"] = {"huge.onnx": model([helper.make_node("Identity", ["W"], ["y"])], [giant_ext("W", dims, elem)],
                                            outputs=[helper.make_tensor_value_info("y", elem, None)]),
                         "w.bin": bytes(8192)}
        case.update(oracle="error", desc=f"external initializer {dims} of type {elem}")
    elif kind == "init_zero":
        dims = _giant_dims(rng, 20, 70)
        dims.insert(rng.randrange(len(dims) + 1), 0)
        if rng.random() < 0.5:
            t = TensorProto(name="W", data_type=elem, dims=dims, raw_data=b"")
        else:
            t = TensorProto(name="W", data_type=elem, dims=dims, data_location=TensorProto.EXTERNAL)
            for k, v in (("location", "w.bin"), ("offset", "0"), ("length", "0")):
                t.external_data.add(key=k, value=v)
        case["files"] = {"huge.onnx": model([helper.make_node("Identity", ["W"], ["y"])], [t],
                                            outputs=[helper.make_tensor_value_info("y", elem, None)]),
                         "w.bin": bytes(64)}
        case.update(oracle="zero", shape=dims, desc=f"zero-size initializer {dims}")
    elif kind == "sparse":
        from onnxpack.graph._model import MAX_DENSE_SPARSE_BYTES

        dims = _giant_dims(rng, 33, 62) if rng.random() < 0.8 else _giant_dims(rng, 36, 40)
        while math.prod(dims) * 4 <= MAX_DENSE_SPARSE_BYTES:  # above the densify cap: must be refused
            dims[rng.randrange(len(dims))] *= 2
        count = math.prod(dims)
        nvals = rng.randint(1, 4)
        flat = sorted(rng.sample(range(min(count, 1 << 62)), nvals)) if count < 1 << 62 else list(range(nvals))
        if rng.random() < 0.5:
            idx = np.array(flat, np.int64)
        else:
            idx = np.array([np.unravel_index(f, dims) for f in flat], np.int64) if count < 1 << 62 else np.zeros((nvals, len(dims)), np.int64)
        sp = helper.make_sparse_tensor(numpy_helper.from_array(np.ones(nvals, np.float32), "S"),
                                       numpy_helper.from_array(idx, "S_i"), dims)
        case["files"] = {"huge.onnx": model([helper.make_node("ReduceSum", ["S"], ["y"], keepdims=0)], [], sparse=[sp])}
        case.update(oracle="error", desc=f"sparse initializer dims {dims} ({nvals} values)")
    elif kind == "attr_ext":
        dims = _giant_dims(rng, 28, 66)
        node = helper.make_node("Constant", [], ["y"], value=giant_ext("v", dims, elem))
        case["files"] = {"huge.onnx": model([node], [], outputs=[helper.make_tensor_value_info("y", elem, None)]),
                         "w.bin": bytes(8192)}
        case.update(oracle="error", desc=f"Constant value {dims} of type {elem}")
    elif kind == "value_info":
        where = rng.choice(["input", "output", "both", "value_info"])
        dims_in = _giant_dims(rng, 30, 63) if where in ("input", "both") else [4]
        dims_out = _giant_dims(rng, 30, 63) if where in ("output", "both") else [4]
        nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "one"], ["y"])]
        g = helper.make_graph(nodes, "huge", [helper.make_tensor_value_info("x", F, dims_in)],
                              [helper.make_tensor_value_info("y", F, dims_out)],
                              [numpy_helper.from_array(np.ones(4, np.float32), "one")])
        if where == "value_info":
            g.value_info.append(helper.make_tensor_value_info("r", F, _giant_dims(rng, 30, 63)))
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        case["files"] = {"huge.onnx": m.SerializeToString()}
        case.update(oracle="error_or_want", want=[np.maximum(x, 0) + 1], desc=f"declared shapes ({where})")
        case["declared"] = False
    elif kind == "runtime":
        op = rng.choice(["cos", "expand", "tile", "reshape0", "range", "pad"])
        dims = _giant_dims(rng, 38, 64)
        inits = []
        if op == "cos":
            inits.append(numpy_helper.from_array(np.array(dims, np.int64), "shape"))
            nodes = [helper.make_node("ConstantOfShape", ["shape"], ["y"])]
        elif op == "expand":
            inits.append(numpy_helper.from_array(np.array(dims, np.int64), "shape"))
            nodes = [helper.make_node("Expand", ["x", "shape"], ["y"])]
            dims[-1] = 4
        elif op == "tile":
            inits.append(numpy_helper.from_array(np.array([min(math.prod(dims), 2**62)], np.int64), "reps"))
            nodes = [helper.make_node("Tile", ["x", "reps"], ["y"])]
        elif op == "reshape0":
            dims.insert(rng.randrange(len(dims) + 1), 0)
            inits += [numpy_helper.from_array(np.zeros(0, np.float32), "e"), numpy_helper.from_array(np.array(dims, np.int64), "shape")]
            nodes = [helper.make_node("Reshape", ["e", "shape"], ["y"], allowzero=1)]
        elif op == "range":
            inits += [numpy_helper.from_array(np.array(0, np.int64), "a"), numpy_helper.from_array(np.array(min(math.prod(dims), 2**63 - 1), np.int64), "b"),
                      numpy_helper.from_array(np.array(1, np.int64), "d")]
            nodes = [helper.make_node("Range", ["a", "b", "d"], ["y"])]
        else:
            inits.append(numpy_helper.from_array(np.array([0, min(math.prod(dims), 2**62)], np.int64), "pads"))
            nodes = [helper.make_node("Pad", ["x", "pads"], ["y"])]
        case["files"] = {"huge.onnx": model(nodes, inits, outputs=[helper.make_value_info("y", TypeProto())])}
        case.update(oracle="error_or_ref" if op == "reshape0" else "error", desc=f"run-time {op} to {dims}")
        case["declared"] = False
    elif kind == "record_shape":
        name = rng.choice(sorted(b for b in bases if not b.endswith("+cache") and bases[b]["blobs"]))
        base = bases[name]
        import onnx

        proto = onnx.ModelProto.FromString(base["files"][base["entry"]])
        recs, _ = _records_of(proto)
        key, pi, bi, buf = rng.choice(_saved_buffers(recs))
        itemsize = np.dtype(buf["dtype"]).itemsize
        dims = _giant_dims(rng, 20, 60)
        if rng.random() < 0.3:
            dims.insert(0, 0)
        buf.update(shape=dims, length=math.prod(dims) * itemsize)
        _store(*recs[key])
        files = {base["entry"]: proto.SerializeToString()}
        if rng.random() < 0.5:
            loc = _data_location(proto)
            files[loc] = _forge_manifest(proto, base["files"][loc])
            files[base["entry"]] = proto.SerializeToString()
        case = {"base": name, "files": files, "config": {}, "oracle": "equal", "limit": limit, "declared": True,
                "reseal": rng.random() < 0.5, "desc": f"record buffer shape {dims}"}
    else:  # cache_shape: a newer commit whose index (valid CRCs) declares a giant entry
        from onnxpack.prepack import cache_file as cf

        name = rng.choice(sorted(b for b in bases if b.endswith("+cache")))
        base = bases[name]
        data = base["files"]["packed.cache"]
        entries = _cache_entries(data)
        j = rng.randrange(len(entries))
        e = entries[j]
        b0 = e.buffers[0]
        itemsize = np.dtype(b0.dtype).itemsize
        dims = tuple(_giant_dims(rng, 20, 60))
        if rng.random() < 0.3:
            dims = (0,) + dims
        giant = cf.CacheBuffer(b0.offset, math.prod(dims) * itemsize, b0.dtype, dims, b0.crc32)
        entries[j] = cf.CacheEntry(e.key, (giant,) + e.buffers[1:])
        both = rng.random() < 0.3
        new = _cache_commit(rng, data, entries, both)
        case = {"base": name, "files": {"packed.cache": new}, "config": {}, "oracle": "equal", "limit": limit,
                "declared": True, "desc": f"cache index entry shape {list(dims)}" + (" in both slots" if both else "")}
    return case


def _if_unit(rng: random.Random, k: int, prev: str, depth: int, weights: bool, outer: bool, counter: list[int]):
    """One If node computing from ``prev`` (then: +w, else: -w), its then-branch nesting
    another such If, ``depth`` levels in all."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    F = TensorProto.FLOAT

    def uid(tag: str) -> str:
        counter[0] += 1
        return f"{tag}{counter[0]}"

    def branch(sign: str, level: int):
        out = uid("o")
        nodes, inits = [], []
        src = prev
        if level + 1 < depth and sign == "then":  # a chain: only then-branches nest further
            inner = uid("n")
            nodes.append(helper.make_node("If", ["c"], [inner], name=uid("if"),
                                          then_branch=branch("then", level + 1), else_branch=branch("else", level + 1)))
            src = inner
        wname = "w" if outer else uid("w")
        if not outer:
            inits.append(numpy_helper.from_array(np.full(4, 0.5 if sign == "then" else 0.25, np.float32), wname))
        if weights:
            m = uid("m")
            mm = uid("mw")
            inits.append(numpy_helper.from_array((np.eye(4) * (1 + (counter[0] % 3) / 4)).astype(np.float32), mm))
            nodes.append(helper.make_node("MatMul", [src, mm], [m]))
            src = m
        nodes.append(helper.make_node("Add" if sign == "then" else "Sub", [src, wname], [out]))
        return helper.make_graph(nodes, uid("g"), [], [helper.make_tensor_value_info(out, F, [1, 4])], inits)

    out = uid("h")
    return helper.make_node("If", ["c"], [out], name=f"if{k}", then_branch=branch("then", 0),
                            else_branch=branch("else", 0)), out


def _loop_unit(k: int, prev: str, trips: int, counter: list[int]):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    F = TensorProto.FLOAT
    counter[0] += 1
    n = counter[0]
    body = helper.make_graph(
        [helper.make_node("Add", [f"a{n}", "w"], [f"ao{n}"]), helper.make_node("Identity", [f"cd{n}"], [f"co{n}"])],
        f"loop{n}", [helper.make_tensor_value_info(f"i{n}", TensorProto.INT64, []),
                     helper.make_tensor_value_info(f"cd{n}", TensorProto.BOOL, []),
                     helper.make_tensor_value_info(f"a{n}", F, [1, 4])],
        [helper.make_tensor_value_info(f"co{n}", TensorProto.BOOL, []), helper.make_tensor_value_info(f"ao{n}", F, [1, 4])])
    trip = numpy_helper.from_array(np.array(trips, np.int64), f"trip{n}")
    return helper.make_node("Loop", [f"trip{n}", "", prev], [f"l{n}"], name=f"loop{k}", body=body), f"l{n}", trip


def make_subgraphs(rng: random.Random) -> dict[str, Any]:
    """Family 7: many subgraphs — hundreds to thousands of If / Loop nodes, nesting up to ~25
    deep (protobuf's parser stops near 33), weights inside branches or read from the outer scope,
    optionally optimized first (one record per branch weight).  Creation must finish within a
    linear budget (``CREATE_BUDGET``) and the outputs match onnxruntime's."""
    size = rng.choice(["small", "small", "medium", "large"])
    n = {"small": rng.randint(1, 60), "medium": rng.randint(60, 600), "large": rng.randint(600, 2500)}[size]
    depth = rng.choice([1, 1, 1, 2, 3, rng.randint(4, 12), rng.randint(12, 26)])
    weights = rng.random() < 0.5
    case = subgraph_case(rng, n, depth, weights=weights, outer=rng.random() < 0.5, loops=rng.random() < 0.3,
                         cond=rng.random() < 0.5)
    case["optimize"] = weights and rng.random() < 0.4 and case["nodes"] < 4000
    return case


def subgraph_case(rng: random.Random, n: int, depth: int, *, weights: bool, outer: bool, loops: bool,
                  cond: bool) -> dict[str, Any]:
    """A chain of ``n`` If (and, with ``loops``, Loop) nodes, the first three nested ``depth``
    deep, as a standalone case with the linear creation budget."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    F = TensorProto.FLOAT
    counter = [0]
    nodes, inits = [], [numpy_helper.from_array(np.full(4, 0.125, np.float32), "w")]
    prev = "x"
    for k in range(n):
        if loops and rng.random() < 0.3:
            node, prev, trip = _loop_unit(k, prev, rng.randint(0, 2), counter)
            inits.append(trip)
        else:
            node, prev = _if_unit(rng, k, prev, depth if k < 3 else 1, weights, outer, counter)
        nodes.append(node)
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    g = helper.make_graph(nodes, "many", [helper.make_tensor_value_info("x", F, [1, 4]),
                                          helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", F, [1, 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnxpack-fuzz")
    m.ir_version = 8
    total = sum(1 for _ in _all_nodes(m.graph))
    budget = CREATE_BUDGET[0] + CREATE_BUDGET[1] * total
    feeds = {"x": (np.arange(4, dtype=np.float32) / 4).reshape(1, 4), "c": np.array(cond)}
    return {"standalone": True, "entry": "many.onnx", "files": {"many.onnx": m.SerializeToString()}, "feeds": feeds,
            "config": {}, "oracle": "want", "budget": budget, "timeout": CASE_TIMEOUT + 3 * budget, "nodes": total,
            "desc": f"{n} units ({'If+Loop' if loops else 'If'}), depth {depth}, {total} nodes"
                    + (", branch weights" if weights else "") + (", outer w" if outer else "")}


# Session creation budget of the many-subgraphs family: seconds = a + b * (nodes in all graphs).
# Measured ~0.15 ms per node here (2 CPUs, shared); the budget allows 20x that plus a constant, so
# only a super-linear creation (or a hang) fails, not a busy machine.
CREATE_BUDGET = (3.0, 0.003)


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.HasField("g"):
                yield from _all_nodes(a.g)
            for g in a.graphs:
                yield from _all_nodes(g)


def make_case(target: str, seed: int, bases: dict[str, dict], case_id: int = 0) -> dict[str, Any]:
    """The case of ``target`` drawn from ``seed`` (deterministic: a failing seed reproduces)."""
    rng = random.Random(f"{target}:{seed}")
    if target == "cache":  # bases whose cache file holds entries (kernels that pack)
        pool = [b for b in bases if b.endswith("+cache") and bases[b]["cache"]["regions"]]
    elif target in ("entry", "blob"):  # bases with saved blobs
        pool = [b for b in bases if not b.endswith("+cache") and bases[b]["blobs"]]
    elif target == "record":  # saved blobs, and one time in four a cache file
        cached = rng.random() < 0.25
        pool = [b for b in bases if (b.endswith("+cache") and bases[b]["cache"]["regions"]) if cached] or [
            b for b in bases if not b.endswith("+cache") and bases[b]["blobs"]]
    elif target == "live":
        pool = list(bases)
    else:
        pool = [b for b in bases if not b.endswith("+cache")]
    base = bases[rng.choice(sorted(pool))]
    head = {"id": case_id, "target": target, "seed": seed, "base": base["name"]}
    oracle = "equal"
    reseal = False
    if target == "entry":
        files, config, desc = mutate_entry(rng, base)
        reseal = rng.random() < 0.5  # the data file is untouched: its seal may still hold
    elif target == "blob":
        files, config, desc, oracle = mutate_blob(rng, base)
        # Resealed: bytes that changed while the file's identity did not (bit rot, a forged seal),
        # the trusted path where only small blobs are CRC-checked.
        reseal = rng.random() < 0.5
    elif target == "external":
        files, config, desc = mutate_external(rng, base)
        oracle = "reference"
        reseal = rng.random() < 0.5
    elif target == "cache":
        files, config, desc, oracle = mutate_cache(rng, base)
    elif target == "proto":
        files, config, desc = mutate_proto(rng, base)
        oracle = "reference"
        reseal = rng.random() < 0.5
    else:
        if target == "record":
            case = forge_cache(rng, base) if base["name"].endswith("+cache") else mutate_record(rng, base)
        elif target == "inplace":
            case = mutate_inplace(rng, base)
        elif target == "live":
            case = make_live(rng, base)
        elif target == "special":
            case = make_special(rng, base, bases)
        elif target == "attr":
            case = make_attr(rng)
        elif target == "huge":
            case = make_huge(rng, bases)
        elif target == "subgraphs":
            case = make_subgraphs(rng)
        else:
            raise ValueError(f"unknown target {target!r}")
        if case.get("standalone"):
            head["base"] = None
        return {**head, **case}
    return {**head, "files": files, "config": config, "oracle": oracle, "desc": desc,
            **({"reseal": True} if reseal else {})}


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


def _make_special(folder: str, name: str, kind: str) -> None:
    """A special file ``name`` in ``folder``: ``fifo``, ``dir`` or ``link:<target>``."""
    path = os.path.join(folder, name)
    if os.path.lexists(path):
        return
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    else:
        os.symlink(kind.split(":", 1)[1], path)


def _reseal(folder: str, entry: str) -> None:
    """Gives every data-file seal of the model the file's current identity, as the save does right
    after its rename: the case then starts on the trusted path (nothing re-read at load)."""
    import dataclasses

    import onnx

    from onnxpack.graph import stat_identity
    from onnxpack.prepack import entry_format as fmt

    path = os.path.join(folder, entry)
    try:
        with open(path, "rb") as f:
            proto = onnx.ModelProto.FromString(f.read())
    except Exception:  # noqa: BLE001 - a mutated proto that does not parse has no seal to renew
        return
    changed = False
    for p in proto.metadata_props:
        if not fmt.is_file_key(p.key):
            continue
        try:
            rec = fmt.parse_file_record(p.key, p.value)
            st = os.stat(os.path.join(folder, rec.location))
        except Exception:  # noqa: BLE001 - a broken seal stays broken
            continue
        key, value = fmt.format_file_record(dataclasses.replace(rec, identity=stat_identity(st)))
        if key == p.key:
            p.value = value
            changed = True
    if changed:
        with open(path, "wb") as f:
            f.write(proto.SerializeToString())


def _act(folder: str, act: tuple) -> None:
    """One change to a file of the case folder (``post`` and ``live`` actions)."""
    op, path = act[0], os.path.join(folder, act[1])
    if op == "patch":  # bytes written in place; mtime optionally restored (ctime still moves)
        _, _, at, data, keep = act
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(data)
        if keep:
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif op == "replace":  # a new file renamed over (another inode), its stat optionally copied
        _, _, data, keep = act
        tmp = path + ".new~"
        with open(tmp, "wb") as f:
            f.write(data)
        if keep:
            shutil.copystat(path, tmp)
        os.replace(tmp, path)
    elif op == "touch":
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif op == "truncate":
        os.truncate(path, act[2])
    elif op == "cp":  # what `cp new old` does: truncate the same inode, then write
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write(act[2])
    elif op == "unlink":
        os.unlink(path)
    elif op == "append":
        with open(path, "ab") as f:
            f.write(act[2])
    elif op == "cache_append":  # another process adds entries: a legitimate append
        import numpy as np

        from onnxpack.prepack import cache_file as cf

        cf.append_entries(path, {f"other/1/{act[2]:032x}": (np.arange(4096, dtype=np.float32),)})
    else:
        raise ValueError(f"Bug: unknown action {op!r}")


def _error_chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


# Writes seen while onnxpack runs in the worker (None: not watching).  An audit hook records
# every open for writing, rename, removal, mkdir and truncation; one outside the case's folder is a
# failure (onnxpack writes only its outputs, temp files beside them, the cache file and its lock).
_WRITES: list[str] | None = None
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _audit(event: str, args: tuple) -> None:
    if _WRITES is None:
        return
    paths = ()
    nofollow = False
    if event == "open":
        path, mode, flags = args
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS):
            paths = (path,)
            # O_NOFOLLOW: a symlink as the last component is refused, never followed.
            nofollow = isinstance(flags, int) and bool(flags & getattr(os, "O_NOFOLLOW", 0))
    elif event in ("os.rename", "os.remove", "os.mkdir", "os.truncate", "os.rmdir", "os.symlink", "os.link"):
        paths = tuple(a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike)))
    for p in paths:
        if isinstance(p, (str, bytes, os.PathLike)):
            p = os.fsdecode(p)
            if nofollow:
                real = os.path.join(os.path.realpath(os.path.dirname(p) or "."), os.path.basename(p))
            else:
                real = os.path.realpath(p)  # now: /proc/self/fd/N names an open file
            if not real.startswith("/proc/"):  # the harness resets the peak RSS there
                _WRITES.append(real)


def _code_cache_dirs() -> list[str]:
    """Where caches of onnxpack's own code go: Python's bytecode and numba's compiled kernels
    (``cache=True``) in the package's ``__pycache__`` folders, or ``NUMBA_CACHE_DIR``.  Writes
    there are not writes of model data, so they do not count as writes outside the folder."""
    import onnxpack
    dirs = [os.path.realpath(os.path.dirname(onnxpack.__file__))]
    if os.environ.get("NUMBA_CACHE_DIR"):
        dirs.append(os.path.realpath(os.environ["NUMBA_CACHE_DIR"]))
    return dirs


def _is_code_cache(path: str, dirs: list[str]) -> bool:
    if path.startswith(dirs[0] + os.sep):
        return "__pycache__" in path[len(dirs[0]):].split(os.sep)
    return any(path.startswith(d + os.sep) for d in dirs[1:])


def _outside(writes: list[str], roots: list[str]) -> list[str]:
    real = [os.path.realpath(r) for r in roots]
    caches = _code_cache_dirs()
    bad = []
    for w in writes:
        rw = os.path.realpath(w)
        if not any(rw == r or rw.startswith(r + os.sep) for r in real) and not _is_code_cache(rw, caches):
            bad.append(w)
    return bad


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> int | None:
    """Resets the process's peak RSS (Linux ``clear_refs``) and returns the current RSS; None
    where that is not possible.  Real memory, not numpy's requests: numpy reports an allocation to
    tracemalloc even when it fails (a 2 TiB request refused by the kernel costs nothing)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS")
    except (OSError, KeyError, ValueError):
        return None


_ROOTS: list[str] = []  # the case's folders
_SEEN: list[str] = []  # what was written while watching


def _evaluate(case: dict, bases: dict, workdir: str, out) -> dict[str, Any]:
    """Runs one case (see the module docstring and the families' docstrings for the oracles)."""
    global _WRITES
    _WRITES = None
    _SEEN.clear()
    try:
        res = _evaluate_case(case, bases, workdir, out)
    finally:
        _WRITES = None
    bad = _outside(_SEEN, _ROOTS)
    if bad and res["verdict"] == "pass":
        res["verdict"], res["detail"] = "fail", f"wrote outside the model folder: {bad[:3]}"
    return res


def _evaluate_case(case: dict, bases: dict, workdir: str, out) -> dict[str, Any]:
    global _WRITES
    import time as _time
    import tracemalloc
    import warnings

    import numpy as np

    from onnxpack import InferenceSession, SessionOptions
    from onnxpack.errors import OnnxpackError, PrepackWarning

    base = bases[case["base"]] if case.get("base") else None
    folder = tempfile.mkdtemp(dir=workdir)
    cwd = tempfile.mkdtemp(dir=workdir) if case.get("cwd") is not None else None
    here = os.getcwd()
    try:
        files = dict(base["files"]) if base is not None and not case.get("standalone") else {}
        files.update(case["files"])
        for name in case.get("remove", ()):
            files.pop(name, None)
        for name, data in files.items():
            os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        # hostile neighbours the locations may name
        os.symlink("/etc/passwd", os.path.join(folder, "link_out"))
        os.symlink("/dev/zero", os.path.join(folder, "devzero"))
        os.mkfifo(os.path.join(folder, "fifo"))
        os.mkdir(os.path.join(folder, "subdir"))
        for name, kind in list(_SPECIAL_NAMES.items()) + list(case.get("special", ())):
            _make_special(folder, name, kind)
        entry = case.get("entry") or base["entry"]
        if case.get("reseal"):
            _reseal(folder, entry)
        for act in case.get("post", ()):
            _act(folder, act)
        if cwd is not None:
            for name, data in case["cwd"].items():
                os.makedirs(os.path.dirname(os.path.join(cwd, name)), exist_ok=True)
                with open(os.path.join(cwd, name), "wb") as f:
                    f.write(data)
        path = os.path.join(folder, case.get("path") or entry)
        feeds = case.get("feeds") if case.get("feeds") is not None else base["feeds"]
        expected = base["expected"] if base is not None else None
        config = dict(base["config"]) if base is not None else {}
        config.update(case["config"])
        res: dict[str, Any] = {"id": case["id"], "verdict": "pass", "outcome": "", "detail": ""}
        oracle = case["oracle"]

        def fail(outcome: str, detail: str) -> dict[str, Any]:
            res["verdict"], res["detail"] = "fail", detail
            if outcome:
                res["outcome"] = outcome
            return res

        def foreign(stage: str, e: BaseException) -> dict[str, Any]:
            return fail(f"{stage}-foreign:{type(e).__name__}", "".join(traceback.format_exception(e))[-3000:])

        def refused(stage: str, e: OnnxpackError) -> dict[str, Any] | None:
            """Records a clean error; returns a failure if its message is empty or, for declared
            huge shapes, if it only came from a failed allocation."""
            msg = str(e)
            res["outcome"] = f"{stage}-error:{type(e).__name__}"
            res["detail"] = msg[:300]
            if not msg.strip():
                return fail("", f"{type(e).__name__} with an empty message")
            if case.get("declared") and any(isinstance(x, MemoryError) for x in _error_chain(e)):
                return fail("", "refused by a failed allocation, not before it: " + msg[:300])
            return None

        _WRITES, _ROOTS[:] = [], [folder] + ([cwd] if cwd else [])
        if case.get("optimize"):
            from onnxpack.cli import optimize_model

            opt = os.path.join(folder, "optimized.onnx")
            if cwd is not None:
                os.chdir(cwd)
            try:
                optimize_model(path, opt, out=io.StringIO())
                path = opt
            except OnnxpackError as e:
                return refused("optimize", e) or res
            except BaseException as e:  # noqa: BLE001
                return foreign("optimize", e)
            finally:
                os.chdir(here)
        opts = SessionOptions()
        for k, v in config.items():
            if k == "onnxpack.prepacked_cache_path":
                v = os.path.join(folder, v)
            opts.add_session_config_entry(k, v)
        limit = case.get("limit")
        outputs = None
        stats: dict[str, Any] = {}
        later: list[Any] = []  # live: per later run, outputs or the error
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rss0 = _reset_peak_rss() if limit else None
            if limit and rss0 is None:
                tracemalloc.start()
            if cwd is not None:
                os.chdir(cwd)
            try:
                t0 = _time.perf_counter()
                try:
                    sess = InferenceSession(path, opts)
                except OnnxpackError as e:
                    res["create_seconds"] = _time.perf_counter() - t0
                    bad = refused("create", e)
                    if bad is not None or oracle not in ("want", "mapped", "live"):
                        return bad or res
                    sess = None
                except BaseException as e:  # noqa: BLE001 - anything else is what we hunt for
                    return foreign("create", e)
                if sess is not None:
                    res["create_seconds"] = _time.perf_counter() - t0
                    stats = sess.get_prepack_stats()
                    try:
                        try:
                            outputs = sess.run(None, feeds)
                        except OnnxpackError as e:
                            bad = refused("run", e)
                            if bad is not None:
                                return bad
                        except BaseException as e:  # noqa: BLE001
                            return foreign("run", e)
                        if oracle == "live" and outputs is not None:
                            for act in case["live"]:
                                _act(folder, act)
                            for _ in range(2):
                                try:
                                    later.append(sess.run(None, feeds))
                                except OnnxpackError as e:
                                    later.append(e)
                                except BaseException as e:  # noqa: BLE001
                                    return foreign("live-run", e)
                    finally:
                        sess.close()
            finally:
                os.chdir(here)
                if limit:
                    if rss0 is not None:
                        peak = _status_bytes("VmHWM") - rss0
                    else:  # no clear_refs: traced allocations (also counts failed ones)
                        peak = tracemalloc.get_traced_memory()[1]
                        tracemalloc.stop()
                    res["peak_bytes"] = peak
                    if peak > limit:
                        return fail("", f"peak memory grew by {peak} bytes > {limit}: not refused before allocating")
        warned = [w for w in caught if issubclass(w.category, PrepackWarning)]
        if not res["outcome"]:
            res["outcome"] = "ok-warned" if warned else "ok"
        if stats.get("blobs_rejected") and not warned:
            return fail("", f"{stats['blobs_rejected']} blob(s) rejected without a PrepackWarning")
        budget = case.get("budget")
        if budget is not None and res.get("create_seconds", 0.0) > budget:
            return fail("", f"creation took {res['create_seconds']:.2f} s, over the budget of {budget:.2f} s")
        if oracle in ("equal", "mapped", "live"):
            if outputs is None:
                return fail("", "run failed on a mutation that cannot change weights: " + res["detail"])
            diff = _same(outputs, expected, exact=True)
            if diff:
                return fail("", "silently wrong output: " + diff)
            if oracle == "mapped":
                if warned:
                    return fail("", "a same-content file gave warnings: " + str(warned[0].message)[:300])
                want = base["stats"]
                if (stats["weights_packed"], stats["blobs_from_model"]) != (want["weights_packed"], want["blobs_from_model"]):
                    return fail("", f"a same-content file did not map its blobs: {stats} (unmutated: {want})")
            for k, got in enumerate(later):
                if isinstance(got, OnnxpackError):
                    res["outcome"] = f"ok/live-error:{type(got).__name__}"
                    continue
                diff = _same(got, expected, exact=True)
                if diff:
                    return fail("", f"run {k + 2} after {case['live']!r:.200}: silently wrong output: {diff}")
        elif oracle == "reference" and outputs is not None:
            _send(out, {"stage": "reference", "id": case["id"]})  # a crash from here on is not ours
            ref, which = _reference(path, folder, config, feeds)
            res["reference"] = which
            if ref is not None:
                # Not exact even against onnxpack itself: a packed (transposed, contiguous) weight
                # and the original view go through different BLAS kernels.
                diff = _same(outputs, ref, exact=False, atol=base.get("ref_atol", ORT_ATOL))
                if diff and which == "onnxruntime":
                    # onnxruntime's CPU provider computes float16 ops in float32 (it inserts
                    # Casts), so garbage fp16 weights overflow differently: ask the spec's
                    # numpy implementation, onnx.reference, before calling it a failure.
                    spec = _spec_reference(path, feeds)
                    if spec is not None and _same(outputs, spec, exact=False, atol=base.get("ref_atol", ORT_ATOL)) is None:
                        diff, res["reference"] = None, "onnx.reference"
                if diff:
                    return fail("", f"output differs from {which}: {diff}")
        elif oracle == "error":
            if outputs is not None:
                return fail("", "a model that must be refused ran")
        elif oracle == "zero":
            if outputs is not None:
                shape = tuple(case["shape"])
                if outputs[0].shape != shape or outputs[0].size:
                    return fail("", f"zero-size tensor {shape} came out as {outputs[0].dtype}{list(outputs[0].shape)}")
        elif oracle == "error_or_want":
            if outputs is not None:
                diff = _same(outputs, case["want"], exact=False)
                if diff:
                    return fail("", "wrong output: " + diff)
        elif oracle in ("want", "error_or_ref"):
            _send(out, {"stage": "reference", "id": case["id"]})
            if case.get("inline") is not None:
                ref, which = _inline_reference(case["inline"], feeds), "the inline model's reference"
            else:
                ref, which = _reference_standalone(os.path.join(folder, case.get("entry")), feeds)
            res["reference"] = which
            if outputs is None:
                if oracle == "want" and ref is not None:
                    return fail("", f"refused a model {which} runs: {res['detail']}")
                return res
            if ref is not None:
                diff = _same(outputs, ref, exact=False)
                if diff:
                    return fail("", f"output differs from {which}: {diff}")
                if cwd is not None and any(np.any(np.asarray(o) == DECOY) for o in outputs):
                    return fail("", "a decoy value from the working directory reached an output")
        return res
    finally:
        if _WRITES is not None:  # stop watching before the harness cleans up
            _SEEN.extend(_WRITES)
            _WRITES = None
        os.chdir(here)
        shutil.rmtree(folder, ignore_errors=True)
        if cwd is not None:
            shutil.rmtree(cwd, ignore_errors=True)


def _inline_reference(data: bytes, feeds: dict) -> list | None:
    """onnxruntime's outputs on a model whose tensors are all inline (nothing to resolve), else
    onnx.reference's (whose Loop disagrees with both runtimes on an empty condition input)."""
    import warnings

    import onnx
    from onnx.reference import ReferenceEvaluator

    try:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception:  # noqa: BLE001
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return list(ReferenceEvaluator(onnx.ModelProto.FromString(data)).run(None, feeds))
    except Exception:  # noqa: BLE001
        return None


def _reference_standalone(path: str, feeds: dict) -> tuple[list | None, str]:
    """onnxruntime's outputs (graph optimizations off), else onnx.reference's, else None."""
    try:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds), "onnxruntime"
    except Exception:  # noqa: BLE001
        pass
    ref = _spec_reference(path, feeds)
    return ref, ("onnx.reference" if ref is not None else "none")


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


def _warm_code(bases: dict, workdir: str) -> None:
    """Runs every base model once before the first case: the one-time cost of loading code (numba
    and its compiled kernels, ~100 MB of RSS) is then not counted against a case's memory limit
    (the huge family's "refused before allocating" check measures what the case allocates)."""
    from onnxpack import InferenceSession

    for base in bases.values():
        folder = tempfile.mkdtemp(dir=workdir)
        try:
            for name, data in base["files"].items():
                os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
                with open(os.path.join(folder, name), "wb") as f:
                    f.write(data)
            with InferenceSession(os.path.join(folder, base["entry"])) as s:
                s.run(None, base["feeds"])
        except Exception:  # noqa: BLE001 - only a warm-up
            pass
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def worker_main() -> int:
    """Worker loop: reads ``init`` then cases from stdin, writes results to stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the frame stream
    inp = os.fdopen(0, "rb")
    import faulthandler
    import logging
    import warnings

    faulthandler.enable()
    sys.addaudithook(_audit)
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    msg = _recv(inp)
    bases = msg["bases"]
    workdir = tempfile.mkdtemp(prefix="onnxpack-fuzz-")
    _warm_code(bases, workdir)
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

    def kill_hung(self, limit: float = CASE_TIMEOUT) -> dict:
        case = self.case
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self.case = None
        self.restarts += 1
        return {"id": case["id"], "verdict": "fail", "outcome": "hang",
                "detail": f"no result after {limit:.0f} s (stage {self.stage})"}

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
                limit = max(self.timeout, case.get("timeout", 0))  # big cases say how long they may take
                if now - w.started > limit:
                    del busy[fd]
                    idle.append(w)
                    yield case, w.kill_hung(limit)

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
