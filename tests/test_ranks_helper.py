"""The multi-rank test helper itself: results in rank order, failures tagged, nothing left running."""
from __future__ import annotations

import os
import threading

import psutil
import pytest
from ranks import RankFailure, run_ranks


def _rank_and_pid():
    return int(os.environ["RANK"]), os.getpid()


def _fail_on_rank_one():
    if os.environ["RANK"] == "1":
        raise KeyError("missing-on-rank-1")
    return "ok"


def _hang_on_rank_zero(pid_dir):
    with open(os.path.join(pid_dir, os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    if os.environ["RANK"] == "0":
        threading.Event().wait()  # never set: a hang
    return "done"


@pytest.mark.timeout(30)
def test_results_come_back_in_rank_order_from_separate_processes():
    results = run_ranks(_rank_and_pid, 3, init=False)
    assert [r for r, _ in results] == [0, 1, 2]
    assert len({pid for _, pid in results} | {os.getpid()}) == 4
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for _, pid in results)


@pytest.mark.timeout(30)
def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(_fail_on_rank_one, 2, init=False)
    assert list(info.value.failures) == [1]
    assert "KeyError: 'missing-on-rank-1'" in info.value.failures[1]
    assert "--- rank 1 ---" in str(info.value)


@pytest.mark.timeout(30)
def test_a_hanging_rank_is_killed_at_the_deadline(tmp_path):
    with pytest.raises(RankFailure, match="rank 0"):
        run_ranks(_hang_on_rank_zero, 2, args=(str(tmp_path),), init=False, timeout=3)
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    assert not any(psutil.pid_exists(pid) for pid in pids)
