"""Watching the other nodes from one node: is every node still there, and has one reported a failure?

A node launcher that is SIGKILLed (or whose host dies) says nothing, so every launcher beats a
heartbeat on node 0's store (``alive/<node rank>``, a counter) and node 0 watches the others'
counters: a node whose counter stands still for ``--node-timeout`` seconds is lost, and node 0 tells
the others (one watcher, not one per node: the store's load grows with the nodes, not their square).
Counters, not timestamps, so the hosts' clocks need not agree. Node 0's own death is seen by every
node as end-of-file on an idle socket to its store, or, where its host vanished without closing the
connection, as a store call that gets no answer within ``--node-timeout``.

Plain sockets are used where they can be, because a TCPStore call that meets a closed connection logs
a C++ stack trace: the launcher's own one-line messages say what happened instead.
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

__all__ = ["NodeWatch", "wait_reachable", "heartbeat_key", "failure_key", "read_key", "launcher_store"]

_TICK = 0.1


def heartbeat_key(node_rank: int) -> str:
    return f"alive/{node_rank}"


def failure_key(attempt: int) -> str:
    return f"attempt/{attempt}/failed"


def read_key(key: str) -> str:
    """Counts the nodes other than node 0 that have read ``key``: node 0 keeps its store up for them."""
    return f"{key}/read"


def launcher_store(host: str, port: int, timeout: timedelta) -> dist.Store:
    """A connection to node 0's store, with the launchers' keys apart from the workers'."""
    return dist.PrefixStore("ddpkit-run", dist.TCPStore(host, port, is_master=False, timeout=timeout))


def _dial(host: str, port: int) -> socket.socket | None:
    try:
        return socket.create_connection((host.strip("[]"), port), timeout=1)
    except OSError:
        return None


def wait_reachable(host: str, port: int, deadline: float, abort: Callable[[], bool],
                   waiting: Callable[[], None] | None = None) -> None:
    """Return once ``host:port`` accepts a TCP connection, or at the deadline / on abort.

    ``waiting`` is called once, if the first try fails.
    """
    while not abort() and time.monotonic() < deadline:
        sock = _dial(host, port)
        if sock is not None:
            sock.close()
            return
        if waiting is not None:
            waiting()
            waiting = None
        time.sleep(0.1)


class NodeWatch:
    """A thread on its own connection to node 0's store, for as long as this node is in the job.

    ``lost`` becomes ``{"node": R, "lost": why}`` when node R stops answering (node 0: its store
    closed; another node, seen on node 0 only: its heartbeat stood still for ``node_timeout`` s).
    ``failure`` becomes the failure report published under the key given to ``follow`` (the
    current attempt's).
    """

    def __init__(self, host: str, port: int, node_rank: int, nnodes: int, node_timeout: float):
        self.lost: dict | None = None
        self.failure: dict | None = None
        self._address = (host, port)
        self._node_rank, self._nnodes, self._timeout = node_rank, nnodes, node_timeout
        self._beat_every = min(1.0, node_timeout / 4)
        self._key: str | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # a store call to a host that vanished without closing the connection gives up after the
        # same --node-timeout that node 0 gives the other nodes
        self._store = launcher_store(host, port, timedelta(seconds=node_timeout))
        self._store.add(heartbeat_key(node_rank), 1)  # alive from now on, before the thread runs
        self._thread = threading.Thread(target=self._run, name="ddpkit-node-watch", daemon=True)
        self._thread.start()

    def follow(self, key: str | None) -> None:
        """Watch ``key`` for a failure report from now on (None: none); forgets the previous one."""
        with self._lock:
            self._key, self.failure = key, None

    def _run(self) -> None:
        probe = _dial(*self._address)
        seen: dict[int, tuple[int, float]] = {}  # node rank -> (last counter, when it last moved)
        next_beat = 0.0
        try:
            while not self._stopped.wait(_TICK):
                if probe is None or select.select([probe], [], [], 0)[0]:
                    # readable means end-of-file: confirm by dialling again, in case the server
                    # merely dropped an idle connection
                    if probe is not None:
                        probe.close()
                    probe = _dial(*self._address)
                    if probe is None:
                        self._lose(0, "node 0's rendezvous store closed: node 0's launcher exited "
                                   "or is unreachable")
                        return
                self._check_failure()
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self._beat_every
                    self._store.add(heartbeat_key(self._node_rank), 1)
                    if self._node_rank == 0:
                        self._check_heartbeats(seen, now)
        except (RuntimeError, OSError) as e:
            self._lose(0, f"lost the connection to node 0's rendezvous store ({e}): node 0's "
                       "launcher exited or is unreachable")
        finally:
            if probe is not None:
                probe.close()

    def _check_failure(self) -> None:
        with self._lock:
            key = self._key
        if key is None or self.failure is not None or not self._store.check([key]):
            return
        info = json.loads(self._store.get(key))
        with self._lock:
            if self._key == key:
                self.failure = info
        if self._node_rank not in (0, info.get("from")):  # the reporting node counted itself
            self._store.add(read_key(key), 1)  # only now may node 0 close its store

    def _check_heartbeats(self, seen: dict[int, tuple[int, float]], now: float) -> None:
        for rank in range(self._nnodes):
            if rank == self._node_rank:
                continue
            count = self._store.add(heartbeat_key(rank), 0)
            if count == 0:
                continue  # not registered yet: the rendezvous timeout covers a node that never comes
            last = seen.get(rank)
            if last is None or last[0] != count:
                seen[rank] = (count, now)
            elif now - last[1] > self._timeout and self.lost is None:
                host = json.loads(self._store.get(f"node/{rank}")).get("host", "?")
                self._lose(rank, f"node {rank} (host {host}) vanished: its launcher sent no heartbeat "
                           f"for {self._timeout:g} s (it was killed, or its host is down or "
                           "unreachable)")

    def _lose(self, rank: int, why: str) -> None:
        if not self._stopped.is_set() and self.lost is None:
            self.lost = {"node": rank, "lost": why}

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)
