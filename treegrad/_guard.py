"""Guards: where a function reads its values from, checked on every call.

When the engine compiles a function, `walk` visits everything the function
can read: its closure cells, the globals its code names, its defaults, and,
recursively, the user functions, methods, partials, `jax.jit` helpers,
containers, objects, classes and modules it reaches. The result is a tree of
`Node`s that remembers, for each place, what was there: an array (a *place*,
numbered in walk order), a number or string (checked by value), a library
object (checked by identity), or a container to descend into.

A cache hit then runs the node tree as a *guard*: straight-line Python
generated once per entry (`Guard`), the way TorchDynamo guards compiled
frames, which re-reads every place from the function being called, checks each
non-array value and collects the arrays in place order. So every value the
function reads is fresh, and the hit path builds no trees. A failed check means
the entry does not apply and the engine re-traces.

The same tree drives tracing: `Swap` puts tracers into the places (the user's
own containers, cells and globals) while the function is traced, records what
the function rebinds there (an in-place update inside a compiled step), and
puts everything back. So the function runs against its real objects, identity
and side effects included, exactly as it would run uncompiled.

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
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ._module import Module
from ._paths import rebind

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
            and name.partition(".")[0] in _LIBRARY_ROOTS
            and name not in _APPLICATIONS
        )
    return r


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
        r = isinstance(x, Module) or not jax.tree_util.treedef_is_leaf(
            jax.tree_util.tree_structure(x)
        )
        _PYTREE_NODE[t] = r
    return r


def clear() -> None:
    """Forget every memo (`tg.clear_cache`)."""
    _CODE_INFO.clear()
    _PYTREE_NODE.clear()
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
        self.type = typ
        self.items = items


class Map(Node):
    __slots__ = ("items", "type")

    def __init__(self, typ: type, items: list[tuple[Any, Node]]):
        self.type = typ
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
        self.type = typ
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
        self.type = typ
        self.attrs = attrs
        self.slots = slots


class Tree(Node):
    """A registered pytree (a Module, an optimiser state, an equinox module).

    Checked by its treedef (which holds its static data) and its leaves.
    """

    __slots__ = ("leaves", "treedef")

    def __init__(self, treedef: Any, leaves: list[Node]):
        self.treedef = treedef
        self.leaves = leaves


class ParamsNode(Node):
    __slots__ = ("source",)

    def __init__(self, source: Node):
        self.source = source


class Descr(Node):
    """A static method, class method or property: the function behind it."""

    __slots__ = ("attr", "inner", "type")

    def __init__(self, typ: type, attr: str, inner: Node):
        self.type = typ
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
                node = nodes[key] = Attrs(Same(obj), [])
                done[key] = set()
                if isinstance(obj, type):
                    for name, value in list(vars(obj).items()):
                        if name not in _SKIP_CLASS_ATTRS and _code_of(value) is not None:
                            node.attrs.append((name, self._attr(obj, name, value)))
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
            return self._tree(value, path)
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


@functools.cache
def _slot_names(t: type) -> tuple[str, ...]:
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


# --- the guard: generated straight-line Python ----------------------------------


class Guard:
    """`guard(*roots)` returns the arrays at every place, in place order, or None.

    Generated once per cache entry from its node tree: one flat function with
    one check per place, so a hit costs a few attribute and dict reads per
    value the function can read, and no Python objects per array.
    """

    def __init__(self, roots: list[Node], absolute: list[Node]):
        self.ns: dict[str, Any] = {
            "ARR": _ARRAY_TYPES,
            "isarr": is_array,
            "MISSING": MISSING,
            "FunctionType": types.FunctionType,
            "MethodType": types.MethodType,
            "flatten": jax.tree_util.tree_flatten,
        }
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.n = 0
        args = [f"r{i}" for i in range(len(roots))]
        for node, arg in zip(roots, args, strict=True):
            self._gen(node, arg, 1)
        for node in absolute:
            self._gen(node, None, 1)
        body = "\n".join(self.lines) or "    pass"
        head = f"def guard({', '.join(args)}):\n    out = []\n    push = out.append\n"
        src = f"{head}{body}\n    return out\n"
        exec(compile(src, "<treegrad guard>", "exec"), self.ns)
        self.check: Callable[..., list[Any] | None] = self.ns["guard"]
        self.source = src

    def _k(self, obj: Any) -> str:
        name = f"K{len(self.ns)}"
        self.ns[name] = obj
        return name

    def _v(self) -> str:
        self.n += 1
        return f"v{self.n}"

    def _emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    def _fail_unless(self, depth: int, cond: str) -> None:
        self._emit(depth, f"if not ({cond}): return None")

    def _gen(self, node: Node, v: str | None, d: int) -> None:
        if v is not None:
            self.names[id(node)] = v
        if isinstance(node, Array):
            self._fail_unless(d, f"type({v}) in ARR or isarr({v})")
            self._emit(d, f"push({v})")
        elif isinstance(node, Const):
            self._const(node.value, v, d)
        elif isinstance(node, Same):
            k = self._k(node.ref)
            self._fail_unless(d, f"{v} is {k}()" if node.weak else f"{v} is {k}")
        elif isinstance(node, Unchecked):
            pass
        elif isinstance(node, Alias):
            self._fail_unless(d, f"{v} is {self.names[id(node.target)]}")
        elif isinstance(node, Seq):
            self._fail_unless(
                d, f"type({v}) is {self._k(node.type)} and len({v}) == {len(node.items)}"
            )
            for i, child in enumerate(node.items):
                w = self._v()
                self._emit(d, f"{w} = {v}[{i}]")
                self._gen(child, w, d)
        elif isinstance(node, Map):
            self._fail_unless(
                d, f"type({v}) is {self._k(node.type)} and len({v}) == {len(node.items)}"
            )
            for key, child in node.items:
                w = self._v()
                self._emit(d, f"{w} = {v}.get({self._k(key)}, MISSING)")
                self._gen(child, w, d)
        elif isinstance(node, Func):
            self._func(node, v, d)  # type: ignore[arg-type]  # roots and children have a name
        elif isinstance(node, Method):
            self._fail_unless(d, f"type({v}) is MethodType")
            for attr, child in (("__self__", node.self_), ("__func__", node.func)):
                w = self._v()
                self._emit(d, f"{w} = {v}.{attr}")
                self._gen(child, w, d)
        elif isinstance(node, Partial):
            self._fail_unless(d, f"type({v}) is {self._k(node.type)}")
            for attr, child in (
                ("func", node.func),
                ("args", node.args),
                ("keywords", node.keywords),
            ):
                w = self._v()
                self._emit(d, f"{w} = {v}.{attr}")
                self._gen(child, w, d)
        elif isinstance(node, Jitted):
            self._fail_unless(d, f"type({v}) is {self._k(_JITTED_TYPE)}")
            w = self._v()
            self._emit(d, f"{w} = getattr({v}, '__wrapped__', MISSING)")
            self._gen(node.inner, w, d)
        elif isinstance(node, Descr):
            self._fail_unless(d, f"type({v}) is {self._k(node.type)}")
            w = self._v()
            self._emit(d, f"{w} = {v}.{node.attr}")
            self._gen(node.inner, w, d)
        elif isinstance(node, Obj):
            self._fail_unless(d, f"type({v}) is {self._k(node.type.ref)}()")
            if node.attrs:
                dv = self._v()
                self._emit(d, f"{dv} = {v}.__dict__")
                self._fail_unless(d, f"len({dv}) == {len(node.attrs)}")
                for name, child in node.attrs:
                    w = self._v()
                    self._emit(d, f"{w} = {dv}.get({name!r}, MISSING)")
                    self._gen(child, w, d)
            for name, child in node.slots:
                w = self._v()
                self._emit(d, f"{w} = getattr({v}, {name!r}, MISSING)")
                self._gen(child, w, d)
        elif isinstance(node, Tree):
            leaves, td = self._v(), self._v()
            self._emit(d, f"{leaves}, {td} = flatten({v})")
            self._fail_unless(d, f"{td} == {self._k(node.treedef)}")
            if all(isinstance(leaf, Array) for leaf in node.leaves):
                self._fail_unless(
                    d, f"ARR.issuperset(map(type, {leaves})) or all(map(isarr, {leaves}))"
                )
                self._emit(d, f"out.extend({leaves})")
            else:
                for i, leaf in enumerate(node.leaves):
                    w = self._v()
                    self._emit(d, f"{w} = {leaves}[{i}]")
                    self._gen(leaf, w, d)
        elif isinstance(node, ParamsNode):
            from ._params import Params

            self._fail_unless(d, f"type({v}) is {self._k(Params)}")
            w = self._v()
            self._emit(d, f"{w} = {v}._sources")
            self._gen(node.source, w, d)
        elif isinstance(node, Fixed):
            obj = self._v()
            self._emit(d, f"{obj} = {self._k(node.obj.ref)}()")
            self._func(node.func, obj, d)  # type: ignore[arg-type]  # Fixed holds a Func
        elif isinstance(node, Attrs):
            obj = self._v()
            k = self._k(node.obj.ref)
            self._emit(d, f"{obj} = {k}()" if node.obj.weak else f"{obj} = {k}")
            self._fail_unless(d, f"{obj} is not None")
            dv = self._v()
            self._emit(d, f"{dv} = vars({obj})")
            for name, child in node.attrs:
                w = self._v()
                self._emit(d, f"{w} = {dv}.get({name!r}, MISSING)")
                self._gen(child, w, d)
        else:  # pragma: no cover - every node type is handled above
            raise AssertionError(type(node))

    def _const(self, value: Any, v: str | None, d: int) -> None:
        if value is None or value is True or value is False or value is Ellipsis:
            self._fail_unless(d, f"{v} is {value!r}")
        elif isinstance(value, float) and value != value:
            self._fail_unless(d, f"type({v}) is float and {v} != {v}")
        else:
            k = self._k(value)
            self._fail_unless(d, f"{v} is {k} or (type({v}) is type({k}) and {v} == {k})")

    def _func(self, node: Func, v: str, d: int) -> None:
        self._fail_unless(d, f"type({v}) is FunctionType and {v}.__code__ is {self._k(node.code)}")
        if node.cells:
            cl = self._v()
            self._emit(d, f"{cl} = {v}.__closure__")
            for i, child in enumerate(node.cells):
                if child is None:
                    self._emit(d, "try:")
                    self._emit(d + 1, f"{cl}[{i}].cell_contents")
                    self._emit(d, "except ValueError:")
                    self._emit(d + 1, "pass")
                    self._emit(d, "else:")
                    self._emit(d + 1, "return None")
                    continue
                w = self._v()
                self._emit(d, "try:")
                self._emit(d + 1, f"{w} = {cl}[{i}].cell_contents")
                self._emit(d, "except ValueError:")
                self._emit(d + 1, "return None")
                self._gen(child, w, d)
        if node.globals:
            g = self._v()
            self._emit(d, f"{g} = {v}.__globals__")
            for name, child in node.globals:
                if child is None:
                    self._fail_unless(d, f"{name!r} not in {g}")
                    continue
                w = self._v()
                self._emit(d, f"{w} = {g}.get({name!r}, MISSING)")
                self._gen(child, w, d)
        for attr, child in (("__defaults__", node.defaults), ("__kwdefaults__", node.kwdefaults)):
            w = self._v()
            self._emit(d, f"{w} = {v}.{attr}")
            if child is None:
                self._fail_unless(d, f"{w} is None")
            else:
                self._gen(child, w, d)


# --- swapping values into the places, and back ----------------------------------


class CannotSwap(TypeError):
    """A place that cannot be written (an immutable object that is not a tuple)."""


class Swap:
    """Writes new values into the places of a node tree, in the user's own objects.

    `values[place]` is the new value of each place (`MISSING`: leave it). Every
    write is recorded, so `restore()` puts back exactly what was there. While
    tracing, `inline` replaces `jax.jit` helpers by their wrapped function.
    """

    def __init__(self, values: list[Any], *, inline: bool = True, record: bool = True):
        self.values = values
        self.inline = inline
        self.record = record
        self.undo: list[Callable[[], None]] = []

    def restore(self) -> None:
        while self.undo:
            self.undo.pop()()

    def _log(self, fn: Callable[[], None]) -> None:
        if self.record:
            self.undo.append(fn)

    def put(self, node: Node, v: Any) -> Any:
        """Write into `v` in place; return `v`, or its replacement if `v` is immutable."""
        if isinstance(node, Array):
            new = self.values[node.place]
            return v if new is MISSING else new
        if isinstance(node, Seq):
            if type(v) is list:
                for i, child in enumerate(node.items):
                    self._set_item(v, i, self.put(child, v[i]))
                return v
            items = [self.put(child, x) for child, x in zip(node.items, v, strict=True)]
            if all(a is b for a, b in zip(items, v, strict=True)):
                return v
            return type(v)._make(items) if hasattr(v, "_fields") else type(v)(items)
        if isinstance(node, Map):
            for key, child in node.items:
                self._set_item(v, key, self.put(child, v[key]))
            return v
        if isinstance(node, Func):
            self._func(node, v)
            return v
        if isinstance(node, Method):
            if self.put(node.self_, v.__self__) is not v.__self__:
                raise CannotSwap(f"cannot write into the object bound to {v!r}")
            self.put(node.func, v.__func__)
            return v
        if isinstance(node, Partial):
            func = self.put(node.func, v.func)
            args = self.put(node.args, v.args)
            self.put(node.keywords, v.keywords)
            if func is not v.func or args is not v.args:
                old = v.__reduce__()[2]
                self._log(lambda: v.__setstate__(old))
                v.__setstate__((func, args, v.keywords, getattr(v, "__dict__", None) or None))
            return v
        if isinstance(node, Jitted):
            inner = v if type(v) is types.FunctionType else v.__wrapped__
            self.put(node.inner, inner)
            return inner if self.inline else v
        if isinstance(node, Descr):
            self.put(node.inner, getattr(v, node.attr))
            return v
        if isinstance(node, Obj):
            d = getattr(v, "__dict__", None)
            for name, child in node.attrs:
                self._set_item(d, name, self.put(child, d[name]))  # type: ignore[index]
            for name, child in node.slots:
                self._set_attr(v, name, self.put(child, getattr(v, name)))
            return v
        if isinstance(node, Tree):
            return self._tree(node, v)
        if isinstance(node, ParamsNode):
            self.put(node.source, v._sources)  # a list: rebound in place
            return v
        if isinstance(node, Fixed):
            self._func(node.func, node.obj.get())  # type: ignore[arg-type]  # Fixed holds a Func
            return v
        if isinstance(node, Attrs):
            obj = node.obj.get()
            d = vars(obj)
            for name, child in node.attrs:
                new = self.put(child, d[name])
                if new is not d[name]:
                    self._set_attr(obj, name, new, plain=False)
            return obj
        return v  # Const, Same, Unchecked, Alias: nothing to write

    def _set_item(self, container: Any, key: Any, new: Any) -> None:
        old = container[key]
        if new is not old:
            self._log(lambda: container.__setitem__(key, old))
            container[key] = new

    def _set_attr(self, obj: Any, name: str, new: Any, plain: bool = True) -> None:
        old = getattr(obj, name)
        if new is old:
            return
        # Frozen dataclass-style models (equinox) refuse setattr; object.__setattr__
        # is how their own tree-surgery helpers write, and it cannot be intercepted.
        setter = object.__setattr__ if plain else setattr
        self._log(lambda: setter(obj, name, old))
        setter(obj, name, new)

    def _func(self, node: Func, fn: types.FunctionType) -> None:
        for cell, child in zip(fn.__closure__ or (), node.cells, strict=True):
            if child is None:
                continue
            old = cell.cell_contents
            new = self.put(child, old)
            if new is not old:
                self._log(lambda cell=cell, old=old: setattr(cell, "cell_contents", old))
                cell.cell_contents = new
        g = fn.__globals__
        for name, child in node.globals:
            if child is not None:
                self._set_item(g, name, self.put(child, g[name]))
        if node.defaults is not None:
            defaults = self.put(node.defaults, fn.__defaults__)
            if defaults is not fn.__defaults__:
                self._set_attr(fn, "__defaults__", defaults, plain=False)
        if node.kwdefaults is not None:
            self.put(node.kwdefaults, fn.__kwdefaults__)

    def _tree(self, node: Tree, v: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(v)
        new = [self.put(child, x) for child, x in zip(node.leaves, leaves, strict=True)]
        changed = {id(a): b for a, b in zip(leaves, new, strict=True) if a is not b}
        if not changed:
            return v
        try:
            rebind(v, changed)
        except TypeError:
            # Not writable in place (an immutable pytree): the parent rebinds a new one.
            return jax.tree_util.tree_unflatten(treedef, new)
        self._log(lambda: _restore_tree(v, treedef, leaves))
        return v


def _restore_tree(v: Any, treedef: Any, leaves: list[Any]) -> None:
    """Put the original leaves back by position, whatever the trace rebound meanwhile."""
    now, now_def = jax.tree_util.tree_flatten(v)
    if now_def != treedef:
        raise Unsettled(f"the structure of a captured {type(v).__name__} changed while tracing")
    back = {id(b): a for a, b in zip(leaves, now, strict=True) if a is not b}
    if back:
        rebind(v, back)


# --- after a trace: what the function changed ------------------------------------


class Unsettled(Exception):
    """The trace changed where arrays live (not only their values): not cacheable."""


class Settle:
    """Compare the places after a trace with what was put there.

    Array places now holding another array were rebound by the function (an
    in-place update): they go into `written`. Numbers and containers the
    function changed itself (counters, logs) are demoted to `Unchecked`: they
    are its outputs, not its inputs. `node(n, v)` returns the node to guard from now on.
    """

    def __init__(self, put: list[Any], written: dict[int, Any]):
        self.put = put
        self.written = written
        self.values: dict[int, Any] = {}
        self.demoted = False

    def _demote(self, node: Node, v: Any) -> Node:
        if _has_places(node) or is_array(v):
            raise Unsettled
        if not isinstance(node, Unchecked):
            self.demoted = True
        return Unchecked()

    def _container(self, node: Node, children: list[Node]) -> Node:
        # A container the function wrote into (a counter dict, a log list) is its
        # output as a whole: another function's writes to it must not invalidate
        # this one's guard.
        if any(isinstance(c, Unchecked) for c in children) and not _has_places(node):
            self.demoted = True
            return Unchecked()
        return node

    def node(self, node: Node, v: Any) -> Node:
        self.values[id(node)] = v
        if isinstance(node, Array):
            if v is not self.put[node.place]:
                if not is_array(v):
                    raise Unsettled
                self.written[node.place] = v
            return node
        if isinstance(node, Const):
            if v is node.value or (type(v) is type(node.value) and _equal(v, node.value)):
                return node
            return self._demote(node, v)
        if isinstance(node, Same):
            return node if v is node.get() else self._demote(node, v)
        if isinstance(node, Unchecked):
            if is_array(v):
                raise Unsettled
            return node
        if isinstance(node, Alias):
            if v is not self.values.get(id(node.target)):
                raise Unsettled
            return node
        if isinstance(node, Seq):
            if type(v) is not node.type or len(v) != len(node.items):
                return self._demote(node, v)
            node.items = [self.node(c, x) for c, x in zip(node.items, v, strict=True)]
            return self._container(node, [c for c in node.items])
        if isinstance(node, Map):
            if type(v) is not node.type or len(v) != len(node.items):
                return self._demote(node, v)
            items = []
            for key, child in node.items:
                if key not in v:
                    return self._demote(node, v)
                items.append((key, self.node(child, v[key])))
            node.items = items
            return self._container(node, [c for _, c in items])
        if isinstance(node, Func):
            if type(v) is not types.FunctionType or v.__code__ is not node.code:
                return self._demote(node, v)
            cells = []
            for cell, child in zip(v.__closure__ or (), node.cells, strict=True):
                try:
                    value = cell.cell_contents
                except ValueError:
                    value = MISSING
                if child is None:
                    cells.append(None if value is MISSING else self._demote(Unchecked(), value))
                else:
                    cells.append(
                        self._demote(child, value) if value is MISSING else self.node(child, value)
                    )
            node.cells = cells
            g = v.__globals__
            names: list[tuple[str, Node | None]] = []
            for name, child in node.globals:
                value = g.get(name, MISSING)
                if child is None:
                    names.append(
                        (name, None if value is MISSING else self._demote(Unchecked(), value))
                    )
                else:
                    names.append(
                        (
                            name,
                            self._demote(child, value)
                            if value is MISSING
                            else self.node(child, value),
                        )
                    )
            node.globals = names
            if node.defaults is not None:
                node.defaults = self.node(node.defaults, v.__defaults__)
            if node.kwdefaults is not None:
                node.kwdefaults = self.node(node.kwdefaults, v.__kwdefaults__)
            return node
        if isinstance(node, Method):
            if type(v) is not types.MethodType:
                return self._demote(node, v)
            node.self_ = self.node(node.self_, v.__self__)
            node.func = self.node(node.func, v.__func__)
            return node
        if isinstance(node, Partial):
            if type(v) is not node.type:
                return self._demote(node, v)
            node.func = self.node(node.func, v.func)
            node.args = self.node(node.args, v.args)
            node.keywords = self.node(node.keywords, v.keywords)
            return node
        if isinstance(node, Jitted):
            inner = v if type(v) is types.FunctionType else getattr(v, "__wrapped__", MISSING)
            node.inner = self.node(node.inner, inner)
            return node
        if isinstance(node, Descr):
            if type(v) is not node.type:
                return self._demote(node, v)
            node.inner = self.node(node.inner, getattr(v, node.attr))
            return node
        if isinstance(node, Obj):
            if type(v) is not node.type.get():
                return self._demote(node, v)
            d = getattr(v, "__dict__", {})
            if len(d) != len(node.attrs) or any(k not in d for k, _ in node.attrs):
                return self._demote(node, v)
            node.attrs = [(k, self.node(c, d[k])) for k, c in node.attrs]
            node.slots = [(k, self.node(c, getattr(v, k, MISSING))) for k, c in node.slots]
            return node
        if isinstance(node, Tree):
            leaves, treedef = jax.tree_util.tree_flatten(v)
            if treedef != node.treedef:
                return self._demote(node, v)
            node.leaves = [self.node(c, x) for c, x in zip(node.leaves, leaves, strict=True)]
            return node
        if isinstance(node, ParamsNode):
            node.source = self.node(node.source, v._sources)
            return node
        if isinstance(node, Fixed):
            node.func = self.node(node.func, node.obj.get())
            return node
        if isinstance(node, Attrs):
            d = vars(node.obj.get())
            attrs = []
            for name, child in node.attrs:
                value = d.get(name, MISSING)
                attrs.append(
                    (
                        name,
                        self._demote(child, value) if value is MISSING else self.node(child, value),
                    )
                )
            node.attrs = attrs
            return node
        raise AssertionError(type(node))  # pragma: no cover


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and a != a:
        return b != b
    return bool(a == b)


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


def _has_places(node: Node) -> bool:
    return isinstance(node, Array) or any(_has_places(c) for c in children(node))
