"""Which optax state entries belong to which parameter of an optimiser state's part.

A part's `statemap` (`_Part.statemap`) says, for each optax state leaf, the
parameter it is kept for, or that it is shared (optax's `count`), or that it
holds several parameters' state at once (`MIXED`, `RAVELED`). It comes from
optax's public `optax.tree_map_params`, once per part; for a rule it cannot map
(`optax.flatten`, `optax.sm3`), from what the rule's init leaves out when a
parameter is left out (`_statemap_by_removal`). A skipped or frozen parameter's
entries are kept from it (`_optstep.py`), and a sub-state view shows one
parameter's (`param_state`).

Apart from `_optstate.py` because it is about optax's state trees, not the
model's: it is computed once, when a part is made (`_optbuild.new_part`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import optax

from ._optstate import _Config, _Part


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


__all__ = [
    "MIXED",
    "RAVELED",
    "mixed_skips",
    "param_state",
]
