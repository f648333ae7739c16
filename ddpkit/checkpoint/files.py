"""Checkpoint files that survive a crash: ``save`` / ``load`` and ``latest_checkpoint``.

``save`` writes on the main process only, to a temporary file in the same directory that is flushed,
fsynced and then renamed over the target (``os.replace`` is atomic on POSIX and Windows), and the
directory is fsynced so the rename itself is durable. A process killed mid-write leaves at worst a
stray ``.<name>.tmp-*`` file: the previous checkpoint under ``path`` is never torn or emptied. The
other ranks wait until the file is complete, so they may read it as soon as ``save`` returns.
"""
from __future__ import annotations

import errno
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import CheckpointSaveError, explain
from ddpkit.runtime.comm import broadcast_object
from ddpkit.runtime.process_group import current_env, is_main_process, require_group_when_launched

__all__ = ["save", "load", "latest_checkpoint"]

_TMP_MARK = ".tmp-"


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` from the main process, atomically; every rank returns once it is on disk.

    Missing parent directories are created. Call it on every rank, not under ``if rank == 0:`` as
    with ``torch.save``: it synchronises the ranks, and rank 0 alone would wait for the others.

    Raises:
        TypeError: ``path`` is not a path.
        CheckpointSaveError: on ranks other than 0 when rank 0 failed to write (rank 0 raises its own
            error); a RuntimeError.
    """
    path = _as_path(path)
    require_group_when_launched("ddpkit.save", "the other ranks could not wait for rank 0's write")
    error: str | None = None
    if is_main_process():
        try:
            _atomic_save(obj, path)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            broadcast_object(error)  # release the waiting ranks before raising here
            if isinstance(e, Exception) and hasattr(e, "add_note"):  # the OS names the temporary file
                e.add_note(f"ddpkit.save could not write {str(path)!r} (through a temporary file beside it).")
            raise
    # doubles as the barrier: no rank returns before rank 0 has renamed the file into place
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointSaveError(f"rank 0 failed to save the checkpoint {str(path)!r}: {error}",
                                  path=str(path), error=error)


def load(path: str | os.PathLike[str], map_location: Any = None, **kwargs: Any) -> Any:
    """Read a checkpoint on this rank, onto this process's device by default.

    Args:
        map_location: as for ``torch.load``; default ``ddpkit.init()``'s device (``cuda:<local_rank>``
            or ``cpu``), so tensors land where this rank computes.
        kwargs: passed to ``torch.load`` (e.g. ``weights_only=False`` for arbitrary pickled objects;
            torch's default, ``weights_only=True``, covers tensors, containers and numbers).

    Raises:
        FileNotFoundError: no file at ``path`` (or an empty path); the message names it.
        IsADirectoryError: ``path`` is a directory.
    """
    path = _as_path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, explain(
            f"{str(path)!r} is a directory, not a checkpoint file.",
            f"ddpkit.checkpoint.latest_checkpoint({str(path)!r}) gives the newest complete checkpoint in it."))
    if not path.is_file():
        where = path.parent if str(path.parent) else Path(".")
        hint = "" if where.is_dir() else f" (the directory {str(where)!r} does not exist either)"
        env = current_env()
        racing = ("if another rank saves it just before: ddpkit.save is collective, call it on every rank "
                  "(rank 0 writes, the others wait until the file is in place); "
                  if env is not None and env.world_size > 1 else "")
        missing = FileNotFoundError(explain(
            f"no checkpoint at {str(path)!r}{hint}.",
            f"{racing}ddpkit.checkpoint.latest_checkpoint(dir) finds the newest complete one in a directory, "
            "or None."))
        missing.errno = errno.ENOENT  # no filename: OSError would print it again after the hint
        raise missing
    if map_location is None:
        env = current_env()
        map_location = env.device if env is not None and env.device is not None else "cpu"
    return torch.load(path, map_location=map_location, **kwargs)


def _as_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(explain(f"path must be a str or os.PathLike, got {type(path).__name__}.",
                                "for file objects use torch.save directly; ddpkit.save needs a path to be atomic."))
    if os.fspath(path) == "":  # Path("") is the current directory
        raise FileNotFoundError(errno.ENOENT, "the path is empty: name a checkpoint file", "")
    return Path(path)


def _atomic_save(obj: Any, path: Path) -> None:
    directory = path.parent
    blocking = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # mkdir's own words, "File exists: '<that file>'", do not say why it matters
        raise NotADirectoryError(explain(
            f"ddpkit.save cannot write {str(path)!r}: {str(blocking)!r} is a file, not a directory.",
            "give a path whose directories are directories (or can be made), or move that file."))
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{_TMP_MARK}", dir=directory)
    try:
        _permissions_of_a_new_file(fd)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _permissions_of_a_new_file(fd: int) -> None:
    """mkstemp makes the file private (0600); a checkpoint gets what torch.save's open() gives."""
    if hasattr(os, "fchmod"):
        os.fchmod(fd, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would, for every thread, briefly)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)  # no /proc: the one way there is
    os.umask(umask)
    return umask


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable: without this a power loss may bring back the old directory entry."""
    if os.name != "posix":  # Windows cannot open a directory; NTFS journals the rename itself
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(directory: str | os.PathLike[str], pattern: str = "*.pt") -> Path | None:
    """The newest complete checkpoint in ``directory`` matching ``pattern``, or None.

    Newest means the largest numbers in the file name, compared in order (``step_00000120.pt``
    after ``step_00000090_rank0.pt``, ``epoch4_step50.pt`` after ``epoch3_step100.pt``), then the
    latest modification time. Complete means not one of ``save``'s temporary files and a whole zip
    archive (torch's format): a file torn by a writer that was not atomic lacks the archive's
    trailing directory and is skipped. A file in torch's legacy format
    (``_use_new_zipfile_serialization=False``) has no such trailer and is taken as it is.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    candidates = [p for p in directory.glob(pattern)
                  if p.is_file() and _TMP_MARK not in p.name and (zipfile.is_zipfile(p) or _is_legacy(p))]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (_step_of(p), p.stat().st_mtime_ns, p.name))


def _step_of(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.stem))


# torch.save's legacy format begins with its magic number, pickled with protocol 2
_LEGACY_START = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"


def _is_legacy(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_LEGACY_START)) == _LEGACY_START
    except OSError:
        return False


