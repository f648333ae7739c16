"""``mixed_precision``: torch's ``_MixedPrecision`` for ddpkit's DDP, on CPU (Gloo) as on GPU.

    DDP(model, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))

torch's meaning, kept: parameters stay in full precision; each forward runs on copies cast to
``param_dtype`` (made before that forward); gradients are produced in ``param_dtype``, averaged in
``reduce_dtype`` (None: ``param_dtype``) and land in the full-precision ``.grad`` when backward
returns, so the optimizer steps full-precision parameters; floating-point buffers are cast to
``buffer_dtype`` once, at construction. None leaves that part as it is.

How, differently from torch (whose copies wait on CUDA events, so it fails on CPU): the copies are
differentiable casts ``p.to(param_dtype)`` put in the module's place for its forward
(``torch.func.functional_call``), floating-point inputs cast as torch casts them. Autograd then
produces the gradient in ``param_dtype`` at the cast and upcasts it on its way into the
full-precision ``.grad``, where the reducer's hooks are: the reducer is unchanged. Reducing in
``reduce_dtype`` below the parameters' dtype is a comm hook (cast, all-reduce, divide: torch's
``_reducer_allreduce_and_upcast_hook``). ``torch.compile(ddp)`` compiles the module's forward on
the copies (DDP's own forward is eager); a module compiled before wrapping is refused. Two differences: a
gradient accumulated under ``no_sync`` sums in full precision (torch casts it down to
``param_dtype`` before the next forward), and integer buffers (BatchNorm's ``num_batches_tracked``)
keep their dtype (torch casts them too, and a bfloat16 counter stops counting at 256).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_map_only

from ddpkit.errors import CommHookError, MixedPrecisionError, explain

__all__ = ["MixedPrecision", "allreduce_in_dtype_hook", "resolve_mixed_precision"]

_WHO = "DistributedDataParallel"
_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")


@dataclass(frozen=True)
class MixedPrecision:
    """The resolved setting: each field a ``torch.dtype`` or None (left as is)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        """torch's rule: without ``reduce_dtype``, gradients are reduced in ``param_dtype``."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


def resolve_mixed_precision(config: Any, rank: int = 0) -> MixedPrecision | None:
    """Check ``mixed_precision`` (torch's ``_MixedPrecision`` or any object with its three fields)."""
    if config is None:
        return None
    missing = [f for f in _FIELDS if not hasattr(config, f)]
    if missing:
        raise MixedPrecisionError(explain(  # torch's words first: it reads the fields, and fails so
            f"{type(config).__name__!r} object has no attribute {missing[0]!r}: mixed_precision={config!r} "
            f"lacks {', '.join(missing)}.", "pass torch.nn.parallel.distributed._MixedPrecision(param_dtype=..., "
            "reduce_dtype=..., buffer_dtype=...), or an object with those three fields.", who=_WHO, rank=rank),
            missing=missing)
    for field in _FIELDS:
        value = getattr(config, field)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise TypeError(explain(
                f"mixed_precision.{field}={value!r} is not a floating-point torch.dtype.",
                f"e.g. {field}=torch.bfloat16, or None to leave it as is.", who=_WHO, rank=rank))
    return MixedPrecision(*(getattr(config, f) for f in _FIELDS))


def cast_buffers(module: nn.Module, setting: MixedPrecision, ignore: Iterable[str]) -> None:
    """Cast the floating-point buffers to ``buffer_dtype`` in place (torch's ``_cast_buffers``)."""
    if setting.buffer_dtype is None:
        return
    skip = set(ignore)
    for name, buf in module.named_buffers():
        if name not in skip and buf.is_floating_point():
            buf.data = buf.to(setting.buffer_dtype)


def forward_in_param_dtype(module: nn.Module, setting: MixedPrecision, ignore: Iterable[str],
                           args: tuple, kwargs: dict) -> Any:
    """Run ``module`` on copies of its parameters cast to ``param_dtype``, made now; the casts are
    in the graph, so each gradient comes back to its full-precision parameter upcast. Floating-point
    inputs are cast to ``param_dtype`` too, as torch's ``_cast_forward_inputs`` does."""
    dtype = setting.param_dtype
    if dtype is None:
        return module(*args, **kwargs)
    skip = set(ignore)
    low = {name: p.to(dtype) for name, p in module.named_parameters()
           if name not in skip and p.is_floating_point()}
    args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
                                 (args, kwargs))
    if isinstance(module, nn.DataParallel):
        # functional_call refuses any DataParallel, ddpkit's included; the reparametrization it would
        # run works on one (the replicas are made from the swapped-in parameters)
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(module, low, strict=False):
            return module(*args, **kwargs)
    return functional_call(module, low, args, kwargs, strict=False)


def allreduce_in_dtype_hook(state: tuple[Any, torch.dtype], bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in ``reduce_dtype``: cast, all-reduce (sum), divide, back into the bucket."""
    group, dtype = state
    buffer = bucket.buffer()
    low = buffer.to(dtype)

    def upcast(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0].div_(dist.get_world_size(group)))
        return buffer

    return dist.all_reduce(low, group=group, async_op=True).get_future().then(upcast)


def needs_reduce_hook(setting: MixedPrecision, params: Iterable[torch.Tensor]) -> bool:
    """Whether some bucket's dtype differs from the reduce dtype (else the plain all-reduce is it)."""
    dtype = setting.effective_reduce_dtype
    return dtype is not None and any(p.dtype != dtype for p in params)


def refuse_comm_hook(rank: int, hook: Any) -> CommHookError:
    """mixed_precision reduces through a comm hook of its own, as torch's does; a second cannot compose."""
    name = getattr(hook, "__qualname__", type(hook).__name__)
    return CommHookError(explain(
        f"register_comm_hook({name}) cannot be combined with mixed_precision: the gradients are "
        "already averaged in reduce_dtype by mixed_precision's own hook (torch's DDP refuses a second hook too).",
        "leave mixed_precision's reduce_dtype to choose the reduction's precision, or drop mixed_precision "
        "and register the hook (e.g. ddpkit.hooks.bf16_compress_hook).", who=_WHO, rank=rank),
        rank=rank, hook=name)


def refuse_compiled(module: nn.Module, rank: int) -> None:
    """A module compiled before wrapping would be traced on full-precision parameters: refused."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        raise NotImplementedError(explain(
            "mixed_precision cannot be combined with a torch.compile'd module: the low-precision copies "
            "replace its parameters for each forward, which the compiled graph does not see.",
            "wrap the plain module (DDP(model, mixed_precision=...)), or compile without mixed_precision.",
            who=_WHO, rank=rank))
