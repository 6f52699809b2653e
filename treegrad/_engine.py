"""The trace engine shared by explicit mode, implicit mode and `tg.jit`.

One call goes through four steps:

1. `flatten_call`: the function is turned into a pytree of what it captures
   (`_capture`), and that pytree and the arguments are flattened once. Array
   leaves are the dynamic inputs; every other leaf is static and, with the
   treedefs, forms the cache key. A new lambda with the same code, the same
   static data and the same structure gives an equal key.
2. On a cache miss, `_Entry` builds a pure function of the flat dynamic inputs
   and wraps it in `jax.jit`; jax's own C++ cache then handles shapes and
   dtypes, so the Python key holds no per-leaf avals.
3. The first time `jax.jit` traces it, the user's function is staged once with
   `jax.make_jaxpr`; the jaxpr tells which inputs the output depends on (for
   `None` gradients) and whether any array was captured where the walk could
   not see it. Such a closure cannot be proven fresh: its entry is dropped after
   the call, so the next call re-traces, and a `RetraceWarning` names it once.
4. The staged jaxpr is differentiated (`jax.vjp`, `jax.jacrev`, `jax.hessian`)
   and the result returned as flat lists the front ends rebuild into trees.

Called with tracers (inside `jax.jit`, `jax.vmap`, `jax.grad`, `lax.scan`),
the same jitted function is simply traced into the outer computation.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jaxpr
from ._capture import capture, describe, materialize
from ._tree import describe_leaf, is_inexact

_ARRAY_TYPES = (jax.Array, np.ndarray)


class RetraceWarning(UserWarning):
    """Warned once per function that captures arrays treegrad cannot track.

    Such a function is re-traced on every call, so its result is never stale.

    Examples:
        >>> import warnings, jax.numpy as jnp, treegrad as tg
        >>> class Hidden:
        ...     __slots__ = ("w",)
        >>> h = Hidden(); h.w = jnp.ones(2)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     g = tg.gradient(lambda v: jnp.sum(v * h.w), jnp.ones(2))
        >>> caught[0].category is tg.RetraceWarning
        True
    """


class _Dyn:
    """Marks the position of a dynamic (array) leaf in the static key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<array>"


DYN = _Dyn()

# Programs: what to do with the staged function.
GRAD = "grad"  # value and gradient of a scalar output
PULLBACK = "pullback"  # value and a vector-Jacobian product closure
JACOBIAN = "jacobian"
HESSIAN = "hessian"
CALL = "call"  # plain compiled call (tg.jit)


class Flat:
    """A callable and its arguments, flattened once."""

    __slots__ = ("a_def", "cl_def", "dyn", "key", "n_cl", "statics")

    def __init__(self, f: Any, args: tuple[Any, ...]):
        cl_leaves, self.cl_def = jax.tree_util.tree_flatten(capture(f))
        # Functions passed as arguments (a loss handed to a compiled step) are
        # captured like the function itself, so their arrays are inputs too.
        a_leaves, self.a_def = jax.tree_util.tree_flatten(tuple(map(capture, args)))
        self.n_cl = len(cl_leaves)
        leaves = cl_leaves + a_leaves if a_leaves else cl_leaves
        is_array = _IS_ARRAY
        try:
            mask = [is_array[type(leaf)] for leaf in leaves]
        except KeyError:
            mask = [_is_array_type(leaf) for leaf in leaves]
        self.dyn = [leaf for leaf, m in zip(leaves, mask, strict=True) if m]
        self.statics = tuple([DYN if m else leaf for leaf, m in zip(leaves, mask, strict=True)])
        try:
            hash(self.statics)
            key: Any = self.statics
        except TypeError:
            # Unhashable static leaves are keyed by identity.
            key = tuple(s if _hashable(s) else ("<id>", id(s)) for s in self.statics)
        self.key = (self.cl_def, self.a_def, key)

    def n_closure_dyn(self) -> int:
        return sum(1 for s in self.statics[: self.n_cl] if s is DYN)


# Whether a leaf type is an array (a dynamic input), memoised per type: the
# isinstance check against jax.Array goes through an ABC hook costing ~0.3us.
_IS_ARRAY: dict[type, bool] = {}


def _is_array_type(leaf: Any) -> bool:
    t = type(leaf)
    r = _IS_ARRAY.get(t)
    if r is None:
        r = _IS_ARRAY[t] = isinstance(leaf, _ARRAY_TYPES)
    return r


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


class _Aux:
    """Non-array parts of an output, carried through `jax.jit` as static data."""

    __slots__ = ("statics", "treedef")

    def __init__(self, treedef: Any, statics: tuple[Any, ...]):
        self.treedef = treedef
        self.statics = statics

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        it = iter(arrays)
        return jax.tree_util.tree_unflatten(
            self.treedef, [next(it) if s is DYN else s for s in self.statics]
        )


jax.tree_util.register_pytree_node(_Aux, lambda a: ((), a), lambda a, _: a)


class Packed:
    """A traced function's output as returned by `jax.jit`.

    When every leaf of the output is an array, the output tree itself is the
    payload (jax rebuilds it in C++); otherwise the arrays travel flat and the
    static leaves ride in `aux`.
    """

    __slots__ = ("aux", "payload")

    def __init__(self, payload: Any, aux: _Aux | None):
        self.payload = payload
        self.aux = aux

    def value(self) -> Any:
        return self.payload if self.aux is None else self.aux.rebuild(self.payload)


jax.tree_util.register_pytree_node(
    Packed, lambda p: ((p.payload,), p.aux), lambda a, c: Packed(c[0], a)
)


def pack(aux: _Aux, arrays: Sequence[Any]) -> Packed:
    if all(s is DYN for s in aux.statics):
        return Packed(aux.rebuild(arrays), None)
    return Packed(list(arrays), aux)


def split_output(out: Any) -> tuple[list[Any], _Aux]:
    leaves, treedef = jax.tree_util.tree_flatten(out)
    arrays = []
    statics = []
    for leaf in leaves:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            arrays.append(leaf)
            statics.append(DYN)
        else:
            statics.append(leaf)
    return arrays, _Aux(treedef, tuple(statics))


def scalar_loss(value: Any, api: str) -> Any:
    """Check that `value` is a real scalar and return it as an array."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return jnp.asarray(value, dtype=float)
    if not isinstance(value, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            f"{api}: the function must return a real scalar, but it returned a "
            f"{type(value).__name__}. Return a scalar loss (reduce with jnp.sum or jnp.mean); "
            "for the derivatives of a vector output use tg.jacobian."
        )
    if value.shape != ():
        raise TypeError(
            f"{api}: the function must return a real scalar, but it returned an array of "
            f"shape {value.shape}. Reduce it to a scalar (jnp.sum, jnp.mean), or use "
            "tg.jacobian for the derivatives of a vector output."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"{api}: the function must return a real floating-point scalar, but it returned "
            f"dtype {value.dtype}. Cast the loss to a float (or use tg.jacobian for a complex "
            "output)."
        )
    return value


class _State:
    """What the trace found out; read after the call."""

    __slots__ = ("hidden", "transient")

    def __init__(self) -> None:
        self.hidden: list[Any] = []
        self.transient = False


def _check_constants(
    closed: Any, before: set[int], state: _State, guard: Callable[[list[Any]], None] | None
) -> None:
    hidden = []
    for c in _jaxpr.constants(closed):
        if isinstance(c, jax.core.Tracer):
            state.transient = True
        elif isinstance(c, jax.Array) and id(c) in before:
            hidden.append(c)
    if hidden:
        if guard is not None:
            guard(hidden)
        state.hidden = hidden


class Entry:
    """One compiled program for one cache key."""

    __slots__ = (
        "api",
        "donate",
        "explicit",
        "flat",
        "jitted",
        "options",
        "program",
        "slots",
        "state",
        "wrt",
    )

    def __init__(
        self,
        program: str,
        flat: Flat,
        wrt: tuple[int, ...],
        *,
        api: str,
        slots: tuple[int, ...] | None = None,
        options: tuple[Any, ...] = (),
        guard: Callable[[list[Any]], None] | None = None,
        donate: tuple[int, ...] = (),
    ):
        self.program = program
        self.flat = flat
        self.wrt = wrt
        self.api = api
        self.slots = slots
        self.options = options
        # Explicit mode: results come back as trees shaped like the arguments,
        # built while tracing so that jax rebuilds them in C++ on each call.
        self.explicit = slots is None and program != CALL
        self.state = _State()
        cl_def, a_def, statics, n_cl = flat.cl_def, flat.a_def, flat.statics, flat.n_cl
        state = self.state

        def user(*dyn: Any) -> Any:
            if slots is not None:
                dyn = tuple(dyn[s] for s in slots)
            it = iter(dyn)
            leaves = [next(it) if s is DYN else s for s in statics]
            fn = materialize(jax.tree_util.tree_unflatten(cl_def, leaves[:n_cl]))
            args = tuple(map(materialize, jax.tree_util.tree_unflatten(a_def, leaves[n_cl:])))
            if program == CALL:
                names = options[0]
                n = len(args) - len(names)
                out = fn(*args[:n], **dict(zip(names, args[n:], strict=True)))
            else:
                out = fn(*args)
            if program in (GRAD, HESSIAN):
                loss = out[0] if options and options[0] and isinstance(out, tuple) else out
                loss = scalar_loss(loss, api)
                arrays, aux = split_output(out)
                return [loss, *arrays], aux
            if program == JACOBIAN and not isinstance(out, (jax.Array, np.ndarray)):
                raise TypeError(
                    f"{api}: the function must return one array, got {type(out).__name__}"
                )
            arrays, aux = split_output(out)
            return arrays, aux

        def pure(dyn: list[Any]) -> Any:
            before = {id(a) for a in jax.live_arrays()}
            try:
                closed, (_, aux) = _jaxpr.stage(user, dyn)
            except TypeError as e:
                if "valid JAX type" in str(e):
                    raise TypeError(
                        f"{api}: the function returned something that is not an array or a "
                        f"pytree of arrays ({e})"
                    ) from None
                raise
            _check_constants(closed, before, state, guard)
            run = _jaxpr.as_function(closed)
            return _PROGRAMS[program](self, closed, run, aux, dyn)

        if donate:
            # Positional inputs, so that jax can donate the buffers of some of them.
            self.jitted = jax.jit(lambda *d: pure(list(d)), donate_argnums=donate)
        else:
            self.jitted = jax.jit(pure)
        self.donate = donate

    def arg_trees(self, values: Sequence[Any]) -> Any:
        """One value per dynamic argument leaf, placed in the arguments' structure."""
        flat = self.flat
        it = iter(values)
        leaves = [next(it) if s is DYN else None for s in flat.statics[flat.n_cl :]]
        return jax.tree_util.tree_unflatten(flat.a_def, leaves)

    @property
    def cacheable(self) -> bool:
        return not self.state.hidden and not self.state.transient


def _active(
    entry: Entry, closed: Any, dyn: list[Any], wrt: Sequence[int], outputs: Any
) -> list[int]:
    """The positions in `wrt` to differentiate: floating inputs the outputs depend on."""
    deps = _jaxpr.dependencies(closed, outputs)
    return [i for i in wrt if i in deps and is_inexact(dyn[i].dtype)]


def _of_active(run: Any, dyn: list[Any], active: list[int]) -> Callable[..., list[Any]]:
    """`run` as a function of the active inputs only, the others held at their values."""

    def fn(*xs: Any) -> list[Any]:
        full = list(dyn)
        for i, x in zip(active, xs, strict=True):
            full[i] = x
        return run(*full)

    return fn


def _grad_program(entry: Entry, closed: Any, run: Any, aux: _Aux, dyn: list[Any]) -> Any:
    active = _active(entry, closed, dyn, entry.wrt, [0])
    if active:
        fn = _of_active(run, dyn, active)

        def loss_and_outputs(*xs: Any) -> tuple[Any, list[Any]]:
            outs = fn(*xs)
            return outs[0], outs

        _, vjp, outs = jax.vjp(loss_and_outputs, *[dyn[i] for i in active], has_aux=True)
        by_pos = dict(zip(active, vjp(jnp.ones((), outs[0].dtype)), strict=True))
    else:
        outs = run(*dyn)
        by_pos = {}
    grads = tuple(by_pos.get(i) for i in entry.wrt)
    return pack(aux, outs[1:]), entry.arg_trees(grads) if entry.explicit else grads


def _expand(positions: tuple[int | None, ...], vjp: Any, dy: Any) -> tuple[Any, ...]:
    grads = vjp(dy)
    return tuple(None if p is None else grads[p] for p in positions)


def _pullback_program(entry: Entry, closed: Any, run: Any, aux: _Aux, dyn: list[Any]) -> Any:
    active = _active(entry, closed, dyn, entry.wrt, range(len(closed.jaxpr.outvars)))
    fn = _of_active(run, dyn, active)
    out, vjp = jax.vjp(lambda *xs: aux.rebuild(fn(*xs)), *[dyn[i] for i in active])
    index = {p: k for k, p in enumerate(active)}
    positions = tuple(index.get(i) for i in entry.wrt)
    return out, jax.tree_util.Partial(functools.partial(_expand, positions), vjp)


def _jacobian_program(entry: Entry, closed: Any, run: Any, aux: _Aux, dyn: list[Any]) -> Any:
    active = _active(entry, closed, dyn, entry.wrt, [0])
    fn = _of_active(run, dyn, active)
    jacs = (
        jax.jacrev(lambda *xs: fn(*xs)[0], argnums=tuple(range(len(active))))(
            *[dyn[i] for i in active]
        )
        if active
        else ()
    )
    by_pos = dict(zip(active, jacs, strict=True))
    result = tuple(by_pos.get(i) for i in entry.wrt)
    return entry.arg_trees(result) if entry.explicit else result


def _hessian_program(entry: Entry, closed: Any, run: Any, aux: _Aux, dyn: list[Any]) -> Any:
    # options[1]: the groups of wrt positions (one group per argument); the
    # Hessian of each argument with respect to itself.
    groups: tuple[tuple[int, ...], ...] = entry.options[1]
    result = []
    for group in groups:
        active = _active(entry, closed, dyn, group, [0])
        fn = _of_active(run, dyn, active)
        h = (
            jax.hessian(lambda *xs, fn=fn: fn(*xs)[0], argnums=tuple(range(len(active))))(
                *[dyn[i] for i in active]
            )
            if active
            else ()
        )
        index = {p: k for k, p in enumerate(active)}
        result.append(
            tuple(
                tuple(
                    None if i not in index or j not in index else h[index[i]][index[j]]
                    for j in group
                )
                for i in group
            )
        )
    return tuple(result)


def _call_program(entry: Entry, closed: Any, run: Any, aux: _Aux, dyn: list[Any]) -> Any:
    return pack(aux, run(*dyn))


_PROGRAMS: dict[str, Callable[..., Any]] = {
    GRAD: _grad_program,
    PULLBACK: _pullback_program,
    JACOBIAN: _jacobian_program,
    HESSIAN: _hessian_program,
    CALL: _call_program,
}

_CACHE: dict[Any, Entry] = {}
_WARNED: set[Any] = set()
# Each entry holds a compiled program; a loop that changes a static value
# every step (a Python float captured by the loss) would otherwise grow the
# cache without end. Oldest-first eviction keeps the hit path a plain dict get.
MAX_ENTRIES = 2048


def lookup(key: Any) -> Entry | None:
    return _CACHE.get(key)


def store(key: Any, entry: Entry) -> None:
    if len(_CACHE) >= MAX_ENTRIES:
        del _CACHE[next(iter(_CACHE))]
    _CACHE[key] = entry


def execute(key: Any, entry: Entry, dyn: Sequence[Any], f: Any) -> Any:
    """Run an entry; drop it from the cache if its trace proved it uncacheable."""
    out = entry.jitted(*dyn) if entry.donate else entry.jitted(dyn)
    if not entry.cacheable:
        _CACHE.pop(key, None)
        if entry.state.hidden:
            code = getattr(f, "__code__", None) or type(f)
            if code not in _WARNED:
                _WARNED.add(code)
                what = ", ".join(describe_leaf(h) for h in entry.state.hidden[:5])
                warnings.warn(
                    f"treegrad cannot cache {describe(f)}: it captures {len(entry.state.hidden)} "
                    f"array(s) ({what}) through objects it cannot see into, so it is re-traced "
                    "on every call to stay correct. Pass these arrays as arguments, or hold "
                    "them in a tg.Module, list, dict or a closure variable.",
                    RetraceWarning,
                    stacklevel=4,
                )
    return out


def clear_cache() -> None:
    """Forget every compiled function (for tests and long-running sessions).

    Returns:
        None. The next call of each function traces and compiles it again.

    Examples:
        >>> import treegrad as tg
        >>> tg.clear_cache()
    """
    _CACHE.clear()
    _WARNED.clear()


def cache_size() -> int:
    return len(_CACHE)
