"""What the collective recorder (and strict mode) cost per DDP step, side by side in one run.

    PYTHONPATH=. python3 tests/hangs/recorder_cost.py            # bench's models, 2 ranks, ~1 minute
    PYTHONPATH=. python3 tests/hangs/recorder_cost.py --quick

Three steppers of ddpkit's DDP on ``ddpkit bench``'s models, timed in interleaved rounds by the bench's
own ``time_interleaved``: the recorder off (unwrapped), on (the default), and strict mode. Each stepper
first puts the recorder in its own state (a few setattrs), so the toggling costs all three alike.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the ranks helper

import torch  # noqa: E402
from ranks import run_ranks  # noqa: E402

from ddpkit.bench.ddp_step import make_stepper, time_interleaved  # noqa: E402
from ddpkit.runtime import process_group  # noqa: E402
from ddpkit.runtime.hangs.strict import StrictCheck  # noqa: E402


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

    times = time_interleaved({"off": off, "on": on, "strict": checked}, repeats, steps, warmup=2,
                             device=torch.device("cpu"))
    recorder.install()
    recorder.before = None
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    quick = "--quick" in sys.argv
    repeats, steps = (5, 2) if quick else (30, 3)
    for model in ("large", "small"):
        result = run_ranks(_measure, 2, args=(model, quick, repeats, steps), timeout=600)[0]
        off = result["off"]
        print(f"{model:6s} median step: recorder off {off * 1e3:8.2f} ms | on {result['on'] * 1e3:8.2f} ms "
              f"({(result['on'] / off - 1) * 100:+5.1f}%) | strict {result['strict'] * 1e3:8.2f} ms "
              f"({(result['strict'] / off - 1) * 100:+5.1f}%)")


if __name__ == "__main__":
    main()
