"""``os._exit`` that leaves no ``pymp-*`` directory behind.

A process that used a multiprocessing forkserver (or shared a file descriptor with a child) has a
temporary directory of multiprocessing's own, with a socket in it, which only multiprocessing's
exit handler removes. ``os._exit`` skips that handler: the bench's ranks (which must not finalize
while Gloo still holds work) and a rank the hang watchdog ends left one in ``/tmp`` per process.
"""
from __future__ import annotations

import os
from multiprocessing import util
from typing import NoReturn

__all__ = ["quick_exit", "remove_multiprocessing_tempdir"]


def remove_multiprocessing_tempdir() -> None:
    """Run now multiprocessing's own finalizer of the directory this process made, if it made one.

    Only the process that made the directory holds that finalizer; a child that inherited its name
    holds none (and the finalizer ignores a forked copy of itself), so a parent's directory stays.
    The names are multiprocessing's internals: where they are missing, nothing is removed.
    """
    remove = getattr(util, "_remove_temp_dir", None)
    registry = getattr(util, "_finalizer_registry", None)
    if remove is None or not isinstance(registry, dict):
        return
    for finalizer in list(registry.values()):
        if getattr(finalizer, "_callback", None) is remove:
            finalizer()


def quick_exit(code: int) -> NoReturn:
    """End the process now, as ``os._exit(code)``, without multiprocessing's directory."""
    remove_multiprocessing_tempdir()
    os._exit(code)
