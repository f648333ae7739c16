"""ddpkit.comm at its edges: alone as on several ranks, results outside autograd, torch's own op objects,
16-bit means near the top of their range."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

import ddpkit


def _on_two_ranks() -> dict:
    """What the tests below read, from one pair of ranks (each pair costs seconds to start)."""
    return {"gathered": _gathered_and_scattered_from_a_parameter(), "op_objects": _reduced_with_torchs_op_objects(),
            "means": _means_near_the_top()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_on_two_ranks, 2)


def _gathered_and_scattered_from_a_parameter():
    weight = torch.nn.Parameter(torch.ones(4) * (ddpkit.get_rank() + 1))
    out = [ddpkit.reduce_scatter(weight), *ddpkit.all_gather(weight), ddpkit.reduce_scatter([weight[:2], weight[2:]])]
    return [(o.requires_grad, o.grad_fn is None, o.tolist()) for o in out]


@pytest.mark.timeout(60)
def test_gathered_and_scattered_results_are_new_data_outside_autograd_as_torchs(two_ranks):
    # a grad_fn there sent each rank's backward into its own slice of its own input: a gradient of
    # [1, 1, 0, 0] on rank 0 where the sum's true one is [1, 1, 1, 1] on every rank
    expected = [(False, True, v) for v in ([3.0, 3.0], [1.0] * 4, [2.0] * 4, [3.0, 3.0])]
    assert [r["gathered"] for r in two_ranks] == [expected, [expected[0], *expected[1:3], (False, True, [3.0, 3.0])]]
    weight = torch.nn.Parameter(torch.ones(4))  # a world of one gives the same
    for out in (ddpkit.reduce_scatter(weight), *ddpkit.all_gather(weight)):
        assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("op", ["max", "min", "product", dist.ReduceOp.MAX])
def test_an_order_or_product_of_complex_tensors_is_refused_alone_as_on_several_ranks(op):
    # torch refuses these in a world of one too ("all_reduce does not support ... on complex tensors")
    with pytest.raises(ValueError, match=r"all_reduce does not support op=.* on complex tensors \(torch.complex64\)"):
        ddpkit.all_reduce(torch.ones(2, dtype=torch.complex64), op)
    with pytest.raises(ValueError, match=r"reduce_scatter does not support"):
        ddpkit.reduce_scatter(torch.ones(2, dtype=torch.complex64), op)
    assert ddpkit.all_reduce(torch.ones(2, dtype=torch.complex64), "sum").tolist() == [1 + 0j, 1 + 0j]


def test_a_world_of_one_refuses_what_several_ranks_would():
    with pytest.raises(ValueError, match=r"up to 8 dimensions, got 9"):
        ddpkit.all_gather(torch.ones([1] * 9))
    for call in (ddpkit.broadcast_object, ddpkit.all_gather_object):
        with pytest.raises((pickle.PicklingError, AttributeError)):
            call(lambda: 1)


def _reduced_with_torchs_op_objects():
    ops = (dist.ReduceOp(dist.ReduceOp.SUM), dist.ReduceOp(dist.ReduceOp.MAX))
    return [ddpkit.all_reduce(torch.tensor([float(ddpkit.get_rank() + 1)]), op).item() for op in ops]


@pytest.mark.timeout(60)
def test_torchs_reduce_op_objects_are_taken_as_their_members(two_ranks):
    assert [r["op_objects"] for r in two_ranks] == [[3.0, 2.0]] * 2
    premul = dist._make_nccl_premul_sum(2.0)
    with pytest.raises(ValueError, match=r"is not a reduction ddpkit knows"):
        ddpkit.all_reduce(torch.ones(1), premul)


def _means_near_the_top():
    big = torch.tensor([3e38, -3e38], dtype=torch.bfloat16)
    half = torch.tensor([60000.0, 2.0 ** -24], dtype=torch.float16)
    scattered = ddpkit.reduce_scatter(torch.full((2,), 3e38, dtype=torch.bfloat16), "mean")
    return ddpkit.all_reduce(big, "mean").tolist(), ddpkit.all_reduce(half, "mean").tolist(), scattered.tolist()


@pytest.mark.timeout(60)
def test_a_16_bit_mean_does_not_overflow_where_the_mean_itself_fits(two_ranks):
    big, half = torch.tensor([3e38, -3e38], dtype=torch.bfloat16), torch.tensor([60000.0], dtype=torch.float16)
    expected = (big.tolist(), [half.item(), 2.0 ** -24], [big[0].item()])
    assert [tuple(r["means"]) for r in two_ranks] == [expected] * 2


def test_init_takes_a_bool_for_check_collectives_and_numbers_for_its_timeouts():
    # bool("false") is True: strict mode came on where the caller asked for it off
    for given in ("false", "no", "0", 2):
        with pytest.raises(ValueError, match=rf"check_collectives={given!r} is not True, False or None"):
            ddpkit.init(check_collectives=given)
    with pytest.raises(ValueError, match=r"stall_timeout='5' is a string"):
        ddpkit.init(stall_timeout="5")
    with pytest.raises(ValueError, match=r"backend=5 must be a string"):  # was AttributeError: 'int' ... 'lower'
        ddpkit.init(backend=5)
    assert not dist.is_initialized()


def _check_collectives_as_numbers():
    from ddpkit.runtime.process_group import _chosen
    ddpkit.init(check_collectives=1)
    return _chosen["check_collectives"], ddpkit.init(check_collectives=True).world_size


@pytest.mark.timeout(60)
def test_check_collectives_may_be_written_as_0_or_1():
    assert run_ranks(_check_collectives_as_numbers, 2, init=False) == [(True, 2)] * 2


def test_checkpoint_paths_that_are_empty_or_a_directory_say_so(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"the path is empty"):
        ddpkit.save({}, "")
    with pytest.raises(FileNotFoundError, match=r"the path is empty"):
        ddpkit.load("")
    with pytest.raises(IsADirectoryError, match=rf"{tmp_path}' is a directory.*latest_checkpoint"):
        ddpkit.load(tmp_path)
