"""Where workers meet: a fresh worker store per attempt; on a single node, no one else to meet.

Workers always connect as clients (TORCHELASTIC_USE_AGENT_STORE=True) to a TCPStore the launcher of
node 0 hosts, created anew for every attempt as torchrun does, so a restarted group never reads its
predecessor's keys. On one node the store listens on the loopback socket the launcher bound itself
(port 0 unless --master-port): no free-port guess, no bind-then-close race, nothing reachable from
outside. The launcher records its job in each store, so a worker of another job is refused there
(``ddpkit.runtime.job_check``). Several nodes meet first (``node_rendezvous``).
"""
from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ddpkit.errors import RendezvousError, explain
from ddpkit.launch.config import LaunchConfig
from ddpkit.runtime.job_check import JobRecord, claim
from ddpkit.runtime.port_holder import describe_holder

if TYPE_CHECKING:  # the launcher of one node starts its workers before it imports torch
    import torch.distributed as dist

__all__ = ["ask_where_they_are", "Layout", "listen", "host_store", "Rendezvous", "LocalRendezvous", "for_config"]


@dataclass(frozen=True)
class Layout:
    """The job as every node sees it: total workers, this node's first rank, node count, this
    node's rank (numbered at the rendezvous with c10d), and the job its workers name (an unnamed run
    of several nodes is named at the rendezvous; None: the launcher's own)."""

    world_size: int
    rank_offset: int
    nnodes: int
    node_rank: int = 0
    job_id: str | None = None


def listen(bind_addr: str | None, port: int) -> socket.socket:
    """A socket listening on ``bind_addr:port`` only (all interfaces when None); port 0 = any free port.
    Connections wait in its backlog until ``host_store`` serves it."""
    host = "0.0.0.0" if bind_addr is None else bind_addr.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as e:
        held = (f" Another process, probably another job, holds port {port}{describe_holder(port)}."
                if e.errno == errno.EADDRINUSE else "")
        raise RendezvousError(explain(f"cannot listen on {bind_addr}:{port}: {e}.{held}",
                                      "leave out --master-port to let the launcher pick a free port."),
                              address=f"{bind_addr}:{port}", timeout=None) from e
    return sock


def host_store(sock: socket.socket) -> dist.TCPStore:
    """Host a TCPStore on the listening ``sock``, which the store takes over (and closes when destroyed)."""
    import torch.distributed as dist

    host, port = sock.getsockname()[:2]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())


class Rendezvous:
    """What the launcher of a node meets the others through, one attempt after another; the defaults
    are those of a node alone."""

    def join(self, abort: Callable[[], bool]) -> Layout:
        """Meet the other nodes (``abort()`` True: give up); returns the agreed layout."""
        raise NotImplementedError

    def begin_attempt(self, attempt: int, abort: Callable[[], bool]) -> tuple[str, int]:
        """Wait for every node to reach ``attempt``; returns the workers' store address and port."""
        raise NotImplementedError

    def serve(self) -> None:
        """This node's workers started: open what they connect to, if it is not open yet."""

    def report_failure(self, attempt: int, info: dict) -> None:
        """Tell the other nodes why this node's attempt ends."""

    def remote_failure(self) -> dict | None:
        """What another node reported during this attempt, if anything."""
        return None

    def finish_attempt(self, attempt: int, abort: Callable[[], bool]) -> dict | None:
        """After local success: wait for the other nodes; returns another node's failure, if any."""
        return None

    def worker_store(self) -> dist.Store | None:
        """The store this node's workers meet in, where this launcher holds it; else None."""
        return None

    def close(self) -> None:
        """Leave the rendezvous."""


class LocalRendezvous(Rendezvous):
    """One node: no other launcher to meet; a fresh loopback worker store per attempt, opened once the
    workers started, while they import torch (Note [Launcher start] in docs/design.md)."""

    def __init__(self, config: LaunchConfig):
        self._config = config
        self._store: dist.TCPStore | None = None
        self._socket: socket.socket | None = None  # the attempt's, until the store takes it over

    def join(self, abort: Callable[[], bool]) -> Layout:
        return Layout(self._config.nproc_per_node, 0, 1)

    def begin_attempt(self, attempt: int, abort: Callable[[], bool]) -> tuple[str, int]:
        self.close()  # the previous attempt's store closes here, before the new one opens
        self._socket = listen(self._config.master_addr, self._config.master_port or 0)
        return self._config.master_addr, self._socket.getsockname()[1]

    def serve(self) -> None:
        """Open the store on the attempt's socket and record the job in it; a worker that connects
        first waits in the socket's backlog, then for the record (``job_check.read_owner``)."""
        self._store, self._socket = host_store(self._socket), None
        claim(self._store, JobRecord.here(self._config.job_id, self._config.nproc_per_node, "ddpkit run"))

    def worker_store(self) -> dist.Store | None:
        return self._store

    def close(self) -> None:
        self._store = None
        if self._socket is not None:  # never served (the store closes the socket it took over)
            self._socket.close()
            self._socket = None


def ask_where_they_are(rendezvous: Rendezvous) -> bool:
    """Open a hang inquiry in the workers' store, where this launcher holds it: each rank's watchdog
    then reports where it waits (ranks blocked in a collective cannot see a signal). False where
    there is no store here, or the job records no hangs."""
    store = rendezvous.worker_store()
    if store is None:
        return False
    from ddpkit.runtime.hangs.inquiry import ask_from_outside

    return ask_from_outside(store)


def for_config(config: LaunchConfig) -> Rendezvous:
    """Several nodes meet over torch's TCPStore before any worker starts; one node needs no torch yet."""
    if not config.multi_node:
        return LocalRendezvous(config)
    from ddpkit.launch.node_rendezvous import NodeRendezvous

    return NodeRendezvous(config)
