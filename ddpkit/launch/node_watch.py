"""Watching the other nodes from one node: is node 0 reachable, and has any node reported a failure?

Both use a plain socket where they can, because a TCPStore call that meets a closed connection logs a
C++ stack trace (and TORCH_CPP_LOG_LEVEL cannot be changed once torch is imported): the launcher's
own one-line messages say what happened instead.
"""
from __future__ import annotations

import json
import select
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

__all__ = ["FailureWatch", "wait_reachable"]


def _dial(host: str, port: int) -> socket.socket | None:
    try:
        return socket.create_connection((host.strip("[]"), port), timeout=1)
    except OSError:
        return None


def wait_reachable(host: str, port: int, deadline: float, abort: Callable[[], bool]) -> None:
    """Return once ``host:port`` accepts a TCP connection, or at the deadline / on abort."""
    while not abort() and time.monotonic() < deadline:
        sock = _dial(host, port)
        if sock is not None:
            sock.close()
            return
        time.sleep(0.1)


class FailureWatch:
    """A thread polling the failure key on its own connection, so the supervisor's loop never blocks.

    ``info`` becomes the failure report as published, or ``{"node": None, "lost": ...}`` when node 0
    stops answering. Node 0's death is seen as end-of-file on an idle socket to its store, checked
    before every store call; an end-of-file is confirmed by dialling again, in case the server merely
    dropped an idle connection.
    """

    def __init__(self, host: str, port: int, key: str):
        self.info: dict | None = None
        self._address = (host, port)
        self._stopped = threading.Event()
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self._thread = threading.Thread(target=self._run, args=(key,), name="ddpkit-failure-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self, key: str) -> None:
        probe = _dial(*self._address)
        try:
            while not self._stopped.wait(0.1):
                if probe is None or select.select([probe], [], [], 0)[0]:
                    if probe is not None:
                        probe.close()
                    probe = _dial(*self._address)
                    if probe is None:
                        self._lost("node 0's rendezvous store closed")
                        return
                if self._store.check([key]):
                    self.info = json.loads(self._store.get(key))
                    return
        except (RuntimeError, OSError) as e:
            self._lost(f"lost the connection to node 0's rendezvous ({e})")
        finally:
            if probe is not None:
                probe.close()

    def _lost(self, why: str) -> None:
        if not self._stopped.is_set():
            self.info = {"node": None, "lost": why}

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)
