"""PyTorch's classic DataParallel tutorial, on ddpkit, runnable without GPUs.

Usage (from the repository root, with ddpkit installed: pip install -e .):
    python examples/data_parallel_tutorial.py                          # every GPU, else plain CPU
    python examples/data_parallel_tutorial.py --devices cpu,cpu,cpu    # three replicas on the CPU
    python examples/data_parallel_tutorial.py --devices 0,1            # GPUs 0 and 1
    python examples/data_parallel_tutorial.py --devices cuda:0,cuda:0  # one GPU named twice

A Linear(5, 2) model prints the size of the chunk each replica sees ("In Model"); the loop prints the
size of the whole batch ("Outside"). 100 samples in batches of 30 give 30, 30, 30, 10; over three
devices each 30 is split 10/10/10 and the last 10 is split 4/4/2, exactly as torch.chunk would.
The "In Model" lines of one batch come from parallel threads, so their order may vary.
"""
from __future__ import annotations

import argparse

import ddpkit  # before torch: it imports torch without the warning a missing numpy would print
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["Model", "RandomDataset", "main"]

input_size = 5
output_size = 2
batch_size = 30
data_size = 100


class RandomDataset(Dataset):
    """Random vectors; only __getitem__ and __len__ are needed."""

    def __init__(self, size: int, length: int) -> None:
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class Model(nn.Module):
    """One linear layer that reports the input it was given."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = self.fc(input)
        # one write per line: replicas print from parallel threads, and print(a, b, ...) writes piecewise
        print(f"\tIn Model: input size {input.size()} output size {output.size()}\n", end="")
        return output


def _parse_devices(text: str | None) -> list[int | str]:
    if text is None:
        return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    return [int(d) if d.strip().isdigit() else d.strip() for d in text.split(",") if d.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="comma-separated devices, e.g. cpu,cpu,cpu or 0,1 (default: all GPUs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    devices = _parse_devices(args.devices)
    if not torch.cuda.is_available() and any(isinstance(d, int) or str(d).startswith("cuda") for d in devices):
        parser.error(f"--devices {args.devices} names GPUs, but CUDA is not available here: "
                     f"name CPU devices instead, e.g. --devices {','.join(['cpu'] * len(devices))}")
    device = torch.device(f"cuda:{devices[0]}" if isinstance(devices[0], int) else devices[0]) if devices else (
        torch.device("cpu")
    )
    rand_loader = DataLoader(dataset=RandomDataset(input_size, data_size), batch_size=batch_size, shuffle=True)

    model = Model(input_size, output_size)
    if len(devices) > 1:
        kind = "GPUs" if all(isinstance(d, int) or str(d).startswith("cuda") for d in devices) else "devices"
        print("Let's use", len(devices), f"{kind}!")
        # dim = 0 [30, xxx] -> [10, ...], [10, ...], [10, ...] on 3 devices
        model = ddpkit.DataParallel(model, device_ids=devices)
    model.to(device)

    for data in rand_loader:
        input = data.to(device)
        output = model(input)
        print("Outside: input size", input.size(), "output_size", output.size())


if __name__ == "__main__":
    main()
