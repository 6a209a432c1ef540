"""load_model, Tensor views, scopes and the bottom-up walker."""

from __future__ import annotations

import math
import mmap

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpack.errors import ExternalDataError, ModelLoadError
from onnxpack.graph import Model, load_model, save_model, walk


def _all_initializers(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    out = {}

    def visit(g):
        for t in g.initializer:
            out[t.name] = numpy_helper.to_array(t)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    visit(a.g)
                for sub in a.graphs:
                    visit(sub)

    visit(proto.graph)
    return out


def _buffer_owner(arr):
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


@pytest.mark.parametrize("name", ["mlp", "cnn", "subgraphs", "transformer", "fp16_mlp",
                                  "shared_weight"])
def test_sample_initializers_are_zero_copy_views(samples, build_module, name):
    model = load_model(samples[name])
    expected = _all_initializers(build_module.SAMPLES[name]())
    got = {k: v for s in model.scopes() for k, v in s.initializers.items()}
    assert set(got) == set(expected)
    for k, t in got.items():
        arr = t.numpy()
        assert arr.dtype == expected[k].dtype and arr.shape == expected[k].shape
        np.testing.assert_array_equal(arr, expected[k])
        assert not arr.flags.writeable
        if t.external is not None:
            assert isinstance(_buffer_owner(arr), mmap.mmap), f"{k} is not a view over the mapping"
            assert t.external.offset % 64 == 0
            assert t.nbytes == t.external.length == expected[k].nbytes


def test_each_file_mapped_once(samples):
    model = load_model(samples["transformer"])
    tensors = [t for t in model.root.initializers.values() if t.external is not None]
    assert len(tensors) > 3
    bases = set()
    for t in tensors:
        bases.add(id(_buffer_owner(t.numpy())))
    assert len(bases) == 1
    assert len({t.external.file_id for t in tensors}) == 1


DTYPE_CASES = [
    (TensorProto.FLOAT, np.float32), (TensorProto.DOUBLE, np.float64),
    (TensorProto.FLOAT16, np.float16), (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
    (TensorProto.INT8, np.int8), (TensorProto.UINT8, np.uint8), (TensorProto.INT16, np.int16),
    (TensorProto.UINT16, np.uint16), (TensorProto.INT32, np.int32), (TensorProto.INT64, np.int64),
    (TensorProto.UINT32, np.uint32), (TensorProto.UINT64, np.uint64), (TensorProto.BOOL, np.bool_),
    (TensorProto.COMPLEX64, np.complex64), (TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn),
    (TensorProto.INT4, ml_dtypes.int4), (TensorProto.UINT4, ml_dtypes.uint4),
]


def _sample_array(dtype, shape=(3, 5)):
    rng = np.random.default_rng(0)
    if dtype in (ml_dtypes.int4,):
        return rng.integers(-8, 8, shape).astype(dtype)
    if dtype in (ml_dtypes.uint4,):
        return rng.integers(0, 16, shape).astype(dtype)
    if dtype is np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, 100, shape).astype(dtype)
    return (rng.standard_normal(shape) * 2).astype(dtype)


def _identity_model(tensors: list[TensorProto]) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", [t.name], [t.name + "_out"]) for t in tensors]
    outs = [helper.make_tensor_value_info(t.name + "_out", t.data_type, list(t.dims))
            for t in tensors]
    g = helper.make_graph(nodes, "g", [], outs, tensors)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("ai.onnx", 21)])


@pytest.mark.parametrize("elem,dtype", DTYPE_CASES,
                         ids=[TensorProto.DataType.Name(e) for e, _ in DTYPE_CASES])
@pytest.mark.parametrize("storage", ["external", "raw", "typed"])
def test_dtypes(tmp_path, elem, dtype, storage):
    arr = _sample_array(dtype)
    if storage == "typed":
        t = helper.make_tensor("t", elem, arr.shape, arr.reshape(-1).tolist()
                               if elem not in (TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN,
                                               TensorProto.FLOAT16)
                               else arr.astype(np.float32).reshape(-1).tolist())
    else:
        t = numpy_helper.from_array(arr, "t")
    expected = numpy_helper.to_array(t)
    proto = _identity_model([t])
    if storage == "external":
        save_model(proto, tmp_path / "m.onnx", min_size=1)
        model = load_model(tmp_path / "m.onnx")
    else:
        model = load_model(proto.SerializeToString())
    tensor = model.root.initializers["t"]
    assert (tensor.external is not None) == (storage == "external")
    got = tensor.numpy()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got.view(np.uint8) if got.dtype.itemsize == 1 and elem not in (
        TensorProto.INT4, TensorProto.UINT4, TensorProto.BOOL) else got, expected.view(np.uint8)
        if got.dtype.itemsize == 1 and elem not in (TensorProto.INT4, TensorProto.UINT4,
                                                    TensorProto.BOOL) else expected)
    assert bytes(tensor.raw()) == numpy_helper.from_array(expected, "t").raw_data
    assert not got.flags.writeable


def test_strings_stay_in_proto(tmp_path):
    t = numpy_helper.from_array(np.array(["a", "bcd" * 500], dtype=object), "s")
    save_model(_identity_model([t]), tmp_path / "m.onnx", min_size=1)
    model = load_model(tmp_path / "m.onnx")
    s = model.root.initializers["s"]
    assert s.external is None
    assert list(s.numpy()) == ["a", "bcd" * 500]


def test_opsets_normalized():
    model = load_model(_identity_model([numpy_helper.from_array(np.ones(2, np.float32), "t")])
                       .SerializeToString())
    assert model.opsets == {"": 21}


def test_bytes_without_base_dir_refuses_external(samples):
    with open(samples["mlp"], "rb") as f:
        data = f.read()
    with pytest.raises(ExternalDataError, match="base_dir"):
        load_model(data)
    import os

    model = load_model(data, base_dir=os.path.dirname(samples["mlp"]))
    assert model.path is None
    assert model.root.initializers["W1"].numpy().shape == (64, 256)


def test_garbage_is_model_load_error(tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(b"\xff\xff\xff\xffnot a model")
    with pytest.raises(ModelLoadError):
        load_model(p)
    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "missing.onnx")


def test_close_keeps_live_views(samples):
    model = load_model(samples["mlp"])
    arr = model.root.initializers["W1"].numpy()
    copy = np.array(arr)
    model.close()
    del model
    np.testing.assert_array_equal(arr, copy)


def test_scopes_paths_order_and_outer_refs(samples):
    model = load_model(samples["subgraphs"])
    order = [s.path for s in model.scopes()]
    # children follow node order, then attribute order (make_node sorts: else before then)
    assert order == [
        "/top_if.else_branch",
        "/top_if.then_branch/inner_loop.body",
        "/top_if.then_branch",
        "/top_loop.body/body_if.else_branch",
        "/top_loop.body/body_if.then_branch",
        "/top_loop.body",
        "",
    ]
    seen = set()
    for s in model.scopes():  # bottom-up: every child was yielded before its parent
        assert all(c.path in seen for c in s.children)
        seen.add(s.path)
    by_path = {s.path: s for s in model.scopes()}
    root = model.root
    assert by_path[""] is root and root.parent is None and root.owner is None
    inner = by_path["/top_if.then_branch/inner_loop.body"]
    assert inner.owner.name == "inner_loop" and inner.parent.path == "/top_if.then_branch"
    assert inner.outer_refs == {"W_loop": root}
    assert set(inner.initializers) == {"D_body"}
    assert by_path["/top_if.then_branch"].outer_refs == {"W_loop": root}
    assert by_path["/top_if.else_branch"].outer_refs == {"W_else": root}
    assert by_path["/top_loop.body"].outer_refs == {"B_if": root}
    assert by_path["/top_loop.body/body_if.then_branch"].outer_refs == {"B_if": root}
    assert root.outer_refs == {}
    assert inner.lookup_initializer("W_loop") is root.initializers["W_loop"]
    assert inner.lookup_initializer("D_body") is inner.initializers["D_body"]
    assert inner.lookup_initializer("nope") is None


def test_shadowing_and_duplicate_names():
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "W")
    # inner graph defines "W" as a node output -> the outer initializer is shadowed
    inner = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["W"]),
         helper.make_node("Add", ["W", "W"], ["o"])],
        "inner", [], [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 2])])
    other = helper.make_graph(
        [helper.make_node("Add", ["W", "x"], ["o2"])],
        "other", [], [helper.make_tensor_value_info("o2", TensorProto.FLOAT, [2, 2])])
    nodes = [helper.make_node("If", ["c"], ["y"], name="dup", then_branch=inner, else_branch=other),
             helper.make_node("If", ["c"], ["z"], name="dup", then_branch=other, else_branch=inner)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                       helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], [w])
    model = Model(helper.make_model(g))
    paths = [s.path for s in model.scopes()]
    assert paths == ["/#0.else_branch", "/#0.then_branch", "/#1.else_branch", "/#1.then_branch", ""]
    s = {p: sc for p, sc in zip(paths, model.scopes())}
    assert s["/#0.then_branch"].outer_refs == {}
    assert s["/#0.then_branch"].lookup_initializer("W") is None
    assert s["/#0.else_branch"].outer_refs == {"W": model.root}
    assert s["/#0.else_branch"].lookup_initializer("W") is model.root.initializers["W"]


def test_graphs_attribute_and_deep_nesting():
    depth = 12  # protobuf (upb) caps message nesting at ~100 levels; 12 graphs = 48 levels
    body = helper.make_graph([helper.make_node("Add", ["x", "W"], ["o"])], "leaf", [],
                             [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])])
    leaf = body
    for i in range(depth):
        node = helper.make_node("Custom", [], ["o"], name=f"n{i}", domain="x.y")
        node.attribute.append(helper.make_attribute("gs", [body, leaf]))
        body = helper.make_graph([node], f"g{i}", [],
                                 [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])])
    body.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), "W"))
    model = Model(helper.make_model(body))
    scopes = list(walk(model.root))
    assert len(scopes) == 2 * depth + 1
    assert scopes[-1] is model.root
    assert scopes[0].path == "".join(f"/n{i}.gs[0]" for i in reversed(range(depth)))
    assert scopes[0].outer_refs == {"W": model.root}
    assert len({s.path for s in scopes}) == len(scopes)


def test_sparse_initializer_dense():
    values = numpy_helper.from_array(np.array([1.5, 2.5], np.float32), "S")
    indices = numpy_helper.from_array(np.array([1, 5], np.int64), "S_idx")
    sp = helper.make_sparse_tensor(values, indices, [2, 3])
    g = helper.make_graph([helper.make_node("Identity", ["S"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    g.sparse_initializer.append(sp)
    model = Model(helper.make_model(g))
    np.testing.assert_array_equal(model.root.initializers["S"].numpy(),
                                  [[0, 1.5, 0], [0, 0, 2.5]])


@pytest.mark.parametrize("elem_type,values", [
    (TensorProto.FLOAT, [1.5, -2.25, 3e-8]), (TensorProto.DOUBLE, [1.5, 2.0, -1e300]),
    (TensorProto.INT64, [1, -2, 2**40]), (TensorProto.INT32, [3, -4, 2**30]),
    (TensorProto.INT8, [-128, 0, 127]), (TensorProto.UINT8, [0, 7, 255]),
])
@pytest.mark.parametrize("dims", [[3], [1, 3]])
def test_typed_field_tensors_read_as_numpy_helper_reads_them(elem_type, values, dims):
    from onnxpack.graph._tensor import Tensor

    t = helper.make_tensor("t", elem_type, dims, values)
    assert not t.HasField("raw_data")
    got, want = Tensor(t, None).numpy(), numpy_helper.to_array(t)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert not got.flags.writeable


def _text_model() -> onnx.ModelProto:
    """A model with text in every kind of place: value infos, a subgraph, a function, attributes,
    external-data entries, metadata."""
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"], name="then_node")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, ["batch"])])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu", doc_string="doc"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=then),
             helper.make_node("Fn", ["r"], ["z"], domain="local", name="call")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch"]),
                                       helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch"])],
                          value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, ["batch"])])
    fn = onnx.FunctionProto(name="Fn", domain="local", input=["a"], output=["b"],
                            node=[helper.make_node("Neg", ["a"], ["b"], name="neg")],
                            opset_import=[helper.make_opsetid("", 17)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                          functions=[fn], producer_name="prod")
    helper.set_model_props(m, {"meta": "value"})
    return m


# Every place names one marker: replaced by invalid UTF-8 in the serialized bytes.
_TEXT_PLACES = {
    "node name": lambda m: setattr(m.graph.node[0], "name", "MARK"),
    "node doc": lambda m: setattr(m.graph.node[0], "doc_string", "MARK"),
    "value info": lambda m: setattr(m.graph.value_info[0], "name", "MARK"),
    "dim param": lambda m: setattr(m.graph.value_info[0].type.tensor_type.shape.dim[0], "dim_param", "MARK"),
    "subgraph node": lambda m: setattr(m.graph.node[1].attribute[0].g.node[0], "name", "MARK"),
    "function node": lambda m: setattr(m.functions[0].node[0], "name", "MARK"),
    "metadata value": lambda m: setattr(m.metadata_props[0], "value", "MARK"),
    "producer": lambda m: setattr(m, "producer_name", "MARK"),
    "attribute ref": lambda m: m.graph.node[0].attribute.add(name="alpha", ref_attr_name="MARK",
                                                             type=onnx.AttributeProto.FLOAT),
}


@pytest.mark.parametrize("place", list(_TEXT_PLACES), ids=list(_TEXT_PLACES))
@pytest.mark.parametrize("mirror", [True, False], ids=["mirror", "walk"])
def test_invalid_utf8_in_any_text_field_is_a_model_load_error(place, mirror, monkeypatch):
    # protobuf parses ONNX's proto2 strings without checking them; load_model asks a proto3 twin
    # of the schema (checked in C), and walks the fields to name the bad one when it refuses, or
    # when this protobuf has no usable twin.
    from onnxpack.graph import _model

    if not mirror:
        monkeypatch.setattr(_model, "_mirror", [None])
    m = _text_model()
    good = m.SerializeToString()
    assert _model._valid_utf8(good) is mirror
    load_model(good)  # the intact model loads
    _TEXT_PLACES[place](m)
    data = m.SerializeToString()
    assert data.count(b"MARK") == 1
    bad = data.replace(b"MARK", b"MA\xc3(")  # a lead byte followed by ASCII: not UTF-8
    assert not _model._valid_utf8(bad)
    with pytest.raises(ModelLoadError, match="not valid UTF-8"):
        load_model(bad)


def test_the_utf8_twin_parses_what_onnx_parses():
    # The twin only answers "every string is UTF-8": a valid model with non-ASCII text, unknown
    # fields and an enum value this onnx does not know still passes it.
    from onnxpack.graph import _model

    m = _text_model()
    m.graph.node[0].name = "relu-ü-€-😀"
    m.graph.value_info[0].type.tensor_type.elem_type = 999  # not a TensorProto.DataType
    data = m.SerializeToString() + b"\xf8\x07\x05"  # field 127, varint 5: unknown to the schema
    assert _model._valid_utf8(data)
    assert load_model(data).proto.graph.node[0].name == "relu-ü-€-😀"



@pytest.mark.parametrize("elem_type,value,in_range", [
    (TensorProto.FLOAT, 0.03571455180644989, True), (TensorProto.FLOAT, float("nan"), True),
    (TensorProto.FLOAT, -0.0, True), (TensorProto.DOUBLE, -1e300, True), (TensorProto.INT64, -(2**40), True),
    (TensorProto.INT32, 2**30, True), (TensorProto.INT8, -128, True), (TensorProto.INT8, 200, False),
    (TensorProto.UINT8, 255, True), (TensorProto.UINT8, 300, False),
], ids=["f32", "f32-nan", "f32-negzero", "f64", "i64", "i32", "i8", "i8-wraps", "u8", "u8-wraps"])
@pytest.mark.parametrize("dims", [[], [1], [1, 1]], ids=["0d", "1", "1x1"])
def test_one_value_typed_tensors_read_as_the_many_value_path_reads_them(elem_type, value, in_range, dims):
    # One stored value takes a shortcut (a QDQ model's scales and zero points); its array must be
    # the general conversion's, bit for bit: same dtype, shape and bytes, out-of-range int8/uint8
    # values wrapped the same way, read-only.
    from onnxpack.graph._tensor import _TYPED_NUMPY, Tensor

    t = TensorProto(name="t", data_type=elem_type, dims=dims)
    field, storage = _TYPED_NUMPY[elem_type]
    getattr(t, field).append(value)
    got = Tensor(t, None).numpy()
    want = np.asarray(getattr(t, field), dtype=storage).astype(got.dtype).reshape(dims)
    assert got.dtype == want.dtype == helper.tensor_dtype_to_np_dtype(elem_type)
    assert got.shape == want.shape == tuple(dims)
    assert got.tobytes() == want.tobytes()
    assert not got.flags.writeable
    if in_range:
        np.testing.assert_array_equal(got, numpy_helper.to_array(t))


@pytest.mark.parametrize("dims", [[], [3], [2, 5], [0], [4, 0, 2**62], [2**31, 2**31], [2**61, 2], [2**30, 0, 2**40],
                                  [1] * 9, [7, 2**59]])
@pytest.mark.parametrize("elem_type", [TensorProto.FLOAT, TensorProto.INT4, TensorProto.BOOL, TensorProto.DOUBLE],
                         ids=["f32", "int4", "bool", "f64"])
def test_tensor_accepts_exactly_the_shapes_that_fit_and_sizes_them_as_storage_nbytes(dims, elem_type):
    # Tensor computes the element count once for its checks; what it accepts and the size it
    # records must be shape_fits' and storage_nbytes' own answers.
    from onnxpack.graph._tensor import Tensor, shape_fits, storage_nbytes

    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    t = TensorProto(name="t", data_type=elem_type, dims=dims)
    t.data_location = TensorProto.EXTERNAL  # no data needed to decide the shape
    if not shape_fits(tuple(dims), dtype.itemsize):
        with pytest.raises(ModelLoadError, match="too large for any array"):
            Tensor(t, None)
        return
    with pytest.raises(ExternalDataError, match="no data folder"):  # past the shape checks
        Tensor(t, None)
    t.data_location = TensorProto.DEFAULT
    t.raw_data = b"\0" * storage_nbytes(elem_type, tuple(dims), dtype) if math.prod(dims) < 2**20 else b""
    if math.prod(dims) < 2**20:
        assert Tensor(t, None).nbytes == storage_nbytes(elem_type, tuple(dims), dtype)


def test_views_sliced_from_one_byte_array_equal_frombuffer_views(tmp_path):
    """mapped_view over graph.byte_array of a read-only mapping: the same values as a view
    made by np.frombuffer, read-only, alive after the mapping's other references are gone;
    writable and empty buffers get no byte array."""
    from onnxpack.graph import byte_array, mapped_view

    data = np.arange(1024, dtype=np.float32)
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(64) + data.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    whole = byte_array(mm)
    assert whole is not None and whole.dtype == np.uint8 and whole.size == 64 + data.nbytes
    view = mapped_view(whole, "<f4", (32, 32), 64)
    direct = mapped_view(mm, np.dtype("<f4"), (32, 32), 64)
    assert view.shape == (32, 32) and view.dtype == np.float32
    assert np.array_equal(view, direct) and np.array_equal(view.reshape(-1), data)
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0, 0] = 1.0
    assert mapped_view(whole, np.float32, (0, 3), 64).shape == (0, 3)
    del whole, direct
    with pytest.raises(BufferError):  # the view still holds the mapping
        mm.close()
    assert float(view[31, 31]) == 1023.0
    del view
    mm.close()
    assert byte_array(bytearray(8)) is None  # writable: views must stay read-only
    assert byte_array(b"") is None


def test_drop_pages_only_advises_bytes_that_were_handed_out(samples):
    """A mapped tensor whose bytes nobody asked for has no pages of ours to drop (a warm start
    never reads its packed weights): no madvise; once raw() or numpy() handed them out, it does."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        pytest.skip("no madvise on this platform")
    model = load_model(samples["mlp"])
    tensors = [t for t in model.root.initializers.values() if t.external is not None and t.nbytes >= 2 * mmap.PAGESIZE]
    assert len(tensors) >= 2
    first, second = tensors[:2]
    assert first.drop_pages() is False and second.drop_pages() is False
    before = np.array(first.numpy())
    assert first.drop_pages() is True
    np.testing.assert_array_equal(first.numpy(), before)  # the pages fault back in from the file
    bytes(second.raw()[:16])
    assert second.drop_pages() is True
    model.close()
