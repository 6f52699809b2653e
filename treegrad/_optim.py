"""The model-tree optimiser: optax rules, one state shaped like the model.

As in Optimisers.jl, `setup` builds a state that mirrors the model (the state
of `model.l1` is `state.l1`, of `model[0]` is `state[0]`) and `update` walks
model, gradients and state together; the optimiser does not know or care which
gradient style produced the gradients. Storage is by groups (see
`_optstate.py`): the arrays set up with one rule share one optax state, so a
step is one compiled call whatever the number of arrays, and the rule sees them
as optax would see a model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import optax

from ._optstate import Leaf, OptState, SubState, _Group, _rule_name, _Slot, build, compact, split
from ._params import Grads, Params, trainable_leaves_with_path
from ._paths import rebind
from ._tree import first_difference, is_differentiable


def _source(model: Any) -> Any:
    return model.source if isinstance(model, Params) else model


def setup(rule: optax.GradientTransformation, model: Any) -> OptState:
    """Build the optimiser state for `model`: navigable like the model.

    Arguments:
        rule: any optax `GradientTransformation` (use `optax.inject_hyperparams`
            to be able to `tg.adjust` its hyperparameters later).
        model: a model (Module, dict, list, any pytree) or a `tg.Params`.

    Returns:
        An `OptState`: `state.l1` is the state of `model.l1`, `state[0]` of
        `model[0]`, and at each trainable floating-point array (respecting
        `__trainable__`) there is a `tg.Leaf`; `None` elsewhere. Assign a
        sub-state to use another rule for a sub-model:
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
    leaves, treedef = jax.tree_util.tree_flatten(model)
    return build(rule, leaves, trainable, treedef)


def _step_impl(groups: list[_Group], params: list[list[Any]], grads: list[list[Any]]) -> Any:
    # Every group's optax update in one XLA computation: one dispatch per step.
    new_groups, new_params = [], []
    for group, p, g in zip(groups, params, grads, strict=True):
        updates, state = group.rule.update(g, group.state, p)
        new_groups.append(_Group(group.rule, state, group.n, group.frozen))
        new_params.append(optax.apply_updates(p, updates))
    return new_groups, new_params


_step = jax.jit(_step_impl)
# Each member appears once in its group (tied weights are one member), so no
# buffer is donated twice.
_step_donating = jax.jit(_step_impl, donate_argnums=(0, 1))


def _check_state(state: Any, api: str) -> OptState:
    if not isinstance(state, OptState):
        raise TypeError(
            f"{api}: expected the optimiser state from tg.setup as the first argument, got "
            f"{type(state).__name__}. Call it as {api}(state, model, grads)."
        )
    return state


class _Plan:
    """Model, state and gradients aligned, and the groups to update this step."""

    __slots__ = ("groups", "m_def", "m_leaves", "new_params", "slots")

    def __init__(self, state: OptState, model: Any, grads: Any, api: str, donate: bool = False):
        # No is_leaf: a Python callback per node would cost more than the rest of the plan.
        m_leaves, m_def = jax.tree_util.tree_flatten(model)
        if m_def != state._treedef:
            raise ValueError(_mismatch(api, "optimiser state", model, state.layout))
        if isinstance(grads, Grads):
            # Looked up by identity, as Grads.to_tree would, without building the tree.
            g_leaves = grads.leaves_for(m_leaves)
        else:
            _check_not_wrapped(grads, model, api)
            try:
                # The gradient has the model's structure, with None where the model
                # has a non-differentiable leaf.
                g_leaves = m_def.flatten_up_to(grads)  # type: ignore[attr-defined]
            except (ValueError, TypeError):
                raise ValueError(_mismatch(api, "gradient", model, grads)) from None
        groups = state.groups
        slots = state._slots
        params, acc = _collect(groups, slots, m_leaves, g_leaves)
        # Members without a gradient keep their value and state: split them off.
        missing = {
            _Slot(k, i)
            for k, group in enumerate(groups)
            if not group.frozen and any(a is None for a in acc[k])
            for i, a in enumerate(acc[k])
            if a is None
        }
        if missing:
            groups, slots = split(groups, slots, missing, frozen=False)
            params, acc = _collect(groups, slots, m_leaves, g_leaves)
        self.m_leaves, self.m_def, self.slots = m_leaves, m_def, slots
        active = [
            k
            for k, grp in enumerate(groups)
            if not grp.frozen and all(a is not None for a in acc[k])
        ]
        new_groups = list(groups)
        new_params = [list(p) for p in params]
        if active:
            out_groups, out_params = (_step_donating if donate else _step)(
                [groups[k] for k in active], [params[k] for k in active], [acc[k] for k in active]
            )
            for k, grp, ps in zip(active, out_groups, out_params, strict=True):
                new_groups[k] = grp
                new_params[k] = ps
        self.groups = new_groups
        self.new_params = new_params

    def model_leaves(self) -> list[Any]:
        # One new object per member, so that the places of a tied weight share it.
        return [
            p if s is None else self.new_params[s.g][s.i]
            for p, s in zip(self.m_leaves, self.slots, strict=True)
        ]


def _collect(
    groups: list[_Group], slots: Any, m_leaves: list[Any], g_leaves: list[Any]
) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per group: each member's parameter and gradient (None where it has none)."""
    params: list[list[Any]] = [[None] * g.n for g in groups]
    acc: list[list[Any]] = [[None] * g.n for g in groups]
    for p, s, g in zip(m_leaves, slots, g_leaves, strict=True):
        if s is None:
            continue
        params[s.g][s.i] = p
        if g is not None:
            prev = acc[s.g][s.i]
            # A tied weight: the gradients from each of its places are summed.
            acc[s.g][s.i] = g if prev is None else prev + g
    return params, acc


def _mismatch(api: str, what: str, model: Any, other: Any) -> str:
    where = first_difference(model, other)
    at = f"first difference at '{where}'" if where else "same paths, different static data or types"
    return (
        f"{api}: the {what} tree does not match the model ({at}). "
        "Pass the gradient of this model, e.g. "
        "`(g,) = tg.gradient(lambda m: loss(m, x, y), model)`, or a tg.Grads for a tg.Params."
        if what == "gradient"
        else f"{api}: the {what} does not match the model ({at}); build it with "
        "tg.setup(rule, model) for this model."
    )


def _check_not_wrapped(grads: Any, model: Any, api: str) -> None:
    if isinstance(grads, tuple) and len(grads) == 1 and not isinstance(model, tuple):
        raise TypeError(
            f"{api}: got a 1-tuple of gradients; tg.gradient returns one entry per argument, "
            "so unpack it first: `(g,) = tg.gradient(...)` or pass `grads[0]`."
        )


def update(
    state: OptState, model: Any, grads: Any, *, donate: bool = False
) -> tuple[OptState, Any]:
    """One optimiser step, pure: returns `(new_state, new_model)`.

    Arguments:
        state: from `tg.setup`.
        model: the model the gradients were taken for.
        grads: its explicit gradient tree (`None` entries skip a parameter:
            its value and optimiser state are unchanged), or a `tg.Grads`.
        donate: let XLA reuse the buffers of the updated parameters and of
            their optimiser state for the new ones, so a large model is not
            held twice. The old arrays are deleted: use it only when nothing
            will read the old model or state again.

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
    state = _check_state(state, "tg.update")
    plan = _Plan(state, _source(model), grads, "tg.update", donate)
    new_state = OptState(plan.groups, state._treedef, plan.slots)
    if plan.slots is state._slots:
        object.__setattr__(new_state, "_aux", state._aux)  # same layout: reuse its hash
    return new_state, jax.tree_util.tree_unflatten(plan.m_def, plan.model_leaves())


def update_(state: OptState, model: Any, grads: Any) -> None:
    """One optimiser step in place: rebinds the new arrays where the old ones lived.

    Arguments:
        state: from `tg.setup`; updated in place.
        model: a model held in mutable containers (Modules, dicts, lists), or a
            `tg.Params` built from one.
        grads: the explicit gradient tree, or a `tg.Grads`.

    Returns:
        None; the model's containers and the state are changed in place.

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
    state = _check_state(state, "tg.update_")
    model_src = _source(model)
    if isinstance(model_src, jax.Array):
        raise TypeError(
            "tg.update_ cannot update a standalone array in place; hold it in a list, dict or "
            "Module, or use the pure tg.update."
        )
    plan = _Plan(state, model_src, grads, "tg.update_")
    # All computed before anything is touched: a failure above leaves model and state as they were.
    changed = {
        id(old): new
        for old, new in zip(plan.m_leaves, plan.model_leaves(), strict=True)
        if old is not new
    }
    if changed:
        rebind(model_src, changed)
    state.replace(plan.groups, plan.slots)


def _view_slots(state: Any, api: str) -> tuple[OptState, set[_Slot]]:
    if isinstance(state, Leaf):
        return state._root, {state._slot}
    if isinstance(state, OptState):
        return state, set(state.slots())
    if isinstance(state, SubState):
        return state._r(), set(state.slots())
    raise TypeError(
        f"{api} expects an optimiser state from tg.setup, or a part of one, "
        f"got {type(state).__name__}"
    )


def _adjusted_state(hyper: dict[str, Any]) -> Any:
    def adjust_group(group: _Group) -> Any:
        hp = getattr(group.state, "hyperparams", None)
        if not isinstance(hp, dict):
            raise TypeError(
                f"tg.adjust: the rule {_rule(group)} has no adjustable "
                "hyperparameters. Build it with optax.inject_hyperparams, e.g. "
                "tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), model)."
            )
        unknown = set(hyper) - set(hp)
        if unknown:
            raise TypeError(
                f"tg.adjust: unknown hyperparameter(s) {sorted(unknown)}; "
                f"this rule has {sorted(hp)}."
            )
        new_hp = dict(hp)
        for k, v in hyper.items():
            new_hp[k] = jnp.asarray(v, dtype=jnp.asarray(hp[k]).dtype)
        return group.state._replace(hyperparams=new_hp)

    return adjust_group


def _rule(group: _Group) -> str:
    return _rule_name(group.rule)


def _changed_groups(
    state: Any, api: str, **change: Any
) -> tuple[OptState, list[_Group], tuple[Any, ...]]:
    root, chosen = _view_slots(state, api)
    groups, slots = split(root.groups, root._slots, chosen, **change)
    return root, groups, slots


def adjust_(state: Any, **hyper: Any) -> None:
    """Change hyperparameters (e.g. `learning_rate`) in place, keeping the moments.

    Works on a whole state or a part of one (`tg.adjust_(state.l1, learning_rate=1e-4)`),
    which then gets its own copy of the optimiser state. The rule must come
    from `optax.inject_hyperparams`.

    Arguments:
        state: an optimiser state, a sub-state or a `tg.Leaf`.
        **hyper: new values, e.g. `learning_rate=1e-4`.

    Returns:
        None; the state is changed in place.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), [jnp.ones(2)])
        >>> tg.adjust_(state, learning_rate=0.01)
        >>> round(float(state[0].state.hyperparams["learning_rate"]), 6)
        0.01
    """
    root, groups, slots = _changed_groups(state, "tg.adjust_", new_state=_adjusted_state(hyper))
    root.replace(*compact(groups, slots))


def adjust(state: OptState, **hyper: Any) -> OptState:
    """Change hyperparameters, pure: returns a new state with the moments kept.

    Arguments:
        state: from `tg.setup` with a rule built by `optax.inject_hyperparams`.
        **hyper: new values, e.g. `learning_rate=1e-4`.

    Returns:
        A new `OptState`; `state` is unchanged.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> rule = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> state = tg.setup(rule, {"w": jnp.ones(2)})
        >>> new = tg.adjust(state, learning_rate=0.5)
        >>> lr = lambda s: round(float(s["w"].state.hyperparams["learning_rate"]), 6)
        >>> lr(new), lr(state)
        (0.5, 0.1)
    """
    root, groups, slots = _changed_groups(state, "tg.adjust", new_state=_adjusted_state(hyper))
    new_groups, new_slots = compact(groups, slots)
    return OptState(new_groups, root._treedef, new_slots)


def freeze_(state: Any) -> None:
    """Freeze every parameter under `state` (a state, sub-state or Leaf): no more updates.

    Arguments:
        state: the (part of the) optimiser state to freeze.

    Returns:
        None; the state is changed in place.

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
    root, groups, slots = _changed_groups(state, "tg.freeze_", frozen=True)
    root.replace(groups, slots)


def thaw_(state: Any) -> None:
    """Undo `tg.freeze_` on a state, sub-state or Leaf.

    Arguments:
        state: the (part of the) optimiser state to update again.

    Returns:
        None; the state is changed in place.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> state = tg.setup(optax.sgd(0.1), {"w": jnp.ones(2)})
        >>> tg.freeze_(state["w"]); tg.thaw_(state["w"])
        >>> state["w"].frozen
        False
    """
    root, groups, slots = _changed_groups(state, "tg.thaw_", frozen=False)
    root.replace(groups, slots)


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
