"""RunOptions (onnxruntime's per-run settings) and the run control built from them.

A run that passes a :class:`RunOptions`, profiles, or writes into bound outputs goes through a
:class:`SessionControl` (a :class:`~onnxpack.session._program.RunControl`): one hook per plan run
that, before each step, reads ``run_options.terminate`` — so another thread setting it stops the
run between two nodes, also inside If/Loop/Scan bodies, with onnxruntime's error — and that times
the root graph's steps for the profiler.  A run with none of these takes the plain loop.
"""

from __future__ import annotations

import time
from typing import Any

from onnxpack.errors import ConfigKeyNotFound, InvalidArgumentType, Terminated
from onnxpack.session._program import Frame, Plan, RunControl, Step, StepHook, call_step
from onnxpack.session.options import _INT, _typed

__all__ = ["RunOptions", "SessionControl", "TERMINATED_MESSAGE", "check_terminate", "check_run_options"]

TERMINATED_MESSAGE = "Exiting due to terminate flag being set to true."


class RunOptions:
    """Per-run options, as onnxruntime's ``RunOptions``.

    ``terminate`` may be set from another thread while a run is in flight: the run stops before
    its next node (onnxruntime's FAIL, :class:`~onnxpack.errors.Terminated`).  Like onnxruntime,
    the flag stays set: later runs with these options fail until it is reset to False.
    """

    logid = _typed("logid", str, "tag of this run's log records")
    log_severity_level = _typed("log_severity_level", _INT, "-1 (the session's) or 0..4", convert=int)
    log_verbosity_level = _typed("log_verbosity_level", _INT, "kept (onnxruntime: debug builds only)", convert=int)
    only_execute_path_to_fetches = _typed("only_execute_path_to_fetches", (bool, _INT),
                                          "run only the nodes the requested outputs need", convert=bool)
    training_mode = _typed("training_mode", (bool, _INT), "kept (inference only here)", convert=bool)

    def __init__(self) -> None:
        self.logid = ""
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.only_execute_path_to_fetches = False
        self.training_mode = False
        self.terminate = False
        self._config: dict[str, str] = {}
        self._adapters: list[Any] = []

    @property
    def terminate(self) -> bool:
        return self._terminate

    @terminate.setter
    def terminate(self, value: bool) -> None:
        if not isinstance(value, (bool, *_INT)):
            raise InvalidArgumentType(f"terminate: expected bool, got {type(value).__name__}")
        self._terminate = bool(value)

    def add_run_config_entry(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgumentType(f"add_run_config_entry: expected (str, str), got "
                                      f"({type(key).__name__}, {type(value).__name__})")
        self._config[key] = value

    def get_run_config_entry(self, key: str) -> str:
        if key in self._config:
            return self._config[key]
        raise ConfigKeyNotFound(f"RunOptions does not have configuration with key: {key}")

    def add_active_adapter(self, adapter: Any) -> None:
        """Use a LoRA adapter's parameters for runs with these options (they are fed by name)."""
        if not hasattr(adapter, "parameters"):
            raise InvalidArgumentType(f"add_active_adapter: expected a LoraAdapter, got {type(adapter).__name__}")
        self._adapters.append(adapter)

    @property
    def config(self) -> dict[str, str]:
        return dict(self._config)

    @property
    def adapters(self) -> list[Any]:
        return list(self._adapters)


def check_terminate(run_options: RunOptions | None) -> None:
    if run_options is not None and run_options._terminate:
        raise Terminated(TERMINATED_MESSAGE)


def check_run_options(run_options: Any) -> RunOptions | None:
    if run_options is None or isinstance(run_options, RunOptions):
        return run_options
    raise InvalidArgumentType(f"run_options: expected onnxpack.RunOptions, got {type(run_options).__name__}")


class SessionControl(RunControl):
    """A run's controls: terminate checks (``run_options``), per-node profiling of the root graph
    (``profiler``, see :mod:`~onnxpack.session._profile`) and bound outputs (``binder``, see
    :mod:`~onnxpack.session._iobinding`)."""

    __slots__ = ("run_options", "profiler", "binder")

    def __init__(self, run_options: RunOptions | None = None, profiler: Any = None, binder: Any = None) -> None:
        self.run_options = run_options
        self.profiler = profiler
        self.binder = binder

    def check(self) -> None:
        check_terminate(self.run_options)

    def hook(self, plan: Plan, inner: StepHook | None, root: bool) -> StepHook | None:
        if root and self.binder is not None:
            inner = self.binder.hook(inner)
        profiler = self.profiler if root else None
        if self.run_options is None and profiler is None:
            return inner
        return _ControlHook(inner, self.run_options, profiler)


class _ControlHook(StepHook):
    """Checks ``terminate`` before every step; with a profiler, records one event per step.

    A step's event spans from the end of the previous step's event to the end of this step, so it
    covers the step's whole cost in the loop (gathering its arguments, the kernel, storing its
    outputs) and the events of a run add up to the run; ``kernel_dur`` in its args is the kernel
    call alone.
    """

    __slots__ = ("inner", "run_options", "profiler", "last")

    def __init__(self, inner: StepHook | None, run_options: RunOptions | None, profiler: Any) -> None:
        self.inner = inner
        self.run_options = run_options
        self.profiler = profiler
        self.last = time.perf_counter_ns()

    def step(self, k: int, step: Step, args: list[Any], frame: Frame, plan: Plan) -> Any:
        ro = self.run_options
        if ro is not None and ro._terminate:
            raise Terminated(TERMINATED_MESSAGE)
        inner = self.inner
        profiler = self.profiler
        if profiler is None:
            return call_step(step, frame, args, plan.name) if inner is None else inner.step(k, step, args, frame, plan)
        t0 = time.perf_counter_ns()
        outs = call_step(step, frame, args, plan.name) if inner is None else inner.step(k, step, args, frame, plan)
        t1 = time.perf_counter_ns()
        profiler.node(k, step, args, outs, self.last, t0, t1)
        self.last = t1
        return outs

