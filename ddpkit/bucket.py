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
memory), by its own hook as soon as it is ready; smaller ones are copied with one
``torch._foreach_copy_`` and scaled with one ``mul_`` over their shared region, since per-call
overhead would dominate (400 small tensors: 0.5 ms instead of 3)."""


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], cap_bytes: int,
                   first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes``, per device and dtype.

    Indices are taken in ``order`` (the order in which gradients are expected to become ready) and
    a bucket closes once it reaches its limit, so a tensor larger than the limit gets a bucket of
    its own. The first bucket of each device and dtype closes at ``first_cap_bytes`` instead
    (torch's small first bucket: the first all-reduce starts early). Buckets are returned in the
    order in which they are expected to fill.
    """
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict[tuple, tuple[list[int], int]] = {}  # (device, dtype) -> (indices, bytes)
    started: set[tuple] = set()
    buckets: list[list[int]] = []
    for index in order:
        p = params[index]
        key = (p.device, p.dtype)
        indices, size = open_buckets.pop(key, ([], 0))
        indices.append(index)
        size += p.numel() * p.element_size()
        if size >= (cap_bytes if key in started else first_cap_bytes):
            buckets.append(indices)
            started.add(key)
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
        # a comm hook sees the parameters in the order given (torch's), whatever the layout
        self._given_order = sorted(range(len(params)), key=lambda pos: layout[pos])
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
        """A bucket of the same layout holding zeros: what a joined rank contributes.

        Built from the parameters in the order given, so a comm hook sees them as on active ranks.
        """
        given = [self.param_indices[pos] for pos in self._given_order]
        return Bucket(self._index, self.parameters(), given, self._is_last,
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
        """The bucket's parameters as torch's GradBucket lists them: in registration order until
        the buckets are rebuilt after the first iteration, then in gradient-ready order."""
        return [self.params[pos] for pos in self._given_order]

    def gradients(self) -> list[torch.Tensor]:
        """Views of ``buffer()``, one per parameter, shaped like it, in ``parameters()``'s order."""
        return [self.views[pos] for pos in self._given_order]

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the bucket's contents with ``tensor`` (same number of elements)."""
        self._buffer.copy_(tensor.reshape(-1))

    def __repr__(self) -> str:
        return (f"Bucket(index={self._index}, params={len(self.params)}, numel={self.numel}, "
                f"dtype={self.flat.dtype}, device={self.flat.device})")
