"""CUDA and NCCL paths (one GPU is enough): skipped, with the reason, on machines without CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    ddpkit.shutdown()


def test_single_process_fallback_on_a_gpu_reduces_cpu_and_cuda_tensors(single_process):
    env = ddpkit.init()
    assert env.backend is None and env.device == torch.device("cuda", 0)
    for device in ("cpu", "cuda"):
        t = torch.ones(3, device=device)
        dist.all_reduce(t)
        ddpkit.all_reduce(t, "mean")
        assert t.tolist() == [1.0, 1.0, 1.0]


def _nccl_world_of_one():
    env = ddpkit.init()
    device = env.device
    out = {"backend": env.backend, "device": str(device)}
    t = torch.arange(4.0, device=device)
    out["sum"] = ddpkit.all_reduce(t.clone()).tolist()
    out["gather"] = [g.tolist() for g in ddpkit.all_gather(t[:3])]
    out["scatter"] = ddpkit.reduce_scatter(t.clone()).tolist()
    out["object"] = ddpkit.broadcast_object({"a": 1})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    reference = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(model)]).to(device)
    ours = ddpkit.DistributedDataParallel(model.to(device), device_ids=[device.index])
    theirs = torch.nn.parallel.DistributedDataParallel(reference, device_ids=[device.index])
    for net in (ours, theirs):
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 8, generator=g).to(device)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    out["max_diff"] = max((a - b).abs().max().item() for a, b in
                          zip(ours.module.state_dict().values(), theirs.module.state_dict().values()))
    return out


@pytest.mark.timeout(120)
def test_nccl_world_of_one_collectives_and_ddp_match_torch():
    out = run_ranks(_nccl_world_of_one, 1, backend="nccl", timeout=100)[0]
    assert (out["backend"], out["device"]) == ("nccl", "cuda:0")
    assert out["sum"] == [0.0, 1.0, 2.0, 3.0]
    assert out["gather"] == [[0.0, 1.0, 2.0]] and out["scatter"] == [0.0, 1.0, 2.0, 3.0]
    assert out["object"] == {"a": 1}
    assert out["max_diff"] <= 1e-5
