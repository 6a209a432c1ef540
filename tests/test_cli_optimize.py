"""`onnxpack optimize`: writes an aligned model that runs the same; one-line errors, exit 2."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxpack.cli import main
from onnxpack.graph import load_model

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"


@pytest.fixture
def transformer(tmp_path):
    for f in ("transformer.onnx", "transformer.onnx.data"):
        shutil.copy(MODELS / f, tmp_path / f)
    return tmp_path / "transformer.onnx"


def _sha(p) -> str:
    return hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest()


def test_optimize_writes_aligned_model(transformer, tmp_path, capsys):
    before = {f: _sha(tmp_path / f) for f in os.listdir(tmp_path)}
    out = tmp_path / "out" / "t.onnx"
    out.parent.mkdir()
    rc = main(["optimize", str(transformer), "-o", str(out), "--min-size", "256",
               "--align-threshold", "4096", "--allocation-granularity", "16384"])
    assert rc == 0
    assert "wrote" in capsys.readouterr().out
    onnx.checker.check_model(str(out), full_check=True)
    saved = load_model(out)
    for t in saved.root.initializers.values():
        if t.nbytes >= 256:
            assert t.external is not None and t.external.offset % 64 == 0
            if t.nbytes >= 4096:
                assert t.external.offset % 16384 == 0
        else:
            assert t.external is None
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 8, 64)).astype(np.float32)}
    a = ort.InferenceSession(str(transformer), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(a[0], b[0])
    assert {f: _sha(tmp_path / f) for f in before} == before


@pytest.mark.parametrize("argv_tail,needle", [
    (["missing.onnx"], "cannot read"),
    (["garbage.onnx"], "cannot parse"),
    (["transformer.onnx", "--min-size", "-3"], None),
    (["transformer.onnx", "--location", "../escape.data"], "location"),
])
def test_bad_input_one_line_exit_2(transformer, tmp_path, capsys, argv_tail, needle):
    (tmp_path / "garbage.onnx").write_bytes(b"\x08\xff\xff")
    argv = ["optimize", str(tmp_path / argv_tail[0]), "-o", str(tmp_path / "o.onnx"), *argv_tail[1:]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    if needle is not None:
        assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_console_entry_point_runs(transformer, tmp_path):
    out = subprocess.run([sys.executable, "-m", "onnxpack.cli", "optimize", str(transformer),
                          "-o", str(tmp_path / "cli.onnx")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cli.onnx").exists()


def test_output_directory_is_created_and_said(transformer, tmp_path, capsys):
    out = tmp_path / "new" / "dir" / "m.onnx"
    assert main(["optimize", str(transformer), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"created directory {out.parent}" in printed
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 8, 64)).astype(np.float32)}
    a = ort.InferenceSession(str(transformer), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(a[0], b[0])
    assert main(["optimize", str(transformer), "-o", str(out)]) == 0  # exists now: nothing to create
    assert "created directory" not in capsys.readouterr().out
    (tmp_path / "afile").write_bytes(b"")
    assert main(["optimize", str(transformer), "-o", str(tmp_path / "afile" / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a directory" in err
