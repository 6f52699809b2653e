"""Step 1 of the engine (`_engine`): a call's arguments as program inputs.

`Call` flattens the arguments once: array leaves are inputs (each object once,
`uniq`; for a gradient, once per positional argument: `_groups`), the treedef
and the other leaves key the cache, with the function's code (`root_key`).
`links` says which argument arrays a `tg.jit` function also captures.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Sequence
from typing import Any

import jax

from . import _kinds as K
from ._outputs import DYN, shared_nodes, uniq
from ._programs import CALL
from ._tree import value_key

_MEMO_BOUND = 512


def root_key(f: Any) -> Any:
    """What a function's cache entries are filed under: its code, for a function."""
    t = type(f)
    if t is types.FunctionType:
        return f.__code__
    if t is types.MethodType:
        return ("method", root_key(f.__func__), type(f.__self__))
    if t is K.JITTED_TYPE:
        return ("jit", root_key(getattr(f, "__wrapped__", None)))
    if isinstance(f, functools.partial):
        return ("partial", root_key(f.func))
    return t


class Call:
    """The roots (the function, and for `tg.jit` callable arguments) and the flat arguments."""

    __slots__ = (
        "a_bare",
        "a_def",
        "a_shared",
        "a_slots",
        "a_statics",
        "a_uniq",
        "groups",
        "key",
        "roots",
    )

    def __init__(self, program: str, options: Any, roots: tuple[Any, ...], args: Any):
        self.roots = roots
        leaves, a_def = jax.tree_util.tree_flatten(args)
        self.a_def: Any = a_def  # jaxlib's stub lacks PyTreeDef's children and num_leaves
        if K.ARRAY_TYPES.issuperset(map(type, leaves)) or all(map(K.is_array, leaves)):
            arrays = leaves
            self.a_statics: Any = None
        else:
            arrays = [x for x in leaves if K.is_array(x)]
            # The values themselves, which the traced function receives; the key
            # holds a hashable stand-in for an unhashable one (a set, a dataclass).
            self.a_statics = tuple(DYN if K.is_array(x) else x for x in leaves)
        self.groups = _groups(program, a_def, self.a_statics)
        self.a_uniq, self.a_slots = uniq_in_groups(arrays, self.groups)
        # A sub-model at two places holds its arrays at both, so arguments without
        # repeated arrays share one only where it holds none (`bare`): then which (the
        # trace shares it again).
        self.a_bare = has_bare_nodes(a_def)
        share = self.a_slots is not None or self.a_bare
        self.a_shared = shared_nodes(args) if share else None
        typed = None if self.a_statics is None else _static_key(self.a_statics)
        self.key = (
            program,
            options,
            root_keys(roots),
            self.a_def,
            typed,
            self.a_slots,
            self.a_shared,
        )


_BARE: dict[Any, bool] = {}  # cleared with the other memos (_cache.MEMOS)


def has_bare_nodes(treedef: Any) -> bool:
    """Whether the structure has a node that could be shared without an array showing
    it: a Module, list or dict holding no array (a Module of static data only). A
    shared node holding arrays repeats them, which the ties of the arrays reveal."""
    bare = _BARE.get(treedef)
    if bare is None:
        if len(_BARE) >= _MEMO_BOUND:
            _BARE.clear()
        bare = _BARE[treedef] = _bare(treedef)
    return bare


# None and tuples are never shared objects (`shared_nodes`); an empty dict or list is
# left out too: every call's keyword arguments are one, made afresh.
_NOT_BARE = (tuple, type(None))


def _bare(treedef: Any) -> bool:
    stack = [treedef]
    while stack:
        td = stack.pop()
        data = td.node_data()
        if (
            data is not None
            and td.num_leaves == 0
            and not issubclass(data[0], _NOT_BARE)
            and (td.num_nodes > 1 or data[0] not in (dict, list))
        ):
            return True
        stack.extend(td.children())
    return False


def _static_key(statics: tuple[Any, ...]) -> Any:
    try:
        hash(statics)
        return value_key(statics)
    except TypeError:
        return tuple(value_key(s) if _hashable(s) else _unhashable_key(s) for s in statics)


def _unhashable_key(s: Any) -> Any:
    """An unhashable static leaf: by identity and by its text, so that an edit in
    place (a set gaining an element) traces again; never stale, perhaps retraced."""
    return ("<unhashable>", type(s), id(s), repr(s))


_GROUPS: dict[Any, tuple[int, ...]] = {}


def _groups(program: str, a_def: Any, statics: tuple[Any, ...] | None) -> tuple[int, ...] | None:
    """For a gradient program: the positional argument each array leaf belongs to.

    An array passed as two arguments is two inputs, each differentiated on its
    own (as `jax.grad` with several `argnums`); within one argument it is a tied
    weight. `tg.jit` keeps one input per array object.
    """
    if program == CALL:
        return None
    key = (a_def, None if statics is None else tuple(st is DYN for st in statics))
    groups = _GROUPS.get(key)
    if groups is None:
        per_leaf = [g for g, child in enumerate(a_def.children()) for _ in range(child.num_leaves)]
        if statics is not None:
            per_leaf = [g for g, st in zip(per_leaf, statics, strict=True) if st is DYN]
        if len(_GROUPS) >= _MEMO_BOUND:
            _GROUPS.clear()
        groups = _GROUPS[key] = tuple(per_leaf)
    return groups


def uniq_in_groups(
    xs: list[Any], groups: tuple[int, ...] | None
) -> tuple[list[Any], tuple[int, ...] | None]:
    """`uniq`, with an object repeated in two groups kept once per group."""
    out, slots = uniq(xs)
    if slots is None or groups is None or len(set(groups)) < 2:
        return out, slots
    first: dict[tuple[int, int], int] = {}
    out = []
    new: list[int] = []
    for x, g in zip(xs, groups, strict=True):
        k = first.setdefault((g, id(x)), len(out))
        if k == len(out):
            out.append(x)
        new.append(k)
    return out, (None if len(out) == len(xs) else tuple(new))


def root_keys(roots: tuple[Any, ...]) -> Any:
    return tuple(map(root_key, roots)) if len(roots) > 1 else root_key(roots[0])


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


_DTYPE = operator.attrgetter("dtype")
# A jax array's `dtype` is a Python property that reads `aval.dtype`; reading that
# directly skips one Python call per array (34 arrays: 2.2 us to 1.2 us a call).
_AVAL_DTYPE = operator.attrgetter("aval.dtype")


def dtypes(xs: Sequence[Any]) -> tuple[Any, ...]:
    """The dtype of each array (jax or numpy, concrete or traced)."""
    try:
        return tuple(map(_AVAL_DTYPE, xs))
    except AttributeError:  # a numpy array among them: no aval
        return tuple(map(_DTYPE, xs))


def links(cl_uniq: list[Any], a_uniq: list[Any]) -> tuple[int, ...] | None:
    """For each argument array, the position of the same object among the closure's
    arrays (-1 if none); None when they share none (checked in C on every call)."""
    if not cl_uniq or not a_uniq or set(map(id, a_uniq)).isdisjoint(map(id, cl_uniq)):
        return None
    where = {id(x): k for k, x in enumerate(cl_uniq)}
    return tuple(where.get(id(a), -1) for a in a_uniq)
