"""Rank synchronisation for timing: barriers and the max over ranks, on any backend.

NCCL only reduces CUDA tensors and wants to know the barrier's device, so both go through here.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["barrier", "max_over_ranks", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU), so a timer sees finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device: torch.device) -> None:
    if device.type == "cuda" and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def max_over_ranks(values: torch.Tensor | Sequence[float], device: torch.device) -> torch.Tensor:
    """Elementwise max over ranks of a float tensor (any shape), returned on the CPU in float64."""
    tensor = torch.as_tensor(values, dtype=torch.float64)
    on_device = tensor.to(device) if dist.get_backend() == "nccl" else tensor.clone()
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
    return on_device.cpu()
