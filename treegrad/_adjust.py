"""Changing an optimiser state in place or purely: hyperparameters (`adjust`,
`adjust_`, on the whole state or a sub-state) and freezing (`freeze_`, `thaw_`).

A sub-state adjusted or frozen apart from the rest gets a part of its own
(`_optbuild.own_part`), so its moments and counters carry over.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from ._jaxpr import is_tracer
from ._optbuild import own_part, split_leaves, with_frozen
from ._optstate import _Config
from ._optstatemap import mixed_skips
from ._optview import Leaf, OptState, SubState, rule_name, skip_problem


def _chosen(state: Any, api: str) -> tuple[OptState, list[int], str]:
    """The root state, the parameters under `state`, and its model path."""
    if isinstance(state, OptState):
        return state, list(range(state._config.n)), ""
    if isinstance(state, (SubState, Leaf)):
        root = state._root
        return root, state._params_under(), state._scope()
    if state is None:
        raise TypeError(
            f"{api} got None: that is the optimiser state at a place with no trainable "
            "array (a layer with no parameters, an integer array, an attribute outside "
            f"__trainable__), which has no hyperparameters. Call {api} on the whole state "
            "or on a sub-state holding parameters."
        )
    raise TypeError(
        f"{api} expects an optimiser state from tg.setup, or a part of one (state.l1, "
        f"state[0]), got {type(state).__name__}"
    )


def _is_injected(x: Any) -> bool:
    # optax.inject_hyperparams' states (stateful or not) hold a dict `hyperparams`.
    return isinstance(getattr(x, "hyperparams", None), dict) and hasattr(x, "_replace")


def _check_value(name: str, value: Any, api: str) -> Any:
    if isinstance(value, (str, bytes)) or not isinstance(
        value, (int, float, np.number, np.ndarray, jax.Array)
    ):
        raise TypeError(
            f"{api}: {name}={value!r} is a {type(value).__name__}; a hyperparameter is a number, "
            f"e.g. {api}(state, {name}=1e-4)."
        )
    return value


def _cast(name: str, value: Any, old: Any, api: str) -> Any:
    new = jnp.asarray(value)
    if new.shape != jnp.shape(old):
        raise ValueError(
            f"{api}: {name} must have shape {jnp.shape(old)} like the rule's, got {new.shape}."
        )
    if (new.dtype == jnp.bool_) != (jnp.asarray(old).dtype == jnp.bool_) or (
        jnp.iscomplexobj(new) and not jnp.iscomplexobj(old)
    ):
        raise TypeError(f"{api}: {name} is {jnp.asarray(old).dtype} in the rule, got {new.dtype}.")
    dtype = jnp.asarray(old).dtype
    cast = new.astype(dtype)
    if not jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(new.dtype, jnp.integer):
        return cast  # a float into a float rule (a traced one too), an int into an int
    if is_tracer(new):
        raise TypeError(
            f"{api}: {name} is a traced {new.dtype} value, and the rule's {name} is "
            f"{dtype} (the rule was built with an integer, e.g. {name}=1): whether the "
            f"value is a whole number cannot be checked inside a trace. Build the rule "
            f"with a float ({name}=1.0), or pass an integer array."
        )
    if not bool(jnp.all(cast == new)):
        # Never truncate: learning_rate=0.5 into an int32 would become 0 and stop training.
        raise TypeError(
            f"{api}: {name}={value!r} cannot be held exactly by the rule's {dtype} {name} "
            f"(the rule was built with an integer, e.g. {name}=1). Build the rule with a "
            f"float ({name}=1.0) to adjust it to {value!r}."
        )
    return cast


def _with_hyperparams(state: Any, values: dict[str, Any], rule: Any, api: str) -> Any:
    """Set hyperparameters in every `inject_hyperparams` state, at any depth of `state`."""
    found: set[str] = set()
    available: set[str] = set()
    injected = False

    def change(x: Any) -> Any:
        nonlocal injected
        if not _is_injected(x):
            return x
        injected = True
        hyper = dict(x.hyperparams)
        scheduled = getattr(x, "hyperparams_states", None) or {}
        available.update(hyper)
        for name, value in values.items():
            if name in hyper:
                if name in scheduled:
                    raise TypeError(
                        f"{api}: {name} follows a schedule in the rule {rule_name(rule)} and is "
                        "recomputed every step; build the rule with a number for it to adjust it."
                    )
                hyper[name] = _cast(name, value, hyper[name], api)
                found.add(name)
        return x._replace(hyperparams=hyper)

    new = jax.tree_util.tree_map(change, state, is_leaf=_is_injected)
    if not injected:
        raise TypeError(
            f"{api}: the rule {rule_name(rule)} has no adjustable hyperparameters. Build it "
            "(or a part of its chain) with optax.inject_hyperparams, e.g. "
            "tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), model)."
        )
    unknown = set(values) - found
    if unknown:
        raise TypeError(
            f"{api}: unknown hyperparameter(s) {sorted(unknown)}; "
            f"this rule has {sorted(available)}."
        )
    return new


def _already(root: OptState, chosen: list[int], values: dict[str, Any], api: str) -> bool | None:
    """Whether the parts holding the `chosen` parameters already have these values (the
    names and values checked as an adjust checks them). A sub-state is then not split
    from the rest: that would change a rule looking across parameters (the global norm
    of `optax.clip_by_global_norm` taken per part) for a change that changes nothing.
    None where a traced value (inside jax.jit or tg.jit) makes it impossible to tell."""
    config = root._config
    per_part = split_leaves(config, root._leaves)
    same: bool | None = True
    for k in sorted({config.owner[i] for i in chosen}):
        part = config.parts[k]
        old = per_part[k]
        new = jax.tree_util.tree_leaves(
            _with_hyperparams(part.state_def.unflatten(old), values, part.rule, api)
        )
        for a, b in zip(new, old, strict=True):
            if a is b:
                continue
            if is_tracer(a) or is_tracer(b):
                same = None
                continue
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype != b.dtype or not np.array_equal(a, b):
                return False
    return same


def _shares_a_part(config: _Config, chosen: list[int]) -> bool:
    """Whether a part owning some of the `chosen` parameters also owns others: adjusting
    them then gives them a part of their own (`own_part`)."""
    chosen_set = set(chosen)
    owners = {config.owner[i] for i in chosen}
    return any(config.owner[i] in owners and i not in chosen_set for i in range(config.n))


def _traced_split(api: str, scope: str, hyper: dict[str, Any]) -> TypeError:
    # Inside a compiled step the split cannot follow the values: eagerly, an adjust to
    # the value already there splits nothing, and a compiled step splitting anyway
    # gives another result (a clip_by_global_norm then clips each part apart); an
    # implicit tg.jit step cannot write back a state whose structure it changed.
    where = f"the sub-state at '{scope}'" if scope else "this sub-state"
    name = next(iter(hyper))
    return TypeError(
        f"{api} of {where} inside a compiled step (tg.jit, jax.jit): its parameters share "
        "one optax state with others, and adjusting them gives them a part of their own "
        "unless the value is the one already there, which cannot be told from traced "
        "values, so the compiled step could not do what the uncompiled one does. Give it "
        f"a part of its own once, outside the compiled step ({api} of it there to a new "
        "value, or assign it a rule: state.sub = tg.setup(rule, model.sub)); adjusting it "
        f"inside the step then only changes the value. Or adjust the whole state "
        f"({api}(state, {name}=...)) inside the step, or adjust outside it."
    )


def _adjusted(state: Any, hyper: dict[str, Any], api: str) -> tuple[OptState, _Config, list[Any]]:
    root, chosen, scope = _chosen(state, api)
    if not hyper:
        raise TypeError(f"{api}: name the hyperparameters to change, e.g. learning_rate=1e-4.")
    values = {name: _check_value(name, v, api) for name, v in hyper.items()}
    same = _already(root, chosen, values, api)
    if same:
        return root, root._config, list(root._leaves)
    if same is None and _shares_a_part(root._config, chosen):
        raise _traced_split(api, scope, hyper)
    config, leaves, parts = own_part(root._config, root._leaves, chosen, scope)
    per_part = split_leaves(config, leaves)
    for k in parts:
        part = config.parts[k]
        new = _with_hyperparams(part.state_def.unflatten(per_part[k]), values, part.rule, api)
        per_part[k] = jax.tree_util.tree_leaves(new)
    return root, config, [x for xs in per_part for x in xs]


def adjust_(state: Any, **hyper: Any) -> None:
    """Change hyperparameters (e.g. `learning_rate`) in place, keeping the moments.

    The rule, or a part of its chain, must come from `optax.inject_hyperparams`.
    Works on a whole state or a part of one (`tg.adjust_(state.l1, learning_rate=1e-4)`);
    a part that shares its optax state with other parameters first gets its
    own copy of it (moments and counters included), as if it had been given
    its own rule, so rules that look across parameters then see it apart.

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
    root, config, leaves = _adjusted(state, hyper, "tg.adjust_")
    if any(map(is_tracer, leaves)) and not any(map(is_tracer, root._leaves)):
        # A traced value into a state the transformation does not trace (jax.jit
        # capturing it): nothing would write it back, and a tracer would stay in it.
        raise TypeError(
            "tg.adjust_ inside jax.jit (or another jax transformation) with a traced value, "
            "on an optimiser state the transformation does not trace: the traced value would "
            "leak into the state, which is left unchanged. Compile the step with tg.jit, "
            "which writes the state back; or use the pure `state = tg.adjust(state, ...)` "
            "and return the state."
        )
    root._install(config, leaves)


def adjust(state: Any, **hyper: Any) -> OptState:
    """Change hyperparameters, pure: returns a new state with the moments kept.

    Arguments:
        state: from `tg.setup` with a rule built by `optax.inject_hyperparams`
            (anywhere in its chain), or a part of one (then the whole new state
            is returned, changed for that part).
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
    _, config, leaves = _adjusted(state, hyper, "tg.adjust")
    return OptState(config, leaves)


def freeze_(state: Any) -> None:
    """Freeze every parameter under `state` (a state, sub-state or Leaf): no more updates.

    Frozen parameters keep their values and their own optax state entries.

    Arguments:
        state: the (part of the) optimiser state to freeze. `None`, which the
            state holds at a place with no trainable array (`state[1]` for an
            activation layer, `state.steps` for an integer array), is a no-op,
            as Optimisers.jl's `freeze!` of such a place (`()` there) is.

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
    if state is None:  # the state of a place with no trainable array: nothing to freeze
        return
    root, chosen, _ = _chosen(state, "tg.freeze_")
    config = with_frozen(root._config, chosen, True)
    found = mixed_skips(config, config.kept)
    if found is not None:
        raise TypeError(f"tg.freeze_: {skip_problem(config, *found)}")
    root._install(config, root._leaves)


def thaw_(state: Any) -> None:
    """Undo `tg.freeze_` on a state, sub-state or Leaf.

    Arguments:
        state: the (part of the) optimiser state to update again; `None` (a
            place with no trainable array) is a no-op, as in `freeze_`.

    Returns:
        None; the state is changed in place.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> state = tg.setup(optax.sgd(0.1), {"w": jnp.ones(2)})
        >>> tg.freeze_(state["w"]); tg.thaw_(state["w"])
        >>> state["w"].frozen
        False
    """
    if state is None:  # as in freeze_: a place with no trainable array
        return
    root, chosen, _ = _chosen(state, "tg.thaw_")
    root._install(with_frozen(root._config, chosen, False), root._leaves)
