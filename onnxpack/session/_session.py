"""InferenceSession: onnxruntime's Python API over the numpy executor, with pre-packing."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, NodeProto, TensorProto, helper

from onnxpack.errors import InvalidArgument, InvalidGraph, OnnxpackError
from onnxpack.graph import Model, Scope, Tensor, load_model
from onnxpack.prepack import PrePackedWeights, PrepackedWeightsContainer, content_identity, file_identity
from onnxpack.session._arena import ArenaRunner
from onnxpack.session._control import CONTROL_FLOW
from onnxpack.session._executor import ScopePlan, Step, topological_order
from onnxpack.session._fusion import ReluAfter, bn_fold, find_conv_fusions, find_relu_fusions, fused_node
from onnxpack.session.kernels.conv import FusedConv
from onnxpack.session._fallback import FallbackKernel
from onnxpack.session._sources import PrepackSources, save_optimized
from onnxpack.session.kernels import KernelContext, TensorInfo, lookup
from onnxpack.session.kernels._base import normalize_domain
from onnxpack.session.options import SessionOptions, validate_config

logger = logging.getLogger(__name__)

__all__ = ["InferenceSession", "NodeArg", "ModelMetadata", "PrepackStats"]

_HOLDER_IDS = itertools.count(1)
_SUPPORTED_PROVIDERS = ("CPUExecutionProvider",)


@dataclasses.dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime describes it."""

    name: str
    type: str  # "tensor(float)"
    shape: list[int | str | None]


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


@dataclasses.dataclass
class PrepackStats:
    """Where every packed weight of a session came from, and what it cost."""

    weights_packed: int = 0  # packed at creation by this session
    blobs_from_model: int = 0  # mapped from the model's data file
    blobs_from_cache: int = 0  # mapped from the persistent cache file
    blobs_from_container: int = 0  # already in the (shared) container
    blobs_rejected: int = 0  # saved blobs ignored with a warning (then re-packed)
    bytes_packed: int = 0
    bytes_mapped: int = 0
    bytes_held: int = 0  # bytes of every packed weight this session uses
    seconds_packing: float = 0.0
    originals_released: int = 0  # weights whose every consumer uses a packed form

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ELEM_NAMES = {
    v: k.lower() for k, v in TensorProto.DataType.items() if k not in ("UNDEFINED",)
}
_ORT_TYPE_NAMES = {"float": "float", "double": "double", "float16": "float16", "bfloat16": "bfloat16", "bool": "bool", "string": "string"}


def _type_string(type_proto: onnx.TypeProto) -> str:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({_ELEM_NAMES.get(type_proto.tensor_type.elem_type, 'undefined')})"
    if kind == "sequence_type":
        return f"seq({_type_string(type_proto.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({_type_string(type_proto.optional_type.elem_type)})"
    if kind == "map_type":
        m = type_proto.map_type
        return f"map({_ELEM_NAMES.get(m.key_type, 'undefined')},{_type_string(m.value_type)})"
    if kind == "sparse_tensor_type":
        return f"sparse_tensor({_ELEM_NAMES.get(type_proto.sparse_tensor_type.elem_type, 'undefined')})"
    return "unknown"


def _shape_of(type_proto: onnx.TypeProto) -> list[int | str | None] | None:
    if type_proto.WhichOneof("value") != "tensor_type" or not type_proto.tensor_type.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for d in type_proto.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def _node_arg(vi: onnx.ValueInfoProto) -> NodeArg:
    shape = _shape_of(vi.type)
    return NodeArg(vi.name, _type_string(vi.type), shape if shape is not None else [])


def _subgraph_attrs(node: NodeProto) -> list[tuple[str, int | None, onnx.GraphProto]]:
    out = []
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            out.append((attr.name, None, attr.g))
        elif attr.type == AttributeProto.GRAPHS:
            out.extend((attr.name, k, g) for k, g in enumerate(attr.graphs))
    return out


class _ConstRef:
    """A constant as a kernel input: the tensor, the scope that owns it, and its identity."""

    __slots__ = ("name", "tensor", "owner", "array", "user")

    def __init__(self, name: str, tensor: Tensor | None, owner: Scope, array: np.ndarray | None = None) -> None:
        self.name = name
        self.tensor = tensor
        self.owner = owner
        self.array = array  # user-given (add_initializer) value
        self.user = array is not None

    def info(self) -> TensorInfo:
        if self.user:
            a = self.array
            return TensorInfo(self.name, a.dtype, tuple(a.shape), helper.np_dtype_to_tensor_dtype(a.dtype))
        t = self.tensor
        return TensorInfo(self.name, t.dtype, t.dims, t.elem_type)

    def value(self) -> np.ndarray:
        return self.array if self.user else self.tensor.numpy()

    def identity(self) -> bytes:
        if self.user:
            return content_identity(self.array)
        ext = self.tensor.external
        if ext is not None:
            return file_identity(*ext.file_id, ext.offset, ext.length)
        return content_identity(self.tensor.raw())


class InferenceSession:
    """Runs an ONNX model with numpy; mirrors ``onnxruntime.InferenceSession``.

    Args:
        path_or_bytes: model file path, or the serialized model.
        sess_options: :class:`SessionOptions` (config keys, optimized model path, initializers).
        providers: ``None`` or ``["CPUExecutionProvider"]``.
        prepacked_weights_container: a :class:`PrepackedWeightsContainer` shared with other
            sessions; without one, the session owns a local container shared by its subgraphs.
    """

    def __init__(
        self,
        path_or_bytes: str | os.PathLike | bytes,
        sess_options: SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[dict] | None = None,
        *,
        prepacked_weights_container: PrepackedWeightsContainer | None = None,
    ) -> None:
        self._closed = True
        self._options = sess_options if sess_options is not None else SessionOptions()
        if not isinstance(self._options, SessionOptions):
            raise InvalidArgument(f"sess_options: expected onnxpack.SessionOptions, got {type(sess_options).__name__}")
        self._config = validate_config(self._options.config)
        self._providers = self._check_providers(providers)
        if prepacked_weights_container is not None and not isinstance(prepacked_weights_container, PrepackedWeightsContainer):
            raise InvalidArgument(
                "prepacked_weights_container: expected onnxpack.PrepackedWeightsContainer, "
                f"got {type(prepacked_weights_container).__name__}"
            )
        self._container = prepacked_weights_container if prepacked_weights_container is not None else PrepackedWeightsContainer()
        self._shared_container = prepacked_weights_container is not None
        self._holder = next(_HOLDER_IDS)
        self._finalizer = weakref.finalize(self, self._container.release, self._holder)
        self._stats = PrepackStats()
        self._packed_log: list[dict[str, Any]] = []  # for inspect: node, input, weight, key, bytes, origin
        self._held: dict[str, int] = {}  # key -> bytes of every pack this session uses
        self._fallback_nodes: list[str] = []

        self._model: Model = load_model(path_or_bytes if isinstance(path_or_bytes, bytes) else os.fspath(path_or_bytes))
        try:
            self._setup_prepack_sources()
            self._build()
            self._stats.blobs_rejected = self._sources.rejected
            self._sources.flush_cache()
            self._save_if_asked()
        except BaseException:
            self._finalizer()
            self._model.close()
            raise
        planner = self._config["onnxpack.memory_planner"]
        self._arena = None if planner in (None, "none") else ArenaRunner(self._root_plan, planner)
        self._closed = False

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _check_providers(providers: Sequence[Any] | None) -> list[str]:
        if providers is None:
            return list(_SUPPORTED_PROVIDERS)
        names = []
        for p in providers:
            name = p[0] if isinstance(p, tuple) else p
            if name not in _SUPPORTED_PROVIDERS:
                raise InvalidArgument(
                    f"providers: onnxpack runs on {', '.join(_SUPPORTED_PROVIDERS)} only, got {name!r}"
                )
            names.append(name)
        return names

    def _setup_prepack_sources(self) -> None:
        """Hook for saved blobs (model file) and the persistent cache file; see _sources.py."""
        self._sources = PrepackSources(self._model, self._config)

    def _build(self) -> None:
        model = self._model
        self._opsets = dict(model.opsets)
        self._functions = list(model.proto.functions)
        self._function_ids = {(normalize_domain(f.domain), f.name) for f in self._functions}
        self._prepack_on = not self._config["session.disable_prepacking"]
        user_inits = self._options.initializers
        root = model.root
        root_inputs = {i.name for i in root.graph.input}
        unknown = sorted(set(user_inits) - set(root.initializers) - root_inputs)
        if unknown:
            raise InvalidArgument(f"add_initializer: {unknown} are neither initializers nor inputs of the model")
        self._user_inits = user_inits
        # Before IR 4 every initializer had to be listed as an input too; onnxruntime treats them
        # as constants there (not feedable, not overridable), and so do we.
        self._overridable = {n for n in root.initializers if n in root_inputs} if model.proto.ir_version >= 4 else set()
        self._plans: dict[int, ScopePlan] = {}
        self._fusions: dict[int, dict[str, Any]] = {}  # id(fused Conv node) -> FusedConv arguments
        unpacked_uses: set[tuple[int, str]] = set()  # (id(owner scope), name) read unpacked
        for scope in model.scopes():  # bottom-up: children before the node that owns them
            plan = self._plan_scope(scope, unpacked_uses)
            self._plans[id(scope)] = plan
        # Constants: only originals still read unpacked somewhere stay referenced.
        released = 0
        for scope in model.scopes():
            plan = self._plans[id(scope)]
            consts: dict[str, Any] = {}
            names = set(scope.initializers) | (set(user_inits) if scope is root else set())
            for name in names:
                if scope is root and name in user_inits:
                    value: Any = user_inits[name]
                else:
                    if (id(scope), name) not in unpacked_uses and name not in plan.output_names:
                        # Nothing reads the original: drop the pages packing faulted in.
                        scope.initializers[name].drop_pages()
                        released += 1
                        continue
                    value = scope.initializers[name].numpy()
                consts[name] = value
            if scope is root:
                for name in self._overridable:
                    consts.pop(name, None)  # fed by the user, or the default below
                self._overridable_defaults = {
                    n: (user_inits[n] if n in user_inits else root.initializers[n].numpy()) for n in self._overridable
                }
            plan.constants = consts
        self._stats.originals_released = released
        self._root_plan = self._plans[id(root)]
        self._stats.bytes_held = sum(self._held.values())

    def _resolve_const(self, scope: Scope, name: str) -> _ConstRef | None:
        """The initializer ``name`` refers to from ``scope``, or None if it is not a constant."""
        s: Scope | None = scope
        while s is not None:
            if name in s.initializers:
                if s is self._model.root and name in self._overridable:
                    return None
                if s is self._model.root and name in self._user_inits:
                    return _ConstRef(name, None, s, self._user_inits[name])
                return _ConstRef(name, s.initializers[name], s)
            if s is self._model.root and name in self._user_inits:
                return _ConstRef(name, None, s, self._user_inits[name])
            if name in s.defined:
                return None
            s = s.parent
        return None

    def _plan_scope(self, scope: Scope, unpacked_uses: set[tuple[int, str]]) -> ScopePlan:
        graph = scope.graph
        name = scope.path or graph.name or "main"
        available = {i.name for i in graph.input} | set(scope.initializers)
        if scope.parent is None:
            available |= set(self._user_inits)
        outer = _visible_outer_names(scope)
        available |= outer
        children: dict[int, list[Scope]] = {}
        for c in scope.children:
            children.setdefault(id(c.owner), []).append(c)
        # What each node's subgraphs read from outside them (the graph layer's free names).
        implicit = {k: tuple(sorted(set().union(*(c.free for c in cs)))) for k, cs in children.items()}
        nodes = list(graph.node)
        if self._prepack_on:
            nodes = self._fuse(scope, nodes, implicit)
        reads = [(*node.input, *implicit.get(id(node), ())) for node in nodes]
        order = topological_order(nodes, available, name, reads)
        steps = []
        for idx in order:
            node = nodes[idx]
            step = self._bind(scope, node, children.get(id(node), []), unpacked_uses)
            step.implicit = implicit.get(id(node), ())
            steps.append(step)
        # Graph outputs that are constants keep their originals.
        for out in graph.output:
            ref = self._resolve_const(scope, out.name)
            if ref is not None and not ref.user:
                unpacked_uses.add((id(ref.owner), out.name))
        input_names = [i.name for i in graph.input]
        if scope.parent is None:
            input_names = [n for n in input_names if n not in scope.initializers] + sorted(self._overridable)
        plan = ScopePlan(name, input_names, [o.name for o in graph.output], {}, steps, outer)
        plan.output_types = [o.type.tensor_type.elem_type for o in graph.output]
        plan.output_dims = [
            None if (dims := _shape_of(o.type)) is None else [d if isinstance(d, int) else None for d in dims]
            for o in graph.output
        ]
        return plan

    def _fuse(self, scope: Scope, nodes: list[NodeProto], implicit: dict[int, tuple[str, ...]]) -> list[NodeProto]:
        """Fold Conv → BatchNormalization → Relu chains (see ``_fusion.py``)."""
        readers: dict[str, int] = {}
        for node in nodes:
            for n in (*node.input, *implicit.get(id(node), ())):
                if n:
                    readers[n] = readers.get(n, 0) + 1
        protected = {o.name for o in scope.graph.output}
        for n in protected:
            readers[n] = readers.get(n, 0) + 1

        def is_const(n: str) -> bool:
            return self._resolve_const(scope, n) is not None

        fusions = find_conv_fusions(nodes, readers, protected, is_const, self._opsets.get("", 1))
        taken = {i for f in fusions for i in (f.conv, *f.absorbed)}
        for f in find_relu_fusions(nodes, readers, protected, taken):
            node = fused_node(nodes, f)
            self._fusions[id(node)] = {"relu_after": True}
            nodes = [node if k == f.conv else n for k, n in enumerate(nodes)]
            taken.add(f.relu)
        if not fusions and not taken:
            return nodes
        absorbed: set[int] = {i for i in taken if nodes[i].op_type == "Relu"}
        replaced: dict[int, NodeProto] = {}
        for f in fusions:
            node = fused_node(nodes, f)
            multiplier = shift = None
            if f.bn is not None:
                bn = nodes[f.bn]
                scale, bias, mean, var = (self._resolve_const(scope, n).value() for n in bn.input[1:5])
                eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
                conv = nodes[f.conv]
                cb = self._resolve_const(scope, conv.input[2]).value() if len(conv.input) > 2 and conv.input[2] else None
                multiplier, shift = bn_fold(scale, bias, mean, var, eps, cb)
                del node.input[2:]  # the Conv bias is folded into the shift
            self._fusions[id(node)] = {"multiplier": multiplier, "shift": shift, "relu": f.relu is not None}
            replaced[f.conv] = node
            absorbed.update(f.absorbed)
        return [replaced.get(k, n) for k, n in enumerate(nodes) if k not in absorbed]

    def _bind(self, scope: Scope, node: NodeProto, child_scopes: list[Scope], unpacked_uses: set) -> Step:
        domain = normalize_domain(node.domain)
        opset = self._opsets.get(domain, 1)
        ctx = KernelContext(opset=opset, opsets=self._opsets)
        kernel: Any = None
        needs_frame = needs_context = False
        sub_attrs = _subgraph_attrs(node)
        if domain == "" and node.op_type in CONTROL_FLOW and (domain, node.op_type) not in self._function_ids:
            cls, lowest = CONTROL_FLOW[node.op_type]
            if opset >= lowest:
                plans = {child.attr_name: self._plans[id(child)] for child in child_scopes}
                try:
                    kernel = cls(node, ctx, plans)
                    needs_frame = True
                except NotImplementedError:
                    kernel = None
        fusion = self._fusions.get(id(node))
        if fusion is not None and not fusion.get("relu_after"):
            kernel = FusedConv(node, ctx, **fusion)
        if kernel is None and not sub_attrs and (domain, node.op_type) not in self._function_ids:
            cls = lookup(domain, node.op_type, opset)
            if cls is not None:
                try:
                    kernel = cls(node, ctx)
                except NotImplementedError as exc:
                    logger.debug("node %r (%s): native kernel declined (%s); using onnx.reference", node.name, node.op_type, exc)
                    kernel = None
                except OnnxpackError:
                    raise
                except Exception as exc:  # e.g. an attribute of the wrong type in a hostile model
                    raise InvalidGraph(
                        f"node {node.name!r} ({node.op_type}): invalid node for its kernel: {type(exc).__name__}: {exc}"
                    ) from exc
        if kernel is None:
            kernel = FallbackKernel(node, ctx, self._functions)
            needs_context = kernel.needs_context
            self._fallback_nodes.append(f"{scope.path or 'main'}:{node.name or '#'}:{node.op_type}")
            logger.debug("node %r (%s): onnx.reference fallback", node.name, node.op_type)
        if fusion is not None and fusion.get("relu_after"):
            kernel = ReluAfter(kernel)
        packed: set[int] = set()
        for i, name in enumerate(node.input):
            if not name:
                continue
            ref = self._resolve_const(scope, name)
            if ref is None:
                continue
            if self._prepack_on and not needs_frame and not needs_context and self._try_prepack(scope, node, kernel, i, ref):
                packed.add(i)
            elif not ref.user:
                unpacked_uses.add((id(ref.owner), name))
        # Names used implicitly by subgraphs are read unpacked only if the subgraph did so; those
        # reads were recorded when the child scopes were planned (they resolve to the same owner).
        return Step(node, kernel, tuple(node.input), tuple(node.output), frozenset(packed), (), needs_frame, needs_context)

    def _try_prepack(self, scope: Scope, node: NodeProto, kernel: Any, i: int, ref: _ConstRef) -> bool:
        info = ref.info()
        if info.elem_type == TensorProto.STRING:
            return False
        spec = kernel.pack_spec(i, info)
        if spec is None:
            return False
        entry, origin = self._sources.obtain(
            self, kernel, i, ref, info, spec, self._container, self._holder
        )
        if entry is None:
            return False
        kernel.use_prepacked(i, entry.buffers)
        key = entry.key
        self._held[key] = entry.nbytes
        self._packed_log.append(
            {"scope": scope.path, "node": node.name, "op_type": node.op_type, "input": i, "weight": ref.name,
             "key": key, "nbytes": entry.nbytes, "origin": origin}
        )
        return True

    def _count(self, origin: str, entry: PrePackedWeights, seconds: float = 0.0) -> None:
        s = self._stats
        if origin == "packed":
            s.weights_packed += 1
            s.bytes_packed += entry.nbytes
            s.seconds_packing += seconds
        elif origin == "model":
            s.blobs_from_model += 1
            s.bytes_mapped += entry.nbytes
        elif origin == "cache":
            s.blobs_from_cache += 1
            s.bytes_mapped += entry.nbytes
        elif origin == "container":
            s.blobs_from_container += 1

    def _save_if_asked(self) -> None:
        path = self._options.optimized_model_filepath
        if not path:
            return
        save_optimized(self, os.fspath(path))

    # -- API ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this InferenceSession is closed")

    def get_inputs(self) -> list[NodeArg]:
        init = set(self._model.root.initializers)
        return [_node_arg(i) for i in self._model.proto.graph.input if i.name not in init]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(o) for o in self._model.proto.graph.output]

    def get_overridable_initializers(self) -> list[NodeArg]:
        return [_node_arg(i) for i in self._model.proto.graph.input if i.name in self._overridable]

    def get_modelmeta(self) -> ModelMetadata:
        p = self._model.proto
        return ModelMetadata(
            producer_name=p.producer_name,
            graph_name=p.graph.name,
            domain=p.domain,
            description=p.doc_string,
            graph_description=p.graph.doc_string,
            version=p.model_version if p.HasField("model_version") else 2**63 - 1,  # ORT's kNoVersion
            custom_metadata_map={m.key: m.value for m in p.metadata_props if not m.key.startswith("onnxpack.prepacked/")},
        )

    def get_session_options(self) -> SessionOptions:
        return self._options

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_prepack_stats(self) -> dict[str, Any]:
        return self._stats.as_dict()

    def get_fallback_nodes(self) -> list[str]:
        """Nodes run by onnx.reference (no native kernel), as ``scope:node:op_type``."""
        return list(self._fallback_nodes)

    def get_prepack_log(self) -> list[dict[str, Any]]:
        """One row per packed kernel input: node, weight, key, bytes and where the blob came from."""
        return [dict(r) for r in self._packed_log]

    @property
    def model(self) -> Model:
        return self._model

    def run(self, output_names: Sequence[str] | None, input_feed: dict[str, Any], run_options: Any = None) -> list[np.ndarray]:
        self._check_open()
        plan = self._root_plan
        feeds = self._validate_feed(input_feed)
        all_outputs = plan.output_names
        if output_names:
            missing = [n for n in output_names if n not in all_outputs]
            if missing:
                raise InvalidArgument(f"run: unknown output name(s) {missing}; the model's outputs are {all_outputs}")
        inputs = [feeds[n] for n in plan.input_names]
        arena = self._arena
        values = plan.run(inputs, None) if arena is None else arena.run(inputs)
        result = dict(zip(all_outputs, values))
        names = list(output_names) if output_names else all_outputs
        return [_to_user(result[n]) for n in names]

    def get_memory_plan(self, input_shapes: dict[str, Sequence[int]] | None = None) -> dict[str, Any] | None:
        """The activation memory plan of the root graph, or ``None`` when there is none yet.

        Plans are made at the first run for a set of input shapes (with
        ``onnxpack.memory_planner`` set), so this is ``None`` before that run and when the
        planner is off.  Without ``input_shapes`` the latest plan is returned.  The dict is
        :meth:`PlanResult.as_dict` (algorithm, totals, lower bound, per memory arena/peak, per
        tensor name/memory/offset/size/first/last, plus nbytes/dtype/shape/node) with the input
        ``signature``, ``steps``, ``planned_steps`` and the ``lifetimes`` planned.
        """
        self._check_open()
        return None if self._arena is None else self._arena.memory_plan(input_shapes)

    def _validate_feed(self, input_feed: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(input_feed, dict):
            raise InvalidArgument(f"run: input_feed must be a dict of name -> array, got {type(input_feed).__name__}")
        graph = self._model.proto.graph
        consts = self._model.root.initializers
        declared = {i.name: i for i in graph.input if i.name not in consts or i.name in self._overridable}
        unknown = [n for n in input_feed if n not in declared]
        if unknown:
            required = [i.name for i in self.get_inputs()]
            raise InvalidArgument(f"run: unknown input name(s) {unknown}; the model's inputs are {required}")
        feeds: dict[str, Any] = {}
        for vi in declared.values():
            name = vi.name
            if name not in input_feed:
                if name in self._overridable:
                    feeds[name] = self._overridable_defaults[name]
                    continue
                raise InvalidArgument(f"run: missing input {name!r} ({_type_string(vi.type)}, shape {_shape_of(vi.type)})")
            feeds[name] = _check_input(name, vi.type, input_feed[name])
        return feeds

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._root_plan = None  # type: ignore[assignment]
        self._arena = None
        self._plans.clear()
        self._held.clear()
        self._model.close()

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _visible_outer_names(scope: Scope) -> set[str]:
    """Every name the enclosing scopes define (the graph layer's ``defined`` sets)."""
    names: set[str] = set()
    s = scope.parent
    while s is not None:
        names |= s.defined
        s = s.parent
    return names


def _to_user(value: Any) -> Any:
    """Outputs are the user's to keep and modify: never a read-only view of a weight or blob."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return np.array(value)
    return value


def _check_input(name: str, type_proto: onnx.TypeProto, value: Any) -> Any:
    if type_proto.WhichOneof("value") != "tensor_type":
        return value
    tt = type_proto.tensor_type
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    try:
        expected = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
    except Exception:
        expected = None
    if expected is not None and arr.dtype != expected and not (expected == object and arr.dtype.kind in "USO"):
        raise InvalidArgument(
            f"run: input {name!r} has the wrong type: expected {_type_string(type_proto)} "
            f"({expected}), got {arr.dtype}"
        )
    if tt.HasField("shape"):
        dims = tt.shape.dim
        if arr.ndim != len(dims):
            raise InvalidArgument(
                f"run: input {name!r} has the wrong rank: expected {len(dims)} "
                f"(shape {_shape_of(type_proto)}), got {arr.ndim} (shape {list(arr.shape)})"
            )
        for k, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value != arr.shape[k]:
                raise InvalidArgument(
                    f"run: input {name!r} has the wrong shape: dimension {k} expected {d.dim_value}, "
                    f"got {arr.shape[k]} (expected {_shape_of(type_proto)}, got {list(arr.shape)})"
                )
    return arr
