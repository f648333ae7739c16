"""``DistributedDataParallel``: ddpkit's own, with the reducer written in Python.

    model = ddpkit.DistributedDataParallel(model)        # after ddpkit.init()
    loss_fn(model(x), y).backward()                      # gradients are averaged over ranks here

Same arguments, defaults and results as ``torch.nn.parallel.DistributedDataParallel``; the bucketing
and the overlapped all-reduce live in ``ddpkit.ddp.reducer`` on plain ``torch.distributed`` collectives.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from ddpkit.ddp import mixed_precision as mp
from ddpkit.ddp import options
from ddpkit.ddp.arguments import (
    bucket_caps,
    check_comm_hook,
    check_devices,
    refuse_meta,
    refuse_torch_sync_batchnorm_on_cpu,
    refuse_uninitialized,
    sparse_gradient_names,
)
from ddpkit.ddp.compile_support import DYNAMO_CALLBACK, bookkeeping, eager, inside_ddp_forward
from ddpkit.ddp.ddp_logger import DDPLogger, logs_errors
from ddpkit.ddp.delayed import DelayedAllReduce
from ddpkit.ddp.errors import FIND_UNUSED_WITH_STATIC_GRAPH, no_parameters_error, not_a_module_error, warn_if_all_used
from ddpkit.ddp.join import JoinSupport
from ddpkit.ddp.outputs import backward_entries, find_tensors, to_device
from ddpkit.ddp.parameter_watch import ParameterWatch
from ddpkit.ddp.pickling import PicklingSupport
from ddpkit.ddp.profiling import forward_range
from ddpkit.ddp.python_reducer import PythonReducer, python_reducer_for
from ddpkit.ddp.reducer import Reducer
from ddpkit.ddp.solo_checks import SoloChecks, solo_checks_for
from ddpkit.ddp.state_sync import StateSyncSupport, overlapping_state_error, verify_same_tensors
from ddpkit.ddp.torch_compat import TorchCompat
from ddpkit.runtime.process_group import require_group_when_launched

__all__ = ["DistributedDataParallel", "DDP"]

class DistributedDataParallel(PicklingSupport, JoinSupport, StateSyncSupport, TorchCompat):
    """Data parallelism over processes: same model on every rank, gradients averaged in backward.

    Construction checks that every rank holds the same parameters, copies rank 0's parameters (and
    buffers) to all, and hands the parameters to a ``Reducer``. Each forward may broadcast rank 0's
    buffers; each synced backward averages the gradients. In a world of one it is a plain wrapper.

    Example:
        >>> ddpkit.init()
        >>> model = ddpkit.DDP(nn.Linear(8, 2))
        >>> model(torch.randn(4, 8)).sum().backward()   # .grad is the average over ranks
    """

    _reducer_options: ClassVar[dict[str, Any]] = {}
    """Keyword arguments for the reducer (e.g. ``split_bytes``); a subclass sets them, the constructor
    keeps torch's signature."""

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False,
                 delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
                 param_to_hook_all_reduce: nn.Parameter | None = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Sequence[float] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None):
        super().__init__()
        JoinSupport.__init__(self)
        # torch 2.13's arguments, resolved as torch does: see ddpkit.ddp.options and docs/torch-compat.md
        options.check_delay_pair(delay_all_reduce_named_params, param_to_hook_all_reduce)
        options.warn_check_reduction(check_reduction)
        buffer_sync = options.resolve_buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.module, self.dim = module, dim
        self.forward_sync_buffers = buffer_sync.forward  # broadcast_buffers reads it, as in torch
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        if static_graph and find_unused_parameters:  # torch's words, as its constructor warns them
            warnings.warn(FIND_UNUSED_WITH_STATIC_GRAPH, stacklevel=2)
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy  # ddpkit always batches small copies (Note [Big gradients])
        self.require_backward_grad_sync = True  # public: no_sync() sets it, and so may scripts
        # torch's way to keep some parameters and buffers out of DDP: per-rank ones, left alone
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        delayed = list(delay_all_reduce_named_params or ())
        self.parameters_to_ignore.update(name for name, _ in delayed)  # averaged apart, as in torch
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._join_group(options.resolve_group(process_group, device_mesh))
        if device_mesh is not None:
            self.device_mesh = device_mesh
        if self.process_group is None:  # a world of one, unless a launcher started several ranks
            require_group_when_launched("DistributedDataParallel",
                                        "each rank would train on its own, its gradients never averaged")
        local_error: Exception | None = None
        try:  # checks of this rank's arguments: every rank must hear of a failure, not wait for it
            if not isinstance(module, nn.Module):
                raise not_a_module_error(module)
            named = self._parameters_to_reduce(delayed_too=bool(delayed))
            self.mixed_precision = mp.resolve_mixed_precision(mixed_precision, self.rank)  # torch's meaning
            if self.mixed_precision is not None:
                mp.refuse_compiled(module, self.rank)
            handled = [p for _, p in self._states(buffers=False)] or [p for _, p in delayed]
            self.device, self.device_ids, self.output_device = check_devices(handled, device_ids, output_device)
            refuse_meta(named)
            refuse_torch_sync_batchnorm_on_cpu(module, self.device)
            self.bucket_bytes_cap, self._first_bucket_bytes = bucket_caps(bucket_cap_mb)
            self.bucket_bytes_cap_list = list(options.bucket_cap_list(bucket_cap_mb_list))
            if self.bucket_bytes_cap_list:  # torch: the largest is the cap, and no small first bucket
                self.bucket_bytes_cap = self._first_bucket_bytes = max(self.bucket_bytes_cap_list)
            self._set_torch_attributes(handled)
        except (TypeError, ValueError, RuntimeError) as e:
            local_error = e
        # torch's init_sync=False: no check across ranks and no broadcast, the caller's promise that
        # every rank starts from the same values; torch skips both when every parameter is delayed
        init_sync = init_sync and bool(named if local_error is None else True)
        if self.world_size > 1 and init_sync and local_error is None:
            local_error = overlapping_state_error(self._states(buffers=buffer_sync.init), self.rank)
        if self.world_size > 1 and init_sync:
            verify_same_tensors(self._states(buffers=buffer_sync.init), local_error, self.process_group,
                                self.rank, self.world_size)
        if local_error is not None:
            raise local_error
        # whether there are buffers at all: a model without buffers is not walked again each forward,
        # a walk that costs time in proportion to its modules (see docs/performance.md)
        self._has_buffers = any(True for _ in self._synced_buffers())
        self.reducer: Reducer | None = None  # none in a world of one: nothing to average
        self.logger = DDPLogger(self)  # torch's logging data: facts, sampled timings, the last error
        self._delayed: DelayedAllReduce | None = None
        if self.world_size > 1 and delayed:
            hook_name = next((n for n, p in module.named_parameters() if p is param_to_hook_all_reduce),
                             "param_to_hook_all_reduce")
            self._delayed = DelayedAllReduce(delayed, param_to_hook_all_reduce, hook_name, self.process_group)
        self._python_reducer: PythonReducer | None = None
        if self.world_size > 1 and named:
            if init_sync:
                self._broadcast_states(src=0, buffers=buffer_sync.init)
            # torch's mode for compiled autograd: no reducer, no buckets
            self._python_reducer = python_reducer_for(self, [p for _, p in named])
            if self._python_reducer is None:
                self.reducer = self._make_reducer(named)
        self._solo: SoloChecks | None = solo_checks_for(self, named)  # a group of one: the checks alone
        if self.mixed_precision is not None:  # after the broadcast, so every rank casts the same values
            mp.cast_buffers(module, self.mixed_precision, self.parameters_to_ignore)
            if self.reducer is not None and mp.needs_reduce_hook(self.mixed_precision, self.reducer.params):
                self.reducer.register_comm_hook((self.process_group, self.mixed_precision.effective_reduce_dtype),
                                                mp.allreduce_in_dtype_hook)
        self._log_construction()

    # ---- construction steps --------------------------------------------------------------------
    def _join_group(self, process_group) -> None:
        """Use ``process_group`` (None: no process group, a world of one)."""
        self.process_group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.rank = 0 if process_group is None else dist.get_rank(process_group)

    def _parameters_to_reduce(self, delayed_too: bool = False) -> list[tuple[str, nn.Parameter]]:
        """``delayed_too``: some parameters are averaged apart, so none left here is no error."""
        refuse_uninitialized(self.module)
        named = [(n, p) for n, p in self.module.named_parameters()
                 if p.requires_grad and n not in self.parameters_to_ignore]
        if not named and not delayed_too:
            raise no_parameters_error(self.rank)
        return named

    def _make_reducer(self, named: list[tuple[str, nn.Parameter]]) -> Reducer:
        reducer = Reducer([p for _, p in named], [n for n, _ in named], self.process_group,
                          self.bucket_bytes_cap, self._first_bucket_bytes,
                          find_unused_parameters=self.find_unused_parameters,
                          gradient_as_bucket_view=self.gradient_as_bucket_view,
                          static_graph=self.static_graph, cap_list=self.bucket_bytes_cap_list,
                          skip_unused=self.skip_all_reduce_unused_params,
                          sparse=sparse_gradient_names(self.module, [n for n, _ in named]),
                          logger=self.logger, watch=ParameterWatch(self.module, named, self.parameters_to_ignore),
                          **self._reducer_options)
        self.logger.note_buckets(reducer.buckets)  # a reducer made late (a comm hook in a world of one)
        return reducer

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._python_reducer is not None and torch.compiler.is_compiling():
            # optimize_ddp="python_reducer": Dynamo traces the whole forward, fullgraph=True too, as
            # torch's DDP lets it there (its forward then skips its own bookkeeping, as here)
            inputs, kwargs = self._on_device(inputs, kwargs)
            return self.module(*inputs, **kwargs)
        return self._forward(*inputs, **kwargs)

    def _on_device(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The inputs on the module's device where ``device_ids`` names one, as torch's DDP moves them."""
        if not self.device_ids:
            return inputs, kwargs
        return to_device(inputs, self.device), to_device(kwargs, self.device)

    @eager  # torch.compile: this runs eagerly, the module is compiled (see ddpkit.ddp.compile_support)
    def _forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # no torch.compile around this call: no wrapper to keep Dynamo out of the bookkeeping (15 us)
        direct = DYNAMO_CALLBACK is not None and DYNAMO_CALLBACK() is None
        pre = getattr(self._pre_forward, "plain", None) if direct else None  # a subclass's override: as it is
        post = getattr(self._post_forward, "plain", None) if direct else None
        with forward_range():  # torch's name for it in a trace
            inputs, kwargs = pre(self, *inputs, **kwargs) if pre else self._pre_forward(*inputs, **kwargs)
            with inside_ddp_forward(self):  # Dynamo's DDPOptimizer splits the graph at our buckets
                if self.mixed_precision is None:
                    output = self.module(*inputs, **kwargs)
                else:  # on copies in param_dtype, made now
                    output = mp.forward_in_param_dtype(self.module, self.mixed_precision,
                                                       self.parameters_to_ignore, inputs, kwargs)
            return post(self, output) if post else self._post_forward(output)

    @bookkeeping
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """torch's signature, which a subclass overriding it keeps (torch's ``replicate`` calls it so)."""
        inputs, kwargs = self._on_device(inputs, kwargs)
        grad_enabled = torch.is_grad_enabled()
        if self.reducer is not None and self.reducer.adopt:
            self.reducer.layout.let_go_of_retired()
        if grad_enabled and self.require_backward_grad_sync:
            self.logger.start_forward()  # torch's iteration count, and its sampled timings
            if self.reducer is not None:
                self.reducer.prepare_for_forward()
            elif self._solo is not None:
                self._solo.prepare_for_forward()
        if self.reducer is None:
            return inputs, kwargs
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

    @bookkeeping
    def _post_forward(self, output: Any) -> Any:
        if self._delayed is not None:
            self._delayed.after_forward(torch.is_grad_enabled() and self.require_backward_grad_sync)
        if self.reducer is None:
            if self._solo is not None:
                self._solo.prepare_for_backward(torch.is_grad_enabled() and self.require_backward_grad_sync, output)
            self.logger.end_forward()
            return output
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            outputs = [t for t in find_tensors(output) if t.requires_grad]
            search = self.find_unused_parameters and not self.static_graph
            unused = self.reducer.unreached(outputs)
            self.reducer.prepare_for_backward(unused)
            if search:  # torch logs whether the unused ones stay the same (can_set_static_graph)
                self.logger.note_unused(unused)
                if not unused:
                    warn_if_all_used(self.reducer.rank)
            # the hooks say where backward ends: look into a plain output object too (torch's
            # search above does not, and find_unused_parameters keeps its answer)
            for t in backward_entries(output, outputs):
                t.register_hook(self.reducer.output_gradient_hook())
        else:
            self.require_forward_param_sync = False
            self.reducer.prepare_for_local_backward()
        return output

    # ---- options -------------------------------------------------------------------------------
    @logs_errors
    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Let ``hook(state, bucket) -> Future[Tensor]`` average each bucket (see ``ddpkit.hooks``)."""
        check_comm_hook(hook, self.rank)
        if self._python_reducer is not None:  # torch's python reducer calls it per gradient
            self._python_reducer.comm_hooks.append((hook, state))
        elif self.mixed_precision is not None and self.reducer is not None:
            raise mp.refuse_comm_hook(self.rank, hook)
        elif self.process_group is not None:  # else no collective the hook could call
            if self.reducer is None:
                # a group of one (torchrun --nproc-per-node 1): nothing to average, but torch runs the
                # hook, and a hook may change the gradients (fp16 rounding), so it runs here too
                self.reducer = self._make_reducer(self._parameters_to_reduce())
                if self._solo is not None:  # the reducer checks now
                    self._solo.disable()
            self.reducer.register_comm_hook(state, hook)
        self.logger._set_comm_hook_name(getattr(hook, "__qualname__", repr(hook)))


DDP = DistributedDataParallel
