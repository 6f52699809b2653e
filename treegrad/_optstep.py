"""The optimiser's compiled step: every rule's `update`, in one XLA computation.

Per step: sum a tied array's gradients over its places, give the rule zeros
where a gradient is `None`, run `rule.update` on the tree `rule.init` saw, then
keep the old value and the own optax state entries (found once per rule with
`optax.tree_map_params`, see `_optstate._Part.statemap`) of every skipped
parameter; shared entries such as optax's `count` advance as in optax.

Which gradients are `None` is an input (a bool per place), not part of the
cache key, so a step with `None` gradients does not re-trace; which parameters
are frozen or belong to another rule is static (the `_Config`). Shapes and
dtypes are checked while tracing, which costs nothing on later calls: the
cache is keyed on them.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._layout import constrain
from ._optstate import _Config
from ._optstatemap import MIXED, RAVELED
from ._optview import rule_name
from ._tree import describe_aval, describe_leaf, is_inexact, same_structure

# The TypeError of a call missing keyword-only arguments, and their names.
_EXTRA_ARGS = re.compile(
    r"(?:(\w+)\.<locals>\.)?\w+\(\) missing \d+ required keyword-only arguments?: (.*)$"
)


class BadGradient(ValueError):
    """A gradient does not fit its parameter, or a parameter its optax state (found
    while tracing)."""


def _gradient_problem(param: Any, g: Any) -> str | None:
    expected, got = describe_leaf(param), describe_leaf(g)
    if not jnp.issubdtype(g.dtype, jnp.inexact):
        return (
            f"has dtype {g.dtype} (expected {expected}, got {got}); gradients are floating "
            "point: take them with tg.gradient of this model."
        )
    if jnp.issubdtype(g.dtype, jnp.complexfloating) and not jnp.issubdtype(
        param.dtype, jnp.complexfloating
    ):
        return (
            f"is complex but its parameter is real (expected {expected}, got {got}); the "
            "imaginary part would be silently dropped. Pass jnp.real(g) if that is what you mean."
        )
    if g.shape != param.shape:
        return (
            f"has shape {g.shape} but its parameter has shape {param.shape} (expected "
            f"{expected}, got {got}); a gradient must have its parameter's shape and is never "
            "broadcast: take it with tg.gradient of this model."
        )
    return None


def shape_changed(path: str, x: Any, shape: tuple[int, ...], dtype: Any) -> str:
    """The message for a parameter whose shape or dtype is not the one set up."""
    return (
        f"'{path}' is {describe_leaf(x)} but was {describe_aval(shape, dtype)} when "
        "the optimiser state was set up; its state has the old shape. Set the state up again "
        "for the changed model (tg.setup(rule, model))."
    )


def _check_shapes(config: _Config, params: list[Any]) -> None:
    """A parameter with state entries of its own has the shape it was set up with, and
    every updated parameter is still floating-point (or still not).

    Checked while tracing (free on later calls): optax would broadcast a new
    shape against the old-shaped moments and return the old shape, silently. A
    rule that keeps nothing per parameter (plain sgd) takes any shape, as in optax.
    """
    for i in config.updated:
        # An integer array where a float parameter was (or back): optax would step it
        # and the result be truncated to the integer dtype, without a word.
        shape, dtype = config.avals[i]
        if is_inexact(params[i].dtype) != is_inexact(dtype):
            path = config.paths[config.first[i]]
            raise BadGradient(
                f"'{path}' is {describe_leaf(params[i])} but was "
                f"{describe_aval(shape, dtype)} when the optimiser state was set up: "
                "only a floating-point array is trained. Set the state up again for the "
                "changed model (tg.setup(rule, model)), or assign an array of the old dtype."
            )
    for part in config.parts:
        for local in part.statemap:
            if local < 0:
                continue
            i = part.leaf_ids[local]
            shape, dtype = config.avals[i]
            if tuple(params[i].shape) != tuple(shape):
                path = config.paths[config.first[i]]
                raise BadGradient(shape_changed(path, params[i], shape, dtype))


def _step_impl(
    config: _Config,
    placed: tuple[Any, ...] | None,
    states: tuple[Any, ...],
    updated: tuple[Any, ...],
    kept: tuple[Any, ...],
    grads: tuple[Any, ...],
    present: Any,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """One optimiser step for every part, in one XLA computation.

    `updated`/`kept` are the distinct parameters that may change / are frozen
    (separate so that only the former are donated); `grads` has one gradient
    per trainable place, a placeholder where `present` is False. `placed`:
    the mesh sharding of each state array and updated parameter (None when
    none is on a mesh), which the new ones keep.
    """
    params: list[Any] = [None] * config.n
    for i, x in zip(config.updated + config.kept, updated + kept, strict=True):
        params[i] = x
    _check_shapes(config, params)
    for p, i, g in zip(config.tpos, config.tslot, grads, strict=True):
        problem = _gradient_problem(params[i], g)
        if problem:
            raise BadGradient(f"the gradient at '{config.paths[p]}' {problem}")
    total, seen = _sum_over_places(config, grads, present)
    new_states = list(states)
    new_params: dict[int, Any] = {}
    # Every part steps, even one whose parameters are all frozen: a frozen
    # parameter counts as one with a `None` gradient, so its part's shared
    # counters (optax's `count`) advance whether or not `tg.adjust_` or a
    # grafted sub-state gave it a part of its own. The moment maths of such a
    # part is dead code (its own entries are kept) and XLA drops it.
    for k in range(len(config.parts)):
        lo, hi = config.offsets[k], config.offsets[k + 1]
        new_states[lo:hi] = _part_step(config, k, states[lo:hi], params, total, seen, new_params)
    new_updated = [new_params[i] for i in config.updated]
    if placed is not None:
        n = len(states)
        new_states = [constrain(x, p) for x, p in zip(new_states, placed[:n], strict=True)]
        new_updated = [constrain(x, p) for x, p in zip(new_updated, placed[n:], strict=True)]
    return tuple(new_states), tuple(new_updated)


def _sum_over_places(
    config: _Config, grads: tuple[Any, ...], present: Any
) -> tuple[list[Any], list[Any]]:
    """Per parameter: its gradient summed over its places (zeros where absent), and
    whether any place had one."""
    total: list[Any] = [None] * config.n
    seen: list[Any] = [None] * config.n
    for k, (i, g) in enumerate(zip(config.tslot, grads, strict=True)):
        here = present[k]
        g = jnp.where(here, g, jnp.zeros_like(g))
        total[i] = g if total[i] is None else total[i] + g
        seen[i] = here if seen[i] is None else seen[i] | here
    return total, seen


def _part_step(
    config: _Config,
    k: int,
    old: tuple[Any, ...],
    params: list[Any],
    total: list[Any],
    seen: list[Any],
    new_params: dict[int, Any],
) -> list[Any]:
    """Part `k`'s `rule.update` on its tree; the new values of its parameters go to
    `new_params`. Returns its new optax state leaves."""
    part = config.parts[k]
    # Parameters of this tree that another part owns, or that are frozen, are
    # skipped statically; those without a gradient this step, dynamically.
    mine = [config.owner[i] == k and i not in config.frozen for i in part.leaf_ids]
    p_leaves = [params[i] for i in part.leaf_ids]
    g_leaves = [
        total[i] if m else jnp.zeros_like(params[i])
        for i, m in zip(part.leaf_ids, mine, strict=True)
    ]
    try:
        updates, state = part.rule.update(
            part.param_def.unflatten(g_leaves),
            part.state_def.unflatten(old),
            part.param_def.unflatten(p_leaves),
        )
    except TypeError as e:
        extra = _EXTRA_ARGS.search(str(e))
        if extra is None:
            raise
        # optax's GradientTransformationExtraArgs (reduce_on_plateau, lbfgs's line
        # search) take more than (updates, state, params) at each step.
        name = rule_name(part.rule)
        inner = extra.group(1)
        where = f"{name} ({inner} in it)" if inner and inner != name else name
        raise TypeError(
            f"tg.update: the optax rule {where} needs extra arguments at each "
            f"step ({extra.group(2)}: optax's GradientTransformationExtraArgs), which "
            "tg.update and tg.update_ do not pass. Use a rule that needs none, or run this "
            "one with plain optax on the gradient tree tg.gradient gives."
        ) from e
    new, new_def = jax.tree_util.tree_flatten(state)
    if not same_structure(new_def, part.state_def):
        raise TypeError(
            f"the optax rule {rule_name(part.rule)} returned a state of another structure "
            "than its init gave; treegrad needs the structure to stay fixed."
        )
    # Skipped parameters keep their own state entries; shared ones (count) advance.
    for j, local in enumerate(part.statemap):
        if local >= 0:
            i = part.leaf_ids[local]
            new[j] = jnp.where(seen[i], new[j], old[j]) if mine[local] else old[j]
        elif local == RAVELED:
            # Every parameter's state in one vector, in the tree's order (optax.flatten's):
            # each skipped parameter's slice keeps its old values.
            keep = [
                jnp.broadcast_to(jnp.logical_not(seen[i]) if m else True, (p.size,))
                for i, m, p in zip(part.leaf_ids, mine, p_leaves, strict=True)
            ]
            new[j] = jnp.where(jnp.concatenate(keep), old[j], new[j])
        elif local == MIXED:
            # Several parameters' state in one array (optax.flatten's vector): kept when
            # every parameter of this part is skipped; a step skipping only some of them
            # is refused before it runs (`_optim._check_mixed`).
            own = [seen[i] for i, m in zip(part.leaf_ids, mine, strict=True) if m]
            if not own:
                new[j] = old[j]
            else:
                new[j] = jnp.where(functools.reduce(jnp.logical_or, own), new[j], old[j])
    u_leaves = part.param_def.flatten_up_to(updates)
    for local, (i, p, u) in enumerate(zip(part.leaf_ids, p_leaves, u_leaves, strict=True)):
        if mine[local]:
            new_params[i] = jnp.where(seen[i], optax.apply_updates(p, u), p)
    return new


def _jitted() -> tuple[Any, Any]:
    # The donating one donates the parameters that may change and the optax state:
    # each array appears once (tied weights are one parameter; split parts hold
    # copies), so no buffer is donated twice.
    # A new function object each time: jax keeps traces per function, across its jits.
    impl = functools.partial(_step_impl)
    return (
        jax.jit(impl, static_argnums=(0, 1)),
        jax.jit(impl, static_argnums=(0, 1), donate_argnums=(2, 3)),
    )


# Read as `_optstep.step` at each call: `clear_steps` replaces them.
step, _step_donating = _jitted()


def step_donating(
    config: _Config,
    placed: tuple[Any, ...] | None,
    states: tuple[Any, ...],
    updated: tuple[Any, ...],
    kept: tuple[Any, ...],
    grads: tuple[Any, ...],
    present: Any,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """`step`, donating the optax state and the parameters that may change.

    XLA refuses a donated buffer that the same call also reads elsewhere. A
    gradient tree may hold the donated arrays themselves (the model as its own
    gradient, weight decay written by hand: `tg.update(state, m, m,
    donate=True)`), or a state array may be a parameter itself: such an input
    is passed as a copy, so the step runs as it does without donation.
    """
    donated: set[int] = set()

    def once(xs: tuple[Any, ...], donate: bool) -> tuple[Any, ...]:
        out = []
        for x in xs:
            if id(x) in donated and isinstance(x, jax.Array):
                x = jnp.copy(x)
            if donate:
                donated.add(id(x))
            out.append(x)
        return tuple(out)

    states, updated = once(states, True), once(updated, True)
    kept, grads = once(kept, False), once(grads, False)
    return _step_donating(config, placed, states, updated, kept, grads, present)


def clear_steps() -> None:
    """Forget every traced step (a rule's function reads a changed value: `_optguard`)."""
    global step, _step_donating
    step, _step_donating = _jitted()
