"""IOBinding on the CPU: inputs used in place, outputs written into the caller's buffers.

``session.io_binding()`` returns an :class:`IOBinding`; ``run_with_iobinding(binding)`` runs it:

* **Inputs** (``bind_cpu_input``, ``bind_ortvalue_input``, ``bind_input`` with a pointer) are
  the caller's arrays, handed to the kernels without a copy.
* **Outputs bound to a preallocated OrtValue** (``bind_ortvalue_output``, ``bind_output`` with a
  pointer) are *written into*: the caller keeps the buffer.  When the node producing such an
  output has a kernel that can write into a given array (``Kernel.run_into``), and this binding
  has already seen that node run on inputs of the same shapes and dtypes giving an output of the
  buffer's shape and dtype, the kernel writes straight into the buffer; otherwise the result is
  copied in (``np.copyto``) at the end of the run, after checking that it fits (onnxruntime's
  "Got invalid dimensions for output" / "Unexpected output data type" otherwise).  A buffer that
  shares memory with one of the run's inputs is never written before the inputs are all read.
* **Outputs bound by device name only** (``bind_output(name)``) are allocated by the run and
  returned as OrtValues by ``get_outputs()``.

So an LLM decode loop can bind ``present_*`` outputs to buffers and bind those same OrtValues as
the next step's ``past_*`` inputs.  Errors of a bound run are onnxruntime's: plain
``RuntimeError`` subclasses whose message starts "Error in execution: ".
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxpack.errors import OnnxpackError, RuntimeInvalidArgument
from onnxpack.session._api import distinct_outputs, to_user
from onnxpack.session._ortvalue import OrtValue, _device_name, elem_dtype, value_type
from onnxpack.session._program import Frame, Plan, Step, StepHook, call_step, step_failure
from onnxpack.session.kernels import same_view

if TYPE_CHECKING:
    from onnxpack.session._session import InferenceSession

__all__ = ["IOBinding", "SessionIOBinding", "array_at"]


def array_at(buffer_ptr: int, element_type: Any, shape: Sequence[int]) -> np.ndarray:
    """A numpy array over ``shape`` elements at a raw CPU address (the caller guarantees the memory
    stays valid while bound, as with onnxruntime)."""
    dtype = elem_dtype(element_type)
    shape = tuple(int(d) for d in shape)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype == object or count < 0:
        raise RuntimeInvalidArgument("bind by pointer: numeric tensors only")
    raw = (ctypes.c_byte * (count * dtype.itemsize)).from_address(int(buffer_ptr))
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)


def _require_cpu(device_type: Any, what: str) -> None:
    if _device_name(device_type) != "cpu":
        raise RuntimeInvalidArgument(f"{what}: device {device_type!r} is not available; onnxpack computes on the CPU "
                                     "(bind to 'cpu')")


class IOBinding:
    """Inputs and outputs bound for :meth:`InferenceSession.run_with_iobinding` (see the module)."""

    def __init__(self, session: InferenceSession) -> None:
        self._session = session
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, OrtValue | None] = {}  # name -> preallocated OrtValue, None: allocate
        self._results: list[OrtValue] = []
        self._seen: dict[int, tuple] = {}  # id(kernel) -> (input signature, output shape, dtype) seen
        # The last run's binder decision: (plan, bound buffers by name, inputs, binder, the buffers'
        # spans).  Kept across clear_binding_* (a decoding loop rebinds the same buffers at each step).
        self._memo: tuple | None = None

    # -- inputs -----------------------------------------------------------------------------------
    def _input_name(self, name: str) -> str:
        if name not in self._session._feedable:
            raise RuntimeInvalidArgument(f"Failed to find NodeArg with name: {name} in the def list")
        return name

    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        self._inputs[self._input_name(name)] = arr_on_cpu

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: Sequence[int],
                   buffer_ptr: int) -> None:
        _require_cpu(device_type, f"bind_input({name!r})")
        self._inputs[self._input_name(name)] = array_at(buffer_ptr, element_type, shape)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        if not isinstance(ortvalue, OrtValue):
            raise RuntimeInvalidArgument(f"bind_ortvalue_input({name!r}): expected an OrtValue, got {type(ortvalue).__name__}")
        self._inputs[self._input_name(name)] = ortvalue._value

    def synchronize_inputs(self) -> None:
        """Nothing to wait for: CPU memory is written synchronously."""

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    # -- outputs ----------------------------------------------------------------------------------
    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type: Any = None,
                    shape: Sequence[int] | None = None, buffer_ptr: int | None = None) -> None:
        _require_cpu(device_type, f"bind_output({name!r})")
        if buffer_ptr is None:
            self._outputs[name] = None
            return
        if element_type is None or shape is None:
            raise RuntimeInvalidArgument("`element_type` and `shape` are to be provided if pre-allocated memory is provided")
        self._outputs[name] = OrtValue(array_at(buffer_ptr, element_type, shape))

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        if not isinstance(ortvalue, OrtValue) or not ortvalue.is_tensor():
            raise RuntimeInvalidArgument(f"bind_ortvalue_output({name!r}): expected an OrtValue holding a tensor")
        self._outputs[name] = ortvalue

    def synchronize_outputs(self) -> None:
        """Nothing to wait for: the run has written its outputs when it returns."""

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    def get_outputs(self) -> list[OrtValue]:
        """The outputs of the last run, in binding order (preallocated ones are the bound OrtValues)."""
        return list(self._results)

    get_outputs_as_ortvaluevector = get_outputs

    def copy_outputs_to_cpu(self) -> list[Any]:
        """Copies of the last run's outputs (numpy arrays; lists/dicts for sequences/maps)."""
        return [np.array(v._value) if isinstance(v._value, np.ndarray) else v._value for v in self._results]

    # -- running (called by the session) ----------------------------------------------------------
    def _run(self, runner: Any, run_options: Any, types: dict[str, str]) -> None:
        """One run of the session's runner with these bindings; errors as onnxruntime's bound
        runs report them (``RuntimeError``, "Error in execution: ...")."""
        if not self._outputs:
            raise RuntimeInvalidArgument("Error in execution: At least one output should be requested.")
        try:
            names, values, _ = runner.execute(self._inputs, list(self._outputs), run_options, self._binder)
            self._finish(names, values, types)
        except OnnxpackError as exc:
            if isinstance(exc, RuntimeError):
                raise
            raise RuntimeInvalidArgument(f"Error in execution: {exc}") from exc

    def _binder(self, plan: Plan, inputs: Sequence[Any]) -> _Binder | None:
        """Which steps write a bound output straight into its buffer (step index -> {output
        position -> buffer}).  A step qualifies when its kernel writes into given buffers and
        either has one output, or declares which outputs may be written in place
        (``Kernel.bound_outputs``: GroupQueryAttention's present caches).  A buffer that is also
        one of the run's inputs qualifies only as the input the kernel declares for that output
        (a present cache bound to its own past: onnxruntime-genai's shared KV buffer)."""
        targets = {n: ov._value for n, ov in self._outputs.items() if ov is not None}
        if not targets:
            return None
        memo = self._memo
        if memo is not None and memo[0] is plan and _same_buffers(memo[1], targets) and len(memo[2]) == len(inputs):
            # A decoding loop runs the same plan with the same bound buffers, and most of the same
            # inputs (the KV cache), at every step.  The decision stands while every input that
            # is not the very same array touches no bound buffer, and neither did the one it
            # replaces: the decision depends only on which inputs share memory with a buffer.
            bound_spans = memo[4]
            if all(x is old or not (_touches(bound_spans, x) or _touches(bound_spans, old))
                   for x, old in zip(inputs, memo[2])):
                return memo[3]
        binder = self._decide(plan, inputs, targets)
        self._memo = (plan, targets, tuple(inputs), binder, _Spans(targets.items()))
        return binder

    def _decide(self, plan: Plan, inputs: Sequence[Any], targets: dict[str, np.ndarray]) -> _Binder | None:
        spans = _Spans(zip(plan.input_names, inputs))
        producers: dict[int, dict[int, np.ndarray]] = {}
        for k, step in enumerate(plan.steps):
            kernel = step.kernel
            if not kernel.writes_into or kernel.call_mode != "plain":
                continue
            named = [i for i, o in enumerate(step.outputs) if o]
            declared = type(kernel).bound_outputs
            if declared:
                positions = [i for i in named if step.outputs[i] in targets and i in declared]
            elif len(named) == 1 and step.outputs[named[0]] in targets:
                positions = named
            else:
                continue
            bufs = {}
            for i in positions:
                buf = targets[step.outputs[i]]
                own = declared.get(i)
                own_name = step.inputs[own] if own is not None and 0 <= own < len(step.inputs) else None
                if all(n == own_name and x is buf for n, x in spans.touching(buf)):
                    bufs[i] = buf
            if bufs:
                producers[k] = bufs
        return _Binder(producers, self._seen) if producers else None

    def _finish(self, names: Sequence[str], values: Sequence[Any], types: dict[str, str]) -> None:
        results = []
        for name, value in zip(names, distinct_outputs(values)):
            bound = self._outputs[name]
            if bound is None:
                # As run() hands outputs out (to_user): never a read-only view of a weight in the
                # mapped data file (truncating that file after the run killed a later read with
                # SIGBUS) nor an input's memory.
                results.append(OrtValue(to_user(value, list(self._inputs.values()), name), types.get(name)))
                continue
            buf = bound._value
            if value is not buf and not same_view(value, buf):  # written in place: nothing to copy
                _check_fits(name, buf, value)
                np.copyto(buf, value)
            results.append(bound)
        self._results = results


def _touches(spans: _Spans, x: Any) -> bool:
    return isinstance(x, np.ndarray) and bool(spans.touching(x))


def _same_buffers(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two name -> buffer bindings name the very same arrays."""
    if len(a) != len(b):
        return False
    for name, buf in a.items():
        if b.get(name) is not buf:
            return False
    return True


def _bounds(x: np.ndarray) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` an array's elements lie in."""
    first = last = x.__array_interface__["data"][0]
    if x.flags.c_contiguous:
        return first, first + x.nbytes
    for n, st in zip(x.shape, x.strides):
        if n > 1:
            if st < 0:
                first += (n - 1) * st
            else:
                last += (n - 1) * st
    return first, last + x.itemsize


class _Spans:
    """The run's input arrays by byte range: which of them a buffer may share memory with, in
    O(log n) per buffer (a KV-cache binding has ~50 inputs and ~50 bound outputs per step)."""

    def __init__(self, named: Any) -> None:
        items = sorted((*_bounds(x), n, x) for n, x in named if isinstance(x, np.ndarray) and x.size)
        self.items = items
        self.starts = [it[0] for it in items]
        self.widest = max((it[1] - it[0] for it in items), default=0)

    def touching(self, buf: np.ndarray) -> list[tuple[str, np.ndarray]]:
        if not self.items or buf.size == 0:
            return []
        lo, hi = _bounds(buf)
        j = bisect.bisect_left(self.starts, hi)
        out = []
        k = bisect.bisect_left(self.starts, lo - self.widest)
        for start, end, n, x in self.items[k:j]:
            if end > lo and np.may_share_memory(buf, x):
                out.append((n, x))
        return out


def _check_fits(name: str, buf: np.ndarray, value: Any) -> None:
    if not isinstance(value, np.ndarray):
        raise RuntimeInvalidArgument(f"Error in execution: output {name!r} is a {value_type(value)}; it cannot be "
                                     "written into a preallocated tensor")
    if buf.dtype != value.dtype:
        raise RuntimeInvalidArgument(f"Error in execution: Unexpected output data type. Actual: ({value_type(buf)}) , "
                                     f"expected: ({value_type(value)})")
    if buf.shape != value.shape:
        if buf.ndim != value.ndim:
            raise RuntimeInvalidArgument(f"Error in execution: Invalid rank for output: {name} Got: {buf.ndim} Expected: "
                                         f"{value.ndim} Please fix either the inputs/outputs or the model.")
        bad = "".join(f" index: {i} Got: {g} Expected: {e}" for i, (g, e) in enumerate(zip(buf.shape, value.shape))
                      if g != e)
        raise RuntimeInvalidArgument(f"Error in execution: Got invalid dimensions for output: {name} for the following "
                                     f"indices{bad} Please fix either the inputs/outputs or the model.")


def _sig(args: Sequence[Any]) -> tuple:
    return tuple((a.shape, a.dtype) if isinstance(a, np.ndarray) else type(a) for a in args)


class _Binder:
    """Per run: the steps of the plan run whose one output is a preallocated buffer (step index ->
    buffer), and what the binding has seen each node produce (``seen``, by kernel)."""

    __slots__ = ("producers", "seen")

    def __init__(self, producers: dict[int, np.ndarray], seen: dict[int, tuple]) -> None:
        self.producers = producers
        self.seen = seen

    def hook(self, inner: StepHook | None) -> StepHook | None:
        # With the memory planner's hook in charge, results are copied in at the end instead.
        return _BindHook(self) if inner is None else inner


class _BindHook(StepHook):
    __slots__ = ("binder",)

    def __init__(self, binder: _Binder) -> None:
        self.binder = binder

    def steps(self, plan: Plan) -> Container[int]:
        return self.binder.producers  # the other steps run as in a plain run

    def step(self, k: int, step: Step, args: list[Any], frame: Frame, plan: Plan) -> Any:
        bufs = self.binder.producers.get(k)
        if bufs is None:
            return call_step(step, frame, args, plan.name)
        sig = _sig(args)
        key = id(step.kernel)  # the node, whichever plan (whole or pruned) runs it
        # Written in place only once this node was seen making outputs of the buffers' shapes
        # from inputs of these shapes (the first run with a signature computes as usual).
        if self.binder.seen.get(key) == (sig, tuple((i, b.shape, b.dtype) for i, b in bufs.items())):
            outs = [bufs.get(i) for i in range(len(step.outputs))]
            try:
                done = step.kernel.run_into(outs, *args)
            except OnnxpackError:
                raise
            except Exception as exc:
                raise step_failure(step, plan.name, exc) from exc
            if isinstance(done, (tuple, list)):  # the outputs, bound ones in their buffers
                return list(done)
            if done is not False:
                return outs
        outs = call_step(step, frame, args, plan.name)
        made = [(i, outs[i]) for i in bufs if i < len(outs)]
        if all(isinstance(v, np.ndarray) for _, v in made):
            self.binder.seen[key] = (sig, tuple((i, v.shape, v.dtype) for i, v in made))
        return outs


class SessionIOBinding(IOBinding):
    """onnxruntime's low-level binding class (``SessionIOBinding(session)``); the same object here."""
