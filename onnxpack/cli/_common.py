"""What several subcommands share: argument types, KEY=VALUE pairs, random feeds, the progress bar."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnxpack._units import format_bytes
from onnxpack.errors import InvalidArgument

__all__ = ["EXIT_OK", "EXIT_BAD_INPUT", "format_bytes", "int_at_least", "parse_pairs", "parse_config",
           "random_inputs", "Progress", "INT_HIGH"]

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # bad arguments or bad model: argparse uses 2 for usage errors too

# Integers are drawn from [0, INT_HIGH): small non-negative values are valid indices, counts and
# trip counts for most models, where arbitrary int64 would make Gather/Loop inputs nonsense.
INT_HIGH = 4


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


def parse_pairs(values: Sequence[str], flag: str) -> dict[str, str]:
    """``["a=1", "b=2"]`` -> ``{"a": "1", "b": "2"}``; a malformed or repeated name is an error."""
    out: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise InvalidArgument(f"{flag} {item!r}: expected NAME=VALUE")
        if name in out:
            raise InvalidArgument(f"{flag} {name!r} given twice")
        out[name] = value
    return out


def parse_config(values: Sequence[str]) -> dict[str, str]:
    """``--config KEY=VALUE`` entries (a later entry of the same key wins, as in a config file)."""
    config: dict[str, str] = {}
    for entry in values:
        key, sep, value = entry.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"--config: expected KEY=VALUE, got {entry!r}")
        config[key.strip()] = value.strip()
    return config


_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def random_inputs(nodeargs: Sequence[Any], dims: Mapping[str, int] | None = None, seed: int = 0, *,
                  shapes: Mapping[str, tuple[int, ...]] | None = None, int_high: int = INT_HIGH) -> dict[str, np.ndarray]:
    """Random arrays for ``nodeargs`` (``NodeArg``s): normal floats, ints in ``[0, int_high)``,
    random bools.

    ``shapes[name]`` gives an input's whole shape; otherwise symbolic dims take ``dims[name]``
    (default 1) and unknown dims 1.
    """
    rng = np.random.default_rng(seed)
    dims = dims or {}
    feeds = {}
    for arg in nodeargs:
        dtype = _TYPES.get(arg.type)
        if dtype is None:
            raise InvalidArgument(
                f"input {arg.name!r} has type {arg.type}; give it with --input {arg.name}=FILE.npy")
        if shapes and arg.name in shapes:
            shape = tuple(shapes[arg.name])
        else:
            shape = tuple(d if isinstance(d, int) else dims.get(d, 1) if isinstance(d, str) else 1
                          for d in arg.shape)
        if np.dtype(dtype).kind == "f":
            feeds[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype is np.bool_:
            feeds[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[arg.name] = rng.integers(0, int_high, shape).astype(dtype)
    return feeds


class Progress:
    """One self-overwriting stderr line: ``packing [#####.....] 40%  12 weights, 45.2 MB``.

    Not tqdm: the bar needs one counter and one line, and a dependency for that would be one
    more package in every serving image that installs onnxpack.  Redrawn at most 10x a second;
    on a non-terminal stderr (CI logs) it prints a line per 10% instead of carriage returns.
    ``start(sizes)`` gives the weights (name -> bytes); below ``min_bytes`` in all, nothing is
    drawn (optimizing takes well under a second and a bar would only flicker).
    """

    def __init__(self, total: int = 0, sizes: dict[str, int] | None = None, stream=None, *,
                 min_bytes: int = 0, label: str = "packing") -> None:
        self.sizes = dict(sizes or {})
        self.total = max(total, 1)
        self.min_bytes = min_bytes
        self.enabled = total >= min_bytes
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done: set[str] = set()
        self.bytes = 0
        self._last = 0.0
        self._last_decile = -1

    def start(self, sizes: dict[str, int]) -> None:
        self.sizes = dict(sizes)
        total = sum(sizes.values())
        self.total = max(total, 1)
        self.enabled = total >= self.min_bytes

    def __call__(self, name: str) -> None:
        if name not in self.done:
            self.done.add(name)
            self.bytes += self.sizes.get(name, 0)
        self.draw()

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
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
        text = (f"{self.label} [{'#' * filled}{'.' * (30 - filled)}] {frac:4.0%}  "
                f"{len(self.done)} weights, {self.bytes / 1e6:.1f} MB")
        self.stream.write(("\r" + text) if self.tty else text + "\n")
        if final and self.tty:
            self.stream.write("\n")
        self.stream.flush()
