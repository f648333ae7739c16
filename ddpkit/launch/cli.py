"""``ddpkit run`` entry point: parse the flags, run the job, turn setup errors into one clear line."""
from __future__ import annotations

import os
import sys

from ddpkit.launch.config import parse_args

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``ddpkit run [flags] SCRIPT [ARGS...]``; returns the exit code (2 for bad flags).

    Makes this process a child subreaper, so it should be the launcher process itself (the
    ``ddpkit`` command or ``python -m ddpkit run``), not a long-lived host process.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = parse_args(argv)
        if config.log_dir is not None:
            _check_log_dir(config.log_dir)
        _check_script(config.command)
    except ValueError as e:
        print(f"ddpkit run: error: {e}", file=sys.stderr)
        return 2
    for note in config.notes:
        print(f"ddpkit run: note: {note}", file=sys.stderr)
    environ = dict(os.environ)  # the workers get the user's environment unchanged
    if "TORCH_CPP_LOG_LEVEL" not in environ:
        _quiet_torch_cpp_logs()

    from ddpkit.launch.signals import become_subreaper
    from ddpkit.launch.supervisor import run

    become_subreaper()
    return run(config, environ)


def _quiet_torch_cpp_logs() -> None:
    """Keep c10d's C++ warnings (with their stack traces) out of the launcher's own output.

    A lost connection to another node's store is reported by the launcher in one line; c10d would
    also log it with a C++ stack trace. torch reads TORCH_CPP_LOG_LEVEL as it loads, which the
    launcher does after it copied the workers' environment: the variable is set for this process only.
    Where torch is loaded already (``--nproc-per-node gpu`` or ``auto``), this sets the flag the
    variable sets (c10's ``FLAGS_caffe2_log_level``, 3 = FATAL): torch has no Python API for the level.
    """
    if "torch" not in sys.modules:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        return
    import ctypes
    import glob

    import torch

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
        try:
            ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level").value = 3
            return
        except (OSError, ValueError):
            continue  # another build of torch: its C++ warnings stay visible, nothing worse


def _check_log_dir(path: str) -> None:
    """Create ``--log-dir`` and write a file in it now, not after the workers started."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        raise ValueError(f"--log-dir {path!r} is an existing file, not a directory.") from None
    except OSError as e:
        raise ValueError(f"--log-dir {path!r} cannot be written to: {e.strerror or e}.") from None


def _check_script(command: tuple[str, ...]) -> None:
    """A script path that does not exist fails here, once, not in every worker after they started."""
    if len(command) < 3 or command[:2] != (sys.executable, "-u") or command[2] == "-m":
        return  # --no-python's program or -m's module: found, or not, where the workers run it
    script = command[2]
    if not os.path.exists(script):
        from ddpkit.errors import explain

        raise ValueError(explain(
            f"the training script {script!r} does not exist (looked for it from {os.getcwd()}).",
            "give the script's path as the workers will open it, or -m for a module."))
