"""A plan's plain run as one generated Python function: the step loop unrolled.

Why: :func:`~onnxpack.session._program.run_plan`'s loop costs ~1-1.5 us per step beyond the
kernel call: a list built per step from dict lookups, the call mode tested, each output checked
and stored into the frame's dict, the release list walked.  onnxruntime's whole run of Silero
VAD (43 steps after shape specialization) takes ~90 us; the loop alone was ~50 us of ours.  A
function whose values are local variables does the same work with a few bytecodes per step.

What it does is exactly the loop's, for the runs it serves (no hook, no run control: every
default run): the steps in order, each kernel's ``run`` looked up at the call (a kernel patched
on its instance is seen), arguments read from locals (graph inputs and step outputs), module
globals (the plan's constants) or the enclosing frame (a subgraph's outer-scope names), omitted
and packed inputs as ``None``; outputs stored as the loop stores them (numpy scalars as 0-d
arrays); a value released at its last use (the local set to ``None``) so memory is freed where
the loop frees it; a kernel's exception wrapped in the same :class:`~onnxpack.errors.RuntimeFailure`
naming the step, a ``RuntimeFailure`` passed through as is (a specialized plan's guard miss).

A control-flow step (If, Loop, Scan: called with its frame) gets a frame of the values its
subgraphs read from this plan (``Step.implicit``: the live locals and constants of those names)
over the enclosing frame, so its bodies run as in the loop, generated themselves (a small model
ending in an If on its score, openWakeWord's heads, paid the loop's ~1 us a step for all of them).

What it declines (the loop runs instead): a step called with the run's whole context (the
onnx.reference fallback), a name read when the loop would not find it in the frame (read before
it is produced or after it is released), an output that is not a live value at the end.
A plan is compiled on its second plain run (a plan run once never pays for it); the function is
kept on the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from onnxpack.errors import RuntimeFailure

__all__ = ["generate", "Declined"]


# Plans longer than this stay on the loop: generating costs ~40 us a step (once), and a model of
# hundreds of thousands of nodes would pause its second run for seconds.
MAX_STEPS = 20000


class Declined(Exception):
    """The plan has something the generated function does not do (the loop runs it)."""


def generate(plan: Any, store: Callable[[Any], Any], missing_outputs: Callable[..., None],
             step_failure: Callable[..., Exception], frame: Callable[..., Any] | None = None) -> Callable:
    """The function ``run(inputs, get, parent)`` doing ``plan``'s plain run (``get``: the enclosing
    frame's lookup, for a root plan one that raises KeyError; ``parent``: that frame, or None), or
    raises :class:`Declined`.  ``store``, ``missing_outputs`` and ``step_failure`` are the loop's
    own helpers, ``frame`` its Frame class (_program; without it a step called with its frame is
    declined)."""
    if len(plan.steps) > MAX_STEPS:
        raise Declined(f"{len(plan.steps)} steps (more than {MAX_STEPS})")
    names: dict[str, str] = {}  # value name -> local identifier
    glob: dict[str, Any] = {"_nd": np.ndarray, "_RF": RuntimeFailure, "_store": store, "_missing": missing_outputs,
                            "_fail": step_failure, "_scope": plan.name, "_steps": plan.steps, "_Frame": frame}
    consts: dict[str, str] = {}
    for j, n in enumerate(plan.constants):
        consts[n] = f"C{j}"
        glob[f"C{j}"] = plan.constants[n]
    local_names = set(plan.input_names)
    for step in plan.steps:
        local_names.update(o for o in step.outputs if o)

    def ident(n: str) -> str:
        v = names.get(n)
        if v is None:
            v = names[n] = f"v{len(names)}"
        return v

    live = set(plan.input_names)
    live_consts = set(consts)
    lines = ["def _run(_inputs, _get, _parent):"]
    if plan.input_names:
        targets = ", ".join(ident(n) for n in plan.input_names)
        lines.append(f"    {targets}, = _inputs")
    lines.append("    _k = 0")
    lines.append("    try:")
    body = lines.append

    def read(n: str) -> str:
        if not n:
            return "None"
        if n in live:
            return ident(n)
        if n in local_names or n in consts:
            if n in consts and n in live_consts and n not in local_names:
                return consts[n]
            raise Declined(f"{n!r} read where the loop would look it up outside the plan")
        return f"_get({n!r})"

    def frame_of(step: Any) -> str:
        # The frame a control-flow step's subgraphs run in: the names they read from this plan
        # (its live values and constants) and, through the parent, from the enclosing plans; a
        # name the loop's frame would not hold here is read there from the enclosing frames.
        held = []
        for n in step.implicit:
            if n in live:
                held.append(f"{n!r}: {ident(n)}")
            elif n in consts and n in live_consts and n not in local_names:
                held.append(f"{n!r}: {consts[n]}")
            elif n in local_names or n in consts:
                raise Declined(f"{n!r} read by {step.label}'s subgraphs where the loop would look it up outside the plan")
        return f"_Frame({{{', '.join(held)}}}, _parent)"

    for k, step in enumerate(plan.steps):
        kernel = step.kernel
        mode = getattr(kernel, "call_mode", "plain")
        if mode == "frame" and frame is not None:
            call = f"K{k}.run_in_frame({', '.join([frame_of(step)] + [read(n) for n in step.args])})"
        elif mode == "plain":
            call = f"K{k}.run({', '.join(read(n) for n in step.args)})"
        else:
            raise Declined(f"{step.label} is called with its {mode}")
        glob[f"K{k}"] = kernel
        body(f"        _k = {k}")
        outs = step.outputs
        if len(outs) == 1:
            if outs[0]:
                v = ident(outs[0])
                body(f"        {v} = {call}[0]")
                body(f"        if {v}.__class__ is not _nd and {v} is not None: {v} = _store({v})")
                live.add(outs[0])
            else:
                body(f"        {call}")
        elif not outs:  # (a specialized plan's shape guard)
            body(f"        {call}")
        else:
            body(f"        _o = {call}")
            body(f"        if len(_o) < {len(outs)}: _missing(_steps[{k}], _o, _scope)")
            for j, o in enumerate(outs):
                if o:
                    body(f"        {ident(o)} = _store(_o[{j}])")
                    live.add(o)
        for n in step.release:
            if n in live:
                live.discard(n)
                body(f"        {ident(n)} = None")
            elif n in live_consts and n not in local_names:
                live_consts.discard(n)
    body("        pass")
    body("    except _RF:")
    body("        raise")
    body("    except Exception as _e:")
    body("        raise _fail(_steps[_k], _scope, _e) from _e")
    outs = []
    for n in plan.output_names:
        if n in live:
            outs.append(ident(n))
        elif n in consts and n in live_consts and n not in local_names:
            outs.append(consts[n])
        elif n not in local_names and n not in consts and n:
            outs.append(f"_get({n!r})")
        else:
            raise Declined(f"output {n!r} is not a live value at the end of the plan")
    body(f"    return [{', '.join(outs)}]")
    source = "\n".join(lines) + "\n"
    code = compile(source, f"<onnxpack plan {plan.name!r}>", "exec")
    exec(code, glob)  # noqa: S102 - our own generated source: identifiers and repr()'d names only
    # Taken out of its own globals: a function in the dict it reads would be a reference cycle,
    # and the kernels and constants it reaches would outlive a dropped session until Python's
    # cyclic collector ran (the loop frees them at once).
    return glob.pop("_run")
