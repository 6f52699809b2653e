"""`tg.jit`: compile a function of models and arrays with the shared engine."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import _engine as E


class Jitted:
    """A function compiled by `tg.jit`; call it like the original."""

    def __init__(self, fn: Callable[..., Any]):
        if not callable(fn):
            raise TypeError(f"tg.jit expects a function, got {type(fn).__name__}")
        self.__wrapped__ = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.__wrapped__
        names = tuple(kwargs)
        flat = E.Flat(fn, (*args, *kwargs.values()))
        key = (E.CALL, names, flat.key)
        entry = E.lookup(key)
        if entry is None:
            entry = E.Entry(E.CALL, flat, (), api="tg.jit", options=(names,))
            E.store(key, entry)
        return E.execute(key, entry, flat.dyn, fn).value()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Decorating a method: bind the instance as the first (traced) argument.
        return self if obj is None else functools.partial(self, obj)


def jit(fn: Callable[..., Any]) -> Jitted:
    """Compile a function of models, arrays and other data with XLA.

    Array leaves of the arguments (and of everything the function captures from
    closures and globals) are traced; everything else is static and part of the
    cache key. A training step written with `tg.withgradient` and `tg.update`
    inside `tg.jit` compiles to one XLA computation. Inside, use the pure
    `tg.update` and return the new model: in-place changes made while tracing
    are not seen outside.

    Arguments:
        fn: the function to compile.

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
    return Jitted(fn)
