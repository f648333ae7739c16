"""``DistributedDataParallel``: ddpkit's own, with the reducer written in Python.

    model = ddpkit.DistributedDataParallel(model)        # after ddpkit.init()
    loss_fn(model(x), y).backward()                      # gradients are averaged over ranks here

Same arguments, defaults and results as ``torch.nn.parallel.DistributedDataParallel``; the bucketing
and the overlapped all-reduce live in ``ddpkit.reducer`` on plain ``torch.distributed`` collectives.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from ddpkit.autograd_engine import preserving_autograd_versions
from ddpkit.bucket import DEFAULT_FIRST_BUCKET_BYTES
from ddpkit.comm import all_gather_object
from ddpkit.join import JoinSupport
from ddpkit.process_group import require_group_when_launched
from ddpkit.reducer import Reducer

__all__ = ["DistributedDataParallel", "DDP"]

_MIB = 1024 * 1024
_DEFAULT_BUCKET_CAP_MB = 25
_BROADCAST_CHUNK_BYTES = 250 * _MIB  # torch's broadcast_bucket_size


class DistributedDataParallel(nn.Module, JoinSupport):
    """Data parallelism over processes: same model on every rank, gradients averaged in backward.

    Construction checks that every rank holds the same parameters, copies rank 0's parameters (and
    buffers) to all, and hands the parameters to a ``Reducer``. Each forward may broadcast rank 0's
    buffers; each synced backward averages the gradients. In a world of one it is a plain wrapper.

    Example:
        >>> ddpkit.init()
        >>> model = ddpkit.DDP(nn.Linear(8, 2))
        >>> model(torch.randn(4, 8)).sum().backward()   # .grad is the average over ranks
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group=None,
                 bucket_cap_mb: float | None = _DEFAULT_BUCKET_CAP_MB,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False):
        super().__init__()
        JoinSupport.__init__(self)
        self.module = module
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True  # public: no_sync() sets it, and so may scripts
        # torch's way to keep some parameters and buffers out of DDP: per-rank ones, left alone
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self.process_group = _default_group() if process_group is None else process_group
        if self.process_group is None:  # a world of one, unless a launcher started several ranks
            require_group_when_launched("DistributedDataParallel",
                                        "each rank would train on its own, its gradients never averaged")
        self.world_size = 1 if self.process_group is None else dist.get_world_size(self.process_group)
        self.rank = 0 if self.process_group is None else dist.get_rank(self.process_group)
        local_error: Exception | None = None
        try:  # checks of this rank's arguments: every rank must hear of a failure, not wait for it
            if not isinstance(module, nn.Module):
                raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module, got {type(module).__name__}.")
            named = self._parameters_to_reduce()
            if self.world_size > 1:  # a world of one averages nothing: sparse gradients pass through
                self._refuse_sparse_gradients()
            self.device, self.device_ids, self.output_device = self._check_devices(device_ids, output_device)
            self.bucket_bytes_cap, self._first_bucket_bytes = _bucket_caps(bucket_cap_mb, self.device)
        except (TypeError, ValueError, RuntimeError) as e:
            local_error = e
        if self.world_size > 1:
            self._verify_same_parameters(local_error)
        if local_error is not None:
            raise local_error
        # whether there are buffers at all: walking the module tree each forward costs ~1 ms at 400
        # modules, so a model without buffers is not walked again
        self._has_buffers = any(True for _ in self._synced_buffers())
        self.reducer: Reducer | None = None  # none in a world of one: nothing to average
        if self.world_size > 1:
            self._broadcast_states(src=0, buffers=broadcast_buffers)
            self.reducer = self._make_reducer(named)

    # ---- construction steps --------------------------------------------------------------------
    def _parameters_to_reduce(self) -> list[tuple[str, nn.Parameter]]:
        for name, p in self.module.named_parameters():
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise RuntimeError(
                    f"DistributedDataParallel needs initialized parameters, but {name!r} is not yet (a "
                    "lazy module, such as nn.LazyLinear, sizes it at its first forward). HINT: run one "
                    "forward pass on a sample batch before wrapping the model.")
        named = [(n, p) for n, p in self.module.named_parameters()
                 if p.requires_grad and n not in self.parameters_to_ignore]
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        return named

    def _refuse_sparse_gradients(self) -> None:
        """Sparse gradients (torch's rule: an embedding built with sparse=True) have no flat bucket."""
        for name, module in self.module.named_modules():
            if (isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
                    and module.weight.requires_grad):
                where = f"{name}.weight" if name else "weight"
                raise NotImplementedError(
                    f"DistributedDataParallel averages dense gradients only, but {where!r} gets sparse "
                    f"ones ({type(module).__name__}(sparse=True)). HINT: build it with sparse=False, "
                    "or use torch.nn.parallel.DistributedDataParallel, which averages sparse gradients.")

    def _check_devices(self, device_ids, output_device):
        """torch's rules: device_ids only for a module on one GPU, and then a single device."""
        devices = {p.device for p in self.module.parameters()}
        types = sorted({d.type for d in devices})
        if len(types) != 1:
            raise ValueError(f"DistributedDataParallel needs the module's parameters on one type of "
                             f"device, found {types}. HINT: move the whole module with .to(device).")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"device_ids={list(device_ids)}: DistributedDataParallel drives one device "
                             "per process, so device_ids can only be None or contain a single element. "
                             "HINT: start one process per GPU (ddpkit run --nproc-per-node).")
        if not device_ids or types[0] == "cpu" or len(devices) > 1:
            if device_ids or output_device:  # torch's test: an output_device of 0 passes, unused
                raise ValueError(
                    f"device_ids={device_ids} and output_device={output_device} only apply to a module "
                    f"on a single GPU, but its parameters are on {sorted(map(str, devices))}. "
                    "HINT: leave device_ids and output_device as None for CPU or multi-device modules.")
            return next(iter(self.module.parameters())).device, None, None
        device = _as_device(device_ids[0], types[0])
        if device not in devices:
            raise ValueError(f"device_ids names {device}, but the module's parameters are on "
                             f"{next(iter(devices))}. HINT: move the module there with .to({str(device)!r}).")
        output = device if output_device is None else _as_device(output_device, types[0])
        return device, [device.index], output

    def _verify_same_parameters(self, local_error: Exception | None) -> None:
        """Raise on every rank, naming the first difference, unless all ranks hold the same tensors.

        A rank whose own arguments were refused (``local_error``) says so through the same
        collective, so that the others raise too instead of waiting for it.
        """
        mine = [] if local_error is not None else [
            (n, tuple(t.shape), str(t.dtype).replace("torch.", ""),
             t.requires_grad if isinstance(t, nn.Parameter) else None)  # None: a buffer
            for n, t in self._states(buffers=self.broadcast_buffers)]
        shared = (None if local_error is None else f"{type(local_error).__name__}: {local_error}", mine)
        gathered = all_gather_object(shared, group=self.process_group)
        failed = [(rank, error) for rank, (error, _) in enumerate(gathered) if error is not None]
        if failed and local_error is None:
            rank, error = failed[0]
            raise RuntimeError(f"DistributedDataParallel could not be built on rank {rank}: {error} "
                               f"(this is rank {self.rank}).")
        if failed:
            return  # the caller raises this rank's own error
        everyone = [tensors for _, tensors in gathered]
        for rank in range(1, self.world_size):
            problem = _first_difference(everyone[0], everyone[rank], rank)
            if problem:
                raise RuntimeError(
                    f"DistributedDataParallel needs the same parameters and buffers on every rank, but "
                    f"{problem} (this is rank {self.rank}). HINT: build the model identically on every "
                    "rank (same arguments, same code path) before wrapping it.")

    def _make_reducer(self, named: list[tuple[str, nn.Parameter]]) -> Reducer:
        return Reducer([p for _, p in named], [n for n, _ in named], self.process_group,
                       self.bucket_bytes_cap, self._first_bucket_bytes,
                       find_unused_parameters=self.find_unused_parameters,
                       gradient_as_bucket_view=self.gradient_as_bucket_view,
                       static_graph=self.static_graph)

    def _states(self, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
        ignore = self.parameters_to_ignore
        yield from ((n, p) for n, p in self.module.named_parameters() if n not in ignore)
        if buffers:
            yield from ((n, b) for n, b in self.module.named_buffers() if n not in ignore)

    def _synced_buffers(self) -> list[torch.Tensor]:
        if not self.parameters_to_ignore:
            return list(self.module.buffers())
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _broadcast_states(self, src: int, buffers: bool) -> None:
        """Copy rank ``src``'s parameters (and buffers) to every rank, coalesced."""
        _broadcast_coalesced([t for _, t in self._states(buffers)], src, self.process_group)

    # ---- torch's private configuration calls, which its own error messages recommend --------
    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """Keep these fully qualified parameter and buffer names out of any DDP wrapping ``module``
        later: not broadcast, not checked across ranks, not averaged."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    def _set_static_graph(self) -> None:
        """``static_graph=True`` after construction, before the first forward (torch's call)."""
        if self.static_graph:
            warnings.warn("static_graph is already True; _set_static_graph() changes nothing.")
            return
        if self.reducer is not None:
            self.reducer.set_static_graph()
        self.static_graph = True

    # ---- pickling: copy.deepcopy (an EMA or teacher copy) and torch.save of the wrapper --------
    def __getstate__(self) -> dict[str, Any]:
        """torch's rule: without the process group and the reducer, which the copy makes anew."""
        if self.process_group is not _default_group():
            raise RuntimeError(
                "DistributedDataParallel can be pickled or deep-copied only when it uses the default "
                "process group (the copy joins the default group). HINT: copy or save its .module "
                "and wrap that in a new DistributedDataParallel.")
        state = super().__getstate__()
        del state["process_group"], state["reducer"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The copy averages its own parameters' gradients over the default group; its comm hook,
        as in torch, is not carried over."""
        super().__setstate__(state)
        self.process_group = _default_group()
        self.world_size = 1 if self.process_group is None else dist.get_world_size(self.process_group)
        self.rank = 0 if self.process_group is None else dist.get_rank(self.process_group)
        self.reducer = self._make_reducer(self._parameters_to_reduce()) if self.world_size > 1 else None

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        return self._post_forward(output)

    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.device_ids:
            inputs, kwargs = _to_device(inputs, self.device), _to_device(kwargs, self.device)
        if self.reducer is None:
            return inputs, kwargs
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.require_backward_grad_sync:
            self.reducer.prepare_for_forward()
        work = Join.notify_join_context(self)
        if work is not None and not self._divide_by_initial_world_size:
            self.reducer.set_join_count(work)
        if grad_enabled:
            self.reducer.rebuild_buckets_if_due()
        if self._will_sync_buffers():
            self._sync_buffers(active=True)
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        return inputs, kwargs

    def _post_forward(self, output: Any) -> Any:
        if self.reducer is None:
            return output
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            outputs = [t for t in _find_tensors(output) if t.requires_grad]
            # with static_graph the first iteration's hook counts decide, as in torch
            search = self.find_unused_parameters and not self.static_graph
            unused = self._unreached_parameters(outputs) if search else ()
            self.reducer.prepare_for_backward(unused)
            # the hooks say where backward ends: look into a plain output object too (torch's
            # search above does not, and find_unused_parameters keeps its answer)
            hooked = outputs or [t for t in _find_tensors(output, attributes=True) if t.requires_grad]
            for t in hooked:
                if t.grad_fn is not None:  # a hook on a leaf would stay on it for good
                    t.register_hook(self.reducer.output_gradient_hook())
        else:
            self.require_forward_param_sync = False
            self.reducer.prepare_for_local_backward()
        return output

    def _unreached_parameters(self, outputs: list[torch.Tensor]) -> list[int]:
        """Indices of the parameters the outputs' autograd graph does not reach (torch's search)."""
        index_of = self.reducer.index_of
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

    # ---- buffers -------------------------------------------------------------------------------
    def _will_sync_buffers(self) -> bool:
        """torch's rule: before a forward that follows a synced one, when there are buffers."""
        return self.require_forward_param_sync and self.broadcast_buffers and self._has_buffers

    def _sync_buffers(self, active: bool) -> None:
        """Broadcast buffers from rank 0, or under join from the highest rank still active.

        Read afresh each time, as torch does: a module may replace a buffer out of place (an
        exponential moving average written ``self.avg = ...``); that walk of the module tree is the
        price of it for models with buffers. The copy keeps the buffers' autograd versions, as
        torch's does: a graph of an earlier forward of this iteration may have saved them.
        """
        src = self._find_common_rank(self.rank, active) if self._join_config.enable else 0
        buffers = self._synced_buffers()
        with preserving_autograd_versions(buffers):
            _broadcast_coalesced(buffers, src, self.process_group)

    # ---- options -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the block averages the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Let ``hook(state, bucket) -> Future[Tensor]`` average each bucket (see ``ddpkit.hooks``)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {type(hook).__name__}.")
        if self.reducer is not None:  # a world of one has nothing to average: the hook never runs
            self.reducer.register_comm_hook(state, hook)


DDP = DistributedDataParallel


# --------------------------------------------------------------------------------------------------


def _default_group():
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _bucket_caps(bucket_cap_mb: float | None, device: torch.device) -> tuple[int, int]:
    """(cap, first cap): torch's small first bucket, with the default cap, on GPUs only.

    On CPU, Gloo runs the all-reduce on threads that share the cores backward is using: a bucket
    launched during backward preempts it (2 ranks on 2 cores: about 5 more involuntary context
    switches and 1 to 1.5 ms more per step for one more bucket), which the 1 MiB it overlaps does not
    pay back. So every CPU bucket holds up to the cap; models above it still overlap.
    """
    if bucket_cap_mb is None:
        bucket_cap_mb = _DEFAULT_BUCKET_CAP_MB
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number of MiB, 0 or more (0: one "
                         "bucket per parameter).")
    cap = max(1, int(bucket_cap_mb * _MIB))
    small_first = bucket_cap_mb == _DEFAULT_BUCKET_CAP_MB and device.type != "cpu"
    return cap, min(DEFAULT_FIRST_BUCKET_BYTES, cap) if small_first else cap


def _as_device(device: int | str | torch.device, device_type: str) -> torch.device:
    if isinstance(device, int):
        return torch.device(device_type, device)
    device = torch.device(device)
    if device.index is None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _first_difference(ref: list[tuple], other: list[tuple], rank: int) -> str | None:
    def describe(entry: tuple, r: int) -> str:
        name, shape, dtype, requires_grad = entry
        frozen = ", requires_grad=False" if requires_grad is False else ""
        return f"rank {r} has {name!r} with shape {list(shape)} ({dtype}{frozen})"

    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return f"tensor #{i} differs: {describe(a, 0)}, {describe(b, rank)}"
    if len(ref) != len(other):
        longer, r = (ref, 0) if len(ref) > len(other) else (other, rank)
        return (f"rank 0 has {len(ref)} parameters/buffers and rank {rank} has {len(other)}; the first "
                f"without a counterpart: {describe(longer[min(len(ref), len(other))], r)}")
    return None


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast ``tensors`` from group rank ``src`` as a few flat tensors per (device, dtype)."""
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        chunks = groups.setdefault(key, [[]])
        if filled.get(key, 0) > _BROADCAST_CHUNK_BYTES:
            chunks.append([])
            filled[key] = 0
        chunks[-1].append(t)
        filled[key] = filled.get(key, 0) + t.numel() * t.element_size()
    receiving = dist.get_rank(group) != src
    with torch.no_grad():
        for chunks in groups.values():
            for chunk in chunks:
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
                if receiving:
                    views = torch.split(flat, [t.numel() for t in chunk])
                    torch._foreach_copy_(chunk, [v.view_as(t) for v, t in zip(views, chunk)])


def _find_tensors(obj: Any, attributes: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output: tensors, lists, tuples, dicts, dataclasses; with
    ``attributes`` also those a plain object holds (one level: no cycles to follow)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _find_tensors(getattr(obj, field.name))
    elif attributes and hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module)):
        for item in vars(obj).values():
            yield from _find_tensors(item)


def _to_device(obj: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) input to ``device``, as torch's DDP does with device_ids."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj
