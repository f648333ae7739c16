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

# The parts, one subpackage each: runtime (environment, process group, collectives), dp (DataParallel
# and its four primitives), ddp (DistributedDataParallel), checkpoint; launch and bench load lazily.
from ddpkit import comm, env, errors, hooks
from ddpkit.checkpoint import load, save
from ddpkit.ddp import DDP, DistributedDataParallel, SyncBatchNorm
from ddpkit.dp import DataParallel, data_parallel, gather, parallel_apply, replicate, scatter, scatter_kwargs
from ddpkit.errors import (
    BatchDimError,
    CheckpointSaveError,
    CollectiveMismatchError,
    CommHookError,
    DenseGradientError,
    EmptyListError,
    LateGradientError,
    LauncherVariableError,
    MixedPrecisionError,
    NotAModuleError,
    NotInitializedError,
    OutputKeysError,
    RanksDisagreeError,
    RendezvousError,
    ReplicaCountError,
    SecondGradientError,
    StateDictMismatchError,
    StaticGraphChangedError,
    UnusedParametersError,
)
from ddpkit.logging import print  # noqa: A004 - rank-0 print is the point
from ddpkit.parallelize import parallelize
from ddpkit.runtime import (
    DistEnv,
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    detect,
    expand_hostlist,
    get_local_rank,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    is_main_process,
    reduce_scatter,
    shutdown,
)
from ddpkit.runtime.hangs import HANG_EXIT_CODE

__version__ = "0.1.0"

__all__ = [
    "DDP", "DataParallel", "DistEnv", "DistributedDataParallel", "all_gather", "all_gather_object", "comm", "env",
    "all_reduce", "barrier",
    "broadcast", "broadcast_object", "data_parallel", "detect", "expand_hostlist", "gather",
    "get_local_rank", "get_rank", "get_world_size", "hooks", "init", "is_initialized",
    "is_main_process", "load", "parallel_apply", "parallelize", "print", "reduce_scatter",
    "replicate", "save", "scatter", "scatter_kwargs", "shutdown", "SyncBatchNorm", "__version__",
    "HANG_EXIT_CODE",
    # the typed errors (ddpkit.errors), each a subclass of what was raised before them
    "errors", "BatchDimError", "CheckpointSaveError", "CollectiveMismatchError", "CommHookError", "DenseGradientError",
    "EmptyListError", "LateGradientError", "LauncherVariableError", "MixedPrecisionError",
    "NotAModuleError", "NotInitializedError", "OutputKeysError",
    "RanksDisagreeError", "RendezvousError", "ReplicaCountError", "SecondGradientError", "StateDictMismatchError",
    "StaticGraphChangedError", "UnusedParametersError",
]

_LAZY_SUBMODULES = ("launch", "bench")  # command-line tools: not needed to train


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"ddpkit.{name}")
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
