"""``onnxpack plan MODEL``: the activation memory plan of a model, as tables and a picture.

The model runs once (unplanned) on generated inputs of the given shapes — zeros for integer and
bool inputs, so token ids and indices stay valid, standard normal values for floats — to learn
every intermediate's size; then each placement algorithm plans those tensors against the memory
hierarchy and the tables compare the arenas with the lower bound (max live bytes).
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from onnxpack.cli._common import random_inputs
from onnxpack.errors import InvalidArgument
from onnxpack.session import planner

__all__ = ["HELP", "add_arguments", "run"]

HELP = "print the activation memory plan: per-memory arena, peak, lower bound; --plot draws it"

logger = logging.getLogger(__name__)

_ALGORITHM_CHOICES = (*planner.ALGORITHMS, "auto")


def _shape_arg(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=D1,D2,... (e.g. input=1,3,224,224), got {text!r}")
    try:
        shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integer dimensions in {text!r}") from None
    if any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"dimensions must be >= 0 in {text!r}")
    return name, shape


def _memory_arg(text: str) -> planner.MemoryConfig:
    try:
        return planner.MemoryConfig.parse(text)
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--shape", action="append", type=_shape_arg, default=[], metavar="NAME=D1,D2,...",
                   help="shape of an input (needed for symbolic dimensions); repeatable")
    p.add_argument("--memory", type=_memory_arg, default=None, metavar="SIZE[:ALIGN],...",
                   help="memory hierarchy, fastest first, e.g. 256K:64,64M:16 (default: one unbounded, align 64)")
    p.add_argument("--algorithm", choices=_ALGORITHM_CHOICES, default="auto",
                   help="placement algorithm (auto: try all, keep the smallest)")
    p.add_argument("--runtime", action="store_true",
                   help="plan only the tensors the session's run-time arena holds (run_into kernels)")
    p.add_argument("--plot", metavar="FILE", help="draw the plan (png/svg/pdf; needs matplotlib)")


def _feeds(session, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Standard normal floats, zeros for integers and bools (valid ids and indices)."""
    declared = session.get_inputs()
    names = {a.name for a in declared} | {a.name for a in session.get_overridable_initializers()}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise InvalidArgument(f"--shape: unknown input(s) {unknown}; inputs are {[a.name for a in declared]}")
    for arg in declared:
        if not arg.type.startswith("tensor("):
            raise InvalidArgument(f"input {arg.name!r}: only tensor inputs can be generated")
        if arg.name not in shapes and not all(isinstance(d, int) for d in arg.shape):
            raise InvalidArgument(
                f"input {arg.name!r} has symbolic dimensions {[d if isinstance(d, str) else '?' for d in arg.shape]}; "
                f"give them with --shape {arg.name}=" + ",".join(str(d) if isinstance(d, int) else "1" for d in arg.shape)
            )
    return random_inputs(declared, shapes=shapes, int_high=1)


def run(args: argparse.Namespace) -> int:
    from onnxpack.session import InferenceSession, analyze, validate_feed

    config = args.memory or planner.MemoryConfig.default()
    with InferenceSession(args.model) as session:
        feeds = _feeds(session, dict(args.shape))
        program = session.program
        valid = validate_feed(session.model, feeds, program.overridable, program.defaults)
        lifetimes, result, _ = analyze(
            program.root, [valid[n] for n in program.root.input_names], algorithm=args.algorithm, config=config,
            runtime_only=args.runtime,
        )
    what = "run-time arena tensors" if args.runtime else "intermediate tensors"
    total = sum(t.size for t in lifetimes)
    print(f"model: {args.model}")
    print("inputs: " + ", ".join(f"{n}{list(v.shape)}" for n, v in feeds.items()))
    print(f"{len(lifetimes)} {what}, {planner._fmt_bytes(total)} if each had its own bytes")
    print(f"memories: {config.describe()}")
    print()
    rows = [("algorithm", "arena", "lower bound", "arena/bound")]
    for name in planner.ALGORITHMS:
        try:
            r = planner.plan(lifetimes, config, name)
            rows.append((name, planner._fmt_bytes(r.total_size), planner._fmt_bytes(r.lower_bound),
                         planner._ratio(r.total_size, r.lower_bound)))
        except MemoryError as e:
            rows.append((name, "does not fit", "", str(e).split(":")[0]))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for j, r in enumerate(rows):
        print("  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print()
    print(planner.format_table(result))
    if args.plot:
        planner.plot(result, args.plot)
        print(f"\nplot written to {args.plot}")
    return 0
