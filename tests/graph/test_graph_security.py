"""Hostile external data locations and bounds: ExternalDataError, and nothing outside is opened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxpack.errors import ExternalDataError
from onnxpack.graph import load_model

W = np.arange(16, dtype=np.float32)  # 64 bytes


def _write_model(folder, location, offset="0", length=None, dims=(16,), extra_keys=()):
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=list(dims))
    t.data_location = TensorProto.EXTERNAL
    entries = [("location", location), ("offset", offset)]
    if length is not None:
        entries.append(("length", length))
    for k, v in [*entries, *extra_keys]:
        e = t.external_data.add()
        e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(dims))], [t])
    path = os.path.join(folder, "model.onnx")
    with open(path, "wb") as f:
        f.write(helper.make_model(g).SerializeToString())
    return path


@pytest.fixture
def layout(tmp_path):
    """model/ (the model folder, with w.bin) and outside/secret.bin beside it."""
    model_dir = tmp_path / "model"
    outside = tmp_path / "outside"
    model_dir.mkdir()
    outside.mkdir()
    (model_dir / "w.bin").write_bytes(W.tobytes())
    (outside / "secret.bin").write_bytes(W.tobytes())
    os.symlink(outside / "secret.bin", model_dir / "link_out.bin")
    os.symlink(outside, model_dir / "dir_link")
    os.symlink(model_dir / "w.bin", model_dir / "link_in.bin")
    os.mkfifo(model_dir / "fifo.bin")
    (model_dir / "sub").mkdir()
    return model_dir, outside


HOSTILE = {
    "absolute": dict(location="{outside}/secret.bin"),
    "absolute_windows": dict(location="C:\\secret.bin"),
    "unc": dict(location="\\\\server\\share\\secret.bin"),
    "dotdot": dict(location="../outside/secret.bin"),
    "dotdot_backslash": dict(location="sub\\..\\..\\outside\\secret.bin"),
    "symlink_out": dict(location="link_out.bin"),
    "symlinked_dir_out": dict(location="dir_link/secret.bin"),
    "nul": dict(location="w.bin\x00.txt"),
    "fifo": dict(location="fifo.bin"),
    "directory": dict(location="sub"),
    "missing": dict(location="nope.bin"),
    "empty": dict(location=""),
    "offset_past_end": dict(location="w.bin", offset="65"),
    "length_past_end": dict(location="w.bin", offset="4", length="64"),
    "negative_offset": dict(location="w.bin", offset="-1"),
    "negative_length": dict(location="w.bin", length="-64"),
    "overflow_offset": dict(location="w.bin", offset=str(2**64 + 1)),
    "overflow_length": dict(location="w.bin", length="9" * 40),
    "not_a_number": dict(location="w.bin", offset="0x10"),
    "length_disagrees_with_shape": dict(location="w.bin", length="60"),
    "shape_bigger_than_file": dict(location="w.bin", dims=(17,)),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_location_raises(layout, case):
    model_dir, outside = layout
    kwargs = dict(HOSTILE[case])
    kwargs["location"] = kwargs["location"].format(outside=outside)
    path = _write_model(str(model_dir), **kwargs)
    with pytest.raises(ExternalDataError) as info:
        load_model(path)
    msg = str(info.value)
    assert "'W'" in msg  # names the tensor
    if case.startswith(("offset", "length", "negative", "overflow", "shape")):
        assert "w.bin" in msg  # names the file (and the bounds)


def test_symlink_inside_folder_is_allowed(layout):
    model_dir, _ = layout
    model = load_model(_write_model(str(model_dir), "link_in.bin", length="64"))
    np.testing.assert_array_equal(model.root.initializers["W"].numpy(), W)


_AUDIT = textwrap.dedent("""
    import json, os, sys
    import numpy, onnx, onnx.numpy_helper
    from onnxpack.errors import ExternalDataError
    from onnxpack.graph import load_model
    opened = []
    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)):
            opened.append(os.fsdecode(args[0]))
    sys.addaudithook(hook)
    results = {}
    for path in sys.argv[1:]:
        try:
            m = load_model(path)
            for s in m.scopes():
                for t in s.initializers.values():
                    t.numpy()
            results[path] = "ok"
        except ExternalDataError as e:
            results[path] = "ExternalDataError"
    print(json.dumps({"opened": opened, "results": results}))
""")


def test_nothing_outside_model_folder_is_opened(layout):
    model_dir, outside = layout
    paths = []
    for case, kwargs in HOSTILE.items():
        folder = model_dir / f"case_{case}"
        folder.mkdir()
        for name in ("w.bin",):
            (folder / name).write_bytes(W.tobytes())
        for name in ("link_out.bin",):
            os.symlink(outside / "secret.bin", folder / name)
        os.symlink(outside, folder / "dir_link")
        os.mkfifo(folder / "fifo.bin")
        (folder / "sub").mkdir()
        kw = dict(kwargs)
        kw["location"] = kw["location"].format(outside=outside)
        paths.append(_write_model(str(folder), **kw))
    out = subprocess.run([sys.executable, "-c", _AUDIT, *paths], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report["results"].values()) == {"ExternalDataError"}
    real_outside = os.path.realpath(outside)
    for p in report["opened"]:
        real = os.path.realpath(p)
        assert not real.startswith(real_outside), f"opened {p} outside the model folder"
        assert not real.endswith("fifo.bin"), "a FIFO must never be opened"


@pytest.mark.parametrize("location", ["c.bin", "../outside/c.bin", "ABSOLUTE"])
def test_external_tensor_in_a_model_local_function_goes_through_the_checked_loader(tmp_path, monkeypatch, location):
    """A Constant with external data inside a model-local function (run by onnx.reference) reads
    the model folder's file, not one of the working directory's name; a location outside the
    folder is refused as anywhere else (onnx.reference resolved it against the working directory:
    a decoy there was computed with)."""
    import onnx
    import onnxruntime as ort

    import onnxpack

    mdir, cwd, out = (tmp_path / n for n in ("model", "cwd", "outside"))
    for d in (mdir, cwd, out):
        d.mkdir()
    np.ones(4, np.float32).tofile(mdir / "c.bin")
    np.full(4, 666.0, np.float32).tofile(cwd / "c.bin")
    np.full(4, 777.0, np.float32).tofile(out / "c.bin")
    loc = str(out / "c.bin") if location == "ABSOLUTE" else location
    t = TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value=loc)
    t.external_data.add(key="length", value="16")
    f = helper.make_function("loc", "F", ["a"], ["b"], [helper.make_node("Constant", [], ["k"], value=t),
                                                         helper.make_node("Add", ["a", "k"], ["b"])],
                             [helper.make_opsetid("", 17)])
    g = helper.make_graph([helper.make_node("F", ["x"], ["y"], domain="loc")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("loc", 1)],
                          functions=[f], ir_version=9)
    path = mdir / "m.onnx"
    onnx.save(m, str(path))
    monkeypatch.chdir(cwd)
    x = np.zeros(4, np.float32)
    if location == "c.bin":
        got = onnxpack.InferenceSession(str(path)).run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, np.ones(4, np.float32))
        np.testing.assert_array_equal(got, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0])
    else:
        with pytest.raises(ExternalDataError):
            onnxpack.InferenceSession(str(path))


def test_a_file_opened_outside_the_folder_after_the_checks_is_refused(tmp_path, monkeypatch):
    """The location is checked (realpath inside the folder), then opened; what counts is the
    file the kernel opened (/proc/self/fd): a directory of the path swapped for a symlink between
    the two (a helper's race: 3 reads of 81 went outside) is refused, not read."""
    from onnxpack.graph import _external

    (tmp_path / "d").mkdir()
    np.ones(4, np.float32).tofile(tmp_path / "d" / "w.bin")
    fd = os.open(tmp_path / "d" / "w.bin", os.O_RDONLY)
    try:
        assert _external._opened_path(fd) in (None, str((tmp_path / "d" / "w.bin").resolve()))
    finally:
        os.close(fd)
    t = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value="d/w.bin")
    g = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [t])
    import onnx

    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    np.testing.assert_array_equal(load_model(path).root.initializers["w"].numpy(), np.ones(4, np.float32))
    monkeypatch.setattr(_external, "_opened_path", lambda fd: "/elsewhere/w.bin")
    with pytest.raises(ExternalDataError, match="outside"):
        load_model(path).root.initializers["w"].numpy()
