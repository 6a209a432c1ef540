"""Command line: ``onnxpack optimize | run | inspect | plan | bench | demo | cache | generate``.

One module per subcommand, each with ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``;
:data:`COMMANDS` lists them.  Errors from :mod:`onnxpack.errors` (and OS errors) become one line on
stderr and exit code 2; ``main`` never prints a traceback for bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType

from onnxpack.cli import bench, cache, demo, generate, inspect, optimize, plan, run
from onnxpack.cli._common import EXIT_BAD_INPUT, EXIT_OK, int_at_least
from onnxpack.cli.optimize import optimize_model
from onnxpack.errors import OnnxpackError

__all__ = ["main", "COMMANDS", "optimize_model", "int_at_least", "EXIT_OK", "EXIT_BAD_INPUT"]

COMMANDS: dict[str, ModuleType] = {
    "optimize": optimize,
    "inspect": inspect,
    "cache": cache,
    "demo": demo,
    "bench": bench,
    "plan": plan,
    "run": run,
    "generate": generate,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxpack", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
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
        return args._run(args)
    except (OnnxpackError, OSError) as e:
        print(f"onnxpack {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
