"""onnxruntime's LoRA adapter file format (session/_lora.py): interchange with onnxruntime both
ways, and reading untrusted bytes (every mutation either reads or is a ``Fail``, never another
exception; parameters never reach outside the buffer)."""

from __future__ import annotations

import random

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import onnxpack
from onnxpack.errors import Fail
from onnxpack.session._lora import read_adapter_bytes, write_adapter_bytes

PARAMS = {
    "a.weight": np.arange(10, dtype=np.float32).reshape(5, 2),
    "b": np.arange(6, dtype=np.int64).reshape(2, 3),
    "scalar-as-1": np.array([3.5], np.float64),
    "half": np.arange(4, dtype=np.float16),
    "empty": np.zeros((0, 3), np.float32),
}


@pytest.mark.parametrize("writer", ["onnxpack", "onnxruntime"])
def test_files_interchange_with_onnxruntime(tmp_path, writer):
    rt = {"onnxpack": onnxpack, "onnxruntime": ort}[writer]
    fmt = rt.AdapterFormat()
    fmt.set_adapter_version(7)
    fmt.set_model_version(3)
    fmt.set_parameters({k: rt.OrtValue.ortvalue_from_numpy(v) for k, v in PARAMS.items()})
    path = str(tmp_path / "x.onnx_adapter")
    fmt.export_adapter(path)
    for reader in (onnxpack, ort):
        read = reader.AdapterFormat.read_adapter(path)
        assert (read.get_format_version(), read.get_adapter_version(), read.get_model_version()) == (1, 7, 3)
        got = read.get_parameters()
        assert sorted(got) == sorted(PARAMS)
        for k, v in PARAMS.items():
            arr = got[k].numpy()
            assert arr.dtype == v.dtype and arr.shape == v.shape
            np.testing.assert_array_equal(arr, v)


def test_scalar_parameters_are_written_as_one_element_as_onnxruntime_writes_them():
    _, got = read_adapter_bytes(write_adapter_bytes({"s": np.array(2.0, np.float32)}, 1, 1))
    assert got["s"].shape == (1,) and got["s"][0] == 2.0


def test_reader_rejects_foreign_bytes():
    with pytest.raises(Fail, match="does not appear to be a valid lora parameter format"):
        read_adapter_bytes(b"not an adapter at all")
    good = bytearray(write_adapter_bytes(PARAMS, 1, 1))
    good[4:8] = b"XXXX"
    with pytest.raises(Fail):
        read_adapter_bytes(bytes(good))


GOOD = write_adapter_bytes(PARAMS, 1, 1)


@settings(max_examples=300, deadline=None, database=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_mutated_files_read_or_fail_cleanly(seed):
    rng = random.Random(seed)
    data = bytearray(GOOD)
    kind = rng.choice(["flip", "truncate", "u32"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    else:
        pos = rng.randrange(0, len(data) - 4)
        data[pos:pos + 4] = rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, len(data), rng.randrange(2**32)]).to_bytes(4, "little")
    try:
        _, params = read_adapter_bytes(bytes(data))
    except Fail:
        return
    for arr in params.values():
        assert arr.nbytes <= len(data)
