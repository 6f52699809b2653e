"""What a compiled program returns, and how it is unpacked after the call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._fasttree import TAKE, Shape
from ._grads import Grads
from ._params import Params
from ._paths import get_at, put_at
from ._tree import functor, same_structure, unique_by_id

Path = tuple[Any, ...]


class _Dyn:
    """Marks an array leaf among a tree's static leaves."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<array>"


DYN = _Dyn()


def uniq(xs: list[Any]) -> tuple[list[Any], tuple[int, ...] | None]:
    """`xs` without repeated objects, and where each came from (None: no repeats, the
    common case, checked at C speed on every call)."""
    if len(set(map(id, xs))) == len(xs):
        return xs, None
    out, slots = unique_by_id(xs)
    return out, tuple(slots)


def expand(values: Sequence[Any], slots: tuple[int, ...] | None) -> list[Any]:
    """Undo `uniq`: one value per original position."""
    return list(values) if slots is None else [values[s] for s in slots]


class _Aux:
    """Non-array parts of an output, carried through `jax.jit` as static data."""

    __slots__ = ("_shape", "shared", "slots", "statics", "treedef")

    def __init__(
        self,
        treedef: Any,
        statics: tuple[Any, ...],
        slots: tuple[int, ...] | None = None,
        shared: tuple[tuple[Path, Path], ...] | None = None,
    ):
        self.treedef = treedef
        self.statics = statics
        # For an output holding one array at several places (a tied weight): which of
        # the distinct arrays each place gets (see `uniq`), so the places are one
        # object again after the call. None: every array is at one place.
        self.slots = slots
        # Likewise for a sub-model (a Module, list or dict) at several places: the
        # path of each repeat and of its first place (see `shared_nodes`).
        self.shared = shared
        self._shape: Shape | None = None

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        # Generated code (built on first use): what tree_unflatten gives, with the
        # static leaves in place, without a Python callback per Module.
        if self._shape is None:
            self._shape = Shape(self.treedef, spec=[TAKE if s is DYN else s for s in self.statics])
        if self.slots is None and self.shared is None:  # the usual case
            return self._shape.unflatten(arrays)
        tree = self._shape.unflatten(expand(arrays, self.slots))
        for repeat, first in self.shared or ():
            tree = put_at(tree, repeat, get_at(tree, first))
        return tree

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Aux)
            and same_structure(self.treedef, other.treedef)
            and self.slots == other.slots
            and self.shared == other.shared
            and len(self.statics) == len(other.statics)
            and all(a is b or _same(a, b) for a, b in zip(self.statics, other.statics, strict=True))
        )

    def __hash__(self) -> int:
        return hash(self.treedef)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


jax.tree_util.register_pytree_node(_Aux, lambda a: ((), a), lambda a, _: a)


class Packed:
    """A traced function's output as returned by `jax.jit`.

    When every leaf of the output is an array, the output tree itself is the
    payload (jax rebuilds it in C++); otherwise the arrays travel flat and the
    static leaves ride in `aux`.
    """

    __slots__ = ("aux", "payload")

    def __init__(self, payload: Any, aux: _Aux | None):
        self.payload = payload
        self.aux = aux

    def value(self) -> Any:
        return self.payload if self.aux is None else self.aux.rebuild(self.payload)


jax.tree_util.register_pytree_node(
    Packed, lambda p: ((p.payload,), p.aux), lambda a, c: Packed(c[0], a)
)


def split_output(out: Any) -> tuple[list[Any], _Aux]:
    leaves, treedef = jax.tree_util.tree_flatten(out)
    arrays = []
    statics = []
    for leaf in leaves:
        # A numpy scalar (np.float32(0.5)) is static data where it comes in (like a
        # Python number: not differentiable, keyed by value), so it goes out as it is,
        # as uncompiled: made a jax.Array it would turn differentiable in the caller's
        # model after one compiled step, and the next `tg.update` would refuse it.
        if isinstance(leaf, (jax.Array, np.ndarray)):
            arrays.append(leaf)
            statics.append(DYN)
        else:
            if type(leaf) is Grads:
                raise _grads_out()
            if type(leaf) is Params:
                raise _params_out()
            statics.append(leaf)
    return arrays, _Aux(treedef, tuple(statics), shared=shared_nodes(out))


def shared_nodes(out: Any) -> tuple[tuple[Path, Path], ...] | None:
    """For each node object (a Module, list, dict or foreign pytree node; not a tuple)
    found at several places of `out`: the key path of each repeat and of its first
    place, in flatten order. None when nothing repeats: the common case.

    jax rebuilds an output tree node by node, so a sub-model shared by two
    places would come back as two objects; `_Aux.rebuild` shares it again.
    """
    first: dict[int, Path] = {}
    pairs: list[tuple[Path, Path]] = []

    def go(node: Any, path: Path) -> None:
        level = functor(node)
        if level is None:
            return
        if node is not None and not isinstance(node, tuple):
            prior = first.get(id(node))
            if prior is not None:
                pairs.append((path, prior))
                return
            first[id(node)] = path
        for key, child in level[0]:
            go(child, (*path, key))

    go(out, ())  # `out` holds every node while this runs, so ids stay unique
    return tuple(pairs) or None


def _grads_out() -> TypeError:
    # A Grads is keyed by the parameter arrays themselves, which are traced inside a
    # compiled function: carried out as static data it would hold tracers.
    return TypeError(
        "tg.jit: the compiled function returns a tg.Grads, which is keyed by the parameter "
        "arrays themselves, traced inside the function. Return grads.to_tree(model) (the "
        "explicit gradient tree) or grads.named() instead, or apply the step inside the "
        "compiled function with tg.update_(state, ps, grads)."
    )


def _params_out() -> TypeError:
    # Params holds the arrays themselves, traced inside the compiled function: carried
    # out as static data it would hand back tracers, and every gradient would be None.
    return TypeError(
        "tg.jit: the compiled function returns a tg.Params, which holds the arrays "
        "themselves, traced inside the function. Return the model and call "
        "tg.params(model) on the returned model, outside the compiled function."
    )


def split_unique(out: Any) -> tuple[list[Any], _Aux]:
    """`split_output` with each array once: jax would return a tied weight's places
    as separate arrays, untying it in the caller's model."""
    arrays, aux = split_output(out)
    unique, aux.slots = uniq(arrays)
    return unique, aux


def pack(out: Any) -> Packed:
    arrays, aux = split_unique(out)
    if aux.slots is None and aux.shared is None and all(s is DYN for s in aux.statics):
        return Packed(out, None)
    return Packed(arrays, aux)


class Written:
    """Arrays the traced function rebound in its captured places, to write back after a call."""

    __slots__ = ("index", "places", "values")

    def __init__(self, places: tuple[int, ...], index: tuple[int, ...], values: list[Any]):
        self.places = places
        self.index = index
        self.values = values

    @classmethod
    def of(cls, written: dict[int, Any]) -> Written:
        places = tuple(sorted(written))
        # A tied weight rebound at two places is one new array: one output, one object after.
        values, slots = uniq([written[p] for p in places])
        index = tuple(range(len(values))) if slots is None else slots
        return cls(places, index, values)


jax.tree_util.register_pytree_node(
    Written,
    lambda w: (w.values, (w.places, w.index)),
    lambda aux, values: Written(aux[0], aux[1], list(values)),
)


def scalar_loss(value: Any, api: str) -> Any:
    """Check that `value` is a real scalar and return it as an array."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return jnp.asarray(value, dtype=float)
    if not isinstance(value, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            f"{api}: the function must return a real scalar, but it returned a "
            f"{type(value).__name__}. Return a scalar loss (reduce with jnp.sum or jnp.mean); "
            "for the derivatives of a vector output use tg.jacobian."
        )
    if value.shape != ():
        raise TypeError(
            f"{api}: the function must return a real scalar, but it returned an array of "
            f"shape {value.shape}. Reduce it to a scalar (jnp.sum, jnp.mean), or use "
            "tg.jacobian for the derivatives of a vector output."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"{api}: the function must return a real floating-point scalar, but it returned "
            f"dtype {value.dtype}. Cast the loss to a float (or use tg.jacobian for a complex "
            "output)."
        )
    return value


def conj(g: Any) -> Any:
    # Steepest ascent for complex parameters (API.md §1): df/dx + i df/dy, the
    # conjugate of what jax returns, so that `p - lr * g` and optax descend.
    return jnp.conj(g) if jnp.iscomplexobj(g) else g
