"""The errors of DistributedDataParallel's backward pass: each names the parameter, the rank and the fix.

torch's own reducer reports parameter indices unless a debug variable is set; these messages are
built from the qualified names the reducer keeps, and are the same on every rank where they must be.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Sequence

import torch

__all__ = ["late_gradient_warning", "warn_at_user_code", "second_gradient_error", "static_graph_changed_error",
           "unused_gradient_error"]


def late_gradient_warning(rank: int, name: str) -> str:
    """A gradient arrived after its iteration was averaged: a second backward through one graph.

    torch's DDP runs such a backward without a word; its gradients stay local, so the ranks' models
    drift apart. ddpkit runs it the same way, and says so once.
    """
    return (f"DistributedDataParallel on rank {rank}: a gradient for '{name}' arrived after this "
            "iteration's gradients were already averaged (backward() ran a second time through one "
            "forward's graph, or through an earlier iteration's). Its gradients are not averaged: "
            "each rank keeps its own, as with torch's DDP, and the ranks' models drift apart. HINT: "
            "add the losses and call backward() once, or call forward() again before each backward().")


def warn_at_user_code(message: str) -> None:
    """Warn, pointing at the user's line (its backward() call) rather than at torch's autograd."""
    skipped = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["ddpkit"]))
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level if frame is not None else 1)


def second_gradient_error(rank: int, name: str, used: bool) -> RuntimeError:
    """A parameter's hook fired twice in one backward, or for a parameter reduced as unused."""
    prefix = f"DistributedDataParallel on rank {rank}: parameter '{name}' received"
    if not used:
        return RuntimeError(
            f"{prefix} a gradient, but the forward's output has no autograd path to it, so it was "
            "already reduced as unused (find_unused_parameters searches that path; a parameter used "
            "only inside a reentrant activation checkpoint is off it). HINT: return every tensor the "
            "loss is computed from in the module's output; checkpoint with use_reentrant=False, or "
            "pass static_graph=True.")
    return RuntimeError(
        f"{prefix} its gradient twice in one backward pass (reentrant checkpointing, or a parameter "
        "shared with a module outside this DDP). HINT: use non-reentrant checkpointing "
        "(use_reentrant=False), or static_graph=True if every iteration uses the parameters alike.")


def static_graph_changed_error(rank: int, name: str, first_count: int) -> RuntimeError:
    """With static_graph, a parameter's hook fired more often than in the first iteration."""
    times = {0: "no gradient", 1: "one gradient"}.get(first_count, f"{first_count} gradients")
    return RuntimeError(
        f"DistributedDataParallel on rank {rank}: parameter '{name}' received more gradients in "
        f"this backward pass than in the first iteration ({times}), but static_graph=True says "
        "every iteration uses the parameters alike. HINT: drop static_graph=True (pass "
        "find_unused_parameters=True if some parameters go unused in some iterations).")


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
