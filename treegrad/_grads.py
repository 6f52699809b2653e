"""Implicit mode's gradients: `Grads`, looked up by the parameter array itself.

A `Grads` maps each registered parameter (by identity) to its gradient. It only
ever holds the registered parameters, so there are no internal or spurious keys,
and a lookup with an array that is not registered explains why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._jaxpr import is_tracer
from ._params import _names
from ._tree import describe_leaf, path_str, picker
from ._typing import GradientTree, Model


def _combine(a: Any, b: Any, op: Callable[[Any, Any], Any]) -> Any:
    if a is None:
        return None if b is None else op(jnp.zeros_like(b), b)
    if b is None:
        return op(a, jnp.zeros_like(a))
    return op(a, b)


def _check_scalar(c: Any, how: str) -> None:
    if isinstance(c, (int, float, complex, np.generic)) and not isinstance(c, bool):
        return
    if isinstance(c, (np.ndarray, jax.Array)):
        if c.ndim == 0:
            return
        # Broadcast into every gradient, a mask meant for one parameter would scale
        # the others' columns: per-parameter work is what map is for.
        raise TypeError(
            f"Grads can be {how} by a scalar, got a {describe_leaf(c)} array, which would "
            "broadcast into every gradient. For one parameter, use "
            "grads.map(fn) or work on grads[p] (e.g. grads.map(lambda g: g * mask if "
            "g.shape == mask.shape else g))."
        )
    raise TypeError(
        f"Grads can be {how} by a number or a 0-d array, got a {type(c).__name__} ({c!r:.40})."
    )


def _scaler(c: Any, op: Callable[[Any, Any], Any]) -> Callable[[Any], Any]:
    """`g -> op(g, c)` that keeps each gradient's dtype, as a Python number does.

    A scale is not meant to change precision, but JAX promotes against a numpy
    scalar or a 0-d array by its dtype: `bfloat16_grad * np.float32(0.5)` became
    float32 (and the weak-typed gradient of a `jnp.asarray(2.0)` parameter times
    an `np.float16`, float16), and the optimiser's moments then changed dtype too.
    So a real scale takes the gradient's dtype; only a complex scale of a real
    gradient still promotes it to complex (that is what the user asked for).
    """
    if not isinstance(c, (np.generic, np.ndarray, jax.Array)):
        return lambda g: op(g, c)  # a Python number: weakly typed already
    complex_c = jnp.issubdtype(c.dtype, jnp.complexfloating)
    cast: dict[Any, Any] = {}  # one conversion per gradient dtype

    def scaled(g: Any) -> Any:
        dtype = g.dtype
        if not jnp.issubdtype(dtype, jnp.inexact) or (
            complex_c and not jnp.issubdtype(dtype, jnp.complexfloating)
        ):
            return op(g, c)
        if dtype not in cast:
            cast[dtype] = c.astype(dtype)
        return op(g, cast[dtype])

    return scaled


def _same_kind(a: Any, b: Any) -> bool:
    """Whether two arrays could be one parameter before and after an update."""
    return bool(a.shape == b.shape and a.dtype == b.dtype)


class Grads(Mapping[Any, Any]):
    """Gradients looked up by the parameter array itself: `grads[W]`.

    A read-only mapping from each registered parameter (by identity) to its
    gradient, or `None` where the loss does not depend on it. Only registered
    parameters appear.

    Examples:
        >>> import jax, jax.numpy as jnp, treegrad as tg
        >>> W = jnp.ones((3, 5)); b = jnp.zeros(3)
        >>> x = jnp.array([3.0, 1, 0, 1, 2])
        >>> grads = tg.gradient(lambda: jnp.sum(W @ x + b), tg.Params([W, b]))
        >>> grads[W][0]
        Array([3., 1., 0., 1., 2.], dtype=float32)
        >>> grads[b]
        Array([1., 1., 1.], dtype=float32)
        >>> (2 * grads)[b]
        Array([2., 2., 2.], dtype=float32)
        >>> sum([grads, grads, grads])[b]  # accumulated over batches
        Array([3., 3., 3.], dtype=float32)
    """

    __slots__ = ("_grads", "_index", "_names", "_params", "_paths", "_readers")
    # numpy would otherwise take a Grads for a sequence of its keys (the parameters)
    # in `np.float32(2) * grads` and scale those; None makes it defer to __rmul__.
    __array_ufunc__ = None

    def __init__(
        self,
        params: list[Any],
        grads: list[Any],
        paths: list[tuple[Any, ...]],
        readers: tuple[Any, ...] = (),
    ):
        self._params = params
        self._grads = grads
        # Key paths, turned into dotted names only when asked: keystr costs
        # microseconds per parameter, too much for every training step.
        self._paths = paths
        self._names: list[str] | None = None
        self._index: dict[int, int] | None = None
        # The loss functions these gradients were taken of, each with its cache entry,
        # whose guard re-reads what the function reads (`unread`).
        self._readers = readers

    @property
    def _names_list(self) -> list[str]:
        if self._names is None:
            self._names = _names(self._paths)
        return self._names

    def _lookup(self) -> dict[int, int]:
        if self._index is None:
            self._index = dict(zip(map(id, self._params), range(len(self._params)), strict=True))
        return self._index

    def __getitem__(self, p: Any) -> Any:
        i = self._lookup().get(id(p))
        if i is None:
            raise KeyError(self._missing(p))
        return self._grads[i]

    def _missing(self, p: Any) -> str:
        if not isinstance(p, (jax.Array, np.ndarray)):
            return (
                f"Grads are looked up by parameter array, got a {type(p).__name__}; "
                "use grads.named() to look them up by name."
            )
        msg = f"this {describe_leaf(p)} array is not a registered parameter of these gradients."
        same = [
            n
            for n, q in zip(self._names_list, self._params, strict=True)
            if getattr(q, "shape", None) == p.shape and getattr(q, "dtype", None) == p.dtype
        ]
        if same:
            msg += (
                f" The registered parameter {same[0]!r} has the same shape and dtype: it may "
                "have been replaced (by tg.update_, or by assigning a new array) since the "
                "gradients were taken. Parameters are tracked by identity and a new array is a "
                "new object: look gradients up with the arrays that were registered when "
                "gradient was called, or use grads.named()."
            )
        return msg

    def __contains__(self, p: object) -> bool:
        return id(p) in self._lookup()

    def __getstate__(self) -> tuple[Any, ...]:
        # Not the id index: a copy (pickle, deepcopy) has new parameter objects.
        return (self._params, self._grads, self._paths)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        params, grads, paths = state
        self._params, self._grads, self._paths = params, grads, paths
        self._readers = ()  # a copy's parameters are new objects no function reads
        self._names = None
        self._index = None  # rebuilt on the first lookup, from the new objects' ids

    def __iter__(self) -> Iterator[Any]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def named(self) -> dict[str, Any]:
        """A dict from dotted parameter path to gradient."""
        return dict(zip(self._names_list, self._grads, strict=True))

    def map(self, fn: Callable[[Any], Any]) -> Grads:
        """A new `Grads` with `fn` applied to every gradient that is not `None`."""
        grads = [None if g is None else fn(g) for g in self._grads]
        return Grads(self._params, grads, self._paths, self._readers)

    def _aligned(self, other: Grads) -> list[Any]:
        """`other`'s gradients in this one's parameter order: the same set, any order
        (Zygote's rule); a clear error naming the first difference otherwise."""
        if len(other._params) == len(self._params) and all(
            a is b for a, b in zip(self._params, other._params, strict=True)
        ):
            return other._grads
        index = other._lookup()
        at = [index.get(id(p), -1) for p in self._params]
        if len(other._params) == len(self._params) and -1 not in at:
            return [other._grads[i] for i in at]
        mine = {id(p) for p in self._params}
        only_self = [
            n for n, p in zip(self._names_list, self._params, strict=True) if id(p) not in index
        ]
        only_other = [
            n for n, p in zip(other._names_list, other._params, strict=True) if id(p) not in mine
        ]
        msg = (
            f"cannot combine Grads over different parameter sets ({len(self)} and "
            f"{len(other)} parameters)"
        )
        first = dict(zip(self._names_list, self._params, strict=True))
        second = dict(zip(other._names_list, other._params, strict=True))
        in_other = set(only_other)
        named_alike = [n for n in only_self if n in in_other]
        # One name, two arrays: the same parameter replaced between the two calls only
        # when the arrays could be one parameter's old and new value.
        replaced = [n for n in named_alike if _same_kind(first[n], second[n])]
        if replaced:
            msg += (
                f": '{replaced[0]}' is a different array in each (it was replaced, by "
                "tg.update_ or an assignment, between the two gradient calls). Combine "
                "gradients taken for the same arrays, e.g. before the update."
            )
        elif named_alike:
            n = named_alike[0]
            msg += (
                f": '{n}' is a {describe_leaf(first[n])} array in the first and a "
                f"{describe_leaf(second[n])} array in the second, not the same parameter. "
                "Take both for the same tg.params."
            )
        else:
            if only_self:
                msg += f": '{only_self[0]}' is only in the first"
            if only_other:
                msg += f"{';' if only_self else ':'} '{only_other[0]}' is only in the second"
            msg += ". Take both for the same tg.params."
        raise ValueError(msg)

    def _binary(self, other: Any, op: Callable[[Any, Any], Any]) -> Grads:
        if not isinstance(other, Grads):
            return NotImplemented
        theirs = self._aligned(other)
        grads = [_combine(a, b, op) for a, b in zip(self._grads, theirs, strict=True)]
        # One reader per program: the same loss over many batches (`sum` of their
        # gradients) would otherwise keep every batch alive, in the loss it closes over.
        mine = {id(entry) for entry, _ in self._readers}
        readers = self._readers + tuple(r for r in other._readers if id(r[0]) not in mine)
        return Grads(self._params, grads, self._paths, readers)

    def __add__(self, other: Any) -> Grads:
        return self._binary(other, jnp.add)

    def __radd__(self, other: Any) -> Grads:
        # `sum(list_of_grads)` starts from the integer 0 (Python's `sum`): accumulating
        # the gradients of several batches is the common use.
        if type(other) is int and other == 0:
            return self
        return NotImplemented

    def __sub__(self, other: Any) -> Grads:
        return self._binary(other, jnp.subtract)

    def __mul__(self, c: Any) -> Grads:
        if isinstance(c, Grads):
            return NotImplemented
        _check_scalar(c, "multiplied")
        return self.map(_scaler(c, jnp.multiply))

    __rmul__ = __mul__

    def __truediv__(self, c: Any) -> Grads:
        if isinstance(c, Grads):
            return NotImplemented
        _check_scalar(c, "divided")
        return self.map(_scaler(c, jnp.divide))

    def __neg__(self) -> Grads:
        return self.map(jnp.negative)

    def __pos__(self) -> Grads:
        return self

    def __setitem__(self, p: Any, value: Any) -> None:
        raise TypeError(
            "Grads is read-only: make a new one with grads.map(fn) or arithmetic "
            "(grads * 0.5, g1 + g2), or take the tree with grads.to_tree(model)."
        )

    def leaves_for(self, leaves: list[Any]) -> list[Any]:
        """The gradient for each of `leaves` (a flattened model), as `to_tree` places them."""
        index = self._lookup()
        grads = self._grads
        ids = list(map(id, leaves))
        at: list[Any] = list(map(index.get, ids))
        if len(set(ids)) == len(ids) and id(None) not in map(id, at):
            # No tied leaves and every leaf a parameter (the common case): in C.
            return picker(at)(grads)
        seen: set[int] = set()
        out: list[Any] = []
        for leaf in leaves:
            i = index.get(id(leaf))
            if i is None or id(leaf) in seen:
                out.append(None)
            else:
                seen.add(id(leaf))
                out.append(grads[i])
        return out

    def unread(self, changed: dict[int, Any], given: frozenset[int]) -> list[tuple[str, str, Any]]:
        """After `tg.update_` rebound parameters inside a Params' containers (`changed`:
        old array's id to new array): the parameters the loss reads only where the update
        did not reach, so that it would keep reading the old array and never train, each
        as (its name, where the loss reads it, the old array).

        The Params of Flux's `Params([W, b])` with `W` and `b` globals: Julia's update
        mutates the arrays; jax arrays are immutable, so the update rebinds them in the
        list the Params holds, which the loss does not read. `given`: the ids of arrays
        a compiled function being traced was given as arguments (`_programs.LINKED`),
        which each call gives afresh: never stale.
        """
        for entry, roots in self._readers:
            read = entry.guard.check(*roots)
            if read is None:  # the function changed since: what it reads is not known
                continue
            if set(map(id, read)).issuperset(map(id, changed.values())):
                continue  # it reads every new array: the usual case, in C
            where = {id(a): k for k, a in enumerate(read)}
            found = []
            for name, p in zip(self._names_list, self._params, strict=True):
                new = changed.get(id(p))
                k = where.get(id(p))
                stale = k is not None and id(new) not in where and id(p) not in given
                if new is not None and stale:
                    found.append((name, entry.names[k], p))
            if found:
                return found
        return []

    def to_tree(self, model: Model) -> GradientTree:
        """The explicit gradient tree for `model`: what `tg.gradient(f, model)` gives.

        Leaves of `model` that are registered parameters get their gradient (a
        tied weight at its first occurrence, `None` at the others, so that the
        optimiser, which sums over occurrences, takes the same step); every
        other leaf gets `None`.
        """
        leaves, treedef = jax.tree_util.tree_flatten(model)
        out = self.leaves_for(leaves)
        index = self._lookup()
        if self._params and not any(id(leaf) in index for leaf in leaves):
            raise ValueError(
                "Grads.to_tree: none of the model's arrays is one of the registered parameters "
                "of these gradients. Pass the model whose tg.params the gradients were taken "
                "for; after tg.update_ replaced its arrays, take new gradients."
            )
        held = set(map(id, leaves))
        if not all(map(held.__contains__, map(id, self._params))):
            self._check_not_replaced(model)
        return jax.tree_util.tree_unflatten(treedef, out)

    def _check_not_replaced(self, model: Model) -> None:
        """Refuse a model in which a registered parameter was replaced, at its own path, by
        an array of its shape and dtype: its gradient would silently become None there, and
        the optimiser would skip it (tg.update_ with these Grads refuses the same case).

        A parameter merely absent (`to_tree(model.l1)` of gradients for the whole model, an
        extra array added to the Params) is fine: its path names nothing in `model`.
        """
        index = self._lookup()
        at = {
            path_str(p): leaf
            for p, leaf in jax.tree_util.tree_flatten_with_path(model)[0]
            if isinstance(leaf, (jax.Array, np.ndarray))
        }
        for name, p in zip(self._names_list, self._params, strict=True):
            now = at.get(name)
            if now is not None and now is not p and id(now) not in index and _same_kind(now, p):
                raise ValueError(
                    f"Grads.to_tree: the model's '{name}' is not the array the gradients were "
                    f"taken for: it was replaced (by tg.update_ or an assignment) since, so its "
                    "gradient would silently be None and the optimiser would skip it. Take the "
                    "gradients again after changing the model, then call to_tree."
                )

    def __repr__(self) -> str:
        lines = [f"Grads({len(self)} parameters)"]
        for n, p, g in zip(self._names_list, self._params, self._grads, strict=True):
            if g is None:
                norm = "None"
            elif isinstance(g, jax.Array) and not is_tracer(g) and g.is_deleted():
                # repr must not raise: a gradient donated to a jax.jit (or deleted) has no norm.
                norm = "deleted"
            else:
                norm = f"norm {float(jnp.linalg.norm(jnp.ravel(g))):.4g}"
            lines.append(f"  {n}: {describe_leaf(p)}  grad {norm}")
        return "\n".join(lines)

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__
