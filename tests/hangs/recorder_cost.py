"""What the collective recorder (and strict mode) cost per DDP step, side by side in one run.

    PYTHONPATH=. python3 tests/hangs/recorder_cost.py            # bench's models, 2 ranks, a few minutes
    PYTHONPATH=. python3 tests/hangs/recorder_cost.py --quick

Three measures, because a shared 2-core machine moves step times by several percent from one round to
the next. (1) ddpkit's DDP on ``ddpkit bench``'s models, recorder off vs on (and off vs strict), timed in
interleaved rounds by the bench's own ``time_interleaved``; the figure is the median of the per-round
ratios, each stepper first putting the recorder in its own state (a few setattrs). (2) The recorder's
own work per collective, timed around a collective that does nothing, times the collectives a step
makes, over the step time: the cost with the noise taken out, but hot in the caches, as a loop keeps
it. (3) The main-thread CPU time of single steps, recorder off and on in alternation, medians: in a
step the recorder runs cold, and on a short step (``convbn``, quick) that is what a user pays.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the ranks helper

import torch  # noqa: E402
from ranks import run_ranks  # noqa: E402
from torch.distributed import distributed_c10d as c10d  # noqa: E402

from ddpkit.bench.ddp_step import make_stepper, time_interleaved  # noqa: E402
from ddpkit.runtime import process_group  # noqa: E402
from ddpkit.runtime.hangs.recorder import Recorder  # noqa: E402
from ddpkit.runtime.hangs.strict import StrictCheck  # noqa: E402


def _paired(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(tb / ta for ta, tb in zip(times[a], times[b])) - 1


def _per_call_seconds(calls: int = 20000) -> float:
    """The wrapper's own time per call: around an all_reduce that does nothing."""
    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    real, c10d.all_reduce = c10d.all_reduce, all_reduce
    recorder = Recorder()
    try:
        wrapped = recorder._wrap("all_reduce", all_reduce, "tensor", None)
        t = torch.ones(4)
        best = {}
        for name, fn in (("bare", all_reduce), ("wrapped", wrapped)) * 3:
            start = time.perf_counter()
            for _ in range(calls):
                fn(t)
            best[name] = min(best.get(name, 1.0), (time.perf_counter() - start) / calls)
    finally:
        c10d.all_reduce = real
    return best["wrapped"] - best["bare"]


def _measure(model_name: str, quick: bool, repeats: int, steps: int) -> dict[str, float]:
    watch = process_group._watch[0]
    recorder = watch.recorder
    strict = StrictCheck(watch.inquiry.store, watch.rank)
    step = make_stepper("ddpkit", model_name, quick, torch.device("cpu"))

    def off():
        recorder.uninstall()
        step()

    def on():
        recorder.install()
        recorder.before = None
        step()

    def checked():
        recorder.install()
        recorder.before = strict
        step()

    cpu = torch.device("cpu")
    plain_cpu: dict[str, list[float]] = {}
    plain = time_interleaved({"off": off, "on": on}, repeats, steps, warmup=2, device=cpu, cpu_out=plain_cpu)
    strict_times = time_interleaved({"off": off, "strict": checked}, max(3, repeats // 3), steps, warmup=1,
                                    device=cpu)
    recorder.install()
    recorder.before = None
    before = sum(log.seq for log in recorder.groups())
    step()
    per_step = sum(log.seq for log in recorder.groups()) - before
    return {"off": statistics.median(plain["off"]), "on": _paired(plain, "off", "on"),
            "on_cpu": _paired(plain_cpu, "off", "on"),
            "strict": _paired(strict_times, "off", "strict"), "collectives": per_step,
            "per_call": _per_call_seconds()}


def _alternate_steps(model_name: str, steps: int) -> dict[str, float]:
    """Median main-thread CPU seconds of one step of ``model_name`` (quick), recorder off and on by turns."""
    recorder = process_group._watch[0].recorder
    step = make_stepper("ddpkit", model_name, True, torch.device("cpu"))
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(steps):
        for state in ("off", "on") if i % 2 else ("on", "off"):
            if state == "on":
                recorder.install()
            else:
                recorder.uninstall()
            start = time.thread_time()
            step()
            cpu[state].append(time.thread_time() - start)
    recorder.install()
    return {state: statistics.median(times[steps // 10:]) for state, times in cpu.items()}


def main() -> None:
    quick = "--quick" in sys.argv
    repeats, steps = (6, 2) if quick else (60, 3)
    for model in ("large", "small"):
        r = run_ranks(_measure, 2, args=(model, quick, repeats, steps), timeout=900)[0]
        direct = r["per_call"] * r["collectives"] / r["off"]
        print(f"{model:6s} step {r['off'] * 1e3:7.2f} ms, {r['collectives']} collectives/step | side by side: "
              f"recorder on {r['on'] * 100:+.1f}% (CPU time {r['on_cpu'] * 100:+.1f}%), "
              f"strict {r['strict'] * 100:+.1f}% | recorder's own work {r['per_call'] * 1e6:.1f} us/collective "
              f"= {direct * 100:.3f}% of the step")
    r = run_ranks(_alternate_steps, 2, args=("convbn", 300 if quick else 3000), timeout=900)[0]
    print(f"convbn (quick) main-thread CPU per step: recorder off {r['off'] * 1e6:.0f} us, "
          f"on {r['on'] * 1e6:.0f} us ({(r['on'] - r['off']) * 1e6:+.0f} us)")


if __name__ == "__main__":
    main()
