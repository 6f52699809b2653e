"""Straight-line flatten and unflatten for one tree structure seen before.

JAX flattens a `tg.Module` by calling back into Python once per Module, and
unflattens it the same way: on a deep model that is most of treegrad's cost
per step (a 17-layer MLP: 5.2 us to flatten, 8.9 us to unflatten, against
1.8 us and 3.9 us for the code below; see docs/benchmarks.md). A `Shape` is
generated once per structure, as the engine's guards are: `flatten` checks
that a tree has exactly that structure (each Module by the identity of its
cached split into children, `_tg_aux`) and returns its leaves, or None when
anything differs, so the caller takes JAX's own path; `unflatten` builds the
tree JAX's `tree_unflatten` would.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax

from ._codegen import CodeGen
from ._kinds import ARRAY_TYPES, is_array
from ._module import _AUX_SLOT, Module, _Static

# Nodes whose children are one tuple attribute and whose aux data is another
# (treegrad's own `OptState`): (aux attribute, children attribute, build(aux, children)).
_TUPLE_NODES: dict[type, tuple[str, str, Callable[[Any, tuple[Any, ...]], Any]]] = {}


def register_tuple_node(
    cls: type, aux: str, children: str, build: Callable[[Any, tuple[Any, ...]], Any]
) -> None:
    """Let `Shape` read `cls` directly: its children are the tuple `obj.<children>`,
    its treedef aux data `obj.<aux>` (checked by identity), and `build(aux, children)`
    is its unflatten."""
    _TUPLE_NODES[cls] = (aux, children, build)


class _Leaf:
    """In an unflatten spec: this leaf is the next value given."""

    __slots__ = ()


TAKE = _Leaf()
_LEAF_DEF: Any = jax.tree_util.tree_structure(0)  # one leaf


class Shape:
    """Generated `flatten` and `unflatten` for one treedef.

    `flatten(tree)` returns the leaves when `tree` has this structure and every
    leaf is an array (a type `_guard.is_array` has accepted), else None.
    `unflatten(values)` builds the tree; with `spec` (one entry per leaf,
    `TAKE` or a constant), the leaves marked `TAKE` come from `values` in order
    and the others are the constants. `leaves`: the tree's leaves when known,
    so that their array types are accepted from the first call.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> tree = {"w": jnp.ones(2), "b": [jnp.zeros(1)]}
        >>> leaves, treedef = jax.tree_util.tree_flatten(tree)
        >>> shape = Shape(treedef, leaves)
        >>> shape.flatten(tree) == leaves, shape.flatten({"w": 1})
        (True, None)
        >>> shape.unflatten(leaves)["b"][0] is tree["b"][0]
        True
    """

    __slots__ = ("flatten", "spec", "treedef", "unflatten")

    def __init__(
        self, treedef: Any, leaves: Sequence[Any] | None = None, spec: Sequence[Any] | None = None
    ):
        for leaf in leaves or ():
            is_array(leaf)  # learns the leaf's type
        self.treedef = treedef
        self.spec = spec
        # Each half is generated on first use: most users need one (a model of
        # 2,000 arrays takes about 25 ms a half).
        self.flatten: Callable[[Any], list[Any] | None] = self._first_flatten
        self.unflatten: Callable[[Sequence[Any]], Any] = self._first_unflatten

    def _first_flatten(self, tree: Any) -> list[Any] | None:
        gen = _Gen(ARRAY_TYPES)
        self.flatten = gen._define(gen.flatten_source(self.treedef), "<treegrad shape>", "flatten")
        return self.flatten(tree)

    def _first_unflatten(self, values: Sequence[Any]) -> Any:
        gen = _Gen(ARRAY_TYPES)
        src = gen.unflatten_source(self.treedef, self.spec)
        self.unflatten = gen._define(src, "<treegrad shape>", "unflatten")
        return self.unflatten(values)


def _tuple(items: list[str]) -> str:
    return f"({', '.join(items)},)" if items else "()"


def _is_namedtuple(t: type) -> bool:
    return issubclass(t, tuple) and hasattr(t, "_fields")


class _Gen(CodeGen):
    def __init__(self, leaf_types: Collection[type]):
        super().__init__(
            {
                "L": leaf_types,
                "jflatten": jax.tree_util.tree_flatten,
                "new": object.__new__,
                "set_aux": _AUX_SLOT.__set__,
            }
        )

    def _fail_unless(self, cond: str) -> None:
        self.lines.append(f"    if not ({cond}): return None")

    # --- flatten ------------------------------------------------------------------

    def flatten_source(self, treedef: Any) -> str:
        self.lines = []
        items = self._flat(treedef, "v0")
        body = "\n".join("    " + line for line in self.lines)
        # A missing attribute or key is a different structure: JAX's path decides.
        return (
            f"def flatten(v0):\n    try:\n{body}\n        out = [{', '.join(items)}]\n"
            "    except (AttributeError, KeyError):\n        return None\n"
            # Every leaf an array: one check in C for all of them.
            "    return out if L.issuperset(map(type, out)) else None\n"
        )

    def _flat(self, td: Any, v: str) -> list[str]:
        data = td.node_data()
        if data is None:
            return [v]  # its type is checked with the others', at the end
        t, aux = data
        kids = td.children()
        if t is type(None):
            self._fail_unless(f"{v} is None")
            return []
        if t is tuple or t is list or _is_namedtuple(t):
            self._fail_unless(f"type({v}) is {self._k(t)} and len({v}) == {len(kids)}")
            return self._children(kids, [f"{v}[{i}]" for i in range(len(kids))])
        if t is dict:
            self._fail_unless(f"type({v}) is dict and len({v}) == {len(kids)}")
            return self._children(kids, [f"{v}[{self._k(k)}]" for k in aux])
        if isinstance(aux, _Static) and issubclass(t, Module) and not aux.mutable:
            # The cached split (`_tg_aux`) is dropped by every attribute assignment,
            # so the same object there means the same children and static data.
            self._fail_unless(f"type({v}) is {self._k(t)} and {v}._tg_aux is {self._k(aux)}")
            d = self._v()
            self.lines.append(f"    {d} = {v}.__dict__")
            self._fail_unless(f"len({d}) == {aux.size}")
            for name, value in aux.items:
                # A static value rebound without `Module.__setattr__` (`m.__dict__[k] =`,
                # `object.__setattr__` on a frozen dataclass Module) keeps the split.
                self._fail_unless(f"{d}[{name!r}] is {self._k(value)}")
            return self._children(kids, [f"{d}[{n!r}]" for n in aux.names])
        if t in _TUPLE_NODES:
            aux_attr, seq_attr, _ = _TUPLE_NODES[t]
            self._fail_unless(f"type({v}) is {self._k(t)} and {v}.{aux_attr} is {self._k(aux)}")
            s = self._v()
            self.lines.append(f"    {s} = {v}.{seq_attr}")
            self._fail_unless(f"len({s}) == {len(kids)}")
            return self._children(kids, [f"{s}[{i}]" for i in range(len(kids))])
        # Any other node: JAX flattens it; the structure and leaf types are checked.
        leaves, sub = self._v(), self._v()
        self.lines.append(f"    {leaves}, {sub} = jflatten({v})")
        # (The hash too: jax's == takes two dataclass types of one layout for one
        # node, `_tree.same_structure`.)
        self._fail_unless(f"{sub} == {self._k(td)} and hash({sub}) == {hash(td)}")
        return [f"*{leaves}"]

    def _children(self, kids: list[Any], exprs: list[str]) -> list[str]:
        items: list[str] = []
        for kid, expr in zip(kids, exprs, strict=True):
            w = self._v()
            self.lines.append(f"    {w} = {expr}")
            items.extend(self._flat(kid, w))
        return items

    # --- unflatten ----------------------------------------------------------------

    def unflatten_source(self, treedef: Any, spec: Sequence[Any] | None) -> str:
        self.lines = []
        self._spec = list(spec) if spec is not None else [TAKE] * treedef.num_leaves
        if len(self._spec) != treedef.num_leaves:
            raise ValueError(f"a spec of {len(self._spec)} leaves for {treedef.num_leaves}")
        self._leaf = 0
        self._taken = 0
        expr = self._build(treedef)
        body = "\n".join(self.lines)
        return f"def unflatten(x):\n{body}\n    return {expr}\n"

    def _build(self, td: Any) -> str:
        data = td.node_data()
        if data is None:
            s = self._spec[self._leaf]
            self._leaf += 1
            if s is TAKE:
                self._taken += 1
                return f"x[{self._taken - 1}]"
            return "None" if s is None else self._k(s)
        t, aux = data
        o = self._v()
        if not (
            t in (type(None), tuple, list, dict)
            or _is_namedtuple(t)
            or (isinstance(aux, _Static) and issubclass(t, Module))
            or t in _TUPLE_NODES
        ):
            # Any other node: JAX unflattens it from its leaves.
            leaves = [self._build(_LEAF_DEF) for _ in range(td.num_leaves)]
            self.lines.append(f"    {o} = {self._k(td)}.unflatten([{', '.join(leaves)}])")
            return o
        kids = [self._build(k) for k in td.children()]
        if t is type(None):
            return "None"
        if t is tuple:
            return _tuple(kids)
        if t is list:
            return f"[{', '.join(kids)}]"
        if _is_namedtuple(t):
            return f"{self._k(t)}({', '.join(kids)})"
        if t is dict:
            return (
                "{" + ", ".join(f"{self._k(k)}: {e}" for k, e in zip(aux, kids, strict=True)) + "}"
            )
        if isinstance(aux, _Static) and issubclass(t, Module):
            # What `_module._make_unflatten` does: children, then static data, then the split.
            d = self._v()
            self.lines.append(f"    {o} = new({self._k(t)})")
            self.lines.append(f"    {d} = {o}.__dict__")
            for name, e in zip(aux.names, kids, strict=True):
                self.lines.append(f"    {d}[{name!r}] = {e}")
            if aux.static:
                self.lines.append(f"    {d}.update({self._k(aux.static)})")
            self.lines.append(f"    set_aux({o}, {self._k(aux)})")
            return o
        build = _TUPLE_NODES[t][2]
        self.lines.append(f"    {o} = {self._k(build)}({self._k(aux)}, {_tuple(kids)})")
        return o
