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

from ddpkit.errors import LauncherVariableError, explain
from ddpkit.runtime.environments.dist_env import DEFAULT_MASTER_PORT, LAUNCHERS, DistEnv
from ddpkit.runtime.environments.hostlist import expand_hostlist
from ddpkit.runtime.environments.mpi import MPI_FLAVOURS, from_mpi
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
    """RANK and WORLD_SIZE set by hand in a SLURM or MPI job (``srun bash -c 'RANK=$SLURM_PROCID
    ...'``), without torchrun's local variables: the node layout is the scheduler's, where it counts
    the same world size, and a RANK that is not the scheduler's rank there is refused. Derived from
    RANK alone, every rank would sit on one node (rank 9 of 16 on ``cuda:9`` of an 8-GPU node, and
    a share of the cores for 16)."""
    if "TORCHELASTIC_RUN_ID" in environ:  # torchrun or 'ddpkit run' (inside srun): its ranks, its layout
        return env
    for source in (from_slurm, from_mpi):
        try:
            scheduler = source(environ)
        except LauncherVariableError:  # its variables were never needed: the job ran without them
            continue
        if scheduler is None or scheduler.world_size != env.world_size:
            continue
        if scheduler.rank != env.rank:
            raise _same_rank_everywhere(env, scheduler, source is from_slurm, environ)
        if any(name in environ for name in _PLACE):  # set by hand beside RANK: the script's own layout
            return env
        return env.replace(local_rank=scheduler.local_rank, local_world_size=scheduler.local_world_size,
                           node_rank=scheduler.node_rank)
    return env


def _same_rank_everywhere(env: DistEnv, scheduler: DistEnv, slurm: bool,
                          environ: Mapping[str, str]) -> LauncherVariableError:
    """RANK exported by hand disagrees with the scheduler's rank in a world of the same size: set once
    in the batch script (``export RANK=$SLURM_PROCID`` before ``srun``, or ``mpirun -x RANK=0``), it is
    the same on every task; their rendezvous would wait for the ranks nobody holds."""
    name = "SLURM_PROCID" if slurm else next(names[0] for names in MPI_FLAVOURS if names[0] in environ)
    where = ("exported before srun (in the batch script" + (", where SLURM_PROCID is 0" if env.rank == 0 else "")
             + "), so every task gets the same value" if slurm else "passed to every rank alike (mpirun -x RANK=...)")
    also = "".join(f", {place}" for place in _PLACE if place in environ)
    return LauncherVariableError(explain(
        f"RANK={env.rank} but {name}={scheduler.rank}: this process is {name}={scheduler.rank} of "
        f"WORLD_SIZE={env.world_size}, and RANK was probably {where}.",
        f"unset RANK, WORLD_SIZE{also} (ddpkit reads {name} and the rest of the layout itself)"
        + (", or set them inside each task (srun bash -c 'RANK=$SLURM_PROCID ... python train.py', with "
           "MASTER_ADDR and MASTER_PORT exported)." if slurm else ".")),
        variable="RANK", value=str(env.rank))
