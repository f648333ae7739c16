"""Bucket-size sweep and comm hooks for ddpkit's DDP: bytes all-reduced per step, and step time.

Bytes are *measured*: one extra step runs with ``torch.distributed.all_reduce`` wrapped to count
what goes in (tensor bytes, so fp16/bf16 compression shows as half). "sent per rank" is what a
ring all-reduce puts on each rank's link, 2(n-1)/n times that.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddpkit.bench.ddp_step import Stepper, make_stepper, time_interleaved
from ddpkit.bench.report import Table, fmt_bytes, median, ranks, summarize

__all__ = ["BUCKET_CAPS_MB", "HOOKS", "sweep_configs", "count_all_reduce", "run_buckets",
           "buckets_table"]

BUCKET_CAPS_MB = (1, 5, 25, 100)
HOOKS = ("none", "allreduce", "fp16", "bf16")


def sweep_configs() -> list[tuple[str, float, str]]:
    """(implementation, bucket_cap_mb, hook): the cap sweep without a hook, then each hook at 25 MB,
    and torch's DDP at its defaults as the reference."""
    configs = [("ddpkit", float(cap), "none") for cap in BUCKET_CAPS_MB]
    configs += [("ddpkit", 25.0, hook) for hook in HOOKS if hook != "none"]
    configs.append(("torch", 25.0, "none"))
    return configs


def _hook(name: str) -> Callable | None:
    if name == "none":
        return None
    from ddpkit import hooks

    return {"allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
            "bf16": hooks.bf16_compress_hook}[name]


@contextmanager
def count_all_reduce() -> Iterator[dict[str, int]]:
    """Count calls and input bytes of ``torch.distributed.all_reduce`` inside the block."""
    counter = {"calls": 0, "bytes": 0}
    original = c10d.all_reduce

    def counting(tensor, *args, **kwargs):
        counter["calls"] += 1
        counter["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = c10d.all_reduce = counting
    try:
        yield counter
    finally:
        dist.all_reduce = c10d.all_reduce = original


def _stepper(impl: str, cap: float, hook: str, model: str, quick: bool,
             device: torch.device) -> Stepper:
    step = make_stepper(impl, model, quick, device, bucket_cap_mb=cap)
    assert step is not None
    if hook != "none":
        step.module.register_comm_hook(None, _hook(hook))
    return step


def run_buckets(model_names: list[str], quick: bool, repeats: int, steps: int,
                device: torch.device) -> list[dict]:
    """One row per (model, config): step-time statistics and measured all-reduce traffic."""
    world_size = dist.get_world_size()
    rows = []
    for model in model_names:
        configs = sweep_configs()
        steppers = {cfg: _stepper(*cfg, model, quick, device) for cfg in configs}
        cpu: dict = {}
        timings = time_interleaved(steppers, repeats, steps, warmup=2, device=device, cpu_out=cpu)
        for cfg in configs:
            with count_all_reduce() as counted:
                steppers[cfg]()
            impl, cap, hook = cfg
            rows.append({"model": model, "impl": impl, "bucket_cap_mb": cap, "hook": hook,
                         "allreduce_calls": counted["calls"], "allreduce_bytes": counted["bytes"],
                         "sent_bytes_per_rank": counted["bytes"] * 2 * (world_size - 1) / world_size,
                         **summarize(timings[cfg]), "times": timings[cfg],
                         "cpu_median": median(cpu[cfg]), "cpu_times": cpu[cfg]})
    return rows


def buckets_table(rows: list[dict], world_size: int) -> Table:
    table = Table(f"3. ddpkit DDP: bucket cap and comm hook ({ranks(world_size)}; per step)",
                  ["model", "impl", "cap (MB)", "hook", "all-reduces", "all-reduced",
                   "sent per rank", "median (ms)", "q1 (ms)", "q3 (ms)", "cpu (ms)"])
    for r in rows:
        counted = r["allreduce_calls"] > 0
        table.add(r["model"], r["impl"], f"{r['bucket_cap_mb']:g}", r["hook"],
                  r["allreduce_calls"] if counted else "-",
                  fmt_bytes(r["allreduce_bytes"]) if counted else "-",
                  fmt_bytes(r["sent_bytes_per_rank"]) if counted else "-",
                  *(f"{r[k] * 1e3:.2f}" for k in ("median", "q1", "q3", "cpu_median")))
    table.notes.append("all-reduced: bytes handed to all_reduce per step (measured); sent per rank: "
                       "x 2(n-1)/n for a ring. torch's DDP all-reduces in C++, so it is not counted.")
    return table
