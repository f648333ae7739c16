"""The private autograd calls ddpkit makes, in one place, each saying why no public API would do.

DistributedDataParallel needs three things that torch offers only privately: a callback when the
engine has finished a backward pass (to wait for the all-reduces once), collectives launched without
the Python object that backward keeps in C++ thread-local state, and buffers overwritten by a
broadcast without bumping their autograd versions. It also hooks each parameter's gradient
accumulator, a public node whose lifetime rule is not written down.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, ContextManager, Iterator, Sequence

import torch

from ddpkit.ddp.compile_support import dynamo_free
from ddpkit.errors import explain

__all__ = ["gradient_accumulator", "outside_backward_python_context", "preserving_autograd_versions",
           "queue_end_of_backward_callback", "without_grad"]

_BACKWARD_STASHES_CONTEXT = hasattr(torch._C, "_is_key_in_tls")
_NOTHING: ContextManager[None] = contextlib.nullcontext()  # reusable: it keeps no state


def without_grad() -> ContextManager[None]:
    """``torch.no_grad()`` where grad mode is on, else nothing to enter. A backward without
    ``create_graph`` runs its hooks and its end-of-backward callbacks with grad mode off already;
    entering ``no_grad`` there anyway cost 3 to 9 us a call, several times a step on the hot path."""
    return torch.no_grad() if torch.is_grad_enabled() else _NOTHING


def gradient_accumulator(param: torch.Tensor) -> torch.autograd.graph.Node:
    """The AccumulateGrad node of a leaf ``param``: where torch's own reducer hooks in.

    A post-hook on it runs once the gradient is in ``.grad`` and after the tensor's post-accumulate-
    grad hooks, so a gradient a user's hook clips or rescales is the one averaged. The parameter
    holds its node only weakly: the caller must keep it, or a later backward would build a new one
    without the hook.
    """
    get_gradient_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if get_gradient_edge is not None:
        return get_gradient_edge(param).node
    return param.view_as(param).grad_fn.next_functions[0][0]


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the autograd engine has finished the current backward pass.

    ``Variable._execution_engine.queue_callback`` is what
    torch's own DDP uses for the same purpose; there is no public equivalent. It must be called
    from inside a running backward pass (here: from a parameter's gradient-accumulator hook).

    Compiled autograd traces the backward instead of running it, and refuses the callback with an
    AssertionError about ``fullgraph``; torch's C++ reducer is refused there too, by name.
    """
    callback = dynamo_free(callback)  # a backward() inside a compiled frame: see compile_support
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled is not None and compiled.in_compiled_autograd_region:
        raise RuntimeError(explain(
            "Compiled autograd is not compatible with ddpkit's DDP reducer, as it is not with torch's C++ "
            "DDP Reducer: its hooks wait for the all-reduces in a callback at the end of backward, which "
            "compiled autograd cannot trace.",
            "set torch._dynamo.config.optimize_ddp = \"python_reducer\" before building the DDP (it then "
            "averages each gradient with a collective compiled autograd traces, as torch's DDP does), or "
            "run backward without compiled autograd (torch.compile of the model itself is supported)."))
    torch.autograd.Variable._execution_engine.queue_callback(callback)


@contextlib.contextmanager
def outside_backward_python_context() -> Iterator[None]:
    """Launch collectives from a backward pass without its Python context in their thread state.

    torch stashes a ``contextvars.Context`` in C++ thread-local state for the length of
    ``backward()`` ("context" key, where that key exists), and every collective snapshots that state
    into its Gloo work. When the Gloo thread drops the last reference to such a work while the
    interpreter is exiting, freeing the Python object needs the GIL and the process dies with
    "terminate called without an active exception". The collectives need nothing from that context,
    so they are launched without it: see Note [Private autograd calls] in docs/design.md.
    """
    if not (_BACKWARD_STASHES_CONTEXT and torch._C._is_key_in_tls("context")):
        yield
        return
    context = torch._C._get_obj_in_tls("context")
    torch._C._remove_obj_from_tls("context")
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls("context", context)


def preserving_autograd_versions(tensors: Sequence[torch.Tensor]) -> ContextManager[None]:
    """Overwrite ``tensors`` in place without bumping their autograd version counters.

    torch's own DDP broadcasts buffers the same way (``_unsafe_preserve_version_counter``): rank 0's
    buffers replace ours before a forward, and a graph built by an earlier forward of the same
    iteration (two forwards, one backward) may have saved them; a bumped version would make its
    backward refuse them, though their values are the ones every rank agrees on.
    """
    return torch.autograd._unsafe_preserve_version_counter(tuple(tensors))
