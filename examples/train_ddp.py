"""Train a small MLP data-parallel: one file for one process, ``ddpkit run`` and ``torchrun``.

    python examples/train_ddp.py                                   # one process
    ddpkit run --nproc-per-node 2 examples/train_ddp.py            # two processes (Gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/train_ddp.py              # the same, with torch's launcher

Checkpoints and resume: with --checkpoint-dir the run saves every --checkpoint-every steps and, when
started again, resumes from the newest complete checkpoint there. Model, optimizer, step and every
rank's RNG state are saved, so the resumed run ends with bit-for-bit the parameters of a run that was
never interrupted (with the same world size and flags):

    ddpkit run --nproc-per-node 2 --max-restarts 3 examples/train_ddp.py --checkpoint-dir ckpt
    # a worker died? --max-restarts restarts the group, which resumes from ckpt/;
    # the whole job died? run the same command again.

Flags: --steps, --batch-size (per process), --lr, --seed, --checkpoint-dir, --checkpoint-every,
--out (final parameters, a state dict for torch.load), --backend (default: nccl on GPUs, else gloo).
The data are synthetic and a function of (seed, rank, step), so a run is reproducible.
"""
from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

# ddpkit before torch: it imports torch without the warning torch prints where numpy is missing
import ddpkit
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    load_state_dict,
    restore_rng_state,
    unwrap_model,
)

IN_FEATURES = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process and step")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the final state dict here")
    parser.add_argument("--backend", default=None, help="gloo, nccl, ...; default: nccl on GPUs, else gloo")
    return parser.parse_args(argv)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1),
    )


def batch(seed: int, rank: int, step: int, size: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: a function of its arguments only, so a resumed run sees it too."""
    target = torch.Generator().manual_seed(seed)
    weight = torch.randn(IN_FEATURES, 1, generator=target) / IN_FEATURES ** 0.5
    g = torch.Generator().manual_seed((seed << 40) + (step << 16) + rank)
    x = torch.randn(size, IN_FEATURES, generator=g)
    y = torch.sin(x @ weight) + 0.1 * torch.randn(size, 1, generator=g)
    return x.to(device), y.to(device)


def all_rng_states() -> list[dict]:
    """Every rank's RNG state (dropout draws differ per rank), in rank order."""
    state = capture_rng_state()
    if ddpkit.get_world_size() == 1:
        return [state]
    return ddpkit.all_gather_object(state)


def save_checkpoint(directory: Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> None:
    rng = all_rng_states()  # collectives: every rank takes part, rank 0 writes
    state = {"step": step, "world_size": len(rng), "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "rng": rng}
    ddpkit.save(state, directory / f"step_{step:08d}.pt")


def resume(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> int:
    """Load the newest complete checkpoint, if any; return the step to continue from."""
    path = latest_checkpoint(directory)
    if path is None:
        return 0
    state = ddpkit.load(path)
    load_state_dict(model, state["model"])  # the "module." prefix differs between world sizes
    optimizer.load_state_dict(state["optimizer"])
    if state["world_size"] == len(state["rng"]) == ddpkit.get_world_size():
        restore_rng_state(state["rng"][rank])
    else:
        ddpkit.print(f"world size changed from {state['world_size']}: RNG streams start afresh")
    ddpkit.print(f"resumed from {path} at step {state['step']}")
    return state["step"]


def crash_for_tests(step: int, resumed: bool) -> None:
    """Test hook: DDPKIT_EXAMPLE_CRASH_AT_STEP=k SIGKILLs the last rank after the checkpoint at step
    k, on a first attempt only (no restart yet, not resumed), so the rerun gets past it."""
    crash_at = os.environ.get("DDPKIT_EXAMPLE_CRASH_AT_STEP")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not resumed
    if crash_at and int(crash_at) == step and first_attempt \
            and ddpkit.get_rank() == ddpkit.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)


def train(args: argparse.Namespace) -> None:
    env = ddpkit.init(backend=args.backend)
    device = env.device
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = ddpkit.parallelize(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    torch.manual_seed(args.seed + 1 + env.rank)  # dropout masks differ between ranks
    start = resume(args.checkpoint_dir, model, optimizer, env.rank) if args.checkpoint_dir else 0
    if start > args.steps:
        raise SystemExit(f"{args.checkpoint_dir} holds a checkpoint at step {start}, beyond --steps "
                         f"{args.steps}: nothing to train. HINT: pass --steps {start} or more to go on "
                         "from it, or another --checkpoint-dir to start afresh.")
    log_every = max(1, args.steps // 10)

    model.train()
    for step in range(start, args.steps):
        x, y = batch(args.seed, env.rank, step, args.batch_size, device)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        if done % log_every == 0 or done == args.steps:
            mean_loss = ddpkit.all_reduce(loss.detach().clone(), op="mean")
            ddpkit.print(f"step {done:5d}/{args.steps} loss {mean_loss.item():.6f}")
        if args.checkpoint_dir and (done % args.checkpoint_every == 0 or done == args.steps):
            save_checkpoint(args.checkpoint_dir, done, model, optimizer)
            crash_for_tests(done, resumed=start > 0)

    if args.out is not None:
        ddpkit.save(unwrap_model(model).state_dict(), args.out)
    ddpkit.shutdown()


if __name__ == "__main__":
    train(parse_args())
