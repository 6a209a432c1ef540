"""Where a session's packed weights come from, and how they are saved.

Order for one packed kernel input: the container (another session, or another node of this
session, already has it) → blobs saved in the model's data file (load mode) → the persistent
cache file → pack now.  Saved blobs are validated before they can reach a kernel; anything wrong
is one warning and a re-pack.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from onnxpack.graph import Model
from onnxpack.prepack import PrePackedWeights, PrepackedWeightsContainer, make_key

logger = logging.getLogger(__name__)

__all__ = ["PrepackSources", "save_optimized"]


class PrepackSources:
    """The saved-blob sources of one session (model file record, cache file)."""

    def __init__(self, model: Model, config: dict[str, Any]) -> None:
        self.model = model
        self.config = config
        self.rejected = 0

    def obtain(self, session: Any, kernel: Any, i: int, ref: Any, info: Any, spec: Any,
               container: PrepackedWeightsContainer, holder: int) -> tuple[PrePackedWeights | None, str]:
        key = make_key(spec, ref.identity(), info.dtype, info.shape)
        origin = {"value": "container"}

        def pack() -> PrePackedWeights | None:
            t0 = time.perf_counter()
            buffers = kernel.prepack(i, ref.value())
            entry = PrePackedWeights(key, tuple(buffers), "packed")
            reason = kernel.check_packed(i, info, entry.buffers)
            if reason is not None:
                raise RuntimeError(f"Bug: {type(kernel).__name__}.prepack output fails its own check: {reason}")
            session._count("packed", entry, time.perf_counter() - t0)
            origin["value"] = "packed"
            return entry

        entry, created = container.get_or_create(key, holder, pack)
        if entry is not None and not created:
            session._count("container", entry)
        return entry, origin["value"]


def save_optimized(session: Any, path: str) -> None:
    from onnxpack.graph import save_model

    cfg = session._config
    kwargs: dict[str, Any] = {}
    name = cfg["session.optimized_model_external_initializers_file_name"]
    if name:
        kwargs["location"] = name
    kwargs["min_size"] = cfg["session.optimized_model_external_initializers_min_size_in_bytes"]
    if cfg["onnxpack.align_threshold"] is not None:
        kwargs["align_threshold"] = cfg["onnxpack.align_threshold"]
    kwargs["allocation_granularity"] = cfg["onnxpack.allocation_granularity"]
    save_model(session.model, path, **kwargs)
