"""Random number generator state for a resume that draws what the interrupted run would have drawn."""
from __future__ import annotations

import random
import sys
from typing import Any, Mapping

import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, every CUDA device, Python's ``random``, NumPy's if imported.

    Saved in a checkpoint and given back to ``restore_rng_state``, they make dropout, shuffling and
    augmentation after a resume draw what the interrupted run would have drawn. Every value loads
    with ``torch.load(weights_only=True)``. Each rank has its own state: gather them all to save.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                          float(cached))
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what ``capture_rng_state`` returned (tensors may have been loaded onto a GPU)."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss, cached))


def _as_tuple(value: Any) -> Any:
    """random.setstate wants the nested tuples back; a round trip may have made lists of them."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
