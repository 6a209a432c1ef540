"""Running models: SessionOptions, InferenceSession, the executor, kernels, the memory planner."""

from __future__ import annotations

from onnxpack.session._session import InferenceSession, ModelMetadata, NodeArg
from onnxpack.session.options import SessionOptions

__all__ = ["InferenceSession", "ModelMetadata", "NodeArg", "SessionOptions"]
