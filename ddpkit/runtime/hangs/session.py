"""One process group's hang watch: ``start()`` installs the recorder and the watchdog, ``HangWatch``
ends them (the package's docstring tells the whole story)."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import uuid
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from ddpkit.errors import rank_prefix
from ddpkit.runtime.hangs.callsite import call_site, describe_error, format_site, traceback_site
from ddpkit.runtime.hangs.inquiry import LATEST_KEY, Inquiry
from ddpkit.runtime.hangs.recorder import Record, Recorder
from ddpkit.runtime.hangs.settings import (
    CONSEQUENCE_FILE_VARIABLE,
    DEFAULT_STALL_TIMEOUT,
    HANG_EXIT_CODE,
    HangSettings,
    read_settings,
)
from ddpkit.runtime.hangs.strict import StrictCheck
from ddpkit.runtime.hangs.watchdog import ANSWER_SECONDS, Watchdog, peer_gone_error

__all__ = ["HangWatch", "start", "where_called", "HANG_EXIT_CODE", "DEFAULT_STALL_TIMEOUT", "HangSettings",
           "read_settings"]


class HangWatch:
    """The recorder, the strict check and the watchdog of one process group, started and stopped together."""

    def __init__(self, rank: int, world_size: int, settings: HangSettings, watch_store: dist.Store,
                 main_store: dist.Store) -> None:
        self.rank, self.settings = rank, settings
        self.recorder = Recorder()
        self.inquiry = Inquiry(watch_store, rank, world_size)
        self.watchdog = Watchdog(self.recorder, self.inquiry, settings.stall_timeout, rank) \
            if settings.stall_timeout > 0 else None
        if settings.check_collectives:
            self.recorder.before = StrictCheck(main_store, rank)
        self.recorder.failed = self._collective_failed
        self._asked = False  # a failed collective's inquiry has run already
        self._exit_site: str | None = None  # where the main thread called sys.exit()
        self._pid = os.getpid()  # see _forked

    def begin(self) -> None:
        self.inquiry.introduce()
        self.recorder.install()
        if self.watchdog is not None:
            self.watchdog.start()
            self._previous_excepthook = threading.excepthook
            threading.excepthook = self._thread_died
        atexit.register(self._at_exit)
        self._sys_exit = sys.exit
        sys.exit = self._exiting

    def _exiting(self, status: object = None) -> NoReturn:
        """``sys.exit`` while the group lives: note where it was called, for the ranks still waiting
        on this one (Python keeps no trace of a SystemExit that ends the script), then exit."""
        if threading.current_thread() is threading.main_thread() and not self._forked():
            self._exit_site = f"sys.exit({status!r:.80}) at {format_site(call_site(2)[0])}"
        self._sys_exit(status)

    def _forked(self) -> bool:
        """In a child of ``os.fork()``: it inherited these hooks, but it is not the rank."""
        return os.getpid() != self._pid

    def _thread_died(self, args: threading.ExceptHookArgs) -> None:
        """A thread ended with an uncaught exception: the report names it (a main thread waiting for
        a queue that thread fed waits for ever), then Python's own hook prints it."""
        if self.watchdog is not None and args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            name = args.thread.name if args.thread is not None else "?"
            self.watchdog.dead_threads = [*self.watchdog.dead_threads[-2:],
                                          f"thread '{name}' died with {describe_error(args.exc_value)}"]
        self._previous_excepthook(args)

    def end(self, how: str = "shutdown", where: str | None = None, error: str | None = None) -> None:
        """Leave the job: the last word first (the others may be waiting for this rank), then unwrap."""
        if self._forked():  # shutdown() in a forked child's finally:, the rank goes on
            return
        atexit.unregister(self._at_exit)
        if sys.exit == self._exiting:
            sys.exit = self._sys_exit
        try:
            self.inquiry.last_word({"how": how, "where": where or self._last_collective(), "error": error,
                                    "groups": [log.snapshot(0.0) for log in self.recorder.groups()]})
        except Exception:  # noqa: BLE001 - the store is gone with the job: nothing to tell
            pass
        if self.watchdog is not None:
            self.watchdog.stop()
            if threading.excepthook == self._thread_died:
                threading.excepthook = self._previous_excepthook
        self.recorder.uninstall()
        self.recorder.forget()

    def _at_exit(self) -> None:
        if self._forked():  # a forked child ends: its last word would be taken for the rank's
            return
        error = getattr(sys, "last_value", None)  # set when an uncaught exception ends the script
        if error is None:
            self.end("exit", error=self._exit_site)
        else:
            # an async collective (DDP's) that failed because a peer went away raised in Work.wait(),
            # past the recorder: ask the others now, before the process ends with Gloo's words only
            if self._collective_failed(None, error) and not self._asked:
                self.recorder.blame_async(error)
                self.watchdog.where = (f"exiting after an uncaught {type(error).__name__} at "
                                       f"{format_site(traceback_site(error.__traceback__))}")
                self.watchdog.inquire_now(3 * ANSWER_SECONDS)
            self.end("exception", format_site(traceback_site(error.__traceback__)),
                     f"{type(error).__name__}: {error}"[:300])

    def _last_collective(self) -> str:
        last: Record | None = None
        for log in self.recorder.groups():
            if log.ring and (last is None or log.ring[-1].start > last.start):
                last = log.ring[-1]
        return "none" if last is None else last.label()

    def _collective_failed(self, record: Record | None, error: BaseException) -> bool:
        """A collective raised: if a peer went away, ask everyone at once, so that the report says who
        and where before the error goes on to the script (with ``record`` None, only say whether it
        would). The error is this rank's consequence of another's failure: the launcher is told."""
        gone = peer_gone_error(error)
        if gone:
            _mark_consequence()
        if gone and self.watchdog is not None and record is not None:
            self._asked = True
            self.watchdog.inquire_now(3 * ANSWER_SECONDS)
        return gone and self.watchdog is not None


def _mark_consequence() -> None:
    """Tell ``ddpkit run`` (through the file it named) that this rank fails because a peer went away."""
    path = os.environ.get(CONSEQUENCE_FILE_VARIABLE)
    if path:
        with contextlib.suppress(OSError):
            open(path, "w").close()


def start(rank: int, world_size: int, store: dist.Store | None, settings: HangSettings) -> HangWatch | None:
    """Start recording and watching the group ``init()`` just made; None when there is nothing to do
    (a world of one, both features off, or no store to talk through)."""
    if world_size < 2 or not settings.recording:
        return None
    try:
        if store is None:  # a group the user made before init(): its own store
            store = dist.distributed_c10d._get_default_store()
        main_store, watch_store = _stores(store, rank)
    except (RuntimeError, ValueError, AttributeError) as e:
        sys.stderr.write(f"{rank_prefix(rank)}ddpkit: no store to report hangs through ({e}); hang reports are "
                         "off.\n")
        return None
    watch = HangWatch(rank, world_size, settings, watch_store, main_store)
    watch.begin()
    return watch


def _stores(store: dist.Store, rank: int) -> tuple[dist.Store, dist.Store]:
    """Two views of one key space for this job: one for the main thread, one (its own connection,
    where the store is a TCPStore) for the watchdog, so that neither blocks the other's calls."""
    if rank == 0:
        store.set("ddpkit-hangs/prefix", uuid.uuid4().hex)
    prefix = f"ddpkit-hangs/{store.get('ddpkit-hangs/prefix').decode()}"
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if rank == 0:  # where a launcher that holds the store finds this job's keys (ask_from_outside)
        base.set(LATEST_KEY, prefix)
    own = base
    if isinstance(base, dist.TCPStore):
        own = dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=30))
    return dist.PrefixStore(prefix, base), dist.PrefixStore(prefix, own)


def where_called() -> str:
    """``file:line in function()`` of the user code calling the function that calls this."""
    site, _ = call_site(3)
    return format_site(site)
