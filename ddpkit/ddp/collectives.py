"""The collectives of one synced backward: one per bucket, in order, then the tail.

A bucket goes out as our all-reduce (a large CPU bucket on Gloo as two halves) or through the
user's comm hook; the tail collective after the buckets carries the used map
(find_unused_parameters, static_graph's first iteration) or, when a comm hook hides the status
flag riding in the last bucket, a flag of its own (see Note [Errors on every rank] in
docs/design.md). A joined rank issues the same ones, with zeros.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ddpkit.ddp.bucket import Bucket
from ddpkit.ddp.errors import unused_gradient_error
from ddpkit.ddp.profiling import bucket_range
from ddpkit.errors import CommHookError, explain
from ddpkit.runtime import direct
from ddpkit.runtime.comm import all_gather_object, comm_device
from ddpkit.runtime.hangs.after_wait import release_finished, wait_failed
from ddpkit.runtime.hangs.watchdog import peer_gone_error

__all__ = ["CommHook", "Collectives", "SPLIT_BUCKET_BYTES"]

SPLIT_BUCKET_BYTES = 12 * 1024 * 1024
"""The default ``split_bytes``: from this size on a bucket's Gloo all-reduce goes as two halves."""

CommHook = Callable[[Any, Bucket], torch.futures.Future]

# what a collective under a comm hook raises when the job, not the hook, failed (kept as it is)
_COLLECTIVE_FAILURE: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(dist, "DistError", None),) if t is not None)

Tail = Optional[tuple[torch.Tensor, Any]]  # the tail collective: (tensor, work), or none


class Collectives:
    """Launch and wait for the collectives of the buckets over ``group``.

    Args:
        group: the process group.
        device: the parameters' device.
        split_bytes: from this size on a CPU bucket's Gloo all-reduce goes as two halves.
    """

    def __init__(self, group: Any, device: torch.device, split_bytes: int = SPLIT_BUCKET_BYTES):
        self.group = group
        self.rank = dist.get_rank(group)
        # Gloo carries CPU tensors (also where init_process_group named no backend)
        backend = dist.get_backend(group)
        self.split_large = device.type == "cpu" and ("gloo" in backend or backend == "undefined")
        self.split_bytes = split_bytes
        # the tail's small tensors (status flag, used map) go where the group reduces: CUDA for an
        # NCCL-only group (torch's init_process_group("nccl")), else the CPU
        self.control_device = comm_device(group)
        # CUDA buckets on a group that carries CPU tensors too: the status flag is a CPU collective of
        # its own, so reading it waits for no GPU work (see Note [Errors on every rank])
        self.cpu_status = device.type != "cpu" and self.control_device.type == "cpu"
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None

    @property
    def status_in_bucket(self) -> bool:
        """Whether the status flag rides in the last bucket's all-reduce (else in the tail)."""
        return self.comm_hook is None and not self.cpu_status

    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self.comm_hook is not None:
            raise RuntimeError(explain(
                f"register_comm_hook or register_builtin_comm_hook can only be called once: this "
                f"DistributedDataParallel already reduces with {_name_of(self.comm_hook)}, and {_name_of(hook)} "
                "would replace it.", "wrap one hook in the other (e.g. fp16_compress_wrapper(hook)), or "
                "register the one you want.", who="DistributedDataParallel", rank=self.rank))
        self.comm_hook, self.comm_state = hook, state

    def launch(self, bucket: Bucket) -> Any:
        """Start reducing ``bucket``: our all-reduce, or the comm hook's future."""
        if self.comm_hook is None:
            with bucket_range(bucket, "all_reduce"):
                return self.all_reduce_bucket(bucket)
        with bucket_range(bucket, "comm_hook"):
            future = self.comm_hook(self.comm_state, bucket)
        if not callable(getattr(future, "wait", None)):  # then() gives torch._C.Future
            name = _name_of(self.comm_hook)
            raise CommHookError(explain(
                f"comm hook {name} for bucket {bucket.index()}: callback must return a torch.futures.Future "
                f"object, but got {type(future).__name__}. The Future must hold the reduced bucket.",
                "return e.g. dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(...).",
                who="DistributedDataParallel", rank=self.rank), rank=self.rank, hook=name)
        return future

    @staticmethod
    def skipped(bucket: Bucket) -> Any:
        """The work of a bucket left out (``skip_all_reduce_unused_params``): its own buffer is the result."""
        return _Done(bucket.buffer())

    def all_reduce_bucket(self, bucket: Bucket) -> Any:
        """Start the bucket's all-reduce; a large one on Gloo goes as two concurrent halves.

        Gloo runs each collective on one of its two worker threads; two halves keep both busy
        (see Note [Gloo halves] in docs/design.md).
        """
        if bucket.sparse:  # a sparse gradient goes as it is, its status flag beside it
            return _AllWorks(bucket.all_reduce(self.group))
        flat = bucket.flat
        if self.split_large and flat.numel() * flat.element_size() >= self.split_bytes:
            return _AllWorks([direct.all_reduce(half, self.group) for half in flat.chunk(2)])
        return direct.all_reduce(flat, self.group)

    def drain(self, works: Sequence[Any]) -> None:
        """Let the collectives of an abandoned backward finish: they write into the buckets, which the
        next backward fills again. What they report is no news any more: the backward failed."""
        for work in works:
            with contextlib.suppress(Exception):
                work.wait()

    def finish(self, works: Sequence[Any], used_map: Callable[[], torch.Tensor] | None, missing: bool,
               last: Bucket, into: Sequence[Bucket] | None = None) -> tuple[torch.Tensor | None, bool]:
        """Wait for the buckets' ``works`` and the tail collective; active and joined ranks alike.

        Args:
            used_map: gives this rank's used map for the tail (None: no used map this iteration).
            missing: this rank lacked gradients.
            last: the last bucket launched, whose status flag was all-reduced with it.
            into: the buckets a comm hook's results go into (none on a joined rank: zeros, dropped).

        Returns:
            The all-reduced used map (or None), and whether some rank lacked gradients.
        """
        try:
            tail = self.wait_with_tail(works, used_map, missing, into)
            if used_map is not None:
                tail[1].wait()
        except Exception as e:
            if peer_gone_error(e):  # the hang report first (who went away, and where), then the error
                wait_failed(e)
            raise
        release_finished(self.group)  # before zero_grad may free the gradients the Works hold
        if used_map is not None:
            return tail[0], False
        return None, self._failed(tail, last)

    def shadow(self, buckets: Sequence[Bucket], used_map: Callable[[], torch.Tensor] | None,
               static_graph: bool) -> None:
        """A joined rank's share of ``finish``: every bucket's all-reduce with zeros, and the tail;
        raise with the active ranks if one of them lacked gradients, naming none of ours."""
        works, zeros = [], None
        for bucket in buckets:
            zeros = bucket.zeros_like()
            works.append(self.launch(zeros))
        if self.finish(works, used_map, False, zeros)[1]:
            self.raise_missing([], static_graph)

    def raise_missing(self, names: list[str], static_graph: bool, changed: dict[str, str] | None = None) -> None:
        """Raise on every rank, each naming its parameters that got no gradient (``changed``: what
        became of those replaced, removed or frozen since wrapping)."""
        everyone = all_gather_object((self.rank, names, changed or {}), group=self.group)
        raise unused_gradient_error(self.rank, [(r, n) for r, n, _ in everyone], static_graph,
                                    {r: c for r, _, c in everyone})

    def wait_with_tail(self, works: Sequence[Any], used_map: Callable[[], torch.Tensor] | None,
                       missing: bool, into: Sequence[Bucket] | None = None) -> Tail:
        """Wait for the buckets and launch the tail collective, in the order every rank keeps.

        The tail goes out before the wait, overlapping it; with a comm hook only after, since a
        hook's futures may issue collectives from their callbacks (torch's PowerSGD does).
        """
        if self.comm_hook is None:
            tail = self._launch_tail(used_map, missing)
            self._wait(works, into)
            return tail
        self._wait(works, into)
        return self._launch_tail(used_map, missing)

    def _launch_tail(self, used_map: Callable[[], torch.Tensor] | None, missing: bool) -> Tail:
        """The collective after the buckets: the used map, or a status flag when a comm hook hides ours."""
        if used_map is not None:
            local = used_map()  # reduced in place: a joined rank sends the last reduced map again
            used = local.to(self.control_device)
            work = direct.all_reduce(used, self.group)
            return local, work if used is local else _CopiedBack(work, used, local)
        if not self.status_in_bucket:
            status = torch.tensor([int(missing)], dtype=torch.int32, device=self.control_device)
            return status, direct.all_reduce(status, self.group)
        return None  # the status flag rides in the last bucket: set it before that bucket launched

    def _wait(self, works: Sequence[Any], into: Sequence[Bucket] | None) -> None:
        if into is None or self.comm_hook is None:
            for work in works:
                work.wait()
            return
        name = _name_of(self.comm_hook)
        for bucket, work in zip(into, works):
            try:
                result = work.wait()
            except _COLLECTIVE_FAILURE:  # a peer gone, a timeout: not the hook's doing
                raise
            except Exception as e:
                raise CommHookError(explain(  # a RuntimeError, as torch's DDP raises it
                    f"the future of comm hook {name} for bucket {bucket.index()} failed: {type(e).__name__}: {e}",
                    "the hook's own error is the cause, shown above.", who="DistributedDataParallel",
                    rank=self.rank), rank=self.rank, hook=name) from e
            bucket.take_result(result, name, self.rank)

    def _failed(self, tail: Tail, last: Bucket) -> bool:
        """Whether some rank lacked gradients: the status flag, all-reduced in ``last`` or the tail."""
        if tail is not None:
            tail[1].wait()
            return bool(int(tail[0].item()))
        return bool(last.flag.item())  # the gradients' dtype: maybe complex


def _name_of(hook: Callable) -> str:
    return repr(getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or hook)


class _CopiedBack:
    """A collective on a copy (a CUDA copy of a CPU tensor), whose result ``wait`` copies back."""

    def __init__(self, work: Any, reduced: torch.Tensor, into: torch.Tensor):
        self._work, self._reduced, self._into = work, reduced, into

    def wait(self) -> None:
        self._work.wait()
        self._into.copy_(self._reduced)


class _AllWorks:
    """Several collectives waited on as one."""

    def __init__(self, works: list[Any]):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class _Done:
    """A collective that was never needed, waited on like the others."""

    def __init__(self, result: torch.Tensor):
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result
