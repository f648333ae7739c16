"""Checkpoints: atomic ``save`` / ``load`` on every rank, the newest complete file, wrapped and bare
state dicts, and the random number generators' state for an exact resume.

``files`` writes and finds checkpoint files; ``state_dict`` bridges the ``module.`` prefix of wrapped
models; ``rng`` captures and restores the generators.
"""
from __future__ import annotations

from ddpkit.checkpoint.files import latest_checkpoint, load, save
from ddpkit.checkpoint.rng import capture_rng_state, restore_rng_state
from ddpkit.checkpoint.state_dict import PREFIX, load_state_dict, unwrap_model, unwrap_state_dict, wrap_state_dict

__all__ = ["save", "load", "latest_checkpoint", "unwrap_state_dict", "wrap_state_dict", "load_state_dict",
           "unwrap_model", "capture_rng_state", "restore_rng_state", "PREFIX"]
