"""The CPU time a cgroup allows this process, in cores: ``docker --cpus 2`` or a Kubernetes CPU limit.

Such a quota leaves the affinity mask alone: a container limited to 2 CPUs on a 64-core host still
sees 64 cores there, and ranks that each took a share of 64 would spend most of their time throttled.
cgroup v2 writes the limit as ``cpu.max`` ("quota period", or "max ..."), v1 as ``cpu.cfs_quota_us``
and ``cpu.cfs_period_us`` (-1: none). A limit on any ancestor cgroup applies too, so every level from
the process's own cgroup up to the mount's root is read, and the smallest limit wins.
"""
from __future__ import annotations

import os
from typing import Iterator

__all__ = ["cgroup_cpu_quota"]

_V2_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
_V1_MOUNTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpuacct,cpu")


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", fs_root: str = "") -> float | None:
    """The cores' worth of CPU time this process's cgroups allow (2.5 for ``--cpus 2.5``), or None
    where no quota is set or none can be read. ``fs_root`` prefixes every path (for tests)."""
    try:
        with open(fs_root + proc_cgroup) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except (OSError, ValueError):  # ValueError: bytes that are not text
        return None
    limits: list[float] = []
    for _, controllers, path in entries:
        if controllers == "":  # cgroup v2's single hierarchy
            for directory in _levels(fs_root, _V2_MOUNTS, path):
                limits += _read_v2(directory)
        elif "cpu" in controllers.split(","):
            for directory in _levels(fs_root, _V1_MOUNTS, path):
                limits += _read_v1(directory)
    return min(limits) if limits else None


def _levels(fs_root: str, mounts: tuple[str, ...], path: str) -> Iterator[str]:
    """The cgroup's directory and its ancestors under each mount that exists. Inside a container the
    path may name the host's hierarchy, which is not mounted there; its root still is. A path that
    climbs out of this cgroup namespace (``/../other``) is outside the mount: its root alone is read."""
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        parts = []
    for mount in mounts:
        base = fs_root + mount
        if not os.path.isdir(base):
            continue
        for depth in range(len(parts), -1, -1):
            directory = os.path.join(base, *parts[:depth])
            if os.path.isdir(directory):
                yield directory


def _read_v2(directory: str) -> list[float]:
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return [] if quota == "max" or int(period) <= 0 else [int(quota) / int(period)]
    except (OSError, ValueError):
        return []


def _read_v1(directory: str) -> list[float]:
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read().strip())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read().strip())
        return [quota / period] if quota > 0 and period > 0 else []
    except (OSError, ValueError):
        return []
