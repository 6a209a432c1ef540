"""``onnxpack run MODEL``: run a model once (or N times) and print its outputs and timings.

Inputs come from ``--input name=file.npy``; any input not given is random data of its declared
shape and type (seeded, so two runs print the same numbers).  ``--dim name=value`` fixes a
symbolic dimension as a free-dimension override of the session (the API's
``SessionOptions.add_free_dimension_override_by_name``: the session's inputs show it and feeds
are checked against it).  Symbolic or unknown dims left open are set to 1, and the command says
which inputs have them before running; a run that then fails says so again, with the flags that
fix it.  The point is a one-line smoke test of a model ("does it load, what comes out, how long
does it take") without writing Python.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpack.cli._common import int_at_least, parse_pairs, random_inputs
from onnxpack.errors import InvalidArgument, RuntimeFailure

__all__ = ["HELP", "add_arguments", "run"]

logger = logging.getLogger(__name__)

HELP = "run a model on .npy or random inputs; print outputs and timings"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE.npy",
                   help="feed input NAME from a .npy file (repeatable); others get random data")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                   help="size of a symbolic dimension (a free-dimension override; repeatable; open dims are 1)")
    p.add_argument("--repeat", "-n", type=int_at_least(1), default=1,
                   help="number of timed runs after the first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="session config entry, e.g. session.disable_prepacking=1 (repeatable)")


def _dims(values: list[str]) -> dict[str, int]:
    dims = {}
    for name, text in parse_pairs(values, "--dim").items():
        try:
            dims[name] = int(text)
        except ValueError:
            raise InvalidArgument(f"--dim {name}={text}: expected a non-negative integer") from None
        if dims[name] < 0:
            raise InvalidArgument(f"--dim {name}={text}: expected a non-negative integer")
    return dims


def _load_npy(name: str, path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as e:  # OSError (missing file) reaches the CLI as is
        raise InvalidArgument(f"--input {name}={path}: not a readable .npy file ({e})") from e


def _open_dims(args: Sequence[Any]) -> dict[str, list]:
    """Input name -> its dims still open (symbolic names, None for unknown) after the overrides."""
    return {a.name: [d for d in a.shape if not isinstance(d, int)] for a in args
            if any(not isinstance(d, int) for d in a.shape)}


def _describe_open(open_dims: dict[str, list]) -> str:
    return "; ".join(f"{name} {['?' if d is None else d for d in dims]}" for name, dims in open_dims.items())


def run(args: argparse.Namespace) -> int:
    from onnxpack.session import InferenceSession, SessionOptions

    given = parse_pairs(args.input, "--input")
    dims = _dims(args.dim)
    so = SessionOptions()
    for key, value in parse_pairs(args.config, "--config").items():
        so.add_session_config_entry(key, value)
    if not os.path.exists(args.model):
        raise InvalidArgument(f"model {args.model!r} does not exist")
    for name, value in dims.items():
        so.add_free_dimension_override_by_name(name, value)
    t0 = time.perf_counter()
    sess = InferenceSession(args.model, so)
    create_s = time.perf_counter() - t0
    with sess:
        inputs = sess.get_inputs() + sess.get_overridable_initializers()
        known = {a.name for a in inputs}
        unknown = sorted(set(given) - known)
        if unknown:
            raise InvalidArgument(f"--input {unknown[0]!r}: the model's inputs are {sorted(known)}")
        declared = (_declared_inputs(args.model) if dims else sess.get_inputs()) + sess.get_overridable_initializers()
        used_dims = {d for a in declared for d in a.shape if isinstance(d, str)}
        stray = sorted(set(dims) - used_dims)
        if stray:
            raise InvalidArgument(f"--dim {stray[0]!r}: no input has a dimension of that name "
                                  f"(symbolic dims: {sorted(used_dims) or 'none'})")
        feeds = {name: _load_npy(name, path) for name, path in given.items()}
        randoms = [a for a in sess.get_inputs() if a.name not in feeds]
        open_dims = _open_dims(randoms)
        if open_dims:
            print(f"note: symbolic or unknown dims set to 1 in random inputs: {_describe_open(open_dims)} "
                  "(--dim NAME=VALUE sets a named dim, --input NAME=FILE.npy gives an input)")
        feeds.update(random_inputs(randoms, dims, args.seed))
        for name, value in feeds.items():
            origin = "file" if name in given else "random"
            print(f"input  {name}: {value.dtype} {list(value.shape)} ({origin})")
        names = [o.name for o in sess.get_outputs()]
        t0 = time.perf_counter()
        try:
            outputs = sess.run(None, feeds)
        except RuntimeFailure as exc:
            if not open_dims:
                raise
            raise InvalidArgument(
                f"{exc} -- the random inputs had symbolic or unknown dims set to 1 ({_describe_open(open_dims)}); "
                "give their sizes with --dim NAME=VALUE or the inputs with --input NAME=FILE.npy") from exc
        first_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        for name, value in zip(names, outputs):
            print(f"output {name}: {_describe(value)}")
        print(f"create {create_s * 1e3:.1f} ms, first run {first_s * 1e3:.1f} ms, "
              f"run median {statistics.median(times) * 1e3:.2f} ms / min {min(times) * 1e3:.2f} ms "
              f"over {len(times)} run(s)")
        fallbacks = sess.get_fallback_nodes()
        if fallbacks:
            print(f"{len(fallbacks)} node(s) ran through onnx.reference: {', '.join(fallbacks[:5])}"
                  + (" ..." if len(fallbacks) > 5 else ""))
    return 0


def _declared_inputs(model: str) -> list[Any]:
    """The model's own inputs (before --dim overrides): which symbolic dims exist to override."""
    from onnxpack.graph import load_model
    from onnxpack.session import model_inputs

    with load_model(model) as m:
        return model_inputs(m)


def _describe(value: Any) -> str:
    if not isinstance(value, np.ndarray):
        return f"{type(value).__name__} of {len(value)}" if isinstance(value, list) else type(value).__name__
    text = f"{value.dtype} {list(value.shape)}"
    if value.size and value.dtype.kind in "fiub":
        v = value.astype(np.float64)
        text += f" min {v.min():.6g} max {v.max():.6g} mean {v.mean():.6g}"
    return text
