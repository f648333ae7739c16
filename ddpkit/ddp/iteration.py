"""One synced iteration's state as one object: its phase, and what its buckets still wait for.

torch's reducer keeps this in a dozen fields and boolean flags whose combinations are the state;
here a new iteration, or a fresh count on new buckets, is a new ``Iteration``.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ddpkit.ddp.bucket_layout import BucketLayout
    from ddpkit.ddp.usage import ParameterUsage

__all__ = ["Iteration", "Phase"]


class Phase(enum.Enum):
    """Where a synced iteration stands, from the reducer's point of view.

    IDLE: no synced forward waits for its backward; a gradient now stays local (``no_sync``).
    ARMED: a synced forward ran; its backward has reached neither its outputs nor a parameter.
    QUEUED: backward reached an output of a synced forward; ``finalize_backward`` runs at its end.
    REDUCING: a parameter's hook fired (the wait is queued); buckets may have launched.
    HELD: a parameter's hook fired in a ``backward(create_graph=True)``: nothing launches; at its
        end the hooks' work is done in their order (see ``ddpkit.ddp.create_graph``).
    FINALIZED: averaged and written back, no forward since; a gradient now is late (warned once).
    """

    IDLE = "idle"
    ARMED = "armed"
    QUEUED = "queued"
    REDUCING = "reducing"
    HELD = "held"
    FINALIZED = "finalized"

    def on_new_buckets(self) -> Phase:
        """The phase of a fresh count: a window still open is armed again, nothing launched."""
        return self if self in (Phase.IDLE, Phase.FINALIZED) else Phase.ARMED


class Iteration:
    """A synced iteration counted against one bucket layout.

    Per parameter: ``ready`` (counted in, or marked unused), ``used`` (not marked unused),
    ``copied`` (a big gradient already scaled into its slot). Per bucket: ``pending``, how many
    parameters it still waits for; buckets launch strictly in order (``next_bucket``), so every
    rank issues the same collectives whatever order its gradients arrive in. The hot path reads
    these lists directly, and the layout's tables through here, all fixed for the iteration's life.
    So are ``counting`` (static_graph's first iteration: hooks are counted and every bucket
    launches at the end of backward, torch's delay_all_reduce, since a hook may fire again),
    ``tolerant`` (missing gradients are allowed, and a used-map all-reduce is due) and
    ``hooks_left`` (static_graph later on: hooks to fire before each parameter is ready).

    Args:
        layout: the buckets counted into.
        usage, iterations: the accounting, and how many synced backwards came before.
        scale: what gradients are multiplied by on their way in (1 / world size).
        phase: where it starts.
        previous: the iteration before, whose forward window carries over.
    """

    __slots__ = ("phase", "window_start", "late_warned", "counting", "tolerant", "hooks_left", "scale",
                 "ready", "used", "copied", "pending", "next_bucket", "works", "bucket_of", "big_slot",
                 "record", "held")

    def __init__(self, layout: BucketLayout, usage: ParameterUsage, iterations: int, scale: float,
                 phase: Phase = Phase.IDLE, previous: Iteration | None = None):
        n = len(layout.bucket_of)
        self.phase = phase
        self.window_start = 1 if previous is None else previous.window_start  # its first forward
        self.late_warned = False if previous is None else previous.late_warned
        self.counting = usage.counting(iterations)
        self.tolerant = usage.tolerant(iterations)
        self.hooks_left = usage.hooks_left(iterations)
        self.scale = scale
        self.ready = [False] * n
        self.used = [True] * n
        self.copied = [False] * n
        self.pending = list(layout.counts)
        self.next_bucket = 0
        self.works: list[Any] = []
        self.bucket_of = layout.bucket_of
        self.big_slot = layout.big_slot
        self.record = layout.record  # the gradient-ready order, while a rebuild is to come
        self.held: list[int] = []  # HELD: the parameters whose hooks fired, in order

    # ---- phase transitions ---------------------------------------------------------------------
    def arm(self, forward: int) -> None:
        """Synced forward pass number ``forward`` ran: its backward is expected."""
        if self.phase is Phase.IDLE or self.phase is Phase.FINALIZED:  # the first of an iteration
            self.phase, self.window_start = Phase.ARMED, forward

    def disarm(self) -> None:
        """A forward without gradient sync: a gradient now is a local one, not a late one."""
        if self.phase is Phase.FINALIZED:
            self.phase = Phase.IDLE

    @property
    def running(self) -> bool:
        """A backward of this iteration is under way (it reached an output or a parameter)."""
        return self.phase is Phase.QUEUED or self.phase is Phase.REDUCING or self.phase is Phase.HELD

    def reach_output(self) -> bool:
        """Backward reached an output of a synced forward; True: queue the wait now."""
        if self.phase is Phase.ARMED:
            self.phase = Phase.QUEUED
            return True
        return False

    def begin_reducing(self) -> bool:
        """A parameter's first gradient; True: queue the wait now (backward came another way)."""
        queue = self.phase is Phase.ARMED
        self.phase = Phase.REDUCING
        return queue

    def hold(self) -> None:
        """A ``backward(create_graph=True)`` began: its gradients are looked at before any launch."""
        self.phase = Phase.HELD

    def release(self) -> list[int]:
        """The held backward ended: its parameters, in the order their hooks fired, to reduce now."""
        held, self.held = self.held, []
        self.phase = Phase.REDUCING
        return held

    def rearm(self) -> None:
        """A backward ended (or failed) before reaching a parameter: still armed, nothing queued."""
        if self.phase is Phase.QUEUED:
            self.phase = Phase.ARMED

    # ---- counting ------------------------------------------------------------------------------
    def mark_unused(self, indices: Sequence[int]) -> None:
        """Count parameters in as ready without a gradient (unused, or missing at the end)."""
        ready, used, pending, bucket_of = self.ready, self.used, self.pending, self.bucket_of
        for i in indices:
            if not ready[i]:
                ready[i], used[i] = True, False
                pending[bucket_of[i]] -= 1

    def mark_ready(self, indices: Sequence[int]) -> None:
        """Count parameters in as ready with their gradient (static_graph's counted hooks)."""
        ready, pending, bucket_of = self.ready, self.pending, self.bucket_of
        for i in indices:
            if not ready[i]:
                ready[i] = True
                pending[bucket_of[i]] -= 1

    def missing(self) -> list[int]:
        """The parameters not counted in yet."""
        return [i for i, r in enumerate(self.ready) if not r]

    def all_launched(self) -> bool:
        return self.next_bucket == len(self.pending)
