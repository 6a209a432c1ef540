"""Packed weights as data: PrePackedWeights, keys, the cross-session container, where packs come
from (saved records, the cache file), and the on-disk formats (``entry_format``, ``cache_file``)."""

from __future__ import annotations

from onnxpack.prepack._container import PrepackedWeightsContainer
from onnxpack.prepack._record import ALWAYS_VERIFY_BELOW, LoadRecord, SaveRecord
from onnxpack.prepack._sources import Obtained, PackSources, report_progress
from onnxpack.prepack._weights import (
    PackSpec,
    PrePackedWeights,
    WeightRef,
    content_identity,
    file_identity,
    make_key,
)

__all__ = [
    "PackSpec",
    "PrePackedWeights",
    "PrepackedWeightsContainer",
    "WeightRef",
    "PackSources",
    "Obtained",
    "LoadRecord",
    "SaveRecord",
    "ALWAYS_VERIFY_BELOW",
    "report_progress",
    "content_identity",
    "file_identity",
    "make_key",
]
