"""Which parameters share a bucket: torch's assignment by size, per device and dtype, before and
after the rebuild, and ddpkit's one departure from it (full buckets on CPU), which a comm hook
never sees.

The group functions return parameter indices in launch order; ``assign_buckets`` does the packing.
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch

__all__ = ["assign_buckets", "initial_groups", "rebuilt_groups"]


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], cap_bytes: int,
                   first_cap_bytes: int | None = None, caps: Sequence[int] = (), sparse: Sequence[bool] = (),
                   in_closing_order: bool = False, as_torch_rebuilds: bool = False) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes``, per device and dtype.

    Indices are taken in ``order`` (the order in which gradients are expected to become ready) and
    a bucket closes once it reaches its limit, so a tensor larger than the limit gets a bucket of
    its own. The first bucket of each device and dtype closes at ``first_cap_bytes`` instead
    (torch's small first bucket: the first all-reduce starts early). ``caps`` (torch's
    ``bucket_cap_mb_list``), when given, replaces both: the k-th bucket of each device and dtype
    closes at ``caps[k]``, the last cap repeating. Buckets are returned in the order in which they
    are expected to fill.

    ``sparse[i]``: parameter ``i`` gets sparse gradients, so a bucket of its own, whatever its size
    (torch's ``expect_sparse_gradient``). ``in_closing_order``: the buckets in the order they closed,
    those left open last, as torch orders its rebuilt buckets (where a sparse one closes at once).
    ``as_torch_rebuilds``: in closing order, and those left open (one per device and dtype) in the
    reverse of the order their device and dtype first came, as torch's rebuild lists them (its
    unordered_map, read back; tested against ``dist._compute_bucket_assignment_by_size``).
    """
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    limits = list(caps) or [first_cap_bytes, cap_bytes]
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict[tuple, tuple[list[int], int]] = {}  # (device, dtype) -> (indices, bytes)
    closed: dict[tuple, int] = {}  # (device, dtype) -> buckets closed so far
    buckets: list[list[int]] = []
    first_seen: dict[tuple, None] = {}
    for index in order:
        if sparse and sparse[index]:
            buckets.append([index])
            continue
        p = params[index]
        key = (p.device, p.dtype)
        first_seen.setdefault(key)
        indices, size = open_buckets.pop(key, ([], 0))
        indices.append(index)
        size += p.numel() * p.element_size()
        done = closed.get(key, 0)
        if size >= limits[min(done, len(limits) - 1)]:
            buckets.append(indices)
            closed[key] = done + 1
        else:
            open_buckets[key] = (indices, size)
    if as_torch_rebuilds:
        return buckets + [open_buckets[key][0] for key in reversed(first_seen) if key in open_buckets]
    buckets.extend(indices for indices, _ in open_buckets.values())
    if not in_closing_order:
        buckets.sort(key=lambda indices: position[indices[0]])
    return buckets


def initial_groups(params: Sequence[torch.Tensor], cap: int, first_cap: int, *, hooked: bool,
                   rebuilt_later: bool, cap_list: Sequence[int] = (), sparse: Sequence[bool] = (),
                   alone: Sequence[bool] = (), own_cap: int | None = None) -> list[list[int]]:
    """The buckets before the rebuild, each listing its parameters in registration order.

    Without a comm hook: filled in reverse registration order (the expected order of gradients),
    so the first backward overlaps too. With one, torch's, which a hook acting on whole buckets
    must see: one bucket per device and dtype until the rebuild, or, when no rebuild comes
    (find_unused_parameters), groups formed in registration order and launched last first.
    With ``cap_list`` (torch's ``bucket_cap_mb_list``), torch's own always: those caps in
    registration order, launched last first. ``sparse``: see ``assign_buckets``. ``alone[i]``:
    parameter ``i`` is reduced in place, so a bucket of its own, and the buckets go in the order
    they close (see ``_alone``); only without a hook. ``own_cap``: see ``BucketLayout``.
    """
    registration = list(range(len(params)))
    if cap_list:
        return assign_buckets(params, registration, cap, caps=cap_list, sparse=sparse)[::-1]
    if not hooked:
        groups = assign_buckets(params, registration[::-1], *_caps(params, cap, first_cap, hooked, own_cap),
                                sparse=_alone(sparse, alone), in_closing_order=any(alone))
        return [sorted(indices) for indices in groups]
    if rebuilt_later:
        return assign_buckets(params, registration, sys.maxsize, sys.maxsize, sparse=sparse)[::-1]
    return assign_buckets(params, registration, cap, first_cap, sparse=sparse)[::-1]


def rebuilt_groups(params: Sequence[torch.Tensor], order: Sequence[int], cap: int, first_cap: int,
                   *, hooked: bool, cap_list: Sequence[int] = (), sparse: Sequence[bool] = (),
                   alone: Sequence[bool] = (), own_cap: int | None = None) -> list[list[int]]:
    """The buckets after the rebuild, filled in ``order`` (the order gradients arrived in); with
    ``cap_list``, the k-th bucket closes at its k-th cap, as torch rebuilds. With sparse gradients,
    in torch's rebuilt order: a sparse bucket goes where its gradient arrived, before a bucket
    still filling; ``hooked``: in torch's order, which a comm hook sees through ``bucket.index()``
    and ``is_last()``, with several dtypes too. ``alone``, ``own_cap``: see ``initial_groups``."""
    return assign_buckets(params, order, *_caps(params, cap, first_cap, hooked, own_cap), caps=cap_list,
                          sparse=_alone(sparse, alone), in_closing_order=any(sparse) or any(alone),
                          as_torch_rebuilds=hooked)


def _alone(sparse: Sequence[bool], in_place: Sequence[bool]) -> Sequence[bool]:
    """Which parameters get a bucket of their own. A gradient reduced in place is launched as soon
    as it is ready, so the buckets go in the order they close: one of them sorted by its first
    parameter would hold back the in-place ones that arrive before it fills."""
    if not in_place:
        return sparse
    return [bool(sparse and sparse[i]) or own for i, own in enumerate(in_place)]


def _caps(params: Sequence[torch.Tensor], cap: int, first_cap: int, hooked: bool,
          own_cap: int | None) -> tuple[int, int]:
    """(cap, first cap): torch's, with its small first bucket, except on CPU without a comm hook.

    On CPU, Gloo runs the all-reduce on threads that share the cores backward is using: a bucket
    launched during backward preempts it, which the 1 MiB it overlaps does not pay back. So every
    CPU bucket holds up to ``own_cap`` (the cap, or less where Gloo has cores of its own: see
    ``cpu_share``); models above it still overlap. See Note [Bucket layout on CPU] in docs/design.md.
    """
    if params[0].device.type == "cpu" and not hooked:
        own = cap if own_cap is None else own_cap
        return own, own
    return cap, first_cap
