"""A watchdog that kills what is left of the workers if the launcher dies without cleaning up.

A SIGKILLed launcher runs no code. Its workers die by their parent-death signal, but their own children
(DataLoader workers, shell pipelines, servers a script started) would live on as orphans. So the
launcher starts this tiny stdlib-only process, in a session of its own, and tells it each worker's pid
through a pipe. When the pipe closes without a final ``exit`` line, the launcher is gone: the watchdog
SIGKILLs every process still in a worker's session, every process whose environment carries this
launcher's token (``DDPKIT_WATCHDOG_TOKEN``, which the workers and their children inherit), and every
descendant of the workers it recorded (it records them, with their start times, once a second: that
finds a daemon that left the session and cleared its environment, unless it started in the last
second). A recorded pid is killed only if it still has the same start time, never a stranger's.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid

__all__ = ["Watchdog", "kill_sessions", "marked", "TOKEN_VARIABLE"]

TOKEN_VARIABLE = "DDPKIT_WATCHDOG_TOKEN"


class Watchdog:
    """The launcher's side: start the watchdog, report workers, dismiss it on a clean exit."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self.token = uuid.uuid4().hex  # give it to the workers as TOKEN_VARIABLE
        try:
            # -I: the standard library only, nothing from this directory or site-packages
            self._process = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), self.token], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, start_new_session=True, text=True)
        except OSError:
            self._process = None  # not fatal: only a SIGKILLed launcher would need it

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def add(self, pid: int) -> None:
        self._send(f"{pid}\n")

    def remove_on_kill(self, path: str) -> None:
        """A directory of the launcher's own, removed too if the launcher is killed."""
        self._send(f"rmtree {path}\n")

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


_SCAN_EVERY = 1.0  # seconds between two records of the workers' descendants


def _processes() -> dict[int, tuple[int, int, int]]:
    """Every live process (zombies run nothing): pid -> (parent pid, session, start time in clock
    ticks since boot)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid pgrp session ... starttime (22nd)": comm may hold spaces
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[3]), int(fields[19]))
    return table


def _descendants(roots: dict[int, int], table: dict[int, tuple[int, int, int]]) -> dict[int, int]:
    """The processes below ``roots`` (pid -> start time) that are still running, roots included."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = [pid for pid, start in roots.items() if pid in table and table[pid][2] == start]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][2]
            todo += children.get(pid, [])
    return found


def marked(token: str, table: dict[int, tuple[int, int, int]]) -> dict[int, int]:
    """The processes whose environment holds ``TOKEN_VARIABLE=token``: pid -> start time."""
    mark = f"{TOKEN_VARIABLE}={token}".encode()
    found = {}
    for pid, (_, _, start) in table.items():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found[pid] = start
        except OSError:
            continue  # gone, or not ours to read
    return found


def kill_sessions(sessions: set[int], also: dict[int, int] | None = None,
                  token: str | None = None) -> None:
    """SIGKILL every process in these sessions, each of ``also`` (pid -> start time) that is still the
    same process, and those ``marked`` with ``token``, again until none is left (a dying parent may
    fork)."""
    also = dict(also or {})
    for _ in range(10):
        table = _processes()
        doomed = [pid for pid, (_, session, _) in table.items() if session in sessions]
        if token:
            doomed += marked(token, table)
        # a recorded process's children go too: started since the last record, or re-parented
        doomed += _descendants(also, table)
        if not doomed:
            return
        for pid in doomed:
            also[pid] = table[pid][2]
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the launcher's end of the pipe decides
    sessions: set[int] = set()
    recorded: dict[int, int] = {}  # every worker and descendant seen: pid -> start time
    directories: list[str] = []  # the launcher's own, removed after the kill
    pending, next_scan = b"", time.monotonic() + _SCAN_EVERY
    while True:
        if select.select([0], [], [], max(0.0, next_scan - time.monotonic()))[0]:
            data = os.read(0, 4096)
            if not data:
                break  # the launcher is gone
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if line.strip() == b"exit":
                    return
                if line.startswith(b"rmtree "):
                    directories.append(os.fsdecode(line[len(b"rmtree "):]))
                if line.strip().isdigit():
                    sessions.add(int(line))
                    recorded[int(line)] = _start_time(int(line))
        if time.monotonic() >= next_scan:
            recorded = _descendants(recorded, _processes())  # the gone are forgotten
            next_scan = time.monotonic() + _SCAN_EVERY
    kill_sessions(sessions, recorded, sys.argv[1] if len(sys.argv) > 1 else None)
    for path in directories:
        shutil.rmtree(path, ignore_errors=True)


def _start_time(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


if __name__ == "__main__":
    _main()
