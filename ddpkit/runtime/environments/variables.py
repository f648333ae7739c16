"""Reading launcher variables: strict integers, the first of several names, rank bounds, the port.

Every source reader parses the same kinds of values and must fail the same way, with the variable,
its value and a HINT; sharing these few functions keeps the messages identical across launchers.
All of them only read the mapping they are given. ``refuse`` is how every reader raises: a
``LauncherVariableError`` naming the variable to fix.
"""
from __future__ import annotations

import re
from typing import Mapping

from ddpkit.errors import LauncherVariableError, explain
from ddpkit.runtime.environments.dist_env import DEFAULT_MASTER_PORT

__all__ = ["read_int", "read_optional_int", "first_set", "check_rank", "check_local_size", "check_one_node",
           "read_master_port", "refuse"]


def refuse(variable: str, value: object, what: str, hint: str) -> LauncherVariableError:
    """The error for launcher variable ``variable`` (``value``: as read, or None when unset)."""
    return LauncherVariableError(explain(what, hint), variable=variable,
                                 value=None if value is None else str(value))


_INT_MAX = 2**31 - 1
"""torch takes ranks and sizes as C ints: a larger value fails deep in TCPStore's constructor."""


def read_int(environ: Mapping[str, str], name: str, minimum: int = 0, hint: str | None = None) -> int:
    """``environ[name]`` as an int of at least ``minimum``; ``hint``: the fix for a smaller one."""
    raw = environ[name]
    # int() would also take '1_0', '+1' and non-ASCII digits: a launcher writes none of them
    if re.fullmatch(r"-?[0-9]+", raw.strip()) is None:
        raise refuse(name, raw, f"{name}={raw!r} is not an integer.",
                     f"set {name} to plain decimal digits, or unset it.")
    value = int(raw.strip())
    if value < minimum:
        raise refuse(name, raw, f"{name}={value} must be >= {minimum}.",
                     hint or f"set {name} to a whole number >= {minimum}, or unset it.")
    if value > _INT_MAX:
        raise refuse(name, raw, f"{name}={value} is too large: torch takes it as a 32-bit integer, at most "
                     f"{_INT_MAX}.", hint or f"set {name} to the job's real count, or unset it.")
    return value


def read_optional_int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    return read_int(environ, name, minimum) if environ.get(name, "").strip() else None


def first_set(environ: Mapping[str, str], *names: str) -> str | None:
    return next((name for name in names if environ.get(name, "").strip()), None)


def check_rank(rank_name: str, rank: int, size_name: str, size: int, described: str | None = None,
               hint: str | None = None) -> None:
    """``rank`` must be in [0, size); ``described`` says where ``size`` came from when not ``size_name``."""
    if not 0 <= rank < size:
        raise refuse(rank_name, rank, f"{rank_name}={rank} is out of range for "
                     f"{described or f'{size_name}={size}'}: {rank_name} must be in [0, {size}).",
                     hint or f"the launcher and the job disagree on the number of processes; check {size_name}.")


def check_local_size(local_size_name: str, local_size: int, size_name: str, size: int, hint: str) -> None:
    """A node cannot hold more processes than the whole job."""
    if local_size > size:
        raise refuse(local_size_name, local_size,
                     f"{local_size_name}={local_size} is larger than {size_name}={size}: a node cannot hold "
                     "more processes than the whole job.", hint)


def check_one_node(rank_name: str, rank: int, local_name: str, local_rank: int,
                   local_world_size: int, world_size: int) -> None:
    """When every process of the job is on this node, its local rank is its rank.

    Two processes with one local rank would pick the same GPU.
    """
    if local_world_size == world_size and local_rank != rank:
        raise refuse(local_name, local_rank,
                     f"{local_name}={local_rank} differs from {rank_name}={rank}, but all {world_size} "
                     "processes of the job are on this node, where the local rank is the rank.",
                     f"check {local_name}; two processes with one local rank would share a GPU.")


def read_master_port(environ: Mapping[str, str], default: int) -> int:
    if "MASTER_PORT" not in environ:
        return default
    hint = f"set MASTER_PORT to a free TCP port in [1, 65535] on the host of rank 0, e.g. {DEFAULT_MASTER_PORT}."
    port = read_int(environ, "MASTER_PORT", minimum=1, hint=hint)
    if port > 65535:
        raise refuse("MASTER_PORT", environ["MASTER_PORT"],
                     f"MASTER_PORT={port} is not a TCP port: it must be in [1, 65535].", hint)
    return port
