"""init()/shutdown(): a world of one without network, real worlds of 2-4, and failed rendezvous."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ranks import rank_env, run_ranks


@pytest.fixture
def single_process(monkeypatch):
    """No launcher variables, and the process group torn down whatever the test does."""
    for name in list(os.environ):
        if name.split("_")[0] in ("RANK", "WORLD", "LOCAL", "MASTER", "SLURM", "OMPI", "PMI", "PMIX", "MV2"):
            monkeypatch.delenv(name)
    yield
    ddpkit.shutdown()


def test_single_process_fallback_gives_a_working_world_of_one(single_process):
    env = ddpkit.init()
    assert (env.rank, env.world_size, env.launcher, env.backend) == (0, 1, "single", None)
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert env.device == expected and env.master_addr is None
    assert ddpkit.init() is env, "init() must be idempotent"
    # plain torch.distributed calls in user code work too
    t = torch.tensor([2.0])
    dist.all_reduce(t)
    assert t.item() == 2.0 and dist.get_world_size() == 1
    assert (ddpkit.get_rank(), ddpkit.get_world_size(), ddpkit.is_main_process()) == (0, 1, True)


def test_shutdown_is_safe_twice_and_init_works_again(single_process):
    ddpkit.shutdown()
    ddpkit.init()
    ddpkit.shutdown()
    ddpkit.shutdown()
    assert not dist.is_initialized()
    assert ddpkit.init().world_size == 1


def test_contradictory_variables_fail_before_any_network(single_process, monkeypatch):
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"RANK=4 is out of range for WORLD_SIZE=4"):
        ddpkit.init()
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend, message", [("tcp", "is not one of"), ("nccl", "needs CUDA")])
def test_bad_backend_is_named(single_process, backend, message):
    if backend == "nccl" and torch.cuda.is_available():
        pytest.skip("NCCL is usable on this machine")
    with pytest.raises(ValueError, match=message):
        ddpkit.init(backend=backend)


def test_bad_timeout_is_named(single_process):
    with pytest.raises(ValueError, match=r"timeout=-1 must be a positive number"):
        ddpkit.init(timeout=-1)


def _describe_init():
    env = ddpkit.init(backend="gloo", timeout=30)
    again = ddpkit.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    described = (env.rank, env.world_size, env.local_rank, env.launcher, env.backend, str(env.device),
                 again is env, t.item(), ddpkit.is_main_process())
    ddpkit.shutdown()
    ddpkit.shutdown()
    return described, dist.is_initialized()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_init_and_shutdown_in_a_real_world(world):
    results = run_ranks(_describe_init, world, init=False)
    for rank, (described, still_initialized) in enumerate(results):
        assert described == (rank, world, rank, "torchrun", "gloo", "cpu", True, float(world), rank == 0)
        assert not still_initialized


def _run_python(code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "MASTER", "LOCAL"))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**clean, **env},
                          capture_output=True, text=True, timeout=timeout)


INIT_WITH_SHORT_TIMEOUT = """
    import ddpkit
    try:
        ddpkit.init(backend="gloo", timeout=2)
    except RuntimeError as e:
        print(e)
        raise SystemExit(3)
"""


@pytest.mark.timeout(60)
def test_rendezvous_that_cannot_complete_says_how_many_joined():
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    result = _run_python(INIT_WITH_SHORT_TIMEOUT, rank_env(0, 3, store.port))
    assert result.returncode == 3, result.stderr
    assert f"rendezvous at 127.0.0.1:{store.port} timed out after 2 s" in result.stdout
    assert "only 1 of WORLD_SIZE=3 ranks joined" in result.stdout


@pytest.mark.timeout(60)
def test_unreachable_rendezvous_names_the_address():
    with socket.socket() as held:  # bound but not listening: connections are refused, port not reused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        result = _run_python(INIT_WITH_SHORT_TIMEOUT, rank_env(1, 2, port, agent_store=False))
    assert result.returncode == 3, result.stderr
    assert f"rank 1 could not reach the rendezvous at 127.0.0.1:{port}" in result.stdout
    assert "MASTER_ADDR=127.0.0.1" in result.stdout
