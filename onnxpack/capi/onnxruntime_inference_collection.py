"""onnxruntime's ``capi.onnxruntime_inference_collection``: its Python-level classes and the
provider-argument check, from onnxpack."""

from __future__ import annotations

from typing import Any

from onnxpack.session import InferenceSession, IOBinding, OrtValue, SparseTensor
from onnxpack.session.ortapi import ModelCompiler
from onnxpack.session.ortapi import AdapterFormat
from onnxpack.session.ortapi import OrtDevice, OrtDeviceVendorId, copy_tensors
from onnxpack.session.ortapi import normalize_providers

Session = InferenceSession

__all__ = ["InferenceSession", "Session", "IOBinding", "OrtValue", "SparseTensor", "OrtDevice", "OrtDeviceVendorId",
           "copy_tensors", "AdapterFormat", "ModelCompiler", "check_and_normalize_provider_args"]


def check_and_normalize_provider_args(providers: Any, provider_options: Any, available_provider_names: Any):
    """onnxruntime's provider-argument normalization: ``(names, options dicts of strings)``."""
    return normalize_providers(providers, provider_options, list(available_provider_names), stacklevel=4)
