"""Reading and rebinding leaves of mutable containers by key path.

Implicit mode and `tg.update_` change a model in place by rebinding the new
arrays where the old ones lived: a Module attribute, a dict entry, a list item.
Tuples (and NamedTuples) are immutable, so a leaf inside one is replaced by
rebuilding the tuple and rebinding it in its own parent.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ._module import Module
from ._module import _flatten as _module_flatten
from ._tree import path_str


def raw_value(node: Any, name: str) -> bool:
    """Whether attribute `name` of `node` is a flax nnx Variable's leaf: jax's key path
    names it `value`, a property whose getter and setter flax 0.12.10 deprecates (a
    DeprecationWarning on every use) for `get_raw_value`/`set_raw_value`, which read
    and write the leaf that the Variable's flatten gives. Read by duck type: flax is
    not imported here."""
    t = type(node)
    return (
        name == "value"
        and isinstance(getattr(t, "value", None), property)
        and callable(getattr(t, "set_raw_value", None))
        and callable(getattr(t, "get_raw_value", None))
    )


def get_attr(node: Any, name: str, *default: Any) -> Any:
    """`getattr(node, name, *default)`, an nnx Variable's leaf read as flatten reads it."""
    if raw_value(node, name):
        return node.get_raw_value()
    return getattr(node, name, *default)


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, GetAttrKey):
        return get_attr(node, key.name)
    if isinstance(key, SequenceKey):
        return node[key.idx]
    if isinstance(key, DictKey):
        return node[key.key]
    if isinstance(key, FlattenedIndexKey):
        raise TypeError(f"cannot address a child of {type(node).__name__} by flattened index")
    raise TypeError(f"unknown key {key!r}")


def _replaced(node: Any, key: Any, value: Any) -> Any:
    """`node` with child `key` set to `value`: the same object if it is mutable."""
    if isinstance(key, GetAttrKey):
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            # jax addresses a NamedTuple's children by GetAttrKey, but it is a tuple:
            # immutable, so rebuilt like one (setattr raised "can't set attribute" from
            # tg.params converting a numpy leaf in it, and from re-tying its outputs).
            # (isinstance narrowed it to `tuple`, which has no `_replace`: a NamedTuple's.)
            return node._replace(**{key.name: value})  # type: ignore[attr-defined]  # a NamedTuple's method
        try:
            if raw_value(node, key.name):
                node.set_raw_value(value)
            else:
                setattr(node, key.name, value)
        except (AttributeError, dataclasses.FrozenInstanceError):
            # Frozen dataclass-style models (e.g. equinox) refuse setattr;
            # object.__setattr__ is how their own tree_at-style helpers write.
            object.__setattr__(node, key.name, value)
        except Exception:  # a foreign setattr's own refusal (flax nnx: TraceContextError)
            if isinstance(node, Module):
                raise
            # A foreign pytree's setattr refusing for a reason of its own: flax nnx's
            # Variable, set inside a trace it was not made in (TraceContextError).
            # Its unflatten is the sanctioned way to build one: the node takes the
            # contents of a copy with the new child, and stays the same object.
            new = {id(leaf) for leaf in jax.tree_util.tree_leaves(value)}
            _take_contents(node, _with_child(node, key, value), new)
            _check_landed(node, new)  # the broad except above must not hide a no-op
        return node
    if isinstance(key, DictKey):
        node[key.key] = value
        return node
    if isinstance(key, SequenceKey):
        if isinstance(node, list):
            node[key.idx] = value
            return node
        if isinstance(node, tuple):
            items = list(node)
            items[key.idx] = value
            return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    raise TypeError(f"cannot set child {key!r} of {type(node).__name__}")


def get_at(root: Any, path: tuple[Any, ...]) -> Any:
    """The node at key path `path` inside `root`."""
    for key in path:
        root = _child(root, key)
    return root


def put_at(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    """`root` with the node at `path` set to `value`: in place where a mutable container
    holds it, rebuilding the tuples above it; returns the (possibly new) root."""
    if not path:
        return value
    child = _child(root, path[0])
    new = put_at(child, path[1:], value)
    return root if new is child else _replaced(root, path[0], new)


def set_at(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Rebind the leaf at `path` inside `root` to `value`, in place.

    Raises TypeError when the path runs through immutable containers all the
    way up to `root`, so there is nowhere to rebind.
    """
    if not path:
        raise TypeError("cannot rebind the root of a tree in place")
    nodes = [root]
    for key in path[:-1]:
        nodes.append(_child(nodes[-1], key))
    new = value
    for depth in range(len(path) - 1, -1, -1):
        parent = nodes[depth]
        updated = _replaced(parent, path[depth], new)
        if updated is parent:
            return
        if depth == 0:
            raise TypeError(
                f"cannot update '{path_str(path)}' in place: it lives in an immutable "
                f"{type(root).__name__}. Hold parameters in a tg.Module, a dict or a list, "
                "or use the pure tg.update."
            )
        new = updated


# Pytree types that replace their own leaves in place (an optimiser state): a
# function `(node, new_leaves) -> None`, faster and surer than rebinding by path.
IN_PLACE: dict[type, Callable[[Any, list[Any]], None]] = {}


def register_in_place(cls: type, set_leaves: Callable[[Any, list[Any]], None]) -> None:
    """Declare how to replace the leaves of a `cls` pytree node in place."""
    IN_PLACE[cls] = set_leaves


# Per treedef: generated code assigning new leaves where the old ones live (None:
# the tree has a place that cannot be assigned in place, such as a tuple). Built
# once per model structure, it makes tg.update_'s rebinding a few assignments.
_SETTERS: dict[Any, Any] = {}
_LAST: dict[str, Any] = {}  # the treedef rebound last (held, so `is` is safe), and its setter
_UNKNOWN = object()


def rebind(root: Any, changed: dict[int, Any], flat: tuple[list[Any], Any] | None = None) -> None:
    """Replace, in place, every leaf of `root` whose id is in `changed` by its new value.

    One walk over Modules, lists and dicts (using each Module's cached split
    into children), rebuilding tuples on the way back up; about the cost of one
    flatten. Foreign pytrees fall back to rebinding by key path. `flat`: the
    leaves and treedef of `root` when the caller has them, and every key of
    `changed` is the id of one of those leaves.
    """
    leaves, treedef = flat if flat is not None else jax.tree_util.tree_flatten(root)
    # The last treedef by identity first: an optimiser passes the same one every
    # step, and hashing a treedef calls back into Python once per Module.
    if _LAST.get("treedef") is treedef:
        setter = _LAST["setter"]
    else:
        setter = _SETTERS.get(treedef, _UNKNOWN)
        if setter is _UNKNOWN:
            from ._guardcode import tree_setter

            setter = _SETTERS[treedef] = tree_setter(root)
        _LAST.update(treedef=treedef, setter=setter)
    if setter is not None:
        ids = list(map(id, leaves))
        # Every changed array is among the leaves (the caller's word, or checked).
        if flat is not None or changed.keys() <= set(ids):
            setter(root, list(map(changed.get, ids)))
            return
    found: set[int] = set()
    if _rebind_node(root, changed, found) is not root:
        raise TypeError(
            f"cannot update a {type(root).__name__} in place: it is immutable. Hold parameters "
            "in a tg.Module, a dict or a list, or use the pure tg.update."
        )
    if len(found) != len(changed):
        # Never a silent no-op: an array we could not reach would keep its old value.
        raise TypeError(
            f"could not rebind {len(changed) - len(found)} parameter(s) inside the "
            f"{type(root).__name__} in place; use the pure tg.update and keep the model it returns."
        )


def rebind_value(value: Any, changed: dict[int, Any]) -> Any:
    """`value` with every leaf whose id is in `changed` replaced by its new value: as
    `rebind`, in place where `value` allows it, or a new tuple where it is one."""
    return _rebind_node(value, changed, set())


def _rebind_node(node: Any, changed: dict[int, Any], found: set[int]) -> Any:
    new = changed.get(id(node))
    if new is not None:
        found.add(id(node))
        return new
    if isinstance(node, Module):
        _, aux = _module_flatten(node)
        d = node.__dict__
        for name in aux.names:
            child = d[name]
            updated = _rebind_node(child, changed, found)
            if updated is not child:
                # An array replacing an array leaves the Module's split into
                # children and static data as it was, so keep its cache: a
                # setattr would make the next flatten re-derive it.
                d[name] = updated
        return node
    t = type(node)
    if t is list:
        for i, child in enumerate(node):
            updated = _rebind_node(child, changed, found)
            if updated is not child:
                node[i] = updated
        return node
    if t is dict:
        for k, child in node.items():
            updated = _rebind_node(child, changed, found)
            if updated is not child:
                node[k] = updated
        return node
    if isinstance(node, tuple):
        items = [_rebind_node(child, changed, found) for child in node]
        if all(a is b for a, b in zip(items, node, strict=True)):
            return node
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    if node is None or isinstance(node, (jax.Array, np.ndarray, *_OPAQUE)):
        return node
    set_leaves = IN_PLACE.get(t)
    if set_leaves is not None:
        leaves = jax.tree_util.tree_leaves(node)
        new_leaves = [changed.get(id(leaf), leaf) for leaf in leaves]
        found.update(id(a) for a, b in zip(leaves, new_leaves, strict=True) if a is not b)
        set_leaves(node, new_leaves)
        return node
    # A foreign pytree (an equinox module, say): rebind its leaves by path; a
    # node whose paths are not attributes or items takes the contents of a copy
    # rebuilt with the new leaves.
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(node)[0]
    hits = [(p, leaf) for p, leaf in leaves_with_paths if id(leaf) in changed and p]
    if not hits:
        return node
    try:
        for path, leaf in hits:
            set_at(node, path, changed[id(leaf)])
            found.add(id(leaf))
    except (TypeError, AttributeError, KeyError, IndexError):
        _become(node, changed, found)
    return node


def _become(node: Any, changed: dict[int, Any], found: set[int]) -> None:
    """Give `node` the new leaves, through a copy of itself rebuilt with them."""
    leaves, treedef = jax.tree_util.tree_flatten(node)
    new_leaves = []
    mine: set[int] = set()
    for leaf in leaves:
        new = changed.get(id(leaf))
        if new is not None:
            found.add(id(leaf))
            mine.add(id(new))
        new_leaves.append(leaf if new is None else new)
    copy = jax.tree_util.tree_unflatten(treedef, new_leaves)
    if isinstance(node, functools.partial) and type(copy) is type(node):
        # A jax.tree_util.Partial (a functools.partial) keeps its arguments in C slots,
        # not in attributes: `_take_contents` found nothing to take and the update was
        # a silent no-op (a trainable array in a Partial never changed). Its
        # __setstate__ replaces func, args and keywords in place.
        state: Any = copy.__reduce__()[2]
        # (typeshed's functools.partial declares __setstate__ only through __reduce__.)
        setstate: Any = node.__setstate__  # type: ignore[attr-defined]  # typeshed: no partial.__setstate__
        setstate(state)
    else:
        _take_contents(node, copy, mine)
    _check_landed(node, mine)


def _check_landed(node: Any, new: set[int]) -> None:
    """Never a silent no-op: a leaf that did not land would keep its old value."""
    if not new <= {id(leaf) for leaf in jax.tree_util.tree_leaves(node)}:
        raise TypeError(
            f"cannot update a {type(node).__name__} in place: its leaves are not held in "
            "attributes treegrad can rebind. Hold parameters in a tg.Module, a dict or a "
            "list, or use the pure tg.update."
        )


def _with_child(node: Any, key: Any, value: Any) -> Any:
    """A copy of the pytree `node`, built by its unflatten, with child `key` replaced."""
    children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if (key,) not in [p for p, _ in children]:
        raise TypeError(f"{type(node).__name__} has no child {key!r} to set")
    return jax.tree_util.tree_unflatten(treedef, [value if p == (key,) else c for p, c in children])


def _take_contents(node: Any, copy: Any, new: set[int]) -> None:
    """Give `node` the contents of `copy` (a new one of its type, holding the new leaves
    whose ids are `new`): the attributes that hold them, the others staying `node`'s
    own, since bookkeeping an unflatten makes afresh (flax nnx's trace state, made
    inside a trace) would be wrong outside. When that does not bring every new leaf
    in (a class that wraps its children), every attribute is taken."""
    if type(copy) is not type(node):
        raise TypeError(f"cannot update a {type(node).__name__} in place")

    def holds(x: Any) -> bool:
        return any(id(leaf) in new for leaf in jax.tree_util.tree_leaves(x))

    def attributes(obj: Any) -> list[tuple[str, Any, bool]]:
        # The instance dict itself, not through getattr: a class that forwards unknown
        # attributes (nnx's Variable, to its value) would hand back someone else's.
        out = []
        if type(obj).__dictoffset__:
            out += [(k, v, False) for k, v in object.__getattribute__(obj, "__dict__").items()]
        for klass in type(obj).__mro__:
            for name in vars(klass).get("__slots__", ()):
                if name not in ("__dict__", "__weakref__"):
                    try:
                        out.append((name, object.__getattribute__(obj, name), True))
                    except AttributeError:
                        continue
        return out

    def put(name: str, value: Any, slot: bool) -> None:
        if slot:
            object.__setattr__(node, name, value)
        else:
            object.__getattribute__(node, "__dict__")[name] = value

    taken = attributes(copy)
    for name, value, slot in taken:
        if holds(value):
            put(name, value, slot)
    now = {id(leaf) for leaf in jax.tree_util.tree_leaves(node)}
    if not new or not new <= now:
        for name, value, slot in taken:
            put(name, value, slot)


_OPAQUE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, str, int, float)
