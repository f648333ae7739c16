"""Copying one rank's parameters and buffers to every rank: at construction, before a forward
(buffers), and after join (the model of a rank that trained to the end)."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["broadcast_coalesced", "default_group"]

_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # torch's broadcast_bucket_size


def default_group() -> dist.ProcessGroup | None:
    """The group a ``process_group=None`` means: the default one, or None in a world of one."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast ``tensors`` from group rank ``src`` as a few flat tensors per (device, dtype)."""
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        chunks = groups.setdefault(key, [[]])
        if filled.get(key, 0) > _BROADCAST_CHUNK_BYTES:
            chunks.append([])
            filled[key] = 0
        chunks[-1].append(t)
        filled[key] = filled.get(key, 0) + t.numel() * t.element_size()
    receiving = dist.get_rank(group) != src
    with torch.no_grad():
        for chunks in groups.values():
            for chunk in chunks:
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
                if receiving:
                    views = torch.split(flat, [t.numel() for t in chunk])
                    torch._foreach_copy_(chunk, [v.view_as(t) for v, t in zip(views, chunk)])


