"""``backward(create_graph=True)`` under DDP: averaged values, and this rank's share of the graph.

The gradients such a backward leaves carry a graph, for a second derivative (a gradient penalty
taken through ``.grad``). The all-reduce has no derivative, so what DDP can give is torch's reducer's
own answer where it has one: ``.grad`` holds the average over ranks, and its graph is the local
gradient's times what the reducer multiplied it by (1 / world size; 1 with a comm hook, which
averages). torch gets there only for a bucket of one parameter, and refuses any other bucket (an
in-place copy into the bucket); see Note [create_graph] in docs/design.md.

The reducer holds such a backward's hooks (nothing launches while gradients carry graphs), sets the
graph-carrying gradients aside here, reduces detached copies as usual, and joins each average to its
gradient's graph at the end.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["set_aside", "join_graphs"]


class _Averaged(torch.autograd.Function):
    """The averaged values, differentiating as ``scale`` times the local gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, averaged: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return averaged.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.scale, None, None


def set_aside(params: Sequence[torch.Tensor], indices: Sequence[int]) -> dict[int, torch.Tensor]:
    """Take the gradients among ``indices`` that carry a graph out of ``.grad``, leaving detached
    copies to reduce (the copies are written in place; the graph must not see that)."""
    carried: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for i in indices:
            grad = params[i].grad
            if grad is not None and grad.requires_grad:
                carried[i] = grad
                params[i].grad = grad.detach().clone(memory_format=torch.preserve_format)
    return carried


def join_graphs(params: Sequence[torch.Tensor], carried: dict[int, torch.Tensor], scale: float) -> None:
    """Each set-aside parameter's ``.grad`` becomes its average, carrying ``scale`` times the graph
    of the local gradient."""
    with torch.enable_grad():
        for i, local in carried.items():
            averaged = params[i].grad
            if averaged is not None:
                params[i].grad = _Averaged.apply(local, averaged, scale)
