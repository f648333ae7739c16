"""The one walker of nested values, and the agreement of everything built on it: scatter, gather,
parallel_apply's device choice and DDP's output search and input move see the same tensors (the
output search also those in a dataclass's non-init fields, as torch's DDP)."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from ddpkit.ddp.outputs import find_tensors, to_device
from ddpkit.dp import nested
from ddpkit.dp.nested import UnevenSplit, join, map_tensors, split, tensors
from ddpkit.dp.parallel_apply import parallel_apply
from ddpkit.dp.scatter_gather import gather, scatter

Pair = namedtuple("Pair", ["x", "label"])


class Shape(tuple):
    """A tuple subclass that is not a namedtuple."""


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    extra: Pair
    total: torch.Tensor = dataclasses.field(init=False)  # derived: not walked, derived again

    def __post_init__(self) -> None:
        self.total = self.x.sum()


def _sample() -> tuple[object, list[torch.Tensor]]:
    """A value holding every kind of container, and its tensors in the walker's order."""
    a, b, c, d = (torch.full((6, 2), float(i)) for i in range(4))
    value = {"batch": Batch(a, Pair(b, "tag")), "ordered": OrderedDict(c=c, n=3),
             "seq": [Shape((d,)), None, "s"]}
    return value, [a, b, c, d]


def test_tensors_walks_every_container_kind_depth_first_and_skips_non_init_fields():
    value, expected = _sample()
    assert [id(t) for t in tensors(value)] == [id(t) for t in expected]


def test_map_tensors_keeps_every_container_type_and_derives_non_init_fields_again():
    value, _ = _sample()
    doubled = map_tensors(lambda t: t * 2, value)
    assert type(doubled["ordered"]) is OrderedDict and list(doubled["ordered"]) == ["c", "n"]
    assert isinstance(doubled["batch"], Batch) and isinstance(doubled["batch"].extra, Pair)
    assert type(doubled["seq"][0]) is Shape and doubled["seq"][1:] == [None, "s"]
    torch.testing.assert_close(doubled["batch"].total, value["batch"].x.sum() * 2)
    torch.testing.assert_close(doubled["seq"][0][0], torch.full((6, 2), 6.0))


def test_map_tensors_returns_what_it_did_not_change_as_the_same_object():
    value, _ = _sample()
    assert map_tensors(lambda t: t, value) is value
    changed = map_tensors(lambda t: t if t[0, 0] != 2.0 else t + 1, value)  # only ordered["c"]
    assert changed is not value and changed["batch"] is value["batch"] and changed["seq"] is value["seq"]
    noted = Batch(torch.zeros(1), Pair(torch.zeros(1), "t"))
    noted.note = "set after construction"  # a rebuilt copy would lose it
    assert map_tensors(lambda t: t, noted) is noted


def test_split_and_join_are_inverses_over_every_container_kind():
    value, _ = _sample()
    pieces = split(lambda t: t.chunk(3), value, 3)
    assert len(pieces) == 3 and all(p["ordered"]["n"] == 3 for p in pieces)
    assert all(p["batch"].total == p["batch"].x.sum() for p in pieces)  # derived from each piece
    back = join(lambda leaves: torch.cat(leaves) if isinstance(leaves[0], torch.Tensor) else leaves[0], pieces)
    assert all(torch.equal(x, y) for x, y in zip(tensors(back), tensors(value)))
    assert type(back["ordered"]) is OrderedDict and type(back["seq"][0]) is Shape


def test_split_repeats_empty_containers_and_leaves_by_reference():
    empty, leaf = [], object()
    pieces = split(lambda t: t.chunk(2), (empty, leaf, torch.zeros(4)), 2)
    assert all(p[0] is empty and p[1] is leaf for p in pieces)


def test_split_refuses_tensors_that_split_into_different_counts_naming_the_counts():
    with pytest.raises(UnevenSplit, match=r"different numbers of pieces \[2, 3\]") as info:
        split(lambda t: t.chunk(3), {"a": torch.zeros(6), "b": torch.zeros(2)}, 3)
    assert info.value.counts == [2, 3] and len(info.value.values) == 2


def test_split_looks_at_each_value_once(monkeypatch):
    """The count check reuses what splitting learnt: no second walk of each subtree per level."""
    deep = torch.zeros(4)
    for _ in range(40):
        deep = [deep, "leaf"]
    calls = []
    real = nested._node
    monkeypatch.setattr(nested, "_node", lambda obj: calls.append(obj) or real(obj))
    split(lambda t: t.chunk(2), deep, 2)
    assert len(calls) == 80  # 40 lists and 40 strings, each once


def test_join_refuses_dicts_with_different_keys():
    with pytest.raises(ValueError, match=r"all objects must be dicts with the same keys, "
                                         r"but found \[\['a'\], \['b'\]\]"):
        join(lambda leaves: leaves[0], [{"a": 1}, {"b": 1}])


# ---- the walkers built on it agree -------------------------------------------------------------
def test_ddp_output_search_sees_what_torchs_sees_non_init_fields_too():
    from torch.nn.parallel.distributed import _find_tensors

    value, expected = _sample()
    batch = value["batch"]
    with_derived = [expected[0], expected[1], batch.total, *expected[2:]]  # torch reads every field
    assert [id(t) for t in _find_tensors(value)] == [id(t) for t in with_derived]
    assert [id(t) for t in find_tensors(value)] == [id(t) for t in with_derived]
    assert [id(t) for t in find_tensors(value, attributes=True)] == [id(t) for t in with_derived]


def test_ddp_input_move_moves_dataclass_and_namedtuple_tensors():
    value, _ = _sample()
    moved = to_device(value, torch.device("meta"))
    assert [t.device.type for t in tensors(moved)] == ["meta"] * 4
    assert isinstance(moved["batch"], Batch) and moved["batch"].total.device.type == "meta"
    assert moved["batch"].extra.label == "tag" and type(moved["ordered"]) is OrderedDict


def test_scatter_and_gather_split_and_join_what_the_walker_sees():
    value, expected = _sample()
    pieces = scatter(value, ["cpu"] * 3)
    for i, piece in enumerate(pieces):
        for got, full in zip(tensors(piece), expected):
            torch.testing.assert_close(got, full.chunk(3)[i])
    back = gather(pieces, "cpu")
    for got, full in zip(tensors(back), expected):
        torch.testing.assert_close(got, full)


class _Fails(nn.Module):
    def forward(self, batch: Batch) -> None:
        raise RuntimeError("boom")


def test_parallel_apply_takes_the_device_of_a_dataclass_inputs_first_tensor():
    with pytest.raises(RuntimeError, match="replica 0 on device cpu raised RuntimeError: boom"):
        parallel_apply([_Fails()], [(Batch(torch.zeros(2), Pair(None, "t")),)])


# ---- dataclasses whose fields are not all their constructor's arguments --------------------------
@dataclasses.dataclass
class Scaled:
    x: torch.Tensor
    scale: dataclasses.InitVar[float] = 10.0  # applied once, at construction

    def __post_init__(self, scale: float) -> None:
        self.x = self.x * scale


@dataclasses.dataclass(frozen=True)
class Needs:
    x: torch.Tensor
    unit: dataclasses.InitVar[str]

    def __post_init__(self, unit: str) -> None:
        object.__setattr__(self, "label", unit)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor | None = dataclasses.field(init=False, default=None)  # set by the module


class _WithAux(nn.Module):
    def forward(self, x):
        out = Output(x * 2)
        out.aux = x + 1
        return out


class _ReadsX(nn.Module):
    def forward(self, batch):
        return batch.x


@pytest.mark.parametrize("make", [lambda x: Scaled(x), lambda x: Needs(x, unit="m")], ids=["default", "required"])
def test_a_dataclass_with_an_init_var_is_split_without_running_its_constructor_again(make):
    from ddpkit.dp.data_parallel import DataParallel

    batch = make(torch.arange(6.0).unsqueeze(1))
    expected = _ReadsX()(batch)
    pieces = scatter(batch, ["cpu"] * 3)
    assert all(type(p) is type(batch) for p in pieces)
    torch.testing.assert_close(torch.cat([p.x for p in pieces]), expected)
    torch.testing.assert_close(DataParallel(_ReadsX(), ["cpu"] * 3)(batch), expected)


def test_a_field_the_module_sets_outside_the_constructor_is_gathered_and_scattered():
    from ddpkit.dp.data_parallel import DataParallel

    x = torch.arange(6.0).unsqueeze(1)
    out = DataParallel(_WithAux(), ["cpu"] * 3)(x)
    expected = _WithAux()(x)
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.aux, expected.aux)
    pieces = scatter(expected, ["cpu"] * 2)
    torch.testing.assert_close(pieces[1].aux, expected.aux[3:])
    assert [id(t) for t in tensors(expected)] == [id(expected.logits), id(expected.aux)]


class Span(tuple):
    """A tuple subclass whose constructor takes two arguments, not an iterable."""

    def __new__(cls, start, end):
        return super().__new__(cls, (start, end))


def test_a_sequence_subclass_that_cannot_be_rebuilt_from_its_values_comes_back_as_torchs_plain_one():
    pieces = scatter(Span(torch.arange(4), torch.arange(4, 8)), ["cpu"] * 2)
    assert [type(p) for p in pieces] == [tuple, tuple]
    assert [p[1].tolist() for p in pieces] == [[4, 5], [6, 7]]


def test_which_fields_post_init_derives_is_found_once_per_class_not_on_every_walk():
    calls = []

    @dataclasses.dataclass
    class Counted:
        x: torch.Tensor
        total: torch.Tensor = dataclasses.field(init=False)  # derived
        aux: torch.Tensor | None = dataclasses.field(init=False, default=None)  # set by a module

        def __post_init__(self) -> None:
            calls.append(1)
            self.total = self.x.sum()

    value = Counted(torch.arange(4.0))
    value.aux = torch.arange(4.0) * 10
    before = len(calls)
    for _ in range(5):
        assert [id(t) for t in tensors(value)] == [id(value.x), id(value.aux)]
    assert len(calls) - before == 1
    pieces = split(lambda t: t.chunk(2), value, 2)
    assert [p.total.item() for p in pieces] == [1.0, 5.0] and [p.aux.tolist() for p in pieces] == [[0, 10], [20, 30]]
