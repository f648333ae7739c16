"""The hangs of the tests, one function per rank body; ``# <- name`` marks the lines a report must name.

Each runs on every rank of a job made by ``jobs.run_job`` after ``ddpkit.init(stall_timeout=...)``.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import ddpkit

SLOW_SECONDS = 3.5  # longer than the tests' stall_timeout plus one inquiry


def skipped(rank: int) -> None:
    """Rank 1 skips the logging all-reduce and waits in the barrier that follows."""
    x = torch.ones(4)
    for _ in range(2):
        dist.all_reduce(x)
    if rank != 1:
        dist.all_reduce(torch.ones(1))  # <- skipped
    dist.barrier()  # <- skipped-barrier


def extra(rank: int) -> None:
    """Rank 0 reduces one tensor more; the same size, so it pairs with rank 1's next, which then leaves."""
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 0:
        dist.all_reduce(torch.ones(4))  # <- extra
    dist.all_reduce(x)  # <- extra-next
    ddpkit.shutdown()  # <- extra-leaves


def _reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """A helper that every collective of a script goes through, as many scripts have."""
    dist.all_reduce(t)  # <- helper
    return t / dist.get_world_size()


def extra_through_a_helper(rank: int) -> None:
    """``extra``, with each all-reduce made by one helper: the report must tell the calls apart."""
    x = torch.ones(4)
    _reduce_mean(x)
    if rank == 0:
        _reduce_mean(torch.ones(4))  # <- helper-extra
    _reduce_mean(x)  # <- helper-next
    ddpkit.shutdown()


def different_op(rank: int) -> None:
    t = torch.ones(3)
    if rank == 0:
        dist.all_reduce(t)  # <- op-0
    else:
        dist.broadcast(t, src=0)  # <- op-1


def monitored_barrier_on_one_rank(rank: int) -> None:
    """Rank 0 waits in dist.monitored_barrier(), which the recorder numbered as any collective; rank 1
    went on to the next all-reduce."""
    t = torch.ones(3)
    if rank == 0:
        dist.monitored_barrier()  # <- monitored
    dist.all_reduce(t)  # <- monitored-skipped


def both_receive_first(rank: int) -> None:
    """A pipeline's exchange written the wrong way round: both ranks receive before they send."""
    buffer = torch.zeros(4)
    dist.all_reduce(buffer)
    dist.recv(buffer, src=1 - rank)  # <- recv
    dist.send(torch.ones(4), dst=1 - rank)


def send_to_a_rank_in_a_barrier(rank: int) -> None:
    """Rank 0 sends to rank 1, which went on to a barrier instead of receiving."""
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        dist.send(torch.ones(4), dst=1)  # <- send-unmatched
    dist.barrier()  # <- send-barrier


def send_while_the_receiver_computes(rank: int) -> None:
    """Rank 1 has an all-reduce in flight (async, as DDP's buckets) and computes before it receives:
    rank 0's send is slow, not stuck."""
    y = torch.ones(2)
    if rank == 0:
        dist.send(torch.ones(4), dst=1)
        dist.all_reduce(y)
    else:
        work = dist.all_reduce(y, async_op=True)
        time.sleep(SLOW_SECONDS)
        dist.recv(torch.zeros(4), src=0)
        work.wait()
    assert y.tolist() == [2.0, 2.0]


def tags_that_differ(rank: int) -> None:
    """A pipeline's exchange whose tags disagree: rank 0 sends with tag 1, rank 1 receives tag 2."""
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        dist.send(torch.ones(4), dst=1, tag=1)  # <- send-tag
    else:
        dist.recv(torch.zeros(4), src=0, tag=2)  # <- recv-tag


def different_shapes(rank: int) -> None:
    dist.all_reduce(torch.ones(10 if rank == 0 else 20))  # <- shapes


def slow(rank: int) -> None:
    """Rank 1 is slow once; the job then ends well."""
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(SLOW_SECONDS)  # <- slow
    dist.all_reduce(t)  # <- slow-wait
    assert t.tolist() == [4.0, 4.0]


def killed(rank: int) -> None:
    """Rank 2 is killed (SIGKILL) while it waits in an all-reduce that rank 0 is late for."""
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 2:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if rank == 0:
        time.sleep(1.5)  # the late rank: rank 2 dies inside the collective meanwhile
    dist.all_reduce(t)  # <- killed


def spin(rank: int) -> None:
    """Rank 1 never leaves a Python loop."""
    t = torch.ones(2)
    dist.all_reduce(t)
    n = 0
    while rank == 1:  # <- spin
        n += 1  # <- spin-body
    dist.all_reduce(t)  # <- spin-wait


def subgroup(rank: int) -> None:
    """Inside group [2, 3] the ranks call different collectives; ranks 0 and 1 wait in a barrier."""
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    t = torch.ones(3)
    if rank == 2:
        dist.all_reduce(t, group=high)  # <- sub-2
    elif rank == 3:
        dist.broadcast(t, src=2, group=high)  # <- sub-3
    else:
        dist.all_reduce(t, group=low)
    dist.barrier()  # <- sub-barrier


def dead_thread(rank: int) -> None:
    """Rank 1's data thread dies of an exception; its main thread waits for the queue it fed."""
    import queue

    feed: queue.Queue = queue.Queue()

    def produce() -> None:
        if rank == 1:
            raise RuntimeError("the data thread of rank 1 died")  # <- thread-raise
        feed.put(torch.ones(4))

    threading.Thread(target=produce, name="data-feeder", daemon=True).start()
    dist.all_reduce(feed.get())  # <- thread-wait


def cleanup_collective(rank: int) -> None:
    """Rank 1 raises inside the training loop; its finally: block saves a checkpoint (a broadcast)
    while rank 0 waits in the next gradient all-reduce: a deadlock whose cause is rank 1's error."""
    model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 2))
    try:
        for step in range(3):
            loss = model(torch.ones(8, 4)).sum()
            if rank == 1 and step == 1:
                raise ValueError("a bad batch on rank 1")  # <- cleanup-raise
            loss.backward()
    finally:
        ddpkit.broadcast_object({"step": 1})  # <- cleanup-save


def ddp_skips_backward(rank: int) -> None:
    """Rank 1 skips one backward, so its barrier meets rank 0's last gradient bucket."""
    torch.manual_seed(0)
    model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 2))
    for step in range(3):
        loss = model(torch.ones(8, 4)).sum()
        if not (rank == 1 and step == 1):
            loss.backward()  # <- ddp-backward
    dist.barrier()  # <- ddp-barrier


def strict_same_size(rank: int) -> None:
    """Same op, dtype and shape, from different lines: runs fine without strict mode, mixing tensors."""
    a, b = torch.ones(5), torch.zeros(5)
    if rank == 0:
        dist.all_reduce(a)  # <- strict-0
    else:
        dist.all_reduce(b)  # <- strict-1


def strict_other_reduction(rank: int) -> None:
    """Same line, dtype and shape, another reduction: runs fine without strict mode, mixing sum and max."""
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM)  # <- strict-op


def strict_broadcast_shapes(rank: int) -> None:
    """A broadcast whose receiver allocated another shape: rank 1 would get half of rank 0's tensor."""
    dist.broadcast(torch.arange(3.0) if rank == 0 else torch.zeros(5), src=0)  # <- strict-bcast


def strict_join_on_one_rank(rank: int) -> None:
    """``with model.join():`` on rank 0 only: its forward all-reduces Join's count of active ranks
    (one element) where rank 1's backward all-reduces its gradient bucket, from one line."""
    torch.manual_seed(0)
    model = ddpkit.DDP(torch.nn.Linear(4, 5))
    with model.join() if rank == 0 else contextlib.nullcontext():
        model(torch.ones(2, 4)).sum().backward()  # <- strict-join


def strict_agree(rank: int) -> None:
    for _ in range(3):
        t = torch.ones(5)
        dist.all_reduce(t)
        assert t.tolist() == [2.0] * 5


def ddp_peer_exits(rank: int) -> None:
    """Rank 1 leaves abruptly (os._exit) before a backward; rank 0's gradient all-reduce fails in
    DDP's Work.wait(), past the recorder's wrapper."""
    model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 2))
    for step in range(3):
        loss = model(torch.ones(8, 4)).sum()
        if rank == 1 and step == 1:
            os._exit(3)  # <- peer-exits
        loss.backward()  # <- peer-exits-backward


def store_host_killed(rank: int) -> None:
    """Rank 0, which hosts the store (as under SLURM), is killed inside an all-reduce."""
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if rank == 1:
        time.sleep(1.5)  # the late rank: rank 0 dies inside the collective meanwhile
    dist.all_reduce(t)  # <- host-killed


def peer_exit_caught(rank: int) -> None:
    """Rank 1 ends its script early; rank 0 catches its all-reduce's error, as a torch script may (to
    save what it can), and its finally block runs."""
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        raise RuntimeError("rank 1 gives up")  # <- caught-exits
    try:
        dist.all_reduce(t)  # <- caught-waits
    except RuntimeError as e:
        print(f"caught on rank {rank}: {type(e).__name__}", flush=True)
    finally:
        print(f"finally ran on rank {rank}", flush=True)


def exits_early(rank: int) -> None:
    """Rank 1 calls sys.exit() after the first all-reduce; rank 0 waits in the second."""
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        sys.exit(3)  # <- sys-exit
    dist.all_reduce(t)  # <- exit-waits


def leaves_then_lingers(rank: int) -> None:
    """Rank 1 leaves with ddpkit.shutdown() and goes on with other work; rank 0's next all-reduce
    must fail as soon as it leaves (as under torch), not when its process ends."""
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        ddpkit.shutdown()
        time.sleep(SLOW_SECONDS)
        return
    start = time.monotonic()
    try:
        dist.all_reduce(t)  # <- lingers-waits
    except RuntimeError:
        print(f"raised after {time.monotonic() - start:.1f} s", flush=True)
