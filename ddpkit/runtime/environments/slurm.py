"""SLURM's ``srun``: SLURM_PROCID, the job step's task and node layout, and the hostlist.

SLURM spreads one job over several variables that may disagree (a job step's own versus the
allocation's), compresses host names and per-node counts, and exports no rendezvous address; this
module picks the variables that describe this step, derives what is missing (node and local rank,
the first host as MASTER_ADDR, a port from the job id) and checks that the pieces agree.
"""
from __future__ import annotations

import itertools
from typing import Mapping

from ddpkit.errors import LauncherVariableError
from ddpkit.runtime.environments.dist_env import DEFAULT_MASTER_PORT, LOOPBACK, DistEnv
from ddpkit.runtime.environments.hostlist import expand_hostlist, expand_tasks_per_node
from ddpkit.runtime.environments.job import SLURM_BATCH_STEPS, slurm_step
from ddpkit.runtime.environments.mpi import MPI_FLAVOURS
from ddpkit.runtime.environments.ports import slurm_port
from ddpkit.runtime.environments.variables import (
    check_one_node,
    check_rank,
    first_set,
    read_int,
    read_master_port,
    read_optional_int,
    refuse,
)

__all__ = ["from_slurm"]

# Inside a job step (srun) the SLURM_STEP_* variables describe this step; the job's may describe the
# allocation instead (srun -n4 in an --ntasks-per-node=4 allocation keeps SLURM_NTASKS_PER_NODE=4).
_SLURM_TASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_SLURM_LAYOUT = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_SLURM_NODES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
# set by mpirun itself (not by srun, which may set PMI_RANK / PMIX_RANK for its own tasks)
_MPIRUN_RANKS = ("OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_SLURM_STEP_ONLY = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST")
_SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_NODE_COUNT_OF = {"SLURM_STEP_NODELIST": "SLURM_STEP_NUM_NODES", "SLURM_JOB_NODELIST": "SLURM_JOB_NUM_NODES",
                  "SLURM_NODELIST": "SLURM_NNODES"}


def from_slurm(environ: Mapping[str, str]) -> DistEnv | None:
    if "SLURM_PROCID" not in environ:
        _refuse_allocation_shell(environ)
        return None
    if _outside_a_step(environ):
        return None
    rank = read_int(environ, "SLURM_PROCID")
    tasks_name, nodes_name = first_set(environ, *_SLURM_TASKS), first_set(environ, *_SLURM_NODES)
    nodelist_name = first_set(environ, *_SLURM_NODELIST)
    hosts = _hostlist(environ, nodelist_name) if nodelist_name else []
    world_size = read_int(environ, tasks_name, minimum=1) if tasks_name else None
    num_nodes = read_int(environ, nodes_name, minimum=1) if nodes_name else len(hosts) or None
    _check_node_count(nodes_name, num_nodes, nodelist_name, hosts)
    counts, layout, layout_name = _slurm_layout(environ, rank, world_size, num_nodes, tasks_name, nodes_name)
    world_size = sum(counts) if world_size is None else world_size
    tasks = f"{tasks_name}={world_size}" if tasks_name else f"the {world_size} task(s) of {layout}"
    check_rank("SLURM_PROCID", rank, tasks_name or "SLURM_NTASKS", world_size, tasks)

    node_rank = read_optional_int(environ, "SLURM_NODEID")
    if node_rank is None:
        node_rank = _block_node(counts, rank, layout)
    nodes_described = (None if nodes_name and num_nodes == len(counts)
                       else f"the {len(counts)} node(s) of {layout}")
    check_rank("SLURM_NODEID", node_rank, nodes_name or "SLURM_NNODES", len(counts), nodes_described)
    local_world_size = counts[node_rank]
    local_rank = read_optional_int(environ, "SLURM_LOCALID")
    if local_rank is None:
        local_rank = rank - sum(counts[:node_rank])  # srun's default block distribution
        if not 0 <= local_rank < local_world_size:
            raise refuse("SLURM_PROCID", rank,
                         f"SLURM_PROCID={rank} is not among the tasks that {layout} places on "
                         f"SLURM_NODEID={node_rank}.", "set SLURM_LOCALID (srun does), or make the two agree.")
    check_rank("SLURM_LOCALID", local_rank, layout_name, local_world_size,
               f"the {local_world_size} task(s) on node {node_rank} of {layout}")
    check_one_node("SLURM_PROCID", rank, "SLURM_LOCALID", local_rank, local_world_size, world_size)
    if sum(counts) != world_size:
        raise refuse(tasks_name or "SLURM_NTASKS", world_size,
                     f"{tasks_name}={world_size} disagrees with {layout} = {sum(counts)} tasks.",
                     "ask sbatch/srun for a consistent layout, e.g. --nodes=N --ntasks-per-node=K "
                     "without a different --ntasks.")

    master_addr = environ.get("MASTER_ADDR", "").strip() or (hosts[0] if hosts else None)
    if master_addr is None:
        if world_size > 1:
            raise refuse("MASTER_ADDR", None,
                         f"SLURM_PROCID={rank} with {tasks}, but neither SLURM_JOB_NODELIST nor "
                         "MASTER_ADDR is set, so the ranks cannot find each other.",
                         "run under srun, or export MASTER_ADDR=<first node>.")
        master_addr = LOOPBACK
    # every task of the step derives the same port from the job and step id; jobs sharing a node differ
    master_port = read_master_port(environ, slurm_port(environ) or DEFAULT_MASTER_PORT)
    return DistEnv(rank, world_size, local_rank, local_world_size, node_rank, master_addr,
                   master_port, "slurm")


def _outside_a_step(environ: Mapping[str, str]) -> bool:
    """True where SLURM's variables are the batch script's, not an srun task's.

    A batch script runs once, as SLURM_PROCID=0, whatever its --ntasks: only srun starts the tasks.
    Under an mpirun inside the script those variables are inherited and say nothing about the
    ranks (the MPI reader describes them); on the other nodes mpirun's daemons may even run in an
    srun step, whose SLURM_PROCID counts nodes, not ranks. Started directly with several tasks asked for, the script
    would wait the whole rendezvous timeout for ranks that never come: refused at once instead.
    """
    if any(name in environ for name in _MPIRUN_RANKS):
        return True  # mpirun's rank (on other nodes its daemon may run in an srun step of its own)
    step = slurm_step(environ)
    if step is not None and step not in SLURM_BATCH_STEPS:
        return False
    if step is None and first_set(environ, *_SLURM_STEP_ONLY):
        return False  # srun's step variables without the id (an environment copied in part)
    if any(names[0] in environ for names in MPI_FLAVOURS):
        return True
    if environ["SLURM_PROCID"].strip() != "0":
        return False  # not the batch script, which is always task 0: some launcher's task
    tasks_name = first_set(environ, *_SLURM_TASKS)
    tasks = read_int(environ, tasks_name, minimum=1) if tasks_name else 1
    if tasks > 1:
        job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "?"
        where = (f"SLURM_STEP_ID={step} is SLURM's {SLURM_BATCH_STEPS[step]} step" if step
                 else "SLURM_STEP_ID is unset")
        raise refuse("SLURM_STEP_ID", step,
                     f"this is the batch script of SLURM job {job}, run once, not a task of a job step: "
                     f"{tasks_name}={tasks} but {where}, so the other {tasks - 1} task(s) will never start.",
                     "start the script with srun inside the batch script, e.g. 'srun python train.py' "
                     "(or sbatch --wrap 'srun python train.py'); srun starts one task per --ntasks.")
    return False  # a single-task batch script: a world of one, as SLURM_PROCID=0 of 1 says


def _refuse_allocation_shell(environ: Mapping[str, str]) -> None:
    """salloc's shell (``salloc -n 2 python train.py``, srun forgotten) has the job's variables but no
    SLURM_PROCID: not a task, so the tasks asked for never start. Refused, as the batch script is,
    rather than run as a lone process; an mpirun's ranks there are MPI's (another reader)."""
    job = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    tasks_name = first_set(environ, *_SLURM_TASKS)
    if (not job or tasks_name is None or first_set(environ, *_SLURM_STEP_ONLY)
            or any(names[0] in environ for names in MPI_FLAVOURS)):
        return
    tasks = read_int(environ, tasks_name, minimum=1)
    if tasks > 1:
        raise refuse("SLURM_PROCID", None,
                     f"SLURM job {job} asks for {tasks_name}={tasks} tasks, but this process is not one of "
                     "them: SLURM_PROCID is unset, as in salloc's shell, so the other "
                     f"{tasks - 1} task(s) will never start.",
                     "start the script with srun, e.g. 'srun python train.py', which starts one task per "
                     "--ntasks; to run a single process here, 'srun -n 1 python train.py'.")


def _check_node_count(nodes_name: str | None, num_nodes: int | None, nodelist_name: str | None,
                      hosts: list[str]) -> None:
    """A node count and the node list of its own pair name as many nodes. Counts and lists of other
    pairs may differ: a step (srun) may run on part of the job's allocation."""
    if not (nodes_name and hosts) or _NODE_COUNT_OF.get(nodelist_name or "") != nodes_name:
        return
    if num_nodes != len(hosts):
        raise refuse(nodes_name, num_nodes,
                     f"{nodes_name}={num_nodes} disagrees with {nodelist_name}, which names {len(hosts)} "
                     f"node(s): {', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}.",
                     "run under srun or sbatch, which set both, or make the two agree.")


def _hostlist(environ: Mapping[str, str], name: str) -> list[str]:
    try:
        return expand_hostlist(environ[name])
    except ValueError as e:  # the hostlist's own message, which ends with its HINT
        raise LauncherVariableError(f"{name}={environ[name]!r}: {e}", variable=name,
                                    value=environ[name]) from e


def _slurm_layout(environ: Mapping[str, str], rank: int, world_size: int | None, num_nodes: int | None,
                  tasks_name: str | None, nodes_name: str | None) -> tuple[list[int], str, str]:
    """The tasks on each node, where that came from, and the variables to check (for messages):
    those that are set, so that a hint never names one the job lacks."""
    layout_name = first_set(environ, *_SLURM_LAYOUT)
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
            raise refuse("SLURM_NTASKS", None,
                         f"SLURM_PROCID={rank} is set but SLURM_NTASKS is unset, so the number of tasks "
                         "is unknown.", "run under srun, which sets both, or export SLURM_NTASKS=<tasks>.")
        world_size = 1
    # no per-node counts: an even split over the nodes (srun's default when it divides), the first
    # nodes taking one more when it does not
    nodes = min(num_nodes or 1, world_size)
    base, extra = divmod(world_size, nodes)
    given = " and ".join(name for name in (tasks_name, nodes_name) if name) or "SLURM_NTASKS"
    return ([base + 1] * extra + [base] * (nodes - extra),
            f"{world_size} task(s) spread evenly over {nodes} node(s)", given)


def _block_node(counts: list[int], rank: int, layout: str) -> int:
    """The node holding ``rank`` when node i runs ``counts[i]`` consecutive ranks."""
    for node, first_of_next in enumerate(itertools.accumulate(counts)):
        if rank < first_of_next:
            return node
    raise refuse("SLURM_PROCID", rank,
                 f"SLURM_PROCID={rank} is beyond the {sum(counts)} task(s) that {layout} places on the "
                 "nodes.", "set SLURM_NODEID and SLURM_LOCALID (srun does), or make the two agree.")
