"""The model-tree optimiser on optax: `setup`, `update`, `update_` and friends.

As in Optimisers.jl, `setup` builds a state that mirrors the model and
`update` walks model, gradients and state together; the optimiser does not
know which gradient style produced the gradients. The state is one optax
state over the trainable tree (`_optstate.py`), seen through the model's shape
(`_optview.py`), so every optax rule, including those that look across
parameters, gives plain optax's result. The step itself is one compiled call
(`_optstep.py`); this module checks everything before it runs, so a failed
update changes nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax

from . import _optstep
from ._grads import Grads
from ._jaxpr import is_tracer
from ._layout import placements, several_devices, state_on_other_devices
from ._optguard import RuleGuard, holder
from ._optstate import _Config, build, holders, mixed_skips
from ._optstep import BadGradient, clear_steps, shape_changed, step_donating
from ._optview import Leaf, OptState, SubState, skip_problem
from ._params import Params
from ._paths import rebind
from ._tree import (
    describe_leaf,
    first_difference,
    is_differentiable,
    is_none,
    path_str,
    tree_map_shared,
)
from ._walk import node_types

_ARRAYS = (jax.Array, np.ndarray, np.generic)


def _source(model: Any) -> Any:
    return model.source if isinstance(model, Params) else model


def setup(rule: optax.GradientTransformation, model: Any) -> OptState:
    """Build the optimiser state for `model`: one optax state, navigable like the model.

    Arguments:
        rule: any optax `GradientTransformation` (use `optax.inject_hyperparams`
            to be able to `tg.adjust` its hyperparameters later). It is
            initialised on the trainable tree: the model with `None` in place
            of every leaf the optimiser does not train (non-floating arrays,
            attributes outside `__trainable__`, and the second and later
            places of a tied array). Label and mask trees for
            `optax.multi_transform` and `optax.masked` have that structure.
        model: a model (Module, dict, list, any pytree) or a `tg.Params`.

    Returns:
        An `OptState`: `state.l1` is the state of `model.l1`, `state[0]` of
        `model[0]`, and at each trainable array there is a `tg.Leaf`; `None`
        elsewhere. Assign a sub-state to use another rule for a sub-model:
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
    return OptState(*build(rule, _source(model)))


# --- checks and plumbing around the step -------------------------------------------------


def _check_state(state: Any, api: str) -> OptState:
    if isinstance(state, OptState):
        return state
    if isinstance(state, (SubState, Leaf)):
        raise TypeError(
            f"{api}: pass the whole optimiser state from tg.setup, not a part of it; parts "
            "(state.l1, state[0]) are for tg.freeze_, tg.adjust_ and assigning a rule."
        )
    raise TypeError(
        f"{api}: expected the optimiser state from tg.setup as the first argument, got "
        f"{type(state).__name__}. Call it as {api}(state, model, grads)."
    )


def _by_path_if_only_static_differs(model: Any, grads: Any) -> list[Any] | None:
    """The gradient at each of the model's leaves, by key path, when the gradient tree
    differs from the model in static data only (taken before an edit of a dropout rate
    or an activation); None otherwise."""
    model_paths = jax.tree_util.tree_flatten_with_path(model)[0]
    grad_paths = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
    by = dict(grad_paths)
    if len(by) != len(grad_paths) or any(p not in by for p, _ in model_paths):
        return None
    if any(g is not None for p, g in grad_paths if p not in dict(model_paths)):
        return None
    g_def = jax.tree_util.tree_structure(grads, is_leaf=is_none)
    m_def = jax.tree_util.tree_structure(model, is_leaf=is_none)
    if list(node_types(g_def)) != list(node_types(m_def)):
        return None
    return [by[p] for p, _ in model_paths]


def _only_static_changed(config: _Config, model: Any, m_def: Any) -> bool:
    """Whether `model` differs from the state's structure in static data only: the same
    leaves at the same paths, in containers of the same kinds."""
    if m_def.num_leaves != config.treedef.num_leaves:
        return False
    # A static attribute set to None (an activation removed), or a None set to one,
    # changes no parameter: None is an empty child of a Module, not static data, so
    # it is left out of both the leaves' paths and the node kinds compared.
    paths = [k for k, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    if paths != [k for k, _ in jax.tree_util.tree_flatten_with_path(config.layout)[0]]:
        return False
    kinds = [t for t in node_types(m_def) if t is not type(None)]
    return kinds == [t for t in node_types(config.treedef) if t is not type(None)]


def _first_gradient_difference(model: Any, grads: Any) -> str | None:
    """Dotted path of the first place where a gradient tree differs from the model.
    Unlike `first_difference`, `None` in the gradient at a leaf (an integer array, a
    skipped parameter) or for a whole sub-tree is not a difference: otherwise an extra
    or a missing key was reported at the first integer leaf of the model."""
    m_paths = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_none)[0]
    g_paths = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
    try:
        m_keys = {k for k, _ in m_paths}
        g_keys = {k for k, _ in g_paths}
    except TypeError:  # a foreign pytree's unhashable key
        return first_difference(model, grads)
    skipped = {k for k, g in g_paths if g is None}
    for k, _ in m_paths:
        if k not in g_keys and not any(k[:i] in skipped for i in range(len(k))):
            return path_str(k) or "<root>"
    for k, g in g_paths:
        if k not in m_keys and g is not None:
            return path_str(k) or "<root>"
    return first_difference(model, grads)


def _mismatch(api: str, what: str, model: Any, other: Any) -> str:
    where = (
        _first_gradient_difference(model, other)
        if what == "gradient"
        else first_difference(model, other)
    )
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


def _gradient_leaves(m_def: Any, model: Any, grads: Any, api: str) -> list[Any]:
    """The gradient at each leaf position of the model (`None` allowed)."""
    try:
        return list(m_def.flatten_up_to(grads))
    except (ValueError, TypeError):
        pass
    by_path = _by_path_if_only_static_differs(model, grads)
    if by_path is not None:
        return by_path
    # `None` for a whole sub-tree ({"enc": None, "dec": g}) skips every parameter in it.
    out = _by_none_subtrees(model, grads)
    if out is None:
        out = _by_walk_with_none_attributes(model, grads)
    if out is None:
        raise ValueError(_mismatch(api, "gradient", model, grads))
    return out


def _by_none_subtrees(model: Any, grads: Any) -> list[Any] | None:
    """The gradient at each of the model's leaves when `grads` is the model's structure
    with `None` in place of whole sub-trees; None if it is not."""
    items, g_def_ = jax.tree_util.tree_flatten(grads, is_leaf=is_none)
    g_def: Any = g_def_
    try:
        subtrees = g_def.flatten_up_to(model)
    except (ValueError, TypeError):
        return None
    out: list[Any] = []
    for g, sub in zip(items, subtrees, strict=True):
        structure: Any = jax.tree_util.tree_structure(sub)
        if g is None:
            out.extend([None] * structure.num_leaves)
        elif structure.num_nodes == 1 and structure.num_leaves == 1:
            out.append(g)
        else:
            return None
    return out


_MISSING = object()


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.DictKey):
        return node.get(key.key, _MISSING) if isinstance(node, dict) else _MISSING
    if isinstance(key, jax.tree_util.SequenceKey):
        ok = isinstance(node, (list, tuple)) and key.idx < len(node)
        return node[key.idx] if ok else _MISSING
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name, _MISSING)
    return _MISSING


def _by_walk_with_none_attributes(model: Any, grads: Any) -> list[Any] | None:
    """The gradient at each of the model's leaves, found by walking each leaf's key path
    through `grads`, where `None` stands for a whole sub-tree. Needed where a gradient
    Module's attribute was set to a container of Nones (`g.extra = {"scale": None}`,
    `g.layers = [None, None]`): a Module decides child or static by value, and a
    container holding no array is static data, so no treedef matches the model. Each
    node on the way must have the model's node's type, and every gradient array must
    be at one of the model's paths; None otherwise."""
    out: list[Any] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(model)[0]:
        m_node, g_node = model, grads
        for key in path:
            if g_node is None:
                break
            if type(g_node) is not type(m_node):
                return None
            m_node, g_node = _child(m_node, key), _child(g_node, key)
            if g_node is _MISSING:
                return None
        if g_node is not None and not isinstance(g_node, _ARRAYS):
            return None  # a container where the model has a leaf
        out.append(g_node)
    used = sum(g is not None for g in out)
    return out if used == len(jax.tree_util.tree_leaves(grads)) else None


def _from_tree(
    config: _Config, m_def: Any, m_leaves: list[Any], model: Any, grads: Any, api: str
) -> list[Any]:
    _check_not_wrapped(grads, model, api)
    shape = config._shape
    g_leaves = shape.flatten(grads) if shape is not None else None  # all arrays, if not None
    if g_leaves is None:
        g_leaves = _gradient_leaves(m_def, model, grads, api)
        if not all(g is None or isinstance(g, _ARRAYS) for g in g_leaves):
            p, g = next(
                (p, g) for p, g in enumerate(g_leaves) if not (g is None or isinstance(g, _ARRAYS))
            )
            expected = (
                f"a {describe_leaf(m_leaves[p])} array or None"
                if config.slots[p] >= 0
                else "None (the optimiser does not train this leaf)"
            )
            raise TypeError(
                f"{api}: the gradient at '{config.paths[p]}' is a {type(g).__name__} "
                f"({g!r:.40}); expected {expected}. Pass the gradient tree that tg.gradient gives."
            )
    return g_leaves if config.plain else config.pick_trainable(g_leaves)


def _from_mapping(config: _Config, grads: Grads, m_leaves: list[Any], params: list[Any], api: str):
    if (
        not config.tied
        and len(grads._params) == len(params)
        and all(map(operator.is_, grads._params, params))
    ):
        # Taken for exactly these parameters, in this order (a Params of this model):
        # each trainable place's gradient is its parameter's.
        return config.pick_by_param(grads._grads)
    held = set(map(id, params))
    if not all(map(held.__contains__, map(id, grads))):
        # Never a silent no-op: these gradients belong to arrays the model no longer holds.
        name = next(n for n, p in zip(grads.named(), grads, strict=True) if id(p) not in held)
        if not any(map(held.__contains__, map(id, grads))):
            raise ValueError(
                f"{api}: the Grads hold gradients for arrays none of which is a parameter of "
                f"this model (e.g. '{name}'): they were taken before the parameters were "
                "replaced (by an earlier tg.update_ or an assignment), or for another model's "
                "parameters. Take the gradients again after each update, for this model's "
                "Params (grads = tg.gradient(lambda: loss(...), ps)), then call update_."
            )
        raise ValueError(
            f"{api}: the Grads hold gradients for arrays that are not this model's parameters "
            f"(e.g. '{name}'): they were taken before the parameters were replaced, by an "
            "earlier tg.update_ or an assignment. Take the gradients again after each update "
            "(grads = tg.gradient(lambda: loss(...), ps)), then call update_."
        )
    return config.pick_trainable(grads.leaves_for(m_leaves))


def _has_none(xs: list[Any]) -> bool:
    # Compares ids at C speed (`None in xs` would compare arrays with ==).
    return id(None) in map(id, xs)


def _inputs(
    config: _Config, grads: list[Any], params: list[Any], donate: bool
) -> tuple[tuple[Any, ...], Any]:
    tracing = bool(params) and is_tracer(params[0])
    if not _has_none(grads):
        return tuple(grads), config.present_all(tracing)
    missing = tuple(k for k, g in enumerate(grads) if g is None)
    filled = list(grads)
    for k in missing:
        x = params[config.tslot[k]]
        # A placeholder of the gradient's shape and dtype, ignored by the step:
        # the parameter itself costs nothing, but a donated buffer cannot be
        # read a second time.
        filled[k] = jnp.zeros(x.shape, x.dtype) if donate else x
    return tuple(filled), config.present(missing, tracing)


def _check_became_trainable(config: _Config, m_leaves: list[Any], api: str) -> None:
    """A place that held no floating-point array at setup (an integer array, a Python
    number) and holds one now has no optimiser state: its gradient would be dropped
    and the array never trained, without a word."""
    for p, x in zip(config.undiff, config.pick_undiff(m_leaves), strict=True):
        if is_differentiable(x):
            raise ValueError(
                f"{api}: '{config.paths[p]}' is {describe_leaf(x)}, a trainable array, but "
                "was not floating-point when the optimiser state was set up, so it has no "
                "optimiser state and would never be trained. Set the state up again for "
                "the changed model (tg.setup(rule, model)), or assign a value of the "
                "old kind if it is not to be trained."
            )


def _check_ties(config: _Config, m_leaves: list[Any], params: list[Any], api: str) -> None:
    """The model's tied weights are those the state was set up with.

    A tie is one optimiser state for several places; one made or broken since
    `tg.setup` would sum two parameters' gradients into one, or leave a place
    never updated, without a word.
    """
    if len(set(map(id, params))) != len(params):
        seen: dict[int, int] = {}
        for i, x in enumerate(params):
            j = seen.setdefault(id(x), i)
            if j != i:
                a, b = config.paths[config.first[j]], config.paths[config.first[i]]
                raise ValueError(
                    f"{api}: '{a}' and '{b}' are now one array (a tied weight), but were two "
                    "when the optimiser state was set up, each with its own state. Set the "
                    f"state up again for the tied model (tg.setup(rule, model)), or give '{b}' "
                    "an array of its own."
                )
    if config.tied and not all(
        map(operator.is_, config.pick_trainable(m_leaves), config.pick_by_param(params))
    ):
        for p, i in zip(config.tpos, config.tslot, strict=True):
            if m_leaves[p] is not params[i]:
                a, b = config.paths[config.first[i]], config.paths[p]
                raise ValueError(
                    f"{api}: '{a}' and '{b}' were one array (a tied weight) when the optimiser "
                    "state was set up, and are now two. Tie them again (assign the same array "
                    f"to both), or set the state up again for the untied model "
                    "(tg.setup(rule, model))."
                )


def _check_deleted(
    config: _Config,
    params: list[Any],
    grads: list[Any],
    states: tuple[Any, ...],
    api: str,
    error: Exception,
) -> None:
    """Name a gradient that escaped a trace, or a parameter or gradient whose array was
    deleted (jax says only "Array has been deleted"): donated to an earlier step, which
    consumed the model it was given."""
    if isinstance(error, jax.errors.UnexpectedTracerError):
        leaked = next((i for i, x in enumerate(grads) if is_tracer(x)), None)
        if leaked is not None:
            # Outside any trace, a traced gradient escaped one (jax says only
            # "unexpected tracer", naming neither the update nor the parameter).
            raise ValueError(
                f"{api}: the gradient of '{config.paths[config.tpos[leaked]]}' is a traced "
                "value that escaped a finished jax transformation (saved from inside a "
                "jax.jit, grad or vmap to a list or global). Return the gradients from the "
                "transformation, or call the update inside it."
            ) from error
    for what, arrays in (("parameter", params), ("gradient of", grads)):
        for i, x in enumerate(arrays):
            if isinstance(x, jax.Array) and not is_tracer(x) and x.is_deleted():
                path = config.paths[config.first[i] if what == "parameter" else config.tpos[i]]
                raise ValueError(
                    f"{api}: the {what} '{path}' is an array that was deleted: an earlier "
                    "tg.update(..., donate=True) (or a jax.jit with donate_argnums) was given "
                    "it and consumed it. Use the model that call returned, not the one given "
                    "to it."
                ) from error
    if any(isinstance(x, jax.Array) and not is_tracer(x) and x.is_deleted() for x in states):
        raise ValueError(
            f"{api}: the optimiser state holds arrays that were deleted: an earlier "
            "tg.update(..., donate=True) was given this state and consumed it. Use the state "
            "that call returned (state, model = tg.update(state, model, grads, donate=True))."
        ) from error


def _check_avals(config: _Config, params: list[Any], api: str, error: Exception) -> None:
    """Name a parameter whose shape or dtype changed since setup (the step then fails
    inside the rule with an error that names neither)."""
    for i, (x, (shape, dtype)) in enumerate(zip(params, config.avals, strict=True)):
        if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
            path = config.paths[config.first[i]]
            raise ValueError(f"{api}: {shape_changed(path, x, shape, dtype)}") from error


def _check_rebindable(config: _Config, model: Any, api: str) -> None:
    pinned = [p for p in config.pinned(model) if config.slots[p] not in config.frozen]
    if pinned:
        path = config.paths[pinned[0]]
        kinds = [k.__name__ for k in holders(model, pinned[0]) if not issubclass(k, tuple)]
        if not kinds:
            raise TypeError(
                f"{api}: cannot update '{path}' in place: only tuples hold it, up to the "
                f"{type(model).__name__} at the root, and tuples are immutable. Hold "
                "parameters in a tg.Module, a dict or a list, or use the pure tg.update."
            )
        # A pytree registered without keys says where its children are by position
        # only: there is no attribute to set the new array on.
        raise TypeError(
            f"{api}: cannot update '{path}' in place: it is held by a {kinds[-1]}, a pytree "
            "registered without attribute names (jax.tree_util.register_pytree_node), so "
            "there is no attribute to set the new array on. Register the class with "
            "jax.tree_util.register_pytree_with_keys and GetAttrKey keys, make it a "
            "tg.Module, or use the pure tg.update."
        )


def _check_mixed(config: _Config, g: list[Any], api: str) -> None:
    """A parameter skipped (a `None` gradient, or frozen) whose optax state is one array
    with other parameters' that are stepped (`optax.flatten`'s vector): its part of it
    cannot be kept while the rest steps, and would silently decay."""
    have = {i for i, x in zip(config.tslot, g, strict=True) if x is not None}
    skipped = set(config.kept) | (set(range(config.n)) - have)
    found = mixed_skips(config, skipped)
    if found is None:
        return
    i, k = found
    raise ValueError(
        f"{api}: {skip_problem(config, i, k)} Pass a zero gradient for it instead of None "
        "(its state then steps as in plain optax), or thaw it."
    )


def _check_rules(config: _Config) -> None:
    """Trace the step again when a value the rules' own functions read (a schedule's
    dict entry, say) changed since it was traced: plain optax reads it every step."""
    cell = config._rules
    if cell is None:
        cell = config._rules = holder(tuple(part.rule for part in config.parts))
    guard = cell[0]
    if guard is not None and not guard.fresh():
        clear_steps()  # rare: a schedule's input edited
        cell[0] = RuleGuard.of(tuple(part.rule for part in config.parts))


def _run(
    state: OptState, model: Any, grads: Any, api: str, *, donate: bool = False, in_place: bool
) -> tuple[list[Any], list[Any], list[Any], tuple[Any, ...], _Config]:
    """Check everything, then run the compiled step; nothing is changed here.

    Returns the model's leaves, its distinct parameters, their new values, the
    new optax state leaves, and the configuration they belong to (the state's,
    or one following static data the model changed since setup).
    """
    config = state._config
    m_def = config.treedef
    m_leaves = config._shape.flatten(model) if config._shape is not None else None
    if m_leaves is None:  # not the structure seen last (or not all arrays): JAX's path
        m_leaves, m_def = jax.tree_util.tree_flatten(model)
        if m_def != config.treedef:
            if not _only_static_changed(config, model, m_def):
                raise ValueError(_mismatch(api, "optimiser state", model, config.layout))
            # Static data edited since setup (a dropout rate, an activation): the
            # arrays and their places are the same, so the state fits; it follows
            # the model's structure from now on (a pure update returns it so).
            config = config.with_treedef(m_def)
        config.shape(m_leaves)
    if config.undiff:
        _check_became_trainable(config, m_leaves, api)
    if in_place:
        _check_rebindable(config, model, api)
    params = m_leaves if config.plain else config.pick_first(m_leaves)
    if config.tied or len(set(map(id, params))) != len(params):
        _check_ties(config, m_leaves, params, api)
    shape = config._shape
    g_all = shape.flatten(grads) if shape is not None else None
    if g_all is not None:
        # The usual step, inline: a gradient tree of the model's own structure with an
        # array at every leaf (so no None, and not a 1-tuple around it).
        g = g_all if config.plain else config.pick_trainable(g_all)
        g_in = tuple(g)
        present = config.present_all(bool(params) and is_tracer(params[0]))
        none = False
    else:
        if isinstance(grads, Grads):
            g = _from_mapping(config, grads, m_leaves, params, api)
        else:
            g = _from_tree(config, m_def, m_leaves, model, grads, api)
        g_in, present = _inputs(config, g, params, donate)
        none = _has_none(g)
    if config.kept or none:
        _check_mixed(config, g, api)
    _check_rules(config)  # before the step is read: it may trace it again
    run = step_donating if donate else _optstep.step
    if config.kept:
        updated = tuple(config.pick_updated(params))
        kept = tuple(config.pick_kept(params))
    else:  # nothing frozen: the usual case
        updated, kept = tuple(params), ()
    placed = placements((*state._leaves, *updated)) if several_devices() else None
    try:
        leaves, new_updated = run(config, placed, state._leaves, updated, kept, g_in, present)
    except BadGradient as e:
        raise ValueError(f"{api}: {e}") from None
    except (TypeError, ValueError, RuntimeError) as e:
        # Checked only once the step failed: a per-step check would cost every step.
        _check_deleted(config, params, g, state._leaves, api, e)
        if isinstance(e, RuntimeError):
            raise
        if several_devices():
            state_on_other_devices(state, params, g, api, e)
        _check_avals(config, params, api, e)
        raise
    if config.kept:
        new_params = list(params)
        for i, x in zip(config.updated, new_updated, strict=True):
            new_params[i] = x
    else:
        new_params = list(new_updated)
    if not donate and none:
        # A parameter with no gradient at any place keeps its array object, not
        # only its value: Grads keyed on it stay valid, and update_ rebinds nothing.
        have = {i for i, x in zip(config.tslot, g, strict=True) if x is not None}
        for i in config.updated:
            if i not in have:
                new_params[i] = params[i]
    return m_leaves, params, new_params, leaves, config


def _update_plain(state: OptState, model: Any, grads: Any) -> tuple[OptState, Any] | None:
    """`update` of the usual step in one go, or None for `_run` to check and run it.

    The usual step: every leaf of the model its own trainable parameter, none
    frozen, none held twice, on one device; the gradient tree of the model's own
    structure with an array at every leaf (the generated flatten sees to that).
    A step that fails is run again by `_run`, which says what is wrong: the
    step changes nothing, so running it twice loses nothing.
    """
    config = state._config
    shape = config._shape
    if shape is None or not config.plain or config.kept or several_devices():
        return None
    params = shape.flatten(model)
    if params is None or len(set(map(id, params))) != len(params):
        return None
    g = shape.flatten(grads)
    if g is None:
        return None
    _check_rules(config)
    present = config.present_all(bool(params) and is_tracer(params[0]))
    try:
        leaves, new = _optstep.step(
            config, None, state._leaves, tuple(params), (), tuple(g), present
        )
    except (TypeError, ValueError, RuntimeError):  # the checked path makes the message
        return None
    return OptState(config, leaves), shape.unflatten(new)


def update(
    state: OptState, model: Any, grads: Any, *, donate: bool = False
) -> tuple[OptState, Any]:
    """One optimiser step, pure: returns `(new_state, new_model)`.

    Arguments:
        state: from `tg.setup`.
        model: the model the gradients were taken for.
        grads: its explicit gradient tree, or a `tg.Grads`. `None` (for a leaf
            or a whole sub-tree, `{"enc": None, "dec": g}`) skips those
            parameters: their values and their own optax state entries are
            kept, while shared counters (optax's `count`) advance as in optax.
        donate: let XLA reuse the buffers of the updated parameters and of
            the optimiser state for the new ones, so a large model is not
            held twice. The old arrays are deleted: use it only when nothing
            will read the old model or state again.

    Returns:
        `(state, model)`, new objects; the inputs are left as they were. A
        sub-model held at two places is one object in the new model too.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.array([1.0, 2.0])}
        >>> state = tg.setup(optax.sgd(0.1), model)
        >>> (g,) = tg.gradient(lambda m: jnp.sum(m["w"] ** 2), model)
        >>> state, model = tg.update(state, model, g)
        >>> model["w"]
        Array([0.8, 1.6], dtype=float32)
    """
    if type(state) is OptState and not donate:
        done = _update_plain(state, model, grads)
        if done is not None:
            return done
    state = _check_state(state, "tg.update")
    model = _source(model)
    m_leaves, params, new_params, leaves, config = _run(
        state, model, grads, "tg.update", donate=donate, in_place=False
    )
    new_state = OptState(config, leaves)
    if config.tied:
        by_id = {id(old): new for old, new in zip(params, new_params, strict=True)}
        return new_state, tree_map_shared(lambda leaf: by_id.get(id(leaf), leaf), model)
    if config.plain:  # every leaf its own parameter, in order
        new_leaves = new_params
    else:
        pairs = zip(config.slots, m_leaves, strict=True)
        new_leaves = [leaf if s < 0 else new_params[s] for s, leaf in pairs]
    return new_state, config.shape(m_leaves).unflatten(new_leaves)


def update_(state: OptState, model: Any, grads: Any) -> None:
    """One optimiser step in place: rebinds the new arrays where the old ones lived.

    Arguments:
        state: from `tg.setup`; updated in place.
        model: a model held in mutable containers (Modules, dicts, lists), or a
            `tg.Params` built from one.
        grads: the explicit gradient tree, or a `tg.Grads` taken for the
            model's current arrays.

    Returns:
        None; the model's containers and the state are changed in place.
        Everything is checked first: on any error neither is changed.

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
    api = "tg.update_"
    state = _check_state(state, api)
    src = _source(model)
    if isinstance(src, jax.Array):
        raise TypeError(
            "tg.update_ cannot update a standalone array in place; hold it in a list, dict or "
            "Module, or use the pure tg.update."
        )
    m_leaves, params, new_params, leaves, config = _run(state, src, grads, api, in_place=True)
    if _is_tracer_in(new_params) and not _is_tracer_in(params):
        # Traced results for arrays that are not traced: a transformation of the user's
        # (jax.jit, jax.vmap) captured the model, so nothing would write the new arrays
        # back; they would be tracers left in the model and the state.
        raise TypeError(
            "tg.update_ inside jax.jit (or another jax transformation) of a model the "
            "transformation does not trace: the new arrays would be tracers leaking into the "
            "model and the optimiser state, which are left unchanged. Compile the step with "
            "tg.jit, which writes the new arrays back; or use the pure "
            "`state, model = tg.update(state, model, grads)` and return them."
        )
    if all(map(operator.is_not, params, new_params)):  # every parameter changed: in C
        changed = dict(zip(map(id, params), new_params, strict=True))
    else:
        pairs = zip(params, new_params, strict=True)
        changed = {id(old): new for old, new in pairs if old is not new}
    if changed:
        rebind(src, changed, (m_leaves, config.treedef))
        if isinstance(model, Params):
            model._rebound(src)
    if config is not state._config and (_is_tracer_in(new_params) or _is_tracer_in(leaves)):
        # Inside a compiled step, after an edit of the model's static data: the state
        # keeps its configuration (the same arrays and places; only the model's static
        # data differs), as a compiled step's guard recorded it, so the next call of
        # the step is not traced again. Outside a trace it follows the model.
        config = state._config
    state._install(config, leaves)


def _is_tracer_in(leaves: Sequence[Any]) -> bool:
    return bool(leaves) and is_tracer(leaves[0])


__all__ = ["Leaf", "OptState", "setup", "update", "update_"]
