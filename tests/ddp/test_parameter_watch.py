"""Gradients that DDP cannot average, said as such: parameters changed after wrapping, a module called directly.

DDP averages the parameters it was built with, in backwards that follow its own forward. torch's DDP
says nothing when a script replaces a head after wrapping (the new head trains on each rank alone),
and its error for the old head's missing gradient recommends find_unused_parameters=True, which hides
the change; nor when the script calls the wrapped module rather than the wrapper. ddpkit warns once,
and says in that error what became of the parameters.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks
from torch import nn

import ddpkit
from ddpkit.ddp.parameter_watch import ADDED, FROZEN, REMOVED, REPLACED, ParameterWatch


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.fc = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.body(x)))


def test_the_watch_tells_replaced_removed_frozen_and_added_parameters_apart():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    net[3].requires_grad_(False)  # frozen when wrapped: not DDP's
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    watch = ParameterWatch(net, named, ignored={"4.bias"})  # on DDP's ignore list
    assert watch.changes() == {}
    net[0] = nn.Linear(2, 2)
    net[1].weight.requires_grad_(False)
    net[2].bias = None
    net[3].requires_grad_(True)
    net.append(nn.Linear(2, 2))
    assert watch.changes() == {"0.weight": REPLACED, "0.bias": REPLACED, "1.weight": FROZEN, "2.bias": REMOVED,
                               "3.weight": ADDED, "3.bias": ADDED, "4.weight": ADDED}
    # of the names given only, as the error asks: no search for new ones
    assert watch.changes(["0.bias", "1.weight", "1.bias"]) == {"0.bias": REPLACED, "1.weight": FROZEN}


def test_an_ignored_parameter_is_no_change():
    net = nn.Sequential(nn.Linear(2, 2))
    watch = ParameterWatch(net, [("0.weight", net[0].weight)], ignored={"0.bias"})
    assert watch.changes() == {}


def _step(ddp: nn.Module, rank: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def _replaced_head_worker(find_unused: bool) -> tuple[str | None, list[str], float]:
    import torch.distributed as dist

    torch.manual_seed(0)
    ddp = ddpkit.DDP(_Net(), find_unused_parameters=find_unused)
    ddp.module.fc = nn.Linear(8, 2)  # a new head for the downstream task, after wrapping: too late
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _step(ddp, dist.get_rank(), steps=12)
        except ddpkit.UnusedParametersError as e:
            error = str(e)
    head = ddp.module.fc.weight.detach().clone()
    spread = [torch.zeros_like(head) for _ in range(2)]
    dist.all_gather(spread, head)
    return error, [str(w.message) for w in caught], float((spread[0] - spread[1]).abs().max())


@pytest.mark.timeout(60)
def test_a_head_replaced_after_wrapping_is_named_in_the_error_which_does_not_recommend_find_unused():
    for error, warned, _ in run_ranks(_replaced_head_worker, 2, args=(False,)):
        assert error is not None
        assert ("on every rank: 'fc.weight' replaced by a new parameter, 'fc.bias' replaced by a new "
                "parameter") in error
        hint = error.split("HINT: ")[1]
        assert hint.startswith("build the final model") and "would hide this error" in hint
        assert warned == []  # the error says it, at the first backward


@pytest.mark.timeout(60)
def test_a_head_replaced_after_wrapping_with_find_unused_warns_once_that_it_trains_alone():
    results = run_ranks(_replaced_head_worker, 2, args=(True,))
    for rank, (error, warned, spread) in enumerate(results):
        assert error is None and spread > 0  # torch's result too: the new head was never averaged
        changed = [w for w in warned if "parameters changed after it was wrapped" in w]
        assert len(changed) == 1, warned  # twelve steps, ten of them sampled: one warning
        assert changed[0].startswith(f"DistributedDataParallel on rank {rank}: ")
        assert "'fc.weight' (replaced by a new parameter), 'fc.bias' (replaced by a new parameter)" in changed[0]


def _frozen_then_unfrozen_worker() -> tuple[list[str], str | None]:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = _Net()
    net.body.requires_grad_(False)
    ddp = ddpkit.DDP(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.body.requires_grad_(True)  # unfrozen after wrapping: its gradients stay local
        _step(ddp, rank)
    net.body.requires_grad_(False)
    net.fc.bias.requires_grad_(False)  # frozen after wrapping: DDP waits for its gradient
    try:
        _step(ddp, rank, steps=1)
    except ddpkit.UnusedParametersError as e:
        return [str(w.message) for w in caught], str(e)
    return [str(w.message) for w in caught], None


@pytest.mark.timeout(60)
def test_layers_unfrozen_or_frozen_after_wrapping_are_named():
    for warned, error in run_ranks(_frozen_then_unfrozen_worker, 2):
        assert len(warned) == 1
        assert "'body.weight' (added or unfrozen), 'body.bias' (added or unfrozen)" in warned[0]
        assert error is not None and "on every rank: 'fc.bias' frozen (requires_grad=False)" in error


class _TiedFrozenIgnored(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.frozen, self.out = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10)
        self.out.weight = self.embed.weight  # tied
        self.frozen.requires_grad_(False)
        self.local = nn.Linear(4, 4)  # on DDP's ignore list: trains on each rank by design

    def forward(self, x):
        return self.out(self.frozen(self.embed(x))).sum() + self.local(torch.ones(4)).sum()


def _unchanged_worker() -> list[str]:
    net = _TiedFrozenIgnored()
    ddpkit.DDP._set_params_and_buffers_to_ignore_for_model(net, ["local.weight", "local.bias"])
    ddp = ddpkit.DDP(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(12):
            ddp(torch.arange(6)).backward()
    return [str(w.message) for w in caught]


@pytest.mark.timeout(60)
def test_tied_frozen_and_ignored_parameters_are_no_change():
    assert run_ranks(_unchanged_worker, 2) == [[], []]


def _group_of_one_worker() -> str | None:
    ddp = ddpkit.DDP(_Net())
    ddp.module.fc = nn.Linear(8, 2)
    try:
        _step(ddp, 0, steps=1)
    except ddpkit.UnusedParametersError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_a_group_of_one_names_the_replaced_head_too():
    (error,) = run_ranks(_group_of_one_worker, 1)
    assert error is not None and "on rank 0: 'fc.weight' replaced by a new parameter" in error


def _module_called_directly_worker(accumulate_first: bool) -> tuple[list[str], bool]:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = _Net()
    ddp = ddpkit.DDP(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.full((2, 4), float(rank + step))
            if accumulate_first:  # a local micro-batch through the wrapper, then a synced one
                with ddp.no_sync():
                    ddp(x).sum().backward()
                ddp(x).sum().backward()
            else:
                net(x).sum().backward()  # the wrapper never runs: nothing is averaged
    grads = [torch.zeros_like(net.fc.weight) for _ in range(2)]
    dist.all_gather(grads, net.fc.weight.grad)
    return [str(w.message) for w in caught], torch.equal(grads[0], grads[1])


@pytest.mark.timeout(60)
def test_a_module_called_directly_from_the_start_is_said_once():
    for rank, (warned, same) in enumerate(run_ranks(_module_called_directly_worker, 2, args=(False,))):
        assert not same  # as with torch's DDP: each rank kept its own gradients
        assert len(warned) == 1, warned
        assert warned[0].startswith(f"DistributedDataParallel on rank {rank}: a gradient for 'fc.bias' arrived, "
                                    "but no forward has run through the DistributedDataParallel wrapper yet")
        assert "HINT: call the wrapper, ddp(x)" in warned[0]


@pytest.mark.timeout(60)
def test_a_first_step_under_no_sync_is_no_direct_call():
    assert run_ranks(_module_called_directly_worker, 2, args=(True,)) == [([], True), ([], True)]


def _functional_call_worker() -> list[str]:
    ddp = ddpkit.DDP(_Net())
    x = torch.ones(2, 4)
    swapped = {name: p.detach() + 0.01 for name, p in ddp.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.func.functional_call(ddp, swapped, (x,))  # parameters swapped for this call alone
            ddp(x).sum().backward()
    return [str(w.message) for w in caught]


@pytest.mark.timeout(60)
def test_parameters_swapped_for_one_functional_call_are_no_change():
    assert run_ranks(_functional_call_worker, 2) == [[], []]
