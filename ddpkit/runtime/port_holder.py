"""Who holds a port on this host: for the message of a rank 0 that cannot bind its rendezvous port.

"Port 29500 is in use" leaves the reader to hunt for the culprit; naming the process, its command
and, when it is a ddpkit rank, its job, usually ends the hunt. Best effort: another user's processes
may be invisible, and then the message simply says less.
"""
from __future__ import annotations

import psutil

from ddpkit.runtime.environments.job import job_id

__all__ = ["describe_holder"]


def describe_holder(port: int) -> str:
    """``": pid 4242 (python3 train.py) of job slurm:12.0"``, or ``""`` when it cannot be seen."""
    try:
        pids = {c.pid for c in psutil.net_connections(kind="tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid}
    except (psutil.Error, OSError):
        return ""
    found = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            command = " ".join(process.cmdline()) or process.name()
            command = command if len(command) <= 100 else command[:99] + "…"
            environ = process.environ()
        except (psutil.Error, OSError):
            found.append(f"pid {pid}")
            continue
        launcher = "mpi" if "OMPI_COMM_WORLD_RANK" in environ or "PMIX_RANK" in environ else "torchrun"
        if "SLURM_PROCID" in environ and launcher != "mpi" and "RANK" not in environ:
            launcher = "slurm"
        job = job_id(environ, launcher)
        found.append(f"pid {pid} ({command})" + (f" of job {job}" if job else ""))
    return f": {', '.join(found)}" if found else ""
