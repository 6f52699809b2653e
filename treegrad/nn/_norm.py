"""Normalisation layers: LayerNorm and BatchNorm."""

from __future__ import annotations

import contextvars
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._module import Module
from .._tree import tree_map_shared
from ._basic import check_features, check_float_dtype, check_rate, check_size


def _check_eps(layer: str, eps: Any) -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{layer}: eps must be a positive number, e.g. 1e-5, got {eps!r}.")
    if not (0.0 < float(eps) < math.inf):
        raise ValueError(
            f"{layer}: eps must be a positive number (it keeps the division by the standard "
            f"deviation finite), e.g. 1e-5, got {eps}."
        )


def _dtypes(x: Any, *params: Any) -> tuple[Any, Any]:
    """`(compute, output)` dtypes of a normalisation, as flax.linen computes them.

    The output dtype is the input's promoted with the parameters' (an integer
    input gives floats); the statistics are computed in at least float32: in
    bfloat16, on data of unit spread offset by 100, the rounded mean left an
    error of 0.23 in the output (flax, in float32: 2.5e-4).
    """
    out = jnp.result_type(x, *(p for p in params if p is not None))
    if not jnp.issubdtype(out, jnp.inexact):
        out = jnp.promote_types(out, jnp.float32)
    return jnp.promote_types(out, jnp.float32), out


def _normalise(x: Any, mean: Any, var: Any, eps: float, scale: Any, bias: Any, out: Any) -> Any:
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * scale + bias
    return y.astype(out)


class LayerNorm(Module):
    """Normalise over the last axis, then scale and shift.

    Arguments:
        features: size of the last axis.
        eps: added to the variance (a positive number).
        affine: learn `scale` and `bias`.
        dtype: a floating-point dtype for `scale` and `bias`.

    The statistics are computed in at least float32, bfloat16 inputs included,
    and the output has the input's dtype promoted with the parameters', as in
    flax.

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
        _check_eps("LayerNorm", eps)
        check_float_dtype("LayerNorm", dtype)
        self.eps = eps
        self.scale = jnp.ones((features,), dtype) if affine else None
        self.bias = jnp.zeros((features,), dtype) if affine else None

    def __call__(self, x: Any) -> Any:
        check_features(self, x, self.features)
        compute, out = _dtypes(x, self.scale, self.bias)
        x = jnp.asarray(x, compute)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.var(x, axis=-1, keepdims=True)
        return _normalise(x, mean, var, self.eps, self.scale, self.bias, out)

    def __str__(self) -> str:
        return f"LayerNorm({self.features})"


# Batch statistics recorded by BatchNorm layers during `nn.with_batch_stats`, one
# `(layer, mean, var)` per call in call order.
_COLLECTOR: contextvars.ContextVar[list[tuple[Any, Any, Any]] | None] = contextvars.ContextVar(
    "treegrad_batchnorm_collector", default=None
)


class BatchNorm(Module):
    """Normalise each feature (last axis) over the batch and spatial axes.

    Arguments:
        features: size of the last axis.
        momentum: how far running statistics move towards each batch's.
        eps: added to the variance (a positive number).
        training: start in training mode.
        dtype: a floating-point dtype for the parameters and running statistics.

    In training mode (the default) it uses the statistics of the batch, so the
    input needs a batch axis and more than one value per feature (one example
    is an error, as in PyTorch: normalised by itself it would give `bias`); in
    test mode (`nn.testmode(model)`) the running statistics. Statistics are
    computed in at least float32 (bfloat16 inputs included), as flax does. An
    empty batch gives an empty output and leaves the running statistics
    unchanged. The running statistics
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
        _check_eps("BatchNorm", eps)
        check_float_dtype("BatchNorm", dtype)
        self.momentum = momentum
        self.eps = eps
        self.training = training
        self.scale = jnp.ones((features,), dtype)
        self.bias = jnp.zeros((features,), dtype)
        self.running_mean = jnp.zeros((features,), dtype)
        self.running_var = jnp.ones((features,), dtype)

    def __call__(self, x: Any) -> Any:
        check_features(self, x, self.features)
        compute, out = _dtypes(x, self.scale, self.bias)
        x = jnp.asarray(x, compute)
        if not self.training:
            mean, var = self.running_mean, self.running_var
            return _normalise(x, mean, var, self.eps, self.scale, self.bias, out)
        shape = x.shape
        if len(shape) < 2:
            raise ValueError(
                f"{self} is in training mode and normalises over the batch, but got one example "
                f"of shape {shape}, without a batch axis (under jax.vmap each call sees one): "
                f"give a batch of shape (batch, ..., {self.features}), or use the running "
                "statistics with nn.testmode(model)."
            )
        n = math.prod(shape[:-1])
        if n == 1:
            raise ValueError(
                f"{self} is in training mode and needs more than one value per feature to "
                f"normalise over, got shape {shape} (one value normalised by itself gives the "
                "bias): give a larger batch, or use the running statistics with "
                "nn.testmode(model)."
            )
        axes = tuple(range(len(shape) - 1))
        mean = jnp.mean(x, axis=axes)
        var = jnp.var(x, axis=axes)
        collector = _COLLECTOR.get()
        if collector is not None and n > 0:  # an empty batch has no statistics
            collector.append((self, mean, var))
        return _normalise(x, mean, var, self.eps, self.scale, self.bias, out)

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
        `momentum`, once per call in call order (a layer run twice steps
        twice, as in flax and PyTorch). A layer held at several places stays
        one object in `new_model`.

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
    calls: list[tuple[Any, Any, Any]] = []
    token = _COLLECTOR.set(calls)
    try:
        out = fn(*args)
    finally:
        _COLLECTOR.reset(token)
    # Keyed by the running-statistics array (held with it, so its id stays its own):
    # a layer found at two places in `model` is one object and steps once per call.
    new: dict[int, tuple[Any, Any]] = {}
    for layer, mean, var in calls:
        m = layer.momentum
        for old, stat in ((layer.running_mean, mean), (layer.running_var, var)):
            current = new.get(id(old), (old, old))[1]
            step = (1 - m) * current + m * jax.lax.stop_gradient(stat)
            new[id(old)] = (old, step.astype(jnp.result_type(old)))
    return out, tree_map_shared(lambda leaf: new[id(leaf)][1] if id(leaf) in new else leaf, model)
