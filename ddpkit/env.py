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

from ddpkit.hostlist import expand_hostlist, expand_tasks_per_node

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


def _int(environ: Mapping[str, str], name: str, minimum: int = 0, hint: str | None = None) -> int:
    raw = environ[name]
    # int() would also take '1_0', '+1' and non-ASCII digits: a launcher writes none of them
    if re.fullmatch(r"-?[0-9]+", raw.strip()) is None:
        raise ValueError(
            f"{name}={raw!r} is not an integer. HINT: set {name} to plain decimal digits, or unset it."
        )
    value = int(raw.strip())
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}. "
                         f"{hint or f'HINT: set {name} to a whole number >= {minimum}, or unset it.'}")
    return value


def _optional_int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    return _int(environ, name, minimum) if environ.get(name, "").strip() else None


def _first_set(environ: Mapping[str, str], *names: str) -> str | None:
    return next((name for name in names if environ.get(name, "").strip()), None)


def _check_rank(rank_name: str, rank: int, size_name: str, size: int, described: str | None = None,
                hint: str | None = None) -> None:
    """``rank`` must be in [0, size); ``described`` says where ``size`` came from when not ``size_name``."""
    if not 0 <= rank < size:
        hint = hint or ("HINT: the launcher and the job disagree on the number of processes; "
                        f"check {size_name}.")
        raise ValueError(f"{rank_name}={rank} is out of range for {described or f'{size_name}={size}'}: "
                         f"{rank_name} must be in [0, {size}). {hint}")


def _master_port(environ: Mapping[str, str], default: int) -> int:
    if "MASTER_PORT" not in environ:
        return default
    hint = "HINT: set MASTER_PORT to a free TCP port in [1, 65535] on the host of rank 0, e.g. 29500."
    port = _int(environ, "MASTER_PORT", minimum=1, hint=hint)
    if port > 65535:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port: it must be in [1, 65535]. {hint}")
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
    world_size = _int(environ, "WORLD_SIZE", minimum=1,
                      hint="HINT: set WORLD_SIZE to the number of processes in the job (1 or more).")
    rank = _int(environ, "RANK", hint="HINT: ranks count from 0; set RANK to this process's index "
                                      "in [0, WORLD_SIZE).")
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
            "cannot hold more processes than the whole job. HINT: set LOCAL_WORLD_SIZE to the "
            "processes on this node (torchrun's --nproc-per-node), at most WORLD_SIZE."
        )
    node_rank = _optional_int(environ, "GROUP_RANK")
    if node_rank is None:
        node_rank = rank // local_world_size
    else:
        # torchrun says how many nodes there are; without it, nodes of LOCAL_WORLD_SIZE processes each
        num_nodes = _optional_int(environ, "GROUP_WORLD_SIZE", minimum=1)
        described = None if num_nodes else (f"the nodes of WORLD_SIZE={world_size} processes, "
                                             f"LOCAL_WORLD_SIZE={local_world_size} per node")
        _check_rank("GROUP_RANK", node_rank, "GROUP_WORLD_SIZE",
                    num_nodes or -(-world_size // local_world_size), described,
                    "HINT: GROUP_RANK is this node's index (torchrun's --node-rank), counted from 0; "
                    "check it and LOCAL_WORLD_SIZE.")

    master_addr = environ.get("MASTER_ADDR", "").strip() or None
    master_port = _master_port(environ, DEFAULT_MASTER_PORT)
    if world_size > 1 and master_addr is None:
        who = "the other ranks" if rank == 0 else f"rank {rank}"
        raise ValueError(
            f"RANK={rank} and WORLD_SIZE={world_size} are set but MASTER_ADDR is not, so {who} "
            "cannot find rank 0. HINT: launch with 'ddpkit run' or torchrun, which set it, "
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

# Inside a job step (srun) the SLURM_STEP_* variables describe this step; the job's may describe the
# allocation instead (srun -n4 in an --ntasks-per-node=4 allocation keeps SLURM_NTASKS_PER_NODE=4).
_SLURM_TASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_SLURM_LAYOUT = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_SLURM_NODES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
_SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def _from_slurm(environ: Mapping[str, str]) -> DistEnv | None:
    if "SLURM_PROCID" not in environ:
        return None
    rank = _int(environ, "SLURM_PROCID")
    tasks_name, nodes_name = _first_set(environ, *_SLURM_TASKS), _first_set(environ, *_SLURM_NODES)
    nodelist_name = _first_set(environ, *_SLURM_NODELIST)
    hosts = _hostlist(environ, nodelist_name) if nodelist_name else []
    world_size = _int(environ, tasks_name, minimum=1) if tasks_name else None
    num_nodes = _int(environ, nodes_name, minimum=1) if nodes_name else len(hosts) or None
    counts, layout, layout_name = _slurm_layout(environ, rank, world_size, num_nodes)
    world_size = sum(counts) if world_size is None else world_size
    tasks = f"{tasks_name}={world_size}" if tasks_name else f"the {world_size} task(s) of {layout}"
    _check_rank("SLURM_PROCID", rank, tasks_name or "SLURM_NTASKS", world_size, tasks)

    node_rank = _optional_int(environ, "SLURM_NODEID")
    if node_rank is None:
        node_rank = _block_node(counts, rank, layout)
    nodes_described = (None if nodes_name and num_nodes == len(counts)
                       else f"the {len(counts)} node(s) of {layout}")
    _check_rank("SLURM_NODEID", node_rank, nodes_name or "SLURM_NNODES", len(counts), nodes_described)
    local_world_size = counts[node_rank]
    local_rank = _optional_int(environ, "SLURM_LOCALID")
    if local_rank is None:
        local_rank = rank - sum(counts[:node_rank])  # srun's default block distribution
        if not 0 <= local_rank < local_world_size:
            raise ValueError(
                f"SLURM_PROCID={rank} is not among the tasks that {layout} places on SLURM_NODEID="
                f"{node_rank}. HINT: set SLURM_LOCALID (srun does), or make the two agree.")
    _check_rank("SLURM_LOCALID", local_rank, layout_name, local_world_size,
                f"the {local_world_size} task(s) on node {node_rank} of {layout}")
    if sum(counts) != world_size:
        raise ValueError(
            f"{tasks_name}={world_size} disagrees with {layout} = {sum(counts)} tasks. HINT: ask "
            "sbatch/srun for a consistent layout, e.g. --nodes=N --ntasks-per-node=K without a "
            "different --ntasks.")

    master_addr = environ.get("MASTER_ADDR", "").strip() or (hosts[0] if hosts else None)
    if master_addr is None:
        if world_size > 1:
            raise ValueError(
                f"SLURM_PROCID={rank} with {tasks}, but neither SLURM_JOB_NODELIST "
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


def _hostlist(environ: Mapping[str, str], name: str) -> list[str]:
    try:
        return expand_hostlist(environ[name])
    except ValueError as e:
        raise ValueError(f"{name}={environ[name]!r}: {e}") from e


def _slurm_layout(environ: Mapping[str, str], rank: int, world_size: int | None,
                  num_nodes: int | None) -> tuple[list[int], str, str]:
    """The tasks on each node, where that came from, and the variable to check (for messages)."""
    layout_name = _first_set(environ, *_SLURM_LAYOUT)
    if layout_name is not None:
        text = environ[layout_name]
        return expand_tasks_per_node(layout_name, text), f"{layout_name}={text!r}", layout_name
    if environ.get("SLURM_NTASKS_PER_NODE", "").strip():
        # only without a per-node layout: an srun step may have overridden the job's value
        text = environ["SLURM_NTASKS_PER_NODE"]
        counts = expand_tasks_per_node("SLURM_NTASKS_PER_NODE", text)  # sbatch may write '4(x2)' too
        if len(set(counts)) > 1:
            return counts, f"SLURM_NTASKS_PER_NODE={text!r}", "SLURM_NTASKS_PER_NODE"
        nodes = num_nodes or 1
        return ([counts[0]] * nodes, f"{nodes} node(s) x SLURM_NTASKS_PER_NODE={counts[0]}",
                "SLURM_NTASKS_PER_NODE")
    if world_size is None:
        if rank > 0:
            raise ValueError(
                f"SLURM_PROCID={rank} is set but SLURM_NTASKS is unset, so the number of tasks is "
                "unknown. HINT: run under srun, which sets both, or export SLURM_NTASKS=<tasks>.")
        world_size = 1
    # no per-node counts: an even split over the nodes (srun's default when it divides), the first
    # nodes taking one more when it does not
    nodes = min(num_nodes or 1, world_size)
    base, extra = divmod(world_size, nodes)
    return ([base + 1] * extra + [base] * (nodes - extra),
            f"{world_size} task(s) spread evenly over {nodes} node(s)", "SLURM_TASKS_PER_NODE")


def _block_node(counts: list[int], rank: int, layout: str) -> int:
    """The node holding ``rank`` when node i runs ``counts[i]`` consecutive ranks."""
    for node, first_of_next in enumerate(itertools.accumulate(counts)):
        if rank < first_of_next:
            return node
    raise ValueError(
        f"SLURM_PROCID={rank} is beyond the {sum(counts)} task(s) that {layout} places on the nodes. "
        "HINT: set SLURM_NODEID and SLURM_LOCALID (srun does), or make the two agree.")


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
    node_rank = _mpi_node(rank, world_size, local_rank, local_world_size)

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


def _mpi_node(rank: int, world_size: int, local_rank: int, local_world_size: int) -> int:
    """The node index, which MPI launchers do not export.

    (Open MPI's OMPI_COMM_WORLD_NODE_RANK is a rank *on* the node, counted over all jobs there.)
    mpirun's default mapping fills node 0 first; ``--map-by node`` deals ranks round-robin, which
    shows as local ranks that count up every ``nodes`` ranks instead.
    """
    num_nodes, uneven = divmod(world_size, local_world_size)
    if local_rank != rank % local_world_size and not uneven and local_rank == rank // num_nodes:
        return rank % num_nodes
    return rank // local_world_size
