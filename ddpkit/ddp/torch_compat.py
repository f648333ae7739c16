"""torch's DDP members that libraries and scripts reach for, beyond the constructor and forward.

``DistributedDataParallel`` inherits this mixin: torch's private configuration calls (which torch's
own error messages recommend) and the attributes of torch's DDP that ddpkit keeps with torch's
meaning. Which private members are here, who calls them, and why: docs/torch-compat.md.
"""
from __future__ import annotations

import warnings

from torch import nn

__all__ = ["TorchCompat"]


class TorchCompat:
    """torch's private calls on a DDP, for ``DistributedDataParallel`` (which sets the attributes read)."""

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """Keep these fully qualified parameter and buffer names out of any DDP wrapping ``module``
        later: not broadcast, not checked across ranks, not averaged."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    def _set_static_graph(self) -> None:
        """``static_graph=True`` after construction, before the first forward (torch's call)."""
        if self.static_graph:
            warnings.warn("static_graph is already True; _set_static_graph() changes nothing.", stacklevel=2)
            return
        if self.reducer is not None:
            self.reducer.set_static_graph()
        self.static_graph = True
