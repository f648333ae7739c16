"""``ddpkit bench``: the smoke run prints every table and writes complete JSON; the formulas are right.

Timings are never asserted (the machine is noisy); only that they exist and are positive.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ddpkit.bench.cli import parse_all, parse_args
from ddpkit.bench.collectives import alg_bandwidth, bus_bandwidth, message_sizes, repeats_for
from ddpkit.bench.ddp_step import ddp_step_table, ratios
from ddpkit.bench.memory import peak_ratios
from ddpkit.bench.models import FAMILY
from ddpkit.bench.report import Table, fmt_bytes, quantile, summarize

TABLE_HEADERS = [
    "1. Collectives",
    "2. DDP step time",
    "3. ddpkit DDP: bucket cap and comm hook",
    "4. Gradient memory",
]


_QUICK_RUN_TIMEOUT = 330
"""The fixture's run (25-40 s on 2 cores) counts against whichever of its tests comes first: more
than the suite's 120 s, so a loaded machine does not fail it at setup."""


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``ddpkit bench --quick --json`` run shared by the tests that read its output; its
    temporary files go to a directory of its own (``TMPDIR``), for the test that none is left."""
    out = tmp_path_factory.mktemp("bench") / "out.json"
    tmpdir = tmp_path_factory.mktemp("tmp")
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "bench", "--quick", "--backend", "gloo",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmpdir)})
    return proc, out, tmpdir


@pytest.mark.timeout(_QUICK_RUN_TIMEOUT)
def test_quick_run_exits_zero_and_prints_every_table(quick_run):
    proc, _, _ = quick_run
    assert proc.returncode == 0, proc.stderr
    for header in TABLE_HEADERS:
        assert header in proc.stdout, f"{header!r} missing from:\n{proc.stdout}"
    assert "all_reduce" in proc.stdout and "broadcast" in proc.stdout and "all_gather" in proc.stdout
    for variant in ("local", "ddpkit", "torch", "floor"):
        assert variant in proc.stdout
    # printed once, by rank 0 only
    assert proc.stdout.count("1. Collectives") == 1


@pytest.mark.timeout(_QUICK_RUN_TIMEOUT)
def test_quick_run_writes_json_with_positive_figures(quick_run):
    proc, out, _ = quick_run
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data) >= {"meta", "collectives", "ddp_step", "buckets", "memory"}
    assert data["meta"]["world_size"] == 2 and data["meta"]["backend"] == "gloo"

    ops = {r["op"] for r in data["collectives"]}
    assert ops == {"all_reduce", "broadcast", "all_gather"}
    for r in data["collectives"]:
        assert r["bytes"] > 0 and r["seconds"] > 0 and r["algbw"] > 0 and r["busbw"] > 0
        assert math.isclose(r["algbw"], r["bytes"] / r["seconds"])

    rows = data["ddp_step"]["rows"]
    assert {(r["model"], r["variant"]) for r in rows} == {
        (m, v) for m in FAMILY for v in ("local", "ddpkit", "torch", "floor")}
    for r in rows:
        assert r["available"], r.get("reason")  # every member trains with both DDPs
        assert 0 < r["min"] <= r["q1"] <= r["median"] <= r["q3"] <= r["max"]
    assert set(data["ddp_step"]["ratios"]) == set(FAMILY)
    for figures in data["ddp_step"]["ratios"].values():
        for pair in ("ddpkit/torch", "ddpkit/floor", "torch/floor", "ddpkit/torch cpu"):
            assert 0 < figures[f"{pair} q1"] <= figures[pair] <= figures[f"{pair} q3"]
            # --quick's 3 rounds are too few for a 95% interval of the median
            assert figures[f"{pair} ci_low"] is None and figures[f"{pair} ci_high"] is None

    for r in data["buckets"]:
        assert r["median"] > 0
        if r["impl"] == "ddpkit":
            assert r["allreduce_bytes"] > 0
    assert {(r["model"], r["gradient_as_bucket_view"]) for r in data["memory_peak_ratios"]} == {
        (m, v) for m in FAMILY for v in (False, True)}
    # the tensor peak (a profiled run of its own) for the first model only, in a quick run
    assert {r["model"] for r in data["memory"] if r["tensor_peak_bytes"]} == {FAMILY[0]}
    for r in data["memory"]:
        assert r["peak_bytes"] > 0
        assert r["param_bytes"] > 0 and r["grad_bytes"] > 0 and r["accounted_bytes"] > 0
        assert r["accounted_bytes"] <= r["grad_bytes"] + r["bucket_bytes"]


@pytest.mark.timeout(_QUICK_RUN_TIMEOUT)
def test_gradient_as_bucket_view_saves_the_grad_copy(quick_run):
    _, out, _ = quick_run
    data = json.loads(out.read_text())
    by = {(r["model"], r["impl"], r["gradient_as_bucket_view"]): r for r in data["memory"]}
    for (model, impl, view), r in by.items():
        if view:
            # grads alias the buckets: accounted bytes are one copy, not two (or, for ddpkit's
            # gradients reduced where they lie, never two: Note [Big gradients in place])
            assert r["accounted_bytes"] <= by[(model, impl, False)]["accounted_bytes"]
            if impl == "torch":
                assert r["accounted_bytes"] < by[(model, impl, False)]["accounted_bytes"]


@pytest.mark.timeout(_QUICK_RUN_TIMEOUT)
def test_quick_run_leaves_no_temporary_directory(quick_run):
    """The ranks end with os._exit, which skips multiprocessing's exit handler: the directory it
    made for the memory table's forkserver (``pymp-*``) must go all the same."""
    proc, _, tmpdir = quick_run
    assert proc.returncode == 0, proc.stderr
    # torch's own cache (torchinductor_<user>) is meant to stay
    assert sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(("pymp-", "ddpkit-"))) == []


def test_a_ratio_is_the_median_of_the_rounds_own_ratios():
    """Paired round by round, a slow round for both variants cancels; a ratio of medians it would not."""
    times = {"ddpkit": [1.0, 2.0, 3.0, 4.0, 100.0], "torch": [2.0, 4.0, 6.0, 8.0, 1.0]}
    rows = [{"model": "m", "variant": v, "available": v in times, "times": times.get(v, []),
             "cpu_times": times.get(v, [])} for v in ("local", "ddpkit", "torch", "floor")]
    figures = ratios(rows)["m"]
    assert figures["ddpkit/torch"] == 0.5 and figures["ddpkit/torch cpu"] == 0.5
    assert figures["ddpkit/torch q1"] == 0.5 and figures["ddpkit/torch q3"] == 0.5
    assert figures["ddpkit/floor"] is None and figures["torch/floor q1"] is None


@pytest.mark.parametrize("op, world_size, expected_busbw", [
    # hand-computed: algbw = 1 GB/s
    ("all_reduce", 2, 1.0e9),      # 2(2-1)/2 = 1
    ("all_reduce", 4, 1.5e9),      # 2(4-1)/4 = 1.5
    ("all_reduce", 8, 1.75e9),     # 2(8-1)/8 = 1.75
    ("all_gather", 2, 0.5e9),      # (2-1)/2
    ("all_gather", 8, 0.875e9),    # (8-1)/8
    ("broadcast", 8, 1.0e9),
    ("all_reduce", 1, 0.0),        # a world of one moves nothing
])
def test_bus_bandwidth_follows_nccl_tests(op, world_size, expected_busbw):
    assert math.isclose(bus_bandwidth(op, 1.0e9, world_size), expected_busbw, abs_tol=1e-6)


def test_alg_bandwidth_is_bytes_over_seconds():
    assert alg_bandwidth(256 << 20, 0.5) == 2 * (256 << 20)
    assert math.isclose(alg_bandwidth(4096, 1e-4), 40.96e6)
    with pytest.raises(ValueError, match="seconds must be positive"):
        alg_bandwidth(4096, 0.0)


def test_bandwidth_rejects_unknown_op_and_world():
    with pytest.raises(ValueError, match="reduce_scatter"):
        bus_bandwidth("reduce_scatter", 1.0, 2)
    with pytest.raises(ValueError, match="world_size"):
        bus_bandwidth("all_reduce", 1.0, 0)


def test_message_sizes_are_powers_of_four_from_4kib():
    assert message_sizes(quick=False) == [4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20,
                                          64 << 20, 256 << 20]
    assert message_sizes(quick=True)[-1] == 1 << 20
    assert message_sizes(quick=False, max_bytes=64 << 20)[-1] == 64 << 20


def test_large_messages_get_fewer_repeats_but_never_below_three():
    assert repeats_for(4096, 20) == 20
    assert repeats_for(256 << 20, 20) == 4
    assert repeats_for(1 << 40, 20) == 3


def test_statistics_and_formatting():
    assert quantile([1, 2, 3, 4], 0.5) == 2.5
    s = summarize([5.0, 1.0, 3.0])
    assert (s["min"], s["median"], s["max"], s["n"]) == (1.0, 3.0, 5.0, 3)
    assert fmt_bytes(4096) == "4 KiB" and fmt_bytes(256 << 20) == "256 MiB"
    assert fmt_bytes(781.02 * 1024) == "781 KiB" and fmt_bytes(1.5 * 2**30) == "1.5 GiB"
    table = Table("T", ["a", "b"])
    table.add("x", "1.5")
    assert table.render().splitlines()[2].split() == ["a", "b"]
    with pytest.raises(ValueError, match="row has 1 cells"):
        table.add("only one")


@pytest.mark.parametrize("argv, message", [
    (["--models", "huge"], "--models"),
    (["--tables", "nope"], "--tables"),
    (["--nproc", "0"], "--nproc"),
    (["--backend", "nccl", "--device", "cpu"], "NCCL reduces CUDA tensors only"),
    (["--device", "tpu"], "--device"),
    # found before any rank starts (they ended in a rank's traceback, or in a lost --json after the run)
    (["--threads", "-2"], "--threads must be >= 1, got -2"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),  # 0 meant the default
    (["--max-size", "-1"], "--max-size must be >= 1, got -1"),  # an empty table, exit code 0
    (["--timeout", "-5"], "--timeout must be a number of seconds > 0, got -5"),
    (["--backend", "foo"], "--backend='foo' is not one of ('gloo', 'nccl'"),
    (["--backend", "mpi"], "this build of torch has no mpi backend"),
    (["--json", "/nonexistent-ddpkit/x.json"], "the directory '/nonexistent-ddpkit' does not exist"),
    (["--json", "/"], "--json '/' is a directory"),
])
def test_bad_arguments_exit_2_with_the_reason(argv, message, capsys):
    if argv == ["--backend", "mpi"] and torch.distributed.is_mpi_available():
        pytest.skip("this torch has MPI built in")
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_with_the_reason(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda: this machine has no usable CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_backend_nccl_without_cuda_is_refused_before_any_rank_starts(capsys):
    # it started the ranks, each of which then printed a traceback ending in init's ValueError
    with pytest.raises(SystemExit) as e:
        parse_args(["--backend", "nccl", "--nproc", "1"])
    assert e.value.code == 2
    assert "--backend nccl: this machine has no usable CUDA device" in capsys.readouterr().err


def test_device_cuda_over_gloo_gives_each_rank_a_gpu_round_robin(monkeypatch):
    from ddpkit.bench import runner

    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    config = runner.BenchConfig(backend="gloo", device="cuda")
    assert [runner._rank_device(config, torch.device("cpu"), r) for r in (0, 1)] == \
        [torch.device("cuda", 0)] * 2
    assert chosen == [torch.device("cuda", 0)] * 2
    assert runner._rank_device(runner.BenchConfig(), torch.device("cpu"), 1) == torch.device("cpu")


def test_nproc_takes_a_list_of_world_sizes_one_run_and_one_json_each(tmp_path):
    configs = parse_all(["--nproc", "2,3", "--models", "mlp34,embedding", "--json", str(tmp_path / "o.json")])
    assert [c.nproc for c in configs] == [2, 3]
    assert [c.json_path for c in configs] == [str(tmp_path / "o.n2.json"), str(tmp_path / "o.n3.json")]
    assert all(c.models == ("mlp34", "embedding") for c in configs)
    assert parse_all([])[0].models == FAMILY and parse_all([])[0].nproc == 2


def test_a_variant_that_could_not_be_built_is_unavailable_with_its_reason():
    stats = {"median": 0.01, "q1": 0.01, "q3": 0.01, "min": 0.01, "max": 0.01, "n": 1, "cpu_median": 0.01,
             "times": [0.01], "cpu_times": [0.01]}
    rows = [{"model": "m", "variant": v, "available": v != "torch", **(stats if v != "torch" else
            {"reason": "RuntimeError: refused"})} for v in ("local", "ddpkit", "torch", "floor")]
    text = ddp_step_table(rows, 2, 3, {"m": "a model"}).render()
    assert "n/a: m torch: RuntimeError: refused" in text and "ddpkit/torch = n/a" in text


def test_peak_ratios_pair_each_ddpkit_figure_with_torchs():
    rows = [{"model": "m", "impl": impl, "gradient_as_bucket_view": view, "peak_bytes": peak}
            for impl, view, peak in (("ddpkit", False, 50), ("torch", False, 100), ("ddpkit", True, 80),
                                     ("torch", True, 80))]
    assert peak_ratios(rows) == {("m", False): 0.5, ("m", True): 1.0}


def test_plot_paths_are_checked_before_the_run_and_models_counted_once(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for argv, message in ((["--tables", "big", "--plot", str(tmp_path / "p.png")], "has none of them"),
                          (["--plot", str(tmp_path / "p.txt")], "named by the file's extension")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert parse_args(["--models", "small,small,large"]).models == ("small", "large")
    assert parse_args(["--plot", str(tmp_path / "bench")]).plot_path.endswith("bench")  # matplotlib adds .png


def test_table_numbers_select_tables():
    config = parse_args(["--tables", "1,ddp", "--quick"])
    assert config.tables == ("collectives", "ddp")
    assert config.repeats == 3 and config.steps == 2


def test_plot_draws_every_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from ddpkit.bench.plot import plot_results

    stats = {"median": 0.01, "q1": 0.009, "q3": 0.011}
    results = {
        "meta": {"world_size": 2, "backend": "gloo"},
        "collectives": [{"op": "all_reduce", "bytes": b, "busbw": b * 1e3} for b in (4096, 16384)],
        "ddp_step": {"rows": [{"model": "large", "variant": v, "available": v != "ddpkit", **stats}
                              for v in ("local", "ddpkit", "torch", "floor")],
                     "ratios": {"large": {"ddpkit/torch": 0.9, "ddpkit/torch q1": 0.8, "ddpkit/torch q3": 1.0,
                                          "ddpkit/floor": None, "torch/floor": 1.0, "torch/floor q1": 0.9,
                                          "torch/floor q3": 1.1}}},
        "memory": [{"model": "large", "impl": impl, "gradient_as_bucket_view": view, "peak_bytes": 2**20}
                   for impl in ("ddpkit", "torch") for view in (False, True)],
    }
    path = tmp_path / "bench.png"
    plot_results(results, str(path))
    assert path.stat().st_size > 0


def test_memory_figures_are_medians_of_fresh_runs(monkeypatch):
    """Each peak is the median over fresh runs, taken in rounds; every run's peak is kept."""
    import torch

    from ddpkit.bench import memory

    peaks = iter([10, 40, 30, 20,  # round 1: ddpkit off/on, torch off/on
                  50, 20, 10, 60,
                  30, 30, 20, 40])

    def fake(fn, kind, model, quick, device, view, steps):
        return {"model": model, "impl": kind, "gradient_as_bucket_view": view, "peak_bytes": next(peaks),
                "retained_bytes": 1, "peak_kind": "rss_hwm",
                **dict.fromkeys(("param_bytes", "grad_bytes", "bucket_bytes", "accounted_bytes"), 1)}

    def fresh(fn, *args):
        return 7 if fn is memory.tensor_peak else fake(fn, *args)

    monkeypatch.setattr(memory, "in_fresh_processes", fresh)
    rows = memory.run_memory(["small"], quick=False, device=torch.device("cpu"), repeats=3)
    assert [r["peak_runs"] for r in rows] == [[10, 50, 30], [40, 20, 30], [30, 10, 20], [20, 60, 40]]
    assert [r["peak_bytes"] for r in rows] == [30, 30, 20, 40]
    assert peak_ratios(rows) == {("small", False): 1.5, ("small", True): 0.75}
    assert [r["tensor_peak_bytes"] for r in rows] == [7] * 4
    assert peak_ratios(rows, "tensor_peak_bytes") == {("small", False): 1.0, ("small", True): 1.0}
    assert "median of 3 runs" in memory.memory_table(rows, 2).render()


def test_tensor_peak_is_the_running_sum_in_time_order():
    from ddpkit.bench.tensor_peak import running_peak

    # given out of order: at t=1 +5, t=2 +3 (peak 8), t=3 -6, t=4 +4 (6), t=5 -6
    assert running_peak([(3, -6), (1, 5), (5, -6), (2, 3), (4, 4)]) == (8, 0)
    assert running_peak([]) == (0, 0)


def test_memory_table_in_a_world_of_one_finds_no_bucket_rather_than_failing():
    from types import SimpleNamespace

    from ddpkit.bench.memory import _ddpkit_buckets

    assert _ddpkit_buckets(SimpleNamespace(reducer=None)) == {}  # world of one: DDP has no reducer


@pytest.fixture(scope="module")
def on_request_run(tmp_path_factory):
    """One ``--quick`` run of the two tables given on request only, ``big`` and ``in_place``."""
    out = tmp_path_factory.mktemp("on_request") / "out.json"
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "bench", "--quick", "--tables", "big,in_place",
                           "--models", "large,small", "--backend", "gloo", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=_QUICK_RUN_TIMEOUT - 10)
    return proc, out


@pytest.mark.timeout(_QUICK_RUN_TIMEOUT)
def test_big_table_times_both_paths_of_a_cpu_gradient(on_request_run):
    """``--tables big`` (on request only): each size trains with every gradient scaled by its own
    hook, with every one copied at the bucket's launch, and with torch's DDP."""
    assert parse_args(["--tables", "6"]).tables == ("big",)
    assert "big" not in parse_args([]).tables
    proc, out = on_request_run
    assert proc.returncode == 0, proc.stderr
    assert "6. ddpkit DDP: a gradient scaled by its own hook, or at its bucket's launch" in proc.stdout
    rows = json.loads(out.read_text())["big_gradients"]
    assert [r["numel"] for r in rows] == [4096, 65536]
    for r in rows:
        for variant in ("own hook", "at launch", "torch"):
            assert r[variant]["median"] > 0 and r[variant]["cpu_median"] > 0
        assert r["own/launch"]["median"] > 0


def test_the_big_tables_variants_put_every_gradient_on_one_path():
    from ddpkit.bench.big_gradients import _AtLaunchBucket, _OwnHookBucket
    from ddpkit.ddp.bucket import BIG_PARAM_NUMEL, Bucket

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (8, BIG_PARAM_NUMEL)]
    assert _OwnHookBucket(0, params, [0, 1], True).num_big == 2
    assert _AtLaunchBucket(0, params, [0, 1], True).num_big == 0
    assert Bucket(0, params, [0, 1], True).num_big == 1


@pytest.mark.timeout(_QUICK_RUN_TIMEOUT)
def test_in_place_table_times_big_gradients_in_place_and_in_buckets(on_request_run):
    """``--tables in_place`` (on request only): each member with big gradients trains with them in
    place and in buckets, whatever the host's cores, beside torch's DDP; the others are named as
    not run."""
    assert parse_args(["--tables", "7"]).tables == ("in_place",)
    assert "in_place" not in parse_args([]).tables
    proc, out = on_request_run
    assert proc.returncode == 0, proc.stderr
    assert "7. ddpkit DDP: big CPU gradients in place, or in buckets" in proc.stdout
    result = json.loads(out.read_text())["in_place"]
    assert [r["model"] for r in result["rows"]] == ["large"] and result["skipped"] == ["small"]
    row = result["rows"][0]
    assert row["big_gradients"] == 4  # the quick large model's four 256 KiB weights
    for variant in ("in place", "buckets", "torch"):
        assert row[variant]["median"] > 0 and row[variant]["cpu_median"] > 0
    assert row["buckets/in place"]["median"] > 0
    # each variant ran the layout it names, whatever this host's cores
    assert row["in place"]["in_place_buckets"] == 4 and row["buckets"]["in_place_buckets"] == 0

