"""``ddpkit bench``'s values checked before any rank starts: a bad one is a usage error (exit code 2)
naming the flag, not a traceback after minutes of measuring, nor a file that cannot be written once
the figures are in."""
from __future__ import annotations

import argparse
import os
from typing import Sequence

__all__ = ["check_values"]

_PLOTTED = ("collectives", "ddp", "memory")  # the tables plot.py draws


def check_values(parser: argparse.ArgumentParser, args: argparse.Namespace, tables: Sequence[str]) -> None:
    """Raise SystemExit(2) through ``parser`` on the first bad value; ``tables`` by their full names."""
    for flag, value in (("--threads", args.threads), ("--max-size", args.max_size)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}.")
    if not args.timeout > 0:
        parser.error(f"--timeout must be a number of seconds > 0, got {args.timeout:g}.")
    if args.backend is not None:
        _check_backend(parser, args.backend)
    for flag, path in (("--json", args.json_path), ("--plot", args.plot_path)):
        if path:
            _check_writable(parser, flag, path)
    if args.plot_path:
        if not set(tables) & set(_PLOTTED):
            parser.error(f"--plot draws the {', '.join(_PLOTTED)} tables, and --tables {args.tables!r} "
                         "has none of them.")
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        suffix = os.path.splitext(args.plot_path)[1].lstrip(".").lower()
        if suffix and suffix not in formats:  # none: matplotlib writes a .png
            parser.error(f"--plot {args.plot_path!r}: matplotlib writes {', '.join(sorted(formats))}, "
                         "named by the file's extension (e.g. bench.png).")


def _check_backend(parser: argparse.ArgumentParser, backend: str) -> None:
    """``init()``'s own check of a backend's name and build; NCCL's need of CUDA is said by the bench."""
    from ddpkit.runtime.init_settings import choose_backend

    if backend != "nccl":
        try:
            choose_backend(backend, "--backend")
        except ValueError as e:
            parser.error(str(e))


def _check_writable(parser: argparse.ArgumentParser, flag: str, path: str) -> None:
    """The file can be created where it is named: its directory exists and takes files, and it is not
    a directory itself."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path!r} is a directory; name a file in it.")
    if not os.path.isdir(directory):
        parser.error(f"{flag} {path!r}: the directory {directory!r} does not exist.")
    if not os.access(directory, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path!r}: the directory {directory!r} is not writable.")
