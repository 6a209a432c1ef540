"""One small exception hierarchy for everything onnxpack raises on bad input.

Every message names what was being read (tensor, node, file, key), what was expected and what
was found, so a user can fix the input without reading our source.  ``assert`` is reserved for
"Bug:" invariants; user input never reaches one.
"""

from __future__ import annotations

__all__ = [
    "OnnxpackError",
    "ModelLoadError",
    "ExternalDataError",
    "PrepackFormatError",
    "CacheFileError",
    "KernelNotFoundError",
    "InvalidArgument",
    "InvalidGraph",
    "RuntimeFailure",
    "ConfigError",
    "PlannerMemoryError",
    "PrepackWarning",
    # onnxruntime's names (see the section below); onnxpack.capi.onnxruntime_pybind11_state exports them
    "Fail", "InvalidArgumentStatus", "NoSuchFile", "NoModel", "EngineError", "RuntimeException", "InvalidProtobuf",
    "ModelLoaded", "NotImplementedStatus", "InvalidGraphStatus", "EPFail", "ModelLoadCanceled",
    "ModelRequiresCompilation", "NotFound", "DeviceReset", "RuntimeInvalidArgument", "ConfigKeyNotFound",
    "InvalidArgumentType", "Terminated", "as_onnxruntime_error",
]


class OnnxpackError(Exception):
    """Base class of every error onnxpack raises on purpose."""


class ModelLoadError(OnnxpackError):
    """The model file or bytes cannot be parsed or are not a valid model."""


class ExternalDataError(ModelLoadError):
    """An initializer's external data location, offset or length is invalid or unsafe."""


class InvalidGraph(ModelLoadError):
    """The graph cannot be planned: a cycle, an undefined input, a duplicate output."""


class PrepackFormatError(OnnxpackError):
    """A pre-packed entry string or blob is malformed (callers downgrade this to a warning)."""


class CacheFileError(PrepackFormatError):
    """A persistent packed-weight cache file is corrupt, foreign or of a newer version."""


class KernelNotFoundError(OnnxpackError):
    """No kernel (native or fallback) exists for an op in the model's opset."""


class InvalidArgument(OnnxpackError, ValueError):
    """Bad argument from the caller: a missing/unknown input, a wrong dtype or shape, a bad option."""


class ConfigError(InvalidArgument):
    """An unknown ``onnxpack.*`` session config key or an invalid config value."""


class RuntimeFailure(OnnxpackError, RuntimeError):
    """A kernel failed while running; the message names the node and the cause is chained."""


class PlannerMemoryError(OnnxpackError, MemoryError):
    """No memory of the configured hierarchy can hold a tensor; names the tensor and memories."""


class PrepackWarning(UserWarning):
    """A saved pre-packed blob or cache entry was ignored; the weight is re-packed."""


# -- onnxruntime's names ------------------------------------------------------------------------
#
# Code written for onnxruntime catches ``onnxruntime.capi.onnxruntime_pybind11_state.Fail``,
# ``InvalidArgument``, ``NoSuchFile`` ... .  The classes below carry those names and subclass ours,
# and :func:`as_onnxruntime_error` re-types an error of ours in place (same object, message,
# traceback and cause) to the class that is *both* ours and onnxruntime's, so ``except
# errors.ConfigError`` and ``except onnxpack.capi.onnxruntime_pybind11_state.InvalidArgument`` both
# catch it.  ``onnxpack.capi.onnxruntime_pybind11_state`` re-exports them under onnxruntime's path.
# Like onnxruntime's, they are plain ``Exception`` subclasses (onnxruntime's are not RuntimeError);
# where onnxruntime raises a builtin (``RuntimeError``, ``TypeError``) we raise a class that is
# that builtin *and* one of ours.


class Fail(OnnxpackError):
    """onnxruntime's FAIL status (code 1): a kernel failed, a run was terminated, a library failed."""


class InvalidArgumentStatus(InvalidArgument):
    """onnxruntime's INVALID_ARGUMENT status (code 2); exported as ``InvalidArgument``."""


class NoSuchFile(ModelLoadError):
    """onnxruntime's NO_SUCHFILE status (code 3): the model file does not exist."""


class NoModel(OnnxpackError):
    """onnxruntime's NO_MODEL status (code 4)."""


class EngineError(OnnxpackError):
    """onnxruntime's ENGINE_ERROR status (code 5)."""


class RuntimeException(RuntimeFailure):
    """onnxruntime's RUNTIME_EXCEPTION status (code 6)."""


class InvalidProtobuf(ModelLoadError):
    """onnxruntime's INVALID_PROTOBUF status (code 7): the bytes are not a model."""


class ModelLoaded(OnnxpackError):
    """onnxruntime's MODEL_LOADED status (code 8)."""


class NotImplementedStatus(KernelNotFoundError):
    """onnxruntime's NOT_IMPLEMENTED status (code 9): no kernel for an op; exported as ``NotImplemented``."""


class InvalidGraphStatus(InvalidGraph):
    """onnxruntime's INVALID_GRAPH status (code 10); exported as ``InvalidGraph``."""


class EPFail(OnnxpackError):
    """onnxruntime's EP_FAIL status (code 11); never raised (there is no execution provider to fail)."""


class ModelLoadCanceled(OnnxpackError):
    """onnxruntime's MODEL_LOAD_CANCELED status (code 12)."""


class ModelRequiresCompilation(OnnxpackError):
    """onnxruntime's MODEL_REQUIRES_COMPILATION status (code 13)."""


class NotFound(OnnxpackError):
    """onnxruntime's NOT_FOUND status (code 14)."""


class DeviceReset(OnnxpackError):
    """onnxruntime's DEVICE_RESET status; never raised (no device)."""


class RuntimeInvalidArgument(InvalidArgument, RuntimeError):
    """A bad argument that onnxruntime reports as a plain ``RuntimeError`` (an unknown provider,
    a missing config key, a logging severity out of range, an I/O binding that does not fit)."""


class ConfigKeyNotFound(ConfigError, RuntimeError):
    """``get_session_config_entry`` / ``get_run_config_entry`` of a key that was never set."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of the wrong type where onnxruntime raises ``TypeError``."""


class Terminated(RuntimeFailure, Fail):
    """A run stopped because ``RunOptions.terminate`` was set (onnxruntime's FAIL status)."""


class OrtConfigError(ConfigError, InvalidArgumentStatus):
    """A :class:`ConfigError` as onnxruntime's INVALID_ARGUMENT."""


class OrtExternalDataError(ExternalDataError, Fail):
    """An :class:`ExternalDataError` as onnxruntime's FAIL."""


class OrtPrepackFormatError(PrepackFormatError, Fail):
    """A :class:`PrepackFormatError` as onnxruntime's FAIL."""


class OrtCacheFileError(CacheFileError, Fail):
    """A :class:`CacheFileError` as onnxruntime's FAIL."""


class OrtRuntimeFailure(RuntimeFailure, Fail):
    """A kernel failure as onnxruntime's FAIL (onnxruntime 1.32 reports "Non-zero status code
    returned while running <op> node" with FAIL)."""


class OrtPlannerMemoryError(PlannerMemoryError, Fail):
    """A :class:`PlannerMemoryError` as onnxruntime's FAIL."""


class OrtModelLoadError(InvalidProtobuf):
    """A :class:`ModelLoadError` (bytes that are not a model) as onnxruntime's INVALID_PROTOBUF."""


class OrtModelFileMissing(NoSuchFile):
    """A :class:`ModelLoadError` for a model file that does not exist, as onnxruntime's NO_SUCHFILE."""


class OrtInvalidGraph(InvalidGraphStatus, Fail, InvalidArgumentStatus):
    """An :class:`InvalidGraph` as onnxruntime reports graph errors: INVALID_GRAPH, FAIL (a duplicate
    name, a cycle, a bad attribute) or INVALID_ARGUMENT (an undefined input) — catchable as each."""


class OrtKernelNotFound(NotImplementedStatus, InvalidGraphStatus):
    """A :class:`KernelNotFoundError`: onnxruntime's NOT_IMPLEMENTED for an op it knows without a
    kernel, INVALID_GRAPH for an op it does not know — catchable as both."""


# ``type(e).__name__`` of a re-typed error stays the name of our class (code and logs that print or
# match it keep working); ``__qualname__`` stays the real one, so pickling finds the class.
for _cls, _name in ((InvalidArgumentStatus, "InvalidArgument"), (InvalidGraphStatus, "InvalidGraph"),
                    (NotImplementedStatus, "NotImplemented"), (OrtConfigError, "ConfigError"),
                    (OrtExternalDataError, "ExternalDataError"), (OrtPrepackFormatError, "PrepackFormatError"),
                    (OrtCacheFileError, "CacheFileError"), (OrtRuntimeFailure, "RuntimeFailure"),
                    (OrtPlannerMemoryError, "PlannerMemoryError"), (OrtInvalidGraph, "InvalidGraph"),
                    (OrtKernelNotFound, "KernelNotFoundError"), (OrtModelLoadError, "ModelLoadError"),
                    (OrtModelFileMissing, "ModelLoadError")):
    _cls.__name__ = _name

# Our class -> the class that is ours and onnxruntime's (ModelLoadError is decided per instance).
_AS_ORT: dict[type, type] = {
    OnnxpackError: Fail,
    InvalidArgument: InvalidArgumentStatus,
    InvalidGraph: OrtInvalidGraph,
    KernelNotFoundError: OrtKernelNotFound,
    ConfigError: OrtConfigError,
    ExternalDataError: OrtExternalDataError,
    PrepackFormatError: OrtPrepackFormatError,
    CacheFileError: OrtCacheFileError,
    RuntimeFailure: OrtRuntimeFailure,
    PlannerMemoryError: OrtPlannerMemoryError,
}
_ORT_BASES = (Fail, InvalidArgumentStatus, NoSuchFile, NoModel, EngineError, RuntimeException, InvalidProtobuf,
              ModelLoaded, NotImplementedStatus, InvalidGraphStatus, EPFail, ModelLoadCanceled,
              ModelRequiresCompilation, NotFound, DeviceReset)


def as_onnxruntime_error(exc: BaseException) -> BaseException:
    """Re-types ``exc`` (in place) to the class that is both its own and onnxruntime's; returns it.

    Errors that already are onnxruntime's, and anything that is not an :class:`OnnxpackError`
    (including subclasses defined outside this module), are returned unchanged.
    """
    cls = type(exc)
    if not isinstance(exc, OnnxpackError) or isinstance(exc, _ORT_BASES):
        return exc
    if cls is ModelLoadError:
        target = OrtModelFileMissing if isinstance(exc.__cause__, FileNotFoundError) else OrtModelLoadError
    else:
        target = _AS_ORT.get(cls)
    if target is not None:
        exc.__class__ = target
    return exc
