"""scatter / scatter_kwargs / gather against torch.chunk and torch.cat, on CPU devices (and cuda:0 when present)."""
from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch

from ddpkit.dp.scatter_gather import gather, scatter, scatter_kwargs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = [pytest.param(["cpu"] * n, id=f"{n}xcpu") for n in (1, 2, 3, 8)] + [
    pytest.param(["cuda:0"] * n, id=f"{n}xcuda0", marks=needs_cuda) for n in (2, 3)
]

Pair = namedtuple("Pair", ["x", "label"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor
    name: str = "batch"


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("batch", [30, 10, 1])
def test_scatter_chunks_like_torch_chunk(devices, batch):
    x = torch.arange(batch * 5.0).view(batch, 5)
    chunks = scatter(x, devices)
    expected = x.chunk(len(devices))
    assert [c.shape for c in chunks] == [e.shape for e in expected]
    for chunk, want, device in zip(chunks, expected, devices):
        assert chunk.device == torch.device(device)
        torch.testing.assert_close(chunk.cpu(), want)


def test_scatter_of_30_over_8_and_10_over_8_matches_the_tutorial():
    assert [len(c) for c in scatter(torch.zeros(30, 5), ["cpu"] * 8)] == [4, 4, 4, 4, 4, 4, 4, 2]
    assert [len(c) for c in scatter(torch.zeros(10, 5), ["cpu"] * 8)] == [2, 2, 2, 2, 2]


def test_scatter_along_another_dim():
    x = torch.randn(4, 9)
    chunks = scatter(x, ["cpu"] * 3, dim=1)
    assert [c.shape for c in chunks] == [torch.Size([4, 3])] * 3
    torch.testing.assert_close(torch.cat(chunks, 1), x)


def test_scatter_returns_torchs_container_of_per_device_items_of_the_input_type():
    """As torch's scatter: a tuple for a lone tensor, a list for anything else (torch's own
    scatter_kwargs extends that list)."""
    x = torch.randn(4, 2)
    assert type(scatter(x, ["cpu"] * 2)) is tuple
    for inputs, item_type in (([x, x], list), ((x, x), tuple), ({"a": x}, dict), (7, int), ((None, 1), tuple)):
        pieces = scatter(inputs, ["cpu"] * 2)
        assert type(pieces) is list and len(pieces) == 2, inputs
        assert all(type(item) is item_type for item in pieces), inputs
    assert scatter((None, 1), ["cpu"] * 2) == [(None, 1), (None, 1)]
    assert scatter([1, 2], ["cpu"] * 2) == [[1, 2], [1, 2]]


def test_scatter_recurses_into_nested_namedtuples_and_dataclasses():
    x, mask = torch.randn(6, 3), torch.ones(6, dtype=torch.bool)
    inputs = {"batch": Batch(x, mask), "pairs": [Pair(x, "tag")], "n": 7}
    pieces = scatter(inputs, ["cpu"] * 3)
    assert len(pieces) == 3
    for piece, want_x in zip(pieces, x.chunk(3)):
        assert isinstance(piece["batch"], Batch) and piece["batch"].name == "batch"
        torch.testing.assert_close(piece["batch"].x, want_x)
        assert piece["batch"].mask.shape == (2,)
        assert isinstance(piece["pairs"][0], Pair) and piece["pairs"][0].label == "tag"
        torch.testing.assert_close(piece["pairs"][0].x, want_x)
        assert piece["n"] == 7


def test_scatter_passes_other_objects_by_reference_to_every_device():
    shared = object()
    assert all(piece is shared for piece in scatter(shared, ["cpu"] * 3))


def test_scatter_is_differentiable_back_to_the_input():
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    chunks = scatter(x, ["cpu"] * 3)
    sum((i + 1) * c.sum() for i, c in enumerate(chunks)).backward()
    expected = torch.tensor([1.0, 1, 2, 2, 3, 3], dtype=torch.float64)[:, None].expand(6, 2)
    torch.testing.assert_close(x.grad, expected)


def test_scatter_rejects_a_dim_out_of_range_naming_dim_and_shape():
    with pytest.raises(IndexError, match=r"dim=2.*shape \(30, 5\)") as raised:  # torch's type on GPUs
        scatter(torch.zeros(30, 5), ["cpu"] * 2, dim=2)
    assert isinstance(raised.value, ValueError) and (raised.value.dim, raised.value.shape) == (2, (30, 5))
    with pytest.raises(IndexError) as torchs:  # what torch's chunk says, word for word
        torch.zeros(30, 5).chunk(2, 2)
    assert str(raised.value).startswith(str(torchs.value))


def test_scatter_rejects_a_0_dim_tensor():
    with pytest.raises(RuntimeError, match=r"chunk expects at least a 1-dimensional tensor: .*0-dim tensor.*HINT"):
        scatter(torch.tensor(3.0), ["cpu"] * 2)


def test_gather_rejects_a_dim_out_of_range():
    with pytest.raises(IndexError, match=r"Dimension out of range .*cannot gather along dim=1"):
        gather([torch.zeros(3), torch.zeros(3)], "cpu", dim=1)
    with pytest.raises(RuntimeError, match=r"zero-dimensional tensor \(at position 0\) cannot be concatenated: "
                                           r"cannot gather a 0-dim tensor returned by replica 0 .*along dim=1"):
        gather([torch.zeros(()), torch.zeros(())], "cpu", dim=1)


def test_gather_names_the_replica_whose_output_lost_its_batch_dim():
    """A last chunk of one row through .squeeze() gives a 0-dim output on that replica only."""
    outputs = [torch.zeros(2), torch.zeros(2), torch.zeros(())]
    with pytest.raises(RuntimeError) as raised:
        gather(outputs, "cpu")
    with pytest.raises(RuntimeError) as torchs:  # what torch's cat says, word for word
        torch.cat(outputs)
    assert str(raised.value).startswith(str(torchs.value))
    assert ("returned by replica 2 (on cpu; the replicas' shapes: (2,), (2,), ()) along dim=0, found shape ()"
            in str(raised.value)) and ".squeeze(-1)" in str(raised.value)


def test_scatter_rejects_an_empty_device_list():
    with pytest.raises(ValueError, match="target_devices is empty"):
        scatter(torch.zeros(4), [])


def test_gather_of_nothing_raises_torchs_index_error_naming_outputs():
    with pytest.raises(IndexError, match="gather: outputs is empty") as raised:
        gather([], "cpu")
    assert isinstance(raised.value, ValueError) and raised.value.argument == "outputs"


def test_gather_of_dicts_with_other_keys_raises_torchs_key_error_readably():
    outputs = [{"a": torch.ones(1)}, {"b": torch.ones(1)}]
    with pytest.raises(KeyError) as raised:
        gather(outputs, "cpu")
    assert isinstance(raised.value, ValueError) and raised.value.found == [["a"], ["b"]]
    assert str(raised.value) == "all replica outputs must be dicts with the same keys, but found [['a'], ['b']]"


def test_scatter_rejects_a_bad_device_name():
    with pytest.raises(ValueError, match=r"target_devices\[1\] 'gpu7' is not a device name"):
        scatter(torch.zeros(4), ["cpu", "gpu7"])


def test_scatter_kwargs_pads_the_shorter_side_as_torch_does():
    x = torch.randn(6, 2)
    inputs, kwargs = scatter_kwargs((x,), None, ["cpu"] * 3)
    assert len(inputs) == 3 and kwargs == ({}, {}, {})
    inputs, kwargs = scatter_kwargs((), {"x": x}, ["cpu"] * 3)
    assert inputs == ((), (), ())
    assert [k["x"].shape for k in kwargs] == [torch.Size([2, 2])] * 3


def test_scatter_kwargs_splits_positional_and_keyword_tensors_alike():
    x, y = torch.randn(6, 2), torch.randn(6)
    inputs, kwargs = scatter_kwargs((x, "mode"), {"y": y}, ["cpu"] * 2)
    for (xi, mode), ki, want_x, want_y in zip(inputs, kwargs, x.chunk(2), y.chunk(2)):
        assert mode == "mode"
        torch.testing.assert_close(xi, want_x)
        torch.testing.assert_close(ki["y"], want_y)


def test_scatter_gives_every_device_a_contiguous_copy_not_a_view_of_the_input():
    x = torch.randn(6, 8)
    for chunk in scatter(x, ["cpu"] * 3, dim=1):
        assert chunk.is_contiguous() and chunk.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_tensors_that_split_into_different_chunk_counts_are_rejected_with_their_shapes():
    x, short = torch.randn(8, 2), torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"different numbers of chunks \[3, 4\] \(shapes \[\(8, 2\), \(3, 2\)\]\)"):
        scatter((x, short), ["cpu"] * 4)
    with pytest.raises(ValueError, match=r"different numbers of chunks \[3, 4\]"):
        scatter_kwargs((x,), {"mask": short}, ["cpu"] * 4)


def test_objects_passed_by_reference_follow_a_short_batch():
    inputs, kwargs = scatter_kwargs(("mode",), {"x": torch.randn(3, 2)}, ["cpu"] * 8)
    assert inputs == (("mode",),) * 3 and len(kwargs) == 3


def test_cuda_targets_without_cuda_are_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"target_devices\[0\] is cuda:0, but CUDA is not available"):
        scatter(torch.zeros(4), [0, 1])
    with pytest.raises(ValueError, match=r"target_device is cuda:0, but CUDA is not available"):
        gather([torch.zeros(2)], 0)


@pytest.mark.parametrize("devices", DEVICES)
def test_gather_inverts_scatter_over_nested_structures(devices):
    x, mask = torch.randn(8, 3), torch.rand(8) > 0.5
    structure = {"out": (x, [mask]), "pair": Pair(x, None), "batch": Batch(x, mask)}
    back = gather(scatter(structure, devices), "cpu")
    torch.testing.assert_close(back["out"][0], x)
    torch.testing.assert_close(back["out"][1][0], mask)
    assert isinstance(back["out"], tuple) and isinstance(back["out"][1], list)
    assert isinstance(back["pair"], Pair) and back["pair"].label is None
    assert isinstance(back["batch"], Batch)
    torch.testing.assert_close(back["batch"].x, x)


def test_gather_turns_0_dim_outputs_into_a_vector_with_torchs_warning():
    outputs = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        vector = gather(outputs, "cpu")
    torch.testing.assert_close(vector, torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("target", [-1, "cpu", torch.device("cpu")])
def test_gather_places_output_on_the_cpu_however_it_is_named(target):
    assert gather([torch.zeros(2), torch.zeros(3)], target).device == torch.device("cpu")


def test_gather_is_differentiable_back_to_every_output():
    parts = [torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    (gather(parts, "cpu") * 2).sum().backward()
    for part in parts:
        torch.testing.assert_close(part.grad, torch.full((2, 3), 2.0, dtype=torch.float64))


def test_gather_along_dim_1():
    parts = [torch.randn(4, 2), torch.randn(4, 1)]
    torch.testing.assert_close(gather(parts, "cpu", dim=1), torch.cat(parts, 1))


def test_gather_gives_the_first_outputs_dtype_as_torchs_copy_into_a_tensor_like_it_does():
    gathered = gather([torch.tensor([1, 2]), torch.tensor([0.5])], "cpu")
    assert gathered.dtype == torch.int64 and gathered.tolist() == [1, 2, 0]


def test_gather_rejects_dicts_with_different_keys():
    with pytest.raises(ValueError, match="same keys"):
        gather([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], "cpu")


def test_gather_names_outputs_of_different_structure():
    with pytest.raises(ValueError, match=r"all replica outputs must be lists of the same length, "
                                         r"but found \['list of 1', 'list of 2'\]"):
        gather([[torch.ones(1)], [torch.ones(1), torch.ones(1)]], "cpu")
    with pytest.raises(ValueError, match=r"must be tuples of the same length, but found \['tuple of 1', 'Tensor'\]"):
        gather([(torch.ones(1),), torch.ones(1)], "cpu")
    with pytest.raises(TypeError, match="replica 0 returned a tensor where replica 2 returned NoneType None"):
        gather([torch.ones(1), torch.ones(1), None], "cpu")


def test_gather_returns_a_non_tensor_that_is_the_same_on_every_replica():
    assert gather([("tag", torch.zeros(1)), ("tag", torch.zeros(1))], "cpu")[0] == "tag"


def test_gather_rejects_non_tensors_that_differ_between_replicas():
    with pytest.raises(TypeError, match="cannot gather replica outputs of type str that differ"):
        gather(["a", "b"], "cpu")


@needs_cuda
def test_gather_from_cpu_devices_to_cuda_and_back():
    parts = [torch.randn(2, 3) for _ in range(3)]
    on_gpu = gather(parts, 0)
    assert on_gpu.device == torch.device("cuda", 0)
    torch.testing.assert_close(gather(scatter(on_gpu, ["cuda:0", "cpu", "cuda:0"]), -1), torch.cat(parts))


@needs_cuda
def test_scatter_matches_torch_scatter_on_one_gpu():
    from torch.nn.parallel import scatter as torch_scatter

    x = torch.randn(10, 3)
    for ours, theirs in zip(scatter(x, [0]), torch_scatter(x, [0])):
        torch.testing.assert_close(ours, theirs)


def test_a_list_of_inputs_is_scattered_into_lists_as_torch_does():
    x = torch.arange(8.0).view(4, 2)
    inputs, kwargs = scatter_kwargs([x, "tag"], None, ["cpu"] * 2)
    assert [type(piece) for piece in inputs] == [list, list] and kwargs == ({}, {})
    assert torch.equal(inputs[1][0], x[2:]) and inputs[1][1] == "tag"
    inputs, kwargs = scatter_kwargs((x,), {"y": x}, ["cpu"] * 2)
    assert [type(piece) for piece in inputs] == [tuple, tuple] and torch.equal(kwargs[1]["y"], x[2:])


def test_outputs_of_different_sizes_name_every_replicas_shape():
    with pytest.raises(RuntimeError, match=r"^Sizes of tensors must match except in dimension 0\. .*: cannot "
                                           r"gather along dim=0 the replicas' outputs of shapes \(6, 3\), \(2, 4\)"):
        gather([torch.ones(6, 3), torch.ones(2, 4)], "cpu")


def test_a_gather_dim_out_of_range_hints_at_the_outputs_and_a_dim_not_an_int_is_named():
    with pytest.raises(IndexError, match=r"HINT: pass dim= the batch dimension of every tensor output\.$"):
        gather([torch.ones(6, 3)] * 2, "cpu", dim=2)
    with pytest.raises(TypeError, match=r"^argument 'dim' must be int, not str"):
        gather([torch.ones(6, 3)] * 2, "cpu", dim="1")
    with pytest.raises(TypeError, match=r"^argument 'dim' must be int, not str"):
        scatter(torch.ones(6, 3), ["cpu"] * 2, dim="1")
