"""The guard of a cache entry: straight-line Python generated from its node tree.

A cache hit runs this instead of walking the function again: one flat
function with one check per place the function can read a value from, which
returns the arrays in place order (or None when anything changed). Code
generation is what TorchDynamo does for its guards; here it keeps a hit at a
few attribute and dict reads per captured value, and no Python objects per
array.
"""

from __future__ import annotations

import keyword
import types
from collections.abc import Callable
from typing import Any

import jax

from ._codegen import CodeGen
from ._fasttree import Shape
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
    children,
    deref,
    referent,
)
from ._kinds import ARRAY_TYPES, is_array
from ._paths import get_attr, raw_value
from ._tree import is_float_like


class Guard(CodeGen):
    """`guard(*roots)` returns the arrays at every place, in place order, or None.

    Generated once per cache entry from its node tree: one flat function with
    one check per place, so a hit costs a few attribute and dict reads per
    value the function can read, and no Python objects per array.
    """

    def __init__(self, roots: list[Node], absolute: list[Node]):
        super().__init__(
            {
                "ARR": ARRAY_TYPES,
                "isarr": is_array,
                "MISSING": MISSING,
                "FunctionType": types.FunctionType,
                "MethodType": types.MethodType,
                "flatten": jax.tree_util.tree_flatten,
                "referent": referent,
            }
        )
        self.names: dict[int, str] = {}
        # An object reached by two routes is checked in full by one (its node) and by
        # identity by the other (an Alias), whichever the guard reads first.
        self.waiting: dict[int, list[str]] = {}
        self.in_tree, self.ordered = _scan([*roots, *absolute])
        args = [f"r{i}" for i in range(len(roots))]
        for node, arg in zip(roots, args, strict=True):
            self._gen(node, arg, 1)
        for node in absolute:
            self._gen(node, None, 1)
        body = "\n".join(self.lines) or "    pass"
        head = f"def guard({', '.join(args)}):\n    out = []\n    push = out.append\n"
        src = f"{head}{body}\n    return out\n"
        self.check: Callable[..., list[Any] | None] = self._define(src, "<treegrad guard>", "guard")
        self.source = src

    def _emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    def _fail_unless(self, depth: int, cond: str) -> None:
        self._emit(depth, f"if not ({cond}): return None")

    def _same(self, td: str, treedef: Any) -> str:
        """`td` is `treedef`: jax's == and the hash (`_tree.same_structure`)."""
        return f"{td} == {self._k(treedef)} and hash({td}) == {hash(treedef)}"

    def _read(self, d: int, expr: str, child: Node) -> None:
        """Read `expr` into a new variable and check it as `child`."""
        w = self._v()
        self._emit(d, f"{w} = {expr}")
        self._gen(child, w, d)

    def _gen(self, node: Node, v: str | None, d: int) -> None:
        if v is not None:
            self.names[id(node)] = v
            for w in self.waiting.pop(id(node), ()):
                self._fail_unless(d, f"{w} is {v}")
            ident = getattr(node, "ident", None)
            if ident is not None:
                k = self._k(ident.ref)
                self._fail_unless(d, f"{v} is {k}()" if ident.weak else f"{v} is {k}")
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
        elif isinstance(node, Snap):
            self._fail_unless(d, f"{self._k(node.equal)}({v})")
        elif isinstance(node, Alias):
            target = self.names.get(id(node.target))
            if target is not None:
                self._fail_unless(d, f"{v} is {target}")
            elif id(node.target) in self.in_tree:  # checked where the guard reads it
                self.waiting.setdefault(id(node.target), []).append(str(v))
            # Else the object reached by another route was demoted to Unchecked (the
            # function changes it: a log it appends to), so it is the function's
            # output, not an input, by this route too.
        elif isinstance(node, Seq):
            if node.type is list or node.type is tuple:
                size, item = f"len({v})", f"{v}[{{}}]"
            else:
                # A user's subclass: its items as stored, as the walk read them (its own
                # `__getitem__` or `__len__` may compute what it returns).
                base = self._k(list if issubclass(node.type, list) else tuple)
                size, item = f"{base}.__len__({v})", f"{base}.__getitem__({v}, {{}})"
            self._fail_unless(
                d, f"type({v}) is {self._k(node.type)} and {size} == {len(node.items)}"
            )
            for i, child in enumerate(node.items):
                self._read(d, item.format(i), child)
        elif isinstance(node, Map):
            if node.type is dict:
                keys_of, size, get = f"[*{v}]", f"len({v})", f"{v}.get({{}}, MISSING)"
            else:
                # A user's subclass: its entries as stored, as the walk read them (its own
                # `get`, `__iter__` or `__len__` may compute what it returns).
                k = self._k(dict)
                keys_of, size = f"[*{k}.__iter__({v})]", f"{k}.__len__({v})"
                get = f"{k}.get({v}, {{}}, MISSING)"
            if id(node) in self.ordered:
                # The keys in order (a function may iterate the dict, a model's too:
                # layers applied in its order): ~35 ns more than their number, for a
                # dict of a few keys. A captured dict model rebound to `tg.update`'s
                # output (whose keys jax sorts) is traced once more, then hits.
                keys = self._k([key for key, _ in node.items])
                self._fail_unless(d, f"type({v}) is {self._k(node.type)} and {keys_of} == {keys}")
            else:
                # The number of keys, not their order: the function reorders this
                # dict itself (its order is the function's output).
                self._fail_unless(
                    d, f"type({v}) is {self._k(node.type)} and {size} == {len(node.items)}"
                )
            for key, child in node.items:
                self._read(d, get.format(self._k(key)), child)
        elif isinstance(node, Func):
            if v is None:  # pragma: no cover - only absolute roots are read from no variable
                raise AssertionError("a function node without a variable")
            self._func(node, v, d)
        elif isinstance(node, Method):
            self._fail_unless(d, f"type({v}) is MethodType")
            for attr, child in (("__self__", node.self_), ("__func__", node.func)):
                self._read(d, f"{v}.{attr}", child)
        elif isinstance(node, Partial):
            self._fail_unless(d, f"type({v}) is {self._k(node.type)}")
            for attr, child in (
                ("func", node.func),
                ("args", node.args),
                ("keywords", node.keywords),
            ):
                self._read(d, f"{v}.{attr}", child)
        elif isinstance(node, Jitted):
            self._fail_unless(d, f"type({v}) is {self._k(node.type)}")
            self._read(d, f"getattr({v}, '__wrapped__', MISSING)", node.inner)
        elif isinstance(node, Descr):
            self._fail_unless(d, f"type({v}) is {self._k(node.type)}")
            self._read(d, f"{v}.{node.attr}", node.inner)
        elif isinstance(node, Obj):
            self._fail_unless(d, f"type({v}) is {self._k(node.type.ref)}()")
            if node.has_dict:
                dv = self._v()
                self._emit(d, f"{dv} = {v}.__dict__")
                self._fail_unless(d, f"len({dv}) == {len(node.attrs) + len(node.skipped)}")
                for name, child in node.attrs:
                    self._read(d, f"{dv}.get({name!r}, MISSING)", child)
            for name, child in node.slots:
                self._read(d, f"getattr({v}, {name!r}, MISSING)", child)
        elif isinstance(node, Tree):
            leaves, td = self._v(), self._v()
            if all(isinstance(leaf, Array) for leaf in node.leaves):
                # A model: read by generated code while its structure holds (Shape),
                # else by JAX, checked against the structure seen.
                # (`.flatten` looked up each call: it is generated on first use.)
                self._emit(d, f"{leaves} = {self._k(Shape(node.treedef))}.flatten({v})")
                self._emit(d, f"if {leaves} is None:")
                self._emit(d + 1, f"{leaves}, {td} = flatten({v})")
                self._fail_unless(
                    d + 1,
                    f"{self._same(td, node.treedef)} and (ARR.issuperset(map(type, {leaves})) "
                    f"or all(map(isarr, {leaves})))",
                )
                self._emit(d, f"out.extend({leaves})")
            else:
                self._emit(d, f"{leaves}, {td} = flatten({v})")
                self._fail_unless(d, self._same(td, node.treedef))
                for i, leaf in enumerate(node.leaves):
                    self._read(d, f"{leaves}[{i}]", leaf)
        elif isinstance(node, Deref):
            self._fail_unless(d, f"type({v}) is {self._k(node.type)}")
            w = self._v()
            if node.kind == "ref":
                self._emit(d, f"{w} = {v}()")
            else:
                read, error = (
                    (f"referent({v})", "ReferenceError")
                    if node.kind == "proxy"
                    else (f"{v}.get()", "LookupError")
                )
                self._emit(d, "try:")
                self._emit(d + 1, f"{w} = {read}")
                self._emit(d, f"except {error}:")
                self._emit(d + 1, f"{w} = MISSING")
            self._gen(node.inner, w, d)
        elif isinstance(node, Modules):
            self._fail_unless(d, f"type({v}) is dict and len({v}) == {node.size}")
            for name, child in node.items:
                self._read(d, f"{v}.get({name!r}, MISSING)", child)
        elif isinstance(node, ParamsNode):
            from ._params import Params

            self._fail_unless(d, f"type({v}) is {self._k(Params)}")
            self._read(d, f"{v}._sources", node.source)
        elif isinstance(node, Fixed):
            obj = self._v()
            k = self._k(node.obj.ref)
            self._emit(d, f"{obj} = {k}()" if node.obj.weak else f"{obj} = {k}")
            self._gen(node.func, obj, d)
        elif isinstance(node, Attrs):
            if not node.attrs:  # a library module none of whose data the code reads
                return
            obj = self._v()
            k = self._k(node.obj.ref)
            self._emit(d, f"{obj} = {k}()" if node.obj.weak else f"{obj} = {k}")
            self._fail_unless(d, f"{obj} is not None")
            dv = self._v()
            self._emit(d, f"{dv} = vars({obj})")
            for name, child in node.attrs:
                self._read(d, f"{dv}.get({name!r}, MISSING)", child)
        else:  # pragma: no cover - every node type is handled above
            raise AssertionError(type(node))

    def _const(self, value: Any, v: str | None, d: int) -> None:
        if value is None or value is True or value is False or value is Ellipsis:
            self._fail_unless(d, f"{v} is {value!r}")
        elif isinstance(value, float) and value != value:
            # NaN (a numpy float64 is a float too: its own type, not float's)
            self._fail_unless(d, f"type({v}) is {self._k(type(value))} and {v} != {v}")
        elif is_float_like(value) and (value == 0 or type(value) is not float):
            # == takes -0.0 for 0.0 (1 / x differs): compare the text, which keeps them apart.
            t, k = self._k(type(value)), self._k(repr(value))
            self._fail_unless(d, f"type({v}) is {t} and repr({v}) == {k}")
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
                self._read(d, f"{g}.get({name!r}, MISSING)", child)
        for attr, child in (("__defaults__", node.defaults), ("__kwdefaults__", node.kwdefaults)):
            w = self._v()
            self._emit(d, f"{w} = {v}.{attr}")
            if child is None:
                self._fail_unless(d, f"{w} is None")
            else:
                self._gen(child, w, d)


def _scan(nodes: list[Node]) -> tuple[set[int], set[int]]:
    """The ids of the nodes in the tree (not behind an Alias), and of the dicts whose
    key order the guard checks: every dict whose order the function itself did not
    change, a model's too (the function may iterate it: layers applied in its order)."""
    in_tree: set[int] = set()
    ordered: set[int] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        in_tree.add(id(node))
        if isinstance(node, Map) and node.ordered:
            ordered.add(id(node))
        stack.extend(children(node))
    return in_tree, ordered


class WriteBack(CodeGen):
    """`write(*roots, values)` puts new arrays into the given places, in place.

    Generated, like the guard, for one set of written places: after each call
    of a compiled implicit step it assigns the new arrays where the old ones
    lived (a Module attribute, a dict entry, a cell, an optimiser state), so
    writing back costs a few assignments, not a walk of everything the function
    reads. Built from the objects of the first call (the guard has checked that
    later calls have the same structure); `ok` is False when some place needs a
    container rebuilt (a tuple), and the caller then writes back the slow way.
    """

    def __init__(
        self, roots: list[Node], absolute: list[Node], places: dict[int, int], live: list[Any]
    ):
        from ._paths import IN_PLACE

        self.places = places  # place -> index into the values passed
        super().__init__(
            {"IN_PLACE": IN_PLACE, "flatten": jax.tree_util.tree_flatten, "referent": referent}
        )
        self.ok = True
        self.names: dict[int, str] = {}
        args = [f"r{i}" for i in range(len(roots))]
        for node, arg, value in zip(roots, args, live, strict=True):
            self._node(node, arg, value)
        for node in absolute:
            if self._has(node):
                obj = node.obj.get() if isinstance(node, (Attrs, Fixed)) else None
                self._node(node, None, obj)
        body = "\n".join(self.lines) or "    pass"
        src = f"def write({', '.join([*args, 'vals'])}):\n{body}\n"
        self.write: Callable[..., None] = self._define(src, "<treegrad write-back>", "write")

    def _emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def _has(self, node: Node) -> bool:
        if isinstance(node, Array):
            return node.place in self.places
        from ._guard import children

        return any(self._has(c) for c in children(node))

    def _val(self, node: Array) -> str:
        return f"vals[{self.places[node.place]}]"

    def _child(self, node: Node, expr: str, value: Any, assign: Callable[[str], str]) -> None:
        """Write into the child `node` (value `value`, read as `expr`); `assign(v)` rebinds it."""
        if not self._has(node):
            return
        if isinstance(node, Array):
            self._emit(assign(self._val(node)))
            return
        if isinstance(value, tuple) or isinstance(node, Partial):
            self.ok = False  # immutable: rebuilt by the slow path
            return
        w = self._v()
        self._emit(f"{w} = {expr}")
        self._node(node, w, value)

    def _node(self, node: Node, v: str | None, value: Any) -> None:
        if not self.ok or not self._has(node):
            return
        if isinstance(node, Seq) and isinstance(value, list):
            for i, (c, x) in enumerate(zip(node.items, value, strict=True)):
                self._child(c, f"{v}[{i}]", x, _assign(f"{v}[{i}] = \0"))
        elif isinstance(node, Map):
            for key, c in node.items:
                k = self._k(key)
                self._child(c, f"{v}[{k}]", value[key], _assign(f"{v}[{k}] = \0"))
        elif isinstance(node, Func):
            cells = value.__closure__ or ()
            for i, (cell, cell_node) in enumerate(zip(cells, node.cells, strict=True)):
                if cell_node is not None:
                    self._child(
                        cell_node,
                        f"{v}.__closure__[{i}].cell_contents",
                        cell.cell_contents,
                        _assign(f"{v}.__closure__[{i}].cell_contents = \0"),
                    )
            g = value.__globals__
            for name, global_node in node.globals:
                if global_node is not None:
                    self._child(
                        global_node,
                        f"{v}.__globals__[{name!r}]",
                        g[name],
                        _assign(f"{v}.__globals__[{name!r}] = \0"),
                    )
            for default in (node.defaults, node.kwdefaults):
                if default is not None and self._has(default):
                    self.ok = False
        elif isinstance(node, Method):
            self._child(node.self_, f"{v}.__self__", value.__self__, _assign("pass"))
            self._child(node.func, f"{v}.__func__", value.__func__, _assign("pass"))
            if isinstance(node.self_, Array) and self._has(node.self_):
                self.ok = False
        elif isinstance(node, (Jitted, Descr)):
            attr = "__wrapped__" if isinstance(node, Jitted) else node.attr
            self._child(node.inner, f"{v}.{attr}", getattr(value, attr), _assign("pass"))
        elif isinstance(node, Deref):
            # Only a ContextVar holds an array place itself (set anew); a weakly held
            # object is written into in place.
            read = {"ref": f"{v}()", "proxy": f"referent({v})", "ctx": f"{v}.get()"}[node.kind]
            assign = _assign(f"{v}.set(\0)" if node.kind == "ctx" else "pass")
            self._child(node.inner, read, deref(node.kind, value), assign)
        elif isinstance(node, Obj):
            d = vars(value) if node.has_dict else {}
            for name, c in node.attrs:
                self._child(
                    c,
                    f"{v}.__dict__[{name!r}]",
                    d[name],
                    _assign(f"{v}.__dict__[{name!r}] = \0"),
                )
            for name, c in node.slots:
                self._child(
                    c,
                    f"{v}.{name}",
                    getattr(value, name),
                    _assign(f"object.__setattr__({v}, {name!r}, \0)"),
                )
        elif isinstance(node, ParamsNode):
            self._child(node.source, f"{v}._sources", value._sources, _assign("pass"))
        elif isinstance(node, Fixed):
            fn = self._v()
            k = self._k(node.obj.ref)
            self._emit(f"{fn} = {k}()" if node.obj.weak else f"{fn} = {k}")
            self._node(node.func, fn, value)
        elif isinstance(node, Attrs):
            obj = self._v()
            k = self._k(node.obj.ref)
            self._emit(f"{obj} = {k}()" if node.obj.weak else f"{obj} = {k}")
            d = vars(value)
            for name, c in node.attrs:
                self._child(
                    c,
                    _attr(obj, name),
                    d.get(name, MISSING),
                    _assign(f"setattr({obj}, {name!r}, \0)"),
                )
        elif isinstance(node, Tree):
            self._tree(node, v, value)
        else:  # Const, Same, Unchecked, Alias: no places below
            self.ok = self.ok and not self._has(node)

    def _tree(self, node: Tree, v: str | None, value: Any) -> None:
        from ._paths import IN_PLACE

        if type(value) in IN_PLACE:  # a node that sets its own leaves (an optimiser state)
            leaves = self._v()
            self._emit(f"{leaves} = flatten({v})[0]")
            for i, c in enumerate(node.leaves):
                if isinstance(c, Array) and c.place in self.places:
                    self._emit(f"{leaves}[{i}] = {self._val(c)}")
            self._emit(f"IN_PLACE[{self._k(type(value))}]({v}, {leaves})")
            return
        for c, key in zip(node.leaves, node.keys, strict=True):
            if not (isinstance(c, Array) and c.place in self.places):
                continue
            if not key:
                self.ok = False
                return
            expr: str = v or ""
            obj = value
            for k in key[:-1]:
                step = _step(obj, k, self)
                if step is None:
                    self.ok = False
                    return
                expr, obj = f"{expr}{step}", _get(obj, k)
            setter = _set(obj, key[-1], expr, self._val(c), self)
            if setter is None:
                self.ok = False
                return
            self._emit(setter)


def _identifier(name: Any) -> bool:
    """Whether `name` can follow a dot in generated code."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def _attr(expr: str, name: str) -> str:
    """Python reading attribute `name` of `expr` (any string a user set with setattr)."""
    return f"{expr}.{name}" if _identifier(name) else f"getattr({expr}, {name!r})"


def _assign(template: str) -> Callable[[str], str]:
    """Python rebinding a child: `template` with the new value's expression for NUL."""
    return lambda val: template.replace("\0", val)


def _get(obj: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return get_attr(obj, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return obj[key.idx]
    return obj[key.key]


def _step(obj: Any, key: Any, gen: CodeGen) -> str | None:
    """Python reading child `key` of `obj`, or None when it is not addressable."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        name = key.name
        if raw_value(obj, name):
            return ".get_raw_value()"
        if _identifier(name):
            return f".{name}"
        # `setattr(m, "layer-1", ...)`: `.layer-1` was generated, a SyntaxError (or
        # worse, `m.layer - 1`). Read from the instance dict where it lives.
        return f".__dict__[{name!r}]" if name in getattr(obj, "__dict__", ()) else None
    if isinstance(key, jax.tree_util.SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, jax.tree_util.DictKey) and isinstance(obj, dict):
        return f"[{_dict_key(key.key, gen)}]"
    return None


def _set(obj: Any, key: Any, expr: str, val: str, gen: CodeGen) -> str | None:
    """Python rebinding child `key` of `obj` (read as `expr`) in place, or None."""
    from ._module import Module

    if isinstance(obj, tuple):
        # A NamedTuple's fields have attribute keys, but it is immutable: rebuilt by
        # the caller's slow path (setting the attribute raised AttributeError).
        return None
    if isinstance(key, jax.tree_util.GetAttrKey):
        if isinstance(obj, Module):
            # Straight into __dict__: an array replacing an array keeps the Module's
            # cached split into children and static data (setattr would drop it).
            return f"{expr}.__dict__[{key.name!r}] = {val}"
        if raw_value(obj, key.name):
            return f"{expr}.set_raw_value({val})"
        return f"object.__setattr__({expr}, {key.name!r}, {val})"
    if isinstance(key, jax.tree_util.SequenceKey) and type(obj) is list:
        return f"{expr}[{key.idx}] = {val}"
    if isinstance(key, jax.tree_util.DictKey) and isinstance(obj, dict):
        return f"{expr}[{_dict_key(key.key, gen)}] = {val}"
    return None


def _dict_key(key: Any, gen: CodeGen) -> str:
    # A str or int key written as itself; any other (np.int64(1), an enum member, a
    # tuple, an object) a constant of the generated code: its repr need not be code.
    return repr(key) if type(key) in (str, int) else gen._k(key)


def tree_setter(root: Any) -> Callable[[Any, list[Any]], None] | None:
    """`set(root, vals)`: put `vals[i]` (where not None) at leaf `i` of a tree like `root`.

    Generated from `root`'s key paths; trees of the same structure (the same
    treedef, which fixes every container's type) share it. None when a leaf
    cannot be assigned in place (it sits in a tuple, or in a node without keys).
    """
    gen = CodeGen({})
    held: dict[str, str] = {}  # a container's path -> the variable that holds it
    lines = []
    for i, (key, _) in enumerate(jax.tree_util.tree_flatten_with_path(root)[0]):
        if not key:
            return None
        path, obj, var = "root", root, "root"
        for k in key[:-1]:
            step = _step(obj, k, gen)
            if step is None or isinstance(obj, tuple):
                return None
            path, obj = f"{path}{step}", _get(obj, k)
            # Each container is read once (only leaves are rebound).
            if path not in held:
                held[path] = gen._v()
                lines.append(f"    {held[path]} = {var}{step}")
            var = held[path]
        if isinstance(obj, tuple):
            return None
        assign = _set(obj, key[-1], var, f"vals[{i}]", gen)
        if assign is None:
            return None
        lines.append(f"    if vals[{i}] is not None:\n        {assign}")
    src = "def set(root, vals):\n" + ("\n".join(lines) or "    pass") + "\n"
    return gen._define(src, "<treegrad rebind>", "set")
