"""Building an optimiser state's configuration, and changing it.

`tg.setup(rule, model)` calls `rule.init` on the *trainable tree*: the model
itself with `None` in place of every leaf the optimiser does not train
(non-differentiable leaves, attributes left out by `__trainable__`, and every
place of a tied array but the first). Every optax combinator then sees the
tree it expects (`clip_by_global_norm` the whole model, `masked` and
`multi_transform` their label trees, `flatten` one vector), exactly as a plain
optax user holds it (`build`, `new_part`).

A config then changes only here, always into a new `_Config`: a sub-model given
a state of its own (`graft`), a part copied so that some parameters get their
own hyperparameters (`own_part`), parameters frozen or thawed (`with_frozen`).
Apart from `_optstate.py` (the types these build) because this is what runs at
setup and on assignment, never on a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._layout import place_state
from ._optstate import _Config, _Part
from ._optstatemap import _statemap
from ._paramsource import refuse_opaque_containers, trainable_leaves_with_path
from ._tree import (
    describe_aval,
    describe_leaf,
    first_difference,
    functor,
    is_differentiable,
    is_inexact,
    path_str,
    refuse_unsortable,
    same_structure,
    unique_by_id,
)


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
    state = _steady_dtypes(rule, _init(rule, tree, treedef, leaves, masked), tree)
    _refuse_lookahead(state)
    state_leaves, state_def = jax.tree_util.tree_flatten(state)
    statemap = _statemap(rule, state, param_def, tree)
    part = _Part(rule, state_def, param_def, tuple(leaf_ids), statemap, scope)
    p_leaves = [x for x in masked if x is not None]
    owners = [p_leaves[local] if local >= 0 else None for local in statemap]
    return part, place_state(state_leaves, owners, p_leaves)


def _init(rule: Any, tree: Any, treedef: Any, leaves: Sequence[Any], masked: list[Any]) -> Any:
    """`rule.init(tree)`, saying why when it fails on the `None` of the trainable tree.

    Most optax rules skip `None` in a parameter tree; a few (optax.contrib.galore) read
    every leaf as an array and fail with an AttributeError from inside optax that names
    neither treegrad's placeholders nor the model place.
    """
    from ._optview import rule_name  # not at the top: _optview imports this module

    try:
        return rule.init(tree)
    except Exception as e:  # optax's error, re-raised unless explained below (chained)
        called = _callable_tree(rule)
        if called is not None:
            # optax.multi_transform calls its labels when they are callable, and a
            # model-shaped labels tree built from a Module (jax.tree.map(f, model)) is
            # callable: optax ran the model on the parameters, failing far from the cause.
            raise TypeError(
                f"tg.setup: the optax rule {rule_name(rule)} failed to initialise "
                f"({type(e).__name__}: {e}). It holds a {type(called).__name__}, a pytree that "
                "is callable (a Module with __call__), which optax takes for a function of "
                "the parameters and calls (optax.multi_transform's param_labels). Pass the "
                "labels tree through a function: param_labels=lambda _: labels."
            ) from e
        holes = [p for p, x in enumerate(masked) if x is None]
        if not (isinstance(e, (AttributeError, TypeError, IndexError)) and holes) or (
            "NoneType" not in str(e)
        ):  # another failure: optax's own message
            raise

        flat = jax.tree_util.tree_flatten_with_path(treedef.unflatten(list(leaves)))[0]
        where = path_str(flat[holes[0]][0]) or "<root>"
        raise TypeError(
            f"tg.setup: the optax rule {rule_name(rule)} failed to initialise "
            f"({type(e).__name__}: {e}). It is given the trainable tree, the model with None "
            f"in place of each array it does not train (first at '{where}': "
            f"{describe_leaf(leaves[holes[0]])}, {_why_none(leaves[holes[0]], masked, holes[0])}), "
            "and this rule does not accept None in a parameter tree. Give it a sub-model "
            "whose arrays are all trained (state.sub = tg.setup(rule, model.sub)), or use "
            "another rule."
        ) from e


def _callable_tree(rule: Any) -> Any:
    """A callable pytree (a Module) the rule holds, or None."""
    from ._reach import user_functions

    return next((x for x in user_functions([rule]) if not jax.tree_util.all_leaves([x])), None)


def _why_none(leaf: Any, masked: list[Any], p: int) -> str:
    if is_differentiable(leaf) and any(x is leaf for x in masked[:p]):
        return "the second place of a tied array"
    if is_differentiable(leaf):
        return "not trained (outside __trainable__ or removed from the Params)"
    return "not floating-point"


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
    if not same_structure(after_def, jax.tree_util.tree_structure(state)):
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


def trainable_slots(
    model: Any, among: Any = None, api: str = "tg.setup"
) -> tuple[list[Any], Any, list[int], list[Any]]:
    """Flatten `model` and number its distinct trainable arrays.

    Returns `(leaves, treedef, slots, uniq)`: `slots[p]` is the index in
    `uniq` of the array at leaf position `p` (the same for every place of a
    tied array); -2 where the leaf may be trained but is not floating-point (an
    integer array, a Python number), -1 where it is not to be trained.

    `among`: the `tg.Params` that `model` is the source of, or None. An array
    removed from it (`ps.remove(model.emb)`) is not a parameter (-1): the rule
    sees the Params' arrays, as a plain optax user given them would.
    """
    try:
        leaves, treedef = jax.tree_util.tree_flatten(model)
    except ValueError as e:  # a dict whose keys jax cannot sort: named
        refuse_unsortable(api, [("the model", model)], e)
        raise
    trainable = trainable_leaves_with_path(model)
    _refuse_abstract(trainable, api)
    refuse_opaque_containers(trainable, api)
    places = {id(leaf) for _, leaf in trainable}
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


def _refuse_abstract(trainable: list[tuple[tuple[Any, ...], Any]], api: str) -> None:
    """A floating ShapeDtypeStruct where a parameter goes (a model from
    `jax.eval_shape`) is not an array: counted as one that is not trained, tg.setup
    gave a state with no parameters at all (and tg.destructure an empty vector),
    silently; loading a saved state into it or updating a real model with it then
    failed with messages about another cause."""
    for path, leaf in trainable:
        if isinstance(leaf, jax.ShapeDtypeStruct) and is_inexact(leaf.dtype):
            raise TypeError(
                f"{api}: '{path_str(path)}' is a jax.ShapeDtypeStruct "
                f"({describe_aval(leaf.shape, leaf.dtype)}), not an array: the model is "
                f"abstract (from jax.eval_shape?). Give {api} the real model; for an abstract "
                "optimiser state (a `like` for tg.load), use "
                "jax.eval_shape(lambda: tg.setup(rule, make_model()))."
            )


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
    "build",
    "shares_nodes",
    "graft",
    "new_part",
    "own_part",
    "split_leaves",
    "trainable_slots",
    "with_frozen",
]
