"""Implicit mode's identity registry: `Params` (its gradients, `Grads`, are `_grads`'s).

A `Params` is an ordered set of parameter arrays keyed by object identity, like
Zygote's `Params`. It remembers where it got them: built from a model, a dict or
a list, it re-reads that container at each call, so it follows `tg.update_` and
user assignments; built from standalone arrays, it holds those objects.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from ._fasttree import Shape
from ._paramsource import checked_source, trainable_leaves_with_path
from ._tree import (
    describe_leaf,
    is_differentiable,
    path_str,
    picker,
    same_structure,
    unique_by_id,
)
from ._typing import Model

# The arrays `Params._retire` remembers, of every Params: id -> (the old array and the
# array that replaced it, both weakly; the parameter's name; where the loss read it). A
# Params built again at each step from the same variables has no memory of its own.
RETIRED: dict[int, tuple[Any, Any, str, str]] = {}


def _weak(x: Any) -> Any:
    """A weak reference to `x`, or one that is always dead (None, or no weakref)."""
    try:
        return weakref.ref(x)
    except TypeError:
        return lambda: None


class Params:
    """An ordered identity set of parameters: `tg.Params(xs)`, same as `tg.params(xs)`.

    Arguments:
        xs: an array, a list or tuple of arrays, a `tg.Module`, or any pytree or
            mutable container (dict, list) holding arrays. Floating and complex
            `jax.Array` leaves are collected, each distinct object once (a tied
            weight appears once), respecting `__trainable__`. With no argument
            (or an empty list) the set starts empty; `add` fills it.

    A `Params` built from a container re-reads it at each use, so it follows
    `tg.update_` and assignments; `add` and `remove` change the set itself,
    never the container. Two `Params` are equal when they hold the same arrays
    (by identity) in the same order.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> W, b = jnp.ones((3, 5)), jnp.zeros(3)
        >>> ps = tg.Params([W, b])
        >>> len(ps), W in ps, jnp.ones(3) in ps
        (2, True, False)
        >>> list(ps.named())
        ['0', '1']
        >>> ps.remove(b); len(ps), ps == tg.Params([W])
        (1, True)
    """

    __slots__ = ("_cache", "_proven", "_sources", "_stale")
    __hash__ = None  # type: ignore[assignment]  # mutable, and equal by contents

    def __init__(self, xs: Model = ()):
        # `_sources` is the one attribute the engine reads and swaps when a function
        # captures a Params (_walk.py, _swap.py): the removed arrays first, then the
        # models, containers and arrays given. The removed arrays are held there, as
        # objects, for two reasons: inside a trace they are replaced by the same
        # tracers as where they live in the containers, so `ps.remove(W)` still
        # leaves W out while `f` iterates `ps`; and an id held alive cannot be
        # reused by a new array. (Weak references would free the memory of a removed
        # array the user dropped, but the engine does not see through them, so
        # inside the trace the removed arrays came back. Measured on CPU, a 20-array
        # model with one removed: _read 5.3 us and an implicit gradient ~87 us, the
        # same as with ids; a removed array still in the model is one program input.)
        self._sources: list[Any] = [[]]
        self._cache: dict[int, _Reading] = {}
        # Whether `tg.update_` has seen the loss read this Params' containers (`_unproven`).
        self._proven = False
        # Arrays an update replaced here that the loss read elsewhere (`_retire`).
        self._stale: dict[int, tuple[Any, str, str]] = {}
        if isinstance(xs, Params):
            self._sources = [list(xs._removed), *xs._sources[1:]]
        elif isinstance(xs, (list, tuple)) and any(isinstance(x, Params) for x in xs):
            # Params([p1, p2]) and Params([p1, W]): the union, in order. (A list mixing
            # a Params with arrays once read as a container, where the Params is an
            # opaque leaf: its parameters were silently left out.)
            for x in xs:
                self._add(x, "tg.params")
        elif not (type(xs) in (list, tuple) and not xs):
            self._sources.append(checked_source(xs, "tg.params"))

    def __copy__(self) -> Params:
        # A new set: adding to or removing from the copy leaves this one as it is.
        return Params(self)

    # pickle and deepcopy: the sources only. The readings cache held generated
    # functions (`picker`'s lambdas) that pickle refused ("Can't pickle local object
    # 'picker.<locals>.<lambda>'") as soon as the set had been read once; it is
    # rebuilt from the copied sources on the first read.
    def __getstate__(self) -> dict[str, Any]:
        return {"_sources": self._sources}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._sources = state["_sources"]
        self._cache = {}
        self._proven = False  # the copy's containers: not yet seen read by the loss
        self._stale = {}

    @property
    def _removed(self) -> list[Any]:
        removed: list[Any] = self._sources[0]
        return removed

    def add(self, x: Any) -> None:
        """Add a parameter (an array), or every parameter of a model or container.

        An array removed before is a parameter again when it is added, on its own
        or inside a container.
        """
        self._add(x, "Params.add")

    def _add(self, x: Any, api: str) -> None:
        if isinstance(x, Params):
            # The union: its sources join ours. An array it left out stays out unless
            # one of our sources holds it; one we left out comes back if it holds it.
            mine, theirs = {id(a) for a in self}, {id(a) for a in x}
            kept = [r for r in self._removed if id(r) not in theirs]
            kept += [r for r in x._removed if id(r) not in mine and all(r is not k for k in kept)]
            self._sources[1:] = [*self._sources[1:], *x._sources[1:]]
            self._sources[0] = kept
            self._cache.clear()
            self._proven = False  # its containers: not yet seen read by the loss
            return
        if isinstance(x, jax.Array) and any(r is x for r in self._removed):
            held = any(
                a is x for j in range(1, len(self._sources)) for a in self._read_source(j)[0]
            )
            if held:
                # Removed before and still in a source: a parameter again where it
                # is, with its name, and the set's sources (which the optimiser
                # state mirrors) unchanged.
                self._sources[0] = [r for r in self._removed if r is not x]
                self._cache.clear()
                return
        self._sources.append(checked_source(x, api))
        self._cache.clear()
        self._proven = False  # a new container: not yet seen read by the loss
        if self._removed:
            back = {id(a) for a in self._read_source(len(self._sources) - 1)[0]}
            self._sources[0] = [r for r in self._removed if id(r) not in back]

    def remove(self, x: Any) -> None:
        """Remove a parameter, a source given to `Params`/`add`, or every parameter of a
        sub-model; `KeyError` if none of them is in the set (see `discard`).

        A removed array stays out while it is the array in its place; a new array
        assigned there (by the user; `tg.update_` leaves a removed array alone) is a
        parameter again.
        """
        if not self._discard(x):
            raise KeyError(
                f"Params.remove: this {describe_leaf(x)} is not one of the parameters, nor "
                "holds any (they are compared by identity); use discard to ignore a missing one."
            )

    def discard(self, x: Any) -> None:
        """`remove`, doing nothing when `x` is not (and holds no) parameter."""
        self._discard(x)

    def _discard(self, x: Any) -> bool:
        """Remove `x`; whether anything was removed."""
        current = self.arrays()
        sources = self._sources[1:]
        dropped = any(s is x for s in sources)
        if dropped:
            # A source given to Params/add: drop it (a container's arrays go unless
            # another source holds them too).
            self._sources[1:] = [s for s in sources if s is not x]
        if isinstance(x, jax.Array):  # out, wherever else it is held
            gone = [x] if any(a is x for a in current) else []
        elif dropped or isinstance(x, (np.ndarray, Params)) or x is None:
            gone = []
        else:  # a sub-model or container: its parameters that are in the set
            inside = {id(leaf) for leaf in jax.tree_util.tree_leaves(x)}
            gone = [a for a in current if id(a) in inside]
        removed = self._removed
        removed.extend(a for a in gone if all(r is not a for r in removed))
        self._cache.clear()
        return dropped or bool(gone)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Params):
            return NotImplemented
        a, b = self.arrays(), other.arrays()
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))

    def _read(self) -> tuple[list[Any], list[tuple[Any, ...]]]:
        """The current parameter arrays and the path of each, in order."""
        sources = self._sources
        if len(sources) == 2 and not sources[0]:
            return self._read_source(1)
        arrays: list[Any] = []
        paths: list[tuple[Any, ...]] = []
        seen: set[int] = set(map(id, sources[0]))
        for j in range(1, len(sources)):
            # Sources after the first are named under "+k" (an array added on its
            # own is named "+k"), apart from the first source's own keys.
            prefix = (jax.tree_util.GetAttrKey(f"+{j - 1}"),) if j > 1 else ()
            for a, p in zip(*self._read_source(j), strict=True):
                if id(a) not in seen:
                    seen.add(id(a))
                    arrays.append(a)
                    paths.append(prefix + p)
        return arrays, paths

    def _read_source(self, j: int) -> tuple[list[Any], list[tuple[Any, ...]]]:
        source = self._sources[j]
        if isinstance(source, jax.Array):
            return [source], [()]
        seen = self._cache.get(j)
        # The structure seen last, read by generated code; else JAX's flatten.
        leaves = seen.shape.flatten(source) if seen is not None else None
        if seen is not None and leaves is not None:
            if _kinds(seen.candidates(leaves)) != seen.kinds:
                # A leaf became (or stopped being) differentiable at the same
                # structure: `m.scale = jnp.array(2.0)` where an int array was.
                seen = self._cache[j] = _Reading(source, leaves, seen.treedef, seen.shape)
        else:
            leaves, treedef = jax.tree_util.tree_flatten(source)
            if (
                seen is None
                or not same_structure(seen.treedef, treedef)
                or _kinds(seen.candidates(leaves)) != seen.kinds
            ):
                seen = self._cache[j] = _Reading(source, leaves, treedef)
        arrays = seen.pick(leaves)
        paths = seen.paths
        if len(set(map(id, arrays))) != len(arrays):
            # Ties can change without changing the structure (a user tying two
            # weights by assignment); de-duplicate by identity, first wins.
            uniq, slots = unique_by_id(arrays)
            first: dict[int, int] = {}
            for k, s in enumerate(slots):
                first.setdefault(s, k)
            return uniq, [paths[first[s]] for s in range(len(uniq))]
        return arrays, paths

    def arrays(self) -> list[Any]:
        return self._read()[0]

    def __len__(self) -> int:
        return len(self.arrays())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.arrays())

    def __contains__(self, x: object) -> bool:
        return any(a is x for a in self.arrays())

    def __getitem__(self, i: Any) -> Any:
        """The parameter at position `i` (Zygote's `ps[1]`, counted from 0 here), or a
        list of them for a slice; by name, use `ps.named()[name]`."""
        arrays = self.arrays()
        if isinstance(i, slice):
            return arrays[i]
        if isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)):
            if -len(arrays) <= i < len(arrays):
                return arrays[i]
            raise IndexError(f"Params index {i} is out of range: there are {len(arrays)}.")
        hint = f"; by name, use ps.named()[{i!r}]" if isinstance(i, str) else ""
        raise TypeError(
            f"Params are indexed by position (an int or a slice), got a {type(i).__name__}{hint}."
        )

    def named(self) -> dict[str, Any]:
        """A dict from dotted path (`"l1.weight"`, `"layers.0.bias"`) to array.

        An array added on its own after the first source is named `"+k"`, and a
        container's parameters `"+k.<path>"` (k counts the sources from 0).
        """
        arrays, paths = self._read()
        return dict(zip(_names(paths), arrays, strict=True))

    @property
    def source(self) -> Any:
        """What the parameters are read from: the model, container or array given (a list
        of them after `add`), as the optimiser and `tg.update_` see it."""
        sources = self._sources[1:]
        return sources[0] if len(sources) == 1 else sources

    def _loose(self) -> bool:
        """Whether a parameter is held on its own: an array given or added by itself, or
        an item of a list or tuple given (Zygote's `Params([W, b])`). A loss most often
        reads such an array through a variable of its own, where `tg.update_` cannot
        rebind it (`_optim._check_read`); the arrays of a model or dict the Params
        holds are read from it, and that check (about 10 us a step on the benchmark's
        deep model) is not spent on them."""
        return any(
            isinstance(src, jax.Array)
            or (type(src) in (list, tuple) and any(isinstance(v, jax.Array) for v in src))
            for src in self._sources[1:]
        )

    def _retire(self, read: list[tuple[str, str, Any]], changed: dict[int, Any]) -> None:
        """Remember, weakly, the old arrays of parameters an update replaced here that
        the loss read elsewhere (`_optim._check_read`: `W` of `tg.Params([W, b])`), each
        with its name and where the loss read it; `changed`: old array's id to the new
        array. A local unpacked from the Params at each step (`W, b = ps`) reads the new
        arrays at the next step, and the old ones die with it; a variable that outlives
        the step keeps reading an old one, which the next gradient refuses
        (`stale_read`), through this Params or any other (`RETIRED`)."""
        for name, where, old in read:
            self._stale[id(old)] = (weakref.ref(old), name, where)
            new = changed.get(id(old))
            RETIRED[id(old)] = (weakref.ref(old), _weak(new), name, where)

    def any_stale(self) -> bool:
        """Whether an array `_retire` remembers, here or for any Params, is still alive
        (the others forgotten)."""
        if self._stale:
            self._stale = {k: v for k, v in self._stale.items() if v[0]() is not None}
        if RETIRED:
            for k in [k for k, v in RETIRED.items() if v[0]() is None]:
                RETIRED.pop(k, None)
        return bool(self._stale or RETIRED)

    def stale_read(self, read: Sequence[Any]) -> tuple[str, str, Any, bool] | None:
        """Of the arrays a function reads (`read`): one `_retire` remembers, read without
        the array that replaced it (a loss that reads both, the old one as an anchor,
        `jnp.sum((W - W0) ** 2)`, trains), as (the parameter's name, where it was read,
        the array, whether another Params replaced it); None when there is none.

        Another Params: `ps = tg.Params([W])` built again at each step over a global
        `W` that the loss reads: each update rebinds `W` only in the list of that step's
        Params, so every step started again from the first array, silently."""
        ids = set(map(id, read))
        for a in read:
            hit = self._stale.get(id(a))
            if hit is not None and hit[0]() is a:
                now = self.named().get(hit[1])
                if now is None or id(now) not in ids:
                    return hit[1], hit[2], a, False
        for a in read:
            seen = RETIRED.get(id(a))
            if seen is not None and seen[0]() is a and id(a) not in self._stale:
                new = seen[1]()
                if new is None or id(new) not in ids:
                    return seen[2], seen[3], a, True
        return None

    def _unproven(self) -> bool:
        """Whether a source is a plain dict, list or tuple that `tg.update_` has not yet
        seen the loss read (`_proven`). `tg.Params({"W": W, "b": b})` (or
        `ps.add({"t": t})`, `tg.Params([[W, b]])`) over arrays the loss reads as
        variables of their own was not checked at all (not `_loose`): the update rebound
        them only in that container and they never trained, silently where another
        parameter kept its gradient. The loss reads the same places on every step, so
        one check (the first update) finds it; a model's path pays nothing after."""
        if self._proven:
            return False
        plain = any(type(src) in (dict, list, tuple) for src in self._sources[1:])
        if not plain:
            self._proven = True  # a Module or other model: nothing to check, ever
        return plain

    def _rebound(self, source: Any) -> None:
        """After `tg.update_` rebound arrays inside `source` (what `.source` gave): keep
        the new arrays added on their own, which live in the list `.source` copied."""
        if len(self._sources) > 2:
            self._sources[1:] = source

    def __repr__(self) -> str:
        items = ", ".join(f"{n}: {describe_leaf(a)}" for n, a in self.named().items())
        return f"Params([{items}])"


class _Reading:
    """What one source of a `Params` held when it was last scanned.

    `pick(leaves)` gives its parameters and `paths` their paths; the reading holds
    while the source has the structure `treedef` and `kinds` (`_kinds` of the leaves
    at trainable places, `candidates(leaves)`) is unchanged: a dtype alone can make
    a leaf a parameter or not, at the same structure.
    """

    __slots__ = ("candidates", "kinds", "paths", "pick", "shape", "treedef")

    def __init__(self, source: Any, leaves: list[Any], treedef: Any, shape: Shape | None = None):
        # Every place of a trainable leaf, a tied one's places each: a tie can be
        # broken by assignment without changing the structure, and then both arrays
        # are parameters (`_read_source` de-duplicates the ties of the moment).
        first = {id(leaf): i for i, leaf in reversed(list(enumerate(leaves)))}
        by_path = {
            tuple(p): i for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(source)[0])
        }
        places: list[int] = []
        index: list[int] = []
        paths: list[tuple[Any, ...]] = []
        for path, leaf in trainable_leaves_with_path(source):
            i = by_path.get(tuple(path))
            if i is None:
                i = first[id(leaf)]
            places.append(i)
            if is_differentiable(leaf):
                index.append(i)
                paths.append(path)
        self.treedef = treedef
        # The generated flatten of the per-call fast path; kept when only a dtype changed.
        self.shape = shape if shape is not None else Shape(treedef, leaves)
        self.pick = picker(index)
        self.paths = paths
        everywhere = places == list(range(len(leaves)))
        self.candidates: Callable[[list[Any]], list[Any]] = _same if everywhere else picker(places)
        self.kinds = _kinds(self.candidates(leaves))


def _same(xs: list[Any]) -> list[Any]:
    return xs


_AVAL_DTYPE = operator.attrgetter("aval.dtype")


def _kinds(leaves: list[Any]) -> list[Any]:
    """Per leaf, what decides whether it is differentiable (`is_differentiable`'s own
    test): its dtype if it is an array, else None.

    Checked on every read of a container, so the common case (every leaf a
    `jax.Array`, whose `aval` is read in C) is one `map`: for 20 arrays 2.7 us,
    against 4.0 us through the `dtype` property and 13 us for the general loop
    below (CPU, busy machine, measured for this check).
    """
    try:
        return list(map(_AVAL_DTYPE, leaves))
    except AttributeError:  # a numpy array, a Python number: no aval
        return [x.dtype if isinstance(x, (jax.Array, np.ndarray)) else None for x in leaves]


def _names(paths: list[tuple[Any, ...]]) -> list[str]:
    """A distinct dotted name for each path (an array given on its own: its position).

    Dict keys are free text, so two paths can still print alike (`{"a.b": x}` and
    `{"a": {"b": y}}`); a later one gets `#2`, `#3`, ... so that no parameter is
    dropped from a dict of names.
    """
    return distinct([path_str(p) if p else str(k) for k, p in enumerate(paths)])


def distinct(names: list[str]) -> list[str]:
    """`names` with each repeat renamed `name#2`, `name#3`, ... (a name not taken)."""
    taken = set(names)
    if len(taken) == len(names):
        return names
    seen: set[str] = set()
    for k, name in enumerate(names):
        if name in seen:
            n = 2
            while f"{name}#{n}" in taken:
                n += 1
            name = names[k] = f"{name}#{n}"
            taken.add(name)
        seen.add(name)
    return names


def params(xs: Model) -> Params:
    """The parameters of a model: the same as `tg.Params(xs)`.

    Arguments:
        xs: a model, a container of arrays, or an array.

    Returns:
        A `tg.Params`.

    Examples:
        >>> import jax, treegrad as tg
        >>> from treegrad import nn
        >>> model = nn.Dense(2, 3, key=jax.random.key(0))
        >>> list(tg.params(model).named())
        ['weight', 'bias']
    """
    return Params(xs)
