"""ddpkit under Open MPI's mpirun: the layout, a collective, the example's losses, and two jobs on one port."""
from __future__ import annotations

import sys

import pytest
from conftest import python_env
from helpers import COLLECTIVE, EXAMPLE, REPO, TRAIN_FLAGS, losses, rank_lines, run_together

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("ranks", [2, 3])
def test_mpirun_ranks_all_reduce_over_a_port_of_their_own(mpirun, ranks):
    [done] = run_together([[*mpirun, "-np", str(ranks), sys.executable, COLLECTIVE]], python_env(), 180)
    assert done.returncode == 0, done.output
    lines = rank_lines(done.output)
    assert [line.rank for line in lines] == list(range(ranks)), done.output
    assert {(line.world_size, line.local_world_size, line.launcher) for line in lines} == {(ranks, ranks, "mpi")}
    assert {line.total for line in lines} == {ranks * (ranks + 1) / 2}
    assert len({line.port for line in lines}) == 1 and 20000 <= lines[0].port < 32000  # derived, not 29500
    assert {line.threads for line in lines} == {max(1, len_cores() // ranks)}


def test_mpirun_trains_the_example_to_ddpkit_runs_losses(mpirun, reference_losses):
    [done] = run_together([[*mpirun, "-np", "2", sys.executable, EXAMPLE, *TRAIN_FLAGS]], python_env(), 180)
    assert done.returncode == 0, done.output
    ours = losses(done.output)
    assert [s for s, _ in ours] == [s for s, _ in reference_losses] and ours
    assert [v for _, v in ours] == pytest.approx([v for _, v in reference_losses], rel=1e-5)


def test_two_mpiruns_on_one_port_never_mix_and_the_loser_is_told_at_once(mpirun):
    port = "24999"
    jobs = [[*mpirun, "-np", "2", "-x", f"MASTER_PORT={port}", sys.executable, COLLECTIVE, marker, "60", "6"]
            for marker in ("1", "100")]
    results = run_together(jobs, python_env(), 200)
    for marker, done in zip((1, 100), results):
        for line in rank_lines(done.output):  # whatever finished, finished within its own job
            assert (line.total, line.markers) == (3, 2 * marker), done.output
    losers = [done for done in results if done.returncode != 0]
    assert len(losers) == 1, [done.output for done in results]  # they met (both hold the port 6 s)
    for done in losers:
        assert f"port {port}" in done.output and "another" in done.output, done.output
        assert "HINT: " in done.output and "MASTER_PORT" in done.output
        assert done.seconds < 40, done.output  # at once: not after the 60 s rendezvous timeout


def len_cores() -> int:
    import os
    return len(os.sched_getaffinity(0))


def test_a_certain_deadlock_under_mpirun_ends_with_the_report_and_no_noise_from_the_store(mpirun, tmp_path):
    # rank 0 hosts the store: it leaves last, so no rank's last store call finds it gone (torch then
    # printed a C++ trace, and ddpkit a second, wrong cause); two runs, as the race went either way
    demo = str(REPO / "examples" / "hang_demo.py")
    runs = run_together([[*mpirun, "-np", "2", "-x", "DDPKIT_STALL_TIMEOUT", "-x", "TMPDIR", sys.executable, demo]] * 2,
                        python_env(DDPKIT_STALL_TIMEOUT="3", TMPDIR=str(tmp_path)), 180)  # it saves in TMPDIR
    for done in runs:
        assert done.returncode == 86, done.output
        assert done.output.count("certain deadlock") == 2, done.output  # each rank's report
        assert "frame #" not in done.output and "store is unreachable" not in done.output, done.output
