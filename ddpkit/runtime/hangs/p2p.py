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

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["PointToPointWaits", "CALLS"]

CALLS = ("recv", "send")


class PointToPointWaits:
    """Wraps torch's blocking ``recv`` and ``send`` while installed; ``oldest()`` is the start of the
    longest such call still running in any thread."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}  # thread id -> when its outermost call began
        self._originals: dict[str, Callable] = {}

    def install(self, owner: Any) -> None:
        """Wrap the calls; ``owner`` (the recorder) marks the wrappers, so that they are told apart
        from torch's own functions and from another recorder's."""
        for name in CALLS:
            original = getattr(c10d, name)
            if getattr(original, "__ddpkit_recorder__", None) is owner:
                continue
            self._originals[name] = original
            wrapper = self._wrap(original)
            wrapper.__ddpkit_recorder__ = owner
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)

    def uninstall(self, owner: Any) -> None:
        for name, original in self._originals.items():
            for module in (c10d, dist):
                if getattr(getattr(module, name, None), "__ddpkit_recorder__", None) is owner:
                    setattr(module, name, original)
        self._originals.clear()

    def oldest(self) -> float | None:
        return min(list(self._started.values()), default=None)

    def _wrap(self, fn: Callable) -> Callable:
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
