"""The reducer's checks in a world of one, where there is nothing to average.

``torchrun --nproc-per-node 1`` (or a group made by hand) gives a process group of one. There
ddpkit's DDP has no reducer: each gradient is its own average, and the buckets' copies and
collectives would be time spent for nothing. torch's reducer runs anyway, and so raises, at one rank,
the errors a script meets on its first step at eight: a backward that leaves parameters without a
gradient (find_unused_parameters=False), or gives one a gradient twice (reentrant checkpointing).
These hooks only count, so that the same script fails the same way here: one Python call per
parameter and step, no copy and no collective. Not installed with find_unused_parameters or
static_graph, which accept both, nor in the single-process fallback (no launcher, with or without
``ddpkit.init()``), where DDP is a plain wrapper.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

import torch

from ddpkit.ddp import errors
from ddpkit.ddp.autograd_engine import gradient_accumulator, queue_end_of_backward_callback
from ddpkit.ddp.compile_support import HOOK_CALLBACK as _HOOK_CALLBACK
from ddpkit.ddp.compile_support import dynamo_free, never_compiled, outside_dynamo
from ddpkit.ddp.outputs import backward_entries
from ddpkit.ddp.parameter_watch import ParameterWatch
from ddpkit.ddp.python_reducer import python_reducer_requested
from ddpkit.runtime.process_group import current_env

__all__ = ["SoloChecks", "solo_checks_for"]

_IDLE, _ARMED, _RUNNING = range(3)  # after a backward: idle until the next synced forward arms the count


class SoloChecks:
    """Count each parameter's gradients in a synced backward; raise as the reducer would."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], logger: Any,
                 watch: ParameterWatch | None = None) -> None:
        self.names = list(names)
        self.logger = logger  # the DDP's: an error raised here is its last error, as the reducer's
        self.watch = watch  # what became of the parameters that got no gradient, for the error
        self.enabled = True  # False once _set_static_graph() says the graph is static
        self._ready = [False] * len(self.names)
        self._phase = _IDLE
        self._queued = False  # the end-of-backward check is queued in the running backward
        # kept: the parameter holds its node only weakly (see gradient_accumulator)
        self._accumulators = [gradient_accumulator(p) for p in params]
        on_grad = type(self)._on_grad
        for i, acc in enumerate(self._accumulators):
            acc.register_hook(functools.partial(on_grad, self, i))

    def prepare_for_forward(self) -> None:
        """Before a synced forward: a backward that began must have ended (it raised midway,
        and the script caught it), as the reducer says once at that forward."""
        if self._phase == _RUNNING:
            self._reset()
            raise self.logger.logged(errors.unfinished_backward_error(0))

    def prepare_for_backward(self, synced: bool, output: Any) -> None:
        """After a forward: ``synced`` (grad mode, outside ``no_sync``) arms the count, and the
        outputs' gradient hooks say where the backward ends (the first parameter's gradient may come
        from a reentrant checkpoint's inner backward, which ends first); else the next backward is
        a local one, as the reducer's."""
        self._queued = False
        if not (synced and self.enabled):
            self._phase = _IDLE
            return
        self._phase = _ARMED
        for t in backward_entries(output):
            t.register_hook(dynamo_free(self._on_output_grad))

    def disable(self) -> None:
        """The checks end: the graph was declared static, or a reducer now runs (a comm hook)."""
        self.enabled = False
        self._reset()

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._phase == _ARMED and not self._queued and not _in_compiled_autograd():
            self._queued = True
            queue_end_of_backward_callback(self._finish)

    @never_compiled  # see ddpkit.ddp.compile_support
    def _on_grad(self, index: int, *_: Any) -> None:
        if _HOOK_CALLBACK is not None and _HOOK_CALLBACK() is not None:  # backward() in a compiled frame
            return outside_dynamo(self._on_grad, index)
        phase = self._phase
        if phase != _RUNNING:
            # a later backward of this iteration (GPipe's microbatches through a pipeline stage,
            # which runs a group of one's DDP as a plain module) is no error, and torch says nothing
            if phase != _ARMED or _in_compiled_autograd():
                return
            self._phase = _RUNNING
            if not self._queued:  # a backward that did not come through the outputs
                self._queued = True
                queue_end_of_backward_callback(self._finish)
        ready = self._ready
        if ready[index]:
            self._reset()
            raise self.logger.logged(errors.second_gradient_error(0, self.names[index], True))
        ready[index] = True

    def _finish(self) -> None:
        """End of the backward: every parameter must have had its gradient. A backward that reached
        none (``torch.autograd.grad`` for a penalty on the input) leaves the count armed."""
        self._queued = False
        if self._phase != _RUNNING:
            return
        missing = [name for name, ready in zip(self.names, self._ready) if not ready]
        self._reset()
        if missing:
            changed = {0: self.watch.changes(missing)} if self.watch is not None else None
            raise self.logger.logged(errors.unused_gradient_error(0, [(0, missing)], False, changed))

    def _reset(self) -> None:
        self._ready = [False] * len(self.names)
        self._phase = _IDLE


def solo_checks_for(ddp: Any, named: Sequence[tuple[str, torch.nn.Parameter]]) -> SoloChecks | None:
    """The checks for ``ddp`` in a group of one, where torch's reducer would raise; else None."""
    if (ddp.process_group is None or ddp.world_size != 1 or not named or ddp.find_unused_parameters
            or ddp.static_graph or python_reducer_requested() or _single_process_fallback()):
        return None
    return SoloChecks([p for _, p in named], [n for n, _ in named], ddp.logger,
                      ParameterWatch(ddp.module, named, ddp.parameters_to_ignore))


def _single_process_fallback() -> bool:
    """``ddpkit.init()`` in a plain ``python`` run: its group of one serves the collectives, and
    DDP stays the plain wrapper the contract promises there."""
    env = current_env()
    return env is not None and env.launcher == "single"


def _in_compiled_autograd() -> bool:
    """Compiled autograd traces the backward and refuses end-of-backward callbacks; it has no
    reducer to finish either, so nothing is counted there."""
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled is not None and bool(compiled.in_compiled_autograd_region)
