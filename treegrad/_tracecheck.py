"""What a trace must not let out of the user's function, and how its errors read.

While `_programs` traces a user's function, arrays are tracers: one stored in a
plain object the caller keeps, assigned into an argument and not returned, or
returned inside a `Grads`, `Params` or implicit-mode `back` would be dead
outside the trace. Each is refused while tracing, with how to write the
function instead; a traced array used where Python needs a concrete value gets
a message that names the user's own line.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any

import jax

from . import _kinds as K
from ._grads import Grads
from ._jaxpr import is_tracer
from ._params import Params
from ._tree import path_str

if TYPE_CHECKING:
    from ._engine import Entry


def check_out(api: str, out: Any, made: list[Any], returns_one: bool) -> None:
    """Refuse an output holding what only makes sense inside this trace.

    A `Grads` or `Params` in an output tree (one returned alone by a function that
    must return one array has that error) holds the parameter arrays themselves (tracers here),
    and so does an implicit-mode `back` made in this run (`made`), in its pytree's
    static data: returned, every lookup with the user's arrays would miss, and
    `named()` would hand back values keyed by dead tracers. (tg.jit's own output
    check, `_outputs.split_output`, words the first two for a compiled function.)
    `returns_one`: the program's function must return one array (a gradient,
    Jacobian or Hessian), so a `Grads` or `Params` returned alone has that error.
    """
    ids = {id(b) for b in made}
    alone = returns_one and type(out) in (Grads, Params)
    for v in jax.tree_util.tree_leaves(out, is_leaf=lambda v: id(v) in ids):
        if id(v) in ids:
            raise TypeError(
                f"{api}: the function returns the backward function of an implicit-mode "
                "tg.pullback, whose gradients are keyed by the parameter arrays themselves, "
                "traced inside the function: outside it no lookup with your arrays could "
                "find them. Call back(dy) inside the function and return grads.named() or "
                "grads.to_tree(model), or use explicit mode, tg.pullback(lambda m: f(m), "
                "model), whose back can be returned."
            )
        if type(v) is Grads and not alone:
            raise TypeError(
                f"{api}: the function's output holds a tg.Grads, which is "
                "keyed by the parameter arrays themselves, traced inside the function: "
                "outside it no lookup with your arrays could find them. Return "
                "grads.named() or grads.to_tree(model) instead."
            )
        if type(v) is Params and not alone:
            raise TypeError(
                f"{api}: the function's output holds a tg.Params, which "
                "holds the arrays themselves, traced inside the function. Return the model "
                "instead and call tg.params(model) outside."
            )


class ArgsKept:
    """tg.jit's arguments are values, as with `jax.jit`: the function gets its own
    copy of each pytree argument. An array it assigns into that copy and does not
    return would be lost (`tg.update_` on an optimiser state passed as an
    argument: the step would train without the state ever advancing), and one it
    stores in a plain object, passed by reference as static data, would leak a
    tracer into the caller's object. Both are refused while tracing, with how to
    write the step instead; no call pays for the check."""

    def __init__(self, api: str, args: Any):
        self.api = api
        self.args = args
        self.before = jax.tree_util.tree_leaves(args)
        # Plain objects (not pytrees) travel by reference: their attributes, shallowly.
        self.objects: list[tuple[Any, dict[str, Any]]] = [
            (leaf, dict(vars(leaf)))
            for leaf in self.before
            if not is_tracer(leaf)
            and type(leaf).__module__ not in _LIBRARY_MODULES
            and not isinstance(
                leaf, (type, types.FunctionType, types.ModuleType, functools.partial)
            )
            and isinstance(getattr(leaf, "__dict__", None), dict)
        ]

    def check(self, out: Any) -> None:
        for obj, attrs in self.objects:
            stored = [k for k, v in vars(obj).items() if is_tracer(v) and attrs.get(k) is not v]
            if stored:
                vars(obj).clear()
                vars(obj).update(attrs)  # the caller's object as it was
                raise TypeError(
                    f"{self.api}: the function stores a traced array in attribute "
                    f"{stored[0]!r} of an argument of type {type(obj).__name__}, which is not "
                    "a pytree and so is passed as static data, by reference: the array would "
                    "leak out of the compiled function. Let the function capture the object "
                    "instead of taking it as an argument (tg.jit then writes its arrays back), "
                    "make it a tg.Module, or return the new array."
                )
        seen = {id(a) for a in self.before}
        new = [a for a in jax.tree_util.tree_leaves(self.args) if id(a) not in seen]
        returned = {id(a) for a in jax.tree_util.tree_leaves(out)}
        lost = [a for a in new if is_tracer(a) and id(a) not in returned]
        if lost:
            raise TypeError(
                f"{self.api}: the function assigns new arrays into one of its arguments "
                "(e.g. tg.update_ on an optimiser state or model passed as an argument) and "
                "does not return them. Arguments are values, as with jax.jit: the change "
                "would be lost, and the caller's object would not advance. Return the "
                "changed argument and use the returned one (or the pure tg.update), or let "
                "the function capture the object instead of taking it as an argument "
                "(tg.jit writes captured arrays back)."
            )


# Types whose instances are never a user's plain object holding arrays.
_LIBRARY_MODULES = frozenset({"builtins", "numpy", "jaxlib.xla_extension", "jaxlib._jax"})


def traced_value_error(entry: Entry, e: Exception) -> Exception:
    where = _user_frame(e)
    captured = ", ".join(entry.names[:6])
    what = (
        f" It reads these captured arrays, which are traced inputs: {captured}." if captured else ""
    )
    msg = (
        f"{entry.api}: while tracing {where}, a traced array was used where a concrete Python "
        f"value is needed ({type(e).__name__}: {str(e).splitlines()[0]}).{what} treegrad traces "
        "every array the function reads (arguments, closure variables, globals) as an input, "
        "so that it is never stale; its value is not known while compiling. Use a Python "
        "value instead (e.g. mask.tolist(), or int(n) computed outside the function), use "
        "jnp.where instead of boolean indexing, or pass the value to a tg.jit function listed "
        "in static_argnums."
    )
    return TypeError(msg)


def _user_frame(e: BaseException) -> str:
    """The innermost frame of the user's own code in a traceback: `file:line`."""
    tb = e.__traceback__
    found = "the function"
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_globals.get("__name__")
        if not K.is_library_module(name) and "/treegrad/" not in frame.f_code.co_filename:
            found = f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found


def abstract_argument_error(api: str, args: Any, e: BaseException, call: bool) -> Exception | None:
    """The error for a function that failed on an argument holding a
    `jax.ShapeDtypeStruct` (a model from `jax.eval_shape`), or None.

    Such a leaf is no array, so the function gets it as static data, as `jax.jit`
    would refuse it: the user's code then fails far from the cause (`'ShapeDtypeStruct'
    object has no attribute 'T'`). An unused one is fine, so only a failure is explained.
    `call`: `args` is tg.jit's `(positional, keywords)`, not a tuple of arguments.
    """
    if not isinstance(e, (AttributeError, TypeError)):
        return None
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    where = next((p for p, x in flat if isinstance(x, jax.ShapeDtypeStruct)), None)
    if where is None:
        return None
    key, *rest = where[1:] if call else where
    arg = key.key if isinstance(key, jax.tree_util.DictKey) else getattr(key, "idx", key)
    at = f" at '{path_str(tuple(rest))}'" if rest else ""
    return TypeError(
        f"{api}: the function failed ({type(e).__name__}: {e}); its argument {arg!r} holds "
        f"a jax.ShapeDtypeStruct{at}, which has a shape and dtype but no values (a model "
        "from jax.eval_shape?). Pass real arrays: build the model, or tg.load a checkpoint "
        "into the abstract one."
    )
