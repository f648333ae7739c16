"""``ddpkit.init()`` / ``ddpkit.shutdown()``: the one place that turns a ``DistEnv`` into a process group.

A world of one (``python train.py``) gets a real Gloo group over an in-process store: no network, yet
ddpkit's collectives and plain ``torch.distributed`` calls in user code work unchanged. A larger world
rendezvouses on a TCPStore at MASTER_ADDR:MASTER_PORT with a deadline, and a rendezvous that cannot
complete says how many ranks arrived and where they were looking.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import time
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ddpkit.errors import LauncherVariableError, NotInitializedError, explain
from ddpkit.runtime.env import DistEnv, detect
from ddpkit.runtime.environments.threads import thread_share
from ddpkit.runtime.hangs import session as hangs
from ddpkit.runtime.init_settings import (
    DEFAULT_TIMEOUT,
    as_timedelta,
    beside_group,
    check_same_backend,
    check_same_settings,
    choose_backend,
    choose_device,
)
from ddpkit.runtime.refusal import tell_the_job
from ddpkit.runtime.rendezvous import rendezvous

__all__ = [
    "DEFAULT_TIMEOUT",
    "init",
    "shutdown",
    "current_env",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "is_main_process",
]

# What init() set up, so that a second init() returns it and shutdown() knows what to destroy.
_state: dict[str, Any] = {"env": None, "pid": None}  # init()'s DistEnv, and the process that made it
_watch: list[hangs.HangWatch | None] = [None]  # the recorder and watchdog of that group
_chosen: dict[str, object] = {}  # that init()'s timeout, stall_timeout and check_collectives

_SETTLE_SECONDS = 0.05
"""How long the exit handler lets collective threads finish their last release (see below)."""


def _let_collective_threads_settle() -> None:
    """At exit, while the interpreter is whole: let Gloo's threads drop what they still hold.

    A Gloo thread releases a finished collective's work, and with it the last reference to tensors
    whose Python objects torch keeps alive for C++ (or to backward's context), a moment after the
    collective returns. Should that moment fall inside interpreter finalization, taking the GIL to
    free them kills the process ("terminate called without an active exception"), as in a script
    whose last act is a collective (a checkpoint's broadcast). Sleeping releases the GIL to those
    threads before finalization begins: see Note [Private autograd calls] in docs/design.md.
    """
    time.sleep(_SETTLE_SECONDS)


def init(backend: str | None = None, timeout: float | timedelta | None = None,
         stall_timeout: float | None = None, check_collectives: bool | None = None) -> DistEnv:
    """Join the job this process was launched into (idempotent) and return its ``DistEnv``.

    A repeated call returns the first one's ``DistEnv``; an argument it passes must agree with the
    first call's settings (else ValueError): ``shutdown()`` first to change them.

    Args:
        backend: "nccl", "gloo", ...; default NCCL when CUDA is usable, else Gloo (also read from
            ``DDPKIT_BACKEND``).
        timeout: seconds or a timedelta for the rendezvous and for every collective; by default 5
            minutes for the rendezvous and torch's default for collectives (30 minutes, NCCL's 10).
        stall_timeout: seconds a collective may wait before every rank reports where it is, and a
            certain deadlock ends the job with exit code ``ddpkit.HANG_EXIT_CODE``; default
            ``DDPKIT_STALL_TIMEOUT`` or 60; 0 turns the watchdog off.
        check_collectives: compare every collective's op, reduction, dtype, shape and call site across
            ranks before it runs (default ``DDPKIT_CHECK_COLLECTIVES``, off).

    Returns:
        The detected ``DistEnv`` with ``backend`` (None in the single-process fallback) and ``device``
        (``cuda:<local_rank>`` or ``cpu``) filled in.

    Raises:
        LauncherVariableError: contradictory launcher variables (a ValueError).
        ValueError: an unknown backend, a bad timeout or stall_timeout (naming the variable), a
            check_collectives that is not a bool (``"false"`` would have been true), or
            settings other than those of this process's earlier ``init()``.
        RendezvousError: the rendezvous did not complete within ``timeout`` (a RuntimeError).
    """
    given = {"timeout": timeout, "stall_timeout": stall_timeout, "check_collectives": check_collectives}
    timeout = as_timedelta(timeout)
    collective_timeout = None if given["timeout"] is None else timeout  # None: torch's default
    settings = hangs.read_settings(stall_timeout, check_collectives, os.environ)
    chosen = {"timeout": collective_timeout or default_pg_timeout, "stall_timeout": settings.stall_timeout,
              "check_collectives": settings.check_collectives}
    if _state["env"] is not None and dist.is_initialized():
        check_same_backend(backend)
        check_same_settings({k: chosen[k] for k, v in given.items() if v is not None}, _chosen)
        return _state["env"]
    store = None
    if dist.is_initialized():
        env = _adopt_existing_group()
    else:
        try:
            env, backend = _plan(os.environ, backend)
        except LauncherVariableError as e:
            tell_the_job(os.environ, e)  # the ranks waiting for this one raise it too
            raise
        _take_share_of_cores(env)
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)
        if env.world_size == 1:
            # A world of one needs no network: an in-process store is enough. With NCCL, Gloo
            # serves CPU tensors too, so user code may reduce tensors on either device.
            hook = sys.excepthook
            dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
                                    store=dist.HashStore(), rank=0, world_size=1, timeout=collective_timeout)
            if env.launcher == "single":  # no ranks to tell apart: no "[rank0]: " before every traceback line
                sys.excepthook = hook
        else:
            _dump_stacks_on_fatal_signals()
            store = rendezvous(env, timeout, notice_after=settings.stall_timeout)
            # from here the store waits as long as a collective: strict mode's checks go through it
            store.set_timeout(collective_timeout or default_pg_timeout)
            dist.init_process_group(backend, store=store, rank=env.rank,
                                    world_size=env.world_size, timeout=collective_timeout)
        atexit.unregister(_let_collective_threads_settle)  # once, however often init() runs
        atexit.register(_let_collective_threads_settle)
    if _watch[0] is not None:  # the group it watched was destroyed behind shutdown()'s back
        _watch[0].end()
    _watch[0] = hangs.start(env.rank, env.world_size, store, settings)
    _state["env"], _state["pid"] = env, os.getpid()
    _chosen.clear()
    _chosen.update(chosen)
    return env


def _dump_stacks_on_fatal_signals() -> None:
    """Python's stacks on stderr when native code aborts or crashes (``faulthandler``), as
    ``python -X faulthandler`` would: Gloo aborts the process when ranks send tensors of different
    sizes to one collective, and without this the user sees Gloo's message but not which line of
    theirs made the call. Left as it is when already on, or when stderr has no file descriptor."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except (AttributeError, OSError, ValueError):  # stderr replaced (a notebook, a capture)
        pass


def shutdown() -> None:
    """Destroy the process group ``init()`` created; safe to call twice or without ``init()``.

    In a child of ``os.fork()`` it only forgets the group: the group, its connections included,
    is the parent rank's, which goes on."""
    if _state.get("pid") not in (None, os.getpid()):
        _watch[0], _state["env"], _state["pid"] = None, None, None
        return
    watch, _watch[0] = _watch[0], None
    if watch is not None:  # first: ranks still waiting for this one learn that it left, and from where
        watch.end("shutdown", hangs.where_called())
    if dist.is_initialized():
        dist.destroy_process_group()
    _state["env"] = None


def current_env() -> DistEnv | None:
    """The ``DistEnv`` returned by ``init()``, or None before it."""
    return _state["env"]


def is_initialized() -> bool:
    return dist.is_initialized()


def require_group_when_launched(what: str, consequence: str) -> None:
    """Raise if a launcher started several processes but ``init()`` has not joined them yet.

    Without a process group each rank would act as a world of one, quietly on its own.

    Raises:
        NotInitializedError: the launcher started several processes (a RuntimeError, and a
            ValueError as torch's "Default process group has not been initialized" is).
    """
    if dist.is_available() and dist.is_initialized():
        return
    launched = detect(os.environ)
    if launched.world_size > 1:
        raise NotInitializedError(
            explain(f"this process is rank {launched.rank} of WORLD_SIZE={launched.world_size} "
                    f"(launcher: {launched.launcher}), but no process group exists (Default process group "
                    f"has not been initialized), so {consequence}.",
                    "call ddpkit.init() first (or torch.distributed.init_process_group()).", who=what),
            needed_by=what, rank=launched.rank, world_size=launched.world_size, launcher=launched.launcher)


def get_rank() -> int:
    """This process's rank: from the process group once initialized, else from the environment."""
    return dist.get_rank() if dist.is_initialized() else detect(os.environ).rank


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else detect(os.environ).world_size


def get_local_rank() -> int:
    """This process's rank on its node: the launcher's, else LOCAL_RANK (an mp.spawn script may set it
    to pick its GPU before it makes its group), else 0."""
    return (_state["env"] or beside_group(os.environ)).local_rank


def is_main_process() -> bool:
    """True on rank 0 (and in a single process): the one that prints, logs and saves."""
    return get_rank() == 0


# --------------------------------------------------------------------------------------------------


def planned_env(environ: Mapping[str, str]) -> DistEnv:
    """The DistEnv ``init()`` would return in this environment (backend and device included), without
    joining anything: what ``ddpkit env`` prints. Raises the ValueError ``init()`` would raise for a
    variable, ``DDPKIT_STALL_TIMEOUT`` and ``DDPKIT_CHECK_COLLECTIVES`` included."""
    hangs.read_settings(None, None, environ)
    return _plan(environ, None)[0]


def _plan(environ: Mapping[str, str], backend: str | None) -> tuple[DistEnv, str]:
    """The DistEnv ``init()`` returns, and the backend its group is made with (a world of one started
    without a launcher has one, though its DistEnv reports None)."""
    env = detect(environ)
    from_environment = not backend and bool(environ.get("DDPKIT_BACKEND"))
    backend = choose_backend(backend or environ.get("DDPKIT_BACKEND") or None,
                              "DDPKIT_BACKEND" if from_environment else "backend")
    device = choose_device(backend, env)
    return env.replace(backend=None if env.launcher == "single" else backend, device=device), backend


def _take_share_of_cores(env: DistEnv) -> None:
    """Under srun/mpirun, unless OMP_NUM_THREADS is set: torch threads = cores // local ranks."""
    threads = thread_share(env.launcher, env.local_world_size, os.environ)
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # for the processes this rank starts




def _adopt_existing_group() -> DistEnv:
    """The user called ``torch.distributed.init_process_group`` already: describe that group.

    Without a launcher's variables (the tutorials' ``mp.spawn``), the launcher is given as
    "torchrun", whose kind of rendezvous (MASTER_ADDR, MASTER_PORT) such a script uses; where that
    rendezvous is on this host (a loopback address), every rank is too, so a rank's local rank is
    its rank. Elsewhere, and without LOCAL_RANK, the layout is unknown: local rank 0 of 1."""
    env = beside_group(os.environ)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if env.world_size != world_size:
        env = env.replace(launcher="torchrun")
        if "LOCAL_RANK" not in os.environ and _rendezvous_on_this_host():
            env = env.replace(local_rank=rank, local_world_size=world_size, node_rank=0)
    return env.replace(rank=rank, world_size=world_size, backend=backend, device=device)


def _rendezvous_on_this_host() -> bool:
    """Whether the default group's store is on a loopback address, or in this process (a world of one)."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # torch wraps it in PrefixStores
        store = store.underlying_store
    if isinstance(store, dist.HashStore):
        return True
    host = getattr(store, "host", None) if isinstance(store, dist.TCPStore) else None
    return host is not None and (host == "localhost" or host.startswith("127.") or host == "::1")

