"""Convolutions and pools over NC(D)HW tensors, as GEMMs and a handful of whole-array numpy ops.

Conv is im2col + one BLAS call per group.  im2col is built by a Python loop over *kernel
offsets* (9 for a 3x3 kernel), each a single strided numpy copy of a whole (N, C, out...) slab, so
no loop ever runs per pixel; with the numba kernels, 2-D column matrices are written straight from
the unpadded input instead (``im2col2d``: no padded copy; stride 2 from the input's stride
phases), large ones with few output channels a block of output rows at a time, each block
multiplied while its columns are in L2.  These shapes skip im2col:

* 1x1, unpadded convolutions (a third of resnet50's convs): the input *is* the column matrix
  (strided-sliced first when the stride is > 1), so the conv is one matmul over channels.
* depthwise convolutions (group == C, one output channel per group): a GEMM of inner size
  kh*kw would be dominated by call overhead, so they are kh*kw fused multiply-adds over the whole
  tensor instead.
* with the JIT, one-group stride-1 convs of few channels (``conv_shift``): in the input padded to
  rows of ``wp``, every tap of 16 consecutive output positions (flattened with rows of ``wp``) is
  16 consecutive inputs, so a register-blocked micro-kernel reads them in place.
* everything else: ``cols`` of shape (N, g, C/g*kh*kw, L) and ``np.matmul(W, cols)``, which numpy
  turns into one sgemm per (image, group).

Pre-packing: Conv's weight becomes the per-group GEMM matrix, stored C-contiguous float32 as
``(g, M/g, C/g, *kernel)`` so that it is self-describing (no kernel_shape attribute needed) and
viewed as ``(g, M/g, C/g*prod(kernel))`` for free; half-precision weights are widened once (numpy
has no half BLAS).  ConvTranspose's weight becomes the transposed per-group matrix
``(g, M/g, *kernel, C/g)``, viewed as ``(g, M/g*prod(kernel), C/g)``, which multiplies the input
directly before the col2im scatter.  Half-precision activations are
computed in float32 and the output cast back to the input dtype.

Pools use the same offset loop (``np.maximum`` / ``+=``).  Spatial ranks 1, 2 and 3 share one
implementation.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os
import struct
import threading

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.session.kernels._base import Kernel, PackSpec, TensorInfo, register, register_fused, scratch_releaser
from onnxpack.session.kernels import _act, _winograd
from onnxpack.session.kernels._act import Activation
from onnxpack.session.kernels.linalg import as_compute, compute_dtype
from onnxpack.session.kernels.norm import batch_norm_affine

logger = logging.getLogger(__name__)

__all__ = [
    "Conv",
    "ConvTranspose",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "conv_geometry",
    "im2col",
]

# Version of the packed layouts written by this module (bump when a layout changes).
_PACK_VERSION = 1
# Version of the Winograd pack (filters transformed to (16, M, C) float32).
_WINO_VERSION = 1
# ONNXPACK_WINOGRAD=0 keeps every conv on im2col (to measure what Winograd buys).
_WINOGRAD = os.environ.get("ONNXPACK_WINOGRAD", "1") != "0"
# ONNXPACK_CONV_SHIFT=0 keeps stride-1 convs on im2col + GEMM (to measure what conv_shift buys).
_SHIFT_ON = os.environ.get("ONNXPACK_CONV_SHIFT", "1") != "0"
# A 1-D Conv of one input channel by a long kernel (an STFT written as a Conv: a mel-spectrogram's
# or a VAD's front end) packs its weight transposed in panels of 64 output channels
# (pack_windows) and runs as the product of the input's windows, read in place
# (_conv_jit.conv_windows): from this many taps and output channels (the panels pad M to a
# multiple of 64: at most 1.33x the weight's bytes from 48 channels; 257 -> 320 for the
# spectrograms).  Measured one thread, a mel-spectrogram's two 257 x 512-tap convs at stride 160
# over 16,000 samples: ~180 us each against ~240 through im2col + OpenBLAS.
_WINDOWS_ON = os.environ.get("ONNXPACK_CONV_WINDOWS", "1") != "0"
_WIN_VERSION = 1
_WIN_MIN_TAPS = 32
_WIN_MIN_M = 48
# The direct alternative of a Winograd-packed conv (its filters recovered from U) runs with the
# output channels vectorized (_conv_jit.conv_bcast: the weight in pack_windows' panels, each
# output position's inputs broadcast) where the panels are filled (at least _BCAST_MIN_FILL of
# their lanes) and the sums deep (C * 9 >= _BCAST_MIN_K); measured one thread against
# onnxruntime's NCHWc convs on resnet50's 3x3 shapes: 1.05-1.12x its time, where conv_shift took
# 1.22-1.39x and Winograd 1.26-1.35x (256 -> 256 on 14x14 1145 -> 978 us, 512 -> 512 on 7x7
# 1260 -> 1012).  With idle lanes it loses: YOLOX's 96 -> 96 on 26x26 and 48 -> 48 on 52x52
# (3/4 of the lanes used) 580 -> 720 and 654 -> 790 us against conv_shift (it still beat
# Winograd, the only path it is timed against); 32 -> 16 on 80x80 1.9x conv_shift's time.  A
# last panel of at most _PANEL_HALF channels runs half-width tiles (96 = 64 + 32 fills them:
# YOLOX one thread 1.23x -> 1.20x onnxruntime's time, two threads 1.50x -> 1.34x).
# ONNXPACK_CONV_BCAST=0 keeps conv_shift and im2col there.
# Other one-group 2-D convs under the same rule (1x1 convs from C >= _BCAST_MIN_K_1X1) pack their
# weight in those panels (family conv_bc); the first call of a geometry times conv_bcast against
# the general path (the filters recovered from the panels, let go when conv_bcast is kept): one
# thread, resnet50's 512 <- 256 3x3 stride 2 on 28x28 and 2048 <- 512 1x1 on 7x7 ran 1.05x and
# 1.2x onnxruntime's time against 1.39x and 1.42x (conv_shift over the phases, OpenBLAS).  Since
# the sums are stored transposed in registers and the epilogue runs on them (_conv_jit._transpose),
# 1x1 convs of short sums win too (one thread, isolated, against OpenBLAS and onnxruntime: 960 <-
# 160 on 7x7 64 / 82 / 65 us, 384 <- 64 on 14x14 42 / 51 / 45, 256 <- 64 on 56x56 440 / 523 /
# 460); 192 <- 32 on 28x28 won alone and lost in MobileNetV2 (its Clip: 67 against 61), so 64.
_BCAST_ON = os.environ.get("ONNXPACK_CONV_BCAST", "1") != "0"
_BCAST_VERSION = 1
_BCAST_MIN_FILL = 0.9
_BCAST_MIN_K = 128
_BCAST_MIN_K_1X1 = 64
# The width of the half panel (_sgemm_jit.HALF): a last panel of at most that many channels runs
# tiles of that width (no idle lanes: 160 <- 960 1x1 on 7x7 67 us against OpenBLAS's 86 and
# onnxruntime's 68; 32 <- 192 on 28x28 43 / 59 / 55).
_PANEL_HALF = 32
# With the JIT, a one-group stride-1 conv (1-D or 2-D, more than one tap, not Winograd's) with at
# most _SHIFT_MAX_CHANNELS input and output channels and at most _SHIFT_MAX_TAPS taps per output
# (C * kh * kw) runs conv_shift: tiles of 16 output positions straight from the padded input, no
# im2col.  Measured one thread, side by side with the im2col + GEMM path (conv_shift's time /
# im2col's): wake-word 24 -> 24 1x3 on 16 x 74x32 0.89, 3x1 0.64, 48 -> 48 3x1 on 16 x 36x16
# 0.72, 72 -> 72 1x3 on 16 x 30x8 0.85; 64 -> 64 3x3 on 40x40 0.84, 32 -> 32 5x5 on 40x40 0.68,
# 16 -> 32 5x5 on 80x80 0.75; 1-D 80 -> 80 3 taps over 256 0.93.  Beyond them the tile's inputs
# and the weight outgrow L1 and OpenBLAS's packed GEMM wins: 96 -> 96 1x3 on 40x40 1.17,
# 128 -> 128 3x3 on 20x20 1.30, 64 -> 64 5x5 (1,600 taps) 1.42, 512 -> 512 3 taps 1.30.
_SHIFT_MAX_CHANNELS = 80
_SHIFT_MAX_TAPS = 800
# Those limits are AVX2's (tiles of 16 positions).  With AVX-512 (tiles of 64, and input channels
# in L1-sized blocks) conv_shift wins further, measured the same way on a Sapphire Rapids core
# (3x3 + SiLU, Winograd off): 96 -> 96 3x3 on 40x40 0.60, 64 -> 64 5x5 (1,600 taps) on 40x40
# 0.45, 128 -> 128 5x5 on 20x20 0.96, 128 -> 128 3x3 on 10x10 0.81, 256 -> 64 3x3 on 10x10 0.65;
# then 256 -> 256 3x3 on 28x28 1.07 and 512 -> 512 on 14x14 1.16, but on maps of one tile OpenBLAS
# loses whatever the channels (its GEMM of 49 columns): 512 -> 512 on 7x7 0.82, 1024 -> 1024 on
# 7x7 0.95 (resnet's last stage, which its Winograd pack hands to the direct path: too few tiles).
_SHIFT_MAX_TAPS_WIDE = 1600
_SHIFT_MAX_TAPS_ONE_TILE = 1024 * 9
# Beyond those limits (other machines draw them elsewhere: on an AMD Zen 5 core conv_shift ran
# YOLOv8n's 256 -> 64 3x3 on 10x10, 2,304 taps, in 0.6x im2col's time), a stride-1 conv up to
# this many taps that im2col would run has its first call time both and keeps the faster
# (_act.faster_path; ONNXPACK_SHIFT_TUNE=0: the limits alone).
_SHIFT_TUNED_TAPS = 1024 * 9
_SHIFT_TUNED = os.environ.get("ONNXPACK_SHIFT_TUNE", "1") != "0"
# After this many geometries of one Conv all chose one path, its new geometries take it unmeasured.
_PATH_VOTES = 3
# Stride-2 convs run conv_shift over the input's four stride phases (one group, no dilation) up to
# this many taps per output (C * kh * kw), by the tile width (64 positions with AVX-512, 16 with
# AVX2); beyond, im2col + GEMM.  Measured one thread, 3x3 + SiLU, against im2col + OpenBLAS on the
# same input (phases' time / im2col's): AVX-512 (Sapphire Rapids) 16 -> 32 on 160x160 0.63,
# 32 -> 64 on 80x80 0.65, 64 -> 128 on 40x40 0.69, 128 -> 128 on 20x20 0.60, 128 -> 256 on 20x20
# 0.69, 256 -> 256 on 28x28 0.82, 512 -> 512 on 14x14 0.68; AVX2 code on the same machine
# (OpenBLAS's Haswell kernels): 0.78 / 0.82 / 0.83 / 0.64 / 0.86, then 256 -> 256 1.03 and
# 512 -> 512 1.25.
_S2_MAX_TAPS = {64: 512 * 9, 16: 128 * 9}
_SHIFT_L1 = 24 << 10
_SHIFT_CB = 0  # input channels per block of conv_shift's tiles when set (tests); else from _SHIFT_L1
# Flattened output positions per band of conv_shift's epilogue (its scratch: M x that).  Measured
# on the kernel alone (one thread): the wake-word's 24-channel 1x3 conv 10.0 / 5.6 / 4.5 / 4.1 /
# 5.2 ms at 64 / 128 / 256 / 512 / 1024, a 64-channel 3x3 on 40x40 2.4 / 2.0 / 2.0 / 2.1 / 2.0 ms.
_SHIFT_BAND = 256
# Output channels from which a batch-1 conv_shift with fewer bands than threads (a 7x7 map is one
# band) splits over blocks of its output channels instead (_run_channel_blocks).
_SHIFT_SPLIT_MIN_M = 48
# conv_shift's bands split as a unit job in about this many units a thread (each unit is one call
# of conv_shift, which allocates its band scratch: sixteen a thread lost ~10 % to that on the
# wake-word's convs; one a thread makes the caller wait for a helper that starts late).
_SHIFT_UNITS = 4
# A 3x3 stride-1 conv of C inputs and M outputs that conv_shift can run (the JIT, C and M within
# _SHIFT_MAX_CHANNELS) packs for Winograd only when C*M/(C+M) exceeds this: Winograd's transforms
# cost per channel, its GEMMs per channel pair, and with few channels conv_shift's direct sum wins.
# Measured one thread, conv + SiLU as YOLOv8n has them, shift's time / Winograd's: 16 -> 16 on
# 160x160 0.65, 80x80 0.88, 20x20 0.79; 16 -> 32 on 80x80 0.88; 32 -> 32 0.85-0.96; 16 -> 64 on
# 40x40 0.88; 24 -> 48 1.00 (C*M/(C+M) = 16); 40 -> 40 on 40x40 and 80x80 1.05-1.07 (20);
# 32 -> 64 on 40x40 1.07-1.20 (21); 48 -> 48 on 40x40 and 80x80 1.10; 80 -> 80 on 20x20 1.15.
_WINO_OVER_SHIFT = 18
# Below this many 2x2 output tiles (batch included) a Winograd conv runs as im2col + one GEMM.
_WINO_MIN_TILES = 24
# From that many, its first calls time Winograd against the direct path and keep the faster
# (_act.faster_path): which wins is the machine's (ONNXPACK_WINOGRAD_TUNE=0: always Winograd).
_WINO_TUNED = os.environ.get("ONNXPACK_WINOGRAD_TUNE", "1") != "0"
_EMPTY1 = np.zeros(0, np.float32)
_NO_OFFSETS = np.zeros(0, np.int64)  # conv_windows' (absent) bases and offsets in a unit table
# 2-D float32 MaxPools without indices whose windows span several rows run the JIT's maxpool2d
# (its "zero" argument is this 0.0): measured one thread, kernel vs numpy's padded copy and
# separable passes, the wake-word 2x2 stride-2 pool of 16 x 24 x 72x32 0.22 vs 0.59 ms, 2x2 over
# 32 x 160x160 0.10 vs 0.40, resnet's 3x3 stride 2 over 64 x 112x112 0.37 vs 1.06, YOLOv8n's
# 5x5 over 128 x 10x10 0.095 vs 0.12.  Pools of one row (1x2) keep numpy (0.24 vs 0.20 ms).
_F32_ZERO = np.float32(0.0)
# Depthwise convs of at least this many multiply-adds split their planes over the BLAS's
# thread count (below, a thread hand-off costs more than it saves).
_PARALLEL_MACS = 1 << 18
# One-group 2-D convs with at most this many taps per output (C * KH * KW, KH * KW > 1) run the
# JIT's direct kernel instead of im2col + GEMM: RGB stems (27 taps).  1x1 convs keep the GEMM
# (16->96 on 112x112: 1.44 ms as a GEMM, 2.11 direct).
_DIRECT_TAPS = 27
# ... and at most this many output channels: im2col's copies are shared by every output channel,
# the direct kernel's passes are not.  Measured per stem (direct vs im2col + GEMM): 8 or 16
# outputs 1.4-3x faster (PP-OCR det 3->16 on 480x640 8.8 -> 2.9 ms, PicoDet 800x608 17.0 -> 6.0,
# PP-OCR rec/cls, YOLOv8n, orientation).  Wider ones, once its activations stopped using masked
# stores (see _conv_jit._act_row; before, 24 outputs already lost), Conv + LeakyRelu sessions, one
# thread, direct vs the path they took: wake-word's 1 -> 24 on 16 x 76x32 0.96 vs 2.26 ms (the
# gather), 1 -> 48 1.6 vs 2.8, 1 -> 128 6.1 vs 10.4; 3 -> 32 on 224x224 4.2 vs 5.6, 3 -> 64 8.0 vs
# 10.4, 3 -> 128 15.1 vs 14.9; 3 -> 48 on 112x112 1.42 vs 2.1; 2 -> 32 on 4 x 64x64 1.28 vs 2.34;
# 3 -> 96 on 56x56 0.79 vs 0.63 (lost).  All at stride 1; at stride 2 the direct kernel does not
# win past 16 outputs (3 -> 64 on 224x224 3.0 vs 2.3 ms, 3 -> 32 0.85 vs 0.9, 3 -> 48 and the
# wake-word's 1 -> 48 even), so strided convs keep _DIRECT_MAX_OUT_STRIDED.
_DIRECT_MAX_OUT = 64
_DIRECT_MAX_OUT_STRIDED = 16
# A one-group 3x3 stride-2 conv with one zero of padding in front over an even H x W plane, from
# at most this many input channels to at most this many outputs, runs the JIT's conv3_s2_small
# (the input's stride phases, 9 taps per channel in one pass, no im2col).
_S2_STEM_IN = 3
_S2_STEM_OUT = 64
# A stride-2 3x3 / 5x5 depthwise conv with (K - 1) / 2 zeros of padding in front over an even
# H x W plane runs the JIT's depthwise3_s2 / depthwise5_s2 (the plane split into its four phases,
# one pass over the output: see their docstrings).  Any other strided (or end-cut) one on planes
# of at most this many H * W * taps runs as the one-pass "same" kernel over the whole plane, then
# keeps every stride-th output:
# up to 4x the multiply-adds, but on small planes the phase-scatter kernel's per-row work costs
# more (3x3 + Clip, stride 2, one thread, phase kernel vs same + subsample: 576 x 14x14 269 ->
# 133 us, 192 x 28x28 179 -> 112, 5x5 576 x 14x14 358 -> 226; even at 3x3 40x40 and 5x5 20x20;
# 3x3 112x112 505 -> 909, so large planes keep the phase kernel).
_SUBSAMPLE_MAX = 9 * 1024
# Above this many kernel taps im2col is one strided-window copy, not a copy per tap.
_WINDOW_TAPS = 32
_EMPTY3 = _act.NO_RESIDUAL
_F32 = np.dtype(np.float32)
_EMPTY_CHAN = _act.NO_CHANNELS  # bias_act's per-channel tables when there are none
# conv_tiny's epilogue arguments after the bias when it runs none (codes, params, residual, post
# codes, post params, channel tables).
_NO_EPILOGUE = (*_act.encode(()), _EMPTY3, *_act.encode(()), _EMPTY_CHAN)
_EMPTY5 = np.zeros((0, 0, 0, 0, 0), np.float32)  # im2col2d's stride phases when there are none
# A one-group column matrix of more than twice this many bytes, with at least _COLS_BLOCK_MIN_N
# output positions per output channel, is made and multiplied a block of output rows (about this
# many bytes) at a time on one thread: each block's columns are still in L2 when its GEMM reads
# them.  Measured (3x3 + Clip sessions, one thread, interleaved, medians of 100, a loaded
# machine): stride 2 16 -> 32 on 160x160 (YOLOv8n) 2299 -> 1992 us; but 32 -> 64 on 80x80
# 1488 -> 1528, 64 -> 128 on 40x40 1265 -> 1335, 128 -> 256 on 20x20 1213 -> 1352 (every block's
# GEMM packs the weight again), hence the positions-per-channel bound.
_COLS_BLOCK = 256 << 10
_COLS_BLOCK_MIN_N = 32
# The JIT's im2col at stride 1 (or odd planes) only for output rows of at least this many
# columns: measured (one Conv, no bias, one thread, interleaved) 3x1 on 48 x 36x16 (16-column
# rows, wake-word) 178 -> 221 us, on 16 x 48 x 36x16 4164 -> 4583; 1x3 on 16 x 24 x 74x32
# 10748 -> 8850 but 1 x 24 x 74x32 280 -> 297; 3x3 on 64 x 40x40 624 -> 477.
_JIT_IM2COL_ROW = 32
# Column matrices of at most this many elements are built by one gather through precomputed
# indices (an index per element: 8 bytes each, made once per input shape).  Silero VAD's convs
# (1-D, 3 taps over 3 positions; an STFT of 256 taps over 3 frames): ~10-20 us of per-tap Python
# each, most of their run.
_GATHER_MAX = 1 << 15
# With the JIT, a one-group conv with at most this many output positions (batch included) and at
# least _TINY_MIN_TAPS taps per output gathers its columns and takes one vectorized dot product
# per output in one call (_conv_jit.conv_tiny): OpenBLAS runs a GEMM with N = 1..4 at a fraction
# of its speed.  Measured one thread, the GEMM alone (M x taps x N, np.matmul vs the JIT's dot
# products): Silero VAD's STFT 258 x 256 x 3 35 vs 16 us, encoder 128 x 387 x 3 25 vs 14 us,
# 64 x 384 x 2 12 vs 3 us; at N = 1 both ~2 us.
_TINY_N = 4
_TINY_MIN_TAPS = 16
# 1x1 convs take that path too up to this many weights (M * C): Silero VAD's 128 -> 1 head on one
# position, 4.6 us through np.matmul and the epilogue's own pass, ~2 in one call.  A large 1x1 on
# one position (a classifier head) stays a BLAS GEMV, which may run on several threads.
_TINY_ONE_MAX = 1 << 16


# -- geometry ---------------------------------------------------------------------------------


def conv_geometry(
    in_shape: tuple[int, ...],
    kernel: tuple[int, ...],
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    pads: tuple[int, ...] | None,
    auto_pad: str,
    ceil_mode: bool = False,
    pool: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(pads_begin, pads_end, out_shape) for a conv/pool over ``in_shape``.

    ``SAME_UPPER``/``SAME_LOWER`` keep ``ceil(in / stride)`` outputs and put the odd padding
    element at the end / the beginning (ONNX spec, as onnxruntime does).  With ``ceil_mode`` the
    last window must start inside the (begin-padded) input, PyTorch's and onnxruntime's rule.

    When the strides leave more than the kernel between windows, the spec's SAME padding
    ``(out - 1) * stride + kernel - in`` is negative.  A convolution pads nothing then (what
    onnxruntime's Conv does); a ``pool`` keeps the negative padding, split with C's truncating
    division as onnxruntime's AveragePool and LpPool split it: a negative begin pad starts every
    window that far inside the input (6 rows, kernel 1, stride 3, SAME_UPPER: rows 1 and 4, not 0
    and 3; onnx.reference's MaxPool shifts the same way, onnxruntime's refuses the node).
    """
    nd = len(in_shape)
    begin, end, out = [], [], []
    for i in range(nd):
        eff = (kernel[i] - 1) * dilations[i] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER") and pool and dilations[i] != 1:
            # onnxruntime's pools size SAME padding with the undilated kernel, then the output
            # with the dilated one and ceil_mode (fewer outputs than ceil(in / stride))
            need = (-(-in_shape[i] // strides[i]) - 1) * strides[i] + kernel[i] - in_shape[i]
            half = need + (auto_pad == "SAME_LOWER")
            b = half // 2 if half >= 0 else -(-half // 2)  # C's half / 2
            if in_shape[i] + need < eff:  # (onnxruntime's pools disagree with each other there)
                raise InvalidArgument(f"kernel {list(kernel)} (dilations {list(dilations)}) is larger than the "
                                      f"SAME-padded input {list(in_shape)}")
            begin.append(b)
            end.append(need - b)
            out.append(_ort_pool_size(in_shape[i] + need - eff, strides[i], ceil_mode))
            continue
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-in_shape[i] // strides[i])
            total = (o - 1) * strides[i] + eff - in_shape[i]
            if total < 0 and pool:
                half = total + (auto_pad == "SAME_LOWER")
                b = -(-half // 2)  # C's half / 2 for half <= 0
            else:
                total = max(0, total)
                small = total // 2
                b = small if auto_pad == "SAME_UPPER" else total - small
            begin.append(b)
            end.append(total - b)
            out.append(o)
            continue
        if auto_pad == "VALID":
            b = e = 0
        else:
            p = pads or (0,) * (2 * nd)
            b, e = int(p[i]), int(p[i + nd])
        span = in_shape[i] + b + e - eff
        if span < 0:
            raise InvalidArgument(
                f"kernel {list(kernel)} (dilations {list(dilations)}) is larger than the padded "
                f"input {list(in_shape)}"
            )
        if ceil_mode:
            o = -(-span // strides[i]) + 1
            if (o - 1) * strides[i] >= in_shape[i] + b:
                o -= 1
        else:
            o = span // strides[i] + 1
        begin.append(b)
        end.append(e)
        out.append(o)
    return tuple(begin), tuple(end), tuple(out)


def _ort_pool_size(span: int, stride: int, ceil_mode: bool) -> int:
    """onnxruntime's pool output length for ``span = in + pads - dilated kernel``: the float
    ``span / stride + 1``, rounded up with ``ceil_mode``, then truncated toward zero."""
    x = np.float32(span) / np.float32(stride) + np.float32(1)
    return int(math.ceil(x)) if ceil_mode else int(x)


# Per-thread scratch of the conv's transient buffers (the padded input and the im2col matrix):
# thread ident -> {name: flat uint8 buffer}.  Fresh multi-megabyte arrays on every call cost a
# page fault per 4 KiB (glibc maps large blocks and unmaps them on free): measured on the wake-word
# embedding CNN (batch 16, 10.9 MB column matrices) 44-48 ms per run, 32 ms with glibc told to
# keep freed memory (MALLOC_MMAP_THRESHOLD_), which reusing the buffers gives without touching
# the process's allocator.  Buffers above _SCRATCH_MAX are not kept.
_conv_scratch: dict[int, dict[str, np.ndarray]] = {}
_SCRATCH_MAX = 64 << 20


@scratch_releaser
def _drop_conv_scratch() -> None:
    _conv_scratch.clear()


def _scratch(name: str, shape: tuple[int, ...], dtype) -> np.ndarray | None:
    """An uninitialized C-contiguous array of ``shape`` reused by this thread's later calls
    (the caller is done with it before its next call under ``name``), or None when too large."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > _SCRATCH_MAX or nbytes == 0:
        return None
    key = threading.get_ident()
    bufs = _conv_scratch.get(key)
    if bufs is None:
        if len(_conv_scratch) >= 8:  # threads that ended leave their buffers: drop those
            alive = {t.ident for t in threading.enumerate()}
            for k in [k for k in _conv_scratch if k not in alive]:
                _conv_scratch.pop(k, None)
        bufs = _conv_scratch.setdefault(key, {})
    buf = bufs.get(name)
    # (a buffer made for a smaller request may hold nbytes but not nbytes past its aligned start:
    # a scratch that came back short by its alignment offset failed to reshape)
    if buf is None or buf.size - (-buf.ctypes.data % 64) < nbytes:
        buf = bufs[name] = np.empty(nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64  # 64-byte aligned, as a fresh large numpy array is
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def _pad(x: np.ndarray, begin, extent, value, scratch: str | None = None) -> np.ndarray:
    """``x`` placed at ``begin`` inside a (N, C, *extent) array filled with ``value`` (the
    thread's scratch buffer ``scratch`` when given: valid until this thread's next use of it).

    ``extent`` may cut the input short (ceil_mode windows are computed on what they need).
    """
    if all(b == 0 for b in begin) and all(e <= n for e, n in zip(extent, x.shape[2:])):
        # Nothing to pad: ``x`` itself, or a view of the part the windows read (an STFT's last
        # samples past its last frame: melspectrogram copied 16,000 floats per conv for it).
        if tuple(extent) == x.shape[2:]:
            return x
        return x[(Ellipsis,) + tuple(slice(0, e) for e in extent)]
    shape = x.shape[:2] + tuple(extent)
    xp = _scratch(scratch, shape, x.dtype) if scratch else None
    if xp is None:
        xp = np.empty(shape, dtype=x.dtype)
    _place(x, xp, begin, value)
    return xp


def _place(x: np.ndarray, xp: np.ndarray, begin, value) -> None:
    """``x`` (N, C, *spatial) written at ``begin`` into ``xp`` (N, C, *extent), ``value`` around
    it (cut where it reaches past ``xp``): the borders, then one strided copy, so each element is
    written about once (a fill of the whole then the copy wrote the interior twice: the wake-word
    CNN's padded copies of 3.6 MB took 0.75 ms in a JIT loop over rows, 0.35 ms this way)."""
    dst, src = [slice(None), slice(None)], [slice(None), slice(None)]
    lead = (slice(None), slice(None))
    for axis, (b, n, e) in enumerate(zip(begin, x.shape[2:], xp.shape[2:])):
        lo = min(max(b, 0), e)
        hi = max(min(b + n, e), lo)
        if lo > 0:
            xp[lead + (slice(None),) * axis + (slice(0, lo),)] = value
        if hi < e:
            xp[lead + (slice(None),) * axis + (slice(hi, e),)] = value
        dst.append(slice(lo, hi))
        src.append(slice(lo - b, hi - b))
    xp[tuple(dst)] = x[tuple(src)]


def _shift_fits(c: int, m: int, kprod: int, length: int, tile: int) -> bool:
    """Whether a stride-1 conv of ``c`` -> ``m`` channels, ``kprod`` taps and ``length`` output
    positions per image runs conv_shift rather than im2col + GEMM (the limits' measurements above
    _SHIFT_MAX_CHANNELS), by the tile width: AVX2's 16 positions or AVX-512's 64."""
    taps = c * kprod
    if tile >= 64:
        return taps <= _SHIFT_MAX_TAPS_WIDE or (length <= tile and taps <= _SHIFT_MAX_TAPS_ONE_TILE)
    return max(c, m) <= _SHIFT_MAX_CHANNELS and taps <= _SHIFT_MAX_TAPS


def _shift_plan(p, tile: int, c: int, taps: np.ndarray, far: list[int], plane: int, wp: int, ho: int, wo: int,
                runs: int, kw: int, padded: tuple | None, at: tuple | None) -> None:
    """The fields of a conv_shift plan (stride 1 over a padded plane, or stride 2 over its phases):
    ``taps`` each tap's offset in a channel's ``plane`` floats (rows of ``wp``), ``far`` each input
    stream's farthest tap (prefetched four tiles ahead), ``runs`` about how many runs of
    ``tile + kw`` floats a tile reads per channel (its input channels go in blocks of
    ``_SHIFT_L1`` bytes of those), ``padded`` / ``at`` the padded copy's shape and where the input
    sits in it (None: the input read as it is)."""
    n, m = p.n, p.m
    macs = m * c * taps.shape[0]
    p.kind = _SHIFT
    p.wk_shape = (macs,)
    p.big = n * macs * p.length >= _PARALLEL_MACS
    # Output rows per band of conv_shift's epilogue: ~_SHIFT_BAND positions (its scratch: M x that).
    rows = max(1, _SHIFT_BAND // wp)
    p.count = n * -(-ho // rows)
    block = _SHIFT_CB or _SHIFT_L1 // (4 * runs * (tile + kw))
    p.jit_args = (taps, np.array([f + 4 * tile for f in far], np.int64), c, plane, wp, wo, rows, max(1, min(c, block)))
    if padded is not None:
        # (then the floats a last tile may read past the copy: see conv_shift)
        p.padded, p.at = padded, at
        p.slack = tile + int(taps.max())
        p.pad_size = math.prod(padded)


def _padded_extent(in_shape, begin, out, kernel, strides, dilations):
    return tuple(
        (o - 1) * s + (k - 1) * d + 1 for o, k, s, d in zip(out, kernel, strides, dilations)
    )


def _shared_gaps(nd, in_shape, begin, hp, wp, wo) -> tuple[int, int]:
    """conv_shift's padded plane ``(hp, wp)`` with one gap of zeros between rows instead of a
    left and a right border: a row is ``left`` zeros, the input row, then zeros up to ``W + gap``
    floats, ``gap = max(left, right)``.  A window reaching past its row's end reads the next
    row's leading zeros, which stand for this row's right border; one more row of zeros at the
    bottom serves the last row.  Every output row computes ``wp`` positions of which ``wo`` are
    kept, so the narrower rows waste less: the wake-word model's 1x3 convs (one zero each side)
    on rows of 32, 16, 8 and 4 compute 33 / 17 / 9 / 5 positions instead of 34 / 18 / 10 / 6.
    The plane as it is when there is no saving (one border, one row, a cut input)."""
    if nd != 2:
        return hp, wp
    h, w = in_shape
    left, right = begin[1], wp - begin[1] - w
    gap = max(left, right)
    if left <= 0 or right <= 0 or hp < begin[0] + h or w + gap < wo:
        return hp, wp
    return hp + 1, w + gap


def _window(offset, out, strides, dilations):
    """Slices picking, for one kernel offset, the input element of every output position."""
    return tuple(
        slice(k * d, k * d + (o - 1) * s + 1, s) for k, o, s, d in zip(offset, out, strides, dilations)
    )


def _separable_reduce(xp: np.ndarray, kernel, out, strides, dilations, op) -> np.ndarray:
    """Reduce every window of ``xp`` with ``op`` (np.maximum / np.add), one spatial axis at a time.

    Max and sum over a box are separable: reducing along H then W costs kh + kw strided passes
    instead of kh*kw (measured 0.49 ms vs 0.87 ms for a 3x3/2 max pool of 64x112x112).

    An axis with one tap that keeps every position (the rows of a 1x2/(1,2) pool) is skipped
    instead of copied: the wake-word embedding's (16, 48, 32, 16) pool 186 -> 159 us (medians,
    one thread).  The result is always a fresh array (AveragePool divides it in place).
    """
    # Axes whose one tap keeps every position; all of them when every axis is such (a 1x1 pool):
    # the first is then copied.
    same = [k == 1 and o == n and (s == 1 or o == 1) for k, o, s, n in zip(kernel, out, strides, xp.shape[2:])]
    if all(same):
        same[0] = False
    cur = xp
    for axis, (k, o, s, d) in enumerate(zip(kernel, out, strides, dilations)):
        if same[axis]:
            continue
        res = None
        for tap in range(k):
            sl = [slice(None)] * cur.ndim
            sl[2 + axis] = slice(tap * d, tap * d + (o - 1) * s + 1, s)
            v = cur[tuple(sl)]
            if res is None:
                res = v.copy()
            else:
                op(res, v, out=res)
        cur = res
    return cur


def im2col(xp: np.ndarray, kernel, out, strides, dilations, scratch: str | None = None) -> np.ndarray:
    """Column tensor (N, C, *kernel, *out) of a padded input, one copy per kernel offset.

    With strides > 1 the input is first split into its stride phases (``xp[..., r::s]``), so
    every tap reads a unit-stride block of one phase: measured 2.4x faster for resnet's 7x7/2
    stem (0.26 ms vs 0.61 ms) than strided reads.

    Kernels of more than :data:`_WINDOW_TAPS` taps (an STFT as a 1-D Conv: 512 taps) are one
    strided-window copy instead (``sliding_window_view``): a Python step per tap would cost more
    than the copy itself (melspectrogram's 2 convs: 19 ms -> well under 1 ms).
    """
    if math.prod(kernel) > _WINDOW_TAPS:
        nd = len(kernel)
        # win: (N, C, *out, *kernel), the window of every output position (by stride) and its
        # taps (by dilation), as strides over xp (which holds every position they reach;
        # sliding_window_view's checks cost 3x the copy of an STFT's columns).
        sp = xp.strides[2:]
        win = np.lib.stride_tricks.as_strided(
            xp, xp.shape[:2] + tuple(out) + tuple(kernel),
            xp.strides[:2] + tuple(a * st for a, st in zip(sp, strides)) + tuple(a * d for a, d in zip(sp, dilations)),
            writeable=False)
        perm = (0, 1) + tuple(range(2 + nd, 2 + 2 * nd)) + tuple(range(2, 2 + nd))
        if nd == 1 and xp.shape[1] == 1 and dilations[0] == 1:
            # One channel, 1-D (an STFT): each position's window is a contiguous run of the
            # input, so the windows are copied row by row and handed over transposed; with one
            # channel the caller's (N, 1, K, L) reshape keeps the view, and BLAS reads the
            # transpose in place (the column-major copy gathered with a stride of the hop:
            # melspectrogram's 512 x 97 columns 122 -> ~20 us in the model).
            rows = _scratch(scratch, win.shape, xp.dtype) if scratch else None
            if rows is None:
                return np.ascontiguousarray(win).transpose(perm)
            np.copyto(rows, win)
            return rows.transpose(perm)
        win = win.transpose(perm)
        cols = _scratch(scratch, win.shape, xp.dtype) if scratch else None
        if cols is None:
            return np.ascontiguousarray(win)
        np.copyto(cols, win)
        return cols
    shape = xp.shape[:2] + tuple(kernel) + tuple(out)
    cols = _scratch(scratch, shape, xp.dtype) if scratch else None
    if cols is None:
        cols = np.empty(shape, dtype=xp.dtype)
    phases: dict[tuple[int, ...], np.ndarray] = {}
    strided = any(s > 1 for s in strides)
    for offset in itertools.product(*(range(k) for k in kernel)):
        dst = (slice(None), slice(None)) + offset
        if not strided:
            cols[dst] = xp[(Ellipsis,) + _window(offset, out, strides, dilations)]
            continue
        pos = [k * d for k, d in zip(offset, dilations)]
        key = tuple(p % s for p, s in zip(pos, strides))
        phase = phases.get(key)
        if phase is None:
            phase = phases[key] = np.ascontiguousarray(
                xp[(Ellipsis,) + tuple(slice(r, None, s) for r, s in zip(key, strides))]
            )
        cols[dst] = phase[(Ellipsis,) + tuple(slice(p // s, p // s + o) for p, s, o in zip(pos, strides, out))]
    return cols


def _gather_index(in_shape, ks, out, strides, dils, begin) -> np.ndarray:
    """Indices ``(C * prod(ks), prod(out))`` into one image flattened as (C, *in_spatial) plus
    one appended zero: ``x_flat_with_zero[idx]`` is :func:`im2col` of the padded image, rows in
    its order (channel, kernel offsets), padding reading the zero at ``C * prod(in_spatial)``."""
    c, spatial = in_shape[0], tuple(in_shape[1:])
    nd = len(spatial)
    size = c * math.prod(spatial)
    flat = np.zeros((1,) * (2 * nd), dtype=np.int64)
    valid = np.ones((1,) * (2 * nd), dtype=bool)
    step = 1
    for i in reversed(range(nd)):
        k = np.arange(ks[i]).reshape((1,) * i + (-1,) + (1,) * (2 * nd - i - 1))
        o = np.arange(out[i]).reshape((1,) * (nd + i) + (-1,) + (1,) * (nd - i - 1))
        pos = o * strides[i] + k * dils[i] - begin[i]
        valid = valid & (pos >= 0) & (pos < spatial[i])
        flat = flat + pos * step
        step *= spatial[i]
    chan = (np.arange(c) * step).reshape((-1,) + (1,) * (2 * nd))
    idx = np.where(valid[None], flat[None] + chan, size)
    return np.ascontiguousarray(idx.reshape(c * math.prod(ks), math.prod(out)), dtype=np.intp)


def _same_depthwise(ks, dils, begin, in_shape, out_shape, strides) -> int | None:
    """3 or 5 when a depthwise conv's outputs are those of the 3x3 / 5x5 "same" conv (unit
    strides and dilations, ``(K - 1) / 2`` zeros of padding on every side), which the JIT's
    ``depthwise3_same`` / ``depthwise5_same`` compute in one pass per plane, at rows
    ``oh * sh`` and columns ``ow * sw``: the same kernel and padding in front, any stride, and
    no output past the input's last row or column (less padding at the end only cuts it short).
    """
    if len(ks) != 2 or ks[0] != ks[1] or ks[0] not in (3, 5) or tuple(dils) != (1, 1):
        return None
    p = (ks[0] - 1) // 2
    if tuple(begin) != (p, p):
        return None
    if any(o < 1 or (o - 1) * s > i - 1 for o, s, i in zip(out_shape, strides, in_shape)):
        return None
    return ks[0]


def _halving(in_shape, out_shape, strides) -> bool:
    """Whether a "same" depthwise conv (:func:`_same_depthwise`) is the JIT's stride-2 case
    (``depthwise3_s2`` / ``depthwise5_s2``): stride 2 both ways over an even H and W, giving
    exactly H / 2 x W / 2 outputs (the padding at the end may be one less: the outputs are the same)."""
    return (tuple(strides) == (2, 2) and all(i % 2 == 0 and i > 0 for i in in_shape)
            and tuple(out_shape) == tuple(i // 2 for i in in_shape))


def _s2_stem(c, m, ks, dils, begin, in_shape, out_shape, strides) -> bool:
    """Whether a one-group conv runs the JIT's ``conv3_s2_small``: 3x3, stride 2, one zero of
    padding in front, even H and W (:func:`_halving`), at most ``_S2_STEM_IN`` input channels
    and ``_S2_STEM_OUT`` output channels."""
    return (tuple(ks) == (3, 3) and tuple(dils) == (1, 1) and tuple(begin) == (1, 1) and c <= _S2_STEM_IN
            and m <= _S2_STEM_OUT and _halving(in_shape, out_shape, strides))


def _jit_im2col(nd, kprod, begin, strides, in_shape, out_shape) -> bool:
    """Whether a conv's column matrix is the JIT's ``im2col2d``: 2-D, padding only added, at
    most ``_WINDOW_TAPS`` taps (longer kernels keep numpy's one strided-window copy), and
    stride 2 over an even plane (from the stride phases) or output rows of at least
    ``_JIT_IM2COL_ROW`` (its per-row work made short rows slower than numpy's slab copies)."""
    if nd != 2 or min(begin) < 0 or kprod > _WINDOW_TAPS:
        return False
    phased = tuple(strides) == (2, 2) and in_shape[0] % 2 == 0 and in_shape[1] % 2 == 0
    return phased or out_shape[1] >= _JIT_IM2COL_ROW


def _ints(value, n: int, default: int) -> tuple[int, ...]:
    if value is None or len(value) == 0:
        return (default,) * n
    return tuple(int(v) for v in value)


class _SpatialAttrs:
    """Attributes common to Conv, ConvTranspose and pools, resolved against an input's rank."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel_shape = kernel.attr("kernel_shape")
        self.strides = kernel.attr("strides")
        self.dilations = kernel.attr("dilations")
        self.pads = kernel.attr("pads")
        self.auto_pad = kernel.attr("auto_pad", "NOTSET") or "NOTSET"
        if self.auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
            raise InvalidArgument(
                f"node {kernel.node.name!r} ({kernel.node.op_type}): auto_pad must be NOTSET, "
                f"SAME_UPPER, SAME_LOWER or VALID, got {self.auto_pad!r}"
            )
        # As onnxruntime: a zero or negative stride, dilation or kernel size is refused (a negative
        # one would otherwise size the padded input or the output in the exabytes).
        for name in ("kernel_shape", "strides", "dilations"):
            values = getattr(self, name)
            if values is not None and any(int(v) < 1 for v in values):
                raise InvalidArgument(f"node {kernel.node.name!r} ({kernel.node.op_type}): {name} must be "
                                      f"positive, got {list(values)}")

    def resolve(self, nd: int, kernel_shape=None):
        ks = tuple(int(k) for k in (self.kernel_shape or kernel_shape))
        return ks, _ints(self.strides, nd, 1), _ints(self.dilations, nd, 1)


# -- Conv -------------------------------------------------------------------------------------

# The paths of a Conv call (_ConvPlan.kind); the JIT's own kernels first (``kind <= _DIRECT``).
_DW_JIT = 0  # depthwise, one JIT pass with padding, bias and activations
_DIRECT = 1  # one group, few taps per output: the JIT's direct kernel
_ONE = 2  # 1x1 unpadded: the (strided) input is the column matrix
_GATHER = 3  # a small column matrix gathered through precomputed indices
_IM2COL = 4  # padded copy, im2col, GEMM
_DW_NUMPY = 5  # depthwise without the JIT: a multiply-add per tap over the whole tensor
_IM2COL_JIT = 6  # 2-D: the JIT's im2col straight from the unpadded input (im2col2d), GEMM
_TINY = 7  # one group, a few output positions: gather and dot products in one JIT call (conv_tiny)
_SHIFT = 8  # one group, stride 1: tiles of positions straight from the (padded) input (conv_shift)
_WINDOWS = 9  # 1-D, one input channel, a long kernel: windows @ W^T from panels (conv_windows)
_BCAST = 10  # 2-D, one group: output channels vectorized, inputs broadcast, from panels (conv_bcast)


class _ConvPlan:
    """What a Conv call on one input shape and dtype does, decided once (:meth:`Conv._plan`):
    the path, the geometry, the weight as the path reads it (when packed), the thread decision's
    size test, the epilogue's encoded activations.  Silero VAD's six small convs spent 8-20 us
    each of Python on these before the arithmetic; a call now only runs array operations.
    Attributes not used by the plan's path are None."""

    __slots__ = ("kind", "n", "m", "g", "length", "ks", "strides", "dils", "begin", "out_shape", "yshape",
                 "wm_shape", "wm", "wk_shape", "wk", "fn", "jit_args", "big", "count", "zero_bias", "full",
                 "sub", "idx", "zero", "extent", "cols_shape", "small", "pre", "post", "channels", "jit", "enc",
                 "table", "rows3", "chunk", "phased", "padded", "at", "split", "empty", "slack", "pad_size", "per_image",
                 "alt", "choice", "bases", "koffs", "unit", "planes")



def pack_windows(weight: np.ndarray) -> np.ndarray:
    """A (M, 1, K) weight as :func:`._conv_jit.conv_windows` reads it: ``ceil(M / 64)`` panels of
    64 output channels, each K rows of 64 (row k: tap k of each channel), zeros past M; float32,
    shape (panels * K, 64)."""
    m, k = weight.shape[0], weight.shape[-1]
    panels = -(-m // 64)
    w = np.zeros((panels * 64, k), np.float32)
    w[:m] = weight.reshape(m, k)
    return np.ascontiguousarray(w.reshape(panels, 64, k).transpose(0, 2, 1)).reshape(panels * k, 64)


def unpack_windows(packed: np.ndarray, m: int, k: int) -> np.ndarray:
    """The (M, 1, K) float32 weight that :func:`pack_windows` packed."""
    panels = packed.shape[0] // k
    return np.ascontiguousarray(packed.reshape(panels, k, 64).transpose(0, 2, 1).reshape(panels * 64, k)[:m]
                                ).reshape(m, 1, k)


def _tiny_taps(idx: np.ndarray, wm: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """conv_tiny's gather indices and (g, M, C * taps) weight without the (channel, tap) columns
    that read only padding at every output position (index ``size``: the appended zero), when
    there are such columns and their weights are finite: a 3-tap conv over one frame (Silero
    VAD's last encoder conv, 128 <- 64) reads one tap in three.  A non-finite weight there keeps
    them: its product with the padding's zero is NaN, which the output must show."""
    keep = (idx < size).any(axis=1)
    if keep.all() or not keep.any() or not np.isfinite(wm[:, :, ~keep]).all():
        return idx, wm
    return np.ascontiguousarray(idx[keep]), np.ascontiguousarray(wm[:, :, keep])


def _into(out: np.ndarray | None, y: np.ndarray) -> np.ndarray:
    """``y`` written into the caller's ``out`` when it fits (same shape and dtype), else ``y``."""
    if out is not None and out.shape == y.shape and out.dtype == y.dtype:
        out[...] = y
        return out
    return y


def _run_items(fn, args, plan: _ConvPlan, native=None) -> None:
    """``fn(*args, i0, i1)`` over the plan's ``count`` work items: split over onnxpack's threads
    when the plan is ``big`` and splitting it pays here (its :class:`~._act.SplitTuner`), else
    one call.  ``native(args, plan, threads)``, when given, is the split without the GIL (a unit
    job); False from it: the split through :func:`~._act.parallel`."""
    threads = _act.threads() if plan.big else 1
    if threads > 1 and plan.per_image:
        # One block of items per thread: each call first lays out its image's input planes
        # (an RGB stem's stride phases), which finer chunks would each redo.
        count = plan.count
        plan.split.run(lambda a, b: fn(*args, a * count // threads, b * count // threads), threads, threads,
                       None if native is None else lambda: native(args, plan, threads))
    elif threads > 1:
        plan.split.run(lambda a, b: fn(*args, a, b), plan.count, threads,
                       None if native is None else lambda: native(args, plan, threads))
    else:
        fn(*args, 0, plan.count)


def _plane_units(args, plan: _ConvPlan, threads: int) -> bool:
    """The JIT's plane kernels (depthwise, ``conv2d_small``, ``conv3_s2_small``: ``args`` as
    :func:`_run_items` takes them) split over threads as a unit job (``_conv_jit.planes_unit``):
    blocks of planes, each computed by one call as on one thread, so the same bits.  Through
    :func:`~._act.parallel` each chunk takes the GIL, and a helper that wakes late leaves most
    chunks to the caller: MobileNetV2's 32 x 112x112 depthwise conv, 111 us on one thread, took
    92 us split that way and 68 us as units (one thread, then two, in a loop).  A block per
    thread (a per-image kernel lays out its image's input planes first, and each depthwise call
    sets up its scratch and column masks: finer blocks redo that).  False when an array is not
    as the unit reads it, or there is no unit path here (:func:`~._act.run_units`)."""
    x, w, bias, y = args[:4]
    codes, params = args[-2:]
    if not (_act.c_arrays(_F32, x, w, y, bias, params) and _act.c_arrays(np.int64, codes)):
        return False
    jit = plan.jit
    if jit is None:
        return False
    geometry = args[4:10] if len(args) == 12 else (0,) * 6
    dims = w.shape if w.ndim == 4 else (*w.shape, 1)
    units = min(threads, plan.count)
    table = np.empty(jit.PU_LEN, np.int64)
    table[jit.PU_KIND:] = (plan.unit, x.ctypes.data, *x.shape, w.ctypes.data, *dims, bias.ctypes.data, bias.shape[0],
                           y.ctypes.data, *y.shape, *geometry, codes.ctypes.data, codes.shape[0], params.ctypes.data,
                           units, plan.count)
    return _act.run_units(jit.PLANES_UNIT, table, units, threads)


def _shift_units(args, plan: _ConvPlan, threads: int) -> bool:
    """conv_shift's bands (``args`` as :func:`_run_items` takes them, with its epilogue's
    arguments) split over threads as a unit job (``_conv_jit.shift_unit``: a few bands a unit, by
    conv_shift itself, so the same bits as one call).  Through :func:`~._act.parallel` each chunk
    takes the GIL: the wake-word's convs (16 images, 1-3 ms a call) gained 0-1.5x there, erratic
    (a helper that waits for the GIL sleeps).  False when an array is not as the unit reads it
    (C-contiguous float32 / int64), or there is no unit path here (:func:`~._act.run_units`)."""
    x, w, y, taps, lead, c, plane, wp, wo, rows, cb, bias, codes, params, res, pcodes, pparams, chan = args
    if not (_act.c_arrays(_F32, x, w, y, bias, params, res, pparams, chan)
            and _act.c_arrays(np.int64, taps, lead, codes, pcodes)):
        return False
    jit = plan.jit
    count = plan.count
    per = max(1, count // (_SHIFT_UNITS * threads))
    table = np.empty(jit.SU_LEN, np.int64)
    table[jit.SU_X:] = (
        x.ctypes.data, x.shape[0], w.ctypes.data, w.shape[0], y.ctypes.data, *y.shape, taps.ctypes.data, taps.shape[0],
        lead.ctypes.data, lead.shape[0], c, plane, wp, wo, rows, cb, bias.ctypes.data, bias.shape[0], codes.ctypes.data,
        codes.shape[0], params.ctypes.data, res.ctypes.data, res.shape[0], pcodes.ctypes.data, pcodes.shape[0],
        pparams.ctypes.data, chan.ctypes.data, chan.shape[0], chan.shape[1], per, count)
    return _act.run_units(jit.SHIFT_UNIT, table, -(-count // per), threads)


def _bcast_fits(m: int, c: int, taps: int) -> bool:
    """Whether conv_bcast's panels fit a weight of ``m`` output channels, ``c`` input channels
    and ``taps`` taps: at least ``_BCAST_MIN_FILL`` of the panels' lanes used, sums of at least
    ``_BCAST_MIN_K`` terms (``_BCAST_MIN_K_1X1`` for one tap)."""
    if m <= 0:
        return False
    tail = m % 64  # (a last panel of at most _PANEL_HALF channels computes only those columns)
    lanes = m - tail + (0 if not tail else _PANEL_HALF if tail <= _PANEL_HALF else 64)
    if m / lanes < _BCAST_MIN_FILL:
        return False
    return c * taps >= (_BCAST_MIN_K_1X1 if taps == 1 else _BCAST_MIN_K)


def _panel_blocks(n: int, m: int, positions: int, jit) -> tuple[int, int]:
    """The panel kernels' (conv_windows, conv_bcast) positions per item and item count for ``n``
    images of ``m`` output channels by ``positions``: the fewest blocks of at most
    ``WIN_BLOCK`` positions, evened out to a multiple of 6 (97 -> 54 + 43), times the panels."""
    per = -(-positions // -(-positions // jit.WIN_BLOCK))
    chunk = -(-per // 6) * 6
    return chunk, n * -(-positions // chunk) * -(-m // 64)


def _panel_units(args, plan: _ConvPlan, threads: int) -> bool:
    """conv_windows' or conv_bcast's items (``args`` as :func:`_run_items` takes them: the
    windows' stride, or conv_bcast's bases and offsets) split over threads as a unit job
    (``_conv_jit.windows_unit``: a few items a unit, by the kernel's own item loop, so the same
    bits as one call).  Through :func:`~._act.parallel` a mel-spectrogram's 257 x 512-tap conv on
    two threads took 140-190 us against ~210 on one.  False when an array is not C-contiguous
    float32 (int64 offsets), or there is no unit path here (:func:`~._act.run_units`)."""
    if len(args) == 6:  # conv_windows
        (x, w, y, stride, bias, block), bases, koffs = args, _NO_OFFSETS, _NO_OFFSETS
        codes, params, res, pcodes, pparams, chan = _NO_EPILOGUE
    else:  # conv_bcast
        (x, w, y, bases, koffs, bias, codes, params, res, pcodes, pparams, chan, block), stride = args, 0
    if not (_act.c_arrays(_F32, x, w, y, bias, params, res, pparams, chan)
            and _act.c_arrays(np.int64, bases, koffs, codes, pcodes)):
        return False
    jit = plan.jit
    count = plan.count
    per = max(1, count // (_SHIFT_UNITS * threads))  # (as many units a thread as conv_shift's)
    table = np.empty(jit.WU_LEN, np.int64)
    table[jit.WU_X:] = (x.ctypes.data, *x.shape, w.ctypes.data, w.shape[0], y.ctypes.data, *y.shape[1:], stride,
                        bias.ctypes.data, bias.shape[0], block, bases.ctypes.data, bases.shape[0], koffs.ctypes.data,
                        koffs.shape[0], codes.ctypes.data, codes.shape[0], params.ctypes.data, res.ctypes.data,
                        res.shape[0], pcodes.ctypes.data, pcodes.shape[0], pparams.ctypes.data, chan.ctypes.data,
                        chan.shape[0], chan.shape[1], per, count)
    return _act.run_units(jit.WINDOWS_UNIT, table, -(-count // per), threads)


def _channel_rows(bias: np.ndarray, res: np.ndarray, table: np.ndarray, m0: int, m1: int) -> tuple:
    """The JIT epilogue's bias, residual (N, M, L) and per-channel tables (K, M, 2) for output
    channels ``m0 .. m1`` (the empty ones as they are; the tables contiguous, as numba takes them)."""
    return (bias[m0:m1] if bias.shape[0] else bias, res[:, m0:m1] if res.shape[0] else res,
            np.ascontiguousarray(table[:, m0:m1]) if table.shape[0] else table)


def _run_channel_blocks(fn, args, plan: _ConvPlan, threads: int) -> None:
    """conv_shift (``args`` as :func:`_run_items` takes them, with its epilogue's arguments) over
    blocks of output channels, one per thread, for a batch of one image with fewer bands than
    threads: resnet's and YOLO's last stages (3x3 convs on 7x7 or 10x10 maps) are one band, and
    stayed on one thread.  Each block is the kernel on its rows of the weight, output, bias,
    residual and per-channel tables; block edges fall on multiples of 6 channels (the
    micro-kernel's tile), so every channel's sums are the ones a single call makes.  Whether the
    split pays is the plan's SplitTuner's call (its band split never runs for such a plan)."""
    x, w, y3, *rest = args
    jit_args = tuple(rest[:len(plan.jit_args)])
    bias, codes, params, res, pcodes, pparams, table = rest[len(plan.jit_args):]
    m = plan.m
    cuts = [0] + [m * i // threads // 6 * 6 for i in range(1, threads)] + [m]
    wrow = w.shape[0] // m

    def run(lo: int, hi: int) -> None:
        for b in range(lo, hi):
            m0, m1 = cuts[b], cuts[b + 1]
            if m1 > m0:
                b, r, t = _channel_rows(bias, res, table, m0, m1)
                fn(x, w[m0 * wrow:m1 * wrow], y3[:, m0:m1], *jit_args, b, codes, params, r, pcodes, pparams, t, 0,
                   plan.count)

    plan.split.run(run, threads, threads)


@register("Conv", since=1)
class Conv(Kernel):
    """N-D convolution (1-D, 2-D, 3-D), groups, dilations, strides, pads and auto_pad."""

    op_type = "Conv"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.sp = _SpatialAttrs(self)
        self._votes: dict[str, list[int]] = {}  # _path's choices so far, per question
        self.group = int(self.attr("group", 1))
        if self.group < 1:
            raise InvalidArgument(f"node {node.name!r} ({node.op_type}): attribute group must be >= 1, got {self.group}")
        self._w: np.ndarray | None = None  # packed (g, M/g, C/g, *kernel)
        self._u: np.ndarray | None = None  # packed Winograd filters (16, M, C)
        self._w_from_u: np.ndarray | None = None  # (M, C, 3, 3) recovered for small maps, lazily
        # conv_bcast's panels (pack_windows): packed (family conv_bc, of a weight _bcw (M, C, KH, KW)),
        # or a Winograd conv's recovered filters, lazily
        self._bc: np.ndarray | None = None
        self._bcw: tuple[int, int, int, int] | None = None
        self._w_from_bc: np.ndarray | None = None  # (M, C, KH, KW) recovered from packed panels, lazily
        self._wp: np.ndarray | None = None  # packed windows panels (ceil(M/64) * K, 64): pack_windows
        self._win: tuple[int, int] | None = None  # (M, K) of the weight packed as windows
        self._w_from_wp: np.ndarray | None = None  # (M, 1, K) recovered when the JIT cannot run, lazily
        self._gather: dict[tuple, np.ndarray] = {}  # (spatial shape, kernel) -> im2col gather indices (small convs)
        # (x shape, x dtype, no JIT[, w shape, w dtype]) -> _ConvPlan; ("winograd", x shape) -> geometry
        self._plans: dict[tuple, object] = {}
        self._w_as: dict[np.dtype, np.ndarray] = {}  # the packed GEMM matrix in another compute dtype

    # pre-packing
    def _winograd_ok(self, info: TensorInfo) -> bool:
        """Whether this Conv packs its weight for Winograd F(2x2, 3x3): a float32-computed 3x3
        kernel, one group, unit strides and dilations, at least ``MIN_CHANNELS`` in and out."""
        if not _WINOGRAD or len(info.shape) != 4 or tuple(info.shape[2:]) != (3, 3) or self.group != 1:
            return False
        if compute_dtype(info.dtype) != np.float32:
            return False
        if any(int(s) != 1 for s in (self.sp.strides or ())) or any(int(d) != 1 for d in (self.sp.dilations or ())):
            return False
        if self.sp.kernel_shape and tuple(int(k) for k in self.sp.kernel_shape) != (3, 3):
            return False
        m, c = int(info.shape[0]), int(info.shape[1])
        if min(m, c) < _winograd.MIN_CHANNELS:
            return False
        # Where conv_shift would run it, a conv with few channels is faster there (see _WINO_OVER_SHIFT).
        return not (_SHIFT_ON and max(c, m) <= _SHIFT_MAX_CHANNELS and c * 9 <= _SHIFT_MAX_TAPS
                    and c * m <= _WINO_OVER_SHIFT * (c + m) and _act.jit_possible())

    def _windows_ok(self, info: TensorInfo) -> bool:
        """Whether this Conv packs its weight for conv_windows: a float32-computed 1-D kernel of
        one input channel (one group), at least ``_WIN_MIN_TAPS`` taps and ``_WIN_MIN_M`` output
        channels, no dilation, and the JIT to run it."""
        if not _WINDOWS_ON or len(info.shape) != 3 or self.group != 1 or int(info.shape[1]) != 1:
            return False
        if compute_dtype(info.dtype) != np.float32:
            return False
        m, k = int(info.shape[0]), int(info.shape[2])
        if k < _WIN_MIN_TAPS or m < _WIN_MIN_M:
            return False
        if any(int(d) != 1 for d in (self.sp.dilations or ())):
            return False
        if self.sp.kernel_shape and tuple(int(v) for v in self.sp.kernel_shape) != (k,):
            return False
        if not _act.jit_possible():
            return False
        self._win = (m, k)
        return True

    def _bcast_ok(self, info: TensorInfo) -> bool:
        """Whether this Conv packs its weight as conv_bcast's panels: a float32-computed 2-D
        kernel of one group, panels filled (``_BCAST_MIN_FILL``), sums deep enough
        (``_BCAST_MIN_K``, ``_BCAST_MIN_K_1X1``), and the JIT to run it (Winograd's and the
        windows' packs are checked first)."""
        if not _BCAST_ON or len(info.shape) != 4 or self.group != 1 or compute_dtype(info.dtype) != np.float32:
            return False
        m, c, kh, kw = (int(d) for d in info.shape)
        if not _bcast_fits(m, c, kh * kw):
            return False
        if self.sp.kernel_shape and tuple(int(v) for v in self.sp.kernel_shape) != (kh, kw):
            return False
        if not _act.jit_possible():
            return False
        self._bcw = (m, c, kh, kw)
        return True

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != 1 or compute_dtype(info.dtype) is None or len(info.shape) < 3:
            return None
        if info.shape[0] % self.group:
            return None
        if self._windows_ok(info):
            return PackSpec("conv_win", _WIN_VERSION, struct.pack("<q", self.group), 1)
        if self._winograd_ok(info):
            return PackSpec("conv_wino", _WINO_VERSION, struct.pack("<q", self.group), 1)
        if self._bcast_ok(info):
            return PackSpec("conv_bc", _BCAST_VERSION, struct.pack("<q", self.group), 1)
        identity = compute_dtype(info.dtype) == np.dtype(info.dtype)  # the GEMM matrix is a reshape
        return PackSpec("conv", _PACK_VERSION, struct.pack("<q", self.group), 1, identity=identity)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        m = info.shape[0]
        g = self.group
        if self._windows_ok(info):
            return [(np.dtype(np.float32), (-(-m // 64) * info.shape[2], 64))]
        if self._winograd_ok(info):
            return [(np.dtype(np.float32), (16, m, info.shape[1]))]
        if self._bcast_ok(info):
            return [(np.dtype(np.float32), (-(-m // 64) * math.prod(info.shape[1:]), 64))]
        return [(compute_dtype(info.dtype), (g, m // g) + tuple(info.shape[1:]))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        m = weight.shape[0]
        g = self.group
        info = TensorInfo("", weight.dtype, tuple(weight.shape), 0)
        if self._windows_ok(info):
            return (pack_windows(weight),)
        if self._winograd_ok(info):
            if not _winograd.weight_is_tame(weight):
                return None  # runs on the weight itself (im2col), see weight_is_tame
            return (_winograd.weight_transform(weight),)
        if self._bcast_ok(info):
            return (pack_windows(weight.reshape(m, 1, -1)),)
        w = weight.reshape((g, m // g) + weight.shape[1:])
        return (np.ascontiguousarray(w, dtype=compute_dtype(weight.dtype)),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (packed,) = buffers
        # A (g, M/g, C/g, *kernel) pack has rank >= 4; only the Winograd pack (16, M, C) has rank 3
        # and the panels of the windows (1-D) and conv_bcast (2-D) packs (panels * K, 64) rank 2
        # (check_packed has already matched the buffer against expected_packed, for which
        # pack_spec noted the windows pack's (M, K) or the conv_bcast pack's (M, C, KH, KW)).
        if packed.ndim == 3:
            self._u = packed
        elif packed.ndim == 2 and self._win is not None:
            self._wp = packed
        elif packed.ndim == 2:
            assert self._bcw is not None, "Bug: a panels pack without its pack_spec"
            self._bc = packed
        else:
            self._w = packed

    def run(self, x, w=None, b=None):
        return (self._conv(x, w, b, None),)

    def fixed(self, shape, dtype, constants):
        """For a plan specialized for fixed shapes: the calls of a packed float32 conv whose plan
        for ``shape`` is settled and is one JIT call (a few output positions, ``conv_tiny``; the
        1-D windows, ``conv_windows``) with this bias, as :meth:`_conv` makes them, without its
        dispatch (~1.5 us a call of Silero VAD's six convs, each 3-10 us).  Other paths keep
        :meth:`run`."""
        w, b, r = (list(constants) + [None, None, None])[:3]
        if (w is not None or r is not None or getattr(self, "residual", False) or dtype != np.float32
                or getattr(self, "multiplier", None) is not None or self._u is not None
                or (self._bcw is not None and self._bc is not None)):
            return None
        jit = _act.jit()
        if jit is None:
            return None
        if self._wp is not None:
            return self._fixed_windows(shape, b, jit)
        plan = self._plans.get((shape, dtype, False)) if self._w is not None else None
        if plan is None or plan.kind != _TINY or plan.alt is not None or plan.empty or plan.wm is None:
            return None
        if b is not None and (b.dtype != np.float32 or b.shape != (plan.m,)):
            return None
        codes, params, pcodes, pparams = plan.enc
        tiny, idx, w0, yshape, rows3, n, table = plan.jit.conv_tiny, plan.idx, np.ascontiguousarray(plan.wm[0]), \
            plan.yshape, plan.rows3, plan.n, plan.table
        bias = _EMPTY1 if b is None else b

        def conv_tiny(x: np.ndarray) -> np.ndarray:
            y = np.empty(yshape, np.float32)
            tiny(np.ascontiguousarray(x).reshape(n, -1), idx, w0, y.reshape(rows3), bias, codes, params, _EMPTY3,
                 pcodes, pparams, table)
            return y

        return conv_tiny

    def _fixed_windows(self, shape, b, jit):
        plan = self._plans.get(("windows", shape, np.dtype(np.float32)))
        if plan is None or plan.extent is not None or self._pre or self._post or self._has_channel:
            return None
        if b is not None and (b.dtype != np.float32 or b.shape != (plan.m,)):
            return None
        windows, wp, yshape, n, stride, chunk, count = jit.conv_windows, self._wp, plan.yshape, plan.n, \
            plan.strides[0], plan.chunk, plan.count
        bias = _EMPTY1 if b is None else b

        def conv_windows(x: np.ndarray) -> np.ndarray:
            xp = np.ascontiguousarray(x).reshape(n, -1)
            y = np.empty(yshape, np.float32)
            args = (xp, wp, y, stride, bias, chunk)
            if plan.big:
                _run_items(windows, args, plan, _panel_units)
            else:
                windows(*args, 0, count)
            return y

        return conv_windows

    def run_into(self, outs, x, w=None, b=None) -> bool:
        """``run`` writing into ``outs[0]`` (the memory planner's arena): only the one-GEMM case
        (batch 1, one group, output already in the compute dtype), so the bits are ``run``'s."""
        return self._run_into(outs, x, w, b, None)

    def _run_into(self, outs, x, w, b, res) -> bool:
        y = outs[0]
        if self.group != 1 or x.ndim < 3 or x.shape[0] != 1 or y.size == 0:
            return False
        if y.dtype != x.dtype or compute_dtype(x.dtype) != x.dtype:
            return False
        return self._conv(x, w, b, y, res) is y

    # The epilogue after the GEMM: per-channel bias, activations, residual, activations.  Conv
    # has none but its bias; FusedConv sets these from its fusion record.
    _pre: tuple[Activation, ...] = ()
    _post: tuple[Activation, ...] = ()
    _has_channel = False  # an Activation("channel", k) in the epilogue (FusedConv)

    def _channels(self, dtype) -> tuple[tuple[tuple[np.ndarray, np.ndarray], ...], np.ndarray]:
        """The epilogue's per-channel steps in ``dtype``: ``(A, B)`` per table, and the JIT's
        (K, M, 2) float32 table; none for a plain Conv."""
        return (), _EMPTY_CHAN

    def _conv(self, x, w, b, out: np.ndarray | None, res: np.ndarray | None = None) -> np.ndarray:
        """The convolution and its epilogue; with ``out`` (batch 1, one group) the GEMM writes there.

        Returns the result: ``out`` itself when it was used, else a fresh array.  Everything that
        depends only on the input's shape and dtype (and the weight's, when it is not packed) is
        decided once, in a :class:`_ConvPlan`; a call runs array operations.
        """
        cd = compute_dtype(x.dtype)
        if cd is None:
            raise InvalidArgument(f"node {self.node.name!r}: Conv on {x.dtype} is not supported natively")
        if self._u is not None and w is None:
            return self._conv_winograd(x, b, out, res)
        if self._wp is not None and w is None:
            return self._conv_windows(x, b, out, res)
        if self._bcw is not None and self._bc is not None and w is None:
            return self._conv_bcast_packed(x, b, out, res)
        jit = _act.jit() if cd == np.float32 else None
        packed = self._w is not None
        key = (x.shape, x.dtype, jit is None) if packed else (x.shape, x.dtype, jit is None, w.shape, w.dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(x.shape, cd, None if packed else w, jit)
            if plan.kind in (_IM2COL, _IM2COL_JIT) and plan.jit is not None and _SHIFT_TUNED:
                # A stride-1 conv beyond conv_shift's measured limits: which path is faster is
                # the machine's (see _SHIFT_TUNED_TAPS); its first call times both.
                alt = self._plan(x.shape, cd, None if packed else w, jit, shift_any=True)
                if alt.kind == _SHIFT:
                    plan.alt, plan.choice = alt, _act.PathChoice()
            if len(self._plans) < 64:  # bounded: a model fed ever new shapes
                self._plans[key] = plan
        alt = plan.alt
        if alt is not None:
            path = plan.choice.settled()
            if path is None:
                path, y = self._path(
                    plan.choice, "shift", ("conv", x.shape, plan.wm_shape, plan.ks, plan.strides, plan.dils,
                                           tuple(plan.begin)),
                    lambda: self._conv_by(plan, x, w, b, None, res, cd),
                    lambda: self._conv_by(alt, x, w, b, None, res, cd), res)
                if y is not None:
                    return _into(out, y)
            if path:
                plan = alt
        return self._conv_by(plan, x, w, b, out, res, cd)

    def _path(self, choice: _act.PathChoice, question: str, key, first, second, res) -> tuple[int, object]:
        """:func:`._act.faster_path` for a geometry of this Conv whose ``choice`` has no settled
        path in the thread mode now in force (:class:`._act.PathChoice`): its first call in the
        mode, or its confirming one (timed again).  Once this Conv's first ``_PATH_VOTES``
        geometries of ``question`` in a mode chose one path, a new geometry takes that path
        unmeasured and is not timed again (recorded for the process all the same).  The
        process-wide key holds the thread mode and the epilogue's kinds (a chain of fake
        quantizations and per-channel steps costs the paths differently than a Relu: a QDQ model
        and its float original in one process measure their own choices)."""
        mode = _act.path_mode()
        chain = (tuple(a.kind for a in self._pre), tuple(a.kind for a in self._post), self._has_channel,
                 res is not None)
        key = key + (mode, chain)
        if mode in choice.modes:  # the confirming call
            path, y = _act.faster_path(key, first, second, confirm=True)
            choice.modes[mode] = [path, -1]
            return path, y
        votes = self._votes.setdefault((question, mode), [])
        prior = votes[0] if len(votes) >= _PATH_VOTES and len(set(votes)) == 1 else None
        path, y = _act.faster_path(key, first, second, prior)
        if prior is None and len(votes) < _PATH_VOTES:
            votes.append(path)
        choice.modes[mode] = [path, _act.PATH_CONFIRM_AT if prior is None else -1]
        return path, y

    def _conv_by(self, plan: _ConvPlan, x, w, b, out: np.ndarray | None, res: np.ndarray | None, cd) -> np.ndarray:
        """A call of :meth:`_conv` by ``plan`` (``cd``: the compute dtype)."""
        xc = x if x.dtype == cd else _act.astype(x, cd)
        wm = plan.wm
        if wm is None:  # a weight fed at run time
            wm = as_compute(w).reshape(plan.wm_shape)
            if wm.dtype != cd:
                wm = wm.astype(cd)
        if b is None:
            bias = None
        else:
            bias = b if b.dtype == cd else as_compute(b).astype(cd, copy=False)
            if bias.shape != (plan.m,):
                raise InvalidArgument(
                    f"node {self.node.name!r} (Conv): bias must have shape [{plan.m}], got {list(bias.shape)}")
        out_dtype = x.dtype
        if plan.empty:
            # No output element (a batch of 0 images, no output channel or position): nothing to
            # compute, and the paths below reshape by the batch size, which a size of 0 leaves
            # ambiguous.  onnxruntime returns the empty tensor too.
            if out is not None and out.shape == plan.yshape and out.dtype == out_dtype:
                return out
            return np.empty(plan.yshape, out_dtype)
        kind = plan.kind
        if kind <= _DIRECT:
            # The JIT folds the padding, bias and the inner activations into its one pass.
            if out is not None and (out.shape != plan.yshape or not out.flags.c_contiguous or out.dtype != cd
                                    or kind != _DIRECT):
                out = None
            y = np.empty(plan.yshape, np.float32) if out is None else out
            wk = plan.wk
            if wk is None:
                wk = np.ascontiguousarray(wm.reshape(plan.wk_shape))
            dst = y if plan.full is None else np.empty(plan.full, np.float32)
            xk, yk = np.ascontiguousarray(xc), dst
            if plan.planes is not None:  # 1-D as planes of one row (views of the same memory)
                xk, yk = xk.reshape(plan.planes[0]), dst.reshape(plan.planes[1])
            args = (xk, wk, plan.zero_bias if bias is None else bias, yk) + plan.jit_args
            fn = plan.fn
            _run_items(fn, args, plan, _plane_units)
            if dst is not y:
                # Strided (or cut short): every output is the "same" conv's at (oh*sh, ow*sw).
                y[...] = dst[plan.sub]
            return self._epilogue(plan, y, None, res, out_dtype)
        if kind == _SHIFT:
            # Tiles of output positions straight from the padded input; the epilogue a band of
            # output rows at a time, while the band is in cache.
            if out is not None and (out.shape != plan.yshape or not out.flags.c_contiguous or out.dtype != np.float32):
                out = None
            y = np.empty(plan.yshape, np.float32) if out is None else out
            wk = plan.wk
            if wk is None:
                wk = np.ascontiguousarray(wm).reshape(plan.wk_shape)
            xf = np.ascontiguousarray(xc)
            if plan.padded is not None:  # the padded copy, in this thread's scratch
                # (then plan.slack floats that the last tile may read: see conv_shift)
                flat = _scratch("pad", (plan.pad_size + plan.slack,), np.float32)
                if flat is None:
                    flat = np.empty(plan.pad_size + plan.slack, np.float32)
                xp = flat[:plan.pad_size].reshape(plan.padded)
                if plan.phased:  # stride 2: the padded input's four phases
                    plan.jit.pad_phases(xf, xp, plan.at[0], plan.at[1])
                else:
                    _place(xf.reshape(plan.n, plan.padded[1], -1, xf.shape[-1]), xp, plan.at, 0)
                xf = flat
            xf = xf.reshape(-1)
            fn = plan.jit.conv_shift
            y3 = y.reshape(plan.rows3)
            if res is not None and res.shape != y.shape:  # a broadcasting residual: numpy's rules after
                args = (xf, wk, y3) + plan.jit_args + (_EMPTY1, *_NO_EPILOGUE)
            else:
                codes, params, pcodes, pparams = plan.enc
                r = _EMPTY3 if res is None else np.ascontiguousarray(res, dtype=np.float32).reshape(plan.rows3)
                args = (xf, wk, y3) + plan.jit_args + (_EMPTY1 if bias is None else bias, codes, params, r, pcodes,
                                                       pparams, plan.table)
                bias = res = None
                threads = _act.threads() if plan.big else 1
                if threads > plan.count and plan.n == 1 and plan.m >= _SHIFT_SPLIT_MIN_M:
                    _run_channel_blocks(fn, args, plan, threads)
                    return _act.astype(y, out_dtype)
            _run_items(fn, args, plan, _shift_units)
            if bias is None and res is None:
                return _act.astype(y, out_dtype)
            return self._epilogue(plan, y, bias, res, out_dtype)
        if out is not None and (out.shape != plan.yshape or not out.flags.c_contiguous):
            out = None
        n = plan.n
        if kind == _TINY:
            # A few output positions: the columns gathered and one dot product per output, in one
            # JIT call; bias and activations in the epilogue's one pass.
            if out is not None and out.dtype != np.float32:
                out = None
            y = np.empty(plan.yshape, np.float32) if out is None else out
            args = (np.ascontiguousarray(xc).reshape(n, -1), plan.idx, np.ascontiguousarray(wm[0]), y.reshape(plan.rows3))
            if res is not None and res.shape != y.shape:  # a broadcasting residual: numpy's rules
                plan.jit.conv_tiny(*args, _EMPTY1, *_NO_EPILOGUE)
                return self._epilogue(plan, y, bias, res, out_dtype)
            codes, params, pcodes, pparams = plan.enc
            r = _EMPTY3 if res is None else np.ascontiguousarray(res, dtype=np.float32).reshape(plan.rows3)
            plan.jit.conv_tiny(*args, _EMPTY1 if bias is None else bias, codes, params, r, pcodes, pparams, plan.table)
            return _act.astype(y, out_dtype)
        if kind == _ONE:
            # 1x1: the (strided) input is the column matrix.
            cols = np.ascontiguousarray(xc if plan.sub is None else xc[plan.sub]).reshape(plan.cols_shape)
        elif kind == _GATHER:
            # A small column matrix: one gather through indices made once per input shape (the
            # padding reads an appended zero), instead of a padded copy and a copy per tap.
            if plan.jit is not None:
                xz = np.concatenate((xc.reshape(n, -1), plan.zero), axis=1)
                cols = np.empty(plan.cols_shape, np.float32)
                plan.jit.gather_cols(xz, plan.idx.reshape(-1), cols.reshape(n, -1))
            elif n == 1:
                cols = np.concatenate((xc.reshape(-1), plan.zero)).take(plan.idx).reshape(plan.cols_shape)
            else:
                xz = np.concatenate((xc.reshape(n, -1), plan.zero), axis=1)
                cols = xz[:, plan.idx].reshape(plan.cols_shape)
        elif kind == _IM2COL_JIT:
            # The column matrix straight from the input (no padded copy; stride 2 over even
            # planes from the input's stride phases), in this thread's scratch (read only before
            # this call returns).  On one thread, a large one is made and multiplied a block of
            # output rows at a time, each block's columns still in L2 for its GEMM.
            jit = plan.jit
            xcc = np.ascontiguousarray(xc)
            ph4 = _EMPTY5
            if plan.phased:
                pshape = (n, xcc.shape[1], 4, xcc.shape[2] // 2, xcc.shape[3] // 2)
                ph4 = _scratch("phases", pshape, np.float32)
                if ph4 is None:
                    ph4 = np.empty(pshape, np.float32)
                jit.stride_phases(xcc, ph4)
            oh, ow = plan.out_shape
            rows = plan.chunk
            if rows < oh and _act.threads() == 1:
                y = out if out is not None else np.empty(plan.yshape, cd)
                y3 = y.reshape(n, plan.m, plan.length)
                k = plan.cols_shape[2]
                flat = _scratch("cols", (k * rows * ow,), np.float32)
                if flat is None:
                    flat = np.empty(k * rows * ow, np.float32)
                w2 = wm[0]
                for i in range(n):
                    for r0 in range(0, oh, rows):
                        r1 = min(oh, r0 + rows)
                        cv = flat[:k * (r1 - r0) * ow].reshape(k, (r1 - r0) * ow)
                        jit.im2col2d(xcc, ph4, cv, *plan.jit_args, i, r0, r1)
                        np.matmul(w2, cv, out=y3[i, :, r0 * ow:r1 * ow])
                return self._epilogue(plan, y, bias, res, out_dtype)
            cols = _scratch("cols", plan.cols_shape, np.float32)
            if cols is None:
                cols = np.empty(plan.cols_shape, np.float32)
            c3 = cols.reshape(n, -1, plan.length)
            for i in range(n):
                jit.im2col2d(xcc, ph4, c3[i], *plan.jit_args, i, 0, oh)
        else:
            # The padded copy and the column matrix live in this thread's scratch: both are
            # read only before this call returns (the GEMM's result is a fresh array).
            xp = _pad(xc, plan.begin, plan.extent, 0, "pad")
            if kind == _DW_NUMPY:
                y = self._depthwise(xp, wm, plan.ks, plan.out_shape, plan.strides, plan.dils)
                return self._epilogue(plan, y, bias, res, out_dtype)
            cols = im2col(xp, plan.ks, plan.out_shape, plan.strides, plan.dils, "cols").reshape(plan.cols_shape)
        mm = np.matmul if plan.small else _act.matmul  # _act.matmul is np.matmul below _SPLIT_MACS
        if (not plan.small and n == 1 and plan.g == 1 and (out is None or out.dtype == np.float32)
                and _act.threads() > 1):
            # The epilogue by blocks, each in the thread that computed it (see _block_epilogue).
            y = out if out is not None else np.empty(plan.yshape, np.float32)
            after = self._block_epilogue(plan, y, bias, res)
            if after is not None:
                _act.matmul(wm[0], cols[0, 0], out=y.reshape(plan.m, plan.length), after=after)
                return _act.astype(y, out_dtype)
            out = y
        if out is not None:
            mm(wm[0], cols[0, 0], out=out.reshape(plan.m, plan.length))
            y = out  # already (n, m, *out_shape): keep the object, run_into checks identity
        elif plan.g == 1:
            y = mm(wm[0], cols[0, 0] if n == 1 else cols[:, 0]).reshape(plan.yshape)
        else:
            y = np.matmul(wm, cols).reshape(plan.yshape)
        return self._epilogue(plan, y, bias, res, out_dtype)

    def _plan(self, x_shape, cd, w, jit, shift_any: bool = False) -> _ConvPlan:
        """What a call on an input of ``x_shape`` computed in ``cd`` does (``w``: the weight
        when it is not packed; ``jit``: the numba kernels or None; ``shift_any``: conv_shift
        wherever it can run, up to ``_SHIFT_TUNED_TAPS``).  Raises what a call would."""
        g = self.group
        if w is None:
            m = self._w.shape[0] * self._w.shape[1]
            kernel_shape = self._w.shape[3:]
            per_group = math.prod(self._w.shape[2:])
        else:
            m = w.shape[0]
            if m % g:
                raise InvalidArgument(f"node {self.node.name!r}: {m} output channels not divisible by group {g}")
            kernel_shape = w.shape[2:]
            per_group = math.prod(w.shape[1:])
        n, c = x_shape[:2]
        nd = len(x_shape) - 2
        in_shape = tuple(x_shape[2:])
        ks, strides, dils = self.sp.resolve(nd, kernel_shape)
        kprod = math.prod(ks)
        if c % g or per_group != (c // g) * kprod:
            raise InvalidArgument(
                f"node {self.node.name!r} (Conv): input has {c} channels, weight expects "
                f"{per_group // max(kprod, 1) * g} (group {g}, kernel {list(ks)})"
            )
        begin, end, out_shape = conv_geometry(in_shape, ks, strides, dils, self.sp.pads, self.sp.auto_pad)
        cg, mg = c // g, m // g
        length = math.prod(out_shape)
        p = _ConvPlan()
        p.split = _act.SplitTuner()  # whether _run_items splits this plan's calls (when big)
        p.n, p.m, p.g, p.length = n, m, g, length
        p.ks, p.strides, p.dils, p.begin, p.out_shape = ks, strides, dils, begin, out_shape
        p.yshape = (n, m) + tuple(out_shape)
        p.empty = math.prod(p.yshape) == 0
        p.wm_shape = (g, mg, cg * kprod)
        p.wm = None
        if w is None:
            wm = self._w.reshape(p.wm_shape)
            if wm.dtype != cd:  # one copy per dtype, shared by the plans of every shape
                wm = self._w_as.get(cd)
                if wm is None:
                    wm = self._w_as[cd] = self._w.reshape(p.wm_shape).astype(cd)
            p.wm = wm
        p.wk = p.full = p.sub = p.idx = p.zero = p.extent = p.cols_shape = p.padded = p.at = p.planes = None
        p.alt = p.choice = p.unit = None
        p.phased = p.per_image = False
        p.small = False
        pre, post = self._pre, self._post
        # A few output positions: gathered columns and dot products in one JIT call (conv_tiny)
        tiny = (jit is not None and g == 1 and cd == np.float32 and 0 < n * length <= _TINY_N
                and c * kprod >= _TINY_MIN_TAPS)
        # Per-channel steps run only in the epilogue's row pass (bias_act), not inside the
        # depthwise, direct or Winograd kernels: with one, the whole pre-residual chain goes there.
        inner, outer = ((), pre) if self._has_channel else (pre, ())
        depthwise = cg == 1 and mg == 1 and g > 1
        if depthwise and nd == 1 and jit is not None and length > 0 and min(begin) >= 0:
            # 1-D (an audio model's depthwise convs: Silero VAD v4): the 2-D kernel over planes
            # of one row, instead of numpy's multiply-add per tap over the whole tensor (~60 us
            # a call of Silero v4's four, ~10 with the JIT).
            p.kind = _DW_JIT
            p.wk_shape = (m, 1, ks[0])
            p.big = math.prod(p.yshape) * kprod >= _PARALLEL_MACS
            p.fn, p.unit = jit.depthwise2d, jit.PK_DW2D
            p.jit_args = (1, strides[0], 1, dils[0], 0, begin[0]) + _act.encode(inner)
            p.planes = ((n, c, 1, in_shape[0]), (n, m, 1, out_shape[0]))
        elif depthwise and nd == 2 and jit is not None and length > 0 and min(begin) >= 0:
            p.kind = _DW_JIT
            p.wk_shape = (m,) + tuple(ks)
            p.big = math.prod(p.yshape) * kprod >= _PARALLEL_MACS
            p.fn, p.unit = jit.depthwise2d, jit.PK_DW2D
            p.jit_args = (strides[0], strides[1], dils[0], dils[1], begin[0], begin[1]) + _act.encode(inner)
            same = _same_depthwise(ks, dils, begin, in_shape, out_shape, strides)
            if same is not None and _halving(in_shape, out_shape, strides):
                # Stride 2 on even planes: one pass over the output from the plane's phases.
                p.fn, p.unit = (jit.depthwise3_s2, jit.PK_DW3_S2) if same == 3 else (jit.depthwise5_s2, jit.PK_DW5_S2)
                p.jit_args = _act.encode(inner)
            elif same is not None and (tuple(out_shape) == in_shape or in_shape[0] * in_shape[1] * kprod <= _SUBSAMPLE_MAX):
                p.fn, p.unit = ((jit.depthwise3_same, jit.PK_DW3_SAME) if same == 3
                                else (jit.depthwise5_same, jit.PK_DW5_SAME))
                p.jit_args = _act.encode(inner)
                if tuple(out_shape) != in_shape:
                    p.full = (n, m) + in_shape
                    p.sub = (slice(None), slice(None), slice(None, (out_shape[0] - 1) * strides[0] + 1, strides[0]),
                             slice(None, (out_shape[1] - 1) * strides[1] + 1, strides[1]))
                p.big = math.prod((n, m) + in_shape) * kprod >= _PARALLEL_MACS
        elif (g == 1 and nd == 2 and jit is not None and length > 0 and _s2_stem(c, m, ks, dils, begin, in_shape,
                                                                                out_shape, strides)):
            # A 3x3 stride-2 stem over even planes: from the input's stride phases (conv3_s2_small).
            p.kind = _DIRECT
            p.wk_shape = (m, c) + tuple(ks)
            p.big = math.prod(p.yshape) * c * kprod >= _PARALLEL_MACS
            p.fn, p.unit = jit.conv3_s2_small, jit.PK_S2_STEM
            p.per_image = True  # (each call splits its images' input planes into phases first)
            p.jit_args = _act.encode(inner)
        elif (g == 1 and nd == 2 and jit is not None and length > 0 and kprod > 1 and c * kprod <= _DIRECT_TAPS
                and m <= (_DIRECT_MAX_OUT if max(strides) == 1 else _DIRECT_MAX_OUT_STRIDED) and min(begin) >= 0):
            # Few taps per output (an RGB stem): the JIT's direct kernel, no im2col (see conv2d_small).
            p.kind = _DIRECT
            p.wk_shape = (m, c) + tuple(ks)
            p.big = math.prod(p.yshape) * c * kprod >= _PARALLEL_MACS
            p.fn, p.unit = jit.conv2d_small, jit.PK_SMALL
            p.per_image = True  # (each call scatters its images' input planes first)
            p.jit_args = (strides[0], strides[1], dils[0], dils[1], begin[0], begin[1]) + _act.encode(inner)
        elif kprod == 1 and not any(begin) and not any(end) and not (
                tiny and m * c <= _TINY_ONE_MAX and c * length <= _GATHER_MAX):
            p.kind = _ONE
            sub = (Ellipsis,) + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out_shape, strides))
            p.sub = None if tuple(out_shape) == in_shape else sub  # all-unit strides: the input itself
            p.cols_shape = (n, g, cg, length)
        elif not depthwise and c * kprod * length <= _GATHER_MAX:
            p.kind = _TINY if tiny else _GATHER
            key = (in_shape, tuple(kernel_shape))
            idx = self._gather.get(key)  # shared by the plans of every batch size
            if idx is None:
                idx = _gather_index(x_shape[1:], ks, out_shape, strides, dils, begin)
                if len(self._gather) < 16:
                    self._gather[key] = idx
            p.idx = idx
            if tiny and p.wm is not None:
                p.idx, p.wm = _tiny_taps(idx, p.wm, c * math.prod(in_shape))
            # (N, 1) for the JIT's gather (gather_cols: one row per image) and numpy's batched one
            p.zero = np.zeros(1 if n == 1 and (jit is None or cd != np.float32) else (n, 1), cd)
            p.cols_shape = (n, g, cg * kprod, length)
        elif (_SHIFT_ON and g == 1 and jit is not None and cd == np.float32 and length > 0 and kprod > 1 and nd <= 2
              and all(s == 1 for s in strides) and min(begin) >= 0
              and ((shift_any and c * kprod <= _SHIFT_TUNED_TAPS) or _shift_fits(c, m, kprod, length, jit.TILE))):
            # Stride 1: every tap of a tile of output positions is a run of consecutive inputs in the
            # padded plane, read in place (conv_shift; no im2col).
            p.extent = _padded_extent(in_shape, begin, out_shape, ks, strides, dils)
            hp, wp = (1, *p.extent) if nd == 1 else p.extent
            ho, wo = (1, *out_shape) if nd == 1 else out_shape
            hp, wp = _shared_gaps(nd, in_shape, begin, hp, wp, wo)
            dh, dw = (1, *dils) if nd == 1 else dils
            kh, kw = (1, *ks) if nd == 1 else ks
            taps = np.array([i * dh * wp + j * dw for i in range(kh) for j in range(kw)], np.int64)
            # The padded input's shape and where the input sits in it (none: the input as it is).
            padded = at = None
            if (hp, wp) != ((1, *in_shape) if nd == 1 else in_shape) or any(begin):
                padded, at = (n, c, hp, wp), ((0, begin[0]) if nd == 1 else tuple(begin))
            _shift_plan(p, jit.TILE, c, taps, [int(taps.max())], hp * wp, wp, ho, wo, kh, kw, padded, at)
        elif (_SHIFT_ON and g == 1 and jit is not None and cd == np.float32 and length > 0 and kprod > 1 and nd == 2
              and tuple(strides) == (2, 2) and tuple(dils) == (1, 1) and min(begin) >= 0
              and c * kprod <= _S2_MAX_TAPS.get(jit.TILE, 0)):
            # Stride 2: the padded input split into its four stride phases (rows and columns even /
            # odd), each a plane of (ho + (kh-1)//2) x (wo + (kw-1)//2); tap (i, j) reads phase
            # (i % 2, j % 2) shifted by (i // 2, j // 2), so a tile of output positions is again a
            # run of consecutive floats per tap and channel: conv_shift over the phases, every
            # tap computed once (im2col + GEMM copied 9 columns per output first).
            ho, wo = out_shape
            kh, kw = ks
            hq, wq = ho + (kh - 1) // 2, wo + (kw - 1) // 2
            pplane = hq * wq
            taps = np.array([(2 * (i % 2) + j % 2) * pplane + (i // 2) * wq + j // 2
                             for i in range(kh) for j in range(kw)], np.int64)
            far: dict[int, int] = {}  # one prefetch stream per phase: its farthest tap
            for t in taps.tolist():
                far[t // pplane] = max(far.get(t // pplane, t), t)
            _shift_plan(p, jit.TILE, c, taps, list(far.values()), 4 * pplane, wq, ho, wo, kh + 2, kw,
                        (n, c, 2, 2, hq, wq), tuple(begin))
            p.phased = True
        elif not depthwise and jit is not None and length > 0 and _jit_im2col(nd, kprod, begin, strides, in_shape,
                                                                                 out_shape):
            p.kind = _IM2COL_JIT
            p.cols_shape = (n, g, cg * kprod, length)
            p.jit_args = (ks[0], ks[1], strides[0], strides[1], dils[0], dils[1], begin[0], begin[1],
                          out_shape[0], out_shape[1])
            p.phased = tuple(strides) == (2, 2) and in_shape[0] % 2 == 0 and in_shape[1] % 2 == 0
            # Output rows per block of the column matrix: about _COLS_BLOCK bytes when it is
            # large and the weight small (each block's GEMM packs the weight again).
            p.chunk = out_shape[0]
            if g == 1 and length >= _COLS_BLOCK_MIN_N * m and 4 * c * kprod * length > 2 * _COLS_BLOCK:
                p.chunk = max(1, _COLS_BLOCK // (4 * c * kprod * out_shape[1]))
        else:
            p.kind = _DW_NUMPY if depthwise else _IM2COL
            p.extent = _padded_extent(in_shape, begin, out_shape, ks, strides, dils)
            p.cols_shape = (n, g, cg * kprod, length)
        if p.kind <= _DIRECT:
            p.count = n * m
            p.zero_bias = np.zeros(m, np.float32)
            if w is None:
                p.wk = np.ascontiguousarray(p.wm.reshape(p.wk_shape))
            p.pre = outer
        elif p.kind == _SHIFT:
            if w is None:
                p.wk = p.wm.reshape(p.wk_shape)
            p.pre = pre
        else:
            # _act.matmul is np.matmul for GEMMs below its split size: call that directly.
            p.small = n * m * (cg * kprod) * length < _act._SPLIT_MACS
            p.pre = pre
        p.post = post
        p.channels = self._channels(cd)
        p.jit = jit if cd == np.float32 else None
        if p.jit is not None:
            p.enc = _act.encode(p.pre) + _act.encode(post)
            p.table = p.channels[1] if p.channels[1] is not None else _EMPTY_CHAN
            p.rows3 = (n, m, length)
        return p

    @staticmethod
    def _block_epilogue(plan: _ConvPlan, y: np.ndarray, bias, res):
        """The epilogue of a batch-1 convolution's output ``y`` (fresh or the caller's, float32,
        C-contiguous) as ``after(r0, r1, c0, c1)`` for :func:`._act.matmul`: the JIT's one pass
        over a block of output channels (rows of the GEMM) or of positions (columns), so that on
        two threads each runs the epilogue of its own block while it is in its cache (one thread
        ran the whole epilogue after the split GEMM: a QDQ ResNet-50's fake-quantization chains,
        ~10 % of its run).  None when the epilogue is not that pass (nothing to do, no JIT, a
        broadcasting residual): then :meth:`_epilogue` runs after the GEMM."""
        jit = plan.jit
        if (jit is None or not plan.length or not plan.m or (bias is None and res is None and not plan.pre)
                or (res is not None and res.shape != y.shape)):
            return None
        codes, params, pcodes, pparams = plan.enc
        b = _EMPTY1 if bias is None else bias
        r = _EMPTY3 if res is None else np.ascontiguousarray(res, dtype=np.float32).reshape(plan.rows3)
        table, length = plan.table, plan.length
        y3 = y.reshape(plan.rows3)

        def after(r0: int, r1: int, c0: int, c1: int) -> None:
            if c1 - c0 == length:  # output channels r0..r1: bias_act on their rows
                rb, rr, rt = _channel_rows(b, r, table, r0, r1)
                jit.bias_act(y3[:, r0:r1], rb, codes, params, rr, pcodes, pparams, rt)
            else:  # positions c0..c1 of every channel
                jit.bias_act_rows(y3, 0, c0, c1 - c0, b, codes, params, r, pcodes, pparams, table)

        # The same epilogue's arrays for a split without the GIL (_act._native_epilogue_split):
        # one image, no per-channel tables, every array C-contiguous float32 as numba reads it.
        if (y3.shape[0] == 1 and not table.shape[0] and _act.c_arrays(_F32, y3, b, params, r, pparams)
                and _act.c_arrays(np.int64, codes, pcodes)):
            after.native = (y3, b, codes, params, r, pcodes, pparams)
        return after

    def _epilogue(self, plan: _ConvPlan, y, bias, res, out_dtype) -> np.ndarray:
        """:meth:`_finish` with the plan's chain: its common case (one JIT pass over a fresh
        C-contiguous float32 ``y``) with what the plan encoded once, the others through _finish."""
        if bias is None and res is None and not plan.pre:  # nothing left (the JIT kernels' bias is done)
            return _act.astype(y, out_dtype)
        jit = plan.jit
        if (jit is not None and plan.length and plan.n and plan.m and y.flags.c_contiguous
                and (res is None or res.shape == y.shape)):
            codes, params, pcodes, pparams = plan.enc
            r = _EMPTY3 if res is None else np.ascontiguousarray(res, dtype=np.float32).reshape(plan.rows3)
            jit.bias_act(y.reshape(plan.rows3), _EMPTY1 if bias is None else bias, codes, params, r, pcodes, pparams,
                         plan.table)
            return _act.astype(y, out_dtype)
        return self._finish(y, bias, plan.pre, res, plan.post, out_dtype, plan.channels)

    def _conv_windows(self, x, b, out, res) -> np.ndarray:
        """The windows path (weight packed by :func:`pack_windows`): the padded input's windows
        times the panels by :func:`._conv_jit.conv_windows` (the bias added there), then the
        epilogue's chain in one pass.  Without the JIT (or on an input it does not take) the
        weight is recovered once and the general path runs."""
        m, k = self._win
        jit = _act.jit() if compute_dtype(x.dtype) == np.float32 else None
        key = ("windows", x.shape, x.dtype)
        plan = self._plans.get(key) if jit is not None else None
        if plan is None and jit is not None and x.ndim == 3 and x.shape[1] == 1:
            ks, strides, dils = self.sp.resolve(1, (k,))
            begin, end, out_shape = conv_geometry(x.shape[2:], ks, strides, dils, self.sp.pads, self.sp.auto_pad)
            if min(begin) >= 0 and min(end) >= 0 and out_shape[0] > 0 and x.shape[0] > 0:
                plan = _ConvPlan()
                plan.kind, plan.n, plan.m, plan.length = _WINDOWS, x.shape[0], m, out_shape[0]
                plan.begin, plan.strides, plan.yshape = begin, strides, (x.shape[0], m, out_shape[0])
                plan.extent = None if not (any(begin) or any(end)) else (x.shape[2] + begin[0] + end[0],)
                plan.chunk, plan.count = _panel_blocks(x.shape[0], m, out_shape[0], jit)
                plan.big = x.shape[0] * m * k * out_shape[0] >= _PARALLEL_MACS
                plan.split = _act.SplitTuner()
                plan.per_image = False
                plan.jit = jit
                if len(self._plans) < 64:
                    self._plans[key] = plan
        if plan is None:
            w = self._w_from_wp
            if w is None:
                w = self._w_from_wp = unpack_windows(self._wp, m, k)
            return self._conv(x, w, b, out, res)
        xp, bias, y = self._panel_inputs(plan, x, b, out)
        _run_items(jit.conv_windows, (xp, self._wp, y, plan.strides[0], bias, plan.chunk), plan, _panel_units)
        return self._finish(y, None, self._pre, res, self._post, x.dtype, self._channels(np.float32))

    def _panel_inputs(self, plan: _ConvPlan, x, b, out) -> tuple:
        """The arguments of the panel kernels (conv_windows, conv_bcast) for one call by
        ``plan``: the input as float32 (N, -1), padded in this thread's scratch when the plan has
        an ``extent``; the bias (checked; empty when absent); the output, ``out`` when it fits."""
        bias = _EMPTY1
        if b is not None:
            bias = as_compute(b).astype(np.float32, copy=False)
            if bias.shape != (plan.m,):
                raise InvalidArgument(
                    f"node {self.node.name!r} (Conv): bias must have shape [{plan.m}], got {list(bias.shape)}")
        xp = as_compute(x).astype(np.float32, copy=False)
        if plan.extent is not None:  # the padded copy, in this thread's scratch
            xp = _pad(xp, plan.begin, plan.extent, 0, "pad")
        xp = np.ascontiguousarray(xp).reshape(plan.n, -1)
        if out is not None and out.shape == plan.yshape and out.dtype == np.float32 and out.flags.c_contiguous:
            return xp, bias, out
        return xp, bias, np.empty(plan.yshape, np.float32)

    def _conv_winograd(self, x, b, out, res) -> np.ndarray:
        """The Winograd path (weight packed as ``U``); the epilogue's activations before a
        residual run inside the output transform.  Where a call has enough tiles for Winograd,
        the first call of its geometry in the process times it against the direct path (the
        filters recovered from ``U``), and the faster one runs (:func:`._act.faster_path`)."""
        u = self._u
        c_w = u.shape[2]
        xc = as_compute(x)
        if xc.ndim != 4 or xc.shape[1] != c_w:
            raise InvalidArgument(
                f"node {self.node.name!r} (Conv): input of shape {list(x.shape)} does not fit a 3x3 weight of "
                f"{c_w} input channels")
        key = ("winograd", xc.shape)
        geo = self._plans.get(key)
        if geo is None:  # once per input shape, as _conv's plans
            ks, strides, dils = self.sp.resolve(2, (3, 3))
            begin, end, out_shape = conv_geometry(xc.shape[2:], ks, strides, dils, self.sp.pads, self.sp.auto_pad)
            tiles = xc.shape[0] * (-(-out_shape[0] // 2)) * (-(-out_shape[1] // 2))
            # (its PathChoice: None when Winograd always runs)
            geo = [begin, out_shape, tiles >= _WINO_MIN_TILES, _act.PathChoice() if _WINO_TUNED else None]
            if len(self._plans) < 64:
                self._plans[key] = geo
        begin, out_shape, enough, choice = geo
        if not enough:
            # Too few tiles for 16 GEMMs to pay (resnet's 7x7 maps: 16 tiles, 2x slower than one
            # GEMM): the direct path.
            return self._conv_direct(x, b, out, res)
        path = 0 if choice is None else choice.settled()
        if path is None:
            # The choice is the geometry's (shape, channels, padding, thread mode), for every
            # Conv and session of the process; its measuring calls write no caller's buffer.
            path, y = self._path(
                choice, "winograd", ("conv3x3", xc.shape, u.shape[1], tuple(begin), tuple(out_shape)),
                lambda: self._winograd_call(x, xc, b, None, res, begin, out_shape),
                lambda: self._conv_direct(x, b, None, res), res)
            if path == 0 and not any(type(g) is list and g[3] is not None and g[3].takes(1)
                                     for g in self._plans.values()):
                self._w_from_u = self._bc = None  # Winograd runs: the recovered filters go
            if y is not None:
                return _into(out, y)
        if path:
            return self._conv_direct(x, b, out, res)
        return self._winograd_call(x, xc, b, out, res, begin, out_shape)

    def _conv_direct(self, x, b, out, res) -> np.ndarray:
        """A Winograd-packed conv computed directly: by :meth:`_conv_bcast` where its panels fit
        (``_BCAST_MIN_FILL``, ``_BCAST_MIN_K``) and the JIT runs, else by the general path on the
        recovered filters."""
        m, c = self._u.shape[1:]
        if _BCAST_ON and _bcast_fits(m, c, 9) and compute_dtype(x.dtype) == np.float32 and _act.jit() is not None:
            y = self._conv_bcast(x, (m, c, 3, 3), b, out, res)
            if y is not None:
                return y
        return self._conv(x, self._direct_weight(), b, out, res)

    def _bcast_panels(self) -> np.ndarray:
        """:func:`._conv_jit.conv_bcast`'s panels: the conv_bc pack, or a Winograd conv's filters
        recovered from ``U`` and laid out as panels once (the filters themselves not kept for it)."""
        w = self._bc
        if w is None:
            f = self._w_from_u if self._w_from_u is not None else _winograd.weight_untransform(self._u)
            w = self._bc = pack_windows(f.reshape(f.shape[0], 1, -1))
        return w

    def _conv_bcast_packed(self, x, b, out, res) -> np.ndarray:
        """A conv packed as conv_bcast's panels (family conv_bc): the first call of a geometry in
        the process times :meth:`_conv_bcast` against the general path on the filters recovered
        from the panels (:func:`._act.faster_path`, by :meth:`_path`), and the faster runs from
        then on; the recovered filters are let go once no geometry of this Conv uses them.
        Without the JIT, or on an input conv_bcast does not take, the general path."""
        plan = self._bcast_plan(x, self._bcw) if compute_dtype(x.dtype) == np.float32 and _act.jit() else None
        if plan is None:
            return self._conv(x, self._bcast_filters(), b, out, res)
        path = plan.choice.settled()
        if path is None:
            path, y = self._path(
                plan.choice, "bcast", ("conv_bc", x.shape, self._bcw, plan.strides, plan.dils, tuple(plan.begin),
                                       plan.yshape),
                lambda: self._conv_bcast(x, self._bcw, b, None, res),
                lambda: self._conv(x, self._bcast_filters(), b, None, res), res)
            if not any(type(p) is _ConvPlan and p.kind == _BCAST and p.choice.takes(1) for p in self._plans.values()):
                self._w_from_bc = None  # conv_bcast runs every geometry so far: the recovered filters go
            if y is not None:
                return _into(out, y)
        if path:
            return self._conv(x, self._bcast_filters(), b, out, res)
        return self._conv_bcast(x, self._bcw, b, out, res)

    def _bcast_filters(self) -> np.ndarray:
        """The (M, C, KH, KW) filters recovered from a conv_bc pack, once (for the general path)."""
        w = self._w_from_bc
        if w is None:
            m, c, kh, kw = self._bcw
            w = self._w_from_bc = unpack_windows(self._bc, m, c * kh * kw).reshape(m, c, kh, kw)
        return w

    def _conv_bcast(self, x, wshape, b, out, res) -> np.ndarray | None:
        """A one-group 2-D conv of a weight of ``wshape`` (M, C, KH, KW) by
        :func:`._conv_jit.conv_bcast` on :meth:`_bcast_panels`: the padded input in this thread's
        scratch, the bias and the epilogue's chain in the kernel, item by item (a broadcasting
        residual after it, by numpy's rules).  None for an input it does not take (cropping pads,
        no output): the caller's general path then."""
        plan = self._bcast_plan(x, wshape)
        if plan is None:
            return None
        xp, bias, y = self._panel_inputs(plan, x, b, out)
        if plan.enc is None:  # the epilogue's chain, encoded once
            channels = self._channels(np.float32)
            plan.enc = _act.encode(self._pre) + _act.encode(self._post)
            plan.table = channels[1] if channels[1] is not None else _EMPTY_CHAN
        y3 = y.reshape(plan.n, plan.m, -1)
        if res is not None and res.shape != y.shape:  # a broadcasting residual: numpy's rules, after
            args = (xp, self._bcast_panels(), y3, plan.bases, plan.koffs, bias) + _NO_EPILOGUE + (plan.chunk,)
            _run_items(plan.jit.conv_bcast, args, plan, _panel_units)
            return self._finish(y, None, self._pre, res, self._post, x.dtype, self._channels(np.float32))
        codes, params, pcodes, pparams = plan.enc
        r = _EMPTY3 if res is None else np.ascontiguousarray(res, dtype=np.float32).reshape(y3.shape)
        args = (xp, self._bcast_panels(), y3, plan.bases, plan.koffs, bias, codes, params, r, pcodes, pparams,
                plan.table, plan.chunk)
        _run_items(plan.jit.conv_bcast, args, plan, _panel_units)
        return _act.astype(y, x.dtype)

    def _bcast_plan(self, x, wshape) -> _ConvPlan | None:
        """:meth:`_conv_bcast`'s plan for ``x``'s shape, made once: output position ``p``'s window
        starts at ``bases[p]`` of the padded image (strides), its (channel, tap) ``k`` sits
        ``koffs[k]`` further (dilations); items of ``chunk`` positions by 64 channels, as
        conv_windows'.  None where it does not apply (no JIT, cropping pads, no output)."""
        key = ("bcast", x.shape)
        if key in self._plans:
            return self._plans[key]
        jit = _act.jit()
        m, c = wshape[:2]
        plan = None
        if x.ndim == 4 and x.shape[1] == c and jit is not None:
            ks, strides, dils = self.sp.resolve(2, wshape[2:])
            begin, end, out_shape = conv_geometry(x.shape[2:], ks, strides, dils, self.sp.pads, self.sp.auto_pad)
            n, length = x.shape[0], math.prod(out_shape)
            if min(begin) >= 0 and min(end) >= 0 and length > 0 and n > 0:
                plan = _ConvPlan()
                plan.kind, plan.n, plan.m, plan.length, plan.begin = _BCAST, n, m, length, begin
                plan.strides, plan.dils, plan.choice, plan.jit, plan.enc = strides, dils, _act.PathChoice(), jit, None
                plan.yshape = (n, m) + tuple(out_shape)
                plan.extent = None if not (any(begin) or any(end)) else tuple(
                    s + a + z for s, a, z in zip(x.shape[2:], begin, end))
                hp, wp = plan.extent if plan.extent is not None else x.shape[2:]
                (sh, sw), (dh, dw) = strides, dils
                plan.bases = ((np.arange(out_shape[0], dtype=np.int64) * (sh * wp))[:, None]
                              + np.arange(out_shape[1], dtype=np.int64) * sw).reshape(-1)
                plan.koffs = ((np.arange(c, dtype=np.int64) * (hp * wp))[:, None, None]
                              + (np.arange(ks[0], dtype=np.int64) * (dh * wp))[:, None]
                              + np.arange(ks[1], dtype=np.int64) * dw).reshape(-1)
                plan.chunk, plan.count = _panel_blocks(n, m, length, jit)
                plan.big = n * m * c * ks[0] * ks[1] * length >= _PARALLEL_MACS
                plan.split = _act.SplitTuner()
                plan.per_image = False
        if len(self._plans) < 64:
            self._plans[key] = plan
        return plan

    def _direct_weight(self) -> np.ndarray:
        """The (M, C, 3, 3) filters recovered from ``U`` (G's left inverse, float64), once: for
        the direct path, without keeping a second pack of every weight."""
        w = self._w_from_u
        if w is None:
            w = self._w_from_u = _winograd.weight_untransform(self._u)
        return w

    def _winograd_call(self, x, xc, b, out, res, begin, out_shape) -> np.ndarray:
        """One call of the Winograd path proper (the direct one for a non-finite input)."""
        out_dtype = x.dtype
        m = self._u.shape[1]
        bias = None if b is None else as_compute(b).astype(np.float32, copy=False)
        if bias is not None and bias.shape != (m,):
            raise InvalidArgument(
                f"node {self.node.name!r} (Conv): bias must have shape [{m}], got {list(bias.shape)}")
        inner, outer = ((), self._pre) if self._has_channel else (self._pre, ())
        y = _winograd.conv3x3(xc, self._u, bias, begin, out_shape, inner)
        if y is None:  # a non-finite input: the transforms would spread it (inf - inf)
            return self._conv_direct(x, b, out, res)
        return _into(out, self._finish(y, None, outer, res, self._post, out_dtype, self._channels(y.dtype)))

    @staticmethod
    def _finish(y, bias, pre, res, post, out_dtype, channels=((), None)) -> np.ndarray:
        """The epilogue in place on the fresh ``y`` (n, m, *spatial): ``post(pre(y + bias) + res)``,
        one JIT pass when possible, then the cast to the output dtype.  ``channels``: the
        per-channel steps' tables (:meth:`_channels`)."""
        n, m = y.shape[:2]
        if res is not None and res.shape != y.shape:  # a broadcasting residual: numpy's rules
            y = Conv._finish(y, bias, pre, None, (), y.dtype, channels)
            y = y + as_compute(res).astype(y.dtype, copy=False)
            return Conv._finish(y, None, post, None, (), out_dtype, channels)
        jit = _act.jit() if y.dtype == np.float32 and y.flags.c_contiguous else None
        if jit is not None and (bias is not None or pre or res is not None) and y.size:
            codes, params = _act.encode(pre)
            pcodes, pparams = _act.encode(post)
            r = _EMPTY3 if res is None else np.ascontiguousarray(res, dtype=np.float32).reshape(n, m, -1)
            table = channels[1] if channels[1] is not None else _EMPTY_CHAN
            jit.bias_act(y.reshape(n, m, -1), _EMPTY1 if bias is None else bias, codes, params, r, pcodes, pparams,
                         table)
        else:
            if bias is not None:
                y += bias.reshape((1, m) + (1,) * (y.ndim - 2))
            _act.apply_channels(y, pre, channels[0])
            if res is not None:
                y += as_compute(res).astype(y.dtype, copy=False)
                _act.apply_channels(y, post, channels[0])
        if y.dtype != out_dtype:
            y = y.astype(out_dtype)
        return y

    @staticmethod
    def _depthwise(xp, wm, ks, out, strides, dils) -> np.ndarray:
        """kh*kw multiply-adds over the whole tensor, one per kernel tap.

        With unit strides every tap's window is one contiguous run of the flattened padded
        image (rows keep their padded width; the extra columns are cut at the end), so numpy's
        inner loops run over thousands of elements instead of one output row: measured 2.4x
        faster than strided 2-D windows for 96 channels at 56x56.
        """
        n, c = xp.shape[:2]
        taps = wm.reshape(c, -1)
        offsets = list(itertools.product(*(range(s) for s in ks)))
        if all(s == 1 for s in strides):
            pshape = xp.shape[2:]
            flat = np.ascontiguousarray(xp).reshape(n, c, -1)
            pstrides = [int(np.prod(pshape[i + 1 :])) for i in range(len(pshape))]
            length = sum((o - 1) * ps for o, ps in zip(out, pstrides)) + 1
            full = (out[0],) + tuple(pshape[1:])
            y = np.zeros((n, c, int(np.prod(full))), dtype=xp.dtype)
            yv = y[..., :length]
            tmp = np.empty((n, c, length), dtype=xp.dtype)
            for k, offset in enumerate(offsets):
                start = sum(o * d * ps for o, d, ps in zip(offset, dils, pstrides))
                np.multiply(flat[..., start : start + length], taps[:, k].reshape(1, c, 1), out=tmp)
                yv += tmp
            y = y.reshape((n, c) + full)
            return y[(Ellipsis,) + tuple(slice(0, o) for o in out[1:])]
        bshape = (1, c) + (1,) * len(out)
        y = np.empty((n, c) + tuple(out), dtype=xp.dtype)
        tmp = np.empty_like(y)
        for k, offset in enumerate(offsets):
            win = xp[(Ellipsis,) + _window(offset, out, strides, dils)]
            if k == 0:
                np.multiply(win, taps[:, k].reshape(bshape), out=y)
            else:
                np.multiply(win, taps[:, k].reshape(bshape), out=tmp)
                y += tmp
        return y


# -- ConvTranspose ------------------------------------------------------------------------------


@register("ConvTranspose", since=1)
class ConvTranspose(Kernel):
    """Transposed convolution: GEMM of the transposed weight with the input, then col2im."""

    op_type = "ConvTranspose"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.sp = _SpatialAttrs(self)
        self.group = int(self.attr("group", 1))
        if self.group < 1:
            raise InvalidArgument(f"node {node.name!r} ({node.op_type}): attribute group must be >= 1, got {self.group}")
        self.output_padding = self.attr("output_padding")
        self.output_shape = self.attr("output_shape")
        self._w: np.ndarray | None = None  # packed (g, M/g, *kernel, C/g)

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        if input_index != 1 or compute_dtype(info.dtype) is None or len(info.shape) < 3:
            return None
        if info.shape[0] % self.group:
            return None
        return PackSpec("convtranspose", _PACK_VERSION, struct.pack("<q", self.group), 1)

    def expected_packed(self, input_index: int, info: TensorInfo):
        if self.pack_spec(input_index, info) is None:
            return None
        c = info.shape[0]
        g = self.group
        return [(compute_dtype(info.dtype), (g,) + tuple(info.shape[1:]) + (c // g,))]

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        c = weight.shape[0]
        g = self.group
        wt = weight.reshape((g, c // g) + weight.shape[1:])
        wt = np.moveaxis(wt, 1, -1)  # (g, M/g, *kernel, C/g)
        return (np.ascontiguousarray(wt, dtype=compute_dtype(weight.dtype)),)

    def use_prepacked(self, input_index: int, buffers: tuple[np.ndarray, ...]) -> None:
        (self._w,) = buffers

    def run(self, x, w=None, b=None):
        out_dtype = x.dtype
        if compute_dtype(x.dtype) is None:
            raise InvalidArgument(f"node {self.node.name!r}: ConvTranspose on {x.dtype} is not supported natively")
        g = self.group
        xc = as_compute(x)
        n, c = xc.shape[:2]
        nd = xc.ndim - 2
        if self._w is not None:
            mg, wk = self._w.shape[1], tuple(self._w.shape[2:-1])
            wt = self._w.reshape(g, -1, self._w.shape[-1])
        else:
            mg, wk = w.shape[1], tuple(w.shape[2:])
            wt = as_compute(w).reshape(g, w.shape[0] // g, -1).transpose(0, 2, 1)
        if wt.dtype != xc.dtype:
            wt = wt.astype(xc.dtype)
        ks, strides, dils = self.sp.resolve(nd, wk)
        in_shape = xc.shape[2:]
        opad = _ints(self.output_padding, nd, 0)[:nd]
        natural = [(i - 1) * s + (k - 1) * d + 1 + op for i, s, k, d, op in zip(in_shape, strides, ks, dils, opad)]
        if self.output_shape is not None and len(self.output_shape) > 0:
            out = tuple(int(v) for v in self.output_shape[-nd:])
            totals = [nat - o for nat, o in zip(natural, out)]
            for i, (t, s) in enumerate(zip(totals, strides)):
                if t <= -s:  # (onnxruntime's check: the input would have had more positions)
                    raise InvalidArgument(
                        f"node {self.node.name!r} (ConvTranspose): output_shape {list(out)} is inconsistent with the "
                        f"input's spatial dims {list(in_shape)} (axis {i}: at most {natural[i] + s - 1} for stride {s}, "
                        f"kernel {ks[i]}, dilation {dils[i]}, output_padding {opad[i]})")
            # A larger output than the natural one keeps the result at the start and the extra
            # positions (the bias alone) at the end, as onnxruntime and onnx.reference place it.
            begin = [0 if t < 0 else b for t, b in zip(totals, self._split_total(totals))]
        elif self.sp.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = tuple(i * s for i, s in zip(in_shape, strides))
            begin = self._split_total([nat - o for nat, o in zip(natural, out)])
        else:
            p = (0,) * (2 * nd) if self.sp.auto_pad == "VALID" or not self.sp.pads else self.sp.pads
            begin = [int(v) for v in p[:nd]]
            out = tuple(nat - int(p[i]) - int(p[i + nd]) for i, nat in enumerate(natural))
        m = mg * g
        cg = c // g
        lin = math.prod(in_shape)
        cols = np.matmul(wt, xc.reshape(n, g, cg, lin))  # (n, g, mg*K, lin)
        cols = cols.reshape((n, m) + tuple(ks) + tuple(in_shape))
        # Full (uncropped) output, shifted so that negative begin pads stay in bounds.
        lo = [min(0, bg) for bg in begin]
        full = tuple(max(o + bg, nat) - l for o, bg, nat, l in zip(out, begin, natural, lo))
        y_full = np.zeros((n, m) + full, dtype=xc.dtype)
        for offset in itertools.product(*(range(k) for k in ks)):
            dst = tuple(
                slice(k * d - l, k * d - l + (i - 1) * s + 1, s)
                for k, d, l, i, s in zip(offset, dils, lo, in_shape, strides)
            )
            y_full[(Ellipsis,) + dst] += cols[(slice(None), slice(None)) + offset]
        crop = tuple(slice(bg - l, bg - l + o) for bg, l, o in zip(begin, lo, out))
        y = y_full[(Ellipsis,) + crop]
        if b is not None:
            y = y + as_compute(b).astype(y.dtype, copy=False).reshape((1, m) + (1,) * nd)
        y = np.ascontiguousarray(y, dtype=out_dtype)
        return (y,)

    def _split_total(self, totals):
        """Begin pads from total paddings: SAME_UPPER puts the odd element at the end."""
        if self.sp.auto_pad == "SAME_UPPER":
            return [t // 2 for t in totals]
        return [t - t // 2 for t in totals]


@register("DeformConv", since=19)
class DeformConv(Kernel):
    """Deformable convolution (v1, and v2 with ``mask``): each kernel tap reads the input at its
    regular position plus a learned (dy, dx) offset, bilinearly (torchvision's rule: 0 outside
    (-1, size), missing corners 0), times the mask, then the grouped convolution.  2-D.
    Vectorized: the sampled columns of every offset group at once, then one GEMM per group
    (onnx.reference's loop took 520 s for an 8 x 16 x 3 x 3 conv of a 32 x 32 map)."""

    op_type = "DeformConv"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.group = int(self.attr("group", 1))
        self.offset_group = int(self.attr("offset_group", 1))
        self.kernel_shape = self.attr("kernel_shape")
        self.strides = [int(v) for v in self.attr("strides", [1, 1])]
        self.dilations = [int(v) for v in self.attr("dilations", [1, 1])]
        self.pads = [int(v) for v in self.attr("pads", [0, 0, 0, 0])]
        if self.group < 1 or self.offset_group < 1 or len(self.strides) != 2 or len(self.dilations) != 2 \
                or len(self.pads) != 4:
            raise InvalidArgument(f"node {node.name!r} (DeformConv): 2-D only, with group / offset_group >= 1, "
                                  f"2 strides, 2 dilations and 4 pads")

    def run(self, x, w, offset, b=None, mask=None):
        name = self.node.name
        if x.ndim != 4 or w.ndim != 4:
            raise InvalidArgument(f"node {name!r} (DeformConv): X and W must be 4-D, got {list(x.shape)}, {list(w.shape)}")
        n, c, h, wd = x.shape
        oc, cg, kh, kw = w.shape
        if self.kernel_shape and [int(v) for v in self.kernel_shape] != [kh, kw]:
            raise InvalidArgument(f"node {name!r} (DeformConv): kernel_shape {list(self.kernel_shape)} != W's {[kh, kw]}")
        g, og = self.group, self.offset_group
        sh, sw = self.strides
        dh, dw = self.dilations
        pt, pl, pb, pr = self.pads
        outh = (h + pt + pb - (dh * (kh - 1) + 1)) // sh + 1
        outw = (wd + pl + pr - (dw * (kw - 1) + 1)) // sw + 1
        k = kh * kw
        if c % g or oc % g or cg * g != c or c % og or outh < 1 or outw < 1 \
                or offset.shape != (n, og * 2 * k, outh, outw) \
                or (mask is not None and mask.shape != (n, og * k, outh, outw)):
            raise InvalidArgument(
                f"node {name!r} (DeformConv): shapes do not fit (X {list(x.shape)}, W {list(w.shape)}, offset "
                f"{list(offset.shape)}, mask {None if mask is None else list(mask.shape)}, group {g}, offset_group {og}, "
                f"output {outh} x {outw})")
        cd = np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)
        xf = x.astype(cd, copy=False)
        off = offset.astype(cd, copy=False).reshape(n, og, k, 2, outh * outw)
        base_h = (np.arange(outh) * sh - pt)[:, None] + np.zeros(outw, np.int64)[None, :]
        base_w = (np.arange(outw) * sw - pl)[None, :] + np.zeros(outh, np.int64)[:, None]
        tap_h = (np.arange(kh) * dh).repeat(kw)
        tap_w = np.tile(np.arange(kw) * dw, kh)
        ph = base_h.reshape(1, 1, 1, -1) + tap_h.reshape(1, 1, k, 1) + off[:, :, :, 0]  # (n, og, k, P)
        pw = base_w.reshape(1, 1, 1, -1) + tap_w.reshape(1, 1, k, 1) + off[:, :, :, 1]
        inside = (ph > -1) & (ph < h) & (pw > -1) & (pw < wd)
        h0 = np.floor(ph)
        w0 = np.floor(pw)
        lh, lw = ph - h0, pw - w0
        h0, w0 = h0.astype(np.int64), w0.astype(np.int64)
        scale = inside.astype(cd)
        if mask is not None:
            scale = scale * mask.astype(cd, copy=False).reshape(n, og, k, outh * outw)
        cpo = c // og
        xg = xf.reshape(n, og, cpo, h * wd)
        cols = np.zeros((n, og, cpo, k, outh * outw), cd)
        for hi, wh in ((h0, 1 - lh), (h0 + 1, lh)):
            for wi, ww in ((w0, 1 - lw), (w0 + 1, lw)):
                ok = (hi >= 0) & (hi < h) & (wi >= 0) & (wi < wd)
                flat = np.where(ok, hi * wd + wi, 0)  # (n, og, k, P)
                weight = np.where(ok, wh * ww, 0) * scale
                vals = np.take_along_axis(xg, flat.reshape(n, og, 1, -1), axis=3).reshape(n, og, cpo, k, -1)
                cols += vals * weight[:, :, None]
        cols = cols.reshape(n, g, (c // g) * k, outh * outw)
        wm = w.astype(cd, copy=False).reshape(g, oc // g, cg * k)
        y = np.matmul(wm[None], cols).reshape(n, oc, outh, outw)
        if b is not None:
            y += b.astype(cd, copy=False).reshape(1, -1, 1, 1)
        return (y.astype(x.dtype, copy=False),)


@register("CausalConvWithState", domain="com.microsoft", since=1)
class CausalConvWithState(Kernel):
    """Stateful causal depthwise 1-D convolution (LFM2's short convolutions as onnxruntime-genai's
    builder writes them; Mamba / Gated DeltaNet): per channel, ``seq = past_state ++ input``
    (zeros without a state), ``y[t] = act(bias + sum_j w[j] * seq[S + t - (K - 1 - j) * dilation])``
    with ``S = (K - 1) * dilation``, summed from tap 0 in float32 as onnxruntime's CPU kernel
    does; ``present_state`` is the last ``S`` values of ``seq`` (with ``state_window = W``, the
    state after each of the last W positions, zeros before the call's first; ``past_state`` is
    then read from slot W - 1).  ``channels_last`` takes (B, L, d...) activations and states.
    ndim 2 and 3 and the CUDA-only attributes are not implemented (the node is refused)."""

    op_type = "CausalConvWithState"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        what = f"node {node.name!r} (CausalConvWithState)"
        self.what = what
        if int(self.attr("ndim", 1)) != 1:
            raise NotImplementedError(f"{what}: ndim {self.attr('ndim')} (only 1 is implemented)")
        for name, default in (("state_update_capacity", 0), ("state_length", 0), ("input_channel_offset", 0),
                              ("input_channels", 0), ("state_channels_last", -1)):
            if int(self.attr(name, default)) != default:
                raise NotImplementedError(f"{what}: {name} (a CUDA-only attribute)")
        self.dilation = int(self.attr("dilation", 1))
        self.window = int(self.attr("state_window", 0))
        self.channels_last = int(self.attr("channels_last", 0)) == 1
        act = self.attr("activation", "none") or "none"
        if act not in ("none", "silu", "swish") or self.dilation < 1 or not 0 <= self.window <= 8:
            raise InvalidArgument(f"{what}: activation {act!r} (none, silu or swish), dilation {self.dilation} (>= 1), "
                                  f"state_window {self.window} (0-8)")
        self.silu = act != "none"

    def run(self, x, w, bias=None, past=None):
        what = self.what
        if x is None or w is None or x.ndim < 3 or w.ndim != 3 or w.shape[1] != 1:
            raise InvalidArgument(f"{what}: input must be (B, C, L) (or (B, L, d...) channels-last) and weight "
                                  f"(C, 1, K), got {None if x is None else list(x.shape)} and "
                                  f"{None if w is None else list(w.shape)}")
        if not self.channels_last and x.ndim != 3:
            raise InvalidArgument(f"{what}: input must be (B, C, L), got {list(x.shape)}")
        b = x.shape[0]
        if self.channels_last:
            length, lead = x.shape[1], x.shape[2:]
            xc = x.reshape(b, length, -1).transpose(0, 2, 1)
        else:
            length, lead = x.shape[2], None
            xc = x
        c, k = w.shape[0], w.shape[2]
        s = (k - 1) * self.dilation
        if xc.shape[1] != c or (bias is not None and bias.shape != (c,)) or k < 1:
            raise InvalidArgument(f"{what}: {xc.shape[1]} channels, weight {list(w.shape)}, bias "
                                  f"{None if bias is None else list(bias.shape)}")
        f = np.float32
        seq = np.zeros((b, c, s + length), f)
        seq[:, :, s:] = xc
        if past is not None:
            p = past[-1] if self.window else past
            if self.channels_last and p.ndim >= 2:
                p = p.reshape(p.shape[0], p.shape[1], -1).transpose(0, 2, 1)
            if p.shape != (b, c, s):
                raise InvalidArgument(f"{what}: past_state must hold ({b}, {c}, {s}) (batch, channels, "
                                      f"(K - 1) x dilation), got {list(past.shape)}")
            seq[:, :, :s] = p
        wf = w.reshape(c, k).astype(f)
        y = np.zeros((b, c, length), f)
        if bias is not None:
            y += bias.astype(f).reshape(1, c, 1)
        for j in range(k):
            at = s - (k - 1 - j) * self.dilation
            y += wf[:, j, None] * seq[:, :, at:at + length]
        if self.silu:
            y = y / (f(1) + np.exp(-y, dtype=f))
        if self.window:
            present = np.zeros((self.window, b, c, s), f)
            for slot in range(self.window):
                end = length - self.window + slot + 1  # positions of x seen, the prefix's end in seq is s + end
                if end > 0:
                    present[slot] = seq[:, :, end:end + s]
        else:
            present = seq[:, :, length:]
        if self.channels_last:
            y = y.transpose(0, 2, 1).reshape(x.shape)
            moved = np.moveaxis(present, -1, -2)
            present = moved.reshape(moved.shape[:-1] + tuple(lead))
        return (np.ascontiguousarray(y, dtype=x.dtype), np.ascontiguousarray(present, dtype=x.dtype))


@register("CausalConvWithState", since=27)
class CausalConvWithState27(CausalConvWithState):
    """The standard op (opset 27): the contrib op's 1-D channels-first form."""

    domain = ""


@register("Col2Im", since=18)
class Col2Im(Kernel):
    """The inverse of im2col (torch's ``nn.Fold``): each column's blocks added into the image,
    overlaps summed, padding cropped; any number of spatial axes.  One strided slice-add per
    block position (onnx.reference looped per element: 1.5 s for 16 x 3 x 3 blocks of 32 x 32)."""

    op_type = "Col2Im"

    def run(self, x, image_shape, block_shape):
        name = self.node.name
        image = [int(v) for v in np.asarray(image_shape).reshape(-1)]
        block = [int(v) for v in np.asarray(block_shape).reshape(-1)]
        nd = len(image)
        dil = [int(v) for v in self.attr("dilations", [1] * nd)]
        strides = [int(v) for v in self.attr("strides", [1] * nd)]
        pads = [int(v) for v in self.attr("pads", [0] * (2 * nd))]
        kprod = math.prod(block)
        if x.ndim != 3 or len(block) != nd or len(dil) != nd or len(strides) != nd or len(pads) != 2 * nd \
                or kprod == 0 or x.shape[1] % kprod:
            raise InvalidArgument(f"node {name!r} (Col2Im): input (N, C * prod(block), L) with {nd}-D image, block, "
                                  f"dilations, strides and 2x pads, got input {list(x.shape)}, block {block}")
        counts = [(image[d] + pads[d] + pads[d + nd] - dil[d] * (block[d] - 1) - 1) // strides[d] + 1 for d in range(nd)]
        if math.prod(counts) != x.shape[2] or min(counts) < 1:
            raise InvalidArgument(f"node {name!r} (Col2Im): {x.shape[2]} columns, the geometry gives "
                                  f"{' x '.join(map(str, counts))}")
        n, c = x.shape[0], x.shape[1] // kprod
        full = [image[d] + pads[d] + pads[d + nd] for d in range(nd)]
        if min(image) < 0 or n * c * math.prod(full) > 1 << 31:  # (huge strides let a few columns ask for that)
            raise InvalidArgument(f"node {name!r} (Col2Im): an image of {image} (padded {full}) for {n} x {c} "
                                  f"channels is out of range")
        padded = np.zeros((n, c, *full), x.dtype)
        cols = x.reshape(n, c, kprod, *counts)
        for t, tap in enumerate(itertools.product(*(range(k) for k in block))):
            index = tuple(slice(tap[d] * dil[d], tap[d] * dil[d] + (counts[d] - 1) * strides[d] + 1, strides[d])
                          for d in range(nd))
            padded[(slice(None), slice(None), *index)] += cols[:, :, t]
        crop = tuple(slice(pads[d], pads[d] + image[d]) for d in range(nd))
        return (np.ascontiguousarray(padded[(slice(None), slice(None), *crop)]),)


# -- pools ----------------------------------------------------------------------------------------


class _Pool(Kernel):
    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.sp = _SpatialAttrs(self)
        if self.sp.kernel_shape is None:
            raise InvalidArgument(f"node {node.name!r} ({node.op_type}): kernel_shape is required")
        self.ceil_mode = bool(self.attr("ceil_mode", 0))
        pads, ks = self.sp.pads, self.sp.kernel_shape
        if pads and self.sp.auto_pad == "NOTSET" and (
                len(pads) != 2 * len(ks) or any(not 0 <= int(p) < int(ks[i % len(ks)]) for i, p in enumerate(pads))):
            # onnxruntime's rule; a window wholly in the padding has nothing to pool
            raise InvalidArgument(f"node {node.name!r} ({node.op_type}): pads {list(pads)} must be two per axis of "
                                  f"kernel_shape {list(ks)}, non-negative and smaller than the kernel")

    def _empty(self, x, out) -> tuple:
        """The output when an axis has no window (a SAME-padded empty input): an empty tensor."""
        y = np.zeros(x.shape[:2] + tuple(out), x.dtype)
        return (y, np.zeros(y.shape, np.int64)) if getattr(self, "want_indices", False) else (y,)

    def _geometry(self, x):
        nd = x.ndim - 2
        ks, strides, dils = self.sp.resolve(nd)
        begin, end, out = conv_geometry(x.shape[2:], ks, strides, dils, self.sp.pads, self.sp.auto_pad, self.ceil_mode,
                                        pool=True)
        extent = _padded_extent(x.shape[2:], begin, out, ks, strides, dils)
        return ks, strides, dils, begin, end, out, extent


@register("MaxPool", since=1)
class MaxPool(_Pool):
    """Max pooling; optional Indices output (flat index into the unpadded input, row- or column-major)."""

    op_type = "MaxPool"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.storage_order = int(self.attr("storage_order", 0))
        self.want_indices = len(node.output) > 1 and bool(node.output[1])

    def run(self, x):
        ks, strides, dils, begin, end, out, extent = self._geometry(x)
        if 0 in out:
            return self._empty(x, out)
        if (x.dtype in (np.float32, np.float16) and x.ndim == 4 and ks[0] > 1 and not self.want_indices and x.size
                and min(out) > 0):
            # Windows of several rows: the JIT's one pass (see _F32_ZERO's comment); float16
            # through float32, exactly (a maximum is one of its values).
            jit = _act.jit()
            if jit is not None:
                y = np.empty(x.shape[:2] + tuple(out), np.float32)
                xf = np.ascontiguousarray(_act.astype(x, np.float32))
                planes = x.shape[0] * x.shape[1]
                # Over threads by blocks of whole planes (each plane's windows are its own; a max
                # is exact, so a split changes no bit): resnet50's 3x3 stride-2 pool of 64 x
                # 112x112, two threads, 0.31 ms a run on one against onnxruntime's 0.07.
                x3, y3 = xf.reshape((1, planes) + xf.shape[2:]), y.reshape((1, planes) + y.shape[2:])

                def part(lo: int, hi: int) -> None:
                    jit.maxpool2d(x3[:, lo:hi], y3[:, lo:hi], ks[0], ks[1], strides[0], strides[1],
                                  dils[0], dils[1], begin[0], begin[1], _F32_ZERO)

                if y.size >= _act.SPLIT_ELEMENTS:  # (as the other JIT passes: below, its SplitTuner's Python costs more)
                    _act.tuner(("maxpool2d", x.shape, ks, strides, dils, tuple(begin))).run(part, planes, _act.threads())
                else:
                    part(0, planes)
                return (_act.astype(y, x.dtype),)
        if np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16":
            fill = -np.inf
        else:
            fill = np.iinfo(x.dtype).min
        xw = x if x.dtype.name != "bfloat16" else x.astype(np.float32)
        xp = _pad(xw, begin, extent, fill)
        if not self.want_indices:
            y = _separable_reduce(xp, ks, out, strides, dils, np.maximum)
            return (y.astype(x.dtype, copy=False),)
        y = None
        idx = None
        if self.want_indices:
            in_shape = x.shape[2:]
            n, c = x.shape[:2]
            base = (np.arange(n * c, dtype=np.int64) * math.prod(in_shape)).reshape((n, c) + (1,) * len(out))
        for offset in itertools.product(*(range(k) for k in ks)):
            win = xp[(Ellipsis,) + _window(offset, out, strides, dils)]
            if y is None:
                y = win.copy()
                if self.want_indices:
                    idx = np.broadcast_to(self._flat(offset, out, strides, dils, begin, in_shape), y.shape).copy()
                continue
            if self.want_indices:
                better = win > y
                np.copyto(idx, self._flat(offset, out, strides, dils, begin, in_shape), where=better)
                np.copyto(y, win, where=better)
            else:
                np.maximum(y, win, out=y)
        if y.dtype != x.dtype:
            y = y.astype(x.dtype)
        if self.want_indices:
            return (y, idx + base)
        return (y,)

    def _flat(self, offset, out, strides, dils, begin, in_shape):
        """Flat input index (within one (n, c) plane) of every output position for one kernel offset."""
        coords = [
            np.clip(np.arange(o) * s + k * d - b, 0, i - 1)
            for o, s, k, d, b, i in zip(out, strides, offset, dils, begin, in_shape)
        ]
        grids = np.meshgrid(*coords, indexing="ij")
        if self.storage_order == 1:
            grids, shape = grids[::-1], tuple(in_shape)[::-1]
        else:
            shape = tuple(in_shape)
        return np.ravel_multi_index(tuple(grids), shape).astype(np.int64)


@register("NhwcMaxPool", domain="com.microsoft", since=1)
class NhwcMaxPool(MaxPool):
    """MaxPool of an 8-bit (N, *spatial, C) tensor: what onnxruntime's NHWC transformer (graph
    optimization level *all*) writes around channels-last QLinearConv, in models saved at that
    level.  The same pooling over the channels-first view, the result made contiguous NHWC."""

    op_type = "NhwcMaxPool"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        if self.want_indices:
            raise InvalidArgument(f"node {node.name!r} (NhwcMaxPool): has one output, got {len(node.output)}")

    def run(self, x):
        if x.dtype.name not in ("int8", "uint8") or x.ndim < 3:
            raise InvalidArgument(f"node {self.node.name!r} (NhwcMaxPool): input must be int8 or uint8 "
                                  f"(N, *spatial, C), got {x.dtype}{list(x.shape)}")
        last = x.ndim - 1
        (y,) = super().run(np.moveaxis(x, last, 1))
        return (np.ascontiguousarray(np.moveaxis(y, 1, last)),)


@register("AveragePool", since=1)
class AveragePool(_Pool):
    """Average pooling; ``count_include_pad`` counts explicit padding but never the ceil_mode overhang."""

    op_type = "AveragePool"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.count_include_pad = int(self.attr("count_include_pad", 0))
        self._ones: dict[int, np.ndarray] = {}  # (_row_sums)

    def run(self, x):
        ks, strides, dils, begin, end, out, extent = self._geometry(x)
        if 0 in out:
            return self._empty(x, out)
        hw = math.prod(ks)
        if (x.dtype == _F32 and tuple(ks) == x.shape[2:] and all(o == 1 for o in out) and not any(begin)
                and not any(end) and all(d == 1 for d in dils) and x.shape[0] * x.shape[1] and hw):
            # One window over each whole plane (resnet's 7x7 pool of a 7x7 map): a global average,
            # one GEMV instead of 2 x 7 strided passes (2,048 x 7x7: ~450 -> ~20 us).
            y = _row_sums(np.ascontiguousarray(x).reshape(-1, hw), self._ones)
            y /= np.float32(hw)
            return (y.reshape(x.shape[:2] + (1,) * len(ks)),)
        xc = as_compute(x) if x.dtype != np.float64 else x
        xp = _pad(xc, begin, extent, 0)
        acc = _separable_reduce(xp, ks, out, strides, dils, np.add)
        # Divisor per output position: how many window taps fall on counted positions, per axis.
        counts = None
        for i, (o, k, s, d, b, n_in) in enumerate(zip(out, ks, strides, dils, begin, x.shape[2:])):
            lo, hi = (-b, n_in + end[i]) if self.count_include_pad else (0, n_in)
            taps = np.arange(o)[:, None] * s + np.arange(k)[None, :] * d - b
            cnt = ((taps >= lo) & (taps < hi)).sum(axis=1).astype(acc.dtype)
            cnt = cnt.reshape((1,) * i + (o,) + (1,) * (len(out) - i - 1))
            counts = cnt if counts is None else counts * cnt
        acc /= np.maximum(counts, 1)
        return (acc.astype(x.dtype, copy=False),)


def _row_sums(rows: np.ndarray, ones_cache: dict[int, np.ndarray]) -> np.ndarray:
    """The sum of each row of a float32 ``rows`` (R, hw), fresh: one GEMV with a ones vector.

    numpy's mean over short rows costs ~80 ns per row (MobileNetV2's 1280 x 7x7: 100 us;
    onnxruntime 10 us); the summation order differs from numpy's pairwise sum by float32
    rounding only.  The vector is made once per spatial size (``ones_cache``, the kernel's):
    inside a model a fresh one cost ~20 us of the call's ~75."""
    hw = rows.shape[1]
    ones = ones_cache.get(hw)
    if ones is None:
        ones = np.ones(hw, np.float32)
        ones.flags.writeable = False
        if len(ones_cache) < 8:
            ones_cache[hw] = ones
    return rows @ ones


def _lp_root(acc: np.ndarray, p: float) -> np.ndarray:
    return np.sqrt(acc, out=acc) if p == 2 else np.power(acc, 1.0 / p, out=acc)


def _lp_powers(x: np.ndarray, p: float) -> np.ndarray:
    xc = np.abs(as_compute(x) if x.dtype != np.float64 else x)
    return xc * xc if p == 2 else np.power(xc, p)


@register("LpPool", since=1)
class LpPool(_Pool):
    """``(sum over the window of |x|^p)^(1/p)``, padding counting as 0 (p: opset 1's float
    attribute, then an int; default 2)."""

    op_type = "LpPool"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.p = float(self.attr("p", 2))
        if self.p <= 0:
            raise InvalidArgument(f"node {node.name!r} (LpPool): p must be positive, got {self.p}")

    def run(self, x):
        ks, strides, dils, begin, end, out, extent = self._geometry(x)
        if 0 in out:
            return self._empty(x, out)
        xp = _pad(_lp_powers(x, self.p), begin, extent, 0)
        acc = _separable_reduce(xp, ks, out, strides, dils, np.add)
        return (_lp_root(acc, self.p).astype(x.dtype, copy=False),)


@register("GlobalLpPool", since=1)
class GlobalLpPool(Kernel):
    """``(sum over all spatial positions of |x|^p)^(1/p)`` per (image, channel), spatial axes kept as 1."""

    op_type = "GlobalLpPool"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self.p = float(self.attr("p", 2))
        if self.p <= 0:
            raise InvalidArgument(f"node {node.name!r} (GlobalLpPool): p must be positive, got {self.p}")

    def run(self, x):
        if x.ndim < 3:
            raise InvalidArgument(f"node {self.node.name!r} (GlobalLpPool): X must be (N, C, D1, ...), "
                                  f"got {list(x.shape)}")
        acc = _lp_powers(x, self.p).sum(axis=tuple(range(2, x.ndim)), keepdims=True)
        return (_lp_root(acc, self.p).astype(x.dtype, copy=False),)


@register("GlobalAveragePool", since=1)
class GlobalAveragePool(Kernel):
    op_type = "GlobalAveragePool"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        self._ones: dict[int, np.ndarray] = {}  # spatial size -> the GEMV's ones vector, kept

    def _mean_rows(self, rows: np.ndarray) -> np.ndarray:
        """The mean of each row of a float32 ``rows`` (R, hw) (see :func:`_row_sums`)."""
        y = _row_sums(rows, self._ones)
        y *= np.float32(1.0 / rows.shape[1])
        return y

    def run(self, x):
        shape = x.shape
        if x.dtype == _F32 and len(shape) == 4 and x.flags.c_contiguous and x.size:
            # The common call (float32 NCHW, contiguous) without the general path's checks.
            return (self._mean_rows(x.reshape(-1, shape[2] * shape[3])).reshape(shape[0], shape[1], 1, 1),)
        xc = as_compute(x) if x.dtype != np.float64 else x
        hw = math.prod(x.shape[2:])
        if xc.dtype == np.float32 and x.ndim >= 3 and hw > 0 and x.shape[0] * x.shape[1] > 0:
            y = self._mean_rows(np.ascontiguousarray(xc).reshape(-1, hw))
            return (y.reshape(x.shape[:2] + (1,) * (x.ndim - 2)).astype(x.dtype, copy=False),)
        return (xc.mean(axis=tuple(range(2, x.ndim)), keepdims=True).astype(x.dtype, copy=False),)


@register("GlobalMaxPool", since=1)
class GlobalMaxPool(Kernel):
    op_type = "GlobalMaxPool"

    def run(self, x):
        axes = tuple(range(2, x.ndim))
        return (x.max(axis=axes, keepdims=True),)


def _fused_activation(name: str, params: tuple) -> list | None:
    """onnxruntime's fused-activation name and parameters as this package's epilogue steps
    (:class:`._act.Activation`), or None for one they do not cover (Tanh: ``named_activation``)."""
    lname = name.lower()
    p = list(params) + [None, None]
    if lname == "relu":
        return [_act.Activation("relu")]
    if lname == "clip":
        return [_act.Activation("clip", -np.inf if p[0] is None else p[0], np.inf if p[1] is None else p[1])]
    if lname == "sigmoid":
        return [_act.Activation("sigmoid")]
    if lname == "leakyrelu":
        return [_act.Activation("leakyrelu", 0.01 if p[0] is None else p[0])]
    if lname == "hardsigmoid":
        return [_act.Activation("hardsigmoid", 0.2 if p[0] is None else p[0], 0.5 if p[1] is None else p[1])]
    if lname == "hardswish":
        return [_act.Activation("hardswish", 1 / 6, 0.5)]
    return None


@register("FusedConv", domain="com.microsoft", since=1)
class OrtFusedConv(Conv):
    """com.microsoft FusedConv, which onnxruntime's extended optimizer writes when it saves a
    model (Conv + Relu / Clip / Sigmoid / Tanh / LeakyRelu / HardSigmoid): ``Y = act(Conv(X, W,
    B) + Z)`` with ``activation`` and ``activation_params``; the Conv is this package's (packed
    weight), the activation applied after it in float32 as the standalone op would be."""

    op_type = "FusedConv"
    domain = "com.microsoft"

    def __init__(self, node, ctx) -> None:
        super().__init__(node, ctx)
        from onnxpack.session.kernels.rnn import named_activation

        params = tuple(float(v) for v in (self.attr("activation_params") or ()))
        name = self.attr("activation", "")
        name = name.decode() if isinstance(name, bytes) else name
        self._acts = _fused_activation(name, params) if name else []
        self._act = named_activation(name, params) if name and self._acts is None else None

    def run(self, x, w=None, b=None, z=None):
        (y,) = super().run(x, w, b)  # (a fresh array: the epilogue runs in place)
        if z is not None:
            y += z
        if self._acts:
            _act.apply(y, self._acts)  # the JIT's one pass when it runs (LeakyRelu by np.where was 24 ms of 64)
        elif self._act is not None:
            y = np.asarray(self._act(y)).astype(y.dtype, copy=False)
        return (y,)

    def run_into(self, outs, x, w=None, b=None, z=None) -> bool:
        return False  # run computes it (the epilogue reads the Conv's result)


@register_fused("conv")
class FusedConv(Conv):
    """A Conv with the elementwise chain that followed it folded in (``session/_fusion.py``).

    * ``multiplier``/``shift`` (float64, per output channel): BatchNormalization and per-channel
      Mul/Add/Sub/Div by constants, folded into the packed weight (``W * multiplier`` per output
      channel, pack family ``conv_bn``; the key covers a digest of both, so other statistics are
      another key) and a shift that replaces the Conv's bias; rounded once to the compute dtype.
    * ``pre``: activations (and scalar affines) applied in place after the bias;
      ``residual``: the node's input 3 is added next (a residual connection), then ``post``.
      With the JIT the whole epilogue is one pass over the Conv's fresh output (depthwise convs:
      inside the convolution itself).
    * ``channels``: the BatchNormalizations after an activation (a QDQ model's
      ``Conv -> Q -> DQ -> BatchNormalization -> Q -> DQ``), one ``(scale, bias, mean, var,
      epsilon)`` per ``Activation("channel", k)`` of the chain (the statistics as arrays, or
      functions returning them, called at the first run): ``x * A + B`` per channel with
      ``A``, ``B`` computed as the BatchNormalization kernel computes them, and applied as it
      applies them (a product, then a sum), so the bits are the unfused nodes'.
    * ``relu=True`` is ``pre=(Activation("relu"),)``.
    """

    def __init__(self, node, ctx, *, multiplier: np.ndarray | None = None,
                 shift: np.ndarray | None = None, relu: bool = False,
                 pre: tuple[Activation, ...] = (), residual: bool = False,
                 post: tuple[Activation, ...] = (), channels: tuple = ()) -> None:
        super().__init__(node, ctx)
        self.multiplier = multiplier
        self.shift = shift
        pre = tuple(pre) + ((Activation("relu"),) if relu and not pre else ())
        self._pre = pre
        self._post = tuple(post)
        self.relu = pre == (Activation("relu"),) and not residual and not post
        self.residual = residual
        self._stats = tuple(channels)
        self._has_channel = any(a.kind == "channel" for a in (*self._pre, *self._post))
        self._fakequant = any(a.kind == "fakequant" for a in (*self._pre, *self._post))
        self._by_dtype: dict = {}
        self._shifts: dict = {}  # compute dtype -> shift in it (the bias replacing the Conv's)
        if multiplier is not None:
            h = hashlib.blake2b(digest_size=16)
            h.update(np.ascontiguousarray(multiplier, dtype=np.float64).tobytes())
            h.update(np.ascontiguousarray(shift, dtype=np.float64).tobytes())
            self._fold_digest = h.digest()

    def pack_spec(self, input_index: int, info: TensorInfo) -> PackSpec | None:
        spec = super().pack_spec(input_index, info)
        if spec is None or self.multiplier is None:
            return spec
        if spec.family == "conv_wino":
            return PackSpec("conv_bn_wino", _WINO_VERSION, spec.attrs + self._fold_digest, 1)
        if spec.family == "conv_win":
            return PackSpec("conv_bn_win", _WIN_VERSION, spec.attrs + self._fold_digest, 1)
        if spec.family == "conv_bc":
            return PackSpec("conv_bn_bc", _BCAST_VERSION, spec.attrs + self._fold_digest, 1)
        return PackSpec("conv_bn", _PACK_VERSION, spec.attrs + self._fold_digest, 1)

    def prepack(self, input_index: int, weight: np.ndarray) -> tuple[np.ndarray, ...]:
        if self.multiplier is None:
            return super().prepack(input_index, weight)
        # Folded in float64 before the layout change (the Winograd transform is linear, but
        # folding first rounds once).
        w = np.asarray(weight, dtype=np.float64) * self.multiplier.reshape((-1,) + (1,) * (weight.ndim - 1))
        made = super().prepack(input_index, w.astype(compute_dtype(weight.dtype) or np.float32))
        if made is None:
            return None
        (packed,) = made
        return (np.ascontiguousarray(packed),)

    def _channels(self, dtype):
        got = self._by_dtype.get(dtype)
        if got is None:
            if not self._stats:
                got = ((), _EMPTY_CHAN)
            else:
                # Statistics may come as functions (computed at the first run, see _fusion.py).
                stats = [tuple(v() if callable(v) else v for v in st[:4]) + (st[4],) for st in self._stats]
                arrays = tuple(batch_norm_affine(*st, dtype) for st in stats)
                table = None
                if np.dtype(dtype) == np.float32:
                    table = np.ascontiguousarray(np.stack([np.stack(ab, axis=-1) for ab in arrays]), np.float32)
                got = (arrays, table)
            self._by_dtype[dtype] = got
        return got

    def run(self, x, w=None, b=None, r=None):
        return (self._fused(x, w, b, None, r),)

    # (Conv's: its plans encode this kernel's epilogue; it declines a residual, a folded
    # multiplier and anything but float32)
    fixed = Conv.fixed

    def run_into(self, outs, x, w=None, b=None, r=None) -> bool:
        if self.group != 1 or x.ndim < 3 or x.shape[0] != 1 or outs[0].size == 0:
            return False
        if outs[0].dtype != x.dtype or compute_dtype(x.dtype) != x.dtype:
            return False
        return self._fused(x, w, b, outs[0], r) is outs[0]

    def _fused(self, x, w, b, out, r):
        if self.residual and r is None:
            raise InvalidArgument(f"node {self.node.name!r} (Conv): the fused residual input is missing")
        if self._fakequant and x.dtype != np.float32:
            # A fused Q -> DQ pair has a float32 scale, which QuantizeLinear's x must share.
            raise InvalidArgument(f"node {self.node.name!r} (Conv): the QuantizeLinear after it takes float32, "
                                  f"got {x.dtype}")
        if self.multiplier is not None:
            if self._w is None and self._u is None and self._wp is None and self._bc is None:  # not packed (a weight fed at run time, or a dtype BLAS cannot take): fold per call
                # In the input's compute dtype, as the unfused Conv casts the weight: folding in an
                # integer weight's own dtype truncated the multiplier (found by the fuzzer).
                cd = compute_dtype(x.dtype)
                w = w.astype(cd) if cd is not None and w.dtype != cd else as_compute(w)
                w = w * self.multiplier.astype(w.dtype).reshape((-1,) + (1,) * (w.ndim - 1))
            cd = compute_dtype(x.dtype) or np.float32
            b = self._shifts.get(cd)
            if b is None:  # the shift in the compute dtype, once per dtype (read only)
                b = self._shifts[cd] = self.shift.astype(cd)
        return self._conv(x, w, b, out, r if self.residual else None)
