"""Small pytree helpers shared by the engine, the optimiser and the front ends."""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_INEXACT: dict[Any, bool] = {}


def is_inexact(dtype: Any) -> bool:
    """Whether a dtype is floating or complex (memoised: jnp.issubdtype costs ~2us)."""
    try:
        return _INEXACT[dtype]
    except KeyError:
        r = _INEXACT[dtype] = bool(jnp.issubdtype(dtype, jnp.inexact))
        return r


def is_differentiable(x: Any) -> bool:
    """A differentiable leaf: a floating or complex array (`jax.Array` or numpy).

    One rule everywhere: a floating-point numpy array in a model is
    differentiated like a `jax.Array` (as `jax.grad` does), trained by the
    optimiser (which returns `jax.Array`s), and converted to a `jax.Array`
    where it lives by `tg.params` (implicit mode tracks arrays by identity).

    Arguments:
        x: any pytree leaf.

    Returns:
        True for float and complex arrays; False for integer, bool and key
        arrays, Python numbers and everything else.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, treegrad as tg
        >>> tg.is_differentiable(jnp.ones(2)), tg.is_differentiable(jnp.arange(2))
        (True, False)
        >>> tg.is_differentiable(np.ones(2)), tg.is_differentiable(1.0)
        (True, False)
    """
    return isinstance(x, (jax.Array, np.ndarray)) and is_inexact(x.dtype)


def path_str(path: tuple[Any, ...]) -> str:
    """A key path as a dotted string: `l1.weight`, `layers.0.bias`."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def same_structure(a: Any, b: Any) -> bool:
    """Whether two treedefs are the same structure: jax's `==`, and the same hash.

    jax's `==` (jaxlib 0.10 to 0.12) takes two `jax.tree_util.register_dataclass`
    types with as many data fields and equal static fields for the same node, even
    with other field names (`flax.struct.dataclass` too); their hashes differ. Trusting
    `==` alone, a gradient of one such model was served from another's cache entry.
    (`test_jax_treedef_equality_of_same_layout_dataclasses_is_the_trap` tracks it.)
    """
    return a == b and hash(a) == hash(b)


def describe_leaf(x: Any) -> str:
    if isinstance(x, (jax.Array, np.ndarray)):
        return describe_aval(x.shape, x.dtype)
    return repr(x)


def describe_aval(shape: tuple[int, ...], dtype: Any) -> str:
    """`float32[5x3]` (with a multiplication sign), `int32 scalar`: how messages write an array."""
    name = str(dtype) if isinstance(dtype, np.dtype) else _dtype_name(dtype)
    return f"{name}[{'×'.join(map(str, shape))}]" if shape else f"{name} scalar"


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name  # a scalar type: jnp.float32
    except TypeError:  # a jax extended dtype (a typed PRNG key's)
        return str(dtype)


_VALUES_VIEW: type = type({}.values())


def iterable_leaf(x: Any) -> bool:
    """An iterator (a data loader a Module keeps, one the function holds) or a dict's
    values view (`vals = cfg.values()`): a leaf, as jax takes it today with a
    DeprecationWarning (an error in a later jax), told to `tree_leaves(is_leaf=)` so
    that nothing warns."""
    return type(x) is _VALUES_VIEW or hasattr(type(x), "__next__")


def is_none(x: Any) -> bool:
    return x is None


def first_difference(a: Any, b: Any) -> str | None:
    """Dotted path of the first place where two trees differ in structure."""
    pa = jax.tree_util.tree_flatten_with_path(a, is_leaf=is_none)[0]
    pb = jax.tree_util.tree_flatten_with_path(b, is_leaf=is_none)[0]
    # A path in one tree only (an extra or a missing dict key) first, by name: in
    # sorted order an extra key would shift the others and the first mismatch
    # would name a key both trees have.
    try:
        in_a, in_b = dict(pa), dict(pb)
    except TypeError:  # a foreign pytree's unhashable key: compare in order below
        in_a = in_b = {}
    for k, leaf in pa if in_b else ():
        if k not in in_b or (leaf is None) != (in_b[k] is None):
            return path_str(k) or "<root>"
    for k, _ in pb if in_a else ():
        if k not in in_a:
            return path_str(k) or "<root>"
    for (ka, la), (kb, lb) in zip(pa, pb, strict=False):
        # A place that is None in one tree only (an attribute set to None) differs too.
        if ka != kb or (la is None) != (lb is None):
            return path_str(ka) or "<root>"
    if len(pa) != len(pb):
        longer = pa if len(pa) > len(pb) else pb
        return path_str(longer[min(len(pa), len(pb))][0]) or "<root>"
    return None


def unique_by_id(items: Iterable[Any]) -> tuple[list[Any], list[int]]:
    """De-duplicate objects by identity: a tied weight is one object at several places.

    Arguments:
        items: any objects (typically the leaves of a flattened model).

    Returns:
        `(uniq, slots)`: the distinct objects in first-seen order, and for each
        item the index of its object in `uniq`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from treegrad._tree import unique_by_id
        >>> w, b = jnp.ones(2), jnp.zeros(2)
        >>> uniq, slots = unique_by_id([w, b, w])
        >>> len(uniq), slots
        (2, [0, 1, 0])
    """
    index: dict[int, int] = {}
    uniq: list[Any] = []
    slots: list[int] = []
    for x in items:
        i = index.get(id(x))
        if i is None:
            i = index[id(x)] = len(uniq)
            uniq.append(x)
        slots.append(i)
    return uniq, slots


def functor(node: Any) -> tuple[list[tuple[Any, Any]], Callable[[list[Any]], Any]] | None:
    """One level of a pytree, like Functors.jl's `functor`: its children and how to rebuild it.

    Arguments:
        node: any pytree node (a Module, list, dict, tuple, foreign pytree) or leaf.

    Returns:
        `None` for a leaf; otherwise `(children, rebuild)`, where `children`
        lists `(key, child)` pairs (keys as in `jax.tree_util` key paths) and
        `rebuild(new_children)` builds a node of the same type and static data.

    Examples:
        >>> import jax.numpy as jnp
        >>> from treegrad._tree import functor
        >>> children, rebuild = functor({"w": jnp.ones(2), "n": 3})
        >>> [str(k) for k, _ in children]
        ["['n']", "['w']"]
        >>> rebuild([4, 5])
        {'n': 4, 'w': 5}
        >>> functor(jnp.ones(2)) is None
        True
    """
    pairs, treedef_ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    treedef: Any = treedef_
    # A leaf has one node and one leaf; `None` and empty containers (one node,
    # no leaf) are nodes, rebuilt as new objects.
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return None
    return [(path[0], child) for path, child in pairs], treedef.unflatten


def tree_map_shared(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`jax.tree_util.tree_map(fn, tree)` that keeps sharing: each object is rebuilt once.

    A sub-model held at two places (the same Module object twice) comes back
    as one new object held at both places, and a leaf object found at several
    places is mapped once, so tied weights stay tied. `jax.tree_util`'s
    flatten/unflatten round trip would build two copies of a shared node.

    Arguments:
        fn: applied to every leaf (`None` counts as a leaf).
        tree: any pytree.

    Returns:
        A new tree of the same structure and the same sharing.

    Examples:
        >>> import jax.numpy as jnp
        >>> from treegrad._tree import tree_map_shared
        >>> block = {"w": jnp.ones(2)}
        >>> out = tree_map_shared(lambda x: x * 2, {"a": block, "b": block})
        >>> out["a"] is out["b"], out["a"]["w"]
        (True, Array([2., 2.], dtype=float32))
    """
    # Keyed by id, holding the node too: a foreign pytree may flatten to
    # temporary children, whose ids could otherwise be reused mid-walk.
    memo: dict[int, tuple[Any, Any]] = {}

    def go(node: Any) -> Any:
        done = memo.get(id(node))
        if done is not None:
            return done[1]
        level = functor(node)
        out = fn(node) if level is None else level[1]([go(child) for _, child in level[0]])
        memo[id(node)] = (node, out)
        return out

    return go(tree)


def picker(index: Sequence[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """`lambda xs: [xs[i] for i in index]`, with the loop in C (operator.itemgetter)."""
    if len(index) < 2:
        return lambda xs: [xs[i] for i in index]
    get = operator.itemgetter(*index)
    return lambda xs: list(get(xs))


def is_float_like(x: Any) -> bool:
    """A Python or numpy float or complex scalar: `==` takes -0.0 for 0.0 there."""
    t = type(x)
    return t is float or t is complex or isinstance(x, (np.floating, np.complexfloating))


def value_key(x: Any) -> Any:
    """A key equal for two static values only when a program traced with one is right
    for the other: `==` alone takes `1` for `1.0` and `True` (which trace to other
    dtypes) and `0.0` for `-0.0` (`1 / x` differs). Tuples are keyed item by item."""
    t = type(x)
    if is_float_like(x):
        return (t, repr(x))  # repr tells -0.0 from 0.0, and keeps nan equal to nan
    if t is tuple:
        return (t, tuple(map(value_key, x)))
    return (t, x)


def same_value(a: Any, b: Any) -> bool:
    """`a == b` for static data, with `value_key`'s distinctions."""
    if type(a) is not type(b):
        return False
    if is_float_like(a):
        return repr(a) == repr(b)
    return bool(a == b)


def user_stacklevel() -> int:
    """`stacklevel` for a `warnings.warn` in the caller: the first frame outside treegrad,
    so the warning names the user's line however deep inside treegrad it is raised."""
    frame = sys._getframe(1)  # the function that calls warnings.warn: level 1
    level = 1
    while frame.f_back is not None and _ours(frame.f_globals.get("__name__")):
        frame = frame.f_back
        level += 1
    return level


def _ours(module: Any) -> bool:
    return isinstance(module, str) and (module == "treegrad" or module.startswith("treegrad."))


_UNSORTABLE = "sorting pytree dictionary keys"


def refuse_unsortable(api: str, labelled: Sequence[tuple[str, Any]], error: ValueError) -> None:
    """Raise a TypeError naming the dict whose keys jax failed to sort, when `error` is
    jax's "Comparator raised exception while sorting pytree dictionary keys" (which
    names neither the dict nor the fix); return otherwise. `labelled`: (how to name it,
    tree) for each tree that was flattened."""
    if _UNSORTABLE not in str(error):
        return
    for label, tree in labelled:
        found = _unsortable(tree, "", set())
        if found is not None:
            where, keys = found
            what = f"the dict at {where.lstrip('.')} in {label}" if where else label
            kinds = sorted({type(key).__name__ for key in keys})
            raise TypeError(
                f"{api}: {what} has keys that cannot be sorted "
                f"({', '.join(map(repr, keys[:4]))}: {', '.join(kinds)}); jax orders a dict's "
                "entries by sorting its keys. Use keys that sort (all str, or all int), or a "
                "collections.OrderedDict, which jax keeps in insertion order."
            ) from error


def _unsortable(node: Any, where: str, seen: set[int]) -> tuple[str, list[Any]] | None:
    """The first dict (path, keys) in the containers and Modules of `node` whose keys
    do not sort."""
    if id(node) in seen:
        return None
    seen.add(id(node))
    if type(node) is dict or type(node).__name__ == "defaultdict":
        try:
            sorted(node)
        except TypeError:
            return where, list(node)
    if isinstance(node, dict):
        items: Iterable[tuple[str, Any]] = ((f"{where}[{k!r}]", v) for k, v in node.items())
    elif isinstance(node, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(node))
    elif _is_module(node):
        items = ((f"{where}.{k}", v) for k, v in vars(node).items())
    else:
        return None
    for w, v in items:
        found = _unsortable(v, w, seen)
        if found is not None:
            return found
    return None


def _is_module(node: Any) -> bool:
    from ._module import Module  # _module imports this module

    return isinstance(node, Module)
