"""CUDA and NCCL paths (one GPU is enough): skipped, with the reason, on machines without CUDA."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

import ddpkit

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



class _Net(torch.nn.Module):
    """A big layer (on the GPU copied into its bucket at the launch with the small ones, see
    ``is_big``), a BatchNorm buffer, small layers, and a branch only some ranks use."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(256, 128)
        self.bn = torch.nn.BatchNorm1d(128)
        self.small = torch.nn.Linear(128, 8)
        self.some = torch.nn.Linear(8, 8)

    def forward(self, x, use_some=False):
        out = self.small(self.bn(self.big(x)).relu())
        return self.some(out) if use_some else out


SHARED_GPU_CONFIGS = [
    {"name": "defaults"},
    {"name": "tiny_buckets", "kwargs": {"bucket_cap_mb": 0.01}},
    {"name": "gradient_as_bucket_view", "kwargs": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01}},
    {"name": "find_unused", "kwargs": {"find_unused_parameters": True}, "unused": True},
    {"name": "static_graph", "kwargs": {"static_graph": True}},
    {"name": "no_sync", "no_sync": True},
    {"name": "fp16_hook", "hook": "fp16_compress_hook", "tolerance": 2e-3},
    {"name": "no_broadcast_buffers", "kwargs": {"broadcast_buffers": False}},
]


def _control_tensors_on_the_gpu() -> None:
    """Make this rank's reducer treat its Gloo group as NCCL-only (torch's init_process_group("nccl")):
    the status flag, the used map and the rebuilt bucket order then travel as CUDA tensors."""
    import ddpkit.ddp.bucket_layout
    import ddpkit.ddp.collectives

    def on_the_gpu(group):
        return torch.device("cuda", 0)

    ddpkit.ddp.collectives.comm_device = on_the_gpu
    ddpkit.ddp.bucket_layout.comm_device = on_the_gpu


def _shared_gpu_training(configs: list[dict], nccl_only: bool = False) -> dict[str, float]:
    """Per configuration, the largest difference between ddpkit's and torch's DDP after training."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if nccl_only:
        _control_tensors_on_the_gpu()
    device = torch.device("cuda", 0)
    rank = dist.get_rank()
    results = {}
    for cfg in configs:
        states = []
        for cls in (ddpkit.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
            torch.manual_seed(0)
            ddp = cls(_Net().to(device), device_ids=[0], **cfg.get("kwargs", {}))
            if "hook" in cfg:
                ddp.register_comm_hook(None, getattr(default_hooks, cfg["hook"]))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
            data = torch.Generator().manual_seed(7 + rank)
            for step in range(6):
                x = torch.randn(16, 256, generator=data).to(device)
                local = cfg.get("no_sync") and step % 3 != 2
                with ddp.no_sync() if local else contextlib.nullcontext():
                    out = ddp(x, use_some=rank == 1 if cfg.get("unused") else True)
                    out.square().mean().backward()
                if not local:
                    opt.step()
                    opt.zero_grad()
            assert all(p.device == device for p in ddp.parameters())
            states.append({k: v.detach().cpu() for k, v in ddp.state_dict().items()})
        results[cfg["name"]] = max((a.double() - b.double()).abs().max().item()
                                   for a, b in zip(states[0].values(), states[1].values()))
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nccl_only", [False, True], ids=["cpu_and_cuda_group", "cuda_only_group"])
def test_two_ranks_sharing_one_gpu_over_gloo_train_like_torch_ddp(nccl_only):
    """The reducer on CUDA tensors across ranks: buckets, bucket views, unused parameters, hooks; also
    with every small tensor of the reducer on the GPU, as a group that carries CUDA tensors only needs."""
    for results in run_ranks(_shared_gpu_training, 2, args=(SHARED_GPU_CONFIGS, nccl_only), timeout=280):
        for cfg in SHARED_GPU_CONFIGS:
            assert results[cfg["name"]] <= cfg.get("tolerance", 1e-5), (cfg["name"], results[cfg["name"]])


def _lacking_gradients_on_the_gpu(nccl_only: bool) -> str:
    if nccl_only:
        _control_tensors_on_the_gpu()
    ddp = ddpkit.DistributedDataParallel(_Net().cuda(), device_ids=[0])
    rank = dist.get_rank()
    for step in range(3):
        out = ddp(torch.randn(4, 256, device="cuda"), use_some=True)
        if step == 2 and rank == 1:  # rank 1 leaves `some` without a gradient in its third step
            out = ddp.module.small(ddp.module.bn(ddp.module.big(torch.randn(4, 256, device="cuda"))))
        try:
            out.square().mean().backward()
        except ddpkit.UnusedParametersError as e:
            return f"step {step}: {e}"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nccl_only", [False, True], ids=["cpu_and_cuda_group", "cuda_only_group"])
def test_a_rank_lacking_gradients_on_the_gpu_raises_on_every_rank(nccl_only):
    for rank, message in enumerate(run_ranks(_lacking_gradients_on_the_gpu, 2, args=(nccl_only,), timeout=100)):
        assert message.startswith("step 2: "), (rank, message)
        assert "rank 1: 'some.weight', 'some.bias'" in message and f"(this is rank {rank})" in message


def test_a_devices_buckets_share_one_block_which_the_allocator_rounds_up_once():
    """Two buckets of 11.05 MiB: a block each would be rounded up to 12 MiB each by the caching
    allocator (24 MiB), one block of 22.1 MiB is split off a 24 MiB segment (Note [One block per device])."""
    from ddpkit.ddp.bucket_layout import BLOCK_ALIGN_BYTES, BucketLayout

    numel = int(11.05 * 2**20) // 4
    params = [torch.nn.Parameter(torch.zeros(numel, device="cuda")) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    layout = BucketLayout(params, 8 * 2**20, 8 * 2**20, as_view=False, rebuild=True)  # a bucket each
    taken = torch.cuda.memory_allocated() - before
    assert len(layout.buckets) == 2
    assert len({b.flat.untyped_storage().data_ptr() for b in layout.buckets}) == 1
    assert taken <= 2 * numel * 4 + 2 * BLOCK_ALIGN_BYTES, taken
