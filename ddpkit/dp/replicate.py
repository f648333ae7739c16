"""replicate: one module copy per device whose parameters are copies of the original's (differentiable
unless ``detach``).

Gradients from every replica flow back into the original parameters' ``.grad``. As in torch, the replica
on the first device shares the original's storage, so in-place updates made there (BatchNorm's running
statistics, nn.Embedding's max_norm) are kept; every other replica gets copies of its own.

That holds where a device is named more than once (``["cpu", "cpu", "cpu"]`` or ``["cuda:0"] * 4``) too:
the later replicas on the original's device get copies, not aliases of its storage. Replicas run in
threads at once, and a forward that writes a parameter in place under no_grad (max_norm's renorm) made
them write one storage together, which left rows scaled twice or half-written.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn

from ddpkit.dp.devices import DeviceLike, as_devices, check_available
from ddpkit.dp.torch_names import torch_keywords

__all__ = ["replicate"]

M = TypeVar("M", bound=nn.Module)


def _torch_broadcast(tensors: list[torch.Tensor], devices: list[torch.device],
                     detach: bool) -> list[list[torch.Tensor]]:
    """torch's coalesced CUDA broadcast (the private helper torch's own replicate uses).

    Only valid for distinct CUDA devices with every tensor on the first one; it is kept because it
    coalesces many small parameters into few copies, which matters on real GPUs.
    """
    from torch.nn.parallel.replicate import _broadcast_coalesced_reshape

    return _broadcast_coalesced_reshape(tensors, [d.index for d in devices], detach)


def _can_use_torch_broadcast(tensors: list[torch.Tensor], devices: list[torch.device]) -> bool:
    return (
        all(d.type == "cuda" for d in devices)
        and len(set(devices)) == len(devices)
        and all(t.device == devices[0] for t in tensors)
    )


def _copy_to(t: torch.Tensor, device: torch.device, *, first: bool) -> torch.Tensor:
    """One replica's copy of ``t`` without an autograd link: the tensor itself, or a copy."""
    if first and t.device == device:
        return t  # torch's contract: the first replica shares the original's tensors
    return t.detach().to(device, copy=True)


def _chained_views(t: torch.Tensor, devices: list[torch.device]) -> list[torch.Tensor]:
    """Differentiable copies of ``t``, one per device, whose gradients reach ``t`` summed in device
    order, ((g0 + g1) + g2) + ..., as torch's Broadcast backward sums them.

    Each copy hangs on a view of ``t``, and each view is taken of the next device's view: the view
    of device j adds g_j to what came from the views before it, two terms at a time. An addition of
    two is the same whichever comes first, so the sum does not depend on the order in which autograd
    runs the replicas' graphs. With every copy an edge of ``t`` of its own, three or more gradients
    were added in that order, and ``.grad`` was an ulp off torch's.
    ``expand_as``, not ``view_as``: a view's backward reshapes the gradient, which a sparse one
    (``nn.Embedding(sparse=True)``) refuses; expand's sums it to the same size, which hands it back
    as it is. Only the first device's copy is the view itself, sharing ``t``'s storage; a later
    replica on ``t``'s device gets a ``clone`` of its view (see the module doc).
    """
    copies = []
    link = t
    for j in reversed(range(len(devices))):
        link = link.expand_as(link)
        if devices[j] != t.device:
            copies.append(link.to(devices[j]))
        else:
            copies.append(link if j == 0 else link.clone())
    return copies[::-1]


def _broadcast(tensors: list[torch.Tensor], devices: list[torch.device], *, detach: bool) -> list[list[torch.Tensor]]:
    """Copies of ``tensors`` for each device: result[j][i] is tensors[i] on devices[j]; only the first
    replica's may share the original's storage, so only its in-place updates reach the original."""
    if not tensors:
        return [[] for _ in devices]
    if _can_use_torch_broadcast(tensors, devices):
        return _torch_broadcast(tensors, devices, detach)
    per_tensor = [_chained_views(t, devices) if t.requires_grad and not detach else
                  [_copy_to(t, device, first=j == 0) for j, device in enumerate(devices)]
                  for t in tensors]
    return [list(copies) for copies in zip(*per_tensor)]


def _check_replicatable(module: nn.Module) -> None:
    # a python module below a ScriptModule cannot be copied by _replicate_for_data_parallel
    from torch.nn.parallel.replicate import _replicatable_module

    if not _replicatable_module(module):
        raise RuntimeError(
            "cannot replicate a network where python modules are children of a ScriptModule. "
            "HINT: script the whole network, or none of it."
        )


@torch_keywords(network="module")
def replicate(module: M, devices: Sequence[DeviceLike], detach: bool = False) -> list[M]:
    """Return one replica of ``module`` per entry of ``devices`` (repeats allowed).

    Args:
        module: the network to copy; its parameters should live on ``devices[0]``.
        devices: ints (CUDA indices), strings or torch.devices.
        detach: if True the replicas' parameters have no autograd link to the original (inference).

    Returns:
        A list of independent module objects, ``replicas[j]`` computing on ``devices[j]``.

    Example:
        >>> replicas = replicate(nn.Linear(5, 2), ["cpu", "cpu"])
    """
    targets = as_devices(devices)
    for i, device in enumerate(targets):
        check_available(device, f"devices[{i}]")
    # here, not in replicate_to: DataParallel's placement check names a meta tensor before each forward
    meta = next((n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise NotImplementedError(
            f"Cannot copy out of meta tensor; no data!: cannot replicate a module whose '{meta}' is on the meta "
            "device. HINT: materialize it first, e.g. module.to_empty(device='cpu') and then load its weights."
        )
    return replicate_to(module, targets, detach)


def replicate_to(module: M, targets: list[torch.device], detach: bool) -> list[M]:
    """replicate onto devices already parsed and checked (DataParallel checks them once, at
    construction, not at every forward)."""
    _check_replicatable(module)
    if not targets:
        return []

    params = list(module.parameters())
    param_copies = _broadcast(params, targets, detach=detach)
    param_index = {p: i for i, p in enumerate(params)}

    # as torch: buffers that need no gradient are always copied without an autograd link
    buffers_rg = [b for b in module.buffers() if b.requires_grad and not detach]
    buffers = buffers_rg + [b for b in module.buffers() if not (b.requires_grad and not detach)]
    copies_rg = _broadcast(buffers_rg, targets, detach=False)
    copies_not_rg = _broadcast(buffers[len(buffers_rg):], targets, detach=True)
    buffer_copies = [a + b for a, b in zip(copies_rg, copies_not_rg)]
    buffer_index = {b: i for i, b in enumerate(buffers)}

    originals = list(module.modules())
    module_index = {m: i for i, m in enumerate(originals)}
    copies: list[list[nn.Module]] = [[m._replicate_for_data_parallel() for m in originals] for _ in targets]

    for j, replicas in enumerate(copies):
        for original, replica in zip(originals, replicas):
            # torch's DDP reads replicated parameters through this dict
            replica._former_parameters = OrderedDict()
            for key, child in original._modules.items():
                if child is None:
                    replica._modules[key] = None
                else:
                    setattr(replica, key, replicas[module_index[child]])
            for key, param in original._parameters.items():
                if param is None:
                    replica._parameters[key] = None
                else:
                    # replicated parameters are no longer leaves, so they become plain attributes
                    copy = param_copies[j][param_index[param]]
                    setattr(replica, key, copy)
                    replica._former_parameters[key] = copy
            for key, buf in original._buffers.items():
                if buf is None:
                    replica._buffers[key] = None
                else:
                    setattr(replica, key, buffer_copies[j][buffer_index[buf]])
    return [replicas[0] for replicas in copies]  # type: ignore[misc]
