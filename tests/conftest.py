"""Shared pytest setup: makes tests/ importable (kernel_util) and keeps hypothesis bounded."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass
