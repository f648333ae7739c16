"""DDP step time: local step, ddpkit's DDP, torch's DDP and the floor, in one run, interleaved.

Every variant gets its own copy of the same model, the same per-rank batch and the same SGD step.
Repeats go in rounds over the variants, so slow drift on a noisy machine (frequency scaling,
a neighbour's job) lands on all of them alike. A repeat is ``steps`` consecutive training steps,
reported per step; the figure for a repeat is the slowest rank's. A ratio such as ddpkit/torch is
the median over rounds of the two variants' ratio within a round, where they ran seconds apart.

The *floor* is what any data-parallel step must at least cost here: a local step plus one
all-reduce of all gradients as one flat tensor (the grads are views into it, so nothing is copied).
It is the mark to hold ddpkit against; overlap of communication with backward can beat it.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpkit.bench.models import build_model, make_batch
from ddpkit.bench.report import Table, median, median_interval, quantile, ranks, summarize
from ddpkit.bench.sync import barrier, max_over_ranks, synchronize
from ddpkit.ddp.distributed import DistributedDataParallel

__all__ = ["VARIANTS", "PAIRS", "Stepper", "make_ddp", "make_stepper", "paired_ratio",
           "time_interleaved", "run_ddp_step", "ddp_step_table", "ratios"]

VARIANTS = ("local", "ddpkit", "torch", "floor")
PAIRS = (("ddpkit", "torch"), ("ddpkit", "floor"), ("torch", "floor"))
"""The ratios every table and file reports, as (numerator, denominator)."""
_LR = 0.01


class Stepper:
    """One training step of a variant, as named phases (so they can be timed one by one).

    ``module`` is what is trained (the DDP wrapper for the DDP variants); ``zero`` clears the grads
    and ``after_backward`` is the floor's explicit all-reduce.
    """

    def __init__(self, module: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, zero: Callable[[], None],
                 after_backward: Callable[[], None] | None = None):
        self.module, self.opt, self.x, self.y = module, opt, x, y
        self.zero = zero
        self.after_backward = after_backward

    def forward(self) -> torch.Tensor:
        return F.mse_loss(self.module(self.x), self.y)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.after_backward is not None:
            self.after_backward()

    def __call__(self) -> None:
        self.zero()
        self.backward(self.forward())
        self.opt.step()


class _BucketsOnlyDDP(DistributedDataParallel):
    """ddpkit's DDP with every gradient copied into a bucket, as before Note [Big gradients in place]."""

    _reducer_options = {"in_place_bytes": 0}


def make_ddp(kind: str, model: nn.Module, device: torch.device, **options) -> nn.Module:
    """Wrap ``model`` in ddpkit's (``kind="ddpkit"``), torch's (``"torch"``) DDP, or ddpkit's
    without gradients reduced in place (``"ddpkit_buckets"``, for the profile)."""
    device_ids = [device.index] if device.type == "cuda" else None
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **options)
    if kind in ("ddpkit", "ddpkit_buckets"):
        cls = DistributedDataParallel if kind == "ddpkit" else _BucketsOnlyDDP
        return cls(model, device_ids=device_ids, **options)
    raise ValueError(f"kind={kind!r} is not 'ddpkit', 'ddpkit_buckets' or 'torch'.")


def _floor_stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Stepper:
    """Local step + one flat all-reduce; grads are views of one buffer, zeroed in place."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device,
                       dtype=params[0].dtype)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    world_size = dist.get_world_size()
    opt = torch.optim.SGD(params, lr=_LR)

    def reduce() -> None:
        dist.all_reduce(flat)
        flat.div_(world_size)

    return Stepper(model, opt, x, y, zero=flat.zero_, after_backward=reduce)


def make_stepper(variant: str, model_name: str, quick: bool, device: torch.device,
                 set_to_none: bool = True, **ddp_options) -> Stepper:
    """One training step of ``variant`` on a fresh copy of the model.

    ``set_to_none`` is ``zero_grad``'s (the floor always zeroes its flat buffer in place).
    """
    rank = dist.get_rank()
    x, y = make_batch(model_name, quick, device, rank)
    model = build_model(model_name, quick, device)
    if variant == "floor":
        return _floor_stepper(model, x, y)
    if variant in ("ddpkit", "torch", "ddpkit_buckets"):
        model = make_ddp(variant, model, device, **ddp_options)
    elif variant != "local":
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}.")
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    return Stepper(model, opt, x, y, zero=lambda: opt.zero_grad(set_to_none=set_to_none))


def time_interleaved(steppers: dict[Any, Callable[[], None]], repeats: int, steps: int,
                     warmup: int, device: torch.device, cpu_out: dict[Any, list[float]] | None = None,
                     cpu_clock: Callable[[], float] = time.process_time) -> dict[Any, list[float]]:
    """Seconds per step for each stepper, ``repeats`` each, in rounds; max over ranks.

    Odd rounds run the steppers in reverse order: in a fixed order each variant always follows the
    same other one, and that position alone can move a variant by a few percent (see
    docs/performance.md).
    ``cpu_out`` receives the process CPU seconds per step as well (all threads of the rank, Gloo's
    included): on a shared, noisy machine it shows the work done where wall time shows the waiting.
    ``cpu_clock``: what that CPU time is read from (``time.thread_time``: the main thread's only).
    """
    names = list(steppers)
    for name in names:
        for _ in range(warmup):
            steppers[name]()
    times = torch.zeros(2, len(names), repeats, dtype=torch.float64)
    for rep in range(repeats):
        order = list(enumerate(names))
        for i, name in order if rep % 2 == 0 else reversed(order):
            barrier(device)
            start, cpu_start = time.perf_counter(), cpu_clock()
            for _ in range(steps):
                steppers[name]()
            synchronize(device)
            times[0, i, rep] = (time.perf_counter() - start) / steps
            times[1, i, rep] = (cpu_clock() - cpu_start) / steps
    times = max_over_ranks(times, device)
    if cpu_out is not None:
        cpu_out.update({name: times[1, i].tolist() for i, name in enumerate(names)})
    return {name: times[0, i].tolist() for i, name in enumerate(names)}


def run_ddp_step(model_names: list[str], quick: bool, repeats: int, steps: int,
                 device: torch.device) -> list[dict]:
    """One row per (model, variant): step-time statistics in seconds; unavailable variants marked."""
    rows = []
    for model_name in model_names:
        steppers, reasons = {}, {}
        for v in VARIANTS:
            try:  # a DDP refusing a model (every rank alike: same model, same checks) is a result too
                steppers[v] = make_stepper(v, model_name, quick, device)
            except (RuntimeError, ValueError, TypeError) as e:
                reasons[v] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        cpu: dict[str, list[float]] = {}
        timings = time_interleaved(steppers, repeats, steps, warmup=2, device=device, cpu_out=cpu)
        for variant in VARIANTS:
            row = {"model": model_name, "variant": variant, "available": variant in timings}
            if variant in timings:
                row.update(summarize(timings[variant]), times=timings[variant],
                           cpu_median=median(cpu[variant]), cpu_times=cpu[variant])
            else:
                row["reason"] = reasons.get(variant, "not run")
            rows.append(row)
    return rows


def _ratio(rows: list[dict], model: str, a: str, b: str, key: str = "times") -> dict[str, float] | None:
    """Median, quartiles and the median's 95% interval over rounds of ``a``'s time over ``b``'s in
    the same round."""
    by = {r["variant"]: r for r in rows if r["model"] == model and r["available"]}
    if a not in by or b not in by:
        return None
    return paired_ratio(by[a][key], by[b][key])


def paired_ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """The figures of ``a``/``b`` from the ratios of the same rounds' times."""
    paired = [x / y for x, y in zip(a, b)]
    low, high = median_interval(paired) or (None, None)  # None: too few rounds for 95%
    return {"median": median(paired), "q1": quantile(paired, 0.25), "q3": quantile(paired, 0.75),
            "ci_low": low, "ci_high": high}


def ddp_step_table(rows: list[dict], world_size: int, steps: int, describe: dict[str, str]) -> Table:
    table = Table(f"2. DDP step time ({ranks(world_size)}; per step, {steps} steps per repeat, "
                  "variants interleaved)",
                  ["model", "variant", "median (ms)", "q1 (ms)", "q3 (ms)", "min (ms)", "max (ms)",
                   "repeats", "cpu (ms)"])
    for r in rows:
        if not r["available"]:
            table.add(r["model"], r["variant"], "n/a", "-", "-", "-", "-", "0", "-")
            continue
        table.add(r["model"], r["variant"], *(f"{r[k] * 1e3:.2f}" for k in
                                                ("median", "q1", "q3", "min", "max")), r["n"],
                  f"{r['cpu_median'] * 1e3:.2f}")
    for model in dict.fromkeys(r["model"] for r in rows):
        parts = []
        for a, b in PAIRS:
            wall, cpu = _ratio(rows, model, a, b), _ratio(rows, model, a, b, "cpu_times")
            interval = ("too few rounds" if wall is None or wall["ci_low"] is None
                        else f"{wall['ci_low']:.3f}-{wall['ci_high']:.3f}")
            parts.append(f"{a}/{b} = {wall['median']:.3f} [{wall['q1']:.2f}-{wall['q3']:.2f}] "
                         f"(95% {interval}, cpu {cpu['median']:.3f})" if wall and cpu else f"{a}/{b} = n/a")
        table.notes.append(f"{model} ({describe.get(model, '')}): " + ", ".join(parts))
    table.notes.append("a/b: median over rounds of a's step time over b's in the same round "
                       "[quartiles] (95%: the median's confidence interval; an interval holding 1 "
                       "does not tell a from b); the variants alternate their order from round to round.")
    table.notes.append("cpu: median process CPU time per step (all threads of the rank, max over "
                       "ranks): the work done, less sensitive than wall time to a busy machine.")
    for r in rows:
        if not r["available"]:
            table.notes.append(f"n/a: {r['model']} {r['variant']}: {r.get('reason', 'not run')}")
    return table


def ratios(rows: list[dict]) -> dict[str, dict[str, float | None]]:
    """ddpkit/torch, ddpkit/floor and torch/floor per model: paired medians, quartiles and the
    medians' 95% intervals, wall and CPU."""
    out: dict[str, dict[str, float | None]] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        out[model] = {}
        for a, b in PAIRS:
            for key, suffix in (("times", ""), ("cpu_times", " cpu")):
                stats = _ratio(rows, model, a, b, key)
                out[model][f"{a}/{b}{suffix}"] = stats and stats["median"]
                out[model][f"{a}/{b}{suffix} q1"] = stats and stats["q1"]
                out[model][f"{a}/{b}{suffix} q3"] = stats and stats["q3"]
                out[model][f"{a}/{b}{suffix} ci_low"] = stats and stats["ci_low"]
                out[model][f"{a}/{b}{suffix} ci_high"] = stats and stats["ci_high"]
    return out
