"""Where a launched job's ranks meet: a TCPStore at MASTER_ADDR:MASTER_PORT, with a deadline and a job check.

Rank 0 hosts the store (or the launcher does, under torchrun and ``ddpkit run``); every rank connects,
proves it belongs to the store's job (``job_check``), counts itself and waits until all have come.
Each way this can fail says so at once and in its own words: a port rank 0 cannot bind is held by
another process, probably another job; a rank of another job is refused and the owner told; only
ranks that never come cost the whole timeout. Before meeting, a rank started by srun or mpirun takes
its share of the node's cores (``environments.threads``), as ``ddpkit run``'s workers are given.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

from ddpkit.errors import RendezvousError, explain, rank_prefix
from ddpkit.runtime.environments.dist_env import DistEnv
from ddpkit.runtime.environments.job import job_id
from ddpkit.runtime.hangs.report import rank_list
from ddpkit.runtime.job_check import PORT_FIX, JobRecord, check_member, claim, read_owner, tell_of_intruders
from ddpkit.runtime.port_holder import describe_holder
from ddpkit.runtime.refusal import refusal_for
from ddpkit.runtime.store_client import connect, launcher_hosts_store, seconds_left

__all__ = ["rendezvous"]

# how many groups this process has joined, so that an init() after shutdown() meets on fresh keys
_joined = [0]
_POLL = (0.002, 0.1)  # seconds between checks while waiting: from quick to patient
_NAMED_MISSING = 4096  # a timed-out rendezvous names the missing ranks of a world up to this size


def rendezvous(env: DistEnv, timeout: timedelta, environ: Mapping[str, str] | None = None,
               notice_after: float = 0.0) -> dist.Store:
    """Connect to (or, on rank 0, host) the TCPStore and wait until every rank of this job has arrived.

    A rank late to ``init()`` is a hang before any collective: after ``notice_after`` seconds (the
    stall timeout; 0: never) of waiting, and again after each further such period, every waiting rank
    says how many ranks joined, and rank 0 which are missing.

    One deadline covers every step: torch's client retries its connection with a backoff that
    overshoots its timeout about twice over, so a client first waits for the port with plain sockets.

    Raises:
        RendezvousError: the port is taken, the store belongs to another job, or not every rank
            arrived within ``timeout`` (a RuntimeError); the message says which, and the fix.
    """
    environ = os.environ if environ is None else environ
    address = f"{env.master_addr}:{env.master_port}"
    deadline = time.monotonic() + timeout.total_seconds()
    agent_hosts_store = launcher_hosts_store(environ)
    hosting = env.rank == 0 and not agent_hosts_store
    me = JobRecord.here(job_id(environ, env.launcher), env.world_size, f"rank {env.rank}")
    store = (_host(env, address, environ, deadline) if hosting
             else _connect(env, address, timeout, deadline, agent_hosts_store, notice_after, environ))
    if hosting:
        claim(store, me)
    else:
        try:
            owner = read_owner(store, me, deadline, first_come=agent_hosts_store)
        except TimeoutError as e:
            raise RendezvousError(explain(
                f"rank {env.rank} reached a store at {address}, but nothing there says which job owns it "
                f"within {timeout.total_seconds():.0f} s: it is not a ddpkit rendezvous.",
                f"another program holds port {env.master_port}: {PORT_FIX}."),
                address=address, timeout=timeout.total_seconds()) from e
        check_member(store, me, owner, address)
    # A restarted group, or one joined again after shutdown(), must not read the keys of the
    # previous one from a store that outlived it (the launcher's): every rank counts alike.
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _joined[0] += 1
    group = dist.PrefixStore(f"ddpkit/attempt{attempt}/group{_joined[0]}", store)
    if group.add(f"rank/{env.rank}", 1) > 1:
        raise RendezvousError(explain(
            f"rank {env.rank} joined the rendezvous at {address} twice: two processes of "
            f"{me.describe()} were given RANK={env.rank}.",
            f"give each process its own rank; if another job uses this port too: {PORT_FIX}."),
            address=address, timeout=None)
    if group.add("arrived", 1) == env.world_size:
        group.set("complete", "1")
    _wait_complete(env, store, group, address, timeout, deadline, notice_after, environ, me.job)
    return group


def _host(env: DistEnv, address: str, environ: Mapping[str, str], deadline: float) -> dist.Store:
    """Rank 0 opens the store; a port already taken is reported now, not after the timeout.

    The store listens on every address of this host; only rank 0's own connection to it uses
    MASTER_ADDR. Where that names no address of this host (a typo, another node, a NAT's public
    address, a name not resolvable yet) the connection would hang for torch's 5 minutes, past
    ``init(timeout=...)``: it goes over loopback instead, with a notice, and the others' arrival
    within the deadline tells whether they found it (on one node they take loopback too).
    """
    try:
        own = env.master_addr if _names_this_host(env.master_addr) else "127.0.0.1"
        why = "is not an address of this host"
    except OSError as e:  # perhaps not yet: a pod's own DNS name comes a few seconds after it starts
        own, why = "127.0.0.1", f"does not resolve here ({e})"
    if own != env.master_addr:
        others = ("every rank is on this node and reaches it over loopback, but set MASTER_ADDR to this host"
                  if env.local_world_size == env.world_size else "the other ranks look for it there. If they "
                  "cannot reach it, init() fails when its timeout runs out: set MASTER_ADDR to this host")
        _tell(f"{rank_prefix(env.rank)}ddpkit: MASTER_ADDR={env.master_addr} {why} ({socket.gethostname()}), "
              f"where rank 0 hosts the rendezvous; {others}.")
    try:
        return dist.TCPStore(own, env.master_port, env.world_size, is_master=True, wait_for_workers=False,
                             timeout=seconds_left(deadline))
    except (RuntimeError, OSError) as e:
        in_use = "EADDRINUSE" in str(e) or "already in use" in str(e)
        if not in_use:
            raise RendezvousError(explain(f"rank 0 cannot host the rendezvous at {address}: {e}.",
                                          f"check MASTER_ADDR={env.master_addr} names this host."),
                                  address=address, timeout=None) from e
        chosen = ("MASTER_PORT is set" if "MASTER_PORT" in environ
                  else f"ddpkit derived it from the {env.launcher} job id")
        raise RendezvousError(explain(
            f"rank 0 cannot host the rendezvous: port {env.master_port} on {socket.gethostname()} is "
            f"already in use ({chosen}). Another process, probably another job, holds it"
            f"{describe_holder(env.master_port)}.",
            f"{PORT_FIX}, or unset MASTER_PORT under srun/mpirun, where ddpkit derives a port per job."),
            address=address, timeout=None) from e


def _connect(env: DistEnv, address: str, timeout: timedelta, deadline: float, agent: bool, notice_after: float,
             environ: Mapping[str, str]) -> dist.Store:
    """Connect to the store, saying every ``notice_after`` seconds (0: never) why it cannot yet.

    In a job on one node, where rank 0 hosts the store, a MASTER_ADDR that names no address of this
    host is reached over loopback, as rank 0 itself does.
    """
    who = "the launcher" if agent else "rank 0"
    host = env.master_addr if agent or env.local_world_size < env.world_size else _own_address(env.master_addr)
    start = time.monotonic()
    notice = [start + notice_after if notice_after > 0 else float("inf")]

    def tell_if_due(reason: str) -> None:
        now = time.monotonic()
        if now >= notice[0]:
            notice[0] = now + notice_after
            _tell(f"{rank_prefix(env.rank)}ddpkit: this rank cannot reach the rendezvous at {address} yet ({who} "
                  f"hosts it): {reason}; for {now - start:.0f} s, it gives up in {deadline - now:.0f} s. Check "
                  f"that MASTER_ADDR and MASTER_PORT are the same on every rank and that {who} is running."
                  + _scheduler_hints(env, environ))

    try:
        return connect(host, env.master_port, env.world_size, deadline, tell_if_due)
    except (RuntimeError, OSError) as e:
        raise RendezvousError(explain(
            f"rank {env.rank} could not reach the rendezvous at {address} within "
            f"{timeout.total_seconds():.0f} s ({who} hosts it): {e}.",
            f"check that MASTER_ADDR={env.master_addr} and MASTER_PORT={env.master_port} are the same on "
            "every rank, that rank 0 is running, and that the port is free and reachable."),
            address=address, timeout=timeout.total_seconds()) from e


def _own_address(master_addr: str) -> str:
    """MASTER_ADDR where it names this host, else loopback (a job on one node: rank 0 is here)."""
    try:
        return master_addr if _names_this_host(master_addr) else "127.0.0.1"
    except OSError:  # does not resolve (yet): rank 0 listens here all the same
        return "127.0.0.1"


def _wait_complete(env: DistEnv, store: dist.Store, group: dist.Store, address: str, timeout: timedelta,
                   deadline: float, notice_after: float, environ: Mapping[str, str], job: str | None) -> None:
    """Wait for every rank; meanwhile rank 0 tells of strangers the job check refused, every rank
    raises a refusal a process of ``job`` left (``ddpkit.runtime.refusal``), and, after
    ``notice_after`` seconds, says who it waits for."""
    pause, seen, refused = _POLL[0], 0, None
    start = time.monotonic()
    notice = start + notice_after if notice_after > 0 else float("inf")
    try:
        while not group.check(["complete"]):
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError
            refused = refusal_for(store, job)
            if refused is not None:
                break
            if env.rank == 0:
                seen = tell_of_intruders(store, seen, address, _tell)
            if now >= notice:
                notice = now + notice_after
                _tell_waiting(env, group, address, now - start, deadline - now, environ)
            time.sleep(pause)
            pause = min(_POLL[1], pause * 2)
    except (RuntimeError, OSError, TimeoutError) as e:
        try:
            joined = f"only {group.add('arrived', 0)} of WORLD_SIZE={env.world_size} ranks joined"
            if env.rank == 0:  # one rank asks: every rank asking would be world_size**2 store queries
                joined += _missing(group, env.world_size)
        except (RuntimeError, OSError):  # rank 0 gave up first and took its store with it
            joined = f"rank 0 gave up and closed the store, so not all of WORLD_SIZE={env.world_size} ranks joined"
        raise RendezvousError(explain(
            f"rendezvous at {address} timed out after {timeout.total_seconds():.0f} s: {joined} "
            f"(this is rank {env.rank}).",
            "a rank failed to start or was launched with a different MASTER_ADDR/MASTER_PORT or WORLD_SIZE."
            + _scheduler_hints(env, environ)),
            address=address, timeout=timeout.total_seconds()) from e
    if refused is not None:
        raise RendezvousError(explain(
            f"a process of this job (pid {refused['pid']} on {refused['host']}) refused its launcher variables, "
            f"so not all of WORLD_SIZE={env.world_size} ranks can join the rendezvous at {address} (this is "
            f"rank {env.rank}). Its error: {refused['error'].replace(' HINT: ', ' (its hint: ')})",
            "fix what that error names; under srun, --kill-on-bad-exit=1 also ends the other tasks as soon "
            "as one fails."), address=address, timeout=None)


def _tell_waiting(env: DistEnv, group: dist.Store, address: str, waited: float, left: float,
                  environ: Mapping[str, str]) -> None:
    """``ddpkit: rank 0 waits in init() for the other ranks: 1 of WORLD_SIZE=2 joined, missing: rank 1``."""
    missing = _missing(group, env.world_size) if env.rank == 0 else ""
    _tell(f"{rank_prefix(env.rank)}ddpkit: this rank waits in ddpkit.init() at {address} for the others: "
          f"{group.add('arrived', 0)} of WORLD_SIZE={env.world_size} ranks joined{missing}, for {waited:.0f} s; "
          f"it gives up in {left:.0f} s. A rank late to init() is still starting, or stuck before it; one "
          "that never comes was launched with another MASTER_ADDR/MASTER_PORT or WORLD_SIZE, or failed."
          + _scheduler_hints(env, environ))


def _scheduler_hints(env: DistEnv, environ: Mapping[str, str]) -> str:
    """What the scheduler's own variables add to a wait: srun lets the other tasks live on when one
    fails, and a WORLD_SIZE set by hand may not count the tasks it started."""
    hints = []
    tasks_name = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
                       if environ.get(n, "").strip()), None)
    if "TORCHELASTIC_RUN_ID" in environ or tasks_name is None:
        return ""
    if tasks_name.startswith("SLURM") and "SLURM_PROCID" in environ:
        hints.append(" Under srun, a task that failed leaves the others running unless srun was given "
                     "--kill-on-bad-exit=1; srun's output names it.")
    if env.launcher == "torchrun" and environ[tasks_name].strip() != str(env.world_size):
        hints.append(f" WORLD_SIZE={env.world_size} was set by hand, but {tasks_name}={environ[tasks_name].strip()} "
                     "processes were started: if each is one rank, WORLD_SIZE is wrong.")
    return "".join(hints)


def _missing(group: dist.Store, world_size: int) -> str:
    """", missing: ranks 3, 5-7": the ranks that never checked in (one store query each, so only up
    to _NAMED_MISSING ranks; on a larger world the count alone)."""
    if world_size > _NAMED_MISSING:
        return ""
    missing = [r for r in range(world_size) if not group.check([f"rank/{r}"])]
    return f", missing: {rank_list(missing)}" if missing else ""


def _names_this_host(host: str) -> bool:
    """Whether ``host`` resolves to an address this host can bind (OSError: it does not resolve, yet)."""
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


def _tell(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

