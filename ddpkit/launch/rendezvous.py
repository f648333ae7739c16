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
from typing import Callable

import torch.distributed as dist

from ddpkit.errors import RendezvousError, explain
from ddpkit.launch.config import LaunchConfig
from ddpkit.runtime.job_check import JobRecord, claim
from ddpkit.runtime.port_holder import describe_holder

__all__ = ["Layout", "host_store", "LocalRendezvous"]


@dataclass(frozen=True)
class Layout:
    """The job as every node sees it: total workers, this node's first rank, node count, and this
    node's rank (numbered at the rendezvous with c10d)."""

    world_size: int
    rank_offset: int
    nnodes: int
    node_rank: int = 0


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
        held = (f" Another process, probably another job, holds port {port}{describe_holder(port)}."
                if e.errno == errno.EADDRINUSE else "")
        raise RendezvousError(explain(f"cannot listen on {bind_addr}:{port}: {e}.{held}",
                                      "leave out --master-port to let the launcher pick a free port."),
                              address=f"{bind_addr}:{port}", timeout=None) from e
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
        claim(self._store, JobRecord.here(self._config.job_id, self._config.nproc_per_node, "ddpkit run"))
        return self._config.master_addr, self._store.port

    def report_failure(self, attempt: int, info: dict) -> None:
        pass

    def remote_failure(self) -> dict | None:
        return None

    def finish_attempt(self, attempt: int, abort: Callable[[], bool]) -> dict | None:
        return None

    def close(self) -> None:
        self._store = None
