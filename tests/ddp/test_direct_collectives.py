"""DDP's collectives go to the process group itself (``ddpkit.runtime.direct``), as torch's reducer's do.

They must still be recorded for hang reports, still pass through a function someone else put in
place of ``dist.all_reduce`` or ``dist.broadcast``, and still broadcast from the right rank of a
group that does not hold global rank 0.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn
from torch.distributed import distributed_c10d as c10d

import ddpkit
from ddpkit.runtime import process_group


def _bn_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _train(cls, group, rank: int, steps: int = 4, during_steps=contextlib.nullcontext) -> list[torch.Tensor]:
    torch.manual_seed(rank)  # different on every rank: construction copies the group's first rank's
    model = cls(_bn_net(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1) / 24 + step
        # the second forward rebuilds the buckets, which takes a broadcast of their order
        with during_steps() if step >= 2 else contextlib.nullcontext():
            model(x).square().sum().backward()
        opt.step()
    return [t.detach().clone() for t in model.module.state_dict().values()]


def _subgroup_worker() -> dict:
    """DDP over ranks [1, 2] of three, against torch's DDP on the same group; rank 0 stays out."""
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return {}
    checks = []
    real = c10d._check_single_tensor  # torch's Python collectives check every tensor they are given

    def counted(*args, **kwargs):
        checks.append(args)
        return real(*args, **kwargs)

    @contextlib.contextmanager
    def counting():
        c10d._check_single_tensor = counted
        try:
            yield
        finally:
            c10d._check_single_tensor = real

    ours = _train(ddpkit.DDP, group, rank, during_steps=counting)
    theirs = _train(nn.parallel.DistributedDataParallel, group, rank)
    log = process_group._watch[0].recorder.logs[group]
    return {"diff": max((a - b).abs().max().item() for a, b in zip(ours, theirs)),
            "ddp_records": sorted({(r.op, r.via) for r in log.ring if r.via == "DDP"}),
            "checked": len(checks)}


@pytest.mark.timeout(90)
def test_ddp_on_a_group_without_rank_0_matches_torch_and_is_recorded_past_torchs_python_layer():
    out = run_ranks(_subgroup_worker, 3, timeout=75)
    for rank in (1, 2):
        assert out[rank]["diff"] <= 1e-5, out[rank]["diff"]
        # the buffers' broadcast (forward) and the buckets' all-reduce (backward), numbered in the ring
        assert out[rank]["ddp_records"] == [("all_reduce", "DDP"), ("broadcast", "DDP")]
        assert out[rank]["checked"] == 0  # the steps' collectives skip torch.distributed's Python layer


def _wrapped_worker() -> dict:
    calls = {"all_reduce": 0, "broadcast": 0}
    real = {op: getattr(dist, op) for op in calls}

    def counting(op):
        def wrapper(*args, **kwargs):
            calls[op] += 1
            return real[op](*args, **kwargs)
        return wrapper

    for op in calls:
        setattr(dist, op, counting(op))
    try:
        torch.manual_seed(0)
        model = ddpkit.DDP(_bn_net())
        before = dict(calls)
        for _ in range(3):
            model(torch.randn(4, 6)).sum().backward()
    finally:
        for op, fn in real.items():
            setattr(dist, op, fn)
    return {op: calls[op] - before[op] for op in calls}


@pytest.mark.timeout(60)
def test_a_function_put_in_place_of_torchs_collectives_sees_ddps():
    for counts in run_ranks(_wrapped_worker, 2, timeout=45):
        # one bucket all-reduced per backward; the buffers broadcast before every forward, and the
        # buckets' new order at the second
        assert counts == {"all_reduce": 3, "broadcast": 4}, counts


PATCHED_BEFORE_IMPORT = """
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
calls = []
real = c10d.all_reduce

def wrapper(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

dist.all_reduce = c10d.all_reduce = wrapper  # as a profiler would, before ddpkit is imported
from ddpkit.runtime import direct
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
direct.all_reduce(torch.ones(2), dist.group.WORLD).wait()
print("calls", len(calls))
"""


@pytest.mark.timeout(60)
def test_a_function_put_in_place_before_ddpkit_was_imported_is_not_skipped():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", PATCHED_BEFORE_IMPORT], capture_output=True, text=True,
                            timeout=50)
    assert "calls 1" in result.stdout, result.stdout + result.stderr
