"""Blocking point-to-point calls (``recv``, ``send``): timed, not numbered.

A peer, not a group, matches them, so they get no sequence number (Note [Hang reports]). But the
watchdog notices a stall by the age of what a rank waits in, and ranks that all wait in ``recv``
wait in no collective: nobody opened an inquiry, and the job hung without a word. Each blocking
call's start is kept here while it runs, and the watchdog counts it as a wait.
"""
from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["PointToPointWaits", "CALLS"]

CALLS = ("recv", "send")


class PointToPointWaits:
    """The start of each blocking ``recv`` or ``send`` still running, and what it is (``op``, the
    global rank of its ``peer``, None for any source, and its ``tag``), by thread, through the
    wrappers ``wrap`` makes (the recorder installs them beside its collectives' own)."""

    def __init__(self) -> None:
        self._started: dict[int, tuple[float, dict]] = {}  # thread id -> its outermost call's start, and it

    def oldest(self) -> float | None:
        """When the longest such call still running began; None: none runs."""
        return min((start for start, _ in list(self._started.values())), default=None)

    def call_of(self, thread_id: int | None) -> dict | None:
        """The call ``thread_id`` waits in, for its published state; None: it waits in none."""
        entry = self._started.get(thread_id) if thread_id is not None else None
        return None if entry is None else entry[1]

    def wrap(self, fn: Callable) -> Callable:
        started = self._started
        names, op = list(inspect.signature(fn).parameters), fn.__name__

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            me = threading.get_ident()
            if me in started:  # a call inside another (recv_object_list's recv)
                return fn(*args, **kwargs)
            started[me] = (time.monotonic(), _described(op, {**dict(zip(names, args)), **kwargs}))
            try:
                return fn(*args, **kwargs)
            finally:
                started.pop(me, None)

        return call


def _described(op: str, arguments: dict[str, Any]) -> dict:
    """``{"op": "send", "peer": 1, "tag": 0}``; a peer named by its rank in a group is made global."""
    side = "src" if op == "recv" else "dst"
    peer, group_peer = arguments.get(side), arguments.get(f"group_{side}")
    try:
        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(arguments.get("group") or dist.group.WORLD, group_peer)
        return {"op": op, "peer": None if peer is None else int(peer), "tag": int(arguments.get("tag") or 0)}
    except Exception:  # noqa: BLE001 - torch's own call will say what is wrong with its arguments
        return {"op": op, "peer": None, "tag": None}
