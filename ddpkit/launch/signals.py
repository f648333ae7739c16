"""Process-lifetime plumbing: the death signal for workers, the subreaper flag, and a signal inbox.

Workers must never outlive the launcher, even one killed with SIGKILL (which runs no handler): each
worker asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``). The launcher becomes a
child subreaper, so a worker's orphaned children are re-parented to it and can be found and killed at
teardown. Signals sent to the launcher are only recorded here; the supervisor's loop acts on them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import signal
import sys
from collections import deque
from typing import Callable, Iterable

__all__ = ["death_signal_preexec", "become_subreaper", "SignalInbox", "STOPPING", "FORWARDED"]

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Forwarded to every worker's process group, then the job ends with 128 + signal."""
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)
"""Forwarded to the workers themselves (pre-emption notices); the job goes on."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _load_prctl() -> Callable[..., int] | None:
    # resolved here, in the parent: the forked child must not import or look anything up
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def _set_death_signal(launcher_pid: int) -> None:
    """Runs in the forked child before exec (keep it to two system calls)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # type: ignore[misc]
    # the launcher may have died between fork and prctl: then no signal will ever come
    if os.getppid() != launcher_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def death_signal_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that gives the child SIGKILL when this process dies (None off Linux).

    The kernel sends it when the *thread* that forked the child exits, so call ``Popen`` from the
    main thread, which lives as long as the launcher.
    """
    if _prctl is None:
        return None
    return functools.partial(_set_death_signal, os.getpid())


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux); returns whether it worked."""
    return _prctl is not None and _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


class SignalInbox:
    """Record STOPPING and FORWARDED signals while installed; restore the old handlers on exit.

    Example::

        with SignalInbox() as inbox:
            ...
            for sig in inbox.take():
                ...
    """

    def __init__(self, signals: Iterable[signal.Signals] = STOPPING + FORWARDED):
        self._signals = tuple(signals)
        self._received: deque[signal.Signals] = deque()
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> SignalInbox:
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _record(self, signum: int, frame: object) -> None:
        self._received.append(signal.Signals(signum))

    def take(self) -> list[signal.Signals]:
        """The signals received since the last call, oldest first."""
        taken = []
        while self._received:
            taken.append(self._received.popleft())
        return taken
