"""The errors of DistributedDataParallel's backward pass: each names the parameter, the rank and the fix.

torch's own reducer reports parameter indices unless a debug variable is set; these messages are
built from the qualified names the reducer keeps, and are the same on every rank where they must be.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["late_gradient_error", "second_gradient_error", "unused_gradient_error"]


def late_gradient_error(rank: int, name: str) -> RuntimeError:
    """A gradient arrived after its iteration was averaged: a second backward through one graph."""
    return RuntimeError(
        f"DistributedDataParallel on rank {rank}: a gradient for '{name}' "
        "arrived after this iteration's gradients were already averaged: backward() ran twice "
        "through one forward's graph, or through the graph of an earlier iteration. HINT: call "
        "forward() through the DDP model again before each backward().")


def second_gradient_error(rank: int, name: str, used: bool) -> RuntimeError:
    """A parameter's hook fired twice in one backward, or for a parameter reduced as unused."""
    prefix = f"DistributedDataParallel on rank {rank}: parameter '{name}' received"
    if not used:
        return RuntimeError(
            f"{prefix} a gradient, but the forward's output has no autograd path to it, so it was "
            "already reduced as unused. HINT: return every tensor the loss is computed from in "
            "the module's output.")
    return RuntimeError(
        f"{prefix} its gradient twice in one backward pass (reentrant checkpointing, or a parameter "
        "shared with a module outside this DDP). HINT: use non-reentrant checkpointing "
        "(use_reentrant=False), or static_graph=True.")


def unused_gradient_error(rank: int, everyone: Sequence[tuple[int, list[str]]],
                          static_graph: bool) -> RuntimeError:
    """The error every rank raises when some rank's backward left parameters without a gradient."""
    listed = "; ".join(f"rank {r}: " + ", ".join(repr(n) for n in names)
                       for r, names in everyone if names)
    mode = ("static_graph=True, and these were used in the first iteration" if static_graph
            else "find_unused_parameters=False")
    return RuntimeError(
        f"DistributedDataParallel: parameters received no gradient in this backward pass, so their "
        f"buckets could not be averaged ({mode}): {listed} (this is rank {rank}). HINT: pass "
        "find_unused_parameters=True to DistributedDataParallel, or make sure the output (the loss) "
        "depends on every parameter; freeze parameters you do not train with requires_grad_(False) "
        "before wrapping the model.")
