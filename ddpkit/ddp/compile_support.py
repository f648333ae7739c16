"""``torch.compile`` and ddpkit's DDP: the treatment Dynamo gives torch's DDP, in both orders.

    torch.compile(DDP(model))     DDP's forward runs eagerly; ``model``'s forward is compiled
    DDP(torch.compile(model))     the same, with no break in DDP's own code

Two things make the compiled backward overlap the all-reduces as it does for torch's DDP:

* **Eager bookkeeping.** ``eager`` marks DDP's forward (``_forward``) for Dynamo to skip, and only it: what it
  calls (the wrapped module) is still compiled; torch marks its own ``_inside_ddp_forward`` so
  (``torch._disable_dynamo(recursive=False)``, which imports Dynamo on its first call). The
  pre/post-forward bookkeeping (reducer state, Join, buffer broadcast, hooks on the outputs) reads
  ``grad_fn`` and calls collectives; traced, it broke the graph six times and warned on every
  rank. ``bookkeeping`` keeps Dynamo out of it and all it calls, as torch's C++ reducer is. Under
  ``optimize_ddp="python_reducer"`` there is no bookkeeping to keep out, and the forward is traced
  whole, as torch's is there (``fullgraph=True`` works).
* **DDPOptimizer.** When Dynamo compiles a frame it asks ``DistributedDataParallel.
  _get_active_ddp_module()`` (torch's class) whether a DDP forward is running; if one is, its
  DDPOptimizer splits the graph at bucket boundaries of ``bucket_bytes_cap`` bytes, so each bucket's
  gradients are ready (and ddpkit's hooks launch its all-reduce) while the rest of backward runs.
  torch offers no registration for other wrappers; the answer is the class attribute
  ``_active_ddp_module``, which torch's DDP sets around its module's forward and restores after.
  ``inside_ddp_forward`` sets it to ddpkit's DDP the same way: torch's DDP is neither subclassed
  nor constructed, and a torch DDP forward nested inside (or around) restores it as its own does.
  Dynamo reads the attribute through that classmethod (checked on torch 2.13); a torch without
  either (``ADAPTED`` False) is left alone, and a compiled module in ddpkit's DDP is then one
  graph whose gradients all become ready at its end.
"""
from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

__all__ = ["ACTIVE_SLOT", "ADAPTED", "eager", "bookkeeping", "DYNAMO_CALLBACK", "inside_ddp_forward",
           "never_compiled", "outside_dynamo", "dynamo_free", "HOOK_CALLBACK"]

ACTIVE_SLOT = "_active_ddp_module"
"""torch's DDP class attribute that Dynamo reads (via ``_get_active_ddp_module``) for DDPOptimizer."""

ADAPTED = hasattr(TorchDDP, ACTIVE_SLOT) and callable(getattr(TorchDDP, "_get_active_ddp_module", None))
"""Whether this torch reads the active DDP module as 2.0 to 2.13 do."""

_F = TypeVar("_F", bound=Callable[..., Any])


def eager(forward: _F) -> _F:
    """``forward`` runs outside Dynamo's graph, its callees compiled (torch's decorator for this)."""
    return torch._disable_dynamo(forward, recursive=False)


def bookkeeping(method: _F) -> _F:
    """``method`` and all it calls run outside Dynamo: no frame of the reducer is compiled (its
    ``.tolist()``, pybind collective options and ``grad_fn`` reads each broke a graph). The wrapper
    costs 15 us a call; where no Dynamo callback is installed (``DYNAMO_CALLBACK``) the caller runs
    the method itself, ``plain``, instead: there is no Dynamo to keep out."""
    disabled = torch._disable_dynamo(method, recursive=True)
    disabled.plain = method  # type: ignore[attr-defined]
    return disabled


def _release() -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


_get_callback = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback",
                        None)
DYNAMO_CALLBACK: Callable[[], Any] | None = _get_callback if _release() >= (2, 13) else None
"""Reads the callback Dynamo runs each new Python frame through: None while no torch.compile runs
around the call. A C function, so an ``eager`` frame calls it without entering a frame that Dynamo
would compile. Only from torch 2.13 (checked: None's reference count stays put over 100,000
calls): some earlier releases return the callback without a new reference, and each call would
take one from it. None elsewhere: the bookkeeping then always goes through the wrapper."""


@contextlib.contextmanager
def inside_ddp_forward(ddp: torch.nn.Module) -> Iterator[None]:
    """While the wrapped module runs, Dynamo sees ``ddp`` as the active DDP module (DDPOptimizer)."""
    if not ADAPTED:
        yield
        return
    previous = getattr(TorchDDP, ACTIVE_SLOT)
    setattr(TorchDDP, ACTIVE_SLOT, ddp)
    try:
        yield
    finally:
        setattr(TorchDDP, ACTIVE_SLOT, previous)


# The reducer's autograd callbacks (gradient hooks, the end-of-backward callback) are Python. When a
# compiled function calls backward() (``torch.compile`` around a whole training step, its backward a
# graph break), they run while Dynamo's frame callback is installed, and Dynamo would compile them:
# a collective traced there fails ("Attempted to access unregistered member on an OpaqueObject"),
# where torch's are C++. So their own frames are marked for Dynamo to run as they are, and they turn
# the callback off for what they call. Only from torch 2.13, as DYNAMO_CALLBACK.
_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_RUN_AS_IS = (_eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.DEFAULT)
              if DYNAMO_CALLBACK is not None and hasattr(_eval_frame, "set_code_exec_strategy") else None)
HOOK_CALLBACK: Callable[[], Any] | None = DYNAMO_CALLBACK if _RUN_AS_IS is not None else None
"""What a per-parameter hook reads to see a compile around its backward, inlined in the hook (one C
call, no frame: ``if HOOK_CALLBACK is not None and HOOK_CALLBACK() is not None: return
outside_dynamo(...)``); None where its frames cannot be marked, as ``dynamo_free`` then does nothing."""


def never_compiled(fn: _F) -> _F:
    """Dynamo runs ``fn``'s own frames as they are, without compiling them (what ``fn`` calls it still
    considers: ``fn`` calls ``outside_dynamo`` for that)."""
    if _RUN_AS_IS is not None:
        _eval_frame.set_code_exec_strategy(fn.__code__, _RUN_AS_IS)
    return fn


@never_compiled
def outside_dynamo(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with Dynamo's frame callback off, as ``torch._disable_dynamo`` runs a function."""
    prior = _eval_frame.set_eval_frame(None)
    try:
        return fn(*args)
    finally:
        _eval_frame.set_eval_frame(prior)


def dynamo_free(fn: _F) -> _F:
    """``fn`` as an autograd callback that Dynamo never compiles; where no compile runs, one C call
    more. For a per-parameter hook, the check inlined in the hook itself saves the extra frame."""
    if HOOK_CALLBACK is None:
        return fn
    return functools.partial(_run_dynamo_free, fn)  # type: ignore[return-value]


@never_compiled  # once, here: marked per call, each wrapper set its shared code's strategy again
def _run_dynamo_free(fn: Callable[..., Any], *args: Any) -> Any:
    if HOOK_CALLBACK() is None:
        return fn(*args)
    return outside_dynamo(fn, *args)

