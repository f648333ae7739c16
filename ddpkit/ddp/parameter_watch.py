"""What became of the parameters a DDP was built with: replaced, removed, frozen, or joined by new ones.

DDP averages the parameters its module held when it was wrapped, as torch's does. A head replaced
after wrapping (``ddp.module.fc = nn.Linear(...)``), or a layer unfrozen, then trains on each rank
alone: torch says nothing, and the ranks drift apart. ``ParameterWatch`` compares the module with
that list at the end of the first ten synced backwards and every 100th after (torch's sampled
iterations, so the steps between pay nothing; after the backward, not in the forward, where
``torch.func.functional_call`` swaps parameters for the call alone) and warns once; and when a
backward leaves parameters without a gradient, it says which of them were replaced, removed or
frozen since, so that the error does not send the user to ``find_unused_parameters=True``, which
would hide the change rather than fix it.
"""
from __future__ import annotations

from typing import Collection, Sequence

from torch import nn

from ddpkit.ddp import errors

__all__ = ["ParameterWatch", "REPLACED", "REMOVED", "FROZEN", "ADDED"]

REPLACED = "replaced by a new parameter"
REMOVED = "removed from the module"
FROZEN = "frozen (requires_grad=False)"
ADDED = "added or unfrozen"

_DRIFTING = (REPLACED, ADDED)
"""Changes whose gradients are never averaged, silently: warned about at the sampled forwards."""


class ParameterWatch:
    """The parameters a DDP averages (``named``), against what ``module`` holds now; ``ignored``: the
    names DDP leaves alone (torch's ignore list, the delayed ones)."""

    def __init__(self, module: nn.Module, named: Sequence[tuple[str, nn.Parameter]], ignored: Collection[str]):
        self._module = module
        self._named = list(named)
        self._ignored = ignored
        self._warned = False

    def changes(self, names: Collection[str] | None = None) -> dict[str, str]:
        """Name -> what became of it (``REPLACED``, ...), for ``names`` of the DDP's parameters, or,
        without ``names``, for all of them and the module's new trainable ones (``ADDED``)."""
        current = dict(self._module.named_parameters())
        found: dict[str, str] = {}
        for name, param in self._named:
            if names is not None and name not in names:
                continue
            now = current.get(name)
            if now is None:
                found[name] = REMOVED
            elif now is not param:
                found[name] = REPLACED
            elif not now.requires_grad:
                found[name] = FROZEN
        if names is None:
            averaged = {id(p) for _, p in self._named}
            for name, param in current.items():
                if param.requires_grad and id(param) not in averaged and name not in self._ignored:
                    found.setdefault(name, ADDED)
        return found

    def warn_if_changed(self, rank: int) -> None:
        """Warn once, at the user's backward call, if parameters were replaced or added since wrapping."""
        if self._warned:
            return
        drifting = {name: what for name, what in self.changes().items() if what in _DRIFTING}
        if drifting:
            self._warned = True
            errors.warn_at_user_code(errors.parameters_changed_warning(rank, drifting))
