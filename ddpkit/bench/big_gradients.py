"""Where a CPU gradient is big enough to be scaled into its bucket by its own hook (``is_big``).

Not part of the default run (``--tables big``). For each gradient size, a model of 8 bias-free
Linear layers whose weights have that many elements trains with ddpkit's DDP twice: every gradient
scaled into its slot by its own hook as it becomes ready (and left there at the end, Note [Averages
in their slots]), or every gradient copied at its bucket's launch with one ``_foreach_copy_`` and
one ``mul_``. torch's DDP runs beside them. The sizes where "own hook" costs less than "at launch"
are where ``BIG_PARAM_NUMEL`` belongs (Note [Big gradients] in docs/design.md).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.bench.ddp_step import Stepper, make_ddp, paired_ratio, time_interleaved
from ddpkit.bench.report import Table, median, ranks
from ddpkit.ddp.bucket import Bucket
from ddpkit.ddp.distributed import DistributedDataParallel

__all__ = ["SIZES", "LAYERS", "run_big_gradients", "big_gradients_table"]

SIZES = ((64, 64), (128, 128), (256, 128), (256, 256), (384, 256), (512, 256), (512, 512))
"""(in, out) of the Linear layers: weights of 4 Ki to 256 Ki elements."""
QUICK_SIZES = ((64, 64), (256, 256))
LAYERS = 8
_BATCH = 4


class _OwnHookBucket(Bucket):
    big_numel = 1


class _AtLaunchBucket(Bucket):
    big_numel = 1 << 62


class _OwnHookDDP(DistributedDataParallel):
    _reducer_options = {"bucket_type": _OwnHookBucket}


class _AtLaunchDDP(DistributedDataParallel):
    _reducer_options = {"bucket_type": _AtLaunchBucket}


def _stepper(variant: str, width_in: int, width_out: int, device: torch.device) -> Stepper:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width_in, width_out, bias=False) if k % 2 == 0 else
                            nn.Linear(width_out, width_in, bias=False) for k in range(LAYERS)]).to(device)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = (torch.randn(_BATCH, width_in, generator=gen).to(device) for _ in range(2))
    if variant == "torch":
        module = make_ddp("torch", model, device)
    else:
        module = (_OwnHookDDP if variant == "own hook" else _AtLaunchDDP)(model)
    opt = torch.optim.SGD(module.parameters(), lr=0.001)
    return Stepper(module, opt, x, y, zero=opt.zero_grad)


def run_big_gradients(quick: bool, repeats: int, steps: int, device: torch.device) -> list[dict]:
    """One row per gradient size: each variant's median step and CPU time, and paired ratios."""
    rows = []
    for width_in, width_out in QUICK_SIZES if quick else SIZES:
        steppers = {v: _stepper(v, width_in, width_out, device) for v in ("own hook", "at launch", "torch")}
        cpu: dict = {}
        times = time_interleaved(steppers, repeats, steps, warmup=2, device=device, cpu_out=cpu,
                                 cpu_clock=time.thread_time)
        row: dict = {"numel": width_in * width_out, "gradients": LAYERS}
        for v in steppers:
            row[v] = {"median": median(times[v]), "cpu_median": median(cpu[v]), "times": times[v],
                      "cpu_times": cpu[v]}
        row["own/launch"] = paired_ratio(times["own hook"], times["at launch"])
        row["own/launch cpu"] = paired_ratio(cpu["own hook"], cpu["at launch"])
        rows.append(row)
    return rows


def big_gradients_table(rows: list[dict], world_size: int) -> Table:
    table = Table(f"6. ddpkit DDP: a gradient scaled by its own hook, or at its bucket's launch "
                  f"({ranks(world_size)}; per step)",
                  ["elements", "own hook (ms)", "at launch (ms)", "torch (ms)", "own/launch",
                   "own/launch cpu", "cpu diff per gradient (us)"])
    for r in rows:
        diff = (r["own hook"]["cpu_median"] - r["at launch"]["cpu_median"]) / r["gradients"] * 1e6
        table.add(r["numel"], *(f"{r[v]['median'] * 1e3:.2f}" for v in ("own hook", "at launch", "torch")),
                  f"{r['own/launch']['median']:.3f}", f"{r['own/launch cpu']['median']:.3f}", f"{diff:+.1f}")
    table.notes.append(f"{LAYERS} bias-free Linear layers whose weights have that many elements. own hook: every "
                       "gradient scaled into its slot by its own hook and left there; at launch: copied with "
                       "the bucket's one _foreach_copy_ and scaled by one mul_. own/launch: median over rounds "
                       "of the paired ratio; cpu: the main thread's CPU time, where the hooks run (max over "
                       "ranks). ddpkit's BIG_PARAM_NUMEL belongs where own hook starts to cost less.")
    return table
