"""Big gradients reduced where they lie: the layout that gives them a bucket of their own, and
the ``InPlaceBucket`` itself (see Note [Big gradients in place] in docs/design.md).

In process, on small CPU tensors with a threshold of a few bytes; the whole path is compared with
torch's DDP on several ranks by the ``in_place_*`` configurations of test_ddp.py.
"""
from __future__ import annotations

import pytest
import torch

from ddpkit.ddp.bucket import Bucket
from ddpkit.ddp.bucket_layout import BucketLayout


def _params(*sizes: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.full((n,), float(i))) for i, n in enumerate(sizes)]



def _in_place_layout(*sizes: int, **kwargs) -> BucketLayout:
    options = {"cap": 64, "as_view": False, "rebuild": True, "in_place_bytes": 32, **kwargs}
    cap = options.pop("cap")
    return BucketLayout(_params(*sizes), cap, cap, **options)


def test_a_big_gradient_gets_a_bucket_of_its_own_launched_as_soon_as_it_is_ready():
    from ddpkit.ddp.inplace_bucket import InPlaceBucket

    # reverse registration order is 4, 3, 2, 1, 0: the small ones fill one bucket, launched last
    layout = _in_place_layout(1, 8, 2, 8, 1)
    kinds = [(type(b).__name__, b.param_indices) for b in layout.buckets]
    assert kinds == [("InPlaceBucket", [3]), ("InPlaceBucket", [1]), ("Bucket", [0, 2, 4])]
    assert layout.buckets[-1].flag is not None and all(b.flag is None for b in layout.buckets[:-1])
    assert layout.big_slot == [None] * 5  # nothing is copied in by the gradient's own hook
    assert isinstance(layout.buckets[0], InPlaceBucket)


def test_the_last_bucket_is_never_in_place_it_carries_the_status_flag():
    layout = _in_place_layout(8, 8)
    assert [type(b).__name__ for b in layout.buckets] == ["InPlaceBucket", "Bucket"]


@pytest.mark.parametrize("kwargs", [{"as_view": True}, {"like_torch": True}, {"cap_list": (64,)},
                                    {"in_place_bytes": 0}], ids=str)
def test_no_gradient_is_reduced_in_place_where_the_buckets_must_be_torchs_or_views(kwargs):
    layout = _in_place_layout(1, 8, 2, 8, 1, **kwargs)
    assert all(type(b) is Bucket for b in layout.buckets)


def test_a_comm_hook_or_static_graph_turned_on_late_gets_buckets_without_in_place_ones():
    hooked = _in_place_layout(1, 8, 2, 8, 1)
    hooked.build_initial(hooked=True)
    late = _in_place_layout(1, 8, 2, 8, 1)
    late.expect_rebuild()
    for layout in (hooked, late):
        assert all(type(b) is Bucket for b in layout.buckets)


def test_an_in_place_bucket_scales_the_gradient_itself_and_stands_in_zeros_for_a_missing_one():
    layout = _in_place_layout(8, 8)
    bucket, param = layout.buckets[0], layout.params[1]
    param.grad = grad = torch.full((8,), 4.0)
    bucket.fill(0.5, False, [False, False])
    assert bucket.flat.data_ptr() == grad.data_ptr() and grad.tolist() == [2.0] * 8
    bucket.write_back(False, None)
    assert param.grad is grad
    layout.release()
    assert bucket.flat.numel() == 0 and bucket.grads == []
    param.grad = None
    bucket.fill(0.5, False, [False, False])
    assert bucket.flat.tolist() == [0.0] * 8
    bucket.write_back(False, [True, False])  # no rank used it: .grad stays None
    assert param.grad is None
    bucket.write_back(False, None)
    assert param.grad.tolist() == [0.0] * 8
