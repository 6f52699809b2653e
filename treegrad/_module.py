"""`tg.Module`: mutable model classes that are JAX pytrees.

Every subclass is registered with `jax.tree_util` when it is defined, with key
paths (`GetAttrKey`), so `jax.tree_util` functions, `jax.jit` and treegrad's own
engine see through it. Which attributes are children is decided per instance at
flatten time: arrays (and the ShapeDtypeStructs standing for them), Modules and
containers holding them are children, everything else is static data carried
in the treedef. An assignment re-decides only the attribute assigned.
"""

from __future__ import annotations

import copy
import operator
import types
import weakref
from typing import Any, ClassVar

import jax
import numpy as np
from jax.tree_util import GetAttrKey

from ._tree import describe_leaf, is_differentiable, iterable_leaf, same_value

_ARRAY_TYPES: tuple[type, ...] = (jax.Array, np.ndarray)
# What `jax.eval_shape` puts where a model has arrays: a `like` for `tg.load` is
# a Module of these, and one assigned to it must take an array's place too.
_ARRAY_LIKE: tuple[type, ...] = (*_ARRAY_TYPES, jax.ShapeDtypeStruct)
# Python scalars, strings and functions are the common static attributes;
# checking their exact type first keeps flatten cheap (it runs on every call).
_SCALAR_TYPES = frozenset({int, float, complex, bool, str, bytes})


# Per-type verdicts: 0 static, 1 child, 2 look inside. Memoised because this
# runs for every attribute of every Module that is flattened without a cache.
_KIND: dict[type, int] = {type(None): 0, list: 2, tuple: 2, dict: 2, jax.ShapeDtypeStruct: 1}
_KIND.update(dict.fromkeys(_SCALAR_TYPES, 0))


def register_child_type(cls: type) -> None:
    """Declare that instances of `cls` are always pytree children of a Module."""
    _KIND[cls] = 1


def _kind(t: type, value: Any) -> int:
    kind = _KIND.get(t)
    if kind is None:
        # isinstance, not issubclass: tracers are jax.Arrays only by instance check.
        if isinstance(value, (*_ARRAY_TYPES, Module)):
            kind = 1
        elif issubclass(t, (list, tuple, dict)):
            kind = 2  # NamedTuples and other container subclasses
        elif isinstance(value, type) or (callable(value) and _is_leaf(value)):
            kind = 0  # functions; a callable pytree (an equinox layer) is decided below
        else:
            return 3  # foreign pytrees: decided by their leaves, not memoised
        _KIND[t] = kind
    return kind


def _only_scalars(values: Any) -> bool:
    """Whether every value is a Python number, string or None, by type (in C)."""
    return set(map(type, values)) <= _SCALARS_OR_NONE


_SCALARS_OR_NONE = frozenset({*_SCALAR_TYPES, type(None)})
# Types whose `==` is exact: a list of them is compared with one `==` (floats are not:
# -0.0 == 0.0, and NaN != NaN, which `same_value` keeps apart).
_EXACT_TYPES = frozenset({int, str, bytes, bool, type(None)})


def _is_leaf(value: Any) -> bool:
    return jax.tree_util.all_leaves([value])


def holds_arrays(value: Any) -> bool:
    """Whether a value holds arrays or ShapeDtypeStructs (so is a child, not static data)."""
    kind = _kind(type(value), value)
    if kind < 2:
        return kind == 1
    if kind == 2:
        values = value.values() if isinstance(value, dict) else value
        if _only_scalars(values):  # a vocabulary of 100k strings: one pass in C
            return False
        return any(holds_arrays(v) for v in values)
    leaves = jax.tree_util.tree_leaves(value, is_leaf=iterable_leaf)
    return not (len(leaves) == 1 and leaves[0] is value) and any(
        isinstance(leaf, _ARRAY_LIKE) for leaf in leaves
    )


class _Static:
    """Static attributes of a Module instance, as treedef aux data.

    Equality compares the values, so two models with the same functions and
    hyperparameters share a compiled function; unhashable static values (a list
    of strings, say) are allowed and hash by their type only. Mutable static
    values (a list, a dict, a config object) are compared through a snapshot
    taken when the Module was flattened, so editing them in place is seen.
    """

    __slots__ = ("_hash", "children", "items", "mutable", "names", "size", "snapshot", "static")

    def __init__(
        self,
        names: tuple[str, ...],
        items: tuple[tuple[str, Any], ...],
        owner: Module | None = None,
    ):
        self.names = names
        self.items = items
        self.static = dict(items)
        self.size = len(names) + len(items)
        self.mutable = not all(_frozen(v) for _, v in items)
        self.snapshot = tuple((k, _snapshot(v, owner)) for k, v in items) if self.mutable else items
        # Reads the children out of an instance __dict__ in C.
        if len(names) == 1:
            name = names[0]
            self.children: Any = lambda d: (d[name],)
        else:
            self.children = operator.itemgetter(*names) if names else lambda d: ()
        h: list[tuple[str, Any]] = []
        for k, v in items:
            try:
                h.append((k, hash(v)))
            except TypeError:
                h.append((k, type(v).__name__))
        self._hash = hash((names, tuple(h)))

    def holds(self, d: dict[str, Any]) -> bool:
        """Whether the static values are still the ones in `d` (the same objects).

        `Module.__setattr__` drops the cached split, but a value rebound past it
        (`m.__dict__["scale"] = 5.0`, `vars(m).update(...)`, `object.__setattr__` on a
        frozen dataclass Module, a subclass's `__setattr__` that skips super()) kept
        the old value in the split, and the rebuilt model (and the gradient) read it.
        """
        for k, v in self.items:  # noqa: SIM110 -- a loop: all() over a generator is ~2x slower
            if d.get(k, _Static) is not v:
                return False
        return True

    def __reduce__(self) -> tuple[type[_Static], tuple[Any, ...]]:
        # Rebuilt from what it was made of: `children` is a closure, which pickle
        # cannot write, and a Module keeps its split in `_tg_aux` (pickled with it,
        # so a Module built by unflatten keeps its children, whatever they hold).
        return _Static, (self.names, self.items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Static) or other._hash != self._hash:
            return False
        if self.names != other.names or len(self.items) != len(other.items):
            return False
        for (k1, v1), (k2, v2) in zip(self.snapshot, other.snapshot, strict=True):
            if k1 != k2 or not (v1 is v2 or _deep_equal(v1, v2)):
                return False
        return True


_FROZEN_TYPES = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    range,
    slice,
    type(Ellipsis),
    type,
    types.ModuleType,
    np.dtype,
    np.generic,
)


def _frozen(v: Any) -> bool:
    """Whether a static value cannot change in place (so comparing it once is enough)."""
    if isinstance(v, _FROZEN_TYPES) or callable(v):
        # Functions are compared by identity; what they read is guarded by the engine.
        return True
    if type(v) in (tuple, frozenset):
        return all(_frozen(x) for x in v)
    return False


class _Opaque:
    """A snapshot that could not be copied: compared by identity with the original."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj


def _snapshot(v: Any, owner: Module | None = None) -> Any:
    if _frozen(v):
        return v
    # The Module whose static data this is stays itself in the copy (a config object
    # holding the Module it configures): copied, its own arrays were compared as
    # static data, and they are tracers while the Module is traced ("the function
    # changes the static data of the M", a trace on every call). What the Module
    # holds is compared as its children and static data already.
    memo = {} if owner is None else {id(owner): owner}
    if type(v) is list and _only_scalars(v):
        return list(v)  # immutable items: a shallow copy is a deep one, and much faster
    if type(v) is dict and _only_scalars(v.values()) and _only_scalars(v):
        return dict(v)
    try:
        # Eagerly: a jax array inside static data (a config object holding one, or
        # holding this Module) is copied while a function is traced too, and the copy
        # staged into the trace made the array a constant of the jaxpr: "captured
        # through objects it cannot see into", and for a parameter an error.
        with jax.ensure_compile_time_eval():
            return copy.deepcopy(v, memo)
    except (TypeError, copy.Error, AttributeError, RecursionError):
        return _Opaque(v)


def _deep_equal(a: Any, b: Any, seen: set[tuple[int, int]] | None = None) -> bool:
    """Value equality that looks into plain objects (whose own `==` is identity).

    The two sides are snapshots (deep copies) of static data. Objects inside them
    that compare by identity are never the same object, so a class whose own `==`
    compares its fields with `==` (a dataclass, `SimpleNamespace`,
    `argparse.Namespace`) holding one is compared field by field too: else a
    Module holding such a config was never equal to itself, and implicit mode
    failed with "a new guard rejected its own function". `seen`: the pairs being
    compared, so a cycle through static data (a config holding its Module) ends.
    """
    if a is b:  # the Module owning the snapshots (`_snapshot`), a shared atomic value
        return True
    if type(a) is not type(b):
        return False
    if type(a) is _Opaque:
        return a.obj is b.obj
    if isinstance(a, (jax.Array, np.ndarray)):
        # An array inside static data (a plain object holding one): the snapshot is
        # a copy, so compare values; `==` on arrays has no truth value.
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    plain = not callable(a) and hasattr(a, "__dict__")
    if plain or type(a) in (list, tuple, dict):
        seen = set() if seen is None else seen
        if (id(a), id(b)) in seen:
            return True  # being compared further up: decided there
        seen.add((id(a), id(b)))
    if type(a) in (list, tuple):
        if len(a) != len(b):
            return False
        kinds = list(map(type, a))
        if set(kinds) <= _EXACT_TYPES:  # one `==` in C (`True == 1`: types compared too)
            return kinds == list(map(type, b)) and a == b
        return all(_deep_equal(x, y, seen) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_deep_equal(a[k], b[k], seen) for k in a)
    if plain:
        if type(a).__eq__ is not object.__eq__:
            try:
                if same_value(a, b):
                    return True
            except (TypeError, ValueError, RecursionError):
                pass  # an `==` that has no truth value, or recurses through a cycle
            if _slot_state(type(a)):
                return False  # state outside __dict__: its own `==` decides
        return _deep_equal(vars(a), vars(b), seen)
    try:
        return same_value(a, b)
    except (TypeError, ValueError, RecursionError):
        return False


def _slot_state(cls: type) -> bool:
    """Whether instances of `cls` keep state in slots (outside their __dict__)."""
    ignored = {"__dict__", "__weakref__", "_tg_aux"}
    for klass in cls.__mro__[:-1]:
        names = klass.__dict__.get("__slots__", ())
        names = (names,) if isinstance(names, str) else names
        if any(n not in ignored for n in names):
            return True
    return False


class _Edited:
    """Stands in the cache (`_tg_aux`) of a Module assigned to since its split was made.

    The next flatten re-derives the split, but only for the attributes assigned:
    the other children stay children whatever they hold. A Module built by
    unflatten may hold at its array places anything a tree_map put there
    (ShapeDtypeStructs, shardings, booleans of a filter spec); judged by value,
    those became static and the tree lost its leaves when an unrelated
    attribute was set. Never the same object as a `_Static`, so `_fasttree`'s
    identity check sees the edit.
    """

    __slots__ = ("assigned", "names")

    def __init__(self, names: tuple[str, ...], assigned: tuple[str, ...]):
        self.names = names  # the children before the assignments
        self.assigned = assigned

    def keeps(self, name: str, value: Any) -> bool:
        """Whether `name` stays a child although its value alone would make it static."""
        if name not in self.names:
            return False
        if name not in self.assigned:
            return True
        # A lone leaf of no static kind replacing a child (a sharding in a tree of
        # shardings) takes the child's place; a Python number or function does not.
        return _kind(type(value), value) == 3 and jax.tree_util.all_leaves((value,))


def _classify(
    d: dict[str, Any], edited: _Edited | None = None, owner: Module | None = None
) -> _Static:
    names = []
    static = []
    for k, v in d.items():
        # None is a child (an empty subtree) rather than static data, so that a
        # gradient tree, which has None where the model has a non-differentiable
        # array, keeps the model's structure. Empty lists and dicts are children
        # too, so layers appended to them later are seen.
        if (
            v is None
            or (type(v) in (list, dict) and not v)
            or holds_arrays(v)
            or (edited is not None and edited.keeps(k, v))
        ):
            names.append(k)
        else:
            static.append((k, v))
    return _Static(tuple(names), tuple(static), owner)


def _flatten(module: Module) -> tuple[tuple[Any, ...], _Static]:
    # The split into children and static data is cached on the instance and
    # dropped by __setattr__: re-deriving it cost ~3us per Module per call, the
    # largest share of treegrad's per-step overhead on small models.
    # A Module with mutable static data (a list, a dict, a config object) is
    # classified afresh each time: an edit in place must be seen, and a static
    # dict that gains an array must become a child. (It keeps its `_Edited`, so
    # the children an assignment did not touch stay children on every flatten.)
    d = module.__dict__
    try:
        aux = module._tg_aux
    except AttributeError:
        aux = None
    if type(aux) is not _Static or aux.size != len(d) or not aux.holds(d):
        edited = aux if type(aux) is _Edited else None
        aux = _classify(d, edited, module)
        if not aux.mutable:
            object.__setattr__(module, "_tg_aux", aux)
    return aux.children(d), aux


def _flatten_with_keys(module: Module) -> tuple[list[tuple[GetAttrKey, Any]], _Static]:
    children, aux = _flatten(module)
    return [(GetAttrKey(k), c) for k, c in zip(aux.names, children, strict=True)], aux


def _make_unflatten(cls: type) -> Any:
    new = object.__new__
    # Unflatten runs for every Module of every output tree; these shortcuts
    # (the slot's own setter, a prebuilt dict of static items) halve its cost.
    set_aux = _AUX_SLOT.__set__

    def unflatten(aux: _Static, children: Any) -> Module:
        obj: Module = new(cls)
        d = obj.__dict__
        d.update(zip(aux.names, children))  # noqa: B905 -- jax passes as many as names
        d.update(aux.static)
        set_aux(obj, aux)
        return obj

    return unflatten


class Module:
    """Base class for models: every instance is a mutable JAX pytree.

    Attributes holding arrays, Modules, or lists/tuples/dicts of them are the
    children of the pytree; everything else (functions, strings, numbers, None)
    is static data. Subclasses are registered with `jax.tree_util` automatically
    and may list the attributes the optimiser trains in `__trainable__`.

    Examples:
        >>> import jax, jax.numpy as jnp, treegrad as tg
        >>> class Affine(tg.Module):
        ...     def __init__(self):
        ...         self.w = jnp.ones((2, 3))
        ...         self.b = jnp.zeros(2)
        ...         self.act = jax.nn.relu
        ...     def __call__(self, x):
        ...         return self.act(self.w @ x + self.b)
        >>> m = Affine()
        >>> [x.shape for x in jax.tree_util.tree_leaves(m)]
        [(2, 3), (2,)]
        >>> m(jnp.ones(3))
        Array([3., 3.], dtype=float32)
    """

    __trainable__: ClassVar[tuple[str, ...] | None] = None
    # Outside __dict__, so it is neither an attribute of the model nor data.
    __slots__ = ("__weakref__", "_tg_aux")
    _tg_aux: _Static | _Edited | None

    def __setattr__(self, name: str, value: Any) -> None:
        if type(value) not in _LEAF_TYPES and _reaches(value, self):
            # A Module inside itself is an infinite tree: flattening it would
            # overflow the stack (and can take the interpreter down with it).
            raise ValueError(
                f"cannot set {type(self).__name__}.{name}: the value holds this "
                f"{type(self).__name__} itself, which would make the model a cycle (an "
                "infinite tree). Hold a reference outside the model, or hold a function "
                "that returns it."
            )
        object.__setattr__(self, name, value)
        _forget_split(self, name)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        _forget_split(self, name)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in _REGISTERED:
            # A parent's __init_subclass__ that skips super() never reached ours:
            # register here, before the first instance exists (unflattening builds
            # instances with object.__new__, so it never comes this way).
            _register(cls)
        return object.__new__(cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)

    def __repr__(self) -> str:
        return format_tree(self)


# Every registered Module class; a class reaches `Module.__new__` unregistered only
# when a parent's __init_subclass__ skipped super().
_REGISTERED: weakref.WeakSet[type] = weakref.WeakSet()


_DICT_SLOTS = frozenset({"__dict__", "__weakref__"})


def _register(cls: type) -> None:
    """Check a Module class's definition and register it with `jax.tree_util`."""
    if "__slots__" in cls.__dict__ and "__dict__" not in cls.__dict__["__slots__"]:
        # A Module's attributes are its __dict__ (children and static data alike).
        raise TypeError(
            f"{cls.__name__} defines __slots__: a tg.Module keeps its attributes in "
            "__dict__, which __slots__ removes. Drop __slots__ from the class."
        )
    slots = cls.__dict__.get("__slots__", ())
    extra = [n for n in ((slots,) if isinstance(slots, str) else slots) if n not in _DICT_SLOTS]
    if extra:
        # Beside __dict__: an array there was no child (no gradient, not trained), and
        # the model rebuilt by unflatten lacked it (an AttributeError in the loss).
        raise TypeError(
            f"{cls.__name__} defines __slots__ {tuple(extra)!r}: a tg.Module keeps its "
            "attributes in __dict__, and an attribute in a slot is not part of the model "
            "(no gradient, not trained, lost when the model is rebuilt). Drop those names "
            "from __slots__."
        )
    names = cls.__dict__.get("__trainable__")
    if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
        # ("wb") is the string "wb", which would be read as the names "w" and "b".
        raise TypeError(
            f"{cls.__name__}.__trainable__ must be a tuple of attribute names, got "
            f"{names!r}; write ({names!r},) for one name."
            if isinstance(names, str)
            else f"{cls.__name__}.__trainable__ must hold attribute names (strings), got {names!r}."
        )
    jax.tree_util.register_pytree_with_keys(
        cls, _flatten_with_keys, _make_unflatten(cls), flatten_func=_flatten
    )
    _REGISTERED.add(cls)


# The slot's descriptor: setting the cache through it skips attribute lookup.
_AUX_SLOT: Any = Module.__dict__["_tg_aux"]


_LEAF_TYPES = frozenset({*_SCALAR_TYPES, type(None)})


def _reaches(value: Any, target: Module) -> bool:
    """Whether `target` is `value` or inside it, through Modules and containers."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v is target:
            return True
        if id(v) in seen or type(v) in _LEAF_TYPES or isinstance(v, _ARRAY_TYPES):
            continue
        seen.add(id(v))
        if isinstance(v, Module):
            stack.extend(v.__dict__.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return False


def _forget_split(module: Module, name: str) -> None:
    """Drop the cached split after `name` was assigned or deleted."""
    # A Module never flattened (one in its __init__) has nothing to remember.
    # Through the slot: a user's __getattr__ (forwarding to a wrapped model) must not
    # run for it, before that model is assigned.
    try:
        aux = _AUX_SLOT.__get__(module)
    except AttributeError:
        aux = None
    if type(aux) is _Static:
        aux = _Edited(aux.names, (name,))
    elif aux is not None and name not in aux.assigned:
        # A new object: copy.copy shares the slot's value between two Modules.
        aux = _Edited(aux.names, (*aux.assigned, name))
    _AUX_SLOT.__set__(module, aux)


jax.tree_util.register_pytree_with_keys(
    Module, _flatten_with_keys, _make_unflatten(Module), flatten_func=_flatten
)
_REGISTERED.add(Module)


def format_tree(tree: Any, name: str | None = None) -> str:
    """Render a model as an indented tree with paths, shapes, dtypes and counts."""
    lines: list[str] = []
    _format(tree, name or type(tree).__name__, 0, lines)
    return "\n".join(lines)


def _count(tree: Any) -> int:
    """The parameters `tg.params` would collect: each array once (a tied weight is one),
    within `__trainable__`; a ShapeDtypeStruct counts as the array it stands for."""
    from ._paramsource import trainable_leaves_with_path  # it imports this module

    arrays = {
        id(leaf): leaf
        for _, leaf in trainable_leaves_with_path(tree)
        if is_differentiable(leaf)
        or (isinstance(leaf, jax.ShapeDtypeStruct) and np.issubdtype(leaf.dtype, np.inexact))
    }
    return sum(int(np.prod(leaf.shape)) for leaf in arrays.values())


def _format(node: Any, label: str, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    if isinstance(node, Module):
        head = label if label == type(node).__name__ else f"{label}: {type(node).__name__}"
        lines.append(f"{pad}{head}  # {_count(node):,} parameters")
        for k, v in node.__dict__.items():
            if holds_arrays(v):
                _format(v, k, depth + 1, lines)
            else:
                lines.append(f"{pad}  {k} = {_short(v)}")
    elif isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        lines.append(
            f"{pad}{label}: {type(node).__name__}[{len(node)}]  # {_count(node):,} parameters"
        )
        for i, v in enumerate(node):
            _format(v, str(i), depth + 1, lines)
    elif isinstance(node, dict):
        lines.append(f"{pad}{label}: dict  # {_count(node):,} parameters")
        for k, v in node.items():
            _format(v, str(k), depth + 1, lines)
    elif isinstance(node, _ARRAY_TYPES):
        lines.append(f"{pad}{label}: {describe_leaf(node)}")
    elif isinstance(node, jax.ShapeDtypeStruct):  # a model from jax.eval_shape
        shape = "×".join(map(str, node.shape))
        lines.append(
            f"{pad}{label}: {node.dtype}[{shape}]"
            if shape
            else f"{pad}{label}: {node.dtype} scalar"
        )
    elif node is None:
        lines.append(f"{pad}{label} = None")
    else:
        leaves = jax.tree_util.tree_leaves_with_path(node)
        if len(leaves) == 1 and leaves[0][1] is node:
            lines.append(f"{pad}{label} = {_short(node)}")
            return
        lines.append(f"{pad}{label}: {type(node).__name__}  # {_count(node):,} parameters")
        for path, leaf in leaves:
            key = jax.tree_util.keystr(path, simple=True, separator=".")
            lines.append(f"{pad}  {key}: {describe_leaf(leaf)}")


def _short(value: Any) -> str:
    name = getattr(value, "__name__", None)
    if callable(value) and name:
        return f"<function {name}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
