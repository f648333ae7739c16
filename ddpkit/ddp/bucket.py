"""Gradient buckets: which parameters share one flat buffer, and the buffer itself.

A ``Bucket`` is what one all-reduce moves. It is also the object a comm hook receives, so it keeps
torch's ``GradBucket`` methods: ``buffer()``, ``index()``, ``parameters()``, ``gradients()``,
``is_last()`` and ``set_buffer()``.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from ddpkit.ddp.adoption import adopt_slots, let_go_of_replaced_at_fill, storage_refs
from ddpkit.ddp.autograd_engine import without_grad
from ddpkit.errors import CommHookError, explain

__all__ = ["Bucket", "GradBucketBasics", "factor", "copy_in", "move_in", "DEFAULT_FIRST_BUCKET_BYTES",
           "BIG_PARAM_NUMEL", "is_big"]

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: a small first bucket starts the first all-reduce early."""

BIG_PARAM_NUMEL = 65536
"""From this size on a CPU gradient (``is_big``) is scaled into its slot with one ``torch.mul(out=)``
(one pass over memory), by its own hook as soon as it is ready; smaller ones are copied with one
``torch._foreach_copy_`` and scaled with one ``mul_`` over their shared region, since per-call
overhead would dominate. ``ddpkit bench --tables big`` measures where the two cross; see Note [Big
gradients] in docs/design.md."""


def is_big(param: torch.Tensor, numel: int = BIG_PARAM_NUMEL) -> bool:
    """Whether ``param``'s gradient goes into its slot by its own hook: a CPU one of ``numel``
    elements or more. On a GPU each such copy would be a kernel launch on backward's thread, which
    holds back the next one; there every gradient waits for its bucket's one ``_foreach_copy_`` (with
    ``gradient_as_bucket_view``, a fresh one still moves into its view by its hook, as in torch)."""
    return param.device.type == "cpu" and param.numel() >= numel


@functools.lru_cache(maxsize=64)
def factor(scale: float) -> torch.Tensor:
    """``scale`` as a 0-dim float64 CPU tensor, made once. A kernel reads it as the very scalar it
    makes of a Python float (the same bits for every dtype), but a float is wrapped in a new tensor
    at every call: in a backward hook that cost 7 us a gradient (17 against 10 us for 64 KiB)."""
    return torch.tensor(scale, dtype=torch.float64, device="cpu")  # whatever the default device


def copy_in(grad: torch.Tensor, slot: torch.Tensor, scale: float | None) -> None:
    """One pass over a big gradient: multiplied by ``scale`` into its slot, or copied (None)."""
    with without_grad():
        if scale is None:
            slot.copy_(grad)
        else:
            torch.mul(grad, factor(scale), out=slot)


def move_in(param: torch.Tensor, grad: torch.Tensor, slot: torch.Tensor, scale: float | None = None) -> None:
    """``gradient_as_bucket_view``: a gradient autograd allocated is copied into its slot, which
    becomes ``param.grad``, as soon as it is ready, as torch's reducer does; held until the bucket
    launched, the fresh gradients and the buckets were both alive, one gradient set more at the peak.
    ``scale``: a big gradient is multiplied by it on the way, in the same pass (or in its slot)."""
    with without_grad():
        if grad is slot:
            if scale is not None:
                slot.mul_(factor(scale))
            return
        copy_in(grad, slot, scale)
    param.grad = slot


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides if its elements fill one block without gaps (any order of dimensions, such
    as channels_last), else the contiguous ones."""
    expected = 1
    for d in sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=t.stride):
        if t.stride(d) != expected:
            return torch.empty(t.shape, device="meta").stride()
        expected *= t.shape[d]
    return t.stride()


class GradBucketBasics:
    """What every bucket shows a comm hook as torch's ``GradBucket`` does, whatever it holds."""

    _index: int
    _is_last: bool
    _buffer: torch.Tensor | None

    def buffer(self) -> torch.Tensor:
        """What the collective must reduce: the flat gradients (or a sparse bucket's gradient)."""
        return self._buffer

    def index(self) -> int:
        """Position of this bucket in the launch order; 0 is launched first."""
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` what ``buffer()`` returns, as torch's does (torch's fp16_compress_wrapper
        swaps in a half-precision copy this way, so that the hook it wraps sends half the bytes)."""
        self._buffer = tensor


class Bucket(GradBucketBasics):
    """One flat gradient buffer, its parameters, and a view of the buffer shaped like each one.

    ``extra`` trailing elements (outside ``buffer()``) ride along with the all-reduce; the reducer
    uses one as a status flag so that an error on one rank reaches every rank at no extra cost.
    """

    sparse = False  # a SparseBucket (ddpkit.ddp.sparse_bucket) is launched its own way
    big_numel = BIG_PARAM_NUMEL  # ``is_big``'s threshold (``ddpkit bench --tables big`` moves it)

    def __init__(self, index: int, params: list[torch.nn.Parameter], param_indices: list[int],
                 is_last: bool, extra: int = 0, memory: torch.Tensor | None = None):
        self._index = index
        self._is_last = is_last
        # big tensors first: the small ones then share one region, scaled with a single mul_
        big = [is_big(p, self.big_numel) for p in params]
        layout = sorted(range(len(params)), key=lambda k: not big[k])
        # a comm hook sees the parameters in the order given (torch's), whatever the layout
        self._given_order = sorted(range(len(params)), key=lambda pos: layout[pos])
        self.params = [params[k] for k in layout]
        self.param_indices = [param_indices[k] for k in layout]
        self.numel = sum(p.numel() for p in self.params)
        self.extra = extra
        self.num_big = sum(big)
        # big gradients left in their slots after an iteration: (position, weakref to the gradient)
        self.adopted: list[tuple[int, Any]] = []
        self.retired: list[Any] = []  # their old memory, until the next forward (Note [Averages in their slots])
        self.allocate(memory)
        self.grads: list[torch.Tensor | None] = []  # what was copied in: where the averages go back
        self.has_none = False

    def allocate(self, memory: torch.Tensor | None = None) -> None:
        """The buffer, and the views into it: at construction, and again where a slot is still held
        by a gradient the caller kept (see ``ddpkit.ddp.adoption.reclaim``). ``memory``: a flat
        tensor of ``numel + extra`` elements to use instead of a new one (Note [One block per device])."""
        params, extra = self.params, self.extra
        first = params[0]
        # empty, as torch's: pages are touched when the gradients first come in, not at construction
        self.flat = (torch.empty(self.numel + extra, dtype=first.dtype, device=first.device) if memory is None
                     else memory)
        # the bucket's own gradients, which the views point into; a comm hook may hand the
        # collective another buffer (set_buffer), whose result is copied back here
        self.grad_data = self.flat[: self.numel] if extra else self.flat
        # what a hook sees: complex gradients as real numbers, twice as many, as torch shows them
        self._hook_data = (torch.view_as_real(self.grad_data).view(-1) if self.grad_data.is_complex()
                           else self.grad_data)
        self._buffer = self._hook_data
        self.flag = self.flat[self.numel:].zero_() if extra else None
        self.views: list[torch.Tensor] = []
        offset = self.grad_data.storage_offset()  # as_strided counts from the start of the storage
        for p in params:
            # shaped and strided like the parameter (a channels_last weight keeps its layout), as
            # torch's bucket views are: with gradient_as_bucket_view they become the gradients
            self.views.append(self.grad_data.as_strided(p.shape, _dense_strides(p), offset))
            offset += p.numel()
        self.small_region = self.grad_data[sum(p.numel() for p in params[: self.num_big]):]
        self.own_refs = storage_refs(self.flat)  # the bucket's own tensors on its memory

    def fill(self, scale: float | None, as_view: bool, copied: Sequence[bool]) -> None:
        """Put the parameters' gradients into the buffer, multiplied by ``scale`` (None: as they are).

        ``copied[i]``: parameter ``i``'s big gradient is already in its slot. A missing gradient
        counts as zeros. With ``as_view`` each gradient becomes its view of the buffer.
        """
        grads = self.grads = [p.grad for p in self.params]
        views, num_big, indices = self.views, self.num_big, self.param_indices
        self.has_none = any(g is None for g in grads)
        if self.adopted:
            let_go_of_replaced_at_fill(self, grads, copied)
        with without_grad():
            if scale is not None and not as_view and not self.has_none:  # the common case
                for k in range(num_big):
                    if not copied[indices[k]]:
                        copy_in(grads[k], views[k], scale)
                if num_big < len(grads):
                    torch._foreach_copy_(views[num_big:], grads[num_big:])
                    self.small_region.mul_(factor(scale))
                return
            copy_src, copy_dst = [], []
            for k, (g, v) in enumerate(zip(grads, views)):
                if k < num_big and copied[indices[k]]:
                    continue
                if g is v:  # gradient_as_bucket_view: already in place
                    if k < num_big and scale is not None:
                        v.mul_(factor(scale))
                elif g is None:
                    v.zero_()
                elif k < num_big:
                    copy_in(g, v, scale)
                else:
                    copy_src.append(g)
                    copy_dst.append(v)
            if copy_dst:
                torch._foreach_copy_(copy_dst, copy_src)
            if scale is not None and self.small_region.numel():
                self.small_region.mul_(factor(scale))
        if as_view:
            for p, g, v in zip(self.params, grads, views):
                if g is not None and g is not v:
                    p.grad = v
            # what write_back needs: which were missing; the fresh gradients themselves can go now
            self.grads = [None if g is None else v for g, v in zip(grads, views)]

    def write_back(self, as_view: bool, mask: Sequence[bool] | None, adopt: bool = False) -> None:
        """Put the averages where the gradients were; ``mask[i]`` False: leave parameter ``i`` alone.
        ``adopt``: big gradients take their slots as their memory instead (Note [Averages in their
        slots]; never where ``mask`` may leave a gradient alone)."""
        if mask is None and not self.has_none:
            if not as_view:
                start = 0
                if adopt:
                    adopt_slots(self)
                    start = self.num_big
                if start < len(self.grads):
                    torch._foreach_copy_(self.grads[start:], self.views[start:])
            return
        for i, p, g, v in zip(self.param_indices, self.params, self.grads, self.views):
            if mask is not None and not mask[i]:
                continue
            if g is None:
                p.grad = v if as_view else v.clone()
            elif not as_view:
                g.copy_(v)

    def zeros_like(self) -> Bucket:
        """A bucket of the same layout holding zeros: what a joined rank contributes.

        Built from the parameters in the order given, so a comm hook sees them as on active ranks.
        """
        given = [self.param_indices[pos] for pos in self._given_order]
        zeros = Bucket(self._index, self.parameters(), given, self._is_last, extra=self.flat.numel() - self.numel)
        zeros.flat.zero_()
        return zeros

    # ---- torch's GradBucket interface, for comm hooks ----
    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters as torch's GradBucket lists them: in registration order until
        the buckets are rebuilt after the first iteration, then in gradient-ready order."""
        return [self.params[pos] for pos in self._given_order]

    def gradients(self) -> list[torch.Tensor]:
        """Views of ``buffer()``, one per parameter, shaped like it, in ``parameters()``'s order: of
        the buffer a hook set with ``set_buffer`` too, as torch's (``fp16_compress_wrapper`` around
        PowerSGD hands it half-precision gradients this way)."""
        views = self.views if self._buffer is self._hook_data else self._views_of(self._buffer)
        return [views[pos] for pos in self._given_order]

    def _views_of(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of a buffer laid out as this bucket's (a complex gradient's as its
        real pairs, where the buffer holds twice the elements)."""
        pairs = buffer.dim() == 1 and self.grad_data.is_complex() and buffer.numel() == 2 * self.numel
        if not buffer.is_contiguous() or (not pairs and (buffer.dim() != 1 or buffer.numel() != self.numel)):
            from ddpkit.runtime.process_group import get_rank

            raise CommHookError(explain(
                f"bucket.gradients() of bucket {self._index}: the buffer given to set_buffer() has shape "
                f"{list(buffer.shape)} and strides {list(buffer.stride())}, but the bucket's gradients are "
                f"{self.numel} contiguous elements in one dimension.", "set a buffer of the same size as "
                "bucket.buffer(), such as a copy of it in another dtype."), rank=get_rank(), hook="set_buffer")
        views, offset, width = [], 0, 2 if pairs else 1
        for p in self.params:
            # laid out as the bucket's own views are (a channels_last weight keeps its layout)
            strides = tuple(width * s for s in _dense_strides(p)) + ((1,) if pairs else ())
            views.append(buffer.as_strided((*p.shape, 2) if pairs else p.shape, strides,
                                           buffer.storage_offset() + width * offset))
            offset += p.numel()
        return views

    def list_in(self, order: Sequence[int]) -> None:
        """List ``parameters()`` and ``gradients()`` in ``order`` (this bucket's parameter indices,
        as a rebuild that keeps the bucket gives them); the memory layout stays."""
        position = {index: pos for pos, index in enumerate(self.param_indices)}
        self._given_order = [position[index] for index in order]

    def restore_buffer(self) -> None:
        """``buffer()`` is the bucket's own gradients again (after a hook swapped in another)."""
        self._buffer = self._hook_data

    def take_result(self, result: torch.Tensor, hook_name: str, rank: int) -> None:
        """Copy a comm hook's result into the bucket's gradients, unless it already is them."""
        own = self._hook_data
        if result is own:
            return
        if not isinstance(result, torch.Tensor) or result.numel() != own.numel():
            listed = isinstance(result, (list, tuple))  # work.get_future()'s own value: torch refuses it too
            got = (f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor) else
                   f"a {type(result).__name__} of {len(result)}, not a tensor (torch's DDP refuses it too: "
                   "\"expected the hook result is a PyObject\")" if listed else type(result).__name__)
            raise CommHookError(explain(
                f"the future of comm hook {hook_name} for bucket {self._index} holds {got}, but the bucket "
                f"has {own.numel()} elements.", ("return dist.all_reduce(...).get_future().then(lambda fut: "
                "fut.value()[0])" if listed else "complete the future with the reduced bucket.buffer() (a "
                "tensor of the same size)") + ", as ddpkit.hooks.allreduce_hook does."), rank=rank, hook=hook_name)
        own.copy_(result.reshape(-1))

    def __repr__(self) -> str:
        return (f"Bucket(index={self._index}, params={len(self.params)}, numel={self.numel}, "
                f"dtype={self.flat.dtype}, device={self.flat.device})")
