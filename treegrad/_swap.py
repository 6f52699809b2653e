"""Putting tracers into the places a function reads, and taking them out again.

While the engine traces a function, `Swap` writes the tracers into the user's
own cells, globals, containers and objects (recording every write so that
`restore` undoes exactly them), so the function runs on its real objects. After
the function ran, `Settle` (`_settle.py`) compares the places with what was put
there: arrays the function rebound become outputs to write back, values it
changed itself (counters, logs) stop being checked by the guard.
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
    Seq,
    Snap,
    Tree,
    deref,
    same_array,
)
from ._jaxpr import is_tracer
from ._kinds import has_instance_dict, is_array, is_pytree_node
from ._paths import IN_PLACE, rebind, rebind_value
from ._reach import slot_names
from ._tree import iterable_leaf, same_structure


class Unsettled(Exception):
    """The trace changed where arrays live (not only their values): not cacheable."""


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
        # Pytrees that could not take the tracers in place and were rebuilt (`_tree`),
        # by the id of the user's object: (the user's, the rebuilt one).
        self.stand_ins: dict[int, tuple[Any, Any]] = {}

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
                    self._set_item(v, i, self.put(child, _stored(v, i)), self._forced(child))
                return v
            items = [self.put(child, x) for child, x in zip(node.items, v, strict=True)]
            if all(a is b for a, b in zip(items, v, strict=True)):
                return v
            made = type(v)._make(items) if hasattr(v, "_fields") else type(v)(items)
            return self._stand_in(v, made)
        if isinstance(node, Map):
            for key, child in node.items:
                self._set_item(v, key, self.put(child, _stored(v, key)), self._forced(child))
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
            # (`v` is the inner function itself where an earlier pass inlined it: a
            # function, or the bound method or partial of `jax.jit(obj.method)`.)
            jitted = type(v) is node.type
            inner = v.__wrapped__ if jitted else v
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
        if isinstance(node, Alias):
            # An object reached first by another route, where it was rebuilt with the
            # tracers (an immutable pytree; a flax nnx Module, whose Variables refuse
            # them): this route gets the same rebuilt object, so every route the
            # function reads it by (the loss's closure and the Params built from the
            # module, `tg.params(m)`) holds the same traced arrays. Left as it was, the
            # Params read the user's arrays while the loss read the tracers: "the loss
            # depends on none of the parameters" inside tg.jit and tg.train.
            pair = self.stand_ins.get(id(v))
            return pair[1] if pair is not None and pair[0] is v and self.record else v
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
        old = _stored(container, key)
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
            # So may a captured Module with no arrays put in it (a lazy layer whose
            # `self.w = None` the function fills in while traced): without a restore
            # logged, nothing took that tracer out again and the next call failed
            # with jax's UnexpectedTracerError (`held`: it has containers to scrub).
            if type(v) in IN_PLACE or self.again or held:
                self._log(lambda: _restore_tree(v, treedef, leaves, {}, self, held))
            return v
        ours = {id(b): a for a, b in zip(leaves, new, strict=True) if a is not b}
        try:
            rebind(v, changed)
        except TypeError:
            # Not writable in place (an immutable pytree): the parent rebinds a new one.
            return self._stand_in(v, jax.tree_util.tree_unflatten(treedef, new))
        except Exception as e:  # flax's TraceContextError only; any other re-raised
            # A flax.nnx Variable refuses a value from another trace level
            # (TraceContextError, matched by name: flax is not imported here). The user
            # saw flax's bare error from every implicit-mode call on an nnx.Module; treat
            # the node as immutable instead, after putting back any leaf written before
            # the refusal, so the parent rebinds a new one (as for a frozen pytree).
            if type(e).__name__ != "TraceContextError":
                raise
            _restore_tree(v, treedef, leaves, ours, self, held)
            return self._stand_in(v, jax.tree_util.tree_unflatten(treedef, new))
        if self.record:
            self.originals.update(ours)
        self._log(lambda: _restore_tree(v, treedef, leaves, ours, self, held))
        return v

    def _stand_in(self, v: Any, new: Any) -> Any:
        """`new`, rebuilt in place of the user's `v`: what another route to `v` gets too.
        `detrace` puts `v` back wherever the function left `new` (a place the trace's
        settling found holding tracers): the user's own object, not an equal copy, so
        the routes that reach it stay one object (checked by the guard)."""
        if self.record:
            self.stand_ins[id(v)] = (v, new)
            self.originals[id(new)] = v
        return new


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


def _stored(container: Any, key: Any) -> Any:
    """`container[key]` as stored, as the walk read it: a user's dict or list subclass's
    own `__getitem__` (which may compute what it returns: `self.get(k.lower()) * s`)
    is not run, so a value it computes is never written back in place of the stored one."""
    if isinstance(container, dict):
        return dict.__getitem__(container, key)
    if isinstance(container, list):
        return list.__getitem__(container, key)
    return container[key]


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
    elif same_structure(now_def, treedef):
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
        elif has_instance_dict(x) and is_pytree_node(x):
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


def _leaves(value: Any) -> list[Any]:
    """`value`'s leaves; an iterator it holds (one the function keeps) or a dict's values
    view (`vals = cfg.values()`, read by the function) is a leaf, as jax takes it today
    with a DeprecationWarning (an error in later jax)."""
    return jax.tree_util.tree_leaves(value, is_leaf=iterable_leaf)


def _holds_tracer(value: Any) -> bool:
    """Whether `value` holds a traced array (one the function computed while traced)."""
    try:
        leaves = _leaves(value)  # [value] for a leaf, a tracer too
    except (TypeError, ValueError):  # a pytree that cannot flatten (a dict of unsortable keys)
        return True  # it may hold one: treated as one, so no tracer can stay behind
    return any(map(is_tracer, leaves))
