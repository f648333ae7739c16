"""The watchdog prints a report only while it is true of this rank: a slow rank that arrives while
the answers come in makes the report describe a past that no longer holds."""
from __future__ import annotations

from ddpkit.runtime.hangs import watchdog as watchdog_module
from ddpkit.runtime.hangs.recorder import GroupLog, Record, Recorder
from ddpkit.runtime.hangs.watchdog import Watchdog


class _NeverDone:
    def is_completed(self):
        return False


class _LeadingInquiry:
    """An inquiry this rank leads; ``arrive`` runs while it collects the answers."""

    def __init__(self, arrive=lambda: None):
        self.arrive = arrive

    def answer(self, n, state):
        return True

    def collect(self, n, seconds):
        self.arrive()
        return {}, {}

    def publish_report(self, n, report):
        pass

    def wait_read(self, n, readers, seconds):
        pass


def _run_inquiry(monkeypatch, capsys, arrive, certain=False, waiting=False) -> str:
    recorder = Recorder()
    log = recorder.logs[None] = GroupLog("0", [0, 1], True)
    if waiting:  # this rank waits in a collective: an async one whose Work never completes
        stuck = Record(1, "all_reduce", None, None, None, None)
        stuck.work = _NeverDone()
        log.ring.append(stuck)
        log.pending.append(stuck)
    monkeypatch.setattr(watchdog_module, "build_report", lambda *a, **k: {
        "text": "REPORT", "certain": certain, "picture": "slow rank 1", "readers": 0})
    monkeypatch.setattr(Watchdog, "_end_in_deadlock", lambda self, n, readers: None)
    Watchdog(recorder, _LeadingInquiry(lambda: arrive(log)), 5.0, 0)._take_part(1)
    return capsys.readouterr().err


def test_a_report_is_printed_while_it_holds(monkeypatch, capsys):
    assert "REPORT" in _run_inquiry(monkeypatch, capsys, arrive=lambda log: None)


def test_a_report_this_rank_outran_is_not_printed(monkeypatch, capsys):
    def next_collective(log):  # the slow rank arrived: this rank went on to its next collective
        log.seq += 1

    assert "REPORT" not in _run_inquiry(monkeypatch, capsys, arrive=next_collective)
    # a certain deadlock is not a picture that passes: it is printed whatever happened meanwhile
    assert "REPORT" in _run_inquiry(monkeypatch, capsys, arrive=next_collective, certain=True)


def test_a_rank_still_waiting_in_a_collective_has_not_got_on_whatever_else_it_calls(monkeypatch, capsys):
    def finish(log):  # the collective this rank waited in ended
        log.ring[0].end = 1.0

    def elsewhere(log):  # another thread or group goes on calling collectives; the stuck one stays
        log.seq += 5

    assert "REPORT" not in _run_inquiry(monkeypatch, capsys, arrive=finish, waiting=True)
    assert "REPORT" in _run_inquiry(monkeypatch, capsys, arrive=elsewhere, waiting=True)
