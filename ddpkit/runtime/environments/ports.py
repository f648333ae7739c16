"""The rendezvous port a scheduler's job uses when MASTER_PORT is not set: one per job, in a fixed range.

A fixed default (29500) puts every job on a node on one port; the last digits of a job id put jobs
18 and 10018 on one. Instead the whole job id and the step id choose a port in
``[PORT_BASE, PORT_BASE + PORT_SPAN)`` = [20000, 32000): unprivileged, and below Linux's ephemeral range
(32768-60999), so the kernel does not hand it to some client's outgoing connection.

- SLURM: ``PORT_BASE + (SLURM_JOB_ID * 16 + SLURM_STEP_ID mod 16) mod PORT_SPAN``. Consecutive jobs
  and the first 16 steps of a job get consecutive ports: jobs whose ids differ by less than 750
  never share one.
- mpirun: ``PORT_BASE + crc32(job id) mod PORT_SPAN`` over Open MPI's job id or the PMIx namespace,
  which carry no order.

Where two jobs still meet on one port (a hash collision, or one MASTER_PORT given to both) the
rendezvous's job check refuses the stranger: see ``ddpkit.runtime.job_check``.
"""
from __future__ import annotations

import zlib
from typing import Mapping

from ddpkit.runtime.environments.job import SLURM_BATCH_STEPS, slurm_step

__all__ = ["PORT_BASE", "PORT_SPAN", "slurm_port", "mpi_port", "port_for_job"]

PORT_BASE = 20000
PORT_SPAN = 12000
_STEP_SLOTS = 16


def slurm_port(environ: Mapping[str, str]) -> int | None:
    """The port of this SLURM job step, or None without a numeric job id."""
    job = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    if not job.isdigit():
        return None
    step = slurm_step(environ)
    step_index = int(step) % _STEP_SLOTS if step and step.isdigit() and step not in SLURM_BATCH_STEPS else 0
    return PORT_BASE + (int(job) * _STEP_SLOTS + step_index) % PORT_SPAN


def mpi_port(environ: Mapping[str, str]) -> int | None:
    """The port of this mpirun job (Open MPI's job id, else the PMIx namespace), or None."""
    for name in ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE", "PMI_JOBID"):
        value = environ.get(name, "").strip()
        if value:
            return port_for_job(value)
    return None


def port_for_job(name: str) -> int:
    """A port for a job known only by a name: a stable hash of it into the range."""
    return PORT_BASE + zlib.crc32(name.encode()) % PORT_SPAN
