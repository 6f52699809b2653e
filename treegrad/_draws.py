"""Python state a compiled function consumes while it is traced: random generators
and iterators.

`np.random.rand`, `random.random` or a `np.random.Generator` the function captures
hand the trace one draw, and `next(batches)` on an iterator it captures one item;
compiling would bake either in, and every later call would repeat it (the same
noise, the same dropout mask, the same batch), where the uncompiled function draws
afresh. treegrad therefore compares these states before and after each trace: a
function that drew is traced again on every call, and says so once. Only traces
pay for the comparison (a copy of each state), never a cached call.

An iterator of the user's own class is walked as any object of theirs is (its
position is an attribute); these are the library's, whose position is internal.
"""

from __future__ import annotations

import io
import random
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

# The objects that hold a Python-side random state.
RNG_TYPES = (random.Random, np.random.Generator, np.random.RandomState, np.random.BitGenerator)
_BOUND = (types.BuiltinMethodType, types.MethodType, types.MethodWrapperType)


def consumed(value: Any, is_library: Callable[[type], bool]) -> Any:
    """The random state or library iterator `value` is, or whose bound method it is
    (`rng.normal`, `it.__next__`); else None. An iterator of a class that is not a
    library's (`is_library`) is walked as the user's object instead."""
    # By type alone: `isinstance` would ask a user object for its `__class__`.
    t = type(value)
    if t in _BOUND:
        value = value.__self__
        t = type(value)
    if issubclass(t, RNG_TYPES):
        return value
    if _is_iterator(t) and is_library(t):
        if issubclass(t, io.IOBase) and (value.closed or not value.readable()):
            return None  # a log file it writes to: no items are taken from it
        return value
    return None


def _is_iterator(t: type) -> bool:
    # A weakref.proxy forwards `__next__` whatever it points to: what it points to is
    # walked (and checked) on its own. Taken for an iterator, a proxy to a model had the
    # loss "take items from a ProxyType" and traced on every call.
    return hasattr(t, "__next__") and not issubclass(t, type) and t not in weakref.ProxyTypes


# The instances behind the modules' own functions (`random.random`, `np.random.rand`).
_GLOBAL_PY = consumed(random.random, lambda t: True)
_GLOBAL_NP = consumed(np.random.rand, lambda t: True)

_UNKNOWN = object()  # a position that cannot be read: taken as moved (never stale)
_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _state(obj: Any) -> Any:
    if isinstance(obj, random.Random):
        return obj.getstate()
    if isinstance(obj, np.random.RandomState):
        return obj.get_state(legacy=False)
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    if isinstance(obj, np.random.BitGenerator):
        return obj.state
    return _position(obj, 0)


def _position(it: Any, depth: int) -> Any:
    """An iterator's position, as comparable values: what pickling it would save (a
    list iterator's index, `itertools.count`'s next value, the iterators `map` or
    `zip` read, each by its own position), or a generator's frame (the instruction it
    is paused at and what its locals are)."""
    if depth > 8:
        return _UNKNOWN
    if isinstance(it, io.IOBase):
        return it.tell() if it.seekable() else _UNKNOWN  # a file read line by line
    if type(it) is types.GeneratorType:
        frame = it.gi_frame
        if frame is None:
            return None  # finished
        inner = it.gi_yieldfrom
        return (
            frame.f_lasti,
            _value(dict(frame.f_locals), depth),  # a proxy from Python 3.13 (PEP 667)
            None if inner is None else _position(inner, depth + 1),
        )
    try:
        with warnings.catch_warnings():
            # Python 3.12 and 3.13 deprecate pickling itertools objects (gone in 3.14).
            warnings.simplefilter("ignore", DeprecationWarning)
            reduced = it.__reduce__()
    except Exception:  # any refusal (a file, a socket): the position is unknown, taken as moved
        return _UNKNOWN
    return _value(reduced, depth)


def _value(v: Any, depth: int) -> Any:
    t = type(v)
    if t in _PLAIN:
        return v
    if depth > 8:  # deep, or a container holding itself
        return ("object", id(v))
    if t is tuple or t is list:
        return tuple(_value(x, depth + 1) for x in v)
    if t is dict:
        return tuple((k, _value(x, depth + 1)) for k, x in v.items())
    if _is_iterator(t):
        return _position(v, depth + 1)
    return ("object", id(v))  # arrays, functions, other objects: by identity


def _equal(a: Any, b: Any) -> bool:
    """States compared: dicts of numpy arrays (numpy's), tuples of plain values."""
    if a is _UNKNOWN or b is _UNKNOWN:
        return False
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if type(a) is tuple and type(b) is tuple:
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _label(obj: Any) -> str:
    if obj is _GLOBAL_PY:
        return "Python's global random state (random.random...)"
    if obj is _GLOBAL_NP:
        return "numpy's global random state (np.random.rand...)"
    t = type(obj)
    root = t.__module__.split(".")[0]
    known = ("numpy", "random", "itertools")
    name = f"{root}.{t.__qualname__}" if root in known else t.__qualname__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} it captures"


def global_states(module: Any = None) -> list[Any]:
    """The module-level random states: those behind `module` (the `random` or
    `numpy.random` module a function reaches), or both (code that reads an attribute
    named `random`: `np.random.rand`, `random.random`)."""
    name = getattr(module, "__name__", None)
    if module is None:
        return [s for s in (_GLOBAL_PY, _GLOBAL_NP) if s is not None]
    if name == "random":
        return [_GLOBAL_PY] if _GLOBAL_PY is not None else []
    if name in ("numpy.random", "numpy.random.mtrand"):
        return [_GLOBAL_NP] if _GLOBAL_NP is not None else []
    return []


class Draws:
    """The states of `objs` (random states and iterators the function may consume),
    taken now; `changed()` names those that moved since (a draw, a reseed, an item
    taken). Only what the function's code may reach is compared: a draw by another
    thread (a data loader's augmentation) is not taken for the function's."""

    def __init__(self, objs: list[Any]):
        unique = list({id(o): o for o in objs}.values())
        self.before = [(o, _state(o)) for o in unique]

    def changed(self) -> list[tuple[str, bool]]:
        """`(label, random)` for each that moved; `random`: a random state, else an
        iterator."""
        return [
            (_label(o), isinstance(o, RNG_TYPES))
            for o, s in self.before
            if not _equal(_state(o), s)
        ]

    def restore(self) -> None:
        """Put back the random states as they were taken (a trace that failed, to be
        tried again, must not have drawn: uncompiled, the function draws once).
        An iterator's position cannot be put back in general: left as it is."""
        for o, s in self.before:
            if isinstance(o, random.Random):
                o.setstate(s)
            elif isinstance(o, np.random.RandomState):
                o.set_state(s)
            elif isinstance(o, np.random.Generator):
                o.bit_generator.state = s
            elif isinstance(o, np.random.BitGenerator):
                o.state = s
