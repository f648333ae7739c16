"""A process that refuses its launcher variables tells the ranks that wait for it.

Under srun without ``--kill-on-bad-exit`` a task that fails in ``init()`` leaves the others running,
and rank 0 would wait the whole rendezvous timeout for it. A typical case: ``export RANK=0`` before
srun, which every task inherits; task 0 agrees with it and waits, task 1 refuses. Where the refused
variables still name the rendezvous (MASTER_ADDR and MASTER_PORT), the refusing process leaves its
error in the store for a few seconds' try, under its job's name, and the waiting ranks of that job
raise it at once. Under torchrun and ``ddpkit run`` the launcher stops the job itself.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Mapping

import torch.distributed as dist

from ddpkit.runtime.environments.job import job_id
from ddpkit.runtime.store_client import connect, launcher_hosts_store

__all__ = ["tell_the_job", "refusal_for", "KEY"]

KEY = "ddpkit/refused"
"""Outside any group's prefix: the refusing process knows no more of the rendezvous than its address."""


_SCHEDULER_RANKS = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
"""Under srun or mpirun the ranks start together: rank 0 may open the store a moment after this one
refuses, so the refusal waits a few seconds for it; elsewhere one second, so that an error is not late."""


def tell_the_job(environ: Mapping[str, str], error: Exception, seconds: float = 5.0) -> None:
    """Best effort: leave ``error`` in the store MASTER_ADDR:MASTER_PORT names, if one answers."""
    addr, port = environ.get("MASTER_ADDR", "").strip(), environ.get("MASTER_PORT", "").strip()
    if not addr or not port.isdigit() or launcher_hosts_store(environ):
        return
    if not any(name in environ for name in _SCHEDULER_RANKS):
        seconds = min(seconds, 1.0)
    try:
        store = connect(addr, int(port), 1, time.monotonic() + seconds)
        store.set(KEY, json.dumps({"job": job_id(environ, "torchrun"), "host": socket.gethostname(),
                                   "pid": os.getpid(), "error": str(error)}))
    except Exception:  # noqa: BLE001 - nobody listens, or not a store: the error is raised here anyway
        pass


def refusal_for(store: dist.Store, job: str | None) -> dict[str, Any] | None:
    """The refusal a process of ``job`` left in ``store``, if any."""
    if not store.check([KEY]):
        return None
    record = json.loads(store.get(KEY))
    return record if record.get("job") == job else None
