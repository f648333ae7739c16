"""The peak of the bytes held in CPU tensors, from torch's own allocator events.

The RSS high-water mark counts everything the process touched: tensors, Python objects, and the
freed heap that glibc has not yet given back, whose layout changes from run to run. The profiler's
memory events (``profile_memory=True``) see each CPU tensor allocation and free as torch's allocator
makes it, so their running sum peaks at what the tensors alone needed: the CPU counterpart of
``torch.cuda.max_memory_allocated``, exact and free of heap placement. It costs a run of its own,
since the profiler's own buffers would move the RSS figure.
"""
from __future__ import annotations

import gc
import os

import torch
from torch.profiler import ProfilerActivity, profile

from ddpkit.bench.ddp_step import make_stepper
from ddpkit.bench.sync import max_over_ranks

__all__ = ["tensor_peak", "running_peak", "quiet_profile"]


def quiet_profile(**kwargs) -> profile:
    """torch's profiler without kineto's start/stop lines on stderr (``KINETO_LOG_LEVEL``, read when
    the profiler first starts; a user's own setting wins)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return profile(**kwargs)


def running_peak(deltas: list[tuple[int, int]]) -> tuple[int, int]:
    """(peak, end) of the running sum of ``(time, bytes)`` allocation deltas taken in time order."""
    current = peak = 0
    for _, delta in sorted(deltas):
        current += delta
        peak = max(peak, current)
    return peak, current


def tensor_peak(kind: str, model: str, quick: bool, device: torch.device, view: bool, steps: int) -> int:
    """Bytes of CPU tensors held at the peak while ``kind``'s DDP is built and takes ``steps`` steps
    (the same steps as the RSS figure); the largest over ranks."""
    warm = make_stepper(kind, model, quick, device)  # imports and first-call allocations: not ours
    warm()
    del warm
    gc.collect()  # a cycle freed inside the window would be a block the profiler never saw allocated
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = make_stepper(kind, model, quick, device, set_to_none=False, gradient_as_bucket_view=view)
        for _ in range(steps):
            step()
    # an op's own allocations less its own frees; the events nest, so only self figures add up
    deltas = [(e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage]
    peak, _ = running_peak(deltas)
    return int(max_over_ranks([float(peak)], device)[0])
