"""The ``ddpkit`` command: dispatches to ``run`` (the launcher) and ``bench`` (benchmarks)."""
from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["main", "console"]

_USAGE = """usage: ddpkit <command> [args...]

commands:
  run     launch a training script on N local processes / several nodes (torchrun's flags)
  bench   collective bandwidth and DDP step time, ddpkit vs torch, on this machine
  env     print what ddpkit detects from this process's environment

'ddpkit <command> --help' describes each command; 'ddpkit --version' prints the version."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from ddpkit.launch.cli import main as run_main

        return run_main(rest)
    if command == "bench":
        from ddpkit.bench.cli import main as bench_main

        return bench_main(rest)
    if command == "env":
        return _env(rest)
    if command in ("--version", "version"):
        from ddpkit import __version__

        print(f"ddpkit {__version__}")
        return 0
    print(f"ddpkit: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
    return 2


def console() -> NoReturn:
    """The ``ddpkit`` command and ``python -m ddpkit``: ``main()``, then the exit.

    When ``ddpkit run`` returns, its workers are stopped, their output relayed and its own files
    removed; a normal exit would then spend most of a second finalizing torch (0.8 s on the 2-core
    test machine), for objects that die with the process. The launcher ends at once instead, its
    streams flushed (Note [Launcher start] in docs/design.md).
    """
    code = main()
    if sys.argv[1:2] == ["run"] and "torch" in sys.modules:
        from ddpkit.runtime.quick_exit import quick_exit

        sys.stdout.flush()
        sys.stderr.flush()
        quick_exit(code)
    raise SystemExit(code)


def _env(argv: list[str]) -> int:
    """``ddpkit env``: the detected layout, or the one-line reason the variables are wrong."""
    import os

    from ddpkit.runtime.process_group import planned_env

    if argv:
        print("usage: ddpkit env\n\nprint the DistEnv that ddpkit.init() would return from this "
              "process's environment variables (backend and device included)",
              file=sys.stdout if argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv[0] in ("-h", "--help") else 2
    try:
        print(planned_env(os.environ))
    except ValueError as e:
        print(f"ddpkit env: error: {e}", file=sys.stderr)
        return 1
    return 0
