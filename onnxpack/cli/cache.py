"""``onnxpack cache info PATH`` and ``onnxpack cache compact PATH``: look after a cache file.

A packed-weight cache file (``onnxpack.prepacked_cache_path``) is only ever appended to, so it
collects garbage: the index of every earlier commit, padding, and the regions of appends that a
crash cut short.  ``info`` shows how much (``wasted``), ``compact`` rewrites the file with only
the live entries — to a temp file in the same folder, fsynced, then renamed over PATH, so a crash
leaves the old file or the new one and processes that have the old file mapped keep using it.

Both refuse a missing path (a typo would otherwise look like an empty cache) and report a
corrupt, foreign or newer-version file as one line (exit code 2); neither ever writes to such a
file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from onnxpack.cli._common import format_bytes
from onnxpack.errors import InvalidArgument
from onnxpack.prepack import cache_file

__all__ = ["HELP", "add_arguments", "run"]

logger = logging.getLogger(__name__)

HELP = "inspect (info) or compact a packed-weight cache file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="cache_action", metavar="ACTION")
    actions.required = True
    info = actions.add_parser("info", help="list entries, sizes and the wasted bytes",
                              description="List a cache file's entries, sizes and wasted bytes.")
    info.add_argument("path", help="the cache file (onnxpack.prepacked_cache_path)")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    compact = actions.add_parser("compact", help="rewrite the file atomically with only its live entries",
                                 description="Rewrite a cache file atomically with only its live entries.")
    compact.add_argument("path", help="the cache file (onnxpack.prepacked_cache_path)")


def _existing_file(path: str) -> str:
    if not os.path.exists(path):
        raise InvalidArgument(f"cache file {path!r}: expected an existing file, got no such file")
    if not os.path.isfile(path):
        raise InvalidArgument(f"cache file {path!r}: expected a regular file, got a folder or device")
    return path


def _info(args: argparse.Namespace) -> int:
    info = cache_file.info(_existing_file(args.path))
    if args.json:
        print(json.dumps({
            "path": info.path, "file_size": info.file_size, "version": info.version,
            "sequence": info.sequence, "live_bytes": info.live_bytes, "index_bytes": info.index_bytes,
            "wasted_bytes": info.wasted_bytes,
            "entries": [{"key": e.key, "nbytes": e.nbytes,
                         "buffers": [{"offset": b.offset, "length": b.length, "dtype": b.dtype,
                                      "shape": list(b.shape)} for b in e.buffers]}
                        for e in info.entries],
        }))
        return 0
    share = 100.0 * info.wasted_bytes / info.file_size if info.file_size else 0.0
    print(f"{info.path}: {len(info.entries)} entries, file {format_bytes(info.file_size)} "
          f"({info.file_size} bytes), format v{info.version}, commit {info.sequence}")
    print(f"  live {info.live_bytes} bytes, index {info.index_bytes} bytes, "
          f"wasted {info.wasted_bytes} bytes ({share:.1f}%)")
    if info.entries:
        width = max(len(e.key) for e in info.entries)
        print(f"  {'key':<{width}}  {'bytes':>12}  buffers")
        for e in sorted(info.entries, key=lambda e: e.buffers[0].offset):
            bufs = ", ".join(f"{b.dtype}{list(b.shape)}@{b.offset}" for b in e.buffers)
            print(f"  {e.key:<{width}}  {e.nbytes:>12}  {bufs}")
    return 0


def _compact(args: argparse.Namespace) -> int:
    result = cache_file.compact(_existing_file(args.path))
    saved = result.bytes_before - result.bytes_after
    print(f"{args.path}: {result.entries} entries kept, {result.bytes_before} -> {result.bytes_after} bytes "
          f"({saved} bytes freed)")
    for key in result.dropped:
        print(f"  dropped {key}: its bytes fail their CRC-32")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"info": _info, "compact": _compact}[args.cache_action](args)
