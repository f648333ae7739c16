"""Environment detection: every launcher's variables, hostlists, and each invalid setting's message."""
from __future__ import annotations

import re

import pytest

from ddpkit.errors import LauncherVariableError
from ddpkit.runtime.env import DistEnv, detect, expand_hostlist

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}


def test_no_launcher_variables_is_the_single_process_fallback():
    assert detect({}) == DistEnv(0, 1, 0, 1, 0, None, None, "single")
    assert detect({"PATH": "/usr/bin", "HOME": "/root"}).launcher == "single"


def test_torchrun_variables():
    env = detect({**TORCHRUN, "TORCHELASTIC_RUN_ID": "x"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (3, 8, 1, 2, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("node0", 29400, "torchrun")
    assert env.backend is None and env.device is None


def test_ddpkit_run_marks_its_workers():
    assert detect({**TORCHRUN, "DDPKIT_LAUNCHER": "ddpkit"}).launcher == "ddpkit"


def test_torchrun_without_local_variables_assumes_one_node():
    env = detect({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (env.local_rank, env.local_world_size, env.node_rank) == (2, 4, 0)


def test_node_rank_derived_when_group_rank_missing():
    environ = {k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"}
    assert detect(environ).node_rank == 1


def test_world_of_one_needs_a_master_address_as_torchs_env_rendezvous_does():
    # torch's init_process_group: "environment variable MASTER_ADDR expected, but not set"
    with pytest.raises(LauncherVariableError, match=r"^RANK=0 and WORLD_SIZE=1 are set but MASTER_ADDR is not.*"
                       r"HINT: unset RANK and WORLD_SIZE to run one process") as caught:
        detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert isinstance(caught.value, ValueError) and caught.value.variable == "MASTER_ADDR"
    with pytest.raises(LauncherVariableError, match=r"^MASTER_ADDR=127.0.0.1 is set but MASTER_PORT is not"):
        detect({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
    env = detect({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"})
    assert (env.world_size, env.master_addr, env.master_port, env.launcher) == (1, "127.0.0.1", 29400, "torchrun")


def test_torchrun_variables_win_over_slurm():
    # torchrun started by srun, one per node: RANK is the truth, SLURM_PROCID is the node's task id
    env = detect({**TORCHRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert (env.rank, env.launcher) == (3, "torchrun")


_HAND_EXPORTED = {"RANK": "9", "WORLD_SIZE": "16", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
_SLURM_STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "9", "SLURM_NTASKS": "16",
               "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NODELIST": "n[1-2]",
               "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
_OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1"}


def test_rank_exported_by_hand_under_srun_or_mpirun_keeps_the_schedulers_node_layout():
    # srun bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS python train.py': not one node of 16
    env = detect({**_HAND_EXPORTED, **_SLURM_STEP})
    assert (env.rank, env.local_rank, env.local_world_size, env.node_rank) == (9, 1, 8, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("n1", 29500, "torchrun")
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1", **_OPEN_MPI})
    assert (env.local_rank, env.local_world_size, env.node_rank) == (1, 2, 1)


def test_the_schedulers_layout_is_not_taken_where_it_counts_other_ranks_or_torchrun_gave_its_own():
    # torchrun inside srun (one task per node): SLURM_PROCID is the node's task, LOCAL_RANK is set
    env = detect({**_HAND_EXPORTED, **_SLURM_STEP, "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                  "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "LOCAL_RANK": "1"})
    assert (env.rank, env.local_rank) == (9, 1)  # torchrun's own: SLURM's task rank is not RANK
    env = detect({**_HAND_EXPORTED, **_SLURM_STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "1"})  # other counts
    assert (env.rank, env.local_world_size) == (9, 16)
    env = detect({**_HAND_EXPORTED, **_SLURM_STEP, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"})
    assert (env.local_rank, env.local_world_size, env.node_rank) == (1, 8, 1)
    env = detect({**_HAND_EXPORTED, **_SLURM_STEP, "SLURM_NODELIST": "n[1-"})  # unread, as before
    assert (env.local_rank, env.local_world_size, env.node_rank) == (9, 16, 0)


@pytest.mark.parametrize("scheduler, name", [
    ({**_SLURM_STEP, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
      "SLURM_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2"}, "SLURM_PROCID"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK")])
def test_a_rank_exported_alike_to_every_task_is_refused_naming_the_schedulers_rank(scheduler, name):
    # export RANK=$SLURM_PROCID in the batch script: 0 on every task; rank 0 would wait 5 minutes
    with pytest.raises(LauncherVariableError, match=rf"^RANK=0 but {name}=1: this process is {name}=1 of "
                       rf"WORLD_SIZE=2.*HINT: unset RANK, WORLD_SIZE \(ddpkit reads {name} and the rest") as caught:
        detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500", **scheduler})
    assert (caught.value.variable, caught.value.value) == ("RANK", "0")
    # LOCAL_RANK exported alike beside it (export LOCAL_RANK=$SLURM_LOCALID): refused too
    with pytest.raises(LauncherVariableError, match=r"HINT: unset RANK, WORLD_SIZE, LOCAL_RANK \(ddpkit reads"):
        detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "29500",
                **scheduler})
    # torchrun or 'ddpkit run' inside the step: their rendezvous numbers the ranks, not the scheduler
    env = detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "j", "MASTER_ADDR": "n1",
                  "MASTER_PORT": "29500", **scheduler})
    assert (env.rank, env.launcher) == (0, "torchrun")


def test_rank_without_master_addr_under_mpirun_says_to_leave_the_rank_to_the_scheduler():
    with pytest.raises(LauncherVariableError, match=r"MASTER_ADDR is not.*HINT: OMPI_COMM_WORLD_RANK and "
                       r"OMPI_COMM_WORLD_SIZE=2 are set: unset RANK and WORLD_SIZE"):
        detect({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    # a scheduler counting other ranks (an srun --pty shell of one task) cannot describe this job
    with pytest.raises(LauncherVariableError, match=r"MASTER_ADDR is not.*HINT: launch with 'ddpkit run' or torchrun"):
        detect({"RANK": "0", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})


TORCHRUN_ERRORS = [
        ({**TORCHRUN, "RANK": "8"}, r"RANK=8 is out of range for WORLD_SIZE=8: RANK must be in \[0, 8\)"),
        ({**TORCHRUN, "RANK": "-1"}, r"RANK=-1 must be >= 0"),
        ({**TORCHRUN, "RANK": "one"}, r"RANK='one' is not an integer"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 must be >= 1"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, r"MASTER_ADDR is not.*HINT"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, r"MASTER_PORT is not"),
        ({"RANK": "1"}, r"RANK='1' is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, r"WORLD_SIZE='2' is set but RANK is not"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, r"LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "16"}, r"LOCAL_WORLD_SIZE=16 is larger than WORLD_SIZE=8"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, r"MASTER_PORT='http' is not an integer"),
        ({**TORCHRUN, "MASTER_PORT": "0"}, r"MASTER_PORT=0 must be >= 1"),
        ({**TORCHRUN, "GROUP_RANK": "4"}, r"GROUP_RANK=4 is out of range for the nodes of WORLD_SIZE=8 "
                                          r"processes, LOCAL_WORLD_SIZE=2 per node: .*\[0, 4\)"),
        ({**TORCHRUN, "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "2"},
         r"GROUP_RANK=2 is out of range for GROUP_WORLD_SIZE=2"),
        # more nodes than processes, with or without GROUP_RANK
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "3", "MASTER_ADDR": "h",
          "MASTER_PORT": "1"}, r"^GROUP_WORLD_SIZE=3 is larger than WORLD_SIZE=2: every node runs at least one "
                               r"process\. HINT: .*--nnodes"),
        ({**TORCHRUN, "GROUP_WORLD_SIZE": "9"}, r"GROUP_WORLD_SIZE=9 is larger than WORLD_SIZE=8"),
        ({**TORCHRUN, "GROUP_WORLD_SIZE": "0"}, r"GROUP_WORLD_SIZE=0 must be >= 1"),
        ({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"},
         r"^GROUP_WORLD_SIZE=1 says the job is on one node, but WORLD_SIZE=8 and LOCAL_WORLD_SIZE=2 differ"),
        # torch takes sizes as C ints: larger ones failed in TCPStore's constructor, naming nothing
        ({**TORCHRUN, "WORLD_SIZE": "2147483648"}, r"^WORLD_SIZE=2147483648 is too large: .* at most 2147483647"),
        ({**TORCHRUN, "RANK": "99999999999999999999999"}, r"^RANK=99999999999999999999999 is too large"),
        ({**TORCHRUN, "MASTER_PORT": "4294967296"}, r"^MASTER_PORT=4294967296 is too large: .*HINT: set MASTER_PORT "
                                                    r"to a free TCP port in \[1, 65535\]"),
        # a node's ranks are consecutive: two processes of one node would share LOCAL_RANK (a GPU)
        ({**TORCHRUN, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "0"},
         r"RANK=0 and LOCAL_RANK=1 disagree: .* would start at rank -1"),
        ({**TORCHRUN, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": "0"},
         r"RANK=1 and LOCAL_RANK=0 disagree: .*\(LOCAL_WORLD_SIZE=2\) do not fit in WORLD_SIZE=2"),
        ({**TORCHRUN, "RANK": "2"}, r"RANK=2 with LOCAL_RANK=1 makes rank 1 this node's first, but "
                                    r"GROUP_RANK=1 with LOCAL_WORLD_SIZE=2 .* starts it at rank 2"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "5", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
         r"^LOCAL_RANK=5 is out of range for WORLD_SIZE=2"),
]


@pytest.mark.parametrize("environ, message", TORCHRUN_ERRORS)
def test_invalid_torchrun_settings_name_the_variable_and_value(environ, message):
    with pytest.raises(LauncherVariableError, match=message):
        detect(environ)


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "123456",
         "SLURM_JOB_NODELIST": "gpu-[01-03,07]"}


def test_slurm_variables():
    env = detect(SLURM)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 2, 2)
    assert (env.master_addr, env.launcher) == ("gpu-01", "slurm")


def test_slurm_port_is_derived_from_the_job_id_unless_master_port_is_set():
    # the port rule of ddpkit.runtime.environments.ports: 20000 + (job * 16 + step % 16) % 12000
    assert detect(SLURM).master_port == 20000 + (123456 * 16) % 12000
    assert detect({**SLURM, "SLURM_STEP_ID": "3"}).master_port == 20000 + (123456 * 16 + 3) % 12000
    assert detect({**SLURM, "SLURM_JOB_ID": "133456"}).master_port != detect(SLURM).master_port
    assert detect({**SLURM, "MASTER_PORT": "29777"}).master_port == 29777


def test_slurm_master_addr_override_and_old_nodelist_name():
    assert detect({**SLURM, "MASTER_ADDR": "login1"}).master_addr == "login1"
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    environ["SLURM_NODELIST"] = "cpu[5-8]"
    assert detect(environ).master_addr == "cpu5"


def test_slurm_tasks_per_node_from_slurm_format():
    environ = {k: v for k, v in SLURM.items() if k not in ("SLURM_NTASKS_PER_NODE", "SLURM_LOCALID")}
    environ.update(SLURM_NTASKS="7", SLURM_PROCID="6", SLURM_NODEID="3", SLURM_TASKS_PER_NODE="2(x3),1")
    env = detect(environ)
    assert (env.local_world_size, env.local_rank) == (1, 0)


def test_slurm_single_task_without_nodelist():
    env = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.world_size, env.launcher, env.master_addr) == (1, "slurm", "127.0.0.1")


SLURM_ERRORS = [
        ({"SLURM_NTASKS": "6"}, r"SLURM_NTASKS=6 disagrees with 4 node\(s\) x SLURM_NTASKS_PER_NODE=2 = 8"),
        ({"SLURM_PROCID": "8"}, r"SLURM_PROCID=8 is out of range for SLURM_NTASKS=8"),
        ({"SLURM_PROCID": "x"}, r"SLURM_PROCID='x' is not an integer"),
        ({"SLURM_LOCALID": "2"}, r"SLURM_LOCALID=2 is out of range"),
        ({"SLURM_JOB_NODELIST": "gpu-[01-03"}, r"'\[' without its '\]'"),
        ({"SLURM_JOB_NODELIST": "gpu-[3-1]"}, r"SLURM_JOB_NODELIST='gpu-\[3-1\]': .* runs backwards"),
        ({"SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": "2(x4)"},
         r"SLURM_NTASKS=7 disagrees with SLURM_TASKS_PER_NODE='2\(x4\)' = 8 tasks"),
        ({"SLURM_NODEID": "4"}, r"SLURM_NODEID=4 is out of range for SLURM_JOB_NUM_NODES=4"),
        ({"SLURM_NTASKS_PER_NODE": "2(3)"}, r"SLURM_NTASKS_PER_NODE='2\(3\)' is not in SLURM's format"),
        # a node count and the node list of its own pair must agree (SLURM sets both)
        ({"SLURM_JOB_NUM_NODES": "5"}, r"^SLURM_JOB_NUM_NODES=5 disagrees with SLURM_JOB_NODELIST, which names 4 "
                                       r"node\(s\): gpu-01, gpu-02, gpu-03, gpu-07\."),
]


def test_a_steps_node_count_may_be_smaller_than_the_jobs_node_list():
    env = detect({**SLURM, "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
                  "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"})
    assert (env.rank, env.world_size, env.local_world_size, env.node_rank) == (1, 2, 2, 0)


@pytest.mark.parametrize("changes, message", SLURM_ERRORS)
def test_invalid_slurm_settings(changes, message):
    with pytest.raises(LauncherVariableError, match=message):
        detect({**SLURM, **changes})


MPI_ERRORS = [{"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, {"PMI_RANK": "1"},
              {"PMIX_RANK": "-1", "PMIX_SIZE": "2"},
              {"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "1_0"}, {"OMPI_COMM_WORLD_SIZE": "2"}]


@pytest.mark.parametrize("size_name, rank_name", [("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                                                  ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK")])
def test_an_mpi_size_without_its_rank_is_refused_not_run_as_a_single_process(size_name, rank_name):
    with pytest.raises(LauncherVariableError, match=rf"^{size_name}='2' is set but {rank_name} is not") as caught:
        detect({size_name: "2"})
    assert caught.value.variable == rank_name


@pytest.mark.parametrize("environ", [e for e, _ in TORCHRUN_ERRORS] + MPI_ERRORS
                         + [{**SLURM, **c} for c, _ in SLURM_ERRORS])
def test_every_invalid_setting_ends_with_a_hint(environ):
    with pytest.raises(LauncherVariableError, match=r"^[A-Z0-9_]+=.*\. HINT: [^\n]+$") as caught:
        detect(environ)
    assert caught.value.variable in str(caught.value)  # the variable to fix is named


@pytest.mark.parametrize("raw", ["1_0", "+1", "1 0", "0x1", "\u0661", "1.0", ""])
def test_integers_must_be_plain_decimal_digits(raw):
    with pytest.raises(ValueError, match=rf"^RANK={re.escape(repr(raw))} is not an integer\. HINT: "):
        detect({**TORCHRUN, "WORLD_SIZE": "20", "RANK": raw})


def test_integers_may_have_surrounding_whitespace():
    assert detect({**TORCHRUN, "RANK": " 3 "}).rank == 3


def test_rank_zero_without_master_addr_says_the_other_ranks_cannot_find_it():
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not, so the other ranks cannot find rank 0\. HINT"):
        detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})


def test_group_rank_of_an_uneven_node_is_accepted():
    # 3 processes: node 0 runs one, node 1 (this one) runs two
    env = detect({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "GROUP_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (env.node_rank, env.local_rank) == (1, 1)


def test_group_rank_without_local_world_size_is_not_checked_against_a_guess():
    # LOCAL_RANK=0 alone says nothing of how many processes the node runs
    env = detect({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "GROUP_RANK": "1",
                  "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (env.rank, env.local_rank, env.node_rank) == (2, 0, 1)


def test_slurm_procid_without_ntasks_says_ntasks_is_unset():
    with pytest.raises(ValueError, match=r"SLURM_PROCID=1 is set but SLURM_NTASKS is unset.*HINT"):
        detect({"SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "n[1-2]"})


def test_slurm_without_any_address_for_several_tasks():
    with pytest.raises(ValueError, match=r"neither SLURM_JOB_NODELIST nor MASTER_ADDR"):
        detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("gpu-[01-03,07],cpu5", ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "cpu5"]),
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("rack[1-2]-gpu[0-1]", ["rack1-gpu0", "rack1-gpu1", "rack2-gpu0", "rack2-gpu1"]),
        ("x[3],y[1,5-6]z", ["x3", "y1z", "y5z", "y6z"]),
        ("host-a.example.org,host-[2-3].example.org",
         ["host-a.example.org", "host-2.example.org", "host-3.example.org"]),
        (" a , b ", ["a", "b"]),
    ],
)
def test_hostlist_expansion(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]", "n[5-3]", "n[1-]"])
def test_malformed_hostlists_are_rejected(bad):
    with pytest.raises(ValueError, match="SLURM hostlist"):
        expand_hostlist(bad)


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "m"}, (3, 4, 1, 2, 1, "m")),
        ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
          "MV2_COMM_WORLD_LOCAL_SIZE": "2"}, (1, 2, 1, 2, 0, "127.0.0.1")),
        ({"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3",
          "MASTER_ADDR": "m"}, (5, 6, 2, 3, 1, "m")),
        ({"PMIX_RANK": "0", "PMIX_SIZE": "1"}, (0, 1, 0, 1, 0, "127.0.0.1")),
    ],
)
def test_mpi_flavours(environ, expected):
    env = detect(environ)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank,
            env.master_addr) == expected
    assert env.launcher == "mpi" and env.master_port == 29500


def test_mpi_over_several_nodes_needs_master_addr():
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        detect(environ)


@pytest.mark.parametrize("environ, message", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n1",
      "SLURM_STEP_ID": "0"},
     r"^SLURM_LOCALID=1 differs from SLURM_PROCID=0, but all 2 processes of the job are on this node"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     r"^OMPI_COMM_WORLD_LOCAL_RANK=1 differs from OMPI_COMM_WORLD_RANK=0, but all 2 processes"),
])
def test_on_one_node_the_local_rank_must_be_the_rank(environ, message):
    with pytest.raises(ValueError, match=message + r".*HINT: .*share a GPU"):
        detect(environ)


def test_mpi_local_size_larger_than_the_job_is_refused():
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with pytest.raises(LauncherVariableError, match=r"^OMPI_COMM_WORLD_LOCAL_SIZE=4 is larger than "
                                                    r"OMPI_COMM_WORLD_SIZE=2") as raised:
        detect(environ)
    assert (raised.value.variable, raised.value.value) == ("OMPI_COMM_WORLD_LOCAL_SIZE", "4")


def test_mpi_rank_out_of_range():
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_RANK=4 is out of range for OMPI_COMM_WORLD_SIZE=4"):
        detect({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"})


def test_detect_never_writes_the_environment():
    environ = dict(SLURM)
    detect(environ)
    assert environ == SLURM


def test_dist_env_is_frozen():
    with pytest.raises(AttributeError):
        detect({}).rank = 3  # type: ignore[misc]
