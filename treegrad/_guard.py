"""Guards: where a function reads its values from, checked on every call.

When the engine compiles a function, `walk` visits everything the function
can read: its closure cells, the globals its code names, its defaults, and,
recursively, the user functions, methods, partials, `jax.jit` helpers,
containers, objects, classes and modules it reaches. The result is a tree of
`Node`s that remembers, for each place, what was there: an array (a *place*,
numbered in walk order), a number or string (checked by value), a library
object (checked by identity), or a container to descend into.

A cache hit then runs the node tree as a *guard*: straight-line Python
generated once per entry (`_guardcode.py`), the way TorchDynamo guards compiled
frames, which re-reads every place from the function being called, checks each
non-array value and collects the arrays in place order. So every value the
function reads is fresh, and the hit path builds no trees. A failed check means
the entry does not apply and the engine re-traces.

The same tree drives tracing (`_swap.py`): tracers are put into the places (the
user's own containers, cells and globals) while the function is traced, what
the function rebinds there is recorded (an in-place update inside a compiled
step), and everything is put back. So the function runs against its real
objects, identity and side effects included, exactly as it would uncompiled.

Nodes hold no user arrays and no user containers: code objects, treedefs,
library objects, weak references to user classes and functions, and values of
numbers and strings only.
"""

from __future__ import annotations

import dis
import enum
import functools
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ._module import Module

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()

# Packages whose code never reads user arrays through its own globals: values
# from them are checked by identity and never walked into. Everything else,
# including code made by `exec` without a module name, is user code.
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
        "torch",
        "tqdm",
        "matplotlib",
        "orbax",
        "ml_dtypes",
        "opt_einsum",
        "einops",
        "jaxtyping",
        "typing_extensions",
        "treegrad",
        *sys.stdlib_module_names,
    }
)
# treegrad's own applications are user code: they show what a user's script does.
_APPLICATIONS = frozenset({"treegrad._bench", "treegrad._demo"})

_CONST_TYPES = frozenset(
    {int, float, complex, bool, str, bytes, type(None), type(Ellipsis), range, slice}
)
_ARRAY_TYPES: set[type] = set()
_NOT_ARRAY_TYPES: set[type] = set()


def is_array(x: Any) -> bool:
    """A dynamic input: a `jax.Array` (tracers included) or a numpy array."""
    t = type(x)
    if t in _ARRAY_TYPES:
        return True
    if t in _NOT_ARRAY_TYPES:
        return False
    r = isinstance(x, (jax.Array, np.ndarray))
    (_ARRAY_TYPES if r else _NOT_ARRAY_TYPES).add(t)
    return r


_LIBRARY_MODULES: dict[Any, bool] = {}


def is_library_module(name: Any) -> bool:
    r = _LIBRARY_MODULES.get(name)
    if r is None:
        r = _LIBRARY_MODULES[name] = (
            isinstance(name, str)
            and name not in _APPLICATIONS
            and (name.partition(".")[0] in _LIBRARY_ROOTS or _installed(name))
        )
    return r


def _installed(name: str) -> bool:
    """A module of an installed package (site-packages): library code, not the user's."""
    module = sys.modules.get(name.partition(".")[0])
    path = getattr(module, "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path


def _is_library(obj: Any) -> bool:
    """Library code: defined in a file of a library package (not a doctest or `exec`)."""
    if not is_library_module(getattr(obj, "__module__", None)):
        return False
    # Doctests run in a copy of the library module's namespace: their code is user code.
    if type(obj) is types.FunctionType:
        return not obj.__code__.co_filename.startswith("<doctest")
    if isinstance(obj, type):
        r = _LIBRARY_CLASSES.get(obj)
        if r is None:
            r = _LIBRARY_CLASSES[obj] = not any(
                (fn := _code_of(v)) is not None and fn.__code__.co_filename.startswith("<doctest")
                for v in vars(obj).values()
            )
        return r
    return True


_LIBRARY_CLASSES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


class _CodeInfo:
    """The global names and attribute names a code object (and its nested code) reads."""

    __slots__ = ("attrs", "globals")

    def __init__(self, code: types.CodeType):
        names: dict[str, None] = {}
        attrs: set[str] = set()
        stack = [code]
        while stack:
            c = stack.pop()
            for ins in dis.get_instructions(c):
                if ins.opname in ("LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"):
                    names[ins.argval] = None
                elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "LOAD_SUPER_ATTR"):
                    attrs.add(ins.argval)
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        self.globals = tuple(names)
        self.attrs = frozenset(attrs)


_CODE_INFO: dict[types.CodeType, _CodeInfo] = {}


def code_info(code: types.CodeType) -> _CodeInfo:
    info = _CODE_INFO.get(code)
    if info is None:
        info = _CODE_INFO[code] = _CodeInfo(code)
    return info


_JITTED_TYPE = type(jax.jit(lambda: None))
_PYTREE_NODE: dict[type, bool] = {}


def _is_pytree_node(x: Any) -> bool:
    """Whether `x` is a registered pytree node (a Module, an equinox module, a state...)."""
    t = type(x)
    r = _PYTREE_NODE.get(t)
    if r is None:
        try:
            r = isinstance(x, Module) or not jax.tree_util.treedef_is_leaf(
                jax.tree_util.tree_structure(x)
            )
        except (TypeError, ValueError):  # a pytree that cannot flatten this value (unsortable keys)
            return False
        _PYTREE_NODE[t] = r
    return r


def clear() -> None:
    """Forget every memo (`tg.clear_cache`)."""
    _CODE_INFO.clear()
    _PYTREE_NODE.clear()
    _SLOT_NAMES.clear()
    _LIBRARY_MODULES.clear()
    _LIBRARY_CLASSES.clear()
    _ARRAY_TYPES.clear()
    _NOT_ARRAY_TYPES.clear()


# --- the node tree ------------------------------------------------------------


class Node:
    """What was found at one place; subclasses say how to check and rebind it."""

    __slots__ = ()


class Array(Node):
    """A dynamic input: place number `place` of the walk."""

    __slots__ = ("place",)

    def __init__(self, place: int):
        self.place = place


class Const(Node):
    """A number, string or other immutable value, checked by value."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class Same(Node):
    """A library object (function, module, class, instance), checked by identity."""

    __slots__ = ("ref", "weak")

    def __init__(self, obj: Any):
        try:
            self.ref: Any = weakref.ref(obj)
            self.weak = True
        except TypeError:
            self.ref = obj
            self.weak = False

    def get(self) -> Any:
        return self.ref() if self.weak else self.ref


class Unchecked(Node):
    """A value the function itself changes while it is traced (a counter): not an input."""

    __slots__ = ()


class Alias(Node):
    """A container, object or function already reached by another route: the same object."""

    __slots__ = ("target",)

    def __init__(self, target: Node):
        self.target = target


class Seq(Node):
    __slots__ = ("items", "type")

    def __init__(self, typ: type, items: list[Node]):
        self.type: Any = typ
        self.items = items


class Map(Node):
    __slots__ = ("items", "type")

    def __init__(self, typ: type, items: list[tuple[Any, Node]]):
        self.type: Any = typ
        self.items = items


class Func(Node):
    """A user function: its code, and what it reads from cells, globals and defaults."""

    __slots__ = ("cells", "code", "defaults", "gid", "globals", "kwdefaults")

    def __init__(self, code: types.CodeType, gid: int):
        self.code = code
        self.gid = gid
        self.cells: list[Node | None] = []  # None: an empty cell
        self.globals: list[tuple[str, Node | None]] = []  # None: the name is absent
        self.defaults: Node | None = None
        self.kwdefaults: Node | None = None


class Method(Node):
    __slots__ = ("func", "self_")

    def __init__(self, self_: Node, func: Node):
        self.self_ = self_
        self.func = func


class Partial(Node):
    __slots__ = ("args", "func", "keywords", "type")

    def __init__(self, typ: type, func: Node, args: Node, keywords: Node):
        self.type: Any = typ
        self.func = func
        self.args = args
        self.keywords = keywords


class Jitted(Node):
    """A `jax.jit` helper: its wrapped function, inlined while tracing.

    jax caches a jitted function's trace by the function and its arguments, not
    by what it closes over, so calling the helper itself would reuse a trace
    holding old captured arrays as constants. Inlining it makes them inputs.
    """

    __slots__ = ("inner",)

    def __init__(self, inner: Node):
        self.inner = inner


class Obj(Node):
    """A user object that is not a pytree: its instance attributes and slots."""

    __slots__ = ("attrs", "slots", "type")

    def __init__(self, typ: Same, attrs: list[tuple[str, Node]], slots: list[tuple[str, Node]]):
        self.type: Any = typ
        self.attrs = attrs
        self.slots = slots


class Tree(Node):
    """A registered pytree (a Module, an optimiser state, an equinox module).

    Checked by its treedef (which holds its static data) and its leaves.
    """

    __slots__ = ("keys", "leaves", "treedef")

    def __init__(self, treedef: Any, leaves: list[Node]):
        self.treedef = treedef
        self.leaves = leaves
        self.keys: list[tuple[Any, ...]] = []  # each leaf's key path (for writing back)


class ParamsNode(Node):
    __slots__ = ("source",)

    def __init__(self, source: Node):
        self.source = source


class Descr(Node):
    """A static method, class method or property: the function behind it."""

    __slots__ = ("attr", "inner", "type")

    def __init__(self, typ: type, attr: str, inner: Node):
        self.type: Any = typ
        self.attr = attr
        self.inner = inner


class Fixed(Node):
    """A user function held by static data (a Module's activation): guarded as a root."""

    __slots__ = ("func", "obj")

    def __init__(self, obj: Same, func: Node):
        self.obj = obj
        self.func = func


class Attrs(Node):
    """A class or user module reached by the walk: the attributes its code may read.

    Held weakly (classes) or strongly (modules live as long as the interpreter);
    checked as an absolute root after the rest of the walk.
    """

    __slots__ = ("attrs", "obj")

    def __init__(self, obj: Same, attrs: list[tuple[str, Node]]):
        self.obj = obj
        self.attrs = attrs


# --- the walk -----------------------------------------------------------------

_SKIP_CLASS_ATTRS = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__slots__",
        "__annotations__",
        "__firstlineno__",
        "__static_attributes__",
        "__orig_bases__",
        "__parameters__",
        "__abstractmethods__",
        "_abc_impl",
        "__match_args__",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__trainable__",
    }
)


class Walk:
    """Builds the node tree of one or more roots; numbers the array places."""

    def __init__(self) -> None:
        self.places = 0
        self.names: list[str] = []  # a readable path per place, for messages
        self.seen: dict[int, Node] = {}
        self.attr_names: set[str] = set()
        # Classes and user modules met on the way, walked last as absolute roots
        # (their attributes are read by name, so the names must be known first).
        self.absolute: dict[int, Any] = {}
        self._keep: list[Any] = []  # keeps memoised ids valid while walking

    def root(self, value: Any) -> Node:
        """The function being compiled: walked even when a library defined it (a closure
        made inside library code still captures the user's values)."""
        if type(value) is types.FunctionType:
            return self._function(value, _describe(value))
        return self.node(value, _describe(value))

    def fixed(self, fn: Any) -> None:
        """Also guard a function held by the arguments' static data (a Module's activation)."""
        if type(fn) is types.FunctionType and not _is_library(fn):
            self.absolute.setdefault(id(fn), fn)

    def finish(self, roots: list[Node]) -> list[Node]:
        """Walk the classes, modules and functions met on the way; number the places.

        A class's methods are walked first: the attribute names their code
        reads decide which of its other attributes (and of user modules) are
        read, and those are walked once every name is known.
        """
        nodes: dict[int, Node] = {}
        done: dict[int, set[str]] = {}
        changed = True
        while changed:
            changed = False
            for key, obj in list(self.absolute.items()):
                if key in nodes:
                    continue
                changed = True
                if type(obj) is types.FunctionType:
                    nodes[key] = Fixed(Same(obj), self._function(obj, _describe(obj)))
                    continue
                attrs = Attrs(Same(obj), [])
                nodes[key] = attrs
                done[key] = set()
                if isinstance(obj, type):
                    for name, value in list(vars(obj).items()):
                        if name not in _SKIP_CLASS_ATTRS and _code_of(value) is not None:
                            attrs.attrs.append((name, self._attr(obj, name, value)))
                            done[key].add(name)
            for key, node in nodes.items():
                if not isinstance(node, Attrs):
                    continue
                obj = self.absolute[key]
                for name, value in list(vars(obj).items()):
                    if name in done[key] or name not in self.attr_names:
                        continue
                    if name in _SKIP_CLASS_ATTRS or type(value) in _SKIPPED_DESCRIPTORS:
                        continue
                    node.attrs.append((name, self._attr(obj, name, value)))
                    done[key].add(name)
                    changed = True
        absolute = list(nodes.values())
        # Places are numbered in the order the guard reads them.
        self.names = [self.names[a.place] for a in _arrays([*roots, *absolute])]
        for i, a in enumerate(_arrays([*roots, *absolute])):
            a.place = i
        return absolute

    def _attr(self, obj: Any, name: str, value: Any) -> Node:
        prefix = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "?")
        path = f"{prefix}.{name}"
        fn = _code_of(value)
        if fn is not None and fn is not value:
            attr = "fget" if isinstance(value, property) else "__func__"
            return Descr(type(value), attr, self.node(fn, path))
        return self.node(value, path)

    def _place(self, path: str) -> Array:
        node = Array(self.places)
        self.places += 1
        self.names.append(path)
        return node

    def _memo(self, value: Any, node: Node) -> Any:
        self.seen[id(value)] = node
        self._keep.append(value)
        return node

    def _absolute(self, obj: Any) -> None:
        if isinstance(obj, type):
            for klass in obj.__mro__:
                if klass is not object and not _is_library(klass):
                    self.absolute.setdefault(id(klass), klass)
        else:
            self.absolute.setdefault(id(obj), obj)

    def node(self, value: Any, path: str) -> Node:
        t = type(value)
        if t in _CONST_TYPES:
            return Const(value)
        if is_array(value):
            return self._place(path)
        prior = self.seen.get(id(value))
        if prior is not None:
            return Alias(prior)
        if t is list or t is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
            seq = self._memo(value, Seq(t, []))
            seq.items.extend(self.node(v, f"{path}[{i}]") for i, v in enumerate(value))
            return seq
        if t is dict:
            mapping = self._memo(value, Map(t, []))
            mapping.items.extend(
                (k, self.node(v, f"{path}[{k!r}]")) for k, v in list(value.items())
            )
            return mapping
        if t is types.FunctionType:
            return Same(value) if _is_library(value) else self._function(value, path)
        if t is types.MethodType:
            method = self._memo(value, Method(Unchecked(), Unchecked()))
            method.self_ = self.node(value.__self__, f"{path}.__self__")
            method.func = self.node(value.__func__, path)
            return method
        if isinstance(value, functools.partial):
            part = self._memo(value, Partial(t, Unchecked(), Unchecked(), Unchecked()))
            part.func = self.node(value.func, f"{path}.func")
            part.args = self.node(value.args, f"{path}.args")
            part.keywords = self.node(value.keywords, f"{path}.keywords")
            return part
        if t is _JITTED_TYPE:
            inner = getattr(value, "__wrapped__", None)
            if type(inner) is types.FunctionType and not _is_library(inner):
                jitted = self._memo(value, Jitted(Unchecked()))
                jitted.inner = self._function(inner, path)
                return jitted
            return Same(value)
        if isinstance(value, np.generic):
            return Const(value)
        from ._params import Params  # imports this module's users; a cycle at import time

        if t is Params:
            ps = self._memo(value, ParamsNode(Unchecked()))
            ps.source = self.node(value._sources, path)
            return ps
        if t is types.ModuleType:
            if not is_library_module(value.__name__):
                self._absolute(value)
            return Same(value)
        if isinstance(value, type):
            if not _is_library(value):
                self._absolute(value)
            return Same(value)
        if isinstance(value, enum.Enum):
            return Same(value)
        if _is_pytree_node(value):
            try:
                return self._tree(value, path)
            except (TypeError, ValueError):  # this value cannot flatten (unsortable keys)
                return Same(value)
        if _is_library(t) and t is not types.SimpleNamespace:
            return Same(value)
        if hasattr(value, "__dict__") or _slot_names(t):
            return self._object(value, path)
        return Same(value)

    def _function(self, fn: types.FunctionType, path: str) -> Node:
        info = code_info(fn.__code__)
        self.attr_names.update(info.attrs)
        node = self._memo(fn, Func(fn.__code__, id(fn.__globals__)))
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # a name not assigned yet
                node.cells.append(None)
                continue
            node.cells.append(self.node(value, name))
        g = fn.__globals__
        for name in info.globals:
            value = g.get(name, MISSING)
            node.globals.append((name, None if value is MISSING else self.node(value, name)))
        if fn.__defaults__ is not None:
            node.defaults = self.node(fn.__defaults__, f"{path} defaults")
        if fn.__kwdefaults__ is not None:
            node.kwdefaults = self.node(fn.__kwdefaults__, f"{path} defaults")
        return node

    def _tree(self, value: Any, path: str) -> Node:
        leaves, treedef = jax.tree_util.tree_flatten(value)
        node = self._memo(value, Tree(treedef, []))
        if any(is_array(x) for x in leaves):
            keys = [p for p, _ in jax.tree_util.tree_flatten_with_path(value)[0]]
            if len(keys) != len(leaves):  # pragma: no cover - a pytree with inconsistent paths
                keys = [(i,) for i in range(len(leaves))]
        else:
            keys = [()] * len(leaves)
        node.keys = [tuple(k) for k in keys]
        node.leaves.extend(
            self._place(path + jax.tree_util.keystr(k)) if is_array(x) else self._leaf(x)
            for k, x in zip(keys, leaves, strict=True)
        )
        for cls in _node_types(treedef):
            if not _is_library(cls):
                self._absolute(cls)
        return node

    def _leaf(self, x: Any) -> Node:
        return Const(x) if type(x) in _CONST_TYPES else Same(x)

    def _object(self, value: Any, path: str) -> Node:
        t = type(value)
        self._absolute(t)
        node = self._memo(value, Obj(Same(t), [], []))
        d = getattr(value, "__dict__", None)
        if d is not None:
            node.attrs.extend((k, self.node(v, f"{path}.{k}")) for k, v in list(d.items()))
        for name in _slot_names(t):
            v = getattr(value, name, MISSING)
            if v is not MISSING:
                node.slots.append((name, self.node(v, f"{path}.{name}")))
        return node


_SKIPPED_DESCRIPTORS = (types.MemberDescriptorType, types.GetSetDescriptorType)


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _code_of(value: Any) -> Any:
    """The function behind a class attribute (a method, static/class method, property)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    return value if type(value) is types.FunctionType else None


_SLOT_NAMES: dict[type, tuple[str, ...]] = {}


def _slot_names(t: type) -> tuple[str, ...]:
    got = _SLOT_NAMES.get(t)
    if got is None:
        got = _SLOT_NAMES[t] = _find_slot_names(t)
    return got


def _find_slot_names(t: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in t.__mro__:
        slots = vars(klass).get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        names.extend(s for s in slots if s not in ("__dict__", "__weakref__", "_tg_aux"))
    return tuple(dict.fromkeys(names))


def _node_types(treedef: Any) -> Iterator[type]:
    stack = [treedef]
    while stack:
        td = stack.pop()
        data = td.node_data()
        if data is not None:
            yield data[0]
        stack.extend(td.children())


def children(node: Node) -> list[Node]:
    """A node's children, in the order the guard reads them."""
    if isinstance(node, Seq):
        return node.items
    if isinstance(node, Map):
        return [c for _, c in node.items]
    if isinstance(node, Func):
        out = [c for c in node.cells if c is not None]
        out += [c for _, c in node.globals if c is not None]
        return out + [c for c in (node.defaults, node.kwdefaults) if c is not None]
    if isinstance(node, Method):
        return [node.self_, node.func]
    if isinstance(node, Partial):
        return [node.func, node.args, node.keywords]
    if isinstance(node, (Jitted, Descr)):
        return [node.inner]
    if isinstance(node, Obj):
        return [c for _, c in node.attrs] + [c for _, c in node.slots]
    if isinstance(node, Tree):
        return node.leaves
    if isinstance(node, ParamsNode):
        return [node.source]
    if isinstance(node, Fixed):
        return [node.func]
    if isinstance(node, Attrs):
        return [c for _, c in node.attrs]
    return []


def _arrays(nodes: list[Node]) -> list[Array]:
    out: list[Array] = []
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        if isinstance(node, Array):
            out.append(node)
        else:
            stack.extend(reversed(children(node)))
    return out


def has_places(node: Node) -> bool:
    return isinstance(node, Array) or any(has_places(c) for c in children(node))
