"""Copying one rank's parameters and buffers to every rank: at construction, before a forward
(buffers), and after join (the model of a rank that trained to the end); and the construction-time
check that every rank holds the same tensors."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.ddp.arguments import first_difference
from ddpkit.ddp.autograd_engine import preserving_autograd_versions
from ddpkit.ddp.errors import (
    out_of_step_error,
    ranks_disagree_error,
    refused_elsewhere_error,
    reordered_warning,
    warn_at_user_code,
)
from ddpkit.errors import explain
from ddpkit.runtime import direct
from ddpkit.runtime.comm import broadcast_object, comm_device

__all__ = ["StateSyncSupport", "broadcast_coalesced", "default_group", "overlapping_state_error",
           "verify_same_tensors"]

_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # torch's broadcast_bucket_size


def default_group() -> dist.ProcessGroup | None:
    """The group a ``process_group=None`` means: the default one, or None in a world of one."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast ``tensors`` from group rank ``src`` as one flat byte tensor per device (per 250 MiB).

    Bytes, so that tensors of every dtype go in one collective: BatchNorm's float statistics and its
    int64 ``num_batches_tracked`` took two broadcasts, and each costs a round trip (convbn's 12
    buffers over Gloo: 380 microseconds as bytes, 620-670 in two flat tensors, torch's 530-590).
    Larger elements go first, so every tensor's offset in the flat bytes is a multiple of its
    element size, as a dtype view of them requires.
    """
    chunks: dict[torch.device, list[list[torch.Tensor]]] = {}
    filled: dict[torch.device, int] = {}
    for t in sorted(tensors, key=lambda t: -t.element_size()):
        per_device = chunks.setdefault(t.device, [[]])
        if filled.get(t.device, 0) > _BROADCAST_CHUNK_BYTES:
            per_device.append([])
            filled[t.device] = 0
        per_device[-1].append(t)
        filled[t.device] = filled.get(t.device, 0) + t.numel() * t.element_size()
    receiving = dist.get_rank(group) != src
    root = dist.get_global_rank(group, src)
    with torch.no_grad():
        for per_device in chunks.values():
            for chunk in per_device:
                # contiguous first: a strided 1-D tensor reshapes to itself, and its bytes cannot be viewed
                flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in chunk])
                direct.broadcast(flat, root, group)
                if receiving:
                    views = torch.split(flat, [t.numel() * t.element_size() for t in chunk])
                    torch._foreach_copy_(chunk, [v.view(t.dtype).view(t.shape) for v, t in zip(views, chunk)])


def verify_same_tensors(states: Iterable[tuple[str, torch.Tensor]], local_error: Exception | None,
                        group, rank: int, world_size: int) -> None:
    """Raise on every rank, naming the first difference, unless all ranks hold the same tensors.

    Rank 0's list is broadcast and every rank compares its own with it; one all-reduce then tells
    every rank the first rank that differs, whose words follow on that path only. Gathering every
    rank's list instead cost each rank ``world_size`` lists, and a first use of Gloo's all_gather
    (1.2 MB of resident memory at construction on a 400-parameter model, where torch's check
    broadcasts too). A rank whose own arguments were refused (``local_error``) says so through the
    same all-reduce, so that the others raise too instead of waiting for it; it returns, and its
    caller raises its own error.
    """
    mine = None if local_error is not None else [
        (n, tuple(t.shape), str(t.dtype).replace("torch.", ""),
         t.requires_grad if isinstance(t, nn.Parameter) else None,  # None: a buffer
         _layout(t) if isinstance(t, nn.Parameter) else None)
        for n, t in states]
    reference = broadcast_object(mine, src=dist.get_global_rank(group, 0), group=group)
    if reference is not None and not (isinstance(reference, list) and all(
            isinstance(entry, tuple) and len(entry) == 5 for entry in reference)):
        raise out_of_step_error(rank, reference)  # another collective's object: nothing to compare
    difference = None if mine is None or reference is None else first_difference(reference, mine, rank)
    first = torch.tensor([world_size if local_error is None else rank, world_size if difference is None else rank],
                         dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    refused, differing = first.tolist()
    if refused < world_size:  # the first rank that refused its arguments says why
        said = f"{type(local_error).__name__}: {local_error}" if rank == refused else None
        said = broadcast_object(said, src=dist.get_global_rank(group, refused), group=group)
        if local_error is None:
            raise refused_elsewhere_error(rank, refused, said)
    elif differing < world_size:
        said = broadcast_object(difference, src=dist.get_global_rank(group, differing), group=group)
        raise ranks_disagree_error(rank, differing, said)
    elif mine is not None and reference is not None:
        _warn_if_reordered(reference, mine, rank)


def _warn_if_reordered(reference: list[tuple], mine: list[tuple], rank: int) -> None:
    """Names are not compared (a rank may wrap the model in another container), but rank 0's very
    names in another order mean two parameters of equal shapes averaged together: warned."""
    names, theirs = [entry[0] for entry in mine], [entry[0] for entry in reference]
    if names == theirs or sorted(names) != sorted(theirs):
        return
    i = next(i for i, (a, b) in enumerate(zip(names, theirs)) if a != b)
    warn_at_user_code(reordered_warning(rank, i, names[i], theirs[i], mine[i][1]))


def _layout(t: torch.Tensor) -> tuple[int | None, ...] | None:
    """A dense tensor's strides, None for its size-1 dimensions (they place nothing)."""
    if t.layout != torch.strided:
        return None
    return tuple(stride if size > 1 else None for stride, size in zip(t.stride(), t.shape))


def overlapping_state_error(states: Iterable[tuple[str, torch.Tensor]], rank: int) -> RuntimeError | None:
    """The error for a tensor that a broadcast cannot write into (an ``expand``-ed buffer, whose
    elements share memory), or None. Raised on every rank: torch's copy fails on the receiving ranks
    only, and the source rank went on alone."""
    for name, t in states:
        if t.layout == torch.strided and torch._debug_has_internal_overlap(t) == 1:
            return RuntimeError(explain(
                "unsupported operation: more than one element of the written-to tensor refers to a single "
                f"memory location. DistributedDataParallel copies rank 0's {name!r} into every rank's, but "
                f"its elements share memory (shape {list(t.shape)}, strides {list(t.stride())}, an expand()ed "
                f"tensor) (this is rank {rank}).",
                f"register a tensor of its own: {name!r} = tensor.clone(), or leave it out of the "
                "broadcast with broadcast_buffers=False."))
    return None


class StateSyncSupport:
    """The state half of DistributedDataParallel: which parameters and buffers it keeps equal across
    ranks (all but ``parameters_to_ignore``), copied from one rank at construction and after join,
    the buffers before a forward as torch decides. (DistributedDataParallel and JoinSupport supply
    what these read.)"""

    def _states(self, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
        ignore = self.parameters_to_ignore
        yield from ((n, p) for n, p in self.module.named_parameters() if n not in ignore)
        if buffers:
            yield from ((n, b) for n, b in self.module.named_buffers() if n not in ignore)

    def _synced_buffers(self) -> list[torch.Tensor]:
        if not self.parameters_to_ignore:
            return list(self.module.buffers())
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _broadcast_states(self, src: int, buffers: bool) -> None:
        """Copy rank ``src``'s parameters (and buffers) to every rank, coalesced."""
        broadcast_coalesced([t for _, t in self._states(buffers)], src, self.process_group)

    def _will_sync_buffers(self) -> bool:
        """torch's rule: before a forward that follows a synced one, when there are buffers."""
        return self.require_forward_param_sync and self.forward_sync_buffers and self._has_buffers

    def _sync_buffers(self, active: bool = True) -> None:
        """Broadcast buffers from rank 0, or under join from the highest rank still active.

        Read afresh each time, as torch does: a module may replace a buffer out of place (an
        exponential moving average written ``self.avg = ...``); that walk of the module tree is the
        price of it for models with buffers. The copy keeps the buffers' autograd versions, as
        torch's does: a graph of an earlier forward of this iteration may have saved them.
        """
        src = self._find_common_rank(self.rank, active) if self._join_config.enable else 0
        buffers = self._synced_buffers()
        with preserving_autograd_versions(buffers):
            broadcast_coalesced(buffers, src, self.process_group)
