"""save_model layout, alignment, hooks, preserved keys and never touching the input."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnxpack.errors import InvalidArgument
from onnxpack.graph import BlobPlacement, compute_offset, load_model, save_model


@settings(max_examples=300, deadline=None)
@given(current=st.integers(0, 1 << 40), size=st.integers(0, 1 << 32),
       threshold=st.integers(0, 1 << 24), gran_log=st.integers(0, 16))
def test_compute_offset_properties(current, size, threshold, gran_log):
    gran = 1 << gran_log
    off = compute_offset(current, size, align_threshold=threshold, allocation_granularity=gran)
    assert off >= current and off % 64 == 0
    step = max(gran, 64) if size >= threshold else 64
    assert off % step == 0 and off - current < step  # smallest aligned offset


def _model_with(arrays: list[np.ndarray]) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(a, f"t{i}") for i, a in enumerate(arrays)]
    nodes = [helper.make_node("Identity", [t.name], [t.name + "_o"]) for t in inits]
    outs = [helper.make_tensor_value_info(t.name + "_o", t.data_type, list(t.dims)) for t in inits]
    return helper.make_model(helper.make_graph(nodes, "g", [], outs, inits),
                             opset_imports=[helper.make_opsetid("", 17)])


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 20000), min_size=1, max_size=12),
       threshold=st.sampled_from([0, 100, 4096, 10000, 1 << 30]),
       gran=st.sampled_from([64, 256, 4096, 16384]),
       min_size=st.sampled_from([0, 1, 1024]),
       blob_sizes=st.lists(st.integers(1, 9000), max_size=4))
def test_saved_layout_aligned_no_overlap_bytes_equal(tmp_path_factory, sizes, threshold, gran,
                                                     min_size, blob_sizes):
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    blobs = [rng.integers(0, 255, n, dtype=np.uint8) for n in blob_sizes]

    class Extras:
        def blobs(self, scope_path, name):
            return blobs if name == "t0" else ()

        def metadata(self, placements, location):
            return {}

    out = tmp_path_factory.mktemp("layout") / "m.onnx"
    result = save_model(_model_with(arrays), out, min_size=min_size, align_threshold=threshold,
                        allocation_granularity=gran, extra=Extras())
    regions = []
    data = open(result.data_path, "rb").read() if result.data_path else b""
    assert len(data) == result.bytes_written
    model = load_model(out)
    for i, a in enumerate(arrays):
        t = model.root.initializers[f"t{i}"]
        np.testing.assert_array_equal(t.numpy(), a)
        if t.external is None:
            assert a.nbytes < min_size or a.nbytes == 0
            continue
        assert a.nbytes >= min_size
        off = t.external.offset
        assert off % 64 == 0 and (a.nbytes < threshold or off % max(gran, 64) == 0)
        assert data[off:off + a.nbytes] == a.tobytes()
        regions.append((off, off + a.nbytes))
    placed = result.placements.get(("", "t0"), [])
    assert len(placed) == len(blobs)
    for p, b in zip(placed, blobs):
        assert p.offset % 64 == 0 and (b.nbytes < threshold or p.offset % max(gran, 64) == 0)
        assert data[p.offset:p.offset + p.length] == b.tobytes()
        regions.append((p.offset, p.offset + p.length))
    regions.sort()
    for (a0, a1), (b0, b1) in zip(regions, regions[1:]):
        assert a1 <= b0, "overlapping regions"


def test_outer_scope_initializers_externalized_and_found(samples, tmp_path):
    model = load_model(samples["subgraphs"])
    result = save_model(model, tmp_path / "o.onnx", min_size=64)
    saved = load_model(tmp_path / "o.onnx")
    by_path = {s.path: s for s in saved.scopes()}
    inner = by_path["/top_if.then_branch/inner_loop.body"]
    for scope, name in [(inner, "W_loop"), (by_path["/top_if.else_branch"], "W_else"),
                        (by_path["/top_loop.body/body_if.then_branch"], "B_if")]:
        t = scope.lookup_initializer(name)
        assert t is saved.root.initializers[name]
        assert t.external is not None and t.external.path == os.path.realpath(result.data_path)
        np.testing.assert_array_equal(t.numpy(), model.root.initializers[name].numpy())
    # the body's own initializer lives in its scope and is externalized too
    assert inner.initializers["D_body"].external is not None
    # no node in the root consumes W_loop: it is referenced only from nested scopes
    assert not any("W_loop" in n.input for n in saved.root.graph.node)


def test_extras_dedupe_metadata_and_small_initializers(samples, tmp_path):
    model = load_model(samples["shared_weight"])
    shared = np.arange(300, dtype=np.float32)
    calls = []

    class Extras:
        def blobs(self, scope_path, name):
            calls.append((scope_path, name))
            return [shared, shared]

        def metadata(self, placements, location):
            self.seen = placements
            return {"onnxpack.prepacked//W": "new", "other": "x"}

    extras = Extras()
    # min_size above everything: W stays in-proto but its blobs still go to the data file
    result = save_model(model, tmp_path / "s.onnx", min_size=1 << 30, extra=extras)
    assert calls == [("", "W")]
    assert result.placements[("", "W")] == [BlobPlacement(0, 1200), BlobPlacement(0, 1200)]
    assert extras.seen == result.placements
    data = open(result.data_path, "rb").read()
    assert data == shared.tobytes()
    saved = onnx.load(str(tmp_path / "s.onnx"), load_external_data=False)
    assert saved.graph.initializer[0].data_location == TensorProto.DEFAULT
    assert {p.key: p.value for p in saved.metadata_props} == {"onnxpack.prepacked//W": "new",
                                                              "other": "x"}


def test_stale_prepacked_keys_and_metadata_dropped_unknown_kept(tmp_path):
    w = np.arange(1024, dtype=np.float32)
    (tmp_path / "w.bin").write_bytes(b"\0" * 128 + w.tobytes())
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[1024])
    t.data_location = TensorProto.EXTERNAL
    for k, v in [("location", "w.bin"), ("offset", "128"), ("length", "4096"),
                 ("checksum", "abc"), ("prepacked_weights", "0:123"), ("vendor_key", "keep")]:
        e = t.external_data.add()
        e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024])], [t])
    m = helper.make_model(g)
    helper.set_model_props(m, {"onnxpack.prepacked//W": "stale", "author": "me"})
    (tmp_path / "in.onnx").write_bytes(m.SerializeToString())
    save_model(load_model(tmp_path / "in.onnx"), tmp_path / "out.onnx")
    saved = onnx.ModelProto.FromString((tmp_path / "out.onnx").read_bytes())
    keys = [(e.key, e.value) for e in saved.graph.initializer[0].external_data]
    assert [k for k, _ in keys] == ["location", "offset", "length", "checksum", "vendor_key"]
    assert {p.key: p.value for p in saved.metadata_props} == {"author": "me"}
    np.testing.assert_array_equal(load_model(tmp_path / "out.onnx").root.initializers["W"].numpy(), w)


def _digest(folder) -> dict[str, str]:
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest()
            for f in sorted(os.listdir(folder)) if not f.startswith(".")}


def test_save_over_input_never_modifies_it(samples, tmp_path, build_module):
    import shutil

    for f in ("mlp.onnx", "mlp.onnx.data"):
        shutil.copy(os.path.join(os.path.dirname(samples["mlp"]), f), tmp_path / f)
    before = _digest(tmp_path)
    inode_before = os.stat(tmp_path / "mlp.onnx.data").st_ino
    model = load_model(tmp_path / "mlp.onnx")
    w1 = model.root.initializers["W1"].numpy()
    w1_copy = np.array(w1)
    # Same model path, same data file name: the data goes to an alternate name (A/B)
    result = save_model(model, tmp_path / "mlp.onnx", location="mlp.onnx.data", min_size=64)
    assert result.location == "mlp.onnx.1.data"
    assert _digest(tmp_path)["mlp.onnx.data"] == before["mlp.onnx.data"]
    assert os.stat(tmp_path / "mlp.onnx.data").st_ino == inode_before
    np.testing.assert_array_equal(w1, w1_copy)  # live view still valid
    # Saving in place again never replaces a file: mlp.onnx.data may still be another model's
    # (issue 12: a second in-place save replaced it), so a fresh name is used and both stay.
    first_data = _digest(tmp_path)["mlp.onnx.1.data"]
    again = save_model(load_model(tmp_path / "mlp.onnx"), tmp_path / "mlp.onnx", min_size=64)
    assert again.location == "mlp.onnx.2.data"
    after = _digest(tmp_path)
    assert after["mlp.onnx.data"] == before["mlp.onnx.data"] and after["mlp.onnx.1.data"] == first_data
    import onnxruntime as ort

    feeds = build_module.sample_inputs("mlp")
    a = ort.InferenceSession(samples["mlp"], providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(str(tmp_path / "mlp.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(a[0], b[0])


def test_other_output_sharing_data_name_does_not_touch_input(samples, tmp_path):
    import shutil

    for f in ("cnn.onnx", "cnn.onnx.data"):
        shutil.copy(os.path.join(os.path.dirname(samples["cnn"]), f), tmp_path / f)
    before = _digest(tmp_path)
    result = save_model(load_model(tmp_path / "cnn.onnx"), tmp_path / "other.onnx",
                        location="cnn.onnx.data")
    assert result.location == "cnn.onnx.1.data"
    after = _digest(tmp_path)
    assert all(after[f] == h for f, h in before.items())


@pytest.mark.parametrize("kwargs", [{"min_size": -1}, {"align_threshold": "x"},
                                    {"allocation_granularity": 0}, {"location": "../x.data"},
                                    {"location": "/abs.data"}, {"location": "m.onnx"}])
def test_bad_arguments(samples, tmp_path, kwargs):
    with pytest.raises(InvalidArgument):
        save_model(load_model(samples["mlp"]), tmp_path / "m.onnx", **kwargs)
