"""Shape specialization: a root plan rewritten for one set of input shapes, with guards.

Exporters leave shape logic in the graph that only the *shapes* of the inputs decide:
``Shape -> Gather -> Equal -> If`` on the batch size, ``Shape -> Slice -> Concat -> Reshape``
targets, ``Size -> Equal -> Not -> If`` around an LSTM (Silero VAD: 70 steps per run of which
~30 are such arithmetic, plus 7 ``If`` runs, each a frame and a plan run).  onnxruntime runs each
in well under a microsecond; our step loop pays 1-3 us per step and several per ``If``.  The
compile step cannot fold them: the shapes are unknown until a run.

So the runner keeps, per set of input shapes and dtypes (the *key*), a specialized root plan:

* it is built from one real run, recorded through the step loop's hook
  (:class:`~onnxpack.session._program.RunControl`: every step of the root plan and of the
  ``If`` branches it ran, with their values);
* a ``Shape``/``Size`` step becomes a constant (its recorded value), and a *guard* checks, where
  the step was, that its input has the recorded shape; an input of the graph needs no guard (the
  key holds its shape);
* a step of :data:`~onnxpack.session._fold.FOLDABLE_OPS` (deterministic, default domain) whose
  inputs are all such constants becomes a constant too, when small (:data:`MAX_BYTES`);
* a reshaping step (``Kernel.reshapes_input``: Reshape, Squeeze, Unsqueeze, Flatten) whose other
  inputs are constants becomes one ``reshape`` to the recorded shape, guarded on its input's shape;
* a step whose kernel offers a fixed form for its input's recorded shape and dtype, its other
  inputs constants (``Kernel.fixed``: Slice's index, Pad's gather, Gather's row, a small conv's
  one JIT call), becomes that function, guarded on the input's shape and dtype;
* an ``If`` whose condition became a constant is replaced by the steps of the branch it ran
  (recursively), its outputs aliased to the branch's; names are never renamed: a branch that
  defines a name the root also uses (not valid ONNX, which is SSA across scopes) stays an ``If``;
* ``Identity`` steps (the model's and the aliases) whose input is produced by a kept step and read
  by nothing else disappear: the producer writes the output name directly;
* an ``If`` whose condition a small integer or boolean *input* decides (Silero VAD v5:
  ``If(sr == 16000)`` around the whole model) is inlined too, with that input taken as the
  constant it was in the recorded run: from then on the session's keys hold that input's value
  (``Specializer.value_at``; only inputs some folded condition read, so a step counter that no
  condition reads does not split the keys), and each value gets a plan of its own.

Correctness does not rest on any shape-inference rule: every folded value is a deterministic
function of shapes the guards (or the key) check at run time.  A guard that fails (a
data-dependent shape: NonZero, a Reshape to computed sizes) raises :class:`GuardMiss`; the run is
redone with the generic plan — kernels are pure, nothing was written that a rerun does not
rewrite — and that key stays generic.  Values that became constants are read-only, so an output
that is one is copied for the user (``to_user``).

Cost: a key is specialized on its second run (a model fed ever new shapes never pays the
recording), at most :data:`MAX_PLANS` keys are kept.  Measured on Silero VAD (512 samples): 70
steps per run (root + branches, 7 ``If`` runs) -> 43, the root plan's loop 0.33 -> 0.25 ms; on
Silero VAD v5 (its If on the sample rate inlined) 0.24 -> 0.10 ms a run, onnxruntime 0.08.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpack.errors import RuntimeFailure
from onnxpack.graph._proto import make_node
from onnxpack.session._fold import FOLDABLE_OPS
from onnxpack.session._program import Plan, RunControl, Step, StepHook, call_step, run_plan, schedule, store
from onnxpack.session.kernels import Kernel, normalize_domain

__all__ = ["GuardMiss", "Specializer", "specialize", "worth_specializing", "MAX_BYTES", "MAX_PLANS"]

# Recorded values above this size stay computed at every run: a specialized plan holds its
# constants for as long as the session lives, one copy per key.
MAX_BYTES = 1 << 16
# Keys (sets of input shapes) with a plan kept per session; the oldest is dropped first.
MAX_PLANS = 8
# Keys remembered to count their runs (a key is specialized on its second run).
MAX_SEEN = 64
_SHAPE_OPS = frozenset({"Shape", "Size"})


class GuardMiss(RuntimeFailure):
    """A specialized plan's guard saw a shape other than the recorded one (never leaves the
    runner: the run is redone with the generic plan)."""


class _Guard:
    """The check left where a folded ``Shape``/``Size`` step was: its input's shape is ``shape``."""

    call_mode = "plain"
    __slots__ = ("shape",)

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def run(self, x: Any) -> tuple:
        if getattr(x, "shape", None) != self.shape:
            raise GuardMiss(f"shape {getattr(x, 'shape', None)} where the specialized plan expects {self.shape}")
        return ()


class _FixedReshape:
    """A reshaping step (``Kernel.reshapes_input``) whose other inputs are constants, for the
    recorded input shape: one guarded ``reshape`` (~0.3 us) instead of the kernel's argument
    parsing (~1.5-2 us for Unsqueeze/Squeeze/Reshape)."""

    call_mode = "plain"
    __slots__ = ("shape", "target")

    def __init__(self, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
        self.shape = shape
        self.target = target

    def run(self, x: Any, *_constants: Any) -> tuple:
        if x.__class__ is not np.ndarray or x.shape != self.shape:
            raise GuardMiss(f"shape {getattr(x, 'shape', None)} where the specialized plan expects {self.shape}")
        return (x.reshape(self.target),)


class _Fixed:
    """A step whose kernel has a fixed form for the recorded shape and dtype of its input 0, its
    other inputs constants (``Kernel.fixed``: Slice, Pad, Gather, a small Conv): the guard, then
    that function (~0.3 us for a Slice instead of ~1, ~1.3 for Silero VAD's reflect Pad instead
    of ~3)."""

    call_mode = "plain"
    __slots__ = ("shape", "dtype", "fn")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, fn: Any) -> None:
        self.shape, self.dtype, self.fn = shape, dtype, fn

    def run(self, x: Any, *_constants: Any) -> tuple:
        if x.__class__ is not np.ndarray or x.shape != self.shape or (x.dtype is not self.dtype and x.dtype != self.dtype):
            raise GuardMiss(f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))} where the "
                            f"specialized plan expects {self.dtype}{list(self.shape)}")
        return (self.fn(x),)


def _fixable(kernel: Any) -> bool:
    """Whether ``kernel`` has a fixed form to offer: a ``fixed`` defined by the class that defines
    its ``run`` (a subclass whose run computes something else, com.microsoft's FusedConv with its
    activation after Conv's, inherits Conv's ``fixed`` but must not use it)."""
    cls = kernel if isinstance(kernel, type) else type(kernel)
    fixed = run = None
    for c in cls.__mro__:
        if fixed is None and "fixed" in c.__dict__:
            fixed = c
        if run is None and "run" in c.__dict__:
            run = c
    return fixed is not None and fixed is not Kernel and fixed is run


class _Alias:
    """An inlined ``If``'s output: the branch's value itself (what the ``If`` kernel returns)."""

    call_mode = "plain"
    __slots__ = ()

    def run(self, x: Any) -> tuple:
        return (x,)


# -- recording ------------------------------------------------------------------------------------


class _StepRecord:
    __slots__ = ("step", "shapes", "dtype", "outs", "children")

    def __init__(self, step: Step) -> None:
        self.step = step
        self.shapes: tuple | None = None  # Shape/Size, reshaping and fixable steps: input 0's shape
        self.dtype: np.dtype | None = None  # fixable steps (Kernel.fixed): input 0's dtype
        self.outs: Sequence[Any] | None = None  # candidates for folding: the outputs
        self.children: list[_PlanRun] = []  # plan runs made by this step (If: its branch)


class _PlanRun:
    __slots__ = ("plan", "steps")

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.steps: list[_StepRecord] = []


class _Recorder(RunControl):
    """Records one run: each plan run, its steps, the values folding may use."""

    def __init__(self) -> None:
        self.root: _PlanRun | None = None
        self.stack: list[_StepRecord] = []

    def hook(self, plan: Plan, inner: StepHook | None, root: bool) -> StepHook | None:
        run = _PlanRun(plan)
        if self.stack:
            self.stack[-1].children.append(run)
        elif self.root is None:
            self.root = run
        return _RecordHook(self, run, inner)


class _RecordHook(StepHook):
    def __init__(self, recorder: _Recorder, run: _PlanRun, inner: StepHook | None) -> None:
        self.recorder = recorder
        self.run = run
        self.inner = inner

    def step(self, k: int, step: Step, args: list[Any], frame, plan: Plan) -> Sequence[Any]:
        rec = _StepRecord(step)
        self.run.steps.append(rec)
        stack = self.recorder.stack
        stack.append(rec)
        try:
            outs = self.inner.step(k, step, args, frame, plan) if self.inner is not None else call_step(
                step, frame, args, plan.name)
        finally:
            stack.pop()
        node = step.node
        if normalize_domain(node.domain) == "" and (node.op_type in FOLDABLE_OPS or node.op_type == "If"):
            rec.outs = tuple(store(v) for v in outs)  # numpy scalars as the loop keeps them
            if (node.op_type in _SHAPE_OPS or step.kernel.reshapes_input) and args:
                rec.shapes = getattr(args[0], "shape", None)
        if _fixable(step.kernel) and args and args[0].__class__ is np.ndarray:
            rec.shapes, rec.dtype = args[0].shape, args[0].dtype
        return outs


# -- building (pure) ------------------------------------------------------------------------------


def _small(v: Any) -> bool:
    return isinstance(v, np.ndarray) and v.dtype.kind in "biuf" and v.nbytes <= MAX_BYTES


def _frozen(v: np.ndarray) -> np.ndarray:
    out = np.array(v, copy=True)
    out.setflags(write=False)
    return out


def _names_of(plan: Plan) -> set[str]:
    names = set(plan.input_names) | set(plan.constants)
    for step in plan.steps:
        names.update(o for o in step.outputs if o)
    return names


def specialize(root: _PlanRun, values: dict[str, np.ndarray] | None = None) -> tuple[Plan, int, frozenset] | None:
    """The specialized plan of a recorded root run, how many steps it saves and the inputs of
    ``values`` whose values it holds, or None when nothing folds.  Pure: reads the record,
    builds new steps.

    ``values``: small integer or boolean inputs of the run (name -> value).  When an ``If``
    condition folds only with some of them taken as constants (Silero VAD v5: ``If(sr == 16000)``
    around the whole model, ``sr`` a graph input), the plan takes them all as constants and
    says which were read (the caller keys its plans by their values too); else it is the plan
    of the shapes alone."""
    if values:
        got = _specialize(root, values)
        if got is not None:
            # Again with only the values the folded conditions read: a plan keyed by an input
            # that changes at every run (a step counter) would never be used.  Every value given
            # is a constant of the plan, so all are its key's.
            held = {n: values[n] for n in got[2]}
            got = _specialize(root, held)
            if got is not None:
                return got[0], got[1], frozenset(held)
    return _specialize(root, None)


def _specialize(root: _PlanRun, values: dict[str, np.ndarray] | None) -> tuple[Plan, int, frozenset] | None:
    plan = root.plan
    inputs = set(plan.input_names)
    static: dict[str, Any] = dict(plan.constants)
    # Constants that hold a value of ``values`` (an input's, or computed from one): an If
    # inlined on such a condition makes the plan one of those values.
    tainted: dict[str, frozenset] = {}  # name -> the inputs of ``values`` it was computed from
    used: set[str] = set()
    if values:
        static.update(values)
        tainted.update((n, frozenset((n,))) for n in values)
    namespace = _names_of(plan)
    steps: list[Step] = []
    guarded: set[str] = set()
    saved = 0

    def emit(run: _PlanRun) -> None:
        nonlocal saved
        for rec in run.steps:
            step = rec.step
            node = step.node
            op = node.op_type if normalize_domain(node.domain) == "" else None
            plain = step.kernel.call_mode == "plain"
            outs = rec.outs
            if op in _SHAPE_OPS and plain and outs and len(outs) == 1 and _small(outs[0]) and rec.shapes is not None:
                x = step.inputs[0]
                if x not in static and x not in inputs and x not in guarded:
                    guard = make_node("ShapeGuard", [x], [], name=f"{node.name}/guard", domain="onnxpack")
                    steps.append(Step(guard, _Guard(tuple(rec.shapes)), (x,), ()))  # type: ignore[arg-type]
                    guarded.add(x)
                else:
                    saved += 1
                if step.outputs[0]:
                    static[step.outputs[0]] = _frozen(outs[0])
                continue
            if (op in FOLDABLE_OPS and plain and outs is not None and any(step.inputs)
                    and all(not n or n in static for n in step.inputs) and not step.implicit
                    and len(outs) >= len([o for o in step.outputs if o])
                    and all(_small(v) for o, v in zip(step.outputs, outs) if o)):
                taint = frozenset().union(*(tainted[n] for n in step.inputs if n in tainted))
                for o, v in zip(step.outputs, outs):
                    if o:
                        static[o] = _frozen(v)
                        if taint:
                            tainted[o] = taint
                saved += 1
                continue
            if (op is not None and getattr(step.kernel, "reshapes_input", False) and plain and outs is not None
                    and len(outs) == 1 and len(step.outputs) == 1 and isinstance(outs[0], np.ndarray)
                    and rec.shapes is not None and step.inputs and step.inputs[0]
                    and all(not n or n in static for n in step.inputs[1:]) and not step.implicit):
                steps.append(dataclasses.replace(step, kernel=_FixedReshape(tuple(rec.shapes), outs[0].shape),
                                                 inputs=step.inputs[:1], packed=frozenset()))
                continue
            if (plain and rec.dtype is not None and rec.shapes is not None and len(step.outputs) == 1
                    and step.outputs[0] and step.inputs and step.inputs[0] and 0 not in step.packed
                    and not step.implicit and all(not n or i in step.packed or n in static
                                                  for i, n in enumerate(step.inputs) if i)):
                # (a packed input is the kernel's own: None, as the loop feeds it)
                fn = _fixed_form(step, rec, [static[n] if n and i not in step.packed else None
                                             for i, n in enumerate(step.inputs) if i])
                if fn is not None:
                    steps.append(dataclasses.replace(step, kernel=_Fixed(tuple(rec.shapes), rec.dtype, fn),
                                                     inputs=step.inputs[:1], packed=frozenset()))
                    continue
            if (op == "If" and outs is not None and step.inputs and step.inputs[0] in static
                    and len(rec.children) == 1):
                branch = rec.children[0]
                local = _names_of(branch.plan)
                if not (local & namespace):
                    used.update(tainted.get(step.inputs[0], ()))
                    namespace.update(local)
                    static.update(branch.plan.constants)
                    emit(branch)
                    for o, b in zip(step.outputs, branch.plan.output_names):
                        if not o:
                            continue
                        if b in static:
                            static[o] = static[b]
                            if b in tainted:
                                tainted[o] = tainted[b]
                        else:
                            alias = make_node("Identity", [b], [o], name=f"{node.name}/{o}")
                            steps.append(Step(alias, _Alias(), (b,), (o,)))  # type: ignore[arg-type]
                    saved += 1
                    continue
            steps.append(step)

    emit(root)
    if not saved:
        return None
    if values and not used:
        return None  # the values folded no condition: the caller takes the plan of the shapes alone
    kept = _drop_aliases(steps, plan.output_names)
    saved += len(steps) - len(kept)
    read = {n for step in kept for n in step.reads} | set(plan.output_names)
    constants = {n: v for n, v in static.items() if n in read and n not in inputs}
    new = dataclasses.replace(plan, constants=constants,
                              steps=schedule(kept, plan.input_names, plan.output_names, constants))
    return new, saved, frozenset(used)


def _fixed_form(step: Step, rec: _StepRecord, constants: list[Any]) -> Any:
    """The kernel's fixed form for the recorded input, or None (declined, or it raised: the step
    then stays as it was, and a bad input still fails where it did)."""
    try:
        return step.kernel.fixed(tuple(rec.shapes), rec.dtype, constants)
    except Exception:  # noqa: BLE001 - an optimization only
        return None


def _drop_aliases(steps: list[Step], outputs: Sequence[str]) -> list[Step]:
    """Identity steps (the model's and the aliases) removed: a later reader reads the Identity's
    input instead; or, when the output must keep its name (a graph output, a name a subgraph
    reads), the input's producer writes that name directly if nothing else reads the input.
    Both give every reader the same object the Identity would have returned."""
    pinned = set(outputs)
    for step in steps:
        pinned.update(step.implicit)
    rename: dict[str, str] = {}
    out: list[Step | None] = []
    for step in steps:
        if rename and any(n in rename for n in step.inputs):
            step = dataclasses.replace(step, inputs=tuple(rename.get(n, n) for n in step.inputs), release=())
        node = step.node
        if ((isinstance(step.kernel, _Alias) or (node.op_type == "Identity" and normalize_domain(node.domain) == ""
                                                 and step.kernel.call_mode == "plain"))
                and len(step.inputs) == 1 and step.inputs[0] and len(step.outputs) == 1 and step.outputs[0]
                and step.outputs[0] not in pinned):
            rename[step.outputs[0]] = step.inputs[0]
            continue
        out.append(step)
    # Pinned aliases: the producer takes the name when the input has no other reader.
    producer: dict[str, int] = {}
    readers: dict[str, int] = {}
    for k, step in enumerate(out):
        for n in step.inputs:
            if n:
                readers[n] = readers.get(n, 0) + 1
        for o in step.outputs:
            if o:
                producer[o] = k
    for k, step in enumerate(out):
        node = step.node
        if not (isinstance(step.kernel, _Alias) or (node.op_type == "Identity" and normalize_domain(node.domain) == ""
                                                    and step.kernel.call_mode == "plain")):
            continue
        if len(step.inputs) != 1 or len(step.outputs) != 1 or not step.outputs[0]:
            continue
        src, dst = step.inputs[0], step.outputs[0]
        j = producer.get(src)
        if j is None or out[j] is None or readers.get(src) != 1 or src in pinned:
            continue
        p = out[j]
        out[j] = dataclasses.replace(p, outputs=tuple(dst if o == src else o for o in p.outputs), release=())
        producer[dst] = j
        out[k] = None
    return [s for s in out if s is not None]


def worth_specializing(root: Plan) -> bool:
    """Whether a root plan has anything shapes could fold: a Shape, Size or If step in it or in
    an If branch (other subgraphs are never inlined)."""
    return any(normalize_domain(step.node.domain) == "" and (step.node.op_type in _SHAPE_OPS or step.node.op_type == "If")
               for step in root.steps)


# -- the runner's part ----------------------------------------------------------------------------

_GENERIC = object()  # a key whose runs take the generic plan


# An integer or boolean input of at most this many values may become part of a plan's key (see
# specialize's ``values``).
VALUE_MAX = 4


def _key(inputs: Sequence[Any], value_at: tuple[int, ...] = ()) -> tuple | None:
    """The key of a run's inputs: their shapes and dtypes, and the values of those at
    ``value_at`` (None: not specialized)."""
    key = []
    for v in inputs:
        if v.__class__ is not np.ndarray:
            return None
        key.append(v.shape)
        key.append(v.dtype.num)
    for i in value_at:
        v = inputs[i]
        if v.size > VALUE_MAX:
            return None
        key.append(v.tobytes())
    return tuple(key)


def _values(names: Sequence[str], inputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """The inputs whose values a plan may hold (``VALUE_MAX`` integers or booleans at most)."""
    return {n: _frozen(v) for n, v in zip(names, inputs)
            if v.__class__ is np.ndarray and v.dtype.kind in "biu" and v.size <= VALUE_MAX}


class Specializer:
    """Specialized root plans of one session, by input shapes and dtypes, and by the values of the
    small inputs an ``If`` condition was found to read (``value_at``: from the first plan that
    folded such a condition on; thread-safe)."""

    def __init__(self, root: Plan) -> None:
        self.root = root
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._seen: OrderedDict[tuple, int] = OrderedDict()
        self._lock = threading.Lock()
        self.value_at: tuple[int, ...] = ()  # indices of the inputs whose values the keys hold

    def run(self, inputs: list[Any]) -> list[Any]:
        value_at = self.value_at
        key = _key(inputs, value_at)
        if key is None:
            return run_plan(self.root, inputs)
        plan = self._plans.get(key)
        if plan is _GENERIC:
            return run_plan(self.root, inputs)
        if plan is not None:
            try:
                return run_plan(plan, inputs)
            except GuardMiss:
                self._store(key, _GENERIC)
                return run_plan(self.root, inputs)
        with self._lock:
            seen = self._seen.pop(key, 0) + 1
            self._seen[key] = seen
            while len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)
        if seen < 2:
            return run_plan(self.root, inputs)
        recorder = _Recorder()
        values = run_plan(self.root, inputs, control=recorder)
        got = None
        if recorder.root is not None:
            got = specialize(recorder.root, _values(self.root.input_names, inputs))
        if got is not None and got[2]:
            names = self.root.input_names
            at = tuple(sorted(set(value_at) | {names.index(n) for n in got[2]}))
            if at != value_at:
                # Keys hold these inputs' values from now on (the plans kept so far are keyed
                # without them: dropped).
                with self._lock:
                    self.value_at = at
                    self._plans.clear()
                    self._seen.clear()
                key = _key(inputs, at)
                if key is None:
                    return values
        self._store(key, _GENERIC if got is None else got[0])
        return values

    def _store(self, key: tuple, plan: Any) -> None:
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
