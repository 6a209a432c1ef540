"""Generators of the big benchmark models, shared by the scripts in ``benchmarks/``.

Every generator is deterministic (fixed seeds), writes ``<path>`` plus ``<path>.data`` (external,
aligned initializers) through temp files that are fsynced and renamed, and returns the number of
weight bytes it wrote.  Models go to a temp dir or ``benchmarks/work/`` (git-ignored), never to
the repository.

* :func:`make_matmul_model` — the 100.7 MB chain of 6 fp32 MatMul(2048x2048) + Relu used by the
  issue anchors (input ``x`` float32 [1, 2048]).
* :func:`make_fp16_mlp` — a ~103 MB fp16-weight MLP: 4 fp16 MatMul(3584x3584) + Relu layers with
  fp16 activations (input ``x`` float16 [1, 3584]).  numpy has no fp16 BLAS, so every run of an
  unpacked kernel widens the weights to fp32 — what pre-packing does once.
* :func:`make_int4_model` — the fp32 MatMul chain quantized to 4-bit ``com.microsoft``
  MatMulNBits by onnxruntime's own ``MatMulNBitsQuantizer`` (block size 32, asymmetric), so the
  blocks, scales and zero points are laid out exactly as onnxruntime writes them.
* :func:`transformer_block` — one pre-LN encoder block (attention + GELU MLP) as a proto, for
  the run-latency and memory-planner benchmarks.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import sys
import tempfile

import numpy as np

__all__ = ["make_matmul_model", "make_fp16_mlp", "make_int4_model", "transformer_block", "feeds_for",
           "sample_models"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SAMPLE_MODELS_MODULE = "onnxpack_sample_models"

# The anchor model: 6 x 2048 x 2048 x 4 bytes = 100,663,296 bytes (100.7 MB).
MATMUL_LAYERS, MATMUL_DIM = 6, 2048
# 4 x 3584 x 3584 x 2 bytes = 102,760,448 bytes (~103 MB) of fp16 weights.
FP16_LAYERS, FP16_DIM = 4, 3584
# onnxruntime's default is 128; 32 is what LLM exports commonly use and is the harder case for
# a dequantizing kernel (4x more scales and zero points).
INT4_BLOCK_SIZE = 32


def sample_models():
    """models/build.py (a script, not a package), loaded once as ``onnxpack_sample_models``.

    It holds the streaming ``make_matmul_chain`` and the light-model materializer.  The same
    module name as the tests use, so a process that has both sees one module.
    """
    module = sys.modules.get(_SAMPLE_MODELS_MODULE)
    if module is None:
        spec = importlib.util.spec_from_file_location(_SAMPLE_MODELS_MODULE, ROOT / "models" / "build.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_SAMPLE_MODELS_MODULE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_SAMPLE_MODELS_MODULE]
            raise
    return module


def make_matmul_model(path: str | os.PathLike, n: int = MATMUL_LAYERS, dim: int = MATMUL_DIM, *,
                      seed: int = 0) -> int:
    """fp32 chain of ``n`` MatMul(dim x dim) + Relu; returns weight bytes (100.7 MB by default)."""
    return sample_models().make_matmul_chain(os.fspath(path), n, dim, np.float32, seed=seed)


def make_fp16_mlp(path: str | os.PathLike, n_layers: int = FP16_LAYERS, dim: int = FP16_DIM, *,
                  seed: int = 1) -> int:
    """fp16 MLP of ``n_layers`` MatMul(dim x dim) + Relu, fp16 in and out; returns weight bytes."""
    return sample_models().make_matmul_chain(os.fspath(path), n_layers, dim, np.float16, seed=seed)


def make_int4_model(path: str | os.PathLike, n: int = MATMUL_LAYERS, dim: int = MATMUL_DIM, *,
                    block_size: int = INT4_BLOCK_SIZE, seed: int = 2) -> int:
    """:func:`make_matmul_model` quantized to 4-bit MatMulNBits by onnxruntime's quantizer.

    Returns the bytes of the quantized initializers (blocks, scales, zero points).
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from onnxpack.graph import load_model, save_model

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        fp32 = os.path.join(tmp, "fp32.onnx")
        make_matmul_model(fp32, n, dim, seed=seed)
        quant = MatMulNBitsQuantizer(onnx.load(fp32), bits=4, block_size=block_size, is_symmetric=False)
        quant.process()
        proto = quant.model.model
    model = load_model(proto.SerializeToString())
    try:
        save_model(model, path, location=os.path.basename(path) + ".data", min_size=1024)
    finally:
        model.close()
    return sum(int(np.prod(t.dims)) * (1 if t.data_type == onnx.TensorProto.UINT8 else 4)
               for t in proto.graph.initializer)


def transformer_block(s: int = 128, d: int = 512, h: int = 8, ff: int = 2048, *, seed: int = 0):
    """One pre-LN encoder block, batch 1: LayerNorm, multi-head attention, residual, LayerNorm,
    GELU (Erf) MLP, residual.  Input ``x`` and output ``y`` are float32 [1, s, d].

    Weights N(0, 1/fan_in) (biases and LayerNorm shifts N(0, 0.01)) keep activations O(1).
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    hd = d // h

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1 / math.sqrt(shape[0])
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    arrays = {
        "ln1_s": 1 + w(d, scale=0.1), "ln1_b": w(d, scale=0.1), "Wq": w(d, d), "Wk": w(d, d), "Wv": w(d, d),
        "bq": w(d, scale=0.1), "Wo": w(d, d), "ln2_s": 1 + w(d, scale=0.1), "ln2_b": w(d, scale=0.1),
        "W1": w(d, ff), "b1": w(ff, scale=0.1), "W2": w(ff, d), "b2": w(d, scale=0.1),
        "heads": np.array([1, s, h, hd], np.int64), "model": np.array([1, s, d], np.int64),
        "scale": np.array(1 / math.sqrt(hd), np.float32), "half": np.array(0.5, np.float32),
        "one": np.array(1.0, np.float32), "rsqrt2": np.array(1 / math.sqrt(2), np.float32),
    }
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln1_s", "ln1_b"], ["ln1"], axis=-1, epsilon=1e-5),
        n("MatMul", ["ln1", "Wq"], ["q0"]), n("Add", ["q0", "bq"], ["q"]),
        n("MatMul", ["ln1", "Wk"], ["k"]), n("MatMul", ["ln1", "Wv"], ["v"]),
        n("Reshape", ["q", "heads"], ["qh"]), n("Reshape", ["k", "heads"], ["kh"]), n("Reshape", ["v", "heads"], ["vh"]),
        n("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]), n("Transpose", ["kh"], ["kt"], perm=[0, 2, 3, 1]),
        n("Transpose", ["vh"], ["vt"], perm=[0, 2, 1, 3]),
        n("MatMul", ["qt", "kt"], ["sc"]), n("Mul", ["sc", "scale"], ["scs"]), n("Softmax", ["scs"], ["p"], axis=-1),
        n("MatMul", ["p", "vt"], ["ctx"]), n("Transpose", ["ctx"], ["ctxt"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ctxt", "model"], ["ctxr"]), n("MatMul", ["ctxr", "Wo"], ["att"]),
        n("Add", ["x", "att"], ["r1"]),
        n("LayerNormalization", ["r1", "ln2_s", "ln2_b"], ["ln2"], axis=-1, epsilon=1e-5),
        n("MatMul", ["ln2", "W1"], ["f1"]), n("Add", ["f1", "b1"], ["f1b"]),
        n("Mul", ["f1b", "rsqrt2"], ["g0"]), n("Erf", ["g0"], ["g1"]), n("Add", ["g1", "one"], ["g2"]),
        n("Mul", ["f1b", "g2"], ["g3"]), n("Mul", ["g3", "half"], ["gelu"]),
        n("MatMul", ["gelu", "W2"], ["f2"]), n("Add", ["f2", "b2"], ["f2b"]), n("Add", ["r1", "f2b"], ["y"]),
    ]
    g = helper.make_graph(nodes, "transformer_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, s, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, s, d])],
                          [numpy_helper.from_array(a, k) for k, a in arrays.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9  # what onnxruntime 1.18+ reads
    return m


def feeds_for(path: str | os.PathLike, batch_rows: int = 1, *, seed: int = 123) -> dict[str, np.ndarray]:
    """Deterministic feeds for a model made here (one input ``x`` of shape [1, dim])."""
    import onnx
    from onnx import helper

    proto = onnx.load(os.fspath(path), load_external_data=False)
    (inp,) = proto.graph.input
    tt = inp.type.tensor_type
    dims = [d.dim_value for d in tt.shape.dim]
    dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
    rng = np.random.default_rng(seed)
    return {inp.name: rng.standard_normal(dims).astype(dtype)}
