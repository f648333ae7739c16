"""What ddpkit's DDP tells the installed hang recorder after it waits for its own collectives.

DDP's bucket all-reduces are async: the recorder's wrapper returns before they end, and their
``Work.wait()`` runs in DDP's code. There DDP lets the recorder drop the Works it waited for (they
hold gradients), and hands it a wait's failure (a peer gone), which the wrapper never sees.
"""
from __future__ import annotations

import time
from typing import Any

from ddpkit.runtime.hangs.recorder import INSTALLED

__all__ = ["release_finished", "wait_failed"]


def release_finished(group: Any = None) -> None:
    """Let go now of ``group``'s completed async Works, which hold their tensors.

    Called by ddpkit's DDP once it has waited for its collectives. Left to the next collective, a
    gradient reduced in place stayed alive into the next backward, past ``zero_grad(set_to_none=True)``,
    and the new one was allocated beside it; on the embedding bench model (a 16 MiB gradient) the heap
    then went back and forth to the kernel, 4,000 page faults a step and 1.04-1.17x torch's step time
    in some launches. See Note [Gradient memory] in docs/design.md.
    """
    for recorder in INSTALLED:
        log = recorder.logs.get(group)
        if log is not None and log.pending:
            log.settle(time.monotonic())


def wait_failed(error: BaseException) -> None:
    """A DDP's ``Work.wait()`` raised, past the wrapper: pin ``error`` on the latest async collective
    and hand it to the ``failed`` hook, which asks the other ranks at once where a peer went away,
    so that the report comes before the error leaves ``backward()`` (not only at exit)."""
    for recorder in INSTALLED:
        recorder.blame_async(error)
        record = recorder.latest_failed()
        if recorder.failed is not None and record is not None:
            recorder.failed(record, error)
