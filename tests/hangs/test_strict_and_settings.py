"""Strict mode (every collective compared across ranks before it runs) and the settings' validation."""
from __future__ import annotations

import re

import pytest
from jobs import line_of, run_job
from ranks import run_ranks

import ddpkit
from ddpkit.runtime.hangs import read_settings

pytestmark = pytest.mark.timeout(60)


def test_strict_mode_names_a_same_size_mismatch_from_different_lines(tmp_path):
    job = run_job("strict_same_size", 2, tmp_path, env={"DDPKIT_CHECK_COLLECTIVES": "1"})
    assert job.codes == [1, 1], job.log()
    for rank, text in enumerate(job.logs):
        assert f"CollectiveMismatchError: ddpkit on rank {rank}: the ranks disagree at collective #1" in text
        assert f"rank 0: all_reduce float32[5] at {line_of('strict-0')} in strict_same_size()" in text
        assert f"rank 1: all_reduce float32[5] at {line_of('strict-1')} in strict_same_size()" in text
        assert "HINT: every rank must call the same collectives in the same order, from the same line." in text


def test_without_strict_mode_the_same_mismatch_passes_silently(tmp_path):
    job = run_job("strict_same_size", 2, tmp_path)
    assert job.codes == [0, 0], job.log()


def _mismatch_in(scenario: str) -> str:
    """What strict mode raises on this rank in ``scenario`` (a function of scenarios.py)."""
    import scenarios

    from ddpkit.errors import CollectiveMismatchError
    try:
        getattr(scenarios, scenario)(ddpkit.get_rank())
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def test_strict_mode_names_a_reduction_that_differs_between_ranks():
    texts = run_ranks(_mismatch_in, 2, args=("strict_other_reduction",), env={"DDPKIT_CHECK_COLLECTIVES": "1"})
    site = re.escape(line_of("strict-op"))
    for text in texts:
        assert re.search(rf"rank 0: all_reduce float32\[3\] at \S*{site}", text), text
        assert re.search(rf"rank 1: all_reduce float32\[3\], op=max at \S*{site}", text), text
        # the same call with other arguments: the hint says what must agree, not where to call from
        assert "HINT: the same call on every rank, with other tensors: all_reduce needs the same shape" in text


def test_strict_mode_on_a_broadcast_of_other_shapes_speaks_of_shapes_not_of_a_reduction():
    for text in run_ranks(_mismatch_in, 2, args=("strict_broadcast_shapes",), env={"DDPKIT_CHECK_COLLECTIVES": "1"}):
        assert "rank 0: broadcast float32[3] from rank 0" in text and "rank 1: broadcast float32[5] from rank 0" in text
        assert ("HINT: the same call on every rank, with other tensors: broadcast needs the same shape and dtype on "
                "every rank; make them agree, e.g. send the shape first and allocate the tensor from it") in text


def test_strict_mode_names_torchs_join_when_one_rank_alone_entered_it():
    texts = run_ranks(_mismatch_in, 2, args=("strict_join_on_one_rank",), env={"DDPKIT_CHECK_COLLECTIVES": "1"})
    site = re.escape(line_of("strict-join"))
    for text in texts:
        assert re.search(rf"rank 0: all_reduce float32\[1\] \(issued by torch's Join\) at \S*{site}", text), text
        assert re.search(rf"rank 1: all_reduce float32\[26\] \(issued by DDP\) at \S*{site}", text), text
        assert "HINT: a forward inside 'with model.join():' first all-reduces the count of ranks still active" in text


def _strict_agree_and_error_facts():
    from scenarios import strict_agree

    strict_agree(ddpkit.get_rank())
    return ddpkit.get_rank()


def test_strict_mode_lets_agreeing_collectives_run():
    assert run_ranks(_strict_agree_and_error_facts, 2, env={"DDPKIT_CHECK_COLLECTIVES": "1"}) == [0, 1]


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_bad_stall_timeout_names_the_variable_and_value(value):
    with pytest.raises(ValueError, match=rf"DDPKIT_STALL_TIMEOUT='{value}' is not a number of seconds >= 0"):
        read_settings(None, None, {"DDPKIT_STALL_TIMEOUT": value})


def test_bad_stall_timeout_argument_is_refused_by_init(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"stall_timeout=-3 is not a number of seconds >= 0"):
        ddpkit.init(stall_timeout=-3)
    monkeypatch.setenv("DDPKIT_STALL_TIMEOUT", "ten")
    with pytest.raises(ValueError, match=r"DDPKIT_STALL_TIMEOUT='ten'"):
        ddpkit.init()


def test_settings_defaults_and_precedence():
    assert read_settings(None, None, {}).stall_timeout == 60
    assert read_settings(None, None, {"DDPKIT_STALL_TIMEOUT": "0"}).recording is False
    assert read_settings(5, None, {"DDPKIT_STALL_TIMEOUT": "0"}).stall_timeout == 5
    assert read_settings(None, None, {"DDPKIT_CHECK_COLLECTIVES": "1"}).check_collectives
    with pytest.raises(ValueError, match="DDPKIT_CHECK_COLLECTIVES='maybe'"):
        read_settings(None, None, {"DDPKIT_CHECK_COLLECTIVES": "maybe"})
