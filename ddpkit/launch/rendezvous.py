"""Where launchers and workers meet: a fresh worker store per attempt, and a static node rendezvous.

Workers always connect as clients (TORCHELASTIC_USE_AGENT_STORE=True) to a TCPStore the launcher of
node 0 hosts, created anew for every attempt as torchrun does, so a restarted group never reads its
predecessor's keys. On one node the store listens on the loopback socket the launcher bound itself
(port 0 unless --master-port): no free-port guess, no bind-then-close race, nothing reachable from
outside. Across nodes, node 0 also hosts a rendezvous store at --master-addr:--master-port on which the
node launchers register, agree on each attempt, publish the worker store's port and report failures.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ddpkit.launch.config import LaunchConfig
from ddpkit.launch.node_watch import FailureWatch, wait_reachable

__all__ = ["Layout", "host_store", "LocalRendezvous", "NodeRendezvous", "make_rendezvous"]

_POLL = 0.05


@dataclass(frozen=True)
class Layout:
    """The job as every node sees it: total workers, this node's first rank, node count."""

    world_size: int
    rank_offset: int
    nnodes: int


def host_store(bind_addr: str | None, port: int) -> dist.TCPStore:
    """Host a TCPStore on ``bind_addr:port`` only (all interfaces when None); port 0 = any free port."""
    if bind_addr is None:
        return dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    host = bind_addr.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {bind_addr}:{port}: {e}. HINT: leave out --master-port "
                           "to let the launcher pick a free port.") from e
    # the store takes ownership of the bound socket and closes it when it is destroyed
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


class LocalRendezvous:
    """One node: no other launcher to meet; a fresh loopback worker store per attempt."""

    def __init__(self, config: LaunchConfig):
        self._config = config
        self._store: dist.TCPStore | None = None

    def join(self, abort: Callable[[], bool]) -> Layout:
        return Layout(self._config.nproc_per_node, 0, 1)

    def begin_attempt(self, attempt: int, abort: Callable[[], bool]) -> tuple[str, int]:
        self._store = None  # the previous attempt's store closes here, before the new one opens
        self._store = host_store(self._config.master_addr, self._config.master_port or 0)
        return self._config.master_addr, self._store.port

    def report_failure(self, attempt: int, info: dict) -> None:
        pass

    def remote_failure(self) -> dict | None:
        return None

    def finish_attempt(self, attempt: int, abort: Callable[[], bool]) -> dict | None:
        return None

    def close(self) -> None:
        self._store = None


class NodeRendezvous:
    """Several nodes meeting on node 0's TCPStore; see the module docstring for the protocol."""

    def __init__(self, config: LaunchConfig):
        self._config = config
        self._address = f"{config.master_addr}:{config.master_port}"
        self._server: dist.TCPStore | None = None  # node 0 only
        self._store: dist.TCPStore | None = None
        self._worker_store: dist.TCPStore | None = None
        self._watch: FailureWatch | None = None

    # ---------------------------------------------------------------------------------------- join
    def join(self, abort: Callable[[], bool]) -> Layout:
        """Register this node and wait for all ``nnodes``; returns the agreed layout."""
        cfg = self._config
        deadline = time.monotonic() + cfg.rdzv_timeout
        if cfg.node_rank == 0:
            try:
                self._server = dist.TCPStore(cfg.master_addr, cfg.master_port, is_master=True,
                                             wait_for_workers=False)
            except (RuntimeError, OSError) as e:
                raise RuntimeError(f"node 0 cannot host the rendezvous on port {cfg.master_port}: "
                                   f"{e}. HINT: is another job using it? Pick another --master-port.") from e
        self._store = self._connect(deadline, abort)
        store = self._store
        me = {"host": socket.gethostname(), "pid": os.getpid(), "nproc": cfg.nproc_per_node}
        if store.add(f"node/{cfg.node_rank}/claims", 1) > 1:
            other = json.loads(store.get(f"node/{cfg.node_rank}"))
            raise RuntimeError(f"node rank {cfg.node_rank} already joined from {other['host']} (pid "
                               f"{other['pid']}). HINT: give every node a different --node-rank.")
        store.set(f"node/{cfg.node_rank}", json.dumps(me))
        store.add("joined", 1)
        self._wait_count("joined", deadline, abort, "join")
        nprocs = [json.loads(store.get(f"node/{r}"))["nproc"] for r in range(cfg.nnodes)]
        return Layout(sum(nprocs), sum(nprocs[:cfg.node_rank]), cfg.nnodes)

    def _connect(self, deadline: float, abort: Callable[[], bool]) -> dist.TCPStore:
        cfg = self._config
        error: Exception | None = None
        # a plain socket first: TCPStore's own retries log a C++ stack trace per attempt
        wait_reachable(cfg.master_addr, cfg.master_port, deadline, abort)
        while not abort():
            wait = max(1.0, min(5.0, deadline - time.monotonic()))
            try:
                return dist.TCPStore(cfg.master_addr, cfg.master_port, is_master=False,
                                     timeout=timedelta(seconds=wait))
            except (RuntimeError, OSError) as e:
                error = e
            if time.monotonic() >= deadline:
                break
        raise RuntimeError(f"node {cfg.node_rank} could not reach node 0's rendezvous at "
                           f"{self._address} within {cfg.rdzv_timeout:g} s ({error}). HINT: start "
                           "node 0 with the same --master-addr/--master-port, and check the address "
                           "is reachable from this host.")

    def _wait_count(self, key: str, deadline: float, abort: Callable[[], bool], what: str) -> None:
        cfg, store = self._config, self._store
        assert store is not None
        while store.add(key, 0) < cfg.nnodes:
            if store.check(["abort"]):
                raise RuntimeError(f"the rendezvous was abandoned: {store.get('abort').decode()}")
            if abort():
                raise RuntimeError("interrupted while waiting for the other nodes")
            if time.monotonic() >= deadline:
                message = self._missing_message(what)
                store.set("abort", message)
                raise RuntimeError(message)
            time.sleep(_POLL)

    def _missing_message(self, what: str) -> str:
        cfg, store = self._config, self._store
        assert store is not None
        present = [r for r in range(cfg.nnodes) if store.check([f"node/{r}"])]
        missing = [r for r in range(cfg.nnodes) if r not in present]
        return (f"rendezvous at {self._address} timed out after {cfg.rdzv_timeout:g} s waiting for "
                f"the nodes to {what}: {len(present)} of {cfg.nnodes} nodes joined (node ranks "
                f"{_ranks(present)}); did not join: node rank(s) {_ranks(missing)}. HINT: start "
                "'ddpkit run --nnodes {0} --node-rank R --master-addr {1} --master-port {2} ...' on "
                "each missing node, or raise --rdzv-timeout.".format(
                    cfg.nnodes, cfg.master_addr, cfg.master_port))

    # ------------------------------------------------------------------------------------ attempts
    def begin_attempt(self, attempt: int, abort: Callable[[], bool]) -> tuple[str, int]:
        """Wait for every node to reach this attempt; returns the worker store's address and port."""
        cfg, store = self._config, self._store
        assert store is not None
        deadline = time.monotonic() + cfg.rdzv_timeout
        self._stop_watch()
        store.add(f"attempt/{attempt}/arrived", 1)
        self._wait_count(f"attempt/{attempt}/arrived", deadline, abort, f"start attempt {attempt}")
        port_key = f"attempt/{attempt}/port"
        if cfg.node_rank == 0:
            self._worker_store = None
            self._worker_store = host_store(None, 0)  # reachable from the other nodes
            store.set(port_key, str(self._worker_store.port))
        while not store.check([port_key]):
            if abort() or time.monotonic() >= deadline:
                raise RuntimeError(f"node 0 did not publish attempt {attempt}'s worker store in time")
            time.sleep(_POLL)
        self._watch = FailureWatch(cfg.master_addr, cfg.master_port, f"attempt/{attempt}/failed")
        return cfg.master_addr, int(store.get(port_key))

    def report_failure(self, attempt: int, info: dict) -> None:
        """Tell every node to stop; only the first failure of an attempt is published."""
        assert self._store is not None
        try:
            if self._store.add(f"attempt/{attempt}/failures", 1) == 1:
                self._store.set(f"attempt/{attempt}/failed", json.dumps(info))
        except (RuntimeError, OSError):
            pass  # node 0 is gone: the other nodes lose the store and stop anyway

    def remote_failure(self) -> dict | None:
        """What another node (or the loss of node 0) reported during this attempt, if anything."""
        info = self._watch.info if self._watch is not None else None
        if info is not None and info.get("node") == self._config.node_rank:
            return None  # our own report, already handled
        return info

    def finish_attempt(self, attempt: int, abort: Callable[[], bool]) -> dict | None:
        """After local success: wait until every node finished, or return another node's failure."""
        cfg, store = self._config, self._store
        assert store is not None
        store.add(f"attempt/{attempt}/finished", 1)
        while store.add(f"attempt/{attempt}/finished", 0) < cfg.nnodes:
            remote = self.remote_failure()
            if remote is not None or abort():
                return remote
            time.sleep(_POLL)
        self._stop_watch()
        if cfg.node_rank != 0:
            store.add("exited", 1)
        else:  # keep the store up until every node has read the outcome
            deadline = time.monotonic() + 30
            while store.add("exited", 0) < cfg.nnodes - 1 and time.monotonic() < deadline:
                time.sleep(_POLL)
        return None

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def close(self) -> None:
        self._stop_watch()
        self._store = self._worker_store = self._server = None


def make_rendezvous(config: LaunchConfig) -> LocalRendezvous | NodeRendezvous:
    return NodeRendezvous(config) if config.multi_node else LocalRendezvous(config)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) or "none"
