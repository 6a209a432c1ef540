"""Model, scopes and the one bottom-up walker.

A *scope* is one GraphProto: the root graph or a graph held by a node attribute (If branches,
Loop/Scan bodies, any GRAPH/GRAPHS attribute, nested to any depth).  Names that a scope uses but
does not define resolve to the nearest enclosing scope that defines them (ONNX outer-scope
rule); :attr:`Scope.outer_refs` records which of those are enclosing *initializers*, because those
are the weights a subgraph's kernels pre-pack and the saver must externalize with their owner.

Scope paths
-----------
The root's path is ``""``.  A child's path is
``f"{parent.path}/{label}.{attr_name}"`` plus ``f"[{k}]"`` for the k-th graph of a GRAPHS
attribute, where ``label`` is the owner node's name when it is non-empty, does not start with
``#`` and is unique among the nodes of its graph, else ``f"#{node_index}"``.  In the pathological
case where two different scopes still spell the same path (node names containing ``/`` and ``.``
crafted to collide), the later one in pre-order gets ``#{node_index}`` and then a ``~{n}``
suffix.  Paths depend only on the graph structure and node names, so a model saved and loaded
again has the same paths — which is what the prepack layer keys its records by.
"""

from __future__ import annotations

import collections
import logging
import math
import os
from collections.abc import Iterator

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from onnxpack.errors import InvalidGraph, ModelLoadError
from onnxpack.graph._attributes import allowed as _allowed_attributes
from onnxpack.graph._external import DataFiles, read_regular_file
from onnxpack.graph._proto import AttributeProto, GraphProto, ModelProto, NodeProto, SparseTensorProto, TensorProto
from onnxpack.graph._tensor import Tensor

__all__ = ["Model", "Scope", "load_model", "walk", "subgraphs_of", "sparse_to_dense"]

logger = logging.getLogger(__name__)


_GRAPH, _GRAPHS, _UNDEFINED = AttributeProto.GRAPH, AttributeProto.GRAPHS, AttributeProto.UNDEFINED
# Attribute types that never hold a graph: skipped on one set test (most attributes of most nodes).
_NO_GRAPH_TYPES = frozenset(t for t in AttributeProto.AttributeType.values() if t not in (_GRAPH, _GRAPHS, _UNDEFINED))
# Attribute types that hold neither a graph nor a tensor (most attributes of most nodes).
_SCALAR_TYPES = frozenset({AttributeProto.FLOAT, AttributeProto.INT, AttributeProto.STRING, AttributeProto.FLOATS,
                           AttributeProto.INTS, AttributeProto.STRINGS})
_UNSEEN = object()  # an op whose allowed attribute names are not looked up yet


def subgraphs_of(node: NodeProto) -> Iterator[tuple[str, int | None, GraphProto]]:
    """Yields ``(attr_name, k, graph)`` for each graph a node holds (``k`` is None for GRAPH)."""
    for attr in node.attribute[:]:  # a slice: upb's containers iterate through __getitem__ + IndexError
        kind = attr.type
        if kind in _NO_GRAPH_TYPES:
            continue
        if kind == _GRAPH or (kind == _UNDEFINED and attr.HasField("g")):
            yield attr.name, None, attr.g
        elif kind == _GRAPHS:
            for k, g in enumerate(attr.graphs):
                yield attr.name, k, g


class Scope:
    """One graph of a model with its place in the scope tree.

    Attributes:
        graph: the GraphProto.
        parent: enclosing scope (``None`` for the root).
        owner: node whose attribute holds this graph (``None`` for the root).
        owner_index: index of ``owner`` in the parent's ``graph.node`` (``None`` for the root).
        attr_name, attr_index: the owner's attribute holding this graph, and k for GRAPHS.
        path: unique, stable path of the scope (see the module docstring).
        children: scopes of the graphs held by this scope's nodes, in node order.
        initializers: dense initializers defined in this graph (sparse ones converted to dense).
        outer_refs: names used by this scope's nodes or its nested scopes that resolve to an
            enclosing scope's initializer -> the scope that owns it.
        defined: every name this scope defines (inputs, initializers, node outputs).
        free: every name this scope's nodes, outputs or nested scopes use but this scope does not
            define (its implicit inputs, resolved in enclosing scopes).
    """

    __slots__ = ("graph", "parent", "owner", "owner_index", "attr_name", "attr_index", "path",
                 "children", "initializers", "outer_refs", "defined", "free")

    def __init__(self, graph: GraphProto, parent: Scope | None, owner: NodeProto | None,
                 owner_index: int | None, path: str) -> None:
        self.graph = graph
        self.parent = parent
        self.owner = owner
        self.owner_index = owner_index
        self.attr_name: str | None = None  # attribute of ``owner`` holding this graph
        self.attr_index: int | None = None  # k for GRAPHS attributes
        self.path = path
        self.children: list[Scope] = []
        self.initializers: dict[str, Tensor] = {}
        self.outer_refs: dict[str, Scope] = {}
        self.defined: set[str] = set()
        self.free: set[str] = set()

    def __repr__(self) -> str:
        return f"Scope({self.path!r}, graph={self.graph.name!r}, {len(self.initializers)} initializers)"

    def resolve(self, name: str) -> Scope | None:
        """The scope whose definition ``name`` refers to from here: this scope or the nearest
        enclosing one that defines it (inputs, initializers, node outputs); ``None`` if none."""
        scope: Scope | None = self
        while scope is not None:
            if name in scope.defined:
                return scope
            scope = scope.parent
        return None

    def defined_outside(self, name: str) -> bool:
        """Whether an enclosing scope defines ``name`` (an implicit input would resolve)."""
        return self.parent is not None and self.parent.resolve(name) is not None

    def lookup_initializer(self, name: str) -> Tensor | None:
        """Resolves ``name`` innermost scope first; ``None`` when the nearest definition is not an
        initializer (an input or node output shadows outer initializers of the same name)."""
        owner = self.resolve(name)
        return None if owner is None else owner.initializers.get(name)


def walk(root: Scope) -> Iterator[Scope]:
    """Yields ``root`` and every nested scope bottom-up: each scope's children (in node order,
    recursively) before the scope itself, so the root comes last.  Iterative: depth is unbounded."""
    stack: list[tuple[Scope, bool]] = [(root, False)]
    while stack:
        scope, expanded = stack.pop()
        if expanded:
            yield scope
            continue
        stack.append((scope, True))
        for child in reversed(scope.children):
            stack.append((child, False))


# A sparse initializer is densified at load (as onnxruntime does); its dense form may not exceed
# this many bytes, so that a hostile model declaring huge dims is an error before any allocation.
MAX_DENSE_SPARSE_BYTES = 1 << 34  # 16 GiB


def _check_sparse(sparse: SparseTensorProto, what: str) -> None:
    """Dims, value and index counts of a sparse tensor (before anything is read)."""
    dims = tuple(int(d) for d in sparse.dims)
    if any(d < 0 for d in dims):
        raise ModelLoadError(f"{what}: sparse tensor has a negative dimension in {dims}")
    nvals = math.prod(int(d) for d in sparse.values.dims)
    idims = tuple(int(d) for d in sparse.indices.dims)
    if len(sparse.values.dims) != 1:
        raise ModelLoadError(f"{what}: sparse values must be 1-D, got shape {tuple(sparse.values.dims)}")
    if len(idims) == 1:
        ok = idims[0] == nvals
    elif len(idims) == 2:
        ok = idims == (nvals, len(dims))
    else:
        ok = False
    if not ok:
        raise ModelLoadError(
            f"{what}: sparse indices of shape {idims} do not match {nvals} values of a {len(dims)}-D "
            f"tensor (expected ({nvals},) or ({nvals}, {len(dims)}))"
        )


def _sparse_to_dense(sparse: SparseTensorProto, files: DataFiles | None, what: str | None = None) -> Tensor:
    name = sparse.values.name
    what = what or f"sparse initializer {name!r}"
    _check_sparse(sparse, what)
    dims = tuple(int(d) for d in sparse.dims)
    values = Tensor(sparse.values, files)
    indices = Tensor(sparse.indices, files)
    count = math.prod(dims)
    if count * values.dtype.itemsize > MAX_DENSE_SPARSE_BYTES:
        raise ModelLoadError(
            f"{what}: dense shape {dims} needs {count * values.dtype.itemsize} bytes, more than the "
            f"{MAX_DENSE_SPARSE_BYTES} a sparse initializer may densify to"
        )
    vals = values.numpy().reshape(-1)
    idx = indices.numpy().astype(np.int64, copy=False)
    dense = np.zeros(count, dtype=vals.dtype)
    try:
        if idx.ndim == 2:  # COO with one column per dimension
            if idx.size and (idx.min() < 0 or np.any(idx >= np.asarray(dims, dtype=np.int64))):
                raise ValueError("an index is negative or beyond its dimension")
            flat = np.ravel_multi_index(tuple(idx.T), dims) if idx.size else idx.reshape(-1)
        else:
            flat = idx.reshape(-1)
            if flat.size and (flat.min() < 0 or flat.max() >= count):
                raise ValueError(f"a linear index is negative or not below {count}")
        if flat.size > 1 and np.any(np.diff(flat) <= 0):
            raise ValueError("indices are not strictly increasing (duplicates or out of order)")
        dense[flat] = vals
    except (ValueError, IndexError) as e:
        raise ModelLoadError(f"{what}: indices {idx.shape} do not fit shape {dims}: {e}") from e
    dense = dense.reshape(dims)
    dense.flags.writeable = False
    proto = TensorProto()
    proto.name = name
    proto.data_type = sparse.values.data_type
    proto.dims.extend(dims)
    return Tensor(proto, None, array=dense)


def sparse_to_dense(sparse: SparseTensorProto, what: str = "sparse tensor") -> np.ndarray:
    """The dense, read-only array of an in-proto sparse tensor (a node attribute's: those with
    external data were read in when the model was loaded), with the checks sparse initializers
    get: dims, counts, indices in range and increasing, and the dense size cap, all before
    anything is allocated; ``what`` names it in errors (``ModelLoadError``)."""
    for t in (sparse.values, sparse.indices):
        if t.data_location == TensorProto.EXTERNAL:
            raise ModelLoadError(f"{what}: external data must be read through the model (Model.tensor)")
    return _sparse_to_dense(sparse, None, what).numpy()


class Model:
    """A parsed model whose external data is mapped, not read.

    A node of the default or ``ai.onnx.ml`` domain, in any scope, with an attribute its op's
    schema does not have at the model's opset of that domain is refused (InvalidGraph), as
    onnxruntime refuses it: the names come from ``_attributes`` (no onnx import).

    Attributes:
        proto: the ModelProto (external data is NOT pulled into it).
        path: model file path, or ``None`` when loaded from bytes.
        base_dir: folder against which external locations resolve (``None``: none allowed).
        root: the root scope.
        opsets: domain -> version; ``"ai.onnx"`` is normalized to ``""``.
    """

    def __init__(self, proto: ModelProto, *, path: str | None = None,
                 base_dir: str | None = None) -> None:
        self.proto = proto
        self.path = os.path.abspath(path) if path is not None else None
        if base_dir is None and self.path is not None:
            base_dir = os.path.dirname(self.path)
        self.base_dir = os.path.abspath(base_dir) if base_dir is not None else None
        self._files = DataFiles(self.base_dir)
        self.opsets: dict[str, int] = {}
        for imp in proto.opset_import:
            domain = "" if imp.domain in ("", "ai.onnx") else imp.domain
            self.opsets[domain] = int(imp.version)
        self.root = self._build(proto.graph)

    # -- construction -----------------------------------------------------------------------
    def _inline_attribute_tensors(self, node: NodeProto) -> None:
        """Attribute tensors stored as external data (a Constant's ``value``, ConstantOfShape's,
        sparse values) are read here, through the same location checks as initializers, and
        kept in this in-memory proto: kernels and onnx.reference later read them with
        ``numpy_helper``, which would resolve the location against the working directory."""
        for attr in node.attribute[:]:
            if attr.type == AttributeProto.TENSOR:
                tensors = [attr.t]
            elif attr.type == AttributeProto.TENSORS:
                tensors = list(attr.tensors)
            elif attr.type == AttributeProto.SPARSE_TENSOR:
                tensors = [attr.sparse_tensor.values, attr.sparse_tensor.indices]
                _check_sparse(attr.sparse_tensor, f"node {node.name!r} attribute {attr.name!r}")
            elif attr.type == AttributeProto.SPARSE_TENSORS:
                tensors = [t for sp in attr.sparse_tensors for t in (sp.values, sp.indices)]
            else:
                continue
            for t in tensors:
                self._inline(t)

    def _inline(self, t: TensorProto) -> None:
        """Puts an external tensor's bytes (read through the checked loader) into the proto."""
        if t.data_location == TensorProto.EXTERNAL:
            raw = bytes(self.tensor(t).raw())
            t.ClearField("external_data")
            t.data_location = TensorProto.DEFAULT
            t.raw_data = raw

    def inlined(self, node: NodeProto) -> NodeProto:
        """A copy of ``node`` whose nested graphs hold every external tensor inline (read through
        this model's checked loader): for a runtime that walks the graphs itself (onnx.reference),
        which would otherwise resolve external locations against the working directory."""
        copy = NodeProto()
        copy.CopyFrom(node)
        stack = [g for _, _, g in subgraphs_of(copy)]
        while stack:
            g = stack.pop()
            tensors = list(g.initializer) + [t for sp in g.sparse_initializer for t in (sp.values, sp.indices)]
            for t in tensors:
                self._inline(t)
            for n in g.node:
                stack.extend(sub for _, _, sub in subgraphs_of(n))
        return copy

    def tensor(self, proto: TensorProto) -> Tensor:
        """Wraps any TensorProto of this model (e.g. a Constant node's ``value``) as a Tensor,
        with the same external-data checks and mappings as initializers."""
        return Tensor(proto, self._files)

    def _allowed_attributes(self, domain: str, op_type: str) -> frozenset[str] | None:
        """The attribute names a node of ``op_type`` may carry in this model (its opset of the
        node's domain), or ``None``: no check (a domain or op the table does not know, an opset
        before the op existed, a model-local function of that name: other layers decide)."""
        if domain == "ai.onnx":
            domain = ""
        opset = self.opsets.get(domain)
        if opset is None:
            return None
        functions = self.proto.functions[:]
        if functions and any(f.name == op_type and f.domain in (domain, domain or "ai.onnx") for f in functions):
            return None
        return _allowed_attributes(domain, op_type, opset)

    def _check_attribute_names(self, node: NodeProto, attrs: list, names: frozenset[str], scope: Scope) -> None:
        """Raises InvalidGraph for an attribute of ``node`` that is not in ``names`` (names
        starting with ``__`` excepted: onnx's checker lets those through)."""
        unknown = [a.name for a in attrs if a.name not in names and not a.name.startswith("__")]
        if not unknown:
            return
        domain = "" if node.domain == "ai.onnx" else node.domain
        where = f"graph {scope.graph.name!r}{' (' + scope.path + ')' if scope.path else ''}"
        listed = ", ".join(sorted(names)) if names else "none"
        raise InvalidGraph(
            f"{where}: node {node.name!r} ({node.op_type}, opset {self.opsets[domain]} of domain "
            f"{domain or 'ai.onnx'!r}) has attribute{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(n) for n in unknown)} that {node.op_type} does not have at this opset "
            f"(its attributes there: {listed}; an attribute of another opset, e.g. one that became "
            "an input, needs the model converted): onnxruntime refuses the model too (Unrecognized "
            "attribute)"
        )

    def _build(self, graph: GraphProto) -> Scope:
        root = Scope(graph, None, None, None, "")
        used_paths = {""}
        allowed_names: dict[tuple[str, str], frozenset[str] | None] = {}
        order: list[Scope] = []
        stack = [root]
        while stack:  # pre-order: parents before children, so path collisions resolve stably
            scope = stack.pop()
            order.append(scope)
            g = scope.graph
            files = self._files
            for init in g.initializer[:]:
                scope.initializers[init.name] = Tensor(init, files)
            for sp in g.sparse_initializer[:]:
                dense = _sparse_to_dense(sp, files)
                scope.initializers[dense.name] = dense
            defined = scope.defined
            defined.update(scope.initializers)
            defined.update(v.name for v in g.input[:])
            nodes = g.node[:]
            name_counts = None
            for index, node in enumerate(nodes):
                for o in node.output[:]:
                    if o and o in defined:
                        raise InvalidGraph(
                            f"graph {g.name!r}{' (' + scope.path + ')' if scope.path else ''}: node "
                            f"{node.name!r} ({node.op_type}) output {o!r} is already defined (a graph "
                            "input, an initializer or another node's output): ambiguous, as onnxruntime "
                            "refuses it"
                        )
                    if o:
                        defined.add(o)
                attrs = node.attribute[:]
                if not attrs:
                    continue
                # Names the op's schema does not declare at the model's opset: refused, as
                # onnxruntime does (one cached set per op of this model).
                key = (node.domain, node.op_type)
                names = allowed_names.get(key, _UNSEEN)
                if names is _UNSEEN:
                    names = allowed_names[key] = self._allowed_attributes(*key)
                if names is not None and not names.issuperset([a.name for a in attrs]):
                    self._check_attribute_names(node, attrs, names, scope)
                # One pass over the attributes decides for most nodes: numbers and strings hold
                # neither tensors to read nor graphs.
                if all(a.type in _SCALAR_TYPES for a in attrs):
                    continue
                self._inline_attribute_tensors(node)
                subs = list(subgraphs_of(node))
                if not subs:
                    continue
                if name_counts is None:
                    name_counts = collections.Counter(n.name for n in nodes)
                ok_name = node.name and not node.name.startswith("#") and name_counts[node.name] == 1
                for attr_name, k, sub in subs:
                    suffix = f".{attr_name}" + (f"[{k}]" if k is not None else "")
                    path = f"{scope.path}/{node.name if ok_name else '#' + str(index)}{suffix}"
                    if path in used_paths:
                        path = f"{scope.path}/#{index}{suffix}"
                        n = 1
                        while path in used_paths:
                            path = f"{scope.path}/#{index}~{n}{suffix}"
                            n += 1
                    used_paths.add(path)
                    child = Scope(sub, scope, node, index, path)
                    child.attr_name, child.attr_index = attr_name, k
                    scope.children.append(child)
            stack.extend(reversed(scope.children))
        # Free names bottom-up (children first), then resolve outer references per scope.
        for scope in walk(root):
            g = scope.graph
            used: set[str] = set()
            for node in g.node[:]:
                used.update(node.input[:])
            used.update(o.name for o in g.output[:])
            used.discard("")  # an omitted optional input (or an unnamed output)
            for child in scope.children:
                used |= child.free
            scope.free = used - scope.defined
            for name in scope.free:
                outer = scope.parent
                while outer is not None and name not in outer.defined:
                    outer = outer.parent
                if outer is not None and name in outer.initializers:
                    scope.outer_refs[name] = outer
        return root

    # -- queries ----------------------------------------------------------------------------
    def scopes(self) -> Iterator[Scope]:
        """Every scope, bottom-up (children before the scope of their owner node)."""
        return walk(self.root)

    def data_buffer(self, location: str, what: str) -> tuple[object, int]:
        """The read-only mapping of data file ``location`` and its size, with the same location
        rules as tensors (``what`` names the reader in errors, e.g. a pre-packed blob)."""
        mapped = self._files._open(what, location)
        return mapped.buffer, mapped.size

    def data_paths(self) -> set[str]:
        """Real paths of the external data files this model maps."""
        return self._files.paths()

    def data_identity(self, location: str) -> tuple[int, ...] | None:
        """``stat_identity`` of data file ``location`` as it was when mapped (None: not mapped)."""
        return self._files.identity(location)

    def check_files(self) -> None:
        """Raises ExternalDataError if a mapped data file was truncated or rewritten since load."""
        self._files.check()

    def close(self) -> None:
        """Drops the mappings this model owns; arrays handed out earlier stay valid."""
        self._files.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# protobuf cannot parse a message over 2 GiB: a larger "model file" is not one.
MAX_MODEL_FILE_BYTES = (2 << 30) - 1


def load_model(path_or_bytes: str | os.PathLike | bytes, *, base_dir: str | None = None) -> Model:
    """Parses a model without reading its external data.

    Args:
        path_or_bytes: a model file path, or the serialized ModelProto.
        base_dir: folder external locations resolve against; defaults to the model file's folder.
            For bytes without ``base_dir`` any external tensor is an ``ExternalDataError``.

    Returns:
        The :class:`Model`; every initializer of every scope is validated and mapped.

    Raises:
        ModelLoadError: the file cannot be read or parsed.
        ExternalDataError: an external data location, offset or length is invalid or unsafe.
    """
    path = None
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = bytes(path_or_bytes)
    else:
        path = os.fspath(path_or_bytes)
        data = read_regular_file(path, "model file", MAX_MODEL_FILE_BYTES, ModelLoadError)
    proto = ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as e:  # protobuf raises DecodeError (a plain Exception subclass)
        where = repr(path) if path is not None else f"<{len(data)} bytes>"
        raise ModelLoadError(f"cannot parse model {where}: not a valid ONNX ModelProto ({e})") from e
    if not proto.HasField("graph"):
        where = repr(path) if path is not None else f"<{len(data)} bytes>"
        raise ModelLoadError(f"model {where} has no graph")
    if not _valid_utf8(data):
        _check_text_fields(proto, repr(path) if path is not None else f"<{len(data)} bytes>")
    return Model(proto, path=path, base_dir=base_dir)


# Above this size the mirror parse (below) would copy large in-proto weights once more; such a
# model's text fields are few next to its tensors, and the walk checks them.
_MIRROR_MAX_BYTES = 16 << 20
_mirror: list = []  # [the proto3 mirror's ModelProto class, or None when it cannot be used]


def _valid_utf8(data: bytes) -> bool:
    """Whether every ``string`` field in the serialized model is valid UTF-8, decided by protobuf
    in C: the bytes are parsed once more as a *proto3* copy of ONNX's schema (proto3 string
    fields are verified while parsing; ONNX's proto2 ones are not).  False means "not known":
    :func:`_check_text_fields` then walks the parsed model and names the field.

    Why: the walk reads every string field through Python — 5 of the 45 ms of a warm create of
    an LLM whose graph declares 664 value infos; the mirror parse costs ~1 ms.
    """
    if len(data) > _MIRROR_MAX_BYTES:
        return False
    if not _mirror:
        _mirror.append(_build_mirror())
    mirror = _mirror[0]
    if mirror is None:
        return False
    try:
        mirror.FromString(data)
    except Exception:  # protobuf's DecodeError: bad UTF-8 (or anything else: the walk decides)
        return False
    return True


def _build_mirror():
    """The proto3 twin of the loaded ``ModelProto`` class, in a private descriptor pool; None if
    this protobuf cannot build one or its parser does not reject bad UTF-8 in it.

    The twin's file is ONNX's own serialized FileDescriptorProto with a second ``syntax`` field
    (number 12, ``"proto3"``) appended: protobuf keeps the last value of a singular field, and
    this costs 0.7 ms where parsing and editing the descriptor with ``descriptor_pb2`` costs 3.
    A schema proto3 cannot express (explicit defaults, required fields: ONNX has neither) makes
    the pool refuse it, and the walk serves alone.
    """
    try:
        from google.protobuf import descriptor_pool, message_factory

        file = ModelProto.DESCRIPTOR.file
        pool = descriptor_pool.DescriptorPool()
        pool.AddSerializedFile(file.serialized_pb + b"\x62\x06proto3")  # field 12, 6 bytes
        name = f"{file.package}.ModelProto" if file.package else "ModelProto"
        cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
        probe = ModelProto(producer_name="x").SerializeToString()
        cls.FromString(probe)
        bad = probe.replace(b"x", b"\xff")
    except Exception as exc:  # an older or different protobuf: the walk serves alone
        logger.debug("no proto3 mirror of the ONNX schema (%s): text fields are walked", exc)
        return None
    try:
        cls.FromString(bad)
    except Exception:
        return cls  # it rejects bad UTF-8: usable
    logger.debug("this protobuf does not verify UTF-8 in proto3 strings: text fields are walked")
    return None


def _check_text_fields(proto: ModelProto, where: str) -> None:
    """Refuses a model whose ``string`` fields hold invalid UTF-8.

    protobuf (upb) parses such a field without error but hands it to Python as ``bytes`` instead
    of ``str``, so a corrupt name or external-data location would otherwise surface much later as
    a ``TypeError`` deep inside the loader (found by the reliability fuzzer).  Every string field
    of every message is checked, through a per-message-type plan of its string and message fields
    (``"".join`` refuses a bytes item at C speed).  The walk goes by field, not by message: all
    messages reached through one field path (every node of a graph, every attribute of those
    nodes, every initializer's external-data entries, ...) are one batch of one type, each of
    whose fields is checked for the whole batch at once — the cost per message is a few list
    items, not a Python loop over its fields.
    """
    stack: list[tuple[list[Message], str]] = [([proto], "model")]
    while stack:
        msgs, at = stack.pop()
        singles, repeats, messages, message_lists = _text_plan(msgs[0].DESCRIPTOR)
        for name in singles:
            try:
                "".join([getattr(m, name) for m in msgs])
            except TypeError:
                raise ModelLoadError(f"cannot parse model {where}: field {at}.{name} is not valid UTF-8 text") from None
        for name in repeats:
            try:
                "".join([x for m in msgs for x in getattr(m, name)])
            except TypeError:
                raise ModelLoadError(f"cannot parse model {where}: field {at}.{name} is not valid UTF-8 text") from None
        for name in messages:
            subs = [getattr(m, name) for m in msgs if m.HasField(name)]
            if subs:
                stack.append((subs, f"{at}.{name}"))
        for name in message_lists:
            subs = [x for m in msgs for x in getattr(m, name)]
            kind = subs[0].DESCRIPTOR.name if subs else ""
            if kind == "ValueInfoProto":
                subs = _tensor_value_infos(subs, where, f"{at}.{name}[?]")
            elif kind == "AttributeProto":
                subs = _plain_attributes(subs, where, f"{at}.{name}[?]")
            if subs:
                stack.append((subs, f"{at}.{name}[?]"))


_PLAIN_ATTRIBUTES = frozenset({AttributeProto.INT, AttributeProto.FLOAT, AttributeProto.INTS, AttributeProto.FLOATS,
                               AttributeProto.STRING, AttributeProto.STRINGS})


def _plain_attributes(items: list, where: str, at: str) -> list:
    """Checks the text of attributes of a number or bytes type (their name, ref_attr_name and
    doc_string: nothing reads their message fields, every reader dispatches on ``type``) in one
    join; returns the others (tensors, graphs, types) for the generic walk."""
    plain, rest = [], []
    for a in items:
        (plain if a.type in _PLAIN_ATTRIBUTES else rest).append(a)
    try:
        "".join([x for a in plain for x in (a.name, a.ref_attr_name, a.doc_string)])
    except TypeError:
        raise ModelLoadError(f"cannot parse model {where}: a field under {at} is not valid UTF-8 text") from None
    return rest


def _tensor_value_infos(items: list, where: str, at: str) -> list:
    """Checks the value infos of plain tensor type (name, doc string, denotation, each dim's
    dim_param and denotation) in two joins; returns the others for the generic walk.  A builder's
    LLM declares hundreds of intermediate values (Qwen2.5-0.5B: 664, two thirds of its messages):
    walked generically, level by level through TypeProto's oneof, they took 5 of the 11 ms."""
    plain, rest = [], []
    for vi in items:
        (plain if vi.type.WhichOneof("value") == "tensor_type" and not vi.metadata_props else rest).append(vi)
    try:
        "".join([x for vi in plain for x in (vi.name, vi.doc_string, vi.type.denotation)])
        "".join([x for vi in plain for d in vi.type.tensor_type.shape.dim for x in (d.dim_param, d.denotation)])
    except TypeError:
        raise ModelLoadError(f"cannot parse model {where}: a field under {at} is not valid UTF-8 text") from None
    return rest


_TEXT_PLANS: dict[object, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}


def _text_plan(desc) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(single string fields, repeated string fields, single message fields, repeated message
    fields) of a message type, computed once per type."""
    plan = _TEXT_PLANS.get(desc)
    if plan is None:
        groups: tuple[list[str], list[str], list[str], list[str]] = ([], [], [], [])
        for fd in desc.fields:
            rep = _is_repeated(fd)
            if fd.type == FieldDescriptor.TYPE_STRING:
                groups[1 if rep else 0].append(fd.name)
            elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                groups[3 if rep else 2].append(fd.name)
        plan = _TEXT_PLANS[desc] = tuple(tuple(g) for g in groups)  # type: ignore[assignment]
    return plan


def _is_repeated(fd: FieldDescriptor) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.x; ``label`` is deprecated
    if is_repeated is not None:
        return bool(is_repeated)
    return fd.label == FieldDescriptor.LABEL_REPEATED
