"""``ddpkit.hooks``: DDP comm hooks, as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``
(they live in ``ddpkit.ddp.hooks``)."""
from __future__ import annotations

from ddpkit.ddp.hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]
