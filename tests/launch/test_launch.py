"""``ddpkit run`` end to end: real launchers, real workers, and no process of a job left behind.

Every worker writes its pid (and its child's) to a file in tmp_path before doing anything else, so each
test knows every process its job created and checks with psutil that all of them are gone.
"""
from __future__ import annotations

import glob
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from ranks import kill_tree

from ddpkit.launch.config import parse_args
from ddpkit.launch.signals import SignalInbox
from ddpkit.launch.summary import failure_summary
from ddpkit.launch.supervisor import Supervisor
from ddpkit.launch.watchdog import _SCAN_EVERY as _WATCHDOG_SCAN
from ddpkit.launch.watchdog import TOKEN_VARIABLE, _processes, marked
from ddpkit.launch.workers import Placement, spawn_worker

REPO = Path(__file__).resolve().parents[2]
WORKER = str(REPO / "tests" / "scripts" / "launch_worker.py")
TORCHRUN_STYLE = str(REPO / "tests" / "scripts" / "launch_torchrun_style.py")
_LAUNCH_PREFIXES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_",
                    "TORCHELASTIC_", "PET_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "DDPKIT_", "OMP_NUM")


def _clean_env() -> dict[str, str]:
    """This environment without any launcher's variables, importing this checkout's ddpkit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Job:
    """Launchers started by one test; ``cleanup`` kills whatever a failed test left running."""

    def __init__(self, out: Path):
        self.out = out
        self.launchers: list[subprocess.Popen] = []
        self.port: int | None = None  # node 0's --master-port, set by start_nodes

    def start(self, *args: str, command: tuple[str, ...] = ("-m", "ddpkit", "run"),
              stdin: int | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, *command, *args], stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_clean_env(), cwd=REPO)
        self.launchers.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 45, **kw) -> tuple[int, str, str]:
        proc = self.start(*args, **kw)
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err

    def start_nodes(self, *args: str, nnodes: int = 2, nproc: int = 2) -> list[subprocess.Popen]:
        """``nnodes`` launchers on this host, of ``nproc`` workers each, meeting on ``self.port``."""
        self.port = _free_port()
        return [self.start("--nnodes", str(nnodes), "--node-rank", str(rank), "--nproc-per-node",
                           str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(self.port),
                           "--rdzv-timeout", "30", "--grace-period", "5", *args)
                for rank in range(nnodes)]

    def run_two_nodes(self, *args: str, timeout: float = 50) -> list[tuple[int, str]]:
        """Two nodes of two workers each; waits for both: (exit code, stderr) of each."""
        nodes = self.start_nodes(*args)
        errors = [node.communicate(timeout=timeout)[1] for node in nodes]
        return [(node.returncode, err) for node, err in zip(nodes, errors)]

    def pids(self) -> set[int]:
        """Every process the workers reported: themselves and their children."""
        pids = set()
        for path in glob.glob(str(self.out / "pids_*.json")):
            record = json.loads(Path(path).read_text())
            pids.update(p for p in (record["pid"], record["child"], record.get("daemon")) if p)
        return pids

    def wait_for_files(self, pattern: str, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(glob.glob(str(self.out / pattern))) < count:
            if any(p.poll() is not None for p in self.launchers):
                raise AssertionError(f"a launcher exited early: {[p.communicate() for p in self.launchers]}")
            assert time.monotonic() < deadline, f"{count} workers did not start within {timeout} s"
            time.sleep(0.05)

    def worker_pid(self, rank: int, attempt: int = 0) -> int:
        return json.loads((self.out / f"pids_{rank}_{attempt}.json").read_text())["pid"]

    def results(self) -> dict[int, dict]:
        return {int(Path(p).stem.split("_")[1]): json.loads(Path(p).read_text())
                for p in glob.glob(str(self.out / "result_*.json"))}

    def cleanup(self) -> None:
        for proc in self.launchers:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.communicate()
        for pid in self.pids():
            kill_tree(pid, grace=0.5)


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.cleanup()


def assert_all_gone(pids: set[int], timeout: float = 10) -> None:
    """Every pid has exited (a zombie counts as gone: it runs nothing)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    running = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                running.append((p.pid, p.cmdline()))
        except psutil.NoSuchProcess:
            pass
    assert not running, f"processes of the job still running: {running}"


def run_dir(logs: Path) -> Path:
    """The one run's directory in ``--log-dir`` ``logs`` (each run makes its own, as torchrun's)."""
    [path] = logs.iterdir()
    return path


def read_until(proc: subprocess.Popen, needle: bytes, timeout: float = 20) -> bytes:
    """Read ``proc``'s stdout, unbuffered, until ``needle`` came; everything read so far."""
    seen, fd, deadline = b"", proc.stdout.fileno(), time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle[:40]!r} did not come within {timeout} s: {seen[-200:]!r}"
        if select.select([fd], [], [], left)[0]:
            data = os.read(fd, 65536)
            assert data, f"stdout closed before {needle[:40]!r}: {seen[-200:]!r}"
            seen += data
    return seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ success


@pytest.mark.timeout(60)
def test_two_workers_all_reduce_with_torchrun_variables(job, tmp_path):
    logs = tmp_path / "logs"
    code, out, err = job.run("--nproc_per_node", "2", "--log-dir", str(logs), WORKER, str(tmp_path),
                             "allreduce", "--nproc-per-node", "7", "x y")
    assert code == 0, err
    results = job.results()
    assert sorted(results) == [0, 1]
    cores = len(os.sched_getaffinity(0))
    for rank, result in results.items():
        assert result["sum"] == 3.0 and result["launcher"] == "ddpkit"
        assert result["args"] == ["--nproc-per-node", "7", "x y"]  # the script's own, untouched
        env = result["env"]
        assert env["MASTER_PORT"].isdigit()
        assert {k: v for k, v in env.items() if k not in ("MASTER_PORT", "TORCHELASTIC_RUN_ID")} == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "DDPKIT_LAUNCHER": "ddpkit",
            "TORCHELASTIC_ERROR_FILE": str(run_dir(logs) / "attempt_0" / f"rank_{rank}.error.json"),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "OMP_NUM_THREADS": str(max(1, cores // 2)), "PYTHONUNBUFFERED": "1"}
        uuid.UUID(env["TORCHELASTIC_RUN_ID"])  # one node, no port given: a fresh id, as torchrun's
    assert "[rank0]: sum 3.0" in out.splitlines() and "[rank1]: sum 3.0" in out.splitlines()
    assert (run_dir(logs) / "attempt_0" / "rank_1.log").read_text().splitlines()[0] == "rank 1 started"
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_local_ranks_filter_quiets_the_console_not_the_logs_nor_a_failures_summary(job, tmp_path):
    logs = tmp_path / "logs"
    code, out, err = job.run("--nproc-per-node", "2", "--local-ranks-filter", "1", "--log-dir", str(logs),
                             "--numa-binding", "node", WORKER, str(tmp_path), "succeed")
    assert code == 0, err
    assert "ddpkit run: note: --numa-binding node has no effect" in err.splitlines()[0]
    assert "[rank1]: rank 1 started" in out.splitlines() and "[rank0]" not in out + err
    assert (run_dir(logs) / "attempt_0" / "rank_0.log").read_text().splitlines()[0] == "rank 0 started"
    code, _, err = job.run("--nproc-per-node", "2", "--local-ranks-filter", "1", "--grace-period", "5",
                           WORKER, str(tmp_path), "fail", "0")
    assert code == 1, err
    assert "[rank0]" not in err[:err.index("the job failed")]
    assert "ValueError: boom on rank 0" in err[err.index("the job failed"):]  # the summary names it all the same
    assert_all_gone(job.pids())


@pytest.mark.timeout(90)
def test_two_launchers_on_one_host_form_a_world_of_four(job, tmp_path):
    nodes = job.run_two_nodes(WORKER, str(tmp_path), "allreduce", timeout=80)
    assert [code for code, _ in nodes] == [0, 0], nodes
    results = job.results()
    assert sorted(results) == [0, 1, 2, 3]
    assert {r["sum"] for r in results.values()} == {10.0}
    assert [results[r]["env"]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert {results[r]["env"]["WORLD_SIZE"] for r in range(4)} == {"4"}
    # as in torchrun: the workers use node 0's store on --master-port, no other port is opened
    assert {results[r]["env"]["MASTER_PORT"] for r in range(4)} == {str(job.port)}
    assert_all_gone(job.pids())


@pytest.mark.timeout(120)
def test_torchruns_c10d_command_line_numbers_the_nodes_as_they_come(job, tmp_path):
    """torchrun's multi-node form: no --node-rank; the launcher that binds the endpoint is node 0. A
    third launcher for --nnodes 2 is refused, naming the count, and the job of two goes on."""
    port = _free_port()
    args = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "c10d-test", "--rdzv-timeout", "30", "--grace-period", "5",
            WORKER, str(tmp_path), "allreduce")
    nodes = [job.start(*args) for _ in range(3)]
    outcomes = [(node.communicate(timeout=90)[1], node.returncode) for node in nodes]
    refused = [err for err, code in outcomes if code != 0]
    assert len(refused) == 1, outcomes
    assert "more nodes came to the rendezvous at 127.0.0.1:" in refused[0] and "--nnodes 2" in refused[0]
    results = job.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["sum"] for r in results.values()} == {10.0}
    assert [results[r]["env"]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert {results[r]["env"]["MASTER_PORT"] for r in range(4)} == {str(port)}
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_workers_read_the_launchers_stdin_as_under_torchrun(job, tmp_path):
    launcher = job.start("--nproc-per-node", "1", WORKER, str(tmp_path), "stdin", stdin=subprocess.PIPE)
    _, err = launcher.communicate("typed at the terminal\n", timeout=30)
    assert launcher.returncode == 0, err
    assert job.results() == {0: {"stdin": "typed at the terminal"}}


@pytest.mark.timeout(60)
def test_a_progress_line_shows_before_its_newline_and_a_long_line_in_pieces(job, tmp_path):
    launcher = job.start("--nproc-per-node", "1", WORKER, str(tmp_path), "progress", stdin=subprocess.PIPE)
    seen = read_until(launcher, b"[rank0]: progress 1/2")  # the worker waits: no newline came yet
    launcher.stdin.write("\n")
    launcher.stdin.flush()
    seen += read_until(launcher, b"x" * 65536)  # a line without end is not held back whole
    launcher.stdin.write("\n")
    launcher.stdin.flush()
    seen += read_until(launcher, b"progress 2/2\n")  # raw: text mode would turn \r into \n
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, err
    expected = b"[rank0]: progress 1/2\r[rank0]: " + b"x" * 100_000 + b"\r[rank0]: progress 2/2"
    assert seen.split(b"\n") == [b"[rank0]: rank 0 started", expected, b""]


@pytest.mark.timeout(60)
def test_torchrun_script_runs_under_ddpkit_run(job, tmp_path):
    code, _, err = job.run("--nproc-per-node", "2", TORCHRUN_STYLE, str(tmp_path))
    assert code == 0, err
    assert {r: (v["sum"], v["world_size"], v["local_rank"]) for r, v in job.results().items()} == {
        0: (3.0, 2, 0), 1: (3.0, 2, 1)}


@pytest.mark.timeout(90)
def test_a_ddpkit_script_under_torchrun_sees_the_variables_ddpkit_run_sets(job, tmp_path):
    seen = {}
    # torchrun keeps its logs in a torchelastic_* directory of /tmp unless given one
    torchrun = ("-m", "torch.distributed.run", "--log-dir", str(tmp_path / "torchrun-logs"))
    for name, command in (("torchrun", torchrun), ("ddpkit", ("-m", "ddpkit", "run"))):
        out = tmp_path / name
        out.mkdir()
        code, _, err = job.run("--nproc-per-node", "2", "--max-restarts", "1", WORKER, str(out), "allreduce",
                               command=command)
        assert code == 0, err
        seen[name] = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("result_*.json")}
    # the values a launcher picks for itself: a free port, a fresh id, its own files, its address spelling
    own = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")
    for rank in (0, 1):
        torchrun, ddpkit_run = seen["torchrun"][rank], seen["ddpkit"][rank]
        assert (torchrun["sum"], torchrun["launcher"], ddpkit_run["launcher"]) == (3.0, "torchrun", "ddpkit")
        assert torchrun["names"] == ddpkit_run["names"]
        assert {k: v for k, v in torchrun["env"].items() if k not in own and k != "DDPKIT_LAUNCHER"} == {
            k: v for k, v in ddpkit_run["env"].items() if k not in own and k != "DDPKIT_LAUNCHER"}
        for result in (torchrun, ddpkit_run):
            uuid.UUID(result["env"]["TORCHELASTIC_RUN_ID"])
            assert result["env"]["TORCHELASTIC_ERROR_FILE"].endswith(".json")


# ------------------------------------------------------------------------------------------ failure


@pytest.mark.timeout(60)
def test_record_writes_the_error_file_kept_in_the_log_dir_else_removed(job, tmp_path):
    logs = tmp_path / "logs"
    for log_args in (("--log-dir", str(logs)), ()):
        code, _, err = job.run("--nproc-per-node", "1", *log_args, WORKER, str(tmp_path), "record-fail", "0")
        assert code == 1, err
        assert "ValueError: recorded on rank 0" in err[err.index("the job failed"):]
        path = Path((tmp_path / "error_file_0").read_text())
        if log_args:
            assert path == run_dir(logs) / "attempt_0" / "rank_0.error.json"
            assert "recorded on rank 0" in json.loads(path.read_text())["message"]["message"]
        else:
            assert not path.parent.parent.exists()  # the launcher's own directory, gone with it


@pytest.mark.timeout(60)
def test_worker_exception_stops_the_job_with_its_traceback(job, tmp_path):
    start = time.monotonic()
    code, _, err = job.run("--nproc-per-node", "2", "--grace-period", "5", WORKER, str(tmp_path),
                           "fail", "1")
    assert time.monotonic() - start < 30
    assert code == 1, err
    summary = err[err.index("the job failed"):]
    assert "rank 1 (node 0, local rank 1" in summary and "exit code 1" in summary
    assert "Traceback (most recent call last)" in summary and "ValueError: boom on rank 1" in summary
    assert "KeyError: 'root cause'" in summary  # the cause of a chained exception too
    assert "stopped because of it: rank 0" in summary
    assert "ddpkit run: stopping workers: SIGTERM, SIGKILL in 5 s" in err  # not 5 s of silence
    pids = job.pids()
    assert len(pids) == 3  # two workers and rank 1's child
    assert_all_gone(pids)


@pytest.mark.timeout(60)
def test_worker_killed_by_sigkill_is_named_with_an_oom_hint(job, tmp_path):
    code, _, err = job.run("--nproc-per-node", "2", "--grace-period", "5", WORKER, str(tmp_path),
                           "sigkill", "0")
    assert code == 128 + signal.SIGKILL, err
    assert "rank 0 (node 0" in err and "killed by SIGKILL" in err and "out of memory" in err
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_a_gloo_abort_shows_the_users_line_that_called_the_collective(job, tmp_path):
    # Gloo calls abort() on a size mismatch; ddpkit.init() turned on Python's stack dump for it
    code, _, err = job.run("--nproc-per-node", "2", "--grace-period", "5", WORKER, str(tmp_path), "mismatch")
    assert code == 128 + signal.SIGABRT, err
    summary = err[err.index("the job failed"):]
    assert "killed by SIGABRT" in summary and "Received data size doesn't match" in summary, summary
    assert "likely cause: the ranks passed tensors of different sizes (or dtypes) to one collective" in summary
    # join() entered on some ranks only ends here too: its count meets the others' gradient buckets
    assert "or called different ones there (a collective, or 'with model.join():', on some ranks only)" in summary
    line = next(i for i, text in enumerate(Path(WORKER).read_text().splitlines(), 1)
                if "MISMATCHED ALL_REDUCE" in text)
    assert f'launch_worker.py", line {line} in main' in summary, summary
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_an_exit_code_of_137_is_not_taken_for_sigkill(job, tmp_path):
    code, _, err = job.run("--no-python", "bash", "-c", "exit 137")
    assert code == 137, err
    assert "rank 0 (node 0, local rank 0" in err and "exit code 137" in err
    assert "SIGKILL" not in err and "out of memory" not in err


@pytest.mark.timeout(60)
def test_workers_that_failed_by_themselves_are_not_called_stopped(tmp_path):
    supervisor = Supervisor(parse_args(["--nproc-per-node", "3", "--no-python", "sh"], environ={}))
    supervisor._inbox = SignalInbox()  # not installed: the test sends no signal
    places = [Placement(rank, rank, 3, 3, 0, 1) for rank in range(3)]
    workers = [spawn_worker(("sh", "-c", "exit 2"), dict(os.environ), places[0], None),
               spawn_worker(("sh", "-c", "exit 3"), dict(os.environ), places[1], None),
               spawn_worker(("sleep", "60"), dict(os.environ), places[2], None)]
    supervisor._workers = workers
    for worker in workers[:2]:
        worker.process.wait(timeout=20)  # both end before the supervisor looks
    outcome = supervisor.watch()
    supervisor.stop_workers(workers, signal.SIGTERM)
    assert outcome.failed is workers[0] and outcome.code == 2
    summary = failure_summary(outcome.failed, workers, 0, None)
    assert f"also failed, before they were stopped: rank 1 (pid {workers[1].pid}, exit code 3)" in summary
    assert f"stopped because of it: rank 2 (pid {workers[2].pid})" in summary


@pytest.mark.timeout(60)
def test_a_rank_that_left_with_code_0_before_the_failure_is_named(tmp_path):
    """sys.exit(0) on one rank (an early stop) makes the others' next collective fail: the summary
    leads with the failure, and says who had left before it."""
    supervisor = Supervisor(parse_args(["--nproc-per-node", "2", "--no-python", "sh"], environ={}))
    supervisor._inbox = SignalInbox()  # not installed: the test sends no signal
    places = [Placement(rank, rank, 2, 2, 0, 1) for rank in range(2)]
    workers = [spawn_worker(("sh", "-c", "exit 0"), dict(os.environ), places[0], None)]
    workers[0].process.wait(timeout=20)
    supervisor._workers = workers
    workers.append(spawn_worker(("sh", "-c", "exit 1"), dict(os.environ), places[1], None))
    workers[1].process.wait(timeout=20)
    outcome = supervisor.watch()
    assert outcome.failed is workers[1] and outcome.code == 1
    summary = failure_summary(outcome.failed, workers, 0, None)
    assert f"had exited before, with exit code 0: rank 0 (pid {workers[0].pid})" in summary


@pytest.mark.timeout(60)
def test_a_failure_that_is_a_consequence_of_a_rank_elsewhere_says_so(tmp_path):
    """Another node's launcher killed: this node's ranks fail in Gloo ("Connection closed by peer"),
    and the summary's first line, "exit code 1", must not read as the cause."""
    supervisor = Supervisor(parse_args(["--nproc-per-node", "1", "--no-python", "sh"], environ={}))
    supervisor._inbox = SignalInbox()  # not installed: the test sends no signal
    said = tmp_path / "consequence"  # what ddpkit.runtime.hangs creates in the worker
    supervisor._consequence_files = {0: str(said)}
    worker = spawn_worker(("sh", "-c", f"touch {said}; exit 1"), dict(os.environ), Placement(0, 0, 1, 1, 0, 1), None)
    worker.process.wait(timeout=20)
    supervisor._workers = [worker]
    outcome = supervisor.watch()
    summary = failure_summary(outcome.failed, [worker], 0, None, consequence=supervisor._is_consequence(worker))
    assert "exit code 1\nwhich is a consequence: its collective failed because a rank it waited on went away" \
        in summary, summary
    said.unlink()
    assert "consequence" not in failure_summary(outcome.failed, [worker], 0, None,
                                                consequence=supervisor._is_consequence(worker))


@pytest.mark.timeout(60)
def test_restart_increments_the_restart_count(job, tmp_path):
    code, _, err = job.run("--nproc-per-node", "2", "--max-restarts", "2", "--grace-period", "5",
                           WORKER, str(tmp_path), "fail-once", "1")
    assert code == 0, err
    assert "restarting all workers: restart 1 of at most 2" in err
    # the failed attempt's summary says a restart follows: the job did not fail
    assert "ddpkit run: attempt failed; restart 1 of at most 2 follows" in err and "the job failed" not in err
    assert {r: v["restart_count"] for r, v in job.results().items()} == {0: "1", 1: "1"}
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_runs_that_share_a_log_dir_each_keep_their_own_attempts(job, tmp_path):
    logs = tmp_path / "logs"
    code, _, first = job.run("--nproc-per-node", "1", "--max-restarts", "1", "--log-dir", str(logs),
                             WORKER, str(tmp_path), "fail-once", "0")
    assert code == 0, first
    code, _, second = job.run("--nproc-per-node", "1", "--log-dir", str(logs), WORKER, str(tmp_path), "succeed")
    assert code == 0, second
    dirs = [next(line.split("logs in ", 1)[1] for line in err.splitlines() if "logs in " in line)
            for err in (first, second)]
    assert sorted(dirs) == sorted(str(p) for p in logs.iterdir())
    assert [sorted(p.name for p in Path(d).iterdir()) for d in dirs] == [["attempt_0", "attempt_1"], ["attempt_0"]]


@pytest.mark.timeout(60)
def test_the_summary_leads_with_the_cause_not_the_rank_whose_hang_report_ended_it_first(job, tmp_path):
    # rank 1 raises and takes 3 s to exit; rank 0 sees it leave at once and ends with exit code 86
    code, _, err = job.run("--nproc-per-node", "2", "--grace-period", "5", WORKER, str(tmp_path), "exit-slowly", "1")
    summary = err[err.index("the job failed"):]
    assert code == 1, err
    assert summary.splitlines()[2].startswith("rank 1 (node 0, local rank 1,"), summary
    assert "RuntimeError: the cause, on rank 1" in summary
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_the_summary_leads_with_the_cause_not_a_collective_error_it_caused(job, tmp_path):
    # rank 0's all-reduce raises (exit code 1) when rank 1 leaves; rank 1 fails 2 s later with code 3
    code, _, err = job.run("--nproc-per-node", "2", "--grace-period", "5", WORKER, str(tmp_path),
                           "leave-then-fail", "1")
    summary = err[err.index("the job failed"):]
    assert code == 3, err
    assert summary.splitlines()[2].startswith("rank 1 (node 0, local rank 1,"), summary
    assert "also failed, before they were stopped: rank 0" in summary and "exit code 1" in summary
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_ranks_failing_together_each_show_their_own_error_and_none_is_called_stopped(job, tmp_path):
    # rank 1 raises 0.2 s after rank 0; the launcher gives it PEER_EXIT_WAIT to end by itself before
    # SIGTERM: without that it was "stopped because of it", killed before it printed its traceback
    for _ in range(3):
        code, _, err = job.run("--nproc-per-node", "2", WORKER, str(tmp_path), "all-fail")
        summary = err[err.index("the job failed"):]
        assert code == 1, err
        assert "also failed, before they were stopped: rank" in summary and "stopped because of it" not in summary
        assert "ValueError: bad config on rank 0" in err and "ValueError: bad config on rank 1" in err
        assert_all_gone(job.pids())
        for stale in tmp_path.glob("pids_*"):
            stale.unlink()


def _node(rank: int, port: int, *args: str) -> tuple[str, ...]:
    return ("--nnodes", "3", "--node-rank", str(rank), "--master-port", str(port), *args)


@pytest.mark.timeout(60)
def test_missing_node_times_out_naming_it_on_every_node_that_joined(job, tmp_path):
    start = time.monotonic()
    port = _free_port()
    nodes = [job.start(*_node(rank, port, "--rdzv-timeout", "3"), WORKER, str(tmp_path), "block")
             for rank in (0, 1)]
    errors = [node.communicate(timeout=30)[1] for node in nodes]
    assert time.monotonic() - start < 30
    assert [node.returncode for node in nodes] == [1, 1], errors
    for err in errors:  # node 1 too: it reads node 0's verdict before node 0 closes the store
        assert "2 of 3 nodes joined (node ranks 0, 1); did not join: node rank(s) 2" in err, err
    assert not job.pids()  # no worker was started


@pytest.mark.timeout(60)
def test_a_node_waiting_for_the_others_says_whom_it_waits_for_before_it_gives_up(job, tmp_path):
    # 15 s in (half a shorter --rdzv-timeout), then every minute: a long --rdzv-timeout
    # (multi_node.sh's is 900 s) is not silence
    port = _free_port()
    node = job.start("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                     str(port), "--rdzv-timeout", "7", WORKER, str(tmp_path), "block")
    err = node.communicate(timeout=45)[1]
    notice = re.search(rf"ddpkit run: waiting for node rank\(s\) 1 to join at 127.0.0.1:{port} \((\d+) s so far; "
                       r"this node gives up after 7 s, --rdzv-timeout\)", err)
    assert node.returncode == 1 and notice and 3 <= int(notice.group(1)) < 7, err
    assert notice.start() < err.index("did not join: node rank(s) 1")


@pytest.mark.timeout(60)
def test_a_second_node_0_on_the_port_is_told_that_it_may_be_this_runs(job, tmp_path):
    port = _free_port()
    first = job.start(*_node(0, port, "--rdzv-timeout", "4", "--rdzv-id", "j1"), WORKER, str(tmp_path), "block")
    _wait_listening(port)
    second = job.start(*_node(0, port, "--rdzv-timeout", "4", "--rdzv-id", "j1"), WORKER, str(tmp_path), "block")
    err = second.communicate(timeout=30)[1]
    first.communicate(timeout=30)
    assert second.returncode == 1, err
    assert (f"node 0 cannot host the rendezvous on port {port}" in err and "another job, or another node of "
            "this run started with --node-rank 0 too" in err and "give every node its own --node-rank" in err), err


def _wait_listening(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s")


@pytest.mark.timeout(60)
def test_an_unnamed_run_says_so_and_a_taken_node_rank_may_be_another_runs(job, tmp_path):
    port = _free_port()
    nodes = [job.start(*_node(rank, port, "--rdzv-timeout", "5"), WORKER, str(tmp_path), "block")
             for rank in (0, 1, 1)]
    errors = [node.communicate(timeout=30)[1] for node in nodes]  # node 2 never comes: the rest time out
    assert all("this run has no name (--rdzv-id)" in err for err in errors), errors
    taken = [err for err in errors[1:] if "node rank 1 already joined from" in err]
    assert len(taken) == 1, errors  # whichever of the two node-1 launchers came second
    assert "as this run has no --rdzv-id, a node of another run on this port took the place" in taken[0]


@pytest.mark.timeout(60)
def test_nodes_that_disagree_on_nnodes_stop_as_soon_as_they_meet(job, tmp_path):
    port = _free_port()
    nodes = [job.start("--nnodes", nnodes, "--node-rank", rank, "--master-port", str(port),
                       WORKER, str(tmp_path), "block") for nnodes, rank in (("2", "0"), ("3", "1"))]
    errors = [node.communicate(timeout=30)[1] for node in nodes]  # the default --rdzv-timeout is 600 s
    assert [node.returncode for node in nodes] == [1, 1], errors
    for err in errors:
        assert "node 0 was started with --nnodes 2, node 1 with --nnodes 3" in err, err


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_for_node_0_says_it_was_interrupted(job, tmp_path):
    node1 = job.start(*_node(1, _free_port()), WORKER, str(tmp_path), "block")
    for _ in range(20):  # the launcher's first lines; a warning of torch's may come before ours
        if "is waiting for node 0's rendezvous" in node1.stderr.readline():
            break
    else:
        pytest.fail("the launcher never said it was waiting for node 0")
    node1.send_signal(signal.SIGINT)
    _, err = node1.communicate(timeout=30)
    assert node1.returncode == 128 + signal.SIGINT, err
    assert "error: interrupted while waiting to reach node 0's rendezvous" in err


@pytest.mark.timeout(60)
def test_failure_on_one_node_stops_the_other_node(job, tmp_path):
    node0, node1 = job.start_nodes(WORKER, str(tmp_path), "fail", "3")
    err1 = node1.communicate(timeout=50)[1]
    node1_done = time.monotonic()
    err0 = node0.communicate(timeout=50)[1]
    # node 0 closes its store once every other node has the failure: the failing node has it from
    # the start (it waited out a 5 s read timeout for the failing node's own acknowledgement)
    assert time.monotonic() - node1_done < 3
    code0, code1 = node0.returncode, node1.returncode
    assert (code0, code1) == (1, 1), (err0, err1)
    assert "rank 3 on node 1" in err0 and "stopped on this node: rank 0, rank 1" in err0
    assert "rank 3 (node 1, local rank 1" in err1 and "ValueError: boom on rank 3" in err1
    pids = job.pids()
    assert len(pids) == 5  # four workers and rank 3's child
    assert_all_gone(pids)


@pytest.mark.timeout(60)
def test_restart_after_a_failure_on_one_node_restarts_every_node(job, tmp_path):
    (code0, err0), (code1, err1) = job.run_two_nodes("--max-restarts", "1", WORKER, str(tmp_path),
                                                     "fail-once", "3")
    assert (code0, code1) == (0, 0), (err0, err1)
    assert "rank 3 on node 1" in err0 and "RuntimeError: first attempt fails" in err1
    assert {r: v["restart_count"] for r, v in job.results().items()} == {r: "1" for r in range(4)}
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_a_node_whose_launcher_vanishes_ends_the_job_on_the_others_naming_it(job, tmp_path):
    nodes = job.start_nodes("--node-timeout", "1.5", WORKER, str(tmp_path), "block-on-node", "2",
                            nnodes=3, nproc=1)
    job.wait_for_files("pids_*.json", 3)
    finished = []
    for rank in (0, 1):
        try:
            finished.append(psutil.Process(job.worker_pid(rank)))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(finished, timeout=20)  # nodes 0 and 1's ranks succeed at once
    assert not alive
    nodes[2].kill()  # no handler runs: node 0 only learns of it from the missing heartbeat
    for node in nodes[:2]:  # node 1 hears it from node 0
        _, err = node.communicate(timeout=20)
        assert node.returncode == 1, err
        assert "node 2 (host" in err and "vanished: its launcher sent no heartbeat for 1.5 s" in err
    pids = job.pids()
    assert len(pids) == 4  # three workers and node 2's grandchild
    assert_all_gone(pids)


@pytest.mark.timeout(60)
def test_node_0_vanishing_stops_node_1_with_one_line_and_no_cpp_trace(job, tmp_path):
    node0, node1 = job.start_nodes(WORKER, str(tmp_path), "block")
    job.wait_for_files("pids_*.json", 4)
    node0.kill()
    _, err1 = node1.communicate(timeout=30)
    assert node1.returncode == 1, err1
    assert "node 0's rendezvous store" in err1 and "node 0's launcher exited or is unreachable" in err1
    assert "frame #" not in err1 and "TCPStore.cpp" not in err1  # c10d's C++ log stays quiet
    pids = job.pids()
    assert len(pids) == 8
    assert_all_gone(pids)


# ------------------------------------------------------------------------------------------ signals


@pytest.mark.timeout(60)
def test_launcher_killed_with_sigkill_leaves_no_worker(job, tmp_path):
    launcher = job.start("--nproc-per-node", "2", WORKER, str(tmp_path), "block")
    job.wait_for_files("pids_*.json", 2)
    pids = job.pids()
    assert len(pids) == 4  # two workers, each with a child
    error_file = psutil.Process(job.worker_pid(0)).environ()["TORCHELASTIC_ERROR_FILE"]
    own_dir = Path(error_file).parents[1]  # the launcher's own directory for the error files
    assert own_dir.is_dir()
    launcher.kill()
    launcher.communicate(timeout=10)
    assert_all_gone(pids)  # workers by their death signal, their children by the watchdog
    deadline = time.monotonic() + 10
    while own_dir.exists():  # the watchdog removes it after the kill
        assert time.monotonic() < deadline, f"{own_dir} was left behind"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_launcher_killed_with_sigkill_leaves_no_daemon_a_worker_started(job, tmp_path):
    launcher = job.start("--nproc-per-node", "1", WORKER, str(tmp_path), "detached")
    job.wait_for_files("pids_*.json", 1)
    pids = job.pids()
    assert len(pids) == 3
    # one daemon carries the watchdog's token in its environment; the other, with an empty
    # environment, is only found by the watchdog's record of the workers' descendants, taken once a
    # second and announced nowhere: let two of them pass
    time.sleep(2 * _WATCHDOG_SCAN)
    launcher.kill()
    launcher.communicate(timeout=10)
    assert_all_gone(pids)


@pytest.mark.timeout(30)
def test_the_watchdog_finds_the_processes_its_token_marks():
    token = "test-token"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    marked_proc = subprocess.Popen(sleep, env={**os.environ, TOKEN_VARIABLE: token})
    other = subprocess.Popen(sleep, env={**os.environ, TOKEN_VARIABLE: "another job"})
    try:
        found = marked(token, _processes())
        assert marked_proc.pid in found and other.pid not in found
    finally:
        for proc in (marked_proc, other):
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_sigusr1_is_forwarded_and_sigint_stops_every_worker_and_child(job, tmp_path):
    launcher = job.start("--nproc-per-node", "2", "--grace-period", "10", WORKER, str(tmp_path), "block")
    job.wait_for_files("pids_*.json", 2)
    launcher.send_signal(signal.SIGUSR1)  # a pre-emption notice: the workers hear it, the job goes on
    job.wait_for_files("usr1_*", 2)
    assert launcher.poll() is None
    assert all(psutil.pid_exists(pid) for pid in job.pids())  # the children were not sent SIGUSR1
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert "received SIGINT: stopped all workers" in err
    pids = job.pids()
    assert len(pids) == 4
    assert_all_gone(pids)


@pytest.mark.timeout(60)
def test_ctrl_c_on_a_deadlocked_job_has_each_rank_report_where_it_waits(job, tmp_path):
    # before, the launcher waited out its 30 s grace in silence, then killed them
    launcher = job.start("--nproc-per-node", "2", WORKER, str(tmp_path), "deadlock")
    job.wait_for_files("deadlock_*", 2)
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert "workers still running 2 s after SIGINT: each reports where it waits" in err
    assert "ddpkit hang report (stall_timeout=60 s" in err and "the ranks disagree at #1" in err, err
    assert time.monotonic() - start < 15, err
    assert_all_gone(job.pids())


@pytest.mark.timeout(60)
def test_ctrl_c_reaches_each_worker_once_so_its_cleanup_runs_to_the_end(job, tmp_path):
    launcher = job.start("--nproc-per-node", "2", "--grace-period", "20", WORKER, str(tmp_path), "sigint")
    job.wait_for_files("pids_*.json", 2)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=30)
    assert "SIGKILL in 20 s (Ctrl-C: at once)" in err
    for rank in (0, 1):
        assert json.loads((tmp_path / f"sigint_{rank}").read_text()) == {"count": 1}, err
    assert_all_gone(job.pids())
