"""Taking stock after the traced function ran: `Settle`.

`Swap` (`_swap.py`) put the tracers into the places the function reads; once it
has run, `Settle` compares each place with what was put there: arrays the
function rebound become outputs to write back, a value it can read that it
changed itself (a counter) makes the trace one not to reuse, a log it appends
to is its output, no longer checked, and values computed from its traced
arrays that it stored in the user's objects are taken out. `Scrub` does
the same after the function raised.
"""

import functools
import types
from collections.abc import Callable
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
    children,
    deref,
    has_places,
)
from ._jaxpr import is_tracer
from ._kinds import has_instance_dict, is_array
from ._paths import IN_PLACE
from ._swap import Unsettled, _holds_tracer, _key_paths, _leaves
from ._tree import same_structure

# The Python values a call's runs of the function changed (a counter it advances): each
# run is undone after it (`Settle.undo_changes`), so that every run of the call starts
# from the values the call found (the Hessian's several runs, a trace made again for
# unused inputs, a numpy retry), and the last run's are made once when the call ends
# (`changes_made`). One frame per call in progress (`_cache._new`), innermost last.
CHANGES: list[list[Any]] = []  # (undo, redo) pairs


def changes_made(frame: list[Any]) -> None:
    """Make the Python changes of a call's last run, once (the call succeeded)."""
    for _, redo in frame:
        redo()


_UNKNOWN: Any = object()


def _current(put: Any, key: Any) -> Any:
    """What the place that `put(key, value)` writes holds now (MISSING if nothing;
    `_UNKNOWN` for a place this cannot read, whose change is then made as before)."""
    if isinstance(put, functools.partial) and put.func is _put_cell:
        try:
            return put.args[0].cell_contents
        except ValueError:  # an empty cell
            return MISSING
    target = getattr(put, "__self__", None)
    if isinstance(target, dict):
        return target.get(key, MISSING)
    if isinstance(target, list):
        return target[key] if 0 <= key < len(target) else MISSING
    return _UNKNOWN


def _redo_if(put: Any, key: Any, expected: Any, redo: Callable[[], Any]) -> Callable[[], Any]:
    """`redo`, made only while the place still holds `expected` (what the undo put back).
    Between the undo of the last run and the end of the call (the compile), another thread
    may write the place (`cfg["s"] = 3.0` while this thread's call compiles, the place
    changed during the trace by that thread, not by the function): its write is the
    newer one and must stay, not be overwritten by the value this trace saw."""

    def redo_unless_rewritten() -> None:
        now = _current(put, key)
        if now is expected or now is _UNKNOWN:
            redo()

    return redo_unless_rewritten


class Settle:
    """Compare the places after a trace with what was put there.

    Array places now holding another array were rebound by the function (an
    in-place update): they go into `written`. A number, helper or entry the
    function changed itself (a counter) makes the trace not reusable (`_changed`);
    a list or set it appended to (a log) is demoted to `Unchecked`, its output.
    `node(n, v)` returns the node to guard from now on.
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
        # Places holding a value the function can read that it changed itself (a counter
        # `c["n"] += 1`, a helper it swapped, an entry it deleted): uncompiled, the next
        # call reads the new value, so this trace is not reused (`_changed`).
        self.changed: list[str] = []
        self._at: str | None = None  # the place `node` is looking at, when `_entry` knows it
        # For each value the function changed at a place it can read: how to put the old
        # value back, and how to make the change again (`undo_changes`).
        self.changes: list[tuple[Callable[[], Any], Callable[[], Any]]] = []

    def undo_changes(self) -> None:
        """Put back the Python values this run changed, and leave the changes to make
        once the call ends (`CHANGES`): the call's next run (if any) starts from the
        values the call found, as the function uncompiled runs once. Outside a call in
        progress (a cached program run again by jax), the changes stay as made."""
        if not CHANGES:
            return
        # A run after the first finds the places it changed already demoted, and records
        # nothing: it made the same changes from the same values (the second argument's
        # Hessian), so the first run's are undone again.
        changes = self.changes or CHANGES[-1]
        for undo, _ in reversed(changes):
            undo()
        CHANGES[-1][:] = changes

    def _change_at(self, put: Callable[[Any, Any], Any], key: Any, old: Any, new: Any) -> None:
        redo = _redo_if(put, key, old, functools.partial(put, key, new))
        self.changes.append((functools.partial(put, key, old), redo))

    def _items(self, node: Seq, v: Any) -> None:
        """Settle a list's or tuple's first items (those it had when the trace began)."""
        at, self._at = self._at, self._at and f"an item of {self._at}"
        try:
            items = list(zip(node.items, v, strict=False))
            for i, (c, x) in enumerate(items):
                old = _old_value(c, x)
                if old is not MISSING and type(v) is list:
                    self._change_at(v.__setitem__, i, old, x)
            node.items = [self.node(c, x) for c, x in items]
        finally:
            self._at = at

    def _our_ids(self) -> set[int]:
        """Ids of the values put in the places for the trace (made once, when needed)."""
        if self._ours is None:
            self._ours = {id(x) for x in self.put if x is not MISSING}
        return self._ours

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
        ours = self._our_ids()
        if not all(id(x) in ours for x in tracers):
            return False
        self.rebound.append([put, key, value])
        self.cacheable = False
        return True

    def _took(self, v: Any) -> None:
        self.took.append(f"a {type(v).__name__} it captures (entries taken out)")
        self.cacheable = False

    def _demote(self, node: Node, v: Any, log: bool = False) -> Node:
        """The node of a place whose value the function changed: no longer checked. Unless
        `log` (a list or set it only adds to: an output, see `_changed`), this trace is
        not reused."""
        if has_places(node) or is_array(v):
            raise Unsettled
        if not isinstance(node, Unchecked):
            self.demoted = True
            if not log:
                self._changed()
        return Unchecked()

    def _changed(self, where: str | None = None) -> None:
        """The function changed a value it can read: a number (`self.step += 1`, `c["n"]
        *= 2`), a helper, an entry it deleted, a default it filled in on first use. Its
        result may depend on that value (`lr = sched(self.step)`), so, as uncompiled, the
        next call must read the new one: this trace is not reused, and the next call
        traces again with the value as it finds it. A write made once (a default filled
        in, `self.training = True`) costs one trace more, then the value is checked as an
        input; one made on every call (a counter) has the function traced on every call,
        said once (`_cache._warn_changed`). A list or set it only appends to (a log,
        `traces.append(1)`) is its output instead, as with `jax.jit`: appended when
        traced, not checked."""
        self.cacheable = False
        where = where or self._at or "a value it captures"
        if where not in self.changed:
            self.changed.append(where)

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
        # Entries as stored (`dict.__getitem__`): a user's dict subclass's own
        # `__getitem__` may compute what it returns, which is not a change.
        for key, child in items:
            if key in d:
                where = _where(key, of)
                out.append(
                    (key, self._entry(child, dict.__getitem__(d, key), d.__setitem__, key, where))
                )
            elif has_places(child):
                raise Unsettled
            else:
                self.demoted = True
                self._changed(_where(key, of))  # an entry it deleted
                old = _old_value(child, MISSING)
                if old is not MISSING:
                    self.changes.append(
                        (
                            functools.partial(d.__setitem__, key, old),
                            _redo_if(d.__setitem__, key, old, functools.partial(d.pop, key, None)),
                        )
                    )
        known = {key for key, _ in items}.union(skipped)
        for key in [k for k in d if k not in known]:
            if self._kept(dict.__getitem__(d, key), d.__setitem__, key):
                out.append((key, Unchecked()))
                continue
            added = self._added(
                dict.__getitem__(d, key), functools.partial(d.pop, key, None), _where(key, of)
            )
            if key in d:  # else removed again: a traced value (`_added`)
                out.append((key, added))
                new = dict.__getitem__(d, key)
                self.changes.append(
                    (
                        functools.partial(d.pop, key, None),
                        _redo_if(
                            d.__setitem__, key, MISSING, functools.partial(d.__setitem__, key, new)
                        ),
                    )
                )
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
        old = _old_value(node, value)
        if old is not MISSING:
            self._change_at(put, key, old, value)
        at, self._at = self._at, where
        try:
            return self.node(node, value)
        finally:
            self._at = at

    def _added(self, value: Any, remove: Callable[[], Any], where: str) -> Node:
        """An entry the function added to a dict or object while traced."""
        if self._dropped(value, remove, where):
            return Unchecked()
        if any(map(is_array, _leaves(value))):
            raise Unsettled
        self.demoted = True
        # A default filled in on first use (`setdefault`, a lazy attribute, a
        # cached_property): the next call reads it, so it is checked from then on. One
        # added on every call (a new key each call) is said, as a counter is.
        self._changed(f"{where} (added)")
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
        # An array moved within it (a layer popped or two swapped) is one put there
        # for the trace, and goes back with its layer (`_swap._restore_tree`).
        moved = self._our_ids()
        for path, child in zip(old_paths, node.leaves, strict=True):
            value = now.get(path, MISSING)
            if type(child) is Array and id(value) not in moved and is_array(value):
                self.written[child.place] = value
        if self.written:
            raise Unsettled(f"the structure of {_a(kind)} it captures changed")

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
            if _same_value(v, node.value):
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
            # A set or deque it adds to (a log), its old items kept: its output. (One the
            # code also reads, `len(seen)`, is a counter: `Snap.read`.)
            return self._demote(node, v, log=_grew(node, v) and not node.read)
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
                # A list it appends to (a log, `traces.append(1)`), its old items
                # unchanged: its output. (A tuple rebound longer is a new value.)
                # (One the code also reads, `len(log)`, is a counter: `Seq.read`.)
                log = node.type is list and type(v) is list and len(v) > n and not node.read
                if log:
                    before = len(self.changed), self.cacheable
                    self._items(node, v)
                    log = len(self.changed) == before[0] and self.cacheable == before[1]
                return self._demote(node, v, log=log)
            self._items(node, v)
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
                    if value is not MISSING:
                        self.cacheable = False  # filled on first use: read from now on
                    cells.append(None if value is MISSING else self._demote(Unchecked(), value))
                elif value is MISSING:
                    self._changed(place)  # emptied (`del`)
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
                    if value is not MISSING:
                        self.cacheable = False  # a new global: read from now on
                    names.append(
                        (name, None if value is MISSING else self._demote(Unchecked(), value))
                    )
                elif value is MISSING:
                    self._changed(f"global {name!r}")  # deleted
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
            # (The inner function where the swap inlined it: a function, or the bound
            # method or partial of `jax.jit(obj.method)`.)
            inner = getattr(v, "__wrapped__", MISSING) if type(v) is node.type else v
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
            if not same_structure(treedef, node.treedef):
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
            if not same_structure(treedef, node.treedef):
                at = f" ({self._at})" if self._at else ""
                self._changed(f"the static data of {_a(type(v).__name__)}{at}")
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


def _grew(node: Any, v: Any) -> bool:
    """Whether a mutable container the walk compares whole (a set, a deque, a Mapping
    that is not a dict: a cache filled) only had items added while traced, its old
    items kept: a log. A frozenset rebound larger is a new value, not a log."""
    if type(v) is not node.type or len(v) <= node.size() or node.type is frozenset:
        return False
    if node.held is not None:
        return True  # items held by identity (a queue of batches), appended to
    try:
        if node.as_dict:
            return set(node.value) <= set(dict(v))
        if isinstance(v, set):
            return set(node.value) <= v
        return list(v)[: len(node.value)] == list(node.value)
    except TypeError:
        return False


def _where(key: Any, of: str) -> str:
    """A place in a dict (`of` empty) or in an object's `__dict__`, for messages."""
    return f"attribute {key!r} of {_a(of)}" if of else f"dict entry [{key!r}]"


def _a(name: str) -> str:
    """`name` with its article, for messages: "a Trainer", "an Obj", "a _Stack"."""
    return f"{'an' if name.lstrip('_')[:1].lower() in 'aeiou' and name[:1] else 'a'} {name}"


def _same(target: Node, alias: Any, v: Any) -> bool:
    """Whether an Alias's route holds the object of its target's route. A `jax.jit` or
    `tg.jit` helper reached first is replaced by its function while traced (inlined);
    the same helper reached again is not."""
    return alias is v or (isinstance(target, Jitted) and getattr(alias, "__wrapped__", None) is v)


def _same_value(now: Any, old: Any) -> bool:
    """Whether a number's or string's place holds the value a Const was made from."""
    return now is old or (type(now) is type(old) and _equal(now, old))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (float, complex, np.floating, np.complexfloating)) and a != a:
        # NaN (a Python, complex or numpy one): the same NaN when written again.
        return bool(b != b) and repr(a) == repr(b)
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


def _old_value(node: Node, now: Any) -> Any:
    """The value a number's or library object's place held when the trace began, if the
    function changed it (`now` is what it holds now); else MISSING."""
    if isinstance(node, Const):
        old = node.value
        if old is MISSING or _same_value(now, old):
            return MISSING
        return old
    if isinstance(node, Same):
        old = node.get()
        return MISSING if now is old or (node.weak and old is None) else old
    return MISSING


def _put_cell(cell: Any, _key: Any, value: Any) -> None:
    cell.cell_contents = value


def _empty_cell(cell: Any) -> None:
    del cell.cell_contents
