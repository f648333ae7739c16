"""What the scheduler tests read from a launched job's output: losses, collective results, timings."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COLLECTIVE = str(Path(__file__).parent / "scripts" / "collective_check.py")
EXAMPLE = str(REPO / "examples" / "train_ddp.py")
TRAIN_FLAGS = ["--steps", "10", "--batch-size", "16"]
_CHECK = re.compile(r"rank (\d+)/(\d+) local (\d+)/(\d+) launcher (\w+) port (\d+) threads (\d+) "
                    r"sum ([0-9.]+) markers ([0-9.]+)")  # numbers only: lines of two ranks may run together


@dataclass(frozen=True)
class RankLine:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    port: int
    threads: int
    total: float
    markers: float


def rank_lines(output: str) -> list[RankLine]:
    """The lines collective_check.py printed, one per rank, in rank order."""
    lines = [RankLine(int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5], int(m[6]), int(m[7]),
                      float(m[8]), float(m[9])) for m in _CHECK.finditer(output)]
    return sorted(lines, key=lambda line: line.rank)


def losses(output: str) -> list[tuple[int, float]]:
    """The example's (step, loss) lines; a launcher may tag them with the rank."""
    pattern = r"^(?:\[rank\d+\]:? ?)?(?:\d+: )?step\s+(\d+)/\d+ loss (\S+)$"
    return [(int(s), float(v)) for s, v in re.findall(pattern, output, flags=re.M)]


def ddpkit_run_losses(nproc: int, env: dict[str, str]) -> list[tuple[int, float]]:
    """The reference: the example under ``ddpkit run`` with as many processes."""
    result = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", str(nproc), EXAMPLE,
                             *TRAIN_FLAGS], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    return losses(result.stdout)


@dataclass
class Finished:
    returncode: int
    output: str
    seconds: float


def run_together(commands: list[list[str]], env: dict[str, str], timeout: float) -> list[Finished]:
    """Start every command at once and wait for all; output is stdout and stderr together, and
    ``seconds`` is when each command ended, counted from the common start."""
    start = time.monotonic()
    processes = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  cwd=REPO) for c in commands]

    def wait(p: subprocess.Popen) -> Finished:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        return Finished(p.returncode, out, time.monotonic() - start)

    with ThreadPoolExecutor(len(processes)) as pool:
        return list(pool.map(wait, processes))
