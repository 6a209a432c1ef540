"""Constant folding: small values that depend only on constants, computed once at compile.

Exporters leave shape arithmetic in the graph: ``Constant`` nodes for axes and indices,
``Unsqueeze``/``Concat``/``Slice`` over them, padding amounts computed from a constant's
``Shape`` (Silero VAD's STFT: 49 Constants and a dozen such ops in its main graph alone).  Each
is a step of the loop at every run, ~1-3 us apiece on values of a few bytes; onnxruntime folds
them when it loads the model.  :func:`fold_constants` does the same over a scope's bound steps,
in order: a step whose inputs are all constants (initializers, ``Constant`` tensors, derived
constants, values folded before it) is run once with its own kernel — so the value is the one a
run would compute, bit for bit — and its outputs become the plan's constants; steps nobody else
reads then drop out of the plan (the compile step's dead-code elimination).

Only the ops of :data:`FOLDABLE_OPS` fold (shape and index arithmetic, no activations: their
kernels never import the JIT, which stays off session creation), only in the default domain, and
only when every input and output is at most :data:`MAX_BYTES`: a large constant expression keeps
its step, so folding never holds a copy of a large weight nor computes one at creation (the
original of a folded value is released when nothing else reads it).  A
kernel that raises is left to raise at run time, where it did before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnxpack.session._program import Step
from onnxpack.session.kernels import normalize_domain

__all__ = ["COMPUTED_MAX_BYTES", "FOLDABLE_OPS", "MAX_BYTES", "fold_constants"]

# Values (inputs and outputs) above this size are not folded: a large constant expression
# computed at creation would cost time and a held copy.  Shape arithmetic is a few bytes; 1 MiB
# also takes in weights that exporters re-slice at every run (Silero VAD builds its LSTM's W and
# R, 256 KB each, with Slice + Concat + Unsqueeze of the LSTMCell weights).
MAX_BYTES = 1 << 20

# A constant computed from a weight (a DequantizeLinear or Cast chain: a QDQ model's
# BatchNormalization statistics and biases, an fp16 model's widened biases) folds up to this size:
# computing it at each creation costs ~10-20 us, where its step cost as much at every run; a
# larger one keeps its step, whose kernel may pack the value (Cast) so that a warm start maps it.
COMPUTED_MAX_BYTES = 64 << 10

# Deterministic, cheap default-domain ops whose kernels are plain numpy (no JIT, no subgraphs).
FOLDABLE_OPS = frozenset({
    "Shape", "Size", "Gather", "GatherElements", "Unsqueeze", "Squeeze", "Concat", "Slice", "Split", "Reshape",
    "Flatten", "Transpose", "Cast", "CastLike", "ConstantOfShape", "Range", "Expand", "Tile", "Identity",
    "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Floor", "Ceil", "Sqrt", "Pow", "Min", "Max",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Where",
    "ReduceProd", "ReduceSum", "ReduceMin", "ReduceMax", "Sign",
})


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def fold_constants(steps: Sequence[Step], lookup: Callable[[str], Any | None],
                   max_bytes: int = MAX_BYTES) -> dict[str, Callable[[], np.ndarray]]:
    """Name -> value of every step output that folds, for ``steps`` in execution order.

    ``lookup(name)`` gives the constant a name refers to (an object with ``shape``, ``dtype``,
    ``derived`` and ``value()``: a :class:`~onnxpack.prepack.WeightRef`), or None.  A step whose kernel is
    ``None`` is a constant expression the compile step has not bound (a ``Constant`` node or a
    derived chain): its outputs fold through ``lookup`` when small.  Each value comes as a
    function computing it once: most constant expressions are packed by their readers and never
    needed, so nothing is computed for them.  Values are owned copies, never views of mapped
    weights.
    """
    folded: dict[str, Callable[[], np.ndarray]] = {}
    produced: set[str] = set()  # outputs of steps that did not fold: never constants

    def value(name: str) -> np.ndarray | None:
        thunk = folded.get(name)
        if thunk is not None:
            return thunk()
        if name in produced:
            return None
        w = lookup(name)
        if w is None or _nbytes(w.shape, w.dtype) > max_bytes or np.dtype(w.dtype).kind not in "biuf":
            return None
        return np.asarray(w.value())  # read only: kernels never write their inputs

    for step in steps:
        outs = [o for o in step.outputs if o]
        if not outs:
            continue
        if step.kernel is None:  # an unbound constant expression: its value is the lookup's, later
            # Constant tensors and reshaping chains over a weight (Unsqueeze of a Constant axis
            # list...) up to ``max_bytes``; a computing chain (Cast, DequantizeLinear) only up to
            # COMPUTED_MAX_BYTES: a larger one keeps its step where a step reads it, whose kernel
            # packs the value (Cast) and so maps it at a warm start instead of computing it.
            # Steps that fold read any chain through ``lookup`` all the same.
            refs = [lookup(o) for o in outs]
            if all(w is not None and np.dtype(w.dtype).kind in "biuf"
                   and _nbytes(w.shape, w.dtype) <= (max_bytes if w.derived is None or w.derived.is_view
                                                     else min(max_bytes, COMPUTED_MAX_BYTES)) for w in refs):
                for o, w in zip(outs, refs):
                    folded[o] = _once(lambda w=w: np.array(w.value(), copy=True))
            continue
        got = _fold_step(step, value, max_bytes)
        if got is None:
            produced.update(outs)
            continue
        for name, v in zip(step.outputs, got):
            if name:
                folded[name] = lambda v=v: v
    return folded


def _once(compute: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    memo: list[np.ndarray] = []

    def get() -> np.ndarray:
        if not memo:
            memo.append(compute())
        return memo[0]
    return get


def _fold_step(step: Step, value: Callable[[str], np.ndarray | None], max_bytes: int) -> list | None:
    node = step.node
    if (node.op_type not in FOLDABLE_OPS or normalize_domain(node.domain) != "" or step.packed or step.implicit
            or not any(step.inputs) or step.kernel.call_mode != "plain"):
        return None
    args = []
    for name in step.inputs:
        if not name:
            args.append(None)
            continue
        v = value(name)
        if v is None:
            return None
        args.append(v)
    try:
        outs = step.kernel.run(*args)
    except Exception:  # left to the run, which raises as it did before
        return None
    if len(outs) < len(step.outputs):
        return None
    got = []
    for name, v in zip(step.outputs, outs):
        if not name:
            got.append(None)
            continue
        if not isinstance(v, (np.ndarray, np.generic)) or v.dtype.kind not in "biuf" or v.nbytes > max_bytes:
            return None
        v = np.array(v, copy=True)  # owned: never a view of an input or of a kernel's buffer
        got.append(v)
    return got
