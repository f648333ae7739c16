"""DDP's collectives, issued to the process group itself, as torch's reducer issues them.

``dist.all_reduce`` and ``dist.broadcast`` check and convert their arguments in Python before they
call the process group. On DDP's own calls (a dense tensor, on a group this rank is in) the checks
have nothing to find, and inside a training step that layer cost 20-45 us a call (a world of two
on the CPU, conv net A/B; Note [Collectives past torch's Python] in docs/design.md). torch's DDP
issues its collectives from C++ and pays none of it. These functions call the process group
directly and still go through the hang recorder when it is installed. A function someone else put
in place of ``dist.all_reduce`` or ``dist.broadcast`` (a profiler's, a test's) is respected: the
call then goes through it, as before.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.overrides import has_torch_function

__all__ = ["all_reduce", "broadcast"]


def _torchs(fn: Callable) -> Callable | None:
    """``fn`` if torch.distributed defined it (torch decorates its collectives in ``c10d_logger.py``),
    seen through the hang recorder of an ``init()`` that came before this module loaded (``ddpkit``
    loads its parts on first use); else None: a wrapper put in its place before is never skipped."""
    if getattr(fn, "__ddpkit_recorder__", None) is not None:
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    return fn if code is not None and code.co_filename.startswith(_TORCH_DISTRIBUTED) else None


_TORCH_DISTRIBUTED = os.path.dirname(dist.__file__) + os.sep
# torch's own functions, as ddpkit found them on import (before ddpkit.init() wraps them)
_TORCH_ALL_REDUCE = _torchs(c10d.all_reduce)
_TORCH_BROADCAST = _torchs(c10d.broadcast)
_SUM = dist.AllreduceOptions()
_SUM.reduceOp = dist.ReduceOp.SUM


def _recorder_of(fn: Callable, original: Callable) -> Any:
    """The hang recorder whose wrapper ``fn`` is, around torch's ``original``; else None."""
    recorder = getattr(fn, "__ddpkit_recorder__", None)
    return recorder if recorder is not None and getattr(fn, "__wrapped__", None) is original else None


def _own_group(group: Any) -> Any:
    return c10d._get_default_group() if group is None else group


def _all_reduce(tensor: torch.Tensor, group: Any) -> Any:
    if tensor.is_complex():  # as torch's all_reduce: a sum of complex numbers is one of their parts
        tensor = torch.view_as_real(tensor)
    return _own_group(group).allreduce([tensor], _SUM)


def all_reduce(tensor: torch.Tensor, group: Any = None) -> Any:
    """``dist.all_reduce(tensor, group=group, async_op=True)``, a sum; returns its Work."""
    fn = dist.all_reduce
    if _TORCH_ALL_REDUCE is not None and not has_torch_function((tensor,)):
        if fn is _TORCH_ALL_REDUCE:
            return _all_reduce(tensor, group)
        recorder = _recorder_of(fn, _TORCH_ALL_REDUCE)
        if recorder is not None:
            return recorder.run("all_reduce", group, tensor, None, "sum", True, _all_reduce, (tensor, group))
    return fn(tensor, group=group, async_op=True)


def _broadcast(tensor: torch.Tensor, src: int, group: Any) -> None:
    pg = _own_group(group)
    opts = dist.BroadcastOptions()
    opts.rootRank = src if pg is c10d._get_default_group() else c10d.get_group_rank(pg, src)
    opts.rootTensor = 0
    if hasattr(opts, "asyncOp"):  # torch >= 2.7: a synchronous call may run on the current stream
        opts.asyncOp = False
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    work = pg.broadcast([tensor], opts)
    if work is not None:
        work.wait()


def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """``dist.broadcast(tensor, src=src, group=group)``: from global rank ``src``, waited for (DDP
    sends bytes; torch's conversion of float8 for GPUs older than sm90 is not done here)."""
    fn = dist.broadcast
    if _TORCH_BROADCAST is not None and not has_torch_function((tensor,)):
        if fn is _TORCH_BROADCAST:
            return _broadcast(tensor, src, group)
        recorder = _recorder_of(fn, _TORCH_BROADCAST)
        if recorder is not None:
            return recorder.run("broadcast", group, tensor, src, None, False, _broadcast, (tensor, src, group))
    fn(tensor, src=src, group=group)
    return None
