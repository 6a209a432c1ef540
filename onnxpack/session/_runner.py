"""How one run of a session is executed: feed checks, run controls, threads, the step loop.

:class:`Runner` holds what every run of a session shares (the program, the memory planner, the
profiler, the BLAS thread limit) and :meth:`Runner.execute` is the one path every run API of the
facade takes — ``run``, ``run_async``, ``run_with_ort_values``, ``run_with_iobinding``:

1. ``RunOptions.terminate`` already set fails at once (onnxruntime's FAIL);
2. the feed is checked and coerced (:func:`~onnxpack.session._api.validate_feed`) against the
   compiled inputs; active LoRA adapters' parameters are fed by name;
3. the output names are checked; with ``only_execute_path_to_fetches`` the root plan is pruned to
   the steps they need (cached per output set);
4. a :class:`~onnxpack.session._run_options.SessionControl` is made only if the run needs one
   (run options, profiling, bound outputs): otherwise the plain loop runs;
5. the root plan runs — through the memory planner if configured — under the session's BLAS
   thread limit, on several threads in the thread mode its :class:`~._threads.ModeTuner` picks
   (plain runs of the whole model are timed for it).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


from onnxpack.errors import InvalidArgumentStatus
from onnxpack.graph import Model
from onnxpack.session._api import feed_spec, validate_feed
from onnxpack.session._arena import ArenaRunner
from onnxpack.session._memory import keep_freed_memory, return_freed_heap
from onnxpack.session._profile import Profiler
from onnxpack.session._program import Plan, Program, prune, run_plan
from onnxpack.session._run_options import SessionControl, check_run_options, check_terminate
from onnxpack.session._specialize import Specializer, worth_specializing
from onnxpack.session._threads import ModeTuner, blas_libraries, blas_threads, global_intra_op_threads, owned_threads
from onnxpack.session.kernels import blas_threads as current_blas_threads, release_scratch
from onnxpack.session.kernels._act import blas_run_ended, deterministic_run, first_run, one_thread, quiet, stop_spinning
from onnxpack.session.options import SessionOptions

__all__ = ["Runner"]

# Pruned root plans kept per session (only_execute_path_to_fetches), one per requested output set.
MAX_PRUNED_PLANS = 16


class Runner:
    """The run path of one session (see the module docstring)."""

    def __init__(self, model: Model, program: Program, options: SessionOptions, config: dict[str, Any],
                 profiler: Profiler | None) -> None:
        self.model = model
        self.program = program
        self.feed = feed_spec(program.inputs, model.root.initializers, program.overridable)
        planner = config["onnxpack.memory_planner"]
        use_planner = planner not in (None, "none") and options.enable_mem_pattern
        self.arena = ArenaRunner(program.root, planner, pool_arenas=options.enable_cpu_mem_arena) if use_planner else None
        if options.enable_cpu_mem_arena:
            keep_freed_memory()  # what a run frees stays in the process for the next (see _memory)
        # Plans specialized per set of input shapes (_specialize.py): plain runs only (no memory
        # planner, run options, profiling or bound outputs), not with graph optimizations off.
        specialize = (config["onnxpack.specialize_shapes"] and self.arena is None
                      and int(options.graph_optimization_level) != 0 and worth_specializing(program.root))
        self.specializer = Specializer(program.root) if specialize else None
        self.per_session_threads = options.use_per_session_threads
        self.threads = options.intra_op_num_threads
        self.profiler = profiler
        self._pruned: OrderedDict[tuple[str, ...], Plan] = OrderedDict()
        self._ran = False  # a run has started (the first one maps the weights' pages: see _act.first_run)
        # The thread mode of runs on several threads: fixed by onnxpack.thread_mode, else tuned.
        # use_deterministic_compute keeps the starting mode (the modes may round a GEMM split
        # differently) and decides nothing by timing that changes a result (see _act.deterministic_run).
        mode = config["onnxpack.thread_mode"]
        self.deterministic = bool(options.use_deterministic_compute)
        self.modes = ModeTuner(mode != "blas")  # auto starts owned (see ModeTuner)
        if mode != "auto" or self.deterministic:
            self.modes.fix()

    def output_names(self, output_names: Sequence[str] | None) -> list[str]:
        outputs = self.program.root.output_names
        if not output_names:
            return list(outputs)
        for n in output_names:
            if n not in outputs:
                raise InvalidArgumentStatus(f"Invalid output name:{n} (the model's outputs are {list(outputs)})")
        return list(output_names)

    def _plan_for(self, names: list[str]) -> Plan:
        key = tuple(dict.fromkeys(names))
        plan = self._pruned.get(key)
        if plan is None:
            plan = prune(self.program.root, key)
            self._pruned[key] = plan
            while len(self._pruned) > MAX_PRUNED_PLANS:
                self._pruned.popitem(last=False)
        return plan

    def execute(self, input_feed: Any, output_names: Sequence[str] | None, run_options: Any = None,
                bind: Callable[[Plan, list[Any]], Any] | None = None) -> tuple[list[str], list[Any], list[Any]]:
        """Runs once; returns (output names, their values, the run's input values)."""
        t0 = time.perf_counter_ns()
        ro = check_run_options(run_options)
        check_terminate(ro)
        program = self.program
        program.check_files()  # a mapped file truncated or rewritten since load: an error, not SIGBUS
        feeds = validate_feed(self.model, input_feed, program.overridable, program.defaults, inputs=program.inputs,
                              spec=self.feed)
        if ro is not None and ro._adapters:
            for adapter in ro._adapters:
                feeds.update({n: v for n, v in adapter.parameters.items() if n in feeds})
        names = self.output_names(output_names)
        plan = program.root
        if ro is not None and ro.only_execute_path_to_fetches:
            plan = self._plan_for(names)
        inputs = [feeds[n] for n in plan.input_names]
        binder = bind(plan, inputs) if bind is not None else None
        profiler = self.profiler if self.profiler is not None and self.profiler.active else None
        control = SessionControl(ro, profiler, binder) if ro is not None or profiler or binder else None
        threads = self.threads if self.per_session_threads else global_intra_op_threads()
        n = threads if threads > 0 else current_blas_threads()
        first, self._ran = not self._ran, True
        own, which, key = False, -1, None
        if n > 1 and blas_libraries(quiet=True):  # (owned mode needs the BLAS at one thread: threadpoolctl)
            own = self.modes.current()
            if not first and control is None and plan is program.root:
                # Plain runs of the whole model choose their thread mode from the session's own runs.
                own, which, key = self.modes.pick(inputs)
        owned = n if own else 0
        if not owned and n > 1:
            stop_spinning()  # (helpers still polling after an owned-mode run: see below)
        try:
            t_run = time.perf_counter()
            # No floating-point warnings from the kernels' numpy (an overflow to inf, a NaN from
            # inf - inf): onnxruntime computes IEEE arithmetic silently, and a warning at every
            # run of a model whose masks add float32's lowest value twice would drown the log.
            with (quiet(), first_run() if first else contextlib.nullcontext(),
                  deterministic_run() if self.deterministic else contextlib.nullcontext()):
                if owned > 1:
                    with owned_threads(owned):
                        values = self._loop(plan, inputs, control)
                elif threads == 1:  # onnxpack's own kernels on one thread too, whatever else runs
                    with blas_threads(1), one_thread():
                        values = self._loop(plan, inputs, control)
                elif threads > 0:
                    with blas_threads(threads):
                        values = self._loop(plan, inputs, control)
                else:
                    values = self._loop(plan, inputs, control)
            if which >= 0:
                self.modes.record(key, which, time.perf_counter() - t_run)
        finally:
            if owned <= 1:
                # The pool's helpers sleep until the next run's first split: a run with BLAS on
                # several threads leaves OpenBLAS's workers polling the other core, where a polling
                # helper would take their turns.  After a run on onnxpack's own threads the helpers
                # poll out their window (SPIN_US after their last job, then they sleep), so the
                # next run's first split finds them awake: stopped here, each run paid a wake-up
                # (~15-40 us) and a helper coming back for the GIL while this thread ran Python
                # (measured two threads: the mel-spectrogram 494 -> 382 us a run, YOLOv8n 21.3-23.3
                # -> 19.8-20.5 ms).
                stop_spinning()
            if n > 1 and not owned and threads != 1:
                blas_run_ended()  # (OpenBLAS's workers poll a while: no owned-mode split sample then)
        result = dict(zip(plan.output_names, values))
        if profiler is not None:
            profiler.event("Session", "model_run", t0, time.perf_counter_ns())
        if ro is not None and "cpu" in ro._config.get("memory.enable_memory_arena_shrinkage", ""):
            if self.arena is not None:
                self.arena.shrink()
            release_scratch()  # the kernels' reusable buffers (this thread's)
            return_freed_heap()
        return names, [result[n] for n in names], inputs

    def _loop(self, plan: Plan, inputs: list[Any], control: SessionControl | None) -> list[Any]:
        if self.arena is not None and plan is self.program.root:
            return self.arena.run(inputs, control)
        if control is None and self.specializer is not None and plan is self.program.root:
            return self.specializer.run(inputs)
        return run_plan(plan, inputs, control=control)

