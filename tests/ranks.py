"""Run a function on N real processes (Gloo over loopback) and bring back each rank's result.

    results = run_ranks(worker, world_size=2, args=(3,))   # [worker's return on rank 0, on rank 1]

``worker`` must be a module-level function (it is pickled by name). Each rank gets torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, ..., MASTER_ADDR/MASTER_PORT) and, unless ``init=False``,
``ddpkit.init(backend="gloo")`` has been called before ``worker(*args)`` runs and ``ddpkit.shutdown()``
after. The rendezvous store is hosted here, in the test process, on a port the OS picked, so there is
no free-port race between tests. A rank that raises makes ``run_ranks`` raise ``RankFailure`` with
every failing rank's traceback; a rank that does not finish by the deadline is killed, with a stack
dump on stderr (faulthandler). No process outlives the call, pass or fail.
"""
from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import psutil
import torch
import torch.distributed as dist

__all__ = ["RankFailure", "run_ranks", "rank_env", "kill_tree"]

# forkserver with torch preloaded (and torch._dynamo, which torch.optim and torch's DDP pull in):
# a rank starts in ~0.1 s instead of re-importing them.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.optim", "psutil"])


class RankFailure(RuntimeError):
    """One or more ranks raised, crashed or missed the deadline."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


def rank_env(rank: int, world_size: int, port: int, agent_store: bool = True) -> dict[str, str]:
    """The variables torchrun would give ``rank`` (one node, loopback)."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def _rank_main(fn, rank, world_size, port, args, kwargs, init, timeout, env, results, backend):
    """Body of one rank: set the environment, init, run, report, shut down."""
    faulthandler.dump_traceback_later(timeout, exit=True)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "TORCHELASTIC_")):
            del os.environ[name]
    os.environ.update(rank_env(rank, world_size, port))
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        if init:
            import ddpkit

            ddpkit.init(backend=backend, timeout=timeout)
        value = fn(*args, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test, tagged with the rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        if init:
            try:
                import ddpkit

                ddpkit.shutdown()
            except Exception:  # noqa: BLE001 - the result is already reported
                pass


def kill_tree(pid: int, grace: float = 2.0) -> None:
    """SIGTERM a process and all its descendants, SIGKILL what survives ``grace`` seconds."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    init: bool = True,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    rank_args: Sequence[Sequence[Any]] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``rank_args`` (one tuple per rank) replaces ``args`` where ranks need different inputs.
    Raises ``RankFailure`` naming every rank that raised, died or missed the ``timeout`` deadline.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = _CONTEXT.Queue()
    procs = []
    try:
        for rank in range(world_size):
            rank_fn_args = tuple(rank_args[rank]) if rank_args is not None else tuple(args)
            p = _CONTEXT.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store.port, rank_fn_args, kwargs or {}, init, timeout,
                      env or {}, results, backend),
                name=f"rank{rank}",
            )
            p.start()
            procs.append(p)
        return _collect(procs, results, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                kill_tree(p.pid)
            p.join(timeout=5)
        results.close()
        results.join_thread()
        del store


def _collect(procs, results, timeout: float) -> list[Any]:
    """Wait for every rank's report; stop early when one fails, since the others may then hang."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout + 5
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    while len(values) + len(failures) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in values and rank not in failures and p.exitcode is not None:
                    # exited without reporting: read what may still sit in the queue first
                    try:
                        while True:
                            r, ok, payload = results.get(timeout=0.5)
                            _record(r, ok, payload, values, failures)
                    except queue.Empty:
                        pass
                    if rank not in values and rank not in failures:
                        failures[rank] = f"rank {rank} died with exit code {p.exitcode} without reporting"
            if time.monotonic() > deadline:
                for rank in range(world_size):
                    if rank not in values and rank not in failures:
                        failures[rank] = f"rank {rank} missed the {timeout:.0f} s deadline"
            if failures:
                break
            continue
        _record(rank, ok, payload, values, failures)
        if failures:
            # give the other ranks a moment to report their own errors (often the same one)
            grace = time.monotonic() + 5
            while len(values) + len(failures) < world_size and time.monotonic() < grace:
                try:
                    _record(*results.get(timeout=0.2), values, failures)
                except queue.Empty:
                    pass
            break
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RankFailure(f"{len(failures)} of {world_size} ranks failed:\n{text}", failures)
    return [values[r] for r in range(world_size)]


def _record(rank, ok, payload, values, failures) -> None:
    if ok:
        values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    else:
        failures[rank] = payload


def _self_check() -> None:  # pragma: no cover - manual smoke run
    print(run_ranks(os.getpid, 2, init=False))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_self_check())
