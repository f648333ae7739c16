"""The recorder lets go of a finished async collective's Work: a Work keeps its tensors alive."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from ddpkit.runtime import process_group

pytestmark = pytest.mark.timeout(60)


def _works_held_after_many_async_collectives() -> tuple[int, int]:
    for _ in range(40):  # fresh tensors each time, as gradients with zero_grad(set_to_none=True)
        dist.all_reduce(torch.ones(1000), async_op=True).wait()
    dist.all_reduce(torch.ones(1))  # the next collective settles the finished ones before it
    [log] = process_group._watch[0].recorder.groups()  # the default group only
    return sum(1 for r in log.ring if r.work), log.seq


def test_finished_async_works_are_not_kept_in_the_ring():
    for held, seq in run_ranks(_works_held_after_many_async_collectives, 2):
        assert seq == 41
        assert held == 0


def test_a_reductions_name_is_the_same_however_torch_is_given_it():
    from ddpkit.runtime.hangs.recorder import _reduction_name

    # strict mode compares these names across ranks: ReduceOp(MAX) and ReduceOp.MAX are one reduction
    assert _reduction_name(dist.ReduceOp.MAX) == _reduction_name(dist.ReduceOp(dist.ReduceOp.MAX)) == "max"
    assert _reduction_name(None) == _reduction_name(dist.ReduceOp(dist.ReduceOp.SUM)) == "sum"
    assert _reduction_name(dist.ReduceOp.AVG) == "avg"


def _a_forked_child_exits():
    import atexit

    rank = dist.get_rank()
    if rank == 0:
        pid = os.fork()
        if pid == 0:  # the child ends as a script does: a finally: shutdown(), then the atexit handlers
            import ddpkit

            ddpkit.shutdown()
            atexit._run_exitfuncs()
            os._exit(0)
        os.waitpid(pid, 0)
    from ddpkit.runtime.process_group import _watch

    said = _watch[0].inquiry.store.check([f"final/{rank}"])
    dist.barrier()  # the parent's group still works
    return said


@pytest.mark.timeout(60)
def test_a_forked_child_that_exits_leaves_no_last_word_for_its_parent_rank():
    # the child's word read "rank 0 has exited", and the watchdog ended a rank that was only slow
    assert run_ranks(_a_forked_child_exits, 2) == [False, False]
