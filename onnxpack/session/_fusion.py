"""Conv → BatchNormalization → Relu fusion, decided at session creation.

ResNet-style models spend a tenth of their time in BatchNormalization and Relu after each Conv.
With pre-packing on, an inference BatchNormalization whose statistics are constants folds into
the Conv's packed weight (``W' = W * scale / sqrt(var + eps)``) and a per-channel shift, and a
following Relu runs in place on the Conv's fresh output.  The folded weight is an ordinary
pre-packed weight of ``W``: its key includes a digest of the BatchNormalization constants, so it
is saved, mapped and shared like any other, and a changed statistic is a different key.

The graph itself is never rewritten: the saved model is the original one, and each session
re-derives the fusion from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from onnx import NodeProto, helper

__all__ = ["ConvFusion", "ReluAfter", "find_conv_fusions", "find_relu_fusions", "fused_node"]


@dataclasses.dataclass(frozen=True)
class ConvFusion:
    """One Conv with the BatchNormalization and/or Relu folded into it (indices into the nodes)."""

    conv: int
    bn: int | None
    relu: int | None

    @property
    def absorbed(self) -> tuple[int, ...]:
        return tuple(i for i in (self.bn, self.relu) if i is not None)


def find_conv_fusions(
    nodes: Sequence[NodeProto],
    readers: dict[str, int],
    protected: set[str],
    is_const: Callable[[str], bool],
    opset: int,
) -> list[ConvFusion]:
    """Fusions in ``nodes`` (pure: decided from the graph alone).

    Args:
        nodes: the scope's nodes.
        readers: name -> number of reads (node inputs, subgraph free names, graph outputs).
        protected: names that must stay materialized (graph outputs).
        is_const: whether a name is a constant of the scope (initializer, not overridable).
        opset: the default domain's opset.
    """
    by_input: dict[str, list[int]] = {}
    for k, node in enumerate(nodes):
        for name in node.input:
            if name:
                by_input.setdefault(name, []).append(k)

    def sole_reader(name: str, op_type: str) -> int | None:
        users = by_input.get(name, [])
        if len(users) != 1 or readers.get(name, 0) != 1 or name in protected:
            return None
        k = users[0]
        node = nodes[k]
        if node.op_type != op_type or node.domain not in ("", "ai.onnx") or node.input[0] != name:
            return None
        return k

    out: list[ConvFusion] = []
    for k, node in enumerate(nodes):
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        if not is_const(node.input[1]) or (len(node.input) > 2 and node.input[2] and not is_const(node.input[2])):
            continue
        bn = sole_reader(node.output[0], "BatchNormalization")
        if bn is not None and not _foldable_bn(nodes[bn], is_const, opset):
            bn = None
        tail = nodes[bn].output[0] if bn is not None else node.output[0]
        relu = sole_reader(tail, "Relu")
        if bn is None and relu is None:
            continue
        out.append(ConvFusion(k, bn, relu))
    return out


# Elementwise producers whose result Relu may clamp in place (a residual Sum -> Relu, ...).
_RELU_PRODUCERS = frozenset({"Add", "Sum", "Sub", "Mul"})


def find_relu_fusions(
    nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str], taken: set[int]
) -> list[ConvFusion]:
    """``Add/Sum/Sub/Mul -> Relu`` pairs where Relu is the producer's only reader.

    Returned as :class:`ConvFusion` with ``conv`` the producer and ``bn`` None; ``taken`` holds
    node indices already part of another fusion.
    """
    by_input: dict[str, list[int]] = {}
    for k, node in enumerate(nodes):
        for name in node.input:
            if name:
                by_input.setdefault(name, []).append(k)
    out = []
    for k, node in enumerate(nodes):
        if k in taken or node.op_type not in _RELU_PRODUCERS or node.domain not in ("", "ai.onnx"):
            continue
        name = node.output[0]
        users = by_input.get(name, [])
        if len(users) != 1 or readers.get(name, 0) != 1 or name in protected or users[0] in taken:
            continue
        relu = nodes[users[0]]
        if relu.op_type == "Relu" and relu.domain in ("", "ai.onnx"):
            out.append(ConvFusion(k, None, users[0]))
    return out


class ReluAfter:
    """A native elementwise kernel whose single output Relu clamps in place.

    The producer's result is a fresh array unless it returned one of its inputs (Sum of one
    input): then Relu allocates as usual, so no caller's value is ever written.
    """

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):  # pack_spec, node, attrs...: the producer's
        return getattr(self.inner, name)

    def run_into(self, outs, *inputs) -> bool:
        """The producer's ``run_into`` (the planner's arena), then Relu in place on ``outs[0]``."""
        into = getattr(self.inner, "run_into", None)
        if into is None or not into(outs, *inputs):
            return False
        np.maximum(outs[0], 0, out=outs[0])
        return True

    def run(self, *inputs):
        (y,) = self.inner.run(*inputs)[:1]
        if isinstance(y, np.ndarray) and y.flags.writeable and y.flags.owndata and not any(y is x for x in inputs):
            np.maximum(y, 0, out=y)
            return (y,)
        return (np.maximum(y, 0).astype(y.dtype, copy=False),)


def _foldable_bn(node: NodeProto, is_const: Callable[[str], bool], opset: int) -> bool:
    if len(node.input) != 5 or not all(is_const(n) for n in node.input[1:]):
        return False
    if len([o for o in node.output if o]) != 1:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if int(attrs.get("training_mode", 0)):
        return False
    return not (opset < 9 and int(attrs.get("spatial", 1)) == 0)


def fused_node(nodes: Sequence[NodeProto], fusion: ConvFusion) -> NodeProto:
    """The Conv node standing for the fused chain: its inputs, the chain's last output."""
    conv = nodes[fusion.conv]
    last = nodes[fusion.relu if fusion.relu is not None else fusion.bn]
    names = [nodes[i].name or f"#{i}" for i in (fusion.conv, *fusion.absorbed)]
    node = NodeProto()
    node.CopyFrom(conv)
    node.name = "+".join(names)
    del node.output[:]
    node.output.extend([last.output[0]])
    return node


def bn_fold(scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float,
            conv_bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel multiplier and shift of ``BN(conv(x) + conv_bias)`` (float32)."""
    f = np.float32
    a = scale.astype(f) / np.sqrt(var.astype(f) + f(eps))
    b0 = conv_bias.astype(f) if conv_bias is not None else f(0)
    shift = (b0 - mean.astype(f)) * a + bias.astype(f)
    return a, shift
