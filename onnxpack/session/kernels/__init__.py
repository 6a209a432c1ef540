"""Native numpy kernels, one module per op family, registered into one registry."""

from __future__ import annotations

from onnxpack.session.kernels._base import (
    Kernel,
    KernelContext,
    PackSpec,
    TensorInfo,
    fused_kernel,
    lookup,
    normalize_domain,
    register_fused,
    register,
    registered_ops,
    release_scratch,
    same_view,
    scratch_releaser,
)

from onnxpack.session.kernels._act import blas_threads, set_owned_threads  # noqa: E402

# Importing the family modules registers their kernels.
from onnxpack.session.kernels import _families  # noqa: F401,E402

__all__ = ["Kernel", "KernelContext", "PackSpec", "TensorInfo", "blas_threads", "fused_kernel", "lookup",
           "normalize_domain", "register", "register_fused", "registered_ops", "release_scratch", "same_view",
           "scratch_releaser", "set_owned_threads"]
