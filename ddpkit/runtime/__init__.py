"""Where a process stands in the job and how it talks to the others.

``env`` reads the launchers' variables (one reader per launcher in ``environments/``) into a frozen
``DistEnv``; ``process_group`` turns it into a process group (``ddpkit.init``), whose ranks meet in
``rendezvous`` (connecting through ``store_client``), where ``job_check`` keeps other jobs out,
``port_holder`` names who holds a taken port and ``refusal`` carries a rank's refused variables to
the ranks waiting for it; ``comm`` holds the collectives that also work in a world of one (``ddpkit.env`` and
``ddpkit.comm`` re-export ``env`` and ``comm``); ``direct`` issues DDP's collectives to the process
group itself.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["DistEnv", "detect", "expand_hostlist", "init", "shutdown", "current_env", "is_initialized",
           "get_rank", "get_world_size", "get_local_rank", "is_main_process", "all_reduce", "broadcast",
           "broadcast_object", "all_gather", "all_gather_object", "reduce_scatter", "barrier"]

# loaded on first use: ``ddpkit run`` reads ``environments`` and ``hangs.settings`` before it imports
# torch, which ``comm`` and ``process_group`` need (Note [Launcher start] in docs/design.md)
_WHERE = {**dict.fromkeys(("DistEnv", "detect", "expand_hostlist"), "env"),
          **dict.fromkeys(("all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast", "broadcast_object",
                           "reduce_scatter"), "comm")}

if TYPE_CHECKING:
    from ddpkit.runtime.comm import (
        all_gather,
        all_gather_object,
        all_reduce,
        barrier,
        broadcast,
        broadcast_object,
        reduce_scatter,
    )
    from ddpkit.runtime.env import DistEnv, detect, expand_hostlist
    from ddpkit.runtime.process_group import (
        current_env,
        get_local_rank,
        get_rank,
        get_world_size,
        init,
        is_initialized,
        is_main_process,
        shutdown,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE.get(name, 'process_group')}"), name)
    globals()[name] = value
    return value
