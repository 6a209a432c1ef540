"""``jit_primer.py``'s list of specializations names kernels that exist, with as many arguments
as they take (a stale list only slows a fresh clone's suite; this says when to regenerate it)."""

from __future__ import annotations

import inspect

import pytest

import jit_primer

pytest.importorskip("numba")


def test_every_listed_specialization_names_a_kernel_with_its_arity():
    import importlib

    from numba.core.dispatcher import Dispatcher

    rows = jit_primer.read_signatures()
    assert rows
    for module, function, text in rows:
        dispatcher = getattr(importlib.import_module(f"{jit_primer.PACKAGE}.{module}"), function, None)
        assert isinstance(dispatcher, Dispatcher), (module, function)
        sig = jit_primer.parse_signature(text)
        assert len(sig) == len(inspect.signature(dispatcher.py_func).parameters), (module, function, text)


def test_signatures_round_trip_through_numbas_printed_form():
    from numba.core import types

    sig = (types.Array(types.float32, 2, "C", readonly=True), types.int64, types.IntegerLiteral(0), types.boolean,
           types.Array(types.uint8, 1, "C"))
    assert jit_primer.parse_signature(str(sig)) == sig
    assert jit_primer.parse_signature("(int64, float64)") == (types.int64, types.float64)


def test_record_lists_numbas_cache_in_the_order_it_was_written(tmp_path, monkeypatch):
    """``--record`` reads numba's cache index files: every specialization, oldest entry first,
    as ``<module> <function> <signature>`` lines that ``prime`` parses back."""
    import importlib
    import os
    import sys
    import time

    from numba.core import types

    (tmp_path / "primer_probe.py").write_text(
        "from numba import njit\n\n\n@njit(cache=True)\ndef twice(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "primer_probe", raising=False)
    probe = importlib.import_module("primer_probe")
    probe.twice(3)
    for data in (tmp_path / "__pycache__").glob("*.nbc"):  # older than the next entry, on any clock
        os.utime(data, (time.time() - 60, time.time() - 60))
    probe.twice(1.5)
    out = tmp_path / "sigs.txt"
    assert jit_primer.record(str(tmp_path / "__pycache__"), str(out)) == 0
    rows = jit_primer.read_signatures(str(out))
    assert [r[:2] for r in rows] == [["primer_probe", "twice"]] * 2
    assert [jit_primer.parse_signature(r[2]) for r in rows] == [(types.int64,), (types.float64,)]
    assert not os.path.exists(str(out) + ".tmp")
