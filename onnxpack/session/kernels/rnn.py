"""RNN, LSTM and GRU: one GEMM for every timestep's input projection, one small GEMM per step.

The step loop is inherently sequential, so the work per step is kept to one ``h @ R^T`` GEMM
(two for GRU without ``linear_before_reset``, whose candidate gate needs ``r * h`` first) and a
few fused elementwise ops on (batch, hidden) arrays.  The input projection ``X @ W^T`` of *all*
timesteps is done up front as one large GEMM, with the bias folded in.

Pre-packing (per input, every direction at once):

* ``W`` (num_dir, G*H, I) -> ``W^T`` per direction, (num_dir, I, G*H) float32 C-contiguous, the
  right operand of the up-front GEMM.
* ``R`` (num_dir, G*H, H) -> ``R^T`` per direction, (num_dir, H, G*H) float32, so the per-step
  GEMM reads a contiguous matrix.
* ``B`` (num_dir, 2*G*H) -> the summed bias.  RNN: (num_dir, H) = Wb + Rb.  LSTM:
  (num_dir, 4H) = Wb + Rb.  GRU: (num_dir, 4H) = [Wb_z+Rb_z, Wb_r+Rb_r, Wb_h, Rb_h]: the
  candidate gate's two biases must stay apart because with ``linear_before_reset`` Rb_h is
  multiplied by the reset gate.

Activations: every function of the spec's list (Relu, Tanh, Sigmoid, Affine, LeakyRelu,
ThresholdedRelu, ScaledTanh, HardSigmoid, Elu, Softsign, Softplus), names matched without regard
to case as onnxruntime's LSTM/GRU do; an unknown name is the node's ``InvalidArgument``.  Their
``activation_alpha``/``activation_beta`` values are consumed in order by the functions that take
them.  Defaults when the lists run out: the spec says "the same as of corresponding ONNX
operators" — LeakyRelu 0.01, ThresholdedRelu 1.0, HardSigmoid 0.2/0.5, Elu 1.0, and Affine 1.0/0.0
(the experimental Affine op's); ScaledTanh had no defaults in ONNX, so onnxruntime's apply: 0 and
0 (its output is then 0, as onnxruntime's is).  Where ONNX defines a default and onnxruntime does
not follow it (it uses 0 for ThresholdedRelu's and Affine's alpha), we keep the spec's.

LSTM as onnxruntime computes it (deep_cpu_lstm.cc): a gate's ``clip`` applies after its peephole
term (``i = f(clip(Xi + Hi + b + pi * c))``; ``o``'s with the new ``c``); ``input_forget=1``
couples the forget gate to the input gate, ``f = 1 - i`` (its peephole and weights unused).  The
numba recurrence (:mod:`._rnn_jit`) takes the default activations without clip, peepholes,
input_forget or sequence_lens; the numpy loop everything.

Every input's shape is checked against X, hidden_size, direction and layout before any
arithmetic (onnxruntime's checks, its messages: ``input B must have shape {1,512}``): the JIT
reads the buffers as those shapes say.  A constant W, R or B whose shape does not fit the node is
not packed (``pack_spec`` declines it), so the run refuses it as it would a fed one;
``prepack`` given one anyway refuses it (``InvalidGraph``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np

from onnxpack.errors import InvalidArgument, InvalidGraph
from onnxpack.session.kernels import _act
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, register

logger = logging.getLogger(__name__)

__all__ = ["RNN", "LSTM", "GRU", "ACTIVATIONS", "named_activation"]

_PACK_VERSION = 1


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # 0.5 * (1 + tanh(x / 2)) is exact, overflow-free and one transcendental op.
    out = np.tanh(x * 0.5)
    out += 1.0
    out *= 0.5
    return out


# MLAS' logistic and tanh (onnxruntime's x86 kernels, Eigen's rational approximations, their
# coefficients in float32): its LSTM's gates go through them.  Horner steps are fused multiply-
# adds, as its FMA3 kernels compute them: the float64 product of two float32 values is exact,
# then one rounding to float32.
_LOGISTIC_P = tuple(np.float32(c) for c in (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05,
                                            8.51377133304701e-03, 2.48287947061529e-01))
_LOGISTIC_Q = tuple(np.float32(c) for c in (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06,
                                            1.70198817374094e-03, 1.16817656904453e-01, 9.93151921023180e-01))
_TANH_P = tuple(np.float32(c) for c in (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
                                        5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
                                        4.89352455891786e-03))
_TANH_Q = tuple(np.float32(c) for c in (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                                        4.89352518554385e-03))


def _horner_fma(x2: np.ndarray, coefficients: tuple) -> np.ndarray:
    acc = np.full(x2.shape, coefficients[0], np.float32)
    wide = x2.astype(np.float64)
    for c in coefficients[1:]:
        acc = (wide * acc + np.float64(c)).astype(np.float32)
    return acc


def mlas_logistic(v: np.ndarray) -> np.ndarray:
    """float32 sigmoid as onnxruntime computes it on x86 (``MlasLogisticKernelFma3``): x clamped
    to [-18, 18], ``x * P(x^2) / Q(x^2) + 0.5``, clamped below at 0.  Equal to its Sigmoid on
    every float32 tried (300,000 values over [-20, 20] and normal draws)."""
    with np.errstate(all="ignore"):
        x = np.asarray(v, np.float32)
        x = np.where(np.isnan(x), x, np.clip(x, np.float32(-18.0), np.float32(18.0))).astype(np.float32)
        x2 = (x * x).astype(np.float32)
        y = (x * _horner_fma(x2, _LOGISTIC_P)).astype(np.float32) / _horner_fma(x2, _LOGISTIC_Q)
        y = (y.astype(np.float32) + np.float32(0.5)).astype(np.float32)
        return np.where(np.isnan(y), y, np.maximum(y, np.float32(0.0))).astype(np.float32)


def mlas_tanh(v: np.ndarray) -> np.ndarray:
    """float32 tanh as onnxruntime computes it on x86 (MLAS: x clamped to [-9, 9], ``x * P(x^2) /
    Q(x^2)``); equal to its Tanh on the same values as :func:`mlas_logistic`."""
    with np.errstate(all="ignore"):
        x = np.asarray(v, np.float32)
        x = np.where(np.isnan(x), x, np.clip(x, np.float32(-9.0), np.float32(9.0))).astype(np.float32)
        x2 = (x * x).astype(np.float32)
        return ((x * _horner_fma(x2, _TANH_P)).astype(np.float32) / _horner_fma(x2, _TANH_Q)).astype(np.float32)


# Lower-cased name -> (takes alpha, takes beta): which functions consume activation_alpha/beta.
_ACT_PARAMS = {
    "relu": (False, False), "tanh": (False, False), "sigmoid": (False, False), "affine": (True, True),
    "leakyrelu": (True, False), "thresholdedrelu": (True, False), "scaledtanh": (True, True),
    "hardsigmoid": (True, True), "elu": (True, False), "softsign": (False, False), "softplus": (False, False),
}
ACTIVATIONS = ("Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh", "HardSigmoid",
               "Elu", "Softsign", "Softplus")
# (alpha, beta) when the lists run out (see the module docstring for where each comes from).
_ACT_DEFAULTS = {
    "leakyrelu": (0.01, 0.0), "thresholdedrelu": (1.0, 0.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0),
    "affine": (1.0, 0.0), "scaledtanh": (0.0, 0.0),
}


def named_activation(name: str, params: tuple = ()) -> Callable[[np.ndarray], np.ndarray]:
    """The activation onnxruntime's fused kernels (FusedConv, FusedGemm) name by a string, with
    their parameters in order (``activation_params`` / ``activation_alpha``, ``_beta``): the RNN
    activations, plus Clip ``[min, max]`` and HardSwish.  NotImplementedError for any other name."""
    lname = str(name).lower()
    if lname == "hardswish":  # (NCHWc Conv's fused HardSwish: x * hardsigmoid(x), alpha 1/6, beta 0.5)
        return lambda x: x * np.clip(x / np.float32(6) + np.float32(0.5), 0, 1)
    if lname == "clip":
        lo = np.float32(params[0]) if len(params) > 0 else np.float32(-np.inf)
        hi = np.float32(params[1]) if len(params) > 1 else np.float32(np.inf)
        return lambda x: np.minimum(np.maximum(x, lo), hi)
    if lname not in _ACT_PARAMS:
        raise NotImplementedError(f"fused activation {name!r}")
    alpha, beta = _ACT_DEFAULTS.get(lname, (0.0, 0.0))
    if len(params) > 0 and params[0] is not None:
        alpha = float(params[0])
    if len(params) > 1 and params[1] is not None:
        beta = float(params[1])
    return _activation(lname, alpha, beta)


def _activation(lname: str, alpha: float, beta: float) -> Callable[[np.ndarray], np.ndarray]:
    """The function named ``lname`` (lower case, one of :data:`_ACT_PARAMS`) with its parameters."""
    a, b = np.float32(alpha), np.float32(beta)
    if lname == "sigmoid":
        return _sigmoid
    if lname == "tanh":
        return np.tanh
    if lname == "relu":
        return lambda x: np.maximum(x, 0)
    if lname == "leakyrelu":
        return lambda x: np.where(x >= 0, x, a * x)
    if lname == "thresholdedrelu":
        return lambda x: np.where(x > a, x, 0).astype(x.dtype)
    if lname == "scaledtanh":
        return lambda x: a * np.tanh(b * x)
    if lname == "hardsigmoid":
        return lambda x: np.clip(a * x + b, 0, 1)
    if lname == "elu":
        return lambda x: np.where(x >= 0, x, a * (np.exp(np.minimum(x, 0)) - 1))
    if lname == "softsign":
        return lambda x: x / (1 + np.abs(x))
    if lname == "softplus":
        return lambda x: np.logaddexp(x, 0)
    if lname == "affine":
        return lambda x: a * x + b
    raise AssertionError(f"Bug: activation {lname!r} not handled")


def _lstm_jit():
    """The LSTM recurrence's numba kernel (:mod:`._rnn_jit`), or None (numpy's loop)."""
    return _act.load_jit("_rnn_jit", "LSTM")


def _warm_lstm(writeable: bool) -> None:
    """Loads the LSTM recurrence's JIT (numba's on-disk cache) off the critical path, on zeros of
    the packed weight's array type: no kernel and no mapped bytes held (see linalg.warm_panels)."""
    jit = _lstm_jit()
    if jit is not None:
        rt = np.zeros((1, 4), np.float32)
        rt.flags.writeable = writeable
        z = np.zeros((1, 1), np.float32)
        jit.lstm_standard(np.zeros((1, 1, 4), np.float32), rt, z, z.copy(), np.zeros((1, 1, 1), np.float32), False)
        jit.lstm_small(np.zeros((1, 1, 1), np.float32), rt, np.zeros(4, np.float32), rt, z, z.copy(),
                       np.zeros((1, 1, 1), np.float32), False)


# (step, batch row) pairs up to which the LSTM's JIT makes the input projection itself
# (_rnn_jit.lstm_small): Silero VAD's one step of 128 -> 4 x 128 took 8 us in a BLAS call and
# ~2 us in the JIT; a longer sequence is one GEMM for all its steps.
_SMALL_LSTM = 4
_F32 = np.dtype(np.float32)


def _stack(states: list[np.ndarray]) -> np.ndarray:
    """The per-direction final states as (num_dir, batch, H); one direction without np.stack's
    ~3 us of Python."""
    return states[0][None] if len(states) == 1 else np.stack(states)


def _as_f(x: np.ndarray, dtype=np.float32) -> np.ndarray:
    return x if x.dtype == dtype else x.astype(dtype)


def _dims(shape) -> str:
    """A shape as onnxruntime prints one: ``{1,8,256}``."""
    return "{" + ",".join(str(int(d)) for d in shape) + "}"


class _RNNBase(Kernel):
    n_gates: int = 0
    default_acts: tuple[str, ...] = ()

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.direction = self.attr("direction", "forward") or "forward"
        if self.direction not in ("forward", "reverse", "bidirectional"):
            raise InvalidArgument(
                f"node {node.name!r} ({node.op_type}): direction must be forward, reverse or "
                f"bidirectional, got {self.direction!r}"
            )
        self.num_dir = 2 if self.direction == "bidirectional" else 1
        self.layout = int(self.attr("layout", 0))
        self.hidden = self.attr("hidden_size")
        if self.hidden is not None and int(self.hidden) < 1:
            raise InvalidGraph(f"{self._what()}: hidden_size must be positive, got {self.hidden}")
        if len(node.input) < 3 or not node.input[1] or not node.input[2]:
            raise InvalidGraph(f"{self._what()}: inputs X, W and R are required, got {list(node.input)}")
        clip = self.attr("clip")
        self.clip = None if clip is None else float(clip)
        names = [a.decode() if isinstance(a, bytes) else a for a in (self.attr("activations") or [])]
        per_dir = len(self.default_acts)
        if not names:
            names = list(self.default_acts) * self.num_dir
        if len(names) == 2 * per_dir and self.num_dir == 1 and self.op_type == "RNN":
            names = names[:per_dir]  # onnxruntime's RNN defaults to two and drops the second
        if len(names) != per_dir * self.num_dir:
            raise InvalidArgument(
                f"node {node.name!r} ({node.op_type}): expected {per_dir * self.num_dir} activations "
                f"for direction {self.direction}, got {len(names)} ({names})"
            )
        alphas = [float(v) for v in (self.attr("activation_alpha") or [])]
        betas = [float(v) for v in (self.attr("activation_beta") or [])]
        acts = []
        ai = bi = 0
        for name in names:
            lname = str(name).lower()
            if lname not in _ACT_PARAMS:
                raise InvalidArgument(
                    f"node {node.name!r} ({node.op_type}): unknown activation {name!r}; expected one of "
                    f"{', '.join(ACTIVATIONS)}"
                )
            takes_alpha, takes_beta = _ACT_PARAMS[lname]
            a, b = _ACT_DEFAULTS.get(lname, (0.0, 0.0))
            if takes_alpha and ai < len(alphas):
                a, ai = alphas[ai], ai + 1
            if takes_beta and bi < len(betas):
                b, bi = betas[bi], bi + 1
            acts.append(_activation(lname, a, b))
        self.acts = [acts[d * per_dir : (d + 1) * per_dir] for d in range(self.num_dir)]
        self._wt = self._rt = self._b = None

    # -- pre-packing ------------------------------------------------------------------------------
    def _what(self) -> str:
        return f"node {self.node.name!r} ({self.op_type})"

    def _constant_problem(self, input_index: int, shape: tuple[int, ...]) -> str | None:
        """Why a constant W (1), R (2) or B (3) of ``shape`` cannot be this node's, as far as the
        attributes tell (X's input size is known at run only; without hidden_size, R's last
        dimension is it), or None."""
        nd, g = self.num_dir, self.n_gates
        s = tuple(int(d) for d in shape)
        h = int(self.hidden) if self.hidden is not None else None
        if h is None and input_index == 2 and len(s) == 3:
            h = s[2]
        gh = str(g * h) if h is not None else f"{g}*hidden_size"
        if input_index == 1:
            ok = len(s) == 3 and s[0] == nd and (s[1] == g * h if h is not None else s[1] > 0 and s[1] % g == 0)
            want, meaning = f"{{{nd},{gh},input_size}}", f"num_directions, {g}*hidden_size, input_size"
        elif input_index == 2:
            ok = len(s) == 3 and s[0] == nd and h is not None and h > 0 and s[2] == h and s[1] == g * h
            want = f"{{{nd},{gh},{h if h is not None else 'hidden_size'}}}"
            meaning = f"num_directions, {g}*hidden_size, hidden_size"
        elif input_index == 3:
            ok = len(s) == 2 and s[0] == nd and (s[1] == 2 * g * h if h is not None
                                                 else s[1] > 0 and s[1] % (2 * g) == 0)
            want = f"{{{nd},{2 * g * h if h is not None else f'{2 * g}*hidden_size'}}}"
            meaning = f"num_directions, {2 * g}*hidden_size"
        else:
            return None
        return None if ok else f"input {'WRB'[input_index - 1]} must have shape {want} ({meaning}), got {_dims(s)}"

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index not in (1, 2, 3) or info.dtype.name not in ("float16", "float32", "float64", "bfloat16"):
            return None
        if self._constant_problem(input_index, tuple(info.shape)) is not None:
            return None  # not packed: the run refuses it with the same message as a fed one
        return PackSpec(self.op_type.lower(), _PACK_VERSION, bytes([input_index]), 1)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        if input_index in (1, 2):
            nd, gh, k = info.shape
            return [(np.dtype(np.float32), (nd, k, gh))]
        nd, twogh = info.shape
        h = twogh // (2 * self.n_gates)
        return [(np.dtype(np.float32), (nd, self._bias_cols(h)))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        problem = self._constant_problem(input_index, weight.shape)
        if problem is not None:
            raise InvalidGraph(f"{self._what()}: {problem}")
        if input_index in (1, 2):
            return (np.ascontiguousarray(weight.transpose(0, 2, 1), dtype=np.float32),)
        return (self._fuse_bias(_as_f(weight)),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (buf,) = buffers
        if input_index == 1:
            self._wt = buf
        elif input_index == 2:
            self._rt = buf
            if self.op_type == "LSTM" and _act.jit_possible():
                self.warm_up = functools.partial(_warm_lstm, bool(buf.flags.writeable))
        else:
            self._b = buf

    def _fuse_bias(self, b: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _bias_cols(self, hidden: int) -> int:
        """Columns of the fused bias (see the module docstring)."""
        return 4 * hidden

    # -- shared plumbing ------------------------------------------------------------------------------
    def _prepare(self, x, w, r, b, seq_lens, init_states, p=None):
        """Inputs in (seq, batch, ...) layout and float32; packed forms resolved.  Every input's
        shape checked first (:meth:`_check_shapes`)."""
        seq, batch, hidden = self._check_shapes(x, w, r, b, seq_lens, init_states, p)
        out_dtype = x.dtype
        xs = _as_f(x)
        if self.layout:
            xs = xs.transpose(1, 0, 2)
        # Unpacked weights (computed by the graph, or packing off): transposed views, no copy —
        # BLAS reads a transposed operand as fast, and a copy per run cost more than a short
        # sequence's whole recurrence (Silero VAD's one-step LSTM: 4 x 256 KB, ~100 us).
        wt = self._wt if self._wt is not None else _as_f(w).transpose(0, 2, 1)
        rt = self._rt if self._rt is not None else _as_f(r).transpose(0, 2, 1)
        if self._b is not None:
            bias = self._b
        elif b is not None:
            bias = self._fuse_bias(_as_f(b))
        else:
            bias = np.zeros((self.num_dir, self._bias_cols(hidden)), np.float32)
        states = []
        for s in init_states:
            if s is None:
                states.append(np.zeros((self.num_dir, batch, hidden), np.float32))
            else:
                s = _as_f(s)
                states.append(s.transpose(1, 0, 2) if self.layout else s)
        lens = None
        if seq_lens is not None:
            lens = np.asarray(seq_lens).astype(np.int64)
            if (lens > seq).any() or (lens < 0).any():
                raise InvalidArgument(
                    f"{self._what()}: sequence_lens must have {batch} values in [0, {seq}], got {lens.tolist()}"
                )
            if (lens == seq).all():
                lens = None
        return out_dtype, xs, wt, rt, bias, states, lens, seq, batch, hidden

    def _check_shapes(self, x, w, r, b, seq_lens, init_states, p) -> tuple[int, int, int]:
        """(seq_length, batch_size, hidden_size) after checking X, W, R, B, sequence_lens, the
        initial states and P against X, hidden_size, direction and layout, in onnxruntime's
        order and words (``input initial_h must have shape {1,1,256}``): the loops and the JIT
        read every buffer as these shapes say.  Packed W, R and B are checked in the layout they
        were given in (their packs are transposes, B's a sum)."""
        what, nd, g = self._what(), self.num_dir, self.n_gates
        x_dims = "batch_size, seq_length, input_size" if self.layout else "seq_length, batch_size, input_size"
        if x is None or x.ndim != 3:
            raise InvalidArgument(f"{what}: input X must have 3 dimensions ({x_dims}), got "
                                  f"{'none' if x is None else _dims(x.shape)}")
        batch, seq, inp = x.shape if self.layout else (x.shape[1], x.shape[0], x.shape[2])
        # The node's weights as given: (num_dir, G*H, K).  DynamicQuantizeLSTM's are (num_dir, K,
        # G*H): its run hands us transposed views, and its messages name its own layout.
        kn = self.op_type == "DynamicQuantizeLSTM"
        shapes = []
        for name, given, packed in (("W", w, self._wt), ("R", r, self._rt)):
            if packed is not None:
                pnd, pk, pgh = packed.shape
                shapes.append((pnd, pgh, pk))
            elif given is None:
                raise InvalidArgument(f"{what}: input {name} is required")
            else:
                shapes.append(tuple(given.shape))
        w_shape, r_shape = shapes
        hidden = int(self.hidden) if self.hidden is not None else (r_shape[2] if len(r_shape) == 3 else -1)

        def refuse(name: str, want: tuple, meaning: str, got: tuple) -> None:
            if kn and name in ("W", "R"):
                want = (want[0], want[2], want[1])
                got = (got[0], got[2], got[1]) if len(got) == 3 else got
                parts = meaning.split(", ")
                meaning = ", ".join((parts[0], parts[2], parts[1]))
            raise InvalidArgument(f"{what}: input {name} must have shape {_dims(want)} ({meaning}), got {_dims(got)}")

        if hidden < 1:  # no hidden_size, and R not 3-D
            raise InvalidArgument(f"{what}: input R must have shape {{{nd},{g}*hidden_size,hidden_size}}, got "
                                  f"{_dims(r_shape)}")
        if w_shape != (nd, g * hidden, inp):
            refuse("W", (nd, g * hidden, inp), f"num_directions, {g}*hidden_size, input_size", w_shape)
        if r_shape != (nd, g * hidden, hidden):
            refuse("R", (nd, g * hidden, hidden), f"num_directions, {g}*hidden_size, hidden_size", r_shape)
        if self._b is not None:
            b_shape = (self._b.shape[0], self._b.shape[1] * 2 * g // self._bias_cols(1)) if self._b.ndim == 2 else ()
            if self._b.shape != (nd, self._bias_cols(hidden)):
                refuse("B", (nd, 2 * g * hidden), f"num_directions, {2 * g}*hidden_size", b_shape)
        elif b is not None and b.shape != (nd, 2 * g * hidden):
            refuse("B", (nd, 2 * g * hidden), f"num_directions, {2 * g}*hidden_size", b.shape)
        if seq_lens is not None:
            lens = np.asarray(seq_lens)
            if lens.shape != (batch,):
                refuse("sequence_lens", (batch,), "batch_size", lens.shape)
            if lens.dtype.kind not in "iu":
                raise InvalidArgument(f"{what}: input sequence_lens must be int32 (integers), got {lens.dtype}")
        st_want, st_dims = ((batch, nd, hidden), "batch_size, num_directions, hidden_size") if self.layout else \
            ((nd, batch, hidden), "num_directions, batch_size, hidden_size")
        for name, state in zip(("initial_h", "initial_c"), init_states):
            if state is not None and state.shape != st_want:
                refuse(name, st_want, st_dims, state.shape)
        if p is not None and p.shape != (nd, 3 * hidden):
            refuse("P", (nd, 3 * hidden), "num_directions, 3*hidden_size", p.shape)
        return seq, batch, hidden

    def _reverse(self, d: int) -> bool:
        return self.direction == "reverse" or (self.direction == "bidirectional" and d == 1)

    def _steps(self, d: int, seq: int):
        return range(seq - 1, -1, -1) if self._reverse(d) else range(seq)

    def _finish(self, y, finals, out_dtype):
        """y (seq, nd, batch, H), finals list of (nd, batch, H) -> outputs in the node's layout."""
        if self.layout:
            y = y.transpose(2, 0, 1, 3)
            finals = [f.transpose(1, 0, 2) for f in finals]
        outs = [np.ascontiguousarray(y, dtype=out_dtype)] + [np.ascontiguousarray(f, dtype=out_dtype) for f in finals]
        return tuple(outs[: max(1, len(self.node.output))])

    @staticmethod
    def _zero_empty(state: np.ndarray, lens: np.ndarray | None) -> np.ndarray:
        """Final states of zero-length sequences are zeros (onnxruntime), not the initial state."""
        if lens is None or not (lens == 0).any():
            return state
        return np.where((lens == 0)[:, None], 0, state).astype(state.dtype)

    def _clip(self, g: np.ndarray) -> np.ndarray:
        if self.clip is not None:
            np.clip(g, -self.clip, self.clip, out=g)
        return g


@register("RNN", since=7)
class RNN(_RNNBase):
    """Simple RNN: ``H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb)``, clip, sequence_lens, layout, directions.

    Opset 1 (``output_sequence``) is left to onnx.reference.  Two activations for one direction
    are accepted and the second ignored, as onnxruntime does (its default list is two long).
    """

    op_type = "RNN"
    n_gates = 1
    default_acts = ("Tanh",)

    def _fuse_bias(self, b: np.ndarray) -> np.ndarray:
        h = b.shape[1] // 2
        return np.ascontiguousarray(b[:, :h] + b[:, h:], dtype=np.float32)

    def _bias_cols(self, hidden: int) -> int:
        return hidden

    def run(self, x, w=None, r=None, b=None, seq_lens=None, h0=None):
        out_dtype, xs, wt, rt, bias, (hs,), lens, seq, batch, H = self._prepare(x, w, r, b, seq_lens, (h0,))
        y = np.zeros((seq, self.num_dir, batch, H), np.float32)
        finals = []
        for d in range(self.num_dir):
            (f,) = self.acts[d]
            xw = (xs.reshape(seq * batch, -1) @ wt[d]).reshape(seq, batch, H)
            xw += bias[d]
            h = hs[d].copy()
            for t in self._steps(d, seq):
                h_new = f(self._clip(xw[t] + h @ rt[d]))
                if lens is not None:
                    valid = (t < lens)[:, None]
                    h_new = np.where(valid, h_new, h)
                    y[t, d] = np.where(valid, h_new, 0)
                else:
                    y[t, d] = h_new
                h = h_new
            finals.append(self._zero_empty(h, lens))
        return self._finish(y, [np.stack(finals)], out_dtype)


@register("LSTM", since=7)
class LSTM(_RNNBase):
    """LSTM (gate order i, o, f, c), peepholes, clip, input_forget, sequence_lens, layout 0/1, all
    directions."""

    op_type = "LSTM"
    n_gates = 4
    default_acts = ("Sigmoid", "Tanh", "Tanh")

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        # Coupled input-forget gate (onnxruntime's: f = 1 - i); the numpy loop's, not the JIT's.
        self.input_forget = bool(int(self.attr("input_forget", 0) or 0))

    def _fuse_bias(self, b: np.ndarray) -> np.ndarray:
        g = b.shape[1] // 2
        return np.ascontiguousarray(b[:, :g] + b[:, g:], dtype=np.float32)

    # (x shape, state shape, lstm_small, W^T, bias, R^T, reverse, outputs): a one-direction
    # standard LSTM on a short float32 input with packed weights and both initial states, after
    # a first call took _run's small-JIT path with them (see run)
    _fast: tuple | None = None

    def run(self, x, w=None, r=None, b=None, seq_lens=None, h0=None, c0=None, p=None):
        fast = self._fast
        if (fast is not None and w is None and r is None and b is None and seq_lens is None and p is None
                and h0 is not None and c0 is not None and x.__class__ is np.ndarray and x.shape == fast[0]
                and h0.__class__ is np.ndarray and c0.__class__ is np.ndarray and h0.shape == fast[1]
                and c0.shape == fast[1] and x.dtype == _F32 and h0.dtype == _F32 and c0.dtype == _F32):
            # What _run does for these inputs, without its general plumbing (~5 us of Python in
            # a one-step LSTM of ~12: Silero VAD's): the same call, the same arrays.
            _, _, lstm_small, wt, bias, rt, reverse, outputs = fast
            seq, batch, hidden = x.shape[0], x.shape[1], rt.shape[0]
            y = np.zeros((seq, 1, batch, hidden), np.float32)
            h = h0[0].copy()
            c = c0[0].copy()
            lstm_small(np.ascontiguousarray(x), wt, bias, rt, h, c, y.reshape(seq, batch, hidden), reverse)
            return (y, h[None], c[None])[:outputs]
        return self._run(x, w, r, b, seq_lens, h0, c0, p)

    def _project(self, a: np.ndarray, weight: np.ndarray, d: int, which: int, q) -> np.ndarray:
        """``a @ weight`` for direction ``d``: ``which`` 0 is the input projection (all timesteps),
        1 the recurrence.  A subclass computing these products another way (e.g. quantized:
        ``qinteger.DynamicQuantizeLSTM``) overrides this; ``q`` is what its ``run`` passed."""
        return a @ weight

    def _exact_steps(self, d, xw, bias, weight, h, c, y, lens, q) -> int:
        """Runs the first steps of direction ``d`` of the quantized recurrence (``q``: see
        :meth:`_project`) another way, in place on ``h`` and ``c`` and into ``y``, with the
        loop's arithmetic; returns how many it ran (the loop runs the rest).  None here."""
        return 0

    def _run(self, x, w, r, b, seq_lens, h0, c0, p, q=None):
        out_dtype, xs, wt, rt, bias, (hs, cs), lens, seq, batch, H = self._prepare(x, w, r, b, seq_lens, (h0, c0), p)
        y = np.zeros((seq, self.num_dir, batch, H), np.float32)
        finals_h, finals_c = [], []
        recurrences: list = []  # the JIT's recurrences, run after the projections: (d, its Y, arguments)
        for d in range(self.num_dir):
            f, g, hact = self.acts[d]
            h = hs[d].copy()
            c = cs[d].copy()
            pi = po = pf = None
            if p is not None:
                pp = _as_f(p)[d]
                pi, po, pf = pp[:H], pp[H : 2 * H], pp[2 * H :]
            coupled = self.input_forget
            standard = (pi is None and self.clip is None and not coupled and f is _sigmoid and g is np.tanh
                        and hact is np.tanh)
            jit = _lstm_jit() if standard and lens is None and type(self)._project is LSTM._project else None
            jit = jit if seq and batch else None
            small = jit is not None and seq * batch <= _SMALL_LSTM  # the input projection in the JIT's call
            # The quantized LSTM (q) follows onnxruntime's arithmetic: X W + H R, then the bias, the
            # gates through MLAS' logistic and tanh; its per-step quantization of h turns any ulp
            # apart into another code (seen: 1.4e-3 apart on an OCR model's LSTM outputs).
            exact = q is not None
            cell = _lstm_jit() if exact and standard else None  # its lstm_cell_mlas: the same, in one call
            if not small:
                xw = self._project(xs.reshape(seq * batch, -1), wt[d], d, 0, q).reshape(seq, batch, 4 * H)
                if not exact:
                    xw += bias[d]
            if jit is not None:
                # Every step in one call (see _rnn_jit): the states in place, this direction's Y.
                yd = y.reshape(seq, batch, H) if self.num_dir == 1 else np.empty((seq, batch, H), np.float32)
                if small:
                    jit.lstm_small(np.ascontiguousarray(xs), np.ascontiguousarray(wt[d]), bias[d],
                                   np.ascontiguousarray(rt[d]), h, c, yd, self._reverse(d))
                    if yd.base is not y:
                        y[:, d] = yd
                else:
                    recurrences.append((d, yd, (np.ascontiguousarray(xw), np.ascontiguousarray(rt[d]), h, c, yd,
                                                self._reverse(d))))
                finals_h.append(h)
                finals_c.append(c)
                continue
            steps = self._steps(d, seq)
            if exact and standard and cell is not None:
                steps = steps[self._exact_steps(d, xw, bias[d], rt[d], h, c, y, lens, q):]
            for t in steps:
                gates = self._project(h, rt[d], d, 1, q)
                gates += xw[t]
                if exact:
                    gates += bias[d]
                if pi is None:
                    self._clip(gates)  # (with peepholes: each gate after its peephole term, below)
                if standard and exact and cell is not None:
                    c_new = np.array(c, np.float32)
                    h_new = np.empty_like(c_new)
                    cell.lstm_cell_mlas(np.ascontiguousarray(gates, np.float32), c_new, h_new)
                elif standard and exact:
                    iof = mlas_logistic(gates[:, : 3 * H])
                    cand = mlas_tanh(gates[:, 3 * H :])
                    cand *= iof[:, :H]
                    c_new = iof[:, 2 * H :] * c
                    c_new += cand
                    h_new = mlas_tanh(c_new)
                    h_new *= iof[:, H : 2 * H]
                elif standard:
                    # The default activations in place on the fresh gates (i, o, f adjacent: one
                    # sigmoid pass), ~half the numpy calls of the general form below; a one-step
                    # LSTM (Silero VAD) is mostly such calls.
                    iof = gates[:, : 3 * H]
                    iof *= 0.5
                    np.tanh(iof, out=iof)
                    iof += 1.0
                    iof *= 0.5
                    cand = gates[:, 3 * H :]
                    np.tanh(cand, out=cand)
                    cand *= iof[:, :H]
                    c_new = iof[:, 2 * H :] * c
                    c_new += cand
                    h_new = np.tanh(c_new)
                    h_new *= iof[:, H : 2 * H]
                elif pi is None and not coupled:
                    # i, o, f are adjacent: one activation call for the three gates.
                    iof = f(gates[:, : 3 * H])
                    c_new = iof[:, 2 * H :] * c + iof[:, :H] * g(gates[:, 3 * H :])
                    h_new = iof[:, H : 2 * H] * hact(c_new)
                else:
                    # onnxruntime's order (deep_cpu_lstm.cc): a gate's peephole term, then its
                    # clip, then its activation; the coupled forget gate is 1 - i.
                    gi = gates[:, :H] if pi is None else self._clip(gates[:, :H] + pi * c)
                    gate_i = f(gi)
                    if coupled:
                        gate_f = 1.0 - gate_i
                    else:
                        gf = gates[:, 2 * H : 3 * H] if pi is None else self._clip(gates[:, 2 * H : 3 * H] + pf * c)
                        gate_f = f(gf)
                    cand = g(gates[:, 3 * H :] if pi is None else self._clip(gates[:, 3 * H :]))
                    c_new = gate_f * c + gate_i * cand
                    go = gates[:, H : 2 * H] if pi is None else self._clip(gates[:, H : 2 * H] + po * c_new)
                    h_new = f(go) * hact(c_new)
                if lens is not None:
                    valid = (t < lens)[:, None]
                    h_new = np.where(valid, h_new, h)
                    c_new = np.where(valid, c_new, c)
                    y[t, d] = np.where(valid, h_new, 0)
                else:
                    y[t, d] = h_new
                h, c = h_new, c_new
            finals_h.append(self._zero_empty(h, lens))
            finals_c.append(self._zero_empty(c, lens))
        if recurrences:
            self._recur(recurrences, y)
        if (small and self.num_dir == 1 and not self.layout and q is None and type(self) is LSTM and p is None
                and self._wt is not None and self._rt is not None and self._b is not None
                and h0 is not None and c0 is not None and x.dtype == _F32 and h0.dtype == _F32 and c0.dtype == _F32):
            self._fast = (x.shape, h0.shape, jit.lstm_small, np.ascontiguousarray(wt[0]), bias[0],
                          np.ascontiguousarray(rt[0]), self._reverse(0), max(1, len(self.node.output)))
        return self._finish(y, [_stack(finals_h), _stack(finals_c)], out_dtype)

    @staticmethod
    def _recur(recurrences: list, y: np.ndarray) -> None:
        """Runs the JIT's recurrences: a bidirectional LSTM's two directions share nothing, so they
        run on two threads when the split pays (its SplitTuner; CRNN's 512-hidden directions of 32
        steps, ~6 ms each, each step reading its 4 MB recurrence weight), else one after the other."""
        jit = _lstm_jit()

        def run(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                jit.lstm_standard(*recurrences[i][2])

        if len(recurrences) > 1:
            key = ("lstm_directions",) + tuple(r[2][0].shape for r in recurrences)
            _act.tuner(key).run(run, len(recurrences), _act.threads())
        else:
            run(0, 1)
        for d, yd, _ in recurrences:
            if yd.base is not y:
                y[:, d] = yd


@register("GRU", since=7)
class GRU(_RNNBase):
    """GRU (gate order z, r, h), ``linear_before_reset`` 0/1, clip, sequence_lens, layout, directions."""

    op_type = "GRU"
    n_gates = 3
    default_acts = ("Sigmoid", "Tanh")

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.lbr = int(self.attr("linear_before_reset", 0))

    def _fuse_bias(self, b: np.ndarray) -> np.ndarray:
        h = b.shape[1] // 6
        wb, rb = b[:, : 3 * h], b[:, 3 * h :]
        out = np.concatenate([wb[:, : 2 * h] + rb[:, : 2 * h], wb[:, 2 * h :], rb[:, 2 * h :]], axis=1)
        return np.ascontiguousarray(out, dtype=np.float32)

    def run(self, x, w=None, r=None, b=None, seq_lens=None, h0=None):
        out_dtype, xs, wt, rt, bias, (hs,), lens, seq, batch, H = self._prepare(x, w, r, b, seq_lens, (h0,))
        y = np.zeros((seq, self.num_dir, batch, H), np.float32)
        finals = []
        for d in range(self.num_dir):
            f, g = self.acts[d]
            xw = (xs.reshape(seq * batch, -1) @ wt[d]).reshape(seq, batch, 3 * H)
            xw += bias[d, : 3 * H]
            rb_h = bias[d, 3 * H :]
            r_zr, r_h = rt[d][:, : 2 * H], rt[d][:, 2 * H :]
            h = hs[d].copy()
            for t in self._steps(d, seq):
                xt = xw[t]
                if self.lbr:
                    hr = h @ rt[d]
                    zr = f(self._clip(xt[:, : 2 * H] + hr[:, : 2 * H]))
                    z, rr = zr[:, :H], zr[:, H:]
                    hr_h = hr[:, 2 * H :] + rb_h
                    cand = self._clip(xt[:, 2 * H :] + rr * hr_h)
                else:
                    zr = f(self._clip(xt[:, : 2 * H] + h @ r_zr))
                    z, rr = zr[:, :H], zr[:, H:]
                    cand = self._clip(xt[:, 2 * H :] + (rr * h) @ r_h + rb_h)
                hh = g(cand)
                h_new = hh + z * (h - hh)  # (1 - z) * hh + z * h
                if lens is not None:
                    valid = (t < lens)[:, None]
                    h_new = np.where(valid, h_new, h)
                    y[t, d] = np.where(valid, h_new, 0)
                else:
                    y[t, d] = h_new
                h = h_new
            finals.append(self._zero_empty(h, lens))
        return self._finish(y, [np.stack(finals)], out_dtype)
