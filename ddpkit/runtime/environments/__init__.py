"""Readers of the launchers' environment variables, one module per source; ``ddpkit.env`` is the face.

Each launcher describes the job in its own variables, with its own gaps and quirks; keeping one small
module per source (as Lightning Fabric's ``plugins/environments/`` does) lets each be read and
changed without the others. ``torchrun``, ``slurm`` and ``mpi`` each export one ``from_*(environ)``
that returns a ``DistEnv`` (``dist_env``) or None when its variables are absent, sharing the parsing
and rank checks in ``variables``; ``hostlist`` reads SLURM's compact lists. ``job`` names the job a
process belongs to, ``ports`` derives its rendezvous port, ``threads`` its share of the cores: all
pure functions of the variables, used by the rendezvous (docs/schedulers.md). ``ddpkit.env.detect``
tries them in order. This file imports nothing, so loading one reader never loads the others.
"""
from __future__ import annotations

__all__: list[str] = []
