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
    bucket all-reduces + tail collective        the same, with zeros (Reducer.shadow_backward, Collectives.shadow)
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddpkit.ddp.ddp_logger import logs_errors
from ddpkit.errors import explain

if TYPE_CHECKING:
    from ddpkit.ddp.distributed import DistributedDataParallel

__all__ = ["DDPJoinHook", "JoinSupport"]


class JoinSupport(Joinable):
    """The join half of DistributedDataParallel: ``ddp.join()`` and torch's Joinable interface."""

    @logs_errors
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Context manager for ranks with different numbers of batches (torch's ``ddp.join``).

        Ranks that run out of data contribute zeros to the others' all-reduces until all are done;
        then every rank adopts the model of a rank that trained to the end.
        """
        unshadowed = [name for name, on in (
            ("skip_all_reduce_unused_params", self.skip_all_reduce_unused_params and self.find_unused_parameters),
            ("delay_all_reduce_named_params", self._delayed is not None)) if on]
        if enable and unshadowed:  # torch's DDP would leave the ranks in mismatched collectives
            raise NotImplementedError(explain(
                f"join() cannot be used with {unshadowed[0]}: a rank that joined cannot tell which "
                "all-reduces the others issue, and the ranks would wait in mismatched collectives.",
                f"give every rank the same number of batches, or leave {unshadowed[0]} out.",
                who="DistributedDataParallel", rank=self.rank))
        if enable and self.mixed_precision is not None:
            raise NotImplementedError(explain(
                "join() is not implemented with mixed_precision: its reduce_dtype hook divides by the whole "
                "world size, so join's divide_by_initial_world_size=False would be ignored.",
                "give every rank the same number of batches, or leave mixed_precision out.",
                who="DistributedDataParallel", rank=self.rank))
        self.logger._set_uneven_input_join()  # as torch's, in a world of one too
        if self.reducer is None:
            return contextlib.nullcontext()
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        self.logger._set_uneven_input_join()  # as torch's join hook tells its logger
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> bool | None:
        """Tell joined ranks whether this iteration's backward is synced (they contribute 0)."""
        flag = torch.tensor([0.0 if is_joined_rank or not self.require_backward_grad_sync else 1.0],
                            device=self.device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if not is_joined_rank:
            return None
        work.wait()
        return bool(flag.item() != 0)

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        """The highest ``input_rank`` of the ranks whose ``rank_cond`` holds, agreed by all ranks
        (torch's names: its Join hook and subclasses call it so)."""
        t = torch.tensor([input_rank if rank_cond else -1], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        if int(t.item()) < 0:
            raise RuntimeError("DistributedDataParallel join: no rank could provide the model state.")
        return int(t.item())

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        src = self._find_common_rank(self.rank, is_last_joiner)
        self._broadcast_states(src=src, buffers=self.broadcast_buffers)


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
