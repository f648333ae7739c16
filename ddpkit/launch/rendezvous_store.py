"""How a node's launcher reaches the rendezvous store: node 0 hosts it, the others connect.

With the static rendezvous (torchrun's default) every node is told its ``--node-rank`` and node 0
hosts the store at ``--master-addr:--master-port``. With ``--rdzv-backend c10d``, as torchrun's
multi-node command line has it (``--rdzv-endpoint HOST:PORT``, no ``--node-rank``), the nodes are
numbered at the rendezvous: the launcher on the endpoint's host that binds its port hosts the store
and is node 0, and the others take 1, 2, ... in the order they arrive. Node ranks then say nothing
about the hosts, as under torchrun's c10d, whose node ranks are not fixed either.
"""
from __future__ import annotations

import ipaddress
import socket
import time
from datetime import timedelta
from typing import Callable

import psutil
import torch.distributed as dist

from ddpkit.errors import RendezvousError, explain
from ddpkit.launch.config import LaunchConfig
from ddpkit.launch.logs import say
from ddpkit.launch.node_watch import launcher_store, wait_reachable
from ddpkit.runtime.job_check import PORT_FIX
from ddpkit.runtime.port_holder import describe_holder

__all__ = ["host_node_store", "try_hosting", "endpoint_is_here", "number_this_node", "connect"]

NEXT_NODE_KEY = "c10d/next-node"  # the rank the next arriving node takes, less one


def host_node_store(cfg: LaunchConfig, error: Callable[[str], RendezvousError]) -> dist.TCPStore:
    """Node 0 of a static rendezvous hosts the store, or says why it cannot."""
    try:
        return dist.TCPStore(cfg.master_addr, cfg.master_port, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise error(explain(
            f"node 0 cannot host the rendezvous on port {cfg.master_port}: {e}. Another process "
            f"holds it{describe_holder(cfg.master_port)}: another job, or another node of this run "
            "started with --node-rank 0 too.",
            f"if that is this run's, give every node its own --node-rank; else {PORT_FIX}, or start it "
            "under srun/mpirun, which derive one per job.")) from e


def try_hosting(cfg: LaunchConfig) -> dist.TCPStore | None:
    """c10d: host the store if the endpoint is on this host and its port is free, else None (the
    node connects as the others do; a store of another job there is refused by its job record)."""
    if not endpoint_is_here(cfg.master_addr):
        return None
    try:
        return dist.TCPStore(cfg.master_addr, cfg.master_port, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError):
        return None  # another launcher of this host took it first, or another process holds it


def endpoint_is_here(host: str) -> bool:
    """Whether ``host`` names this machine: loopback, its host name, or one of its addresses."""
    name = host.strip("[]")
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    mine = {a.address.split("%")[0] for nic in psutil.net_if_addrs().values() for a in nic}
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a.split("%")[0] in mine for a in addresses)


def number_this_node(store: dist.Store, hosting: bool, nnodes: int, address: str,
                     error: Callable[[str], RendezvousError]) -> int:
    """c10d: node 0 is the host; the others take the next number, in the order they arrive."""
    if hosting:
        return 0
    rank = store.add(NEXT_NODE_KEY, 1)
    if rank >= nnodes:
        raise error(explain(
            f"more nodes came to the rendezvous at {address} than --nnodes {nnodes}: this one would be "
            f"node {rank}.", "start --nnodes launchers in all, each with the same --nnodes; a run of its own "
            "needs an --rdzv-id and --rdzv-endpoint of its own."))
    return rank


def connect(cfg: LaunchConfig, address: str, deadline: float, abort: Callable[[], bool],
            error: Callable[..., RendezvousError]) -> dist.Store:
    """This launcher's connection to the rendezvous store, waiting for it until ``deadline``."""
    failure: Exception | None = None
    me = "this node" if cfg.assign_node_rank else f"node {cfg.node_rank}"  # c10d numbers it later
    # a plain socket first: TCPStore's own retries log a C++ stack trace per attempt
    wait_reachable(cfg.master_addr, cfg.master_port, deadline, abort, lambda: say(
        f"ddpkit run: {me} is waiting for node 0's rendezvous at {address} (at most {cfg.rdzv_timeout:g} s)"))
    while not abort():
        wait = max(1.0, min(5.0, deadline - time.monotonic()))
        try:
            return launcher_store(cfg.master_addr, cfg.master_port, timedelta(seconds=wait))
        except (RuntimeError, OSError) as e:
            failure = e
        if time.monotonic() >= deadline:
            break
    if abort():
        raise error(f"interrupted while waiting to reach node 0's rendezvous at {address}")
    raise error(explain(
        f"{me} could not reach node 0's rendezvous at {address} within {cfg.rdzv_timeout:g} s ({failure}).",
        ("start a node on the endpoint's host, which hosts it, with the same --rdzv-endpoint"
         if cfg.assign_node_rank else "start node 0 with the same --master-addr/--master-port") +
        ", and check the address is reachable from this host."), timed_out=True)
