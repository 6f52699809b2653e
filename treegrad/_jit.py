"""`tg.jit`: compile a function of models and arrays with the shared engine.

Arguments are flattened: array leaves are traced, every other leaf is static
and keys the cache. Callable arguments (a loss handed to a compiled step) are
guarded like the function itself, so the arrays they capture are inputs too;
so are plain objects of the user's (`self` of a compiled method, a trainer
holding a model and its state), read and written back as captured ones are.
What the function reads from its closure and globals is guarded as in
`tg.gradient`; arrays it rebinds there (an implicit-style `tg.update_` inside
the step) are outputs of the compiled call and are written back afterwards.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _cache as C
from . import _engine as E
from . import _kinds as K
from . import _programs as P
from ._reach import is_plain_object
from ._shard import by_prefix
from ._tree import describe_leaf, value_key

# A class or module passed as an argument (`cls` of a compiled classmethod) is guarded
# like a function: keyed by identity alone, a class attribute it reads could go stale.
_FUNCTION_TYPES = (
    types.FunctionType,
    types.MethodType,
    functools.partial,
    K.JITTED_TYPE,
    type,
    types.ModuleType,
)


def _int_tuple(value: Any, name: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in items
    ):
        raise TypeError(
            f"tg.jit: {name} must be an int or a tuple of ints (positions of arguments), got "
            f"{value!r}. E.g. tg.jit(step, {name}=(0, 1))."
        )
    return tuple(items)


def _str_tuple(value: Any, name: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (tuple, list)) or not all(isinstance(i, str) for i in items):
        raise TypeError(
            f"tg.jit: {name} must be a str or a tuple of str (names of keyword arguments), got "
            f"{value!r}. E.g. tg.jit(step, {name}=('model',))."
        )
    return tuple(items)


class _Unset:
    """The default of an option not given; compared by identity, so a copy (of a
    tg.jit function, or of a model holding one) must be this object again."""

    def __repr__(self) -> str:
        return "<unset>"

    def __copy__(self) -> _Unset:
        return UNSET

    def __deepcopy__(self, memo: dict[int, Any]) -> _Unset:
        return UNSET

    def __reduce__(self) -> str:
        return "UNSET"  # pickled by name: this module's UNSET


UNSET: Any = _Unset()


class Jitted:
    """A function compiled by `tg.jit`; call it like the original."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        static_argnums: Any = (),
        static_argnames: Any = (),
        donate_argnums: Any = (),
        donate_argnames: Any = (),
        in_shardings: Any = UNSET,
        out_shardings: Any = UNSET,
    ):
        # `@tg.jit` above `@staticmethod`: compile the function, and bind no instance.
        self._unbound = isinstance(fn, staticmethod)
        if isinstance(fn, (staticmethod, classmethod)):
            if isinstance(fn, classmethod):
                raise TypeError(
                    "tg.jit of a classmethod: put @classmethod above @tg.jit, so that the "
                    "class is bound first and passed to the compiled function."
                )
            fn = fn.__func__
        if not callable(fn):
            raise TypeError(f"tg.jit expects a function, got {type(fn).__name__} {fn!r:.60}.")
        self.__wrapped__ = fn
        self._signature = _signature(fn)
        self._static, self._static_names = _resolve(
            fn,
            self._signature,
            _int_tuple(static_argnums, "static_argnums"),
            _str_tuple(static_argnames, "static_argnames"),
            "static",
        )
        self._donate, self._donate_names = _resolve(
            fn,
            self._signature,
            _int_tuple(donate_argnums, "donate_argnums"),
            _str_tuple(donate_argnames, "donate_argnames"),
            "donate",
        )
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        self._plain = not (self._static or self._static_names)
        # The options key the cache with the function: two `tg.jit`s of one function
        # with other donation or shardings must not share a compiled program (one made
        # with `donate_argnums` would delete the arrays of the other's callers).
        self._key = _options_key(self._donate, self._donate_names, in_shardings, out_shardings)
        self._options = ((), self._key)
        functools.update_wrapper(self, fn)

    def _entry(self, call: E.Call) -> E.Entry:
        """The cache entry for a call without static arguments."""
        return self._new_entry(call, self._options, ())

    def _new_entry(self, call: E.Call, options: Any, static: Sequence[Any]) -> E.Entry:
        return E.Entry(
            P.CALL,
            "tg.jit",
            options,
            call,
            donate=self._donated if (self._donate or self._donate_names) else None,
            shardings=self._shardings if self._in_shardings is not UNSET else None,
            out_shardings=None if self._out_shardings is UNSET else self._out_shardings,
            statics=dict(static),
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            self._plain
            and not kwargs
            and (_NOT_FUNCTIONS.issuperset(map(type, args)) or not any(map(_is_function, args)))
        ):
            # No static or callable argument (a training step): the arguments as given.
            # (A deleted argument is named by `_cache.execute`.)
            _, (_, packed, _) = C.execute(
                P.CALL, "tg.jit", self._options, (self.__wrapped__,), (args, {}), make=self._entry
            )
            return packed.value()
        fn = self.__wrapped__
        # A negative position (a function of *args) counts from the end of this call's.
        static_at = _at(self._static, len(args))
        static: list[Any] = []
        roots: list[Any] = [fn]
        pos: list[Any] = []
        keys: list[Any] = []
        # A function or plain object is guarded like the compiled function even when
        # named static: keyed by its hash alone, a value it reads (a number in a dict,
        # a global) could change under an old trace. Other static values are keyed by
        # value, a Module by its static data too (by identity, an attribute edited in
        # place would reuse a trace made with the old one). A static pytree holding arrays
        # (a Module with weights) is guarded like a captured one, its arrays traced inputs
        # and its static data checked at each call (keyed by its identity, as it was, an
        # edit in place reused the old trace: a stale result).
        for i, a in enumerate(args):
            if _is_function(a) or (i in static_at and _holds_arrays(a)):
                if i in static_at:
                    _hashed(a, f"argument {i}")
                pos.append(P.RootArg(len(roots) - 1))
                roots.append(a)
            elif i in static_at:
                pos.append(P.RootArg(-1 - len(static)))
                key, a = _static_key(_hashed(a, f"argument {i}"))
                static.append((i, a))
                keys.append((i, key))
            else:
                pos.append(a)
        kw: dict[str, Any] = {}
        for k, a in kwargs.items():
            if _is_function(a) or (k in self._static_names and _holds_arrays(a)):
                if k in self._static_names:
                    _hashed(a, f"argument {k!r}")
                kw[k] = P.RootArg(len(roots) - 1)
                roots.append(a)
            elif k in self._static_names:
                kw[k] = P.RootArg(-1 - len(static))
                key, a = _static_key(_hashed(a, f"argument {k!r}"))
                static.append((k, a))
                keys.append((k, key))
            else:
                kw[k] = a
        options = (tuple(keys), self._key)

        def make(call: E.Call) -> E.Entry:
            return self._new_entry(call, options, static)

        _, (_, packed, _) = C.execute(
            P.CALL, "tg.jit", options, tuple(roots), (tuple(pos), kw), make=make
        )
        return packed.value()

    def _owners(self, entry: E.Entry) -> list[Any]:
        """For each argument array leaf: the top-level argument (index or name) it belongs to."""
        pos_def, kw_def = entry.a_def.children()
        owners: list[Any] = []
        for i, child in enumerate(pos_def.children()):
            owners.extend([i] * child.num_leaves)
        names = kw_def.node_data()[1]  # the dict's keys, in flattening order
        for name, child in zip(names, kw_def.children(), strict=True):
            owners.extend([name] * child.num_leaves)
        return [o for o, a in zip(owners, entry.is_array_leaf(), strict=True) if a]

    def _donated(self, entry: E.Entry) -> tuple[int, ...]:
        # A buffer is donated only if every place it is read from is a donated
        # argument: a tied weight is one buffer (jax refuses to donate one
        # buffer twice), and the closure's arrays are never donated.
        owners = self._owners(entry)
        donate = _at(self._donate, len(entry.a_def.children()[0].children()))
        donated: dict[int, bool] = {}
        slots = entry.a_slots or range(entry.n_args)
        links = entry.a_links
        for u, who in zip(slots, owners, strict=True):
            ok = (isinstance(who, int) and who in donate) or who in self._donate_names
            # An argument that is also a captured array is read from the closure too.
            donated[u] = donated.get(u, True) and ok and (links is None or links[u] < 0)
        return tuple(entry.n_cl + u for u, ok in donated.items() if ok)

    def _shardings(self, entry: E.Entry) -> tuple[Any, ...]:
        pos_def, _ = entry.a_def.children()
        static = _at(self._static, len(pos_def.children()))
        per_leaf = _prefix_leaves(self._in_shardings, entry, pos_def, tuple(static))
        out: list[Any] = [None] * (entry.n_cl + entry.n_args)
        slots = entry.a_slots or range(entry.n_args)
        for u, s in zip(slots, per_leaf, strict=False):
            if out[entry.n_cl + u] is None:
                out[entry.n_cl + u] = s
        return tuple(out)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Decorating a method: bind the instance as the first (traced) argument.
        return self if obj is None or self._unbound else functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"<tg.jit of {getattr(self.__wrapped__, '__qualname__', self.__wrapped__)!r}>"


_OWN_KEYS = itertools.count()


def _options_key(donate: Any, donate_names: Any, in_shardings: Any, out_shardings: Any) -> Any:
    """What of a `tg.jit`'s options keys its compiled programs (False: none given)."""
    if not (donate or donate_names) and in_shardings is UNSET and out_shardings is UNSET:
        return False
    parts: list[Any] = [donate, donate_names]
    for s in (in_shardings, out_shardings):
        # A pytree prefix of shardings, by structure (a Module's static data too) and
        # leaves; None is a place given no sharding, so it is part of the structure.
        leaves, treedef = jax.tree_util.tree_flatten(s)
        parts += [treedef, tuple(leaves)]
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        # Unhashable static data in a prefix: this tg.jit's own programs only.
        return ("own", next(_OWN_KEYS))
    return key


# The argument types seen that are not functions: checked for all arguments in C.
_NOT_FUNCTIONS: set[type] = set()
C.MEMOS.append(_NOT_FUNCTIONS)


def _holds_arrays(a: Any) -> bool:
    """Whether a static argument is a pytree holding arrays (a Module with weights): it is
    guarded and traced through like a captured one, its arrays inputs and its static data
    checked at each call, rather than keyed by its identity."""
    leaves, treedef = jax.tree_util.tree_flatten(a)
    if jax.tree_util.treedef_is_leaf(treedef):
        return False
    return any(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)


def _is_function(a: Any) -> bool:
    """Whether an argument is guarded and traced through like the function itself, not
    static data: a function, or a plain object of the user's (a trainer holding a model
    and its state, `self` of a compiled method), read and written back as a captured
    one is, so that its arrays are inputs and what the function assigns into it lands."""
    t = type(a)
    if t in _NOT_FUNCTIONS:
        return False
    if t in _ROOT_TYPES or issubclass(t, _FUNCTION_TYPES):
        return True
    if is_plain_object(a):
        _ROOT_TYPES.add(t)
        return True
    _NOT_FUNCTIONS.add(t)
    return False


_ROOT_TYPES: set[type] = set()  # plain objects' classes, as found by `is_plain_object`
C.MEMOS.append(_ROOT_TYPES)


def _resolve(
    fn: Any, sig: inspect.Signature | None, nums: tuple[int, ...], names: tuple[str, ...], what: str
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`{what}_argnums` and `{what}_argnames` checked against `fn`'s signature and
    completed from each other, as `jax.jit` does: an argument named static is
    static when passed by position too. A position or name that is no argument
    of `fn` (a typo, a negative index never matched) is refused: ignored, it
    would silently trace what the user meant to keep static, or keep a buffer."""
    if sig is None:  # a builtin or other callable without a signature: as given
        return nums, names
    params = list(sig.parameters.values())
    kind = inspect.Parameter
    positional = [
        p.name for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)
    ]
    by_name = [p.name for p in params if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)]
    var_pos = any(p.kind is kind.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is kind.VAR_KEYWORD for p in params)
    name = getattr(fn, "__qualname__", repr(fn))
    out: list[int] = []
    for i in nums:
        if i < 0 and var_pos:
            out.append(i)  # from the end of each call's arguments, as jax.jit counts it
            continue
        j = i + len(positional) if i < 0 else i
        if j < 0 or (j >= len(positional) and not var_pos):
            raise ValueError(
                f"tg.jit: {what}_argnums={i} names no argument: {name}{sig} takes "
                f"{len(positional)} positional argument(s). Count from 0."
            )
        out.append(j)
    for n in names:
        if n not in by_name and not var_kw:
            raise ValueError(
                f"tg.jit: {what}_argnames={n!r} names no argument of {name}{sig}; "
                f"its arguments by name are {by_name}."
            )
    out += [positional.index(n) for n in names if n in positional]
    more = [positional[j] for j in out if 0 <= j < len(positional) and positional[j] in by_name]
    return tuple(dict.fromkeys(out)), tuple(dict.fromkeys((*names, *more)))


def _at(nums: tuple[int, ...], n: int) -> Any:
    """Argument positions for a call with `n` positional arguments (negative: from the end)."""
    if all(i >= 0 for i in nums):
        return nums
    return {i if i >= 0 else i + n for i in nums}


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


# A tg.jit helper called by a function being traced is inlined, like a jax.jit one.
K.JITTED_TYPES.add(Jitted)


def _hashed(value: Any, what: str) -> Any:
    try:
        hash(value)
    except TypeError:
        if isinstance(value, (jax.Array, np.ndarray)):
            got = f"an array ({describe_leaf(value)})"
            fix = (
                "an array is traced, not static: leave it out of static_argnums and "
                "static_argnames (or pass a tuple of Python numbers)."
            )
        else:
            got = f"a {type(value).__name__}"
            fix = "pass a tuple instead of a list, or make it a traced argument."
        raise TypeError(
            f"tg.jit: static {what} must be hashable (it keys the compiled function), got "
            f"{got}; {fix}"
        ) from None
    return value


def _static_key(value: Any) -> tuple[Any, Any]:
    """A static argument's cache key, and the value the function is traced with.

    A pytree (a Module) is keyed by its structure, static data included, and its
    leaves, and traced with a copy rebuilt from them: a later trace of the same
    program (new shapes) must see the value it was keyed by, even if the caller's
    object was edited since. Anything else is keyed as `value_key` and passed as is.
    """
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if jax.tree_util.treedef_is_leaf(treedef) and leaves:  # not a pytree node
        return value_key(value), value
    key = ("tree", treedef, tuple(map(value_key, leaves)))
    try:
        hash(key)
    except TypeError:  # an array among the leaves: the value itself
        return value_key(value), value
    return key, jax.tree_util.tree_unflatten(treedef, leaves)


def _prefix_leaves(
    prefix: Any, entry: E.Entry, pos_def: Any, static_nums: tuple[int, ...]
) -> list[Any]:
    """One sharding per array leaf of the positional arguments, from a pytree prefix."""
    # The arguments' structure with each leaf replaced by whether it is an array.
    is_array = entry.is_array_leaf()[: pos_def.num_leaves]
    args = jax.tree_util.tree_unflatten(pos_def, is_array)
    if not isinstance(prefix, (tuple, list)):
        prefix = (prefix,) * len(args)
    static = [i for i in static_nums if i < len(args)]
    if len(prefix) == len(args) - len(static) != len(args):
        # As for jax.jit: one entry per positional argument that is not static.
        given = iter(prefix)
        prefix = [None if i in static else next(given) for i in range(len(args))]
    if len(prefix) != len(args):
        n_kw = len(entry.a_def.children()[1].children())
        raise ValueError(
            f"tg.jit: in_shardings has {len(prefix)} entries for {len(args)} positional "
            "arguments"
            + (f" ({len(static)} of them static)" if static else "")
            + (
                f", and {n_kw} passed by keyword (which in_shardings does not cover)"
                if n_kw
                else ""
            )
            + "; give one (a sharding or a pytree prefix of shardings) per positional "
            "argument that is not static, as for jax.jit."
        )
    leaves: list[Any] = []
    for p, flags in zip(prefix, args, strict=True):
        # `flags` is the argument's structure holding, at each leaf, whether it is an array.
        per_leaf = by_prefix(p, flags, "tg.jit: in_shardings")
        leaves.extend(
            s for s, flag in zip(per_leaf, jax.tree_util.tree_leaves(flags), strict=True) if flag
        )
    return leaves


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    in_shardings: Any = UNSET,
    out_shardings: Any = UNSET,
) -> Any:
    """Compile a function of models, arrays and other data with XLA.

    Array leaves of the arguments (and of everything the function reads from
    closures and globals) are traced; everything else is static and part of
    the cache key. A function or a plain object of yours passed as an
    argument (`self` of a compiled method, a trainer holding a model) is read
    as a captured one is: its arrays are traced, what the function reads from
    it is checked on every call, and arrays it assigns into it are written
    back. A training step written with `tg.withgradient` and
    `tg.update` inside `tg.jit` compiles to one XLA computation; so does an
    implicit-style step (`tg.gradient(lambda: ..., ps)` and `tg.update_`):
    the arrays it rebinds in the model and the optimiser state are written
    back after the call, as an uncompiled run would leave them.

    Arguments:
        fn: the function to compile.
        static_argnums: positions of arguments treated as static (keys of the
            compiled function), as in `jax.jit`; a Module is keyed by what it
            holds, and a function, class or module is read fresh at each call.
        static_argnames: names of keyword arguments treated as static.
        donate_argnums: positions of arguments whose buffers XLA may reuse for
            the outputs (the old model and optimiser state of a training
            step). Donated arrays are deleted: only donate what you will not
            read again. Tied weights are de-duplicated first, and a buffer also
            read from another argument or the closure is not donated.
        donate_argnames: names of keyword arguments to donate.
        in_shardings: shardings of the positional arguments that are not
            static, one pytree prefix per argument (or one for all), as in
            `jax.jit`.
        out_shardings: shardings of the output, as a pytree prefix of it.

    Returns:
        A callable with the same signature.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> @tg.jit
        ... def f(x, n):
        ...     return x * n
        >>> f(jnp.ones(2), 3)
        Array([3., 3.], dtype=float32)
    """
    options = dict(
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
    )
    if fn is None:
        return functools.partial(jit, **options)
    return Jitted(fn, **options)
