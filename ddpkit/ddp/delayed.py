"""torch's ``delay_all_reduce_named_params``: some parameters are averaged apart from the buckets,
in one flat all-reduce launched once the gradient of ``param_to_hook_all_reduce`` is accumulated.

Their gradients live in one flat buffer (each ``.grad`` a view of it, set after each forward, as
torch does), so the launch needs no copy. torch never waits for that all-reduce; ddpkit waits at
the end of the backward that launched it, so the averages are final when ``backward()`` returns.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ddpkit.ddp.autograd_engine import outside_backward_python_context, queue_end_of_backward_callback
from ddpkit.ddp.compile_support import dynamo_free
from ddpkit.ddp.state_sync import broadcast_coalesced
from ddpkit.errors import LateGradientError, explain

__all__ = ["DelayedAllReduce"]


class DelayedAllReduce:
    """Average ``params``' gradients over ``group`` after ``hook_param``'s gradient is computed.

    Args:
        named: the delayed parameters (out of the reducer's buckets) by name, one device and dtype.
        hook_param: the parameter whose accumulated gradient launches the all-reduce; it must get
            its gradient last (an early layer): a delayed gradient computed after it raises
            ``LateGradientError``, where torch's DDP averages it incomplete, differently on each rank.
        hook_name: ``hook_param``'s name, for that error.
        group: the process group; rank 0's values of the parameters are broadcast at construction.
    """

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], hook_param: torch.nn.Parameter,
                 hook_name: str, group: Any):
        self.params = [p for _, p in named]
        if len({(p.device, p.dtype) for p in self.params}) != 1:
            raise ValueError(explain(
                "delay_all_reduce_named_params must share one device and dtype, found "
                f"{sorted({f'{p.device}/{p.dtype}' for p in self.params})}.",
                "delay parameters of one device and dtype only.", who="DistributedDataParallel"))
        if not isinstance(hook_param, torch.Tensor) or not hook_param.requires_grad:
            raise ValueError(explain(
                f"param_to_hook_all_reduce must be a parameter that requires a gradient, got "
                f"{type(hook_param).__name__}.", "pass e.g. model[0].weight.", who="DistributedDataParallel"))
        self.group, self.hook_name = group, hook_name
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        first = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=first.device, dtype=first.dtype)
        self.views = [v.view_as(p) for v, p in zip(self.buffer.split([p.numel() for p in self.params]),
                                                   self.params)]
        broadcast_coalesced([p.detach() for p in self.params], 0, group)  # torch: whatever init_sync says
        self.armed = False  # a synced forward ran: its backward averages
        self._work: Any = None
        # after its gradient is accumulated (torch: before), so that it may be a delayed one itself
        self._handles = [hook_param.register_post_accumulate_grad_hook(dynamo_free(self._launch))]
        self._handles += [
            p.register_post_accumulate_grad_hook(dynamo_free(functools.partial(self._check_in_time, name)))
            for name, p in named if p is not hook_param]

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

    def _check_in_time(self, name: str, param: torch.Tensor) -> None:
        """A delayed gradient computed once its all-reduce is under way was averaged incomplete."""
        if self._work is not None:
            raise LateGradientError(explain(
                f"the gradient of {name!r}, one of delay_all_reduce_named_params, was computed after the "
                f"gradient of param_to_hook_all_reduce ({self.hook_name!r}), which launches the all-reduce "
                f"of the delayed gradients: {name!r} was averaged before it was complete, so each rank would "
                "keep a different gradient (torch's DDP does so silently).",
                "pass as param_to_hook_all_reduce a parameter whose gradient is computed after every delayed "
                "one's, such as the first layer's weight (backward runs from the last layer to the first).",
                who="DistributedDataParallel", rank=self.rank),
                rank=self.rank, parameter=name, hook_parameter=self.hook_name)

    def _wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
