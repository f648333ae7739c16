"""Communication hooks for ``DistributedDataParallel.register_comm_hook``.

Same contract and semantics as torch's ``ddp_comm_hooks.default_hooks``: ``hook(state, bucket)``
gets the process group (None: the default group) and a bucket with unscaled gradients in
``bucket.buffer()``, and returns a ``torch.futures.Future`` whose value is the averaged buffer.

    ddp.register_comm_hook(None, ddpkit.hooks.fp16_compress_hook)

The annotations are the objects themselves, not strings: torch's DDP compares the return annotation
with ``torch.futures.Future[torch.Tensor]``, so these hooks work with it too. As torch's, they also
take the ``(grad, param)`` pair that the compiled python reducer
(``torch._dynamo.config.optimize_ddp = "python_reducer"``) passes for a bucket, and the compressing
ones all-reduce through functional collectives while torch.compile traces them.
"""
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]


def _group(process_group) -> Any:
    return process_group if process_group is not None else dist.group.WORLD


def _buffer(bucket) -> torch.Tensor:
    """The bucket's flat gradients; the compiled python reducer passes a ``(grad, param)`` pair."""
    return bucket[0] if isinstance(bucket, tuple) else bucket.buffer()


def allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Divide by the world size and all-reduce: what DDP does without a hook."""
    group = _group(process_group)
    buffer = _buffer(bucket)
    buffer.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Cast to ``dtype`` (halving the bytes sent), average, and cast back into the bucket."""
    group = _group(process_group)
    buffer = _buffer(bucket)
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))

    def decompress(fut: torch.futures.Future | torch.Tensor) -> torch.Tensor:
        buffer.copy_(fut if isinstance(fut, torch.Tensor) else fut.value()[0])
        return buffer

    if torch.compiler.is_compiling():  # traced: a functional collective, as torch's hook does
        return decompress(dist._functional_collectives.all_reduce(compressed, "sum", group))
    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the gradients in float16 (torch's ``fp16_compress_hook``)."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the gradients in bfloat16 (torch's ``bf16_compress_hook``)."""
    return _compress_hook(torch.bfloat16, process_group, bucket)
