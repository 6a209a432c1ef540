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
    # expression); b1h's Cast feeds fc1's bias Add, which fc1 absorbs (its bias is folded into the
    # fused MatMul, nothing to pack); W2h (128x16) feeds an fp16 MatMul: packed as fp32.
    assert sorted((p["weight"], p["op_type"], p["nbytes"]) for p in packs) == [
        ("W1h", "MatMul", 64 * 128 * 4), ("W2h", "MatMul", 128 * 16 * 4)]


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


# -- op coverage --------------------------------------------------------------------------------
def _coverage_model(path) -> str:
    """Native ops, a fallback op (Det), a node a native kernel declines (BatchNormalization in
    training mode), a model-local function, an op in a subgraph, and an op nothing runs."""
    F = TensorProto.FLOAT
    fn = helper.make_function("local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, [3, 3])])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", F, [3, 3])])
    c = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("s", "b", "m", "v")]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Relu", ["r"], ["r2"]),
        helper.make_node("Det", ["x"], ["d"]),
        helper.make_node("Unsqueeze", ["x", "ax"], ["x4"]),
        helper.make_node("BatchNormalization", ["x4", "s", "b", "m", "v"], ["bn", "rm", "rv"], training_mode=1),
        helper.make_node("BatchNormalization", ["x4", "s", "b", "m", "v"], ["bn2"]),
        helper.make_node("Twice", ["x"], ["tw"], domain="local"),
        helper.make_node("ReduceMax", ["x"], ["cond0"], keepdims=0),
        helper.make_node("Cast", ["cond0"], ["cond"], to=TensorProto.BOOL),
        helper.make_node("If", ["cond"], ["iff"], then_branch=then, else_branch=other),
        helper.make_node("Frobnicate", ["x"], ["z"], domain="com.example"),
    ]
    outs = ["r2", "d", "bn", "bn2", "tw", "iff", "z"]
    g = helper.make_graph(nodes, "coverage", [helper.make_tensor_value_info("x", F, [3, 3])],
                          [helper.make_tensor_value_info(o, F, None) for o in outs],
                          c + [numpy_helper.from_array(np.array([0], np.int64), "ax")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1),
                                            helper.make_opsetid("com.example", 1)], functions=[fn], ir_version=8)
    onnx.save(m, str(path))
    return str(path)


def test_coverage_reports_native_fallback_and_unsupported_without_dying(tmp_path, capsys):
    """A model with an op nothing runs cannot make a session; inspect says why and still gives
    every op type's status (JSON and text), computed without running."""
    path = _coverage_model(tmp_path / "coverage.onnx")
    code, out, err = _run(["inspect", path, "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert "com.example::Frobnicate" in report["session_error"]
    rows = {f"{r['domain']}::{r['op_type']}": r for r in report["coverage"]["ops"]}
    assert {k: r["status"] for k, r in rows.items()} == {
        "ai.onnx::Abs": "native", "ai.onnx::Neg": "native",  # inside the If's branches
        "ai.onnx::BatchNormalization": "fallback", "ai.onnx::Cast": "native", "ai.onnx::Det": "fallback",
        "ai.onnx::If": "native", "ai.onnx::ReduceMax": "native", "ai.onnx::Relu": "native",
        "ai.onnx::Unsqueeze": "native", "com.example::Frobnicate": "unsupported", "local::Twice": "fallback",
    }
    bn = rows["ai.onnx::BatchNormalization"]
    assert (bn["nodes"], bn["native"], bn["fallback"]) == (2, 1, 1) and "declines" in bn["reason"]
    assert rows["ai.onnx::Relu"]["nodes"] == 2 and rows["ai.onnx::Relu"]["reason"] is None
    assert "function defined by the model" in rows["local::Twice"]["reason"]
    assert report["coverage"]["op_types"] == {"native": 7, "fallback": 3, "unsupported": 1}
    assert report["coverage"]["runnable"] is False and report["coverage"]["fully_native"] is False
    assert report["stats"] is None and report["packs"] == []
    code, out, err = _run(["inspect", path], capsys)
    assert code == 0, err
    assert "no session: " in out and "1 op type(s) UNSUPPORTED" in out
    line = next(ln for ln in out.splitlines() if ln.lstrip().startswith("com.example::Frobnicate"))
    assert "unsupported" in line and "onnx.reference has no com.example::Frobnicate" in line


def test_coverage_of_a_runnable_model_matches_its_sessions_fallback_nodes(tmp_path, capsys):
    """Without the unsupported op the session is made; the fallback op types are exactly those of
    the nodes the session runs through onnx.reference."""
    path = tmp_path / "coverage.onnx"
    _coverage_model(path)
    m = onnx.load(str(path))
    keep = [n for n in m.graph.node if n.op_type != "Frobnicate"]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    del m.graph.output[-1]
    onnx.save(m, str(path))
    report = collect(str(path))
    assert report["session_error"] is None and report["coverage"]["runnable"] is True
    fallback_ops = {r["op_type"] for r in report["coverage"]["ops"] if r["fallback"]}
    assert fallback_ops == {n.split(":")[-1] for n in report["fallback_nodes"]} == {"Det", "BatchNormalization", "Twice"}


@pytest.mark.parametrize("name", sorted(sample_models.SAMPLES))
def test_samples_are_fully_native(samples, name):
    report = collect(samples[name])
    assert report["coverage"]["fully_native"], [r for r in report["coverage"]["ops"] if r["status"] != "native"]
    assert sum(r["nodes"] for r in report["coverage"]["ops"]) == sum(s["nodes"] for s in report["scopes"])
