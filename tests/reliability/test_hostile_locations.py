"""Hostile external-data and blob locations: nothing outside the model folder is ever opened.

The check runs in a subprocess with ``sys.addaudithook``: every ``open`` audit event (builtins
``open``, ``os.open``, ``io.open``) after warm-up is recorded, and every path opened must lie in
the model's folder.  FIFOs and devices must not block (the subprocess has a timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import onnx
import pytest

import reliability_harness as harness

LOCATIONS = [
    ("absolute", "{outside}/secret.bin"),
    ("etc-passwd", "/etc/passwd"),
    ("dotdot", "../outside/secret.bin"),
    ("inner-dotdot", "sub/../../outside/secret.bin"),
    ("symlink-out", "link_out"),
    ("symlink-devzero", "link_zero"),
    ("dev-zero", "/dev/zero"),
    ("nul", "fuzzmix.onnx.data\x00.txt"),
    ("directory", "subdir"),
    ("fifo", "fifo"),
    ("windows-drive", "C:\\secret.bin"),
    ("backslash-dotdot", "..\\outside\\secret.bin"),
]

CHILD = textwrap.dedent(r"""
    import json, os, sys, warnings
    from onnxpack import InferenceSession
    from onnxpack.errors import OnnxpackError
    folder, cases = sys.argv[1], json.loads(sys.argv[2])
    warnings.simplefilter("ignore")
    InferenceSession(os.path.join(folder, "base.onnx")).close()  # warm-up: lazy imports
    from onnxpack.session import _program
    assert _program.wait_warm_ups(timeout=300)  # the kernels' warm-up thread imports JIT code too
    opened = []
    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            opened.append(os.fsdecode(args[0]))
    sys.addaudithook(hook)
    results = {}
    for name in cases:
        try:
            InferenceSession(os.path.join(folder, name)).close()
            results[name] = "ok"
        except OnnxpackError as e:
            results[name] = type(e).__name__
        except BaseException as e:
            results[name] = "FOREIGN " + type(e).__name__ + ": " + str(e)
    print(json.dumps({"opened": opened, "results": results}))
""")


@pytest.fixture()
def layout(bases, tmp_path):
    base = bases["fuzzmix"]
    folder = tmp_path / "model"
    outside = tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (outside / "secret.bin").write_bytes(base["files"]["fuzzmix.onnx.data"])
    for name, data in base["files"].items():
        (folder / name).write_bytes(data)
    (folder / "base.onnx").write_bytes(base["files"]["fuzzmix.onnx"])
    os.symlink(outside / "secret.bin", folder / "link_out")
    os.symlink("/dev/zero", folder / "link_zero")
    os.mkdir(folder / "subdir")
    os.mkfifo(folder / "fifo")
    return base, folder, outside


def _external_variant(base, location: str | None = None, offset: str | None = None) -> bytes:
    proto = onnx.ModelProto.FromString(base["files"]["fuzzmix.onnx"])
    init = next(t for t in proto.graph.initializer if t.name == "Wh")
    for e in init.external_data:
        if location is not None and e.key == "location":
            e.value = location
        if offset is not None and e.key == "offset":
            e.value = offset
    return proto.SerializeToString()


def _record_variant(base, location: str) -> bytes:
    proto = onnx.ModelProto.FromString(base["files"]["fuzzmix.onnx"])
    from onnxpack.prepack.entry_format import is_record_key

    assert sum(is_record_key(p.key) for p in proto.metadata_props) == 3
    for prop in proto.metadata_props:
        if not is_record_key(prop.key):
            continue  # the data file's seal
        prefix, body = prop.value.split(";", 1)
        obj = json.loads(body)
        for p in obj["packs"]:
            for b in p["buffers"]:
                b["file"] = location
        prop.value = prefix + ";" + json.dumps(obj)
    return proto.SerializeToString()


def test_nothing_outside_the_model_folder_is_opened(layout):
    base, folder, outside = layout
    cases = {}
    for label, loc in LOCATIONS:
        loc = loc.replace("{outside}", str(outside))
        cases[f"ext-{label}.onnx"] = _external_variant(base, location=loc)
        cases[f"rec-{label}.onnx"] = _record_variant(base, loc)
    for label, off in [("huge", str(2**62)), ("max", str(2**63 - 1)), ("beyond", str(2**64)),
                       ("negative", "-4096")]:
        cases[f"off-{label}.onnx"] = _external_variant(base, offset=off)
    for name, data in cases.items():
        (folder / name).write_bytes(data)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), json.dumps(sorted(cases))],
                          capture_output=True, text=True, timeout=60, env=harness.subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = report["results"]
    foreign = {k: v for k, v in results.items() if v.startswith("FOREIGN")}
    assert not foreign
    # Every hostile external location is refused; hostile blob locations only lose the blob.
    assert all(results[n] == "ExternalDataError" for n in cases if n.startswith(("ext-", "off-"))), results
    assert all(results[n] == "ok" for n in cases if n.startswith("rec-")), results
    real_folder = os.path.realpath(folder)
    outside_opens = [p for p in report["opened"]
                     if os.path.commonpath([os.path.realpath(p), real_folder]) != real_folder]
    assert outside_opens == []
    assert report["opened"], "the audit hook saw no open at all"
