"""PrePackedWeights and the keys that name them.

A key is ``<family>/<pack version>/<hex digest>``.  The digest covers the identity of the source
weight (never the packed bytes), its dtype and shape, and the attribute bytes that shape the pack.
It is therefore computable without packing: at a warm load the key comes from the kernel's
``pack_spec`` and the weight's identity alone.

A weight's identity is either the identity of the file region it is mapped from (device, inode,
size, mtime, offset, length: cheap, and stable across process starts while the file is unchanged)
or, for weights stored inside the proto or given by the user, a digest of its bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from onnxpack._frozen import fast_init
from onnxpack.graph import ExternalLocation, Tensor
from onnxpack.graph._proto import np_dtype_to_tensor_dtype

__all__ = ["PackSpec", "PrePackedWeights", "WeightRef", "make_key", "content_identity", "file_identity", "freeze",
           "sample_digest", "full_digest"]

# 16 bytes of BLAKE2b: collisions are out of reach for any number of weights a machine holds.
KEY_DIGEST_SIZE = 16


def freeze(array: np.ndarray) -> np.ndarray:
    """A read-only, C-contiguous view (or copy when the input is not contiguous)."""
    flags = array.flags  # numpy builds a flags object at every access: once
    if flags.c_contiguous:
        if not flags.writeable:  # a mapped blob: already what is handed out
            return array
        out = array.view()
    else:
        # np.ascontiguousarray would turn a 0-d array into a 1-d one; keep the shape.
        out = np.ascontiguousarray(array).reshape(array.shape)
    out.setflags(write=False)
    return out


@fast_init
@dataclasses.dataclass(frozen=True)
class PackSpec:
    """How a kernel would pack one input, known without packing.

    ``family`` names the kernel family ("matmul", "conv", ...), ``version`` the pack format
    version (bump it whenever the packed layout changes, so old saved blobs are ignored), and
    ``attrs`` the bytes of every attribute that changes the packed bytes (e.g. Gemm's transB).
    ``nbuffers`` is how many buffers ``prepack`` returns; ``identity`` says the single buffer is
    the weight's own bytes (a view), which lets a saved model point at the weight instead of
    writing it twice.
    """

    family: str
    version: int
    attrs: bytes = b""
    nbuffers: int = 1
    # The pack is the weight's own bytes, viewed (an fp32 weight BLAS reads as it is): nothing is
    # computed, and a saved model records it at the weight's own offset instead of a second copy.
    identity: bool = False


class DerivedValue(Protocol):
    """How a constant value is computed from a stored leaf weight (``session/_derive.py``)."""

    digest: bytes  # the ops, their attributes and their other inputs' bytes
    dtype: np.dtype
    shape: tuple[int, ...]
    elem_type: int
    is_view: bool  # the value is the leaf's bytes reshaped

    def compute(self, leaf: np.ndarray) -> np.ndarray: ...


@fast_init
@dataclasses.dataclass(frozen=True, eq=False)
class WeightRef:
    """A constant a kernel may pack: an initializer of a model scope (or a ``Constant`` node's
    tensor), or an array the user gave with ``SessionOptions.add_initializer`` (``array`` set,
    ``tensor`` None).  With ``derived``, the value is computed from that stored leaf (a
    dequantized or reshaped weight): dtype, shape, value and identity are the derived value's,
    ``raw`` stays the leaf's stored bytes (what saved records digest)."""

    scope: str  # path of the scope that owns the initializer
    name: str
    tensor: Tensor | None
    array: np.ndarray | None = None
    derived: DerivedValue | None = None

    @property
    def user(self) -> bool:
        return self.array is not None

    @property
    def dtype(self) -> np.dtype:
        if self.derived is not None:
            return self.derived.dtype
        return self.array.dtype if self.array is not None else self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        if self.derived is not None:
            return self.derived.shape
        return tuple(self.array.shape) if self.array is not None else self.tensor.dims

    @property
    def elem_type(self) -> int:
        """ONNX element type (``TensorProto.FLOAT`` …)."""
        if self.derived is not None:
            return self.derived.elem_type
        if self.array is not None:
            return np_dtype_to_tensor_dtype(self.array.dtype)
        return self.tensor.elem_type

    @property
    def external(self) -> ExternalLocation | None:
        return None if self.tensor is None else self.tensor.external

    def value(self) -> np.ndarray:
        leaf = self.array if self.array is not None else self.tensor.numpy()
        return leaf if self.derived is None else self.derived.compute(leaf)

    def raw(self) -> bytes | memoryview | np.ndarray:
        """The stored bytes (what saved records digest)."""
        return self.array if self.array is not None else self.tensor.raw()

    def identity(self) -> bytes:
        """File identity for a mapped weight (no read), else a digest of the bytes; plus the
        derivation's digest for a derived value."""
        if self.array is not None:
            base = content_identity(self.array)
        elif self.tensor.external is not None:
            ext = self.tensor.external
            base = file_identity(ext.file_id, ext.offset, ext.length)
        else:
            base = content_identity(self.tensor.raw())
        return base if self.derived is None else base + b"|d:" + self.derived.digest


@fast_init
@dataclasses.dataclass(frozen=True, eq=False)
class PrePackedWeights:
    """Immutable buffers that a kernel derived from one constant input.

    ``origin`` says where the buffers came from: ``"packed"`` (this process packed them),
    ``"model"`` (mapped from the model's data file), ``"cache"`` (mapped from the cache file).
    """

    key: str
    buffers: tuple[np.ndarray, ...]
    origin: str = "packed"
    # For mapped buffers: raises if the file they map was truncated or rewritten (one fstat).
    check_source: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        buffers = self.buffers
        if type(buffers) is tuple:
            for b in buffers:
                flags = b.flags
                if flags.writeable or not flags.c_contiguous:
                    break
            else:  # mapped blobs: read-only views already, kept as they are
                return
        object.__setattr__(self, "buffers", tuple(freeze(b) for b in buffers))

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers)

    @property
    def mapped(self) -> bool:
        return self.origin in ("model", "cache")


def content_identity(raw: bytes | memoryview | np.ndarray) -> bytes:
    """Identity of in-proto or user-given bytes: their digest."""
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1).data
    return b"c:" + hashlib.blake2b(raw, digest_size=KEY_DIGEST_SIZE).digest()


def file_identity(file_id: tuple[int, ...], offset: int, length: int) -> bytes:
    """Identity of a weight mapped from a file region (``graph.stat_identity`` of the file, the
    region), without reading it."""
    return ("f:" + ":".join(map(str, (*file_id, offset, length)))).encode()


_DTYPE_NAMES: dict[object, bytes] = {}


def _dtype_name(dtype: np.dtype | str) -> bytes:
    """``str(np.dtype(dtype))`` as bytes, cached (numpy builds that string in Python, ~10 us)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(np.dtype(dtype)).encode()
    return name


_SHAPE_TEXTS: dict[tuple, bytes] = {}


def _shape_text(shape: Sequence[int]) -> bytes:
    """``b"d0,d1,..."`` (each dim as an int), cached by shape (an LLM's layers repeat a few)."""
    key = tuple(shape)
    text = _SHAPE_TEXTS.get(key)
    if text is None:
        text = ",".join([str(int(d)) for d in key]).encode()
        if len(_SHAPE_TEXTS) < 4096:
            _SHAPE_TEXTS[key] = text
    return text


def make_key(spec: PackSpec, source_identity: bytes, dtype: np.dtype | str, shape: Sequence[int]) -> str:
    """Key of a pack; ``spec`` has ``family``, ``version`` and ``attrs`` (a kernel's PackSpec)."""
    # One buffer, one call: BLAKE2b of the parts joined is that of the parts streamed in turn.
    data = b"%s|%s|%s|%s" % (source_identity, _dtype_name(dtype), _shape_text(shape), spec.attrs)
    return f"{spec.family}/{spec.version}/{hashlib.blake2b(data, digest_size=KEY_DIGEST_SIZE).hexdigest()}"


# Staleness is checked at every warm load, so it must not page the whole weight in: 16 samples of
# 256 bytes (at most 16 pages touched) plus the length catch a rewritten or re-generated weight;
# ``onnxpack.verify_prepacked=1`` adds the full digest.
_SAMPLES = 16
_SAMPLE_BYTES = 256


def _bytes_of(raw: bytes | memoryview | np.ndarray) -> memoryview:
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).data
    return memoryview(raw).cast("B")


def full_digest(raw: bytes | memoryview | np.ndarray) -> bytes:
    """BLAKE2b-128 of every byte (the content identity used in saved keys)."""
    return hashlib.blake2b(_bytes_of(raw), digest_size=KEY_DIGEST_SIZE).digest()


def sample_spans(n: int) -> list[tuple[int, int]]:
    """(start, length) of the evenly spaced samples :func:`sample_digest` reads from ``n`` bytes."""
    if n <= _SAMPLES * _SAMPLE_BYTES:
        return [(0, n)]
    step = (n - _SAMPLE_BYTES) // (_SAMPLES - 1)
    return [(k * step, _SAMPLE_BYTES) for k in range(_SAMPLES)]


def sample_digest(raw: bytes | memoryview | np.ndarray | None, *, length: int | None = None,
                  read: Callable[[int, int], bytes | None] | None = None) -> bytes | None:
    """BLAKE2b-128 of the length and of evenly spaced samples of the bytes.

    The bytes are ``raw``, or (``raw`` None) ``length`` bytes read span by span with
    ``read(start, size)`` — e.g. ``os.pread`` of a file region, so nothing is mapped.  ``None``
    when a read comes back short.
    """
    view = _bytes_of(raw) if raw is not None else None
    n = len(view) if view is not None else int(length)
    h = hashlib.blake2b(digest_size=KEY_DIGEST_SIZE)
    h.update(n.to_bytes(8, "little"))
    for start, size in sample_spans(n):
        chunk = view[start:start + size] if view is not None else read(start, size)
        if chunk is None or len(chunk) != size:
            return None
        h.update(chunk)
    return h.digest()
