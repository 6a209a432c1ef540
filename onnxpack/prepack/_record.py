"""The per-model serialization record: save mode and load mode.

*Save mode* (:class:`SaveRecord`): while a session packs, it records weight → packs; at save it
hands the graph layer the blobs to write right after each weight (``SaveExtras.blobs``) and, once
their offsets are known, one ``metadata_props`` entry per weight (``SaveExtras.metadata``, format
in :mod:`onnxpack.prepack.entry_format`).  Saved keys are content keys — the digest of the source
weight's bytes, never the file it came from — so equal weights share one blob and a warm session
computes the same key without packing.

*Load mode* (:class:`LoadRecord`): parses the records of a model and hands out mapped buffers
after checking everything that can be checked without paging the weight in (bounds, sizes,
dtypes, a sampled digest of the source weight); ``verify`` adds the full digest and every
buffer's checksum.  Anything wrong is one warning naming the weight, and ``None``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpack.errors import OnnxpackError, PrepackFormatError, PrepackWarning
from onnxpack.prepack import entry_format as fmt
from onnxpack.prepack._weights import PrePackedWeights, full_digest, make_key, sample_digest

logger = logging.getLogger(__name__)

__all__ = ["SaveRecord", "LoadRecord", "content_key", "ALWAYS_VERIFY_BELOW"]

# Blobs shorter than this have their CRC-32 checked at every load, even without
# ``onnxpack.verify_prepacked``.  Why: at ~4 GB/s a 64 KiB blob costs ~16 us, such blobs are
# below the page-alignment threshold (they share pages with neighbours that are read anyway), and
# a wrong small blob (bias-sized tables, conv kernels) otherwise gives silently wrong outputs.
# Large blobs are not read at load: checking them would page in every packed weight at create,
# which is exactly what mapping avoids; ``verify_prepacked=1`` checks them too.
ALWAYS_VERIFY_BELOW = 64 * 1024


def _warn(message: str) -> None:
    warnings.warn(message, PrepackWarning, stacklevel=4)
    logger.warning("%s", message)


def content_key(spec: Any, digest: bytes, dtype: Any, shape: Sequence[int]) -> str:
    """The key of a pack made from bytes whose full digest is ``digest``."""
    return make_key(spec, b"c:" + digest, dtype, shape)


@dataclasses.dataclass
class _SavedWeight:
    length: int
    digest: bytes
    sample: bytes
    packs: list[tuple[str, tuple[np.ndarray, ...]]]


class SaveRecord:
    """Save mode: collects packs per (scope path, weight name); implements ``SaveExtras``."""

    def __init__(self) -> None:
        self._weights: dict[tuple[str, str], _SavedWeight] = {}
        self._by_key: dict[str, tuple[np.ndarray, ...]] = {}  # one blob per content key

    def __len__(self) -> int:
        return len(self._weights)

    def add(self, scope: str, name: str, source: bytes | memoryview | np.ndarray, spec: Any,
            dtype: Any, shape: Sequence[int], packed: PrePackedWeights) -> str:
        """Record that ``packed`` was made from weight ``name`` of ``scope``; returns its saved key."""
        entry = self._weights.get((scope, name))
        if entry is None:
            nbytes = source.nbytes if isinstance(source, (np.ndarray, memoryview)) else len(source)
            entry = _SavedWeight(int(nbytes), full_digest(source), sample_digest(source), [])
            self._weights[(scope, name)] = entry
        key = content_key(spec, entry.digest, dtype, shape)
        buffers = self._by_key.setdefault(key, packed.buffers)
        if all(k != key for k, _ in entry.packs):
            entry.packs.append((key, buffers))
        return key

    # -- SaveExtras -----------------------------------------------------------------------------
    def blobs(self, scope_path: str, name: str) -> list[np.ndarray]:
        entry = self._weights.get((scope_path, name))
        if entry is None:
            return []
        return [b for _key, buffers in entry.packs for b in buffers]

    def metadata(self, placements: dict[tuple[str, str], list[Any]], location: str | None) -> dict[str, str]:
        out: dict[str, str] = {}
        for (scope, name), entry in self._weights.items():
            placed = placements.get((scope, name))
            if not placed or location is None:
                continue
            packs = []
            k = 0
            for key, buffers in entry.packs:
                recs = []
                for b in buffers:
                    recs.append(fmt.buffer_record(b, location, placed[k].offset))
                    k += 1
                packs.append(fmt.PackRecord(key, tuple(recs)))
            record = fmt.WeightRecord(
                scope=scope, name=name, source_length=entry.length, source_offset=None,
                source_digest=(entry.digest + entry.sample).hex(), packs=tuple(packs),
            )
            rk, value = fmt.format_record(record)
            out[rk] = value
        return out


class LoadRecord:
    """Load mode: the records found in a model, validated lazily per weight."""

    def __init__(self, model: Any, *, verify: bool = False) -> None:
        self.model = model
        self.verify = verify
        self.rejected = 0
        self._failed: set[tuple[str, str, str]] = set()  # (scope, name, reason): warn once each
        self._records: dict[tuple[str, str], fmt.WeightRecord] = {}
        for prop in model.proto.metadata_props:
            if not fmt.is_record_key(prop.key):
                continue
            try:
                rec = fmt.parse_record(prop.key, prop.value)
            except PrepackFormatError as exc:
                self.rejected += 1
                _warn(f"pre-packed record {prop.key[:200]!r} ignored (the weight will be re-packed): {exc}")
                continue
            self._records[(rec.scope, rec.name)] = rec

    def __len__(self) -> int:
        return len(self._records)

    def has(self, scope: str, name: str) -> bool:
        return (scope, name) in self._records

    def find(self, scope: str, name: str, raw: Any, spec: Any, dtype: Any, shape: Sequence[int],
             check: Any) -> PrePackedWeights | None:
        """Mapped buffers for this weight and kernel spec, or None (with a warning if unusable).

        ``raw`` returns the source weight's bytes (read lazily: only sampled unless verifying);
        ``check(buffers)`` is the kernel's own validation (None when fine, else a reason).
        """
        rec = self._records.get((scope, name))
        if rec is None:
            return None
        where = f"pre-packed blob of weight {name!r}" + (f" in scope {scope!r}" if scope else "")
        try:
            return self._find(rec, where, raw, spec, dtype, shape, check)
        except (PrepackFormatError, OnnxpackError, ValueError) as exc:
            # A weight with several consumers is looked up once per consumer; the same failure
            # is one warning (and one rejected blob), not one per consumer.
            seen = (scope, name, str(exc))
            if seen not in self._failed:
                self._failed.add(seen)
                self.rejected += 1
                _warn(f"{where} ignored, re-packing: {exc}")
            return None

    def _find(self, rec: fmt.WeightRecord, where: str, raw: Any, spec: Any, dtype: Any,
              shape: Sequence[int], check: Any) -> PrePackedWeights | None:
        digest_hex = rec.source_digest
        if len(digest_hex) != 64:
            raise PrepackFormatError(f"source digest: expected 64 hex digits, got {len(digest_hex)}")
        digest, sample = bytes.fromhex(digest_hex[:32]), bytes.fromhex(digest_hex[32:])
        key = content_key(spec, digest, dtype, shape)
        pack = next((p for p in rec.packs if p.key == key), None)
        if pack is None:
            fam = f"{spec.family}/{spec.version}"
            raise PrepackFormatError(
                f"no pack for kernel {fam} with this weight's dtype/shape (record has "
                f"{[p.key.rsplit('/', 1)[0] for p in rec.packs]})"
            )
        source = raw()
        nbytes = source.nbytes if isinstance(source, (memoryview, np.ndarray)) else len(source)
        if nbytes != rec.source_length:
            raise PrepackFormatError(f"stale: weight has {nbytes} bytes, record says {rec.source_length}")
        if sample_digest(source) != sample:
            raise PrepackFormatError("stale: the weight's bytes changed since the blob was saved")
        if self.verify and full_digest(source) != digest:
            raise PrepackFormatError("stale: the weight's full digest does not match the record")
        buffers = []
        for i, b in enumerate(pack.buffers):
            data, size = self.model.data_buffer(b.location, where)
            if b.offset + b.length > size:
                raise PrepackFormatError(
                    f"buffer {i} [{b.offset}, {b.offset + b.length}) lies outside {b.location!r} of {size} bytes"
                )
            view = b.view(data)
            if (self.verify or b.length < ALWAYS_VERIFY_BELOW) and fmt.checksum(view) != b.checksum:
                raise PrepackFormatError(f"buffer {i}: checksum {fmt.checksum(view)} != recorded {b.checksum}")
            buffers.append(view)
        reason = check(tuple(buffers))
        if reason is not None:
            raise PrepackFormatError(f"kernel rejects the blob: {reason}")
        return PrePackedWeights(key, tuple(buffers), "model")
