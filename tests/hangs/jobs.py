"""Run a scenario of ``scenarios.py`` as a job of N ranks and bring back each rank's exit code and output.

Unlike ``ranks.run_ranks``, the ranks' own ends are the point: a rank may leave with the hang exit
code, be killed, or run on. Each rank's stdout and stderr go to ``<out>/rank<r>.log``; a rank's body
ends like a script's (uncaught exception printed, atexit handlers run). No process outlives the call.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from ranks import _CONTEXT, kill_tree, rank_env

__all__ = ["Job", "run_job", "line_of"]

_HERE = Path(__file__).parent


@dataclass
class Job:
    codes: list[int | None]   # None: still running when the job was stopped
    logs: list[str]
    seconds: float

    def log(self) -> str:
        return "\n".join(f"----- rank {r} (exit {c}) -----\n{text}"
                         for r, (c, text) in enumerate(zip(self.codes, self.logs)))


def line_of(marker: str, filename: str = "scenarios.py") -> str:
    """``scenarios.py:<n>`` of the line marked ``# <- marker`` (or of another file of this folder)."""
    for n, line in enumerate((_HERE / filename).read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# <- {marker}"):
            return f"{filename}:{n}"
    raise KeyError(marker)


def _rank_main(name: str, rank: int, world_size: int, port: int, out: str, env: dict[str, str],
               deadline: float, agent_store: bool) -> None:
    log = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.dump_traceback_later(deadline, exit=True)
    os.environ.update(rank_env(rank, world_size, port, agent_store))
    os.environ.update(env)
    os.chdir(_HERE)  # reports name files relative to the working directory, as in a real job
    code = 0
    try:
        import scenarios

        import ddpkit

        ddpkit.init(backend="gloo", timeout=deadline)
        getattr(scenarios, name)(rank)  # <- scenario
    except SystemExit as e:  # as Python ends a script on sys.exit(): no traceback, no sys.last_value
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:  # noqa: BLE001 - a script's end: traceback on stderr, exit code 1
        traceback.print_exc()
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_job(name: str, world_size: int, out: Path, *, stall_timeout: float = 1.5, deadline: float = 30.0,
            env: dict[str, str] | None = None, stop_when: Callable[[list[str]], bool] | None = None,
            rank0_hosts_store: bool = False) -> Job:
    """Run scenario ``name``; return when every rank has exited, or ``stop_when(logs)`` holds (the
    ranks still running are then killed), or at ``deadline`` seconds (killed too). The store is
    hosted here, as torchrun's agent does, or by rank 0, as under SLURM or MPI."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    if rank0_hosts_store:
        del store  # frees the port for rank 0 (a port the OS just gave: no other test takes it meanwhile)
        store = None
    env = {"DDPKIT_STALL_TIMEOUT": str(stall_timeout), **(env or {})}
    procs = [_CONTEXT.Process(target=_rank_main, name=f"rank{r}",
                              args=(name, r, world_size, port, str(out), env, deadline, not rank0_hosts_store))
             for r in range(world_size)]
    start = time.monotonic()
    codes: list[int | None] = [None] * world_size
    try:
        for p in procs:
            p.start()
        while time.monotonic() - start < deadline:
            if all(p.exitcode is not None for p in procs):
                break
            if stop_when is not None and stop_when(_logs(out, world_size)):
                break
            for p in procs:
                p.join(timeout=0.1)  # waits on the processes; the logs are read between waits
    finally:
        seconds = time.monotonic() - start
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                kill_tree(p.pid)
            p.join(timeout=5)
        del store
    return Job(codes, _logs(out, world_size), seconds)


def _logs(out: Path, world_size: int) -> list[str]:
    texts = []
    for r in range(world_size):
        path = out / f"rank{r}.log"
        texts.append(path.read_text(errors="replace") if path.exists() else "")
    return texts
