"""The two benchmark models: a few large tensors, and hundreds of small ones.

They pull DDP's costs apart. ``large`` is bandwidth-bound: 4 Linear(1024, 1024) give ~16 MiB of
gradients in 8 tensors, and a step takes tens of ms on one CPU core. ``small`` is overhead-bound:
200 Linear(64, 64) give 400 gradient tensors of 16 KiB or less, so per-tensor work (hooks, bucket
copies, Python in the autograd callbacks) dominates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MODELS", "ModelSpec", "get_spec", "build_model", "make_batch"]


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model and its batch; ``quick`` shrinks it for the smoke run."""

    name: str
    layers: int
    width: int
    batch: int
    quick_layers: int
    quick_width: int

    def shape(self, quick: bool) -> tuple[int, int]:
        return (self.quick_layers, self.quick_width) if quick else (self.layers, self.width)

    def describe(self, quick: bool) -> str:
        layers, width = self.shape(quick)
        return f"{layers} x Linear({width},{width}), batch {self.batch}"


MODELS: dict[str, ModelSpec] = {
    "large": ModelSpec("large", layers=4, width=1024, batch=64, quick_layers=4, quick_width=256),
    "small": ModelSpec("small", layers=200, width=64, batch=64, quick_layers=50, quick_width=32),
}


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one of {sorted(MODELS)}.")
    return MODELS[name]


def build_model(name: str, quick: bool, device: torch.device, seed: int = 0) -> nn.Module:
    """The same weights on every rank and for every variant (seeded), on ``device``."""
    layers, width = get_spec(name).shape(quick)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        blocks: list[nn.Module] = []
        for _ in range(layers):
            # tanh keeps activations alive through 200 layers, so every gradient is non-trivial
            blocks += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*blocks).to(device)
    finally:
        torch.random.set_rng_state(gen_state)


def make_batch(name: str, quick: bool, device: torch.device, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed (input, target) batch per rank: ranks differ, variants see the same data."""
    spec = get_spec(name)
    _, width = spec.shape(quick)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(spec.batch, width, generator=gen)
    y = torch.randn(spec.batch, width, generator=gen)
    return x.to(device), y.to(device)
