"""ddpkit: data-parallel training for PyTorch.

Its own DistributedDataParallel (Python buckets and overlapped all-reduce on torch.distributed), a
single-process DataParallel that also runs on CPU devices, collectives that work in a world of one,
environment detection for torchrun / SLURM / MPI, and a launcher (``ddpkit run``).
"""
from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import TYPE_CHECKING, Any

# torch warns at import when numpy is missing; ddpkit needs none. Whoever imports torch after ddpkit
# (ddpkit itself, or the script), that one warning of torch's own import is not shown.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", module=r"torch(\.|$)")

# What each part exports here, loaded on first use (PEP 562): ``import ddpkit`` costs no torch import,
# so ``ddpkit run`` starts its workers while it imports torch itself (see Note [Launcher start] in
# docs/design.md). The parts, one subpackage each: runtime (environment, process group,
# collectives), dp (DataParallel and its four primitives), ddp (DistributedDataParallel), checkpoint;
# launch and bench are the command-line tools.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "ddpkit.checkpoint": ("load", "save"),
    "ddpkit.ddp": ("DDP", "DistributedDataParallel", "SyncBatchNorm"),
    "ddpkit.dp": ("DataParallel", "data_parallel", "gather", "parallel_apply", "replicate", "scatter",
                  "scatter_kwargs"),
    "ddpkit.errors": ("BatchDimError", "CheckpointSaveError", "CollectiveMismatchError", "CommHookError",
                      "DenseGradientError", "EmptyListError", "LateGradientError", "LauncherVariableError",
                      "MixedPrecisionError", "NotAModuleError", "NotInitializedError", "OutputKeysError",
                      "RanksDisagreeError", "RendezvousError", "ReplicaCountError", "SecondGradientError",
                      "StateDictMismatchError", "StaticGraphChangedError", "UnusedParametersError"),
    "ddpkit.logging": ("print",),
    "ddpkit.parallelize": ("parallelize",),
    "ddpkit.runtime": ("DistEnv", "all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast",
                       "broadcast_object", "detect", "expand_hostlist", "get_local_rank", "get_rank",
                       "get_world_size", "init", "is_initialized", "is_main_process", "reduce_scatter",
                       "shutdown"),
    "ddpkit.runtime.hangs.settings": ("HANG_EXIT_CODE",),
}
_SUBMODULES = ("comm", "env", "errors", "hooks", "launch", "bench")
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported at once
    from ddpkit import bench, comm, env, errors, hooks, launch  # noqa: F401 - attributes, as at run time
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
    from ddpkit.runtime.hangs.settings import HANG_EXIT_CODE

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


def __getattr__(name: str) -> Any:
    """Load the part that exports ``name`` on first use, then keep it here (module attribute)."""
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f"ddpkit.{name}")
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


class _Package(types.ModuleType):
    """The import system binds each loaded submodule as an attribute of its package; where an
    export shares a submodule's name (``parallelize``), the name stays the export."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _WHERE and value.__name__ == f"ddpkit.{name}":
            value = getattr(value, name, value)  # loaded now or, mid-import, by __getattr__ later
            if isinstance(value, types.ModuleType):
                return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
