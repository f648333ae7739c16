"""torch's distributed-checkpoint keys for ddpkit's DDP: the same as for torch's, without ``module.``.

``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``, ``get_state_dict``, their
``set_`` twins, and so ``dcp.save`` / ``dcp.load`` of what they return) names parameters and optimizer
state by canonical names. Its ``_get_fqns`` drops a wrapper's level when ``isinstance(obj, DDP)``,
``DDP`` being torch's class, imported there under that name; FSDP, ``torch.compile``'s ``_orig_mod``
and checkpoint wrappers are recognised the same way, by class or by a fixed prefix. torch offers no
registration for other wrappers (a module's ``_fqn_modifiers`` adds a level to a key, never drops
one), so ``install()`` widens that one name: it becomes ``TorchOrDdpkitDDP``, which ``isinstance``
matches for torch's DDP and for ddpkit's. ``_get_fqns`` is the only reader of ``DDP`` there in torch
2.2 to 2.13, and it reads it at each call, so nothing else changes; torch's DDP is neither subclassed
nor constructed. A torch whose module has no such name is left alone, with a warning.

Importing torch's module costs about 0.7 s, so ``import ddpkit`` does not: ``install()`` adapts it at
once if it is imported already, else right after it is imported, through an import hook that
answers for that one module name and passes every other by.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from types import ModuleType
from typing import Any

from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddpkit.ddp.distributed import DistributedDataParallel

__all__ = ["TorchOrDdpkitDDP", "TARGET", "install", "adapt"]

TARGET = "torch.distributed.checkpoint.state_dict"
"""The module whose ``DDP`` name decides which wrappers lose their ``module.`` level."""


class _EitherDDP(type):
    """``isinstance`` and ``issubclass`` against torch's DDP or ddpkit's (subclasses included)."""

    kinds = (TorchDDP, DistributedDataParallel)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.kinds)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls.kinds)


class TorchOrDdpkitDDP(metaclass=_EitherDDP):
    """What ``torch.distributed.checkpoint.state_dict.DDP`` names once adapted: torch's DDP or ddpkit's."""


def adapt(module: ModuleType) -> bool:
    """Make ``module`` (torch's ``state_dict``) recognise ddpkit's DDP; True if it does now."""
    current = getattr(module, "DDP", None)
    if current is TorchOrDdpkitDDP:
        return True
    if current is not TorchDDP:  # a torch that decides otherwise: leave it, and say so once
        warnings.warn(f"ddpkit: {TARGET} has no DDP name bound to torch's DistributedDataParallel, so "
                      "get_state_dict keeps ddpkit DDP's 'module.' prefix; HINT: pass model.module to "
                      "get_state_dict / set_state_dict.", RuntimeWarning, stacklevel=2)
        return False
    module.DDP = TorchOrDdpkitDDP
    return True


class _AdaptOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``TARGET`` is imported (or reloaded), lets the other finders find
    it and has its loader call ``adapt`` once the module's code has run. Other names pass at the
    cost of one string comparison."""

    def __init__(self) -> None:
        self._finding = threading.local()  # our own find_spec call below must not come back here

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET or getattr(self._finding, "active", False):
            return None
        self._finding.active = True
        try:
            spec = next((s for s in (_find(f, fullname, path, target) for f in sys.meta_path if f is not self)
                         if s is not None), None)
        finally:
            self._finding.active = False
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AdaptingLoader(spec.loader)
        return spec


def _find(finder: Any, fullname: str, path: Any, target: Any) -> Any:
    find_spec = getattr(finder, "find_spec", None)
    return None if find_spec is None else find_spec(fullname, path, target)


class _AdaptingLoader:
    """The real loader, which runs the module's code; then ``adapt``. Anything else goes to it."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        adapt(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


def install() -> None:
    """Adapt torch's module now if it is imported, and whenever it is (re)imported (``import ddpkit``
    calls this once; again changes nothing)."""
    if not any(isinstance(f, _AdaptOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AdaptOnImport())
    module = sys.modules.get(TARGET)
    if module is not None:
        adapt(module)
