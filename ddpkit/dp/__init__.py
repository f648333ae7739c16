"""Single-process DataParallel from four primitives, on CUDA and CPU devices alike.

``scatter_gather`` splits inputs and joins outputs, ``replicate`` copies the module differentiably,
``parallel_apply`` runs the replicas in threads, ``data_parallel`` composes them; ``nested`` is the one
walker of nested inputs and outputs (DDP's too), ``devices`` parses what names a device and
``torch_names`` accepts torch's keyword names for the primitives' arguments.
"""
from __future__ import annotations

from ddpkit.dp.data_parallel import DataParallel, data_parallel
from ddpkit.dp.parallel_apply import parallel_apply

# Imported here, once, as torch.nn.parallel does: the modules share their name with the function
# they export, and these imports leave each package attribute bound to the function for good.
from ddpkit.dp.replicate import replicate
from ddpkit.dp.scatter_gather import gather, scatter, scatter_kwargs

__all__ = ["DataParallel", "data_parallel", "gather", "parallel_apply", "replicate", "scatter",
           "scatter_kwargs"]
