"""The inquiry: how the ranks tell each other where they are, through the rendezvous store.

Never through the process group, which is what is stuck. Keys, under a prefix of the job's own:
``info/<rank>`` (pid and host, at init), ``inquiry`` (a counter: inquiry n is open once it reads n),
``answer/<n>/<rank>`` (a rank's state), ``lead/<n>`` (the first rank to answer builds the report),
``report/<n>`` (the report), ``read/<n>`` and ``left/<n>`` (how many ranks read it, and left after a
certain one), ``final/<rank>`` (a rank's last word as it leaves the job). The store
is polled with ``check``: a ``wait`` that times out makes torch log a warning per call.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import psutil
import torch.distributed as dist

__all__ = ["Inquiry", "pid_exited", "pid_stopped", "ask_from_outside", "LATEST_KEY"]

_POLL = 0.05
LATEST_KEY = "ddpkit-hangs/latest"
"""The key prefix of the newest process group's inquiry, at the top of the store."""


def pid_exited(pid: int | None, host: str | None) -> bool | None:
    """True when ``pid`` on this host is gone, None when that cannot be known (another host)."""
    if not pid or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def pid_stopped(pid: int | None, host: str | None) -> str | None:
    """How a live ``pid`` on this host is stopped: "stopped" (SIGSTOP, Ctrl-Z), "traced" (held by a
    debugger); None when it runs, is gone, or lives on another host."""
    if not pid or host != socket.gethostname():
        return None
    try:
        status = psutil.Process(pid).status()
    except (psutil.Error, OSError):
        return None
    return {psutil.STATUS_STOPPED: "stopped", psutil.STATUS_TRACING_STOP: "traced"}.get(status)


def ask_from_outside(store: dist.Store) -> bool:
    """Open an inquiry in a job's store from outside its ranks (``ddpkit run``, whose workers did not
    end at its Ctrl-C: ranks blocked in a collective cannot run Python's handler), so that every
    rank's watchdog reports where it is now. False where the job records no hangs."""
    try:
        if not store.check([LATEST_KEY]):
            return False
        store.add(f"{store.get(LATEST_KEY).decode()}/inquiry", 1)
    except (RuntimeError, OSError, ValueError):  # the store went away with the job
        return False
    return True


class Inquiry:
    """One rank's side of the protocol over a store that belongs to the watchdog's thread alone."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    def introduce(self) -> None:
        # the parent: a launcher (ddpkit run, torchrun) whose death takes its workers with it
        self._put(f"info/{self.rank}", {"pid": os.getpid(), "host": socket.gethostname(), "parent": os.getppid()})

    def current(self) -> int:
        return self.store.add("inquiry", 0)

    def open(self, seen: int) -> int:
        """Open inquiry ``seen + 1`` unless another rank opened one already; the number to answer."""
        return int(self.store.compare_set("inquiry", str(seen), str(seen + 1)))

    def answer(self, n: int, state: dict[str, Any]) -> bool:
        """Publish this rank's state for inquiry ``n``; True if this rank is the one to report."""
        self._put(f"answer/{n}/{self.rank}", state)
        return self.store.add(f"lead/{n}", 1) == 1

    def collect(self, n: int, seconds: float) -> tuple[dict[int, dict], dict[int, dict]]:
        """Every rank's answer to ``n`` within ``seconds``; for those without one, what is known."""
        answers: dict[int, dict] = {}
        finals: dict[int, dict] = {}
        deadline = time.monotonic() + seconds
        pending = list(range(self.world_size))
        while True:
            for rank in list(pending):
                if self.store.check([f"answer/{n}/{rank}"]):
                    answers[rank] = self._get(f"answer/{n}/{rank}")
                    pending.remove(rank)
            gone = {r: self._known(r) for r in pending}
            if all(info.get("final") or info.get("exited") for info in gone.values()) or \
                    time.monotonic() > deadline:
                finals = gone
                break
            time.sleep(_POLL)  # other ranks answer from their own watchdog's next tick
        return answers, finals

    def _known(self, rank: int) -> dict[str, Any]:
        info = self._get(f"info/{rank}") if self.store.check([f"info/{rank}"]) else {}
        final = self._get(f"final/{rank}") if self.store.check([f"final/{rank}"]) else None
        exited = pid_exited(info.get("pid"), info.get("host"))
        return {"pid": info.get("pid"), "host": info.get("host"), "final": final, "exited": exited,
                "stopped": None if exited is not False else pid_stopped(info.get("pid"), info.get("host")),
                "parent": info.get("parent"),
                "parent_exited": bool(exited and pid_exited(info.get("parent"), info.get("host")))}

    def publish_report(self, n: int, report: dict[str, Any]) -> None:
        self._put(f"report/{n}", report)

    def wait_report(self, n: int, seconds: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.store.check([f"report/{n}"]):
                return self._get(f"report/{n}")
            time.sleep(_POLL)  # the reporting rank is still collecting answers
        return None

    def mark_read(self, n: int) -> None:
        self.store.add(f"read/{n}", 1)

    def wait_read(self, n: int, readers: int, seconds: float) -> None:
        """Until ``readers`` ranks have read report ``n``, or ``seconds`` passed."""
        self._wait_count(f"read/{n}", readers, seconds)  # the others fetch it on their next poll

    def mark_left(self, n: int) -> None:
        """This rank has said its last word after certain report ``n``, and leaves."""
        self.store.add(f"left/{n}", 1)

    def wait_left(self, n: int, others: int, seconds: float) -> None:
        """Until ``others`` ranks have left after report ``n``, or ``seconds`` passed."""
        self._wait_count(f"left/{n}", others, seconds)

    def _wait_count(self, key: str, at_least: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.store.add(key, 0) < at_least and time.monotonic() < deadline:
            time.sleep(_POLL)

    def last_word(self, word: dict[str, Any]) -> None:
        self._put(f"final/{self.rank}", word)

    def _put(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def _get(self, key: str) -> Any:
        return json.loads(self.store.get(key))
