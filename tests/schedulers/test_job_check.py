"""The job check of the rendezvous, with ranks started by hand: no launcher is needed to meet a stranger."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from conftest import python_env
from helpers import COLLECTIVE, REPO, rank_lines

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, job: str | None, marker: str = "1") -> subprocess.Popen:
    env = python_env(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))
    if job is not None:
        env["DDPKIT_JOB_ID"] = job
    return subprocess.Popen([sys.executable, COLLECTIVE, marker, "30"], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(process: subprocess.Popen, seconds: float) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        out, err = process.communicate(timeout=seconds)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return out, err, time.monotonic() - start


def test_a_rank_of_another_job_is_refused_at_once_and_the_owner_is_told():
    port = _free_port()
    owners = [_rank(0, 3, port, "train-a"), _rank(1, 3, port, "train-a")]
    try:
        time.sleep(3)  # the owner's store is up, waiting for its rank 2
        out, err, seconds = _wait_for(_rank(2, 3, port, "train-b", marker="100"), 60)
        assert seconds < 15, err  # refused at once, not after the 30 s timeout
        assert f"the rendezvous at 127.0.0.1:{port} (port {port}) belongs to another job: job user:train-a " \
               "(rank 0, pid" in err
        assert "This is job user:train-b (rank 2, pid" in err
        assert "HINT: two jobs share the port: give each job its own port (MASTER_PORT, or the --master-port" in err
        owners.append(_rank(2, 3, port, "train-a"))
        results = [_wait_for(p, 60) for p in owners]
    finally:
        for p in owners:
            p.kill()
    lines = rank_lines("".join(out for out, _, _ in results))
    assert [(line.rank, line.total, line.markers) for line in lines] == [(r, 6, 3) for r in range(3)]
    told = results[0][1]
    assert "job user:train-b (rank 2, pid" in told and "was refused; this job goes on without it" in told


def test_unnamed_jobs_of_different_sizes_are_refused():
    port = _free_port()
    owner = _rank(0, 2, port, None)
    try:
        time.sleep(2)
        _, err, seconds = _wait_for(_rank(1, 3, port, None), 60)
        assert seconds < 15
        assert "belongs to another unnamed job (or this job, launched with a different WORLD_SIZE): an " \
               "unnamed job (rank 0, pid" in err and "WORLD_SIZE=2)" in err
    finally:
        owner.kill()
        owner.communicate()


def test_one_rank_given_twice_is_refused():
    port = _free_port()
    ranks = [_rank(0, 3, port, "dup"), _rank(1, 3, port, "dup"), _rank(1, 3, port, "dup")]
    try:
        deadline = time.monotonic() + 25  # the one that came second exits at once; the others wait
        while all(p.poll() is None for p in ranks[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        second = next(p for p in ranks[1:] if p.poll() is not None)
        err = second.communicate()[1]
        assert "rank 1 joined the rendezvous at" in err and "twice" in err, err
    finally:
        for p in ranks:
            p.kill()
            p.communicate()


def test_a_port_already_in_use_is_reported_at_once_naming_its_holder():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        _, err, seconds = _wait_for(_rank(0, 2, port, "train-a"), 60)
    assert seconds < 15, err  # not after the 30 s rendezvous timeout
    assert f"rank 0 cannot host the rendezvous: port {port} on {socket.gethostname()} is already in use " \
           "(MASTER_PORT is set). Another process, probably another job, holds it: pid " in err, err
    assert "HINT: give each job its own port (MASTER_PORT, or the --master-port" in err
