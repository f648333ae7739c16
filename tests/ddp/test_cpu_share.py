"""The CPU bucket layout by the host's cores: the cap where Gloo's threads have cores to spare, big
gradients in place where every rank has a core, and rank 0's choice holds on every rank (buckets
that differ between ranks would sum different gradients)."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from ddpkit.ddp import cpu_share
from ddpkit.ddp.arguments import bucket_caps

MIB = 1 << 20


@pytest.mark.parametrize("spare, bucket_cap_mb, expected_mib", [
    (7.0, None, 5),  # default cap, cores to spare: small buckets that overlap backward
    (1.0, None, 5),
    (0.0, None, 25),  # backward's threads fill the cores: every bucket to the cap
    (0.5, None, 25),
    (7.0, 25, 25),  # a cap the caller chose is kept, even 25
    (7.0, 2, 2),
])
def test_the_own_cpu_cap_is_smaller_only_with_the_default_cap_and_a_core_to_spare(
        monkeypatch, spare, bucket_cap_mb, expected_mib):
    monkeypatch.setattr(cpu_share, "spare_cores_per_rank", lambda world_size: spare)
    params = [torch.nn.Parameter(torch.ones(1))]
    assert cpu_share.own_cpu_cap(params, *bucket_caps(bucket_cap_mb), world_size=2) == expected_mib * MIB


def test_an_odd_host_leaves_the_cap_as_it_is_rather_than_failing_the_constructor(monkeypatch):
    def broken(world_size):
        raise ZeroDivisionError("a cgroup period of 0")

    monkeypatch.setattr(cpu_share, "spare_cores_per_rank", broken)
    params = [torch.nn.Parameter(torch.ones(1))]
    assert cpu_share.own_cpu_cap(params, *bucket_caps(None), world_size=2) == 25 * MIB


@pytest.mark.parametrize("environ, cores, threads, world_size, expected", [
    ({"LOCAL_WORLD_SIZE": "2"}, 16, 1, 2, 7.0),  # torchrun's OMP_NUM_THREADS=1 on 16 cores
    ({"LOCAL_WORLD_SIZE": "2"}, 16, 8, 2, 0.0),  # ddpkit run's share of the cores: none to spare
    ({"LOCAL_WORLD_SIZE": "2"}, 2, 1, 2, 0.0),  # this project's 2-core machine
    ({}, 16, 1, 4, 3.0),  # no launcher variables: every rank is taken to be on this host
])
def test_spare_cores_are_the_ranks_share_less_its_threads(monkeypatch, environ, cores, threads,
                                                         world_size, expected):
    launched = {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                "MASTER_PORT": "1", "GROUP_RANK": "0"} if environ else {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**launched, **environ}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cpu_share, "available_cores", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert cpu_share.spare_cores_per_rank(world_size) == expected


class _ManySmall(torch.nn.Module):
    """14 MiB of 1 MiB gradients, none big enough to be reduced in place: one bucket at the 25 MiB
    cap, three at 5 MiB."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(14)])

    def forward(self, x):
        return self.layers(x)


def _train_beside_torch(ddp_class: type, build: Callable[[], torch.nn.Module], width: int,
                        observe: Callable[[torch.nn.Module], Any]) -> tuple[list, float]:
    """Three steps of ``ddp_class`` and of torch's DDP on the same data: what ``observe`` saw of
    ``ddp_class``'s DDP after each step, and the largest difference of their parameters at the end."""
    rank = dist.get_rank()
    states, seen = [], []
    for cls in (ddp_class, torch.nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        ddp = cls(build())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(8, width, generator=data)).square().mean().backward()
            opt.step()
            if cls is ddp_class:
                seen.append(observe(ddp))
        states.append([p.detach().clone() for p in ddp.parameters()])
    return seen, max((a - b).abs().max().item() for a, b in zip(*states))


def _rank_zero_chooses_the_cap(spare_on: list[int]) -> dict:
    import ddpkit.ddp.reducer

    chosen = cpu_share.SPARE_CORES_CAP_BYTES if dist.get_rank() in spare_on else None
    ddpkit.ddp.reducer.own_cpu_cap = lambda params, cap, first, world_size: chosen or cap
    counts, diff = _train_beside_torch(ddpkit.ddp.DistributedDataParallel, _ManySmall, 512,
                                       lambda ddp: len(ddp.reducer.buckets))
    return {"buckets": counts[-1], "diff": diff}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spare_on, buckets", [([0], 3), ([1], 1), ([0, 1], 3)],
                         ids=["rank0_spares_cores", "rank1_spares_cores", "both"])
def test_every_rank_takes_rank_zeros_cap_and_trains_as_torch(spare_on, buckets):
    for rank, out in enumerate(run_ranks(_rank_zero_chooses_the_cap, 2, args=(spare_on,), timeout=100)):
        assert out["buckets"] == buckets, (rank, out)
        assert out["diff"] <= 1e-5, (rank, out)


@pytest.mark.parametrize("cores, ranks, expected", [
    (16, 2, True), (2, 2, True),  # a core per rank: each collective runs beside backward
    (2, 3, False), (2, 4, False), (6, 8, False),  # more ranks than cores: fewer collectives cost less
    (1, 2, True), (1, 3, True),  # one core: the ranks take turns, and the copies saved pay
])
def test_big_gradients_stay_in_place_where_every_rank_has_a_core_or_all_share_one(
        monkeypatch, cores, ranks, expected):
    monkeypatch.setattr(cpu_share, "available_cores", lambda: cores)
    monkeypatch.setattr(cpu_share, "_launch", lambda world_size: ("torchrun", ranks))
    assert cpu_share.in_place_pays(world_size=ranks) is expected


_SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
          "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "7",
          "SLURM_JOB_NODELIST": "node1", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("per_task, mask, expected", [
    ("2", 2, 2.0),  # srun pinned each task to its 2 cores: the mask is this rank's own, not divided
    ("2", 8, 2.0),  # not pinned: the mask is the node's, the share is still the task's
    ("4", 2, 2.0),  # never more than the mask
    ("", 8, 2.0),  # no --cpus-per-task: the node's cores over its 4 tasks
])
def test_under_srun_a_rank_has_the_cores_of_its_task(monkeypatch, per_task, mask, expected):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**_SLURM, "SLURM_CPUS_PER_TASK": per_task}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cpu_share, "available_cores", lambda: mask)
    assert cpu_share.cores_per_rank(world_size=4) == expected
    assert cpu_share.in_place_pays(world_size=4)  # with 4 pinned tasks of 2 cores each, in place pays


def test_an_odd_host_keeps_big_gradients_in_place_rather_than_failing_the_constructor(monkeypatch):
    def broken():
        raise ZeroDivisionError("a cgroup period of 0")

    monkeypatch.setattr(cpu_share, "available_cores", broken)
    assert cpu_share.in_place_pays(world_size=2) is True


class _Wide(torch.nn.Module):
    """Three 2.25 MiB weights, each big enough to be reduced where it lies by default."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(768, 768) for _ in range(3)])

    def forward(self, x):
        return self.layers(x)


def _rank_zero_chooses_in_place(pays_on: list[int], in_place_bytes: int | None) -> dict:
    import ddpkit.ddp.reducer
    from ddpkit.ddp.inplace_bucket import InPlaceBucket

    rank = dist.get_rank()
    ddpkit.ddp.reducer.in_place_pays = lambda world_size: rank in pays_on
    ddp_class = ddpkit.ddp.DistributedDataParallel
    if in_place_bytes is not None:  # given, as the bench's in_place table does: no rule applies
        ddp_class = type("Given", (ddp_class,), {"_reducer_options": {"in_place_bytes": in_place_bytes}})
    in_place, diff = _train_beside_torch(ddp_class, _Wide, 768, lambda ddp: sum(
        isinstance(b, InPlaceBucket) for b in ddp.reducer.buckets))
    return {"in_place": in_place, "diff": diff}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pays_on, in_place_bytes, after_rebuild", [
    ([0], None, 3), ([1], None, 0), ([0, 1], None, 3),
    ([], 1 << 21, 3),  # an in_place_bytes given is kept, whatever the cores
], ids=["rank0_has_the_cores", "rank1_has_the_cores", "both", "given_in_place_bytes"])
def test_every_rank_takes_rank_zeros_in_place_choice_and_trains_as_torch(pays_on, in_place_bytes, after_rebuild):
    for rank, out in enumerate(run_ranks(_rank_zero_chooses_in_place, 2, args=(pays_on, in_place_bytes),
                                         timeout=100)):
        # the first backward reduces in place on every rank; rank 0's choice holds from the rebuild on
        assert out["in_place"] == [3, after_rebuild, after_rebuild], (rank, out)
        assert out["diff"] <= 1e-5, (rank, out)
