"""What DistributedDataParallel's forward takes and returns: inputs moved to the device, the
output's tensors, and the parameters its autograd graph reaches (find_unused_parameters)."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ddpkit.dp.nested import map_tensors, tensors

__all__ = ["find_tensors", "backward_entries", "to_device", "unreached_parameters"]


def find_tensors(obj: Any, attributes: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output, as ``ddpkit.dp.nested`` walks it (tensors, tuples, lists,
    dicts, namedtuples, dataclasses: every field, as torch's DDP reads them); with ``attributes``,
    when ``obj`` itself is a plain object, those its attributes hold (one level: no cycles to follow)."""
    if attributes and _is_plain_object(obj):
        for value in vars(obj).values():
            yield from tensors(value, every_field=True)
    else:
        yield from tensors(obj, every_field=True)


def backward_entries(output: Any, outputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors of a forward's ``output`` that a backward through it starts from, for a gradient
    hook that says where that backward ends: those that require a gradient (``outputs``, when the
    caller has them), else those a plain output object holds; never a leaf, on which a hook would
    stay for good."""
    if outputs is None:
        outputs = [t for t in find_tensors(output) if t.requires_grad]
    found = outputs or [t for t in find_tensors(output, attributes=True) if t.requires_grad]
    return [t for t in found if t.grad_fn is not None]


def _is_plain_object(obj: Any) -> bool:
    """Neither a tensor nor a container the walker looks into, yet with attributes to look at."""
    if isinstance(obj, (torch.Tensor, tuple, list, dict, type, nn.Module)):
        return False
    return hasattr(obj, "__dict__") and not dataclasses.is_dataclass(obj)


def to_device(obj: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) input to ``device``, as torch's DDP does with device_ids;
    what holds no tensor to move comes back as the same object. A PackedSequence moves whole, as in
    torch: its batch_sizes stay on the CPU, where an RNN wants them."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), obj, leaves=(PackedSequence,))


def unreached_parameters(outputs: list[torch.Tensor], index_of: Mapping[int, int]) -> list[int]:
    """Indices of the parameters (``index_of``: id -> index) the outputs' autograd graph does not
    reach: torch's search for find_unused_parameters."""
    reached: set[int] = set()
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif id(t) in index_of:
            reached.add(index_of[id(t)])
    seen = set(stack)
    while stack:
        fn = stack.pop()
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            if id(variable) in index_of:
                reached.add(index_of[id(variable)])
            continue
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return [i for i in range(len(index_of)) if i not in reached]
