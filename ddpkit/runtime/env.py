"""Where am I in the job? ``detect(environ)`` reads the launcher's variables into a frozen ``DistEnv``.

Sources, first match wins: torchrun / ``ddpkit run`` (RANK, WORLD_SIZE, ...), SLURM's ``srun``
(SLURM_PROCID, ...), MPI launchers (Open MPI, MVAPICH, PMI/PMIx), and finally the single-process
fallback: rank 0 of a world of one, unless a local or node rank says the process is one of several.
``detect`` is pure: it reads the mapping it is given and writes nothing, so every case is testable
with a plain dict. Each source is read by its own module in ``ddpkit.runtime.environments``; this
module fixes their order and is the public face.
"""
from __future__ import annotations

import os
from typing import Mapping

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
            return env
    return None
