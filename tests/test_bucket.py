"""Buckets: the flat buffer, its views, and the order a comm hook sees (torch's GradBucket's)."""
from __future__ import annotations

import torch

from ddpkit.bucket import BIG_PARAM_NUMEL, Bucket


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
