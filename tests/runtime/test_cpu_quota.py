"""A cgroup CPU quota narrows the cores a rank takes a share of (docker --cpus, Kubernetes limits)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.launch.config import resolve_nproc_per_node
from ddpkit.launch.workers import Placement, worker_env
from ddpkit.runtime.environments import threads
from ddpkit.runtime.environments.cpu_quota import cgroup_cpu_quota


def _write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def _write_v1(root: Path, directory: str, quota: int, period: int = 100000) -> None:
    _write(root, f"{directory}/cpu.cfs_quota_us", f"{quota}\n")
    _write(root, f"{directory}/cpu.cfs_period_us", f"{period}\n")


def _quota(root: Path) -> float | None:
    return cgroup_cpu_quota(fs_root=str(root))


def test_cgroup_v2_quota_of_the_process_cgroup(tmp_path):
    _write(tmp_path, "/proc/self/cgroup", "0::/kubepods/pod1/c1\n")
    _write(tmp_path, "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max", "250000 100000\n")
    assert _quota(tmp_path) == 2.5


def test_the_smallest_limit_of_any_ancestor_wins(tmp_path):
    _write(tmp_path, "/proc/self/cgroup", "0::/job/step\n")
    _write(tmp_path, "/sys/fs/cgroup/job/step/cpu.max", "max 100000\n")
    _write(tmp_path, "/sys/fs/cgroup/job/cpu.max", "300000 100000\n")
    _write(tmp_path, "/sys/fs/cgroup/cpu.max", "800000 100000\n")
    assert _quota(tmp_path) == 3.0


def test_no_quota_set_or_none_readable_gives_none(tmp_path):
    assert _quota(tmp_path) is None  # no /proc/self/cgroup at all
    _write(tmp_path, "/proc/self/cgroup", "0::/\n")
    assert _quota(tmp_path) is None  # no cpu.max (the root cgroup has none)
    _write(tmp_path, "/sys/fs/cgroup/cpu.max", "max 100000\n")
    assert _quota(tmp_path) is None
    _write(tmp_path, "/sys/fs/cgroup/cpu.max", "garbage\n")
    assert _quota(tmp_path) is None


def test_a_path_outside_the_cgroup_namespace_or_unreadable_text_reads_no_stranger(tmp_path):
    _write(tmp_path, "/proc/self/cgroup", "0::/../other\n")
    _write(tmp_path, "/sys/fs/cgroup/other/cpu.max", "100000 100000\n")  # another cgroup of that name
    assert _quota(tmp_path) is None
    _write(tmp_path, "/sys/fs/cgroup/cpu.max", "300000 100000\n")
    assert _quota(tmp_path) == 3.0
    (tmp_path / "proc/self/cgroup").write_bytes(b"0::/\xff\xfe\n")
    assert _quota(tmp_path) is None


def test_cgroup_v1_quota_and_a_host_path_not_mounted_in_the_container(tmp_path):
    # inside a container /proc/self/cgroup names the host's hierarchy; the container sees its own root
    _write(tmp_path, "/proc/self/cgroup", "4:cpu,cpuacct:/docker/0123abcd\n2:memory:/docker/0123abcd\n")
    _write_v1(tmp_path, "/sys/fs/cgroup/cpu,cpuacct", 150000)
    assert _quota(tmp_path) == 1.5
    _write_v1(tmp_path, "/sys/fs/cgroup/cpu,cpuacct", -1)
    assert _quota(tmp_path) is None


def test_hybrid_hierarchy_reads_the_unified_mount(tmp_path):
    _write(tmp_path, "/proc/self/cgroup", "1:cpu:/\n0::/user.slice\n")
    _write_v1(tmp_path, "/sys/fs/cgroup/cpu", -1)
    _write(tmp_path, "/sys/fs/cgroup/unified/user.slice/cpu.max", "200000 100000\n")
    assert _quota(tmp_path) == 2.0


@pytest.mark.parametrize("quota, expected", [(None, 16), (2.5, 2), (0.3, 1), (64.0, 16)])
def test_available_cores_takes_the_quota_whole_cores_at_least_one(monkeypatch, quota, expected):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: quota)
    assert threads.available_cores() == expected


def test_ddpkit_run_shares_out_the_quota_not_the_affinity_mask(monkeypatch):
    """64 visible cores and a 4-CPU limit: 2 threads per worker, not 32 (each would be throttled)."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: 4.0)
    place = Placement(rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0, nnodes=1)
    env = worker_env({}, place, master_addr="h", master_port=5, attempt=0, max_restarts=0, run_id="r")
    assert env["OMP_NUM_THREADS"] == "2"
    assert resolve_nproc_per_node("cpu") == 4
