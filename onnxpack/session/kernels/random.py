"""Sampling ops without an onnx.reference implementation: Multinomial.

Multinomial draws ``sample_size`` class indices per row of ``input`` ([batch, classes],
unnormalized log-probabilities).  The values cannot equal onnxruntime's (it draws from C++'s
``std::default_random_engine``); what is kept is its distribution and its conventions, taken from
its CPU kernel where ONNX is silent:

* probabilities are ``exp(logit - max)`` over the row's *finite* logits; a non-finite logit
  (``-inf``, ``+inf``, NaN) has probability 0 and the maximum is taken over finite ones only;
* a sample is ``upper_bound(cdf, u * total)`` for ``u`` uniform in [0, 1) — a row with no finite
  logit has total 0 and yields the index ``classes`` (one past the last class), as onnxruntime's;
* with the ``seed`` attribute the kernel owns one generator seeded with it when the session is
  created, so two sessions of one model draw the same sequence and successive runs of a session
  draw fresh samples (onnxruntime's generator is a member of its kernel too); without it the
  generator is seeded from the OS.

The generator is shared by concurrent runs of the session: draws are serialized by a lock.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from onnxpack.errors import InvalidArgument
from onnxpack.graph._proto import TensorProto
from onnxpack.session.kernels._base import Kernel, KernelContext, register

logger = logging.getLogger(__name__)

__all__ = ["Multinomial"]

_OUTPUT_DTYPES = {TensorProto.INT32: np.dtype(np.int32), TensorProto.INT64: np.dtype(np.int64)}


@register("Multinomial", since=7)
class Multinomial(Kernel):
    op_type = "Multinomial"

    def __init__(self, node, ctx: KernelContext) -> None:
        super().__init__(node, ctx)
        where = f"node {node.name!r} (Multinomial)"
        dtype = int(self.attr("dtype", TensorProto.INT32))
        if dtype not in _OUTPUT_DTYPES:
            raise InvalidArgument(f"{where}: dtype must be int32 (6) or int64 (7), got {dtype}")
        self.dtype = _OUTPUT_DTYPES[dtype]
        self.sample_size = int(self.attr("sample_size", 1))
        if self.sample_size < 1:
            raise InvalidArgument(f"{where}: sample_size must be >= 1, got {self.sample_size}")
        seed = self.attr("seed")
        # onnxruntime narrows the float seed to uint32; keep the same 32 bits.
        self._rng = np.random.default_rng(None if seed is None else int(np.float32(seed)) & 0xFFFFFFFF)
        self._lock = threading.Lock()

    def run(self, x):  # type: ignore[override]
        if x.ndim != 2 or x.dtype.kind != "f":
            raise InvalidArgument(
                f"node {self.node.name!r} (Multinomial): input must be a 2-D float tensor "
                f"[batch_size, class_size], got {x.dtype}{list(x.shape)}")
        logits = np.asarray(x, dtype=np.float64)
        finite = np.isfinite(logits)
        top = np.where(finite, logits, -np.inf).max(axis=1, keepdims=True, initial=-np.inf)
        top = np.where(np.isfinite(top), top, 0.0)
        with np.errstate(over="ignore", invalid="ignore"):
            weights = np.where(finite, np.exp(np.where(finite, logits, 0.0) - top), 0.0)
        cdf = np.cumsum(weights, axis=1)
        total = cdf[:, -1:] if cdf.shape[1] else np.zeros((cdf.shape[0], 1))
        with self._lock:
            u = self._rng.random((x.shape[0], self.sample_size))
        targets = u * total
        out = np.empty((x.shape[0], self.sample_size), dtype=self.dtype)
        for b in range(x.shape[0]):
            out[b] = np.searchsorted(cdf[b], targets[b], side="right")
        return (out,)
