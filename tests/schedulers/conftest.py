"""Fixtures for the tests under real launchers: Open MPI's mpirun and a private single-node SLURM.

Every test here carries the ``schedulers`` marker (``pytest -m schedulers`` selects them, ``-m 'not
schedulers'`` leaves them out) and runs in the default ``pytest -q tests``; where a launcher is not
installed it skips, saying which package is missing. The SLURM daemons are started once per session
in a temporary folder and stopped at its end, so no daemon outlives the tests.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import SlurmCluster, slurm_missing, start_cluster  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"


def pytest_configure(config):
    config.addinivalue_line("markers", "schedulers: runs under real launchers (mpirun, srun, sbatch)")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.schedulers)


def python_env(**extra: str) -> dict[str, str]:
    """The environment a launched rank needs to import this checkout's ddpkit, without launcher leftovers."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "DDPKIT_JOB_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def reference_losses() -> list[tuple[int, float]]:
    """examples/train_ddp.py's losses under 'ddpkit run' with 2 processes, which every launcher must match."""
    from helpers import ddpkit_run_losses
    return ddpkit_run_losses(2, python_env())


@pytest.fixture(scope="session")
def mpirun() -> list[str]:
    """The start of an mpirun command line: as root it needs --allow-run-as-root, and more ranks than
    cores need --oversubscribe."""
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.skip("Open MPI is not installed: apt-get install openmpi-bin")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version:
        pytest.skip(f"mpirun is not Open MPI's ({version.splitlines()[:1]})")
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [exe, *as_root, "--oversubscribe", "--bind-to", "none"]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> SlurmCluster:
    reason = slurm_missing()
    if reason is not None:
        pytest.skip(reason)
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()
