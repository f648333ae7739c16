"""Job identity, the derived ports, the batch script without srun, PMIx sizes and thread shares."""
from __future__ import annotations

import pytest

from ddpkit.errors import LauncherVariableError
from ddpkit.runtime.env import detect
from ddpkit.runtime.environments.job import job_id
from ddpkit.runtime.environments.ports import PORT_BASE, PORT_SPAN, mpi_port, port_for_job, slurm_port
from ddpkit.runtime.environments.threads import thread_share

SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "vm"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "2052915201",
          "PMIX_NAMESPACE": "2052915201", "PMIX_RANK": "0"}
BATCH = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2",
         "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "vm", "SLURM_LOCALID": "0"}
# salloc -n 2's shell (as SLURM 22 sets it on the submit host): the job's variables, no task's
SALLOC = {"SLURM_JOB_ID": "31", "SLURM_JOBID": "31", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2",
          "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "vm", "SLURM_NNODES": "1", "SLURM_SUBMIT_HOST": "vm"}


@pytest.mark.parametrize("environ, launcher, expected", [
    (SRUN, "slurm", "slurm:4242.1"),
    ({**SRUN, "SLURM_STEP_ID": "4294967294"}, "slurm", "slurm:4242.batch"),
    (MPIRUN, "mpi", "mpi:2052915201"),
    ({"PMIX_NAMESPACE": "prterun-vm-1@1"}, "mpi", "mpi:prterun-vm-1@1"),
    ({**MPIRUN, **BATCH}, "mpi", "mpi:2052915201"),  # mpirun inside a batch script: the MPI job
    ({"TORCHELASTIC_RUN_ID": "abc", **SRUN}, "torchrun", "run:abc"),
    ({"TORCHELASTIC_RUN_ID": "none", **SRUN}, "torchrun", "slurm:4242.1"),  # torchrun's default id
    ({"DDPKIT_JOB_ID": "mine", **SRUN}, "slurm", "user:mine"),
    ({"DDPKIT_JOB_ID": "run:abc"}, "ddpkit", "run:abc"),  # as 'ddpkit run' passes it to workers
    ({"RANK": "0"}, "torchrun", None),
])
def test_every_launcher_names_its_job(environ, launcher, expected):
    assert job_id(environ, launcher) == expected


def test_slurm_ports_follow_the_whole_job_id_and_the_step():
    port = slurm_port(SRUN)
    assert port == PORT_BASE + (4242 * 16 + 1) % PORT_SPAN and 20000 <= port < 32000
    assert slurm_port({**SRUN, "SLURM_STEP_ID": "2"}) == port + 1  # two steps of one allocation
    assert slurm_port({**SRUN, "SLURM_JOB_ID": "14242"}) != port  # the old rule's 15000 + last 4 digits
    ports = {slurm_port({**SRUN, "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)})
             for job in range(1000, 1750) for step in range(16)}
    assert len(ports) == 750 * 16  # nearby jobs and their first 16 steps never share a port
    assert detect(SRUN).master_port == port
    assert detect({**SRUN, "MASTER_PORT": "29777"}).master_port == 29777  # MASTER_PORT still wins


def test_mpirun_ports_follow_the_mpi_job_id():
    assert mpi_port(MPIRUN) == port_for_job("2052915201")
    assert detect(MPIRUN).master_port == mpi_port(MPIRUN)
    assert detect({**MPIRUN, "OMPI_MCA_ess_base_jobid": "2052980737"}).master_port != mpi_port(MPIRUN)
    assert detect({**MPIRUN, "MASTER_PORT": "29777"}).master_port == 29777


def test_a_batch_script_with_several_tasks_is_told_to_use_srun():
    with pytest.raises(LauncherVariableError, match=r"batch script of SLURM job 77.*SLURM_NTASKS=2 but "
                       r"SLURM_STEP_ID is unset.*HINT: start the script with srun") as caught:
        detect(BATCH)
    assert (caught.value.variable, caught.value.value) == ("SLURM_STEP_ID", None)
    with pytest.raises(LauncherVariableError, match=r"SLURM_STEP_ID=4294967294 is SLURM's batch step"):
        detect({**BATCH, "SLURM_STEP_ID": "4294967294"})


def test_a_single_task_batch_script_is_a_world_of_one():
    env = detect({**BATCH, "SLURM_NTASKS": "1", "SLURM_NPROCS": "1", "SLURM_TASKS_PER_NODE": "1"})
    assert (env.rank, env.world_size) == (0, 1)


def test_mpirun_inside_a_batch_script_is_read_as_mpi():
    env = detect({**BATCH, **MPIRUN, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (env.launcher, env.rank, env.world_size) == ("mpi", 1, 2)


def test_mpirun_whose_daemon_runs_in_an_srun_step_is_still_read_as_mpi():
    # Open MPI starts its daemons on the other nodes with srun: their ranks inherit a step's variables
    env = detect({**SRUN, **MPIRUN, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (env.launcher, env.rank, env.world_size) == ("mpi", 1, 2)


def test_pmix_without_pmix_size_reads_open_mpis_size():
    env = detect({"PMIX_RANK": "1", "OMPI_MCA_orte_ess_num_procs": "3", "PMIX_NAMESPACE": "7"})
    assert (env.launcher, env.rank, env.world_size) == ("mpi", 1, 3)


def test_pmix_without_any_size_names_every_variable_it_tried():
    with pytest.raises(LauncherVariableError, match=r"PMIX_RANK='0' is set but the number of ranks is not: "
                       r"none of PMIX_SIZE, OMPI_COMM_WORLD_SIZE, .* is set\. HINT") as caught:
        detect({"PMIX_RANK": "0"})
    assert caught.value.variable == "PMIX_SIZE"


@pytest.mark.parametrize("launcher, local, environ, cores, expected", [
    ("slurm", 2, {}, 8, 4), ("mpi", 3, {}, 8, 2), ("mpi", 4, {}, 2, 1),
    ("slurm", 2, {"OMP_NUM_THREADS": "3"}, 8, None),  # the user's setting wins
    ("slurm", 2, {"SLURM_CPUS_PER_TASK": "4"}, 4, 4),  # a mask of the task's own cores: not divided
    ("slurm", 2, {"SLURM_CPUS_PER_TASK": "4"}, 2, 2),
    ("ddpkit", 2, {}, 8, None), ("torchrun", 2, {}, 8, None), ("single", 1, {}, 8, None),
])
def test_srun_and_mpirun_ranks_share_the_cores_like_ddpkit_runs_workers(launcher, local, environ, cores,
                                                                       expected):
    assert thread_share(launcher, local, environ, cores) == expected


def test_salloc_shell_asking_for_several_tasks_is_refused_not_run_as_one_process():
    with pytest.raises(LauncherVariableError, match=r"^SLURM job 31 asks for SLURM_NTASKS=2 tasks, but this process "
                                                    r"is not one of them: SLURM_PROCID is unset.*HINT: start the "
                                                    r"script with srun") as caught:
        detect(SALLOC)
    assert caught.value.variable == "SLURM_PROCID"


@pytest.mark.parametrize("extra", [{"SLURM_NTASKS": "1", "SLURM_NPROCS": "1"}, MPIRUN,
                                   {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "vm", "MASTER_PORT": "29500",
                                    "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}],
                         ids=["one_task", "mpirun", "torchrun"])
def test_salloc_shell_with_one_task_or_a_launcher_inside_is_no_refusal(extra):
    env = detect({**SALLOC, **extra})
    assert env.world_size == (1 if extra.get("SLURM_NTASKS") == "1" else 2)


def test_a_refused_stranger_is_told_of_once_by_whichever_reader_of_the_store_comes_first():
    # a multi-node launcher and its rank 0 worker both read node 0's store
    import torch.distributed as dist

    from ddpkit.errors import RendezvousError
    from ddpkit.runtime.job_check import JobRecord, check_member, tell_of_intruders

    store = dist.HashStore()
    stranger, owner = JobRecord("run:b", 2, "node 1's ddpkit run", "h", 7), JobRecord("run:a", 2, "rank 0", "h", 1)
    with pytest.raises(RendezvousError):
        check_member(store, stranger, owner, "h:29500")
    launcher, rank0 = [], []
    assert tell_of_intruders(store, 0, "h:29500", launcher.append) == 1
    assert tell_of_intruders(store, 0, "h:29500", rank0.append) == 1
    assert len(launcher) == 1 and "job run:b (node 1's ddpkit run" in launcher[0] and rank0 == []
