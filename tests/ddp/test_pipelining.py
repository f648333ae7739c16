"""torch.distributed.pipelining sees ddpkit's DDP as torch's: one all-reduce a step, not one a microbatch.

A ``PipelineStage`` whose module is a DDP runs every microbatch but the last under ``no_sync()`` and
arms the last backward with ``reducer.prepare_for_backward(outputs)``. Here each of 2 ranks is a
one-stage pipeline (data parallel across the ranks), and the reference is the same microbatches
accumulated under ``no_sync`` by hand. See ddpkit/ddp/ddp_class_checks.py.
"""
from __future__ import annotations

import types

import pytest
import torch
from ranks import run_ranks
from torch import nn

from ddpkit.ddp import ddp_class_checks

pipelining = pytest.importorskip("torch.distributed.pipelining", reason="torch.distributed.pipelining: torch >= 2.4")

MICROBATCHES, STEPS = 4, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _by_hand(find_unused: bool) -> list[torch.Tensor]:
    """The microbatches' mean losses accumulated under no_sync, the last backward averaging."""
    import ddpkit

    model = _model()
    ddp = ddpkit.DDP(model, find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _batch(ddpkit.get_rank(), step)
        optimizer.zero_grad()
        pieces = list(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)))
        for i, (xs, ys) in enumerate(pieces):
            if i < len(pieces) - 1:
                with ddp.no_sync():
                    (_loss(ddp(xs), ys) / MICROBATCHES).backward()
            else:
                (_loss(ddp(xs), ys) / MICROBATCHES).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _pipelined_worker(schedule: str, find_unused: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import ddpkit

    rank = ddpkit.get_rank()
    stage_group, _ = dist.new_subgroups(group_size=1)  # each rank: a pipeline of one stage
    model = _model()
    ddp = ddpkit.DDP(model, find_unused_parameters=find_unused)
    launched, launch = [], ddp.reducer.collectives.launch  # count the buckets' all-reduces
    ddp.reducer.collectives.launch = lambda bucket: launched.append(bucket.index()) or launch(bucket)
    stage = PipelineStage(ddp, stage_index=0, num_stages=1, device=torch.device("cpu"), group=stage_group)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    pipeline = kind(stage, n_microbatches=MICROBATCHES, loss_fn=_loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        launched.clear()
        pipeline.step(x, target=y)
        optimizer.step()
        per_step.append(len(launched) / len(ddp.reducer.buckets))
    reference = _by_hand(find_unused)
    diff = max((p - r).abs().max().item() for p, r in zip(model.parameters(), reference))
    return {"diff": diff, "reductions": per_step}


def _pipelines_worker() -> dict:
    """GPipe and 1F1B, and GPipe with find_unused_parameters, in one pair of processes."""
    return {case: _pipelined_worker(*case) for case in (("gpipe", False), ("1f1b", False), ("gpipe", True))}


@pytest.mark.timeout(120)
def test_a_ddp_stage_averages_once_a_step_as_torchs_does():
    for results in run_ranks(_pipelines_worker, world_size=2, timeout=100):
        for case, result in results.items():
            assert result["diff"] < 1e-6, (case, result)
            # the stage's first step also averages its first microbatch, armed by the stage's shape
            # inference (a synced forward whose backward never comes); an average of averages is the same
            assert result["reductions"][1:] == [1] * (STEPS - 1), (case, result)  # once a step


def test_the_stage_name_is_widened_only_for_a_ddpkit_ddp_that_averages():
    fake = types.ModuleType(ddp_class_checks.PIPELINE_TARGET)
    fake.DistributedDataParallel = nn.parallel.DistributedDataParallel
    assert ddp_class_checks.adapt(fake) and ddp_class_checks.adapt(fake)
    widened = fake.DistributedDataParallel
    assert widened is ddp_class_checks.TorchOrAveragingDdpkitDDP
    import ddpkit

    alone = ddpkit.DDP(nn.Linear(2, 2))  # no process group: a world of one, a plain module to a stage
    assert alone.reducer is None and not isinstance(alone, widened)
    assert not isinstance(nn.Linear(2, 2), widened)
    averaging = ddpkit.DDP.__new__(ddpkit.DDP)  # as if built in a world of several: it has a reducer
    object.__setattr__(averaging, "reducer", object())
    assert isinstance(averaging, widened)


def test_torchs_stage_module_is_adapted_once_imported():  # after ddpkit, imported above: by the hook
    from torch.distributed.pipelining import stage

    assert stage.DistributedDataParallel is ddp_class_checks.TorchOrAveragingDdpkitDDP
