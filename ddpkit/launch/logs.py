"""Worker output: whole lines, prefixed with the rank, never interleaved mid-line; per-rank files; tails.

Each worker's stdout and stderr are pipes read by one thread each. A line is written to the launcher's
stream in one locked write, so ``[rank0]: ...`` and ``[rank1]: ...`` never mix inside a line. The last
lines of each stderr are kept for the failure summary, and with ``--log-dir`` every line also goes to
``DIR/attempt_<k>/rank_<r>.log``.
"""
from __future__ import annotations

import os
import sys
import threading
from collections import deque
from typing import IO, BinaryIO

__all__ = ["OutputPump", "TAIL_LINES", "log_path", "say"]

TAIL_LINES = 50

# one per process on purpose: the launcher has one stdout and one stderr, shared by every pump
_console_lock = threading.Lock()


def log_path(log_dir: str, attempt: int, rank: int) -> str:
    return os.path.join(log_dir, f"attempt_{attempt}", f"rank_{rank}.log")


def say(text: str) -> None:
    """The launcher's own message on stderr, whole, never inside a worker's line."""
    OutputPump._emit(sys.stderr, (text.rstrip("\n") + "\n").encode())


def _binary(stream: IO[str]) -> BinaryIO | None:
    return getattr(stream, "buffer", None)


class OutputPump:
    """Copy one worker's stdout and stderr to the launcher's, line by line, on two daemon threads."""

    def __init__(self, rank: int, stdout: BinaryIO, stderr: BinaryIO, log_file: str | None = None):
        self.rank = rank
        self._prefix = f"[rank{rank}]: ".encode()
        self._tail: deque[bytes] = deque(maxlen=TAIL_LINES)
        self._file: BinaryIO | None = None
        self._file_lock = threading.Lock()
        if log_file is not None:
            os.makedirs(os.path.dirname(log_file), exist_ok=True)
            self._file = open(log_file, "ab")  # noqa: SIM115 - closed by join()
        self._threads = [
            threading.Thread(target=self._pump, args=(stdout, sys.stdout, False),
                             name=f"rank{rank}-stdout", daemon=True),
            threading.Thread(target=self._pump, args=(stderr, sys.stderr, True),
                             name=f"rank{rank}-stderr", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, pipe: BinaryIO, console: IO[str], keep_tail: bool) -> None:
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # the last line of a worker that died mid-print
                # torch's excepthook already tags traceback lines "[rank1]: "; do not tag them twice
                if line.startswith(self._prefix):
                    line = line[len(self._prefix):]
                if keep_tail:
                    self._tail.append(line)
                self._emit(console, self._prefix + line)
                if self._file is not None:
                    with self._file_lock:
                        self._file.write(line)
                        self._file.flush()
        except (OSError, ValueError):
            pass  # the pipe was closed under us at teardown
        finally:
            pipe.close()

    @staticmethod
    def _emit(console: IO[str], data: bytes) -> None:
        with _console_lock:
            try:
                binary = _binary(console)
                if binary is not None:
                    binary.write(data)
                    binary.flush()
                else:  # a text-only stream (e.g. one replaced by a test harness)
                    console.write(data.decode(errors="replace"))
                    console.flush()
            except (OSError, ValueError):
                pass  # the launcher's own output went away (closed terminal): keep draining

    def join(self, timeout: float) -> bool:
        """Wait until both pipes reached end-of-file; returns False if one is still open."""
        for thread in self._threads:
            thread.join(timeout)
        done = not any(thread.is_alive() for thread in self._threads)
        if self._file is not None and done:
            self._file.close()
        return done

    def stderr_tail(self) -> list[str]:
        """The last ``TAIL_LINES`` lines the worker wrote to stderr, without the rank prefix."""
        return [line.decode(errors="replace").rstrip("\n") for line in list(self._tail)]
