"""A big gradient reduced where it lies: its own collective on ``.grad``, no copy in or out.

On CPU a bucket costs each gradient two passes over memory (scaled into the bucket, copied back),
as torch's reducer does; for a gradient of megabytes those passes cost more than a collective of
its own. ``InPlaceBucket`` scales the gradient in place and hands that very tensor to the
all-reduce, so the average is in ``.grad`` when the collective ends. See Note [Big gradients in
place] in docs/design.md for when the layout gives one (and when it must not).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ddpkit.ddp.autograd_engine import without_grad
from ddpkit.ddp.bucket import Bucket, GradBucketBasics, factor

__all__ = ["InPlaceBucket", "IN_PLACE_BYTES"]

IN_PLACE_BYTES = 2 * 1024 * 1024
"""The default ``in_place_bytes``: a CPU gradient of this size or more is reduced where it lies
(without a comm hook, ``gradient_as_bucket_view``, ``find_unused_parameters`` or ``static_graph``),
after the rebuild only where ``cpu_share.in_place_pays`` says so on rank 0."""


class InPlaceBucket(GradBucketBasics):
    """The bucket of one big dense gradient: ``flat`` is the gradient itself while it is reduced.

    Takes the arguments of ``Bucket`` so that a layout builds either; never the last bucket (that
    one carries the status flag, see Note [Errors on every rank])."""

    sparse = False
    num_big = 0  # no slot: the gradient is not copied anywhere by its own hook
    views: list[torch.Tensor] = []  # no view of a flat buffer (never with gradient_as_bucket_view)

    def __init__(self, index: int, params: list[torch.nn.Parameter], param_indices: list[int],
                 is_last: bool, extra: int = 0):
        if len(params) != 1 or extra:
            raise ValueError(f"an InPlaceBucket holds one parameter and no flag, got {len(params)} "
                             f"and extra={extra}.")
        self._index, self._is_last = index, is_last
        self.params, self.param_indices = list(params), list(param_indices)
        param = params[0]
        self.numel = param.numel()
        # between iterations: an empty tensor, which says the gradients' dtype to the profiler
        self._idle = torch.empty(0, dtype=param.dtype, device=param.device)
        self.flat = self._buffer = self._idle
        self.flag = None
        self._data: torch.Tensor | None = None  # what is reduced: the gradient, or a stand-in
        self.grads: list[torch.Tensor | None] = []
        self.has_none = False

    def fill(self, scale: float | None, as_view: bool, copied: Sequence[bool]) -> None:
        """Multiply the gradient in place by ``scale`` (None: leave it); a missing one counts as
        zeros, and a non-contiguous one goes through a contiguous copy."""
        param = self.params[0]
        grad = param.grad
        self.grads = [grad]
        self.has_none = grad is None
        with without_grad():
            if grad is None:
                data = torch.zeros_like(param, memory_format=torch.contiguous_format)
            else:
                data = grad if grad.is_contiguous() else grad.contiguous()
                if scale is not None:
                    data.mul_(factor(scale))
        self._data = data
        self.flat = self._buffer = data.view(-1)

    def write_back(self, as_view: bool, mask: Sequence[bool] | None, adopt: bool = False) -> None:
        """The average is in the gradient already; a rank that had none gets it (unless ``mask``
        says no rank used the parameter), and a non-contiguous gradient gets it copied back.
        ``adopt``: nothing to do, the average is in the gradient's own memory."""
        grad, data = self.grads[0], self._data
        if grad is None:
            if mask is None or mask[self.param_indices[0]]:
                self.params[0].grad = data
        elif data is not grad:
            with without_grad():
                grad.copy_(data)

    def zeros_like(self) -> Bucket:
        """What a joined rank contributes: zeros, in one collective of the same size."""
        zeros = Bucket(self._index, self.params, self.param_indices, self._is_last)
        zeros.flat.zero_()
        return zeros

    # ---- torch's GradBucket interface (a comm hook never sees this bucket: its layout is torch's) ----
    def parameters(self) -> list[torch.Tensor]:
        return list(self.params)

    def gradients(self) -> list[torch.Tensor]:
        return [] if self._data is None else [self._data]

    def restore_buffer(self) -> None:
        """Let go of the gradient at the end of the iteration (zero_grad may free it)."""
        self._data = None
        self.flat = self._buffer = self._idle

    def take_result(self, result: torch.Tensor, hook_name: str, rank: int) -> None:
        if result is not self.flat:
            self.flat.copy_(result.reshape(-1))

    def __repr__(self) -> str:
        return (f"InPlaceBucket(index={self._index}, param={self.param_indices[0]}, "
                f"shape={list(self.params[0].shape)}, dtype={self._idle.dtype})")
