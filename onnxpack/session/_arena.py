"""Run-time activation memory planning: one preallocated arena per run, planned per input shapes.

How a planned session runs (``onnxpack.memory_planner`` != ``none``):

1. The first run for a *shape signature* (the graph inputs' dtypes and shapes) runs unplanned and
   is **recorded**: per step, its inputs' shapes/dtypes, and per output its dtype, shape, byte
   size and whether it is a view of one of the step's inputs (found with
   ``np.may_share_memory``, so Reshape, Squeeze, Transpose, Slice, Identity, a fallback that
   returns a view ... are all caught without a list of "aliasing ops").
2. From the recording, :func:`~onnxpack.session.planner.compute_lifetimes` gives the lifetime of
   every output of a step whose kernel can write into a given buffer (``kernel.run_into(outs,
   *inputs)``, numpy ``out=``); views extend their base's lifetime; graph outputs and bases that
   graph outputs view are not planned.  :func:`~onnxpack.session.planner.plan` places them and
   the plan is cached per signature.
3. Later runs with that signature take an :class:`_Arena` from the plan's pool (a lock-protected
   free list: concurrent runs never share one, a finished run returns its arena) and hand each
   ``run_into`` kernel prebuilt views of it.  Every other kernel allocates as before.

Why this never changes results:

* ``run_into`` is only used when the step's inputs have exactly the recorded shapes and dtypes
  (so the output shape is the recorded one), and each ``run_into`` does the same numpy operations
  as ``run`` with ``out=``; a kernel may decline (return ``False``) and is then ``run``.
* A value produced by any other step that lies in the arena but is not a recorded view of its
  input (a data-dependent view, a subgraph returning an outer value) is copied at once, while
  its base is still live.  Outputs that reach the user are copied if they touch the arena.

Subgraphs (If/Loop/Scan bodies) run unplanned, through their own ``Plan.run``; they read
outer arena values (which the lifetimes keep live through the owning node), never write them.

There is no second step loop here: recording and planned runs are
:class:`~onnxpack.session._program.StepHook` objects plugged into ``run_plan``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpack.session._program import Frame, Plan, RunControl, Step, StepHook, call_step, run_plan, step_failure, store
from onnxpack.session.planner import MemoryConfig, PlanResult, TensorLifetime, compute_lifetimes
from onnxpack.session.planner import plan as plan_tensors

logger = logging.getLogger(__name__)

__all__ = ["ArenaRunner", "Recording", "analyze", "record", "recording_lifetimes"]

# Signatures (distinct input shapes) whose plans are kept; the first made is dropped beyond this.  A
# model served at a few batch sizes fits; a model fed ever-changing shapes does not grow memory.
MAX_CACHED_PLANS = 8

# Free arenas kept per plan.  Concurrent runs beyond this still get their own arena (allocated
# for the run, freed after it); keeping a few avoids re-faulting the pages of a large arena.
MAX_POOLED_ARENAS = 4

_MISSING = object()


# --------------------------------------------------------------------------------------------
# Recording an unplanned run


@dataclasses.dataclass(frozen=True)
class ValueRecord:
    """One step output seen in the recording run."""

    name: str
    step: int
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    plannable: bool  # a plain ndarray a run_into kernel produced (not a view)
    alias_of: int | None  # index of the step input this output is a view of


@dataclasses.dataclass
class Recording:
    """What one unplanned run of a scope saw: per step, input signature and outputs."""

    steps: list[tuple[tuple[str, ...], tuple[str, ...]]]  # (reads incl. subgraph uses, outputs)
    input_sigs: list[tuple]  # per step, the signature of its explicit inputs
    values: dict[str, ValueRecord]


def _sig(args: Sequence[Any]) -> tuple:
    return tuple((a.shape, a.dtype) if isinstance(a, np.ndarray) else type(a) for a in args)


def _has_run_into(step: Step) -> bool:
    return step.kernel.call_mode == "plain" and step.kernel.writes_into


class _Recorder(StepHook):
    """Records, per step, what the planner needs: reads, input signature, outputs."""

    def __init__(self) -> None:
        self.rec = Recording([], [], {})

    def step(self, k: int, step: Step, args: list[Any], frame: Frame, plan: Plan) -> Sequence[Any]:
        rec = self.rec
        rec.steps.append((step.reads, tuple(step.outputs)))
        rec.input_sigs.append(_sig(args))
        outs = [store(v) for v in call_step(step, frame, args, plan.name)]
        into = _has_run_into(step)
        for name, value in zip(step.outputs, outs):
            if not name or not isinstance(value, np.ndarray):
                continue
            alias = None
            if step.kernel.call_mode != "frame":
                for i, a in enumerate(args):
                    if isinstance(a, np.ndarray) and np.may_share_memory(value, a):
                        alias = i
                        break
            plannable = into and alias is None and not value.dtype.hasobject and value.dtype.kind not in "USV"
            rec.values[name] = ValueRecord(name, k, value.dtype, value.shape, int(value.nbytes), plannable, alias)
        return outs


def record(plan: Plan, inputs: Sequence[Any], parent: Frame | None = None,
           control: RunControl | None = None) -> tuple[list[Any], Recording]:
    """Run ``plan`` unplanned and record what the planner needs; returns (outputs, recording)."""
    recorder = _Recorder()
    outputs = run_plan(plan, inputs, parent, recorder, control)
    return outputs, recorder.rec


def recording_lifetimes(plan: Plan, rec: Recording, *, only_plannable: bool = True) -> list[TensorLifetime]:
    """Lifetimes of the recorded intermediates.

    ``only_plannable`` (the run-time plan) keeps outputs of ``run_into`` kernels only; ``False``
    (the report: ``onnxpack plan``, the benchmark) plans every intermediate ndarray, as a runtime
    whose every kernel wrote into the arena would.
    """
    sizes: dict[str, int] = {}
    aliases: dict[str, str] = {}
    for name, v in rec.values.items():
        if v.alias_of is not None:
            src = plan.steps[v.step].inputs[v.alias_of]
            if src:
                aliases[name] = src
        elif v.plannable or (not only_plannable and not v.dtype.hasobject and v.dtype.kind not in "USV"):
            sizes[name] = v.nbytes
    return compute_lifetimes(
        rec.steps, sizes, graph_inputs=plan.input_names, graph_outputs=plan.output_names, aliases=aliases
    )


# --------------------------------------------------------------------------------------------
# A plan for one signature, and its arenas


@dataclasses.dataclass(frozen=True)
class _OutSpec:
    memory: int | None  # index in the config's memories; None: not planned (a fresh np.empty)
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class _IntoStep:
    sig: tuple  # the step's recorded input signature: run_into only when it matches
    outs: tuple[_OutSpec | None, ...]  # per output (None for an omitted output name)

    fresh: bool = False  # some output is not in the arena: it gets its own np.empty per run


class _Arena:
    """The buffers of one run (one per memory) and the prebuilt output views per step."""

    __slots__ = ("buffers", "outs")

    def __init__(self, sizes: Sequence[int], alignments: Sequence[int], into: Sequence[_IntoStep | None]) -> None:
        self.buffers: list[np.ndarray] = []
        for size, align in zip(sizes, alignments):
            raw = np.empty(size + align, dtype=np.uint8)
            shift = (-raw.ctypes.data) % align
            self.buffers.append(raw[shift : shift + size])
        self.outs: list[tuple | None] = []
        for st in into:
            if st is None:
                self.outs.append(None)
                continue
            views = []
            for o in st.outs:
                if o is None or o.memory is None:
                    views.append(None)
                else:
                    buf = self.buffers[o.memory]
                    views.append(buf[o.offset : o.offset + o.nbytes].view(o.dtype).reshape(o.shape))
            self.outs.append(tuple(views))

    def touches(self, value: np.ndarray) -> bool:
        return any(np.may_share_memory(value, b) for b in self.buffers if b.size)


class _SignaturePlan:
    """The plan for one input signature, with its pool of arenas."""

    def __init__(self, plan: Plan, rec: Recording, algorithm: str, config: MemoryConfig, signature: tuple,
                 pooled: int = MAX_POOLED_ARENAS) -> None:
        self.signature = signature
        self.pooled = pooled
        self.lifetimes = recording_lifetimes(plan, rec, only_plannable=True)
        self.result: PlanResult = plan_tensors(self.lifetimes, config, algorithm)
        self.config = config
        self.records = rec.values
        mem_index = {m.name: i for i, m in enumerate(config.memories)}
        placed = {p.name: p for p in self.result.placements}
        self.into: list[_IntoStep | None] = []
        for k, step in enumerate(plan.steps):
            if not _has_run_into(step):
                self.into.append(None)
                continue
            specs = []
            ok = True
            for name in step.outputs:
                v = rec.values.get(name) if name else None
                if not name:
                    specs.append(None)
                elif v is None or not v.plannable:
                    ok = False  # an output the kernel did not give as a fresh ndarray
                    break
                else:
                    p = placed.get(name)
                    mem = None if p is None or v.nbytes == 0 else mem_index[p.memory]
                    specs.append(_OutSpec(mem, 0 if p is None else p.offset, v.dtype, v.shape, v.nbytes))
            fresh = any(o is not None and o.memory is None for o in specs)
            self.into.append(_IntoStep(rec.input_sigs[k], tuple(specs), fresh) if ok else None)
        # Outputs that are recorded views of an input: name -> input index (kept, not copied).
        self.alias_input = {n: v.alias_of for n, v in rec.values.items() if v.alias_of is not None}
        # Steps that may see arena bytes: they read a planned tensor or a recorded view of one
        # (subgraph reads included).  Only their outputs need the "unrecorded view" check: a
        # step reading no arena value cannot return a view of the arena.
        in_arena = {p.name for p in self.result.placements if p.size}
        for k, step in enumerate(plan.steps):
            for name in step.outputs:
                i = self.alias_input.get(name) if name else None
                if i is not None and step.inputs[i] in in_arena:
                    in_arena.add(name)
        self.guard = [any(n in in_arena for n in rec.steps[k][0]) for k in range(len(plan.steps))]
        self.sizes = [self.result.arena_size_per_memory[m.name] for m in config.memories]
        self.alignments = [m.alignment for m in config.memories]
        self._pool: list[_Arena] = []
        self.planned_steps = sum(1 for st in self.into if st is not None)

    def acquire(self) -> _Arena:
        # list.pop / list.append are atomic under the GIL: one arena goes to one run only.
        try:
            return self._pool.pop()
        except IndexError:
            return _Arena(self.sizes, self.alignments, self.into)

    def release(self, arena: _Arena) -> None:
        if len(self._pool) < self.pooled:  # a race may keep one or two more: harmless
            self._pool.append(arena)

    def as_dict(self, plan: Plan) -> dict[str, Any]:
        d = self.result.as_dict()
        producers = {k: plan.steps[k].node.name for k in range(len(plan.steps))}
        for t in d["tensors"]:
            v = self.records[t["name"]]
            t.update(nbytes=v.nbytes, dtype=str(v.dtype), shape=list(v.shape), node=producers[v.step])
        d["signature"] = [{"name": n, "dtype": dt, "shape": list(s)} for n, dt, s in self.signature]
        d["steps"] = len(plan.steps)
        d["planned_steps"] = self.planned_steps
        d["lifetimes"] = [dataclasses.asdict(t) for t in self.lifetimes]
        return d


def _copy_if_in(arena: _Arena, value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy(order="K") if arena.touches(value) else value
    if isinstance(value, list):
        return [_copy_if_in(arena, v) for v in value]
    return value


def _unaliased(arena: _Arena, name: str, value: Any, args: list, alias_input: dict[str, int]) -> Any:
    """``value``, or a copy of it when it views the arena without being a recorded view."""
    if isinstance(value, np.ndarray):
        if arena.touches(value):
            i = alias_input.get(name)
            if i is None or not (isinstance(args[i], np.ndarray) and np.may_share_memory(value, args[i])):
                return value.copy(order="K")  # e.g. a data-dependent view, a subgraph's outer value
        return value
    return _copy_if_in(arena, value)


class _Planned(StepHook):
    """Runs ``run_into`` steps into the arena's prebuilt views; copies unrecorded arena views."""

    def __init__(self, sp: _SignaturePlan, arena: _Arena) -> None:
        self.sp = sp
        self.arena = arena

    def step(self, k: int, step: Step, args: list[Any], frame: Frame, plan: Plan) -> Sequence[Any]:
        sp, arena = self.sp, self.arena
        st = sp.into[k]
        if st is not None and _sig(args) == st.sig:
            outs = arena.outs[k]
            if st.fresh:  # outputs not in the plan (graph outputs, ...): allocated as usual
                outs = tuple(
                    v if v is not None or o is None else np.empty(o.shape, o.dtype) for v, o in zip(outs, st.outs)
                )
            try:
                done = step.kernel.run_into(outs, *args)
            except Exception as exc:
                raise step_failure(step, plan.name, exc) from exc
            if isinstance(done, (tuple, list)):  # the outputs, each in its given buffer
                return list(done)
            if done is not False:
                return outs
        outs = [store(v) for v in call_step(step, frame, args, plan.name)]
        if sp.guard[k]:
            outs = [_unaliased(arena, name, value, args, sp.alias_input) for name, value in zip(step.outputs, outs)]
        return outs


def run_planned(plan: Plan, inputs: Sequence[Any], sp: _SignaturePlan, arena: _Arena,
                control: RunControl | None = None) -> list[Any]:
    """Run the root plan with ``run_into`` kernels writing into ``arena``; outputs never alias it."""
    return [_copy_if_in(arena, v) for v in run_plan(plan, inputs, None, _Planned(sp, arena), control)]


# --------------------------------------------------------------------------------------------
# The session's entry point


class ArenaRunner:
    """Runs a root plan with the memory planner: record, plan and cache per input signature.

    Thread-safe: the plan cache is guarded by a lock and each run holds its own arena.
    ``pool_arenas=False`` (``SessionOptions.enable_cpu_mem_arena = False``) frees each run's
    arena after the run instead of keeping it for the next.
    """

    def __init__(self, plan: Plan, algorithm: str, config: MemoryConfig | None = None, *,
                 pool_arenas: bool = True) -> None:
        self.plan = plan
        self.pooled = MAX_POOLED_ARENAS if pool_arenas else 0
        self.algorithm = algorithm
        self.config = config or MemoryConfig.default()
        self._plans: collections.OrderedDict[tuple, _SignaturePlan | None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._last: _SignaturePlan | None = None

    @staticmethod
    def signature(plan: Plan, inputs: Sequence[Any]) -> tuple | None:
        try:
            return tuple((name, v.dtype.str, v.shape) for name, v in zip(plan.input_names, inputs))
        except AttributeError:
            return None  # sequences/optionals as graph inputs: run unplanned

    def run(self, inputs: Sequence[Any], control: RunControl | None = None) -> list[Any]:
        plan = self.plan
        sig = self.signature(plan, inputs)
        if sig is None:
            return run_plan(plan, inputs, control=control)
        sp = self._plans.get(sig, _MISSING)  # a dict read is atomic; writes hold the lock
        if sp is _MISSING:
            outputs, rec = record(plan, inputs, control=control)
            try:
                made: _SignaturePlan | None = _SignaturePlan(plan, rec, self.algorithm, self.config, sig, self.pooled)
            except Exception as exc:  # planning must never break a run: stay unplanned
                logger.warning("memory planner: no plan for graph %r (%s: %s); running unplanned", plan.name, type(exc).__name__, exc)
                made = None
            with self._lock:
                self._plans.setdefault(sig, made)
                while len(self._plans) > MAX_CACHED_PLANS:
                    self._plans.popitem(last=False)
                if made is not None:
                    self._last = made
            return outputs
        if sp is None or sp.planned_steps == 0:
            return run_plan(plan, inputs, control=control)
        arena = sp.acquire()
        try:
            return run_planned(plan, inputs, sp, arena, control)
        finally:
            sp.release(arena)

    def shrink(self) -> None:
        """Frees the pooled arenas of every plan (``memory.enable_memory_arena_shrinkage``)."""
        with self._lock:
            for sp in self._plans.values():
                if sp is not None:
                    sp._pool.clear()

    def memory_plan(self, input_shapes: dict[str, Sequence[int]] | None = None) -> dict[str, Any] | None:
        """The plan of the last planned signature, or of the one whose input shapes are given."""
        with self._lock:
            if input_shapes is None:
                sp = self._last
            else:
                want = {n: tuple(int(d) for d in s) for n, s in input_shapes.items()}
                sp = next(
                    (p for sig, p in reversed(self._plans.items()) if p is not None and {n: s for n, _d, s in sig} == want),
                    None,
                )
        return None if sp is None else sp.as_dict(self.plan)


def analyze(
    plan: Plan,
    inputs: Sequence[Any],
    *,
    algorithm: str = "auto",
    config: MemoryConfig | None = None,
    runtime_only: bool = False,
) -> tuple[list[TensorLifetime], PlanResult, Recording]:
    """Record one unplanned run of a root ``plan`` on ``inputs`` (in ``plan.input_names`` order,
    e.g. from ``validate_feed``) and plan its intermediates.

    For reports (``onnxpack plan``, the benchmark): ``runtime_only=False`` plans every
    intermediate ndarray, ``True`` only those the run-time arena holds (``run_into`` outputs).

    Raises:
        InvalidArgument: an unknown algorithm.
        PlannerMemoryError: a tensor fits in no memory of ``config``.
    """
    _, rec = record(plan, inputs)
    lifetimes = recording_lifetimes(plan, rec, only_plannable=runtime_only)
    return lifetimes, plan_tensors(lifetimes, config or MemoryConfig.default(), algorithm), rec
