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

Nothing here runs a model, and nothing reaches back into a session: the caller gets the program,
and its counters come from the log.  Creation is O(nodes + edges): names are resolved through
the graph layer's scope chain, never by building the set of every outer name per scope.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import NodeProto, TensorProto

from onnxpack.errors import InvalidArgument
from onnxpack.graph import Model, Scope
from onnxpack.prepack import PackSources, PrepackedWeightsContainer, WeightRef
from onnxpack.session._api import override_dims
from onnxpack.session._fusion import Fusion, apply_fusions, plan_fusions
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
    """

    prepack: bool = True
    runnable: bool = True
    initializers: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    fuse: bool = True
    dims_by_name: Mapping[str, int] = dataclasses.field(default_factory=dict)
    dims_by_denotation: Mapping[str, int] = dataclasses.field(default_factory=dict)


def compile(model: Model, options: CompileOptions, sources: PackSources,  # noqa: A001 - the compile step
            container: PrepackedWeightsContainer, holder: int) -> Program:
    """Compile ``model`` into a :class:`Program`; packs go into ``container`` held by ``holder``.

    Raises:
        InvalidArgument: an ``add_initializer`` name that is neither an initializer nor an input.
        InvalidGraph: a cycle, a missing input, a name produced twice, an invalid node.
        KernelNotFoundError: a node nobody can run.
    """
    return _Compiler(model, options, sources, container, holder).compile()


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
        self.functions = tuple(model.proto.functions)
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
            n for n in root.initializers if n in root_inputs) if model.proto.ir_version >= 4 else frozenset()
        self.plans: dict[str, Plan] = {}
        self.log: list[PackEvent] = []
        self.fallback_nodes: list[str] = []
        self.unpacked: set[tuple[str, str]] = set()  # (owner scope path, name) read unpacked
        self.released = 0

    def compile(self) -> Program:
        for scope in self.model.scopes():  # bottom-up: children before the node that owns them
            self.plans[scope.path] = self._plan_scope(scope)
        root = self.root
        defaults = {n: (self.user[n] if n in self.user else root.initializers[n].numpy()) for n in self.overridable}
        stats = PrepackStats.from_log(self.log, rejected=self.sources.rejected, released=self.released)
        inputs, outputs = override_dims(root.graph.input, root.graph.output, self.options.dims_by_name,
                                        self.options.dims_by_denotation)
        return Program(
            plans=dict(self.plans), root=self.plans[root.path], overridable=self.overridable, defaults=defaults,
            pack_log=tuple(self.log), fallback_nodes=tuple(self.fallback_nodes), stats=stats,
            inputs=inputs, outputs=outputs,
        )

    # -- names ------------------------------------------------------------------------------------
    def _weight(self, scope: Scope, name: str) -> WeightRef | None:
        """The constant ``name`` refers to from ``scope``, or None if it is not a constant."""
        owner = scope.resolve(name)
        if owner is None:
            return None
        if owner is self.root:
            if name in self.overridable:
                return None
            if name in self.user:
                return WeightRef(owner.path, name, None, self.user[name])
        tensor = owner.initializers.get(name)
        return None if tensor is None else WeightRef(owner.path, name, tensor)

    # -- one scope --------------------------------------------------------------------------------
    def _plan_scope(self, scope: Scope) -> Plan:
        graph = scope.graph
        name = scope.path or graph.name or "main"
        children: dict[int, list[Scope]] = {}
        for c in scope.children:
            children.setdefault(c.owner_index, []).append(c)
        # What each node's subgraphs read from outside them (the graph layer's free names).
        implicit = {k: tuple(sorted(set().union(*(c.free for c in cs)))) for k, cs in children.items()}
        nodes = list(graph.node)
        fusions: list[Fusion] = []
        if self.options.prepack and self.options.fuse:
            fusions = self._fusions(scope, nodes, implicit)
        entries = apply_fusions(nodes, fusions)
        local = {i.name for i in graph.input} | set(scope.initializers)
        if scope is self.root:
            local |= set(self.user)

        def available(n: str) -> bool:
            return n in local or scope.defined_outside(n)

        reads = [(*node.input, *implicit.get(k, ())) for k, node, _f in entries]
        order = topological_order([node for _k, node, _f in entries], available, name, reads)
        steps = []
        for idx in order:
            k, node, fusion = entries[idx]
            steps.append(self._bind(scope, node, fusion, children.get(k, []), implicit.get(k, ())))
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
        return Plan(
            name=name, path=scope.path, input_names=tuple(input_names), output_names=tuple(output_names),
            constants=constants, steps=schedule(steps, input_names, output_names, constants),
            output_types=tuple(o.type.tensor_type.elem_type for o in graph.output),
            output_dims=tuple(_declared_dims(o) for o in graph.output),
        )

    def _fusions(self, scope: Scope, nodes: list[NodeProto], implicit: dict[int, tuple[str, ...]]) -> list[Fusion]:
        """Conv → BatchNormalization → Relu and elementwise → Relu chains (see ``_fusion.py``)."""
        readers: dict[str, int] = {}
        for k, node in enumerate(nodes):
            for n in (*node.input, *implicit.get(k, ())):
                if n:
                    readers[n] = readers.get(n, 0) + 1
        protected = {o.name for o in scope.graph.output}
        for n in protected:
            readers[n] = readers.get(n, 0) + 1

        def const_value(n: str) -> np.ndarray | None:
            w = self._weight(scope, n)
            return None if w is None else w.value()

        return plan_fusions(nodes, readers, protected, const_value, self.opsets.get("", 1))

    def _constants(self, scope: Scope, output_names: list[str]) -> dict[str, Any]:
        """The scope's constants: originals still read unpacked (all readers are bound by now:
        they are this scope's nodes and its nested scopes, compiled first)."""
        consts: dict[str, Any] = {}
        user = self.user if scope is self.root else {}
        for name in set(scope.initializers) | set(user):
            if name in user:
                consts[name] = user[name]
                continue
            if (scope.path, name) not in self.unpacked and name not in output_names:
                scope.initializers[name].drop_pages()  # nothing reads the original: drop its pages
                self.released += 1
                continue
            consts[name] = scope.initializers[name].numpy()
        if scope is self.root:
            for name in self.overridable:
                consts.pop(name, None)  # fed by the user, or the program's default
        return consts

    # -- one node ---------------------------------------------------------------------------------
    def _bind(self, scope: Scope, node: NodeProto, fusion: Fusion | None, child_scopes: list[Scope],
              implicit: tuple[str, ...]) -> Step:
        domain = normalize_domain(node.domain)
        ctx = KernelContext(
            opset=self.opsets.get(domain, 1), opsets=self.opsets,
            subgraphs={_subgraph_key(c): self.plans[c.path] for c in child_scopes}, functions=self.functions,
        )
        resolved = resolve(node, ctx, local_functions=self.local_functions, fusion=fusion,
                           runnable=self.options.runnable)
        kernel = resolved.kernel
        if resolved.fallback:
            self.fallback_nodes.append(f"{scope.path or 'main'}:{node.name or '#'}:{node.op_type}")
        packed: set[int] = set()
        pack = self.options.prepack and kernel.call_mode == "plain"
        for i, name in enumerate(node.input):
            if not name:
                continue
            w = self._weight(scope, name)
            if w is None:
                continue
            if pack and self._pack(scope, node, kernel, i, w):
                packed.add(i)
            elif not w.user:
                self.unpacked.add((w.scope, name))
        if kernel.call_mode == "context":
            # onnx.reference runs this node's graphs itself, reading enclosing values from the
            # frame: the originals they name must stay, whatever the compiled subgraphs packed.
            for name in implicit:
                w = self._weight(scope, name)
                if w is not None and not w.user:
                    self.unpacked.add((w.scope, name))
        return Step(node, kernel, tuple(node.input), tuple(node.output), frozenset(packed), (), implicit)

    def _pack(self, scope: Scope, node: NodeProto, kernel: Kernel, i: int, w: WeightRef) -> bool:
        if w.elem_type == TensorProto.STRING:
            return False
        info = TensorInfo(w.name, w.dtype, w.shape, w.elem_type)
        spec = kernel.pack_spec(i, info)
        if spec is None:
            return False
        got = self.sources.obtain(
            w, spec, lambda value: kernel.prepack(i, value), lambda buffers: kernel.check_packed(i, info, buffers),
            self.container, self.holder, label=node.op_type,
        )
        if got is None:
            return False
        kernel.use_prepacked(i, got.entry.buffers)
        self.log.append(PackEvent(scope.path, node.name, node.op_type, i, w, spec, got.entry, got.origin, got.seconds))
        return True


def _declared_dims(value_info: Any) -> tuple[int | None, ...] | None:
    t = value_info.type
    if t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
        return None
    return tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim)
