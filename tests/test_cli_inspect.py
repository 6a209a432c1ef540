"""``onnxpack inspect``: text and JSON reports checked against the model proto and the bytes on disk.

Oracles: the ModelProto as onnx loads it (scopes, initializer names, dtypes, shapes, external
offsets), the data file's bytes (an offset/length printed by inspect must locate exactly the
initializer's bytes), and the packing facts we can derive by hand (which op packs which input).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxpack_sample_models as sample_models  # models/build.py, via tests/conftest.py
from onnxpack import cli
from onnxpack.cli.inspect import collect, format_text



@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    return sample_models.build_all(str(tmp_path_factory.mktemp("samples")))


def _run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _graphs(graph, acc):
    acc.append(graph)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _graphs(attr.g, acc)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _graphs(g, acc)
    return acc


@pytest.mark.parametrize("name", sorted(sample_models.SAMPLES))
def test_json_report_matches_the_model_and_its_data_file(samples, name, capsys):
    path = samples[name]
    code, out, err = _run(["inspect", path, "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    proto = onnx.load(path, load_external_data=False)
    graphs = _graphs(proto.graph, [])
    assert sorted(s["graph"] for s in report["scopes"]) == sorted(g.name for g in graphs)
    expected = {(t.name, t.data_type, tuple(t.dims)) for g in graphs for t in g.initializer}
    got = {(t["name"], helper.np_dtype_to_tensor_dtype(np.dtype(t["dtype"])), tuple(t["shape"]))
           for t in report["initializers"]}
    assert got == expected
    folder = os.path.dirname(path)
    by_name = {t.name: t for g in graphs for t in g.initializer}
    for row in report["initializers"]:
        t = by_name[row["name"]]
        want = numpy_helper.to_array(t, base_dir=folder) if t.data_location == TensorProto.EXTERNAL \
            else numpy_helper.to_array(t)
        assert row["nbytes"] == want.nbytes
        if row["location"] is None:
            assert t.data_location != TensorProto.EXTERNAL
            continue
        ext = {e.key: e.value for e in t.external_data}
        assert row["location"] == ext["location"] and row["offset"] == int(ext.get("offset", 0))
        with open(os.path.join(folder, row["location"]), "rb") as f:
            f.seek(row["offset"])
            raw = f.read(row["length"])
        assert raw == want.tobytes(), f"{row['name']}: offset/length do not locate its bytes"
    stats = report["stats"]
    assert stats["weights_packed"] + stats["blobs_from_container"] == len(report["packs"])
    assert stats["bytes_held"] == sum({p["key"]: p["nbytes"] for p in report["packs"]}.values())
    assert {t["name"] for t in report["initializers"] if t["packed"]} == {p["weight"] for p in report["packs"]}
    assert report["fallback_nodes"] == []


def test_packs_name_the_node_input_and_packed_size(samples, capsys):
    code, out, _ = _run(["inspect", samples["mlp"], "--json"], capsys)
    assert code == 0
    packs = {(p["node"], p["op_type"], p["input"], p["weight"]): p for p in json.loads(out)["packs"]}
    # fc1: MatMul x @ W1 (64x256 fp32), fc2: Gemm a1 @ W2 (256x128), fc3: MatMul a2 @ W3 (128x10).
    assert set(packs) == {("fc1", "MatMul", 1, "W1"), ("fc2", "Gemm", 1, "W2"), ("fc3", "MatMul", 1, "W3")}
    assert packs[("fc1", "MatMul", 1, "W1")]["nbytes"] == 64 * 256 * 4
    assert packs[("fc2", "Gemm", 1, "W2")]["nbytes"] == 256 * 128 * 4
    assert all(p["origin"] == "packed" for p in packs.values())
    assert all(p["key"].count("/") == 2 for p in packs.values())


def test_fp16_weight_packs_to_float32(samples, capsys):
    code, out, _ = _run(["inspect", samples["fp16_mlp"], "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    packs = report["packs"]
    # W1h (64x128) is Cast to fp32 for fc1, which packs the cast weight itself (a constant
    # expression); b1h (128) is Cast for an Add, which does not pack, so the Cast packs its
    # result; W2h (128x16) feeds an fp16 MatMul: all packed as fp32, twice the bytes.
    assert sorted((p["weight"], p["op_type"], p["nbytes"]) for p in packs) == [
        ("W1h", "MatMul", 64 * 128 * 4), ("W2h", "MatMul", 128 * 16 * 4), ("b1h", "Cast", 128 * 4)]


def test_text_report_has_every_section(samples, capsys):
    code, out, err = _run(["inspect", samples["subgraphs"]], capsys)
    assert code == 0, err
    for title in ("model:", "scopes (7, bottom-up):", "initializers (5,", "packed weights (3 kernel inputs):",
                  "fallback nodes (onnx.reference): none", "prepack stats:", "originals_released"):
        assert title in out
    # Each packed weight is listed with its consuming node, and the nested scope path is shown.
    assert "/top_if.then_branch/inner_loop.body" in out
    for node, weight in (("body_mm", "W_loop"), ("else_mm", "W_else"), ("root_mm", "W_root")):
        line = next(ln for ln in out.splitlines() if f" {node} " in ln and "MatMul" in ln)
        assert weight in line and "4096" in line
    assert "subgraphs.onnx.data @" in out


def test_no_prepack_reports_no_packs(samples, capsys):
    code, out, _ = _run(["inspect", samples["mlp"], "--no-prepack", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["packs"] == [] and report["stats"]["weights_packed"] == 0
    assert report["config"] == {"session.disable_prepacking": "1"}
    assert "packed weights: none" in format_text(report)


def test_fallback_nodes_are_listed(tmp_path, capsys):
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("Det", ["x"], ["y"], name="det")], "g",
                          [vi("x", TensorProto.FLOAT, [3, 3])], [vi("y", TensorProto.FLOAT, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    path = tmp_path / "det.onnx"
    onnx.save(m, path)
    code, out, _ = _run(["inspect", str(path), "--json"], capsys)
    assert code == 0
    assert json.loads(out)["fallback_nodes"] == ["main:det:Det"]  # scope:node:op_type


def test_config_entries_reach_the_session(samples, tmp_path, capsys):
    cache = tmp_path / "cache.bin"
    argv = ["inspect", samples["mlp"], "--json", "--config", f"onnxpack.prepacked_cache_path={cache}"]
    code, out, _ = _run(argv, capsys)
    assert code == 0 and json.loads(out)["stats"]["weights_packed"] == 3
    assert cache.exists()
    code, out, _ = _run(argv, capsys)
    stats = json.loads(out)["stats"]
    assert stats["weights_packed"] == 0 and stats["blobs_from_cache"] == 3


@pytest.mark.parametrize("argv,needle", [
    (["--config", "nonsense"], "expected KEY=VALUE"),
    (["--config", "onnxpack.no_such_key=1"], "onnxpack.no_such_key"),
], ids=["malformed", "unknown_key"])
def test_bad_config_is_one_error_line(samples, capsys, argv, needle):
    code, out, err = _run(["inspect", samples["mlp"], *argv], capsys)
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err


def test_missing_model_is_an_error_not_a_traceback(tmp_path, capsys):
    code, _, err = _run(["inspect", str(tmp_path / "nope.onnx")], capsys)
    assert code == 2 and "onnxpack inspect: error" in err


def test_collect_does_not_modify_the_model(samples):
    path = samples["cnn"]
    before = {p: open(p, "rb").read() for p in (path, path + ".data")}
    report = collect(path)
    assert report["stats"]["weights_packed"] == 3
    assert {p: open(p, "rb").read() for p in before} == before
