"""``stall_timeout`` and ``check_collectives``: from ``init()``'s arguments, else the environment; and
what the launcher and its workers agree on (this module imports no torch: ``ddpkit run`` reads it)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ddpkit.errors import explain

__all__ = ["HangSettings", "DEFAULT_STALL_TIMEOUT", "read_settings", "HANG_EXIT_CODE", "CONSEQUENCE_FILE_VARIABLE"]

HANG_EXIT_CODE = 86
"""The exit code of every rank of a job that the watchdog ended in a certain deadlock."""

CONSEQUENCE_FILE_VARIABLE = "DDPKIT_CONSEQUENCE_FILE"
"""Set by ``ddpkit run``: a file a worker creates when its collective failed because a peer went
away, so that the launcher's summary leads with the peer's failure, not this consequence of it."""

DEFAULT_STALL_TIMEOUT = 60.0
"""Seconds a collective may wait before the ranks are asked where they are."""

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class HangSettings:
    stall_timeout: float          # 0: no watchdog
    check_collectives: bool       # strict mode

    @property
    def recording(self) -> bool:
        return self.stall_timeout > 0 or self.check_collectives


def read_settings(stall_timeout: float | None, check_collectives: bool | None,
                  environ: Mapping[str, str]) -> HangSettings:
    """Arguments win over ``DDPKIT_STALL_TIMEOUT`` / ``DDPKIT_CHECK_COLLECTIVES``.

    Raises:
        ValueError: a value that is not a number of seconds >= 0, or not a yes/no, naming it (the
            arguments take a number and a bool, the environment's text only there).
    """
    if stall_timeout is None:
        raw = environ.get("DDPKIT_STALL_TIMEOUT")
        stall = DEFAULT_STALL_TIMEOUT if raw is None or raw.strip() == "" else _seconds(raw, "DDPKIT_STALL_TIMEOUT")
    else:
        if isinstance(stall_timeout, str):  # as init's timeout: a number in code, a string in the environment
            raise ValueError(explain(f"stall_timeout={stall_timeout!r} is a string; pass a number of seconds.",
                                     "e.g. stall_timeout=30; DDPKIT_STALL_TIMEOUT is the place for text."))
        stall = _seconds(stall_timeout, "stall_timeout")
    if check_collectives is None:
        raw = environ.get("DDPKIT_CHECK_COLLECTIVES", "").strip().lower()
        if raw not in _TRUE + _FALSE:
            raise ValueError(explain(f"DDPKIT_CHECK_COLLECTIVES={environ['DDPKIT_CHECK_COLLECTIVES']!r} is "
                                     "not a yes/no value.", "set it to 1 to compare every collective across "
                                     "ranks before it runs, or 0 (the default)."))
        check = raw in _TRUE
    elif not isinstance(check_collectives, str) and check_collectives in (False, True):  # 0 and 1 too
        check = bool(check_collectives)
    else:  # bool("false") is True: only a real yes/no is taken as one
        raise ValueError(explain(f"check_collectives={check_collectives!r} is not True, False or None.",
                                 "pass a bool; DDPKIT_CHECK_COLLECTIVES=1 is the environment's spelling."))
    return HangSettings(stall, check)


def _seconds(value: object, name: str) -> float:
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(explain(f"{name}={value!r} is not a number of seconds >= 0.",
                                 f"the default is {DEFAULT_STALL_TIMEOUT:g}; 0 turns the hang watchdog off."))
    return seconds
