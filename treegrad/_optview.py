"""The optimiser state as the user sees it: shaped like the model.

`state.l1`, `state[0]` and `state["w"]` navigate as the model does (through
the model's own `__getattr__`/`__getitem__`, so `state[0]` of a `Chain` is
what `model[0]` is); at a trainable array one finds a `Leaf`: its rule, its
view of the optax state, and whether it is frozen. Assigning a state built for
a sub-model (`state.l1 = tg.setup(rule, model.l1)`) gives that sub-model its
own rule.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn, Self

import jax

from ._fasttree import register_tuple_node
from ._optbuild import graft
from ._optstate import _Config, _Pos
from ._optstatemap import MIXED, param_state
from ._paths import register_in_place


class _View:
    """Navigation shared by `OptState` and `SubState`: as on the model."""

    __slots__ = ()

    def _at(self) -> tuple[OptState, Any]:
        raise NotImplementedError

    def _child(self, node: Any, name: str) -> Any:
        try:
            return getattr(node, name)
        except AttributeError:
            raise AttributeError(
                f"the optimiser state has no '{name}' here; it mirrors the model, whose "
                f"{type(node).__name__} has no attribute '{name}'"
            ) from None

    def _item(self, node: Any, key: Any) -> Any:
        try:
            return node[key]
        except (KeyError, IndexError, TypeError) as e:
            if isinstance(node, dict):
                have = "keys " + ", ".join(map(repr, node))
            elif isinstance(node, (list, tuple)):
                have = f"length {len(node)}"
            else:
                have = "no items"
            raise type(e)(
                f"the optimiser state has no [{key!r}] here; it mirrors the model, whose "
                f"{type(node).__name__} has {have}"
            ) from None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        root, node = self._at()
        return root._wrap(self._child(node, name))

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            raise TypeError("index the optimiser state one element at a time")
        root, node = self._at()
        return root._wrap(self._item(node, key))

    def __setattr__(self, name: str, other: Any) -> None:
        root, node = self._at()
        root._graft(self._child(node, name), other)

    def __setitem__(self, key: Any, other: Any) -> None:
        root, node = self._at()
        root._graft(self._item(node, key), other)

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("iterate over the model, and index the state with the same keys")

    # Underscored: any other name would hide a model attribute of that name.
    def _params_under(self) -> list[int]:
        root, node = self._at()
        return root._config.params_under(node)

    def _scope(self) -> str:
        root, node = self._at()
        return root._config.path_of(node)


class OptState(_View):
    """The optimiser state of a model, from `tg.setup`; navigate it like the model.

    One optax state over the model's trainable arrays, as plain optax would
    hold it. A pytree whose leaves are that state's arrays, named by the
    optax path (which holds the model path) for checkpoints, so it passes
    through `tg.jit` and `tg.save`/`tg.load`.

    Examples:
        >>> import jax, optax, treegrad as tg
        >>> from treegrad import nn
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> model = nn.Chain(nn.Dense(2, 3, key=k1), nn.Dense(3, 1, key=k2))
        >>> state = tg.setup(optax.adam(1e-3), model)
        >>> state[1].bias
        Leaf(chain)
        >>> len(jax.tree_util.tree_leaves(state))  # one count, and mu and nu per array
        9
        >>> [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]][1]
        (DictKey(key='0.mu.layers.0.weight'),)
    """

    __slots__ = ("_config", "_leaves", "_views")

    _config: _Config
    _leaves: tuple[Any, ...]

    def __init__(self, config: _Config, leaves: Sequence[Any]):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_leaves", tuple(leaves))
        object.__setattr__(self, "_views", {})

    def _at(self) -> tuple[OptState, Any]:
        return self, self._config.layout

    # `copy` would restore slots through __setattr__, which assigns rules here.
    def __copy__(self) -> OptState:
        return OptState(self._config, self._leaves)

    def __deepcopy__(self, memo: dict[int, Any]) -> OptState:
        return OptState(self._config, copy.deepcopy(self._leaves, memo))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The state holds its optax rule, functions made inside optax that pickle
        # cannot store; a checkpoint stores the arrays, and the rule is given again.
        raise TypeError(
            "cannot pickle a treegrad optimiser state: it holds its optax rule (functions "
            "made inside optax, which pickle cannot store). Save it with "
            "tg.save(path, state) and read it back with "
            "tg.load(path, tg.setup(rule, model)); or pickle jax.tree_util.tree_leaves(state)."
        )

    def _install(self, config: _Config, leaves: Sequence[Any]) -> None:
        """Replace configuration and arrays in place (views follow: they read the root)."""
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_leaves", tuple(leaves))

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, _Pos):
            i = self._config.slots[value.p]
            return None if i < 0 else self._leaf(i)
        if any(isinstance(x, _Pos) for x in jax.tree_util.tree_leaves(value)):
            return SubState(self, value)
        return None

    def _leaf(self, i: int) -> Leaf:
        # One view per parameter: the places of a tied array give the same Leaf.
        views: dict[int, Leaf] = self._views
        view = views.get(i)
        if view is None:
            view = views[i] = Leaf(self, i)
        return view

    def _graft(self, node: Any, other: Any) -> None:
        if not isinstance(other, OptState):
            raise TypeError(
                "assign a state from tg.setup to a sub-state, e.g. "
                f"state.l1 = tg.setup(optax.sgd(1e-3), model.l1); got {type(other).__name__}."
            )
        self._install(*graft(self._config, self._leaves, node, other._config, other._leaves))

    def _part_state(self, k: int) -> Any:
        config = self._config
        o = config.offsets
        return config.parts[k].state_def.unflatten(self._leaves[o[k] : o[k + 1]])

    def __repr__(self) -> str:
        config = self._config
        rules = ", ".join(
            f"{rule_name(p.rule)}" + (f" at '{p.scope}'" if p.scope else "") for p in config.parts
        )
        frozen = f", {len(config.frozen)} frozen" if config.frozen else ""
        return (
            f"<optimiser state of {type(config.layout).__name__}: {rules or 'no parameters'}; "
            f"{config.n} parameter array(s){frozen}>"
        )


class SubState(_View):
    """The optimiser state of a sub-model (`state.l1`, `state[0]`): a view of its root."""

    __slots__ = ("_node", "_root")

    def __init__(self, root: OptState, node: Any):
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_node", node)

    def _at(self) -> tuple[OptState, Any]:
        return self._root, self._node

    # Without these, copy/deepcopy/pickle rebuilt the view empty and restored its
    # slots through `_View.__setattr__`, which reads `_root` before it is set: a
    # RecursionError. A copy is a view of the same root; a deep copy, a view of a
    # deep-copied root (updating either leaves the other alone), as for OptState.
    def __copy__(self) -> SubState:
        return SubState(self._root, self._node)

    def __deepcopy__(self, memo: dict[int, Any]) -> SubState:
        # `_node` belongs to the root's configuration, which a deep copy shares.
        return SubState(copy.deepcopy(self._root, memo), self._node)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._root.__reduce_ex__(protocol)  # OptState's clear TypeError

    def __repr__(self) -> str:
        where = self._root._config.path_of(self._node)
        return f"<optimiser state of {type(self._node).__name__} at '{where}'>"


class Leaf:
    """The optimiser state of one parameter, as seen through `state.path.to.weight`.

    `rule` is the optax rule updating it, `state` its view of that rule's
    optax state (its own moments, and the counters it shares with the other
    parameters), `frozen` whether updates skip it.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> state = tg.setup(optax.adam(1e-3), {"w": jnp.ones(3)})
        >>> leaf = state["w"]
        >>> leaf.state[0].mu.shape, int(leaf.state[0].count), leaf.frozen
        ((3,), 0, False)
    """

    __slots__ = ("_i", "_root")

    def __init__(self, root: OptState, i: int):
        self._root = root
        self._i = i

    @property
    def rule(self) -> Any:
        config = self._root._config
        return config.parts[config.owner[self._i]].rule

    @property
    def state(self) -> Any:
        config = self._root._config
        k = config.owner[self._i]
        part = config.parts[k]
        view = param_state(part, self._root._part_state(k), part.leaf_ids.index(self._i))
        return _read_only(view)

    @property
    def frozen(self) -> bool:
        return self._i in self._root._config.frozen

    @property
    def path(self) -> str:
        """The model path of this parameter (its first place, if tied)."""
        config = self._root._config
        return config.paths[config.first[self._i]]

    def _params_under(self) -> list[int]:
        return [self._i]

    def _scope(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"Leaf({rule_name(self.rule)}{', frozen' if self.frozen else ''})"


jax.tree_util.register_pytree_node(Leaf, lambda v: ((v.state,), None), lambda _, c: next(iter(c)))


def _refuse_edit() -> NoReturn:
    raise TypeError(
        "state[...].state is a view of one parameter's optimiser state, built on each "
        "access: editing it (e.g. the optax idiom hyperparams['learning_rate'] = x) would "
        "change nothing. Use tg.adjust_(state, learning_rate=x), or tg.adjust for a new state."
    )


class _ViewDict(dict[Any, Any]):
    """A dict inside a `Leaf.state` view (optax's `hyperparams`): the view is built on
    each access, so an edit of it would change nothing; refused, with the way to do it."""

    def __setitem__(self, key: Any, value: Any) -> None:
        _refuse_edit()

    def __delitem__(self, key: Any) -> None:
        _refuse_edit()

    # `d |= x` must refuse too (dict's C __ior__ would bypass __setitem__).
    def __ior__(self, other: Any) -> Self:  # type: ignore[misc]  # typeshed's overloaded __or__
        _refuse_edit()

    def update(self, *args: Any, **kwargs: Any) -> None:
        _refuse_edit()

    def pop(self, *args: Any) -> Any:
        _refuse_edit()

    def popitem(self) -> Any:
        _refuse_edit()

    def clear(self) -> None:
        _refuse_edit()

    def setdefault(self, *args: Any) -> Any:
        _refuse_edit()

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (copy, deepcopy, pickle) is the user's own: a plain dict, editable.
        return (dict, (dict(self),))


def _keyed_items(d: _ViewDict) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
    keys = tuple(sorted(d))
    return [(jax.tree_util.DictKey(k), d[k]) for k in keys], keys


def _as_dict(keys: tuple[Any, ...], values: Any) -> Any:
    # What jax builds from a view (tree_map over it) is a new value: a plain dict.
    return dict(zip(keys, values, strict=True))


# Flattened as a dict is (sorted keys), so the view's leaves are those of optax's state.
jax.tree_util.register_pytree_with_keys(_ViewDict, _keyed_items, _as_dict)


def _read_only(view: Any) -> Any:
    """The view with each dict in it (through tuples and named tuples) a `_ViewDict`."""
    if type(view) is dict:
        return _ViewDict({k: _read_only(v) for k, v in view.items()})
    if isinstance(view, tuple):
        items = [_read_only(v) for v in view]
        return type(view)(*items) if hasattr(view, "_fields") else type(view)(items)
    return view


def rule_name(rule: Any) -> str:
    qual = getattr(getattr(rule, "init", None), "__qualname__", "") or ""
    return qual.split(".<locals>")[0] if qual else type(rule).__name__


def skip_problem(config: _Config, i: int, k: int) -> str:
    """Why parameter `i` of part `k` cannot be skipped (for `update` and `freeze_`)."""
    part = config.parts[k]
    path = config.paths[config.first[i]]
    names = config.names[config.offsets[k] : config.offsets[k + 1]]
    mixed = next(n for n, local in zip(names, part.statemap, strict=True) if local == MIXED)
    return (
        f"'{path}' is skipped (a None gradient, or frozen) while other parameters of its "
        f"rule {rule_name(part.rule)} are stepped, and that rule keeps their state together "
        f"in one array ('{mixed}', as optax.flatten does), so its part of it cannot be kept "
        "unchanged and would be stepped with a zero gradient. Give it a rule of its own "
        "(state.sub = tg.setup(rule, model.sub)), which it can skip whole, or use the rule "
        "without optax.flatten."
    )


def _flatten(state: OptState) -> tuple[tuple[Any, ...], _Config]:
    return state._leaves, state._config


def _flatten_with_keys(state: OptState) -> tuple[list[tuple[Any, Any]], _Config]:
    names = state._config.names
    keyed = [(jax.tree_util.DictKey(n), x) for n, x in zip(names, state._leaves, strict=True)]
    return keyed, state._config


def _unflatten(config: _Config, leaves: Any) -> OptState:
    return OptState(config, leaves)


jax.tree_util.register_pytree_with_keys(
    OptState, _flatten_with_keys, _unflatten, flatten_func=_flatten
)
register_tuple_node(OptState, "_config", "_leaves", _unflatten)
# In place, for tg.update_ and for compiled implicit steps writing the new state back.
register_in_place(OptState, lambda state, leaves: state._install(state._config, leaves))
