"""`tg.jit`: compile a function of models and arrays with the shared engine."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import _engine as E


class Jitted:
    """A function compiled by `tg.jit`; call it like the original."""

    def __init__(self, fn: Callable[..., Any], donate_argnums: int | tuple[int, ...] = ()):
        if not callable(fn):
            raise TypeError(f"tg.jit expects a function, got {type(fn).__name__}")
        self.__wrapped__ = fn
        self._donate = (
            (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        )
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.__wrapped__
        names = tuple(kwargs)
        flat = E.Flat(fn, (*args, *kwargs.values()))
        if self._donate:
            return self._call_donating(fn, flat, names, len(args))
        key = (E.CALL, names, flat.key)
        entry = E.lookup(key)
        if entry is None:
            entry = E.Entry(E.CALL, flat, (), api="tg.jit", options=(names,))
            E.store(key, entry)
        return E.execute(key, entry, flat.dyn, fn).value()

    def _call_donating(self, fn: Any, flat: E.Flat, names: tuple[str, ...], n_args: int) -> Any:
        # Inputs are de-duplicated by identity first: a tied weight is one
        # buffer, and donating one buffer twice is an error in jax. A buffer is
        # donated only if every place it is read from is a donated argument.
        owner: list[int] = []  # per dynamic leaf: its top-level argument, or -1 (closure)
        statics = flat.statics
        owner.extend(-1 for s in statics[: flat.n_cl] if s is E.DYN)
        offset = flat.n_cl
        for i, child in enumerate(flat.a_def.children()):  # type: ignore[attr-defined]
            n = child.num_leaves
            owner.extend(i for s in statics[offset : offset + n] if s is E.DYN)
            offset += n
        index: dict[int, int] = {}
        uniq: list[Any] = []
        slots: list[int] = []
        donated: dict[int, bool] = {}
        for a, who in zip(flat.dyn, owner, strict=True):
            j = index.get(id(a))
            if j is None:
                j = index[id(a)] = len(uniq)
                uniq.append(a)
            slots.append(j)
            ok = 0 <= who < n_args and who in self._donate
            donated[j] = donated.get(j, True) and ok
        donate = tuple(j for j, ok in donated.items() if ok)
        key = (E.CALL, names, flat.key, tuple(slots), donate)
        entry = E.lookup(key)
        if entry is None:
            entry = E.Entry(
                E.CALL, flat, (), api="tg.jit", options=(names,), slots=tuple(slots), donate=donate
            )
            E.store(key, entry)
        return E.execute(key, entry, uniq, fn).value()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Decorating a method: bind the instance as the first (traced) argument.
        return self if obj is None else functools.partial(self, obj)


def jit(fn: Callable[..., Any] | None = None, *, donate_argnums: int | tuple[int, ...] = ()) -> Any:
    """Compile a function of models, arrays and other data with XLA.

    Array leaves of the arguments (and of everything the function captures from
    closures and globals) are traced; everything else is static and part of the
    cache key. A training step written with `tg.withgradient` and `tg.update`
    inside `tg.jit` compiles to one XLA computation. Inside, use the pure
    `tg.update` and return the new model: in-place changes made while tracing
    are not seen outside.

    Arguments:
        fn: the function to compile.
        donate_argnums: positional arguments whose buffers XLA may reuse for
            the outputs (the old model and optimiser state of a training step),
            so a large model is not held twice. Donated arrays are deleted:
            only donate what you will not read again. Tied weights are
            de-duplicated first, and a buffer also read from another argument
            or the closure is not donated.

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
    if fn is None:
        return functools.partial(jit, donate_argnums=donate_argnums)
    return Jitted(fn, donate_argnums)
