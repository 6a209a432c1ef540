"""This process's memory as Linux reports it (``/proc/self/status``, ``/proc/self/smaps_rollup``)."""

from __future__ import annotations

__all__ = ["process_memory"]

_STATUS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def process_memory() -> dict[str, int]:
    """Bytes of VmRSS, VmHWM (peak), RssAnon (private), RssFile (file-backed), RssShmem and Pss
    (shared pages divided among sharers); an empty dict where /proc is not there."""
    out: dict[str, int] = {}
    for path, keys in (("/proc/self/status", _STATUS), ("/proc/self/smaps_rollup", ("Pss",))):
        try:
            with open(path) as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in keys:
                        out[key] = int(rest.split()[0]) * 1024
        except OSError:
            pass
    return out
