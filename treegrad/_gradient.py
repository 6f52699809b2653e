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
from types import FunctionType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _cache as C
from . import _jaxpr
from . import _programs as P
from ._grads import Grads
from ._layout import different_devices, several_devices
from ._outputs import DYN
from ._paramerrors import (
    NoGradientError,
    NoGradientWarning,
    UnreadParameterError,
    unread_message,
)
from ._params import RETIRED, Params
from ._paramsource import refuse_opaque_containers
from ._tree import path_str, refuse_unsortable, user_stacklevel
from ._typing import GradientTree, PyTree


def _check_callable(f: Any, api: str) -> None:
    if not callable(f):
        raise TypeError(
            f"{api} expects a function as its first argument, got {type(f).__name__} {f!r:.60}. "
            f"Call it as {api}(lambda m: loss(m, x, y), model)."
        )


_STYLE_OK: set[Any] = set()
C.MEMOS.append(_STYLE_OK)


def _styled(f: Any, api: str, args: tuple[Any, ...]) -> Params | None:
    """Check `f` and its arguments; returns the `Params` of an implicit-style call, else None.

    Clear errors for the two styles mixed up, the usual first mistakes: checked
    once per code object and number of arguments (this runs on every call).
    """
    if not callable(f):
        _check_callable(f, api)
    ps = args[0] if len(args) == 1 and isinstance(args[0], Params) else None
    key = (getattr(f, "__code__", None), len(args), ps is None)
    if key not in _STYLE_OK:
        _check_style_once(f, api, args, ps)
        if key[0] is not None:
            _STYLE_OK.add(key)
    return ps


def _check_style_once(f: Any, api: str, args: tuple[Any, ...], ps: Params | None) -> None:
    if not args:
        implicit = (
            ""  # tg.hessian has no implicit style
            if api == "tg.hessian"
            else f"; implicit style: {api}(lambda: loss(model, x, y), tg.params(model))"
        )
        raise TypeError(
            f"{api} got no argument to differentiate with respect to. Explicit style: "
            f"{api}(lambda m: loss(m, x, y), model){implicit}."
        )
    if ps is None:
        # Into each argument only once per code object: a callable without one (a
        # partial) comes here on every call, where walking the model would cost.
        _no_params_among(api, args, deep=hasattr(f, "__code__"))
    n = _positional_arity(f)
    if n is None:
        return
    # Arguments with defaults are not required: `lambda c=c: ...` is the loop-capture idiom.
    n_required = n - len(getattr(f, "__defaults__", None) or ())
    if ps is not None and n_required > 0:
        raise TypeError(
            f"{api}: implicit style (a tg.Params as the only argument) calls the function with "
            f"no arguments, but {_describe(f)} takes {n_required} without a default. Write "
            f"{api}(lambda: loss(model, x, y), ps), or use explicit style: "
            f"{api}(lambda m: loss(m, x, y), model)."
        )
    if ps is None and n_required > len(args):
        raise TypeError(
            f"{api}: {_describe(f)} takes {n} positional argument(s) but was given "
            f"{len(args)} to differentiate; gradient passes each argument after the function "
            f"to it: {api}(f, model, x) calls f(model, x)."
        )
    if ps is None and n < len(args) and n >= 0:
        if n == 0:
            raise TypeError(
                f"{api}: {_describe(f)} takes no arguments but was given {len(args)} to "
                "differentiate. For implicit style pass the parameters: "
                f"{api}(lambda: loss(model, x, y), tg.params(model)); for explicit style let "
                f"the function take the model: {api}(lambda m: loss(m, x, y), model)."
            )
        raise TypeError(
            f"{api}: {_describe(f)} takes {n} positional argument(s) but was given "
            f"{len(args)}; gradient passes each argument after the function to it."
        )


def _no_params_among(api: str, args: tuple[Any, ...], deep: bool) -> None:
    """Refuse a `Params` or `Grads` given with other arguments, or inside one (`deep`):
    not a pytree, it would be a leaf of explicit mode, and its gradient a silent None."""
    for k, arg in enumerate(args):
        try:
            pairs = jax.tree_util.tree_leaves_with_path(arg) if deep else [((), arg)]
        except ValueError as e:  # a dict whose keys jax cannot sort: named
            refuse_unsortable(api, [(f"argument {k}", arg)], e)
            raise
        if deep:
            refuse_opaque_containers(pairs, api, f"argument {k}")
        for _, leaf in pairs:
            if type(leaf) is Params:
                where = "" if leaf is arg else f" inside argument {k} ({type(arg).__name__})"
                raise TypeError(
                    f"{api}: a tg.Params is passed{where} among {len(args)} argument(s), so "
                    "it would be an explicit-mode argument, which has no gradient (None). "
                    f"Implicit style takes the Params as the only argument and a function of "
                    f"none: {api}(lambda: loss(model, x, y), ps); explicit style takes the "
                    f"model itself: {api}(lambda m: loss(m, x, y), model)."
                )
            if type(leaf) is Grads:
                raise TypeError(
                    f"{api}: a tg.Grads is passed as (part of) argument {k}; it is keyed by "
                    "parameter arrays, and differentiating with respect to it is not "
                    "supported. Pass grads.to_tree(model) or grads.named() (a dict of arrays)."
                )


def _positional_arity(f: Any) -> int | None:
    """How many positional arguments `f` takes (None: any number, or unknown)."""
    code = getattr(f, "__code__", None)
    if code is None or not isinstance(f, FunctionType):
        return None
    if code.co_flags & 0x04:  # *args
        return None
    n = code.co_argcount
    return n


def _describe(f: Any) -> str:
    name = getattr(f, "__qualname__", None) or type(f).__name__
    return "the lambda" if name.endswith("<lambda>") else name


def _explicit(program: str, api: str, f: Any, args: tuple[Any, ...], options: Any) -> Any:
    try:
        return C.execute(program, api, options, (f,), args)
    except ValueError as e:
        _explain_devices(api, args, e)
        raise


def _explain_devices(api: str, args: tuple[Any, ...], e: ValueError) -> None:
    if several_devices():  # jax's error names the program's inputs, not the arguments'
        different_devices(api, _named_leaves(args), e)


def _named_leaves(args: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """Each leaf of the arguments, described for a message: `'l1.weight'`, `argument 1`."""
    out = []
    for i, arg in enumerate(args):
        for path, x in jax.tree_util.tree_flatten_with_path(arg)[0]:
            name = path_str(path)
            if len(args) == 1:
                out.append((repr(name or "<root>"), x))
            else:
                out.append((f"{name!r} of argument {i}" if name else f"argument {i}", x))
    return out


class _Implicit:
    """One implicit-mode call: the parameters read from their `Params`, and the results."""

    __slots__ = ("arrays", "entry", "out", "paths")

    def __init__(self, program: str, api: str, f: Any, ps: Params, options: Any):
        # The parameters are read in the call's turn: while another thread traces over
        # the same model, its places hold that trace's tracers (`_cache.TURN`), which
        # read here would be taken for the parameters (the loss then "depends on none").
        with C.TURN:
            self.arrays, self.paths = ps._read()
            try:
                self.entry, self.out = C.execute(
                    program, api, options, (f,), (), params=self.arrays
                )
            except ValueError as e:
                if several_devices():
                    different_devices(api, ((repr(k), a) for k, a in ps.named().items()), e)
                raise
            if (ps._stale or RETIRED) and ps.any_stale():
                # An update replaced arrays the loss read outside the Params (this one or
                # another): still reading one, it would never train (`_optim._check_read`).
                stale = ps.stale_read(self.entry.guard.check(f) or ())
                if stale is not None:
                    name, where, old, other = stale
                    # Said once: a loop the user fixes next may build its Params over
                    # the same array, and must not be refused for this one's mistake.
                    RETIRED.pop(id(old), None)
                    raise UnreadParameterError(
                        unread_message(api, name, where, old, stale=True, other=other)
                    )

    def place(self, values: Any) -> list[Any]:
        """One value per registered parameter: its result, or None where it has none."""
        entry = self.entry
        by_pos = dict(zip(entry.wrt, values, strict=True))
        return list(map(by_pos.get, entry.param_pos))  # None at -1: not captured


def _label(path: Any) -> str:
    return repr(path_str(path)) if path else "array"


def _implicit_grad(api: str, f: Any, ps: Params, has_aux: bool, strict: bool) -> tuple[Any, Grads]:
    call = _Implicit(P.GRAD, api, f, ps, (has_aux,))
    _, packed, grads = call.out
    values = call.place(grads)
    if values and all(g is None for g in values):
        # Only now (a rare path): whether the function read traced arrays.
        read = call.entry.guard.check(f) or ()
        _no_gradient(
            api,
            strict,
            len(values),
            traced=any(map(_jaxpr.is_tracer, read)),
            replaced=_reads_lookalikes(read, call.arrays),
        )
    value = packed.value() if has_aux else None
    return value, Grads(call.arrays, values, call.paths, ((call.entry, (f,)),))


def _reads_lookalikes(read: Any, arrays: Any) -> bool:
    """Whether the function reads, instead of the parameters, arrays of every one of their
    shapes and dtypes: the model was most likely replaced by a new one after
    `tg.params(model)` (an equinox model updated with `eqx.apply_updates` or `eqx.tree_at`,
    `model = new_model`), and the Params still hold the old one's arrays. Every kind must
    be matched, one of them not a scalar, so a loss computed outside (`q = model(x)`,
    read as one array) keeps the usual message."""
    kinds = {(a.shape, a.dtype) for a in arrays if isinstance(a, jax.Array)}
    ids = {id(a) for a in arrays}
    if not any(shape for shape, _ in kinds) or any(id(a) in ids for a in read):
        return False  # (it reads a parameter: under stop_gradient, say)
    seen = {(a.shape, a.dtype) for a in read if isinstance(a, jax.Array)}
    return kinds <= seen


def _no_gradient(
    api: str, strict: bool, n: int, traced: bool = False, replaced: bool = False
) -> None:
    msg = f"{api}: the loss does not depend on any of the {n} registered parameters, so every "
    if traced and P.in_user_function():
        # Inside tg.jit (or tg.train's compiled step), captured arrays are inputs mapped
        # to their tracers: a Params the loss does not read holds other arrays, most
        # often standalone ones an earlier update replaced in the Params only.
        msg += (
            "gradient is None. The function reads none of the arrays the Params hold now. "
            "Inside a compiled step (tg.jit, tg.train) the arrays it captures are its inputs; "
            "a Params of arrays captured on their own (tg.Params([W, b]) with W and b globals) "
            "holds new arrays after an update, which the function never reads. Keep the "
            "parameters in a model, dict or list the function reads them from, and build the "
            "Params from it (ps = tg.params(model))."
        )
    elif traced:
        # Inside jax.jit (or vmap, grad...), a model passed in is a new set of traced
        # arrays: the Params built outside hold the old ones, which the loss never reads.
        msg += (
            "gradient is None. The function runs inside a jax transformation (jax.jit, "
            "jax.vmap, ...) and reads traced copies of the model, while the Params hold the "
            "arrays from outside it. Build the Params inside the transformed function "
            "(ps = tg.params(m)), or compile with tg.jit, which maps captured parameters to "
            "their traced copies."
        )
    else:
        msg += (
            "gradient is None. The computation was probably done outside the function passed "
            "to gradient (e.g. `q = model(x)` computed before the call): only what runs inside "
            "the function is differentiated. Move the model call inside, or use explicit "
            "mode: tg.gradient(lambda m: loss(m(x), y), model)."
        )
        if replaced:
            # That points the wrong way when the function reads a model of the same
            # shapes: an immutable model (equinox) updated purely is a new object, and a
            # Params of the old one is never read.
            msg += (
                " Or, since the function reads other arrays of the parameters' shapes and "
                "dtypes: the model was probably replaced by a new one since the Params were "
                "built (eqx.apply_updates, eqx.tree_at, tg.update and `model = ...` all make a "
                "new model; the Params hold the old one's arrays). Build the Params again from "
                "the model the function reads (ps = tg.params(model)), or update in place with "
                "tg.update_(state, ps, grads), which keeps them current."
            )
    if strict:
        raise NoGradientError(msg)
    warnings.warn(msg, NoGradientWarning, stacklevel=user_stacklevel())


def _explicit_grad(api: str, f: Any, args: tuple[Any, ...], has_aux: bool) -> tuple[Any, Any]:
    try:
        _, (_, packed, grads) = C.execute(P.GRAD, api, (has_aux,), (f,), args)
    except ValueError as e:
        _explain_devices(api, args, e)
        raise
    return (packed.value() if has_aux else None), grads


def gradient(
    f: Callable[..., Any], *args: PyTree, strict: bool = False
) -> tuple[GradientTree, ...] | Grads:
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
    ps = _styled(f, "tg.gradient", args)
    if ps is not None:
        return _implicit_grad("tg.gradient", f, ps, False, strict)[1]
    return _explicit_grad("tg.gradient", f, args, False)[1]


def withgradient(
    f: Callable[..., Any], *args: PyTree, strict: bool = False
) -> tuple[Any, tuple[GradientTree, ...] | Grads]:
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
    ps = _styled(f, "tg.withgradient", args)
    if ps is not None:
        return _implicit_grad("tg.withgradient", f, ps, True, strict)
    return _explicit_grad("tg.withgradient", f, args, True)


_BACK = jax.jit(lambda back, dy: back(dy))


class Pullback:
    """The backward function returned by `tg.pullback`: `back(dy)` gives gradients.

    `dy` has the structure of the output; `back(None)` (no cotangent) gives
    `None` for every gradient, as a structural zero. `None` for one output array
    is a zero cotangent for it, and a Python number is taken for a scalar output.
    """

    __slots__ = ("_aux", "_back", "_none", "_place", "_shapes")

    def __init__(self, back: Any, out: Any, place: Callable[[Any], Any], none: Any):
        self._back = back
        self._aux = out.aux
        self._shapes = [(a.shape, a.dtype) for a in out.payload]
        self._place = place
        self._none = none

    def __call__(self, dy: Any) -> Any:
        if dy is None:
            return self._none
        try:
            leaves = self._aux.treedef.flatten_up_to(dy)
        except (ValueError, TypeError):
            raise ValueError(
                "tg.pullback: the cotangent does not have the structure of the output "
                f"({self._aux.treedef}); pass one array per output array, shaped like it."
            ) from None
        given = [d for d, s in zip(leaves, self._aux.statics, strict=True) if s is DYN]
        if all(d is None for d in given):
            return self._none
        arrays = [
            _cotangent(d, shape, dtype, k if len(given) > 1 else None)
            for k, (d, (shape, dtype)) in enumerate(zip(given, self._shapes, strict=True))
        ]
        return self._place(_BACK(self._back, arrays))


def _pullback_flatten(p: Pullback) -> tuple[tuple[Any], tuple[Any, ...]]:
    return (p._back,), (p._aux, tuple(p._shapes), p._place, p._none)


def _pullback_unflatten(static: tuple[Any, ...], children: tuple[Any]) -> Pullback:
    p = object.__new__(Pullback)
    p._back = children[0]
    p._aux, shapes, p._place, p._none = static
    p._shapes = list(shapes)
    return p


# A pytree, like the function jax.vjp returns: `back` can leave a jax.jit (its
# residuals are its leaves) and be passed into one.
jax.tree_util.register_pytree_node(Pullback, _pullback_flatten, _pullback_unflatten)


def _cotangent(d: Any, shape: tuple[int, ...], dtype: Any, k: int | None) -> Any:
    """The cotangent `d` given for one output array (the `k`-th), as jax.vjp takes it."""
    which = "" if k is None else f" {k}"
    if d is None:
        # None for one output, as for the whole output: it contributes nothing.
        return jnp.zeros(shape, dtype)
    number = isinstance(d, (int, float, complex, np.generic)) and not isinstance(
        d, (bool, np.bool_)
    )
    got = np.shape(d) if number else getattr(d, "shape", None)
    if got != shape:
        what = f"shape {got}" if got is not None else f"type {type(d).__name__}"
        raise ValueError(
            f"tg.pullback: the cotangent dy{which} has {what} where the output{which} has "
            f"shape {shape} ({dtype}); pass dy shaped like the output."
        )
    if number:
        # `back(1.0)` for a scalar loss is the usual idiom (Zygote's too); left as
        # it is, a Python float would reach jax.vjp weakly typed or as float64.
        if not np.can_cast(np.result_type(d), dtype, "same_kind"):
            raise ValueError(
                f"tg.pullback: the cotangent dy{which} is a {type(d).__name__} where the "
                f"output{which} has dtype {dtype}; pass a value of that kind."
            )
        return jnp.asarray(d, dtype)
    have = getattr(d, "dtype", None)
    if have is not None and have != dtype:
        # jax.vjp takes only the output's own dtype; a float32 dy for a float16 output
        # is the same number at another precision, a complex one for a real output not.
        if not np.can_cast(have, dtype, "same_kind"):
            raise ValueError(
                f"tg.pullback: the cotangent dy{which} has dtype {have} where the output{which} "
                f"has dtype {dtype}; pass dy of the output's dtype (dy.astype({dtype}) if the "
                "values are meant)."
            )
        return d.astype(dtype)
    return d


def pullback(f: Callable[..., Any], *args: PyTree) -> tuple[PyTree, Pullback]:
    """The value of `f` and a function mapping an output cotangent to gradients.

    Arguments:
        f: any function of arrays and pytrees.
        *args: its arguments, or a single `tg.Params` (implicit mode).

    Returns:
        `(y, back)`: `back(dy)` returns a tuple like `tg.gradient` (a `tg.Grads`
        in implicit mode), with `None` for leaves `y` does not depend on;
        `back(None)` returns `None` for every gradient.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> y, back = tg.pullback(lambda x: 3 * x, jnp.array([1.0, 2.0]))
        >>> back(jnp.array([1.0, 10.0]))
        (Array([ 3., 30.], dtype=float32),)
    """
    ps = _styled(f, "tg.pullback", args)
    if ps is not None:
        call = _Implicit(P.PULLBACK, "tg.pullback", f, ps, ())
        _, packed, back = call.out
        arrays, paths = call.arrays, call.paths
        none = Grads(arrays, [None] * len(arrays), paths)
        readers = ((call.entry, (f,)),)
        pb = Pullback(back, packed, lambda g: Grads(arrays, call.place(g), paths, readers), none)
        if any(map(_jaxpr.is_tracer, arrays)):
            P.made_implicit_back(pb)  # keyed by tracers: must not leave their trace
        return packed.value(), pb
    entry, (_, packed, back) = _explicit(P.PULLBACK, "tg.pullback", f, args, ())
    active = entry.active

    def to_trees(g: Any) -> Any:
        return entry.arg_trees(dict(zip(active, g, strict=True)))

    return packed.value(), Pullback(back, packed, to_trees, entry.arg_trees({}))


def jacobian(f: Callable[..., Any], *args: PyTree) -> tuple[PyTree, ...] | Grads:
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
    ps = _styled(f, "tg.jacobian", args)
    if ps is not None:
        call = _Implicit(P.JACOBIAN, "tg.jacobian", f, ps, ())
        return Grads(call.arrays, call.place(call.out[2]), call.paths)
    return _explicit(P.JACOBIAN, "tg.jacobian", f, args, ())[1][2]


def hessian(f: Callable[..., Any], *args: PyTree) -> tuple[PyTree, ...]:
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
    if len(args) == 1 and isinstance(args[0], Params):
        raise TypeError("tg.hessian takes explicit arguments; pass the arrays, not a tg.Params.")
    _styled(f, "tg.hessian", args)
    entry, (_, _, blocks) = _explicit(P.HESSIAN, "tg.hessian", f, args, (False,))
    out = []
    offset = 0
    for treedef, block in zip(entry.a_def.children(), blocks, strict=True):
        n = treedef.num_leaves
        statics = (DYN,) * n if entry.a_statics is None else entry.a_statics[offset : offset + n]
        offset += n
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            out.append(block[0][0] if statics[0] is DYN else None)
            continue
        rows = iter(block)
        outer: list[Any] = []
        for s in statics:
            if s is not DYN:
                outer.append(None)
                continue
            cols = iter(next(rows))
            inner = [next(cols) if t is DYN else None for t in statics]
            # The row of a leaf not differentiated (an int array, a tied array's later
            # place) is None, like its gradient, not a tree of Nones.
            row = None if all(b is None for b in inner) else inner
            outer.append(None if row is None else jax.tree_util.tree_unflatten(treedef, row))
        out.append(jax.tree_util.tree_unflatten(treedef, outer))
    return tuple(out)
