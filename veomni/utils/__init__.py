"""Utilities: device and backend selection, rank-aware logging, collectives helpers, the demos' asset cache.

Names are imported lazily so that light modules (the lifecycle wrapper that every task runs under) do not pull in
torch before the arguments are parsed: `--help` and config mistakes answer at once.
"""

import importlib

_LAZY = {
    "get_device": "device",
    "get_device_type": "device",
    "get_dist_backend": "device",
    "get_logger": "logging",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
