"""What DistributedDataParallel's forward takes and returns: inputs moved to the device, the
output's tensors, and the parameters its autograd graph reaches (find_unused_parameters)."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

import torch
from torch import nn

__all__ = ["find_tensors", "to_device", "unreached_parameters"]


def find_tensors(obj: Any, attributes: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output: tensors, lists, tuples, dicts, dataclasses; with
    ``attributes`` also those a plain object holds (one level: no cycles to follow)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from find_tensors(getattr(obj, field.name))
    elif attributes and hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module)):
        for item in vars(obj).values():
            yield from find_tensors(item)


def to_device(obj: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) input to ``device``, as torch's DDP does with device_ids."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    return obj


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
