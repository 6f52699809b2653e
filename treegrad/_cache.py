"""Steps 2 and 4 of the engine (`_engine`): the cache of compiled programs, and a call.

`execute` runs a function under one of the programs (`_programs`): the last
arguments' structure seen with the function (generated code, `_fasttree.Shape`)
finds its bucket without flattening; each entry's guard then says whether it
fits. On a miss a new `Entry` is traced and filed. The cache is bounded by a
number of programs (least recently used first out); `clear_cache` forgets it
and every memo.
"""

from __future__ import annotations

import collections
import functools
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import _kinds as K
from . import _optguard
from ._call import _BARE, _GROUPS, Call, root_keys, uniq_in_groups
from ._draws import Draws
from ._engine import NUMPY_VALUES, VALUED_SEEN, Entry, Refit, deleted_input, values_mode
from ._fasttree import Shape
from ._outputs import DYN, shared_nodes
from ._paths import _LAST, _SETTERS
from ._programs import CALL
from ._reach import _SLOT_NAMES, describe
from ._settle import CHANGES, changes_made
from ._tree import describe_leaf, user_stacklevel


class RetraceWarning(UserWarning):
    """Warned once per function that treegrad must trace again on every call.

    Four causes, each named in the message with its fix. The function captures
    arrays treegrad cannot track: it is re-traced on every call, so its result is
    never stale. treegrad sees into closures, globals, containers, plain objects,
    classes and pytrees; an array inside, say, a `collections.deque` is out of
    its sight. Or the function stores values computed from its traced arrays in
    your objects (a loss log it appends to): they cannot stay there as tracers,
    so they are taken out again after each trace. Or it draws from numpy's or
    Python's random generators while traced: compiled, the draw would repeat.
    Or it changes, on every call, a Python value it can read (a counter it
    advances, `self.step += 1`): compiled, the next call would read the old one.

    Examples:
        >>> import collections, warnings, jax.numpy as jnp, treegrad as tg
        >>> d = collections.deque([jnp.ones(2)])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     g = tg.gradient(lambda v: jnp.sum(v * d[0]), jnp.ones(2))
        >>> caught[0].category is tg.RetraceWarning
        True
    """


# Each compiled program costs about 1.5 MB of resident memory (measured on CPU,
# jax 0.10: see docs/benchmarks.md), so the cache is bounded by a number of
# programs that keeps it near 200 MB; least recently used first out.
MAX_ENTRIES = 128
_CACHE: dict[Any, list[Entry]] = {}
_LRU: collections.OrderedDict[int, tuple[Any, Entry]] = collections.OrderedDict()
_WARNED: set[Any] = set()
# Per function (and program, options): the last arguments' structure, its ties, its
# bucket and its argument groups (`_call._groups`).
_Slots = tuple[int, ...] | None
_RECENT: dict[Any, tuple[Shape, _Slots, list[Entry], _Slots, Any, bool]] = {}
_SHAPES: dict[Any, Shape] = {}
# Other modules' memos (per code object or type), forgotten by clear_cache too.
MEMOS: list[Any] = [_SETTERS, _LAST, _SLOT_NAMES, NUMPY_VALUES, VALUED_SEEN, _BARE]
# Per function: how many traces in a row changed a value it can read (`_warn_changed`).
_CHANGING: dict[Any, int] = {}
MEMOS.append(_CHANGING)


# Calls from several threads take turns, the optimiser's `update`s too. While a function
# is traced, tracers stand in the places it reads arrays from (a captured model's
# entries) until the trace ends: another thread's call would read them there, and with
# both restoring, one could be left in the user's model for good. Re-entrant: a call
# inside a traced function (a gradient of a gradient) is in the same thread.
TURN = threading.RLock()


def execute(
    program: str,
    api: str,
    options: Any,
    roots: tuple[Any, ...],
    args: Any,
    *,
    params: Sequence[Any] | None = None,
    make: Callable[[Call], Entry] | None = None,
) -> tuple[Entry, Any]:
    """Run `roots[0]` under `program`; returns the entry and `(deps, packed, grads)`."""
    with TURN:
        try:
            f = roots[0]
            rk = (
                f.__code__
                if len(roots) == 1 and type(f) is types.FunctionType
                else root_keys(roots)
            )
            recent_key = (program, options, rk)
            recent = _RECENT.get(recent_key)
            if recent is not None:
                # The arguments' structure seen last with this function, read by generated
                # code: the same structure and ties give the same cache key.
                shape, slots, last, groups, shared, bare = recent
                leaves = shape.flatten(args)
                if leaves is not None:
                    if slots is None and not bare and len(set(map(id, leaves))) == len(leaves):
                        # No tied arrays: the usual case; the usual explicit gradient in one step.
                        if last and last[0].fast and params is None:
                            first = last[0]
                            out = first.run_plain(roots, leaves)
                            if out is not None:
                                _LRU.move_to_end(id(first))
                                return first, out
                            last = last[1:]  # not this call's entry (see `run_plain`)
                        hit = _lookup(last, roots, leaves, params)
                    else:
                        a_uniq, a_slots = uniq_in_groups(leaves, groups)
                        # With a node holding no array (`bare`), sharing is read afresh.
                        same = a_slots == slots and (
                            (a_slots is None and not bare) or shared_nodes(args) == shared
                        )
                        hit = _lookup(last, roots, a_uniq, params) if same else None
                    if hit is not None:
                        return hit
            call = Call(program, options, roots, args)
            bucket = _CACHE.get(call.key)
            if bucket is not None:
                hit = _lookup(bucket, roots, call.a_uniq, params)
                if hit is not None:
                    _remember(recent_key, call, bucket)
                    return hit
            if make is None:
                make = functools.partial(Entry, program, api, options, params=params)
            entry, out = _new(make, call, params)
            if program != CALL and call.a_statics is not None:
                _warn_opaque_argument(entry, roots[0])
            if entry.changed:
                _CHANGING[rk] = _CHANGING.get(rk, 0) + 1
            else:
                _CHANGING.pop(rk, None)
            if entry.cacheable:
                _remember(recent_key, call, _store(call.key, entry))
            else:
                if _CHANGING.get(rk, 0) >= 2 and not entry.drew:
                    # (Not after one trace: a write made on the first call only, a default
                    # filled in. Not for a random state or iterator: `_warn_drew` says it.)
                    _warn_changed(entry, roots[0])
                if entry.hidden and all(random for _, random in entry.drew):
                    # (Arrays an iterator yields are hidden too: the iterator is named below.)
                    _warn_hidden(entry, roots[0])
                if entry.lost:
                    _warn_lost(entry, roots[0])
                if entry.drew:
                    _warn_drew(entry, roots[0])
                if entry.wrote:
                    _warn_wrote(entry, roots[0])
            if (
                entry.valued
                and not entry.wrote
                and NUMPY_VALUES.get(root_keys(roots), 0) >= _VALUED_TRACES
            ):
                _warn_valued(entry, roots[0])
            return entry, out
        except Exception as e:  # re-raised as it is unless an input was deleted
            # A failed call: an input deleted (donated to an earlier call, `x.delete()`)
            # is named, not left to XLA's "Invalid buffer passed to Execute()".
            deleted = deleted_input(api, program, roots, args, e)
            if deleted is None:
                raise
            raise deleted from e


def _new(
    make: Callable[[Call], Entry], call: Call, params: Sequence[Any] | None
) -> tuple[Entry, Any]:
    """Walk, trace and run a new entry. A trace that fails while captured numpy arrays
    are inputs is tried once more with them read as values (`_engine.NUMPY_VALUES`):
    numpy code that changes one in place (`order[0] = 1.0`, `np.random.shuffle(order)`,
    `np.add(buf, 1, out=buf)`) or needs its value (`float(scale[0])`) fails on the jax
    tracer that stands in for it, and runs on the array itself, as uncompiled."""
    # The Python values the function changes (a counter) are changed once a call, by
    # its last run, however many runs tracing takes (`_settle.CHANGES`).
    frame: list[Any] = []  # (undo, redo) pairs
    CHANGES.append(frame)
    try:
        entry, out = _new_run(make, call, params)
    finally:
        CHANGES.pop()
    changes_made(frame)
    return entry, out


def _new_run(
    make: Callable[[Call], Entry], call: Call, params: Sequence[Any] | None
) -> tuple[Entry, Any]:
    entry = make(call)
    draws = Draws(entry.consumed) if entry.numpy_places else None
    try:
        return _first_run(entry, make, call, params)
    except _NOT_NUMPY as e:
        key = root_keys(call.roots)
        if draws is None or key in NUMPY_VALUES:
            raise
        error = e
    draws.restore()  # uncompiled, the function draws once: the failed trace's are undone
    values_mode(key)
    try:
        return _first_run(make(call), make, call, params)
    except BaseException as again:  # any: values mode undone; non-numpy ones propagate
        NUMPY_VALUES.pop(key, None)
        VALUED_SEEN.pop(key, None)
        if not isinstance(again, _NOT_NUMPY):
            raise
    raise error  # it fails either way: the error of the function as the user wrote it


# What numpy code meets on the jax tracer standing in for a numpy array: a missing method
# (`fill`), a refused write (`x[0] = 1`, `out=`), a value a trace cannot know (jax's
# concretization errors are TypeErrors, a boolean mask an IndexError), a type numpy's C
# code refuses, numpy's own warning about the tracer turned into an error (`shuffle`
# warns that it is not a Sequence). Any other error is not retried.
_NOT_NUMPY = (TypeError, AttributeError, NotImplementedError, IndexError, ValueError, Warning)


def _first_run(
    entry: Entry, make: Callable[[Call], Entry], call: Call, params: Sequence[Any] | None
) -> tuple[Entry, Any]:
    """The new entry's first run. Its guard was built from the values the walk read; a
    thread that changes one meanwhile (a config it toggles) makes the guard refuse them:
    walked again then, as the next call would be."""
    for _ in range(_REWALKS):
        cl = entry.guard.check(*call.roots)
        if cl is not None:
            dyn = entry.bind(cl, call.a_uniq, params)
            return entry, entry.first_run(call.roots, dyn, params)
        entry = make(call)
    raise RuntimeError(
        f"treegrad: what the function reads changed {_REWALKS} times while it was being "
        "compiled (another thread changes it without pause): change it between calls, or "
        "pass the value as an argument."
    )


_REWALKS = 20


def _lookup(
    bucket: list[Entry], roots: tuple[Any, ...], a_uniq: list[Any], params: Sequence[Any] | None
) -> tuple[Entry, Any] | None:
    """Run the first entry of `bucket` whose guard and ties accept this call."""
    for entry in bucket:
        cl = entry.guard.check(*roots)
        if cl is None:
            continue
        if entry.plain and params is None and len(set(map(id, cl))) == len(cl):
            dyn = cl + a_uniq  # the usual explicit call: `matches` and `fits` in one test
        else:
            cl_uniq = entry.matches(cl, params)
            if cl_uniq is None or not entry.fits(cl_uniq + a_uniq):
                continue
            dyn = cl_uniq + a_uniq
        try:
            out = entry.run(roots, dyn)
        except Refit:  # a new trace read differentiation otherwise: another entry's call
            continue
        _LRU.move_to_end(id(entry))
        return entry, out
    return None


def _store(key: Any, entry: Entry) -> list[Entry]:
    bucket = _CACHE.setdefault(key, [])
    bucket.insert(0, entry)
    _LRU[id(entry)] = (key, entry)
    while len(_LRU) > MAX_ENTRIES:
        _, (old_key, old) = _LRU.popitem(last=False)
        old_bucket = _CACHE[old_key]
        old_bucket.remove(old)
        if not old_bucket:
            del _CACHE[old_key]
    return bucket


def _remember(recent_key: Any, call: Call, bucket: list[Entry]) -> None:
    """File the bucket a call hit under its function, with its arguments' structure as
    generated code, for the next call's fast path (`execute`). Only for arguments whose
    leaves are all arrays: other leaves key the cache by value."""
    if call.a_statics is not None:
        return
    shape = _SHAPES.get(call.a_def)
    if shape is None:
        if len(_SHAPES) >= 4 * MAX_ENTRIES:
            _SHAPES.clear()
        shape = _SHAPES[call.a_def] = Shape(call.a_def, call.a_uniq)
    if len(_RECENT) >= 4 * MAX_ENTRIES:
        _RECENT.clear()
    # An emptied bucket is dropped from the cache; the one held here then stays
    # empty, so the fast path misses and the slow path files the new one.
    _RECENT[recent_key] = (shape, call.a_slots, bucket, call.groups, call.a_shared, call.a_bare)


def _say(message: str) -> None:
    warnings.warn(message, RetraceWarning, stacklevel=user_stacklevel())


def _first(f: Any, kind: str) -> bool:
    """Whether this is the first warning of `kind` for `f`'s code: each is said once."""
    key = (getattr(f, "__code__", None) or type(f), kind)
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


def _warn_hidden(entry: Entry, f: Any) -> None:
    if not _first(f, "hidden"):
        return
    what = ", ".join(entry.hidden[:5])
    _say(
        f"treegrad cannot cache {describe(f)}: it captures {len(entry.hidden)} array(s) "
        f"({what}) through objects it cannot see into, so it is re-traced on every call to "
        "stay correct. Pass these arrays as arguments, or hold them in a tg.Module, list, "
        "dict, plain object or a closure variable."
    )


def _warn_opaque_argument(entry: Entry, f: Any) -> None:
    """A gradient's argument that is not a pytree but holds arrays (a plain dataclass):
    jax takes it for one leaf, so its gradient is None, the classic silent None. Its
    arrays are read as the function's captured ones (inputs, fresh); say which argument
    and how to differentiate them, once."""
    holder = next((x for x in entry.a_statics or () if _holds_arrays(x)), None)
    if holder is None or not _first(f, "opaque"):
        return
    name = type(holder).__name__
    what = ", ".join(describe_leaf(v) for v in _values(holder) if isinstance(v, jax.Array))
    _say(
        f"{entry.api}: an argument of {describe(f)} is a {name}, which is not a pytree: "
        f"it is one leaf, not differentiated (its gradient is None), though it holds arrays "
        f"({what}). Make {name} a tg.Module, or register it as a pytree "
        "(jax.tree_util.register_dataclass for a dataclass), to differentiate its arrays; or "
        "pass them in a dict."
    )


def _warn_lost(entry: Entry, f: Any) -> None:
    """The function stored values computed from its traced arrays in the user's objects
    (a loss log it appends to, `self.last = loss`, a cache filled on first use). They
    cannot stay there as tracers, so they were taken out again and the function is traced
    on every call: a log that stays empty and a slow step, said once, with the fixes."""
    if not _first(f, "lost"):
        return
    instead = (
        "Return them from the function instead (`loss = step(x); losses.append(loss)`)"
        if entry.api == "tg.jit"
        else "Return them with the loss instead (`(loss, aux), grads = tg.withgradient("
        "lambda m: (loss_fn(m), aux_fn(m)), model)`)"
    )
    _say(
        f"{entry.api}: {describe(f)} stores values computed from its traced arrays in your "
        f"objects ({', '.join(entry.lost[:5])}). A traced value cannot stay there after the "
        "call, so each was taken out again (a new entry removed, an old value put back) and "
        f"the function is traced again on every call. {instead}, or put an array there "
        "before the first call: an array the function replaces is written back after "
        "every call."
    )


def _warn_changed(entry: Entry, f: Any) -> None:
    """The function changes, on each call, a value it can read (a counter it increments):
    uncompiled, each call reads the value the last one left, so no trace is reused
    (`_settle.Settle._changed`). Said once, with the fixes."""
    if not _first(f, "changed"):
        return
    what = ", ".join(entry.changed[:5])
    _say(
        f"{entry.api}: {describe(f)} changes values it can read while traced ({what}). "
        "Uncompiled, each call would read the value the call before left there (a counter "
        "a schedule reads, `self.step += 1`), so a compiled trace cannot be reused: the "
        "function is traced and compiled again on every call. To compile it once, keep "
        "such counters outside the function and pass the value in, or make the value a "
        "jax array (`self.step = self.step + 1` with `self.step = jnp.array(0)`): an array "
        "the function replaces is an output, written back after every call. A list it "
        "appends to (a log of Python values) is an output too: appended when traced."
    )


def _warn_drew(entry: Entry, f: Any) -> None:
    """The function drew from a Python random state, or took an item from a library
    iterator, while traced (`_draws`): compiled, that draw would repeat on every call
    (the same noise, the same dropout mask, the same batch)."""
    if not _first(f, "drew"):
        return
    randoms = [label for label, random in entry.drew if random]
    items = [label for label, random in entry.drew if not random]
    what = [f"draws from {' and '.join(randoms)}"] if randoms else []
    what += [f"takes items from {' and '.join(items)}"] if items else []
    fixes = []
    if randoms:
        fixes.append(
            "draw with jax.random from a key you pass in and split each step (`key, sub = "
            "jax.random.split(key)`), or draw outside the function and pass the values in"
        )
    if items:
        fixes.append(
            "take the items outside the function and pass them in (`x, y = next(batches)`, "
            "then `tg.gradient(lambda m: loss(m, x, y), model)`)"
        )
    drawn = "that draw" if not items else "that item" if not randoms else "what it drew"
    fresh = "take the next item" if not randoms else "draw afresh"
    _say(
        f"{entry.api}: {describe(f)} {' and '.join(what)} while traced. Compiled, {drawn} "
        "would be the same on every call, so the function is traced again on every call, "
        f"to {fresh} as it would uncompiled. To compile it once, {'; '.join(fixes)}."
    )


# A function reading its numpy arrays as values, traced this many times: they change.
_VALUED_TRACES = 4


def _warn_valued(entry: Entry, f: Any) -> None:
    """Numpy arrays read as values (`_engine.NUMPY_VALUES`) that keep changing: each
    change costs a trace. A batch the function captures as a numpy array, in a
    function that also needs a numpy mask, would be traced on every step."""
    if not _first(f, "valued"):
        return
    _say(
        f"{entry.api}: {describe(f)} needs the numpy arrays it captures as numpy values "
        f"({', '.join(entry.valued[:5])}), so they are compared on each call, and they "
        f"changed: it was traced {_VALUED_TRACES} times. Each change costs a trace. Pass "
        "an array that changes each step as a jax array (jnp.asarray(x)) or as an "
        "argument, and keep numpy for what stays fixed (a mask)."
    )


def _warn_wrote(entry: Entry, f: Any) -> None:
    """The function changed a numpy array it captures in place while traced (`buf[0] =
    1.0`, `order.sort()`): such arrays are read as values, so it is traced again on
    every call that finds one changed; said once, with how to compile it once."""
    if not _first(f, "wrote"):
        return
    which = f" (one of: {', '.join(entry.valued[:5])})" if entry.valued else ""
    _say(
        f"{entry.api}: {describe(f)} changes a numpy array it captures in place while "
        f"traced{which}. A jax tracer cannot stand in for it, so treegrad reads such arrays "
        "as values and the function is traced again on every call that finds one changed, "
        "as it would run uncompiled. To compile it once, keep that state in a jax array "
        "that the function returns, or change the array outside the function."
    )


def _holds_arrays(x: Any) -> bool:
    """Whether a plain object (a static leaf of the arguments) holds arrays directly."""
    if x is DYN or isinstance(x, (type, types.FunctionType, str, bytes, int, float, complex)):
        return False
    return any(isinstance(v, jax.Array) for v in _values(x))


def _values(x: Any) -> list[Any]:
    """A plain object's attribute values, read past any __getattribute__ of the user's
    (the object is only looked at here); a Mapping's values, a deque's or UserList's items
    (`UserDict(w=w)` as an argument: its arrays sit in `.data`, a silent None too)."""
    if isinstance(x, (collections.UserDict, collections.ChainMap, types.MappingProxyType)):
        return list(x.values())
    if isinstance(x, (collections.deque, collections.UserList)):
        return list(x)
    try:
        return list(object.__getattribute__(x, "__dict__").values())
    except AttributeError:  # no __dict__: a dataclass with slots, or a builtin value
        fields = getattr(type(x), "__dataclass_fields__", None) or {}
        return [_slot(x, name) for name in fields]


def _slot(x: Any, name: str) -> Any:
    try:
        return object.__getattribute__(x, name)
    except AttributeError:  # a field not set
        return None


def clear_cache() -> None:
    """Forget every compiled function and every memo (for tests and long sessions).

    Returns:
        None. The next call of each function traces and compiles it again.

    Examples:
        >>> import treegrad as tg
        >>> tg.clear_cache()
    """
    # In a turn of its own: a call in another thread between its lookup and its
    # `_LRU.move_to_end` would find its entry gone (a KeyError from treegrad's insides).
    with TURN:
        _CACHE.clear()
        _LRU.clear()
        _WARNED.clear()
        _RECENT.clear()
        _SHAPES.clear()
        _GROUPS.clear()
        K.clear()
        _optguard.clear()
        for memo in MEMOS:
            memo.clear()


def cache_size() -> int:
    return len(_LRU)
