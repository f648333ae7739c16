"""The reducer's forward side: what a synced forward tells it, before and after it runs.

``Reducer`` inherits these: the check that the last backward finished, arming the hooks (with
find_unused_parameters' search of the output), the hook on the outputs that says where a backward
ends, and a local forward (``no_sync``). Kept apart so that ``reducer.py`` reads as the backward's
path (hooks, launches, the wait point).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ddpkit.ddp import errors
from ddpkit.ddp.autograd_engine import queue_end_of_backward_callback
from ddpkit.ddp.compile_support import dynamo_free
from ddpkit.ddp.iteration import Phase
from ddpkit.ddp.outputs import unreached_parameters

if TYPE_CHECKING:
    from ddpkit.ddp.collectives import Collectives
    from ddpkit.ddp.ddp_logger import DDPLogger
    from ddpkit.ddp.iteration import Iteration
    from ddpkit.ddp.usage import ParameterUsage

__all__ = ["ReducerForward"]


class ReducerForward:
    """The forward half of ``Reducer`` (which supplies these attributes, ``_end_iteration`` and
    ``finalize_backward``)."""

    params: list[torch.nn.Parameter]
    rank: int
    usage: ParameterUsage
    collectives: Collectives
    logger: DDPLogger
    iterations: int
    forwards: int
    forward_seen: bool
    _iteration: Iteration

    def _end_iteration(self, it: Iteration, phase: Phase, counted: bool = True) -> None:
        raise NotImplementedError

    def finalize_backward(self) -> None:
        raise NotImplementedError

    @functools.cached_property
    def index_of(self) -> dict[int, int]:
        """Parameter index by ``id``, for find_unused_parameters' search: built at its first use."""
        return {id(p): i for i, p in enumerate(self.params)}

    def prepare_for_forward(self) -> None:
        """Called before a synced forward: a backward that began must have finished."""
        it = self._iteration
        if it.phase is Phase.REDUCING or it.phase is Phase.HELD:  # its collectives finish first
            self.collectives.drain(it.works)
            self._end_iteration(it, Phase.IDLE, counted=False)
            raise self.logger.logged(errors.unfinished_backward_error(self.rank))
        it.rearm()  # a backward that reached no parameter, or failed first: its queued wait never runs

    def prepare_for_backward(self, unused: Sequence[int] | Sequence[torch.Tensor] = ()) -> None:
        """Arm the hooks after a synced forward; ``unused``: indices the output cannot reach. Several
        forwards before one backward (a siamese loss, an evaluation forward) share one iteration.
        Also torch's reducer call, with the outputs: a pipeline stage arms its last backward so."""
        if unused and isinstance(unused[0], torch.Tensor):
            unused = self.unreached(unused)
        self.forwards += 1
        self.forward_seen = True
        self._iteration.arm(self.forwards)
        self.usage.note_forward(unused, self.iterations)
        if self.logger.timing:  # a sampled iteration: its backward begins, its gradients' order is noted
            self._iteration.record = self.logger.start_backward(
                self._iteration.record, [self.params[i] for i in unused or self.usage.static_unused])

    def unreached(self, outputs: Sequence[torch.Tensor]) -> list[int]:
        """find_unused_parameters' search: the parameters ``outputs`` cannot reach (none searched with
        static_graph, whose first iteration's hook counts decide, as in torch)."""
        if not self.usage.find_unused or self.usage.static_graph:
            return []
        return unreached_parameters([t for t in outputs if t.requires_grad], self.index_of)

    def output_gradient_hook(self) -> Callable[[torch.Tensor], None]:
        """A hook for this forward's outputs: queues the wait at the end of the backward that runs
        through them (a reentrant checkpoint's inner backward, where parameter hooks may fire first,
        ends earlier). A backward that starts at an averaged iteration's outputs raises."""
        forward = self.forwards

        def check(grad: torch.Tensor) -> None:
            if forward < self._iteration.window_start:
                if not self._iteration.running:  # else reached through this one's graph: a carried state
                    raise self.logger.logged(errors.stale_output_error(self.rank, forward, self.forwards))
            elif self._iteration.reach_output():
                queue_end_of_backward_callback(self.finalize_backward)
        return dynamo_free(check)

    def prepare_for_local_backward(self) -> None:
        """A forward without gradient sync (no_sync, or grad disabled): hooks stay quiet."""
        self.forward_seen = True
        self._iteration.disarm()
