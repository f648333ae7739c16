"""The collective recorder: every ``torch.distributed`` collective, numbered per group, in a ring buffer.

``install()`` replaces the collective functions in both ``torch.distributed`` and its
``distributed_c10d`` module (where torch's own ``*_object`` collectives look them up) with a thin
wrapper; ddpkit's DDP and collectives call them through the module, so they are recorded too. A
synchronous call ends when it returns; an ``async_op=True`` call ends when its ``Work`` completes,
which the watchdog polls off the hot path. See Note [Hang reports] in docs/design.md.
"""
from __future__ import annotations

import collections
import functools
import inspect
import re
import threading
import time
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ddpkit.runtime.hangs.callsite import Site, call_site, format_site
from ddpkit.runtime.hangs.p2p import CALLS as P2P_CALLS
from ddpkit.runtime.hangs.p2p import PointToPointWaits

__all__ = ["Record", "GroupLog", "Recorder", "COLLECTIVES", "INSTALLED"]

# op -> (the argument whose dtype and shape describe the call, the argument naming a root rank)
COLLECTIVES: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("tensor", None), "broadcast": ("tensor", "src"), "all_gather": ("tensor", None),
    "all_gather_into_tensor": ("input_tensor", None), "reduce_scatter": ("output", None),
    "reduce_scatter_tensor": ("input", None), "reduce": ("tensor", "dst"), "gather": ("tensor", "dst"),
    "scatter": ("tensor", "src"), "all_to_all": ("input_tensor_list", None),
    "all_to_all_single": ("input", None), "barrier": (None, None), "monitored_barrier": (None, None),
}
_RING = 64
INSTALLED: list[Recorder] = []  # the recorders wrapping torch's collectives now (one per process)


def _short_error(error: BaseException) -> str:
    """``RuntimeError: Connection closed by peer [127.0.0.1]:1205``: Gloo's words without its source
    path and its advice."""
    text = str(error).splitlines()[0] if str(error) else ""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
    return f"{type(error).__name__}: {text}"[:200]


def _reduction_name(op: Any) -> str:
    """A reduction's name, the same on every rank: ``max`` for ``ReduceOp.MAX`` (a ``RedOpType``) and
    for ``ReduceOp(ReduceOp.MAX)`` (an object equal to it), ``sum`` for the default (None)."""
    if op is None:
        return "sum"
    name = getattr(op, "name", None)
    if isinstance(name, str):
        return name.lower()
    for member in dist.ReduceOp.RedOpType.__members__.values():
        if op == member:
            return member.name.lower()
    return "premul_sum" if isinstance(op, dist.ReduceOp) else str(op)


class Record:
    """One collective on one rank: what, where, when; ``end`` stays None while it is outstanding."""

    __slots__ = ("seq", "op", "tensor", "root", "reduction", "site", "via", "start", "end", "work", "error")

    def __init__(self, seq: int, op: str, tensor: Any, root: Any, site: Site | None, via: str | None,
                 reduction: str | None = None) -> None:
        self.seq, self.op, self.root, self.site, self.via = seq, op, root, site, via
        self.reduction = reduction  # for the reductions only: "sum", "max", ...
        # dtype and shape only: holding the tensor would keep its memory alive in the ring
        if isinstance(tensor, (list, tuple)):
            self.tensor = (len(tensor), tensor[0].dtype, tuple(tensor[0].shape)) if tensor else (0, None, ())
        else:
            self.tensor = None if tensor is None else (None, tensor.dtype, tuple(tensor.shape))
        self.start, self.end, self.work, self.error = time.monotonic(), None, None, None

    def what(self) -> str:
        """``float32[10, 3]``, ``4 x float32[10]`` for a list, ``from rank 0`` for a root; "" for a barrier."""
        text = ""
        if self.tensor is not None:
            count, dtype, shape = self.tensor
            text = f"{str(dtype).replace('torch.', '')}{list(shape)}" if dtype is not None else "[]"
            text = text if count is None else f"{count} x {text}"
        if self.root is not None:
            text = f"{text} {'from' if self.op in ('broadcast', 'scatter') else 'to'} rank {self.root}".strip()
        if self.reduction not in (None, "sum"):  # sum, the default, goes unsaid
            text = f"{text}, op={self.reduction}"
        return text

    def label(self) -> str:
        """``all_reduce #12 at train.py:88 in step()``: which collective, and where it was called."""
        return f"{self.op} #{self.seq} at {format_site(self.site)}"

    def describe(self, now: float) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "what": self.what(), "site": format_site(self.site),
                "via": self.via, "age": round(now - self.start, 1), "error": self.error,
                "outstanding": self.end is None, "blocking": self.work is None}


class GroupLog:
    """One process group's numbered collectives on this rank."""

    def __init__(self, name: str, ranks: list[int], default: bool) -> None:
        self.name, self.ranks, self.default = name, ranks, default
        self.seq = 0
        self.ring: collections.deque[Record] = collections.deque(maxlen=_RING)
        # async records still holding their Work, oldest first: a Work keeps its tensors alive, so
        # the ring must not hold one past its completion (with zero_grad(set_to_none=True), 64 of
        # them kept old gradients and made every backward allocate afresh: +7% on a DDP step)
        self.pending: collections.deque[Record] = collections.deque()

    def settle(self, now: float) -> None:
        """Let go of the Works at the head of ``pending`` that have completed (cheap: usually one
        ``is_completed()`` call per collective). Called by the thread issuing collectives only; the
        watchdog's ``poll_works`` marks records ended but leaves ``pending`` to it."""
        pending = self.pending
        while pending:
            record = pending[0]
            work = record.work
            if work and not work.is_completed():
                return
            pending.popleft()
            if record.end is None:
                record.end = now
            record.work = False  # False: it was async, and has completed

    def snapshot(self, now: float) -> dict[str, Any]:
        """The group's state as a report reads it; ``recent`` is the whole ring (where the ranks went
        apart may lie 50 collectives back: a few a step, for a dozen steps)."""
        records = list(self.ring)
        done = [r.seq for r in records if r.end is not None and r.error is None]
        return {"name": self.name, "ranks": self.ranks, "default": self.default, "seq": self.seq,
                "done": max(done) if done else 0,
                "waiting": [r.describe(now) for r in records if r.end is None or r.error],
                "recent": [r.describe(now) for r in records]}


class Recorder:
    """Wraps torch's collectives while installed; ``before`` (strict mode) and ``failed`` are hooks."""

    def __init__(self) -> None:
        self.logs: dict[Any, GroupLog | None] = {}
        self.before: Callable[[GroupLog, Record], None] | None = None
        self.failed: Callable[[Record, BaseException], None] | None = None
        self._inside = threading.local()
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[str, Callable] = {}
        self.p2p = PointToPointWaits()  # recv and send: timed for the watchdog, not numbered

    # ---- installing -------------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap the collectives, and the blocking recv and send (timed only), again after
        ``uninstall()`` reusing the wrappers: a few setattrs."""
        for op in (*COLLECTIVES, *P2P_CALLS):
            original = getattr(c10d, op)
            if getattr(original, "__ddpkit_recorder__", None) is self:
                continue
            self._originals[op] = original
            wrapper = self._wrappers.get(op)
            if wrapper is None or wrapper.__wrapped__ is not original:
                wrapper = self._wrappers[op] = (self._wrap(op, original, *COLLECTIVES[op]) if op in COLLECTIVES
                                                else self.p2p.wrap(original))
                wrapper.__ddpkit_recorder__ = self
            setattr(c10d, op, wrapper)
            if getattr(dist, op, None) is original:
                setattr(dist, op, wrapper)
        if self not in INSTALLED:
            INSTALLED.append(self)

    def uninstall(self) -> None:
        for op, original in self._originals.items():
            for module in (c10d, dist):
                if getattr(getattr(module, op, None), "__ddpkit_recorder__", None) is self:
                    setattr(module, op, original)
        self._originals.clear()
        if self in INSTALLED:
            INSTALLED.remove(self)

    def forget(self) -> None:
        """Let go of the groups, their records and the hooks, at the group's end: a record's Work and
        the logs' keys hold the process group, whose connections stay open while anything holds it
        (a peer waiting on this rank would not learn that it left until this process ends)."""
        self.logs.clear()
        self.before = self.failed = None

    def _wrap(self, op: str, fn: Callable, tensor_arg: str | None, root_arg: str | None) -> Callable:
        names = list(inspect.signature(fn).parameters)
        group_at, async_at = names.index("group"), names.index("async_op") if "async_op" in names else len(names)
        tensor_at = names.index(tensor_arg) if tensor_arg else None
        root_at = names.index(root_arg) if root_arg else None
        reduce_at = names.index("op") if "op" in names else None  # the reductions: strict mode compares it
        run = self.run

        @functools.wraps(fn)
        def collective(*args, **kwargs):
            group = kwargs["group"] if "group" in kwargs else args[group_at] if len(args) > group_at else None
            tensor = (kwargs.get(tensor_arg) if tensor_arg in kwargs else args[tensor_at]
                      if tensor_at is not None and len(args) > tensor_at else None)
            root = (kwargs.get(root_arg) if root_arg in kwargs else args[root_at]
                    if root_at is not None and len(args) > root_at else None)
            reduction = None if reduce_at is None else _reduction_name(
                kwargs.get("op") if "op" in kwargs else args[reduce_at] if len(args) > reduce_at else None)
            async_op = kwargs["async_op"] if "async_op" in kwargs else len(args) > async_at and args[async_at]
            return run(op, group, tensor, root, reduction, async_op, fn, args, kwargs)

        return collective

    def run(self, op: str, group: Any, tensor: Any, root: Any, reduction: str | None, async_op: bool,
            fn: Callable, args: tuple, kwargs: dict[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)``, the collective ``op`` on ``group``, as a record (the wrappers'
        body; ddpkit's DDP calls it for the collectives it issues itself, ``ddpkit.runtime.direct``)."""
        inside, kwargs = self._inside, kwargs or {}
        if getattr(inside, "depth", 0):  # torch calling one collective from another
            return fn(*args, **kwargs)
        log = self.logs.get(group)
        if log is None:
            log = self._log_for(group)
            if log is None:  # not a member, or not a group: torch's own checks answer
                return fn(*args, **kwargs)
        log.seq += 1
        site, via = call_site(3)  # past this method and the wrapper
        record = Record(log.seq, op, tensor, root, site, via, reduction)
        if log.pending:
            log.settle(record.start)
        log.ring.append(record)
        if self.before is not None:
            try:
                self.before(log, record)
            except BaseException as e:
                record.end, record.error = time.monotonic(), type(e).__name__
                raise
        inside.depth = 1
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            record.error = _short_error(e)
            record.end = time.monotonic()
            inside.depth = 0
            if self.failed is not None:
                self.failed(record, e)
            raise
        inside.depth = 0
        if async_op and result is not None:
            record.work = result
            log.pending.append(record)
        else:
            record.end = time.monotonic()
        return result

    def _log_for(self, group: Any) -> GroupLog | None:
        try:
            if group is not None and c10d._rank_not_in_group(group):
                return None
            pg = group if group is not None else c10d._get_default_group()
            default = pg is c10d._get_default_group()
            log = GroupLog(str(pg.group_name), dist.get_process_group_ranks(pg), default)
        except (AttributeError, RuntimeError, ValueError, TypeError):
            return None
        self.logs[group] = log
        if group is None or default:
            self.logs[None] = self.logs[pg] = log
        return log

    # ---- what the watchdog reads ------------------------------------------------------------------
    def groups(self) -> list[GroupLog]:
        unique: dict[int, GroupLog] = {}
        for log in list(self.logs.values()):
            if log is not None:
                unique[id(log)] = log
        return list(unique.values())

    def poll_works(self) -> None:
        """Mark async collectives whose ``Work`` has completed as ended (and drop the Work)."""
        now = time.monotonic()
        for log in self.groups():
            for record in list(log.pending):  # the records that still hold a Work
                work = record.work
                if work and record.end is None and work.is_completed():
                    record.end, record.work = now, False  # False: it was async, and has completed

    def blame_async(self, error: BaseException) -> None:
        """An async collective's failure surfaced in ``Work.wait()``, past the wrapper: pin it on the
        latest async collective, which completed (with that error) as far as the ring knows."""
        self.poll_works()
        done = [r for log in self.groups() for r in list(log.ring) if r.work is False and r.error is None]
        if done:
            max(done, key=lambda r: r.start).error = _short_error(error)

    def latest_failed(self) -> Record | None:
        failed = [r for log in self.groups() for r in list(log.ring) if r.error is not None]
        return max(failed, key=lambda r: r.start) if failed else None

    def oldest_outstanding(self) -> Record | None:
        oldest = None
        for log in self.groups():
            for record in list(log.ring):
                if record.end is None and (oldest is None or record.start < oldest.start):
                    oldest = record
        return oldest
