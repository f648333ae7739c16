"""How many CPU threads a rank should use: its share of the cores, the same rule under every launcher.

torch gives every process all the cores it may run on; with several ranks on a node they then fight
over them (2 threads per rank under plain srun on 2 cores, 1 under ``ddpkit run``). ``ddpkit run``
exports OMP_NUM_THREADS = cores // local ranks to its workers; srun and mpirun export nothing, so a
rank they start takes the same share itself, in ``ddpkit.init()``. A user's OMP_NUM_THREADS wins.
"""
from __future__ import annotations

import math
import os
from typing import Mapping

from ddpkit.runtime.environments.cpu_quota import cgroup_cpu_quota

__all__ = ["available_cores", "task_cores", "thread_share"]

_SHARING_LAUNCHERS = ("slurm", "mpi")


def available_cores() -> int:
    """The cores this process may run on: its affinity mask (which srun, mpirun and cpusets narrow),
    fewer where a cgroup CPU quota allows less time (``docker --cpus``, a Kubernetes CPU limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def thread_share(launcher: str, local_world_size: int, environ: Mapping[str, str],
                 cores: int | None = None) -> int | None:
    """Threads for one rank started by ``launcher``, or None to leave torch's setting alone.

    Under srun, SLURM_CPUS_PER_TASK is the rank's share when set. None where the user set
    OMP_NUM_THREADS, and for launchers that set it themselves (torchrun, ``ddpkit run``) or start one
    process (a world of one keeps every core).
    """
    if environ.get("OMP_NUM_THREADS", "").strip() or launcher not in _SHARING_LAUNCHERS:
        return None
    cores = available_cores() if cores is None else cores
    own = task_cores(launcher, environ, cores)
    return own if own is not None else max(1, cores // max(1, local_world_size))


def task_cores(launcher: str, environ: Mapping[str, str], cores: int) -> int | None:
    """The cores srun gave this task (``--cpus-per-task``), at most ``cores``; None where it gave none.

    The affinity mask may already be the task's own, so it is not divided by the ranks on the node.
    """
    per_task = environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if launcher == "slurm" and per_task.isdigit() and int(per_task) > 0:
        return min(int(per_task), cores)
    return None
