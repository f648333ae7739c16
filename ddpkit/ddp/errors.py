"""The errors of DistributedDataParallel: each names the parameter or tensor, the rank and the fix.

torch's own reducer reports parameter indices unless a debug variable is set; these messages are
built from the qualified names the reducer keeps, and are the same on every rank where they must be.
Each factory returns the typed error of ``ddpkit.errors``, its facts as fields.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Mapping, Sequence

import torch

from ddpkit.errors import (
    RanksDisagreeError,
    SecondGradientError,
    StaticGraphChangedError,
    UnusedParametersError,
    explain,
    not_a_module_error,
)

__all__ = ["not_a_module_error", "no_parameters_error", "warn_create_graph", "late_gradient_warning",
           "no_forward_warning", "warn_at_user_code", "FIND_UNUSED_WITH_STATIC_GRAPH", "second_gradient_error",
           "static_graph_changed_error", "unused_gradient_error", "parameters_changed_warning", "reordered_warning",
           "unfinished_backward_error", "stale_output_error", "late_static_graph_error", "ranks_disagree_error",
           "refused_elsewhere_error"]

_DDP = "DistributedDataParallel"


def no_parameters_error(rank: int) -> RuntimeError:
    """torch's words for a module with nothing to average, with the rank and the way out."""
    return RuntimeError(explain(
        f"{_DDP} is not needed when a module doesn't have any parameter that requires a gradient (on rank "
        f"{rank}, none of its parameters requires one, or all are ignored).",
        "wrap the module once some parameters train (requires_grad_(True)), or leave it unwrapped."))


def no_forward_warning(rank: int, name: str) -> str:
    """A gradient arrived before any forward through the DDP: the wrapped module was called directly
    from the start. torch's DDP says nothing, and each rank trains alone."""
    return explain(
        f"a gradient for '{name}' arrived, but no forward has run through the DistributedDataParallel "
        "wrapper yet: the module was called directly (ddp.module(x), or the model object kept from before "
        "wrapping), so its gradients are not averaged and each rank trains alone (said once).",
        "call the wrapper, ddp(x), for the forward; wrap it in ddp.no_sync() where the gradients are meant "
        "to stay local.", who=_DDP, rank=rank)


def late_gradient_warning(rank: int, name: str) -> str:
    """A gradient arrived after its iteration was averaged: a second backward through one graph, or a
    backward through a forward of the wrapped module called directly.

    torch's DDP runs such a backward without a word; its gradients stay local, so the ranks' models
    drift apart unless the script means them to be local. ddpkit runs it the same way, and says so
    once per DDP.
    """
    return explain(
        f"a gradient for '{name}' arrived after this iteration's gradients were already averaged: "
        "backward() ran a second time through one forward's graph or an earlier iteration's, or through "
        "a forward of ddp.module called directly. Such gradients are not averaged: each rank keeps its "
        "own, as with torch's DDP (said once).",
        "if they should be averaged, add the losses and call backward() once, or call the DDP's "
        "forward() before each backward(); if they are meant to stay local, nothing is wrong.",
        who=_DDP, rank=rank)


FIND_UNUSED_WITH_STATIC_GRAPH = (
    "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will detect "
    "unused parameters automatically, so you do not need to set find_unused_parameters=true, just be sure "
    "these unused parameters will not change during training loop while calling `_set_static_graph`.")
"""torch's words, warned where torch warns them: static_graph with find_unused_parameters."""


_all_used_warned = [False]


def warn_if_all_used(rank: int) -> None:
    """Once, as torch's reducer does: find_unused_parameters searched the graph and every parameter
    was used, so the search is a cost with nothing found."""
    if not _all_used_warned[0]:
        _all_used_warned[0] = True
        warn_at_user_code(explain(
            "find_unused_parameters=True was specified in DDP constructor, but did not find any unused "
            "parameters in the forward pass. This flag results in an extra traversal of the autograd graph "
            "every iteration, which can adversely affect performance.", "if your model indeed never has "
            "any unused parameters in the forward pass, turn this flag off. This warning may be a false "
            "positive if your model has flow control causing later iterations to have unused parameters.",
            who=_DDP, rank=rank))


_create_graph_warned = [False]


def warn_create_graph(rank: int) -> None:
    """Once, where backward(create_graph=True) made gradients that carry a graph: DDP averages their
    values, not their graph (see ``ddpkit.ddp.create_graph``)."""
    if not _create_graph_warned[0]:
        _create_graph_warned[0] = True
        warn_at_user_code(explain(
            "Using DistributedDataParallel with create_graph=True is not well-supported. The higher-order "
            "gradient will not be synchronized across ranks: each .grad holds the average over ranks, but "
            "the graph it carries is this rank's own share (the local gradient's, times 1 / world size "
            "without a comm hook), so "
            "a loss built from it (a gradient penalty) differentiates that share only.",
            "compute higher-order terms with torch.autograd.grad(..., create_graph=True) on the local loss, "
            "outside DDP's backward, and all-reduce them yourself.", who=_DDP, rank=rank))


def warn_at_user_code(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn, pointing at the user's line (its backward() call, its DDP(...) even through
    ``ddpkit.parallelize``) rather than at torch's autograd or ddpkit's own code."""
    skipped = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["ddpkit"]))
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 1)


def second_gradient_error(rank: int, name: str, used: bool) -> SecondGradientError:
    """A parameter's hook fired twice in one backward, or for a parameter reduced as unused."""
    if not used:
        what = ("a gradient, but the forward's output has no autograd path to it, so it was already "
                "reduced as unused (find_unused_parameters searches that path; a parameter used only "
                "inside a reentrant activation checkpoint is off it).")
        hint = ("return every tensor the loss is computed from in the module's output; checkpoint "
                "with use_reentrant=False, or pass static_graph=True.")
    else:
        what = ("its gradient twice in one backward pass (reentrant checkpointing, or a parameter "
                "shared with a module outside this DDP).")
        hint = ("use non-reentrant checkpointing (use_reentrant=False), or static_graph=True if every "
                "iteration uses the parameters alike.")
    what = f"Expected to mark a variable ready only once, but parameter '{name}' received {what}"
    return SecondGradientError(explain(what, hint, who=_DDP, rank=rank),
                               rank=rank, parameter=name, reduced_as_unused=not used)


def static_graph_changed_error(rank: int, name: str, first_count: int) -> StaticGraphChangedError:
    """With static_graph, a parameter's hook fired more often than in the first iteration."""
    times = {0: "no gradient", 1: "one gradient"}.get(first_count, f"{first_count} gradients")
    message = explain(  # torch's words first, so that its error text finds this one
        f"Your training graph has changed in this iteration: parameter '{name}' received more gradients "
        f"in this backward pass than in the first iteration ({times}). This is not compatible with "
        "static_graph set to True, which says every iteration uses the parameters alike.",
        "drop static_graph=True (pass find_unused_parameters=True if some parameters go unused in "
        "some iterations).", who=_DDP, rank=rank)
    return StaticGraphChangedError(message, rank=rank, parameter=name, first_count=first_count)


def unused_gradient_error(rank: int, everyone: Sequence[tuple[int, list[str]]], static_graph: bool,
                          changed: Mapping[int, Mapping[str, str]] | None = None) -> UnusedParametersError:
    """The error every rank raises when some rank's backward left parameters without a gradient;
    ``changed``: by rank, what became of those that were replaced, removed or frozen since wrapping."""
    by_rank = {r: list(names) for r, names in everyone if names}
    listed = "; ".join(f"rank {r}: " + ", ".join(repr(n) for n in names) for r, names in by_rank.items())
    mode = ("static_graph=True, and these were used in the first iteration" if static_graph
            else "find_unused_parameters=False")
    # torch's words, so that its error text finds this one; torch says them at the next forward
    cause = ("your training graph has changed in this iteration: your module has parameters that were "
             "not used in producing loss" if static_graph
             else "your module has parameters that were not used in producing loss")
    changed = {r: found for r, found in sorted((changed or {}).items()) if found}
    same = len(changed) == len(everyone) > 1 and all(c == changed[rank] for c in changed.values())
    changes = "; ".join(("on every rank: " if same else f"on rank {r}: ")
                        + ", ".join(f"{name!r} {what}" for name, what in found.items())
                        for r, found in (list(changed.items())[:1] if same else changed.items()))
    if changes:
        cause, hint = (f"{cause}. They changed after the model was wrapped ({changes}), and DDP averages the "
                       "parameters it was built with", "build the final model (new heads, frozen layers) "
                       "before wrapping it in DistributedDataParallel, or wrap it again after the change; "
                       "find_unused_parameters=True would hide this error, and the new parameters would "
                       "still train on each rank alone.")
    elif static_graph:  # torch's DDP refuses find_unused_parameters beside it once the graph changes
        hint = ("drop static_graph=True, which says every iteration uses the parameters alike, and pass "
                "find_unused_parameters=True if some parameters go unused in some iterations.")
    else:
        hint = ("pass find_unused_parameters=True to DistributedDataParallel, or make sure the output (the "
                "loss) depends on every parameter; freeze parameters you do not train with "
                "requires_grad_(False) before wrapping the model.")
    message = explain(
        "Expected to have finished reduction in the prior iteration before starting a new one (torch's "
        f"DDP says so at the next forward; ddpkit at this backward, where it happens). This error indicates "
        f"that {cause}: they received no gradient in this backward pass, so their buckets could not be "
        f"averaged ({mode}): {listed} (this is rank {rank}).", hint, who=_DDP)
    return UnusedParametersError(message, rank=rank, by_rank=by_rank, static_graph=static_graph)


def reordered_warning(rank: int, position: int, here: str, there: str, shape: Sequence[int]) -> str:
    """This rank lists rank 0's tensor names in another order: tensors are matched by position (as in
    torch, which says nothing), so two different parameters are averaged together."""
    return explain(
        f"this rank lists its parameters in another order than rank 0: tensor #{position} is {here!r} here "
        f"and {there!r} on rank 0 (shape {list(shape)} on both). DDP matches tensors by position, as torch's "
        f"does, so {here!r} here starts from rank 0's {there!r} and their gradients are averaged together.",
        "build the model the same way on every rank: a module lists its parameters in the order its "
        "submodules and parameters were assigned in __init__.", who=_DDP, rank=rank)


def parameters_changed_warning(rank: int, changes: Mapping[str, str]) -> str:
    """The parameters replaced or added since wrapping: their gradients are never averaged."""
    listed = ", ".join(f"{name!r} ({what})" for name, what in changes.items())
    return explain(
        f"the module's parameters changed after it was wrapped: {listed}. DDP averages the "
        "parameters it was built with, so these train on each rank alone and the ranks drift apart.",
        "build the final model (new heads, unfrozen layers) before wrapping it in DistributedDataParallel, "
        "or wrap it again after the change.", who=_DDP, rank=rank)


def unfinished_backward_error(rank: int) -> RuntimeError:
    """A synced forward while the previous backward had launched buckets but not finished."""
    return RuntimeError(explain(
        "Expected to have finished reduction in the prior iteration before starting a new one: forward() "
        "was called while the previous backward() had not finished averaging gradients (it raised, or was "
        "interrupted), so the ranks may disagree on which buckets were reduced.",
        "let an error in backward() end the step on every rank instead of catching it and training on.",
        who=_DDP, rank=rank))


def stale_output_error(rank: int, forward: int, latest: int) -> RuntimeError:
    """Backward reached the output of a forward whose iteration was already averaged."""
    return RuntimeError(explain(
        f"backward() reached the output of forward pass {forward}, whose gradients were already "
        f"averaged, but forward pass {latest} came after it; its gradients would be averaged as if "
        "they were the new ones.",
        "call backward() on each forward's loss before the next backward (retain_graph only inside "
        "no_sync()).", who=_DDP, rank=rank))


def late_static_graph_error(rank: int, forwards: int) -> RuntimeError:
    """``_set_static_graph()`` after a forward: the first iteration's hooks went uncounted."""
    return RuntimeError(explain(
        "set_static_graph() should be called before training loop starts and after "
        f"DistributedDataParallel is constructed, but _set_static_graph() came after {forwards} forward "
        "pass(es); the first iteration must count the gradients already.",
        "pass static_graph=True to the constructor.", who=_DDP, rank=rank))


def ranks_disagree_error(rank: int, differing_rank: int, difference: str) -> RanksDisagreeError:
    """Rank ``differing_rank`` holds other parameters or buffers than rank 0 (``difference``: the first)."""
    message = explain(
        f"DDP expects same model across all ranks: {_DDP} needs the same parameters and buffers on "
        f"every rank, but {difference} (this is "
        f"rank {rank}).",
        "build the model identically on every rank (same arguments, same code path) before wrapping it.")
    return RanksDisagreeError(message, rank=rank, differing_rank=differing_rank, difference=difference)


def out_of_step_error(rank: int, received: object) -> RanksDisagreeError:
    """What rank 0 broadcast where its list of parameters was expected is something else: the ranks
    had called different collectives before this construction."""
    got = f"{type(received).__name__} {received!r:.80}"
    message = explain(
        f"{_DDP} on rank {rank} expected rank 0's list of parameters and buffers, but received {got}: the "
        "ranks called different collectives before this construction, so each call met another.",
        "call every collective on every rank, in the same order (a broadcast_object or other collective "
        "under 'if rank == 0:' before the model is wrapped is the usual cause).")
    return RanksDisagreeError(message, rank=rank, differing_rank=0, difference=f"rank 0 sent {got}")


def refused_elsewhere_error(rank: int, differing_rank: int, error: str) -> RanksDisagreeError:
    """Rank ``differing_rank`` refused its own arguments (``error``, as ``"Type: message"``): this rank
    cannot build the DistributedDataParallel without it."""
    message = f"{_DDP} could not be built on rank {differing_rank}: {error} (this is rank {rank})."
    return RanksDisagreeError(message, rank=rank, differing_rank=differing_rank, difference=error)
