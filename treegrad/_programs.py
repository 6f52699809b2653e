"""Tracing: the user's function run on its own objects, holding tracers, and
differentiated as each front end asks (gradient, pullback, Jacobian, Hessian,
plain call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _guard as G
from . import _jaxpr
from ._draws import Draws
from ._jaxpr import forget_bodies, is_tracer
from ._layout import constrain, tracing
from ._outputs import Packed, Written, conj, expand, pack, scalar_loss, split_output
from ._settle import CHANGES, Scrub, Settle
from ._shard import by_prefix
from ._swap import Swap, Unsettled
from ._tracecheck import ArgsKept, abstract_argument_error, check_out, traced_value_error

if TYPE_CHECKING:
    from ._engine import Entry

GRAD = "grad"  # value and gradient of a scalar output
PULLBACK = "pullback"  # value and a vector-Jacobian product closure
JACOBIAN = "jacobian"
HESSIAN = "hessian"
CALL = "call"  # plain compiled call (tg.jit)

_TRACE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


def trace(
    entry: Entry, dyn: list[Any], extra: tuple[Any, ...], placed: tuple[Any, ...] | None
) -> Any:
    """The traced program: the user's function run on its own objects, holding tracers.

    `placed` holds the mesh sharding of each input of the call (None when no
    input is on a mesh): gradients are constrained to it, and calls nested in
    this trace find it for these tracers.
    """
    roots = entry.stack[-1]
    swap = Swap(expand(dyn[: entry.n_cl], entry.cl_slots))
    outer, entry.placement = entry.placement, placed
    outer_rebound, entry.rebound = entry.rebound, []
    outer_swap, entry.swap = entry.swap, swap
    try:
        fns = [swap.put(node, root) for node, root in zip(entry.nodes, roots, strict=True)]
        for node in entry.absolute:
            swap.put(node, None)
        with tracing(dyn, placed):
            out = _PROGRAMS[entry.program](entry, fns, dyn, *extra)
    finally:
        swap.restore()
        if entry.overwritten is not None:
            entry.overwritten += swap.overwritten
        swap.detrace(entry.rebound)
        entry.rebound = outer_rebound
        entry.swap = outer_swap
        entry.placement = outer
    if swap.lost:
        entry.lost += [w for w in swap.lost if w not in entry.lost]
        entry.cacheable = False
    if swap.reverted:
        raise TypeError(
            f"{entry.api}: the function changed the structure of an optimiser state it "
            f"captures ({swap.reverted[0]}: a rule assigned to a sub-state, `state[...] = "
            "tg.setup(...)`), which a compiled call cannot write back; the state is left as "
            "it was. Assign the rule before calling the compiled function, once."
        )
    return out


def _user(
    entry: Entry, fns: list[Any], dyn: list[Any], active: Sequence[int], again: bool = False
) -> Any:
    """The user's function as a function of the `active` inputs (the rest held fixed).

    Returns `call(*xs) -> (output, written)`, where `written` maps the places
    the function rebound to their new values. `again`: the function has run in
    this trace before (the Hessian's second derivatives), so each call starts from
    the program's inputs in every place, not from what the last run rebound there
    (`c["s"] = c["s"] + 1` would count twice), and leaves the places as it found them.
    """

    def call(*xs: Any) -> tuple[Any, dict[int, Any]]:
        vals = list(dyn)
        for i, x in zip(active, xs, strict=True):
            vals[i] = x
        per_place = expand(vals[: entry.n_cl], entry.cl_slots)
        inner = None
        inner_rebound: list[Any] = []
        if again or (entry.implicit and active):
            if again:
                inner = Swap(per_place, fresh=entry.swap)
            else:
                # Parameters live in the closure: put the differentiated tracers in their places.
                chosen = set(active)
                slots = entry.cl_slots or range(entry.n_cl)
                inner = Swap(
                    [v if u in chosen else G.MISSING for u, v in zip(slots, per_place, strict=True)]
                )
            try:
                for node, fn in zip(entry.nodes, fns, strict=True):
                    inner.put(node, fn)
                for node in entry.absolute:
                    inner.put(node, None)
            except ValueError:
                if not again:
                    raise
                # The places no longer match the program's inputs one to one.
                inner.restore()
                raise TypeError(
                    f"{entry.api}: the function changes the structure of what it captures "
                    "(e.g. appends an array to a list it reads), and it runs more than once "
                    "while traced (the Hessian of several arguments, the Jacobian of a "
                    "complex output), each run starting from the same inputs. Keep that "
                    "structure fixed (assign arrays into it), or return the new values instead."
                ) from None
        try:
            args = entry.args(vals)
            draws = Draws(entry.consumed)
            # jax reuses a body (a scan's, a cond branch) it traced before by the
            # function's identity, with what it read then: not this run's tracers.
            forget_bodies()
            _MADE.append([])
            LINKED.append(_linked(entry, vals, args))
            try:
                if entry.program == CALL:
                    pos, kw = args
                    kept = ArgsKept(entry.api, args)
                    out = _call_with_roots(entry, fns, pos, kw)
                    kept.check(out)
                else:
                    out = fns[0](*args)
            except _TRACE_ERRORS as e:
                _scrub(entry, per_place)
                raise traced_value_error(entry, e) from e
            except BaseException as e:  # any, a KeyboardInterrupt too: cleaned up, re-raised
                _scrub(entry, per_place)
                abstract = abstract_argument_error(entry.api, args, e, entry.program == CALL)
                if abstract is None:
                    raise
                raise abstract from e
            finally:
                forget_bodies()  # bodies holding this run's tracers
                made = _MADE.pop()
                LINKED.pop()
            if made or entry.program != CALL:
                check_out(entry.api, out, made, entry.program in (GRAD, JACOBIAN, HESSIAN))
            drew = draws.changed()
            if drew:
                # Compiled, this trace's draw would be repeated on every call.
                entry.cacheable = False
                entry.drew += [d for d in drew if d not in entry.drew]
            written: dict[int, Any] = {}
            settle = Settle(per_place, written)
            try:
                roots = entry.stack[-1]
                try:
                    entry.nodes = [
                        settle.node(n, r) for n, r in zip(entry.nodes, roots, strict=True)
                    ]
                    entry.absolute = [settle.node(n, None) for n in entry.absolute]
                finally:
                    entry.rebound += settle.rebound  # (the outer swap's values)
                    if inner is not None:
                        inner_rebound.extend(settle.rebound)
            except Unsettled as e:
                if written:
                    # The function rebound arrays, and also changed where arrays live:
                    # the new ones cannot be written back by place. Never a silent loss.
                    # (An Unsettled raised bare has no words: `e or ...` printed "( was".)
                    what = str(e) or "a container was replaced by another kind of value"
                    raise TypeError(
                        f"{entry.api}: the function rebinds arrays it captures, and while "
                        f"traced it also changed where its arrays live ({what}), so the new "
                        "arrays cannot be written back. Keep the structure the function "
                        "reads fixed (assign arrays into it), or return the new values instead."
                    ) from None
                entry.cacheable = False
                written = {}
            if not settle.cacheable:
                entry.cacheable = False
            entry.lost += [w for w in settle.lost if w not in entry.lost]
            entry.drew += [(t, False) for t in settle.took if (t, False) not in entry.drew]
            entry.wrote = entry.wrote or settle.wrote
            entry.changed += [w for w in settle.changed if w not in entry.changed]
            settle.undo_changes()
            entry.demoted = entry.demoted or settle.demoted
            return out, written
        finally:
            if inner is not None:
                inner.restore()
                inner.detrace(inner_rebound)

    return call


def _scrub(entry: Entry, per_place: list[Any]) -> None:
    """After the function raised while traced: take the values computed from its traced
    arrays out of the user's objects (a log it appended to, an entry or global it set),
    as `Settle` does after a run that returns, so that nothing the user had is lost and
    no tracer stays behind. The nodes are left as they were: the entry may be a cached
    one, traced again for new shapes, that must keep guarding what it guarded."""
    saved = _fields([*entry.nodes, *entry.absolute])
    settle = Scrub(per_place, {})
    try:
        for node, root in zip(entry.nodes, entry.stack[-1], strict=True):
            settle.node(node, root)
        for node in entry.absolute:
            settle.node(node, None)
        if CHANGES:
            # A run that failed inside a call: its Python changes undone, as a run that
            # returns has them (`Settle.undo_changes`), for the call's retry to start over.
            for undo, _ in reversed(settle.changes):
                undo()
    finally:
        entry.rebound += settle.rebound  # user arrays stored in place of tracers: see detrace
        for node, fields in saved:
            for name, value in fields:
                setattr(node, name, value)


def _fields(nodes: list[G.Node]) -> list[tuple[G.Node, list[tuple[str, Any]]]]:
    """Every node under `nodes`, each with its fields' values (`Settle` rewrites them)."""
    out: list[tuple[G.Node, list[tuple[str, Any]]]] = []
    seen: set[int] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        names = [n for c in type(node).__mro__ for n in getattr(c, "__slots__", ())]
        out.append((node, [(n, getattr(node, n)) for n in names if hasattr(node, n)]))
        stack.extend(G.children(node))
    return out


# Per user function running in a trace (innermost last): the implicit-mode
# backward functions `tg.pullback` made during it (`made_implicit_back`).
_MADE: list[list[Any]] = []


# Per user function running in a trace: the ids of the arrays it is given as arguments
# that it also captures (`Entry.a_links`: one tracer for both). Read through an
# argument (`step(model)` with `ps = tg.params(model)` captured), such an array is
# given afresh on each call; `tg.update_`'s read check leaves it alone.
LINKED: list[frozenset[int]] = []


def _linked(entry: Entry, vals: list[Any], args: Any) -> frozenset[int]:
    """The ids of the captured arrays this run is also given as arguments (`LINKED`),
    but for those given as arguments on their own (`step(W, b, x)`): the caller's
    variables, which `tg.update_` cannot rebind, stale on the next call as they would
    be uncompiled (where the read check refuses them). An array reached through an
    argument container (`step(model)`, `step(ws)`) is read from the container
    `tg.update_` rebinds in, given afresh on each call."""
    linked = frozenset(id(vals[k]) for k in entry.a_links or () if k >= 0)
    if linked and entry.program == CALL:
        pos, kw = args
        linked = linked.difference(map(id, (*pos, *kw.values())))
    return linked


def in_user_function() -> bool:
    """Whether a user's function is running in one of treegrad's traces (a `tg.jit`
    step, a gradient of a gradient): its captured arrays are that trace's inputs."""
    return bool(_MADE)


def made_implicit_back(back: Any) -> None:
    """Record an implicit-mode `back` whose gradients are keyed by traced parameters."""
    if _MADE:
        _MADE[-1].append(back)


def _call_with_roots(entry: Entry, fns: list[Any], pos: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    # tg.jit: callable arguments travel as roots and static arguments in the
    # entry; their places in the arguments hold a marker for the real value.
    statics = list(entry.statics.values())

    def real(a: Any) -> Any:
        if type(a) is not RootArg:
            return a
        return fns[a.k + 1] if a.k >= 0 else statics[-1 - a.k]

    return fns[0](*map(real, pos), **{k: real(v) for k, v in kw.items()})


class RootArg:
    """Stands for the k-th callable argument of a `tg.jit` call in the static arguments."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __eq__(self, other: object) -> bool:
        return type(other) is RootArg and other.k == self.k

    def __hash__(self) -> int:
        return hash((RootArg, self.k))

    def __repr__(self) -> str:
        return f"<callable argument {self.k}>"


def _grad_program(entry: Entry, fns: list[Any], dyn: list[Any], ct: Any) -> Any:
    active = entry.active
    call = _user(entry, fns, dyn, active)
    has_aux = entry.options[0]

    def loss_of(*xs: Any) -> Any:
        out, written = call(*xs)
        loss = _first(out, entry.api) if has_aux and isinstance(out, tuple) else out
        return scalar_loss(loss, entry.api), (out if has_aux else None, written)

    if active:
        loss, vjp, (out, written) = jax.vjp(loss_of, *[dyn[i] for i in active], has_aux=True)
        # The cotangent is an input (always 1), so that the jaxpr shows which
        # gradients depend on it; the loss itself is an output only when asked
        # for, so XLA drops the forward work the gradient does not need.
        grads = [conj(g) for g in vjp(_seed(ct, loss))]
        if entry.placement is not None:
            # Each gradient on its parameter's sharding: left to itself XLA
            # often makes a fully sharded (FSDP) parameter's gradient
            # replicated (see _shard.py).
            grads = [constrain(g, entry.placement[i]) for i, g in zip(active, grads, strict=True)]
    else:
        loss, (out, written) = loss_of()
        grads = []
    return _flat_grads(entry, active, grads), pack(out), Written.of(written)


def _seed(ct: Any, loss: Any) -> Any:
    """The cotangent input (1) as the loss's cotangent: of its dtype and, inside
    `jax.shard_map`, varying over the mesh axes the loss varies over (as the 1
    that `jax.grad` seeds with, `full_like` of the loss); jax.vjp takes no other."""
    one = ct.astype(loss.dtype)
    if jax.typeof(one) != jax.typeof(loss):
        one = jax.lax.full_like(loss, one)
    return one


def _first(out: tuple[Any, ...], api: str) -> Any:
    """The loss of a tuple output (`withgradient`'s auxiliary results follow it)."""
    if not out:
        raise TypeError(
            f"{api}: the function must return a real scalar, or a tuple whose first element is "
            "one, but it returned an empty tuple (). Put the loss first: return (loss, aux); "
            "for the derivatives of a vector output use tg.jacobian."
        )
    return out[0]


def _grads_out(entry: Entry, active: Sequence[int], grads: Sequence[Any]) -> Any:
    by_pos = dict(zip(active, grads, strict=True))
    if entry.implicit:
        return tuple(by_pos.get(i) for i in entry.wrt)
    return entry.arg_trees(by_pos)


def _flat_grads(entry: Entry, active: Sequence[int], grads: Sequence[Any]) -> Any:
    """A gradient program's gradients: per parameter (implicit), or in `grad_order`,
    put into the arguments' structure after the call (`Entry._grad_tree`)."""
    by_pos = dict(zip(active, grads, strict=True))
    if entry.implicit:
        return tuple(by_pos.get(i) for i in entry.wrt)
    return [by_pos[i] for i in entry.grad_order()]


def _pullback_program(entry: Entry, fns: list[Any], dyn: list[Any]) -> Any:
    active = entry.active
    call = _user(entry, fns, dyn, active)
    holder: list[Any] = []

    def outputs(*xs: Any) -> Any:
        out, written = call(*xs)
        arrays, aux = split_output(out)
        holder.append(aux)
        return arrays, written

    arrays, vjp, written = jax.vjp(outputs, *[dyn[i] for i in active], has_aux=True)
    # The backward pass traced here, while the function's captured values are in
    # place (a custom rule's global read where it is swapped for this program's
    # input), and returned as its constants: `back` runs it from them, fresh for
    # every call of this program.
    closed = _backward(entry, vjp, arrays, active)
    run, consts = _jaxpr.as_function(closed)
    placed = entry.placement
    fn = _back if placed is None else _placed_back(tuple(placed[i] for i in active))
    if entry.implicit and tuple(active) != tuple(entry.wrt):
        # Implicit mode gives one gradient per captured parameter (`wrt`), as the
        # other programs do: None for one the output does not depend on.
        fn = _spread(fn, tuple(entry.wrt.index(i) for i in active), len(entry.wrt))
    back = jax.tree_util.Partial(fn, jax.tree_util.Partial(run, consts))
    return arrays, Packed(arrays, holder[0]), back, Written.of(written)


def _backward(entry: Entry, vjp: Any, out: Any, active: Sequence[int]) -> Any:
    """The backward pass, traced; records the inputs it may give a non-zero cotangent
    (`Entry.live`): the others get None, as in a gradient (`_jaxpr.reached`). Read
    from the backward pass, not from what the output depends on: a custom rule may
    pass a cotangent to an input the value ignores (a straight-through estimator),
    and an input the value depends on may get a structural zero (`stop_gradient`).
    Traced with the outputs themselves as the cotangents: the same types, placement
    (explicit mesh axes, shard_map's varying axes) included."""
    closed = jax.make_jaxpr(vjp)(out)
    given = range(len(jax.tree_util.tree_leaves(out)))
    entry.live = frozenset(active[k] for k in _jaxpr.reached(closed, given))
    return closed


def _back(vjp: Any, dy: Any) -> list[Any]:
    # `dy` is in treegrad's convention (steepest ascent, the conjugate of jax's) and
    # so are the results: conjugated on the way in and out, so that back(dy) of a
    # complex output chains like tg.gradient of the composition.
    return [conj(g) for g in vjp(*map(conj, jax.tree_util.tree_leaves(dy)))]


@functools.lru_cache(maxsize=64)
def _spread(
    fn: Callable[[Any, Any], list[Any]], where: tuple[int, ...], n: int
) -> Callable[[Any, Any], list[Any]]:
    # The gradients of the differentiated inputs at their places among `n`.
    def back(vjp: Any, dy: Any) -> list[Any]:
        out: list[Any] = [None] * n
        for k, g in zip(where, fn(vjp, dy), strict=True):
            out[k] = g
        return out

    return back


@functools.lru_cache(maxsize=64)
def _placed_back(placed: tuple[Any, ...]) -> Callable[[Any, Any], list[Any]]:
    # One function per placement (it keys the compiled backward pass), each
    # gradient constrained to its input's sharding as in `_grad_program`.
    def back(vjp: Any, dy: Any) -> list[Any]:
        return [constrain(g, s) for g, s in zip(_back(vjp, dy), placed, strict=True)]

    return back


def _jacobian_program(entry: Entry, fns: list[Any], dyn: list[Any]) -> Any:
    active = entry.active
    call = _user(entry, fns, dyn, active)
    # The call's run is the backward pass's, first. The runs a complex output takes
    # after it start from the program's inputs and leave the places as they found them
    # (`_user`'s `again`): the function's writes (`buf[0] += 1`, `c["s"] = c["s"] +
    # 1`) are made once, as in the one run of the uncompiled function.
    again = _user(entry, fns, dyn, active, again=True)

    def y_of(*xs: Any, call: Any = call) -> Any:
        out, written = call(*xs)
        if not isinstance(out, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{entry.api}: the function must return one array, got {type(out).__name__}. "
                "Return a single array (stack several outputs with jnp.stack)."
            )
        if not jnp.issubdtype(out.dtype, jnp.inexact):
            raise TypeError(
                f"{entry.api}: the function returns a {out.dtype} array; a Jacobian needs a "
                "floating-point or complex output (an integer or bool output has no "
                "derivative). Return the value before it is rounded or compared, or cast it "
                "(.astype(jnp.float32))."
            )
        return out, (out, written)

    if active:
        xs = [dyn[i] for i in active]
        _, vjp, (y, written) = jax.vjp(y_of, *xs, has_aux=True)
        complex_out = jnp.iscomplexobj(y)
        if complex_out and any(map(jnp.iscomplexobj, xs)):
            raise TypeError(
                f"{entry.api}: the function returns a complex array and takes a complex "
                "input; unless it is holomorphic, such a function has no complex Jacobian. "
                "Take the Jacobians of jnp.real(f) and jnp.imag(f) (each with respect to "
                "jnp.real and jnp.imag of the input), or, for a holomorphic f, "
                "jax.jacrev(f, holomorphic=True)."
            )
        if complex_out:
            # A complex output of real inputs: dy/dx, complex, column by column
            # (forward mode: a backward pass takes only real outputs). Which inputs
            # get None: those the linearised function's output does not depend on.
            jacs, _ = jax.jacfwd(
                functools.partial(y_of, call=again),
                argnums=tuple(range(len(active))),
                has_aux=True,
            )(*xs)
            _, tangent = jax.linearize(lambda *a: y_of(*a, call=again)[0], *xs)
            closed = jax.make_jaxpr(tangent)(*xs)
            entry.live = frozenset(active[k] for k in _jaxpr.dependencies(closed, [0]))
        else:
            # jax.jacrev's rows, one backward pass per output component, with the
            # backward pass read as a pullback's is (`_backward`). The unit
            # cotangents are the Jacobian of the identity (jax places them as the
            # output is placed); one vmap per output axis gives y.shape + x.shape.
            # Each row is the gradient of one component, in tg.gradient's convention
            # for complex inputs (steepest ascent).
            _backward(entry, vjp, y, active)
            rows = vjp
            for _ in range(y.ndim):
                rows = jax.vmap(rows)
            jacs = tuple(map(conj, rows(jax.jacrev(lambda t: t)(y))))
    else:
        _, (y, written) = y_of()
        jacs = ()
    entry.n_deps = 1
    return [y], Packed(None, None), _grads_out(entry, active, jacs), Written.of(written)


def _hessian_program(entry: Entry, fns: list[Any], dyn: list[Any]) -> Any:
    # options[1]: the groups of wrt positions (one per argument); each argument's
    # Hessian with respect to itself.
    groups = entry.arg_groups()
    if any(jnp.iscomplexobj(dyn[i]) for i in entry.active):
        raise TypeError(
            f"{entry.api}: an argument holds a complex array; the Hessian of a real function "
            "of a complex variable is not a complex matrix. Pass the real and imaginary "
            "parts as separate real arguments (f(jax.lax.complex(x, y))) and take the "
            "Hessian in those."
        )
    # The call's run gives the loss and the function's writes; each Hessian's runs start
    # from the program's inputs and leave the places as they found them (`_user`'s
    # `again`), so that the function's writes are made once. (The loss is not taken
    # from inside the first Hessian: there an argument that only a custom rule
    # differentiates, its value ignored, would read as unused, and get None.)
    call = _user(entry, fns, dyn, entry.active)
    loss, written = call(*[dyn[i] for i in entry.active])
    loss = scalar_loss(loss, entry.api)
    result = []
    for group in groups:
        active = list(dict.fromkeys(i for i in group if i in entry.active))
        h: Any = ()
        if active:
            fn = _user(entry, fns, dyn, active, again=True)
            h = jax.hessian(
                lambda *xs, fn=fn: scalar_loss(fn(*xs)[0], entry.api),
                argnums=tuple(range(len(active))),
            )(*[dyn[i] for i in active])
        index = {p: k for k, p in enumerate(active)}
        # A tied array (one input at several places): its block at its first place
        # only, None at the others, as its gradient (blocks summed over places would
        # count it again).
        first = [group.index(p) == k for k, p in enumerate(group)]
        result.append(
            tuple(
                tuple(
                    h[index[i]][index[j]] if fi and fj and i in index and j in index else None
                    for j, fj in zip(group, first, strict=True)
                )
                for i, fi in zip(group, first, strict=True)
            )
        )
    entry.n_deps = 1
    return [loss], Packed(None, None), tuple(result), Written.of(written)


def _call_program(entry: Entry, fns: list[Any], dyn: list[Any]) -> Any:
    out, written = _user(entry, fns, dyn, ())()
    if entry.out_shardings is not None:
        out = _constrained(out, entry.out_shardings, entry.api)
    entry.n_deps = 0
    return [], pack(out), None, Written.of(written)


def _constrained(out: Any, shardings: Any, api: str) -> Any:
    """The output, each array on its sharding from the pytree prefix `shardings`; one
    under a None is left to XLA's choice, as `jax.jit`'s `out_shardings` reads it."""
    per_leaf = by_prefix(shardings, out, api)
    leaves, treedef = jax.tree_util.tree_flatten(out)
    placed = [
        x if s is None or not isinstance(x, jax.Array) else jax.lax.with_sharding_constraint(x, s)
        for x, s in zip(leaves, per_leaf, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, placed)


_PROGRAMS: dict[str, Callable[..., Any]] = {
    GRAD: _grad_program,
    PULLBACK: _pullback_program,
    JACOBIAN: _jacobian_program,
    HESSIAN: _hessian_program,
    CALL: _call_program,
}


_ONE: list[Any] = []


def cotangent() -> Any:
    # Made on first use, not at import: creating an array starts jax's backend,
    # which must wait for jax.distributed.initialize in multi-process runs. The
    # first use may be inside a trace, where jnp.ones would give a tracer.
    if not _ONE:
        with jax.ensure_compile_time_eval():
            one = jnp.ones((), jnp.float32)
        if is_tracer(one):
            # Inside a trace that runs eagerly (an eager `jax.shard_map`): this
            # one belongs to that trace, so it is used for this call only.
            return one
        _ONE.append(one)
    return _ONE[0]


def is_cotangent(x: Any) -> bool:
    return bool(_ONE) and x is _ONE[0]
