"""The reducer: gradient buckets, grad-ready hooks, async all-reduce, and the one wait point.

One iteration, seen from here:

1. ``prepare_for_backward`` (end of a synced forward) arms the hooks and notes, with
   find_unused_parameters, the parameters that the output does not depend on. Several forwards
   before one backward (a siamese loss, a discarded evaluation forward) share one iteration, as in
   torch: a parameter counts as unused when none of their outputs reaches it.
2. The gradient reaching the forward's outputs queues ``finalize_backward`` at the end of that
   backward (queued from a parameter's hook instead, it could run at the end of a reentrant
   checkpoint's inner backward). The first gradient hook (a post-hook on a parameter's gradient
   accumulator, which runs after the user's own post-accumulate-grad hooks, as torch's does)
   marks the unused parameters ready: not earlier, since a ``zero_grad()`` between forward and
   backward must still reset their gradients, as in torch. Each parameter's hook counts it ready
   (and scales a big gradient into its slot while it is still in cache). When a bucket is complete
   and every bucket before it has been launched, the rest of its gradients are scaled into the
   flat buffer and its all-reduce (or comm hook) starts. Strict bucket order means every rank
   issues the same sequence of collectives, whatever order its gradients arrive in. With
   static_graph, the first iteration counts each parameter's hooks (reentrant checkpointing fires
   one per reentrant backward) and launches every bucket at the end; later ones wait for that count.
3. At the end of backward ``finalize_backward`` launches whatever is left, waits for everything,
   raises the same error on every rank if some rank lacked gradients, and writes the averaged
   gradients back: they are final when ``backward()`` returns. A backward that reached no
   parameter (``torch.autograd.grad`` for a gradient penalty) leaves the iteration open.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ddpkit.ddp.autograd_engine import (gradient_accumulator, outside_backward_python_context,
                                    queue_end_of_backward_callback)
from ddpkit.ddp.bucket import Bucket, copy_in
from ddpkit.ddp.bucket_layout import initial_groups, rebuilt_groups
from ddpkit.runtime.comm import all_gather_object
from ddpkit.ddp.errors import (late_gradient_warning, second_gradient_error, static_graph_changed_error,
                                   unused_gradient_error, warn_at_user_code)

__all__ = ["Reducer", "SPLIT_BUCKET_BYTES"]

SPLIT_BUCKET_BYTES = 12 * 1024 * 1024
"""The default ``split_bytes``: from this size on a bucket's Gloo all-reduce goes as two halves."""

CommHook = Callable[[Any, Bucket], torch.futures.Future]


class Reducer:
    """Average the gradients of ``params`` over ``process_group`` during backward, in buckets."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], process_group,
                 cap_bytes: int, first_cap_bytes: int, *, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 split_bytes: int = SPLIT_BUCKET_BYTES):
        self.params = list(params)
        self.names = list(names)
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.comm_hook: CommHook | None = None
        # Gloo carries CPU tensors (also where init_process_group named no backend): see
        # all_reduce_bucket
        backend = dist.get_backend(process_group)
        self._split_large = self.params[0].device.type == "cpu" and ("gloo" in backend or backend == "undefined")
        self.comm_state: Any = None
        self.split_bytes = split_bytes
        self._cap, self._first_cap = cap_bytes, first_cap_bytes
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        # Rebuilt once, in the order gradients really arrived; as torch, not where that order may
        # change from one iteration to the next (find_unused_parameters without static_graph).
        self._rebuilt = find_unused_parameters and not static_graph
        self._rebuilt_later = not self._rebuilt  # torch fixes its first buckets at construction
        self._build(self._initial_groups())
        self._record: list[int] | None = None if self._rebuilt else []
        self.iterations = 0  # synced backward passes, real or shadowed (join)
        self.forwards = 0  # synced forward passes
        self._write_mask: list[bool] | None = None  # False: globally unused, leave .grad alone
        self._static_unused: list[int] = []
        self._last_used_map = torch.zeros(len(self.params), dtype=torch.int32)  # see _launch_tail
        # static_graph: how often each parameter's hook fired in the first iteration (reentrant
        # checkpointing fires it once per reentrant backward that uses the parameter)
        self._hook_counts = [0] * len(self.params)
        self._late_warned = False
        self._join_work = None
        self._expecting = self._finalized = False
        self._window_start = 1  # the first forward of the iteration being prepared
        self._used_locally = [False] * len(self.params)  # got a gradient in a no_sync step
        self._deferred_unused: list[int] | None = None  # marked ready at the first gradient hook
        self._reset_iteration()
        # on the gradient accumulators, as torch: after a user's own post-accumulate-grad hooks
        self._accumulators = [gradient_accumulator(p) for p in self.params]
        self._handles = [acc.register_hook(functools.partial(self._on_grad_ready, i))
                         for i, acc in enumerate(self._accumulators)]

    # ---- buckets -------------------------------------------------------------------------------
    def _initial_groups(self) -> list[list[int]]:
        return initial_groups(self.params, self._cap, self._first_cap, hooked=self.comm_hook is not None,
                              rebuilt_later=self._rebuilt_later)

    def _build(self, groups: list[list[int]]) -> None:
        """(Re)create the buckets, in launch order; the last one carries the status flag."""
        last = len(groups) - 1
        self.buckets = []  # the old buffers go before the new ones are allocated, as in torch
        self.buckets = [Bucket(k, [self.params[i] for i in idx], idx, k == last, extra=int(k == last))
                        for k, idx in enumerate(groups)]
        self._bucket_of = [0] * len(self.params)
        for b in self.buckets:
            for i in b.param_indices:
                self._bucket_of[i] = b.index()
        self._counts = [len(b.params) for b in self.buckets]
        # a big gradient is scaled into its slot by its own hook, while still in cache (its copy at
        # bucket completion cost twice the time); with gradient_as_bucket_view it is already there
        self._big_slot: list[torch.Tensor | None] = [None] * len(self.params)
        if self.as_view:  # gradients that exist move into the buckets, as torch does
            with torch.no_grad():
                for b in self.buckets:
                    for p, v in zip(b.params, b.views):
                        if p.grad is not None and p.grad is not v:
                            v.copy_(p.grad)
                            p.grad = v
        else:
            for b in self.buckets:
                for i, v in zip(b.param_indices[: b.num_big], b.views):
                    self._big_slot[i] = v

    def rebuild_buckets_if_due(self) -> bool:
        """After the first synced backward, rebuild once in rank 0's gradient-ready order.

        With static_graph, after the second: the first one counts gradient hooks instead of
        recording when each parameter became ready.
        """
        if self._rebuilt or self.iterations < (2 if self.static_graph else 1):
            return False
        seen = set(self._record or ())
        # parameters that got no gradient go last, in registration order, as torch appends them
        order = list(self._record or ()) + [i for i in range(len(self.params)) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64)
        dist.broadcast(order_t, src=dist.get_global_rank(self.group, 0), group=self.group)
        self._build(rebuilt_groups(self.params, order_t.tolist(), self._cap, self._first_cap,
                                   hooked=self.comm_hook is not None))
        self._rebuilt, self._record = True, None
        self._reset_iteration()  # the pending counts are per bucket, and the buckets changed
        return True

    def set_static_graph(self) -> None:
        """Turn static_graph on before the first forward."""
        if self.forwards:
            raise RuntimeError(
                f"DistributedDataParallel on rank {self.rank}: _set_static_graph() came after "
                f"{self.forwards} forward pass(es); the first iteration must count the gradients "
                "already. HINT: pass static_graph=True to the constructor.")
        self.static_graph, self._rebuilt, self._record = True, False, []
        self._reset_iteration()

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook() may be called only once per DistributedDataParallel.")
        self.comm_hook, self.comm_state = hook, state
        if not self.forwards:  # before training, as torch asks: the hook gets torch's buckets
            self._build(self._initial_groups())
            self._reset_iteration()

    def set_join_count(self, work) -> None:
        """Divide by the number of ranks still active (``Join(divide_by_initial_world_size=False)``)."""
        self._join_work = work

    # ---- iteration state -----------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        n = len(self.params)
        self._ready = [False] * n
        self._used = [True] * n
        self._pending = list(self._counts)
        self._next_bucket = 0
        self._works: list[Any] = []
        self._callback_queued = False  # finalize_backward waits at the end of this backward
        self._began = False  # a gradient hook fired: buckets may have launched
        self._scale: float | None = 1.0 / self.world_size
        self._copied = [False] * n  # big gradients already in their slot
        # static_graph after its first iteration: hooks still to fire before a parameter is ready
        self._hooks_left = list(self._hook_counts) if self.static_graph and self.iterations else None
        # Let go of the gradients written back: held until the next backward, they outlived
        # zero_grad(set_to_none=True), a second set of gradients in memory that torch never keeps.
        for bucket in self.buckets:
            bucket.grads = []
            bucket.restore_buffer()  # and a hook's stand-in buffer (set_buffer), such as an fp16 copy

    @property
    def _tolerant(self) -> bool:
        """Missing gradients are allowed this iteration (and a used-map all-reduce is due)."""
        return self.find_unused or (self.static_graph and self.iterations == 0)

    @property
    def _counting(self) -> bool:
        """static_graph's first iteration: hooks are counted and every bucket launches at the end
        of backward (torch's delay_all_reduce), since a hook may fire again."""
        return self.static_graph and self.iterations == 0

    def prepare_for_forward(self) -> None:
        """Called before a synced forward: a backward that began must have finished."""
        if self._expecting and not self._began:
            # a backward that reached no parameter, or failed before one did: nothing launched,
            # and a callback queued by an output hook of a failed backward never runs
            self._callback_queued = False
        elif self._expecting:
            self._end_iteration(counted=False)
            raise RuntimeError(
                f"DistributedDataParallel on rank {self.rank}: forward() was called while the previous "
                "backward() had not finished averaging gradients (it raised, or was interrupted), so "
                "the ranks may disagree on which buckets were reduced. HINT: let an error in "
                "backward() end the step on every rank instead of catching it and training on.")

    def prepare_for_backward(self, unused: Sequence[int] = ()) -> None:
        """Arm the hooks after a synced forward; ``unused``: indices the output cannot reach."""
        if not self._expecting:  # the first forward of an iteration
            self._window_start = self.forwards + 1
        self._expecting, self._finalized, self._late_warned = True, False, False
        self.forwards += 1
        if self.static_graph:  # the first iteration's hook counts say which are unused, as in torch
            if self.iterations > 0:
                self._deferred_unused = self._static_unused
        elif self.find_unused:
            if self._deferred_unused is None:
                self._deferred_unused = list(unused)
            else:  # unused only if no forward of this iteration reaches it
                unused_now = set(unused)
                self._deferred_unused = [i for i in self._deferred_unused if i in unused_now]

    def output_gradient_hook(self) -> Callable[[torch.Tensor], None]:
        """A hook for this forward's outputs: queues the wait at the end of the backward that runs
        through them (a reentrant checkpoint's inner backward, where parameter hooks may fire
        first, ends earlier); backward through an older forward's graph raises."""
        forward = self.forwards

        def check(grad: torch.Tensor) -> None:
            if forward < self._window_start:
                raise RuntimeError(
                    f"DistributedDataParallel on rank {self.rank}: backward() reached the output of "
                    f"forward pass {forward}, whose gradients were already averaged, but forward pass "
                    f"{self.forwards} came after it; its gradients would be averaged as if they were "
                    "the new ones. HINT: call backward() on each forward's loss before the next "
                    "backward (retain_graph only inside no_sync()).")
            if self._expecting and not self._callback_queued:
                self._queue_finalize()
        return check

    def _queue_finalize(self) -> None:
        self._callback_queued = True
        queue_end_of_backward_callback(self.finalize_backward)

    def prepare_for_local_backward(self) -> None:
        """A forward without gradient sync (no_sync, or grad disabled): hooks stay quiet."""
        self._finalized = False

    # ---- the hot path --------------------------------------------------------------------------
    def _on_grad_ready(self, index: int, *_: Any) -> None:
        """Gradient-accumulator post-hook: count the gradient in, launch the buckets it completes."""
        if not self._expecting:
            if self._finalized:  # torch's DDP leaves such a gradient local too; it says nothing
                if not self._late_warned:
                    self._late_warned = True
                    warn_at_user_code(late_gradient_warning(self.rank, self.names[index]))
                return
            if self.find_unused:  # a local step (no_sync): torch counts this parameter as used
                self._used_locally[index] = True
            return
        if not self._began:  # the first gradient of this backward
            self._began = True
            if not self._callback_queued:  # backward did not come through the outputs we know of
                self._queue_finalize()
            if self._deferred_unused:  # before counting this one, which may be among them
                self._mark_unused(self._deferred_unused)
        if self._counting:
            self._hook_counts[index] += 1
            return
        left = self._hooks_left
        if left is not None:
            if not left[index]:
                raise static_graph_changed_error(self.rank, self.names[index], self._hook_counts[index])
            left[index] -= 1
            if left[index]:  # more reentrant backwards will add to this gradient
                return
        ready = self._ready
        if ready[index]:
            raise second_gradient_error(self.rank, self.names[index], self._used[index])
        ready[index] = True
        slot = self._big_slot[index]
        if slot is not None and self._join_work is None:  # else at _fill, once the scale is known
            grad = self.params[index].grad
            if grad is not None:
                copy_in(grad, slot, self._copy_scale)
                self._copied[index] = True
        if self._record is not None:
            self._record.append(index)
        b = self._bucket_of[index]
        pending = self._pending
        left = pending[b] = pending[b] - 1
        if not left and b == self._next_bucket:
            self._launch_ready_buckets()

    def _mark_unused(self, indices: Sequence[int]) -> None:
        for i in indices:
            if not self._ready[i]:
                self._ready[i], self._used[i] = True, False
                self._pending[self._bucket_of[i]] -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        buckets, pending = self.buckets, self._pending
        while self._next_bucket < len(buckets) and pending[self._next_bucket] == 0:
            self._launch(buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        self._fill(bucket)
        with outside_backward_python_context():
            if self.comm_hook is None:
                self._works.append(self.all_reduce_bucket(bucket))
                return
            future = self.comm_hook(self.comm_state, bucket)
            if not callable(getattr(future, "wait", None)):  # then() gives torch._C.Future
                raise TypeError(
                    f"DistributedDataParallel on rank {self.rank}: comm hook {_name_of(self.comm_hook)} "
                    f"returned {type(future).__name__} for bucket {bucket.index()}, but must return a "
                    "torch.futures.Future of the reduced bucket. HINT: return e.g. "
                    "dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(...).")
            self._works.append(future)

    def all_reduce_bucket(self, bucket: Bucket) -> Any:
        """Start the bucket's all-reduce; a large one on Gloo goes as two concurrent halves.

        Gloo runs each collective on one of its two worker threads; two halves keep both busy.
        Measured on 2 ranks over loopback: 16 MiB in 9.7 ms instead of 12.1, 32 MiB in 18.2 instead
        of 19.4, but 8 MiB in 6.6 instead of 6.1; the 16 MiB model's step gained 2 to 5%. A joined
        rank shadows a bucket through here too, so every rank issues the same collectives.
        """
        flat = bucket.flat
        if self._split_large and flat.numel() * flat.element_size() >= self.split_bytes:
            return _AllWorks([dist.all_reduce(half, group=self.group, async_op=True) for half in flat.chunk(2)])
        return dist.all_reduce(flat, group=self.group, async_op=True)

    def _fill(self, bucket: Bucket) -> None:
        if self._join_work is not None:
            self._join_work.wait()
            self._scale = 1.0 / max(1, int(self._join_work.result()[0].item()))
            self._join_work = None
        bucket.fill(self._copy_scale, self.as_view, self._copied)

    @property
    def _copy_scale(self) -> float | None:
        """What gradients are multiplied by on their way in: none for a comm hook, which averages."""
        return self._scale if self.comm_hook is None else None

    # ---- the wait point ------------------------------------------------------------------------
    def finalize_backward(self) -> None:
        """End of backward: launch what is left, wait, check, write the averages back."""
        if not self._began:  # it reached no parameter (torch.autograd.grad): the iteration goes on
            self._callback_queued = False
            return
        with outside_backward_python_context():
            self._finalize_backward()

    def _finalize_backward(self) -> None:
        try:
            missing = self._launch_remaining()
            tail = self.wait_with_tail(self._wait_buckets, bool(missing))
            self._check(tail, missing)
            self._write_back()
            self._finalized = True
        finally:
            self._end_iteration()

    def _launch_remaining(self) -> list[int]:
        if self._next_bucket == len(self.buckets):
            return []
        if self._counting:  # every parameter whose hook fired is ready now
            for i, count in enumerate(self._hook_counts):
                if count and not self._ready[i]:
                    self._ready[i] = True
                    self._pending[self._bucket_of[i]] -= 1
        missing = [i for i, r in enumerate(self._ready) if not r]
        if not self._tolerant and self.comm_hook is None:
            self.buckets[-1].flag.fill_(1)  # tell every rank, through the last bucket's all-reduce
        self._mark_unused(missing)
        return missing

    def wait_with_tail(self, wait_buckets: Callable[[], None], missing: bool, shadow: bool = False):
        """Wait for the buckets and launch the tail collective, in the order every rank keeps.

        The tail goes out before the wait, overlapping it; with a comm hook only after, since a
        hook's futures may issue collectives from their callbacks (torch's PowerSGD does).
        """
        if self.comm_hook is None:
            tail = self._launch_tail(missing, shadow)
            wait_buckets()
            return tail
        wait_buckets()
        return self._launch_tail(missing, shadow)

    def _launch_tail(self, missing: bool, shadow: bool = False):
        """The collective after the buckets: used-map, or status flag when a comm hook hides ours."""
        if self._tolerant:
            if shadow:  # torch's joined rank sends its last all-reduced map again: a parameter any
                used = self._last_used_map  # rank used then counts as used (zeros, not None)
            else:
                used = torch.tensor(self._used, dtype=torch.int32)
                used |= torch.tensor(self._used_locally, dtype=torch.int32)  # no_sync steps' too
            self._last_used_map = used  # reduced in place
            return used, dist.all_reduce(used, group=self.group, async_op=True)
        if self.comm_hook is not None:
            status = torch.tensor([int(missing)], dtype=torch.int32)
            return status, dist.all_reduce(status, group=self.group, async_op=True)
        return None  # the status flag rides in the last bucket: set it before that bucket launched

    def _wait_buckets(self) -> None:
        for bucket, work in zip(self.buckets, self._works):
            result = work.wait()
            if self.comm_hook is not None:
                if isinstance(result, (list, tuple)) and len(result) == 1:
                    result = result[0]
                bucket.take_result(result, _name_of(self.comm_hook))

    def _check(self, tail, missing: list[int]) -> None:
        """Record globally unused parameters, or raise on every rank if a gradient was missing."""
        if self._tolerant:
            used, work = tail
            work.wait()
            self._write_mask = [u > 0 for u in used.tolist()]
            if self.static_graph:
                self._static_unused = [i for i, u in enumerate(self._used) if not u]
            return
        if tail is not None:
            tail[1].wait()
            failed = int(tail[0].item())
        else:
            failed = bool(self.buckets[-1].flag.item())  # the gradients' dtype: maybe complex
        if failed:
            self.buckets[-1].flag.zero_()
            names = [self.names[i] for i in missing]
            everyone = all_gather_object((self.rank, names), group=self.group)
            raise unused_gradient_error(self.rank, everyone, self.static_graph)

    def _write_back(self) -> None:
        for bucket in self.buckets:
            bucket.write_back(self.as_view, self._write_mask)

    def _end_iteration(self, counted: bool = True) -> None:
        self._expecting = False
        self._deferred_unused = None
        if counted:
            self._used_locally = [False] * len(self.params)
            self.iterations += 1
        elif self._counting:  # an abandoned first static_graph iteration: its counts are partial
            self._hook_counts = [0] * len(self.params)
        self._reset_iteration()


def _name_of(hook: Callable) -> str:
    return repr(getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or hook)


class _AllWorks:
    """Several collectives waited on as one."""

    def __init__(self, works: list[Any]):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
