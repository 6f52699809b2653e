"""The model-tree optimiser: optax rules applied leaf by leaf, one state tree.

As in Optimisers.jl, `setup` builds a state tree shaped like the model (the
state of `model.l1` is `state.l1`, of `model[0]` is `state[0]`) whose leaves are
`Leaf(rule, state)` objects, one per trainable array; `update` walks model,
gradient and state together. `Leaf` is mutable so that its identity encodes
parameter sharing: a tied weight (the same array object in several places) has
one `Leaf` at each of its places, its gradients are summed, and after the update
the places again hold one object.

The per-leaf optax updates run in one compiled function (`_step`), so a step
costs one dispatch whatever the number of leaves; the optimiser does not know or
care which gradient style produced the gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import optax

from ._module import register_child_type
from ._params import Grads, Params, trainable_leaves_with_path
from ._paths import rebind
from ._tree import first_difference, is_differentiable, is_none


class Leaf:
    """The optimiser state of one parameter: its optax rule and that rule's state.

    A pytree whose only child is `state`; `rule` and `frozen` are static.
    """

    __slots__ = ("frozen", "rule", "state")

    def __init__(self, rule: optax.GradientTransformation, state: Any, frozen: bool = False):
        self.rule = rule
        self.state = state
        self.frozen = frozen

    def __repr__(self) -> str:
        frozen = ", frozen" if self.frozen else ""
        return f"Leaf({_rule_name(self.rule)}{frozen})"


jax.tree_util.register_pytree_with_keys(
    Leaf,
    lambda leaf: (((jax.tree_util.GetAttrKey("state"), leaf.state),), (leaf.rule, leaf.frozen)),
    lambda aux, children: Leaf(aux[0], next(iter(children)), aux[1]),
    flatten_func=lambda leaf: ((leaf.state,), (leaf.rule, leaf.frozen)),
)
register_child_type(Leaf)


def _rule_name(rule: Any) -> str:
    init = getattr(rule, "init", None)
    qual = getattr(init, "__qualname__", "") or ""
    return qual.split(".<locals>")[0] if qual else type(rule).__name__


def _is_leaf_state(x: Any) -> bool:
    return x is None or isinstance(x, Leaf)


def _source(model: Any) -> Any:
    return model.source if isinstance(model, Params) else model


def setup(rule: optax.GradientTransformation, model: Any) -> Any:
    """Build the optimiser state for `model`: a tree shaped like it.

    Arguments:
        rule: any optax `GradientTransformation` (use `optax.inject_hyperparams`
            to be able to `tg.adjust` its hyperparameters later).
        model: a model (Module, dict, list, any pytree) or a `tg.Params`.

    Returns:
        A state tree with the model's structure: a `Leaf` for each trainable
        floating-point array (respecting `__trainable__`), `None` elsewhere.
        Assign a sub-state to use another rule for a sub-model:
        `state.l1 = tg.setup(other_rule, model.l1)`.

    Examples:
        >>> import jax, optax, treegrad as tg
        >>> from treegrad import nn
        >>> model = nn.Chain(nn.Dense(2, 3, key=jax.random.key(0)))
        >>> state = tg.setup(optax.adam(1e-3), model)
        >>> type(state[0].weight).__name__, state[0].weight.state[0].mu.shape
        ('Leaf', (3, 2))
    """
    if not (hasattr(rule, "init") and hasattr(rule, "update")):
        raise TypeError(
            f"tg.setup expects an optax GradientTransformation (e.g. optax.adam(1e-3)), "
            f"got {type(rule).__name__}."
        )
    model = _source(model)
    trainable = {
        id(leaf) for _, leaf in trainable_leaves_with_path(model) if is_differentiable(leaf)
    }
    leaves, treedef = jax.tree_util.tree_flatten(model, is_leaf=is_none)
    shared: dict[int, Leaf] = {}
    states: list[Leaf | None] = []
    for leaf in leaves:
        if id(leaf) not in trainable:
            states.append(None)
            continue
        st = shared.get(id(leaf))
        if st is None:
            st = shared[id(leaf)] = Leaf(rule, rule.init(leaf))
        states.append(st)
    return jax.tree_util.tree_unflatten(treedef, states)


def _apply(leaf: Leaf, p: Any, g: Any) -> tuple[Leaf, Any]:
    updates, new_state = leaf.rule.update(g, leaf.state, p)
    return Leaf(leaf.rule, new_state, leaf.frozen), optax.apply_updates(p, updates)


@jax.jit
def _step(leaves: list[Leaf], params: list[Any], grads: list[Any]) -> tuple[list[Leaf], list[Any]]:
    # Every leaf's optax update in one XLA computation: one dispatch per step.
    new_leaves, new_params = [], []
    for leaf, p, g in zip(leaves, params, grads, strict=True):
        if g is None:
            new_leaves.append(leaf)
            new_params.append(p)
        else:
            nl, np_ = _apply(leaf, p, g)
            new_leaves.append(nl)
            new_params.append(np_)
    return new_leaves, new_params


class _Plan:
    """Model, state and gradients flattened and aligned: one entry per distinct parameter."""

    __slots__ = ("grads", "leaves", "m_def", "m_leaves", "params", "positions", "s_def", "s_leaves")

    def __init__(self, state: Any, model: Any, grads: Any, api: str):
        m_leaves, m_def = jax.tree_util.tree_flatten(model, is_leaf=is_none)
        s_leaves, s_def = jax.tree_util.tree_flatten(state, is_leaf=_is_leaf_state)
        if isinstance(grads, Grads):
            # Looked up by identity, as Grads.to_tree would, without building the tree.
            g_leaves = grads.leaves_for(m_leaves)
        else:
            _check_not_wrapped(grads, model, api)
            g_leaves, g_def = jax.tree_util.tree_flatten(grads, is_leaf=is_none)
            if g_def != m_def:  # type: ignore[operator]
                raise ValueError(_mismatch(api, "gradient", model, grads))
        if len(s_leaves) != len(m_leaves):
            raise ValueError(_mismatch(api, "optimiser state", model, state))
        self.m_leaves, self.m_def, self.s_leaves, self.s_def = m_leaves, m_def, s_leaves, s_def
        index: dict[int, int] = {}
        self.leaves: list[Leaf] = []
        self.params: list[Any] = []
        self.grads: list[Any] = []
        self.positions: list[int] = []  # per model leaf: its entry, or -1
        for p, st, g in zip(m_leaves, s_leaves, g_leaves, strict=True):
            if st is None:
                self.positions.append(-1)
                continue
            if not isinstance(st, Leaf):
                raise TypeError(
                    f"{api}: the optimiser state holds a {type(st).__name__} where a Leaf belongs"
                )
            k = index.get(id(p))
            if k is None:
                k = index[id(p)] = len(self.params)
                self.leaves.append(st)
                self.params.append(p)
                self.grads.append(None if st.frozen else g)
            elif g is not None and not st.frozen:
                # A tied weight: gradients from each place are summed.
                prev = self.grads[k]
                self.grads[k] = g if prev is None else prev + g
            self.positions.append(k)

    def run(self) -> tuple[list[Leaf], list[Any]]:
        if all(g is None for g in self.grads):
            return self.leaves, self.params
        return _step(self.leaves, self.params, self.grads)


def _mismatch(api: str, what: str, model: Any, other: Any) -> str:
    where = first_difference(model, other)
    at = f"first difference at '{where}'" if where else "same paths, different static data or types"
    return (
        f"{api}: the {what} tree does not match the model ({at}). "
        "Pass the gradient of this model, e.g. "
        "`(g,) = tg.gradient(lambda m: loss(m, x, y), model)`, or a tg.Grads for a tg.Params."
    )


def _check_not_wrapped(grads: Any, model: Any, api: str) -> None:
    if isinstance(grads, tuple) and len(grads) == 1 and not isinstance(model, tuple):
        raise TypeError(
            f"{api}: got a 1-tuple of gradients; tg.gradient returns one entry per argument, "
            "so unpack it first: `(g,) = tg.gradient(...)` or pass `grads[0]`."
        )


def update(state: Any, model: Any, grads: Any) -> tuple[Any, Any]:
    """One optimiser step, pure: returns `(new_state, new_model)`.

    Arguments:
        state: from `tg.setup`.
        model: the model the gradients were taken for.
        grads: its explicit gradient tree (`None` entries skip a parameter:
            its value and optimiser state are unchanged), or a `tg.Grads`.

    Returns:
        `(state, model)`, new objects; the inputs are left as they were.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.array([1.0, 2.0])}
        >>> state = tg.setup(optax.sgd(0.1), model)
        >>> (g,) = tg.gradient(lambda m: jnp.sum(m["w"] ** 2), model)
        >>> state, model = tg.update(state, model, g)
        >>> model["w"]
        Array([0.8, 1.6], dtype=float32)
    """
    model_src = _source(model)
    plan = _Plan(state, model_src, grads, "tg.update")
    new_leaves, new_params = plan.run()
    # Rebuild with one new object per distinct parameter, so ties stay tied.
    m_out = [plan.m_leaves[i] if k < 0 else new_params[k] for i, k in enumerate(plan.positions)]
    s_out = [None if k < 0 else new_leaves[k] for k in plan.positions]
    return (
        jax.tree_util.tree_unflatten(plan.s_def, s_out),
        jax.tree_util.tree_unflatten(plan.m_def, m_out),
    )


def update_(state: Any, model: Any, grads: Any) -> None:
    """One optimiser step in place: rebinds the new arrays where the old ones lived.

    Arguments:
        state: from `tg.setup`; its `Leaf` objects are updated in place.
        model: a model held in mutable containers (Modules, dicts, lists), or a
            `tg.Params` built from one.
        grads: the explicit gradient tree, or a `tg.Grads`.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.array([1.0, 2.0])}
        >>> ps = tg.params(model)
        >>> state = tg.setup(optax.sgd(0.1), ps)
        >>> grads = tg.gradient(lambda: jnp.sum(model["w"] ** 2), ps)
        >>> tg.update_(state, ps, grads)
        >>> model["w"]
        Array([0.8, 1.6], dtype=float32)
    """
    model_src = _source(model)
    if isinstance(model_src, jax.Array):
        raise TypeError(
            "tg.update_ cannot update a standalone array in place; hold it in a list, dict or "
            "Module, or use the pure tg.update."
        )
    plan = _Plan(state, model_src, grads, "tg.update_")
    new_leaves, new_params = plan.run()
    # All computed before anything is touched: a failure above leaves model and state as they were.
    for old, new in zip(plan.leaves, new_leaves, strict=True):
        if old is not new:
            old.state = new.state
    changed = {id(p): q for p, q in zip(plan.params, new_params, strict=True) if p is not q}
    if changed:
        rebind(model_src, changed)


def _leaves_of(state: Any) -> Iterator[Leaf]:
    seen: set[int] = set()
    for leaf in jax.tree_util.tree_leaves(state, is_leaf=_is_leaf_state):
        if isinstance(leaf, Leaf) and id(leaf) not in seen:
            seen.add(id(leaf))
            yield leaf


def _adjusted(leaf: Leaf, hyper: dict[str, Any]) -> Any:
    hp = getattr(leaf.state, "hyperparams", None)
    if not isinstance(hp, dict):
        raise TypeError(
            f"tg.adjust: the rule {_rule_name(leaf.rule)} has no adjustable hyperparameters. "
            "Build it with optax.inject_hyperparams, e.g. "
            "tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), model)."
        )
    unknown = set(hyper) - set(hp)
    if unknown:
        raise TypeError(
            f"tg.adjust: unknown hyperparameter(s) {sorted(unknown)}; this rule has {sorted(hp)}."
        )
    new_hp = dict(hp)
    for k, v in hyper.items():
        new_hp[k] = jnp.asarray(v, dtype=jnp.asarray(hp[k]).dtype)
    return leaf.state._replace(hyperparams=new_hp)


def adjust_(state: Any, **hyper: Any) -> None:
    """Change hyperparameters (e.g. `learning_rate`) in place, keeping the moments.

    Works on a whole state or a sub-state (`tg.adjust_(state.l1, learning_rate=1e-4)`).
    The rule must come from `optax.inject_hyperparams`.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), [jnp.ones(2)])
        >>> tg.adjust_(state, learning_rate=0.01)
        >>> round(float(state[0].state.hyperparams["learning_rate"]), 6)
        0.01
    """
    leaves = list(_leaves_of(state))
    new_states = [_adjusted(leaf, hyper) for leaf in leaves]  # validate all before mutating
    for leaf, st in zip(leaves, new_states, strict=True):
        leaf.state = st


def adjust(state: Any, **hyper: Any) -> Any:
    """Pure version of `tg.adjust_`: returns a new state tree."""
    leaves, treedef = jax.tree_util.tree_flatten(state, is_leaf=_is_leaf_state)
    new: dict[int, Leaf] = {}
    out = []
    for leaf in leaves:
        if isinstance(leaf, Leaf):
            if id(leaf) not in new:
                new[id(leaf)] = Leaf(leaf.rule, _adjusted(leaf, hyper), leaf.frozen)
            out.append(new[id(leaf)])
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def freeze_(state: Any) -> None:
    """Freeze every parameter under `state` (a state or sub-state): no more updates.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"a": jnp.ones(2), "b": jnp.ones(2)}
        >>> state = tg.setup(optax.sgd(0.1), model)
        >>> tg.freeze_(state["a"])
        >>> g = {"a": jnp.ones(2), "b": jnp.ones(2)}
        >>> state, model = tg.update(state, model, g)
        >>> model["a"], model["b"]
        (Array([1., 1.], dtype=float32), Array([0.9, 0.9], dtype=float32))
    """
    for leaf in _leaves_of(state):
        leaf.frozen = True


def thaw_(state: Any) -> None:
    """Undo `tg.freeze_` on a state or sub-state."""
    for leaf in _leaves_of(state):
        leaf.frozen = False


def destructure(model: Any) -> tuple[jax.Array, Any]:
    """Flatten a model's trainable parameters into one vector, and a way back.

    Arguments:
        model: any model.

    Returns:
        `(flat, rebuild)`: `flat` concatenates every trainable floating-point
        array; `rebuild(v)` returns a copy of `model` with those arrays taken
        from `v` (differentiable, so `jax.grad` flows through it).

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> flat, rebuild = tg.destructure({"w": jnp.ones((2, 2)), "b": jnp.zeros(2)})
        >>> flat.shape
        (6,)
        >>> rebuild(flat * 2)["w"]
        Array([[2., 2.],
               [2., 2.]], dtype=float32)
    """
    trainable = {
        id(leaf) for _, leaf in trainable_leaves_with_path(model) if is_differentiable(leaf)
    }
    leaves, treedef = jax.tree_util.tree_flatten(model)
    index: dict[int, int] = {}
    uniq: list[Any] = []
    slots: list[int] = []
    for leaf in leaves:
        if id(leaf) in trainable:
            if id(leaf) not in index:
                index[id(leaf)] = len(uniq)
                uniq.append(leaf)
            slots.append(index[id(leaf)])
        else:
            slots.append(-1)
    flat, unravel = jax.flatten_util.ravel_pytree(uniq)

    def rebuild(v: Any) -> Any:
        if getattr(v, "shape", None) != flat.shape:
            raise ValueError(
                f"destructure's rebuild expects a vector of shape {flat.shape}, got "
                f"{getattr(v, 'shape', type(v).__name__)}"
            )
        parts = unravel(v)
        return jax.tree_util.tree_unflatten(
            treedef, [leaves[i] if s < 0 else parts[s] for i, s in enumerate(slots)]
        )

    return flat, rebuild
