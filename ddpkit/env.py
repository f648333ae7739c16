"""``ddpkit.env``: where am I in the job? The detection lives in ``ddpkit.runtime.env``."""
from __future__ import annotations

from ddpkit.runtime.env import DEFAULT_MASTER_PORT, LAUNCHERS, DistEnv, detect, expand_hostlist

__all__ = ["DistEnv", "detect", "expand_hostlist", "LAUNCHERS", "DEFAULT_MASTER_PORT"]
