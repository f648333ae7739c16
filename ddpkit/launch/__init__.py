"""``ddpkit run``: torchrun's flags and worker environment, with a clean stop and a clear summary.

One job per module: ``config`` (flags -> LaunchConfig), ``scheduler_defaults`` (what srun or
mpirun says where a flag is not given), ``rendezvous`` (the store workers meet on),
``node_rendezvous`` and ``node_watch`` (node launchers meeting, heartbeats, failures), ``workers``
(environment, start, signal and kill worker trees), ``logs`` (rank-prefixed lines, per-rank files,
stderr tails), ``signals`` (death signal, subreaper, signal inbox), ``watchdog`` (cleanup after a
SIGKILLed launcher), ``summary`` (what is printed when a job fails), ``supervisor`` (watch, stop,
restart) and ``cli`` (the entry point).
"""
from __future__ import annotations

from ddpkit.launch.cli import main
from ddpkit.launch.config import LaunchConfig, parse_args

__all__ = ["main", "LaunchConfig", "parse_args"]
