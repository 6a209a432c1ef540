"""The one kernel resolver: which kernel runs a node.

Every kernel — native, control flow, fused, and the onnx.reference fallback — is chosen here,
through the registry (``kernels.lookup`` for ``(domain, op_type)`` at the model's opset,
``kernels.fused_kernel`` for fusion records):

1. a node whose op is a function defined by the model itself runs that function (fallback);
2. a fusion record builds its fused kernel, or the anchor's own kernel plus an epilogue;
3. the registered native kernel for the opset, if any — unless the node holds graphs and the
   kernel does not run them (only ``call_mode == "frame"`` kernels do), or its constructor
   declines with ``NotImplementedError``;
4. otherwise onnx.reference's implementation (:class:`FallbackKernel`), or, when compiling only
   to save (``runnable=False``), a :class:`Deferred` placeholder that packs nothing and builds no
   evaluator.
"""

from __future__ import annotations

import logging
from collections.abc import Collection


from onnxpack.errors import InvalidGraph, OnnxpackError
from onnxpack.graph import subgraphs_of
from onnxpack.graph._proto import NodeProto
from onnxpack.session._fusion import Fusion
from onnxpack.session.kernels import Kernel, KernelContext, fused_kernel, lookup, normalize_domain
from onnxpack.session.kernels.elementwise import ActAfter

logger = logging.getLogger(__name__)

__all__ = ["Deferred", "Resolved", "resolve"]


class Deferred(Kernel):
    """A node left to onnx.reference in a compile that will not run (``onnxpack optimize``)."""

    fallback = True

    def run(self, *inputs):
        raise RuntimeError("Bug: a Deferred kernel was run (the program was compiled with runnable=False)")


class Resolved:
    """The kernel chosen for a node, and whether it is the onnx.reference fallback."""

    __slots__ = ("kernel", "fallback")

    def __init__(self, kernel: Kernel, fallback: bool) -> None:
        self.kernel = kernel
        self.fallback = fallback


def resolve(node: NodeProto, ctx: KernelContext, *, local_functions: Collection[tuple[str, str]] = (),
            fusion: Fusion | None = None, runnable: bool = True, holds_graphs: bool | None = None) -> Resolved:
    """The kernel for ``node`` (``fusion.node`` when a fusion record is given); ``holds_graphs``:
    whether ``node`` has graph attributes, when the caller knows (the compile step has its scopes).

    Raises:
        InvalidGraph: a native kernel's constructor failed on the node's attributes.
        KernelNotFoundError: no native kernel and onnx.reference has none either.
    """
    if fusion is not None:
        node = fusion.node
        if fusion.kernel is not None:
            return Resolved(_construct(fused_kernel(fusion.kernel), node, ctx, fusion.params), False)
    domain = normalize_domain(node.domain)
    kernel: Kernel | None = None
    if (domain, node.op_type) not in local_functions:
        cls = lookup(domain, node.op_type, ctx.opset)
        if holds_graphs is None:
            holds_graphs = next(subgraphs_of(node), None) is not None
        if cls is not None and (not holds_graphs or cls.call_mode == "frame"):
            _check_inputs(cls, node, ctx.opset)
            try:
                kernel = _construct(cls, node, ctx, {})
            except NotImplementedError as exc:
                logger.debug("node %r (%s): native kernel declined (%s); using onnx.reference", node.name,
                             node.op_type, exc)
    fallback = kernel is None
    if kernel is None:
        kernel = _fallback(node, ctx, runnable)
    if fusion is not None and fusion.epilogue:
        kernel = ActAfter(kernel, fusion.epilogue)
    return Resolved(kernel, fallback)


# kernel class -> how many inputs its run() requires (positional parameters without a default)
_REQUIRED: dict[type, int] = {}


def _check_inputs(cls: type[Kernel], node: NodeProto, opset: int) -> None:
    """Refuses a node with fewer inputs than its kernel's ``run`` requires: an ``Unsqueeze`` that
    kept its opset-11 ``axes`` attribute in an opset-21 model (as one of onnxruntime's quantizers
    leaves it; onnxruntime refuses such a model at load) failed at the first run with a Python
    signature error.  Read off the signature, once per class (onnx's schemas would import onnx,
    which loading and running never do)."""
    required = _REQUIRED.get(cls)
    if required is None:
        import inspect

        required = 0
        if cls.call_mode == "plain":
            params = list(inspect.signature(cls.run).parameters.values())[1:]
            for p in params:
                if p.kind is not p.POSITIONAL_OR_KEYWORD or p.default is not p.empty:
                    break
                required += 1
        _REQUIRED[cls] = required
    if len(node.input) < required:
        raise InvalidGraph(
            f"node {node.name!r} ({node.op_type}): {len(node.input)} input(s) {list(node.input)}, its kernel at opset "
            f"{opset} requires {required}"
            + (f" (attribute(s) {[a.name for a in node.attribute[:]]}: an older opset's form?)" if node.attribute else "")
        )


def _construct(cls: type[Kernel], node: NodeProto, ctx: KernelContext, params: dict) -> Kernel:
    try:
        return cls(node, ctx, **params)
    except (OnnxpackError, NotImplementedError):
        raise
    except Exception as exc:  # e.g. an attribute of the wrong type in a hostile model
        raise InvalidGraph(
            f"node {node.name!r} ({node.op_type}): invalid node for its kernel: {type(exc).__name__}: {exc}"
        ) from exc


def _fallback(node: NodeProto, ctx: KernelContext, runnable: bool) -> Kernel:
    logger.debug("node %r (%s): onnx.reference fallback", node.name, node.op_type)
    if not runnable:
        return Deferred(node, ctx)
    from onnxpack.session._fallback import FallbackKernel

    return FallbackKernel(node, ctx, ctx.functions)
