"""Suite-wide guard: no test may leave a process running behind it, pass or fail."""
from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker

import psutil
import pytest


def _infrastructure_pids() -> set[int]:
    """multiprocessing's long-lived helpers, shared by every test: not leftovers."""
    pids = {
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
    }
    return {pid for pid in pids if pid}


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    me = psutil.Process()
    infrastructure = _infrastructure_pids()
    left = [p for p in me.children(recursive=True) if p.pid not in infrastructure]
    # processes already told to exit get a moment to do so; this waits on them, it does not sleep
    _, alive = psutil.wait_procs(left, timeout=5)
    alive = [p for p in alive if _running(p)]
    for p in alive:
        p.kill()
    assert not alive, f"the test left processes running: {[(p.pid, p.name()) for p in alive]}"


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def launched_as_rank_1_of_2(monkeypatch):
    """The variables torchrun gives rank 1 of a 2-process job, with no process group made yet."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
