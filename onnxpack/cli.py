"""Command line: ``onnxpack optimize | run | inspect | plan | bench | demo``.

Each subcommand is one entry of :data:`SUBCOMMANDS`: name -> (help, add_arguments, handler).
``add_arguments(parser)`` declares its flags; ``handler(args) -> int`` does the work and returns
the exit code.  Errors from :mod:`onnxpack.errors` become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable

from onnxpack.errors import OnnxpackError

__all__ = ["main", "SUBCOMMANDS", "optimize_model"]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # bad arguments or bad model: argparse uses 2 for usage errors too


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = int_at_least(0)


# -- optimize ---------------------------------------------------------------------------------
# Show a progress bar when the model holds at least this many bytes of initializers (or with
# --progress): below it, optimizing takes well under a second and a bar would only flicker.
PROGRESS_MIN_BYTES = 32 << 20


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
    p.add_argument("--no-prepack", action="store_true",
                   help="only externalize and align the weights; do not save pre-packed blobs")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                     help="always show the progress bar (default: on stderr for models of "
                          f"{PROGRESS_MIN_BYTES >> 20} MiB or more)")
    bar.add_argument("--no-progress", dest="progress", action="store_const", const=False)


class _Progress:
    """One self-overwriting stderr line: ``packing [#####.....] 12/30 weights 45.2 MB``.

    Not tqdm: the bar needs one counter and one line, and a dependency for that would be one
    more package in every serving image that installs onnxpack.  Redrawn at most 10x a second;
    on a non-terminal stderr (CI logs) it prints a line per 10% instead of carriage returns.
    """

    def __init__(self, total: int, sizes: dict[str, int], stream=None) -> None:
        self.total = max(total, 1)
        self.sizes = sizes
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done: set[str] = set()
        self.bytes = 0
        self._last = 0.0
        self._last_decile = -1

    def __call__(self, name: str) -> None:
        if name not in self.done:
            self.done.add(name)
            self.bytes += self.sizes.get(name, 0)
        self.draw()

    def draw(self, final: bool = False) -> None:
        frac = min(self.bytes / self.total, 1.0) if not final else 1.0
        now = time.perf_counter()
        decile = int(frac * 10)
        if self.tty:
            if not final and now - self._last < 0.1:
                return
        elif not final and decile == self._last_decile:
            return
        self._last, self._last_decile = now, decile
        filled = int(frac * 30)
        text = (f"packing [{'#' * filled}{'.' * (30 - filled)}] {frac:4.0%}  "
                f"{len(self.done)} weights, {self.bytes / 1e6:.1f} MB")
        self.stream.write(("\r" + text) if self.tty else text + "\n")
        if final and self.tty:
            self.stream.write("\n")
        self.stream.flush()


def _size(n: float) -> str:
    for unit, step in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= step:
            return f"{n / step:.1f} {unit}"
    return f"{int(n)} B"


def optimize_model(input_path: str, output_path: str, *, prepack: bool = True,
                   location: str | None = None, min_size: int = 1024,
                   align_threshold: int | None = None, allocation_granularity: int | None = None,
                   progress: bool | None = None, out=None) -> dict:
    """Optimize ``input_path`` into ``output_path`` and print the closing table.

    With ``prepack`` (the default) this is exactly a session created with
    ``optimized_model_filepath`` and ``session.save_external_prepacked_constant_initializers=1``:
    every weight a kernel pre-packs gets its blobs written right after it, so the next session
    maps them instead of packing.  Returns the table's figures as a dict.
    """
    import mmap

    import onnx

    from onnxpack.graph import DEFAULT_ALIGN_THRESHOLD, load_model, save_model
    from onnxpack.prepack import entry_format as fmt

    out = out if out is not None else sys.stdout
    align_threshold = DEFAULT_ALIGN_THRESHOLD if align_threshold is None else align_threshold
    granularity = mmap.ALLOCATIONGRANULARITY if allocation_granularity is None else allocation_granularity
    t0 = time.perf_counter()
    packed = 0
    seconds_packing = 0.0
    if prepack:
        from onnxpack.session import InferenceSession, SessionOptions
        from onnxpack.session._sources import report_progress

        opts = SessionOptions()
        opts.optimized_model_filepath = output_path
        for key, value in (
            ("session.save_external_prepacked_constant_initializers", "1"),
            ("session.optimized_model_external_initializers_min_size_in_bytes", str(min_size)),
            ("onnxpack.align_threshold", str(align_threshold)),
            ("onnxpack.allocation_granularity", str(granularity)),
        ):
            opts.add_session_config_entry(key, value)
        if location:
            opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", location)
        with load_model(input_path) as probe:
            sizes = {name: t.nbytes for s in probe.scopes() for name, t in s.initializers.items()}
        total = sum(sizes.values())
        show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
        bar = _Progress(total, sizes) if show else None
        with report_progress(bar if bar is not None else (lambda name: None)):
            session = InferenceSession(input_path, opts)
        if bar is not None:
            bar.draw(final=True)
        stats = session.get_prepack_stats()
        packed = stats["weights_packed"] + stats["blobs_from_model"] + stats["blobs_from_cache"]
        seconds_packing = stats["seconds_packing"]
        session.close()
    else:
        with load_model(input_path) as model:
            save_model(model, output_path, location=location, min_size=min_size,
                       align_threshold=align_threshold, allocation_granularity=granularity)
    elapsed = time.perf_counter() - t0

    # The closing table reads what is on disk, not what we meant to write.
    proto = onnx.load(output_path, load_external_data=False)
    folder = os.path.dirname(os.path.abspath(output_path))
    n_ext = weight_bytes = 0
    files: set[str] = set()
    for t in _all_initializers(proto.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            n_ext += 1
            weight_bytes += int(info.get("length", 0))
            files.add(info["location"])
    records = 0
    blobs: dict[tuple[str, int], int] = {}
    for p in proto.metadata_props:
        if fmt.is_record_key(p.key):
            rec = fmt.parse_record(p.key, p.value)
            records += 1
            for pack in rec.packs:
                for b in pack.buffers:
                    blobs[(b.location, b.offset)] = b.length
                    files.add(b.location)
    file_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    figures = {
        "model": output_path, "data_files": sorted(files), "weights": n_ext,
        "weights_packed": records, "kernel_inputs_packed": packed, "blobs": len(blobs),
        "weight_bytes": weight_bytes, "blob_bytes": sum(blobs.values()), "file_bytes": file_bytes,
        "seconds": elapsed, "seconds_packing": seconds_packing,
    }
    rows = [
        ("wrote", output_path + (f" + {', '.join(sorted(files))}" if files else "")),
        ("external weights", f"{n_ext} ({_size(weight_bytes)})"),
        ("pre-packed weights", f"{records}" if prepack else "off (--no-prepack)"),
        ("blobs written", f"{len(blobs)} ({_size(sum(blobs.values()))})"),
        ("data file bytes", _size(file_bytes)),
        ("time", f"{elapsed:.2f} s" + (f" (packing {seconds_packing:.2f} s)" if prepack else "")),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"  {k.ljust(width)}  {v}\n")
    out.flush()
    return figures


def _all_initializers(graph):
    from onnx import AttributeProto

    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from _all_initializers(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _all_initializers(g)


def _optimize(args: argparse.Namespace) -> int:
    print(f"optimizing {args.input} -> {args.output}" + (" (no pre-packing)" if args.no_prepack else ""))
    optimize_model(args.input, args.output, prepack=not args.no_prepack, location=args.location,
                   min_size=args.min_size, align_threshold=args.align_threshold,
                   allocation_granularity=args.allocation_granularity, progress=args.progress)
    return EXIT_OK


# -- the subcommand table -----------------------------------------------------------------------
AddArguments = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace], int]

SUBCOMMANDS: dict[str, tuple[str, AddArguments, Handler]] = {
    "optimize": ("pre-pack the weights and save the blobs next to them (aligned, standard ONNX)",
                 _optimize_args, _optimize),
    # >>> other subcommands register here (one line each), e.g.
    # "run": ("run a model on inputs", _run_args, _run),            # owner: session layer
    # "inspect": ("print scopes, tensors and prepack stats", ...),  # owner: prepack/session
    # "plan": ("print the execution and memory plan", ...),         # owner: planner
    # "bench": ("benchmark load/run", ...),                         # owner: benchmarks
    # "demo": ("optimize with pre-packing and compare starts", ...),  # owner: serialization
    "inspect": ("print scopes, initializers, packed weights, fallback nodes and prepack stats", *(lambda m: (m.add_arguments, m.handler))(__import__("onnxpack._cli_inspect", fromlist=["handler"]))),
    "cache": ("inspect (info) or compact a packed-weight cache file", *(lambda m: (m.add_arguments, m.handle))(__import__("onnxpack._cli_cache", fromlist=["handle"]))),
    "demo": ("generate a model, optimize it, compare cold (packing) and warm (mapped) starts", *(lambda m: (m.demo_args, m.demo))(__import__("onnxpack._cli_demo", fromlist=["demo"]))),
    "bench": ("cold vs warm session starts of a model in fresh processes (time, memory)", *(lambda m: (m.bench_args, m.bench))(__import__("onnxpack._cli_demo", fromlist=["bench"]))),
    "plan": ("print the activation memory plan: per-memory arena, peak, lower bound; --plot draws it", *(lambda m: (m.add_arguments, m.handler))(__import__("onnxpack._cli_plan", fromlist=["handler"]))),
    "run": ("run a model on .npy or random inputs; print outputs and timings", *(lambda m: (m.add_arguments, m.handler))(__import__("onnxpack._cli_run", fromlist=["handler"]))),
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
