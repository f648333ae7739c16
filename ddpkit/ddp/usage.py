"""Which parameters an iteration uses: find_unused_parameters and static_graph's accounting.

Kept across iterations: the parameters to mark unused when backward begins, those a ``no_sync``
step used locally, the used map last all-reduced, the write mask it gives, and static_graph's
hook counts from its first iteration. None of it needs a process group.
See Note [Unused parameters] in docs/design.md.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["ParameterUsage"]


class ParameterUsage:
    """Unused-parameter and static_graph accounting for ``num_params`` parameters."""

    def __init__(self, num_params: int, *, find_unused_parameters: bool, static_graph: bool):
        self.num_params = num_params
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        # marked ready (unused) at the first gradient hook, not at the forward: a zero_grad()
        # between forward and backward must still reset their gradients, as in torch
        self.deferred_unused: list[int] | None = None
        self.used_locally = [False] * num_params  # got a gradient in a no_sync step
        self.write_mask: list[bool] | None = None  # False: globally unused, leave .grad alone
        self.static_unused: list[int] = []
        # what a joined rank all-reduces again (see shadow_used_map); reduced in place
        self.last_used_map = torch.zeros(num_params, dtype=torch.int32)
        # static_graph: how often each parameter's hook fired in the first iteration (reentrant
        # checkpointing fires it once per reentrant backward that uses the parameter);
        # see Note [Static graph and reentrant checkpointing] in docs/design.md
        self.hook_counts = [0] * num_params

    # ---- what an iteration is: fixed for its life, so the Iteration holds the answers ----------
    def counting(self, iterations: int) -> bool:
        """static_graph's first iteration: count hooks, launch every bucket at the end."""
        return self.static_graph and iterations == 0

    def tolerant(self, iterations: int) -> bool:
        """Missing gradients are allowed (and a used-map all-reduce is due)."""
        return self.find_unused or (self.static_graph and iterations == 0)

    def hooks_left(self, iterations: int) -> list[int] | None:
        """static_graph after its first iteration: hooks to fire before each parameter is ready."""
        return list(self.hook_counts) if self.static_graph and iterations else None

    # ---- one iteration -------------------------------------------------------------------------
    def note_forward(self, unused: Sequence[int], iterations: int) -> None:
        """A synced forward: ``unused``, the parameters its output cannot reach (find_unused)."""
        if self.static_graph:  # the first iteration's hook counts say which are unused, as in torch
            if iterations > 0:
                self.deferred_unused = self.static_unused
        elif self.find_unused:
            if self.deferred_unused is None:
                self.deferred_unused = list(unused)
            else:  # unused only if no forward of this iteration reaches it
                unused_now = set(unused)
                self.deferred_unused = [i for i in self.deferred_unused if i in unused_now]

    def counted(self) -> list[int]:
        """The parameters whose hook fired in static_graph's first iteration."""
        return [i for i, count in enumerate(self.hook_counts) if count]

    def used_map(self, used: Sequence[bool]) -> torch.Tensor:
        """This rank's used map for the all-reduce: used this iteration or in a no_sync step."""
        used_map = torch.tensor(used, dtype=torch.int32)
        used_map |= torch.tensor(self.used_locally, dtype=torch.int32)
        self.last_used_map = used_map
        return used_map

    def shadow_used_map(self) -> torch.Tensor:
        """A joined rank's: torch's sends its last all-reduced map again, so a parameter any rank
        used then counts as used (zeros, not None)."""
        return self.last_used_map

    def settle(self, reduced: torch.Tensor, used: Sequence[bool]) -> None:
        """Take the all-reduced used map: which gradients to write back, and static_graph's unused."""
        self.write_mask = [u > 0 for u in reduced.tolist()]
        if self.static_graph:
            self.static_unused = [i for i, u in enumerate(used) if not u]

    def end_iteration(self, counted: bool, counting: bool) -> None:
        """``counted``: a synced backward finished; else it was abandoned."""
        self.deferred_unused = None
        if counted:
            self.used_locally = [False] * self.num_params
        elif counting:  # an abandoned first static_graph iteration: its counts are partial
            self.hook_counts = [0] * self.num_params
