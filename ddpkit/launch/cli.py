"""``ddpkit run`` entry point: parse the flags, run the job, turn setup errors into one clear line."""
from __future__ import annotations

import os
import sys

from ddpkit.launch.config import parse_args

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``ddpkit run [flags] SCRIPT [ARGS...]``; returns the exit code (2 for bad flags).

    Makes this process a child subreaper, so it should be the launcher process itself (the
    ``ddpkit`` command or ``python -m ddpkit run``), not a long-lived host process.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = parse_args(argv)
    except ValueError as e:
        print(f"ddpkit run: error: {e}", file=sys.stderr)
        return 2
    # keep c10d's C++ connection-retry chatter out of the launcher's own output; workers get the
    # user's environment unchanged
    environ = dict(os.environ)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

    from ddpkit.launch.signals import become_subreaper
    from ddpkit.launch.supervisor import run

    become_subreaper()
    return run(config, environ)
