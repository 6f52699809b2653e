"""Matching a checkpoint's records with the tree `like` that `tg.load` fills.

`match(manifest, like)` pairs the leaf records (`_manifest.py`) with the leaves
of `like`, naming the first path whose structure, shape, dtype or tying
differs, and saying why when it can: containers of another type, keys that
print alike, an optimiser state set up with another rule or sub-state rules.
Apart from the records and their text form because it is the load-side check
of a tree against another, with its own messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._manifest import (
    LeafRecord,
    Manifest,
    _is_key,
    _value_type,
    check_concrete,
    check_no_leaf_view,
    check_not_params,
    container_names,
    describe_array,
    display,
    is_array,
    leaves_with_keys,
)
from ._tree import functor

# What jax.eval_shape makes of a Python number: a scalar ShapeDtypeStruct of
# this kind of dtype (weakly typed, but for bool).
_SCALAR_KINDS: dict[str, type] = {
    "bool": np.bool_,
    "int": np.signedinteger,
    "float": np.floating,
    "complex": np.complexfloating,
}


@dataclass(frozen=True)
class Target:
    """Where stored array `array` goes: the `like` leaf that decides its type and sharding."""

    array: int
    leaf: Any


def match(
    m: Manifest, like: Any, where: str, api: str = "tg.load"
) -> tuple[list[Target | LeafRecord | None], Callable[[list[Any]], Any]]:
    """Pair each leaf of `like` with the manifest; raise ValueError at the first difference.

    Returns one entry per leaf of `like` (a `Target` for an array, the record
    for a saved Python value, None to keep `like`'s leaf) and a function that
    rebuilds `like`'s structure from new leaves.
    """
    check_no_leaf_view(like, api)
    saved = {r.keys: r for r in m.leaves}
    out: list[Target | LeafRecord | None] = []
    owner: dict[int, tuple[str, int]] = {}  # id of a like array -> (first path, its array)
    used: set[tuple[str, ...]] = set()
    containers = container_names(like)
    for (keys, path, leaf), inside in zip(leaves_with_keys(like), containers, strict=True):
        check_not_params(leaf, path, api)
        r = saved.get(keys)
        name = display(path)
        if r is None:
            raise _missing(m, keys, inside, leaf, name, where, api)
        used.add(keys)
        if _is_saved_python_scalar(leaf, r):
            out.append(r)  # the saved Python number, as the tree that was saved held it
        elif is_array(leaf):
            check_concrete(leaf, path, api)
            if r.kind != "array":
                raise ValueError(
                    f"{api}: '{name}' is an array ({describe_array(leaf)}) in the model but a "
                    f"{r.type} in the checkpoint {where}."
                )
            assert r.array is not None  # parse guarantees it for kind "array"
            a = m.arrays[r.array]
            if tuple(leaf.shape) != a.shape or str(leaf.dtype) != a.dtype:
                raise ValueError(
                    f"{api}: '{name}' is {describe_array(leaf)} in the model but "
                    f"{a.dtype}{list(a.shape)} in the checkpoint {where}."
                )
            _check_representable(leaf, name, where, api)
            if isinstance(leaf, (jax.Array, np.ndarray)):
                first, array = owner.setdefault(id(leaf), (name, r.array))
                if array != r.array:
                    raise ValueError(
                        f"{api}: '{name}' and '{first}' are one (tied) array in the model but "
                        f"two different arrays in the checkpoint {where}; load into a model "
                        "built without that tie."
                    )
            out.append(Target(r.array, leaf))
        elif r.kind == "array":
            raise ValueError(
                f"{api}: '{name}' is a {type(leaf).__name__} in the model but an array "
                f"({m.arrays[r.array or 0].dtype}{list(m.arrays[r.array or 0].shape)}) in the "
                f"checkpoint {where}."
            )
        elif r.kind == "value":
            if _value_type(leaf) != r.type:
                raise ValueError(
                    f"{api}: '{name}' is a {type(leaf).__name__} in the model but a {r.type} "
                    f"({r.value!r}) in the checkpoint {where}."
                )
            out.append(r)
        else:
            out.append(None)
    extra = [r for r in m.leaves if r.keys not in used]
    if extra:
        path = display(extra[0].path)
        hint = "Load into a model built like the one that was saved."
        if _STATE in (extra[0].containers or ()) and ":" not in path:
            hint = (
                "It is an entry of a saved optimiser state: the optimiser rule in `like` "
                "differs from the one the state was saved with. Load into "
                "tg.setup(rule, model) with the rule that was saved."
            )
        elif ":" in path:
            # Named `sub.model:...`: a sub-state that had a rule or hyperparameters of
            # its own when saved; a fresh tg.setup has not (yet).
            hint = (
                f"It is an entry of the sub-state '{path.split(':')[0]}', which had a rule or "
                "hyperparameters of its own when saved (state[...] = rule, or tg.adjust_ of a "
                "sub-state): set the fresh state up the same way before loading into it."
            )
        raise ValueError(
            f"{api}: the checkpoint {where} has '{path}', which the model lacks. {hint}"
        )
    return out, lambda new: _rebuild_keeping_shared(like, new)


def _check_representable(leaf: Any, name: str, where: str, api: str) -> None:
    """A jax-bound `like` leaf (a ShapeDtypeStruct, say) of a 64-bit dtype with jax's
    x64 off: restored as a jax.Array it would silently come back 32-bit (an int64
    step count of 2**40 + 3 loaded as 3, float64 values rounded), not the dtype
    `like` asks for and the file holds. A numpy leaf is restored exactly as numpy."""
    if isinstance(leaf, (np.ndarray, np.generic)) or _is_key(leaf.dtype):
        return
    dtype = np.dtype(leaf.dtype)
    if jax.dtypes.canonicalize_dtype(dtype) == dtype:
        return
    raise ValueError(
        f"{api}: '{name}' is {describe_array(leaf)} in `like` and in the checkpoint {where}, "
        f"but jax's 64-bit types are off (jax_enable_x64), so as a jax.Array it would be "
        f"truncated to {jax.dtypes.canonicalize_dtype(dtype)}. Enable x64 "
        '(jax.config.update("jax_enable_x64", True)) before loading, or give a numpy array '
        "at that place of `like` (np.zeros(shape, dtype)) to load it as numpy."
    )


def _rebuild_keeping_shared(like: Any, new: list[Any]) -> Any:
    """`like`'s structure with leaves `new`, a node held at several places of `like`
    (the same Dense twice in a Chain) again one object at those places.

    `jax.tree_util.tree_unflatten` would build a copy per place: the loaded model's
    layers would come apart (an edit of one no longer seen by the other), where the
    model that was saved, and the one that `tg.update` returns, hold one object. A
    repeat is shared only when its loaded leaves are the very objects of the first
    place (the tie check of `match` makes that so for arrays); otherwise it stays a
    copy of its own, as before.
    """
    # Keyed by id, holding the node: a foreign pytree may flatten to temporary
    # children, whose ids could otherwise be reused during the walk.
    memo: dict[int, tuple[Any, list[Any], Any]] = {}
    pos = 0

    def go(node: Any) -> Any:
        nonlocal pos
        level = functor(node)
        if level is None:
            pos += 1
            return new[pos - 1]
        start = pos
        built = level[1]([go(child) for _, child in level[0]])
        mine = new[start:pos]
        # None is one object wherever it is; an immutable tuple held twice cannot be
        # told from two equal ones (as `shares_nodes`).
        if node is None or isinstance(node, tuple):
            return built
        seen = memo.get(id(node))
        if seen is None:
            memo[id(node)] = (node, mine, built)
        elif len(seen[1]) == len(mine) and all(map(_same_leaf, seen[1], mine)):
            return seen[2]
        return built

    result = go(like)
    assert pos == len(new), (pos, len(new))
    return result


def _same_leaf(a: Any, b: Any) -> bool:
    """Whether two loaded leaves can be one node's: the same array (ties are checked by
    `match`), or equal Python values, which load as a new object at each place (a
    Module's float leaf saved once per place it is held). A checkpoint's other leaves
    are Python and numpy scalars, whose == answers a bool."""
    if a is b:
        return True
    if is_array(a) or is_array(b) or type(a) is not type(b):
        return False
    return bool(a == b)


def _is_saved_python_scalar(leaf: Any, r: LeafRecord) -> bool:
    """`leaf` is what `jax.eval_shape` makes of the Python number `r` saved."""
    kind = _SCALAR_KINDS.get(r.type or "") if r.kind == "value" else None
    return (
        kind is not None
        and isinstance(leaf, jax.ShapeDtypeStruct)
        and leaf.shape == ()
        and not _is_key(leaf.dtype)
        and bool(jnp.issubdtype(leaf.dtype, kind))
        # eval_shape marks Python numbers weakly typed (bools excepted): a
        # strongly typed scalar in `like` asks for an array, and gets an error.
        and (leaf.weak_type or kind is np.bool_)
    )


def _missing(
    m: Manifest,
    keys: tuple[str, ...],
    inside: tuple[str, ...],
    leaf: Any,
    name: str,
    where: str,
    api: str,
) -> ValueError:
    """The error for a leaf of `like` the checkpoint lacks, naming the containers if they differ."""
    differ = _container_difference(m, keys, inside)
    if differ is not None:
        at, ours, theirs = differ
        return ValueError(
            f"{api}: the containers differ: {at} is of type {ours} in the model but of type "
            f"{theirs} in the checkpoint {where} (so the model's '{name}' is not in it). Load "
            "into a model built like the one that was saved."
        )
    what = describe_array(leaf) if is_array(leaf) else type(leaf).__name__
    alike = next((r for r in m.leaves if r.path == name), None)
    if alike is not None:
        # Two keys that print alike in a dotted path ({1: x} and {"1": x}): show both.
        return ValueError(
            f"{api}: the model has {''.join(keys)} ({what}) but the checkpoint {where} has "
            f"{''.join(alike.keys)} there instead (the keys differ in type; both read "
            f"'{name}'). Load into a model built like the one that was saved."
        )
    if _STATE in inside:
        depth = inside.index(_STATE)
        saved = [r for r in m.leaves if r.keys[:depth] == keys[:depth]]
        if saved and all(_STATE in (r.containers or ()) for r in saved):
            held = ", ".join(f"'{_inner(r.path, depth)}'" for r in saved[:3])
            inner = _inner(name, depth)
            at = f" at '{name[: len(name) - len(inner) - 1]}'" if depth else ""
            return ValueError(
                f"{api}: the optimiser state{at} in `like` has '{inner}' "
                f"({what}) but the state in the checkpoint {where} does not (it has {held}"
                f"{', ...' if len(saved) > 3 else ''}): the optimiser rule differs from the "
                "one the state was saved with. Load into tg.setup(rule, model) with the rule "
                "that was saved (and the same sub-state rules and adjusts)."
            )
    return ValueError(
        f"{api}: the model has '{name}' ({what}) but the checkpoint {where} does not. "
        "Load into a model built like the one that was saved."
    )


_STATE = "OptState"  # the type name a state's leaves have above them in `containers`


def _inner(path: str, depth: int) -> str:
    """A state leaf's name: its dotted path without the `depth` keys above the state."""
    return path.split(".", depth)[-1] if depth else path


def _container_difference(
    m: Manifest, keys: tuple[str, ...], inside: tuple[str, ...]
) -> tuple[str, str, str] | None:
    """(where, model's type, checkpoint's type) of the first container on `keys`'s path
    whose type differs from the saved leaf sharing the longest key prefix, if any."""
    best: LeafRecord | None = None
    depth = -1
    for r in m.leaves:
        n = _common_prefix(r.keys, keys)
        if r.containers is not None and n > depth:
            best, depth = r, n
    if best is None or best.containers is None or depth >= min(len(keys), len(best.keys)):
        return None
    ours, theirs = inside[depth], best.containers[depth]
    if ours == theirs:
        return None
    at = f"the container at {''.join(keys[:depth])}" if depth else "the root"
    return at, ours, theirs


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
