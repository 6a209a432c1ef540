"""``onnxpack optimize IN -o OUT``: pre-pack the weights and save the blobs next to them.

Load + compile + save (:func:`onnxpack.session.optimize`): one parse of the model, no runnable
session, and the closing table from what the save returned and the program's pack log.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

from onnxpack.cli._common import EXIT_OK, Progress, format_bytes, int_at_least
from onnxpack.errors import InvalidArgument
from onnxpack.graph import DEFAULT_ALIGN_THRESHOLD

__all__ = ["HELP", "add_arguments", "run", "optimize_model", "PROGRESS_MIN_BYTES"]

HELP = "pre-pack the weights and save the blobs next to them (aligned, standard ONNX)"

# Show a progress bar when the model holds at least this many bytes of initializers (or with
# --progress): below it, optimizing takes well under a second and a bar would only flicker.
PROGRESS_MIN_BYTES = 32 << 20

_non_negative = int_at_least(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="model to optimize (never modified)")
    p.add_argument("-o", "--output", required=True, help="output model path")
    p.add_argument("--location", default=None,
                   help="external data file name (default: <output name>.data)")
    p.add_argument("--min-size", type=_non_negative, default=1024,
                   help="initializers of at least this many bytes go to the data file (default 1024)")
    p.add_argument("--align-threshold", type=_non_negative, default=DEFAULT_ALIGN_THRESHOLD,
                   help=f"tensors of at least this many bytes start on an allocation-granularity "
                        f"boundary (default {DEFAULT_ALIGN_THRESHOLD})")
    p.add_argument("--allocation-granularity", type=_non_negative,
                   default=mmap.ALLOCATIONGRANULARITY,
                   help=f"page alignment for large tensors (default {mmap.ALLOCATIONGRANULARITY})")
    p.add_argument("--no-prepack", action="store_true",
                   help="only externalize and align the weights; do not save pre-packed blobs")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                     help="always show the progress bar (default: on stderr for models of "
                          f"{PROGRESS_MIN_BYTES >> 20} MiB or more)")
    bar.add_argument("--no-progress", dest="progress", action="store_const", const=False)


def optimize_model(input_path: str, output_path: str, *, prepack: bool = True,
                   location: str | None = None, min_size: int = 1024,
                   align_threshold: int | None = None, allocation_granularity: int | None = None,
                   progress: bool | None = None, out=None) -> dict:
    """Optimize ``input_path`` into ``output_path`` and print the closing table.

    With ``prepack`` (the default) every weight a kernel pre-packs gets its blobs written right
    after it, so the next session maps them instead of packing.  Returns the table's figures.
    """
    from onnxpack.session import PrepackStats, optimize

    out = out if out is not None else sys.stdout
    config = {
        "session.save_external_prepacked_constant_initializers": "1" if prepack else "0",
        "session.disable_prepacking": "0" if prepack else "1",
        "session.optimized_model_external_initializers_min_size_in_bytes": str(min_size),
        "onnxpack.align_threshold": str(DEFAULT_ALIGN_THRESHOLD if align_threshold is None else align_threshold),
        "onnxpack.allocation_granularity": str(
            mmap.ALLOCATIONGRANULARITY if allocation_granularity is None else allocation_granularity),
    }
    if location:
        config["session.optimized_model_external_initializers_file_name"] = location
    t0 = time.perf_counter()
    bar = None
    if prepack and progress is not False:
        bar = Progress(min_bytes=0 if progress else PROGRESS_MIN_BYTES)
    result, program = optimize(input_path, output_path, config, progress=bar)
    if bar is not None:
        bar.draw(final=True)
    elapsed = time.perf_counter() - t0
    stats = program.stats if program is not None else PrepackStats()
    blobs = {(b.offset, b.length) for placed in result.placements.values() for b in placed}
    files = [result.location] if result.data_path else []
    figures = {
        "model": output_path, "data_files": files, "weights": result.tensors_written,
        "weights_packed": len(result.placements),
        "kernel_inputs_packed": stats.weights_packed + stats.blobs_from_model + stats.blobs_from_cache,
        "blobs": len(blobs), "weight_bytes": result.tensor_bytes, "blob_bytes": sum(n for _o, n in blobs),
        "file_bytes": result.bytes_written, "seconds": elapsed, "seconds_packing": stats.seconds_packing,
    }
    rows = [
        ("wrote", output_path + (f" + {', '.join(files)}" if files else "")),
        ("external weights", f"{result.tensors_written} ({format_bytes(result.tensor_bytes, si=True)})"),
        ("pre-packed weights", f"{len(result.placements)}" if prepack else "off (--no-prepack)"),
        ("blobs written", f"{len(blobs)} ({format_bytes(figures['blob_bytes'], si=True)})"),
        ("data file bytes", format_bytes(result.bytes_written, si=True)),
        ("time", f"{elapsed:.2f} s" + (f" (packing {stats.seconds_packing:.2f} s)" if prepack else "")),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"  {k.ljust(width)}  {v}\n")
    out.flush()
    return figures


def run(args: argparse.Namespace) -> int:
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        if os.path.exists(folder):
            raise InvalidArgument(f"-o {args.output}: {folder} exists and is not a directory")
        os.makedirs(folder)
        print(f"created directory {os.path.dirname(args.output) or folder}")
    print(f"optimizing {args.input} -> {args.output}" + (" (no pre-packing)" if args.no_prepack else ""))
    optimize_model(args.input, args.output, prepack=not args.no_prepack, location=args.location,
                   min_size=args.min_size, align_threshold=args.align_threshold,
                   allocation_granularity=args.allocation_granularity, progress=args.progress)
    return EXIT_OK
