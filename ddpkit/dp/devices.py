"""Device normalisation: the one parser of what names a device, for DataParallel, DDP and parallelize.

Vocabulary: a ``device`` is a ``torch.device``; a ``device_id`` is what torch's DataParallel stores in
``device_ids`` (an int for a CUDA device). ddpkit also accepts CPU devices, stored as ``torch.device("cpu")``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

__all__ = ["DeviceLike", "as_device", "as_devices", "check_available", "device_id"]

DeviceLike = Union[int, str, torch.device]

def as_device(device: DeviceLike, *, what: str = "device", accelerator: str = "cuda") -> torch.device:
    """Turn an int (an ``accelerator`` index: CUDA, as in torch), a string or a torch.device into a
    canonical torch.device.

    CPU devices lose their index (``cpu:0`` and ``cpu`` are the same memory), and a bare ``"cuda"``
    means the current CUDA device, as in torch. DDP passes the module's device type as
    ``accelerator``, since torch's DDP reads an int in ``device_ids`` as an index of that type.

    Raises:
        TypeError: for anything that is not an int, str or torch.device.
        ValueError: for a negative index, an unparsable string or an unsupported device type.
    """
    kind = "CUDA" if accelerator == "cuda" else accelerator
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(
            f"{what} must be an int ({kind} index), a str or a torch.device, but found "
            f"{type(device).__name__} {device!r}. HINT: use e.g. 0, '{accelerator}:1' or 'cpu'."
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(
                f"{what} must be a non-negative {kind} index, but found {device}. "
                "HINT: name the CPU as 'cpu'."
            )
        return torch.device(accelerator, device)
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{what} {device!r} is not a device name. HINT: use e.g. '{accelerator}:1' or 'cpu'.") from e
    if dev.type not in ("cpu", accelerator):
        raise ValueError(
            f"{what} must be a CPU or {kind} device, but found {dev}. "
            f"HINT: name a 'cpu' or '{accelerator}:N' device."
        )
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.index is None:
        # torch reads a bare "cuda" as the current device
        module = getattr(torch, accelerator, None)
        available = module is not None and module.is_available()
        return torch.device(accelerator, module.current_device() if available else 0)
    return dev


def as_devices(devices: Sequence[DeviceLike], *, what: str = "devices") -> list[torch.device]:
    """as_device over a sequence; the same device may appear several times."""
    if isinstance(devices, (str, torch.device, int)):
        raise TypeError(
            f"{what} must be a sequence of devices, but found a single {type(devices).__name__} "
            f"{devices!r}. HINT: wrap it in a list, e.g. [{devices!r}]."
        )
    return [as_device(d, what=f"{what}[{i}]") for i, d in enumerate(devices)]


def check_available(device: torch.device, what: str) -> None:
    """Raise unless ``device`` exists here: CUDA usable, and the index below the device count."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"{what} is {device}, but CUDA is not available on this machine. "
            "HINT: use 'cpu' (possibly several times) instead."
        )
    count = torch.cuda.device_count()
    if device.index >= count:
        raise ValueError(
            f"{what} is {device}, but this machine has {count} CUDA device(s): expected an index in "
            f"[0, {count}). HINT: check CUDA_VISIBLE_DEVICES."
        )


def device_id(device: torch.device) -> int | torch.device:
    """The form torch's DataParallel stores: the index for CUDA, the device itself otherwise."""
    return device.index if device.type == "cuda" else device
