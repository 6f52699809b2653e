"""Freshness of the optimiser's compiled step: what a rule's own functions read.

`tg.update` runs every optax rule inside one compiled step (`_optstep`), traced
once per configuration. A rule may hold functions of the user's: a learning-rate
schedule given to `optax.inject_hyperparams`, a mask or label function. What
they read (a dict entry, a global, a captured array) is baked into that trace.
Plain optax, run eagerly, reads it on every step, and so does treegrad: the
user's functions found in a rule are guarded as a compiled function's closure
is (`_guardcode.Guard`), and when the guard fails the step is traced again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._guardcode import Guard
from ._reach import user_functions
from ._walk import Walk


class RuleGuard:
    """Whether the values the rules' user functions read are those the step was traced
    with. `None` from `of` when the rules hold no function of the user's."""

    __slots__ = ("_arrays", "_fns", "_guard", "_numpy")

    def __init__(self, fns: list[Any]):
        self._fns = fns
        walk = Walk()
        for fn in fns:
            walk.fixed(fn)
        self._guard = Guard([], walk.finish([]))
        found = self._guard.check()
        # A captured array is a constant of the trace: the same objects, or trace again;
        # a numpy array can also be edited in place, so its contents are kept to compare.
        self._arrays = None if found is None else list(map(id, found))
        self._numpy = [
            (k, x.tobytes()) for k, x in enumerate(found or ()) if isinstance(x, np.ndarray)
        ]

    @classmethod
    def of(cls, rules: Sequence[Any]) -> RuleGuard | None:
        fns = user_functions(rules)
        return cls(fns) if fns else None

    def fresh(self) -> bool:
        found = self._guard.check()
        return (
            found is not None
            and list(map(id, found)) == self._arrays
            and all(found[k].tobytes() == data for k, data in self._numpy)
        )


# Per tuple of rule objects (equal configurations share one compiled step, and
# equal configurations hold the same rules): `[guard]`, shared by their configs.
_HOLDERS: dict[tuple[int, ...], tuple[tuple[Any, ...], list[RuleGuard | None]]] = {}


def holder(rules: tuple[Any, ...]) -> list[RuleGuard | None]:
    """The shared `[guard]` of these rules (made on first use)."""
    key = tuple(map(id, rules))
    held = _HOLDERS.get(key)
    if held is None:
        if len(_HOLDERS) >= 256:
            _HOLDERS.clear()
        held = _HOLDERS[key] = (rules, [RuleGuard.of(rules)])  # keeps the ids valid
    return held[1]


def clear() -> None:
    _HOLDERS.clear()
