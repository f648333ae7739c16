"""ddpkit.print, get_logger and progress speak on rank 0 only."""
from __future__ import annotations

import contextlib
import io
import logging

import pytest
from ranks import run_ranks

import ddpkit
from ddpkit.logging import get_logger, progress


def _print_to_file(path: str) -> None:
    with open(path, "w") as f, contextlib.redirect_stdout(f):
        ddpkit.print("loss", 0.5)
        ddpkit.print("everywhere", all_ranks=True)


def _log_to_buffer() -> str:
    buffer = io.StringIO()
    logger = get_logger("ddpkit.test_logging")
    logger.addHandler(logging.StreamHandler(buffer))
    logger.info("step %d", 3)
    return buffer.getvalue()


@pytest.mark.timeout(60)
def test_print_speaks_on_rank_0_only_and_all_ranks_tags_every_rank(tmp_path):
    paths = [str(tmp_path / f"rank{r}.txt") for r in range(2)]
    run_ranks(_print_to_file, world_size=2, rank_args=[(p,) for p in paths])
    outputs = [open(p).read() for p in paths]
    assert outputs[0] == "loss 0.5\n[rank 0] everywhere\n"
    assert outputs[1] == "[rank 1] everywhere\n"


@pytest.mark.timeout(60)
def test_get_logger_emits_on_rank_0_only():
    assert run_ranks(_log_to_buffer, world_size=2) == ["step 3\n", ""]


@pytest.mark.timeout(10)
def test_get_logger_is_idempotent_and_does_not_propagate():
    first = get_logger("ddpkit.test_idempotent")
    second = get_logger("ddpkit.test_idempotent")
    assert first is second
    assert len(first.handlers) == 1 and len(first.filters) == 1
    assert first.propagate is False


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.timeout(10)
def test_progress_is_quiet_when_not_a_terminal():
    out = io.StringIO()
    assert list(progress(range(5), file=out)) == [0, 1, 2, 3, 4]
    assert out.getvalue() == ""


@pytest.mark.timeout(10)
def test_progress_draws_count_and_percentage_on_a_terminal():
    out = _Terminal()
    bar = progress(range(4), desc="train", file=out)
    assert len(bar) == 4
    assert list(bar) == [0, 1, 2, 3]
    assert "\rtrain: 4/4 100%" in out.getvalue()
    assert out.getvalue().endswith("\n")


@pytest.mark.timeout(10)
def test_progress_is_quiet_on_other_ranks_even_on_a_terminal(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    out = _Terminal()
    assert list(progress(iter("abc"), file=out)) == ["a", "b", "c"]
    assert out.getvalue() == ""


@pytest.mark.timeout(10)
def test_progress_without_length_counts_items():
    out = _Terminal()
    assert list(progress(iter("ab"), file=out)) == ["a", "b"]
    assert out.getvalue().startswith("\r2 ")


@pytest.mark.timeout(10)
def test_a_shorter_redraw_blanks_what_the_longer_line_left():
    out = _Terminal()
    bar = progress(range(10), file=out)
    bar._draw(5, elapsed=0.5)  # "5/10  50% 10.0 it/s"
    bar._draw(10, elapsed=0.0)  # "10/10 100% " with no rate yet: shorter
    first, second = out.getvalue().split("\r")[1:]
    assert len(second) == len(first) and second.rstrip() == "10/10 100%"


@pytest.mark.timeout(10)
def test_progress_draws_on_stderr_that_ddpkit_run_relays_to_a_terminal(monkeypatch, capsys):
    monkeypatch.setenv("DDPKIT_TERMINAL", "1")  # what the launcher sets when its stderr is a tty
    assert list(progress(range(3))) == [0, 1, 2]
    assert "\r3/3 100%" in capsys.readouterr().err
