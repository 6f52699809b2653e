"""Small pytree helpers shared by the engine, the optimiser and the front ends."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_INEXACT: dict[Any, bool] = {}


def is_inexact(dtype: Any) -> bool:
    """Whether a dtype is floating or complex (memoised: jnp.issubdtype costs ~2us)."""
    try:
        return _INEXACT[dtype]
    except KeyError:
        r = _INEXACT[dtype] = bool(jnp.issubdtype(dtype, jnp.inexact))
        return r


def is_differentiable(x: Any) -> bool:
    """A differentiable leaf: a `jax.Array` of floating or complex dtype.

    Arguments:
        x: any pytree leaf.

    Returns:
        True for float and complex `jax.Array`s; False for integer, bool and
        key arrays, numpy arrays, Python numbers and everything else.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> tg.is_differentiable(jnp.ones(2)), tg.is_differentiable(jnp.arange(2))
        (True, False)
    """
    return isinstance(x, jax.Array) and is_inexact(x.dtype)


def path_str(path: tuple[Any, ...]) -> str:
    """A key path as a dotted string: `l1.weight`, `layers.0.bias`."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def describe_leaf(x: Any) -> str:
    if isinstance(x, (jax.Array, np.ndarray)):
        shape = "×".join(map(str, x.shape)) if x.shape else "scalar"
        return f"{x.dtype}[{shape}]" if x.shape else f"{x.dtype} scalar"
    return repr(x)


def is_none(x: Any) -> bool:
    return x is None


def first_difference(a: Any, b: Any) -> str | None:
    """Dotted path of the first place where two trees differ in structure."""
    pa = jax.tree_util.tree_flatten_with_path(a, is_leaf=is_none)[0]
    pb = jax.tree_util.tree_flatten_with_path(b, is_leaf=is_none)[0]
    for (ka, _), (kb, _) in zip(pa, pb, strict=False):
        if ka != kb:
            return path_str(ka) or "<root>"
    if len(pa) != len(pb):
        longer = pa if len(pa) > len(pb) else pb
        return path_str(longer[min(len(pa), len(pb))][0]) or "<root>"
    return None
