"""onnxpack: a numpy ONNX inference session that pre-packs constant weights, saves the packed
blobs next to the model's external initializers and memory-maps them back on the next load.

Change one import::

    import onnxpack as ort
    sess = ort.InferenceSession("model.onnx")
"""

from __future__ import annotations

from onnxpack import errors
from onnxpack.errors import OnnxpackError, PrepackWarning
from onnxpack.graph import load_model, save_model
from onnxpack.prepack import PrepackedWeightsContainer
from onnxpack.session import InferenceSession, ModelMetadata, NodeArg, SessionOptions

__version__ = "0.1.0"

__all__ = [
    "InferenceSession",
    "SessionOptions",
    "PrepackedWeightsContainer",
    "NodeArg",
    "ModelMetadata",
    "load_model",
    "save_model",
    "errors",
    "OnnxpackError",
    "PrepackWarning",
    "__version__",
]


def get_available_providers() -> list[str]:
    """As onnxruntime's: onnxpack runs on the CPU."""
    return ["CPUExecutionProvider"]
