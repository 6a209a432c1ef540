"""onnx.backend.base.Backend over InferenceSession, so onnx's conformance suites run on onnxpack.

Usage (as in tests/session/test_backend.py)::

    backend_test = onnx.backend.test.BackendTest(onnxpack.backend, __name__)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from onnxpack.session import InferenceSession, SessionOptions

__all__ = ["OnnxpackBackend", "OnnxpackRep", "prepare", "run_model", "supports_device", "run_node"]


class OnnxpackRep(BackendRep):
    def __init__(self, session: InferenceSession) -> None:
        self.session = session
        self._inputs = [i.name for i in session.get_inputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feed = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feed = dict(zip(self._inputs, inputs))
        return tuple(self.session.run(None, feed))


class OnnxpackBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return device == "CPU"

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"

    @classmethod
    def prepare(cls, model: onnx.ModelProto | str | bytes, device: str = "CPU", **kwargs: Any) -> OnnxpackRep:
        options = SessionOptions()
        for key, value in kwargs.pop("config", {}).items():
            options.add_session_config_entry(key, value)
        source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        return OnnxpackRep(InferenceSession(source, options))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Sequence[Any], device: str = "CPU",
                 outputs_info: Any = None, **kwargs: Any) -> tuple:
        raise NotImplementedError("onnxpack runs whole models; use prepare()")


prepare = OnnxpackBackend.prepare
run_model = OnnxpackBackend.run_model
supports_device = OnnxpackBackend.supports_device
run_node = OnnxpackBackend.run_node
is_compatible = OnnxpackBackend.is_compatible
