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
