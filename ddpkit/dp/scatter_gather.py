"""scatter / scatter_kwargs / gather: split nested inputs over devices and join the outputs back.

Tensors are chunked exactly like ``torch.chunk`` (so a batch of 10 over 8 devices gives five chunks of 2
and only five replicas run, as in torch); tuples, lists, dicts, namedtuples and dataclasses are recursed
into as ``ddpkit.dp.nested`` says; any other object is passed by reference to every device. As
torch's, ``scatter`` returns a tuple for a lone tensor and a list otherwise, one item per device.
Both directions are differentiable: gradients flow from the chunks back to the input, and from the
gathered output back to every replica's output.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ddpkit.dp.devices import DeviceLike, as_device, as_devices, check_available
from ddpkit.dp.nested import UnevenSplit, join, split, tensors
from ddpkit.dp.torch_names import torch_keywords
from ddpkit.errors import BatchDimError, EmptyListError, explain

__all__ = ["scatter", "scatter_kwargs", "gather", "check_dim_type"]


def check_dim_type(dim: object) -> None:
    """``dim`` must be an int, as torch.chunk and torch.cat take it: said at once, naming it."""
    if not isinstance(dim, int):
        raise TypeError(explain(
            f"argument 'dim' must be int, not {type(dim).__name__}: dim={dim!r} is the batch dimension that "
            "inputs are split and outputs joined along.", "pass an int, e.g. dim=0 (or dim=1 for a "
            "time-major batch)."))


def _check_dim(t: torch.Tensor, dim: int, action: str, replica: int | None = None,
               shapes: Sequence[tuple[int, ...]] = ()) -> None:
    """torch's words first (its chunk and cat say them on GPUs), then which call, dim and shape; for
    gather, which replica returned the tensor and what the others returned (``shapes``)."""
    shape = tuple(t.shape)
    whose = "" if replica is None else (f" returned by replica {replica} (on {t.device}; the replicas' "
                                        f"shapes: {', '.join(map(str, shapes))})")
    if t.dim() == 0:
        torchs = ("chunk expects at least a 1-dimensional tensor" if action == "scatter"
                  else f"zero-dimensional tensor (at position {replica or 0}) cannot be concatenated")
        hint = ("give the tensor a batch dimension, e.g. t.unsqueeze(0)" if replica is None else
                "keep the batch dimension in forward's output even for a chunk of one row (a .squeeze() "
                "drops it: squeeze a named dim, e.g. .squeeze(-1))")
        raise BatchDimError(explain(
            f"{torchs}: cannot {action} a 0-dim tensor{whose} along dim={dim}, found shape {shape}.",
            f"{hint}."), action=action, dim=dim, shape=shape)
    if not -t.dim() <= dim < t.dim():
        raise BatchDimError(explain(
            f"Dimension out of range (expected to be in range of [{-t.dim()}, {t.dim() - 1}], but got "
            f"{dim}): cannot {action} along dim={dim} a tensor of shape {shape}{whose}.",
            f"pass dim= the batch dimension of every tensor {'input' if replica is None else 'output'}."),
            action=action, dim=dim, shape=shape)


def _scatter_tensor(t: torch.Tensor, devices: list[torch.device], dim: int) -> list[torch.Tensor]:
    _check_dim(t, dim, "scatter")
    # A copy on every device, as torch's cross-device scatter gives: a chunk that stayed a view of
    # the input would refuse a replica's in-place op (ReLU(inplace=True)) and, along dim 1, .view().
    return [_copy_to(chunk, device) for chunk, device in zip(t.chunk(len(devices), dim), devices)]


_CPU_ALIGNMENT = 64
"""Bytes: torch's CPU allocator aligns every block so, and CPU matrix kernels choose their path by
where the rows start within it."""


def _copy_to(chunk: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``chunk`` copied to ``device``; from CPU to CPU, at the chunk's own alignment, so that a
    replica computes bit for bit what the module computes on ``torch.chunk``'s piece.

    A copy in a fresh block starts 64-byte aligned, where the chunk at row k may not: on Linear
    layers 69 of 596 chunks then came out an ulp apart from ``module(chunk)``; placed at the
    chunk's address modulo 64, none did. The copy is a tensor of its own (``set_`` on a padded
    block, no view), so a replica may still modify it in place."""
    if not (device.type == chunk.device.type == "cpu" and chunk.is_contiguous() and chunk.numel()):
        return chunk.to(device, copy=True)
    size = chunk.element_size()
    block = torch.empty(chunk.numel() + _CPU_ALIGNMENT // size, dtype=chunk.dtype)
    shift = (chunk.data_ptr() - block.data_ptr()) % _CPU_ALIGNMENT // size
    copy = torch.empty(0, dtype=chunk.dtype).set_(block.untyped_storage(), shift, chunk.shape, chunk.stride())
    return copy.copy_(chunk)


def _split_over(obj: Any, devices: list[torch.device], dim: int) -> list[Any]:
    """One piece of ``obj`` per device (fewer when a tensor has fewer rows than devices).

    Objects passed by reference come once per device and are cut to the tensors' count, as torch's
    zip does; tensors that split differently would leave some replica without its share of the
    batch (torch then drops rows silently), so that is an error here.
    """
    check_dim_type(dim)
    try:
        return split(functools.partial(_scatter_tensor, devices=devices, dim=dim), obj, len(devices))
    except UnevenSplit as e:
        sizes = [tuple(t.shape) for t in tensors(e.values)][:8]
        raise ValueError(
            f"cannot scatter inputs over {len(devices)} devices along dim={dim}: their tensors split "
            f"into different numbers of chunks {e.counts} (shapes {sizes}), so some replica "
            "would get only part of its inputs. HINT: give every batched input the same size along "
            "dim, and pass unbatched tensors as module attributes or buffers instead of inputs.") from e


def _target_devices(target_devices: Sequence[DeviceLike]) -> list[torch.device]:
    devices = as_devices(target_devices, what="target_devices")
    if not devices:
        raise EmptyListError(
            "target_devices is empty: expected at least one device. HINT: pass e.g. ['cpu', 'cpu'] or [0, 1].",
            argument="target_devices")
    for i, device in enumerate(devices):
        check_available(device, f"target_devices[{i}]")
    return devices


@torch_keywords(target_gpus="target_devices")
def scatter(inputs: Any, target_devices: Sequence[DeviceLike], dim: int = 0) -> tuple[Any, ...] | list[Any]:
    """Split ``inputs`` into one piece per device, chunking tensors along ``dim`` like torch.chunk.

    Returns:
        One item per used device, each of the same type as ``inputs``: in a tuple for a lone tensor
        and in a list otherwise, as torch's ``scatter`` returns them (code written for torch's may
        ``extend`` the list).

    Example:
        >>> scatter(torch.zeros(30, 5), ["cpu"] * 8)[-1].shape
        torch.Size([2, 5])
    """
    pieces = _split_over(inputs, _target_devices(target_devices), dim)
    return tuple(pieces) if isinstance(inputs, torch.Tensor) else pieces


@torch_keywords(target_gpus="target_devices")
def scatter_kwargs(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    target_devices: Sequence[DeviceLike],
    dim: int = 0,
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """Scatter positional and keyword inputs; the shorter side is padded with () or {} as torch does.

    Raises:
        ValueError: positional and keyword tensors split into different numbers of chunks (torch
            pads the keyword side with ``{}`` there, so the last replicas silently lose their kwargs).
    """
    return scatter_kwargs_to(inputs, kwargs, _target_devices(target_devices), dim)


def scatter_kwargs_to(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, devices: list[torch.device], dim: int
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """scatter_kwargs over devices already parsed and checked (DataParallel checks them once, at
    construction, not at every forward)."""
    if inputs and kwargs:
        pairs = _split_over((inputs, kwargs), devices, dim)  # a list's pieces stay lists, as in torch
        scattered_inputs, scattered_kwargs = [p[0] for p in pairs], [p[1] for p in pairs]
    else:
        scattered_inputs = _split_over(inputs, devices, dim) if inputs else []
        scattered_kwargs = _split_over(kwargs, devices, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(scattered_inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def _gather_tensors(outputs: Sequence[torch.Tensor], target: torch.device, dim: int) -> torch.Tensor:
    if all(t.dim() == 0 for t in outputs) and dim == 0:
        warnings.warn(
            "Was asked to gather along dimension 0, but all input tensors were scalars; "
            "will instead unsqueeze and return a vector.",
            stacklevel=6,  # for an output that is one tensor: the line that called gather
        )
        outputs = [t.view(1) for t in outputs]
    shapes = [tuple(t.shape) for t in outputs]
    for replica, t in enumerate(outputs):
        _check_dim(t, dim, "gather", replica, shapes)
    # .to and cat are both differentiable, so backward splits the gradient back to every replica;
    # in the first output's dtype, as torch's gather copies every output into a tensor like it
    dtype = outputs[0].dtype
    try:
        return torch.cat([t.to(target, dtype) for t in outputs], dim)
    except RuntimeError as e:  # torch's words, then whose outputs
        raise RuntimeError(explain(
            f"{str(e).rstrip('.')}: cannot gather along dim={dim} the replicas' outputs of shapes "
            f"{', '.join(map(str, shapes))} (replica i's at position i).",
            f"every replica's output must have the same size in every dimension but dim={dim}: check that "
            "forward returns the same shape for every chunk.")) from e


def _same_everywhere(outputs: Sequence[Any]) -> bool:
    try:
        return all(o is outputs[0] or bool(o == outputs[0]) for o in outputs[1:])
    except Exception:  # noqa: BLE001 - == may be undefined or ambiguous for arbitrary objects
        return False


def _gather_leaves(outputs: list[Any], target: torch.device, dim: int) -> Any:
    """Join what the replicas returned at one position of their outputs' structure."""
    out = outputs[0]
    if isinstance(out, torch.Tensor):
        others = [(i, o) for i, o in enumerate(outputs) if not isinstance(o, torch.Tensor)]
        if others:
            i, o = others[0]
            raise TypeError(
                f"cannot gather replica outputs: replica 0 returned a tensor where replica {i} returned "
                f"{type(o).__name__} {o!r:.80}. HINT: every replica's forward must return the same "
                "structure, with a tensor at the same places.")
        return _gather_tensors(outputs, target, dim)
    if out is None:
        return None
    if _same_everywhere(outputs):
        return out  # what scatter passed by reference comes back as it went
    raise TypeError(
        f"cannot gather replica outputs of type {type(out).__name__} that differ between replicas "
        f"(found {list(outputs)!r:.200}): expected tensors, None, or tuples, lists, dicts, namedtuples "
        "or dataclasses of them. HINT: return such values from forward, or wrap them in a tensor."
    )


def gather_target(target_device: DeviceLike) -> torch.device:
    """Where gather puts its output: -1 means the CPU, as in torch; anything else goes to as_device."""
    if isinstance(target_device, int) and not isinstance(target_device, bool) and target_device == -1:
        return torch.device("cpu")
    return as_device(target_device, what="target_device")


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Join per-replica outputs on ``target_device`` along ``dim``; the inverse of scatter.

    ``target_device`` may be an int (CUDA index; -1 means the CPU, as in torch), a str or a
    torch.device. 0-dim outputs become a vector with one entry per replica, with torch's warning.
    """
    if len(outputs) == 0:
        raise EmptyListError("gather: outputs is empty: expected one output per replica, found none.",
                             argument="outputs")
    target = gather_target(target_device)
    check_available(target, "target_device")
    return gather_to(outputs, target, dim)


def gather_to(outputs: Sequence[Any], target: torch.device, dim: int) -> Any:
    """gather onto a device already parsed and checked."""
    check_dim_type(dim)
    return join(functools.partial(_gather_leaves, target=target, dim=dim), outputs, what="replica outputs")
