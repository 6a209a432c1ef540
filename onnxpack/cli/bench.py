"""``onnxpack bench MODEL``: cold vs warm session starts of a user's model in fresh processes."""

from __future__ import annotations

import argparse
import os
import tempfile

from onnxpack.cli._measure import compare
from onnxpack.cli.optimize import optimize_model
from onnxpack.errors import InvalidArgument

__all__ = ["HELP", "add_arguments", "run"]

HELP = "cold vs warm session starts of a model in fresh processes (time, memory)"

DEFAULT_REPEATS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model (never modified)")
    p.add_argument("--sessions", type=int, default=1, help="sessions per process (default 1)")
    p.add_argument("--processes", type=int, default=1,
                   help="processes alive at once for the total-PSS column (default 1)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"fresh processes per row; the median is shown (default {DEFAULT_REPEATS})")


def run(args: argparse.Namespace) -> int:
    """Cold vs warm table for a user's model (optimized into a temp folder unless it has blobs)."""
    if args.sessions < 1 or args.processes < 1 or args.repeats < 1:
        raise InvalidArgument("bench: --sessions, --processes and --repeats must be >= 1")
    if not os.path.isfile(args.model):
        raise InvalidArgument(f"bench: model {args.model!r} does not exist")
    with tempfile.TemporaryDirectory(prefix="onnxpack-bench-") as tmp:
        for sub in ("cold", "warm"):
            os.makedirs(os.path.join(tmp, sub))
        optimized = os.path.join(tmp, "optimized.onnx")
        print(f"optimizing {args.model} into a temp folder (with pre-packed blobs):")
        optimize_model(args.model, optimized, progress=False)
        compare(args.model, optimized, tmp, repeats=args.repeats, sessions=args.sessions,
                 processes=args.processes)
    return 0
