"""Gradient memory with and without ``gradient_as_bucket_view``.

On CPU, Python-level tracers do not see tensor storage, so two figures are reported:

* *accounted*: the bytes of the distinct storages behind every ``.grad`` and every bucket buffer
  (torch's buckets are seen through a recording comm hook, ddpkit's read directly: a hook would give
  it torch's layout). With ``gradient_as_bucket_view=True`` the grads alias the buckets, so this
  drops from ~2x to ~1x the gradient bytes (ddpkit's gradients reduced in place have no bucket).
* *peak*: the process's RSS peak over building the model, wrapping it and a few steps, minus its RSS
  before, in fresh processes per figure (``ddpkit.bench.fresh``), freed heap trimmed first. On
  Linux it is the kernel's own high-water mark, ``VmHWM``, reset at the start
  (``/proc/self/clear_refs``): exact, where a sampler can miss a short peak. torch keeps no
  allocator statistics for CPU tensors, so RSS it is; where ``VmHWM`` cannot be reset, RSS is
  sampled every millisecond. On CUDA, the allocator's peak.
"""
from __future__ import annotations

import ctypes
import gc
import re
import statistics
import threading
from typing import Callable

import psutil
import torch

from ddpkit.bench.ddp_step import make_stepper
from ddpkit.bench.fresh import in_fresh_processes
from ddpkit.bench.report import Table, fmt_bytes, ranks
from ddpkit.bench.sync import max_over_ranks
from ddpkit.bench.tensor_peak import tensor_peak

__all__ = ["run_memory", "memory_table", "peak_ratios", "PeakSampler"]


class PeakSampler:
    """Track this process's peak RSS (or CUDA allocated bytes) above the level at ``start``."""

    def __init__(self, device: torch.device, interval: float = 0.001):
        self.device = device
        self.interval = interval
        self.kind = "cuda_allocated" if device.type == "cuda" else "rss_hwm" if _reset_hwm() else "rss"
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
        if self.kind == "rss_hwm":
            _reset_hwm()
        elif self.device.type != "cuda":
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.kind == "rss_hwm":
            self.peak = _hwm()
        self.peak = max(self.peak, self._now())

    def retained(self) -> int:
        """What is held now above the start level (after a collection and a heap trim)."""
        gc.collect()
        _trim_heap()
        return self._now() - self.base

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _reset_hwm() -> bool:
    """Reset the kernel's RSS high-water mark (Linux 4.0+); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _hwm() > 0
    except OSError:
        return False


def _hwm() -> int:
    """The process's RSS high-water mark (``VmHWM``) in bytes, 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def _trim_heap() -> None:
    """Give freed heap back to the OS (glibc), so one variant's leftovers do not hide the next's."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _ddpkit_buckets(ddp) -> dict[int, int]:
    """The storages of ddpkit's bucket buffers (a gradient reduced in place has none of its own; in a
    world of one there is no reducer and no bucket)."""
    if ddp.reducer is None:
        return {}
    flats = [b.flat for b in ddp.reducer.buckets if not b.sparse and b.flat.numel()]
    return {f.untyped_storage().data_ptr(): f.untyped_storage().nbytes() for f in flats}


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
    if device.type == "cuda":
        torch.cuda.set_device(device)
    max_over_ranks([0.0], device)  # Gloo's first collective allocates its own buffers: not ours
    warm = make_stepper("local", model, quick, device)  # pages in the model's kernels, for both DDPs alike
    warm()
    del warm
    buckets: dict[int, int] = {}
    with PeakSampler(device) as sampler:
        # grads zeroed in place: with set_to_none each backward allocates fresh grads before DDP
        # copies them into the buckets, and the view's saving would not show in the peak
        step = make_stepper(kind, model, quick, device, set_to_none=False,
                            gradient_as_bucket_view=view)
        if kind == "torch":  # its buckets are out of Python's sight; a hook does not change them
            step.module.register_comm_hook(None, _recording_hook(kind, buckets))
        for _ in range(steps - 1):
            step()
        buckets.clear()  # both DDPs may rebuild buckets after the first step: keep the last ones
        step()
        if kind == "ddpkit":  # read directly: a hook would give it torch's layout, without in-place buckets
            buckets.update(_ddpkit_buckets(step.module))
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
            "peak_kind": sampler.kind}


def run_memory(model_names: list[str], quick: bool, device: torch.device, steps: int = 3,
               repeats: int = 3) -> list[dict]:
    """Every figure in fresh processes (see ``ddpkit.bench.fresh``): the same start for each.

    On CPU each figure is the median of ``repeats`` fresh runs, taken in rounds over all figures:
    one run's peak moves by a few MiB with where the heap happened to place things (measured on
    ``small``: ddpkit/torch from 0.97 to 1.16 between two runs of the same code)."""
    figures = [(model, kind, view) for model in model_names for kind in ("ddpkit", "torch")
               for view in (False, True)]
    runs = 1 if device.type == "cuda" else max(1, repeats)
    measured = [[in_fresh_processes(_measure, kind, model, quick, device, view, steps)
                 for model, kind, view in figures] for _ in range(runs)]
    # the tensors' own peak (CPU only: on CUDA the peak above is the allocator's already); a quick
    # run takes it for its first model only, each figure being a fresh process pair of its own
    profiled = {model_names[0]} if quick else set(model_names)
    tensors = [None if device.type == "cuda" or model not in profiled else
               in_fresh_processes(tensor_peak, kind, model, quick, device, view, steps)
               for model, kind, view in figures]
    rows = []
    for i in range(len(figures)):
        row = dict(measured[0][i])
        for key in ("peak_bytes", "retained_bytes"):
            row[key] = int(statistics.median(run[i][key] for run in measured))
        row["peak_runs"] = [run[i]["peak_bytes"] for run in measured]
        row["tensor_peak_bytes"] = tensors[i]
        rows.append(row)
    return rows


def memory_table(rows: list[dict], world_size: int) -> Table:
    peak_name = {"cuda_allocated": "CUDA peak", "rss_hwm": "RSS high-water"}.get(rows[0]["peak_kind"] if rows else "",
                                                                                "RSS peak")
    table = Table(f"4. Gradient memory, gradient_as_bucket_view off/on ({ranks(world_size)}; max over "
                  "ranks)",
                  ["model", "impl", "grad view", "params", "grads", "buckets", "accounted",
                   f"{peak_name} delta", "retained", "tensor peak"])
    for r in rows:
        tensors = r.get("tensor_peak_bytes")
        table.add(r["model"], r["impl"], "on" if r["gradient_as_bucket_view"] else "off",
                  fmt_bytes(r["param_bytes"]), fmt_bytes(r["grad_bytes"]),
                  fmt_bytes(r["bucket_bytes"]), fmt_bytes(r["accounted_bytes"]),
                  fmt_bytes(r["peak_bytes"]), fmt_bytes(r["retained_bytes"]),
                  "-" if tensors is None else fmt_bytes(tensors))
    runs = len(rows[0].get("peak_runs", [0])) if rows else 1
    if runs > 1:
        table.notes.append(f"peak and retained: the median of {runs} runs, each in fresh processes.")
    table.notes.append("accounted: distinct storages behind .grad and bucket buffers (shared storage "
                       "counted once); peak delta: above the level before the model was built (the first "
                       "backward allocates fresh grads either way); retained: held after the steps; "
                       "tensor peak: the most bytes held in tensors at once, from torch's allocator events "
                       "(the profiler, a run of its own; CPU only; --quick: the first model only), free of "
                       "heap placement.")
    table.notes.append("steps use zero_grad(set_to_none=False); with set_to_none=True autograd "
                       "allocates fresh grads every backward and the peak does not drop with the view.")
    ratios = peak_ratios(rows)
    if ratios:
        table.notes.append("ddpkit/torch peak: " + ", ".join(
            f"{model} {'view' if view else 'no view'} {ratio:.2f}" for (model, view), ratio in ratios.items()))
    tensor_ratios = peak_ratios(rows, "tensor_peak_bytes")
    if tensor_ratios:
        table.notes.append("ddpkit/torch tensor peak: " + ", ".join(
            f"{model} {'view' if view else 'no view'} {ratio:.2f}" for (model, view), ratio in tensor_ratios.items()))
    return table


def peak_ratios(rows: list[dict], key: str = "peak_bytes") -> dict[tuple[str, bool], float]:
    """ddpkit's peak (``key``) over torch's, per (model, gradient_as_bucket_view); none where unmeasured."""
    by = {(r["model"], r["impl"], r["gradient_as_bucket_view"]): r[key] for r in rows if r.get(key) is not None}
    return {(model, view): by[(model, "ddpkit", view)] / max(1, by[(model, "torch", view)])
            for model, impl, view in by if impl == "ddpkit" and (model, "torch", view) in by}
