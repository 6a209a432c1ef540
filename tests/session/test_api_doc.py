"""docs/api.md names every public name of onnxruntime's Python package and every public member of
its classes, and what it says exists in onnxpack exists.

onnxruntime's names are read from the installed onnxruntime (the oracle), so a new onnxruntime
with new names makes this fail until the page says what onnxpack does with them.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnxruntime as ort
import pytest

import onnxpack

DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
CLASSES = ["InferenceSession", "SessionOptions", "RunOptions", "OrtValue", "IOBinding", "SparseTensor", "OrtDevice",
           "ModelCompiler", "AdapterFormat", "LoraAdapter", "NodeArg", "ModelMetadata", "OrtMemoryInfo", "OrtArenaCfg",
           "OrtEpDevice", "OrtHardwareDevice", "OrtSyncStream", "OrtEpAssignedSubgraph", "OrtEpAssignedNode"]


def _spellings(name: str) -> tuple[str, ...]:
    # A subpackage (quantization, tools, transformers) is an attribute once something imported it.
    return (f"`{name}`", f"`onnxruntime.{name}`")


def _not_provided(name: str) -> bool:
    row = next((line for line in DOC.splitlines()
                if line.startswith("|") and any(s in line.split("|")[1] for s in _spellings(name))), "")
    return "not provided" in row


@pytest.mark.parametrize("name", sorted(n for n in dir(ort) if not n.startswith("_")))
def test_every_module_name_is_in_the_table(name):
    assert any(s in DOC for s in _spellings(name)), f"docs/api.md does not say what onnxpack does with onnxruntime.{name}"
    if not _not_provided(name):
        assert hasattr(onnxpack, name), f"docs/api.md describes onnxpack.{name}, which does not exist"


@pytest.mark.parametrize("cls", CLASSES)
def test_every_class_member_is_in_the_page(cls):
    members = [m for m in dir(getattr(ort, cls)) if not m.startswith("_")]
    ours = getattr(onnxpack, cls)
    for m in members:
        # ``Class.member``, or the member in backticks on the line that names the class
        mentioned = f"`{cls}.{m}`" in DOC or any(
            f"`{m}`" in line for line in DOC.splitlines() if re.search(rf"`{re.escape(cls)}[`(]", line))
        assert mentioned, f"docs/api.md does not mention {cls}.{m}"
        instance_only = cls in ("NodeArg", "ModelMetadata", "OrtMemoryInfo", "OrtArenaCfg", "OrtEpDevice",
                                "OrtHardwareDevice", "OrtEpAssignedSubgraph", "OrtEpAssignedNode")
        if not instance_only:
            assert hasattr(ours, m), f"onnxpack.{cls} has no {m}"


def test_capi_exception_classes_exist():
    theirs = ort.capi.onnxruntime_pybind11_state
    ours = onnxpack.capi.onnxruntime_pybind11_state
    for name in dir(theirs):
        obj = getattr(theirs, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(getattr(ours, name), onnxpack.errors.OnnxpackError), name
            assert f"`{name}`" in DOC, name
