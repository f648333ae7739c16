"""Collective bandwidth: all-reduce, broadcast and all-gather over a range of message sizes.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``): *algorithm bandwidth* is message bytes over
time; *bus bandwidth* rescales it by what each link must carry for that collective, so figures are
comparable across collectives and world sizes and can be held against the hardware's link speed.
For all-gather the message is the gathered output (each rank contributes ``size / world_size``), as
in nccl-tests.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from ddpkit.bench.report import Table, fmt_bytes, median, ranks
from ddpkit.bench.sync import barrier, max_over_ranks, synchronize

__all__ = ["OPS", "alg_bandwidth", "bus_bandwidth", "message_sizes", "repeats_for", "run_collectives",
           "collectives_table"]

OPS = ("all_reduce", "broadcast", "all_gather")

# bytes every collective's timing loop may move, per size, before it cuts its repeats (keeps the
# 64-256 MiB rows to a few repeats each on a slow CPU machine)
_BYTES_BUDGET = 1 << 30


def alg_bandwidth(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: message bytes over time."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}.")
    return nbytes / seconds


def bus_bandwidth(op: str, algbw: float, world_size: int) -> float:
    """Bus bandwidth (nccl-tests): all_reduce 2(n-1)/n, all_gather (n-1)/n, broadcast 1 times algbw."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "broadcast": 1.0}
    if op not in factors:
        raise ValueError(f"op={op!r} is not one of {sorted(factors)}.")
    return algbw * factors[op]


def message_sizes(quick: bool, max_bytes: int | None = None) -> list[int]:
    """Powers of 4 from 4 KiB to 256 MiB (to 1 MiB with ``quick``), capped at ``max_bytes``."""
    top = max_bytes if max_bytes is not None else (1 << 20 if quick else 256 << 20)
    sizes, size = [], 4 << 10
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def repeats_for(nbytes: int, repeats: int, minimum: int = 3) -> int:
    """Timed repeats for one size: ``repeats``, cut so large messages stay within the byte budget."""
    return max(minimum, min(repeats, _BYTES_BUDGET // max(nbytes, 1)))


def _make_op(op: str, nbytes: int, device: torch.device, world_size: int) -> Callable[[], None]:
    """A closure running one collective on preallocated float32 buffers of ``nbytes`` message bytes."""
    if op == "all_reduce":
        buf = torch.ones(nbytes // 4, device=device)
        return lambda: dist.all_reduce(buf)
    if op == "broadcast":
        buf = torch.ones(nbytes // 4, device=device)
        return lambda: dist.broadcast(buf, src=0)
    if op == "all_gather":
        out = torch.empty(nbytes // 4, device=device)
        inp = torch.ones(nbytes // 4 // world_size, device=device)
        outs = list(out.chunk(world_size))
        return lambda: dist.all_gather(outs, inp)
    raise ValueError(f"op={op!r} is not one of {OPS}.")


def time_collective(op: str, nbytes: int, repeats: int, warmup: int, device: torch.device) -> float:
    """Median seconds of one collective over ``repeats``; each repeat is the slowest rank's time."""
    world_size = dist.get_world_size()
    run = _make_op(op, nbytes, device, world_size)
    for _ in range(warmup):
        run()
    synchronize(device)
    times = torch.zeros(repeats, dtype=torch.float64)
    for i in range(repeats):
        barrier(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times[i] = time.perf_counter() - start
    # a collective is done when its slowest rank is: take the max over ranks, repeat by repeat
    return median(max_over_ranks(times, device).tolist())


def run_collectives(sizes: list[int], repeats: int, device: torch.device,
                    ops: tuple[str, ...] = OPS) -> list[dict]:
    """One row per (op, size): seconds, algbw and busbw in bytes/s, with the repeats used."""
    world_size = dist.get_world_size()
    # the first collectives on a fresh group pay for connection set-up: keep that out of the table
    warm = torch.ones(1024, device=device)
    for _ in range(5):
        dist.all_reduce(warm)
        dist.broadcast(warm, src=0)
    rows = []
    for op in ops:
        for nbytes in sizes:
            reps = repeats_for(nbytes, repeats)
            warmup = 1 if nbytes >= (16 << 20) else 3
            seconds = time_collective(op, nbytes, reps, warmup, device)
            algbw = alg_bandwidth(nbytes, seconds)
            rows.append({"op": op, "bytes": nbytes, "repeats": reps, "seconds": seconds,
                         "algbw": algbw, "busbw": bus_bandwidth(op, algbw, world_size)})
    return rows


def collectives_table(rows: list[dict], world_size: int, backend: str) -> Table:
    table = Table(f"1. Collectives ({ranks(world_size)}, {backend}; median of repeats, max over ranks)",
                  ["op", "size", "repeats", "time (us)", "algbw (GB/s)", "busbw (GB/s)"])
    for r in rows:
        table.add(r["op"], fmt_bytes(r["bytes"]), r["repeats"], f"{r['seconds'] * 1e6:.1f}",
                  f"{r['algbw'] / 1e9:.3f}", f"{r['busbw'] / 1e9:.3f}")
    return table
