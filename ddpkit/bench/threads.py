"""Where a DDP step's CPU goes: per thread, context switches, copy kernels and the final wait.

Part of ``--tables profile``. For each variant (``ddpkit_buckets`` is ddpkit with every gradient
copied into a bucket, the layout before Note [Big gradients in place]), per step and per rank:

* CPU time of the main thread (forward, backward, the DDP's Python) and of all other threads
  (Gloo's workers, which run the collectives), from ``/proc/self/task/*/schedstat`` (nanoseconds);
* voluntary and involuntary context switches over all threads (``/proc/self/task/*/status``): on a
  machine without a spare core, a collective launched during backward shows as involuntary ones;
* with ``torch.profiler``, the CPU time in the kernels that copy gradients in and out of buckets
  (``aten::mul``, ``aten::copy_``, ``aten::_foreach_copy_``, ``aten::mul_``) and in ddpkit's wait at
  the end of backward (``ddpkit.finalize_backward.wait``).
"""
from __future__ import annotations

import os
import re

import torch
from torch.profiler import ProfilerActivity

from ddpkit.bench.ddp_step import make_stepper
from ddpkit.bench.report import Table
from ddpkit.bench.sync import barrier, max_over_ranks
from ddpkit.bench.tensor_peak import quiet_profile

__all__ = ["THREAD_VARIANTS", "COPY_KERNELS", "thread_counters", "run_threads", "threads_table"]

THREAD_VARIANTS = ("ddpkit", "ddpkit_buckets", "torch", "floor")
COPY_KERNELS = ("aten::mul", "aten::mul_", "aten::copy_", "aten::_foreach_copy_")
_FIELDS = ("main_cpu", "other_cpu", "voluntary", "involuntary", "copies", "wait")


def thread_counters() -> dict[str, float]:
    """This process's main-thread and other-thread CPU seconds, and its context switches so far."""
    out = {"main_cpu": 0.0, "other_cpu": 0.0, "voluntary": 0.0, "involuntary": 0.0}
    pid = os.getpid()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        out["main_cpu" if int(tid) == pid else "other_cpu"] += cpu
        for key, name in (("voluntary", "voluntary_ctxt_switches"), ("involuntary", "nonvoluntary_ctxt_switches")):
            match = re.search(rf"^{name}:\s+(\d+)", status, re.MULTILINE)
            out[key] += int(match.group(1)) if match else 0
    return out


def _counted(step, steps: int, device: torch.device) -> dict[str, float]:
    barrier(device)
    before = thread_counters()
    for _ in range(steps):
        step()
    after = thread_counters()
    return {k: (after[k] - before[k]) / steps for k in before}


def _profiled(step, steps: int) -> dict[str, float]:
    """Seconds per step in the copy kernels and in ddpkit's final wait (self CPU time)."""
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    totals = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    wait = next((e.cpu_time_total for e in prof.key_averages() if e.key == "ddpkit.finalize_backward.wait"), 0.0)
    return {"copies": sum(totals.get(k, 0.0) for k in COPY_KERNELS) / 1e6 / steps, "wait": wait / 1e6 / steps}


def run_threads(model_names: list[str], quick: bool, steps: int, device: torch.device,
                rounds: int = 4) -> list[dict]:
    """One row per (model, variant): medians over ``rounds`` of per-step counters, max over ranks."""
    rows = []
    for model in model_names:
        steppers = {v: make_stepper(v, model, quick, device) for v in THREAD_VARIANTS}
        for step in steppers.values():
            for _ in range(2):
                step()
        samples: dict[str, list[dict[str, float]]] = {v: [] for v in THREAD_VARIANTS}
        for r in range(rounds):  # alternating order, as the step table
            for v in THREAD_VARIANTS if r % 2 == 0 else THREAD_VARIANTS[::-1]:
                samples[v].append(_counted(steppers[v], steps, device))
        for v in THREAD_VARIANTS:
            barrier(device)
            extra = _profiled(steppers[v], max(2, steps // 2))
            figures = {k: sorted(s[k] for s in samples[v])[len(samples[v]) // 2] for k in samples[v][0]}
            figures.update(extra)
            worst = max_over_ranks([figures[k] for k in _FIELDS], device).tolist()
            rows.append({"model": model, "variant": v, **dict(zip(_FIELDS, worst))})
        del steppers
    return rows


def threads_table(rows: list[dict], world_size: int) -> Table:
    table = Table(f"5b. Where the CPU goes ({world_size} ranks; per step, median of rounds, max over ranks)",
                  ["model", "variant", "main thread (ms)", "other threads (ms)", "voluntary cs",
                   "involuntary cs", "copy kernels (ms)", "ddpkit wait (ms)"])
    for r in rows:
        table.add(r["model"], r["variant"], f"{r['main_cpu'] * 1e3:.2f}", f"{r['other_cpu'] * 1e3:.2f}",
                  f"{r['voluntary']:.1f}", f"{r['involuntary']:.1f}", f"{r['copies'] * 1e3:.2f}",
                  f"{r['wait'] * 1e3:.2f}")
    table.notes.append("ddpkit_buckets: ddpkit with every gradient copied into a bucket (in_place_bytes=0). "
                       "Other threads: Gloo's workers. Copy kernels: self CPU time of "
                       + ", ".join(COPY_KERNELS) + " under torch.profiler (the floor's own division included).")
    return table
