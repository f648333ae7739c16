"""The ``module.`` prefix of wrapped models: state dicts that load into wrapped and bare models alike.

A model wrapped in DDP or DataParallel has keys starting with ``module.``, and one compiled by
``torch.compile`` keys starting with ``_orig_mod.``. ``load_state_dict`` loads such a dict into a
wrapped, compiled or bare model, deciding by the target's own keys, and raises when nothing fits
instead of guessing.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, Callable, Mapping

from torch import nn

from ddpkit.errors import StateDictMismatchError, explain

__all__ = ["PREFIX", "COMPILED_PREFIX", "unwrap_state_dict", "wrap_state_dict", "load_state_dict", "unwrap_model"]

PREFIX = "module."
"""What DistributedDataParallel and DataParallel put in front of the wrapped module's keys."""

COMPILED_PREFIX = "_orig_mod."
"""What ``torch.compile``'s ``OptimizedModule`` puts in front of the compiled module's keys."""


def unwrap_state_dict(state_dict: Mapping[str, Any], prefix: str = PREFIX) -> OrderedDict[str, Any]:
    """A copy of a wrapped model's state dict with ``prefix`` removed from every key.

    Raises:
        ValueError: some key does not start with ``prefix`` (then it is not a wrapped model's dict).
    """
    lacking = [k for k in state_dict if not k.startswith(prefix)]
    if lacking:
        raise ValueError(explain(f"cannot unwrap: {len(lacking)} of {len(state_dict)} keys do not start "
                                 f"with {prefix!r}, e.g. {lacking[:3]}.", "only a state dict taken from a "
                                 "DDP/DataParallel-wrapped model has the prefix on every key."))
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
        raise ValueError(explain(f"cannot wrap: {len(having)} of {len(state_dict)} keys already start with "
                                 f"{prefix!r}, e.g. {having[:3]}.", "the dict is already wrapped; load it as is."))
    return _prefixed(state_dict, prefix)


def _prefixed(state_dict: Mapping[str, Any], prefix: str) -> OrderedDict[str, Any]:
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
    key has it and that gives the module's keys; with ``prefix`` added when that gives the module's
    keys (a bare model whose own submodule is called ``module`` has it on every key already). A
    ``torch.compile``'d model's ``_orig_mod.`` counts as a wrapper's prefix too: the prefixes every
    key of the dict starts with may be removed, and then those of the target's own wrappers
    (``compile(DDP(m))``: ``_orig_mod.module.``) added. Nothing else is guessed.

    Returns:
        torch's ``(missing_keys, unexpected_keys)``.
    Raises:
        StateDictMismatchError: with ``strict=True``, when no variant matches (a RuntimeError); its
            ``missing`` and ``unexpected`` keys are the closest variant's. With ``strict=False`` the
            variant sharing most keys is loaded non-strictly.
    """
    target = list(module.state_dict().keys())
    wanted = set(target)
    variants: list[tuple[str, Mapping[str, Any]]] = [("as is", state_dict)]
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        variants.append((f"with {prefix!r} removed", unwrap_state_dict(state_dict, prefix)))
    # also where the keys start with it already, for a wrapped model: a bare model whose own
    # submodule is "module" has it on every key
    if state_dict and (not any(k.startswith(prefix) for k in state_dict) or any(k.startswith(prefix) for k in target)):
        variants.append((f"with {prefix!r} added", _prefixed(state_dict, prefix)))
    variants += _wrapper_variants(state_dict, _wrappers_prefix(module, prefix), (prefix, COMPILED_PREFIX))
    for _, candidate in variants:
        if set(candidate) == wanted:
            return module.load_state_dict(candidate, strict=strict)
    best_name, best = max(variants, key=lambda v: len(wanted & set(v[1])))
    if not strict:
        return module.load_state_dict(best, strict=False)
    missing = [k for k in target if k not in best]
    unexpected = [k for k in best if k not in wanted]
    tried = ", ".join(dict.fromkeys(name for name, _ in variants))
    matching = len(wanted & set(best))
    raise StateDictMismatchError(explain(
        f"the state dict does not fit {type(module).__name__} (tried it {tried}). Closest, {best_name}: "
        f"{len(missing)} of the model's keys are missing{_eg(missing)}; {len(unexpected)} keys "
        f"are unexpected{_eg(unexpected)}.",
        "was the checkpoint saved from another model? " + (
            f"Pass strict=False to load the keys that match ({matching} of {len(target)})." if matching else
            "No key matches in any of these forms, so strict=False would load nothing.")),
        missing=missing, unexpected=unexpected)


def _wrappers_prefix(module: nn.Module, prefix: str) -> str:
    """What ``module``'s wrappers put before the innermost module's keys, outermost first:
    ``_orig_mod.module.`` for ``torch.compile(DDP(m))``."""
    out = ""
    while (layer := _peel(module, prefix)) is not None:
        out, module = out + layer[0], layer[1]
    return out


def _wrapper_variants(state_dict: Mapping[str, Any], outer: str,
                      segments: tuple[str, ...]) -> list[tuple[str, Mapping[str, Any]]]:
    """The dict with the wrapper prefixes that every key starts with removed, one after another,
    each also with ``outer`` (the target's wrappers) added."""
    forms: list[tuple[str, Mapping[str, Any]]] = [("", state_dict)]
    while forms[-1][1]:
        removed, current = forms[-1]
        segment = next((s for s in segments if all(k.startswith(s) for k in current)), None)
        if segment is None:
            break
        forms.append((removed + segment, unwrap_state_dict(current, segment)))
    variants = [(f"with {removed!r} removed", form) for removed, form in forms[1:]]
    if outer:
        variants += [(f"with {removed!r} removed and {outer!r} added" if removed else f"with {outer!r} added",
                      _prefixed(form, outer)) for removed, form in forms]
    return variants


def _eg(keys: list[str]) -> str:
    return f", e.g. {keys[:3]}" if keys else ""


def unwrap_model(module: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel wrappers (ddpkit's or torch's) and ``torch.compile``'s
    ``OptimizedModule``, in either order, or ``module`` itself."""
    while (layer := _peel(module, PREFIX)) is not None:
        module = layer[1]
    return module


def _peel(module: nn.Module, prefix: str) -> tuple[str, nn.Module] | None:
    """For a wrapper, the prefix it puts before its inner module's keys and that module; else None."""
    if isinstance(module, _wrapper_types()):
        return prefix, module.module
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing is compiled
    compiled = getattr(eval_frame, "OptimizedModule", None)
    if compiled is not None and isinstance(module, compiled):
        return COMPILED_PREFIX, module._orig_mod
    return None


def _wrapper_types() -> tuple[type, ...]:
    from ddpkit.ddp.distributed import DistributedDataParallel  # imported late: they import checkpoints' users
    from ddpkit.dp.data_parallel import DataParallel

    return (nn.DataParallel, nn.parallel.DistributedDataParallel, DataParallel, DistributedDataParallel)
