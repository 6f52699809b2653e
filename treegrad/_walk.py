"""The walk: everything a function can read, as a tree of `_guard` nodes.

On a cache miss the engine walks the function being compiled (and, for
`tg.jit`, its callable arguments): closure cells, the globals its code names,
defaults, and recursively the user functions, methods, partials, `jax.jit`
helpers, containers, objects and pytrees it reaches; then the classes and user
modules met on the way, whose attributes the walked code reads by name. Each
array found is a numbered place; every other value is remembered for the guard.
"""

from __future__ import annotations

import array
import collections
import collections.abc
import copy
import enum
import functools
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ._guard import (
    _CONST_TYPES,
    JITTED_TYPES,
    MISSING,
    Alias,
    Array,
    Attrs,
    Const,
    Descr,
    Fixed,
    Func,
    Jitted,
    Map,
    Method,
    Node,
    Obj,
    ParamsNode,
    Partial,
    Same,
    Seq,
    Snap,
    Tree,
    Unchecked,
    _arrays,
    _code_of,
    _is_library,
    _is_pytree_node,
    code_info,
    is_array,
    is_library_module,
)

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
            return self._function(value, describe(value))
        return self.node(value, describe(value))

    def fixed(self, fn: Any) -> None:
        """Also guard a function held by static data (a Module's activation), or a
        callable of the user's (a callable object, a bound method, a partial): what
        it reads, and its own state, are checked like a closure's."""
        if type(fn) is types.FunctionType:
            if not _is_library(fn):
                self.absolute.setdefault(id(fn), fn)
        elif _user_callable(fn):
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
                    nodes[key] = Fixed(Same(obj), self._function(obj, describe(obj)))
                    continue
                if not isinstance(obj, (type, types.ModuleType)):  # a held callable
                    nodes[key] = Fixed(Same(obj), self.node(obj, describe(obj)))
                    continue
                attrs = Attrs(Same(obj), [])
                nodes[key] = attrs
                done[key] = set()
                if isinstance(obj, type):
                    for name, value in list(vars(obj).items()):
                        if name not in _SKIP_CLASS_ATTRS and _code_of(value) is not None:
                            attrs.attrs.append((name, self._attr(obj, name, value)))
                            done[key].add(name)
                elif type(vars(obj).get("__getattr__")) is types.FunctionType:
                    # A user module's __getattr__ (PEP 562) answers the names it lacks.
                    getattr_ = vars(obj)["__getattr__"]
                    attrs.attrs.append(("__getattr__", self._attr(obj, "__getattr__", getattr_)))
                    done[key].add("__getattr__")
            for key, node in nodes.items():
                if not isinstance(node, Attrs):
                    continue
                obj = self.absolute[key]
                for name, value in list(vars(obj).items()):
                    if name in done[key] or name not in self.attr_names:
                        continue
                    if name in _SKIP_CLASS_ATTRS or type(value) in _SKIPPED_DESCRIPTORS:
                        continue
                    if (
                        type(obj) is types.ModuleType
                        and is_library_module(obj.__name__)
                        and (callable(value) or type(value) is types.ModuleType)
                    ):
                        continue  # a library's function, class or submodule
                    node.attrs.append((name, self._attr(obj, name, value)))
                    done[key].add(name)
                    changed = True
        self._absences(nodes)
        self._module_absences(nodes)
        absolute = list(nodes.values())
        # Places are numbered in the order the guard reads them.
        self.names = [self.names[a.place] for a in _arrays([*roots, *absolute])]
        for i, a in enumerate(_arrays([*roots, *absolute])):
            a.place = i
        return absolute

    def _absences(self, nodes: dict[int, Node]) -> None:
        """For each class walked: the names the code reads that a class after it in
        its MRO, or its metaclass, defines, checked to stay absent from it; assigned
        there later (`Sub.scale = 5` over `Base.scale`), they would shadow the one read."""
        for key, node in nodes.items():
            cls = self.absolute[key]
            if not isinstance(cls, type) or not isinstance(node, Attrs):
                continue
            related = [
                vars(k) for k in (*cls.__mro__[1:], *inspect.getmro(type(cls))) if id(k) in nodes
            ]
            own = vars(cls)
            for name in sorted(self.attr_names):
                if (
                    name not in own
                    and name not in _SKIP_CLASS_ATTRS
                    and any(name in d for d in related)
                ):
                    node.attrs.append((name, Const(MISSING)))

    def _module_absences(self, nodes: dict[int, Node]) -> None:
        """For a user module with a `__getattr__`: the names the code reads that the
        module lacks, checked to stay absent (assigned, they would bypass it)."""
        for key, node in nodes.items():
            mod = self.absolute[key]
            if type(mod) is not types.ModuleType or not isinstance(node, Attrs):
                continue
            d = vars(mod)
            if "__getattr__" in d:
                for name in sorted(self.attr_names - d.keys() - _SKIP_CLASS_ATTRS):
                    node.attrs.append((name, Const(MISSING)))

    def _attr(self, obj: Any, name: str, value: Any) -> Node:
        # From the object's own dict: a module's __getattr__ may answer any name its way.
        prefix = obj.__qualname__ if isinstance(obj, type) else vars(obj).get("__name__", "?")
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
            # The class's MRO and its metaclass's: `C.x` may be found on either.
            for klass in (*obj.__mro__, *inspect.getmro(type(obj))):
                if klass is not object and klass is not type and not _is_library(klass):
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
        if not _plain_attributes(t):
            try:
                value.__class__  # noqa: B018 -- what isinstance and hasattr read first
            except Exception:
                # A __getattribute__ that answers every name its own way (a view of a
                # dict): the object by identity, and its class's methods (that
                # __getattribute__ included) walked, with what they read.
                self._absolute(t)
                return Same(value)
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
            if not _is_library(value):
                return self._function(value, path)
            # A library wrapper of a user function (jax.vmap, jax.grad, a functools.wraps
            # decorator): the wrapper by identity, and what the wrapped function reads
            # as a root of its own, so its captured arrays are inputs.
            self.fixed(getattr(value, "__wrapped__", None))
            return Same(value)
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
        if t in JITTED_TYPES:
            inner = getattr(value, "__wrapped__", None)
            if type(inner) is types.FunctionType and not _is_library(inner):
                jitted = self._memo(value, Jitted(Unchecked(), t))
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
            # A library module too: its data attributes the code reads (os.environ,
            # a constant a user reassigned) are checked; its functions, classes and
            # submodules are not (`finish`).
            if value is not sys:  # sys.modules would be a walk of every module
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
        if isinstance(value, dict):
            # A dict subclass (Counter, a user's): read by key, as a dict.
            mapping = self._memo(value, Map(t, []))
            mapping.items.extend(
                (k, self.node(v, f"{path}[{k!r}]")) for k, v in list(value.items())
            )
            return mapping
        if isinstance(value, list):  # a list subclass
            seq = self._memo(value, Seq(t, []))
            seq.items.extend(self.node(v, f"{path}[{i}]") for i, v in enumerate(value))
            return seq
        snap = _snapshot(value)
        if snap is not None:
            return snap
        if _is_library(t) and t is not types.SimpleNamespace:
            wrapped = getattr(value, "__wrapped__", None) if callable(value) else None
            if type(wrapped) is types.FunctionType:
                # A library wrapper of a user function (functools.lru_cache): what the
                # function reads is guarded as a root of its own.
                self.fixed(wrapped)
            return Same(value)
        if hasattr(value, "__dict__") or _slot_names(t):
            return self._object(value, path)
        return Same(value)

    def _function(self, fn: types.FunctionType, path: str) -> Func:
        inner = getattr(fn, "__wrapped__", None)
        if inner is not None and inner is not fn:
            # A wrapper (jax.vmap's, to which functools.wraps gives the user's
            # __module__): the function it wraps may be reached only through library
            # objects (vmap's own closure); guard it as a root of its own.
            self.fixed(inner)
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
        for cls in node_types(treedef):
            if not _is_library(cls):
                self._absolute(cls)
        for fn in static_callables(treedef):  # a captured Module's activation
            self.fixed(fn)
        return node

    def _leaf(self, x: Any) -> Node:
        return Const(x) if type(x) in _CONST_TYPES else Same(x)

    def _object(self, value: Any, path: str) -> Node:
        t = type(value)
        self._absolute(t)
        node = self._memo(value, Obj(Same(t), [], []))
        d = getattr(value, "__dict__", None)
        node.has_dict = d is not None
        if d is not None:
            node.attrs.extend((k, self.node(v, f"{path}.{k}")) for k, v in list(d.items()))
        for name in _slot_names(t):
            v = getattr(value, name, MISSING)
            if v is not MISSING:
                node.slots.append((name, self.node(v, f"{path}.{name}")))
        return node


_SKIPPED_DESCRIPTORS = (types.MemberDescriptorType, types.GetSetDescriptorType)

# Mutable containers the walk does not see into, compared by a copy of their contents
# when every element is a number or string (otherwise: by identity, as before).
_SNAP_TYPES = (set, frozenset, bytearray, collections.deque, array.array)


def _snapshot(value: Any) -> Snap | None:
    t = type(value)
    if isinstance(value, np.ndarray):  # of strings, bytes, dates, or objects
        if value.dtype.kind == "O" and not all(type(x) in _CONST_TYPES for x in value.flat):
            return None
        return Snap(t, value.copy())
    if isinstance(value, _SNAP_TYPES):
        if all(type(x) in _CONST_TYPES for x in value):
            return Snap(t, copy.copy(value))
        return None
    if isinstance(value, collections.abc.Mapping) and not _is_pytree_node(value):
        # os.environ, a ChainMap, a MappingProxyType: compared as a dict of their items.
        try:
            items = dict(value)
        except Exception:  # a user's Mapping whose iteration fails: left to identity
            return None
        if all(type(x) in _CONST_TYPES for x in items.values()):
            return Snap(t, items, as_dict=True)
    return None


def _plain_attributes(t: type) -> bool:
    return t.__getattribute__ is object.__getattribute__


def describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


_SLOT_NAMES: dict[type, tuple[str, ...]] = {}  # cleared with the other memos (_engine.MEMOS)


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


def _user_callable(fn: Any) -> bool:
    """A callable of the user's that static data may hold: a bound method, a partial, or
    an instance of a user class with `__call__` (not a class, module or library object)."""
    if isinstance(fn, (types.MethodType, functools.partial)):
        return True
    return (
        callable(fn)
        and not isinstance(fn, (type, types.ModuleType, types.BuiltinFunctionType))
        and not _is_library(type(fn))
    )


def static_callables(treedef: Any) -> list[Any]:
    """The callables held as static data by the Modules of a tree's structure."""
    from ._module import _Static

    out: list[Any] = []
    stack = [treedef]
    while stack:
        td = stack.pop()
        data = td.node_data()
        if data is not None and isinstance(data[1], _Static):
            out.extend(v for _, v in data[1].items if callable(v) and not isinstance(v, type))
        stack.extend(td.children())
    return out


def node_types(treedef: Any) -> Iterator[type]:
    stack = [treedef]
    while stack:
        td = stack.pop()
        data = td.node_data()
        if data is not None:
            yield data[0]
        stack.extend(td.children())
