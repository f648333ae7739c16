"""``ddpkit.SyncBatchNorm``: torch's SyncBatchNorm that also trains on CPU over Gloo.

torch's ``nn.SyncBatchNorm.forward`` raises unless the input is on a GPU (its Function calls CUDA
kernels). This layer keeps torch's constructor, arguments, buffers and state-dict keys; only the training
forward differs: it synchronises through ``SyncBatchNormFunction`` (plain tensor ops and collectives)
on any device. It is deliberately a ``_BatchNorm`` and not an ``nn.SyncBatchNorm``: torch's DDP refuses
to wrap a CPU module holding an ``nn.SyncBatchNorm`` ("SyncBatchNorm layers only work with GPU
modules"). Evaluation with running statistics, a world of one and a rank outside ``process_group``
need no communication and run plain ``F.batch_norm``, as torch's does.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit.ddp.sync_batchnorm_function import SyncBatchNormFunction

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation with statistics over the batches of every rank in ``process_group``.

    Same arguments as ``torch.nn.SyncBatchNorm`` (``num_features, eps, momentum, affine,
    track_running_stats, process_group, device, dtype``, keyword ``bias``); ``process_group=None``
    means the default group. Outputs, gradients and running statistics equal ``nn.BatchNorm`` run on
    the concatenation of the ranks' batches (uneven or empty ones included).

    Example::

        model = ddpkit.SyncBatchNorm.convert_sync_batchnorm(model)   # every BatchNorm*D
        model = ddpkit.DDP(model)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any | None = None, device=None, dtype=None,
                 *, bias: bool = True) -> None:
        # ``bias`` goes on only when False: torch before 2.12 has no such argument (nor bias-less BatchNorm)
        no_bias = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         **no_bias)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:  # torch's words: BatchNorm1d, 2d and 3d each take any rank of 2 or more here
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` (N, C, ...); in training, with the group's global batch statistics."""
        self._check_input_dim(input)
        momentum = self._average_factor()
        # batch statistics in training, and in eval when there are no running statistics to use
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        # running statistics are handed over only where they are used or updated
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        group, world_size = self._sync_group() if self.training else (None, 1)
        if world_size <= 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training,
                                momentum, self.eps)
        return SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var,
                                           self.eps, momentum, group, world_size)

    def _average_factor(self) -> float:
        """The weight of this batch in the running statistics (counting it in ``num_batches_tracked``);
        ``momentum=None`` gives the cumulative average, ``1 / num_batches_tracked``."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked.item())
        return factor

    def _sync_group(self) -> tuple[dist.ProcessGroup | None, int]:
        """The group to synchronise over and its size; size 1 (no communication) without a process
        group, in a world of one, or on a rank that is not a member of ``process_group``."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)  # -1 on a rank outside the group
        return group, max(world_size, 1)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: dist.ProcessGroup | None = None
                               ) -> nn.Module:
        """Replace every ``BatchNorm*D`` in ``module`` by a ``ddpkit.SyncBatchNorm``, as torch's does.

        The new layers share the old ones' parameters and buffers (so names and state-dict keys are
        unchanged) and take their ``training`` flag and ``qconfig``. Returns ``module`` itself, or a new
        layer when ``module`` is a BatchNorm.
        """
        converted = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group,
                            bias=module.bias is not None or not module.affine)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
