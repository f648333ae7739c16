"""torch's checks for its DDP class, widened to ddpkit's: distributed-checkpoint keys, pipeline stages.

Two modules of ``torch.distributed`` recognise a DDP by ``isinstance`` against torch's class, imported
under a name of their own, and offer no registration for other wrappers:

- ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``, ``get_state_dict``, their
  ``set_`` twins, and so ``dcp.save`` / ``dcp.load`` of what they return): its ``_get_fqns`` drops a
  DDP's ``module.`` level from the canonical names (name ``DDP``). FSDP, ``torch.compile``'s
  ``_orig_mod`` and checkpoint wrappers are recognised the same way; a module's ``_fqn_modifiers``
  adds a level to a key, never drops one.
- ``torch.distributed.pipelining.stage`` (name ``DistributedDataParallel``): a stage whose module is
  a DDP runs every microbatch but the last under ``no_sync()`` and calls ``reducer.prepare_for_backward
  (outputs)`` before the last backward, so that one all-reduce averages the accumulated gradients.

``install()`` rebinds each name to a class that ``isinstance`` matches for torch's DDP and for ddpkit's
(for a stage, only one that averages: a world of one has no reducer). They are the only readers of
those names in torch 2.2 to 2.13 (the stage's from 2.4, where pipelining came), each reads it at each
call, so nothing else changes; torch's DDP is neither subclassed nor constructed. A torch whose
module binds no such name is left alone, with a warning.

Importing torch's modules costs about 0.7 s, so ddpkit does not: ``install()`` (run when ``ddpkit.ddp``
loads, at the first use of ``ddpkit.DDP`` or another of its names) adapts one
at once if it is imported already, else right after it is imported, through an import hook that
answers for those module names and passes every other by.
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

__all__ = ["TorchOrDdpkitDDP", "TorchOrAveragingDdpkitDDP", "TARGET", "PIPELINE_TARGET", "TARGETS", "install",
           "adapt"]

TARGET = "torch.distributed.checkpoint.state_dict"
"""The module whose ``DDP`` name decides which wrappers lose their ``module.`` level."""

PIPELINE_TARGET = "torch.distributed.pipelining.stage"
"""The module whose ``DistributedDataParallel`` name decides which stage modules sync once a step."""


class _EitherDDP(type):
    """``isinstance`` and ``issubclass`` against torch's DDP or ddpkit's (subclasses included)."""

    kinds = (TorchDDP, DistributedDataParallel)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.kinds)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls.kinds)


class TorchOrDdpkitDDP(metaclass=_EitherDDP):
    """What ``torch.distributed.checkpoint.state_dict.DDP`` names once adapted: torch's DDP or ddpkit's."""


class _EitherAveragingDDP(_EitherDDP):
    """As ``_EitherDDP``, but a ddpkit DDP only with a reducer (a world of one has none: a plain module)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if isinstance(obj, DistributedDataParallel):
            return obj.reducer is not None
        return isinstance(obj, TorchDDP)


class TorchOrAveragingDdpkitDDP(metaclass=_EitherAveragingDDP):
    """What ``torch.distributed.pipelining.stage.DistributedDataParallel`` names once adapted."""


# module -> (the name it binds torch's DDP to, what it becomes, what is lost where it cannot)
TARGETS = {
    TARGET: ("DDP", TorchOrDdpkitDDP, "get_state_dict keeps ddpkit DDP's 'module.' prefix; HINT: pass "
             "model.module to get_state_dict / set_state_dict."),
    PIPELINE_TARGET: ("DistributedDataParallel", TorchOrAveragingDdpkitDDP, "a pipeline stage runs a "
                      "ddpkit DDP as a plain module, averaging after every microbatch; HINT: use torch's "
                      "DDP for the stages of a pipeline."),
}


def adapt(module: ModuleType) -> bool:
    """Make ``module`` (one of ``TARGETS``) recognise ddpkit's DDP; True if it does now."""
    name, widened, lost = TARGETS[module.__name__]
    current = getattr(module, name, None)
    if current is widened:
        return True
    if current is not TorchDDP:  # a torch that decides otherwise: leave it, and say so once
        warnings.warn(f"ddpkit: {module.__name__} has no {name} name bound to torch's DistributedDataParallel, "
                      f"so {lost}", RuntimeWarning, stacklevel=2)
        return False
    setattr(module, name, widened)
    return True


class _AdaptOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when one of ``TARGETS`` is imported (or reloaded), lets the other finders find
    it and has its loader call ``adapt`` once the module's code has run. Other names pass at the
    cost of one string comparison."""

    def __init__(self) -> None:
        self._finding = threading.local()  # our own find_spec call below must not come back here

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in TARGETS or getattr(self._finding, "active", False):
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
    """Adapt torch's modules now where imported, and whenever they are (re)imported (loading ``ddpkit.ddp``
    calls this once; again changes nothing)."""
    if not any(isinstance(f, _AdaptOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AdaptOnImport())
    for target in TARGETS:
        module = sys.modules.get(target)
        if module is not None:
            adapt(module)
