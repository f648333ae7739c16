"""ddpkit's typed errors: the facts of a failure as fields, not only as words in a message.

Each class subclasses what ddpkit raised before it existed, so ``except RuntimeError`` or ``except
ValueError`` in users' code still catches it; code that must act on a failure (retry the rendezvous,
fix a launcher variable, name the unused parameters) reads ``err.by_rank`` or ``err.variable``
instead of parsing ``str(err)``, whose wording may change. ``explain`` gives every message its one
shape, ``"<who> on rank <r>: <what happened> HINT: <the fix>"``.

This module imports nothing of ddpkit, so that every part of ddpkit can raise these.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["explain", "NotAModuleError", "UnusedParametersError", "SecondGradientError",
           "LateGradientError", "StaticGraphChangedError", "DenseGradientError", "RanksDisagreeError", "CommHookError",
           "NotInitializedError", "LauncherVariableError", "RendezvousError", "CheckpointSaveError",
           "StateDictMismatchError", "CollectiveMismatchError", "ReplicaCountError", "BatchDimError", "EmptyListError",
           "OutputKeysError", "MixedPrecisionError"]


def explain(what: str, hint: str | None = None, *, who: str | None = None, rank: int | None = None) -> str:
    """``"<who> on rank <rank>: <what> HINT: <hint>"``, leaving out the parts not given.

    ``who`` names the API that speaks and ``rank`` (only with ``who``) where, when ranks may say
    different things; ``hint`` is the fix. Example: ``explain("bad.", "do this.", who="DDP", rank=1)``
    gives ``"DDP on rank 1: bad. HINT: do this."``.
    """
    if who is not None:
        where = "" if rank is None else f" on rank {rank}"
        what = f"{who}{where}: {what}"
    return what if hint is None else f"{what} HINT: {hint}"


def rank_prefix(rank: int) -> str:
    """``"[rank3]: "`` before a line a rank writes to stderr itself, as torch prefixes a rank's traceback
    (one pattern to grep for under srun or mpirun); none under ``ddpkit run``, which prefixes each
    worker's lines so already."""
    return "" if os.environ.get("DDPKIT_LAUNCHER") == "ddpkit" else f"[rank{rank}]: "


class _Facts:
    """What the typed errors share: the facts survive pickling (a spawned rank sends its error to
    its parent pickled), which the default reduce loses, as it calls ``cls(message)`` alone."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, self.__dict__)  # type: ignore[attr-defined]


def _rebuild(cls: type, args: tuple, facts: dict[str, Any]) -> BaseException:
    error = cls.__new__(cls, *args)
    error.__dict__.update(facts)
    return error


# ---- DistributedDataParallel's backward pass ---------------------------------------------------------
class UnusedParametersError(_Facts, RuntimeError):
    """Some rank's backward left parameters without a gradient, so their buckets could not be averaged.

    Every rank raises it, with the same ``by_rank``: the parameter names each rank lacked (only the
    ranks that lacked some). ``rank`` is the rank that raised it.
    """

    def __init__(self, message: str, *, rank: int, by_rank: dict[int, list[str]], static_graph: bool) -> None:
        super().__init__(message)
        self.rank, self.by_rank, self.static_graph = rank, by_rank, static_graph


class SecondGradientError(_Facts, RuntimeError):
    """``parameter`` got a gradient twice in one backward, or after it was reduced as unused
    (``reduced_as_unused``)."""

    def __init__(self, message: str, *, rank: int, parameter: str, reduced_as_unused: bool) -> None:
        super().__init__(message)
        self.rank, self.parameter, self.reduced_as_unused = rank, parameter, reduced_as_unused


class LateGradientError(_Facts, RuntimeError):
    """The gradient of ``parameter``, one of ``delay_all_reduce_named_params``, was computed after
    that of ``hook_parameter`` (``param_to_hook_all_reduce``), whose gradient launches their
    all-reduce: it was averaged incomplete, and the ranks would hold different gradients."""

    def __init__(self, message: str, *, rank: int, parameter: str, hook_parameter: str) -> None:
        super().__init__(message)
        self.rank, self.parameter, self.hook_parameter = rank, parameter, hook_parameter


class StaticGraphChangedError(_Facts, RuntimeError):
    """With ``static_graph=True``, ``parameter`` got more gradients than the ``first_count`` of the
    first iteration."""

    def __init__(self, message: str, *, rank: int, parameter: str, first_count: int) -> None:
        super().__init__(message)
        self.rank, self.parameter, self.first_count = rank, parameter, first_count


class DenseGradientError(_Facts, TypeError, RuntimeError):
    """The gradient of ``parameter``, a sparse embedding's weight, came out dense (a hook densified
    it, or the weight is shared with a dense layer). A RuntimeError, as torch's "Expected variable to
    have sparse gradient", and a TypeError, as ddpkit raised before."""

    def __init__(self, message: str, *, rank: int, parameter: str) -> None:
        super().__init__(message)
        self.rank, self.parameter = rank, parameter


class CommHookError(_Facts, TypeError, RuntimeError):
    """A comm hook broke the contract ``hook(state, bucket) -> Future[Tensor]``.

    Both a TypeError and a RuntimeError: the hook's failures were one or the other (not callable, not a
    Future: TypeError; a result of the wrong size: RuntimeError), and ``except`` clauses for either
    must keep catching them. ``hook``: its name, or its type's when it is not a function.
    """

    def __init__(self, message: str, *, rank: int, hook: str) -> None:
        super().__init__(message)
        self.rank, self.hook = rank, hook


# ---- DistributedDataParallel's construction ----------------------------------------------------------
class NotAModuleError(_Facts, TypeError, AttributeError):
    """DistributedDataParallel was given something other than an ``nn.Module``. Also an
    AttributeError, the type torch's DDP raises for it (the object has no ``named_parameters``)."""

    def __init__(self, message: str, *, got: str) -> None:
        super().__init__(message)
        self.got = got


def not_a_module_error(module: object, who: str = "DistributedDataParallel") -> NotAModuleError:
    """``who`` (DDP or DataParallel) was given ``module``, which is not an ``nn.Module``."""
    got = type(module).__name__
    short = "DDP" if who == "DistributedDataParallel" else who
    return NotAModuleError(explain(f"{who} wraps a torch.nn.Module, got {got} {module!r:.60}.",
                                   f"wrap the model, an nn.Module instance: {short}(model)."), got=got)


class MixedPrecisionError(_Facts, TypeError, AttributeError):
    """``mixed_precision`` lacks a field DistributedDataParallel reads (``missing``). Also an
    AttributeError, the type torch's DDP raises for it (``'str' object has no attribute 'param_dtype'``)."""

    def __init__(self, message: str, *, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


class RanksDisagreeError(_Facts, RuntimeError):
    """The ranks could not build one DistributedDataParallel together.

    ``differing_rank`` differs from rank 0 (its parameters or buffers), or refused its own arguments;
    ``difference`` says how: the first differing tensor, or that rank's error as ``"Type: message"``.
    ``rank`` is the rank that raised it.
    """

    def __init__(self, message: str, *, rank: int, differing_rank: int, difference: str) -> None:
        super().__init__(message)
        self.rank, self.differing_rank, self.difference = rank, differing_rank, difference


# ---- DataParallel's primitives ------------------------------------------------------------------------
class ReplicaCountError(_Facts, ValueError, AssertionError):
    """``parallel_apply`` got a list (``argument``: inputs, kwargs_tup or devices) whose length
    (``found``) is not the number of modules (``expected``). Also an AssertionError, the type
    torch's ``parallel_apply`` raises for it."""

    def __init__(self, message: str, *, argument: str, expected: int, found: int) -> None:
        super().__init__(message)
        self.argument, self.expected, self.found = argument, expected, found


class BatchDimError(_Facts, ValueError, IndexError, RuntimeError):
    """``scatter`` or ``gather`` (``action``) met a tensor of ``shape`` that has no dimension ``dim``
    (or none at all). Also what torch raises there: IndexError for a dim out of range, RuntimeError
    for a 0-dim tensor."""

    def __init__(self, message: str, *, action: str, dim: int, shape: tuple[int, ...]) -> None:
        super().__init__(message)
        self.action, self.dim, self.shape = action, dim, shape


class EmptyListError(_Facts, ValueError, IndexError, RuntimeError):
    """A DataParallel primitive got an empty list for ``argument`` (device_ids, target_devices or
    outputs). Also the types torch raises there: IndexError where it reads the first entry,
    RuntimeError ("device type could not be determined") from ``data_parallel`` without CUDA."""

    def __init__(self, message: str, *, argument: str) -> None:
        super().__init__(message)
        self.argument = argument


class OutputKeysError(_Facts, ValueError, KeyError):
    """``gather`` met dicts whose keys differ between replicas (``found``: each one's keys). Also a
    KeyError, what torch's gather raises when the keys differ but not their number."""

    def __init__(self, message: str, *, found: list) -> None:
        super().__init__(message)
        self.found = found

    def __str__(self) -> str:  # KeyError's would be the repr of the message
        return str(self.args[0]) if self.args else ""


# ---- the job: launcher variables, process group, rendezvous ------------------------------------------
class LauncherVariableError(_Facts, ValueError):
    """The launcher's variables are incomplete or contradict each other.

    ``variable``: the one to set or fix (of a contradicting pair, the one checked against the other);
    ``value``: its value as text, None when it is unset.
    """

    def __init__(self, message: str, *, variable: str, value: str | None) -> None:
        super().__init__(message)
        self.variable, self.value = variable, value


class NotInitializedError(_Facts, RuntimeError, ValueError):
    """A launcher started ``world_size`` processes, but ``needed_by`` ran before ``ddpkit.init()``:
    each rank would act alone. Also a ValueError, the type of torch's own "Default process group has
    not been initialized"."""

    def __init__(self, message: str, *, needed_by: str, rank: int, world_size: int, launcher: str) -> None:
        super().__init__(message)
        self.needed_by, self.rank, self.world_size, self.launcher = needed_by, rank, world_size, launcher


class RendezvousError(_Facts, RuntimeError):
    """Processes or nodes could not meet at ``address`` (``host:port``).

    ``timeout``: the seconds waited when the failure is a deadline that passed, else None (refused at
    once: a port in use, a disagreement, an interruption).
    """

    def __init__(self, message: str, *, address: str, timeout: float | None) -> None:
        super().__init__(message)
        self.address, self.timeout = address, timeout


# ---- checkpoints ------------------------------------------------------------------------------------
class CheckpointSaveError(_Facts, RuntimeError):
    """Raised on the other ranks when rank 0 failed to write ``path``; ``error`` is rank 0's error as
    ``"Type: message"`` (rank 0 raises the error itself)."""

    def __init__(self, message: str, *, path: str, error: str) -> None:
        super().__init__(message)
        self.path, self.error = path, error


class StateDictMismatchError(_Facts, RuntimeError):
    """No variant of the state dict (as is, prefix removed or added) has the model's keys; ``missing``
    and ``unexpected`` are the keys of the closest one."""

    def __init__(self, message: str, *, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message)
        self.missing, self.unexpected = missing, unexpected


# ---- collectives: hangs and mismatches ---------------------------------------------------------------
class CollectiveMismatchError(_Facts, RuntimeError):
    """With ``DDPKIT_CHECK_COLLECTIVES=1``, the members of ``group`` (its global ranks) were about to
    run different collectives as number ``seq``; ``by_rank`` maps each rank to its
    ``"op dtype[shape] at file:line in function()"``. Every member raises it."""

    def __init__(self, message: str, *, rank: int, seq: int, group: list[int], by_rank: dict[int, str]) -> None:
        super().__init__(message)
        self.rank, self.seq, self.group, self.by_rank = rank, seq, group, by_rank
