"""One store, one job: the store records the job that owns it, and a rank of another job is refused.

Two jobs that meet on one port (one MASTER_PORT given to both, a port both derive) would otherwise
form one process group holding ranks of both, whose all-reduces return plausible, wrong sums. So
whoever creates a rendezvous store (rank 0, or the launcher that hosts it) writes its ``JobRecord``
under ``OWNER_KEY`` before anyone can count as arrived; every rank that connects reads it and
compares its own job (``ddpkit.runtime.environments.job``) and WORLD_SIZE before it counts itself.
A stranger is refused at once, with a message naming the port, both jobs and the fix; it also leaves
its record under ``INTRUDER_KEY``/<n>, which the owning job's ranks read while they wait, so the
owner is told too. See Note [Job identity in the rendezvous] in docs/design.md.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from ddpkit.errors import RendezvousError, explain

if TYPE_CHECKING:  # the stores' type only: ``ddpkit run`` claims its store in a module it loads before torch
    import torch.distributed as dist

__all__ = ["JobRecord", "OWNER_KEY", "INTRUDER_KEY", "PORT_FIX", "claim", "read_owner", "check_member",
           "new_intruders", "tell_of_intruders"]

OWNER_KEY = "ddpkit/job"
INTRUDER_KEY = "ddpkit/intruders"
PORT_FIX = "give each job its own port (MASTER_PORT, or the --master-port of ddpkit run and torchrun)"
_POLL = 0.01


@dataclass(frozen=True)
class JobRecord:
    """Who a participant of a rendezvous is: its job (None: unnamed), its size, and where it runs."""

    job: str | None
    world_size: int | None
    who: str
    host: str
    pid: int

    @classmethod
    def here(cls, job: str | None, world_size: int | None, who: str) -> JobRecord:
        return cls(job, world_size, who, socket.gethostname(), os.getpid())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobRecord:
        fields = json.loads(text)
        return cls(fields.get("job"), fields.get("world_size"), str(fields.get("who", "?")),
                   str(fields.get("host", "?")), int(fields.get("pid", 0)))

    def describe(self) -> str:
        """``job slurm:12.0 (rank 0, pid 4242 on node1, WORLD_SIZE=2)``."""
        name = f"job {self.job}" if self.job else "an unnamed job"
        size = "" if self.world_size is None else f", WORLD_SIZE={self.world_size}"
        return f"{name} ({self.who}, pid {self.pid} on {self.host}{size})"


def claim(store: dist.Store, me: JobRecord) -> None:
    """The store's creator records its job, before any other participant can count itself."""
    store.set(OWNER_KEY, me.to_json())


def read_owner(store: dist.Store, me: JobRecord, deadline: float, first_come: bool) -> JobRecord:
    """The job that owns ``store``.

    ``first_come``: the store's creator is no participant that records a job (torchrun's agent
    store), so the first participant to arrive claims it; otherwise the creator already did, or
    does so a moment after the store opens.

    Raises:
        TimeoutError: no job recorded by ``deadline`` (the store was not made by ddpkit).
    """
    if first_come:
        return JobRecord.from_json(store.compare_set(OWNER_KEY, "", me.to_json()))
    while not store.check([OWNER_KEY]):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no job recorded under {OWNER_KEY!r}")
        time.sleep(_POLL)
    return JobRecord.from_json(store.get(OWNER_KEY))


def check_member(store: dist.Store, me: JobRecord, owner: JobRecord, address: str) -> None:
    """Refuse ``me`` unless it belongs to the owner's job; a refused stranger leaves its record.

    Raises:
        RendezvousError: another job owns the store, or this job's ranks disagree on WORLD_SIZE.
    """
    same_job = owner.job == me.job
    sizes_agree = None in (owner.world_size, me.world_size) or owner.world_size == me.world_size
    if same_job and sizes_agree:
        return
    if same_job and owner.job is not None:
        raise RendezvousError(explain(
            f"{me.describe()} and {owner.describe()}, which hosts the rendezvous at {address}, are one "
            "job but disagree on WORLD_SIZE.", "launch every rank with the same number of processes."),
            address=address, timeout=None)
    try:
        number = store.add(INTRUDER_KEY, 1)
        store.set(f"{INTRUDER_KEY}/{number}", me.to_json())
    except (RuntimeError, OSError):
        pass  # the owner is gone already: nobody is left to tell
    what = ("another job" if owner.job != me.job
            else "another unnamed job (or this job, launched with a different WORLD_SIZE)")
    raise RendezvousError(explain(
        f"the rendezvous at {address} (port {address.rpartition(':')[2]}) belongs to {what}: "
        f"{owner.describe()}. This is {me.describe()}, so it was refused and joins no process group; "
        "rank 0 of the other job is told while it waits for its ranks.",
        f"two jobs share the port: {PORT_FIX}. Under srun and mpirun ddpkit derives a port per job "
        "(see 'Ports and job identity' in docs/schedulers.md)."), address=address, timeout=None)


def new_intruders(store: dist.Store, seen: int) -> tuple[int, list[JobRecord]]:
    """Strangers refused since the first ``seen`` that nobody has told of yet: the new count, and
    their records. Each is handed out once: a multi-node launcher and its rank 0 read one store."""
    records = []
    for number in range(seen + 1, store.add(INTRUDER_KEY, 0) + 1):
        key = f"{INTRUDER_KEY}/{number}"
        if not store.check([key]):  # written a moment after the count: read it next time
            return number - 1, records
        if store.add(f"{key}/told", 1) == 1:
            records.append(JobRecord.from_json(store.get(key)))
        seen = number
    return seen, records


def tell_of_intruders(store: dist.Store, seen: int, address: str, tell: Callable[[str], None]) -> int:
    """The owner's side: ``tell`` one line per stranger refused since ``seen`` (that no other reader
    of the store told of); returns the new count."""
    seen, strangers = new_intruders(store, seen)
    for stranger in strangers:
        tell(explain(f"ddpkit: {stranger.describe()} reached this job's rendezvous at {address} and was "
                     "refused; this job goes on without it.",
                     f"two jobs share port {address.rpartition(':')[2]}: {PORT_FIX}."))
    return seen
