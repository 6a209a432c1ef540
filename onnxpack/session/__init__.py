"""Running models: SessionOptions, the compile step, InferenceSession, kernels, the memory planner.

Load → :func:`compile` → :class:`Program` → run (``InferenceSession``); :func:`optimize` is load →
compile → save.  See ``docs/architecture.md``.
"""

from __future__ import annotations

from onnxpack.session._api import ModelMetadata, NodeArg, model_inputs, validate_feed
from onnxpack.session._arena import analyze, recording_lifetimes
from onnxpack.session._compile import CompileOptions, compile
from onnxpack.session._coverage import OpCoverage, op_coverage
from onnxpack.session._optimize import optimize, save_program
from onnxpack.session._program import PackEvent, Plan, PrepackStats, Program, Step, run_plan
from onnxpack.session._session import InferenceSession
from onnxpack.session.options import SessionOptions

__all__ = [
    "InferenceSession",
    "ModelMetadata",
    "NodeArg",
    "SessionOptions",
    "CompileOptions",
    "compile",
    "optimize",
    "save_program",
    "Program",
    "Plan",
    "Step",
    "PackEvent",
    "PrepackStats",
    "run_plan",
    "validate_feed",
    "model_inputs",
    "analyze",
    "recording_lifetimes",
    "OpCoverage",
    "op_coverage",
]
