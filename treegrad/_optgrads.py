"""How the gradients given to `update` are matched to the model's parameters.

A gradient tree of the model's structure is read by position; one that differs in
static data only (taken before an edit of an activation), or holds `None` for a
whole sub-tree, by key path; a `Grads` by parameter identity. Anything else is
refused with the first place where it differs from the model.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np

from ._grads import Grads
from ._optstate import _Config
from ._paths import get_attr
from ._reach import node_types
from ._tree import describe_leaf, first_difference, is_none, path_str

_ARRAYS = (jax.Array, np.ndarray, np.generic)


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
        return get_attr(node, key.name, _MISSING)
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
    # A parameter whose gradient is None is skipped whatever array holds its place now:
    # one the loss itself replaced while it ran (a running statistic the model keeps,
    # `m["mean"] = 0.9 * m["mean"] + ...`; nnx's BatchNorm) is no stale gradient.
    if not all(
        held.__contains__(id(p))
        for p, g in zip(grads._params, grads._grads, strict=True)
        if g is not None
    ):
        # Never a silent no-op: these gradients belong to arrays the model no longer holds.
        name, x = next(
            (n, p)
            for n, p, g in zip(grads.named(), grads._params, grads._grads, strict=True)
            if id(p) not in held and g is not None
        )
        if any(leaf is x for leaf in m_leaves):
            # The model holds it, but the state was set up without it: removed from the
            # Params then, added back since (or a place __trainable__ leaves out).
            raise ValueError(
                f"{api}: the Grads hold a gradient for '{name}', an array of the model that "
                "was not a parameter when the optimiser state was set up (it had been removed "
                "from the Params, or __trainable__ leaves it out), so it has no optimiser state "
                "and would never be trained. Set the state up again for the Params as they are "
                "now (state = tg.setup(rule, ps)), or remove the array from the Params."
            )
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
