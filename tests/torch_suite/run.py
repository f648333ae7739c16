"""torch's own DDP tests, run against ddpkit's DistributedDataParallel (and against torch's, as the baseline).

torch ships its distributed test suite in ``torch/testing/_internal/distributed/distributed_test.py``
(class ``DistributedTest._DistTestBase``); torch's CI runs it through ``test/distributed/test_distributed_spawn.py``,
which mixes it into ``TestDistBackend`` (a ``MultiProcessTestCase``) and spawns one process per rank. This
script does the same, on Gloo with 2 ranks, for the DDP tests only (those whose name or body holds
``DistributedDataParallel`` or ``ddp``), with ``--ddp ddpkit`` or ``--ddp torch``:

    cd <checkout> && PYTHONPATH=$PWD nice -n 19 python3 tests/torch_suite/run.py --ddp ddpkit --out /tmp/ts-ddpkit
    cd <checkout> && PYTHONPATH=$PWD nice -n 19 python3 tests/torch_suite/run.py --ddp torch  --out /tmp/ts-torch
    python3 tests/torch_suite/run.py --compare /tmp/ts-ddpkit /tmp/ts-torch     # the table of differences

With ``--ddp ddpkit`` every rank (the spawned ones too: they re-import this file as ``__mp_main__``) replaces
``torch.nn.parallel.DistributedDataParallel`` and ``distributed_test.DistributedDataParallel`` (the two names the
tests look up) by ddpkit's class. Every construction of a DDP in a rank is counted per test and kind (ddpkit /
torch), so the report shows that the swap took effect: with ddpkit no test builds torch's DDP.

Results go to ``OUT/results.jsonl``, one line per test as it finishes: status passed / failed (an
AssertionError in a rank) / error (any other exception) / timeout / skipped, with the first line of the
exception or torch's skip reason, the seconds taken and the DDP constructions seen. Tests decorated with
``skip_if_lt_x_gpu`` are skipped without spawning (this machine has no GPU; the reason is torch's own wording).
``--gpu-gated-only`` runs just those, with the ``skip_if_lt_x_gpu`` wrapper taken off in every rank
(most then fail in torch too: they call CUDA).
``-k SUBSTRING`` narrows the selection, ``--timeout`` is the per-test limit (torch's
``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``). Named ``run.py`` so that pytest does not collect it: it needs minutes.

``--suite c10d_gloo --torch-tests DIR`` runs instead torch's ``test/distributed/test_c10d_gloo.py``
(``DistributedDataParallelTest``, with what it inherits from ``test_c10d_common.py``), which the wheel does not
ship: DIR holds both files from torch's source tree. The swap then covers the ``DistributedDataParallel`` name
both modules import.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import tempfile
import time
import unittest

__all__ = ["main"]

_OUT = os.environ.get("DDPKIT_SUITE_OUT", "")
for _flag, _var in (("--suite", "DDPKIT_SUITE"), ("--torch-tests", "DDPKIT_SUITE_TESTS")):
    if _flag in sys.argv:  # the spawned ranks read them when they re-import this file
        os.environ[_var] = sys.argv[sys.argv.index(_flag) + 1]
_C10D = os.environ.get("DDPKIT_SUITE") == "c10d_gloo"
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="ddpkit-torchsuite-"))
if "--timeout" in sys.argv:
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = sys.argv[sys.argv.index("--timeout") + 1]

import logging  # noqa: E402

import torch  # noqa: E402
import torch.nn.parallel  # noqa: E402
from gates import gpu_skip, ungate  # noqa: E402  (beside this file)
from torch.testing._internal import common_distributed  # noqa: E402

import ddpkit  # noqa: E402

if _C10D:  # torch's source-tree tests: DistributedDataParallelTest, 2 ranks on Gloo
    sys.path.insert(0, os.environ.get("DDPKIT_SUITE_TESTS", "."))
    import test_c10d_common  # noqa: E402
    import test_c10d_gloo  # noqa: E402
    _BASE, _SUITE_MODULES = test_c10d_gloo.DistributedDataParallelTest, (test_c10d_gloo, test_c10d_common)
else:
    from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402
    _BASE, _SUITE_MODULES = dt.DistributedTest._DistTestBase, (dt,)

_TORCH_DDP = torch.nn.parallel.DistributedDataParallel
_CURRENT: dict[str, str] = {"test": "unknown"}


def _record(kind: str) -> None:
    """Append one line per DDP construction to OUT/swap/<test>.<pid> (read back by the parent)."""
    if not _OUT:
        return
    os.makedirs(os.path.join(_OUT, "swap"), exist_ok=True)
    with open(os.path.join(_OUT, "swap", f"{_CURRENT['test']}.{os.getpid()}"), "a") as f:
        f.write(kind + "\n")


def _count_constructions(cls: type, kind: str) -> None:
    init = cls.__init__

    def counted(self, *args, **kwargs):
        _record(kind)
        init(self, *args, **kwargs)

    cls.__init__ = counted


def _swap() -> None:
    """In every process: point the names the tests use at ddpkit's class, if asked."""
    _count_constructions(_TORCH_DDP, "torch")
    _count_constructions(ddpkit.DistributedDataParallel, "ddpkit")
    _swap_in_parent(os.environ.get("DDPKIT_SUITE_DDP", "torch"))


def _swap_in_parent(kind: str) -> None:
    if kind == "ddpkit":
        torch.nn.parallel.DistributedDataParallel = ddpkit.DistributedDataParallel
        for module in _SUITE_MODULES:
            module.DistributedDataParallel = ddpkit.DistributedDataParallel


class _SkipReasons(logging.Handler):
    """torch logs a rank's SkipTest reason and exits with a generic code: keep the reason."""

    def emit(self, record: logging.LogRecord) -> None:
        if "skipping test" in record.msg and _OUT:
            with open(os.path.join(_OUT, "swap", f"{_CURRENT['test']}.skip"), "w") as f:
                f.write(str(record.args[-1]))


_swap()
if os.environ.get("DDPKIT_SUITE_UNGATE"):
    ungate(_BASE)
if __name__ == "__mp_main__":
    common_distributed.logger.setLevel(logging.INFO)
    common_distributed.logger.addHandler(_SkipReasons())


class _Named:
    """The test name recorded in each rank (for the count of DDP constructions)."""

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        _CURRENT["test"] = test_name
        os.makedirs(os.path.join(_OUT, "swap"), exist_ok=True)
        super()._run(rank, test_name, file_name, pipe, **kwargs)


if _C10D:
    class SuiteTest(_Named, _BASE):
        """test_c10d_gloo's DistributedDataParallelTest, which spawns its ranks itself."""
else:
    class SuiteTest(_Named, dt.TestDistBackend, _BASE):
        """What torch's test_distributed_spawn.py builds."""

        def setUp(self):
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def _mentions_ddp(name: str) -> bool:
    if _C10D:  # every test of DistributedDataParallelTest
        return True
    fn = getattr(_BASE, name)
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    text = name + inspect.getsource(fn)
    return "DistributedDataParallel" in text or "ddp" in text.lower()


def _selected(pattern: str) -> list[str]:
    """The DDP tests: those whose name or body names DistributedDataParallel or ddp."""
    names = [n for n in dir(_BASE) if n.startswith("test_") and pattern in n]
    return [n for n in names if _mentions_ddp(n)]


_EXC = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Warning|Exit|Interrupt)\b.*$")


def _first_error_line(text: str) -> tuple[str, str]:
    """(status, line): the last 'SomethingError: message' line of a rank's traceback."""
    if "timed out after" in text or "Timing out" in text:
        return "timeout", text.strip().splitlines()[-1][:300]
    lines = [ln for ln in text.splitlines() if _EXC.match(ln.strip())]
    if "exited with error code" in text:
        ranks = text.split("exception:\n")[1] if "exception:\n" in text else text
        lines = [ln for ln in ranks.splitlines() if _EXC.match(ln.strip())] or lines
    line = (lines[-1] if lines else text.strip().splitlines()[-1]).strip()
    return ("failed" if line.startswith("AssertionError") else "error"), line[:300]


def _constructions(out: str, name: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    folder = os.path.join(out, "swap")
    for fname in os.listdir(folder) if os.path.isdir(folder) else []:
        if fname.startswith(name + ".") and not fname.endswith(".skip"):
            with open(os.path.join(folder, fname)) as f:
                for kind in f.read().split():
                    counts[kind] = counts.get(kind, 0) + 1
    return counts


def _run_one(out: str, name: str, gpu_gated: bool) -> dict:
    reason = gpu_skip(_BASE, name)
    if reason is not None and not gpu_gated:
        return {"test": name, "status": "skipped", "why": reason, "seconds": 0.0, "ddp": {}}
    result = unittest.TestResult()
    start = time.time()
    SuiteTest(name).run(result)
    row: dict = {"test": name, "seconds": round(time.time() - start, 1)}
    if result.skipped:
        row["status"], row["why"] = "skipped", result.skipped[0][1]
        skip_file = os.path.join(out, "swap", f"{name}.skip")
        if os.path.exists(skip_file):
            with open(skip_file) as f:
                row["why"] = f.read()
    elif result.failures or result.errors:
        row["status"], row["why"] = _first_error_line((result.failures or result.errors)[0][1])
    else:
        row["status"] = "passed"
    row["ddp"] = _constructions(out, name)
    return row


def _load(out: str) -> dict[str, dict]:
    with open(os.path.join(out, "results.jsonl")) as f:
        return {row["test"]: row for row in map(json.loads, f)}


def _compare(ours: str, theirs: str) -> None:
    a, b = _load(ours), _load(theirs)
    for label, rows in (("ddpkit", a), ("torch", b)):
        counts: dict[str, int] = {}
        for row in rows.values():
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        built = sum(r["ddp"].get("ddpkit", 0) for r in rows.values())
        torch_built = sum(r["ddp"].get("torch", 0) for r in rows.values())
        print(f"{label}: {len(rows)} tests {counts}; DDP built: ddpkit {built}, torch {torch_built}")
    print("\n| test | with ddpkit | first line of the error |\n|---|---|---|")
    for name in sorted(a):
        if name in b and b[name]["status"] == "passed" and a[name]["status"] != "passed":
            why = a[name].get("why", "").replace("|", "\\|")
            print(f"| `{name}` | {a[name]['status']} | {why} |")
    other = [n for n in sorted(a) if n in b and a[n]["status"] != b[n]["status"] and b[n]["status"] != "passed"]
    for name in other:
        print(f"differs, torch not passing: {name}: ddpkit {a[name]['status']}, torch {b[name]['status']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", choices=["ddpkit", "torch"], default="ddpkit")
    parser.add_argument("--out", default="")
    parser.add_argument("-k", default="", help="only the tests whose name holds this")
    parser.add_argument("--timeout", default="300", help="seconds per test")
    parser.add_argument("--gpu-gated-only", action="store_true",
                        help="run only the skip_if_lt_x_gpu tests, with that gate taken off (on CPU)")
    parser.add_argument("--compare", nargs=2, metavar=("DDPKIT_OUT", "TORCH_OUT"))
    parser.add_argument("--suite", choices=["distributed_test", "c10d_gloo"], default="distributed_test",
                        help="torch's distributed_test.py (in the wheel), or test_c10d_gloo.py (see --torch-tests)")
    parser.add_argument("--torch-tests", metavar="DIR",
                        help="with --suite c10d_gloo: the folder holding torch's test_c10d_gloo.py and "
                             "test_c10d_common.py (torch's test/distributed)")
    args = parser.parse_args()
    if args.compare:
        _compare(*args.compare)
        return
    if not args.out:
        parser.error("--out is required")
    os.makedirs(os.path.join(args.out, "swap"), exist_ok=True)
    # the spawned ranks read these when they re-import this file
    os.environ["DDPKIT_SUITE_OUT"], os.environ["DDPKIT_SUITE_DDP"] = args.out, args.ddp
    global _OUT
    _OUT = args.out
    _swap_in_parent(args.ddp)
    done = _load(args.out) if os.path.exists(os.path.join(args.out, "results.jsonl")) else {}
    names = [n for n in _selected(args.k) if n not in done and (not args.gpu_gated_only or gpu_skip(_BASE, n))]
    if args.gpu_gated_only:  # run them anyway: the skip_if_lt_x_gpu wrapper is taken off in the ranks
        os.environ["DDPKIT_SUITE_UNGATE"] = "1"
        ungate(_BASE)
    print(f"{len(names)} tests to run ({len(done)} already in {args.out}), DDP = {args.ddp}", flush=True)
    for i, name in enumerate(names, 1):
        row = _run_one(args.out, name, args.gpu_gated_only)
        with open(os.path.join(args.out, "results.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{i}/{len(names)}] {row['status']:8} {row['seconds']:6.1f}s {name} {row.get('why', '')[:120]}",
              flush=True)


if __name__ == "__main__":
    main()
