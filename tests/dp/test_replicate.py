"""replicate against the original module: same outputs, gradients summed into the original, buffers as torch."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddpkit.dp.replicate import replicate

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = [pytest.param(["cpu"] * n, id=f"{n}xcpu") for n in (1, 2, 3, 8)] + [
    pytest.param(["cuda:0"] * n, id=f"{n}xcuda0", marks=needs_cuda) for n in (2, 3)
]


def _net(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double().to(device)


@pytest.mark.parametrize("devices", DEVICES)
def test_every_replica_computes_what_the_original_computes(devices):
    net = _net(devices[0]).eval()
    x = torch.randn(6, 5, dtype=torch.float64, device=devices[0])
    for replica in replicate(net, devices):
        torch.testing.assert_close(replica(x), net(x))


@pytest.mark.parametrize("devices", DEVICES)
def test_gradients_of_all_replicas_accumulate_into_the_original(devices):
    net = _net(devices[0])
    reference = copy.deepcopy(net)
    x = torch.randn(8 * len(devices), 5, dtype=torch.float64, device=devices[0])
    chunks = x.chunk(len(devices))
    # BatchNorm normalises per chunk, so the reference is the sum of per-chunk losses
    sum(reference(c).pow(2).sum() for c in chunks).backward()
    replicas = replicate(net, devices)
    sum(r(c.to(d)).pow(2).sum() for r, c, d in zip(replicas, chunks, devices)).backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("make", [lambda: nn.Embedding(10, 3, sparse=True),
                                  lambda: nn.EmbeddingBag(10, 3, mode="sum", sparse=True)],
                         ids=["embedding", "embedding_bag"])
def test_sparse_gradients_of_all_replicas_accumulate_into_the_original(devices, make):
    torch.manual_seed(0)
    net = make().to(devices[0])
    reference = copy.deepcopy(net)
    x = torch.randint(0, 10, (4 * len(devices), 2), device=devices[0])
    chunks = x.chunk(len(devices))
    reference(x).sum().backward()
    replicas = replicate(net, devices)
    sum(r(c.to(d)).sum() for r, c, d in zip(replicas, chunks, devices)).backward()
    assert net.weight.grad.is_sparse
    torch.testing.assert_close(net.weight.grad.to_dense(), reference.weight.grad.to_dense())


def test_a_replica_may_change_its_parameters_in_place_without_grad():
    # nn.Embedding's max_norm renormalises the looked-up rows of its weight in place, under no_grad;
    # as in torch, each replica renormalises its own copy and only the first one's reaches the module
    torch.manual_seed(0)
    net = nn.Embedding(10, 3, max_norm=1.0)
    net.weight.data.mul_(5)
    x = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [0, 9]])
    reference, first_only = copy.deepcopy(net), copy.deepcopy(net)
    expected = reference(x)
    expected.sum().backward()
    first_only(x.chunk(3)[0])
    outputs = [r(c) for r, c in zip(replicate(net, ["cpu"] * 3), x.chunk(3))]
    torch.cat(outputs).sum().backward()
    torch.testing.assert_close(torch.cat(outputs), expected)
    torch.testing.assert_close(net.weight.grad, reference.weight.grad)
    torch.testing.assert_close(net.weight, first_only.weight)


@pytest.mark.parametrize("detach", [False, True], ids=["grad", "detached"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_only_the_first_replica_on_the_originals_device_shares_its_parameters(detach, frozen):
    # replicas run in threads at once: an in-place write to a shared storage (max_norm) raced
    net = _net().requires_grad_(not frozen)
    replicas = replicate(net, ["cpu"] * 3, detach=detach)
    pointers = [[p.data_ptr() for p in (r[0].weight, r[3].bias)] for r in replicas]
    assert pointers[0] == [net[0].weight.data_ptr(), net[3].bias.data_ptr()]
    assert not set(pointers[0]) & set(pointers[1]) and not set(pointers[1]) & set(pointers[2])
    torch.testing.assert_close(replicas[2][0].weight, net[0].weight.detach())


def test_an_unused_parameter_of_every_replica_keeps_no_gradient():
    net = nn.ModuleDict({"used": nn.Linear(3, 3), "unused": nn.Linear(3, 3)})
    for replica in replicate(net, ["cpu"] * 3):
        replica["used"](torch.randn(2, 3)).sum().backward()
    assert net["unused"].weight.grad is None and net["used"].weight.grad is not None


def test_the_first_replica_shares_buffers_so_its_running_stats_are_kept():
    net = _net()
    replicas = replicate(net, ["cpu"] * 3)
    assert replicas[0][1].running_mean is net[1].running_mean
    before = net[1].running_mean.clone()
    replicas[1](torch.randn(4, 5, dtype=torch.float64))
    torch.testing.assert_close(net[1].running_mean, before)
    assert net[1].num_batches_tracked == 0
    replicas[0](torch.randn(4, 5, dtype=torch.float64))
    assert not torch.equal(net[1].running_mean, before)
    assert net[1].num_batches_tracked == 1


def test_replicas_are_independent_module_objects():
    net = _net()
    replicas = replicate(net, ["cpu"] * 2)
    assert replicas[0] is not replicas[1] and replicas[0] is not net
    assert replicas[0][0] is not replicas[1][0]
    replicas[1].training = False
    replicas[1].note = "only here"
    assert net.training and replicas[0].training
    assert not hasattr(net, "note") and not hasattr(replicas[0], "note")
    assert replicas[1][1].running_var.data_ptr() != net[1].running_var.data_ptr()


def test_replica_parameters_are_non_leaf_tensors_linked_to_the_original():
    net = _net()
    replica = replicate(net, ["cpu"] * 2)[1]
    assert replica[0].weight.grad_fn is not None
    assert list(replica.parameters()) == []  # as torch: replicas own no leaf parameters


def test_detach_gives_replicas_without_an_autograd_link():
    net = _net()
    replicas = replicate(net, ["cpu"] * 3, detach=True)
    assert replicas[0][0].weight is net[0].weight  # the first replica shares, as torch
    assert all(not r[0].weight.requires_grad for r in replicas[1:])
    torch.testing.assert_close(replicas[2][0].weight, net[0].weight.detach())


def test_modules_with_none_parameters_and_buffers_replicate():
    net = nn.Sequential(nn.Linear(3, 3, bias=False), nn.BatchNorm1d(3, track_running_stats=False)).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    for replica in replicate(net, ["cpu"] * 2):
        torch.testing.assert_close(replica(x), net(x))


def test_no_devices_give_no_replicas():
    assert replicate(_net(), []) == []


def test_a_device_that_is_not_a_device_is_rejected():
    with pytest.raises(TypeError, match=r"devices\[1\] must be an int.*found float"):
        replicate(_net(), ["cpu", 1.5])


@needs_cuda
def test_a_cpu_module_replicated_onto_cuda_sends_gradients_back_to_the_cpu():
    net = _net()
    reference = copy.deepcopy(net)
    x = torch.randn(8, 5, dtype=torch.float64)
    replicas = replicate(net, ["cuda:0", "cuda:0"])
    assert replicas[1][0].weight.device == torch.device("cuda", 0)
    sum(r(c.cuda()).sum() for r, c in zip(replicas, x.chunk(2))).backward()
    sum(reference(c).sum() for c in x.chunk(2)).backward()
    torch.testing.assert_close(net[0].weight.grad, reference[0].weight.grad)


@needs_cuda
def test_replicate_matches_torch_replicate_on_one_gpu():
    from torch.nn.parallel import replicate as torch_replicate

    net = _net("cuda:0").eval()
    x = torch.randn(4, 5, dtype=torch.float64, device="cuda:0")
    torch.testing.assert_close(replicate(net, [0])[0](x), torch_replicate(net, [0])[0](x))


def test_a_module_on_the_meta_device_is_named_with_its_parameter():
    with pytest.raises(NotImplementedError, match=r"^Cannot copy out of meta tensor; no data!: cannot replicate a "
                                                  r"module whose 'weight' is on the meta device\. HINT: materialize"):
        replicate(nn.Linear(3, 2).to("meta"), ["cpu"] * 2)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_replicas_gradients_are_summed_in_device_order_bit_for_bit_at_every_step(n):
    # torch's Broadcast backward adds the replicas' gradients in device order: ((g0 + g1) + g2) + ...
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(6 * n, 32)
    per_chunk = []
    for chunk in x.chunk(n):
        net.zero_grad(set_to_none=True)
        net(chunk).pow(2).sum().backward()
        per_chunk.append([p.grad.clone() for p in net.parameters()])
    expected = []
    for grads in zip(*per_chunk):
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        expected.append(total)
    for _ in range(5):  # the same bits at every step, not only to rounding
        net.zero_grad(set_to_none=True)
        replicas = replicate(net, ["cpu"] * n)
        sum(r(c).pow(2).sum() for r, c in zip(replicas, x.chunk(n))).backward()
        for (name, p), e in zip(net.named_parameters(), expected):
            assert torch.equal(p.grad, e), name
