"""Buckets: the flat buffer, its views, and the order a comm hook sees (torch's GradBucket's)."""
from __future__ import annotations

import inspect
import sys

import pytest
import torch
import torch.distributed as dist

from ddpkit.ddp.arguments import bucket_caps as _bucket_caps
from ddpkit.ddp.bucket import BIG_PARAM_NUMEL, DEFAULT_FIRST_BUCKET_BYTES, Bucket, factor
from ddpkit.ddp.bucket_groups import assign_buckets, initial_groups, rebuilt_groups
from ddpkit.ddp.distributed import DistributedDataParallel


def _bucket() -> Bucket:
    sizes = (3, BIG_PARAM_NUMEL, 5, BIG_PARAM_NUMEL + 1)  # small and big mixed: the layout reorders
    params = [torch.nn.Parameter(torch.full((n,), float(i))) for i, n in enumerate(sizes)]
    return Bucket(0, params, [10, 11, 12, 13], is_last=True)


def test_a_hook_sees_the_parameters_in_the_order_given_whatever_the_memory_layout():
    bucket = _bucket()
    assert [p.numel() for p in bucket.parameters()] == [3, BIG_PARAM_NUMEL, 5, BIG_PARAM_NUMEL + 1]
    assert [g.shape for g in bucket.gradients()] == [p.shape for p in bucket.parameters()]
    assert all(g.untyped_storage().data_ptr() == bucket.buffer().untyped_storage().data_ptr()
               for g in bucket.gradients())


def test_a_joined_ranks_zero_bucket_lists_its_parameters_as_the_active_ranks_do():
    bucket = _bucket()
    zeros = bucket.zeros_like()
    assert [p is q for p, q in zip(zeros.parameters(), bucket.parameters())] == [True] * 4
    assert [g.shape for g in zeros.gradients()] == [g.shape for g in bucket.gradients()]
    assert zeros.buffer().count_nonzero() == 0 and zeros.flat.numel() == bucket.flat.numel()


# ---- which parameters share a bucket ---------------------------------------------------------------


def _tensors(seed: int, count: int = 40) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.float16, torch.float64)
    return [torch.empty(int(torch.randint(1, 3000, (1,), generator=gen)),
                        dtype=dtypes[int(torch.randint(0, 3, (1,), generator=gen))])
            for _ in range(count)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("first_cap, cap", [(1024, 8192), (8192, 8192), (100, 100), (5000, 3000)])
def test_buckets_are_grouped_as_torchs_ddp_groups_them(seed, first_cap, cap):
    """Reference: torch's own assignment, fed the tensors in gradient-ready order."""
    params = _tensors(seed)
    order = torch.randperm(len(params), generator=torch.Generator().manual_seed(seed)).tolist()
    expected, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], [first_cap, cap])
    assert assign_buckets(params, order, cap, first_cap) == [[order[i] for i in b] for b in expected]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rebuilt_later", [True, False])
def test_with_a_comm_hook_the_first_buckets_are_torchs(seed, rebuilt_later):
    """torch 2.13: one bucket per dtype until the rebuild; without one, registration-order groups
    with a small first limit, launched last first."""
    params = _tensors(seed)
    limits = [sys.maxsize] if rebuilt_later else [1024, 8192]
    expected, _ = dist._compute_bucket_assignment_by_size(params, limits)
    got = initial_groups(params, 8192, 1024, hooked=True, rebuilt_later=rebuilt_later)
    assert got == list(reversed(expected))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("first_cap, cap", [(1024, 8192), (100, 100), (sys.maxsize, sys.maxsize)])
def test_with_a_comm_hook_the_rebuilt_buckets_are_torchs_in_torchs_order(seed, first_cap, cap):
    """torch's rebuild, fed the gradient-ready order: buckets in the order they close, then those of
    each dtype left open, in the reverse of the order the dtypes first came (what a hook's index()
    and is_last() show)."""
    params = _tensors(seed, count=12)
    order = torch.randperm(len(params), generator=torch.Generator().manual_seed(seed)).tolist()
    expected, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], [first_cap, cap],
                                                          [False] * len(params), order)
    assert rebuilt_groups(params, order, cap, first_cap, hooked=True) == expected


def test_on_cpu_without_a_hook_every_bucket_fills_to_the_cap():
    params = [torch.empty(256) for _ in range(8)]  # 1 KiB each
    assert initial_groups(params, 4096, 1024, hooked=False, rebuilt_later=True) == [[4, 5, 6, 7], [0, 1, 2, 3]]
    assert rebuilt_groups(params, list(range(8)), 4096, 1024, hooked=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rebuilt_groups(params, list(range(8)), 4096, 1024, hooked=True) == [[0], [1, 2, 3, 4], [5, 6, 7]]


def test_a_tensor_over_the_cap_gets_a_bucket_of_its_own():
    params = [torch.empty(n) for n in (10, 5000, 10, 10)]  # 40 and 20000 bytes
    assert assign_buckets(params, [3, 2, 1, 0], cap_bytes=100) == [[3, 2, 1], [0]]


def test_torchs_small_first_bucket_comes_with_the_default_cap_only():
    mib = 1024 * 1024
    assert _bucket_caps(None) == (25 * mib, DEFAULT_FIRST_BUCKET_BYTES)
    default = inspect.signature(DistributedDataParallel).parameters["bucket_cap_mb"].default
    assert default is None  # torch 2.13's signature, as API.md says
    assert _bucket_caps(25) == (25 * mib, 25 * mib)  # a 25 the caller chose, as in torch
    assert _bucket_caps(0.5) == (mib // 2, mib // 2)  # a cap of the user's own
    assert _bucket_caps(0) == (1, 1)  # one bucket per parameter
    layers = [torch.empty(64 * 64) for _ in range(200)]  # 3.2 MiB in 16 KiB tensors
    order = list(reversed(range(200)))
    assert [len(b) for b in assign_buckets(layers, order, *_bucket_caps(None))] == [64, 136]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64])
def test_the_scale_as_a_tensor_gives_the_bits_of_the_python_float(dtype):
    """The buckets multiply by ``factor(1 / world_size)``, as torch's reducer multiplies by the float."""
    grad = torch.randn(4099, dtype=dtype) * 3.7
    for world_size in (2, 3, 6, 7, 1000):
        scale = 1.0 / world_size
        assert torch.equal(torch.mul(grad, factor(scale)), torch.mul(grad, scale))
        assert torch.equal(grad.clone().mul_(factor(scale)), grad.clone().mul_(scale))
        assert torch.mul(grad, factor(scale)).dtype == dtype
