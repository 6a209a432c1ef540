"""ONNX models as data: zero-copy load, scopes and the bottom-up walker, aligned atomic save.

See ``_model`` for scope paths, ``_external`` for the external-data security rules and
``_save`` for the on-disk layout and crash-safety choices.
"""

from __future__ import annotations

from onnxpack.graph._external import MAX_FILE_POSITION, ExternalLocation, open_regular_file, read_regular_file, stat_identity
from onnxpack.graph._model import Model, Scope, load_model, sparse_to_dense, subgraphs_of, walk
from onnxpack.graph._save import (
    DEFAULT_ALIGN_THRESHOLD,
    BlobPlacement,
    SaveExtras,
    SaveResult,
    compute_offset,
    save_model,
)
from onnxpack.graph._tensor import Tensor, byte_array, mapped_view, shape_fits

__all__ = [
    "load_model",
    "save_model",
    "walk",
    "subgraphs_of",
    "sparse_to_dense",
    "Model",
    "Scope",
    "Tensor",
    "ExternalLocation",
    "MAX_FILE_POSITION",
    "stat_identity",
    "open_regular_file",
    "read_regular_file",
    "byte_array",
    "mapped_view",
    "shape_fits",
    "SaveExtras",
    "SaveResult",
    "BlobPlacement",
    "compute_offset",
    "DEFAULT_ALIGN_THRESHOLD",
]
