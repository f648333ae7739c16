"""Whether a rank's Gloo threads have cores of their own beside backward: the CPU bucket layout
depends on it (see Notes [Bucket layout on CPU] and [Big gradients in place] in docs/design.md)."""
from __future__ import annotations

import os
from typing import Sequence

import torch

from ddpkit.runtime.environments.threads import available_cores, task_cores

__all__ = ["SPARE_CORES_CAP_BYTES", "cores_per_rank", "in_place_pays", "own_cpu_cap", "spare_cores_per_rank"]

SPARE_CORES_CAP_BYTES = 5 << 20
"""With spare cores and the default cap, buckets of small CPU gradients close at this size."""


def cores_per_rank(world_size: int) -> float:
    """This rank's share of the host's cores: under srun with ``--cpus-per-task``, that many (as for
    its threads, ``task_cores``); else the cores over the ranks on the host, and unsure how many
    share it, over all of them."""
    cores = available_cores()
    launcher, local_ranks = _launch(world_size)
    own = task_cores(launcher, os.environ, cores)
    return own if own is not None else cores / local_ranks


def spare_cores_per_rank(world_size: int) -> float:
    """This rank's share of the host's cores less its intra-op threads; below 1 when backward's
    threads fill every core."""
    return cores_per_rank(world_size) - torch.get_num_threads()


def _launch(world_size: int) -> tuple[str, int]:
    """The launcher, and how many ranks of this group run on this host."""
    try:
        from ddpkit.runtime.env import detect

        env = detect()
        if env.launcher != "single" and env.world_size == world_size:
            return env.launcher, max(1, env.local_world_size)
    except ValueError:  # launcher variables that contradict each other: init() reports those
        pass
    return "single", max(1, world_size)


def own_cpu_cap(params: Sequence[torch.Tensor], cap: int, first_cap: int, world_size: int) -> int:
    """The cap of ddpkit's own buckets of CPU ``params``: ``cap``; with the default cap (the one with a smaller
    first bucket) and a core to spare per rank, ``SPARE_CORES_CAP_BYTES``, so that buckets of small
    gradients launch during backward, where Gloo's threads then overlap it instead of preempting it.
    A heuristic: whatever goes wrong in it leaves the cap as it is, never the constructor failing."""
    if params[0].device.type != "cpu" or first_cap >= cap:
        return cap
    try:
        spare = spare_cores_per_rank(world_size)
    except Exception:  # noqa: BLE001 - an odd host must not stop training, nor one rank alone
        return cap
    return min(cap, SPARE_CORES_CAP_BYTES) if spare >= 1 else cap


def in_place_pays(world_size: int) -> bool:
    """Whether big CPU gradients are best reduced where they lie, each by a collective of its own
    launched during backward: where every rank has a core, or where all ranks take turns on one.
    With more ranks than cores, and more than one core, the extra collectives cost more CPU than
    the copies they save (measured, Note [Big gradients in place]). A heuristic: whatever goes
    wrong in it leaves the gradients in place."""
    try:
        return available_cores() <= 1 or cores_per_rank(world_size) >= 1
    except Exception:  # noqa: BLE001 - an odd host must not stop training, nor one rank alone
        return True
