"""Where a DDP step's time goes: per-phase times for every variant, and cProfile of the DDPs.

Not part of the default run (``--tables profile``). The phases are the Stepper's: zero the grads,
forward (DDP's pre-forward work included), backward (grad hooks, bucket copies and the wait for the
last all-reduce included; the floor's flat all-reduce too) and the optimizer step. The cProfile
listing is rank 0's, by own time, so Python overhead in a DDP's hooks stands out.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist

from ddpkit.bench.ddp_step import VARIANTS, Stepper, make_stepper
from ddpkit.bench.report import Table, median
from ddpkit.bench.sync import barrier, max_over_ranks, synchronize

__all__ = ["PHASES", "time_phases", "cprofile_text", "run_profile", "profile_table"]

PHASES = ("zero", "forward", "backward", "optimizer")


def time_phases(step: Stepper, steps: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds of each phase, step by step (ranks aligned by a barrier before each step)."""
    out: dict[str, list[float]] = {p: [] for p in PHASES}

    def mark() -> float:
        synchronize(device)
        return time.perf_counter()

    for _ in range(steps):
        barrier(device)
        t0 = mark()
        step.zero()
        t1 = mark()
        loss = step.forward()
        t2 = mark()
        step.backward(loss)
        t3 = mark()
        step.opt.step()
        t4 = mark()
        for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            out[name].append(seconds)
    return out


def cprofile_text(step: Stepper, steps: int, top: int = 18) -> str:
    """Run ``steps`` steps under cProfile; the ``top`` functions by own time, as text."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    lines = buffer.getvalue().splitlines()
    # drop pstats' preamble up to the column header
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(line for line in lines[start - 2 if start >= 2 else 0:] if line.strip())


def run_profile(model_names: list[str], quick: bool, steps: int, device: torch.device) -> dict:
    """Phase medians for every variant, and rank 0's cProfile of ddpkit's and torch's DDP."""
    rows, listings = [], {}
    for model in model_names:
        steppers = {v: make_stepper(v, model, quick, device) for v in VARIANTS}
        for variant, step in steppers.items():
            for _ in range(2):
                step()
            phases = time_phases(step, steps, device)
            medians = max_over_ranks([median(phases[p]) for p in PHASES], device)
            rows.append({"model": model, "variant": variant,
                         **{p: float(m) for p, m in zip(PHASES, medians)}})
        for variant in ("ddpkit", "torch"):
            barrier(device)
            if dist.get_rank() == 0:
                listings[f"{model}/{variant}"] = cprofile_text(steppers[variant], steps)
            else:
                for _ in range(steps):
                    steppers[variant]()
    return {"phases": rows, "cprofile": listings}


def profile_table(result: dict, world_size: int) -> str:
    table = Table(f"5. Profile: step phases ({world_size} ranks; median per step, max over ranks)",
                  ["model", "variant", *(f"{p} (ms)" for p in PHASES), "sum (ms)"])
    for r in result["phases"]:
        table.add(r["model"], r["variant"], *(f"{r[p] * 1e3:.2f}" for p in PHASES),
                  f"{sum(r[p] for p in PHASES) * 1e3:.2f}")
    parts = [table.render()]
    for name, text in result["cprofile"].items():
        parts.append(f"--- cProfile, rank 0, {name} (by own time) ---\n{text}")
    return "\n\n".join(parts)
