"""Whether big CPU gradients pay to be reduced where they lie on this host (``in_place_pays``).

Not part of the default run (``--tables in_place``). Each member of the family with a gradient of
``IN_PLACE_BYTES`` or more trains with ddpkit's DDP twice: every such gradient reduced where it lies
by a collective of its own, launched as soon as it is ready ("in place"), or every gradient copied
into a bucket ("buckets"), whatever the host. torch's DDP runs beside them. Where "buckets" costs
less, ddpkit's rule should leave the gradients in buckets (Note [Big gradients in place] in
docs/design.md); the table says what the rule chooses here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.bench.ddp_step import Stepper, make_ddp, paired_ratio, time_interleaved
from ddpkit.bench.models import build_model, make_batch
from ddpkit.bench.report import Table, median, ranks
from ddpkit.ddp.cpu_share import in_place_pays
from ddpkit.ddp.distributed import DistributedDataParallel
from ddpkit.ddp.inplace_bucket import IN_PLACE_BYTES, InPlaceBucket

__all__ = ["VARIANTS", "run_in_place", "in_place_table"]

VARIANTS = ("in place", "buckets", "torch")
QUICK_IN_PLACE_BYTES = 64 << 10
"""The quick run's models are small: their big gradients start at 64 KiB."""


def _in_place(in_place_bytes: int) -> type[DistributedDataParallel]:
    """ddpkit's DDP with ``in_place_bytes`` given, so that the host's cores do not decide."""
    options = {"in_place_bytes": in_place_bytes}
    return type("InPlaceDDP", (DistributedDataParallel,), {"_reducer_options": options})


def _stepper(variant: str, model_name: str, quick: bool, threshold: int, device: torch.device) -> Stepper:
    x, y = make_batch(model_name, quick, device, dist.get_rank())
    model = build_model(model_name, quick, device)
    if variant == "in place":
        module = _in_place(threshold)(model)
    else:  # "buckets": the profile's ddpkit_buckets, every gradient in a bucket whatever the cores
        module = make_ddp("torch" if variant == "torch" else "ddpkit_buckets", model, device)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    return Stepper(module, opt, x, y, zero=lambda: opt.zero_grad(set_to_none=True))


def _big_gradients(model_name: str, quick: bool, threshold: int) -> int:
    model = build_model(model_name, quick, torch.device("cpu"))
    return sum(p.numel() * p.element_size() >= threshold for p in model.parameters() if p.requires_grad)


def run_in_place(model_names: list[str], quick: bool, repeats: int, steps: int, device: torch.device) -> dict:
    """Per member with big gradients: each variant's median step and CPU time, and buckets/in place."""
    threshold = QUICK_IN_PLACE_BYTES if quick else IN_PLACE_BYTES
    result: dict = {"threshold_bytes": threshold, "rule_keeps_in_place": in_place_pays(dist.get_world_size()),
                    "rows": [], "skipped": []}
    if device.type != "cpu" or dist.get_world_size() < 2:
        # the rule is the CPU's (on GPUs every gradient has a bucket); a world of one has no reducer
        result["skipped"] = list(model_names)
        return result
    for model_name in model_names:
        big = _big_gradients(model_name, quick, threshold)
        if not big:
            result["skipped"].append(model_name)
            continue
        steppers = {v: _stepper(v, model_name, quick, threshold, device) for v in VARIANTS}
        cpu: dict = {}
        times = time_interleaved(steppers, repeats, steps, warmup=2, device=device, cpu_out=cpu)
        row: dict = {"model": model_name, "big_gradients": big}
        for v in VARIANTS:
            row[v] = {"median": median(times[v]), "cpu_median": median(cpu[v]), "times": times[v], "cpu_times": cpu[v]}
        for v in ("in place", "buckets"):  # after the rebuild: the layout each variant really ran
            row[v]["in_place_buckets"] = sum(isinstance(b, InPlaceBucket) for b in steppers[v].module.reducer.buckets)
        row["buckets/in place"] = paired_ratio(times["buckets"], times["in place"])
        row["buckets/in place cpu"] = paired_ratio(cpu["buckets"], cpu["in place"])
        result["rows"].append(row)
    return result


def in_place_table(result: dict, world_size: int) -> Table:
    table = Table(f"7. ddpkit DDP: big CPU gradients in place, or in buckets ({ranks(world_size)}; per step)",
                  ["model", "big gradients", "in place (ms)", "buckets (ms)", "torch (ms)",
                   "buckets/in place", "95%", "cpu"])
    for r in result["rows"]:
        wall, cpu = r["buckets/in place"], r["buckets/in place cpu"]
        interval = "-" if wall["ci_low"] is None else f"{wall['ci_low']:.3f}-{wall['ci_high']:.3f}"
        table.add(r["model"], r["big_gradients"], *(f"{r[v]['median'] * 1e3:.2f}" for v in VARIANTS),
                  f"{wall['median']:.3f}", interval, f"{cpu['median']:.3f}")
    table.notes.append(f"in place: every gradient of {result['threshold_bytes'] >> 10} KiB or more reduced where it "
                       "lies, by a collective of its own; buckets: every gradient copied into a bucket. "
                       "buckets/in place: median over rounds of the paired ratio [95% interval]; cpu: the same "
                       "of the process CPU time (all threads, max over ranks).")
    chosen = "in place" if result["rule_keeps_in_place"] else "buckets"
    table.notes.append(f"ddpkit's rule on this host ({ranks(world_size)}): {chosen} (in place where every rank has "
                       "a core, or all share one).")
    if result["skipped"]:
        table.notes.append("no big gradient, not on the CPU, or a world of one (not run): "
                           + ", ".join(result["skipped"]))
    return table
