"""Imports every kernel family module so that their ``@register`` decorators run."""

from __future__ import annotations

import importlib
import pkgutil

import onnxpack.session.kernels as _pkg

for _info in pkgutil.iter_modules(_pkg.__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{_pkg.__name__}.{_info.name}")
