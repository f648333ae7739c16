"""A reducer's buckets: built from the groups of ``bucket_groups``, rebuilt once in rank 0's
gradient-ready order, and where each parameter's gradient goes (its bucket, its slot).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ddpkit.ddp.adoption import reclaim
from ddpkit.ddp.bucket import Bucket
from ddpkit.ddp.bucket_groups import initial_groups, rebuilt_groups
from ddpkit.ddp.inplace_bucket import IN_PLACE_BYTES, InPlaceBucket
from ddpkit.ddp.profiling import bucket_range
from ddpkit.ddp.sparse_bucket import SparseBucket
from ddpkit.runtime.comm import comm_device

__all__ = ["BucketLayout", "ONE_BLOCK_DEVICES"]

ONE_BLOCK_DEVICES = ("cuda",)
"""The device types whose dense buckets share one block per device and dtype: those of an allocator
that rounds each block up (Note [One block per device] in docs/design.md)."""


class BucketLayout:
    """A reducer's buckets, in launch order, and where each parameter's gradient goes.

    Args:
        params: the parameters, in registration order.
        cap_bytes, first_cap_bytes: bucket sizes (torch's ``bucket_cap_mb`` and small first bucket).
        as_view: ``gradient_as_bucket_view``: the gradients become views of the buckets.
        rebuild: the buckets are rebuilt once, in the order gradients really arrived.
        bucket_type: the class of the buckets built.
        cap_list: torch's ``bucket_cap_mb_list`` in bytes (the k-th bucket's cap), or empty.
        like_torch: torch's layout even without a comm hook (skip_all_reduce_unused_params skips
            the buckets torch would).
        sparse: per parameter, its name if its gradients are sparse (a ``SparseBucket`` of its own,
            which names it in errors), else None.
        in_place_bytes: a CPU gradient of this many bytes or more is reduced where it lies, in an
            ``InPlaceBucket`` of its own, wherever the layout is ddpkit's own (no comm hook, no
            ``as_view``, no ``cap_list``); 0: never; None: ``IN_PLACE_BYTES``. See Note [Big
            gradients in place].
        own_cap: the cap this rank would give ddpkit's own CPU buckets (no comm hook) from the
            rebuild on, where rank 0's choice, broadcast with the order, holds on every rank; before
            it (and without a rebuild), ``cap_bytes``.
        keep_in_place: whether this rank would keep reducing big gradients in place after the
            rebuild; rank 0's choice holds there, as for ``own_cap`` (before it they are in place).
        one_block: the device types whose dense buckets share one block per device and dtype.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], cap_bytes: int, first_cap_bytes: int, *,
                 as_view: bool, rebuild: bool, bucket_type: type[Bucket] = Bucket, cap_list: Sequence[int] = (),
                 like_torch: bool = False, sparse: Sequence[str | None] = (), in_place_bytes: int | None = 0,
                 own_cap: int | None = None, keep_in_place: bool = True,
                 one_block: Sequence[str] = ONE_BLOCK_DEVICES):
        self.params = list(params)
        self.cap, self.first_cap = cap_bytes, first_cap_bytes
        self.own_cap: int | None = None  # every rank's, the same: the cap until the rebuild
        self._own_cap_wanted = cap_bytes if own_cap is None else own_cap
        self._keep_in_place_wanted = keep_in_place
        self.cap_list, self.like_torch = tuple(cap_list), like_torch
        self.as_view = as_view
        self.bucket_type = bucket_type
        self.one_block = tuple(one_block)
        self.sparse_names = list(sparse)
        self.sparse = [name is not None for name in sparse] if any(name is not None for name in sparse) else []
        in_place_bytes = IN_PLACE_BYTES if in_place_bytes is None else in_place_bytes
        free = in_place_bytes > 0 and not (as_view or like_torch or cap_list)
        self.in_place = [free and p.device.type == "cpu" and not (self.sparse and self.sparse[i])
                         and p.numel() * p.element_size() >= in_place_bytes for i, p in enumerate(self.params)]
        if not any(self.in_place):
            self.in_place = []
        self._alone: list[bool] = []  # in place in the buckets built last (none in torch's layout)
        self._rebuild_planned = rebuild  # torch fixes its first buckets at construction
        self.rebuilt = not rebuild
        # the order gradients became ready in, recorded while a rebuild is to come
        self.record: list[int] | None = None if self.rebuilt else []
        self.buckets: list[Bucket] = []
        self.build_initial(hooked=False)

    def build_initial(self, hooked: bool) -> None:
        """The buckets before the rebuild; ``hooked``: a comm hook sees them, so torch's."""
        self._alone = [] if hooked else self.in_place
        self.build(initial_groups(self.params, self.cap, self.first_cap, hooked=hooked or self.like_torch,
                                  rebuilt_later=self._rebuild_planned, cap_list=self.cap_list,
                                  sparse=self.sparse, alone=self._alone, own_cap=self.own_cap))

    def expect_rebuild(self) -> None:
        """Rebuild after all (static_graph turned on late): record the order from now on. No
        gradient is reduced in place any more: static_graph's used map may leave one untouched."""
        self.in_place = []
        if self._alone:
            self.build_initial(hooked=False)
        self.rebuilt, self.record = False, []

    def rebuild_order(self) -> list[int]:
        """The recorded order, each parameter where it first came (a pipeline stage may reduce twice
        before the forward that rebuilds); parameters that got no gradient go last, in registration
        order, as torch appends them."""
        recorded = list(dict.fromkeys(self.record or ()))
        seen = set(recorded)
        return recorded + [i for i in range(len(self.params)) if i not in seen]

    def rebuild(self, group: Any, hooked: bool) -> None:
        """Rebuild in rank 0's order, which every rank receives (a broadcast on every rank)."""
        # on the device the group reduces on: an NCCL-only group carries no CPU tensor
        # rank 0's own cap and in-place choice ride behind the order: the ranks' buckets must
        # match, their cores may not
        wanted = [self._own_cap_wanted, int(self._keep_in_place_wanted)]
        order = torch.tensor(self.rebuild_order() + wanted, dtype=torch.int64, device=comm_device(group))
        dist.broadcast(order, src=dist.get_global_rank(group, 0), group=group)
        *order, self.own_cap, keep_in_place = order.tolist()
        if not keep_in_place:
            self.in_place = []
        alone = [] if hooked else self.in_place
        groups = rebuilt_groups(self.params, order, self.cap, self.first_cap,
                                hooked=hooked or self.like_torch, cap_list=self.cap_list, sparse=self.sparse,
                                alone=alone, own_cap=self.own_cap)
        # in ddpkit's own layout, the same parameters in the same buckets: keeping them spares a
        # second set of gradients (with views, the old buckets hold them while they move); a hook
        # registered later still sees the new order. torch's layout (a hook, cap_list, like_torch)
        # is rebuilt as torch's. See Note [Gradient memory] in docs/design.md
        own_layout = not (hooked or self.like_torch or self.cap_list)
        if own_layout and alone == self._alone and self._same_buckets(groups):
            for bucket, group in zip(self.buckets, groups):
                if isinstance(bucket, Bucket):  # the others hold one parameter
                    bucket.list_in(group)
        else:
            self._alone = alone
            self.build(groups)
        self.rebuilt, self.record = True, None

    def _same_buckets(self, groups: list[list[int]]) -> bool:
        """Whether ``groups`` puts the same parameters in each bucket, in the same launch order."""
        return len(groups) == len(self.buckets) and all(
            sorted(g) == sorted(b.param_indices) for g, b in zip(groups, self.buckets))

    def build(self, groups: list[list[int]]) -> None:
        """(Re)create the buckets, in launch order; the last one carries the status flag."""
        params, last = self.params, len(groups) - 1
        self.buckets = []  # the old buffers go before the new ones are allocated, as in torch
        kinds = [SparseBucket if self.sparse and self.sparse[idx[0]] else
                 InPlaceBucket if self._alone and self._alone[idx[0]] and k != last else  # the last holds the flag
                 self.bucket_type for k, idx in enumerate(groups)]
        members = [[params[i] for i in idx] for idx in groups]
        memory = _one_block_per_device(kinds, members, self.one_block)
        self.buckets = [kind(k, members[k], idx, k == last, extra=int(k == last),
                             **({} if m is None else {"memory": m}))  # only a dense Bucket gets memory
                        for k, (kind, idx, m) in enumerate(zip(kinds, groups, memory))]
        self.bucket_of = [0] * len(params)
        for b in self.buckets:
            for i in b.param_indices:
                self.bucket_of[i] = b.index()
            if b.sparse:
                b.name = self.sparse_names[b.param_indices[0]]
        self.counts = [len(b.params) for b in self.buckets]
        # a big gradient is scaled into its slot by its own hook, while still in cache; with
        # gradient_as_bucket_view it is there already, or moves there. See Note [Big gradients]
        self.big_slot: list[torch.Tensor | None] = [None] * len(params)
        if self.as_view:  # gradients that exist move into the buckets, as torch does
            with torch.no_grad():
                for b in self.buckets:
                    for p, v in zip(b.params, b.views):
                        if p.grad is not None and p.grad is not v:
                            v.copy_(p.grad)
                            p.grad = v
        for b in self.buckets:  # with as_view, any gradient autograd allocated moves in by its hook
            for i, v in zip(b.param_indices if self.as_view else b.param_indices[: b.num_big], b.views):
                self.big_slot[i] = v

    def write_back(self, mask: Sequence[bool] | None, adopt: bool = False) -> None:
        """Put the averages where the gradients were; ``mask[i]`` False: leave parameter ``i`` alone.
        ``adopt``: big gradients keep them in their slots (Note [Averages in their slots])."""
        for bucket in self.buckets:
            with bucket_range(bucket, "write_back"):
                bucket.write_back(self.as_view, mask, adopt)

    def let_go_of_retired(self) -> None:
        """At a forward: free the memory big gradients had before they took their slots, where
        torch's ``zero_grad`` frees it at the latest (Note [Averages in their slots])."""
        for bucket in self.buckets:
            if isinstance(bucket, Bucket) and bucket.retired:
                bucket.retired = []

    def reclaim(self) -> None:
        """Before a backward writes into the buckets: one whose slot a kept gradient still holds
        gets new memory, and its big parameters' slots move with it."""
        for bucket in self.buckets:
            if isinstance(bucket, Bucket) and bucket.adopted and reclaim(bucket):
                for i, view in zip(bucket.param_indices[: bucket.num_big], bucket.views):
                    self.big_slot[i] = view

    def release(self) -> None:
        """Let go of the gradients written back, and of a hook's stand-in buffer (``set_buffer``,
        such as an fp16 copy): held until the next backward, they outlived
        ``zero_grad(set_to_none=True)``, a second set of gradients torch never keeps.
        See Note [Gradient memory] in docs/design.md."""
        for bucket in self.buckets:
            bucket.grads = []
            bucket.restore_buffer()


BLOCK_ALIGN_BYTES = 512
"""Where each bucket starts in a device's block: the CUDA allocator's own granularity, so that
kernels reading a bucket see memory as aligned as a block of its own."""


def _one_block_per_device(kinds: Sequence[type], groups: Sequence[Sequence[torch.Tensor]],
                          device_types: Sequence[str]) -> list[torch.Tensor | None]:
    """Per bucket, its memory in one block shared by every dense bucket of its device and dtype,
    where the device's type is one of ``device_types``, or None (a block of its own). The caching
    allocator rounds each new block up, by up to 1 MiB a block; one block pays that once. See
    Note [One block per device] in docs/design.md."""
    memory: list[torch.Tensor | None] = [None] * len(groups)
    shared: dict[tuple[torch.device, torch.dtype], list[tuple[int, int]]] = {}
    for k, (kind, params) in enumerate(zip(kinds, groups)):
        first = params[0]
        if issubclass(kind, Bucket) and first.device.type in device_types:
            numel = sum(p.numel() for p in params) + int(k == len(groups) - 1)  # the status flag
            shared.setdefault((first.device, first.dtype), []).append((k, numel))
    for (device, dtype), buckets in shared.items():
        if len(buckets) < 2:
            continue
        align = max(1, BLOCK_ALIGN_BYTES // dtype.itemsize)
        starts, end = [], 0
        for _, numel in buckets:
            starts.append(end)
            end += -(-numel // align) * align
        block = torch.empty(end, dtype=dtype, device=device)
        for (k, numel), start in zip(buckets, starts):
            memory[k] = block[start: start + numel]
    return memory
