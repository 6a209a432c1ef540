"""Externalize every scope's initializers into one aligned data file and save atomically.

Layout
------
Scopes are visited bottom-up (:func:`walk`); in each, dense initializers in graph order, then
sparse initializers' values/indices, then external tensors held by node attributes, then the
blobs of the scope's other packed names (``SaveExtras.names``: Constant-node tensors, which stay
in the proto).  Each initializer's pre-packed blobs (``SaveExtras.blobs``) follow it directly.  Every tensor and blob
starts at a multiple of :data:`ALIGNMENT`; those of at least ``align_threshold`` bytes start at
a multiple of ``allocation_granularity`` so they can be mapped on their own and share no page with
a neighbour.  Offsets come from the pure :func:`compute_offset`.

Crash safety and the input
--------------------------
The data file is written to a temp name in the target folder, fsynced and renamed, then the
model the same way (data first, model last), then the folder is fsynced.  Nothing the input
model uses is ever opened for writing.

Replacing a data file that some model references would silently change that model's weights
(and, after a crash, tear the pair).  So the data file name is chosen among ``location``,
``<root>.1<ext>``, ``<root>.2<ext>``… : the first name that does not exist — an existing file is
never replaced, not even the data file of the model currently at the output path, since that
model reads it until the new model's rename commits the save.  Once committed, the old output's
own data files are removed, unless the input reads them (compared by device+inode, so hard links
count; a symlink is never removed); re-saving an output therefore alternates between two names.
A crash leaves the old pair or the new one (and, at worst, an unreferenced new data file).
Optimizing a model in place leaves every earlier data file on disk, since another model may share
it — :class:`SaveResult` reports the name used.  The output model path itself may be the input
model (in place) but never one of the input's data files.

After the data file is renamed into place, the prepack layer's ``SaveExtras.sealed`` records the
file's identity (device, inode, size, mtime, ctime) and the offset of the manifest it appended,
so a later load can tell, without reading weights, whether the file is still the one written.
Renaming over a file that is mapped is safe on POSIX: the old inode lives until unmapped, so
views into the input stay valid.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import sys
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from onnxpack._io import atomic_write
from onnxpack.errors import InvalidArgument, OnnxpackError
from onnxpack.graph._external import RESERVED_KEYS, read_regular_file, stat_identity
from onnxpack.graph._model import Model, Scope, subgraphs_of, walk
from onnxpack.graph._proto import AttributeProto, GraphProto, ModelProto, TensorProto
from onnxpack.graph._tensor import Tensor

__all__ = [
    "ALIGNMENT",
    "DEFAULT_ALIGN_THRESHOLD",
    "PREPACKED_METADATA_PREFIX",
    "BlobPlacement",
    "SaveExtras",
    "SaveResult",
    "compute_offset",
    "save_model",
]

logger = logging.getLogger(__name__)

# Every tensor and blob starts on 64 bytes: a cache line and the widest SIMD load (AVX-512), and
# onnxruntime crashes on pre-packed blobs at offsets that are not multiples of 64.
ALIGNMENT = 64

# Tensors of at least this many bytes start on an allocation-granularity boundary.  Measured by
# ``benchmarks/bench_load.py`` (results/load.json, "align"; layout of 64 weights each followed by
# a 1 KB bias, 4 KiB pages): page-aligning a weight costs ~half a page of file padding and saves
# at most one page spanned when that weight is read alone (prepack load mode never touches the
# originals, so a blob must not drag a neighbour's boundary page in, and vice versa).
#   tensor   4 KiB: +59% file, 43% fewer pages   16 KiB: +17% / 16%   64 KiB: +4.5% / 4.5%
#   256 KiB: +1.2% / 1.2%                         1 MiB: +0.3% / 0.3%
# 64 KiB is the smallest size where the file grows by under 5%; below it padding dominates the
# file, above it the saving is still worth a page per tensor for the many 64 KiB–1 MiB weights
# (conv kernels, small projections) that onnx-ir's and onnxruntime's 1 MiB threshold leaves
# sharing pages with neighbours.
DEFAULT_ALIGN_THRESHOLD = 64 * 1024

# Model-level metadata_props under this prefix belong to the prepack layer and describe offsets
# in one specific data file layout: they are dropped on save unless ``extra.metadata`` returns
# them again for the new layout.
PREPACKED_METADATA_PREFIX = "onnxpack.prepacked/"

# external_data keys onnxruntime writes for its own pre-packed blobs ("prepacked_*").  They hold
# offsets into the *old* data file; after we relayout the file they would point at unrelated
# bytes and onnxruntime would hand garbage to its kernels.  Other unknown keys are kept.
_STALE_KEY_PREFIXES = ("prepacked",)

_WRITE_CHUNK = 16 << 20  # copy large tensors in 16 MiB pieces: bounded page-cache dirtiness
_ZEROS = bytes(1 << 16)


@dataclasses.dataclass(frozen=True)
class BlobPlacement:
    """Where one blob landed in the data file."""

    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """What :func:`save_model` wrote.

    Attributes:
        model_path: absolute path of the model file.
        data_path: absolute path of the data file, or ``None`` when nothing was externalized.
        location: the data file name written into the model (may differ from the requested one,
            see the module docstring).
        tensors_written: number of tensors stored in the data file.
        bytes_written: size of the data file.
        placements: ``(scope_path, initializer name) -> blob placements`` of the extras.
        tensor_bytes: bytes of the tensors stored in the data file (padding and blobs excluded).
    """

    model_path: str
    data_path: str | None
    location: str | None
    tensors_written: int
    bytes_written: int
    placements: dict[tuple[str, str], list[BlobPlacement]]
    tensor_bytes: int = 0


@runtime_checkable
class SaveExtras(Protocol):
    """Hook through which the prepack layer appends blobs after weights.

    ``weights_placed``, ``manifest`` and ``sealed`` are optional: an extra without the last two
    writes no seal.
    """

    def blobs(self, scope_path: str, name: str) -> Sequence[np.ndarray]:
        """Blobs to write right after initializer ``name`` of scope ``scope_path``."""
        ...

    def names(self, scope_path: str) -> Sequence[str]:
        """Every name of scope ``scope_path`` that has blobs.  Optional: names that are not
        initializers of the scope (a ``Constant`` node's output whose tensor a kernel packed) get
        their blobs after the scope's initializers; without this method they are not saved."""
        ...

    def weights_placed(self, places: dict[tuple[str, str], BlobPlacement]) -> None:
        """Where each initializer itself landed in the data file, told before ``metadata``: a
        record binds its blobs to the weight's bytes at that offset (a model whose initializers
        were re-pointed at other bytes no longer matches it)."""
        ...

    def metadata(self, placements: dict[tuple[str, str], list[BlobPlacement]],
                 location: str | None) -> dict[str, str]:
        """Model metadata_props entries to add or replace, given where the blobs landed and the
        data file name actually used (``None`` when nothing went to a data file)."""
        ...

    def manifest(self, metadata: dict[str, str]) -> bytes:
        """Bytes to append to the data file that seal ``metadata`` (b"" for none)."""
        ...

    def sealed(self, location: str, manifest_offset: int, identity: tuple[int, ...]) -> dict[str, str]:
        """metadata_props entries known only once the data file is written: where the manifest
        landed and the file's ``stat_identity`` right after its rename."""
        ...


def compute_offset(current: int, size: int, *, align_threshold: int,
                   allocation_granularity: int, alignment: int = ALIGNMENT) -> int:
    """Start offset for the next item of ``size`` bytes when the file currently ends at ``current``.

    Items of at least ``align_threshold`` bytes go to a multiple of both ``allocation_granularity``
    and ``alignment``; all others to a multiple of ``alignment``.
    """
    step = math.lcm(alignment, allocation_granularity) if size >= align_threshold else alignment
    return -(-current // step) * step


def _check_args(min_size: int, align_threshold: int, allocation_granularity: int) -> None:
    for name, value, low in (("min_size", min_size, 0), ("align_threshold", align_threshold, 0),
                             ("allocation_granularity", allocation_granularity, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidArgument(f"save_model: {name} must be an integer >= {low}, got {value!r}")


def _check_location(location: str) -> None:
    if (not location or "\x00" in location or "/" in location or "\\" in location
            or location in (".", "..") or ":" in location):
        raise InvalidArgument(
            f"save_model: location must be a plain file name in the model's folder, got {location!r}"
        )


def _kept_keys(src: TensorProto) -> list[tuple[str, str]]:
    return [(e.key, e.value) for e in src.external_data
            if e.key not in RESERVED_KEYS and not e.key.startswith(_STALE_KEY_PREFIXES)]


def _clear_data(t: TensorProto) -> None:
    for field in ("raw_data", "float_data", "int32_data", "string_data", "int64_data",
                  "double_data", "uint64_data", "external_data"):
        t.ClearField(field)


def _inline(dst: TensorProto, src: Tensor) -> None:
    raw = bytes(src.raw())
    _clear_data(dst)
    dst.data_location = TensorProto.DEFAULT
    dst.raw_data = raw


def _graph_tensors(graph: GraphProto):
    """Yields every TensorProto held by node attributes of ``graph`` (not nested graphs)."""
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == AttributeProto.TENSORS:
                yield from attr.tensors
            elif attr.type == AttributeProto.SPARSE_TENSOR:
                yield attr.sparse_tensor.values
                yield attr.sparse_tensor.indices
            elif attr.type == AttributeProto.SPARSE_TENSORS:
                for sp in attr.sparse_tensors:
                    yield sp.values
                    yield sp.indices


def _external_locations(graph: GraphProto, out: set[str]) -> None:
    """Collects every external location string in ``graph`` and its subgraphs."""
    tensors = list(graph.initializer) + list(_graph_tensors(graph))
    for sp in graph.sparse_initializer:
        tensors += [sp.values, sp.indices]
    for t in tensors:
        if t.data_location == TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    out.add(e.value)
    for node in graph.node:
        for _, _, g in subgraphs_of(node):
            _external_locations(g, out)


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _old_output_data(model: Model, out_path: str) -> dict[str, tuple[int, int]]:
    """Data files the save may remove once the new model is in place: those of the model
    currently at ``out_path`` (re-saving an output drops its own data), minus every file the input
    reads; path -> (device, inode) as seen now.

    Nothing else is removed, whatever its name: a data file the input no longer references after
    an earlier in-place save may still be another model's, and removing it would take that
    model's weights away.
    """
    inputs = {i for i in map(_inode, model.data_paths()) if i is not None}
    if model.path is not None and (i := _inode(model.path)) is not None:
        inputs.add(i)
    old: dict[str, tuple[int, int]] = {}
    if os.path.isfile(out_path) and _inode(out_path) not in inputs:
        try:
            existing = ModelProto.FromString(read_regular_file(out_path, "model file", (2 << 30) - 1, OSError))
        except Exception:  # not a model we can read: nobody we know depends on its data
            existing = None
        if existing is not None:
            locations: set[str] = set()
            _external_locations(existing.graph, locations)
            folder = os.path.dirname(out_path)
            for loc in locations:
                if "\x00" in loc:
                    continue
                path = os.path.join(folder, loc)
                if not os.path.islink(path) and os.path.isfile(path) and (i := _inode(path)) is not None and i not in inputs:
                    old[os.path.normpath(path)] = i
    return old


def _choose_data_name(folder: str, location: str) -> str:
    """``location``, or ``<root>.1<ext>``, ``<root>.2<ext>`` …: the first name not in use.  An
    existing file is never replaced — not even the old output's own data file, which the old model
    reads until the new model's rename commits the save (replacing it first would leave the old
    model reading the new layout if the save died in between)."""
    root, ext = os.path.splitext(location)
    n = 0
    candidate = location
    while os.path.lexists(os.path.join(folder, candidate)):
        n += 1
        candidate = f"{root}.{n}{ext}"
    return candidate


def _remove_old_data(old: dict[str, tuple[int, int]], keep: str | None) -> None:
    """After the commit: the old output's data files, unless replaced since (another inode) or
    now ours.  Best effort: a file left behind is only disk space."""
    for path, inode in old.items():
        if keep is not None and os.path.normpath(path) == os.path.normpath(keep):
            continue
        try:
            if _inode(path) == inode and not os.path.islink(path):
                os.unlink(path)
        except OSError as e:
            logger.info("old data file %r left in place: %s", path, e)


def _check_output_path(model: Model, out_path: str) -> None:
    """The output model may replace the input model file (in place), never a file the input
    reads its weights from."""
    target = _inode(out_path)
    if target is None:
        return
    if target in {i for i in map(_inode, model.data_paths()) if i is not None}:
        raise InvalidArgument(
            f"save_model: output path {out_path!r} is an external data file of the input model; "
            "writing there would destroy the weights being saved — choose another output path"
        )


def _atomic_write(folder: str, final_name: str, write) -> None:
    atomic_write(os.path.join(folder, final_name), write)


def _as_bytes(arr: np.ndarray) -> memoryview:
    arr = np.ascontiguousarray(arr).reshape(-1)
    return memoryview(arr.view(np.uint8))


@dataclasses.dataclass
class _Item:
    offset: int
    data: object  # bytes-like


def _settled_identity(path: str) -> tuple[int, ...]:
    """The file's ``stat_identity`` once the clock has moved past its ctime.

    File timestamps come from a coarse clock (one tick: 1-10 ms): a write landing in the same
    tick as the last one leaves ctime unchanged, so a seal taken at once could miss a write made
    right after the save (the fuzz campaign's in-place patches did, now and then).  Waiting until
    the coarse clock is a tick past ctime makes every later write move it.  Costs at most ~2 ticks
    per save, bounded by 50 ms (a ctime in the future, from clock skew, is not waited for)."""
    st = os.stat(path)
    clock = getattr(time, "CLOCK_REALTIME_COARSE", 5 if sys.platform.startswith("linux") else time.CLOCK_REALTIME)
    try:
        tick = max(time.clock_getres(clock), 1e-6)
    except OSError:
        clock, tick = time.CLOCK_REALTIME, 0.01
    tick_ns = int(tick * 1e9)
    deadline = time.monotonic() + 0.05
    while time.clock_gettime_ns(clock) <= st.st_ctime_ns + tick_ns and time.monotonic() < deadline:
        time.sleep(tick / 2)
    return stat_identity(os.stat(path))


def save_model(
    model: Model | ModelProto,
    path: str | os.PathLike,
    *,
    location: str | None = None,
    min_size: int = 1024,
    align_threshold: int = DEFAULT_ALIGN_THRESHOLD,
    allocation_granularity: int = mmap.ALLOCATIONGRANULARITY,
    extra: SaveExtras | None = None,
) -> SaveResult:
    """Writes ``model`` to ``path`` with its large tensors in one aligned external data file.

    Args:
        model: a loaded :class:`Model` (its external data is read through its mappings) or a
            ModelProto whose data is all in-proto.
        path: output model file; its folder must exist.
        location: data file name (a plain name in the output folder); default
            ``<model file name>.data``.  Another name is used if this one is in use by the input
            or by the model being replaced (see the module docstring).
        min_size: tensors of at least this many bytes go to the data file.  Keep it above the
            size of shape tensors (>= 64): onnxruntime and onnx shape inference refuse Reshape
            shapes and similar inputs stored as external data.
        align_threshold: tensors/blobs of at least this many bytes start on a multiple of
            ``allocation_granularity``.
        allocation_granularity: page alignment for large tensors.
        extra: pre-packed blobs to append after weights, and metadata to record them.

    Returns:
        A :class:`SaveResult`.

    Raises:
        InvalidArgument: bad arguments or output folder.
        ExternalDataError: the input's external data is invalid.
    """
    _check_args(min_size, align_threshold, allocation_granularity)
    if isinstance(model, ModelProto):
        model = Model(model)
    out_path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(out_path)
    if not os.path.isdir(folder):
        raise InvalidArgument(f"save_model: output folder {folder!r} does not exist")
    if location is None:
        location = os.path.basename(out_path) + ".data"
    _check_location(location)
    if location == os.path.basename(out_path):
        raise InvalidArgument(f"save_model: location {location!r} is the model file itself")
    _check_output_path(model, out_path)
    old_data = _old_output_data(model, out_path)

    dst = ModelProto()
    dst.CopyFrom(model.proto)

    # Pair each source scope with the same graph inside the copy (identical structure).
    dst_graph_of: dict[int, GraphProto] = {id(model.root): dst.graph}
    for scope in _top_down(model.root):
        dgraph = dst_graph_of[id(scope)]
        subs = [g for node in dgraph.node for _, _, g in subgraphs_of(node)]
        for child, g in zip(scope.children, subs, strict=True):
            dst_graph_of[id(child)] = g

    items: list[_Item] = []  # in file order
    externalized: list[tuple[TensorProto, list[tuple[str, str]], _Item, int]] = []
    placements: dict[tuple[str, str], list[BlobPlacement]] = {}
    weight_places: dict[tuple[str, str], BlobPlacement] = {}
    blob_seen: dict[int, BlobPlacement] = {}
    keep_alive: list[np.ndarray] = []
    end = 0

    def place(data, length: int) -> _Item:
        nonlocal end
        start = compute_offset(end, length, align_threshold=align_threshold,
                               allocation_granularity=allocation_granularity)
        item = _Item(start, data)
        items.append(item)
        end = start + length
        return item

    def handle(dst_t: TensorProto, src: Tensor, *, only_if_external: bool = False) -> _Item | None:
        is_external = src.external is not None
        if only_if_external and not is_external:
            return None
        big = src.elem_type != TensorProto.STRING and src.nbytes >= min_size and src.nbytes > 0
        if big:
            kept = _kept_keys(src.proto)
            raw = src.raw()
            item = place(raw, src.nbytes)
            externalized.append((dst_t, kept, item, src.nbytes))
            return item
        if is_external:
            _inline(dst_t, src)
        return None

    def blobs_for(scope: Scope, name: str, item: _Item | None = None) -> None:
        if extra is None:
            return
        result = []
        for arr in extra.blobs(scope.path, name):
            arr = np.asarray(arr)
            placed = blob_seen.get(id(arr))
            if placed is None and item is not None and _is_view_of(arr, item.data):
                # A pack that is the weight's own bytes (an fp32 weight BLAS reads as it is) is
                # recorded at the weight's offset instead of being written a second time.
                placed = BlobPlacement(item.offset, int(arr.nbytes))
                keep_alive.append(arr)
                blob_seen[id(arr)] = placed
            if placed is None:
                keep_alive.append(arr)  # ids stay unique while we hold the objects
                view = _as_bytes(arr)
                item = place(view, view.nbytes)
                placed = BlobPlacement(item.offset, view.nbytes)
                blob_seen[id(arr)] = placed
            result.append(placed)
        if result:
            placements[(scope.path, name)] = result

    for scope in walk(model.root):
        dgraph = dst_graph_of[id(scope)]
        sgraph = scope.graph
        names = [t.name for t in sgraph.initializer]
        unique = len(set(names)) == len(names)
        for s_init, d_init in zip(sgraph.initializer, dgraph.initializer, strict=True):
            src = scope.initializers.get(s_init.name) if unique else None
            if src is None:  # duplicate names (invalid, but keep every copy's bytes)
                src = model.tensor(s_init)
            item = handle(d_init, src)
            if item is not None and unique:
                weight_places[(scope.path, s_init.name)] = BlobPlacement(item.offset, src.nbytes)
            blobs_for(scope, s_init.name, item)
        for s_sp, d_sp in zip(sgraph.sparse_initializer, dgraph.sparse_initializer, strict=True):
            handle(d_sp.values, model.tensor(s_sp.values))
            handle(d_sp.indices, model.tensor(s_sp.indices))
            blobs_for(scope, s_sp.values.name)
        for s_t, d_t in zip(_graph_tensors(sgraph), _graph_tensors(dgraph), strict=True):
            if s_t.data_location == TensorProto.EXTERNAL:
                handle(d_t, model.tensor(s_t), only_if_external=True)
        if extra is not None and hasattr(extra, "names"):
            # Blobs of weights that are not initializers (Constant-node tensors), after the rest.
            placed_here = {t.name for t in sgraph.initializer} | {sp.values.name for sp in sgraph.sparse_initializer}
            for name in extra.names(scope.path):
                if name not in placed_here:
                    blobs_for(scope, name)

    data_name = None
    data_path = None
    if items:
        data_name = _choose_data_name(folder, location)
        data_path = os.path.join(folder, data_name)
        if data_name != location:
            logger.info("data file %r is in use; writing %r instead", location, data_name)
    for dst_t, kept, item, length in externalized:
        _clear_data(dst_t)
        dst_t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", data_name), ("offset", str(item.offset)),
                           ("length", str(length)), *kept):
            entry = dst_t.external_data.add()
            entry.key, entry.value = key, value

    # Model metadata: drop the prepack layer's records of the old layout, add the new ones.
    if extra is not None and hasattr(extra, "weights_placed"):
        extra.weights_placed(weight_places if data_name is not None else {})
    new_meta = dict(extra.metadata(placements, data_name)) if extra is not None else {}
    seal = extra is not None and items and new_meta and hasattr(extra, "manifest") and hasattr(extra, "sealed")
    manifest = extra.manifest(new_meta) if seal else b""
    manifest_item = place(manifest, len(manifest)) if manifest else None
    kept_props = [(p.key, p.value) for p in dst.metadata_props
                  if not p.key.startswith(PREPACKED_METADATA_PREFIX) and p.key not in new_meta]
    dst.ClearField("metadata_props")
    for key, value in [*kept_props, *new_meta.items()]:
        prop = dst.metadata_props.add()
        prop.key, prop.value = key, value

    # protobuf's 2 GiB limit, checked before anything is written (the seal adds < 1 KiB).
    if dst.ByteSize() > (2 << 30) - (1 << 20):
        raise InvalidArgument(
            f"save_model: the model proto would be {dst.ByteSize()} bytes, over protobuf's 2 GiB; "
            "lower min_size so more tensors go to the data file"
        )

    def write_data(f) -> None:
        pos = 0
        for item in items:
            pad = item.offset - pos
            while pad > 0:
                n = min(pad, len(_ZEROS))
                f.write(_ZEROS[:n])
                pad -= n
            view = memoryview(item.data).cast("B")
            for i in range(0, len(view), _WRITE_CHUNK):
                f.write(view[i:i + _WRITE_CHUNK])
            pos = item.offset + len(view)

    try:
        if items:
            _atomic_write(folder, data_name, write_data)
            if manifest_item is not None:
                identity = _settled_identity(data_path)
                for key, value in extra.sealed(data_name, manifest_item.offset, identity).items():
                    prop = dst.metadata_props.add()
                    prop.key, prop.value = key, value
        serialized = dst.SerializeToString()
        _atomic_write(folder, os.path.basename(out_path), lambda f: f.write(serialized))
    except OSError as e:
        raise OnnxpackError(f"save_model: cannot write {out_path!r}: {e}") from e
    _remove_old_data(old_data, data_path)
    return SaveResult(out_path, data_path, data_name, len(externalized), end if items else 0,
                      placements, sum(length for *_rest, length in externalized))


def _is_view_of(arr: np.ndarray, data) -> bool:
    """Whether ``arr`` covers exactly the bytes of ``data`` (same start address and length)."""
    try:
        src = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError):
        return False
    if arr.nbytes != src.nbytes or arr.nbytes == 0 or not arr.flags.c_contiguous:
        return False
    return arr.__array_interface__["data"][0] == src.__array_interface__["data"][0]


def _top_down(root: Scope):
    stack = [root]
    while stack:
        scope = stack.pop()
        yield scope
        stack.extend(scope.children)
