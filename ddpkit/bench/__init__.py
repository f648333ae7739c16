"""``ddpkit bench``: collective bandwidth and DDP step time (ddpkit vs torch vs the floor).

``ddpkit.bench.cli.main(argv)`` is the command; the tables live one per module: ``collectives``,
``ddp_step``, ``buckets`` (bucket cap and comm hooks) and ``memory``; ``report`` renders them and
``plot`` (optional, matplotlib) draws them.
"""
from __future__ import annotations

from ddpkit.bench.collectives import alg_bandwidth, bus_bandwidth

__all__ = ["alg_bandwidth", "bus_bandwidth", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``ddpkit bench`` with ``argv``; returns the exit code."""
    from ddpkit.bench.cli import main as cli_main

    return cli_main(argv)
