"""Dense layers and the Chain container."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .._module import Module


def check_features(layer: Module, x: Any, expected: int, axis: int = -1) -> None:
    """Raise a clear error when `x` does not have `expected` features on `axis`."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) == 0 or shape[axis] != expected:
        raise ValueError(
            f"{layer!s}: expected input with {expected} features on axis {axis}, got shape {shape}."
        )


class Dense(Module):
    """A fully connected layer: `activation(x @ weight.T + bias)`.

    Arguments:
        in_features: size of the last axis of the input.
        out_features: size of the last axis of the output.
        activation: a function applied to the output (default: identity).
        key: a `jax.random` key for the Glorot-uniform initialisation of `weight`.
        use_bias: whether to add `bias` (zeros at initialisation).

    `weight` has shape `(out_features, in_features)`, `bias` `(out_features,)`,
    and `(..., in_features)` maps to `(..., out_features)`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> layer = nn.Dense(4, 8, jax.nn.relu, key=jax.random.key(0))
        >>> layer.weight.shape, layer(jnp.ones((2, 4))).shape
        ((8, 4), (2, 8))
    """

    __trainable__ = ("weight", "bias")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        activation: Callable[[Any], Any] | None = None,
        *,
        key: Any,
        use_bias: bool = True,
        dtype: Any = jnp.float32,
    ):
        init = jax.nn.initializers.glorot_uniform()
        self.weight = init(key, (out_features, in_features), dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.activation = activation
        self.in_features = in_features
        self.out_features = out_features

    def __call__(self, x: Any) -> Any:
        check_features(self, x, self.in_features)
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return y if self.activation is None else self.activation(y)

    def __str__(self) -> str:
        act = getattr(self.activation, "__name__", None)
        return f"Dense({self.in_features} => {self.out_features}{', ' + act if act else ''})"


class Chain(Module):
    """Layers applied in order; indexable (`chain[0]`) and sliceable (`chain[1:]`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> model = nn.Chain(nn.Dense(2, 4, jax.nn.relu, key=k1), nn.Dense(4, 1, key=k2))
        >>> model(jnp.ones((3, 2))).shape, len(model), type(model[1:]).__name__
        ((3, 1), 2, 'Chain')
    """

    def __init__(self, *layers: Any):
        self.layers = list(layers)

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return Chain(*self.layers[i])
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.layers)

    def __str__(self) -> str:
        return "Chain(" + ", ".join(str(layer) for layer in self.layers) + ")"
