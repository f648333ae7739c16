"""ddpkit.SyncBatchNorm against nn.BatchNorm run in one process on the global batch.

Each rank normalises its slice of one global batch (same seed everywhere, slices of the sizes a case
names, empty ones included); the concatenated outputs and input gradients, the summed parameter
gradients (the loss is a sum, so the global gradient is the sum of the ranks') and every rank's running
statistics must equal ``nn.BatchNorm*d`` applied to the whole batch. On a GPU it must also equal
torch's own SyncBatchNorm.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

import ddpkit
from ddpkit.ddp.sync_batchnorm_function import local_moments, local_sums

C = 4
_BATCHNORM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


@dataclass(frozen=True)
class Case:
    name: str
    sizes: tuple[int, ...]  # per-rank batch sizes; len(sizes) is the world size
    spatial: tuple[int, ...] = (3, 5)  # the dims after (N, C): () for (N, C), (L,), (H, W), (D, H, W)
    kwargs: dict = field(default_factory=dict)  # for the BatchNorm constructors
    channels_last: bool = False
    steps: int = 2  # forwards (with backward) before the comparison: running stats compound
    eval_after: bool = False  # then one eval forward, which must communicate nothing
    dtype: torch.dtype = torch.float32
    subgroup: tuple[int, ...] | None = None  # ranks of a dist.new_group to synchronise over


# torch's BatchNorm takes ``bias`` from 2.12 on; before, ddpkit's has it and torch's has not
TORCH_HAS_BIAS = "bias" in __import__("inspect").signature(nn.BatchNorm1d).parameters
_NEEDS_BIAS = pytest.mark.skipif(not TORCH_HAS_BIAS, reason="torch's BatchNorm has no bias argument before 2.12")

CASES = [
    Case("2d_input", (6, 6), spatial=()),
    Case("3d_input", (4, 4), spatial=(7,)),
    Case("4d_input", (3, 3)),
    Case("5d_input", (2, 2), spatial=(2, 3, 2)),
    Case("channels_last", (3, 3), spatial=(4, 5), channels_last=True),
    Case("uneven_batches", (2, 5), spatial=(3,)),
    Case("three_ranks_uneven", (1, 4, 2)),
    Case("a_rank_with_an_empty_batch", (3, 0, 4), spatial=(5,)),
    Case("eval_mode", (3, 3), eval_after=True),
    Case("affine_false", (3, 3), kwargs={"affine": False}),
    pytest.param(Case("no_bias", (3, 3), kwargs={"bias": False}), marks=_NEEDS_BIAS, id="no_bias"),
    Case("momentum_none", (3, 5), kwargs={"momentum": None}, steps=3),
    Case("no_running_stats", (3, 3), kwargs={"track_running_stats": False}),
    Case("float64", (3, 4), dtype=torch.float64),
    Case("subgroup_of_ranks_0_1", (3, 5, 2), subgroup=(0, 1), eval_after=True),
]


def _global_data(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` and the output gradient fed to backward: the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    shape = (sum(case.sizes), C, *case.spatial)
    x = torch.randn(shape, generator=g, dtype=case.dtype) * 3 + 2  # a mean away from 0, a spread above 1
    return x, torch.randn(shape, generator=g, dtype=case.dtype)


def _slice(t: torch.Tensor, case: Case, rank: int) -> torch.Tensor:
    start = sum(case.sizes[:rank])
    return t[start:start + case.sizes[rank]]


def _layout(t: torch.Tensor, case: Case) -> torch.Tensor:
    if not case.channels_last:
        return t
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return t.contiguous(memory_format=fmt)


def _fresh_bn(case: Case, cls) -> nn.Module:
    torch.manual_seed(0)
    bn = cls(C, **case.kwargs).to(case.dtype)
    if bn.affine:  # weights away from 1 and biases away from 0, so that a missed factor shows
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            if bn.bias is not None:
                bn.bias.uniform_(-1, 1)
    return bn


def _run(bn: nn.Module, case: Case, members: tuple[int, ...], rank: int | None) -> dict:
    """Train ``bn`` ``case.steps`` times on the batch of ``members`` (its ``rank``'s slice, or the whole
    of it when ``rank`` is None), then maybe evaluate; return what the test compares."""
    out: dict = {"y": [], "x_grad": []}
    sub = Case(case.name, tuple(case.sizes[r] for r in members), case.spatial, case.kwargs,
               case.channels_last, case.steps, case.eval_after, case.dtype)
    for step in range(case.steps):
        x, dy = _global_data(case, step)
        x, dy = torch.cat([_slice(x, case, r) for r in members]), torch.cat([_slice(dy, case, r) for r in members])
        if rank is not None:
            x, dy = _slice(x, sub, members.index(rank)), _slice(dy, sub, members.index(rank))
        x = _layout(x, case).requires_grad_()
        y = bn(x)
        y.backward(_layout(dy, case))
        out["y"].append(y.detach())
        out["x_grad"].append(x.grad)
        out["channels_last"] = case.channels_last and y.is_contiguous(memory_format=torch.channels_last)
    out["params"] = {n: p.grad.clone() for n, p in bn.named_parameters()}
    out["buffers"] = {n: b.clone() for n, b in bn.named_buffers()}
    if case.eval_after:
        bn.eval()
        x, _ = _global_data(case, case.steps)
        x = torch.cat([_slice(x, case, r) for r in members])
        out["eval_y"] = bn(x if rank is None else _slice(x, sub, members.index(rank)))
    return out


def _case_worker(case: Case) -> dict:
    rank = dist.get_rank()
    group = dist.new_group(list(case.subgroup)) if case.subgroup else None  # every rank must call it
    members = case.subgroup if case.subgroup and rank in case.subgroup else (
        tuple(range(len(case.sizes))) if not case.subgroup else (rank,))
    bn = _fresh_bn(case, lambda c, **kw: ddpkit.SyncBatchNorm(c, process_group=group, **kw))
    calls = {"n": 0}
    gather, reduce = dist.all_gather, dist.all_reduce
    try:
        if case.eval_after:  # count the collectives of the eval forward only
            def counted(fn):
                def wrapper(*args, **kwargs):
                    calls["n"] += 1
                    return fn(*args, **kwargs)
                return wrapper
            original_eval = bn.eval

            def eval_and_count():
                dist.all_gather, dist.all_reduce = counted(gather), counted(reduce)
                return original_eval()
            bn.eval = eval_and_count
        out = _run(bn, case, members, rank)
    finally:
        dist.all_gather, dist.all_reduce = gather, reduce
    out["eval_collectives"] = calls["n"]
    out["members"] = members
    return out


def _assert_close(actual, expected, case: Case) -> None:
    tol = 1e-5 if case.dtype == torch.float32 else 1e-10
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(case: Case):
    results = run_ranks(_case_worker, len(case.sizes), args=(case,), timeout=60)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, result in enumerate(results):
        groups.setdefault(tuple(result["members"]), []).append(rank)
    for members, ranks in groups.items():
        ref = _run(_fresh_bn(case, _BATCHNORM[2 + len(case.spatial)]), case, members, None)
        for step in range(case.steps):
            _assert_close(torch.cat([results[r]["y"][step] for r in ranks]), ref["y"][step], case)
            _assert_close(torch.cat([results[r]["x_grad"][step] for r in ranks]), ref["x_grad"][step], case)
        for name, grad in ref["params"].items():
            _assert_close(sum(results[r]["params"][name] for r in ranks), grad, case)
        for rank in ranks:
            assert results[rank]["buffers"].keys() == ref["buffers"].keys()
            for name, buffer in ref["buffers"].items():
                _assert_close(results[rank]["buffers"][name], buffer, case)
            assert results[rank]["channels_last"] == ref["channels_last"]
        if case.eval_after:
            _assert_close(torch.cat([results[r]["eval_y"] for r in ranks]), ref["eval_y"], case)
    if case.eval_after:  # eval normalises with the running statistics: nothing to synchronise
        assert [r["eval_collectives"] for r in results] == [0] * len(results)


def _tiny_batches_worker() -> dict:
    """A global batch of one value per channel, then an empty one everywhere."""
    rank, out = dist.get_rank(), {}
    bn = ddpkit.SyncBatchNorm(C)
    try:
        bn(torch.randn(1 - rank, C))  # rank 0 has the one sample, rank 1 none
    except ValueError as e:
        out["one"] = str(e)
    y = bn(torch.randn(0, C, 3, requires_grad=True))
    y.sum().backward()
    out["empty"] = (y.shape, bn.running_mean.clone(), bn.running_var.clone(), bn.weight.grad.clone())
    return out


@pytest.mark.timeout(60)
def test_a_global_batch_of_one_raises_on_every_rank_and_an_empty_one_changes_nothing():
    reference = nn.BatchNorm1d(C)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as batchnorm_error:
        reference(torch.randn(1, C))
    reference(torch.randn(0, C, 3))  # BatchNorm on an empty batch: empty output, statistics untouched
    for rank, out in enumerate(run_ranks(_tiny_batches_worker, 2, timeout=30)):
        assert "Expected more than 1 value per channel when training" in out["one"]
        assert out["one"].startswith(f"SyncBatchNorm on rank {rank}:") and "HINT:" in out["one"]
        assert batchnorm_error.type is ValueError
        shape, mean, var, weight_grad = out["empty"]
        assert shape == (0, C, 3)
        torch.testing.assert_close((mean, var), (reference.running_mean, reference.running_var), atol=0, rtol=0)
        torch.testing.assert_close(weight_grad, torch.zeros(C), atol=0, rtol=0)


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_fused_cpu_kernels_equal_the_plain_ops_that_other_devices_use(channels_last: bool):
    """The GPU path (var_mean and plain sums) is checked here on CPU, against the fused CPU kernels
    and a float64 hand computation."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(6, C, 5, 7, generator=g) * 3 + 2, torch.randn(6, C, 5, 7, generator=g)
    if channels_last:
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    x64, dy64 = x.double(), dy.double()
    mean64 = x64.mean((0, 2, 3))
    m2_64 = ((x64 - mean64.view(1, -1, 1, 1)) ** 2).sum((0, 2, 3))
    invstd64 = (m2_64 / 210 + 1e-5).rsqrt()
    sums64 = (dy64.sum((0, 2, 3)), (dy64 * (x64 - mean64.view(1, -1, 1, 1))).sum((0, 2, 3)) * invstd64)
    for fused in (True, False):
        mean, m2, count = local_moments(x, fused=fused)
        assert count == 6 * 5 * 7
        torch.testing.assert_close((mean.double(), m2.double()), (mean64, m2_64), atol=1e-4, rtol=1e-5)
        var = m2 / count
        sums = local_sums(dy, x, mean, var, (var + 1e-5).rsqrt(), 1e-5, fused=fused)
        torch.testing.assert_close(tuple(t.double() for t in sums), sums64, atol=1e-4, rtol=1e-5)


def test_world_of_one_is_plain_batchnorm():
    """No process group: the layer is BatchNorm, with no collective to call."""
    assert not dist.is_initialized()
    case = Case("single", (5,), kwargs={"momentum": None}, steps=3)
    mine = _run(_fresh_bn(case, ddpkit.SyncBatchNorm), case, (0,), None)
    ref = _run(_fresh_bn(case, nn.BatchNorm2d), case, (0,), None)
    for key in ("y", "x_grad", "params", "buffers"):
        torch.testing.assert_close(mine[key], ref[key], atol=0, rtol=0)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.BatchNorm1d(6, momentum=None),
                                  nn.Linear(6, 2))

    def forward(self, x):
        return self.head(self.features(x))


_TRAIN_SIZES = (3, 5)  # uneven: each rank's loss is its share of the global mean


def _train(model: nn.Module, rank: int | None, steps: int = 3) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    total = sum(_TRAIN_SIZES)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(total, 3, 6, 6, generator=g), torch.randn(total, 2, generator=g)
        if rank is not None:
            start = sum(_TRAIN_SIZES[:rank])
            x, target = x[start:start + _TRAIN_SIZES[rank]], target[start:start + _TRAIN_SIZES[rank]]
        # DDP averages over ranks: scaling each rank's sum by world / total gives the global mean's gradient
        scale = (len(_TRAIN_SIZES) if rank is not None else 1) / total
        loss = (model(x) - target).square().sum() * scale
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.module.state_dict() if rank is not None else model.state_dict()
    return {k: v.clone() for k, v in state.items()}


def _ddp_worker(wrapper: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ddpkit.SyncBatchNorm.convert_sync_batchnorm(_Net())
    cls = ddpkit.DDP if wrapper == "ddpkit" else nn.parallel.DistributedDataParallel
    return _train(cls(model), dist.get_rank())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("wrapper", ["ddpkit", "torch"])
def test_training_inside_ddp_equals_single_process_training(wrapper: str):
    torch.manual_seed(0)
    reference = _train(_Net(), None)
    for state in run_ranks(_ddp_worker, len(_TRAIN_SIZES), args=(wrapper,), timeout=60):
        assert state.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5, msg=name)


def test_convert_sync_batchnorm_keeps_names_state_and_flags():
    net = _Net()
    net.features[1].qconfig = "a qconfig"
    net.head[2].eval()
    params, state = dict(net.named_parameters()), net.state_dict()
    converted = ddpkit.SyncBatchNorm.convert_sync_batchnorm(net)
    assert converted is net  # the tree is kept; only the BatchNorm leaves are new
    assert type(net.features[1]) is ddpkit.SyncBatchNorm and type(net.head[2]) is ddpkit.SyncBatchNorm
    # a BatchNorm to code that checks, but not torch's SyncBatchNorm, which torch's DDP refuses on CPU
    assert isinstance(net.features[1], nn.modules.batchnorm._BatchNorm)
    assert not isinstance(net.features[1], nn.SyncBatchNorm)
    assert dict(net.named_parameters()) == params  # the same Parameter objects under the same names
    assert net.state_dict().keys() == state.keys()
    for name, value in net.state_dict().items():
        assert value is state[name] or torch.equal(value, state[name])
    assert net.features[1].qconfig == "a qconfig" and not hasattr(net.head[2], "qconfig")
    assert net.features[1].training and not net.head[2].training
    assert net.head[2].momentum is None and net.head[2].process_group is None


def test_convert_of_a_batchnorm_itself_returns_a_new_layer_with_the_group():
    bn = nn.BatchNorm3d(5, eps=1e-3, affine=False, track_running_stats=False)
    group = object()  # stands for a process group: convert only stores it
    converted = ddpkit.SyncBatchNorm.convert_sync_batchnorm(bn, process_group=group)
    assert type(converted) is ddpkit.SyncBatchNorm and converted is not bn
    assert (converted.num_features, converted.eps, converted.affine, converted.track_running_stats) == (
        5, 1e-3, False, False)
    assert converted.process_group is group and converted.running_mean is None


def test_constructor_is_torchs():
    import inspect

    def arguments(cls):  # names, kinds and defaults (annotations differ only in being strings here)
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]

    ours = arguments(ddpkit.SyncBatchNorm)
    assert ours == arguments(nn.SyncBatchNorm) + ([] if TORCH_HAS_BIAS else [("bias", ours[-1][1], True)])
    assert "SyncBatchNorm" in ddpkit.__all__ and ddpkit.SyncBatchNorm is ddpkit.ddp.SyncBatchNorm
    if TORCH_HAS_BIAS:
        bias_free = ddpkit.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3, bias=False))
        assert bias_free.bias is None and bias_free.weight is not None
    with pytest.raises(ValueError, match="expected at least 2D input"):
        ddpkit.SyncBatchNorm(3)(torch.ones(3))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        ddpkit.SyncBatchNorm(3)(torch.ones(1, 3))  # a world of one: BatchNorm's own check


def _cuda_worker(sizes: tuple[int, ...], channels_last: bool) -> dict[str, list[torch.Tensor]]:
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    x = torch.randn(sum(sizes), C, 5, 5, device="cuda") * 2 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    dy, start = torch.randn_like(x), sum(sizes[:rank])
    for kind, cls in (("ddpkit", ddpkit.SyncBatchNorm), ("torch", nn.SyncBatchNorm)):
        torch.manual_seed(1)
        bn = cls(C).cuda()
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
        mine = x[start:start + sizes[rank]].clone().requires_grad_()
        for _ in range(2):  # the second step normalises with the first step's running statistics mixed in
            mine.grad = None
            y = bn(mine)
            y.backward(dy[start:start + sizes[rank]])
        out[kind] = [y.detach().cpu(), mine.grad.cpu(), bn.weight.grad.cpu(), bn.bias.grad.cpu(),
                     bn.running_mean.cpu(), bn.running_var.cpu()]
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's SyncBatchNorm runs only on GPUs; no CUDA here")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sizes, channels_last", [((3, 4), False), ((2, 5), True)])
def test_on_gpu_equals_torchs_sync_batchnorm(sizes: tuple[int, ...], channels_last: bool):
    """Both ranks on the one GPU, over Gloo (which takes CUDA tensors): torch's Function is the reference."""
    for result in run_ranks(_cuda_worker, len(sizes), args=(sizes, channels_last), timeout=90):
        for mine, ref in zip(result["ddpkit"], result["torch"]):
            torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
