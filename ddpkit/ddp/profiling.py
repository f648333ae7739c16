"""Named ranges in ``torch.profiler`` traces for DDP's work, free when no profiler runs.

torch's DDP shows its forward as "DistributedDataParallel.forward"; its reducer works in C++. ddpkit
names the same forward, and per bucket and step (never per parameter) what its Python reducer does:

    ddpkit.bucket[<index>].fill (<bytes> B)    gradients into the bucket's flat buffer, scaled
    ddpkit.bucket[<index>].all_reduce          launch of its all-reduce (".comm_hook": the user's hook)
    ddpkit.finalize_backward.wait              end of backward: waiting for every bucket's collective
    ddpkit.bucket[<index>].write_back          the averages back into the gradients

Entering ``record_function`` costs about 6 us even with no profiler running, so the bucket ranges
are entered only while one runs (the forward's, once a step, always, as torch's DDP enters it: an
execution-trace observer records it with no profiler running). The check is
``torch.autograd.profiler._is_profiler_enabled``, the Python flag torch's profilers set on start and
clear on stop, which torch's own compiler code reads for the same purpose (a profiler started from
C++ alone does not set it: those ranges are then missing).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
import torch.autograd.profiler as _autograd_profiler

from ddpkit.ddp.bucket import Bucket

__all__ = ["profiling", "profiled", "bucket_range", "forward_range"]

_OFF: ContextManager[Any] = contextlib.nullcontext()  # reusable: it keeps no state


def profiling() -> bool:
    """Whether a torch profiler is recording: a read of torch's Python flag (0.03 us), or where a torch
    lacks it, the C++ state (0.1 us)."""
    flag = getattr(_autograd_profiler, "_is_profiler_enabled", None)
    return torch.autograd._profiler_enabled() if flag is None else flag


def profiled(name: str) -> ContextManager[Any]:
    """``record_function(name)`` while a profiler records, else a context that does nothing."""
    return _autograd_profiler.record_function(name) if profiling() else _OFF


def forward_range() -> ContextManager[Any]:
    """torch's range around DDP's forward, entered on every forward as torch's DDP does, so that
    ``torch.profiler.ExecutionTraceObserver`` alone (no profiler running) records it too."""
    return _autograd_profiler.record_function("DistributedDataParallel.forward")


def bucket_range(bucket: Bucket, step: str) -> ContextManager[Any]:
    """The range "ddpkit.bucket[<index>].<step>"; ``fill`` also names the bucket's gradient bytes."""
    if not profiling():  # the name is not even formatted
        return _OFF
    name = f"ddpkit.bucket[{bucket.index()}].{step}"
    if step == "fill":
        name += f" ({bucket.numel * bucket.flat.element_size()} B)"
    return _autograd_profiler.record_function(name)
