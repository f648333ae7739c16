"""DDP's input move and output search walk nested values as scatter and gather do (ddpkit.dp.nested):
dataclasses and namedtuples included, on the way in and on the way out."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from ranks import run_ranks
from torch import nn

import ddpkit
from ddpkit.ddp.outputs import find_tensors, to_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
Pair = namedtuple("Pair", ["main", "side"])


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: Pair


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    mask: OrderedDict


class Plain:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.nested = logits, Pair(logits, [logits])


def test_find_tensors_walks_dataclasses_namedtuples_and_ordered_dicts():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    found = find_tensors([Output(a, Pair(b, None)), OrderedDict(c=c)])
    assert [id(t) for t in found] == [id(a), id(b), id(c)]


def test_attributes_mode_looks_one_level_into_a_plain_object_only():
    t = torch.zeros(1)
    assert list(find_tensors(Plain(t))) == []
    assert [id(x) for x in find_tensors(Plain(t), attributes=True)] == [id(t)] * 3
    assert list(find_tensors([Plain(t)], attributes=True)) == []  # not inside containers
    assert list(find_tensors(nn.Linear(1, 1), attributes=True)) == []


def test_to_device_moves_a_dataclass_input_and_keeps_its_types():
    moved = to_device((Inputs(torch.zeros(2), OrderedDict(m=torch.ones(2))), "tag"), torch.device("meta"))
    assert isinstance(moved[0], Inputs) and type(moved[0].mask) is OrderedDict and moved[1] == "tag"
    assert moved[0].x.device.type == "meta" and moved[0].mask["m"].device.type == "meta"


class _ReadsInputs(nn.Linear):
    def forward(self, inputs: Inputs) -> torch.Tensor:
        assert inputs.x.device == self.weight.device and inputs.mask["m"].device == self.weight.device
        return super().forward(inputs.x * inputs.mask["m"])


@needs_cuda
def test_ddp_with_device_ids_moves_a_dataclass_inputs_tensors():
    model = ddpkit.DistributedDataParallel(_ReadsInputs(3, 2).cuda(), device_ids=[0])
    out = model(Inputs(torch.randn(4, 3), OrderedDict(m=torch.ones(4, 3))))
    assert out.device == torch.device("cuda", 0)


class _TwoHeads(nn.Module):
    """``side`` is reached only through the namedtuple inside the dataclass output."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.main, self.side = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Output:
        h = torch.tanh(self.trunk(x))
        return Output(self.main(h), Pair(self.main(h) * 0, self.side(h)))


def _loss(out: Output) -> torch.Tensor:
    return out.logits.square().sum() + out.extra.side.sum()


def _dataclass_output_worker(options: dict) -> dict[str, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _TwoHeads()
    inputs = [torch.full((3, 4), float(r + 1)) / 4 for r in range(ddpkit.get_world_size())]
    reference = [torch.zeros_like(p) for p in model.parameters()]
    for x in inputs:  # the average over ranks, computed here on one process
        grads = torch.autograd.grad(_loss(model(x)), list(model.parameters()))
        reference = [r + g / len(inputs) for r, g in zip(reference, grads)]
    ddp = ddpkit.DistributedDataParallel(model, **options)
    _loss(ddp(inputs[ddpkit.get_rank()])).backward()
    return {"grads": [p.grad for p in model.parameters()], "reference": reference}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{"find_unused_parameters": True}, {"static_graph": True}])
def test_ddp_averages_gradients_reached_through_a_dataclass_and_namedtuple_output(options):
    """With static_graph torch's first backward leaves such gradients local; ddpkit averages them."""
    for out in run_ranks(_dataclass_output_worker, 2, (options,), timeout=45):
        for got, want in zip(out["grads"], out["reference"]):
            torch.testing.assert_close(got, want)


@dataclasses.dataclass
class WithAux:
    """An output whose ``aux`` head is set after construction: a field outside ``__init__``."""

    logits: torch.Tensor
    aux: torch.Tensor = dataclasses.field(init=False)


def test_find_tensors_reads_every_dataclass_field_as_torch_does():
    from torch.nn.parallel.distributed import _find_tensors

    out = WithAux(torch.zeros(1))
    unset = [id(t) for t in find_tensors(out)]  # torch's raises AttributeError on a field not set yet
    out.aux = torch.ones(1)
    assert [id(t) for t in find_tensors(out)] == [id(t) for t in _find_tensors(out)]
    assert unset == [id(out.logits)]


class _AuxHead(nn.Module):
    """``aux`` is reached only through the output's non-init field."""

    def __init__(self) -> None:
        super().__init__()
        self.main, self.aux = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> WithAux:
        out = WithAux(self.main(x))
        out.aux = self.aux(x)
        return out


def _non_init_field_worker() -> dict[str, list[torch.Tensor]]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    grads = {}
    for name, wrap in (("ddpkit", ddpkit.DistributedDataParallel), ("torch", TorchDDP)):
        torch.manual_seed(0)
        model = wrap(_AuxHead(), find_unused_parameters=True)
        out = model(torch.full((3, 4), float(ddpkit.get_rank() + 1)))
        (out.logits.square().sum() + out.aux.sum()).backward()
        grads[name] = [p.grad for p in model.parameters()]
    return grads


@pytest.mark.timeout(60)
def test_ddp_averages_gradients_reached_through_a_non_init_dataclass_field_as_torch():
    for out in run_ranks(_non_init_field_worker, 2, timeout=45):
        for got, want in zip(out["ddpkit"], out["torch"]):
            torch.testing.assert_close(got, want)


def test_a_packed_sequence_input_moves_whole_keeping_batch_sizes_on_the_cpu():
    """torch's DDP moves a PackedSequence with .to(); taken apart as a named tuple, its batch_sizes
    would move too, which PackedSequence refuses (and an RNN on a GPU would too)."""
    from torch.nn.utils.rnn import PackedSequence, pack_sequence

    from ddpkit.ddp.outputs import to_device

    packed = pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    moved, = to_device((packed,), torch.device("meta"))
    assert isinstance(moved, PackedSequence)
    assert moved.data.device.type == "meta" and moved.batch_sizes.device.type == "cpu"
    assert moved.batch_sizes.tolist() == packed.batch_sizes.tolist()
