"""PrepackedWeightsContainer on its own: reference counts, one factory call per key, threads.

Oracle: the container's contract (issue 4) stated as counts and identities; no session involved.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from onnxpack import PrepackedWeightsContainer
from onnxpack.prepack import PrePackedWeights


def _entry(key: str, n: int = 4) -> PrePackedWeights:
    return PrePackedWeights(key, (np.arange(n, dtype=np.float32),))


def test_empty_container_is_inspectable():
    c = PrepackedWeightsContainer()
    assert len(c) == 0
    assert c.keys() == []
    assert c.nbytes == 0
    assert "k" not in c
    assert c.acquire("k", 1) is None
    assert c.release(1) == 0


def test_get_or_create_then_share_then_free_on_last_release():
    c = PrepackedWeightsContainer()
    calls = []

    def factory():
        calls.append(1)
        return _entry("a", 8)

    e1, created1 = c.get_or_create("a", 1, factory)
    e2, created2 = c.get_or_create("a", 2, factory)
    assert (created1, created2) == (True, False)
    assert e1 is e2 and len(calls) == 1
    assert len(c) == 1 and c.keys() == ["a"] and c.nbytes == 32 and c.holders("a") == 2
    assert c.release(1) == 0 and len(c) == 1  # session 2 still holds it
    assert c.release(2) == 1 and len(c) == 0 and c.nbytes == 0


def test_release_is_per_holder_and_idempotent():
    c = PrepackedWeightsContainer()
    c.get_or_create("a", 1, lambda: _entry("a"))
    c.get_or_create("b", 1, lambda: _entry("b"))
    c.get_or_create("b", 2, lambda: _entry("b"))
    assert c.acquire("a", 3) is not None
    assert c.release(1) == 0  # a: {3}, b: {2}
    assert c.release(1) == 0
    assert c.keys() == ["a", "b"]
    assert c.release(3) == 1 and c.keys() == ["b"]
    assert c.release(2) == 1 and len(c) == 0


def test_entries_are_read_only():
    c = PrepackedWeightsContainer()
    e, _ = c.get_or_create("a", 1, lambda: _entry("a"))
    with pytest.raises(ValueError):
        e.buffers[0][0] = 1.0


def test_factory_returning_none_leaves_no_entry():
    c = PrepackedWeightsContainer()
    e, created = c.get_or_create("a", 1, lambda: None)
    assert e is None and not created and len(c) == 0
    e, created = c.get_or_create("a", 1, lambda: _entry("a"))
    assert created and len(c) == 1


def test_factory_error_propagates_and_the_key_can_be_retried():
    c = PrepackedWeightsContainer()

    def boom():
        raise RuntimeError("pack failed")

    with pytest.raises(RuntimeError, match="pack failed"):
        c.get_or_create("a", 1, boom)
    assert len(c) == 0
    e, created = c.get_or_create("a", 1, lambda: _entry("a"))
    assert created and e is not None


def test_concurrent_get_or_create_packs_each_key_once():
    c = PrepackedWeightsContainer()
    calls: dict[str, int] = {}
    lock = threading.Lock()
    start = threading.Barrier(8)

    def factory_for(key):
        def factory():
            with lock:
                calls[key] = calls.get(key, 0) + 1
            time.sleep(0.01)  # hold the key "pending" so the others must wait for it
            return _entry(key)
        return factory

    results: list[tuple[int, str, PrePackedWeights]] = []
    errors: list[BaseException] = []

    def worker(holder):
        try:
            start.wait()
            for key in ("a", "b", "c"):
                e, _ = c.get_or_create(key, holder, factory_for(key))
                with lock:
                    results.append((holder, key, e))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(h,)) for h in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert calls == {"a": 1, "b": 1, "c": 1}
    for key in ("a", "b", "c"):
        entries = {id(e) for _h, k, e in results if k == key}
        assert len(entries) == 1
        assert c.holders(key) == 8
    for h in range(1, 9):
        c.release(h)
    assert len(c) == 0


def test_adopt_keeps_the_first_entry_of_a_key_and_counts_holders():
    c = PrepackedWeightsContainer()
    mapped, other = _entry("a", 8), _entry("a", 8)
    e1, added1 = c.adopt("a", 1, mapped)
    e2, added2 = c.adopt("a", 2, other)  # a second session mapping the same blob
    e3, created3 = c.get_or_create("a", 3, lambda: pytest.fail("the key is there: nothing to make"))
    assert (added1, added2, created3) == (True, False, False)
    assert e1 is mapped and e2 is mapped and e3 is mapped
    assert c.holders("a") == 3 and len(c) == 1
    assert c.release(1) == 0 and c.release(2) == 0 and c.release(3) == 1 and len(c) == 0


def test_adopt_waits_for_a_key_another_caller_is_making():
    """A key pending in get_or_create (another session packing it) is not overwritten: adopt
    waits, then returns the entry that caller made."""
    c = PrepackedWeightsContainer()
    made, started = _entry("k"), threading.Event()
    release = threading.Event()

    def factory():
        started.set()
        release.wait(5)
        return made

    t = threading.Thread(target=lambda: c.get_or_create("k", 1, factory))
    t.start()
    assert started.wait(5)
    got: list = []
    adopter = threading.Thread(target=lambda: got.append(c.adopt("k", 2, _entry("k"))))
    adopter.start()
    time.sleep(0.05)
    assert not got  # still waiting for the pending maker
    release.set()
    t.join(5)
    adopter.join(5)
    assert got and got[0][0] is made and got[0][1] is False
    assert c.holders("k") == 2
