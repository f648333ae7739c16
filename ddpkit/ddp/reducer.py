"""The reducer: gradient buckets, grad-ready hooks, async all-reduce, and the one wait point.

``prepare_for_backward`` (end of a synced forward) arms the hooks; then, as torch's reducer.cpp
(see Note [Reducer walk-through] in docs/design.md):

    _on_grad_ready       a gradient is in ``.grad``: count it ready (autograd_hook, mark_variable_ready)
    _mark_bucket_ready   launch, strictly in order, every bucket whose gradients are all in
    _launch              scale the gradients into the bucket, start its collective (all_reduce_bucket)
    finalize_backward    end of backward: launch what is left, wait, check, write the averages back

The parts: ``Iteration`` (one iteration's phase and counts), ``ParameterUsage`` (unused parameters,
static_graph), ``BucketLayout`` (the buckets, rebuilt once) and ``Collectives`` (what goes out).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ddpkit.ddp import adoption, errors
from ddpkit.ddp.autograd_engine import (
    gradient_accumulator,
    outside_backward_python_context,
    queue_end_of_backward_callback,
)
from ddpkit.ddp.bucket import Bucket, copy_in, is_big, move_in
from ddpkit.ddp.bucket_layout import ONE_BLOCK_DEVICES, BucketLayout
from ddpkit.ddp.collectives import SPLIT_BUCKET_BYTES, Collectives
from ddpkit.ddp.compile_support import HOOK_CALLBACK as _HOOK_CALLBACK
from ddpkit.ddp.compile_support import never_compiled, outside_dynamo
from ddpkit.ddp.cpu_share import in_place_pays, own_cpu_cap
from ddpkit.ddp.create_graph import join_graphs, set_aside
from ddpkit.ddp.ddp_logger import DDPLogger
from ddpkit.ddp.iteration import Iteration, Phase
from ddpkit.ddp.parameter_watch import ParameterWatch
from ddpkit.ddp.profiling import bucket_range, profiled
from ddpkit.ddp.reducer_config import ReducerConfig
from ddpkit.ddp.reducer_forward import ReducerForward
from ddpkit.ddp.usage import ParameterUsage

__all__ = ["Reducer", "SPLIT_BUCKET_BYTES"]

# module globals for the hot path: Phase.REDUCING, looked up on the enum class each time, costs several times more
_IDLE, _REDUCING, _FINALIZED, _HELD = Phase.IDLE, Phase.REDUCING, Phase.FINALIZED, Phase.HELD


class Reducer(ReducerConfig, ReducerForward):
    """Average the gradients of ``params`` (named ``names``) over ``process_group`` during backward.

    ``cap_bytes``, ``first_cap_bytes`` and ``cap_list`` size the buckets; the flags are torch's DDP
    options; ``split_bytes``: see Note [Gloo halves]; ``bucket_type``: the class of the buckets;
    ``in_place_bytes``: see Note [Big gradients in place] (0: never; None: ``IN_PLACE_BYTES``, kept
    after the rebuild where ``in_place_pays`` on rank 0); ``one_block``: the device types
    whose buckets share one block (Note [One block per device]); ``adopt``: see Note [Averages in
    their slots]; ``logger``: the DDP's (torch's logging data), else one of its own that notes errors only;
    ``watch``: the DDP's, which says what became of parameters changed since wrapping."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], process_group: Any,
                 cap_bytes: int, first_cap_bytes: int, *, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 split_bytes: int = SPLIT_BUCKET_BYTES, bucket_type: type[Bucket] = Bucket,
                 cap_list: Sequence[int] = (), skip_unused: bool = False, sparse: Sequence[str | None] = (),
                 in_place_bytes: int | None = None, one_block: Sequence[str] = ONE_BLOCK_DEVICES,
                 adopt: bool = True, logger: DDPLogger | None = None, watch: ParameterWatch | None = None):
        self.params = list(params)
        self.names = list(names)
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.as_view = gradient_as_bucket_view
        self.collectives = Collectives(process_group, self.params[0].device, split_bytes)
        self.skip_unused = skip_unused and find_unused_parameters  # on torch's buckets, as it promises
        self.usage = ParameterUsage(len(self.params), find_unused_parameters=find_unused_parameters,
                                    static_graph=static_graph)
        # big CPU gradients keep their averages in their slots, where no used map may leave one alone
        self.adopt = (adopt and adoption.AVAILABLE and not (gradient_as_bucket_view or find_unused_parameters)
                      and all(p.device.type == "cpu" for p in self.params))
        # rebuilt once in arrival order, not where it may change (find_unused); none in place with a used
        # map; a bucket whose slots gradients adopt has a block of its own, whose references adoption counts
        self.layout = BucketLayout(self.params, cap_bytes, first_cap_bytes, as_view=gradient_as_bucket_view,
                                   rebuild=not (find_unused_parameters and not static_graph), sparse=sparse,
                                   bucket_type=bucket_type, cap_list=cap_list, like_torch=self.skip_unused,
                                   in_place_bytes=0 if find_unused_parameters or static_graph else in_place_bytes,
                                   keep_in_place=in_place_bytes is not None or in_place_pays(self.world_size),
                                   one_block=() if self.adopt else one_block,
                                   own_cap=own_cpu_cap(self.params, cap_bytes, first_cap_bytes, self.world_size))
        self._big = [is_big(p, bucket_type.big_numel) for p in self.params]  # scaled by their own hooks
        self.iterations = 0  # synced backward passes, real or shadowed (join)
        self.forwards = 0  # synced forward passes
        self.forward_seen = False  # a forward of any kind went through the DDP (or its warning was said)
        self._join_work: Any = None  # Join's count of the ranks still active, read at the first launch
        self.logger = logger if logger is not None else DDPLogger()  # sampled timings, the last error
        self.watch = watch  # the DDP's module against these parameters, after the sampled backwards
        self._iteration = Iteration(self.layout, self.usage, 0, 1.0 / self.world_size)
        # on the gradient accumulators, as torch: after a user's own post-accumulate-grad hooks;
        # see Note [Accumulator hooks] in docs/design.md. Never removed, so their handles are not
        # kept, and each hook partial-applies the function, not a bound method: with hundreds of
        # parameters these objects are a part of the RSS (Note [Gradient memory])
        self._accumulators = [gradient_accumulator(p) for p in self.params]
        on_grad_ready = type(self)._on_grad_ready
        for i, acc in enumerate(self._accumulators):
            acc.register_hook(functools.partial(on_grad_ready, self, i))

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in launch order."""
        return self.layout.buckets

    # ---- the hot path --------------------------------------------------------------------------
    @never_compiled  # see ddpkit.ddp.compile_support
    def _on_grad_ready(self, index: int, *_: Any) -> None:
        """Gradient-accumulator post-hook: count the gradient in, launch the buckets it completes.
        Runs once per parameter per step, so it stays flat: locals, no call per parameter."""
        if _HOOK_CALLBACK is not None and _HOOK_CALLBACK() is not None:  # backward() in a compiled frame
            return outside_dynamo(self._on_grad_ready, index)
        it = self._iteration
        phase = it.phase
        if phase is not _REDUCING:
            if phase is _IDLE:  # a local step (no_sync): torch counts this parameter as used
                if self.usage.find_unused:
                    self.usage.used_locally[index] = True
                if not self.forward_seen:  # none through the DDP yet: the module was called directly
                    self.forward_seen = True  # said once
                    errors.warn_at_user_code(errors.no_forward_warning(self.rank, self.names[index]))
                return
            if phase is _FINALIZED:  # torch's DDP leaves such a gradient local too; it says nothing
                if not it.late_warned:
                    it.late_warned = True
                    errors.warn_at_user_code(errors.late_gradient_warning(self.rank, self.names[index]))
                return
            if phase is _HELD or self._begin_reducing(it, index):  # see ddpkit.ddp.create_graph
                it.held.append(index)
                return
        if it.counting:
            self.usage.hook_counts[index] += 1
            return
        left = it.hooks_left
        if left is not None:
            if not left[index]:
                raise self.logger.logged(errors.static_graph_changed_error(self.rank, self.names[index],
                                                                           self.usage.hook_counts[index]))
            left[index] -= 1
            if left[index]:  # more reentrant backwards will add to this gradient
                return
        ready = it.ready
        if ready[index]:
            raise self.logger.logged(errors.second_gradient_error(self.rank, self.names[index], it.used[index]))
        ready[index] = True
        slot = it.big_slot[index]
        if slot is not None and self._join_work is None:  # else at _launch, once the scale is known
            grad = self.params[index].grad
            if grad is not None and self.as_view:  # it is its view, or becomes it; a big one scaled now
                scale = it.scale if self._big[index] and self.collectives.comm_hook is None else None
                move_in(self.params[index], grad, slot, scale)
                it.copied[index] = scale is not None
            elif grad is not None:
                bucket = self.layout.buckets[it.bucket_of[index]]  # an ordinary one: it has slots
                if bucket.adopted and grad.data_ptr() != slot.data_ptr():  # set_to_none=False, replaced
                    adoption.let_go_of_replaced(bucket, bucket.param_indices.index(index), grad)
                copy_in(grad, slot, it.scale if self.collectives.comm_hook is None else None)
                it.copied[index] = True
        record = it.record
        if record is not None:
            record.append(index)
        b = it.bucket_of[index]
        pending = it.pending
        left = pending[b] = pending[b] - 1
        if not left and b == it.next_bucket:
            self._mark_bucket_ready(it)

    def _begin_reducing(self, it: Iteration, index: int) -> bool:
        """The first gradient of a synced backward: queue the wait, mark the unused parameters.
        True: the backward has ``create_graph`` (its hooks run in grad mode), and is held."""
        if it.begin_reducing():  # backward did not come through the outputs we know of
            queue_end_of_backward_callback(self.finalize_backward)
        if torch.is_grad_enabled():
            it.hold()
            return True
        self._start_reducing(it)
        return False

    def _start_reducing(self, it: Iteration) -> None:
        """Before the first gradient is counted in: free the slots kept gradients hold, mark the unused."""
        if self.adopt:  # before any gradient is written into a slot that a kept gradient holds
            self.layout.reclaim()
        deferred = self.usage.deferred_unused
        if deferred:  # before counting this gradient in, whose parameter may be among them
            it.mark_unused(deferred)
            self._mark_bucket_ready(it)

    def _mark_bucket_ready(self, it: Iteration) -> None:
        """Launch, in order, every bucket whose gradients are all in."""
        buckets, pending = self.layout.buckets, it.pending
        while it.next_bucket < len(buckets) and pending[it.next_bucket] == 0:
            self._launch(buckets[it.next_bucket], it)
            it.next_bucket += 1

    def _launch(self, bucket: Bucket, it: Iteration) -> None:
        """Scale the bucket's gradients into its buffer and start its collective."""
        if self._join_work is not None:
            active = self._join_work.get_future().wait()[0]  # Work.result() warns that it goes away
            it.scale = 1.0 / max(1, int(active.item()))
            self._join_work = None
        # multiplied by the scale on their way in, unless a comm hook averages them
        with bucket_range(bucket, "fill"):
            bucket.fill(it.scale if self.collectives.comm_hook is None else None, self.as_view, it.copied)
        # skip_all_reduce_unused_params: torch's contract is that every rank leaves the same ones unused
        skip = self.skip_unused and not any(it.used[i] for i in bucket.param_indices)
        if self.logger.timing and it.next_bucket == 0:
            self.logger.mark("backward_comm")
        with outside_backward_python_context():
            it.works.append(self.collectives.skipped(bucket) if skip else self.collectives.launch(bucket))

    # ---- the wait point ------------------------------------------------------------------------
    def finalize_backward(self) -> None:
        """End of backward: launch what is left, wait, check, write the averages back (final when
        ``backward()`` returns), or raise on every rank if some rank lacked gradients. A backward
        that reached no parameter (``torch.autograd.grad`` for a gradient penalty) changes nothing."""
        it = self._iteration
        carried = self._release(it) if it.phase is Phase.HELD else None
        if it.phase is not Phase.REDUCING:
            it.rearm()
            return
        timing = self.logger.timing
        if timing:
            self.logger.mark("backward_compute_end")
        with outside_backward_python_context():
            outcome, buckets = Phase.IDLE, self.layout.buckets
            try:
                missing = self._launch_remaining(it)
                used_map = functools.partial(self.usage.used_map, it.used) if it.tolerant else None
                with profiled("ddpkit.finalize_backward.wait"):
                    reduced, failed = self.collectives.finish(it.works, used_map, bool(missing), buckets[-1],
                                                              into=buckets)
                if reduced is not None:  # which parameters no rank used: their .grad is left alone
                    self.usage.settle(reduced, it.used)
                elif failed:  # some rank lacked gradients: raise on every rank
                    buckets[-1].flag.zero_()
                    names = [self.names[i] for i in missing]
                    self.collectives.raise_missing(names, self.usage.static_graph,
                                                   self.watch.changes(names) if self.watch else None)
                self.layout.write_back(self.usage.write_mask, adopt=self.adopt and not self.usage.static_graph
                                       and self.collectives.comm_hook is None)
                outcome = Phase.FINALIZED
                if timing:
                    self.logger.end_backward(self.params, it.used, buckets, self.skip_unused)
                    if self.watch is not None:  # torch's sampled iterations: one walk over the module
                        self.watch.warn_if_changed(self.rank)
            except Exception as e:
                self.logger.logged(e)
                raise
            finally:
                self._end_iteration(it, outcome)
        if carried:
            join_graphs(self.params, carried, it.scale if self.collectives.comm_hook is None else 1.0)

    def _release(self, it: Iteration) -> dict[int, torch.Tensor]:
        """A held ``create_graph`` backward ends: the gradients that carry a graph are set aside,
        and the hooks' work is done now, in their order, on detached copies."""
        carried = set_aside(self.params, it.held)
        if carried:
            errors.warn_create_graph(self.rank)  # as torch's reducer does
        self._start_reducing(it)
        for index in it.release():
            self._on_grad_ready(index)
        return carried

    def _launch_remaining(self, it: Iteration) -> list[int]:
        """Count in the parameters without a gradient, launching the buckets that waited for them."""
        if it.all_launched():
            return []
        if it.counting:  # every parameter whose hook fired is ready now
            it.mark_ready(self.usage.counted())
        missing = it.missing()
        if not it.tolerant and self.collectives.status_in_bucket:
            self.layout.buckets[-1].flag.fill_(1)  # tell every rank, through the last bucket's all-reduce
        it.mark_unused(missing)
        self._mark_bucket_ready(it)
        return missing

    # ---- iterations ----------------------------------------------------------------------------
    def _end_iteration(self, it: Iteration, phase: Phase, counted: bool = True) -> None:
        """``counted``: a synced backward finished (else it was abandoned); go on in ``phase``."""
        self.usage.end_iteration(counted, it.counting)
        if counted:
            self.iterations += 1
        elif it.record:  # its arrivals are forgotten: the rebuild follows one whole backward
            it.record.clear()
        self._renew(phase)

    def _renew(self, phase: Phase | None = None) -> None:
        """A new Iteration on the current buckets, in ``phase``; None: the counts start afresh (new
        buckets, static_graph), and a forward window still open stays open."""
        it = self._iteration
        self.layout.release()
        self._iteration = Iteration(self.layout, self.usage, self.iterations, 1.0 / self.world_size,
                                    it.phase.on_new_buckets() if phase is None else phase, previous=it)
