"""Worker output: prefixed with the rank, never two ranks inside one line; per-rank files; tails.

Each worker's stdout and stderr are pipes read by one thread each, or, where both go to one place
(the launcher's two streams are one terminal or file, and ``--redirects``/``--tee`` treat them
alike), one pipe for both: the worker's writes then stay in the order it made them, as on torchrun's
shared terminal, where two pipes read by two threads lost it (the last prints before a crash came
after its traceback). Complete lines are written to the
launcher's stream in one locked write, so ``[rank0]: ...`` and ``[rank1]: ...`` never mix inside a
line. A line still being written is shown too, so progress bars move: when it ends in ``\\r``, when
the worker wrote nothing more for ``IDLE_FLUSH`` seconds, or once it is ``MAX_PARTIAL`` bytes long.
Such an open line belongs to its rank until it ends; anyone else who writes first ends it with a
newline, and the rest of it comes later on a line of its own, prefixed again. The last lines of each
stderr are kept for the failure summary, and with ``--log-dir`` the worker's output also goes,
unchanged, to ``DIR/<run id>_<random>/attempt_<k>/rank_<r>.log``: a directory per run, as torchrun
makes, so that a run reusing DIR never mixes its attempts with an earlier run's. (With two pipes the
file keeps each stream's order, not the order between them.)
"""
from __future__ import annotations

import contextlib
import os
import re
import select
import sys
import tempfile
import threading
from collections import deque
from typing import IO, BinaryIO

__all__ = ["OutputPump", "TAIL_LINES", "IDLE_FLUSH", "MAX_PARTIAL", "log_path", "run_log_dir", "say",
           "one_pipe"]

TAIL_LINES = 200
IDLE_FLUSH = 0.1  # seconds: a partial line shows once the worker paused this long
MAX_PARTIAL = 64 * 1024  # bytes: a line without end is shown in pieces of at most this size

_SEPARATOR = re.compile(rb"(\r\n|\n|\r)")
_NEWLINES = (b"\n", b"\r\n")


def run_log_dir(log_dir: str, run_id: str) -> str:
    """A new directory in ``--log-dir`` for this run's files, named by its run id (torchrun's scheme)."""
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:64] or "run"
    return tempfile.mkdtemp(prefix=f"{prefix}_", dir=log_dir)


def log_path(log_dir: str, attempt: int, rank: int) -> str:
    return os.path.join(log_dir, f"attempt_{attempt}", f"rank_{rank}.log")


def error_file_path(base: str, attempt: int, rank: int, suffix: str = "error.json") -> str:
    """A fresh TORCHELASTIC_ERROR_FILE for the worker (its directory made, an old file removed);
    with another ``suffix``, another of the worker's files there."""
    path = os.path.join(base, f"attempt_{attempt}", f"rank_{rank}.{suffix}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)  # left by an earlier job in the same --log-dir: not this worker's error
    return path


def one_pipe(shown: tuple[bool, bool]) -> bool:
    """Whether a worker's stdout and stderr can share one pipe: both are shown on the console or
    neither is, and where shown, the launcher's stdout and stderr are the same terminal or file."""
    if shown[0] != shown[1]:
        return False
    if not shown[0]:
        return True
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor
        return False
    return (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)


class _Console:
    """The launcher's stdout and stderr, shared by every pump, and the one line left open on them.

    One per process on purpose: the launcher has one terminal, whatever number of pumps write to it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: object | None = None  # who has an unterminated line on the console
        self._owner_stream: IO[str] | None = None
        self._after_cr = False  # the owner's line was just returned to its start with \r
        self._cut: object | None = None  # whose open line someone else ended last

    def write(self, owner: object, stream: IO[str], prefix: bytes,
              pieces: list[tuple[bytes, bytes]]) -> None:
        """Write ``(text, separator)`` pieces; separator b"" leaves the line open for ``owner``."""
        out = bytearray()
        with self._lock:
            if self._owner is not None and self._owner is not owner:
                _write(self._owner_stream, b"\n")  # end the other's open line: no two in one line
                self._owner, self._cut = None, self._owner
            for text, sep in pieces:
                if self._cut is owner:
                    self._cut = None
                    if not text and sep in _NEWLINES:
                        continue  # the end of our line that was ended for us already
                mine = self._owner is owner
                if mine and not self._after_cr:
                    out += text + sep  # the rest of our open line
                elif text or (sep in _NEWLINES and not mine):
                    out += prefix + text + sep  # a new line, or a new start after "\r"
                elif mine:
                    out += sep  # after "\r", a bare "\n" keeps the progress line as it is
                if sep in _NEWLINES:
                    self._owner = None
                elif text or mine:
                    self._after_cr = sep == b"\r" or (mine and self._after_cr and not text)
                    self._owner, self._owner_stream = owner, stream
            _write(stream, bytes(out))


_console = _Console()


def _write(stream: IO[str] | None, data: bytes) -> None:
    if stream is None or not data:
        return
    try:
        binary: BinaryIO | None = getattr(stream, "buffer", None)
        if binary is not None:
            binary.write(data)
            binary.flush()
        else:  # a text-only stream (e.g. one replaced by a test harness)
            stream.write(data.decode(errors="replace"))
            stream.flush()
    except (OSError, ValueError):
        pass  # the launcher's own output went away (closed terminal): keep draining


def say(text: str) -> None:
    """The launcher's own message on stderr, whole, on a line of its own."""
    _console.write(say, sys.stderr, b"", [(text.rstrip("\n").encode(), b"\n")])


class OutputPump:
    """Copy one worker's stdout and stderr to the launcher's, on two daemon threads; ``stderr`` None:
    the worker's stderr shares the ``stdout`` pipe, copied on one thread (see ``one_pipe``)."""

    def __init__(self, rank: int, stdout: BinaryIO, stderr: BinaryIO | None, log_file: str | None = None,
                 shown: tuple[bool, bool] = (True, True)):
        self.rank = rank
        self._prefix = f"[rank{rank}]: ".encode()
        self._tag = self._prefix[:-1]  # "[rank1]:"
        self._tail: deque[bytes] = deque(maxlen=TAIL_LINES)
        self._line = b""  # stderr's current, unfinished line, for the tail
        self._file: BinaryIO | None = None
        self._file_lock = threading.Lock()
        if log_file is not None:
            os.makedirs(os.path.dirname(log_file), exist_ok=True)
            self._file = open(log_file, "ab")  # noqa: SIM115 - closed by join()
        self.tail_of = "stderr" if stderr is not None else "output"  # what stderr_tail() holds
        pipes = [(stdout, sys.stdout if shown[0] else None, stderr is None, "stdout")]
        if stderr is not None:
            pipes.append((stderr, sys.stderr if shown[1] else None, True, "stderr"))
        self._threads = [threading.Thread(target=self._pump, args=(pipe, console, keep_tail),
                                          name=f"rank{rank}-{name}", daemon=True)
                         for pipe, console, keep_tail, name in pipes]
        for thread in self._threads:
            thread.start()

    def _pump(self, pipe: BinaryIO, console: IO[str] | None, keep_tail: bool) -> None:
        owner = object()  # this pipe: its open line is its own, not the other pipe's
        fd, pending, at_start = pipe.fileno(), b"", True
        try:
            while True:
                if pending and not select.select([fd], [], [], IDLE_FLUSH)[0]:
                    at_start = self._forward(owner, console, keep_tail, [(pending, b"")], at_start)
                    pending = b""
                    continue
                data = os.read(fd, 65536)
                if not data:
                    break
                parts = _SEPARATOR.split(pending + data)
                pending = parts.pop()
                pieces = list(zip(parts[::2], parts[1::2]))
                if len(pending) >= MAX_PARTIAL:
                    pieces.append((pending, b""))
                    pending = b""
                if pieces:
                    at_start = self._forward(owner, console, keep_tail, pieces, at_start)
        except (OSError, ValueError):
            pass  # the pipe was closed under us at teardown
        finally:
            if pending:  # the last line of a worker that died mid-print
                self._forward(owner, console, keep_tail, [(pending, b"\n")], at_start)
            pipe.close()

    def _forward(self, owner: object, console: IO[str] | None, keep_tail: bool,
                 pieces: list[tuple[bytes, bytes]], at_start: bool) -> bool:
        """Show ``pieces`` on the console (None: filtered out), log and tail them; returns whether a
        line start follows."""
        cleaned = []
        for text, sep in pieces:
            # torch's excepthook already tags traceback lines "[rank1]: ", and its C++ log lines
            # "[rank1]:W1129 ..." (once a process group exists); do not tag them twice
            if at_start and text.startswith(self._tag):
                text = text[len(self._tag):]
                if text.startswith(b" "):
                    text = text[1:]
            cleaned.append((text, sep))
            at_start = sep != b""
            if keep_tail:
                self._keep(text, sep)
        if console is not None:
            _console.write(owner, console, self._prefix, cleaned)
        if self._file is not None:
            with self._file_lock:
                self._file.write(b"".join(text + sep for text, sep in cleaned))
                self._file.flush()
        return at_start

    def _keep(self, text: bytes, sep: bytes) -> None:
        # a "\r" starts the line over, as on a terminal: the tail keeps what one would see
        if text:
            self._line = text if self._line.endswith(b"\r") else self._line + text
        if sep in _NEWLINES:
            self._tail.append(self._line.rstrip(b"\r"))
            self._line = b""
        elif sep:
            self._line += sep

    def join(self, timeout: float) -> bool:
        """Wait until both pipes reached end-of-file; returns False if one is still open."""
        for thread in self._threads:
            thread.join(timeout)
        done = not any(thread.is_alive() for thread in self._threads)
        if self._file is not None and done:
            self._file.close()
        return done

    def stderr_tail(self) -> list[str]:
        """The last ``TAIL_LINES`` lines the worker wrote to stderr (to either stream, where they share
        a pipe: ``tail_of`` says which), without the rank prefix."""
        lines = [*self._tail, self._line.rstrip(b"\r")] if self._line.strip() else list(self._tail)
        return [line.decode(errors="replace") for line in lines]
