"""torch 2.13's newer DDP constructor arguments, where the side-by-side training of test_ddp.py cannot
tell: warnings, buffers at construction, bucket layouts, collectives skipped, a DeviceMesh, the
delayed all-reduce. Each compares with torch's DDP on Gloo ranks, or a hand computation."""
from __future__ import annotations

import copy
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ranks import RankFailure, run_ranks
from torch import nn

import ddpkit
from ddpkit.ddp.options import bucket_cap_list, resolve_group

TORCH_DDP = nn.parallel.DistributedDataParallel


# ---- single process: refusals that need no process group --------------------------------------
@pytest.mark.parametrize("given", ["delay_all_reduce_named_params", "param_to_hook_all_reduce"])
def test_delayed_parameters_and_their_hook_parameter_come_together(given):
    model = nn.Linear(2, 2)
    value = [("weight", model.weight)] if given == "delay_all_reduce_named_params" else model.weight
    with pytest.raises(ValueError, match=rf"need to be set at the same time, but only {given} was"):
        ddpkit.DDP(model, **{given: value})


def test_device_mesh_rules_are_torchs():
    with pytest.raises(RuntimeError, match="Cannot specify both process_group and device_mesh arguments"):
        resolve_group(object(), SimpleNamespace(ndim=1))
    with pytest.raises(RuntimeError, match=r"Only 1D device mesh is supported.*2 dimensions"):
        resolve_group(None, SimpleNamespace(ndim=2))
    group = object()
    assert resolve_group(None, SimpleNamespace(ndim=1, get_group=lambda mesh_dim: group)) is group


def test_bucket_cap_mb_list_is_in_mib_and_checked():
    assert bucket_cap_list([1, 0.5]) == (2**20, 2**19) and bucket_cap_list([]) == bucket_cap_list(None) == ()
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list=\[1, -2\] holds -2"):
        bucket_cap_list([1, -2])


# ---- warnings and buffers at construction, against torch -----------------------------------------
class _RankBuffer(nn.Module):
    """A buffer that starts as 10 + rank: which rank's value survives construction and forward."""

    def __init__(self, rank: int):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("mark", torch.full((1,), 10.0 + rank))

    def forward(self, x):
        return self.lin(x)


_BUFFER_CASES = [{}, {"broadcast_buffers": False}, {"broadcast_buffers": True}, {"forward_sync_buffers": False},
                 {"broadcast_buffers": False, "forward_sync_buffers": False}, {"check_reduction": True},
                 {"static_graph": True, "find_unused_parameters": True}]


def _buffers_worker() -> list[dict]:
    rank = dist.get_rank()
    out = []
    for kwargs in _BUFFER_CASES:
        got = {}
        for kind, cls in (("ddpkit", ddpkit.DDP), ("torch", TORCH_DDP)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ddp = cls(_RankBuffer(rank), **kwargs)
            after_init = ddp.module.mark.item()
            ddp.module.mark.fill_(20.0 + rank)
            ddp(torch.ones(1, 3))
            got[kind] = {"init": after_init, "forward": ddp.module.mark.item(),
                         "attrs": (ddp.broadcast_buffers, ddp.forward_sync_buffers),
                         # where: both point at the caller's line, not into DDP
                         "warnings": sorted((w.category.__name__, str(w.message), os.path.basename(w.filename))
                                            for w in caught if issubclass(w.category, FutureWarning)),
                         # torch warns this one from inside its DDP: compared by its words only
                         "static": [str(w.message) for w in caught if "_set_static_graph" in str(w.message)]}
        out.append(got)
    return out


@pytest.mark.timeout(60)
def test_buffer_sync_and_deprecation_warnings_are_torchs():
    per_rank = run_ranks(_buffers_worker, 2, timeout=45)
    for rank, results in enumerate(per_rank):
        for kwargs, got in zip(_BUFFER_CASES, results):
            assert got["ddpkit"] == got["torch"], (rank, kwargs)
    rank1 = dict(zip(map(str, _BUFFER_CASES), per_rank[1]))
    # the hand-worked meaning on rank 1: init 10 is rank 0's value, 11 its own; forward 20 / 21 likewise
    assert rank1["{}"]["ddpkit"]["init"] == 10 and rank1["{}"]["ddpkit"]["forward"] == 20
    assert rank1[str({"forward_sync_buffers": False})]["ddpkit"]["init"] == 10  # init sync stays
    assert rank1[str({"forward_sync_buffers": False})]["ddpkit"]["forward"] == 21
    assert rank1[str({"broadcast_buffers": False})]["ddpkit"]["init"] == 11
    assert [w[::2] for w in rank1[str({"check_reduction": True})]["ddpkit"]["warnings"]] == [
        ("FutureWarning", "test_constructor.py")]
    assert "check_reduction" in rank1[str({"check_reduction": True})]["ddpkit"]["warnings"][0][1]
    static = rank1[str({"static_graph": True, "find_unused_parameters": True})]["ddpkit"]["static"]
    assert len(static) == 1 and static[0].startswith("You passed find_unused_parameters=true")


def _init_sync_off_worker() -> dict:
    """init_sync=False: no check and no broadcast, so ranks may even hold different shapes."""
    rank = dist.get_rank()
    out = {}
    for kind, cls in (("ddpkit", ddpkit.DDP), ("torch", TORCH_DDP)):
        torch.manual_seed(rank)
        model = nn.Linear(3, 2 + rank)  # refused with init_sync=True
        ddp = cls(model, init_sync=False)
        out[kind] = [p.detach().clone() for p in ddp.parameters()]
    torch.manual_seed(rank)
    out["own"] = [p.detach() for p in nn.Linear(3, 2 + rank).parameters()]
    with pytest.raises(RuntimeError):
        ddpkit.DDP(nn.Linear(3, 2 + rank))  # the check is on by default
    return out


@pytest.mark.timeout(60)
def test_init_sync_false_neither_checks_nor_broadcasts_like_torch():
    for out in run_ranks(_init_sync_off_worker, 2, timeout=45):
        for mine, theirs, own in zip(out["ddpkit"], out["torch"], out["own"]):
            assert torch.equal(mine, theirs) and torch.equal(mine, own)


def _strided_on_rank_1_worker(in_channels: int) -> list[torch.Tensor]:
    """A conv weight in channels_last on rank 1 only; returns the averaged gradient."""
    torch.manual_seed(0)
    model = nn.Conv2d(in_channels, 4, 3)
    if dist.get_rank() == 1:
        model = model.to(memory_format=torch.channels_last)
    ddp = ddpkit.DDP(model)
    x = torch.randn(2, in_channels, 5, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    ddp(x).square().sum().backward()
    own = torch.func.grad(lambda w: torch.nn.functional.conv2d(x, w, model.bias).square().sum())(model.weight.detach())
    dist.all_reduce(own)
    return [model.weight.grad, own / 2]


@pytest.mark.timeout(60)
def test_a_parameter_strided_otherwise_on_one_rank_is_refused_on_every_rank():
    # its gradient would be summed with another rank's elements; torch raises on the odd rank only
    with pytest.raises(RankFailure) as info:
        run_ranks(_strided_on_rank_1_worker, 2, args=(3,))
    assert sorted(info.value.failures) == [0, 1]
    for text in info.value.failures.values():
        assert "RanksDisagreeError: DDP expects same model across all ranks" in text
        assert ("parameter #0 with sizes [4, 3, 3, 3] appears not to match strides of the same param in "
                "process 0: rank 0 has 'weight' with strides [27, 9, 3, 1], rank 1 has 'weight' with strides "
                "[27, 1, 9, 3]") in text


def _object_collective_on_rank_0_only_worker() -> None:
    config = {"hidden": 16}
    if dist.get_rank() == 0:
        config = ddpkit.broadcast_object(config)  # the bug: rank 0 alone calls it
    ddpkit.DDP(nn.Linear(8, config["hidden"]))


@pytest.mark.timeout(60)
def test_a_collective_called_on_rank_0_alone_before_the_construction_is_named_not_an_unpacking_error():
    # rank 1 received rank 0's config where rank 0's parameter list was due: "not enough values to unpack"
    with pytest.raises(RankFailure) as info:
        run_ranks(_object_collective_on_rank_0_only_worker, 2, timeout=45)
    said = info.value.failures[1]
    assert ("RanksDisagreeError: DistributedDataParallel on rank 1 expected rank 0's list of parameters and "
            "buffers, but received dict {'hidden': 16}: the ranks called different collectives") in said


@pytest.mark.timeout(60)
def test_strides_of_size_one_dimensions_place_nothing_and_pass():
    # a one-channel weight is laid out alike either way, though torch compares the raw strides
    for grad, expected in run_ranks(_strided_on_rank_1_worker, 2, args=(1,)):
        torch.testing.assert_close(grad, expected)


# ---- bucket layouts and collectives -------------------------------------------------------------
def _layout_worker(cap_list: list[float]) -> dict:
    """ddpkit's buckets (no hook) and torch's (seen through a recording hook), step by step."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 600), nn.ReLU(), nn.Linear(600, 700), nn.ReLU(), nn.Linear(700, 3))
    shapes = {}
    theirs: list[list[list[tuple]]] = []

    def record(state, bucket):
        theirs[-1].append([tuple(p.shape) for p in bucket.parameters()])
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    mine = ddpkit.DDP(_copy(base), bucket_cap_mb_list=cap_list)
    ref = TORCH_DDP(_copy(base), bucket_cap_mb_list=cap_list)
    ref.register_comm_hook(None, record)
    shapes["ddpkit"] = []
    for _ in range(3):
        x = torch.randn(2, 4)
        out = mine(x)
        shapes["ddpkit"].append([[tuple(p.shape) for p in b.parameters()] for b in mine.reducer.buckets])
        out.sum().backward()
        theirs.append([])
        ref(x).sum().backward()
    shapes["torch"] = theirs
    return shapes


def _copy(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cap_list", [[0.01, 1, 0.5], [0.002], [3, 0]])
def test_bucket_cap_mb_list_gives_torchs_buckets_before_and_after_the_rebuild(cap_list):
    for shapes in run_ranks(_layout_worker, 2, args=(cap_list,), timeout=45):
        assert shapes["ddpkit"] == shapes["torch"]


class _LargeNet(nn.Module):
    """torch's own test model for skip_all_reduce_unused_params: fc2 is unused on every rank."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(100, 500, bias=False)
        self.fc2 = nn.Linear(100, 100, bias=False)

    def forward(self, x):
        return self.fc1(x)


def _skip_worker() -> dict:
    """Bucket all-reduces in the last of three backwards, with and without skip_all_reduce_unused_params."""
    from ddpkit.ddp.collectives import Collectives

    counted = [0]
    real = Collectives.all_reduce_bucket

    def counting(self, bucket):
        counted[0] += 1
        return real(self, bucket)

    Collectives.all_reduce_bucket = counting
    out = {}
    for skip in (False, True):
        torch.manual_seed(0)
        model = _LargeNet()
        kwargs = dict(find_unused_parameters=True, bucket_cap_mb=0.15, skip_all_reduce_unused_params=skip)
        mine, ref = ddpkit.DDP(_copy(model), **kwargs), TORCH_DDP(_copy(model), **kwargs)
        x = torch.randn(4, 100) + dist.get_rank()
        for _ in range(3):
            counted[0] = 0
            mine(x).sum().backward()
            ref(x).sum().backward()
        out[skip] = {"ddpkit": counted[0], "torch": ref._get_ddp_logging_data().get("num_buckets_reduced"),
                     "buckets": len(mine.reducer.buckets),
                     "grads": [None if p.grad is None else p.grad.clone() for p in mine.parameters()],
                     "torch_grads": [None if p.grad is None else p.grad.clone() for p in ref.parameters()]}
    return out


@pytest.mark.timeout(60)
def test_skip_all_reduce_unused_params_leaves_out_the_unused_bucket_as_torch_does():
    for out in run_ranks(_skip_worker, 2, timeout=45):
        for skip in (False, True):
            mine, theirs = out[skip]["grads"], out[skip]["torch_grads"]
            assert [g is None for g in mine] == [g is None for g in theirs] == [False, True]
            assert torch.allclose(mine[0], theirs[0], atol=1e-5)
        # torch reduces fc1's bucket and fc2's, or only fc1's; with skip ddpkit keeps torch's two
        # buckets (without it, on CPU, one: Note [Bucket layout on CPU]) and reduces only fc1's
        assert (out[False]["torch"], out[True]["torch"]) == (2, 1)
        assert (out[True]["buckets"], out[True]["ddpkit"]) == (2, 1)


def _join_refused_worker() -> list[str]:
    model = _LargeNet()
    refused = []
    for kwargs in ({"find_unused_parameters": True, "skip_all_reduce_unused_params": True},
                   {"delay_all_reduce_named_params": [("fc2.weight", model.fc2.weight)],
                    "param_to_hook_all_reduce": model.fc1.weight}):
        ddp = ddpkit.DDP(_copy(model) if "delay_all_reduce_named_params" not in kwargs else model, **kwargs)
        with pytest.raises(NotImplementedError) as caught:
            ddp.join()
        refused.append(str(caught.value))
    return refused


@pytest.mark.timeout(60)
def test_join_refuses_the_options_a_joined_rank_cannot_shadow():
    for rank, refused in enumerate(run_ranks(_join_refused_worker, 2, timeout=45)):
        assert f"DistributedDataParallel on rank {rank}: join() cannot be used with skip_all_reduce" in refused[0]
        assert "join() cannot be used with delay_all_reduce_named_params" in refused[1] and "HINT: " in refused[1]


# ---- a DeviceMesh for the group; delayed parameters -----------------------------------------------
def _train(ddp: nn.Module, rank: int, steps: int = 3, after_backward=None) -> list[torch.Tensor]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ddp(torch.randn(5, 4, generator=data) + rank).square().mean().backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _mlp(rank: int) -> nn.Module:
    torch.manual_seed(rank)  # different weights per rank: construction must broadcast rank 0's
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _device_mesh_worker() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    mine = ddpkit.DDP(_mlp(rank), device_mesh=mesh)
    errors = []
    for cls in (ddpkit.DDP, TORCH_DDP):
        try:
            cls(_mlp(rank), device_mesh=mesh, process_group=dist.group.WORLD)
        except RuntimeError as e:
            errors.append(str(e))
    return {"group": mine.process_group is mesh.get_group(0), "errors": errors,
            "ddpkit": _train(mine, rank), "torch": _train(TORCH_DDP(_mlp(rank), device_mesh=mesh), rank)}


@pytest.mark.timeout(60)
def test_a_1d_device_mesh_stands_for_its_group_and_not_with_process_group():
    for out in run_ranks(_device_mesh_worker, 2, timeout=45):
        assert out["group"]
        assert len(out["errors"]) == 2 and all("Cannot specify both process_group and device_mesh" in e
                                               for e in out["errors"])
        for mine, theirs in zip(out["ddpkit"], out["torch"]):
            assert torch.allclose(mine, theirs, atol=1e-6)


def _delay_worker(delay_all: bool) -> dict:
    rank = dist.get_rank()
    out = {}
    # torch cannot delay every parameter (its device check then sees none and raises): for that case
    # the reference is single-process training on both ranks' batches, from rank 0's weights
    for kind, cls in (("ddpkit", ddpkit.DDP),) + ((("torch", TORCH_DDP),) if not delay_all else ()):
        model = _mlp(rank)
        delayed = list(model.named_parameters()) if delay_all else list(model[4].named_parameters(prefix="4"))
        ddp = cls(model, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=model[0].weight)
        # torch never waits for its delayed all-reduce; a Gloo barrier waits for every earlier collective
        out[kind] = _train(ddp, rank, after_backward=dist.barrier)
    if delay_all:
        out["torch"] = _global_batch_reference()
    return out


def _global_batch_reference(steps: int = 3) -> list[torch.Tensor]:
    """What averaged gradients give: the mean of the ranks' losses, on one process."""
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.Generator().manual_seed(r) for r in range(2)]
    for _ in range(steps):
        sum(model(torch.randn(5, 4, generator=data[r]) + r).square().mean() for r in range(2)).div(2).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay_all", [False, True])
def test_delayed_parameters_are_averaged_after_the_hook_parameters_gradient_like_torch(delay_all):
    per_rank = run_ranks(_delay_worker, 2, args=(delay_all,), timeout=45)
    for out in per_rank:
        for mine, theirs in zip(out["ddpkit"], out["torch"]):
            assert torch.allclose(mine, theirs, atol=1e-6)
    for a, b in zip(per_rank[0]["ddpkit"], per_rank[1]["ddpkit"]):  # averaged: the ranks agree
        assert torch.equal(a, b)


def _delayed_before_its_hook_worker() -> dict:
    """The first layer delayed, the last layer's weight as the hook: the delayed gradient comes after
    the launch. torch averages it incomplete (the ranks then differ); ddpkit raises on every rank."""
    rank = dist.get_rank()
    model = _mlp(rank)
    ddp = ddpkit.DDP(model, delay_all_reduce_named_params=[("0.weight", model[0].weight)],
                     param_to_hook_all_reduce=model[4].weight)
    with ddp.no_sync():  # no all-reduce under no_sync: nothing to be late for
        ddp(torch.ones(2, 4)).sum().backward()
    try:
        ddp(torch.ones(2, 4)).sum().backward()
    except ddpkit.LateGradientError as e:
        return {"type": type(e).__name__, "text": str(e), "facts": (e.rank, e.parameter, e.hook_parameter)}
    return {"type": None}


@pytest.mark.timeout(60)
def test_a_delayed_gradient_computed_after_its_hook_parameters_raises_on_every_rank():
    for rank, out in enumerate(run_ranks(_delayed_before_its_hook_worker, 2, timeout=45)):
        assert out["type"] == "LateGradientError", out
        assert out["facts"] == (rank, "0.weight", "4.weight")
        assert "'0.weight', one of delay_all_reduce_named_params, was computed after" in out["text"]
        assert "param_to_hook_all_reduce ('4.weight')" in out["text"] and "HINT:" in out["text"]


# ---- the construction-time check across ranks ----------------------------------------------------
def _disagree_on_three_worker() -> dict[str, tuple | None]:
    """Rank 0's list is broadcast and compared: the first rank that differs or refuses is named on
    every rank, whichever rank that is, in a subgroup too. Per case: (type, text, differing_rank)."""
    from ddpkit.errors import RanksDisagreeError

    rank = dist.get_rank()

    def caught(build) -> BaseException | None:
        try:
            build()
        except (RanksDisagreeError, TypeError) as e:
            return e
        return None

    sub = dist.new_group([1, 2])
    out = {
        "rank2_differs": caught(lambda: ddpkit.DDP(nn.Linear(4, 4 + (rank == 2)))),
        "two_refuse": caught(lambda: ddpkit.DDP(nn.Linear(4, 4) if rank == 0 else f"model{rank}")),
        "same": caught(lambda: ddpkit.DDP(nn.Linear(4, 4))),
        # the same tensors under other names (another container on rank 2): torch's DDP trains it
        "renamed": caught(lambda: ddpkit.DDP(nn.Sequential(nn.Linear(4, 4)) if rank == 2 else nn.Linear(4, 4))),
    }
    if rank in (1, 2):  # group rank 1 of [1, 2] is global rank 2
        out["subgroup"] = caught(lambda: ddpkit.DDP(nn.Linear(3 + (rank == 2), 4), process_group=sub))
    return {k: None if e is None else (type(e).__name__, str(e), getattr(e, "differing_rank", None))
            for k, e in out.items()}


@pytest.mark.timeout(90)
def test_the_first_rank_that_differs_or_refuses_is_named_on_every_rank():
    results = run_ranks(_disagree_on_three_worker, 3, timeout=75)
    for rank, out in enumerate(results):
        kind, text, differing = out["rank2_differs"]
        assert (kind, differing) == ("RanksDisagreeError", 2), out
        assert ("tensor #0 differs: rank 0 has 'weight' with shape [4, 4] (float32), rank 2 has 'weight' "
                "with shape [5, 4] (float32), so tensor #0 with sizes [5, 4] appears not to match sizes of the "
                f"same param in process 0 (this is rank {rank})") in text
        kind, text, differing = out["two_refuse"]
        if rank == 0:  # ranks 1 and 2 refused their own arguments: the first of them is named
            assert (kind, differing) == ("RanksDisagreeError", 1), out
            assert text.startswith("DistributedDataParallel could not be built on rank 1: NotAModuleError: "
                                   "DistributedDataParallel wraps a torch.nn.Module, got str 'model1'")
        else:
            assert kind == "NotAModuleError" and f"'model{rank}'" in text, out
        assert out["same"] is None and out["renamed"] is None
    for rank in (1, 2):
        kind, text, differing = results[rank]["subgroup"]
        assert (kind, differing) == ("RanksDisagreeError", 1), results[rank]
        assert "rank 0 has 'weight' with shape [4, 3] (float32), rank 1 has 'weight' with shape [4, 4]" in text


class _TwoLayers(nn.Module):
    """Two layers of equal shapes, assigned in the order given: their parameters are listed so."""

    def __init__(self, first: str):
        super().__init__()
        for name in (first, "b" if first == "a" else "a"):
            setattr(self, name, nn.Linear(4, 4))

    def forward(self, x):
        return self.b(self.a(x))


def _reordered_worker() -> dict[str, list[str]]:
    """Per case, the warnings each rank gave while wrapping."""
    rank = dist.get_rank()
    out = {}
    for case, build in {
        # rank 1 assigned its layers in another order: 'b.weight' there is averaged with rank 0's 'a.weight'
        "reordered": lambda: _TwoLayers("b" if rank == 1 else "a"),
        "same": lambda: _TwoLayers("a"),
        # other names altogether (another container): matched by position, as torch's DDP trains it
        "renamed": lambda: nn.Sequential(nn.Linear(4, 4)) if rank == 1 else nn.Linear(4, 4),
    }.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddpkit.DDP(build())
        out[case] = [str(w.message) for w in caught if "another order" in str(w.message)]
    return out


@pytest.mark.timeout(60)
def test_a_rank_that_lists_rank_0s_parameters_in_another_order_is_warned():
    rank_0, rank_1 = run_ranks(_reordered_worker, 2, timeout=45)
    assert rank_0 == {"reordered": [], "same": [], "renamed": []}
    assert rank_1["same"] == [] and rank_1["renamed"] == [], rank_1
    warning, = rank_1["reordered"]
    assert warning.startswith("DistributedDataParallel on rank 1: this rank lists its parameters in another "
                              "order than rank 0: tensor #0 is 'b.weight' here and 'a.weight' on rank 0 "
                              "(shape [4, 4] on both)."), warning
    assert "HINT: build the model the same way on every rank" in warning


class _Scaled(nn.Module):
    """A parameter of the wrapped module itself (``scale``), beside a submodule's."""

    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.full((2,), scale))

    def forward(self, x):
        return self.lin(x) * self.scale


def _root_parameter_on_the_ignore_list():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, x = _Scaled(float(rank + 1)), torch.full((3, 4), float(rank + 1))
    alone = copy.deepcopy(model)
    alone(x).sum().backward()
    ddpkit.DDP._set_params_and_buffers_to_ignore_for_model(model, ["scale"])
    ddpkit.DDP(model)(x).sum().backward()
    return model.scale.tolist(), torch.equal(model.scale.grad, alone.scale.grad), model.lin.weight.grad.tolist()


@pytest.mark.timeout(60)
def test_a_parameter_of_the_module_itself_on_the_ignore_list_is_neither_broadcast_nor_averaged():
    # torch's reducer compares ".scale" (module name "" + "." + name) with the list, so averages it
    # anyway (docs/torch-compat.md); the submodule's gradient is averaged as usual
    (scale0, own0, lin0), (scale1, own1, lin1) = run_ranks(_root_parameter_on_the_ignore_list, 2)
    assert (scale0, scale1) == ([1.0, 1.0], [2.0, 2.0]) and own0 and own1
    assert lin0 == lin1
