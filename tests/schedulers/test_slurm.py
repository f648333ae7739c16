"""ddpkit under a real single-node SLURM: srun steps, sbatch scripts, two jobs on one port, srun forgotten."""
from __future__ import annotations

import re
import sys
import time

import pytest
from conftest import python_env
from helpers import (
    COLLECTIVE,
    EXAMPLE,
    REPO,
    TRAIN_FLAGS,
        losses,
    rank_lines,
    run_together,
)

from ddpkit.runtime.environments.ports import slurm_port

pytestmark = pytest.mark.timeout(240)


def _submit(slurm, tmp_path, *args: str, env: dict[str, str] | None = None) -> tuple[str, str, float]:
    """sbatch ``args``; wait for the job; return its id, its output file's text and its run time."""
    out = tmp_path / "job.out"
    start = time.monotonic()
    result = slurm.run("sbatch", "--parsable", f"--output={out}", *args, env=env or python_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip().split(";")[0]
    slurm.wait_job(job, timeout=180)
    return job, out.read_text() if out.exists() else "", time.monotonic() - start


@pytest.mark.parametrize("tasks", [2, 3])
def test_srun_tasks_all_reduce_on_the_port_of_their_job_step(slurm, tasks):
    result = slurm.run("srun", "--overcommit", f"-n{tasks}", sys.executable, COLLECTIVE, "1", "60", "0",
                       env=python_env(), timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = rank_lines(result.stdout)
    assert [line.rank for line in lines] == list(range(tasks)), result.stdout + result.stderr
    assert {(line.world_size, line.local_world_size, line.launcher) for line in lines} == {(tasks, tasks, "slurm")}
    assert {line.total for line in lines} == {tasks * (tasks + 1) / 2}
    assert len({line.port for line in lines}) == 1 and 20000 <= lines[0].port < 32000
    assert {line.threads for line in lines} == {max(1, slurm.cpus // tasks)}  # as 'ddpkit run' gives


def test_ddpkit_run_once_per_srun_task_numbers_its_nodes_from_the_step(slurm):
    # srun --ntasks-per-node=1 on N nodes, one launcher each; here two "nodes" of one host
    result = slurm.run("srun", "--overcommit", "-n2", sys.executable, "-m", "ddpkit", "run", "--nnodes", "2",
                       "--nproc-per-node", "1", COLLECTIVE, "1", "60", "0", env=python_env(), timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = rank_lines(result.stdout)
    assert sorted(line.rank for line in lines) == [0, 1], result.stdout + result.stderr
    assert {(line.world_size, line.launcher, line.total) for line in lines} == {(2, "ddpkit", 3)}


def test_srun_trains_the_example_to_ddpkit_runs_losses(slurm, reference_losses):
    result = slurm.run("srun", "-n2", sys.executable, EXAMPLE, *TRAIN_FLAGS, env=python_env(), timeout=180,
                       cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    ours = losses(result.stdout)
    assert [s for s, _ in ours] == [s for s, _ in reference_losses] and ours
    assert [v for _, v in ours] == pytest.approx([v for _, v in reference_losses], rel=1e-5)


def test_slurm_sbatch_script_with_the_cpu_recipe_trains_like_ddpkit_run(slurm, tmp_path,
                                                                      reference_losses):
    env = python_env(SBATCH_GPUS_PER_NODE="0", PYTHON=sys.executable)
    _, output, _ = _submit(slurm, tmp_path, "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                           str(REPO / "launch" / "slurm.sbatch"), EXAMPLE, *TRAIN_FLAGS, env=env)
    ours = losses(output)
    assert [s for s, _ in ours] == [s for s, _ in reference_losses] and ours, output
    assert [v for _, v in ours] == pytest.approx([v for _, v in reference_losses], rel=1e-5)


def test_two_srun_steps_of_one_allocation_get_two_ports_and_stay_apart(slurm, tmp_path):
    step = f"srun --overlap --overcommit -n2 {sys.executable} {COLLECTIVE}"
    job, output, _ = _submit(slurm, tmp_path, "-n4", "--overcommit",
                             "--wrap", f"{step} 1 60 4 & {step} 100 60 4 & wait")
    lines = rank_lines(output)
    assert len(lines) == 4, output
    by_port: dict[int, set[tuple[float, float]]] = {}
    for line in lines:
        by_port.setdefault(line.port, set()).add((line.total, line.markers))
    assert sorted(by_port.values(), key=sorted) == [{(3, 2)}, {(3, 200)}], output  # two groups, unmixed
    assert set(by_port) == {slurm_port({"SLURM_JOB_ID": job, "SLURM_STEP_ID": s}) for s in ("0", "1")}


def test_two_srun_jobs_on_one_port_never_mix_and_the_loser_is_told_at_once(slurm):
    port = "25111"
    jobs = [slurm.command("srun", "-n2", "--overcommit", "--export=ALL", sys.executable, COLLECTIVE, marker,
                          "60", "6") for marker in ("1", "100")]
    results = run_together(jobs, python_env(MASTER_PORT=port), 200)
    for marker, done in zip((1, 100), results):
        for line in rank_lines(done.output):
            assert (line.total, line.markers) == (3, 2 * marker), done.output
    assert sorted(done.returncode == 0 for done in results) == [False, True], [d.output for d in results]
    for done in results:
        if done.returncode != 0:
            assert f"port {port}" in done.output and "another" in done.output, done.output
            assert "HINT: " in done.output and "MASTER_PORT" in done.output
            assert done.seconds < 40, done.output  # not after the 60 s rendezvous timeout


def test_a_batch_script_without_srun_is_told_to_use_srun_at_once(slurm, tmp_path):
    wrap = f"date +%s.%N; {sys.executable} {COLLECTIVE} 1 60; echo exit $?; date +%s.%N"
    _, output, _ = _submit(slurm, tmp_path, "-n2", "--overcommit", "--wrap", wrap)
    assert "exit 1" in output, output
    assert re.search(r"batch script of SLURM job \d+, run once, not a task of a job step: SLURM_NTASKS=2 but "
                     r"SLURM_STEP_ID is unset.*HINT: start the script with srun", output), output
    start, end = (float(t) for t in re.findall(r"^(\d+\.\d+)$", output, flags=re.M))
    assert end - start < 20, output  # python's start-up only: not the 60 s rendezvous timeout


def test_salloc_without_srun_is_told_to_use_srun_at_once(slurm):
    start = time.monotonic()
    result = slurm.run("salloc", "-n2", "--overcommit", sys.executable, str(COLLECTIVE), "1", "60",
                       env=python_env(), cwd=REPO, timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    assert re.search(r"SLURM job \d+ asks for SLURM_NTASKS=2 tasks, but this process is not one of them: "
                     r"SLURM_PROCID is unset.*HINT: start the script with srun", result.stderr), result.stderr
    assert time.monotonic() - start < 30  # not the 60 s rendezvous timeout, nor a world of one's success


def test_a_task_that_refuses_its_variables_ends_the_wait_of_the_others_at_once(slurm):
    # RANK exported before srun: task 1 refuses it, task 0 agrees and would wait the whole timeout,
    # since srun without --kill-on-bad-exit lets it run on
    env = python_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    start = time.monotonic()
    result = slurm.run("srun", "--overcommit", "-n2", sys.executable, COLLECTIVE, "1", "60", "0", env=env,
                       timeout=120, cwd=REPO)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "RANK=0 but SLURM_PROCID=1" in result.stderr, result.stderr
    assert re.search(r"a process of this job \(pid \d+ on \S+\) refused its launcher variables, so not all of "
                     r"WORLD_SIZE=2 ranks can join the rendezvous at 127\.0\.0\.1:\d+ \(this is rank 0\)\. Its error: "
                     r"RANK=0 but SLURM_PROCID=1", result.stderr), result.stderr
    assert time.monotonic() - start < 40  # not the 60 s rendezvous timeout


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_single_task_batch_script_runs_as_a_world_of_one(slurm, tmp_path):
    _, output, _ = _submit(slurm, tmp_path, "-n1", "--wrap", f"{sys.executable} {COLLECTIVE}")
    [line] = rank_lines(output)
    assert (line.rank, line.world_size, line.total) == (0, 1, 1), output
