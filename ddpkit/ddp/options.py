"""DistributedDataParallel's newer arguments as torch 2.13 resolves them.

The process group or a 1-D ``DeviceMesh`` standing for one; buffer syncing (``broadcast_buffers``,
deprecated, and ``forward_sync_buffers``, which leaves the construction-time sync alone); the
per-bucket caps; and the deprecated ``check_reduction``. Each rule and each warning is torch's,
worded with the argument and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist

from ddpkit.ddp.errors import warn_at_user_code
from ddpkit.ddp.state_sync import default_group
from ddpkit.errors import explain

__all__ = ["BufferSync", "bucket_cap_list", "check_delay_pair", "resolve_buffer_sync",
           "resolve_group", "warn_check_reduction"]

_MIB = 1024 * 1024
_WHO = "DistributedDataParallel"


@dataclass(frozen=True)
class BufferSync:
    """When buffers are broadcast from rank 0: before each forward (and after join), and at construction."""

    forward: bool
    init: bool


def resolve_group(process_group: Any, device_mesh: Any) -> Any:
    """The group DDP averages over: ``process_group``, the one group of a 1-D ``device_mesh``, or the
    default group (None in a world of one); torch refuses both at once."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError(explain("Cannot specify both process_group and device_mesh arguments.",
                                   "pass one: a 1-D DeviceMesh stands for its process group.", who=_WHO))
    if device_mesh is None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            outside = isinstance(process_group, int) and process_group == getattr(dist.GroupMember,
                                                                                  "NON_GROUP_MEMBER", None)
            raise TypeError(explain(
                f"process_group must be a torch.distributed.ProcessGroup, or None for the default group; "
                f"got {type(process_group).__name__} {process_group!r:.60}"
                + (", what dist.new_group(ranks) returns on a rank outside ranks." if outside else "."),
                "wrap the model only on the group's ranks." if outside else
                "pass None (ddpkit.init() or init_process_group() made the default group), or a group "
                "from dist.new_group(ranks); a backend name goes to init_process_group(backend=...).",
                who=_WHO))
        return default_group() if process_group is None else process_group
    if device_mesh.ndim != 1:
        raise RuntimeError(explain(
            f"Only 1D device mesh is supported, but got {device_mesh} ({device_mesh.ndim} dimensions).",
            "pass the data-parallel slice, e.g. device_mesh=mesh['dp'].", who=_WHO))
    return device_mesh.get_group(mesh_dim=0)


def resolve_buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> BufferSync:
    """torch's resolution: ``forward_sync_buffers`` wins and leaves the construction sync on;
    ``broadcast_buffers`` (deprecated, with torch's FutureWarning) steers both; neither: both on."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            message = ("Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` "
                       "is deprecated and its value is ignored when `forward_sync_buffers` is provided.")
        else:
            message = ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: "
                       "unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at "
                       "init. If you rely on buffers NOT being synced at init (e.g. rank-local buffers), keep "
                       "using `broadcast_buffers=False` until `init_sync_buffers` is available.")
        warn_at_user_code(message, FutureWarning)
    if forward_sync_buffers is not None:
        return BufferSync(forward=bool(forward_sync_buffers), init=True)
    both = True if broadcast_buffers is None else bool(broadcast_buffers)
    return BufferSync(forward=both, init=both)


def warn_check_reduction(check_reduction: bool) -> None:
    """torch's warning: the reducer always completes the reduction, so the flag does nothing."""
    if check_reduction:
        warn_at_user_code("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                          "Please avoid using it.", FutureWarning)


def bucket_cap_list(bucket_cap_mb_list: Sequence[float] | None) -> tuple[int, ...]:
    """``bucket_cap_mb_list`` in bytes: the k-th bucket of each device and dtype closes at the k-th
    cap, the last one repeating; empty: none given (torch treats ``[]`` as None)."""
    if not bucket_cap_mb_list:
        return ()
    for cap in bucket_cap_mb_list:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
            raise ValueError(explain(
                f"bucket_cap_mb_list={list(bucket_cap_mb_list)!r} holds {cap!r}, but each cap must be a "
                "number of MiB, 0 or more.", "e.g. bucket_cap_mb_list=[1, 25].", who=_WHO))
    return tuple(max(1, int(cap * _MIB)) for cap in bucket_cap_mb_list)


def check_delay_pair(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any) -> None:
    """torch's rule: the delayed parameters and the parameter whose gradient launches them come together."""
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        given = "delay_all_reduce_named_params" if param_to_hook_all_reduce is None else "param_to_hook_all_reduce"
        raise ValueError(explain(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time, "
            f"but only {given} was.", "pass both, e.g. param_to_hook_all_reduce=model[0].weight (a "
            "parameter whose gradient comes after the delayed ones'), or neither.", who=_WHO))

