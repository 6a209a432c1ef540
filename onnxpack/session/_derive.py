"""Constant expressions: weights reached through cheap ops are packed like initializers.

Exporters and quantizers rarely hand a weight straight to its kernel: a QDQ model reads
``DequantizeLinear(W_int8, scale, zero_point)``, Paddle exports keep weights in ``Constant``
nodes, others add ``Identity``, ``Transpose``, ``Reshape`` or ``(Un)Squeeze`` in between.  The
compile step treats the result of such a chain as a constant: the consumer's kernel packs it like
any weight (a Conv packs the dequantized weight, folded with its BatchNormalization), the chain's
nodes drop out of the plan once nothing reads them unpacked, and a QDQ model keeps its int8 weights
on disk while its packs are saved and mapped beside them.  A float weight that the graph itself
quantizes (``QuantizeLinear -> DequantizeLinear`` on it, as onnxruntime's quantizer writes with
``AddQDQPairToWeight`` and PyTorch exports quantization-aware models) is such a chain as well.

``Cast`` belongs here too: exporters widen fp16 weights with ``Cast(W) -> float32``, and models
from onnxruntime's test data cast a constant twice (``Cast(Cast(W))``); with Cast in a chain the
final consumer packs the cast value once and every Cast drops out of the plan, instead of the
second Cast and its consumer recomputing from the first Cast's pack at every run.

A :class:`Derivation` says how a value comes from one stored *leaf* weight (an initializer or a
``Constant`` node's tensor) without computing it: the leaf's declared dtype and shape, the ops
applied, their attributes and the bytes of their other (small) constant inputs, digested
(``digest``), and the result's dtype and shape.
Keys are therefore computable at a warm start without dequantizing anything: the leaf's identity
plus the digest, and in saved records the leaf's own record with the digest in the pack spec.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import numpy as np

from onnxpack.errors import InvalidGraph, OnnxpackError
from onnxpack.graph._proto import (
    AttributeProto, NodeProto, TensorProto, get_attribute_value, np_dtype_to_tensor_dtype, tensor_dtype_to_np_dtype,
)
from onnxpack.prepack import WeightRef
from onnxpack.session._fusion import sole_output
from onnxpack.session.kernels import KernelContext, lookup, normalize_domain

__all__ = ["Derivation", "derive"]

# (domain, op_type) of the ops a chain may hold; their input 0 is the weight, any other input a
# small constant (scale, zero point, shape, axes).
FOLDABLE = frozenset({
    ("", "Identity"), ("", "DequantizeLinear"), ("com.microsoft", "DequantizeLinear"),
    ("", "QuantizeLinear"), ("com.microsoft", "QuantizeLinear"), ("", "Transpose"),
    ("", "Reshape"), ("", "Squeeze"), ("", "Unsqueeze"), ("", "Flatten"), ("", "Cast"),
})
_FOLDABLE_OPS = frozenset(op for _domain, op in FOLDABLE)
# Ops whose result is the input's bytes reshaped: a chain of only these keeps a weight's identity
# pack (the packed buffer is still the stored bytes, recorded at the weight's own offset).
_VIEWS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


class Derivation:
    """How a constant value comes from a stored leaf weight (see the module docstring): one op
    (``node``) applied to the value ``prev`` derives (None: to the leaf ``src`` itself), with the
    small constants ``values`` as its other inputs.

    ``digest`` is computed on first use: only a value some kernel packs needs its key, and most
    derived values are not packed (a QDQ model's BatchNormalization statistics, fake-quant
    scales) — hashing each one's small constants at every session creation cost more than
    deriving it.  The op's kernel is built when the value is first computed: at a warm start
    most never are.  (Plain fields and methods, not closures: a QDQ ResNet-50 derives ~290
    values per session, and each closure's function and cells were garbage the collector walked.)
    """

    __slots__ = ("dtype", "shape", "is_view", "_node", "_domain", "_opset", "_opsets", "_cls", "_values",
                 "_prev", "_src", "_kernel", "_digest")

    def __init__(self, node: NodeProto, domain: str, opset: int, opsets: dict[str, int], cls: type,
                 values: tuple[WeightRef | None, ...], src: WeightRef, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.shape = shape
        self._node, self._domain, self._opset, self._opsets, self._cls = node, domain, opset, opsets, cls
        self._values = values
        self._src = src
        self._prev: Derivation | None = src.derived  # type: ignore[assignment]
        prev = self._prev
        self.is_view = node.op_type in _VIEWS and (prev is None or prev.is_view)
        self._kernel = None
        self._digest: bytes | None = None

    def kernel(self):
        """The op's kernel, built once (a failed build is retried at the next call)."""
        if self._kernel is None:
            self._kernel = self._cls(self._node, KernelContext(opset=self._opset, opsets=self._opsets))
        return self._kernel

    @property
    def digest(self) -> bytes:
        if self._digest is None:
            # The chain's digests from the first one not known yet, in order (not by recursion:
            # a chain of 600 Transposes over a weight is a valid model, past Python's stack).
            chain = []
            d: Derivation | None = self
            while d is not None and d._digest is None:
                chain.append(d)
                d = d._prev
            for d in reversed(chain):
                d._digest = d._make_digest()
        return self._digest

    def _make_digest(self) -> bytes:
        node, prev, src = self._node, self._prev, self._src
        h = hashlib.blake2b(digest_size=16)
        if prev is not None:
            h.update(prev._digest)
        else:
            # The leaf's declared type and shape: the same bytes read as another dtype (a model
            # whose weight now says bfloat16 where it said float16) derive another value, and a
            # pack of the old value must not be found under the new one's key.
            h.update(b"leaf:" + f"{_dtype_name(src.dtype)}{tuple(src.shape)}".encode())
        h.update(f"|{self._domain}:{node.op_type}:{self._opset}|".encode())
        for a in sorted(node.attribute[:], key=lambda a: a.name):
            if a.type not in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
                h.update(a.SerializeToString())
        for w in self._values:
            # The bytes hashed in place (no copy): streaming them after their length digests the
            # same as hashing the two joined.
            raw = b"-" if w is None else memoryview(w.raw()).cast("B")
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
            if w is not None:
                h.update(f"{_dtype_name(w.dtype)}{w.shape}".encode())
        return h.digest()

    def compute(self, leaf: np.ndarray) -> np.ndarray:
        """The value, from the leaf weight's value: each op of the chain in order, from the leaf
        (a loop, not recursion: see :attr:`digest`).  What a hostile chain makes numpy raise
        here (at creation: the value is being packed or folded) is the model's InvalidGraph."""
        chain = []
        d: Derivation | None = self
        while d is not None:
            chain.append(d)
            d = d._prev
        x = leaf
        for d in reversed(chain):
            x = d._step(x)
        return x

    def _step(self, x: np.ndarray) -> np.ndarray:
        """This op on ``x``, the value of the chain before it."""
        node = self._node

        def run() -> np.ndarray:
            args = [None if w is None else w.value() for w in self._values]
            return np.asarray(self.kernel().run(x, *args)[0])

        return compute_constant(run, node.output[0], f"node {node.name!r} ({node.op_type})")

    @property
    def elem_type(self) -> int:
        return np_dtype_to_tensor_dtype(self.dtype)


def compute_constant(compute: Callable[[], np.ndarray], name: str, where: str) -> np.ndarray:
    """``compute()``, a constant computed from the model's weights at creation (a derived value
    being packed, a folded step's value); anything but an onnxpack error it raises (a hostile
    chain's dequantization, a Reshape of a weight to a shape numpy cannot hold) is the model's
    InvalidGraph, naming the constant and ``where`` (its node or graph)."""
    try:
        with np.errstate(all="ignore"):  # the arithmetic's inf or NaN, silently (as at run time)
            return compute()
    except OnnxpackError:
        raise
    except Exception as exc:
        raise InvalidGraph(f"{where}: constant {name!r} (computed from the model's weights) cannot be computed: "
                           f"{type(exc).__name__}: {exc}") from exc


def derive(node: NodeProto, weight_of: Callable[[str], WeightRef | None], opsets: dict[str, int]) -> WeightRef | None:
    """The constant ``node``'s single output is, or None when it is not a foldable constant.

    ``weight_of(name)`` gives the constant a name refers to (initializer, Constant, or an earlier
    derived value), or None.
    """
    if node.op_type not in _FOLDABLE_OPS:  # the common case first: one string compare
        return None
    domain = normalize_domain(node.domain)
    if not sole_output(node):
        return None
    # One conversion, by a slice: protobuf builds a container at every access, and iterating one
    # (tuple(), a for loop, * unpacking) ends in an IndexError it formats (~2,000 instructions).
    inputs = tuple(node.input[:])
    if (domain, node.op_type) not in FOLDABLE or not inputs or not inputs[0]:
        return None
    src = weight_of(inputs[0])
    if src is None or src.user or src.elem_type == TensorProto.STRING:
        return None
    if node.op_type == "Identity" and domain == "":
        # The weight itself, not a derivation of it: its packs have the weight's own key whether
        # the compile reads through the Identity (graph optimizations on) or runs it (off), so a
        # model saved at one level warm-starts at the other.
        return src
    others = []
    for name in inputs[1:]:
        if not name:
            others.append(None)
            continue
        w = weight_of(name)
        if w is None or w.derived is not None or w.user:
            return None
        others.append(w)
    opset = opsets.get(domain, 1)
    try:
        shape, dtype = _infer(node, src.shape, np.dtype(src.dtype), others, opset)
        # numpy refuses a shape whose nonzero dims multiply past its index range, even with a 0
        # dim (an empty weight reshaped to [2**61 + 3, 0]): such a value is never derived.
        if math.prod(d for d in shape if d) * max(np.dtype(dtype).itemsize, 1) > _INTP_MAX:
            raise ValueError("shape too large for numpy")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None  # anything unusual: leave the node to run as it is
    cls = lookup(domain, node.op_type, opset)
    if cls is None:
        return None
    derivation = Derivation(node, domain, opset, opsets, cls, tuple(others), src, dtype, shape)
    if node.op_type == "Cast":  # the one foldable kernel that may decline a node (its target type)
        try:
            derivation.kernel()
        except NotImplementedError:
            return None
    # (not dataclasses.replace: it re-reads the class's fields at every call, a fifth of derive())
    return WeightRef(src.scope, src.name, src.tensor, src.array, derivation)


_DTYPE_NAMES: dict[np.dtype, str] = {}
_INTP_MAX = int(np.iinfo(np.intp).max)


def _dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)``, cached: numpy builds the string anew at every call."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _axes(node: NodeProto, others: list, opset: int, ndim: int) -> list[int] | None:
    attr = next((get_attribute_value(a) for a in node.attribute[:] if a.name == "axes"), None)
    axes = attr if attr is not None else (others[0].value().tolist() if others and others[0] is not None else None)
    if axes is None:
        return None
    return [int(a) + ndim if int(a) < 0 else int(a) for a in np.asarray(axes).reshape(-1)]


def _plain_cast_type(dtype: np.dtype) -> bool:
    return (dtype.isbuiltin == 1 and dtype.kind in "biuf") or dtype.name == "bfloat16"


def _infer(node: NodeProto, shape: tuple[int, ...], dtype: np.dtype, others: list, opset: int) -> tuple[tuple[int, ...], np.dtype]:
    """Result shape and dtype of one foldable op, from the input's and the small constants
    (``others``: their WeightRefs, read only where a value decides the shape)."""
    op = node.op_type
    attrs = {a.name: get_attribute_value(a) for a in node.attribute[:]}
    if op == "Identity":
        return shape, dtype
    if op == "Cast":
        to = attrs["to"]
        if isinstance(to, bytes):  # opset 1 spelled the type as a string
            to = TensorProto.DataType.Value(to.decode().upper())
        target = np.dtype(tensor_dtype_to_np_dtype(int(to)))
        # numpy's own numeric and bool types and bfloat16: their astype is the spec's cast, the
        # Cast kernel's (float8 and the 4-bit types need saturation/packing, strings are not weights).
        if not (_plain_cast_type(target) and _plain_cast_type(dtype)):
            raise ValueError("cast outside numpy's numeric types")
        return shape, target
    if op == "DequantizeLinear":
        od = int(attrs.get("output_dtype", 0))
        if od:
            return shape, np.dtype(tensor_dtype_to_np_dtype(od))
        scale = others[0]
        if normalize_domain(node.domain) == "" and opset < 19:
            return shape, np.dtype(np.float32)
        if np.dtype(scale.dtype).name in ("float32", "float16", "bfloat16", "float64"):
            return shape, np.dtype(scale.dtype)
        return shape, np.dtype(np.float32)
    if op == "QuantizeLinear":
        # A float weight quantized in the graph (``Q -> DQ`` on a weight: onnxruntime's quantizer
        # with AddQDQPairToWeight, PyTorch's exported quantization-aware models).  Only the
        # 8- and 16-bit integer codes of a float32 weight with a zero point of that type: the
        # kernel's result type is then the zero point's, whatever the opset.
        zp = others[1] if len(others) > 1 else None
        if (zp is None or dtype != np.float32 or attrs.get("output_dtype") or attrs.get("precision")
                or np.dtype(zp.dtype).name not in ("int8", "uint8", "int16", "uint16")):
            raise ValueError("not a plain integer quantization of a float32 weight")
        return shape, np.dtype(zp.dtype)
    if op == "Transpose":
        perm = attrs.get("perm") or list(range(len(shape)))[::-1]
        if sorted(perm) != list(range(len(shape))):
            raise ValueError("bad perm")
        return tuple(shape[p] for p in perm), dtype
    if op == "Reshape":
        target = [int(d) for d in np.asarray(others[0].value()).reshape(-1)] if opset >= 5 else list(attrs["shape"])
        allowzero = int(attrs.get("allowzero", 0))
        out = [shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
        if out.count(-1) > 1:
            raise ValueError("two -1")
        if -1 in out:
            known = math.prod(d for d in out if d != -1)
            out[out.index(-1)] = math.prod(shape) // known if known else 0
        if math.prod(out) != math.prod(shape) or any(d < 0 for d in out):
            raise ValueError("bad reshape")
        return tuple(out), dtype
    if op == "Squeeze":
        axes = _axes(node, others, opset, len(shape))
        if axes is None:
            return tuple(d for d in shape if d != 1), dtype
        if any(shape[a] != 1 for a in axes):
            raise ValueError("squeezing a non-1 axis")
        return tuple(d for i, d in enumerate(shape) if i not in axes), dtype
    if op == "Unsqueeze":
        n = len(shape) + len(_axes(node, others, opset, 0) or [])
        axes = sorted(_axes(node, others, opset, n) or [])
        out = list(shape)
        for a in axes:
            out.insert(a, 1)
        return tuple(out), dtype
    if op == "Flatten":
        axis = int(attrs.get("axis", 1))
        axis = axis + len(shape) if axis < 0 else axis
        return (math.prod(shape[:axis]), math.prod(shape[axis:])), dtype
    raise KeyError(op)
