"""torch's keyword names for arguments ddpkit names after what they hold, not after GPUs.

torch's primitives say ``target_gpus=`` and ``network=``; ddpkit's take CPU devices too, so their
parameters are ``target_devices`` and ``module``. Code written for torch calls them by keyword, and
switching the import must not break it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

__all__ = ["torch_keywords"]

F = TypeVar("F", bound=Callable[..., Any])


def torch_keywords(**aliases: str) -> Callable[[F], F]:
    """Let ``fn`` also take torch's keyword ``old=`` for its parameter ``aliases[old]``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for torch_name, ours in aliases.items():
                if torch_name in kwargs:
                    if ours in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {ours}= and torch's name for it, "
                                        f"{torch_name}=; pass one.")
                    kwargs[ours] = kwargs.pop(torch_name)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
