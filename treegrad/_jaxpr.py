"""Every use of jaxpr internals in treegrad, in one place.

When the engine compiles a function it traces it once with `jax.jit(...).trace`
(public) and reads two things off the traced jaxpr that no public API gives:

- which inputs the outputs depend on, so an unused parameter gets `None` (a
  structural zero) instead of an array of zeros;
- which constants the trace closed over, so an array captured where the guard
  walk could not see it (and so could go stale) is found and reported.

It also empties jax's memo of traced function bodies (`forget_bodies`), which
no public API reaches without dropping every compiled program, and makes a
loaded array weakly typed again (`weakly_typed`), which no public API does.

`tests/test_jaxpr.py` pins each of these behaviours and fails loudly if a JAX
upgrade changes them. They hold on jax 0.10 to 0.12: from 0.11 on,
`ClosedJaxpr` is an alias of `Jaxpr` that keeps the old attributes (`.jaxpr`,
`.consts`; marked for removal), so one code path serves both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex

_JAXPR_TYPES = tuple({jex.ClosedJaxpr, jex.Jaxpr})


def _body_memos() -> list[Any]:
    """jax's memos of traced bodies: a `lax.cond` branch, a `scan`, `while_loop` or
    `fori_loop` body (`trace_to_jaxpr`), a `jax.checkpoint`-ed function. Each is
    keyed on the function object and the input types only, with the arrays the body
    read from elsewhere (a global model, a closure) kept as its constants."""
    from jax._src import ad_checkpoint
    from jax._src.interpreters import partial_eval

    return [partial_eval.trace_to_jaxpr, ad_checkpoint._trace_to_jaxpr]


_BODY_MEMOS = _body_memos()


def weakly_typed(x: jax.Array) -> jax.Array:
    """`x` weakly typed, as `jnp.asarray(0.5)` is, with its values and sharding (an
    elementwise conversion to its own dtype): a checkpoint restores the weak type it
    saved (`_manifest.from_storage`), so the loaded model computes in the same dtypes."""
    from jax._src.lax.lax import _convert_element_type

    return _convert_element_type(x, weak_type=True)


def forget_bodies() -> None:
    """Empty jax's memos of traced bodies, before and after the engine runs a user's
    function on tracers put in the user's own places.

    Before: a body a plain call traced holds the arrays it read then as constants,
    so reusing it would give the old values (and hide a parameter from the
    gradient). After: a body traced now holds the engine's tracers, and the next
    plain call of the user's function would reuse them (`UnexpectedTracerError`).
    Compiled programs are kept (unlike `jax.clear_caches`): only traced bodies go.
    """
    for memo in _BODY_MEMOS:
        memo.cache_clear()


def is_tracer(x: Any) -> bool:
    """Whether `x` is a value being traced (inside jit, grad, vmap...). By its type: an
    object whose `__getattribute__` answers every name its own way may raise for the
    `__class__` that isinstance reads."""
    return issubclass(type(x), jax.core.Tracer)


def _inner(closed: Any) -> Any:
    """The open jaxpr of a closed one (the same object from jax 0.11 on)."""
    return getattr(closed, "jaxpr", closed)


def n_inputs(closed: Any) -> int:
    """How many inputs a traced jaxpr takes: more than the function was given when jax
    made inputs of traced values the function read from elsewhere."""
    return len(_inner(closed).invars)


def as_function(closed: Any) -> tuple[Callable[..., list[Any]], list[Any]]:
    """A traced function as `(run, consts)`: `run(consts, *args)` evaluates it with its
    constants given, so they can be a compiled program's outputs (a backward pass's
    residuals, and what its rules read) and the function run by another program."""
    return functools.partial(_evaluate, _inner(closed)), _consts(closed)


def _evaluate(jaxpr: Any, consts: list[Any], *args: Any) -> list[Any]:
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


def _consts(closed: Any) -> list[Any]:
    return list(getattr(closed, "consts", ()))


def _closed_subjaxprs(params: dict[str, Any]) -> Iterator[Any]:
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, _JAXPR_TYPES):
                yield item


def constants(closed: Any) -> list[Any]:
    """All constants a traced jaxpr holds, including those of inner jaxprs.

    A constant captured inside an inner `jax.jit` sits in that equation's own
    closed jaxpr, not at the top level, hence the recursion.
    """
    out: list[Any] = []
    seen: set[int] = set()

    def visit(j: Any) -> None:
        if id(j) in seen:
            return
        seen.add(id(j))
        out.extend(_consts(j))
        jaxpr = _inner(j)
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, jex.Literal) and isinstance(v.val, jax.Array):
                    out.append(v.val)
            for sub in _closed_subjaxprs(eqn.params):
                visit(sub)

    visit(closed)
    return out


def dependencies(closed: Any, outputs: Sequence[int] | None) -> set[int]:
    """Indices of the jaxpr's inputs that the given outputs (None: all) depend on.

    Calls to inner jitted functions are followed precisely; other higher-order
    primitives (scan, cond, custom_jvp, ...) count every input as used, which
    can only turn a `None` into a zero gradient, never the reverse.
    """
    jaxpr = _inner(closed)
    outvars = jaxpr.outvars if outputs is None else [jaxpr.outvars[i] for i in outputs]
    live = _live_inputs(jaxpr, outvars)
    return {i for i, v in enumerate(jaxpr.invars) if v in live}


def _live_inputs(jaxpr: Any, outvars: Sequence[Any]) -> set[Any]:
    live: set[Any] = {v for v in outvars if isinstance(v, jex.Var)}
    for eqn in reversed(jaxpr.eqns):
        used_outs = [i for i, v in enumerate(eqn.outvars) if v in live]
        if not used_outs:
            continue
        sub = eqn.params.get("jaxpr")
        if eqn.primitive.name in ("pjit", "jit") and isinstance(sub, _JAXPR_TYPES):
            inner = _inner(sub)
            inner_live = _live_inputs(inner, [inner.outvars[i] for i in used_outs])
            for v, inner_v in zip(eqn.invars, inner.invars, strict=True):
                if inner_v in inner_live and isinstance(v, jex.Var):
                    live.add(v)
        else:
            live.update(v for v in eqn.invars if isinstance(v, jex.Var))
    return live


def reached(closed: Any, sources: Iterable[int]) -> set[int]:
    """Indices of the outputs that depend on the inputs `sources` (a forward pass), or
    that may be non-zero without them.

    The engine feeds the cotangent of a gradient as an input (or, for a backward
    pass traced alone, its inputs are the cotangents): a gradient that
    does not depend on it and is zero by construction (jax's zeros for an
    unused input: a literal 0 broadcast, cast or conjugated) is a structural
    zero. One that does not depend on it but may be non-zero is a real
    gradient: a custom rule (`jax.custom_vjp`) may return a constant, or a
    value of the residuals alone, as a straight-through estimator does.
    Calls to inner jitted functions are followed precisely; other higher-order
    primitives count every output as reached when any input is, which can only
    turn a `None` into a zero gradient, never the reverse.
    """
    jaxpr = _inner(closed)
    tainted = _reach(jaxpr, {jaxpr.invars[i] for i in sources})
    zeros = _zeros(jaxpr, set())
    return {
        i
        for i, v in enumerate(jaxpr.outvars)
        if (_is_var(v) and v in tainted) or not _is_zero(v, zeros)
    }


# Primitives whose output is zero when their first operand is (shape, dtype and
# layout changes, and the conjugate taken for complex gradients).
_KEEP_ZERO = frozenset(
    {
        "broadcast_in_dim",
        "convert_element_type",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "neg",
        "conj",
        "real",
        "imag",
        "copy",
        "copy_p",
        "reduce_sum",
        "reduce_precision",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "pvary",
        "pcast",
    }
)
# Primitives whose output is zero when all their operands are.
_ALL_ZERO = frozenset({"add", "add_any", "sub"})


def _is_zero(v: Any, zeros: set[Any]) -> bool:
    if isinstance(v, jex.Literal):
        try:
            return bool(np.all(np.asarray(v.val) == 0))
        except (TypeError, ValueError):  # pragma: no cover - a literal of another kind
            return False
    return _is_var(v) and v in zeros


def _zeros(jaxpr: Any, zeros: set[Any]) -> set[Any]:
    """The variables of `jaxpr` that are zero by construction, given those in `zeros`."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _KEEP_ZERO:
            if eqn.invars and _is_zero(eqn.invars[0], zeros):
                zeros.update(eqn.outvars)
        elif name in _ALL_ZERO:
            if all(_is_zero(v, zeros) for v in eqn.invars):
                zeros.update(eqn.outvars)
        elif name == "select_n":
            if all(_is_zero(v, zeros) for v in eqn.invars[1:]):
                zeros.update(eqn.outvars)
        elif name in ("pjit", "jit"):
            sub = eqn.params.get("jaxpr")
            if isinstance(sub, _JAXPR_TYPES):
                inner = _inner(sub)
                given = {
                    iv for v, iv in zip(eqn.invars, inner.invars, strict=True) if _is_zero(v, zeros)
                }
                inner_zeros = _zeros(inner, given)
                zeros.update(
                    o
                    for o, io in zip(eqn.outvars, inner.outvars, strict=True)
                    if _is_zero(io, inner_zeros)
                )
    return zeros


def _is_var(v: Any) -> bool:
    # Literals (constants written into the jaxpr) are unhashable and never depend on inputs.
    return isinstance(v, jex.Var) and not isinstance(v, jex.Literal)


def _reach(jaxpr: Any, tainted: set[Any]) -> set[Any]:
    for eqn in jaxpr.eqns:
        hit = [_is_var(v) and v in tainted for v in eqn.invars]
        if not any(hit):
            continue
        sub = eqn.params.get("jaxpr")
        if eqn.primitive.name in ("pjit", "jit") and isinstance(sub, _JAXPR_TYPES):
            inner = _inner(sub)
            inner_tainted = _reach(inner, {v for v, h in zip(inner.invars, hit, strict=True) if h})
            tainted.update(
                o
                for o, io in zip(eqn.outvars, inner.outvars, strict=True)
                if _is_var(io) and io in inner_tainted
            )
        else:
            tainted.update(eqn.outvars)
    return tainted
