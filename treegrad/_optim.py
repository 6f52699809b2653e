"""The model-tree optimiser on optax: `setup`, `update`, `update_` and friends.

As in Optimisers.jl, `setup` builds a state that mirrors the model and
`update` walks model, gradients and state together; the optimiser does not
know which gradient style produced the gradients. The state is one optax
state over the trainable tree (`_optbuild.py`), seen through the model's shape
(`_optview.py`), so every optax rule, including those that look across
parameters, gives plain optax's result. The step itself is one compiled call
(`_optstep.py`); this module checks everything before it runs, so a failed
update changes nothing (the gradients given are matched to the model's
parameters in `_optgrads.py`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import optax

from . import _optstep
from ._cache import TURN
from ._grads import Grads
from ._jaxpr import is_tracer
from ._layout import placements, several_devices, state_on_other_devices
from ._optbuild import build
from ._optgrads import _from_mapping, _from_tree, _mismatch
from ._optguard import RuleGuard, holder
from ._optstate import _Config, holders
from ._optstatemap import mixed_skips
from ._optstep import BadGradient, clear_steps, shape_changed, step_donating
from ._optview import Leaf, OptState, SubState, skip_problem
from ._paramerrors import UnreadParameterError, unread_message
from ._params import Params
from ._paths import rebind
from ._programs import LINKED, in_user_function
from ._reach import node_types
from ._tree import describe_leaf, is_differentiable, same_structure, tree_map_shared


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
        model: a model (Module, dict, list, any pytree) or a `tg.Params`: its
            model, with the arrays removed from the Params (`ps.remove(x)`)
            not trained, as those outside `__trainable__` are not.

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
    # A Params' own arrays: one removed from it is not a parameter (no state, not seen
    # by the rule), as for a plain optax user given the Params' arrays.
    among = model if isinstance(model, Params) else None
    return OptState(*build(rule, _source(model), among))


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
        if is_differentiable(x) and is_tracer(x):
            # Inside a jax transformation of the model (a user's jax.jit, lax.scan,
            # jax.vmap), jax traces a Python or numpy number leaf as an array: the
            # user changed nothing, so "set the state up again" would mislead.
            raise ValueError(
                f"{api}: '{config.paths[p]}' is a traced {describe_leaf(x)} here, but was not "
                "a floating-point array when the optimiser state was set up (a Python or "
                "numpy number is static data, never trained): inside jax.jit, jax.lax.scan, "
                "jax.vmap or another jax transformation of the model, jax traces every leaf, "
                "Python numbers included, as an array. Compile the step with tg.jit, which "
                "keeps Python numbers static, or keep such a number out of the model's "
                "leaves (a static attribute of a tg.Module, a closure variable). (Inside "
                "tg.jit: the step assigned a traced array there; assign a value of the old "
                "kind.)"
            )
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
                if is_tracer(m_leaves[p]) and is_tracer(params[i]) and not in_user_function():
                    # Inside the user's own jax transformation of the model (jax.jit,
                    # lax.scan, jax.vmap): jax passes each place as its own traced
                    # array, so the tie cannot be seen here; "tie them again" would
                    # mislead. (A tg.jit step passes a tied weight as one traced array:
                    # two there were untied, before the step or in it.)
                    raise ValueError(
                        f"{api}: '{a}' and '{b}' were one array (a tied weight) when the "
                        "optimiser state was set up, but are two traced arrays here: inside "
                        "jax.jit, jax.lax.scan, jax.vmap or another jax transformation of the "
                        "model, jax passes each place of a tied weight as an array of its own, "
                        "so the tie cannot be kept. Compile the step with tg.jit, which keeps "
                        "tied weights one array (a Python loop of tg.jit steps in place of "
                        "lax.scan), or untie the model and set the state up again "
                        "(tg.setup(rule, model))."
                    )
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
        if not same_structure(m_def, config.treedef):
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
    frozen, no array or sub-model held twice, on one device; the gradient tree of
    the model's own structure with an array at every leaf (the generated flatten
    sees to that).
    A step that fails is run again by `_run`, which says what is wrong: the
    step changes nothing, so running it twice loses nothing.
    """
    config = state._config
    shape = config._shape
    if shape is None or not config.plain or config.tied or config.kept or several_devices():
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
    with TURN:  # not while another thread traces over the model (`_cache.TURN`)
        if type(state) is OptState and not donate:
            done = _update_plain(state, model, grads)
            if done is not None:
                return done
        return _update(state, model, grads, donate)


def _update(state: Any, model: Any, grads: Any, donate: bool) -> tuple[OptState, Any]:
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
    with TURN:  # not while another thread traces over the model (`_cache.TURN`)
        _update_in_place(state, model, grads)


def _update_in_place(state: Any, model: Any, grads: Any) -> None:
    api = "tg.update_"
    state = _check_state(state, api)
    src = _source(model)
    if isinstance(src, jax.Array):
        raise TypeError(
            "tg.update_ cannot update a standalone array in place; hold it in a list, dict or "
            "Module that the loss reads it from, and build the Params from that, or use the "
            "pure tg.update."
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
            if (
                isinstance(grads, Grads)
                and grads._readers
                and (model._loose() or model._unproven())
            ):
                _check_read(grads, changed, model, src, m_leaves, config.treedef)
                model._proven = True  # read from its containers: `Params._unproven`
    if config is not state._config and (_is_tracer_in(new_params) or _is_tracer_in(leaves)):
        # Inside a compiled step, after an edit of the model's static data: the state
        # keeps its configuration (the same arrays and places; only the model's static
        # data differs), as a compiled step's guard recorded it, so the next call of
        # the step is not traced again. Outside a trace it follows the model.
        config = state._config
    state._install(config, leaves)


def _check_read(
    grads: Grads, changed: dict[int, Any], ps: Params, src: Any, m_leaves: list[Any], treedef: Any
) -> None:
    """After the arrays were rebound inside the Params' containers: a parameter the loss
    reads only where the update did not reach (`Grads.unread`) would be read as the old
    array on every later step, never training, and the next gradient would be None with
    no sign of why. Outside a trace the update stands, since the loss read the current
    arrays, and the Params remembers the old ones: the next gradient refuses a loss
    still reading one (`Params.stale_read`), while a local unpacked from the Params at
    each step (`W, b = ps`) reads the new arrays and trains. Inside a compiled step the
    old arrays are tracers: refused now, undoing the rebinding."""
    unread = grads.unread(changed, frozenset().union(*LINKED))
    if not unread:
        return
    if not is_tracer(unread[0][2]):
        ps._retire(unread, changed)
        return
    name, where, old = unread[0]
    new_leaves = [changed.get(id(leaf), leaf) for leaf in m_leaves]
    back = {id(changed[id(leaf)]): leaf for leaf in m_leaves if id(leaf) in changed}
    rebind(src, back, (new_leaves, treedef))
    ps._rebound(src)
    raise UnreadParameterError(unread_message("tg.update_", name, where, old, stale=False))


def _is_tracer_in(leaves: Sequence[Any]) -> bool:
    return bool(leaves) and is_tracer(leaves[0])


__all__ = ["Leaf", "OptState", "setup", "update", "update_"]
