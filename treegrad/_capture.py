"""Closures as pytrees: the arrays a function captures become leaves.

`capture(fn)` turns a Python callable into a pytree whose leaves are what the
function reads from its closure cells, the globals its code names, its defaults,
and, recursively, the same for the user functions, bound methods, partials and
`jax.jit`-wrapped helpers it reaches. Flattening that tree each call gives the
engine fresh values of every captured array (so nothing is baked into a
compiled function as a stale constant) and a treedef to key the cache on: a new
lambda object with the same code and the same captured structure flattens to an
equal treedef.

`materialize(tree)` rebuilds a function from such a tree with other leaves (JAX
tracers while tracing): new closure cells and a copy of the globals dict holding
the substituted values. Only read values are captured; cells and globals the
code writes to (`nonlocal n; n += 1`) keep the user's own objects, so Python side
effects still reach the user.
"""

from __future__ import annotations

import dis
import functools
import types
from typing import Any

import jax

from ._module import holds_arrays

# Functions of these packages never close over user arrays; treating them as
# opaque static leaves keeps the walk short (a loss calling `optax.l2_loss`
# would otherwise walk optax's module globals on every call).
_LIBRARY_ROOTS = frozenset(
    {
        "jax",
        "jaxlib",
        "numpy",
        "optax",
        "equinox",
        "flax",
        "chex",
        "scipy",
        "builtins",
        "functools",
        "math",
        "operator",
        "typing",
        "collections",
        "torch",
    }
)

_MUTABLE_CONTAINERS = frozenset({list, dict, set})
_OPAQUE_TYPES = (types.ModuleType, type, types.BuiltinFunctionType, types.CodeType)


class _CodeInfo:
    """What a code object reads and writes, computed once per code object."""

    __slots__ = ("global_names", "writes_globals", "written_cells")

    def __init__(self, code: types.CodeType):
        names: dict[str, None] = {}
        written_globals = False
        written_cells: set[str] = set()
        stack = [code]
        while stack:
            c = stack.pop()
            names.update(dict.fromkeys(c.co_names))
            for ins in dis.get_instructions(c):
                if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                    written_globals = True
                elif ins.opname in ("STORE_DEREF", "DELETE_DEREF") and c is code:
                    written_cells.add(ins.argval)
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        self.global_names = tuple(names)
        self.writes_globals = written_globals
        self.written_cells = frozenset(written_cells)


_CODE_INFO: dict[types.CodeType, _CodeInfo] = {}


def _code_info(code: types.CodeType) -> _CodeInfo:
    info = _CODE_INFO.get(code)
    if info is None:
        info = _CODE_INFO[code] = _CodeInfo(code)
    return info


class _Spec:
    """Treedef aux data of a captured function: equal for equal code and layout.

    The function object itself rides along (excluded from equality) so that a
    rebuilt function gets the right globals dict and name.
    """

    __slots__ = ("_key", "fn")

    def __init__(self, fn: Any, key: tuple[Any, ...]):
        self.fn = fn
        self._key = key

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Spec) and self._key == other._key

    def __repr__(self) -> str:
        return f"<captured {getattr(self.fn, '__qualname__', self.fn)!r}>"


class ById:
    """A static leaf compared by identity: a mutable container the closure reads.

    Captured lists, dicts and sets that hold no arrays are passed through as
    the user's own objects (not copies), so side effects such as
    `calls.append(1)` or `counter[0] += 1` inside a traced loss reach the user,
    and mutating them does not force a re-trace.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ById) and other.obj is self.obj


class Captured:
    """A pytree node standing for a callable and everything it reads."""

    __slots__ = ("kind", "spec", "values")

    def __init__(self, kind: str, spec: _Spec, values: tuple[Any, ...]):
        self.kind = kind
        self.spec = spec
        self.values = values


def _flatten(node: Captured) -> tuple[tuple[Any, ...], tuple[str, _Spec]]:
    return node.values, (node.kind, node.spec)


def _unflatten(aux: tuple[str, _Spec], values: Any) -> Captured:
    return Captured(aux[0], aux[1], tuple(values))


jax.tree_util.register_pytree_node(Captured, _flatten, _unflatten)

_MISSING = object()


_LIBRARY_MODULES: dict[Any, bool] = {}


def _is_library(fn: Any) -> bool:
    mod = getattr(fn, "__module__", None)
    r = _LIBRARY_MODULES.get(mod)
    if r is None:
        r = _LIBRARY_MODULES[mod] = (
            not isinstance(mod, str) or mod.partition(".")[0] in _LIBRARY_ROOTS
        )
    return r


def _is_jitted(obj: Any) -> bool:
    return hasattr(obj, "__wrapped__") and hasattr(obj, "lower") and hasattr(obj, "trace")


# Types whose instances are plain objects worth walking (user classes that are
# not pytrees); decided once per type.
_OBJECT_KIND: dict[type, bool] = {}


def _walkable_object(obj: Any) -> bool:
    t = type(obj)
    kind = _OBJECT_KIND.get(t)
    if kind is None:
        kind = (
            hasattr(obj, "__dict__")
            and not _is_library(t)
            and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(obj))
        )
        _OBJECT_KIND[t] = kind
    return kind


_PASS, _FUNCTION, _CONTAINER, _METHOD, _PARTIAL, _JITTED, _OBJECT = range(7)
# What to do with a value, decided once per type: the walk runs on every call,
# and type dispatch keeps it to one dict lookup for the common leaves.
_TYPE_KIND: dict[type, int] = {t: _PASS for t in (int, float, bool, str, bytes, type(None))}


def _type_kind(obj: Any) -> int:
    t = type(obj)
    if t is types.FunctionType:
        kind = _FUNCTION
    elif isinstance(obj, (jax.Array, *_OPAQUE_TYPES)):
        kind = _PASS
    elif t in _MUTABLE_CONTAINERS:
        kind = _CONTAINER
    elif t is types.MethodType:
        kind = _METHOD
    elif isinstance(obj, functools.partial):
        kind = _PARTIAL
    elif _is_jitted(obj):
        kind = _JITTED
    elif _walkable_object(obj):
        kind = _OBJECT
    else:
        kind = _PASS
    _TYPE_KIND[t] = kind
    return kind


def capture(obj: Any, _stack: frozenset[int] = frozenset(), _depth: int = 0) -> Any:
    """Convert a callable (or a value it reads) into a pytree of what it captures.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> W = jnp.ones(3)
        >>> f = lambda x: jnp.sum(W * x)
        >>> leaves = jax.tree_util.tree_leaves(capture(f))
        >>> [leaf is W for leaf in leaves if isinstance(leaf, jax.Array)]
        [True]
    """
    kind = _TYPE_KIND.get(type(obj))
    if kind is None:
        kind = _type_kind(obj)
    if kind == _PASS:
        return obj
    if kind == _FUNCTION:
        if _is_library(obj) or id(obj) in _stack:
            return obj
        return _capture_function(obj, _stack | {id(obj)}, _depth)
    if kind == _CONTAINER:
        return obj if holds_arrays(obj) else ById(obj)
    if kind == _METHOD:
        self_ = capture(obj.__self__, _stack, _depth)
        func = capture(obj.__func__, _stack, _depth)
        return Captured("method", _Spec(obj, ()), (self_, func))
    if kind == _PARTIAL:
        parts = (
            capture(obj.func, _stack, _depth),
            tuple(capture(a, _stack, _depth) for a in obj.args),
            {k: capture(v, _stack, _depth) for k, v in obj.keywords.items()},
        )
        return Captured("partial", _Spec(obj, ()), parts)
    if kind == _JITTED and isinstance(obj.__wrapped__, types.FunctionType):
        inner = obj.__wrapped__
        if _is_library(inner) or id(inner) in _stack:
            return obj
        # Inlined while tracing: the outer jit compiles it anyway, and unwrapping
        # lets the arrays the helper captures become inputs like any other.
        return Captured("jitted", _Spec(obj, ()), (capture(inner, _stack, _depth),))
    if kind == _OBJECT and _depth < 4:
        items = tuple(obj.__dict__.items())
        keys = tuple(k for k, _ in items)
        values = tuple(capture(v, _stack, _depth + 1) for _, v in items)
        return Captured("object", _Spec(obj, (type(obj), keys)), values)
    return obj


def _capture_function(fn: types.FunctionType, stack: frozenset[int], depth: int) -> Captured:
    code = fn.__code__
    info = _code_info(code)
    g = fn.__globals__
    cells = fn.__closure__ or ()
    cell_values: list[Any] = []
    cell_kinds = []
    for name, cell in zip(code.co_freevars, cells, strict=True):
        if name in info.written_cells:
            cell_kinds.append(False)
            cell_values.append(None)
            continue
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell: a name not assigned yet
            cell_kinds.append(False)
            cell_values.append(None)
            continue
        cell_kinds.append(True)
        cell_values.append(capture(value, stack, depth))
    if info.writes_globals:
        names: tuple[str, ...] = ()
        gvalues: list[Any] = []
    else:
        present = [(n, g[n]) for n in info.global_names if n in g]
        names = tuple(n for n, _ in present)
        gvalues = [capture(v, stack, depth) for _, v in present]
    defaults = fn.__defaults__ or ()
    kwdefaults = fn.__kwdefaults__ or {}
    values = (
        tuple(cell_values),
        tuple(gvalues),
        tuple(capture(d, stack, depth) for d in defaults),
        {k: capture(v, stack, depth) for k, v in kwdefaults.items()},
    )
    key = (code, id(g), tuple(cell_kinds), names, len(defaults))
    return Captured("function", _Spec(fn, key), values)


def materialize(obj: Any) -> Any:
    """Rebuild the callable (or value) that `capture` converted, from its leaves."""
    if not isinstance(obj, Captured):
        return obj.obj if isinstance(obj, ById) else obj
    kind, fn, values = obj.kind, obj.spec.fn, obj.values
    if kind == "function":
        cell_values, gvalues, defaults, kwdefaults = values
        cells = []
        for cell, value, kept in zip(
            fn.__closure__ or (), cell_values, obj.spec._key[2], strict=True
        ):
            cells.append(types.CellType(materialize(value)) if kept else cell)
        names = obj.spec._key[3]
        if names:
            g = dict(fn.__globals__)
            g.update(zip(names, map(materialize, gvalues), strict=True))
        else:
            g = fn.__globals__
        new = types.FunctionType(
            fn.__code__,
            g,
            fn.__name__,
            tuple(map(materialize, defaults)) or None,
            tuple(cells) or None,
        )
        new.__kwdefaults__ = {k: materialize(v) for k, v in kwdefaults.items()} or None
        new.__qualname__ = fn.__qualname__
        new.__dict__.update(fn.__dict__)
        return new
    if kind == "method":
        return types.MethodType(materialize(values[1]), materialize(values[0]))
    if kind == "partial":
        func, args, kwargs = values
        return functools.partial(
            materialize(func),
            *map(materialize, args),
            **{k: materialize(v) for k, v in kwargs.items()},
        )
    if kind == "jitted":
        return materialize(values[0])
    if kind == "object":
        new = object.__new__(type(fn))
        new.__dict__.update(zip(obj.spec._key[1], map(materialize, values), strict=True))
        return new
    raise AssertionError(kind)


def describe(fn: Any) -> str:
    """A short readable name for a callable, for messages."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    code = getattr(fn, "__code__", None)
    if name and code is not None:
        return f"{name} ({code.co_filename}:{code.co_firstlineno})"
    return name or type(fn).__name__
