"""Where am I in the job? ``detect(environ)`` reads the launcher's variables into a frozen ``DistEnv``.

Sources, first match wins (torchrun's RANK and WORLD_SIZE without a node layout take SLURM's or
MPI's): torchrun / ``ddpkit run`` (RANK, WORLD_SIZE, ...), SLURM's ``srun``
(SLURM_PROCID, ...), MPI launchers (Open MPI, MVAPICH, PMI/PMIx), and finally the single-process
fallback: rank 0 of a world of one, unless a local or node rank says the process is one of several.
``detect`` is pure: it reads the mapping it is given and writes nothing, so every case is testable
with a plain dict. Each source is read by its own module in ``ddpkit.runtime.environments``; this
module fixes their order and is the public face.
"""
from __future__ import annotations

import os
from typing import Mapping

from ddpkit.errors import LauncherVariableError
from ddpkit.runtime.environments.dist_env import DEFAULT_MASTER_PORT, LAUNCHERS, DistEnv
from ddpkit.runtime.environments.hostlist import expand_hostlist
from ddpkit.runtime.environments.mpi import from_mpi
from ddpkit.runtime.environments.slurm import from_slurm
from ddpkit.runtime.environments.torchrun import from_torchrun, refuse_partial_launch

__all__ = ["DistEnv", "detect", "launched", "expand_hostlist", "LAUNCHERS", "DEFAULT_MASTER_PORT"]

# the detection order: the most complete description of the job first
_SOURCES = (from_torchrun, from_slurm, from_mpi)


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the job layout from ``environ`` (``os.environ`` when not given; it is only read).

    Raises:
        LauncherVariableError: the variables are incomplete or contradict each other (a ValueError);
            its ``variable`` and ``value`` say which to fix, its message also how.
    """
    environ = os.environ if environ is None else environ
    env = launched(environ)
    if env is not None:
        return env
    refuse_partial_launch(environ)  # LOCAL_RANK=1 alone: a launch that lost its RANK and WORLD_SIZE
    return DistEnv()


def launched(environ: Mapping[str, str]) -> DistEnv | None:
    """What a launcher's variables say, or None where none are set (a script that made its process
    group itself may still have set LOCAL_RANK: the group, not the variable, says it is one of several)."""
    for source in _SOURCES:
        env = source(environ)
        if env is not None:
            return _with_scheduler_layout(env, environ) if source is from_torchrun else env
    return None


# torchrun's variables that say where a process sits among its node's
_PLACE = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _with_scheduler_layout(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """RANK and WORLD_SIZE exported by hand in a SLURM or MPI job (``export RANK=$SLURM_PROCID``,
    then ``srun``), without torchrun's local variables: the node layout is the scheduler's, where it
    counts the same ranks. Derived from RANK alone, every rank would sit on one node (rank 9 of 16
    on ``cuda:9`` of an 8-GPU node, and a share of the cores for 16)."""
    if any(name in environ for name in _PLACE):
        return env
    for source in (from_slurm, from_mpi):
        try:
            scheduler = source(environ)
        except LauncherVariableError:  # its variables were never needed: the job ran without them
            continue
        if scheduler is not None and (scheduler.rank, scheduler.world_size) == (env.rank, env.world_size):
            return env.replace(local_rank=scheduler.local_rank, local_world_size=scheduler.local_world_size,
                               node_rank=scheduler.node_rank)
    return env
