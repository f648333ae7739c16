"""Averages left where the bucket put them: a big gradient takes its bucket slot as its memory.

Without ``gradient_as_bucket_view``, torch's reducer copies each average from the bucket back into
``.grad``: a second pass over every gradient. Where ``.grad`` is a tensor no one else can see into
(its storage is its own), ddpkit instead points that very tensor at its slot (``Tensor.set_``): the
same object, holding the same averages, with no copy. A gradient the caller kept from an earlier
iteration may still lie in a slot; before a backward writes into a bucket, ``reclaim`` finds such
a gradient and gives the bucket new memory, so that what the caller holds never changes.
See Note [Averages in their slots] in docs/design.md.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ddpkit.ddp.autograd_engine import without_grad

if TYPE_CHECKING:
    from ddpkit.ddp.bucket import Bucket

__all__ = ["AVAILABLE", "storage_refs", "adopt_slots", "reclaim", "let_go_of_replaced",
           "let_go_of_replaced_at_fill"]

_use_count = getattr(torch._C, "_storage_Use_Count", None)
AVAILABLE = _use_count is not None
"""Whether this torch can count what holds a storage; without it the averages are copied back."""


def storage_refs(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold ``tensor``'s memory, counting this call's own."""
    return _use_count(tensor.untyped_storage()._cdata) if AVAILABLE else 0


def adopt_slots(bucket: Bucket) -> None:
    """Leave the averages of the bucket's big gradients in their slots: each ``.grad`` that only
    itself holds its memory is pointed at its slot; any other gets the average copied in."""
    grads, views = bucket.grads, bucket.views
    with without_grad():
        for k in range(bucket.num_big):
            grad, slot = grads[k], views[k]
            if grad.data_ptr() == slot.data_ptr():  # it lies there already (zero_grad(set_to_none=False))
                continue
            # 2: the gradient and the storage object asked; strides kept, and no graph around it
            if storage_refs(grad) == 2 and grad.stride() == slot.stride() and not grad.requires_grad:
                # its old memory is let go at the next forward, where zero_grad would have freed it
                bucket.retired.append(grad.untyped_storage())
                grad.set_(slot)
                bucket.adopted.append((k, weakref.ref(grad)))
            else:  # a view, or viewed: whoever shares its memory sees the average there, as with torch
                grad.copy_(slot)


def reclaim(bucket: Bucket) -> bool:
    """Before a backward writes into ``bucket``: True if it took new memory because something
    other than its parameters' current ``.grad`` still holds a slot (a gradient kept after
    ``zero_grad``, or a view of one)."""
    if not bucket.adopted:
        return False
    kept = []
    for k, ref in bucket.adopted:
        grad = ref()
        # still the gradient, in its slot: backward accumulates there (zero_grad(set_to_none=False));
        # one freed by zero_grad, or moved away by its owner, is forgotten; one kept by the caller
        # after its parameter moved on counts against the bucket's memory, as does any view of one
        if grad is not None and grad is bucket.params[k].grad and grad.data_ptr() == bucket.views[k].data_ptr():
            kept.append((k, ref))
    bucket.adopted = kept
    if storage_refs(bucket.flat) != bucket.own_refs + len(kept):
        bucket.allocate()
        bucket.adopted = []
        return True
    return False


def let_go_of_replaced(bucket: Bucket, k: int, grad: torch.Tensor | None) -> None:
    """Before ``grad``, which is not in slot ``k`` (or None: zeros), is written there: the gradient
    that held the slot (``zero_grad(set_to_none=False)`` left it there) was replaced during this
    backward, by a hook of the caller's (``p.grad = p.grad * 2``, or None). If the caller still
    holds it, it takes memory of its own with its values, which with torch, where it never was the
    bucket's, stay as backward left them."""
    for j, (pos, ref) in enumerate(bucket.adopted):
        if pos == k:
            old = ref()
            if old is not None and old is not grad and old.data_ptr() == bucket.views[k].data_ptr():
                with torch.no_grad():
                    old.set_(old.clone())
            del bucket.adopted[j]
            return


def let_go_of_replaced_at_fill(bucket: Bucket, grads: list, copied) -> None:
    """``let_go_of_replaced`` for the big gradients that the bucket's fill writes, where their
    hooks did not: copied in under join (whose divisor is known only at the launch), or zeroed for
    a gradient the caller's hook set to None."""
    for k, _ in list(bucket.adopted):
        grad = grads[k]
        if grad is None or (not copied[bucket.param_indices[k]] and grad.data_ptr() != bucket.views[k].data_ptr()):
            let_go_of_replaced(bucket, k, grad)
