"""Layouts that schedulers really produce, read from plain dicts (regressions for detect())."""
from __future__ import annotations

import pytest
import torch

from ddpkit.errors import LauncherVariableError
from ddpkit.runtime.env import detect


def _layout(env):
    return env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank


def test_slurm_ntasks_per_node_in_the_repeat_format():
    env = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)",
                  "SLURM_JOB_NODELIST": "node[1-2]"})
    assert _layout(env) == (5, 8, 1, 4, 1)


@pytest.mark.parametrize("rank, layout", [(1, (1, 3, 1, 2, 0)), (2, (2, 3, 0, 1, 1))])
def test_slurm_uneven_tasks_per_node_without_nodeid(rank, layout):
    # srun's block distribution: node 0 runs ranks 0-1, node 1 runs rank 2
    env = detect({"SLURM_PROCID": str(rank), "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "2,1",
                  "SLURM_JOB_NODELIST": "a,b"})
    assert _layout(env) == layout


def test_slurm_ntasks_per_node_without_nodeid_or_nodelist():
    env = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4",
                  "SLURM_NNODES": "2", "MASTER_ADDR": "n0"})
    assert _layout(env) == (5, 8, 1, 4, 1)


def test_slurm_tasks_per_node_that_do_not_cover_the_rank():
    with pytest.raises(LauncherVariableError, match=r"SLURM_PROCID=5 .* SLURM_TASKS_PER_NODE='2,1'.*HINT"):
        detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "2,1",
                "MASTER_ADDR": "n0"})


def test_open_mpi_map_by_node_deals_ranks_round_robin():
    # mpirun --map-by node: rank 1 is the first rank on node 1
    env = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                  "OMPI_COMM_WORLD_NODE_RANK": "0", "MASTER_ADDR": "n0"})
    assert _layout(env) == (1, 4, 0, 2, 1)


@pytest.mark.parametrize("rank, layout", [(0, (0, 4, 0, 2, 0)), (1, (1, 4, 1, 2, 0)),
                                          (2, (2, 4, 0, 2, 1)), (3, (3, 4, 1, 2, 1))])
def test_open_mpi_node_rank_is_the_node_index_not_ompi_node_rank(rank, layout):
    # OMPI_COMM_WORLD_NODE_RANK is the process's rank on its node (over all jobs there), not the node
    env = detect({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
                  "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 2), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                  "OMPI_COMM_WORLD_NODE_RANK": str(rank % 2), "MASTER_ADDR": "n0"})
    assert _layout(env) == layout


# a real srun task environment (4 nodes, srun -n4 inside an --ntasks-per-node=4 allocation), SLURM_* only
SRUN_4_NODES = {"SLURM_NODELIST": "gnode[10,20,25,37]", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "4",
                "SLURM_JOBID": "200505", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "1(x4)",
                "SLURM_JOB_ID": "200505", "SLURM_NPROCS": "4", "SLURM_CPUS_ON_NODE": "4",
                "SLURM_JOB_NODELIST": "gnode[10,20,25,37]", "SLURM_JOB_CPUS_PER_NODE": "4(x4)",
                "SLURM_JOB_NUM_NODES": "4", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("rank", range(4))
def test_slurm_tasks_per_node_layout_wins_over_the_allocations_ntasks_per_node(rank):
    env = detect({**SRUN_4_NODES, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank), "SLURM_LOCALID": "0"})
    assert _layout(env) == (rank, 4, 0, 1, rank)
    assert (env.master_addr, env.master_port) == ("gnode10", 20000 + (200505 * 16) % 12000)


@pytest.mark.parametrize("rank", range(2))
def test_slurm_step_variables_win_over_the_job_variables(rank):
    # srun -N1 -n2 inside a 2-node allocation made with --ntasks-per-node=4; the step runs on n2
    env = detect({"SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
                  "SLURM_NTASKS_PER_NODE": "4", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2",
                  "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "n2",
                  "SLURM_PROCID": str(rank)})
    assert _layout(env) == (rank, 2, rank, 2, 0)
    assert env.master_addr == "n2"


def test_slurm_step_tasks_disagreeing_with_the_step_layout_are_refused():
    with pytest.raises(LauncherVariableError, match=r"SLURM_STEP_NUM_TASKS=3 disagrees with "
                                         r"SLURM_STEP_TASKS_PER_NODE='2' = 2 tasks\. HINT"):
        detect({"SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NTASKS": "3",
                "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n1"})


@pytest.mark.parametrize("ntasks, rank, layout", [("2", 0, (0, 2, 0, 1, 0)), ("2", 1, (1, 2, 0, 1, 1)),
                                                  ("4", 2, (2, 4, 0, 2, 1)), ("3", 2, (2, 3, 0, 1, 1))])
def test_slurm_without_per_node_counts_splits_the_tasks_over_the_nodes(ntasks, rank, layout):
    env = detect({"SLURM_PROCID": str(rank), "SLURM_NTASKS": ntasks, "SLURM_NNODES": "2",
                  "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"})
    assert _layout(env) == layout


def test_ddpkit_env_prints_the_layout_or_one_clear_error(monkeypatch, capsys):
    from ddpkit.cli import main

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert main(["env"]) == 1
    assert capsys.readouterr().err.startswith("ddpkit env: error: RANK=1 and WORLD_SIZE=2")
    monkeypatch.setenv("MASTER_ADDR", "h")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "rank=1, world_size=2" in out
    # what init() would choose, not None: backend and device are part of the layout a user checks
    if not torch.cuda.is_available():
        assert "backend='gloo', device=device(type='cpu')" in out
    monkeypatch.setenv("DDPKIT_BACKEND", "mpi-nonsense")
    assert main(["env"]) == 1
    assert "mpi-nonsense" in capsys.readouterr().err
    monkeypatch.delenv("DDPKIT_BACKEND")
    for name, value in (("DDPKIT_STALL_TIMEOUT", "abc"), ("DDPKIT_CHECK_COLLECTIVES", "maybe")):
        monkeypatch.setenv(name, value)  # what init() refuses, env refuses too
        assert main(["env"]) == 1
        assert f"{name}='{value}' is not" in capsys.readouterr().err
        monkeypatch.delenv(name)


def test_second_init_refuses_a_different_backend_or_settings_and_a_dead_group_is_rebuilt(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist

    import ddpkit

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "DDPKIT_STALL_TIMEOUT",
                 "DDPKIT_CHECK_COLLECTIVES"):
        monkeypatch.delenv(name, raising=False)
    try:
        env = ddpkit.init(backend="gloo", timeout=timedelta(seconds=30))
        assert ddpkit.init(backend="gloo") is env
        with pytest.raises(ValueError, match=r"backend='mpi'.*made by an earlier init\(\), uses backend 'gloo'.*HINT"):
            ddpkit.init(backend="mpi")
        # the first call's settings hold: asking again for them is fine, for others raises
        assert ddpkit.init(timeout=30, stall_timeout=60, check_collectives=False) is env
        with pytest.raises(ValueError, match=r"^ddpkit.init\(stall_timeout=5.0\) but this process already joined "
                                             r"with stall_timeout=60.0\. HINT: call ddpkit.shutdown\(\) first"):
            ddpkit.init(stall_timeout=5)
        with pytest.raises(ValueError, match=r"init\(timeout=600s\) .* already joined with timeout=30s"):
            ddpkit.init(timeout=600)
        with pytest.raises(ValueError, match=r"init\(check_collectives=True\) .* with check_collectives=False"):
            ddpkit.init(check_collectives=True)
        dist.destroy_process_group()  # behind ddpkit's back
        assert ddpkit.init().world_size == 1 and dist.is_initialized()
    finally:
        ddpkit.shutdown()
    with pytest.raises(ValueError, match=r"timeout=.* must be a positive duration"):
        ddpkit.init(timeout=timedelta(0))


def test_detect_reads_os_environ_when_given_nothing(monkeypatch):
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert detect().launcher == "torchrun"


@pytest.mark.parametrize("name, value", [("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "4"), ("GROUP_RANK", "2"),
                                         ("GROUP_WORLD_SIZE", "2")])
def test_a_local_or_node_rank_of_several_without_a_launcher_is_refused(name, value):
    # each such process would otherwise train alone as rank 0 of a world of one
    with pytest.raises(LauncherVariableError, match=rf"{name}={value} says this process is one of several.*"
                       rf"RANK and WORLD_SIZE are unset.*HINT:.*unset {name}") as caught:
        detect({name: value})
    assert (caught.value.variable, caught.value.value) == (name, value)


def test_a_local_rank_that_fits_one_process_or_beside_a_launcher_is_accepted():
    assert detect({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}).launcher == "single"
    # scripts export LOCAL_RANK=$SLURM_LOCALID or $OMPI_COMM_WORLD_LOCAL_RANK beside their launcher's own
    env = detect({"LOCAL_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})
    assert (env.launcher, env.rank, env.local_rank) == ("slurm", 1, 1)
    env = detect({"LOCAL_RANK": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (env.launcher, env.rank) == ("mpi", 1)


def test_slurm_hint_names_the_variables_that_are_set():
    with pytest.raises(LauncherVariableError, match=r"SLURM_LOCALID=5 .*HINT:.*check SLURM_NTASKS and "
                       r"SLURM_NNODES\.$"):
        detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_LOCALID": "5",
                "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"})
