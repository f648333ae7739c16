"""``ddpkit run``'s pure parts: torchrun's flags, the worker environment, exit descriptions. No processes."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ddpkit.launch.cli import main
from ddpkit.launch.config import parse_args
from ddpkit.launch.logs import OutputPump, _Console
from ddpkit.launch.summary import describe_exit, traceback_tail
from ddpkit.launch.workers import Placement, worker_env

CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("flag, field, value, expected", [
    ("--nproc-per-node", "nproc_per_node", "3", 3), ("--nproc_per_node", "nproc_per_node", "3", 3),
    ("--node-rank", "node_rank", "1", 1), ("--node_rank", "node_rank", "1", 1),
    ("--master-addr", "master_addr", "10.0.0.1", "10.0.0.1"),
    ("--master_addr", "master_addr", "10.0.0.1", "10.0.0.1"),
    ("--master-port", "master_port", "1234", 1234), ("--master_port", "master_port", "1234", 1234),
    ("--max-restarts", "max_restarts", "2", 2), ("--max_restarts", "max_restarts", "2", 2),
    ("--log-dir", "log_dir", "/x", "/x"), ("--log_dir", "log_dir", "/x", "/x"),
    ("--shutdown-timeout", "grace_period", "7", 7.0), ("--grace-period", "grace_period", "7", 7.0),
    ("--rdzv-timeout", "rdzv_timeout", "5", 5.0), ("--rdzv_id", "run_id", "job7", "job7"),
])
def test_flags_take_both_torchrun_spellings(flag, field, value, expected):
    extra = ["--nnodes", "2"] if field == "node_rank" else []
    config = parse_args([*extra, flag, value, "train.py"], environ={})
    assert getattr(config, field) == expected


def test_script_arguments_pass_through_untouched():
    config = parse_args(["--nproc-per-node", "2", "train.py", "--nnodes", "3", "-m", "x y"], environ={})
    assert config.command == (sys.executable, "-u", "train.py", "--nnodes", "3", "-m", "x y")
    assert config.nnodes == 1 and config.nproc_per_node == 2


def test_module_and_no_python_build_the_worker_command():
    assert parse_args(["-m", "pkg.train", "--lr", "1"], environ={}).command == (
        sys.executable, "-u", "-m", "pkg.train", "--lr", "1")
    assert parse_args(["--no-python", "./run.sh", "a"], environ={}).command == ("./run.sh", "a")
    with pytest.raises(ValueError, match="cannot be combined"):
        parse_args(["--no-python", "-m", "pkg"], environ={})


def test_nnodes_accepts_a_number_and_rejects_an_elastic_range():
    assert parse_args(["--nnodes", "2:2", "t.py"], environ={}).nnodes == 2
    with pytest.raises(ValueError, match=r"--nnodes '1:4' asks for an elastic range.*--nnodes 4"):
        parse_args(["--nnodes", "1:4", "t.py"], environ={})
    with pytest.raises(ValueError, match=r"--node-rank 2 must be in \[0, 2\)"):
        parse_args(["--nnodes", "2", "--node-rank", "2", "t.py"], environ={})


def test_several_nodes_default_to_torchruns_port_one_node_to_a_free_one():
    assert parse_args(["--nnodes", "2", "t.py"], environ={}).master_port == 29500
    assert parse_args(["t.py"], environ={}).master_port is None
    # torchrun's --master-port 0: any free port, on one node (the others could not learn it)
    assert parse_args(["--master-port", "0", "t.py"], environ={}).master_port is None
    with pytest.raises(ValueError, match=r"--master-port 0 is not a TCP port .*0, any free port, serves one node"):
        parse_args(["--nnodes", "2", "--master-port", "0", "t.py"], environ={})


def test_standalone_ignores_the_master_address_and_port():
    config = parse_args(["--standalone", "--master-addr", "h", "--master-port", "5", "t.py"], environ={})
    assert (config.master_addr, config.master_port, config.nnodes) == ("127.0.0.1", None, 1)
    assert config.run_id != "none"
    with pytest.raises(ValueError, match="--standalone runs a single node"):
        parse_args(["--standalone", "--nnodes", "2", "t.py"], environ={})


def test_nproc_per_node_words_mean_what_they_mean_in_torchrun():
    assert parse_args(["--nproc-per-node", "cpu", "t.py"], environ={}).nproc_per_node == CORES
    expected_auto = torch.cuda.device_count() if torch.cuda.is_available() else CORES
    assert parse_args(["--nproc-per-node", "auto", "t.py"], environ={}).nproc_per_node == expected_auto
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--nproc-per-node gpu"):
            parse_args(["--nproc-per-node", "gpu", "t.py"], environ={})
    with pytest.raises(ValueError, match="'many' is not a positive integer"):
        parse_args(["--nproc-per-node", "many", "t.py"], environ={})


def test_pet_variables_set_defaults_as_in_torchrun():
    config = parse_args(["t.py"], environ={"PET_NNODES": "3", "PET_NODE_RANK": "2",
                                           "PET_MASTER_ADDR": "head", "PET_NPROC_PER_NODE": "4"})
    assert (config.nnodes, config.node_rank, config.master_addr, config.nproc_per_node) == (3, 2, "head", 4)
    assert parse_args(["--nnodes", "1", "t.py"], environ={"PET_NNODES": "3"}).nnodes == 1


def test_pet_on_off_variables_are_read_as_torchrun_reads_them():
    assert parse_args(["t.py"], environ={"PET_MODULE": "1"}).command[1:3] == ("-u", "-m")
    assert parse_args(["t.py"], environ={"PET_MODULE": "0"}).command[1:3] == ("-u", "t.py")
    assert parse_args(["t.py"], environ={"PET_STANDALONE": ""}).run_id != "none"  # unset, as in torchrun
    with pytest.raises(ValueError, match=r"PET_NO_PYTHON='false' is not an integer.*PET_NO_PYTHON=0"):
        parse_args(["t.py"], environ={"PET_NO_PYTHON": "false"})


def test_the_run_id_is_fresh_on_one_node_without_a_port_as_in_torchrun():
    first, second = (parse_args(["t.py"], environ={}).run_id for _ in range(2))
    assert first != second and uuid.UUID(first)
    assert parse_args(["--rdzv-id", "job7", "t.py"], environ={}).run_id == "job7"  # named: kept
    assert parse_args(["--master-port", "5", "t.py"], environ={}).run_id == "none"  # torchrun's static default
    assert parse_args(["--nnodes", "2", "t.py"], environ={}).run_id == "none"


def test_a_bad_shutdown_timeout_is_named_by_torchruns_flag():
    with pytest.raises(ValueError, match=r"--shutdown-timeout \(--grace-period\) must be > 0, got 0.0"):
        parse_args(["--shutdown-timeout", "0", "t.py"], environ={})


def test_other_rendezvous_backends_are_refused_with_a_hint():
    with pytest.raises(ValueError, match="--rdzv-backend 'etcd' is not supported.*--rdzv-backend c10d"):
        parse_args(["--rdzv-backend", "etcd", "t.py"], environ={})


def test_c10d_on_several_nodes_numbers_them_at_the_rendezvous_as_torchrun_does():
    config = parse_args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1", "--rdzv-id", "j",
                         "--node-rank", "1", "t.py"], environ={})
    assert config.assign_node_rank and config.node_rank == 0  # --node-rank is torchrun's static flag
    assert (config.master_addr, config.master_port) == ("n1", 29400)  # torchrun's c10d port
    single = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "t.py"], environ={})
    assert not single.assign_node_rank


def test_torchruns_single_node_c10d_command_line_and_no_op_flags_parse():
    config = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-conf",
                         "join_timeout=5", "--local-ranks-filter", "0", "--local_addr", "n1",
                         "--nproc-per-node", "2", "t.py"], environ={})
    assert (config.master_addr, config.master_port, config.nnodes, config.nproc_per_node) == (
        "localhost", None, 1, 2)


def test_torchrun_command_lines_with_endpoint_and_output_flags_parse():
    config = parse_args(["--rdzv_endpoint=node0:29400", "--nnodes", "2", "--node-rank", "1", "--tee", "3",
                         "-r", "3", "--start-method", "fork", "--run-path", "t.py", "-r", "x"], environ={})
    assert (config.master_addr, config.master_port, config.nnodes) == ("node0", 29400, 2)
    assert config.command[-3:] == ("t.py", "-r", "x")
    assert parse_args(["--rdzv-endpoint", "localhost:0", "t.py"], environ={}).master_port is None
    assert parse_args(["--rdzv-endpoint", "[::1]:7", "t.py"], environ={}).master_addr == "::1"


def test_cli_reports_a_bad_flag_in_one_line(capsys):
    assert main(["--nnodes", "1:8", "t.py"]) == 2
    assert capsys.readouterr().err.startswith("ddpkit run: error: --nnodes '1:8' asks for an elastic")


def test_worker_env_shares_the_cores_unless_omp_num_threads_is_set():
    place = Placement(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, nnodes=2)
    kw = dict(master_addr="h", master_port=5, attempt=1, max_restarts=2, run_id="r")
    env = worker_env({"PATH": "/bin"}, place, **kw)
    assert env["OMP_NUM_THREADS"] == str(max(1, CORES // 2))
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["TORCHELASTIC_RESTART_COUNT"]) == (
        "3", "1", "1", "1")
    assert env["PATH"] == "/bin"
    assert worker_env({"OMP_NUM_THREADS": "8"}, place, **kw)["OMP_NUM_THREADS"] == "8"


def test_workers_hear_whether_the_launchers_stderr_is_a_terminal():
    place = Placement(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1)
    kw = dict(master_addr="h", master_port=5, attempt=0, max_restarts=0, run_id="r")
    assert worker_env({}, place, terminal=True, **kw)["DDPKIT_TERMINAL"] == "1"
    assert "DDPKIT_TERMINAL" not in worker_env({"DDPKIT_TERMINAL": "1"}, place, **kw)  # an outer launcher's


def test_exit_descriptions_name_the_signal_and_hint_at_oom():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-9).startswith(
        "killed by SIGKILL (signal 9, exit code 137): possibly out of memory")
    assert describe_exit(-11).startswith("killed by SIGSEGV")
    assert describe_exit(137) == "exit code 137"  # exited by itself, e.g. a shell: not a signal
    # the summary shows one rank's last lines: another rank's hang report is not below it
    assert describe_exit(86, report_below=True).endswith("(its hang report is below)")
    assert describe_exit(86).endswith("(its output holds its hang report)")


def test_the_summary_shows_the_last_traceback():
    lines = ["noise", "Traceback (most recent call last):", "  old", "E: first",
             "warning", "Traceback (most recent call last):", '  File "t.py"', "ValueError: x"]
    assert traceback_tail(lines) == lines[5:]
    assert traceback_tail(["a", "b"]) == ["a", "b"]


def test_the_summary_keeps_the_hang_report_printed_just_before_the_traceback():
    # a collective that failed because a peer left: the report says which rank left, then it raises
    rule = "=" * 78
    report = [rule, "ddpkit hang report (stall_timeout=5 s, collected by rank 0). Where each rank is:",
              "  rank 1 has exited without ddpkit.shutdown()", "Verdict:", "  ...", rule]
    error = ["Traceback (most recent call last):", '  File "t.py"', "RuntimeError: Connection closed by peer"]
    assert traceback_tail(["noise", *report, *error]) == [*report, *error]
    assert traceback_tail(["noise", *report, "", *error]) == [*report, "", *error]
    # a deadlock in a finally: block: the exception the rank was handling, printed after the report
    handled = "ddpkit: this rank was handling the exception below when the deadlock ended it (exit code 1)"
    assert traceback_tail(["noise", *report, handled, *error]) == [*report, handled, *error]
    # a report followed by other output is an earlier one: not the cause
    assert traceback_tail([*report, "step 5", *error]) == error
    assert traceback_tail(["noise", rule, "other block", rule, *error]) == error


def test_a_long_report_and_traceback_keep_their_start_and_their_end():
    rule = "=" * 78
    report = [rule, "ddpkit hang report (stall_timeout=5 s, collected by rank 0). Where each rank is:",
              *[f"  rank {r} waits in all_reduce #7 at t.py:9 in step()" for r in range(100)], rule]
    error = ["Traceback (most recent call last):", *[f'  File "t.py", line {n}' for n in range(60)],
             "RuntimeError: Connection closed by peer"]
    tail = traceback_tail(["noise", *report, *error])
    assert len(tail) == 120 and tail[:2] == report[:2] and tail[-1] == error[-1]
    assert f"... ({len(report) + len(error) - 119} lines left out) ..." in tail
    assert traceback_tail(["x"] * 130) == ["x"] * 120  # no traceback: the last lines


def test_the_summary_shows_a_chained_exception_from_its_root_cause():
    lines = ["noise", "Traceback (most recent call last):", "  old", "E: unrelated", "",
             "Traceback (most recent call last):", '  File "t.py"', "KeyError: 'k'", "",
             "The above exception was the direct cause of the following exception:", "",
             "Traceback (most recent call last):", '  File "t.py"', "ValueError: x"]
    assert traceback_tail(lines) == lines[5:]


def test_a_bad_log_dir_is_one_line_before_anything_starts(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["--log-dir", str(tmp_path / "file"), "t.py"]) == 2
    assert capsys.readouterr().err == (f"ddpkit run: error: --log-dir '{tmp_path / 'file'}' is an "
                                       "existing file, not a directory.\n")
    assert main(["--log-dir", str(tmp_path / "file" / "logs"), "t.py"]) == 2
    assert capsys.readouterr().err.startswith(f"ddpkit run: error: --log-dir '{tmp_path / 'file' / 'logs'}'"
                                              " cannot be written to: Not a directory")



def test_a_script_that_does_not_exist_is_one_line_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    # it started every worker, each of which failed with python's "can't open file" 3 s later
    monkeypatch.chdir(tmp_path)
    assert main(["--nproc-per-node", "2", "nope.py", "--lr", "1"]) == 2
    assert capsys.readouterr().err == (f"ddpkit run: error: the training script 'nope.py' does not exist (looked "
                                       f"for it from {tmp_path}). HINT: give the script's path as the workers will "
                                       "open it, or -m for a module.\n")


def test_lines_torch_already_tagged_with_the_rank_are_not_tagged_twice(monkeypatch):
    # torch's excepthook writes "[rank1]: ...", its C++ logs "[rank1]:W1129 ..." once a group exists
    stream = io.BytesIO()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(stream, write_through=True))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pump = OutputPump(1, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
    os.write(err_w, b"[rank1]: Traceback (most recent call last):\n[rank1]:   File \"t.py\", line 3\n"
                    b"[rank1]:W1129 04:50:01.123 torch/log.cpp:1] a warning\nplain\n[rank0]: not mine\n")
    os.close(err_w)
    os.close(out_w)
    assert pump.join(timeout=10)
    assert stream.getvalue().decode().splitlines() == [
        "[rank1]: Traceback (most recent call last):", '[rank1]:   File "t.py", line 3',
        "[rank1]: W1129 04:50:01.123 torch/log.cpp:1] a warning", "[rank1]: plain", "[rank1]: [rank0]: not mine"]

def test_an_open_progress_line_is_ended_before_another_rank_writes():
    console, stream, rank0, rank1 = _Console(), io.BytesIO(), object(), object()
    out = io.TextIOWrapper(stream)
    console.write(rank0, out, b"[rank0]: ", [(b"", b"\r"), (b"step 1", b"")])
    console.write(rank0, out, b"[rank0]: ", [(b"", b"\r"), (b"step 2", b"")])
    console.write(rank1, out, b"[rank1]: ", [(b"hello", b"\n")])
    console.write(rank0, out, b"[rank0]: ", [(b"", b"\r"), (b"step 3", b""), (b"", b"\n")])
    console.write(rank0, out, b"[rank0]: ", [(b"half a ", b"")])
    console.write(rank0, out, b"[rank0]: ", [(b"line", b"\n")])
    assert stream.getvalue() == (b"[rank0]: step 1\r[rank0]: step 2\n[rank1]: hello\n"
                                 b"[rank0]: step 3\n[rank0]: half a line\n")


@pytest.mark.parametrize("name", ["single_node.sh", "multi_node.sh", "slurm.sbatch", "torchrun.sh"])
def test_launch_scripts_parse_and_show_their_usage(name):
    path = Path(__file__).resolve().parents[2] / "launch" / name
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    header = path.read_text().split("set -euo pipefail")[0]
    assert f"launch/{name}" in header and os.access(path, os.X_OK)


def test_multi_node_script_on_a_node_without_gpu_asks_for_nproc(tmp_path):
    path = Path(__file__).resolve().parents[2] / "launch" / "multi_node.sh"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h", "JOB_ID": "j"}
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # present, but sees no GPU
    (tmp_path / "nvidia-smi").chmod(0o755)
    result = subprocess.run(["bash", str(path), "train.py"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "set NPROC, the workers per node" in result.stderr, result.stderr


@pytest.mark.parametrize("name, variables, message", [
    ("single_node.sh", {"NPROC": "abc"}, "NPROC=abc must be a number of workers"),
    ("single_node.sh", {"NPROC": "2", "RESTARTS": "x"}, "RESTARTS=x must be a whole number"),
    ("multi_node.sh", {"NPROC": "1", "NNODES": "two"}, "NNODES=two must be a whole number"),
    ("multi_node.sh", {"NPROC": "many"}, "NPROC=many must be a whole number (or one of: gpu cpu auto)"),
])
def test_launch_scripts_name_the_variable_that_is_wrong(name, variables, message):
    path = Path(__file__).resolve().parents[2] / "launch" / name
    env = {"PATH": "/usr/bin:/bin", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h", "JOB_ID": "j", **variables}
    result = subprocess.run(["bash", str(path), "train.py"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and f"launch/{name}: {message}" in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["multi_node.sh", "torchrun.sh"])
def test_multi_node_scripts_refuse_an_unnamed_run(name):
    # two unnamed runs on one node 0 and port cannot be told apart: one would take the other's nodes
    path = Path(__file__).resolve().parents[2] / "launch" / name
    env = {"PATH": "/usr/bin:/bin", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h", "NPROC": "1"}
    result = subprocess.run(["bash", str(path), "train.py"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "set JOB_ID to the name of this run" in result.stderr, result.stderr


def test_local_ranks_filter_and_redirects_choose_the_console_streams_as_in_torchrun():
    shows = parse_args(["--local-ranks-filter", "0,2", "--nproc-per-node", "3", "t.py"], environ={}).console.shows
    assert [shows(r) for r in range(3)] == [(True, True), (False, False), (True, True)]
    assert parse_args(["--redirects", "3", "t.py"], environ={}).console.shows(0) == (True, True)  # no log dir
    shows = parse_args(["-r", "0:1,1:3", "--log-dir", "d", "t.py"], environ={}).console.shows
    assert [shows(r) for r in range(3)] == [(False, True), (False, False), (True, True)]
    assert parse_args(["--redirects", "2", "--log-dir", "d", "t.py"], environ={}).console.shows(5) == (True, False)
    # torchrun's tee: a redirected stream it tees is shown as well
    shows = parse_args(["-r", "3", "-t", "1", "--log-dir", "d", "t.py"], environ={}).console.shows
    assert shows(0) == (True, False)
    assert parse_args(["-r", "3", "-t", "0:3", "--log-dir", "d", "t.py"], environ={}).console.shows(1) == (False, False)
    for flags in (["--local-ranks-filter", "zero"], ["-r", "7", "--log-dir", "d"], ["-r", "0:x", "--log-dir", "d"],
                  ["--tee", "4"]):
        with pytest.raises(ValueError, match=flags[1]):
            parse_args([*flags, "t.py"], environ={})


def test_torchrun_flags_ddpkit_does_not_act_on_are_accepted_and_each_says_so():
    assert parse_args(["--signals-to-handle", "SIGINT,SIGTERM,SIGQUIT,SIGHUP", "t.py"], environ={}).notes == ()
    config = parse_args(["--numa-binding", "node", "--logs-specs", "mine", "--event-log-handler", "console",
                         "--signals_to_handle", "SIGTERM", "--duplicate-stdout-filters", "loss",
                         "--redirects", "3", "t.py"], environ={})
    joined = "\n".join(config.notes)
    for flag in ("--numa-binding node has no effect", "--logs-specs mine", "--event-log-handler console",
                 "--signals-to-handle SIGTERM has no effect", "--duplicate-stdout-filters",
                 "--redirects needs --log-dir"):
        assert flag in joined
    assert len(config.notes) == 6
    with pytest.raises(ValueError, match="--virtual-local-rank is not supported"):
        parse_args(["--virtual-local-rank", "t.py"], environ={})


def test_rdzv_conf_timeout_bounds_the_wait_for_the_nodes_as_in_torchrun():
    """torchrun's static rendezvous reads --rdzv-conf timeout (600 s without it), c10d join_timeout;
    ddpkit's own --rdzv-timeout wins over both."""
    two = ["--nnodes", "2", "--node-rank", "1", "--master-port", "29400"]
    assert parse_args([*two, "t.py"], environ={}).rdzv_timeout == 600
    assert parse_args([*two, "--rdzv-conf", "timeout=5", "t.py"], environ={}).rdzv_timeout == 5
    assert parse_args([*two, "--rdzv-conf", "join_timeout=7,x=1", "t.py"], environ={}).rdzv_timeout == 7
    assert parse_args([*two, "--rdzv-conf", "timeout=5", "--rdzv-timeout", "9", "t.py"],
                      environ={}).rdzv_timeout == 9
    assert parse_args([*two, "t.py"], environ={"PET_RDZV_CONF": "timeout=3"}).rdzv_timeout == 3
    noted = parse_args([*two, "--rdzv-conf", "timeout=5,read_timeout=60", "t.py"], environ={}).notes
    assert noted == ("--rdzv-conf read_timeout has no effect: the static rendezvous reads only timeout or "
                     "join_timeout (the seconds the nodes wait for each other)",)
    with pytest.raises(ValueError, match="'timeout5' is not KEY=VALUE"):
        parse_args([*two, "--rdzv-conf", "timeout5", "t.py"], environ={})
    with pytest.raises(ValueError, match="--rdzv-conf timeout='soon' is not a number of seconds"):
        parse_args([*two, "--rdzv-conf", "timeout=soon", "t.py"], environ={})
