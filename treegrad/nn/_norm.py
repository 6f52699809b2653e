"""Normalisation layers: LayerNorm and BatchNorm."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._module import Module
from ._basic import check_features, check_rate, check_size


class LayerNorm(Module):
    """Normalise over the last axis, then scale and shift.

    Arguments:
        features: size of the last axis.
        eps: added to the variance.
        affine: learn `scale` and `bias`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from treegrad import nn
        >>> y = nn.LayerNorm(4)(jnp.array([1.0, 2.0, 3.0, 4.0]))
        >>> round(float(jnp.mean(y)), 6), round(float(jnp.var(y)), 3)
        (0.0, 1.0)
    """

    __trainable__ = ("scale", "bias")

    def __init__(
        self, features: int, *, eps: float = 1e-5, affine: bool = True, dtype: Any = jnp.float32
    ):
        self.features = features = check_size("LayerNorm", "features", features)
        self.eps = eps
        self.scale = jnp.ones((features,), dtype) if affine else None
        self.bias = jnp.zeros((features,), dtype) if affine else None

    def __call__(self, x: Any) -> Any:
        check_features(self, x, self.features)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.var(x, axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        if self.scale is not None:
            y = y * self.scale + self.bias
        return y

    def __str__(self) -> str:
        return f"LayerNorm({self.features})"


# Batch statistics recorded by BatchNorm layers during `nn.with_batch_stats`.
_COLLECTOR: contextvars.ContextVar[dict[int, tuple[Any, Any]] | None] = contextvars.ContextVar(
    "treegrad_batchnorm_collector", default=None
)


class BatchNorm(Module):
    """Normalise each feature (last axis) over the batch and spatial axes.

    Arguments:
        features: size of the last axis.
        momentum: how far running statistics move towards each batch's.
        eps: added to the variance.
        training: start in training mode.

    In training mode (the default) it uses the statistics of the batch; in test
    mode (`nn.testmode(model)`) the running statistics. The running statistics
    are data, not trainable parameters (`__trainable__` excludes them), and are
    updated functionally by `nn.with_batch_stats`, so nothing is mutated while
    tracing.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> bn = nn.BatchNorm(3)
        >>> x = jax.random.normal(jax.random.key(0), (64, 3)) * 5 + 2
        >>> y, bn = nn.with_batch_stats(bn, bn, x)
        >>> bool(jnp.allclose(jnp.mean(y, axis=0), 0, atol=1e-5))
        True
        >>> bn.running_mean.shape
        (3,)
    """

    __trainable__ = ("scale", "bias")

    def __init__(
        self,
        features: int,
        *,
        momentum: float = 0.1,
        eps: float = 1e-5,
        training: bool = True,
        dtype: Any = jnp.float32,
    ):
        self.features = features = check_size("BatchNorm", "features", features)
        check_rate("BatchNorm:", "momentum", momentum, closed=True)
        self.momentum = momentum
        self.eps = eps
        self.training = training
        self.scale = jnp.ones((features,), dtype)
        self.bias = jnp.zeros((features,), dtype)
        self.running_mean = jnp.zeros((features,), dtype)
        self.running_var = jnp.ones((features,), dtype)

    def __call__(self, x: Any) -> Any:
        check_features(self, x, self.features)
        if self.training:
            axes = tuple(range(x.ndim - 1))
            mean = jnp.mean(x, axis=axes)
            var = jnp.var(x, axis=axes)
            collector = _COLLECTOR.get()
            if collector is not None:
                collector[id(self)] = (mean, var)
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale + self.bias

    def __str__(self) -> str:
        return f"BatchNorm({self.features})"


def with_batch_stats(model: Any, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """Run `fn(*args)` (a forward pass through `model`) and update running statistics.

    Pure, so it works inside `tg.jit` and in a loss function (return the new
    model as auxiliary output of `tg.withgradient`).

    Arguments:
        model: the model holding the BatchNorm layers.
        fn: the forward pass, e.g. `model` itself or `lambda x: model(x)`.
        *args: its arguments.

    Returns:
        `(output, new_model)`: `new_model` is `model` with each BatchNorm that
        ran in training mode moved towards its batch statistics by its
        `momentum`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from treegrad import nn
        >>> bn = nn.BatchNorm(2, momentum=0.5)
        >>> _, bn = nn.with_batch_stats(bn, bn, jnp.array([[1.0, 2.0], [3.0, 4.0]]))
        >>> bn.running_mean
        Array([1. , 1.5], dtype=float32)
    """
    if not callable(fn):
        raise TypeError(
            f"nn.with_batch_stats: fn must be a function (the forward pass, e.g. the model "
            f"itself), got a {type(fn).__name__}. The call is with_batch_stats(model, fn, *args)."
        )
    collected: dict[int, tuple[Any, Any]] = {}
    token = _COLLECTOR.set(collected)
    try:
        out = fn(*args)
    finally:
        _COLLECTOR.reset(token)

    def replace(node: Any) -> Any:
        if not (isinstance(node, BatchNorm) and id(node) in collected):
            return node
        mean, var = collected[id(node)]
        new = jax.tree_util.tree_map(lambda a: a, node)
        m = node.momentum
        new.running_mean = (1 - m) * node.running_mean + m * jax.lax.stop_gradient(mean)
        new.running_var = (1 - m) * node.running_var + m * jax.lax.stop_gradient(var)
        return new

    return out, jax.tree_util.tree_map(replace, model, is_leaf=lambda n: isinstance(n, BatchNorm))
