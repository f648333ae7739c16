"""Gradient memory with and without ``gradient_as_bucket_view``.

On CPU, Python-level tracers do not see tensor storage, so two figures are reported:

* *accounted*: the bytes of the distinct storages behind every ``.grad`` and every bucket buffer
  (buckets are seen through a recording comm hook). With ``gradient_as_bucket_view=True`` the grads
  alias the buckets, so this drops from ~2x to ~1x the gradient bytes.
* *peak*: the process's RSS peak over building the model, wrapping it and a few steps, minus its RSS
  before (sampled every millisecond; freed heap is trimmed first). On CUDA, the allocator's peak.
"""
from __future__ import annotations

import ctypes
import gc
import threading
from typing import Callable

import psutil
import torch

from ddpkit.bench.ddp_step import make_stepper
from ddpkit.bench.report import Table, fmt_bytes
from ddpkit.bench.sync import max_over_ranks

__all__ = ["run_memory", "memory_table", "PeakSampler"]


class PeakSampler:
    """Track this process's peak RSS (or CUDA allocated bytes) above the level at ``start``."""

    def __init__(self, device: torch.device, interval: float = 0.001):
        self.device = device
        self.interval = interval
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.base = 0
        self.peak = 0

    def _now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._now())

    def __enter__(self) -> PeakSampler:
        gc.collect()
        _trim_heap()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.base = self.peak = self._now()
        if self.device.type != "cuda":
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        self.peak = max(self.peak, self._now())

    def retained(self) -> int:
        """What is held now above the start level (after a collection and a heap trim)."""
        gc.collect()
        _trim_heap()
        return self._now() - self.base

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _trim_heap() -> None:
    """Give freed heap back to the OS (glibc), so one variant's leftovers do not hide the next's."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _recording_hook(kind: str, storages: dict[int, int]) -> Callable:
    """An all-reduce comm hook that also notes each bucket buffer's storage."""
    if kind == "ddpkit":
        from ddpkit.ddp.hooks import allreduce_hook
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        storage = bucket.buffer().untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return allreduce_hook(state, bucket)

    return hook


def _measure(kind: str, model: str, quick: bool, device: torch.device, view: bool,
             steps: int) -> dict:
    buckets: dict[int, int] = {}
    with PeakSampler(device) as sampler:
        # grads zeroed in place: with set_to_none each backward allocates fresh grads before DDP
        # copies them into the buckets, and the view's saving would not show in the peak
        step = make_stepper(kind, model, quick, device, set_to_none=False,
                            gradient_as_bucket_view=view)
        assert step is not None
        step.module.register_comm_hook(None, _recording_hook(kind, buckets))
        for _ in range(steps - 1):
            step()
        buckets.clear()  # both DDPs may rebuild buckets after the first step: keep the last ones
        step()
        params = list(step.module.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grads: dict[int, int] = {}
        for p in params:
            if p.grad is not None:
                storage = p.grad.untyped_storage()
                grads[storage.data_ptr()] = storage.nbytes()
        retained = sampler.retained()
    # the peak is per rank; report the largest
    peak, retained = max_over_ranks([sampler.delta, retained], device).tolist()
    del step, params
    return {"model": model, "impl": kind, "gradient_as_bucket_view": view,
            "param_bytes": param_bytes,
            "grad_bytes": sum(grads.values()), "bucket_bytes": sum(buckets.values()),
            "accounted_bytes": sum({**grads, **buckets}.values()),
            "peak_bytes": int(peak), "retained_bytes": int(retained),
            "peak_kind": "cuda_allocated" if device.type == "cuda" else "rss"}


def run_memory(model_names: list[str], quick: bool, device: torch.device, steps: int = 3) -> list[dict]:
    kinds = ["ddpkit", "torch"]
    # a first, discarded run pays the process's one-time allocations (gloo buffers, caches)
    _measure(kinds[-1], model_names[0], quick, device, False, steps)
    return [_measure(kind, model, quick, device, view, steps)
            for model in model_names for kind in kinds for view in (False, True)]


def memory_table(rows: list[dict], world_size: int) -> Table:
    peak_name = "CUDA peak" if rows and rows[0]["peak_kind"] == "cuda_allocated" else "RSS peak"
    table = Table(f"4. Gradient memory, gradient_as_bucket_view off/on ({world_size} ranks; max over "
                  "ranks)",
                  ["model", "impl", "grad view", "params", "grads", "buckets", "accounted",
                   f"{peak_name} delta", "retained"])
    for r in rows:
        table.add(r["model"], r["impl"], "on" if r["gradient_as_bucket_view"] else "off",
                  fmt_bytes(r["param_bytes"]), fmt_bytes(r["grad_bytes"]),
                  fmt_bytes(r["bucket_bytes"]), fmt_bytes(r["accounted_bytes"]),
                  fmt_bytes(r["peak_bytes"]), fmt_bytes(r["retained_bytes"]))
    table.notes.append("accounted: distinct storages behind .grad and bucket buffers (shared storage "
                       "counted once); peak delta: above the level before the model was built (the first "
                       "backward allocates fresh grads either way); retained: held after the steps.")
    table.notes.append("steps use zero_grad(set_to_none=False); with set_to_none=True autograd "
                       "allocates fresh grads every backward and the peak does not drop with the view.")
    return table
