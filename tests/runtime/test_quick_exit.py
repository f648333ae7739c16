"""``quick_exit``: ``os._exit`` without leaving multiprocessing's ``pymp-*`` directory in the temp dir."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

import ddpkit.runtime.quick_exit as quick_exit_module

_SCRIPT = textwrap.dedent("""
    import importlib.util
    import multiprocessing as mp
    import sys

    # the module's file, not the package: importing ddpkit would import torch here, in the forkserver
    # and in every child (seconds each), and quick_exit needs none of it
    spec = importlib.util.spec_from_file_location("quick_exit", QUICK_EXIT_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    quick_exit = module.quick_exit

    def child():
        pass

    def child_quick():  # it inherits the name of its parent's directory, not the directory
        quick_exit(0)

    if __name__ == "__main__":
        # the forkserver's socket lives in this process's pymp-* directory
        targets = {"forkserver": [child], "child_quick": [child, child_quick, child], "none": []}[sys.argv[1]]
        for target in targets:
            p = mp.get_context("forkserver").Process(target=target)
            p.start()
            p.join()
            assert p.exitcode == 0, p.exitcode
        if sys.argv[2] == "quick":
            quick_exit(3)
        import os
        os._exit(3)
""")


def _run(tmp_path, start: str, end: str) -> list[str]:
    """What the script leaves in its TMPDIR, having started ``start`` and ended by ``end``."""
    script = tmp_path / f"exit_{start}_{end}.py"
    script.write_text(f"QUICK_EXIT_FILE = {quick_exit_module.__file__!r}\n" + _SCRIPT)
    # short: the forkserver's socket path must fit in AF_UNIX's 108 bytes
    tmpdir = pathlib.Path(tempfile.mkdtemp(prefix="qe-"))
    try:
        return _left_in(tmpdir, script, start, end)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _left_in(tmpdir: pathlib.Path, script: pathlib.Path, start: str, end: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(script), start, end], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "TMPDIR": str(tmpdir)})
    assert proc.returncode == 3, proc.stderr
    return sorted(p.name for p in tmpdir.iterdir())


@pytest.mark.timeout(90)
def test_os_exit_after_a_forkserver_leaves_its_directory_which_quick_exit_removes(tmp_path):
    left = _run(tmp_path, "forkserver", "os")
    assert [name for name in left if name.startswith("pymp-")], left  # what quick_exit is for
    assert _run(tmp_path, "forkserver", "quick") == []


@pytest.mark.timeout(60)
def test_quick_exit_makes_no_directory_where_multiprocessing_made_none(tmp_path):
    assert _run(tmp_path, "none", "quick") == []


@pytest.mark.timeout(90)
def test_a_childs_quick_exit_leaves_its_parents_directory_alone(tmp_path):
    """The parent's first child starts its forkserver, and with it the directory; the second, made
    after, inherits the directory's name and ends by quick_exit; the third still starts through it."""
    assert _run(tmp_path, "child_quick", "quick") == []
