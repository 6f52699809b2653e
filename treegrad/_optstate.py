"""The optimiser state's static configuration: `_Part`, `_Config`, and the model's layout.

A `_Part` is one rule with its optax state. A state has one part, unless a
sub-model was given its own rule (`state.l1 = tg.setup(rule2, model.l1)`) or
its own hyperparameters (`tg.adjust_(state.l1, ...)`): each part then *owns*
some parameters, and treats the others as skipped (see `_optstep.py`).
Everything static (rules, tree structures, which part owns which parameter,
which are frozen) lives in one hashable `_Config`, the treedef aux of the
`OptState` pytree; its only children are the optax states' arrays, so a step
passes the same config object on and jax never re-hashes it.

This module holds only those types and what they derive from the model (paths,
positions, which leaves `tg.update_` can rebind): every other optimiser module
reads them. How a config is built from a rule and a model and then changed (a
sub-model's own rule, a copied part, frozen parameters) is `_optbuild.py`; which
optax state entries belong to which parameter is `_optstatemap.py`.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
import numpy as np

from ._fasttree import Shape
from ._module import Module, register_child_type
from ._params import distinct
from ._tree import functor, path_str, picker, same_structure


class _Part(NamedTuple):
    """One optax rule and its state's static layout."""

    rule: Any
    state_def: Any
    """Treedef of the rule's optax state."""
    param_def: Any
    """Treedef of the tree `rule.init` was given (`None` where masked out)."""
    leaf_ids: tuple[int, ...]
    """For each leaf of that tree, the parameter it is (index into the distinct arrays)."""
    statemap: tuple[int, ...]
    """For each optax state leaf, the leaf of `param_def` it belongs to, -1 (shared), or
    `MIXED` (several parameters' at once)."""
    scope: str
    """Model path of the sub-model the rule was set up for ("" for the whole model)."""


class _Pos:
    """A leaf position of the model, in the model-shaped layout used for navigation."""

    __slots__ = ("p",)

    def __init__(self, p: int):
        self.p = p

    def __repr__(self) -> str:
        return f"_Pos({self.p})"


register_child_type(_Pos)


class _Config:
    """Everything static about an optimiser state; the `OptState` pytree's aux data.

    `slots[p]` is the parameter at model leaf position `p` (an index into the
    model's distinct trainable arrays, shared by the places of a tied array),
    -2 at a trainable place that held no floating-point array at setup (an
    integer array, a Python number), or -1; `owner[i]` the part that updates
    parameter `i`; `frozen` the parameters no part updates; `tied` whether the model
    holds an array or a sub-model at two places (`shares_nodes`).
    """

    __slots__ = (
        "__weakref__",
        "_equal",
        "_hash",
        "_layout",
        "_masks",
        "_names",
        "_paths",
        "_pinned",
        "_rules",
        "_shape",
        "avals",
        "first",
        "frozen",
        "kept",
        "n",
        "offsets",
        "owner",
        "parts",
        "pick_by_param",
        "pick_first",
        "pick_kept",
        "pick_trainable",
        "pick_undiff",
        "pick_updated",
        "plain",
        "slots",
        "tied",
        "tpos",
        "treedef",
        "tslot",
        "undiff",
        "updated",
    )

    def __init__(
        self,
        treedef: Any,
        slots: tuple[int, ...],
        parts: tuple[_Part, ...],
        owner: tuple[int, ...],
        frozen: frozenset[int],
        tied: bool,
        avals: tuple[tuple[tuple[int, ...], Any], ...],
        like: _Config | None = None,
    ):
        self.treedef = treedef
        # Shape and dtype of each parameter: to check an assigned sub-state.
        # Not part of the hash: the compiled step is keyed on its inputs' shapes anyway.
        self.avals = avals
        self.slots = slots
        self.parts = parts
        self.owner = owner
        self.frozen = frozen
        self.tied = tied
        self.n = len(owner)
        # Every leaf is a parameter of its own, in leaf order (no ties, no static leaves).
        self.plain = slots == tuple(range(len(slots)))
        self.tpos = tuple(p for p, s in enumerate(slots) if s >= 0)
        self.tslot = tuple(slots[p] for p in self.tpos)
        first = [-1] * self.n
        for p, s in zip(self.tpos, self.tslot, strict=True):
            if first[s] < 0:
                first[s] = p
        self.first = tuple(first)
        self.updated = tuple(i for i in range(self.n) if i not in frozen)
        self.kept = tuple(i for i in range(self.n) if i in frozen)
        # Run on every step: the same selections as list comprehensions, in C.
        self.pick_trainable = picker(self.tpos)
        self.pick_by_param = picker(self.tslot)
        self.pick_first = picker(self.first)
        self.pick_updated = picker(self.updated)
        self.pick_kept = picker(self.kept)
        # Places that may be trained but were not floating-point at setup: one that
        # becomes so has no optimiser state and would silently never be trained.
        self.undiff = tuple(p for p, s in enumerate(slots) if s == -2)
        self.pick_undiff = picker(self.undiff)
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + part.state_def.num_leaves)
        self.offsets = tuple(offsets)
        self._hash = hash((treedef, slots, parts, owner, frozen, tied))
        self._layout: Any = None
        self._paths: list[str] | None = None
        self._pinned: list[int] | None = None
        self._shape: Shape | None = None
        # `[guard]` of what the rules' own functions read (`_optguard`), on first step.
        self._rules: list[Any] | None = None
        if like is not None and like.treedef is treedef:
            self._layout, self._paths, self._pinned = like._layout, like._paths, like._pinned
            self._shape = like._shape
        self._names: list[str] | None = None
        self._masks: dict[tuple[int, ...], list[Any]] = {}
        # Configs found equal to this one (see __eq__), by id, each with a weak
        # reference that says the id still names that object.
        self._equal: dict[int, weakref.ref[_Config]] = {}

    def with_treedef(self, treedef: Any) -> _Config:
        """This configuration for a model whose static data changed (same leaves, paths
        and container kinds): the model-derived caches are rebuilt for the new one."""
        keys = ("slots", "parts", "owner", "frozen", "tied", "avals")
        return _Config(treedef, **{k: getattr(self, k) for k in keys})

    def replaced(self, **change: Any) -> _Config:
        """A new config with some fields changed (the model-derived caches carried over)."""
        keys = ("slots", "parts", "owner", "frozen", "tied", "avals")
        fields = {k: getattr(self, k) for k in keys}
        fields.update(change)
        return _Config(self.treedef, **fields, like=self)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # The compiled step is keyed on its config: two equal configs (two models
        # of one architecture) share it, and jax compares them on every call.
        if self is other:
            return True
        if not isinstance(other, _Config) or self._hash != other._hash:
            return False
        known = self._equal.get(id(other))
        if known is not None and known() is other:  # compared before; configs never change
            return True
        equal = (
            self.slots == other.slots
            and self.owner == other.owner
            and self.frozen == other.frozen
            and self.tied == other.tied
            and self.parts == other.parts
            and same_structure(self.treedef, other.treedef)
        )
        if equal:
            if len(self._equal) >= 16:
                self._equal.clear()
            self._equal[id(other)] = weakref.ref(other)
        return equal

    def shape(self, leaves: list[Any]) -> Shape:
        """The model's structure as generated code (built on first use, from its leaves)."""
        if self._shape is None:
            self._shape = Shape(self.treedef, leaves)
        return self._shape

    # --- derived lazily: only views, errors and checkpoints need these --------------
    @property
    def layout(self) -> Any:
        """The model's shape with a `_Pos` at every leaf: what `state.l1[0]` navigates."""
        if self._layout is None:
            n = self.treedef.num_leaves
            self._layout = self.treedef.unflatten([_Pos(p) for p in range(n)])
        return self._layout

    @property
    def paths(self) -> list[str]:
        """The dotted model path of every leaf position."""
        if self._paths is None:
            flat = jax.tree_util.tree_flatten_with_path(self.layout)[0]
            self._paths = [path_str(path) or "<root>" for path, _ in flat]
        return self._paths

    @property
    def names(self) -> list[str]:
        """Checkpoint name of every optax state leaf: the part's scope and the optax path.

        The optax path holds the model path for per-parameter entries
        (`0.mu.layers.0.weight`), and it depends only on the rules and the
        model, never on what happened during training.
        """
        if self._names is None:
            names: list[str] = []
            scopes: dict[str, int] = {}
            for part in self.parts:
                seen = scopes[part.scope] = scopes.get(part.scope, 0) + 1
                scope = part.scope if seen == 1 else f"{part.scope}#{seen}"
                dummy = part.state_def.unflatten([0] * part.state_def.num_leaves)
                for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]:
                    inner = path_str(path)
                    names.append(f"{scope}:{inner}" if scope else inner or "<root>")
            # Dict keys are free text: {"a.b": x} beside {"a": {"b": y}} print alike.
            self._names = distinct(names)
        return self._names

    def present_all(self, tracing: bool) -> Any:
        """`present((), tracing)`: every gradient given, as on most steps."""
        masks = self._masks.get(())
        if masks is not None and not tracing and masks[1] is not None:
            return masks[1]
        return self.present((), tracing)

    def present(self, missing: tuple[int, ...], tracing: bool) -> Any:
        """A bool per trainable position, False where the gradient is `None` (cached).

        Inside a trace it is a numpy array, which becomes a literal: a cached
        device array would be a constant from outside the trace, which
        `tg.jit` reports as a hidden capture.
        """
        masks = self._masks.get(missing)
        if masks is None:
            host = np.ones(len(self.tpos), dtype=bool)
            host[list(missing)] = False
            if len(self._masks) >= 64:
                self._masks.clear()
            masks = self._masks[missing] = [host, None]
        if tracing:
            return masks[0]
        if masks[1] is None:
            # One transfer per pattern rather than one per step.
            masks[1] = jax.device_put(masks[0])
        return masks[1]

    def pinned(self, model: Any) -> list[int]:
        """Trainable positions `tg.update_` cannot rebind: immutable containers up to the root."""
        if self._pinned is None:
            free = _rebindable(model)
            self._pinned = [p for p in self.tpos if not free[p]]
        return self._pinned

    def path_of(self, node: Any) -> str:
        """The dotted model path of a node of `layout` (found by identity)."""
        if node is self.layout:
            return ""

        def find(at: Any, prefix: tuple[Any, ...]) -> tuple[Any, ...] | None:
            level = functor(at)
            for key, child in level[0] if level else ():
                if child is node:
                    return (*prefix, key)
                found = find(child, (*prefix, key))
                if found is not None:
                    return found
            return None

        return path_str(find(self.layout, ()) or ())

    def positions(self, node: Any) -> list[int]:
        """The leaf positions under a node of `layout`."""
        return [x.p for x in jax.tree_util.tree_leaves(node) if isinstance(x, _Pos)]

    def params_under(self, node: Any) -> list[int]:
        """The distinct parameters under a node of `layout`."""
        slots = self.slots
        return list(dict.fromkeys(slots[p] for p in self.positions(node) if slots[p] >= 0))


def _rebindable(model: Any) -> list[bool]:
    """Per leaf position: whether a mutable container holds it, at some depth.

    `tg.update_` rebuilds tuples on the way up to the nearest Module, list or
    dict and rebinds there; a leaf with only tuples above it cannot be
    updated in place. Checked before anything is rebound.
    """
    out: list[bool] = []

    def go(node: Any, free: bool) -> None:
        level = functor(node)
        if level is None:
            out.append(free)
            return
        children = level[0]
        free = free or _mutable(node, children)
        for _, child in children:
            go(child, free)

    go(model, False)
    return out


def holders(model: Any, position: int) -> list[type]:
    """The types of the containers above leaf `position`, from the root down."""
    count = 0

    def go(node: Any, above: list[type]) -> list[type] | None:
        nonlocal count
        level = functor(node)
        if level is None:
            count += 1
            return above if count - 1 == position else None
        for _, child in level[0]:
            found = go(child, [*above, type(node)])
            if found is not None:
                return found
        return None

    return go(model, []) or []


def _mutable(node: Any, children: list[tuple[Any, Any]]) -> bool:
    if isinstance(node, (Module, list, dict)):
        return True
    if isinstance(node, tuple) or node is None:
        return False
    # Foreign pytrees (an equinox Module) are rebound attribute by attribute.
    return all(isinstance(k, jax.tree_util.GetAttrKey) for k, _ in children)
