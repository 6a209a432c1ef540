"""Fusions decided at session creation: elementwise chains folded into the Conv or MatMul before them.

Models spend much of their time in the elementwise passes after each Conv or MatMul.  With
pre-packing on:

* a Conv's BatchNormalization and per-channel ``Mul/Add/Sub/Div`` by constants fold into its
  packed weight (``W' = W * scale / sqrt(var + eps)``) and a per-channel shift; the
  activations after it (:func:`match_activation`: Relu, Clip, HardSwish in both spellings,
  HardSigmoid, LeakyRelu, Max/Min by a constant, Sigmoid, SiLU, scalar affines, exact GELU), one
  residual ``Add`` and the activations after that run in place on the Conv's fresh output, in one
  pass (``FusedConv``);
* a MatMul by a constant matrix takes its bias ``Add``, activations and residual the same way
  (``FusedMatMul``);
* a ``MatMulNBits`` takes its bias ``Add`` as its bias input and the activations after it (the
  SiLU of a gate projection) as an in-place epilogue; a gate chain whose result is multiplied by
  another ``MatMulNBits`` of the same input (the gated MLP of Llama/Qwen-family decoders:
  ``Mul(SiLU(gate(x)), up(x))``) runs as one step with both weights (``nbits_gated``);
* ``Add/Sum/Sub/Mul -> Relu`` clamps in place, and ``BatchNormalization -> Relu`` when the BN is not
  folded into a Conv (its statistics fed at run time);
* a QuantizeLinear → DequantizeLinear pair of the same scale and zero point ("fake quantization",
  what ``onnxruntime.quantization``'s QDQ format puts around every activation) runs as one float
  kernel (``fake_quant``: divide, round, clamp to the integer range shifted by the zero point,
  multiply, never materializing the integers), whose results are the pair's bit for bit;
* in a Conv or MatMul chain, a per-tensor pair is an activation like the others
  (:func:`match_activation`), and in a Conv chain a BatchNormalization after an activation (a QDQ
  model's ``Conv → Q → DQ → BatchNormalization → Q → DQ``, which cannot fold into the weight) is
  a per-channel step ``x * A + B`` of the epilogue: a QDQ ResNet block runs as its Convs'
  epilogues, one pass each, as the float model does, with the unfused nodes' bits.

Before the finders run, the compile step reads through ``Identity`` nodes (:func:`identity_aliases`,
onnxruntime's Identity elimination), so an Identity between two links does not end a chain.

The folded weight is an ordinary pre-packed weight of ``W``: its key includes a digest of the
folded constants, so it is saved, mapped and shared like any other, and a changed statistic is a
different key.  The graph itself is never rewritten: the saved model is the original one, and
each compile re-derives the fusions from it.  :func:`plan_fusions` is pure: it returns
:class:`Fusion` records (which nodes collapse into which, and the arguments of the kernel that
runs them); the resolver turns a record into a kernel.  A chain stops at any name read by
anything else or that is a graph output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from onnxpack._frozen import fast_init
from onnxpack.graph._proto import AttributeProto, NodeProto, get_attribute_value
from onnxpack.session.kernels._act import Activation

__all__ = ["ConvFusion", "Fusion", "MatMulFusion", "apply_fusions", "bn_fold", "find_conv_fusions",
           "find_attention_chains", "find_fake_quant_fusions", "find_gated_nbits", "find_matmul_fusions", "find_nbits_fusions",
           "find_relu_fusions", "fused_node", "group_sibling_matmuls", "identity_aliases", "inputs_index", "match_activation",
           "nodes_with_index", "passes_through", "plan_fusions", "read_through"]


@fast_init
@dataclasses.dataclass(frozen=True)
class Fusion:
    """A chain of nodes that runs as one kernel.

    ``node`` stands for the chain (the anchor's inputs, the chain's last output); it replaces the
    node at index ``anchor`` and the nodes at ``absorbed`` are dropped.  ``kernel`` names the
    fused kernel (``register_fused``) built with ``params``; ``None`` keeps the anchor's own
    kernel, and ``epilogue`` (activations) then runs on that kernel's fresh output in place.
    """

    node: NodeProto
    anchor: int
    absorbed: tuple[int, ...]
    kernel: str | None = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    epilogue: tuple[Activation, ...] = ()


@fast_init
@dataclasses.dataclass(frozen=True)
class ConvFusion:
    """One Conv with the chain after it folded in (indices into the nodes).

    ``bn``: a BatchNormalization folded into the weight; ``folds``: per-channel
    ``(op, constant name)`` Mul/Add/Sub/Div folded the same way (before any activation);
    ``pre``: activations; ``residual``: the name added next (a residual connection); ``post``:
    activations after it; ``nodes``: every absorbed node; ``output``: the chain's last output.
    ``relu`` is the index of a lone Relu (the simple Conv -> BN -> Relu case), for reports.
    ``channels``: the BatchNormalizations met after an activation (a fake-quant pair, ...),
    which cannot fold into the weight; ``Activation("channel", k)`` in ``pre``/``post`` stands
    for ``channels[k]``.
    """

    conv: int
    bn: int | None
    relu: int | None
    folds: tuple[tuple[str, str], ...] = ()
    pre: tuple[Activation, ...] = ()
    residual: str | None = None
    post: tuple[Activation, ...] = ()
    nodes: tuple[int, ...] = ()
    output: str = ""
    channels: tuple[int, ...] = ()

    @property
    def absorbed(self) -> tuple[int, ...]:
        if self.nodes:
            return self.nodes
        return tuple(i for i in (self.bn, self.relu) if i is not None)


class ConstMeta(NamedTuple):
    """A constant's shape and dtype, known without computing its value."""

    shape: tuple[int, ...]
    dtype: np.dtype


def _meta_from(const_value: Callable[[str], np.ndarray | None]) -> Callable[[str], ConstMeta | None]:
    def meta(name: str) -> ConstMeta | None:
        v = const_value(name)
        return None if v is None else ConstMeta(tuple(v.shape), v.dtype)
    return meta


class _Nodes(list):
    """A scope's nodes with their input index built once (:func:`plan_fusions` runs several
    finders over the same nodes; protobuf field reads make each index pass cost ~1 ms on a
    300-node decoder), or given by a caller that has it (:func:`nodes_with_index`)."""

    by_input: dict[str, list[int]] | None = None


def passes_through(node: NodeProto, ins: Sequence[str], outs: Sequence[str]) -> bool:
    """Whether ``node`` (its input and output names ``ins``, ``outs``) returns its first input as
    its one output: an ``Identity``, or an inference ``Dropout`` (no mask asked for, no
    ``training_mode`` input: what its kernel and onnxruntime's Dropout elimination take as an
    identity)."""
    if node.domain not in ("", "ai.onnx") or not ins or not ins[0] or not outs or not outs[0]:
        return False
    if node.op_type == "Identity":
        return len(ins) == 1 and len(outs) == 1
    if node.op_type == "Dropout":
        return (len(ins) < 3 or not ins[2]) and (len(outs) == 1 or not outs[1])
    return False


def identity_aliases(nodes: Sequence[NodeProto], ins: Sequence[Sequence[str]], outs: Sequence[Sequence[str]],
                     pinned: set[str], holders: set[int]) -> dict[str, str]:
    """The ``Identity`` nodes (and inference ``Dropout`` nodes: :func:`passes_through`) a scope can
    do without, as output name -> the name its readers read instead (an Identity of an Identity
    reads through both); ``ins`` / ``outs``: each node's input and output names.

    onnxruntime removes them before fusing (its Identity elimination); so must we, or a chain with
    one in it stops there: Paddle's exporter writes an Identity after most adds (an SE block's
    ``Conv -> Add -> Identity -> Relu`` ran as a fused Conv and two more steps, each ~10-40 us of
    Python on a cache the convolutions had just flushed).  An Identity stays when its output
    keeps its name for someone: ``pinned`` (graph outputs, names subgraphs read) or a node in
    ``holders`` (nodes with subgraphs, left as the model wrote them) reading it.  A reader then
    gets the object the Identity would have returned (it returns its input)."""
    candidates: dict[str, str] = {}
    for k, node in enumerate(nodes):
        if passes_through(node, ins[k], outs[k]) and outs[k][0] not in pinned and k not in holders:
            candidates[outs[k][0]] = ins[k][0]
    if not candidates:
        return {}
    for k in holders:
        for name in ins[k]:
            candidates.pop(name, None)
    aliases: dict[str, str] = {}
    for out in candidates:
        src, seen = candidates[out], {out}
        while src in candidates and src not in seen:  # (a cycle is not a valid graph: left as it is)
            seen.add(src)
            src = candidates[src]
        if src not in candidates:
            aliases[out] = src
    return aliases


def read_through(node: NodeProto, aliases: Mapping[str, str]) -> NodeProto:
    """``node`` reading through ``aliases`` (:func:`identity_aliases`): a copy with those inputs
    renamed, or the node itself when it reads none (the model's own nodes are never changed)."""
    names = node.input[:]
    if not any(n in aliases for n in names):
        return node
    copy = NodeProto()
    copy.CopyFrom(node)
    del copy.input[:]
    copy.input.extend([aliases.get(n, n) for n in names])
    return copy


def nodes_with_index(nodes: Sequence[NodeProto], by_input: dict[str, list[int]]) -> Sequence[NodeProto]:
    """``nodes`` for :func:`plan_fusions` with their input index built by the caller (the compile
    step counts reads in the same pass): ``by_input`` must be what :func:`_by_input` returns,
    name -> the indices of the nodes reading it, a node once per input slot, in node order."""
    out = _Nodes(nodes)
    out.by_input = by_input
    return out


def inputs_index(ins: Sequence[Sequence[str]]) -> dict[str, list[int]]:
    """name -> indices of the nodes reading it, from ``ins[k]`` (node ``k``'s input names; a node
    once per input slot, omitted inputs skipped)."""
    by_input: dict[str, list[int]] = {}
    get = by_input.get
    for k, names in enumerate(ins):
        for name in names:
            if name:
                got = get(name)
                if got is None:
                    by_input[name] = [k]
                else:
                    got.append(k)
    return by_input


def _by_input(nodes: Sequence[NodeProto]) -> dict[str, list[int]]:
    """name -> indices of the nodes reading it (a node once per input slot)."""
    if isinstance(nodes, _Nodes) and nodes.by_input is not None:
        return nodes.by_input
    # a slice: iterating the container ends in a formatted IndexError
    by_input = inputs_index([node.input[:] for node in nodes])
    if isinstance(nodes, _Nodes):
        nodes.by_input = by_input
    return by_input


def _sole_users(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                taken: set[int]) -> Callable[[str], list[int] | None]:
    """``users_of(name)``: the nodes reading ``name`` when they are all its reads (``readers``
    counts subgraph and graph-output reads too), it is not protected and none of them is in
    ``taken`` (read at each call: the finder adds to it as it goes); else None."""
    by_input = _by_input(nodes)

    def users_of(name: str) -> list[int] | None:
        # ``by_input[name]`` holds a node once per input slot reading ``name``: its length is the
        # number of these nodes' reads of it (counting them again from the protos cost a third of
        # this function in a QDQ model's fusion planning).
        reads = by_input.get(name)
        if not reads or name in protected or readers.get(name, 0) != len(reads):
            return None
        users = [reads[0]] if len(reads) == 1 else sorted(set(reads))
        if not taken.isdisjoint(users):
            return None
        return users

    return users_of


def _match_epilogue(nodes, t: str, users_of, const_value, opset: int, is_const: Callable[[str], bool],
                    absorbed: list[int], channel: Callable[[str], tuple[Activation, tuple[int, ...], str] | None]
                    | None = None) -> tuple[list[Activation], str | None, list[Activation], str]:
    """After a GEMM or conv output ``t``: activations, one residual ``Add``/``Sum`` of a
    non-constant, activations again.  Appends the matched nodes to ``absorbed``; returns
    (activations before the residual, the residual name or None, activations after, the chain's
    last output).  ``channel(t)``, when given (a Conv's chain), matches a per-channel step
    reading ``t`` where no activation does."""
    pre: list[Activation] = []
    post: list[Activation] = []
    residual = None
    while True:
        got = match_activation(nodes, t, users_of, const_value, opset)
        if got is None and channel is not None:
            got = channel(t)
        if got is not None:
            act, idxs, t = got
            (post if residual is not None else pre).append(act)
            absorbed.extend(idxs)
            continue
        if residual is None:
            users = users_of(t)
            if users is not None and len(users) == 1:
                add = nodes[users[0]]
                other = _other_operand(add, t)
                if add.op_type in ("Add", "Sum") and add.domain in ("", "ai.onnx") and other is not None:
                    if other and not is_const(other):
                        residual = other
                        absorbed.append(users[0])
                        t = add.output[0]
                        continue
        break
    return pre, residual, post, t


def find_conv_fusions(
    nodes: Sequence[NodeProto],
    readers: dict[str, int],
    protected: set[str],
    is_const: Callable[[str], bool],
    opset: int,
    const_value: Callable[[str], np.ndarray | None] | None = None,
    const_meta: Callable[[str], ConstMeta | None] | None = None,
) -> list[ConvFusion]:
    """Fusions in ``nodes`` (pure: decided from the graph alone).

    From each Conv whose weight (and bias) are constants, the chain of single-reader nodes after
    it is followed as far as it matches, in this order: a foldable BatchNormalization;
    per-channel Mul/Add/Sub/Div by constants (folded into the weight and shift); activations
    (:func:`match_activation`: Relu, Clip, HardSwish and its Add/Clip/Mul/Div spelling,
    HardSigmoid, LeakyRelu, Sigmoid, Sigmoid*x = SiLU) and scalar affines; then one residual Add
    of a non-constant, then activations again.

    Args:
        nodes: the scope's nodes.
        readers: name -> number of reads (node inputs, subgraph free names, graph outputs).
        protected: names that must stay materialized (graph outputs).
        is_const: whether a name is a constant of the scope (initializer, not overridable).
        opset: the default domain's opset.
        const_value: the value of a constant (for the shapes and values of folded constants and
            activation bounds); without it only BatchNormalization and Relu fuse.
        const_meta: a constant's shape and dtype without computing it (default: from
            ``const_value``).
    """
    if const_value is None:
        const_value = lambda n: None  # noqa: E731
    const_meta = const_meta or _meta_from(const_value)
    taken: set[int] = set()
    users_of = _sole_users(nodes, readers, protected, taken)

    def sole_reader(name: str, op_type: str) -> int | None:
        users = users_of(name)
        if users is None or len(users) != 1:
            return None
        k = users[0]
        node = nodes[k]
        if node.op_type != op_type or node.domain not in ("", "ai.onnx") or node.input[:].count(name) != 1:
            return None
        return k

    out: list[ConvFusion] = []
    for k, node in enumerate(nodes):
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        if not is_const(node.input[1]) or (len(node.input) > 2 and node.input[2] and not is_const(node.input[2])):
            continue
        w = const_meta(node.input[1])
        m = None if w is None or len(w.shape) < 3 else int(w.shape[0])
        rank = None if w is None else len(w.shape)
        absorbed: list[int] = []
        t = node.output[0]
        bn = sole_reader(t, "BatchNormalization")
        if bn is not None and _foldable_bn(nodes[bn], is_const, opset):
            absorbed.append(bn)
            t = nodes[bn].output[0]
        else:
            bn = None
        folds: list[tuple[str, str]] = []
        while m is not None:
            f = _match_channel_fold(nodes, t, users_of, const_value, m, rank)
            if f is None:
                break
            idx, op, cname = f
            folds.append((op, cname))
            absorbed.append(idx)
            t = nodes[idx].output[0]
        channels: list[int] = []

        def channel(name: str) -> tuple[Activation, tuple[int, ...], str] | None:
            # A BatchNormalization after an activation: per-channel x * A + B in the epilogue.
            i = sole_reader(name, "BatchNormalization")
            if i is None or m is None or not _foldable_bn(nodes[i], is_const, opset):
                return None
            channels.append(i)
            return Activation("channel", float(len(channels) - 1)), (i,), nodes[i].output[0]

        pre, residual, post, t = _match_epilogue(nodes, t, users_of, const_value, opset, is_const, absorbed, channel)
        if not absorbed:
            continue
        taken.update(absorbed)
        taken.add(k)
        relu = None
        if pre == [Activation("relu")] and residual is None and not folds:
            relu = next(i for i in absorbed if nodes[i].op_type == "Relu")
        out.append(ConvFusion(k, bn, relu, tuple(folds), tuple(pre), residual, tuple(post), tuple(absorbed), t,
                              tuple(channels)))
    return out


def _other_operand(node: NodeProto, name: str) -> str | None:
    """The other input of a two-input ``node`` that reads ``name`` once, else None (a hostile or
    malformed node may hold one input, or three)."""
    ins = node.input[:]
    if len(ins) != 2 or ins.count(name) != 1:
        return None
    return ins[1] if ins[0] == name else ins[0]


def _scalar(v: np.ndarray | None) -> float | None:
    if v is None or v.size != 1 or v.dtype.kind != "f":
        return None
    return float(v.reshape(()))


def _match_channel_fold(nodes, t, users_of, const_value, m: int, rank: int | None):
    """``Mul/Add/Sub/Div(t, C)`` (``C`` per output channel or scalar, float): (index, op, C name)."""
    users = users_of(t)
    if users is None or len(users) != 1:
        return None
    node = nodes[users[0]]
    other = _other_operand(node, t)
    if node.op_type not in ("Mul", "Add", "Sub", "Div") or node.domain not in ("", "ai.onnx") or other is None:
        return None
    if node.op_type in ("Sub", "Div") and node.input[0] != t:
        return None
    c = const_value(other) if other else None
    if c is None or c.dtype.kind != "f" or rank is None or c.ndim > rank:
        return None
    shape = (1,) * (rank - c.ndim) + tuple(c.shape)
    if shape[0] != 1 or shape[1] not in (1, m) or any(d != 1 for d in shape[2:]):
        return None
    return users[0], node.op_type, other


def _match_gelu(nodes, t, users, users_of, const_value):
    """``Mul(Mul(t, Add(Erf(Div(t, sqrt 2)), 1)), 0.5)`` (torch's exact GELU export; also with
    ``Mul(t, 1/sqrt 2)`` and the 0.5 applied to ``t`` first)."""
    ops = [nodes[u] for u in users]
    scale = next(((u, n) for u, n in zip(users, ops) if n.op_type in ("Div", "Mul") and len(n.input) == 2
                  and _scalar(const_value(n.input[1] if n.input[0] == t else n.input[0])) is not None
                  and (n.op_type == "Mul" or n.input[0] == t)), None)
    if scale is None:
        return None
    si, sn = scale
    k = _scalar(const_value(sn.input[1] if sn.input[0] == t else sn.input[0]))
    inv = k if sn.op_type == "Mul" else 1.0 / k
    if abs(inv - 0.7071067811865476) > 1e-6:
        return None
    other = [(u, n) for u, n in zip(users, ops) if u != si]
    if len(other) != 1 or other[0][1].op_type != "Mul":
        return None
    mi, mul = other[0]

    def only(name, op):
        us = users_of(name)
        if us is None or len(us) != 1 or nodes[us[0]].op_type != op or nodes[us[0]].domain not in ("", "ai.onnx"):
            return None
        return us[0]

    ei = only(sn.output[0], "Erf")
    if ei is None:
        return None
    ai = only(nodes[ei].output[0], "Add")
    if ai is None:
        return None
    add = nodes[ai]
    one = _other_operand(add, nodes[ei].output[0])
    if one is None or _scalar(const_value(one)) != 1.0:
        return None
    e1 = add.output[0]
    if sorted(mul.input) == sorted([t, e1]):
        # 0.5 applied last: Mul(Mul(t, e1), 0.5)
        if users_of(e1) != [mi]:
            return None
        hi = only(mul.output[0], "Mul")
        if hi is None:
            return None
        h = nodes[hi]
        half = _other_operand(h, mul.output[0])
        if half is None or _scalar(const_value(half)) != 0.5:
            return None
        return Activation("gelu", 1.0), (si, ei, ai, mi, hi), h.output[0]  # a = 1: the 0.5 last
    # 0.5 applied to t first: Mul(Mul(t, 0.5), e1)
    half = _other_operand(mul, t)
    if half is None or _scalar(const_value(half)) != 0.5:
        return None
    fi = only(mul.output[0], "Mul")
    if fi is None or sorted(nodes[fi].input) != sorted([mul.output[0], e1]) or users_of(e1) != [fi]:
        return None
    return Activation("gelu"), (si, ei, ai, mi, fi), nodes[fi].output[0]


def match_activation(nodes, t, users_of, const_value, opset):
    """The activation reading ``t`` (its only readers), as ``(Activation, node indices, output)``.

    Recognized: Relu; Clip with constant bounds (attributes before opset 11); HardSwish;
    HardSigmoid; LeakyRelu; Sigmoid; ``Mul(t, Sigmoid(t))`` (SiLU) and Swish-24 with alpha 1;
    Gelu-20 (exact); ``Div(Mul(t, Clip(Add(t, 3),
    0, 6)), 6)`` (HardSwish as Paddle and TF export it, also with ``Mul(., 1/6)``); and
    ``Mul/Add/Sub/Div`` by a float scalar constant (an affine step); ``Max/Min`` with a float
    scalar constant (a one-sided clip, as TensorFlow exports write it); torch's exact GELU
    (``x * (erf(x / sqrt 2) + 1) * 0.5``, see :func:`_match_gelu`) and onnxruntime's
    ``com.microsoft`` Gelu, FastGelu (without its bias input) and QuickGelu.
    """
    users = users_of(t)
    if users is None:
        return None
    ops = [nodes[u] for u in users]
    attrs = lambda n: {a.name: get_attribute_value(a) for a in n.attribute[:]}  # noqa: E731
    if len(ops) == 1 and ops[0].domain == "com.microsoft" and ops[0].op_type in ("Gelu", "FastGelu", "QuickGelu"):
        # onnxruntime's exact, tanh and sigmoid GELUs (its transformer optimizer's fusions):
        # float32 arithmetic, one rounding to the input's dtype, as the fused epilogue computes them.
        n = ops[0]
        if len(n.input) == 1 and n.input[0] == t and sole_output(n):
            if n.op_type == "QuickGelu":
                act = Activation("quickgelu", float(attrs(n).get("alpha", 1.702)))
            else:
                act = Activation("gelu" if n.op_type == "Gelu" else "fastgelu")
            return act, (users[0],), sole_output(n)
        return None
    if any(n.domain not in ("", "ai.onnx") for n in ops) and not (
            len(ops) == 1 and ops[0].domain == "com.microsoft" and ops[0].op_type == "QuantizeLinear"):
        return None  # (onnxruntime's contrib QuantizeLinear: a fake-quant pair below, as the default domain's)
    if len(users) == 1:
        n = ops[0]
        ins = tuple(n.input[:])
        if ins.count(t) != 1 or ins[0] != t and n.op_type not in ("Mul", "Add", "Max", "Min"):
            return None
        out = sole_output(n)
        if not out:
            return None
        if n.op_type == "Relu":
            return Activation("relu"), (users[0],), out
        if n.op_type == "QuantizeLinear":
            dq = users_of(out)
            if dq is None or len(dq) != 1:
                return None
            got = _fake_quant_pair(n, nodes[dq[0]], const_value, opset)
            if got is None or got[3].size != 1 or got[4].size != 1:  # per tensor: scalar parameters
                return None
            _axis, lo, hi, scale, zp = got
            z = float(zp.reshape(-1)[0])
            return (Activation("fakequant", float(scale.reshape(-1)[0]), lo - z, hi - z), (users[0], dq[0]),
                    nodes[dq[0]].output[0])
        if n.op_type == "Clip":
            # (a missing bound is float32's largest finite value, as the Clip kernel takes it: an
            # epilogue runs on float32 sums)
            if opset < 11:
                a = attrs(n)
                lo, hi = float(a.get("min", -_FLT_MAX)), float(a.get("max", _FLT_MAX))
            else:
                lo, hi = -_FLT_MAX, _FLT_MAX
                if len(n.input) > 1 and n.input[1]:
                    lo = _scalar(const_value(n.input[1]))
                if len(n.input) > 2 and n.input[2]:
                    hi = _scalar(const_value(n.input[2]))
                if lo is None or hi is None:
                    return None
            return Activation("clip", lo, hi), (users[0],), out
        if n.op_type == "HardSwish":
            return Activation("hardswish", 1.0 / 6.0, 0.5), (users[0],), out
        if n.op_type == "HardSigmoid":
            a = attrs(n)
            return Activation("hardsigmoid", float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))), (users[0],), out
        if n.op_type == "LeakyRelu":
            return Activation("leakyrelu", float(attrs(n).get("alpha", 0.01))), (users[0],), out
        if n.op_type == "Sigmoid":
            return Activation("sigmoid"), (users[0],), out
        if n.op_type == "Swish" and opset >= 24 and float(attrs(n).get("alpha", 1.0)) == 1.0:
            return Activation("silu"), (users[0],), out  # torch's SiLU as the opset-24 op
        if n.op_type == "Gelu" and opset >= 20 and attrs(n).get("approximate", "none") in ("none", b"none"):
            return Activation("gelu"), (users[0],), out  # torch's exact GELU as the opset-20 op
        if n.op_type in ("Max", "Min") and len(ins) == 2:  # TF exports' bounds: Max(x, c)
            other = _other_operand(n, t)
            k = _scalar(const_value(other)) if other else None
            if k is None or np.isnan(k):
                return None
            return (Activation("clip", k, np.inf) if n.op_type == "Max" else Activation("clip", -np.inf, k)), (users[0],), out
        if n.op_type in ("Mul", "Add", "Sub", "Div") and len(ins) == 2:
            other = _other_operand(n, t)
            k = _scalar(const_value(other)) if other else None
            if k is None:
                return None
            if n.op_type == "Mul":
                return Activation("affine", k, 0.0), (users[0],), out
            if n.op_type == "Add":
                return Activation("affine", 1.0, k), (users[0],), out
            if n.op_type == "Sub":
                return Activation("affine", 1.0, -k), (users[0],), out
            if k != 0.0:
                return Activation("affine", 1.0 / k, 0.0), (users[0],), out
        return None
    if len(users) != 2:
        return None
    by_op = {n.op_type: (u, n) for u, n in zip(users, ops)}
    if set(by_op) == {"Sigmoid", "Mul"}:
        (si, sig), (mi, mul) = by_op["Sigmoid"], by_op["Mul"]
        s = sig.output[0]
        if sig.input[0] == t and sorted(mul.input) == sorted([t, s]) and users_of(s) == [mi]:
            return Activation("silu"), (si, mi), mul.output[0]
        return None
    gelu = _match_gelu(nodes, t, users, users_of, const_value)
    if gelu is not None:
        return gelu
    if set(by_op) == {"Add", "Mul"}:
        (ai, add), (mi, mul) = by_op["Add"], by_op["Mul"]
        three = _other_operand(add, t)
        if three is None or _scalar(const_value(three)) != 3.0:
            return None
        cu = users_of(add.output[0])
        if cu is None or len(cu) != 1 or nodes[cu[0]].op_type != "Clip":
            return None
        clip = nodes[cu[0]]
        if opset < 11:
            a = attrs(clip)
            lo, hi = float(a.get("min", -np.inf)), float(a.get("max", np.inf))
        else:
            lo = _scalar(const_value(clip.input[1])) if len(clip.input) > 1 and clip.input[1] else None
            hi = _scalar(const_value(clip.input[2])) if len(clip.input) > 2 and clip.input[2] else None
        if (lo, hi) != (0.0, 6.0) or sorted(mul.input) != sorted([t, clip.output[0]]):
            return None
        if users_of(clip.output[0]) != [mi]:
            return None
        du = users_of(mul.output[0])
        if du is None or len(du) != 1:
            return None
        last = nodes[du[0]]
        if last.domain not in ("", "ai.onnx") or len(last.input) != 2 or last.input[0] != mul.output[0]:
            return None
        k = _scalar(const_value(last.input[1]))
        if not ((last.op_type == "Div" and k == 6.0) or (last.op_type == "Mul" and k is not None
                                                        and abs(k - 1.0 / 6.0) < 1e-7)):
            return None
        return Activation("hardswish", 1.0 / 6.0, 0.5), (ai, cu[0], mi, du[0]), last.output[0]
    return None


@fast_init
@dataclasses.dataclass(frozen=True)
class MatMulFusion:
    """A MatMul by a constant 2-D weight with its bias Add, activations and residual folded in."""

    matmul: int
    bias: str | None
    pre: tuple[Activation, ...]
    residual: str | None
    post: tuple[Activation, ...]
    nodes: tuple[int, ...]
    output: str


_NIBBLE_TYPES = ("int4", "uint4")



def group_sibling_matmuls(nodes: Sequence[NodeProto], fusions: list[Fusion], taken: set[int],
                          const_meta: Callable[[str], ConstMeta | None]) -> list[Fusion]:
    """``fusions`` with the MatMuls that multiply one activation by constant float32 weights of
    one K (a transformer layer's query, key and value projections, exported as three MatMuls,
    each perhaps fused with its bias and activations: ``kernel="matmul"`` without a residual)
    joined into one ``kernel="matmul_group"`` fusion: inputs ``A, B_1 .. B_n``, outputs the
    members' outputs, ``params`` each member's ``(bias, pre, post)`` and name, anchored at the
    first member (its inputs are A and constants, so the group cannot close a cycle).  The
    members' nodes join ``taken``."""
    by_a: dict[str, list[tuple[int, Fusion | None, NodeProto]]] = {}
    for f in fusions:
        if f.kernel == "matmul" and not f.params.get("residual") and len(f.node.input) == 2 and f.node.input[0]:
            by_a.setdefault(f.node.input[0], []).append((f.anchor, f, f.node))
    for k, node in enumerate(nodes):
        if k in taken or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        ins = node.input[:]
        if len(ins) == 2 and ins[0] and sole_output(node) and len(node.output) == 1:
            by_a.setdefault(ins[0], []).append((k, None, node))
    grouped: set[int] = set()  # ids of the member fusions
    groups: list[Fusion] = []
    for a, cands in by_a.items():
        by_k: dict[int, list[tuple[int, Fusion | None, NodeProto]]] = {}
        for k, f, node in cands:
            meta = const_meta(node.input[1])
            if meta is not None and len(meta.shape) == 2 and meta.dtype == np.float32 and node.input[1] != a:
                by_k.setdefault(int(meta.shape[0]), []).append((k, f, node))
        for members in by_k.values():
            if len(members) < 2:
                continue
            members.sort(key=lambda m: m[0])
            node = NodeProto()
            node.op_type = "MatMul"
            node.name = "+".join(n.name or f"#{k}" for k, _f, n in members)
            node.input.extend([a, *(n.input[1] for _k, _f, n in members)])
            node.output.extend([n.output[0] for _k, _f, n in members])
            specs = tuple((None, (), ()) if f is None else (f.params["bias"], f.params["pre"], f.params["post"])
                          for _k, f, _n in members)
            absorbed = tuple(i for j, (k, f, _n) in enumerate(members)
                             for i in ((k,) if j else ()) + (f.absorbed if f is not None else ()))
            groups.append(Fusion(node, members[0][0], absorbed, kernel="matmul_group",
                                 params={"members": specs, "names": tuple(n.name for _k, _f, n in members)}))
            grouped.update(id(f) for _k, f, _n in members if f is not None)
            taken.update(k for k, _f, _n in members)
            taken.update(absorbed)
    return [f for f in fusions if id(f) not in grouped] + groups


# Ops whose output has their first input's shape, and the elementwise ops that broadcast theirs
# (for _shape_of: what onnxruntime's shape inference knows where a fusion of its depends on it).
_SAME_SHAPE = frozenset({"Relu", "Sigmoid", "Tanh", "Clip", "LeakyRelu", "Cast", "Identity", "Dropout", "Erf", "Gelu",
                         "Softmax", "LogSoftmax", "LayerNormalization", "Neg", "Abs", "Sqrt", "Exp", "Log", "HardSigmoid",
                         "HardSwish", "Elu", "Selu", "Softplus", "Softsign", "PRelu", "QuantizeLinear",
                         "DequantizeLinear", "BatchNormalization", "InstanceNormalization", "Floor", "Ceil", "Round"})
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean"})
_SHAPE_DEPTH = 48  # producers _shape_of follows up from a value


def _shape_of(name: str, nodes: Sequence[NodeProto], producer: dict[str, int], declared: Callable[[str], tuple | None],
              const_meta: Callable[[str], ConstMeta | None], memo: dict[str, tuple | None], depth: int = 0) -> tuple | None:
    """The shape of ``name`` as far as it is known without running the model: declared (a graph
    input or value_info: ints, symbolic names, None for unknown), a constant's, or carried through
    the ops above from those, at most ``_SHAPE_DEPTH`` producers up (None: unknown; a chain of
    thousands of nodes is a valid model, past Python's stack)."""
    if name in memo:
        return memo[name]
    if depth > _SHAPE_DEPTH:
        return None
    memo[name] = None  # (a cycle, in an invalid graph: unknown)
    got = declared(name)
    if got is None:
        meta = const_meta(name)
        if meta is not None:
            got = tuple(meta.shape)
    k = producer.get(name) if got is None else None
    if k is not None:
        node = nodes[k]
        op, ins = node.op_type, node.input[:]
        shapes = [_shape_of(i, nodes, producer, declared, const_meta, memo, depth + 1) if i else None for i in ins]
        if op in _SAME_SHAPE and node.output[0] == name and shapes and shapes[0] is not None:
            got = shapes[0]
        elif op in _BROADCAST and shapes and all(s is not None for s in shapes):
            rank = max(len(s) for s in shapes)
            dims = []
            for j in range(rank):
                col = [s[len(s) - rank + j] for s in shapes if len(s) - rank + j >= 0]
                known = {d for d in col if d != 1}
                dims.append(known.pop() if len(known) == 1 else (1 if not known else None))
            got = tuple(dims)
        elif op == "MatMul" and len(shapes) == 2 and shapes[0] is not None and shapes[1] is not None \
                and len(shapes[1]) == 2 and len(shapes[0]) >= 2:
            got = shapes[0][:-1] + shapes[1][-1:]
        elif op == "Flatten" and shapes and shapes[0] is not None:
            got = (None, None)
    memo[name] = got
    return got


def declared_shapes(graph) -> dict[str, tuple]:
    """name -> declared shape of a graph's inputs, outputs and value_info entries (dims as ints,
    symbolic names, or None: a dim without either, or a legacy -1)."""
    out: dict[str, tuple] = {}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value >= 0
                                 else (d.dim_param or None) for d in tt.shape.dim)
    return out


def _clip_group(nodes: Sequence[NodeProto], name: str, by_input: dict[str, list[int]], protected: set[str]) -> bool:
    """Whether ``name``'s one reader is a Relu or Clip with one reader of its own, not a graph
    output: onnxruntime's QDQ "redundant clip" node group (GetQDQSelection) with the producer of
    ``name``, which no DequantizeLinear -> MatMul rewrite takes."""
    after = by_input.get(name, ())
    if len(after) != 1 or nodes[after[0]].op_type not in ("Relu", "Clip"):
        return False
    clip_out = nodes[after[0]].output[:1]
    return bool(clip_out) and clip_out[0] not in protected and len(by_input.get(clip_out[0], ())) == 1


def _gemm_bias_ok(bias: tuple, a: tuple, n: int) -> bool:
    """Whether onnxruntime's MatMulAddFusion takes ``bias`` as a Gemm's C for a 2-D A of shape
    ``a``: (N), (1, N), or (A's rows, 1 or N), dims compared as declared."""
    if len(bias) == 1:
        return bias[0] == n
    return len(bias) == 2 and ((bias[0] == 1 and bias[1] == n)
                               or (bias[0] is not None and bias[0] == a[0] and bias[1] in (1, n)))


def find_dq_matmul_nbits(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                         const_meta: Callable[[str], ConstMeta | None], taken: set[int],
                         accuracy_level: int, declared: Callable[[str], tuple | None] | None = None) -> list[Fusion]:
    """``MatMul(A, DequantizeLinear(W, scale[, zero point]))`` with a constant 4-bit ``W``
    quantized in blocks along K (``axis`` 0, ``block_size`` a power of two >= 16): one
    ``MatMulNBits`` step (pure), as onnxruntime's QDQ transformer rewrites the pair; a Gemm that
    is such a MatMul (alpha 1, no transposes; beta 1 and a C of N values, MatMulNBits' bias) too.
    Not where onnxruntime's node groups keep it float: an 8-bit QDQ group (below), or a MatMul
    whose one reader is a Relu or Clip with one reader that is not a graph output (that group's
    clip is made redundant by a QuantizeLinear or not at all; neither is rewritten).

    Why: the pair is how QDQ-format int4 LLMs store their projections (onnxruntime-genai's builder
    with ``use_qdq``, the weight-only quantizer's QDQ format).  Folding the DequantizeLinear into
    a float pack held 8x the int4 bytes; the MatMulNBits kernel keeps them 4-bit and, like
    onnxruntime, takes the session's ``session.qdq_matmulnbits_accuracy_level`` (``accuracy_level``
    here; onnxruntime's default 4 quantizes the activations to int8 where the int4 GEMV does).

    The fused node reads ``W``, the scales and the zero points as the model stores them ((K, N),
    (K / block, N)); kernel ``dq_nbits`` packs them into MatMulNBits' layout (a uint4 weight
    without zero points gets zero points of 0 there, as onnxruntime's rewrite gives it)."""
    used = set(taken)
    users_of = _sole_users(nodes, readers, protected, used)
    out: list[Fusion] = []
    by_input = _by_input(nodes)
    shape_memo: dict[str, tuple | None] = {}
    producer: dict[str, int] | None = None  # output -> node index, made when a shape is asked

    def eight_bit(q: NodeProto) -> bool:
        """Whether a QuantizeLinear / DequantizeLinear works on 8-bit codes (its zero point's type,
        else QuantizeLinear's output_dtype; unknown counts as 8-bit)."""
        qins = q.input[:]
        meta = const_meta(qins[2]) if len(qins) > 2 and qins[2] else None
        if meta is not None:
            return meta.dtype.name in ("int8", "uint8")
        od = int(_attrs(q).get("output_dtype", 0)) if q.op_type == "QuantizeLinear" else 0
        return od in (0, 2, 3)  # (unset: uint8 without a zero point; UINT8, INT8)

    # The MatMuls and Gemms first, then the DequantizeLinear producing each one's B: a QDQ CNN has
    # hundreds of DequantizeLinear nodes and one Gemm (walking the former cost ~0.6 ms a create).
    outputs_of_dq: dict[str, int] = {}
    products: list[int] = []
    for i, node in enumerate(nodes):
        op = node.op_type
        if op == "DequantizeLinear":
            outs = node.output[:1]
            if outs and outs[0]:
                outputs_of_dq[outs[0]] = i
        elif op == "MatMul" or op == "Gemm":
            products.append(i)
    for k in products:
        mm = nodes[k]
        mins = mm.input[:]
        d = outputs_of_dq.get(mins[1]) if len(mins) > 1 else None
        if d is None or d in used or k in used:
            continue
        dq = nodes[d]
        if dq.domain not in ("", "ai.onnx", "com.microsoft"):
            continue
        ins = dq.input[:]
        if len(ins) < 2 or not ins[0] or not ins[1]:
            continue
        users = users_of(dq.output[0])
        if users is None or users != [k]:
            continue
        if (mm.domain not in ("", "ai.onnx") or len(mm.output) != 1 or mins[0] == dq.output[0]
                or len(mins) != 2 and mm.op_type == "MatMul" or len(mins) > 3):
            continue
        bias = mins[2] if len(mins) > 2 and mins[2] else ""
        if mm.op_type == "Gemm" and not _gemm_is_matmul(mm, bias):
            continue
        # onnxruntime's QDQ node groups: a MatMul in a clip group stays float there.
        if _clip_group(nodes, mm.output[0], by_input, protected):
            continue
        after = by_input.get(mm.output[0], ())
        if len(after) == 1 and mm.op_type == "MatMul" and nodes[after[0]].op_type == "Add" and \
                mm.output[0] not in protected and declared is not None:
            if producer is None:
                producer = {o: j for j, node in enumerate(nodes) for o in node.output[:] if o}
            if not _stays_matmul(nodes, after[0], mm, by_input, protected, declared, const_meta, shape_memo, producer):
                continue
        # onnxruntime's rule: a MatMul of an 8-bit QDQ group (its activation dequantized from 8-bit
        # codes, or an 8-bit QuantizeLinear reading its result) is left to the 8-bit QDQ rules and
        # runs in float there (quantize_static's int4 block weights with 8-bit activations: with
        # the int8 activations of accuracy level 4 its outputs moved by a step); with 16-bit ones
        # it is still rewritten (measured, onnxruntime 1.32: /work/tmp/s65/helperB).
        a_d = outputs_of_dq.get(mins[0])
        a_dq = None if a_d is None else nodes[a_d]
        if ((a_dq is not None and eight_bit(a_dq))
                or any(nodes[j].op_type == "QuantizeLinear" and eight_bit(nodes[j]) for j in by_input.get(mm.output[0], ()))):
            continue
        attrs = _attrs(dq)
        bs = attrs.get("block_size", 0)
        w, sc = const_meta(ins[0]), const_meta(ins[1])
        zp = const_meta(ins[2]) if len(ins) > 2 and ins[2] else None
        if (w is None or sc is None or len(w.shape) != 2 or w.dtype.name not in _NIBBLE_TYPES
                or attrs.get("axis", 1) not in (0, -2) or bs < 16 or bs & (bs - 1)):
            continue
        kdim, n = (int(v) for v in w.shape)
        nb = -(-kdim // bs)
        if (sc.dtype.name not in ("float32", "float16") or tuple(sc.shape) != (nb, n)
                or (len(ins) > 2 and ins[2] and (zp is None or zp.dtype != w.dtype or tuple(zp.shape) != (nb, n)))
                or kdim < 1 or n < 1):
            continue
        if bias:  # (a Gemm's C: MatMulNBits' bias input, of N values)
            meta = const_meta(bias)
            if meta is None or tuple(meta.shape) != (n,):
                continue
        node = NodeProto()
        node.op_type, node.domain = "MatMulNBits", "com.microsoft"
        node.name = mm.name  # reports and logs name the weight's reader
        node.input.extend([mins[0], ins[0], ins[1], ins[2] if zp is not None else ""] + (["", bias] if bias else []))
        node.output.extend([mm.output[0]])
        for name, value in (("K", kdim), ("N", n), ("bits", 4), ("block_size", bs), ("accuracy_level", accuracy_level)):
            a = node.attribute.add()
            a.name, a.type, a.i = name, AttributeProto.INT, value
        used.update((k, d))
        # A uint4 weight without zero points: onnxruntime's rewrite gives it zero points of 0
        # (MatMulNBits' default, 8, is int4's 0); the kernel makes them.
        out.append(Fusion(node, k, (d,), kernel="dq_nbits",
                          params={"zero_codes": True} if zp is None and w.dtype.name == "uint4" else {}))
    return out


def _stays_matmul(nodes: Sequence[NodeProto], add_k: int, mm: NodeProto, by_input: dict[str, list[int]],
                  protected: set[str], declared: Callable[[str], tuple | None],
                  const_meta: Callable[[str], ConstMeta | None], memo: dict, producer: dict[str, int]) -> bool:
    """Whether ``MatMul -> Add`` (the MatMul's one reader) stays a MatMul in onnxruntime's QDQ
    rewrite, or ends float there: its MatMulAddFusion (before the QDQ transformer) makes a 2-D
    A's MatMul and Add a Gemm whose C is the Add's other input, where that input is a Gemm bias
    (:func:`_gemm_bias_ok`); such a Gemm is rewritten only with a C of N values and no clip group
    after it (a Relu or Clip, its one reader, with one reader and not a graph output).  An A of
    another rank or unknown shape: no Gemm (a reshaped one's reader is a Reshape, its C must be
    of N values: the same rewrite)."""
    add = nodes[add_k]
    ains = add.input[:]
    if len(ains) != 2:
        return True
    bias = ains[1] if ains[0] == mm.output[0] else ains[0]
    a = _shape_of(mm.input[0], nodes, producer, declared, const_meta, memo)
    c = _shape_of(bias, nodes, producer, declared, const_meta, memo)
    w = _shape_of(mm.input[1], nodes, producer, declared, const_meta, memo)
    if a is None or len(a) != 2 or c is None or w is None or len(w) != 2 or not _gemm_bias_ok(c, a, w[1]):
        return True  # no Gemm there
    if tuple(c) != (w[1],):
        return False  # a Gemm whose C is not N values: float
    return not _clip_group(nodes, add.output[0], by_input, protected)  # the Gemm's clip group: float


def _gemm_is_matmul(gemm: NodeProto, bias: str) -> bool:
    """Whether a Gemm is ``A @ B (+ C)``: alpha 1, neither input transposed, beta 1 where C is
    given (onnxruntime's condition for rewriting it as MatMulNBits, 1e-6 on alpha and beta)."""
    attrs = {a.name: get_attribute_value(a) for a in gemm.attribute[:]}
    return (abs(float(attrs.get("alpha", 1.0)) - 1.0) <= 1e-6 and not int(attrs.get("transA", 0))
            and not int(attrs.get("transB", 0)) and (not bias or abs(float(attrs.get("beta", 1.0)) - 1.0) <= 1e-6))


def find_dq_gather(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                   const_meta: Callable[[str], ConstMeta | None], taken: set[int]) -> list[Fusion]:
    """``Gather(DequantizeLinear(W, scale[, zero point]), indices)`` with a constant ``W`` and a
    one-value (per-tensor) scale and zero point: one step that gathers ``W``'s codes and
    dequantizes only the gathered rows (kernel ``dq_gather``), the same values (the
    dequantization is elementwise).

    Why: onnxruntime's quantizer quantizes embedding tables this way; unfused, the
    DequantizeLinear of a table that no kernel packs runs at every run (a QDQ BERT-base's 30,522 x
    768 word embeddings: 94 MB allocated and ~6 ms a run to read 128 rows)."""
    used = set(taken)
    users_of = _sole_users(nodes, readers, protected, used)
    out: list[Fusion] = []
    for d, dq in enumerate(nodes):
        if (d in used or dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx", "com.microsoft")
                or len(dq.output) != 1 or not dq.output[0]):
            continue
        ins = dq.input[:]
        if len(ins) < 2 or not ins[0] or not ins[1] or _attrs(dq).get("block_size", 0):
            continue
        users = users_of(dq.output[0])
        if users is None or len(users) != 1:
            continue
        k = users[0]
        g = nodes[k]
        gins = g.input[:]
        if (g.op_type != "Gather" or g.domain not in ("", "ai.onnx") or len(gins) != 2 or gins[0] != dq.output[0]
                or gins[1] == dq.output[0] or len(g.output) != 1):
            continue
        w, sc = const_meta(ins[0]), const_meta(ins[1])
        zp = const_meta(ins[2]) if len(ins) > 2 and ins[2] else None
        if (w is None or sc is None or math.prod(sc.shape) != 1 or not w.shape
                or (len(ins) > 2 and ins[2] and (zp is None or math.prod(zp.shape) != 1))):
            continue
        node = NodeProto()
        node.CopyFrom(g)  # the Gather's name and axis; its data is W's codes, then the scale and zero point
        del node.input[:]
        node.input.extend([ins[0], gins[1], ins[1], ins[2] if zp is not None else ""])
        used.update((k, d))
        out.append(Fusion(node, k, (d,), kernel="dq_gather", params={"dq": dq}))
    return out


def find_matmul_fusions(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                        const_value: Callable[[str], np.ndarray | None], opset: int,
                        taken: set[int], const_meta: Callable[[str], ConstMeta | None] | None = None,
                        ) -> list[MatMulFusion]:
    """``MatMul(A, W) [+ bias] [activations] [+ residual [activations]]`` chains (pure).

    ``W`` is a constant float matrix; the bias a float constant along its last axis (shape
    ``(N,)``, ``(1, ..., N)`` or a scalar), or onnxruntime's ``BiasGelu`` / ``FastGelu`` with a
    constant ``(N,)`` bias (the bias, then the exact / tanh GELU); activations as :func:`match_activation` finds them
    (torch's erf GELU included); the residual a non-constant ``Add`` operand.  Each name in the
    chain must be read only by the next node and not be a graph output.
    """
    used = set(taken)
    const_meta = const_meta or _meta_from(const_value)
    users_of = _sole_users(nodes, readers, protected, used)

    out: list[MatMulFusion] = []
    for k, node in enumerate(nodes):
        if k in used or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        w = const_meta(node.input[1])
        if w is None or len(w.shape) != 2 or w.dtype.kind != "f":
            continue
        n = int(w.shape[1])
        absorbed: list[int] = []
        t = node.output[0]
        bias = None
        lead: list[Activation] = []
        users = users_of(t)
        if users is not None and len(users) == 1:
            add = nodes[users[0]]
            other = _other_operand(add, t)
            if add.op_type == "Add" and add.domain in ("", "ai.onnx") and other is not None:
                c = const_value(other) if other else None
                if c is not None and c.dtype.kind == "f" and (c.size == 1 or (c.shape[-1] == n and c.size == n)):
                    bias = other
                    absorbed.append(users[0])
                    t = add.output[0]
            elif (add.op_type in ("BiasGelu", "FastGelu") and add.domain == "com.microsoft" and len(add.input) == 2
                  and add.input[0] == t and add.input[1] and add.input[1] != t and sole_output(add)):
                # onnxruntime's BiasGelu(t, B) / FastGelu(t, B) = the exact / tanh GELU of t + B,
                # B 1-D along the last axis: the bias and a GELU of the epilogue (float32
                # arithmetic, one rounding).
                c = const_value(add.input[1])
                if c is not None and c.dtype.kind == "f" and c.shape == (n,):
                    bias = add.input[1]
                    absorbed.append(users[0])
                    t = sole_output(add)
                    lead = [Activation("gelu" if add.op_type == "BiasGelu" else "fastgelu")]
        pre, residual, post, t = _match_epilogue(nodes, t, users_of, const_value, opset,
                                                 lambda n: const_meta(n) is not None, absorbed)
        pre = lead + pre
        if not absorbed:
            continue
        used.update(absorbed)
        used.add(k)
        out.append(MatMulFusion(k, bias, tuple(pre), residual, tuple(post), tuple(absorbed), t))
    return out


# Elementwise producers whose result Relu may clamp in place (a residual Sum -> Relu, ...), and
# BatchNormalization when it stays a node of its own (statistics fed at run time: the caffe2
# resnet50 of onnx's model zoo lists 30 of its BN scales and biases as graph inputs).
_RELU_PRODUCERS = frozenset({"Add", "Sum", "Sub", "Mul", "BatchNormalization"})


def find_attention_chains(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                          const_value: Callable[[str], np.ndarray | None], is_const: Callable[[str], bool],
                          opset: int, taken: set[int]) -> list[Fusion]:
    """``MatMul(Q, K) [Mul / Div by a scalar float constant] [Add(mask)] Softmax(axis -1)
    MatMul(., V)`` (pure): an exported attention (torch's BERT-class encoders write it so) as one
    step of kernel ``attention_chain``, inputs ``(Q, K, V, mask or "")``.  Q and K must not be
    constants (a MatMul by a weight is a GEMM, not this), each value of the chain must be read
    only by the next node and not be a graph output, and the Softmax's axis must be -1 (written
    so, or its opset-13 default)."""
    used = set(taken)
    users_of = _sole_users(nodes, readers, protected, used)

    def sole(name: str, ops: tuple[str, ...]) -> int | None:
        us = users_of(name)
        if us is None or len(us) != 1:
            return None
        n = nodes[us[0]]
        return us[0] if n.op_type in ops and n.domain in ("", "ai.onnx") and sole_output(n) else None

    out: list[Fusion] = []
    for k, node in enumerate(nodes):
        if (k in used or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2
                or not all(node.input) or any(is_const(n) for n in node.input)):
            continue
        chain: list[int] = []
        t = node.output[0]
        scale, op, mask = None, "Mul", ""
        i = sole(t, ("Mul", "Div", "Add", "Softmax"))
        if i is not None and nodes[i].op_type in ("Mul", "Div") and len(nodes[i].input) == 2:
            other = _other_operand(nodes[i], t)
            c = const_value(other) if other else None
            if (c is None or c.dtype.kind != "f" or c.size != 1 or list(nodes[i].input).count(t) != 1
                    or (nodes[i].op_type == "Div" and nodes[i].input[0] != t)):
                continue
            scale, op = c, nodes[i].op_type
            chain.append(i)
            t = sole_output(nodes[i])
            i = sole(t, ("Add", "Softmax"))
        if i is not None and nodes[i].op_type == "Add" and len(nodes[i].input) == 2:
            other = _other_operand(nodes[i], t)
            if not other or list(nodes[i].input).count(t) != 1:
                continue
            mask = other
            chain.append(i)
            t = sole_output(nodes[i])
            i = sole(t, ("Softmax",))
        if i is None or nodes[i].op_type != "Softmax":
            continue
        axis = _attrs(nodes[i]).get("axis", -1 if opset >= 13 else 1)
        if axis != -1:
            continue
        chain.append(i)
        t = sole_output(nodes[i])
        j = sole(t, ("MatMul",))
        if j is None or len(nodes[j].input) != 2 or nodes[j].input[0] != t or not nodes[j].input[1] or nodes[j].input[1] == t:
            continue
        chain.append(j)
        fused = NodeProto()
        fused.CopyFrom(node)  # the first MatMul's name: reports name the chain by it
        fused.ClearField("attribute")
        del fused.input[:]
        fused.input.extend([node.input[0], node.input[1], nodes[j].input[1], mask])
        del fused.output[:]
        fused.output.extend([sole_output(nodes[j])])
        out.append(Fusion(fused, k, tuple(chain), kernel="attention_chain",
                          params={"scale": scale, "divide": op == "Div"}))
        used.update((k, *chain))
    return out


def find_layernorm_chains(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                          const_value: Callable[[str], np.ndarray | None], taken: set[int]) -> list[Fusion]:
    """A LayerNormalization over the last axis written out in elementwise ops, as torch's exporter
    writes ``nn.LayerNorm`` below opset 17 (and tf2onnx, and Keras models):
    ``m = ReduceMean(x, [-1]); d = x - m; v = ReduceMean(d ** 2 | d * d, [-1]);
    y = d / Sqrt(v + eps) * gamma + beta`` (either operand order of the last Mul and Add), with
    ``eps`` a constant scalar and ``gamma``, ``beta`` constant float32 vectors of one length: one
    step, kernel ``layernorm_chain`` (pure), as onnxruntime's LayerNormFusion rewrites the chain.

    Why: nine numpy passes over the activations, and nine steps of the loop (an openWakeWord head
    has two such chains in 26 steps; a BERT exported at opset 14 one per sub-layer).  Every
    intermediate must be read only inside the chain."""
    used = set(taken)
    users_of = _sole_users(nodes, readers, protected, used)
    out: list[Fusion] = []

    def last_axis_mean(node: NodeProto) -> bool:
        if node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx") or not sole_output(node):
            return False
        attrs = {a.name: a for a in node.attribute[:]}
        if "keepdims" in attrs and attrs["keepdims"].i != 1:
            return False
        if "noop_with_empty_axes" in attrs and attrs["noop_with_empty_axes"].i:
            return False
        ins = node.input[:]
        if "axes" in attrs:
            axes = list(attrs["axes"].ints)
        elif len(ins) > 1 and ins[1]:
            v = const_value(ins[1])
            axes = None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]
        else:
            return False
        return axes == [-1]

    def sole(name: str, op: str) -> int | None:
        users = users_of(name)
        if users is None or len(users) != 1 or nodes[users[0]].op_type != op or nodes[users[0]].domain not in ("", "ai.onnx"):
            return None
        return users[0]

    def scalar(name: str) -> float | None:
        v = const_value(name) if name else None
        if v is None or np.asarray(v).size != 1 or np.asarray(v).dtype.kind != "f":
            return None
        return float(np.asarray(v).reshape(()))

    for r1, mean_node in enumerate(nodes):
        if r1 in used or not last_axis_mean(mean_node):
            continue
        x, mean = mean_node.input[0], mean_node.output[0]
        sub = sole(mean, "Sub")
        if sub is None or nodes[sub].input[:] != [x, mean] or not sole_output(nodes[sub]):
            continue
        d = nodes[sub].output[0]
        reads = _by_input(nodes).get(d, [])
        if d in protected or readers.get(d, 0) != len(reads) or not used.isdisjoint(reads):
            continue
        kinds = sorted(set(reads))
        if len(kinds) != 2:
            continue
        sq, div = (kinds if nodes[kinds[1]].op_type == "Div" else kinds[::-1])
        sq_node, div_node = nodes[sq], nodes[div]
        if div_node.op_type != "Div" or div_node.input[:] != [d, div_node.input[1]] or not sole_output(div_node):
            continue
        if sq_node.op_type == "Pow":
            if sq_node.input[0] != d or scalar(sq_node.input[1]) != 2.0 or len(reads) != 2:
                continue
        elif sq_node.op_type == "Mul":
            if sq_node.input[:] != [d, d] or len(reads) != 3:
                continue
        else:
            continue
        if not sole_output(sq_node):
            continue
        r2 = sole(sq_node.output[0], "ReduceMean")
        if r2 is None or not last_axis_mean(nodes[r2]) or nodes[r2].input[0] != sq_node.output[0]:
            continue
        add_eps = sole(nodes[r2].output[0], "Add")
        if add_eps is None or not sole_output(nodes[add_eps]):
            continue
        a_ins = nodes[add_eps].input[:]
        eps_name = a_ins[1] if a_ins[0] == nodes[r2].output[0] else a_ins[0]
        eps = scalar(eps_name)
        if eps is None or len(a_ins) != 2 or nodes[r2].output[0] not in a_ins:
            continue
        sqrt = sole(nodes[add_eps].output[0], "Sqrt")
        if sqrt is None or not sole_output(nodes[sqrt]) or div_node.input[1] != nodes[sqrt].output[0]:
            continue
        mul = sole(div_node.output[0], "Mul")
        if mul is None or not sole_output(nodes[mul]):
            continue
        m_ins = nodes[mul].input[:]
        gamma = m_ins[1] if m_ins[0] == div_node.output[0] else m_ins[0]
        add_b = sole(nodes[mul].output[0], "Add")
        if add_b is None or not sole_output(nodes[add_b]):
            continue
        b_ins = nodes[add_b].input[:]
        beta = b_ins[1] if b_ins[0] == nodes[mul].output[0] else b_ins[0]
        g, b = const_value(gamma), const_value(beta)
        if (g is None or b is None or g.dtype != np.float32 or b.dtype != np.float32 or g.ndim != 1 or g.shape != b.shape
                or g.shape[0] < 2 or len(m_ins) != 2 or len(b_ins) != 2 or gamma == div_node.output[0]
                or beta == nodes[mul].output[0]):
            continue
        chain = (r1, sub, sq, r2, add_eps, sqrt, div, mul, add_b)
        if not used.isdisjoint(chain) or len(set(chain)) != len(chain):
            continue
        node = NodeProto()
        node.op_type, node.name = "LayerNormalization", nodes[add_b].name or mean_node.name
        node.input.extend([x, gamma, beta])
        node.output.extend([nodes[add_b].output[0]])
        for name, value in (("axis", -1), ("epsilon", eps)):
            a = node.attribute.add()
            a.name = name
            if name == "axis":
                a.type, a.i = AttributeProto.INT, value
            else:
                a.type, a.f = AttributeProto.FLOAT, value
        used.update(chain)
        out.append(Fusion(node, add_b, tuple(i for i in chain if i != add_b), kernel="layernorm_chain"))
    return out


def find_relu_fusions(
    nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str], taken: set[int],
    const_value: Callable[[str], np.ndarray | None] | None = None, opset: int = 1,
) -> list[tuple[ConvFusion, tuple[Activation, ...]]]:
    """``Add/Sum/Sub/Mul/BatchNormalization -> Relu`` pairs where Relu is the producer's only
    reader; after a BatchNormalization (given ``const_value``), a chain of Relus and per-tensor
    fake-quant pairs (``QuantizeLinear -> DequantizeLinear``, see :func:`match_activation`): a
    QDQ model's BatchNormalization that cannot fold into its Conv (its statistics are graph
    inputs, or a fake-quant pair stands between them) with the pair quantizing its output.  Both
    are exact in its float32 result, so the fused epilogue gives the unfused nodes' bits.

    Returned as :class:`ConvFusion` with ``conv`` the producer and ``bn`` None, each with its
    activations; ``taken`` holds node indices already part of another fusion.
    """
    by_input = _by_input(nodes)
    users_of = _sole_users(nodes, readers, protected, taken)
    out = []
    for k, node in enumerate(nodes):
        if k in taken or node.op_type not in _RELU_PRODUCERS or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "BatchNormalization" and (
                sum(1 for o in node.output[:] if o) != 1
                or any(a.name == "training_mode" and a.i for a in node.attribute[:])):
            continue  # only inference BN's one output (training mode runs in onnx.reference)
        name = node.output[0]
        if node.op_type == "BatchNormalization" and const_value is not None:
            acts: list[Activation] = []
            absorbed: list[int] = []
            t = name
            while True:
                got = match_activation(nodes, t, users_of, const_value, opset)
                if got is None or got[0].kind not in ("relu", "fakequant"):
                    break
                acts.append(got[0])
                absorbed.extend(got[1])
                t = got[2]
            if acts:
                taken.update((k, *absorbed))
                out.append((ConvFusion(k, None, None, nodes=tuple(absorbed), output=t), tuple(acts)))
            continue
        users = by_input.get(name, [])
        if len(users) != 1 or readers.get(name, 0) != 1 or name in protected or users[0] in taken:
            continue
        relu = nodes[users[0]]
        if relu.op_type == "Relu" and relu.domain in ("", "ai.onnx"):
            taken.update((k, users[0]))
            out.append((ConvFusion(k, None, users[0]), (Activation("relu"),)))
    return out


def find_nbits_fusions(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                       const_value: Callable[[str], np.ndarray | None], opset: int, taken: set[int],
                       const_meta: Callable[[str], ConstMeta | None]) -> list[Fusion]:
    """``MatMulNBits [+ bias] [activations]`` chains (pure; onnxruntime-genai's layers: the
    QKV bias ``Add``, ``Sigmoid`` and ``Mul`` spelling SiLU on the gate projection).

    A bias ``Add`` of a float constant of N values becomes the node's own bias input (when it has
    none; onnxruntime's kernel adds it the same way); the activations (:func:`match_activation`)
    become the fusion's epilogue, run in place on the kernel's fresh output.  Each name in the
    chain must be read only by the next node and not be a graph output.
    """
    used = set(taken)
    users_of = _sole_users(nodes, readers, protected, used)
    out: list[Fusion] = []
    for k, node in enumerate(nodes):
        if k in used or node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.output) != 1:
            continue
        scales = const_meta(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        # A half-precision MatMulNBits (onnxruntime has its float16 kernel) rounds its result to
        # half before a bias Add reads it, in onnxruntime too: that Add stays a node (as the
        # kernel's own bias, it was added before the rounding: 1 ulp off on a quarter of them).
        half = scales is not None and scales.dtype.itemsize < 4
        absorbed: list[int] = []
        t = node.output[0]
        bias = None
        users = users_of(t)
        if users is not None and len(users) == 1 and (len(node.input) < 6 or not node.input[5]) and not half:
            add = nodes[users[0]]
            other = _other_operand(add, t)
            if add.op_type == "Add" and add.domain in ("", "ai.onnx") and other is not None:
                meta = const_meta(other) if other else None
                n = next((a.i for a in node.attribute[:] if a.name == "N"), None)
                if n is not None and meta is not None and meta.dtype.kind == "f" and math.prod(meta.shape) == n and (
                        len(meta.shape) == 1 or all(d == 1 for d in meta.shape[:-1])):
                    bias = other
                    absorbed.append(users[0])
                    t = add.output[0]
        acts: list[Activation] = []
        while True:
            got = match_activation(nodes, t, users_of, const_value, opset)
            if got is None:
                break
            act, idxs, t = got
            acts.append(act)
            absorbed.extend(idxs)
        if not absorbed:
            continue
        fused = NodeProto()
        fused.CopyFrom(node)
        del fused.output[:]
        fused.output.extend([t])
        if bias is not None:
            while len(fused.input) < 6:
                fused.input.append("")
            fused.input[5] = bias
        used.update(absorbed)
        used.add(k)
        out.append(Fusion(fused, k, tuple(absorbed), epilogue=tuple(acts)))
    return out


def find_gated_nbits(nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
                     gates: Sequence[Fusion], taken: set[int]) -> list[Fusion]:
    """Each of ``gates`` (:func:`find_nbits_fusions`' records) as one ``nbits_gated`` step when
    its result is read only by a ``Mul`` whose other operand is read only there and comes from a
    ``MatMulNBits`` of the same input with the same ``N`` (pure).  Gates that do not take part are
    returned unchanged; ``taken`` must hold the gates' nodes.

    The fused node has the gate's six inputs (A, B, scales, zero points, g_idx, bias; absent ones
    empty) then the other projection's five, and the Mul's output; ``params["up"]`` is that
    projection's node.  Both weights keep their own packs (the same records as unfused)."""
    if not gates:
        return []
    used = set(taken)
    users_of = _sole_users(nodes, readers, protected, set())
    by_input = _by_input(nodes)
    out: list[Fusion] = []
    for f in gates:
        gate = f.node
        t = gate.output[0]
        users = users_of(t)
        if not f.epilogue or users is None or len(users) != 1 or users[0] in used:
            out.append(f)
            continue
        mul = nodes[users[0]]
        ins = mul.input[:]
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or len(ins) != 2 or ins.count(t) != 1:
            out.append(f)
            continue
        other = ins[1] if ins[0] == t else ins[0]
        # the other projection reads the gate's input: among that input's readers
        producer = next((k for k in by_input.get(gate.input[0], ()) if nodes[k].output[:] == [other]),
                        None) if users_of(other) == users else None
        up = None if producer is None else nodes[producer]
        if (up is None or producer in used or up.op_type != "MatMulNBits" or up.domain != "com.microsoft"
                or len(up.output) != 1 or up.input[0] != gate.input[0] or _attrs(up).get("N") != _attrs(gate).get("N")
                or any(len(n.input) > 4 and n.input[4] for n in (gate, up))):  # g_idx: the general path
            out.append(f)
            continue
        fused = NodeProto()
        fused.CopyFrom(gate)
        while len(fused.input) < 6:
            fused.input.append("")
        up_ins = up.input[1:6]  # B, scales, zero points, g_idx, bias; absent ones empty
        fused.input.extend(up_ins + [""] * (5 - len(up_ins)))
        del fused.output[:]
        fused.output.extend([mul.output[0]])
        absorbed = (*f.absorbed, producer, users[0])
        used.update(absorbed)
        out.append(Fusion(fused, f.anchor, absorbed, kernel="nbits_gated", params={"up": up, "acts": f.epilogue}))
    return out


# Zero-point types of a fusable pair: integers of at most 16 bits, exact in float32 arithmetic.
_FAKE_QUANT_TYPES = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535)}


def find_fake_quant_fusions(
    nodes: Sequence[NodeProto], readers: dict[str, int], protected: set[str],
    const_value: Callable[[str], np.ndarray | None], opset: int, taken: set[int],
    is_const: Callable[[str], bool] | None = None,
) -> list[Fusion]:
    """``QuantizeLinear -> DequantizeLinear`` pairs that are one rounding of a float tensor
    computed at run time (a pair over a constant, ``is_const``, is a derived constant: the
    weight's reader packs the rounded value, see ``_derive.py``).

    The pair fuses when: both are default-domain (any opset: at 10-12 per tensor only) or
    onnxruntime's com.microsoft nodes (the same arithmetic; the quantizer writes them for 16-bit
    and 4-bit types and with ``UseQDQContribOps``) without ``block_size``,
    ``output_dtype`` or ``precision``; the Q's output is read by the DQ alone (and is no graph
    output); the DQ's scale and zero point are the Q's (same constants: equal dtypes and values);
    the scale is float32 (the DQ's output is float32) and positive; the zero point an integer type
    of at most 16 bits (both constants; a zero point must be given).  ``params`` carries the
    integer range.
    """
    ops = [n.op_type for n in nodes]
    # The DequantizeLinear nodes by their input: a Q output read once (``readers``) by one of them.
    dq_of = {nodes[k].input[0]: k for k, op in enumerate(ops) if op == "DequantizeLinear" and nodes[k].input}
    out: list[Fusion] = []
    for k, op in enumerate(ops):
        if op != "QuantizeLinear" or k in taken:
            continue
        q = nodes[k]
        name = q.output[0] if q.output else ""
        d = dq_of.get(name)
        if d is None or readers.get(name, 0) != 1 or name in protected or d in taken:
            continue
        if is_const is not None and q.input and is_const(q.input[0]):
            continue
        dq = nodes[d]
        got = _fake_quant_pair(q, dq, const_value, opset)
        if got is None:
            continue
        axis, lo, hi, _scale, _zp = got
        node = NodeProto()
        node.CopyFrom(q)
        node.name = f"{q.name or f'#{k}'}+{dq.name or f'#{d}'}"
        del node.output[:]
        node.output.extend([dq.output[0]])
        out.append(Fusion(node, k, (d,), kernel="fake_quant", params={"axis": axis, "low": lo, "high": hi}))
        taken.update((k, d))
    return out


def _fake_quant_pair(q: NodeProto, dq: NodeProto, const_value: Callable[[str], np.ndarray | None],
                     opset: int) -> tuple[int, int, int, np.ndarray, np.ndarray] | None:
    """``(axis, low, high, scale, zero point)`` when ``dq`` reading ``q``'s output makes the
    pair one rounding of a float tensor (the conditions of :func:`find_fake_quant_fusions`,
    except who reads what, which the caller checks), else None."""
    if q.domain not in _QDQ_DOMAINS or dq.domain not in _QDQ_DOMAINS:
        return None
    q_in, dq_in = tuple(q.input[:]), tuple(dq.input[:])  # one conversion each, by a slice (see _by_input)
    if len(q_in) != 3 or len(dq_in) != 3 or dq.op_type != "DequantizeLinear" or not q.output:
        return None
    if dq_in[0] != q.output[0] or not sole_output(dq):
        return None
    qa, da = _attrs(q), _attrs(dq)
    for a in (qa, da):
        if a and (a.get("block_size") or a.get("output_dtype") or a.get("precision")):
            return None
    scale, zp = const_value(q_in[1]), const_value(q_in[2])
    if scale is None or zp is None or scale.dtype != _F32:
        return None
    bounds = _fake_quant_range(zp.dtype)
    if bounds is None:
        return None
    for mine, theirs in ((q_in[1], dq_in[1]), (q_in[2], dq_in[2])):
        if mine != theirs:  # the quantizer shares one scale and zero point: names match
            other, value = const_value(theirs), const_value(mine)
            if other is None or other.dtype != value.dtype or not np.array_equal(other, value):
                return None
    # One scale (per tensor, the common case) is compared as a Python float: NaN is refused
    # either way; numpy's elementwise test and its reduction cost ~10 times more.
    positive = scale.item() > 0 if scale.size == 1 else bool((scale > 0).all())
    if not positive or (scale.size > 1 and int(qa.get("axis", 1)) != int(da.get("axis", 1))):
        return None
    if scale.size > 1 and opset < 13 and (q.domain in ("", "ai.onnx") or dq.domain in ("", "ai.onnx")):
        return None  # (per-axis scales are opset 13's: an older default-domain node runs as it is)
    lo, hi = bounds
    return int(qa.get("axis", 1)), lo, hi, scale, zp


_F32 = np.dtype(np.float32)
_QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
_FLT_MAX = float(np.finfo(np.float32).max)
_FAKE_QUANT_RANGES: dict[np.dtype, tuple[int, int] | None] = {}


def _fake_quant_range(dtype: np.dtype) -> tuple[int, int] | None:
    """``_FAKE_QUANT_TYPES[dtype.name]`` or None, cached by dtype (numpy builds ``dtype.name``
    in Python at every access)."""
    try:
        return _FAKE_QUANT_RANGES[dtype]
    except KeyError:
        got = _FAKE_QUANT_RANGES[dtype] = _FAKE_QUANT_TYPES.get(dtype.name)
        return got


def sole_output(node: NodeProto) -> str:
    """The node's first output when it is named and no other output is, else ``""`` (the
    one-output test of fusion matching and of constant derivation)."""
    outs = node.output
    if len(outs) == 1:  # the common case, without building a list
        return outs[0]
    first = outs[0] if outs else ""
    return first if first and len([o for o in outs[:] if o]) == 1 else ""


def _attrs(node: NodeProto) -> dict[str, Any]:
    """The int attributes the fusion looks at (``axis``, ``block_size``, ``output_dtype``, ``precision``)."""
    return {a.name: a.i for a in node.attribute[:]}


def _foldable_bn(node: NodeProto, is_const: Callable[[str], bool], opset: int) -> bool:
    if len(node.input) != 5 or not all(is_const(n) for n in node.input[1:]):
        return False
    if len([o for o in node.output[:] if o]) != 1:
        return False
    attrs = {a.name: get_attribute_value(a) for a in node.attribute[:]}
    if int(attrs.get("training_mode", 0)):
        return False
    return not (opset < 9 and int(attrs.get("spatial", 1)) == 0)


def fused_node(nodes: Sequence[NodeProto], fusion: ConvFusion) -> NodeProto:
    """The node standing for the fused chain: the anchor's inputs (plus the residual as input
    3 of a Conv), the chain's last output."""
    conv = nodes[fusion.conv]
    if fusion.output:
        last_output = fusion.output
    else:
        last = nodes[fusion.relu if fusion.relu is not None else fusion.bn]
        last_output = last.output[0]
    names = [nodes[i].name or f"#{i}" for i in (fusion.conv, *fusion.absorbed)]
    node = NodeProto()
    node.CopyFrom(conv)
    node.name = "+".join(names)
    del node.output[:]
    node.output.extend([last_output])
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
                 is_const: Callable[[str], bool] | None = None,
                 const_meta: Callable[[str], ConstMeta | None] | None = None,
                 const_lazy: Callable[[str], Callable[[], np.ndarray]] | None = None,
                 qdq_accuracy_level: int = 4, arithmetic_only: bool = False, qdq_rewrite: bool = True,
                 declared: Callable[[str], tuple | None] | None = None) -> list[Fusion]:
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
        const_meta: a constant's shape and dtype without computing it (a weight's are known from
            its declaration; matching a chain needs no more), default: from ``const_value``.
        const_lazy: a constant's value as a function a kernel calls when it first needs it
            (per-channel statistics of a Conv epilogue), default: ``const_value`` deferred.
        qdq_accuracy_level: the ``accuracy_level`` of the MatMulNBits steps that 4-bit
            ``DequantizeLinear -> MatMul`` pairs become (``session.qdq_matmulnbits_accuracy_level``).
        arithmetic_only: only the fusions that change the arithmetic as onnxruntime's graph
            optimizer does (its MatMulNBits of a DequantizeLinear pair quantizes activations at
            accuracy level 4): they apply whenever graph optimizations are on, with pre-packing
            off too, so both give onnxruntime's results.
        qdq_rewrite: whether those DequantizeLinear pairs become MatMulNBits at all (onnxruntime's
            QDQ transformer runs from ``ORT_ENABLE_EXTENDED`` on: at basic they stay float).
        declared: a value's declared shape (graph input, output or value_info; dims as ints,
            symbolic names or None), or None: where onnxruntime's rewrite depends on shapes.
    """
    if arithmetic_only:
        return find_dq_matmul_nbits(nodes, readers, protected, const_meta or _meta_from(const_value), set(),
                                    qdq_accuracy_level, declared) if qdq_rewrite else []
    if const_lazy is None:
        def const_lazy(n: str) -> Callable[[], np.ndarray]:
            return lambda: const_value(n)
    if is_const is None:
        def is_const(n: str) -> bool:
            return const_value(n) is not None
    const_meta = const_meta or _meta_from(const_value)
    if not isinstance(nodes, _Nodes):
        nodes = _Nodes(nodes)

    convs = find_conv_fusions(nodes, readers, protected, is_const, opset, const_value, const_meta)
    taken = {i for f in convs for i in (f.conv, *f.absorbed)}
    out: list[Fusion] = []
    for f in convs:
        node = fused_node(nodes, f)
        conv = nodes[f.conv]
        params: dict[str, Any] = {"multiplier": None, "shift": None, "pre": f.pre, "residual": f.residual is not None,
                                  "post": f.post}
        if f.channels:
            # Decided from shapes and dtypes; the values are computed by the kernel at its first
            # run (a QDQ model's statistics are dequantized int8: a warm start computes none).
            m = int(const_meta(conv.input[1]).shape[0])
            stats = []
            for i in f.channels:
                bn = nodes[i]
                metas = [const_meta(n) for n in bn.input[1:5]]
                if any(c is None or c.shape != (m,) or c.dtype.kind != "f" for c in metas):
                    break
                eps = next((a.f for a in bn.attribute[:] if a.name == "epsilon"), 1e-5)
                stats.append((*(const_lazy(n) for n in bn.input[1:5]), eps))
            if len(stats) != len(f.channels):
                continue  # not one float statistic per output channel: the nodes run as they are
            params["channels"] = tuple(stats)
        if f.bn is not None or f.folds:
            m = int(const_meta(conv.input[1]).shape[0])
            cb = const_value(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else None
            mult = np.ones(m, np.float64)
            shift = np.zeros(m, np.float64) if cb is None else cb.astype(np.float64).reshape(m)
            if f.bn is not None:
                bn = nodes[f.bn]
                scale, bias, mean, var = (const_value(n) for n in bn.input[1:5])
                if any(np.ndim(p) != 1 or np.size(p) != m for p in (scale, bias, mean, var)):
                    continue  # not one statistic per output channel: BatchNormalization decides (or refuses)
                eps = next((a.f for a in bn.attribute[:] if a.name == "epsilon"), 1e-5)
                a, b = bn_fold(scale, bias, mean, var, eps, None)
                mult, shift = mult * a, shift * a + b
            for op, cname in f.folds:
                c = np.broadcast_to(const_value(cname).astype(np.float64).reshape(-1), (m,))
                if op == "Mul":
                    mult, shift = mult * c, shift * c
                elif op == "Div":
                    mult, shift = mult / c, shift / c
                elif op == "Add":
                    shift = shift + c
                else:
                    shift = shift - c
            params["multiplier"], params["shift"] = mult, shift
            del node.input[2:]  # the Conv bias is folded into the shift
        if f.residual is not None:
            while len(node.input) < 3:
                node.input.append("")
            node.input.append(f.residual)
        out.append(Fusion(node, f.conv, f.absorbed, kernel="conv", params=params))
    # The finders below whose patterns need op types the scope lacks are skipped: each walks every
    # node through protobuf reads (a QDQ ResNet-50's 287 DequantizeLinear nodes made the three
    # ~0.6 ms of its warm create, for patterns it has none of).
    types = {n.op_type for n in nodes}
    dq = "DequantizeLinear" in types
    for f in (find_dq_matmul_nbits(nodes, readers, protected, const_meta, taken, qdq_accuracy_level, declared)
              if qdq_rewrite and dq and ("MatMul" in types or "Gemm" in types) else ()):
        out.append(f)
        taken.update((f.anchor, *f.absorbed))
    for f in find_dq_gather(nodes, readers, protected, const_meta, taken) if dq and "Gather" in types else ():
        out.append(f)
        taken.update((f.anchor, *f.absorbed))
    for f in find_matmul_fusions(nodes, readers, protected, const_value, opset, taken, const_meta):
        node = NodeProto()
        node.CopyFrom(nodes[f.matmul])  # keeps the MatMul's name: reports and logs name the weight's reader
        del node.output[:]
        node.output.extend([f.output])
        if f.residual is not None:
            node.input.append(f.residual)
        bias = None
        if f.bias is not None:
            bias = np.asarray(const_value(f.bias), dtype=np.float64).reshape(-1)
        params = {"bias": bias, "pre": f.pre, "residual": f.residual is not None, "post": f.post}
        out.append(Fusion(node, f.matmul, f.nodes, kernel="matmul", params=params))
        taken.update((f.matmul, *f.nodes))
    out = group_sibling_matmuls(nodes, out, taken, const_meta)
    nbits = find_nbits_fusions(nodes, readers, protected, const_value, opset, taken, const_meta)
    for f in nbits:
        taken.update((f.anchor, *f.absorbed))
    for f in find_gated_nbits(nodes, readers, protected, nbits, taken):
        out.append(f)
        taken.update((f.anchor, *f.absorbed))
    for f in (find_attention_chains(nodes, readers, protected, const_value, is_const, opset, taken)
              if "Softmax" in types and "MatMul" in types else ()):
        out.append(f)
        taken.update((f.anchor, *f.absorbed))
    for f in (find_layernorm_chains(nodes, readers, protected, const_value, taken)
              if "ReduceMean" in types and "Sqrt" in types else ()):
        out.append(f)
        taken.update((f.anchor, *f.absorbed))
    for f, acts in find_relu_fusions(nodes, readers, protected, taken, const_value, opset):
        out.append(Fusion(fused_node(nodes, f), f.conv, f.absorbed, epilogue=acts))
    out.extend(find_fake_quant_fusions(nodes, readers, protected, const_value, opset, taken, is_const))
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
