"""onnxruntime's ``capi`` module paths, so code that imports from them runs unchanged.

``onnxpack.capi.onnxruntime_pybind11_state`` (alias ``_pybind_state``) holds onnxruntime's
exception classes (``Fail``, ``InvalidArgument``, ``NoSuchFile``, ``InvalidGraph``,
``RuntimeException``, ``NotImplemented``, ...) — subclasses of :mod:`onnxpack.errors`' — and the
types onnxruntime's native module exports; ``onnxruntime_inference_collection`` the Python-level
classes and ``check_and_normalize_provider_args``.
"""
