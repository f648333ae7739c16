"""The one walker of nested inputs and outputs, shared by scatter, gather, parallel_apply and DDP.

What counts as a container, and how it is rebuilt, is decided here once:

* tuples and lists, rebuilt as ``type(obj)(values)`` (a plain tuple or list, as torch's scatter
  gives, for a subclass whose constructor takes other arguments); namedtuples as
  ``type(obj)(*values)``;
* dicts, by value, rebuilt as ``type(obj)(pairs)`` so an OrderedDict stays one;
* dataclass instances, through their *init* fields, rebuilt with ``dataclasses.replace``. A field
  declared ``init=False`` that ``__post_init__`` derives is not visited: a rebuilt copy derives it
  again from its new init fields. One that holds tensors ``__post_init__`` does not give it (an
  auxiliary head's output, set by the module) is visited too, and set on the rebuilt copy, so that
  gather does not drop it; which fields ``__post_init__`` derives is found once per class. A
  dataclass whose constructor takes other arguments than its init fields (an ``InitVar``, an
  ``__init__`` of its own) cannot be rebuilt by calling it (``replace`` would apply an InitVar's
  default again, or fail without one): it is copied, and its fields set, without running
  ``__post_init__``, so its ``init=False`` fields that hold tensors are split and joined as the
  others are (a 0-dim one cannot be split). A search that rebuilds nothing reads every field,
  ``tensors(obj, every_field=True)``, as torch's DDP looks for output tensors there.

Anything else (None, numbers, strings, modules, plain objects) is a leaf, as is a tensor. An empty
container holds nothing to walk: ``split`` hands the same object to every piece, as torch's scatter
does, and ``map_tensors`` returns it as it is.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ddpkit.errors import OutputKeysError

__all__ = ["UnevenSplit", "is_namedtuple", "join", "map_tensors", "split", "tensors"]


class _Node(NamedTuple):
    """A container's direct values, the keys that read them (None: by position), and its rebuild."""

    keys: list[Any] | None
    values: list[Any]
    rebuild: Callable[[list[Any]], Any]


def is_namedtuple(obj: Any) -> bool:
    """torch's test: a tuple with namedtuple's methods (collections.namedtuple, typing.NamedTuple)."""
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _sequence(cls: type, values: list[Any]) -> Any:
    if cls is tuple or cls is list:
        return cls(values)
    try:
        return cls(values)
    except TypeError:  # a subclass whose constructor takes other arguments
        return tuple(values) if issubclass(cls, tuple) else list(values)


def _holds_tensor(obj: Any) -> bool:
    return next(tensors(obj), None) is not None


@functools.cache
def _built_from_init_fields(cls: type, init: tuple[str, ...]) -> bool:
    """Whether ``cls(**init_fields)`` is its constructor's whole call (no InitVar, no own __init__)."""
    return set(inspect.signature(cls).parameters) == set(init)


_DERIVED: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _derived_fields(obj: Any, fields: Sequence[dataclasses.Field]) -> frozenset[str]:
    """The ``init=False`` fields of ``obj``'s class that its construction gives a tensor, found once
    per class by constructing one (``__post_init__`` runs then, and not on every walk). A field with
    a ``default_factory`` counts as state with a default, which a module may set."""
    cls = type(obj)
    if cls not in _DERIVED:
        probe = dataclasses.replace(obj)
        _DERIVED[cls] = frozenset(f.name for f in fields if not f.init and f.default_factory is dataclasses.MISSING
                                  and _holds_tensor(getattr(probe, f.name, None)))
    return _DERIVED[cls]


def _dataclass_node(obj: Any) -> _Node:
    """A dataclass's fields to walk, and its rebuild (see the module doc)."""
    fields = dataclasses.fields(obj)
    init = [f.name for f in fields if f.init]
    late = [f.name for f in fields if not f.init and _holds_tensor(getattr(obj, f.name, None))]
    if not _built_from_init_fields(type(obj), tuple(init)):
        names = init + late  # without __post_init__, nothing is derived again: every tensor is split

        def copy_with(values: list[Any]) -> Any:
            new = copy.copy(obj)
            for name, value in zip(names, values):
                object.__setattr__(new, name, value)  # frozen dataclasses too
            return new

        return _Node(names, [getattr(obj, n) for n in names], copy_with)
    if late:
        derived = _derived_fields(obj, fields)
        late = [n for n in late if n not in derived]

    def replace_with(values: list[Any]) -> Any:
        new = dataclasses.replace(obj, **dict(zip(init, values)))
        for name, value in zip(late, values[len(init):]):
            object.__setattr__(new, name, value)
        return new

    names = init + late
    return _Node(names, [getattr(obj, n) for n in names], replace_with)


def _node(obj: Any) -> _Node | None:
    """How to look inside ``obj``; None for a leaf."""
    if isinstance(obj, torch.Tensor):
        return None
    if is_namedtuple(obj):
        return _Node(None, list(obj), lambda values: type(obj)(*values))
    if isinstance(obj, (tuple, list)):
        return _Node(None, list(obj), functools.partial(_sequence, type(obj)))
    if isinstance(obj, dict):
        keys = list(obj)
        return _Node(keys, [obj[k] for k in keys], lambda values: type(obj)(zip(keys, values)))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _dataclass_node(obj)
    return None


def tensors(obj: Any, *, every_field: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, depth first, in the order of the containers' values: of a dataclass,
    those the walk visits (see the module doc); with ``every_field``, those of every field (the
    unset ones skipped)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if every_field and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    else:
        node = _node(obj)
        values = () if node is None else node.values
    for value in values:
        yield from tensors(value, every_field=every_field)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any, leaves: tuple[type, ...] = ()) -> Any:
    """``obj`` with ``fn`` applied to each of its tensors, and to each instance of ``leaves`` (types
    handed to ``fn`` whole, such as a PackedSequence, whose ``.to()`` keeps batch_sizes on the CPU).

    A container is rebuilt only where ``fn`` returned something other than the tensor it was given,
    so what holds no tensor (or only tensors ``fn`` kept) comes back as the very same object.

    Example:
        >>> map_tensors(lambda t: t * 2, {"x": torch.ones(2), "tag": "a"})
        {'x': tensor([2., 2.]), 'tag': 'a'}
    """
    if isinstance(obj, torch.Tensor) or (leaves and isinstance(obj, leaves)):
        return fn(obj)
    node = _node(obj)
    if node is None or not node.values:
        return obj
    mapped = [map_tensors(fn, v, leaves) for v in node.values]
    if all(new is old for new, old in zip(mapped, node.values)):
        return obj
    return node.rebuild(mapped)


class UnevenSplit(ValueError):
    """Tensors side by side in one container split into different numbers of pieces."""

    def __init__(self, values: list[Any], counts: list[int]) -> None:
        super().__init__(f"values split into different numbers of pieces {counts}")
        self.values = values
        self.counts = counts


def split(fn: Callable[[torch.Tensor], Sequence[Any]], obj: Any, count: int) -> list[Any]:
    """``obj`` as a list of pieces of the same structure: ``fn`` splits every tensor into pieces.

    Containers split position by position; a leaf that is not a tensor goes by reference into each
    of ``count`` pieces. Where a tensor splits into fewer pieces than ``count``, the result has as
    many pieces as the tensors do (the other values are cut to match, as torch's zip does).

    Raises:
        UnevenSplit: tensors in one container split into different numbers of pieces (some piece
            would lack part of its values); it carries those values and the counts.
    """
    return _split(fn, obj, count)[0]


def _split(fn: Callable[[torch.Tensor], Sequence[Any]], obj: Any, count: int) -> tuple[list[Any], bool]:
    """The pieces, and whether ``obj`` holds a tensor: the parent's count check needs both, and
    returning them together walks each subtree once."""
    if isinstance(obj, torch.Tensor):
        return list(fn(obj)), True
    node = _node(obj)
    if node is None or not node.values:
        return [obj] * count, False
    parts = [_split(fn, v, count) for v in node.values]
    counts = {len(pieces) for pieces, holds in parts if holds}
    if len(counts) > 1:
        raise UnevenSplit(node.values, sorted(counts))
    return [node.rebuild(list(values)) for values in zip(*(pieces for pieces, _ in parts))], bool(counts)


def join(fn: Callable[[list[Any]], Any], objs: Sequence[Any], *, what: str = "objects") -> Any:
    """Zip ``objs`` of one structure into one object of that structure: the inverse of split.

    The structure is that of ``objs[0]``; ``fn`` gets the list of leaves found at one position (one
    from each object) and returns their joined value.

    Raises:
        OutputKeysError: dicts at one position have different keys (a ValueError and a KeyError).
        ValueError: sequences at one position have different lengths
            (``what`` names the objects in the message).
    """
    first = objs[0]
    node = _node(first)
    if node is None:
        return fn(list(objs))
    if isinstance(first, dict):
        if not all(isinstance(d, dict) and d.keys() == first.keys() for d in objs):
            found = [sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__ for d in objs]
            raise OutputKeysError(f"all {what} must be dicts with the same keys, but found {found}", found=found)
        columns = [[d[k] for d in objs] for k in node.keys]
    elif node.keys is not None:  # a dataclass: the fields its node walks, by name
        columns = [[getattr(o, name) for o in objs] for name in node.keys]
    else:
        nodes = [_node(o) for o in objs]
        if not all(n is not None and n.keys is None and len(o) == len(first) for n, o in zip(nodes, objs)):
            found = [f"{type(o).__name__} of {len(o)}" if n is not None else type(o).__name__
                     for n, o in zip(nodes, objs)]
            raise ValueError(f"all {what} must be {type(first).__name__}s of the same length, but found {found}")
        columns = [list(column) for column in zip(*objs, strict=True)]
    return node.rebuild([join(fn, column, what=what) for column in columns])
