"""Saving a compiled model: ``optimized_model_filepath`` and ``onnxpack optimize``.

``optimize(input, output, config)`` is load + compile + save: one parse of the model, a compile
that builds no onnx.reference evaluators (``runnable=False``: nothing will run), and a save whose
pre-packed blobs come from the program's pack log.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from onnxpack.graph import Model, SaveResult, load_model, save_model
from onnxpack.prepack import PackSources, PrepackedWeightsContainer, SaveRecord, report_progress
from onnxpack.session._compile import CompileOptions, compile
from onnxpack.session._program import Program
from onnxpack.session.options import validate_config

__all__ = ["save_program", "optimize"]

_HOLDERS = itertools.count(1)


def save_program(model: Model, program: Program | None, path: str, config: dict[str, Any]) -> SaveResult:
    """Save ``model`` to ``path`` with the layout options of ``config`` (a validated config);
    with ``session.save_external_prepacked_constant_initializers`` the program's packs are written
    next to their weights."""
    kwargs: dict[str, Any] = {
        "min_size": config["session.optimized_model_external_initializers_min_size_in_bytes"],
        "allocation_granularity": config["onnxpack.allocation_granularity"],
    }
    name = config["session.optimized_model_external_initializers_file_name"]
    if name:
        kwargs["location"] = name
    if config["onnxpack.align_threshold"] is not None:
        kwargs["align_threshold"] = config["onnxpack.align_threshold"]
    extra = None
    if program is not None and config["session.save_external_prepacked_constant_initializers"]:
        extra = SaveRecord()
        initializers = {s.path: s.initializers for s in model.scopes()}
        for e in program.pack_log:
            w = e.weight
            if w.user:  # user-given initializers are not part of the saved model's weights
                continue
            if e.spec.identity and w.name not in initializers.get(w.scope, {}):
                # An identity pack of a Constant-node tensor: the tensor stays in the proto, so
                # saving its pack would store the weight twice; viewing it again costs nothing.
                continue
            extra.add(w.scope, w.name, w.raw(), e.spec, w.dtype, w.shape, e.entry)
    return save_model(model, os.fspath(path), extra=extra, **kwargs)


def optimize(input_path: str, output_path: str, config: dict[str, str] | None = None, *,
             progress: Any = None) -> tuple[SaveResult, Program | None]:
    """Load ``input_path``, compile it (packing, not runnable) and save it to ``output_path``.

    ``config`` holds session config entries as strings (validated here); pre-packed blobs are
    saved unless ``session.save_external_prepacked_constant_initializers`` is ``0`` or
    ``session.disable_prepacking`` is ``1``.  ``progress`` (optional) gets ``start(sizes)`` with
    every initializer's bytes by name, then is called with each weight's name as it is packed.

    Blobs taken from the input's own records are verified in full (digest of the source weight,
    checksum of every buffer) before they are saved again: a stale blob must not be laundered
    into a new model under the current weight's digest.  Optimizing runs once; it can afford it.
    With pre-packing off nothing is compiled (the program is ``None``): the weights are only
    externalized and aligned.
    """
    entries = {"session.save_external_prepacked_constant_initializers": "1", **(config or {})}
    cfg = validate_config(entries)
    container = PrepackedWeightsContainer()
    holder = next(_HOLDERS)
    with load_model(input_path) as model:
        if cfg["session.disable_prepacking"]:
            return save_program(model, None, output_path, cfg), None
        if progress is not None:
            progress.start({name: t.nbytes for s in model.scopes() for name, t in s.initializers.items()})
        try:
            sources = PackSources(model, verify=True, cache_path=cfg["onnxpack.prepacked_cache_path"] or "")
            options = CompileOptions(prepack=True, runnable=False)
            with report_progress(progress if progress is not None else _ignore):
                program = compile(model, options, sources, container, holder)
            result = save_program(model, program, output_path, cfg)
        finally:
            container.release(holder)
    return result, program


def _ignore(name: str) -> None:
    pass
