"""Run a measurement in a fresh process per rank, with a process group of its own.

A process's memory high-water mark and its heap carry the history of everything it ran before:
one model's freed arenas, the allocator's fragmentation, Gloo's buffers. Measured in the same
process, one after the other, the order of the figures moved them by more than the differences
between the two DDPs. Each figure of the memory table therefore comes from new processes (one per
rank, started from a forkserver that has torch, torch._dynamo and the measuring module imported, so
a child starts in a fraction of a second), which rendezvous over a ``FileStore``.
"""
from __future__ import annotations

import gc
import itertools
import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddpkit.runtime.quick_exit import quick_exit

__all__ = ["in_fresh_processes"]

_COUNTER = itertools.count()


def in_fresh_processes(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a new process on every rank of the current group (same ranks, same world
    size, the same backend); returns what this rank's process returned. Collective on the group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    holder = [tempfile.mkdtemp(prefix="ddpkit-bench-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    path = os.path.join(holder[0], f"store-{next(_COUNTER)}")
    context = mp.get_context("forkserver")
    # torch.optim's first optimizer imports torch._dynamo: 2 s in every child unless the server has it
    # (the list counts only before the server's first start: the bench's callers share one module)
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", *filter(None, [fn.__module__])])
    receiver, sender = context.Pipe(duplex=False)
    proc = context.Process(target=_child, args=(rank, world, dist.get_backend(), torch.get_num_threads(),
                                                 path, fn, args, sender), name=f"fresh-rank{rank}")
    proc.start()
    sender.close()
    try:
        ok, value = receiver.recv()
    except EOFError:
        ok, value = False, f"the fresh process of rank {rank} exited with code {proc.exitcode} and no result"
    proc.join()
    dist.barrier()  # every rank's child is done with the store
    if rank == 0:
        for name in os.listdir(holder[0]):
            os.unlink(os.path.join(holder[0], name))
        os.rmdir(holder[0])
    if not ok:
        raise RuntimeError(f"a measurement in a fresh process failed on rank {rank}:\n{value}")
    return value


def _child(rank: int, world: int, backend: str, threads: int, path: str, fn: Callable[..., Any],
           args: tuple, sender: Any) -> None:
    torch.set_num_threads(threads)
    # the objects inherited from the forkserver (torch, torch._dynamo) go to the permanent generation:
    # the measurement's gc.collect() calls walked all of them (0.3 s each) and wrote to their pages
    gc.freeze()
    try:
        dist.init_process_group(backend, store=dist.FileStore(path, world), rank=rank, world_size=world)
        sender.send((True, fn(*args)))
    except BaseException:
        sender.send((False, traceback.format_exc()))
    sender.close()
    # torch's DDP leaves Gloo work that must not be freed while the interpreter finalizes (see
    # runner.rank_main): everything is sent, so skip finalization
    quick_exit(0)
