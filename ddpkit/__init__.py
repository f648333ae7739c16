"""ddpkit: data-parallel training for PyTorch.

Its own DistributedDataParallel (Python buckets and overlapped all-reduce on torch.distributed), a
single-process DataParallel that also runs on CPU devices, collectives that work in a world of one,
environment detection for torchrun / SLURM / MPI, and a launcher (``ddpkit run``).

Names are imported on first use, so ``import ddpkit`` stays cheap for the launcher and the CLI.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # environment and process group
    "DistEnv": "ddpkit.env",
    "detect": "ddpkit.env",
    "expand_hostlist": "ddpkit.env",
    "init": "ddpkit.process_group",
    "shutdown": "ddpkit.process_group",
    "get_rank": "ddpkit.process_group",
    "get_world_size": "ddpkit.process_group",
    "get_local_rank": "ddpkit.process_group",
    "is_main_process": "ddpkit.process_group",
    "is_initialized": "ddpkit.process_group",
    # collectives
    "all_reduce": "ddpkit.comm",
    "broadcast": "ddpkit.comm",
    "broadcast_object": "ddpkit.comm",
    "all_gather": "ddpkit.comm",
    "reduce_scatter": "ddpkit.comm",
    "barrier": "ddpkit.comm",
    # single-process DataParallel
    "replicate": "ddpkit.replicate",
    "scatter": "ddpkit.scatter_gather",
    "scatter_kwargs": "ddpkit.scatter_gather",
    "gather": "ddpkit.scatter_gather",
    "parallel_apply": "ddpkit.parallel_apply",
    "DataParallel": "ddpkit.data_parallel",
    "data_parallel": "ddpkit.data_parallel",
    # DistributedDataParallel
    "DistributedDataParallel": "ddpkit.distributed",
    "DDP": "ddpkit.distributed",
    # one script everywhere
    "parallelize": "ddpkit.parallelize",
    "save": "ddpkit.checkpoint",
    "load": "ddpkit.checkpoint",
    "print": "ddpkit.logging",
}
_SUBMODULES = ("env", "process_group", "comm", "hooks", "launch", "bench")

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"ddpkit.{name}")
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
