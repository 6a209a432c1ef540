"""Packed weights as data: PrePackedWeights, keys, the cross-session container, on-disk formats."""

from __future__ import annotations

from onnxpack.prepack._container import PrepackedWeightsContainer
from onnxpack.prepack._weights import PrePackedWeights, content_identity, file_identity, make_key

__all__ = ["PrePackedWeights", "PrepackedWeightsContainer", "content_identity", "file_identity", "make_key"]
