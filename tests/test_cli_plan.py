"""`onnxpack plan`: tables that agree with the planner, the plot, and one-line errors (exit 2)."""

from __future__ import annotations

import pathlib
import re

import onnx
import pytest
from onnx import TensorProto, helper

from onnxpack.cli import main
from onnxpack.session import planner

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"


def _dynamic_model(tmp_path) -> pathlib.Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])
    nodes = [
        helper.make_node("Add", ["x", "x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Mul", ["b", "a"], ["c"]),
        helper.make_node("Exp", ["c"], ["y"]),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "dyn.onnx"
    onnx.save(model, path)
    return path


def test_tables_match_the_planner(tmp_path, capsys):
    path = _dynamic_model(tmp_path)
    assert main(["plan", str(path), "--shape", "x=4,16", "--algorithm", "naive"]) == 0
    out = capsys.readouterr().out
    # Independent oracle: a, b, c are 4*16*4 = 256 bytes each, live [0,2], [1,2], [2,3].
    lifetimes = [planner.TensorLifetime("a", 256, 0, 2), planner.TensorLifetime("b", 256, 1, 2),
                 planner.TensorLifetime("c", 256, 2, 3)]
    assert planner.lower_bound(lifetimes, 64) == (768, 2)
    assert "3 intermediate tensors, 768 B" in out
    assert re.search(r"^naive\s+768 B\s+768 B\s+1\.000$", out, re.M)
    assert "algorithm: naive" in out
    assert re.search(r"^total\s+3\s+768 B\s+768 B \(@2\)\s+1\.000$", out, re.M)


def test_memory_hierarchy_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    model = MODELS / "transformer.onnx"
    assert main(["plan", str(model), "--memory", "8K:64,64M:16", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^mem0\s+8\.00 KiB\s+64\s", out, re.M)
    assert re.search(r"^mem1\s+64\.00 MiB\s+16\s", out, re.M)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".plan-*"))  # the temp file was renamed


def test_runtime_only_plans_fewer_tensors(capsys):
    model = str(MODELS / "transformer.onnx")
    assert main(["plan", model]) == 0
    all_n = int(re.search(r"^(\d+) intermediate tensors", capsys.readouterr().out, re.M).group(1))
    assert main(["plan", model, "--runtime"]) == 0
    rt_n = int(re.search(r"^(\d+) run-time arena tensors", capsys.readouterr().out, re.M).group(1))
    assert 0 < rt_n < all_n


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "symbolic dimensions"),
        (["--shape", "z=1,16"], "unknown input(s) ['z']"),
        (["--shape", "x=4,16", "--memory", "512:64"], "fits in no memory"),
        (["--shape", "x=4,16", "--memory", "12Q"], "expected a size like"),
        (["--shape", "x=four"], "integer dimensions"),
    ],
    ids=["symbolic", "unknown-input", "no-fit", "bad-memory", "bad-shape"],
)
def test_errors_are_one_line_exit_2(tmp_path, capsys, extra, message):
    path = _dynamic_model(tmp_path)
    assert main(["plan", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    path = _dynamic_model(tmp_path)
    assert main(["plan", str(path), "--shape", "x=2,16", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'onnxpack[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
