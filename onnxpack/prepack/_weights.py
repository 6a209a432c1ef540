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
from collections.abc import Sequence

import numpy as np

__all__ = ["PrePackedWeights", "make_key", "content_identity", "file_identity", "freeze", "sample_digest", "full_digest"]

# 16 bytes of BLAKE2b: collisions are out of reach for any number of weights a machine holds.
KEY_DIGEST_SIZE = 16


def freeze(array: np.ndarray) -> np.ndarray:
    """A read-only, C-contiguous view (or copy when the input is not contiguous)."""
    # np.ascontiguousarray would turn a 0-d array into a 1-d one; keep the shape.
    out = array if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(array.shape)
    if out is array and array.flags.writeable:
        out = array.view()
    out.setflags(write=False)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class PrePackedWeights:
    """Immutable buffers that a kernel derived from one constant input.

    ``origin`` says where the buffers came from: ``"packed"`` (this process packed them),
    ``"model"`` (mapped from the model's data file), ``"cache"`` (mapped from the cache file).
    """

    key: str
    buffers: tuple[np.ndarray, ...]
    origin: str = "packed"

    def __post_init__(self) -> None:
        frozen = tuple(freeze(b) for b in self.buffers)
        object.__setattr__(self, "buffers", frozen)

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


def file_identity(st_dev: int, st_ino: int, st_size: int, st_mtime_ns: int, offset: int, length: int) -> bytes:
    """Identity of a weight mapped from a file region, without reading it."""
    return f"f:{st_dev}:{st_ino}:{st_size}:{st_mtime_ns}:{offset}:{length}".encode()


def make_key(spec, source_identity: bytes, dtype: np.dtype | str, shape: Sequence[int]) -> str:
    """Key of a pack; ``spec`` has ``family``, ``version`` and ``attrs`` (a kernel's PackSpec)."""
    h = hashlib.blake2b(digest_size=KEY_DIGEST_SIZE)
    h.update(source_identity)
    h.update(b"|" + str(np.dtype(dtype)).encode() + b"|" + ",".join(map(str, shape)).encode())
    h.update(b"|" + spec.attrs)
    return f"{spec.family}/{spec.version}/{h.hexdigest()}"


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


def sample_digest(raw: bytes | memoryview | np.ndarray) -> bytes:
    """BLAKE2b-128 of the length and of evenly spaced samples of the bytes."""
    view = _bytes_of(raw)
    n = len(view)
    h = hashlib.blake2b(digest_size=KEY_DIGEST_SIZE)
    h.update(n.to_bytes(8, "little"))
    if n <= _SAMPLES * _SAMPLE_BYTES:
        h.update(view)
    else:
        step = (n - _SAMPLE_BYTES) // (_SAMPLES - 1)
        for k in range(_SAMPLES):
            start = k * step
            h.update(view[start:start + _SAMPLE_BYTES])
    return h.digest()
