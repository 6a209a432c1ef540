"""Where a session's packed weights come from, and how they are saved.

For one packed kernel input the order is:

1. blobs saved in the model's data file (load mode) — their content key is shared through the
   container, so a second session of the same optimized model takes them from the container;
2. the container (another session, or another node of this session, already has the key);
3. the persistent cache file (``onnxpack.prepacked_cache_path``);
4. pack now (and, with a cache path, append the new blobs to the cache file at the end of
   session creation).

Saved blobs are validated before they can reach a kernel; anything wrong is one warning and a
re-pack.  The cache file is mapped once per process per path and re-mapped only after it grew.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from onnxpack.errors import CacheFileError, InvalidArgument, PrepackWarning
from onnxpack.graph import Model
from onnxpack.prepack import PrePackedWeights, PrepackedWeightsContainer, make_key
from onnxpack.prepack import cache_file as cf
from onnxpack.prepack._record import ALWAYS_VERIFY_BELOW, LoadRecord, SaveRecord

logger = logging.getLogger(__name__)

__all__ = ["PrepackSources", "save_optimized", "report_progress"]

# Called after every packed kernel input is obtained (weight name); set by report_progress.
# A context variable, not a session option: progress display is the caller's business (the
# optimize CLI's bar) and must not leak into sessions created by other threads.
_PROGRESS: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "onnxpack_prepack_progress", default=None
)


@contextlib.contextmanager
def report_progress(callback: Callable[[str], None]) -> Iterator[None]:
    """Within the block, sessions created in this context call ``callback(weight name)`` after
    obtaining each packed kernel input (packed, mapped or shared)."""
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)

# realpath -> (file identity, CacheFile): one mapping per process per cache path.
_CACHE_FILES: dict[str, tuple[tuple[int, int, int, int], cf.CacheFile]] = {}
_CACHE_LOCK = threading.Lock()


def _warn(message: str) -> None:
    warnings.warn(message, PrepackWarning, stacklevel=4)
    logger.warning("%s", message)


def _cache_identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_cache(path: str) -> cf.CacheFile | None:
    """The process-wide mapping of cache file ``path`` (None with a warning when unusable)."""
    real = os.path.realpath(path)
    ident = _cache_identity(real)
    with _CACHE_LOCK:
        known = _CACHE_FILES.get(real)
        if known is not None and known[0] == ident:
            return known[1]
        if ident is None:
            return None  # no file yet: nothing to map
        cache, warning = cf.load_or_empty(real)
        if warning:
            _warn(f"packed-weight cache {path!r} ignored, packing in memory: {warning}")
            return None
        _CACHE_FILES[real] = (ident, cache)
        return cache


class PrepackSources:
    """The saved-blob sources of one session (model file record, cache file) and its save record."""

    def __init__(self, model: Model, config: dict[str, Any]) -> None:
        self.model = model
        self.config = config
        self.verify = bool(config["onnxpack.verify_prepacked"])
        self.record = LoadRecord(model, verify=self.verify)
        self.cache_path = config["onnxpack.prepacked_cache_path"] or ""
        if self.cache_path:
            folder = os.path.dirname(os.path.abspath(self.cache_path))
            if not os.path.isdir(folder):
                raise InvalidArgument(
                    f"onnxpack.prepacked_cache_path: folder {folder!r} of {self.cache_path!r} does not exist"
                )
        self.cache = open_cache(self.cache_path) if self.cache_path else None
        # open_cache returns None for an existing file only after warning that it is unusable;
        # flush_cache then keeps to that one warning (issue 6: "ignored with one warning").
        self._cache_ignored = bool(self.cache_path) and self.cache is None and os.path.exists(self.cache_path)
        # (constant ref, spec, tensor info, entry) of every pack, for a save with blobs.
        self.save_items: list[tuple[Any, Any, Any, PrePackedWeights]] = []
        self.to_cache: dict[str, tuple[np.ndarray, ...]] = {}
        self.cache_rejected = 0  # cache entries ignored with a warning
        # (scope path, name, user-given) -> identity: a weight read by several kernels is
        # identified (for in-proto weights: hashed) once.
        self._identities: dict[tuple[str, str, bool], bytes] = {}

    @property
    def rejected(self) -> int:
        """Saved blobs and cache entries ignored with a warning (their weights were re-packed)."""
        return self.record.rejected + self.cache_rejected

    def obtain(self, session: Any, kernel: Any, i: int, ref: Any, info: Any, spec: Any,
               container: PrepackedWeightsContainer, holder: int) -> tuple[PrePackedWeights | None, str]:
        """The packed form of kernel input ``i`` (constant ``ref``), and where it came from."""
        result = self._obtain(session, kernel, i, ref, info, spec, container, holder)
        callback = _PROGRESS.get()
        if callback is not None:
            callback(ref.name)
        return result

    def _obtain(self, session: Any, kernel: Any, i: int, ref: Any, info: Any, spec: Any,
                container: PrepackedWeightsContainer, holder: int) -> tuple[PrePackedWeights | None, str]:

        def check(buffers: tuple[np.ndarray, ...]) -> str | None:
            return kernel.check_packed(i, info, buffers)

        origin = {"value": "container"}
        if not ref.user and self.record.has(ref.owner.path, ref.name):
            mapped = self.record.find(ref.owner.path, ref.name, ref.tensor.raw, spec, info.dtype, info.shape, check,
                                      ref.tensor.external)
            if mapped is not None:
                def from_model() -> PrePackedWeights:
                    origin["value"] = "model"
                    session._count("model", mapped)
                    return mapped

                entry, created = container.get_or_create(mapped.key, holder, from_model)
                if not created:
                    session._count("container", entry)
                self._record_for_save(ref, spec, info, entry)
                return entry, origin["value"]

        ident_key = (ref.owner.path, ref.name, ref.user)
        identity = self._identities.get(ident_key)
        if identity is None:
            identity = self._identities[ident_key] = ref.identity()
        key = make_key(spec, identity, info.dtype, info.shape)

        def pack() -> PrePackedWeights | None:
            if self.cache is not None and key in self.cache:
                # Small entries are CRC-checked at every load, like small blobs saved in a model
                # (ALWAYS_VERIFY_BELOW): cheap, and a corrupt one would give wrong outputs.
                cached = self.cache.entry(key)
                small = cached is not None and cached.nbytes < ALWAYS_VERIFY_BELOW
                try:
                    buffers = self.cache.get(key, verify=self.verify or small)
                except CacheFileError as exc:
                    buffers = None
                    self.cache_rejected += 1
                    _warn(f"cache entry for weight {ref.name!r} ignored, re-packing: {exc}")
                if buffers is not None:
                    reason = check(tuple(buffers))
                    if reason is None:
                        entry = PrePackedWeights(key, tuple(buffers), "cache")
                        origin["value"] = "cache"
                        session._count("cache", entry)
                        return entry
                    self.cache_rejected += 1
                    _warn(f"cache entry for weight {ref.name!r} rejected by {kernel.op_type}, re-packing: {reason}")
            t0 = time.perf_counter()
            buffers = kernel.prepack(i, ref.value())
            entry = PrePackedWeights(key, tuple(buffers), "packed")
            reason = check(entry.buffers)
            if reason is not None:
                raise RuntimeError(f"Bug: {type(kernel).__name__}.prepack output fails its own check: {reason}")
            session._count("packed", entry, time.perf_counter() - t0)
            origin["value"] = "packed"
            if self.cache_path:
                self.to_cache[key] = entry.buffers
            return entry

        entry, created = container.get_or_create(key, holder, pack)
        if entry is not None and not created:
            session._count("container", entry)
        if entry is not None:
            self._record_for_save(ref, spec, info, entry)
        return entry, origin["value"]

    def _record_for_save(self, ref: Any, spec: Any, info: Any, entry: PrePackedWeights) -> None:
        if not ref.user:  # user-given initializers are not part of the saved model's weights
            self.save_items.append((ref, spec, info, entry))

    def flush_cache(self) -> None:
        """Append blobs packed by this session to the cache file (nothing new → nothing written)."""
        if not self.cache_path or not self.to_cache:
            return
        entries = {k: v for k, v in self.to_cache.items() if self.cache is None or k not in self.cache}
        self.to_cache = {}
        if not entries:
            return
        try:
            result = cf.append_entries(self.cache_path, entries)
        except (OSError, CacheFileError) as exc:
            if self._cache_ignored:  # the file was already reported unusable at open: one warning
                logger.info("packed-weight cache %r not updated: %s", self.cache_path, exc)
            else:
                _warn(f"packed-weight cache {self.cache_path!r} not updated: {exc}")
            return
        logger.info("cache %s: %d entries added, %d already there%s", self.cache_path, len(result.added),
                    len(result.skipped), " (damaged file rebuilt)" if result.rebuilt else "")


def save_optimized(session: Any, path: str) -> Any:
    """Save the session's model to ``path`` (optimized_model_filepath), with packed blobs if asked."""
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
    extra = None
    if cfg["session.save_external_prepacked_constant_initializers"]:
        extra = SaveRecord()
        for ref, spec, info, entry in session._sources.save_items:
            extra.add(ref.owner.path, ref.name, ref.tensor.raw(), spec, info.dtype, info.shape, entry)
    return save_model(session.model, path, extra=extra, **kwargs)
