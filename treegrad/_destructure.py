"""`tg.destructure`: a model's trainable arrays as one vector, and the way back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp

from ._layout import keep
from ._optbuild import shares_nodes, trainable_slots
from ._optim import _source
from ._params import Params
from ._tree import tree_map_shared


def destructure(model: Any) -> tuple[jax.Array, Any]:
    """Flatten a model's trainable parameters into one vector, and a way back.

    Arguments:
        model: any model, or a `tg.Params` (its model is used; an array removed
            from the Params is left out of the vector and kept by `rebuild`).

    Returns:
        `(flat, rebuild)`: `flat` concatenates every trainable floating-point
        array, a tied array once; `rebuild(v)` returns a copy of `model` with
        those arrays taken from `v` (differentiable, so `jax.grad` flows
        through it), tied arrays and shared sub-models shared again.
        `rebuild` is a `jax.tree_util.Partial`, a pytree holding the model's
        arrays, so it can be passed to `jax.jit` as an argument.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> flat, rebuild = tg.destructure({"w": jnp.ones((2, 2)), "b": jnp.zeros(2)})
        >>> flat.shape
        (6,)
        >>> rebuild(flat * 2)["w"]
        Array([[2., 2.],
               [2., 2.]], dtype=float32)
    """
    # A Params' own arrays: one removed from it (`ps.remove(model.emb)`) is not a
    # parameter, so it is not in the vector and `rebuild` leaves it as it is.
    among = model if isinstance(model, Params) else None
    model = _source(model)
    leaves, treedef, slots, uniq = trainable_slots(model, among, "tg.destructure")
    flat, unravel = jax.flatten_util.ravel_pytree(uniq)

    def check(v: Any) -> Any:
        if getattr(v, "shape", None) != flat.shape:
            raise ValueError(
                f"destructure's rebuild expects a vector of shape {flat.shape}, got "
                f"{getattr(v, 'shape', type(v).__name__)}"
            )
        if jnp.iscomplexobj(v) and not jnp.iscomplexobj(flat):
            raise TypeError(
                f"destructure's rebuild got a complex vector ({v.dtype}) for a real model: "
                "its imaginary part would be dropped. Pass jnp.real(v) if that is meant."
            )
        # Each array keeps its own dtype, whatever the vector's (as Flux's destructure):
        # an int vector must not make the parameters int (they would get no gradient).
        return v if v.dtype == flat.dtype else v.astype(flat.dtype)

    def parts(v: Any, uniq: list[Any]) -> Sequence[Any]:
        # Each array back on its own sharding: the pieces of `v` are slices of
        # one vector, which XLA lays out as it likes.
        pieces = unravel(check(v))
        return [keep(x.astype(old.dtype), old) for x, old in zip(pieces, uniq, strict=True)]

    # `rebuild` is a jax.tree_util.Partial: the model's arrays it reads are its pytree
    # children, so a function differentiated or compiled through it (and jax.jit given
    # it as an argument) takes them as inputs, not as constants hidden in a closure.
    if shares_nodes(model, leaves):  # tied weights, shared sub-models (with arrays or not)

        def rebuild_shared(model: Any, uniq: list[Any], v: Any) -> Any:
            # By position, then by object: under jax.jit the model's leaves arrive as
            # distinct tracers (one per place), outside it a tied array is one object.
            new = parts(v, uniq)
            at = jax.tree_util.tree_leaves(model)
            by_id = {id(leaf): leaf if s < 0 else new[s] for s, leaf in zip(slots, at, strict=True)}
            return tree_map_shared(lambda leaf: by_id.get(id(leaf), leaf), model)

        return flat, jax.tree_util.Partial(rebuild_shared, model, uniq)

    def rebuild(leaves: list[Any], uniq: list[Any], v: Any) -> Any:
        new = parts(v, uniq)
        return treedef.unflatten(
            [leaf if s < 0 else new[s] for s, leaf in zip(slots, leaves, strict=True)]
        )

    return flat, jax.tree_util.Partial(rebuild, leaves, uniq)
