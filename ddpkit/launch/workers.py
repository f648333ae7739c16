"""Worker processes: the environment torchrun gives them, starting them, and signalling whole trees.

Each worker starts in its own session (so its process group holds its children too, and a terminal's
Ctrl-C reaches the launcher only), with SIGKILL as its parent-death signal. Stopping a worker signals
its process group and every descendant psutil can see, so grandchildren die with it.
"""
from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import psutil

from ddpkit.launch.logs import OutputPump, one_pipe
from ddpkit.launch.signals import death_signal_preexec
from ddpkit.launch.torchrun_flags import HANDLED_SIGNALS
from ddpkit.logging import TERMINAL_VARIABLE
from ddpkit.runtime.environments.threads import available_cores

__all__ = ["Placement", "Worker", "worker_env", "spawn_worker", "signal_worker", "kill_leftovers",
           "exit_code", "record_exit"]


@dataclass(frozen=True)
class Placement:
    """Where a worker sits in the job: global rank, local rank, world and node layout."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int


def worker_env(base: Mapping[str, str], place: Placement, *, master_addr: str, master_port: int,
               attempt: int, max_restarts: int, run_id: str, role: str = "default",
               terminal: bool = False, job_id: str | None = None, error_file: str = "") -> dict[str, str]:
    """torchrun's worker variables plus ``DDPKIT_LAUNCHER=ddpkit``, on top of ``base``.

    OMP_NUM_THREADS defaults to this process's cores shared out between the local workers, unless
    the user set it (torch would otherwise give every worker every core and oversubscribe the node).
    ``terminal``: the launcher's stderr is a terminal; a worker's is a pipe to it, so it is told
    through ``DDPKIT_TERMINAL=1`` that what it writes there reaches one (ddpkit's progress line).
    ``job_id``: the launcher's job, which its workers name in the rendezvous (``DDPKIT_JOB_ID``).
    ``error_file``: where torch's ``@record`` writes the worker's exception (TORCHELASTIC_ERROR_FILE).
    """
    env = dict(base)
    env.update({
        "RANK": str(place.rank), "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(place.world_size), "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_RANK": str(place.node_rank), "GROUP_WORLD_SIZE": str(place.nnodes),
        "ROLE_RANK": str(place.rank), "ROLE_WORLD_SIZE": str(place.world_size), "ROLE_NAME": role,
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file, "TORCHELASTIC_SIGNALS_TO_HANDLE": HANDLED_SIGNALS,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "DDPKIT_LAUNCHER": "ddpkit", "PYTHONUNBUFFERED": "1",
    })
    if job_id is not None:
        env["DDPKIT_JOB_ID"] = job_id
    if terminal:
        env[TERMINAL_VARIABLE] = "1"
    else:
        env.pop(TERMINAL_VARIABLE, None)
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(1, available_cores() // place.local_world_size))
    return env


@dataclass
class Worker:
    """One worker process and what became of it: running, succeeded, failed or stopped (by us)."""

    place: Placement
    process: subprocess.Popen
    pump: OutputPump
    state: str = "running"
    exit_code: int | None = None
    tree: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def rank(self) -> int:
        return self.place.rank


def record_exit(worker: Worker) -> bool:
    """If a running worker exited by itself, record how (succeeded or failed); returns whether it did."""
    returncode = worker.process.poll()
    if returncode is None or worker.state != "running":
        return False
    worker.exit_code = exit_code(returncode)
    worker.state = "succeeded" if returncode == 0 else "failed"
    return True


def exit_code(returncode: int) -> int:
    """A shell's convention: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def spawn_worker(command: tuple[str, ...], env: dict[str, str], place: Placement,
                 log_file: str | None, shown: tuple[bool, bool] = (True, True)) -> Worker:
    """Start one worker with piped output (call from the main thread: see ``death_signal_preexec``);
    ``shown``: whether its stdout and its stderr reach the console (the log file gets both)."""
    shared = one_pipe(shown)
    try:
        # stdin is inherited, as in torchrun: breakpoint() and input() work in a worker
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if shared else subprocess.PIPE,
            start_new_session=True, preexec_fn=death_signal_preexec(),
        )
    except OSError as e:
        raise RuntimeError(f"could not start rank {place.rank}: {' '.join(command)}: {e}") from e
    pump = OutputPump(place.rank, process.stdout, process.stderr, log_file, shown)  # type: ignore[arg-type]
    return Worker(place, process, pump, tree={process.pid})


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_worker(worker: Worker, sig: int, *, tree: bool = True) -> None:
    """Send ``sig`` once to the worker, and with ``tree`` to its process group and all its descendants.

    Once: a second SIGINT would interrupt the worker's own ``except KeyboardInterrupt`` cleanup.
    The group's signal reaches every process still in it, so a descendant gets its own only if it
    left the group (``setsid``)."""
    procs = _descendants(worker.pid) if tree else []
    worker.tree.update(p.pid for p in procs)
    if tree:
        try:
            os.killpg(worker.pid, sig)  # also reaches children whose parent already exited
        except (ProcessLookupError, PermissionError):
            pass
    else:
        try:
            worker.process.send_signal(sig)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            if os.getpgid(p.pid) != worker.pid:
                p.send_signal(sig)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass


def kill_leftovers(workers: Iterable[Worker], keep: set[int]) -> None:
    """SIGKILL whatever is left of the workers' trees, and any orphan this launcher adopted.

    ``keep`` holds this process's children from before the job (not ours to kill).
    """
    workers = list(workers)
    me = os.getpid()
    doomed: dict[int, psutil.Process] = {}
    for worker in workers:
        for p in _descendants(worker.pid):
            doomed[p.pid] = p
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    worker_pids = {w.pid for w in workers}
    for child in psutil.Process(me).children():
        if child.pid in keep or child.pid in worker_pids:
            continue
        for p in _descendants(child.pid):  # an orphan re-parented to us (we are a subreaper)
            doomed[p.pid] = p
    for p in doomed.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    # psutil reaps the orphans we adopted; Popen must reap the workers, or their exit codes are lost
    psutil.wait_procs([p for pid, p in doomed.items() if pid not in worker_pids], timeout=5)
    for worker in workers:
        try:
            worker.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
