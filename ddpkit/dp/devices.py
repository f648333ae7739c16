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

_SUPPORTED = ("cpu", "cuda")


def as_device(device: DeviceLike, *, what: str = "device") -> torch.device:
    """Turn an int (CUDA index, as in torch), a string or a torch.device into a canonical torch.device.

    CPU devices lose their index (``cpu:0`` and ``cpu`` are the same memory), and a bare ``"cuda"``
    means the current CUDA device, as in torch.

    Raises:
        TypeError: for anything that is not an int, str or torch.device.
        ValueError: for a negative index, an unparsable string or an unsupported device type.
    """
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(
            f"{what} must be an int (CUDA index), a str or a torch.device, but found "
            f"{type(device).__name__} {device!r}. HINT: use e.g. 0, 'cuda:1' or 'cpu'."
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(
                f"{what} must be a non-negative CUDA index, but found {device}. "
                "HINT: name the CPU as 'cpu'."
            )
        return torch.device("cuda", device)
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{what} {device!r} is not a device name. HINT: use e.g. 'cuda:1' or 'cpu'.") from e
    if dev.type not in _SUPPORTED:
        raise ValueError(
            f"{what} must be a CPU or CUDA device, but found {dev}. "
            "HINT: name a 'cpu' or 'cuda:N' device."
        )
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.index is None:
        # torch reads a bare "cuda" as the current device
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
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
