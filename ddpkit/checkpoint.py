"""Checkpoints that survive a crash: ``ddpkit.save`` / ``ddpkit.load`` and the helpers around them.

``save`` writes on the main process only, to a temporary file in the same directory that is flushed,
fsynced and then renamed over the target (``os.replace`` is atomic on POSIX and Windows), and the
directory is fsynced so the rename itself is durable. A process killed mid-write leaves at worst a
stray ``.<name>.tmp-*`` file: the previous checkpoint under ``path`` is never torn or emptied. The
other ranks wait until the file is complete, so they may read it as soon as ``save`` returns.

State dicts are saved as they are; a model wrapped in DDP or DataParallel has keys starting with
``module.``. ``load_state_dict`` loads such a dict into a wrapped or an unwrapped model, deciding by
the target's own keys, and raises when neither fits instead of guessing.
"""
from __future__ import annotations

import os
import random
import re
import sys
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ddpkit.comm import broadcast_object
from ddpkit.process_group import current_env, is_main_process, require_group_when_launched

__all__ = [
    "save",
    "load",
    "latest_checkpoint",
    "unwrap_state_dict",
    "wrap_state_dict",
    "load_state_dict",
    "unwrap_model",
    "capture_rng_state",
    "restore_rng_state",
    "PREFIX",
]

PREFIX = "module."
"""What DistributedDataParallel and DataParallel put in front of the wrapped module's keys."""

_TMP_MARK = ".tmp-"


# --------------------------------------------------------------------------------------------------
# save / load


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` from the main process, atomically; every rank returns once it is on disk.

    Missing parent directories are created. Call it on every rank, not under ``if rank == 0:`` as
    with ``torch.save``: it synchronises the ranks, and rank 0 alone would wait for the others.

    Raises:
        TypeError: ``path`` is not a path.
        RuntimeError: on ranks other than 0 when rank 0 failed to write (rank 0 raises its own error).
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
            raise
    # doubles as the barrier: no rank returns before rank 0 has renamed the file into place
    error = broadcast_object(error)
    if error is not None:
        raise RuntimeError(f"rank 0 failed to save the checkpoint {str(path)!r}: {error}")


def load(path: str | os.PathLike[str], map_location: Any = None, **kwargs: Any) -> Any:
    """Read a checkpoint on this rank, onto this process's device by default.

    Args:
        map_location: as for ``torch.load``; default ``ddpkit.init()``'s device (``cuda:<local_rank>``
            or ``cpu``), so tensors land where this rank computes.
        kwargs: passed to ``torch.load`` (e.g. ``weights_only=False`` for arbitrary pickled objects;
            torch's default, ``weights_only=True``, covers tensors, containers and numbers).

    Raises:
        FileNotFoundError: no file at ``path``; the message names it.
    """
    path = _as_path(path)
    if not path.is_file():
        where = path.parent if str(path.parent) else Path(".")
        hint = "" if where.is_dir() else f" (the directory {str(where)!r} does not exist either)"
        raise FileNotFoundError(
            2, f"no checkpoint at {str(path)!r}{hint}. HINT: ddpkit.checkpoint.latest_checkpoint(dir) "
               "finds the newest complete one in a directory, or None", str(path))
    if map_location is None:
        env = current_env()
        map_location = env.device if env is not None and env.device is not None else "cpu"
    return torch.load(path, map_location=map_location, **kwargs)


def _as_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}. HINT: for "
                        "file objects use torch.save directly; ddpkit.save needs a path to be atomic.")
    return Path(path)


def _atomic_save(obj: Any, path: Path) -> None:
    directory = path.parent
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


# --------------------------------------------------------------------------------------------------
# finding the newest checkpoint


def latest_checkpoint(directory: str | os.PathLike[str], pattern: str = "*.pt") -> Path | None:
    """The newest complete checkpoint in ``directory`` matching ``pattern``, or None.

    Newest means the largest number in the file name (``step_00000120.pt``), then the latest
    modification time. Complete means not one of ``save``'s temporary files and a whole zip archive
    (torch's format): a file torn by a writer that was not atomic lacks the archive's trailing
    directory and is skipped.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    candidates = [p for p in directory.glob(pattern)
                  if p.is_file() and _TMP_MARK not in p.name and zipfile.is_zipfile(p)]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (_step_of(p), p.stat().st_mtime_ns, p.name))


def _step_of(path: Path) -> int:
    numbers = re.findall(r"\d+", path.stem)
    return int(numbers[-1]) if numbers else -1


# --------------------------------------------------------------------------------------------------
# the "module." prefix of wrapped models


def unwrap_state_dict(state_dict: Mapping[str, Any], prefix: str = PREFIX) -> OrderedDict[str, Any]:
    """A copy of a wrapped model's state dict with ``prefix`` removed from every key.

    Raises:
        ValueError: some key does not start with ``prefix`` (then it is not a wrapped model's dict).
    """
    lacking = [k for k in state_dict if not k.startswith(prefix)]
    if lacking:
        raise ValueError(f"cannot unwrap: {len(lacking)} of {len(state_dict)} keys do not start with "
                         f"{prefix!r}, e.g. {lacking[:3]}. HINT: only a state dict taken from a "
                         "DDP/DataParallel-wrapped model has the prefix on every key.")
    top = prefix.rstrip(".")

    def module_path(path: str) -> str | None:  # the wrapper's own entry ("") has no place inside
        return "" if path == top else path[len(prefix):] if path.startswith(prefix) else None

    return _rename(state_dict, lambda k: k[len(prefix):], module_path)


def wrap_state_dict(state_dict: Mapping[str, Any], prefix: str = PREFIX) -> OrderedDict[str, Any]:
    """A copy of a state dict with ``prefix`` put in front of every key, as a wrapped model has them.

    Raises:
        ValueError: some key already starts with ``prefix`` (the dict looks wrapped already).
    """
    having = [k for k in state_dict if k.startswith(prefix)]
    if having:
        raise ValueError(f"cannot wrap: {len(having)} of {len(state_dict)} keys already start with "
                         f"{prefix!r}, e.g. {having[:3]}. HINT: the dict is already wrapped; load it as is.")
    top = prefix.rstrip(".")
    return _rename(state_dict, lambda k: prefix + k, lambda path: prefix + path if path else top)


def _rename(state_dict: Mapping[str, Any], rename_key: Callable[[str], str],
            rename_path: Callable[[str], str | None]) -> OrderedDict[str, Any]:
    out = OrderedDict((rename_key(k), v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # per-module versions (BatchNorm's, for one), keyed by module path; load_state_dict reads them
        renamed = OrderedDict()
        for path, value in metadata.items():
            new = rename_path(path)
            if new is not None:
                renamed[new] = value
        out._metadata = renamed  # type: ignore[attr-defined]
    return out


def load_state_dict(module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True,
                    prefix: str = PREFIX):
    """``module.load_state_dict(state_dict)`` that bridges wrapped and unwrapped models.

    The dict is loaded as is when its keys are the module's; with ``prefix`` stripped when every
    key has it and that gives the module's keys; with ``prefix`` added when no key has it and that
    gives the module's keys. Nothing else is guessed.

    Returns:
        torch's ``(missing_keys, unexpected_keys)``.
    Raises:
        RuntimeError: with ``strict=True``, when no variant matches; the message lists what is missing
            and unexpected. With ``strict=False`` the variant sharing most keys is loaded non-strictly.
    """
    target = list(module.state_dict().keys())
    wanted = set(target)
    variants: list[tuple[str, Mapping[str, Any]]] = [("as is", state_dict)]
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        variants.append((f"with {prefix!r} removed", unwrap_state_dict(state_dict, prefix)))
    if state_dict and not any(k.startswith(prefix) for k in state_dict):
        variants.append((f"with {prefix!r} added", wrap_state_dict(state_dict, prefix)))
    for _, candidate in variants:
        if set(candidate) == wanted:
            return module.load_state_dict(candidate, strict=strict)
    best_name, best = max(variants, key=lambda v: len(wanted & set(v[1])))
    if not strict:
        return module.load_state_dict(best, strict=False)
    missing = [k for k in target if k not in best]
    unexpected = [k for k in best if k not in wanted]
    tried = ", ".join(name for name, _ in variants)
    raise RuntimeError(
        f"the state dict does not fit {type(module).__name__} (tried it {tried}). Closest, {best_name}: "
        f"{len(missing)} of the model's keys are missing{_eg(missing)}; {len(unexpected)} keys "
        f"are unexpected{_eg(unexpected)}. HINT: was the checkpoint saved from another model? "
        "Pass strict=False to load the keys that match.")


def _eg(keys: list[str]) -> str:
    return f", e.g. {keys[:3]}" if keys else ""


def unwrap_model(module: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel wrappers (ddpkit's or torch's), or ``module`` itself."""
    wrappers = _wrapper_types()
    while isinstance(module, wrappers):
        module = module.module
    return module


def _wrapper_types() -> tuple[type, ...]:
    types: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    for module_name, class_name in (("ddpkit.data_parallel", "DataParallel"),
                                    ("ddpkit.distributed", "DistributedDataParallel")):
        try:
            module = __import__(module_name, fromlist=[class_name])
            types.append(getattr(module, class_name))
        except (ImportError, AttributeError):  # not built in this checkout
            pass
    return tuple(types)


# --------------------------------------------------------------------------------------------------
# random number generators


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, every CUDA device, Python's ``random``, NumPy's if imported.

    Saved in a checkpoint and given back to ``restore_rng_state``, they make dropout, shuffling and
    augmentation after a resume draw what the interrupted run would have drawn. Every value loads
    with ``torch.load(weights_only=True)``. Each rank has its own state: gather them all to save.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                          float(cached))
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what ``capture_rng_state`` returned (tensors may have been loaded onto a GPU)."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss, cached))


def _as_tuple(value: Any) -> Any:
    """random.setstate wants the nested tuples back; a round trip may have made lists of them."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
