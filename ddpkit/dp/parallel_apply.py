"""parallel_apply: run each replica on its own input in its own thread, as torch does.

Grad mode, inference mode and autocast are thread-local, so the caller's state is carried into every
thread (torch carries grad mode and autocast only: a BatchNorm in training mode under
``torch.inference_mode()`` then fails in its replica threads). Replicas that share a device share its
random generator and draw from it in whatever order their threads run; under
``torch.use_deterministic_algorithms(True)`` they run one after another, in replica order, so that
dropout gives the same masks from the same seed (replicas on distinct GPUs each have their own
generator, and run at once). An exception raised in a replica comes back to the caller with its
original type, a message naming the replica and its device, the replica's traceback text, and the
original exception chained as the cause.
"""
from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.dp.devices import DeviceLike, as_device, check_available
from ddpkit.dp.nested import tensors
from ddpkit.errors import ReplicaCountError, explain

__all__ = ["parallel_apply"]

_AUTOCAST_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class _Failure:
    """What a replica raised, kept until the caller can re-raise it."""

    error: BaseException
    traceback_text: str


@dataclass(frozen=True)
class _ThreadState:
    """The caller's thread-local torch state that every replica thread must reproduce."""

    grad_enabled: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype, bool], ...]  # (device_type, dtype, cache_enabled) when enabled
    threads: int  # intra-op threads: a new thread's first CPU op uses the default count, not the caller's

    @classmethod
    def capture(cls) -> _ThreadState:
        autocast = tuple(
            (kind, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in _AUTOCAST_TYPES
            if torch.is_autocast_enabled(kind)
        )
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, torch.get_num_threads())

    def enter(self, stack: contextlib.ExitStack) -> None:
        # after torch.set_num_threads(k) in the caller, a replica's matmul split over another number of
        # threads sums in another order: no longer bit for bit the module on its chunk
        torch.set_num_threads(self.threads)
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for kind, dtype, cache in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))


class _KeyErrorMessage(str):
    """KeyError's str() is the repr of its argument; this keeps a multi-line message readable."""

    def __repr__(self) -> str:
        return self


def _resolve_device(index: int, device: DeviceLike | None, inputs: Any, kwargs: dict[str, Any]) -> torch.device | None:
    """The replica's device: the one given, else that of its first tensor input (as torch)."""
    if device is not None:
        resolved = as_device(device, what=f"devices[{index}]")
        check_available(resolved, f"devices[{index}]")
        return resolved
    found = next(tensors((inputs, kwargs)), None)
    return None if found is None else found.device


def _caller_stream(device: torch.device | None) -> torch.cuda.Stream | None:
    # current streams are thread-local: read the caller's here, so replica work is ordered with its work
    return torch.cuda.current_stream(device.index) if device is not None and device.type == "cuda" else None


def _device_context(device: torch.device | None, stream: torch.cuda.Stream | None, stack: contextlib.ExitStack) -> None:
    if stream is not None:
        stack.enter_context(torch.cuda.device(device.index))
        stack.enter_context(torch.cuda.stream(stream))


def _run_replica(
    index: int,
    module: nn.Module,
    inputs: Any,
    kwargs: dict[str, Any],
    device: torch.device | None,
    stream: torch.cuda.Stream | None,
    state: _ThreadState,
    results: list[Any],
) -> None:
    try:
        with contextlib.ExitStack() as stack:
            state.enter(stack)
            _device_context(device, stream, stack)
            # a lone tensor is one argument, not a sequence of them
            args = inputs if isinstance(inputs, (list, tuple)) else (inputs,)
            results[index] = module(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller by _reraise
        results[index] = _Failure(e, traceback.format_exc())


def _reraise(index: int, device: torch.device | None, failure: _Failure) -> None:
    error = failure.error
    where = "an unknown device" if device is None else f"device {device}"
    message = (
        f"replica {index} on {where} raised {type(error).__name__}: {error}\n\n"
        f"Original traceback in replica {index}:\n{failure.traceback_text}"
    )
    if isinstance(error, KeyError):
        message = _KeyErrorMessage(message)
    try:
        rebuilt = type(error)(message)
    except Exception:  # noqa: BLE001 - the type needs other constructor arguments
        rebuilt = None
    if rebuilt is None or str(rebuilt) != message:
        # keep the original object (and type); the note shows where it came from
        error.add_note(f"(raised in replica {index} on {where})")
        raise error
    raise rebuilt from error


def _share_a_generator(devices: Sequence[torch.device | None]) -> bool:
    """Whether two replicas draw from one random generator: the CPU's (also that of a replica whose
    device is unknown) or one GPU's."""
    generators = [(d.type, d.index or 0) if d is not None and d.type != "cpu" else ("cpu", 0) for d in devices]
    return len(set(generators)) < len(generators)


def _check_length(name: str, found: int, expected: int) -> None:
    if found != expected:  # torch's words first: its AssertionError says the same
        raise ReplicaCountError(explain(
            f"The number of modules {expected} is not equal to the number of {name} {found}: {name} must "
            f"have one entry per module.",
            "pass the outputs of scatter_kwargs for the same devices as the replicas."),
            argument=name, expected=expected, found=found)


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
) -> list[Any]:
    """Call ``modules[i](*inputs[i], **kwargs_tup[i])`` for every i, one thread per module.

    ``inputs[i]`` is either the argument tuple/list or a single argument. ``devices[i]`` (default: the
    device of the first tensor in the replica's input) becomes the current CUDA device in its thread.

    Returns:
        The outputs, in the order of ``modules``.

    Raises:
        The first failing replica's exception, re-raised with its type and naming its index and device.
    """
    _check_length("inputs", len(inputs), len(modules))
    if kwargs_tup is None:
        kwargs_tup = [{} for _ in modules]
    _check_length("kwargs_tup", len(kwargs_tup), len(modules))
    if devices is None:
        devices = [None] * len(modules)
    _check_length("devices", len(devices), len(modules))
    resolved = [_resolve_device(i, d, x, k) for i, (d, x, k) in enumerate(zip(devices, inputs, kwargs_tup))]
    return parallel_apply_on(modules, inputs, kwargs_tup, resolved)


def parallel_apply_on(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]],
    devices: Sequence[torch.device | None],
) -> list[Any]:
    """parallel_apply with one entry per module everywhere and devices already parsed and checked
    (DataParallel checks them once, at construction); None: no current device to set."""
    state = _ThreadState.capture()
    results: list[Any] = [None] * len(modules)
    jobs = [
        (i, module, x, kwargs, device, _caller_stream(device), state, results)
        for i, (module, x, kwargs, device) in enumerate(zip(modules, inputs, kwargs_tup, devices))
    ]
    if len(jobs) == 1:
        _run_replica(*jobs[0])
    elif torch.are_deterministic_algorithms_enabled() and _share_a_generator(devices):
        for job in jobs:  # each still in a thread of its own, with the same thread-local state
            thread = threading.Thread(target=_run_replica, args=job)
            thread.start()
            thread.join()
    else:
        threads = [threading.Thread(target=_run_replica, args=job) for job in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for i, (result, device) in enumerate(zip(results, devices)):
        if isinstance(result, _Failure):
            _reraise(i, device, result)
    return results
