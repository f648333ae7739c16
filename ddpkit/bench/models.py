"""The bench's model family: each member pulls a different one of DDP's costs apart.

- ``large``: 4 x Linear(1024, 1024), 16 MiB of gradients in 8 tensors: bandwidth-bound, one bucket.
- ``mlp34``: 9 x Linear(976, 976), 34 MB of gradients in 18 tensors: more than one 25 MB bucket.
- ``small``: 200 x Linear(64, 64), 400 gradient tensors of 16 KiB or less: per-tensor overhead.
- ``transformer``: a 4-layer encoder (d_model 256), 12.6 MB in 48 tensors of mixed sizes.
- ``convbn``: a conv + BatchNorm net: compute-heavy, small gradients, buffers broadcast each forward.
- ``embedding``: a 16 MiB embedding table whose (dense) gradient is mostly zeros, and a small head.

``quick`` shrinks every member for the smoke run. Every model takes ``make_batch``'s input and is
trained on the MSE against a target shaped like its output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["MODELS", "FAMILY", "ModelSpec", "get_spec", "build_model", "make_batch"]


@dataclass(frozen=True)
class ModelSpec:
    """How to build a member and its input; ``quick`` shrinks it for the smoke run.

    ``build(quick)`` returns the module; ``batch(quick, gen)`` one input tensor; ``out(quick)``
    the shape of one output row (the target's); ``text(quick)`` describes it for the tables.
    """

    name: str
    build: Callable[[bool], nn.Module]
    batch: Callable[[bool, torch.Generator], torch.Tensor]
    text: Callable[[bool], str]

    def describe(self, quick: bool) -> str:
        return self.text(quick)


def _mlp(layers: int, width: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        # tanh keeps activations alive through 200 layers, so every gradient is non-trivial
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


def _mlp_spec(name: str, layers: int, width: int, quick_layers: int, quick_width: int) -> ModelSpec:
    def shape(quick: bool) -> tuple[int, int]:
        return (quick_layers, quick_width) if quick else (layers, width)

    def text(quick: bool) -> str:
        n, w = shape(quick)
        return f"{n} x Linear({w},{w}), batch 64, {n * (w * w + w) * 4 / 1e6:.1f} MB of gradients"

    return ModelSpec(name, build=lambda q: _mlp(*shape(q)),
                     batch=lambda q, gen: torch.randn(64, shape(q)[1], generator=gen), text=text)


class _Encoder(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def _conv_bn(quick: bool) -> nn.Module:
    widths = (3, 16, 32) if quick else (3, 32, 64, 128, 256)
    blocks: list[nn.Module] = []
    for k, (cin, cout) in enumerate(zip(widths, widths[1:])):
        blocks += [nn.Conv2d(cin, cout, 3, stride=1 if k == 0 else 2, padding=1, bias=False),
                   nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], 10))


class _EmbeddingNet(nn.Module):
    """A bag-of-tokens classifier: a big table (dense gradient, mostly zeros) and a small head."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


MODELS: dict[str, ModelSpec] = {
    "large": _mlp_spec("large", 4, 1024, 4, 256),
    "mlp34": _mlp_spec("mlp34", 9, 976, 9, 128),
    "small": _mlp_spec("small", 200, 64, 50, 32),
    "transformer": ModelSpec(
        "transformer", build=lambda q: _Encoder(64 if q else 256, 2 if q else 4),
        batch=lambda q, gen: torch.randn(8, 16 if q else 32, 64 if q else 256, generator=gen),
        text=lambda q: f"TransformerEncoder, {2 if q else 4} layers, d_model {64 if q else 256}, "
                       f"batch 8 x {16 if q else 32} tokens"),
    "convbn": ModelSpec(
        "convbn", build=_conv_bn,
        batch=lambda q, gen: torch.randn(8 if q else 32, 3, 16 if q else 32, 16 if q else 32, generator=gen),
        text=lambda q: f"{2 if q else 4} x (Conv2d, BatchNorm2d, ReLU) + Linear, batch {8 if q else 32} "
                       f"x 3 x {16 if q else 32}^2"),
    "embedding": ModelSpec(
        "embedding", build=lambda q: _EmbeddingNet(2048 if q else 32768, 32 if q else 128),
        batch=lambda q, gen: torch.randint(0, 2048 if q else 32768, (64, 32), generator=gen),
        text=lambda q: f"Embedding({2048 if q else 32768}, {32 if q else 128}) dense, 2 x Linear, "
                       "batch 64 x 32 tokens"),
}
FAMILY = tuple(MODELS)
"""Every member, in the order the tables list them."""


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one of {sorted(MODELS)}.")
    return MODELS[name]


def build_model(name: str, quick: bool, device: torch.device, seed: int = 0) -> nn.Module:
    """The same weights on every rank and for every variant (seeded), on ``device``."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return get_spec(name).build(quick).to(device)
    finally:
        torch.random.set_rng_state(gen_state)


def make_batch(name: str, quick: bool, device: torch.device, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed (input, target) batch per rank: ranks differ, variants see the same data. The
    target is shaped like the output (found by one forward of the model without gradients)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = get_spec(name).batch(quick, gen)
    with torch.no_grad():
        shape = build_model(name, quick, torch.device("cpu"))(x).shape
    y = torch.randn(shape, generator=gen)
    return x.to(device), y.to(device)
