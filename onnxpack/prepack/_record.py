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

import bisect
import hashlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpack.errors import OnnxpackError, PrepackFormatError, PrepackWarning
from onnxpack.prepack import entry_format as fmt
from onnxpack.graph import byte_array, mapped_view, stat_identity
from onnxpack.prepack._weights import (
    PrePackedWeights,
    full_digest,
    make_key,
    sample_digest,
)
from onnxpack.prepack._weights import KEY_DIGEST_SIZE

logger = logging.getLogger(__name__)

__all__ = ["SaveRecord", "LoadRecord", "content_key", "ALWAYS_VERIFY_BELOW"]

# Blobs shorter than this have their CRC-32 checked at every load, even without
# ``onnxpack.verify_prepacked``.  Why: at ~4 GB/s a 64 KiB blob costs ~16 us, such blobs are
# below the page-alignment threshold (they share pages with neighbours that are read anyway), and
# a wrong small blob (bias-sized tables, conv kernels) otherwise gives silently wrong outputs.
# Large blobs are not read at load: checking them would page in every packed weight at create,
# which is exactly what mapping avoids; ``verify_prepacked=1`` checks them too.
ALWAYS_VERIFY_BELOW = 64 * 1024


def _where(scope: str, name: str) -> str:
    """How warnings and errors name the saved blob of weight ``name`` (built only when needed)."""
    return f"pre-packed blob of weight {name!r}" + (f" in scope {scope!r}" if scope else "")


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


def _apart_from(buffers: tuple[np.ndarray, ...], source: bytes | memoryview | np.ndarray) -> tuple[np.ndarray, ...]:
    """``buffers`` with a copy of any that lies in ``source``'s memory.

    Why: a kernel's prepack may hand back a view of the weight when the packed layout happens to
    be the stored one (MatMulNBits' scales with one block per column, N a multiple of the tile),
    and the saver writes a buffer that is a view of its weight at the weight's own offset.  Only
    a pack whose spec says ``identity`` may point there (the loader refuses any other blob that
    overlaps a weight): such a pack would be rejected, with a warning, at every warm load."""
    src = source if isinstance(source, np.ndarray) else np.frombuffer(source, np.uint8)
    if not src.size or not any(b.size and np.may_share_memory(b, src) for b in buffers):
        return buffers
    return tuple(np.array(b) if b.size and np.may_share_memory(b, src) else b for b in buffers)


def _own_view(buffers: tuple[np.ndarray, ...], source: bytes | memoryview | np.ndarray) -> tuple[np.ndarray, ...]:
    """An identity pack's one buffer as a view of ``source`` (the weight's own bytes, the same
    dtype and shape), when it views other memory."""
    src = source if isinstance(source, np.ndarray) else np.frombuffer(source, np.uint8)
    if len(buffers) != 1 or not src.size or np.may_share_memory(buffers[0], src):
        return buffers
    (b,) = buffers
    raw = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    if raw.nbytes != b.nbytes:
        raise RuntimeError(f"Bug: an identity pack of {b.nbytes} bytes for a weight of {raw.nbytes}")
    return (raw.view(b.dtype).reshape(b.shape),)


class SaveRecord:
    """Save mode: collects packs per (scope path, weight name); implements ``SaveExtras``."""

    def __init__(self) -> None:
        self._weights: dict[tuple[str, str], _SavedWeight] = {}
        self._by_key: dict[str, tuple[np.ndarray, ...]] = {}  # one blob per content key
        self._places: dict[tuple[str, str], Any] = {}  # where each weight itself was written

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
        if getattr(spec, "identity", False):
            # The pack is this weight's own bytes: the saver records it at the weight's offset,
            # so it must be a view of this weight, not of an equal one packed first (the
            # container hands every weight with the same bytes the first one's view: recorded at
            # that weight's offset, the loader refused it as overlapping another weight).
            buffers = _own_view(packed.buffers, source)
        else:
            buffers = self._by_key.setdefault(key, _apart_from(packed.buffers, source))
        if all(k != key for k, _ in entry.packs):
            entry.packs.append((key, buffers))
        return key

    # -- SaveExtras -----------------------------------------------------------------------------
    def names(self, scope_path: str) -> list[str]:
        return [name for scope, name in self._weights if scope == scope_path]

    def blobs(self, scope_path: str, name: str) -> list[np.ndarray]:
        entry = self._weights.get((scope_path, name))
        if entry is None:
            return []
        return [b for _key, buffers in entry.packs for b in buffers]

    def weights_placed(self, places: dict[tuple[str, str], Any]) -> None:
        self._places = dict(places)

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
            # The weight's own offset in the data file binds the record to those bytes: a model
            # whose initializer was re-pointed (offsets swapped between equal-length weights,
            # scopes renamed) no longer matches, even while the file is trusted unread.
            own = self._places.get((scope, name))
            source_offset = own.offset if own is not None and own.length == entry.length else None
            record = fmt.WeightRecord(
                scope=scope, name=name, source_length=entry.length, source_offset=source_offset,
                source_digest=(entry.digest + entry.sample).hex(), packs=tuple(packs),
            )
            rk, value = fmt.format_record(record)
            out[rk] = value
        return out

    def manifest(self, metadata: dict[str, str]) -> bytes:
        self._manifest = fmt.manifest_bytes(metadata.items())
        return self._manifest

    def sealed(self, location: str, manifest_offset: int, identity: tuple[int, ...]) -> dict[str, str]:
        m = self._manifest
        digest = hashlib.blake2b(m, digest_size=32).hexdigest()
        key, value = fmt.format_file_record(fmt.FileRecord(location, tuple(identity), manifest_offset, len(m), digest))
        return {key: value}


# Full digests of external source weights are computed reading the file in chunks of this size
# with pread: the weight's pages are not mapped into the process (its RSS stays as it was).
_DIGEST_CHUNK = 4 << 20


def _file_full_digest(external: Any) -> bytes | None:
    """:func:`full_digest` of an external weight read with ``os.pread``, not through the mapping;
    ``None`` (use the mapping) when the file on disk is no longer the one mapped."""
    try:
        fd = os.open(external.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError:
        return None
    try:
        if stat_identity(os.fstat(fd)) != tuple(external.file_id):
            return None
        h = hashlib.blake2b(digest_size=KEY_DIGEST_SIZE)
        pos, end = external.offset, external.offset + external.length
        while pos < end:
            chunk = os.pread(fd, min(_DIGEST_CHUNK, end - pos), pos)
            if not chunk:
                return None
            h.update(chunk)
            pos += len(chunk)
        return h.digest()
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class _State:
    """How one data file's blobs are checked: ``mode`` ``trusted`` (its seal holds) or ``verify``
    (digests, checksums and fresh packs); its manifest (key digest -> value digest); its record
    index where the file is trusted and has one."""

    mode: str
    manifest: dict[bytes, bytes]
    index: fmt.RecordIndex | None = None


class _FileRejected(PrepackFormatError):
    """Every record of one data file is unusable (reported once for the file, not per weight)."""


class LoadRecord:
    """Load mode: the records found in a model, validated lazily per weight.

    How much is checked before a blob is used depends on the seal of its data file (see
    ``entry_format``): records that do not match the data file's manifest are never used; a file
    with its identity unchanged since it was written is trusted without reading a weight (bounds,
    overlaps, sizes, dtypes, the kernel's check and the checksums of small blobs still apply); a
    file without a seal or with another identity (copied, replaced, written since) — and every
    file under ``verify`` — has every source weight digested and every blob checksummed in full.
    Sources stored inside the model proto are always digested in full.
    """

    def __init__(self, model: Any, *, verify: bool = False) -> None:
        self.model = model
        self.verify = verify
        self.rejected = 0
        self._failed: set[tuple[str, str, str]] = set()  # (scope, name, reason): warn once each
        self._records: dict[tuple[str, str], fmt.WeightRecord] = {}
        # Records sealed by a trusted file's record index, built from it when first asked for.
        self._indexed: dict[tuple[str, str], tuple[fmt.RecordIndex, int]] = {}
        # The record's key and value as stored, and once known their digests (for the manifest).
        self._stored: dict[tuple[str, str], tuple[str, str]] = {}
        self._digests: dict[tuple[str, str], tuple[bytes, bytes]] = {}
        self._files: dict[str, fmt.FileRecord | None] = {}
        self._states: dict[str, _State | PrepackFormatError] = {}
        self._warned_files: set[str] = set()
        self._ranges: tuple[dict[str, tuple[list, list]], set] | None = None
        self._buffers: dict[str, tuple[Any, int]] = {}  # data file -> (mapping, size), as first looked up
        props = [(p.key, p.value) for p in model.proto.metadata_props[:]]
        counts: dict[str, int] = {}
        for key, _ in props:
            counts[key] = counts.get(key, 0) + 1
        for key, value in props:
            if fmt.is_file_key(key):
                try:
                    rec = fmt.parse_file_record(key, value)
                except PrepackFormatError as exc:
                    _warn(f"data file record {key[:200]!r} ignored (blobs are verified in full): {exc}")
                    continue
                # Two records for one file: neither is believed.
                self._files[rec.location] = None if rec.location in self._files else rec
        indexes = self._trusted_indexes()
        for key, value in props:
            if not fmt.is_record_key(key):
                continue
            if counts[key] > 1:
                if counts[key] > 0:
                    self.rejected += 1
                    _warn(f"pre-packed record {key[:200]!r} appears {counts[key]} times: every copy ignored "
                          "(the weight will be re-packed)")
                    counts[key] = -1
                continue
            if counts[key] < 0:
                continue
            if indexes and self._from_index(key, value, indexes):
                continue
            try:
                rec = fmt.parse_record(key, value)
            except PrepackFormatError as exc:
                self.rejected += 1
                _warn(f"pre-packed record {key[:200]!r} ignored (the weight will be re-packed): {exc}")
                continue
            self._records[(rec.scope, rec.name)] = rec
            self._stored[(rec.scope, rec.name)] = (key, value)

    def _trusted_indexes(self) -> list[tuple[dict[bytes, bytes], fmt.RecordIndex, str]]:
        """(manifest, record index, data file) of every data file whose seal holds and whose manifest has an
        index (a file that is not trusted, or a version-1 manifest, has none: its records' JSON is
        parsed and checked as always)."""
        out = []
        for location, seal in self._files.items():
            if seal is None:
                continue
            try:
                state = self._state(location)
            except _FileRejected:
                continue  # reported when one of its blobs is looked up
            if state.mode == "trusted" and state.index is not None:
                out.append((state.manifest, state.index, location))
        return out

    def _from_index(self, key: str, value: str, indexes: list) -> bool:
        """Registers the record stored as (``key``, ``value``) to be built from a trusted index
        whose manifest sealed exactly this key and value; False when none did."""
        kd, vd = fmt._entry(key, value)
        for manifest, index, location in indexes:
            if manifest.get(kd) != vd:
                continue
            row = index.row(kd)
            if row is None:
                return False
            scope, name = index.names(row)
            if fmt._key_of(scope, name) != key:
                return False  # the JSON path names the mismatch
            self._indexed[(scope, name)] = (index, row, location)
            self._stored[(scope, name)] = (key, value)
            self._digests[(scope, name)] = (kd, vd)
            return True
        return False

    def __len__(self) -> int:
        return len(self._records) + len(self._indexed)

    def has(self, scope: str, name: str) -> bool:
        return (scope, name) in self._records or (scope, name) in self._indexed

    def _record(self, scope: str, name: str) -> fmt.WeightRecord | None:
        rec = self._records.get((scope, name))
        if rec is None and (scope, name) in self._indexed:
            index, row, _ = self._indexed.pop((scope, name))
            try:
                rec = self._records[(scope, name)] = index.record(row)
            except PrepackFormatError as exc:  # (the index's checks make this a bug)
                self.rejected += 1
                _warn(f"pre-packed record of weight {name!r} in the record index ignored, re-packing: {exc}")
        return rec

    def find(self, scope: str, name: str, raw: Any, spec: Any, dtype: Any, shape: Sequence[int],
             check: Any, external: Any = None, repack: Any = None) -> PrePackedWeights | None:
        """Mapped buffers for this weight and kernel spec, or None (with a warning if unusable).

        ``raw`` returns the source weight's bytes (read only when it must be digested);
        ``check(buffers)`` is the kernel's own validation (None when fine, else a reason);
        ``repack()`` packs the weight now (the kernel's ``prepack``), called only by a full
        verification, which compares the blob with it.
        """
        indexed = self._indexed.get((scope, name))
        if indexed is not None and external is not None:
            try:
                mapped = self._find_row(*indexed, scope, name, spec, dtype, shape, check, external)
            except (PrepackFormatError, OnnxpackError, ValueError):
                mapped = None  # _find reports it
            if mapped is not None:
                return mapped
        rec = self._record(scope, name)
        if rec is None:
            return None
        try:
            return self._find(rec, raw, spec, dtype, shape, check, external, repack)
        except _FileRejected as exc:
            seen = (scope, name, "file")
            if seen not in self._failed:
                self._failed.add(seen)
                self.rejected += 1
            if str(exc) not in self._warned_files:
                self._warned_files.add(str(exc))
                _warn(f"pre-packed blobs ignored, re-packing: {exc}")
            return None
        except (PrepackFormatError, OnnxpackError, ValueError) as exc:
            # A weight with several consumers is looked up once per consumer; the same failure
            # is one warning (and one rejected blob), not one per consumer.
            seen = (scope, name, str(exc))
            if seen not in self._failed:
                self._failed.add(seen)
                self.rejected += 1
                _warn(f"{_where(scope, name)} ignored, re-packing: {exc}")
            return None

    def _find_row(self, index: fmt.RecordIndex, row: int, location: str, scope: str, name: str, spec: Any,
                  dtype: Any, shape: Sequence[int], check: Any, external: Any) -> PrePackedWeights | None:
        """:meth:`_find` of an indexed record in its common form — one pack of one buffer in the
        trusted data file whose index lists it, bound to its weight's bytes in that file — read
        straight from the index rows, without building the record.  It only accepts: whenever
        any of :meth:`_find`'s checks would not pass (or the record is not of this form), it
        returns None and :meth:`_find` decides, with its errors and warnings.  (A warm start looks
        up every packed weight this way: an LLM's 242.)"""
        _scope, _name, digest_hex, packs = index.row_texts(row)
        if len(packs) != 1 or len(packs[0][1]) != 1 or packs[0][1][0] != location or len(digest_hex) != 64:
            return None
        key = packs[0][0]
        if key != content_key(spec, bytes.fromhex(digest_hex[:32]), dtype, shape) or external.location != location:
            return None
        source_offset, source_length, b = index.row_source(row)
        if source_offset != external.offset or source_length != external.length:
            return None  # (no offset recorded: _find digests the weight)
        state = self._states.get(location)
        if state is None or state.__class__ is not _State or state.mode != "trusted":
            return None
        # (The manifest binds this record: _from_index registered it only when it did.)
        offset, length = b[5], b[6]
        data, size = self._mapping(location, scope, name)
        end = offset + length
        if end > size:
            return None
        if not (getattr(spec, "identity", False) and offset == external.offset and length == external.length):
            weights, conflicts = self._occupied()
            if length and (location, offset, end, key) in conflicts:
                return None
            starts, reach = weights.get(location, ((), ()))
            k = bisect.bisect_left(starts, end)
            if length and k and reach[k - 1][0] > offset:
                return None
        view = mapped_view(data, fmt.dtype_of_code(b[2]), tuple(b[7][:b[3]]), offset)
        if length < ALWAYS_VERIFY_BELOW and fmt.crc32(view) != b[1]:
            return None
        views = (view,)
        if check(views) is not None:
            return None
        return PrePackedWeights(key, views, "model", self.model.check_files)

    def _state(self, location: str) -> _State:
        """How the blobs in data file ``location`` are checked (see :class:`_State`); raises
        :class:`_FileRejected` when the file's seal and manifest disagree."""
        state = self._states.get(location)
        if state is None:
            try:
                state = self._seal_state(location)
            except PrepackFormatError as exc:
                state = _FileRejected(f"data file {location!r}: {exc}")
            self._states[location] = state
        if isinstance(state, PrepackFormatError):
            raise state
        return state

    def _seal_state(self, location: str) -> _State:
        seal = self._files.get(location)
        if seal is None:
            raise PrepackFormatError(
                "no seal for this data file (saved by an older onnxpack, or its record was removed): "
                "re-run onnxpack optimize"
            )
        data, size = self.model.data_buffer(location, f"manifest of data file {location!r}")
        end = seal.manifest_offset + seal.manifest_length
        if end > size:
            raise PrepackFormatError(f"the manifest [{seal.manifest_offset}, {end}) lies outside the file of {size} bytes")
        raw = bytes(memoryview(data)[seal.manifest_offset:end])
        if hashlib.blake2b(raw, digest_size=32).hexdigest() != seal.manifest_digest:
            raise PrepackFormatError("the manifest in the data file is not the one this model was saved with "
                                     "(a data file from another save)")
        trusted = self.model.data_identity(location) == seal.identity and not self.verify
        index = problem = None
        if trusted and raw[:16] == fmt.MANIFEST_MAGIC_V2:
            try:
                index = fmt.RecordIndex(raw)  # parses the manifest's entries too
            except PrepackFormatError as exc:
                problem = exc
        manifest = fmt.parse_manifest(raw) if index is None else index.manifest
        if problem is not None:
            # The records' JSON is still there and sealed: they are parsed as before.
            _warn(f"record index of data file {location!r} ignored (its records are read from the model): {problem}")
        return _State("trusted" if trusted else "verify", manifest, index)

    def _find(self, rec: fmt.WeightRecord, raw: Any, spec: Any, dtype: Any, shape: Sequence[int], check: Any,
              external: Any = None, repack: Any = None) -> PrePackedWeights | None:
        digest_hex = rec.source_digest
        if len(digest_hex) != 64:
            raise PrepackFormatError(f"source digest: expected 64 hex digits, got {len(digest_hex)}")
        digest = bytes.fromhex(digest_hex[:32])
        key = content_key(spec, digest, dtype, shape)
        for pack in rec.packs:
            if pack.key == key:
                break
        else:
            fam = f"{spec.family}/{spec.version}"
            raise PrepackFormatError(
                f"no pack for kernel {fam} with this weight's dtype/shape, the kernel's pack attributes and the "
                f"chain it is computed by (record has {[p.key.rsplit('/', 1)[0] for p in rec.packs]})"
            )
        buffers = pack.buffers
        location = buffers[0].location
        if len(buffers) > 1 and any(b.location != location for b in buffers):
            raise PrepackFormatError(f"the pack's buffers lie in several files {sorted({b.location for b in buffers})}")
        if external is not None and external.location != location:
            raise PrepackFormatError(
                f"the blob lies in {location!r}, not in {external.location!r} with its weight: the record "
                "points at another file"
            )
        state = self._state(location)
        manifest, full = state.manifest, state.mode == "verify"
        # The weight's own bytes, where an identity pack may point (see ``PackSpec.identity``).
        own = (location, external.offset, external.length) if external is not None and getattr(spec, "identity", False) else None
        views = self._views(pack, rec, key, own)  # bounds and overlaps: the record's structure
        digests = self._digests.get((rec.scope, rec.name))
        if digests is None:
            digests = self._digests[(rec.scope, rec.name)] = fmt._entry(*self._stored[(rec.scope, rec.name)])
        if manifest.get(digests[0]) != digests[1]:
            raise PrepackFormatError(
                "the record does not match the data file's manifest (edited, added or moved to this "
                "weight after saving): its blobs are not bound to this weight"
            )
        if external is not None:
            if external.length != rec.source_length:
                raise PrepackFormatError(
                    f"stale: weight has {external.length} bytes, record says {rec.source_length}")
            if rec.source_offset is not None and rec.source_offset != external.offset:
                raise PrepackFormatError(
                    f"the weight's bytes are at offset {external.offset} of {external.location!r}, the record's "
                    f"were saved at {rec.source_offset}: the initializer was re-pointed at other bytes")
            # A record without the weight's offset (saved from an in-proto weight, or by an older
            # onnxpack) is not bound to these bytes: they are digested even in a trusted file.
            if full or rec.source_offset is None:
                got = _file_full_digest(external)
                if got is None:
                    got = full_digest(raw())
                if got != digest:
                    raise PrepackFormatError("stale: the weight's bytes changed since the blob was saved")
        else:
            source = raw()
            nbytes = source.nbytes if isinstance(source, (memoryview, np.ndarray)) else len(source)
            if nbytes != rec.source_length:
                raise PrepackFormatError(f"stale: weight has {nbytes} bytes, record says {rec.source_length}")
            if full_digest(source) != digest:
                raise PrepackFormatError("stale: the weight's bytes changed since the blob was saved")
        for i, b in enumerate(buffers):
            # The CRC first even when the pack is compared below: it tells corrupt bytes from a
            # record bound to another blob (and costs a quarter of the comparison).
            if (full or b.length < ALWAYS_VERIFY_BELOW) and fmt.checksum(views[i]) != b.checksum:
                raise PrepackFormatError(f"buffer {i}: checksum {fmt.checksum(views[i])} != recorded {b.checksum}")
        reason = check(views)
        if reason is not None:
            raise PrepackFormatError(f"kernel rejects the blob: {reason}")
        if full and repack is not None:
            # Digests and CRCs bind the record to the weight and the blob to the record, but a
            # record is text anyone can rewrite together with its CRCs and, once the file's identity
            # is gone, with the manifest: only the weight's own pack proves which blob is its pack.
            mismatch = pack_differs(repack(), views)
            if mismatch:
                raise PrepackFormatError(
                    f"the blob is not this weight's pack ({mismatch}): the record binds another blob")
        return PrePackedWeights(key, views, "model", self.model.check_files)

    def _mapping(self, location: str, scope: str, name: str) -> tuple[Any, int]:
        """(the mapping of data file ``location``, every view a slice of it; its size), mapped
        when first asked for (``scope``/``name``: the blob that asks, named in errors)."""
        got = self._buffers.get(location)
        if got is None:
            data, size = self.model.data_buffer(location, _where(scope, name))
            whole = byte_array(data)  # every view a slice of it (see mapped_view)
            got = self._buffers[location] = (data if whole is None else whole, size)
        return got

    def _views(self, pack: fmt.PackRecord, rec: fmt.WeightRecord, key: str,
               own: tuple[str, int, int] | None = None) -> tuple[np.ndarray, ...]:
        """Views of ``pack`` (of ``rec``)'s buffers after the bounds and overlap checks."""
        views = []
        for i, b in enumerate(pack.buffers):
            data, size = self._mapping(b.location, rec.scope, rec.name)
            if b.offset + b.length > size:
                raise PrepackFormatError(
                    f"buffer {i} [{b.offset}, {b.offset + b.length}) lies outside {b.location!r} of {size} bytes"
                )
            if own is None or (b.location, b.offset, b.length) != own:
                self._check_overlap(i, b, key)
            views.append(b.view(data, size))
        return tuple(views)

    def _occupied(self) -> tuple[dict[str, tuple[list, list]], set]:
        """:func:`_occupied_ranges` of the model's weights and every record's buffers, made once."""
        if self._ranges is None:
            spans = [(b.location, b.offset, b.offset + b.length, p.key)
                     for rec in self._records.values() for p in rec.packs for b in p.buffers]
            for index in {id(ix): ix for ix, _, _ in self._indexed.values()}.values():
                spans.extend(index.spans())
            self._ranges = _occupied_ranges(self.model, spans)
        return self._ranges

    def _check_overlap(self, i: int, b: fmt.BufferRecord, key: str) -> None:
        """Refuses a buffer whose bytes overlap a weight or another record's buffer.

        Why: blobs of at least ``ALWAYS_VERIFY_BELOW`` bytes are not CRC-checked at load, so a
        record whose offset was corrupted (or copied from another layout) would otherwise hand a
        kernel the wrong bytes and give silently wrong outputs (found by the reliability fuzzer).
        Our saver never lets a blob overlap a weight or a different blob, and both facts are
        known without reading a byte.  The same range under the same key (two equal weights
        sharing one blob) is fine.
        """
        weights, conflicts = self._occupied()
        end = b.offset + b.length
        if b.length and (b.location, b.offset, end, key) in conflicts:
            raise PrepackFormatError(
                f"buffer {i} [{b.offset}, {end}) in {b.location!r} overlaps another record's buffer"
            )
        starts, reach = weights.get(b.location, ((), ()))
        k = bisect.bisect_left(starts, end)  # weights starting before the buffer ends
        if b.length and k and reach[k - 1][0] > b.offset:
            stop, start, name = reach[k - 1]
            raise PrepackFormatError(
                f"buffer {i} [{b.offset}, {end}) in {b.location!r} overlaps the bytes "
                f"[{start}, {stop}) of weight {name!r}: the record points at the wrong bytes"
            )


def pack_differs(fresh: Any, views: Sequence[np.ndarray]) -> str | None:
    """Why the buffers ``fresh`` (a pack made now) are not bit-identical to ``views``, or None."""
    if fresh is None:
        return "the kernel declines to pack this weight"
    fresh = tuple(fresh)
    if len(fresh) != len(views):
        return f"{len(fresh)} buffers, the blob has {len(views)}"
    for i, (a, b) in enumerate(zip(fresh, views)):
        a = np.asarray(a)
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"buffer {i} is {a.dtype}{list(a.shape)}, the blob's {b.dtype}{list(b.shape)}"
        # Bytes, not values: NaN payloads and -0.0 must match too (~8 GB/s; memoryview's == is 0.5).
        if a.size and not np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                                         np.ascontiguousarray(b).reshape(-1).view(np.uint8)):
            return f"buffer {i} holds other bytes"
    return None


def _occupied_ranges(model: Any, buffers: Any) -> tuple[dict[str, tuple[list, list]], set]:
    """(location -> (sorted weight starts, running max of (end, start, name)), set of record
    buffers that overlap another one) for ``buffers`` (location, offset, end, pack key) of the
    records; O(log n) per lookup, so large models stay cheap."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for scope in model.scopes():
        for name, tensor in scope.initializers.items():
            ext = tensor.external
            if ext is not None and ext.length:
                ranges.setdefault(ext.location, []).append((ext.offset, ext.offset + ext.length, name))
    weights: dict[str, tuple[list, list]] = {}
    for location, items in ranges.items():
        items.sort()
        reach: list[tuple[int, int, str]] = []
        for start, stop, name in items:
            reach.append(max(reach[-1], (stop, start, name)) if reach else (stop, start, name))
        weights[location] = ([start for start, _, _ in items], reach)
    own = {(loc, start, stop) for loc, items in ranges.items() for start, stop, _ in items}
    spans = sorted(  # buffers pointing exactly at a weight are identity packs, checked apart
        span for span in buffers if span[2] > span[1] and span[:3] not in own
    )
    conflicts: set = set()
    prev = None  # the span reaching furthest so far in the current location
    for span in spans:
        if prev is not None and prev[0] == span[0] and span[1] < prev[2] and span[1:] != prev[1:]:
            conflicts.add(span)
            conflicts.add(prev)
        if prev is None or prev[0] != span[0] or span[2] > prev[2]:
            prev = span
    return weights, conflicts
