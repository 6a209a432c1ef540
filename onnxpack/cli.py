"""Command line: ``onnxpack optimize | run | inspect | plan | bench | demo``.

Each subcommand is one entry of :data:`SUBCOMMANDS`: name -> (help, add_arguments, handler).
``add_arguments(parser)`` declares its flags; ``handler(args) -> int`` does the work and returns
the exit code.  Errors from :mod:`onnxpack.errors` become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from onnxpack.errors import OnnxpackError

__all__ = ["main", "SUBCOMMANDS"]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # bad arguments or bad model: argparse uses 2 for usage errors too


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


# -- optimize ---------------------------------------------------------------------------------
def _optimize_args(p: argparse.ArgumentParser) -> None:
    from onnxpack.graph import DEFAULT_ALIGN_THRESHOLD
    import mmap

    p.add_argument("input", help="model to optimize (never modified)")
    p.add_argument("-o", "--output", required=True, help="output model path")
    p.add_argument("--location", default=None,
                   help="external data file name (default: <output name>.data)")
    p.add_argument("--min-size", type=_positive_int, default=1024,
                   help="initializers of at least this many bytes go to the data file (default 1024)")
    p.add_argument("--align-threshold", type=_positive_int, default=DEFAULT_ALIGN_THRESHOLD,
                   help=f"tensors of at least this many bytes start on an allocation-granularity "
                        f"boundary (default {DEFAULT_ALIGN_THRESHOLD})")
    p.add_argument("--allocation-granularity", type=_positive_int,
                   default=mmap.ALLOCATIONGRANULARITY,
                   help=f"page alignment for large tensors (default {mmap.ALLOCATIONGRANULARITY})")


def _optimize(args: argparse.Namespace) -> int:
    # Pre-packing arrives with the serialization issue; it will pass `extra=` here.
    from onnxpack.graph import load_model, save_model

    model = load_model(args.input)
    try:
        result = save_model(model, args.output, location=args.location, min_size=args.min_size,
                            align_threshold=args.align_threshold,
                            allocation_granularity=args.allocation_granularity)
    finally:
        model.close()
    data = f" + {result.data_path} ({result.bytes_written} bytes, {result.tensors_written} tensors)" \
        if result.data_path else " (all tensors in the model file)"
    print(f"wrote {result.model_path}{data}")
    return EXIT_OK


# -- the subcommand table -----------------------------------------------------------------------
AddArguments = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace], int]

SUBCOMMANDS: dict[str, tuple[str, AddArguments, Handler]] = {
    "optimize": ("externalize and align initializers; write a standard ONNX model",
                 _optimize_args, _optimize),
    # >>> other subcommands register here (one line each), e.g.
    # "run": ("run a model on inputs", _run_args, _run),            # owner: session layer
    # "inspect": ("print scopes, tensors and prepack stats", ...),  # owner: prepack/session
    # "plan": ("print the execution and memory plan", ...),         # owner: planner
    # "bench": ("benchmark load/run", ...),                         # owner: benchmarks
    # "demo": ("optimize with pre-packing and compare starts", ...),  # owner: serialization
    # <<< end of subcommand registrations
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxpack", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, add_arguments, handler) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(_handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 2 bad input or arguments)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and usage errors (2)
        return int(e.code) if isinstance(e.code, int) else EXIT_BAD_INPUT
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args._handler(args)
    except OnnxpackError as e:
        print(f"onnxpack {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"onnxpack {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
