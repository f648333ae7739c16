"""ddpkit's own DistributedDataParallel: torch's constructor and results, its reducer in Python.

``distributed`` is the module users wrap their model in; ``arguments`` checks what it is given and
``outputs`` walks what its forward returns; ``reducer`` averages gradients during backward, keeping
each ``iteration``'s state, the parameters' ``usage`` (find_unused_parameters, static_graph), the
``bucket``s laid out by ``bucket_layout``, and the ``collectives`` that reduce them; ``join`` shadows
collectives for ranks out of data; ``hooks`` are the comm hooks; ``errors`` words backward's
failures; ``autograd_engine`` holds the private autograd calls, each with its reason.
"""
from __future__ import annotations

from ddpkit.ddp import hooks
from ddpkit.ddp.distributed import DDP, DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel", "hooks"]
