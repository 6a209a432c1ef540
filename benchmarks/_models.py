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
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import tempfile

import numpy as np

__all__ = ["make_matmul_model", "make_fp16_mlp", "make_int4_model", "feeds_for"]

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The anchor model: 6 x 2048 x 2048 x 4 bytes = 100,663,296 bytes (100.7 MB).
MATMUL_LAYERS, MATMUL_DIM = 6, 2048
# 4 x 3584 x 3584 x 2 bytes = 102,760,448 bytes (~103 MB) of fp16 weights.
FP16_LAYERS, FP16_DIM = 4, 3584
# onnxruntime's default is 128; 32 is what LLM exports commonly use and is the harder case for
# a dequantizing kernel (4x more scales and zero points).
INT4_BLOCK_SIZE = 32


def _build_module():
    """models/build.py (not a package): its streaming ``make_matmul_chain`` writes the weights."""
    spec = importlib.util.spec_from_file_location("_onnxpack_models_build", ROOT / "models" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_matmul_model(path: str | os.PathLike, n: int = MATMUL_LAYERS, dim: int = MATMUL_DIM, *,
                      seed: int = 0) -> int:
    """fp32 chain of ``n`` MatMul(dim x dim) + Relu; returns weight bytes (100.7 MB by default)."""
    return _build_module().make_matmul_chain(os.fspath(path), n, dim, np.float32, seed=seed)


def make_fp16_mlp(path: str | os.PathLike, n_layers: int = FP16_LAYERS, dim: int = FP16_DIM, *,
                  seed: int = 1) -> int:
    """fp16 MLP of ``n_layers`` MatMul(dim x dim) + Relu, fp16 in and out; returns weight bytes."""
    return _build_module().make_matmul_chain(os.fspath(path), n_layers, dim, np.float16, seed=seed)


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
