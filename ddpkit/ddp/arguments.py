"""DistributedDataParallel's construction checks: torch's rules for its arguments, said clearly.

Each check raises with the argument, its value and the fix; ``DistributedDataParallel`` runs them
all on every rank and shares any failure, so that no rank is left waiting for another.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.ddp.bucket import DEFAULT_FIRST_BUCKET_BYTES
from ddpkit.dp.devices import as_device
from ddpkit.errors import CommHookError, explain

__all__ = ["DEFAULT_BUCKET_CAP_MB", "bucket_caps", "check_comm_hook", "check_devices", "first_difference",
           "refuse_meta", "refuse_torch_sync_batchnorm_on_cpu", "refuse_uninitialized", "sparse_gradient_names"]

_MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
"""What ``bucket_cap_mb=None`` means, as in torch."""


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """(cap, first cap) in bytes, as torch: a small first bucket with the default (None) only, not
    with a cap the caller chose (even 25)."""
    small_first = bucket_cap_mb is None
    if bucket_cap_mb is None:
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number of MiB, 0 or more (0: one "
                         "bucket per parameter).")
    cap = max(1, int(bucket_cap_mb * _MIB))
    return cap, min(DEFAULT_FIRST_BUCKET_BYTES, cap) if small_first else cap


def check_devices(params: Sequence[torch.Tensor], device_ids: Sequence[int | torch.device] | None,
                  output_device: int | torch.device | None
                  ) -> tuple[torch.device, list[int] | None, torch.device | None]:
    """torch's rules: device_ids only for a module on one GPU, and then a single device.

    ``params``: the module's parameters that DDP handles (not those it was told to ignore).
    Returns (their device, device_ids as torch stores them, output_device).
    """
    if isinstance(device_ids, (int, str, torch.device)):
        # torch's len() of it: "object of type 'int' has no len()", or a str taken letter by letter
        error = ValueError if isinstance(device_ids, str) else TypeError
        shown = f"torch.device({str(device_ids)!r})" if isinstance(device_ids, torch.device) else repr(device_ids)
        raise error(explain(f"device_ids must be a list of one device, but got the {type(device_ids).__name__} "
                            f"{shown}.", f"wrap it in a list, device_ids=[{shown}] (None for a CPU module, or one "
                            "on several GPUs)."))
    devices = {p.device for p in params}
    types = sorted({d.type for d in devices})
    if len(types) != 1:
        raise ValueError(explain(f"DistributedDataParallel's input module must be on the same type of devices: "
                                 f"its parameters are on {types}.", "move the whole module with .to(device)."))
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(explain(f"device_ids={list(device_ids)}: DistributedDataParallel drives one "
                                 "device per process, so device_ids can only be None or contain a single "
                                 "element.", "start one process per GPU (ddpkit run --nproc-per-node)."))
    if not device_ids or types[0] == "cpu" or len(devices) > 1:
        if device_ids or output_device:  # torch's test: an output_device of 0 passes, unused
            raise ValueError(explain(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules: "
                f"device_ids={device_ids!r} and output_device={output_device!r} only apply to a module "
                f"on a single GPU, but its parameters are on {sorted(map(str, devices))}.",
                "leave device_ids and output_device as None for CPU or multi-device modules."))
        return params[0].device, None, None
    device = as_device(device_ids[0], what="device_ids[0]", accelerator=types[0])
    if device not in devices:
        raise ValueError(explain(f"device_ids names {device}, but the module's parameters are on "
                                 f"{next(iter(devices))}.", f"move the module there with .to({str(device)!r})."))
    output = device if output_device is None else as_device(output_device, what="output_device", accelerator=types[0])
    return device, [device.index], output


def refuse_torch_sync_batchnorm_on_cpu(module: nn.Module, device: torch.device) -> None:
    """torch's ``nn.SyncBatchNorm`` needs CUDA; it failed at the first forward, torch's DDP refuses it."""
    if device.type != "cpu":
        return
    for name, layer in module.named_modules():
        if isinstance(layer, nn.SyncBatchNorm):
            raise ValueError(explain(
                f"SyncBatchNorm layers only work with GPU modules: {name!r} is torch's nn.SyncBatchNorm, "
                "and this module is on the CPU.",
                "build the model with ordinary BatchNorm layers and convert them with "
                "ddpkit.SyncBatchNorm.convert_sync_batchnorm(model), whose layers also work on the CPU."))


def refuse_meta(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """A module on the meta device (deferred initialization): called once every parameter is on one
    device type, so a module partly on meta is refused as on two device types, as in torch."""
    for name, p in named:
        if p.is_meta:  # torch's DDP fails on it in a broadcast, with no name and no way out
            raise RuntimeError(explain(
                f"DistributedDataParallel cannot wrap a module on the meta device: {name!r} is a meta "
                "tensor, which holds no values to broadcast or average (torch's DDP stops here too: "
                "\"Tensor.item() cannot be called on meta tensors\"). Materialized after wrapping "
                "(to_empty), the module's parameters would be new tensors that DDP never hooked, and "
                "their gradients would never be averaged.",
                "materialize the model first, module.to_empty(device=...) and initialize its parameters "
                "(or load a checkpoint), then wrap it."))


def refuse_uninitialized(module: nn.Module) -> None:
    for name, p in module.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(explain(
                f"Modules with uninitialized parameters can't be used with `DistributedDataParallel`: "
                f"{name!r} is not initialized yet (a lazy module, such as nn.LazyLinear, sizes it at its "
                "first forward).",
                "run one forward pass on a sample batch before wrapping the model."))


def sparse_gradient_names(module: nn.Module, names: Sequence[str]) -> list[str | None]:
    """Per parameter of ``names``, its name if it gets sparse gradients, else None. torch's rule:
    those of an ``nn.Embedding`` or ``nn.EmbeddingBag`` built with sparse=True. Each gets a bucket
    of its own, which names it in errors (see Note [Sparse gradients] in docs/design.md)."""
    sparse = {f"{prefix}.{name}" if prefix else name: True
              for prefix, child in module.named_modules()
              if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse
              for name, _ in child.named_parameters(recurse=False)}
    return [name if sparse.get(name) else None for name in names]


def first_difference(ref: list[tuple], other: list[tuple], rank: int) -> str | None:
    """How rank ``rank``'s (name, shape, dtype, requires_grad, strides) list first differs from rank 0's.

    Strides are a parameter's (None for a buffer), with those of size-1 dimensions left out: they
    place nothing. A bucket lays each gradient out as its parameter is laid out, so a parameter
    strided otherwise on one rank (channels_last there only) would be summed with the wrong elements.
    Names are shown, not compared: tensors are matched by position, as torch's check matches them,
    and a rank may wrap the same model in another container (``'0.weight'`` on one, ``'inner.weight'``
    on another), which torch's DDP trains.
    """
    def describe(entry: tuple, r: int) -> str:
        name, shape, dtype, requires_grad, _ = entry
        frozen = ", requires_grad=False" if requires_grad is False else ""
        return f"rank {r} has {name!r} with shape {list(shape)} ({dtype}{frozen})"

    def strides(entry: tuple, r: int) -> str:
        shown = [s if s is not None else "-" for s in entry[4]]
        return f"rank {r} has {entry[0]!r} with strides {shown}"

    for i, (a, b) in enumerate(zip(ref, other)):
        if a[1:4] != b[1:4]:
            sizes = "" if a[1] == b[1] else (  # torch's words for it, which scripts may look for
                f", so tensor #{i} with sizes {list(b[1])} appears not to match sizes of the same param in process 0")
            return f"tensor #{i} differs: {describe(a, 0)}, {describe(b, rank)}{sizes}"
        if a[4] != b[4]:
            return (f"parameter #{i} with sizes {list(a[1])} appears not to match strides of the same param "
                    f"in process 0: {strides(a, 0)}, {strides(b, rank)} (a memory format, such as "
                    "channels_last, set on some ranks only)")
    if len(ref) != len(other):
        longer, r = (ref, 0) if len(ref) > len(other) else (other, rank)
        return (f"rank 0 has {len(ref)} parameters/buffers and rank {rank} has {len(other)}; the first "
                f"without a counterpart: {describe(longer[min(len(ref), len(other))], r)}")
    return None


_FUTURE_OF_TENSOR = torch.futures.Future[torch.Tensor]


def check_comm_hook(hook: Any, rank: int) -> None:
    """torch's checks of a comm hook: callable, and annotated (if at all) ``bucket: dist.GradBucket``
    and ``-> torch.futures.Future[torch.Tensor]``. Annotations written as strings (a module with
    ``from __future__ import annotations``) pass when they name those types, which torch refuses."""
    if not callable(hook):
        raise CommHookError(f"Communication hook must be callable as hook(state, bucket), but rank "
                            f"{rank} got {type(hook).__name__}.", rank=rank, hook=type(hook).__name__)
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin or C++ callable: nothing to read
        return
    positional = list(signature.parameters.values())
    bucket = signature.parameters.get("bucket", positional[1] if len(positional) > 1 else None)
    name = getattr(hook, "__name__", type(hook).__name__)
    try:
        signature.bind(None, None)
    except TypeError:  # else the backward fails: "<lambda>() takes 1 positional argument but 2 were given"
        raise CommHookError(explain(
            f"comm hook {name!r} cannot be called as hook(state, bucket), which is how DDP calls it: its "
            f"signature is {name}{signature} (rank {rank}).",
            "take the state first, even if unused: def hook(state, bucket), and register_comm_hook(None, hook)."),
            rank=rank, hook=name) from None
    if bucket is not None and not _annotates(bucket.annotation, dist.GradBucket, {"GradBucket"}):
        raise ValueError(explain(
            f"Communication hook: bucket annotation should be dist.GradBucket, but {name}'s {bucket.name!r} "
            f"is annotated {_shown(bucket.annotation)} (rank {rank}).",
            f"annotate it `{bucket.name}: dist.GradBucket`, or not at all."))
    if not _annotates(signature.return_annotation, _FUTURE_OF_TENSOR, {"Future[Tensor]"}):
        raise ValueError(explain(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor], but "
            f"{name} returns {_shown(signature.return_annotation)} (rank {rank}).",
            "return the Future of the collective (work.get_future(), then .then(...) for a last step), "
            "annotated `-> torch.futures.Future[torch.Tensor]`."))


def _annotates(annotation: Any, expected: Any, spelled: set[str]) -> bool:
    if annotation is inspect.Parameter.empty or annotation == expected:
        return True
    if isinstance(annotation, str):  # "torch.futures.Future[torch.Tensor]" -> "Future[Tensor]"
        words = annotation.replace(" ", "").replace("torch.futures.", "").replace("futures.", "")
        return words.replace("torch.distributed.", "").replace("dist.", "").replace("torch.", "") in spelled
    return False


def _shown(annotation: Any) -> str:
    return repr(annotation) if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
