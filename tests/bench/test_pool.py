"""The bench's verdicts: the median's confidence interval, and ``--pool``, which pools the rounds of
several runs into one."""
from __future__ import annotations

import json
import math
import random

import pytest

from ddpkit.bench.cli import main
from ddpkit.bench.ddp_step import ratios
from ddpkit.bench.report import median, median_interval

VARIANTS = ("local", "ddpkit", "torch", "floor")


def test_the_median_interval_is_the_textbook_order_statistics():
    # n = 40: the 14th and 27th values (the binomial tables' 95% interval for a median)
    assert median_interval(list(range(1, 41))) == (14, 27)
    # n = 100: the 40th and 61st
    assert median_interval(list(range(1, 101))) == (40, 61)
    # too few values for 95% (a --quick run's 3 rounds): no interval; from 6 on, their whole range
    assert median_interval([3.0, 1.0, 2.0]) is None and median_interval([1.0] * 5) is None
    assert median_interval([6.0, 1.0, 2.0, 3.0, 4.0, 5.0]) == (1.0, 6.0)
    with pytest.raises(ValueError, match="no values"):
        median_interval([])
    with pytest.raises(ValueError, match="confidence must lie strictly between 0 and 1, got 1.5"):
        median_interval([1.0, 2.0], confidence=1.5)


def test_the_median_interval_covers_the_true_median_95_times_in_100():
    """On a long-tailed distribution, as timings on a busy machine are: about 96% (the exact figure
    for n = 40 is 0.9615); an interval one order statistic narrower would cover 92%, one wider 98%."""
    rng = random.Random(0)
    trials = 4000
    hits = 0
    for _ in range(trials):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(40)])
        hits += low <= math.log(2) <= high
    assert 0.945 <= hits / trials <= 0.975


def test_ratios_carry_the_interval_of_the_rounds_own_ratios():
    times = {"ddpkit": [float(i) for i in range(1, 41)], "torch": [1.0] * 40}
    rows = [{"model": "m", "variant": v, "available": v in times, "times": times.get(v, []),
             "cpu_times": times.get(v, [])} for v in VARIANTS]
    figures = ratios(rows)["m"]
    assert (figures["ddpkit/torch ci_low"], figures["ddpkit/torch ci_high"]) == (14.0, 27.0)
    assert figures["ddpkit/floor ci_low"] is None


def _run_file(path, world_size: int, ratios_: list[float], quick: bool = False) -> str:
    """A bench JSON file whose rounds have ddpkit/torch ``ratios_``, torch's times varying from
    round to round (as they do), so that rounds paired wrongly give other ratios."""
    rng = random.Random(len(ratios_) + world_size)
    torch_ = [0.05 + 0.1 * rng.random() for _ in ratios_]
    ddpkit = [t * r for t, r in zip(torch_, ratios_)]
    floor = [0.1] * len(ratios_)
    rows = [{"model": "m", "variant": v, "available": True, "times": t, "cpu_times": t}
            for v, t in (("local", floor), ("ddpkit", ddpkit), ("torch", torch_), ("floor", floor))]
    meta = {"world_size": world_size, "backend": "gloo", "device": "cpu", "config": {"quick": quick, "steps": 3}}
    path.write_text(json.dumps({"meta": meta, "ddp_step": {"rows": rows}}))
    return str(path)


def test_pool_joins_the_rounds_of_runs_in_the_same_setting(tmp_path, capsys):
    rng = random.Random(1)
    runs = [[0.97 + 0.06 * rng.random() for _ in range(40)] for _ in range(3)]  # each straddles 1
    files = [_run_file(tmp_path / f"run{i}.json", 2, r) for i, r in enumerate(runs)]
    files.append(_run_file(tmp_path / "other.json", 3, [0.9] * 10))
    assert main(["--pool", *files]) == 0
    out = capsys.readouterr().out
    assert "3 runs pooled (2 ranks, gloo, cpu, 3 steps per repeat)" in out
    assert "1 run (3 ranks, gloo, cpu, 3 steps per repeat)" in out
    line = next(x for x in out.splitlines() if x.startswith("m ") and "ddpkit/torch" in x and " 120 " in x)
    pooled = median([x for r in runs for x in r])
    low, high = median_interval([x for r in runs for x in r])
    assert line.split()[3:5] == [f"{pooled:.3f}", f"{low:.3f}-{high:.3f}"]
    assert line.endswith(" ".join(f"{median(r):.3f}" for r in runs))
    assert ("within noise" in line) == (low <= 1 <= high)
    three = next(x for x in out.splitlines() if x.startswith("m ") and "ddpkit/torch" in x and " 10 " in x)
    assert "ddpkit faster" in three
    assert main([f"--pool={files[-1]}"]) == 0  # argparse's other spelling runs nothing either
    assert "1 run (3 ranks" in capsys.readouterr().out


def test_pool_keeps_quick_runs_apart_and_gives_no_verdict_on_too_few_rounds(tmp_path, capsys):
    # a --quick run trains smaller models in 3 rounds: pooled with full runs it would mix two things
    full = _run_file(tmp_path / "full.json", 2, [0.99] * 40)
    quick = _run_file(tmp_path / "quick.json", 2, [0.99] * 3, quick=True)
    assert main(["--pool", full, quick]) == 0
    out = capsys.readouterr().out
    assert "1 run (2 ranks, gloo, cpu, 3 steps per repeat)" in out
    assert "1 run (2 ranks, gloo, cpu, 3 steps per repeat, quick)" in out
    three = next(x for x in out.splitlines() if x.startswith("m ") and "ddpkit/torch" in x and " 3 " in x)
    assert three.split()[3:] == ["0.990", "-", "too", "few", "rounds", "0.990"]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("{not json", "not JSON"),
    (json.dumps({"meta": {}, "memory": []}), "no DDP step rounds in it. HINT: pool the --json files"),
    (json.dumps({"ddp_step": {"rows": [{"variant": "ddpkit"}]}}), "row 0 lacks its model or variant"),  # KeyError
])
def test_pool_names_the_file_it_cannot_use(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    assert main(["--pool", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err


def test_pool_refuses_a_file_named_twice_whose_rounds_would_count_twice(tmp_path, capsys, monkeypatch):
    path = _run_file(tmp_path / "run.json", 2, [0.99] * 40)
    monkeypatch.chdir(tmp_path)
    for argv in (["--pool", path, path], ["--pool", path, "run.json"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"--pool names {path!r} twice" in err and "count twice" in err
