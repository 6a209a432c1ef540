"""Byte counts as text, the one formatter every report uses."""

from __future__ import annotations

__all__ = ["format_bytes"]

_BINARY = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SI = (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def format_bytes(n: float, *, si: bool = False, digits: int = 1) -> str:
    """``1536 -> "1.5 KiB"`` (``si``: ``"1.5 kB"``); below one unit ``"N B"``; negative ``"?"``."""
    if n < 0:
        return "?"
    for unit, step in (_SI if si else _BINARY):
        if n >= step:
            return f"{n / step:.{digits}f} {unit}"
    return f"{int(n)} B"
