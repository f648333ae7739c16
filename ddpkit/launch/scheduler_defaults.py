"""What ``ddpkit run`` takes from the scheduler that started it, once per node, on several nodes.

The launchers of one job must agree on node 0's address and port, and each must know its node rank;
torchrun's users pass them by hand (``--node-rank $SLURM_PROCID --master-addr <first host>``). Where
the scheduler says them, they are the defaults: the port from the job id (as ``ddpkit.init`` derives
it, so that two jobs on one node differ), and under ``srun --ntasks-per-node=1`` the task's rank as
the node rank and the step's first host as node 0. A flag given wins.
"""
from __future__ import annotations

from typing import Mapping

from ddpkit.runtime.environments.dist_env import DEFAULT_MASTER_PORT, DistEnv
from ddpkit.runtime.environments.ports import mpi_port, slurm_port
from ddpkit.runtime.environments.slurm import from_slurm

__all__ = ["job_port", "srun_task_per_node"]


def job_port(environ: Mapping[str, str]) -> int:
    """The port of this srun step or mpirun job, else torchrun's default."""
    return slurm_port(environ) or mpi_port(environ) or DEFAULT_MASTER_PORT


def srun_task_per_node(environ: Mapping[str, str], nnodes: int) -> DistEnv | None:
    """This launcher's srun task, where the step runs one per node (``nnodes`` tasks); else None."""
    try:
        task = from_slurm(environ)
    except ValueError:  # SLURM's variables contradict each other: the flags' own defaults
        return None
    return task if task is not None and task.world_size == nnodes else None
