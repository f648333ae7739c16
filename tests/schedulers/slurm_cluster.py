"""A single-node SLURM in a temporary folder: munged, slurmctld and slurmd on free ports.

The tests need a real srun and sbatch, not a mock of their variables, yet must not touch the
machine's own configuration: everything (key, sockets, state, logs, ``slurm.conf``) lives in one
folder, and ``SLURM_CONF`` / the munge socket point there. Process tracking and task binding are
the plain ones (``proctrack/linuxproc``, ``task/none``) because a container has no cgroups to give.
The daemons fork into the background, so they are no test's children; ``stop`` ends each by the
pid it wrote, and waits until it has gone.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SlurmCluster", "slurm_missing", "start_cluster"]

_DAEMONS = ("slurmd", "slurmctld", "munged")
_CLIENTS = ("srun", "sbatch", "squeue", "sinfo", "scontrol", "mungekey")


def slurm_missing() -> str | None:
    """Why a SLURM cannot be started here, or None when it can."""
    missing = [p for p in _DAEMONS + _CLIENTS if shutil.which(p) is None
               and not Path("/usr/sbin", p).exists()]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): "
                "apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "a private slurmd must run as root (it starts tasks as the submitting user)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    """A running single-node SLURM; ``env`` is what a client needs (SLURM_CONF)."""

    folder: Path
    node: str
    cpus: int
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        """Run a SLURM client command (srun, sbatch, ...) against this cluster, in ``env``
        (default: this process's environment) plus SLURM_CONF."""
        base = os.environ if env is None else env
        # a test run inside a SLURM job must not lead the client to that job
        env = {**{k: v for k, v in base.items() if not k.startswith("SLURM_")}, **self.env}
        return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    def command(self, *args: str) -> list[str]:
        """``args`` as a command line that runs against this cluster when started in any environment."""
        return ["env", *(f"{k}={v}" for k, v in self.env.items()), *args]

    def wait_job(self, job_id: str, timeout: float = 120) -> None:
        """Wait until the job has left the queue (it finished, failed or was cancelled)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()
            if not out:
                return
            time.sleep(0.2)
        self.run("scancel", job_id)
        raise TimeoutError(f"SLURM job {job_id} still queued or running after {timeout:g} s")

    def stop(self) -> None:
        """End the daemons (each by the pid it wrote) and any job still running; wait for them."""
        self.run("scancel", "--full", "-u", "root", timeout=10)
        deadline = time.monotonic() + 15  # let slurmd end the jobs' steps, so no slurmstepd outlives it
        while time.monotonic() < deadline and self.run("squeue", "-h", timeout=10).stdout.strip():
            time.sleep(0.2)
        for name in _DAEMONS:
            pid_file = self.folder / f"{name}.pid"
            if not pid_file.exists():
                continue
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (ValueError, ProcessLookupError, IndexError):
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie whose parent is gone is reaped by init; /proc tells whether it is still running
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _config(folder: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=ddpkit-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=2
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def start_cluster(folder: Path, timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and slurmd in ``folder``; return once the node takes jobs.

    Raises:
        RuntimeError: a daemon did not start, with the end of its log.
    """
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    node = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, node, cpus, _free_port(), _free_port()))
    env = {"SLURM_CONF": str(conf)}
    cluster = SlurmCluster(folder, node, cpus, env)
    key = folder / "munge.key"
    started: list[str] = []
    try:
        _check(subprocess.run([_exe("mungekey"), "-c", "-f", "-k", str(key)], capture_output=True,
                              text=True), "mungekey")
        key.chmod(0o400)
        _check(subprocess.run([_exe("munged"), "--force", f"--socket={folder}/munge.socket",
                               f"--key-file={key}", f"--pid-file={folder}/munged.pid",
                               f"--log-file={folder}/munged.log", f"--seed-file={folder}/munged.seed"],
                              capture_output=True, text=True), "munged")
        started.append("munged")
        daemon_env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **env}
        for name in ("slurmctld", "slurmd"):
            args = [_exe(name), "-f", str(conf)] + (["-c", "-i"] if name == "slurmctld" else ["-N", node])
            _check(subprocess.run(args, env=daemon_env, capture_output=True, text=True), name, folder)
            started.append(name)
        _wait_idle(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _check(result: subprocess.CompletedProcess, what: str, folder: Path | None = None) -> None:
    if result.returncode != 0:
        log = ""
        if folder is not None and (folder / f"{what}.log").exists():
            log = (folder / f"{what}.log").read_text()[-2000:]
        raise RuntimeError(f"{what} failed to start (exit {result.returncode}): {result.stderr}{log}")


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = cluster.run("sinfo", "-h", "-o", "%t", timeout=10).stdout.strip()
        if state in ("idle", "mix", "alloc"):
            return
        time.sleep(0.2)
    logs = "".join((cluster.folder / f"{n}.log").read_text()[-1500:]
                   for n in ("slurmctld", "slurmd") if (cluster.folder / f"{n}.log").exists())
    raise RuntimeError(f"the SLURM node did not become idle within {timeout:g} s (state {state!r}):\n{logs}")
