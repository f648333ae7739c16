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

__all__ = ["DistEnv", "detect", "expand_hostlist", "init", "shutdown", "current_env", "is_initialized",
           "get_rank", "get_world_size", "get_local_rank", "is_main_process", "all_reduce", "broadcast",
           "broadcast_object", "all_gather", "all_gather_object", "reduce_scatter", "barrier"]
