"""ddpkit's own DistributedDataParallel: torch's constructor and results, its reducer in Python.

``distributed`` is the module users wrap their model in: ``arguments`` checks what it is given,
``outputs`` walks what its forward returns, ``state_sync`` copies rank 0's parameters and buffers.
The reducer averages gradients during backward: ``reducer`` coordinates (the gradient hook and the
one wait point), ``iteration`` holds one iteration's state, ``usage`` accounts for unused parameters
and static_graph, ``collectives`` launches each bucket's all-reduce or comm hook, ``bucket_groups``
decides which parameters share a ``bucket`` and ``bucket_layout`` holds the buckets and rebuilds
them. ``join`` lets ranks out of data
shadow the others; ``hooks`` are the comm hooks; ``errors`` words backward's failures, and
``parameter_watch`` says which parameters changed after wrapping;
``autograd_engine`` holds the private autograd calls, each with its reason. ``ddp_class_checks``
widens torch's checks for its DDP class to ddpkit's (distributed-checkpoint keys without ``module.``,
pipeline stages), installed on import here;
``compile_support`` gives it Dynamo's treatment of torch's DDP under ``torch.compile``; ``pickling``
is deepcopy and torch.save of the wrapper.
``sync_batchnorm`` is SyncBatchNorm (statistics over every rank's batch, on CPU too), its autograd
Function in ``sync_batchnorm_function``.
"""
from __future__ import annotations

from ddpkit.ddp import ddp_class_checks, hooks
from ddpkit.ddp.distributed import DDP, DistributedDataParallel
from ddpkit.ddp.sync_batchnorm import SyncBatchNorm

ddp_class_checks.install()

__all__ = ["DDP", "DistributedDataParallel", "SyncBatchNorm", "hooks"]
