"""The autograd Function behind ``ddpkit.SyncBatchNorm``: batch statistics over the global batch.

torch's own ``SyncBatchNorm`` Function calls CUDA-only kernels (``batch_norm_stats``,
``batch_norm_gather_stats_with_counts``, ...), so it raises on CPU. This one uses BatchNorm's eval
forward, tensor ops and ``torch.distributed`` collectives, so it runs over Gloo on CPU as well as on
GPUs; on CPU, BatchNorm's fused statistics and backward kernels replace two of the tensor-op steps.

Forward: every rank computes its per-channel count, mean and *centred* sum of squares (``m2``); one
``all_gather`` brings every rank's triple; each rank combines them (Chan et al.'s pairwise formula),
which is exact for uneven batches, lets an empty rank contribute nothing, and does not lose digits the
way ``E[x^2] - E[x]^2`` does when the mean is large next to the spread. Backward: the gradient of that
global computation needs only two per-channel sums over the global batch, ``sum(dy)`` and
``sum(dy * (x - mean))``, so one ``all_reduce`` of ``2C`` numbers. The weight and bias gradients stay
local, as in torch: DDP averages them with the other parameters.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ddpkit.errors import explain

__all__ = ["SyncBatchNormFunction", "gather_global_stats", "local_moments", "local_sums"]


def _channel_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channels (dim 1): the ones BatchNorm reduces over."""
    return [0, *range(2, x.dim())]


def _fused(x: torch.Tensor, fused: bool | None) -> bool:
    """Whether to use BatchNorm's fused CPU kernels: as asked, else on CPU only."""
    return x.device.type == "cpu" if fused is None else fused


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(C,) -> (1, C, 1, ...) so that it broadcasts against an input of ``ndim`` dimensions."""
    return t.view(1, -1, *([1] * (ndim - 2)))


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics of half / bfloat16 inputs are computed in float32, as BatchNorm's kernels do."""
    return torch.promote_types(dtype, torch.float32)


def local_moments(x: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's per-channel mean, centred sum of squares and count (zeros for an empty batch).

    ``fused`` (default: on CPU) picks BatchNorm's statistics kernel over ``var_mean``.
    """
    count = x.numel() // x.size(1)
    acc = _accumulate_dtype(x.dtype)
    if count == 0:
        zeros = torch.zeros(x.size(1), dtype=acc, device=x.device)
        return zeros, zeros.clone(), 0
    if _fused(x, fused):
        # BatchNorm's own statistics kernel (the biased variance): one pass, where var_mean over
        # (N, H, W) is 4x slower on CPU, 25x for channels_last. Other devices keep var_mean, the
        # path checked against torch's SyncBatchNorm on a GPU.
        mean, var = torch.batch_norm_update_stats(x.to(acc), None, None, 0.0)
    else:
        var, mean = torch.var_mean(x.to(acc), dim=_channel_dims(x), correction=0)
    return mean, var * count, count


def local_sums(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, invstd: torch.Tensor,
               eps: float, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-channel ``sum(dy)`` and ``sum(dy * (x - mean)) * invstd``.

    On CPU in one fused pass: BatchNorm's backward kernel in eval mode (``train=False``) takes ``mean``
    and ``var`` as constants, so its bias and weight gradients are exactly these two sums (3x faster
    than the plain ops). CUDA's kernel refuses that call (no weight, no saved statistics), so other
    devices take the plain ops. ``fused`` (default: on CPU) picks the kernel.
    """
    if _fused(x, fused):
        _, weighted, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, None, mean, var, None, None, False, eps, [False, True, True])
        return sum_dy, weighted
    dims = _channel_dims(x)
    return dy.sum(dims), (dy * (x - _per_channel(mean, x.dim()))).sum(dims) * invstd


def gather_global_stats(x: torch.Tensor, group: dist.ProcessGroup, world_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The group's per-channel mean, centred sum of squares and count, the same on every rank.

    The per-rank triples travel in float64 (2C + 1 numbers a rank), so counts stay exact and the
    combination adds almost no rounding; results come back in the accumulate dtype.
    """
    mean, m2, count = local_moments(x)
    packed = torch.cat([mean.double(), m2.double(), mean.new_full((1,), count, dtype=torch.float64)])
    if dist.get_backend(group) == "gloo":  # Gloo has no all_gather_into_tensor
        parts = [torch.empty_like(packed) for _ in range(world_size)]
        dist.all_gather(parts, packed, group=group)
        table = torch.stack(parts)
    else:
        table = packed.new_empty(world_size, packed.numel())
        dist.all_gather_into_tensor(table, packed, group=group)
    channels = mean.numel()
    means, m2s, counts = table[:, :channels], table[:, channels:2 * channels], table[:, 2 * channels:]
    total = int(counts.sum().item())
    if total == 0:
        return mean, m2, 0
    global_mean = (counts * means).sum(0) / total
    # Chan's combination: the spread inside each rank plus the spread of the rank means around the
    # global mean; a rank with count 0 adds exactly nothing to either sum.
    global_m2 = m2s.sum(0) + (counts * (means - global_mean) ** 2).sum(0)
    return global_mean.to(mean.dtype), global_m2.to(mean.dtype), total


def _update_running_stats(running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                          mean: torch.Tensor, unbiased_var: torch.Tensor, momentum: float) -> None:
    """BatchNorm's update: ``running = (1 - momentum) * running + momentum * batch_stat``."""
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)


class SyncBatchNormFunction(torch.autograd.Function):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` with mean and var of the group's batch.

    ``apply(input, weight, bias, running_mean, running_var, eps, momentum, process_group,
    world_size)``, torch's argument order; every rank of ``process_group`` must call it, each with
    its own batch (possibly empty), and run backward if any does.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, process_group,
                world_size):
        mean, m2, total = gather_global_stats(input, process_group, world_size)
        if total == 1:  # every rank sees the same total, so every rank raises: none is left waiting
            raise ValueError(explain(
                f"Expected more than 1 value per channel when training, got 1 over the whole group "
                f"(input size on this rank {tuple(input.shape)}).",
                "give the group's global batch at least 2 samples per channel, or call module.eval().",
                who="SyncBatchNorm", rank=dist.get_rank()))
        var = m2 / max(total, 1)
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(input, weight, mean, var, invstd)
        ctx.process_group, ctx.total, ctx.eps = process_group, total, eps
        if total == 0:  # BatchNorm on an empty batch leaves the running statistics alone
            return torch.empty_like(input)
        _update_running_stats(running_mean, running_var, mean, m2 / (total - 1), momentum)
        if input.numel() == 0:
            return torch.empty_like(input)
        # The normalisation itself is BatchNorm's eval kernel fed the global statistics: one fused
        # pass that keeps the input's memory format (channels_last included).
        stat_dtype = weight.dtype if weight is not None else _accumulate_dtype(input.dtype)
        return F.batch_norm(input, mean.to(stat_dtype), var.to(stat_dtype), weight, bias, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, mean, var, invstd = ctx.saved_tensors
        channels, ndim = input.size(1), input.dim()
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        if input.numel() > 0:
            dy, x = grad_output.to(mean.dtype), input.to(mean.dtype)
            sum_dy, sum_dy_xhat = local_sums(dy, x, mean, var, invstd, ctx.eps)
        else:
            sum_dy = sum_dy_xhat = torch.zeros(channels, dtype=mean.dtype, device=input.device)
        grad_input = grad_weight = grad_bias = None
        if need_input:
            # the only communication of backward: the two sums of the global batch (every rank joins,
            # an empty one with zeros, so that the others are not left waiting)
            combined = torch.cat([sum_dy, sum_dy_xhat / invstd])
            dist.all_reduce(combined, group=ctx.process_group)
            global_sum_dy, global_sum_dy_xmu = combined.split(channels)
            grad_input = torch.empty_like(input)
            if input.numel() > 0:
                scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
                total = ctx.total
                # dx = scale * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean)))
                shift = _per_channel(-scale * global_sum_dy / total, ndim)
                slope = _per_channel(-scale * invstd * invstd * global_sum_dy_xmu / total, ndim)
                # (x - mean) kept whole, not folded into the shift: no digits lost when mean >> spread
                xmu = x - _per_channel(mean, ndim)
                grad_input = torch.addcmul(shift, dy, _per_channel(scale, ndim)).addcmul_(xmu, slope)
                grad_input = grad_input.to(input.dtype)
        # local parts: DDP averages these across ranks with the other parameters; an empty rank gives
        # zeros rather than None so that DDP sees the parameters used on every rank
        if weight is not None and need_weight:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if need_bias:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else sum_dy.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None
