"""Join support for uneven inputs: a rank out of data shadows the others' collectives.

Uses torch's generic ``torch.distributed.algorithms.Join`` (a Python context manager that is not
part of torch's DDP): it all-reduces a 'still active' count each iteration and, on ranks that have
joined, calls ``DDPJoinHook.main_hook`` until every rank is done. ``main_hook`` must issue exactly
the collectives an active rank's iteration issues, in the same order:

    active rank (forward, backward)             joined rank (main_hook)
    ---------------------------------------     ---------------------------------------
    Join count all-reduce (ones)                Join count all-reduce (zeros), by Join
    bucket rebuild broadcast, once              the same
    buffer broadcast, if due                    the same, from the same source rank
    'sync this backward?' all-reduce (1)        the same (0), and learn the answer
    bucket all-reduces + tail collective        the same, with zeros
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.algorithms.join import JoinHook

if TYPE_CHECKING:
    from ddpkit.distributed import DistributedDataParallel

__all__ = ["DDPJoinHook"]


class DDPJoinHook(JoinHook):
    """Mirror one training iteration of the active ranks, contributing zeros."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool = True):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_buckets_if_due()
        if ddp._will_sync_buffers():
            ddp._sync_buffers(active=False)
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        # the active ranks' next forward syncs buffers only after a synced one, and so must we
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: adopt the model of a rank that trained to the end."""
        self.ddp._sync_final_model(is_last_joiner)
