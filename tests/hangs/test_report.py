"""The report as a pure function of the ranks' states: wording, grouping and verdicts, in one process."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ddpkit.runtime.hangs.inquiry import pid_stopped
from ddpkit.runtime.hangs.report import build_report, rank_list


def _item(seq, op="all_reduce", what="float32[10]", site="train.py:88 in step()", age=61.0, error=None):
    return {"seq": seq, "op": op, "what": what, "site": site, "via": None, "age": age, "error": error,
            "outstanding": True}


def _state(rank, waiting=(), where="train.py:90 in step()", recent=(), ranks=16):
    group = {"name": "0", "ranks": list(range(ranks)), "default": True, "seq": 0, "done": 0,
             "waiting": list(waiting), "recent": list(recent)}
    return {"rank": rank, "pid": 100 + rank, "host": "h", "where": where, "top": None, "groups": [group]}


def _report(answers, missing=None):
    return build_report(answers, missing or {}, stall_timeout=60, answer_seconds=5, seen_by=0, exit_code=86)


def test_rank_lists_are_ranges():
    assert rank_list([3]) == "rank 3"
    assert rank_list([0, 2]) == "ranks 0, 2"
    assert rank_list([*range(7), *range(8, 16)]) == "ranks 0-6, 8-15"
    assert rank_list([0, 1, 5]) == "ranks 0, 1, 5"


def test_one_rank_elsewhere_in_a_large_job_is_one_line_and_slow():
    answers = {r: _state(r, [_item(457)]) for r in range(16) if r != 7}
    answers[7] = _state(7, where="eval.py:41 in evaluate()")
    report = _report(answers)
    assert ("  ranks 0-6, 8-15: wait in all_reduce #457 float32[10] at train.py:88 in step() "
            "[the default group], for 61.0 s") in report["text"]
    assert "  rank 7: in no collective; at eval.py:41 in evaluate()" in report["text"]
    assert ("rank 7 has not reached all_reduce #457 (train.py:88 in step()) that ranks 0-6, 8-15 wait in; "
            "it is at eval.py:41 in evaluate().") in report["text"]
    assert not report["certain"]


def test_a_rank_inside_backward_is_said_to_maybe_wait_in_torchs_own_ddp():
    # torch's DistributedDataParallel all-reduces from C++ inside backward(): no record shows it
    answers = {0: _state(0, [_item(9, op="barrier", what="")], ranks=2),
               1: _state(1, where="train.py:20 in <module>", ranks=2)}
    answers[1]["top"] = "/venv/lib/python3.11/site-packages/torch/autograd/graph.py:829 in _engine_run_backward()"
    text = _report(answers)["text"]
    assert ("rank 1: in no collective; at train.py:20 in <module>, inside backward() (if torch's own "
            "DistributedDataParallel wraps the model, its all-reduces run there from C++") in text
    assert "this rank may wait in one)" in text


def test_a_collective_that_failed_is_not_called_slow():
    # rank 1's barrier timed out while rank 0 still works elsewhere: an error ends the job, not a hang
    answers = {0: _state(0, where="eval.py:41 in evaluate()", ranks=2),
               1: _state(1, [_item(3, op="barrier", what="", error="RuntimeError: Timed out")], ranks=2)}
    report = _report(answers)
    assert "  rank 1: was in barrier #3" in report["text"]
    assert "What next: the collective of rank 1 failed (above); that error ends the job" in report["text"]
    assert "slow is not wrong" not in report["text"] and not report["certain"]


def test_disagreement_is_certain():
    answers = {0: _state(0, [_item(12, site="train.py:50 in f()")], ranks=2),
               1: _state(1, [_item(12, op="broadcast", what="int64[3] from rank 0", site="train.py:77 in g()")],
                         ranks=2)}
    report = _report(answers)
    assert ("the ranks disagree at #12: rank 0 all_reduce #12 float32[10] at train.py:50 in f(), rank 1 "
            "broadcast #12 int64[3] from rank 0 at train.py:77 in g().") in report["text"]
    assert report["certain"] and "exit code 86" in report["text"]


def test_a_rank_that_does_not_answer_and_is_gone_is_certain():
    answers = {r: _state(r, [_item(5)], ranks=3) for r in (0, 1)}
    report = _report(answers, {2: {"pid": 4242, "host": "here", "final": None, "exited": True}})
    assert ("rank 2 (pid 4242 on here) has died without a word: killed by a signal (SIGKILL: out of memory?), "
            "a crash in native code (Gloo aborts a rank whose collective receives another size than its own "
            "tensor's: the ranks' tensors may differ), or os._exit; ranks 0, 1 wait in all_reduce #5 "
            "(train.py:88 in step()).") \
        in report["text"]
    assert report["certain"]


def test_a_rank_gone_with_the_process_that_started_it_names_both_causes():
    # ddpkit run and torchrun take their workers with them (SIGKILL) when they are killed
    answers = {0: _state(0, [_item(5)], ranks=2)}
    report = _report(answers, {1: {"pid": 4242, "host": "here", "final": None, "exited": True,
                                   "parent": 4200, "parent_exited": True}})
    assert ("rank 1 (pid 4242 on here) has died without a word, and the process that started it (pid 4200) "
            "is gone too: its launcher was killed (ddpkit run and torchrun take their workers with them), or "
            "the rank was killed (SIGKILL: out of memory?) and a wrapper script that ran it ended with it") \
        in report["text"]
    assert report["certain"]


@pytest.mark.parametrize("exited", [False, None])  # alive on this host; on another host, unknown
def test_a_rank_that_does_not_answer_but_may_be_busy_is_not_killed(exited):
    # a long call that holds the GIL (a big pickle, a checkpoint's write) keeps its watchdog from answering
    answers = {r: _state(r, [_item(5)], ranks=3) for r in (0, 1)}
    report = _report(answers, {2: {"pid": 4242, "host": "other", "final": None, "exited": exited}})
    expected = ("yet its process lives: it is in a long call that holds Python's lock" if exited is False
                else "and from another host this rank cannot tell whether its process lives")
    assert f"rank 2 (pid 4242 on other) did not answer within 5 s, {expected}" in report["text"]
    assert "ranks 0, 1 wait in all_reduce #5 (train.py:88 in step())." in report["text"]
    assert not report["certain"] and "slow is not wrong" in report["text"]


@pytest.mark.parametrize("how, expected", [
    ("stopped", "its process is stopped (SIGSTOP, or Ctrl-Z in its shell); it goes on after 'kill -CONT 4242'"),
    ("traced", "a debugger holds its process (a breakpoint, or gdb/py-spy attached)")])
def test_a_stopped_rank_is_named_as_stopped_not_busy(how, expected):
    answers = {0: _state(0, [_item(5)], ranks=2)}
    report = _report(answers, {1: {"pid": 4242, "host": "here", "final": None, "exited": False, "stopped": how}})
    assert f"rank 1 (pid 4242 on here) did not answer within 5 s: {expected}" in report["text"]
    assert not report["certain"]  # it may be let go on
    assert "What next: the job waits for the stopped rank(s) above" in report["text"]


@pytest.mark.timeout(30)
def test_pid_stopped_sees_a_stopped_process_on_this_host():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = socket.gethostname()
        assert pid_stopped(child.pid, here) is None
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while pid_stopped(child.pid, here) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the kernel stops it asynchronously
        assert pid_stopped(child.pid, here) == "stopped"
        assert pid_stopped(child.pid, "another-host") is None
    finally:
        child.kill()
        child.wait()
    assert pid_stopped(child.pid, here) is None


def test_ranks_that_agree_are_not_a_deadlock():
    report = _report({r: _state(r, [_item(5)], ranks=2) for r in (0, 1)})
    assert "all wait in all_reduce #5" in report["text"] and "and agree" in report["text"]
    assert not report["certain"]


def test_the_picture_ignores_ages():
    first = _report({0: _state(0, [_item(5, age=61)], ranks=2), 1: _state(1, ranks=2)})
    later = _report({0: _state(0, [_item(5, age=122)], ranks=2), 1: _state(1, ranks=2)})
    assert first["picture"] == later["picture"] and first["text"] != later["text"]


_C10D = "/site-packages/torch/distributed/distributed_c10d.py:2799"


def _in_p2p(rank, call, ranks=3):
    state = _state(rank, where="pipe.py:17 in <module>", ranks=ranks)
    state["top"] = f"{_C10D} in {call}()"
    return state


def test_a_recv_that_no_rank_is_left_to_send_is_a_deadlock():
    answers = {0: _in_p2p(0, "recv", ranks=2), 1: _state(1, [_item(3, op="barrier", what="")], ranks=2)}
    report = _report(answers)
    assert ("rank 0 waits in recv() at pipe.py:17 in <module> (innermost: " + _C10D + " in recv()), a "
            "point-to-point call, and every other rank waits in a collective or a recv: no rank is left "
            "to send.") in report["text"]
    assert report["certain"]


@pytest.mark.parametrize("other", ["send", "busy"])
def test_a_recv_beside_a_send_or_a_busy_rank_may_still_complete(other):
    # a send may be a long transfer; a rank at work may yet send
    answers = {0: _in_p2p(0, "recv"), 1: _state(1, [_item(3)]), 2: _in_p2p(2, "send")}
    if other == "busy":
        answers[2] = _state(2, where="data.py:5 in load()")
    report = _report(answers)
    assert not report["certain"] and "no rank is left to send" not in report["text"]


def test_a_rank_that_exited_without_shutdown_is_named_with_its_last_collective():
    answers = {0: _state(0, [_item(8)], ranks=2)}
    final = {"how": "exit", "where": "all_reduce #7 at train.py:48 in step()", "error": None, "groups": []}
    report = _report(answers, {1: {"pid": 101, "host": "h", "final": final, "exited": True}})
    assert ("rank 1 has exited without ddpkit.shutdown(): its script ended or called sys.exit() while other "
            "ranks still needed it (its last collective: all_reduce #7 at train.py:48 in step())") in report["text"]
    assert report["certain"] and "join()" not in report["text"]  # not DDP's collective: no word of batches


def test_a_rank_that_called_sys_exit_is_named_with_its_line():
    answers = {0: _state(0, [_item(8)], ranks=2)}
    final = {"how": "exit", "where": "all_reduce #7 at train.py:48 in step()",
             "error": "sys.exit(0) at train.py:51 in main()", "groups": []}
    report = _report(answers, {1: {"pid": 101, "host": "h", "final": final, "exited": True}})
    text = report["text"]
    assert ("rank 1 has exited without ddpkit.shutdown(): it called sys.exit(0) at train.py:51 in main() while "
            "other ranks still needed it (its last collective: all_reduce #7 at train.py:48 in step())") in text


@pytest.mark.parametrize("how", ["exit", "shutdown"])
def test_a_rank_that_left_while_the_others_wait_in_ddp_hints_at_uneven_batches(how):
    waiting = {**_item(8), "via": "DDP"}
    answers = {0: _state(0, [waiting], ranks=2)}
    final = {"how": how, "where": "all_reduce #7 at train.py:48 in step()", "error": None, "groups": []}
    report = _report(answers, {1: {"pid": 101, "host": "h", "final": final, "exited": True}})
    assert ("rank 0 waits in all_reduce #8 (train.py:88 in step()): if rank 1's data ran out first (ranks with "
            "different numbers of batches), train under 'with model.join():' or give every rank as many batches "
            "(DistributedSampler(..., drop_last=True)).") in report["text"]


def test_a_rank_that_left_while_rank_0_saves_says_save_is_a_collective():
    saving = {**_item(8, op="broadcast", what="int64[1] from rank 0", site="train.py:60 in <module>"), "via": "save"}
    final = {"how": "exit", "where": "all_reduce #7 at train.py:48 in step()", "error": None, "groups": []}
    report = _report({0: _state(0, [saving], ranks=2)}, {1: {"pid": 101, "host": "h", "final": final, "exited": True}})
    assert ("rank 0 waits in broadcast #8 (train.py:60 in <module>): ddpkit.save is a collective (rank 0 writes, the "
            "others wait): call it on every rank, not under 'if rank == 0:'.") in report["text"]


def test_a_rank_in_a_collective_called_through_an_early_reference_is_named_and_the_deadlock_certain():
    # "from torch.distributed import barrier" before ddpkit.init(): the recorder never saw that call
    answers = {0: _state(0, where="train.py:13 in <module>", ranks=2),
               1: _state(1, [{**_item(12), "via": "DDP"}], ranks=2)}
    answers[0]["top"] = f"{_C10D} in barrier()"
    report = _report(answers)
    assert "  rank 0: waits in torch.distributed.barrier(), which ddpkit does not record; at train.py:13" \
        in report["text"]
    assert ("rank 0 has not reached all_reduce #12 (train.py:88 in step()) that rank 1 waits in; it waits in "
            "torch.distributed.barrier() instead, at train.py:13 in <module>.") in report["text"]
    assert ("the torch.distributed.barrier() that rank 0 waits in (train.py:13 in <module>) is one ddpkit does "
            "not record: called through a reference taken before ddpkit.init() (from torch.distributed import "
            "barrier)") in report["text"]
    assert "the other ranks wait in all_reduce, never in barrier: no rank can move on." in report["text"]
    assert report["certain"] and "slow is not wrong" not in report["text"]


@pytest.mark.parametrize("other", ["same op", "same kind", "busy"])
def test_an_unrecorded_collective_that_may_match_or_a_busy_rank_is_not_certain(other):
    # broadcast_object_list broadcasts: a rank inside torch's broadcast() may be in that very call
    op = "broadcast_object_list" if other == "same kind" else "barrier"
    answers = {0: _state(0, where="train.py:13 in <module>"), 1: _state(1, [_item(12, op=op, what="")]),
               2: _state(2, [_item(12, op=op, what="")])}
    inside = {"same op": "barrier", "same kind": "broadcast", "busy": "all_reduce"}[other]
    answers[0]["top"] = f"{_C10D} in {inside}()"
    if other == "busy":
        answers[2] = _state(2, where="data.py:5 in load()")
    report = _report(answers)
    assert "which ddpkit does not record" in report["text"] and not report["certain"]


def test_ddps_all_reduce_against_another_collective_hints_at_a_call_on_some_ranks_and_uneven_batches():
    answers = {0: _state(0, [_item(30, op="broadcast", what="int64[1] from rank 0", site="train.py:40 in save()")],
                         ranks=2),
               1: _state(1, [{**_item(30), "via": "DDP"}], ranks=2)}
    text = _report(answers)["text"]
    assert ("if rank 0 alone calls that one (under 'if rank == 0:', say), call it on every rank. If the data of "
            "rank 0 ran out first (ranks with different numbers of batches), train under 'with model.join():' or "
            "give every rank as many batches") in text


def test_ddpkit_save_on_some_ranks_against_ddps_all_reduce_says_save_is_a_collective():
    save = _item(9, op="broadcast", what="int64[1] from rank 0", site="train.py:27 in <module>")
    answers = {0: _state(0, [{**save, "via": "save"}], ranks=3), 1: _state(1, [{**_item(9), "via": "DDP"}], ranks=3),
               2: _state(2, [{**save, "via": "save"}], ranks=3)}
    assert ("ddpkit.save is a collective (rank 0 writes, the others wait): if ranks 0, 2 alone call it (under "
            "'if rank == 0:', say), call it on every rank.") in _report(answers)["text"]


@pytest.mark.parametrize("first", [1, 40])
def test_where_the_history_kept_shows_no_earlier_split_it_says_how_far_back_it_looked(first):
    # rank 0 called one broadcast more, long ago: since then both call line 12 at every seq
    bcast = {"op": "broadcast", "what": "int64[1] from rank 0", "site": "train.py:12 in <module>"}
    same = [_item(seq, age=0.0, **bcast) for seq in range(first, 104)]
    answers = {0: _state(0, [_item(104, **bcast)], recent=same, ranks=2),
               1: _state(1, [_item(104, site="train.py:16 in <module>")], recent=same, ranks=2)}
    text = _report(answers)["text"]
    assert "the ranks disagree at #104" in text
    note = ("the collectives #40 to #103, as far back as each rank keeps them, were called from the same places: "
            "if a rank called one the others did not, it was before #40.")
    assert (note in text) == (first == 40)
