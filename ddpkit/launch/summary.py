"""What the launcher says when a job ends: which rank failed, how, and the end of its stderr.

torchrun's answer to a failed worker is a ``ChildFailedError`` whose traceback stays empty unless the
script was decorated with ``@record``. Here the launcher itself keeps the last lines of every worker's
stderr, so the failing rank's own Python traceback is in the summary, with nothing asked of the script.
"""
from __future__ import annotations

import signal
import socket

from ddpkit.launch.workers import Worker
from ddpkit.runtime.hangs.report import HANDLED as REPORT_HANDLED
from ddpkit.runtime.hangs.report import HEADER as REPORT_HEADER
from ddpkit.runtime.hangs.report import RULE as REPORT_RULE
from ddpkit.runtime.hangs.settings import HANG_EXIT_CODE

__all__ = ["describe_exit", "failure_summary", "remote_summary", "failure_info", "traceback_tail"]

_RULE = "=" * 78
_GLOO_SIZE_MISMATCH = "Received data size doesn't match expected size"  # gloo's enforce, then abort()
_MAX_TAIL = 120
_TRACEBACK_STARTS = ("Traceback (most recent call last)", "  + Exception Group Traceback (most recent")
_CHAIN_LINES = ("The above exception was the direct cause of the following exception:",
                "During handling of the above exception, another exception occurred:")
_HINTS = {
    signal.SIGKILL: "possibly out of memory: the kernel's OOM killer sends SIGKILL (check `dmesg` "
                    "or the job's memory limit)",
    signal.SIGSEGV: "a crash in native code (a C/C++/CUDA extension)",
    signal.SIGBUS: "often a full /dev/shm (shared memory used by DataLoader workers)",
    signal.SIGABRT: "native code called abort()",
}


def describe_exit(returncode: int, report_below: bool = False) -> str:
    """``exit code 1``, or for -9 ``killed by SIGKILL (signal 9, exit code 137): possibly out of memory ...``.

    ``returncode`` is Popen's: negative when a signal ended the process. A process that exits with
    code 137 by itself (a shell whose child was killed, ``sys.exit(137)``) was not killed by a signal.
    ``report_below``: the summary shows this process's last lines, where its hang report is.
    """
    if returncode == HANG_EXIT_CODE:
        where = "its hang report is below" if report_below else "its output holds its hang report"
        return f"exit code {returncode}: ddpkit found a certain deadlock ({where})"
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"killed by signal {-returncode} (exit code {128 - returncode})"
    text = f"killed by {sig.name} (signal {int(sig)}, exit code {128 + int(sig)})"
    hint = _HINTS.get(sig)
    return f"{text}: {hint}" if hint else text


def traceback_tail(lines: list[str]) -> list[str]:
    """From the last Python traceback on (if one is in ``lines``), else the last lines.

    A chained exception (``raise ... from e``, or one raised while handling another) prints its
    causes first: they belong to the last traceback, so the root cause is shown too.
    """
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK_STARTS)]
    if not starts:
        return lines[-_MAX_TAIL:]
    first = len(starts) - 1
    while first > 0 and _chained(lines[starts[first - 1]:starts[first]]):
        first -= 1
    return _head_and_tail(lines[_hang_report_before(lines, starts[first]):])


def _head_and_tail(lines: list[str]) -> list[str]:
    """At most ``_MAX_TAIL`` lines: a long block keeps its start (the hang report's header, the
    traceback's first frames) and its end (the error), with the middle left out and counted."""
    if len(lines) <= _MAX_TAIL:
        return lines
    head = _MAX_TAIL // 3
    tail = _MAX_TAIL - head - 1
    return [*lines[:head], f"... ({len(lines) - head - tail} lines left out) ...", *lines[-tail:]]


def _hang_report_before(lines: list[str], start: int) -> int:
    """Where the hang report printed just before the traceback at ``start`` begins, else ``start``:
    a collective that failed because a peer went away prints the report, then raises, and the
    report is what says why (which rank left, and where)."""
    end = start - 1
    while end >= 0 and not lines[end].strip():
        end -= 1
    if end >= 1 and lines[end].startswith(REPORT_HANDLED):  # the exception a deadlock cut short
        end -= 1
    if end < 1 or lines[end] != REPORT_RULE:
        return start
    for i in range(end - 1, 0, -1):
        if lines[i].startswith(REPORT_HEADER):
            return i - 1 if lines[i - 1] == REPORT_RULE else start
        if lines[i] == REPORT_RULE:  # another ruled block
            return start
    return start


def _chained(group: list[str]) -> bool:
    """Whether a traceback ends by saying that the next one follows from it."""
    text = [line.strip() for line in group if line.strip()]
    return bool(text) and text[-1] in _CHAIN_LINES


def failure_info(worker: Worker, node_rank: int) -> dict:
    """What the other nodes are told about a failure on this one (JSON-able)."""
    return {"node": node_rank, "rank": worker.rank, "pid": worker.pid, "host": socket.gethostname(),
            "code": worker.exit_code, "how": describe_exit(worker.process.returncode or 0)}


def failure_summary(failed: Worker, workers: list[Worker], node_rank: int,
                    log_file: str | None, restart: str | None = None, consequence: bool = False) -> str:
    """The block printed to stderr when a worker on this node failed; ``restart``: the restart that
    follows (``1 of at most 3``), where the job goes on; ``consequence``: the worker said its
    collective failed because a peer went away, and no failure of this node's came before it."""
    place = failed.place
    title = "the job failed" if restart is None else f"attempt failed; restart {restart} follows"
    tail = traceback_tail(failed.pump.stderr_tail())
    report = any(REPORT_HEADER in line for line in tail)  # in the lines shown below
    lines = [_RULE, f"ddpkit run: {title}", _RULE,
             f"rank {failed.rank} (node {node_rank}, local rank {place.local_rank}, pid {failed.pid}, "
             f"host {socket.gethostname()}): {describe_exit(failed.process.returncode or 0, report_below=report)}"]
    if consequence and failed.process.returncode != HANG_EXIT_CODE:
        lines.append("which is a consequence: its collective failed because a rank it waited on went away, and "
                     "no rank on this node failed first; " + ("its hang report below says which rank, and how."
                                                              if report else "the other nodes' output says which."))
    also = [w for w in workers if w.state == "failed" and w is not failed]
    if also:
        lines.append("also failed, before they were stopped: " + ", ".join(
            f"rank {w.rank} (pid {w.pid}, {describe_exit(w.process.returncode or 0)})" for w in also))
    left = [w for w in workers if w.state == "succeeded"]
    if left:  # a rank that leaves while the others still call collectives makes theirs fail
        lines.append("had exited before, with exit code 0: " + ", ".join(f"rank {w.rank} (pid {w.pid})"
                                                                         for w in left))
    stopped = [w for w in workers if w.state == "stopped"]
    if stopped:
        lines.append("stopped because of it: " + ", ".join(f"rank {w.rank} (pid {w.pid})" for w in stopped))
    if any(_GLOO_SIZE_MISMATCH in line for line in tail):
        lines.append("likely cause: the ranks passed tensors of different sizes (or dtypes) to one collective, "
                     "or called different ones there (a collective, or 'with model.join():', on some ranks "
                     "only), and Gloo aborts the process then; compare what each rank calls and passes at the "
                     "line below (DDPKIT_CHECK_COLLECTIVES=1 names every rank's collective and shape before it "
                     "runs).")
    source = failed.pump.tail_of
    if tail:
        lines.append(f"last lines of rank {failed.rank}'s {source}:")
        lines += [f"  {line}" for line in tail]
    else:
        lines.append(f"rank {failed.rank} wrote nothing to stderr." if source == "stderr"
                     else f"rank {failed.rank} wrote no output.")
    if log_file:
        lines.append(f"full output: {log_file}")
    lines.append(_RULE)
    return "\n".join(lines)


def remote_summary(info: dict, workers: list[Worker]) -> str:
    """The lines printed on a node whose workers were stopped because of another node."""
    stopped = ", ".join(f"rank {w.rank}" for w in workers if w.state == "stopped") or "none running"
    if "lost" in info:
        cause = info["lost"]
    elif "signal" in info:
        cause = f"the launcher of node {info['node']} received {info['signal']}"
    else:
        cause = (f"rank {info['rank']} on node {info['node']} (host {info['host']}, pid {info['pid']}) "
                 f"failed: {info['how']}; its launcher prints the details")
    failed = [w for w in workers if w.state == "failed"]
    also = "".join(f"\nddpkit run: failed on this node before it was stopped: rank {w.rank} "
                   f"({describe_exit(w.process.returncode or 0)})" for w in failed)
    return f"ddpkit run: stopping: {cause}.\nddpkit run: stopped on this node: {stopped}.{also}"
