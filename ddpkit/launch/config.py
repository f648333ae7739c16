"""``ddpkit run``'s command line: torchrun's flag names and meanings, parsed into a frozen ``LaunchConfig``.

Every torchrun flag ddpkit supports keeps both spellings (``--nproc-per-node`` and
``--nproc_per_node``) and, as in torchrun, may come from a ``PET_<NAME>`` environment variable
(``PET_NNODES=2``), which is how Kubernetes operators configure torchrun. Parsing is pure: it reads the
``environ`` it is given and writes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Mapping, Sequence

from ddpkit.errors import explain
from ddpkit.launch.scheduler_defaults import job_port, srun_task_per_node
from ddpkit.launch.torchrun_flags import (
    ConsoleFilter,
    add_torchrun_flags,
    check_refused,
    console_filter,
    notes,
    rdzv_timeout,
)
from ddpkit.runtime.environments.dist_env import DEFAULT_MASTER_PORT
from ddpkit.runtime.environments.job import job_id
from ddpkit.runtime.environments.threads import available_cores

__all__ = ["LaunchConfig", "build_parser", "parse_args", "resolve_nproc_per_node"]

DEFAULT_GRACE_PERIOD = 30.0  # torchrun's --shutdown-timeout default
C10D_PORT = 29400  # torchrun's c10d endpoint port where --rdzv-endpoint gives none
DEFAULT_RDZV_TIMEOUT = 600.0  # torchrun's static rendezvous (and c10d's join_timeout) wait 10 minutes
DEFAULT_NODE_TIMEOUT = 30.0


@dataclass(frozen=True)
class LaunchConfig:
    """What one ``ddpkit run`` on one node does.

    ``command`` is the worker's full argv (interpreter included unless ``--no-python``);
    ``master_port`` None means "any free port" on a single node.
    """

    command: tuple[str, ...]
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    assign_node_rank: bool = False  # c10d on several nodes: numbered at the rendezvous (rendezvous_store)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    log_dir: str | None = None
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    node_timeout: float = DEFAULT_NODE_TIMEOUT
    grace_period: float = DEFAULT_GRACE_PERIOD
    monitor_interval: float = 0.05
    run_id: str = "none"
    role: str = "default"
    job_id: str | None = None  # the rendezvous's job check; given to workers as DDPKIT_JOB_ID
    console: ConsoleFilter = ConsoleFilter()  # whose output the console shows
    notes: tuple[str, ...] = ()  # torchrun flags given that ddpkit does not act on, one line each

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def _spellings(name: str) -> list[str]:
    """torchrun accepts ``--a-b`` and ``--a_b`` for every multi-word flag."""
    dashed = f"--{name}"
    underscored = dashed[:2] + dashed[2:].replace("-", "_")
    return [dashed] if underscored == dashed else [dashed, underscored]


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser; defaults come from ``PET_*`` variables in ``environ`` where torchrun reads them."""
    environ = os.environ if environ is None else environ

    def pet(dest: str, default: object) -> object:
        return environ.get(f"PET_{dest.upper()}", default)

    def pet_flag(dest: str) -> bool:
        name = f"PET_{dest.upper()}"
        value = environ.get(name, "").strip()
        try:  # torchrun's reading: an integer, 0 is off
            return bool(int(value or "0"))
        except ValueError:
            raise ValueError(f"{name}={environ[name]!r} is not an integer: torchrun reads its on/off "
                             f"variables as 0 or 1, so give {name}=1 (on) or {name}=0 (off).") from None

    p = argparse.ArgumentParser(
        prog="ddpkit run",
        description="Start a training script on N processes per node, with torchrun's flags and "
        "worker environment. The first worker to fail stops the job and is named in a summary.",
    )
    p.add_argument(*_spellings("nproc-per-node"), dest="nproc_per_node", metavar="N|auto|cpu|gpu",
                   default=pet("nproc_per_node", "1"),
                   help="workers on this node: an integer, 'gpu' (one per GPU), 'cpu' (one per "
                   "core) or 'auto' (GPUs if any, else cores). Default 1.")
    p.add_argument("--nnodes", default=pet("nnodes", "1"), metavar="N",
                   help="number of nodes (an integer; torchrun's elastic 'MIN:MAX' is not supported).")
    p.add_argument(*_spellings("node-rank"), dest="node_rank", type=int, metavar="R",
                   default=pet("node_rank", None), help="this node's rank in [0, nnodes). Default 0 "
                   "(under srun with one task per node, SLURM_PROCID).")
    p.add_argument(*_spellings("master-addr"), dest="master_addr", metavar="ADDR", default=pet("master_addr", None),
                   help="address of node 0, reachable from every node. Default 127.0.0.1 (under srun with "
                   "one task per node, the step's first host).")
    p.add_argument(*_spellings("master-port"), dest="master_port", type=int, metavar="PORT",
                   default=pet("master_port", None),
                   help=f"rendezvous port on node 0 (several nodes: default {DEFAULT_MASTER_PORT}); "
                   "on a single node the default is a free port the launcher holds itself.")
    p.add_argument("--standalone", action="store_true", default=pet_flag("standalone"),
                   help="single node on a free loopback port; --master-addr/--master-port ignored.")
    p.add_argument(*_spellings("max-restarts"), dest="max_restarts", type=int, metavar="K",
                   default=pet("max_restarts", 0),
                   help="restart the whole group up to K times after a failure "
                   "(TORCHELASTIC_RESTART_COUNT tells the script which attempt it is).")
    p.add_argument(*_spellings("log-dir"), dest="log_dir", default=pet("log_dir", None), metavar="DIR",
                   help="also write each rank's output to DIR/<run id>_<random>/attempt_<k>/rank_<r>.log "
                   "(a directory per run, as torchrun's).")
    p.add_argument(*_spellings("rdzv-timeout"), dest="rdzv_timeout", type=float, metavar="SECONDS",
                   default=pet("rdzv_timeout", None),
                   help="seconds the nodes wait for each other (ddpkit's flag; torchrun's is --rdzv-conf "
                   f"timeout=SECONDS, read too). Default {DEFAULT_RDZV_TIMEOUT:g}.")
    p.add_argument(*_spellings("node-timeout"), dest="node_timeout", type=float, metavar="SECONDS",
                   default=pet("node_timeout", DEFAULT_NODE_TIMEOUT),
                   help="a node whose launcher sends no heartbeat for this long counts as lost and "
                   f"the job stops (ddpkit's flag). Default {DEFAULT_NODE_TIMEOUT:g}.")
    p.add_argument(*_spellings("shutdown-timeout"), "--grace-period", dest="grace_period",
                   type=float, metavar="SECONDS", default=pet("shutdown_timeout", DEFAULT_GRACE_PERIOD),
                   help="seconds between SIGTERM and SIGKILL when stopping workers. Default 30.")
    p.add_argument(*_spellings("monitor-interval"), dest="monitor_interval", type=float, metavar="SECONDS",
                   default=pet("monitor_interval", 0.05), help="seconds between worker checks (default 0.05).")
    p.add_argument(*_spellings("rdzv-id"), dest="rdzv_id", default=pet("rdzv_id", None), metavar="ID",
                   help="job id, given to workers as TORCHELASTIC_RUN_ID; default 'none' on several "
                   "nodes, a fresh UUID on one (as torchrun's).")
    p.add_argument(*_spellings("rdzv-backend"), dest="rdzv_backend",
                   default=pet("rdzv_backend", "static"),
                   help="'static' (torchrun's default: every node gets --node-rank) or 'c10d' (the "
                   "nodes are numbered as they arrive at --rdzv-endpoint; --node-rank is ignored).")
    p.add_argument(*_spellings("rdzv-endpoint"), dest="rdzv_endpoint", default=pet("rdzv_endpoint", ""),
                   metavar="HOST[:PORT]",
                   help="the rendezvous's address and port, in place of --master-addr/--master-port: "
                   f"node 0's (static), or a host of the job, where a node hosts it (c10d; port {C10D_PORT} "
                   "if none).")
    p.add_argument("--role", default=pet("role", "default"), help="ROLE_NAME given to the workers.")
    # accepted so that torchrun command lines run unchanged; ddpkit's behaviour does not depend on them
    p.add_argument(*_spellings("start-method"), dest="start_method", default=pet("start_method", "spawn"),
                   choices=("spawn", "fork", "forkserver"),
                   help="accepted for torchrun compatibility: every worker is a fresh process anyway.")
    p.add_argument(*_spellings("run-path"), dest="run_path", action="store_true",
                   default=pet_flag("run_path"),
                   help="accepted for torchrun compatibility: the script is run by its path anyway.")
    add_torchrun_flags(p, pet, pet_flag, _spellings)
    p.add_argument(*_spellings("local-addr"), dest="local_addr", default=pet("local_addr", None),
                   metavar="ADDR", help="accepted for torchrun compatibility: the static rendezvous "
                   "needs no address of this node.")
    p.add_argument(*_spellings("rdzv-conf"), dest="rdzv_conf", default=pet("rdzv_conf", ""),
                   metavar="KEY=VALUE,...", help="torchrun's rendezvous options: timeout (or c10d's "
                   "join_timeout) is the seconds the nodes wait for each other, as --rdzv-timeout; other "
                   "keys have no effect (a note says so).")
    p.add_argument("-m", "--module", action="store_true", default=pet_flag("module"),
                   help="run the script as a module, like 'python -m'.")
    p.add_argument(*_spellings("no-python"), dest="no_python", action="store_true",
                   default=pet_flag("no_python"),
                   help="run the script as an executable, without 'python' in front.")
    p.add_argument("training_script", help="the script (or module with -m) every worker runs")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script, passed through untouched")
    return p


def resolve_nproc_per_node(value: str) -> int:
    """torchrun's meaning: an integer, 'cpu' = CPU count, 'gpu' = GPU count, 'auto' = GPUs else CPUs."""
    text = str(value).strip().lower()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text == "cpu":
        return available_cores()
    if text in ("gpu", "auto"):
        import torch  # only here: a launcher given a number starts its workers before it imports torch
    if text == "gpu":
        if not torch.cuda.is_available():
            raise ValueError(explain("--nproc-per-node gpu, but torch.cuda.is_available() is False.",
                                     "give a number, or 'auto' (one worker per CPU when there is no GPU)."))
        return torch.cuda.device_count()
    if text == "auto":
        return torch.cuda.device_count() if torch.cuda.is_available() else available_cores()
    raise ValueError(f"--nproc-per-node {value!r} is not a positive integer, 'auto', 'cpu' or 'gpu'.")


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Parse ``ddpkit run``'s arguments (without the word ``run``).

    Raises:
        ValueError: a flag has a value ddpkit cannot honour; the message says which and why.
        SystemExit: argparse's own usage errors and ``--help``.
    """
    environ = os.environ if environ is None else environ
    args = build_parser(environ).parse_args(list(argv))
    nnodes = _parse_nnodes(str(args.nnodes))
    check_refused(args)
    args.rdzv_timeout = rdzv_timeout(args, DEFAULT_RDZV_TIMEOUT)
    # c10d: one node is the static rendezvous; several are numbered as they arrive (no --node-rank)
    if args.rdzv_backend not in ("static", "c10d"):
        raise ValueError(explain(
            f"--rdzv-backend {args.rdzv_backend!r} is not supported: 'ddpkit run' meets nodes with "
            "torchrun's static or c10d rendezvous.",
            "give every node --nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID, or "
            "--nnodes N --node-rank R --master-addr HOST0 --master-port P."))
    assign = args.rdzv_backend == "c10d" and nnodes > 1
    srun_task = srun_task_per_node(environ, nnodes) if nnodes > 1 and not assign else None
    args.node_rank = (srun_task.rank if srun_task else 0) if args.node_rank is None else args.node_rank
    args.master_addr = args.master_addr or (srun_task.master_addr if srun_task else "127.0.0.1")
    if assign:
        args.node_rank = 0  # ignored, as torchrun ignores it with c10d: the rendezvous numbers the nodes
    if args.standalone and nnodes != 1:
        raise ValueError(f"--standalone runs a single node, but --nnodes is {nnodes}.")
    if not 0 <= args.node_rank < nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be in [0, {nnodes}) for --nnodes {nnodes}.")
    for name in ("max_restarts",):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}.")
    for name, flag in (("rdzv_timeout", "--rdzv-timeout"), ("node_timeout", "--node-timeout"),
                       ("grace_period", "--shutdown-timeout (--grace-period)"),
                       ("monitor_interval", "--monitor-interval")):
        if float(getattr(args, name)) <= 0:
            raise ValueError(f"{flag} must be > 0, got {getattr(args, name)}.")
    if args.rdzv_endpoint:
        # torchrun's static rendezvous takes node 0's address from the endpoint when one is given
        host, _, port = str(args.rdzv_endpoint).strip().rpartition(":")
        if not host or not port.isdigit():
            host, port = str(args.rdzv_endpoint).strip(), ""
        args.master_addr = host.strip("[]")  # an IPv6 endpoint is written [addr]:port
        if port:
            args.master_port = int(port) or None  # port 0: any free port, as in torchrun
        elif assign and args.master_port is None:
            args.master_port = C10D_PORT
    master_port = None if args.master_port is None else int(args.master_port)
    master_port = None if master_port == 0 and nnodes == 1 else master_port  # torchrun's 0: any free port
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f"--master-port {master_port} is not a TCP port in [1, 65535] (0, any free port, "
                         "serves one node only).")
    if nnodes > 1 and master_port is None:  # under srun/mpirun, every node derives its job's port
        master_port = job_port(environ)
    master_addr = str(args.master_addr)
    run_id = "none" if args.rdzv_id is None else str(args.rdzv_id)
    if args.standalone:
        master_addr, master_port, run_id = "127.0.0.1", None, str(uuid.uuid4())
    elif nnodes == 1 and master_port is None and args.rdzv_id is None:
        run_id = str(uuid.uuid4())  # torchrun's single node without a port: c10d on a fresh id
    return LaunchConfig(
        command=_worker_command(args), nproc_per_node=resolve_nproc_per_node(args.nproc_per_node),
        nnodes=nnodes, node_rank=int(args.node_rank), assign_node_rank=assign, master_addr=master_addr,
        master_port=master_port,
        max_restarts=int(args.max_restarts), log_dir=args.log_dir,
        rdzv_timeout=float(args.rdzv_timeout), node_timeout=float(args.node_timeout),
        grace_period=float(args.grace_period), monitor_interval=float(args.monitor_interval),
        run_id=run_id, role=str(args.role), job_id=launch_job_id(environ, run_id, nnodes),
        console=console_filter(args), notes=tuple(notes(args)))


def launch_job_id(environ: Mapping[str, str], run_id: str, nnodes: int) -> str | None:
    """The job every node and worker of this run names in the rendezvous (None: unnamed).

    DDPKIT_JOB_ID, else --rdzv-id, else the scheduler's job (srun/mpirun starting one launcher per
    node); a single node without any of them is a job of its own, with a fresh name.
    """
    scheduler = {k: v for k, v in environ.items() if k != "TORCHELASTIC_RUN_ID"}
    named = job_id({**scheduler, "TORCHELASTIC_RUN_ID": run_id}, "ddpkit")
    return named if named is not None or nnodes > 1 else f"run:{uuid.uuid4()}"


def _parse_nnodes(text: str) -> int:
    low, _, high = text.partition(":")
    try:
        count, upper = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--nnodes {text!r} is not a whole number of nodes.") from None
    if count != upper:
        raise ValueError(explain(
            f"--nnodes {text!r} asks for an elastic range of nodes, which 'ddpkit run' does not support.",
            f"give the exact number of nodes, e.g. --nnodes {upper}, and the same value on every node."))
    if count < 1:
        raise ValueError(f"--nnodes must be >= 1, got {text!r}.")
    return count


def _worker_command(args: argparse.Namespace) -> tuple[str, ...]:
    rest = tuple(args.training_script_args)
    if args.no_python:
        if args.module:
            raise ValueError("--no-python and -m/--module cannot be combined: a module needs python.")
        return (args.training_script, *rest)
    # -u as torchrun does: a worker's lines reach the launcher as they are printed
    if args.module:
        return (sys.executable, "-u", "-m", args.training_script, *rest)
    return (sys.executable, "-u", args.training_script, *rest)
