"""torch's ``delay_all_reduce_named_params``: some parameters are averaged apart from the buckets,
in one flat all-reduce launched once the gradient of ``param_to_hook_all_reduce`` is accumulated.

Their gradients live in one flat buffer (each ``.grad`` a view of it, set after each forward, as
torch does), so the launch needs no copy. torch never waits for that all-reduce; ddpkit waits at
the end of the backward that launched it, so the averages are final when ``backward()`` returns.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ddpkit.ddp.autograd_engine import outside_backward_python_context, queue_end_of_backward_callback
from ddpkit.ddp.state_sync import broadcast_coalesced
from ddpkit.errors import explain

__all__ = ["DelayedAllReduce"]


class DelayedAllReduce:
    """Average ``params``' gradients over ``group`` after ``hook_param``'s gradient is computed.

    Args:
        params: the delayed parameters (out of the reducer's buckets), one device and dtype.
        hook_param: the parameter whose accumulated gradient launches the all-reduce; it should get
            its gradient last (an early layer), or the delayed ones are averaged incomplete.
        group: the process group; rank 0's values of ``params`` are broadcast at construction.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], hook_param: torch.nn.Parameter, group: Any):
        self.params = list(params)
        if len({(p.device, p.dtype) for p in self.params}) != 1:
            raise ValueError(explain(
                "delay_all_reduce_named_params must share one device and dtype, found "
                f"{sorted({f'{p.device}/{p.dtype}' for p in self.params})}.",
                "delay parameters of one device and dtype only.", who="DistributedDataParallel"))
        if not isinstance(hook_param, torch.Tensor) or not hook_param.requires_grad:
            raise ValueError(explain(
                f"param_to_hook_all_reduce must be a parameter that requires a gradient, got "
                f"{type(hook_param).__name__}.", "pass e.g. model[0].weight.", who="DistributedDataParallel"))
        self.group = group
        self.world_size = dist.get_world_size(group)
        first = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=first.device, dtype=first.dtype)
        self.views = [v.view_as(p) for v, p in zip(self.buffer.split([p.numel() for p in self.params]),
                                                   self.params)]
        broadcast_coalesced([p.detach() for p in self.params], 0, group)  # torch: whatever init_sync says
        self.armed = False  # a synced forward ran: its backward averages
        self._work: Any = None
        # after its gradient is accumulated (torch: before), so that it may be a delayed one itself
        self._handle = hook_param.register_post_accumulate_grad_hook(self._launch)

    def after_forward(self, synced: bool) -> None:
        """Point missing gradients at the buffer (zeroed), as torch's ``_clear_grad_buffer``;
        ``synced``: this forward's backward averages (not under ``no_sync``)."""
        self.armed = synced
        if self._work is not None:  # launched by a backward that failed before its end: let it finish,
            with contextlib.suppress(Exception):  # as it writes into the buffer, and launch anew
                self._work.wait()
            self._work = None
        with torch.no_grad():
            if all(p.grad is None for p in self.params):
                self.buffer.zero_()
                for p, v in zip(self.params, self.views):
                    p.grad = v
                return
            for p, v in zip(self.params, self.views):
                if p.grad is None:
                    p.grad = v
                    v.zero_()

    def _launch(self, hook_param: torch.Tensor) -> None:
        if self.armed and self._work is None:
            self.armed = False
            with torch.no_grad(), outside_backward_python_context():
                self.buffer.div_(self.world_size)
                self._work = dist.all_reduce(self.buffer, group=self.group, async_op=True)
            queue_end_of_backward_callback(self._wait)

    def _wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    def remove(self) -> None:
        self._handle.remove()
