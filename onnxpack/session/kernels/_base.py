"""The kernel contract and the one kernel registry.

A kernel is bound to one node once, at session creation.  Its constructor parses the node's
attributes (with the spec's defaults) so ``run`` does no parsing.  A kernel that computes faster
on a re-laid-out constant input implements the pre-packing trio:

* ``pack_spec(i, info)`` says, *without packing*, whether and how input ``i`` would be packed:
  a :class:`PackSpec` (kernel family, pack format version, bytes of the attributes that shape the
  pack).  The prepack layer derives the key from it plus the weight's identity, so a warm load
  finds a saved blob without running ``prepack``.
* ``prepack(i, weight)`` builds the packed buffers (a tuple of numpy arrays).
* ``use_prepacked(i, buffers)`` adopts buffers (packed here, taken from a container, or mapped
  from a file) after ``check_packed`` accepted them; from then on ``run`` must not touch the
  original weight.

Registration is explicit: ``@register("MatMul", since=1)`` (domain ``""`` and ``"ai.onnx"`` are
the same).  The highest since-version not above the model's opset for that domain wins.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from onnxpack._frozen import fast_init
from onnxpack.errors import KernelNotFoundError
from onnxpack.graph._proto import AttributeProto, NodeProto, get_attribute_value
from onnxpack.prepack import PackSpec

logger = logging.getLogger(__name__)

__all__ = [
    "Kernel",
    "register_fused",
    "fused_kernel",
    "KernelContext",
    "PackSpec",
    "TensorInfo",
    "register",
    "lookup",
    "registered_ops",
    "normalize_domain",
    "same_view",
    "broadcasts_to",
    "scratch_releaser",
    "release_scratch",
]


_scratch_releasers: list[Callable[[], None]] = []


def scratch_releaser(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn``: drops a kernel module's reusable per-thread scratch buffers of the calling
    thread (they are made again on next use).  A decorator."""
    _scratch_releasers.append(fn)
    return fn


def release_scratch() -> None:
    """Drop the calling thread's kernel scratch buffers (run option
    ``memory.enable_memory_arena_shrinkage``)."""
    for fn in _scratch_releasers:
        fn()


def same_view(a: Any, b: Any) -> bool:
    """Whether two arrays are the same memory with the same layout (one buffer seen through two
    array objects: a bound KV cache passed as a past input and as a present output)."""
    if a is b:
        return isinstance(a, np.ndarray)
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` without growing it (ONNX's
    unidirectional broadcasting: a bias, a scale or a mask against the tensor it applies to)."""
    try:
        return np.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def quiet_floats(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` (a kernel's) with numpy's floating-point warnings off: inf / NaN inputs give the
    arithmetic's inf / NaN, as onnxruntime's kernels do, without a RuntimeWarning per call."""

    @functools.wraps(run)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(all="ignore"):
            return run(*args, **kwargs)

    return quiet


@fast_init
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What is known about a constant input before its bytes are read."""

    name: str
    dtype: np.dtype  # numpy dtype as onnx.helper.tensor_dtype_to_np_dtype gives it (ml_dtypes for bf16/int4)
    shape: tuple[int, ...]
    elem_type: int  # TensorProto element type


@fast_init
@dataclasses.dataclass(frozen=True)
class KernelContext:
    """What a kernel may know about where it runs.

    ``subgraphs`` maps a node's graph attribute name to the compiled plan of that graph (for
    GRAPHS attributes, ``name[k]``); control-flow kernels run them with the caller's frame.
    """

    opset: int  # the model's opset for the kernel's domain
    opsets: dict[str, int]  # every domain's opset ("" for the default domain)
    subgraphs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    functions: Sequence[Any] = ()  # the model's FunctionProtos (for the onnx.reference fallback)
    # node -> a copy whose nested graphs hold external tensors inline, read through the graph
    # layer's checked loader (for the fallback, whose onnx.reference walks the graphs itself)
    inline: Callable[[NodeProto], NodeProto] | None = None


def normalize_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


class Kernel:
    """Base class of every kernel the executor runs (native, control flow, fused, fallback).

    Subclasses override ``run`` (returning a tuple of arrays, one per node output; ``None``
    entries for omitted optional outputs are allowed) and, when they pre-pack, ``pack_spec``,
    ``prepack`` and ``use_prepacked``.

    How the executor calls a kernel is declared, not discovered:

    * ``call_mode`` ``"plain"``: ``run(*inputs)``; ``"frame"``: ``run_in_frame(frame, *inputs)``
      (control flow: the kernel runs subgraph plans with the caller's values visible);
      ``"context"``: ``run(*inputs, context=visible values)`` (onnx.reference nodes with graph
      attributes).
    * ``run_into(outs, *inputs)`` writes the outputs into given arrays (the memory planner's
      arena) and returns True, or returns False to decline; ``writes_into`` is True for classes
      that override it.
    """

    op_type: ClassVar[str] = ""
    domain: ClassVar[str] = ""
    since: ClassVar[int] = 1
    call_mode: str = "plain"
    writes_into: ClassVar[bool] = False
    # True when the single output is always ``input 0 .reshape(some shape)`` decided by input 0's
    # shape and the other (constant) inputs: Reshape, Squeeze, Unsqueeze, Flatten.  A plan
    # specialized for fixed shapes (session/_specialize.py) then runs one guarded reshape.
    reshapes_input: ClassVar[bool] = False
    # For kernels with several outputs that ``run_into`` can write in place when a caller binds
    # them (IOBinding): output position -> the input position that output may share memory with
    # (the same array bound as both), or -1 for none.  ``run_into`` then gets ``None`` for
    # outputs not given and returns every output (a tuple), given ones in their buffers.
    bound_outputs: ClassVar[dict[int, int]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "writes_into" not in cls.__dict__:
            cls.writes_into = cls.run_into is not Kernel.run_into

    def __init__(self, node: NodeProto, ctx: KernelContext) -> None:
        self.node = node
        self.ctx = ctx
        self.attrs: dict[str, Any] = {
            a.name: get_attribute_value(a)
            for a in node.attribute[:]  # a slice: upb's containers iterate through __getitem__ + IndexError
            if a.type not in (AttributeProto.GRAPH, AttributeProto.GRAPHS)
        }

    # -- attributes -----------------------------------------------------------------------------
    def attr(self, name: str, default: Any = None) -> Any:
        value = self.attrs.get(name, default)
        if isinstance(value, bytes):
            return value.decode("utf-8")
        return value

    # -- pre-packing (optional) -----------------------------------------------------------------
    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        """Whether and how input ``input_index`` (a constant) would be packed. Default: never."""
        return None

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """Pack a constant input; only called when ``pack_spec`` returned a spec.  ``None``
        declines this value: nothing is stored, and the kernel gets the weight itself at run."""
        raise NotImplementedError(f"Bug: {type(self).__name__} has a pack_spec but no prepack")

    def check_packed(self, input_index: int, info: TensorInfo, buffers: Sequence[np.ndarray]) -> str | None:
        """Validate buffers that did not come from our own ``prepack`` (file, cache, container).

        Returns ``None`` when they are usable, else a one-line reason.  The default compares
        against :meth:`expected_packed`, which subclasses override when they pack.
        """
        expected = self.expected_packed(input_index, info)
        if expected is None:
            return "kernel does not pack this input"
        if len(expected) != len(buffers):
            return f"expected {len(expected)} buffers, got {len(buffers)}"
        for k, ((dtype, shape), buf) in enumerate(zip(expected, buffers)):
            got = buf.dtype
            if (got is not dtype and np.dtype(got) != np.dtype(dtype)) or tuple(buf.shape) != tuple(shape):
                return (
                    f"buffer {k}: expected {np.dtype(dtype)}{list(shape)}, "
                    f"got {np.dtype(buf.dtype)}{list(buf.shape)}"
                )
        return None

    def expected_packed(self, input_index: int, info: TensorInfo) -> list[tuple[np.dtype, tuple[int, ...]]] | None:
        """(dtype, shape) of every buffer ``prepack`` would return for this input, without packing."""
        return None

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        raise NotImplementedError(f"Bug: {type(self).__name__} has a pack_spec but no use_prepacked")

    # -- compute --------------------------------------------------------------------------------
    def run(self, *inputs: np.ndarray | None) -> tuple[np.ndarray | None, ...]:
        raise NotImplementedError

    def run_into(self, outs: Sequence[np.ndarray | None], *inputs: np.ndarray | None) -> bool:
        """Compute into ``outs`` (arrays of the recorded output shapes and dtypes, ``None`` for
        an output to allocate as usual); return False to decline.  Default: decline."""
        return False

    def fixed(self, shape: tuple[int, ...], dtype: np.dtype, constants: Sequence[Any]) -> Callable[[np.ndarray], np.ndarray] | None:
        """For a plan specialized for fixed shapes (session/_specialize.py): this single-output
        kernel as a function of input 0 alone, valid while that input has ``shape`` and
        ``dtype`` and the other inputs are ``constants`` (their values, ``None`` where omitted);
        or ``None`` (the default: the step keeps calling :meth:`run`).  The function must compute
        exactly what :meth:`run` would, and may return a view of its input only where ``run``
        does.  The caller guards the shape and dtype.  Only a class that defines ``run`` itself
        offers the ``fixed`` it defines or inherits by name (``fixed = Base.fixed``): a subclass
        that overrides ``run`` alone offers none."""
        return None

    def warm_up(self) -> None:
        """Work this kernel family can do off the critical path once per process (a JIT's import
        and compiled-code load), run by the session in a background thread after creation.
        Kernels that override it are warmed once per class; the default does nothing.  A kernel
        may instead set ``warm_up`` on the instance to a callable that references neither it
        nor mapped bytes: a closed session's model (which every kernel references through its
        context) then unmaps even while the thread is still compiling."""

    def run_in_frame(self, frame: Any, *inputs: Any) -> tuple:
        """For ``call_mode == "frame"`` kernels: run with the caller's frame."""
        raise NotImplementedError(f"Bug: {type(self).__name__} declares call_mode 'frame' but has no run_in_frame")


# (domain, op_type) -> list of (since_version, kernel class), kept sorted by since_version.
_REGISTRY: dict[tuple[str, str], list[tuple[int, type[Kernel]]]] = {}


def register(op_type: str, *, domain: str = "", since: int = 1) -> Callable[[type[Kernel]], type[Kernel]]:
    """Class decorator: register a kernel for (domain, op_type) from opset ``since`` on."""

    def deco(cls: type[Kernel]) -> type[Kernel]:
        key = (normalize_domain(domain), op_type)
        entries = _REGISTRY.setdefault(key, [])
        if any(v == since for v, _ in entries):
            raise RuntimeError(f"Bug: two kernels registered for {key} since {since}")
        entries.append((since, cls))
        entries.sort(key=lambda e: e[0])
        # Record what the class serves unless it says so itself (one class may serve several).
        for attr, value in (("op_type", op_type), ("domain", key[0]), ("since", since)):
            if attr not in cls.__dict__:
                setattr(cls, attr, value)
        return cls

    return deco


def lookup(domain: str, op_type: str, opset: int) -> type[Kernel] | None:
    """The kernel class for an op at the model's opset, or ``None`` when no native one exists."""
    entries = _REGISTRY.get((normalize_domain(domain), op_type))
    if not entries:
        return None
    chosen = None
    for since, cls in entries:
        if since <= opset:
            chosen = cls
    return chosen


# Fusion kind -> kernel class standing for a fused chain (see session/_fusion.py); the resolver
# picks these as it picks every kernel.
_FUSED: dict[str, type[Kernel]] = {}


def register_fused(kind: str) -> Callable[[type[Kernel]], type[Kernel]]:
    """Class decorator: the kernel that runs fusions of ``kind``; its constructor takes
    ``(node, ctx, fusion)``."""

    def deco(cls: type[Kernel]) -> type[Kernel]:
        if kind in _FUSED:
            raise RuntimeError(f"Bug: two kernels registered for fusion {kind!r}")
        _FUSED[kind] = cls
        return cls

    return deco


def fused_kernel(kind: str) -> type[Kernel]:
    cls = _FUSED.get(kind)
    if cls is None:
        raise RuntimeError(f"Bug: no kernel registered for fusion {kind!r}")
    return cls


def registered_ops() -> list[tuple[str, str, int]]:
    return sorted((d, op, v) for (d, op), entries in _REGISTRY.items() for v, _ in entries)


def require(domain: str, op_type: str, opset: int) -> type[Kernel]:
    cls = lookup(domain, op_type, opset)
    if cls is None:
        raise KernelNotFoundError(
            f"no native kernel for {domain or 'ai.onnx'}::{op_type} at opset {opset}; "
            f"native ops: {len(_REGISTRY)}"
        )
    return cls
