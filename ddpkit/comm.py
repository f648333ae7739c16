"""``ddpkit.comm``: collectives that also work in a world of one (they live in ``ddpkit.runtime.comm``)."""
from __future__ import annotations

from ddpkit.runtime.comm import (
                                 REDUCE_OPS,
                                 all_gather,
                                 all_gather_object,
                                 all_reduce,
                                 barrier,
                                 broadcast,
                                 broadcast_object,
                                 reduce_scatter,
)

__all__ = ["all_reduce", "broadcast", "broadcast_object", "all_gather", "all_gather_object",
           "reduce_scatter", "barrier", "REDUCE_OPS"]
