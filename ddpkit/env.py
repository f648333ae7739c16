"""Where am I in the job? ``detect(environ)`` reads the launcher's variables into a frozen ``DistEnv``.

Sources, first match wins: torchrun / ``ddpkit run`` (RANK, WORLD_SIZE, ...), SLURM's ``srun``
(SLURM_PROCID, ...), MPI launchers (Open MPI, MVAPICH, PMI/PMIx), and finally the single-process
fallback: rank 0 of a world of one. ``detect`` is pure: it reads the mapping it is given and writes
nothing, so every case is testable with a plain dict.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from ddpkit.hostlist import expand_hostlist

__all__ = ["DistEnv", "detect", "expand_hostlist", "LAUNCHERS", "DEFAULT_MASTER_PORT"]

LAUNCHERS = ("torchrun", "ddpkit", "slurm", "mpi", "single")
DEFAULT_MASTER_PORT = 29500
_LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job.

    ``rank``/``world_size`` count processes over the whole job, ``local_*`` those on this node,
    ``node_rank`` the node. ``backend`` and ``device`` stay None until ``ddpkit.init()`` fills them in.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "single"
    backend: str | None = None
    device: torch.device | None = None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def replace(self, **changes) -> DistEnv:
        return dataclasses.replace(self, **changes)


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the job layout from ``environ`` (``os.environ`` when not given; it is only read).

    Raises:
        ValueError: the variables are incomplete or contradict each other; the message names the
            variable, its value, and the fix.
    """
    environ = os.environ if environ is None else environ
    for source in (_from_torchrun, _from_slurm, _from_mpi):
        env = source(environ)
        if env is not None:
            return env
    return DistEnv()


# --------------------------------------------------------------------------------------------------
# parsing helpers


def _int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not an integer. HINT: set {name} to a whole number, or unset it."
        ) from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}.")
    return value


def _optional_int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    return _int(environ, name, minimum) if environ.get(name, "").strip() else None


def _check_rank(rank_name: str, rank: int, size_name: str, size: int) -> None:
    if not 0 <= rank < size:
        raise ValueError(
            f"{rank_name}={rank} is out of range for {size_name}={size}: {rank_name} must be in "
            f"[0, {size}). HINT: the launcher and the job disagree on the number of processes; "
            f"check {size_name}."
        )


def _master_port(environ: Mapping[str, str], default: int) -> int:
    if "MASTER_PORT" not in environ:
        return default
    port = _int(environ, "MASTER_PORT", minimum=1)
    if port > 65535:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port: it must be in [1, 65535].")
    return port


# --------------------------------------------------------------------------------------------------
# torchrun / ddpkit run


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv | None:
    has_rank, has_world = "RANK" in environ, "WORLD_SIZE" in environ
    if not (has_rank or has_world):
        return None
    if not has_world:
        raise ValueError(
            f"RANK={environ['RANK']!r} is set but WORLD_SIZE is not. HINT: set both (torchrun and "
            "'ddpkit run' do), or neither for a single process."
        )
    if not has_rank:
        raise ValueError(
            f"WORLD_SIZE={environ['WORLD_SIZE']!r} is set but RANK is not. HINT: set both (torchrun "
            "and 'ddpkit run' do), or neither for a single process."
        )
    world_size = _int(environ, "WORLD_SIZE", minimum=1)
    rank = _int(environ, "RANK")
    _check_rank("RANK", rank, "WORLD_SIZE", world_size)

    local_world_size = _optional_int(environ, "LOCAL_WORLD_SIZE", minimum=1)
    local_rank = _optional_int(environ, "LOCAL_RANK")
    if local_world_size is None:
        local_world_size = world_size if local_rank is None or local_rank == rank else local_rank + 1
    if local_rank is None:
        local_rank = rank % local_world_size
    _check_rank("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    if local_world_size > world_size:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_world_size} is larger than WORLD_SIZE={world_size}: a node "
            "cannot hold more processes than the whole job."
        )
    node_rank = _optional_int(environ, "GROUP_RANK")
    if node_rank is None:
        node_rank = rank // local_world_size

    master_addr = environ.get("MASTER_ADDR", "").strip() or None
    master_port = _master_port(environ, DEFAULT_MASTER_PORT)
    if world_size > 1 and master_addr is None:
        raise ValueError(
            f"RANK={rank} and WORLD_SIZE={world_size} are set but MASTER_ADDR is not, so rank "
            f"{rank} cannot find rank 0. HINT: launch with 'ddpkit run' or torchrun, which set it, "
            "or export MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free port>."
        )
    if world_size > 1 and "MASTER_PORT" not in environ:
        raise ValueError(
            f"MASTER_ADDR={master_addr} is set but MASTER_PORT is not. HINT: export "
            "MASTER_PORT=<a free port on the host of rank 0>."
        )
    launcher = "ddpkit" if environ.get("DDPKIT_LAUNCHER") == "ddpkit" else "torchrun"
    return DistEnv(rank, world_size, local_rank, local_world_size, node_rank, master_addr,
                   master_port, launcher)


# --------------------------------------------------------------------------------------------------
# SLURM (srun)


def _from_slurm(environ: Mapping[str, str]) -> DistEnv | None:
    if "SLURM_PROCID" not in environ:
        return None
    rank = _int(environ, "SLURM_PROCID")
    world_size = _optional_int(environ, "SLURM_NTASKS", minimum=1)
    if world_size is None:
        world_size = _optional_int(environ, "SLURM_NPROCS", minimum=1) or 1
    _check_rank("SLURM_PROCID", rank, "SLURM_NTASKS", world_size)

    nodelist_name = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in environ else "SLURM_NODELIST"
    nodes = expand_hostlist(environ[nodelist_name]) if nodelist_name in environ else []
    num_nodes = (_optional_int(environ, "SLURM_JOB_NUM_NODES", 1)
                 or _optional_int(environ, "SLURM_NNODES", 1) or len(nodes) or 1)

    # sbatch may export SLURM_NTASKS_PER_NODE in SLURM_TASKS_PER_NODE's "4(x2)" form too
    per_node_counts = _tasks_per_node(environ, "SLURM_NTASKS_PER_NODE")
    per_node = per_node_counts[0] if per_node_counts and len(set(per_node_counts)) == 1 else None
    if per_node is not None and per_node * num_nodes != world_size:
        raise ValueError(
            f"SLURM_NTASKS={world_size} disagrees with {num_nodes} node(s) x "
            f"SLURM_NTASKS_PER_NODE={per_node} = {per_node * num_nodes} tasks. HINT: ask sbatch/srun "
            "for a consistent layout, e.g. --nodes=N --ntasks-per-node=K without a different --ntasks."
        )
    # the step's real layout, one count per node: srun's default block distribution fills node 0 first
    counts_name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                        if environ.get(n, "").strip()), None)
    if counts_name is not None:
        counts = _tasks_per_node(environ, counts_name)
    else:
        counts_name = "SLURM_NTASKS_PER_NODE"
        counts = [per_node] * num_nodes if per_node else per_node_counts
    node_rank = _optional_int(environ, "SLURM_NODEID")
    if node_rank is None:
        node_rank = _block_node(counts, rank, counts_name, environ) if counts else 0
    _check_rank("SLURM_NODEID", node_rank, "the node count", num_nodes)
    on_node = counts[node_rank] if counts and node_rank < len(counts) else None
    local_world_size = on_node or per_node or max(1, world_size // num_nodes)
    local_rank = _optional_int(environ, "SLURM_LOCALID")
    if local_rank is None:
        local_rank = (rank - sum(counts[:node_rank]) if counts and on_node
                      else rank % local_world_size)
    _check_rank("SLURM_LOCALID", local_rank, "the tasks on this node", local_world_size)

    master_addr = environ.get("MASTER_ADDR", "").strip() or (nodes[0] if nodes else None)
    if master_addr is None:
        if world_size > 1:
            raise ValueError(
                f"SLURM_PROCID={rank} with SLURM_NTASKS={world_size}, but neither SLURM_JOB_NODELIST "
                "nor MASTER_ADDR is set, so the ranks cannot find each other. HINT: run under srun, "
                "or export MASTER_ADDR=<first node>."
            )
        master_addr = _LOOPBACK
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    # every task of the job derives the same port from the job id; jobs sharing a node differ
    default_port = 15000 + int(job_id[-4:]) if job_id and job_id[-4:].isdigit() else DEFAULT_MASTER_PORT
    master_port = _master_port(environ, default_port)
    return DistEnv(rank, world_size, local_rank, local_world_size, node_rank, master_addr,
                   master_port, "slurm")


def _tasks_per_node(environ: Mapping[str, str], name: str) -> list[int] | None:
    """Read a tasks-per-node variable such as ``"2(x3),1"`` into one count per node."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None or int(match.group(1)) < 1:
            raise ValueError(f"{name}={text!r} is not in SLURM's format: positive task counts such as "
                             "'4' or '2(x3),1'. HINT: unset it, or let sbatch/srun set it.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _block_node(counts: list[int], rank: int, name: str, environ: Mapping[str, str]) -> int:
    """The node holding ``rank`` when node i runs ``counts[i]`` consecutive ranks."""
    for node, first_of_next in enumerate(itertools.accumulate(counts)):
        if rank < first_of_next:
            return node
    raise ValueError(
        f"SLURM_PROCID={rank} is beyond the {sum(counts)} task(s) that {name}="
        f"{environ.get(name)!r} places on the nodes. HINT: set SLURM_NODEID and SLURM_LOCALID "
        "(srun does), or make the two agree.")


# --------------------------------------------------------------------------------------------------
# MPI launchers (mpirun / mpiexec): Open MPI, MVAPICH, PMI and PMIx


_MPI_FLAVOURS = (
    # rank, size, local rank, local size
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


def _from_mpi(environ: Mapping[str, str]) -> DistEnv | None:
    for rank_name, size_name, local_rank_name, local_size_name in _MPI_FLAVOURS:
        if rank_name in environ:
            break
    else:
        return None
    if size_name not in environ:
        raise ValueError(
            f"{rank_name}={environ[rank_name]!r} is set but {size_name} is not. HINT: start the job "
            "with mpirun/mpiexec, which sets both."
        )
    rank = _int(environ, rank_name)
    world_size = _int(environ, size_name, minimum=1)
    _check_rank(rank_name, rank, size_name, world_size)
    local_world_size = _optional_int(environ, local_size_name, minimum=1) or world_size
    local_rank = _optional_int(environ, local_rank_name)
    if local_rank is None:
        local_rank = rank % local_world_size
    _check_rank(local_rank_name, local_rank, local_size_name, local_world_size)
    # Open MPI numbers the nodes itself; elsewhere assume mpirun's default: ranks fill node 0 first
    node_rank = _optional_int(environ, "OMPI_COMM_WORLD_NODE_RANK") if rank_name.startswith("OMPI") else None
    if node_rank is None:
        node_rank = rank // local_world_size

    master_addr = environ.get("MASTER_ADDR", "").strip() or None
    if master_addr is None:
        if local_world_size < world_size:
            raise ValueError(
                f"{rank_name}={rank} in a job of {size_name}={world_size} over several nodes, but "
                "MASTER_ADDR is not set. HINT: pass it to every rank, e.g. "
                "'mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ...'."
            )
        master_addr = _LOOPBACK  # every rank is on this node
    master_port = _master_port(environ, DEFAULT_MASTER_PORT)
    return DistEnv(rank, world_size, local_rank, local_world_size, node_rank, master_addr,
                   master_port, "mpi")
