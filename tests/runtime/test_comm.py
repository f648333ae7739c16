"""Collectives against hand-computed values, in a world of one and on 2-3 real ranks."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ranks import RankFailure, run_ranks

import ddpkit


def test_collectives_without_any_process_group_act_as_a_world_of_one():
    assert not dist.is_initialized()
    t = torch.tensor([1.0, 2.0])
    assert ddpkit.all_reduce(t, "mean") is t and t.tolist() == [1.0, 2.0]
    assert ddpkit.broadcast(t).tolist() == [1.0, 2.0]
    assert ddpkit.broadcast_object({"a": 1}) == {"a": 1}
    assert [x.tolist() for x in ddpkit.all_gather(t)] == [[1.0, 2.0]]
    assert ddpkit.reduce_scatter(torch.arange(4.0)).tolist() == [0.0, 1.0, 2.0, 3.0]
    ddpkit.barrier()


@pytest.mark.parametrize("call", [
    lambda: ddpkit.all_reduce(torch.ones(1)), lambda: ddpkit.broadcast(torch.ones(1)),
    lambda: ddpkit.broadcast_object(1), lambda: ddpkit.all_gather(torch.ones(1)),
    lambda: ddpkit.reduce_scatter(torch.ones(2)), ddpkit.barrier,
], ids=["all_reduce", "broadcast", "broadcast_object", "all_gather", "reduce_scatter", "barrier"])
def test_a_launched_rank_without_init_is_told_to_call_it_not_left_alone(launched_as_rank_1_of_2, call,
                                                                         request):
    """Under torchrun without ddpkit.init(), a world of one would leave each rank its own answer."""
    assert not dist.is_initialized()
    op = request.node.callspec.id
    with pytest.raises(RuntimeError, match=rf"^ddpkit\.{op}: this process is rank 1 of WORLD_SIZE=2 "
                                           r"\(launcher: torchrun\).*HINT: call ddpkit.init\(\) first"):
        call()


@pytest.mark.parametrize("op", ["median", 3, None])
def test_unknown_reduce_op_is_named(op):
    with pytest.raises(ValueError, match=rf"op={op!r} is not a reduction"):
        ddpkit.all_reduce(torch.ones(1), op)


def test_mean_of_an_integer_tensor_is_refused():
    with pytest.raises(TypeError, match=r"op='mean'.*torch.int64"):
        ddpkit.all_reduce(torch.ones(2, dtype=torch.int64), "mean")
    with pytest.raises(TypeError, match=r"all_reduce\(op=ReduceOp.AVG\) averages"):  # as the caller wrote it
        ddpkit.all_reduce(torch.ones(2, dtype=torch.int64), torch.distributed.ReduceOp.AVG)
    # reduce_scatter too, and already in a world of one, so the error does not wait for a cluster
    with pytest.raises(TypeError, match=r"reduce_scatter\(op='mean'\).*torch.int64"):
        ddpkit.reduce_scatter(torch.arange(4), "mean")


def _bitwise_as_torch():
    rank = dist.get_rank()
    results = {}
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        for dtype in (torch.int64, torch.uint8, torch.bool):
            values = torch.tensor([0b1100, 0b1010, 0, 1]) if rank == 0 else torch.tensor([0b1010, 0b0110, 1, 1])
            ours, theirs = values.to(dtype), values.to(dtype).clone()
            ddpkit.all_reduce(ours, op)
            dist.all_reduce(theirs, op)
            results[f"{op}-{dtype}"] = torch.equal(ours, theirs)
    name = ddpkit.all_reduce(torch.tensor([6, 3]), "bxor")
    return results, name.tolist()


def test_bitwise_reductions_are_torchs():
    for results, xor in run_ranks(_bitwise_as_torch, 2):
        assert all(results.values()) and len(results) == 9, results
        assert xor == [0, 0]
    with pytest.raises(TypeError, match=r"all_reduce\(op=ReduceOp.BAND\) is bitwise .* got torch.float32"):
        ddpkit.all_reduce(torch.ones(2), dist.ReduceOp.BAND)


def _reduce_scatter_of_two_dtypes():
    try:
        ddpkit.reduce_scatter([torch.ones(2, dtype=torch.float16), torch.ones(2)])
    except TypeError as e:
        return str(e)
    return None


def test_reduce_scatter_refuses_tensors_of_several_dtypes():
    # one flat all-reduce would promote them, and rank 0 would get float32 for its float16 chunk
    for message in run_ranks(_reduce_scatter_of_two_dtypes, 2):
        assert message and "tensor[0] is torch.float16, tensor[1] is torch.float32" in message


def test_src_may_be_any_integer_type_as_in_torch():
    np = pytest.importorskip("numpy")
    t = torch.tensor([1.0])
    assert ddpkit.broadcast(t, src=np.int64(0)) is t and ddpkit.broadcast_object("x", src=np.int32(0)) == "x"
    with pytest.raises(ValueError, match=r"src=1\.0 is not a rank of this group"):
        ddpkit.broadcast(t, src=1.0)


def test_non_tensor_input_is_refused():
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, got list"):
        ddpkit.all_reduce([1.0])


def _every_collective():
    rank, world = ddpkit.get_rank(), ddpkit.get_world_size()
    out = {}
    for op in ("sum", "mean", "max", "min", "product"):
        out[op] = ddpkit.all_reduce(torch.tensor([rank + 1.0, -(rank + 1.0)]), op).tolist()
    out["int_sum"] = ddpkit.all_reduce(torch.tensor([rank + 1])).tolist()
    # a 16-bit sum would overflow (fp16 tops out at 65504) where the mean does not, and dividing
    # first would lose the smallest values: summed in float32
    out["half_mean"] = ddpkit.all_reduce(torch.tensor([40000.0, 5.96e-8], dtype=torch.float16), "mean").tolist()
    half = torch.full((world,), 40000.0, dtype=torch.float16)
    out["half_scatter_mean"] = ddpkit.reduce_scatter(half, "mean").tolist() + half.tolist()
    out["torch_ops"] = [ddpkit.all_reduce(torch.tensor([rank + 1.0]), op).item()
                        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG)]
    out["broadcast"] = ddpkit.broadcast(torch.full((2,), float(rank)), src=world - 1).tolist()
    out["object"] = ddpkit.broadcast_object({"from": rank, "items": [rank] * 3}, src=1)
    out["objects"] = ddpkit.all_gather_object(("rank", rank, [None] * rank))
    out["gather"] = [g.tolist() for g in ddpkit.all_gather(torch.full((rank + 1, 2), rank))]
    out["gather_empty"] = [g.shape[0] for g in ddpkit.all_gather(torch.ones(rank % 2, 3))]
    out["gather_scalar"] = [g.item() for g in ddpkit.all_gather(torch.tensor(rank * 10))]
    out["scatter"] = ddpkit.reduce_scatter(torch.arange(7.0) * (rank + 1)).tolist()
    out["scatter_list"] = ddpkit.reduce_scatter(
        [torch.full((2,), float(r + rank)) for r in range(world)], op="max").tolist()
    ddpkit.barrier()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_against_hand_computed_values(world):
    results = run_ranks(_every_collective, world)
    total = sum(range(1, world + 1))
    product = 1.0
    for r in range(1, world + 1):
        product *= r
    chunks = torch.tensor_split(torch.arange(7.0) * total, world)
    for rank, out in enumerate(results):
        assert out["sum"] == [total, -total]
        assert out["mean"] == pytest.approx([total / world, -total / world])
        assert out["max"] == [world, -1.0]
        assert out["min"] == [1.0, -world]
        assert out["product"] == [product, (-1) ** world * product]
        assert out["int_sum"] == [total]
        assert out["half_mean"] == torch.tensor([40000.0, 5.96e-8], dtype=torch.float16).tolist()
        assert out["half_scatter_mean"] == [40000.0] + [40000.0] * world  # the input is left as it was
        assert out["torch_ops"] == pytest.approx([total, world, total / world])
        assert out["broadcast"] == [world - 1.0] * 2
        assert out["object"] == {"from": 1, "items": [1, 1, 1]}
        assert out["objects"] == [("rank", r, [None] * r) for r in range(world)]
        assert out["gather"] == [[[r] * 2] * (r + 1) for r in range(world)]
        assert out["gather_empty"] == [r % 2 for r in range(world)]
        assert out["gather_scalar"] == [r * 10 for r in range(world)]
        assert out["scatter"] == chunks[rank].tolist()
        assert out["scatter_list"] == [rank + world - 1.0] * 2


def _subgroup_sum():
    group = dist.new_group([1, 2])
    if ddpkit.get_rank() == 0:
        try:
            ddpkit.all_reduce(torch.ones(1), "mean", group=group)
        except ValueError as e:
            return str(e)
        return "no error"
    t = ddpkit.all_reduce(torch.tensor([ddpkit.get_rank() + 1.0]), group=group)
    src_value = ddpkit.broadcast(torch.tensor([float(ddpkit.get_rank())]), src=2, group=group)
    obj = ddpkit.broadcast_object({"from": ddpkit.get_rank()}, src=2, group=group)
    return t.item(), src_value.item(), obj, len(ddpkit.all_gather(torch.ones(1), group=group))


@pytest.mark.timeout(60)
def test_collectives_respect_the_group_argument_and_src_is_a_global_rank_as_in_torch():
    outside, *members = run_ranks(_subgroup_sum, 3)
    assert members == [(5.0, 2.0, {"from": 2}, 2)] * 2
    assert outside.startswith("rank 0 is not a member of this group (its ranks are [1, 2])")


def _broadcast_from_outside_the_group():
    group = dist.new_group([0, 1])
    if ddpkit.get_rank() < 2:
        ddpkit.broadcast(torch.ones(1), src=2, group=group)


@pytest.mark.timeout(60)
def test_a_src_outside_the_group_is_named():
    with pytest.raises(RankFailure, match=r"src=2 is not a rank of this group \(its ranks are \[0, 1\]\)"):
        run_ranks(_broadcast_from_outside_the_group, 3)


def _gather_mismatched_trailing_dims():
    ddpkit.all_gather(torch.ones(2, 3 + ddpkit.get_rank()))


def _gather_mismatched_dtypes():
    ddpkit.all_gather(torch.ones(2, dtype=torch.float32 if ddpkit.get_rank() == 0 else torch.float64))


def _reduce_scatter_mismatched_sizes():
    ddpkit.reduce_scatter(torch.ones(4 + ddpkit.get_rank(), 3))


# Gloo aborts the process on a size mismatch (or gathers garbage for dtypes of one size)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker, phrases", [
    (_gather_mismatched_trailing_dims, ["only the first dimension may differ", "rank 0: [2, 3], rank 1: [2, 4]"]),
    (_gather_mismatched_dtypes, ["TypeError: all_gather: every rank must give the same dtype",
                                 "rank 0: float32, rank 1: float64"]),
    (_reduce_scatter_mismatched_sizes, ["ValueError: reduce_scatter: every rank must give chunks of the same sizes",
                                        "rank 0: [6, 6] torch.float32; rank 1: [9, 6] torch.float32"]),
], ids=["trailing_dims", "dtypes", "reduce_scatter_sizes"])
def test_all_gather_of_mismatched_tensors_fails_on_every_rank_naming_them(worker, phrases):
    with pytest.raises(RankFailure) as info:
        run_ranks(worker, 2)
    assert sorted(info.value.failures) == [0, 1]
    for text in info.value.failures.values():
        for phrase in phrases:
            assert phrase in text


def _mean_of_a_parameter():
    weight, ones = torch.nn.Parameter(torch.full((2,), float(ddpkit.get_rank()))), torch.nn.Parameter(torch.ones(2))
    return ddpkit.all_reduce(weight, "mean").tolist(), ddpkit.all_reduce(ones, "sum").tolist()


@pytest.mark.timeout(60)
def test_a_parameter_averaged_by_hand_outside_no_grad_works_as_on_one_process():
    """The collective writes outside autograd, and so does the mean's division (it raised "a leaf
    Variable that requires grad is being used in an in-place operation" on 2 ranks only)."""
    assert run_ranks(_mean_of_a_parameter, 2) == [([0.5, 0.5], [2.0, 2.0])] * 2


def _reduce_scatter_wrong_count():
    ddpkit.reduce_scatter([torch.ones(1)] * 3)


@pytest.mark.timeout(60)
def test_reduce_scatter_wants_one_tensor_per_rank():
    with pytest.raises(RankFailure, match=r"got 3 tensors for a group of 2 ranks"):
        run_ranks(_reduce_scatter_wrong_count, 2)


def test_object_collectives_need_no_numpy():
    """torch's object collectives call tensor.numpy(); a plain torch install may have no numpy."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import torch\n"
        "from ddpkit.runtime.comm import _from_bytes_tensor, _to_bytes_tensor\n"
        "try:\n"
        "    torch.zeros(1).numpy(); raise SystemExit('numpy was importable')\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print(_from_bytes_tensor(_to_bytes_tensor({'a': [1, (2, None)]})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{'a': [1, (2, None)]}"


def _broadcast_in_a_group_of_one():
    group = dist.new_group([1])
    if ddpkit.get_rank() == 1:
        return ddpkit.broadcast(torch.tensor([7.0]), src=1, group=group).item()
    return None


@pytest.mark.timeout(60)
def test_a_group_of_one_takes_its_members_global_rank_as_src():
    assert run_ranks(_broadcast_in_a_group_of_one, 2) == [None, 7.0]


@pytest.mark.parametrize("device_types, backend, carries_cpu", [
    (["cuda"], None, False),  # init_process_group("nccl") or ("cuda:nccl"): CUDA tensors only
    (["cuda", "cpu"], None, True),  # Gloo (which carries CUDA tensors too), or cpu:gloo,cuda:nccl
    (None, "nccl", False),  # a torch without ProcessGroup._device_types: the backend's name
    (None, "cuda:nccl", False),
    (None, "cpu:gloo,cuda:nccl", True),
    (None, "gloo", True),
])
def test_tensors_for_a_group_go_on_the_cpu_only_where_it_has_a_cpu_backend(
        monkeypatch, device_types, backend, carries_cpu):
    from types import SimpleNamespace

    from ddpkit.runtime import comm

    group = SimpleNamespace() if device_types is None else SimpleNamespace(
        _device_types=[torch.device(t) for t in device_types])
    monkeypatch.setattr(comm.dist, "get_backend", lambda g: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert comm.comm_device(group) == (torch.device("cpu") if carries_cpu else torch.device("cuda", 0))
