"""A watchdog that kills what is left of the workers' sessions if the launcher dies without cleaning up.

A SIGKILLed launcher runs no code. Its workers die by their parent-death signal, but their own children
(DataLoader workers, shell pipelines, servers a script started) would live on as orphans. So the
launcher starts this tiny stdlib-only process, in a session of its own, and tells it each worker's pid
through a pipe. When the pipe closes without a final ``exit`` line, the launcher is gone: the watchdog
SIGKILLs every process still in a worker's session, then exits.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

__all__ = ["Watchdog", "kill_sessions"]


class Watchdog:
    """The launcher's side: start the watchdog, report workers, dismiss it on a clean exit."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        try:
            # -I: the standard library only, nothing from this directory or site-packages
            self._process = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, start_new_session=True, text=True)
        except OSError:
            self._process = None  # not fatal: only a SIGKILLed launcher would need it

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def add(self, pid: int) -> None:
        self._send(f"{pid}\n")

    def close(self) -> None:
        """The launcher cleaned up itself: let the watchdog go without killing anything."""
        if self._process is not None:
            self._send("exit\n")
            try:
                self._process.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._process = None

    def _send(self, line: str) -> None:
        if self._process is not None:
            try:
                self._process.stdin.write(line)  # type: ignore[union-attr]
                self._process.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass


def _session_members(sessions: set[int]) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sessions:
            members.append(int(entry))
    return members


def kill_sessions(sessions: set[int]) -> None:
    """SIGKILL every process in these sessions, again until none is left (a dying parent may fork)."""
    for _ in range(10):
        members = _session_members(sessions)
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the launcher's end of the pipe decides
    sessions: set[int] = set()
    for line in sys.stdin:
        if line.strip() == "exit":
            return
        if line.strip().isdigit():
            sessions.add(int(line))
    kill_sessions(sessions)


if __name__ == "__main__":
    _main()
