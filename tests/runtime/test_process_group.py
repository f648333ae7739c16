"""init()/shutdown(): a world of one without network, real worlds of 2-4, and failed rendezvous."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from ranks import rank_env, run_ranks
from torch.distributed.constants import default_pg_timeout

import ddpkit


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
    with pytest.raises(ddpkit.LauncherVariableError, match=r"RANK=4 is out of range for WORLD_SIZE=4"):
        ddpkit.init()
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend, message", [("tcp", "is not one of"), ("nccl", "needs CUDA"),
                                              ("mpi", "this build of torch has no mpi backend")])
def test_bad_backend_is_named(single_process, backend, message):
    if backend == "nccl" and torch.cuda.is_available() or backend == "mpi" and dist.is_mpi_available():
        pytest.skip(f"{backend} is usable on this machine")
    with pytest.raises(ValueError, match=message):
        ddpkit.init(backend=backend)


def test_a_bad_backend_from_the_environment_names_the_variable(single_process, monkeypatch):
    monkeypatch.setenv("DDPKIT_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"^DDPKIT_BACKEND='bogus' is not one of"):
        ddpkit.init()
    assert ddpkit.init(backend="gloo").world_size == 1  # the argument wins over the variable


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), float("inf"), "10"])
def test_bad_timeout_is_named(single_process, timeout):
    with pytest.raises(ValueError, match=rf"timeout={re.escape(repr(timeout))} must be a positive, finite number"):
        ddpkit.init(timeout=timeout)


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


def _collective_timeout() -> float:
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _join_three_times():
    sums, timeouts = [], []
    for round_, timeout in zip(range(1, 4), (30, None, 30)):
        env = ddpkit.init(backend="gloo", timeout=timeout)
        sums.append(ddpkit.all_reduce(torch.tensor([float(env.rank + round_)])).item())
        # the store too, through which strict mode's checks wait
        timeouts.append((_collective_timeout(), dist.distributed_c10d._get_default_store().timeout.total_seconds()))
        ddpkit.shutdown()
    return sums, timeouts


@pytest.mark.timeout(60)
def test_init_after_shutdown_meets_on_fresh_keys_of_the_launchers_store():
    # and collectives keep torch's default timeout unless init() is given one
    torchs = default_pg_timeout.total_seconds()
    for rank_sums, timeouts in run_ranks(_join_three_times, 2, init=False):
        assert rank_sums == [3.0, 5.0, 7.0] and timeouts == [(30, 30), (torchs, torchs), (30, 30)]


def test_collectives_keep_torchs_default_timeout_unless_given_one(single_process):
    ddpkit.init()
    assert _collective_timeout() == default_pg_timeout.total_seconds() == 1800
    assert ddpkit.init(timeout=1800).world_size == 1  # the timeout in force, said again
    with pytest.raises(ValueError, match=r"init\(timeout=300s\) but this process already joined with timeout=1800s"):
        ddpkit.init(timeout=300)
    ddpkit.shutdown()
    ddpkit.init(timeout=7)
    assert _collective_timeout() == 7


def _clean_env() -> dict[str, str]:
    """This process's environment without launcher variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "MASTER", "LOCAL"))}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_python(code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**_clean_env(), **env},
                          capture_output=True, text=True, timeout=timeout)


def test_single_process_tracebacks_carry_no_rank_prefix_but_launched_ones_do():
    code = "import ddpkit; ddpkit.init(); raise ValueError('plain')"
    single = _run_python(code, {})
    assert "\nValueError: plain" in single.stderr and "[rank0]" not in single.stderr, single.stderr
    launched = _run_python(code, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": "1"})
    assert "[rank0]: ValueError: plain" in launched.stderr, launched.stderr  # torch's prefix, as under torchrun


INIT_WITH_SHORT_TIMEOUT = """
    import time
    import ddpkit
    init = ddpkit.init  # loads torch and ddpkit's runtime, as a script's own imports do before init()
    start = time.monotonic()
    try:
        init(backend="gloo", timeout=2)
    except RuntimeError as e:
        print(e)
        print(f"{type(e).__name__} at {e.address} after {e.timeout} s")
        print(f"gave up after {time.monotonic() - start:.1f} s")
        raise SystemExit(3)
"""


def _gave_up_after(stdout: str) -> float:
    return float(re.search(r"gave up after ([0-9.]+) s", stdout).group(1))


@pytest.mark.timeout(60)
def test_rendezvous_that_cannot_complete_says_how_many_joined():
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    result = _run_python(INIT_WITH_SHORT_TIMEOUT, rank_env(0, 3, store.port))
    assert result.returncode == 3, result.stderr
    assert f"rendezvous at 127.0.0.1:{store.port} timed out after 2 s" in result.stdout
    assert "only 1 of WORLD_SIZE=3 ranks joined, missing: ranks 1, 2 (this is rank 0)" in result.stdout
    assert f"RendezvousError at 127.0.0.1:{store.port} after 2.0 s" in result.stdout


@pytest.mark.timeout(60)
def test_a_rank_waiting_for_late_ranks_in_init_says_who_it_waits_for():
    # a rank late to init() is a hang before any collective: it is told after the stall timeout
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    result = _run_python(INIT_WITH_SHORT_TIMEOUT, {**rank_env(0, 3, store.port), "DDPKIT_STALL_TIMEOUT": "0.5"})
    assert result.returncode == 3, result.stderr
    notices = [line for line in result.stderr.splitlines() if "waits in ddpkit.init()" in line]
    assert 2 <= len(notices) <= 4, result.stderr  # every 0.5 s of the 2 s timeout
    assert notices[0].startswith(f"[rank0]: ddpkit: this rank waits in ddpkit.init() at 127.0.0.1:{store.port}")
    assert re.search(r"1 of WORLD_SIZE=3 ranks joined, missing: ranks 1, 2, for \d+ s; it gives up in \d+ s",
                     notices[0]), notices[0]


@pytest.mark.timeout(60)
def test_unreachable_rendezvous_names_the_address():
    with socket.socket() as held:  # bound but not listening: connections are refused, port not reused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        result = _run_python(INIT_WITH_SHORT_TIMEOUT, rank_env(1, 2, port, agent_store=False))
    assert result.returncode == 3, result.stderr
    assert f"rank 1 could not reach the rendezvous at 127.0.0.1:{port}" in result.stdout
    assert "MASTER_ADDR=127.0.0.1" in result.stdout
    assert f"RendezvousError at 127.0.0.1:{port} after 2.0 s" in result.stdout
    assert _gave_up_after(result.stdout) < 3.5  # the 2 s asked for, not torch's connect backoff (~4.5 s)


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_reach_rank_0_says_so_every_stall_timeout():
    with socket.socket() as held:  # bound but not listening: nothing accepts
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        env = {**rank_env(1, 2, port, agent_store=False), "DDPKIT_STALL_TIMEOUT": "0.5"}
        result = _run_python(INIT_WITH_SHORT_TIMEOUT, env)
    assert result.returncode == 3, result.stderr
    notices = [line for line in result.stderr.splitlines() if "cannot reach the rendezvous" in line]
    assert 2 <= len(notices) <= 4, result.stderr  # every 0.5 s of the 2 s timeout
    assert notices[0].startswith(f"[rank1]: ddpkit: this rank cannot reach the rendezvous at 127.0.0.1:{port} yet "
                                 f"(rank 0 hosts it): nothing accepts a connection on port {port}"), notices[0]


@pytest.mark.timeout(60)
def test_a_port_held_by_a_program_that_is_no_store_fails_a_connecting_rank_at_its_deadline():
    # torch's client waits forever for such a listener's answer, past its own timeout
    with socket.socket() as listener:  # accepts connections (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        env = {**rank_env(1, 2, port, agent_store=False), "DDPKIT_STALL_TIMEOUT": "0.5"}
        result = _run_python(INIT_WITH_SHORT_TIMEOUT, env)
    assert result.returncode == 3, result.stderr
    assert (f"rank 1 could not reach the rendezvous at 127.0.0.1:{port} within 2 s (rank 0 hosts it): what listens "
            f"on port {port} of 127.0.0.1 accepted the connection but never answered as a rendezvous store: "
            "another program may hold the port") in result.stdout
    assert _gave_up_after(result.stdout) < 3.5
    assert "does not answer as a rendezvous store" in result.stderr  # said while it waited


@pytest.mark.timeout(60)
def test_a_process_that_refuses_its_variables_ends_the_wait_of_rank_0():
    port = _free_port()
    code = textwrap.dedent(INIT_WITH_SHORT_TIMEOUT).replace("timeout=2", "timeout=30")
    rank_0 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**_clean_env(), **rank_env(0, 2, port, agent_store=False),
                                   "DDPKIT_STALL_TIMEOUT": "0.5"})
    try:
        waiting = rank_0.stderr.readline()  # its first notice: the store is open (no race with the stray)
        assert "waits in ddpkit.init()" in waiting, waiting
        stray = _run_python(INIT_WITH_SHORT_TIMEOUT, {**rank_env(1, 2, port, agent_store=False), "RANK": "5"})
        out, err = rank_0.communicate(timeout=50)
    finally:
        rank_0.kill()
    assert stray.returncode != 0 and "RANK=5 is out of range for WORLD_SIZE=2" in stray.stderr, stray.stderr
    assert rank_0.returncode == 3, err
    assert (f"refused its launcher variables, so not all of WORLD_SIZE=2 ranks can join the rendezvous at "
            f"127.0.0.1:{port} (this is rank 0). Its error: RANK=5 is out of range for WORLD_SIZE=2") in out, out
    assert _gave_up_after(out) < 25  # at once, not after its 30 s


JOIN_AND_SUM = """
    import torch, ddpkit
    env = ddpkit.init(backend="gloo", timeout=20)
    t = torch.ones(1)
    ddpkit.all_reduce(t)
    print(f"rank {env.rank} sum {t.item():.0f}")
    ddpkit.shutdown()
"""


@pytest.mark.timeout(60)
def test_on_one_node_a_master_addr_that_does_not_resolve_is_reached_over_loopback_by_every_rank():
    port = _free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(JOIN_AND_SUM)],
                              env={**_clean_env(), **rank_env(r, 2, port, agent_store=False),
                                   "MASTER_ADDR": "nohost.invalid"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=50) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [out for out, _ in outputs] == ["rank 0 sum 2\n", "rank 1 sum 2\n"], outputs
    assert "every rank is on this node and reaches it over loopback" in outputs[0][1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("address", ["nohost.invalid", "198.51.100.7"])  # no name; a documentation address
def test_rank_0_with_a_master_addr_not_of_this_host_keeps_its_deadline(address):
    # torch's own connection to MASTER_ADDR retried for 5 minutes past init(timeout=...)
    with socket.socket() as probe, contextlib.suppress(OSError):
        probe.bind((address, 0))  # fails unless it is an address of this host
        pytest.skip(f"{address} is an address of this host")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**rank_env(0, 2, port, agent_store=False), "MASTER_ADDR": address}
    result = _run_python(INIT_WITH_SHORT_TIMEOUT, env)
    assert result.returncode == 3, result.stderr
    assert _gave_up_after(result.stdout) < 3.5
    # the others may still reach it (a NAT's address; a name not published yet): rank 0 says so, and waits
    said = "does not resolve here" if address == "nohost.invalid" else "is not an address of this host"
    assert f"MASTER_ADDR={address} {said}" in result.stderr, result.stderr
    assert "timed out after 2 s: only 1 of WORLD_SIZE=2 ranks joined, missing: rank 1" in result.stdout


@pytest.mark.timeout(60)
def test_a_rendezvous_that_times_out_names_the_schedulers_count_of_processes():
    # mpirun -np 1 -x WORLD_SIZE=2 ...: the rank it waits for was never started, and init(timeout=2)
    # ends before the first notice (60 s) could say so
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**rank_env(0, 2, port, agent_store=False), "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name)
    result = _run_python(INIT_WITH_SHORT_TIMEOUT, env)
    assert result.returncode == 3, result.stderr
    assert "only 1 of WORLD_SIZE=2 ranks joined, missing: rank 1" in result.stdout, result.stdout
    assert "WORLD_SIZE=2 was set by hand, but OMPI_COMM_WORLD_SIZE=1 processes were started" in result.stdout


@pytest.mark.timeout(60)
def test_a_rank_that_joined_hears_why_when_rank_0_gives_up_first():
    with socket.socket() as probe:  # rank 0 hosts the store: it needs a port nobody holds
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(INIT_WITH_SHORT_TIMEOUT)],
                              env={**os.environ, **rank_env(r, 3, port, agent_store=False)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=50) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for p, (stdout, stderr) in zip(ranks, outputs):
        assert p.returncode == 3, stderr
        assert "timed out after 2 s" in stdout and "of WORLD_SIZE=3 ranks joined" in stdout
        assert "RendezvousError at 127.0.0.1:" in stdout


def _local_rank_beside_own_group():
    # the mp.spawn pattern: the script makes its group itself and exports only LOCAL_RANK
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name)
    os.environ["LOCAL_RANK"] = "3"
    before = ddpkit.get_local_rank()  # to pick a GPU before the group exists
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen = ddpkit.get_local_rank()
    env = ddpkit.init()
    return before, seen, env.local_rank, env.world_size, ddpkit.get_local_rank()


def test_a_group_the_script_made_takes_its_local_rank_from_local_rank():
    assert run_ranks(_local_rank_beside_own_group, 1, init=False) == [(3, 3, 3, 1, 3)]


def _spawned_like_the_tutorials():
    # mp.spawn + init_process_group("gloo", rank=..., world_size=...) on MASTER_ADDR=127.0.0.1:
    # no launcher variables, every rank on this host
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    env = ddpkit.init()
    return env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.launcher


def test_a_group_made_by_hand_on_loopback_puts_every_rank_on_this_host():
    assert run_ranks(_spawned_like_the_tutorials, 2, init=False) == [(r, 2, r, 2, 0, "torchrun") for r in range(2)]


@pytest.mark.parametrize("environ, said", [
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, ["--kill-on-bad-exit=1"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "RANK": "0", "WORLD_SIZE": "4"},
     ["--kill-on-bad-exit=1", "WORLD_SIZE=4 was set by hand, but SLURM_STEP_NUM_TASKS=2 processes were started"]),
    ({"OMPI_COMM_WORLD_SIZE": "3", "RANK": "0", "WORLD_SIZE": "4"},
     ["WORLD_SIZE=4 was set by hand, but OMPI_COMM_WORLD_SIZE=3 processes"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "4"}, []),
    ({}, []),
], ids=["srun", "srun_world_size_by_hand", "mpirun_world_size_by_hand", "torchrun_in_srun", "none"])
def test_a_wait_in_init_adds_what_the_scheduler_says(environ, said):
    from ddpkit.runtime.env import detect
    from ddpkit.runtime.rendezvous import _scheduler_hints

    env = detect({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
                 if "RANK" in environ else {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    hints = _scheduler_hints(env, environ)
    assert all(s in hints for s in said) and bool(hints) == bool(said), hints
