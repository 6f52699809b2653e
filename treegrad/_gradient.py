"""The two front ends of the engine: explicit gradient trees and implicit `Grads`.

Explicit mode differentiates with respect to the positional arguments and
returns trees shaped like them. Implicit mode (the only positional argument is
a `Params`) differentiates a zero-argument closure with respect to the
registered parameters wherever the closure reached them: the engine has already
turned every array the closure captures into an input, so implicit mode only
says which inputs are the parameters (matched by identity). Both run the same
compiled program, so they agree to the last bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax

from . import _engine as E
from ._params import Grads, NoGradientError, NoGradientWarning, Params
from ._tree import describe_leaf, path_str


def _check_callable(f: Any, api: str) -> None:
    if not callable(f):
        raise TypeError(
            f"{api} expects a function as its first argument, got {type(f).__name__} {f!r:.60}. "
            f"Call it as {api}(lambda m: loss(m, x, y), model)."
        )


def _explicit_entry(
    program: str, api: str, f: Any, args: tuple[Any, ...], options: tuple[Any, ...] = ()
) -> tuple[Any, E.Entry, E.Flat]:
    flat = E.Flat(f, args)
    key = (program, options, flat.key)
    entry = E.lookup(key)
    if entry is None:
        wrt = tuple(range(flat.n_closure_dyn(), len(flat.dyn)))
        entry = E.Entry(program, flat, wrt, api=api, options=options)
        E.store(key, entry)
    return key, entry, flat


def _explicit_grad(
    api: str, f: Any, args: tuple[Any, ...], has_aux: bool
) -> tuple[Any, tuple[Any, ...]]:
    key, entry, flat = _explicit_entry(E.GRAD, api, f, args, (has_aux,))
    packed, grads = E.execute(key, entry, flat.dyn, f)
    return packed.value(), grads


class _Implicit:
    """The per-call bookkeeping of implicit mode."""

    __slots__ = ("arrays", "entry", "key", "paths", "positions", "uniq")

    def __init__(self, program: str, api: str, f: Any, ps: Params, options: tuple[Any, ...]):
        arrays, paths = ps._read()
        self.arrays = arrays
        self.paths = paths
        flat = E.Flat(f, ())
        # Inputs are de-duplicated by identity, so an array reached twice (a
        # tied weight, or a parameter reached through two containers) is one
        # input of the staged function and gets one, total, gradient.
        index: dict[int, int] = {}
        uniq: list[Any] = []
        slots = []
        for a in flat.dyn:
            j = index.get(id(a))
            if j is None:
                j = index[id(a)] = len(uniq)
                uniq.append(a)
            slots.append(j)
        # Per registered parameter: its input position, or -1 if not captured.
        positions = [index.get(id(p), -1) for p in arrays]
        present = tuple(p for p in positions if p >= 0)
        self.positions = positions
        self.uniq = uniq
        self.key = (program, options, flat.key, tuple(slots), present)
        entry = E.lookup(self.key)
        if entry is None:
            ids = {id(a): p for a, p in zip(arrays, paths, strict=True)}

            def guard(hidden: list[Any]) -> None:
                for h in hidden:
                    if id(h) in ids:
                        raise TypeError(
                            f"{api}: the function reaches the parameter "
                            f"{_label(ids[id(h)])} ({describe_leaf(h)}) through an object "
                            "treegrad cannot see into, so its gradient cannot be taken. "
                            "Reach it through a tg.Module, a list, a dict, a closure variable "
                            "or a global instead."
                        )

            entry = E.Entry(
                program, flat, present, api=api, slots=tuple(slots), options=options, guard=guard
            )
            E.store(self.key, entry)
        self.entry = entry

    def run(self, f: Any) -> Any:
        return E.execute(self.key, self.entry, self.uniq, f)

    def place(self, values: tuple[Any, ...]) -> list[Any]:
        """One value per registered parameter: its result, or None if not captured."""
        it = iter(values)
        return [None if p < 0 else next(it) for p in self.positions]


def _label(path: Any) -> str:
    return repr(path_str(path)) if path else "array"


def _implicit_grad(api: str, f: Any, ps: Params, has_aux: bool, strict: bool) -> tuple[Any, Grads]:
    call = _Implicit(E.GRAD, api, f, ps, (has_aux,))
    packed, grads = call.run(f)
    values = call.place(grads)
    if all(g is None for g in values):
        _no_gradient(api, strict, len(values))
    return packed.value(), Grads(call.arrays, values, call.paths)


def _no_gradient(api: str, strict: bool, n: int) -> None:
    msg = (
        f"{api}: the loss does not depend on any of the {n} registered parameters, so every "
        "gradient is None. The computation was probably done outside the function passed to "
        "gradient (e.g. `q = model(x)` computed before the call): only what runs inside the "
        "function is differentiated. Move the model call inside, or use explicit mode: "
        "tg.gradient(lambda m: loss(m(x), y), model)."
    )
    if strict:
        raise NoGradientError(msg)
    warnings.warn(msg, NoGradientWarning, stacklevel=3)


def _split_implicit(args: tuple[Any, ...]) -> Params | None:
    if len(args) == 1 and isinstance(args[0], Params):
        return args[0]
    return None


def gradient(f: Callable[..., Any], *args: Any, strict: bool = False) -> Any:
    """The gradient of a scalar function with respect to each argument.

    Explicit mode: `tg.gradient(f, *args)` returns a tuple with one entry per
    argument, shaped like it: the same containers and Module types, the same
    static data, each differentiable leaf replaced by its gradient and every
    other leaf (integers, keys, leaves the output does not depend on) by None.

    Implicit mode: when the only argument is a `tg.Params`, `f` takes no
    arguments and the result is a `tg.Grads` looked up by parameter.

    Arguments:
        f: a function returning a real scalar.
        *args: the arguments to differentiate with respect to (models, arrays,
            any pytrees), or a single `tg.Params`.
        strict: implicit mode only: raise `tg.NoGradientError` instead of
            warning when the loss depends on no registered parameter.

    Returns:
        A tuple of gradient trees, or a `tg.Grads`.

    Compiled by XLA and cached: a new lambda with the same code and the same
    shapes reuses the compiled function, and arrays the function captures are
    inputs, so a changed global or closure variable is always seen.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> W = jnp.ones((3, 5)); b = jnp.zeros(3)
        >>> x = jnp.array([3.0, 1, 0, 1, 2])
        >>> gW, gb = tg.gradient(lambda W, b: jnp.sum(W @ x + b), W, b)
        >>> gW[1], gb
        (Array([3., 1., 0., 1., 2.], dtype=float32), Array([1., 1., 1.], dtype=float32))
        >>> tg.gradient(lambda a, b: jnp.sum(a), x, b)
        (Array([1., 1., 1., 1., 1.], dtype=float32), None)
    """
    _check_callable(f, "tg.gradient")
    ps = _split_implicit(args)
    if ps is not None:
        return _implicit_grad("tg.gradient", f, ps, False, strict)[1]
    return _explicit_grad("tg.gradient", f, args, False)[1]


def withgradient(f: Callable[..., Any], *args: Any, strict: bool = False) -> tuple[Any, Any]:
    """The value of `f` and its gradient: `(value, grads)`.

    As `tg.gradient`, and if `f` returns a tuple (a NamedTuple included), its
    first element is differentiated and `value` is the whole output, so
    auxiliary results come back alongside the loss.

    Arguments:
        f: a function returning a real scalar, or a tuple whose first element is one.
        *args: the arguments, or a single `tg.Params` (implicit mode).
        strict: implicit mode only: raise instead of warning when no gradient flows.

    Returns:
        `(value, grads)`, `grads` as in `tg.gradient`.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> x = jnp.array([1.0, 2.0])
        >>> (loss, pred), (g,) = tg.withgradient(lambda x: (jnp.sum(x**2), 2 * x), x)
        >>> loss, g
        (Array(5., dtype=float32), Array([2., 4.], dtype=float32))
    """
    _check_callable(f, "tg.withgradient")
    ps = _split_implicit(args)
    if ps is not None:
        return _implicit_grad("tg.withgradient", f, ps, True, strict)
    return _explicit_grad("tg.withgradient", f, args, True)


_BACK = jax.jit(lambda back, dy: back(dy))


class Pullback:
    """The backward function returned by `tg.pullback`: `back(dy)` gives gradients."""

    __slots__ = ("_back", "_place")

    def __init__(self, back: Any, place: Callable[[tuple[Any, ...]], Any]):
        self._back = back
        self._place = place

    def __call__(self, dy: Any) -> Any:
        return self._place(_BACK(self._back, dy))


def pullback(f: Callable[..., Any], *args: Any) -> tuple[Any, Pullback]:
    """The value of `f` and a function mapping an output cotangent to gradients.

    Arguments:
        f: any function of arrays and pytrees.
        *args: its arguments, or a single `tg.Params` (implicit mode).

    Returns:
        `(y, back)`: `back(dy)` returns a tuple like `tg.gradient` (a `tg.Grads`
        in implicit mode), with `None` for leaves `y` does not depend on.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> y, back = tg.pullback(lambda x: 3 * x, jnp.array([1.0, 2.0]))
        >>> back(jnp.array([1.0, 10.0]))
        (Array([ 3., 30.], dtype=float32),)
    """
    _check_callable(f, "tg.pullback")
    ps = _split_implicit(args)
    if ps is not None:
        call = _Implicit(E.PULLBACK, "tg.pullback", f, ps, ())
        out, back = call.run(f)
        return out, Pullback(back, lambda g: Grads(call.arrays, call.place(g), call.paths))
    key, entry, flat = _explicit_entry(E.PULLBACK, "tg.pullback", f, args)
    out, back = E.execute(key, entry, flat.dyn, f)
    return out, Pullback(back, entry.arg_trees)


def jacobian(f: Callable[..., Any], *args: Any) -> Any:
    """The Jacobian of an array-valued function with respect to each argument.

    Arguments:
        f: a function returning one array `y`.
        *args: its arguments, or a single `tg.Params` (implicit mode).

    Returns:
        A tuple shaped like the arguments, each differentiable leaf `x` replaced
        by an array of shape `y.shape + x.shape` (`None` where `y` does not
        depend on it); a `tg.Grads` of Jacobians in implicit mode.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> (J,) = tg.jacobian(lambda x: x**2, jnp.array([1.0, 2.0]))
        >>> J
        Array([[2., 0.],
               [0., 4.]], dtype=float32)
    """
    _check_callable(f, "tg.jacobian")
    ps = _split_implicit(args)
    if ps is not None:
        call = _Implicit(E.JACOBIAN, "tg.jacobian", f, ps, ())
        return Grads(call.arrays, call.place(call.run(f)), call.paths)
    key, entry, flat = _explicit_entry(E.JACOBIAN, "tg.jacobian", f, args)
    return E.execute(key, entry, flat.dyn, f)


def hessian(f: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """The Hessian of a scalar function with respect to each argument.

    Arguments:
        f: a function returning a real scalar.
        *args: its arguments.

    Returns:
        A tuple with one Hessian per argument (second derivatives with respect
        to that argument alone). For an array `x` it has shape
        `x.shape + x.shape`; for a pytree argument it is a tree of trees
        (`H[leaf_i][leaf_j]`), like `jax.hessian`.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> (H,) = tg.hessian(lambda x: jnp.sum(x**3), jnp.array([1.0, 2.0]))
        >>> H
        Array([[ 6.,  0.],
               [ 0., 12.]], dtype=float32)
    """
    _check_callable(f, "tg.hessian")
    if _split_implicit(args) is not None:
        raise TypeError("tg.hessian takes explicit arguments; pass the arrays, not a tg.Params.")
    flat = E.Flat(f, args)
    groups = _arg_groups(flat)
    key = (E.HESSIAN, groups, flat.key)
    entry = E.lookup(key)
    if entry is None:
        wrt = tuple(i for g in groups for i in g)
        entry = E.Entry(E.HESSIAN, flat, wrt, api="tg.hessian", options=(False, groups))
        E.store(key, entry)
    blocks = E.execute(key, entry, flat.dyn, f)
    out = []
    offset = flat.n_cl
    for treedef, block in zip(_children(flat.a_def), blocks, strict=True):
        statics = flat.statics[offset : offset + treedef.num_leaves]
        offset += treedef.num_leaves
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            out.append(block[0][0] if statics[0] is E.DYN else None)
            continue
        rows = iter(block)
        outer: list[Any] = []
        for s in statics:
            if s is not E.DYN:
                outer.append(None)
                continue
            cols = iter(next(rows))
            inner = [next(cols) if t is E.DYN else None for t in statics]
            outer.append(jax.tree_util.tree_unflatten(treedef, inner))
        out.append(jax.tree_util.tree_unflatten(treedef, outer))
    return tuple(out)


def _arg_groups(flat: E.Flat) -> tuple[tuple[int, ...], ...]:
    """The dynamic-input positions of each top-level argument."""
    groups = []
    pos = flat.n_closure_dyn()
    offset = flat.n_cl
    for child in _children(flat.a_def):
        segment = flat.statics[offset : offset + child.num_leaves]
        offset += child.num_leaves
        n_dyn = sum(s is E.DYN for s in segment)
        groups.append(tuple(range(pos, pos + n_dyn)))
        pos += n_dyn
    return tuple(groups)


def _children(treedef: Any) -> list[Any]:
    return list(treedef.children())
