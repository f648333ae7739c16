"""What ``init()`` makes of its arguments and of a group it finds: the timeout, the backend, the
device, a repeated call's settings, and how a group the user made is described.

Kept apart from ``process_group`` so that the module that creates and destroys the group reads as
that sequence; everything here is a pure function of its arguments and the environment.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from ddpkit.errors import LauncherVariableError, explain
from ddpkit.runtime.env import DistEnv, launched
from ddpkit.runtime.environments.variables import read_optional_int

__all__ = ["DEFAULT_TIMEOUT", "as_timedelta", "choose_backend", "check_same_backend", "check_same_settings",
           "choose_device", "beside_group"]

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long a rendezvous may wait when ``init()`` is given no timeout. Collectives then keep torch's
own default (30 minutes, NCCL's 10): a rank that is merely slow (an evaluation on rank 0, a long
save) must not end a job that runs under torch, and the hang report explains it after
``stall_timeout`` anyway."""

_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def as_timedelta(timeout: float | timedelta | None) -> timedelta:
    """``init()``'s timeout as a timedelta (None: the rendezvous default); a bad one names itself."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        if timeout <= timedelta(0):
            raise ValueError(explain(f"timeout={timeout!r} must be a positive duration.",
                                     "pass e.g. timedelta(minutes=10), or None for the defaults."))
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
        raise ValueError(explain(f"timeout={timeout!r} must be a positive, finite number of seconds or a "
                                 "timedelta.", "pass e.g. timeout=600, or None for the defaults."))
    return timedelta(seconds=timeout)


def choose_backend(backend: str | None, named: str = "backend") -> str:
    """``named``: where ``backend`` came from, for the error (init's argument or DDPKIT_BACKEND)."""
    if backend is None:
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    backend = _named_backend(backend, named).lower()
    if backend not in _BACKENDS:
        raise ValueError(f"{named}={backend!r} is not one of {_BACKENDS}.")
    available = getattr(dist, f"is_{backend}_available", None)
    if backend in ("mpi", "ucc", "xccl") and available is not None and not available():
        raise ValueError(explain(f"{named}={backend!r}, but this build of torch has no {backend} backend "
                                 f"(torch.distributed.is_{backend}_available() is False).", f"use {named}='gloo'."))
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(explain(f"{named}='nccl' needs CUDA, and torch.cuda.is_available() is False.",
                                 f"use {named}='gloo' on CPU."))
    return backend


def _named_backend(backend: object, named: str) -> str:
    if not isinstance(backend, str):
        raise ValueError(f"{named}={backend!r} must be a string, one of {_BACKENDS}.")
    return backend


def check_same_backend(backend: str | None) -> None:
    """A repeated ``init()`` returns the first one's group: it must not silently ignore a new backend."""
    if backend is None or not dist.is_initialized():
        return
    _named_backend(backend, "backend")
    current = str(dist.get_backend()).lower()
    if backend.lower() not in current.replace(":", ",").split(","):
        raise ValueError(explain(
            f"ddpkit.init(backend={backend!r}) but this process's group, made by an earlier init(), uses "
            f"backend {current!r} (a world of one too gets a Gloo group, over an in-process store).",
            "call ddpkit.shutdown() first to change the backend."))


def check_same_settings(given: dict[str, object], first_chosen: Mapping[str, object]) -> None:
    """A repeated ``init()`` keeps the first one's settings (``first_chosen``): an argument that asks
    for others raises."""
    for name, value in given.items():
        first = first_chosen.get(name, value)
        if value != first:
            raise ValueError(explain(
                f"ddpkit.init({name}={_shown(value)}) but this process already joined with {name}={_shown(first)}.",
                f"call ddpkit.shutdown() first to change it, or leave {name} out to keep it."))


def _shown(value: object) -> str:
    return f"{value.total_seconds():g}s" if isinstance(value, timedelta) else repr(value)


def choose_device(backend: str, env: DistEnv) -> torch.device:
    """``cuda:<local rank>`` for a CUDA backend, else the CPU; a local rank without its GPU raises."""
    if backend != "gloo" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise LauncherVariableError(
                explain(f"LOCAL_RANK={env.local_rank} but this node has only {count} visible GPU(s).",
                        "start at most one process per GPU (--nproc-per-node), or check CUDA_VISIBLE_DEVICES."),
                variable="LOCAL_RANK", value=str(env.local_rank))
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def beside_group(environ: Mapping[str, str]) -> DistEnv:
    """The launcher's view of a group the user made; without a launcher (mp.spawn), LOCAL_RANK's."""
    env = launched(environ)
    if env is not None:
        return env
    local_rank = read_optional_int(environ, "LOCAL_RANK") or 0
    local_world_size = max(read_optional_int(environ, "LOCAL_WORLD_SIZE", minimum=1) or 1, local_rank + 1)
    return DistEnv(local_rank=local_rank, local_world_size=local_world_size)
