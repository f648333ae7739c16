"""A hang explains itself: each way a job hangs, run on real ranks, and the report every rank prints.

Each job runs with stall_timeout=1.5 s; a report must name the right ranks and ``file:line`` within
stall_timeout plus a few seconds, a certain deadlock must end every rank with ``HANG_EXIT_CODE``, and a
slow rank must not. A collective that fails because a peer went away (exited, crashed, killed) raises
its error after the report, as under torch: the script may catch it, and uncaught it ends the rank
with exit code 1.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import line_of, run_job
from scenarios import SLOW_SECONDS

from ddpkit import HANG_EXIT_CODE

pytestmark = pytest.mark.timeout(60)

STALL = 1.5
PROMPT = STALL + 8  # the stall, one inquiry (answers within a few seconds), the processes' start
CALLED_BY_THE_JOB = f"called from {line_of('scenario', 'jobs.py')} in _rank_main()"  # a script's main()


def _reported(logs: list[str]) -> bool:
    return all("What next:" in text for text in logs)


def _verdict(text: str) -> str:
    return text[text.index("Verdict:"):text.index("What next:")]


def _raised_after_the_report(text: str) -> bool:
    """The report said the error goes on to the script, and the script's traceback followed it."""
    report_end = text.index("goes on to the script")
    return re.search(r"RuntimeError: .*Connection (closed|reset) by peer", text[report_end:]) is not None


def test_skipped_collective_names_both_sides_and_ends_the_job(tmp_path):
    job = run_job("skipped", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [HANG_EXIT_CODE] * 2, job.log()
    verdict = _verdict(job.logs[1])
    assert "disagree at #3" in verdict
    assert f"rank 0 all_reduce #3 float32[1] at {line_of('skipped')}" in verdict
    assert f"rank 1 barrier #3 at {line_of('skipped-barrier')}" in verdict
    assert job.seconds < PROMPT


def test_extra_collective_names_the_rank_that_left_and_where_the_ranks_went_apart(tmp_path):
    job = run_job("extra", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [1, 0], job.log()  # rank 0's all-reduce raised when rank 1's process ended
    assert _raised_after_the_report(job.logs[0]), job.log()
    verdict = _verdict(job.logs[0])
    assert f"rank 1 has left the job: it called ddpkit.shutdown() at {line_of('extra-leaves')}" in verdict
    assert f"rank 0 was in all_reduce #3 ({line_of('extra-next')}" in verdict
    assert (f"#2: rank 0 all_reduce float32[4] at {line_of('extra')} in extra(), {CALLED_BY_THE_JOB}; "
            f"rank 1 all_reduce float32[4] at {line_of('extra-next')}") in verdict
    assert job.seconds < PROMPT


def test_calls_through_one_helper_are_told_apart_by_the_line_that_called_it(tmp_path):
    job = run_job("extra_through_a_helper", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [1, 0], job.log()
    verdict = _verdict(job.logs[0])
    helper = f"{line_of('helper')} in _reduce_mean(), called from"
    assert f"rank 0 was in all_reduce #3 ({helper} {line_of('helper-next')} in extra_through_a_helper())" in verdict
    assert (f"#2: rank 0 all_reduce float32[4] at {helper} {line_of('helper-extra')} in extra_through_a_helper(); "
            f"rank 1 all_reduce float32[4] at {helper} {line_of('helper-next')}") in verdict


def test_ranks_that_all_wait_in_recv_are_reported_and_end(tmp_path):
    # waiting in no collective, they once opened no inquiry: the job hung without a word
    job = run_job("both_receive_first", 2, tmp_path, stall_timeout=STALL)
    assert HANG_EXIT_CODE in job.codes and set(job.codes) <= {HANG_EXIT_CODE, 1}, job.log()
    verdict = _verdict(job.logs[0])
    assert f"ranks 0, 1 wait in recv() at {line_of('recv')} in both_receive_first()" in verdict
    assert "a point-to-point call, and so does every other rank: no rank is left to send." in verdict
    assert job.seconds < PROMPT


@pytest.mark.parametrize("scenario, said", [
    ("send_to_a_rank_in_a_barrier",
     f"rank 0 waits in send() to rank 1 with tag 0 at {line_of('send-unmatched')}"),
    ("tags_that_differ",
     f"rank 0 waits in send() to rank 1 with tag 1 at {line_of('send-tag')}"),
])
def test_a_send_its_destination_cannot_receive_is_a_certain_deadlock(tmp_path, scenario, said):
    # a send may be a long transfer, so it was judged slow, and the job hung for good
    job = run_job(scenario, 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [HANG_EXIT_CODE] * 2, job.log()
    verdict = _verdict(job.logs[0])
    assert said in verdict, verdict
    assert "which is never received: rank 1 waits in " + (
        "barrier #2, which needs rank 0 too" if scenario == "send_to_a_rank_in_a_barrier"
        else "recv() from rank 0 with tag 2") in verdict
    assert job.seconds < PROMPT


def test_a_send_to_a_rank_that_computes_with_a_collective_in_flight_is_slow_not_stuck(tmp_path):
    job = run_job("send_while_the_receiver_computes", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [0, 0], job.log()
    assert "slow is not wrong" in job.logs[0], job.log()


def test_different_op_is_a_certain_deadlock(tmp_path):
    job = run_job("different_op", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [HANG_EXIT_CODE] * 2, job.log()
    for text in job.logs:
        verdict = _verdict(text)
        assert f"rank 0 all_reduce #1 float32[3] at {line_of('op-0')}" in verdict
        assert f"rank 1 broadcast #1 float32[3] from rank 0 at {line_of('op-1')}" in verdict
    assert job.seconds < PROMPT


def test_a_monitored_barrier_is_recorded_as_a_collective(tmp_path):
    # unrecorded, a rank waiting in it alone gave no report at all, and one beside another
    # collective was told to call dist.monitored_barrier(), which it did
    job = run_job("monitored_barrier_on_one_rank", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [HANG_EXIT_CODE] * 2, job.log()
    for text in job.logs:
        verdict = _verdict(text)
        assert f"rank 0 monitored_barrier #1 at {line_of('monitored')}" in verdict, verdict
        assert f"rank 1 all_reduce #1 float32[3] at {line_of('monitored-skipped')}" in verdict
        assert "does not record" not in text
    assert job.seconds < PROMPT


def test_different_shapes_name_the_rank_gloo_crashed_and_the_survivors_call(tmp_path):
    # Gloo aborts the rank whose buffer is too small (SIGABRT, in C++): the other rank's all-reduce
    # raises at once, and the inquiry finds the crashed process gone
    job = run_job("different_shapes", 2, tmp_path, stall_timeout=STALL)
    crashed = job.codes.index(-signal.SIGABRT)
    survivor = 1 - crashed
    assert job.codes[survivor] == 1 and _raised_after_the_report(job.logs[survivor]), job.log()
    verdict = _verdict(job.logs[survivor])
    assert f"rank {crashed} (pid" in verdict and "has died without a word" in verdict
    assert f"rank {survivor} was in all_reduce #1 ({line_of('shapes')}" in verdict
    assert "float32[20]" in job.logs[survivor] or "float32[10]" in job.logs[survivor]
    assert job.seconds < PROMPT


def test_slow_rank_is_reported_and_the_job_goes_on(tmp_path):
    job = run_job("slow", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [0, 0], job.log()
    verdict = _verdict(job.logs[0])
    assert (f"rank 1 has not reached all_reduce #2 ({line_of('slow-wait')} in slow(), {CALLED_BY_THE_JOB}) that "
            f"rank 0 waits in; it is at {line_of('slow')} in slow()") in verdict
    assert "the job goes on" in job.logs[0]
    assert job.logs[0].count("Verdict:") == 1  # the picture did not change: one report


def test_rank_killed_inside_a_collective_is_named(tmp_path):
    job = run_job("killed", 3, tmp_path, stall_timeout=STALL)
    assert job.codes == [1, 1, -signal.SIGKILL], job.log()
    for text in job.logs[:2]:
        assert _raised_after_the_report(text), job.log()
        verdict = _verdict(text)
        assert "rank 2 (pid" in verdict and "has died without a word" in verdict
        assert line_of("killed") in verdict
    assert job.seconds < PROMPT


def test_rank_stuck_in_a_python_loop_is_named_and_not_killed(tmp_path):
    job = run_job("spin", 2, tmp_path, stall_timeout=STALL, deadline=PROMPT + 5, stop_when=_reported)
    assert job.codes == [None, None], job.log()  # still running when the reports were in
    for text in job.logs:
        verdict = _verdict(text)
        assert (f"rank 1 has not reached all_reduce #2 ({line_of('spin-wait')} in spin(), {CALLED_BY_THE_JOB}) "
                "that rank 0 waits in; it is at ") in verdict
        assert (f"at {line_of('spin')} in spin(), {CALLED_BY_THE_JOB}" in verdict
                or f"at {line_of('spin-body')} in spin(), {CALLED_BY_THE_JOB}" in verdict)  # and who called spin()
    assert job.seconds < PROMPT


def test_desync_inside_a_subgroup(tmp_path):
    job = run_job("subgroup", 4, tmp_path, stall_timeout=STALL)
    assert job.codes == [HANG_EXIT_CODE] * 4, job.log()
    verdict = _verdict(job.logs[0])
    assert (f"the ranks disagree at #1 of group [2, 3]: rank 2 all_reduce #1 float32[3] at {line_of('sub-2')}"
            in verdict)
    assert f"rank 3 broadcast #1 float32[3] from rank 2 at {line_of('sub-3')}" in verdict
    assert f"rank 2 has not reached barrier #1 ({line_of('sub-barrier')}" in verdict
    assert job.seconds < PROMPT + 3  # four ranks start on two cores


def test_desync_inside_ddp_backward(tmp_path):
    job = run_job("ddp_skips_backward", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [HANG_EXIT_CODE] * 2, job.log()
    verdict = _verdict(job.logs[1])
    assert f"at {line_of('ddp-backward')} in ddp_skips_backward(), {CALLED_BY_THE_JOB} (issued by DDP)" in verdict
    # the count includes DDP's construction: rank 0's tensor list (its size, its bytes), the verdict, the states
    assert f"rank 1 barrier #8 at {line_of('ddp-barrier')}" in verdict
    assert job.seconds < PROMPT


def test_a_collective_in_a_finally_block_names_the_exception_being_handled(tmp_path):
    job = run_job("cleanup_collective", 2, tmp_path, stall_timeout=STALL)
    # rank 1 prints the exception it was handling and ends as an uncaught one would; rank 0 as a deadlock
    assert job.codes[1] == 1 and job.codes[0] in (1, HANG_EXIT_CODE), job.log()
    cause = f"ValueError: a bad batch on rank 1 (raised at {line_of('cleanup-raise')} in cleanup_collective())"
    for text in job.logs:
        assert f"at {line_of('cleanup-save')} in cleanup_collective()" in text and f"while handling {cause}" in text
        assert f"rank 1 is handling {cause}: a collective in its except: or finally: block" in _verdict(text)
    printed = job.logs[1][job.logs[1].index("ddpkit: this rank was handling the exception below"):]
    assert 'raise ValueError("a bad batch on rank 1")' in printed and printed.rstrip().endswith(
        "ValueError: a bad batch on rank 1"), printed
    assert job.seconds < PROMPT


def test_a_thread_that_died_of_an_exception_is_named_with_it(tmp_path):
    job = run_job("dead_thread", 2, tmp_path, stall_timeout=STALL, deadline=PROMPT + 5, stop_when=_reported)
    assert job.codes == [None, None], job.log()  # not certain: the job goes on, and the test stops it
    died = ("thread 'data-feeder' died with RuntimeError: the data thread of rank 1 died (raised at "
            f"{line_of('thread-raise')} in produce())")
    for text in job.logs:
        assert f"at {line_of('thread-wait')} in dead_thread()" in text and f"; its {died}" in text
        assert f"rank 1's {died}: if rank 1 waits for what that thread was doing" in _verdict(text)
        assert "a rank waiting for a thread that died never arrives" in text
    assert job.seconds < PROMPT


def test_off_with_zero(tmp_path):
    end = time.monotonic() + STALL + 4  # proving an absence takes a while: well past a stall
    job = run_job("spin", 2, tmp_path, stall_timeout=0, stop_when=lambda logs: time.monotonic() > end)
    assert job.codes == [None, None], job.log()
    assert not any("hang report" in text for text in job.logs), job.log()


def test_ddpkit_run_summary_carries_the_report(tmp_path):
    demo = Path(__file__).resolve().parents[2] / "examples" / "hang_demo.py"
    line = next(n for n, text in enumerate(demo.read_text().splitlines(), 1) if "the bug" in text)
    env = {**os.environ, "DDPKIT_STALL_TIMEOUT": str(STALL), "TMPDIR": str(tmp_path)}  # where it saves
    done = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "2", str(demo)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == HANG_EXIT_CODE, done.stderr
    summary = done.stderr[done.stderr.index("ddpkit run: the job failed"):]
    assert f"exit code {HANG_EXIT_CODE}: ddpkit found a certain deadlock" in summary
    assert f"hang_demo.py:{line} in <module>" in summary and "(issued by DDP)" in summary
    assert "the ranks disagree at #" in summary
    assert "ddpkit.save is a collective (rank 0 writes, the others wait): if rank 0 alone calls it" in summary


def test_a_peer_that_exits_during_ddp_training_is_named_on_the_survivor(tmp_path):
    # the failure surfaces in DDP's Work.wait(), past the recorder's wrapper: the inquiry runs at exit
    job = run_job("ddp_peer_exits", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [1, 3], job.log()  # the uncaught error of DDP's backward ends rank 0 as under torch
    verdict = _verdict(job.logs[0])
    assert "rank 1 (pid" in verdict and "has died without a word" in verdict
    assert f"rank 0 was in all_reduce #7 ({line_of('peer-exits-backward')}" in verdict
    assert re.search(r"which failed: RuntimeError: .*Connection (closed|reset) by peer", job.logs[0])
    # asked as DDP's wait failed, so the report comes before the error leaves backward() (under
    # torchrun the survivors are stopped when the first rank exits: a report at exit never came)
    assert job.logs[0].index("What next:") < job.logs[0].index("Traceback (most recent call last)"), job.log()


def test_a_script_catches_the_error_of_a_collective_whose_peer_exited(tmp_path):
    job = run_job("peer_exit_caught", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [0, 1], job.log()  # rank 0 caught the error and its script ended well
    text = job.logs[0]
    assert "caught on rank 0: RuntimeError" in text and "finally ran on rank 0" in text, job.log()
    verdict = _verdict(text)  # the report came first, naming the rank and both lines
    assert f"rank 1 has exited after an uncaught RuntimeError: rank 1 gives up at {line_of('caught-exits')}" in verdict
    assert line_of("caught-waits") in verdict, job.log()
    assert text.index("What next:") < text.index("caught on rank 0")
    assert job.seconds < PROMPT


def test_a_rank_that_calls_sys_exit_is_named_with_the_line(tmp_path):
    # Python keeps no trace of the SystemExit that ends a script: the report said "its script ended
    # or called sys.exit()"
    job = run_job("exits_early", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [1, 3], job.log()
    verdict = _verdict(job.logs[0])
    assert (f"rank 1 has exited without ddpkit.shutdown(): it called sys.exit(3) at {line_of('sys-exit')} in "
            "exits_early()") in verdict, job.log()
    assert line_of("exit-waits") in verdict, job.log()
    assert job.seconds < PROMPT


def test_a_rank_that_shut_down_lets_go_of_its_connections_at_once(tmp_path):
    # the recorder held the group through its logs: the peer learnt of the exit only when the
    # process ended (SLOW_SECONDS later)
    job = run_job("leaves_then_lingers", 2, tmp_path, stall_timeout=STALL)
    assert job.codes == [0, 0], job.log()
    seconds = float(re.search(r"raised after ([0-9.]+) s", job.logs[0]).group(1))
    assert seconds < SLOW_SECONDS - 1, job.log()


def test_the_rank_that_hosts_the_store_killed(tmp_path):
    # under SLURM or MPI rank 0 hosts the store: with it gone there is no inquiry, but a rank that
    # waits says where, and ends with the code
    job = run_job("store_host_killed", 3, tmp_path, stall_timeout=STALL, rank0_hosts_store=True)
    assert job.codes == [-signal.SIGKILL, HANG_EXIT_CODE, HANG_EXIT_CODE], job.log()
    for text in job.logs[1:]:
        assert f"this rank waits in all_reduce #2 at {line_of('host-killed')}" in text
        assert "the rendezvous store is unreachable" in text
    assert job.seconds < PROMPT
