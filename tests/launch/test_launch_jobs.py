"""``ddpkit run``'s job identity: workers name the launcher's job, and a node of another run is refused."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.launch.config import launch_job_id, parse_args
from ddpkit.launch.workers import Placement, worker_env

REPO = Path(__file__).resolve().parents[2]
_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "ROLE_", "TORCHELASTIC_", "SLURM_", "OMPI_",
             "PMIX_", "DDPKIT_")


def test_the_run_is_named_by_the_user_the_rdzv_id_or_the_scheduler():
    assert launch_job_id({"DDPKIT_JOB_ID": "mine"}, "abc", 2) == "user:mine"
    assert launch_job_id({}, "abc", 2) == "run:abc"
    assert launch_job_id({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0"}, "none", 2) == "slurm:12.0"
    assert launch_job_id({}, "none", 2) is None  # several nodes and nothing to name them: unnamed
    assert launch_job_id({}, "none", 1).startswith("run:")  # one node: its own fresh name


def test_workers_are_given_the_launchers_job_and_multi_node_ports_follow_the_scheduler():
    place = Placement(0, 0, 2, 2, 0, 1)
    env = worker_env({}, place, master_addr="127.0.0.1", master_port=1, attempt=0, max_restarts=0,
                     run_id="none", job_id="slurm:12.0")
    assert env["DDPKIT_JOB_ID"] == "slurm:12.0"
    srun = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}
    config = parse_args(["--nnodes", "2", "--node-rank", "0", "--master-addr", "n0", "x.py"], srun)
    assert config.master_port == 20000 + (4242 * 16 + 1) % 12000 and config.job_id == "slurm:4242.1"
    assert parse_args(["--nnodes", "2", "--node-rank", "0", "--master-addr", "n0", "x.py"], {}).master_port == 29500


# srun --ntasks-per-node=1 -N 2 ddpkit run --nnodes 2 ...: task 1 of the step, on the second node
SRUN_TASK_PER_NODE = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NODEID": "1",
                      "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
                      "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]"}


def test_under_srun_with_a_task_per_node_the_node_rank_and_node_0_come_from_the_step():
    config = parse_args(["--nnodes", "2", "x.py"], SRUN_TASK_PER_NODE)
    assert (config.node_rank, config.master_addr, config.master_port) == (1, "gpu07", 20000 + (4242 * 16) % 12000)
    given = parse_args(["--nnodes", "2", "--node-rank", "0", "--master-addr", "n0", "x.py"], SRUN_TASK_PER_NODE)
    assert (given.node_rank, given.master_addr) == (0, "n0")  # the flags win
    two_per_node = {**SRUN_TASK_PER_NODE, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    assert (parse_args(["--nnodes", "2", "x.py"], two_per_node).node_rank, parse_args(
        ["--nnodes", "2", "x.py"], two_per_node).master_addr) == (0, "127.0.0.1")  # torchrun's defaults
    assert parse_args(["x.py"], SRUN_TASK_PER_NODE).node_rank == 0  # one node: nothing to number


@pytest.mark.timeout(60)
def test_a_node_of_another_run_is_refused_at_once_and_node_0_is_told(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))

    def node(rank: int, run: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-id", run,
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "8",
             "--nproc-per-node", "1", "examples/train_ddp.py"], env=env, cwd=REPO, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    owner = node(0, "train-a")
    try:
        time.sleep(2)
        start = time.monotonic()
        stranger = node(1, "train-b")
        _, err = stranger.communicate(timeout=30)
        assert stranger.returncode != 0 and time.monotonic() - start < 8, err  # before the 8 s timeout
        assert f"(port {port}) belongs to another job: job run:train-a (node 0's ddpkit run" in err, err
        assert "This is job run:train-b (node 1's ddpkit run" in err
        _, told = owner.communicate(timeout=30)
        assert "job run:train-b (node 1's ddpkit run" in told and "was refused" in told, told
    finally:
        for p in (owner,):
            if p.poll() is None:
                p.kill()
                p.communicate()


_ONE_ALL_REDUCE = """
import torch, ddpkit
env = ddpkit.init()
t = torch.ones(1)
ddpkit.all_reduce(t)
print(f"rank {env.rank} of {env.world_size}: sum {t.item():g}", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, process: subprocess.Popen, within: float = 30.0) -> None:
    """Until the launcher that hosts the rendezvous accepts connections on ``port``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} (launcher exit code {process.poll()})")


def _launch(args: list[str], script: Path, extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "ddpkit", "run", *args, str(script)] if args else
                            [sys.executable, str(script)], env={**env, **(extra or {})}, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(processes: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Every process's exit code and output, once it ends."""
    return [(p.returncode, out + err) for p in processes for out, err in [p.communicate(timeout=60)]]


def _kill_left(processes: list[subprocess.Popen]) -> None:
    """None is left running, pass or fail."""
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.communicate()


def _owner_stranger_then_own_node(port: int, owner_args: list[str], stranger: tuple, own_args: list[str],
                                  script: Path) -> tuple[tuple[int, str], tuple[int, str], tuple[int, str]]:
    """The owner's launcher (hosting the rendezvous), then a stranger that must be refused, then the
    owner's own second node: each one's exit code and output."""
    owner = _launch(owner_args, script)
    processes = [owner]
    try:
        _wait_listening(port, owner)
        processes.append(_launch(*stranger))
        refused = _finish([processes[-1]])[0]
        processes.append(_launch(own_args, script))
        return (refused, *_finish([owner, processes[-1]]))
    finally:
        _kill_left(processes)


@pytest.mark.timeout(120)
def test_a_refused_c10d_node_of_another_run_takes_no_node_number_from_the_run(tmp_path):
    # it took number 1, so the run's own second node was "one past --nnodes" and node 0 waited out
    # --rdzv-timeout for a node that had come
    script, port = tmp_path / "one.py", _free_port()
    script.write_text(_ONE_ALL_REDUCE)
    c10d = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-timeout", "40"]
    (code, said), (host_code, host_said), (joined_code, joined_said) = _owner_stranger_then_own_node(
        port, [*c10d, "--rdzv-id", "job-y"], ([*c10d, "--rdzv-id", "job-x"], script), [*c10d, "--rdzv-id", "job-y"],
        script)
    assert code == 1 and "belongs to another job: job run:job-y (node 0's ddpkit run" in said, said
    assert (host_code, joined_code) == (0, 0), host_said + joined_said
    assert "job run:job-x (a node's ddpkit run" in host_said and "was refused" in host_said, host_said
    assert "rank 0 of 2: sum 2" in host_said and "rank 1 of 2: sum 2" in joined_said


@pytest.mark.timeout(120)
def test_an_unnamed_run_of_several_nodes_refuses_a_stray_process_of_no_job(tmp_path):
    # RANK=1 ... python train.py by hand on the run's port joined its process group, and the run's own
    # rank 1 was then refused as "joined twice"
    script, port = tmp_path / "one.py", _free_port()
    script.write_text(_ONE_ALL_REDUCE)
    static = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--rdzv-timeout", "40"]
    by_hand = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    (code, said), (code0, said0), (code1, said1) = _owner_stranger_then_own_node(
        port, [*static, "--node-rank", "0"], ([], script, by_hand), [*static, "--node-rank", "1"], script)
    assert code == 1 and "belongs to another job: job unnamed-run:" in said, said
    assert "This is an unnamed job (rank 1" in said
    assert (code0, code1) == (0, 0), said0 + said1
    assert "an unnamed job (rank 1" in said0 and "was refused" in said0, said0
    assert "rank 0 of 2: sum 2" in said0 and "rank 1 of 2: sum 2" in said1
