"""``ddpkit bench --pool``: one verdict from the DDP step rounds of several earlier runs.

Where two DDPs sit within a percent of each other, one run cannot tell them apart on a busy machine:
its median over 40 rounds moves by about 1% from run to run and its 95% interval spans 4 to 12%.
Every round is a pair measured seconds apart, so the rounds of several runs (their ``--json``
files, in one setting) pool like the rounds of one longer run, and the interval narrows with the
square root of their number.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from ddpkit.bench.ddp_step import PAIRS, paired_ratio
from ddpkit.bench.report import Table

__all__ = ["BenchFileError", "load_ddp_rounds", "pool_runs", "pool_tables"]


class BenchFileError(ValueError):
    """A file given to ``--pool`` that holds no DDP step rounds: it names the file and what is missing."""


def load_ddp_rounds(path: str) -> tuple[tuple, list[dict]]:
    """``(setting, rows)`` of one ``ddpkit bench --json`` file: the setting (world size, backend,
    device, ``--quick``, ``--steps``) that runs must share to pool, and the DDP step table's rows
    with their rounds."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise BenchFileError(f"--pool {path!r}: cannot read it ({e.strerror or e}).") from e
    except json.JSONDecodeError as e:
        raise BenchFileError(f"--pool {path!r}: not JSON ({e.msg} at line {e.lineno}).") from e
    rows = data.get("ddp_step", {}).get("rows") if isinstance(data, dict) else None
    if not rows:
        raise BenchFileError(f"--pool {path!r}: no DDP step rounds in it. HINT: pool the --json files of "
                             "runs that included table 2, e.g. ddpkit bench --tables ddp --json run1.json.")
    malformed = next((i for i, r in enumerate(rows) if not isinstance(r, dict) or not {"model", "variant"} <= r.keys()),
                     None) if isinstance(rows, list) else 0
    if malformed is not None:
        raise BenchFileError(f"--pool {path!r}: DDP step row {malformed} lacks its model or variant: not a file "
                             "ddpkit bench --json wrote, or one edited since.")
    meta = data.get("meta", {})
    config = meta.get("config", {})  # --quick builds smaller models, --steps changes what a round is
    return (meta.get("world_size"), meta.get("backend"), meta.get("device"), bool(config.get("quick")),
            config.get("steps")), rows


def pool_runs(runs: Sequence[list[dict]]) -> dict[str, dict[str, dict]]:
    """Per model and pair (``"ddpkit/torch"``...): the pooled figures of ``paired_ratio`` over
    every run's rounds, with ``rounds`` and each run's own ``run_medians``."""
    pooled: dict[str, dict[str, dict]] = {}
    models = dict.fromkeys(r["model"] for rows in runs for r in rows)
    for model in models:
        for a, b in PAIRS:
            xs, ys, per_run = [], [], []
            for rows in runs:
                by = {r["variant"]: r for r in rows if r["model"] == model and r.get("available")}
                if a in by and b in by:
                    xs += by[a]["times"]
                    ys += by[b]["times"]
                    per_run.append(paired_ratio(by[a]["times"], by[b]["times"])["median"])
            if xs:
                figures = paired_ratio(xs, ys)
                pooled.setdefault(model, {})[f"{a}/{b}"] = dict(figures, rounds=len(xs), run_medians=per_run)
    return pooled


def _verdict(a: str, b: str, figures: dict) -> str:
    if figures["ci_low"] is None:
        return "too few rounds"
    if figures["ci_high"] < 1:
        return f"{a} faster"
    if figures["ci_low"] > 1:
        return f"{b} faster"
    return "within noise"


def pool_tables(paths: Sequence[str]) -> list[Table]:
    """One table per setting (world size, backend, device, ``--quick``, ``--steps``) among ``paths``."""
    groups: dict[tuple, list[tuple[str, list[dict]]]] = {}
    for path in paths:
        setting, rows = load_ddp_rounds(path)
        groups.setdefault(setting, []).append((path, rows))
    tables = []
    for (world_size, backend, device, quick, steps), runs in groups.items():
        pooled = f"{len(runs)} runs pooled" if len(runs) > 1 else "1 run"
        setting = f"{world_size} ranks, {backend}, {device}, {steps} steps per repeat" + (", quick" if quick else "")
        table = Table(f"2. DDP step time, {pooled} ({setting})",
                      ["model", "pair", "rounds", "median", "95% interval", "verdict", "each run's median"])
        for model, pairs in pool_runs([rows for _, rows in runs]).items():
            for pair, f in pairs.items():
                interval = "-" if f["ci_low"] is None else f"{f['ci_low']:.3f}-{f['ci_high']:.3f}"
                table.add(model, pair, f["rounds"], f"{f['median']:.3f}", interval, _verdict(*pair.split("/"), f),
                          " ".join(f"{m:.3f}" for m in f["run_medians"]))
        table.notes.append("runs: " + ", ".join(os.path.basename(p) for p, _ in runs))
        table.notes.append("a/b: median over all runs' rounds of a's step time over b's in the same round; "
                           "within noise: the 95% interval holds 1.")
        tables.append(table)
    return tables
