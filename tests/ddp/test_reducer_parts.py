"""The reducer's parts that need no process group: iteration state, parameter usage, bucket layout.

In process, on small CPU tensors; the reducer as a whole is checked against torch's DDP on several
ranks in test_ddp.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.ddp.bucket import BIG_PARAM_NUMEL, Bucket
from ddpkit.ddp.bucket_groups import initial_groups
from ddpkit.ddp.bucket_layout import BucketLayout
from ddpkit.ddp.iteration import Iteration, Phase
from ddpkit.ddp.usage import ParameterUsage
from ddpkit.errors import CommHookError


def _params(*sizes: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.full((n,), float(i))) for i, n in enumerate(sizes)]


def _layout(*sizes: int, cap: int = 16, as_view: bool = False, rebuild: bool = True) -> BucketLayout:
    """Buckets of ``cap`` bytes: with sizes of 1 to 4 floats, a few parameters each."""
    return BucketLayout(_params(*sizes), cap, cap, as_view=as_view, rebuild=rebuild)


def _iteration(layout: BucketLayout, phase: Phase = Phase.IDLE, *, iterations: int = 0,
               usage: ParameterUsage | None = None, previous: Iteration | None = None) -> Iteration:
    usage = usage or ParameterUsage(len(layout.params), find_unused_parameters=False, static_graph=False)
    return Iteration(layout, usage, iterations, 0.5, phase, previous)


# ---- the phase of an iteration ---------------------------------------------------------------------


def test_a_synced_iteration_walks_from_idle_to_reducing_queueing_the_wait_once():
    it = _iteration(_layout(1, 2, 3))
    assert it.phase is Phase.IDLE
    it.arm(forward=1)
    assert (it.phase, it.window_start) == (Phase.ARMED, 1)
    assert it.reach_output() is True  # the first output reached queues the wait
    assert it.phase is Phase.QUEUED
    assert it.reach_output() is False  # a second output of the same backward does not
    assert it.begin_reducing() is False  # already queued
    assert it.phase is Phase.REDUCING


def test_a_backward_that_reaches_a_parameter_first_queues_the_wait_itself():
    it = _iteration(_layout(1, 2))
    it.arm(forward=1)
    assert it.begin_reducing() is True
    assert it.phase is Phase.REDUCING and it.reach_output() is False


def test_several_forwards_share_the_window_of_the_first():
    it = _iteration(_layout(1, 2), Phase.FINALIZED)
    it.late_warned = True
    it.arm(forward=4)
    it.arm(forward=5)
    assert (it.phase, it.window_start, it.late_warned) == (Phase.ARMED, 4, True)  # said once per DDP
    it.begin_reducing()
    it.arm(forward=6)  # arming again while reducing leaves it reducing
    assert (it.phase, it.window_start) == (Phase.REDUCING, 4)


@pytest.mark.parametrize("event, phase, after", [
    # a backward that reached no parameter (or failed first): armed again, nothing queued
    ("rearm", Phase.QUEUED, Phase.ARMED), ("rearm", Phase.ARMED, Phase.ARMED),
    ("rearm", Phase.IDLE, Phase.IDLE), ("rearm", Phase.FINALIZED, Phase.FINALIZED),
    ("rearm", Phase.REDUCING, Phase.REDUCING),
    # a forward without sync: a gradient now is a local one, not a late one
    ("disarm", Phase.FINALIZED, Phase.IDLE), ("disarm", Phase.ARMED, Phase.ARMED),
    ("disarm", Phase.IDLE, Phase.IDLE)])
def test_an_empty_backward_rearms_and_a_local_forward_disarms(event, phase, after):
    it = _iteration(_layout(1, 2), phase)
    getattr(it, event)()
    assert it.phase is after


@pytest.mark.parametrize("phase, fresh", [(Phase.IDLE, Phase.IDLE), (Phase.ARMED, Phase.ARMED),
                                          (Phase.QUEUED, Phase.ARMED), (Phase.REDUCING, Phase.ARMED),
                                          (Phase.FINALIZED, Phase.FINALIZED)])
def test_new_buckets_keep_an_open_window_open_with_nothing_queued_or_launched(phase, fresh):
    assert phase.on_new_buckets() is fresh


def test_a_new_iteration_counts_afresh_and_carries_the_forward_window():
    layout = _layout(1, 2, 3, 4)
    old = _iteration(layout, Phase.ARMED)
    old.window_start, old.late_warned = 7, True
    old.mark_unused([0, 3])
    new = _iteration(layout, Phase.FINALIZED, previous=old)
    assert (new.phase, new.window_start, new.late_warned) == (Phase.FINALIZED, 7, True)
    assert new.ready == [False] * 4 and new.used == [True] * 4 and new.pending == layout.counts
    assert new.pending is not layout.counts and new.next_bucket == 0 and new.works == []
    assert new.bucket_of is layout.bucket_of and new.record is layout.record


# ---- counting gradients into buckets ---------------------------------------------------------------


def test_unused_parameters_count_as_ready_once_and_release_their_buckets():
    layout = _layout(4, 4, 4, 4)  # one parameter per bucket
    it = _iteration(layout, Phase.REDUCING)
    it.mark_unused([2, 0, 2])
    assert it.ready == [True, False, True, False] and it.used == [False, True, False, True]
    assert [it.pending[layout.bucket_of[i]] for i in range(4)] == [0, 1, 0, 1]
    it.mark_ready([1, 2])  # counted hooks: used, and an already ready one stays as it is
    assert it.ready == [True, True, True, False] and it.used == [False, True, False, True]
    assert it.missing() == [3] and not it.all_launched()
    it.next_bucket = len(layout.buckets)
    assert it.all_launched()


def test_static_graph_counts_hooks_in_its_first_iteration_and_expects_them_later():
    layout = _layout(1, 2, 3)
    usage = ParameterUsage(3, find_unused_parameters=False, static_graph=True)
    first = _iteration(layout, usage=usage, iterations=0)
    assert (first.counting, first.tolerant, first.hooks_left) == (True, True, None)
    usage.hook_counts[:] = [2, 0, 1]
    later = _iteration(layout, usage=usage, iterations=1, previous=first)
    assert (later.counting, later.tolerant, later.hooks_left) == (False, False, [2, 0, 1])
    assert later.hooks_left is not usage.hook_counts  # counted down per iteration
    assert usage.counted() == [0, 2]


@pytest.mark.parametrize("find_unused, static_graph, iterations, tolerant",
                         [(False, False, 0, False), (True, False, 0, True), (True, False, 5, True),
                          (False, True, 0, True), (False, True, 1, False), (True, True, 1, True)])
def test_missing_gradients_are_tolerated_with_find_unused_or_in_static_graphs_first_iteration(
        find_unused, static_graph, iterations, tolerant):
    usage = ParameterUsage(2, find_unused_parameters=find_unused, static_graph=static_graph)
    assert _iteration(_layout(1, 2), usage=usage, iterations=iterations).tolerant is tolerant


# ---- which parameters an iteration uses ------------------------------------------------------------


def test_a_parameter_is_unused_only_if_no_forward_of_the_iteration_reaches_it():
    usage = ParameterUsage(6, find_unused_parameters=True, static_graph=False)
    usage.note_forward([1, 2, 3], iterations=0)
    usage.note_forward([2, 3, 4], iterations=0)
    assert usage.deferred_unused == [2, 3]
    usage.end_iteration(counted=True, counting=False)
    assert usage.deferred_unused is None
    usage.note_forward([5], iterations=1)
    assert usage.deferred_unused == [5]


def test_static_graph_marks_unused_what_its_first_iteration_left_unused():
    usage = ParameterUsage(3, find_unused_parameters=False, static_graph=True)
    usage.note_forward([0, 1, 2], iterations=0)  # the search result is not used: hooks are counted
    assert usage.deferred_unused is None
    usage.settle(torch.tensor([1, 0, 1], dtype=torch.int32), used=[True, False, True])
    assert usage.static_unused == [1] and usage.write_mask == [True, False, True]
    usage.end_iteration(counted=True, counting=True)
    usage.note_forward([], iterations=1)
    assert usage.deferred_unused == [1]


def test_the_used_map_includes_no_sync_steps_and_a_joined_rank_sends_the_last_one_again():
    usage = ParameterUsage(4, find_unused_parameters=True, static_graph=False)
    usage.used_locally[3] = True
    used_map = usage.used_map([True, False, False, False])
    assert used_map.tolist() == [1, 0, 0, 1] and used_map.dtype == torch.int32
    assert usage.shadow_used_map() is used_map  # reduced in place: the all-reduced map, next time
    usage.settle(torch.tensor([2, 0, 1, 1], dtype=torch.int32), used=[True, False, False, False])
    assert usage.write_mask == [True, False, True, True]
    usage.end_iteration(counted=True, counting=False)
    assert usage.used_locally == [False] * 4


def test_an_abandoned_first_static_graph_iteration_forgets_its_partial_hook_counts():
    usage = ParameterUsage(2, find_unused_parameters=False, static_graph=True)
    usage.hook_counts[:] = [1, 0]
    usage.used_locally[0] = True
    usage.end_iteration(counted=False, counting=True)
    assert usage.hook_counts == [0, 0] and usage.used_locally == [True, False]
    usage.hook_counts[:] = [1, 1]
    usage.end_iteration(counted=True, counting=True)
    assert usage.hook_counts == [1, 1]


# ---- the bucket layout -----------------------------------------------------------------------------


def test_the_layout_maps_each_parameter_to_its_bucket_and_flags_the_last_one():
    layout = _layout(2, 2, 2, 2, 2)  # 8 bytes each, 16-byte buckets
    groups = initial_groups(layout.params, 16, 16, hooked=False, rebuilt_later=True)
    assert [b.param_indices for b in layout.buckets] == groups
    assert [b.index() for b in layout.buckets] == list(range(len(groups)))
    for b in layout.buckets:
        assert all(layout.bucket_of[i] == b.index() for i in b.param_indices)
        assert (b.flag is not None) == b.is_last()
    assert layout.counts == [len(g) for g in groups] and layout.buckets[-1].is_last()


def test_a_big_gradient_gets_a_slot_in_its_bucket_and_with_bucket_views_every_gradient_does():
    sizes = (3, BIG_PARAM_NUMEL)
    layout = _layout(*sizes, cap=1 << 20)
    bucket = layout.buckets[0]
    assert layout.big_slot[0] is None
    slot = layout.big_slot[1]
    assert slot.shape == (BIG_PARAM_NUMEL,) and slot.data_ptr() == bucket.views[0].data_ptr()
    # with views, a gradient autograd allocated moves into its view as soon as it is ready
    viewed = _layout(*sizes, cap=1 << 20, as_view=True)
    bucket = viewed.buckets[0]
    assert [viewed.big_slot[i] for i in bucket.param_indices] == bucket.views


def test_off_the_cpu_no_gradient_is_big_and_the_bucket_keeps_the_order_given():
    """On a GPU every gradient waits for its bucket's one copy: a slot copied by each hook would be
    a kernel launch on backward's thread (Note [Big gradients]). "meta" stands in for the device."""
    sizes = (3, BIG_PARAM_NUMEL, 5, BIG_PARAM_NUMEL + 1)
    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in sizes]
    layout = BucketLayout(params, 1 << 20, 1 << 20, as_view=False, rebuild=True)
    bucket = layout.buckets[0]
    assert bucket.num_big == 0 and layout.big_slot == [None] * 4
    assert [id(p) for p in bucket.params] == [id(p) for p in params]  # the order given: no big ones first
    assert bucket.small_region.numel() == sum(sizes)
    on_cpu = _layout(*sizes, cap=1 << 20).buckets[0]
    assert on_cpu.num_big == 2 and [p.numel() for p in on_cpu.params[:2]] == [BIG_PARAM_NUMEL, BIG_PARAM_NUMEL + 1]


def test_the_buckets_of_a_one_block_device_share_one_block_each_from_an_aligned_start():
    """On CUDA the buckets share one block, so the allocator rounds it up once (Note [One block per
    device]); the CPU stands in for CUDA here, and by default keeps a block per bucket."""
    from ddpkit.ddp.bucket_layout import BLOCK_ALIGN_BYTES

    sizes = (3, 4, 1, 2, 4, 3)
    params = _params(*sizes)
    layout = BucketLayout(params, 16, 16, as_view=False, rebuild=True, one_block=("cpu",))
    buckets = layout.buckets
    assert len(buckets) > 2
    assert len({b.flat.untyped_storage().data_ptr() for b in buckets}) == 1
    starts = [b.flat.storage_offset() * 4 for b in buckets]
    assert starts == sorted(starts) and all(start % BLOCK_ALIGN_BYTES == 0 for start in starts)
    for p in params:
        p.grad = torch.full_like(p, 1.0) + p
    for b in buckets:
        b.fill(0.5, as_view=False, copied=[False] * len(params))
        assert b.flat.numel() == b.numel + (1 if b.is_last() else 0)
    for b in buckets:  # each view is its parameter's slot, and no two overlap
        assert all(torch.equal(v, p.grad * 0.5) for p, v in zip(b.params, b.views))
    own = _layout(*sizes)
    assert len({b.flat.untyped_storage().data_ptr() for b in own.buckets}) == len(own.buckets)


def test_with_bucket_views_a_fresh_gradient_becomes_its_view_and_is_freed_at_once():
    import weakref

    from ddpkit.ddp.bucket import move_in

    layout = _layout(3, BIG_PARAM_NUMEL, cap=1 << 20, as_view=True)
    param, slot = layout.params[1], layout.big_slot[1]
    param.grad = torch.full((BIG_PARAM_NUMEL,), 2.0)
    fresh = weakref.ref(param.grad)
    move_in(param, param.grad, slot)
    assert param.grad is slot and slot.eq(2.0).all() and fresh() is None


def test_with_gradient_as_bucket_view_existing_gradients_move_into_the_buckets():
    params = _params(2, 3)
    for p in params:
        p.grad = torch.full_like(p, 5.0)
    layout = BucketLayout(params, 1 << 20, 1 << 20, as_view=True, rebuild=True)
    bucket = layout.buckets[0]
    assert all(p.grad.data_ptr() in {v.data_ptr() for v in bucket.views} for p in params)
    assert bucket.grad_data.tolist() == [5.0] * 5


def test_the_rebuild_order_is_the_recorded_one_then_the_rest_in_registration_order():
    layout = _layout(1, 1, 1, 1)
    assert layout.record == [] and not layout.rebuilt
    layout.record.extend([2, 0])
    assert layout.rebuild_order() == [2, 0, 1, 3]
    fixed = _layout(1, 1, rebuild=False)  # find_unused_parameters without static_graph
    assert fixed.rebuilt and fixed.record is None
    fixed.expect_rebuild()  # static_graph turned on late
    assert not fixed.rebuilt and fixed.record == []


def test_a_comm_hook_before_training_gets_torchs_first_buckets():
    layout = _layout(1, 1, 1, 1)
    layout.build_initial(hooked=True)
    assert [b.param_indices for b in layout.buckets] == initial_groups(
        layout.params, 16, 16, hooked=True, rebuilt_later=True)


def test_release_lets_go_of_the_gradients_written_back_and_of_a_hooks_stand_in_buffer():
    layout = _layout(2, 2, cap=1 << 20)
    bucket = layout.buckets[0]
    bucket.grads = [torch.ones(2), torch.ones(2)]
    own = bucket.buffer()
    bucket.set_buffer(torch.zeros(4, dtype=torch.float16))
    layout.release()
    assert bucket.grads == [] and bucket.buffer() is own


def test_write_back_leaves_globally_unused_parameters_alone():
    params = _params(2, 2)
    layout = BucketLayout(params, 1 << 20, 1 << 20, as_view=False, rebuild=True)
    bucket = layout.buckets[0]
    for p in params:
        p.grad = torch.zeros_like(p)
    bucket.fill(None, False, [False, False])
    bucket.grad_data.fill_(3.0)
    layout.write_back([False, True])
    assert params[0].grad.tolist() == [0.0, 0.0] and params[1].grad.tolist() == [3.0, 3.0]


def test_the_buckets_are_of_the_type_the_layout_is_given():
    class Tagged(Bucket):
        pass

    layout = BucketLayout(_params(1, 2), 16, 16, as_view=False, rebuild=True, bucket_type=Tagged)
    assert layout.buckets and all(type(b) is Tagged for b in layout.buckets)



def _status_flag_placement(cuda_only: bool) -> tuple:
    import torch.distributed as dist

    import ddpkit.ddp.collectives as collectives

    if cuda_only:  # as for torch's init_process_group("nccl"), whose group refuses CPU tensors
        collectives.comm_device = lambda group: torch.device("cuda", 0)
    cpu = collectives.Collectives(dist.group.WORLD, torch.device("cpu"))
    gpu = collectives.Collectives(dist.group.WORLD, torch.device("cuda", 0))  # no CUDA needed to build
    return cpu.status_in_bucket, gpu.status_in_bucket, str(gpu.control_device)


@pytest.mark.parametrize("cuda_only, expected", [
    (False, (True, False, "cpu")),  # CUDA buckets: the flag is a CPU collective, read without a GPU sync
    (True, (True, True, "cuda:0")),  # a group without CPU tensors: the flag rides in the last bucket
])
def test_the_status_flag_of_cuda_buckets_waits_for_no_gpu_work_where_the_group_carries_cpu_tensors(
        cuda_only, expected):
    from ranks import run_ranks

    assert run_ranks(_status_flag_placement, 1, args=(cuda_only,), timeout=30) == [expected]


def test_a_used_map_reduced_on_another_device_is_copied_back_into_the_ranks_own():
    from types import SimpleNamespace

    from ddpkit.ddp.collectives import _CopiedBack

    local, reduced = torch.tensor([1, 0, 0], dtype=torch.int32), torch.tensor([2, 1, 0], dtype=torch.int32)
    waited = []
    _CopiedBack(SimpleNamespace(wait=lambda: waited.append(True)), reduced, local).wait()
    # a joined rank sends its last *reduced* map again (Note [Join shadowing])
    assert waited == [True] and local.tolist() == [2, 1, 0]


def test_gradients_are_views_of_the_buffer_a_hook_set_shaped_like_each_parameter():
    params = [nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(4)),
              nn.Parameter(torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last))]
    bucket = Bucket(0, params, [0, 1, 2], is_last=True)
    half = torch.arange(bucket.numel, dtype=torch.float16)
    bucket.set_buffer(half)
    gradients = bucket.gradients()
    assert [g.shape for g in gradients] == [p.shape for p in params]
    assert all(g.dtype == torch.float16 and g.untyped_storage().data_ptr() == half.data_ptr() for g in gradients)
    assert gradients[1].tolist() == [6.0, 7.0, 8.0, 9.0]
    assert gradients[2].is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(CommHookError, match=r"has shape \[3\] and strides \[1\], but the bucket.s gradients are 34"):
        bucket.set_buffer(torch.zeros(3))
        bucket.gradients()
    bucket.restore_buffer()
    assert bucket.gradients()[0].dtype == torch.float32


def test_a_complex_parameters_gradients_of_a_set_buffer_are_its_real_pairs():
    bucket = Bucket(0, [nn.Parameter(torch.randn(3, dtype=torch.cfloat))], [0], is_last=True)
    assert bucket.gradients()[0].dtype == torch.cfloat
    bucket.set_buffer(torch.arange(6.0))
    assert bucket.gradients()[0].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_the_views_of_a_set_buffer_keep_a_channels_last_layout_for_complex_gradients_too():
    weight = nn.Parameter(torch.randn(2, 3, 2, 2, dtype=torch.cfloat).to(memory_format=torch.channels_last))
    bucket = Bucket(0, [nn.Parameter(torch.randn(3, dtype=torch.cfloat)), weight], [0, 1], is_last=True)
    own = [torch.view_as_real(v) for v in bucket.gradients()]
    bucket.grad_data.copy_(torch.randn(bucket.numel, dtype=torch.cfloat))
    bucket.set_buffer(bucket.buffer().clone())
    for mine, theirs in zip(bucket.gradients(), own):
        assert torch.equal(mine, theirs) and mine.stride() == theirs.stride()
    with pytest.raises(CommHookError, match=r"strides \[2\]"):
        bucket.set_buffer(torch.zeros(2 * bucket.buffer().numel())[::2])
        bucket.gradients()
