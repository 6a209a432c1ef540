"""Saving pre-packed blobs next to the weights and mapping them back (issue 5).

Oracles: ``onnx.reference`` and onnxruntime on the same files, numpy re-computations of the
packed layout, and the bytes on disk.  Every invalid-entry case is made by editing a saved model
(its ``metadata_props`` or its data file) and must cost exactly one :class:`PrepackWarning`, a
re-pack, and nothing else.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxpack_sample_models as sample_models  # models/build.py, via tests/conftest.py
from onnxpack.errors import PrepackWarning
from onnxpack.prepack import entry_format as ef
from onnxpack.session import InferenceSession, SessionOptions

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
SAMPLES = ["mlp", "cnn", "subgraphs", "transformer", "fp16_mlp", "shared_weight"]
FLAG = "session.save_external_prepacked_constant_initializers"


# -- helpers ------------------------------------------------------------------------------------


def _options(out: os.PathLike | None = None, *, flag: bool = True, **config: str) -> SessionOptions:
    o = SessionOptions()
    if out is not None:
        o.optimized_model_filepath = str(out)
        if flag:
            o.add_session_config_entry(FLAG, "1")
    for k, v in config.items():
        o.add_session_config_entry(k.replace("__", "."), v)
    return o


def _optimize(src: os.PathLike, out: os.PathLike, *, flag: bool = True, **config: str) -> InferenceSession:
    return InferenceSession(str(src), _options(out, flag=flag, **config))


def _records(path: os.PathLike) -> dict[tuple[str, str], ef.WeightRecord]:
    proto = onnx.load(str(path), load_external_data=False)
    out = {}
    for p in proto.metadata_props:
        if ef.is_record_key(p.key):
            rec = ef.parse_record(p.key, p.value)
            out[(rec.scope, rec.name)] = rec
    return out


def _reference(path: os.PathLike, feeds: dict) -> list[np.ndarray]:
    return ReferenceEvaluator(str(path)).run(None, feeds)


def _ort(path: os.PathLike, feeds: dict) -> list[np.ndarray]:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _close(a, b, *, tol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        atol = tol * max(1.0, float(np.abs(y.astype(np.float64)).max(initial=0.0)))
        np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), rtol=tol, atol=atol)


def _equal(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


class _Warnings:
    """Collects PrepackWarnings (every one, even repeats)."""

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        self.all = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)

    @property
    def prepack(self) -> list[str]:
        return [str(w.message) for w in self.all if issubclass(w.category, PrepackWarning)]


def _rewrite_props(path: os.PathLike, edit) -> None:
    """Rewrites the model file with ``edit(dict key -> value)`` applied to its metadata_props."""
    proto = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in proto.metadata_props}
    props = edit(props)
    proto.ClearField("metadata_props")
    for k, v in props.items():
        e = proto.metadata_props.add()
        e.key, e.value = k, v
    pathlib.Path(path).write_bytes(proto.SerializeToString())


def _data_path(model_path: os.PathLike, location: str) -> pathlib.Path:
    return pathlib.Path(model_path).parent / location


def _external(path: os.PathLike, name: str) -> tuple[str, int, int]:
    proto = onnx.load(str(path), load_external_data=False)
    for t in proto.graph.initializer:
        if t.name == name:
            info = {e.key: e.value for e in t.external_data}
            return info["location"], int(info["offset"]), int(info["length"])
    raise KeyError(name)


# -- round trip on every sample -----------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLES, ids=SAMPLES)
def test_round_trip_sample(name, tmp_path):
    src = MODELS / f"{name}.onnx"
    out = tmp_path / f"{name}.opt.onnx"
    feeds = sample_models.sample_inputs(name, onnx.load(str(src), load_external_data=False))
    with _Warnings() as w:
        cold = _optimize(src, out)
        cold_out = cold.run(None, feeds)
        packed = cold.get_prepack_stats()["weights_packed"]
        assert packed > 0
        warm = InferenceSession(str(out))
        stats = warm.get_prepack_stats()
        warm_out = warm.run(None, feeds)
    assert w.prepack == []
    assert stats["weights_packed"] == 0
    assert stats["blobs_from_model"] >= 1
    assert stats["blobs_rejected"] == 0
    assert all(r["origin"] in ("model", "container") for r in warm.get_prepack_log())
    _equal(warm_out, cold_out)

    onnx.checker.check_model(str(out), full_check=True)
    ref_original = _reference(src, feeds)
    _equal(_reference(out, feeds), ref_original)  # same weights, same reference computation
    _equal(_ort(out, feeds), _ort(src, feeds))
    _close(warm_out, ref_original, tol=2e-3 if "fp16" in name else 1e-4)

    # Every record names a weight its scope owns, and every buffer is aligned inside the file.
    proto = onnx.load(str(out), load_external_data=False)
    owners = _scope_initializers(out)
    recs = _records(out)
    assert recs
    for (scope, wname), rec in recs.items():
        assert wname in owners.get(scope, set()), (scope, wname)
        for p in rec.packs:
            for b in p.buffers:
                assert b.offset % 64 == 0
    assert len(recs) == len({(r["scope_owner"], r["weight"]) for r in _owner_log(warm)})
    del proto
    cold.close()
    warm.close()


def _scope_initializers(path) -> dict[str, set[str]]:
    from onnxpack.graph import load_model

    with load_model(str(path)) as m:
        return {s.path: set(s.initializers) for s in m.scopes()}


def _owner_log(session) -> list[dict]:
    """Packed rows with the owning scope of each weight (resolved like the session does)."""
    owners = {s.path: s for s in session.model.scopes()}
    rows = []
    for r in session.get_prepack_log():
        s = owners[r["scope"]]
        while r["weight"] not in s.initializers:
            s = s.parent
        rows.append({**r, "scope_owner": s.path})
    return rows


def test_outer_scope_weight_recorded_under_owner(tmp_path):
    """W_loop lives in the root and is packed by a MatMul two subgraphs deep."""
    out = tmp_path / "sub.onnx"
    s = _optimize(MODELS / "subgraphs.onnx", out)
    log = {r["weight"]: r for r in s.get_prepack_log()}
    assert log["W_loop"]["scope"] != ""  # packed by a kernel inside a nested subgraph
    assert log["W_else"]["scope"] != ""
    recs = _records(out)
    assert ("", "W_loop") in recs and ("", "W_else") in recs
    assert not any(scope and name in ("W_loop", "W_else") for scope, name in recs)
    # W_loop is fp32 and MatMul reads it as it is (an identity pack): the record points at the
    # weight's own bytes instead of a second copy.
    loc, off, length = _external(out, "W_loop")
    blob = recs[("", "W_loop")].packs[0].buffers[0]
    assert (blob.location, blob.offset, blob.length) == (loc, off, length)
    warm = InferenceSession(str(out))
    assert warm.get_prepack_stats()["weights_packed"] == 0
    assert {r["weight"]: r["origin"] for r in warm.get_prepack_log()}["W_loop"] == "model"


def test_without_flag_only_model_and_weights(tmp_path):
    src = MODELS / "mlp.onnx"
    out = tmp_path / "plain.onnx"
    _optimize(src, out, flag=False).close()
    assert _records(out) == {}
    proto = onnx.load(str(out), load_external_data=False)
    ends = []
    for t in proto.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            ends.append(int(info["offset"]) + int(info["length"]))
            loc = info["location"]
    assert os.path.getsize(_data_path(out, loc)) == max(ends)  # nothing after the last weight
    s = InferenceSession(str(out))
    assert s.get_prepack_stats()["blobs_from_model"] == 0
    assert s.get_prepack_stats()["weights_packed"] == 3


# -- invalid entries ---------------------------------------------------------------------------


def _transposed_mlp(folder: pathlib.Path) -> pathlib.Path:
    """The mlp sample with fc1 and fc3 as Gemm(transB=1) over transposed weights (as PyTorch
    exports Linear layers): their packs transpose, so the saved blobs are bytes of their own."""
    m = onnx.load(str(MODELS / "mlp.onnx"))
    inits = {t.name: t for t in m.graph.initializer}
    for node in m.graph.node:
        if node.name in ("fc1", "fc3"):
            w = node.input[1]
            arr = numpy_helper.to_array(inits[w]).T.copy()
            inits[w].CopyFrom(numpy_helper.from_array(arr, w))
            node.op_type = "Gemm"
            node.attribute.extend([helper.make_attribute("transB", 1)])
    src = folder / "mlp_t.onnx"
    _save_proto(m, src)
    return src


@pytest.fixture
def saved_mlp(tmp_path):
    out = tmp_path / "mlp.opt.onnx"
    s = _optimize(_transposed_mlp(tmp_path), out)
    expected = s.run(None, sample_models.sample_inputs("mlp"))
    s.close()
    return out, expected


def _edit_record(name: str, edit):
    """metadata edit: apply ``edit(json object)`` to the record of root weight ``name``."""

    def apply(props):
        key = ef.record_key("", name)
        prefix, _, body = props[key].partition(";")
        props[key] = prefix + ";" + json.dumps(edit(json.loads(body)))
        return props

    return apply


def _set_value(name: str, value: str):
    def apply(props):
        props[ef.record_key("", name)] = value
        return props

    return apply


def _buf(obj):
    return obj["packs"][0]["buffers"][0]


def _foreign_family(o):
    fam, ver, dig = o["packs"][0]["key"].split("/")
    o["packs"][0]["key"] = f"conv/{ver}/{dig}"
    return o


def _foreign_version(o):
    fam, ver, dig = o["packs"][0]["key"].split("/")
    o["packs"][0]["key"] = f"{fam}/99/{dig}"
    return o


def _oob(o):
    _buf(o)["offset"] = 64 * 2**30
    return o


def _transposed_shape(o):
    b = _buf(o)
    b["shape"] = b["shape"][::-1]
    return o


def _int_dtype(o):
    _buf(o)["dtype"] = "<i4"
    return o


def _short(o):
    b = _buf(o)
    b["shape"] = [b["shape"][0] - 1, b["shape"][1]]
    b["length"] = b["shape"][0] * b["shape"][1] * 4
    return o


def _key_mismatch(props):
    key = ef.record_key("", "W1")
    props[ef.record_key("", "W1_other")] = props.pop(key)
    return props


INVALID = {
    "malformed": _set_value("W1", "onnxpack-prepack-v1;{not json"),
    "unknown_version": lambda p: _set_value("W1", p[ef.record_key("", "W1")].replace("-v1;", "-v7;", 1))(p),
    "foreign_family": _edit_record("W1", _foreign_family),
    "foreign_pack_version": _edit_record("W1", _foreign_version),
    "out_of_bounds": _edit_record("W1", _oob),
    "shape_disagrees": _edit_record("W1", _transposed_shape),
    "dtype_disagrees": _edit_record("W1", _int_dtype),
    "length_disagrees": _edit_record("W1", _short),
    "key_value_mismatch": _key_mismatch,
}


@pytest.mark.parametrize("case", list(INVALID), ids=list(INVALID))
def test_invalid_entry_falls_back(case, saved_mlp):
    out, expected = saved_mlp
    _rewrite_props(out, INVALID[case])
    with _Warnings() as w:
        s = InferenceSession(str(out))
        got = s.run(None, sample_models.sample_inputs("mlp"))
    assert len(w.prepack) == 1, w.prepack
    assert "W1" in w.prepack[0]
    stats = s.get_prepack_stats()
    assert stats["weights_packed"] == 1  # W1 re-packed; W2, W3 still mapped
    assert stats["blobs_from_model"] == 2
    assert stats["blobs_rejected"] == 1
    _equal(got, expected)


@pytest.fixture
def row_lookups(monkeypatch) -> list[tuple[str, bool]]:
    """(weight name, whether the record index's row gave its blob) per LoadRecord._find_row call
    (the warm path that builds no record)."""
    from onnxpack.prepack import _record

    calls: list[tuple[str, bool]] = []
    find_row = _record.LoadRecord._find_row

    def counting(self, index, row, location, scope, name, *args):
        got = find_row(self, index, row, location, scope, name, *args)
        calls.append((name, got is not None))
        return got

    monkeypatch.setattr(_record.LoadRecord, "_find_row", counting)
    return calls


def test_warm_load_reads_blobs_from_the_record_index(saved_mlp, row_lookups):
    """An unchanged saved model's blobs come through the record index's rows, and give the saved
    session's outputs."""
    out, expected = saved_mlp
    with _Warnings() as w:
        s = InferenceSession(str(out))
        got = s.run(None, sample_models.sample_inputs("mlp"))
    assert not w.prepack
    stats = s.get_prepack_stats()
    assert stats["weights_packed"] == 0 and stats["blobs_from_model"] == 3
    assert sorted(row_lookups) == [("W1", True), ("W2", True), ("W3", True)]
    _equal(got, expected)


def test_graph_edit_under_a_trusted_data_file_repacks(saved_mlp, row_lookups):
    """Editing the graph (not the records) leaves the data file trusted and its record index in
    use: fc1 as Gemm(transB=0) over the same bytes read transposed asks for another pack of W1,
    which the index's row must not satisfy (its key binds the old shape): a warning, a re-pack,
    and the edited model's outputs."""
    out, _ = saved_mlp
    proto = onnx.load(str(out), load_external_data=False)
    node = next(n for n in proto.graph.node if n.name == "fc1")
    for a in node.attribute:
        if a.name == "transB":
            a.i = 0
    w1 = next(t for t in proto.graph.initializer if t.name == node.input[1])
    w1.dims[:] = list(w1.dims)[::-1]
    pathlib.Path(out).write_bytes(proto.SerializeToString())
    feeds = sample_models.sample_inputs("mlp")
    with _Warnings() as w:
        s = InferenceSession(str(out))
        got = s.run(None, feeds)
    assert len(w.prepack) == 1 and "W1" in w.prepack[0], w.prepack
    stats = s.get_prepack_stats()
    assert stats["weights_packed"] == 1 and stats["blobs_from_model"] == 2 and stats["blobs_rejected"] == 1
    assert sorted(row_lookups) == [("W1", False), ("W2", True), ("W3", True)]  # the full path refused W1's
    _close(got, _reference(out, feeds))


def test_stale_weight_is_repacked(saved_mlp):
    """The weight's bytes changed in the data file after the blob was saved."""
    out, _ = saved_mlp
    loc, off, length = _external(out, "W1")
    data = _data_path(out, loc)
    with open(data, "r+b") as f:
        f.seek(off)
        w = np.frombuffer(f.read(length), dtype=np.float32)
        f.seek(off)
        f.write((-w * 0.5).astype(np.float32).tobytes())
    feeds = sample_models.sample_inputs("mlp")
    with _Warnings() as ws:
        s = InferenceSession(str(out))
        got = s.run(None, feeds)
    assert len(ws.prepack) == 1 and "W1" in ws.prepack[0] and "stale" in ws.prepack[0]
    assert s.get_prepack_stats()["weights_packed"] == 1
    _close(got, _reference(out, feeds))


def test_stale_shared_weight_warns_once(tmp_path):
    """One weight, two consumers, a stale record: still one warning naming it."""
    out = tmp_path / "shared.onnx"
    _optimize(MODELS / "shared_weight.onnx", out).close()
    loc, off, length = _external(out, "W")
    with open(_data_path(out, loc), "r+b") as f:
        f.seek(off)
        f.write(bytes(length))  # zero weight
    feeds = sample_models.sample_inputs("shared_weight")
    with _Warnings() as ws:
        s = InferenceSession(str(out))
        got = s.run(None, feeds)
    assert len(ws.prepack) == 1, ws.prepack
    assert s.get_prepack_stats()["weights_packed"] == 1
    _close(got, _reference(out, feeds))


# -- layout and bytes on disk ------------------------------------------------------------------


@pytest.mark.parametrize("threshold,granularity", [(65536, 4096), (1024, 16384)],
                         ids=["default", "small_threshold"])
def test_blob_offsets_aligned_and_bytes_on_disk(tmp_path, threshold, granularity):
    out = tmp_path / "t.onnx"
    _optimize(MODELS / "transformer.onnx", out, onnxpack__align_threshold=str(threshold),
              onnxpack__allocation_granularity=str(granularity)).close()
    src = onnx.load(str(MODELS / "transformer.onnx"))
    weights = {t.name: numpy_helper.to_array(t) for t in src.graph.initializer}
    recs = _records(out)
    assert recs
    saw_large = False
    for (scope, name), rec in recs.items():
        for p in rec.packs:
            for b in p.buffers:
                assert b.offset % 64 == 0
                if b.length >= threshold:
                    saw_large = True
                    assert b.offset % granularity == 0, (name, b.offset)
                raw = np.fromfile(_data_path(out, b.location), dtype=np.uint8, count=b.length,
                                  offset=b.offset)
                assert ef.checksum(raw) == b.checksum
                blob = raw.view(b.dtype).reshape(b.shape)
                np.testing.assert_array_equal(blob, _kernel_pack(src, name)[0])
    assert saw_large


def _kernel_pack(model: onnx.ModelProto, name: str, op_type: str | None = None) -> tuple:
    """What a fresh kernel of the (first) root node consuming ``name`` at input 1 packs from the
    original weight: the bytes on disk must be exactly these."""
    from onnxpack.session.kernels import KernelContext, lookup

    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    opset = {o.domain: o.version for o in model.opset_import}.get("", 17)
    for node in model.graph.node:
        if len(node.input) > 1 and node.input[1] == name and (op_type is None or node.op_type == op_type):
            kernel = lookup("", node.op_type, opset)(node, KernelContext(opset=opset, opsets={"": opset}))
            return tuple(kernel.prepack(1, weights[name]))
    raise KeyError(name)


# -- checksums ---------------------------------------------------------------------------------


def _flip_blob_byte(out, name: str) -> None:
    b = _records(out)[("", name)].packs[0].buffers[0]
    with open(_data_path(out, b.location), "r+b") as f:
        f.seek(b.offset + b.length // 2 + 1)
        byte = f.read(1)
        f.seek(b.offset + b.length // 2 + 1)
        f.write(bytes([byte[0] ^ 0x40]))


def test_verify_prepacked_catches_flipped_byte(saved_mlp):
    out, expected = saved_mlp
    _flip_blob_byte(out, "W1")  # 64 KiB blob: above the always-checked size
    feeds = sample_models.sample_inputs("mlp")
    with _Warnings() as ws:
        s = InferenceSession(str(out), _options(onnxpack__verify_prepacked="1"))
        got = s.run(None, feeds)
    assert len(ws.prepack) == 1 and "W1" in ws.prepack[0] and "checksum" in ws.prepack[0]
    assert s.get_prepack_stats()["weights_packed"] == 1
    _equal(got, expected)
    # Without verify the flip is caught too: writing into the data file changed its identity
    # (ctime), so every source and blob of it is verified in full before use (issue 12).
    with _Warnings() as ws:
        s2 = InferenceSession(str(out))
        _equal(s2.run(None, feeds), expected)
    assert len(ws.prepack) == 1 and "W1" in ws.prepack[0] and "checksum" in ws.prepack[0]
    assert s2.get_prepack_stats()["weights_packed"] == 1


def test_small_blobs_always_checksummed(saved_mlp):
    """Blobs below ALWAYS_VERIFY_BELOW are checked even without verify_prepacked (cheap)."""
    from onnxpack.prepack._record import ALWAYS_VERIFY_BELOW

    out, expected = saved_mlp
    b = _records(out)[("", "W3")].packs[0].buffers[0]
    assert b.length < ALWAYS_VERIFY_BELOW
    _flip_blob_byte(out, "W3")
    with _Warnings() as ws:
        s = InferenceSession(str(out))
        got = s.run(None, sample_models.sample_inputs("mlp"))
    assert len(ws.prepack) == 1 and "W3" in ws.prepack[0]
    assert s.get_prepack_stats()["weights_packed"] == 1
    _equal(got, expected)


# -- onnxruntime's own prepacked entries -------------------------------------------------------


def test_model_saved_by_onnxruntime_with_its_prepacked_entries(tmp_path):
    src = tmp_path / "chain.onnx"
    sample_models.make_matmul_chain(str(src), 2, 256)
    ort_out = tmp_path / "ort_opt.onnx"
    o = ort.SessionOptions()
    o.optimized_model_filepath = str(ort_out)
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    o.add_session_config_entry(FLAG, "1")
    o.add_session_config_entry("session.optimized_model_external_initializers_file_name", "ort_opt.onnx.data")
    o.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), o, providers=["CPUExecutionProvider"])
    proto = onnx.load(str(ort_out), load_external_data=False)
    ort_keys = [e.key for t in proto.graph.initializer for e in t.external_data if e.key.startswith("prepacked")]
    assert ort_keys, "onnxruntime did not write its prepacked entries"

    feeds = {"x": np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)}
    with _Warnings() as ws:
        s = InferenceSession(str(ort_out), _options(tmp_path / "again.onnx"))
        got = s.run(None, feeds)
    assert ws.prepack == []
    stats = s.get_prepack_stats()
    assert stats["weights_packed"] == 2 and stats["blobs_from_model"] == 0
    _close(got, _reference(src, feeds))
    again = onnx.load(str(tmp_path / "again.onnx"), load_external_data=False)
    keys = [e.key for t in again.graph.initializer for e in t.external_data]
    assert not [k for k in keys if k.startswith("prepacked")]
    assert len(_records(tmp_path / "again.onnx")) == 2
    _close(_ort(tmp_path / "again.onnx", feeds), got)


# -- sharing -----------------------------------------------------------------------------------


def _save_proto(model: onnx.ModelProto, path) -> None:
    from onnxpack.graph import save_model

    save_model(model, str(path), min_size=1024)


def test_weight_packed_by_two_kernels_gets_both_blobs(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["a"], name="mm"),
         helper.make_node("Gemm", ["x", "W"], ["b"], name="gemm", transB=1, alpha=0.5),
         helper.make_node("Add", ["a", "b"], ["y"], name="add")],
        "two_kernels", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    src = tmp_path / "two.onnx"
    _save_proto(m, src)
    out = tmp_path / "two.opt.onnx"
    _optimize(src, out).close()
    rec = _records(out)[("", "W")]
    assert sorted(p.key.split("/")[0] for p in rec.packs) == ["gemm", "matmul"]
    offsets = [p.buffers[0].offset for p in rec.packs]
    assert len(set(offsets)) == 2
    data = _data_path(out, rec.packs[0].buffers[0].location)
    for p in rec.packs:
        b = p.buffers[0]
        blob = np.fromfile(data, dtype=np.float32, count=b.length // 4, offset=b.offset).reshape(b.shape)
        op = "MatMul" if p.key.startswith("matmul/") else "Gemm"
        np.testing.assert_array_equal(blob, _kernel_pack(m, "W", op)[0])
    # The two packs differ (Gemm folds alpha), so both really are on disk.
    b0, b1 = (np.fromfile(data, dtype=np.float32, count=p.buffers[0].length // 4,
                          offset=p.buffers[0].offset) for p in rec.packs)
    assert not np.array_equal(b0, b1)
    feeds = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    s = InferenceSession(str(out))
    assert s.get_prepack_stats()["weights_packed"] == 0
    assert s.get_prepack_stats()["blobs_from_model"] == 2
    _close(s.run(None, feeds), _reference(src, feeds))


def test_equal_weights_share_one_blob(tmp_path):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "Wa"], ["a"], name="mm_a"),
         helper.make_node("MatMul", ["a", "Wb"], ["y"], name="mm_b")],
        "equal", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(w, "Wa"), numpy_helper.from_array(w.copy(), "Wb")])
    for node in g.node:  # transposing Gemms: packs with bytes of their own (not identity)
        node.op_type = "Gemm"
        node.attribute.extend([helper.make_attribute("transB", 1)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    src = tmp_path / "eq.onnx"
    _save_proto(m, src)
    out = tmp_path / "eq.opt.onnx"
    _optimize(src, out).close()
    recs = _records(out)
    ba = recs[("", "Wa")].packs[0].buffers[0]
    bb = recs[("", "Wb")].packs[0].buffers[0]
    assert (ba.location, ba.offset) == (bb.location, bb.offset)
    # On disk: two weights (they are distinct initializers) and exactly one blob, then the manifest.
    data = _data_path(out, ba.location)
    seal = next(ef.parse_file_record(p.key, p.value) for p in onnx.load(str(out), load_external_data=False).metadata_props
                if ef.is_file_key(p.key))
    assert seal.manifest_offset + seal.manifest_length == os.path.getsize(data)
    assert seal.manifest_offset < 3 * w.nbytes + 3 * 64
    raw = data.read_bytes()
    blob = np.ascontiguousarray(_kernel_pack(m, "Wa")[0]).tobytes()
    assert raw.count(blob) == (1 if blob != w.tobytes() else 3)
    feeds = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    s = InferenceSession(str(out))
    assert s.get_prepack_stats()["weights_packed"] == 0
    _close(s.run(None, feeds), _reference(src, feeds))


def _identity_and_blob(folder: pathlib.Path) -> pathlib.Path:
    """x (2, 128) -> MatMul by WA (128, 32) and Gemm(transB) by WB (32, 128): WA's pack is its
    own bytes (fp32, narrower than a panel), WB's a transposed blob of the same length."""
    rng = np.random.default_rng(8)
    wa = rng.standard_normal((128, 32)).astype(np.float32)
    wb = rng.standard_normal((32, 128)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "WA"], ["ya"], name="mm"),
         helper.make_node("Gemm", ["x", "WB"], ["yb"], name="gemm", transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128])],
        [helper.make_tensor_value_info("ya", TensorProto.FLOAT, [2, 32]),
         helper.make_tensor_value_info("yb", TensorProto.FLOAT, [2, 32])],
        [numpy_helper.from_array(wa, "WA"), numpy_helper.from_array(wb, "WB")])
    src = folder / "ab.onnx"
    _save_proto(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), src)
    return src


def test_identity_pack_points_at_its_weight_and_nothing_else_may(tmp_path):
    """fp32 weights the kernel reads as they are (WA: MatMul, 32 columns) are recorded at their
    own bytes, not written twice; a transposing pack (WB: Gemm transB) pointed at its weight's
    bytes — same length, dtype and shape as the real blob — is refused, never used."""
    out = tmp_path / "ab.opt.onnx"
    feeds = {"x": np.random.default_rng(9).standard_normal((2, 128)).astype(np.float32)}
    s = _optimize(_identity_and_blob(tmp_path), out)
    expected = s.run(None, feeds)
    s.close()
    recs = _records(out)
    wa = recs[("", "WA")].packs[0].buffers[0]
    assert (wa.location, wa.offset, wa.length) == _external(out, "WA")
    loc, off, length = _external(out, "WB")
    wb = recs[("", "WB")].packs[0].buffers[0]
    assert wb.length == length and wb.offset != off  # a real blob of the same size

    def at_own_weight(o):
        _buf(o)["offset"] = off
        return o

    _rewrite_props(out, _edit_record("WB", at_own_weight))
    with _Warnings() as w:
        s = InferenceSession(str(out))
        got = s.run(None, feeds)
    assert len(w.prepack) == 1 and "WB" in w.prepack[0] and "overlaps" in w.prepack[0]
    assert s.get_prepack_stats()["weights_packed"] == 1
    _equal(got, expected)


def _one_matmul(typed_fields: bool) -> onnx.ModelProto:
    w = np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32)
    init = (helper.make_tensor("W", TensorProto.FLOAT, w.shape, w.reshape(-1).tolist()) if typed_fields
            else numpy_helper.from_array(w, "W"))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [init])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("typed_fields", [False, True], ids=["raw_data", "float_data"])
def test_in_proto_weight_is_not_stored_twice(tmp_path, typed_fields):
    """A model with its weights inside the .onnx (most shipped models) optimizes to the same data
    file as the same model saved with external data: the fp32 MatMul weight's identity pack is
    recorded at the weight's own offset, not written a second time.  (The saver recognises a pack
    as its weight by buffer address; an in-proto weight handed out a fresh copy of its bytes on
    every access, so the pack never matched.)"""
    m = _one_matmul(typed_fields)
    sizes = {}
    for layout in ("in-proto", "external"):
        folder = tmp_path / layout
        folder.mkdir()
        src = folder / "m.onnx"
        if layout == "in-proto":
            onnx.save(m, str(src))
        else:
            onnx.save(m, str(src), save_as_external_data=True, location="m.data", size_threshold=0)
        out = folder / "m.opt.onnx"
        _optimize(src, out)
        sizes[layout] = os.path.getsize(str(out) + ".data")
        buf = _records(out)[("", "W")].packs[0].buffers[0]
        assert (buf.location, buf.offset, buf.length) == _external(out, "W"), layout
        warm = InferenceSession(str(out))
        assert warm.get_prepack_stats()["blobs_from_model"] == 1 and warm.get_prepack_stats()["weights_packed"] == 0
    assert sizes["in-proto"] == sizes["external"] < 128 * 64 * 4 + 4096


def test_constant_node_weight_packs_are_saved_under_its_record(tmp_path):
    """A Constant node's tensor packed by its consumer (Gemm transB: a transposed copy) is saved
    after the scope's initializers under the Constant output's record and mapped back warm; an
    identity pack of a Constant tensor (MatMul) is not saved: the tensor stays in the proto, so a
    blob would store it twice, and viewing it again costs nothing."""
    rng = np.random.default_rng(6)
    wg = rng.standard_normal((64, 128)).astype(np.float32)
    wm = rng.standard_normal((128, 32)).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["Wg"], value=numpy_helper.from_array(wg, "Wg")),
             helper.make_node("Constant", [], ["Wm"], value=numpy_helper.from_array(wm, "Wm")),
             helper.make_node("Gemm", ["x", "Wg"], ["h"], transB=1),
             helper.make_node("MatMul", ["x", "Wm"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128])],
                          [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 64]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])])
    src, out = tmp_path / "c.onnx", tmp_path / "c.opt.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(src))
    x = {"x": rng.standard_normal((2, 128)).astype(np.float32)}
    cold = _optimize(src, out)
    assert set(_records(out)) == {("", "Wg")}
    assert os.path.getsize(str(out) + ".data") < wg.nbytes + 4096
    with _Warnings() as w:
        warm = InferenceSession(str(out))
    assert w.prepack == []
    stats = warm.get_prepack_stats()
    assert stats["blobs_from_model"] == 1 and stats["weights_packed"] == 1  # Wm: a view, again
    for a, b in zip(warm.run(None, x), cold.run(None, x)):
        np.testing.assert_array_equal(a, b)
    ref = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, x)
    for a, b in zip(warm.run(None, x), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
