"""Gradient buckets: which parameters share one flat buffer, and the buffer itself.

A ``Bucket`` is what one all-reduce moves. It is also the object a comm hook receives, so it keeps
torch's ``GradBucket`` methods: ``buffer()``, ``index()``, ``parameters()``, ``gradients()``,
``is_last()`` and ``set_buffer()``.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["Bucket", "assign_buckets", "DEFAULT_FIRST_BUCKET_BYTES", "BIG_PARAM_NUMEL"]

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: a small first bucket starts the first all-reduce early."""

BIG_PARAM_NUMEL = 16384
"""From this size on a gradient is scaled into its slot with one ``torch.mul(out=)`` (one pass over
memory); smaller ones are copied with one ``torch._foreach_copy_`` and scaled with one ``mul_`` over
their shared region, since per-call overhead would dominate (400 small tensors: 0.5 ms instead of 3)."""


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], cap_bytes: int,
                   first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes`` (per device and dtype).

    Indices are taken in ``order`` (the expected order in which gradients become ready), so the
    first bucket fills with the first gradients. The first bucket of each (device, dtype) is capped
    at ``first_cap_bytes`` instead, as torch does. A bucket closes once it reaches its cap, so one
    tensor larger than the cap gets a bucket of its own. Buckets are returned in the order of their
    first index in ``order``: the order in which they are expected to fill.
    """
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict[tuple, tuple[list[int], int]] = {}
    closed_count: dict[tuple, int] = {}
    buckets: list[list[int]] = []
    for index in order:
        p = params[index]
        key = (p.device, p.dtype)
        indices, size = open_buckets.get(key, ([], 0))
        indices.append(index)
        size += p.numel() * p.element_size()
        limit = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if size >= limit:
            buckets.append(indices)
            closed_count[key] = closed_count.get(key, 0) + 1
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (indices, size)
    buckets.extend(indices for indices, _ in open_buckets.values())
    buckets.sort(key=lambda indices: position[indices[0]])
    return buckets


class Bucket:
    """One flat gradient buffer, its parameters, and a view of the buffer shaped like each one.

    ``extra`` trailing elements (outside ``buffer()``) ride along with the all-reduce; the reducer
    uses one as a status flag so that an error on one rank reaches every rank at no extra cost.
    """

    def __init__(self, index: int, params: list[torch.nn.Parameter], param_indices: list[int],
                 is_last: bool, extra: int = 0):
        self._index = index
        self._is_last = is_last
        # big tensors first: the small ones then share one region, scaled with a single mul_
        layout = sorted(range(len(params)), key=lambda k: params[k].numel() < BIG_PARAM_NUMEL)
        self.params = [params[k] for k in layout]
        self.param_indices = [param_indices[k] for k in layout]
        params = self.params
        self.numel = sum(p.numel() for p in params)
        first = params[0]
        self.flat = torch.zeros(self.numel + extra, dtype=first.dtype, device=first.device)
        self._buffer = self.flat[: self.numel] if extra else self.flat
        self.flag = self.flat[self.numel:] if extra else None
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self._buffer[offset: offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.num_big = sum(p.numel() >= BIG_PARAM_NUMEL for p in params)
        self.small_region = self._buffer[sum(p.numel() for p in params[: self.num_big]):]
        self.grads: list[torch.Tensor | None] = []  # what was copied in: where the averages go back
        self.has_none = False

    def zeros_like(self) -> Bucket:
        """A bucket of the same layout holding zeros: what a joined rank contributes."""
        return Bucket(self._index, list(self.params), list(self.param_indices), self._is_last,
                      extra=self.flat.numel() - self.numel)

    # ---- torch's GradBucket interface, for comm hooks ----
    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket (what an all-reduce must reduce)."""
        return self._buffer

    def index(self) -> int:
        """Position of this bucket in the launch order; 0 is launched first."""
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        return list(self.params)

    def gradients(self) -> list[torch.Tensor]:
        """Views of ``buffer()``, one per parameter, shaped like it."""
        return list(self.views)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the bucket's contents with ``tensor`` (same number of elements)."""
        self._buffer.copy_(tensor.reshape(-1))

    def __repr__(self) -> str:
        return (f"Bucket(index={self._index}, params={len(self.params)}, numel={self.numel}, "
                f"dtype={self.flat.dtype}, device={self.flat.device})")
