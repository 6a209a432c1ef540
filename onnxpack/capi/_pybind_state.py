"""onnxruntime's ``capi._pybind_state``: the same names as ``onnxruntime_pybind11_state``."""

from onnxpack.capi.onnxruntime_pybind11_state import *  # noqa: F403
from onnxpack.capi.onnxruntime_pybind11_state import __all__  # noqa: F401
