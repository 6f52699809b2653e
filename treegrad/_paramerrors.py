"""What implicit mode warns of and refuses, with the messages that say why and how to fix
it: a loss that reads none of the parameters, and one that reads a parameter where
`tg.update_` cannot reach it."""

from __future__ import annotations

from typing import Any

from ._tree import describe_leaf


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


class UnreadParameterError(TypeError):
    """The loss reads a parameter where `tg.update_` cannot reach: refused by the update
    inside a compiled step (`_optim._check_read`), and by the gradient after an update
    outside one (`Params.stale_read`). A TypeError; `tg.train` adds the step."""


def unread_message(
    api: str, name: str, where: str, old: Any, stale: bool, other: bool = False
) -> str:
    """Why a loss reading a parameter outside the Params' containers never trains, and
    the ways out. `stale`: the gradient found it reading the array an update replaced;
    `other`: an update of another Params replaced it."""
    # A standalone array's name is its position in the Params: say so.
    label = f"parameter {name}" if name.isdigit() else f"parameter {name!r}"
    if other:
        what = (
            f"{api}: the loss reads, as {where}, an array ({describe_leaf(old)}) that an "
            f"earlier tg.update_ replaced, as the {label} of the Params it updated, only "
            "inside the containers that Params holds; a Params built again from the same "
            "variables starts from the old array at every step, so the loss would never train"
        )
    elif stale:
        what = (
            f"{api}: the loss reads, as {where}, the old array of the Params' {label} "
            f"({describe_leaf(old)}), which tg.update_ replaced only inside the containers "
            "the Params holds, so the loss would keep reading the old array and never train"
        )
    else:
        what = (
            f"{api}: the loss reads the Params' {label} ({describe_leaf(old)}) as {where}, "
            "not from the containers the Params holds, so the update would rebind it only "
            "inside the Params: the loss would keep reading the old array and never train"
        )
    local = (
        "(A local unpacked from the Params at each step, W, b = ps, reads the new arrays: "
        "that trains.)"
        if stale
        else "Inside a compiled step (tg.jit, tg.train), a local unpacked from the Params "
        "(W, b = ps) reads the same way: read ps[0] in the loss instead."
    )
    return (
        f"{what} (jax arrays are immutable; Flux's update! mutates them). Nothing was "
        "changed. Build the Params from what the loss reads: a model or dict the loss reads "
        "the parameter from (ps = tg.params(model), or p = {'W': W} read as p['W'] in the "
        f"loss), or read ps[0] in the loss. {local}"
    )


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
