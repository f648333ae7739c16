"""Run the job on this node: start the workers, watch them, stop them whole, restart, report.

One attempt reads as its steps: meet the other nodes, start every local worker, watch until all succeed
or one fails (or a signal or another node says stop), stop the rest (SIGTERM, SIGKILL after the grace
period, trees included), then summarise. With --max-restarts the whole group starts again with
TORCHELASTIC_RESTART_COUNT one higher, so a script can resume from its last checkpoint.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import psutil

from ddpkit.launch.config import LaunchConfig
from ddpkit.launch.logs import error_file_path, log_path, run_log_dir, say
from ddpkit.launch.rendezvous import Layout, ask_where_they_are, for_config
from ddpkit.launch.signals import FORWARDED, STOPPING, SignalInbox
from ddpkit.launch.summary import failure_info, failure_summary, remote_summary
from ddpkit.launch.watchdog import TOKEN_VARIABLE, Watchdog
from ddpkit.launch.workers import (
    Placement,
    Worker,
    exit_code,
    kill_leftovers,
    record_exit,
    signal_worker,
    spawn_worker,
    worker_env,
)
from ddpkit.runtime.hangs.settings import CONSEQUENCE_FILE_VARIABLE, HANG_EXIT_CODE

__all__ = ["Outcome", "Supervisor", "run", "CAUSE_WAIT"]

CAUSE_WAIT = 5.0
"""Seconds a consequence (a hang report's exit, or a collective that failed because a peer went away)
waits for the failure that caused it to end too."""
ASK_AFTER = 2.0
"""Seconds after Ctrl-C (SIGINT) before workers still running are asked where they wait."""
PEER_EXIT_WAIT = 0.5
"""Seconds the rest of a failed attempt's workers get to end by themselves before SIGTERM: a rank
failing at the same moment (both raise after one barrier) prints its own traceback, and is told
apart from one stopped because of the failure."""


@dataclass
class Outcome:
    """How an attempt ended: "succeeded", "failed" (here), "remote" (another node) or "signal"."""

    kind: str
    code: int = 0
    failed: Worker | None = None
    remote: dict | None = None

    @property
    def final(self) -> bool:
        """No restart helps: the job succeeded, was stopped, or lost a node (a static rendezvous
        cannot take it back)."""
        return self.kind in ("succeeded", "signal") or (self.remote is not None and "lost" in self.remote)


def _say(message: str) -> None:
    say(f"ddpkit run: {message}")


class Supervisor:
    """The launcher of one node. ``run()`` returns the exit code for the whole ``ddpkit run``."""

    def __init__(self, config: LaunchConfig, environ: dict[str, str] | None = None):
        self.config = config
        self.environ = dict(os.environ if environ is None else environ)
        self.rendezvous = for_config(config)
        self.stop_signal: signal.Signals | None = None
        self._inbox: SignalInbox | None = None
        self._workers: list[Worker] = []
        # children we had before the job (e.g. when called in-process) are not ours to kill
        self._keep = {p.pid for p in psutil.Process().children()}
        self._watchdog: Watchdog | None = None
        self._error_dir: str | None = None  # set by run()
        self._log_dir: str | None = None  # this run's own directory in --log-dir, made by run()
        self._consequence_since: float | None = None  # when a consequence's exit came first
        self._consequence_files: dict[int, str] = {}  # this attempt's, by rank

    def run(self) -> int:
        with SignalInbox() as self._inbox:
            try:
                if self.config.log_dir:
                    self._log_dir = run_log_dir(self.config.log_dir, self.config.run_id)
                    _say(f"logs in {self._log_dir}")
                # the workers' TORCHELASTIC_ERROR_FILEs: kept with the logs, else removed at the end
                self._error_dir = self._log_dir or tempfile.mkdtemp(prefix="ddpkit-run-")
                self._watchdog = Watchdog()
                self._keep.add(self._watchdog.pid or 0)
                if self._error_dir != self._log_dir:  # ours: gone with us, even if we are killed
                    self._watchdog.remove_on_kill(self._error_dir)
                layout = self.rendezvous.join(self._aborted)
                if layout.node_rank != self.config.node_rank:  # numbered at the rendezvous (c10d)
                    self.config = replace(self.config, node_rank=layout.node_rank)
                if layout.job_id is not None:  # an unnamed run of several nodes, named there
                    self.config = replace(self.config, job_id=layout.job_id)
                for attempt in range(self.config.max_restarts + 1):
                    outcome = self.run_attempt(attempt, layout)
                    if outcome.final or attempt == self.config.max_restarts:
                        return outcome.code
                    _say(f"restarting all workers: restart {attempt + 1} of at most "
                         f"{self.config.max_restarts} (TORCHELASTIC_RESTART_COUNT={attempt + 1})")
                return 1  # unreachable: the loop returns on its last attempt
            except RuntimeError as e:
                _say(f"error: {e}")
                return 128 + self.stop_signal if self.stop_signal else 1
            finally:
                self.rendezvous.close()
                if self._watchdog is not None:
                    self._watchdog.close()
                if self._error_dir is not None and self._error_dir != self._log_dir:
                    shutil.rmtree(self._error_dir, ignore_errors=True)

    # ------------------------------------------------------------------------------------- attempt
    def run_attempt(self, attempt: int, layout: Layout) -> Outcome:
        master_addr, master_port = self.rendezvous.begin_attempt(attempt, self._aborted)
        if self.stop_signal is not None:
            return Outcome("signal", 128 + self.stop_signal)
        self._workers, self._consequence_since, self._consequence_files = [], None, {}
        outcome = None
        try:
            self.start_workers(attempt, layout, master_addr, master_port)
            self.rendezvous.serve()  # one node's store opens now: the workers import torch meanwhile
            outcome = self.watch()
            self.tell_other_nodes(attempt, outcome)  # first: they stop theirs while we stop ours
        finally:
            failed = outcome is not None and outcome.kind == "failed"
            self.stop_workers(self._workers, self.stop_signal or signal.SIGTERM,
                              settle=PEER_EXIT_WAIT if failed else 0.0)
        if outcome.kind == "failed":
            log = log_path(self._log_dir, attempt, outcome.failed.rank) if self._log_dir else None
            restarts = self.config.max_restarts
            restart = f"{attempt + 1} of at most {restarts}" if attempt < restarts and not outcome.final else None
            say(failure_summary(outcome.failed, self._workers, self.config.node_rank, log, restart,
                                consequence=self._is_consequence(outcome.failed)))
        elif outcome.kind == "signal":
            _say(f"received {self.stop_signal.name}: stopped all workers")
        elif outcome.kind == "succeeded":
            remote = self.rendezvous.finish_attempt(attempt, self._aborted)
            if remote is not None:
                outcome = Outcome("remote", remote.get("code") or 1, remote=remote)
            elif self.stop_signal is not None:
                outcome = Outcome("signal", 128 + self.stop_signal)
            self.tell_other_nodes(attempt, outcome)
            if outcome.kind == "signal":
                _say(f"received {self.stop_signal.name} while waiting for the other nodes to finish")
            elif outcome.kind == "succeeded":
                count = len(self._workers)
                _say(f"{'all ' if count > 1 else ''}{count} worker{'s' if count > 1 else ''} on node "
                     f"{self.config.node_rank} succeeded")
        if outcome.kind == "remote":
            _say(remote_summary(outcome.remote, self._workers).removeprefix("ddpkit run: "))
        return outcome

    def tell_other_nodes(self, attempt: int, outcome: Outcome) -> None:
        """Publish why this node's attempt ends, unless it succeeded or another node said it first."""
        if outcome.kind == "failed":
            info = failure_info(outcome.failed, self.config.node_rank)
        elif outcome.kind == "signal":
            info = {"node": self.config.node_rank, "signal": self.stop_signal.name}
        elif outcome.kind == "remote" and "lost" in outcome.remote:
            info = outcome.remote  # only node 0 watches the heartbeats: the others learn it here
        else:
            return
        self.rendezvous.report_failure(attempt, info)

    def start_workers(self, attempt: int, layout: Layout, master_addr: str,
                      master_port: int) -> None:
        """Start this node's workers into ``self._workers`` (so a failed start still stops the rest)."""
        cfg, workers = self.config, self._workers
        for local_rank in range(cfg.nproc_per_node):
            place = Placement(layout.rank_offset + local_rank, local_rank, layout.world_size,
                              cfg.nproc_per_node, cfg.node_rank, layout.nnodes)
            env = worker_env(self.environ, place, master_addr=master_addr, master_port=master_port,
                             attempt=attempt, max_restarts=cfg.max_restarts, run_id=cfg.run_id,
                             role=cfg.role, terminal=sys.stderr.isatty(), job_id=cfg.job_id,
                             error_file=error_file_path(self._error_dir, attempt, place.rank))
            if self._watchdog is not None:
                env[TOKEN_VARIABLE] = self._watchdog.token  # inherited: marks the job's processes
            env[CONSEQUENCE_FILE_VARIABLE] = self._consequence_files[place.rank] = error_file_path(
                self._error_dir, attempt, place.rank, "consequence")
            log = log_path(self._log_dir, attempt, place.rank) if self._log_dir else None
            workers.append(spawn_worker(cfg.command, env, place, log, shown=cfg.console.shows(local_rank)))
            if self._watchdog is not None:
                self._watchdog.add(workers[-1].pid)
        first, last = workers[0].rank, workers[-1].rank
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        _say(f"attempt {attempt}: started {ranks} of {layout.world_size} on node "
             f"{cfg.node_rank} (pids {' '.join(str(w.pid) for w in workers)}), store "
             f"{master_addr}:{master_port}")

    def watch(self) -> Outcome:
        """Poll until every worker succeeded, one failed, a stopping signal came or another node failed."""
        while True:
            self._handle_signals()
            if self.stop_signal is not None:
                return Outcome("signal", 128 + self.stop_signal)
            for worker in self._workers:
                record_exit(worker)
            failed = [w for w in self._workers if w.state == "failed"]
            if failed and not self._await_cause(failed):
                # several ended by themselves (in one poll, or while consequences waited for their
                # cause): a consequence of a peer's failure comes last; a worker killed by a signal is
                # more likely the cause than one that raised because its peer vanished; else the lowest rank
                first = min(failed, key=lambda w: (self._is_consequence(w), w.process.returncode > 0, w.rank))
                return Outcome("failed", first.exit_code, failed=first)
            if all(w.state == "succeeded" for w in self._workers):
                return Outcome("succeeded")
            remote = self.rendezvous.remote_failure()
            if remote is not None:
                return Outcome("remote", remote.get("code") or 1, remote=remote)
            time.sleep(self.config.monitor_interval)

    def _is_consequence(self, worker: Worker) -> bool:
        """A hang report's exit, or a collective's error because a peer went away (the worker then
        created its ``CONSEQUENCE_FILE_VARIABLE`` file, ``ddpkit.runtime.hangs``): not a cause."""
        if worker.process.returncode == HANG_EXIT_CODE:
            return True
        path = self._consequence_files.get(worker.rank)
        return path is not None and os.path.exists(path)

    def _await_cause(self, failed: list[Worker]) -> bool:
        """Whether to wait for the cause: every failure so far is a consequence (the rank saw a peer
        exit or die), and that peer may still be on its way out (its atexit handlers, a logger's
        flush). For at most ``CAUSE_WAIT`` seconds, so that the summary leads with its traceback."""
        if not all(self._is_consequence(w) for w in failed):
            return False
        if self._consequence_since is None:
            self._consequence_since = time.monotonic()
        running = any(w.state == "running" for w in self._workers)
        return running and time.monotonic() - self._consequence_since < CAUSE_WAIT

    def stop_workers(self, workers: list[Worker], sig: int, settle: float = 0.0) -> None:
        """``sig`` to every running worker's tree, SIGKILL after the grace period, then no leftovers;
        ``settle``: seconds to let them end by themselves first (``PEER_EXIT_WAIT``)."""
        self._wait_for_exit(workers, settle)
        for worker in workers:
            record_exit(worker)  # one that ended by itself before we signal it was not stopped by us
        running = [w for w in workers if w.process.poll() is None]
        if running:
            _say(f"stopping workers: {signal.Signals(sig).name}, SIGKILL in "
                 f"{self.config.grace_period:g} s (Ctrl-C: at once)")
        for worker in running:
            signal_worker(worker, sig)
        deadline = time.monotonic() + self.config.grace_period
        if running and self.stop_signal == signal.SIGINT and self.config.grace_period > ASK_AFTER:
            # Ctrl-C on a job that seems stuck: ranks blocked in a collective do not see the signal (a
            # scheduler's SIGTERM gives a checkpoint's save its time without a report)
            if self._wait_for_exit(running, ASK_AFTER):
                deadline = 0.0  # Ctrl-C again: at once
            elif any(w.process.poll() is None for w in running) and ask_where_they_are(self.rendezvous):
                _say(f"workers still running {ASK_AFTER:g} s after {signal.Signals(sig).name}: each reports "
                     "where it waits")
        self._wait_for_exit(running, deadline - time.monotonic())
        kill_leftovers(workers, self._keep)
        for worker in workers:
            if worker.state == "running":
                worker.state = "stopped"
                returncode = worker.process.returncode
                worker.exit_code = None if returncode is None else exit_code(returncode)
        for worker in workers:
            if not worker.pump.join(timeout=2.0):
                _say(f"rank {worker.rank}'s output pipe is still held open by a process outside "
                     "its tree; not waiting for it")

    def _wait_for_exit(self, workers: list[Worker], seconds: float) -> bool:
        """Until every one of ``workers`` has ended, ``seconds`` have passed, or a stopping signal came
        (Ctrl-C while stopping: do not wait out the grace period); returns whether one came."""
        deadline = time.monotonic() + seconds
        while any(w.process.poll() is None for w in workers) and time.monotonic() < deadline:
            if self._handle_signals():
                return True
            time.sleep(0.02)
        return False

    # ------------------------------------------------------------------------------------- signals
    def _handle_signals(self) -> bool:
        """Stopping signals end the job (the first is kept); USR1/USR2 go on to the workers.

        Returns whether a stopping signal arrived since the last call.
        """
        stopping = False
        assert self._inbox is not None
        for sig in self._inbox.take():
            if sig in STOPPING:
                stopping = True
                if self.stop_signal is None:
                    self.stop_signal = sig
            elif sig in FORWARDED:
                for worker in self._workers:
                    if worker.process.poll() is None:
                        signal_worker(worker, sig, tree=False)
        return stopping

    def _aborted(self) -> bool:
        self._handle_signals()
        return self.stop_signal is not None


def run(config: LaunchConfig, environ: dict[str, str] | None = None) -> int:
    """Run ``config`` on this node; returns the exit code ``ddpkit run`` should exit with."""
    return Supervisor(config, environ).run()
