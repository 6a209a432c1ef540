"""Mixture-of-experts feed-forward layers: ``com.microsoft::MoE`` (float experts) and ``QMoE``
(2/4/8-bit block- or row-quantized experts), as onnxruntime-genai's builder writes them for
gpt-oss, Phi-3.5-MoE, LFM2-MoE and friends, and as onnxruntime's CPU provider runs them.

Per token (a row of ``input``, 2-D ``(tokens, hidden)`` or 3-D ``(batch, seq, hidden)``):

* **routing**: ``router_probs`` (tokens, E) are logits; their softmax over all E experts (in
  float32) picks the ``k`` most probable (ties: the higher expert index first, as onnxruntime's
  partial sort of (probability, index) pairs); an expert's mixing weight is its probability,
  divided by the sum of the k chosen ones with ``normalize_routing_weights=1``.  QMoE's optional
  ``router_weights`` (input 14) then gives the mixing weights instead: its values at the chosen
  experts.  ``use_sparse_mixer=1`` (Phi-3.5-MoE; k = 2) is the sparse mixer of that model's
  reference code: the best expert by logit, its weight the softmax over the logits within a
  relative distance 2 * 0.01 of the best; the second the same with the best expert masked out.
* **an expert**: ``fc1`` (+ bias), the activation (relu, gelu (tanh approximation), silu, identity; swiglu with the
  gate and the linear half interleaved (``swiglu_fusion=1``), concatenated (2), or fc1 and fc3
  (0): ``min(g, limit) * sigmoid(alpha * min(g, limit)) * (clip(l, -limit, limit) + beta)``),
  ``fc2`` (+ bias); the output is the sum over the chosen experts of weight * expert(row).

Weights: ``fc1`` is (E, N, K) — every expert's (out features, in features) matrix, as the
builder writes it — and for QMoE its rows are ``K * bits / 8`` bytes of little-end-first codes
with scales (E, N) (one per row) or (E, N, ceil(K / block_size)) and optional packed zero points
(default ``2 ** (bits - 1)``): ``w = (q - zero_point) * scale``.  The INT3 profile (3-bit codes,
one bit stream per row, zero point 4; swiglu, fused, blocks of 32-128, float16 / bfloat16
activations, ``weights_prepacked=0``, all as its schema demands) is packed and computed as 4-bit
codes with zero point 4 (4/3 of its bytes).  An MoE's float (E, K, N)
"legacy" layout (what onnxruntime's checker accepts for backward compatibility) multiplies
untransposed.

Pre-packing (QMoE): every expert's quantized matrix is a MatMulNBits weight (the same codes,
scales and zero points, per block of K), so each of fc1/fc2/fc3's weights, scales and zero
points is packed into :mod:`.quant`'s tiled layout, expert after expert in one buffer (the same
bytes as the model's, re-ordered; rows of a partial last block zero-padded), and each expert's
product runs through a :class:`.quant.MatMulNBits` over its slice of those buffers: the JIT GEMV
for a few rows (decoding), dequantized tiles and BLAS for more — int4 stays int4.  Float MoE
weights are used as stored (float16/bfloat16 experts are widened per call, only the chosen ones).

Precision: computed in float32 for float16/bfloat16 inputs too (onnxruntime multiplies float16
experts in float16), output in the input's dtype.  onnxruntime's CPU QMoE multiplies a projection
with the activations rounded to int8 per block where its QNBit GEMM packed the weights — block-wise,
K a multiple of the block size, 8 bits or 4 bits at ``accuracy_level=4`` — and dequantizes and
multiplies in float32 elsewhere (row-wise scales, a partial last block, and weights it did not
pre-pack: fed at run time, or with ``session.disable_prepacking``); so do these kernels,
projection by projection, where :class:`.quant.MatMulNBits` has the int8 path (its JIT GEMV).
"""

from __future__ import annotations

import math
import struct

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.graph._proto import AttributeProto, NodeProto
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, quiet_floats, register
from onnxpack.session.kernels.contrib_activation import tanh_gelu_inplace
from onnxpack.session.kernels.linalg import as_compute
from onnxpack.session.kernels.quant import (TILE, MatMulNBits, _as_storage, _float_storage, pack_nibbles, to_tiles,
                                            unpack_nbits)
from onnxpack.session.kernels.rnn import _sigmoid

__all__ = ["MoE", "QMoE", "route"]

_ACTIVATIONS = ("relu", "gelu", "silu", "identity", "swiglu")
_SPARSE_MIXER_EPS = 0.01  # Phi-3.5-MoE's router jitter: the sparse mixer's relative threshold is twice it


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


def route(logits: np.ndarray, k: int, normalize: bool, sparse_mixer: bool = False,
          weights: np.ndarray | None = None, normalize_weights: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(chosen experts (T, k) int64, their mixing weights (T, k) float32) of router logits (T, E):
    the k most probable experts of the logits' softmax, weighted by their probabilities (divided
    by the k probabilities' sum with ``normalize``), or by ``weights`` at the chosen experts
    (divided by their sum with ``normalize_weights``); see the module docstring."""
    logits = np.asarray(logits, dtype=np.float32)
    t, e = logits.shape
    if sparse_mixer:
        return _sparse_mixer(logits)
    probs = _softmax(logits.copy()) if e else logits
    # Descending probability, the higher index first among equal ones.
    order = np.lexsort((-np.arange(e)[None, :].repeat(t, 0), -probs), axis=-1)[:, :k]
    if weights is not None:
        chosen = np.take_along_axis(np.asarray(weights, dtype=np.float32), order, axis=-1)
        if normalize_weights:
            chosen = chosen / chosen.sum(axis=-1, keepdims=True)
    else:
        chosen = np.take_along_axis(probs, order, axis=-1)
        if normalize:
            chosen = chosen / chosen.sum(axis=-1, keepdims=True)
    return order.astype(np.int64), chosen.astype(np.float32, copy=False)


def _sparse_mixer(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Phi-3.5-MoE's top-2 sparse mixer at inference (no jitter noise)."""
    rows = np.arange(scores.shape[0])
    experts = np.empty((scores.shape[0], 2), np.int64)
    mix = np.empty((scores.shape[0], 2), np.float32)
    masked = scores.copy()
    for j in range(2):
        best = masked.argmax(axis=-1)
        top = masked[rows, best][:, None]
        factor = np.maximum(np.abs(scores), top)
        with np.errstate(divide="ignore", invalid="ignore"):
            far = (top - scores) / factor > 2 * _SPARSE_MIXER_EPS
        gates = np.where(far, np.float32(-np.inf), masked)
        probs = _softmax(gates)
        experts[:, j] = best
        mix[:, j] = probs[rows, best]
        masked[rows, best] = -np.inf
    return experts, mix


@register("MoE", domain="com.microsoft", since=1)
class MoE(Kernel):
    """``com.microsoft::MoE``: float experts (see the module docstring)."""

    op_type = "MoE"
    domain = "com.microsoft"
    # input positions of (fc1, fc2, fc3) weights and biases
    _WEIGHTS = (2, 4, 6)
    _BIASES = (3, 5, 7)
    always_normalize = False  # QMoE: see its class

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        name = f"node {node.name!r} ({self.op_type})"
        self._where = name
        self.k = int(self.attr("k", 1))  # the schema's default
        self.act = str(self.attr("activation_type", "relu")).lower()
        if self.act not in _ACTIVATIONS:
            raise InvalidArgument(f"{name}: activation_type {self.act!r} is not one of {list(_ACTIVATIONS)} "
                                  "(relu2 and geglu are CUDA-only in onnxruntime)")
        self.alpha = float(self.attr("activation_alpha", 1.0))
        self.beta = float(self.attr("activation_beta", 0.0))
        self.fusion = int(self.attr("swiglu_fusion", 0))
        self.limit = float(self.attr("swiglu_limit", math.inf))
        if math.isnan(self.limit):
            self.limit = math.inf  # no clamp, as onnxruntime reads a NaN limit
        if self.limit < 0:  # (onnxruntime's CPU kernel aborts the process on one)
            raise InvalidArgument(f"{name}: swiglu_limit must be >= 0, got {self.limit}")
        self.normalize = int(self.attr("normalize_routing_weights", 0)) == 1
        self.sparse_mixer = int(self.attr("use_sparse_mixer", 0)) == 1
        if self.act == "swiglu" and self.fusion not in (0, 1, 2):
            raise InvalidArgument(f"{name}: swiglu_fusion must be 0, 1 or 2, got {self.fusion}")
        if int(self.attr("swiglu_limit_after_activation", 0)):
            raise InvalidArgument(f"{name}: swiglu_limit_after_activation=1 is not supported (CUDA-only in onnxruntime)")
        if self.sparse_mixer and self.k != 2:
            raise InvalidArgument(f"{name}: the sparse mixer chooses k=2 experts, got k={self.k}")
        if self.k < 1:
            raise InvalidArgument(f"{name}: k must be >= 1, got {self.k}")

    # -- the layer ------------------------------------------------------------------------------
    def _fused(self) -> bool:
        return self.act == "swiglu" and self.fusion in (1, 2)

    @quiet_floats
    def run(self, x, router_probs, fc1_w=None, fc1_b=None, fc2_w=None, fc2_b=None, fc3_w=None, fc3_b=None):
        t, h = self._tokens(x)
        experts = _DenseExperts(self, fc1_w, fc2_w, fc3_w, h)
        biases = self._biases(experts, fc1_b, fc2_b, fc3_b)
        return (self._layer(x, router_probs, None, experts, biases),)

    def _tokens(self, x) -> tuple[int, int]:
        if x is None or x.ndim not in (2, 3):
            raise InvalidArgument(f"{self._where}: input must be 2-D (tokens, hidden) or 3-D (batch, sequence, hidden), "
                                  f"got {None if x is None else list(x.shape)}")
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise InvalidArgument(f"{self._where}: input must be a float tensor, got {x.dtype}")
        return math.prod(x.shape[:-1]), x.shape[-1]

    def _biases(self, experts, *biases) -> list:
        out = []
        for j, b in enumerate(biases):
            if b is None:
                out.append(None)
                continue
            want = (experts.e, experts.n[j])
            if j == 2 and experts.n[2] is None or tuple(b.shape) != want:
                raise InvalidArgument(f"{self._where}: fc{j + 1} bias must have shape {list(want)}, got {list(b.shape)}")
            out.append(as_compute(b).astype(np.float32, copy=False))
        return out

    def _layer(self, x, router_probs, router_weights, experts, biases) -> np.ndarray:
        t, h = math.prod(x.shape[:-1]), x.shape[-1]
        e = experts.e
        if router_probs is None or router_probs.ndim != 2 or router_probs.shape != (t, e):
            raise InvalidArgument(f"{self._where}: router_probs must have shape [{t}, {e}] (tokens, experts), "
                                  f"got {None if router_probs is None else list(router_probs.shape)}")
        if router_weights is not None and tuple(router_weights.shape) != (t, e):
            raise InvalidArgument(f"{self._where}: router_weights must have shape [{t}, {e}], "
                                  f"got {list(router_weights.shape)}")
        if self.k > e:
            raise InvalidArgument(f"{self._where}: k={self.k} is more than the {e} experts")
        if self.sparse_mixer and router_weights is not None:
            raise InvalidArgument(f"{self._where}: router_weights cannot be used with the sparse mixer")
        x2 = as_compute(x).reshape(t, h)
        if x2.dtype != np.float32:
            x2 = x2.astype(np.float32)
        out = np.zeros((t, h), np.float32)
        if t:
            logits = as_compute(router_probs).astype(np.float32, copy=False)
            rw = None if router_weights is None else as_compute(router_weights).astype(np.float32, copy=False)
            chosen, mix = route(logits, self.k, self.normalize or self.always_normalize, self.sparse_mixer, rw,
                                self.normalize)
            if t == 1:  # a decoding step: its k experts, one row each
                for ex, weight in zip(chosen[0].tolist(), mix[0].tolist()):
                    y = self._expert(ex, x2, experts, biases)
                    y *= np.float32(weight)
                    out += y
            else:
                for ex in np.unique(chosen):
                    tok, slot = np.nonzero(chosen == ex)
                    a = np.ascontiguousarray(x2[tok])
                    y = self._expert(int(ex), a, experts, biases)
                    y *= mix[tok, slot][:, None]
                    out[tok] += y  # (a token chooses an expert once: its rows are distinct)
        return out.reshape(x.shape).astype(x.dtype, copy=False)

    def _expert(self, e: int, a: np.ndarray, experts, biases) -> np.ndarray:
        g = experts.project(e, 0, a)
        if biases[0] is not None:
            g += biases[0][e]
        if self.act == "swiglu":
            if self.fusion == 1:
                gate, lin = g[:, 0::2], g[:, 1::2]
            elif self.fusion == 2:
                half = g.shape[1] // 2
                gate, lin = g[:, :half], g[:, half:]
            else:
                gate = g
                lin = experts.project(e, 2, a)
                if biases[2] is not None:
                    lin += biases[2][e]
            gate = np.minimum(gate, np.float32(self.limit))
            lin = np.clip(lin, np.float32(-self.limit), np.float32(self.limit))
            hdn = gate * _sigmoid(np.float32(self.alpha) * gate)
            hdn *= lin + np.float32(self.beta)
        else:
            hdn = self._activation(g)
            if experts.has_fc3:
                lin = experts.project(e, 2, a)
                if biases[2] is not None:
                    lin += biases[2][e]
                hdn *= lin
        y = experts.project(e, 1, np.ascontiguousarray(hdn, dtype=np.float32))
        if biases[1] is not None:
            y += biases[1][e]
        return y

    def _activation(self, g: np.ndarray) -> np.ndarray:
        if self.act == "relu":
            return np.maximum(g, 0, out=g)
        if self.act == "silu":
            g *= _sigmoid(g)
            return g
        if self.act == "gelu":  # the tanh approximation, as onnxruntime's MoE kernels (CPU and CUDA)
            return tanh_gelu_inplace(g)
        return g


class _DenseExperts:
    """Float experts: ``project(e, j, a)`` is ``a @ fc{j+1}[e]`` (transposed unless legacy)."""

    def __init__(self, kernel: MoE, fc1, fc2, fc3, h: int) -> None:
        where = kernel._where
        for j, w in enumerate((fc1, fc2)):
            if w is None or w.ndim != 3:
                raise InvalidArgument(f"{where}: fc{j + 1}_experts_weights must be 3-D (experts, out, in), "
                                      f"got {None if w is None else list(w.shape)}")
        fused = kernel._fused()
        e = fc1.shape[0]
        inter = fc2.shape[1] * fc2.shape[2] // h if h else 0
        f1 = 2 * inter if fused else inter
        # onnxruntime's backward-compatible layout: (E, in, out) matrices
        legacy = (h != inter and fc2.shape[1] == inter) or (h == inter and fused and fc1.shape[1] == h)
        want1 = (e, h, f1) if legacy else (e, f1, h)
        want2 = (e, inter, h) if legacy else (e, h, inter)
        want3 = (e, h, inter) if legacy else (e, inter, h)
        if tuple(fc1.shape) != want1 or tuple(fc2.shape) != want2 or (fc3 is not None and tuple(fc3.shape) != want3):
            raise InvalidArgument(
                f"{where}: expert weights of hidden size {h}: fc1 {list(fc1.shape)}, fc2 {list(fc2.shape)}"
                f"{'' if fc3 is None else f', fc3 {list(fc3.shape)}'} do not match (experts, out, in) = "
                f"{list(want1)}, {list(want2)}{'' if fc3 is None else f', {list(want3)}'}")
        if kernel.act == "swiglu" and kernel.fusion == 0 and fc3 is None:
            raise InvalidArgument(f"{where}: swiglu with swiglu_fusion=0 needs fc3_experts_weights (the linear half)")
        if fused and fc3 is not None:
            raise InvalidArgument(f"{where}: fc3_experts_weights with a fused swiglu (swiglu_fusion={kernel.fusion})")
        self.e, self.legacy = e, legacy
        self.n = (f1, h, inter if fc3 is not None else None)
        self.has_fc3 = fc3 is not None
        self.w = (fc1, fc2, fc3)

    def project(self, e: int, j: int, a: np.ndarray) -> np.ndarray:
        w = self.w[j][e]
        if w.dtype != np.float32:
            w = as_compute(w).astype(np.float32, copy=False)
        return a @ (w if self.legacy else w.T)


# -- QMoE ---------------------------------------------------------------------------------------

_QMOE_PACK_VERSION = 1


def _pow2_block(k: int) -> int:
    return max(16, 1 << max(0, (k - 1).bit_length()))


@register("QMoE", domain="com.microsoft", since=1)
class QMoE(MoE):
    """``com.microsoft::QMoE``: quantized experts (see the module docstring).

    Routing as onnxruntime's CPU QMoE: the chosen experts' probabilities are always divided by
    their sum (its kernel takes the softmax of the k chosen logits whatever
    ``normalize_routing_weights`` says; measured on onnxruntime 1.32, where its float ``MoE``
    and its INT3 path honour the attribute, as they do here); ``router_weights`` are divided by
    their sum when it is 1.
    """

    op_type = "QMoE"
    always_normalize = True
    _WEIGHTS = (2, 5, 8)
    _SCALES = (3, 6, 9)
    _BIASES = (4, 7, 10)
    _ZEROS = (11, 12, 13)

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        quant = str(self.attr("quant_type", "int"))
        if quant != "int":
            raise InvalidArgument(f"{self._where}: quant_type {quant!r} is not supported (integer experts only)")
        self.bits = int(self.attr("expert_weight_bits", 4))
        self.proj_bits = tuple(int(self.attr(f"fc{j}_expert_weight_bits", self.bits)) for j in (1, 2, 3))
        for b in self.proj_bits:
            if b not in (2, 3, 4, 8):
                raise InvalidArgument(f"{self._where}: expert weight bits must be 2, 3, 4 or 8, got {b}")
        self.block_size = int(self.attr("block_size", 0))
        if 3 in self.proj_bits and (self.act != "swiglu" or self.fusion != 1 or self.block_size not in (32, 64, 128)
                                    or self.attrs.get("weights_prepacked") != 0):
            raise InvalidArgument(f"{self._where}: 3-bit experts (the INT3 profile) need activation_type swiglu, "
                                  f"swiglu_fusion 1, block_size 32, 64 or 128 and weights_prepacked 0, all explicit")
        if self.block_size and (self.block_size < 16 or self.block_size & (self.block_size - 1)):
            raise InvalidArgument(f"{self._where}: block_size must be a power of 2 and >= 16, got {self.block_size}")
        self.accuracy_level = int(self.attr("accuracy_level", 0))
        # onnxruntime's INT3 path honours normalize_routing_weights (its 2/4/8-bit kernel does not)
        self.always_normalize = 3 not in self.proj_bits
        if int(self.attr("weights_prepacked", -1)) not in (-1, 0):  # -1 (default) and 0: raw weights on CPU
            raise InvalidArgument(f"{self._where}: weights_prepacked={self.attr('weights_prepacked')} is a CUDA "
                                  "layout (the raw [E, N, K * bits / 8] weights have 0 or -1)")
        names = list(node.input)
        extra = [i for i in range(15, len(names)) if names[i]]
        if extra:
            raise InvalidArgument(f"{self._where}: inputs {extra} (global or activation scales) are only for "
                                  "floating-point quant types")
        self._packed: dict[tuple[str, int], np.ndarray] = {}
        self._shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        self._subs: dict[tuple, list] = {}
        # (hidden size, experts, biases, the bias arrays): the last call's, when every quantized
        # input was packed (the same experts serve every call of that hidden size)
        self._kept: tuple | None = None
        self._fours: dict[tuple[int, int, int], np.ndarray] = {}  # 3-bit experts' zero points

    # -- geometry of one projection ---------------------------------------------------------------
    def _geometry(self, j: int, shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
        """(experts, N, K, bits, block) of projection ``j``'s weight of ``shape`` (E, N, K*bits/8).
        3-bit codes (the INT3 profile: one bit stream per row) are packed and computed as 4-bit
        ones (:func:`_stored_bits`) with zero point 4."""
        bits = self.proj_bits[j]
        e, n, kb = shape
        k = kb * 8 // bits
        # One block per row (row-wise scales, or a block_size of K or more): a block of the next
        # power of two >= K, whatever the attribute says (a row is never padded to a huge block).
        return e, n, k, bits, min(self.block_size or _pow2_block(k), _pow2_block(k))

    # -- pre-packing ------------------------------------------------------------------------------
    def _role(self, input_index: int) -> tuple[str, int] | None:
        for role, where in (("w", self._WEIGHTS), ("s", self._SCALES), ("z", self._ZEROS)):
            if input_index in where:
                return role, where.index(input_index)
        return None

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        role = self._role(input_index)
        if role is None:
            return None
        kind, j = role
        # A packed buffer is 1-D: the weight's shape (how many experts, rows and codes per row)
        # is kept from here, asked before any pack is made or mapped.
        self._shapes[(kind, j)] = tuple(info.shape)
        dtype = np.dtype(info.dtype)
        if kind == "w" and (dtype != np.uint8 or len(info.shape) != 3):
            return None
        if kind == "s" and (dtype.kind != "f" and dtype.name != "bfloat16"):
            return None
        if kind == "z" and (dtype != np.uint8 or self.proj_bits[j] != 8 or len(info.shape) != 3):
            # Packed zero points of fewer bits do not say how many blocks a row has (a byte holds
            # the last block's code and padding): those are unpacked per call, with the weight's
            # geometry.
            return None
        attrs = struct.pack("<qqBqB", self.proj_bits[j], self.block_size, ord(kind), TILE, j)
        if kind == "w" and self.proj_bits[j] == 2:
            attrs += b"\x04"  # (2-bit codes packed 4-bit: another layout, another key)
        return PackSpec("qmoe", _QMOE_PACK_VERSION, attrs + struct.pack("<q", len(info.shape)), 1)

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...] | None:
        kind, j = self._role(input_index)
        packed = self._pack(kind, j, weight, None)
        return None if packed is None else (packed,)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        kind, j = self._role(input_index)
        self._packed[(kind, j)] = buffers[0]
        self._subs.clear()
        self._kept = None

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        kind, j = self._role(input_index)
        shape = tuple(info.shape)
        if kind == "w":
            e, n, k, bits, bs = self._geometry(j, shape)
            count = e * n * -(-k // bs) * (bs * _stored_bits(bits) // 8)
        else:  # scales (E, N) or (E, N, n_blocks); 8-bit zero points (E, N, n_blocks)
            count = math.prod(shape)
        return [(_packed_dtype(kind, info.dtype), (count,))]

    def _pack(self, kind: str, j: int, arr: np.ndarray, geometry) -> np.ndarray | None:
        """Projection ``j``'s weight ("w"), scales ("s") or zero points ("z") in the tiled layout,
        expert after expert (None when the tensor's shape is not one this kernel can read: the run
        says what is wrong)."""
        arr = np.asarray(arr)
        bits = self.proj_bits[j]
        if kind == "w":
            if arr.ndim != 3:
                return None
            e, n, k, bits, bs = self._geometry(j, arr.shape)
            nb = -(-k // bs)
            if bits in (2, 3):  # the row's codes as 4-bit ones, two to a byte (the even one low)
                arr = _three_bit_codes(arr, k) if bits == 3 else unpack_nbits(arr, 2, k)
                arr = pack_nibbles(arr.astype(np.uint8))
                bits = 4
            blob = bs * bits // 8
            rows = arr.reshape(e, n, -1)
            if rows.shape[2] != nb * blob:  # a partial last block: pad each row with zero codes
                padded = np.zeros((e, n, nb * blob), np.uint8)
                padded[:, :, :rows.shape[2]] = rows
                rows = padded
            return _expert_tiles(rows.reshape(e, n, nb, blob))
        if arr.ndim not in (2, 3):
            return None
        e, n = arr.shape[:2]
        if kind == "s":
            per = _as_storage(arr).reshape(e, n, -1)
            return _expert_tiles(per[..., None])
        if arr.ndim == 2:  # row-wise zero points: packed along N
            n = arr.shape[1] * 8 // bits if geometry is None else geometry[1]
            codes = unpack_nbits(arr, bits, n)[:, :, None]
        else:
            nb = arr.shape[2] * 8 // bits if geometry is None else geometry[2]
            codes = unpack_nbits(arr, bits, nb)
        return _expert_tiles(codes[..., None])

    # -- compute --------------------------------------------------------------------------------
    @quiet_floats
    def run(self, x, router_probs, fc1_w=None, fc1_s=None, fc1_b=None, fc2_w=None, fc2_s=None, fc2_b=None,
            fc3_w=None, fc3_s=None, fc3_b=None, fc1_z=None, fc2_z=None, fc3_z=None, router_weights=None, *rest):
        t, h = self._tokens(x)
        if 3 in self.proj_bits and x.dtype.name not in ("float16", "bfloat16"):
            raise InvalidArgument(f"{self._where}: 3-bit experts (the INT3 profile) take float16 or bfloat16 "
                                  f"activations, got {x.dtype}")
        given = (fc1_w, fc2_w, fc3_w, fc1_s, fc2_s, fc3_s, fc1_z, fc2_z, fc3_z)
        kept = self._kept
        if (kept is not None and kept[0] == h and all(v is None for v in given)
                and all(a is b for a, b in zip(kept[3], (fc1_b, fc2_b, fc3_b)))):
            experts, biases = kept[1], kept[2]  # every quantized input packed: as the last call's
        else:
            experts = _QuantExperts(self, h, (fc1_w, fc2_w, fc3_w), (fc1_s, fc2_s, fc3_s), (fc1_z, fc2_z, fc3_z))
            biases = self._biases(experts, fc1_b, fc2_b, fc3_b)
            if all(v is None for v in given):
                self._kept = (h, experts, biases, (fc1_b, fc2_b, fc3_b))
        return (self._layer(x, router_probs, router_weights, experts, biases),)


def _stored_bits(bits: int) -> int:
    """The width a projection's codes are packed and computed in: 2- and 3-bit codes as 4-bit
    ones (the layout MatMulNBits packs 2-bit weights in)."""
    return 4 if bits in (2, 3) else bits


def _three_bit_codes(packed: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` 3-bit codes of each row of ``packed`` (uint8 (..., bytes)): one bit
    stream per row, the low bits first (code i at bits 3i .. 3i + 2)."""
    bits = np.unpackbits(np.ascontiguousarray(packed, dtype=np.uint8), axis=-1, bitorder="little")
    if bits.shape[-1] < 3 * count:
        raise InvalidArgument(f"3-bit codes: a row of {packed.shape[-1]} bytes holds fewer than {count} codes")
    trip = bits[..., :3 * count].reshape(*packed.shape[:-1], count, 3)
    return trip[..., 0] | (trip[..., 1] << 1) | (trip[..., 2] << 2)


def _expert_tiles(x: np.ndarray) -> np.ndarray:
    """(E, N, n_blocks, r) per-expert block data -> every expert's tiled layout, one after another."""
    return np.concatenate([to_tiles(x[i]) for i in range(x.shape[0])]) if x.shape[0] else np.empty(0, x.dtype)


def _packed_dtype(kind: str, dtype) -> np.dtype:
    return np.dtype(np.uint8) if kind in "wz" else _float_storage(dtype)


class _QuantExperts:
    """Quantized experts: ``project(e, j, a)`` runs a MatMulNBits over expert ``e``'s slice of
    projection ``j``'s tiled buffers (see the module docstring)."""

    def __init__(self, kernel: QMoE, h: int, weights, scales, zeros) -> None:
        where = kernel._where
        fused = kernel._fused()
        shapes = []
        for j, w in enumerate(weights):
            if w is None:
                packed = kernel._packed.get(("w", j)) is not None
                if not packed and j < 2:
                    raise InvalidArgument(f"{where}: fc{j + 1}_experts_weights is missing")
                shapes.append(kernel._shapes.get(("w", j)) if packed else None)
                continue
            if w.dtype != np.uint8 or w.ndim != 3:
                raise InvalidArgument(f"{where}: fc{j + 1}_experts_weights must be uint8 (experts, out, in * bits / 8), "
                                      f"got {w.dtype}{list(w.shape)}")
            shapes.append(tuple(w.shape))
        e = shapes[0][0]
        geo = [None if s is None else kernel._geometry(j, s) for j, s in enumerate(shapes)]
        inter = geo[1][2]
        f1 = 2 * inter if fused else inter
        want = [(e, f1, h), (e, h, inter), (e, inter, h)]
        for j, g in enumerate(geo):
            if g is None:
                continue
            got = g[:3]
            if got != want[j] or shapes[j][2] * 8 % kernel.proj_bits[j]:
                raise InvalidArgument(
                    f"{where}: fc{j + 1}_experts_weights {list(shapes[j])} ({kernel.proj_bits[j]}-bit) does not hold "
                    f"{want[j][0]} experts of {want[j][1]}x{want[j][2]} (out x in) for hidden size {h} (the input's) and "
                    f"inter size {inter} (fc2_experts_weights {list(shapes[1])})")
        if kernel.act == "swiglu" and kernel.fusion == 0 and geo[2] is None:
            raise InvalidArgument(f"{where}: swiglu with swiglu_fusion=0 needs fc3_experts_weights (the linear half)")
        if fused and geo[2] is not None:
            raise InvalidArgument(f"{where}: fc3_experts_weights with a fused swiglu (swiglu_fusion={kernel.fusion})")
        self.e = e
        self.n = (f1, h, inter if geo[2] is not None else None)
        self.has_fc3 = geo[2] is not None
        self.parts = []
        for j, g in enumerate(geo):
            if g is None:
                self.parts.append(None)
                continue
            self.parts.append(self._projection(kernel, j, g, weights[j], scales[j], zeros[j]))

    @staticmethod
    def _projection(kernel: QMoE, j: int, geo, w, s, z) -> list:
        """Expert ``e``'s MatMulNBits kernel for projection ``j``, for every e (kept on the kernel
        while its packed buffers stay the same)."""
        where = kernel._where
        e, n, k, bits, bs = geo
        nb = -(-k // bs)
        row_wise = kernel.block_size == 0
        s_shape = tuple(s.shape) if s is not None else kernel._shapes.get(("s", j))
        if s_shape is not None:
            want = (e, n) if row_wise else (e, n, nb)
            if not row_wise and nb == 1 and s_shape == (e, n):
                # one scale per row with a block_size of K or more: row-wise, as onnxruntime
                # reads (E, N) scales whatever block_size says
                want, row_wise = (e, n), True
            if s_shape != want or (s is not None and s.dtype.kind != "f" and s.dtype.name != "bfloat16"):
                raise InvalidArgument(f"{where}: fc{j + 1}_scales must be float of shape {list(want)}, "
                                      f"got {'' if s is None else s.dtype}{list(s_shape)}")
        if z is not None:
            per = -(-n * bits // 8) if row_wise else -(-nb * bits // 8)
            want = (e, per) if row_wise else (e, n, per)
            if z.dtype != np.uint8 or tuple(z.shape) != want:
                raise InvalidArgument(f"{where}: fc{j + 1}_zero_points must be uint8 of shape {list(want)}, "
                                      f"got {z.dtype}{list(z.shape)}")
            if bits == 3:
                if (_three_bit_codes(z, nb) != 4).any():
                    raise InvalidArgument(f"{where}: fc{j + 1}_zero_points: every 3-bit zero point must be 4 "
                                          "(the INT3 profile's)")
                z = None  # the implicit 4, below
        packed = []
        for kind, arr in (("w", w), ("s", s), ("z", z)):
            buf = kernel._packed.get((kind, j))
            if buf is None and arr is not None:
                buf = kernel._pack(kind, j, arr, (e, n, nb))
            packed.append(buf)
        bq, sc, zq = packed
        if sc is None:
            raise InvalidArgument(f"{where}: fc{j + 1}_scales is missing")
        if bits == 3:  # 4-bit codes with the INT3 profile's zero point, 4, in every block
            zq = kernel._fours.get((e, n, nb))
            if zq is None or len(kernel._fours) > 8:
                kernel._fours.clear()
                zq = kernel._fours[(e, n, nb)] = np.full(e * n * nb, 4, np.uint8)
            bits = 4
        key = (j, id(bq), id(sc), id(zq))
        subs = kernel._subs.get(key)
        if subs is not None:
            return subs[0]
        blob = bs * _stored_bits(bits) // 8  # (2-bit codes are packed 4-bit: MatMulNBits' layout)
        if bq.size != e * n * nb * blob or sc.size != e * n * nb or (zq is not None and zq.size != e * n * nb):
            raise InvalidArgument(f"{where}: fc{j + 1}'s packed buffers do not match {e} experts of {n}x{k}")
        # onnxruntime rounds a projection's activations to int8 per block where its QNBit GEMM
        # took the weights when it pre-packed them: block-wise, K a multiple of the block, and 8
        # bits (it has no float kernel for them) or accuracy_level 4; elsewhere (weights fed at run
        # time, pre-packing disabled) it dequantizes and multiplies in float.  So here: where this
        # kernel packed the weight.
        level = 0
        if (kernel._packed.get(("w", j)) is not None and not row_wise and k % kernel.block_size == 0
                and kernel.proj_bits[j] != 3 and (bits == 8 or (bits == 4 and kernel.accuracy_level == 4))):
            level = 4
        node = NodeProto()  # (onnx itself is never imported to run a model: graph/_proto.py)
        node.op_type, node.domain, node.name = "MatMulNBits", "com.microsoft", f"{kernel.node.name}/fc{j + 1}"
        node.input.extend(["A", "B", "scales"] + (["zp"] if zq is not None else []))
        node.output.append("Y")
        for name, value in (("K", k), ("N", n), ("bits", bits), ("block_size", bs), ("accuracy_level", level)):
            a = node.attribute.add()
            a.name, a.type, a.i = name, AttributeProto.INT, value
        subs = []
        wb, sb = n * nb * blob, n * nb
        for i in range(e):
            sub = MatMulNBits(node, kernel.ctx)
            sub.use_prepacked(1, (bq[i * wb:(i + 1) * wb],))
            sub.use_prepacked(2, (sc[i * sb:(i + 1) * sb],))
            if zq is not None:
                sub.use_prepacked(3, (zq[i * sb:(i + 1) * sb],))
            subs.append(sub)
        if len(kernel._subs) >= 8:
            kernel._subs.clear()
        kernel._subs[key] = (subs, bq, sc, zq)  # the buffers too: ids stay unique while kept
        return subs

    def project(self, e: int, j: int, a: np.ndarray) -> np.ndarray:
        (y,) = self.parts[j][e].run(a)
        return y

