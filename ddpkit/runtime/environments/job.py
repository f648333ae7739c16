"""Which job is this process part of? ``job_id(environ, launcher)`` names it from the launcher's variables.

Two jobs on one node that meet on one port would otherwise form one process group, and their
all-reduces would return plausible, wrong sums: the rendezvous compares every rank's job with the
job that owns the store (``ddpkit.runtime.job_check``). Every rank of one job must derive the same
name, and ranks of different jobs different ones, so each launcher's own job id is used:

1. ``DDPKIT_JOB_ID``, when the user (or ``ddpkit run``, for its workers) sets it;
2. torchrun's / ``ddpkit run``'s ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``), unless it is torchrun's
   default ``none``;
3. SLURM's ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (two steps of one allocation are two jobs);
4. Open MPI's job id (``OMPI_MCA_ess_base_jobid``), else the PMIx namespace (``PMIX_NAMESPACE``).

Under mpirun the MPI id comes before SLURM's, since an mpirun inside a batch script inherits the batch
step's SLURM variables. A job none of them names is ``None``, "unnamed": it is still checked for its
WORLD_SIZE and for ranks that join twice, but two unnamed jobs cannot be told apart. ``ddpkit run`` on
several nodes without a name gets one at its rendezvous (``unnamed_run_name``), made by node 0 and
taken by the nodes that join it, so that its workers at least refuse a process of no job.
"""
from __future__ import annotations

import uuid
from typing import Mapping

__all__ = ["job_id", "slurm_step", "SLURM_BATCH_STEPS", "USER_VARIABLE", "unnamed_run_name", "is_unnamed_run"]

USER_VARIABLE = "DDPKIT_JOB_ID"

SLURM_BATCH_STEPS = {"4294967294": "batch", "4294967295": "extern", "4294967293": "interactive",
                     "batch": "batch", "extern": "extern", "interactive": "interactive"}
"""SLURM's special step ids (and names): the batch script, the extern step, salloc's shell."""

_UNNAMED_RUN = "unnamed-run:"

_MPI_IDS = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE", "PMI_JOBID")


def slurm_step(environ: Mapping[str, str]) -> str | None:
    """This process's SLURM step id (``SLURM_STEP_ID``, older ``SLURM_STEPID``); None outside a step."""
    for name in ("SLURM_STEP_ID", "SLURM_STEPID"):
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def job_id(environ: Mapping[str, str], launcher: str) -> str | None:
    """This job's name, the same on all its ranks (see the module docstring); None when unnamed.

    The name says where it came from (``slurm:1234.0``, ``mpi:3141140481``, ``run:<id>``,
    ``user:<value>``), so that a message naming two jobs tells the reader which launchers met.
    """
    user = environ.get(USER_VARIABLE, "").strip()
    if user:
        return user if ":" in user else f"user:{user}"
    run = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run and run != "none" and launcher in ("torchrun", "ddpkit"):
        return f"run:{run}"
    sources = (_mpi, _slurm) if launcher == "mpi" else (_slurm, _mpi)
    for source in sources:
        name = source(environ)
        if name is not None:
            return name
    return None


def _slurm(environ: Mapping[str, str]) -> str | None:
    job = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    if not job:
        return None
    step = slurm_step(environ)
    return f"slurm:{job}.{SLURM_BATCH_STEPS.get(step, step) if step else 'batch'}"


def _mpi(environ: Mapping[str, str]) -> str | None:
    for name in _MPI_IDS:
        value = environ.get(name, "").strip()
        if value:
            return f"mpi:{value}"
    return None


def unnamed_run_name() -> str:
    """A fresh name for a run of several nodes that has none (no --rdzv-id, no scheduler's job)."""
    return f"{_UNNAMED_RUN}{uuid.uuid4().hex[:16]}"


def is_unnamed_run(job: str | None) -> bool:
    """Whether ``job`` is a name ``unnamed_run_name`` made: a node of an unnamed run takes it."""
    return job is not None and job.startswith(_UNNAMED_RUN)
