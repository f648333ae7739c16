"""ddpkit: data-parallel training for PyTorch.

Its own DistributedDataParallel (Python buckets and overlapped all-reduce on torch.distributed), a
single-process DataParallel that also runs on CPU devices, collectives that work in a world of one,
environment detection for torchrun / SLURM / MPI, and a launcher (``ddpkit run``).
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any

with warnings.catch_warnings():  # torch warns at import when numpy is missing; ddpkit needs none
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401 - imported here, once, under that filter

# Imported eagerly, as torch.nn.parallel does: several modules share their name with the function
# they export (replicate, parallel_apply, data_parallel, parallelize). Importing them here, once,
# leaves the package attribute bound to the function for good.
from ddpkit.env import DistEnv, detect, expand_hostlist
from ddpkit.process_group import (get_local_rank, get_rank, get_world_size, init, is_initialized,
                                  is_main_process, shutdown)
from ddpkit.comm import (all_gather, all_gather_object, all_reduce, barrier, broadcast,
                         broadcast_object, reduce_scatter)
from ddpkit.replicate import replicate
from ddpkit.scatter_gather import gather, scatter, scatter_kwargs
from ddpkit.parallel_apply import parallel_apply
from ddpkit.data_parallel import DataParallel, data_parallel
from ddpkit.distributed import DDP, DistributedDataParallel
from ddpkit import hooks
from ddpkit.parallelize import parallelize
from ddpkit.checkpoint import load, save
from ddpkit.logging import print  # noqa: A004 - rank-0 print is the point

__version__ = "0.1.0"

__all__ = [
    "DDP", "DataParallel", "DistEnv", "DistributedDataParallel", "all_gather", "all_gather_object",
    "all_reduce", "barrier",
    "broadcast", "broadcast_object", "data_parallel", "detect", "expand_hostlist", "gather",
    "get_local_rank", "get_rank", "get_world_size", "hooks", "init", "is_initialized",
    "is_main_process", "load", "parallel_apply", "parallelize", "print", "reduce_scatter",
    "replicate", "save", "scatter", "scatter_kwargs", "shutdown", "__version__",
]

_LAZY_SUBMODULES = ("launch", "bench")  # command-line tools: not needed to train


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"ddpkit.{name}")
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
