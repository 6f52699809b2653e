"""The walk: everything a function can read, as a tree of `_guard` nodes.

On a cache miss the engine walks the function being compiled (and, for
`tg.jit`, its callable arguments): closure cells, the globals its code names,
defaults, and recursively the user functions, methods, partials, `jax.jit`
helpers, containers, objects and pytrees it reaches; then the classes and user
modules met on the way, whose attributes the walked code reads by name, and the
attributes of the objects met that the walked code may read (`_codeinfo.py`).
Each array found is a numbered place; every other value is remembered for the
guard.
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import dataclasses
import enum
import functools
import hashlib
import inspect
import operator
import sys
import threading
import types
from typing import Any

import jax
import numpy as np

from ._codeinfo import PROTOCOL_NAMES, code_info, every_attribute, reads_any_attribute
from ._draws import consumed, global_states
from ._guard import (
    MISSING,
    Alias,
    Array,
    Attrs,
    Const,
    Deref,
    Descr,
    Fixed,
    Func,
    Jitted,
    Map,
    Method,
    Modules,
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
    deref,
    holder_kind,
    snapshot,
)
from ._kinds import (
    CONST_TYPES,
    JITTED_TYPES,
    code_of,
    has_instance_dict,
    holds_user_values,
    is_array,
    is_library,
    is_library_module,
    is_pytree_node,
)
from ._reach import _user_callable, describe, node_types, slot_names, static_callables

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
        "__dataclass_fields__",
        "__dataclass_params__",
        "__trainable__",
    }
)


# Methods a library puts on every class it makes that only a library calls:
# Python 3.13's dataclasses set `__replace__ = dataclasses._replace` (called by
# `copy.replace`, a library that reads any attribute anyway). Walked as a method, that
# library function made every attribute of every user class and module count as read
# (`_library`): any global changed traced again. Spelled by the code
# (`obj.__replace__(...)`), it is walked as an attribute read (`finish`). Compared by
# identity (a class attribute may be unhashable).
_LIBRARY_METHODS: dict[str, Any] = {"__replace__": getattr(dataclasses, "_replace", None)}
_BUILTINS = vars(builtins)


class _AnEnum(enum.Enum):
    A = 1


_ENUM_ATTRS = frozenset(vars(_AnEnum.A))  # what every member has (`_value_`, `_name_`...)
_DICT_VIEWS: tuple[type, ...] = (type({}.keys()), type({}.values()), type({}.items()))
# What functools.wraps sets on a wrapper: read by libraries, not by the user's code.
_WRAPPER_ATTRS = frozenset({"__wrapped__", "__signature__", "__annotations__", "__type_params__"})


class Walk:
    """Builds the node tree of one or more roots; numbers the array places."""

    def __init__(self, as_values: bool = False, keep: frozenset[int] = frozenset()) -> None:
        # A captured numpy array is an input, traced, unless the function needs it to be
        # numpy (`as_values`: it sorts or fills it in place, or the trace failed on it):
        # then it is read as a value, compared by a copy on each call. `keep`: the ids
        # of arrays that stay inputs regardless (implicit mode's parameters).
        self.as_values = as_values
        self.keep = keep
        self.numpy_places = 0  # numpy arrays given a place (each could be read as a value)
        self.valued: list[str] = []  # the paths of those read as values
        self.valued_copies: list[np.ndarray] = []  # and the copies compared on each call
        self.in_place = False  # reached code calls numpy's in-place methods (`_codeinfo`)
        self.places = 0
        self.names: list[str] = []  # a readable path per place, for messages
        self.seen: dict[int, Node] = {}
        self.attr_names: set[str] = set()
        # The instance attributes the walked code may read (`_CodeInfo.reads`), or all
        # of them (`dynamic`); objects' attributes are walked last, once these are known.
        self.read_names: set[str] = set(PROTOCOL_NAMES)
        # Attribute names the walked code reads other than to append to (`_CodeInfo.
        # read_attrs`), and the lists met as attributes: those it reads are counters.
        # Reads by code walked as an attribute of a class or module (its methods,
        # its functions) count only for that class's instances (`_attr_read`): a
        # method of another class reading `.history` is not this loss's read.
        self.attr_reads: set[str] = set()
        self.owner_reads: dict[int, set[str]] = {}
        self._owner: Any = None
        self.attr_lists: list[tuple[str, Any, Any]] = []
        # Whether the value `node` walks next is reached by a name the code spells (a
        # global, a closure variable, an attribute: `_by_name`). A list reached any
        # other way (an item of a dict or list, a partial's argument, a default, a
        # bound method's owner) is read by code the walk cannot tell from an append
        # (`d["log"]`, `partial(len, log)`): a counter (`Seq.read`), never a log.
        self._named = False
        # The Snap nodes of each set or deque met (not memoised: each reach has its own),
        # for `_counter`.
        self.snaps: dict[int, list[Snap]] = {}
        self.dynamic = False
        self.pending: list[_Pending] = []
        # Objects used as dict keys or set elements: their identity is what a lookup
        # compares (`Node.ident`).
        self.keyed: dict[int, Any] = {}
        # Classes and user modules met on the way, walked last as absolute roots
        # (their attributes are read by name, so the names must be known first).
        self.absolute: dict[int, Any] = {}
        self._keep: list[Any] = []  # keeps memoised ids valid while walking
        # Random states and library iterators met (a np.random.Generator, `rng.normal`,
        # an iterator of batches): a trace that draws from one is not reused (`_draws`).
        self.consumed: list[Any] = []
        self.numpy_seen = False  # a module of numpy reached: `np.random.rand` may be read
        self.labels: dict[int, str] = {}  # readable paths of absolute roots (`_held`)
        self.sys_modules: list[Modules] = []  # nodes of `sys.modules` (`_modules_grown`)
        # The user modules whose globals the walked functions use: the code may read one
        # by name through a function (`helper.__globals__["s"]`, `_globals_read`).
        self.fn_modules: dict[int, types.ModuleType] = {}

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
            if not is_library(fn):
                self.absolute.setdefault(id(fn), fn)
        elif _user_callable(fn):
            self.absolute.setdefault(id(fn), fn)

    def held(self, obj: Any, label: str) -> None:
        """Also guard `obj` (an object, a dict) as a root of its own: what it holds and,
        for an object, its attributes the walked code reads."""
        self.labels[id(obj)] = label
        self.absolute.setdefault(id(obj), obj)

    def _held(self, items: dict[Any, Any], path: str) -> None:
        """The values of a container the walk does not see into (`Held`: compared by
        identity), which can change without being replaced: a function (a queue of
        callbacks, a read-only view of helpers), a container or an object. Each is
        walked as a root of its own, so what it holds and reads is checked too."""
        for key, x in items.items():
            if type(x) in CONST_TYPES or is_array(x) or isinstance(x, np.generic):
                continue
            if type(x) is types.FunctionType:
                self.fixed(x)
            elif isinstance(x, (type, types.ModuleType)):
                self.node(x, f"{path}[{key!r}]")  # its attributes, by the names read
            else:
                self.held(x, f"{path}[{key!r}]")

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
                    label = self.labels.get(key) or describe(obj)
                    nodes[key] = Fixed(Same(obj), self.node(obj, label))
                    continue
                attrs = Attrs(Same(obj), [])
                nodes[key] = attrs
                done[key] = set()
                if isinstance(obj, type):
                    for name, value in list(vars(obj).items()):
                        if (
                            name not in _SKIP_CLASS_ATTRS
                            and code_of(value) is not None
                            and _LIBRARY_METHODS.get(name, MISSING) is not value
                        ):
                            attrs.attrs.append((name, self._owned(obj, name, value)))
                            done[key].add(name)
                elif type(vars(obj).get("__getattr__")) is types.FunctionType:
                    # A user module's __getattr__ (PEP 562) answers the names it lacks.
                    getattr_ = vars(obj)["__getattr__"]
                    attrs.attrs.append(("__getattr__", self._owned(obj, "__getattr__", getattr_)))
                    done[key].add("__getattr__")
            for key, node in nodes.items():
                if not isinstance(node, Attrs):
                    continue
                obj = self.absolute[key]
                for name, value in list(vars(obj).items()):
                    if name in done[key] or not self._reads(obj, name):
                        continue
                    if name in _SKIP_CLASS_ATTRS or type(value) in _SKIPPED_DESCRIPTORS:
                        continue
                    if (
                        type(obj) is types.ModuleType
                        and is_library_module(obj.__name__)
                        and (callable(value) or type(value) is types.ModuleType)
                    ):
                        continue  # a library's function, class or submodule
                    node.attrs.append((name, self._owned(obj, name, value)))
                    if issubclass(type(value), list) or type(value) in _ADDED_TO:
                        self.attr_lists.append((name, value, obj))
                    done[key].add(name)
                    changed = True
            changed = self._walk_pending() or changed
            changed = self._modules_grown() or changed
            changed = self._globals_read() or changed
        for p in self.pending:
            p.node.skipped = [k for k in p.dict or () if k not in p.done]
        for name, value, owner in self.attr_lists:
            # (By the names code spells: one read by a computed name, `getattr(o, name)`,
            # would make every list a counter, a log of each library-like function too.)
            if self._attr_read(name, owner):
                self._counter(value)
        for key, k in self.keyed.items():
            found = self.seen.get(key)
            if found is not None and type(k).__eq__ is object.__eq__:
                # Looked up by identity (`weights[layer]`): another object of the same
                # contents in its place reads another entry.
                found.ident = Same(k)
        if self.dynamic or ("random" in self.attr_names and self.numpy_seen):
            # `np.random.rand`: numpy's module-level state (`_draws`); not for code
            # that reaches only `jax.random`, so that a thread of the user's drawing
            # from numpy meanwhile is not taken for this function's draw.
            self.consumed += global_states(None if self.dynamic else np.random)
        self._absences(nodes)
        self._module_absences(nodes)
        absolute = list(nodes.values())
        # Places are numbered in the order the guard reads them.
        self.names = [self.names[a.place] for a in _arrays([*roots, *absolute])]
        for i, a in enumerate(_arrays([*roots, *absolute])):
            a.place = i
        return absolute

    def _reads(self, obj: Any, name: str) -> bool:
        """Whether the walked code may read attribute `name` of a class or module: one it
        names (`C.s`); of a user class or module, also one named by a string
        (`getattr(C, "s")`, `vars(mod)["s"]`, `C.__dict__["s"]`), or any when a name is
        computed at run time (`getattr(C, name)`)."""
        if name in self.attr_names:
            return True
        if isinstance(obj, type):
            user = not is_library(obj)
        else:
            user = type(obj) is types.ModuleType and not is_library_module(obj.__name__)
        return user and (self.dynamic or name in self.read_names)

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
            names = self.attr_names | self.read_names
            if self.dynamic:
                names = names.union(*related)
            for name in sorted(n for n in names if self._reads(cls, n)):
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
        fn = code_of(value)
        if fn is not None and fn is not value:
            attr = "fget" if isinstance(value, property) else "__func__"
            return Descr(type(value), attr, self.node(fn, path))
        return self._by_name(value, path)

    def _array(self, value: Any, path: str) -> Node:
        if isinstance(value, np.ndarray) and id(value) not in self.keep:
            if self.as_values:
                self.valued.append(path)
                self.valued_copies.append(value.copy())
                return Snap(type(value), self.valued_copies[-1], copied=True)
            self.numpy_places += 1
        return self._place(path)

    def valued_seen(self) -> list[tuple[str, Any]]:
        """What the numpy arrays read as values hold: each path with its array's dtype,
        shape and contents hashed (None for an object array: its bytes are pointers)."""
        out: list[tuple[str, Any]] = []
        for path, a in zip(self.valued, self.valued_copies, strict=True):
            if a.dtype.hasobject:
                out.append((path, None))
                continue
            data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            digest = hashlib.blake2b(data.data, digest_size=16).digest()
            out.append((path, (a.dtype.str, a.shape, digest)))
        return out

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
                if klass is not object and klass is not type and not is_library(klass):
                    self.absolute.setdefault(id(klass), klass)
        else:
            self.absolute.setdefault(id(obj), obj)

    def _by_name(self, value: Any, path: str) -> Node:
        """`node` for a value the code reaches by a name it spells (a global, a closure
        variable, an attribute): a list reached so is a log unless that code reads it
        other than by appending (`_counter`)."""
        self._named = True
        return self.node(value, path)

    def node(self, value: Any, path: str) -> Node:
        named, self._named = self._named, False
        t = type(value)
        if t in CONST_TYPES:
            return Const(value)
        kind = holder_kind(t)
        if kind is None and is_array(value):
            return self._array(value, path)
        prior = self.seen.get(id(value))
        if prior is not None:
            if not named and isinstance(prior, Seq):
                prior.read = True  # a list also reached not by a name (`_named`)
            return Alias(prior)
        # A random state or a library iterator, or its bound method (`rng.normal`).
        source = consumed(value, is_library)
        if source is not None:
            self.consumed.append(source)
        if kind is not None:
            return self._holder(value, kind, path)
        if value is sys.modules:
            return self._modules(value)
        if not _plain_attributes(t):
            try:
                value.__class__  # noqa: B018 -- what isinstance and hasattr read first
            except Exception:  # any error: user code answers; the object is then by identity
                # A __getattribute__ that answers every name its own way (a view of a
                # dict): the object by identity, and its class's methods (that
                # __getattribute__ included) walked, with what they read.
                self._absolute(t)
                return Same(value)
        if t not in _BUILTIN_CONTAINERS and _user_container(value):
            # A user's subclass of a container (a dict with `__missing__`, a NamedTuple
            # with methods, a set with its own `__contains__`) or a Mapping of the user's:
            # a read runs its class's code, which may read a global: the class is walked,
            # its methods with what they read, as any user class met.
            self._absolute(t)
            if (
                isinstance(value, _BUILTIN_CONTAINER_TYPES)
                and has_instance_dict(value)
                and vars(value) is not value
            ):
                # Its instance attributes (`layers.scale` on a list of layers), which no
                # item holds: a root of their own, each checked.
                self.held(vars(value), f"{path}.__dict__")
        if t is list or t is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
            seq = self._memo(value, Seq(t, []))
            seq.read = not named  # (`_named`)
            # (Its items as stored: a NamedTuple of the user's may define `__iter__`.)
            items = value if t is list or t is tuple else tuple.__iter__(value)
            seq.items.extend(self.node(v, f"{path}[{i}]") for i, v in enumerate(items))
            return seq
        if t is dict:
            self._note_keys(value)
            mapping = self._memo(value, Map(t, []))
            mapping.items.extend(
                (k, self.node(v, f"{path}[{k!r}]")) for k, v in list(value.items())
            )
            return mapping
        if t is types.FunctionType:
            if not is_library(value):
                return self._function(value, path)
            # A library wrapper of a user function (jax.vmap, jax.grad, a functools.wraps
            # decorator): the wrapper by identity, and what the wrapped function reads
            # as a root of its own, so its captured arrays are inputs.
            self._library(value)
            self.fixed(getattr(value, "__wrapped__", None))
            return Same(value)
        if t is types.MethodType:
            method = self._memo(value, Method(Unchecked(), Unchecked()))
            method.self_ = self.node(value.__self__, f"{path}.__self__")
            method.func = self.node(value.__func__, path)
            return method
        if isinstance(value, functools.partial):
            self._reads_by_name(value)
            part = self._memo(value, Partial(t, Unchecked(), Unchecked(), Unchecked()))
            part.func = self.node(value.func, f"{path}.func")
            part.args = self.node(value.args, f"{path}.args")
            part.keywords = self.node(value.keywords, f"{path}.keywords")
            return part
        if t in JITTED_TYPES:
            inner = getattr(value, "__wrapped__", None)
            if type(inner) is types.FunctionType and not is_library(inner):
                jitted = self._memo(value, Jitted(Unchecked(), t))
                jitted.inner = self._function(inner, path)
                return jitted
            if isinstance(inner, (functools.partial, types.MethodType)):
                # `jax.jit(functools.partial(f, k=1))`, `jax.jit(layer.__call__)`: inlined
                # as a function is, what it reads checked (jax's cache would reuse the
                # first trace).
                jitted = self._memo(value, Jitted(Unchecked(), t))
                jitted.inner = self.node(inner, path)
                return jitted
            return Same(value)
        if isinstance(value, np.generic):
            return Const(value)
        if t is types.BuiltinMethodType or t is types.MethodWrapperType:
            if any(value is f for f in _READS_ANY_ATTRIBUTE):
                # `ga = getattr` then `ga(obj, NAME)` (a global alias, a default, a dict
                # entry): the code names no attribute, so any may be read.
                self.dynamic = True
            # `get = cfg.get`, `cfg.__getitem__`: what the method reads is its owner's.
            owner = value.__self__
            if owner is not None and not isinstance(owner, (type, types.ModuleType)):
                self._held({"__self__": owner}, path)
            return Same(value)
        if t in _DICT_VIEWS:
            self._held({"mapping": value.mapping}, path)  # `vals = cfg.values()`
            return Same(value)
        from ._grads import Grads  # (these import this module's users: a cycle at import)
        from ._params import Params

        if t is Params:
            ps = self._memo(value, ParamsNode(Unchecked()))
            ps.source = self.node(value._sources, path)
            return ps
        if t is Grads:
            # Its parameters and gradients are inputs, as a Params' sources are: inside
            # a compiled function the parameters are tracers, and a Grads taken outside
            # it is looked up with them (`g[W]`, `tg.update_(state, ps, g)`).
            grads = self._memo(value, Obj(Same(t), [], []))
            grads.has_dict = False
            grads.slots = [
                ("_params", self.node(value._params, f"{path}._params")),
                ("_grads", self.node(value._grads, f"{path}._grads")),
            ]
            return grads
        if t is types.ModuleType:
            self.consumed += global_states(value)  # `random`, `numpy.random` (`_draws`)
            self.numpy_seen = self.numpy_seen or value.__name__.split(".")[0] == "numpy"
            # A library module too: its data attributes the code reads (os.environ,
            # a constant a user reassigned, sys.modules: `_modules`) are checked; its
            # functions, classes and submodules are not (`finish`).
            self._absolute(value)
            if is_library_module(value.__name__):
                self._library(value)
            return Same(value)
        if isinstance(value, type):
            if not is_library(value):
                self._absolute(value)
            else:
                self._library(value)
            return Same(value)
        if isinstance(value, enum.Enum):
            # A member's value may be mutable (`A = [2.0]`): walked as a root of its own.
            self._held({"value": value._value_}, path)
            if vars(value).keys() - _ENUM_ATTRS:
                # Attributes set on the member (`Mode.TRAIN.scale = 2.0`), by the names read.
                return self._object(value, path)
            return Same(value)
        if is_pytree_node(value):
            try:
                return self._tree(value, path)
            except (TypeError, ValueError):  # this value cannot flatten (unsortable keys)
                return Same(value)
        if isinstance(value, dict):
            # A dict subclass (Counter, a user's): read by key, as a dict.
            self._note_keys(value)
            mapping = self._memo(value, Map(t, []))
            mapping.items.extend(
                (k, self.node(v, f"{path}[{k!r}]")) for k, v in list(dict.items(value))
            )
            return mapping
        if isinstance(value, list):  # a list subclass: its items as stored (as the guard)
            seq = self._memo(value, Seq(t, []))
            seq.read = not named  # (`_named`)
            items = list.__iter__(value)
            seq.items.extend(self.node(v, f"{path}[{i}]") for i, v in enumerate(items))
            return seq
        if isinstance(value, (set, frozenset)):
            self._note_keys(value)
        snap = snapshot(value)
        if snap is not None and type(value) in _ADDED_TO:
            snap.read = not named  # (`_named`)
            self.snaps.setdefault(id(value), []).append(snap)
            self._keep.append(value)
        if snap is not None:
            if snap.held is not None:
                self._held(dict(value) if snap.as_dict else dict(enumerate(value)), path)
            return snap
        if isinstance(value, threading.local):
            # Its instance dict is the calling thread's: read afresh on each call.
            return self._object(value, path)
        if is_library(t) and not holds_user_values(t):
            self._library(value)
            self._reads_by_name(value)
            if callable(value) or t in _METHOD_DESCRIPTORS:
                # A library wrapper of the user's functions (functools.lru_cache's
                # __wrapped__, jax.custom_vjp's fwd and bwd rules, custom_jvp's jvp, a
                # partial a staticmethod holds): what each reads is guarded, as a root
                # of its own.
                held = getattr(value, "__dict__", {}).values()
                for fn in (getattr(value, "__wrapped__", None), *held):
                    if type(fn) is types.FunctionType or isinstance(fn, functools.partial):
                        self.fixed(fn)
                if t in _METHOD_DESCRIPTORS:
                    # A class's partialmethod (its function, and the arguments it holds,
                    # which can change in place), singledispatchmethod (its dispatcher),
                    # a property or classmethod of a partial or an attrgetter.
                    self._held({k: getattr(value, k) for k in _METHOD_DESCRIPTORS[t]}, path)
            return Same(value)
        if has_instance_dict(value) or slot_names(t):
            return self._object(value, path)
        return Same(value)

    def _owned(self, obj: Any, name: str, value: Any) -> Node:
        """`_attr`, with the attributes the code it reaches reads filed under `obj`."""
        outer, self._owner = self._owner, obj
        try:
            return self._attr(obj, name, value)
        finally:
            self._owner = outer

    def _attr_read(self, name: str, owner: Any) -> bool:
        """Whether code may read attribute `name` of `owner` other than by appending to
        it: code reached from the function (not as another class's or a module's
        attribute), or a method of `owner`'s class (or of `owner`, a class)."""
        if name in self.attr_reads:
            return True
        if type(owner) is types.ModuleType:
            return False  # its functions read it as a global (`Func`'s names)
        # (type(), not isinstance: an object's own __getattribute__ may answer anything.)
        is_class = issubclass(type(owner), type)
        classes = type.__getattribute__(owner, "__mro__") if is_class else type(owner).__mro__
        return any(name in self.owner_reads.get(id(k), ()) for k in classes)

    def _counter(self, value: Any) -> None:
        """Mark a list the code reads other than by appending to it: a counter
        (`log.append(1); if len(log) > 3`), not a log (`_settle.Settle.node`)."""
        if issubclass(type(value), list):
            seq = self.seen.get(id(value))
            if isinstance(seq, Seq):
                seq.read = True
        for snap in self.snaps.get(id(value), ()):
            snap.read = True  # a set or deque

    def _function(self, fn: types.FunctionType, path: str) -> Func:
        inner = getattr(fn, "__wrapped__", None)
        if inner is not None and inner is not fn:
            # A wrapper (jax.vmap's, to which functools.wraps gives the user's
            # __module__): the function it wraps may be reached only through library
            # objects (vmap's own closure); guard it as a root of its own.
            self.fixed(inner)
        info = code_info(fn.__code__)
        for name in info.imports:
            # `importlib.import_module("cfg").s`: the user module it names, if imported.
            module = sys.modules.get(name)
            if type(module) is types.ModuleType and not is_library_module(name):
                self.node(module, name)
        self.attr_names.update(info.attrs)
        self.read_names.update(info.reads)
        if self._owner is None:
            self.attr_reads.update(info.read_attrs)
        else:
            self.owner_reads.setdefault(id(self._owner), set()).update(info.read_attrs)
        self.dynamic = self.dynamic or info.dynamic
        self.in_place = self.in_place or info.in_place
        node = self._memo(fn, Func(fn.__code__, id(fn.__globals__)))
        modname = fn.__module__
        module = sys.modules.get(modname) if isinstance(modname, str) else None
        if module is not None and vars(module) is fn.__globals__:
            self.fn_modules.setdefault(id(module), module)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # a name not assigned yet
                node.cells.append(None)
                continue
            node.cells.append(self._by_name(value, name))
            if name in info.read_names:
                self._counter(value)
        g = fn.__globals__
        for name in info.globals:
            value = g.get(name, MISSING)
            node.globals.append((name, None if value is MISSING else self._by_name(value, name)))
            if name in info.read_names:
                self._counter(value)
            if value is MISSING and name in _BUILTINS and not callable(_BUILTINS[name]):
                # A value put in `builtins` (`builtins.SCALE = 2.0`): read from there.
                self.attr_names.add(name)
                self._absolute(builtins)
        if info.all_globals:
            # A name computed at run time (`globals()[name]`): every other global of
            # its module is checked too; a function, class or module by identity (a
            # walk of each would reach the whole program).
            named = set(info.globals)
            for name, value in list(g.items()):
                if name in named or name.startswith("__"):
                    continue
                if isinstance(value, _BY_IDENTITY):
                    node.globals.append((name, Same(value)))
                else:
                    node.globals.append((name, self.node(value, name)))
        own = vars(fn)
        names_itself = fn.__name__ in info.globals or fn.__name__ in fn.__code__.co_freevars
        if own.keys() - _WRAPPER_ATTRS or names_itself:
            # (Empty too, for a function that names itself: `f.calls = getattr(f,
            # "calls", 0) + 1` adds its attribute on the first call.)
            # Attributes set on the function (`helper.scale = 2.0`) that code may read.
            self.held(own, f"{path}.__dict__")
        if fn.__defaults__ is not None:
            node.defaults = self._defaults(fn, info, f"{path} defaults")
        if fn.__kwdefaults__ is not None:
            node.kwdefaults = self.node(fn.__kwdefaults__, f"{path} defaults")
        return node

    def _defaults(self, fn: types.FunctionType, info: Any, path: str) -> Node:
        """`node` of `fn.__defaults__`, each default reached by its parameter's name,
        which the code spells: a list default it only appends to
        (`def step(x, traces=traces)`) is a log, as a global would be; one it reads
        otherwise (`len(h)`) is a counter (`_named`)."""
        values = fn.__defaults__ or ()
        prior = self.seen.get(id(values))
        if prior is not None:
            return Alias(prior)
        code = fn.__code__
        names = code.co_varnames[code.co_argcount - len(values) : code.co_argcount]
        seq = self._memo(values, Seq(tuple, []))
        for i, (name, v) in enumerate(zip(names, values, strict=True)):
            read = name in info.read_locals or name in info.read_names
            walk = self.node if read else self._by_name
            seq.items.append(walk(v, f"{path}[{i}]"))
        return seq

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
            self._array(x, path + jax.tree_util.keystr(k)) if is_array(x) else self._leaf(x)
            for k, x in zip(keys, leaves, strict=True)
        )
        for cls in node_types(treedef):
            if not is_library(cls):
                self._absolute(cls)
        for fn in static_callables(treedef):  # a captured Module's activation
            self.fixed(fn)
        return node

    def _leaf(self, x: Any) -> Node:
        return Const(x) if type(x) in CONST_TYPES else Same(x)

    def _object(self, value: Any, path: str) -> Node:
        """A user object: its attributes are walked in `finish`, those the walked code
        may read (`read_names`), once every name is known; the others are unchecked,
        so bookkeeping the function never reads (a step counter the training loop
        increments) does not trace it again."""
        t = type(value)
        self._absolute(t)
        node = self._memo(value, Obj(Same(t), [], []))
        if issubclass(t, _VALUE_TYPES):
            # A user's subclass of an immutable value (`class Mode(str)`, a tuple
            # subclass): its value is no attribute. Checked by identity as well: another
            # of the same class and attributes (`Mode("b")` bound over `Mode("a")`) holds
            # another value.
            node.ident = Same(value)
        d = getattr(value, "__dict__", None) if has_instance_dict(value) else None
        node.has_dict = d is not None
        self.pending.append(_Pending(node, value, d, path, every_attribute(t)))
        return node

    def _walk_pending(self) -> bool:
        """Walk the attributes of the objects met that the code read so far may read."""
        changed = False
        for p in self.pending:  # grows while walked: later objects are walked too
            every = p.every or self.dynamic
            for k, v in list(p.dict.items()) if p.dict is not None else ():
                if k not in p.done and (every or k in self.read_names):
                    p.done.add(k)
                    p.node.attrs.append((k, self._by_name(v, f"{p.path}.{k}")))
                    if issubclass(type(v), list) or type(v) in _ADDED_TO:
                        self.attr_lists.append((k, v, p.value))
                    changed = True
            for name in slot_names(type(p.value)):
                if name not in p.done and (every or name in self.read_names):
                    p.done.add(name)
                    changed = True
                    v = getattr(p.value, name, MISSING)
                    if v is not MISSING:
                        p.node.slots.append((name, self._by_name(v, f"{p.path}.{name}")))
                        if issubclass(type(v), list) or type(v) in _ADDED_TO:
                            self.attr_lists.append((name, v, p.value))
        return changed

    def _reads_by_name(self, value: Any) -> None:
        """A callable that reads attributes by the names it holds, not by names in
        code (`operator.attrgetter("s")`, `functools.partial(getattr, obj, "s")`):
        those names are read; every attribute may be, when they are not known."""
        names = _names_read_by(value)
        if names is None:
            self.dynamic = True
        else:
            parts = {part for name in names for part in name.split(".")}
            self.read_names.update(parts)
            # Read other than by appending: a list there is a counter (`_attr_read`).
            if self._owner is None:
                self.attr_reads.update(parts)
            else:
                self.owner_reads.setdefault(id(self._owner), set()).update(parts)

    def _holder(self, value: Any, kind: str, path: str) -> Node:
        """A weak reference, weak proxy or ContextVar: what it holds, read through it."""
        inner = deref(kind, value)
        if kind == "proxy" and (
            inner is MISSING or not repr(value).lower().endswith(f" at {id(inner):#x}>")
        ):
            return Same(value)  # dead, or not the object `referent` found: by identity
        node = self._memo(value, Deref(kind, type(value), Unchecked()))
        if inner is MISSING:
            node.inner = Const(MISSING)
        elif kind != "ctx" and is_array(inner):
            # No tracer can take the place of a weakly referenced array: a jax array
            # is checked by identity (it is immutable), a numpy array by a copy.
            node.inner = snapshot(inner) if isinstance(inner, np.ndarray) else Same(inner)
        else:
            node.inner = self.node(inner, f"{path}()" if kind == "ref" else path)
        return node

    def _modules(self, modules: dict[Any, Any]) -> Node:
        """`sys.modules`, however reached: the user modules in it, by name."""
        node = Modules(len(modules), [])
        self.sys_modules.append(node)
        for name, module in list(modules.items()):
            if isinstance(name, str) and not is_library_module(name):
                node.items.append((name, self.node(module, f"sys.modules[{name!r}]")))
        return node

    def _globals_read(self) -> bool:
        """Code that reads a function's `__globals__` (`helper.__globals__["s"]`, with
        `helper` from another module) reads that module's globals by name: each user
        module of a function met is checked as a module read by name is (`_reads`).
        Whether one was added."""
        if "__globals__" not in self.attr_names:
            return False
        added = False
        for key, module in list(self.fn_modules.items()):
            if key not in self.absolute and not is_library_module(module.__name__):
                self._absolute(module)
                added = True
        return added

    def _modules_grown(self) -> bool:
        """Modules imported while walking (a library's attribute loaded lazily, on first
        read): their size is the one checked, and a user module among them is walked."""
        grew = False
        for node in self.sys_modules:
            if node.size == len(sys.modules):
                continue
            named = {name for name, _ in node.items}
            for name, module in list(sys.modules.items()):
                if isinstance(name, str) and name not in named and not is_library_module(name):
                    node.items.append((name, self.node(module, f"sys.modules[{name!r}]")))
                    grew = True
            node.size = len(sys.modules)
        return grew

    def _library(self, obj: Any) -> None:
        """Library code the function may call, or an object of a library's: unless the
        library is one known to read no attribute of the objects it is given but
        their array protocols (jax, numpy, optax...), every instance attribute of the
        objects the walk meets counts as read (`copy`, `json`, `pickle` read any)."""
        if not self.dynamic and reads_any_attribute(obj):
            self.dynamic = True

    def _note_keys(self, keys: Any) -> None:
        for k in list(keys):
            if type(k) not in CONST_TYPES:
                self.keyed[id(k)] = k


_SKIPPED_DESCRIPTORS = (types.MemberDescriptorType, types.GetSetDescriptorType)
# Method descriptors that are not callable themselves, and what each holds of the user's
# (a property or classmethod of a function is walked as a method, `_attr`; this is for
# one of a partial, an `operator.attrgetter`, a callable object).
_METHOD_DESCRIPTORS: dict[type, tuple[str, ...]] = {
    functools.partialmethod: ("func", "args", "keywords"),
    functools.singledispatchmethod: ("dispatcher", "func"),
    property: ("fget",),
    classmethod: ("__func__",),
}
_BUILTIN_CONTAINERS = frozenset({list, tuple, dict, set, frozenset})
# The containers other than lists that a function may only add to (a log) or also
# read (a counter): `Snap.read`.
_ADDED_TO = (set, collections.deque)

_BUILTIN_CONTAINER_TYPES = (*_BUILTIN_CONTAINERS, collections.deque, bytearray)
_VALUE_TYPES = (int, float, complex, str, bytes, tuple)
_CONTAINERS = (*_BUILTIN_CONTAINER_TYPES, collections.abc.Mapping)


def _user_container(value: Any) -> bool:
    """A container of a user's class (not a library's): a subclass of list, tuple, dict,
    set, frozenset (a NamedTuple), deque or bytearray, or a Mapping."""
    return isinstance(value, _CONTAINERS) and not is_library(type(value))


class _Pending:
    """An object met by the walk, whose attributes are walked in `finish`."""

    __slots__ = ("dict", "done", "every", "node", "path", "value")

    def __init__(self, node: Obj, value: Any, d: dict[str, Any] | None, path: str, every: bool):
        self.node = node
        self.value = value
        self.dict = d
        self.path = path
        self.every = every
        self.done: set[str] = set()


def _plain_attributes(t: type) -> bool:
    return t.__getattribute__ is object.__getattribute__


_BY_NAME_BUILTINS = (getattr, hasattr, setattr, delattr)
# Builtins that read attributes named by a value, or every one: reached as a value
# (not called by name, which `_codeinfo` sees), they make the walk `dynamic`.
_READS_ANY_ATTRIBUTE = (*_BY_NAME_BUILTINS, vars, eval, exec)
# The other globals of a function that reads one by a computed name: checked by identity.
_BY_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)


def _names_read_by(value: Any) -> tuple[str, ...] | None:
    """The attribute names `value` reads when called, where it holds them: () for a
    callable that holds none, None when they are not known."""
    if isinstance(value, (operator.attrgetter, operator.methodcaller)):
        held: Any = value.__reduce__()  # (type, args), or (partial(type, name), args)
        args = held[1] if isinstance(held[0], type) else held[0].args
        names = args if isinstance(value, operator.attrgetter) else args[:1]
        return tuple(names) if all(isinstance(n, str) for n in names) else None
    if isinstance(value, functools.partial) and any(value.func is f for f in _BY_NAME_BUILTINS):
        name = value.args[1] if len(value.args) > 1 else None
        return (name,) if isinstance(name, str) else None
    return ()
