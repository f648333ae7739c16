"""torch's DDP members that libraries and scripts reach for, beyond the constructor and forward.

``DistributedDataParallel`` inherits this mixin: the public attributes and methods of torch's DDP
that nothing else in ddpkit needs (kept with torch's meaning, so code written against torch's DDP
reads the same values), and the private members that widely used code calls. Which private members
are here, who calls them, and why each is in or out: docs/torch-compat.md.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ddpkit.ddp.ddp_logger import DDPLogger
from ddpkit.ddp.errors import FIND_UNUSED_WITH_STATIC_GRAPH
from ddpkit.ddp.outputs import to_device
from ddpkit.ddp.sync_batchnorm import SyncBatchNorm
from ddpkit.dp.scatter_gather import gather, scatter_kwargs
from ddpkit.errors import explain

__all__ = ["TorchCompat", "BROADCAST_BUCKET_BYTES"]

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""torch's ``broadcast_bucket_size``: the coalescing size of its construction-time broadcast."""


class TorchCompat:
    """torch's remaining DDP members, for ``DistributedDataParallel`` (which sets what they read)."""

    logger: DDPLogger
    """torch's ``dist.Logger``: what ``_get_ddp_logging_data()`` reads (ddpkit.ddp.ddp_logger)."""

    require_backward_grad_sync: bool

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the block averages the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    broadcast_buffers = property(lambda self: self.forward_sync_buffers,
                                 lambda self, value: setattr(self, "forward_sync_buffers", value),
                                 doc="torch 2.13's alias of ``forward_sync_buffers``.")

    def _set_torch_attributes(self, params: Sequence[torch.Tensor]) -> None:
        """torch's plain attributes, with its values; ``params``: the parameters DDP handles."""
        devices = {p.device for p in params}
        self.device_type = next(iter(devices)).type
        self.is_multi_device_module = len(devices) > 1
        self.broadcast_bucket_size = BROADCAST_BUCKET_BYTES
        self.bucket_bytes_cap_default = self._first_bucket_bytes < self.bucket_bytes_cap
        # torch copies inputs to a GPU on a side stream unless this variable says 0; ddpkit's
        # non-blocking copy is on the current stream either way
        self.use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"

    # ---- buffers, as torch names them --------------------------------------------------------
    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers DDP broadcasts (not the ignored ones), read afresh as torch re-reads them."""
        ignore = self.parameters_to_ignore
        return {n: b for n, b in self.module.named_buffers() if n not in ignore}

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        return list(self.named_module_buffers.values())

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (torch's rule)."""
        return self._will_sync_buffers()

    def _check_sync_bufs_pre_fwd(self) -> bool:
        """torch's name for the same question (ddpkit has no buffer comm hook to sync after forward)."""
        return self.will_sync_module_buffers()

    def _check_sync_bufs_post_fwd(self) -> bool:
        return False

    # ---- torch's input and output moves (DataParallel's, kept by torch for compatibility) -------
    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> tuple[tuple, tuple]:
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def to_kwargs(self, inputs: tuple, kwargs: dict | None, device_id: int) -> tuple[tuple, tuple]:
        """``inputs`` and ``kwargs`` moved to device ``device_id`` of this DDP's type, as torch's
        ``([inputs], [kwargs])`` tuples (an empty side padded with ``()`` or ``{}``)."""
        device = torch.device(self.device_type, device_id)
        moved = [tuple(to_device(tuple(inputs), device))] if inputs else []
        moved_kwargs = [to_device(kwargs, device)] if kwargs else []
        moved += [()] * (len(moved_kwargs) - len(moved))
        moved_kwargs += [{}] * (len(moved) - len(moved_kwargs))
        return tuple(moved), tuple(moved_kwargs)

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        return gather(outputs, output_device, dim=self.dim)

    # ---- torch's private configuration calls, which its own error messages recommend --------
    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """Keep these fully qualified parameter and buffer names out of any DDP wrapping ``module``
        later: not broadcast, not checked across ranks, not averaged. As torch, each is marked
        ``_ddp_ignored`` too, which torch.compile's DDPOptimizer reads to leave it out of its buckets."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

    def _set_static_graph(self) -> None:
        """``static_graph=True`` after construction, before the first forward (torch's call)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again. "
                          "_set_static_graph() changes nothing on a DistributedDataParallel built with "
                          "static_graph=True.", stacklevel=2)
            return
        if self.reducer is not None:
            self.reducer.set_static_graph()
        if self._solo is not None:  # a static graph may leave parameters unused, or reach one twice
            self._solo.disable()
        self.static_graph = True
        self.logger._set_static_graph()
        if self.find_unused_parameters:
            warnings.warn(FIND_UNUSED_WITH_STATIC_GRAPH, stacklevel=2)

    # ---- private state that libraries read -------------------------------------------------
    @property
    def _has_rebuilt_buckets(self) -> bool:
        """Whether the buckets were rebuilt in gradient order (torch's ZeRO hook waits for it)."""
        reducer = self.reducer
        return reducer is not None and reducer.layout._rebuild_planned and reducer.layout.rebuilt

    # ---- torch's logging data ------------------------------------------------------------------
    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's logging data, under its keys: the construction facts, the environment, what the
        last sampled iteration measured, and the last error (ddpkit.ddp.ddp_logger)."""
        data = self.logger.data  # read, not kept: the dict is the copy
        return {**data.strs_map, **data.ints_map}

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Time the first ten iterations, then every ``sample_rate``-th (torch's default: 100)."""
        if sample_rate < 1:
            raise self.logger.logged(ValueError(explain(
                f"DDP runtime logging sample rate should be equal or greater than 1, got {sample_rate!r}.",
                "pass 1 to time every iteration, or more to time fewer.", who="DistributedDataParallel",
                rank=self.rank)), typed=True)
        self.logger.sample_rate = sample_rate

    def _log_construction(self) -> None:
        """The facts torch's logger takes at construction (a copy made by unpickling logs anew)."""
        self.logger.set_construction_data_and_log(
            type(self.module).__name__, list(self.device_ids or ()),
            -1 if self.output_device is None else self.output_device.index, self.forward_sync_buffers,
            any(isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm)) for m in self.module.modules()), self.static_graph)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hooks by name (``dist.BuiltinCommHookType``): its Python twins from ddpkit.hooks."""
        from ddpkit.ddp.hooks import allreduce_hook, fp16_compress_hook

        hooks = {"ALLREDUCE": allreduce_hook, "FP16_COMPRESS": fp16_compress_hook}
        name = getattr(comm_hook_type, "name", str(comm_hook_type)).rsplit(".", 1)[-1]
        if name not in hooks:
            raise ValueError(explain(f"_register_builtin_comm_hook: unknown comm hook type {comm_hook_type!r}.",
                                     "pass dist.BuiltinCommHookType.ALLREDUCE or FP16_COMPRESS.",
                                     who="DistributedDataParallel", rank=self.rank))
        self.register_comm_hook(self.process_group, hooks[name])
        self.logger._set_comm_hook_name(str(comm_hook_type))

    def _register_fused_optim(self, optim: type, *args: Any, optim_params: Any = None, **kwargs: Any) -> None:
        """torch's optimizer in backward: each bucket's parameters are stepped by a functional
        ``optim`` as soon as the bucket's average is in (torch's own overlapped optimizer, which
        registers its comm hook here as on torch's DDP)."""
        from torch.distributed.algorithms._optimizer_overlap import _as_overlapped_optim

        if self.process_group is None:  # no reducer, no comm hook: the optimizer would never step
            raise RuntimeError(explain(
                f"_register_fused_optim({getattr(optim, '__name__', optim)}) needs a process group: it steps "
                "the optimizer from the comm hook, and the single-process fallback has no comm hooks.",
                "call ddpkit.init() first (a world of one gets a group), or call optimizer.step() after "
                "backward().", who="DistributedDataParallel", rank=self.rank))
        overlapped_optim = _as_overlapped_optim(optim, optim_params, *args, **kwargs)
        try:
            overlapped_optim.register_ddp(self)
        except NotImplementedError as e:  # torch's words
            raise RuntimeError(f"{optim} does not support overlapped DDP. Please file an issue to PyTorch or "
                               f"the respective owner of {optim}.") from e
