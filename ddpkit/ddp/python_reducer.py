"""torch's "python reducer": what DistributedDataParallel does when
``torch._dynamo.config.optimize_ddp = "python_reducer"`` is set before it is built.

Compiled autograd traces a backward pass into a graph, and a reducer's bucket hooks and end-of-
backward wait cannot be traced. torch's DDP then drops its reducer for a post-accumulate-grad hook
per parameter that all-reduces that one gradient with a functional collective, which compiled
autograd traces and inductor may fuse again. ddpkit's DDP does the same, with torch's semantics:
no buffer broadcast in forward, ``no_sync`` honoured, comm hooks called as
``hook(state, (grad, param))``; outside a trace, the future a hook returns is waited for, where
torch's python reducer drops it (see ``_take``).
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["PythonReducer", "python_reducer_for", "python_reducer_requested"]


def python_reducer_requested() -> bool:
    """Whether Dynamo's ``optimize_ddp`` asks for the python reducer (Dynamo not imported: no)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    from torch._dynamo.utils import get_optimize_ddp_mode

    return get_optimize_ddp_mode() == "python_reducer"


def python_reducer_for(ddp: Any, params: Sequence[torch.Tensor]) -> PythonReducer | None:
    """The python reducer of ``ddp`` over ``params`` when Dynamo asks for one, else None (the caller
    builds its bucket reducer): the one choice for the constructor and an unpickled copy alike."""
    return PythonReducer(ddp, params, ddp.process_group) if python_reducer_requested() else None


def _fuse_in_inductor(cap_bytes: int) -> None:
    """What torch's DDP sets in this mode: inductor fuses the per-parameter all-reduces of a compiled
    backward into buckets of ``bucket_cap_mb`` (without it, one all-reduce per parameter)."""
    import torch._inductor.config as inductor

    mb = cap_bytes / 2**20
    inductor._fuse_ddp_communication = True
    inductor._fuse_ddp_bucket_size = int(mb) if mb == int(mb) else mb


class PythonReducer:
    """One gradient hook per parameter: average ``param.grad`` over ``group`` as soon as it is ready."""

    def __init__(self, ddp: Any, params: Sequence[torch.Tensor], group: Any) -> None:
        import torch.distributed._functional_collectives as fcol  # once, not per gradient

        self._ddp = weakref.ref(ddp)  # the hooks live on the parameters, which outlive no DDP
        self._all_reduce = fcol.all_reduce
        self.group = group
        self.comm_hooks: list[tuple[Callable, Any]] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                        for p in params if p.requires_grad]
        _fuse_in_inductor(ddp.bucket_bytes_cap)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        ddp = self._ddp()
        if ddp is None or not ddp.require_backward_grad_sync or param.grad is None:
            return
        if self.comm_hooks:
            for hook, state in self.comm_hooks:
                result = hook(state, (param.grad, param))
                if isinstance(result, torch._C.Future):  # eager, not traced (see _take); then() gives a _C one
                    _take(param, result.wait())
            return
        gradient = param.grad / dist.get_world_size(self.group)
        param.grad.copy_(self._all_reduce(gradient, "sum", self.group))


def _take(param: torch.Tensor, value: Any) -> None:
    """A comm hook's result, waited for in eager mode: the average is final when backward returns,
    and the Work's callback has run before the script may exit. torch's python reducer drops the
    future: the hook's all-reduce then races the optimizer, and a callback still running in Gloo's
    thread at exit aborts the process ("terminate called without an active exception")."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    grad = param.grad
    if isinstance(value, torch.Tensor) and grad is not None and value.data_ptr() != grad.data_ptr():
        grad.copy_(value)  # a hook that returns the average in a tensor of its own
