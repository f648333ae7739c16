"""examples/train_ddp.py: one script under python, ddpkit run and torchrun; a killed run resumes bit for bit.

Every run is a subprocess tree (launcher and workers) that is killed in ``finally``. Runs use one
thread per process (OMP_NUM_THREADS=1) so that launchers cannot differ by thread count.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import kill_tree

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "train_ddp.py")
STEPS = ["--steps", "20", "--batch-size", "16"]
GLOO = ["--backend", "gloo"]  # two workers on the CPU, also on a machine with a single GPU
CHECKPOINTS = ["--checkpoint-every", "5"]
CRASH_AT = "10"

needs_ddp = pytest.mark.skipif(importlib.util.find_spec("ddpkit.ddp.distributed") is None,
                               reason="ddpkit.ddp.distributed (DistributedDataParallel) is not built yet")
needs_launcher = pytest.mark.skipif(importlib.util.find_spec("ddpkit.launch") is None,
                                    reason="ddpkit.launch ('ddpkit run') is not built yet")


def _ddpkit_run(*flags: str) -> list[str]:
    return [sys.executable, "-m", "ddpkit", "run", *flags]


def _torchrun(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", *flags]


def _launcher_with_restarts(*flags: str) -> list[str]:
    """``ddpkit run`` once it exists; torchrun (same flags) until then."""
    if importlib.util.find_spec("ddpkit.launch") is not None:
        return _ddpkit_run(*flags)
    return _torchrun(*flags)


def run_example(command: list[str], *args: str, crash_at: str | None = None, timeout: float = 60) -> str:
    """Run the example (``command`` is the launcher prefix), return its stdout; raise on failure."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("DDPKIT_EXAMPLE_CRASH_AT_STEP", None)
    if crash_at is not None:
        env["DDPKIT_EXAMPLE_CRASH_AT_STEP"] = crash_at
    proc = subprocess.Popen([*command, EXAMPLE, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} example exited {proc.returncode}\n"
                             f"--- stdout ---\n{out}\n--- stderr ---\n{err[-4000:]}")
    return out


def losses(stdout: str) -> list[tuple[int, float]]:
    """The (step, loss) lines; a launcher may tag them with the rank, as in ``[rank0]: step ...``."""
    pattern = r"^(?:\[rank\d+\]:? ?)?step\s+(\d+)/\d+ loss (\S+)$"
    return [(int(s), float(v)) for s, v in re.findall(pattern, stdout, re.M)]


def assert_same_parameters(a: Path, b: Path) -> None:
    first, second = torch.load(a), torch.load(b)
    assert list(first) == list(second)
    different = [k for k in first if not torch.equal(first[k], second[k])]
    assert not different, f"parameters differ: {different}"


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory) -> tuple[str, Path]:
    """An uninterrupted ``python examples/train_ddp.py`` run: its stdout and final parameters."""
    out = tmp_path_factory.mktemp("reference") / "final.pt"
    return run_example([sys.executable], *STEPS, "--out", str(out)), out


@pytest.mark.timeout(90)
def test_single_process_killed_after_a_checkpoint_resumes_to_the_same_parameters(
        tmp_path, single_process_reference):
    reference_stdout, reference = single_process_reference
    assert [s for s, _ in losses(reference_stdout)] == list(range(2, 21, 2))
    args = [*STEPS, *CHECKPOINTS, "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--out", str(tmp_path / "final.pt")]
    with pytest.raises(AssertionError, match=f"exited {-signal.SIGKILL}"):
        run_example([sys.executable], *args, crash_at=CRASH_AT)
    assert not (tmp_path / "final.pt").exists()
    resumed = run_example([sys.executable], *args)  # the same command again
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000010.pt'} at step 10" in resumed
    assert losses(resumed) == losses(reference_stdout)[5:]
    assert_same_parameters(reference, tmp_path / "final.pt")
    with pytest.raises(AssertionError, match="holds a checkpoint at step 20, beyond --steps 10"):
        run_example([sys.executable], "--steps", "10", "--checkpoint-dir", str(tmp_path / "ckpt"))


@needs_ddp
@needs_launcher
@pytest.mark.timeout(90)
def test_python_and_ddpkit_run_with_one_process_print_the_same_losses(tmp_path, single_process_reference):
    reference_stdout, reference = single_process_reference
    launched = run_example(_ddpkit_run("--nproc-per-node", "1"), *STEPS, "--out", str(tmp_path / "final.pt"))
    ours, theirs = losses(launched), losses(reference_stdout)
    assert ours and [step for step, _ in ours] == [step for step, _ in theirs]
    assert [loss for _, loss in ours] == pytest.approx([loss for _, loss in theirs], rel=1e-5)
    assert_same_parameters(reference, tmp_path / "final.pt")


@needs_ddp
@pytest.mark.timeout(120)
def test_two_workers_with_one_killed_and_restarted_end_bit_for_bit_like_an_uninterrupted_run(tmp_path):
    # torchrun keeps its logs in a torchelastic_* directory of /tmp unless given one
    uninterrupted = run_example(_torchrun("--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs")), *STEPS, *GLOO,
                                "--out", str(tmp_path / "uninterrupted.pt"))
    assert len(losses(uninterrupted)) == 10  # printed by rank 0 only
    restarted = run_example(
        _launcher_with_restarts("--nproc-per-node", "2", "--max-restarts", "1"),
        *STEPS, *GLOO, *CHECKPOINTS,
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "restarted.pt"),
        crash_at=CRASH_AT)
    assert "at step 10" in restarted  # the restarted group resumed from the checkpoint of step 10
    assert losses(restarted)[-5:] == losses(uninterrupted)[-5:]
    assert_same_parameters(tmp_path / "uninterrupted.pt", tmp_path / "restarted.pt")
