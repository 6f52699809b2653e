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

import array
import collections
import collections.abc
import contextvars
import copy
import types
import weakref
from typing import Any

import numpy as np

from ._kinds import CONST_TYPES, PROXY_TYPES, is_pytree_node

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()


# --- the node tree ------------------------------------------------------------


class Node:
    """What was found at one place; subclasses say how to check and rebind it.

    `ident` (set by the walk on a container, object or function used as a dict
    key or set element elsewhere in what the function reads, where its class
    hashes by identity): the object itself, checked by identity as well as by its
    contents; unset otherwise (read with `getattr(node, "ident", None)`).
    """

    __slots__ = ("ident",)
    ident: Same


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


class Snap(Node):
    """A mutable value the walk cannot see into but can compare (a set, a deque, a
    bytearray, a numpy array of strings or one read as a value (`Walk.as_values`), a
    Mapping that is not a dict: `os.environ`, a `ChainMap`, a `MappingProxyType`): a
    copy, checked by equality; `as_dict`: compared as `dict(v)`, its keys in order (a
    function may iterate it, as a dict). A deque or Mapping holding other values (a
    queue of batches, a read-only view of functions) is compared item by item by
    identity (`Held`)."""

    __slots__ = ("as_dict", "copied", "held", "read", "type", "value")

    def __init__(
        self,
        typ: type,
        value: Any,
        as_dict: bool = False,
        copied: bool = False,
        held: Held | None = None,
    ):
        self.type: Any = typ
        self.value = value
        self.as_dict = as_dict
        self.copied = copied  # a numpy array read as a value: traced on a copy (`Swap`)
        self.held = held
        # A set or deque some walked code reads other than by adding to it (`len(seen)`):
        # a counter, not a log (`_settle`, as `Seq.read`).
        self.read = False

    def equal(self, v: Any) -> bool:
        if type(v) is not self.type:
            return False
        if self.held is not None:
            return self.match(v) is True
        if self.type is memoryview:
            return _memory(v) == self.value
        if isinstance(v, np.ndarray):
            return same_array(v, self.value)
        if self.as_dict:
            d = dict(v)
            return bool(d == self.value) and list(d) == list(self.value)
        return bool(v == self.value)

    def match(self, v: Any, traced: bool = False) -> bool | None:
        """For a `held` Snap of `v`'s type: `Held.match` of its items (None as well when
        a Mapping's keys changed)."""
        assert self.held is not None
        if self.as_dict:
            d = dict(v)
            return self.held.match(d.values(), traced) if list(d) == self.value else None
        return self.held.match(v, traced)

    def size(self) -> int:
        return len(self.held.refs) if self.held is not None else len(self.value)


class Held:
    """The items of a container the walk does not see into, compared by identity
    without keeping them alive (weakly where they allow it: the cache holds no user
    arrays), and a numpy array among them by value too: numpy changes it in place,
    and the trace took its contents as a constant (of a deque: of a copy, `Swap`)."""

    __slots__ = ("arrays", "refs")

    def __init__(self, items: Any):
        self.refs: list[tuple[Any, bool]] = []
        self.arrays: list[tuple[int, np.ndarray]] = []  # (position, a copy)
        for i, x in enumerate(items):
            try:
                self.refs.append((weakref.ref(x), True))
            except TypeError:  # an int, a str, a list: held (a number is no user array)
                self.refs.append((x, False))
            if isinstance(x, np.ndarray):
                self.arrays.append((i, x.copy()))

    def match(self, items: Any, traced: bool = False) -> bool | None:
        """None: other items (by identity) or another number of them; else whether each
        numpy array holds what it held. `traced`: just after the trace, when a deque's
        numpy arrays are still the copies the trace read (compared by value only)."""
        xs = list(items)
        if len(xs) != len(self.refs):
            return None
        skip = {i for i, _ in self.arrays} if traced else set()
        for i, (x, (ref, weak)) in enumerate(zip(xs, self.refs, strict=True)):
            if i in skip:
                if not isinstance(x, np.ndarray):
                    return None
            elif (ref() if weak else ref) is not x:
                return None
        return all(same_array(xs[i], old) for i, old in self.arrays)


def _memory(v: memoryview) -> tuple[Any, ...] | None:
    """What a memoryview shows (None once released): the memory it views (a numpy
    array's, a bytearray's) may change in place under the same view."""
    try:
        return (v.format, v.shape, v.tobytes())
    except ValueError:  # released
        return None


def same_array(v: np.ndarray, old: np.ndarray) -> bool:
    """Whether a numpy array holds what `old` holds (shape, dtype and values)."""
    if v.shape != old.shape or v.dtype != old.dtype:
        return False
    # A NaN in a captured numpy array is the same value on the next call.
    return bool(np.array_equal(v, old, equal_nan=old.dtype.kind in "fc"))


class Unchecked(Node):
    """A value the function itself changes while it is traced, no longer an input: a
    log it appends to (or a counter, in a trace that is not reused: `Settle._changed`)."""

    __slots__ = ()


class Alias(Node):
    """A container, object or function already reached by another route: the same object."""

    __slots__ = ("target",)

    def __init__(self, target: Node):
        self.target = target


class Seq(Node):
    """A list or tuple: its items. `read`: a list some walked code reads other than by
    appending to it (`len(log)`), which makes it a counter, not a log (`_settle`)."""

    __slots__ = ("items", "read", "type")

    def __init__(self, typ: type, items: list[Node]):
        self.type: Any = typ
        self.items = items
        self.read = False


class Map(Node):
    """A dict: its entries by key. `ordered`: False once the function itself changed
    the order of its keys (an output of the function, as a value it changes is)."""

    __slots__ = ("items", "ordered", "type")

    def __init__(self, typ: type, items: list[tuple[Any, Node]]):
        self.type: Any = typ
        self.items = items
        self.ordered = True


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
    """A `jax.jit` or `tg.jit` helper: its wrapped function, inlined while tracing.

    jax caches a jitted function's trace by the function and its arguments, not
    by what it closes over, so calling the helper itself would reuse a trace
    holding old captured arrays as constants. Inlining it makes them inputs (and
    what a `tg.jit` helper writes into its captures, writes of the outer trace).
    """

    __slots__ = ("inner", "type")

    def __init__(self, inner: Node, type_: type):
        self.inner = inner
        self.type = type_


class Obj(Node):
    """A user object that is not a pytree: the instance attributes and slots the
    walked code may read (`skipped`: the other attribute names of its instance
    dict, unchecked; `has_dict`: it has an instance dict, whose size is checked,
    even when empty, so that an attribute added later is seen)."""

    __slots__ = ("attrs", "has_dict", "skipped", "slots", "type")

    def __init__(self, typ: Same, attrs: list[tuple[str, Node]], slots: list[tuple[str, Node]]):
        self.type: Any = typ
        self.attrs = attrs
        self.slots = slots
        self.has_dict = True
        self.skipped: list[str] = []


class Deref(Node):
    """A holder of one value, read through it on each call: a weak reference
    (`kind` "ref": `v()`), a weak proxy ("proxy": the object it stands for), a
    `ContextVar` ("ctx": its value in the calling context, MISSING when unset)."""

    __slots__ = ("inner", "kind", "type")

    def __init__(self, kind: str, typ: type, inner: Node):
        self.kind = kind
        self.type: Any = typ
        self.inner = inner


def referent(proxy: Any) -> Any:
    """The object a weak proxy stands for: its bound `__getattribute__`'s `__self__`
    (the proxy forwards every attribute read). Raises ReferenceError when it is dead."""
    return proxy.__getattribute__.__self__


def deref(kind: str, v: Any) -> Any:
    """The value a `Deref` holder gives (MISSING: a dead proxy, an unset ContextVar)."""
    try:
        if kind == "ref":
            return v()
        if kind == "proxy":
            return referent(v)
        return v.get()
    except (ReferenceError, LookupError):
        return MISSING


def holder_kind(t: type) -> str | None:
    """The `Deref` kind of a holder type, or None."""
    if t in PROXY_TYPES:
        return "proxy"
    if issubclass(t, weakref.ref):
        return "ref"
    if t is contextvars.ContextVar:
        return "ctx"
    return None


# Mutable containers the walk does not see into, compared by a copy of their contents
# when every element is a number or string (otherwise: by identity, as before).
_SNAP_TYPES = (set, frozenset, bytearray, collections.deque, array.array)


def snapshot(value: Any) -> Snap | None:
    """A `Snap` of `value` when it is one of the mutable values compared by a copy."""
    t = type(value)
    if isinstance(value, np.ndarray):  # of strings, bytes, dates, or objects
        if value.dtype.kind == "O" and not all(type(x) in CONST_TYPES for x in value.flat):
            return None
        return Snap(t, value.copy())
    if t is memoryview:
        shown = _memory(value)
        return None if shown is None else Snap(t, shown)
    if isinstance(value, _SNAP_TYPES):
        if all(type(x) in CONST_TYPES for x in value):
            return Snap(t, copy.copy(value))
        if isinstance(value, collections.deque):
            # Of arrays or objects (a queue of batches): which ones, in order, so that
            # one taken out (`popleft`, `queue.Queue.get`) is seen.
            return Snap(t, None, held=Held(value))
        return None
    if isinstance(value, collections.abc.Mapping) and not is_pytree_node(value):
        # os.environ, a ChainMap, a MappingProxyType: compared as a dict of their items.
        try:
            items = dict(value)
        except Exception:  # a user's Mapping whose iteration fails: left to identity
            return None
        if all(type(x) in CONST_TYPES for x in items.values()):
            return Snap(t, items, as_dict=True)
        if t is types.MappingProxyType or t is collections.ChainMap:
            # Of functions, objects or arrays (a read-only view of a dict of helpers):
            # the keys in order and each value by identity, a numpy array's contents
            # too. (Other Mappings are walked as objects: a ConfigParser's sections.)
            return Snap(t, list(items), as_dict=True, held=Held(items.values()))
    return None


class Modules(Node):
    """`sys.modules`: the user modules in it, by name, and its size (a module imported
    since, under a name the function may look up, is seen). Library modules are not
    checked: a walk of every module would be the cost of each call."""

    __slots__ = ("items", "size")

    def __init__(self, size: int, items: list[tuple[str, Node]]):
        self.size = size
        self.items = items


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
    """A user function or callable held by static data (a Module's activation, a
    callable object, a bound method, a partial): guarded as a root, held by `obj`."""

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


def children(node: Node) -> list[Node]:
    """A node's children, in the order the guard reads them."""
    if isinstance(node, Seq):
        return node.items
    if isinstance(node, (Map, Modules)):
        return [c for _, c in node.items]
    if isinstance(node, Func):
        out = [c for c in node.cells if c is not None]
        out += [c for _, c in node.globals if c is not None]
        return out + [c for c in (node.defaults, node.kwdefaults) if c is not None]
    if isinstance(node, Method):
        return [node.self_, node.func]
    if isinstance(node, Partial):
        return [node.func, node.args, node.keywords]
    if isinstance(node, (Jitted, Descr, Deref)):
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
