"""The optimiser state: one optax state over the model's trainable tree.

`tg.setup(rule, model)` calls `rule.init` on the *trainable tree*: the model
itself with `None` in place of every leaf the optimiser does not train
(non-differentiable leaves, attributes left out by `__trainable__`, and every
place of a tied array but the first). Every optax combinator then sees the
tree it expects (`clip_by_global_norm` the whole model, `masked` and
`multi_transform` their label trees, `flatten` one vector), exactly as a plain
optax user holds it.

A `_Part` is one rule with its optax state. A state has one part, unless a
sub-model was given its own rule (`state.l1 = tg.setup(rule2, model.l1)`) or
its own hyperparameters (`tg.adjust_(state.l1, ...)`): each part then *owns*
some parameters, and treats the others as skipped (see `_optstep.py`).
Everything static (rules, tree structures, which part owns which parameter,
which are frozen) lives in one hashable `_Config`, the treedef aux of the
`OptState` pytree; its only children are the optax states' arrays, so a step
passes the same config object on and jax never re-hashes it.

Which optax state entries belong to which parameter comes from optax's public
`optax.tree_map_params`, once per part (`_Part.statemap`); for a rule it cannot map
(`optax.flatten`, `optax.sm3`), from what the rule's init leaves out when a parameter
is left out (`_statemap_by_removal`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._fasttree import Shape
from ._layout import place_state
from ._module import Module, register_child_type
from ._params import distinct, trainable_leaves_with_path
from ._tree import (
    first_difference,
    functor,
    is_differentiable,
    path_str,
    picker,
    unique_by_id,
)


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
            and self.treedef == other.treedef
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


# --- which optax state entries belong to which parameter ------------------------------


def _is_hole(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def _map_param_subtrees(
    rule: Any, state: Any, fn: Callable[[Any], Any], shared: Callable[[Any], Any] | None
) -> Any:
    """`optax.tree_map_params`, with `fn` given each whole parameter-shaped subtree.

    `shared` maps the other (shared) entries; None keeps them. Returns None
    when optax cannot tell: `optax.flatten`'s init cannot take optax's
    parameter placeholder ("Need at least one array to concatenate"), and its
    state is over one vector, not per parameter anyway.
    """
    try:
        return optax.tree_map_params(
            rule, fn, state, is_leaf=lambda _: True, transform_non_params=shared
        )
    except (ValueError, TypeError, IndexError):  # IndexError: optax.lbfgs's line search
        return None


MIXED = -2
"""A `_Part.statemap` entry for an optax state leaf that holds several parameters'
state at once, in a layout not known: it cannot be kept for one of them."""
RAVELED = -3
"""A `_Part.statemap` entry for an optax state leaf that holds every parameter's
state raveled into one vector, in the tree's order (`optax.flatten`'s, made with
`jax.flatten_util.ravel_pytree`): a skipped parameter's slice is kept."""


def _statemap(rule: Any, state: Any, param_def: Any, tree: Any) -> tuple[int, ...]:
    n_state = len(jax.tree_util.tree_leaves(state))
    index = param_def.unflatten(range(param_def.num_leaves))

    def positions(sub: Any) -> Any:
        # optax.masked and multi_transform put MaskedNode where a parameter is
        # not theirs: those entries have no state.
        return jax.tree_util.tree_map(
            lambda x, i: x if _is_hole(x) else i, sub, index, is_leaf=_is_hole
        )

    def shared(v: Any) -> Any:
        return jax.tree_util.tree_map(lambda _: -1, v)

    marked = _map_param_subtrees(rule, state, positions, shared)
    leaves = [] if marked is None else jax.tree_util.tree_leaves(marked)
    if len(leaves) != n_state or not all(isinstance(x, int) for x in leaves):
        return _statemap_by_removal(rule, param_def, tree, n_state)
    return tuple(leaves)


def _statemap_by_removal(rule: Any, param_def: Any, tree: Any, n_state: int) -> tuple[int, ...]:
    """`_statemap` for a rule `optax.tree_map_params` cannot map as a whole (it inits the
    whole rule on a placeholder, which `optax.flatten` and `optax.sm3` cannot take, even
    as one part of a chain or `multi_transform`).

    What the rule keeps for a parameter is what its init no longer makes when that
    parameter is left out of the tree (`None` there, as for an untrained leaf). With
    parameters left out by the bits of their number (each set and its complement, so
    2·⌈log2 n⌉ inits under `jax.eval_shape`), each state leaf is one parameter's (gone
    exactly when it is left out), shared (never changes: optax's `count`), or `MIXED`
    (changes with several: `optax.flatten`'s one vector), by its optax key path.
    """
    flat = param_def.flatten_up_to(tree)
    n = len(flat)
    spec = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]

    def init_without(left_out: set[int]) -> dict[Any, Any] | None:
        t = param_def.unflatten([None if k in left_out else x for k, x in enumerate(spec)])
        try:
            out = jax.eval_shape(rule.init, t)
        except (ValueError, TypeError, IndexError):  # a rule that needs those parameters
            return None
        return {path: x.shape for path, x in jax.tree_util.tree_flatten_with_path(out)[0]}

    full = init_without(set())
    if full is None or len(full) != n_state:
        return (MIXED,) * n_state
    paths = list(full)
    code = [0] * n_state
    owned = [True] * n_state
    shared = [True] * n_state
    for b in range(max(1, (n - 1).bit_length())):
        ones = {k for k in range(n) if k >> b & 1}
        with_one, with_zero = init_without(ones), init_without(set(range(n)) - ones)
        if with_one is None or with_zero is None:
            return (MIXED,) * n_state
        for j, path in enumerate(paths):
            gone_one = with_one.get(path) != full[path]
            gone_zero = with_zero.get(path) != full[path]
            shared[j] = shared[j] and not (gone_one or gone_zero)
            owned[j] = owned[j] and gone_one != gone_zero
            code[j] |= gone_one << b
    total = sum(math.prod(x.shape) for x in spec)

    def mixed(j: int) -> int:
        # One vector as long as all the parameters together: optax.flatten's.
        return RAVELED if full[paths[j]] == (total,) else MIXED

    return tuple(
        -1 if shared[j] else code[j] if owned[j] and code[j] < n else mixed(j)
        for j in range(n_state)
    )


def mixed_skips(config: _Config, skipped: Iterable[int]) -> tuple[int, int] | None:
    """A skipped parameter (no gradient, or frozen) whose part keeps `MIXED` state it
    shares with a parameter of that part that is not skipped, as `(parameter, part)`:
    the one vector cannot be kept for one parameter and stepped for another."""
    skipped = set(skipped)
    for k, part in enumerate(config.parts):
        if MIXED not in part.statemap:
            continue
        mine = [i for i in part.leaf_ids if config.owner[i] == k]
        some = [i for i in mine if i in skipped]
        if some and len(some) < len(mine):
            return some[0], k
    return None


def param_state(part: _Part, state: Any, local: int) -> Any:
    """One parameter's view of a part's optax state: its own entries and the shared ones.

    Where the optax state holds a model-shaped tree (Adam's `mu`), the view
    holds this parameter's array; `optax.MaskedNode()` where a masked rule
    keeps nothing for it. The whole state for rules optax cannot map.
    """
    index = part.param_def.unflatten(range(part.param_def.num_leaves))

    def pick(sub: Any) -> Any:
        found: list[Any] = []
        jax.tree_util.tree_map(
            lambda x, i: found.append(x) if local in jax.tree_util.tree_leaves(i) else None,
            sub,
            index,
            is_leaf=_is_hole,
        )
        return found[0] if found else optax.MaskedNode()

    view = _map_param_subtrees(part.rule, state, pick, None)
    return state if view is None else view


# --- building and changing the configuration ------------------------------------------


def new_part(rule: Any, treedef: Any, slots: Sequence[int], leaves: Sequence[Any], scope: str):
    """Initialise `rule` on the trainable tree; returns the part and its state's leaves."""
    seen: set[int] = set()
    masked: list[Any] = []
    leaf_ids: list[int] = []
    for s, leaf in zip(slots, leaves, strict=True):
        if s >= 0 and s not in seen:
            seen.add(s)
            leaf_ids.append(s)
            masked.append(leaf)
        else:
            masked.append(None)
    tree = treedef.unflatten(masked)
    param_def = jax.tree_util.tree_structure(tree)
    state = _steady_dtypes(rule, rule.init(tree), tree)
    _refuse_lookahead(state)
    state_leaves, state_def = jax.tree_util.tree_flatten(state)
    statemap = _statemap(rule, state, param_def, tree)
    part = _Part(rule, state_def, param_def, tuple(leaf_ids), statemap, scope)
    p_leaves = [x for x in masked if x is not None]
    owners = [p_leaves[local] if local >= 0 else None for local in statemap]
    return part, place_state(state_leaves, owners, p_leaves)


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _steady_dtypes(rule: Any, state: Any, tree: Any) -> Any:
    """`rule.init`'s state in the dtypes its update returns.

    `optax.inject_hyperparams` keeps its hyperparameters as arrays of the
    parameters' common dtype (complex for a model mixing real and complex
    arrays), and the moments of a real parameter take that dtype at the first
    step (as in plain optax). Made so from the start, the state keeps one layout:
    a state saved after a step loads into a fresh `tg.setup`, and the compiled
    step is not traced again at the second step. The values are those plain
    optax computes (zeros cast, exactly).
    """
    found = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, _INJECTED))
    if not any(isinstance(x, _INJECTED) for x in found):
        return state  # the usual rules keep their dtypes: no trace at setup
    after = jax.eval_shape(lambda s, p: rule.update(p, s, p)[1], state, tree)
    after_def: Any = jax.tree_util.tree_structure(after)
    if after_def != jax.tree_util.tree_structure(state):
        return state
    return jax.tree_util.tree_map(
        lambda x, a: x.astype(a.dtype) if x.shape == a.shape and x.dtype != a.dtype else x,
        state,
        after,
    )


def _refuse_lookahead(state: Any) -> None:
    """optax.lookahead steps a `LookaheadParams(fast, slow)` pair, not the model:
    its update would fail inside the compiled step on the model's tree."""
    found = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, optax.LookaheadState))
    if any(isinstance(x, optax.LookaheadState) for x in found):
        raise TypeError(
            "tg.setup: optax.lookahead updates a pair of parameter trees "
            "(optax.LookaheadParams(fast, slow)), not a model, so treegrad's optimiser, which "
            "updates the model itself, cannot run it. Train with the inner rule, or use "
            "plain optax for lookahead (its state and params are pytrees: "
            "tg.gradient gives the gradient tree it needs)."
        )


def trainable_slots(model: Any, among: Any = None) -> tuple[list[Any], Any, list[int], list[Any]]:
    """Flatten `model` and number its distinct trainable arrays.

    Returns `(leaves, treedef, slots, uniq)`: `slots[p]` is the index in
    `uniq` of the array at leaf position `p` (the same for every place of a
    tied array); -2 where the leaf may be trained but is not floating-point (an
    integer array, a Python number), -1 where it is not to be trained.

    `among`: the `tg.Params` that `model` is the source of, or None. An array
    removed from it (`ps.remove(model.emb)`) is not a parameter (-1): the rule
    sees the Params' arrays, as a plain optax user given them would.
    """
    leaves, treedef = jax.tree_util.tree_flatten(model)
    places = {id(leaf) for _, leaf in trainable_leaves_with_path(model)}
    if among is not None:
        wanted = set(map(id, among))
        removed = {id(x) for x in leaves if id(x) in places and is_differentiable(x)} - wanted
        places -= removed
    tpos = [p for p, leaf in enumerate(leaves) if id(leaf) in places and is_differentiable(leaf)]
    uniq, tslots = unique_by_id(leaves[p] for p in tpos)
    slots = [-2 if id(leaf) in places else -1 for leaf in leaves]
    for p, s in zip(tpos, tslots, strict=True):
        slots[p] = s
    return leaves, treedef, slots, uniq


def shares_nodes(model: Any, leaves: Sequence[Any]) -> bool:
    """Whether `model` holds an array or a sub-model at two places.

    A shared sub-model that holds arrays is found by its leaves (the same objects
    twice); one that holds none (an activation layer used twice, all its
    attributes static) only by walking the nodes. Either must come back as one
    object from a pure `update` or a `rebuild`, which a flatten/unflatten round
    trip would not do (`tree_map_shared` does).
    """
    if len(unique_by_id(leaves)[0]) < len(leaves):
        return True
    seen: set[int] = set()
    held: list[Any] = []  # keeps the ids valid: a foreign pytree may flatten to temporaries
    stack = [model]
    while stack:
        node = stack.pop()
        level = functor(node)
        if level is None:
            continue
        # Tuples are immutable: one held twice is not told apart from two equal ones;
        # None is one object wherever it is.
        if node is not None and not isinstance(node, tuple):
            if id(node) in seen:
                return True
            seen.add(id(node))
            held.append(node)
        stack.extend(child for _, child in level[0])
    return False


def build(rule: Any, model: Any, among: Any = None) -> tuple[_Config, list[Any]]:
    """The configuration and optax state arrays of `tg.setup(rule, model)` (`among`: see
    `trainable_slots`)."""
    leaves, treedef, slots, uniq = trainable_slots(model, among)
    parts: tuple[_Part, ...] = ()
    state_leaves: list[Any] = []
    if uniq:
        part, state_leaves = new_part(rule, treedef, slots, leaves, "")
        parts = (part,)
    # Tied arrays, or a sub-model at two places: rebuilt keeping that sharing.
    tied = shares_nodes(model, leaves)
    avals = tuple((tuple(x.shape), x.dtype) for x in uniq)
    config = _Config(treedef, tuple(slots), parts, (0,) * len(uniq), frozenset(), tied, avals)
    return config, state_leaves


def _aval(aval: tuple[tuple[int, ...], Any]) -> str:
    shape, dtype = aval
    return f"{dtype}[{'×'.join(map(str, shape))}]" if shape else f"{dtype} scalar"


def _join(scope: str, inner: str) -> str:
    return f"{scope}.{inner}" if scope and inner else scope or inner


def graft(
    config: _Config, leaves: Sequence[Any], node: Any, sub: _Config, sub_leaves: Sequence[Any]
) -> tuple[_Config, list[Any]]:
    """Give the sub-model at `node` the rules and state of `sub` (a setup of that sub-model)."""
    scope = config.path_of(node)
    where = scope or "<root>"
    if jax.tree_util.tree_structure(node) != sub.treedef:
        at = first_difference(node, sub.treedef.unflatten([0] * sub.treedef.num_leaves))
        raise ValueError(
            f"the state assigned to '{where}' was set up for a different model"
            f"{f' (first difference at {at!r})' if at else ''}; build it with "
            "tg.setup(rule, sub_model) from the sub-model at that place."
        )
    remap: dict[int, int] = {}
    back: dict[int, int] = {}
    for q, p in enumerate(config.positions(node)):
        s, r = sub.slots[q], config.slots[p]
        if (s < 0) != (r < 0) or (
            s >= 0 and (remap.setdefault(s, r) != r or back.setdefault(r, s) != s)
        ):
            raise ValueError(
                f"the state assigned to '{where}' does not match the model there: at "
                f"'{config.paths[p]}' its trainable or tied arrays differ. Build it with "
                "tg.setup(rule, sub_model) from the sub-model at that place."
            )
        if s >= 0 and sub.avals[s] != config.avals[r]:
            raise ValueError(
                f"the state assigned to '{where}' was set up for a {_aval(sub.avals[s])} array "
                f"at '{config.paths[p]}', where the model has {_aval(config.avals[r])}. Build "
                "it with tg.setup(rule, sub_model) from the sub-model at that place."
            )
    base = len(config.parts)
    parts = [
        *config.parts,
        *(
            part._replace(
                leaf_ids=tuple(remap[i] for i in part.leaf_ids),
                scope=_join(scope, part.scope),
            )
            for part in sub.parts
        ),
    ]
    owner = list(config.owner)
    frozen = set(config.frozen)
    for s, r in remap.items():
        owner[r] = base + sub.owner[s]
        frozen.discard(r)
        if s in sub.frozen:
            frozen.add(r)
    per_part = [*split_leaves(config, leaves), *split_leaves(sub, sub_leaves)]
    new, new_leaves, _ = _drop_unowned(config, parts, owner, frozenset(frozen), per_part)
    return new, new_leaves


def split_leaves(config: _Config, leaves: Sequence[Any]) -> list[list[Any]]:
    """The optax state leaves of each part."""
    o = config.offsets
    return [list(leaves[o[k] : o[k + 1]]) for k in range(len(config.parts))]


def _drop_unowned(
    config: _Config,
    parts: list[_Part],
    owner: list[int],
    frozen: frozenset[int],
    per_part: list[list[Any]],
) -> tuple[_Config, list[Any], dict[int, int]]:
    """Drop the parts that own no parameter; returns the new part numbers too."""
    keep = sorted(set(owner))
    renumber = {k: j for j, k in enumerate(keep)}
    new = config.replaced(
        parts=tuple(parts[k] for k in keep),
        owner=tuple(renumber[k] for k in owner),
        frozen=frozen,
    )
    return new, [x for k in keep for x in per_part[k]], renumber


def with_frozen(config: _Config, chosen: Iterable[int], frozen: bool) -> _Config:
    chosen = set(chosen)
    return config.replaced(
        frozen=frozenset(config.frozen | chosen if frozen else config.frozen - chosen)
    )


def own_part(
    config: _Config, leaves: Sequence[Any], chosen: Sequence[int], scope: str
) -> tuple[_Config, list[Any], list[int]]:
    """Make sure the parameters `chosen` are the whole of the parts owning them.

    A part that also owns other parameters is copied (rule and optax state,
    moments included) into a new part owning the chosen ones, named by
    `scope`; the original keeps the rest. Returns the config, the leaves and
    the parts that own exactly the chosen parameters.
    """
    chosen_set = set(chosen)
    parts = list(config.parts)
    owner = list(config.owner)
    per_part = split_leaves(config, leaves)
    result: list[int] = []
    for k in sorted({owner[i] for i in chosen}):
        mine = {i for i in range(config.n) if owner[i] == k}
        if mine <= chosen_set:
            result.append(k)
            continue
        parts.append(parts[k]._replace(scope=scope))
        # Copies, so that no buffer is held twice in one state (donation would fail).
        per_part.append([jnp.array(x, copy=True) for x in per_part[k]])
        for i in mine & chosen_set:
            owner[i] = len(parts) - 1
        result.append(len(parts) - 1)
    new, new_leaves, renumber = _drop_unowned(config, parts, owner, config.frozen, per_part)
    return new, new_leaves, [renumber[k] for k in result]


__all__ = [
    "MIXED",
    "RAVELED",
    "build",
    "shares_nodes",
    "graft",
    "mixed_skips",
    "new_part",
    "own_part",
    "param_state",
    "split_leaves",
    "trainable_slots",
    "with_frozen",
]
