"""``DistEnv``, the frozen answer to "where am I in the job?", and the values it may hold.

It lives apart from ``ddpkit.env`` because every source reader builds one while ``ddpkit.env``
imports the readers: here it can be imported by both without a cycle. ``ddpkit.env`` re-exports it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # an annotation only: the launcher reads this module before it imports torch
    import torch

__all__ = ["DistEnv", "LAUNCHERS", "DEFAULT_MASTER_PORT", "LOOPBACK"]

LAUNCHERS = ("torchrun", "ddpkit", "slurm", "mpi", "single")
DEFAULT_MASTER_PORT = 29500
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job.

    ``rank``/``world_size`` count processes over the whole job, ``local_*`` those on this node,
    ``node_rank`` the node. ``backend`` and ``device`` stay None until ``ddpkit.init()`` fills them in.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "single"
    backend: str | None = None
    device: torch.device | None = None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def replace(self, **changes) -> DistEnv:
        return dataclasses.replace(self, **changes)
