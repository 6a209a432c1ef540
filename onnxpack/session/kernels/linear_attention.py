"""Gated DeltaNet / linear-attention layers as onnxruntime-genai's builder writes them for Qwen3.5
(dense ``Qwen3_5ForConditionalGeneration`` and Qwen3.5-MoE): ``com.microsoft::LinearAttention``
(and ONNX's ``LinearAttention``-27), ``LinearAttentionGate``, ``GatedRMSNorm``, ``GatedAdd``,
``MRotaryEmbedding`` and ``BranchwiseRMSNorm``.  Everything is computed in float32 and rounded
once to the input's type (float16 / bfloat16 in, the same type out), except where noted.

**LinearAttention** — a recurrence over the tokens of each sequence with one matrix state
``S`` (d_k x d_v) per KV head.  Inputs are packed (B, T, heads * d): ``query`` (H_q heads of
d_k), ``key`` (n_k heads of d_k, n_k dividing H_kv: KV head h reads key head
``h // (H_kv / n_k)``), ``value`` (H_kv heads of d_v), ``decay`` g (log-space; (B, T, H_kv) one
per head, or (B, T, H_kv * d_k) one per key row of S), ``beta`` (B, T, H_kv) or (B, T, 1).
Per token, with ``update_rule``:

* ``linear``:      ``S += k v^T``
* ``gated``:       ``S = e^g S;  S += k v^T``
* ``delta``:       ``S += k (beta (v - S^T k))^T``
* ``gated_delta``: ``S = e^g S;  S += k (beta (v - S^T k))^T``  (the retrieval reads the decayed S)

then ``o = scale * S^T q`` (``scale`` 0 means 1/sqrt(d_k)).  Head groups: with H_q >= H_kv each
KV head serves H_q / H_kv consecutive query heads (output H_q * d_v); with H_q < H_kv ("inverse
GQA", Qwen3.5: 16 key/query heads, 32 value heads) KV head h is read by query head
``h // (H_kv / H_q)`` and the output has H_kv * d_v.  ``past_state`` / ``present_state`` are
(B, H_kv, d_k, d_v), key-major; zeros without a past.  With ``state_window`` W (1-8; the
com.microsoft op only) both are (W, B, H_kv, d_k, d_v): the past is read from slot W - 1 and slot
j of the present is the state after token T - W + j, zeros for slots before this call's first
token.  onnxruntime 1.32's CPU kernel refuses every W > 0; this follows the spec (checked in
the tests against onnxruntime runs of the sequence's prefixes).  With no token at all (T = 0) the
spec contradicts itself (slot W - 1 "is always the state after the last token" yet every slot
"holds no token from this call"); slot W - 1 then carries the past on and the others are
zeros.  The output has the query's type; the present state the past's (the query's without a
past).  A decoding step costs a few
passes over the state (no dependence on the context length); prefill loops over the tokens,
vectorized over batch and heads.  ``chunk_size`` is a tuning hint and is ignored.  The
com.microsoft op accepts (and ignores) a decay / beta its rule does not use, as onnxruntime does;
ONNX's LinearAttention-27 refuses them, wants H_q a multiple of H_kv and the key with H_kv heads
(its shape inference in onnxruntime does).  onnxruntime registers only a float32 kernel and runs
float16 nodes through casts around it: the same float32 computation as here.

**LinearAttentionGate** — ``decay = decay_scale * softplus(a + dt_bias)`` and
``beta = sigmoid(b)``: a, b (..., H) of type T; dt_bias and decay_scale float32 with H elements
(decay_scale is the model's ``-exp(A_log)``).

**GatedRMSNorm** — per group of C = len(scale) trailing elements of X (the last axis a multiple
of C: a per-head norm on packed heads), ``Y = X / sqrt(mean(X^2) + epsilon) * scale * act(gate)``
with ``act`` silu (``swish``; the default) or sigmoid; epsilon defaults to 1e-5.

**GatedAdd** — ``X + Y * gate`` with gate (..., 1), one per row.  For float16 / bfloat16 the
product is rounded to the type before the add (as two separate ONNX Mul and Add would).  With
``gate_weight`` (K, 1), the gate is ``sigmoid(gate . gate_weight)`` per row, each step rounded
to T as the spec writes it (projection, sigmoid, product, sum); onnxruntime implements that mode
only on CUDA for bfloat16 (its CPU kernel refuses it); this kernel computes it for every type.

**MRotaryEmbedding** — Qwen-VL's multimodal rotary embedding: ``position_ids`` (3, B, S) holds a
temporal, height and width position per token; column c of the half-rotary cos/sin vector comes
from the cache row of one of them: sectioned layout (0) ``[T]*s0 + [H]*s1 + [W]*s2``,
interleaved (1) T everywhere except columns 1, 4, 7, ... (below 3 * s1) from H and 2, 5, 8, ...
(below 3 * s2) from W.  cos and sin are multiplied by ``scale`` (rounded to T), then the usual
rotation of the first ``rotary_embedding_dim`` values of each head (halves, or interleaved
pairs); the rest is copied.  Input (B, S, N * head) with ``num_heads`` or (B, N, S, head).
onnxruntime's CPU kernel refuses a 3-D input without ``num_heads``; this kernel then takes the
head size from the cache width (2 * width), as ``RotaryEmbedding`` does, when
``rotary_embedding_dim`` is 0.  onnxruntime also refuses S above the cache's rows without
``is_packed_batching`` even when the positions are in range; this kernel only checks the
positions.

**BranchwiseRMSNorm** — RMS norm over H of every branch: X (..., C, H), or (..., C * H) with
``num_branches`` C; optional scale (H), (C, H) or (C * H), of any float type.

Errors (bad shapes, missing inputs, bad attributes) raise :class:`InvalidArgument` naming the
node.  ``GatedDeltaNet`` (the packed variant with fused gate activations, ragged batches and
transition capture) is not implemented here.
"""

from __future__ import annotations

import math

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels._base import Kernel, quiet_floats, register
from onnxpack.session.kernels.linalg import as_compute

__all__ = [
    "LinearAttention",
    "LinearAttention27",
    "LinearAttentionGate",
    "GatedRMSNorm",
    "GatedAdd",
    "MRotaryEmbedding",
    "BranchwiseRMSNorm",
]

_F = np.float32
_RULES = ("linear", "gated", "delta", "gated_delta")


_NO_GATE = np.ones((1, 1, 1, 1), np.float32)  # the JIT's decay / beta / window when a rule has none
_NO_BETA = np.ones((1, 1, 1), np.float32)
_NO_WINDOW = np.zeros((0, 1, 1, 1, 1), np.float32)


def _jit():
    """The recurrence's numba kernel (:mod:`._la_jit`), or None (the numpy loop)."""
    from onnxpack.session.kernels import _act

    return _act.load_jit("_la_jit", "LinearAttention")


def _f32(x: np.ndarray) -> np.ndarray:
    return as_compute(x).astype(_F, copy=False)


def _is_float(x: np.ndarray) -> bool:
    return x.dtype.kind == "f" or x.dtype.name == "bfloat16"


def _shape(x) -> list | None:
    return None if x is None else list(x.shape)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """float32 logistic without overflow warnings."""
    out = np.tanh(x * _F(0.5))
    out += 1
    out *= 0.5
    return out


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(_F(0), x).astype(_F, copy=False)


def _round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` (float32) rounded to ``dtype`` and back (identity for float32)."""
    if dtype == _F:
        return x
    return x.astype(dtype).astype(_F)


class _Op(Kernel):
    def _err(self, msg: str) -> InvalidArgument:
        return InvalidArgument(f"node {self.node.name!r} ({self.op_type}): {msg}")

    def _need_float(self, **named) -> None:
        for name, x in named.items():
            if x is not None and not _is_float(x):
                raise self._err(f"{name} must be a float tensor, got {x.dtype}")


# -- LinearAttention -------------------------------------------------------------------------------


@register("LinearAttention", domain="com.microsoft", since=1)
class LinearAttention(_Op):
    """``com.microsoft::LinearAttention`` (see the module docstring)."""

    op_type = "LinearAttention"
    domain = "com.microsoft"
    has_window = True

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        for name in ("q_num_heads", "kv_num_heads"):
            if name not in self.attrs:
                raise self._err(f"missing required attribute {name!r}")
        self.hq = int(self.attr("q_num_heads"))
        self.hkv = int(self.attr("kv_num_heads"))
        if self.hq <= 0 or self.hkv <= 0:
            raise self._err(f"q_num_heads and kv_num_heads must be positive, got {self.hq} and {self.hkv}")
        if self.hq % self.hkv and self.hkv % self.hq:
            raise self._err(f"one of q_num_heads ({self.hq}) and kv_num_heads ({self.hkv}) must be a multiple "
                            "of the other")
        if not self.has_window and self.hq % self.hkv:
            raise self._err(f"q_num_heads ({self.hq}) must be a multiple of kv_num_heads ({self.hkv})")
        self.rule = str(self.attr("update_rule", "gated_delta"))
        if self.rule not in _RULES:
            raise self._err(f"update_rule must be one of {list(_RULES)}, got {self.rule!r}")
        self.scale = float(self.attr("scale", 0.0))
        self.window = int(self.attr("state_window", 0)) if self.has_window else 0
        if not 0 <= self.window <= 8:
            raise self._err(f"state_window must be in [0, 8], got {self.window}")
        self.gated = self.rule in ("gated", "gated_delta")
        self.delta = self.rule in ("delta", "gated_delta")

    @quiet_floats
    def run(self, query, key=None, value=None, past_state=None, decay=None, beta=None):
        self._need_float(query=query, key=key, value=value, past_state=past_state, decay=decay, beta=beta)
        if query is None or key is None or value is None:
            raise self._err("query, key and value are required")
        if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
            raise self._err(f"query, key and value must be 3-D (B, T, heads * head_size), got "
                            f"{_shape(query)}, {_shape(key)}, {_shape(value)}")
        b, t, qh = query.shape
        if key.shape[:2] != (b, t) or value.shape[:2] != (b, t):
            raise self._err(f"key {list(key.shape)} and value {list(value.shape)} must have the query's batch and "
                            f"sequence ({b}, {t})")
        hq, hkv = self.hq, self.hkv
        if qh % hq or qh == 0:
            raise self._err(f"query hidden size {qh} is not a positive multiple of q_num_heads {hq}")
        dk = qh // hq
        if key.shape[2] % dk or key.shape[2] == 0:
            raise self._err(f"key hidden size {key.shape[2]} is not a positive multiple of the head size {dk}")
        nk = key.shape[2] // dk
        if hkv % nk:
            raise self._err(f"kv_num_heads {hkv} is not a multiple of the key's {nk} heads")
        if value.shape[2] % hkv or value.shape[2] == 0:
            raise self._err(f"value hidden size {value.shape[2]} is not a positive multiple of kv_num_heads {hkv}")
        dv = value.shape[2] // hkv
        per_key = False
        if decay is not None:
            if decay.ndim != 3 or decay.shape[:2] != (b, t) or decay.shape[2] not in (hkv, hkv * dk):
                raise self._err(f"decay must be ({b}, {t}, {hkv}) or ({b}, {t}, {hkv * dk}), got {list(decay.shape)}")
            per_key = decay.shape[2] == hkv * dk
        elif self.gated:
            raise self._err(f"decay is required for update_rule {self.rule!r}")
        if beta is not None:
            if beta.ndim != 3 or beta.shape[:2] != (b, t) or beta.shape[2] not in (hkv, 1):
                raise self._err(f"beta must be ({b}, {t}, {hkv}) or ({b}, {t}, 1), got {list(beta.shape)}")
        elif self.delta:
            raise self._err(f"beta is required for update_rule {self.rule!r}")
        w = self.window
        state_shape = (b, hkv, dk, dv)
        if past_state is not None:
            want = (w, *state_shape) if w else state_shape
            if past_state.shape != want:
                raise self._err(f"past_state must be {list(want)}, got {list(past_state.shape)}")
            s = _f32(past_state[-1] if w else past_state)  # copied (or scaled into a new array) below
            sdt = past_state.dtype
        else:
            s = np.zeros(state_shape, _F)
            sdt = query.dtype
        scale = _F(self.scale if self.scale != 0.0 else 1.0 / math.sqrt(dk))
        hout = max(hq, hkv)

        # (B, T, H, d) views in float32; keys repeated to the KV heads, queries grouped per KV head.
        k4 = _f32(key).reshape(b, t, nk, dk)
        if nk != hkv:
            k4 = np.repeat(k4, hkv // nk, axis=2)
        v4 = _f32(value).reshape(b, t, hkv, dv)
        q4 = _f32(query).reshape(b, t, hq, dk)
        if hq >= hkv:
            q5 = q4.reshape(b, t, hkv, hq // hkv, dk)
        else:
            q5 = np.repeat(q4, hkv // hq, axis=2)[:, :, :, None, :]
        if self.gated:
            g = np.exp(_f32(decay))
            g4 = g.reshape(b, t, hkv, dk, 1) if per_key else g.reshape(b, t, hkv, 1, 1)
        if self.delta:
            bt = _f32(beta)
            b4 = bt.reshape(b, t, beta.shape[2], 1)  # (B, T, H_kv or 1, 1)

        out = np.empty((b, t, hkv, q5.shape[3], dv), _F)
        present = np.zeros((w, *state_shape), _F) if w else None
        jit = _jit() if t else None
        if jit is not None:  # the same recurrence with each head's state in cache (see _la_jit)
            s = np.array(s, dtype=_F, order="C")  # a copy: never the caller's past
            jit.recurrence(np.ascontiguousarray(q5), np.ascontiguousarray(k4), np.ascontiguousarray(v4),
                           np.ascontiguousarray(g4.reshape(b, t, hkv, dk if per_key else 1)) if self.gated else _NO_GATE,
                           np.ascontiguousarray(b4.reshape(b, t, beta.shape[2])) if self.delta else _NO_BETA,
                           s, out, present if w else _NO_WINDOW, self.gated, self.delta, scale)
            y = out.reshape(b, t, hout * dv).astype(query.dtype, copy=False)
            if w:
                return y, present.astype(sdt, copy=False)
            return y, s.astype(sdt, copy=False)
        if t and self.gated:
            s = s * g4[:, 0]  # the first token's decay, fused with the state's copy
        elif past_state is not None:
            s = s.copy()  # never update (or return) the caller's past in place
        for i in range(t):
            kt = k4[:, i, :, :, None]  # (B, H, dk, 1)
            if self.gated and i:
                s *= g4[:, i]
            if self.delta:
                retrieved = np.matmul(k4[:, i, :, None, :], s)[:, :, 0, :]  # S^T k: (B, H, dv)
                upd = v4[:, i] - retrieved
                upd *= b4[:, i]
            else:
                upd = v4[:, i]
            s += kt * upd[:, :, None, :]
            np.matmul(q5[:, i], s, out=out[:, i])
            if w and i >= t - w:
                present[w - t + i] = s
        out *= scale
        y = out.reshape(b, t, hout * dv).astype(query.dtype, copy=False)
        if w:
            if t == 0:  # no token: the past's last slot carries on, the others hold no state of this call
                present[w - 1] = s
            return y, present.astype(sdt, copy=False)
        return y, s.astype(sdt, copy=False)


@register("LinearAttention", since=27)
class LinearAttention27(LinearAttention):
    """ONNX ``LinearAttention``-27: the same recurrence without ``state_window``; q_num_heads a
    multiple of kv_num_heads, the key with kv_num_heads heads, and decay / beta given exactly when
    the rule uses them (as the spec's and onnxruntime's shape inference demand)."""

    domain = ""
    has_window = False

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        names = list(node.input) + [""] * 6
        for given, needed, what in ((bool(names[4]), self.gated, "decay"), (bool(names[5]), self.delta, "beta")):
            if given != needed:
                raise self._err(f"update_rule {self.rule!r} {'requires' if needed else 'forbids'} the {what} input")

    @quiet_floats
    def run(self, query, key=None, value=None, past_state=None, decay=None, beta=None):
        if query is not None and key is not None and query.ndim == 3 and key.ndim == 3 and self.hq \
                and query.shape[2] % self.hq == 0 and key.shape[2] != self.hkv * (query.shape[2] // self.hq):
            raise self._err(f"key must be (B, T, kv_num_heads * head_size) = (B, T, "
                            f"{self.hkv * (query.shape[2] // self.hq)}), got {list(key.shape)}")
        return super().run(query, key, value, past_state, decay, beta)


# -- gates and norms -------------------------------------------------------------------------------


@register("LinearAttentionGate", domain="com.microsoft", since=1)
class LinearAttentionGate(_Op):
    """``decay = decay_scale * softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""

    op_type = "LinearAttentionGate"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        outs = list(node.output)
        self.want_beta = len(outs) > 1 and bool(outs[1])

    @quiet_floats
    def run(self, a, dt_bias, decay_scale, b=None):
        self._need_float(a=a, dt_bias=dt_bias, decay_scale=decay_scale, b=b)
        if a is None or dt_bias is None or decay_scale is None:
            raise self._err("a, dt_bias and decay_scale are required")
        if a.ndim < 1 or a.shape[-1] == 0:
            raise self._err(f"a must have a positive last dimension (heads), got {list(a.shape)}")
        h = a.shape[-1]
        if dt_bias.size != h or decay_scale.size != h:
            raise self._err(f"dt_bias and decay_scale must have {h} elements (a's last dimension), got "
                            f"{list(dt_bias.shape)} and {list(decay_scale.shape)}")
        if b is not None and b.shape != a.shape:
            raise self._err(f"b must have a's shape {list(a.shape)}, got {list(b.shape)}")
        if self.want_beta and b is None:
            raise self._err("input b is required when the beta output is requested")
        z = _f32(a) + _f32(dt_bias).reshape(h)
        decay = (_f32(decay_scale).reshape(h) * _softplus(z)).astype(a.dtype, copy=False)
        if not self.want_beta:
            return (decay,)
        return decay, _sigmoid(_f32(b)).astype(b.dtype, copy=False)


@register("GatedRMSNorm", domain="com.microsoft", since=1)
class GatedRMSNorm(_Op):
    """``X / rms(X per group of C) * scale * act(gate)`` (see the module docstring)."""

    op_type = "GatedRMSNorm"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        act = str(self.attr("activation", "silu"))
        if act not in ("silu", "swish", "sigmoid"):
            raise self._err(f"activation must be 'silu', 'swish' or 'sigmoid', got {act!r}")
        self.silu = act != "sigmoid"
        self.eps = _F(self.attr("epsilon", 1e-5))

    @quiet_floats
    def run(self, x, scale, gate):
        self._need_float(X=x, scale=scale, gate=gate)
        if x is None or scale is None or gate is None:
            raise self._err("X, scale and gate are required")
        c = scale.size
        if x.ndim < 1 or c == 0 or x.shape[-1] % c:
            raise self._err(f"X's last dimension must be a multiple of scale's length {c} (> 0), got X "
                            f"{list(x.shape)}")
        if gate.shape != x.shape:
            raise self._err(f"gate must have X's shape {list(x.shape)}, got {list(gate.shape)}")
        xf = _f32(x).reshape(-1, c)
        ms = np.einsum("rc,rc->r", xf, xf) / _F(c)
        inv = (_F(1) / np.sqrt(ms + self.eps)).astype(_F, copy=False)
        y = xf * inv[:, None]
        y *= _f32(scale).reshape(c)
        z = _f32(gate).reshape(-1, c)
        act = _sigmoid(z)
        if self.silu:
            act *= z
        y *= act
        return (y.reshape(x.shape).astype(x.dtype, copy=False),)


@register("GatedAdd", domain="com.microsoft", since=1)
class GatedAdd(_Op):
    """``X + Y * gate`` per row; ``gate_weight`` projects and squashes the gate first."""

    op_type = "GatedAdd"
    domain = "com.microsoft"

    @quiet_floats
    def run(self, x, y, gate, gate_weight=None):
        self._need_float(X=x, Y=y, gate=gate, gate_weight=gate_weight)
        if x is None or y is None or gate is None:
            raise self._err("X, Y and gate are required")
        if x.ndim < 1 or y.shape != x.shape:
            raise self._err(f"Y must have X's shape {list(x.shape)} (rank >= 1), got {list(y.shape)}")
        lead = x.shape[:-1]
        dt = x.dtype
        if gate.ndim != x.ndim or gate.shape[:-1] != lead:
            raise self._err(f"gate must be {list(lead)} + [1] (or [K] with gate_weight), got {list(gate.shape)}")
        if gate_weight is None:
            if gate.shape[-1] != 1:
                raise self._err(f"gate's last dimension must be 1, got {list(gate.shape)}")
            prod = _round(_f32(y) * _f32(gate), dt)
            return ((_f32(x) + prod).astype(dt, copy=False),)
        k = gate.shape[-1]
        if gate_weight.shape != (k, 1):
            raise self._err(f"gate_weight must be ({k}, 1), got {list(gate_weight.shape)}")
        p = _round(_f32(gate) @ _f32(gate_weight), dt)  # (..., 1)
        s = _round(_sigmoid(p), dt)
        prod = _round(_f32(y) * s, dt)
        return ((_f32(x) + prod).astype(dt, copy=False),)


@register("BranchwiseRMSNorm", domain="com.microsoft", since=1)
class BranchwiseRMSNorm(_Op):
    """RMS norm of every branch's H values (see the module docstring)."""

    op_type = "BranchwiseRMSNorm"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.branches = int(self.attr("num_branches", 0))
        if self.branches < 0:
            raise self._err(f"num_branches must be >= 0, got {self.branches}")
        self.eps = _F(self.attr("epsilon", 1e-5))

    @quiet_floats
    def run(self, x, scale=None):
        self._need_float(X=x, scale=scale)
        if self.branches:
            if x.ndim < 1 or x.shape[-1] == 0 or x.shape[-1] % self.branches:
                raise self._err(f"X's last dimension must be a positive multiple of num_branches {self.branches}, "
                                f"got {list(x.shape)}")
            c, h = self.branches, x.shape[-1] // self.branches
        else:
            if x.ndim < 2 or x.shape[-1] == 0 or x.shape[-2] == 0:
                raise self._err(f"X must be (..., C, H) with C, H > 0 (or set num_branches), got {list(x.shape)}")
            c, h = x.shape[-2], x.shape[-1]
        xf = _f32(x).reshape(-1, c, h)
        ms = np.einsum("rch,rch->rc", xf, xf) / _F(h)
        y = xf * (_F(1) / np.sqrt(ms + self.eps))[..., None]
        if scale is not None:
            if scale.shape == (h,):
                y *= _f32(scale)
            elif scale.shape in ((c, h), (c * h,)):
                y *= _f32(scale).reshape(c, h)
            else:
                raise self._err(f"scale must be ({h}), ({c}, {h}) or ({c * h}), got {list(scale.shape)}")
        return (y.reshape(x.shape).astype(x.dtype, copy=False),)


# -- MRotaryEmbedding ------------------------------------------------------------------------------


def mrope_streams(section: tuple[int, int, int], layout: int, half: int) -> np.ndarray:
    """Which position stream (0 = temporal, 1 = height, 2 = width) gives each of the ``half``
    cos/sin columns."""
    which = np.zeros(half, np.int64)
    if layout == 0:
        which[:] = np.repeat(np.arange(3), section)[:half]
    else:
        for stream in (1, 2):
            which[stream:min(3 * section[stream], half):3] = stream
    return which


@register("MRotaryEmbedding", domain="com.microsoft", since=1)
class MRotaryEmbedding(_Op):
    """M-RoPE (see the module docstring)."""

    op_type = "MRotaryEmbedding"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        if "mrope_section" not in self.attrs:
            raise self._err("missing required attribute 'mrope_section'")
        self.section = tuple(int(v) for v in self.attr("mrope_section"))
        if len(self.section) != 3 or min(self.section) < 0:
            raise self._err(f"mrope_section must be 3 non-negative integers, got {list(self.section)}")
        self.layout = int(self.attr("mrope_layout", 0))
        if self.layout not in (0, 1):
            raise self._err(f"mrope_layout must be 0 (sectioned) or 1 (interleaved), got {self.layout}")
        self.heads = int(self.attr("num_heads", 0))
        self.rot = int(self.attr("rotary_embedding_dim", 0))
        if self.heads < 0 or self.rot < 0:
            raise self._err(f"num_heads ({self.heads}) and rotary_embedding_dim ({self.rot}) must be >= 0")
        if self.rot > 0 and self.heads == 0:
            raise self._err("num_heads is required with rotary_embedding_dim")
        self.interleaved = int(self.attr("interleaved", 0)) == 1
        self.scale = float(self.attr("scale", 1.0))
        self._streams: dict[int, np.ndarray] = {}

    @quiet_floats
    def run(self, x, position_ids, cos_cache, sin_cache):
        self._need_float(input=x, cos_cache=cos_cache, sin_cache=sin_cache)
        if x is None or x.ndim not in (3, 4):
            raise self._err(f"input must be 3-D (B, S, N * head) or 4-D (B, N, S, head), got {_shape(x)}")
        if cos_cache.ndim != 2 or sin_cache.shape != cos_cache.shape:
            raise self._err(f"cos_cache and sin_cache must be 2-D of one shape, got {list(cos_cache.shape)} and "
                            f"{list(sin_cache.shape)}")
        half = cos_cache.shape[1]
        b = x.shape[0]
        if x.ndim == 4:
            heads, s, head = x.shape[1], x.shape[2], x.shape[3]
        else:
            s = x.shape[1]
            if self.heads > 0:
                if x.shape[2] % self.heads:
                    raise self._err(f"hidden size {x.shape[2]} is not a multiple of num_heads {self.heads}")
                heads, head = self.heads, x.shape[2] // self.heads
            else:
                head = 2 * half
                if head == 0 or x.shape[2] % head:
                    raise self._err(f"without num_heads the hidden size {x.shape[2]} must be a multiple of the "
                                    f"head size {head} (2 x the cache width)")
                heads = x.shape[2] // head
        rot = self.rot if self.rot > 0 else head
        if rot > head or rot % 2 or rot // 2 != half:
            raise self._err(f"rotary dimension {rot} (cache width {half}) does not fit head size {head}")
        if sum(self.section) != half:
            raise self._err(f"mrope_section {list(self.section)} must sum to rotary_embedding_dim / 2 = {half}")
        pos = np.asarray(position_ids)
        if pos.dtype.kind not in "iu" or pos.shape != (3, b, s):
            raise self._err(f"position_ids must be integer (3, {b}, {s}), got {pos.dtype} {list(pos.shape)}")
        if pos.size:
            lo, hi = int(pos.min()), int(pos.max())
            if lo < 0 or hi >= cos_cache.shape[0]:
                raise self._err(f"position ids must be in [0, {cos_cache.shape[0]}) (cache rows), got [{lo}, {hi}]")
        which = self._streams.get(half)
        if which is None:
            which = self._streams[half] = mrope_streams(self.section, self.layout, half)
        cols = np.arange(half)
        # per token and column: the cache row of the column's stream
        rows = pos[which].transpose(1, 2, 0)  # (B, S, half)
        dt = x.dtype
        sc = _F(self.scale)
        cos = _round(_f32(cos_cache)[rows, cols] * sc, dt)
        sin = _round(_f32(sin_cache)[rows, cols] * sc, dt)
        if x.ndim == 3:
            xh = _f32(x).reshape(b, s, heads, head)
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        else:
            xh = _f32(x)
            cos, sin = cos[:, None], sin[:, None]
        y = xh.copy()
        if self.interleaved:
            x1, x2 = xh[..., 0:rot:2], xh[..., 1:rot:2]
            y[..., 0:rot:2] = x1 * cos - x2 * sin
            y[..., 1:rot:2] = x1 * sin + x2 * cos
        else:
            x1, x2 = xh[..., :half], xh[..., half:rot]
            y[..., :half] = x1 * cos - x2 * sin
            y[..., half:rot] = x1 * sin + x2 * cos
        return (y.reshape(x.shape).astype(dt, copy=False),)
