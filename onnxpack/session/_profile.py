"""Session profiling: onnxruntime's ``enable_profiling`` / ``end_profiling()`` trace files.

With ``SessionOptions.enable_profiling`` a session records Chrome-trace "complete" events
(``"ph": "X"``, microsecond ``ts``/``dur`` from the profiling start, ``pid``, ``tid``, ``cat``,
``name``, ``args``) the way onnxruntime's profiler does: ``model_loading_uri`` /
``model_loading_array`` and ``session_initialization`` at creation, then per run one ``Node``
event per node of the model's graph (``<node>_kernel_time``, with ``op_name``, ``provider``,
``node_index``, input/output type and shape) and one ``model_run`` event.  ``end_profiling()``
writes them to ``<profile_file_prefix>_<date>_<time>.json`` as a JSON array, one event per line
(as onnxruntime writes it), stops recording and returns the file name; ``chrome://tracing`` and
Perfetto open it.

Node events cover their step of the loop end to end (see
:class:`~onnxpack.session._run_options._ControlHook`), so a run's node events add up to its
``model_run`` event less the feed checks before the first node; ``kernel_dur`` is the kernel
call alone.  Subgraph nodes are inside their If/Loop/Scan node's event.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpack.graph._proto import TensorProto
from onnxpack.session._ortvalue import elem_type_of
from onnxpack.session._program import Step

__all__ = ["Profiler"]

_PROVIDER = "CPUExecutionProvider"


_TYPE_NAMES: dict[np.dtype, str] = {}


def _type_name(dtype: np.dtype) -> str:
    name = _TYPE_NAMES.get(dtype)
    if name is None:
        try:
            name = TensorProto.DataType.Name(elem_type_of(dtype)).lower()
        except Exception:  # a dtype without an ONNX element type: name it as numpy does
            name = str(dtype)
        _TYPE_NAMES[dtype] = name
    return name


class Profiler:
    """The events of one session, from its creation to ``end_profiling()``.  Thread-safe."""

    def __init__(self, prefix: str, origin_ns: int | None = None) -> None:
        """``origin_ns``: the ``time.perf_counter_ns()`` reading profiling starts at (default: now)."""
        now = time.perf_counter_ns()
        self._t0 = now if origin_ns is None else origin_ns
        self.prefix = prefix
        self.start_ns = time.time_ns() - (now - self._t0)  # onnxruntime reports the start as wall-clock ns
        self._pid = os.getpid()
        # Records are flat tuples of strings and numbers, made into JSON objects only at the end:
        # tens of thousands of dicts would make every garbage collection walk them during runs.
        self._records: list[tuple] = []
        self._lock = threading.Lock()
        self.active = True

    def event(self, cat: str, name: str, t0_ns: int, t1_ns: int) -> None:
        """Records one complete event between two ``time.perf_counter_ns()`` readings."""
        if self.active:
            self._records.append((cat, name, threading.get_native_id(), t0_ns, t1_ns))  # list.append is atomic

    def node(self, k: int, step: Step, args: Sequence[Any], outs: Sequence[Any], start_ns: int, call_ns: int,
             end_ns: int) -> None:
        """One node's event: its step from ``start_ns`` to ``end_ns``, the kernel from ``call_ns``."""
        if not self.active:
            return
        node = step.node
        ins = tuple((v.dtype, v.shape, v.nbytes) for v in args if isinstance(v, np.ndarray))
        produced = tuple((v.dtype, v.shape, v.nbytes) for v in outs if isinstance(v, np.ndarray))
        self._records.append(("Node", f"{node.name or node.op_type + '_' + str(k)}_kernel_time",
                              threading.get_native_id(), start_ns, end_ns, node.op_type, k, call_ns, ins, produced))

    def _event(self, record: tuple) -> dict[str, Any]:
        cat, name, tid, t0, t1 = record[:5]
        args: dict[str, Any] = {}
        if cat == "Node":
            op, k, call, ins, produced = record[5:]
            args = {"op_name": op, "provider": _PROVIDER, "node_index": str(k),
                    "kernel_dur": round((t1 - call) / 1e3, 3),
                    "input_type_shape": [{_type_name(d): [int(x) for x in s]} for d, s, _ in ins],
                    "output_type_shape": [{_type_name(d): [int(x) for x in s]} for d, s, _ in produced],
                    "output_size": str(sum(n for _, _, n in produced)),
                    "activation_size": str(sum(n for _, _, n in ins))}
        return {"cat": cat, "pid": self._pid, "tid": tid, "dur": round((t1 - t0) / 1e3, 3),
                "ts": round((t0 - self._t0) / 1e3, 3), "ph": "X", "name": name, "args": args}

    def events(self) -> list[dict[str, Any]]:
        """The events recorded so far, as ``end_profiling()`` writes them."""
        return [self._event(r) for r in list(self._records)]

    def end(self) -> str:
        """Writes the events and stops recording; returns the file name ('' when already ended)."""
        with self._lock:
            if not self.active:
                return ""
            self.active = False
            records, self._records = self._records, []
        events = [self._event(r) for r in records]
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(self.start_ns / 1e9))
        base = f"{self.prefix}_{stamp}_{(self.start_ns // 1_000_000) % 1000:03d}"
        lines = ["["] + [json.dumps(e, separators=(",", ":")) + ("," if i + 1 < len(events) else "")
                         for i, e in enumerate(events)] + ["]"]
        text = "\n".join(lines) + "\n"
        for n in range(1000):
            path = f"{base}.json" if n == 0 else f"{base}-{n}.json"
            try:
                with open(path, "x", encoding="utf-8") as f:  # never overwrite another session's trace
                    f.write(text)
                return path
            except FileExistsError:
                continue
        raise FileExistsError(f"end_profiling: {base}.json and 999 numbered variants exist")
