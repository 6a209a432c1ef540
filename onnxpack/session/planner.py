"""Activation memory planning: place every intermediate tensor at an offset in an arena.

Intermediate tensors whose lifetimes do not overlap may share bytes, so one preallocated arena
per memory replaces a malloc per tensor and makes the peak predictable.  Everything here is a
pure function over plain records — :class:`TensorLifetime` in, :class:`PlanResult` out — so the
algorithms are tested alone and the session only has to turn a plan into numpy views.

Three placement algorithms, one contract ``(lifetimes, config) -> PlanResult``:

* ``naive`` — a bump allocator: every tensor gets its own bytes.  The baseline and the worst case.
* ``greedy_by_size`` — Pisarchyk & Lee 2020, "Efficient Memory Management for Deep Neural Net
  Inference", *greedy by size for offset calculation*: tensors in decreasing size; each goes into
  the smallest gap (the leading gap at offset 0 included) left between already placed tensors
  whose lifetimes overlap its own, else right after the highest of them.
* ``position_greedy`` — tensors in order of first use; each goes into the *first* gap from offset
  0 that fits (first fit), else after the highest overlapping tensor.

Memories form a hierarchy (:class:`MemoryConfig`, fastest first): a tensor goes to the first memory
where it fits, given that memory's capacity and what is already placed there.  Offsets honour the
memory's alignment and sizes are rounded up to it, so every gap boundary is aligned too.

Lifetimes are inclusive step ranges ``[first, last]`` over the execution plan; two tensors conflict
when their ranges intersect.  :func:`compute_lifetimes` derives them from a plan, folding views
(Reshape, Squeeze, Identity, ...) into their base.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from onnxpack._units import format_bytes
from onnxpack._io import atomic_write
from onnxpack.errors import ConfigError, InvalidArgument, InvalidGraph, PlannerMemoryError

logger = logging.getLogger(__name__)

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALIGNMENT",
    "Memory",
    "MemoryConfig",
    "PlanResult",
    "Placement",
    "TensorLifetime",
    "compute_lifetimes",
    "format_table",
    "greedy_by_size",
    "lower_bound",
    "naive",
    "plan",
    "plot",
    "position_greedy",
    "validate",
]

# 64 bytes: a cache line on x86-64 and most ARM cores, and the widest SIMD load (AVX-512), so any
# numpy kernel writing into an arena view gets the same alignment numpy's own allocator gives.
DEFAULT_ALIGNMENT = 64

# Name of the default memory: one unbounded region (ordinary RAM).
DEFAULT_MEMORY_NAME = "main"

# Binary size suffixes accepted by MemoryConfig.parse ("256K", "64M", "1G", "512KiB", "2MB").
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNBOUNDED_WORDS = ("inf", "unbounded", "*")


# --------------------------------------------------------------------------------------------
# Records


@dataclasses.dataclass(frozen=True)
class TensorLifetime:
    """One intermediate tensor to place: its byte size and inclusive step range [first, last]."""

    name: str
    size: int
    first: int
    last: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 0:
            raise InvalidArgument(f"tensor {self.name!r}: size must be a non-negative int, got {self.size!r}")
        if self.first < 0 or self.last < self.first:
            raise InvalidArgument(
                f"tensor {self.name!r}: expected 0 <= first <= last, got first={self.first} last={self.last}"
            )

    def overlaps(self, other: TensorLifetime | Placement) -> bool:
        """True when both tensors are live at some common step (inclusive ranges)."""
        return self.first <= other.last and other.first <= self.last


@dataclasses.dataclass(frozen=True)
class Memory:
    """One memory of the hierarchy: ``size`` bytes (``None`` = unbounded) and an alignment."""

    name: str
    size: int | None = None
    alignment: int = DEFAULT_ALIGNMENT

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("memory: the name must not be empty")
        if self.size is not None and (not isinstance(self.size, int) or self.size < 0):
            raise InvalidArgument(f"memory {self.name!r}: size must be a non-negative int or None, got {self.size!r}")
        a = self.alignment
        if not isinstance(a, int) or a < 1 or a & (a - 1):
            raise InvalidArgument(f"memory {self.name!r}: alignment must be a power of two >= 1, got {a!r}")

    def describe(self) -> str:
        """``name(256 KiB, align 64)`` for error messages and tables."""
        cap = "unbounded" if self.size is None else _fmt_bytes(self.size)
        return f"{self.name}({cap}, align {self.alignment})"


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """The memory hierarchy, fastest first.  The default is one unbounded 64-byte-aligned memory."""

    memories: tuple[Memory, ...] = (Memory(DEFAULT_MEMORY_NAME),)

    def __post_init__(self) -> None:
        if not self.memories:
            raise InvalidArgument("memory config: at least one memory is needed")
        object.__setattr__(self, "memories", tuple(self.memories))
        names = [m.name for m in self.memories]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise InvalidArgument(f"memory config: duplicate memory names {dup}")

    @classmethod
    def default(cls) -> MemoryConfig:
        """One unbounded memory with :data:`DEFAULT_ALIGNMENT`."""
        return cls()

    @classmethod
    def parse(cls, text: str) -> MemoryConfig:
        """Parse the CLI form ``"[NAME=]SIZE[:ALIGN],..."``, fastest memory first.

        ``SIZE`` is bytes with an optional binary suffix (``256K``, ``64M``, ``1G``, ``2MiB``) or
        ``inf`` for unbounded; ``ALIGN`` defaults to :data:`DEFAULT_ALIGNMENT`.  Unnamed memories
        are called ``mem0``, ``mem1``, ...  Example: ``"256K:64,64M:16"``.

        Raises:
            ConfigError: naming the bad item and what was expected.
        """
        items = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in items):
            raise ConfigError(f"memory config {text!r}: expected '[NAME=]SIZE[:ALIGN],...' e.g. '256K:64,64M:16'")
        memories = []
        for i, item in enumerate(items):
            name = f"mem{i}"
            if "=" in item:
                name, _, item = (p.strip() for p in item.partition("="))
            size_text, _, align_text = item.partition(":")
            if size_text.strip().lower() in _UNBOUNDED_WORDS:
                size = None
            else:
                m = _SIZE_RE.match(size_text)
                if m is None:
                    raise ConfigError(
                        f"memory config item {i} {item!r}: expected a size like 256K, 64M, 1G or inf, got {size_text!r}"
                    )
                size = int(m.group(1)) * _SIZE_SUFFIXES[m.group(2).upper()]
            alignment = DEFAULT_ALIGNMENT
            if align_text.strip():
                try:
                    alignment = int(align_text.strip(), 10)
                except ValueError:
                    raise ConfigError(
                        f"memory config item {i} {item!r}: expected an integer alignment, got {align_text!r}"
                    ) from None
            try:
                memories.append(Memory(name, size, alignment))
            except InvalidArgument as e:
                raise ConfigError(f"memory config {text!r}: {e}") from e
        try:
            return cls(tuple(memories))
        except InvalidArgument as e:
            raise ConfigError(f"memory config {text!r}: {e}") from e

    def describe(self) -> str:
        return ", ".join(m.describe() for m in self.memories)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one tensor lives: ``size`` is the reserved (alignment-rounded) byte count."""

    name: str
    memory: str
    offset: int
    size: int
    first: int
    last: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A complete plan plus the numbers that judge it.

    Attributes:
        algorithm: the algorithm that produced the placements (the winner when ``auto`` ran).
        placements: one per planned tensor, in the order the algorithm placed them (the order
            matters for the hierarchy rule: a tensor only saw what was placed before it).
        arena_size_per_memory: bytes each memory's arena needs (highest placed end), every
            memory of the config listed, 0 when unused.
        lower_bound: max over steps of the live bytes (sizes as placed) — no plan can be smaller
            in total; ``lower_bound_step`` is the first step reaching it.
        peak_per_memory / peak_step_per_memory: the same maximum of live bytes, per memory: the
            lower bound of that memory's arena given which tensors went there.
        config: the memory hierarchy planned against.
        candidates: for ``auto``, algorithm -> total arena bytes of every algorithm that
            succeeded; empty when one algorithm was asked for.
    """

    algorithm: str
    placements: tuple[Placement, ...]
    arena_size_per_memory: dict[str, int]
    lower_bound: int
    lower_bound_step: int
    peak_per_memory: dict[str, int]
    peak_step_per_memory: dict[str, int]
    config: MemoryConfig
    candidates: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total_size(self) -> int:
        """Sum of the arena sizes over all memories."""
        return sum(self.arena_size_per_memory.values())

    def by_name(self) -> dict[str, Placement]:
        return {p.name: p for p in self.placements}

    def as_dict(self) -> dict:
        """A JSON-ready view (for ``session.get_memory_plan()`` and the CLI)."""
        return {
            "algorithm": self.algorithm,
            "total_size": self.total_size,
            "lower_bound": self.lower_bound,
            "lower_bound_step": self.lower_bound_step,
            "candidates": dict(self.candidates),
            "memories": [
                {
                    "name": m.name,
                    "capacity": m.size,
                    "alignment": m.alignment,
                    "arena_size": self.arena_size_per_memory[m.name],
                    "peak": self.peak_per_memory[m.name],
                    "peak_step": self.peak_step_per_memory[m.name],
                }
                for m in self.config.memories
            ],
            "tensors": [dataclasses.asdict(p) for p in self.placements],
        }


# --------------------------------------------------------------------------------------------
# Lower bound


def _align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _max_live(items: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
    """Max over steps of the summed sizes of (size, first, last) items, and the first such step."""
    delta: dict[int, int] = {}
    for size, first, last in items:
        if size:
            delta[first] = delta.get(first, 0) + size
            delta[last + 1] = delta.get(last + 1, 0) - size
    best, best_step, live = 0, 0, 0
    for step in sorted(delta):
        live += delta[step]
        if live > best:
            best, best_step = live, step
    return best, best_step


def lower_bound(lifetimes: Iterable[TensorLifetime], alignment: int = 1) -> tuple[int, int]:
    """Max over steps of the live bytes, and the first step where it is reached.

    Every tensor live at one step needs its own bytes, so no placement can use less than this.
    Sizes are rounded up to ``alignment`` first (pass the memory's alignment to compare with an
    arena of that memory).  With nothing to place the answer is ``(0, 0)``.
    """
    return _max_live((_align_up(t.size, alignment), t.first, t.last) for t in lifetimes)


# --------------------------------------------------------------------------------------------
# Algorithms


# A placed tensor inside one memory, kept sorted by offset: (offset, end, first, last).
_Slot = tuple[int, int, int, int]
# Offset finder: (slots of one memory sorted by offset, first, last, aligned size) -> offset.
_Finder = Callable[[list[_Slot], int, int, int], int]


def _best_fit(slots: list[_Slot], first: int, last: int, size: int) -> int:
    """Pisarchyk & Lee's offset rule: the smallest gap that fits, else after the highest end.

    Gaps are measured between the tensors whose lifetimes overlap ``[first, last]``, walking them
    by offset from 0 — so the leading gap below the lowest of them counts (the hole XNNPACK once
    missed).  All offsets and sizes are multiples of the memory's alignment, so gaps are too.
    """
    best_gap = None
    best_offset = None
    prev_end = 0
    for off, end, f, l in slots:
        if l < first or f > last:
            continue
        if off >= prev_end:
            gap = off - prev_end
            if gap >= size and (best_gap is None or gap < best_gap):
                best_gap, best_offset = gap, prev_end
        if end > prev_end:
            prev_end = end
    return prev_end if best_offset is None else best_offset


def _first_fit(slots: list[_Slot], first: int, last: int, size: int) -> int:
    """The lowest offset whose gap fits, among tensors overlapping ``[first, last]``."""
    prev_end = 0
    for off, end, f, l in slots:
        if l < first or f > last:
            continue
        if off - prev_end >= size:
            return prev_end
        if end > prev_end:
            prev_end = end
    return prev_end


def _check_lifetimes(lifetimes: Sequence[TensorLifetime]) -> None:
    seen: set[str] = set()
    for t in lifetimes:
        if t.name in seen:
            raise InvalidArgument(f"planner: tensor {t.name!r} appears twice in the lifetimes")
        seen.add(t.name)


def _place(
    algorithm: str,
    lifetimes: Sequence[TensorLifetime],
    config: MemoryConfig,
    order: Sequence[int],
    finder: _Finder | None,
) -> PlanResult:
    """Place tensors in ``order``; each goes to the first memory where ``finder``'s offset fits.

    ``finder=None`` is the bump allocator: the offset is the memory's current top.
    """
    _check_lifetimes(lifetimes)
    memories = config.memories
    slots: list[list[_Slot]] = [[] for _ in memories]
    tops = [0] * len(memories)
    placements: list[Placement] = []
    for i in order:
        t = lifetimes[i]
        if t.size == 0:
            # Zero bytes need no storage and conflict with nothing; offset 0 of the fastest memory.
            placements.append(Placement(t.name, memories[0].name, 0, 0, t.first, t.last))
            continue
        for k, mem in enumerate(memories):
            size = _align_up(t.size, mem.alignment)
            if finder is None:
                offset = tops[k]
            else:
                offset = finder(slots[k], t.first, t.last, size)
            if mem.size is not None and offset + size > mem.size:
                continue
            if finder is None:
                tops[k] = offset + size
            else:
                bisect.insort(slots[k], (offset, offset + size, t.first, t.last))
            placements.append(Placement(t.name, mem.name, offset, size, t.first, t.last))
            break
        else:
            raise PlannerMemoryError(
                f"planner ({algorithm}): tensor {t.name!r} of {t.size} bytes (live steps {t.first}..{t.last}) "
                f"fits in no memory: {config.describe()}; give a memory more room or add an unbounded one"
            )
    return _result(algorithm, placements, config)


def _result(
    algorithm: str, placements: Sequence[Placement], config: MemoryConfig, candidates: dict[str, int] | None = None
) -> PlanResult:
    arena = {m.name: 0 for m in config.memories}
    peak = {}
    peak_step = {}
    for p in placements:
        arena[p.memory] = max(arena[p.memory], p.end)
    for m in config.memories:
        peak[m.name], peak_step[m.name] = _max_live(
            (p.size, p.first, p.last) for p in placements if p.memory == m.name
        )
    lb, lb_step = _max_live((p.size, p.first, p.last) for p in placements)
    return PlanResult(
        algorithm=algorithm,
        placements=tuple(placements),
        arena_size_per_memory=arena,
        lower_bound=lb,
        lower_bound_step=lb_step,
        peak_per_memory=peak,
        peak_step_per_memory=peak_step,
        config=config,
        candidates=dict(candidates or {}),
    )


def naive(lifetimes: Sequence[TensorLifetime], config: MemoryConfig | None = None) -> PlanResult:
    """Bump allocator: tensors in order of first use, each with its own bytes; no reuse."""
    config = config or MemoryConfig()
    order = sorted(range(len(lifetimes)), key=lambda i: (lifetimes[i].first, i))
    return _place("naive", lifetimes, config, order, None)


def greedy_by_size(lifetimes: Sequence[TensorLifetime], config: MemoryConfig | None = None) -> PlanResult:
    """Greedy by size for offset calculation (Pisarchyk & Lee 2020): largest first, best fit.

    Large tensors are the hard ones to fit, so they go first, while the arena is empty; smaller
    ones then fill the smallest hole that holds them, which keeps large holes for later large
    needs.  Ties: earlier first use, then input order (deterministic).
    """
    config = config or MemoryConfig()
    order = sorted(range(len(lifetimes)), key=lambda i: (-lifetimes[i].size, lifetimes[i].first, i))
    return _place("greedy_by_size", lifetimes, config, order, _best_fit)


def position_greedy(lifetimes: Sequence[TensorLifetime], config: MemoryConfig | None = None) -> PlanResult:
    """Position-based greedy: tensors in order of first use (larger first on ties), first fit."""
    config = config or MemoryConfig()
    order = sorted(range(len(lifetimes)), key=lambda i: (lifetimes[i].first, -lifetimes[i].size, i))
    return _place("position_greedy", lifetimes, config, order, _first_fit)


# Algorithm name -> function; also the order ``auto`` prefers on ties (best expected first).
ALGORITHMS: dict[str, Callable[[Sequence[TensorLifetime], MemoryConfig | None], PlanResult]] = {
    "greedy_by_size": greedy_by_size,
    "position_greedy": position_greedy,
    "naive": naive,
}


def plan(
    lifetimes: Sequence[TensorLifetime], config: MemoryConfig | None = None, algorithm: str = "auto"
) -> PlanResult:
    """Plan with one algorithm, or with ``"auto"``: run all and keep the smallest total arena.

    ``auto`` records every successful algorithm's total in ``PlanResult.candidates``; ties go to
    the earlier entry of :data:`ALGORITHMS`.  An algorithm that runs out of memory is skipped;
    only when all do is the first error raised.

    Raises:
        InvalidArgument: unknown algorithm name.
        PlannerMemoryError: a tensor fits in no memory.
    """
    config = config or MemoryConfig()
    lifetimes = list(lifetimes)
    if algorithm != "auto":
        fn = ALGORITHMS.get(algorithm)
        if fn is None:
            raise InvalidArgument(
                f"planner: unknown algorithm {algorithm!r}; expected one of {', '.join([*ALGORITHMS, 'auto'])}"
            )
        return fn(lifetimes, config)
    best: PlanResult | None = None
    first_error: PlannerMemoryError | None = None
    candidates: dict[str, int] = {}
    for name, fn in ALGORITHMS.items():
        try:
            r = fn(lifetimes, config)
        except PlannerMemoryError as e:
            first_error = first_error or e
            logger.debug("planner auto: %s failed: %s", name, e)
            continue
        candidates[name] = r.total_size
        if best is None or r.total_size < best.total_size:
            best = r
    if best is None:
        assert first_error is not None, "Bug: no algorithm ran"
        raise first_error
    logger.debug("planner auto: %s won (%s)", best.algorithm, candidates)
    return dataclasses.replace(best, candidates=candidates)


# --------------------------------------------------------------------------------------------
# Validation


def validate(result: PlanResult, lifetimes: Sequence[TensorLifetime], config: MemoryConfig | None = None) -> None:
    """Check a plan against its lifetimes and config; raise on the first violation.

    Checks: every lifetime placed exactly once with its own steps; the memory exists; offsets
    are multiples of the memory's alignment and sizes cover the tensor rounded up to it; every
    placement stays inside the memory's capacity and the reported arena size; and no two
    tensors with overlapping lifetimes share a byte of the same memory.

    Raises:
        InvalidArgument: naming the tensor(s), memory and offsets at fault.
    """
    config = config or result.config
    mems = {m.name: m for m in config.memories}
    want = {t.name: t for t in lifetimes}
    got: dict[str, Placement] = {}
    for p in result.placements:
        if p.name in got:
            raise InvalidArgument(f"plan: tensor {p.name!r} placed twice")
        got[p.name] = p
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise InvalidArgument(f"plan: tensors missing from the plan {missing[:10]}, unexpected {extra[:10]}")
    for p in result.placements:
        t = want[p.name]
        mem = mems.get(p.memory)
        if mem is None:
            raise InvalidArgument(f"plan: tensor {p.name!r} placed in unknown memory {p.memory!r}")
        if (p.first, p.last) != (t.first, t.last):
            raise InvalidArgument(
                f"plan: tensor {p.name!r} planned for steps {p.first}..{p.last}, lives {t.first}..{t.last}"
            )
        if p.offset < 0 or p.offset % mem.alignment:
            raise InvalidArgument(
                f"plan: tensor {p.name!r} offset {p.offset} in {mem.name!r} is not a multiple of {mem.alignment}"
            )
        if p.size < _align_up(t.size, mem.alignment):
            raise InvalidArgument(f"plan: tensor {p.name!r} reserves {p.size} bytes, needs {t.size}")
        if mem.size is not None and p.end > mem.size:
            raise InvalidArgument(
                f"plan: tensor {p.name!r} ends at {p.end}, beyond memory {mem.name!r} of {mem.size} bytes"
            )
        if p.end > result.arena_size_per_memory.get(mem.name, 0):
            raise InvalidArgument(
                f"plan: tensor {p.name!r} ends at {p.end}, beyond the arena of {mem.name!r} "
                f"({result.arena_size_per_memory.get(mem.name, 0)} bytes)"
            )
    for mem in config.memories:
        placed = sorted((p for p in result.placements if p.memory == mem.name and p.size), key=lambda p: p.offset)
        # Only tensors that overlap in space can conflict; walk each one's spatial neighbours.
        for i, a in enumerate(placed):
            for b in placed[i + 1 :]:
                if b.offset >= a.end:
                    break
                if a.first <= b.last and b.first <= a.last:
                    raise InvalidArgument(
                        f"plan: tensors {a.name!r} [{a.offset}, {a.end}) steps {a.first}..{a.last} and "
                        f"{b.name!r} [{b.offset}, {b.end}) steps {b.first}..{b.last} overlap in memory {mem.name!r}"
                    )


# --------------------------------------------------------------------------------------------
# Lifetimes from a plan


def compute_lifetimes(
    steps: Sequence[tuple[Sequence[str], Sequence[str]]],
    sizes: Mapping[str, int],
    *,
    graph_inputs: Iterable[str] = (),
    graph_outputs: Iterable[str] = (),
    aliases: Mapping[str, str] | None = None,
) -> list[TensorLifetime]:
    """Lifetimes of the tensors to plan, from a plan's steps in execution order.

    Args:
        steps: per step, ``(input names, output names)``; ``""`` (an omitted optional input) is
            skipped.  A node owning subgraphs must list the outer-scope values they read among
            its inputs so those stay live through it.
        sizes: bytes of each intermediate.  Names missing here (weights, values of unknown size,
            sequences) are not planned.
        graph_inputs, graph_outputs: never planned: inputs belong to the caller, and outputs are
            handed to the user, who must never get a view of an arena reused by the next run.
        aliases: output name -> the input name it is a view of (Reshape, Squeeze, Unsqueeze,
            Flatten, Identity).  An alias gets no storage; its uses extend its base's lifetime,
            transitively along alias chains.

    Rules: a planned tensor lives from the step that produces it to the last step that reads it
    or any alias of it (a tensor nobody reads lives one step).  A base that is viewed by a graph
    output, directly or through a chain, is excluded from the plan — otherwise the user's output
    would alias the arena.

    Returns:
        Lifetimes in order of first step (production order).

    Raises:
        InvalidGraph: a name produced twice, a planned name read before it is produced, or an
            alias cycle.
    """
    aliases = dict(aliases or {})
    graph_inputs = set(graph_inputs)
    graph_outputs = set(graph_outputs)

    def root(name: str) -> str:
        seen = [name]
        while name in aliases:
            name = aliases[name]
            if name in seen:
                raise InvalidGraph(f"lifetimes: alias cycle {' -> '.join([*seen, name])}")
            seen.append(name)
        return name

    excluded = {root(o) for o in graph_outputs if o in aliases}
    producer: dict[str, int] = {}
    for step, (_, outputs) in enumerate(steps):
        for name in outputs:
            if not name:
                continue
            if name in producer:
                raise InvalidGraph(
                    f"lifetimes: {name!r} is produced twice (steps {producer[name]} and {step})"
                )
            producer[name] = step
    first: dict[str, int] = {}
    last: dict[str, int] = {}

    def use(name: str, step: int) -> None:
        base = root(name)
        if producer.get(base, -1) >= step:
            raise InvalidGraph(f"lifetimes: {base!r} is read at step {step} but produced at step {producer[base]}")
        if base in first:
            last[base] = max(last[base], step)

    for step, (inputs, outputs) in enumerate(steps):
        for name in inputs:
            if name:
                use(name, step)
        for name in outputs:
            if not name:
                continue
            if name in aliases:
                use(aliases[name], step)  # the view is made here: its base must still exist
                continue
            if name in graph_inputs or name in graph_outputs or name in excluded or name not in sizes:
                continue
            size = sizes[name]
            if not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"lifetimes: size of {name!r} must be a non-negative int, got {size!r}")
            first[name] = last[name] = step
    return [TensorLifetime(n, int(sizes[n]), first[n], last[n]) for n in first]


# --------------------------------------------------------------------------------------------
# Report and picture


def _fmt_bytes(n: int) -> str:
    return format_bytes(n, digits=2)


def _ratio(num: int, den: int) -> str:
    return f"{num / den:.3f}" if den else "-"


def format_table(result: PlanResult) -> str:
    """Per memory: capacity, tensors, arena size, peak live bytes (its lower bound), ratio.

    The ``total`` row compares the summed arenas with the global lower bound; a ratio of 1.000
    means the plan is optimal.
    """
    header = ("memory", "capacity", "align", "tensors", "arena", "peak live (step)", "arena/peak")
    rows = [header]
    counts: dict[str, int] = {}
    for p in result.placements:
        counts[p.memory] = counts.get(p.memory, 0) + 1
    for m in result.config.memories:
        arena = result.arena_size_per_memory[m.name]
        peak = result.peak_per_memory[m.name]
        rows.append((
            m.name,
            "unbounded" if m.size is None else _fmt_bytes(m.size),
            str(m.alignment),
            str(counts.get(m.name, 0)),
            _fmt_bytes(arena),
            f"{_fmt_bytes(peak)} (@{result.peak_step_per_memory[m.name]})",
            _ratio(arena, peak),
        ))
    rows.append((
        "total",
        "",
        "",
        str(len(result.placements)),
        _fmt_bytes(result.total_size),
        f"{_fmt_bytes(result.lower_bound)} (@{result.lower_bound_step})",
        _ratio(result.total_size, result.lower_bound),
    ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = [f"algorithm: {result.algorithm}"]
    if result.candidates:
        lines.append("auto tried: " + ", ".join(f"{k}={_fmt_bytes(v)}" for k, v in result.candidates.items()))
    for j, r in enumerate(rows):
        cells = (cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths)))
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(result: PlanResult, path: str | os.PathLike[str]) -> None:
    """Draw each used memory as tensors-as-boxes over steps (x) × offsets (y) into ``path``.

    The format follows the file suffix (``.png``, ``.svg``, ``.pdf``).  The file is written to a
    temporary name in the target folder, fsynced, then renamed.  Needs matplotlib (the ``plot``
    extra); no global pyplot state is touched.

    Raises:
        InvalidArgument: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise InvalidArgument(
            "plot: matplotlib is not installed; install the extra with `pip install 'onnxpack[plot]'`"
        ) from e
    path = os.fspath(path)
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    used = [m for m in result.config.memories if any(p.memory == m.name for p in result.placements)]
    used = used or [result.config.memories[0]]
    fig = Figure(figsize=(10, 3.2 * len(used)), constrained_layout=True)
    axes = fig.subplots(len(used), 1, squeeze=False)[:, 0]
    label_boxes = len(result.placements) <= 60
    for ax, m in zip(axes, used):
        placed = [p for p in result.placements if p.memory == m.name and p.size]
        arena = result.arena_size_per_memory[m.name]
        last_step = max((p.last for p in placed), default=0)
        for n, p in enumerate(placed):
            ax.add_patch(Rectangle(
                (p.first, p.offset), p.last - p.first + 1, p.size,
                facecolor=f"C{n % 10}", edgecolor="black", linewidth=0.4, alpha=0.8,
            ))
            if label_boxes:
                ax.text(p.first + (p.last - p.first + 1) / 2, p.offset + p.size / 2, p.name,
                        ha="center", va="center", fontsize=6, clip_on=True)
        peak = result.peak_per_memory[m.name]
        ax.axhline(peak, color="red", linestyle="--", linewidth=0.8, label=f"peak live {_fmt_bytes(peak)}")
        ax.set_xlim(0, last_step + 1)
        ax.set_ylim(0, max(arena, peak, 1) * 1.05)
        ax.set_xlabel("step")
        ax.set_ylabel("offset (bytes)")
        ax.set_title(f"{m.name}: arena {_fmt_bytes(arena)} ({result.algorithm})")
        ax.legend(loc="upper right", fontsize=7)
    atomic_write(path, lambda f: fig.savefig(f, format=fmt))
