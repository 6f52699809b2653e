"""What a model may hold for the optimiser and for `tg.Params`: the leaves it may train
(respecting `__trainable__`), and the clear refusals of containers that would hide
parameters from jax (a dict subclass, a weakref.proxy, a non-pytree holding arrays, a
numpy array where identity is needed).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Mapping, Sequence, Set
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._module import Module
from ._paths import set_at
from ._tree import describe_leaf, is_differentiable, path_str, refuse_unsortable


def _restricted(node: Any) -> bool:
    # By type: a weakref.proxy to a Module passes isinstance (it forwards __class__)
    # but is no Module (a leaf, refused by `refuse_opaque_containers`).
    return issubclass(type(node), Module) and type(node).__trainable__ is not None


def _missing_trainable(tree: Any) -> tuple[str, str, list[str]] | None:
    """The first Module in `tree` whose `__trainable__` names an attribute it lacks."""
    for node in jax.tree_util.tree_leaves(tree, is_leaf=_restricted):
        if _restricted(node):
            for name in type(node).__trainable__ or ():
                if name not in node.__dict__:
                    return type(node).__name__, name, list(node.__dict__)
            found = _missing_trainable(
                [node.__dict__[n] for n in type(node).__trainable__ or () if n in node.__dict__]
            )
            if found:
                return found
    return None


def trainable_leaves_with_path(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """(path, leaf) for every leaf the optimiser may train, respecting `__trainable__`."""
    out: list[tuple[tuple[Any, ...], Any]] = []

    def walk(node: Any, prefix: tuple[Any, ...]) -> None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=_restricted)[0]:
            full = prefix + path
            if _restricted(leaf) and not (leaf is node and not path):
                walk(leaf, full)
            elif _restricted(leaf):
                # A name in `__trainable__` whose attribute is static (`scale = 2.0`)
                # holds no leaves of the tree: walked, its value came back as one.
                children = _child_names(leaf)
                for name in type(leaf).__trainable__ or ():
                    if name in children:
                        walk(leaf.__dict__[name], (*full, jax.tree_util.GetAttrKey(name)))
            else:
                out.append((full, leaf))

    walk(tree, ())
    return out


def _holds_inexact(value: Any) -> bool:
    """Whether `value` holds a floating or complex array, through dicts, lists, tuples."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return bool(jnp.issubdtype(value.dtype, jnp.inexact))
    if isinstance(value, dict):
        return any(_holds_inexact(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_inexact(v) for v in value)
    return False


def _contents(value: Any) -> list[Any]:
    """What a non-pytree value holds, as far as a user would see it: a Mapping's values,
    a sequence's or set's items, an object's attributes (empty for anything else)."""
    if isinstance(value, (str, bytes, jax.Array, np.ndarray)):
        return []
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (Sequence, Set, collections.deque)):
        return list(value)
    attrs = getattr(value, "__dict__", None)
    return list(attrs.values()) if isinstance(attrs, dict) and not callable(value) else []


def _reaches_inexact(value: Any, depth: int = 4) -> bool:
    """Whether a float array is among what `value` holds (`_contents`), a few levels deep."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return bool(jnp.issubdtype(value.dtype, jnp.inexact))
    return depth > 0 and any(_reaches_inexact(v, depth - 1) for v in _contents(value))


def _static_holder(
    node: Any, path: tuple[Any, ...] = (), static: bool = False
) -> tuple[str, Any, bool] | None:
    """The first value in `node` that holds float arrays but is no pytree (a leaf, or
    in a Module's static data): (where, the value, whether a Module keeps it static)."""
    if isinstance(node, Module):
        children = _child_names(node)
        for name, value in vars(node).items():
            found = _static_holder(
                value, (*path, jax.tree_util.GetAttrKey(name)), static or name not in children
            )
            if found is not None:
                return found
        return None
    flat = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node and isinstance(x, Module)
    )[0]
    if len(flat) == 1 and flat[0][1] is node:
        if not isinstance(node, (jax.Array, np.ndarray)) and _reaches_inexact(node):
            where = f"'{path_str(path)}' in the model" if path else "the model"
            return where, node, static
        return None
    for p, leaf in flat:
        found = _static_holder(leaf, (*path, *p), static)
        if found is not None:
            return found
    return None


def refuse_opaque_containers(pairs: Any, api: str, what: str = "the model") -> None:
    """Refuse a leaf that is a dict, list or tuple subclass holding parameters.

    jax flattens dict, list and tuple themselves (and OrderedDict, defaultdict,
    NamedTuples), not their subclasses: `class Layers(dict)` is one leaf, so the
    arrays in it got a silent None gradient and were never trained. `pairs`:
    (path, leaf) of a tree's leaves.
    """
    for path, leaf in pairs:
        if type(leaf) in weakref.ProxyTypes:
            where = f"'{path_str(path)}' in {what}" if path else what
            name = leaf.__class__.__name__  # the referent's (a proxy forwards it)
            raise TypeError(
                f"{api}: {where} is a weakref.proxy to a {name}, not the {name} itself: to "
                "jax a proxy is one opaque leaf, so the arrays behind it would get no "
                f"gradient (None) and never be trained. Pass the {name} itself."
            )
        if isinstance(leaf, (dict, list, tuple)) and _holds_inexact(leaf):
            base = next(b for b in (dict, list, tuple) if isinstance(leaf, b)).__name__
            name = type(leaf).__name__
            where = f"'{path_str(path)}' in {what}" if path else what
            raise TypeError(
                f"{api}: {where} is a {name}, a subclass of {base} that jax does not "
                f"flatten: to jax it is one opaque leaf, so the arrays it holds would get no "
                f"gradient (None) and never be trained. Hold them in a plain {base} "
                f"({base}(x)), or register {name} as a pytree "
                "(jax.tree_util.register_pytree_with_keys)."
            )


def _child_names(module: Module) -> set[str]:
    """The attributes of `module` that are pytree children (the others are static)."""
    level = jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda v: v is not module)[0]
    return {path[0].name for path, _ in level if isinstance(path[0], jax.tree_util.GetAttrKey)}


def checked_source(xs: Any, api: str) -> Any:
    """A model, container or array to read parameters from; clear errors otherwise."""
    if isinstance(xs, np.ndarray) and not isinstance(xs, jax.Array):
        raise TypeError(
            f"{api} got a numpy array; parameters are tracked by identity, and JAX "
            "copies a numpy array into a new object whenever it is used, so gradients "
            "could never be found for it. Convert it first: W = jnp.asarray(W)."
        )
    if isinstance(xs, jax.Array):
        if not is_differentiable(xs):
            # A typed PRNG key cannot be cast to a float (astype raises): say what it is
            # instead of suggesting the cast.
            hint = (
                "it is a random key, which a model holds as state, never as a parameter."
                if jnp.issubdtype(xs.dtype, jax.dtypes.prng_key)
                else "cast it, e.g. x.astype(jnp.float32), if it is a parameter."
            )
            raise ValueError(
                f"{api}: a {describe_leaf(xs)} array is not differentiable (only floating and "
                f"complex arrays are); {hint}"
            )
        return xs
    try:
        flat = jax.tree_util.tree_leaves_with_path(xs)
    except ValueError as e:  # a dict whose keys jax cannot sort: named
        refuse_unsortable(api, [(f"the {type(xs).__name__} it was given", xs)], e)
        raise
    from ._params import Params  # _params builds on this module

    leaves = [v for _, v in flat]
    inner = [path_str(p) for p, v in flat if type(v) is Params]
    if inner:
        # Not a pytree, a Params inside a container is an opaque leaf: skipped, its
        # parameters would silently be missing from the set.
        raise TypeError(
            f"{api}: the {type(xs).__name__} holds a tg.Params at '{inner[0]}'; a Params is "
            "not a container of parameters to collect. For their union pass the Params and "
            "arrays at the top level, tg.Params([ps, W]), or call ps.add(other)."
        )
    refuse_opaque_containers(flat, api, f"the {type(xs).__name__} it was given")
    if len(leaves) == 1 and leaves[0] is xs and _reaches_inexact(xs):
        raise TypeError(
            f"{api} got a {type(xs).__name__} holding arrays, which is no pytree: jax takes it "
            "for one leaf, so its arrays cannot be collected. Hold them in a dict, a list or "
            f"a tg.Module, or register {type(xs).__name__} as a pytree."
        )
    if len(leaves) == 1 and leaves[0] is xs:
        raise TypeError(
            f"{api} got a {type(xs).__name__} ({xs!r:.40}): parameters are arrays, tracked by "
            "identity. Pass a model, a container of arrays, or a jax.Array "
            "(e.g. tg.params(jnp.asarray(x)) inside a list or dict you keep)."
        )
    convert_numpy(xs, api)
    if not any(is_differentiable(leaf) for _, leaf in trainable_leaves_with_path(xs)):
        arrays = [
            (path_str(p), leaf)
            for p, leaf in jax.tree_util.tree_flatten_with_path(xs)[0]
            if isinstance(leaf, (jax.Array, np.ndarray))
        ]
        missing = _missing_trainable(xs)
        if missing:
            cls, name, have = missing
            raise ValueError(
                f"{api}: {cls}.__trainable__ names {name!r}, which the {cls} does not have "
                f"(its attributes: {', '.join(have) or 'none'}); so nothing is trainable. "
                "Check the spelling."
            )
        if arrays:
            what = ", ".join(f"'{n}' is {describe_leaf(a)}" for n, a in arrays[:3])
            raise ValueError(
                f"{api}: the {type(xs).__name__} holds no differentiable arrays ({what}); "
                "integer, bool and key arrays are not differentiable. Cast the parameters to "
                "a floating dtype, or check __trainable__."
            )
        hidden = _static_holder(xs)
        if hidden is not None:
            where, holder, static = hidden
            kept = ", and a Module keeps it as static data" if static else ""
            raise TypeError(
                f"{api}: {where} is a {type(holder).__name__} holding arrays, which is no "
                f"pytree: jax takes it for one leaf{kept}, so its arrays are not "
                "parameters. Hold them in a dict, a list or a tg.Module, or register "
                f"{type(holder).__name__} as a pytree."
            )
        # An empty model is almost always a mistake; an empty list is how a set starts.
        raise ValueError(
            f"tg.Params found no floating-point arrays in the {type(xs).__name__} it was given."
        )
    return xs


def convert_numpy(tree: Any, api: str) -> None:
    """Replace float numpy leaves by jax.Arrays where they live (identity needs it)."""
    if isinstance(tree, (np.ndarray, jax.Array)):
        return
    # One jax.Array per numpy object: a tied numpy weight (one object at two places)
    # stays tied, and one parameter; converted place by place it became two.
    converted: dict[int, jax.Array] = {}
    places = [
        (path, leaf)
        for path, leaf in trainable_leaves_with_path(tree)
        if isinstance(leaf, np.ndarray) and np.issubdtype(leaf.dtype, np.inexact)
    ]
    if places:
        # The same numpy object at a non-trainable place too (`frozen` of a Module
        # with `__trainable__`) becomes that jax.Array: left numpy, the tie broke and
        # that place kept the old value after each update (a jax.Array tied across
        # both places is one object, updated at both).
        numpy_ids = {id(leaf) for _, leaf in places}
        trainable_paths = {path for path, _ in places}
        places += [
            (path, leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if id(leaf) in numpy_ids and path not in trainable_paths
        ]
    for path, leaf in places:
        if id(leaf) not in converted:
            converted[id(leaf)] = jnp.asarray(leaf)
        try:
            set_at(tree, path, converted[id(leaf)])
        except TypeError as e:  # nowhere to rebind: immutable all the way up
            raise TypeError(
                f"{api}: '{path_str(path)}' is a numpy array inside an immutable "
                f"{type(tree).__name__}, so it cannot be converted to a jax.Array in place "
                "(parameters are tracked by identity, and JAX copies a numpy array into a "
                "new object whenever it is used). Pass jnp.asarray(...) instead, or hold "
                "it in a list or dict."
            ) from e
