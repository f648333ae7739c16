"""Blocking point-to-point calls (``recv``, ``send``): timed, not numbered.

A peer, not a group, matches them, so they get no sequence number (Note [Hang reports]). But the
watchdog notices a stall by the age of what a rank waits in, and ranks that all wait in ``recv``
wait in no collective: nobody opened an inquiry, and the job hung without a word. Each blocking
call's start is kept here while it runs, and the watchdog counts it as a wait.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

__all__ = ["PointToPointWaits", "CALLS"]

CALLS = ("recv", "send")


class PointToPointWaits:
    """The start of each blocking ``recv`` or ``send`` still running, by thread, through the
    wrappers ``wrap`` makes (the recorder installs them beside its collectives' own)."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}  # thread id -> when its outermost call began

    def oldest(self) -> float | None:
        """When the longest such call still running began; None: none runs."""
        return min(list(self._started.values()), default=None)

    def wrap(self, fn: Callable) -> Callable:
        started = self._started

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            me = threading.get_ident()
            if me in started:  # a call inside another (recv_object_list's recv)
                return fn(*args, **kwargs)
            started[me] = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                started.pop(me, None)

        return call
