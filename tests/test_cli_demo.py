"""`onnxpack demo` and `onnxpack bench`: the table is real (fresh processes, true counts)."""

from __future__ import annotations

import pathlib
import re

from onnxpack.cli import main

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"


def _rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        m = re.match(r"(cold|warm): .*?\)\s+(.*)$", line)
        if m:
            rows[m.group(1)] = m.group(2).split()
    return rows


def test_demo_small(capsys):
    rc = main(["demo", "--size-mb", "0.5", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = _rows(out)
    assert set(rows) == {"cold", "warm"}, out
    # columns: create ms, packed, mapped, RssAnon +MB, RssFile MB, PSS MB, outputs equal
    cold, warm = rows["cold"], rows["warm"]
    assert int(cold[1]) == 2 and int(cold[2]) == 0  # the two fp16 MatMul weights packed
    assert int(warm[1]) == 0 and int(warm[2]) == 2  # ... and mapped, not packed, when warm
    assert cold[-1] == "yes" and warm[-1] == "yes"
    assert float(cold[0]) > 0 and float(warm[0]) > 0
    assert "pre-packed weights  2" in out and "blobs written       2" in out


def test_bench_user_model_with_processes(capsys):
    rc = main(["bench", str(MODELS / "transformer.onnx"), "--repeats", "1", "--processes", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PSS x2 MB" in out
    rows = _rows(out)
    assert rows["cold"][1] == "6" and rows["warm"][1] == "0" and rows["warm"][2] == "6"
    assert rows["warm"][-1] == "yes"


def test_bench_missing_model(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nope.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
