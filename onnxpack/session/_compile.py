"""The compile step: a loaded model → a frozen :class:`~onnxpack.session._program.Program`.

``compile(model, options, sources, container, holder)`` is what session creation and
``onnxpack optimize`` do, and nothing else:

1. every scope, bottom-up (a node's subgraphs are compiled before the node is bound);
2. per scope: fusion records (:func:`~onnxpack.session._fusion.plan_fusions`, pre-packing on
   only), a topological order, one kernel per node from the resolver
   (:func:`~onnxpack.session._resolve.resolve`);
3. per constant kernel input the kernel packs: the pack and its origin from
   :class:`~onnxpack.prepack.PackSources` (saved blob, container, cache file, or packed now),
   logged as a :class:`~onnxpack.session._program.PackEvent`;
4. per scope, once all its readers are bound: its constants — only originals something still
   reads unpacked; the mapped pages of the others are dropped (nothing will read them);
5. the statistics, derived from the pack log.

Nothing here runs a model (only :func:`~onnxpack.session._fold.fold_constants` runs a few
shape-arithmetic kernels on constants), and nothing reaches back into a session: the caller gets the program,
and its counters come from the log.  Creation is O(nodes + edges): names are resolved through
the graph layer's scope chain, never by building the set of every outer name per scope.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnxpack.errors import InvalidArgument, InvalidGraph, OnnxpackError
from onnxpack.graph import Model, Scope
from onnxpack.graph._proto import AttributeProto, NodeProto, TensorProto, np_dtype_to_tensor_dtype
from onnxpack.prepack import PackSources, PrepackedWeightsContainer, WeightRef
from onnxpack.session._api import declared_dim
from onnxpack.session._derive import compute_constant, derive
from onnxpack.session._fold import fold_constants
from onnxpack.session._api import override_dims
from onnxpack.session._fusion import (ConstMeta, Fusion, apply_fusions, declared_shapes, identity_aliases, inputs_index,
                                      nodes_with_index,
                                      passes_through, plan_fusions, read_through)
from onnxpack.session._program import PackEvent, Plan, PrepackStats, Program, Step, schedule, topological_order
from onnxpack.session._resolve import resolve
from onnxpack.session.kernels import Kernel, KernelContext, TensorInfo, normalize_domain

logger = logging.getLogger(__name__)

__all__ = ["CompileOptions", "compile"]


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """What a compile may do.

    Attributes:
        prepack: pre-pack constant kernel inputs (``session.disable_prepacking`` off) and fuse.
        runnable: build kernels for every node; ``False`` (``onnxpack optimize``) builds no
            onnx.reference evaluators, since the program will only be saved.
        initializers: arrays given with ``SessionOptions.add_initializer`` (name -> value).
        fuse: apply the fusions (with ``prepack``); ``GraphOptimizationLevel.ORT_DISABLE_ALL``
            turns them off.
        dims_by_name / dims_by_denotation: free-dimension overrides (symbolic dim name or
            denotation -> size); they fix the compiled inputs' (and outputs') declared shapes,
            which ``get_inputs()`` reports and runs are checked against.
        qdq_accuracy_level: ``session.qdq_matmulnbits_accuracy_level`` (see
            ``_fusion.find_dq_matmul_nbits``).
        qdq_rewrite: rewrite 4-bit ``DequantizeLinear -> MatMul`` pairs as MatMulNBits, as
            onnxruntime's QDQ transformer does from ``ORT_ENABLE_EXTENDED`` on (not at basic).
    """

    prepack: bool = True
    runnable: bool = True
    initializers: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    fuse: bool = True
    dims_by_name: Mapping[str, int] = dataclasses.field(default_factory=dict)
    dims_by_denotation: Mapping[str, int] = dataclasses.field(default_factory=dict)
    qdq_accuracy_level: int = 4
    qdq_rewrite: bool = True


def compile(model: Model, options: CompileOptions, sources: PackSources,  # noqa: A001 - the compile step
            container: PrepackedWeightsContainer, holder: int) -> Program:
    """Compile ``model`` into a :class:`Program`; packs go into ``container`` held by ``holder``.

    Raises:
        InvalidArgument: an ``add_initializer`` name that is neither an initializer nor an input.
        InvalidGraph: a cycle, a missing input, a name produced twice, an invalid node.
        KernelNotFoundError: a node nobody can run.
    """
    return _Compiler(model, options, sources, container, holder).compile()


_NO_SUBGRAPHS: Mapping[str, Any] = types.MappingProxyType({})


def _subgraph_key(scope: Scope) -> str:
    return scope.attr_name if scope.attr_index is None else f"{scope.attr_name}[{scope.attr_index}]"


class _Compiler:
    def __init__(self, model: Model, options: CompileOptions, sources: PackSources,
                 container: PrepackedWeightsContainer, holder: int) -> None:
        self.model = model
        self.options = options
        self.sources = sources
        self.container = container
        self.holder = holder
        self.opsets = dict(model.opsets)
        self.functions = tuple(_checked_function(model, f) for f in model.proto.functions)
        self.local_functions = frozenset((normalize_domain(f.domain), f.name) for f in self.functions)
        root = model.root
        self.root = root
        self.user = dict(options.initializers)
        root_inputs = {i.name for i in root.graph.input}
        unknown = sorted(set(self.user) - set(root.initializers) - root_inputs)
        if unknown:
            raise InvalidArgument(f"add_initializer: {unknown} are neither initializers nor inputs of the model")
        # Before IR 4 every initializer had to be listed as an input too; onnxruntime treats them
        # as constants there (not feedable, not overridable), and so do we.
        self.overridable = frozenset(
            root.initializers.keys() & root_inputs) if model.proto.ir_version >= 4 else frozenset()
        self.plans: dict[str, Plan] = {}
        self.log: list[PackEvent] = []
        self.fallback_nodes: list[str] = []
        self.unpacked: set[tuple[str, str]] = set()  # (owner scope path, name) read unpacked
        self.released = 0
        # scope path -> node output name -> constant computed from a stored weight (_derive.py)
        self.derived: dict[str, dict[str, WeightRef]] = {}
        # (scope path, name) -> what _weight answered, once a scope's derivations are complete
        # (every phase asks again about the same few names: ~2,000 look-ups per QDQ ResNet-50)
        self._weights: dict[str, dict[str, WeightRef | None]] = {}  # by scope path, then name
        self._settled: set[str] = set()  # scope paths whose answers may be kept
        self._leaves: dict[str, dict[str, WeightRef | None]] = {}  # _leaf's answers, by owner path, then name
        self._contexts: dict[str, KernelContext] = {}  # by domain, for nodes without graphs (_bind_now)

    def compile(self) -> Program:
        scopes = list(self.model.scopes())  # bottom-up: children before the node that owns them
        parts: dict[str, tuple] = {}
        if len(scopes) > 1 and self.options.prepack:
            # The constants each scope computes, outer scopes first: a subgraph's fold and packs
            # read its outer scopes' Constant nodes and chains as the constants they are.  Found
            # bottom-up with the rest of each scope's compile, an outer scope's were not known yet
            # when its subgraphs compiled: Silero VAD v5 (an If per sample rate, the LSTM in an If
            # nested in that branch) re-sliced and re-concatenated its LSTM's 256 KB weights, and
            # transposed them unpacked, at every run (0.41 ms a run against onnxruntime's 0.08).
            for scope in reversed(scopes):
                parts[scope.path] = self._scope_parts(scope)
                self._derive_scope(scope, parts[scope.path])
        for scope in scopes:
            self.plans[scope.path] = self._plan_scope(scope, parts.pop(scope.path, None))
        root = self.root
        defaults = {n: (self.user[n] if n in self.user else root.initializers[n].numpy()) for n in self.overridable}
        stats = PrepackStats.from_log(self.log, rejected=self.sources.rejected, released=self.released)
        guards = {id(self.model): self.model.check_files}
        for e in self.log:
            if e.entry.check_source is not None:
                guards.setdefault(id(getattr(e.entry.check_source, "__self__", e.entry.check_source)), e.entry.check_source)
        warm: dict[type, Callable[[], None]] = {}
        for plan in self.plans.values():
            for step in plan.steps:
                k = step.kernel
                task = k.warm_up  # a bound method, or a task the kernel set that holds no reference to it
                if getattr(task, "__func__", None) is not Kernel.warm_up:
                    warm.setdefault(type(k), task)
        inputs, outputs = override_dims(root.graph.input, root.graph.output, self.options.dims_by_name,
                                        self.options.dims_by_denotation)
        return Program(
            plans=dict(self.plans), root=self.plans[root.path], overridable=self.overridable, defaults=defaults,
            pack_log=tuple(self.log), fallback_nodes=tuple(self.fallback_nodes), stats=stats,
            inputs=inputs, outputs=outputs, guards=tuple(guards.values()), warm_ups=tuple(warm.values()),
        )

    # -- names ------------------------------------------------------------------------------------
    def _weight(self, scope: Scope, name: str) -> WeightRef | None:
        """The constant ``name`` refers to from ``scope``, or None if it is not a constant."""
        # (Caches by scope path, then name: no (path, name) tuple built and hashed per look-up.)
        known = self._weights.get(scope.path)
        if known is None:
            known = self._weights[scope.path] = {}
        got = known.get(name, _UNKNOWN)
        if got is not _UNKNOWN:
            return got
        owner = scope if name in scope.defined else scope.resolve(name)  # (the common case without a call)
        if owner is None:
            known[name] = None
            return None
        path = owner.path
        derived = self.derived.get(path)
        got = None if derived is None else derived.get(name)  # (a WeightRef, never None)
        if got is None:
            # A stored weight's answer never changes: one WeightRef per name (while a scope's
            # derivations are followed, each of its DequantizeLinear nodes asks about three names).
            leaves = self._leaves.get(path)
            if leaves is None:
                leaves = self._leaves[path] = {}
            got = leaves.get(name, _UNKNOWN)
            if got is _UNKNOWN:
                got = leaves[name] = self._leaf(owner, name)
        if path in self._settled:  # the owner's derived values are all known
            known[name] = got
        return got

    def _leaf(self, owner: Scope, name: str) -> WeightRef | None:
        if owner is self.root:
            if name in self.overridable:
                return None
            if name in self.user:
                return WeightRef(owner.path, name, None, self.user[name])
        tensor = owner.initializers.get(name)
        return None if tensor is None else WeightRef(owner.path, name, tensor)

    # -- one scope --------------------------------------------------------------------------------
    def _scope_parts(self, scope: Scope) -> tuple:
        """What the compile of ``scope`` reads of its graph: (name, children by owner index, each
        node's subgraph reads, nodes, local names, ``available``, inputs, outputs, reads)."""
        graph = scope.graph
        name = scope.path or graph.name or "main"
        children: dict[int, list[Scope]] = {}
        for c in scope.children:
            children.setdefault(c.owner_index, []).append(c)
        # What each node's subgraphs read from outside them (the graph layer's free names).
        implicit = {k: tuple(sorted(set().union(*(c.free for c in cs)))) for k, cs in children.items()}
        nodes = list(graph.node)
        local = {i.name for i in graph.input} | set(scope.initializers)
        if scope is self.root:
            local |= set(self.user)

        def available(n: str) -> bool:
            return n in local or scope.defined_outside(n)

        # Each node's inputs, read once (every phase below walks them: a protobuf field read
        # builds a container and its strings anew) and what it reads: plus its subgraphs' names.
        ins = [node.input[:] for node in nodes]
        outs = [node.output[:] for node in nodes]
        return name, children, implicit, nodes, local, available, ins, outs, _reads(ins, implicit)

    def _derive_scope(self, scope: Scope, parts: tuple) -> None:
        """The scope's derived constants (with pre-packing), then its answers settled."""
        name, _children, _implicit, nodes, local, available, _ins, outs, reads = parts
        if self.options.prepack:
            self.derived[scope.path] = self._derivations(scope, nodes, reads, local, available, name, outs)
        self._settled.add(scope.path)  # its derived values are known: _weight's answers hold

    def _plan_scope(self, scope: Scope, parts: tuple | None = None) -> Plan:
        graph = scope.graph
        if parts is None:
            parts = self._scope_parts(scope)
            self._derive_scope(scope, parts)
        name, children, implicit, nodes, local, available, ins, outs, reads = parts
        fusions: list[Fusion] = []
        if self.options.fuse:
            stripped = self._without_identities(scope, nodes, ins, outs, children, implicit)
            if stripped is not None:
                nodes, ins, outs, children, implicit = stripped
                reads = _reads(ins, implicit)
            # without pre-packing, only those that compute as onnxruntime's optimized graph does
            fusions = self._fusions(scope, nodes, ins, implicit, arithmetic_only=not self.options.prepack)
        entries = apply_fusions(nodes, fusions)
        entry_reads = [reads[k] if f is None else [*node.input[:], *implicit.get(k, ())] for k, node, f in entries]
        entry_outs = [outs[k] if f is None else node.output[:] for k, node, f in entries]
        order = topological_order([node for _k, node, _f in entries], available, name, entry_reads, local, entry_outs)
        bound = []
        for idx in order:
            k, node, fusion = entries[idx]
            bound.append(self._bind(scope, node, fusion, children.get(k, []), implicit.get(k, ()), entry_outs[idx],
                                    ins[k] if fusion is None else node.input[:]))
        folded: dict[str, Callable[[], np.ndarray]] = {}
        if self.options.prepack and self.options.fuse and self.options.runnable:  # see _fold.py
            folded = fold_constants([b.step for b in bound], functools.partial(self._weight, scope))
            bound = [self._pack_folded(b, folded) for b in bound if not _all_folded(b.step, folded)]
        steps = self._live(scope, bound, [o.name for o in graph.output])
        # Graph outputs that are constants keep their originals.
        for out in graph.output:
            w = self._weight(scope, out.name)
            if w is not None and not w.user:
                self.unpacked.add((w.scope, out.name))
        input_names = [i.name for i in graph.input]
        if scope is self.root:
            input_names = [n for n in input_names if n not in scope.initializers] + sorted(self.overridable)
        output_names = [o.name for o in graph.output]
        constants = self._constants(scope, output_names)
        if folded:
            read = {n for step in steps for n in (*step.args, *step.implicit) if n} | set(output_names)
            for n, v in folded.items():
                if n in read:
                    value = compute_constant(v, n, f"graph {name!r}")
                    # Read-only: a graph output that folded is copied for the user (to_user)
                    # instead of handing out a view that would change every later run.
                    value.setflags(write=False)
                    constants[n] = value
        return Plan(
            name=name, path=scope.path, input_names=tuple(input_names), output_names=tuple(output_names),
            constants=constants, steps=schedule(steps, input_names, output_names, constants),
            output_types=tuple(o.type.tensor_type.elem_type for o in graph.output),
            output_dims=tuple(_declared_dims(o) for o in graph.output),
        )

    @staticmethod
    def _without_identities(scope: Scope, nodes: list[NodeProto], ins: list[list[str]], outs: list[list[str]],
                            children: dict[int, list[Scope]], implicit: dict[int, tuple[str, ...]]):
        """The scope's nodes without the Identity (and inference Dropout) nodes it can do without,
        their readers reading through them (:func:`._fusion.identity_aliases`: onnxruntime's Identity elimination), as
        ``(nodes, ins, outs, children, implicit)``, the last two keyed by the new indices; None
        when there is none to do without."""
        pinned = {o.name for o in scope.graph.output}
        for names in implicit.values():
            pinned.update(names)
        aliases = identity_aliases(nodes, ins, outs, pinned, set(children))
        if not aliases:
            return None
        kept = [k for k in range(len(nodes)) if not (outs[k] and outs[k][0] in aliases
                                                     and passes_through(nodes[k], ins[k], outs[k]))]
        index = {k: i for i, k in enumerate(kept)}
        return ([read_through(nodes[k], aliases) for k in kept], [[aliases.get(n, n) for n in ins[k]] for k in kept],
                [outs[k] for k in kept], {index[k]: v for k, v in children.items()},
                {index[k]: v for k, v in implicit.items()})

    def _pack_folded(self, b: _Bound, folded: Mapping[str, Callable[[], np.ndarray]]) -> _Bound:
        """The step with the folded constants its kernel packs taken pre-packed.

        A folded value is a weight the model computes from weights (Silero VAD's LSTM reads W, R
        and B as Slice + Concat + Unsqueeze of its LSTMCell weights): unpacked, the kernel would
        re-derive its layout at every run (the LSTM: transposed operands, the summed bias).  The
        pack is made here and not recorded: a folded value has no stored leaf to save it beside,
        and it is computed again at each creation anyway."""
        step = b.step
        kernel = step.kernel
        if kernel is None or kernel.call_mode != "plain" or not folded:
            return b
        packed = set(step.packed)
        for i, name in enumerate(step.inputs):
            if not name or i in packed or name not in folded:
                continue
            value = compute_constant(folded[name], name, f"node {step.node.name!r} ({step.node.op_type})")
            if value.dtype.kind not in "fc":
                continue  # shapes, axes, indices: nothing to pack
            info = TensorInfo(name, value.dtype, tuple(value.shape), np_dtype_to_tensor_dtype(value.dtype))
            try:
                if kernel.pack_spec(i, info) is None:
                    continue
                made = kernel.prepack(i, value)
                if made is None or kernel.check_packed(i, info, tuple(made)) is not None:
                    continue
            except OnnxpackError:
                raise
            except Exception as exc:  # the run would fail the same way: let it
                logger.debug("node %r input %d: folded value not packed (%s)", step.node.name, i, exc)
                continue
            kernel.use_prepacked(i, tuple(made))
            packed.add(i)
        if packed == set(step.packed):
            return b
        return _Bound(dataclasses.replace(step, packed=frozenset(packed)), b.uses, b.events, b.fallback, b.later)

    def _fusions(self, scope: Scope, nodes: list[NodeProto], ins: list[list[str]],
                 implicit: dict[int, tuple[str, ...]], arithmetic_only: bool = False) -> list[Fusion]:
        """Conv → BatchNormalization → Relu and elementwise → Relu chains (see ``_fusion.py``);
        ``ins[k]``: node ``k``'s inputs."""
        # The fusion's input index (name -> the nodes reading it, once per input slot), then the
        # read counts (those, the subgraphs' reads and the graph outputs).
        by_input = inputs_index(ins)
        readers = {n: len(ks) for n, ks in by_input.items()}
        for extra in implicit.values():
            for n in extra:
                if n:
                    readers[n] = readers.get(n, 0) + 1
        protected = {o.name for o in scope.graph.output}
        for n in protected:
            readers[n] = readers.get(n, 0) + 1

        # The scope is settled: _weight's answers are final, kept here by name (the finders ask
        # about each BatchNormalization statistic, scale and zero point several times).
        known: dict[str, WeightRef | None] = {}
        weight = self._weight

        def const_value(n: str) -> np.ndarray | None:
            w = known.get(n, _UNKNOWN)
            if w is _UNKNOWN:
                w = known[n] = weight(scope, n)
            return None if w is None else w.value()

        def is_const(n: str) -> bool:
            w = known.get(n, _UNKNOWN)
            if w is _UNKNOWN:
                w = known[n] = weight(scope, n)
            return w is not None

        def const_meta(n: str) -> ConstMeta | None:
            w = known.get(n, _UNKNOWN)
            if w is _UNKNOWN:
                w = known[n] = weight(scope, n)
            return None if w is None else ConstMeta(tuple(w.shape), np.dtype(w.dtype))

        def const_lazy(n: str) -> Callable[[], np.ndarray]:
            return self._weight(scope, n).value  # the WeightRef alone, not this compiler

        shapes: dict[str, tuple] | None = None

        def declared(n: str) -> tuple | None:
            nonlocal shapes
            if shapes is None:  # (read at the first question: most scopes never ask)
                shapes = declared_shapes(scope.graph)
            return shapes.get(n)

        return plan_fusions(nodes_with_index(nodes, by_input), readers, protected, const_value, self.opsets.get("", 1),
                            is_const, const_meta, const_lazy, self.options.qdq_accuracy_level, arithmetic_only,
                            self.options.qdq_rewrite, declared)

    def _constants(self, scope: Scope, output_names: list[str]) -> dict[str, Any]:
        """The scope's constants: originals still read unpacked (all readers are bound by now:
        they are this scope's nodes and its nested scopes, compiled first)."""
        consts: dict[str, Any] = {}
        user = self.user if scope is self.root else {}
        path = scope.path
        read = {n for p, n in self.unpacked if p == path}
        read.update(output_names)
        initializers = scope.initializers
        for name, tensor in initializers.items():
            if name in user:
                consts[name] = user[name]
            elif name in read:
                consts[name] = tensor.numpy()
            else:
                tensor.drop_pages()  # nothing reads the original: drop its pages
                self.released += 1
        for name in user:
            if name not in initializers:  # a graph input given a value
                consts[name] = user[name]
        if scope is self.root:
            for name in self.overridable:
                consts.pop(name, None)  # fed by the user, or the program's default
        return consts

    # -- one node ---------------------------------------------------------------------------------
    def _bind(self, scope: Scope, node: NodeProto, fusion: Fusion | None, child_scopes: list[Scope],
              implicit: tuple[str, ...], outputs: list[str], inputs: list[str]) -> _Bound:
        # A node of a constant expression (_derive.py: its outputs are derived constants) is bound
        # only if dead-code elimination keeps it, i.e. if some reader takes its output unpacked
        # (see _live): most are dropped (every consumer packed the value), and binding them first
        # would build kernels and pack their inputs (warm: look the packs up and miss) for nothing.
        derived_here = self.derived.get(scope.path, {})
        if (fusion is None and not child_scopes and outputs
                and (outputs[0] in derived_here if len(outputs) == 1 and outputs[0] else all(o in derived_here for o in outputs if o))):
            # (No closure to bind it later: _live binds it from the placeholder, with no fusion and
            # no subgraphs, as here; a closure and its cells per node were garbage to collect.)
            return _Bound(_Unbound(node, tuple(inputs), tuple(outputs), implicit), (), (), None, True)  # type: ignore[arg-type]
        return self._bind_now(scope, node, fusion, child_scopes, implicit, inputs, outputs)

    def _bind_now(self, scope: Scope, node: NodeProto, fusion: Fusion | None, child_scopes: list[Scope],
                  implicit: tuple[str, ...], inputs: Sequence[str], outputs: Sequence[str]) -> _Bound:
        """``inputs``, ``outputs``: the node's names, as the caller read them from the proto."""
        domain = normalize_domain(node.domain)
        if child_scopes:
            ctx = KernelContext(
                opset=self.opsets.get(domain, 1), opsets=self.opsets,
                subgraphs={_subgraph_key(c): self.plans[c.path] for c in child_scopes}, functions=self.functions,
                inline=self.model.inlined,
            )
        else:  # one context per domain for the nodes without graphs (a frozen record: kernels share it)
            ctx = self._contexts.get(domain)
            if ctx is None:
                ctx = self._contexts[domain] = KernelContext(
                    opset=self.opsets.get(domain, 1), opsets=self.opsets, subgraphs=_NO_SUBGRAPHS,
                    functions=self.functions, inline=self.model.inlined)
        resolved = resolve(node, ctx, local_functions=self.local_functions, fusion=fusion,
                           runnable=self.options.runnable,
                           holds_graphs=bool(child_scopes) if fusion is None else None)
        kernel = resolved.kernel
        pack = self.options.prepack and kernel.call_mode == "plain"
        packed, uses, events = self._pack_inputs(scope, node, kernel, pack, inputs)
        if kernel.call_mode == "context":
            # onnx.reference runs this node's graphs itself, reading enclosing values from the
            # frame: the originals they name must stay, whatever the compiled subgraphs packed.
            for name in implicit:
                w = self._weight(scope, name)
                if w is not None and w.derived is None and not w.user:
                    uses.append((w.scope, name))
        step = Step(node, kernel, tuple(inputs), tuple(outputs), frozenset(packed), (), implicit)
        label = f"{scope.path or 'main'}:{node.name or '#'}:{node.op_type}" if resolved.fallback else None
        return _Bound(step, tuple(uses), tuple(events), label)

    def _pack_inputs(self, scope: Scope, node: NodeProto, kernel: Kernel, pack: bool,
                     inputs: Sequence[str]) -> tuple[set[int], list[tuple[str, str]], list[PackEvent]]:
        """Packs the node's constant inputs (``pack``; ``inputs``: the node's input names); returns
        the packed input indices, the constants read unpacked ((owner path, name)) and the pack
        events."""
        packed: set[int] = set()
        uses: list[tuple[str, str]] = []
        events: list[PackEvent] = []
        for i, name in enumerate(inputs):
            if not name:
                continue
            w = self._weight(scope, name)
            if w is None:
                continue
            event = self._pack(scope, node, kernel, i, w) if pack else None
            if event is not None:
                packed.add(i)
                events.append(event)
            elif w.derived is None and not w.user:
                uses.append((w.scope, name))
        return packed, uses, events

    def _live(self, scope: Scope, bound: list[_Bound], outputs: list[str]) -> list[Step]:
        """The steps something reads (dead-code elimination, last to first): a node whose outputs
        are read by no kept step — unpacked — nor by a subgraph, nor are graph outputs, drops out
        (a DequantizeLinear whose weight every consumer packed, a Constant nobody reads).  Only the
        kept steps' constant reads, packs and fallback nodes count."""
        needed = set(outputs)
        kept: list[_Bound] = []
        for b in reversed(bound):
            step = b.step
            if not any(o in needed for o in step.outputs if o):
                continue
            if b.later:  # a kept constant-expression node: bound (and packs) now, see _bind
                b = self._bind_now(scope, step.node, None, [], step.implicit, step.inputs, step.outputs)
                step = b.step
            kept.append(b)
            needed.update(n for i, n in enumerate(step.inputs) if n and i not in step.packed)
            needed.update(step.implicit)
        kept.reverse()
        for b in kept:
            self.unpacked.update(b.uses)
            self.log.extend(b.events)
            if b.fallback is not None:
                self.fallback_nodes.append(b.fallback)
        return [b.step for b in kept]

    def _derivations(self, scope: Scope, nodes: list[NodeProto], reads: list[list[str]], local: set[str],
                     available: Callable[[str], bool], name: str, outs: list[list[str]]) -> dict[str, WeightRef]:
        """Constants computed from stored weights in this scope: ``Constant`` tensors and chains of
        cheap ops over them (see ``_derive.py``), in node order."""
        found: dict[str, WeightRef] = {}
        self.derived[scope.path] = found  # visible to _weight while the chain is followed
        weight_of = functools.partial(self._weight, scope)
        for k in topological_order(nodes, available, name, reads, local, outs):
            node = nodes[k]
            if node.op_type == "Constant" and normalize_domain(node.domain) == "" and node.output and node.output[0]:
                attr = next((a for a in node.attribute[:] if a.name == "value" and a.type == AttributeProto.TENSOR), None)
                if attr is not None:
                    found[node.output[0]] = WeightRef(scope.path, node.output[0], self.model.tensor(attr.t))
                continue
            w = derive(node, weight_of, self.opsets)
            if w is not None:
                found[node.output[0]] = w
        return found

    def _pack(self, scope: Scope, node: NodeProto, kernel: Kernel, i: int, w: WeightRef) -> PackEvent | None:
        if w.elem_type == TensorProto.STRING:
            return None
        info = TensorInfo(w.name, w.dtype, w.shape, w.elem_type)
        try:
            spec = kernel.pack_spec(i, info)
        except OnnxpackError:
            raise
        except Exception as exc:
            raise InvalidGraph(f"node {node.name!r} ({node.op_type}) input {i} ({w.name!r}): "
                               f"{type(exc).__name__}: {exc}") from exc
        if spec is None:  # most constant inputs (scales, shapes, ...): nothing more to do
            return None

        def pack(value: np.ndarray) -> tuple[np.ndarray, ...] | None:
            # A kernel's prepack validates the weight as its run would: a bad weight in a hostile
            # model is that node's InvalidGraph, never a numpy or arithmetic error.
            what = f"node {node.name!r} ({node.op_type}) input {i} ({w.name!r})"
            try:
                made = kernel.prepack(i, value)
                if made is None:  # the kernel declines this value (it runs on the weight as it is)
                    return None
                buffers = tuple(made)
            except OnnxpackError:
                raise
            except Exception as exc:
                raise InvalidGraph(f"{what}: cannot be packed: {type(exc).__name__}: {exc}") from exc
            reason = kernel.check_packed(i, info, buffers)
            if reason is not None:
                raise InvalidGraph(f"{what}: the weight does not fit the node: {reason}")
            return buffers

        if w.derived is not None:
            # The pack of a derived value: keyed by the leaf plus the derivation (saved under the
            # leaf's record), and still the leaf's own bytes only when the chain only reshapes.
            spec = dataclasses.replace(spec, attrs=spec.attrs + b"|derived:" + w.derived.digest,
                                       identity=spec.identity and w.derived.is_view)
        got = self.sources.obtain(
            w, spec, pack, lambda buffers: kernel.check_packed(i, info, buffers),
            self.container, self.holder, label=node.op_type,
        )
        if got is None:
            return None
        kernel.use_prepacked(i, got.entry.buffers)
        return PackEvent(scope.path, node.name, node.op_type, i, w, spec, got.entry, got.origin, got.seconds)


_UNKNOWN = object()


class _Bound:
    """A bound node before dead-code elimination: its step and what it would contribute.

    (A plain class with slots: a QDQ ResNet-50 makes ~250 per creation, and a frozen
    dataclass's __init__ sets each field through object.__setattr__.)"""

    __slots__ = ("step", "uses", "events", "fallback", "later")

    def __init__(self, step: Step, uses: tuple[tuple[str, str], ...], events: tuple[PackEvent, ...],
                 fallback: str | None, later: bool = False) -> None:
        self.step = step
        self.uses = uses
        self.events = events
        self.fallback = fallback
        self.later = later  # an unbound constant-expression node (an _Unbound step), bound if kept (see _bind)


class _Unbound:
    """The step of a constant-expression node not bound yet (see ``_bind``): what constant
    folding and dead-code elimination read of a :class:`Step` (no kernel, nothing packed)."""

    __slots__ = ("node", "inputs", "outputs", "implicit")
    kernel = None
    packed: frozenset[int] = frozenset()

    def __init__(self, node: NodeProto, inputs: tuple[str, ...], outputs: tuple[str, ...],
                 implicit: tuple[str, ...]) -> None:
        self.node = node
        self.inputs = inputs
        self.outputs = outputs
        self.implicit = implicit


def _checked_function(model: Model, function: Any) -> Any:
    """A model-local function whose tensors stored as external data (a Constant's ``value``,
    a nested graph's initializer) hold their bytes inline, read through the model's checked
    loader (its location rules: nothing outside the model's folder): onnx.reference, which runs
    function bodies, would resolve a location against the working directory.  The function
    itself when it has none."""
    from onnxpack.graph._model import subgraphs_of

    def external(nodes) -> bool:
        for node in nodes:
            for a in node.attribute[:]:
                tensors = [a.t] if a.type == AttributeProto.TENSOR else list(a.tensors) if a.type == AttributeProto.TENSORS else []
                if any(t.data_location == TensorProto.EXTERNAL for t in tensors):
                    return True
            for _name, _k, g in subgraphs_of(node):
                if any(t.data_location == TensorProto.EXTERNAL for t in g.initializer) or external(g.node):
                    return True
        return False

    if not external(function.node):
        return function
    copy = type(function)()
    copy.CopyFrom(function)
    stack = list(copy.node)
    while stack:
        node = stack.pop()
        model._inline_attribute_tensors(node)
        for _name, _k, g in subgraphs_of(node):
            for t in g.initializer:
                model._inline(t)
            stack.extend(g.node)
    return copy


def _reads(ins: list[list[str]], implicit: dict[int, tuple[str, ...]]) -> list[list[str]]:
    """What each node reads: its inputs (``ins``), plus the names its subgraphs read (``implicit``,
    by node index)."""
    if not implicit:
        return ins
    return [[*ins[k], *implicit[k]] if k in implicit else ins[k] for k in range(len(ins))]


def _all_folded(step: Step, folded: Mapping[str, Any]) -> bool:
    outs = [o for o in step.outputs if o]
    return bool(outs) and all(o in folded for o in outs)


def _declared_dims(value_info: Any) -> tuple[int | None, ...] | None:
    t = value_info.type
    if t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
        return None
    return tuple(d if isinstance(d, int) else None for d in map(declared_dim, t.tensor_type.shape.dim))
