"""DataParallel and data_parallel: scatter, replicate, parallel_apply, gather, in one process.

Same arguments, defaults and results as ``torch.nn.DataParallel`` / ``torch.nn.parallel.data_parallel``,
except that a device may also be the CPU, named several times, so the whole path runs without GPUs:
``DataParallel(model, device_ids=["cpu"] * 3)`` really splits the batch over three replicas.
As in torch, without CUDA and without CPU devices in ``device_ids`` the module is simply called.
"""
from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from itertools import chain
from typing import Any, TypeVar

import torch
from torch import nn

from ddpkit.dp.devices import DeviceLike, as_device, as_devices, check_available, device_id
from ddpkit.dp.parallel_apply import parallel_apply_on
from ddpkit.dp.replicate import replicate_to
from ddpkit.dp.scatter_gather import check_dim_type, gather_target, gather_to, scatter_kwargs_to
from ddpkit.errors import EmptyListError, not_a_module_error

__all__ = ["DataParallel", "data_parallel"]

M = TypeVar("M", bound=nn.Module)

_IMBALANCE_WARNING = """
    There is an imbalance between your GPUs. You may want to exclude GPU {} which
    has less than 75% of the memory or cores of GPU {}. You can do so by setting
    the device_ids argument to DataParallel, or by setting the CUDA_VISIBLE_DEVICES
    environment variable."""


def _empty_device_ids() -> EmptyListError:
    return EmptyListError(
        "device_ids is empty: expected at least one device. "
        "HINT: pass device_ids=None to use every GPU, or name devices, e.g. ['cpu', 'cpu'].",
        argument="device_ids")


def _resolve_device_ids(device_ids: Sequence[DeviceLike] | None, *,
                        named_gpus_needed: bool = False) -> list[torch.device]:
    """The devices to use; an empty list means torch's CPU mode (call the module directly).

    ``named_gpus_needed``: GPUs named without CUDA raise, as torch's ``data_parallel`` does, instead
    of the CPU mode torch's ``DataParallel`` falls back to.
    """
    cuda = torch.cuda.is_available()
    if device_ids is None:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if cuda else []
    devices = as_devices(device_ids, what="device_ids")
    if named_gpus_needed and not cuda and devices and not any(d.type == "cpu" for d in devices):
        raise RuntimeError(
            f"data_parallel: device type could not be determined: device_ids={list(device_ids)!r} names "
            f"{devices[0]}, but CUDA is not available on this machine. HINT: pass device_ids=None to "
            "call the module as it is, or name CPU devices, e.g. ['cpu', 'cpu'].")
    if not cuda and not any(d.type == "cpu" for d in devices):
        # torch ignores device_ids when there is no GPU (an empty list too), so scripts written for
        # GPUs still run; it says nothing, where a user who named GPUs would want to know
        if devices:
            warnings.warn(f"DataParallel: device_ids={list(device_ids)!r} names {devices[0]}, but CUDA is not "
                          "available on this machine: the module is called as it is, on one device, as torch's "
                          "DataParallel does. HINT: name CPU devices (['cpu', 'cpu']) to split batches on the CPU.",
                          stacklevel=3)
        return []
    if not devices:
        raise _empty_device_ids()
    for i, device in enumerate(devices):
        check_available(device, f"device_ids[{i}]")
    return devices


def _resolve_output_device(output_device: DeviceLike | None, devices: list[torch.device]) -> int | torch.device:
    if output_device is None:
        return device_id(devices[0])
    if isinstance(output_device, int) and not isinstance(output_device, bool) and output_device == -1:
        return -1  # torch's spelling of the CPU, kept as given
    device = as_device(output_device, what="output_device")
    check_available(device, "output_device")
    return device_id(device)


def _check_balance(devices: Sequence[torch.device]) -> None:
    """torch's warning when one GPU has under 75% of another's memory or cores."""
    ids = [d.index for d in devices if d.type == "cuda"]
    if len(set(ids)) < 2:
        return
    props = [torch.cuda.get_device_properties(i) for i in ids]
    for prop in ("total_memory", "multi_processor_count"):
        values = [getattr(p, prop) for p in props]
        min_pos, min_val = min(enumerate(values), key=operator.itemgetter(1))
        max_pos, max_val = max(enumerate(values), key=operator.itemgetter(1))
        if min_val / max_val < 0.75:
            warnings.warn(_IMBALANCE_WARNING.format(ids[min_pos], ids[max_pos]), stacklevel=3)
            return


def _check_placement(module: nn.Module, device: torch.device) -> None:
    """Replicas are copied from the module, so everything must start on the first device."""
    named = chain(
        (("parameter", n, t) for n, t in module.named_parameters()),
        (("buffer", n, t) for n, t in module.named_buffers()),
    )
    for kind, name, t in named:
        if t.device != device:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {device} (device_ids[0]) "
                f"but found {kind} '{name}' on device {t.device}. HINT: "
                + (f"call module.to('{device}') first, or put {t.device} first in device_ids."
                   if t.device.type != "meta" else f"materialize it first, e.g. module.to_empty(device='{device}'), "
                   "and then load its weights.")
            )


def _at_least_one_call(inputs: tuple[Any, ...], kwargs: tuple[dict[str, Any], ...]) -> tuple[Any, Any]:
    # a forward without inputs still runs once, on the first device
    if not inputs and not kwargs:
        return ((),), ({},)
    return inputs, kwargs


class DataParallel(nn.DataParallel[M]):
    """Split each batch over devices, run one replica per chunk in parallel, join the outputs.

    Gradients of all replicas accumulate into ``module``'s parameters; the replica on ``device_ids[0]``
    shares the module's tensors, so its in-place buffer updates (BatchNorm running stats) are kept.

    Args:
        module: the network; its parameters and buffers must be on ``device_ids[0]``.
        device_ids: ints (CUDA indices), strings or torch.devices, repeats allowed; default every GPU,
            or, without CUDA, none (the module is then called directly, as in torch).
        output_device: where outputs are gathered (default ``device_ids[0]``; -1 means the CPU).
        dim: the batch dimension of inputs and outputs.

    It subclasses ``torch.nn.DataParallel`` only to be recognised as one, by users' code that unwraps
    ``.module`` and by torch's own checks; it overrides every method, and torch's ``__init__`` (which
    refuses CPU devices) never runs.

    Example:
        >>> model = DataParallel(nn.Linear(5, 2), device_ids=["cpu", "cpu", "cpu"])
        >>> model(torch.randn(30, 5)).shape  # three replicas of 10 rows each
        torch.Size([30, 2])
    """

    def __init__(
        self,
        module: M,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
    ) -> None:
        nn.Module.__init__(self)
        check_dim_type(dim)
        self.module = module
        self.dim = dim
        devices = _resolve_device_ids(device_ids)
        self.device_ids: list[int | torch.device] = [device_id(d) for d in devices]
        if not devices:
            self.output_device: int | torch.device | None = None
            self.src_device_obj: torch.device | None = None
            return
        if not isinstance(module, nn.Module):  # torch's .to() of it: "'function' object has no attribute 'to'"
            raise not_a_module_error(module, "DataParallel")
        self.output_device = _resolve_output_device(output_device, devices)
        self.src_device_obj = devices[0]
        _check_balance(devices)
        if len(devices) == 1:
            self.module.to(self.src_device_obj)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("DataParallel.forward"):
            if not self.device_ids:
                return self.module(*inputs, **kwargs)
            _check_placement(self.module, self.src_device_obj)
            # device_ids were checked in __init__: the four steps trust them instead of checking again
            inputs, module_kwargs = self.scatter(inputs, kwargs, self.device_ids)
            inputs, module_kwargs = _at_least_one_call(inputs, module_kwargs)
            if len(self.device_ids) == 1:
                return self.module(*inputs[0], **module_kwargs[0])
            replicas = self.replicate(self.module, self.device_ids[: len(inputs)])
            outputs = self.parallel_apply(replicas, inputs, module_kwargs)
            return self.gather(outputs, self.output_device)

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceLike]
    ) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
        return scatter_kwargs_to(inputs, kwargs, as_devices(device_ids, what="device_ids"), self.dim)

    def replicate(self, module: M, device_ids: Sequence[DeviceLike]) -> list[M]:
        # without grad there is no backward to route, so the replicas need no autograd link
        return replicate_to(module, as_devices(device_ids, what="device_ids"), not torch.is_grad_enabled())

    def parallel_apply(self, replicas: Sequence[M], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        devices = as_devices(self.device_ids[: len(replicas)], what="device_ids")
        return parallel_apply_on(replicas, inputs, kwargs, devices)

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        return gather_to(outputs, gather_target(output_device), self.dim)


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
) -> Any:
    """Evaluate ``module(*inputs, **module_kwargs)`` in parallel over ``device_ids``: DataParallel as a function.

    ``inputs`` that is not a tuple is one positional argument (None means none). Unlike torch, which
    raises without CUDA, no device_ids and no CUDA calls the module directly, as DataParallel does;
    GPUs named without CUDA raise torch's RuntimeError.
    """
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if device_ids is not None and len(device_ids) == 0:
        raise _empty_device_ids()
    devices = _resolve_device_ids(device_ids, named_gpus_needed=True)
    if not devices:
        return module(*inputs, **(module_kwargs or {}))
    output = _resolve_output_device(output_device, devices)
    _check_placement(module, devices[0])
    scattered, scattered_kwargs = scatter_kwargs_to(inputs, module_kwargs, devices, dim)
    scattered, scattered_kwargs = _at_least_one_call(scattered, scattered_kwargs)
    if len(devices) == 1:
        return module(*scattered[0], **scattered_kwargs[0])
    used = devices[: len(scattered)]
    replicas = replicate_to(module, used, not torch.is_grad_enabled())
    outputs = parallel_apply_on(replicas, scattered, scattered_kwargs, used)
    return gather_to(outputs, gather_target(output), dim)
