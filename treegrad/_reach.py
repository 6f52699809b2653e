"""What a model's structure and an optimiser's rules hold, for the walk and the engine.

The walk (`_walk.py`) starts from the function; a compiled call also reaches the
user's code through its arguments' structure: a Module's static data (an
activation), an optimiser state's rules (a schedule, a mask function). These
helpers find those callables, the Python classes a structure names, the slot
names of a class and a label for a function in messages.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator, Sequence
from typing import Any

from ._kinds import has_instance_dict, holds_user_values, is_array, is_library, is_pytree_node


def describe(fn: Any) -> str:
    try:
        return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    except Exception:  # a label only (no result reads it); a user's __getattr__ or __repr__
        return f"<{type(fn).__qualname__} object>"  # may raise anything


_SLOT_NAMES: dict[type, tuple[str, ...]] = {}  # cleared with the other memos (_cache.MEMOS)


def slot_names(t: type) -> tuple[str, ...]:
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
        and not is_library(type(fn))
    )


def _of_user(fn: Any) -> bool:
    """Whether a bound method or partial runs the user's code (not only a library's)."""
    while isinstance(fn, (types.MethodType, functools.partial)):
        fn = fn.__func__ if isinstance(fn, types.MethodType) else fn.func
    if type(fn) is types.FunctionType:
        return not is_library(fn)
    return _user_callable(fn)


def is_plain_object(value: Any) -> bool:
    """An instance of a user's class (or a standard-library value holder) that is no
    pytree: jax would take it for one leaf; the walk reads it attribute by attribute."""
    t = type(value)
    return (
        not issubclass(t, (type, types.ModuleType))
        and (not is_library(t) or holds_user_values(t))
        and (has_instance_dict(value) or bool(slot_names(t)))
        and not is_array(value)
        and not is_pytree_node(value)
    )


def static_callables(treedef: Any) -> list[Any]:
    """The callables held as static data by the Modules of a tree's structure, and by
    the rules of an optimiser state in it."""
    from ._module import _Static
    from ._optstate import _Config

    out: list[Any] = []
    stack = [treedef]
    while stack:
        td = stack.pop()
        data = td.node_data()
        if data is not None and isinstance(data[1], _Static):
            out.extend(v for _, v in data[1].items if callable(v) and not isinstance(v, type))
        elif data is not None and isinstance(data[1], _Config):
            # An optimiser state: a schedule or mask function of the user's in its rules.
            out.extend(user_functions([part.rule for part in data[1].parts]))
        stack.extend(td.children())
    return out


# A rule is a tree of optax closures; a walk through more objects than this is
# not a rule's (an object graph reached by accident): stop there.
_MAX_VISITS = 10_000


def user_functions(rules: Sequence[Any]) -> list[Any]:
    """The functions (and callable objects) of the user's held by `rules`, through
    optax's closures and objects, tuples (a `GradientTransformation`), lists, dicts
    and partials."""
    found: list[Any] = []
    seen: set[int] = set()
    todo: list[Any] = list(rules)
    while todo and len(seen) < _MAX_VISITS:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if type(x) is types.FunctionType:
            if not is_library(x):
                found.append(x)  # walked by the guard, with what it reads
                continue
            for cell in x.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    todo.append(cell.cell_contents)
            todo.extend(x.__defaults__ or ())
        elif isinstance(x, (types.MethodType, functools.partial)) and _of_user(x):
            # Guarded whole: a bound method with the attributes of `self` it reads, a
            # partial with its arguments. The function alone reads them as parameters,
            # which no guard of the function sees: `optax.sgd(sched.rate)` after
            # `sched.lr = ...`, or `partial(f, cfg=cfg)` after `cfg["lr"] = ...`, was stale.
            found.append(x)
        elif isinstance(x, types.MethodType):
            # A library's bound method (`MultiSteps.gradient_transformation()` holds
            # `self.update`): what its object holds (the user's `every_k_schedule`).
            todo.append(x.__self__)
        elif isinstance(x, functools.partial):
            todo.append(x.func)
            todo.extend(x.args)
            todo.extend(x.keywords.values())
        elif isinstance(x, (tuple, list)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (type, types.ModuleType)) or x is None:
            continue
        elif not is_library(type(x)):
            if _user_callable(x):
                found.append(x)  # a callable object of the user's: guarded with its state
        else:
            # A library object (optax wraps a schedule in one): what it holds.
            todo.extend(getattr(x, "__dict__", {}).values())
    return found


def node_types(treedef: Any) -> Iterator[type]:
    stack = [treedef]
    while stack:
        td = stack.pop()
        data = td.node_data()
        if data is not None:
            yield data[0]
        stack.extend(td.children())
