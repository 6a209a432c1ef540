"""Conv → BatchNormalization → Relu, elementwise → Relu and QuantizeLinear → DequantizeLinear
fusions, decided at session creation.

ResNet-style models spend a tenth of their time in BatchNormalization and Relu after each Conv.
With pre-packing on, an inference BatchNormalization whose statistics are constants folds into
the Conv's packed weight (``W' = W * scale / sqrt(var + eps)``) and a per-channel shift, and a
following Relu runs in place on the Conv's fresh output.  The folded weight is an ordinary
pre-packed weight of ``W``: its key includes a digest of the BatchNormalization constants, so it
is saved, mapped and shared like any other, and a changed statistic is a different key.

A QDQ model (``onnxruntime.quantization``'s default format) brackets every activation with a
QuantizeLinear → DequantizeLinear pair of the same scale and zero point ("fake quantization"):
the float value rounded to the integer grid.  The pair runs as one float kernel
(``fake_quant``: divide, round, clamp to the integer range shifted by the zero point, multiply,
never materializing the integers), whose results are the pair's bit for bit.

The graph itself is never rewritten: the saved model is the original one, and each compile
re-derives the fusions from it.  :func:`plan_fusions` is pure: it returns :class:`Fusion`
records (which nodes collapse into which, and the arguments of the kernel that runs them); the
resolver turns a record into a kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from onnx import NodeProto, helper

__all__ = ["ConvFusion", "Fusion", "apply_fusions", "bn_fold", "find_conv_fusions", "find_fake_quant_fusions",
           "find_relu_fusions", "fused_node", "plan_fusions"]


@dataclasses.dataclass(frozen=True)
class Fusion:
    """A chain of nodes that runs as one kernel.

    ``node`` stands for the chain (the anchor's inputs, the chain's last output); it replaces the
    node at index ``anchor`` and the nodes at ``absorbed`` are dropped.  ``kernel`` names the
    fused kernel (``register_fused``) built with ``params``; ``None`` keeps the anchor's own
    kernel.  ``epilogue`` ``"relu"`` clamps that kernel's fresh output in place.
    """

    node: NodeProto
    anchor: int
    absorbed: tuple[int, ...]
    kernel: str | None = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    epilogue: str | None = None


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


# Zero-point types of a fusable pair: integers of at most 16 bits, exact in float32 arithmetic.
_FAKE_QUANT_TYPES = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535)}


def find_fake_quant_fusions(
    nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
    const_value: Callable[[str], np.ndarray | None], opset: int, taken: set[int],
) -> list[Fusion]:
    """``QuantizeLinear -> DequantizeLinear`` pairs that are one rounding of a float tensor.

    The pair fuses when: both are default-domain nodes at opset >= 13 without ``block_size``,
    ``output_dtype`` or ``precision``; the Q's output is read by the DQ alone (and is no graph
    output); the DQ's scale and zero point are the Q's (same constants: equal dtypes and values);
    the scale is float32 (the DQ's output is float32) and positive; the zero point an integer type
    of at most 16 bits (both constants; a zero point must be given).  ``params`` carries the
    integer range.
    """
    if opset < 13:
        return []
    ops = [n.op_type for n in nodes]
    # The DequantizeLinear nodes by their input: a Q output read once (``readers``) by one of them.
    dq_of = {nodes[k].input[0]: k for k, op in enumerate(ops) if op == "DequantizeLinear" and nodes[k].input}
    out: list[Fusion] = []
    for k, op in enumerate(ops):
        if op != "QuantizeLinear" or k in taken:
            continue
        q = nodes[k]
        if q.domain not in ("", "ai.onnx") or len(q.input) != 3:
            continue
        name = q.output[0]
        d = dq_of.get(name)
        if d is None or readers.get(name, 0) != 1 or name in protected or d in taken:
            continue
        users = [d]
        dq = nodes[d]
        if dq.domain not in ("", "ai.onnx") or len(dq.input) != 3:
            continue
        qa, da = _attrs(q), _attrs(dq)
        if any(a.get(key) for a in (qa, da) for key in ("block_size", "output_dtype", "precision")):
            continue
        scale, zp = const_value(q.input[1]), const_value(q.input[2])
        if scale is None or zp is None or scale.dtype != np.float32 or zp.dtype.name not in _FAKE_QUANT_TYPES:
            continue
        for mine, theirs in ((q.input[1], dq.input[1]), (q.input[2], dq.input[2])):
            if mine != theirs:  # the quantizer shares one scale and zero point: names match
                other, value = const_value(theirs), const_value(mine)
                if other is None or other.dtype != value.dtype or not np.array_equal(other, value):
                    break
        else:
            if not (scale > 0).all() or (scale.size > 1 and int(qa.get("axis", 1)) != int(da.get("axis", 1))):
                continue
            node = NodeProto()
            node.CopyFrom(q)
            node.name = f"{q.name or f'#{k}'}+{dq.name or f'#{users[0]}'}"
            del node.output[:]
            node.output.extend([dq.output[0]])
            lo, hi = _FAKE_QUANT_TYPES[zp.dtype.name]
            out.append(Fusion(node, k, (users[0],), kernel="fake_quant",
                              params={"axis": int(qa.get("axis", 1)), "low": lo, "high": hi}))
            taken.update((k, users[0]))
    return out


def _attrs(node: NodeProto) -> dict[str, Any]:
    """The int attributes the fusion looks at (``axis``, ``block_size``, ``output_dtype``, ``precision``)."""
    return {a.name: a.i for a in node.attribute}


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
    """Per-output-channel multiplier and shift of ``BN(conv(x) + conv_bias)``.

    Computed in float64 whatever the inputs: the kernel rounds once to its compute dtype, so a
    float64 model keeps float64 precision and a float32 one is rounded once instead of per step.
    """
    f = np.float64
    a = scale.astype(f) / np.sqrt(var.astype(f) + f(eps))
    b0 = conv_bias.astype(f) if conv_bias is not None else f(0)
    shift = (b0 - mean.astype(f)) * a + bias.astype(f)
    return a, shift


def plan_fusions(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                 const_value: Callable[[str], np.ndarray | None], opset: int,
                 is_const: Callable[[str], bool] | None = None) -> list[Fusion]:
    """Every fusion of one scope's nodes (pure).

    Args:
        nodes: the scope's nodes.
        readers: name -> number of reads (node inputs, subgraph free names, graph outputs).
        protected: names that must stay materialized (graph outputs).
        const_value: the value of a constant of the scope (initializer, not overridable), or None.
        opset: the default domain's opset.
        is_const: whether a name is such a constant, without computing it (a Conv weight that is
            a dequantized int8 weight would otherwise be dequantized just to be recognised: at a
            warm start, where its pack is mapped, that was a QDQ ResNet-50's largest cost);
            default: ``const_value(n) is not None``.
    """
    if is_const is None:
        def is_const(n: str) -> bool:
            return const_value(n) is not None

    convs = find_conv_fusions(nodes, readers, protected, is_const, opset)
    taken = {i for f in convs for i in (f.conv, *f.absorbed)}
    out: list[Fusion] = []
    for f in convs:
        node = fused_node(nodes, f)
        params: dict[str, Any] = {"multiplier": None, "shift": None, "relu": f.relu is not None}
        if f.bn is not None:
            bn = nodes[f.bn]
            scale, bias, mean, var = (const_value(n) for n in bn.input[1:5])
            channels = const_value(nodes[f.conv].input[1]).shape[0]
            if any(np.ndim(p) != 1 or np.size(p) != channels for p in (scale, bias, mean, var)):
                continue  # not one statistic per output channel: BatchNormalization decides (or refuses)
            eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
            conv = nodes[f.conv]
            cb = const_value(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else None
            params["multiplier"], params["shift"] = bn_fold(scale, bias, mean, var, eps, cb)
            del node.input[2:]  # the Conv bias is folded into the shift
        out.append(Fusion(node, f.conv, f.absorbed, kernel="conv", params=params))
    for f in find_relu_fusions(nodes, readers, protected, taken):
        out.append(Fusion(fused_node(nodes, f), f.conv, f.absorbed, epilogue="relu"))
        taken.update((f.conv, *f.absorbed))
    out.extend(find_fake_quant_fusions(nodes, readers, protected, const_value, opset, taken))
    return out


def apply_fusions(nodes: Sequence[NodeProto],
                  fusions: Sequence[Fusion]) -> list[tuple[int, NodeProto, Fusion | None]]:
    """The scope's nodes after fusion, as (original index, node, fusion or None): each anchor
    replaced by its fused node, absorbed nodes gone."""
    by_anchor = {f.anchor: f for f in fusions}
    absorbed = {i for f in fusions for i in f.absorbed}
    out = []
    for k, node in enumerate(nodes):
        if k in absorbed:
            continue
        f = by_anchor.get(k)
        out.append((k, node, None) if f is None else (k, f.node, f))
    return out
