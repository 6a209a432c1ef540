"""numba kernels for convolutions and activation epilogues (optional; numpy twins in conv.py).

Imported lazily by :func:`onnxpack.session.kernels._act.jit` on a kernel's first ``run`` — never
at ``import onnxpack`` nor at session creation — and only when numba is installed (the ``jit``
extra) and ``ONNXPACK_DISABLE_JIT`` is not ``1``.  ``cache=True``: compiled code is kept in
numba's cache, so a later process loads it instead of compiling.

* :func:`depthwise2d` — a depthwise 2-D convolution (one input and one output channel per group)
  with the padding folded in (bounds per kernel row and column, no padded copy), any stride and
  dilation, and the bias and activation applied to each output row while it is in L1: one pass
  over the output instead of kh*kw numpy passes plus one per epilogue op.
* :func:`depthwise3_same` / :func:`depthwise5_same` — the 3x3 / 5x5 "same" case (unit strides,
  ``(K - 1) / 2`` padding) in one pass per plane; :func:`depthwise3_s2` / :func:`depthwise5_s2`
  — their stride-2 case on even planes, from the plane's four stride phases.
* :func:`bias_act` — ``y = act(y + bias[channel] (+ residual))`` in place on a GEMM's fresh
  output: the epilogue of every other convolution, one pass.
* :func:`conv_shift` — a one-group stride-1 convolution straight from its (padded) input, tiles
  of output positions by a register-blocked micro-kernel over every tap and input channel (no
  im2col), the epilogue of :func:`bias_act` applied a band of rows at a time while in cache.
* :func:`conv_tiny` — a one-group convolution with a handful of output positions (Silero VAD's
  STFT and encoder): the columns gathered, one vectorized dot product per output, then the
  epilogue of :func:`bias_act`, in one call (OpenBLAS runs such a GEMM, N = 1..4, slowly).
* :func:`conv_windows` — a 1-D convolution of one input channel by a long kernel (an STFT written
  as a Conv: a mel-spectrogram's or a VAD's front end) as the product of the input's windows, read
  in place, with the weight packed transposed in panels of 64 output channels (no im2col).
* :func:`wino_input` / :func:`wino_output` — Winograd F(2x2, 3x3) transforms of 3x3 stride-1
  convolutions (padding folded into the input transform, bias and activations into the output
  transform); the 16 GEMMs between them are one batched ``np.matmul``.
* :func:`rows_act` — the same for a MatMul's (rows, N) output with a bias along N.
* :func:`layer_norm_rows` — LayerNormalization over the last axis, one row at a time.
* :func:`rms_rows` — RMS normalization (with skip and bias: SkipSimplifiedLayerNormalization) the same way.
* :func:`act_inplace` — an activation over a flat array in place (standalone HardSwish, SiLU, ...).

Activations (``act`` codes, see ``_act.py``; a kernel takes a list of them, applied in order to
each row while it is in L1): identity, Relu, Clip(a, b), HardSwish ``x * clip(a*x + b, 0, 1)``,
SiLU ``x * sigmoid(x)``, Sigmoid, LeakyRelu(a), HardSigmoid(a, b), affine ``a*x + b``, exact
GELU ``x/2 * (1 + erf(x/sqrt(2)))`` (the erf of ``_erf.py``, element by element), fake-quant
``clamp(rint(x / a), b, c) * a`` (a QuantizeLinear -> DequantizeLinear pair, FakeQuant's bits), and
in :func:`bias_act` only a per-channel ``x * A[m] + B[m]`` (code 11, uncontracted: the bits of
BatchNormalization's numpy).
Sigmoid uses :func:`_expf`, a float32 ``exp`` that vectorizes (range reduction to
``[-ln2/2, ln2/2]``, degree-7 Taylor polynomial, exponent written into the float's bits):
within 1 ulp of the exact value on [-87, 88] (0.91 ulp measured on 2M points; tests check it),
so sigmoid and SiLU keep relative accuracy in both tails (within 3 ulp of numpy's formula).

All kernels are serial on purpose: they run between OpenBLAS calls, and a numba thread team
spinning beside OpenBLAS's threads on 2 cores made calls 100-1000x slower (see _nbits_jit.py).
``fastmath={"contract"}`` only (fused multiply-add; no reassociation, NaN and Inf propagate),
but for the dot products of :func:`conv_tiny` (``reassoc`` too: per-lane partial sums, as BLAS keeps them);
``error_model="numpy"``: a float division by zero gives inf/NaN as in numpy instead of raising,
which also lets the loops with a division vectorize (measured: sigmoid over 1M floats 3.9 ms
with Python's error model, 0.33 ms with numpy's).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from onnxpack.session.kernels import _erf as _erf_mod
from onnxpack.session.kernels._nbits_jit import F32, I64, as_ptr
from onnxpack.session.kernels._spin_jit import _sgemm
from onnxpack.session.kernels._sgemm_jit import TILE, conv_tile1, conv_tile2, conv_tile4, conv_tile6, prefetch
from onnxpack.session.kernels._sgemm_jit import KC, _tile1, _tile2, _tile4, _tile6, gtile1, gtile2, gtile4, gtile6
from onnxpack.session.kernels._sgemm_jit import HALF, _tile1h, _tile2h, _tile4h, _tile6h, gtile1h, gtile2h, gtile4h, gtile6h
from onnxpack.session.kernels._sgemm_jit import LANES, tstore, tstore_bias

__all__ = ["gather_cols", "depthwise2d", "depthwise3_same", "depthwise5_same", "depthwise3_s2", "depthwise5_s2", "conv3_s2_small", "stride_phases", "pad_phases", "im2col2d", "conv2d_small", "conv_tiny", "conv_windows", "conv_bcast", "WIN_BLOCK", "windows_unit", "WINDOWS_UNIT", "conv_shift", "wino_input", "wino_output", "bias_act", "gemm_act_unit", "GEMM_ACT_UNIT", "shift_unit", "SHIFT_UNIT", "planes_unit", "PLANES_UNIT", "maxpool2d", "act_inplace", "expf_array"]

_FM = {"contract"}
# Depthwise kernels activate a plane right after computing it (still in L1) from this many
# outputs; smaller planes are activated in one call over the whole range they wrote: a call
# passes its arrays counted in and out, ~20 ns, as much as a 7x7 plane's activation (MobileNetV2's
# 960 x 7x7 depthwise + Clip 147 -> 126 us a call on one AVX-512 core).
_ACTS_PLANE_MIN = 256
# Widest input plane whose stride-2 phases the depthwise kernels split through the flat arrays
# (_split_phases_flat): 2.3x faster at 14x14 than through row views, at parity from 18x18 (AMD
# Zen 5; on a Sapphire Rapids-class VM, with the loop then scalar, faster up to 14x14).
_SPLIT_FLAT_W = 16
# For kernels whose only reduction is a float64 sum of squares: reassociation lets it vectorize.
_FM_SUM = {"contract", "reassoc"}

_F0 = np.float32(0.0)
_NO_OFFSETS = np.zeros(0, np.int64)  # conv_windows' (absent) gather offsets (see _panel_items)
# conv_windows' (absent) epilogue after the bias: codes, params, residual, channel tables
_NO_PARAMS = np.zeros((0, 3), np.float32)
_NO_RES = np.zeros((0, 0, 0), np.float32)
_NO_CHAN = np.zeros((0, 0, 2), np.float32)
_NO_BIAS = np.zeros(0, np.float32)
_F1 = np.float32(1.0)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO = np.float32(-87.0)
_EXP_HI = np.float32(88.0)
_HALF = np.float32(0.5)
_INF = np.float32(np.inf)
_C2 = np.float32(1.0 / 2)
_C3 = np.float32(1.0 / 6)
_C4 = np.float32(1.0 / 24)
_C5 = np.float32(1.0 / 120)
_C6 = np.float32(1.0 / 720)
_C7 = np.float32(1.0 / 5040)


@intrinsic
def _i32_as_f32(typingctx, i):
    """The float32 whose bits are the low 32 bits of the integer ``i``."""
    if not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if i.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(i), codegen


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _expf(x):
    """float32 ``exp``: 0 below -87 (numpy gives denormals there), inf above 88, NaN for NaN."""
    c = min(max(x, _EXP_LO), _EXP_HI)
    n = np.floor(c * _LOG2E + _HALF)
    r = c - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _C7
    p = p * r + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + _F1
    p = p * r + _F1
    e = p * _i32_as_f32((np.int32(n) + 127) << 23)
    if x > _EXP_HI:
        e = _INF
    elif x < _EXP_LO:
        e = _F0
    elif x != x:
        e = x
    return e


_P = [np.float32(c) for c in _erf_mod._P]
_Q = [np.float32(c) for c in _erf_mod._Q]
_P0, _P1, _P2, _P3, _P4, _P5 = _P
_Q0, _Q1, _Q2, _Q3, _Q4, _Q5, _Q6, _Q7, _Q8 = _Q
_ERF_SPLIT = np.float32(_erf_mod.ERF_SPLIT)
_ERF_CLAMP = np.float32(_erf_mod.ERF_CLAMP)
_SQRT1_2 = np.float32(0.7071067811865476)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _erff(x):
    """float32 ``erf``: the two pieces of ``_erf.py`` (same coefficients, 1.5 ulp), one element."""
    a = abs(x)
    s = min(a, _ERF_SPLIT)
    t = s * s
    p = _P5
    p = p * t + _P4
    p = p * t + _P3
    p = p * t + _P2
    p = p * t + _P1
    p = p * t + _P0
    small = s + s * p
    c = min(a, _ERF_CLAMP)
    q = _Q8
    q = q * c + _Q7
    q = q * c + _Q6
    q = q * c + _Q5
    q = q * c + _Q4
    q = q * c + _Q3
    q = q * c + _Q2
    q = q * c + _Q1
    q = q * c + _Q0
    large = _F1 - _expf(q)
    r = small if a < _ERF_SPLIT else large
    return math.copysign(r, x)


# tanh's odd polynomial below |x| = _TANH_SPLIT (tanh(x) = x + x * u * P(u), u = x * x; a
# least-squares fit on Chebyshev nodes), where 1 - 2 / (exp(2|x|) + 1) would cancel.
_TANH_SPLIT = np.float32(0.55)
# FastGelu's constants (contrib_activation's): sqrt(2/pi) and 0.044715 * sqrt(2/pi).
_FAST_A = np.float32(0.7978845608028654)
_FAST_B = np.float32(0.035677408136300125)
_T4 = np.float32(-0.006657443316005701)
_T3 = np.float32(0.0213397471560988)
_T2 = np.float32(-0.05391574144584575)
_T1 = np.float32(0.13333159248783974)
_T0 = np.float32(-0.3333333272713)
_F2 = np.float32(2.0)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _tanhf(x):
    """float32 ``tanh`` without a libm call (vectorizes): at most 1.9 ulp from the exact value over
    every float32 (numpy's: 1.4), ±1 beyond ±9, NaN for NaN, the sign of ±0 kept."""
    a = abs(x)
    u = a * a
    p = _T4
    p = p * u + _T3
    p = p * u + _T2
    p = p * u + _T1
    p = p * u + _T0
    small = a + a * (u * p)
    large = _F1 - _F2 / (_expf(a + a) + _F1)
    r = small if a < _TANH_SPLIT else large
    return math.copysign(r, x)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _act_row(row, act, a, b, c):
    """Activation ``act`` over a 1-D float32 array in place (a branch per row, not per element).

    Every element is stored as a computed value, never "either the loaded value or a constant":
    LLVM turns ``row[i] = 0 if v < 0 else v`` into a masked store of the zeros (``vmaskmovps``),
    which AMD's Zen cores run microcoded, several times slower than a plain vector store
    (measured on this module's Relu: 0.64 vs 0.10 ns an element).  Relu and Clip subtract
    ``c`` from what they keep: ``c`` is 0.0 for them (:func:`._act.encode` makes sure), so the
    bits are the comparison's (``-0`` stays ``-0``, NaN stays NaN), but LLVM cannot prove the
    subtraction away; LeakyRelu multiplies by 1 or its slope, exact either way.
    """
    n = row.shape[0]
    if act == 1:
        for i in range(n):
            v = row[i]
            row[i] = _F0 if v < _F0 else v - c
    elif act == 2:
        for i in range(n):
            row[i] = min(max(row[i], a), b) - c
    elif act == 3:
        for i in range(n):
            v = row[i]
            row[i] = v * min(max(v * a + b, _F0), _F1)
    elif act == 4:
        for i in range(n):
            v = row[i]
            row[i] = v / (_F1 + _expf(-v))
    elif act == 5:
        for i in range(n):
            row[i] = _F1 / (_F1 + _expf(-row[i]))
    elif act == 6:
        for i in range(n):
            v = row[i]
            row[i] = v * (_F1 if v >= _F0 else a)
    elif act == 7:
        for i in range(n):
            row[i] = min(max(row[i] * a + b, _F0), _F1)
    elif act == 8:
        for i in range(n):
            row[i] = row[i] * a + b
    elif act == 9:
        # In the graph's order: ``x * (1 + erf) * 0.5`` (a = 1: the 0.5 last, which overflows
        # for |x| near the float32 maximum as the op-by-op graph does) or ``0.5 * x * (1 + erf)``.
        if a == _F1:
            for i in range(n):
                v = row[i]
                row[i] = v * (_F1 + _erff(v * _SQRT1_2)) * _HALF
        else:
            for i in range(n):
                v = row[i]
                row[i] = _HALF * v * (_F1 + _erff(v * _SQRT1_2))
    elif act == 10:
        # QuantizeLinear -> DequantizeLinear (per tensor), FakeQuant's arithmetic (_qdq_jit): the
        # division is not contracted, and ``q * a + 0`` rounds once either way.
        for i in range(n):
            q = np.rint(row[i] / a)
            if not (q >= b):  # NaN too: the Q's fmax makes it the lowest code
                q = b
            if q > c:
                q = c
            row[i] = q * a + _F0
    elif act == 12:
        # onnxruntime's FastGelu, in contrib_activation.tanh_gelu_inplace's order:
        # x * ((1 + tanh(x * (A + B * x * x))) * 0.5).
        for i in range(n):
            v = row[i]
            t = _tanhf((v * v * _FAST_B + _FAST_A) * v)
            row[i] = v * ((t + _F1) * _HALF)
    elif act == 13:
        # onnxruntime's QuickGelu, x / (1 + exp(-a * x)) (contrib_activation.quick_gelu_inplace)
        for i in range(n):
            v = row[i]
            row[i] = v / (_F1 + _expf(v * -a))


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _acts(row, codes, params):
    for j in range(codes.shape[0]):
        _act_row(row, codes[j], params[j, 0], params[j, 1], params[j, 2])


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def acts_plane(row, codes, params):
    """:func:`_acts` compiled once, as a function of its own, for the kernels that activate a
    whole output plane at a time (depthwise and small direct convolutions).

    Why not inlined: each inlined copy of :func:`_act_row` (a dozen vectorized loops, exp and
    erf among them) costs ~5-8 s of LLVM time in every kernel that holds one, on a machine's
    first run of a convolution (numba's cache serves later processes); a call per plane costs
    tens of nanoseconds against the plane's microseconds."""
    _acts(row, codes, params)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def act_one(row, act, a, b, c):
    """One activation (:func:`_act_row`) over ``row``, compiled once as a function of its own
    (see :func:`acts_plane`): :func:`bias_act_rows` calls it per step of a chain that holds
    per-channel steps."""
    _act_row(row, act, a, b, c)


@njit(error_model="numpy")
def _channel_affine(row, a, b):
    """``row * a + b`` as a product, then a sum (two roundings): the bits of BatchNormalization's
    numpy ``y = x * a; y += b``.  Two passes, the product stored between them: numba applies a
    caller's fast-math flags to the code it inlines, so a single ``row[i] * a + b`` here became
    one fused multiply-add inside bias_act_rows (1 ulp from the unfused BatchNormalization on
    ~25 % of values, found by comparing with numpy; a float64 product rounded to float32 was
    narrowed back by LLVM and fused too)."""
    n = row.shape[0]
    for i in range(n):
        row[i] = row[i] * a
    for i in range(n):
        row[i] = row[i] + b


@njit(cache=True, nogil=True, error_model="numpy")
def affine_act(x, a, b, codes, params, y, r0, r1):
    """``y[n, c, :] = acts(x[n, c, :] * a[c] + b[c])`` for the flattened rows ``r0 <= n * C + c <
    r1`` of ``x`` and ``y`` (N, C, L) float32: BatchNormalization with its fused activations in
    one pass over memory, where numpy's ``y = x * a; y += b`` and the activations took two or
    three.  The product and the sum are two roundings, as numpy's (compiled without fast-math,
    so nothing contracts them into one fused multiply-add: see :func:`_channel_affine`); the
    activations are :func:`acts_plane`'s (not inlined: its fast-math stays in it)."""
    c_, l_ = x.shape[1], x.shape[2]
    for r in range(r0, r1):
        n = r // c_
        c = r - n * c_
        xr = x[n, c]
        yr = y[n, c]
        av = a[c]
        bv = b[c]
        for i in range(l_):
            yr[i] = xr[i] * av
        for i in range(l_):
            yr[i] = yr[i] + bv
        if codes.shape[0]:
            acts_plane(yr, codes, params)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _scatter(xf, xbase, h_, w_, xp, sh, sw, ph, pw, hq, wq):
    """One (H, W) plane of ``xf`` (flat, from ``xbase``) into ``xp``'s ``sh * sw`` stride
    phases of ``hq x wq`` (zeros elsewhere stay zeros): whole rows at stride 1, a one-pass
    de-interleave at stride 2."""
    for ih in range(h_):
        r = ih + ph
        if r < 0:
            continue
        qr = r // sh
        if qr >= hq:
            break
        pr = r - qr * sh
        srow = xbase + ih * w_
        if sw == 1:
            cnt = min(w_, wq - pw)
            if cnt > 0:
                dst = xp[(pr * hq + qr) * wq + pw:]
                src = xf[srow:srow + cnt]
                for i in range(cnt):
                    dst[i] = src[i]
        elif sw == 2:
            # Both column phases in one pass over the row: input column 2i lands in phase
            # a = pw % 2 at qa + i, column 2i + 1 in phase 1 - a at qb + i.
            a = pw % 2
            qa = pw // 2
            qb = (1 + pw) // 2
            na = min((w_ + 1) // 2, wq - qa)
            nb = min(w_ // 2, wq - qb)
            da = xp[((pr * 2 + a) * hq + qr) * wq + qa:]
            db = xp[((pr * 2 + 1 - a) * hq + qr) * wq + qb:]
            src = xf[srow:srow + w_]
            m2 = min(na, nb)
            for i in range(m2):
                da[i] = src[2 * i]
                db[i] = src[2 * i + 1]
            for i in range(m2, na):
                da[i] = src[2 * i]
            for i in range(m2, nb):
                db[i] = src[2 * i + 1]
        else:
            for pc in range(sw):
                # input columns iw with (iw + pw) % sw == pc, from iw0 on, land at qc0, qc0+1, ...
                iw0 = (pc - pw) % sw
                if iw0 >= w_:
                    continue
                qc0 = (iw0 + pw) // sw
                cnt = min((w_ - 1 - iw0) // sw + 1, wq - qc0)
                if cnt <= 0:
                    continue
                dst = xp[((pr * sw + pc) * hq + qr) * wq + qc0:]
                src = xf[srow + iw0:srow + iw0 + (cnt - 1) * sw + 1]
                for i in range(cnt):
                    dst[i] = src[i * sw]


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _taps(acc, xp, starts, wc, bc, length):
    """``acc[:length] = bc + sum_t wc[t] * xp[starts[t]:starts[t] + length]``, three taps per pass."""
    taps = wc.shape[0]
    t = 0
    while t < taps:
        if t + 3 <= taps:
            w0 = wc[t]
            w1 = wc[t + 1]
            w2 = wc[t + 2]
            x0 = xp[starts[t]:starts[t] + length]
            x1 = xp[starts[t + 1]:starts[t + 1] + length]
            x2 = xp[starts[t + 2]:starts[t + 2] + length]
            if t == 0:
                for i in range(length):
                    acc[i] = bc + w0 * x0[i] + w1 * x1[i] + w2 * x2[i]
            else:
                for i in range(length):
                    acc[i] += w0 * x0[i] + w1 * x1[i] + w2 * x2[i]
            t += 3
        else:
            w0 = wc[t]
            x0 = xp[starts[t]:starts[t] + length]
            if t == 0:
                for i in range(length):
                    acc[i] = bc + w0 * x0[i]
            else:
                for i in range(length):
                    acc[i] += w0 * x0[i]
            t += 1


# 1-D depthwise planes up to this long run straight from the input (_depthwise_rows); longer ones
# through the phase scratch, whose set-up a plane (~200 ns) is amortized there and whose three taps
# a pass make fewer passes over the output.
_DW_ROW_MAX = 64


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def _depthwise_rows(x, w, bias, y, s, d, p, codes, params, nc0, nc1):
    """:func:`depthwise2d` on planes of one row (a 1-D depthwise conv: ``x`` (N, C, 1, L), ``w``
    (C, 1, K), ``y`` (N, C, 1, OL)), straight from the input: per plane the bias, then each tap
    over the outputs whose input is inside the row (one contiguous multiply-add at stride 1); a
    tap over the padding adds ``w * 0``, which only a non-finite weight changes (NaN).  The
    taps' order is the phase kernel's (bias, then tap after tap), without its scatter into a
    scratch per plane: Silero VAD v4's 258 channels of 8 samples took 55 us that way, ~200 ns of
    set-up a plane for 40 multiply-adds."""
    c_, l_ = x.shape[1], x.shape[3]
    ol, k_ = y.shape[3], w.shape[2]
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    # Each tap's input offset and the outputs [lo, hi) whose input is inside the row: the same
    # for every plane (two integer divisions a tap were most of a short row's time).
    offs = np.empty(k_, np.int64)
    los = np.empty(k_, np.int64)
    his = np.empty(k_, np.int64)
    for k in range(k_):
        off = k * d - p  # output o reads input o * s + off
        lo = 0 if off >= 0 else min(ol, (-off + s - 1) // s)
        hi = min(ol, (l_ - 1 - off) // s + 1) if l_ - 1 - off >= 0 else 0
        offs[k], los[k], his[k] = off, lo, max(hi, lo)
    for nc in range(nc0, nc1):
        c = nc % c_
        xb = nc * l_
        yb = nc * ol
        bc = bias[c]
        for o in range(ol):
            yf[yb + o] = bc
        for k in range(k_):
            wk = w[c, 0, k]
            off, lo, hi = offs[k], los[k], his[k]
            if s == 1:
                # Unsigned indices into the flat arrays (no view a tap: ~10 ns each, most of a
                # short row's work; numba tests a signed index for wrap-around, which kept the
                # loop scalar: see _split_phases_flat).
                xo = np.uint64(xb + off + lo)
                yo = np.uint64(yb + lo)
                for i in range(np.uint64(hi - lo)):
                    yf[yo + i] += wk * xf[xo + i]
            else:
                for o in range(lo, hi):
                    yf[yb + o] += wk * xf[xb + o * s + off]
            if wk - wk != _F0:  # an infinite or NaN weight: its product with the padding is NaN
                z = wk * _F0
                for o in range(lo):
                    yf[yb + o] += z
                for o in range(hi, ol):
                    yf[yb + o] += z
    acts_plane(yf[nc0 * ol:nc1 * ol], codes, params)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def depthwise2d(x, w, bias, y, sh, sw, dh, dw, ph, pw, codes, params, nc0, nc1):
    """``y[n, c] = act(bias[c] + sum_{kh,kw} w[c, kh, kw] * xpad[n, c, oh*sh + kh*dh, ow*sw + kw*dw])``.

    ``x`` (N, C, H, W), ``w`` (C, KH, KW), ``bias`` (C,), ``y`` (N, C, OH, OW), all float32
    C-contiguous; ``xpad`` is ``x`` with ``ph >= 0`` rows and ``pw >= 0`` columns of zeros in
    front (and zeros after, as far as the windows reach).  Only planes ``nc0 <= n*C + c < nc1``
    are computed (callers split the planes across threads; the GIL is released).

    Each channel's plane is scattered once into a zeroed scratch holding its ``sh * sw`` stride
    phases (phase ``(r, s)`` = padded rows ``r::sh``, columns ``s::sw``), each flattened with
    width ``wq = OW + (KW-1)*dw // sw``.  A tap then reads one phase at a fixed shift, so it is
    one long multiply-add over ``(OH-1)*wq + OW`` contiguous elements (rows keep the scratch
    width; the extra columns are dropped at the end): the loops vectorize over thousands of
    elements instead of one output row, and no padded copy of the tensor is made.

    What makes it fast on MobileNet-sized planes (measured against the previous version of this
    kernel, 3x3 + Clip, one thread: 1.5-2.2x on 7x7 to 112x112 planes): the scatter copies whole
    rows (stride 1) or de-interleaves a row into both column phases in one contiguous pass
    (stride 2) instead of a strided gather per phase; three taps share one pass over the
    accumulator (a third of its loads and stores); the bias is the first pass's start value and
    the activations run once over the plane's accumulator, not per output row.
    """
    n_, c_, h_, w_ = x.shape
    oh_, ow_ = y.shape[2], y.shape[3]
    kh_, kw_ = w.shape[1], w.shape[2]
    if h_ == 1 and oh_ == 1 and kh_ == 1 and ph == 0 and w_ <= _DW_ROW_MAX:
        _depthwise_rows(x, w, bias, y, sw, dw, pw, codes, params, nc0, nc1)
        return
    taps = kh_ * kw_
    hq = oh_ + ((kh_ - 1) * dh) // sh
    wq = ow_ + ((kw_ - 1) * dw) // sw
    plane = hq * wq
    xp = np.zeros(sh * sw * plane, dtype=np.float32)
    length = (oh_ - 1) * wq + ow_
    acc = np.empty(length, dtype=np.float32)
    # Each tap's start in the phase scratch (the same for every plane).
    starts = np.empty(taps, dtype=np.int64)
    for kh in range(kh_):
        rr = kh * dh
        for kw in range(kw_):
            cc = kw * dw
            starts[kh * kw_ + kw] = (((rr % sh) * sw + cc % sw) * hq + rr // sh) * wq + cc // sw
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    hw = h_ * w_
    ohw = oh_ * ow_
    for nc in range(nc0, nc1):
        c = nc % c_
        _scatter(xf, nc * hw, h_, w_, xp, sh, sw, ph, pw, hq, wq)
        wc = w[c].reshape(-1)
        bc = bias[c]
        _taps(acc, xp, starts, wc, bc, length)
        acts_plane(acc, codes, params)  # the extra columns are activated too, and dropped
        _store_plane(yf, nc * ohw, acc, oh_, ow_, wq)


@njit(inline="always", error_model="numpy")
def _column_masks(k, p, h_, w_):
    """``ok[j, i]`` (k, H * W) float32: 1.0 where output column ``i % W`` has an input column at
    offset ``j - p``, else 0.0.  Row by row, no division per element: with ``i % W`` per element
    the masks of a 112x112 plane cost ~60 us a call, paid by every chunk of a split (a 300 us
    depthwise conv ran 420 us on two threads)."""
    ok = np.zeros((k, h_ * w_), dtype=np.float32)
    for j in range(k):
        lo = max(0, p - j)  # first output column whose input column j - p exists
        hi = min(w_, w_ + p - j)
        row = ok[j]
        for r in range(h_):
            base = r * w_
            for col in range(lo, hi):
                row[base + col] = _F1
    return ok


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def depthwise3_same(x, w, bias, y, codes, params, nc0, nc1):
    """:func:`depthwise2d` for the MobileNet case: a 3x3 kernel (5x5: :func:`depthwise5_same`), unit strides and
    dilations, one zero of padding on every side (so ``OH == H``, ``OW == W``).

    The plane is copied once (a contiguous copy, no per-row scatter) into a scratch with
    ``p * W + p`` zeros before and after it; with the output flattened to ``i = oh * W + ow``,
    tap ``(kh, kw)`` reads the scratch at ``i + kh * W + kw``: a constant shift, so one pass
    over the flattened plane computes every output with all ``K * K`` taps (unrolled, in
    registers) and writes it once.  A tap whose column falls outside the row reads a
    neighbouring row's element: each column group of taps is kept only where its column
    exists (a select per element on a per-call column mask — not a multiply, so an Inf or NaN
    in a neighbouring column never leaks).  Measured against :func:`depthwise2d` (3x3 + Clip,
    one thread): 960 x 7x7 182 -> 33 us, 576 x 14x14 215 -> 54 us, 144 x 56x56 368 -> 208 us,
    32 x 112x112 273 -> 194 us; onnxruntime's NCHWc kernels 27, 57, 155, 217 us.
    """
    n_, c_, h_, w_ = x.shape
    hw = h_ * w_
    # The zeroed scratch and the column masks: ok[j, i] != 0 when output column i % W has an
    # input column at offset j - p (float32, not bool: the select on a float mask vectorizes,
    # on a bool one it ran 1.7x slower; set up here, not in an inlined helper: that cost 1.5x
    # on 7x7 planes).
    p = 1
    m0 = p * w_ + p
    s = np.zeros(hw + 2 * m0, dtype=np.float32)
    ok = _column_masks(3, p, h_, w_)
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    # The scratch's views (its plane, its three kernel rows) and the masks' rows made once per
    # call, not per plane: each view's reference counting cost ~10 ns, ~30 % of a 7x7 plane's
    # time (indexing the flat arrays instead defeats the vectorizer: a computed index may be
    # negative, and numba wraps it).
    dst, r0, r1, r2 = s[m0:m0 + hw], s[0:], s[w_:], s[2 * w_:]
    ok0, ok2 = ok[0], ok[2]
    c = nc0 % c_
    for nc in range(nc0, nc1):
        base = nc * hw
        src = xf[base:base + hw]
        for i in range(hw):
            dst[i] = src[i]
        _dw_plane3(yf[base:base + hw], r0, r1, r2, w, c, bias[c], ok0, ok2, hw)
        if hw >= _ACTS_PLANE_MIN:
            acts_plane(yf[base:base + hw], codes, params)
        c += 1
        if c == c_:
            c = 0
    if hw < _ACTS_PLANE_MIN:
        acts_plane(yf[nc0 * hw:nc1 * hw], codes, params)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def depthwise5_same(x, w, bias, y, codes, params, nc0, nc1):
    """:func:`depthwise3_same` for a 5x5 kernel with 2 zeros of padding on every side (a
    separate function: with both plane loops in one, the 3x3 loop ran 1.6x slower)."""
    n_, c_, h_, w_ = x.shape
    hw = h_ * w_
    # The zeroed scratch and the column masks: ok[j, i] != 0 when output column i % W has an
    # input column at offset j - p (float32, not bool: the select on a float mask vectorizes,
    # on a bool one it ran 1.7x slower; set up here, not in an inlined helper: that cost 1.5x
    # on 7x7 planes).
    p = 2
    m0 = p * w_ + p
    s = np.zeros(hw + 2 * m0, dtype=np.float32)
    ok = _column_masks(5, p, h_, w_)
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    dst = s[m0:m0 + hw]  # (views once per call: see depthwise3_same)
    rows = (s[0:], s[w_:], s[2 * w_:], s[3 * w_:], s[4 * w_:])
    oks = (ok[0], ok[1], ok[3], ok[4])
    c = nc0 % c_
    for nc in range(nc0, nc1):
        base = nc * hw
        src = xf[base:base + hw]
        for i in range(hw):
            dst[i] = src[i]
        _dw_plane5(yf[base:base + hw], rows, w, c, bias[c], oks, hw)
        if hw >= _ACTS_PLANE_MIN:
            acts_plane(yf[base:base + hw], codes, params)
        c += 1
        if c == c_:
            c = 0
    if hw < _ACTS_PLANE_MIN:
        acts_plane(yf[nc0 * hw:nc1 * hw], codes, params)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _dw_plane3(out, r0, r1, r2, w, c, bc, ok0, ok2, hw):
    """One 3x3 plane into ``out``: ``r0..r2`` the padded scratch seen from its three kernel rows
    (see :func:`depthwise3_same`), channel ``c`` of ``w`` (C, 3, 3), the masks of the first and
    last kernel columns."""
    w00 = w[c, 0, 0]
    w01 = w[c, 0, 1]
    w02 = w[c, 0, 2]
    w10 = w[c, 1, 0]
    w11 = w[c, 1, 1]
    w12 = w[c, 1, 2]
    w20 = w[c, 2, 0]
    w21 = w[c, 2, 1]
    w22 = w[c, 2, 2]
    for i in range(hw):
        g0 = w00 * r0[i] + w10 * r1[i] + w20 * r2[i]
        g1 = w01 * r0[i + 1] + w11 * r1[i + 1] + w21 * r2[i + 1]
        g2 = w02 * r0[i + 2] + w12 * r1[i + 2] + w22 * r2[i + 2]
        v = bc + (g0 if ok0[i] != _F0 else _F0)
        v = v + g1
        out[i] = v + (g2 if ok2[i] != _F0 else _F0)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _dw_plane5(out, rows, w, c, bc, oks, hw):
    """:func:`_dw_plane3` for a 5x5 kernel: ``rows`` the scratch from its five kernel rows,
    ``oks`` the masks of kernel columns 0, 1, 3 and 4, ``w`` (C, 5, 5)."""
    r0, r1, r2, r3, r4 = rows
    ok0, ok1, ok3, ok4 = oks
    a0, a1, a2, a3, a4 = w[c, 0, 0], w[c, 1, 0], w[c, 2, 0], w[c, 3, 0], w[c, 4, 0]
    b0, b1, b2, b3, b4 = w[c, 0, 1], w[c, 1, 1], w[c, 2, 1], w[c, 3, 1], w[c, 4, 1]
    d0, d1, d2, d3, d4 = w[c, 0, 2], w[c, 1, 2], w[c, 2, 2], w[c, 3, 2], w[c, 4, 2]
    e0, e1, e2, e3, e4 = w[c, 0, 3], w[c, 1, 3], w[c, 2, 3], w[c, 3, 3], w[c, 4, 3]
    f0, f1, f2, f3, f4 = w[c, 0, 4], w[c, 1, 4], w[c, 2, 4], w[c, 3, 4], w[c, 4, 4]
    for i in range(hw):
        g0 = a0 * r0[i] + a1 * r1[i] + a2 * r2[i] + a3 * r3[i] + a4 * r4[i]
        j = i + 1
        g1 = b0 * r0[j] + b1 * r1[j] + b2 * r2[j] + b3 * r3[j] + b4 * r4[j]
        j = i + 2
        g2 = d0 * r0[j] + d1 * r1[j] + d2 * r2[j] + d3 * r3[j] + d4 * r4[j]
        j = i + 3
        g3 = e0 * r0[j] + e1 * r1[j] + e2 * r2[j] + e3 * r3[j] + e4 * r4[j]
        j = i + 4
        g4 = f0 * r0[j] + f1 * r1[j] + f2 * r2[j] + f3 * r3[j] + f4 * r4[j]
        v = bc + (g0 if ok0[i] != _F0 else _F0)
        v = v + (g1 if ok1[i] != _F0 else _F0)
        v = v + g2
        v = v + (g3 if ok3[i] != _F0 else _F0)
        out[i] = v + (g4 if ok4[i] != _F0 else _F0)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _split_phases(xf, xbase, h_, w_, s, psz, ow_):
    """The (H, W) plane at ``xf[xbase:]`` (H and W even) into its four stride-2 phases in ``s``:
    phase ``(a, b)`` (rows ``a::2``, columns ``b::2``; ``OH x OW``) at ``s[(2a + b) * psz:]``,
    its row ``q`` starting at ``1 + (q + 1) * OW`` (a zero row and a zero before, a zero row and
    a zero after: never written, they stay zeros).  One pass over each input row, which
    de-interleaves it into both column phases."""
    for r in range(h_):
        a = r % 2
        o = 1 + (r // 2 + 1) * ow_
        src = xf[xbase + r * w_:xbase + (r + 1) * w_]
        de = s[2 * a * psz + o:2 * a * psz + o + ow_]
        do = s[(2 * a + 1) * psz + o:(2 * a + 1) * psz + o + ow_]
        for j in range(ow_):
            de[j] = src[2 * j]
            do[j] = src[2 * j + 1]


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _split_phases_flat(xf, xbase, h_, w_, s, psz, ow_):
    """:func:`_split_phases` reading and writing through the flat arrays, for narrow planes: a
    view per row costs ~10 ns of reference counting, most of a 14x14 plane's split (see
    :func:`depthwise3_s2`).  The indices are unsigned: with signed ones numba tests each for a
    negative (wrap-around) value, which kept the loop scalar (AMD Zen 5, one thread: 256 x 14x14
    planes 166 -> 69 ns a plane, 8x8 69 -> 37; at parity with the views from 18x18)."""
    two = np.uint64(2)
    for r in range(h_):
        a = r % 2
        de = np.uint64(2 * a * psz + 1 + (r // 2 + 1) * ow_)
        do = de + np.uint64(psz)
        src = np.uint64(xbase + r * w_)
        for j in range(np.uint64(ow_)):
            s[de + j] = xf[src + two * j]
            s[do + j] = xf[src + two * j + np.uint64(1)]


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _split_plane(xf, xbase, h_, w_, s, psz, ow_):
    """:func:`_split_phases` of one plane, through the flat arrays where its rows are narrow
    (``_SPLIT_FLAT_W``)."""
    if w_ <= _SPLIT_FLAT_W:
        _split_phases_flat(xf, xbase, h_, w_, s, psz, ow_)
    else:
        _split_phases(xf, xbase, h_, w_, s, psz, ow_)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _s2_setup(h_, w_, planes):
    """(OW, OH * OW, phase size, zeroed scratch for the phases of ``planes`` planes, left mask,
    right mask) of the stride-2 kernels: the masks are 1.0 where an output column has its left
    (right) neighbouring phase column."""
    oh_ = h_ // 2
    ow_ = w_ // 2
    ohw = oh_ * ow_
    psz = (oh_ + 2) * ow_ + 2
    s = np.zeros(planes * 4 * psz, dtype=np.float32)
    ok = _column_masks(3, 1, oh_, ow_)
    return ow_, ohw, psz, s, ok[0], ok[2]


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _s2_views(s, psz, ow_, t0):
    """The nine views a 3x3 stride-2 tap reads (:func:`_split_phases`' layout), each starting at
    output ``t0``'s value: phases (odd, odd) up-left, (even, odd) left, (odd, odd) left,
    (odd, even) up, (even, even), (odd, even), (odd, odd) up, (even, odd), (odd, odd).  Views at
    constant shifts, all indexed from 0: numba then knows an index is not negative (no
    wrap-around test per element, which kept a loop from an offset from vectorizing)."""
    b0 = 1 + ow_ + t0  # phase row 0, column 0
    return (s[3 * psz + b0 - ow_ - 1:], s[psz + b0 - 1:], s[3 * psz + b0 - 1:], s[2 * psz + b0 - ow_:], s[b0:],
            s[2 * psz + b0:], s[3 * psz + b0 - ow_:], s[psz + b0:], s[3 * psz + b0:])


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _s2_taps3(out, s, psz, ow_, wc, bc, okl, first):
    """``out[i] (=|+=) [bc +] sum of the 3x3 taps wc`` for every output ``i`` of a stride-2
    conv with one zero of padding in front, from one plane's phases at ``s[:4 * psz]``
    (:func:`_split_phases`): tap ``(kh, kw)`` reads phase ``((kh - 1) % 2, (kw - 1) % 2)`` at
    ``i`` shifted by ``-OW`` for the row above and ``-1`` for the column to the left; the left
    column's taps are kept where ``okl`` says that column exists (a select: an Inf or NaN at
    the previous row's end never leaks).  ``first``: store (with the bias), else accumulate."""
    _s2_taps3_views(out, _s2_views(s, psz, ow_, 0), _w9(wc), bc, okl, first)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _s2_taps3_views(out, views, k, bc, okl, first):
    """:func:`_s2_taps3` on the phases' nine views (:func:`_s2_views`, made once by a caller that
    runs many planes through one scratch) and the taps ``k`` (:func:`_w9`)."""
    oo_ul, eo_l, oo_l, oe_u, ee, oe, oo_u, eo, oo = views
    o = out
    ok = okl
    w00, w01, w02, w10, w11, w12, w20, w21, w22 = k
    if first:
        for i in range(o.shape[0]):
            g0 = w00 * oo_ul[i] + w10 * eo_l[i] + w20 * oo_l[i]
            g1 = w01 * oe_u[i] + w11 * ee[i] + w21 * oe[i]
            g2 = w02 * oo_u[i] + w12 * eo[i] + w22 * oo[i]
            v = bc + (g0 if ok[i] != _F0 else _F0)
            v = v + g1
            o[i] = v + g2
    else:
        for i in range(o.shape[0]):
            g0 = w00 * oo_ul[i] + w10 * eo_l[i] + w20 * oo_l[i]
            g1 = w01 * oe_u[i] + w11 * ee[i] + w21 * oe[i]
            g2 = w02 * oo_u[i] + w12 * eo[i] + w22 * oo[i]
            v = o[i] + (g0 if ok[i] != _F0 else _F0)
            v = v + g1
            o[i] = v + g2


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def depthwise3_s2(x, w, bias, y, codes, params, nc0, nc1):
    """:func:`depthwise2d` for MobileNet's downsampling case: a 3x3 kernel, stride 2, one zero
    of padding in front (rows and columns), even H and W (so ``OH = H / 2``, ``OW = W / 2``).

    Each plane is split once into its four stride phases (:func:`_split_phases`, zero-bordered);
    with the output flattened to ``i = oh * OW + ow`` every tap ``(kh, kw)`` then reads phase
    ``((kh - 1) % 2, (kw - 1) % 2)`` at ``i`` plus a constant shift (``-OW`` for the row above,
    ``-1`` for the column to the left), so one pass over the output plane computes every output
    with all 9 taps and writes it once; the taps of the left column are kept only where that
    column exists (a select on a mask, so an Inf or NaN at the previous row's end never leaks).
    Measured against the phase kernel of :func:`depthwise2d` (3x3 + Clip, one thread, the
    same process, interleaved): 96 x 112x112 968 -> 779 us, 144 x 56x56 334 -> 209,
    32 x 112x112 179 -> 129; against the "same" kernel and a subsample: 192 x 28x28
    124 -> 103, 576 x 14x14 132 -> 122 (a loaded machine: ratios, not absolute times).  The
    split costs about a plain copy of the plane; the phase kernel's per-row scatter cost 4x.
    """
    n_, c_, h_, w_ = x.shape
    ow_, ohw, psz, s, okl, okr = _s2_setup(h_, w_, 1)
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    hw = h_ * w_
    # The scratch's views made once a call, the weights read without a view: on a 7x7 output
    # plane the ten views a plane made were most of its time.
    views = _s2_views(s, psz, ow_, 0)
    for nc in range(nc0, nc1):
        _split_plane(xf, nc * hw, h_, w_, s, psz, ow_)
        out = yf[nc * ohw:(nc + 1) * ohw]
        c = nc % c_
        k = (w[c, 0, 0], w[c, 0, 1], w[c, 0, 2], w[c, 1, 0], w[c, 1, 1], w[c, 1, 2], w[c, 2, 0], w[c, 2, 1],
             w[c, 2, 2])
        _s2_taps3_views(out, views, k, bias[c], okl, True)
        if ohw >= _ACTS_PLANE_MIN:
            acts_plane(out, codes, params)
    if ohw < _ACTS_PLANE_MIN:
        acts_plane(yf[nc0 * ohw:nc1 * ohw], codes, params)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def depthwise5_s2(x, w, bias, y, codes, params, nc0, nc1):
    """:func:`depthwise3_s2` for a 5x5 kernel with two zeros of padding in front: tap
    ``(kh, kw)`` reads phase ``((kh - 2) % 2, (kw - 2) % 2)`` at row shift ``(kh - 2) // 2`` and
    column shift ``(kw - 2) // 2`` (-1, 0 or +1); the taps of the left and right columns are
    kept only where those columns exist."""
    n_, c_, h_, w_ = x.shape
    ow_, ohw, psz, s, okl, okr = _s2_setup(h_, w_, 1)
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    hw = h_ * w_
    b0 = 1 + ow_
    # rows kh = 0..4: phase a = 0, 1, 0, 1, 0 at row shifts -1, -1, 0, 0, +1 (columns likewise)
    ra0 = b0 - ow_
    ra1 = psz * 2 + b0 - ow_  # a = 1 (times 2: the phase index is 2a + b)
    ra2 = b0
    ra3 = psz * 2 + b0
    ra4 = b0 + ow_
    # columns kw = 0..4: phase b = 0, 1, 0, 1, 0 at column shifts -1, -1, 0, 0, +1
    cb0 = -1
    cb1 = psz - 1
    cb2 = 0
    cb3 = psz
    cb4 = 1
    for nc in range(nc0, nc1):
        _split_plane(xf, nc * hw, h_, w_, s, psz, ow_)
        wc = w[nc % c_]
        bc = bias[nc % c_]
        out = yf[nc * ohw:(nc + 1) * ohw]
        # one column of taps per pass would re-read the output; all 25 in one pass, as
        # _dw_plane5 does (the column groups summed in order, masked where the column is missing)
        c0 = wc[:, 0]
        c1 = wc[:, 1]
        c2 = wc[:, 2]
        c3 = wc[:, 3]
        c4 = wc[:, 4]
        a0, a1, a2, a3, a4 = c0[0], c0[1], c0[2], c0[3], c0[4]
        b0_, b1, b2, b3, b4 = c1[0], c1[1], c1[2], c1[3], c1[4]
        d0, d1, d2, d3, d4 = c2[0], c2[1], c2[2], c2[3], c2[4]
        e0, e1, e2, e3, e4 = c3[0], c3[1], c3[2], c3[3], c3[4]
        f0, f1, f2, f3, f4 = c4[0], c4[1], c4[2], c4[3], c4[4]
        p00 = s[ra0 + cb0:]
        p10 = s[ra1 + cb0:]
        p20 = s[ra2 + cb0:]
        p30 = s[ra3 + cb0:]
        p40 = s[ra4 + cb0:]
        p01 = s[ra0 + cb1:]
        p11 = s[ra1 + cb1:]
        p21 = s[ra2 + cb1:]
        p31 = s[ra3 + cb1:]
        p41 = s[ra4 + cb1:]
        p02 = s[ra0 + cb2:]
        p12 = s[ra1 + cb2:]
        p22 = s[ra2 + cb2:]
        p32 = s[ra3 + cb2:]
        p42 = s[ra4 + cb2:]
        p03 = s[ra0 + cb3:]
        p13 = s[ra1 + cb3:]
        p23 = s[ra2 + cb3:]
        p33 = s[ra3 + cb3:]
        p43 = s[ra4 + cb3:]
        p04 = s[ra0 + cb4:]
        p14 = s[ra1 + cb4:]
        p24 = s[ra2 + cb4:]
        p34 = s[ra3 + cb4:]
        p44 = s[ra4 + cb4:]
        for i in range(ohw):
            g0 = a0 * p00[i] + a1 * p10[i] + a2 * p20[i] + a3 * p30[i] + a4 * p40[i]
            g1 = b0_ * p01[i] + b1 * p11[i] + b2 * p21[i] + b3 * p31[i] + b4 * p41[i]
            g2 = d0 * p02[i] + d1 * p12[i] + d2 * p22[i] + d3 * p32[i] + d4 * p42[i]
            g3 = e0 * p03[i] + e1 * p13[i] + e2 * p23[i] + e3 * p33[i] + e4 * p43[i]
            g4 = f0 * p04[i] + f1 * p14[i] + f2 * p24[i] + f3 * p34[i] + f4 * p44[i]
            v = bc + (g0 if okl[i] != _F0 else _F0)
            v = v + (g1 if okl[i] != _F0 else _F0)
            v = v + g2
            v = v + g3
            out[i] = v + (g4 if okr[i] != _F0 else _F0)
        if ohw >= _ACTS_PLANE_MIN:
            acts_plane(out, codes, params)
    if ohw < _ACTS_PLANE_MIN:
        acts_plane(yf[nc0 * ohw:nc1 * ohw], codes, params)


# Output positions per tile of conv3_s2_small's four-channel passes: the four output tiles stay in
# L1 across the input channels' passes (measured 2,048 .. whole planes within noise; 256 slower).
_STEM_TILE = 2048


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _s2_sum(start, keep, k, p):
    """One output of :func:`_s2_taps3`'s loop: ``start`` plus the 9 taps ``k`` (row-major 3x3
    weights) of the phase values ``p`` (:func:`_s2_taps3x4`'s order), the same operations in the
    same order as there (so the same bits)."""
    g0 = k[0] * p[0] + k[3] * p[1] + k[6] * p[2]
    g1 = k[1] * p[3] + k[4] * p[4] + k[7] * p[5]
    g2 = k[2] * p[6] + k[5] * p[7] + k[8] * p[8]
    v = start + (g0 if keep else _F0)
    v = v + g1
    return v + g2


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _w9(wc):
    return (wc[0, 0], wc[0, 1], wc[0, 2], wc[1, 0], wc[1, 1], wc[1, 2], wc[2, 0], wc[2, 1], wc[2, 2])


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _s2_taps3x4(o0, o1, o2, o3, s, psz, ow_, w, m, ci, bias, okl, first, t0, tl):
    """:func:`_s2_taps3` for output channels ``m .. m+3`` at once, over outputs ``t0 .. t0+tl``
    (the ``o*`` views start at ``t0``) from input channel ``ci``'s phases: each phase value is
    loaded once for the four (the per-channel pass loads 9 values and the output for 9 products).
    ``first``: store the bias plus the taps, else accumulate (two loops: a select per element
    between the bias and the output kept the loop from vectorizing, 3x slower)."""
    oo_ul, eo_l, oo_l, oe_u, ee, oe, oo_u, eo, oo = _s2_views(s, psz, ow_, t0)
    ok = okl[t0:]
    ka = _w9(w[m, ci])
    kb = _w9(w[m + 1, ci])
    kc = _w9(w[m + 2, ci])
    kd = _w9(w[m + 3, ci])
    if first:
        ba = bias[m]
        bb = bias[m + 1]
        bc = bias[m + 2]
        bd = bias[m + 3]
        for i in range(tl):
            p = (oo_ul[i], eo_l[i], oo_l[i], oe_u[i], ee[i], oe[i], oo_u[i], eo[i], oo[i])
            keep = ok[i] != _F0
            o0[i] = _s2_sum(ba, keep, ka, p)
            o1[i] = _s2_sum(bb, keep, kb, p)
            o2[i] = _s2_sum(bc, keep, kc, p)
            o3[i] = _s2_sum(bd, keep, kd, p)
    else:
        for i in range(tl):
            p = (oo_ul[i], eo_l[i], oo_l[i], oe_u[i], ee[i], oe[i], oo_u[i], eo[i], oo[i])
            keep = ok[i] != _F0
            o0[i] = _s2_sum(o0[i], keep, ka, p)
            o1[i] = _s2_sum(o1[i], keep, kb, p)
            o2[i] = _s2_sum(o2[i], keep, kc, p)
            o3[i] = _s2_sum(o3[i], keep, kd, p)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def conv3_s2_small(x, w, bias, y, codes, params, nc0, nc1):
    """A one-group 3x3 stride-2 convolution with one zero of padding in front over even H and W,
    from few input channels (an RGB stem): :func:`conv2d_small`'s case of MobileNet's and
    YOLO's stems, the :func:`depthwise3_s2` way.  Each image's ``C`` planes are split once into
    their stride phases; then four output planes at a time, tile by tile, get one pass per input
    channel (:func:`_s2_taps3x4`; the first pass with the bias), then the activations; a last
    one to three planes one at a time (:func:`_s2_taps3`).

    ``x`` (N, C, H, W), ``w`` (M, C, 3, 3), ``bias`` (M,), ``y`` (N, M, H/2, W/2), float32
    C-contiguous; planes ``nc0 <= n*M + m < nc1``.  Measured (single-Conv+Clip sessions, one
    thread, interleaved in one process, medians of 150, a loaded machine): 3 -> 32 on 224x224
    (MobileNetV2) im2col + GEMM + epilogue 683 -> 575 us; :func:`conv2d_small` 3 -> 16 on
    2 x 224x224 (orientation) 777 -> 639, on 320x320 (YOLOv8n) 757 -> 660; 3 -> 64 1236 -> 1092.
    Four planes a pass instead of one (the kernel alone, one thread, Sapphire Rapids-class VM):
    3 -> 32 on 224x224 ~515 -> ~385 us, 3 -> 16 on 320x320 ~600 -> ~470 us, the same bits.
    """
    n_, c_, h_, w_ = x.shape
    m_ = y.shape[1]
    ow_, ohw, psz, s, okl, okr = _s2_setup(h_, w_, c_)
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    hw = h_ * w_
    cur = -1
    nm = nc0
    while nm < nc1:
        n = nm // m_
        m = nm - n * m_
        if n != cur:
            for ci in range(c_):
                _split_phases(xf, (n * c_ + ci) * hw, h_, w_, s[ci * 4 * psz:(ci + 1) * 4 * psz], psz, ow_)
            cur = n
        if m + 4 <= m_ and nm + 4 <= nc1:
            o0 = yf[nm * ohw:(nm + 1) * ohw]
            o1 = yf[(nm + 1) * ohw:(nm + 2) * ohw]
            o2 = yf[(nm + 2) * ohw:(nm + 3) * ohw]
            o3 = yf[(nm + 3) * ohw:(nm + 4) * ohw]
            for t0 in range(0, ohw, _STEM_TILE):
                tl = min(_STEM_TILE, ohw - t0)
                for ci in range(c_):
                    _s2_taps3x4(o0[t0:], o1[t0:], o2[t0:], o3[t0:], s[ci * 4 * psz:(ci + 1) * 4 * psz], psz, ow_,
                                w, m, ci, bias, okl, ci == 0, t0, tl)
            acts_plane(yf[nm * ohw:(nm + 4) * ohw], codes, params)
            nm += 4
            continue
        out = yf[nm * ohw:(nm + 1) * ohw]
        wm = w[m]
        for ci in range(c_):
            _s2_taps3(out, s[ci * 4 * psz:(ci + 1) * 4 * psz], psz, ow_, wm[ci], bias[m], okl, ci == 0)
        acts_plane(out, codes, params)
        nm += 1


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _store_plane(yf, ybase, acc, oh_, ow_, wq):
    """The ``oh_ x ow_`` output plane at ``yf[ybase:]`` from the accumulator's rows of ``wq``
    (whose extra columns are dropped)."""
    for oh in range(oh_):
        row = yf[ybase + oh * ow_:ybase + (oh + 1) * ow_]
        src = acc[oh * wq:oh * wq + ow_]
        for i in range(ow_):
            row[i] = src[i]


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def conv2d_small(x, w, bias, y, sh, sw, dh, dw, ph, pw, codes, params, nc0, nc1):
    """A one-group convolution with few taps per output (``C * KH * KW`` small: an RGB stem's
    27, a 1x1 conv from 16 channels), the depthwise kernel's way: each image's ``C`` planes
    are scattered once into their stride phases, then every output plane is ``C * KH * KW``
    long multiply-adds (three per pass) plus its bias and activations, written once.

    ``x`` (N, C, H, W), ``w`` (M, C, KH, KW), ``bias`` (M,), ``y`` (N, M, OH, OW), float32
    C-contiguous, ``ph, pw >= 0``; planes ``nc0 <= n*M + m < nc1``.  An im2col + GEMM of inner
    size 27 runs far below BLAS speed and makes ``K`` copies of the input plus a pass for the
    epilogue; here the input is copied once and the output written once.
    """
    n_, c_, h_, w_ = x.shape
    m_, oh_, ow_ = y.shape[1], y.shape[2], y.shape[3]
    kh_, kw_ = w.shape[2], w.shape[3]
    hq = oh_ + ((kh_ - 1) * dh) // sh
    wq = ow_ + ((kw_ - 1) * dw) // sw
    psize = sh * sw * hq * wq
    xp = np.zeros(c_ * psize, dtype=np.float32)
    length = (oh_ - 1) * wq + ow_
    acc = np.empty(length, dtype=np.float32)
    starts = np.empty(c_ * kh_ * kw_, dtype=np.int64)
    for ci in range(c_):
        for kh in range(kh_):
            rr = kh * dh
            for kw in range(kw_):
                cc = kw * dw
                starts[(ci * kh_ + kh) * kw_ + kw] = ci * psize + (((rr % sh) * sw + cc % sw) * hq + rr // sh) * wq + cc // sw
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    wf = w.reshape(m_, -1)
    hw = h_ * w_
    ohw = oh_ * ow_
    cur = -1
    for nm in range(nc0, nc1):
        n = nm // m_
        m = nm - n * m_
        if n != cur:
            for ci in range(c_):
                _scatter(xf, (n * c_ + ci) * hw, h_, w_, xp[ci * psize:(ci + 1) * psize], sh, sw, ph, pw, hq, wq)
            cur = n
        _taps(acc, xp, starts, wf[m], bias[m], length)
        acts_plane(acc, codes, params)
        _store_plane(yf, nm * ohw, acc, oh_, ow_, wq)


_NEG_INF = np.float32(-np.inf)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def maxpool2d(x, y, kh, kw, sh, sw, dh, dw, ph, pw, zero):
    """2-D max pooling without indices: ``y[n, c, oh, ow]`` = the largest of ``x[n, c]`` over the
    window of rows ``oh*sh - ph + i*dh`` and columns ``ow*sw - pw + j*dw`` that lie inside the
    plane (positions outside are padding, which never wins: a window of padding only is -inf),
    NaN if the window holds one (``np.maximum``'s rule, as the numpy path).

    ``x`` (N, C, H, W), ``y`` (N, C, OH, OW) float32 C-contiguous; ``zero`` is 0.0.  Per output
    row the window's rows are reduced into one scratch row (vectorized; stored as ``max - zero``
    so that LLVM cannot make the loop masked stores, see :func:`_act_row`), then its columns.

    Written this way on purpose: a version that read a single window row in place (the scratch
    row bound to either the scratch or a view of ``x``) ran 2x slower on every geometry.

    Unit strides and dilations (YOLO's SPP / SPPF pools: 5x5, 9x9, 13x13 windows on 10x10 to
    20x20 maps) take :func:`_maxpool_s1`'s passes over the whole padded plane instead.
    """
    if sh == 1 and sw == 1 and dh == 1 and dw == 1:
        _maxpool_s1(x, y, kh, kw, ph, pw, zero)
        return
    n_, c_, h_, w_ = x.shape
    oh_, ow_ = y.shape[2], y.shape[3]
    # The window rows' maximum goes to ``row``, a view into ``prow``: the row between -inf borders
    # of ``pw`` floats before and enough after for the last window, so the column pass below is
    # kw shifted passes (vectorized, no bounds per tap) over the span the windows start in, then
    # every ``sw``-th of them.  (A loop over each output's taps with bounds checks ran ~1.5 ns a
    # tap: resnet's 3x3 stride-2 pool of 64 x 112x112 0.81-0.95 -> 0.37 ms.)
    span = (ow_ - 1) * sw + 1
    width = max(pw + w_, span + (kw - 1) * dw)
    prow = np.empty(width, np.float32)
    for j in range(width):
        prow[j] = _NEG_INF
    row = prow[pw:pw + w_]
    cm = np.empty(span, np.float32)
    for nc in range(n_ * c_):
        n = nc // c_
        c = nc - n * c_
        for oh in range(oh_):
            r = oh * sh - ph
            first = True
            for t in range(kh):
                rr = r + t * dh
                if rr < 0 or rr >= h_:
                    continue
                src = x[n, c, rr]
                if first:
                    for j in range(w_):
                        row[j] = src[j]
                    first = False
                else:
                    for j in range(w_):
                        a = row[j]
                        b = src[j]
                        row[j] = (a if (a >= b or a != a) else b) - zero
            dst = y[n, c, oh]
            if first:
                for ow in range(ow_):
                    dst[ow] = _NEG_INF
                continue
            if kw == 2 and sw == 2 and dw == 1 and pw == 0 and 2 * ow_ <= w_:
                for ow in range(ow_):
                    a = row[2 * ow]
                    b = row[2 * ow + 1]
                    dst[ow] = (a if (a >= b or a != a) else b) - zero
                continue
            for i in range(span):
                cm[i] = prow[i]
            for t in range(1, kw):
                src = prow[t * dw:t * dw + span]
                for i in range(span):
                    a = cm[i]
                    b = src[i]
                    cm[i] = (a if (a >= b or a != a) else b) - zero
            for ow in range(ow_):
                dst[ow] = cm[ow * sw]


@njit(inline="always", error_model="numpy")
def _maxpool_s1(x, y, kh, kw, ph, pw, zero):
    """:func:`maxpool2d` at unit strides and dilations: each plane copied once into a scratch
    padded with -inf to ``(OH + KH - 1) x (OW + KW - 1)``, then the window's columns and rows
    as shifted passes over that whole flattened plane (each output's window is a run of
    consecutive positions in a row, then of rows at the padded width: one long vectorized loop
    per tap instead of a loop over each output's window; the extra columns each padded row
    yields are dropped at the end).  The same maxima, NaN rule and -inf of an all-padding
    window.  Measured (kernel alone, one thread, 2 x 192 planes of 13x13; YOLOX's SPP):
    5x5 338 -> 147 us, 9x9 487 -> 262, 13x13 680 -> 414; 2 x 128 of 10x10 5x5 (YOLOv8n's
    SPPF) 147 -> 61."""
    n_, c_, h_, w_ = x.shape
    oh_, ow_ = y.shape[2], y.shape[3]
    wp = ow_ + kw - 1
    hp = oh_ + kh - 1
    size = hp * wp
    p = np.empty(size + kw, np.float32)
    for i in range(p.shape[0]):
        p[i] = _NEG_INF
    hm = np.empty(size, np.float32)
    v = np.empty(oh_ * wp, np.float32)
    for nc in range(n_ * c_):
        n = nc // c_
        c = nc - n * c_
        # The plane at (ph, pw); the rest of p stays -inf (the same positions every plane).
        for r in range(h_):
            pr = r + ph
            if pr < 0 or pr >= hp:
                continue
            src = x[n, c, r]
            base = pr * wp
            for j in range(w_):
                pc = j + pw
                if pc >= 0 and pc < wp:
                    p[base + pc] = src[j]
        for i in range(size):
            hm[i] = p[i]
        for t in range(1, kw):  # hm[i] = max(p[i .. i + kw))
            pt = p[t:]
            for i in range(size):
                a = hm[i]
                b = pt[i]
                hm[i] = (a if (a >= b or a != a) else b) - zero
        rows = oh_ * wp
        for i in range(rows):
            v[i] = hm[i]
        for t in range(1, kh):  # v[i] = max(hm[i + t * wp]) over the window's rows
            ht = hm[t * wp:]
            for i in range(rows):
                a = v[i]
                b = ht[i]
                v[i] = (a if (a >= b or a != a) else b) - zero
        for oh in range(oh_):
            dst = y[n, c, oh]
            src = v[oh * wp:]
            for ow in range(ow_):
                dst[ow] = src[ow]


@njit(cache=True, nogil=True)
def gather_cols(xz, idx, cols):
    """``cols[i, j] = xz[i, idx[j]]``: the column matrices of a small convolution, one image per
    row of ``xz`` (N, L + 1: the image flat and a zero that the padding's indices read), through
    indices made once per input shape (conv.py's ``_GATHER`` path; numpy's fancy indexing of 16
    wake-word images, 12,096 columns each: 0.46 ms, this loop 0.15)."""
    k = idx.shape[0]
    for i in range(xz.shape[0]):
        src = xz[i]
        dst = cols[i]
        for j in range(k):
            dst[j] = src[idx[j]]


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def stride_phases(x, ph4):
    """``ph4`` (N, C, 4, H/2, W/2) = the four stride-2 phases of ``x`` (N, C, H, W), H and W
    even: phase ``2a + b`` holds rows ``a::2``, columns ``b::2``.  One de-interleaving pass over
    each input row (both column phases at once)."""
    n_, c_, h_, w_ = x.shape
    wq = w_ // 2
    for n in range(n_):
        for c in range(c_):
            for r in range(h_):
                a = r % 2
                src = x[n, c, r]
                de = ph4[n, c, 2 * a, r // 2]
                do = ph4[n, c, 2 * a + 1, r // 2]
                for j in range(wq):
                    de[j] = src[2 * j]
                    do[j] = src[2 * j + 1]


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def pad_phases(x, xp, top, left):
    """``xp`` (N, C, 2, 2, HQ, WQ) = the stride-2 phases of ``x`` (N, C, H, W) zero-padded by
    ``top`` rows and ``left`` columns (and with zeros wherever a phase reaches past the input):
    ``xp[n, c, a, b, r, s] = x[n, c, 2r + a - top, 2s + b - left]`` or 0.  One de-interleaving
    pass per input row, both column phases at once (a stride-2 read of one phase alone does not
    vectorize), over flat unsigned indices (views per row cost ~60 ns a row); the borders
    written apart.  conv_shift reads the result for stride-2 convs."""
    n_, c_, h_, w_ = x.shape
    hq, wq = xp.shape[4], xp.shape[5]
    xf = x.reshape(-1)
    df = xp.reshape(-1)
    pplane = hq * wq
    # the output columns s where column phase b reads inside the row: 0 <= 2s + b - left < W
    lo0 = min(wq, max(0, (left + 1) // 2))
    lo1 = min(wq, max(0, left // 2))
    hi0 = max(lo0, min(wq, (w_ - 1 + left) // 2 + 1))
    hi1 = max(lo1, min(wq, (w_ - 2 + left) // 2 + 1))
    lo, hi = max(lo0, lo1), min(hi0, hi1)
    cnt = np.uint64(max(0, hi - lo))
    for nc in range(n_ * c_):
        for a in range(2):
            for r in range(hq):
                i = 2 * r + a - top
                d0 = nc * 4 * pplane + 2 * a * pplane + r * wq
                d1 = d0 + pplane
                if i < 0 or i >= h_:
                    for q in range(wq):
                        df[d0 + q] = _F0
                        df[d1 + q] = _F0
                    continue
                src = (nc * h_ + i) * w_
                for q in range(lo):
                    df[d0 + q] = xf[src + 2 * q - left] if lo0 <= q < hi0 else _F0
                    df[d1 + q] = xf[src + 2 * q + 1 - left] if lo1 <= q < hi1 else _F0
                for q in range(max(lo, hi), wq):
                    df[d0 + q] = xf[src + 2 * q - left] if lo0 <= q < hi0 else _F0
                    df[d1 + q] = xf[src + 2 * q + 1 - left] if lo1 <= q < hi1 else _F0
                s0 = np.uint64(src + 2 * lo - left)
                e0 = np.uint64(d0 + lo)
                e1 = np.uint64(d1 + lo)
                for q in range(cnt):
                    df[e0 + q] = xf[s0 + np.uint64(2) * q]
                    df[e1 + q] = xf[s0 + np.uint64(2) * q + np.uint64(1)]


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def im2col2d(x, ph4, cols, kh_, kw_, sh, sw, dh, dw, ph, pw, oh_, ow_, n, oh0, oh1):
    """Output rows ``oh0 <= oh < oh1`` of image ``n``'s column matrix for a 2-D convolution,
    straight from its unpadded input.

    ``x`` (N, C, H, W) float32 C-contiguous; ``cols`` (C * KH * KW, (oh1 - oh0) * OW) float32
    C-contiguous is written in full: row ``(c * KH + kh) * KW + kw`` holds, for every output
    ``(oh, ow)``, the input at ``(oh * sh + kh * dh - ph, ow * sw + kw * dw - pw)``, or 0 where
    that falls in the padding (``ph, pw >= 0``).  Each row segment is one copy of the valid
    columns with the padding zeroed around it: no padded copy of the input.  ``ph4``: empty,
    or (stride 2 over an even H and W) the input's stride phases (:func:`stride_phases`), so
    every segment is a unit-stride copy from one phase (a stride-2 read of every other element
    did not vectorize: slower than numpy's phase copies).  Measured against numpy's pad +
    im2col (3x3, whole matrices, one thread, the same process, interleaved, a loaded machine):
    stride 2 16 x 160x160 878 -> 567 us, 32 x 80x80 392 -> 233, 64 x 40x40 183 -> 156,
    128 x 20x20 146 -> 142; stride 1 64 x 40x40 624 -> 477.
    """
    n_, c_, h_, w_ = x.shape
    phased = ph4.shape[0] > 0
    hq = h_ // 2
    wq = w_ // 2
    xf = x.reshape(-1)
    pf = ph4.reshape(-1)
    hw = h_ * w_
    for c in range(c_):
        xb = (n * c_ + c) * hw
        pb = (n * c_ + c) * 4 * hq * wq
        for kh in range(kh_):
            for kw in range(kw_):
                row = cols[(c * kh_ + kh) * kw_ + kw]
                roff = kh * dh - ph  # input row of output row 0
                off = kw * dw - pw  # input column of output column 0
                qoff = 0
                joff = 0
                base = 0
                if phased:
                    # the tap reads phase (roff % 2, off % 2) at row oh + roff // 2, column ow + off // 2
                    qoff = roff // 2
                    joff = off // 2
                    base = pb + (2 * (roff % 2) + off % 2) * hq * wq
                    lo = max(0, -joff)
                    hi = min(ow_, wq - joff)
                    rows = hq
                else:
                    # valid output columns: 0 <= ow * sw + off < W
                    lo = 0 if off >= 0 else (-off + sw - 1) // sw
                    hi = min(ow_, (w_ - 1 - off) // sw + 1) if w_ - 1 - off >= 0 else 0
                    rows = h_
                if hi < lo:
                    hi = lo
                cnt = hi - lo
                for oh in range(oh0, oh1):
                    d = row[(oh - oh0) * ow_:(oh - oh0 + 1) * ow_]
                    ih = oh + qoff if phased else oh * sh + roff
                    if ih < 0 or ih >= rows or cnt == 0:
                        for j in range(ow_):
                            d[j] = _F0
                        continue
                    for j in range(lo):
                        d[j] = _F0
                    for j in range(hi, ow_):
                        d[j] = _F0
                    dd = d[lo:hi]
                    if phased:
                        src = pf[base + ih * wq + lo + joff:]
                        for j in range(cnt):
                            dd[j] = src[j]
                    else:
                        src = xf[xb + ih * w_ + lo * sw + off:]
                        if sw == 1:
                            for j in range(cnt):
                                dd[j] = src[j]
                        else:
                            for j in range(cnt):
                                dd[j] = src[j * sw]


@njit(inline="always", nogil=True)
def _shift_tile(x, xoff, xstride, w, taps, c, cb, m, out, ooff, ostride):
    """Every output channel of one tile of ``TILE`` positions, channel ``co`` to
    ``out.flat[ooff + co*ostride:][:TILE]``: tiles of 6 channels, then 4, 2 and 1 (see
    ``_sgemm_jit.conv_tileR``), over blocks of ``cb`` input channels (the later blocks add to
    the sums: a block's inputs stay in L1 while every output channel passes over them)."""
    nt = taps.shape[0]
    wrow = c * nt
    for c0 in range(0, c, cb):
        nk = min(cb, c - c0)
        acc = np.int64(c0 > 0)
        xo = xoff + c0 * xstride
        wo = c0 * nt
        co = 0
        while co + 6 <= m:
            conv_tile6(out, ooff + co * ostride, ostride, x, xo, xstride, w, co * wrow + wo, wrow, nt, nk, taps, acc)
            co += 6
        if co + 4 <= m:
            conv_tile4(out, ooff + co * ostride, ostride, x, xo, xstride, w, co * wrow + wo, wrow, nt, nk, taps, acc)
            co += 4
        if co + 2 <= m:
            conv_tile2(out, ooff + co * ostride, ostride, x, xo, xstride, w, co * wrow + wo, wrow, nt, nk, taps, acc)
            co += 2
        if co < m:
            conv_tile1(out, ooff + co * ostride, ostride, x, xo, xstride, w, co * wrow + wo, wrow, nt, nk, taps, acc)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def conv_shift(x, w, y, taps, lead, c, plane, wp, wo, rows, cb, bias, codes, params, res, post_codes, post_params, chan, i0, i1):
    """Bands ``i0 <= i < i1`` of a one-group, stride-1 convolution computed straight from the
    (padded) input, no im2col, with :func:`bias_act`'s epilogue (same arguments) in the same
    pass.  In an input plane padded to rows of ``wp`` floats, output position ``(oh, ow)`` reads
    ``oh * wp + ow + taps[t]`` for tap ``t`` (``taps[t] = kh*dh*wp + kw*dw``); so in the
    flattened coordinates ``p = oh * wp + ow`` a tile of ``TILE`` consecutive positions is, per
    tap and input channel, ``TILE`` consecutive floats of the input.  The micro-kernel
    (``_sgemm_jit.conv_tileR``) keeps 6 channels x ``TILE`` positions of sums in registers over
    every tap and channel; the input channels' next tiles are prefetched (one stream per channel:
    too many for the hardware prefetcher, measured 1.5x slower without).

    A band is ``rows`` output rows of one image: its tiles go to a small scratch (M x the band's
    positions), then its valid positions (``ow < wo``) to ``y`` with the bias, activations and
    residual while the band is still in cache: one pass over ``y``, and no output-sized scratch
    in padded-width rows.

    ``x`` (N * C * plane,) the padded input; ``w`` (M * C * taps,) the weight as packed
    (M, C, kh, kw); ``y`` (N, M, ho * wo), ``wo <= wp``.  Band ``i`` is image ``i // bands``,
    output rows from ``(i % bands) * rows``.  A tile that would read past its image's planes (the last one, when
    partial) reads a zero-filled copy of its inputs instead.
    """
    m = y.shape[1]
    ho = y.shape[2] // wo
    span = (ho - 1) * wp + wo  # the flattened positions up to the last output
    bands = (ho + rows - 1) // rows
    last = taps.max()  # the farthest tap (a stride-2 conv's phases do not list it last)
    reach = TILE + last
    bstride = (rows * wp + TILE - 1) // TILE * TILE
    bbuf = np.empty(m * bstride, np.float32)
    tail = np.empty(0, np.float32)
    tbuf = np.empty(0, np.float32)
    for it in range(i0, i1):
        img = it // bands
        r0 = (it - img * bands) * rows
        r1 = min(ho, r0 + rows)
        b0 = r0 * wp
        b1 = min(span, (r1 - 1) * wp + wo)
        xbase = img * c * plane
        for p0 in range(b0, b1, TILE):
            # Positions past the last output read on into the next channel's plane (or the
            # caller's slack after the last one): values no output keeps.  A copy only where a
            # tile would read past the end of ``x``.
            if xbase + (c - 1) * plane + p0 + reach <= x.shape[0]:
                for ci in range(c):
                    for o in lead:
                        prefetch(x, xbase + ci * plane + p0 + o)
                _shift_tile(x, xbase + p0, plane, w, taps, c, cb, m, bbuf, p0 - b0, bstride)
                continue
            if tail.shape[0] == 0:
                tail = np.empty(c * reach, np.float32)
                tbuf = np.empty(m * TILE, np.float32)
            have = min(reach, plane - p0)
            for ci in range(c):
                src = xbase + ci * plane + p0
                for q in range(have):
                    tail[ci * reach + q] = x[src + q]
                for q in range(have, reach):
                    tail[ci * reach + q] = _F0
            _shift_tile(tail, 0, reach, w, taps, c, cb, m, tbuf, 0, TILE)
            for co in range(m):
                for q in range(b1 - p0):
                    bbuf[co * bstride + p0 - b0 + q] = tbuf[co * TILE + q]
        for co in range(m):
            row = y[img, co, r0 * wo:r1 * wo]
            src = co * bstride
            # Unsigned indices: with signed ones numba wraps every index that might be negative
            # and the row copies do not vectorize (measured on the wake-word's 24-channel 1x3
            # conv, 16 x 74x32 outputs in rows of 32: 4.6 -> 3.7 ms a call, the tiles alone 2.6).
            if wp == wo:
                s = np.uint64(src)
                for q in range(np.uint64((r1 - r0) * wo)):
                    row[q] = bbuf[s + q]
            else:
                for r in range(r1 - r0):
                    d = np.uint64(r * wo)
                    s = np.uint64(src + r * wp)
                    for q in range(np.uint64(wo)):
                        row[d + q] = bbuf[s + q]
        bias_act_rows(y, img, r0 * wo, (r1 - r0) * wo, bias, codes, params, res, post_codes, post_params, chan)


@njit(inline="always", fastmath=_FM_SUM, error_model="numpy")
def _dots4x3(w, m, c0, c1, c2, y, n, p):
    """Rows ``m .. m+3`` of ``w`` dotted with the columns ``c0, c1, c2`` into ``y[n, m.., p..p+2]``:
    twelve sums over one pass of the four rows (each weight and column element loaded once for
    three or four products)."""
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = a22 = a30 = a31 = a32 = np.float32(0.0)
    for q in range(c0.shape[0]):
        x0, x1, x2 = c0[q], c1[q], c2[q]
        v, u, s, r = w0[q], w1[q], w2[q], w3[q]
        a00 += v * x0
        a01 += v * x1
        a02 += v * x2
        a10 += u * x0
        a11 += u * x1
        a12 += u * x2
        a20 += s * x0
        a21 += s * x1
        a22 += s * x2
        a30 += r * x0
        a31 += r * x1
        a32 += r * x2
    y[n, m, p], y[n, m, p + 1], y[n, m, p + 2] = a00, a01, a02
    y[n, m + 1, p], y[n, m + 1, p + 1], y[n, m + 1, p + 2] = a10, a11, a12
    y[n, m + 2, p], y[n, m + 2, p + 1], y[n, m + 2, p + 2] = a20, a21, a22
    y[n, m + 3, p], y[n, m + 3, p + 1], y[n, m + 3, p + 2] = a30, a31, a32


@njit(inline="always", fastmath=_FM_SUM, error_model="numpy")
def _dots4x2(w, m, c0, c1, y, n, p):
    """:func:`_dots4x3` for two columns."""
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = np.float32(0.0)
    for q in range(c0.shape[0]):
        x0, x1 = c0[q], c1[q]
        v, u, s, r = w0[q], w1[q], w2[q], w3[q]
        a00 += v * x0
        a01 += v * x1
        a10 += u * x0
        a11 += u * x1
        a20 += s * x0
        a21 += s * x1
        a30 += r * x0
        a31 += r * x1
    y[n, m, p], y[n, m, p + 1] = a00, a01
    y[n, m + 1, p], y[n, m + 1, p + 1] = a10, a11
    y[n, m + 2, p], y[n, m + 2, p + 1] = a20, a21
    y[n, m + 3, p], y[n, m + 3, p + 1] = a30, a31


@njit(inline="always", fastmath=_FM_SUM, error_model="numpy")
def _dots4x1(w, m, c0, y, n, p):
    """:func:`_dots4x3` for one column."""
    w0, w1, w2, w3 = w[m], w[m + 1], w[m + 2], w[m + 3]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for q in range(c0.shape[0]):
        x0 = c0[q]
        a0 += w0[q] * x0
        a1 += w1[q] * x0
        a2 += w2[q] * x0
        a3 += w3[q] * x0
    y[n, m, p], y[n, m + 1, p], y[n, m + 2, p], y[n, m + 3, p] = a0, a1, a2, a3


@njit(cache=True, fastmath=_FM_SUM, nogil=True, error_model="numpy")
def _tiny_products(x, idx, w, y):
    """``y[n, m, p] = sum_q w[m, q] * x[n, idx[q, p]]`` (see :func:`conv_tiny`): per image, the
    columns gathered into contiguous scratch, then four weight rows at a time against up to three
    columns at a time (:func:`_dots4x3`: each weight row read once per three positions, twelve
    sums in flight; one dot product at a time ran Silero VAD's STFT, 258 x 256 x 3, in 9.8 us, this
    in 5.1, its first encoder conv, 128 x 387 x 3, 7.3 -> 4.0), the last rows one at a time."""
    n_, size = x.shape
    q_, p_ = idx.shape
    m_ = w.shape[0]
    cols = np.empty((p_, q_), np.float32)
    for n in range(n_):
        xn = x[n]
        for q in range(q_):
            for p in range(p_):
                i = idx[q, p]
                cols[p, q] = xn[i] if i < size else np.float32(0.0)
        m = 0
        while m + 4 <= m_:
            p = 0
            while p + 3 <= p_:
                _dots4x3(w, m, cols[p], cols[p + 1], cols[p + 2], y, n, p)
                p += 3
            if p_ - p == 2:
                _dots4x2(w, m, cols[p], cols[p + 1], y, n, p)
            elif p_ - p == 1:
                _dots4x1(w, m, cols[p], y, n, p)
            m += 4
        for m in range(m, m_):
            wm = w[m]
            for p in range(p_):
                cp = cols[p]
                acc = np.float32(0.0)
                for q in range(q_):
                    acc += wm[q] * cp[q]
                y[n, m, p] = acc


# At most this many output positions per work item of conv_windows (16 tiles of 6): an item's
# sums (positions x 64 floats, 24 KB) stay in L1 while the panel's blocks of KC taps pass.
WIN_BLOCK = 96


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _transpose(dst, doff, ds, src, soff, ss, rows, cols, bias, boff):
    """``dst[doff + c * ds + r] = src[soff + r * ss + c]`` (plus ``bias[boff + c]`` when ``bias``
    is not empty) for ``r < rows``, ``c < cols``, flat float32 arrays: a panel item's sums
    (positions x 64 channels in the scratch) written into the (M, P) output, or the residual's
    block read into the scratch's layout.  Whole blocks of ``LANES`` x ``LANES`` are transposed in
    registers (:func:`._sgemm_jit.tstore`), the rest element by element (the same values, the
    same one addition of the bias)."""
    fr = rows - rows % LANES
    fc = cols - cols % LANES
    has_bias = bias.shape[0] > 0
    for cb in range(0, fc, LANES):
        for rb in range(0, fr, LANES):
            if has_bias:
                tstore_bias(dst, doff + cb * ds + rb, ds, src, soff + rb * ss + cb, ss, bias, boff + cb)
            else:
                tstore(dst, doff + cb * ds + rb, ds, src, soff + rb * ss + cb, ss)
    for c in range(cols):
        d = doff + c * ds
        r0 = fr if c < fc else 0
        if has_bias:
            b = bias[boff + c]
            for r in range(r0, rows):
                dst[d + r] = src[soff + r * ss + c] + b
        else:
            for r in range(r0, rows):
                dst[d + r] = src[soff + r * ss + c]


@njit(error_model="numpy")
def _scratch_affine(sv, ni, a, b):
    """``sv[i, j] * a[j] + b[j]`` over an item's sums (``ni`` positions x 64 channels) as a
    product, then a sum: :func:`_channel_affine`'s two roundings, channel by column."""
    for i in range(ni):
        o = i * 64
        for j in range(64):
            sv[o + j] = sv[o + j] * a[j]
    for i in range(ni):
        o = i * 64
        for j in range(64):
            sv[o + j] = sv[o + j] + b[j]


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _scratch_steps(sv, ni, c0, nj, cl, pl, chan, arow, brow):
    """:func:`bias_act_rows`' steps ``cl`` / ``pl`` over an item's sums in the scratch (``ni``
    positions x 64 channels from ``c0``, ``nj`` of them real): the activations over the whole
    item at once, a per-channel step (code 11: table ``chan[k]``) with its 64 channels' factors
    and offsets laid out as a row (zeros past M), in the steps' order."""
    if cl.shape[0] == 0:
        return
    if chan.shape[0] == 0:
        acts_plane(sv, cl, pl)
        return
    for s in range(cl.shape[0]):
        if cl[s] == 11:
            k = int(pl[s, 0])
            for j in range(64):
                arow[j] = chan[k, c0 + j, 0] if j < nj else _F0
                brow[j] = chan[k, c0 + j, 1] if j < nj else _F0
            _scratch_affine(sv, ni, arow, brow)
        else:
            act_one(sv, cl[s], pl[s, 0], pl[s, 1], pl[s, 2])


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _panel_items(x, w, y, stride, bases, koffs, bias, codes, params, res, post_codes, post_params, chan, block,
                 i0, i1):
    """The work items of :func:`conv_windows` (``koffs`` empty: row ``r`` of the product is the
    window at ``r * stride``) and of :func:`conv_bcast` (row ``r``, element ``k`` at ``bases[r] +
    koffs[k]``): per item, ``KC`` rows of the panel a block, tiles of 6, 4, 2 or 1 positions by
    ``TILE`` channels into the scratch, then the bias and, when there is one, the epilogue
    (:func:`bias_act_rows`' arguments) on the item's sums while they are in cache, in the
    thread that computed them, and the sums written transposed into ``y`` (:func:`_transpose`)."""
    n_, m_, p_ = y.shape
    npan = -(-m_ // 64)
    k_ = w.shape[0] // npan
    nblk = -(-p_ // block)
    wf = w.reshape(-1)
    scr = np.empty(block * 64, np.float32)
    gathered = koffs.shape[0] > 0
    epilogue = codes.shape[0] > 0 or res.shape[0] > 0 or post_codes.shape[0] > 0
    # The epilogue runs on the scratch (see below); the residual's block is read into a second
    # one in the scratch's layout (zeros past M).
    has_res = res.shape[0] > 0
    yf = y.reshape(-1)
    rf = res.reshape(-1)
    rsc = np.zeros(block * 64 if epilogue and has_res else 0, np.float32)
    arow = np.zeros(64, np.float32)
    brow = np.zeros(64, np.float32)
    for item in range(i0, i1):
        pan = item % npan
        blk = (item // npan) % nblk
        n = item // (npan * nblk)
        xn = x[n]
        c0 = pan * 64
        r0 = blk * block
        r_end = min(p_, r0 + block)
        nj = min(64, m_ - c0)
        # A last panel whose channels end within its first HALF columns computes only those.
        cw = 64 if nj > HALF else HALF
        step = min(TILE, cw)
        half = step < TILE  # (AVX-512: the half-width tiles; AVX2: two 16-column tiles instead of four)
        for k0 in range(0, k_, KC):
            nk = min(KC, k_ - k0)
            acc = 1 if k0 > 0 else 0
            r = r0
            while r < r_end:
                left = r_end - r
                rows = 6 if left >= 6 else (4 if left >= 4 else (2 if left >= 2 else 1))
                so = (r - r0) * 64
                for c in range(0, cw, step):
                    woff = (pan * k_ + k0) * 64 + c
                    if gathered and half:
                        if rows == 6:
                            gtile6h(scr, so + c, 64, wf, woff, 64, xn, bases, r, koffs, k0, nk, acc)
                        elif rows == 4:
                            gtile4h(scr, so + c, 64, wf, woff, 64, xn, bases, r, koffs, k0, nk, acc)
                        elif rows == 2:
                            gtile2h(scr, so + c, 64, wf, woff, 64, xn, bases, r, koffs, k0, nk, acc)
                        else:
                            gtile1h(scr, so + c, 64, wf, woff, 64, xn, bases, r, koffs, k0, nk, acc)
                    elif gathered:
                        if rows == 6:
                            gtile6(scr, so + c, 64, wf, woff, 64, xn, bases, r, koffs, k0, nk, acc)
                        elif rows == 4:
                            gtile4(scr, so + c, 64, wf, woff, 64, xn, bases, r, koffs, k0, nk, acc)
                        elif rows == 2:
                            gtile2(scr, so + c, 64, wf, woff, 64, xn, bases, r, koffs, k0, nk, acc)
                        else:
                            gtile1(scr, so + c, 64, wf, woff, 64, xn, bases, r, koffs, k0, nk, acc)
                    elif half:
                        if rows == 6:
                            _tile6h(scr, so + c, 64, wf, woff, 64, xn, r * stride + k0, stride, nk, acc, 0, 0)
                        elif rows == 4:
                            _tile4h(scr, so + c, 64, wf, woff, 64, xn, r * stride + k0, stride, nk, acc, 0, 0)
                        elif rows == 2:
                            _tile2h(scr, so + c, 64, wf, woff, 64, xn, r * stride + k0, stride, nk, acc, 0, 0)
                        else:
                            _tile1h(scr, so + c, 64, wf, woff, 64, xn, r * stride + k0, stride, nk, acc, 0, 0)
                    elif rows == 6:
                        _tile6(scr, so + c, 64, wf, woff, 64, xn, r * stride + k0, stride, nk, acc, 0, 0)
                    elif rows == 4:
                        _tile4(scr, so + c, 64, wf, woff, 64, xn, r * stride + k0, stride, nk, acc, 0, 0)
                    elif rows == 2:
                        _tile2(scr, so + c, 64, wf, woff, 64, xn, r * stride + k0, stride, nk, acc, 0, 0)
                    else:
                        _tile1(scr, so + c, 64, wf, woff, 64, xn, r * stride + k0, stride, nk, acc, 0, 0)
                r += rows
        ni = r_end - r0
        if cw < 64:  # (the columns not computed: zeros, as the panel's padding gives the others)
            for i in range(ni):
                for j in range(cw, 64):
                    scr[i * 64 + j] = _F0
        at = (n * m_ + c0) * p_ + r0
        if not epilogue:
            _transpose(yf, at, p_, scr, 0, 64, ni, nj, bias, c0)
            continue
        # The epilogue on the item's sums in the scratch, position by position (64 contiguous
        # channels each: one pass over the item, not one call per channel's short row: ~60 ns a
        # row, 192 <- 32 1x1 conv on a 28x28 map with a Clip 125 -> 54 us), then the transposed
        # store.  Columns past M hold zero sums (the panel's padding) and are not stored.
        sv = scr[:ni * 64]
        if bias.shape[0] > 0:
            # (the item's 64 biases in a local row, zeros past M, and 64-float runs: indexing
            # the bias and a run of nj floats took ~0.26 ns an element, this ~0.04)
            for j in range(64):
                brow[j] = bias[c0 + j] if j < nj else _F0
            for i in range(ni):
                o = i * 64
                for j in range(64):
                    sv[o + j] += brow[j]
        _scratch_steps(sv, ni, c0, nj, codes, params, chan, arow, brow)
        if has_res:
            _transpose(rsc, 0, 64, rf, at, p_, nj, ni, _NO_BIAS, 0)
            for q in range(ni * 64):
                sv[q] += rsc[q]
            _scratch_steps(sv, ni, c0, nj, post_codes, post_params, chan, arow, brow)
        _transpose(yf, at, p_, scr, 0, 64, ni, nj, _NO_BIAS, 0)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def conv_windows(x, w, y, stride, bias, block, i0, i1):
    """Work items ``i0 .. i1`` of a 1-D convolution of one input channel by a kernel of ``K``
    taps: ``y[n, m, p] = sum_k W[m, k] * x[n, p * stride + k] (+ bias[m])``.

    ``x`` (N, L) the images (padded: every window inside), ``w`` (ceil(M / 64) * K, 64) the
    weight packed by ``conv.pack_windows`` (per 64 output channels, K rows of 64, zeros past M),
    ``y`` (N, M, P) float32, ``bias`` (M,) or empty.  An item is one image's 64 output channels
    over ``block`` positions (a multiple of 6, at most ``WIN_BLOCK``; item = (image * blocks +
    block) * panels + panel).

    Why: a window of the input is a row of the im2col matrix, ``stride`` floats after the
    previous one, so the product ``windows @ W^T`` reads the input where it is: the micro-kernel
    of :mod:`._sgemm_jit` (``_tileR``) broadcasts ``x`` along a window and multiplies it with a
    panel row, 6 positions x 64 channels of sums in registers, a block of ``KC`` taps at a time
    (the panel's block stays in L1 while the item's tiles pass over it; the sums wait in a
    scratch between blocks); the item's sums are then written transposed (with the bias) into
    ``y``.  Measured one thread, a mel-spectrogram's 257 x 512 taps at stride 160 over 16,000
    samples (97 positions): ~180 us against ~200 for OpenBLAS on the im2col matrix, which took
    ~30 us more to build.  Each output is one chain of fused multiply-adds over the taps in
    order (the blocks continue it from the scratch)."""
    _panel_items(x, w, y, stride, _NO_OFFSETS, _NO_OFFSETS, bias, _NO_OFFSETS, _NO_PARAMS, _NO_RES, _NO_OFFSETS,
                 _NO_PARAMS, _NO_CHAN, block, i0, i1)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def conv_bcast(x, w, y, bases, koffs, bias, codes, params, res, post_codes, post_params, chan, block, i0, i1):
    """Work items ``i0 .. i1`` of a 2-D convolution of one group with its output channels
    vectorized: ``y[n, m, p] = sum_k W[m, k] * x[n, bases[p] + koffs[k]] (+ bias[m])``.

    ``x`` (N, C * plane) the padded images, flat; ``w`` (ceil(M / 64) * K, 64) the weight
    (M, C, KH, KW) as ``conv.pack_windows`` packs its (M, C * KH * KW) matrix (per 64 output
    channels, K rows of 64, zeros past M); ``bases`` (P,) where output position ``p``'s window
    starts in an image, ``koffs`` (K,) where its k-th (input channel, tap) sits from there
    (strides in ``bases``, dilations in ``koffs``); ``y`` (N, M, P) float32, ``bias`` (M,) or
    empty; then :func:`bias_act`'s epilogue after the bias (activations, residual like ``y`` or
    empty, activations, per-channel tables), run on each item's sums before they are stored.  An
    item is one image's 64 output channels over ``block`` positions (item = (image * blocks +
    block) * panels + panel), as :func:`conv_windows`'.

    Why: onnxruntime's NCHWc convolutions vectorize over output channels, so every lane works
    whatever the map's size; conv_shift's tiles of 64 positions are 77 % filled on a 7x7 map (49
    of 64) and Winograd needs enough tiles.  Here the micro-kernel of :mod:`._sgemm_jit`
    broadcasts one input value per output position (gathered: ``gtileR``) against a panel row
    of 64 channels, 6 positions x 64 channels of sums in registers, ``KC`` (channel, tap) pairs
    a block; the sums are written transposed into ``y`` (:func:`_transpose`).  Each output is one
    chain of fused multiply-adds over k in order, so the bits do not depend on the items' split."""
    _panel_items(x, w, y, 0, bases, koffs, bias, codes, params, res, post_codes, post_params, chan, block, i0, i1)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def conv_tiny(x, idx, w, y, bias, codes, params, res, post_codes, post_params, chan):
    """A convolution with a handful of output positions as dot products (:func:`_tiny_products`):
    ``y[n, m, p] = sum_q w[m, q] * x[n, idx[q, p]]`` (``idx[q, p] == x.shape[1]`` reads a zero:
    the padding), ``x`` (N, L) the images flattened, ``idx`` (C * taps, P) the column matrix's
    gather indices (``conv._gather_index``), ``w`` (M, C * taps), ``y`` (N, M, P) float32; then
    the epilogue of :func:`bias_act` (same arguments) in the same call.

    Why: Silero VAD's convolutions end in 1-3 output positions (an STFT of 256 taps at stride
    128 over 576 samples, then 3-tap convs over 3, 2, 1 frames); as im2col + GEMM each is a BLAS
    call with N = 1..3, which OpenBLAS runs at a sixth of its speed (258 x 256 x 3: 35 us, this
    loop 16 us with the gather included, 6 us since four weight rows share a pass).  The column
    is gathered once per position into contiguous scratch and each dot product is vectorized over
    the taps (``reassoc``: partial sums per lane, as BLAS's kernels keep them; NaN and Inf still
    propagate).
    """
    _tiny_products(x, idx, w, y)
    bias_act(y, bias, codes, params, res, post_codes, post_params, chan)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def bias_act(y, bias, codes, params, res, post_codes, post_params, chan):
    """``y[n, m, :] = post(pre(y[n, m, :] + bias[m]) + res[n, m, :])`` in place, row by row.

    ``y`` (N, M, L) float32; ``bias`` (M,) or empty (no bias); ``codes``/``params`` the
    activations before the residual, ``res`` like ``y`` or empty (no residual), ``post_*`` the
    activations after it; ``chan`` (K, M, 2) the per-channel steps' tables (code 11).

    Without per-channel steps (the common case) the rows' arithmetic is written out here, the
    activation code inlined: a row's view handed to an inlined helper with the other arrays cost
    ~60 ns a row whatever the row's length — measured 15-17 us of a 17 us call on Silero VAD's
    258 x 3 STFT output, 6 us with this loop (two copies of the activation code, one per list:
    one copy shared by both lists through a loop over them ran 1.5-2x slower on those rows).
    With them, each image calls :func:`bias_act_rows` (compiled once, shared with
    :func:`conv_shift`).
    """
    n_, m_, l_ = y.shape
    if chan.shape[0] == 0:
        has_bias = bias.shape[0] > 0
        has_res = res.shape[0] > 0
        for nm in range(n_ * m_):
            n = nm // m_
            m = nm - n * m_
            row = y[n, m]
            if has_bias:
                bv = bias[m]
                for i in range(l_):
                    row[i] += bv
            _acts(row, codes, params)
            if has_res:
                rr = res[n, m]
                for i in range(l_):
                    row[i] += rr[i]
                _acts(row, post_codes, post_params)
        return
    for n in range(n_):
        # (np.int64(0), not 0: a literal 0 would make numba compile bias_act_rows a second time)
        bias_act_rows(y, n, np.int64(0), l_, bias, codes, params, res, post_codes, post_params, chan)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def bias_act_rows(y, n, at, length, bias, codes, params, res, post_codes, post_params, chan):
    """:func:`bias_act`'s epilogue over positions ``at .. at + length`` of every output channel of
    image ``n`` of ``y`` (N, M, L): the epilogue of a :func:`conv_shift` band, of a split GEMM's
    column block and of :func:`bias_act` with per-channel steps (code 11: ``row * chan[k, m, 0] +
    chan[k, m, 1]``, ``k = params[j, 0]``).  One call a band, not one a channel: a call passes
    eleven arrays, each counted in and out, ~120 ns a call with nothing to compute (the
    wake-word's 24-channel 1x3 conv made 4,224 such calls a run).

    Each row is the bias, the activations before the residual, the residual, the ones after:
    without per-channel steps a call of :func:`acts_plane` per list, with them a call of
    :func:`act_one` (or the channel's affine) per step — calls, not inlined copies of the
    activation code (each copy costs ~5-8 s of LLVM time on a machine's first run), and none
    handed this call's eleven arrays: an inlined helper taking them cost ~130 ns a row
    (measured: 64 rows x 256 positions in two blocks 26 -> 11 us; a QDQ chain of fake
    quantizations around a BatchNormalization on 2,048 rows x 49 positions 507 -> 219 us)."""
    has_bias = bias.shape[0] > 0
    has_res = res.shape[0] > 0
    plain = chan.shape[0] == 0
    for m in range(y.shape[1]):
        row = y[n, m, at:at + length]
        if has_bias:
            bv = bias[m]
            for i in range(length):
                row[i] += bv
        for phase in range(2 if has_res else 1):
            if phase == 1:
                rr = res[n, m, at:at + length]
                for i in range(length):
                    row[i] += rr[i]
            cl = codes if phase == 0 else post_codes
            pl = params if phase == 0 else post_params
            if plain:
                acts_plane(row, cl, pl)
                continue
            for j in range(cl.shape[0]):
                if cl[j] == 11:
                    k = int(pl[j, 0])
                    _channel_affine(row, chan[k, m, 0], chan[k, m, 1])
                else:
                    act_one(row, cl[j], pl[j, 0], pl[j, 1], pl[j, 2])


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def rows_act(y, bias, codes, params, res, post_codes, post_params, r0, r1):
    """``y[r, :] = post(pre(y[r, :] + bias) + res[r, :])`` in place for rows ``r0 <= r < r1``.

    ``y`` (R, N) float32 (a GEMM's output); ``bias`` (N,) or empty; ``res`` (R, N) or empty.
    """
    n = y.shape[1]
    has_bias = bias.shape[0] > 0
    has_res = res.shape[0] > 0
    for r in range(r0, r1):
        row = y[r]
        if has_bias:
            for i in range(n):
                row[i] += bias[i]
        for phase in range(2 if has_res else 1):  # one copy of the activation code (see bias_act)
            if phase == 1:
                rr = res[r]
                for i in range(n):
                    row[i] += rr[i]
            _acts(row, codes if phase == 0 else post_codes, params if phase == 0 else post_params)


_EXP_BITS = np.int32(0x7F800000)  # a float32's exponent field


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def wino_input(x, v, ph, pw, th, tw, p0, p1, bad):
    """Winograd F(2x2, 3x3) input transform ``V = B^T d B`` of every 4x4 tile, planes ``p0..p1``.

    ``x`` (N, C, H, W) float32; ``v`` (16, C, N*th*tw): row ``4a + b`` holds element (a, b) of
    the transformed tile; tile (i, j) of image n starts at padded row 2i, column 2j (``ph``/``pw``
    zeros in front).  Each plane is copied once into a zeroed scratch of the padded size; then
    per tile row four full-width row combinations (``B^T`` on rows) and per tile column the
    column combinations, all loops over contiguous or stride-2 data.

    ``bad[0]`` is set to 1 when a plane holds an infinity or a NaN: the transforms subtract
    inputs, so one infinity becomes NaN across its tiles (and a NaN spreads to every output of
    its tiles) where a direct convolution keeps it to the outputs that read it; the caller then
    convolves directly (found by a differential fuzz against onnxruntime).
    """
    n_, c_, h_, w_ = x.shape
    xbits = x.view(np.int32)
    hp = 2 * th + 2
    wp = 2 * tw + 2
    pl = np.zeros((hp, wp), dtype=np.float32)
    t0 = np.empty(wp, dtype=np.float32)
    t1 = np.empty(wp, dtype=np.float32)
    t2 = np.empty(wp, dtype=np.float32)
    t3 = np.empty(wp, dtype=np.float32)
    rows = min(h_, hp - ph)
    cols = min(w_, wp - pw)
    for p in range(p0, p1):
        n = p // c_
        c = p - n * c_
        top = 0  # the largest exponent field seen: all ones for an infinity or a NaN
        for r in range(rows):
            dst = pl[r + ph, pw:pw + cols]
            src = x[n, c, r, 0:cols]
            bits = xbits[n, c, r, 0:cols]
            for q in range(cols):
                dst[q] = src[q]
                top = max(top, bits[q] & _EXP_BITS)  # an integer max: the copy still vectorizes
        if top == _EXP_BITS:
            bad[0] = 1
        base0 = n * th * tw
        for i in range(th):
            r0 = pl[2 * i]
            r1 = pl[2 * i + 1]
            r2 = pl[2 * i + 2]
            r3 = pl[2 * i + 3]
            for q in range(wp):
                t0[q] = r0[q] - r2[q]
                t1[q] = r1[q] + r2[q]
                t2[q] = r2[q] - r1[q]
                t3[q] = r1[q] - r3[q]
            base = base0 + i * tw
            for a in range(4):
                t = t0 if a == 0 else (t1 if a == 1 else (t2 if a == 2 else t3))
                o0 = v[4 * a, c, base:base + tw]
                o1 = v[4 * a + 1, c, base:base + tw]
                o2 = v[4 * a + 2, c, base:base + tw]
                o3 = v[4 * a + 3, c, base:base + tw]
                for j in range(tw):
                    e0 = t[2 * j]
                    e1 = t[2 * j + 1]
                    e2 = t[2 * j + 2]
                    e3 = t[2 * j + 3]
                    o0[j] = e0 - e2
                    o1[j] = e1 + e2
                    o2[j] = e2 - e1
                    o3[j] = e1 - e3
        # the scratch keeps zeros outside the copied rows/columns; the copied part is rewritten
        # by the next plane


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def wino_output(mx, y, bias, codes, params, th, tw, p0, p1):
    """Winograd F(2x2, 3x3) output transform ``Y = A^T M A`` plus bias and activations.

    ``mx`` (16, M, N*th*tw) the batched GEMM's result; ``y`` (N, M, OH, OW); planes
    ``p0 <= n*M + m < p1``.  Two output rows per tile row are built full width in a scratch,
    then cropped into ``y`` with the bias and activations applied row by row.
    """
    n_, m_, oh_, ow_ = y.shape
    s0 = np.empty((4, tw), dtype=np.float32)
    s1 = np.empty((4, tw), dtype=np.float32)
    row0 = np.empty(2 * tw, dtype=np.float32)
    row1 = np.empty(2 * tw, dtype=np.float32)
    for p in range(p0, p1):
        n = p // m_
        m = p - n * m_
        bv = bias[m]
        base0 = n * th * tw
        for i in range(th):
            base = base0 + i * tw
            for b in range(4):
                a0 = mx[b, m, base:base + tw]
                a1 = mx[4 + b, m, base:base + tw]
                a2 = mx[8 + b, m, base:base + tw]
                a3 = mx[12 + b, m, base:base + tw]
                d0 = s0[b]
                d1 = s1[b]
                for j in range(tw):
                    d0[j] = a0[j] + a1[j] + a2[j]
                    d1[j] = a1[j] - a2[j] - a3[j]
            for j in range(tw):
                row0[2 * j] = s0[0, j] + s0[1, j] + s0[2, j] + bv
                row0[2 * j + 1] = s0[1, j] - s0[2, j] - s0[3, j] + bv
                row1[2 * j] = s1[0, j] + s1[1, j] + s1[2, j] + bv
                row1[2 * j + 1] = s1[1, j] - s1[2, j] - s1[3, j] + bv
            for r in range(2 * i, min(2 * i + 2, oh_)):  # one copy of the activation code
                out = y[n, m, r]
                src = row0 if r == 2 * i else row1
                for q in range(ow_):
                    out[q] = src[q]
                _acts(out, codes, params)


_LANES = 16


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _lane_sum(xr, mu, lanes, squares=False):
    """``sum(xr)`` (or ``sum((xr - mu)**2)``) in float64 over ``_LANES`` interleaved partial sums
    (one dependency chain per lane, so the loop vectorizes; a single running sum is a chain of
    ``d`` dependent adds: LayerNorm over (32, 384) took 30 us, onnxruntime 13), then the lanes."""
    d = xr.shape[0]
    for j in range(_LANES):
        lanes[j] = 0.0
    body = d - d % _LANES
    for i in range(0, body, _LANES):
        for j in range(_LANES):
            t = np.float64(xr[i + j] - mu) if squares else np.float64(xr[i + j])
            lanes[j] += t * t if squares else t
    tail = 0.0
    for i in range(body, d):
        t = np.float64(xr[i] - mu) if squares else np.float64(xr[i])
        tail += t * t if squares else t
    total = 0.0
    for j in range(_LANES):
        total += lanes[j]
    return total + tail


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def softmax_rows(x, y, r0, r1):
    """Softmax over the last axis of ``x`` (R, D) float32 into ``y`` (R, D), rows ``r0..r1``:
    ``exp(x - max) / sum``, the exp being :func:`_expf` (within 1 ulp), the sum in float64 lanes
    and the division one float32 division per element as numpy's ``y /= sum``.

    numpy spends ~80 ns per row on each reduction over a short last axis (attention scores of
    16 keys: (2, 12, 16, 16) took 41-80 us, onnxruntime 10).  A row holding NaN or +Inf comes
    out all NaN, as numpy's formula gives (the max ignores NaN here, but the sum is then NaN).
    """
    d = x.shape[1]
    lanes = np.zeros(_LANES, dtype=np.float32)
    sums = np.zeros(_LANES, dtype=np.float64)
    body = d - d % _LANES
    for r in range(r0, r1):
        xr = x[r]
        yr = y[r]
        for j in range(_LANES):
            lanes[j] = -_INF
        for i in range(0, body, _LANES):
            for j in range(_LANES):
                v = xr[i + j]
                lanes[j] = v if v > lanes[j] else lanes[j]
        m = -_INF
        for j in range(_LANES):
            m = lanes[j] if lanes[j] > m else m
        for i in range(body, d):
            m = xr[i] if xr[i] > m else m
        for i in range(d):
            yr[i] = _expf(xr[i] - m)
        total = _lane_sum(yr, _F0, sums)
        t = np.float32(total)
        for i in range(d):
            yr[i] = yr[i] / t


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def layer_norm_rows(x, scale, bias, eps, y, mean_out, inv_out, r0, r1):
    """LayerNormalization over the last axis of ``x`` (R, D) float32 into ``y``, rows ``r0..r1``.

    Mean, then the variance of the centred values (two passes, as the numpy kernel computes
    them, in float32 with float64 sums so long rows lose nothing), then one pass for the scale
    and bias.  ``bias`` may be empty; ``mean_out``/``inv_out`` (R,) receive the statistics.
    """
    d = x.shape[1]
    has_bias = bias.shape[0] > 0
    lanes = np.zeros(_LANES, dtype=np.float64)
    for r in range(r0, r1):
        xr = x[r]
        mu = np.float32(_lane_sum(xr, _F0, lanes) / d)
        inv = np.float32(1.0 / math.sqrt(np.float32(_lane_sum(xr, mu, lanes, True) / d) + eps))
        yr = y[r]
        if has_bias:
            for i in range(d):
                yr[i] = (xr[i] - mu) * inv * scale[i] + bias[i]
        else:
            for i in range(d):
                yr[i] = (xr[i] - mu) * inv * scale[i]
        mean_out[r] = mu
        inv_out[r] = inv


@njit(cache=True, fastmath=_FM_SUM, nogil=True, error_model="numpy")
def rms_rows(x, skip, bias, gamma, eps, y, total, inv_out, r0, r1):
    """RMS normalization of ``x + skip + bias`` over the last axis, float32 rows ``r0..r1``.

    ``x``, ``y`` (R, D); ``skip`` (R, D) or (0, D) for none; ``bias`` (D,) or empty; ``gamma``
    (D,); ``total`` (R, D) receives ``x + skip + bias`` unless it has no rows; ``inv_out`` (R,)
    the reciprocal RMS.  The sum rounds as numpy's ``(x + skip) + bias``; the mean square is
    summed in float64 in any order (``reassoc``: the sum vectorizes; numpy sums float32 pairwise:
    the two agree to an ulp of ``inv``); then
    ``y = (s * inv) * gamma`` as the numpy kernel's two in-place products.  ``y`` may be ``x``.
    """
    d = x.shape[1]
    has_skip = skip.shape[0] > 0
    has_bias = bias.shape[0] > 0
    want_sum = total.shape[0] > 0
    for r in range(r0, r1):
        xr = x[r]
        yr = y[r]
        q = 0.0
        for i in range(d):
            v = xr[i]
            if has_skip:
                v = v + skip[r, i]
            if has_bias:
                v = v + bias[i]
            yr[i] = v
            q += np.float64(v) * np.float64(v)
        if want_sum:
            tr = total[r]
            for i in range(d):
                tr[i] = yr[i]
        inv = np.float32(1.0) / np.float32(math.sqrt(np.float32(np.float32(q / d) + eps)))
        for i in range(d):
            yr[i] = yr[i] * inv * gamma[i]
        inv_out[r] = inv


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def erf_array(x, out):
    """:func:`_erff` over a flat float32 array (tests compare it with ``erf_f32``)."""
    for i in range(x.shape[0]):
        out[i] = _erff(x[i])


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def act_inplace(flat, codes, params):
    """Activations over a flat float32 array in place, in L1-sized pieces."""
    n = flat.shape[0]
    step = 4096
    for s in range(0, n, step):
        _acts(flat[s:min(s + step, n)], codes, params)


@njit(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
def expf_array(x, out):
    """:func:`_expf` over a flat float32 array (for tests of its accuracy)."""
    for i in range(x.shape[0]):
        out[i] = _expf(x[i])


# -- native entry points (see :mod:`._native` and :mod:`._jit_native`) ----------------------------
def native_entries() -> dict:
    """name -> numba cfunc of this module's native entries (see :mod:`._jit_native`):
    ``act_f32`` runs :func:`act_inplace` over the block (address, length, codes address, code
    count, params address: float32 (count, 3)); ``rms_f32`` runs :func:`rms_rows` over every row
    (block: rows, D, then the addresses and row counts of x, skip, bias, gamma, y, total and inv as
    :meth:`._jit_native._Kernels.rms_rows` packs them, eps a float64 in slot 12)."""
    from numba import carray, cfunc

    from onnxpack.session.kernels import _jit_native as L

    def act_f32(blk):
        b = carray(blk, (5,), np.int64)
        flat = carray(as_ptr(b[0], F32), (b[1],))
        codes = carray(as_ptr(b[2], I64), (b[3],))
        params = carray(as_ptr(b[4], F32), (b[3], 3))
        act_inplace(flat, codes, params)

    def rms_f32(blk):
        b = carray(blk, (L.RMS_SLOTS,), np.int64)
        rows, d = b[0], b[1]
        x = carray(as_ptr(b[2], F32), (rows, d))
        skip = carray(as_ptr(b[3], F32), (b[4], d))
        bias = carray(as_ptr(b[5], F32), (b[6],))
        gamma = carray(as_ptr(b[7], F32), (d,))
        y = carray(as_ptr(b[8], F32), (rows, d))
        total = carray(as_ptr(b[9], F32), (b[10], d))
        inv = carray(as_ptr(b[11], F32), (rows,))
        eps = np.float32(carray(blk, (L.RMS_SLOTS,), np.float64)[12])
        rms_rows(x, skip, bias, gamma, eps, y, total, inv, 0, rows)

    sig = types.void(types.voidptr)
    return {name: cfunc(sig, nopython=True, error_model="numpy", fastmath=_FM)(fn)
            for name, fn in (("act_f32", act_f32), ("rms_f32", rms_f32))}


# The unit table of :func:`gemm_act_unit` (int64; ``_spin_jit.U_ARGS`` = 3 header slots first):
# the BLAS's ILP64 cblas_sgemm address, K, A's address and row stride, B's (strides in elements);
# Y's address, M and L (the GEMM's output is Y's (M, L) matrix); the bias's address and length (0: none),
# the activations before the residual (codes' address and count, params' address: (count, 3)
# float32), the residual's address (like Y; 0: none), the activations after it; then per unit
# its block of C: rows r0, r1, columns c0, c1.
(GA_FN, GA_K, GA_A, GA_LDA, GA_B, GA_LDB, GA_Y, GA_M, GA_L, GA_BIAS, GA_NBIAS, GA_CODES, GA_NCODES,
 GA_PARAMS, GA_RES, GA_PCODES, GA_NPCODES, GA_PPARAMS, GA_BLOCKS) = range(3, 22)


@cfunc(types.void(types.CPointer(types.int64), types.int64), cache=True)
def gemm_act_unit(table, u):
    """One block of a split GEMM with a convolution's epilogue (``_act.matmul`` with ``after``
    of :meth:`.conv.Conv._block_epilogue`), computed without the GIL (``_act.run_units``): the
    block's product by the BLAS (the call numpy's matmul makes for it), then its epilogue while
    it is in this core's cache, by :func:`bias_act` on a block of rows, else :func:`bias_act_rows`
    on a block of columns, as ``after`` calls them: the same bits as the split through numpy."""
    t = carray(table, (GA_BLOCKS + 4 * (u + 1),))
    b = GA_BLOCKS + 4 * u
    r0, r1, c0, c1 = t[b], t[b + 1], t[b + 2], t[b + 3]
    lda, ldb = t[GA_LDA], t[GA_LDB]
    m, length, nb = t[GA_M], t[GA_L], t[GA_NBIAS]
    _sgemm(t[GA_FN], r1 - r0, c1 - c0, t[GA_K], t[GA_A] + 4 * r0 * lda, lda, t[GA_B] + 4 * c0, ldb,
           t[GA_Y] + 4 * (r0 * length + c0), length)
    codes = carray(as_ptr(t[GA_CODES], I64), (t[GA_NCODES],))
    params = carray(as_ptr(t[GA_PARAMS], F32), (t[GA_NCODES], 3))
    pcodes = carray(as_ptr(t[GA_PCODES], I64), (t[GA_NPCODES],))
    pparams = carray(as_ptr(t[GA_PPARAMS], F32), (t[GA_NPCODES], 3))
    chan = carray(as_ptr(t[GA_PARAMS], F32), (0, 0, 2))
    res_rows = 1 if t[GA_RES] else 0
    if c1 - c0 == length:  # output channels r0 .. r1
        y = carray(as_ptr(t[GA_Y] + 4 * r0 * length, F32), (1, r1 - r0, length))
        bias = carray(as_ptr(t[GA_BIAS] + 4 * r0, F32), (r1 - r0 if nb else 0,))
        res = carray(as_ptr(t[GA_RES] + 4 * r0 * length, F32), (res_rows, r1 - r0, length))
        bias_act(y, bias, codes, params, res, pcodes, pparams, chan)
    else:  # positions c0 .. c1 of every channel
        y = carray(as_ptr(t[GA_Y], F32), (1, m, length))
        bias = carray(as_ptr(t[GA_BIAS], F32), (nb,))
        res = carray(as_ptr(t[GA_RES], F32), (res_rows, m, length))
        bias_act_rows(y, 0, c0, c1 - c0, bias, codes, params, res, pcodes, pparams, chan)


GEMM_ACT_UNIT = gemm_act_unit.address


# The unit table of :func:`shift_unit` (int64; ``_spin_jit.U_ARGS`` = 3 header slots first): the
# arguments of :func:`conv_shift` as addresses and sizes: ``x`` and ``w`` (float32, flat: address,
# length), ``y`` (address, N, M, L), ``taps`` and ``lead`` (int64: address, length), the six int
# geometry arguments, ``bias`` (address, length), ``codes`` (address, count) and ``params``' address
# ((count, 3) float32), the residual (address, its images: 0 or N; like ``y``), the activations
# after it as before, the per-channel tables (address, K, M: (K, M, 2) float32); then the bands
# per unit and the bands in all.
(SU_X, SU_NX, SU_W, SU_NW, SU_Y, SU_N, SU_M, SU_L, SU_TAPS, SU_NTAPS, SU_LEAD, SU_NLEAD, SU_C, SU_PLANE, SU_WP,
 SU_WO, SU_ROWS, SU_CB, SU_BIAS, SU_NBIAS, SU_CODES, SU_NCODES, SU_PARAMS, SU_RES, SU_NRES, SU_PCODES, SU_NPCODES,
 SU_PPARAMS, SU_CHAN, SU_CHANK, SU_CHANM, SU_PER, SU_COUNT, SU_LEN) = range(3, 37)


@cfunc(types.void(types.CPointer(types.int64), types.int64), cache=True)
def shift_unit(table, u):
    """Bands ``u * per .. (u + 1) * per`` of a :func:`conv_shift` call split over threads without
    the GIL (``_act.run_units``): the call itself on those bands, so the same bits as one thread."""
    t = carray(table, (SU_LEN,))
    i0 = u * t[SU_PER]
    i1 = min(t[SU_COUNT], i0 + t[SU_PER])
    n, m, length = t[SU_N], t[SU_M], t[SU_L]
    x = carray(as_ptr(t[SU_X], F32), (t[SU_NX],))
    w = carray(as_ptr(t[SU_W], F32), (t[SU_NW],))
    y = carray(as_ptr(t[SU_Y], F32), (n, m, length))
    taps = carray(as_ptr(t[SU_TAPS], I64), (t[SU_NTAPS],))
    lead = carray(as_ptr(t[SU_LEAD], I64), (t[SU_NLEAD],))
    bias = carray(as_ptr(t[SU_BIAS], F32), (t[SU_NBIAS],))
    codes = carray(as_ptr(t[SU_CODES], I64), (t[SU_NCODES],))
    params = carray(as_ptr(t[SU_PARAMS], F32), (t[SU_NCODES], 3))
    res = carray(as_ptr(t[SU_RES], F32), (t[SU_NRES], m, length))
    pcodes = carray(as_ptr(t[SU_PCODES], I64), (t[SU_NPCODES],))
    pparams = carray(as_ptr(t[SU_PPARAMS], F32), (t[SU_NPCODES], 3))
    chan = carray(as_ptr(t[SU_CHAN], F32), (t[SU_CHANK], t[SU_CHANM], 2))
    conv_shift(x, w, y, taps, lead, t[SU_C], t[SU_PLANE], t[SU_WP], t[SU_WO], t[SU_ROWS], t[SU_CB], bias, codes,
               params, res, pcodes, pparams, chan, i0, i1)


SHIFT_UNIT = shift_unit.address


# The unit table of :func:`windows_unit` (int64; ``_spin_jit.U_ARGS`` = 3 header slots first): the
# arguments of :func:`conv_windows` or :func:`conv_bcast` as addresses and sizes: ``x`` (address,
# N, L), ``w`` (address, rows), ``y`` (address, M, P: N as x's), conv_windows' stride, ``bias``
# (address, length), the positions per item, conv_bcast's ``bases`` and ``koffs`` (address,
# length: none for conv_windows) and its epilogue as :func:`shift_unit`'s (codes, params, residual,
# post codes and params, channel tables); then the items per unit and the items in all.
(WU_X, WU_N, WU_L, WU_W, WU_NW, WU_Y, WU_M, WU_P, WU_STRIDE, WU_BIAS, WU_NBIAS, WU_BLOCK, WU_BASES, WU_NBASES,
 WU_KOFFS, WU_NKOFFS, WU_CODES, WU_NCODES, WU_PARAMS, WU_RES, WU_NRES, WU_PCODES, WU_NPCODES, WU_PPARAMS, WU_CHAN,
 WU_CHANK, WU_CHANM, WU_PER, WU_COUNT, WU_LEN) = range(3, 33)


@cfunc(types.void(types.CPointer(types.int64), types.int64), cache=True)
def windows_unit(table, u):
    """Items ``u * per .. (u + 1) * per`` of a :func:`conv_windows` or :func:`conv_bcast` call
    split over threads without the GIL (``_act.run_units``): the call itself on those items
    (each output is computed by one item), so the same bits as one thread."""
    t = carray(table, (WU_LEN,))
    i0 = u * t[WU_PER]
    i1 = min(t[WU_COUNT], i0 + t[WU_PER])
    n = t[WU_N]
    x = carray(as_ptr(t[WU_X], F32), (n, t[WU_L]))
    w = carray(as_ptr(t[WU_W], F32), (t[WU_NW], 64))
    y = carray(as_ptr(t[WU_Y], F32), (n, t[WU_M], t[WU_P]))
    bias = carray(as_ptr(t[WU_BIAS], F32), (t[WU_NBIAS],))
    bases = carray(as_ptr(t[WU_BASES], I64), (t[WU_NBASES],))
    koffs = carray(as_ptr(t[WU_KOFFS], I64), (t[WU_NKOFFS],))
    codes = carray(as_ptr(t[WU_CODES], I64), (t[WU_NCODES],))
    params = carray(as_ptr(t[WU_PARAMS], F32), (t[WU_NCODES], 3))
    res = carray(as_ptr(t[WU_RES], F32), (t[WU_NRES], t[WU_M], t[WU_P]))
    pcodes = carray(as_ptr(t[WU_PCODES], I64), (t[WU_NPCODES],))
    pparams = carray(as_ptr(t[WU_PPARAMS], F32), (t[WU_NPCODES], 3))
    chan = carray(as_ptr(t[WU_CHAN], F32), (t[WU_CHANK], t[WU_CHANM], 2))
    _panel_items(x, w, y, t[WU_STRIDE], bases, koffs, bias, codes, params, res, pcodes, pparams, chan, t[WU_BLOCK],
                 i0, i1)


WINDOWS_UNIT = windows_unit.address


# The unit table of :func:`planes_unit` (int64; ``_spin_jit.U_ARGS`` = 3 header slots first): which
# plane kernel (``PK_*``), ``x`` (address, N, C, H, W), ``w`` (address and four dims: the
# depthwise kernels' (C, KH, KW, 1), the direct ones' (M, C, KH, KW)), ``bias`` (address, length),
# ``y`` (address, N, M, OH, OW), the geometry of depthwise2d / conv2d_small (sh, sw, dh, dw, ph,
# pw; unused by the others), ``codes`` (address, count) and ``params``' address ((count, 3)
# float32); then the units and the planes in all.
(PU_KIND, PU_X, PU_N, PU_C, PU_H, PU_W, PU_WT, PU_W0, PU_W1, PU_W2, PU_W3, PU_BIAS, PU_NBIAS, PU_Y, PU_YN, PU_M,
 PU_OH, PU_OW, PU_SH, PU_SW, PU_DH, PU_DW, PU_PH, PU_PW, PU_CODES, PU_NCODES, PU_PARAMS, PU_UNITS, PU_COUNT,
 PU_LEN) = range(3, 33)
# The plane kernels a unit runs (PU_KIND).
PK_DW2D, PK_DW3_SAME, PK_DW5_SAME, PK_DW3_S2, PK_DW5_S2, PK_S2_STEM, PK_SMALL = range(7)


@cfunc(types.void(types.CPointer(types.int64), types.int64), cache=True)
def planes_unit(table, u):
    """Planes ``u * count // units .. (u + 1) * count // units`` of a depthwise or direct
    (``conv2d_small``, ``conv3_s2_small``) call split over threads without the GIL
    (``_act.run_units``): the kernel itself on those planes, each computed by one call as on
    one thread, so the same bits; the blocks' bounds are those of the split through Python
    (``conv._run_items``)."""
    t = carray(table, (PU_LEN,))
    units, count = t[PU_UNITS], t[PU_COUNT]
    i0 = u * count // units
    i1 = (u + 1) * count // units
    kind = t[PU_KIND]
    x = carray(as_ptr(t[PU_X], F32), (t[PU_N], t[PU_C], t[PU_H], t[PU_W]))
    bias = carray(as_ptr(t[PU_BIAS], F32), (t[PU_NBIAS],))
    y = carray(as_ptr(t[PU_Y], F32), (t[PU_YN], t[PU_M], t[PU_OH], t[PU_OW]))
    codes = carray(as_ptr(t[PU_CODES], I64), (t[PU_NCODES],))
    params = carray(as_ptr(t[PU_PARAMS], F32), (t[PU_NCODES], 3))
    if kind >= PK_S2_STEM:
        w4 = carray(as_ptr(t[PU_WT], F32), (t[PU_W0], t[PU_W1], t[PU_W2], t[PU_W3]))
        if kind == PK_S2_STEM:
            conv3_s2_small(x, w4, bias, y, codes, params, i0, i1)
        else:
            conv2d_small(x, w4, bias, y, t[PU_SH], t[PU_SW], t[PU_DH], t[PU_DW], t[PU_PH], t[PU_PW], codes, params,
                         i0, i1)
        return
    w3 = carray(as_ptr(t[PU_WT], F32), (t[PU_W0], t[PU_W1], t[PU_W2]))
    if kind == PK_DW2D:
        depthwise2d(x, w3, bias, y, t[PU_SH], t[PU_SW], t[PU_DH], t[PU_DW], t[PU_PH], t[PU_PW], codes, params, i0, i1)
    elif kind == PK_DW3_SAME:
        depthwise3_same(x, w3, bias, y, codes, params, i0, i1)
    elif kind == PK_DW5_SAME:
        depthwise5_same(x, w3, bias, y, codes, params, i0, i1)
    elif kind == PK_DW3_S2:
        depthwise3_s2(x, w3, bias, y, codes, params, i0, i1)
    else:
        depthwise5_s2(x, w3, bias, y, codes, params, i0, i1)


PLANES_UNIT = planes_unit.address


# One specialization per argument types, whatever the arrays' writability (see _act.one_specialization);
# the parameters named here are arrays the kernels only read.
from onnxpack.session.kernels._act import one_specialization as _act_one_specialization  # noqa: E402

_act_one_specialization(globals(), frozenset({"x", "w", "taps", "bias", "codes", "params", "skip", "gamma", "scale", "mx", "res", "post_codes", "post_params", "chan"}))
