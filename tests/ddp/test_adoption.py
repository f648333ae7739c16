"""Averages left in their bucket slots (Note [Averages in their slots] in docs/design.md).

A big CPU gradient whose memory only it holds is pointed at its slot instead of getting the average
copied back. What the caller can see must stay torch's: the same ``.grad`` object with torch's
values and strides, a gradient kept from an earlier step never changing, and a buffer the caller's
gradients are views of receiving the averages. Each scenario trains both DDPs on 2 Gloo ranks.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from ranks import run_ranks
from torch import nn

import ddpkit

STEPS = 3


def _model() -> nn.Module:
    # 600 x 700 weight: a big gradient (copied in by its own hook) below the in-place size
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 600), nn.ReLU(), nn.Linear(600, 700), nn.ReLU(), nn.Linear(700, 3))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def _bucket_memory(ddp) -> list[tuple[int, int]]:
    spans = []
    for b in ddp.reducer.buckets:
        if not b.sparse:
            start = b.flat.data_ptr()
            spans.append((start, start + b.flat.numel() * b.flat.element_size()))
    return spans


def _in_bucket(ddp, grad: torch.Tensor) -> bool:
    return any(lo <= grad.data_ptr() < hi for lo, hi in _bucket_memory(ddp))


def _train(kind: str, scenario: str, rank: int) -> dict:
    """Train ``STEPS`` steps in the way ``scenario`` names; return the grads after each backward and
    what the scenario checks."""
    cls = ddpkit.DistributedDataParallel if kind == "ddpkit" else nn.parallel.DistributedDataParallel
    ddp = cls(_model())
    params = list(ddp.parameters())
    out: dict = {"grads": [], "checks": []}
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (what the caller holds, its values then)
    flat = None
    out["replaced"] = []  # replaced_in_backward: what the caller's reference to the old gradient holds
    if scenario.startswith("replaced_in_backward"):
        # zero_grad(set_to_none=False): the gradient stays in its slot from one step to the next;
        # the caller's hook replaces it during backward, while the caller still holds the old one
        # (under join, where the divisor is known only at launch, it is copied in at the launch)
        for p in params:
            p.grad = torch.zeros_like(p)
        calls = []  # by_none: at the second step only, once the first step left the gradient in its slot

        def replace(p: nn.Parameter) -> None:
            calls.append(1)
            p.grad = (None if len(calls) == 2 else p.grad) if scenario.endswith("by_none") else p.grad * 2
        params[2].register_post_accumulate_grad_hook(replace)
    if scenario in ("own_tensors", "non_contiguous"):
        for p in params:
            # non_contiguous: column-major weights' gradients, each its own memory (not a view)
            p.grad = (torch.empty_strided(p.shape, (1, p.shape[0])).zero_()
                      if scenario == "non_contiguous" and p.dim() == 2 else torch.zeros_like(p))
    if scenario == "views_of_own_buffer":
        flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    held = [p.grad for p in params]
    strides = [None if g is None else g.stride() for g in held]
    joined = ddp.join(divide_by_initial_world_size=False) if scenario.endswith("join") else nullcontext()
    with joined:
        for step in range(STEPS):
            before = params[2].grad
            ddp(_batch(rank, step)).square().mean().backward()
            out["grads"].append([p.grad.clone() for p in params])
            if scenario.startswith("replaced_in_backward"):  # torch: it keeps what backward accumulated into it
                out["replaced"].append(before.clone())
            if scenario in ("own_tensors", "non_contiguous"):  # the same objects, with their strides
                out["checks"].append(all(p.grad is g for p, g in zip(params, held)))
                out["checks"].append([p.grad.stride() for p in params] == strides)
            if scenario == "views_of_own_buffer":  # the averages land in the caller's buffer
                out["checks"].append(torch.equal(flat, torch.cat([p.grad.reshape(-1) for p in params])))
            if scenario == "kept":
                kept += [(p.grad, p.grad.clone()) for p in params]
            if scenario == "kept_view":
                kept += [(p.grad.view(-1), p.grad.clone().view(-1)) for p in params]
            if scenario == "kept_detached":
                kept += [(p.grad.detach(), p.grad.clone()) for p in params]
            if kind == "ddpkit" and scenario == "kept":  # the path under test is taken
                out["checks"].append(_in_bucket(ddp, params[2].grad))
            with torch.no_grad():
                for p in params:
                    p.sub_(0.1 * p.grad)
            if scenario in ("own_tensors", "non_contiguous", "views_of_own_buffer") or scenario.startswith("replaced"):
                for p in params:
                    p.grad.zero_()
            else:
                for p in params:
                    p.grad = None
    # what the caller kept never changed
    out["checks"].append(all(torch.equal(t, copy) for t, copy in kept))
    out["params"] = [p.detach().clone() for p in params]
    return out


SCENARIOS = ("kept", "kept_view", "kept_detached", "own_tensors", "non_contiguous", "views_of_own_buffer",
             "replaced_in_backward", "replaced_in_backward_join", "replaced_in_backward_by_none")


def _worker() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    return {s: {kind: _train(kind, s, rank) for kind in ("ddpkit", "torch")} for s in SCENARIOS}


def test_averages_in_slots_look_to_the_caller_as_torchs_copies_do():
    for rank_result in run_ranks(_worker, 2, timeout=90):
        for scenario, runs in rank_result.items():
            ours, theirs = runs["ddpkit"], runs["torch"]
            assert all(ours["checks"]), (scenario, ours["checks"])
            assert all(theirs["checks"]), (scenario, "torch", theirs["checks"])
            for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
                for i, (x, y) in enumerate(zip(a, b)):
                    torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=f"{scenario} step {step} grad {i}")
            for step, (x, y) in enumerate(zip(ours["replaced"], theirs["replaced"])):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=f"{scenario} step {step} old grad")
            for x, y in zip(ours["params"], theirs["params"]):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=scenario)


def _big_grad_worker(set_to_none: bool) -> dict:
    ddp = ddpkit.DistributedDataParallel(_model())
    weight = ddp.module[2].weight
    seen = []
    for step in range(STEPS):
        ddp(_batch(0, step)).sum().backward()
        seen.append(_in_bucket(ddp, weight.grad))
        ddp.zero_grad(set_to_none=set_to_none)
    return {"in_bucket": seen, "buckets": len(ddp.reducer.buckets)}


def test_a_big_gradient_keeps_its_average_in_its_slot_step_after_step():
    # zero_grad(set_to_none=False): backward accumulates into the slot, nothing moves any more
    for set_to_none in (True, False):
        for result in run_ranks(_big_grad_worker, 2, args=(set_to_none,), timeout=60):
            assert result["in_bucket"] == [True] * STEPS, (set_to_none, result)


def _old_memory_worker() -> dict:
    ddp = ddpkit.DistributedDataParallel(_model())
    weight = ddp.module[2].weight
    refs = []
    # the gradient autograd made, before the reducer sees it: its memory is what the slot replaces
    weight.register_post_accumulate_grad_hook(lambda p: refs.append(p.grad.untyped_storage()._weak_ref()))
    alive = []
    for step in range(STEPS):
        ddp(_batch(0, step)).sum().backward()
        alive.append(not torch.UntypedStorage._expired(refs[-1]))  # held, as torch holds its .grad
        ddp.zero_grad()
        ddp(_batch(0, step))  # a forward: where torch's zero_grad would have freed it at the latest
        alive.append(not torch.UntypedStorage._expired(refs[-1]))
    return {"alive": alive}


def test_the_memory_a_gradient_leaves_is_freed_by_the_next_forward():
    for result in run_ranks(_old_memory_worker, 2, timeout=60):
        assert result["alive"] == [True, False] * STEPS, result
