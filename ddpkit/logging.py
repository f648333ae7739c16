"""Output from the main process only: ``ddpkit.print``, ``get_logger`` and ``progress``.

With N ranks running the same script, every ``print`` appears N times. These helpers speak on rank 0
(the main process) and stay silent elsewhere, so a script's output reads the same under ``python``,
``ddpkit run`` and ``torchrun``. The rank is looked up at call time, so they work before and after
``ddpkit.init()``.
"""
from __future__ import annotations

import builtins
import logging
import os
import sys
import time
from typing import Any, Generic, Iterable, Iterator, TextIO, TypeVar

__all__ = ["print", "get_logger", "progress", "Progress", "TERMINAL_VARIABLE"]

TERMINAL_VARIABLE = "DDPKIT_TERMINAL"
"""Set to 1 by ``ddpkit run`` for workers whose stderr it relays to a terminal."""

T = TypeVar("T")


def _rank() -> int:
    """This process's rank, read at each call (``init()`` may come later). Imported here, not with
    the module: ``ddpkit run`` reads ``TERMINAL_VARIABLE`` before it imports torch."""
    from ddpkit.runtime.process_group import get_rank

    return get_rank()


def print(*args: Any, all_ranks: bool = False, **kwargs: Any) -> None:  # noqa: A001 - ddpkit.print by design
    """``print`` on the main process only; ``all_ranks=True`` prints everywhere, tagged ``[rank r]``.

    Other keyword arguments (``sep``, ``end``, ``file``) are the builtin's. Output is flushed by
    default, because a launcher usually reads a worker's stdout through a pipe, where Python buffers.
    """
    kwargs.setdefault("flush", True)
    rank = _rank()
    if all_ranks:
        builtins.print(f"[rank {rank}]", *args, **kwargs)
    elif rank == 0:
        builtins.print(*args, **kwargs)


class _MainProcessFilter(logging.Filter):
    """Drop records on ranks other than 0; the rank is read per record, so init() may come later."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _rank() == 0


def get_logger(name: str = "ddpkit", level: int | str = logging.INFO) -> logging.Logger:
    """A logger whose records are emitted on the main process only.

    The first call for ``name`` gives it a stderr handler (``time level name: message``) and stops
    propagation, so a record is not printed twice when the root logger is configured too. Handlers
    added later by the caller see the same main-process-only records.
    """
    logger = logging.getLogger(name)
    logger.setLevel(level)
    if not any(isinstance(f, _MainProcessFilter) for f in logger.filters):
        logger.addFilter(_MainProcessFilter())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    return logger


class Progress(Generic[T]):
    """Iterate over ``iterable`` and show ``desc  12/100  12% 34.5 it/s`` on one terminal line.

    Shown only on the main process and only when ``file`` is a terminal: under a launcher, in CI or
    piped to a log file, carriage-return redraws would just be noise, so it stays quiet there.
    The line is redrawn at most every ``interval`` seconds, so the loop pays almost nothing for it.
    """

    def __init__(self, iterable: Iterable[T], total: int | None = None, desc: str = "",
                 file: TextIO | None = None, interval: float = 0.1, disable: bool | None = None):
        self.iterable = iterable
        self.total = total if total is not None else _length(iterable)
        self.desc = desc
        self.file = file if file is not None else sys.stderr
        self.interval = interval
        self._width = 0  # of the line on screen
        if disable is None:
            disable = _rank() != 0 or not _reaches_a_terminal(self.file)
        self.disable = disable

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress display has no known length")
        return self.total

    def __iter__(self) -> Iterator[T]:
        if self.disable:
            yield from self.iterable
            return
        start = last = time.monotonic()
        count = 0
        try:
            for item in self.iterable:
                yield item
                count += 1
                now = time.monotonic()
                if now - last >= self.interval:
                    self._draw(count, now - start)
                    last = now
        finally:
            self._draw(count, time.monotonic() - start)
            self.file.write("\n")
            self.file.flush()

    def _draw(self, count: int, elapsed: float) -> None:
        rate = f"{count / elapsed:.1f} it/s" if elapsed > 0 else ""
        if self.total:
            line = f"{count}/{self.total} {100 * count // self.total:3d}% {rate}"
        else:
            line = f"{count} {rate}"
        text = f"{self.desc}: {line}" if self.desc else line
        # pad over what the previous, longer line left on screen ("9.9 it/ss")
        self.file.write(f"\r{text}{' ' * (self._width - len(text))}")
        self._width = len(text)
        self.file.flush()


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "",
             file: TextIO | None = None, disable: bool | None = None) -> Progress[T]:
    """Wrap a loop in a progress line on rank 0 (quiet elsewhere): ``for b in progress(loader): ...``."""
    return Progress(iterable, total=total, desc=desc, file=file, disable=disable)


def _length(iterable: Iterable[Any]) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def _reaches_a_terminal(file: TextIO) -> bool:
    """A terminal, or stderr relayed to one by ``ddpkit run`` (which sets DDPKIT_TERMINAL=1)."""
    return _isatty(file) or (file is sys.stderr and os.environ.get(TERMINAL_VARIABLE) == "1")


def _isatty(file: TextIO) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
