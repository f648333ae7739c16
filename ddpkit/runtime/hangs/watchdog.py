"""The watchdog: one daemon thread per rank that notices a stalled collective and runs the inquiry.

Every tick it marks finished async collectives, answers any inquiry another rank opened, and opens
one itself when its oldest outstanding collective is older than ``stall_timeout`` (again only after
another ``stall_timeout``). A report is printed when the picture changes, unless this rank got on
while the answers came in (the slow rank arrived: the picture is past); a certain deadlock prints it
and ends the process with ``HANG_EXIT_CODE``, since the main thread is stuck where it cannot be reached.
A collective that raised (a peer went away) asks at once (``inquire_now``): the report is printed and
the error is raised as under torch, for the script to catch, with its ``finally:`` blocks and exit
handlers run.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from ddpkit.errors import rank_prefix
from ddpkit.runtime.hangs.callsite import describe_error, format_site, handled_error, thread_site
from ddpkit.runtime.hangs.inquiry import Inquiry
from ddpkit.runtime.hangs.recorder import Recorder
from ddpkit.runtime.hangs.report import HANDLED, build_report
from ddpkit.runtime.hangs.settings import CONSEQUENCE_FILE_VARIABLE, HANG_EXIT_CODE
from ddpkit.runtime.quick_exit import quick_exit
from ddpkit.runtime.store_client import launcher_hosts_store

__all__ = ["Watchdog", "HANG_EXIT_CODE", "CONSEQUENCE_FILE_VARIABLE", "ANSWER_SECONDS", "snapshot",
           "peer_gone_error"]

RAISE_GRACE = 5.0
"""After a certain verdict, how long a collective of this rank may take to raise before the watchdog
ends the process: the time for a peer's exit to close its connections."""

ANSWER_SECONDS = 5.0
"""How long the reporting rank waits for the others' answers; a rank that exited says so at once."""


# Phrases of a collective that failed because a peer went away (Gloo's; NCCL's come as DistBackendError)
_PEER_GONE = ("Connection closed", "Connection reset", "Broken pipe", "Read error", "Write error", "Timed out")


def peer_gone_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure because a peer went away: a consequence."""
    backend_error = getattr(sys.modules.get("torch.distributed"), "DistBackendError", ())
    return isinstance(error, backend_error) or (
        isinstance(error, RuntimeError) and any(p in str(error) for p in _PEER_GONE))


def cause_being_handled(main_thread: int | None) -> BaseException | None:
    """The exception the main thread is handling, past collectives' failures (the consequences of a
    peer's exit, which the report explains): for a ``finally:`` block's collective that failed when
    a peer ended, the exception that block was handling, which the failure carries as its context."""
    error, seen = handled_error(main_thread), set()
    while error is not None and id(error) not in seen and peer_gone_error(error):
        seen.add(id(error))
        error = error.__context__
    return None if error is None or id(error) in seen else error


def snapshot(recorder: Recorder, rank: int, main_thread: int | None, where: str | None = None,
             dead_threads: list[str] | None = None) -> dict[str, Any]:
    """This rank's state as published: its groups' outstanding and recent collectives, where its
    main thread is (what matters when it waits in no collective) unless ``where`` says, the
    exception it is handling, and its threads that died of an exception."""
    recorder.poll_works()
    now = time.monotonic()
    frame = sys._current_frames().get(main_thread) if main_thread is not None and where is None else None
    user, top = thread_site(frame)
    handling = cause_being_handled(main_thread)
    return {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
            "where": where or (format_site(user) if user else None), "top": format_site(top) if top else None,
            "handling": None if handling is None else describe_error(handling),
            "dead_threads": list(dead_threads or ()), "p2p": recorder.p2p.call_of(main_thread),
            "groups": [log.snapshot(now) for log in recorder.groups()]}


class Watchdog(threading.Thread):
    """See the module docstring; ``stop()`` ends it, ``inquire_now()`` serves a failed collective."""

    def __init__(self, recorder: Recorder, inquiry: Inquiry, stall_timeout: float, rank: int) -> None:
        super().__init__(name=f"ddpkit-hang-watchdog-rank{rank}", daemon=True)
        self.recorder, self.inquiry, self.stall_timeout, self.rank = recorder, inquiry, stall_timeout, rank
        self.poll = min(1.0, max(0.1, stall_timeout / 20))
        self.main_thread = threading.main_thread().ident
        # the rendezvous store lives in this process (rank 0, unless torchrun or ddpkit run hosts it):
        # after a certain verdict it leaves last, so that the others' last store calls find it
        self.hosts_store = rank == 0 and not launcher_hosts_store(os.environ)
        self._stop_event = threading.Event()
        self._wanted = threading.Event()   # a collective failed: inquire at once
        self._served = threading.Event()
        self._answered = 0
        self._last_inquiry = -float("inf")
        self._last_picture: str | None = None
        self._warned = False
        self.where: str | None = None  # what the main thread is doing, when a frame would not say
        self.dead_threads: list[str] = []  # this rank's threads that ended with an exception (HangWatch)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2 * ANSWER_SECONDS)

    def inquire_now(self, seconds: float) -> None:
        """Called by a thread whose collective raised: inquire at once and wait for the report; the
        caller then re-raises its error, even after a certain verdict (that thread is not stuck)."""
        if not self.is_alive():
            return
        self._served.clear()
        self._wanted.set()
        self._served.wait(seconds)

    def run(self) -> None:
        while not self._stop_event.wait(0 if self._wanted.is_set() else self.poll):
            try:
                self._tick()
            except (RuntimeError, OSError) as e:  # the store's errors: the job is over or ending
                self._store_lost(e)
            except Exception as e:  # noqa: BLE001 - a report that cannot be built must not end the job
                self._warn_once(f"the hang watchdog failed ({type(e).__name__}: {e}); no hang report")
            finally:
                if self._wanted.is_set() and not self._stop_event.is_set():
                    self._wanted.clear()
                    self._served.set()

    def _tick(self) -> None:
        self.recorder.poll_works()
        n = self.inquiry.current()
        if n > self._answered:
            self._take_part(n)
        elif self._wanted.is_set() or self._stalled():
            self._take_part(self.inquiry.open(self._answered))

    def _stalled(self) -> bool:
        oldest = self.recorder.oldest_outstanding()  # and a blocking recv or send, which it times
        starts = (None if oldest is None else oldest.start, self.recorder.p2p.oldest())
        since = min([t for t in starts if t is not None], default=None)
        now = time.monotonic()
        return (since is not None and now - since >= self.stall_timeout
                and now - self._last_inquiry >= self.stall_timeout)

    def _take_part(self, n: int) -> None:
        self._answered, self._last_inquiry = n, time.monotonic()
        answered_at = self._progress()
        leads = self.inquiry.answer(n, snapshot(self.recorder, self.rank, self.main_thread, self.where,
                                                self.dead_threads))
        report = None if leads else self.inquiry.wait_report(n, ANSWER_SECONDS + 3)
        if report is None:
            answers, missing = self.inquiry.collect(n, ANSWER_SECONDS)
            report = build_report(answers, missing, stall_timeout=self.stall_timeout,
                                  answer_seconds=ANSWER_SECONDS, seen_by=self.rank, exit_code=HANG_EXIT_CODE)
            report["readers"] = len(answers) - 1
            if leads:
                self.inquiry.publish_report(n, report)
        if not leads:
            self.inquiry.mark_read(n)
        if report["certain"] or not self._got_on(*answered_at):
            self._show(n, report)
        # else this rank got on while the answers came in (a slow rank arrived): the picture is past

    def _progress(self) -> tuple[Any, tuple[int, ...]]:
        """This rank's oldest outstanding collective, and each group's count of collectives."""
        self.recorder.poll_works()
        return self.recorder.oldest_outstanding(), self._counts()

    def _counts(self) -> tuple[int, ...]:
        return tuple(log.seq for log in self.recorder.groups())

    def _got_on(self, waited: Any, counts: tuple[int, ...]) -> bool:
        """Since ``_progress()`` gave (``waited``, ``counts``): the collective this rank waited in has
        ended, or, where it waited in none (busy), it has called one. Another group's progress while
        that collective stays stuck is not this rank getting on."""
        if waited is None:
            return self._counts() != counts
        self.recorder.poll_works()  # an async collective's end is marked here
        return waited.end is not None

    def _show(self, n: int, report: dict[str, Any]) -> None:
        if report["picture"] != self._last_picture or report["certain"]:
            self._last_picture = report["picture"]
            # ddpkit run prefixes each line with its rank already; other launchers mix the ranks' lines
            prefix = rank_prefix(self.rank)
            sys.stderr.write(prefix + report["text"].replace("\n", "\n" + prefix) + "\n")
            sys.stderr.flush()
        if report["certain"]:
            sys.stdout.flush()
            try:
                # every rank, not only the one that wrote the report: the rank that hosts the store (rank 0
                # under SLURM or MPI) must not take it away before the others have read
                self.inquiry.wait_read(n, report.get("readers", 0), ANSWER_SECONDS)
            except (RuntimeError, OSError):  # the host read it and left first: the report is said
                quick_exit(self._show_handled_error())
            # a peer that went away by itself closes its connections, and a collective waiting on it
            # raises a moment later: that error goes on to the script, as under torch (Note [Hang reports])
            if report.get("peer_gone") and (self._wanted.is_set() or self._wanted.wait(RAISE_GRACE)):
                return
            self._end_in_deadlock(n, report.get("readers", 0))

    def _end_in_deadlock(self, n: int, readers: int) -> None:
        """End the process; first say so, so that a peer whose collective fails because of this exit
        does not take it for a failure of its own making (it then ends too). The store's host waits
        for the others' last words (``readers`` of report ``n``): a store call that finds it gone makes
        torch print a C++ trace."""
        oldest = self.recorder.oldest_outstanding()
        where = "no collective" if oldest is None else oldest.label()
        try:
            self.inquiry.last_word({"how": "hang", "code": HANG_EXIT_CODE, "where": where,
                                    "groups": [log.snapshot(0.0) for log in self.recorder.groups()]})
            if self.hosts_store:
                self.inquiry.wait_left(n, readers, ANSWER_SECONDS)
            else:
                self.inquiry.mark_left(n)
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            pass
        quick_exit(self._show_handled_error())

    def _show_handled_error(self) -> int:
        """The exit code: ``HANG_EXIT_CODE``, or 1 where the main thread was handling an exception
        (its ``finally:`` block's collective deadlocked): that exception, the cause, is printed first,
        as it would have been, and the launcher's summary leads with it."""
        error = cause_being_handled(self.main_thread)
        if error is None:
            return HANG_EXIT_CODE
        prefix = rank_prefix(self.rank)
        text = (f"{HANDLED} (exit code 1, as for an uncaught exception):\n"
                + "".join(traceback.format_exception(error)).rstrip("\n"))
        sys.stderr.write(prefix + text.replace("\n", "\n" + prefix) + "\n")
        sys.stderr.flush()
        return 1

    def _store_lost(self, error: Exception) -> None:
        """Without the store there is no inquiry: at the end of a job, when the rank that hosts it has
        exited, that is normal; but a rank that is stalled too says what it knows and ends."""
        if not (self._wanted.is_set() or self._stalled()):
            return
        oldest = self.recorder.oldest_outstanding() or self.recorder.latest_failed()
        where = "a collective" if oldest is None else oldest.label()
        first = str(error).splitlines()[0] if str(error) else ""
        sys.stderr.write(f"{rank_prefix(self.rank)}ddpkit: this rank waits in {where}, and the rendezvous store "
                         f"is unreachable ({type(error).__name__}: {first}): the launcher or the rank hosting "
                         f"the store has exited. A certain deadlock: ending with exit code {HANG_EXIT_CODE}.\n")
        sys.stderr.flush()
        quick_exit(HANG_EXIT_CODE)

    def _warn_once(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            sys.stderr.write(f"{rank_prefix(self.rank)}ddpkit: {text}\n")
