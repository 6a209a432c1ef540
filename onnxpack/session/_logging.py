"""onnxruntime's logging controls over Python's ``logging``.

onnxruntime's severities are 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.  Here they map to
``DEBUG, INFO, WARNING, ERROR, CRITICAL`` of the ``onnxpack`` logger (every module logs under it):

* ``set_default_logger_severity(n)`` sets that logger's level (the library never configures
  logging on its own; this call is the user asking);
* a session's ``SessionOptions.log_severity_level`` (and a run's ``RunOptions`` level) filters
  the records the session itself emits, tagged with its ``logid``; ``-1`` defers to the default;
* ``set_default_logger_callback(fn, severity)`` routes the ``onnxpack`` records to
  ``fn(severity, category, logid, code_location, message)`` instead of the usual handlers, as
  onnxruntime routes its default logger; ``None`` restores them.  A callback that raises does not
  break the caller.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from onnxpack.errors import RuntimeInvalidArgument
from onnxpack.session.options import check_severity

__all__ = ["set_default_logger_severity", "set_default_logger_verbosity", "set_default_logger_callback",
           "SessionLog", "LEVELS"]

ROOT = logging.getLogger("onnxpack")
LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
_state = {"severity": 2, "verbosity": 0}
_handler_lock = threading.Lock()
_callback_handler: logging.Handler | None = None


def default_severity() -> int:
    return _state["severity"]


def set_default_logger_severity(severity: int) -> None:
    """Minimum severity of the default logger (0 verbose .. 4 fatal)."""
    _state["severity"] = check_severity(severity, "set_default_logger_severity", allow_default=False)
    ROOT.setLevel(LEVELS[_state["severity"]])


def set_default_logger_verbosity(verbosity: int) -> None:
    """Kept: verbosity only refines VERBOSE records, which are all DEBUG records here."""
    _state["verbosity"] = int(verbosity)


class _CallbackHandler(logging.Handler):
    def __init__(self, callback: Callable[..., Any]) -> None:
        super().__init__()
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        severity = min(4, max(0, (record.levelno - logging.DEBUG) // 10))
        logid = getattr(record, "logid", "")
        try:
            self.callback(severity, record.name, logid, f"{record.pathname}:{record.lineno} {record.funcName}",
                          record.getMessage())
        except Exception:  # a failing callback must not break the run or the session creation
            pass


def set_default_logger_callback(callback: Callable[..., Any] | None, severity: int = 2) -> None:
    """Send the ``onnxpack`` log records of at least ``severity`` to ``callback`` (None: stop)."""
    global _callback_handler
    if callback is not None and not callable(callback):
        raise RuntimeInvalidArgument("set_default_logger_callback: callback must be callable or None")
    with _handler_lock:
        if _callback_handler is not None:
            ROOT.removeHandler(_callback_handler)
            _callback_handler = None
            ROOT.propagate = True
        if callback is None:
            return
        set_default_logger_severity(severity)
        _callback_handler = _CallbackHandler(callback)
        ROOT.addHandler(_callback_handler)
        ROOT.propagate = False


class SessionLog:
    """A session's log records: its ``logid`` attached, its ``log_severity_level`` applied."""

    def __init__(self, name: str, logid: str, severity: int) -> None:
        self.logger = logging.getLogger(name)
        self.logid = logid
        self.severity = severity  # -1: the default logger's

    def log(self, severity: int, msg: str, *args: Any, run_severity: int = -1) -> None:
        floor = run_severity if run_severity >= 0 else self.severity if self.severity >= 0 else _state["severity"]
        if severity >= floor:
            self.logger.log(LEVELS[severity], msg, *args, extra={"logid": self.logid}, stacklevel=2)
