"""Python random states a compiled function may draw from while it is traced.

`np.random.rand`, `random.random` or a `np.random.Generator` the function captures
hand the trace one draw, which compiling would bake in: every later call would
repeat it (the same noise, the same dropout mask), where the uncompiled function
draws afresh. treegrad therefore compares these states before and after each
trace: a function that drew is traced again on every call, and says so once.
Only traces pay for the comparison (a copy of each state), never a cached call.
"""

from __future__ import annotations

import random
import types
from typing import Any

import numpy as np

# The objects that hold a Python-side random state.
RNG_TYPES = (random.Random, np.random.Generator, np.random.RandomState, np.random.BitGenerator)


def rng_of(value: Any) -> Any:
    """The random state `value` is, or whose bound method it is (`rng.normal`); else None."""
    # By type alone: `isinstance` would ask a user object for its `__class__`.
    t = type(value)
    if issubclass(t, RNG_TYPES):
        return value
    if t is types.BuiltinMethodType or t is types.MethodType:
        owner = value.__self__
        if issubclass(type(owner), RNG_TYPES):
            return owner
    return None


# The instances behind the modules' own functions (`random.random`, `np.random.rand`).
_GLOBAL_PY = rng_of(random.random)
_GLOBAL_NP = rng_of(np.random.rand)


def _state(rng: Any) -> Any:
    if isinstance(rng, random.Random):
        return rng.getstate()
    if isinstance(rng, np.random.RandomState):
        return rng.get_state(legacy=False)
    if isinstance(rng, np.random.Generator):
        return rng.bit_generator.state
    return rng.state  # a BitGenerator


def _equal(a: Any, b: Any) -> bool:
    """States compared: dicts of numpy arrays (numpy's), or tuples of ints (Python's)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


def _label(rng: Any) -> str:
    if rng is _GLOBAL_PY:
        return "Python's global random state (random.random...)"
    if rng is _GLOBAL_NP:
        return "numpy's global random state (np.random.rand...)"
    t = type(rng)
    root = t.__module__.split(".")[0]
    name = f"{root}.{t.__qualname__}" if root in ("numpy", "random") else t.__qualname__
    return f"a {name} it captures"


class Draws:
    """The states of the global random generators and of `rngs`, taken now;
    `changed()` names those that moved since (a draw, or a reseed)."""

    def __init__(self, rngs: list[Any]):
        every = [r for r in (_GLOBAL_PY, _GLOBAL_NP, *rngs) if r is not None]
        unique = list({id(r): r for r in every}.values())
        self.before = [(r, _state(r)) for r in unique]

    def changed(self) -> list[str]:
        return [_label(r) for r, s in self.before if not _equal(_state(r), s)]
