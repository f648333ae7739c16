"""torchrun and ``ddpkit run``: RANK, WORLD_SIZE, LOCAL_*, GROUP_* and MASTER_ADDR/MASTER_PORT.

Both launchers export torch's elastic variables, the most complete description of a job, so this
source is tried first. What it may leave out (LOCAL_WORLD_SIZE, LOCAL_RANK, GROUP_RANK) is derived
from what it set. The rendezvous address is required, in a world of one too, as torch's ``env://``
requires it: RANK and WORLD_SIZE without it are a launch gone wrong, not a single process.
"""
from __future__ import annotations

from typing import Mapping

from ddpkit.runtime.environments.dist_env import DEFAULT_MASTER_PORT, DistEnv
from ddpkit.runtime.environments.mpi import MPI_FLAVOURS
from ddpkit.runtime.environments.variables import (
    check_local_size,
    check_rank,
    read_int,
    read_master_port,
    read_optional_int,
    refuse,
)

__all__ = ["from_torchrun", "refuse_partial_launch"]


def from_torchrun(environ: Mapping[str, str]) -> DistEnv | None:
    has_rank, has_world = "RANK" in environ, "WORLD_SIZE" in environ
    if not (has_rank or has_world):
        return None
    both = "set both (torchrun and 'ddpkit run' do), or neither for a single process."
    if not has_world:
        raise refuse("WORLD_SIZE", None, f"RANK={environ['RANK']!r} is set but WORLD_SIZE is not.", both)
    if not has_rank:
        raise refuse("RANK", None, f"WORLD_SIZE={environ['WORLD_SIZE']!r} is set but RANK is not.", both)
    world_size = read_int(environ, "WORLD_SIZE", minimum=1,
                          hint="set WORLD_SIZE to the number of processes in the job (1 or more).")
    rank = read_int(environ, "RANK", hint="ranks count from 0; set RANK to this process's index in [0, WORLD_SIZE).")
    check_rank("RANK", rank, "WORLD_SIZE", world_size)

    local_world_size = read_optional_int(environ, "LOCAL_WORLD_SIZE", minimum=1)
    local_rank = read_optional_int(environ, "LOCAL_RANK")
    if local_world_size is None:
        if local_rank is not None:
            check_rank("LOCAL_RANK", local_rank, "WORLD_SIZE", world_size)
        local_world_size = world_size if local_rank is None or local_rank == rank else local_rank + 1
    if local_rank is None:
        local_rank = rank % local_world_size
    check_rank("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    check_local_size("LOCAL_WORLD_SIZE", local_world_size, "WORLD_SIZE", world_size,
                     "set LOCAL_WORLD_SIZE to the processes on this node (torchrun's --nproc-per-node), "
                     "at most WORLD_SIZE.")
    _check_consecutive(rank, local_rank, local_world_size, world_size, "LOCAL_WORLD_SIZE" in environ)
    num_nodes = read_optional_int(environ, "GROUP_WORLD_SIZE", minimum=1)
    if num_nodes is not None and num_nodes > world_size:
        raise refuse("GROUP_WORLD_SIZE", num_nodes,
                     f"GROUP_WORLD_SIZE={num_nodes} is larger than WORLD_SIZE={world_size}: every node runs "
                     "at least one process.",
                     "set GROUP_WORLD_SIZE to the number of nodes (torchrun's --nnodes), at most WORLD_SIZE.")
    if num_nodes == 1 and "LOCAL_WORLD_SIZE" in environ and local_world_size != world_size:
        raise refuse("GROUP_WORLD_SIZE", num_nodes,
                     f"GROUP_WORLD_SIZE=1 says the job is on one node, but WORLD_SIZE={world_size} and "
                     f"LOCAL_WORLD_SIZE={local_world_size} differ: on one node they are the same.",
                     "check GROUP_WORLD_SIZE (torchrun's --nnodes) and LOCAL_WORLD_SIZE (--nproc-per-node).")
    node_rank = read_optional_int(environ, "GROUP_RANK")
    if node_rank is None:
        node_rank = rank // local_world_size
    else:
        # torchrun says how many nodes there are; without it, nodes of LOCAL_WORLD_SIZE processes each
        described = None if num_nodes else (f"the nodes of WORLD_SIZE={world_size} processes, "
                                             f"LOCAL_WORLD_SIZE={local_world_size} per node")
        check_rank("GROUP_RANK", node_rank, "GROUP_WORLD_SIZE",
                   num_nodes or -(-world_size // local_world_size), described,
                   "GROUP_RANK is this node's index (torchrun's --node-rank), counted from 0; "
                   "check it and LOCAL_WORLD_SIZE.")
        even = num_nodes in (None, world_size // local_world_size) and world_size % local_world_size == 0
        if even and "LOCAL_WORLD_SIZE" in environ:  # a derived LOCAL_WORLD_SIZE is only a floor
            _check_node_start(rank, local_rank, node_rank, local_world_size)

    master_addr = environ.get("MASTER_ADDR", "").strip() or None
    master_port = read_master_port(environ, DEFAULT_MASTER_PORT)
    if master_addr is None:  # also in a world of one, as torch's env:// rendezvous
        if world_size == 1:
            raise refuse("MASTER_ADDR", None,
                         "RANK=0 and WORLD_SIZE=1 are set but MASTER_ADDR is not: these variables describe "
                         "a launched job, which has a rendezvous address.",
                         "unset RANK and WORLD_SIZE to run one process (ddpkit's single-process fallback), "
                         "or launch with 'ddpkit run' or torchrun, which set MASTER_ADDR and MASTER_PORT.")
        who = "the other ranks" if rank == 0 else f"rank {rank}"
        # srun's or mpirun's own variables counting the same ranks: they can describe the job alone
        scheduler = next((names for names in _SCHEDULER_RANKS
                          if names[0] in environ and environ.get(names[1], "").strip() == str(world_size)), None)
        raise refuse("MASTER_ADDR", None,
                     f"RANK={rank} and WORLD_SIZE={world_size} are set but MASTER_ADDR is not, so {who} "
                     "cannot find rank 0.",
                     f"{scheduler[0]} and {scheduler[1]}={world_size} are set: unset RANK and WORLD_SIZE, and "
                     "ddpkit reads the scheduler's own variables (under mpirun over several nodes, export "
                     "MASTER_ADDR=<host of rank 0> too); or export MASTER_ADDR=<host of rank 0> and "
                     "MASTER_PORT=<free port>." if scheduler else
                     "launch with 'ddpkit run' or torchrun, which set it, or export "
                     "MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free port>.")
    if "MASTER_PORT" not in environ:
        raise refuse("MASTER_PORT", None, f"MASTER_ADDR={master_addr} is set but MASTER_PORT is not.",
                     "export MASTER_PORT=<a free port on the host of rank 0>.")
    launcher = "ddpkit" if environ.get("DDPKIT_LAUNCHER") == "ddpkit" else "torchrun"
    return DistEnv(rank, world_size, local_rank, local_world_size, node_rank, master_addr,
                   master_port, launcher)


# the rank and size variables of the schedulers ddpkit also reads (SLURM, MPI flavours)
_SCHEDULER_RANKS = (("SLURM_PROCID", "SLURM_NTASKS"), *((rank, size) for rank, size, _, _ in MPI_FLAVOURS))

# torchrun's variables that, above these values, say the process is one of several
_SEVERAL = {"LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "GROUP_RANK": 0, "GROUP_WORLD_SIZE": 1}


def refuse_partial_launch(environ: Mapping[str, str]) -> None:
    """Where no launcher describes the job, a local or node rank that says "one of several" is refused.

    Run as a world of one, each such process would train alone and save over the others' work.
    Values that fit a single process (LOCAL_RANK=0, LOCAL_WORLD_SIZE=1) are left alone.
    """
    for name, single in _SEVERAL.items():
        value = read_optional_int(environ, name)
        if value is not None and value > single:
            raise refuse(name, value,
                         f"{name}={value} says this process is one of several, but RANK and WORLD_SIZE are "
                         "unset and no SLURM or MPI launcher's variables are set: it would train alone, "
                         "as rank 0 of a world of one.",
                         f"launch with torchrun or 'ddpkit run' (they set RANK and WORLD_SIZE), export RANK "
                         f"and WORLD_SIZE beside {name}, or unset {name} to run one process.")


def _check_consecutive(rank: int, local_rank: int, local_world_size: int, world_size: int,
                       local_world_size_set: bool) -> None:
    """torchrun gives a node's processes consecutive ranks: its first is RANK - LOCAL_RANK."""
    first = rank - local_rank
    if 0 <= first and first + local_world_size <= world_size:
        return
    size = (f"LOCAL_WORLD_SIZE={local_world_size}" if local_world_size_set
            else f"at least {local_world_size}, for LOCAL_RANK={local_rank}")
    raise refuse("LOCAL_RANK", local_rank,
                 f"RANK={rank} and LOCAL_RANK={local_rank} disagree: a node's processes hold consecutive "
                 f"ranks, so this node's would start at rank {first}, and its processes ({size}) do not "
                 f"fit in WORLD_SIZE={world_size}.", "RANK is the node's first rank + LOCAL_RANK; check both.")


def _check_node_start(rank: int, local_rank: int, node_rank: int, local_world_size: int) -> None:
    """With LOCAL_WORLD_SIZE processes on every node, node GROUP_RANK starts at GROUP_RANK x that."""
    if rank - local_rank != node_rank * local_world_size:
        raise refuse("GROUP_RANK", node_rank,
                     f"RANK={rank} with LOCAL_RANK={local_rank} makes rank {rank - local_rank} this node's "
                     f"first, but GROUP_RANK={node_rank} with LOCAL_WORLD_SIZE={local_world_size} processes "
                     f"on every node starts it at rank {node_rank * local_world_size}.",
                     "check RANK, LOCAL_RANK and GROUP_RANK (torchrun's --node-rank).")
