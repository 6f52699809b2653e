"""Putting tracers into the places a function reads, and taking them out again.

While the engine traces a function, `Swap` writes the tracers into the user's
own cells, globals, containers and objects (recording every write so that
`restore` undoes exactly them), so the function runs on its real objects. After
the function ran, `Settle` compares the places with what was put there: arrays
the function rebound become outputs to write back, values it changed itself
(counters, logs) stop being checked by the guard.
"""

from __future__ import annotations

import collections
import functools
import gc
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

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
    _is_pytree_node,
    children,
    deref,
    has_instance_dict,
    has_places,
    is_array,
    same_array,
)
from ._jaxpr import is_tracer
from ._paths import IN_PLACE, rebind, rebind_value
from ._walk import slot_names


class CannotSwap(TypeError):
    """A place that cannot be written (an immutable object that is not a tuple)."""


class Swap:
    """Writes new values into the places of a node tree, in the user's own objects.

    `values[place]` is the new value of each place (`MISSING`: leave it). Every
    write is recorded, so `restore()` puts back exactly what was there. While
    tracing, `inline` replaces `jax.jit` helpers by their wrapped function.
    """

    def __init__(
        self,
        values: list[Any],
        *,
        inline: bool = True,
        record: bool = True,
        only: set[int] | None = None,
        fresh: Swap | None = None,
    ):
        self.values = values
        self.inline = inline
        self.record = record
        # Ids of the nodes holding a place to write (None: all), so writing a few
        # arrays back after each call does not walk everything the function reads.
        self.only = only
        self.undo: list[Callable[[], None]] = []
        # Each value written into a place, by id, with what was there (the trace's
        # tracers and the user's arrays): `detrace` puts the user's back.
        self.originals: dict[int, Any] = {}
        self.touched: list[tuple[Any, Any, Any]] = []  # (container, key, old) written
        # The numpy arrays read as values, by id, each with the copy the trace gets.
        self.copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # A later run of the function in the trace of `fresh` (the Hessian's second
        # derivatives): its copies start from the user's arrays as they were before the
        # trace, by the id of the copy `fresh` put in their place, not from what an
        # earlier run wrote into that copy, and nothing goes back (the earlier run's
        # writes are the call's). None: copies of what is there, written back.
        self.fresh: dict[int, np.ndarray] | None = (
            None if fresh is None else {id(c): u for u, c in fresh.copies.values()}
        )
        # A later run (`fresh`) also puts back the array places it wrote the same
        # object into: the function may rebind them (`c["s"] = c["s"] + 1`).
        self.again = fresh is not None
        # The user's numpy arrays `restore` wrote into, each with what it held before.
        self.overwritten: list[tuple[np.ndarray, np.ndarray]] = []
        # Optimiser states whose structure the function changed, put back as they were
        # (`_restore_tree`): such a trace cannot write them back, and is refused.
        self.reverted: list[str] = []
        # Where values computed from traced arrays were taken out of a captured pytree
        # whose structure the function changed (`_untrace_containers`), for the warning.
        self.lost: list[str] = []

    def restore(self) -> None:
        while self.undo:
            self.undo.pop()()
        if self.fresh is None:
            for user, copy in self.copies.values():
                if not same_array(copy, user):
                    self.overwritten.append((user, user.copy()))
                    _copy_back(user, copy)
        self.copies.clear()
        # A place the function rebound to a traced value is cleared too: to the user's
        # array that traced value stands for, if it is one of ours (`self.best =
        # model.w`), else to what was there (an array it computed is written back
        # after the call, as an output).
        for container, key, old in self.touched:
            now = _at(container, key)
            if is_tracer(now) or (self.again and now is not MISSING):
                container[key] = self.originals.get(id(now), old)
        self.touched.clear()

    def detrace(self, rebound: list[list[Any]]) -> None:
        """After `restore`: the values the function bound in the user's places while
        traced (`Settle.rebound`: `batches = batches[1:]` on a global, an attribute,
        a closure variable) hold the trace's values where the user's arrays were; the
        user's arrays go back in them, as the uncompiled function would leave them.
        Each record `[put, key, value]` is updated, so an enclosing swap's `detrace`
        (implicit mode's parameters sit on the closure's tracers) sees what is there."""
        if not self.originals:
            return
        for record in rebound:
            put, key, value = record
            new = rebind_value(value, self.originals)
            if new is not value:
                put(key, new)
                record[2] = new

    def _log(self, fn: Callable[[], None]) -> None:
        if self.record:
            self.undo.append(fn)

    def put(self, node: Node, v: Any) -> Any:
        """Write into `v` in place; return `v`, or its replacement if `v` is immutable."""
        if self.only is not None and id(node) not in self.only:
            return v
        if isinstance(node, Array):
            new = self.values[node.place]
            if new is MISSING:
                return v
            if self.record and new is not v:
                self.originals[id(new)] = v
            return new
        if isinstance(node, Snap):
            if node.held is not None and node.held.arrays and self.record:
                # Its numpy arrays, by the same token: each traced on a copy, written
                # where the container keeps it (`_slots`).
                slots = _slots(v)
                if slots is not None:
                    for i, _ in node.held.arrays:
                        where, key = slots[i]
                        self._set_item(where, key, self._copy_of(where[key]))
                return v
            if not (node.copied and self.record):
                return v
            # A numpy array read as a value (`Walk.as_values`): the trace gets a copy of
            # its own, and what the function writes into it goes back into the user's
            # array afterwards (`restore`). jax keys some of its caches on a constant's
            # identity: the user's array itself, changed in place since an earlier trace,
            # could be taken for the one that trace saw, and its old contents reused.
            return self._copy_of(v)
        if isinstance(node, Seq):
            if isinstance(v, list):
                for i, child in enumerate(node.items):
                    self._set_item(v, i, self.put(child, v[i]), self._forced(child))
                return v
            items = [self.put(child, x) for child, x in zip(node.items, v, strict=True)]
            if all(a is b for a, b in zip(items, v, strict=True)):
                return v
            return type(v)._make(items) if hasattr(v, "_fields") else type(v)(items)
        if isinstance(node, Map):
            for key, child in node.items:
                self._set_item(v, key, self.put(child, v[key]), self._forced(child))
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
        if isinstance(node, Deref):
            inner = deref(node.kind, v)
            new = self.put(node.inner, inner)
            if new is not inner:
                if node.kind != "ctx":  # pragma: no cover - the walk puts no place there
                    raise AssertionError("a place behind a weak reference")
                token = v.set(new)
                self._log(functools.partial(v.reset, token))
            return v
        if isinstance(node, Modules):
            return v  # user modules, checked by identity; their attributes are absolute
        if isinstance(node, Obj):
            if node.skipped and self.record:
                # Attributes no walked code reads but a constructor may write (called
                # on this object while traced): no tracer stays in them afterwards.
                every = vars(v)
                kept = [(k, every[k]) for k in node.skipped if k in every]
                self._log(functools.partial(_untrace, every, kept))
            d: dict[str, Any] = vars(v) if node.attrs else {}
            for name, child in node.attrs:
                self._set_item(d, name, self.put(child, d[name]), self._forced(child))
            for name, child in node.slots:
                new = self.put(child, getattr(v, name))
                self._set_attr(
                    v, name, new, copy=isinstance(child, Snap), force=self._forced(child)
                )
            if self.record and node.slots and type(v).__name__ == "Grads":
                from ._grads import Grads

                if type(v) is Grads:
                    # Its index by id is of the arrays just written over (`_walk`):
                    # built anew from the tracers while traced, the old one back after.
                    self._set_attr(v, "_index", None, force=True)
            return v
        if isinstance(node, Tree):
            return self._tree(node, v)
        if isinstance(node, ParamsNode):
            self.put(node.source, v._sources)  # a list: rebound in place
            return v
        if isinstance(node, Fixed):
            self.put(node.func, node.obj.get())
            return v
        if isinstance(node, Attrs):
            obj = node.obj.get()
            d = vars(obj)
            for name, child in node.attrs:
                if isinstance(child, Const) and child.value is MISSING:
                    continue  # a name checked to stay absent
                new = self.put(child, d[name])
                if new is not d[name] or self._forced(child):
                    self._set_attr(obj, name, new, plain=False, force=self._forced(child))
            return obj
        return v  # Const, Same, Unchecked, Alias: nothing to write

    def _copy_of(self, user: np.ndarray) -> np.ndarray:
        """The copy of a user's numpy array the trace reads (one per array)."""
        pair = self.copies.get(id(user))
        if pair is None:
            start = user if self.fresh is None else self.fresh.get(id(user), user)
            pair = self.copies[id(user)] = (user, start.copy())
        return pair[1]

    def _forced(self, child: Node) -> bool:
        """Whether a place is recorded even when what is written is what was there."""
        return self.again and type(child) is Array

    def _set_item(self, container: Any, key: Any, new: Any, force: bool = False) -> None:
        old = container[key]
        if new is not old or force:
            if self.record:  # (not when writing back after a call: nothing to undo)
                self.undo.append(functools.partial(_put_back, container, key, new, old))
                self.touched.append((container, key, old))
            container[key] = new

    def _set_attr(
        self,
        obj: Any,
        name: str,
        new: Any,
        plain: bool = True,
        copy: bool = False,
        force: bool = False,
    ) -> None:
        old = getattr(obj, name)
        if new is old and not force:
            return
        # Frozen dataclass-style models (equinox) refuse setattr; object.__setattr__
        # is how their own tree-surgery helpers write, and it cannot be intercepted.
        setter = object.__setattr__ if plain else setattr

        def undo() -> None:
            # `copy`: a numpy array read as a value; a value the function bound there
            # instead stays, as uncompiled (unless computed from traced arrays).
            if not copy or _trace_left(getattr(obj, name), new):
                setter(obj, name, old)

        self._log(undo)
        setter(obj, name, new)

    def _func(self, node: Func, fn: types.FunctionType) -> None:
        for cell, child in zip(fn.__closure__ or (), node.cells, strict=True):
            if child is None:
                continue
            old = cell.cell_contents
            new = self.put(child, old)
            if new is not old or self._forced(child):
                if isinstance(child, Snap):  # a copy: the function may bind another value
                    self._log(functools.partial(_put_back_cell, cell, new, old))
                else:
                    self._log(functools.partial(setattr, cell, "cell_contents", old))
                cell.cell_contents = new
        g = fn.__globals__
        for name, child in node.globals:
            if child is not None:
                self._set_item(g, name, self.put(child, g[name]), self._forced(child))
        if node.defaults is not None:
            defaults = self.put(node.defaults, fn.__defaults__)
            if defaults is not fn.__defaults__:
                self._set_attr(fn, "__defaults__", defaults, plain=False)
        if node.kwdefaults is not None:
            self.put(node.kwdefaults, fn.__kwdefaults__)

    def _tree(self, node: Tree, v: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(v)
        held = _containers(v) if self.record else []
        values = self.values
        new = [
            (x if (n := values[c.place]) is MISSING else n) if type(c) is Array else self.put(c, x)
            for c, x in zip(node.leaves, leaves, strict=True)
        ]
        changed = {id(a): b for a, b in zip(leaves, new, strict=True) if a is not b}
        if not changed:
            # An optimiser state may gain traced leaves (a new rule); a later run
            # (`again`) may rebind a leaf to its own traced value.
            if type(v) in IN_PLACE or self.again:
                self._log(lambda: _restore_tree(v, treedef, leaves, {}, self, held))
            return v
        try:
            rebind(v, changed)
        except TypeError:
            # Not writable in place (an immutable pytree): the parent rebinds a new one.
            return jax.tree_util.tree_unflatten(treedef, new)
        ours = {id(b): a for a, b in zip(leaves, new, strict=True) if a is not b}
        if self.record:
            self.originals.update(ours)
        self._log(lambda: _restore_tree(v, treedef, leaves, ours, self, held))
        return v


def _slots(v: Any) -> list[tuple[Any, Any]] | None:
    """Where each item of a container the walk does not see into is kept, as
    (container, key), in the order `Held` numbers them: a deque's own slots; the dict
    behind a `MappingProxyType` (its one referent, `gc.get_referents`); for a
    `ChainMap`, the first of its dicts holding each key. None: another kind (a view
    of another Mapping)."""
    if isinstance(v, collections.deque):
        return [(v, i) for i in range(len(v))]
    if type(v) is types.MappingProxyType:
        inner = gc.get_referents(v)
        if len(inner) == 1 and type(inner[0]) is dict:
            return [(inner[0], k) for k in inner[0]]
    elif type(v) is collections.ChainMap and all(type(m) is dict for m in v.maps):
        return [(next(m for m in v.maps if k in m), k) for k in dict(v)]
    return None


def _copy_back(user: np.ndarray, copy: np.ndarray) -> None:
    """What the function wrote into the copy of a numpy array, into the user's array."""
    if same_array(copy, user):
        return
    if copy.shape != user.shape:  # `resize` on the copy
        user.resize(copy.shape, refcheck=False)
    np.copyto(user, copy)


def undo_writes(overwritten: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Put back what `Swap.restore` wrote into the user's numpy arrays (latest first):
    a trace made again in the same call (`Entry.first_run`) writes them once more, from
    the same contents, as the one run of the uncompiled function does."""
    for user, before in reversed(overwritten):
        _copy_back(user, before)
    overwritten.clear()


def _put_back_cell(cell: types.CellType, new: Any, old: Any) -> None:
    """Undo a closure cell's copy of a numpy array read as a value: the user's array
    back, unless the function bound another value there (`nonlocal buf; buf = ...`),
    which stays, as uncompiled (unless computed from traced arrays)."""
    if _trace_left(cell.cell_contents, new):
        cell.cell_contents = old


def _trace_left(now: Any, new: Any) -> bool:
    """Whether a place holds what the trace put there (`new`), or a value computed from
    traced arrays: then the user's value goes back. Any other value the function bound
    there stays, as it would uncompiled."""
    return now is new or _holds_tracer(now)


def _put_back(container: Any, key: Any, new: Any, old: Any) -> None:
    """Undo `container[key] = new`: `old` back wherever `new` is now. The function may
    have taken entries out while traced (`batches.pop(0)` shifts a list, `d.popitem()`),
    and the container is left as it left it, its other arrays in their new places, as
    uncompiled; an entry it removed is not brought back. (A place it rebound: see
    `Swap.restore`.)"""
    if _at(container, key) is new:
        container[key] = old
        return
    keys = (
        range(len(container))
        if isinstance(container, (list, collections.deque))
        else list(container)
    )
    for k in keys:
        if _at(container, k) is new:
            container[k] = old


def _at(container: Any, key: Any) -> Any:
    """`container[key]`, or MISSING: a dict's entry as stored (a subclass's `__missing__`,
    a defaultdict's default, must not add the key the function took out)."""
    if isinstance(container, dict):
        return dict.get(container, key, MISSING)
    try:
        return container[key]
    except IndexError:
        return MISSING


def _untrace(d: dict[str, Any], kept: list[tuple[str, Any]]) -> None:
    for k, old in kept:
        if is_tracer(d.get(k)):
            d[k] = old


def _restore_tree(
    v: Any,
    treedef: Any,
    leaves: list[Any],
    ours: dict[int, Any],
    swap: Swap,
    held: Sequence[tuple[Any, Any]],
) -> None:
    """Put the original leaves back, whatever the trace did meanwhile, so no traced value
    stays in the user's model. A value put there for the trace (`ours`: by its id) goes
    back as the original wherever it is now: the function may have moved it (a layer
    popped from a list shifts the others). One the function rebound goes back by
    position, or, where it changed the structure (a static attribute it counts in, a
    new attribute), by key path. An optimiser state whose structure changed so that
    traced leaves would stay (a rule assigned to a sub-state) is put back whole, as it
    was, and named in `swap.reverted`: the caller refuses the trace. Values computed from
    traced arrays stored in it where nothing can be put back by place go
    (`_untrace_containers`, named in `swap.lost`)."""
    now, now_def = jax.tree_util.tree_flatten(v)
    if all(id(b) in ours or not is_tracer(b) for b in now):
        back = {id(b): ours[id(b)] for b in now if id(b) in ours}
    elif now_def == treedef:
        back = {id(b): a for a, b in zip(leaves, now, strict=True) if a is not b}
    else:
        old_paths, now_paths = _key_paths(treedef), _key_paths(now_def)
        if old_paths is None or now_paths is None:
            raise Unsettled(f"the structure of a captured {type(v).__name__} changed while tracing")
        before = dict(zip(old_paths, leaves, strict=True))
        back = {}
        for k, b in zip(now_paths, now, strict=True):
            a = before.get(k, MISSING)
            if a is not MISSING and a is not b:
                back[id(b)] = a
        if type(v) in IN_PLACE and any(is_tracer(b) and id(b) not in back for b in now):
            old = jax.tree_util.tree_unflatten(treedef, leaves)
            for name in slot_names(type(v)):
                object.__setattr__(v, name, object.__getattribute__(old, name))
            swap.reverted.append(type(v).__name__)
            return
    if back:
        rebind(v, back)
    # Tracers that were there before are an enclosing trace's (a call nested in tg.jit).
    was = {id(a) for a in leaves}
    if held and any(is_tracer(b) and id(b) not in was for b in jax.tree_util.tree_leaves(v)):
        _untrace_containers(held, was)
        swap.lost.append(f"a {type(v).__name__} it captures")


def _containers(v: Any) -> list[tuple[Any, Any]]:
    """The mutable containers of a pytree (lists, dicts, objects' `__dict__`s), outer
    first, each with a shallow copy of its entries: what `_untrace_containers` puts back."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()

    def visit(x: Any) -> None:
        if id(x) in seen or is_array(x):
            return
        seen.add(id(x))
        if type(x) is list:
            out.append((x, list(x)))
            items: Any = x
        elif type(x) is tuple:
            items = x
        elif isinstance(x, dict):
            out.append((x, dict(x)))
            items = list(x.values())
        elif has_instance_dict(x) and _is_pytree_node(x):
            d = vars(x)
            out.append((d, dict(d)))
            items = list(d.values())
        else:
            return
        for item in items:
            visit(item)

    visit(v)
    return out


def _untrace_containers(held: Sequence[tuple[Any, Any]], was: set[int]) -> None:
    """A value computed from traced arrays that the function stored inside a captured
    pytree (`model.hist = model.hist + [loss]`, `model.log.append(loss)`, a new
    attribute), where its structure changed and no leaf can be put back by place: the
    entry it stored goes back to what was there, or is taken out where there was none,
    so no tracer stays in the user's model (as `Settle` does for a plain list or dict).
    `was`: the ids of the leaves before the trace."""

    def traced(x: Any) -> bool:
        try:
            return any(is_tracer(a) and id(a) not in was for a in _leaves(x))
        except (TypeError, ValueError):  # cannot flatten: see `_holds_tracer`
            return True

    for container, before in held:
        if type(container) is list:
            n = len(before)
            for i in reversed(range(len(container))):
                if (i >= n or container[i] is not before[i]) and traced(container[i]):
                    if i < n:
                        container[i] = before[i]
                    else:
                        del container[i]
            continue
        for key in list(container):
            now = container[key]
            if before.get(key, MISSING) is not now and traced(now):
                if key in before:
                    container[key] = before[key]
                else:
                    del container[key]


def _key_paths(treedef: Any) -> list[Any] | None:
    """The key path of each leaf of a structure (None: it cannot be rebuilt to read them)."""
    try:
        dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
        return [tuple(k) for k, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
    except (TypeError, ValueError, AttributeError):
        # A user's pytree whose unflatten checks its leaves (0 is not an array):
        # the caller then takes the structure as changed. Anything else propagates.
        return None


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
        # Aliases met before the node of their object, with the value each route holds.
        self.waiting: dict[int, list[Any]] = {}
        self.demoted = False
        self.cacheable = True
        # Where the function stored values computed from the traced arrays, taken out
        # again (see `_entry`, `_dropped`): said once to the user (`_cache._warn_lost`).
        self.lost: list[str] = []
        # Containers it took entries out of (`batches.pop()`): the next call reads what
        # is left, as uncompiled, so this trace is not reused (`_cache._warn_drew`).
        self.took: list[str] = []
        self.wrote = False  # a numpy array read as a value, changed in place
        # Places that held the trace's arrays and that the function bound to a new
        # value holding them (`batches = batches[1:]`): `(put, key, value)`, for
        # `Swap.detrace` once the trace is over.
        self.rebound: list[list[Any]] = []
        self._ours: set[int] | None = None

    def _kept(self, value: Any, put: Callable[[Any, Any], Any], key: Any) -> bool:
        """A value the function stored that holds no traced value but the trace's own
        inputs (`self.best = model.w`, `history.append(model.w)`, `saved["w0"] =
        model.w`): the user's arrays, which stay there (`Swap.detrace` puts them back in
        place of the inputs' tracers), as uncompiled. The trace is not reused: the
        place now holds an array. Whether it was such a value."""
        if value is MISSING:
            return False
        try:
            tracers = [x for x in _leaves(value) if is_tracer(x)]
        except (TypeError, ValueError):  # a pytree that cannot flatten (unsortable keys)
            return False
        if not tracers:
            return False
        if self._ours is None:
            self._ours = {id(x) for x in self.put if x is not MISSING}
        if not all(id(x) in self._ours for x in tracers):
            return False
        self.rebound.append([put, key, value])
        self.cacheable = False
        return True

    def _took(self, v: Any) -> None:
        self.took.append(f"a {type(v).__name__} it captures (entries taken out)")
        self.cacheable = False

    def _demote(self, node: Node, v: Any) -> Node:
        if has_places(node) or is_array(v):
            raise Unsettled
        if not isinstance(node, Unchecked):
            self.demoted = True
        return Unchecked()

    def _entries(
        self, items: list[tuple[Any, Node]], d: dict[Any, Any], skipped: Any = (), of: str = ""
    ) -> list[tuple[Any, Node]]:
        """The entries of a dict (or an object's `__dict__`) after a trace. Entries the
        function added (a default filled in on first use, lazy initialisation, a
        cached_property) are its own outputs, not checked; one it removed is no
        longer read. The others stay checked: the function may read them (as
        uncompiled, they stay fresh). `skipped`: names that were there, unchecked.
        `of`: the class of the object whose `__dict__` `d` is, for messages (empty
        for a dict's own entries)."""
        out = []
        for key, child in items:
            if key in d:
                where = _where(key, of)
                out.append((key, self._entry(child, d[key], d.__setitem__, key, where)))
            elif has_places(child):
                raise Unsettled
            else:
                self.demoted = True
        known = {key for key, _ in items}.union(skipped)
        for key in [k for k in d if k not in known]:
            if self._kept(d[key], d.__setitem__, key):
                out.append((key, Unchecked()))
                continue
            added = self._added(d[key], functools.partial(d.pop, key, None), _where(key, of))
            if key in d:  # else removed again: a traced value (`_added`)
                out.append((key, added))
        return out

    def _entry(
        self, node: Node, value: Any, put: Callable[[Any, Any], Any], key: Any, where: str
    ) -> Node:
        """`self.node` for an entry of a dict or object; a number or library object there
        that the function replaced by a value computed from traced arrays (a lazy
        `self.cache = f(self.w)`) is put back, so no tracer stays in the user's object."""
        if isinstance(node, (Const, Same)) and _holds_tracer(value):
            if self._kept(value, put, key):
                return node
            put(key, node.value if isinstance(node, Const) else node.get())
            self.lost.append(where)
            self.cacheable = False  # traced again each call; the places stay where they were
            return node
        if has_places(node) and _holds_tracer(value):
            self.rebound.append([put, key, value])
        return self.node(node, value)

    def _added(self, value: Any, remove: Callable[[], Any], where: str) -> Node:
        """An entry the function added to a dict or object while traced."""
        if self._dropped(value, remove, where):
            return Unchecked()
        if any(map(is_array, _leaves(value))):
            raise Unsettled
        self.demoted = True
        return Unchecked()

    def _dropped(self, value: Any, remove: Callable[[], Any], where: str) -> bool:
        """Remove a value the function put where there was none, when it was computed
        from the traced arrays (a cache filled on first use): left there it would be a
        tracer in the user's object after the call. Removed, it is computed again when
        next read, as a fresh cache is; the function is traced again each call (the
        places stay where they were). Whether it was removed."""
        if value is MISSING or not _holds_tracer(value):
            return False
        remove()
        self.lost.append(where)
        self.cacheable = False
        return True

    def _container(self, node: Node, children: list[Node]) -> Node:
        # Only the entries the function changed stop being checked: it may read
        # other entries of the same dict (a config it also logs into), and those
        # must stay fresh. Two compiled functions writing different entries of
        # one dict therefore re-trace each other: slower, never stale.
        return node

    def _rebound_in(self, node: Tree, kind: str, now: dict[Any, Any], old_paths: list[Any]) -> None:
        """A captured pytree whose structure the function changed: an array it also
        rebound there (`log.s = log.s * 2` beside `log.xs = [*log.xs, y]`) is named in
        `written`, so that the caller refuses the trace with its reason rather than
        losing the new array (it cannot be written back by place)."""
        for path, child in zip(old_paths, node.leaves, strict=True):
            value = now.get(path, MISSING)
            if type(child) is Array and value is not self.put[child.place] and is_array(value):
                self.written[child.place] = value
        if self.written:
            raise Unsettled(f"the structure of a {kind} it captures changed")

    def node(self, node: Node, v: Any) -> Node:
        self.values[id(node)] = v
        for alias in self.waiting.pop(id(node), ()):
            if not _same(node, alias, v):
                raise Unsettled
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
        if isinstance(node, Snap):
            if node.equal(v):
                return node
            if node.held is not None and type(v) is node.type:
                same = node.match(v, traced=True)
                if same is not None:
                    # The same items; a numpy array among them changed in place (by
                    # the function, in its copy): read anew on the next call.
                    if not same:
                        self.wrote = True
                        self.cacheable = False
                    return node
            if type(v) is node.type and (
                isinstance(node.value, np.ndarray) or node.type is memoryview
            ):
                # A numpy array read as a value (`Walk.as_values`), or the memory a
                # memoryview shows, that the function changed in place (`order.sort()`,
                # `view[0] = 1`): it reads the new contents on the next call, as
                # uncompiled, so this trace is not reused.
                self.wrote = True
                self.cacheable = False
                return node
            if type(v) is node.type and len(v) < node.size():
                self._took(v)
            return self._demote(node, v)
        if isinstance(node, Same):
            return node if v is node.get() else self._demote(node, v)
        if isinstance(node, Unchecked):
            if is_array(v):
                raise Unsettled
            return node
        if isinstance(node, Alias):
            if id(node.target) not in self.values:  # its node comes later
                self.waiting.setdefault(id(node.target), []).append(v)
            elif not _same(node.target, v, self.values[id(node.target)]):
                raise Unsettled
            return node
        if isinstance(node, Seq):
            n = len(node.items)
            if type(v) is list and len(v) > n and any(map(_holds_tracer, v[n:])):
                kept = [i for i in range(n, len(v)) if self._kept(v[i], v.__setitem__, i)]
                if len(kept) < len(v) - n:
                    # Values computed from the traced arrays appended while traced (a
                    # log): removed, as a cache filled on first use is (`_added`).
                    self.lost.append(f"{len(v) - n} item(s) appended to a list")
                    del v[n:]
                    self.rebound = [r for r in self.rebound if r[0] != v.__setitem__]
                    self.cacheable = False
                else:
                    # The user's own arrays appended (a history of the weights): the
                    # items before them are the places they were (written back as such);
                    # this trace is not reused (`_kept`).
                    node.items = [self.node(c, x) for c, x in zip(node.items, v, strict=False)]
                    return node
            if isinstance(v, list) and len(v) < n:
                self._took(v)
            if type(v) is not node.type or len(v) != len(node.items):
                return self._demote(node, v)
            node.items = [self.node(c, x) for c, x in zip(node.items, v, strict=True)]
            return self._container(node, [c for c in node.items])
        if isinstance(node, Map):
            if type(v) is not node.type:
                return self._demote(node, v)
            of = "" if node.type is dict else node.type.__name__
            if any(k not in v for k, _ in node.items):
                self._took(v)
            items = self._entries(node.items, v, of=of)
            if [k for k, _ in items] != list(v):
                # The function reordered the dict: the order is its output, not checked.
                node.ordered = False
                where = {k: i for i, k in enumerate(v)}
                items.sort(key=lambda item: where[item[0]])
            node.items = items
            return self._container(node, [c for _, c in node.items])
        if isinstance(node, Func):
            if type(v) is not types.FunctionType or v.__code__ is not node.code:
                return self._demote(node, v)
            cells: list[Node | None] = []
            freevars = v.__code__.co_freevars
            for k, (cell, cell_node) in enumerate(
                zip(v.__closure__ or (), node.cells, strict=True)
            ):
                place = f"closure variable {freevars[k]!r}"
                try:
                    value = cell.cell_contents
                except ValueError:
                    value = MISSING
                if cell_node is None:
                    if self._kept(value, functools.partial(_put_cell, cell), None):
                        cells.append(Unchecked())
                        continue
                    if self._dropped(value, functools.partial(_empty_cell, cell), place):
                        value = MISSING
                    cells.append(None if value is MISSING else self._demote(Unchecked(), value))
                elif value is MISSING:
                    cells.append(self._demote(cell_node, value))
                else:
                    put = functools.partial(_put_cell, cell)
                    cells.append(self._entry(cell_node, value, put, None, place))
            node.cells = cells
            g = v.__globals__
            names: list[tuple[str, Node | None]] = []
            for name, global_node in node.globals:
                # A global the function assigned a traced value (`global G; G = loss`):
                # put back, or removed if it was new, as an object's attribute is.
                value = g.get(name, MISSING)
                if global_node is None and self._kept(value, g.__setitem__, name):
                    names.append((name, Unchecked()))
                elif global_node is None:
                    if self._dropped(
                        value, functools.partial(g.pop, name, None), f"global {name!r}"
                    ):
                        value = MISSING
                    names.append(
                        (name, None if value is MISSING else self._demote(Unchecked(), value))
                    )
                elif value is MISSING:
                    names.append((name, self._demote(global_node, value)))
                else:
                    place = f"global {name!r}"
                    names.append(
                        (name, self._entry(global_node, value, g.__setitem__, name, place))
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
        if isinstance(node, Deref):
            if type(v) is not node.type:
                return self._demote(node, v)
            node.inner = self.node(node.inner, deref(node.kind, v))
            return node
        if isinstance(node, Modules):
            if type(v) is not dict:
                return self._demote(node, v)
            node.size = len(v)  # modules imported while traced (jax imports lazily)
            node.items = [(k, self.node(c, v.get(k, MISSING))) for k, c in node.items]
            return node
        if isinstance(node, Obj):
            if type(v) is not node.type.get():
                return self._demote(node, v)
            d = getattr(v, "__dict__", {}) if has_instance_dict(v) else {}
            node.attrs = self._entries(node.attrs, d, node.skipped, of=type(v).__name__)
            node.skipped = [k for k in node.skipped if k in d]
            node.slots = [(k, self.node(c, getattr(v, k, MISSING))) for k, c in node.slots]
            return node
        if isinstance(node, Tree):
            leaves, treedef = jax.tree_util.tree_flatten(v)
            if treedef != node.treedef:
                paths = _key_paths(treedef)
                old_paths = _key_paths(node.treedef)
                if paths is None or paths != old_paths:
                    if paths is not None and old_paths is not None and set(old_paths) - set(paths):
                        # Entries taken out (an OrderedDict's `popitem`, a defaultdict's
                        # `pop`: pytrees of jax's): the next call reads what is left.
                        self._took(v)
                    # (An optimiser state is put back whole by `_restore_tree`, and the
                    # trace refused with its own reason: `Swap.reverted`.)
                    if paths is not None and old_paths is not None and type(v) not in IN_PLACE:
                        now = dict(zip(paths, leaves, strict=True))
                        self._rebound_in(node, type(v).__name__, now, old_paths)
                    return self._demote(node, v)
            # The same places (perhaps a static attribute the function changed, a
            # counter): arrays it rebound are written back. The node keeps the old
            # structure, so the next call fails its guard and traces again, reading
            # the changed value fresh, as the uncompiled function would.
            node.leaves = [self.node(c, x) for c, x in zip(node.leaves, leaves, strict=True)]
            return node
        if isinstance(node, ParamsNode):
            node.source = self.node(node.source, v._sources)
            return node
        if isinstance(node, Fixed):
            func = self.node(node.func, node.obj.get())
            if isinstance(func, Unchecked):  # the function's code changed while tracing
                raise Unsettled
            node.func = func
            return node
        if isinstance(node, Attrs):
            d = vars(node.obj.get())
            attrs: list[tuple[str, Node]] = []
            for name, child in node.attrs:
                value = d.get(name, MISSING)
                if value is MISSING and isinstance(child, Const) and child.value is MISSING:
                    attrs.append((name, child))  # a name checked to stay absent, still absent
                    continue
                attrs.append(
                    (
                        name,
                        self._demote(child, value) if value is MISSING else self.node(child, value),
                    )
                )
            node.attrs = attrs
            return node
        raise AssertionError(type(node))  # pragma: no cover


class Scrub(Settle):
    """`Settle` after the function raised while traced (`_programs._scrub`): each value
    computed from the traced arrays is taken out of the user's objects as after a run
    that returns; a place whose structure changed (Unsettled) is left to `Swap.restore`,
    and its siblings are still scrubbed."""

    def node(self, node: Node, v: Any) -> Node:
        try:
            return super().node(node, v)
        except Unsettled:
            return node


def _where(key: Any, of: str) -> str:
    """A place in a dict (`of` empty) or in an object's `__dict__`, for messages."""
    return f"attribute {key!r} of a {of}" if of else f"dict entry [{key!r}]"


def _same(target: Node, alias: Any, v: Any) -> bool:
    """Whether an Alias's route holds the object of its target's route. A `jax.jit` or
    `tg.jit` helper reached first is replaced by its function while traced (inlined);
    the same helper reached again is not."""
    return alias is v or (isinstance(target, Jitted) and getattr(alias, "__wrapped__", None) is v)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and a != a:
        return b != b
    return bool(a == b)


def holders(nodes: list[Node], places: set[int]) -> set[int]:
    """Ids of the nodes on the way to the given places (for `Swap(only=...)`)."""
    out: set[int] = set()

    def visit(node: Node) -> bool:
        if isinstance(node, Array):
            hit = node.place in places
        else:
            hit = False
            for child in children(node):
                hit = visit(child) or hit
        if hit:
            out.add(id(node))
        return hit

    for node in nodes:
        visit(node)
    return out


def _leaves(value: Any) -> list[Any]:
    """`value`'s leaves; an iterator it holds (one the function keeps) is a leaf, as jax
    takes it today with a DeprecationWarning (an error in later jax)."""
    return jax.tree_util.tree_leaves(value, is_leaf=_is_iterator)


def _is_iterator(x: Any) -> bool:
    return hasattr(type(x), "__next__")


def _holds_tracer(value: Any) -> bool:
    """Whether `value` holds a traced array (one the function computed while traced)."""
    try:
        leaves = _leaves(value)  # [value] for a leaf, a tracer too
    except (TypeError, ValueError):  # a pytree that cannot flatten (a dict of unsortable keys)
        return True  # it may hold one: treated as one, so no tracer can stay behind
    return any(map(is_tracer, leaves))


def _put_cell(cell: Any, _key: Any, value: Any) -> None:
    cell.cell_contents = value


def _empty_cell(cell: Any) -> None:
    del cell.cell_contents
