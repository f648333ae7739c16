"""A worker's stdout and stderr reach the launcher's in the order the worker wrote them, where the
launcher's two streams are one destination (a terminal, ``2>&1``); apart, each keeps its stream."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.launch.logs import one_pipe

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """\
import sys
for i in range(40):
    print(f"out {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
print("last print", flush=True)
raise RuntimeError("bad batch")
"""
WRITTEN = [line for i in range(40) for line in (f"out {i}", f"err {i}")] + ["last print"]


def _launch(tmp_path: Path, **streams) -> subprocess.CompletedProcess:
    script = tmp_path / "prints.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", "1", str(script)]
    return subprocess.run(command, cwd=REPO, text=True, timeout=60, **streams)


def _worker_lines(text: str) -> list[str]:
    return [line.removeprefix("[rank0]: ") for line in text.splitlines() if line.startswith("[rank0]: ")]


@pytest.mark.timeout(90)
def test_one_destination_gets_the_workers_lines_in_the_order_written(tmp_path):
    result = _launch(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert result.returncode == 1
    lines = _worker_lines(result.stdout)
    assert lines[:len(WRITTEN) + 1] == [*WRITTEN, "Traceback (most recent call last):"]
    assert "last lines of rank 0's output:" in result.stdout and "  RuntimeError: bad batch" in result.stdout


@pytest.mark.timeout(90)
def test_apart_each_stream_keeps_its_own_lines(tmp_path):
    result = _launch(tmp_path, capture_output=True)
    assert result.returncode == 1
    assert _worker_lines(result.stdout) == [line for line in WRITTEN if not line.startswith("err")]
    assert [line for line in _worker_lines(result.stderr) if line.startswith("err")] == [f"err {i}" for i in range(40)]
    assert "last lines of rank 0's stderr:" in result.stderr


def test_streams_share_a_pipe_only_where_redirects_and_tee_treat_them_alike():
    assert one_pipe((False, False))  # both to the log file only
    assert not one_pipe((True, False)) and not one_pipe((False, True))
