"""Every use of jaxpr internals in treegrad, in one place.

The engine stages the user's function once with `jax.make_jaxpr` (public) and
reads two things off the result that no public API gives:

- which inputs the output depends on, so an unused parameter gets `None` (a
  structural zero) instead of an array of zeros;
- which constants the trace closed over, so an array captured where the closure
  walk could not see (and so could go stale) is found and reported.

It then evaluates the staged jaxpr with `jax.extend.core.jaxpr_as_fun`, so the
user's Python runs once per trace. `tests/test_jaxpr.py` pins each of these
behaviours and fails loudly if a JAX upgrade changes them. They hold on jax 0.10
to 0.12: from 0.11 on, `ClosedJaxpr` is an alias of `Jaxpr` that keeps the old
attributes (`.jaxpr`, `.consts`; marked for removal), so one code path serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.extend import core as jex

ClosedJaxpr = jex.ClosedJaxpr


def stage(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, Any]:
    """Trace `fn(*args)` once; return `(closed_jaxpr, output shape tree)`."""
    return jax.make_jaxpr(fn, return_shape=True)(*args)


def as_function(closed: Any) -> Callable[..., list[Any]]:
    """A callable evaluating a closed jaxpr on flat inputs, returning flat outputs."""
    return jex.jaxpr_as_fun(closed)


def _closed_subjaxprs(params: dict[str, Any]) -> Iterator[Any]:
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, (jex.ClosedJaxpr, jex.Jaxpr)):
                yield item


def constants(closed: Any) -> list[Any]:
    """All constants a closed jaxpr holds, including those of inner jaxprs.

    A constant captured inside an inner `jax.jit` sits in that equation's own
    closed jaxpr, not at the top level, hence the recursion.
    """
    out: list[Any] = []
    seen: set[int] = set()

    def visit(j: Any) -> None:
        if id(j) in seen:
            return
        seen.add(id(j))
        if isinstance(j, jex.ClosedJaxpr):
            out.extend(j.consts)
            j = j.jaxpr
        for eqn in j.eqns:
            for v in eqn.invars:
                if isinstance(v, jex.Literal) and isinstance(v.val, jax.Array):
                    out.append(v.val)
            for sub in _closed_subjaxprs(eqn.params):
                visit(sub)

    visit(closed)
    return out


def dependencies(closed: Any, outputs: Sequence[int]) -> set[int]:
    """Indices of the jaxpr's inputs that the given outputs depend on.

    Calls to inner jitted functions are followed precisely; other higher-order
    primitives (scan, cond, custom_jvp, ...) count every input as used, which
    can only turn a `None` into a zero gradient, never the reverse.
    """
    jaxpr = closed.jaxpr if isinstance(closed, jex.ClosedJaxpr) else closed
    outvars = [jaxpr.outvars[i] for i in outputs]
    live = _live_inputs(jaxpr, outvars)
    return {i for i, v in enumerate(jaxpr.invars) if v in live}


def _live_inputs(jaxpr: Any, outvars: Sequence[Any]) -> set[Any]:
    live: set[Any] = {v for v in outvars if isinstance(v, jex.Var)}
    for eqn in reversed(jaxpr.eqns):
        used_outs = [i for i, v in enumerate(eqn.outvars) if v in live]
        if not used_outs:
            continue
        sub = eqn.params.get("jaxpr")
        if eqn.primitive.name in ("pjit", "jit") and isinstance(sub, jex.ClosedJaxpr):
            inner = sub.jaxpr
            inner_live = _live_inputs(inner, [inner.outvars[i] for i in used_outs])
            for v, inner_v in zip(eqn.invars, inner.invars, strict=True):
                if inner_v in inner_live and isinstance(v, jex.Var):
                    live.add(v)
        else:
            live.update(v for v in eqn.invars if isinstance(v, jex.Var))
    return live
