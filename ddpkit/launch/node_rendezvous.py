"""Several nodes meeting: a static rendezvous on a TCPStore that node 0's launcher hosts.

Node 0 hosts the rendezvous store at --master-addr:--master-port; every node launcher (node 0's too)
connects to it, checks it agrees with node 0 on --nnodes, registers, and waits for all the others.
Each attempt starts when every node has arrived at it. As in torchrun, the workers use the same store
(MASTER_PORT is --master-port, so only that port must be open between nodes); the launchers' keys
live under ``ddpkit-run/``, and ``ddpkit.init`` keeps each attempt's keys apart. A node whose workers
fail publishes the failure, and every node stops its own. A node that gives up (a missing node, a
vanished one, a disagreement) leaves the reason under ``abort``, so every node prints the same
message; node 0 keeps its store open until the others have read the last such message or failure.
Node 0 records its job in the store, and a node of another job is refused (``job_check``). With
``--rdzv-backend c10d`` the nodes are numbered as they arrive (``rendezvous_store``).
``NodeWatch`` beats this node's heartbeat; node 0's notices a vanished node.
"""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator

import torch.distributed as dist

from ddpkit.errors import RendezvousError, explain
from ddpkit.launch.config import LaunchConfig
from ddpkit.launch.logs import say
from ddpkit.launch.node_watch import NodeWatch, failure_key, read_key
from ddpkit.launch.rendezvous import Layout, Rendezvous
from ddpkit.launch.rendezvous_store import connect, host_node_store, number_this_node, try_hosting
from ddpkit.runtime.environments.job import is_unnamed_run, unnamed_run_name
from ddpkit.runtime.job_check import JobRecord, check_member, claim, read_owner, tell_of_intruders

__all__ = ["NodeRendezvous"]

_POLL = 0.05
# seconds: when a node waiting for the others says so; the first notice comes at half a shorter
# --rdzv-timeout, so that no wait ends in its error without a word before
_FIRST_NOTICE, _NOTICE_EVERY = 15.0, 60.0
_VERBS = {"joined": "join", "arrived": "arrive"}
_READ_WAIT = 5.0  # seconds node 0 waits for the other nodes to read why the job ended


class NodeRendezvous(Rendezvous):
    """Several nodes meeting on node 0's TCPStore; the module docstring tells the protocol."""

    def __init__(self, config: LaunchConfig):
        self._config = config
        self._address = f"{config.master_addr}:{config.master_port}"
        self._server: dist.TCPStore | None = None  # node 0 only
        self._store: dist.Store | None = None
        self._watch: NodeWatch | None = None
        self._registered = False
        self._attempt: int | None = None
        # who this launcher is in a job record: c10d numbers its nodes only at the rendezvous
        self._who = "a node's ddpkit run" if config.assign_node_rank else f"node {config.node_rank}'s ddpkit run"
        self._intruders = 0

    # ---------------------------------------------------------------------------------------- join
    def join(self, abort: Callable[[], bool]) -> Layout:
        """Register this node and wait for all ``nnodes``; returns the agreed layout."""
        cfg = self._config
        deadline = time.monotonic() + cfg.rdzv_timeout
        if cfg.job_id is None:
            say(f"ddpkit run: note: this run has no name (--rdzv-id), so a node of another unnamed run that "
                f"reaches {self._address} would be taken for one of its own; give each run an --rdzv-id "
                "of its own, the same on all of its nodes")
        if cfg.assign_node_rank:  # c10d: whoever binds the endpoint on its host is node 0
            self._server = try_hosting(cfg)
            if self._server is not None:
                self._who = "node 0's ddpkit run"
        elif cfg.node_rank == 0:
            self._server = host_node_store(cfg, self._error)
        if self._server is not None:
            if cfg.job_id is None:  # its workers still name one job, so that a stray process is refused
                self._named(unnamed_run_name())
            claim(self._server, self._me())
        self._store = connect(cfg, self._address, deadline, abort, self._error)
        store = self._store
        with self._node0_alive("join"):
            if self._server is None:  # a node of another job must not join this one, nor take a number
                raw = store.underlying_store  # type: ignore[attr-defined]
                owner = read_owner(raw, self._me(), deadline, False)
                if cfg.job_id is None and is_unnamed_run(owner.job):
                    self._named(owner.job)
                check_member(raw, self._me(), owner, self._address)
            if cfg.assign_node_rank:
                rank = number_this_node(store, self._server is not None, cfg.nnodes, self._address, self._error)
                self._config, self._who = replace(self._config, node_rank=rank), f"node {rank}'s ddpkit run"
            cfg = self._config
            self._check_nnodes(deadline, abort)
            me = {"host": socket.gethostname(), "pid": os.getpid(), "nproc": cfg.nproc_per_node}
            if store.add(f"node/{cfg.node_rank}/claims", 1) > 1:
                other = json.loads(store.get(f"node/{cfg.node_rank}"))
                unnamed = ("; or, as this run has no --rdzv-id, a node of another run on this port took the "
                           "place: give each run an --rdzv-id of its own") if is_unnamed_run(cfg.job_id) else ""
                raise self._error(explain(f"node rank {cfg.node_rank} already joined from {other['host']} "
                                          f"(pid {other['pid']}).",
                                          f"give every node a different --node-rank{unnamed}."))
            store.set(f"node/{cfg.node_rank}", json.dumps(me))
            self._registered = True
            self._watch = NodeWatch(cfg.master_addr, cfg.master_port, cfg.node_rank, cfg.nnodes,
                                    cfg.node_timeout)
            store.add("joined", 1)
            self._wait_all("joined", "node/{}", deadline, abort, "join", "joined")
            nprocs = [json.loads(store.get(f"node/{r}"))["nproc"] for r in range(cfg.nnodes)]
        return Layout(sum(nprocs), sum(nprocs[:cfg.node_rank]), cfg.nnodes, cfg.node_rank, cfg.job_id)

    def _named(self, job: str | None) -> None:
        """An unnamed run's name, made by node 0 and taken by the others from its record (Note [Job
        identity in the rendezvous]): this run's workers give it, a process of no run is refused."""
        self._config = replace(self._config, job_id=job)

    def _me(self) -> JobRecord:
        """This launcher in a job record: its run's job, as far as the rendezvous has named it."""
        return JobRecord.here(self._config.job_id, None, self._who)

    def _check_nnodes(self, deadline: float, abort: Callable[[], bool]) -> None:
        """Node 0 publishes its --nnodes; every other node compares as soon as it is connected."""
        cfg, store = self._config, self._store
        assert store is not None
        if cfg.node_rank == 0:
            store.set("nnodes", str(cfg.nnodes))
            return
        while not store.check(["nnodes"]):  # node 0 sets it right after opening the store
            self._check_abandoned(abort, deadline, "join", "joined")
            time.sleep(_POLL)
        theirs = int(store.get("nnodes"))
        if theirs != cfg.nnodes:
            self._abandon(explain(f"the nodes disagree on --nnodes: node 0 was started with --nnodes "
                                  f"{theirs}, node {cfg.node_rank} with --nnodes {cfg.nnodes}.",
                                  "give every node the same --nnodes."))

    def _wait_all(self, counter: str, marker: str, deadline: float, abort: Callable[[], bool],
                  what: str, verb: str) -> None:
        """Wait until ``counter`` reaches nnodes; ``marker`` names each node's own key, for messages."""
        cfg, store = self._config, self._store
        assert store is not None
        start = notice = time.monotonic()
        first = min(_FIRST_NOTICE, cfg.rdzv_timeout / 2)
        while store.add(counter, 0) < cfg.nnodes:
            self._check_abandoned(abort, deadline, what, verb, marker)
            if self._server is not None:
                self._intruders = tell_of_intruders(self._server, self._intruders, self._address, say)
            if time.monotonic() - notice >= (first if notice == start else _NOTICE_EVERY):
                notice = time.monotonic()
                missing = self._arrived(marker)[1]
                say(f"ddpkit run: waiting for node rank(s) {_ranks(missing)} to {what} at {self._address} "
                    f"({notice - start:.0f} s so far; this node gives up after {cfg.rdzv_timeout:g} s, "
                    "--rdzv-timeout)")
            time.sleep(_POLL)

    def _check_abandoned(self, abort: Callable[[], bool], deadline: float, what: str, verb: str,
                         marker: str = "node/{}") -> None:
        """Raise if another node gave up, a node vanished, we were interrupted or the time is up."""
        store = self._store
        assert store is not None
        if store.check(["abort"]):
            self._acknowledge()
            raise self._error(store.get("abort").decode())  # another node's reason, word for word
        if abort():
            raise self._error("interrupted while waiting for the other nodes")
        lost = self._watch.lost if self._watch is not None else None
        if lost is not None:
            self._abandon(f"stopped waiting for the nodes to {what}: {lost['lost']}")
        if time.monotonic() >= deadline:
            self._abandon(self._missing_message(what, verb, marker), timed_out=True)

    def _abandon(self, message: str, timed_out: bool = False) -> None:
        """Tell every node why the rendezvous ends (they print the same message), then raise it."""
        assert self._store is not None
        self._store.set("abort", message)
        self._acknowledge()
        raise self._error(message, timed_out)

    def _error(self, message: str, timed_out: bool = False) -> RendezvousError:
        return RendezvousError(message, address=self._address,
                               timeout=self._config.rdzv_timeout if timed_out else None)

    def _acknowledge(self) -> None:
        # node 0 keeps its store open until every registered node has read the abort
        if self._registered and self._config.node_rank != 0:
            self._store.add(read_key("abort"), 1)  # type: ignore[union-attr]

    def _arrived(self, marker: str) -> tuple[list[int], list[int]]:
        """The node ranks whose ``marker`` key is in the store, and those whose is not."""
        assert self._store is not None
        present = [r for r in range(self._config.nnodes) if self._store.check([marker.format(r)])]
        return present, [r for r in range(self._config.nnodes) if r not in present]

    def _missing_message(self, what: str, verb: str, marker: str) -> str:
        cfg = self._config
        present, missing = self._arrived(marker)
        return explain(
            f"rendezvous at {self._address} timed out after {cfg.rdzv_timeout:g} s waiting for the "
            f"nodes to {what}: {len(present)} of {cfg.nnodes} nodes {verb} (node ranks {_ranks(present)}); "
            f"did not {_VERBS[verb]}: node rank(s) {_ranks(missing)}.",
            (f"start 'ddpkit run --nnodes {cfg.nnodes} --rdzv-backend c10d --rdzv-endpoint {self._address} "
             "...' on as many more nodes" if cfg.assign_node_rank else
             f"start 'ddpkit run --nnodes {cfg.nnodes} --node-rank R --master-addr {cfg.master_addr} "
             f"--master-port {cfg.master_port} ...' on each missing node") + ", or raise --rdzv-timeout.")

    @contextmanager
    def _node0_alive(self, what: str) -> Iterator[None]:
        """Turn a lost connection to node 0's store into the one line that explains it."""
        try:
            yield
        except dist.DistNetworkError as e:
            raise self._error(
                f"lost node 0's rendezvous at {self._address} while waiting for the nodes to "
                f"{what}: node 0's launcher exited (it ends the job when a node does not come within "
                "--rdzv-timeout, and when it is stopped); its output says why.") from e

    # ------------------------------------------------------------------------------------ attempts
    def begin_attempt(self, attempt: int, abort: Callable[[], bool]) -> tuple[str, int]:
        """Wait for every node to reach this attempt; returns the workers' store address and port."""
        cfg, store, watch = self._config, self._store, self._watch
        assert store is not None and watch is not None
        deadline = time.monotonic() + cfg.rdzv_timeout
        watch.follow(None)
        what = f"start attempt {attempt}"
        with self._node0_alive(what):
            store.set(f"attempt/{attempt}/arrived/{cfg.node_rank}", "1")
            store.add(f"attempt/{attempt}/arrived", 1)
            self._wait_all(f"attempt/{attempt}/arrived", f"attempt/{attempt}/arrived/{{}}", deadline,
                           abort, what, "arrived")
        self._attempt = attempt
        watch.follow(failure_key(attempt))
        return cfg.master_addr, cfg.master_port

    def report_failure(self, attempt: int, info: dict) -> None:
        """Tell every node to stop; only the first failure of an attempt is published."""
        assert self._store is not None
        try:
            if self._store.add(f"attempt/{attempt}/failures", 1) == 1:
                info = {**info, "from": self._config.node_rank}
                self._store.set(failure_key(attempt), json.dumps(info))
                if self._config.node_rank != 0:  # its own report needs no reading: node 0 may close
                    self._store.add(read_key(failure_key(attempt)), 1)
        except (RuntimeError, OSError):
            pass  # node 0 is gone: the other nodes lose the store and stop anyway

    def remote_failure(self) -> dict | None:
        """What another node reported during this attempt, or the loss of a node, if anything."""
        watch = self._watch
        if watch is None:
            return None
        info = watch.failure
        if info is not None and info.get("from") != self._config.node_rank:
            return info  # before a lost node 0: it may have closed its store after telling us why
        return watch.lost

    def finish_attempt(self, attempt: int, abort: Callable[[], bool]) -> dict | None:
        """After local success: wait until every node finished, or return another node's failure."""
        try:
            return self._finish_attempt(attempt, abort)
        except RuntimeError:
            remote = self.remote_failure()  # node 0 said why before its store went away
            if remote is not None and "from" in remote:
                return remote
            raise

    def _finish_attempt(self, attempt: int, abort: Callable[[], bool]) -> dict | None:
        cfg, store = self._config, self._store
        assert store is not None
        with self._node0_alive(f"finish attempt {attempt}"):
            store.add(f"attempt/{attempt}/finished", 1)
            while store.add(f"attempt/{attempt}/finished", 0) < cfg.nnodes:
                remote = self.remote_failure()
                if remote is not None or abort():
                    return remote
                time.sleep(_POLL)
            if cfg.node_rank != 0:
                store.add("exited", 1)
                return None
            # keep the store up until every node has read the outcome
            deadline = time.monotonic() + 30
            while store.add("exited", 0) < cfg.nnodes - 1 and time.monotonic() < deadline:
                if self.remote_failure() is not None:
                    break  # a node that vanished now has its outcome already: all finished
                time.sleep(_POLL)
        return None

    def close(self) -> None:
        lost = None
        if self._watch is not None:
            lost = self._watch.lost
            self._watch.stop()
            self._watch = None
        if self._server is not None and self._store is not None:
            self._wait_until_read(lost)
        self._store = self._server = None

    def _wait_until_read(self, lost: dict | None) -> None:
        """Node 0, before its store goes: give the other nodes a moment to read why the job ended
        (an abandoned rendezvous, or the last attempt's failure), so they print it too."""
        store, cfg = self._store, self._config
        assert store is not None
        deadline = time.monotonic() + _READ_WAIT
        gone = 0 if lost is None else 1  # a vanished node reads nothing
        try:
            notices = [("abort", store.add("joined", 0) - 1 - gone)]
            if self._attempt is not None:
                notices.append((failure_key(self._attempt), cfg.nnodes - 1 - gone))
            for key, readers in notices:
                if not store.check([key]):
                    continue
                while store.add(read_key(key), 0) < readers and time.monotonic() < deadline:
                    time.sleep(_POLL)
        except (RuntimeError, OSError):
            pass


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) or "none"
