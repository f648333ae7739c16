"""``ddpkit.parallelize(model)``: the one call that makes a script data-parallel wherever it runs.

    ddpkit.init()
    model = ddpkit.parallelize(model)          # same line under python, ddpkit run, torchrun, srun

* a world larger than one (launched with several processes): ``DistributedDataParallel`` on this
  process's device, ``device_ids=[local_rank]`` on CUDA;
* one process, ``devices=[...]`` given (``["cpu", "cpu"]``, ``[0, 1]``): ``DataParallel`` over them;
* one process and several visible GPUs: ``DataParallel`` over all of them;
* one process and one GPU: the model on ``cuda:0``; no GPU: the model itself.

A single process that ``ddpkit.init(backend="gloo")`` placed on the CPU stays on the CPU.

Options are DistributedDataParallel's and DataParallel's keyword arguments, plus ``devices``. An
option that the chosen wrapper does not take but the other one does is ignored, so one script runs
everywhere: ``bucket_cap_mb``, ``find_unused_parameters``, ``broadcast_buffers``, ... do nothing in a
single process, and ``devices`` and ``output_device`` do nothing under a launcher (each process has
its one device, which is also where its output stays). An
option neither takes is a TypeError, on every path, so a typo fails in the quick single-process run;
a ``devices`` that is not a list of devices (``"cpu"``, ``[]``, ``["tpu"]``) is a ValueError on every
path too.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.ddp.distributed import DistributedDataParallel
from ddpkit.dp.data_parallel import DataParallel
from ddpkit.dp.devices import as_devices, check_available
from ddpkit.runtime.process_group import current_env, get_local_rank, require_group_when_launched

__all__ = ["parallelize", "local_devices"]

# chosen by parallelize itself: device_ids follows from the rank (DDP) or from devices= (DataParallel)
_CHOSEN_HERE = ("module", "device_ids")


def _options_of(cls: type) -> frozenset[str]:
    """The keyword arguments ``cls(module, ...)`` takes, read from its signature."""
    parameters = inspect.signature(cls).parameters.values()
    return frozenset(p.name for p in parameters
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) - set(_CHOSEN_HERE)


_DDP_OPTIONS = _options_of(DistributedDataParallel)
_DP_OPTIONS = _options_of(DataParallel)
_ALL_OPTIONS = _DDP_OPTIONS | _DP_OPTIONS | {"devices"}


def parallelize(module: nn.Module, **options: Any) -> nn.Module:
    """Wrap ``module`` for data parallelism as this process's launch calls for (see the module doc).

    Call it after ``ddpkit.init()``. Create the optimizer from the returned module's parameters.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or an option no wrapper takes (the message
            lists the options valid here).
        RuntimeError: launched with several processes but ``ddpkit.init()`` was not called.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize expects a torch.nn.Module, got {type(module).__name__}.")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _distributed(module, options)
    require_group_when_launched("parallelize", "it cannot make the module DistributedDataParallel")
    return _single_process(module, options)


def local_devices(devices: Sequence[Any] | None, cuda_count: int) -> list[torch.device] | None:
    """The devices a single process spreads a batch over, or None for "the module as it is".

    ``devices`` named by the user win; else every GPU when there are several; else None.
    """
    if devices is not None:
        if isinstance(devices, (str, int, torch.device)) or len(devices) == 0:
            raise ValueError(f"devices={devices!r} must be a non-empty list, e.g. ['cpu', 'cpu'] or [0, 1].")
        return as_devices(devices, what="devices")
    if cuda_count > 1:
        return [torch.device("cuda", i) for i in range(cuda_count)]
    return None


# --------------------------------------------------------------------------------------------------


def _distributed(module: nn.Module, options: dict[str, Any]) -> nn.Module:
    _check_options(options, "DistributedDataParallel", _DDP_OPTIONS)
    if options.get("devices") is not None:  # unused here, but a typo fails in either run of the script
        local_devices(options["devices"], 0)
    env = current_env()
    if env is not None and env.device is not None:
        device = env.device
    elif dist.get_backend() == "nccl":
        device = torch.device("cuda", get_local_rank())
    else:
        device = torch.device("cpu")
    module = module.to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    # DataParallel's output_device means "gather here"; a process of a launched job keeps its output
    # on its own device (and torch refuses output_device for a CPU module)
    kwargs = {k: v for k, v in options.items() if k in _DDP_OPTIONS and k != "output_device"}
    return DistributedDataParallel(module, device_ids=device_ids, **kwargs)


def _single_process(module: nn.Module, options: dict[str, Any]) -> nn.Module:
    _check_options(options, "a single process (DataParallel)", _DP_OPTIONS | {"devices"})
    env = current_env()
    # a process that ddpkit.init() placed on the CPU (backend="gloo" on a GPU machine) stays there
    on_cpu = env is not None and env.device is not None and env.device.type == "cpu"
    cuda_count = 0 if on_cpu else torch.cuda.device_count()
    devices = local_devices(options.get("devices"), cuda_count)
    if devices is None:
        return module.to("cuda:0") if cuda_count == 1 else module
    for i, device in enumerate(devices):  # before the module goes there: torch's assertion is cryptic
        check_available(device, f"devices[{i}]")
    kwargs = {k: v for k, v in options.items() if k in _DP_OPTIONS}
    # DataParallel keeps the master copy on the first device and broadcasts it from there
    return DataParallel(module.to(devices[0]), device_ids=devices, **kwargs)


def _check_options(options: dict[str, Any], wrapper: str, valid_here: set[str]) -> None:
    """Reject options no wrapper takes; the rest are used by ``wrapper`` or ignored on this path."""
    known = _ALL_OPTIONS
    for name in options:
        if name == "device_ids":
            raise TypeError(
                "parallelize chooses device_ids itself ([local_rank] for DistributedDataParallel). "
                "HINT: to spread a single process over several devices pass devices=[...], "
                "e.g. devices=['cpu', 'cpu'] or devices=[0, 1].")
        if name not in known:
            listed, ignored = ", ".join(sorted(valid_here)), ", ".join(sorted(known - valid_here))
            raise TypeError(
                f"parallelize() got an unexpected option {name!r}. Valid for {wrapper}, which this "
                f"process runs as: {listed}. Accepted but ignored here: {ignored}.")
