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
from onnx import helper

from onnxpack.errors import InvalidArgument
from onnxpack.session import planner

__all__ = ["add_arguments", "handler"]

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
    rng = np.random.default_rng(0)
    graph = session.model.proto.graph
    inits = set(session.model.root.initializers)
    declared = [vi for vi in graph.input if vi.name not in inits]
    unknown = sorted(set(shapes) - {vi.name for vi in graph.input})
    if unknown:
        raise InvalidArgument(f"--shape: unknown input(s) {unknown}; inputs are {[vi.name for vi in declared]}")
    feeds = {}
    for vi in declared:
        tt = vi.type.tensor_type
        if vi.type.WhichOneof("value") != "tensor_type":
            raise InvalidArgument(f"input {vi.name!r}: only tensor inputs can be generated")
        if vi.name in shapes:
            shape = shapes[vi.name]
        else:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if None in dims:
                raise InvalidArgument(
                    f"input {vi.name!r} has symbolic dimensions {[d.dim_param or '?' for d in tt.shape.dim]}; "
                    f"give them with --shape {vi.name}=" + ",".join("1" if d is None else str(d) for d in dims)
                )
            shape = tuple(dims)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if dtype.kind == "f":
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[vi.name] = np.zeros(shape, dtype=dtype)
    return feeds


def handler(args: argparse.Namespace) -> int:
    from onnxpack.session._arena import analyze
    from onnxpack.session._session import InferenceSession

    config = args.memory or planner.MemoryConfig.default()
    with InferenceSession(args.model) as session:
        feeds = _feeds(session, dict(args.shape))
        lifetimes, result, _ = analyze(
            session, feeds, algorithm=args.algorithm, config=config, runtime_only=args.runtime
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
