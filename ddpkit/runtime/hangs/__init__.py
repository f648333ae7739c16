"""Hangs explain themselves: a collective recorder, a watchdog per rank, and the report.

``start()`` is called by ``ddpkit.init()`` once the process group exists and ``stop()`` by
``ddpkit.shutdown()``. Between them every collective is recorded (``recorder``); a stalled one makes
the ranks compare notes through the rendezvous store (``watchdog``, ``inquiry``), and every rank prints
the same report (``report``); a certain deadlock ends the job with ``HANG_EXIT_CODE``. Strict mode
(``strict``) checks every collective before it runs. See Note [Hang reports] in docs/design.md.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["HangWatch", "start", "where_called", "HANG_EXIT_CODE", "DEFAULT_STALL_TIMEOUT", "HangSettings",
           "read_settings"]

_SETTINGS = ("HANG_EXIT_CODE", "DEFAULT_STALL_TIMEOUT", "HangSettings", "read_settings")


def __getattr__(name: str) -> Any:
    """The exports, loaded on first use: ``settings`` imports no torch, and ``ddpkit run`` reads it
    through this package before it imports torch (Note [Launcher start] in docs/design.md)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = "settings" if name in _SETTINGS else "session"
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
