"""Implicit mode's identity registry: `Params` in, `Grads` out.

A `Params` is an ordered set of parameter arrays keyed by object identity, like
Zygote's `Params`. It remembers where it got them: built from a model, a dict or
a list, it re-reads that container at each call, so it follows `tg.update_` and
user assignments; built from standalone arrays, it holds those objects.

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

from ._module import Module
from ._paths import set_at
from ._tree import describe_leaf, is_differentiable, path_str


class NoGradientWarning(UserWarning):
    """Warned when the loss depends on none of the registered parameters.

    Usually the computation was done outside the function passed to
    `tg.gradient`. Every gradient is then `None`.

    Examples:
        >>> import warnings, jax.numpy as jnp, treegrad as tg
        >>> w = jnp.ones(2)
        >>> out = jnp.sum(w)  # computed outside
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     grads = tg.gradient(lambda: out, tg.Params([w]))
        >>> caught[0].category is tg.NoGradientWarning, grads[w] is None
        (True, True)
    """


class NoGradientError(ValueError):
    """Raised instead of `NoGradientWarning` when `strict=True`.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> w = jnp.ones(2)
        >>> try:
        ...     tg.gradient(lambda: jnp.ones(()), tg.Params([w]), strict=True)
        ... except tg.NoGradientError:
        ...     print("no gradient")
        no gradient
    """


def _restricted(node: Any) -> bool:
    return isinstance(node, Module) and type(node).__trainable__ is not None


def trainable_leaves_with_path(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """(path, leaf) for every leaf the optimiser may train, respecting `__trainable__`."""
    out: list[tuple[tuple[Any, ...], Any]] = []

    def walk(node: Any, prefix: tuple[Any, ...]) -> None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=_restricted)[0]:
            full = prefix + path
            if _restricted(leaf) and not (leaf is node and not path):
                walk(leaf, full)
            elif _restricted(leaf):
                for name in type(leaf).__trainable__ or ():
                    if name in leaf.__dict__:
                        walk(leaf.__dict__[name], (*full, jax.tree_util.GetAttrKey(name)))
            else:
                out.append((full, leaf))

    walk(tree, ())
    return out


class Params:
    """An ordered identity set of parameters: `tg.Params(xs)`, same as `tg.params(xs)`.

    Arguments:
        xs: an array, a list or tuple of arrays, a `tg.Module`, or any pytree or
            mutable container (dict, list) holding arrays. Floating and complex
            `jax.Array` leaves are collected, each distinct object once (a tied
            weight appears once), respecting `__trainable__`.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> W, b = jnp.ones((3, 5)), jnp.zeros(3)
        >>> ps = tg.Params([W, b])
        >>> len(ps), W in ps, jnp.ones(3) in ps
        (2, True, False)
        >>> list(ps.named())
        ['0', '1']
    """

    __slots__ = ("_cache", "_source", "_standalone")

    def __init__(self, xs: Any):
        if isinstance(xs, Params):
            xs = xs.source
        if isinstance(xs, np.ndarray) and not isinstance(xs, jax.Array):
            raise TypeError(
                "tg.Params got a numpy array; parameters are tracked by identity, and JAX "
                "copies a numpy array into a new object whenever it is used, so gradients "
                "could never be found for it. Convert it first: W = jnp.asarray(W)."
            )
        self._standalone = isinstance(xs, jax.Array)
        self._source = xs
        self._cache: tuple[Any, list[int], list[tuple[Any, ...]]] | None = None
        _convert_numpy(xs)
        if not self._standalone and not trainable_leaves_with_path(xs):
            # An empty Params is almost always a mistake (a model with no float
            # arrays, or integer data passed by accident).
            raise ValueError(
                f"tg.Params found no floating-point arrays in the {type(xs).__name__} it was given."
            )

    def _read(self) -> tuple[list[Any], list[tuple[Any, ...]]]:
        """The current parameter arrays and the path of each, in order."""
        if self._standalone:
            return [self._source], [()]
        leaves, treedef = jax.tree_util.tree_flatten(self._source)
        cache = self._cache
        if cache is None or cache[0] != treedef:
            cache = self._rescan(leaves, treedef)
        _, index, paths = cache
        arrays = [leaves[i] for i in index]
        if len({id(a) for a in arrays}) != len(arrays):
            # Ties can change without changing the structure (a user tying two
            # weights by assignment); de-duplicate by identity, first wins.
            seen: set[int] = set()
            keep = [k for k, a in enumerate(arrays) if not (id(a) in seen or seen.add(id(a)))]  # type: ignore[func-returns-value]
            return [arrays[k] for k in keep], [paths[k] for k in keep]
        return arrays, paths

    def _rescan(
        self, leaves: list[Any], treedef: Any
    ) -> tuple[Any, list[int], list[tuple[Any, ...]]]:
        position = {id(leaf): i for i, leaf in reversed(list(enumerate(leaves)))}
        trainable = trainable_leaves_with_path(self._source)
        index: list[int] = []
        paths: list[tuple[Any, ...]] = []
        seen: set[int] = set()
        for path, leaf in trainable:
            if is_differentiable(leaf) and id(leaf) not in seen:
                seen.add(id(leaf))
                index.append(position[id(leaf)])
                paths.append(path)
        self._cache = (treedef, index, paths)
        return self._cache

    def arrays(self) -> list[Any]:
        return self._read()[0]

    def __len__(self) -> int:
        return len(self.arrays())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.arrays())

    def __contains__(self, x: object) -> bool:
        return any(a is x for a in self.arrays())

    def named(self) -> dict[str, Any]:
        """A dict from dotted path (`"l1.weight"`, `"layers.0.bias"`) to array."""
        arrays, paths = self._read()
        return {_name(p, k): a for k, (p, a) in enumerate(zip(paths, arrays, strict=True))}

    @property
    def source(self) -> Any:
        """The container (or array) the parameters are read from."""
        return self._source

    def __repr__(self) -> str:
        items = ", ".join(f"{n}: {describe_leaf(a)}" for n, a in self.named().items())
        return f"Params([{items}])"


def _name(path: tuple[Any, ...], k: int) -> str:
    return path_str(path) if path else str(k)


def _convert_numpy(tree: Any) -> None:
    """Replace float numpy leaves by jax.Arrays where they live (identity needs it)."""
    if isinstance(tree, (np.ndarray, jax.Array)):
        return
    for path, leaf in trainable_leaves_with_path(tree):
        if isinstance(leaf, np.ndarray) and np.issubdtype(leaf.dtype, np.inexact):
            set_at(tree, path, jnp.asarray(leaf))


def params(xs: Any) -> Params:
    """The parameters of a model: the same as `tg.Params(xs)`.

    Arguments:
        xs: a model, a container of arrays, or an array.

    Returns:
        A `tg.Params`.

    Examples:
        >>> import jax, treegrad as tg
        >>> from treegrad import nn
        >>> model = nn.Dense(2, 3, key=jax.random.key(0))
        >>> list(tg.params(model).named())
        ['weight', 'bias']
    """
    return Params(xs)


def _combine(a: Any, b: Any, op: Callable[[Any, Any], Any]) -> Any:
    if a is None:
        return None if b is None else op(jnp.zeros_like(b), b)
    if b is None:
        return op(a, jnp.zeros_like(a))
    return op(a, b)


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
    """

    __slots__ = ("_grads", "_index", "_names", "_params", "_paths")

    def __init__(self, params: list[Any], grads: list[Any], paths: list[tuple[Any, ...]]):
        self._params = params
        self._grads = grads
        # Key paths, turned into dotted names only when asked: keystr costs
        # microseconds per parameter, too much for every training step.
        self._paths = paths
        self._names: list[str] | None = None
        self._index: dict[int, int] | None = None

    @property
    def _names_list(self) -> list[str]:
        if self._names is None:
            self._names = [_name(p, k) for k, p in enumerate(self._paths)]
        return self._names

    def _lookup(self) -> dict[int, int]:
        if self._index is None:
            self._index = {id(p): i for i, p in enumerate(self._params)}
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

    def __iter__(self) -> Iterator[Any]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def named(self) -> dict[str, Any]:
        """A dict from dotted parameter path to gradient."""
        return dict(zip(self._names_list, self._grads, strict=True))

    def map(self, fn: Callable[[Any], Any]) -> Grads:
        """A new `Grads` with `fn` applied to every gradient that is not `None`."""
        return Grads(self._params, [None if g is None else fn(g) for g in self._grads], self._paths)

    def _check_same(self, other: Grads) -> None:
        if len(other._params) != len(self._params) or any(
            a is not b for a, b in zip(self._params, other._params, strict=True)
        ):
            raise ValueError(
                "cannot combine Grads over different parameter sets "
                f"({len(self)} vs {len(other)} parameters, or different arrays)."
            )

    def _binary(self, other: Any, op: Callable[[Any, Any], Any]) -> Grads:
        if not isinstance(other, Grads):
            return NotImplemented
        self._check_same(other)
        grads = [_combine(a, b, op) for a, b in zip(self._grads, other._grads, strict=True)]
        return Grads(self._params, grads, self._paths)

    def __add__(self, other: Any) -> Grads:
        return self._binary(other, jnp.add)

    def __sub__(self, other: Any) -> Grads:
        return self._binary(other, jnp.subtract)

    def __mul__(self, c: Any) -> Grads:
        if isinstance(c, Grads):
            return NotImplemented
        return self.map(lambda g: g * c)

    __rmul__ = __mul__

    def __truediv__(self, c: Any) -> Grads:
        if isinstance(c, Grads):
            return NotImplemented
        return self.map(lambda g: g / c)

    def __neg__(self) -> Grads:
        return self.map(jnp.negative)

    def leaves_for(self, leaves: list[Any]) -> list[Any]:
        """The gradient for each of `leaves` (a flattened model), as `to_tree` places them."""
        index = self._lookup()
        grads = self._grads
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

    def to_tree(self, model: Any) -> Any:
        """The explicit gradient tree for `model`: what `tg.gradient(f, model)` gives.

        Leaves of `model` that are registered parameters get their gradient (a
        tied weight at its first occurrence, `None` at the others, so that the
        optimiser, which sums over occurrences, takes the same step); every
        other leaf gets `None`.
        """
        leaves, treedef = jax.tree_util.tree_flatten(model)
        return jax.tree_util.tree_unflatten(treedef, self.leaves_for(leaves))

    def __repr__(self) -> str:
        lines = [f"Grads({len(self)} parameters)"]
        for n, p, g in zip(self._names_list, self._params, self._grads, strict=True):
            norm = "None" if g is None else f"norm {float(jnp.linalg.norm(jnp.ravel(g))):.4g}"
            lines.append(f"  {n}: {describe_leaf(p)}  grad {norm}")
        return "\n".join(lines)

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__
