"""Build onnxpack's sample models (deterministic) and large benchmark models on demand.

Usage::

    python models/build.py [OUT_DIR]      # default: the folder of this script

Each sample ``<name>.onnx`` is written with its initializers in ``<name>.onnx.data`` through
``onnxpack.graph.save_model`` (``min_size=1024``), so the committed files exercise our own
aligned layout.  :func:`sample_inputs` gives deterministic feeds for each model.

onnx's "light" models (``onnx/backend/test/data/light``) ship without weights: every weight is a
``ConstantOfShape`` of 0.02 fed by a shape initializer, so any runtime that gets the graph
plumbing right passes them no matter what its Conv or Gemm does.  :func:`materialize_light_model`
and :func:`write_light_model` give them real, seeded random weights (used by the tests and the
benchmarks alike); :func:`light_inputs` gives their feeds.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "SAMPLES", "build_all", "build_sample", "sample_inputs", "make_matmul_chain",
    "LIGHT_DIR", "light_model_names", "materialize_light_model", "write_light_model", "light_inputs",
]

OPSET = 17  # LayerNormalization needs 17; onnxruntime and onnx.reference both support it
IR_VERSION = 9  # what onnxruntime 1.18+ reads; newer IR adds nothing these models use


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(sum(map(ord, name)) * 7919)


def _w(rng, shape, dtype=np.float32, scale=None):
    scale = scale if scale is not None else 1.0 / math.sqrt(shape[0] if len(shape) > 1 else 1)
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                          producer_name="onnxpack-models")
    m.ir_version = IR_VERSION
    return m


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


F = TensorProto.FLOAT


def mlp() -> onnx.ModelProto:
    r = _rng("mlp")
    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("W1", _w(r, (64, 256))), ("b1", _w(r, (256,), scale=0.1)),
        ("W2", _w(r, (256, 128))), ("b2", _w(r, (128,), scale=0.1)),
        ("W3", _w(r, (128, 10))), ("b3", _w(r, (10,), scale=0.1))]]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"], name="fc1"),
        helper.make_node("Add", ["h1", "b1"], ["h1b"], name="fc1_bias"),
        helper.make_node("Relu", ["h1b"], ["a1"], name="relu1"),
        helper.make_node("Gemm", ["a1", "W2", "b2"], ["h2"], name="fc2"),
        helper.make_node("Relu", ["h2"], ["a2"], name="relu2"),
        helper.make_node("MatMul", ["a2", "W3"], ["h3"], name="fc3"),
        helper.make_node("Add", ["h3", "b3"], ["h3b"], name="fc3_bias"),
        helper.make_node("Softmax", ["h3b"], ["y"], name="softmax", axis=-1),
    ]
    g = helper.make_graph(nodes, "mlp", [_vi("x", F, [4, 64])], [_vi("y", F, [4, 10])], inits)
    return _model(g)


def cnn() -> onnx.ModelProto:
    r = _rng("cnn")
    arrays = [
        ("C1", _w(r, (16, 3, 3, 3), scale=0.2)), ("C1b", _w(r, (16,), scale=0.1)),
        ("bn_scale", (1 + 0.1 * r.standard_normal(16)).astype(np.float32)),
        ("bn_bias", _w(r, (16,), scale=0.1)),
        ("bn_mean", _w(r, (16,), scale=0.1)),
        ("bn_var", (1 + 0.2 * r.random(16)).astype(np.float32)),
        ("C2", _w(r, (32, 16, 3, 3), scale=0.1)), ("C2b", _w(r, (32,), scale=0.1)),
        ("FC", _w(r, (32, 10))), ("FCb", _w(r, (10,), scale=0.1)),
        ("shape", np.array([1, 32], dtype=np.int64)),
    ]
    inits = [numpy_helper.from_array(a, n) for n, a in arrays]
    nodes = [
        helper.make_node("Conv", ["x", "C1", "C1b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
                         ["bn1"], name="bn1", epsilon=1e-5),
        helper.make_node("Relu", ["bn1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="maxpool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p1", "C2", "C2b"], ["c2"], name="conv2", pads=[1, 1, 1, 1],
                         strides=[1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("AveragePool", ["r2"], ["p2"], name="avgpool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p2"], ["gap"], name="gap"),
        helper.make_node("Reshape", ["gap", "shape"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "FC", "FCb"], ["y"], name="fc"),
    ]
    g = helper.make_graph(nodes, "cnn", [_vi("x", F, [1, 3, 16, 16])], [_vi("y", F, [1, 10])],
                          inits)
    return _model(g)


def subgraphs() -> onnx.ModelProto:
    """If and Loop bodies nested two deep consuming root (outer-scope) initializers.

    root: If(cond) -> then: Loop(M) whose body uses root W_loop (2 deep) and its own initializer
    D_body; else: MatMul with root W_else.  Then a root Loop(M) whose body holds an If whose
    branches use root B_if (2 deep).  W_loop, W_else and B_if are consumed only inside subgraphs.
    """
    r = _rng("subgraphs")
    d = 32
    root_inits = [numpy_helper.from_array(a, n) for n, a in [
        ("W_loop", _w(r, (d, d))), ("W_else", _w(r, (d, d))), ("B_if", _w(r, (d,), scale=0.1)),
        ("W_root", _w(r, (d, d)))]]
    # Loop body (inside If.then): carried v -> Tanh(v @ W_loop + D_body)
    loop_body = helper.make_graph(
        [helper.make_node("MatMul", ["v_in", "W_loop"], ["mm"], name="body_mm"),
         helper.make_node("Add", ["mm", "D_body"], ["mmb"], name="body_add"),
         helper.make_node("Tanh", ["mmb"], ["v_out"], name="body_tanh"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "loop_body",
        [_vi("i", TensorProto.INT64, []), _vi("cond_in", TensorProto.BOOL, []),
         _vi("v_in", F, [1, d])],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("v_out", F, [1, d])],
        [numpy_helper.from_array(_w(r, (1, d), scale=0.1), "D_body")])
    then_g = helper.make_graph(
        [helper.make_node("Loop", ["M", "cond", "x"], ["loop_v"], name="inner_loop", body=loop_body)],
        "then", [], [_vi("loop_v", F, [1, d])])
    else_g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W_else"], ["else_v"], name="else_mm")],
        "else", [], [_vi("else_v", F, [1, d])])
    # Root Loop whose body holds an If using B_if.
    if_then = helper.make_graph([helper.make_node("Add", ["w_in", "B_if"], ["t_out"], name="t_add")],
                                "if_then", [], [_vi("t_out", F, [1, d])])
    if_else = helper.make_graph([helper.make_node("Sub", ["w_in", "B_if"], ["e_out"], name="e_sub")],
                                "if_else", [], [_vi("e_out", F, [1, d])])
    body2 = helper.make_graph(
        [helper.make_node("If", ["cond"], ["w_out"], name="body_if", then_branch=if_then,
                          else_branch=if_else),
         helper.make_node("Identity", ["c_in"], ["c_out"], name="body2_cond")],
        "loop2_body",
        [_vi("j", TensorProto.INT64, []), _vi("c_in", TensorProto.BOOL, []),
         _vi("w_in", F, [1, d])],
        [_vi("c_out", TensorProto.BOOL, []), _vi("w_out", F, [1, d])])
    nodes = [
        helper.make_node("If", ["cond"], ["if_y"], name="top_if", then_branch=then_g,
                         else_branch=else_g),
        helper.make_node("MatMul", ["if_y", "W_root"], ["z"], name="root_mm"),
        helper.make_node("Loop", ["M", "cond", "z"], ["y"], name="top_loop", body=body2),
    ]
    g = helper.make_graph(
        nodes, "subgraphs",
        [_vi("x", F, [1, d]), _vi("cond", TensorProto.BOOL, []), _vi("M", TensorProto.INT64, [])],
        [_vi("y", F, [1, d])], root_inits)
    return _model(g)


def transformer() -> onnx.ModelProto:
    r = _rng("transformer")
    s, d, h, ff = 8, 64, 4, 256
    hd = d // h
    arrays = [
        ("ln1_s", (1 + 0.1 * r.standard_normal(d)).astype(np.float32)),
        ("ln1_b", _w(r, (d,), scale=0.1)),
        ("Wq", _w(r, (d, d))), ("Wk", _w(r, (d, d))), ("Wv", _w(r, (d, d))), ("Wo", _w(r, (d, d))),
        ("ln2_s", (1 + 0.1 * r.standard_normal(d)).astype(np.float32)),
        ("ln2_b", _w(r, (d,), scale=0.1)),
        ("W1", _w(r, (d, ff))), ("b1", _w(r, (ff,), scale=0.1)),
        ("W2", _w(r, (ff, d))), ("b2", _w(r, (d,), scale=0.1)),
        ("heads_shape", np.array([1, s, h, hd], dtype=np.int64)),
        ("model_shape", np.array([1, s, d], dtype=np.int64)),
        ("att_scale", np.array(1 / math.sqrt(hd), dtype=np.float32)),
        ("half", np.array(0.5, dtype=np.float32)), ("one", np.array(1.0, dtype=np.float32)),
        ("rsqrt2", np.array(1 / math.sqrt(2), dtype=np.float32)),
    ]
    inits = [numpy_helper.from_array(a, n) for n, a in arrays]
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln1_s", "ln1_b"], ["ln1"], name="ln1", axis=-1, epsilon=1e-5),
        n("MatMul", ["ln1", "Wq"], ["q"], name="q"), n("MatMul", ["ln1", "Wk"], ["k"], name="k"),
        n("MatMul", ["ln1", "Wv"], ["v"], name="v"),
        n("Reshape", ["q", "heads_shape"], ["qh"], name="q_r"),
        n("Reshape", ["k", "heads_shape"], ["kh"], name="k_r"),
        n("Reshape", ["v", "heads_shape"], ["vh"], name="v_r"),
        n("Transpose", ["qh"], ["qt"], name="q_t", perm=[0, 2, 1, 3]),
        n("Transpose", ["kh"], ["kt"], name="k_t", perm=[0, 2, 3, 1]),
        n("Transpose", ["vh"], ["vt"], name="v_t", perm=[0, 2, 1, 3]),
        n("MatMul", ["qt", "kt"], ["scores"], name="qk"),
        n("Mul", ["scores", "att_scale"], ["scaled"], name="scale"),
        n("Softmax", ["scaled"], ["probs"], name="softmax", axis=-1),
        n("MatMul", ["probs", "vt"], ["ctx"], name="pv"),
        n("Transpose", ["ctx"], ["ctx_t"], name="ctx_t", perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx_t", "model_shape"], ["ctx_r"], name="ctx_r"),
        n("MatMul", ["ctx_r", "Wo"], ["att"], name="o"),
        n("Add", ["x", "att"], ["res1"], name="res1"),
        n("LayerNormalization", ["res1", "ln2_s", "ln2_b"], ["ln2"], name="ln2", axis=-1,
          epsilon=1e-5),
        n("MatMul", ["ln2", "W1"], ["f1"], name="ff1"), n("Add", ["f1", "b1"], ["f1b"], name="ff1b"),
        # GELU(x) = 0.5 * x * (1 + erf(x / sqrt(2)))
        n("Mul", ["f1b", "rsqrt2"], ["g0"], name="gelu_div"), n("Erf", ["g0"], ["g1"], name="erf"),
        n("Add", ["g1", "one"], ["g2"], name="gelu_add"),
        n("Mul", ["f1b", "g2"], ["g3"], name="gelu_mul"),
        n("Mul", ["g3", "half"], ["gelu"], name="gelu_half"),
        n("MatMul", ["gelu", "W2"], ["f2"], name="ff2"), n("Add", ["f2", "b2"], ["f2b"], name="ff2b"),
        n("Add", ["res1", "f2b"], ["y"], name="res2"),
    ]
    g = helper.make_graph(nodes, "transformer", [_vi("x", F, [1, s, d])], [_vi("y", F, [1, s, d])],
                          inits)
    return _model(g)


def fp16_mlp() -> onnx.ModelProto:
    r = _rng("fp16_mlp")
    H = TensorProto.FLOAT16
    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("W1h", _w(r, (64, 128), np.float16)), ("b1h", _w(r, (128,), np.float16, scale=0.1)),
        ("W2h", _w(r, (128, 16), np.float16))]]
    nodes = [
        helper.make_node("Cast", ["W1h"], ["W1"], name="cast_w1", to=F),
        helper.make_node("Cast", ["b1h"], ["b1"], name="cast_b1", to=F),
        helper.make_node("MatMul", ["x", "W1"], ["h1"], name="fc1"),
        helper.make_node("Add", ["h1", "b1"], ["h1b"], name="fc1_bias"),
        helper.make_node("Relu", ["h1b"], ["a1"], name="relu"),
        helper.make_node("Cast", ["a1"], ["a1h"], name="to_fp16", to=H),
        helper.make_node("MatMul", ["a1h", "W2h"], ["h2h"], name="fc2_fp16"),
        helper.make_node("Cast", ["h2h"], ["y"], name="to_fp32", to=F),
    ]
    g = helper.make_graph(nodes, "fp16_mlp", [_vi("x", F, [2, 64])], [_vi("y", F, [2, 16])], inits)
    return _model(g)


def shared_weight() -> onnx.ModelProto:
    r = _rng("shared_weight")
    inits = [numpy_helper.from_array(_w(r, (48, 48)), "W")]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("MatMul", ["a", "W"], ["y"], name="second"),
    ]
    g = helper.make_graph(nodes, "shared_weight", [_vi("x", F, [3, 48])], [_vi("y", F, [3, 48])],
                          inits)
    return _model(g)


SAMPLES: dict[str, Callable[[], onnx.ModelProto]] = {
    "mlp": mlp,
    "cnn": cnn,
    "subgraphs": subgraphs,
    "transformer": transformer,
    "fp16_mlp": fp16_mlp,
    "shared_weight": shared_weight,
}


def sample_inputs(name: str, model: onnx.ModelProto | None = None) -> dict[str, np.ndarray]:
    """Deterministic feeds for sample ``name``."""
    model = model if model is not None else SAMPLES[name]()
    r = np.random.default_rng(12345)
    feeds = {}
    for vi in model.graph.input:
        t = vi.type.tensor_type
        shape = [dim.dim_value for dim in t.shape.dim]
        if t.elem_type == TensorProto.BOOL:
            feeds[vi.name] = np.array(True)
        elif t.elem_type == TensorProto.INT64:
            feeds[vi.name] = np.array(3, dtype=np.int64)
        else:
            feeds[vi.name] = r.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(t.elem_type))
    return feeds


def build_sample(name: str, out_dir: str) -> str:
    """Writes sample ``name`` to ``out_dir/<name>.onnx`` (+ ``.onnx.data``); returns the path."""
    from onnxpack.graph import save_model

    path = os.path.join(out_dir, f"{name}.onnx")
    # Generated files: start clean so the data file keeps its plain name (save_model would
    # otherwise pick "<name>.onnx.1.data" to avoid tearing the model it replaces).
    for old in os.listdir(out_dir):
        if old == f"{name}.onnx" or (old.startswith(f"{name}.onnx.") and old.endswith(".data")):
            os.unlink(os.path.join(out_dir, old))
    save_model(SAMPLES[name](), path, location=f"{name}.onnx.data", min_size=1024)
    return path


def build_all(out_dir: str) -> dict[str, str]:
    """Builds every sample into ``out_dir``; returns name -> model path."""
    os.makedirs(out_dir, exist_ok=True)
    return {name: build_sample(name, out_dir) for name in SAMPLES}


def make_matmul_chain(path: str, n_layers: int, dim: int, dtype=np.float32, *, seed: int = 0,
                      location: str | None = None) -> int:
    """Writes a chain of ``n_layers`` MatMul(dim x dim) + Relu with external, aligned weights.

    The data file is streamed layer by layer (the weights never exist in a proto), aligned like
    ``save_model`` does.  Returns the number of weight bytes.
    """
    from onnxpack.graph import DEFAULT_ALIGN_THRESHOLD, compute_offset
    import mmap

    dtype = np.dtype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    folder = os.path.dirname(os.path.abspath(path))
    location = location or os.path.basename(path) + ".data"
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    offset = 0
    tmp = os.path.join(folder, f".{location}.tmp")
    with open(tmp, "wb") as f:
        prev = "x"
        for i in range(n_layers):
            w = (rng.standard_normal((dim, dim), dtype=np.float32) / math.sqrt(dim)).astype(dtype)
            start = compute_offset(offset, w.nbytes, align_threshold=DEFAULT_ALIGN_THRESHOLD,
                                   allocation_granularity=mmap.ALLOCATIONGRANULARITY)
            f.write(bytes(start - offset))
            f.write(w.tobytes())
            offset = start + w.nbytes
            t = TensorProto(name=f"W{i}", data_type=elem, dims=[dim, dim])
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", location), ("offset", str(start)), ("length", str(w.nbytes))):
                e = t.external_data.add()
                e.key, e.value = k, v
            inits.append(t)
            out = "y" if i == n_layers - 1 else f"h{i}"
            nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"))
            nodes.append(helper.make_node("Relu", [f"m{i}"], [out], name=f"relu{i}"))
            prev = out
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, location))
    g = helper.make_graph(nodes, "matmul_chain", [_vi("x", elem, [1, dim])],
                          [_vi("y", elem, [1, dim])], inits)
    m = _model(g)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(m.SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n_layers * dim * dim * dtype.itemsize


# -- onnx's light models with real weights ---------------------------------------------------------
LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
# External weights start on 64-byte boundaries: what numpy's .npy and our save_model use, so a
# mapped weight is aligned for SIMD loads.
LIGHT_DATA_ALIGN = 64


def light_model_names() -> list[str]:
    """Names (``light_resnet50``, ...) of the light models shipped with the installed onnx."""
    return sorted(n[: -len(".onnx")] for n in os.listdir(LIGHT_DIR)
                  if n.startswith("light_") and n.endswith(".onnx"))


def materialize_light_model(name_or_path: str | os.PathLike, seed: int = 0, *,
                            expose_logits: bool = True, data_path: str | os.PathLike | None = None
                            ) -> onnx.ModelProto:
    """onnx's light model with every ``ConstantOfShape`` weight replaced by a random initializer.

    Why: the shipped constant weights make every channel equal, so wrong kernels, wrong arena
    offsets or wrong packing can still give the expected output.  Scales keep activations O(1)
    through 50+ layers (logits neither saturated nor vanishing): Conv weights N(0, 1/fan_in),
    Gemm weights N(0, 1/K), BatchNormalization scale U(0.3, 0.6) and variance U(0.5, 1.5)
    (positive), everything else (biases, means, shifts) N(0, 0.1²).

    The shape initializers and the graph inputs naming them are dropped; the IR version is raised
    to 4 so the new initializers are constants, not overridable inputs.

    Args:
        name_or_path: A light model name (``"light_resnet50"``) or the path of an ONNX file.
        seed: Seed of the weights (same seed, same weights).
        expose_logits: Also output the input of the last Softmax (typed float), since a softmax
            can hide logit errors.
        data_path: If given, the weights are streamed to this file (64-byte aligned; written to a
            temp name, fsynced, renamed) as external data, so hundreds of MB never pass through a
            protobuf; save the model in the same folder.
    """
    path = os.fspath(name_or_path)
    if not os.path.splitext(path)[1]:
        path = os.path.join(LIGHT_DIR, f"{path}.onnx")
    m = onnx.load(path)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in g.node:
        for k, i in enumerate(n.input):
            consumers.setdefault(i, []).append((n, k))
    rng = np.random.default_rng(seed)
    keep, new_inits, dropped = [], [], set()
    data = tmp = None
    if data_path is not None:
        data_path = os.fspath(data_path)
        tmp = os.path.join(os.path.dirname(os.path.abspath(data_path)), f".{os.path.basename(data_path)}.tmp")
        data = open(tmp, "wb")
    try:
        for n in g.node:
            if n.op_type != "ConstantOfShape" or n.input[0] not in inits:
                keep.append(n)
                continue
            shape = tuple(int(v) for v in numpy_helper.to_array(inits[n.input[0]]))
            dropped.add(n.input[0])
            a = _random_light_weight(rng, shape, *consumers.get(n.output[0], [(None, -1)])[0])
            if data is None:
                new_inits.append(numpy_helper.from_array(a, n.output[0]))
                continue
            offset = -(-data.tell() // LIGHT_DATA_ALIGN) * LIGHT_DATA_ALIGN
            data.write(bytes(offset - data.tell()))
            a.tofile(data)
            t = TensorProto(name=n.output[0], data_type=TensorProto.FLOAT, dims=shape,
                            data_location=TensorProto.EXTERNAL)
            for key, value in (("location", os.path.basename(data_path)), ("offset", str(offset)),
                               ("length", str(a.nbytes))):
                e = t.external_data.add()
                e.key, e.value = key, value
            new_inits.append(t)
        if data is not None:
            data.flush()
            os.fsync(data.fileno())
    finally:
        if data is not None:
            data.close()
    if tmp is not None:
        os.replace(tmp, data_path)
    used = {i for n in keep for i in n.input}
    new_inits += [t for t in g.initializer if t.name not in dropped or t.name in used]
    inputs = [i for i in g.input if i.name not in dropped or i.name in used]
    del g.node[:]
    g.node.extend(keep)
    del g.initializer[:]
    g.initializer.extend(new_inits)
    del g.input[:]
    g.input.extend(inputs)
    # IR 3 wants every initializer listed as a graph input (i.e. overridable); from IR 4 on an
    # initializer that is not an input is a constant, which is what these weights are.
    m.ir_version = max(m.ir_version, 4)
    softmax = [n for n in g.node if n.op_type == "Softmax"]
    if expose_logits and softmax:
        g.output.append(helper.make_tensor_value_info(softmax[-1].input[0], TensorProto.FLOAT, None))
    return m


def write_light_model(name: str, folder: str | os.PathLike, seed: int = 0, *,
                      expose_logits: bool = True) -> tuple[str, onnx.ModelProto]:
    """:func:`materialize_light_model` saved as ``folder/<name>.onnx`` + ``<name>.onnx.data``.

    Returns the model path and the proto (its weights external, pointing at the data file).
    """
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.onnx")
    model = materialize_light_model(name, seed, expose_logits=expose_logits, data_path=path + ".data")
    tmp = os.path.join(folder, f".{name}.onnx.tmp")
    with open(tmp, "wb") as f:
        f.write(model.SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path, model


def _random_light_weight(rng: np.random.Generator, shape: tuple[int, ...], user: onnx.NodeProto | None,
                         k: int) -> np.ndarray:
    """A weight for input ``k`` of node ``user``, scaled per role (see materialize_light_model)."""
    op = user.op_type if user is not None else ""
    f32 = np.float32
    if op == "Conv" and k == 1:
        return rng.standard_normal(shape, dtype=f32) * f32(math.sqrt(1.0 / max(1, math.prod(shape[1:]))))
    if op == "Gemm" and k == 1:
        trans_b = any(at.name == "transB" and at.i for at in user.attribute)
        return rng.standard_normal(shape, dtype=f32) * f32(math.sqrt(1.0 / shape[1 if trans_b else 0]))
    if op == "BatchNormalization" and k == 4:
        return rng.uniform(0.5, 1.5, shape).astype(f32)
    if op == "BatchNormalization" and k == 1:
        return rng.uniform(0.3, 0.6, shape).astype(f32)
    return rng.standard_normal(shape, dtype=f32) * f32(0.1)


def light_inputs(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    """Seeded float32 N(0, 1) feeds for a light model's inputs (dynamic dimensions as 1)."""
    inits = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape, dtype=np.float32)
    return feeds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = argv[0] if argv else os.path.dirname(os.path.abspath(__file__))
    for name, path in build_all(out_dir).items():
        print(f"{name:14s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
