"""Where a compiled model's packed weights come from.

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
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from onnxpack._frozen import fast_init
from onnxpack.errors import CacheFileError, InvalidArgument, PrepackWarning
from onnxpack.graph import Model, stat_identity
from onnxpack.prepack import cache_file as cf
from onnxpack.prepack._container import PrepackedWeightsContainer
from onnxpack.prepack._record import ALWAYS_VERIFY_BELOW, LoadRecord, pack_differs
from onnxpack.prepack._weights import PackSpec, PrePackedWeights, WeightRef, make_key

logger = logging.getLogger(__name__)

__all__ = ["PackSources", "Obtained", "report_progress", "open_cache"]

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
_CACHE_FILES: dict[str, tuple[tuple[int, ...], cf.CacheFile]] = {}
_CACHE_LOCK = threading.Lock()


def _warn(message: str) -> None:
    warnings.warn(message, PrepackWarning, stacklevel=4)
    logger.warning("%s", message)


def _cache_identity(path: str) -> tuple[int, ...] | None:
    try:
        return stat_identity(os.stat(path))
    except OSError:
        return None


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


@fast_init
@dataclasses.dataclass(frozen=True)
class Obtained:
    """A packed kernel input and where it came from: ``packed`` (now, in ``seconds``), ``model``
    (the model's data file), ``cache`` (the cache file) or ``container`` (already shared)."""

    entry: PrePackedWeights
    origin: str
    seconds: float = 0.0


class PackSources:
    """The saved-blob sources of one model (its pre-packed records, the cache file).

    Args:
        model: the loaded model whose records are read and whose files blobs are mapped from.
        verify: ``onnxpack.verify_prepacked``: full digests and checksums.
        cache_path: ``onnxpack.prepacked_cache_path`` ("" for none).
    """

    def __init__(self, model: Model, *, verify: bool = False, cache_path: str = "") -> None:
        self.model = model
        self.verify = verify
        self.record = LoadRecord(model, verify=verify)
        self.cache_path = cache_path
        if cache_path:
            folder = os.path.dirname(os.path.abspath(cache_path))
            if not os.path.isdir(folder):
                raise InvalidArgument(
                    f"onnxpack.prepacked_cache_path: folder {folder!r} of {cache_path!r} does not exist"
                )
        self.cache = open_cache(cache_path) if cache_path else None
        # open_cache returns None for an existing file only after warning that it is unusable;
        # flush_cache then keeps to that one warning (issue 6: "ignored with one warning").
        self._cache_ignored = bool(cache_path) and self.cache is None and os.path.exists(cache_path)
        self.to_cache: dict[str, tuple[np.ndarray, ...]] = {}
        self.cache_rejected = 0  # cache entries ignored with a warning
        # (scope path, name, user-given) -> identity: a weight read by several kernels is
        # identified (for in-proto weights: hashed) once.
        self._identities: dict[tuple[str, str, bool, bytes], bytes] = {}

    @property
    def rejected(self) -> int:
        """Saved blobs and cache entries ignored with a warning (their weights were re-packed)."""
        return self.record.rejected + self.cache_rejected

    def obtain(self, weight: WeightRef, spec: PackSpec, pack: Callable[[np.ndarray], tuple[np.ndarray, ...]],
               check: Callable[[tuple[np.ndarray, ...]], str | None], container: PrepackedWeightsContainer,
               holder: int, label: str = "kernel") -> Obtained | None:
        """The packed form of one kernel input made from ``weight``, and where it came from.

        ``pack(value)`` packs (the kernel's ``prepack``); ``check(buffers)`` validates buffers that
        did not come from ``pack`` (``None`` when usable, else a reason); ``label`` names the
        kernel in warnings.  ``None`` when ``pack`` declined (returned nothing usable).
        """
        result = self._obtain(weight, spec, pack, check, container, holder, label)
        callback = _PROGRESS.get()
        if callback is not None:
            callback(weight.name)
        return result

    def _obtain(self, weight: WeightRef, spec: PackSpec, pack: Callable, check: Callable,
                container: PrepackedWeightsContainer, holder: int, label: str) -> Obtained | None:
        if not weight.user and self.record.has(weight.scope, weight.name):
            mapped = self.record.find(weight.scope, weight.name, weight.raw, spec, weight.dtype, weight.shape,
                                      check, weight.external, lambda: pack(weight.value()))
            if mapped is not None:
                entry, added = container.adopt(mapped.key, holder, mapped)
                return Obtained(entry, "model" if added else "container")

        made: dict[str, Any] = {"origin": "container", "seconds": 0.0}
        ident_key = (weight.scope, weight.name, weight.user, weight.derived.digest if weight.derived else b"")
        identity = self._identities.get(ident_key)
        if identity is None:
            identity = self._identities[ident_key] = weight.identity()
        key = make_key(spec, identity, weight.dtype, weight.shape)

        def create() -> PrePackedWeights | None:
            if self.cache is not None and key in self.cache:
                entry = self._from_cache(key, weight, check, label, pack)
                if entry is not None:
                    made["origin"] = "cache"
                    return entry
            t0 = time.perf_counter()
            buffers = pack(weight.value())
            if buffers is None:  # the kernel declined this value: nothing is stored or cached
                return None
            entry = PrePackedWeights(key, tuple(buffers), "packed")
            reason = check(entry.buffers)
            if reason is not None:
                raise RuntimeError(f"Bug: {label}.prepack output fails its own check: {reason}")
            made["origin"], made["seconds"] = "packed", time.perf_counter() - t0
            if self.cache_path:
                self.to_cache[key] = entry.buffers
            return entry

        entry, _ = container.get_or_create(key, holder, create)
        if entry is None:
            return None
        return Obtained(entry, made["origin"], made["seconds"])

    def _from_cache(self, key: str, weight: WeightRef, check: Callable, label: str,
                    pack: Callable | None = None) -> PrePackedWeights | None:
        # Small entries are CRC-checked at every load, like small blobs saved in a model
        # (ALWAYS_VERIFY_BELOW): cheap, and a corrupt one would give wrong outputs.
        cached = self.cache.entry(key)
        small = cached is not None and cached.nbytes < ALWAYS_VERIFY_BELOW
        try:
            buffers = self.cache.get(key, verify=self.verify or small)
        except CacheFileError as exc:
            self.cache_rejected += 1
            _warn(f"cache entry for weight {weight.name!r} ignored, re-packing: {exc}")
            return None
        if buffers is None:
            return None
        reason = check(tuple(buffers))
        if reason is not None:
            self.cache_rejected += 1
            _warn(f"cache entry for weight {weight.name!r} rejected by {label}, re-packing: {reason}")
            return None
        if self.verify and pack is not None:
            # The index's CRCs guard against corruption; a rewritten index (regions or keys
            # swapped, CRCs and commit recomputed) is told apart only by the weight's own pack.
            reason = pack_differs(pack(weight.value()), buffers)
            if reason is not None:
                self.cache_rejected += 1
                _warn(f"cache entry for weight {weight.name!r} is not its pack ({reason}), re-packing")
                return None
        return PrePackedWeights(key, tuple(buffers), "cache", self.cache.check)

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


