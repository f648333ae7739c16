"""Pickling DistributedDataParallel: ``copy.deepcopy`` (an EMA or teacher copy) and ``torch.save``
of the wrapper, by torch's rule: without the process group and the reducer, which the copy makes
anew on the default group."""
from __future__ import annotations

from typing import Any

from torch import nn

from ddpkit.ddp.ddp_logger import DDPLogger
from ddpkit.ddp.python_reducer import python_reducer_for
from ddpkit.ddp.solo_checks import solo_checks_for
from ddpkit.ddp.state_sync import default_group
from ddpkit.errors import explain

__all__ = ["PicklingSupport"]


class PicklingSupport(nn.Module):
    """The pickling half of DistributedDataParallel (which supplies ``_join_group``,
    ``_make_reducer`` and ``_parameters_to_reduce``)."""

    def __getstate__(self) -> dict[str, Any]:
        """torch's rule: without the process group and the reducer, which the copy makes anew."""
        if self.process_group is not default_group():
            raise RuntimeError(explain(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process group: "
                "DistributedDataParallel can be pickled or deep-copied only when it uses the default "
                "process group (the copy joins the default group).",
                "copy or save its .module and wrap that in a new DistributedDataParallel."))
        if self._delayed is not None:
            raise NotImplementedError("DistributedDataParallel with delay_all_reduce_named_params cannot be "
                                      "pickled or deep-copied. HINT: copy or save its .module instead.")
        state = super().__getstate__()
        del state["process_group"], state["reducer"], state["logger"]
        state["_python_reducer"] = state["_solo"] = None  # their hooks are on the original's parameters
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The copy averages its own parameters' gradients over the default group; its comm hook,
        as in torch, is not carried over."""
        super().__setstate__(state)
        self._join_group(default_group())
        self.reducer = None
        self.logger = DDPLogger(self)
        # a world of one has no reducer to refuse a module without trained parameters
        named = self._parameters_to_reduce(delayed_too=self.world_size == 1)
        if self.world_size > 1:  # as the constructor chooses
            self._python_reducer = python_reducer_for(self, [p for _, p in named])
            if self._python_reducer is None:
                self.reducer = self._make_reducer(named)
        self._solo = solo_checks_for(self, named)
        self._log_construction()
