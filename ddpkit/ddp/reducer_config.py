"""The reducer's settings that change after construction, and a joined rank's backward.

``Reducer`` inherits these: static_graph turned on before the first forward, a comm hook, Join's
divisor, the one rebuild of the buckets in arrival order, and the collectives a joined rank shadows.
Kept apart so that ``reducer.py`` reads as one iteration's path (hooks, launches, the wait point).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpkit.ddp import errors

if TYPE_CHECKING:
    from ddpkit.ddp.bucket_layout import BucketLayout
    from ddpkit.ddp.collectives import Collectives, CommHook
    from ddpkit.ddp.ddp_logger import DDPLogger
    from ddpkit.ddp.iteration import Iteration, Phase
    from ddpkit.ddp.usage import ParameterUsage

__all__ = ["ReducerConfig"]


class ReducerConfig:
    """The configuration half of ``Reducer`` (which supplies these attributes and ``_renew``)."""

    group: Any
    rank: int
    layout: BucketLayout
    usage: ParameterUsage
    collectives: Collectives
    logger: DDPLogger
    iterations: int
    forwards: int
    _join_work: Any
    _iteration: Iteration

    def _renew(self, phase: Phase | None = None) -> None:
        raise NotImplementedError

    def rebuild_buckets_if_due(self) -> bool:
        """After the first synced backward, rebuild once in rank 0's gradient-ready order (a broadcast:
        a joined rank calls this too). With static_graph, after the second: the first one counts
        gradient hooks instead of recording when each parameter became ready."""
        if self.layout.rebuilt or self.iterations < (2 if self.usage.static_graph else 1):
            return False
        self.layout.rebuild(self.group, hooked=self.collectives.comm_hook is not None)
        self._renew()
        return True

    def set_static_graph(self) -> None:
        """Turn static_graph on before the first forward."""
        if self.forwards:
            raise self.logger.logged(errors.late_static_graph_error(self.rank, self.forwards))
        self.usage.static_graph = True
        self.layout.expect_rebuild()
        self._renew()

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        self.collectives.set_comm_hook(state, hook)
        if not self.forwards:  # before training, as torch asks: the hook gets torch's buckets
            self.layout.build_initial(hooked=True)
            self._renew()

    def set_join_count(self, work: Any) -> None:
        """Divide by the number of ranks still active (``Join(divide_by_initial_world_size=False)``)."""
        self._join_work = work

    # ---- a joined rank -------------------------------------------------------------------------
    def shadow_backward(self) -> None:
        """A joined rank's backward: the collectives of an active rank's ``finalize_backward``, in
        order, with zero gradients (see Note [Join shadowing] in docs/design.md)."""
        used_map = self.usage.shadow_used_map if self._iteration.tolerant else None
        self.collectives.shadow(self.layout.buckets, used_map, self.usage.static_graph)
        self.iterations += 1
        self._renew()
