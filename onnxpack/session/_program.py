"""The compiled form of a model: frozen per-scope plans of bound kernels, and the one step loop.

A :class:`Program` is what :func:`~onnxpack.session._compile.compile` returns and what an
``InferenceSession`` runs.  It holds one :class:`Plan` per scope (keyed by scope path), the pack
log (one :class:`PackEvent` per packed kernel input) and the statistics derived from it.

A :class:`Plan` is a frozen tuple of :class:`Step` records (bound kernel, input names, output
names, which inputs were taken pre-packed, which values die after the step), its constants and
its graph's inputs and outputs.  :func:`run_plan` is the only loop that executes steps: plain
runs, subgraph runs (If/Loop/Scan call back into it with their frame) and the memory planner's
recording and arena runs all go through it; the planner plugs in as a :class:`StepHook`, which
decides how one step is called (e.g. writing into a preallocated buffer) and may look at its
outputs.  A plain run (no hook, no run control) of a plan that has run before goes through the
plan's generated function instead (:mod:`~onnxpack.session._codegen`): the same loop unrolled
into Python source, its values local variables.

Running a plan creates a :class:`Frame` — a dict of values plus the enclosing frame — so
concurrent runs share nothing mutable.

What a caller asks of one run beyond its outputs — stop when ``RunOptions.terminate`` is set,
time every node for the profiler, write outputs into bound buffers — is a :class:`RunControl`
passed to :func:`run_plan`.  It reaches subgraph runs through their frames and wraps each plan's
hook once per plan run; a run without one takes the plain loop, untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import _thread
import threading
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import numpy as np

from onnxpack._frozen import fast_init
from onnxpack.errors import InvalidGraph, RuntimeFailure
from onnxpack.graph._proto import NodeProto
from onnxpack.prepack import PackSpec, PrePackedWeights, WeightRef
from onnxpack.session.kernels import Kernel

__all__ = [
    "Frame",
    "Step",
    "Plan",
    "Program",
    "PackEvent",
    "PrepackStats",
    "RunControl",
    "StepHook",
    "call_step",
    "prune",
    "run_plan",
    "schedule",
    "step_failure",
    "topological_order",
]

logger = logging.getLogger(__name__)

_MISSING = object()


class Frame:
    """Values of one running scope; names not found here are looked up in the parent frame."""

    __slots__ = ("values", "parent", "control")

    def __init__(self, values: dict[str, Any], parent: Frame | None, control: RunControl | None = None) -> None:
        self.values = values
        self.parent = parent
        self.control = control  # the run's control, inherited by subgraph runs

    def get(self, name: str) -> Any:
        frame: Frame | None = self
        while frame is not None:
            v = frame.values.get(name, _MISSING)
            if v is not _MISSING:
                return v
            frame = frame.parent
        raise KeyError(name)

    def visible(self) -> dict[str, Any]:
        """Every visible name (outer first, inner wins): the context onnx.reference wants."""
        chain = []
        frame: Frame | None = self
        while frame is not None:
            chain.append(frame.values)
            frame = frame.parent
        out: dict[str, Any] = {}
        for values in reversed(chain):
            out.update(values)
        return out


@fast_init
@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One node bound to its kernel.

    ``inputs`` holds ``""`` for an omitted optional input; ``packed`` the input indices the
    kernel took pre-packed (they are fed ``None``); ``release`` the local names whose last use is
    this step; ``implicit`` the names the node's subgraphs read from enclosing scopes.
    """

    node: NodeProto
    kernel: Kernel
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    packed: frozenset[int] = frozenset()
    release: tuple[str, ...] = ()
    implicit: tuple[str, ...] = ()
    # Derived once, for the step loop: the input names with "" for omitted and packed inputs
    # (both are fed None), so a run does no set lookups per argument.
    args: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple("" if i in self.packed else n for i, n in enumerate(self.inputs)))

    def with_release(self, release: tuple[str, ...]) -> Step:
        """This step releasing ``release`` after it runs (``dataclasses.replace`` re-reads the
        class's fields per call: the planner makes one per step of every plan; ``args`` depends on
        the fields it keeps, so it is carried over, not derived again)."""
        step = object.__new__(Step)
        for name in Step.__slots__:
            object.__setattr__(step, name, getattr(self, name))
        object.__setattr__(step, "release", release)
        return step

    @property
    def label(self) -> str:
        return f"node {self.node.name or '<unnamed>'!r} ({self.node.op_type})"

    @property
    def reads(self) -> tuple[str, ...]:
        """Every name the step reads: its inputs and its subgraphs' implicit inputs."""
        return tuple(n for n in (*self.inputs, *self.implicit) if n)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The steps of one graph, in order, with release points, constants and declared outputs.

    ``output_types`` (ONNX elem types) and ``output_dims`` (declared shapes, ``None`` entries
    for unknown dims, ``None`` for no shape) let Loop/Scan give zero-trip outputs the body's
    declared type.
    """

    name: str
    path: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    constants: Mapping[str, Any]
    steps: tuple[Step, ...]
    output_types: tuple[int, ...] = ()
    output_dims: tuple[tuple[int | None, ...] | None, ...] = ()

    def run(self, inputs: Sequence[Any], parent: Frame | None = None) -> list[Any]:
        return run_plan(self, inputs, parent)


@fast_init
@dataclasses.dataclass(frozen=True)
class PackEvent:
    """One packed kernel input: which node packed which weight, the pack and where it came from.

    ``origin`` is ``packed`` (packed now), ``model`` (mapped from the model's data file),
    ``cache`` (mapped from the cache file) or ``container`` (another session or node had it).
    """

    scope: str  # path of the scope of the node
    node: str
    op_type: str
    input: int
    weight: WeightRef
    spec: PackSpec
    entry: PrePackedWeights
    origin: str
    seconds: float = 0.0

    def as_row(self) -> dict[str, Any]:
        return {"scope": self.scope, "node": self.node, "op_type": self.op_type, "input": self.input,
                "weight": self.weight.name, "key": self.entry.key, "nbytes": self.entry.nbytes,
                "origin": self.origin}


@dataclasses.dataclass(frozen=True)
class PrepackStats:
    """Where every packed weight of a session came from, and what it cost."""

    weights_packed: int = 0  # packed at creation by this session
    blobs_from_model: int = 0  # mapped from the model's data file
    blobs_from_cache: int = 0  # mapped from the persistent cache file
    blobs_from_container: int = 0  # already in the (shared) container
    blobs_rejected: int = 0  # saved blobs ignored with a warning (then re-packed)
    bytes_packed: int = 0
    bytes_mapped: int = 0
    bytes_held: int = 0  # bytes of every packed weight this session uses
    seconds_packing: float = 0.0
    originals_released: int = 0  # weights whose every consumer uses a packed form

    @classmethod
    def from_log(cls, log: Sequence[PackEvent], *, rejected: int, released: int) -> PrepackStats:
        """The one place counters are derived: from the pack log."""
        count = dict.fromkeys(("packed", "model", "cache", "container"), 0)
        nbytes = dict.fromkeys(count, 0)
        held: dict[str, int] = {}
        seconds = 0.0
        for e in log:  # (one pass: an entry's nbytes sums its buffers' at every access)
            n = e.entry.nbytes
            count[e.origin] = count.get(e.origin, 0) + 1
            nbytes[e.origin] = nbytes.get(e.origin, 0) + n
            held[e.entry.key] = n
            if e.origin == "packed":
                seconds += e.seconds
        return cls(
            weights_packed=count["packed"],
            blobs_from_model=count["model"],
            blobs_from_cache=count["cache"],
            blobs_from_container=count["container"],
            blobs_rejected=rejected,
            bytes_packed=nbytes["packed"],
            bytes_mapped=nbytes["model"] + nbytes["cache"],
            bytes_held=sum(held.values()),
            seconds_packing=seconds,
            originals_released=released,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled model: what a session runs and what ``onnxpack optimize`` saves.

    ``overridable`` are root initializers that are also graph inputs (IR >= 4): fed by the user
    or, when not fed, ``defaults``.
    """

    plans: Mapping[str, Plan]  # scope path -> plan
    root: Plan
    overridable: frozenset[str]
    defaults: Mapping[str, Any]
    pack_log: tuple[PackEvent, ...]
    fallback_nodes: tuple[str, ...]
    stats: PrepackStats
    inputs: tuple[Any, ...] = ()  # the root graph's input ValueInfoProtos as compiled (dims overridden)
    outputs: tuple[Any, ...] = ()  # its output ValueInfoProtos, likewise
    # Checks run before every run: each raises if a file this program maps (the model's data
    # files, the cache file, another model's blobs shared through the container) was truncated or
    # rewritten since it was mapped — reading it would kill the process (SIGBUS) or read other
    # weights.  One fstat each.
    guards: tuple[Callable[[], None], ...] = ()
    # One kernel per class that has process-wide warm-up work (Kernel.warm_up): the session runs
    # them in a background thread after creation.
    warm_ups: tuple[Callable[[], None], ...] = ()

    def check_files(self) -> None:
        for guard in self.guards:
            guard()

    def start_warm_ups(self) -> None:
        """Runs the kernels' warm-ups (``Kernel.warm_up``) in one background (daemon) thread.

        Started with ``_thread`` rather than ``threading.Thread``, whose ``start()`` waits until
        the new thread has run: with the GIL, that wait let the warm-up (importing llvmlite,
        loading native code) hold the interpreter for 1-3 ms of every session's creation.
        """
        if self.warm_ups:
            with _PENDING:
                _pending[0] += 1
            try:
                _thread.start_new_thread(_warm_up, (self.warm_ups,))
            except BaseException:
                _warm_up_done()
                raise


# Held while warm-ups run, and taken around fork(): a warm-up loads compiled code under the JIT's
# own locks, and a child forked while another thread held one would wait for it forever (a
# session forked into workers right after creation hung so in its first run).
_WARMING = threading.Lock()
# Warm-ups started and not finished (counted from the creating thread, before the new thread
# runs): wait_warm_ups() waits for them.
_PENDING = threading.Condition()
_pending = [0]


def _warm_up(tasks: Sequence[Callable[[], None]]) -> None:
    try:
        with _WARMING:
            for task in tasks:
                try:
                    task()
                except Exception as exc:  # a warm-up only saves time later; the first run reports real errors
                    logger.debug("warm-up %r failed: %s", task, exc)
    finally:
        _warm_up_done()


def _warm_up_done() -> None:
    with _PENDING:
        _pending[0] -= 1
        _PENDING.notify_all()


def wait_warm_ups(timeout: float | None = None) -> bool:
    """Waits until every warm-up started so far in this process has finished; False on timeout.

    For code that changes what the JIT loaders see (their caches, ``ONNXPACK_DISABLE_*``): a
    warm-up still running in the background would otherwise load kernels under the old settings.
    """
    with _PENDING:
        return _PENDING.wait_for(lambda: _pending[0] <= 0, timeout)


def _after_fork_in_child() -> None:
    global _PENDING
    _WARMING.release()
    _PENDING = threading.Condition()  # the parent's warm-up threads do not exist here
    _pending[0] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_WARMING.acquire, after_in_parent=_WARMING.release,
                        after_in_child=_after_fork_in_child)


# -- running ------------------------------------------------------------------------------------


class StepHook:
    """How the memory planner takes part in a run without a loop of its own.

    ``step(k, step, args, frame, plan)`` returns the step's outputs; the default calls the kernel.
    ``steps(plan)`` is which steps (indices into ``plan.steps``) go through ``step``: every one by
    default; the others are called as in a plain run.
    """

    def step(self, k: int, step: Step, args: list[Any], frame: Frame, plan: Plan) -> Sequence[Any]:
        return call_step(step, frame, args, plan.name)

    def steps(self, plan: Plan) -> Container[int]:
        return range(len(plan.steps))


class RunControl:
    """What a run asks beyond its outputs (terminate checks, profiling, bound outputs).

    ``hook(plan, inner, root)`` returns the hook that runs ``plan``'s steps: ``inner`` (the
    memory planner's hook, or ``None`` for the plain call) wrapped as the control needs; ``root``
    is True for the model's graph, False for a subgraph run.  Called once per plan run.
    """

    def hook(self, plan: Plan, inner: StepHook | None, root: bool) -> StepHook | None:
        return inner

    def check(self) -> None:
        """Raises what a step would raise were the run to stop now (``Terminated``): for kernels
        that loop without running steps (a Loop whose body has none)."""


def missing_outputs(step: Step, outs: Sequence[Any], scope: str) -> None:
    """Refuses a result with fewer values than the node names outputs: a node written with more
    outputs than its op has (onnxruntime refuses such a model at load).  Without this its extra
    outputs were silently never produced, and a node reading one failed with a bare KeyError."""
    names = step.outputs
    if len(outs) < len(names) and any(names[len(outs):]):
        raise RuntimeFailure(
            f"{step.label} in graph {scope!r}: the node names {len(names)} outputs, its op produces "
            f"{len(outs)} ({[n for n in names[len(outs):] if n]} are never produced)")


def call_step(step: Step, frame: Frame, args: Sequence[Any], scope: str) -> Sequence[Any]:
    """Calls the step's kernel the way it asks to be called (see ``Kernel.call_mode``)."""
    outs = _call_step(step, frame, args, scope)
    if len(outs) < len(step.outputs):
        missing_outputs(step, outs, scope)
    return outs


def step_failure(step: Step, scope: str, exc: BaseException) -> RuntimeFailure:
    """The error a run reports for a kernel's exception: the step and graph named, the cause kept
    by the caller's ``raise ... from exc``."""
    return RuntimeFailure(f"{step.label} in graph {scope!r} failed: {type(exc).__name__}: {exc}")


def _call_step(step: Step, frame: Frame, args: Sequence[Any], scope: str) -> Sequence[Any]:
    kernel = step.kernel
    try:
        mode = kernel.call_mode
        if mode == "plain":
            return kernel.run(*args)
        if mode == "frame":
            return kernel.run_in_frame(frame, *args)
        return kernel.run(*args, context=frame.visible())
    except RuntimeFailure:
        raise
    except Exception as exc:
        raise step_failure(step, scope, exc) from exc


def store(value: Any) -> Any:
    """A kernel's output as kept in a frame (numpy scalars become 0-d arrays)."""
    return value if isinstance(value, (np.ndarray, list)) or value is None else np.asarray(value)


_DECLINED = object()


def _no_outer(name: str) -> Any:
    raise KeyError(name)


def _generated(plan: Plan, runs: int | None) -> Any:
    """The plan's generated function on its second plain run; until then its run count (kept on
    the plan, which is frozen: its ``__dict__`` directly); ``_DECLINED`` when the plan has what the
    generated function does not do (see _codegen)."""
    if not runs:
        plan.__dict__["_fast"] = 1
        return 1
    from onnxpack.session import _codegen

    try:
        fast = _codegen.generate(plan, store, missing_outputs, step_failure, Frame)
    except _codegen.Declined as exc:
        logger.debug("graph %r runs on the step loop: %s", plan.name, exc)
        fast = _DECLINED
    except Exception as exc:  # noqa: BLE001 - never a run's failure: the loop computes the same
        logger.warning("graph %r: no generated function (%s: %s); running the step loop", plan.name,
                       type(exc).__name__, exc)
        fast = _DECLINED
    plan.__dict__["_fast"] = fast
    return fast


def run_plan(plan: Plan, inputs: Sequence[Any], parent: Frame | None = None,
             hook: StepHook | None = None, control: RunControl | None = None) -> list[Any]:
    """Runs ``plan`` on ``inputs`` (in ``plan.input_names`` order); the one step loop.

    ``control`` (or, for a subgraph, the enclosing frame's) wraps ``hook`` once, here: the loop
    itself has no per-step check for it.
    """
    if control is None and parent is not None:
        control = parent.control
    if control is not None:
        hook = control.hook(plan, hook, parent is None)
    if hook is None and len(inputs) == len(plan.input_names):
        # A plain run: the plan's generated function (_codegen) once it has run twice.
        fast = plan.__dict__.get("_fast")
        if fast is None or fast.__class__ is int:
            fast = _generated(plan, fast)
        if fast is not _DECLINED and fast.__class__ is not int:
            return fast(inputs, _no_outer if parent is None else parent.get, parent)
    values = dict(plan.constants)
    for name, value in zip(plan.input_names, inputs):
        values[name] = value
    frame = Frame(values, parent, control)
    get = frame.get
    # One loop for plain and hooked runs (measured on a 1,000-node chain of tiny ops,
    # benchmarks/bench_overhead.py): arguments from the precomputed ``Step.args``, the kernel's
    # bound method called directly for ``plain`` kernels, a single output stored without a loop.
    # A hook sees only the steps it asks for (a decoding step's bound outputs are 48 of its 178
    # steps): the others pay nothing for it.
    hooked = () if hook is None else hook.steps(plan)
    for k, step in enumerate(plan.steps):
        args = [values[n] if n in values else (get(n) if n else None) for n in step.args]
        if k in hooked:
            outs = hook.step(k, step, args, frame, plan)
        else:
            kernel = step.kernel
            try:
                mode = kernel.call_mode
                if mode == "plain":
                    outs = kernel.run(*args)
                elif mode == "frame":
                    outs = kernel.run_in_frame(frame, *args)
                else:
                    outs = kernel.run(*args, context=frame.visible())
            except RuntimeFailure:
                raise
            except Exception as exc:
                raise step_failure(step, plan.name, exc) from exc
        names = step.outputs
        if len(names) == 1:
            name = names[0]
            if name:
                value = outs[0]
                values[name] = value if value.__class__ is np.ndarray or value is None or isinstance(
                    value, (np.ndarray, list)) else np.asarray(value)
        else:
            if len(outs) < len(names):
                missing_outputs(step, outs, plan.name)
            for name, value in zip(names, outs):
                if name:
                    values[name] = value if isinstance(value, (np.ndarray, list)) or value is None else np.asarray(value)
        for name in step.release:
            values.pop(name, None)
    try:
        return [values[n] if n in values else get(n) for n in plan.output_names]
    except KeyError as exc:
        raise RuntimeFailure(f"graph {plan.name!r}: output {exc.args[0]!r} was not produced") from None


# -- building (pure) ----------------------------------------------------------------------------


def prune(plan: Plan, outputs: Sequence[str]) -> Plan:
    """``plan`` reduced to the steps ``outputs`` depend on (``RunOptions.only_execute_path_to_fetches``),
    with release points recomputed; the other steps are not run.  O(steps + reads)."""
    producer = {o: k for k, step in enumerate(plan.steps) for o in step.outputs if o}
    keep: set[int] = set()
    todo = [producer[n] for n in outputs if n in producer]
    while todo:
        k = todo.pop()
        if k in keep:
            continue
        keep.add(k)
        todo.extend(producer[n] for n in plan.steps[k].reads if n in producer)
    steps = [step.with_release(()) for k, step in enumerate(plan.steps) if k in keep]
    return dataclasses.replace(plan, output_names=tuple(outputs), output_types=(), output_dims=(),
                               steps=schedule(steps, plan.input_names, outputs, plan.constants))



def topological_order(nodes: Sequence[NodeProto], available: Callable[[str], bool], scope_name: str,
                      reads: Sequence[Sequence[str]] | None = None, known: Container[str] = (),
                      outputs: Sequence[Sequence[str]] | None = None) -> list[int]:
    """Indices of ``nodes`` in an order where every input is produced before use.

    ``available(name)`` says whether a name is defined before any node runs (graph inputs,
    initializers, names visible from enclosing scopes); ``known`` holds names it would say yes
    to, tested first (a set look-up instead of a call per weight read); ``reads[i]`` is what node
    ``i`` reads — its inputs plus the implicit inputs of its subgraphs (default: its inputs);
    ``outputs[i]`` its outputs, when the caller has them (default: read from the protos).  A
    name produced twice, a cycle, or an input nobody produces is InvalidGraph.  O(nodes + edges).
    """
    producers: dict[str, int] = {}
    if outputs is None:
        # a slice: iterating the container ends in a formatted IndexError
        outputs = [node.output[:] for node in nodes]
    for i, outs in enumerate(outputs):
        for out in outs:
            if out:
                if out in producers:
                    raise InvalidGraph(
                        f"graph {scope_name!r}: value {out!r} is produced by two nodes "
                        f"({nodes[producers[out]].name!r} and {nodes[i].name!r})"
                    )
                producers[out] = i
    if reads is None:
        reads = [node.input[:] for node in nodes]
    get = producers.get

    def missing(i: int, name: str) -> InvalidGraph:
        node = nodes[i]
        return InvalidGraph(f"graph {scope_name!r}: node {node.name!r} ({node.op_type}) uses {name!r}, "
                            "which is not a graph input, an initializer, or any node's output")

    # Most graphs list their nodes in an order that already works (ONNX asks for it): then that
    # order is the answer -- the depth-first pass below would return it too, since every node's
    # producers come first -- and one look-up per read decides it.  Names defined before any
    # node runs are skipped; a name nobody defines is InvalidGraph, at the first node reading one.
    # (``defined``: the names defined before node ``i`` runs, tested a node at a time in C; only a
    # node reading something else -- an omitted input, an enclosing scope's name, a later
    # node's output, nothing -- is looked at a name at a time.)
    ordered = True
    defined = set(known).difference(producers)  # (a node's output is its, whatever else has the name)
    defined.add("")
    for i, names in enumerate(reads):
        if not defined.issuperset(names):
            for name in names:
                if name not in defined:
                    if get(name) is not None:  # a later node's output (the earlier ones' are defined)
                        ordered = False
                        break
                    if not available(name):
                        raise missing(i, name)
            if not ordered:
                break
        defined.update(outputs[i])
    if ordered:
        return list(range(len(nodes)))
    deps: list[list[int]] = []
    for i, names in enumerate(reads):
        mine: set[int] = set()
        for name in names:
            if name:
                p = get(name)
                if p is None:
                    if name in known or available(name):
                        continue
                    raise missing(i, name)
                mine.add(p)
        deps.append(sorted(mine))
    order: list[int] = []
    state = [0] * len(nodes)  # 0 new, 1 on stack, 2 done
    for start in range(len(nodes)):
        if state[start]:
            continue
        stack = [(start, iter(deps[start]))]
        state[start] = 1
        while stack:
            i, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                state[i] = 2
                order.append(i)
            elif state[nxt] == 1:
                raise InvalidGraph(f"graph {scope_name!r}: cycle through node {nodes[nxt].name!r} ({nodes[nxt].op_type})")
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(deps[nxt])))
    return order


def schedule(steps: Sequence[Step], input_names: Sequence[str], output_names: Sequence[str],
             constants: Mapping[str, Any]) -> tuple[Step, ...]:
    """The steps with their release lists: a local value dies after its last reader.

    Only values this scope produces (its inputs and step outputs) are released; graph outputs and
    constants are kept; an output nobody reads is dropped at once.  O(steps + reads).
    """
    keep = set(output_names) | set(constants)
    last: dict[str, int] = {}
    for k, step in enumerate(steps):
        for name in step.reads:
            last[name] = k
    produced = set(input_names)
    for step in steps:
        produced.update(o for o in step.outputs if o)
    release: dict[int, list[str]] = {}
    for name, k in last.items():
        if name in produced and name not in keep:
            release.setdefault(k, []).append(name)
    out = []
    for k, step in enumerate(steps):
        names = list(release.get(k, ()))
        names.extend(o for o in step.outputs if o and o not in last and o not in keep)
        out.append(step.with_release(tuple(names)))
    return tuple(out)
