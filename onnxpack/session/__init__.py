"""Running models: SessionOptions, the compile step, InferenceSession, kernels, the memory planner.

Load → :func:`compile` → :class:`Program` → run (``InferenceSession``); :func:`optimize` is load →
compile → save.  See ``docs/architecture.md``; onnxruntime's API and what onnxpack does for each
entry: ``docs/api.md``.
"""

from __future__ import annotations

from onnxpack.session._api import ModelMetadata, NodeArg, model_inputs, validate_feed
from onnxpack.session._arena import analyze, recording_lifetimes
from onnxpack.session._compile import CompileOptions, compile
from onnxpack.session._coverage import OpCoverage, op_coverage
from onnxpack.session._iobinding import IOBinding, SessionIOBinding
from onnxpack.session._memory import process_memory
from onnxpack.session._optimize import optimize, save_program
from onnxpack.session._ortvalue import OrtValue, SparseTensor
from onnxpack.session._program import PackEvent, Plan, PrepackStats, Program, RunControl, Step, run_plan
from onnxpack.session._run_options import RunOptions
from onnxpack.session._session import InferenceSession
from onnxpack.session.options import ExecutionMode, ExecutionOrder, GraphOptimizationLevel, SessionOptions

__all__ = [
    "InferenceSession",
    "ModelMetadata",
    "NodeArg",
    "SessionOptions",
    "RunOptions",
    "GraphOptimizationLevel",
    "ExecutionMode",
    "ExecutionOrder",
    "OrtValue",
    "SparseTensor",
    "IOBinding",
    "SessionIOBinding",
    "CompileOptions",
    "compile",
    "optimize",
    "save_program",
    "Program",
    "Plan",
    "Step",
    "PackEvent",
    "PrepackStats",
    "RunControl",
    "run_plan",
    "validate_feed",
    "model_inputs",
    "process_memory",
    "analyze",
    "recording_lifetimes",
    "OpCoverage",
    "op_coverage",
]
