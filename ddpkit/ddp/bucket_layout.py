"""Which parameters share a bucket, before and after the rebuild: torch's rules, and ddpkit's
one departure from them (full buckets on CPU), which a comm hook never sees.

Each function returns groups of parameter indices in launch order; ``assign_buckets`` does the
packing.
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch

from ddpkit.ddp.bucket import assign_buckets

__all__ = ["initial_groups", "rebuilt_groups"]


def initial_groups(params: Sequence[torch.Tensor], cap: int, first_cap: int, *, hooked: bool,
                   rebuilt_later: bool) -> list[list[int]]:
    """The buckets before the rebuild, each listing its parameters in registration order.

    Without a comm hook: filled in reverse registration order (the expected order of gradients),
    so the first backward overlaps too. With one, torch's, which a hook acting on whole buckets
    must see: one bucket per device and dtype until the rebuild, or, when no rebuild comes
    (find_unused_parameters), groups formed in registration order and launched last first.
    """
    registration = list(range(len(params)))
    if not hooked:
        groups = assign_buckets(params, registration[::-1], cap, _first_cap(params, cap, first_cap, hooked))
        return [sorted(indices) for indices in groups]
    if rebuilt_later:
        return assign_buckets(params, registration, sys.maxsize, sys.maxsize)[::-1]
    return assign_buckets(params, registration, cap, first_cap)[::-1]


def rebuilt_groups(params: Sequence[torch.Tensor], order: Sequence[int], cap: int, first_cap: int,
                   *, hooked: bool) -> list[list[int]]:
    """The buckets after the rebuild, filled in ``order`` (the order gradients arrived in)."""
    return assign_buckets(params, order, cap, _first_cap(params, cap, first_cap, hooked))


def _first_cap(params: Sequence[torch.Tensor], cap: int, first_cap: int, hooked: bool) -> int:
    """torch's small first bucket, except on CPU without a comm hook.

    On CPU, Gloo runs the all-reduce on threads that share the cores backward is using: a bucket
    launched during backward preempts it (2 ranks on 2 cores: about 5 more involuntary context
    switches and 1 to 1.5 ms more per step for one more bucket), which the 1 MiB it overlaps does
    not pay back. So every CPU bucket holds up to the cap; models above it still overlap.
    """
    return cap if params[0].device.type == "cpu" and not hooked else first_cap
