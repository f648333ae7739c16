"""MPI launchers (mpirun / mpiexec): Open MPI, MVAPICH, PMI and PMIx.

Each MPI flavour names rank, size, local rank and local size differently, and none exports the node
index or a rendezvous address; this module finds the flavour that is set, infers the node from the
rank mapping, and asks for MASTER_ADDR only when the job spans several nodes.
"""
from __future__ import annotations

from typing import Mapping

from ddpkit.runtime.environments.dist_env import DEFAULT_MASTER_PORT, LOOPBACK, DistEnv
from ddpkit.runtime.environments.ports import mpi_port
from ddpkit.runtime.environments.variables import (
    check_local_size,
    check_one_node,
    check_rank,
    read_int,
    read_master_port,
    read_optional_int,
    refuse,
)

__all__ = ["from_mpi", "MPI_FLAVOURS"]


MPI_FLAVOURS = (
    # rank, size, local rank, local size
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


# where a launcher keeps the job's size when the flavour's own size variable is missing
_SIZE_FALLBACKS = {
    "PMIX_SIZE": ("OMPI_COMM_WORLD_SIZE", "OMPI_MCA_orte_ess_num_procs", "OMPI_UNIVERSE_SIZE",
                  "PMI_SIZE"),
    "PMI_SIZE": ("PMIX_SIZE",),
}


# launchers that export the size only together with the rank: one without the other is a launch gone wrong
_RANKED_SIZES = {"OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE": "MV2_COMM_WORLD_RANK"}


def from_mpi(environ: Mapping[str, str]) -> DistEnv | None:
    flavour = next((names for names in MPI_FLAVOURS if names[0] in environ), None)
    if flavour is None:
        _check_no_orphan_size(environ)
        return None
    rank_name, size_name, local_rank_name, local_size_name = flavour
    size_name = _size_variable(environ, rank_name, size_name)
    rank = read_int(environ, rank_name)
    world_size = read_int(environ, size_name, minimum=1)
    check_rank(rank_name, rank, size_name, world_size)
    local_world_size = read_optional_int(environ, local_size_name, minimum=1) or world_size
    local_rank = read_optional_int(environ, local_rank_name)
    if local_rank is None:
        local_rank = rank % local_world_size
    check_rank(local_rank_name, local_rank, local_size_name, local_world_size)
    check_local_size(local_size_name, local_world_size, size_name, world_size,
                     f"the launcher and the job disagree on the number of processes; check {local_size_name}.")
    check_one_node(rank_name, rank, local_rank_name, local_rank, local_world_size, world_size)
    node_rank = _mpi_node(rank, world_size, local_rank, local_world_size)

    master_addr = environ.get("MASTER_ADDR", "").strip() or None
    if master_addr is None:
        if local_world_size < world_size:
            raise refuse("MASTER_ADDR", None,
                         f"{rank_name}={rank} in a job of {size_name}={world_size} over several nodes, "
                         "but MASTER_ADDR is not set.",
                         "pass it to every rank, e.g. 'mpirun -x MASTER_ADDR=<host of rank 0> "
                         f"-x MASTER_PORT={DEFAULT_MASTER_PORT} ...'.")
        master_addr = LOOPBACK  # every rank is on this node
    # every rank of one mpirun derives the same port from its job id; two mpiruns differ
    master_port = read_master_port(environ, mpi_port(environ) or DEFAULT_MASTER_PORT)
    return DistEnv(rank, world_size, local_rank, local_world_size, node_rank, master_addr,
                   master_port, "mpi")


def _check_no_orphan_size(environ: Mapping[str, str]) -> None:
    """Refuse a size variable whose rank is missing, which would otherwise run a lone single process."""
    for size_name, rank_name in _RANKED_SIZES.items():
        if environ.get(size_name, "").strip():
            raise refuse(rank_name, None,
                         f"{size_name}={environ[size_name]!r} is set but {rank_name} is not: this process "
                         "cannot tell which rank it is.",
                         f"start the job with mpirun/mpiexec, which sets both, or unset {size_name} to run "
                         "a single process.")


def _size_variable(environ: Mapping[str, str], rank_name: str, size_name: str) -> str:
    """The variable holding the number of ranks: the flavour's own, else another this launcher sets.

    Open MPI 4 exports PMIX_RANK but not PMIX_SIZE; its size is in its own variables instead.
    """
    candidates = (size_name, *_SIZE_FALLBACKS.get(size_name, ()))
    found = next((name for name in candidates if environ.get(name, "").strip()), None)
    if found is None:
        raise refuse(size_name, None,
                     f"{rank_name}={environ[rank_name]!r} is set but the number of ranks is not: none of "
                     f"{', '.join(candidates)} is set.",
                     f"start the job with mpirun/mpiexec, or export {size_name}=<number of ranks>.")
    return found


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
