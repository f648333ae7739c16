"""Collectives for user code: typed, named ops, and they also work in a world of one.

Each takes ``group=None`` (the default group). Without any process group (a plain ``python`` run
that never called ``ddpkit.init()``) they act as the identity of a world of one, so the same
training script runs everywhere; in a job a launcher started with several processes they raise
until ``ddpkit.init()`` has joined them, instead of leaving each rank with its own answer.
"""
from __future__ import annotations

import ctypes
import operator
import pickle
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ddpkit.errors import explain
from ddpkit.runtime.comm_args import (
    DTYPE_CODES,
    DTYPES,
    REDUCE_OPS,
    check_op_dtype,
    check_tensor,
    parse_reduce_op,
    widens,
)
from ddpkit.runtime.process_group import require_group_when_launched

__all__ = ["all_reduce", "broadcast", "broadcast_object", "all_gather", "all_gather_object",
           "reduce_scatter", "barrier", "REDUCE_OPS"]

def _active(group) -> bool:
    """True when there is a process group to talk to; False means: act as a world of one."""
    return dist.is_available() and dist.is_initialized() or group is not None


def _world_size(group, op: str) -> int:
    """The group's size; raises on a rank outside ``group`` (torch would quietly do nothing there),
    and in a launched job whose group ``init()`` has not made yet."""
    if not _active(group):
        require_group_when_launched(f"ddpkit.{op}", f"{op} would leave each rank with its own result")
        return 1
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(explain(
            f"rank {dist.get_rank()} is not a member of this group (its ranks are "
            f"{dist.get_process_group_ranks(group)}), so it takes no part in the group's collectives.",
            "call them only on the group's members, e.g. `if dist.get_rank() in ranks:`."))
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group) if _active(group) else 0


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place; returns it.

    ``op`` is "sum", "mean", "max", "min", "product" or the bitwise "band", "bor", "bxor", or
    torch's ``dist.ReduceOp`` of the same name (``ReduceOp.AVG`` is "mean"). A mean needs a
    floating-point tensor; a 16-bit one is averaged in float32, each rank's share divided before the
    sum, so that the sum cannot overflow where the mean would not (bfloat16 reaches float32's
    largest values). A bitwise one needs an integer or bool tensor.
    """
    check_tensor("tensor", tensor)
    name, reduce_op = parse_reduce_op(op)
    check_op_dtype("all_reduce", name, tensor, op)
    world_size = _world_size(group, "all_reduce")
    if world_size == 1:
        return tensor
    if widens(name, tensor):
        wide = tensor.detach().float().div_(world_size)
        dist.all_reduce(wide, op=reduce_op, group=group)
        with torch.no_grad():
            return tensor.copy_(wide)
    dist.all_reduce(tensor, op=reduce_op, group=group)
    if name in ("mean", "avg"):
        with torch.no_grad():  # the collective writes outside autograd too (a parameter averaged by hand)
            tensor.div_(world_size)
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s; returns it.

    ``src`` is a global rank, as in ``torch.distributed.broadcast``, also with a subgroup.
    """
    check_tensor("tensor", tensor)
    if _check_src(src, group, "broadcast") > 1:
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Return rank ``src``'s ``obj`` (any picklable object) on every rank; ``src`` as in broadcast."""
    if _check_src(src, group, "broadcast_object") == 1:
        return _picklable(obj)
    device = comm_device(group)
    sending = dist.get_rank() == src
    payload = _to_bytes_tensor(obj) if sending else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buffer = payload.to(device) if sending else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return obj if sending else _from_bytes_tensor(buffer)


def _check_src(src: int, group, op: str) -> int:
    """The group's size, once ``src`` is known to be one of its (global) ranks."""
    world_size = _world_size(group, op)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
    try:  # any integer type, numpy's included, as torch takes it
        src = src if isinstance(src, bool) else operator.index(src)
    except TypeError:
        pass
    if isinstance(src, bool) or not isinstance(src, int) or src not in members:
        raise ValueError(explain(f"src={src!r} is not a rank of this group (its ranks are {members}).",
                                 "src is a global rank, as in torch.distributed.broadcast."))
    return world_size


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj`` (any picklable object), in rank order."""
    if _world_size(group, "all_gather_object") == 1:
        return [_picklable(obj)]
    device = comm_device(group)
    return [_from_bytes_tensor(t) for t in all_gather(_to_bytes_tensor(obj).to(device), group=group)]


# torch's own object collectives go through numpy, which a plain torch install may lack: these
# pickle into a uint8 tensor and back with the standard library only.
def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _picklable(obj: Any) -> Any:
    """``obj``, once pickling it works: alone, a script fails where several ranks would."""
    pickle.dumps(obj)
    return obj


def _from_bytes_tensor(tensor: torch.Tensor) -> Any:
    tensor = tensor.cpu().contiguous()
    return pickle.loads(ctypes.string_at(tensor.data_ptr(), tensor.numel()) if tensor.numel() else b"")


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order. First dimensions may differ between ranks.

    Returns a list of ``world_size`` tensors (``torch.cat`` it for one tensor).
    """
    check_tensor("tensor", tensor)
    if tensor.dim() > 8:
        raise ValueError(f"all_gather supports tensors of up to 8 dimensions, got {tensor.dim()}.")
    world_size = _world_size(group, "all_gather")
    tensor = tensor.detach()  # as torch's: gathered tensors are new data, outside autograd
    if world_size == 1:
        return [tensor.clone()]
    tensor = tensor.contiguous()
    # the dtype goes with the shape: Gloo aborts the process on a size mismatch, and a dtype of the
    # same size would be gathered as garbage
    headers = _gather_header([tensor.dim(), *tensor.shape, *[0] * (8 - tensor.dim())], tensor, group, world_size)
    dtypes = [_dtype_named(int(h[0])) for h in headers]
    if len({int(h[0]) for h in headers}) > 1:
        listed = ", ".join(f"rank {r}: {str(d).replace('torch.', '')}" for r, d in enumerate(dtypes))
        raise TypeError(f"all_gather: every rank must give the same dtype, but the dtypes are {listed}. "
                        "HINT: convert with .to(dtype) before gathering.")
    shapes = [tuple(h[2:2 + int(h[1])].tolist()) for h in headers]
    if any(len(s) != tensor.dim() or s[1:] != tuple(tensor.shape[1:]) for s in shapes):
        listed = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(shapes))
        raise ValueError(f"all_gather: only the first dimension may differ between ranks, but the "
                         f"shapes are {listed}.")
    if tensor.dim() == 0:
        out = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(out, tensor, group=group)
        return out
    longest = max(s[0] for s in shapes)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    out = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded, group=group)
    return [o[: s[0]].clone() for o, s in zip(out, shapes)]


def _gather_header(numbers: Sequence[int], tensor: torch.Tensor, group: Any, world_size: int) -> list[torch.Tensor]:
    """Every rank's ``tensor.dtype`` (as a code) and ``numbers``, in rank order: one small all-gather,
    compared before a collective that Gloo would abort on a size mismatch."""
    header = torch.tensor([DTYPE_CODES.get(tensor.dtype, -1), *numbers], dtype=torch.int64, device=tensor.device)
    headers = [torch.empty_like(header) for _ in range(world_size)]
    dist.all_gather(headers, header, group=group)
    return headers


def _dtype_named(code: int) -> Any:
    return DTYPES[code] if code >= 0 else f"code {code}"


def _check_same_sizes(chunks: Sequence[torch.Tensor], group: Any, world_size: int) -> None:
    """reduce_scatter: every rank's r-th chunk must have the same number of elements and dtype; Gloo
    aborts the process on a size mismatch, so the sizes are compared first (one small all-gather)."""
    every = _gather_header([c.numel() for c in chunks], chunks[0], group, world_size)
    if any(not torch.equal(other, every[0]) for other in every[1:]):
        listed = "; ".join(f"rank {r}: {o[1:].tolist()} {_dtype_named(int(o[0]))}" for r, o in enumerate(every))
        raise ValueError(explain(
            "reduce_scatter: every rank must give chunks of the same sizes and dtype (the r-th chunk of "
            f"each rank is reduced with the others' r-th), but the elements per chunk are: {listed}.",
            "give every rank a tensor of the same shape (or lists of the same shapes)."))


def reduce_scatter(tensor: torch.Tensor | Sequence[torch.Tensor], op: str = "sum",
                   group=None) -> torch.Tensor:
    """Reduce over ranks, then give rank ``r`` the ``r``-th chunk of the result.

    ``tensor`` is either one tensor split along dim 0 like ``torch.tensor_split`` (chunks of uneven
    sizes are fine, the same on every rank), or a list of ``world_size`` tensors. Sizes that differ
    between ranks raise a ValueError on every rank. Gloo has no native reduce-scatter: there it is an
    all-reduce followed by taking this rank's chunk, the same result at twice the traffic.
    """
    world_size, rank = _world_size(group, "reduce_scatter"), _rank(group)
    if isinstance(tensor, torch.Tensor):
        if tensor.dim() == 0:
            raise ValueError("reduce_scatter needs a tensor with a first dimension to split, got a scalar.")
        chunks = list(torch.tensor_split(tensor, world_size))
    elif not isinstance(tensor, (list, tuple)):
        raise TypeError(f"reduce_scatter takes a tensor or a list of tensors, got {type(tensor).__name__}.")
    else:
        chunks = list(tensor)
        if len(chunks) != world_size:
            raise ValueError(f"reduce_scatter got {len(chunks)} tensors for a group of {world_size} "
                             "ranks: pass exactly one per rank.")
        for i, chunk in enumerate(chunks):
            check_tensor(f"tensor[{i}]", chunk)
            if chunk.dtype != chunks[0].dtype:  # one flat all-reduce would promote them all
                raise TypeError(explain(f"reduce_scatter's tensors must share a dtype: tensor[0] is "
                                        f"{chunks[0].dtype}, tensor[{i}] is {chunk.dtype}.",
                                        "convert them to one dtype first."))
    name, reduce_op = parse_reduce_op(op)
    for chunk in chunks:
        check_op_dtype("reduce_scatter", name, chunk, op)
    chunks = [c.detach() for c in chunks]  # as torch's: the result is new data, outside autograd
    if world_size == 1:
        return chunks[0].clone()
    _check_same_sizes(chunks, group, world_size)
    same_shapes = all(c.shape == chunks[0].shape for c in chunks)
    narrow = chunks[rank].dtype if widens(name, chunks[rank]) else None
    if narrow is not None:  # new tensors, divided before the sum as in all_reduce: the inputs stay
        chunks = [c.float().div_(world_size) for c in chunks]
    if dist.get_backend(group) == "nccl" and same_shapes:
        out = torch.empty_like(chunks[rank])
        dist.reduce_scatter(out, [c.contiguous() for c in chunks], op=reduce_op, group=group)
    else:
        flat = torch.cat([c.reshape(-1) for c in chunks])
        dist.all_reduce(flat, op=reduce_op, group=group)
        start = sum(c.numel() for c in chunks[:rank])
        out = flat[start:start + chunks[rank].numel()].view_as(chunks[rank]).clone()
    if name in ("mean", "avg") and narrow is None:
        out.div_(world_size)
    return out if narrow is None else out.to(narrow)


def barrier(group=None) -> None:
    """Wait until every rank of the group arrives here."""
    if _world_size(group, "barrier") > 1:
        dist.barrier(group=group)


def comm_device(group) -> torch.device:
    """Where a tensor must be for this group's collectives: the CPU, unless the group has no backend
    for CPU tensors (NCCL alone, named "nccl" or "cuda:nccl"); then the current GPU."""
    if _carries_cpu(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _carries_cpu(group) -> bool:
    types = getattr(group if group is not None else dist.group.WORLD, "_device_types", None)
    if types is not None:  # the devices the group has a backend for (Gloo: both)
        return any(torch.device(t).type == "cpu" for t in types)
    backend = str(dist.get_backend(group))  # older torch: "nccl", "gloo", "cpu:gloo,cuda:nccl", ...
    if ":" in backend:
        return any(part.split(":")[0].strip() == "cpu" for part in backend.split(","))
    return backend != "nccl"
