"""A bucket for one parameter whose gradients are sparse (``nn.Embedding(sparse=True)``).

torch gives each such parameter a bucket of its own (``expect_sparse_gradient``): a sparse COO
gradient cannot share a flat buffer. Its gradient is scaled in place and all-reduced as it is (Gloo
sums sparse tensors and writes the coalesced sum back into it), so ``.grad`` holds the average,
still sparse; there is no view for ``gradient_as_bucket_view``. A comm hook gets this bucket too,
``buffer()`` being the sparse gradient and ``gradients()`` empty, as torch's GradBucket for it.
See Note [Sparse gradients] in docs/design.md.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ddpkit.ddp.autograd_engine import without_grad
from ddpkit.ddp.bucket import GradBucketBasics
from ddpkit.errors import CommHookError, DenseGradientError, explain

__all__ = ["SparseBucket", "empty_sparse_like"]


def empty_sparse_like(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of zeros for ``param``, shaped as an embedding's (one sparse dimension, the
    rest dense): what a rank without the gradient contributes."""
    indices = torch.empty(1, 0, dtype=torch.int64, device=param.device)
    values = torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, is_coalesced=True, check_invariants=False)


class SparseBucket(GradBucketBasics):
    """The bucket of one sparse-gradient parameter, launched with the others, in their order.

    Takes the arguments of ``Bucket`` so that a layout builds either; ``extra`` > 0 gives it the
    status flag, all-reduced beside the gradient (see Note [Errors on every rank])."""

    sparse = True
    num_big = 0  # no slot: nothing is copied in by the gradient's own hook
    views: list[torch.Tensor] = []  # no view of a flat buffer, so none for gradient_as_bucket_view

    def __init__(self, index: int, params: list[torch.nn.Parameter], param_indices: list[int],
                 is_last: bool, extra: int = 0):
        if len(params) != 1:
            raise ValueError(f"a SparseBucket holds one parameter, got {len(params)}.")
        self._index, self._is_last = index, is_last
        self.params, self.param_indices = list(params), list(param_indices)
        self.numel = params[0].numel()
        # the status flag, or an empty tensor: ``flat`` says the gradients' dtype to the profiler
        self.flat = torch.zeros(extra, dtype=params[0].dtype, device=params[0].device)
        self.flag = self.flat if extra else None
        self.grad: torch.Tensor | None = None  # the sparse gradient reduced this iteration
        self._buffer: torch.Tensor | None = None
        self.had_grad = True
        self.name = f"parameter #{param_indices[0]}"  # the layout gives the parameter's own name
        self.grads: list[torch.Tensor | None] = []

    def fill(self, scale: float | None, as_view: bool, copied: Sequence[bool]) -> None:
        """Take the parameter's sparse gradient, multiplied in place by ``scale`` (None: as it is),
        as torch divides it; a missing one counts as zeros."""
        param = self.params[0]
        grad = param.grad
        self.had_grad = grad is not None
        if grad is None:
            grad = empty_sparse_like(param)
        elif not grad.is_sparse:
            rank = dist.get_rank()
            raise DenseGradientError(explain(
                f"Expected variable to have sparse gradient: {self.name!r} belongs to a sparse embedding, "
                f"but its .grad is a dense tensor ({grad.layout}, shape {list(grad.shape)}).",
                "leave its gradient sparse (a post-accumulate-grad hook must not densify it; a weight "
                "shared with a dense layer, such as tied input and output embeddings, gets a dense "
                "gradient), or build the embedding with sparse=False.", who="DistributedDataParallel",
                rank=rank), rank=rank, parameter=self.name)
        elif scale is not None:
            with without_grad():
                grad.mul_(scale)
        self.grad = self._buffer = grad

    def all_reduce(self, group: Any) -> list[Any]:
        """Start the sum of the sparse gradients (written back into ``grad``), and the flag's."""
        works = [dist.all_reduce(self.grad, group=group, async_op=True)]
        if self.flag is not None:
            works.append(dist.all_reduce(self.flag, group=group, async_op=True))
        return works

    def write_back(self, as_view: bool, mask: Sequence[bool] | None, adopt: bool = False) -> None:
        """The average is in the gradient already (reduced in place); a rank that had none gets it,
        unless ``mask`` says no rank used the parameter. A stale gradient that no rank used is
        averaged all the same, as torch does.
        ``adopt``: nothing to do, a sparse gradient has no slot."""
        if not self.had_grad and (mask is None or mask[self.param_indices[0]]):
            self.params[0].grad = self.grad

    def zeros_like(self) -> SparseBucket:
        """The bucket a joined rank contributes: a sparse gradient of zeros."""
        zeros = SparseBucket(self._index, self.params, self.param_indices, self._is_last, self.flat.numel())
        zeros.grad = zeros._buffer = empty_sparse_like(self.params[0])
        zeros.name = self.name
        return zeros

    # ---- torch's GradBucket interface, for comm hooks ----
    def parameters(self) -> list[torch.Tensor]:
        return list(self.params)

    def gradients(self) -> list[torch.Tensor]:
        """Empty, as torch's: a sparse bucket has no per-parameter views."""
        return []

    def restore_buffer(self) -> None:
        """Let go of the gradient at the end of the iteration (zero_grad may free it)."""
        self.grad = self._buffer = None

    def take_result(self, result: torch.Tensor, hook_name: str, rank: int) -> None:
        """Copy a comm hook's result into the sparse gradient, unless it already is it."""
        own = self.grad
        if result is own:
            return
        if not isinstance(result, torch.Tensor) or not result.is_sparse or result.shape != own.shape:
            got = (f"a {result.layout} tensor of shape {list(result.shape)}" if isinstance(result, torch.Tensor)
                   else type(result).__name__)
            raise CommHookError(explain(
                f"the future of comm hook {hook_name} for bucket {self._index} holds {got}, but the bucket "
                f"holds a sparse gradient of shape {list(own.shape)}.",
                "complete the future with the reduced bucket.buffer(), a sparse tensor of the same "
                "shape, as ddpkit.hooks.allreduce_hook does."), rank=rank, hook=hook_name)
        own.copy_(result)

    def __repr__(self) -> str:
        return (f"SparseBucket(index={self._index}, param={self.param_indices[0]}, "
                f"shape={list(self.params[0].shape)}, dtype={self.flat.dtype})")
