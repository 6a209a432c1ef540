"""The cross-session PrepackedWeightsContainer.

Sessions created with the same container share every packed weight: the first one to need a
key packs it (or maps it from a file) and the others take it.  Each entry records which sessions
hold it; when the last holder releases (session closed or garbage-collected), the entry goes.
Packing happens outside the container's lock, and a key being packed by one thread makes the
others wait for it instead of packing it twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from onnxpack.prepack._weights import PrePackedWeights

logger = logging.getLogger(__name__)

__all__ = ["PrepackedWeightsContainer"]


class _Pending:
    """A key being made: its maker holds ``done`` until the entry is in (or failed); a waiter
    takes and returns the lock.  A plain lock, not an Event: a warm load makes ~250 of these and
    an Event (a Condition and its lock) costs ~10x more to create."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()

    def wait(self) -> None:
        with self.done:
            pass


class PrepackedWeightsContainer:
    """Thread-safe key -> PrePackedWeights with per-session reference counts.

    Create one and pass it as ``prepacked_weights_container=`` to every ``InferenceSession`` that
    should share packed weights.  Inspect it with ``len()``, ``keys()`` and ``nbytes``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, PrePackedWeights] = {}
        self._holders: dict[str, set[int]] = {}
        self._pending: dict[str, _Pending] = {}

    # -- inspection -----------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    @property
    def nbytes(self) -> int:
        """Bytes of all packed buffers held (mapped buffers count too: they are address space)."""
        with self._lock:
            return sum(w.nbytes for w in self._entries.values())

    def holders(self, key: str) -> int:
        with self._lock:
            return len(self._holders.get(key, ()))

    def __repr__(self) -> str:
        return f"PrepackedWeightsContainer(entries={len(self)}, nbytes={self.nbytes})"

    # -- use by sessions ------------------------------------------------------------------------
    def acquire(self, key: str, holder: int) -> PrePackedWeights | None:
        """The entry for ``key`` (now also held by ``holder``), or None."""
        with self._lock:
            w = self._entries.get(key)
            if w is not None:
                self._holders[key].add(holder)
            return w

    def adopt(self, key: str, holder: int, made: PrePackedWeights) -> tuple[PrePackedWeights, bool]:
        """Return (entry, added_by_this_call) for ``made``, an entry already at hand (a blob
        mapped from a file): the container's own entry for ``key`` when it has one, else ``made``.

        What :meth:`get_or_create` does with a factory returning ``made``, without its pending
        record when nobody else is making ``key`` (a warm start adopts one entry per packed
        weight: an LLM's 242)."""
        with self._lock:
            w = self._entries.get(key)
            if w is not None:
                self._holders[key].add(holder)
                return w, False
            if key not in self._pending:
                self._entries[key] = made
                self._holders[key] = {holder}
                return made, True
        entry, added = self.get_or_create(key, holder, lambda: made)  # another caller is making it
        return entry, added  # type: ignore[return-value]

    def get_or_create(
        self, key: str, holder: int, factory: Callable[[], PrePackedWeights | None]
    ) -> tuple[PrePackedWeights | None, bool]:
        """Return (entry, created_by_this_call); ``factory`` runs at most once per key at a time.

        A factory returning None (nothing usable) leaves no entry, and waiting callers retry.
        """
        while True:
            with self._lock:
                w = self._entries.get(key)
                if w is not None:
                    self._holders[key].add(holder)
                    return w, False
                pending = self._pending.get(key)
                if pending is None:
                    pending = self._pending[key] = _Pending()
                    mine = True
                else:
                    mine = False
            if not mine:
                pending.wait()
                continue
            try:
                made = factory()
            except BaseException:
                with self._lock:
                    del self._pending[key]
                pending.done.release()
                raise
            with self._lock:
                del self._pending[key]
                if made is not None:
                    self._entries[key] = made
                    self._holders[key] = {holder}
            pending.done.release()
            return made, made is not None

    def release(self, holder: int) -> int:
        """Drop every reference ``holder`` has; entries nobody holds are freed. Returns freed count."""
        freed = 0
        with self._lock:
            for key in [k for k, hs in self._holders.items() if holder in hs]:
                hs = self._holders[key]
                hs.discard(holder)
                if not hs:
                    del self._holders[key]
                    del self._entries[key]
                    freed += 1
        return freed
