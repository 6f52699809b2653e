"""Reading and rebinding leaves of mutable containers by key path.

Implicit mode and `tg.update_` change a model in place by rebinding the new
arrays where the old ones lived: a Module attribute, a dict entry, a list item.
Tuples (and NamedTuples) are immutable, so a leaf inside one is replaced by
rebuilding the tuple and rebinding it in its own parent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ._tree import path_str


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, GetAttrKey):
        return getattr(node, key.name)
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
        try:
            setattr(node, key.name, value)
        except (AttributeError, dataclasses.FrozenInstanceError):
            # Frozen dataclass-style models (e.g. equinox) refuse setattr;
            # object.__setattr__ is how their own tree_at-style helpers write.
            object.__setattr__(node, key.name, value)
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
