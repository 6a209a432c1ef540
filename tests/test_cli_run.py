"""``onnxpack run``: outputs and timings printed, random and file inputs, --dim, one-line errors.

The oracle for printed numbers is onnxruntime run on the same inputs (the printed min/max/mean
have 6 significant digits; compared at rtol 1e-4).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpack.cli._common import random_inputs
from onnxpack.cli import main

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "models" / "mlp.onnx")
LINE = re.compile(r"^output (\S+): (\S+) \[([\d, ]*)\](?: min (\S+) max (\S+) mean (\S+))?$")


def _outputs(text: str) -> dict[str, tuple]:
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            shape = [int(v) for v in m.group(3).split(",") if v.strip()]
            stats = tuple(float(v) for v in m.group(4, 5, 6)) if m.group(4) else None
            out[m.group(1)] = (m.group(2), shape, stats)
    return out


def _ort(model):
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _symbolic(path: Path) -> str:
    w = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Shape", ["idx"], ["n"])],
        "sym", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 5]),
                helper.make_tensor_value_info("idx", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 3]),
         helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
        [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    path.write_bytes(m.SerializeToString())
    return str(path)


def test_run_random_inputs_prints_outputs_and_timing(capsys):
    assert main(["run", MLP, "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    assert "input  x: float32 [4, 64] (random)" in out
    outputs = _outputs(out)
    sess = _ort(MLP)
    assert list(outputs) == [o.name for o in sess.get_outputs()]
    # Same seed -> same random input as random_inputs(); the printed stats match onnxruntime.
    feeds = random_inputs(sess.get_inputs(), {}, seed=0)
    want = sess.run(None, feeds)
    for (name, (dtype, shape, stats)), w in zip(outputs.items(), want):
        assert dtype == str(w.dtype) and shape == list(w.shape)
        np.testing.assert_allclose(stats, [w.min(), w.max(), w.mean()], rtol=1e-4, atol=1e-5)
    m = re.search(r"create [\d.]+ ms, first run [\d.]+ ms, run median ([\d.]+) ms / min ([\d.]+) ms over 3 run", out)
    assert m and float(m.group(2)) <= float(m.group(1))


def test_run_with_input_file(tmp_path, capsys):
    x = np.random.default_rng(7).standard_normal((4, 64)).astype(np.float32) * 3
    np.save(tmp_path / "x.npy", x)
    assert main(["run", MLP, "--input", f"x={tmp_path / 'x.npy'}"]) == 0
    out = capsys.readouterr().out
    assert "input  x: float32 [4, 64] (file)" in out
    (w,) = _ort(MLP).run(None, {"x": x})
    (dtype, shape, stats), = _outputs(out).values()
    np.testing.assert_allclose(stats, [w.min(), w.max(), w.mean()], rtol=1e-4, atol=1e-5)


def test_symbolic_dims_default_to_one_or_dim_flag(tmp_path, capsys):
    model = _symbolic(tmp_path / "sym.onnx")
    assert main(["run", model]) == 0
    out = capsys.readouterr().out
    assert "input  x: float32 [1, 1, 5] (random)" in out and "input  idx: int64 [1] (random)" in out
    assert "symbolic or unknown dims set to 1 in random inputs: x ['batch', 'seq']; idx ['?']" in out
    assert _outputs(out)["y"][1] == [1, 1, 3]
    assert main(["run", model, "--dim", "batch=3", "--dim", "seq=7"]) == 0
    out = capsys.readouterr().out
    assert "input  x: float32 [3, 7, 5] (random)" in out
    assert "in random inputs: idx ['?'] (" in out  # x has no open dim left: only idx is listed
    assert _outputs(out)["y"][1] == [3, 7, 3]


def _detector(path: Path) -> str:
    """Concat of the input with a [1, 4] constant along axis 0: needs width == 4, which the
    default of 1 for symbolic dims does not give (the issue's "dies deep inside with a Concat")."""
    g = helper.make_graph([helper.make_node("Concat", ["x", "c"], ["y"], axis=0, name="cat")], "det",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "width"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
                          [numpy_helper.from_array(np.ones((1, 4), np.float32), "c")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    path.write_bytes(m.SerializeToString())
    return str(path)


def test_failure_with_defaulted_symbolic_dims_names_them_and_the_fix(tmp_path, capsys):
    model = _detector(tmp_path / "det.onnx")
    assert main(["run", model]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("onnxpack run: error:")
    assert "Concat" in err and "x ['batch', 'width']" in err and "--dim NAME=VALUE" in err and "--input" in err
    assert main(["run", model, "--dim", "width=4", "--dim", "batch=2"]) == 0
    out = capsys.readouterr().out
    assert "input  x: float32 [2, 4] (random)" in out and _outputs(out)["y"][1] == [3, 4]
    x = np.ones((5, 4), np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", model, "--input", f"x={tmp_path / 'x.npy'}"]) == 0
    out = capsys.readouterr().out
    assert "set to 1" not in out and _outputs(out)["y"][1] == [6, 4]


def test_dim_flag_is_a_free_dimension_override(tmp_path, capsys):
    """--dim fixes the session's input shape: a file input of another size is refused, as the API
    refuses it after add_free_dimension_override_by_name."""
    model = _detector(tmp_path / "det.onnx")
    np.save(tmp_path / "x.npy", np.ones((5, 4), np.float32))
    assert main(["run", model, "--dim", "batch=2", "--input", f"x={tmp_path / 'x.npy'}"]) == 2
    err = capsys.readouterr().err
    assert "Got invalid dimensions for input: x" in err and "index: 0 Got: 5 Expected: 2" in err


def test_config_entries_reach_the_session(capsys):
    assert main(["run", MLP, "--config", "session.disable_prepacking=1"]) == 0
    assert main(["run", MLP, "--config", "onnxpack.nope=1"]) == 2
    err = capsys.readouterr().err
    assert "onnxpack.nope" in err


@pytest.mark.parametrize("argv_tail,words", [
    (["--input", "x"], ["NAME=VALUE"]),
    (["--input", "zz=/dev/null"], ["'zz'", "inputs are"]),
    (["--input", "x=/no/such/file.npy"], ["/no/such/file.npy"]),
    (["--dim", "batch=2"], ["'batch'", "no input"]),
    (["--dim", "batch=two"], ["batch=two"]),
    (["--config", "session.disable_prepacking=maybe"], ["session.disable_prepacking"]),
], ids=["no-equals", "unknown-input", "missing-file", "unused-dim", "bad-dim", "bad-config"])
def test_errors_are_one_line_exit_2(argv_tail, words, capsys):
    assert main(["run", MLP, *argv_tail]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("onnxpack run: error:"), err
    for w in words:
        assert w in err, (w, err)


def test_bad_npy_and_wrong_dtype(tmp_path, capsys):
    (tmp_path / "junk.npy").write_bytes(b"this is not numpy")
    assert main(["run", MLP, "--input", f"x={tmp_path / 'junk.npy'}"]) == 2
    assert "not a readable .npy" in capsys.readouterr().err
    np.save(tmp_path / "x64.npy", np.zeros((4, 64), np.float64))
    assert main(["run", MLP, "--input", f"x={tmp_path / 'x64.npy'}"]) == 2
    err = capsys.readouterr().err
    assert "'x'" in err and "float64" in err and "tensor(float)" in err and len(err.strip().splitlines()) == 1


def test_missing_model_and_bad_repeat(tmp_path, capsys):
    assert main(["run", str(tmp_path / "none.onnx")]) == 2
    assert "none.onnx" in capsys.readouterr().err
    assert main(["run", MLP, "--repeat", "0"]) == 2  # argparse usage error
    assert "--repeat" in capsys.readouterr().err
    (tmp_path / "bad.onnx").write_bytes(b"garbage")
    assert main(["run", str(tmp_path / "bad.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.onnx" in err
